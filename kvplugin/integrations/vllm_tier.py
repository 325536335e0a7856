"""kvplugin's tiers as a secondary tier under vLLM 0.33's own CPU offloading.

vLLM's ``OffloadingConnector`` with ``TieringOffloadingSpec`` keeps a CPU primary tier and
cascades what it stores there to its secondary tiers; this module is one, loaded by vLLM's
factory from the entry's ``module_path``::

    "kv_connector": "OffloadingConnector",
    "kv_connector_extra_config": {
        "spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "KVPluginSecondaryTier",
                             "module_path": "kvplugin.integrations.vllm_tier",
                             "config_file": "configs/vllm_tier.yaml"}]}

Entry keys besides ``type`` and ``module_path``: ``config_file`` (a kvplugin deployment
config: its ``offload`` section builds the tiers, memory / disk / Redis / Redis Cluster /
tiered, and its timeouts, store budget and tenants apply), ``default_tenant``,
``enable_kv_events`` (the tiers' stored / removed objects as vLLM ``OffloadingEvent``\\ s,
with global KV events on), ``locality`` and ``medium`` (the defaults follow the tiers), and
vLLM's own ``backpressure`` (built by vLLM's factory).

vLLM calls every method on its scheduler thread (under its manager's lock) and wants each
one quick: lookups answer RETRY until vLLM's lookup thread (:class:`_Lookups`, vLLM's
``AsyncLookupManager``) has asked the tiers, within ``offload.lookup_timeout_ms``; stores
and loads run on kvplugin's loop thread and end through :meth:`get_finished_jobs`. What is
decided, and how, is :mod:`._tier`'s. The tenant is ``kv_transfer_params["tenant"]``, else
its ``cache_salt``, else ``default_tenant`` (vLLM gives a tier no ``cache_salt`` of its
own). vLLM is imported lazily: this module imports without it, building the tier raises an
ImportError naming the ``vllm`` extra.
"""

from __future__ import annotations

import hashlib
import importlib
import os
from collections.abc import Collection, Iterable
from typing import Any

from kvplugin.integrations._tier import ChunkLayout, TierCore

__all__ = ["METRICS", "KVPluginSecondaryTier"]


def _vllm() -> tuple[Any, Any, Any, ImportError | None]:
    try:
        return (importlib.import_module("vllm.v1.kv_offload.base"),
                importlib.import_module("vllm.v1.kv_offload.tiering.base"),
                importlib.import_module("vllm.v1.kv_offload.tiering.async_lookup"), None)
    except ImportError as e:
        return None, None, None, e


_kvb, _tb, _al, _IMPORT_ERROR = _vllm()


class _Absent:
    """Stands in for vLLM's classes when vLLM is not installed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError("kvplugin.integrations.vllm_tier needs vLLM 0.33: install the "
                          "`vllm` extra (pip install 'kvplugin[vllm]')") from _IMPORT_ERROR


SecondaryTierManager: Any = _Absent if _tb is None else _tb.SecondaryTierManager
AsyncLookupManager: Any = _Absent if _al is None else _al.AsyncLookupManager

# Counters (per tenant, and tier where it has one) and gauges this tier reports through
# vLLM's offloading stats; docs/metrics.md lists them.
_P = "vllm:kvplugin_secondary_"
METRICS: dict[str, tuple[str, tuple[str, ...], str]] = {
    "stored_bytes": ("counter", ("tenant", "kvplugin_tier"), "Bytes kvplugin's tiers took, by "
                     "tenant and kvplugin tier."),
    "hit_tokens": ("counter", ("tenant", "kvplugin_tier"), "Tokens of lookups found in kvplugin's "
                   "tiers, by tenant and the kvplugin tier a load reads them from."),
    "queried_tokens": ("counter", ("tenant",), "Tokens of the chunks vLLM asked about."),
    "loaded_bytes": ("counter", ("tenant",), "Bytes loaded into vLLM's primary tier."),
    "loads_failed": ("counter", ("tenant",), "Load jobs with a missing, damaged or "
                     "misshapen object (vLLM recomputes those chunks)."),
    "stores_shed": ("counter", ("tenant", "reason"), "Objects not stored: over the tenant's "
                    "tier byte quota, or over the store budget (the tier falling behind)."),
    "stores_deduplicated": ("counter", ("tenant",), "Objects another job was storing."),
    "tier_errors": ("counter", ("kvplugin_tier",), "Tier calls that failed or timed out."),
    "refused_objects": ("counter", ("kvplugin_tier",), "Objects refused on load: damaged, foreign "
                        "or of another layout."),
    "held_bytes": ("gauge", ("tenant", "kvplugin_tier"), "Bytes a tenant holds in a kvplugin tier "
                   "(with a tier quota)."),
}

# vLLM's medium and locality of each kvplugin tier (a Redis Cluster is the "redis" tier).
_MEDIUM_OF = {"memory": ("CPU", "LOCAL"), "disk": ("STORAGE", "LOCAL"),
              "redis": ("CPU", "REMOTE")}


_TAG = 8  # bytes of the tenant's tag on the keys vLLM's lookup front end caches


class _Lookups(AsyncLookupManager):  # type: ignore[misc]
    """vLLM's async lookup front end, asking kvplugin's tiers from its own thread. It
    caches verdicts by key across requests, and two tenants without a cache salt share
    vLLM's keys: the keys it sees carry the tenant's tag (:meth:`tagged`), so one tenant's
    verdict is never another's."""

    def __init__(self, core: TierCore, tier_type: str) -> None:
        self._core = core
        self._tags: dict[str, bytes] = {}
        super().__init__(tier_type=tier_type)

    def tagged(self, okey: bytes, tenant: str) -> bytes:
        tag = self._tags.get(tenant)
        if tag is None:
            tag = self._tags[tenant] = hashlib.sha256(tenant.encode()).digest()[:_TAG]
        return bytes(okey) + tag

    def batch_lookup(self, keys: list[bytes], req_context: Any) -> Iterable[bool]:
        items = [(k[:-_TAG], req_context.get_offload_key_position(k[:-_TAG])) for k in keys]
        return self._core.lookup(req_context.req_id, req_context.kv_transfer_params, items)


class KVPluginSecondaryTier(SecondaryTierManager):  # type: ignore[misc]
    """A ``SecondaryTierManager`` over kvplugin's tiers (see the module docstring)."""

    medium = None if _kvb is None else _kvb.Medium.STORAGE

    def __init__(self, offloading_spec: Any, primary_kv_view: memoryview, tier_type: str,
                 config_file: str | None = None, default_tenant: str = "default",
                 enable_kv_events: bool = False, locality: str | None = None,
                 medium: str | None = None, backpressure_detector: Any = None) -> None:
        if _IMPORT_ERROR is not None:
            _Absent()
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        if not isinstance(config_file, str) or not config_file:
            raise ValueError(f"secondary tier {tier_type!r}: 'config_file' must name a "
                             "kvplugin deployment config (YAML / TOML / JSON)")
        layout = chunk_layout(offloading_spec, self.block_size_bytes)
        events = bool(enable_kv_events) and bool(getattr(getattr(
            offloading_spec, "kv_events_config", None), "enable_kv_cache_events", False))
        self._core = TierCore(os.path.abspath(config_file), layout, primary_kv_view,
                              default_tenant=default_tenant, events=events)
        try:
            kinds = [_MEDIUM_OF.get(t, ("STORAGE", "LOCAL")) for t in self._core.tiers]
            self.medium = _kvb.Medium(medium.upper() if medium else (
                "CPU" if all(m == "CPU" for m, _ in kinds) else "STORAGE"))
            self.locality = _kvb.Locality(locality.upper() if locality else (
                "REMOTE" if any(loc == "REMOTE" for _, loc in kinds) else "LOCAL"))
            hit = importlib.import_module("vllm.v1.metrics.cache_hit_source").CacheHitSource
            self.cache_hit_source = hit.HOST if self.medium is _kvb.Medium.CPU else hit.DISK
            self._lookups = _Lookups(self._core, tier_type)
        except BaseException:
            self._core.close()
            raise
        self._load_keys: dict[int, tuple[list[bytes], str]] = {}
        self._last: dict[tuple[str, tuple[str, ...]], int] = {}

    @property
    def core(self) -> TierCore:
        return self._core

    # ------------------------------------------------------------------ requests
    def on_new_request(self, req_context: Any) -> Any:
        self._core.open_request(req_context.req_id, req_context.kv_transfer_params)
        return _kvb.RequestOffloadingContext()

    def on_request_finished(self, req_context: Any) -> None:
        self._lookups.cleanup(req_context.req_id)
        self._core.close_request(req_context.req_id)

    def lookup(self, key: Any, req_context: Any) -> Any:
        tenant = self._core.open_request(req_context.req_id, req_context.kv_transfer_params)
        found = self._lookups.lookup(self._lookups.tagged(key, tenant), req_context)
        R = _kvb.LookupResult
        return R.RETRY if found is None else (R.HIT if found else R.MISS)

    def on_schedule_end(self, context: Any) -> None:
        self._lookups.flush()

    # ------------------------------------------------------------------ jobs
    def submit_store(self, job_metadata: Any) -> None:
        ctx = job_metadata.req_context
        keys = [bytes(k) for k in job_metadata.keys]
        self._core.submit_store(job_metadata.job_id, ctx.req_id, ctx.kv_transfer_params, keys,
                                [int(c) for c in job_metadata.chunk_ids],
                                [ctx.get_offload_key_position(k) for k in keys])

    def submit_load(self, job_metadata: Any) -> None:
        ctx = job_metadata.req_context
        keys = [bytes(k) for k in job_metadata.keys]
        tenant = self._core.open_request(ctx.req_id, ctx.kv_transfer_params)
        self._load_keys[job_metadata.job_id] = (keys, tenant)
        self._core.submit_load(job_metadata.job_id, ctx.req_id, ctx.kv_transfer_params, keys,
                               [int(c) for c in job_metadata.chunk_ids])

    def get_finished_jobs(self) -> Iterable[Any]:
        out = []
        for o in self._core.finished():
            load, tenant = self._load_keys.pop(o.job_id, (None, ""))
            if load is not None and not o.success:
                # vLLM's livelock guard: the failed keys' cached HITs turn to misses.
                copied = set(o.loaded)
                self._lookups.mark_miss([self._lookups.tagged(k, tenant) for k in load
                                         if k not in copied])
            partial = load is not None and not o.success and bool(o.loaded)
            out.append(_tb.JobResult(job_id=o.job_id, success=o.success,
                                     successful_keys=tuple(o.loaded) if partial else None,
                                     transfer_time=o.seconds, transfer_bytes=o.nbytes))
        return out

    def has_pending_work(self) -> bool:
        return self._core.pending()

    def drain_jobs(self) -> None:
        self._core.drain()

    def touch(self, keys: Collection[Any], req_context: Any) -> None:
        return None  # each kvplugin tier keeps its own recency on reads

    # ------------------------------------------------------------------ events, metrics
    def take_events(self) -> Iterable[Any]:
        for tier, removed, keys in self._core.events():
            medium, loc = _MEDIUM_OF.get(tier, ("STORAGE", "LOCAL"))
            yield _kvb.OffloadingEvent(keys=keys, medium=_kvb.Medium(medium), removed=removed,
                                       locality=_kvb.Locality(loc), ownership=self.tier_type)

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, Any]:
        out = {}
        for name, (kind, labels, doc) in METRICS.items():
            meta = (_kvb.OffloadingGaugeMetadata if kind == "gauge"
                    else _kvb.OffloadingCounterMetadata)
            out[_P + name] = meta(documentation=doc, labelnames=labels)
        return out

    def get_stats(self) -> Any:
        """The counters' increases since the last call and the gauges now."""
        stats_mod = importlib.import_module(
            "vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics")
        stats = stats_mod.OffloadingConnectorStats()
        counters, gauges = self._core.figures()
        for (name, labels), value in counters.items():
            delta = value - self._last.get((name, labels), 0)
            if delta:
                stats.increase_counter(_P + name, delta, labels)
                self._last[(name, labels)] = value
        for (name, labels), value in gauges.items():
            stats.set_gauge(_P + name, value, labels)
        return None if stats.is_empty() else stats

    def config_info(self) -> dict[str, Any]:
        return {}

    def shutdown(self) -> None:
        try:
            self._lookups.shutdown()
        finally:
            self._core.close()


def chunk_layout(spec: Any, chunk_bytes: int) -> ChunkLayout:
    """What vLLM's primary rows hold, from its ``OffloadingSpec`` (its ``config``)."""
    c = spec.config
    par = c.parallel
    return ChunkLayout(
        model=str(c.model.name), dtype=str(c.model.dtype), chunk_bytes=int(chunk_bytes),
        blocks_per_chunk=int(c.cache.blocks_per_chunk),
        tokens_per_hash=int(c.cache.tokens_per_hash),
        group_tokens=tuple(int(g.tokens_per_block) for g in c.groups),
        group_layers=tuple(tuple(g.layer_names) for g in c.groups),
        windowed=tuple(g.sliding_window_size_in_chunks is not None for g in c.groups),
        parallel=(int(par.tp_size), int(par.pp_size), int(par.pcp_size), int(par.dcp_size)),
        kv_cache_layout=str(c.kv_cache_layout or ""), canonical=bool(c.canonical_layout),
        replicated=bool(c.replicated_layout))
