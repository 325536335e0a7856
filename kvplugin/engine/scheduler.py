"""The reference async engine: vLLM 0.33.0's scheduling rules on an asyncio serving loop.

One step is ``schedule`` (synchronous: every decision and its bookkeeping, no await), the
model's ``execute`` (awaited: the loop keeps serving offload I/O meanwhile, as it would
while a GPU computes), and ``_update`` (synchronous: sampled tokens, store hand-offs,
finishes). What ``schedule`` does, after vLLM's ``Scheduler.schedule``:

1. Running requests first, in order, each getting ``min(tokens left, budget,
   long_prefill_token_threshold)`` tokens (chunked prefill under ``max_num_batched_tokens``).
   When the allocation fails, the newest running request is preempted (recompute: it gives
   its blocks back and starts over from the front of the waiting queue) until it fits, or
   the request preempted itself. While the manager holds blocks for stores about to end, no
   one is preempted (vLLM's ``has_pending_block_frees``): the step just does less.
2. Only when nobody was preempted, waiting requests up to ``max_num_seqs`` running: first
   those whose KV load ended and who hold their blocks (vLLM's ``kv_holding_waiting``), then
   the waiting queue in order. A waiting request is admitted with the result of its lookup,
   which runs in the background as soon as the request is queued; one whose lookup has not
   answered yet is skipped this step (vLLM skips a request whose connector answers None).
   An admission that claims tokens from the tiers parks the request
   (``WAITING_FOR_REMOTE_KVS``) without scheduling tokens; when the load ends it moves to
   the kv-holding queue (or back to the waiting queue when nothing was kept).
   The first allocation that fails ends admissions for the step (FCFS).

With a :class:`~kvplugin.engine.clock.SimClock` (deterministic runs) every I/O in flight is
settled before each scheduling decision (:meth:`Engine._settle`), so no decision depends on
how fast a tier answered.

Finishing hands the request to the manager, whose delayed free keeps blocks that stores
still read. Every device hit and every loaded block is checked against the model's
recomputation (``FakeModel.check``) where the request resumes: a loading admission's device
hit with its load, since a window group keeps only what the resume point's window needs;
a Mamba state is checked by the model when a step resumes from it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvplugin.aio import group_kinds
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import Admission, Lookup
from kvplugin.core.events import MEDIUM_GPU, KVCacheEvent
from kvplugin.core.request import LoRAInfo, Request, RequestStatus
from kvplugin.costs import ModelCost
from kvplugin.engine._loadwait import LoadWaits
from kvplugin.engine.clock import Clock, SimClock, let_clients_run
from kvplugin.engine.model import FakeModel, Work
from kvplugin.engine.quantiles import Quantiles

__all__ = ["Engine", "EngineRequest", "EngineStats", "Result", "SchedulerLimits"]

logger = logging.getLogger(__name__)

# A request waiting at the head of a full pool sees its device hit shrink step after step
# (the requests admitted past it evict it); each stale lookup is redone, up to this many
# times. On LMCache's multi-round QA shape (benchmarks/end_to_end.py --quick), with 2 the
# offload-on run computed 42.6k prompt tokens, with 8 33.4k (what the tiers held, computed
# again by requests admitted on a stale lookup).
MAX_LOOKUP_REFRESHES = 8


@dataclass(frozen=True, slots=True)
class SchedulerLimits:
    max_num_batched_tokens: int = 256
    max_num_seqs: int = 16
    long_prefill_token_threshold: int = 0  # 0: no per-request cap below the budget
    idle_poll_s: float = 0.002  # how often an idle step looks again while jobs run

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
        if self.long_prefill_token_threshold < 0 or not self.idle_poll_s > 0:
            raise ValueError("long_prefill_token_threshold must be >= 0, idle_poll_s > 0")


@dataclass(frozen=True, slots=True)
class Result:
    request_id: str
    tenant: str
    prompt: tuple[int, ...]
    output: tuple[int, ...]
    status: RequestStatus
    preemptions: int
    ttft_s: float | None
    latency_s: float


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    idle_waits: int = 0
    requests: int = 0
    finished: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    computed_tokens: int = 0
    computed_prompt_tokens: int = 0  # prefill tokens computed (recomputations included)
    admissions: int = 0
    preemptions: int = 0
    parked: int = 0  # admissions that waited for a KV load
    lookup_skips: int = 0  # admissions put off because the lookup had not answered
    lookup_refreshes: int = 0  # lookups redone because the device hit had shrunk
    unstuck: int = 0  # loaded requests sent back to the queue to free a stuck pool
    device_hit_tokens: int = 0
    tier_hit_tokens: dict[str, int] = field(default_factory=dict)
    kv_events: int = 0  # KV-cache events of the device cache and (tier_events) the tiers
    tier_events: int = 0  # of those, the tiers' (medium other than GPU)
    restored_states: int = 0  # Mamba states a request resumed from after a load
    restored_partial_states: int = 0  # of those, at a boundary inside a Mamba block
    transfer_s: float = 0.0  # with a model cost: simulated time the host link spent on loads
    peak_running_tokens: int = 0  # the most tokens (prompt and output) running in one step
    # Wall time of every step that ran (schedule, model, bookkeeping), for latency figures
    # (bounded: exact percentiles up to a few thousand steps, then 1 % buckets).
    step_s: Quantiles = field(default_factory=Quantiles)


@dataclass(eq=False, slots=True)
class EngineRequest:
    req: Request
    tenant: str
    max_tokens: int
    done: asyncio.Future[Result]
    arrived: float
    lookup: Lookup | None = None
    lookup_task: asyncio.Task[Lookup] | None = None
    holds_blocks: bool = False
    refreshes: int = 0  # lookups redone because the device hit shrank since
    first_token: float | None = None
    ready_at: float = 0.0  # with a model cost: when its loaded KV has crossed the link

    @property
    def rid(self) -> str:
        return self.req.request_id


class Engine(LoadWaits):
    """Serve requests on the running loop: ``add_request`` / ``generate`` to submit, ``run``
    to serve until ``stop`` (and the last request finished)."""

    def __init__(self, mgr: AsyncKVManager, model: FakeModel,
                 limits: SchedulerLimits | None = None, clock: Clock | None = None) -> None:
        self.mgr = mgr
        self.model = model
        self.limits = limits or SchedulerLimits()
        self.clock = clock or model.clock
        self.running: list[EngineRequest] = []
        self.waiting: deque[EngineRequest] = deque()
        self.kv_holding: deque[EngineRequest] = deque()  # loaded, holding blocks: go first
        self.loading: dict[str, EngineRequest] = {}
        # With a model cost, loaded requests wait here until their KV has crossed the host
        # link (the model's bytes over the link and the tier: costs.ModelCost.load_s).
        self.transferring: list[EngineRequest] = []
        self._load_cost = model.costs if isinstance(model.costs, ModelCost) else None
        self._link_free = 0.0  # when the host link is done with the loads booked so far
        self._timers: set[asyncio.Task[None]] = set()
        self.stats = EngineStats()
        # Subscribers of the KV-cache event stream (a publisher, a router's test probe).
        self.event_sinks: list[Callable[[list[KVCacheEvent]], None]] = []
        self._loras: dict[str, LoRAInfo] = {}
        self._wake = asyncio.Event()
        self._watchers: set[asyncio.Task[None]] = set()
        self._checks: list[tuple[EngineRequest, int, int]] = []
        self._stopping = False
        pool = mgr.core.offload_view().num_usable_blocks
        self._pool_blocks = pool
        self._block_sizes = [s.block_size for s in mgr.memory.shapes]
        self._state_block_sizes = [s.block_size for s in mgr.memory.shapes
                                   if not group_kinds.plan_kind(s.kind).chunked]

    def _publish(self, events: list[KVCacheEvent]) -> None:
        if not events:
            return
        self.stats.kv_events += len(events)
        self.stats.tier_events += sum(1 for e in events
                                      if getattr(e, "medium", MEDIUM_GPU) != MEDIUM_GPU)
        for sink in self.event_sinks:
            sink(events)

    def flush_events(self) -> None:
        """Publish what happened since the last step (the run's end: the last stores)."""
        self._publish(self.mgr.take_events())

    # ------------------------------------------------------------------ submitting
    def add_request(self, request_id: str, prompt: Sequence[int], *, tenant: str,
                    max_tokens: int, cache_salt: str | None = None, lora: str | None = None,
                    prefix_group: str | None = None, shared_prefix_tokens: int = 0,
                    arrived: float | None = None) -> asyncio.Future[Result]:
        """Queue a request; the future resolves when it finished. With ``prefix_group`` (a
        group the deployment declares for the tenant), its first ``shared_prefix_tokens``
        tokens are the group's shared prefix: the manager may serve them from any member's
        blocks, and the model computes them as the group's (see ``kvplugin.aio.tenants``).
        ``arrived``: when the client sent it, if earlier than now (its TTFT and latency
        count from then: a request due while a simulated step ran waited for that step)."""
        self._check_fits(request_id, len(prompt), max_tokens)
        # The manager checks the pair (both or neither, a member, a length it accepts).
        shared = shared_prefix_tokens if prefix_group is not None or shared_prefix_tokens \
            else None
        req = self.mgr.new_request(request_id, prompt, tenant=tenant, cache_salt=cache_salt,
                                   lora_request=self._lora(lora), prefix_group=prefix_group,
                                   shared_prefix_tokens=shared)
        self.model.add(request_id, req.all_token_ids, tenant, lora, prefix_group=prefix_group,
                       shared_prefix_tokens=shared_prefix_tokens)
        loop = asyncio.get_running_loop()
        now = self.clock.now()
        er = EngineRequest(req, tenant, max_tokens, loop.create_future(),
                           now if arrived is None else min(arrived, now))
        self.stats.requests += 1
        self.stats.prompt_tokens += req.num_prompt_tokens
        self.waiting.append(er)
        self._start_lookup(er)
        self._wake.set()
        return er.done

    async def generate(self, request_id: str, prompt: Sequence[int], *, tenant: str,
                       max_tokens: int, cache_salt: str | None = None,
                       lora: str | None = None, prefix_group: str | None = None,
                       shared_prefix_tokens: int = 0, arrived: float | None = None) -> Result:
        return await self.add_request(request_id, prompt, tenant=tenant, max_tokens=max_tokens,
                                      cache_salt=cache_salt, lora=lora,
                                      prefix_group=prefix_group,
                                      shared_prefix_tokens=shared_prefix_tokens,
                                      arrived=arrived)

    def _check_fits(self, request_id: str, prompt_len: int, max_tokens: int) -> None:
        if prompt_len < 1 or max_tokens < 1:
            raise ValueError(f"{request_id}: a request needs a prompt and max_tokens >= 1")
        n = prompt_len + max_tokens
        if n > self.mgr.core.max_model_len:
            raise ValueError(f"{request_id}: {n} tokens exceed max_model_len "
                             f"{self.mgr.core.max_model_len}")
        blocks = sum(math.ceil(n / bs) for bs in self._block_sizes)
        if blocks > self._pool_blocks:
            raise ValueError(f"{request_id}: needs {blocks} blocks, the pool has "
                             f"{self._pool_blocks}: it could never run")

    def _lora(self, name: str | None) -> LoRAInfo | None:
        if name is None:
            return None
        info = self._loras.get(name)
        if info is None:
            info = self._loras[name] = LoRAInfo(name, len(self._loras) + 1)
        return info

    def _start_lookup(self, er: EngineRequest) -> None:
        """Ask the tiers in the background; the answer is used at admission, however stale
        (the manager re-checks the local hit and claims from the facts it holds)."""
        if er.lookup_task is not None and not er.lookup_task.done():
            er.lookup_task.cancel()
        er.lookup = None
        task = asyncio.get_running_loop().create_task(self.mgr.lookup(er.req),
                                                      name=f"kv-lookup-{er.rid}")
        task.add_done_callback(lambda _: self._wake.set())
        er.lookup_task = task

    def _take_lookup(self, er: EngineRequest) -> bool:
        """True when the request's lookup has answered (a failed lookup counts as none)."""
        if er.lookup is not None:
            return True
        task = er.lookup_task
        if task is None or not task.done():
            return False
        if not task.cancelled() and task.exception() is None:
            er.lookup = task.result()
        else:
            logger.warning("lookup of %s failed; admitting on the local hit", er.rid)
        er.lookup_task = None
        return True

    # ------------------------------------------------------------------ serving
    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.kv_holding or self.loading
                    or self.transferring)

    def stop(self) -> None:
        """``run`` returns once every request queued so far has finished."""
        self._stopping = True
        self._wake.set()

    async def run(self) -> None:
        self._stopping = False  # a stop ended the previous run; this one serves anew
        sim = self.clock if isinstance(self.clock, SimClock) else None
        while not (self._stopping and not self.has_work()):
            if sim is not None:
                await let_clients_run()  # a finish's follow-up, a woken arrival, submits
                await self._settle()
                self._wake.clear()  # from here on, a set wake is news for _sim_idle
            if await self.step():
                # No yield here: the next step starts its simulated time at once, and the
                # I/O that became ready runs inside it (between the model's slices, while it
                # waits) rather than between steps, where it would delay every step.
                continue
            if self._unstick():
                continue
            if sim is None:
                await self._idle()
            else:
                await self._sim_idle(sim)

    def _lookups_in_flight(self) -> list[asyncio.Task[Lookup]]:
        return [er.lookup_task for er in self._all()
                if er.lookup_task is not None and not er.lookup_task.done()]

    def _io_in_flight(self) -> bool:
        return bool(self._watchers or self.mgr.num_pending_jobs or self._lookups_in_flight())

    async def _settle(self) -> None:
        """Deterministic runs: wait until no I/O is in flight (lookups answered, loads
        applied and their requests requeued, stores written, promotions done), so the next
        decision sees the same state whatever the tiers' timing."""
        drain = getattr(self.mgr.connector, "drain", None)  # a tiered one's promotions
        while True:
            lookups = self._lookups_in_flight()
            if self._watchers or lookups:
                await asyncio.wait([*self._watchers, *lookups])
            elif self.mgr.num_pending_jobs:
                await self.mgr.drain()
            else:
                if drain is not None:
                    await drain()
                # Done callbacks (a watcher's requeue, a hold released) run before we look.
                await asyncio.sleep(0)
                if not self._io_in_flight():
                    return

    async def _sim_idle(self, sim: SimClock) -> None:
        """Nothing could be scheduled with every I/O settled. Let the clients that just
        woke submit; if nothing new happened, jump to the next client's time; with nobody
        due, only a submission or the stop can change anything: wait for it."""
        self.stats.idle_waits += 1
        for _ in range(4):  # a finish wakes its client, which wakes a follow-up's
            await asyncio.sleep(0)
        if self._wake.is_set() or self._io_in_flight() or self._stopping:
            return  # news to look at; or the stop (run() ends once the work has)
        if await sim.jump():
            return
        await self._wake.wait()

    async def _idle(self) -> None:
        self.stats.idle_waits += 1
        self._wake.clear()
        if not self.has_work():
            await self._wake.wait()
            return
        # Held blocks coming back and loads ending need no wake-up call: look again soon.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self.limits.idle_poll_s):
                await self._wake.wait()

    async def step(self) -> bool:
        """Schedule, execute and book one step; False when nothing could be scheduled."""
        t0 = time.perf_counter()
        self.mgr.core.new_step_starts()
        batch = self.schedule()
        self._publish(self.mgr.take_events())
        if not batch:
            await self._run_checks()
            return False
        work = [Work(er.rid, er.req.num_computed_tokens, n,
                     self.mgr.core.get_block_ids(er.rid), self._is_decode(er, n))
                for er, n in batch]
        # The checks run once the step's KV is written, while its simulated time runs.
        sampled = await self.model.execute(work, then=self._run_checks)
        self._update(batch, sampled)
        self.stats.step_s.add(time.perf_counter() - t0)
        return True

    @staticmethod
    def _is_decode(er: EngineRequest, n: int) -> bool:
        r = er.req
        return n == 1 and r.num_output_tokens > 0 and r.num_computed_tokens == r.num_tokens - 1

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> list[tuple[EngineRequest, int]]:
        batch: list[tuple[EngineRequest, int]] = []
        budget, preempted = self._schedule_running(self.limits.max_num_batched_tokens, batch)
        if not preempted:
            self._schedule_waiting(budget, batch)
        self.stats.steps += bool(batch)
        running = sum(er.req.num_tokens for er in self.running)
        if running > self.stats.peak_running_tokens:
            self.stats.peak_running_tokens = running
        return batch

    def _chunk(self, er: EngineRequest, budget: int) -> int:
        n = min(er.req.num_tokens - er.req.num_computed_tokens, budget)
        thr = self.limits.long_prefill_token_threshold
        return min(n, thr) if thr else n

    def _schedule_running(self, budget: int, batch: list[tuple[EngineRequest, int]]
                          ) -> tuple[int, bool]:
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            er = self.running[i]
            n = self._chunk(er, budget)
            adm = self.mgr.allocate(er.req, num_new_tokens=n)
            while adm is None and not self.mgr.num_held_blocks:
                victim = self.running.pop()  # the newest (FCFS): never scheduled yet
                self._preempt(victim)
                preempted = True
                if victim is er:
                    break
                adm = self.mgr.allocate(er.req, num_new_tokens=n)
            if adm is None:
                break
            batch.append((er, adm.num_new_tokens))
            budget -= adm.num_new_tokens
            i += 1
        return budget, preempted

    def _preempt(self, er: EngineRequest) -> None:
        self.mgr.preempt(er.req)
        er.holds_blocks = False
        self.stats.preemptions += 1
        self.waiting.appendleft(er)
        self._start_lookup(er)

    def _schedule_waiting(self, budget: int, batch: list[tuple[EngineRequest, int]]) -> None:
        skipped: list[EngineRequest] = []
        while budget > 0 and len(self.running) < self.limits.max_num_seqs:
            queue = self.kv_holding or self.waiting
            if not queue:
                break
            er = queue[0]
            if not er.holds_blocks and not (self._take_lookup(er) and self._fresh(er)):
                skipped.append(queue.popleft())
                self.stats.lookup_skips += 1
                continue
            adm = self._allocate_waiting(er, budget)
            if adm is None:
                break  # no room: admissions end here this step (FCFS)
            queue.popleft()
            if adm.loading:
                self._book_transfer(er, adm.external_by_tier)
                self._park(er)
                continue
            er.req.status = RequestStatus.RUNNING
            self.running.append(er)
            batch.append((er, adm.num_new_tokens))
            budget -= adm.num_new_tokens
        self.waiting.extendleft(reversed(skipped))

    def _fresh(self, er: EngineRequest) -> bool:
        """The tiers were asked only beyond where the device hit ended at lookup time; when
        the device has since evicted some of it, what the tiers hold there is unknown (a
        claim would be lost, or never made: a lookup that found nothing beyond a long
        device hit says nothing about the blocks evicted since), so look again, at most
        :data:`MAX_LOOKUP_REFRESHES` times: a pool under pressure may keep shrinking it."""
        lk = er.lookup
        if lk is None or er.refreshes >= MAX_LOOKUP_REFRESHES:
            return True
        _, local, _ = self.mgr.core.get_computed_blocks(er.req)
        if local >= lk.local_tokens:
            return True
        er.refreshes += 1
        self.stats.lookup_refreshes += 1
        self._start_lookup(er)
        return False

    def _allocate_waiting(self, er: EngineRequest, budget: int) -> Admission | None:
        n = self._chunk(er, budget)
        if er.holds_blocks:  # resumed after its load: it only grows
            return self.mgr.allocate(er.req, num_new_tokens=n)
        adm = self.mgr.allocate(er.req, er.lookup, num_new_tokens=n,
                                has_scheduled_reqs=bool(self.running))
        if adm is None:
            return None
        er.holds_blocks = True
        er.lookup = None
        er.refreshes = 0
        self.stats.admissions += 1
        self.stats.device_hit_tokens += adm.local_tokens
        for tier, tokens in adm.external_by_tier.items():
            self.stats.tier_hit_tokens[tier] = self.stats.tier_hit_tokens.get(tier, 0) + tokens
        if not adm.loading:
            self._check(er, 0, adm.local_tokens)
        return adm

    # ------------------------------------------------------------------ after a step
    def _update(self, batch: list[tuple[EngineRequest, int]],
                sampled: list[int | None]) -> None:
        now = self.clock.now()
        for (er, n), token in zip(batch, sampled, strict=True):
            req = er.req
            start = req.num_computed_tokens
            req.num_computed_tokens = start + n
            self.stats.computed_tokens += n
            self.stats.computed_prompt_tokens += max(0, min(start + n, req.num_prompt_tokens)
                                                     - start)
            if token is not None:
                req.append_output_token_ids(token)
                if er.first_token is None:
                    er.first_token = now
        self.mgr.after_step([er.req for er, _ in batch])
        for er, _ in batch:
            if er.req.num_output_tokens >= er.max_tokens:
                self.running.remove(er)
                self._finish(er, RequestStatus.FINISHED_LENGTH_CAPPED)

    def _finish(self, er: EngineRequest, status: RequestStatus) -> None:
        req = er.req
        req.status = status
        self.mgr.finish(req)  # True: the manager frees the blocks when its stores end
        er.holds_blocks = False
        self.model.remove(er.rid)
        if status is RequestStatus.FINISHED_ERROR:
            self.stats.failed += 1
        self.stats.finished += 1
        now = self.clock.now()
        result = Result(er.rid, er.tenant, tuple(req.all_token_ids[:req.num_prompt_tokens]),
                        tuple(req.all_token_ids[req.num_prompt_tokens:]), status,
                        req.num_preemptions,
                        None if er.first_token is None else er.first_token - er.arrived,
                        now - er.arrived)
        if not er.done.done():
            er.done.set_result(result)

    async def aclose(self) -> None:
        """Stop the background tasks (lookups, load watchers). Requests still queued keep
        their state; the manager's ``aclose`` releases what its jobs hold."""
        tasks = [*self._watchers, *self._timers,
                 *(er.lookup_task for er in self._all() if er.lookup_task)]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def _all(self) -> list[EngineRequest]:
        return [*self.running, *self.waiting, *self.kv_holding, *self.loading.values(),
                *self.transferring]
