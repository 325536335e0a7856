"""Helpers of the engine tests: small configs, serving a list of requests, recording what the
model was asked to compute, and a connector whose reads wait at a gate the test opens."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from typing import Any

from kvplugin.config import validate
from kvplugin.connectors.base import Connector, ConnectorStats, Health, PutItem
from kvplugin.connectors.keys import ObjectKey
from kvplugin.engine.build import Deployment
from kvplugin.engine.config import RunConfig
from kvplugin.engine.model import Work
from kvplugin.engine.scheduler import Engine, Result
from kvplugin.serde import Block


def small_config(*, blocks: int = 64, block_size: int = 4, budget: int = 64, seqs: int = 8,
                 disk: bool = False, **sections: dict[str, Any]) -> RunConfig:
    """A tiny deployment: memory tier (and a temporary disk tier), no simulated time, in
    real time (``engine.deterministic`` off: the tests that need it turn it on)."""
    doc: dict[str, Any] = {
        "layout": {"block_size": block_size, "num_blocks": blocks, "max_model_len": 2048},
        "model": {"num_layers": 2, "num_kv_heads": 1, "head_size": 8},
        "offload": {"chunk_size": block_size, "max_local_cpu_size": 0.01,
                    "local_disk": "temp://" if disk else None},
        # Real time: these tests hold I/O at gates while the engine steps on.
        "engine": {"prefill_token_ms": 0.0, "decode_step_ms": 0.0, "deterministic": False},
        "limits": {"max_num_batched_tokens": budget, "max_num_seqs": seqs},
        "workload": {"num_requests": 8},
    }
    for name, values in sections.items():
        doc.setdefault(name, {}).update(values)
    return validate(doc, "test", schema=RunConfig)


Req = tuple[str, Sequence[int], str, int]  # id, prompt, tenant, max_tokens


def conversations(n: int, seed: int) -> list[Req]:
    """``n`` requests of tenant t0: one shared 16-token system prompt, then 8-39 tokens each."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 500) for _ in range(16)]
    out: list[Req] = []
    for i in range(n):
        user = [rng.randrange(1, 500) for _ in range(rng.randrange(8, 40))]
        out.append((f"r{i}", system + user, "t0", 4))
    return out


async def serve_all(engine: Engine, reqs: Sequence[Req]) -> dict[str, Result]:
    """Run the engine until every request of ``reqs`` (submitted at once) has finished."""
    runner = asyncio.get_running_loop().create_task(engine.run())
    try:
        futs = [engine.add_request(rid, p, tenant=t, max_tokens=m) for rid, p, t, m in reqs]
        results = await asyncio.wait_for(asyncio.gather(*futs), 30)
    finally:
        engine.stop()
        await asyncio.wait_for(runner, 30)
    return {r.request_id: r for r in results}


def record_steps(dep: Deployment) -> list[list[Work]]:
    """Every step's work from now on (the model's ``execute`` is wrapped)."""
    steps: list[list[Work]] = []
    inner = dep.model.execute

    async def execute(work: Sequence[Work], **kwargs: Any) -> list[int | None]:
        steps.append(list(work))
        return await inner(work, **kwargs)

    dep.model.execute = execute  # type: ignore[method-assign]
    return steps


def free_blocks(dep: Deployment) -> int:
    return dep.mgr.core.block_pool.get_num_free_blocks()


def all_blocks(dep: Deployment) -> int:
    return dep.mgr.core.block_pool.num_gpu_blocks - 1


class GatedReads(Connector):
    """Delegates to ``inner``; ``get`` waits while the gate is closed."""

    def __init__(self, inner: Connector) -> None:
        self.inner = inner
        self.name = inner.name  # it stands in for the tier, under its name
        self.capabilities = inner.capabilities
        self.gate = asyncio.Event()
        self.gate.set()
        self.gets = 0

    @property
    def codec(self) -> Any:
        return self.inner.codec

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        return await self.inner.lookup(keys, timeout=timeout)

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        self.gets += 1
        await self.gate.wait()
        return await self.inner.get(keys, timeout=timeout)

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        return await self.inner.put(items, timeout=timeout)

    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        return await self.inner.delete(keys, timeout=timeout)

    async def health(self, *, timeout: float) -> Health:
        return await self.inner.health(timeout=timeout)

    def stats(self) -> ConnectorStats:
        return self.inner.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()
