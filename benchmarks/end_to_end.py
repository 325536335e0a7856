"""End to end: TTFT against QPS on LMCache's multi-round QA, the reference engine with KV
offload off and on, the engine's time that of a named GPU deployment.

**The workload** is LMCache's ``benchmarks/multi-round-qa`` arrival rule
(:class:`kvplugin.engine.workload.MultiRoundQA`): ``--users`` users in the system at once,
each sending its next round ``users / qps`` seconds after its previous one was sent and only
once its previous answer is complete (open loop below saturation, closed loop per user above
it); a new user joins every ``(rounds - 1) / qps`` seconds, the rate at which they leave;
conversations pre-seeded at staggered rounds so the run starts in steady state; each round
resends the whole conversation plus a new question; ``--answer-len``-token answers. LMCache's
canonical shape is a 1,000-token shared system prompt, 20,000-token histories, 100-token
answers, 10 rounds; here system prompt and history are scaled by 1/10 (100 and 2,000
tokens) and the users (100) chosen so that the users' conversations are 4x the device pool
and the pool holds twice the running batch up to 14 QPS; nearer memory + disk's saturation
the batch grows to the pool and it preempts (printed per run: ``running``, ``pool``,
``preempt``).

**The time** is ``--model-cost``'s (``kvplugin/costs.py``: Llama-3.1-8B on one H100 SXM
from published figures): a step of the model, and a load's KV bytes (128 KiB per token, the
model's, not the test pages') over the 20 GB/s host link and the tier's own bandwidth (NVMe
6 GB/s; Redis over 25 GbE 2.5 GB/s). What is real: the scheduling, the manager, every store
and load through the tiers (real files, a real ``redis-server``) and every loaded page checked
against recomputation.

Three parts:

* **The sweep** (simulated clock: deterministic, runs as fast as this machine allows): for
  each QPS point, offload off, memory, memory + disk and memory + Redis. TTFT p50 / p90 and
  throughput over the requests sent after a warm-up (``--warmup-gaps`` gaps); the highest
  QPS each sustains with TTFT p90 under ``--slo-s`` (interpolated between the points).
* **A slow tier** (real time, the llama preset's steps slept): a Redis tier fast in the
  deployment's figures (``--slow-redis-gbps``, 100 GbE) but throttled by fault injection
  (every get waits ``--slow-get-delay-ms``), so loading from it is slower than recomputing:
  offload off, cost-aware loading (``offload.cost_aware_loads``, measuring the tier) and
  naive loading (the decision off) in the same run, on the sweep's small test pages. Also
  offload off and memory + disk in real time on that shape with ``--page`` pages: the event
  loop's lag, and a real-time check of the sweep's TTFT ratio.
* **No reuse** (real time): every prompt unique, all at once: offload can only cost.

The last line is JSON; ``--plot FILE.png`` draws TTFT p50 and p90 against QPS.

    python3 benchmarks/end_to_end.py --quick              # < 5 min on 2 cores
    python3 benchmarks/end_to_end.py                      # the full sweep
    python3 benchmarks/end_to_end.py --quick --plot ttft_vs_qps.png

A run with a KV mismatch, a cross-tenant hit, a leaked block, a failed request or a ledger
that does not balance makes the exit status 1.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from kvplugin.aio.loop import run, uvloop_available
from kvplugin.config import validate
from kvplugin.connectors.base import Connector
from kvplugin.connectors.faults import FaultInjector, FaultPlan, LocalRedisServer
from kvplugin.costs import model_cost
from kvplugin.engine.config import RunConfig
from kvplugin.engine.quantiles import Quantiles
from kvplugin.engine.report import RunReport
from kvplugin.engine.run import serve
from kvplugin.engine.scheduler import Result
from kvplugin.engine.workload import (
    MultiRoundQA,
    RequestSpec,
    multi_round_qa,
    no_reuse,
    warm_up_tokens,
)

GB = 1 << 30
DTYPE_BYTES = 2  # float16
SWEEP_CONFIGS = ("off", "memory", "memory+disk", "memory+redis")
PARTS = ("sweep", "slow", "no-reuse")


@dataclass(frozen=True, slots=True)
class Page:
    """The test pages the fake model writes (the deployment's bytes are the cost model's)."""

    layers: int
    kv_heads: int
    head_size: int

    @property
    def token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * DTYPE_BYTES


@dataclass(frozen=True, slots=True)
class Setup:
    """What every run shares."""

    model_cost: str
    block_size: int
    chunk_size: int
    budget: int  # max_num_batched_tokens
    max_seqs: int
    pool_fraction: float  # device pool ÷ the users' conversations
    cpu_fraction: float  # host-memory tier ÷ the users' conversations (in test-page bytes)
    cost_aware: bool
    uvloop: bool
    seed: int


def pool_blocks(setup: Setup, qa: MultiRoundQA) -> int:
    """The device pool: ``pool_fraction`` of the working set, and never less than twice
    the longest request (the engine refuses a request that could never run)."""
    longest = qa.prompt_len(qa.rounds - 1) + qa.answer_len
    want = max(qa.working_set_tokens * setup.pool_fraction, 2 * longest)
    return math.ceil(want / setup.block_size) + 1


def config(setup: Setup, qa: MultiRoundQA, page: Page, tiers: str, *, real_time: bool,
           redis_url: str | None = None, cost_aware: bool | None = None,
           tier_links: dict[str, dict[str, float]] | None = None,
           name: str = "e2e") -> RunConfig:
    """The deployment; ``tiers``: off, memory, memory+disk, memory+redis or redis."""
    ws_bytes = qa.working_set_tokens * page.token_bytes
    parts = set(tiers.split("+"))
    off: dict[str, Any] = {
        "enabled": tiers != "off", "chunk_size": setup.chunk_size,
        "local_cpu": "memory" in parts,
        "max_local_cpu_size": max(setup.cpu_fraction * ws_bytes / GB, 1e-4),
        "local_cpu_reserve": True,
        "local_disk": "temp://" if "disk" in parts else None,
        "max_local_disk_size": 2 * ws_bytes / GB,
        "remote_url": redis_url if "redis" in parts else None,
        "store_budget_mb": 1024.0,
        "cost_aware_loads": setup.cost_aware if cost_aware is None else cost_aware}
    if "redis" in parts and redis_url is None:
        raise ValueError(f"{tiers} needs a Redis")
    if not real_time:
        # A tier call past its deadline is decided by this machine's timing (two sweep
        # processes on two cores): simulated runs give the tiers all the time they need.
        off.update(lookup_timeout_ms=60_000.0, load_timeout_ms=60_000.0,
                   store_timeout_ms=60_000.0)
    longest = qa.prompt_len(qa.rounds - 1) + qa.answer_len
    return validate({
        "layout": {"block_size": setup.block_size, "num_blocks": pool_blocks(setup, qa),
                   "max_model_len": max(8192, longest)},
        "model": {"name": name, "num_layers": page.layers, "num_kv_heads": page.kv_heads,
                  "head_size": page.head_size, "dtype": "float16"},
        "offload": off,
        "engine": {"model_cost": setup.model_cost, "tier_links": tier_links or {},
                   "uvloop": setup.uvloop, "deterministic": not real_time},
        "limits": {"max_num_batched_tokens": setup.budget, "max_num_seqs": setup.max_seqs},
    }, "end_to_end", schema=RunConfig)


# --------------------------------------------------------------------------- one run


@dataclass(slots=True)
class Point:
    """One QA run: a configuration at a QPS."""

    config: str
    qps: float
    sent: int  # requests sent in the measured window
    ttft_p50_ms: float
    ttft_p90_ms: float
    tokens_per_s: float  # prompt + answer tokens of the window's requests ÷ their span
    requests_per_s: float
    prompt_tokens: int  # of the requests finished since the window began
    computed_prompt_tokens: int  # of those, computed (the rest: device and tier hits)
    tier_hit_tokens: int  # whole run, warm-up included
    device_hit_tokens: int
    skipped_loads: int  # claims cut by load-or-recompute (every tier)
    peak_running_tokens: int  # the running batch at its largest (prompt and output tokens)
    pool_tokens: int
    preemptions: int
    loop_lag_p99_ms: float
    wall_s: float
    problems: str  # "" when every check passed


def problems_of(rep: RunReport) -> str:
    bad = {"unfinished": rep.requests - rep.finished, "failed": rep.failed,
           "kv_mismatches": rep.kv_mismatches, "cross_tenant_hits": rep.cross_tenant_hits,
           "leaked_blocks": rep.leaked_blocks}
    # The token ledger must balance: every prompt token once (device, tier, computed).
    ledger = [f"ledger: {e}" for e in rep.ledger_errors()]
    return ", ".join([*(f"{k} {v}" for k, v in bad.items() if v), *ledger])


@dataclass(slots=True)
class Window:
    """The requests sent at or after ``start_s`` (engine-clock seconds from the start)."""

    start_s: float
    ttft_ms: Quantiles = field(default_factory=Quantiles)
    sent: int = 0
    tokens: int = 0
    first_s: float = math.inf
    last_s: float = 0.0

    def add(self, res: Result, t: float) -> None:
        sent_at = t - res.latency_s
        if sent_at < self.start_s:
            return
        tokens = len(res.prompt) + len(res.output)
        self.sent += 1
        self.tokens += tokens
        self.first_s, self.last_s = min(self.first_s, sent_at), max(self.last_s, t)
        if res.ttft_s is not None:
            self.ttft_ms.add(res.ttft_s * 1000)

    def span_s(self) -> float:
        return max(self.last_s - min(self.first_s, self.last_s), 1e-9)


@dataclass(frozen=True, slots=True)
class QARun:
    """A shape's specs: the warm-up first (``warm_s``, 0 without), then the users."""

    qa: MultiRoundQA
    specs: Sequence[RequestSpec]
    warm_s: float
    measure_from_s: float  # requests sent before are not measured


def qa_run(a: argparse.Namespace, qa: MultiRoundQA) -> QARun:
    warm_s = 0.0
    if not a.no_warm:
        # The warm-up's prefill alone, with room: it is batched, so it takes about this.
        tokens = warm_up_tokens(qa)
        warm_s = 1.5 * model_cost(a.model_cost).prefill_s(sum(tokens)) + 1.0
    specs = multi_round_qa(qa, warm_s=None if a.no_warm else warm_s)
    return QARun(qa, specs, warm_s, warm_s + a.warmup_gaps * qa.gap_s)


def serve_qa(cfg: RunConfig, label: str, qr: QARun, *,
             wrap: Callable[[Connector], Connector] | None = None) -> Point:
    qa = qr.qa
    window = Window(qr.measure_from_s)
    t0 = time.perf_counter()
    rep = run(serve(cfg, specs=qr.specs, stop_at_s=qr.warm_s + qa.duration_s,
                    on_result=window.add,
                    wrap_tiers=wrap), use_uvloop=cfg.engine.uvloop and uvloop_available())
    wall = time.perf_counter() - t0
    hits, x = rep.hit_tokens, rep.extra
    # The books when the window began: the last finish before it (the timeline's samples
    # are cumulative).
    before = [smp for smp in rep.timeline or () if smp.t_s < qr.measure_from_s]
    prompt0 = before[-1].prompt_tokens if before else 0
    computed0 = before[-1].computed_prompt_tokens if before else 0
    return Point(label, qa.qps, window.sent, window.ttft_ms.percentile(50),
                 window.ttft_ms.percentile(90), window.tokens / window.span_s(),
                 window.sent / window.span_s(), rep.prompt_tokens - prompt0,
                 rep.computed_prompt_tokens - computed0,
                 sum(v for k, v in hits.items() if k != "device"), hits.get("device", 0),
                 sum((x.get("loads_skipped_slower_than_recompute") or {}).values()),
                 int(x.get("peak_running_tokens", 0)),
                 (cfg.layout.num_blocks - 1) * cfg.layout.block_size,
                 int(x.get("preemptions", 0)), rep.loop_lag_p99_ms, wall, problems_of(rep))


# --------------------------------------------------------------------------- the figures


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def sustainable_qps(points: Sequence[tuple[float, float]], slo_ms: float
                    ) -> tuple[float, str]:
    """The highest QPS whose TTFT p90 is under ``slo_ms``, from ``(qps, p90)`` points:
    linear between the last point under and the first over; ("within", "at least" when
    every point is under, "below" when none is: the lowest point, an upper bound)."""
    pts = sorted(points)
    if not pts:
        raise ValueError("no points")
    if pts[0][1] > slo_ms:
        return pts[0][0], "below"
    for (qa_, pa), (qb, pb) in itertools.pairwise(pts):
        if pb > slo_ms:
            return qa_ + (slo_ms - pa) * (qb - qa_) / (pb - pa), "within"
    return pts[-1][0], "at least"


def sweep_figures(points: Sequence[Point], slo_ms: float) -> dict[str, Any]:
    by: dict[str, list[Point]] = {}
    for p in points:
        by.setdefault(p.config, []).append(p)
    sustain = {c: sustainable_qps([(p.qps, p.ttft_p90_ms) for p in ps], slo_ms)
               for c, ps in by.items()}
    low = {c: min(ps, key=lambda p: p.qps) for c, ps in by.items()}
    off, on = low.get("off"), low.get("memory+disk")
    out: dict[str, Any] = {
        "sustainable_qps": {c: round(q, 3) for c, (q, _) in sustain.items()},
        "sustainable_qps_bound": {c: how for c, (_, how) in sustain.items()},
        "sweep": {c: [{"qps": p.qps, "ttft_p50_ms": round(p.ttft_p50_ms, 2),
                       "ttft_p90_ms": round(p.ttft_p90_ms, 2),
                       "tokens_per_s": round(p.tokens_per_s, 1),
                       "requests_per_s": round(p.requests_per_s, 3), "sent": p.sent,
                       "recompute_share": round(_ratio(p.computed_prompt_tokens,
                                                       p.prompt_tokens), 4),
                       "skipped_loads": p.skipped_loads,
                       "peak_running_tokens": p.peak_running_tokens,
                       "preemptions": p.preemptions}
                      for p in sorted(ps, key=lambda p: p.qps)] for c, ps in by.items()},
    }
    if off is not None and on is not None:
        out["lowest_qps"] = off.qps
        out["off_saturated_at_lowest_qps"] = off.ttft_p90_ms > slo_ms
        # Of the requests finished in the window (the warm-up's are the same cold prefill
        # on both sides: they would only pull the ratio towards 1).
        out["recompute_ratio"] = round(_ratio(on.computed_prompt_tokens,
                                              off.computed_prompt_tokens), 4)
        out["ttft_p50_ratio"] = round(_ratio(on.ttft_p50_ms, off.ttft_p50_ms), 4)
        out["sustainable_qps_ratio"] = round(_ratio(sustain["memory+disk"][0],
                                                    sustain["off"][0]), 4)
    return out


TARGETS = {"ttft_p50_ratio": ("<=", 0.33), "sustainable_qps_ratio": (">=", 1.5),
           "no_reuse_throughput_ratio": (">=", 0.97), "loop_lag_p99_ms": ("<=", 5.0),
           "slow_tier_ttft_ratio": ("<=", 1.05)}


def verdicts(figs: dict[str, Any]) -> dict[str, bool | None]:
    out: dict[str, bool | None] = {}
    for k, (op, v) in TARGETS.items():
        x = figs.get(k)
        out[k] = None if x is None or x != x else (x <= v if op == "<=" else x >= v)
    return out


# --------------------------------------------------------------------------- the parts


def qa_shape(a: argparse.Namespace, *, users: int, qps: float, gaps: float) -> MultiRoundQA:
    """The QA shape at ``qps``, running ``gaps`` per-user gaps (about ``gaps * users``
    requests below saturation, whatever the QPS)."""
    return MultiRoundQA(users=users, rounds=a.rounds, qps=qps, duration_s=gaps * users / qps,
                        system_prompt_len=a.system_prompt_len, history_len=a.history_len,
                        question_len=a.question_len, answer_len=a.answer_len,
                        num_tenants=a.tenants, seed=a.seed)


def sweep_config(a: argparse.Namespace, setup: Setup, redis_url: str | None,
                 conf: str) -> list[Point]:
    """One configuration at every QPS point, lowest first, until ``--past-slo`` points
    were over the SLO (simulated clock: a seed's run is the same every time, so one)."""
    page = Page(*a.sweep_page)
    out: list[Point] = []
    over = 0
    for i, qps in enumerate(sorted(a.qps)):
        if over >= a.past_slo:
            break
        qa = qa_shape(a, users=a.users, qps=qps, gaps=a.duration_gaps)
        cfg = config(setup, qa, page, conf, real_time=False, redis_url=redis_url,
                     name=f"sweep-{i}-{conf}")
        out.append(serve_qa(cfg, conf, qa_run(a, qa)))
        over += out[-1].ttft_p90_ms > a.slo_s * 1000
    return out


def sweep(a: argparse.Namespace, setup: Setup, redis_url: str | None,
          log: Callable[[Point], None]) -> list[Point]:
    """Every configuration's sweep, ``--jobs`` at a time in processes of their own: a
    simulated run's figures do not depend on the machine's speed, only its wall time does."""
    confs = [c for c in a.configs if "redis" not in c or redis_url is not None]
    out: list[Point] = []
    if a.jobs <= 1:
        for conf in confs:
            for p in sweep_config(a, setup, redis_url, conf):
                log(p)
                out.append(p)
        return out
    with ProcessPoolExecutor(a.jobs, mp_context=multiprocessing.get_context("fork")) as pool:
        futs = [pool.submit(sweep_config, a, setup, redis_url, c) for c in confs]
        for fut in as_completed(futs):
            for p in fut.result():
                log(p)
                out.append(p)
    return out


def slow_tier(a: argparse.Namespace, setup: Setup, redis_url: str | None, rep: int,
              log: Callable[[Point], None]) -> dict[str, Point]:
    """Real time, one shape: off; a throttled Redis with cost-aware and with naive loads;
    memory + disk (the loop's lag, the real-time TTFT ratio). Order rotates by ``rep``."""
    qa = qa_shape(a, users=a.slow_users, qps=a.slow_qps, gaps=a.slow_gaps)
    qr = qa_run(a, qa)
    links = {"redis": {"gb_per_s": a.slow_redis_gbps, "latency_ms": 0.2}}
    plan = FaultPlan(get_delay=a.slow_get_delay_ms / 1000)

    def throttle(tier: Connector) -> Connector:
        if tier.capabilities.tier != "redis":
            return tier
        return FaultInjector(tier, plan, seed=a.seed, name=f"throttled-{tier.name}")

    big, tiny = Page(*a.page), Page(*a.sweep_page)
    # (label, tiers, cost-aware, tier wrapper, pages). The throttled trio writes the
    # sweep's small pages: the fake model's CPU time for real-size pages exceeds the
    # simulated step on two cores, and that queueing would hide what the tier costs.
    runs: list[tuple[str, str, bool, Callable[[Connector], Connector] | None, Page]] = [
        ("off", "off", True, None, big), ("memory+disk", "memory+disk", True, None, big)]
    if redis_url is not None:
        runs += [("slow:off", "off", True, None, tiny),
                 ("slow:cost-aware", "redis", True, throttle, tiny),
                 ("slow:naive", "redis", False, throttle, tiny)]
    k = rep % len(runs)
    out = {}
    slow_setup = replace(setup, pool_fraction=a.slow_pool_fraction)
    for label, tiers, aware, wrap, page in runs[k:] + runs[:k]:
        cfg = config(slow_setup, qa, page, tiers, real_time=True, redis_url=redis_url,
                     cost_aware=aware, tier_links=links, name=f"slow-{rep}-{label}")
        out[label] = serve_qa(cfg, label, qr, wrap=wrap)
        log(out[label])
    return out


@dataclass(frozen=True, slots=True)
class NoReuse:
    offload: bool
    tokens_per_s: float
    loop_lag_p99_ms: float
    problems: str


def no_reuse_pair(a: argparse.Namespace, setup: Setup, seed: int, on_first: bool
                  ) -> tuple[NoReuse, NoReuse]:
    """Every prompt unique, all at once, real time: (memory + disk, off)."""
    specs = no_reuse(a.no_reuse_requests, prompt_len=a.no_reuse_prompt_len,
                     answer_len=a.no_reuse_answer_len, num_tenants=a.tenants, seed=seed)
    # A shape whose conversations are as many tokens as the requests: tiers and pool
    # sized as for QA.
    qa = MultiRoundQA(users=a.no_reuse_requests, rounds=2, qps=1.0,
                      system_prompt_len=1, history_len=a.no_reuse_prompt_len,
                      question_len=1, answer_len=a.no_reuse_answer_len)
    page = Page(*a.page)
    out = {}
    for offload in ((True, False) if on_first else (False, True)):
        cfg = config(replace(setup, pool_fraction=1.0), qa, page,
                     "memory+disk" if offload else "off", real_time=True)
        rep = run(serve(cfg, specs=specs), use_uvloop=cfg.engine.uvloop and uvloop_available())
        serve_s = max((s.t_s for s in rep.timeline or ()), default=rep.wall_s)
        tokens = rep.prompt_tokens + sum(s.max_tokens for s in specs)
        out[offload] = NoReuse(offload, tokens / serve_s if serve_s else 0.0,
                               rep.loop_lag_p99_ms, problems_of(rep))
    return out[True], out[False]


# --------------------------------------------------------------------------- output


HEADER = (f"{'config':<16} {'qps':>5} {'sent':>5} {'ttft p50':>9} {'ttft p90':>9} "
          f"{'tok/s':>8} {'prompt':>8} {'computed':>8} {'tiers':>8} {'device':>8} "
          f"{'skipped':>7} {'running':>7} {'pool':>7} {'preempt':>7} {'lag p99':>7} "
          f"{'wall s':>6}  checks")


def row(p: Point) -> str:
    return (f"{p.config:<16} {p.qps:>5g} {p.sent:>5} {p.ttft_p50_ms:>9.1f} "
            f"{p.ttft_p90_ms:>9.1f} {p.tokens_per_s:>8.0f} {p.prompt_tokens:>8} "
            f"{p.computed_prompt_tokens:>8} {p.tier_hit_tokens:>8} {p.device_hit_tokens:>8} "
            f"{p.skipped_loads:>7} {p.peak_running_tokens:>7} {p.pool_tokens:>7} "
            f"{p.preemptions:>7} {p.loop_lag_p99_ms:>7.2f} {p.wall_s:>6.1f}  "
            f"{p.problems or 'ok'}")


def table(points: Sequence[Point], configs: Sequence[str]) -> list[str]:
    """TTFT p50 / p90 (ms) and tokens/s per QPS point, one column group per config."""
    by = {(p.config, p.qps): p for p in points}
    cols = [c for c in configs if any(p.config == c for p in points)]
    lines = [f"{'qps':>5}  " + "  ".join(f"{c + ' p50/p90 ms, tok/s':<34}" for c in cols)]
    for q in sorted({p.qps for p in points}):
        cells = []
        for c in cols:
            p = by.get((c, q))
            cells.append(f"{'-':<34}" if p is None else
                         f"{p.ttft_p50_ms:>8.0f} / {p.ttft_p90_ms:>8.0f}, {p.tokens_per_s:>9.0f}"
                         .ljust(34))
        lines.append(f"{q:>5g}  " + "  ".join(cells))
    return lines


def plot(path: str, points: Sequence[Point], title: str, slo_ms: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.8))
    # Lines that coincide (the tiers behind a memory tier that holds every conversation
    # are never read) stay visible: each its own marker and dash.
    style = dict(zip(SWEEP_CONFIGS, ("o-", "s--", "D-.", "^:"), strict=True))
    for conf in SWEEP_CONFIGS:
        ps = sorted((p for p in points if p.config == conf), key=lambda p: p.qps)
        if not ps:
            continue
        axes[0].plot([p.qps for p in ps], [p.ttft_p50_ms / 1000 for p in ps], style[conf],
                     label=conf, markerfacecolor="none")
        axes[1].plot([p.qps for p in ps], [p.ttft_p90_ms / 1000 for p in ps], style[conf],
                     label=conf, markerfacecolor="none")
    axes[1].axhline(slo_ms / 1000, color="gray", linestyle="--", label="SLO")
    for ax, what in zip(axes, ("p50", "p90"), strict=True):
        ax.set_yscale("log")
        ax.set_xlabel("QPS")
        ax.set_ylabel(f"TTFT {what}, s (simulated)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- command line


def _floats(s: str) -> list[float]:
    return [float(x) for x in s.split(",") if x]


def _page(s: str) -> tuple[int, int, int]:
    layers, heads, size = (int(x) for x in s.split(","))
    return layers, heads, size


QUICK: dict[str, Any] = {"qps": "2,6,8,10,14,20,26,32,38", "duration_gaps": 3.0, "slow_gaps": 4.0,
         "repeats": 1, "no_reuse_requests": 12}
FULL: dict[str, Any] = {"qps": "1,2,4,6,8,9,10,12,16,20,24,28,32,36,40", "duration_gaps": 5.0,
        "slow_gaps": 6.0, "repeats": 3, "no_reuse_requests": 24}


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help=f"{QUICK['qps']} QPS, 3 gaps per run, one real-time repeat (< 5 min)")
    p.add_argument("--repeats", type=int, default=None,
                   help="real-time repeats (median); default 3 (1 quick)")
    p.add_argument("--plot", metavar="FILE.png", help="TTFT p50 and p90 against QPS")
    p.add_argument("--slo-s", type=float, default=2.0, help="TTFT p90 SLO, seconds")
    p.add_argument("--jobs", type=int, default=min(2, os.cpu_count() or 1),
                   help="sweep configurations run at once, each in a process (the sweep's "
                        "clock is simulated: this changes its wall time only)")
    p.add_argument("--past-slo", type=int, default=2,
                   help="a configuration's sweep stops after this many points over the SLO")
    p.add_argument("--parts", type=lambda s: s.split(","), default=list(PARTS),
                   help="of " + ",".join(PARTS) + " (all by default)")
    p.add_argument("--naive", action="store_true",
                   help="the sweep without load-or-recompute (every hit loaded)")
    q = p.add_argument_group("multi-round QA (LMCache's benchmarks/multi-round-qa)")
    q.add_argument("--users", type=int, default=100, help="users in the system at once")
    q.add_argument("--rounds", type=int, default=10)
    q.add_argument("--system-prompt-len", type=int, default=100)
    q.add_argument("--history-len", type=int, default=2000)
    q.add_argument("--question-len", type=int, default=20)
    q.add_argument("--answer-len", type=int, default=100)
    q.add_argument("--tenants", type=int, default=1)
    q.add_argument("--qps", type=_floats, default=None, help=f"default {FULL['qps']}")
    q.add_argument("--configs", type=lambda s: s.split(","), default=list(SWEEP_CONFIGS),
                   help="of " + ",".join(SWEEP_CONFIGS))
    q.add_argument("--duration-gaps", type=float, default=None,
                   help="a run lasts this many per-user gaps (users / qps): default 5 "
                        "(3 quick)")
    q.add_argument("--warmup-gaps", type=float, default=1.0,
                   help="requests sent before this many gaps are not measured")
    q.add_argument("--no-warm", action="store_true",
                   help="start the pre-seeded users cold, as LMCache does (default: their "
                        "earlier rounds are served first, so their KV is where the "
                        "deployment would keep it)")
    q.add_argument("--seed", type=int, default=0)
    s = p.add_argument_group("slow tier and real time")
    s.add_argument("--slow-users", type=int, default=24)
    s.add_argument("--slow-qps", type=float, default=6.0)
    s.add_argument("--slow-gaps", type=float, default=None, help="default 6 (4 quick)")
    s.add_argument("--slow-pool-fraction", type=float, default=0.5,
                   help="device pool ÷ the users' conversations (few users: a pool that "
                        "holds twice the batch in flight)")
    s.add_argument("--slow-redis-gbps", type=float, default=10.0,
                   help="the Redis tier's bandwidth in the deployment (100 GbE)")
    s.add_argument("--slow-get-delay-ms", type=float, default=500.0,
                   help="fault injection: every Redis get waits this long")
    n = p.add_argument_group("no reuse (real time)")
    n.add_argument("--no-reuse-requests", type=int, default=None, help="default 24 (12 quick)")
    n.add_argument("--no-reuse-prompt-len", type=int, default=2000)
    n.add_argument("--no-reuse-answer-len", type=int, default=16)
    n.add_argument("--no-reuse-pairs", type=int, default=3, help="on/off pairs per repeat")
    d = p.add_argument_group("deployment")
    d.add_argument("--model-cost", default="llama-3.1-8b-h100")
    d.add_argument("--page", type=_page, default=(2, 4, 128),
                   help="test pages of the real-time runs: layers,kv_heads,head_size")
    d.add_argument("--sweep-page", type=_page, default=(1, 1, 16),
                   help="test pages of the sweep (its bytes' time is the model's anyway)")
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--chunk-size", type=int, default=256, help="tokens per stored object")
    d.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    d.add_argument("--max-seqs", type=int, default=128)
    d.add_argument("--pool-fraction", type=float, default=0.25,
                   help="device pool ÷ the users' conversations")
    d.add_argument("--cpu-fraction", type=float, default=1.0,
                   help="host-memory tier ÷ the users' conversations")
    d.add_argument("--no-uvloop", action="store_true")
    args = p.parse_args(argv)
    for name, default in (QUICK if args.quick else FULL).items():
        if getattr(args, name) is None:
            setattr(args, name, _floats(default) if name == "qps" else default)
    bad = [c for c in args.configs if c not in SWEEP_CONFIGS]
    bad += [p_ for p_ in args.parts if p_ not in PARTS]
    if bad or args.repeats < 1 or args.no_reuse_pairs < 1 or not args.qps:
        p.error(f"bad --configs / --parts {bad}" if bad
                else "--repeats, --no-reuse-pairs >= 1; --qps")
    return args


def _med(values: Sequence[float]) -> float:
    vals = [v for v in values if v == v]
    return round(statistics.median(vals), 4) if vals else float("nan")


def real_time_figures(slow: Sequence[dict[str, Point]],
                      nr: Sequence[tuple[NoReuse, NoReuse]]) -> dict[str, Any]:
    def ratio(label: str, base: str) -> float:
        return _med([_ratio(r[label].ttft_p50_ms, r[base].ttft_p50_ms)
                     for r in slow if label in r])

    return {
        "slow_tier_ttft_ratio": ratio("slow:cost-aware", "slow:off"),
        "naive_slow_tier_ttft_ratio": ratio("slow:naive", "slow:off"),
        "realtime_ttft_p50_ratio": ratio("memory+disk", "off"),
        "loop_lag_p99_ms": _med([r["memory+disk"].loop_lag_p99_ms for r in slow]),
        "loop_lag_p99_ms_offload_off": _med([r["off"].loop_lag_p99_ms for r in slow]),
        "slow_tier_skipped_loads": [r["slow:cost-aware"].skipped_loads for r in slow
                                    if "slow:cost-aware" in r],
        "no_reuse_throughput_ratio": _med([_ratio(on.tokens_per_s, off.tokens_per_s)
                                           for on, off in nr]),
        "loop_lag_p99_ms_no_reuse": _med([on.loop_lag_p99_ms for on, _ in nr]),
    }


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    setup = Setup(a.model_cost, a.block_size, a.chunk_size, a.budget, a.max_seqs,
                  a.pool_fraction, a.cpu_fraction, not a.naive, not a.no_uvloop, a.seed)
    cost = model_cost(a.model_cost)
    t0 = time.perf_counter()
    shape = qa_shape(a, users=a.users, qps=a.qps[0], gaps=a.duration_gaps)
    title = (f"multi-round QA: {a.users} users, {a.rounds} rounds, system {a.system_prompt_len}"
             f" + history {a.history_len} tokens, answers {a.answer_len}; "
             f"{cost.description} (simulated)")
    print(f"{title}\nconversations {shape.working_set_tokens} tokens, device pool "
          f"{pool_blocks(setup, shape) - 1} blocks of {a.block_size}; host memory tier "
          f"{a.cpu_fraction:g}x the conversations; SLO: TTFT p90 <= {a.slo_s:g} s", flush=True)
    print(HEADER, flush=True)

    def log(p: Point) -> None:
        print(row(p), flush=True)

    redis_ok = LocalRedisServer.available()
    if not redis_ok:
        print("redis-server not on PATH: memory+redis and the slow tier are left out")
    with tempfile.TemporaryDirectory(prefix="kvplugin-e2e-") as tmp:
        server = LocalRedisServer(tmp) if redis_ok else None
        if server is not None:
            server.start()
        try:
            url = server.url if server is not None else None
            points = sweep(a, setup, url, log) if "sweep" in a.parts else []
            slow = ([slow_tier(a, setup, url, i, log) for i in range(a.repeats)]
                    if "slow" in a.parts else [])
        finally:
            if server is not None:
                server.kill()
    nr = [no_reuse_pair(a, setup, a.seed + i * a.no_reuse_pairs + j, (i + j) % 2 == 0)
          for i in range(a.repeats) for j in range(a.no_reuse_pairs) if "no-reuse" in a.parts]
    for on, off in nr:
        print(f"no reuse: offload on {on.tokens_per_s:.0f} tok/s (lag p99 "
              f"{on.loop_lag_p99_ms:.2f} ms), off {off.tokens_per_s:.0f} tok/s  "
              f"{on.problems or off.problems or 'ok'}", flush=True)
    figs = {**sweep_figures(points, a.slo_s * 1000), **real_time_figures(slow, nr)}
    ok = verdicts(figs)
    problems = [p.problems for p in points if p.problems] + [
        p.problems for r in slow for p in r.values() if p.problems] + [
        r.problems for pair in nr for r in pair if r.problems]
    print()
    print("\n".join(table(points, a.configs)))
    print()
    for k, (op, v) in TARGETS.items():
        verdict = {True: "met", False: "MISSED", None: "not measured"}[ok[k]]
        print(f"{k:<28} {figs.get(k)!s:>8}   target {op} {v}: {verdict}")
    for k in ("recompute_ratio", "naive_slow_tier_ttft_ratio", "realtime_ttft_p50_ratio",
              "sustainable_qps"):
        print(f"{k:<28} {figs.get(k)}")
    wall = time.perf_counter() - t0
    print(f"checks: {'every run clean' if not problems else '; '.join(problems)}; {wall:.0f} s")
    if a.plot:
        plot(a.plot, points, title, a.slo_s * 1000)
        print(f"plot: {a.plot}")
    out = {**figs, "model_cost": a.model_cost, "model_cost_deployment": cost.description,
           "targets_met": ok, "clean": not problems, "quick": a.quick, "repeats": a.repeats,
           "slo_s": a.slo_s, "naive": a.naive, "shape": asdict(shape) | {"qps": a.qps},
           "setup": asdict(setup), "sweep_token_bytes": Page(*a.sweep_page).token_bytes,
           "token_bytes": Page(*a.page).token_bytes,
           "pool_blocks": pool_blocks(setup, shape) - 1, "wall_s": round(wall, 1)}
    print(json.dumps(out))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
