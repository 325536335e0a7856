"""``kvplugin run``'s main job: the configured workload through the engine, then a report.

Clients arrive in real time (a follow-up a think time after its parent's answer), the
engine serves them, and at the end the manager drains its stores and closes; only then are
leaks counted: blocks not back in the core's free pool, plus jobs still pending.
:func:`serve_compare` serves the same requests again with offload off, for the ratios.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import TYPE_CHECKING

from kvplugin.aio.jobs import connector_tiers
from kvplugin.aio.loop import run, uvloop_available
from kvplugin.connectors.base import Connector, ConnectorStats, Health
from kvplugin.connectors.faults import FaultInjector
from kvplugin.connectors.refusals import REASONS
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.engine import interrupt
from kvplugin.engine.build import Deployment, TierWrapper, deployment, workload_tenancy
from kvplugin.engine.config import RunConfig
from kvplugin.engine.loop import LagProbe
from kvplugin.engine.progress import Progress, follow, hit_sources, ledger_sources, postfix
from kvplugin.engine.report import RunReport, Sample, TenantRow
from kvplugin.engine.scheduler import Result
from kvplugin.engine.served import Served, drive
from kvplugin.engine.workload import RequestSpec, stream
from kvplugin.plugin import deployment_cost

if TYPE_CHECKING:
    from kvplugin.metrics import MetricsServer

__all__ = ["drive", "max_prompt_len", "report", "run_compare", "run_engine", "serve",
           "serve_compare", "without_offload", "workload_specs"]

logger = logging.getLogger(__name__)

ProgressFor = Callable[[str], Progress | None]  # a run's label -> its bar (or none)


class TierUnavailable(RuntimeError):
    """A tier did not answer at start and the deployment requires every tier."""


HEALTH_TIMEOUT_S = 2.0


async def check_tiers(dep: Deployment, *, required: bool) -> list[str]:
    """Ask every tier for its health at start: one warning (logged, and returned) per tier
    that does not answer, or :class:`TierUnavailable` when ``required``. A fault drill's
    injector is looked through: the drill is for the run, not for this check."""
    if dep.connector is None:
        return []
    tiers: list[Connector] = connector_tiers(dep.connector)
    raw = [t.inner if isinstance(t, FaultInjector) else t for t in tiers]
    reports = await asyncio.gather(*(t.health(timeout=HEALTH_TIMEOUT_S) for t in raw),
                                   return_exceptions=True)
    out = []
    for label, conn, h in zip(dep.tier_labels, raw, reports, strict=True):
        if isinstance(h, Health) and h.ok:
            continue
        detail = h.detail if isinstance(h, Health) else f"{type(h).__name__}: {h}"
        name = f"tier {label}" + (f" ({conn.name})" if conn.name != label else "")
        what = f"{name} does not answer at start: {detail}"
        if required:
            raise TierUnavailable(f"{what} (offload.require_tiers)")
        msg = f"{what}; its lookups miss and its stores fail (counted in tier_errors)"
        logger.warning("%s", msg)
        out.append(msg)
    return out


async def serve(cfg: RunConfig, *, wrap_tiers: TierWrapper | None = None,
                specs: Sequence[RequestSpec] | None = None, progress: Progress | None = None,
                metrics_port: int | None = None, metrics_linger_s: float = 0.0,
                stop_at_s: float | None = None,
                on_result: Callable[[Result, float], None] | None = None,
                interruptible: bool = False) -> RunReport:
    """Build the deployment, serve the workload (``specs``, or the config's), close, report.
    ``progress`` gets the requests finished every 100 ms; with ``metrics_port`` the
    deployment is scraped there (0: a free port) until ``metrics_linger_s`` after the end.
    ``stop_at_s``: no request is sent after that (see :func:`drive`); ``on_result`` sees
    every result with the time it came, in the engine clock's seconds from the start.
    ``interruptible``: SIGINT / SIGTERM stop the run early, and it reports what it served
    (:mod:`kvplugin.engine.interrupt`; the CLI's runs)."""
    t0 = time.perf_counter()
    probe = LagProbe(cfg.engine.lag_probe_ms / 1000)
    probe.start()
    metrics: MetricsServer | None = None
    try:
        # Signals are handled until the deployment is closed: a second one cancels this
        # task, and the tiers still close (a temp:// directory is removed) on the way out.
        with interrupt.interruptible(interruptible) as intr:
            try:
                async with deployment(cfg, wrap_tiers=wrap_tiers) as dep:
                    tier_warnings = await check_tiers(dep, required=cfg.offload.require_tiers)
                    if metrics_port is not None:
                        from kvplugin.metrics import start_metrics_server

                        metrics = start_metrics_server(dep, port=metrics_port)
                        logger.info("metrics on http://127.0.0.1:%d/metrics", metrics.port)
                    feed = workload_stream(dep, cfg) if specs is None else specs
                    total = len(specs) if specs is not None else cfg.workload.num_requests
                    served = await _served(dep, feed, progress, total, stop_at_s, on_result,
                                           None if intr is None else intr.halt)
                    await dep.mgr.drain()
                    dep.engine.flush_events()  # the last stores' events reach subscribers
                wall = time.perf_counter() - t0
            finally:
                await probe.stop()
        out = report(dep, served, wall, probe)
        if metrics is not None and metrics_linger_s > 0:
            # The final numbers, for a last scrape; said, or the finished run looks hung.
            print(f"kvplugin: run finished; serving metrics on http://127.0.0.1:"
                  f"{metrics.port}/metrics for {metrics_linger_s:g} s more", file=sys.stderr,
                  flush=True)
            await asyncio.sleep(metrics_linger_s)
    finally:
        if metrics is not None:
            metrics.close()
    out.timeline, out.specs = served.timeline.samples, specs or ()
    out.extra["tier_warnings"] = tier_warnings
    out.extra["workload"] = served.kinds
    out.extra["workload_prompt_tokens"] = served.prompt_tokens
    out.extra["loop"] = type(asyncio.get_running_loop()).__module__.split(".")[0]
    out.extra["clock"] = "simulated" if cfg.engine.deterministic else "real"
    out.extra["served_s"] = round(served.span_s, 6)  # on that clock
    if intr is not None and intr.by is not None:
        out.extra["interrupted"] = intr.by.name
    cost = deployment_cost(cfg)
    out.extra["model_cost"] = cfg.engine.model_cost
    if cost is not None:  # what the simulated times stand for
        out.extra["model_cost_deployment"] = cost.description
        if cfg.engine.tier_links:
            out.extra["model_cost_tier_links"] = {
                t: {"gb_per_s": link.gb_per_s, "latency_ms": link.latency_ms}
                for t, link in cfg.engine.tier_links.items()}
        out.extra["link_transfer_s"] = round(dep.engine.stats.transfer_s, 6)
    return out


def workload_specs(dep: Deployment, cfg: RunConfig) -> list[RequestSpec]:
    """The config's workload, with the tenants and prefix groups the config declares."""
    return list(workload_stream(dep, cfg))


def workload_stream(dep: Deployment, cfg: RunConfig) -> Iterator[RequestSpec]:
    """:func:`workload_specs`, generated as it is consumed (a run of any length)."""
    tenants, groups = workload_tenancy(cfg)
    return stream(cfg.workload, max_prompt_len=max_prompt_len(dep, cfg), tenants=tenants,
                  prefix_groups=groups)


async def _served(dep: Deployment, specs: Iterable[RequestSpec], progress: Progress | None,
                  total: int, stop_at_s: float | None = None,
                  on_result: Callable[[Result, float], None] | None = None,
                  halt: asyncio.Event | None = None) -> Served:
    """:func:`drive`, keeping what the report needs (:class:`Served`: no per-request
    result), recording the time series and feeding the progress bar (from a task of its
    own: the engine's step never waits for the terminal)."""
    es, labels, ledger = dep.engine.stats, _labels(dep), dep.mgr.ledger
    clock = dep.engine.clock
    start = clock.now()
    served = Served()

    def finished(res: Result) -> None:
        served.finished(res)
        books = ledger.totals()  # the manager booked the request when the engine finished it
        t = clock.now() - start
        served.timeline.add(Sample(t, res.tenant, res.ttft_s, books.prompt_tokens,
                                   books.computed_tokens,
                                   hit_sources(ledger_sources(books, labels))))
        if on_result is not None:
            on_result(res, t)

    def now() -> tuple[int, str]:
        books = ledger.totals()
        return es.finished, postfix(hit_sources(ledger_sources(books, labels)),
                                    books.prompt_tokens)

    ticker = None
    if progress is not None:
        progress.begin(total)
        ticker = asyncio.get_running_loop().create_task(follow(now, progress),
                                                        name="progress")
    try:
        await drive(dep.engine, specs, on_finish=finished, on_feed=served.fed,
                    keep_results=False, stop_at_s=stop_at_s, halt=halt)
        served.span_s = clock.now() - start
    finally:
        if ticker is not None:
            ticker.cancel()
            await asyncio.wait([ticker])  # not gather: a cancelled serve stays cancelled
        if progress is not None:
            progress.end()
    return served


def _labels(dep: Deployment) -> dict[str, str]:
    """Tier kind (the engine's and the manager's key) -> the report's name for it."""
    return dict(zip(dep.mgr.tiers, dep.tier_labels, strict=True))


def max_prompt_len(dep: Deployment, cfg: RunConfig) -> int:
    """Long enough for the workload, short enough that any request fits the pool and the
    model with its answer (the engine refuses requests that could never run)."""
    pool_tokens = dep.mgr.core.offload_view().num_usable_blocks * cfg.layout.block_size
    pool_tokens //= max(1, len(cfg.layout.groups))
    cap = min(cfg.layout.max_model_len, pool_tokens // 2)
    return max(2, cap - cfg.workload.output_len[1])


def report(dep: Deployment, served: Served, wall: float,
           probe: LagProbe | None = None) -> RunReport:
    """The report of a deployment that has served a workload (``served``: what was kept of
    its requests; count leaks after its manager closed)."""
    es, model = dep.engine.stats, dep.model
    ms = dep.mgr.stats()
    pool = dep.mgr.core.offload_view()
    labels = _labels(dep)
    ttft, steps = served.ttft_ms, es.step_s
    books = dep.mgr.ledger.totals()
    sources = ledger_sources(books, labels)
    out = RunReport(
        requests=es.requests, finished=es.finished, failed=es.failed,
        prompt_tokens=books.prompt_tokens, computed_prompt_tokens=books.computed_tokens,
        hit_tokens=hit_sources(sources), loads=ms.loads,
        load_failures=ms.loads_failed + ms.loads_cancelled,
        stores=ms.stored_chunks, stores_shed=ms.stores_shed,
        kv_mismatches=model.kv_mismatches, cross_tenant_hits=model.cross_tenant_hits,
        leaked_blocks=(pool.num_usable_blocks - pool.num_free_blocks())
        + dep.mgr.num_pending_jobs,
        loop_lag_p99_ms=probe.percentile(99) * 1000 if probe else 0.0, wall_s=wall,
        per_tenant=tenant_rows(dep, served))
    stored, loaded = tier_bytes(dep)
    out.extra.update(
        token_ledger=sources, recomputed_after=dict(books.recomputed_after),
        discarded_tokens=books.discarded_tokens, prefill_work_tokens=es.computed_prompt_tokens,
        tier_errors=tier_errors(dep), corrupt_objects=corrupt_objects(dep),
        tiers=dep.tier_labels, steps=es.steps, preemptions=es.preemptions,
        peak_running_tokens=es.peak_running_tokens,
        admissions=es.admissions, parked=es.parked, lookup_skips=es.lookup_skips,
        lookup_refreshes=es.lookup_refreshes, queried_tokens=ms.queried_tokens,
        lookups=ms.lookups, lookup_timeouts=ms.lookup_timeouts, loaded_chunks=ms.loaded_chunks,
        recomputed_tokens=ms.recomputed_tokens, store_jobs=ms.stores,
        loads_skipped_slower_than_recompute=dict(ms.loads_skipped_slower_than_recompute),
        skipped_load_tokens=ms.skipped_load_tokens, load_probes=ms.load_probes,
        stores_failed=ms.stores_failed, stores_deduplicated=ms.stores_deduplicated,
        store_failures_by_tier=store_failures_by_tier(dep),
        bytes_stored=stored, bytes_loaded=loaded,
        pages_checked=model.pages_checked, states_checked=model.states_checked,
        state_mismatches=model.state_mismatches, loaded_states=ms.loaded_states,
        stored_states=ms.stored_states, partial_tails=ms.partial_tails,
        restored_states=es.restored_states, restored_partial_states=es.restored_partial_states,
        states_dropped=ms.states_dropped, computed_tokens=es.computed_tokens,
        simulated_compute_s=round(model.busy_s, 3),
        ttft_p50_ms=round(ttft.percentile(50), 2), ttft_p99_ms=round(ttft.percentile(99), 2),
        step_ms_p50=round(steps.percentile(50) * 1000, 3),
        step_ms_p99=round(steps.percentile(99) * 1000, 3),
        pool_blocks=pool.num_usable_blocks)
    return out


def _tier_stats(dep: Deployment) -> list[ConnectorStats]:
    conn = dep.connector
    if conn is None:
        return []
    return conn.tier_stats() if isinstance(conn, TieredConnector) else [conn.stats()]


def store_failures_by_tier(dep: Deployment) -> dict[str, int]:
    """Objects each tier did not take (a failed write; another tier may hold them), by the
    report's tier names; every tier listed."""
    out = dict.fromkeys(dep.tier_labels, 0)
    names = _labels(dep)
    for counters in dep.mgr.offloads.tenants().values():
        for tier, n in counters.store_failures_by_tier.items():
            out[names.get(tier, tier)] += n
    return out


def tier_errors(dep: Deployment) -> dict[str, int]:
    """Per tier, the calls that failed (errors and timeouts, as the tier counts them)."""
    out: dict[str, int] = {}
    for label, st in zip(dep.tier_labels, _tier_stats(dep), strict=True):
        out[label] = out.get(label, 0) + st.errors + st.timeouts
    return out


def corrupt_objects(dep: Deployment) -> dict[str, dict[str, int]]:
    """Per tier, the objects it refused on load (and dropped), by reason."""
    return {label: {r: getattr(st, f"corrupt_{r}") for r in REASONS}
            for label, st in zip(dep.tier_labels, _tier_stats(dep), strict=True)}


def tier_bytes(dep: Deployment) -> tuple[dict[str, int], dict[str, int]]:
    """Bytes written to and verified bytes read from each tier, as the tiers count them (a
    tier above another also counts the objects promoted into it)."""
    parts = _tier_stats(dep)
    stored: dict[str, int] = {}
    loaded: dict[str, int] = {}
    for label, st in zip(dep.tier_labels, parts, strict=True):
        stored[label] = stored.get(label, 0) + st.bytes_out
        loaded[label] = loaded.get(label, 0) + st.bytes_in
    return stored, loaded


def tenant_rows(dep: Deployment, served: Served) -> dict[str, TenantRow]:
    """Per tenant: the token ledger of its finished requests (the same books as the
    totals: the rows add up to them), its requests and TTFT, and the tokens its
    prefix-cache queries asked for (one per admission: the per-query hit rate's)."""
    stats = dep.mgr.tenant_stats()
    books = dep.mgr.ledger.per_tenant()
    labels = _labels(dep)
    out = {}
    for tenant, n in sorted(served.tenant_requests.items()):
        ts, lt = stats.get(tenant), books.get(tenant)
        ttft = served.tenant_ttft_ms.get(tenant)
        sources = ledger_sources(lt, labels) if lt is not None else {}
        out[tenant] = TenantRow(n, lt.prompt_tokens if lt is not None else 0,
                                sum(hit_sources(sources).values()),
                                lt.computed_tokens if lt is not None else 0,
                                ts.queried_tokens if ts is not None else 0,
                                round(ttft.percentile(50), 2) if ttft else 0.0, sources)
    return out


def without_offload(cfg: RunConfig) -> RunConfig:
    """The same deployment with offload off: the device cache alone."""
    return cfg.model_copy(update={"offload": cfg.offload.model_copy(update={"enabled": False})})


async def serve_compare(cfg: RunConfig, *, progress: ProgressFor | None = None,
                        metrics_port: int | None = None, metrics_linger_s: float = 0.0,
                        interruptible: bool = False) -> tuple[RunReport, RunReport | None]:
    """The workload with offload as configured, then the very same requests (same specs)
    with offload off (None: the first run was interrupted). The metrics endpoint, if any,
    serves the first run."""
    bar = progress or (lambda _label: None)
    on = await serve(cfg, progress=bar("offload on"), metrics_port=metrics_port,
                     metrics_linger_s=metrics_linger_s, interruptible=interruptible)
    if "interrupted" in on.extra:
        return on, None
    off = await serve(without_offload(cfg), specs=on.specs or None, progress=bar("offload off"),
                      interruptible=interruptible)
    return on, off


def _use_uvloop(cfg: RunConfig) -> bool:
    return cfg.engine.uvloop and uvloop_available()


def run_engine(cfg: RunConfig, *, wrap_tiers: TierWrapper | None = None,
               progress: Progress | None = None, metrics_port: int | None = None,
               metrics_linger_s: float = 0.0, interruptible: bool = False) -> RunReport:
    """:func:`serve` on a fresh event loop (uvloop when configured and installed)."""
    return run(serve(cfg, wrap_tiers=wrap_tiers, progress=progress, metrics_port=metrics_port,
                     metrics_linger_s=metrics_linger_s, interruptible=interruptible),
               use_uvloop=_use_uvloop(cfg))


def run_compare(cfg: RunConfig, *, progress: ProgressFor | None = None,
                metrics_port: int | None = None, metrics_linger_s: float = 0.0,
                interruptible: bool = False) -> tuple[RunReport, RunReport | None]:
    """:func:`serve_compare` on a fresh event loop."""
    return run(serve_compare(cfg, progress=progress, metrics_port=metrics_port,
                             metrics_linger_s=metrics_linger_s, interruptible=interruptible),
               use_uvloop=_use_uvloop(cfg))
