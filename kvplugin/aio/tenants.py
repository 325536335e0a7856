"""Tenants: whom a request belongs to, what it may share, what it may use, what it did.

**Isolation.** Every request belongs to a tenant. On the device the tenant is the request's
cache salt (:func:`device_salt`), which enters the first block's hash as vLLM's
``cache_salt`` does, so the hash chain of every block differs from any other tenant's; in
the tiers every key lives in the tenant's namespace (:class:`~kvplugin.connectors.keys.Namespace`).
Two tenants with identical prompts therefore never share a device block or a tier object.

**Shared prefix groups.** A deployment may name a group of tenants that share a prefix (a
system prompt). A request of a member opts in explicitly with ``prefix_group=`` and
``shared_prefix_tokens=K`` (at most the group's ``max_prefix_tokens``); only the first ``S``
tokens (K cut down to where every group can be restored together) are shared, the rest of
the request stays the tenant's own:

* device: the cache salt is the group's (:func:`group_salt`), so blocks ``[0, S)`` hash the
  same for every member; the first block after ``S`` has the tenant mixed into its hash
  (:class:`SplitHasher`), exactly as vLLM mixes the salt into block 0, so every later block
  chains from a tenant-specific hash;
* tiers: objects ending at or before ``S`` are keyed in the group's namespace (salted, so
  no tenant name reaches it), later ones in the tenant's (:class:`~kvplugin.aio.keys.KeyScope`).

Why the shared part only, not the whole request: a whole-request group would put members'
private suffixes (user turns, documents) where every member can hit them, and a hit is
observable (latency). With the split, a member can only ever hit what a member declared
shared, and a declaration covers a prefix the deployment capped. Sharing is sound because
KV depends on the tokens only (LoRA and the user's cache salt still enter the hash).

**Quotas** (:class:`TenantQuota`, all off by default; off, nothing here touches the core):

* *blocks in use*: an admission that would bring the tenant's distinct device blocks (its
  requests' tables and the blocks held for their jobs) over ``max_blocks_in_use`` returns
  None, nothing taken. It is the core's own check: the tenant's headroom becomes the free
  space the core sees (through ``reserved_blocks``), so the core's "nothing adopted, nothing
  allocated" guarantee holds. Running requests grow past it: refusing one would make a vLLM
  scheduler preempt, possibly another tenant's request; a tenant over its quota admits
  nothing until it is back under.
* *cached blocks*: when a tenant (or a group, for its shared blocks) keeps more than
  ``max_cached_blocks`` free-but-cached blocks, its own first-to-be-evicted ones lose their
  cache identity through the core's public ``evict_blocks``, which leaves the free queue's
  order alone: the core keeps vLLM's order, other tenants' blocks are never touched.
* *tier bytes*: an offer that would bring the tenant's bytes on a tier (what the tier holds
  of it, plus its store jobs in flight) over ``max_tier_bytes[tier]`` is shed whole,
  counted. Stores write through every tier, so each is charged on every tier. What a tier
  holds is learned from its events (:mod:`kvplugin.aio.holdings`: charged when the tier
  reports an object stored, released when it reports it evicted, deleted or gone), so a
  tenant whose objects were evicted may store again, and one that writes faster than the
  tier evicts is bounded by what it holds. A tier that reports no events (a third-party
  connector's ``reports_objects`` False) is charged what was written, never released: an
  upper bound.

**Stats** (:class:`TenantStats`) attribute every counter of the manager's
:class:`~kvplugin.aio.values.OffloadStats` that belongs to a request to its tenant, so they
sum to the global ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from kvplugin.aio import plans
from kvplugin.aio.holdings import TierHoldings
from kvplugin.aio.jobs import JobEnd, LoadJob, StoreJob
from kvplugin.aio.keys import KeyScope, KeySpace
from kvplugin.aio.memory import HostKVMemory
from kvplugin.aio.plans import StateOffer
from kvplugin.aio.reqstate import ReqState
from kvplugin.aio.stores import Stores
from kvplugin.aio.values import LoadStatus, OffloadConfig, OffloadStats
from kvplugin.connectors.events import TierEvent
from kvplugin.connectors.keys import InvalidName, Namespace
from kvplugin.core.blocks import KVCacheBlock
from kvplugin.core.hashing import BlockHasher
from kvplugin.core.manager import KVCacheBlocks, KVCacheManager
from kvplugin.core.request import BlockHasherFn, Request, RequestStatus

__all__ = [
    "PrefixGroup",
    "RequestScope",
    "SplitHasher",
    "TenantPolicy",
    "TenantQuota",
    "TenantStats",
    "Tenants",
    "check_name",
    "device_salt",
    "group_salt",
]

DEVICE = "device"  # the hit-token key of the device cache, next to the tier names
_GROUP = "group:"  # domain prefix of a group's blocks: ':' is never in a tenant name
_PROBE = ("probe", "0" * 32)  # a valid model and layout, to check a name alone
_MARK = b"kvplugin/private-after-shared-prefix/v1"


def device_salt(tenant: str, cache_salt: str | None = None) -> str:
    """The core cache salt of a tenant's request: tenant names never contain ``;``
    (:class:`~kvplugin.connectors.keys.Namespace` checks), so no two (tenant, salt) pairs
    collide."""
    return f"tenant={tenant}" if cache_salt is None else f"tenant={tenant};salt={cache_salt}"


def group_salt(group: str, cache_salt: str | None = None) -> str:
    """The cache salt of a group request's shared part (never equal to a tenant's)."""
    return f"group={group}" if cache_salt is None else f"group={group};salt={cache_salt}"


def check_name(name: object, what: str = "tenant") -> str:
    """``name`` if it is a valid tenant (or group) name, else InvalidName (connectors.keys)."""
    try:
        Namespace(name, *_PROBE)  # type: ignore[arg-type]  # a non-str is refused there
    except InvalidName as exc:
        if what == "tenant":
            raise
        raise InvalidName(f"{what}: {exc}") from None
    assert isinstance(name, str)
    return name


def _limit(value: object, name: str) -> int | None:
    if value is not None and (type(value) is not int or value < 0):
        raise ValueError(f"{name} must be None or an int >= 0, got {value!r}")
    return value


# --------------------------------------------------------------------------- policy


@dataclass(frozen=True, slots=True)
class TenantQuota:
    """One tenant's limits; None (and a tier left out) means unlimited."""

    max_blocks_in_use: int | None = None
    max_cached_blocks: int | None = None
    max_tier_bytes: Mapping[str, int] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _limit(self.max_blocks_in_use, "max_blocks_in_use")
        _limit(self.max_cached_blocks, "max_cached_blocks")
        tiers = dict(self.max_tier_bytes)
        for tier, n in tiers.items():
            if not isinstance(tier, str) or n is None:
                raise ValueError(f"max_tier_bytes maps tier names to ints, got {tier!r}: {n!r}")
            _limit(n, f"max_tier_bytes[{tier!r}]")
        object.__setattr__(self, "max_tier_bytes", MappingProxyType(tiers))


@dataclass(frozen=True, slots=True)
class PrefixGroup:
    """Tenants that may share device blocks and tier objects for a declared prefix."""

    name: str
    tenants: frozenset[str]
    max_prefix_tokens: int  # the longest prefix a request may declare shared
    max_cached_blocks: int | None = None  # the group's own cached-block quota

    def __post_init__(self) -> None:
        check_name(self.name, "prefix group")
        members = frozenset(self.tenants)
        if not members:
            raise ValueError(f"prefix group {self.name!r} has no tenants")
        for t in members:
            check_name(t)
        object.__setattr__(self, "tenants", members)
        if type(self.max_prefix_tokens) is not int or self.max_prefix_tokens < 1:
            raise ValueError(f"prefix group {self.name!r}: max_prefix_tokens must be a "
                             f"positive int, got {self.max_prefix_tokens!r}")
        _limit(self.max_cached_blocks, "max_cached_blocks")


@dataclass(frozen=True, slots=True)
class TenantPolicy:
    """A deployment's tenants: declared (``tenants``, each with its quota; any other is
    refused) or open (``tenants=None``: any valid name, each with ``default_quota``)."""

    tenants: Mapping[str, TenantQuota] | None = None
    default_quota: TenantQuota = TenantQuota()
    groups: Sequence[PrefixGroup] = ()

    def __post_init__(self) -> None:
        if self.tenants is not None:
            declared = dict(self.tenants)
            for name in declared:
                check_name(name)
            object.__setattr__(self, "tenants", MappingProxyType(declared))
        groups = tuple(self.groups)
        names = [g.name for g in groups]
        if len(set(names)) != len(names):
            raise ValueError(f"prefix group names repeat: {names}")
        for g in groups:
            for t in sorted(g.tenants):
                self.quota(t)  # an undeclared member is a configuration error
        object.__setattr__(self, "groups", groups)

    def quota(self, tenant: str) -> TenantQuota:
        """The tenant's quota; ValueError naming the known tenants when it is undeclared."""
        if self.tenants is None:
            return self.default_quota
        q = self.tenants.get(tenant)
        if q is None:
            raise ValueError(f"unknown tenant {tenant!r}: this deployment declares "
                             f"{', '.join(sorted(self.tenants)) or 'no tenants'}")
        return q

    def group(self, name: str, tenant: str) -> PrefixGroup:
        for g in self.groups:
            if g.name == name:
                if tenant not in g.tenants:
                    raise ValueError(f"tenant {tenant!r} is not a member of prefix group "
                                     f"{name!r} (members: {', '.join(sorted(g.tenants))})")
                return g
        raise ValueError(f"unknown prefix group {name!r}: this deployment declares "
                         f"{', '.join(g.name for g in self.groups) or 'no groups'}")


# --------------------------------------------------------------------------- stats


@dataclass(frozen=True, slots=True, kw_only=True)
class TenantStats:
    """One tenant's counters (hit rates are derived, never stored) and its device use now.
    Hit tokens are keyed by ``"device"`` and each tier's name."""

    tenant: str
    requests: int
    prompt_tokens: int
    hit_tokens: Mapping[str, int]
    loads: int
    loads_failed: int  # loads that verified less than they claimed
    loads_cancelled: int
    loaded_bytes: int
    stores: int  # store jobs started
    stored_chunks: int
    stored_bytes: int
    stored_bytes_by_tier: Mapping[str, int]  # written per tier (quotas count bytes held)
    stores_failed: int
    stores_shed: int  # objects shed (over the in-flight budget or the tier quota)
    stores_shed_quota: int  # of those, over the tenant's tier byte quota
    stores_deduplicated: int
    quota_refusals: int  # admissions refused over the in-use quota
    quota_evictions: int  # cached blocks evicted over the cached-block quota
    blocks_in_use: int  # distinct device blocks its requests and their jobs hold now
    cached_blocks: int | None  # its free-but-cached blocks (tracked with cached quotas)
    queries: int = 0  # admissions (prefix-cache queries whose hits are booked)
    queried_tokens: int = 0  # the tokens of those queries: the hit rate's denominator


@dataclass(slots=True)
class _Counters:
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

    def freeze(self, tenant: str, tiers: Sequence[str], in_use: int,
               cached: int | None) -> TenantStats:
        hits = dict.fromkeys((DEVICE, *tiers), 0) | self.hit_tokens
        by_tier = dict.fromkeys(tiers, 0) | self.stored_bytes_by_tier
        return TenantStats(
            tenant=tenant, requests=self.requests, prompt_tokens=self.prompt_tokens,
            hit_tokens=MappingProxyType(hits), loads=self.loads, loads_failed=self.loads_failed,
            loads_cancelled=self.loads_cancelled, loaded_bytes=self.loaded_bytes,
            stores=self.stores, stored_chunks=self.stored_chunks, stored_bytes=self.stored_bytes,
            stored_bytes_by_tier=MappingProxyType(by_tier), stores_failed=self.stores_failed,
            stores_shed=self.stores_shed, stores_shed_quota=self.stores_shed_quota,
            stores_deduplicated=self.stores_deduplicated, quota_refusals=self.quota_refusals,
            quota_evictions=self.quota_evictions, blocks_in_use=in_use, cached_blocks=cached,
            queries=self.queries, queried_tokens=self.queried_tokens)


# --------------------------------------------------------------------------- requests


class SplitHasher:
    """The manager's hasher, with the tenant mixed into the hash of the first block after a
    shared prefix: the shared blocks hash alike for every member of the group, and every
    later block chains from a hash no other tenant can produce."""

    __slots__ = ("_index", "_inner", "_salt", "block_size", "lookahead")

    def __init__(self, inner: BlockHasher, shared_tokens: int, private_salt: str) -> None:
        if shared_tokens <= 0 or shared_tokens % inner.block_size:
            raise ValueError(f"the shared prefix ({shared_tokens} tokens) must be a positive "
                             f"multiple of the hash block size {inner.block_size}")
        self._inner = inner
        self._index = shared_tokens // inner.block_size
        self._salt = private_salt.encode()
        # Request reads these to know when the next hash is due.
        self.block_size = inner.block_size
        self.lookahead = inner.lookahead

    def mark(self, block_hash: bytes) -> bytes:
        """A domain-separated hash of (tenant salt, hash), as long as the hash."""
        digest = hashlib.sha256(_MARK + len(self._salt).to_bytes(4, "big") + self._salt
                                + block_hash).digest()
        return digest[:len(block_hash)]

    def __call__(self, request: Request) -> list[bytes]:
        have = len(request.block_hashes)
        out = self._inner(request)
        i = self._index - have
        if not 0 <= i < len(out):
            return out
        head = [*out[:i], self.mark(out[i])]
        # The inner hasher chains from the request's last hash: let it see the marked one.
        hashes = request.block_hashes
        hashes.extend(head)
        try:
            rest = self._inner(request)
        finally:
            del hashes[have:]
        return head + rest


@dataclass(frozen=True, slots=True)
class RequestScope:
    """How to build a tenant's request: its cache salt, its hasher (None: the manager's),
    and whose namespaces its objects are keyed in."""

    key_scope: KeyScope
    cache_salt: str
    hasher: BlockHasherFn | None = None


def _shared(scope: KeyScope) -> tuple[str | None, int]:
    """(the domain of a scoped request's shared part, its length in tokens)."""
    if scope.group is not None:
        return _GROUP + scope.group, scope.shared_tokens
    return None, 0


class JobSet(set[LoadJob | StoreJob]):
    """The manager's set of running jobs. The load and store sides remove a job first
    thing when it ends, its result booked (``job.ended``, the load's outcome): that is
    where ``on_end`` attributes it, in the same loop iteration, so counters read right
    after a ``drain()`` are complete."""

    def __init__(self, on_end: Callable[[LoadJob | StoreJob], None]) -> None:
        super().__init__()
        self._on_end = on_end

    def discard(self, job: object) -> None:
        if isinstance(job, LoadJob | StoreJob) and job in self:
            super().discard(job)
            self._on_end(job)


@dataclass(eq=False, slots=True)
class _Hold:
    blocks: list[KVCacheBlock]
    jobs: frozenset[LoadJob | StoreJob]

    @property
    def alive(self) -> bool:  # the manager's Holds frees them when the last job ended
        return any(j.ended is None for j in self.jobs)


class _CachedBlocks:
    """Who owns each free-but-cached device block, and the cached-block quotas.

    A block's owner is recorded when a request releases it (its table position tells a
    group request's shared part from its private part); a block whose hash changed since
    (evicted, reused) is forgotten. Counting a domain's cached blocks walks what it owns;
    choosing victims walks the core's free queue from its head (the eviction order) until
    enough of the domain's blocks are found. Blocks the manager never saw released (Mamba
    copy-on-write endpoints) are nobody's and never evicted here.
    """

    def __init__(self, core: KVCacheManager, layout: plans.Layout,
                 quotas: dict[str, int]) -> None:
        self._core = core
        self._view = core.offload_view()
        self._layout = layout
        self.quotas = quotas  # domain -> max cached blocks
        self._owner: dict[int, str] = {}
        self._owned: dict[str, dict[int, bytes]] = {}

    def record(self, st: ReqState) -> None:
        group, shared = _shared(st.scope)
        tenant = st.tenant
        tables = self._core.get_blocks(st.req.request_id).blocks
        for g, table in enumerate(tables):
            bs = self._layout.block_sizes[g]
            for pos, block in enumerate(table):
                key = block.block_hash
                if key is None or block.is_null:
                    continue
                domain = group if group is not None and (pos + 1) * bs <= shared else tenant
                self._own(block.block_id, domain, key)

    def _own(self, block_id: int, domain: str, key: bytes) -> None:
        prev = self._owner.get(block_id)
        if prev is not None and prev != domain:
            del self._owned[prev][block_id]
        self._owner[block_id] = domain
        self._owned.setdefault(domain, {})[block_id] = key

    def cached(self, domain: str) -> set[int]:
        """The domain's free-but-cached blocks (forgetting those no longer its own)."""
        owned = self._owned.get(domain, {})
        blocks = self._view.blocks
        live: set[int] = set()
        for bid, key in list(owned.items()):
            b = blocks[bid]
            if b.block_hash != key:
                del owned[bid]
                del self._owner[bid]
            elif b.ref_cnt == 0:
                live.add(bid)
        return live

    def enforce(self, domain: str) -> int:
        """Evict the domain's excess cached blocks, first-to-be-evicted first; how many."""
        quota = self.quotas.get(domain)
        if quota is None:
            return 0
        live = self.cached(domain)
        excess = len(live) - quota
        if excess <= 0:
            return 0
        victims = self._view.next_evicted(live, excess)
        self._core.evict_blocks(set(victims))
        owned = self._owned[domain]
        for bid in victims:
            del owned[bid]
            del self._owner[bid]
        return len(victims)


# --------------------------------------------------------------------------- the book


class Tenants:
    """The manager's tenant book: scopes requests, checks quotas, attributes counters.

    The manager calls it at a handful of points (request creation, admission, offers,
    releases); the load and store sides are observed through their jobs (:class:`JobSet`)
    and the synchronous deltas of the global counters around each offer, so they need not
    know about tenants.
    """

    def __init__(self, policy: TenantPolicy | None, *, core: KVCacheManager,
                 keyspace: KeySpace, layout: plans.Layout, memory: HostKVMemory,
                 hasher: BlockHasher, tiers: Sequence[str], config: OffloadConfig,
                 stats: OffloadStats) -> None:
        self.policy = policy if policy is not None else TenantPolicy()
        self._core = core
        self._keyspace = keyspace
        self._layout = layout
        self._memory = memory
        self._hasher = hasher
        self._tiers = tuple(tiers)
        self._config = config
        self._stats = stats
        self._counters: dict[str, _Counters] = {}
        self._requests: dict[str, set[ReqState]] = {}
        self._holds: dict[str, list[_Hold]] = {}
        self.jobs = JobSet(self._job_ended)
        # Tier bytes held, from the tiers' events (count_held): None until the manager
        # has a connector whose events it pumps, and only with a tier quota somewhere.
        self.holdings: TierHoldings | None = None
        self._reporting: frozenset[str] = frozenset()
        self._pump: Callable[[], None] = lambda: None
        self._check_tiers()
        p = self.policy
        groups = {_GROUP + g.name: g.max_cached_blocks for g in p.groups
                  if g.max_cached_blocks is not None}
        tracked = bool(groups) or any(q.max_cached_blocks is not None for q in (
            p.default_quota, *(p.tenants or {}).values()))
        # Ownership is only tracked when some cached quota needs it (off: zero cost).
        self._cached = _CachedBlocks(core, layout, groups) if tracked else None
        for name in p.tenants or ():
            self._book(name)

    def _check_tiers(self) -> None:
        if not self._tiers:
            # Offload off: nothing is stored, so a tier quota can never bind; a config keeps
            # its quotas when offload is switched off for a comparison.
            return
        p = self.policy
        for q in (p.default_quota, *(p.tenants or {}).values()):
            unknown = sorted(set(q.max_tier_bytes) - set(self._tiers))
            if unknown:
                raise ValueError(f"max_tier_bytes names unknown tiers {unknown}; this "
                                 f"connector's tiers are {list(self._tiers)}")

    def count_held(self, reporting: Iterable[str], pump: Callable[[], None]) -> bool:
        """Count tier quotas against bytes held on the ``reporting`` tiers (their events
        complete), with ``pump`` handing this the tiers' events before each check. False
        (nothing to count) when no quota names a tier."""
        p = self.policy
        if not any(q.max_tier_bytes for q in (p.default_quota, *(p.tenants or {}).values())):
            return False
        self.holdings = TierHoldings()
        self._reporting = frozenset(reporting)
        self._pump = pump
        return True

    def tier_events(self, events: Sequence[TierEvent]) -> None:
        if self.holdings is not None:
            self.holdings.apply(events)

    def _book(self, tenant: str) -> _Counters:
        c = self._counters.get(tenant)
        if c is None:
            c = self._counters[tenant] = _Counters()
            self._requests[tenant] = set()
            self._holds[tenant] = []
            limit = self.policy.quota(tenant).max_cached_blocks
            if self._cached is not None and limit is not None:
                self._cached.quotas[tenant] = limit
        return c

    def _of(self, st: ReqState) -> _Counters:
        return self._counters[st.tenant]

    # ------------------------------------------------------------------ requests
    def scope(self, tenant: str, *, cache_salt: str | None, prefix_group: str | None,
              shared_prefix_tokens: int | None, num_prompt_tokens: int) -> RequestScope:
        """Check the tenant (InvalidName, then unknown) and its opt-in to a prefix group."""
        self._keyspace.namespaces(check_name(tenant))
        self.policy.quota(tenant)
        private = device_salt(tenant, cache_salt)
        if prefix_group is None and shared_prefix_tokens is None:
            return RequestScope(KeyScope(tenant), private)
        if prefix_group is None or shared_prefix_tokens is None:
            raise ValueError("prefix_group and shared_prefix_tokens go together: a request "
                             "shares a prefix only by naming both")
        group = self.policy.group(prefix_group, tenant)
        k = shared_prefix_tokens
        if type(k) is not int or not 0 < k <= min(group.max_prefix_tokens, num_prompt_tokens):
            raise ValueError(f"shared_prefix_tokens must be an int in [1, "
                             f"{min(group.max_prefix_tokens, num_prompt_tokens)}] (the group's "
                             f"max_prefix_tokens and the prompt), got {k!r}")
        shared = k - k % self._layout.alignment
        if not shared:
            return RequestScope(KeyScope(tenant), private)  # shorter than one restorable unit
        self._keyspace.group_namespaces(group.name)
        return RequestScope(KeyScope(tenant, group.name, shared),
                            group_salt(group.name, cache_salt),
                            SplitHasher(self._hasher, shared, private))

    def opened(self, st: ReqState) -> None:
        c = self._book(st.tenant)
        c.requests += 1
        c.prompt_tokens += st.req.num_prompt_tokens
        self._requests[st.tenant].add(st)

    def finished(self, st: ReqState) -> None:
        self._requests[st.tenant].discard(st)

    # ------------------------------------------------------------------ admission
    def blocks_in_use(self, tenant: str) -> set[int]:
        """Distinct device blocks the tenant's requests, and the jobs of its released
        ones, hold."""
        ids: set[int] = set()
        for st in self._requests.get(tenant, ()):
            if st.admitted:
                for table in self._core.get_block_ids(st.req.request_id):
                    ids.update(table)
        holds = self._holds.get(tenant, [])
        holds[:] = [h for h in holds if h.alive]
        for h in holds:
            ids.update(b.block_id for b in h.blocks)
        ids.discard(0)
        return ids

    def admission_reserve(self, st: ReqState, hits: KVCacheBlocks, reserved: int,
                          has_scheduled: bool) -> int:
        """The ``reserved_blocks`` to admit with: ``reserved``, raised so that the core's
        room check also keeps the tenant within its in-use quota.

        The core admits when ``need + watermark <= free - reserved``, ``need`` counting new
        blocks and evictable hits; hits already in use by others of the group count here.
        Raising ``reserved`` to ``free - headroom - watermark`` makes that ``need <=
        headroom`` as well, with the core's guarantee that a refusal takes nothing."""
        quota = self.policy.quota(st.tenant).max_blocks_in_use
        if quota is None:
            return reserved
        held = self.blocks_in_use(st.tenant)
        adopted = {b.block_id for table in hits.blocks for b in table
                   if not b.is_null and b.ref_cnt > 0 and b.block_id not in held}
        headroom = quota - len(held) - len(adopted)
        core = self._core
        waiting = st.req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        wm = core.watermark_blocks if has_scheduled and waiting else 0
        return max(reserved, core.offload_view().num_free_blocks() - headroom - wm)

    def refused(self, st: ReqState, reserved: int, asked: int) -> None:
        """An admission returned None; when the quota was the tighter limit, count it."""
        if reserved > asked:
            self._of(st).quota_refusals += 1
            self._stats.quota_refusals += 1

    def admitted(self, st: ReqState, local_tokens: int, by_tier: Mapping[str, int]) -> None:
        c = self._of(st)
        c.queries += 1
        c.queried_tokens += st.req.num_tokens
        hits = c.hit_tokens
        for name, n in ((DEVICE, local_tokens), *by_tier.items()):
            hits[name] = hits.get(name, 0) + n

    # ------------------------------------------------------------------ loads
    def load_started(self, st: ReqState) -> None:
        job = st.load
        assert job is not None
        self._of(st).loads += 1
        # A load that fails or is cancelled frees the hits it adopted.
        self._enforce_after([job], st)

    def _job_ended(self, job: LoadJob | StoreJob) -> None:
        if isinstance(job, LoadJob):
            self._load_ended(job.owner, job)
        else:
            self._store_ended(job.owner, job)

    def _load_ended(self, st: ReqState, job: LoadJob) -> None:
        """Mirror of the load side's counters (kvplugin.aio.loads): a load that got its
        bytes (not cancelled, not abandoned) has an outcome; ``_copy_in`` copied every
        chunk block below the verified end, and the states when all of it verified."""
        c = self._of(st)
        if job.ended is JobEnd.CANCELLED:
            c.loads_cancelled += 1
        out = st.outcome
        if job.abandoned or out is None or job.ended is JobEnd.CANCELLED:
            return
        if out.status in (LoadStatus.PARTIAL, LoadStatus.FAILED):
            c.loads_failed += 1
        good = out.num_computed_tokens
        for load in job.plan:
            n = min(load.num_blocks, good // self._layout.block_sizes[load.group]
                    - load.first_block)
            c.loaded_bytes += max(0, n) * self._memory.page_bytes(load.group)
        if good == job.end:
            c.loaded_bytes += sum(self._memory.page_bytes(s.group) for s in job.states)

    # ------------------------------------------------------------------ stores
    def offer(self, st: ReqState, stores: Stores, offers: Sequence[StateOffer] = (),
              tails: Sequence[StateOffer] = ()) -> int:
        """``stores.offer``, unless it would take the tenant over a tier byte quota (then
        the whole offer is shed); the counters it moved are the request's tenant's."""
        if not offers and not tails and not stores.has_new_chunks(st):
            return 0  # nothing to store: the common case, kept off the step path
        c = self._of(st)
        if st.admitted and st.load is None:
            windows, nbytes = self._pending(st, offers, tails)
            if nbytes and self._over_tier_quota(st, c, nbytes):
                return self._shed(st, c, windows, len(offers) + len(tails))
        s = self._stats
        shed, dup = s.stores_shed, s.stores_deduplicated
        before = set(st.stores)
        started = stores.offer(st, offers, tails)  # synchronous: the deltas are this offer's
        c.stores_shed += s.stores_shed - shed
        c.stores_deduplicated += s.stores_deduplicated - dup
        for job in st.stores - before:
            self._store_started(st, c, job)
        return started

    def _pending(self, st: ReqState, offers: Sequence[StateOffer],
                 tails: Sequence[StateOffer]) -> tuple[dict[int, range], int]:
        """The chunks this offer covers (as the store side computes them) and the bytes it
        could store at most."""
        req = st.req
        committed = req.num_computed_tokens
        if self._config.store_prompt_only:
            committed = min(committed, req.num_prompt_tokens)
        hash_tokens = len(req.block_hashes) * self._keyspace.hash_block_size
        lay, mem = self._layout, self._memory
        windows = {g: plans.store_window(lay, g, st.next_chunk[g], committed, hash_tokens)
                   for g in lay.chunked_groups}
        nbytes = sum(len(w) * mem.page_bytes(g) * lay.chunk_blocks for g, w in windows.items())
        nbytes += sum(mem.page_bytes(o.group) for o in (*offers, *tails))
        return windows, nbytes

    def _over_tier_quota(self, st: ReqState, c: _Counters, nbytes: int) -> bool:
        limits = self.policy.quota(st.tenant).max_tier_bytes
        if not limits:
            return False  # no quota to check: the tiers' events wait for the next pump
        self._pump()
        return any(self._charged(st.tenant, c, tier) + c.store_bytes_in_flight + nbytes > n
                   for tier, n in limits.items())

    def _charged(self, tenant: str, c: _Counters, tier: str) -> int:
        if self.holdings is not None and tier in self._reporting:
            return self.holdings.held(tenant, tier)
        return c.stored_bytes_by_tier.get(tier, 0)

    def _shed(self, st: ReqState, c: _Counters, windows: dict[int, range],
              num_states: int) -> int:
        """Skip the offer's chunks as the store side does with a shed one (the cursor moves
        on, a hole is marked so no later state claims a checkpoint without them); its
        states, without their chunks, are dropped."""
        n = 0
        for g, w in windows.items():
            if w:
                st.hole = min(st.hole, w.start * self._layout.chunk_tokens(g))
                st.next_chunk[g] = w.stop
                n += len(w)
        s = self._stats
        c.stores_shed += n
        c.stores_shed_quota += n
        s.stores_shed += n
        s.stores_shed_quota += n
        s.states_dropped += num_states
        return 0

    def _store_started(self, st: ReqState, c: _Counters, job: StoreJob) -> None:
        c.stores += 1
        c.store_bytes_in_flight += job.nbytes
        if self._tracks(st):
            assert self.holdings is not None
            self.holdings.expect(st.tenant, job.objects)

    def _tracks(self, st: ReqState) -> bool:
        return self.holdings is not None and bool(self.policy.quota(st.tenant).max_tier_bytes)

    def _store_ended(self, st: ReqState, job: StoreJob) -> None:
        """Mirror of the store side's counters; a done store is charged on each tier for
        the share of its objects that tier confirmed (none where its write failed)."""
        c = self._of(st)
        c.store_bytes_in_flight -= job.nbytes
        if self._tracks(st):
            assert self.holdings is not None
            self._pump()  # its writes' events first: a settled object no tier took is gone
            self.holdings.settle(sid for sid, _ in job.objects)
        if job.ended is JobEnd.DONE:
            c.stored_chunks += len(job.items) - job.states
            c.stored_bytes += job.nbytes
            counts = job.tier_counts
            if len(counts) != len(self._tiers):  # a wrapper that reports the tiers as one
                counts = (min(counts, default=len(job.items)),) * len(self._tiers)
            for tier, n in zip(self._tiers, counts, strict=True):
                share = job.nbytes * min(n, len(job.items)) // max(1, len(job.items))
                c.stored_bytes_by_tier[tier] = c.stored_bytes_by_tier.get(tier, 0) + share
        else:
            c.stores_failed += len(job.items)

    # ------------------------------------------------------------------ releases
    def releasing(self, st: ReqState) -> None:
        """The request is about to let its blocks go: note whose cached blocks they are."""
        if self._cached is not None:
            self._cached.record(st)

    def released(self, st: ReqState, blocks: list[KVCacheBlock] | None = None,
                 jobs: frozenset[Any] = frozenset()) -> None:
        """Its blocks are free (enforce the cached quota), or held for ``jobs``."""
        if blocks is not None:
            self._holds[st.tenant].append(_Hold(blocks, jobs))
            self._enforce_after(jobs, st)
        else:
            self._enforce_cached(st)

    def _enforce_after(self, jobs: Iterable[LoadJob | StoreJob], st: ReqState) -> None:
        """Enforce the cached quota once each job has let its blocks go (its task done:
        the side that ran it has freed what it held by then)."""
        if self._cached is None:
            return
        for job in jobs:
            if job.task is not None:
                job.task.add_done_callback(lambda _t: self._enforce_cached(st))

    def _enforce_cached(self, st: ReqState) -> None:
        if self._cached is None:
            return
        group, _ = _shared(st.scope)
        n = sum(self._cached.enforce(d) for d in (st.tenant, group) if d is not None)
        if n:
            self._of(st).quota_evictions += n
            self._stats.quota_evictions += n

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, TenantStats]:
        out = {}
        for tenant, c in self._counters.items():
            cached = len(self._cached.cached(tenant)) if self._cached is not None else None
            out[tenant] = c.freeze(tenant, self._tiers, len(self.blocks_in_use(tenant)), cached)
        return out
