"""Helpers of the async-layer tests: a small layout, a fake model that writes deterministic
KV into host memory, and an engine loop that serves one request through the manager."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import Admission, OffloadConfig
from kvplugin.connectors.base import Connector, ConnectorStats, Health, PutItem
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.request import Request, RequestStatus
from kvplugin.core.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowSpec,
    resolve_kv_cache_block_sizes,
)
from kvplugin.serde import Block

BS = 4
MIB = 1 << 20


def layout(num_blocks: int, block_sizes: Sequence[int] = (BS,)) -> KVCacheConfig:
    """Full-attention groups of two layers each; head counts differ so specs differ."""
    groups = [KVCacheGroupSpec([f"g{i}.l0", f"g{i}.l1"],
                               FullAttentionSpec(block_size=bs, num_kv_heads=2 + i,
                                                 head_size=4, dtype="float16"))
              for i, bs in enumerate(block_sizes)]
    return KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=groups)


def make_manager(*, num_blocks: int = 32, block_sizes: Sequence[int] = (BS,),
                 connector: Connector | None = None, **config: Any) -> AsyncKVManager:
    kv = layout(num_blocks, block_sizes)
    sbs, hbs = resolve_kv_cache_block_sizes(kv, min(block_sizes))
    core = KVCacheManager(kv, max_model_len=1024, scheduler_block_size=sbs,
                          hash_block_size=hbs, log_stats=True)
    conn = connector if connector is not None else MemoryConnector(capacity_bytes=16 * MIB)
    return AsyncKVManager(core, conn, OffloadConfig(model="org/tiny-model", **config))


def make_hybrid(other: str, *, num_blocks: int = 64, block_size: int = BS,
                other_block_size: int | None = None, window: int = 8,
                prefix_match_unit: int | None = None, connector: Connector | None = None,
                **config: Any) -> AsyncKVManager:
    """Full attention + a sliding window (``"window"``) or a Mamba "align" group
    (``"mamba"``; its states mix dtypes, as real ones do)."""
    full = KVCacheGroupSpec(["f.l0", "f.l1"], FullAttentionSpec(
        block_size=block_size, num_kv_heads=2, head_size=4, dtype="float16"))
    obs = other_block_size or block_size
    if other == "window":
        spec: Any = SlidingWindowSpec(block_size=obs, num_kv_heads=3, head_size=4,
                                      dtype="float16", sliding_window=window)
    else:
        spec = MambaSpec(block_size=obs, shapes=((2, 3), (5,)), dtypes=("float32", "float16"),
                         mamba_cache_mode="align")
    kv = KVCacheConfig(num_blocks=num_blocks, kv_cache_groups=[
        full, KVCacheGroupSpec(["o.l0", "o.l1"], spec)])
    sbs, hbs = resolve_kv_cache_block_sizes(kv, block_size, prefix_match_unit=prefix_match_unit)
    core = KVCacheManager(kv, max_model_len=1024, scheduler_block_size=sbs,
                          hash_block_size=hbs, log_stats=True)
    conn = connector if connector is not None else MemoryConnector(capacity_bytes=16 * MIB)
    return AsyncKVManager(core, conn, OffloadConfig(model="org/tiny-hybrid", **config))


def clean(mgr: AsyncKVManager) -> None:
    """No leaked or held block, no job, no store bytes in flight."""
    assert free_blocks(mgr) == all_blocks(mgr)
    assert mgr.num_pending_jobs == 0 and mgr.num_held_blocks == 0
    assert mgr.store_bytes_in_flight == 0


def free_blocks(mgr: AsyncKVManager) -> int:
    return mgr.core.block_pool.get_num_free_blocks()


def all_blocks(mgr: AsyncKVManager) -> int:
    return mgr.core.block_pool.num_gpu_blocks - 1


class FakeModel:
    """Token t's KV slot holds bytes derived from (tenant, group, tokens[:t + 1]), and a
    Mamba group's state at t tokens bytes derived from (tenant, group, tokens[:t]): what a
    recomputation writes again. A load must bring back exactly these bytes, and every step
    first checks what it reads (the attended KV, the state it resumes from) is exactly that.
    """

    def __init__(self, mgr: AsyncKVManager) -> None:
        self.mgr = mgr
        self.steps = 0

    @staticmethod
    def _digests(tenant: str, group: int, tokens: Sequence[int]) -> list[bytes]:
        """Digest of every prefix: ``out[i]`` covers ``tokens[:i]``."""
        d = hashlib.blake2b(f"{tenant}/{group}".encode(), digest_size=16).digest()
        out = [d]
        for t in tokens:
            d = hashlib.blake2b(d + t.to_bytes(8, "little"), digest_size=16).digest()
            out.append(d)
        return out

    @staticmethod
    def _expand(digest: bytes, size: int) -> bytes:
        return (digest * (size // 16 + 1))[:size]

    def _slot_bytes(self, group: int, digest: bytes) -> bytes:
        shape = self.mgr.memory.shapes[group]
        return self._expand(digest, shape.page_bytes // shape.block_size)

    def _state_bytes(self, group: int, digest: bytes) -> bytes:
        state = hashlib.blake2b(b"state" + digest, digest_size=16).digest()
        return self._expand(state, self.mgr.memory.page_bytes(group))

    def token_kv(self, tenant: str, group: int, tokens: Sequence[int]) -> np.ndarray[Any, Any]:
        shape = self.mgr.memory.shapes[group]
        raw = self._slot_bytes(group, self._digests(tenant, group, tokens)[-1])
        return np.frombuffer(raw, dtype=np.uint8).reshape(2, shape.dims[1], -1)

    def _slots(self, group: int, block_id: int) -> np.ndarray[Any, Any]:
        shape = self.mgr.memory.shapes[group]
        row: np.ndarray[Any, Any] = self.mgr.memory.pages(group, [block_id])[0]
        return row.reshape(2, shape.dims[1], shape.block_size, -1)

    def _row(self, group: int, block_id: int) -> bytes:
        return self.mgr.memory.pages(group, [block_id]).tobytes()

    def step(self, req: Request, n: int) -> None:
        """Compute tokens [num_computed, num_computed + n): check the inputs, write their
        KV and the state at the chunk's end, sample a token when the prompt is done (vLLM's
        order)."""
        tenant = self.mgr.tenant_of(req)
        start = req.num_computed_tokens
        end = start + n
        table = self.mgr.core.get_block_ids(req.request_id)
        for g, ids in enumerate(table):
            shape = self.mgr.memory.shapes[g]
            bs = shape.block_size
            dig = self._digests(tenant, g, req.all_token_ids[:end])
            if shape.kind == "state":
                if start:
                    got = self._row(g, ids[-(start // -bs) - 1])
                    assert got == self._state_bytes(g, dig[start]), ("state", g, start)
                state = self._state_bytes(g, dig[end])
                self.mgr.memory.copy_in(g, [ids[-(end // -bs) - 1]], state)
                continue
            lo = 0 if shape.kind == "full" else max(0, start - shape.window_tokens)
            for t in range(lo, start):  # what token `start` attends to
                got = self._slots(g, ids[t // bs])[:, :, t % bs, :].tobytes()
                assert got == self._slot_bytes(g, dig[t + 1]), ("kv", g, t)
            for t in range(start, end):
                raw = np.frombuffer(self._slot_bytes(g, dig[t + 1]), dtype=np.uint8)
                self._slots(g, ids[t // bs])[:, :, t % bs, :] = raw.reshape(2, shape.dims[1], -1)
        req.num_computed_tokens = end
        if req.num_computed_tokens >= req.num_tokens:
            req.append_output_token_ids(7000 + self.steps % 97)
        self.steps += 1

    def expected_page(self, tenant: str, group: int, tokens: Sequence[int],
                      index: int) -> bytes:
        bs = self.mgr.memory.shapes[group].block_size
        dig = self._digests(tenant, group, tokens[:(index + 1) * bs])
        page = np.zeros((bs, self.mgr.memory.page_bytes(group) // bs), dtype=np.uint8)
        for slot in range(bs):
            page[slot] = np.frombuffer(self._slot_bytes(group, dig[index * bs + slot + 1]),
                                       dtype=np.uint8)
        shape = self.mgr.memory.shapes[group]
        # Slot-major bytes -> the page layout (K/V, layer, slot, head, dim).
        return page.reshape(bs, 2, shape.dims[1], -1).transpose(1, 2, 0, 3).tobytes()

    def check_pages(self, req: Request, upto: int) -> int:
        """Assert the request's attention blocks below token ``upto`` hold exactly the
        recomputed bytes (null positions of a window group skipped); returns how many
        pages were compared."""
        tenant = self.mgr.tenant_of(req)
        n = 0
        for g, ids in enumerate(self.mgr.core.get_block_ids(req.request_id)):
            shape = self.mgr.memory.shapes[g]
            if shape.kind == "state":
                continue
            for i in range(upto // shape.block_size):
                if ids[i] == 0:
                    assert shape.kind == "window", (g, i)
                    continue
                got = self._row(g, ids[i])
                assert got == self.expected_page(tenant, g, req.all_token_ids, i), (g, i)
                n += 1
        return n

    def check_state(self, req: Request, boundary: int) -> int:
        """Assert every state group's slot for ``boundary`` holds the recomputed state."""
        tenant = self.mgr.tenant_of(req)
        n = 0
        for g, ids in enumerate(self.mgr.core.get_block_ids(req.request_id)):
            shape = self.mgr.memory.shapes[g]
            if shape.kind != "state":
                continue
            dig = self._digests(tenant, g, req.all_token_ids[:boundary])
            assert self._row(g, ids[-(boundary // -shape.block_size) - 1]) \
                == self._state_bytes(g, dig[boundary]), (g, boundary)
            n += 1
        return n


async def admit(mgr: AsyncKVManager, req: Request,
                budget: int | None = None) -> tuple[Admission, Admission]:
    """Lookup + allocate (+ the load and the first real allocation when it loads).
    Returns (the admission, the allocation that scheduled tokens)."""
    found = await mgr.lookup(req)
    adm = mgr.allocate(req, found, num_new_tokens=budget)
    assert adm is not None, "no room"
    step = adm
    if adm.loading:
        assert req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        await mgr.wait_load(req)
        nxt = mgr.allocate(req, num_new_tokens=budget)
        assert nxt is not None, "no room after the load"
        step = nxt
    req.status = RequestStatus.RUNNING
    return adm, step


async def serve(mgr: AsyncKVManager, model: FakeModel, req: Request, *,
                outputs: int = 2, budget: int | None = None, finish: bool = True
                ) -> Admission:
    """Run a request through prefill (in ``budget``-token chunks) and ``outputs`` decode
    tokens, handing off after every step, then finish it."""
    adm, step = await admit(mgr, req, budget)
    model.step(req, step.num_new_tokens)
    mgr.after_step([req])
    while req.num_output_tokens < outputs:
        nxt = mgr.allocate(req, num_new_tokens=budget)
        assert nxt is not None, "no room"
        model.step(req, nxt.num_new_tokens)
        mgr.after_step([req])
    if finish:
        req.status = RequestStatus.FINISHED_STOPPED
        mgr.finish(req)
    return adm


def proceed(mgr: AsyncKVManager, model: FakeModel, req: Request, outputs: int = 2) -> None:
    """Carry an admitted request on (after its load) until it has ``outputs`` tokens."""
    req.status = RequestStatus.RUNNING
    while req.num_output_tokens < outputs:
        nxt = mgr.allocate(req)
        assert nxt is not None, "no room"
        model.step(req, nxt.num_new_tokens)
        mgr.after_step([req])


def evict_device_cache(mgr: AsyncKVManager) -> None:
    """Drop every cached block from the device pool (all blocks must be free)."""
    assert mgr.core.reset_prefix_cache(), "blocks still in use"


class Gated(Connector):
    """Delegates to ``inner``; each operation can be held at a gate the test opens, so a
    test decides exactly where a job is suspended."""

    def __init__(self, inner: Connector) -> None:
        self.inner = inner
        self.name = inner.name  # it stands in for the tier, under its name
        self.capabilities = inner.capabilities
        self.gates = {op: asyncio.Event() for op in ("lookup", "get", "put")}
        self.entered = {op: asyncio.Event() for op in self.gates}
        self.calls = dict.fromkeys(self.gates, 0)
        for gate in self.gates.values():
            gate.set()

    def hold(self, op: str) -> None:
        self.gates[op].clear()
        self.entered[op].clear()

    def open(self, op: str) -> None:
        self.gates[op].set()

    async def _pass(self, op: str) -> None:
        self.calls[op] += 1
        self.entered[op].set()
        await self.gates[op].wait()

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        await self._pass("lookup")
        return await self.inner.lookup(keys, timeout=timeout)

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        await self._pass("get")
        return await self.inner.get(keys, timeout=timeout)

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        await self._pass("put")
        return await self.inner.put(items, timeout=timeout)

    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        return await self.inner.delete(keys, timeout=timeout)

    async def health(self, *, timeout: float) -> Health:
        return await self.inner.health(timeout=timeout)

    def stats(self) -> ConnectorStats:
        return self.inner.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()


def job_task(kind: str, request_id: str) -> asyncio.Task[Any]:
    """The running task of a request's load or store job (tasks are named by the manager)."""
    found = [t for t in asyncio.all_tasks() if t.get_name() == f"kv-{kind}-{request_id}"]
    assert len(found) == 1, found
    return found[0]


async def load_window_of_40(mgr: AsyncKVManager, model: FakeModel,
                            prompt: Sequence[int]) -> Request:
    """A request extending the stored 40-token ``prompt`` over a full group and an
    8-token window group (blocks of 4), its device cache evicted: the whole prefix is
    claimed from the tier, the full group's 10 blocks and only the window's last 2 loaded
    (checked against the model), the blocks before the window left null."""
    b = mgr.new_request("b", [*prompt, 1, 2, 3], tenant="acme")
    found = await mgr.lookup(b)
    assert (found.local_tokens, found.external_tokens) == (0, 40)
    adm = mgr.allocate(b, found)
    assert adm is not None and adm.loading
    await mgr.wait_load(b)
    full, window = mgr.core.get_block_ids("b")
    # The window before token 40 (7 tokens) lies in blocks 8 and 9; the rest is null.
    assert len(full) == 10 and 0 not in full
    assert window[:8] == [0] * 8 and 0 not in window[8:10]
    assert model.check_pages(b, 40) == 10 + 2
    assert mgr.stats().loaded_chunks == 10 + 2
    return b
