"""The connector's counters in vLLM's own stats channel: the worker reports them each step
(``get_kv_connector_stats``), vLLM sums them over workers, logs them with its "KV Transfer
metrics" line and exports them as Prometheus counters ``vllm:kvplugin_<name>_total`` (the
OpenAI server's ``/metrics``, ``LLM.get_metrics()``).

vLLM is imported by name; without it the classes derive from ``object`` and are unused.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from typing import Any

__all__ = ["COUNTERS", "KVPluginPromMetrics", "KVPluginStats"]

# name -> what it counts (every figure a count since the last report)
COUNTERS = {
    "loads": "loads completed (every object in place and verified)",
    "loads_failed": "loads that vLLM recomputed (an object missing or refused)",
    "objects_loaded": "stored objects copied into vLLM's KV cache, verified",
    "objects_refused": "objects a load asked for that were missing or failed verification "
                       "(damaged, truncated, another model's or tenant's): a visible miss",
    "objects_stored": "objects every tier write of a store confirmed",
    "stores_failed": "stores that did not complete (a tier error or timeout)",
    "stores_withheld": "objects not stored because their step read a block whose load "
                       "failed (their KV was computed from it: vLLM computes them again)",
    "bytes_loaded": "payload bytes copied into vLLM's KV cache",
    "bytes_stored": "payload bytes of confirmed stores",
}


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
    """Counts since the last report: ``data`` maps a name of :data:`COUNTERS` to a count
    (a plain dict, as vLLM sends stats between processes)."""

    data: dict[str, Any] = field(default_factory=dict)

    def add(self, name: str, n: int = 1) -> None:
        if name not in COUNTERS:
            raise KeyError(f"unknown kvplugin counter {name!r}")
        if n:
            self.data[name] = self.data.get(name, 0) + n

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: Any) -> KVPluginStats:
        for k, v in (other.data or {}).items():
            if k in COUNTERS:
                self.data[k] = self.data.get(k, 0) + int(v)
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: self.data.get(k, 0) for k in COUNTERS if k in self.data}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class KVPluginPromMetrics(_PromBase):  # type: ignore[misc]
    """One Prometheus counter per name of :data:`COUNTERS`, per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:kvplugin_{name}", documentation=doc,
                                       labelnames=labelnames)
            self._counters[name] = {engine: metric.labels(*values)
                                    for engine, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in transfer_stats_data.items():
            per_engine = self._counters.get(name)
            if per_engine is not None and value:
                per_engine[engine_idx].inc(value)
