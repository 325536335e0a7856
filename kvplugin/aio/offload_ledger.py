"""The offload ledger: one synchronous state machine of what to store and load, what was
stored and loaded, and whom it is charged to, executed by both integrations.

No asyncio, no I/O, no core objects, no callbacks into an executor: what a decision needs
(the request's blocks, offered states no longer held, tier quotas, the tiers' events) comes
in as data. An executor (the native :class:`~kvplugin.aio.manager.AsyncKVManager`, the
vLLM connector's scheduler half) drives it with a few verbs, in the vocabulary of vLLM's
``OffloadingManager``:

* :meth:`~OffloadLedger.open` / :meth:`~OffloadLedger.close` a request;
  :meth:`~OffloadLedger.admit` its hit (and :meth:`~OffloadLedger.book_query` the
  query's hits); :meth:`~OffloadLedger.rewind` it when tokens were taken back;
* :meth:`~OffloadLedger.prepare_store` -> :class:`StorePlan` or None, run by the executor,
  then :meth:`~OffloadLedger.complete_store` with its :class:`StoreResult`;
* :meth:`~OffloadLedger.prepare_load` -> :class:`LoadPlan`, then
  :meth:`~OffloadLedger.complete_load` with its :class:`LoadResult`;
* :meth:`~OffloadLedger.apply_tier_events` (the tiers' stored / removed objects).

Every plan has a state (:class:`PlanState`); completing one twice, or one this ledger did
not prepare, raises :class:`PlanError` before anything changes. Every cursor, hole, budget
byte, tier quota and counter (global and per tenant) changes here, from the event itself.

Per request (:class:`OffloadRequest`): each chunked group's store cursor (the first chunk
not yet offered), ``known_until`` (states at or below the admitted hit came with it) and the
``hole`` (the first token of a chunk that could not be stored: no state past it is a
complete checkpoint). The decisions themselves are :mod:`kvplugin.aio.plans`'.

A *tracked* ledger (``store_budget_bytes`` set; both executors report every store's end)
keeps the registry of objects being stored (a second request's store of the same object is
deduplicated) and the in-flight byte budget (a store over it is shed). An untracked one
decides the same objects without either.

Tenant tier byte quotas (:class:`TierQuotas`) count bytes *held* (:mod:`kvplugin.aio.
holdings`) on the ``reporting`` tiers (their events complete), bytes written elsewhere;
before a store of a tenant with a quota the executor applies the tiers' events so far
(:meth:`~OffloadLedger.needs_tier_events`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from kvplugin.aio import plans
from kvplugin.aio.holdings import TierHoldings
from kvplugin.aio.keys import KeyScope, KeySpace
from kvplugin.aio.offload_types import (
    NO_HOLE,
    LoadObject,
    LoadPlan,
    LoadResult,
    OffloadRequest,
    PlanError,
    PlanState,
    RequestView,
    StoreObject,
    StorePlan,
    StoreResult,
    TenantCounters,
    TierQuotas,
)
from kvplugin.aio.plans import StateOffer
from kvplugin.aio.values import OffloadStats
from kvplugin.connectors.events import TierEvent

NO_QUOTAS = TierQuotas()

__all__ = ["NO_HOLE", "NO_QUOTAS", "LoadObject", "LoadPlan", "LoadResult", "OffloadLedger",
           "OffloadRequest", "PlanError", "PlanState", "RequestView", "StoreObject",
           "StorePlan", "StoreResult", "TenantCounters", "TierQuotas"]


# The counters a tenant has (TenantCounters) and the global stats too: booked per tenant
# only, the global figure is their sum (OffloadLedger.stats).
PER_TENANT = ("queries", "queried_tokens", "loads", "loads_failed", "loads_cancelled",
              "loaded_bytes", "stores", "stored_chunks", "stored_bytes", "stores_failed",
              "stores_shed", "stores_shed_quota", "stores_deduplicated", "quota_refusals",
              "quota_evictions")
DEVICE = "device"  # the device cache's hit tokens, beside each tier's


def _bump(counts: dict[str, int], key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n


class OffloadLedger:
    """Offers, plans and their outcomes, the budget, tier quotas and counters."""

    def __init__(self, layout: plans.Layout, keyspace: KeySpace | None, *,
                 page_bytes: Sequence[int], tiers: Sequence[str],
                 store_budget_bytes: int | None, store_prompt_only: bool = False,
                 quotas: TierQuotas = NO_QUOTAS, reporting: Iterable[str] = (),
                 stats: OffloadStats | None = None) -> None:
        self.layout = layout
        # None: the executor names every object itself (vLLM's secondary tier is handed
        # keys, not requests) and uses the keyed verbs only.
        self._keyspace = keyspace
        self._stats = stats if stats is not None else OffloadStats()
        self._page_bytes = tuple(page_bytes)
        self._tiers = tuple(tiers)
        self._budget = store_budget_bytes
        self._prompt_only = store_prompt_only
        self._quotas = quotas
        self._hbs = keyspace.hash_block_size if keyspace is not None else 1
        self._chunk_tokens = tuple(layout.chunk_tokens(g) if layout.chunked(g) else 0
                                   for g in range(layout.num_groups))
        self._storing: set[str] = set()  # key ids of objects being stored (tracked)
        self._open: set[StorePlan] = set()  # tracked plans prepared here, not completed
        self._loading: set[LoadPlan] = set()  # load plans prepared here, not completed
        self._bytes = 0
        self._tenants: dict[str, TenantCounters] = {}
        # Held tier bytes: only with a tier quota somewhere.
        self.holdings: TierHoldings | None = TierHoldings() if quotas.any() else None
        self._reporting = frozenset(reporting)

    @property
    def keyspace(self) -> KeySpace:
        if self._keyspace is None:
            raise PlanError("this ledger has no key space: its executor names the objects "
                            "(prepare_keyed_store, book_keyed_load)")
        return self._keyspace

    @property
    def stats(self) -> OffloadStats:
        """A snapshot of the global counters. Those a tenant has are booked once, per
        tenant, and summed here (:data:`PER_TENANT`, the device's and each tier's hit
        tokens); the rest (states, chunks loaded, tokens recomputed, ...) have no tenant
        and are booked globally."""
        s, per = self._stats.copy(), self._tenants.values()
        for name in PER_TENANT:
            setattr(s, name, sum(getattr(c, name) for c in per))
        s.local_hit_tokens = sum(c.hit_tokens.get(DEVICE, 0) for c in per)
        by_tier: dict[str, int] = {}
        for c in per:
            for tier, n in c.hit_tokens.items():
                if tier != DEVICE:
                    _bump(by_tier, tier, n)
        s.hit_tokens_by_tier = by_tier
        return s

    @property
    def loaded_states(self) -> int:
        """Mamba states restored so far (what :attr:`stats` says, without the snapshot)."""
        return self._stats.loaded_states

    @property
    def tracked(self) -> bool:
        return self._budget is not None

    @property
    def tiers(self) -> tuple[str, ...]:
        """The tier names stores are charged on, fastest first."""
        return self._tiers

    def name_tiers(self, tiers: Sequence[str]) -> None:
        """The tiers stores are charged on, learned late (the vLLM scheduler hears them from
        its workers, which build the tiers)."""
        self._tiers = tuple(tiers)

    @property
    def bytes_in_flight(self) -> int:
        return self._bytes

    def tenant(self, tenant: str) -> TenantCounters:
        c = self._tenants.get(tenant)
        if c is None:
            c = self._tenants[tenant] = TenantCounters()
        return c

    def tenants(self) -> dict[str, TenantCounters]:
        return self._tenants

    # ------------------------------------------------------------------ requests
    def open(self, request_id: str, tenant: str, scope: KeyScope | str,
             num_prompt_tokens: int) -> OffloadRequest:
        c = self.tenant(tenant)
        c.requests += 1
        c.prompt_tokens += num_prompt_tokens
        n = self.layout.num_groups
        return OffloadRequest(request_id, tenant, scope, [0] * n, keys=[[] for _ in range(n)])

    def close(self, rq: OffloadRequest) -> None:
        """The request finished: no load is planned for it any more (its stores in flight
        still complete), and its derived keys are let go."""
        rq.closed = True
        rq.keys = [[] for _ in rq.keys]

    def admit(self, rq: OffloadRequest, end: int, stored_until: Sequence[int] = ()) -> None:
        """The request computes from ``end`` (its device hit and claim): chunks inside it
        came from somewhere that stored them, and so did states up to it. Chunks its
        lookup found stored beyond the claim (``stored_until``: per group, the end of what
        the tiers hold, :attr:`~kvplugin.aio.plans.Claim.stored_until`) need no store
        either (vLLM's chunk-level policy)."""
        self._check_live(rq)
        for g in self.layout.chunked_groups:
            n = end // self._chunk_tokens[g]
            if stored_until:
                n = max(n, stored_until[g])
            rq.next_chunk[g] = n
        rq.known_until = end
        rq.hole = NO_HOLE

    def rewind(self, rq: OffloadRequest, done: int) -> None:
        """The request's computed tokens are ``done``: below where it was admitted from
        (a load verified less than it claimed), the chunks from there are computed, and
        offered, again; anything else changes nothing (the cursor may be past ``done``:
        chunks its lookup found stored are skipped)."""
        if done >= rq.known_until:
            return
        for g in self.layout.chunked_groups:
            rq.next_chunk[g] = min(rq.next_chunk[g], done // self._chunk_tokens[g])
        rq.known_until = min(rq.known_until, done)

    def book_query(self, tenant: str, *, queried_tokens: int, local: int, external: int,
                   by_tier: Mapping[str, int]) -> None:
        """An admission's prefix-cache query: its tokens, the device hit, the claim (and
        its tokens per tier)."""
        c = self.tenant(tenant)
        self._stats.external_hit_tokens += external  # the claim (its tiers may not add up)
        c.queries += 1
        c.queried_tokens += queried_tokens
        _bump(c.hit_tokens, DEVICE, local)
        for name, n in by_tier.items():
            _bump(c.hit_tokens, name, n)

    def refused(self, tenant: str) -> None:
        """An admission refused over the tenant's in-use quota."""
        self.tenant(tenant).quota_refusals += 1

    def quota_evicted(self, tenant: str, n: int) -> None:
        self.tenant(tenant).quota_evictions += n

    # ------------------------------------------------------------------ stores
    def committed(self, req: RequestView, computed: int) -> int:
        """The tokens whose KV may be stored once ``computed`` are computed."""
        return min(computed, req.num_prompt_tokens) if self._prompt_only else computed

    def has_new_chunks(self, rq: OffloadRequest, req: RequestView, computed: int) -> bool:
        """Whether a chunk became storable: most steps complete none (a decode step adds
        one token), and an offer without a chunk or a state is a no-op, so executors skip
        it on their step path."""
        ready = min(self.committed(req, computed), len(req.block_hashes) * self._hbs)
        return any(ready // self._chunk_tokens[g] > rq.next_chunk[g]
                   for g in self.layout.chunked_groups)

    def prepare_store(self, rq: OffloadRequest, req: RequestView, *, computed: int,
                      table: Sequence[Sequence[int]], offers: Sequence[StateOffer] = (),
                      tails: Sequence[StateOffer] = (), alive: bool = True,
                      stale: Iterable[StateOffer] = ()) -> StorePlan | None:
        """What to store now that ``computed`` tokens of ``req`` are computed (its KV in
        ``table``, its block ids per group): the chunks that became storable, then the
        state ``offers`` (``tails``: finish-time partial tails) worth keeping. ``alive``
        False (its blocks may be reused): nothing is read, every offer dropped. ``stale``:
        offered blocks that no longer hold the request's state (evicted and reused since
        the offer). None: nothing to store. A tracked plan is registered (budget,
        duplicates) until :meth:`complete_store`."""
        s = self._stats
        if not alive:
            s.states_dropped += len(offers) + len(tails)
            return None
        chunks = self._chunk_objects(rq, req, computed, table)
        c = self.tenant(rq.tenant)
        nbytes = sum(o.nbytes for o in chunks) + sum(self._page_bytes[o.group]
                                                     for o in (*offers, *tails))
        if nbytes and self._over_tier_quota(rq.tenant, c, nbytes):
            self._shed_quota(rq, c, chunks, len(offers) + len(tails))
            return None
        states = self._state_objects(rq, req, offers, tails, frozenset(stale))
        if not chunks and not states:
            return None
        take = self._select(rq, c, chunks)
        taken = {o.key.id for o in take}
        for o in chunks:
            if o.key.id not in taken and o.key.id not in self._storing:  # shed
                rq.hole = min(rq.hole, o.index * self._chunk_tokens[o.group])
        kept = [o for o in states if o.index <= rq.hole]
        s.states_dropped += len(states) - len(kept)
        take += self._select(rq, c, kept, sum(o.nbytes for o in take))
        if not take:
            return None
        return self._register(rq, c, StorePlan(rq, tuple(take), self._chunk_tokens,
                                               self.tracked))

    def _chunk_objects(self, rq: OffloadRequest, req: RequestView, computed: int,
                       table: Sequence[Sequence[int]]) -> list[StoreObject]:
        hashes = req.block_hashes
        got = plans.chunk_offers(self.layout, rq.next_chunk, self.committed(req, computed),
                                 len(hashes) * self._hbs, table, rq.hole)
        rq.next_chunk[:] = got.next_chunk
        rq.hole = got.hole
        cb = self.layout.chunk_blocks
        return [StoreObject(o.group, o.chunk,
                            rq.chunk_keys(self.keyspace, hashes, o.group, o.chunk,
                                          o.chunk + 1)[0],
                            o.block_ids, self._page_bytes[o.group] * cb)
                for o in got.chunks]

    def _state_objects(self, rq: OffloadRequest, req: RequestView,
                       offers: Sequence[StateOffer], tails: Sequence[StateOffer],
                       stale: frozenset[StateOffer]) -> list[StoreObject]:
        if not offers and not tails:
            return []
        save_end = req.num_prompt_tokens if self._prompt_only else req.num_tokens
        tail_set = set(tails)
        kept, dropped = plans.select_states(
            self.layout, [*offers, *tails], alive=True, known_until=rq.known_until,
            save_end=save_end, hole=rq.hole)
        out = []
        for o in kept:
            if o in stale:
                dropped += 1
                continue
            key = self.keyspace.state_key(rq.scope, o.group, req.block_hashes, o.boundary)
            out.append(StoreObject(o.group, o.boundary, key, (o.block_id,),
                                   self._page_bytes[o.group], True, o in tail_set))
        self._stats.states_dropped += dropped
        return out

    def _select(self, rq: OffloadRequest, c: TenantCounters, objects: list[StoreObject],
                used: int = 0) -> list[StoreObject]:
        """Tracked: not an object being stored already, and within the byte budget."""
        if self._budget is None:
            return objects
        sel = plans.select_stores([(o.key.id, o.nbytes) for o in objects], self._storing,
                                  self._bytes + used, self._budget)
        c.stores_shed += sel.shed
        c.stores_deduplicated += sel.duplicates
        return [objects[i] for i in sel.take]

    def _register(self, rq: OffloadRequest, c: TenantCounters, plan: StorePlan) -> StorePlan:
        c.stores += 1
        if plan.tracked:
            self._open.add(plan)
            self._storing |= plan.key_ids
            self._bytes += plan.nbytes
            c.store_bytes_in_flight += plan.nbytes
            if self.holdings is not None and self._quotas.of(rq.tenant):
                self.holdings.expect(rq.tenant, [(o.key.id, o.nbytes) for o in plan.objects])
        return plan

    def storing(self, key_id: str) -> bool:
        """Whether an object is being stored by an open tracked plan."""
        return key_id in self._storing

    def prepare_keyed_store(self, rq: OffloadRequest, objects: Sequence[StoreObject]
                            ) -> StorePlan | None:
        """A store of objects the engine named itself, as one plan (vLLM's secondary tier
        is handed a job of keys, not a request): the tenant's tier quota, then
        deduplication and the byte budget, exactly as :meth:`prepare_store` applies them.
        No cursor, hole or state selection: the engine chose what to offer. None: nothing
        to store (over the quota, or every object stored already or shed)."""
        c = self.tenant(rq.tenant)
        nbytes = sum(o.nbytes for o in objects)
        if nbytes and self._over_tier_quota(rq.tenant, c, nbytes):
            self._shed_quota(rq, c, list(objects), 0)
            return None
        take = self._select(rq, c, list(objects))
        if not take:
            return None
        return self._register(rq, c, StorePlan(rq, tuple(take), self._chunk_tokens,
                                               self.tracked))

    def complete_store(self, plan: StorePlan, result: StoreResult) -> None:
        """A plan's store ended: done (``tier_counts`` per tier, the objects present there
        after the write) or not (failed, cancelled: later states of the request would miss
        these chunks). Apply the tiers' events of its writes first (a settled object no
        tier holds is gone). A plan completes once, in the ledger that prepared it:
        anything else raises :class:`PlanError` before a figure changes."""
        self._check_open(plan)
        done, tier_counts = result.done, result.tier_counts
        plan.state = PlanState.DONE if done else PlanState.FAILED
        rq, s = plan.request, self._stats
        c = self.tenant(rq.tenant)
        if plan.tracked:
            self._open.discard(plan)
            self._storing -= plan.key_ids
            self._bytes -= plan.nbytes
            c.store_bytes_in_flight -= plan.nbytes
            if self.holdings is not None and self._quotas.of(rq.tenant):
                self.holdings.settle(plan.key_ids)
        n, states = len(plan.objects), len(plan.states)
        if not done:
            c.stores_failed += n
            for tier in self._tiers:  # no tier took every write
                _bump(c.store_failures_by_tier, tier, n)
            rq.hole = min(rq.hole, plan.first_token)
            return
        s.stored_states += states
        s.partial_tails += sum(o.tail for o in plan.objects)
        c.stored_chunks += n - states
        c.stored_bytes += plan.nbytes
        counts = tuple(tier_counts)
        if len(counts) != len(self._tiers):  # a wrapper that reports the tiers as one
            counts = (min(counts, default=n),) * len(self._tiers)
        for tier, k in zip(self._tiers, counts, strict=True):
            _bump(c.stored_bytes_by_tier, tier, plan.nbytes * min(k, n) // max(1, n))
            if k < n:  # written through, but not to this tier
                _bump(c.store_failures_by_tier, tier, n - k)

    def _check_open(self, plan: StorePlan) -> None:
        rid = plan.request.request_id
        if plan.state is not PlanState.OPEN:
            raise PlanError(f"store plan of request {rid!r} completed twice (it is "
                            f"{plan.state.value} already)")
        if plan.tracked and plan not in self._open:
            raise PlanError(f"unknown store plan of request {rid!r}: this ledger did not "
                            "prepare it")

    # ------------------------------------------------------------------ tier quotas
    def needs_tier_events(self, tenant: str) -> bool:
        """Whether a store of ``tenant`` is checked against bytes held: then the executor
        applies the tiers' events so far (:meth:`apply_tier_events`) before preparing it
        and before completing its plans."""
        return self.holdings is not None and bool(self._quotas.of(tenant))

    def apply_tier_events(self, events: Sequence[TierEvent]) -> None:
        """The tiers' stored / removed / cleared objects (held bytes follow them)."""
        if self.holdings is not None and events:
            self.holdings.apply(events)

    def _over_tier_quota(self, tenant: str, c: TenantCounters, nbytes: int) -> bool:
        limits = self._quotas.of(tenant)
        return any(self._charged(tenant, c, tier) + c.store_bytes_in_flight + nbytes > n
                   for tier, n in limits.items())

    def _charged(self, tenant: str, c: TenantCounters, tier: str) -> int:
        if self.holdings is not None and tier in self._reporting:
            return self.holdings.held(tenant, tier)
        return c.stored_bytes_by_tier.get(tier, 0)

    def _shed_quota(self, rq: OffloadRequest, c: TenantCounters, chunks: list[StoreObject],
                    num_states: int) -> None:
        """Over the tenant's tier quota: the whole offer is shed (its chunks were passed
        by the cursor; the hole keeps later states from claiming a checkpoint without
        them) and its states are dropped."""
        for o in chunks:
            rq.hole = min(rq.hole, o.index * self._chunk_tokens[o.group])
        n = len(chunks)
        c.stores_shed += n
        c.stores_shed_quota += n
        self._stats.states_dropped += num_states

    # ------------------------------------------------------------------ loads
    def prepare_load(self, rq: OffloadRequest, req: RequestView,
                     table: Sequence[Sequence[int]], start: int, end: int,
                     state_at: int | None) -> LoadPlan:
        """The objects a claim of ``[start, end)`` and the states at ``state_at`` fetch, and
        the blocks of ``table`` they land in (a window group fetches only the window before
        ``end``: the engine left the rest null). The load is counted started and its plan
        stays open until :meth:`complete_load`."""
        self._check_live(rq)
        lay, hashes = self.layout, req.block_hashes
        objects = [LoadObject(c, rq.chunk_keys(self.keyspace, hashes, c.group, c.chunk,
                                               c.chunk + 1)[0],
                              tuple(table[c.group][c.first_block:c.first_block + c.num_blocks]))
                   for c in (plans.load_plan(lay, start, end) if end > start else ())]
        objects += [LoadObject(s, self.keyspace.state_key(rq.scope, s.group, hashes,
                                                          s.boundary),
                               (table[s.group][s.slot],))
                    for s in plans.state_plan(lay, state_at)]
        plan = LoadPlan(rq, start, end, tuple(objects))
        self._loading.add(plan)
        self.tenant(rq.tenant).loads += 1
        return plan

    def complete_load(self, plan: LoadPlan, result: LoadResult) -> None:
        """A load ended: what it copied in (per object, the tier and bytes) and how far it
        verified. Once per plan, in the ledger that prepared it (else :class:`PlanError`,
        nothing changed)."""
        if plan.state is not PlanState.OPEN or plan not in self._loading:
            what = "completed twice" if plan.state is not PlanState.OPEN else "unknown"
            raise PlanError(f"load plan of request {plan.request.request_id!r}: {what}")
        self._loading.discard(plan)
        ended = result.cancelled or result.abandoned
        failed = not ended and result.verified < plan.end
        plan.state = PlanState.FAILED if failed or ended else PlanState.DONE
        s, c = self._stats, self.tenant(plan.request.tenant)
        self._book_copied(c, result.copied)
        if result.cancelled:
            c.loads_cancelled += 1
        if failed:
            c.loads_failed += 1
            s.recomputed_tokens += plan.end - result.verified

    def book_keyed_load(self, tenant: str, *, copied: Sequence[tuple[str, int, bool]],
                        failed: bool) -> None:
        """A load of objects the engine named itself ended (vLLM's secondary tier): per
        object copied in, (tier, bytes, whether it is a state); ``failed`` when some object
        was missing or refused (the engine recomputes it)."""
        c = self.tenant(tenant)
        c.loads += 1
        self._book_copied(c, copied)
        if failed:
            c.loads_failed += 1

    def _book_copied(self, c: TenantCounters, copied: Sequence[tuple[str, int, bool]]
                     ) -> None:
        """Per object a load copied in (tier, bytes, whether it is a state)."""
        s = self._stats
        for tier, nbytes, state in copied:
            if state:
                s.loaded_states += 1
            else:
                s.loaded_chunks += 1
            _bump(s.loaded_bytes_by_tier, tier, nbytes)
            c.loaded_bytes += nbytes

    def _check_live(self, rq: OffloadRequest) -> None:
        if rq.closed:
            raise PlanError(f"request {rq.request_id!r} is closed: nothing is admitted or "
                            "loaded for it")
