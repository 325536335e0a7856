"""kvplugin's tiers for an engine that names its objects itself: vLLM's secondary tier
(:mod:`._tier`) and SGLang's HiCache storage backend (:mod:`._hicache`) hand kvplugin keys
(a block or page hash) and bytes, not requests.

What both need, in one place: the deployment's tiers (a shared :class:`~._runtime.Runtime`),
the keys (``Namespace(tenant, model, layout fingerprint, group).key(hash)``, as every
kvplugin object), the tenants (refused when undeclared or invalid), the offload ledger's
keyed verbs (the tenant's tier byte quota on bytes held, deduplication, the store budget:
the rules the native manager and the KV connector execute), the tiers' events (held bytes;
stored / removed objects by the engine's key) and the figures an engine's metrics report.
Nothing here imports an engine.
"""

from __future__ import annotations

import collections
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplugin.aio import plans
from kvplugin.aio.offload_ledger import OffloadLedger, OffloadRequest, StoreObject, StoreResult
from kvplugin.aio.offload_types import StorePlan, TierQuotas
from kvplugin.connectors.events import TierEvent
from kvplugin.connectors.keys import InvalidName, Namespace, ObjectKey
from kvplugin.integrations import _runtime
from kvplugin.integrations._scheduler import tenant_of_salt
from kvplugin.plugin import offload_config

__all__ = ["Decision", "KeyedTiers", "tenant_of_params"]

logger = logging.getLogger(__name__)

_KEEP_IDS = 1 << 20  # storage ids remembered for events (oldest forgotten first)


def tenant_of_params(params: dict[str, Any] | None, default: str) -> str:
    """A request's tenant from what an engine hands a tier (vLLM's ``kv_transfer_params``,
    SGLang's ``extra_info``): ``tenant``, else ``cache_salt`` (read as the KV connector
    reads a salt, :func:`~._scheduler.tenant_of_salt`), else the default tenant. Both
    engines hash the salt into their keys already, so two salts never share a key whatever
    they name."""
    if isinstance(params, dict):
        if params.get("tenant"):
            return str(params["tenant"])
        if params.get("cache_salt"):
            return tenant_of_salt(str(params["cache_salt"]))
    return default


@dataclass(slots=True)
class _Req:
    tenant: str  # "" when the tenant is refused (undeclared, invalid name): no offload
    rq: OffloadRequest | None


@dataclass(slots=True)
class _Tracked:
    """Storage ids this process knows the engine's key of, and which tiers hold them."""

    keys: collections.OrderedDict[str, Any] = field(default_factory=collections.OrderedDict)
    held: dict[str, set[str]] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class Decision:
    """What the ledger made of an offered store: the plan to write (None: nothing), and
    whether objects were shed over the store budget (the tier falling behind, unlike a
    quota shed or a duplicate, which are decisions)."""

    plan: StorePlan | None
    over_budget: bool


class KeyedTiers:
    """The tiers, keys, tenants, ledger and events of one engine-named deployment."""

    def __init__(self, config_file: str, *, fingerprints: Sequence[str],
                 group_tokens: Sequence[int], blocks_per_chunk: int, object_bytes: int,
                 default_tenant: str, events: bool, who: str, engine: str = "vLLM") -> None:
        config, _ = _runtime.settings(config_file)
        _runtime.refuse_unenforceable(config, who=who, engine=engine)
        self.config = config
        self.who = who
        self.fingerprints = tuple(fingerprints)
        self._default = default_tenant
        self._policy = config.tenants.policy()
        self.rt = _runtime.acquire(config_file)
        try:
            self.tiers = tuple(level.name for level in self.rt.connector.levels)
            quotas = TierQuotas.of_policy(self._policy)
            self.ledger = OffloadLedger(
                plans.Layout(tuple(group_tokens), blocks_per_chunk), None,
                page_bytes=[object_bytes] * len(group_tokens), tiers=self.tiers,
                store_budget_bytes=offload_config(config).store_budget_bytes,
                quotas=quotas, reporting=config.offload.tier_kinds())
            self._events = events
            self._token = (self.rt.subscribe_events() if events or quotas.any() else None)
        except BaseException:
            _runtime.release(self.rt)
            raise
        self._lock = threading.Lock()  # the ledger and the books: the engine's threads
        self._reqs: dict[str, _Req] = {}
        self._ns: dict[tuple[str, int], Namespace] = {}
        self._tracked = _Tracked()
        self._pending_events: list[TierEvent] = []
        self.refused_objects = 0  # loads that met a verified object of another shape
        self.closed = False

    # ------------------------------------------------------------------ requests
    def open_request(self, req_id: str, params: dict[str, Any] | None) -> str:
        """A request first seen: its tenant (``""``: refused, no offload for it)."""
        with self._lock:
            return self._req(req_id, params).tenant

    def _req(self, req_id: str, params: dict[str, Any] | None) -> _Req:
        st = self._reqs.get(req_id)
        if st is not None:
            return st
        tenant = tenant_of_params(params, self._default)
        try:
            self._namespace(tenant, 0)
            self._policy.quota(tenant)  # an undeclared tenant: ValueError
            rq: OffloadRequest | None = self.ledger.open(req_id, tenant, tenant, 0)
        except (ValueError, InvalidName) as e:
            logger.warning("%s: request %s gets no offload: %s", self.who, req_id, e)
            tenant, rq = "", None
        st = self._reqs[req_id] = _Req(tenant, rq)
        return st

    def close_request(self, req_id: str) -> None:
        with self._lock:
            st = self._reqs.pop(req_id, None)
            if st is not None and st.rq is not None:
                self.ledger.close(st.rq)

    def _namespace(self, tenant: str, group: int) -> Namespace:
        ns = self._ns.get((tenant, group))
        if ns is None:
            ns = Namespace(tenant, self.config.model.name, self.fingerprints[group], group)
            self._ns[(tenant, group)] = ns
        return ns

    def key(self, tenant: str, group: int, raw: bytes) -> ObjectKey:
        """The kvplugin key of the engine's hash ``raw`` in ``group``."""
        if not 0 <= group < len(self.fingerprints):
            raise ValueError(f"group {group}: this deployment has {len(self.fingerprints)}")
        return self._namespace(tenant, group).key(raw)

    # ------------------------------------------------------------------ stores
    def decide_store(self, req_id: str, params: dict[str, Any] | None,
                     objects: Sequence[StoreObject], names: Sequence[Any]) -> Decision:
        """The ledger's verdict on storing ``objects`` (the engine calls them ``names``,
        remembered for its events). Call :meth:`complete` with the plan's outcome."""
        with self._lock:
            st = self._req(req_id, params)
            if st.rq is None:
                return Decision(None, False)
            if self.ledger.needs_tier_events(st.tenant):
                self._absorb_events()
            c = self.ledger.tenant(st.tenant)
            shed_before = c.stores_shed - c.stores_shed_quota
            plan = self.ledger.prepare_keyed_store(st.rq, objects)
            over = (c.stores_shed - c.stores_shed_quota) > shed_before
            if plan is not None:
                at = {o.key.id: i for i, o in enumerate(objects)}
                for o in plan.objects:
                    self._remember(o.key.id, names[at[o.key.id]])
            return Decision(plan, over)

    def complete(self, plans_done: Sequence[tuple[StorePlan, bool, tuple[int, ...]]]
                 ) -> None:
        """Stores ended: (plan, some tier took every write, per tier what it holds). The
        tiers' events of their writes are applied first (a settled object no tier holds
        is gone)."""
        if not plans_done:
            return
        with self._lock:
            self._absorb_events()
            for plan, ok, held in plans_done:
                self.ledger.complete_store(plan, StoreResult(ok, held))

    def book_query(self, tenant: str, queried_tokens: int, hits: dict[str, int]) -> None:
        with self._lock:
            self.ledger.book_query(tenant, queried_tokens=queried_tokens, local=0,
                                   external=sum(hits.values()), by_tier=hits)

    def book_load(self, tenant: str, copied: Sequence[tuple[str, int, bool]],
                  failed: bool) -> None:
        with self._lock:
            self.ledger.book_keyed_load(tenant, copied=copied, failed=failed)

    # ------------------------------------------------------------------ events
    def _remember(self, sid: str, name: Any) -> None:
        known = self._tracked.keys
        known[sid] = name
        known.move_to_end(sid)
        while len(known) > _KEEP_IDS:
            known.popitem(last=False)

    def _absorb_events(self) -> None:
        """The tiers' events so far: held bytes (quotas), and queued for :meth:`events`."""
        if self._token is None:
            return
        new = self.rt.take_events(self._token)
        if new:
            self.ledger.apply_tier_events(new)
            if self._events:
                self._pending_events.extend(new)

    def events(self) -> list[tuple[str, bool, list[Any]]]:
        """The tiers' stored / removed objects this process knows the engine's key of, as
        (tier, removed, keys), runs merged; a tier's ``cleared`` removes every key it was
        known to hold."""
        with self._lock:
            self._absorb_events()
            new, self._pending_events = self._pending_events, []
        out: list[tuple[str, bool, list[Any]]] = []
        t = self._tracked
        for ev in new:
            held = t.held.setdefault(ev.tier, set())
            if ev.kind == "cleared":
                ids = list(held)
                held.clear()
            else:
                ids = [i for i in ev.ids if i in t.keys]
                (held.update if ev.kind == "stored" else held.difference_update)(ids)
            keys = [t.keys[i] for i in ids if i in t.keys]
            removed = ev.kind != "stored"
            if keys and out and out[-1][:2] == (ev.tier, removed):
                out[-1][2].extend(keys)  # one event per run of a tier's stores / removals
            elif keys:
                out.append((ev.tier, removed, keys))
        return out

    # ------------------------------------------------------------------ figures
    def figures(self) -> tuple[dict[tuple[str, tuple[str, ...]], int],
                               dict[tuple[str, tuple[str, ...]], int]]:
        """Cumulative counters and current gauges, by (name, label values): per tenant
        (and tier) from the ledger, per tier from the tiers' own stats."""
        counters: dict[tuple[str, tuple[str, ...]], int] = {}
        gauges: dict[tuple[str, tuple[str, ...]], int] = {}
        with self._lock:
            for tenant, c in self.ledger.tenants().items():
                for tier, n in c.stored_bytes_by_tier.items():
                    counters[("stored_bytes", (tenant, tier))] = n
                for tier, n in c.hit_tokens.items():
                    if tier != "device":
                        counters[("hit_tokens", (tenant, tier))] = n
                counters[("queried_tokens", (tenant,))] = c.queried_tokens
                counters[("loaded_bytes", (tenant,))] = c.loaded_bytes
                counters[("loads_failed", (tenant,))] = c.loads_failed
                counters[("stores_shed", (tenant, "quota"))] = c.stores_shed_quota
                counters[("stores_shed", (tenant, "budget"))] = (c.stores_shed
                                                                 - c.stores_shed_quota)
                counters[("stores_deduplicated", (tenant,))] = c.stores_deduplicated
            if self.ledger.holdings is not None:
                for (tenant, tier), n in self.ledger.holdings.by_tenant_tier().items():
                    gauges[("held_bytes", (tenant, tier))] = n
        for level in self.rt.connector.levels:
            st = level.stats()
            counters[("tier_errors", (level.name,))] = st.errors + st.timeouts
            counters[("refused_objects", (level.name,))] = st.corrupt_detected
        counters[("refused_objects", ("layout",))] = self.refused_objects
        return counters, gauges

    def release(self) -> None:
        """Let the tiers go (the last user closes them)."""
        if not self.closed:
            self.closed = True
            _runtime.release(self.rt)
