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
* *tier bytes* (checked by the offload ledger, :mod:`kvplugin.aio.offload_ledger`): an
  offer that would bring the tenant's bytes on a tier (what the tier holds of it, plus its
  store jobs in flight) over ``max_tier_bytes[tier]`` is shed whole, counted. Stores write
  through every tier, so each is charged on every tier. What a tier
  holds is learned from its events (:mod:`kvplugin.aio.holdings`: charged when the tier
  reports an object stored, released when it reports it evicted, deleted or gone), so a
  tenant whose objects were evicted may store again, and one that writes faster than the
  tier evicts is bounded by what it holds. A tier that reports no events (a third-party
  connector's ``reports_objects`` False) is charged what was written, never released: an
  upper bound.

**Stats** (:class:`TenantStats`, snapshots of the offload ledger's per-tenant counters,
booked with the global ones from the same reports) attribute every counter of the manager's
:class:`~kvplugin.aio.values.OffloadStats` that belongs to a request to its tenant, so they
sum to the global ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from kvplugin.aio import plans
from kvplugin.aio.jobs import LoadJob, StoreJob
from kvplugin.aio.keys import KeyScope, KeySpace
from kvplugin.aio.offload_ledger import OffloadLedger, TenantCounters
from kvplugin.aio.reqstate import ReqState
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
    if not isinstance(name, str):  # Namespace refuses a non-str: this only narrows it
        raise TypeError(f"{what} name must be a str, not {type(name).__name__}")
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


def _snapshot(c: TenantCounters, tenant: str, tiers: Sequence[str], in_use: int,
              cached: int | None) -> TenantStats:
    hits = dict.fromkeys((DEVICE, *tiers), 0) | c.hit_tokens
    by_tier = dict.fromkeys(tiers, 0) | c.stored_bytes_by_tier
    return TenantStats(
        tenant=tenant, requests=c.requests, prompt_tokens=c.prompt_tokens,
        hit_tokens=MappingProxyType(hits), loads=c.loads, loads_failed=c.loads_failed,
        loads_cancelled=c.loads_cancelled, loaded_bytes=c.loaded_bytes, stores=c.stores,
        stored_chunks=c.stored_chunks, stored_bytes=c.stored_bytes,
        stored_bytes_by_tier=MappingProxyType(by_tier), stores_failed=c.stores_failed,
        stores_shed=c.stores_shed, stores_shed_quota=c.stores_shed_quota,
        stores_deduplicated=c.stores_deduplicated, quota_refusals=c.quota_refusals,
        quota_evictions=c.quota_evictions, blocks_in_use=in_use, cached_blocks=cached,
        queries=c.queries, queried_tokens=c.queried_tokens)


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
    """The manager's tenant book: scopes requests, checks the device quotas, snapshots the
    counters. What a tenant stored, loaded and hit is booked by the offload ledger
    (:mod:`kvplugin.aio.offload_ledger`), which also checks the tier byte quotas; this
    keeps what is the device's: blocks in use, cached blocks, admissions refused."""

    def __init__(self, policy: TenantPolicy, *, core: KVCacheManager, keyspace: KeySpace,
                 layout: plans.Layout, hasher: BlockHasher, tiers: Sequence[str],
                 ledger: OffloadLedger) -> None:
        self.policy = policy
        self._core = core
        self._keyspace = keyspace
        self._layout = layout
        self._hasher = hasher
        self._tiers = tuple(tiers)
        self._ledger = ledger
        self._requests: dict[str, set[ReqState]] = {}
        self._holds: dict[str, list[_Hold]] = {}
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

    def tier_quotas(self) -> list[Mapping[str, int]]:
        p = self.policy
        return [q.max_tier_bytes for q in (p.default_quota, *(p.tenants or {}).values())]

    def _check_tiers(self) -> None:
        if not self._tiers:
            # Offload off: nothing is stored, so a tier quota can never bind; a config keeps
            # its quotas when offload is switched off for a comparison.
            return
        for limits in self.tier_quotas():
            unknown = sorted(set(limits) - set(self._tiers))
            if unknown:
                raise ValueError(f"max_tier_bytes names unknown tiers {unknown}; this "
                                 f"connector's tiers are {list(self._tiers)}")

    def _book(self, tenant: str) -> None:
        if tenant in self._requests:
            return
        self._ledger.tenant(tenant)  # a declared tenant shows in the stats from the start
        self._requests[tenant] = set()
        self._holds[tenant] = []
        limit = self.policy.quota(tenant).max_cached_blocks
        if self._cached is not None and limit is not None:
            self._cached.quotas[tenant] = limit

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
        self._book(st.tenant)
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
            self._ledger.refused(st.tenant)

    def load_started(self, st: ReqState) -> None:
        job = st.load
        if job is None:
            raise RuntimeError(f"tenants: load_started for {st.req.request_id!r}, "
                               "which has no load")
        # A load that fails or is cancelled frees the hits it adopted.
        self._enforce_after([job], st)

    # ------------------------------------------------------------------ releases
    def releasing(self, st: ReqState) -> None:
        """The request is about to let its blocks go: note whose cached blocks they are."""
        if self._cached is not None:
            self._cached.record(st)

    def released(self, st: ReqState, blocks: list[KVCacheBlock] | None = None,
                 jobs: frozenset[LoadJob | StoreJob] = frozenset()) -> None:
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
            self._ledger.quota_evicted(st.tenant, n)

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict[str, TenantStats]:
        out = {}
        for tenant, c in self._ledger.tenants().items():
            cached = len(self._cached.cached(tenant)) if self._cached is not None else None
            out[tenant] = _snapshot(c, tenant, self._tiers, len(self.blocks_in_use(tenant)),
                                    cached)
        return out
