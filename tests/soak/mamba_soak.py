"""A soak of the async manager on a full attention + Mamba ("align") layout.

The reference engine does not serve Mamba layouts yet (``engine_supports`` refuses them:
its fake model writes attention pages only), so this drives :class:`AsyncKVManager`
directly: a few workers serve the engine's workload (tenants sharing system prompts,
follow-ups resending the history, resends) through lookup → allocate → load → steps →
finish, on the same faulty memory → disk → Redis stack the engine soak uses (built by the
engine's own ``build_connector`` and ``fault_wrapper``). The model is the async-layer tests'
fake one: every step first compares what it reads (the attended KV, the Mamba state it
resumes from) with recomputation; here a difference is counted instead of raised, and
checked against the other tenants' bytes (a cross-tenant hit).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from aio_testlib import FakeModel, make_hybrid

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import Admission
from kvplugin.config import FaultsConfig, OffloadConfigSection
from kvplugin.connectors.faults import FaultInjector
from kvplugin.core.request import Request, RequestStatus
from kvplugin.engine.build import build_connector, fault_wrapper
from kvplugin.engine.config import WorkloadConfig
from kvplugin.engine.workload import Finished, RequestSpec, build_prompt, generate

ROOM_WAIT_S = 0.001  # how long a worker waits before asking again for blocks


class CheckedModel(FakeModel):
    """The fake model, counting what it finds wrong instead of raising."""

    def __init__(self, mgr: AsyncKVManager, tenants: Sequence[str]) -> None:
        super().__init__(mgr)
        self.tenants = tuple(tenants)
        self.kv_mismatches = 0
        self.cross_tenant_hits = 0
        self.hit_tokens_checked = 0  # hit tokens (device or loaded) a step read back

    def checked_step(self, req: Request, n: int) -> bool:
        """One step; False when what it read differs from recomputation."""
        try:
            self.step(req, n)
        except AssertionError:
            self.kv_mismatches += 1
            self.cross_tenant_hits += self._foreign_pages(req)
            return False
        return True

    def _foreign_pages(self, req: Request) -> int:
        """Pages (and the state) below the request's computed tokens holding exactly what
        another tenant's request would have computed for these tokens."""
        upto, tokens = req.num_computed_tokens, req.all_token_ids
        others = [t for t in self.tenants if t != self.mgr.tenant_of(req)]
        found = 0
        for g, ids in enumerate(self.mgr.core.get_block_ids(req.request_id)):
            bs = self.mgr.memory.shapes[g].block_size
            if self.mgr.memory.shapes[g].kind == "state":
                if upto:
                    row = self._row(g, ids[-(upto // -bs) - 1])
                    found += any(row == self._state_bytes(
                        g, self._digests(t, g, tokens[:upto])[upto]) for t in others)
                continue
            for i in range(upto // bs):
                if ids[i]:
                    row = self._row(g, ids[i])
                    found += any(row == self.expected_page(t, g, tokens, i) for t in others)
        return found


@dataclass(slots=True)
class MambaFigures:
    requests: int = 0
    finished: int = 0
    kv_mismatches: int = 0
    cross_tenant_hits: int = 0
    hit_tokens_checked: int = 0
    leaked_blocks: int = 0
    held_blocks: int = 0
    pending_jobs: int = 0
    store_bytes_in_flight: int = 0
    loads: int = 0
    load_failures: int = 0
    loaded_states: int = 0
    stored_states: int = 0
    stored_chunks: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    faults_injected: dict[str, int] = field(default_factory=dict)
    redis_stored: int = 0


def workload(requests: int, seed: int, tenants: int) -> WorkloadConfig:
    # No LoRA: the async-layer fake model's KV depends on the tenant and the tokens only.
    return WorkloadConfig(num_requests=requests, seed=seed, num_tenants=tenants,
                          system_prompt_len=(8, 40), user_len=(4, 20), output_len=(1, 4),
                          document_len=(12, 40), lora_prob=0.0)


def mamba_manager(redis_url: str, disk_root: str, seed: int, fault_rate: float,
                  injectors: list[FaultInjector]) -> AsyncKVManager:
    off = OffloadConfigSection(chunk_size=4, max_local_cpu_size=0.0015, local_disk=disk_root,
                               max_local_disk_size=0.004, remote_url=redis_url)
    faults = FaultsConfig(rate=fault_rate, seed=seed, latency_ms=80.0)
    conn = build_connector(off, disk_root, fault_wrapper(faults, injectors))
    return make_hybrid("mamba", num_blocks=256, connector=conn, lookup_timeout=0.05,
                       load_timeout=2.0)


class MambaSoak:
    """``workers`` requests in flight at once, served in arrival order."""

    def __init__(self, mgr: AsyncKVManager, specs: Sequence[RequestSpec], tenants: int,
                 marks: Any, workers: int = 4) -> None:
        self.mgr = mgr
        self.specs = specs
        self.model = CheckedModel(mgr, [f"tenant{i}" for i in range(tenants)])
        self.marks = marks  # the harness's Milestones
        self.workers = workers
        self.finished = 0
        self._done: dict[str, Finished] = {}
        self._ended = {s.request_id: asyncio.Event() for s in specs}

    async def run(self) -> None:
        queue: asyncio.Queue[RequestSpec] = asyncio.Queue()
        for s in self.specs:
            queue.put_nowait(s)
        async with asyncio.TaskGroup() as tg:
            for _ in range(self.workers):
                tg.create_task(self._worker(queue))
        await self.mgr.drain()

    async def _worker(self, queue: asyncio.Queue[RequestSpec]) -> None:
        while not queue.empty():
            spec = queue.get_nowait()
            if spec.after is not None:  # taken earlier by another worker: it ends
                await self._ended[spec.after].wait()
            await self._serve(spec, build_prompt(spec, self._done))
            self.finished += 1
            self.marks.reached(self.finished)
            self._ended[spec.request_id].set()

    async def _serve(self, spec: RequestSpec, prompt: list[int]) -> None:
        req = self.mgr.new_request(spec.request_id, prompt, tenant=spec.tenant,
                                   cache_salt=spec.cache_salt)
        ok = True
        try:
            step = await self._admit(req)
            self.model.hit_tokens_checked += req.num_computed_tokens
            req.status = RequestStatus.RUNNING
            while ok:
                ok = self.model.checked_step(req, step.num_new_tokens)
                self.mgr.after_step([req])
                await asyncio.sleep(0)  # the GPU's time: stores and other workers run
                if req.num_output_tokens >= spec.max_tokens:
                    break
                step = await self._grow(req)
        finally:
            req.status = RequestStatus.FINISHED_STOPPED if ok else RequestStatus.FINISHED_ERROR
            self.mgr.finish(req)
        output = tuple(req.all_token_ids[len(prompt):])
        self._done[spec.request_id] = Finished(tuple(prompt), output)

    async def _admit(self, req: Request) -> Admission:
        """Lookup and admission until the request holds blocks and has tokens to compute:
        a load that kept nothing sends it back to a fresh lookup (of the device only)."""
        while True:
            found = await self.mgr.lookup(req)
            adm = self.mgr.allocate(req, found)
            if adm is None:
                await asyncio.sleep(ROOM_WAIT_S)
                continue
            if not adm.loading:
                return adm
            outcome = await self.mgr.wait_load(req)
            if outcome.num_computed_tokens:
                return await self._grow(req)

    async def _grow(self, req: Request) -> Admission:
        while (adm := self.mgr.allocate(req)) is None:
            await asyncio.sleep(ROOM_WAIT_S)
        return adm

    def figures(self, injectors: Sequence[FaultInjector]) -> MambaFigures:
        mgr, ms, model = self.mgr, self.mgr.stats(), self.model
        pool = mgr.core.block_pool
        out = MambaFigures(
            requests=len(self.specs), finished=self.finished, kv_mismatches=model.kv_mismatches,
            cross_tenant_hits=model.cross_tenant_hits,
            hit_tokens_checked=model.hit_tokens_checked,
            leaked_blocks=pool.num_gpu_blocks - 1 - pool.get_num_free_blocks(),
            held_blocks=mgr.num_held_blocks, pending_jobs=mgr.num_pending_jobs,
            store_bytes_in_flight=mgr.store_bytes_in_flight, loads=ms.loads,
            load_failures=ms.loads_failed + ms.loads_cancelled, loaded_states=ms.loaded_states,
            stored_states=ms.stored_states, stored_chunks=ms.stored_chunks,
            hit_tokens_by_tier=dict(ms.hit_tokens_by_tier))
        for inj in injectors:
            for k in ("errors", "delays", "dropped", "corrupted"):
                out.faults_injected[k] = out.faults_injected.get(k, 0) + getattr(inj.injected, k)
            if inj.capabilities.tier == "redis":
                out.redis_stored = inj.stats().stored
        return out


def specs_for(requests: int, seed: int, tenants: int, max_prompt_len: int) -> list[RequestSpec]:
    return generate(workload(requests, seed, tenants), max_prompt_len=max_prompt_len)
