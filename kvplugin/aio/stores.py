"""The store side of the async manager: what to offer the tiers each step, within the byte
budget, as store jobs; Mamba checkpoints; blocks held for jobs after a request let go.

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

from kvplugin.aio import plans
from kvplugin.aio.jobs import IOGate, JobEnd, LoadJob, StoreJob, run_store
from kvplugin.aio.jobs import start as start_job
from kvplugin.aio.keys import KeySpace
from kvplugin.aio.memory import HostKVMemory
from kvplugin.aio.plans import StateOffer
from kvplugin.aio.reqstate import NO_HOLE, ReqState
from kvplugin.aio.tier_events import TierEventView, describe_chunk, describe_state
from kvplugin.aio.values import LatencyRecorder, Lookup, OffloadConfig, OffloadStats, StoreMode
from kvplugin.connectors.base import Connector, PutItem
from kvplugin.connectors.keys import ObjectKey
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


@dataclass(eq=False, slots=True)
class _PendingCopy:
    """A store job's copy-outs not done at hand-off: ``(item index, group, block ids)``."""

    items: list[PutItem]
    copies: list[tuple[int, int, list[int]]]
    copied: int = 0  # ``copies[:copied]`` are done
    done: bool = False


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
        self._watches: dict[_PendingCopy, ReuseWatch] = {}

    def add(self, pc: _PendingCopy) -> None:
        ids = [b for _, _, block_ids in pc.copies for b in block_ids]
        self._watches[pc] = self._view.watch_reuse(ids, lambda _block: self._reused(pc))

    def _reused(self, pc: _PendingCopy) -> None:
        if not pc.done:
            self._stats.copies_on_reuse += 1
            self.run(pc)

    def run(self, pc: _PendingCopy) -> None:
        """Every copy left, now (a block is about to be reused)."""
        while not pc.done and pc.copied < len(pc.copies):
            self._copy_next(pc)
        self.discard(pc)

    async def run_sliced(self, pc: _PendingCopy) -> None:
        """Every copy left, one chunk per loop callback: a big job's copy-out must not
        hold the loop (and the engine's next wake-up) for milliseconds at a stretch."""
        while not pc.done and pc.copied < len(pc.copies):
            if pc.copied:
                await asyncio.sleep(0)
                if pc.done:  # the reuse hook ran the rest meanwhile
                    return
            self._copy_next(pc)
        self.discard(pc)

    def _copy_next(self, pc: _PendingCopy) -> None:
        i, group, ids = pc.copies[pc.copied]
        key, blk = pc.items[i]
        data = self._memory.copy_out_bytes(group, ids)
        pc.items[i] = (key, Block(blk.meta, cast("Buffer", data)))
        pc.copied += 1

    def discard(self, pc: _PendingCopy) -> None:
        """Done with (copied, or its job ended first): the hook forgets it."""
        pc.done = True
        watch = self._watches.pop(pc, None)
        if watch is not None:
            watch.cancel()


@dataclass(frozen=True, slots=True)
class _Candidate:
    group: int
    index: int  # chunk index, or the state's boundary
    key: ObjectKey
    block_ids: list[int]
    nbytes: int
    tail: bool = False


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
    jobs: set[Job]
    holds: Holds
    latency: LatencyRecorder
    events: TierEventView | None = None


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
        self._events = ctx.events


class Stores(JobSide):
    """Offers, the in-flight byte budget and the store jobs of one manager."""

    def __init__(self, ctx: JobContext) -> None:
        super().__init__(ctx)
        self._storing: set[str] = set()  # key ids of objects being stored
        self._bytes = 0
        self._hbs = self._keyspace.hash_block_size
        self.copies = CopyWatch(self._core, self._memory, self._stats)

    @property
    def bytes_in_flight(self) -> int:
        return self._bytes

    def start_cursor(self, st: ReqState, hit: int, lookup: Lookup | None) -> None:
        """Where a newly admitted request's stores start. Chunks inside the hit came from
        somewhere that stored them; chunks the tiers already hold beyond the claim need no
        store either (vLLM's chunk-level policy); so do states up to the hit."""
        for g in self._layout.chunked_groups:
            n = hit // self._layout.chunk_tokens(g)
            if lookup is not None:
                n = max(n, lookup.first[g] + lookup.present[g])
            st.next_chunk[g] = n
        st.known_until = hit
        st.hole = NO_HOLE

    # ------------------------------------------------------------------ offers
    def offer(self, st: ReqState, offers: Sequence[StateOffer] = (),
              tails: Sequence[StateOffer] = ()) -> int:
        """Store what the request completed: new attention chunks, then the states offered
        for it (``tails``: finish-time partial tails). Returns the objects whose stores
        started; duplicates and objects over the byte budget are dropped, counted."""
        if not st.admitted or st.load is not None:
            # Its blocks are gone or still being loaded: no offer of it can be read.
            self._stats.states_dropped += len(offers) + len(tails)
            return 0
        chunks = self._chunk_candidates(st)
        chunk_sel = self._select(chunks, self._bytes)
        self._mark_holes(st, chunks, chunk_sel.take)
        used = self._bytes + sum(chunks[i].nbytes for i in chunk_sel.take)
        states = self._state_candidates(st, offers, tails)
        state_sel = self._select(states, used)
        take = [chunks[i] for i in chunk_sel.take] + [states[i] for i in state_sel.take]
        if take:
            self._start(st, take, len(state_sel.take))
        return len(take)

    def has_new_chunks(self, st: ReqState) -> bool:
        """Whether the request completed an attention chunk not yet offered: most steps
        complete none (a decode step adds one token), and an offer without a new chunk
        or a state to store is a no-op, so callers skip it (the engine's step path)."""
        req = st.req
        committed = req.num_computed_tokens
        if self._config.store_prompt_only:
            committed = min(committed, req.num_prompt_tokens)
        ready = min(committed, len(req.block_hashes) * self._hbs)
        lay = self._layout
        return any(ready // lay.chunk_tokens(g) > st.next_chunk[g] for g in lay.chunked_groups)

    def _select(self, cands: list[_Candidate], used: int) -> plans.StoreSelection:
        sel = plans.select_stores([(c.key.id, c.nbytes) for c in cands], self._storing, used,
                                  self._config.store_budget_bytes)
        self._stats.stores_shed += sel.shed
        self._stats.stores_deduplicated += sel.duplicates
        return sel

    def _chunk_candidates(self, st: ReqState) -> list[_Candidate]:
        req = st.req
        committed = req.num_computed_tokens
        if self._config.store_prompt_only:
            committed = min(committed, req.num_prompt_tokens)
        offers = plans.chunk_offers(self._layout, st.next_chunk, committed,
                                    len(req.block_hashes) * self._hbs,
                                    self._core.get_block_ids(req.request_id), st.hole)
        st.next_chunk[:] = offers.next_chunk
        st.hole = offers.hole
        cb = self._layout.chunk_blocks
        return [_Candidate(o.group, o.chunk, st.chunk_keys(self._keyspace, o.group, o.chunk,
                                                           o.chunk + 1)[0],
                           list(o.block_ids), self._memory.page_bytes(o.group) * cb)
                for o in offers.chunks]

    def _mark_holes(self, st: ReqState, chunks: list[_Candidate], taken: Sequence[int]) -> None:
        kept = set(taken)
        for i, c in enumerate(chunks):
            if i not in kept and c.key.id not in self._storing:  # shed, not deduplicated
                st.hole = min(st.hole, c.index * self._layout.chunk_tokens(c.group))

    def _state_candidates(self, st: ReqState, offers: Sequence[StateOffer],
                          tails: Sequence[StateOffer]) -> list[_Candidate]:
        if not offers and not tails:
            return []
        req = st.req
        save_end = req.num_prompt_tokens if self._config.store_prompt_only else req.num_tokens
        tail_set = set(tails)
        kept, dropped = plans.select_states(
            self._layout, [*offers, *tails], alive=True, known_until=st.known_until,
            save_end=save_end, hole=st.hole)
        out = []
        for o in kept:
            key = self._keyspace.state_key(st.scope, o.group, req.block_hashes, o.boundary)
            if not self._still_holds(st, o):
                dropped += 1
                continue
            out.append(_Candidate(o.group, o.boundary, key, [o.block_id],
                                  self._memory.page_bytes(o.group), o in tail_set))
        self._stats.states_dropped += dropped
        return out

    def _still_holds(self, st: ReqState, offer: StateOffer) -> bool:
        """Whether the offered block is still cached under the request's hash at the
        boundary: a block evicted and reused since the offer holds someone else's bytes."""
        digest = st.req.block_hashes[offer.boundary // self._hbs - 1]
        key = digest + offer.group.to_bytes(4, "big")
        return self._core.offload_view().caches(offer.block_id, key)

    # ------------------------------------------------------------------ jobs
    def _start(self, st: ReqState, take: list[_Candidate], num_states: int) -> None:
        started = time.perf_counter()
        items: list[PutItem] = []
        nbytes = 0
        first_token = NO_HOLE
        copy = self._config.store_mode is StoreMode.COPY
        later: list[tuple[int, int, list[int]]] = []  # chunks copied in the job (CopyWatch)
        for i, c in enumerate(take):
            state = i >= len(take) - num_states
            shape = self._memory.shapes[c.group]
            # A state block changes in place from the next step on: copied now. A copy is
            # immutable, which the memory tier keeps without copying again.
            payload: Any
            if state:
                payload = self._memory.copy_out_bytes(c.group, c.block_ids)
            elif copy:
                payload = b""
                later.append((i, c.group, c.block_ids))
            else:
                payload = self._memory.pages(c.group, c.block_ids).data
            if state:
                meta = c.key.meta(token_start=0, token_end=c.index, dtype=shape.dtype,
                                  shape=(1, *shape.dims), boundary=c.index)
            else:
                ct = self._layout.chunk_tokens(c.group)
                first_token = min(first_token, c.index * ct)
                meta = c.key.meta(token_start=c.index * ct, token_end=(c.index + 1) * ct,
                                  dtype=shape.dtype,
                                  shape=(self._layout.chunk_blocks, *shape.dims))
            items.append((c.key, Block(meta, payload)))
            nbytes += c.nbytes
            if self._events is not None:
                self._describe(st, c, state)
        job = StoreJob(st.req.request_id, items, nbytes, frozenset(c.key.id for c in take),
                       objects=tuple((c.key.id, c.nbytes) for c in take),
                       owner=st, states=num_states,
                       partial_tails=sum(c.tail for c in take), first_token=first_token,
                       started=started)
        if later:
            pending = _PendingCopy(items, later)
            self.copies.add(pending)
            job.prepare = lambda: self.copies.run_sliced(pending)
            job.pending = pending
        self._storing |= job.key_ids
        self._bytes += nbytes
        st.stores.add(job)
        self._stats.stores += 1
        coro = run_store(job, self._connector, self._gate, self._config.store_timeout,
                         self._end)
        start_job(job, coro, f"kv-store-{st.req.request_id}", self._end)
        self._jobs.add(job)

    def _describe(self, st: ReqState, c: _Candidate, state: bool) -> None:
        assert self._events is not None
        req = st.req
        if state:
            info = describe_state(req.block_hashes, req.all_token_ids, c.group, c.index,
                                  self._hbs)
        else:
            ct = self._layout.chunk_tokens(c.group)
            info = describe_chunk(req.block_hashes, req.all_token_ids, c.group, c.index * ct,
                                  (c.index + 1) * ct, self._hbs,
                                  self._memory.shapes[c.group].block_size)
        self._events.describe(c.key.id, info)

    def _end(self, job: StoreJob) -> None:
        if self._events is not None:
            self._events.settle(list(job.key_ids))
        if job.pending is not None:
            self.copies.discard(job.pending)
        self._latency.store.observe(time.perf_counter() - job.started)
        self._jobs.discard(job)
        self._storing -= job.key_ids
        self._bytes -= job.nbytes
        st: ReqState = job.owner
        st.stores.discard(job)
        chunks = len(job.items) - job.states
        if job.ended is JobEnd.DONE:
            self._stats.stored_chunks += chunks
            self._stats.stored_bytes += job.nbytes
            self._stats.stored_states += job.states
            self._stats.partial_tails += job.partial_tails
        else:
            self._stats.stores_failed += len(job.items)
            # Later states of this request would miss these chunks.
            st.hole = min(st.hole, job.first_token)
        self._holds.job_ended(job)
