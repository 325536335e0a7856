"""Prometheus metrics of a running deployment (prometheus-client, a private registry).

:func:`build_registry` gives a :class:`~prometheus_client.CollectorRegistry` of its own (never
the global one, so two deployments in one process, or a test, never collide) with one
collector that reads the manager's live state at scrape time: nothing is counted twice, and
the hot path pays nothing for metrics. :func:`start_metrics_server` serves it on
``http://HOST:PORT/metrics`` from a daemon thread::

    server = start_metrics_server(plugin, port=9400)   # a Plugin, a Deployment or a manager
    ...
    server.close()

Every name starts with ``kvplugin_``; :data:`METRICS` documents them (``docs/metrics.md``
shows the same table; a test keeps the two in step). Hit rates are derived, never stored:
``sum(kvplugin_hit_tokens_total) / sum(kvplugin_queried_tokens_total)``.

Threads: the manager lives on one event loop and is not thread-safe (a tenant's blocks in
use walks the core's tables, which the loop mutates). A scrape from the server's thread
therefore asks the loop to take a snapshot (``call_soon_threadsafe``) and waits for it a
bounded time; a scrape on the loop's own thread, or when the loop is not running, reads
directly. When the loop does not answer in time (blocked), the previous snapshot is served
again (counters only grow, so a stale value is still a valid one) and
``kvplugin_metrics_stale_scrapes_total`` counts it; the first scrape has nothing to fall back
on and fails.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import socket
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from socketserver import ThreadingMixIn
from typing import Any, Protocol
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.metrics_core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.utils import floatToGoString

from kvplugin.aio.ledger import LedgerTotals
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.tenants import TenantStats
from kvplugin.aio.values import Histogram, Latency, OffloadStats, Residency
from kvplugin.connectors.base import ConnectorStats
from kvplugin.connectors.refusals import REASONS

__all__ = ["METRICS", "METRIC_NAMES", "ManagerSource", "MetricsServer", "build_registry",
           "snapshot", "start_metrics_server"]

SCRAPE_TIMEOUT = 2.0  # seconds a scrape waits for the event loop's snapshot


@dataclass(frozen=True, slots=True)
class MetricDoc:
    name: str  # as exposed: counters end in _total, histograms add _bucket/_sum/_count
    kind: str  # counter, gauge or histogram
    labels: tuple[str, ...]
    help: str


def _doc(name: str, kind: str, labels: str, text: str) -> MetricDoc:
    return MetricDoc(name, kind, tuple(labels.split()), text)


# tier: "device" (hit tokens only) or a tier's label, as the run report names them
# (memory, disk, redis); tenant: the request's tenant.
METRICS: tuple[MetricDoc, ...] = (
    _doc("kvplugin_lookup_queries_total", "counter", "tenant",
         "Prefix-cache queries whose hits are counted (one per admission)."),
    _doc("kvplugin_queried_tokens_total", "counter", "tenant",
         "Tokens of those queries: the hit rate's denominator."),
    _doc("kvplugin_hit_tokens_total", "counter", "tier tenant",
         "Tokens served from the device cache or a tier instead of being computed."),
    _doc("kvplugin_prompt_tokens_total", "counter", "source tenant",
         "Prompt tokens of finished requests by where they came from, each token once "
         "(source: device, a tier, computed, recomputed, unprocessed; the token ledger, "
         "summing to the prompt tokens)."),
    _doc("kvplugin_discarded_tokens_total", "counter", "tenant",
         "Prompt tokens computed by passes a preemption ended (work, not a source)."),
    _doc("kvplugin_tier_lookups_total", "counter", "",
         "Lookups that asked the tiers."),
    _doc("kvplugin_lookup_timeouts_total", "counter", "",
         "Tier lookups cut by lookup_timeout (answered as misses)."),
    _doc("kvplugin_loads_total", "counter", "",
         "Load jobs started."),
    _doc("kvplugin_load_failures_total", "counter", "",
         "Loads that verified less than they claimed (the rest is recomputed)."),
    _doc("kvplugin_loads_cancelled_total", "counter", "",
         "Loads cancelled (request finished or preempted during its load, shutdown)."),
    _doc("kvplugin_recomputed_tokens_total", "counter", "",
         "Tokens claimed from a tier that did not verify and were computed again."),
    _doc("kvplugin_objects_refused_total", "counter", "",
         "Objects a load fetched but refused: not the object planned (key, token range, "
         "page shape) or a payload of the wrong size."),
    _doc("kvplugin_loaded_bytes_total", "counter", "tier",
         "KV bytes loaded into the device, by the tier the lookup found them at."),
    _doc("kvplugin_loads_skipped_slower_than_recompute_total", "counter", "tier",
         "Claims cut because loading their rest would be slower than recomputing it (by "
         "the slowest tier of the part not loaded; kvplugin.aio.loadcost)."),
    _doc("kvplugin_stores_total", "counter", "",
         "Store jobs started."),
    _doc("kvplugin_stored_chunks_total", "counter", "",
         "Chunk objects stored (every tier written)."),
    _doc("kvplugin_stores_shed_total", "counter", "",
         "Chunk objects not stored: over the in-flight byte budget or a tenant's tier quota."),
    _doc("kvplugin_stores_failed_total", "counter", "",
         "Objects of store jobs that failed or were cancelled."),
    _doc("kvplugin_stores_deduplicated_total", "counter", "",
         "Objects already being stored by another request."),
    _doc("kvplugin_store_copies_on_reuse_total", "counter", "",
         "Store copy-outs done when a block was handed out again before its store job "
         "copied it (on the allocation path instead of beside the next step)."),
    _doc("kvplugin_stored_bytes_total", "counter", "tier tenant",
         "KV bytes of finished stores, charged on each tier for the objects that tier "
         "confirmed (nothing where its write failed: a dead Redis is charged 0)."),
    _doc("kvplugin_stored_states_total", "counter", "",
         "Mamba states stored (with their checkpoint's chunks)."),
    _doc("kvplugin_loaded_states_total", "counter", "",
         "Mamba states restored from a tier."),
    _doc("kvplugin_quota_refusals_total", "counter", "tenant",
         "Admissions refused over the tenant's blocks-in-use quota."),
    _doc("kvplugin_quota_evictions_total", "counter", "tenant",
         "Cached device blocks evicted over the tenant's cached-block quota."),
    _doc("kvplugin_corrupt_objects_total", "counter", "tier",
         "Objects a tier found corrupt or forged on read (counted misses, deleted)."),
    _doc("kvplugin_corrupt_objects_by_reason_total", "counter", "tier reason",
         "The same objects by reason: checksum (or MAC), metadata (another key's or "
         "namespace's), truncated, format (not a kvplugin object)."),
    _doc("kvplugin_tier_errors_total", "counter", "tier",
         "Backend calls of a tier that failed."),
    _doc("kvplugin_tier_timeouts_total", "counter", "tier",
         "Backend calls of a tier cut by their deadline."),
    _doc("kvplugin_tier_evictions_total", "counter", "tier",
         "Objects a tier evicted to stay within its byte budget."),
    _doc("kvplugin_metrics_stale_scrapes_total", "counter", "",
         "Scrapes answered with the previous snapshot (the event loop did not answer)."),
    _doc("kvplugin_lookup_latency_seconds", "histogram", "",
         "Tier lookups, from the first tier call to the answer (or the timeout)."),
    _doc("kvplugin_load_latency_seconds", "histogram", "tier",
         "Load jobs, from the admission that claimed them to their end (published, failed "
         "or cancelled), by the slowest tier they read from."),
    _doc("kvplugin_store_latency_seconds", "histogram", "",
         "Store jobs, from the copy-out to the end of the write to every tier."),
    _doc("kvplugin_block_lifetime_seconds", "histogram", "",
         "Sampled device blocks (layout.metrics_collector_sample_rate), from allocation to "
         "their reuse for another block (no samples when sampling is off)."),
    _doc("kvplugin_block_idle_seconds", "histogram", "",
         "Sampled device blocks: from their last hit (or allocation) to their reuse."),
    _doc("kvplugin_block_reuse_gap_seconds", "histogram", "",
         "Sampled device blocks: the time between consecutive hits (the last few per block)."),
    _doc("kvplugin_inflight_jobs", "gauge", "kind",
         "Load and store jobs running now."),
    _doc("kvplugin_store_bytes_in_flight", "gauge", "",
         "Payload bytes of the stores running now (bounded by store_budget_mb)."),
    _doc("kvplugin_device_blocks", "gauge", "state",
         "Device pool blocks: free (including evictable cached ones) or used."),
    _doc("kvplugin_device_blocks_held", "gauge", "",
         "Blocks of finished or preempted requests kept until their jobs end."),
    _doc("kvplugin_tenant_blocks_in_use", "gauge", "tenant",
         "Distinct device blocks the tenant's requests and their jobs hold."),
    _doc("kvplugin_tenant_cached_blocks", "gauge", "tenant",
         "The tenant's free-but-cached device blocks (tenants with a cached-block quota)."),
    _doc("kvplugin_offload_enabled", "gauge", "",
         "1 when a connector backs the device cache, 0 with offload off."),
)
METRIC_NAMES: tuple[str, ...] = tuple(m.name for m in METRICS)
_DOCS = {m.name: m for m in METRICS}


# --------------------------------------------------------------------------- snapshot


@dataclass(frozen=True, slots=True)
class Snapshot:
    """Everything a scrape shows, copied on the manager's loop."""

    offload: bool
    stats: OffloadStats
    tenants: Mapping[str, TenantStats]
    ledger: Mapping[str, LedgerTotals]  # per tenant, finished requests
    latency: Latency
    residency: Residency | None  # None: the core samples no blocks
    tier_stats: Sequence[ConnectorStats]  # per level
    tier_labels: Mapping[str, str]  # tier name -> label
    level_labels: Sequence[str]  # per level
    free_blocks: int
    total_blocks: int
    held_blocks: int
    jobs: Mapping[str, int]
    store_bytes_in_flight: int


def snapshot(mgr: AsyncKVManager, labels: Sequence[str]) -> Snapshot:
    """Copy the manager's state (call on its loop). ``labels``: one per tier level."""
    view = mgr.core.offload_view()
    return Snapshot(
        offload=mgr.offload, stats=mgr.stats(), tenants=mgr.tenant_stats(),
        ledger=mgr.ledger.per_tenant(),
        latency=mgr.latency(), residency=mgr.residency(), tier_stats=mgr.tier_stats(),
        tier_labels=dict(zip(mgr.tiers, labels, strict=True)), level_labels=list(labels),
        free_blocks=view.num_free_blocks(), total_blocks=view.num_usable_blocks,
        held_blocks=mgr.num_held_blocks, jobs=mgr.pending_jobs(),
        store_bytes_in_flight=mgr.store_bytes_in_flight)


class ManagerSource(Protocol):
    """What holds a deployment's manager: a loaded :class:`~kvplugin.plugin.Plugin`, an
    engine's deployment (the reference engine's ``Deployment``), any engine's own."""

    @property
    def manager(self) -> AsyncKVManager: ...


def _manager_of(source: ManagerSource | AsyncKVManager) -> AsyncKVManager:
    # getattr, not the attribute: anything else gets a TypeError that says what is wanted.
    mgr = source if isinstance(source, AsyncKVManager) else getattr(source, "manager", None)
    if not isinstance(mgr, AsyncKVManager):
        raise TypeError(f"metrics need a Plugin, a Deployment or an AsyncKVManager, got "
                        f"{type(source).__name__}")
    return mgr


# --------------------------------------------------------------------------- collector


class ManagerCollector:
    """Reads one manager at scrape time (see the module's note on threads)."""

    def __init__(self, mgr: AsyncKVManager, labels: Sequence[str],
                 loop: asyncio.AbstractEventLoop | None, timeout: float) -> None:
        self._mgr = mgr
        self._labels = list(labels)
        self._loop = loop
        self._timeout = timeout
        self._lock = threading.Lock()  # the server answers scrapes on several threads
        self._last: Snapshot | None = None
        self._stale = 0

    def read(self) -> tuple[Snapshot, int]:
        """A snapshot, and how many scrapes so far were answered with a stale one."""
        loop = self._loop
        if loop is None or not loop.is_running() or _running_loop() is loop:
            snap = snapshot(self._mgr, self._labels)
        else:
            try:
                snap = self._from_loop(loop)
            except (TimeoutError, RuntimeError):  # RuntimeError: the loop closed
                with self._lock:
                    if self._last is None:
                        raise
                    self._stale += 1
                    return self._last, self._stale
        with self._lock:
            self._last = snap
            return snap, self._stale

    def _from_loop(self, loop: asyncio.AbstractEventLoop) -> Snapshot:
        fut: concurrent.futures.Future[Snapshot] = concurrent.futures.Future()

        def take() -> None:
            if not fut.set_running_or_notify_cancel():
                return  # the scrape gave up waiting
            try:
                fut.set_result(snapshot(self._mgr, self._labels))
            except BaseException as exc:
                fut.set_exception(exc)

        loop.call_soon_threadsafe(take)
        try:
            return fut.result(self._timeout)
        except TimeoutError:
            fut.cancel()
            raise

    def collect(self) -> Iterator[Metric]:
        snap, stale = self.read()
        yield from _queries(snap)
        yield from _counters(snap)
        yield from _tiers(snap)
        yield from _histograms(snap)
        yield from _gauges(snap)
        yield _counter("kvplugin_metrics_stale_scrapes_total", {(): stale})


def _running_loop() -> asyncio.AbstractEventLoop | None:
    try:
        return asyncio.get_running_loop()
    except RuntimeError:
        return None


# --------------------------------------------------------------------------- families

Samples = Mapping[tuple[str, ...], float]


def _family(name: str, samples: Samples) -> Metric:
    doc = _DOCS[name]
    fam: CounterMetricFamily | GaugeMetricFamily
    if doc.kind == "counter":
        fam = CounterMetricFamily(name, doc.help, labels=doc.labels)
    else:
        fam = GaugeMetricFamily(name, doc.help, labels=doc.labels)
    for labels, value in sorted(samples.items()):
        fam.add_metric(list(labels), value)
    return fam


_counter = _gauge = _family


def _add(out: dict[tuple[str, ...], float], key: tuple[str, ...], value: float) -> None:
    # A label is a tier's name (unique); a value booked twice under one key adds up.
    out[key] = out.get(key, 0) + value


def _queries(s: Snapshot) -> Iterator[Metric]:
    ts = s.tenants
    yield _counter("kvplugin_lookup_queries_total", {(t,): v.queries for t, v in ts.items()})
    yield _counter("kvplugin_queried_tokens_total",
                   {(t,): v.queried_tokens for t, v in ts.items()})
    hits: dict[tuple[str, ...], float] = {}
    stored: dict[tuple[str, ...], float] = {}
    for t, v in ts.items():
        for tier, n in v.hit_tokens.items():
            _add(hits, (s.tier_labels.get(tier, tier), t), n)
        for tier, n in v.stored_bytes_by_tier.items():
            _add(stored, (s.tier_labels.get(tier, tier), t), n)
    yield _counter("kvplugin_hit_tokens_total", hits)
    books: dict[tuple[str, ...], float] = {}
    for t, lt in s.ledger.items():
        for src, n in lt.sources.items():
            _add(books, (s.tier_labels.get(src, src), t), n)
    yield _counter("kvplugin_prompt_tokens_total", books)
    yield _counter("kvplugin_discarded_tokens_total",
                   {(t,): lt.discarded_tokens for t, lt in s.ledger.items()})
    yield _counter("kvplugin_stored_bytes_total", stored)
    yield _counter("kvplugin_quota_refusals_total",
                   {(t,): v.quota_refusals for t, v in ts.items()})
    yield _counter("kvplugin_quota_evictions_total",
                   {(t,): v.quota_evictions for t, v in ts.items()})


_PLAIN = {  # metric -> OffloadStats field
    "kvplugin_tier_lookups_total": "lookups",
    "kvplugin_lookup_timeouts_total": "lookup_timeouts",
    "kvplugin_loads_total": "loads",
    "kvplugin_load_failures_total": "loads_failed",
    "kvplugin_loads_cancelled_total": "loads_cancelled",
    "kvplugin_recomputed_tokens_total": "recomputed_tokens",
    "kvplugin_objects_refused_total": "objects_refused",
    "kvplugin_stores_total": "stores",
    "kvplugin_stored_chunks_total": "stored_chunks",
    "kvplugin_stores_shed_total": "stores_shed",
    "kvplugin_stores_failed_total": "stores_failed",
    "kvplugin_stores_deduplicated_total": "stores_deduplicated",
    "kvplugin_store_copies_on_reuse_total": "copies_on_reuse",
    "kvplugin_stored_states_total": "stored_states",
    "kvplugin_loaded_states_total": "loaded_states",
}


def _counters(s: Snapshot) -> Iterator[Metric]:
    for name, attr in _PLAIN.items():
        yield _counter(name, {(): getattr(s.stats, attr)})
    loaded: dict[tuple[str, ...], float] = {(label,): 0 for label in s.level_labels}
    for tier, n in s.stats.loaded_bytes_by_tier.items():
        _add(loaded, (s.tier_labels.get(tier, tier),), n)
    yield _counter("kvplugin_loaded_bytes_total", loaded)
    skipped: dict[tuple[str, ...], float] = {(label,): 0 for label in s.level_labels}
    for tier, n in s.stats.loads_skipped_slower_than_recompute.items():
        _add(skipped, (s.tier_labels.get(tier, tier),), n)
    yield _counter("kvplugin_loads_skipped_slower_than_recompute_total", skipped)


_TIER_FIELDS = {
    "kvplugin_corrupt_objects_total": "corrupt_detected",
    "kvplugin_tier_errors_total": "errors",
    "kvplugin_tier_timeouts_total": "timeouts",
    "kvplugin_tier_evictions_total": "evicted",
}


def _tiers(s: Snapshot) -> Iterator[Metric]:
    for name, attr in _TIER_FIELDS.items():
        out: dict[tuple[str, ...], float] = {}
        for label, st in zip(s.level_labels, s.tier_stats, strict=True):
            _add(out, (label,), getattr(st, attr))
        yield _counter(name, out)
    refused: dict[tuple[str, ...], float] = {}
    for label, st in zip(s.level_labels, s.tier_stats, strict=True):
        for reason in REASONS:
            _add(refused, (label, reason), getattr(st, f"corrupt_{reason}"))
    yield _counter("kvplugin_corrupt_objects_by_reason_total", refused)


def _le(bound: float) -> str:
    # Prometheus' spelling: "0.0005", "1.0", "+Inf" (the helper is untyped upstream).
    return str(floatToGoString(bound))  # type: ignore[no-untyped-call]


def _histogram(name: str, by_label: Mapping[tuple[str, ...], Histogram]) -> Metric:
    doc = _DOCS[name]
    fam = HistogramMetricFamily(name, doc.help, labels=doc.labels)
    for labels, h in sorted(by_label.items()):
        buckets = [(_le(le), float(n)) for le, n in h.cumulative()]
        fam.add_metric(list(labels), buckets, h.sum)
    return fam


def _histograms(s: Snapshot) -> Iterator[Metric]:
    lat = s.latency
    yield _histogram("kvplugin_lookup_latency_seconds", {(): lat.lookup})
    loads: dict[tuple[str, ...], Histogram] = {}
    for tier, h in lat.load.items():
        key = (s.tier_labels.get(tier, tier),)
        loads[key] = loads[key] + h if key in loads else h
    yield _histogram("kvplugin_load_latency_seconds", loads)
    yield _histogram("kvplugin_store_latency_seconds", {(): lat.store})
    r = s.residency
    yield _histogram("kvplugin_block_lifetime_seconds", {(): r.lifetime} if r else {})
    yield _histogram("kvplugin_block_idle_seconds", {(): r.idle} if r else {})
    yield _histogram("kvplugin_block_reuse_gap_seconds", {(): r.reuse_gap} if r else {})


def _gauges(s: Snapshot) -> Iterator[Metric]:
    yield _gauge("kvplugin_inflight_jobs", {(k,): n for k, n in s.jobs.items()})
    yield _gauge("kvplugin_store_bytes_in_flight", {(): s.store_bytes_in_flight})
    yield _gauge("kvplugin_device_blocks", {("free",): s.free_blocks,
                                            ("used",): s.total_blocks - s.free_blocks})
    yield _gauge("kvplugin_device_blocks_held", {(): s.held_blocks})
    ts = s.tenants
    yield _gauge("kvplugin_tenant_blocks_in_use", {(t,): v.blocks_in_use for t, v in ts.items()})
    yield _gauge("kvplugin_tenant_cached_blocks", {(t,): v.cached_blocks for t, v in ts.items()
                                                   if v.cached_blocks is not None})
    yield _gauge("kvplugin_offload_enabled", {(): int(s.offload)})


# --------------------------------------------------------------------------- registry, server


def build_registry(source: ManagerSource | AsyncKVManager, *,
                   loop: asyncio.AbstractEventLoop | None = None,
                   timeout: float = SCRAPE_TIMEOUT) -> CollectorRegistry:
    """A private registry reading ``source``'s manager at scrape time. ``loop``: the
    manager's event loop (default: the running one, if any), where scrapes from other
    threads take their snapshot."""
    mgr = _manager_of(source)
    labels = list(mgr.tiers)  # a tier's name, as the run report and the plugin name it
    if loop is None:
        loop = _running_loop()
    registry = CollectorRegistry(auto_describe=False)  # describing would scrape now
    registry.register(ManagerCollector(mgr, labels, loop, timeout))
    return registry


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        """A scrape every few seconds is not news."""


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True  # a scrape in progress never holds the process open


class _Server6(_Server):
    address_family = socket.AF_INET6


class MetricsServer:
    """``/metrics`` of one registry on a daemon thread; ``close()`` stops and joins it."""

    def __init__(self, registry: CollectorRegistry, host: str, port: int) -> None:
        if type(port) is not int or not 0 <= port <= 65535:
            raise ValueError(f"port must be an int in 0..65535, got {port!r}")
        cls = _Server6 if ":" in host else _Server
        self.registry = registry
        self.host = host
        self._httpd = make_server(host, port, make_wsgi_app(registry), cls,
                                  handler_class=_Quiet)
        # The bound port (the kernel's choice when 0 was asked).
        self.port: int = self._httpd.server_address[1]
        # A short poll interval: close() waits for the serving loop to notice.
        self._thread = threading.Thread(target=self._httpd.serve_forever,
                                        kwargs={"poll_interval": 0.05},
                                        name=f"kvplugin-metrics-{self.port}", daemon=True)
        self._thread.start()
        self._closed = False

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving, close the socket, join the thread. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._httpd.shutdown()
        self._httpd.server_close()
        self._thread.join(5)

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_metrics_server(source: ManagerSource | AsyncKVManager, *, port: int,
                         host: str = "127.0.0.1",
                         timeout: float = SCRAPE_TIMEOUT) -> MetricsServer:
    """Serve ``source``'s metrics on ``http://host:port/metrics`` (``port=0``: a free port,
    see ``.port``). Call it on the manager's event loop (or pass a registry's loop through
    :func:`build_registry` and :class:`MetricsServer`) so that scrapes snapshot there."""
    return MetricsServer(build_registry(source, timeout=timeout), host, port)
