"""The load side of the async manager: fetch a claim's chunks and states, verify them,
copy them into the request's blocks, publish them, and put the request back in line.

A load is all or nothing per layout rule (:func:`kvplugin.aio.plans.resume_point`): a
full-attention layout keeps its verified prefix, any other layout starts over, because the
core sized the window blocks and the state slot for the claimed boundary only.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence

from kvplugin.aio import plans
from kvplugin.aio.jobs import JobEnd, LoadJob, Priority, connector_tiers, run_load
from kvplugin.aio.jobs import start as start_job
from kvplugin.aio.loadcost import LoadCosts
from kvplugin.aio.objects import ObjectSpec, Refusal, chunk_spec, state_spec
from kvplugin.aio.offload_ledger import LoadResult
from kvplugin.aio.plans import Claim
from kvplugin.aio.reqstate import ReqState
from kvplugin.aio.stores import JobContext, JobSide
from kvplugin.aio.values import (
    LoadFailurePolicy,
    LoadOutcome,
    LoadStatus,
    Lookup,
)
from kvplugin.connectors.base import Connector
from kvplugin.connectors.keys import ObjectKey
from kvplugin.core.request import RequestStatus
from kvplugin.serde import Block

__all__ = ["Loads"]

logger = logging.getLogger(__name__)


class Loads(JobSide):
    """Load jobs of one manager; a request's job is ``ReqState.load``."""

    def __init__(self, ctx: JobContext, *, costs: LoadCosts | None = None) -> None:
        super().__init__(ctx)
        self._costs = costs  # told how long each completed load took
        self._probes: set[asyncio.Task[None]] = set()  # reads aside (see probe)

    def start(self, st: ReqState, claim: Claim, lookup: Lookup) -> None:
        started = time.perf_counter()
        req = st.req
        start, end = claim.local, claim.local + claim.external
        lp = self._ledger.prepare_load(st.offload, req,
                                       self._core.get_block_ids(req.request_id), start, end,
                                       claim.state_at)
        if lp.lands_on_null:
            raise AssertionError(f"the core left a null block where {req.request_id}'s "
                                 "load lands: the load plan disagrees with the allocation")
        plan, states = lp.chunks, lp.states
        levels = _levels(lookup, plan, states, claim.state_at)
        job = LoadJob(req.request_id, start, end, plan, list(lp.keys),
                      [list(ids) for ids in lp.dst], owner=st, states=states,
                      levels=levels, tier=self._tiers[max(levels, default=0)],
                      first=tuple(lookup.first), found=tuple(lookup.levels),
                      state_level=levels[-1] if states else None, started=started,
                      ledger_plan=lp)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KVS
        st.load = job
        st.loaded = asyncio.Event()
        coro = run_load(job, self._connector, self._gate, self._config.load_timeout,
                        self._apply, self._end)
        start_job(job, coro, f"kv-load-{req.request_id}", self._end)
        self._jobs.add(job)

    def probe(self, st: ReqState, lookup: Lookup, start: int, end: int, tier: str) -> None:
        """Read one of ``tier``'s objects among tokens ``[start, end)`` of ``st``'s claim
        aside, and time it: a tier skipped for being slower than recomputing is measured
        again without a request waiting on it (the request computes those tokens). The
        object read is dropped; a read that fails or times out teaches nothing."""
        costs = self._costs
        if costs is None or tier not in self._tiers:
            return
        level = self._tiers.index(tier)
        plan = plans.load_plan(self._layout, start, end)
        levels = _levels(lookup, plan, (), None)
        pick = next((c for c, lv in zip(plan, levels, strict=True) if lv == level), None)
        if pick is None:
            return
        key = st.chunk_keys(self._keyspace, pick.group, pick.chunk, pick.chunk + 1)[0]
        tokens = pick.num_blocks * self._layout.block_sizes[pick.group]
        conn = connector_tiers(self._connector)[level]
        self._stats.load_probes += 1
        task = asyncio.get_running_loop().create_task(
            self._read_aside(costs, conn, key, tier, tokens), name=f"kv-probe-{tier}")
        self._probes.add(task)
        task.add_done_callback(self._probes.discard)

    async def _read_aside(self, costs: LoadCosts, conn: Connector, key: ObjectKey, tier: str,
                          tokens: int) -> None:
        timeout = self._config.load_timeout
        try:
            async with asyncio.timeout(timeout), self._gate.slot(Priority.LOAD):
                started = time.perf_counter()
                blocks = await conn.get([key], timeout=timeout)
                took = time.perf_counter() - started
        except TimeoutError:
            return
        except Exception:  # a closed connector, or a bug: nobody awaits this task
            logger.exception("probe read of tier %s raised", tier)
            return
        if blocks and blocks[0] is not None:
            costs.observed(tier, tokens, took)

    async def wait_probes(self, *, cancel: bool = False) -> None:
        """Wait for the reads aside (cancelled first with ``cancel``)."""
        while self._probes:
            if cancel:
                for t in self._probes:
                    t.cancel()
            await asyncio.wait(list(self._probes))

    async def _apply(self, job: LoadJob, blocks: list[Block | None]) -> None:
        """The load's bytes arrived: copy in what is usable, publish it, un-park the
        request. Runs on the loop right after the fetch, never after an abandon (which
        cancels the job: a copy cut short leaves bytes in blocks nobody caches)."""
        if job.abandoned:
            return
        st = _owner(job)
        k = len(job.plan)
        ok = [self._chunk_ok(c, key, b) for c, key, b in zip(job.plan, job.keys[:k],
                                                              blocks[:k], strict=True)]
        states_ok = [self._state_ok(s, key, b) for s, key, b in zip(
            job.states, job.keys[k:], blocks[k:], strict=True)]
        good = plans.resume_point(self._layout, job.plan, ok, states_ok, job.start, job.end)
        await self._copy_in(st, job, blocks, good)
        self._complete(job, LoadResult(verified=good, copied=tuple(job.copied)))
        if good < job.end:
            self._ledger.rewind(st.offload, good)
        if good == job.end:
            status = LoadStatus.LOADED
        elif self._config.load_failure_policy is LoadFailurePolicy.FAIL:
            status = LoadStatus.FAILED
        else:
            status = LoadStatus.PARTIAL
        self._settle_load(st, job, status, good)

    def _settle_load(self, st: ReqState, job: LoadJob, status: LoadStatus, good: int) -> None:
        """Book a load's end on the request, as vLLM's ``_update_waiting_for_remote_kv``."""
        req = st.req
        req.num_computed_tokens = good
        if status is LoadStatus.FAILED:
            req.status = RequestStatus.FINISHED_ERROR  # the engine calls finish()
        else:
            if good:
                self._core.cache_blocks(req, good)  # bytes in place and verified
            else:
                self._core.free(req)  # a retry may hit locally
                st.admitted = False
            if status is not LoadStatus.LOADED:
                st.skip_external = True
            req.status = (RequestStatus.PREEMPTED if req.num_preemptions
                          else RequestStatus.WAITING)
        loaded = status is LoadStatus.LOADED
        verified = plans.tokens_by_tier(
            self._layout, self._tiers, job.first, job.found, job.start,
            min(good, req.num_prompt_tokens), job.state_level if loaded else None)
        st.ledger.load_ended(verified, job.start, job.end, good)
        state = job.states[0].boundary if job.states and loaded else None
        st.outcome = LoadOutcome(req.request_id, status, job.end - job.start,
                                 max(0, good - job.start), good, state)
        st.loaded.set()

    def _chunk_ok(self, load: plans.ChunkLoad, key: ObjectKey, block: Block | None) -> bool:
        # The connector verified checksums and the namespace; this checks it is the chunk
        # this layout expects (a writer with another page shape must not slip through).
        lay = self._layout
        spec = chunk_spec(key, self._memory.shapes[load.group],
                          load.chunk * lay.chunk_tokens(load.group), lay.chunk_blocks)
        return self._accepted(spec, block)

    def _state_ok(self, load: plans.StateLoad, key: ObjectKey, block: Block | None) -> bool:
        return self._accepted(state_spec(key, self._memory.shapes[load.group], load.boundary),
                              block)

    def _accepted(self, spec: ObjectSpec, block: Block | None) -> bool:
        why = spec.refusal(block)
        if why is None:
            return True
        if why is not Refusal.MISSING:
            self._stats.objects_refused += 1
            logger.debug("load of %s refused: %s", spec.key.id, why.value)
        return False

    async def _copy_in(self, st: ReqState, job: LoadJob, blocks: list[Block | None],
                       good: int) -> None:
        """Copy the verified part in, one chunk per loop callback (a 10 MiB load copied in
        one go held the loop, and the engine's next wake-up, ~8 ms here), each piece
        reported to the ledger when the load ends (``job.copied``)."""
        k = len(job.plan)
        copied = 0
        for load, dst, block, level in zip(job.plan, job.dst[:k], blocks[:k],
                                           job.levels[:k], strict=True):
            bs = self._layout.block_sizes[load.group]
            n = min(load.num_blocks, good // bs - load.first_block)
            if n <= 0 or block is None:
                continue
            if copied:
                await asyncio.sleep(0)
            copied += 1
            width = self._memory.page_bytes(load.group)
            raw = memoryview(block.payload).cast("B")
            self._memory.copy_in(load.group, dst[:n],
                                raw[load.skip * width:(load.skip + n) * width])
            job.copied.append((self._tiers[level], n * width, False))
        if good != job.end:
            return  # a state is valid at the claimed boundary only
        for state, dst, block, level in zip(job.states, job.dst[k:], blocks[k:],
                                            job.levels[k:], strict=True):
            if block is None:
                raise RuntimeError(f"load of {job.request_id!r}: a state verified at the claimed "
                                   "boundary has no block to copy in")
            self._memory.copy_in(state.group, dst, block.payload)
            job.copied.append((self._tiers[level], self._memory.page_bytes(state.group), True))

    def _complete(self, job: LoadJob, result: LoadResult) -> None:
        if job.ledger_plan is not None:
            self._ledger.complete_load(job.ledger_plan, result)

    def _end(self, job: LoadJob) -> None:
        """Always runs last: a load that ended without a result (cancelled, or a bug) puts
        the request back to the start; an abandoned one lets its blocks go."""
        took = time.perf_counter() - job.started
        self._latency.load[job.tier].observe(took)
        if self._costs is not None and job.ended is JobEnd.DONE:
            self._costs.observed(job.tier, job.end - job.start, took)
        self._jobs.discard(job)
        st = _owner(job)
        if st.load is job:
            st.load = None
        if job.ended is JobEnd.CANCELLED or st.outcome is None:
            # Its bytes were never applied: cancelled (or it crashed), nothing verified.
            self._complete(job, LoadResult(cancelled=job.ended is JobEnd.CANCELLED,
                                           abandoned=job.abandoned, copied=tuple(job.copied)))
        if not job.abandoned and st.outcome is None:
            # Cancelled (or crashed) before its bytes were applied: nothing is verified.
            if job.ended is JobEnd.CANCELLED:
                status = LoadStatus.CANCELLED
            elif self._config.load_failure_policy is LoadFailurePolicy.FAIL:
                status = LoadStatus.FAILED
            else:
                status = LoadStatus.PARTIAL
            self._settle_load(st, job, status, 0)
        elif job.abandoned and st.outcome is None:
            # The request was finished during its load: nothing is applied to it, but
            # whoever awaits wait_load() must still wake up.
            st.outcome = LoadOutcome(job.request_id, LoadStatus.CANCELLED,
                                     job.end - job.start, 0, 0)
            st.loaded.set()
        self._holds.job_ended(job)


def _owner(job: LoadJob) -> ReqState:
    """The request a load job was started for (every job of ``Loads.start`` has one)."""
    if job.owner is None:
        raise RuntimeError(f"load of {job.request_id!r} has no owning request")
    return job.owner


def _levels(lookup: Lookup, plan: Sequence[plans.ChunkLoad],
            states: Sequence[plans.StateLoad], state_at: int | None) -> tuple[int, ...]:
    """The tier level the lookup found each of a load's keys at (chunks, then states). The
    claim was reconciled from this lookup, so every planned chunk is inside what it found;
    a chunk that is not (a bug elsewhere) is booked at the slowest level seen."""
    found = [lv for group in lookup.levels for lv in group]
    found += [lv for _, lv in lookup.states]
    slowest = max(found, default=0)
    out = []
    for c in plan:
        i = c.chunk - lookup.first[c.group]
        row = lookup.levels[c.group]
        out.append(row[i] if 0 <= i < len(row) else slowest)
    state_level = next((lv for b, lv in lookup.states if b == state_at), slowest)
    out += [state_level] * len(states)
    return tuple(out)
