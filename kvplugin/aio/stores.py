"""The store side of the async manager: it offers the offload ledger
(:mod:`kvplugin.aio.offload_ledger`) what each request completed and runs the plans the
ledger returns as store jobs; lazy copy-outs; blocks held for jobs after a request let go.

Each step a request offers the attention chunks it completed and the Mamba states the core
handed over (``take_boundary_state_offloads``, ``finalize_partial_tail_offloads`` at
finish). Both go out as ONE store job, chunks first and states last: a state at N is a
checkpoint only together with every attention chunk before N, so a state whose chunks
could not all be stored (shed over budget, already released, failed) is not stored at all,
and a lookup counts a boundary only when every group's objects are present.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvplugin.aio import plans
from kvplugin.aio.jobs import (
    IOGate,
    JobEnd,
    LoadJob,
    PendingCopy,
    RunningJobs,
    StoreJob,
    run_store,
)
from kvplugin.aio.jobs import start as start_job
from kvplugin.aio.keys import KeySpace
from kvplugin.aio.memory import HostKVMemory
from kvplugin.aio.objects import ObjectSpec, PageLike, chunk_spec, state_spec
from kvplugin.aio.offload_ledger import OffloadLedger, StoreObject, StorePlan, StoreResult
from kvplugin.aio.plans import StateOffer
from kvplugin.aio.reqstate import ReqState
from kvplugin.aio.tier_events import TierEventView, describe_chunk, describe_state
from kvplugin.aio.values import LatencyRecorder, OffloadConfig, OffloadStats, StoreMode
from kvplugin.connectors.base import Connector, PutItem
from kvplugin.core.blocks import KVCacheBlock
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.view import ReuseWatch
from kvplugin.serde import Block

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["CopyWatch", "Holds", "JobContext", "Stores"]

logger = logging.getLogger(__name__)

Job = LoadJob | StoreJob


@dataclass(eq=False, slots=True)
class _Held:
    blocks: list[KVCacheBlock]
    jobs: set[Job]


class Holds:
    """Blocks a finished or preempted request left behind until ``jobs`` end (a load that
    may still write them, stores that read them in place): vLLM's delayed free."""

    def __init__(self, core: KVCacheManager) -> None:
        self._core = core
        self._held: list[_Held] = []

    @property
    def num_blocks(self) -> int:
        return sum(len(h.blocks) for h in self._held)

    def hold(self, blocks: list[KVCacheBlock], jobs: set[Job]) -> None:
        self._held.append(_Held(blocks, set(jobs)))

    def job_ended(self, job: Job) -> None:
        for held in [h for h in self._held if job in h.jobs]:
            held.jobs.discard(job)
            if not held.jobs:
                self._held.remove(held)
                self._core.free_popped_blocks(held.blocks)


class CopyWatch:
    """Copies a store's chunks out of host memory *after* the step that handed them over,
    in the store job's first step (while the engine's next step runs), instead of on the
    step path. The blocks are not pinned meanwhile (so the core hands out exactly the
    blocks it would without offload): the core's reuse hook copies a chunk at once if one
    of its blocks is handed out before the job ran, before its new owner can write it. A
    completed block's KV never changes in place (Mamba states do: they are copied at
    hand-off), so a lazy copy reads what the step wrote."""

    def __init__(self, core: KVCacheManager, memory: HostKVMemory,
                 stats: OffloadStats) -> None:
        self._view = core.offload_view()
        self._memory = memory
        self._stats = stats
        # One reuse watch per pending copy: its own, so discarding it ends only its
        # interest (another subscriber's watch on the same blocks stays).
        self._watches: dict[PendingCopy, ReuseWatch] = {}

    def add(self, pc: PendingCopy) -> None:
        ids = [b for _, _, block_ids in pc.copies for b in block_ids]
        self._watches[pc] = self._view.watch_reuse(ids, lambda _block: self._reused(pc))

    def _reused(self, pc: PendingCopy) -> None:
        if not pc.done:
            self._stats.copies_on_reuse += 1
            self.run(pc)

    def run(self, pc: PendingCopy) -> None:
        """Every copy left, now (a block is about to be reused)."""
        while not pc.done and pc.copied < len(pc.copies):
            self._copy_next(pc)
        self.discard(pc)

    async def run_sliced(self, pc: PendingCopy) -> None:
        """Every copy left, one chunk per loop callback: a big job's copy-out must not
        hold the loop (and the engine's next wake-up) for milliseconds at a stretch."""
        while not pc.done and pc.copied < len(pc.copies):
            if pc.copied:
                await asyncio.sleep(0)
                if pc.done:  # the reuse hook ran the rest meanwhile
                    return
            self._copy_next(pc)
        self.discard(pc)

    def _copy_next(self, pc: PendingCopy) -> None:
        i, group, ids = pc.copies[pc.copied]
        key, blk = pc.items[i]
        data = self._memory.copy_out_bytes(group, ids)
        pc.items[i] = (key, Block(blk.meta, cast("Buffer", data)))
        pc.copied += 1

    def discard(self, pc: PendingCopy) -> None:
        """Done with (copied, or its job ended first): the hook forgets it."""
        pc.done = True
        watch = self._watches.pop(pc, None)
        if watch is not None:
            watch.cancel()


@dataclass(frozen=True, slots=True, kw_only=True)
class JobContext:
    """What the load side and the store side of one manager share: the core, the
    connector (its tier names, fastest first), the host memory, the I/O gate, the
    manager's job and hold bookkeeping, its latency histograms, and (tier events on) the
    view that learns what each stored object stands for."""

    core: KVCacheManager
    connector: Connector
    tiers: tuple[str, ...]
    config: OffloadConfig
    memory: HostKVMemory
    layout: plans.Layout
    keyspace: KeySpace
    gate: IOGate
    stats: OffloadStats
    jobs: RunningJobs
    holds: Holds
    latency: LatencyRecorder
    ledger: OffloadLedger
    events: TierEventView | None = None
    # Hands the ledger the tiers' events so far (held bytes), before a decision needs them.
    tier_events: Callable[[], None] = lambda: None


class JobSide:
    """The state both sides read, from their :class:`JobContext`."""

    def __init__(self, ctx: JobContext) -> None:
        self._core = ctx.core
        self._connector = ctx.connector
        self._tiers = ctx.tiers
        self._config = ctx.config
        self._memory = ctx.memory
        self._layout = ctx.layout
        self._keyspace = ctx.keyspace
        self._gate = ctx.gate
        self._stats = ctx.stats
        self._jobs = ctx.jobs
        self._holds = ctx.holds
        self._latency = ctx.latency
        self._ledger = ctx.ledger
        self._events = ctx.events
        self._tier_events = ctx.tier_events


class Stores(JobSide):
    """The store jobs of one manager: it offers the ledger what a request completed and
    runs the plans the ledger returns (copy-out, put), reporting each one's end."""

    def __init__(self, ctx: JobContext) -> None:
        super().__init__(ctx)
        self._hbs = self._keyspace.hash_block_size
        self.copies = CopyWatch(self._core, self._memory, self._stats)

    # ------------------------------------------------------------------ offers
    def offer(self, st: ReqState, offers: Sequence[StateOffer] = (),
              tails: Sequence[StateOffer] = ()) -> int:
        """Store what the request completed: new attention chunks, then the states offered
        for it (``tails``: finish-time partial tails). Returns the objects whose stores
        started; what the ledger drops (duplicates, over the byte budget or the tenant's
        tier quota) it counts."""
        req, ledger = st.req, self._ledger
        if not offers and not tails and not ledger.has_new_chunks(st.offload, req,
                                                                  req.num_computed_tokens):
            return 0  # nothing to store: the common case, kept off the step path
        # Its blocks gone or still being loaded: no offer of it can be read.
        alive = st.admitted and st.load is None
        if ledger.needs_tier_events(st.tenant):
            self._tier_events()
        stale = [o for o in (*offers, *tails) if alive and not self._still_holds(st, o)]
        plan = ledger.prepare_store(
            st.offload, req, computed=req.num_computed_tokens,
            table=self._core.get_block_ids(req.request_id) if alive else (),
            offers=offers, tails=tails, alive=alive, stale=stale)
        if plan is None:
            return 0
        self._start(st, plan)
        return len(plan.objects)

    def _still_holds(self, st: ReqState, offer: StateOffer) -> bool:
        """Whether the offered block is still cached under the request's hash at the
        boundary: a block evicted and reused since the offer holds someone else's bytes.
        An offer at no hashed boundary is the ledger's to drop (it keys none)."""
        i = offer.boundary // self._hbs - 1
        if not 0 <= i < len(st.req.block_hashes):
            return True
        digest = st.req.block_hashes[i]
        key = digest + offer.group.to_bytes(4, "big")
        return self._core.offload_view().caches(offer.block_id, key)

    # ------------------------------------------------------------------ jobs
    def _start(self, st: ReqState, plan: StorePlan) -> None:
        started = time.perf_counter()
        items: list[PutItem] = []
        copy = self._config.store_mode is StoreMode.COPY
        later: list[tuple[int, int, list[int]]] = []  # chunks copied in the job (CopyWatch)
        for i, o in enumerate(plan.objects):
            shape = self._memory.shapes[o.group]
            ids = list(o.block_ids)
            # A state block changes in place from the next step on: copied now. A copy is
            # immutable, which the memory tier keeps without copying again.
            payload: Any
            if o.state:
                payload = self._memory.copy_out_bytes(o.group, ids)
            elif copy:
                payload = b""
                later.append((i, o.group, ids))
            else:
                payload = self._memory.pages(o.group, ids).data
            items.append((o.key, Block(described(o, shape, self._layout).meta(), payload)))
            if self._events is not None:
                self._describe(self._events, st, o)
        job = StoreJob(st.req.request_id, items, plan, owner=st, started=started)
        if later:
            pending = PendingCopy(items, later)
            self.copies.add(pending)
            job.prepare = lambda: self.copies.run_sliced(pending)
            job.pending = pending
        st.stores.add(job)
        coro = run_store(job, self._connector, self._gate, self._config.store_timeout,
                         self._end)
        start_job(job, coro, f"kv-store-{st.req.request_id}", self._end)
        self._jobs.add(job)

    def _describe(self, events: TierEventView, st: ReqState, o: StoreObject) -> None:
        req = st.req
        if o.state:
            info = describe_state(req.block_hashes, req.all_token_ids, o.group, o.index,
                                  self._hbs)
        else:
            ct = self._layout.chunk_tokens(o.group)
            info = describe_chunk(req.block_hashes, req.all_token_ids, o.group, o.index * ct,
                                  (o.index + 1) * ct, self._hbs,
                                  self._memory.shapes[o.group].block_size)
        events.describe(o.key.id, info)

    def _end(self, job: StoreJob) -> None:
        if self._events is not None:
            self._events.settle(list(job.plan.key_ids))
        if job.pending is not None:
            self.copies.discard(job.pending)
        self._latency.store.observe(time.perf_counter() - job.started)
        self._jobs.discard(job)
        if self._ledger.needs_tier_events(job.plan.request.tenant):
            self._tier_events()  # its writes' events first: an object no tier took is gone
        self._ledger.complete_store(job.plan, StoreResult(job.ended is JobEnd.DONE,
                                                          job.tier_counts))
        if job.owner is not None:
            job.owner.stores.discard(job)
        self._holds.job_ended(job)


def described(o: StoreObject, page: PageLike, layout: plans.Layout) -> ObjectSpec:
    """The description of a plan's object (:mod:`kvplugin.aio.objects`): a chunk of the
    layout's ``chunk_blocks`` pages, or a state at its boundary."""
    if o.state:
        return state_spec(o.key, page, o.index)
    return chunk_spec(o.key, page, o.index * layout.chunk_tokens(o.group), len(o.block_ids))
