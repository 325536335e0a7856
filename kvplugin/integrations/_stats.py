"""The connector's counters in vLLM's own stats channel.

One book, the offload ledger's (:class:`~kvplugin.aio.offload_ledger.OffloadLedger`, the
one the native manager keeps): the scheduler's connector books every query, plan and
outcome per tenant (its workers report how each store and load ended), and reports what
changed since its last report (``get_kv_connector_stats`` of the scheduler's connector,
which vLLM 0.32+ merges with the workers'). The workers add what only they see: objects a
load refused, stores withheld, tier errors per tier. vLLM sums the reports, logs them
with its "KV Transfer metrics" line and exports them as Prometheus metrics
``vllm:kvplugin_<name>`` (the OpenAI server's ``/metrics``, ``LLM.get_metrics()``), with
a ``tenant`` label (and ``tier`` where the native metric has one): the same names and
meanings as the native metrics (docs/metrics.md).

``data`` is a flat dict (vLLM ships stats between processes): ``name``, ``name|tenant`` or
``name|tenant|tier`` (``name||tier`` for a per-tier worker figure) to a count, or for a
gauge to its value now.

vLLM is imported by name; without it the classes derive from ``object`` and are unused.
"""

from __future__ import annotations

import importlib
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplugin.aio.offload_ledger import OffloadLedger

__all__ = ["COUNTERS", "GAUGES", "KVPluginPromMetrics", "KVPluginStats", "RateLimitedLog",
           "TenantBook"]

logger = logging.getLogger("kvplugin.integrations.vllm")
_LOG_EVERY_S = 30.0  # one line per kind of trouble per interval, with the count

# name -> (labels beyond vLLM's engine labels, what it counts)
COUNTERS: dict[str, tuple[tuple[str, ...], str]] = {
    # the ledger's, per tenant
    "requests": (("tenant",), "requests seen by the scheduler's connector"),
    "lookup_queries": (("tenant",), "prefix-cache queries whose hits are counted (one per "
                                    "admission)"),
    "queried_tokens": (("tenant",), "tokens of those queries: the hit rate's denominator"),
    "hit_tokens": (("tenant", "tier"), "tokens served from the device cache (tier=device) "
                                       "or the tiers (tier=offload) instead of computed"),
    "loads": (("tenant",), "loads started"),
    "load_failures": (("tenant",), "loads that verified less than they claimed (vLLM "
                                   "recomputes the rest)"),
    "loaded_bytes": (("tenant",), "KV bytes loaded into vLLM's KV cache, verified"),
    "loaded_states": ((), "Mamba states restored from the tiers (a hybrid's hit at a "
                          "boundary whose state was stored)"),
    "stores": (("tenant",), "store plans started"),
    "stored_chunks": (("tenant",), "chunk objects stored (every worker's part on some "
                                   "tier)"),
    "stored_bytes": (("tenant", "tier"), "KV bytes of finished stores, charged on each tier "
                                         "for the objects that tier confirmed"),
    "stores_failed": (("tenant",), "objects of store plans that failed (a tier error or "
                                   "timeout)"),
    "stores_shed": (("tenant",), "objects not stored: over the in-flight byte budget or "
                                 "the tenant's tier quota"),
    "stores_shed_quota": (("tenant",), "of those, over the tenant's tier byte quota"),
    "stores_deduplicated": (("tenant",), "objects already being stored by another request"),
    # the workers'
    "objects_refused": ((), "objects a load asked for that were missing or failed "
                            "verification (damaged, truncated, another model's or tenant's): "
                            "a visible miss"),
    "stores_withheld": ((), "objects not stored because their step read a block whose load "
                            "failed (their KV was computed from it: vLLM computes them again)"),
    "tier_errors": (("tier",), "backend calls of a tier that failed (a write-through failure "
                               "counts even when another tier took the object)"),
}
GAUGES: dict[str, tuple[tuple[str, ...], str]] = {
    "tier_bytes_held": (("tenant", "tier"), "bytes of the tenant's objects the tier holds now "
                                            "(tenants with a tier byte quota)"),
}
_LEDGER = {"requests": "requests", "lookup_queries": "queries",
           "queried_tokens": "queried_tokens", "loads": "loads",
           "load_failures": "loads_failed", "loaded_bytes": "loaded_bytes", "stores": "stores",
           "stored_chunks": "stored_chunks", "stores_failed": "stores_failed",
           "stores_shed": "stores_shed", "stores_shed_quota": "stores_shed_quota",
           "stores_deduplicated": "stores_deduplicated"}
_BY_TIER = {"hit_tokens": "hit_tokens", "stored_bytes": "stored_bytes_by_tier"}


def key(name: str, tenant: str = "", tier: str = "") -> str:
    """The flat ``data`` key of a figure (see the module docstring)."""
    if name not in COUNTERS and name not in GAUGES:
        raise KeyError(f"unknown kvplugin figure {name!r}")
    return name + (f"|{tenant}|{tier}" if tier else f"|{tenant}" if tenant else "")


def split(k: str) -> tuple[str, str, str]:
    """(name, tenant, tier) of a flat key."""
    parts = k.split("|")
    return parts[0], parts[1] if len(parts) > 1 else "", parts[2] if len(parts) > 2 else ""


def _vllm_metrics() -> Any:
    try:
        return importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.metrics")
    except ImportError:
        return None


_m = _vllm_metrics()
_StatsBase: Any = object if _m is None else _m.KVConnectorStats
_PromBase: Any = object if _m is None else _m.KVConnectorPromMetrics


@dataclass
class KVPluginStats(_StatsBase):  # type: ignore[misc]
    """Counts since the last report and gauges now, keyed as :func:`key` says."""

    data: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, n: int = 1, *, tenant: str = "", tier: str = "") -> None:
        k = key(name, tenant, tier)
        if n:
            self.data[k] = self.data.get(k, 0) + n

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> KVPluginStats:
        for k, v in (other.data or {}).items():
            name = split(k)[0]
            if name in GAUGES:
                self.data[k] = int(v)  # the latest value
            elif name in COUNTERS:
                self.data[k] = self.data.get(k, 0) + int(v)
        return self

    def totals(self) -> dict[str, int]:
        """Each figure summed over its labels."""
        out: dict[str, int] = {}
        for k, v in self.data.items():
            name = split(k)[0]
            out[name] = out.get(name, 0) + int(v)
        return out

    def reduce(self) -> dict[str, int | float]:
        totals = self.totals()
        return {n: totals[n] for n in (*COUNTERS, *GAUGES) if n in totals}

    def is_empty(self) -> bool:
        return not any(self.data.values())


@dataclass(slots=True)
class TenantBook:
    """What the scheduler's ledger reports: the change of each per-tenant counter since the
    last report, and the bytes held per tenant and tier now."""

    _last: dict[str, int] = field(default_factory=dict)

    def delta(self, ledger: OffloadLedger) -> KVPluginStats | None:
        now = dict(_figures(ledger))
        stats = KVPluginStats()
        for k, v in now.items():
            if split(k)[0] in GAUGES:
                if self._last.get(k) != v:
                    stats.data[k] = v
            elif v != self._last.get(k, 0):
                stats.data[k] = v - self._last.get(k, 0)
        for k in self._last.keys() - now.keys():
            if split(k)[0] in GAUGES:
                stats.data[k] = 0  # nothing held any more
        self._last = now
        return stats if stats.data else None


def _figures(ledger: OffloadLedger) -> Iterator[tuple[str, int]]:
    for tenant, c in ledger.tenants().items():
        for name, attr in _LEDGER.items():
            yield key(name, tenant), getattr(c, attr)
        for name, attr in _BY_TIER.items():
            for tier, n in getattr(c, attr).items():
                yield key(name, tenant, tier), n
    yield key("loaded_states"), ledger.loaded_states
    if ledger.holdings is not None:
        for (tenant, tier), n in ledger.holdings.by_tenant_tier().items():
            yield key("tier_bytes_held", tenant, tier), n


class KVPluginPromMetrics(_PromBase):  # type: ignore[misc]
    """One Prometheus counter per name of :data:`COUNTERS` (a gauge per :data:`GAUGES`),
    labelled by engine and, where the figure has them, tenant and tier."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._engines = per_engine_labelvalues
        self._metrics: dict[str, Any] = {}
        for table, cls in ((COUNTERS, self._counter_cls), (GAUGES, self._gauge_cls)):
            for name, (labels, doc) in table.items():
                metric = cls(name=f"vllm:kvplugin_{name}", documentation=doc,
                             labelnames=[*labelnames, *labels])
                self._metrics[name] = metric
                if not labels:  # known label sets start at 0; tenants and tiers as they come
                    for values in per_engine_labelvalues.values():
                        metric.labels(*values)

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, value in transfer_stats_data.items():
            name, tenant, tier = split(k)
            metric = self._metrics.get(name)
            if metric is None:
                continue
            labels = COUNTERS.get(name, GAUGES.get(name, ((), "")))[0]
            values = {"tenant": tenant, "tier": tier}
            child = metric.labels(*self._engines[engine_idx], *(values[n] for n in labels))
            if name in GAUGES:
                child.set(value)
            elif value:
                child.inc(value)


class RateLimitedLog:
    """One warning per key per interval, saying how many were held back (a dead tier
    must not write one line per request into a busy server's log)."""

    def __init__(self, interval: float = _LOG_EVERY_S) -> None:
        self._interval = interval
        self._last: dict[str, tuple[float, int]] = {}

    def logged(self, what: str) -> None:
        """A line about ``what`` was just written elsewhere (the start's health warning):
        the next ones within the interval are held back and counted."""
        self._last[what] = (time.monotonic(), 0)

    def warn(self, what: str, msg: str, *args: Any) -> None:
        now = time.monotonic()
        seen = self._last.get(what)
        if seen is not None and now - seen[0] < self._interval:
            self._last[what] = (seen[0], seen[1] + 1)
            return
        held = 0 if seen is None else seen[1]
        self._last[what] = (now, 0)
        suffix = f" ({held} more like it in the last {self._interval:.0f} s)" if held else ""
        logger.warning("kvplugin: " + msg + suffix, *args)
