"""The values the offload ledger (:mod:`kvplugin.aio.offload_ledger`) takes and returns:
requests, store and load plans (each a tuple of objects, with a state), the results an
executor reports, tier quotas and per-tenant counters. Plain data, no behaviour beyond
derived properties; pure (no asyncio, no I/O)."""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Protocol

from kvplugin.aio import plans
from kvplugin.aio.keys import KeyScope, KeySpace
from kvplugin.connectors.keys import ObjectKey

__all__ = ["NO_HOLE", "LoadObject", "LoadPlan", "LoadResult", "OffloadRequest", "PlanError",
           "PlanState", "RequestView", "StoreObject", "StorePlan", "StoreResult",
           "TenantCounters", "TierQuotas"]

NO_HOLE = 1 << 62  # "every chunk offered so far was stored"
_EMPTY: Mapping[str, int] = MappingProxyType({})


class PlanError(RuntimeError):
    """An illegal transition (a plan completed twice or not this ledger's, a load for a
    closed request): raised before anything changed, so the books stay as they were."""


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
    closed: bool = False  # finished: no load is planned for it any more

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
class StoreResult:
    """How a store plan's I/O ended: ``done`` (some tier took every write) and, per tier
    (fastest first), how many of its objects that tier holds now."""

    done: bool
    tier_counts: tuple[int, ...] = ()


@dataclass(frozen=True, slots=True)
class LoadObject:
    """One object a load fetches: a chunk (``load`` a :class:`~kvplugin.aio.plans.ChunkLoad`)
    or a state (a :class:`~kvplugin.aio.plans.StateLoad`), its key, and the request's blocks
    it lands in (vLLM's or the native core's block ids)."""

    load: plans.ChunkLoad | plans.StateLoad
    key: ObjectKey
    dst: tuple[int, ...]

    @property
    def state(self) -> bool:
        return isinstance(self.load, plans.StateLoad)

    @property
    def group(self) -> int:
        return self.load.group


@dataclass(eq=False, slots=True)
class LoadPlan:
    """What a claim of tokens ``[start, end)`` (and the states at ``end``) fetches: its
    objects, chunks first, then states."""

    request: OffloadRequest
    start: int
    end: int
    objects: tuple[LoadObject, ...]
    state: PlanState = PlanState.OPEN

    @property
    def chunks(self) -> tuple[plans.ChunkLoad, ...]:
        return tuple(o.load for o in self.objects if isinstance(o.load, plans.ChunkLoad))

    @property
    def states(self) -> tuple[plans.StateLoad, ...]:
        return tuple(o.load for o in self.objects if isinstance(o.load, plans.StateLoad))

    @property
    def keys(self) -> tuple[ObjectKey, ...]:
        return tuple(o.key for o in self.objects)

    @property
    def dst(self) -> tuple[tuple[int, ...], ...]:
        return tuple(o.dst for o in self.objects)

    @property
    def lands_on_null(self) -> bool:
        """A planned object has no block to land in (the allocation disagrees)."""
        return any(0 in o.dst for o in self.objects)


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadResult:
    """How a load ended: tokens ``[start, verified)`` arrived verified (fewer than the
    plan's ``end`` is a failed load: the rest is computed again); ``cancelled`` and
    ``abandoned`` loads verified nothing. ``copied``: per object copied in, (tier, bytes,
    whether it is a state)."""

    verified: int = 0
    cancelled: bool = False
    abandoned: bool = False  # the request went away: only the cancellation is counted
    copied: tuple[tuple[str, int, bool], ...] = ()


@dataclass(frozen=True, slots=True)
class TierQuotas:
    """Tenants' tier byte quotas, as data: ``tenants`` name theirs, every other tenant has
    ``default`` (tier name -> bytes it may hold)."""

    default: Mapping[str, int] = field(default_factory=lambda: _EMPTY)
    tenants: Mapping[str, Mapping[str, int]] = field(default_factory=dict)

    @classmethod
    def of_policy(cls, policy: Any) -> TierQuotas:
        """From a :class:`~kvplugin.aio.tenants.TenantPolicy` (declared tenants' quotas,
        the open policy's default)."""
        return cls(policy.default_quota.max_tier_bytes,
                   {t: q.max_tier_bytes for t, q in (policy.tenants or {}).items()})

    def of(self, tenant: str) -> Mapping[str, int]:
        return self.tenants.get(tenant, self.default)

    def any(self) -> bool:
        return bool(self.default) or any(self.tenants.values())


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
    # Objects a tier did not take (its write failed; another tier may hold them): per tier.
    store_failures_by_tier: dict[str, int] = field(default_factory=dict)
    stores_shed: int = 0
    stores_shed_quota: int = 0
    stores_deduplicated: int = 0
    quota_refusals: int = 0
    quota_evictions: int = 0
    store_bytes_in_flight: int = 0
    queries: int = 0
    queried_tokens: int = 0
