"""``AsyncKVManager``: the engine-facing KV-cache manager with connector offload.

It owns one core :class:`~kvplugin.core.manager.KVCacheManager`, the host KV memory, the
connector, the tenants' key namespaces and every in-flight job, all on one event loop: the
core is called synchronously, and no ``await`` ever separates a decision from the
bookkeeping that depends on it (``allocate`` and ``after_step`` are plain methods; a job's
result is applied in the loop iteration it arrives in).

Per request, following vLLM's scheduler protocol::

    req = mgr.new_request(rid, tokens, tenant="acme")
    found = await mgr.lookup(req)                       # local + external hit, bounded
    adm = mgr.allocate(req, found, num_new_tokens=n)    # None: no room, nothing taken
    if adm.loading:                                     # WAITING_FOR_REMOTE_KVS meanwhile
        outcome = await mgr.wait_load(req)              # req.num_computed_tokens set
        adm = mgr.allocate(req, num_new_tokens=n)       # slots for the rest
    ... the model step writes KV into mgr.memory's pages of the blocks
        mgr.core.get_block_ids(rid) names; the engine advances req.num_computed_tokens ...
    mgr.after_step([req])                               # offer newly computed chunks
    adm = mgr.allocate(req, num_new_tokens=1)           # each next step, until it ends
    mgr.finish(req)                                     # True: freeing waits for stores

The README's engine snippet is this protocol as a complete script (a test runs it).

Tenants: the device cache separates them through the request's cache salt (built from the
tenant, so it enters the first block's hash as vLLM's ``cache_salt`` does); the tiers through
the key namespace.

Layouts: full attention, MLA, sliding window, chunked local attention and Mamba "align"
groups in any mix with at least one attention group. A hit is claimed only at a boundary
every group can be restored at (:func:`kvplugin.aio.plans.reconcile`), including a deeper
local attention hit whose Mamba state lags: only that state is loaded. The manager owns the
core's per-step queues: it runs the copy-on-write copies in host memory right after each
allocation, and ``after_step`` drains the boundary-state offers (stored as checkpoints, see
:mod:`kvplugin.aio.stores`), the zeroing list, and starts the core's next step (the Mamba
same-step guard). So ``after_step`` must follow every model step, before the next step's
allocations, and the engine must not drain those queues itself.

Offload off: ``AsyncKVManager(core, None, config)`` keeps the device prefix cache, the
tenants (isolation, quotas, stats) and the engine protocol unchanged, and never touches a
tier: lookups answer the device hit without awaiting anything, nothing is stored, ``tiers``
is empty and every offload counter stays 0. An engine runs the same code either way.

Latency: tier lookups, load jobs and store jobs are timed into histograms
(:class:`~kvplugin.aio.values.Latency`, :meth:`AsyncKVManager.latency`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterable, Sequence

from kvplugin.aio import group_kinds, probe
from kvplugin.aio.admission import Admissions, Step
from kvplugin.aio.jobs import (
    IOGate,
    LoadJob,
    RunningJobs,
    StoreJob,
    connector_tiers,
    tier_names,
)
from kvplugin.aio.keys import KeySpace
from kvplugin.aio.ledger import TokenLedger
from kvplugin.aio.loadcost import LoadCosts
from kvplugin.aio.loads import Loads
from kvplugin.aio.memory import GroupShape, HostKVMemory, layout_of, shape_of_group
from kvplugin.aio.offload_ledger import OffloadLedger, TierQuotas
from kvplugin.aio.plans import StateOffer
from kvplugin.aio.reqstate import ReqState
from kvplugin.aio.stores import Holds, JobContext, Stores
from kvplugin.aio.tenants import TenantPolicy, Tenants, TenantStats, device_salt
from kvplugin.aio.tier_events import TierEventView, tier_media
from kvplugin.aio.values import (
    Admission,
    Latency,
    LatencyRecorder,
    LoadOutcome,
    Lookup,
    OffloadConfig,
    OffloadStats,
    Residency,
    ResidencyRecorder,
    StoreMode,
)
from kvplugin.connectors.base import Connector, ConnectorStats
from kvplugin.connectors.events import TierEvent
from kvplugin.core.events import KVCacheEvent
from kvplugin.core.hashing import BlockHasher, HashContext
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.request import LoRAInfo, Request, RequestStatus

__all__ = ["AsyncKVManager", "device_salt"]

logger = logging.getLogger(__name__)


def _host_memory(core: KVCacheManager, memory: HostKVMemory | None,
                 offload: OffloadConfig | None) -> tuple[list[GroupShape], HostKVMemory]:
    """The core's group shapes and the host memory of its blocks (given or made), after
    checking that the core, the memory and (offload on) the store budget fit together."""
    if not core.enable_caching:
        raise ValueError("offload needs prefix caching enabled in the core")
    kv_config = core.kv_cache_config
    shapes = [shape_of_group(g) for g in kv_config.kv_cache_groups]
    if memory is None:
        memory = HostKVMemory(kv_config.num_blocks, shapes)
    elif memory.num_blocks != kv_config.num_blocks or list(memory.shapes) != shapes:
        raise ValueError("host memory does not match the core's blocks and groups")
    if core.use_eagle and any(not group_kinds.plan_kind(s.kind).chunked for s in shapes):
        raise ValueError("EAGLE block drop is not supported with Mamba offload")
    chunk_bytes = max(s.page_bytes for s in shapes) * (offload.chunk_blocks if offload else 0)
    if offload is not None and offload.store_budget_bytes < chunk_bytes:
        raise ValueError(f"store_budget_bytes {offload.store_budget_bytes} is below one "
                         f"chunk ({chunk_bytes} bytes): every store would be shed")
    return shapes, memory


class AsyncKVManager:
    def __init__(self, core: KVCacheManager, connector: Connector | None,
                 config: OffloadConfig, *,
                 memory: HostKVMemory | None = None,
                 hash_context: HashContext | None = None,
                 tenants: TenantPolicy | None = None,
                 load_costs: LoadCosts | None = None) -> None:
        shapes, memory = _host_memory(core, memory, None if connector is None else config)
        hbs = core.offload_view().hash_block_size
        has_state = any(not group_kinds.plan_kind(s.kind).chunked for s in shapes)
        self.core = core
        self.connector = connector
        self.config = config
        self.memory = memory
        self.keyspace = KeySpace(config.model, shapes, hbs, config.chunk_blocks)
        # A state boundary must be one the core can hit: the hash unit when sub-block
        # (partial) hits are on, else the scheduler block.
        self.layout = layout_of(shapes, config.chunk_blocks, core.offload_view().lookup_unit)
        self.hasher = BlockHasher(hash_context or HashContext.create("sha256_cbor"), hbs)
        # Tier names, fastest first; empty with offload off (no connector).
        self.tiers: tuple[str, ...] = () if connector is None else tier_names(connector)
        self._hash_block_size = hbs
        # Per-group hits (a lagging Mamba state) are only reconciled for Mamba + full
        # attention layouts, as the core's get_computed_blocks_for_connector.
        self._divergent = has_state and not self.layout.has_null_blocks
        self._gate = IOGate(config.max_io)
        self._requests: dict[str, ReqState] = {}
        self._stats = OffloadStats()
        self.ledger = TokenLedger(self.tiers)  # finished requests' prompt tokens, by source
        policy = tenants if tenants is not None else TenantPolicy()
        # Tiers whose events report every object they hold: quotas count bytes held there.
        reporting = [] if connector is None else [
            name for name, t in zip(self.tiers, connector_tiers(connector), strict=True)
            if t.reports_objects]
        # What to store, the budget, tier quotas and every offload counter (global and per
        # tenant): one synchronous state machine this manager executes.
        self.offloads = OffloadLedger(
            self.layout, self.keyspace, page_bytes=[s.page_bytes for s in shapes],
            tiers=self.tiers, store_budget_bytes=config.store_budget_bytes,
            store_prompt_only=config.store_prompt_only, quotas=TierQuotas.of_policy(policy),
            reporting=reporting, stats=self._stats)
        self.tenants = Tenants(policy, core=core, keyspace=self.keyspace, layout=self.layout,
                               hasher=self.hasher, tiers=self.tiers, ledger=self.offloads)
        self._jobs = RunningJobs()
        self._holds = Holds(core)
        self._latency = LatencyRecorder(self.tiers)
        self._residency = ResidencyRecorder()
        self._loads: Loads | None = None
        self._stores: Stores | None = None
        self.tier_events: TierEventView | None = None
        self._tier_backlog: list[TierEvent] = []  # pumped, not yet given to tier_events
        # Load or recompute by cost (None: every claim is loaded); the loads report back.
        self.load_costs = load_costs if connector is not None else None
        if connector is not None:
            if config.tier_events:
                self.tier_events = TierEventView(media=tier_media(connector_tiers(connector)))
            if self.offloads.holdings is not None or self.tier_events is not None:
                connector.watch_events()
            ctx = JobContext(
                core=core, connector=connector, tiers=self.tiers, config=config,
                memory=memory, layout=self.layout, keyspace=self.keyspace, gate=self._gate,
                stats=self._stats, jobs=self._jobs, holds=self._holds, latency=self._latency,
                ledger=self.offloads, events=self.tier_events,
                tier_events=self.apply_tier_events)
            self._loads = Loads(ctx, costs=self.load_costs)
            self._stores = Stores(ctx)
        self._admissions = Admissions(
            core, self.layout, memory, tiers=self.tiers, ledger=self.offloads,
            tenants=self.tenants, loads=self._loads, costs=self.load_costs, stats=self._stats,
            divergent=self._divergent)
        self._closed = False

    @property
    def offload(self) -> bool:
        """Whether a connector backs the device cache (False: offload off)."""
        return self.connector is not None

    # ------------------------------------------------------------------ requests
    def new_request(self, request_id: str, prompt_token_ids: Sequence[int], *, tenant: str,
                    cache_salt: str | None = None, lora_request: LoRAInfo | None = None,
                    skip_reading_prefix_cache: bool = False, prefix_group: str | None = None,
                    shared_prefix_tokens: int | None = None) -> Request:
        """A core request of ``tenant``, hashed with the manager's hasher and salted so no
        other tenant's prefix can match it; with ``prefix_group`` (one the deployment
        declared for the tenant), its first ``shared_prefix_tokens`` are shared with the
        group's members (see :mod:`kvplugin.aio.tenants`)."""
        self._check_open()
        if request_id in self._requests:
            raise ValueError(f"request {request_id!r} already exists")
        scope = self.tenants.scope(tenant, cache_salt=cache_salt, prefix_group=prefix_group,
                                   shared_prefix_tokens=shared_prefix_tokens,
                                   num_prompt_tokens=len(prompt_token_ids))
        req = Request(request_id, prompt_token_ids, block_hasher=scope.hasher or self.hasher,
                      lora_request=lora_request, cache_salt=scope.cache_salt,
                      skip_reading_prefix_cache=skip_reading_prefix_cache)
        tenant = scope.key_scope.tenant
        offload = self.offloads.open(request_id, tenant, scope.key_scope,
                                     req.num_prompt_tokens)
        st = ReqState(req, tenant, scope.key_scope, offload)
        self._requests[request_id] = st
        self.tenants.opened(st)
        return req

    def tenant_of(self, req: Request) -> str:
        return self._state(req).tenant

    def tenant_stats(self) -> dict[str, TenantStats]:
        """Per-tenant counters, summing to :meth:`stats`' (see :mod:`kvplugin.aio.tenants`)."""
        return self.tenants.stats()

    def _state(self, req: Request) -> ReqState:
        st = self._requests.get(req.request_id)
        if st is None or st.req is not req:
            raise ValueError(f"request {req.request_id!r} is not managed here "
                             "(create it with new_request; finished requests are forgotten)")
        return st

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the AsyncKVManager is closed")

    def _hash_tokens(self, req: Request) -> int:
        return len(req.block_hashes) * self._hash_block_size

    # ------------------------------------------------------------------ lookup
    async def lookup(self, req: Request) -> Lookup:
        """The local hit and what the tiers hold beyond it, within ``lookup_timeout``: a
        slow or dead connector is a miss. Read-only; safe to cancel."""
        self._check_open()
        st = self._state(req)
        if st.admitted:
            raise ValueError(f"request {req.request_id!r} already holds blocks")
        hit = self._admissions.local_hit(req).hit
        todo = probe.windows_past(self.layout, req.num_tokens, self._hash_tokens(req), hit)
        miss = Lookup(req.request_id, hit.reconciled, 0, todo.first,
                      tuple(() for _ in todo.windows))
        connector = self.connector
        if (connector is None or st.skip_external or req.skip_reading_prefix_cache
                or not probe.worth_asking(self.layout, todo, hit)):
            return miss
        self._stats.lookups += 1
        started = time.perf_counter()
        try:
            done = await probe.lookup(
                connector, self.layout, self.keyspace, st.scope, req.block_hashes, todo,
                num_tokens=req.num_tokens, hit=hit, timeout=self.config.lookup_timeout,
                chunk_keys=functools.partial(st.chunk_keys, self.keyspace))
        except TimeoutError:
            self._stats.lookup_timeouts += 1
            return dataclasses.replace(miss, timed_out=True)
        finally:
            # Every lookup that asked the tiers is timed: answered, timed out or cancelled.
            self._latency.lookup.observe(time.perf_counter() - started)
        claim, answer = done.claim, done.answer
        if claim is None or answer is None:
            raise RuntimeError(f"lookup of {req.request_id!r}: the probe answered "
                               "without a claim or an answer")
        return Lookup(req.request_id, claim.local, claim.external, todo.first, answer.levels,
                      False, answer.states, claim.state_at)

    # ------------------------------------------------------------------ allocation
    def allocate(self, req: Request, lookup: Lookup | None = None, *,
                 num_new_tokens: int | None = None, num_lookahead_tokens: int = 0,
                 reserved_blocks: int = 0, has_scheduled_reqs: bool = True
                 ) -> Admission | None:
        """Slots for the request's next step; None when there is no room (nothing taken).

        ``num_new_tokens`` caps the tokens scheduled (the step's token budget); by default
        every token not yet computed (with Mamba groups, cut where a state must be written:
        ``Admission.num_new_tokens`` is what to compute). A request that holds no blocks is
        admitted: the local hit is taken afresh and, with a ``lookup``, what the tiers hold
        is claimed where every group can be restored. A claim allocates only the hit (vLLM
        schedules no new tokens for an async load), sets the request
        ``WAITING_FOR_REMOTE_KVS`` and starts the load. A request that holds blocks just
        grows. The other arguments are the core's.
        """
        self._check_open()
        st = self._state(req)
        if st.load is not None:
            raise ValueError(f"request {req.request_id!r} is waiting for its KV load")
        if lookup is not None and lookup.request_id != req.request_id:
            raise ValueError(f"lookup of {lookup.request_id!r} given for {req.request_id!r}")
        step = Step(num_new_tokens, num_lookahead_tokens, reserved_blocks, has_scheduled_reqs)
        if not st.admitted:
            return self._admissions.admit(st, lookup, step)
        if lookup is not None:
            raise ValueError(f"request {req.request_id!r} already holds blocks; "
                             "a lookup only applies to an admission")
        return self._admissions.grow(st, step)

    # ------------------------------------------------------------------ loads
    async def wait_load(self, req: Request) -> LoadOutcome:
        """Wait until the request's load has ended (its outcome stays until the next
        admission)."""
        st = self._state(req)
        if st.load is None and st.outcome is None:
            raise ValueError(f"request {req.request_id!r} has no load")
        await st.loaded.wait()
        if st.outcome is None:
            raise RuntimeError(f"the load of {req.request_id!r} ended without an outcome")
        return st.outcome

    def load_outcome(self, req: Request) -> LoadOutcome | None:
        """The outcome of the request's last load, or None while it runs (or without one)."""
        return self._state(req).outcome

    # ------------------------------------------------------------------ per step
    def after_step(self, requests: Iterable[Request]) -> int:
        """Per-step hand-off, after the model step: offer the chunks these requests
        completed (every block's KV written, i.e. below ``num_computed_tokens``) and every
        Mamba boundary state the core handed over this step (of any request: an offer
        not taken now is stale) for storing. Returns the *objects* whose stores started
        (one store job may carry several: ``stats().stores`` counts jobs,
        ``stats().stored_chunks`` the chunk objects once written); duplicates and objects
        over the byte budget are dropped, counted (``stores_deduplicated``,
        ``stores_shed``)."""
        self._check_open()
        offers: dict[str, list[StateOffer]] = {
            rid: [StateOffer(*o) for o in lst]
            for rid, lst in self.core.take_boundary_state_offloads().items()}
        started = 0
        stores = self._stores
        for req in requests:
            st = self._state(req)  # misuse raises with offload off too
            st.ledger.advanced(req.num_computed_tokens)
            if stores is not None:
                started += stores.offer(st, offers.pop(req.request_id, ()))
        for rid, rest in offers.items():
            other = self._requests.get(rid)
            if stores is None:
                continue  # offload off: the core's offers are drained, nothing is stored
            if other is None:
                self._stats.states_dropped += len(rest)
            else:
                started += stores.offer(other, rest)
        # The step ran: states cached while scheduling it are on the device now (the
        # Mamba same-step guard), and new attention blocks need no zeroing in host memory.
        self.core.take_new_block_ids()
        self.core.new_step_starts()
        return started

    # ------------------------------------------------------------------ freeing
    def finish(self, req: Request) -> bool:
        """The request is done: offer its last chunks and its finish-time Mamba partial
        tail, then free its blocks. Returns True when freeing is delayed: a load still runs
        (it is cancelled; its blocks are freed when it has stopped), or, in ``HOLD`` mode,
        stores still read the blocks."""
        st = self._state(req)
        if not self._closed and self._stores is not None:  # offload off: nothing to offer
            tails: list[StateOffer] = []
            if st.admitted and st.load is None:
                tails = [StateOffer(*t) for t in self.core.finalize_partial_tail_offloads(req)]
            self._stores.offer(st, (), tails)
        del self._requests[req.request_id]
        self.offloads.close(st.offload)
        self.ledger.close(st.tenant, st.ledger, req.num_computed_tokens, req.num_prompt_tokens)
        self.tenants.finished(st)
        waits: set[LoadJob | StoreJob] = set()
        if st.load is not None:
            st.load.abandoned = True
            waits.add(st.load)
            if st.load.task is not None:
                st.load.task.cancel()
        if self.config.store_mode is StoreMode.HOLD:
            waits |= st.stores
        return self._release(st, waits)

    def preempt(self, req: Request) -> bool:
        """Free a running request's blocks to make room; it starts over as PREEMPTED. In
        ``HOLD`` mode blocks its stores still read are kept until those end (True)."""
        self._check_open()
        st = self._state(req)
        if st.load is not None:
            raise ValueError(f"request {req.request_id!r} is loading its KV and cannot be "
                             "preempted (as in vLLM)")
        if not st.admitted:
            raise ValueError(f"request {req.request_id!r} holds no blocks")
        waits: set[LoadJob | StoreJob] = set()
        if self.config.store_mode is StoreMode.HOLD:
            waits |= st.stores
        delayed = self._release(st, waits)
        st.ledger.preempt(req.num_computed_tokens, req.num_prompt_tokens)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = RequestStatus.PREEMPTED
        return delayed

    def _release(self, st: ReqState, waits: set[LoadJob | StoreJob]) -> bool:
        if not st.admitted:
            return False
        st.admitted = False
        self.tenants.releasing(st)
        if not waits:
            self.core.free(st.req)
            self.tenants.released(st)
            return False
        blocks = self.core.pop_blocks_for_free(st.req)
        self._holds.hold(blocks, waits)
        self.tenants.released(st, blocks, frozenset(waits))
        return True

    # ------------------------------------------------------------------ lifecycle
    @property
    def num_pending_jobs(self) -> int:
        return len(self._jobs)

    @property
    def num_held_blocks(self) -> int:
        """Blocks of finished or preempted requests kept for jobs still running."""
        return self._holds.num_blocks

    @property
    def store_bytes_in_flight(self) -> int:
        return self.offloads.bytes_in_flight

    def pending_jobs(self) -> dict[str, int]:
        """Jobs running now, by kind (``"load"``, ``"store"``)."""
        return self._jobs.by_kind()

    def has_pending_work(self) -> bool:
        """Jobs still run (vLLM's ``has_pending_push_work``: keep the engine stepping)."""
        return bool(self._jobs)

    def stats(self) -> OffloadStats:
        # The offload ledger's snapshot: the totals of its per-tenant counters filled in.
        return self.offloads.stats

    def residency(self) -> Residency | None:
        """Block residency histograms when the core samples blocks (its
        ``metrics_collector``), else None. Reading drains the collector's eviction events
        into cumulative histograms, so every event is counted once."""
        collector = self.core.metrics_collector
        if collector is None:
            return None
        self._residency.absorb(collector.drain_events())
        return self._residency.snapshot()

    def latency(self) -> Latency:
        """Snapshots of the lookup, load (per tier) and store latency histograms."""
        return self._latency.snapshot()

    def tier_stats(self) -> list[ConnectorStats]:
        """Each tier's connector counters, in the order of ``tiers`` (empty: offload off)."""
        if self.connector is None:
            return []
        return [t.stats() for t in connector_tiers(self.connector)]

    def take_events(self) -> list[KVCacheEvent]:
        """KV-cache events since the last call: the device cache's (the core's, medium GPU)
        then, with ``tier_events`` on, the tiers' (medium CPU / DISK / REDIS: blocks
        stored, removed; see :mod:`kvplugin.aio.tier_events` for what a router can and
        cannot learn). One stream for a subscriber (``kvplugin.publisher`` sends it on ZMQ)."""
        events = self.core.take_events()
        if self.tier_events is not None and self.connector is not None:
            self.apply_tier_events()
            backlog, self._tier_backlog = self._tier_backlog, []
            events += self.tier_events.apply(backlog)
        return events

    def apply_tier_events(self) -> None:
        """The tiers' events, taken once, to both who read them: the tenants' held bytes
        now, the KV-event view (tier events on) at the next take_events."""
        if self.connector is None:
            return
        got = self.connector.take_events()
        if got:
            self.offloads.apply_tier_events(got)
            if self.tier_events is not None:
                self._tier_backlog.extend(got)

    async def drain(self) -> None:
        """Wait until every job started so far (and any they lead to) has ended, and the
        load-cost probes' reads. Cancelling the wait (e.g. a ``wait_for`` timing out)
        leaves the jobs running."""
        await self._jobs.wait_all()
        if self._loads is not None:
            await self._loads.wait_probes()

    async def aclose(self) -> None:
        """Cancel and await every job (their releases run), then close the connector.
        Requests still held keep their blocks; the engine finishes them. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._jobs.wait_all(cancel=True)
            if self._loads is not None:
                await self._loads.wait_probes(cancel=True)
        finally:
            if self.config.close_connector and self.connector is not None:
                await self.connector.aclose()

    async def __aenter__(self) -> AsyncKVManager:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()
