"""The scheduler half of the vLLM connector: lookups, load and store plans, and their
outcomes, executed on the offload ledger that the native manager executes too.

The ledger (:class:`~kvplugin.aio.offload_ledger.OffloadLedger`) is *tracked* here as it
is natively: every store plan stays open until the workers report how it ended
(:mod:`._outcomes`, through vLLM's ``kv_connector_worker_meta``), so the in-flight byte
budget (``offload.store_budget_mb``), the deduplication of an object two requests store
at once and the tenants' tier byte quotas (counted on bytes *held*, from the tiers'
events) hold under vLLM as under ``kvplugin run``. Loads are booked from the workers'
reports too; hits from the lookups. The counters are the ledger's, per tenant
(:meth:`SchedulerSide.stats`: vLLM's stats channel, :mod:`._stats`).

``kv_role``: a ``kv_producer`` stores and never loads, a ``kv_consumer`` loads and never
stores, ``kv_both`` does both (prefill / decode disaggregation through a shared tier: a
consumer that comes before the producer's objects are complete finds a miss, since an
object is visible only once written whole).

Nothing here imports vLLM or torch.
"""

from __future__ import annotations

import collections
import enum
import logging
from dataclasses import dataclass
from typing import Any

from kvplugin.aio import plans
from kvplugin.aio.offload_ledger import (
    LoadPlan,
    LoadResult,
    OffloadLedger,
    OffloadRequest,
    StorePlan,
    StoreResult,
)
from kvplugin.aio.tenants import TenantPolicy
from kvplugin.integrations import _events, _lookup
from kvplugin.integrations._hits import Piece, claim_dropped, load_pieces, worth_reconciling
from kvplugin.integrations._outcomes import KVPluginWorkerMeta, Outcomes
from kvplugin.integrations._stats import KVPluginStats, RateLimitedLog, TenantBook

__all__ = ["KVRole", "LoadSpec", "Phase", "SaveSpec", "SchedulerSide", "StepPlan",
           "tenant_of_salt"]

logger = logging.getLogger(__name__)

_TENANT_SALT = "tenant="


class KVRole(enum.Enum):
    PRODUCER = "kv_producer"  # stores, never loads
    CONSUMER = "kv_consumer"  # loads, never stores
    BOTH = "kv_both"

    @classmethod
    def of(cls, value: Any) -> KVRole:
        try:
            return cls(str(value or "kv_both"))
        except ValueError:
            raise ValueError(f"KVPluginConnector: kv_role must be one of "
                             f"{', '.join(r.value for r in cls)}, got {value!r}") from None

    @property
    def loads(self) -> bool:
        return self is not KVRole.PRODUCER

    @property
    def stores(self) -> bool:
        return self is not KVRole.CONSUMER


@dataclass(slots=True)
class LoadSpec:
    """Load ``pieces`` for tokens ``[first_token, end_token)``. ``per_request``: a failure
    fails the whole request (several groups), else the blocks from the first bad one."""

    req_id: str
    pieces: list[Piece]
    is_async: bool
    first_token: int
    end_token: int
    per_request: bool = False
    broken: bool = False  # a piece has no block to land in: fails without fetching


@dataclass(slots=True)
class SaveSpec:
    """Store ``pieces`` (chunks first, then the states they make restorable) as store plan
    ``plan`` (the id the workers report its outcome under). ``reads``: the blocks of this
    step's synchronous loads that the request's table holds (its own claim, or another
    request's it hit on the device): when one of them fails, this step computed the
    pieces from bytes that never arrived, and they are withheld."""

    req_id: str
    pieces: list[Piece]
    plan: int = -1
    reads: tuple[int, ...] = ()


@dataclass(slots=True)
class StepPlan:
    """One step's work for the workers (the connector metadata's content)."""

    loads: list[LoadSpec]
    saves: list[SaveSpec]
    delayed_frees: list[str]  # finished requests waiting for their stores


class Phase(enum.Enum):
    """Where a live request is, as the scheduler half sees it."""

    LOOKED_UP = "looked_up"  # asked for a hit, not allocated yet
    SETTLING = "settling"  # admitted without a load: its hit is read at the step's end
    LOADING = "loading"  # an asynchronous load in flight
    LOADED = "loaded"  # its asynchronous load ended: vLLM allocates it once more, no query
    RUNNING = "running"


@dataclass(slots=True)
class _Req:
    """Scheduler-side state of one live request."""

    request: Any
    tenant: str  # "" when the request gets no offload (invalid or undeclared tenant)
    offload: OffloadRequest | None  # the ledger's state of it (None: no offload)
    phase: Phase = Phase.LOOKED_UP
    local_tokens: int = 0  # the device's hit at the last lookup
    async_hit: bool = False  # the last external hit was reported as an async load
    state_at: int | None = None  # the boundary of the claimed states
    stored_until: tuple[int, ...] = ()  # per group, where the tiers' chunks end (lookup)
    load_failed: bool = False  # never claim from the tiers again: vLLM recomputes


class SchedulerSide:
    """Plans, outcomes and the books of the scheduler's connector."""

    def __init__(self, ledger: OffloadLedger, lookups: _lookup.LookupClient, *,
                 policy: TenantPolicy, default_tenant: str, role: KVRole,
                 async_loads: bool, per_request: bool, divergent: bool, events_on: bool,
                 spec_kinds: list[tuple[str | None, int | None]], num_workers: int) -> None:
        self._ledger = ledger
        self._layout = ledger.layout
        self._keys = ledger.keyspace
        self._lookups = lookups
        self._policy = policy
        self._default_tenant = default_tenant
        self._role = role
        self._async_loads = async_loads
        self._per_request = per_request
        self._divergent = divergent
        self._divergent_now = divergent
        self._reconcile_for: set[str] = set()
        self._events_on = events_on
        self._spec_kinds = spec_kinds
        self._reqs: dict[str, _Req] = {}
        self._plan = StepPlan([], [], [])
        self._kvm: Any = None
        self._plans: dict[int, StorePlan] = {}  # open store plans by the id workers report
        self._load_plans: dict[str, LoadPlan] = {}  # open load plans by request
        self._next_plan = 0
        self._outcomes = Outcomes(num_workers)
        self._book = TenantBook()
        self._log = RateLimitedLog()
        self._event_counts: collections.Counter[Any] = collections.Counter()
        self.num_workers = num_workers

    def close(self) -> None:
        self._lookups.close()

    @property
    def ledger(self) -> OffloadLedger:
        return self._ledger

    def bind_kv_cache_manager(self, kvm: Any) -> None:
        self._kvm = kvm

    @property
    def divergent_now(self) -> bool:
        return self._divergent_now

    # ------------------------------------------------------------------ requests
    def _tenant(self, request: Any) -> str:
        params = request.kv_transfer_params or {}
        tenant = params.get("tenant") if isinstance(params, dict) else None
        if tenant:
            return str(tenant)
        salt = getattr(request, "cache_salt", None)
        return tenant_of_salt(salt) if salt else self._default_tenant

    def _state(self, request: Any) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            tenant = self._tenant(request)
            try:
                self._keys.namespaces(tenant)
                self._policy.quota(tenant)  # an undeclared tenant: ValueError
            except ValueError as e:
                # A user-supplied salt must not crash the scheduler: no offload for it.
                self._log.warn(f"tenant:{tenant}", "request %s: no KV offload: %s",
                               request.request_id, e)
                tenant = ""
            offload = self._ledger.open(request.request_id, tenant, tenant,
                                        request.num_prompt_tokens) if tenant else None
            st = self._reqs[request.request_id] = _Req(request, tenant, offload)
        return st

    # ------------------------------------------------------------------ lookups
    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """External hit tokens beyond the device's ``num_computed_tokens``: the deepest
        point every group can be restored at from the tiers, capped so vLLM still computes
        the last prompt token. ``None`` (look again next step): a diverged hit the tiers
        cannot extend, whose reconciled hit they can. A producer never loads."""
        st = self._state(request)
        st.phase = Phase.LOOKED_UP
        st.local_tokens = num_computed_tokens
        st.state_at, st.stored_until = None, ()
        if not st.tenant or st.load_failed or not self._role.loads:
            return 0, False
        claim = self._tier_claim(st, request, num_computed_tokens)
        st.stored_until = () if claim is None else claim.stored_until
        ext = claim.external if claim is not None and claim.local == num_computed_tokens else 0
        if self._divergent_now and self._dropped(st, request, num_computed_tokens, ext):
            self._reconcile_for.add(request.request_id)
            return None, False
        if ext <= 0 or claim is None:  # a claim of no tokens (ext > 0 implies a claim)
            return 0, False
        st.async_hit = self._async_loads
        st.state_at = claim.state_at
        return ext, self._async_loads

    def _tier_claim(self, st: _Req, request: Any, local: int) -> plans.Claim | None:
        """What the tiers add to a device hit of ``local`` tokens, asked of the worker
        that owns them; None when the lookup failed or timed out (a miss, never a
        stall)."""
        try:
            return self._lookups.claim(_lookup.ClaimQuery(
                st.tenant, request.block_hashes, request.num_tokens, local))
        except Exception as e:
            self._log.warn("lookup", "lookup for %s failed: %r (a miss)", request.request_id, e)
            return None

    def _dropped(self, st: _Req, request: Any, local: int, ext: int) -> bool:
        """Whether vLLM will drop this claim on a diverged hit and fall back to the
        reconciled hit (:func:`claim_dropped`), which the tiers extend
        (:func:`worth_reconciling`): then the request is better looked up again on the
        reconciled hit. The device lookups repeat vLLM's own (block hashes against the
        pool, nothing changed)."""
        co = getattr(self._kvm, "coordinator", None)
        fa = getattr(co, "full_attention_group_id", None)
        if (co is None or fa is None or ext >= co.scheduler_block_size
                or getattr(request, "skip_reading_prefix_cache", False)):
            return False  # no hybrid coordinator, a claim past any sub-block tail, no lookup
        cap = request.num_tokens - 1
        if not claim_dropped(co.find_longest_cache_hit_per_group(request.block_hashes, cap)[1],
                             fa, local, ext):
            return False
        _, hit, _ = co.find_longest_cache_hit(request.block_hashes, cap)
        base = hit - hit % co.scheduler_block_size
        claim = self._tier_claim(st, request, base)
        if (claim is None or claim.local != base
                or not worth_reconciling(hit, co.scheduler_block_size, claim.external)):
            return False
        logger.debug("kvplugin: %s diverged at %d (reconciled %d): the tiers extend the "
                     "reconciled hit to %d; looked up again next step", request.request_id,
                     local, hit, base + claim.external)
        return True

    # ------------------------------------------------------------------ allocation
    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        self._reconcile_for.discard(request.request_id)
        if num_external_tokens <= 0:
            # vLLM settles the local hit after this call (a kept sub-block tail, the
            # reconciled hit of a diverged one, the end of an async load or 0 after a
            # failed one): it is request.num_computed_tokens when the step's metadata is
            # built. The allocation that follows an async load is not a new admission.
            if st.phase is not Phase.LOADED:
                st.phase = Phase.SETTLING
            return
        local = max(st.local_tokens, request.num_computed_tokens)
        end = local + num_external_tokens
        self._admit(st, end, local)
        if st.offload is None:  # a claim is only made for a valid tenant
            raise RuntimeError(f"kvplugin: {request.request_id} was allocated external "
                               "tokens without an offload tenant")
        plan = self._ledger.prepare_load(st.offload, request, blocks.get_block_ids(), local,
                                         end, st.state_at)
        self._load_plans[request.request_id] = plan
        pieces = load_pieces(self._layout, plan)
        # vLLM allocated every block the plan names (the native core's rules), and a state
        # lands in a fresh block (on a diverged hit too: the claim ends past every Mamba
        # block vLLM found). A null block, or a state slot holding a cached block (another
        # prefix's state), would mean it did not: the load fails (vLLM recomputes) instead
        # of writing there.
        broken = plan.lands_on_null or self._on_cached(blocks, pieces)
        if broken:
            logger.warning("kvplugin load for %s: vLLM gave a null or cached block for a "
                           "planned object; the load fails and vLLM recomputes",
                           request.request_id)
        spec = LoadSpec(request.request_id, pieces, st.async_hit, local, end, self._per_request,
                        broken)
        st.phase = Phase.LOADING if spec.is_async else Phase.RUNNING
        self._plan.loads.append(spec)

    def _on_cached(self, blocks: Any, pieces: list[Piece]) -> bool:
        """Whether a state piece would land in a block vLLM's prefix cache holds."""
        for p in pieces:
            if p.state:
                slot = -(p.first_token // -self._layout.block_sizes[p.group]) - 1
                if getattr(blocks.blocks[p.group][slot], "block_hash", None) is not None:
                    return True
        return False

    def _admit(self, st: _Req, end: int, local: int, book: bool = True) -> None:
        """The request computes from ``end``: device hits were stored by whoever computed
        them, loaded chunks came from a tier, so stores start after both (a resumed
        request restarts here too). One admission is one prefix-cache query, booked with
        its device hit (``local``) and claim (the tiers answer as one: ``offload``)."""
        if st.offload is not None:
            self._ledger.admit(st.offload, end, st.stored_until)
            ext = end - local
            if book:
                self._ledger.book_query(st.tenant, queried_tokens=st.request.num_tokens,
                                         local=local, external=ext,
                                         by_tier={"offload": ext} if ext else {})
        st.phase = Phase.RUNNING

    # ------------------------------------------------------------------ steps
    def build_step(self, scheduler_output: Any) -> StepPlan:
        """This step's loads (planned at allocation), stores (the chunks this step's tokens
        complete, the Mamba states vLLM hands over) and delayed frees; resets the plan."""
        step, self._plan = self._plan, StepPlan([], [], [])
        # The next step looks deferred requests up on their reconciled hits.
        self._divergent_now = self._divergent and not self._reconcile_for
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers: dict[str, list[tuple[int, int, int]]] = (
            dict(block_state.boundary_state_offloads) if block_state is not None else {})
        gone = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        gone |= set(getattr(scheduler_output, "finished_req_ids", None) or ())
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is not None:
                if st.phase in (Phase.SETTLING, Phase.LOADED):
                    done = st.request.num_computed_tokens
                    self._admit(st, done, done, book=st.phase is Phase.SETTLING)
                self._rewind(st)
                self._plan_save(st, st.request.num_computed_tokens + n, step,
                                offers.pop(rid, ()), rid not in gone)
        for rid, rest in offers.items():  # offers of requests not scheduled this step
            st = self._reqs.get(rid)
            if st is not None:
                self._plan_save(st, st.request.num_computed_tokens, step, rest,
                                rid not in gone)
        self._mark_reads(step)
        return step

    def _rewind(self, st: _Req) -> None:
        """vLLM took computed tokens back (a failed load, recomputed from its first bad
        block): the chunks from there are computed again and offered again (the worker
        withheld what the failed step computed)."""
        if st.offload is not None:
            self._ledger.rewind(st.offload, st.request.num_computed_tokens)

    def _mark_reads(self, step: StepPlan) -> None:
        """Name in each store the blocks of this step's synchronous loads its request
        reads (see :class:`SaveSpec`). Synchronous loads only serve one-group layouts, so
        block ids are the first group's."""
        loaded = {b for spec in step.loads if not spec.is_async
                  for p in spec.pieces for b in p.block_ids}
        if not loaded or self._kvm is None:
            return
        for spec in step.saves:
            table = self._kvm.get_block_ids(spec.req_id)
            spec.reads = tuple(b for b in table[0] if b in loaded) if table else ()

    def _plan_save(self, st: _Req, computed_after: int, step: StepPlan, offers: Any = (),
                   alive: bool = True) -> None:
        """The ledger's plan for what this step computes (``computed_after`` tokens
        computed once it ran) and the states vLLM handed over; a preempted or finished
        request's blocks may be reused already: none of them is read. A consumer stores
        nothing."""
        if self._kvm is None or st.offload is None or not self._role.stores:
            return
        req = st.request
        plan = self._ledger.prepare_store(
            st.offload, req, computed=computed_after,
            table=self._kvm.get_block_ids(req.request_id) if alive else (),
            offers=[plans.StateOffer(*o) for o in offers],
            alive=alive and st.phase is not Phase.LOADING)
        if plan is not None:
            step.saves.append(self._save_spec(st, plan))

    def register_partial_tail(self, request: Any, block_ids: tuple[list[int], ...],
                              tails: list[tuple[int, int, int]]) -> bool:
        """Store the Mamba state the request's own block holds at its last prompt boundary
        (no token was forwarded past it). The blocks stay until the store is done: the
        request's ``request_finished`` delays the free."""
        st = self._reqs.get(request.request_id)
        if (st is None or st.offload is None or st.phase is Phase.LOADING
                or not self._role.stores):
            return False
        plan = self._ledger.prepare_store(st.offload, request,
                                          computed=request.num_computed_tokens, table=block_ids,
                                          tails=[plans.StateOffer(*t) for t in tails])
        if plan is None:
            return False
        self._plan.saves.append(self._save_spec(st, plan))
        return True

    def _save_spec(self, st: _Req, plan: StorePlan) -> SaveSpec:
        lay = self._layout
        pid = self._next_plan
        self._next_plan += 1
        self._plans[pid] = plan
        pieces = [Piece(o.key, o.group, list(o.block_ids),
                        o.index if o.state else o.index * lay.chunk_tokens(o.group),
                        state=o.state,
                        event=_events.describe(o, st.request, self._keys,
                                               self._spec_kinds[o.group])
                        if self._events_on else None)
                  for o in plan.objects]
        return SaveSpec(st.request.request_id, pieces, pid)

    # ------------------------------------------------------------------ outcomes
    def update_connector_output(self, output: Any) -> None:
        """The workers' results: async loads that ended, failed receives, and (their
        worker metadata) the tiers' events and how each store plan and load ended."""
        for rid in output.finished_recving or ():
            st = self._reqs.get(rid)
            if st is not None and st.phase is Phase.LOADING:
                st.phase = Phase.LOADED
        for rid in getattr(output, "failed_recving", None) or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.load_failed = True
        events = getattr(output, "kv_cache_events", None)
        if events is not None:
            self._event_counts.update(events.get_all_events())
        meta = getattr(output, "kv_connector_worker_meta", None)
        if isinstance(meta, KVPluginWorkerMeta):
            self.apply_reports(meta)

    def take_events(self) -> list[Any]:
        """``BlockStored`` of the objects every worker has stored (see :mod:`._events`)."""
        done = [e for e, n in self._event_counts.items() if n >= self.num_workers]
        for e in done:
            del self._event_counts[e]
        return done

    def apply_reports(self, meta: KVPluginWorkerMeta) -> None:
        # The tiers' names, as the workers built them (extra connectors name their own).
        if meta.tiers and meta.tiers != self._ledger.tiers:
            self._ledger.name_tiers(meta.tiers)
        # Events first: a store that ended had its writes' events recorded before it did,
        # and the ledger settles an object no tier holds as gone.
        self._ledger.apply_tier_events(meta.events)
        for part in meta.stores:
            o = self._outcomes.store_ended(part)
            if o is None:
                continue
            plan = self._plans.pop(o.plan, None)
            if plan is None:
                self._log.warn("plan", "a worker reported store plan %d, which is not open "
                               "(ignored)", o.plan)
                continue
            self._ledger.complete_store(plan, StoreResult(o.ok, o.tier_counts))
        tiers = self._ledger.tiers
        for lpart in meta.loads:
            lo = self._outcomes.load_ended(lpart)
            lplan = None if lo is None else self._load_plans.pop(lo.req_id, None)
            if lo is None or lplan is None:
                continue
            copied = tuple((tiers[level] if 0 <= level < len(tiers) else "offload", n, state)
                           for level, n, state in lo.copied)
            # A request that went away while its load ran: only what it copied is booked.
            gone = lo.req_id not in self._reqs
            self._ledger.complete_load(lplan, LoadResult(verified=lo.verified, abandoned=gone,
                                                         copied=copied))

    # ------------------------------------------------------------------ finish
    def request_finished(self, request: Any) -> bool:
        """Whether vLLM keeps the blocks until the workers have copied the request's last
        pieces out: only when a store of it waits for the next step (a partial tail
        registered at finish); every earlier store was copied at its step's
        ``wait_for_save``, and the tiers write from the copies. Never while its async load
        is in flight: vLLM frees those itself when the load reports, and would free
        twice."""
        rid = request.request_id
        self._reconcile_for.discard(rid)
        st = self._reqs.pop(rid, None)
        if st is not None and st.offload is not None:
            self._ledger.close(st.offload)
        if (st is None or st.phase is Phase.LOADING
                or not any(spec.req_id == rid for spec in self._plan.saves)):
            return False
        self._plan.delayed_frees.append(request.request_id)
        return True

    def stats(self) -> KVPluginStats | None:
        """The ledger's per-tenant counts since the last call, and bytes held per tenant
        and tier now (:class:`~kvplugin.integrations._stats.TenantBook`)."""
        return self._book.delta(self._ledger)


def tenant_of_salt(cache_salt: str) -> str:
    """The tenant a request's ``cache_salt`` names. The native manager salts a tenant's
    requests ``tenant=<t>`` or ``tenant=<t>;salt=<s>`` (:func:`kvplugin.aio.tenants.
    device_salt`): such a request hashes, and is keyed, exactly as the native one; any
    other salt is the tenant's name itself."""
    if cache_salt.startswith(_TENANT_SALT):
        return cache_salt[len(_TENANT_SALT):].split(";salt=", 1)[0]
    return cache_salt
