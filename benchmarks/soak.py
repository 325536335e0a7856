"""Fault soak of the reference engine: thousands of requests over several tenants on a
memory → disk → Redis stack with injected connector faults (the config's ``faults``
section), and the Redis server killed and restarted mid-run.

Figures: requests finished and failed, KV mismatches and cross-tenant hits (the fake
model checks every device hit and every loaded block against recomputation), leaked
blocks (not back in the pool once the manager drained, plus jobs still pending), hit
tokens per tier, loads, stores, faults injected, what Redis stored after its restart,
loop lag p99, wall time; and process RSS (``VmRSS``, after a ``gc.collect()``) when the
1,000th and the last request finished: a finished request must leave nothing behind but
counters, so the second must be within 10 % of the first. The driver keeps no per-request
data either: a prompt is kept only until the follow-ups and resends that need it have
been built, and results are counted, not kept.

    python3 benchmarks/soak.py                  # 10,000 requests; last line: JSON
    python3 benchmarks/soak.py --requests 3000 --fault-rate 0.2 --seed 3

It starts its own ``redis-server`` on a free loopback port (no persistence, in a temp dir)
and needs ``redis-server`` on ``PATH``. ``tests/soak/test_soak.py`` runs the same harness,
shorter, with assertions.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import logging
import tempfile
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvplugin.aio.loop import run, uvloop_available
from kvplugin.config import validate
from kvplugin.connectors.base import Connector
from kvplugin.connectors.faults import LocalRedisServer
from kvplugin.engine.build import Deployment, deployment
from kvplugin.engine.config import RunConfig
from kvplugin.engine.loop import LagProbe
from kvplugin.engine.scheduler import Engine, Result
from kvplugin.engine.workload import Finished, RequestSpec, build_prompt, generate

RSS_MARK = 1000  # RSS is read when this many requests have finished, and at the end
# Requests in flight at most (a fixed population of users): arrivals faster than the engine
# under faults would otherwise pile up waiting clients for the whole run, and RSS would
# measure the backlog's high-water mark instead of what finished requests leave behind.
MAX_IN_FLIGHT = 64


def soak_config(*, requests: int, seed: int, redis_url: str, fault_rate: float = 0.1,
                tenants: int = 4, requests_per_s: float = 400.0) -> RunConfig:
    """Short requests on a small pool (evicted prefixes come back from the tiers), tiers
    small enough to evict (every one of them serves hits), no simulated model time."""
    return validate({
        "layout": {"block_size": 4, "num_blocks": 96, "max_model_len": 2048},
        "model": {"num_layers": 2, "num_kv_heads": 1, "head_size": 8},
        "offload": {"chunk_size": 4, "max_local_cpu_size": 0.0015, "local_disk": "temp://",
                    "max_local_disk_size": 0.004, "remote_url": redis_url},
        # Real time: the soak is after the interleavings real I/O timing produces.
        "engine": {"prefill_token_ms": 0.0, "decode_step_ms": 0.0, "deterministic": False},
        "limits": {"max_num_batched_tokens": 128, "max_num_seqs": 16},
        "workload": {"num_requests": requests, "seed": seed, "num_tenants": tenants,
                     "requests_per_s": requests_per_s, "system_prompt_len": [8, 48],
                     "user_len": [4, 24], "output_len": [1, 4], "document_len": [16, 64],
                     "think_time_ms": [0, 2]},
        # latency up to 80 ms: past the 50 ms lookup deadline now and then (a timeout).
        "faults": {"rate": fault_rate, "seed": seed, "latency_ms": 80.0},
    }, "soak", schema=RunConfig)


def rss_kb() -> int:
    """This process's resident set, from /proc/self/status."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    raise RuntimeError("no VmRSS in /proc/self/status")


# ----------------------------------------------------------------------------- the outage


@dataclass(slots=True)
class Outage:
    """Kill the Redis server when ``kill_at`` requests have finished and start it again
    (same port, empty: no persistence) when ``restart_at`` have. Both run on a thread:
    ``LocalRedisServer`` waits synchronously for the process."""

    server: LocalRedisServer
    kill_at: int
    restart_at: int
    killed_s: float | None = None
    restarted_s: float | None = None
    redis_stored_at_restart: int = 0

    async def kill(self, t0: float) -> None:
        await asyncio.to_thread(self.server.kill)
        self.killed_s = time.perf_counter() - t0

    async def restart(self, t0: float, stored_so_far: int) -> None:
        await asyncio.to_thread(self.server.start)
        self.restarted_s = time.perf_counter() - t0
        self.redis_stored_at_restart = stored_so_far


# ----------------------------------------------------------------------------- the driver


@dataclass(slots=True)
class Milestones:
    """Callbacks due when the ``n``-th request has finished, run as tasks (awaited at the
    end of the run, so a failure in one is not lost)."""

    due: list[tuple[int, Callable[[], Awaitable[None]]]] = field(default_factory=list)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def add(self, n: int, fn: Callable[[], Awaitable[None]]) -> None:
        self.due.append((n, fn))
        self.due.sort(key=lambda d: d[0])

    def reached(self, finished: int) -> None:
        while self.due and self.due[0][0] <= finished:
            _, fn = self.due.pop(0)
            self.tasks.append(asyncio.get_running_loop().create_task(_run(fn)))


async def _run(fn: Callable[[], Awaitable[None]]) -> None:
    await fn()


@dataclass(slots=True)
class Tally:
    """What the driver keeps of finished requests: counters."""

    finished: int = 0
    failed: int = 0
    statuses: Counter[str] = field(default_factory=Counter)


async def drive(engine: Engine, specs: Sequence[RequestSpec], marks: Milestones,
                max_in_flight: int = MAX_IN_FLIGHT) -> Tally:
    """Serve ``specs`` in real time, like ``kvplugin.engine.run.drive``, keeping no
    per-request data once nobody needs it: a client starts at its arrival time once fewer
    than ``max_in_flight`` are in flight (a child's parent started before it, so holds a
    slot of its own), and a finished request's prompt is kept only until its last child
    has built its own."""
    slots = asyncio.Semaphore(max_in_flight)
    loop = asyncio.get_running_loop()
    start = loop.time()
    children = Counter(s.after for s in specs if s.after is not None)
    done: dict[str, Finished] = {}
    ended = {rid: asyncio.Event() for rid in children}
    tally = Tally()

    async def client(spec: RequestSpec) -> None:
        try:
            await serve(spec)
        finally:
            slots.release()

    async def serve(spec: RequestSpec) -> None:
        if spec.after is not None:
            await ended[spec.after].wait()
            await asyncio.sleep(spec.think_s)
        prompt = build_prompt(spec, done)
        _forget_parent(spec, children, done, ended)
        res = await engine.generate(spec.request_id, prompt, tenant=spec.tenant,
                                    max_tokens=spec.max_tokens, cache_salt=spec.cache_salt,
                                    lora=spec.lora)
        _count(tally, res)
        marks.reached(tally.finished)
        if spec.request_id in children:
            done[spec.request_id] = Finished(res.prompt, res.output)
            ended[spec.request_id].set()

    async def clients() -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for s in specs:
                    await asyncio.sleep(max(0.0, start + s.at_s - loop.time()))
                    await slots.acquire()
                    tg.create_task(client(s), name=f"client-{s.request_id}")
        finally:
            engine.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(engine.run(), name="engine")
        tg.create_task(clients(), name="clients")
    return tally


def _forget_parent(spec: RequestSpec, children: Counter[str], done: dict[str, Finished],
                   ended: dict[str, asyncio.Event]) -> None:
    if spec.after is None:
        return
    children[spec.after] -= 1
    if not children[spec.after]:
        del children[spec.after], done[spec.after], ended[spec.after]


def _count(tally: Tally, res: Result) -> None:
    tally.finished += 1
    tally.statuses[res.status.name] += 1
    if res.status.name == "FINISHED_ERROR":
        tally.failed += 1


# ----------------------------------------------------------------------------- one run


@dataclass(slots=True)
class SoakReport:
    requests: int = 0
    finished: int = 0
    failed: int = 0
    kv_mismatches: int = 0
    cross_tenant_hits: int = 0
    leaked_blocks: int = 0
    held_blocks: int = 0
    store_bytes_in_flight: int = 0
    pages_checked: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)
    loads: int = 0
    load_failures: int = 0
    stored_chunks: int = 0
    stores_failed: int = 0
    lookup_timeouts: int = 0
    faults_injected: dict[str, int] = field(default_factory=dict)
    redis_killed_s: float | None = None
    redis_restarted_s: float | None = None
    redis_stored_after_restart: int = 0
    redis_hit_objects: int = 0
    loop_lag_p99_ms: float = 0.0
    wall_s: float = 0.0
    rss_kb: dict[int, int] = field(default_factory=dict)  # finished requests -> VmRSS

    @property
    def rss_ratio(self) -> float | None:
        if len(self.rss_kb) < 2:
            return None
        first, last = min(self.rss_kb), max(self.rss_kb)
        return self.rss_kb[last] / self.rss_kb[first]

    def as_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["rss_kb"] = {str(k): v for k, v in self.rss_kb.items()}
        out["rss_ratio"] = None if self.rss_ratio is None else round(self.rss_ratio, 4)
        out["loop_lag_p99_ms"] = round(self.loop_lag_p99_ms, 3)
        out["wall_s"] = round(self.wall_s, 3)
        return out


def max_prompt_len(cfg: RunConfig) -> int:
    """Prompts that fit the pool twice over with their answers (as ``kvplugin run``)."""
    pool_tokens = (cfg.layout.num_blocks - 1) * cfg.layout.block_size // len(cfg.layout.groups)
    return min(cfg.layout.max_model_len, pool_tokens // 2) - cfg.workload.output_len[1]


async def soak(cfg: RunConfig, outage: Outage | None = None, *,
               rss_mark: int | None = None) -> SoakReport:
    """Serve the config's workload on its deployment, with the outage and RSS readings at
    their milestones; then drain the manager and count what is left."""
    remote: list[Connector] = []

    def watch(tier: Connector) -> Connector:
        if tier.capabilities.tier == "redis":
            remote.append(tier)
        return tier

    specs = generate(cfg.workload, max_prompt_len=max_prompt_len(cfg))
    report = SoakReport(requests=len(specs))
    marks = Milestones()
    t0 = time.perf_counter()
    probe = LagProbe(cfg.engine.lag_probe_ms / 1000)
    probe.start()
    try:
        async with deployment(cfg, wrap_tiers=watch) as dep:
            _plan(marks, report, outage, remote, t0, rss_mark, len(specs))
            tally = await drive(dep.engine, specs, marks)
            await asyncio.gather(*marks.tasks)
            await dep.mgr.drain()
            _figures(report, dep, tally, remote)
    finally:
        await probe.stop()
    report.wall_s = time.perf_counter() - t0
    report.loop_lag_p99_ms = probe.percentile(99) * 1000
    if outage is not None:
        report.redis_killed_s, report.redis_restarted_s = outage.killed_s, outage.restarted_s
        stored = report.redis_stored_after_restart
        report.redis_stored_after_restart = stored - outage.redis_stored_at_restart
    return report


def _plan(marks: Milestones, report: SoakReport, outage: Outage | None,
          remote: list[Connector], t0: float, rss_mark: int | None, total: int) -> None:
    if outage is not None:
        marks.add(outage.kill_at, lambda: outage.kill(t0))
        marks.add(outage.restart_at, lambda: outage.restart(
            t0, sum(r.stats().stored for r in remote)))
    if rss_mark is not None:
        for n in (rss_mark, total):
            marks.add(n, _rss_reader(report, n))


def _rss_reader(report: SoakReport, n: int) -> Callable[[], Awaitable[None]]:
    async def read() -> None:
        gc.collect()  # garbage not yet collected is not a leak
        report.rss_kb[n] = rss_kb()

    return read


def _figures(report: SoakReport, dep: Deployment, tally: Tally,
             remote: list[Connector]) -> None:
    es, ms, model = dep.engine.stats, dep.mgr.stats(), dep.model
    pool = dep.mgr.core.block_pool
    report.finished, report.failed = tally.finished, tally.failed
    report.kv_mismatches, report.cross_tenant_hits = model.kv_mismatches, model.cross_tenant_hits
    report.pages_checked = model.pages_checked
    report.leaked_blocks = (pool.num_gpu_blocks - 1 - pool.get_num_free_blocks()
                            + dep.mgr.num_pending_jobs)
    report.held_blocks = dep.mgr.num_held_blocks
    report.store_bytes_in_flight = dep.mgr.store_bytes_in_flight
    report.hit_tokens = {"device": es.device_hit_tokens}
    for tier, label in zip(dep.mgr.tiers, dep.tier_labels, strict=True):
        report.hit_tokens[label] = es.tier_hit_tokens.get(tier, 0)
    report.loads, report.load_failures = ms.loads, ms.loads_failed + ms.loads_cancelled
    report.stored_chunks, report.stores_failed = ms.stored_chunks, ms.stores_failed
    report.lookup_timeouts = ms.lookup_timeouts
    report.faults_injected = dep.faults_injected()
    report.redis_stored_after_restart = sum(r.stats().stored for r in remote)
    report.redis_hit_objects = sum(r.stats().hits for r in remote)


# ----------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=10_000)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--fault-rate", type=float, default=0.1)
    ap.add_argument("--requests-per-s", type=float, default=400.0)
    ap.add_argument("--uvloop", action="store_true", help="run on uvloop (default: asyncio)")
    args = ap.parse_args(argv)
    # Every corrupt object the faults plant is logged when caught: thousands of lines.
    logging.basicConfig(level=logging.ERROR)
    if args.requests < 2 * RSS_MARK:
        ap.error(f"--requests must be at least {2 * RSS_MARK}")
    with tempfile.TemporaryDirectory(prefix="kvplugin-soak-") as tmp, \
            LocalRedisServer(tmp) as server:
        cfg = soak_config(requests=args.requests, seed=args.seed, redis_url=server.url,
                          fault_rate=args.fault_rate, requests_per_s=args.requests_per_s)
        n = args.requests
        outage = Outage(server, kill_at=n * 4 // 10, restart_at=n * 5 // 10)
        report = run(soak(cfg, outage, rss_mark=RSS_MARK),
                     use_uvloop=args.uvloop and uvloop_available())
    _print(report)
    return 0 if _ok(report) else 1


def _ok(r: SoakReport) -> bool:
    ratio = r.rss_ratio
    return (r.finished == r.requests and not r.failed and not r.kv_mismatches
            and not r.cross_tenant_hits and not r.leaked_blocks
            and ratio is not None and abs(ratio - 1) <= 0.10)


def _print(r: SoakReport) -> None:
    d = r.as_dict()
    with contextlib.suppress(BrokenPipeError):
        for k, v in d.items():
            print(f"{k:28} {v}")
        print(f"{'ok':28} {_ok(r)}")
        print(json.dumps({**d, "ok": _ok(r)}))


if __name__ == "__main__":
    raise SystemExit(main())
