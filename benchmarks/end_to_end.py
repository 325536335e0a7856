"""End to end: the reference engine with KV offload on and off, on the same workloads.

Two workloads, each served with offload on (a host-memory tier and a disk tier) and off
(``offload.enabled: false``: the device prefix cache alone), in alternating order:

* **multi-round QA**, the shape of LMCache's benchmark: 10 users over 3 tenants, 5 rounds, a
  1,000-token system prompt per tenant, a 2,000-token history per user, 100-token answers;
  each round resends the whole conversation plus a new question, a think time after the
  previous answer, and users run concurrently. The device pool holds about a quarter of the
  working set, so earlier rounds are evicted and come back from the tiers (or, offload off,
  are computed again).
* **no reuse**: every prompt unique, all arriving at once. Offload can only cost here: every
  prompt is stored for nothing.

Figures (each the median over ``--repeats`` runs; the no-reuse ones over every pair,
``--no-reuse-pairs`` per repeat, since one no-reuse run is short enough for the machine's
noise to move a single ratio by several percent):

* ``recompute_ratio``: prefill tokens computed with offload ÷ without (QA). Target <= 0.33.
* ``ttft_p50_ratio``: median time to first token with offload ÷ without (QA).
* ``no_reuse_throughput_ratio``: engine throughput (prompt + answer tokens per second, from
  the start to the last answer) with offload ÷ without (no reuse). Target >= 0.97.
* ``loop_lag_p99_ms``: the event loop's lag p99 during the offload-on QA runs (the median
  of the runs' p99s). Target <= 5.

Simulated model (``--prefill-ms``, ``--decode-ms``): an 8B model on one GPU prefills ~10-20k
tokens/s and takes 20-30 ms per decode step, so 0.06 ms per prefill token and 25 ms per step
that decodes. The time is awaited, as a GPU step would be; the CPU work (scheduling, offload
bookkeeping, stores and loads, and the fake model writing and checking KV, which overlaps
the simulated time as a GPU's work would) is real. KV page: ``--layers`` x ``--kv-heads`` x
``--head-size`` in float16: 16 KiB per token by default (4 x 8 x 128: Llama-3-8B's KV heads,
an eighth of its 32 layers), so stores move real bytes while a run fits this machine.

``--quick`` keeps the workloads' structure (10 users, 5 rounds, the same lengths) and makes
it fit in 3 minutes on 2 cores: 4 KiB per token (2 x 4 x 128), a model 5x as fast with the
same prefill:decode ratio (0.012 ms per token, 5 ms per decode step), think times of 0.1 s
and 12 no-reuse requests. A faster model leaves less simulated time for the same CPU work,
so ``--quick`` is the harder case for the throughput ratio and the loop lag.

    python3 benchmarks/end_to_end.py --quick      # < 3 min on 2 cores; last line: JSON
    python3 benchmarks/end_to_end.py              # the full shape
    python3 benchmarks/end_to_end.py --users 20 --rounds 8 --history-len 4000

Every hit is checked against recomputation (the fake model): a run with a KV mismatch, a
cross-tenant hit, a leaked block or a failed request makes the exit status 1.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

# Run as a script, this file's directory comes first on sys.path and benchmarks/connectors.py
# would shadow the ``connectors`` package.
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]

from kvplugin.config import KVPluginConfig, validate  # noqa: E402
from kvplugin.engine.loop import run, uvloop_available  # noqa: E402
from kvplugin.engine.report import RunReport  # noqa: E402
from kvplugin.engine.run import serve  # noqa: E402
from kvplugin.engine.workload import MultiRoundQA, RequestSpec, multi_round_qa, no_reuse  # noqa: E402

GB = 1 << 30
DTYPE_BYTES = 2  # float16


@dataclass(frozen=True, slots=True)
class Setup:
    """What the runs share: the deployment's shape and the no-reuse workload's."""

    block_size: int
    chunk_size: int
    layers: int
    kv_heads: int
    head_size: int
    prefill_ms: float
    decode_ms: float
    budget: int  # max_num_batched_tokens
    max_seqs: int
    pool_fraction: float  # device pool ÷ the QA working set
    disk: bool
    disk_io_threads: int | None
    store_budget_mb: float
    store_mode: str  # copy | hold
    uvloop: bool
    no_reuse_requests: int
    no_reuse_prompt_len: int
    no_reuse_answer_len: int

    @property
    def token_bytes(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_size * DTYPE_BYTES


def pool_blocks(setup: Setup, qa: MultiRoundQA) -> int:
    """The device pool: ``pool_fraction`` of the QA working set, and never less than twice
    the longest request (the engine refuses a request that could never run)."""
    longest = qa.prompt_len(qa.rounds - 1) + qa.answer_len
    want = max(qa.working_set_tokens * setup.pool_fraction, 2 * longest)
    return math.ceil(want / setup.block_size) + 1


def config(setup: Setup, qa: MultiRoundQA, *, offload: bool) -> KVPluginConfig:
    """The deployment; both tiers hold the whole working set (what they never get back is
    the policy's doing, not a lack of room)."""
    tier_gb = 1.5 * max(qa.working_set_tokens, setup.no_reuse_requests
                        * setup.no_reuse_prompt_len) * setup.token_bytes / GB
    longest = max(qa.prompt_len(qa.rounds - 1) + qa.answer_len,
                  setup.no_reuse_prompt_len + setup.no_reuse_answer_len)
    off: dict[str, Any] = {"enabled": offload, "chunk_size": setup.chunk_size,
                           "local_cpu": True, "max_local_cpu_size": tier_gb,
                           "local_cpu_reserve": True,
                           "local_disk": "temp://" if setup.disk else None,
                           "max_local_disk_size": tier_gb,
                           "store_budget_mb": setup.store_budget_mb,
                           "store_mode": setup.store_mode}
    if setup.disk_io_threads is not None:
        off["disk_io_threads"] = setup.disk_io_threads
    return validate({
        "layout": {"block_size": setup.block_size, "num_blocks": pool_blocks(setup, qa),
                   "max_model_len": max(8192, longest)},
        "model": {"num_layers": setup.layers, "num_kv_heads": setup.kv_heads,
                  "head_size": setup.head_size, "dtype": "float16"},
        "offload": off,
        # Real time: what is measured is the overlap of the tiers' I/O with the steps.
        "engine": {"prefill_token_ms": setup.prefill_ms, "decode_step_ms": setup.decode_ms,
                   "uvloop": setup.uvloop, "deterministic": False},
        "limits": {"max_num_batched_tokens": setup.budget, "max_num_seqs": setup.max_seqs},
    }, "end_to_end")


# --------------------------------------------------------------------------- one run


@dataclass(frozen=True, slots=True)
class Run:
    workload: str
    offload: bool
    requests: int
    finished: int
    prompt_tokens: int
    computed_prompt_tokens: int
    tier_hit_tokens: int
    device_hit_tokens: int
    tokens: int  # prompt + answer tokens served
    serve_s: float  # from the start to the last answer
    ttft_p50_ms: float
    step_ms_p99: float
    loop_lag_p99_ms: float
    stores: int
    stores_shed: int
    loop_cpu_s: float  # CPU time of the loop's thread (the deployment's build included)
    cpu_s: float  # of the whole process: the loop, the disk tier's I/O threads
    problems: str  # "" when every check passed

    @property
    def throughput(self) -> float:
        return self.tokens / self.serve_s if self.serve_s else 0.0


def _problems(rep: RunReport) -> str:
    bad = {"unfinished": rep.requests - rep.finished, "failed": rep.failed,
           "kv_mismatches": rep.kv_mismatches, "cross_tenant_hits": rep.cross_tenant_hits,
           "leaked_blocks": rep.leaked_blocks}
    # The token ledger must balance: every prompt token once (device, tier, computed).
    ledger = [f"ledger: {e}" for e in rep.ledger_errors()]
    return ", ".join([*(f"{k} {v}" for k, v in bad.items() if v), *ledger])


def serve_once(cfg: KVPluginConfig, workload: str, specs: Sequence[RequestSpec]) -> Run:
    cpu, loop_cpu = time.process_time(), time.thread_time()
    rep = run(serve(cfg, specs=specs), use_uvloop=cfg.engine.uvloop and uvloop_available())
    cpu, loop_cpu = time.process_time() - cpu, time.thread_time() - loop_cpu
    timeline = getattr(rep, "timeline", None) or []
    serve_s = max((s.t_s for s in timeline), default=rep.wall_s)
    answers = sum(s.max_tokens for s in specs)
    hits = rep.hit_tokens
    return Run(workload, cfg.offload.enabled, rep.requests, rep.finished, rep.prompt_tokens,
               rep.computed_prompt_tokens, sum(v for k, v in hits.items() if k != "device"),
               hits.get("device", 0), rep.prompt_tokens + answers, serve_s,
               float(rep.extra.get("ttft_p50_ms", 0.0)),
               float(rep.extra.get("step_ms_p99", 0.0)), rep.loop_lag_p99_ms, rep.stores,
               rep.stores_shed, loop_cpu, cpu, _problems(rep))


def pair(setup: Setup, qa: MultiRoundQA, workload: str, specs: Sequence[RequestSpec],
         on_first: bool, log: Callable[[Run], None]) -> tuple[Run, Run]:
    """The same specs with offload on and off (in the order given); (on, off)."""
    out: dict[bool, Run] = {}
    for offload in ((True, False) if on_first else (False, True)):
        out[offload] = serve_once(config(setup, qa, offload=offload), workload, specs)
        log(out[offload])
    return out[True], out[False]


# --------------------------------------------------------------------------- the figures


def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def figures(qa_runs: list[tuple[Run, Run]], nr_runs: list[tuple[Run, Run]]) -> dict[str, float]:
    med = statistics.median
    return {
        "recompute_ratio": round(med(_ratio(on.computed_prompt_tokens,
                                            off.computed_prompt_tokens)
                                     for on, off in qa_runs), 4),
        "ttft_p50_ratio": round(med(_ratio(on.ttft_p50_ms, off.ttft_p50_ms)
                                    for on, off in qa_runs), 4),
        "no_reuse_throughput_ratio": round(med(_ratio(on.throughput, off.throughput)
                                               for on, off in nr_runs), 4),
        "loop_lag_p99_ms": round(med(on.loop_lag_p99_ms for on, _ in qa_runs), 3),
        "loop_lag_p99_ms_no_reuse": round(med(on.loop_lag_p99_ms for on, _ in nr_runs), 3),
        "loop_lag_p99_ms_offload_off": round(med(off.loop_lag_p99_ms for _, off in qa_runs), 3),
        "ttft_p50_ms_on": round(med(on.ttft_p50_ms for on, _ in qa_runs), 2),
        "ttft_p50_ms_off": round(med(off.ttft_p50_ms for _, off in qa_runs), 2),
        "step_ms_p99_on": round(med(on.step_ms_p99 for on, _ in qa_runs), 3),
        "step_ms_p99_off": round(med(off.step_ms_p99 for _, off in qa_runs), 3),
        "no_reuse_tokens_per_s_on": round(med(on.throughput for on, _ in nr_runs), 1),
        "no_reuse_tokens_per_s_off": round(med(off.throughput for _, off in nr_runs), 1),
        # Where a no-reuse run's time goes: CPU seconds of the loop and of the process.
        "no_reuse_loop_cpu_s_on": round(med(on.loop_cpu_s for on, _ in nr_runs), 3),
        "no_reuse_loop_cpu_s_off": round(med(off.loop_cpu_s for _, off in nr_runs), 3),
        "no_reuse_cpu_s_on": round(med(on.cpu_s for on, _ in nr_runs), 3),
        "no_reuse_cpu_s_off": round(med(off.cpu_s for _, off in nr_runs), 3),
    }


TARGETS = {"recompute_ratio": ("<=", 0.33), "no_reuse_throughput_ratio": (">=", 0.97),
           "loop_lag_p99_ms": ("<=", 5.0)}


def verdicts(figs: dict[str, float]) -> dict[str, bool]:
    return {k: (figs[k] <= v if op == "<=" else figs[k] >= v)
            for k, (op, v) in TARGETS.items()}


def _row(r: Run) -> str:
    return (f"{r.workload:<9} {'on' if r.offload else 'off':<4} {r.finished:>4}/{r.requests:<4} "
            f"{r.prompt_tokens:>8} {r.computed_prompt_tokens:>9} {r.device_hit_tokens:>8} "
            f"{r.tier_hit_tokens:>8} {r.ttft_p50_ms:>9.1f} {r.throughput:>9.0f} "
            f"{r.step_ms_p99:>8.1f} {r.loop_lag_p99_ms:>7.2f} {r.serve_s:>7.2f} "
            f"{r.loop_cpu_s:>6.2f} {r.cpu_s:>6.2f}  {r.problems or 'ok'}")


HEADER = (f"{'workload':<9} {'off.':<4} {'finished':>9} {'prompt':>8} {'computed':>9} "
          f"{'device':>8} {'tiers':>8} {'ttft p50':>9} {'tok/s':>9} {'step p99':>8} "
          f"{'lag p99':>7} {'serve s':>7} {'loop s':>6} {'cpu s':>6}  checks")


# --------------------------------------------------------------------------- command line


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true",
                   help="4 KiB/token pages, a model 5x as fast (same prefill:decode ratio), "
                        "shorter think times, 12 no-reuse requests (< 3 min)")
    p.add_argument("--repeats", type=int, default=3, help="runs per figure (median)")
    q = p.add_argument_group("multi-round QA")
    q.add_argument("--users", type=int, default=10)
    q.add_argument("--rounds", type=int, default=5)
    q.add_argument("--system-prompt-len", type=int, default=1000)
    q.add_argument("--history-len", type=int, default=2000)
    q.add_argument("--question-len", type=int, default=50)
    q.add_argument("--answer-len", type=int, default=100)
    q.add_argument("--tenants", type=int, default=3)
    q.add_argument("--think-s", type=float, default=None, help="default 0.5 (0.1 quick)")
    q.add_argument("--user-gap-s", type=float, default=None, help="default 0.25 (0.05 quick)")
    q.add_argument("--seed", type=int, default=0)
    n = p.add_argument_group("no reuse")
    n.add_argument("--no-reuse-requests", type=int, default=None, help="default 24 (12 quick)")
    n.add_argument("--no-reuse-prompt-len", type=int, default=2000)
    n.add_argument("--no-reuse-answer-len", type=int, default=16)
    n.add_argument("--no-reuse-pairs", type=int, default=3,
                   help="on/off pairs per repeat (a no-reuse run lasts ~0.6 s in --quick: "
                        "one pair's ratio is mostly the machine's noise)")
    d = p.add_argument_group("deployment")
    d.add_argument("--layers", type=int, default=None, help="default 4 (2 with --quick)")
    d.add_argument("--kv-heads", type=int, default=None, help="default 8 (4 with --quick)")
    d.add_argument("--head-size", type=int, default=128)
    d.add_argument("--block-size", type=int, default=16)
    d.add_argument("--chunk-size", type=int, default=256, help="tokens per stored object")
    d.add_argument("--prefill-ms", type=float, default=None,
                   help="per prefill token: default 0.06 (0.012 quick)")
    d.add_argument("--decode-ms", type=float, default=None,
                   help="per step that decodes: default 25 (5 quick)")
    d.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    d.add_argument("--max-seqs", type=int, default=16)
    d.add_argument("--pool-fraction", type=float, default=0.25,
                   help="device pool ÷ QA working set")
    d.add_argument("--no-disk", action="store_true", help="the memory tier only")
    d.add_argument("--disk-io-threads", type=int, default=None,
                   help="default: the connector's (sized to the CPUs)")
    d.add_argument("--store-budget-mb", type=float, default=1024.0)
    d.add_argument("--store-mode", choices=("copy", "hold"), default="copy",
                   help="copy: blocks copied out at the hand-off; hold: pinned until written")
    d.add_argument("--no-uvloop", action="store_true")
    args = p.parse_args(argv)
    for name, full, quick in (("think_s", 0.5, 0.1), ("user_gap_s", 0.25, 0.05),
                              ("prefill_ms", 0.06, 0.012), ("decode_ms", 25.0, 5.0),
                              ("no_reuse_requests", 24, 12), ("layers", 4, 2),
                              ("kv_heads", 8, 4)):
        if getattr(args, name) is None:
            setattr(args, name, quick if args.quick else full)
    if args.repeats < 1 or args.no_reuse_pairs < 1:
        p.error("--repeats and --no-reuse-pairs must be >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    a = parse(argv)
    qa = MultiRoundQA(users=a.users, rounds=a.rounds, system_prompt_len=a.system_prompt_len,
                      history_len=a.history_len, question_len=a.question_len,
                      answer_len=a.answer_len, num_tenants=a.tenants, think_s=a.think_s,
                      user_gap_s=a.user_gap_s, seed=a.seed)
    setup = Setup(a.block_size, a.chunk_size, a.layers, a.kv_heads, a.head_size, a.prefill_ms,
                  a.decode_ms, a.budget, a.max_seqs, a.pool_fraction, not a.no_disk,
                  a.disk_io_threads, a.store_budget_mb, a.store_mode, not a.no_uvloop,
                  a.no_reuse_requests, a.no_reuse_prompt_len, a.no_reuse_answer_len)
    qa_specs = multi_round_qa(qa)
    t0 = time.perf_counter()
    print(f"multi-round QA: {len(qa_specs)} requests, working set {qa.working_set_tokens} "
          f"tokens ({qa.working_set_tokens * setup.token_bytes / 2**20:.0f} MiB), device "
          f"pool {pool_blocks(setup, qa) - 1} blocks; {setup.token_bytes} B/token; "
          f"{a.repeats} repeats", flush=True)
    print(HEADER, flush=True)

    def log(r: Run) -> None:
        print(_row(r), flush=True)

    qa_runs: list[tuple[Run, Run]] = []
    nr_runs: list[tuple[Run, Run]] = []
    for i in range(a.repeats):
        on_first = i % 2 == 0  # alternate which side runs first: drifts land on both
        qa_runs.append(pair(setup, qa, "qa", qa_specs, on_first, log))
        for j in range(a.no_reuse_pairs):
            nr = no_reuse(setup.no_reuse_requests, prompt_len=setup.no_reuse_prompt_len,
                          answer_len=setup.no_reuse_answer_len, num_tenants=a.tenants,
                          seed=a.seed + i * a.no_reuse_pairs + j)
            nr_runs.append(pair(setup, qa, "no_reuse", nr, (i + j) % 2 == 1, log))
    figs = figures(qa_runs, nr_runs)
    ok = verdicts(figs)
    problems = [r.problems for p in (*qa_runs, *nr_runs) for r in p if r.problems]
    print()
    for k, (op, v) in TARGETS.items():
        print(f"{k:<26} {figs[k]:>8}   target {op} {v}: {'met' if ok[k] else 'MISSED'}")
    for k in ("ttft_p50_ratio", "loop_lag_p99_ms_no_reuse", "loop_lag_p99_ms_offload_off"):
        print(f"{k:<26} {figs[k]:>8}")
    print(f"checks: {'every run clean' if not problems else '; '.join(problems)}; "
          f"{time.perf_counter() - t0:.0f} s")
    out = {**figs, "targets_met": ok, "clean": not problems, "quick": a.quick,
           "repeats": a.repeats, "qa": asdict(qa), "setup": asdict(setup),
           "token_bytes": setup.token_bytes, "pool_blocks": pool_blocks(setup, qa) - 1,
           "wall_s": round(time.perf_counter() - t0, 1)}
    print(json.dumps(out))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
