"""Prometheus metrics (kvplugin.metrics): the values equal the manager's counters exactly, the
labels are the run report's, the histograms count every job, scrapes from another thread
read the manager on its loop, and ``kvplugin run --metrics-port`` serves every name."""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import BOUNDS, Histogram, OffloadConfig
from kvplugin.config import validate
from kvplugin.engine.build import Deployment, deployment
from kvplugin.engine.config import RunConfig
from kvplugin.layouts import build_core
from kvplugin.metrics import (
    METRIC_NAMES,
    METRICS,
    build_registry,
    start_metrics_server,
)
from kvplugin.plugin import load_plugin

REPO = Path(__file__).resolve().parent.parent
# A pool of 39 blocks of 4 tokens, a memory tier of ~50 objects in front of a disk tier, and
# a few corrupted writes: later waves hit the device, memory and disk, and some loads fail.
DOC: dict[str, Any] = {
    "layout": {"block_size": 4, "num_blocks": 40, "max_model_len": 512},
    "model": {"num_layers": 2, "num_kv_heads": 1, "head_size": 8},
    # A lookup timeout no loaded machine reaches: a timed-out lookup (50 ms by default) is a
    # miss, and on a busy CI machine that changed which objects were loaded (once no
    # corrupt one was).
    "offload": {"chunk_size": 4, "max_local_cpu_size": 0.00007, "local_disk": "temp://",
                "lookup_timeout_ms": 10000.0},
    "engine": {"prefill_token_ms": 0.0, "decode_step_ms": 0.0},
    "limits": {"max_num_batched_tokens": 64, "max_num_seqs": 8},
    "faults": {"rate": 0.05, "kinds": ["corrupt"], "seed": 3},
}
TENANTS = ("t0", "t1", "t2")
WAVE = [(t, [*range(1000 * (i + 1), 1000 * (i + 1) + 16), *range(100 * j, 100 * j + 20)])
        for i, t in enumerate(TENANTS) for j in range(3)]  # 9 prompts of 36 tokens

Values = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def config() -> RunConfig:
    return validate(DOC, "test", schema=RunConfig)


async def serve_waves(dep: Deployment, waves: int = 3,
                      between: Callable[[], Any] | None = None) -> None:
    """Serve ``WAVE`` ``waves`` times, draining the stores after each (the next wave's
    lookups then find them); ``between`` is awaited after the first wave."""
    engine = dep.engine
    for w in range(waves):
        runner = asyncio.get_running_loop().create_task(engine.run())
        try:
            futs = [engine.add_request(f"w{w}-{k}", p, tenant=t, max_tokens=4)
                    for k, (t, p) in enumerate(WAVE)]
            await asyncio.wait_for(asyncio.gather(*futs), 30)
        finally:
            engine.stop()
            await asyncio.wait_for(runner, 30)
        await dep.mgr.drain()
        if w == 0 and between is not None:
            await between()


def parse(text: str) -> Values:
    out: Values = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(values: Values, name: str, **labels: str) -> float:
    return values[(name, tuple(sorted(labels.items())))]


def by_label(values: Values, name: str, label: str) -> dict[str, float]:
    """``name``'s samples summed per value of ``label``."""
    out: dict[str, float] = {}
    for (n, labels), v in values.items():
        if n == name:
            key = dict(labels)[label]
            out[key] = out.get(key, 0) + v
    return out


def scrape(url: str) -> str:
    with urllib.request.urlopen(url, timeout=10) as resp:
        body: bytes = resp.read()
    return body.decode()


def _dead_redis_url() -> str:
    with socket.socket() as sock:  # a loopback port nothing listens on once closed
        sock.bind(("127.0.0.1", 0))
        return f"redis://127.0.0.1:{sock.getsockname()[1]}/0"


@pytest.mark.asyncio
async def test_a_tier_whose_writes_fail_is_charged_no_stored_bytes() -> None:
    doc = {**DOC, "offload": {"chunk_size": 4, "max_local_cpu_size": 0.01,
                              "local_disk": None, "remote_url": _dead_redis_url(),
                              "store_timeout_ms": 200,
                              "lookup_timeout_ms": 50},
           "faults": {"rate": 0.0}}
    async with deployment(validate(doc, "test", schema=RunConfig)) as dep:
        await serve_waves(dep, waves=2)
        v = parse(generate_latest(build_registry(dep)).decode())
        s = dep.mgr.stats()
        assert dep.tier_labels == ["memory", "redis"] and s.stored_bytes > 0
        # Every put reached memory and failed at Redis: only memory is charged.
        assert by_label(v, "kvplugin_stored_bytes_total", "tier") == {
            "memory": s.stored_bytes, "redis": 0}
        assert value(v, "kvplugin_tier_errors_total", tier="redis") > 0
        for st in dep.mgr.tenant_stats().values():
            assert st.stored_bytes_by_tier["redis"] == 0


# --------------------------------------------------------------------------- histograms


def test_histogram_buckets_are_upper_bounds_inclusive() -> None:
    h = Histogram()
    for v in (0.0, 0.0005, 0.00051, 0.01, 10.0, 10.5):
        h.observe(v)
    assert h.count == 6 and h.sum == pytest.approx(20.51101)
    cum = dict(h.cumulative())
    assert cum[0.0005] == 2  # 0 and the bound itself
    assert cum[0.001] == 3 and cum[0.01] == 4 and cum[5.0] == 4
    assert cum[10.0] == 5 and cum[float("inf")] == 6
    assert list(cum) == [*BOUNDS, float("inf")]
    both = h + h.copy()
    assert both.count == 12 and both.counts == [2 * n for n in h.counts]
    with pytest.raises(ValueError, match="strictly increasing"):
        Histogram((0.1, 0.1))
    with pytest.raises(ValueError, match="counts for"):
        Histogram((0.1, 0.2), [0, 0])
    with pytest.raises(ValueError, match="different bounds"):
        h + Histogram((0.1,))


# --------------------------------------------------------------------------- exact values


@pytest.mark.asyncio
async def test_registry_equals_the_managers_counters() -> None:
    async with deployment(config()) as dep:
        await serve_waves(dep)
        mgr = dep.mgr
        v = parse(generate_latest(build_registry(dep)).decode())
        s, ts, tiers = mgr.stats(), mgr.tenant_stats(), mgr.tier_stats()
        assert dep.tier_labels == ["memory", "disk"] and mgr.tiers == ("memory", "disk")
        label = dict(zip(mgr.tiers, dep.tier_labels, strict=True))
        # The scenario exercises what is checked: device and both tiers hit, loads ran.
        assert s.local_hit_tokens > 0 and s.loads > 0
        assert s.hit_tokens_by_tier.get("memory", 0) > 0 and s.hit_tokens_by_tier.get("disk", 0) > 0

        for name, attr in (("kvplugin_tier_lookups_total", "lookups"),
                           ("kvplugin_lookup_timeouts_total", "lookup_timeouts"),
                           ("kvplugin_loads_total", "loads"),
                           ("kvplugin_load_failures_total", "loads_failed"),
                           ("kvplugin_loads_cancelled_total", "loads_cancelled"),
                           ("kvplugin_recomputed_tokens_total", "recomputed_tokens"),
                           ("kvplugin_stores_total", "stores"),
                           ("kvplugin_stored_chunks_total", "stored_chunks"),
                           ("kvplugin_stores_shed_total", "stores_shed"),
                           ("kvplugin_stores_failed_total", "stores_failed"),
                           ("kvplugin_stores_deduplicated_total", "stores_deduplicated"),
                           ("kvplugin_store_copies_on_reuse_total", "copies_on_reuse"),
                           ("kvplugin_stored_states_total", "stored_states"),
                           ("kvplugin_loaded_states_total", "loaded_states")):
            assert value(v, name) == getattr(s, attr), name

        assert sorted(ts) == list(TENANTS)
        for t, st in ts.items():
            assert value(v, "kvplugin_lookup_queries_total", tenant=t) == st.queries >= 9
            assert value(v, "kvplugin_queried_tokens_total", tenant=t) == st.queried_tokens
            for tier, n in st.hit_tokens.items():
                assert value(v, "kvplugin_hit_tokens_total", tier=label.get(tier, tier),
                             tenant=t) == n
            for tier, n in st.stored_bytes_by_tier.items():
                assert value(v, "kvplugin_stored_bytes_total", tier=label[tier], tenant=t) == n
            assert value(v, "kvplugin_tenant_blocks_in_use", tenant=t) == st.blocks_in_use
        hits = by_label(v, "kvplugin_hit_tokens_total", "tier")
        assert hits == {"device": s.local_hit_tokens, "memory": s.hit_tokens_by_tier["memory"],
                        "disk": s.hit_tokens_by_tier["disk"]}
        # The run report's sources agree (it labels tiers the same way).
        es = dep.engine.stats
        assert hits == {"device": es.device_hit_tokens,
                        **{label[k]: n for k, n in es.tier_hit_tokens.items()}}
        # One query per admission (a preempted request is admitted, and queries, again).
        assert sum(by_label(v, "kvplugin_lookup_queries_total", "tenant").values()) \
            == s.queries == es.admissions
        assert sum(by_label(v, "kvplugin_queried_tokens_total", "tenant").values()) \
            == s.queried_tokens >= es.prompt_tokens
        assert by_label(v, "kvplugin_stored_bytes_total", "tier") == \
            {"memory": s.stored_bytes, "disk": s.stored_bytes}  # written through
        # The token ledger, per tenant and source; it adds up to the prompt tokens.
        books = mgr.ledger.per_tenant()
        assert sorted(books) == list(TENANTS)
        for t, lt in books.items():
            for src, n in lt.sources.items():
                assert value(v, "kvplugin_prompt_tokens_total", source=label.get(src, src),
                             tenant=t) == n
            assert value(v, "kvplugin_discarded_tokens_total", tenant=t) == lt.discarded_tokens
        assert sum(by_label(v, "kvplugin_prompt_tokens_total", "source").values()) \
            == es.prompt_tokens == mgr.ledger.totals().prompt_tokens
        loaded = by_label(v, "kvplugin_loaded_bytes_total", "tier")
        assert loaded == {label[k]: n for k, n in s.loaded_bytes_by_tier.items()}
        assert sum(loaded.values()) == s.loaded_bytes > 0

        for name, attr in (("kvplugin_corrupt_objects_total", "corrupt_detected"),
                           ("kvplugin_tier_errors_total", "errors"),
                           ("kvplugin_tier_timeouts_total", "timeouts"),
                           ("kvplugin_tier_evictions_total", "evicted")):
            assert by_label(v, name, "tier") == {
                lab: getattr(st, attr) for lab, st in zip(dep.tier_labels, tiers, strict=True)}
        assert sum(t.corrupt_detected for t in tiers) > 0  # the drill did corrupt some

        # Histograms: one observation per job, +Inf == count.
        lat = mgr.latency()
        assert value(v, "kvplugin_lookup_latency_seconds_count") == s.lookups == lat.lookup.count
        assert value(v, "kvplugin_store_latency_seconds_count") == s.stores == lat.store.count
        per_tier = {lab: value(v, "kvplugin_load_latency_seconds_count", tier=lab)
                    for lab in dep.tier_labels}
        assert sum(per_tier.values()) == s.loads == lat.load_total().count
        assert per_tier == {label[k]: h.count for k, h in lat.load.items()}
        assert value(v, "kvplugin_store_latency_seconds_bucket", le="+Inf") == s.stores
        assert value(v, "kvplugin_store_latency_seconds_sum") == lat.store.sum > 0

        pool = mgr.core.block_pool
        assert value(v, "kvplugin_device_blocks", state="free") == pool.get_num_free_blocks()
        assert value(v, "kvplugin_device_blocks", state="free") + \
            value(v, "kvplugin_device_blocks", state="used") == pool.num_gpu_blocks - 1
        assert by_label(v, "kvplugin_inflight_jobs", "kind") == {"load": 0, "store": 0}
        assert value(v, "kvplugin_offload_enabled") == 1
        assert value(v, "kvplugin_metrics_stale_scrapes_total") == 0


@pytest.mark.asyncio
async def test_offload_off_shows_the_device_only() -> None:
    cfg = config()
    core, ctx = build_core(cfg.layout, cfg.model)
    async with AsyncKVManager(core, None, OffloadConfig(model="m"), hash_context=ctx) as mgr:
        a = mgr.new_request("a", list(range(40)), tenant="acme")
        mgr.allocate(a, await mgr.lookup(a))
        mgr.finish(a)
        v = parse(generate_latest(build_registry(mgr)).decode())
    assert value(v, "kvplugin_offload_enabled") == 0
    assert by_label(v, "kvplugin_hit_tokens_total", "tier") == {"device": 0}
    assert value(v, "kvplugin_queried_tokens_total", tenant="acme") == 40
    for name in ("kvplugin_loaded_bytes_total", "kvplugin_corrupt_objects_total",
                 "kvplugin_load_latency_seconds_count"):
        assert not [k for k in v if k[0] == name], name
    assert value(v, "kvplugin_tier_lookups_total") == 0
    assert value(v, "kvplugin_store_latency_seconds_count") == 0


def test_registry_needs_a_manager() -> None:
    with pytest.raises(TypeError, match="Deployment or an AsyncKVManager"):
        build_registry(object())  # type: ignore[arg-type]


@pytest.mark.asyncio
async def test_any_holder_of_a_manager_is_a_source() -> None:
    """An engine's own deployment object needs only a ``manager`` (ManagerSource); the
    reference engine's Deployment has one too, beside its ``mgr``."""

    class Holder:
        def __init__(self, mgr: AsyncKVManager) -> None:
            self.manager = mgr

    async with deployment(config()) as dep:
        assert dep.manager is dep.mgr
        for source in (Holder(dep.mgr), dep):
            v = parse(generate_latest(build_registry(source)).decode())
            assert value(v, "kvplugin_offload_enabled") == 1


@pytest.mark.asyncio
async def test_an_engine_exports_what_load_plugin_gave_it() -> None:
    async with load_plugin(config()) as plugin:
        mgr = plugin.manager
        a = mgr.new_request("a", list(range(40)), tenant="acme")
        mgr.allocate(a, await mgr.lookup(a))
        mgr.finish(a)
        v = parse(generate_latest(build_registry(plugin)).decode())
    assert value(v, "kvplugin_queried_tokens_total", tenant="acme") == 40
    assert value(v, "kvplugin_offload_enabled") == 1
    assert {lab for k in v if k[0] == "kvplugin_corrupt_objects_total"
            for name, lab in k[1] if name == "tier"} == {"memory", "disk"}


def test_metric_table_is_consistent() -> None:
    assert len(set(METRIC_NAMES)) == len(METRIC_NAMES) == len(METRICS)
    for m in METRICS:
        assert m.name.startswith("kvplugin_")
        assert m.kind in ("counter", "gauge", "histogram")
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert m.name.endswith("_seconds") == (m.kind == "histogram"), m.name
    doc = (REPO / "docs" / "metrics.md").read_text()
    for m in METRICS:
        assert f"`{m.name}`" in doc, m.name


# --------------------------------------------------------------------------- threads


def test_http_scrape_during_a_run_reads_the_manager_on_its_loop() -> None:
    mid, release = threading.Event(), threading.Event()
    box: dict[str, Any] = {}

    async def main() -> None:
        async with deployment(config()) as dep:
            box["loop_thread"] = threading.get_ident()
            readers: list[int] = box.setdefault("readers", [])
            inner = dep.mgr.tenant_stats

            def tenant_stats() -> Any:  # records which thread the snapshot runs on
                readers.append(threading.get_ident())
                return inner()

            dep.mgr.tenant_stats = tenant_stats  # type: ignore[method-assign]
            with start_metrics_server(dep, port=0) as server:
                box["server"] = server

                async def pause() -> None:
                    box["mid"] = dep.mgr.stats()
                    mid.set()
                    await asyncio.to_thread(release.wait, 30)

                await serve_waves(dep, between=pause)
                box["final"] = await asyncio.to_thread(scrape, server.url)
                box["stats"] = dep.mgr.stats()

    thread = threading.Thread(target=asyncio.run, args=(main(),), daemon=True)
    thread.start()
    try:
        assert mid.wait(30), "the first wave never ended"
        server = box["server"]
        assert server.port > 0 and server.url == f"http://127.0.0.1:{server.port}/metrics"
        during = scrape(server.url)
    finally:
        release.set()
        thread.join(60)
    assert not thread.is_alive()
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in during, name
    v, m = parse(during), box["mid"]  # the loop was paused after the first wave
    assert sorted(by_label(v, "kvplugin_lookup_queries_total", "tenant")) == list(TENANTS)
    assert sum(by_label(v, "kvplugin_lookup_queries_total", "tenant").values()) == m.queries
    assert value(v, "kvplugin_stored_chunks_total") == m.stored_chunks > 0
    final, s = parse(box["final"]), box["stats"]
    assert value(final, "kvplugin_loads_total") == s.loads > 0
    assert value(final, "kvplugin_stored_chunks_total") == s.stored_chunks > m.stored_chunks
    assert sum(by_label(final, "kvplugin_lookup_queries_total", "tenant").values()) \
        == s.queries >= 27
    # Both scrapes came from other threads and were answered on the loop's thread.
    assert box["readers"] and set(box["readers"]) == {box["loop_thread"]}
    with pytest.raises(urllib.error.URLError):
        scrape(server.url)  # closed with the context


def test_a_blocked_loop_gets_the_previous_snapshot() -> None:
    cfg = config()
    core, ctx = build_core(cfg.layout, cfg.model)
    mgr = AsyncKVManager(core, None, OffloadConfig(model="m"), hash_context=ctx)
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        blocked = build_registry(mgr, loop=loop, timeout=0.2)
        first = build_registry(mgr, loop=loop, timeout=0.2)
        assert value(parse(generate_latest(blocked).decode()),
                     "kvplugin_metrics_stale_scrapes_total") == 0
        gate = threading.Event()
        loop.call_soon_threadsafe(gate.wait, 10)  # the loop is stuck in a callback
        again = parse(generate_latest(blocked).decode())
        assert value(again, "kvplugin_metrics_stale_scrapes_total") == 1
        assert value(again, "kvplugin_device_blocks", state="free") == 39
        with pytest.raises(TimeoutError):  # nothing to fall back on
            generate_latest(first)
        gate.set()
        fresh = parse(generate_latest(blocked).decode())
        assert value(fresh, "kvplugin_metrics_stale_scrapes_total") == 1
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_server_port_checks_and_idempotent_close() -> None:
    cfg = config()
    core, ctx = build_core(cfg.layout, cfg.model)
    mgr = AsyncKVManager(core, None, OffloadConfig(model="m"), hash_context=ctx)
    with pytest.raises(ValueError, match=r"in 0\.\.65535"):
        start_metrics_server(mgr, port=70000)
    server = start_metrics_server(mgr, port=0)
    assert "kvplugin_offload_enabled 0.0" in scrape(server.url)
    server.close()
    server.close()
    with pytest.raises(urllib.error.URLError):
        scrape(server.url)


# --------------------------------------------------------------------------- the CLI


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


@pytest.mark.timeout(180)
def test_kvplugin_run_metrics_port_serves_every_metric() -> None:
    port = _free_port()
    url = f"http://127.0.0.1:{port}/metrics"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvplugin.cli", "run", "--metrics-port", str(port),
         "--requests", "300", "--metrics-linger", "1", "--json"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    text = None
    try:
        deadline = time.monotonic() + 120
        while text is None and proc.poll() is None and time.monotonic() < deadline:
            try:
                text = scrape(url)
            except OSError:  # not listening yet (or a scrape failed): try again
                time.sleep(0.02)
        out, err = proc.communicate(timeout=150)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == 0, err[-3000:]
    assert text is not None, f"nothing answered on {url}; stderr: {err[-3000:]}"
    for name in METRIC_NAMES:
        assert f"# TYPE {name} " in text, name
    assert '"requests": 300' in out.splitlines()[-1]
    # The linger is said: a finished run that keeps serving must not look hung.
    assert (f"kvplugin: run finished; serving metrics on {url} for 1 s more") in err


@pytest.mark.asyncio
async def test_block_residency_reaches_the_histograms_once_per_eviction() -> None:
    cfg = validate({**DOC, "layout": {**DOC["layout"], "metrics_collector_sample_rate": 1.0},
                    "faults": {"rate": 0.0}}, "test", schema=RunConfig)
    async with deployment(cfg) as dep:
        collector = dep.mgr.core.metrics_collector
        assert collector is not None and collector.sample_rate == 1.0
        seen: list[int] = []
        real_drain = collector.drain_events

        def counting_drain() -> Any:
            events = real_drain()
            seen.append(len(events))
            return events

        collector.drain_events = counting_drain  # type: ignore[method-assign]
        await serve_waves(dep)
        first = parse(generate_latest(build_registry(dep)).decode())
        again = parse(generate_latest(build_registry(dep)).decode())
    evictions = sum(seen)
    assert evictions > 0  # a 39-block pool serving 27 requests of 10 blocks reuses blocks
    for name in ("kvplugin_block_lifetime_seconds", "kvplugin_block_idle_seconds"):
        assert value(first, f"{name}_count") == evictions  # one observation per eviction
        assert value(again, f"{name}_count") == evictions  # drained once, counted once
        assert value(first, f"{name}_bucket", le="+Inf") == evictions
    gaps = value(first, "kvplugin_block_reuse_gap_seconds_count")
    assert gaps == value(again, "kvplugin_block_reuse_gap_seconds_count") > 0  # waves hit


@pytest.mark.asyncio
async def test_no_residency_samples_without_a_sample_rate() -> None:
    async with deployment(config()) as dep:
        assert dep.mgr.core.metrics_collector is None and dep.mgr.residency() is None
        v = parse(generate_latest(build_registry(dep)).decode())
    assert not [k for k in v if k[0].startswith("kvplugin_block_")]
