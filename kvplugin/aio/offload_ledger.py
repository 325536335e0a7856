"""The offload ledger: one synchronous state machine of what to store, what was stored and
whom it is charged to, executed by both integrations.

No asyncio, no I/O, no core objects. An executor (the native
:class:`~kvplugin.aio.manager.AsyncKVManager`, the vLLM
:class:`~kvplugin.integrations.vllm.KVPluginConnector`) tells the ledger what happened to a
request (opened, admitted with a hit, computed up to N, a load ended) and asks it what to
store; the ledger answers with a :class:`StorePlan` (objects, keys, blocks), the executor
runs the I/O and reports back (:meth:`OffloadLedger.store_completed`,
:meth:`OffloadLedger.load_completed`). Every cursor, hole, budget byte, tier quota and
counter (global and per tenant) changes here, from the event itself; nothing is inferred by
watching another module.

Per request (:class:`OffloadRequest`): each chunked group's store cursor (the first chunk
not yet offered), ``known_until`` (states at or below the admitted hit came with it) and the
``hole`` (the first token of a chunk that could not be stored: no state past it is a
complete checkpoint). The decisions themselves are :mod:`kvplugin.aio.plans`'.

A *tracked* ledger (``store_budget_bytes`` set: the native manager, which hears every
store's end) keeps the registry of objects being stored (a second request's store of the
same object is deduplicated) and the in-flight byte budget (a store over it is shed).
An untracked one (the vLLM scheduler: vLLM reports the end of a running request's stores
to no one) decides the same objects without either.

Tenant tier byte quotas count bytes *held* (:mod:`kvplugin.aio.holdings`) on tiers that
report their objects' events, bytes written elsewhere.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvplugin.aio import plans
from kvplugin.aio.holdings import TierHoldings
from kvplugin.aio.keys import KeyScope, KeySpace
from kvplugin.aio.plans import StateOffer
from kvplugin.aio.values import OffloadStats
from kvplugin.connectors.events import TierEvent
from kvplugin.connectors.keys import ObjectKey

__all__ = ["NO_HOLE", "LoadPlan", "LoadReport", "OffloadLedger", "OffloadRequest", "PlanError",
           "PlanState", "RequestView", "StoreObject", "StorePlan", "TenantCounters"]

NO_HOLE = 1 << 62  # "every chunk offered so far was stored"


class PlanError(RuntimeError):
    """An illegal transition of a plan (completed twice, not this ledger's): raised before
    anything changed, so the books stay as they were."""


class PlanState(enum.Enum):
    OPEN = "open"  # prepared, its I/O not reported yet
    DONE = "done"
    FAILED = "failed"


class RequestView(Protocol):
    """What the ledger reads of a request: the native core's ``Request`` and vLLM's both
    have these."""

    @property
    def block_hashes(self) -> Sequence[bytes]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def num_prompt_tokens(self) -> int: ...


@dataclass(eq=False, slots=True)
class OffloadRequest:
    """One live request's offload state."""

    request_id: str
    tenant: str
    scope: KeyScope | str  # whose namespace its objects are keyed in
    next_chunk: list[int]  # per group, the first chunk not yet offered for storing
    known_until: int = 0  # states at or below this came with the hit: not its to store
    hole: int = NO_HOLE
    keys: list[list[ObjectKey]] = field(default_factory=list)  # per group, chunks 0..
    stores: set[StorePlan] = field(default_factory=set)  # tracked plans in flight

    def chunk_keys(self, keyspace: KeySpace, block_hashes: Sequence[bytes], group: int,
                   first: int, stop: int) -> list[ObjectKey]:
        """Keys of the group's chunks ``[first, stop)``, derived once per request."""
        have = self.keys[group]
        if stop > len(have):
            have.extend(keyspace.chunk_keys(self.scope, group, block_hashes, len(have), stop))
        return have[first:stop]


@dataclass(frozen=True, slots=True)
class StoreObject:
    """One object of a plan: chunk ``index`` of ``group`` in ``block_ids``, or (``state``)
    the group's state at boundary ``index`` in its one block."""

    group: int
    index: int
    key: ObjectKey
    block_ids: tuple[int, ...]
    nbytes: int
    state: bool = False
    tail: bool = False  # a finish-time partial tail


@dataclass(eq=False, slots=True)
class StorePlan:
    """What one offer stores, as one job: attention chunks first, then the states they
    make restorable (a state at N is a checkpoint only with every chunk before N)."""

    request: OffloadRequest
    objects: tuple[StoreObject, ...]
    chunk_tokens: tuple[int, ...]  # per group (the layout's)
    tracked: bool
    nbytes: int = 0
    key_ids: frozenset[str] = frozenset()
    state: PlanState = PlanState.OPEN

    def __post_init__(self) -> None:
        self.nbytes = sum(o.nbytes for o in self.objects)
        self.key_ids = frozenset(o.key.id for o in self.objects)

    @property
    def states(self) -> tuple[StoreObject, ...]:
        return tuple(o for o in self.objects if o.state)

    @property
    def first_token(self) -> int:
        """The first token of its earliest chunk: where a failure leaves a hole."""
        return min((o.index * self.chunk_tokens[o.group] for o in self.objects if not o.state),
                   default=NO_HOLE)


@dataclass(frozen=True, slots=True)
class LoadPlan:
    """What a claim of tokens ``[start, end)`` (and the states at ``end``) fetches: the
    chunks, the states, one key per chunk then per state, and the request's blocks each
    lands in (vLLM's or the native core's block ids)."""

    start: int
    end: int
    chunks: tuple[plans.ChunkLoad, ...]
    states: tuple[plans.StateLoad, ...]
    keys: tuple[ObjectKey, ...]
    dst: tuple[tuple[int, ...], ...]

    @property
    def lands_on_null(self) -> bool:
        """A planned object has no block to land in (the allocation disagrees)."""
        return any(0 in ids for ids in self.dst)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadReport:
    """How a load ended: ``verified`` less than ``claimed`` tokens is a failed load (the
    rest is computed again); ``cancelled`` and ``abandoned`` loads verified nothing. What
    it copied in was reported piece by piece (:meth:`OffloadLedger.copied_in`)."""

    claimed: int
    verified: int = 0
    cancelled: bool = False
    abandoned: bool = False  # the request went away: only the cancellation is counted


@dataclass(slots=True)
class TenantCounters:
    """One tenant's counters (the ledger's; :class:`~kvplugin.aio.tenants.TenantStats`
    is their snapshot)."""

    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    loads: int = 0
    loads_failed: int = 0
    loads_cancelled: int = 0
    loaded_bytes: int = 0
    stores: int = 0
    stored_chunks: int = 0
    stored_bytes: int = 0
    stored_bytes_by_tier: dict[str, int] = field(default_factory=dict)
    stores_failed: int = 0
    stores_shed: int = 0
    stores_shed_quota: int = 0
    stores_deduplicated: int = 0
    quota_refusals: int = 0
    quota_evictions: int = 0
    store_bytes_in_flight: int = 0
    queries: int = 0
    queried_tokens: int = 0


def _bump(counts: dict[str, int], key: str, n: int) -> None:
    counts[key] = counts.get(key, 0) + n


class OffloadLedger:
    """Offers, plans and their outcomes, the budget, tier quotas and counters."""

    def __init__(self, layout: plans.Layout, keyspace: KeySpace, *,
                 page_bytes: Sequence[int], tiers: Sequence[str],
                 store_budget_bytes: int | None, store_prompt_only: bool = False,
                 tier_quota: Callable[[str], Mapping[str, int]] = lambda _t: {},
                 stats: OffloadStats | None = None) -> None:
        self.layout = layout
        self.keyspace = keyspace
        self.stats = stats if stats is not None else OffloadStats()
        self._page_bytes = tuple(page_bytes)
        self._tiers = tuple(tiers)
        self._budget = store_budget_bytes
        self._prompt_only = store_prompt_only
        self._tier_quota = tier_quota
        self._hbs = keyspace.hash_block_size
        self._chunk_tokens = tuple(layout.chunk_tokens(g) if layout.chunked(g) else 0
                                   for g in range(layout.num_groups))
        self._storing: set[str] = set()  # key ids of objects being stored (tracked)
        self._open: set[StorePlan] = set()  # tracked plans prepared here, not completed
        self._bytes = 0
        self._tenants: dict[str, TenantCounters] = {}
        # Held tier bytes (count_held): only with a tier quota somewhere.
        self.holdings: TierHoldings | None = None
        self._reporting: frozenset[str] = frozenset()
        self._pump: Callable[[], None] = lambda: None

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

    def admitted(self, rq: OffloadRequest, end: int, stored_until: Sequence[int] = ()) -> None:
        """The request computes from ``end`` (its device hit and claim): chunks inside it
        came from somewhere that stored them, and so did states up to it. Chunks its
        lookup found stored beyond the claim (``stored_until``: per group, the end of what
        the tiers hold, :attr:`~kvplugin.aio.plans.Claim.stored_until`) need no store
        either (vLLM's chunk-level policy)."""
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

    def booked_hits(self, tenant: str, *, queried_tokens: int, local: int, external: int,
                    by_tier: Mapping[str, int], device: str = "device") -> None:
        """An admission's prefix-cache query: its tokens, the device hit, the claim (and
        its tokens per tier)."""
        s, c = self.stats, self.tenant(tenant)
        s.queries += 1
        s.queried_tokens += queried_tokens
        s.local_hit_tokens += local
        s.external_hit_tokens += external
        c.queries += 1
        c.queried_tokens += queried_tokens
        _bump(c.hit_tokens, device, local)
        for name, n in by_tier.items():
            _bump(s.hit_tokens_by_tier, name, n)
            _bump(c.hit_tokens, name, n)

    def refused(self, tenant: str) -> None:
        """An admission refused over the tenant's in-use quota."""
        self.tenant(tenant).quota_refusals += 1
        self.stats.quota_refusals += 1

    def quota_evicted(self, tenant: str, n: int) -> None:
        self.tenant(tenant).quota_evictions += n
        self.stats.quota_evictions += n

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

    def offer(self, rq: OffloadRequest, req: RequestView, *, computed: int,
              table: Sequence[Sequence[int]], offers: Sequence[StateOffer] = (),
              tails: Sequence[StateOffer] = (), alive: bool = True,
              holds: Callable[[StateOffer], bool] | None = None) -> StorePlan | None:
        """What to store now that ``computed`` tokens of ``req`` are computed (its KV in
        ``table``, its block ids per group): the chunks that became storable, then the
        state ``offers`` (``tails``: finish-time partial tails) worth keeping. ``alive``
        False (its blocks may be reused): nothing is read, every offer dropped. ``holds``:
        whether an offered block still holds the request's state. None: nothing to store.
        A tracked plan is registered (budget, duplicates) until :meth:`store_completed`."""
        s = self.stats
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
        states = self._state_objects(rq, req, offers, tails, holds)
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
                       holds: Callable[[StateOffer], bool] | None) -> list[StoreObject]:
        if not offers and not tails:
            return []
        save_end = req.num_prompt_tokens if self._prompt_only else req.num_tokens
        tail_set = set(tails)
        kept, dropped = plans.select_states(
            self.layout, [*offers, *tails], alive=True, known_until=rq.known_until,
            save_end=save_end, hole=rq.hole)
        out = []
        for o in kept:
            if holds is not None and not holds(o):
                dropped += 1
                continue
            key = self.keyspace.state_key(rq.scope, o.group, req.block_hashes, o.boundary)
            out.append(StoreObject(o.group, o.boundary, key, (o.block_id,),
                                   self._page_bytes[o.group], True, o in tail_set))
        self.stats.states_dropped += dropped
        return out

    def _select(self, rq: OffloadRequest, c: TenantCounters, objects: list[StoreObject],
                used: int = 0) -> list[StoreObject]:
        """Tracked: not an object being stored already, and within the byte budget."""
        if self._budget is None:
            return objects
        sel = plans.select_stores([(o.key.id, o.nbytes) for o in objects], self._storing,
                                  self._bytes + used, self._budget)
        self.stats.stores_shed += sel.shed
        self.stats.stores_deduplicated += sel.duplicates
        c.stores_shed += sel.shed
        c.stores_deduplicated += sel.duplicates
        return [objects[i] for i in sel.take]

    def _register(self, rq: OffloadRequest, c: TenantCounters, plan: StorePlan) -> StorePlan:
        self.stats.stores += 1
        c.stores += 1
        if plan.tracked:
            self._open.add(plan)
            self._storing |= plan.key_ids
            self._bytes += plan.nbytes
            c.store_bytes_in_flight += plan.nbytes
            rq.stores.add(plan)
            if self._tracks(rq.tenant):
                assert self.holdings is not None
                self.holdings.expect(rq.tenant, [(o.key.id, o.nbytes) for o in plan.objects])
        return plan

    def store_completed(self, plan: StorePlan, done: bool,
                        tier_counts: Sequence[int] = ()) -> None:
        """A plan's store ended: ``done`` (every tier took it; ``tier_counts`` per tier, the
        objects present there after the write) or not (failed, cancelled: later states of
        the request would miss these chunks). A plan completes once, in the ledger that
        prepared it: anything else raises :class:`PlanError` before a figure changes."""
        self._check_open(plan)
        plan.state = PlanState.DONE if done else PlanState.FAILED
        rq, s = plan.request, self.stats
        c = self.tenant(rq.tenant)
        if plan.tracked:
            self._open.discard(plan)
            self._storing -= plan.key_ids
            self._bytes -= plan.nbytes
            c.store_bytes_in_flight -= plan.nbytes
            rq.stores.discard(plan)
            if self._tracks(rq.tenant):
                assert self.holdings is not None
                self._pump()  # its writes' events first: a settled object no tier took is gone
                self.holdings.settle(plan.key_ids)
        n, states = len(plan.objects), len(plan.states)
        if not done:
            s.stores_failed += n
            c.stores_failed += n
            rq.hole = min(rq.hole, plan.first_token)
            return
        s.stored_chunks += n - states
        s.stored_bytes += plan.nbytes
        s.stored_states += states
        s.partial_tails += sum(o.tail for o in plan.objects)
        c.stored_chunks += n - states
        c.stored_bytes += plan.nbytes
        counts = tuple(tier_counts)
        if len(counts) != len(self._tiers):  # a wrapper that reports the tiers as one
            counts = (min(counts, default=n),) * len(self._tiers)
        for tier, k in zip(self._tiers, counts, strict=True):
            _bump(c.stored_bytes_by_tier, tier, plan.nbytes * min(k, n) // max(1, n))

    def _check_open(self, plan: StorePlan) -> None:
        rid = plan.request.request_id
        if plan.state is not PlanState.OPEN:
            raise PlanError(f"store plan of request {rid!r} completed twice (it is "
                            f"{plan.state.value} already)")
        if plan.tracked and plan not in self._open:
            raise PlanError(f"unknown store plan of request {rid!r}: this ledger did not "
                            "prepare it")

    # ------------------------------------------------------------------ tier quotas
    def count_held(self, reporting: Iterable[str], pump: Callable[[], None],
                   quotas: Iterable[Mapping[str, int]]) -> bool:
        """Count tier quotas against bytes held on the ``reporting`` tiers (their events
        complete), ``pump`` handing this the tiers' events before each check. False
        (nothing to count) when no quota names a tier."""
        if not any(quotas):
            return False
        self.holdings = TierHoldings()
        self._reporting = frozenset(reporting)
        self._pump = pump
        return True

    def refresh_holdings(self) -> None:
        """Take the tiers' events now (a check between two offers)."""
        self._pump()

    def tier_events(self, events: Sequence[TierEvent]) -> None:
        if self.holdings is not None:
            self.holdings.apply(events)

    def _tracks(self, tenant: str) -> bool:
        return self.holdings is not None and bool(self._tier_quota(tenant))

    def _over_tier_quota(self, tenant: str, c: TenantCounters, nbytes: int) -> bool:
        limits = self._tier_quota(tenant)
        if not limits:
            return False  # no quota to check: the tiers' events wait for the next pump
        self._pump()
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
        n, s = len(chunks), self.stats
        c.stores_shed += n
        c.stores_shed_quota += n
        s.stores_shed += n
        s.stores_shed_quota += n
        s.states_dropped += num_states

    # ------------------------------------------------------------------ loads
    def load_plan(self, rq: OffloadRequest, req: RequestView, table: Sequence[Sequence[int]],
                  start: int, end: int, state_at: int | None) -> LoadPlan:
        """The objects a claim of ``[start, end)`` and the states at ``state_at`` fetch, and
        the blocks of ``table`` they land in (a window group fetches only the window before
        ``end``: the engine left the rest null)."""
        lay, hashes = self.layout, req.block_hashes
        chunks = plans.load_plan(lay, start, end) if end > start else ()
        states = plans.state_plan(lay, state_at)
        keys = [rq.chunk_keys(self.keyspace, hashes, c.group, c.chunk, c.chunk + 1)[0]
                for c in chunks]
        keys += [self.keyspace.state_key(rq.scope, s.group, hashes, s.boundary) for s in states]
        dst = [tuple(table[c.group][c.first_block:c.first_block + c.num_blocks])
               for c in chunks]
        dst += [(table[s.group][s.slot],) for s in states]
        return LoadPlan(start, end, chunks, states, tuple(keys), tuple(dst))

    def load_started(self, rq: OffloadRequest) -> None:
        self.stats.loads += 1
        self.tenant(rq.tenant).loads += 1

    def copied_in(self, rq: OffloadRequest, tier: str, nbytes: int, *, state: bool) -> None:
        """A load copied one chunk (or a Mamba state) of ``nbytes`` from ``tier`` in."""
        s = self.stats
        if state:
            s.loaded_states += 1
        else:
            s.loaded_chunks += 1
        s.loaded_bytes += nbytes
        _bump(s.loaded_bytes_by_tier, tier, nbytes)
        self.tenant(rq.tenant).loaded_bytes += nbytes

    def load_completed(self, rq: OffloadRequest, report: LoadReport) -> None:
        """A load ended (its copies reported before)."""
        s, c = self.stats, self.tenant(rq.tenant)
        if report.cancelled:
            s.loads_cancelled += 1
            c.loads_cancelled += 1
        if report.abandoned or report.cancelled:
            return
        if report.verified < report.claimed:
            s.loads_failed += 1
            c.loads_failed += 1
            s.recomputed_tokens += report.claimed - report.verified
