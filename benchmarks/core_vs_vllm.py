#!/usr/bin/env python3
"""Replay throughput of kvplugin's core against vLLM 0.33.0's own KVCacheManager.

Both sides replay the same trace through their replay drivers (kvplugin's
``kvplugin.replay.Replayer`` and the conformance reference's ``Oracle``: op dispatch plus
manager calls, no result construction), timing only the replay loop on fresh managers, in
alternating rounds so machine noise hits both alike.  Per trace it prints the median
ops/sec of each side and their ratio; the last line is a JSON object
``{"<trace stem>": ratio, ...}``.

    python benchmarks/core_vs_vllm.py                       # the three bench/ traces
    python benchmarks/core_vs_vllm.py T.json --rounds 5 --clock cpu

``--clock wall`` (default) times with ``perf_counter``, as ``kvplugin replay --bench`` and
the reference's ``--bench`` do; ``--clock cpu`` uses ``process_time``, which other processes
on a shared machine disturb far less.  vLLM runs in the side virtualenv built by
``../shared/conformance/reference/setup-reference.sh`` (``$VENV``, default
``~/.cache/kvplugin-vllm-reference``); it is never a kvplugin dependency.  Without that venv
only kvplugin's figures are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVPLUGIN_SHARED_DIR", REPO.parent / "shared"))
REFERENCE_DIR = SHARED / "conformance" / "reference"
VENV = Path(os.environ.get("VENV", Path.home() / ".cache" / "kvplugin-vllm-reference"))

# Run under each interpreter: the same loop, only the replay driver differs.
DRIVER = r"""
import json, logging, sys, time
side, trace_path, repeats, clock, ref_dir = sys.argv[1:6]
if side == "vllm":
    sys.path.insert(0, ref_dir)
    import vllm_reference as ref
    make = ref.Oracle
else:
    from kvplugin.replay import Replayer as make
logging.disable(logging.WARNING)
trace = json.load(open(trace_path))
ops = trace["ops"]
clk = time.process_time if clock == "cpu" else time.perf_counter
runs = []
if side != "vllm":  # validated once, up front, as `kvplugin replay --bench` does
    from kvplugin.replay import check_ops

    bad = check_ops(ops)
    if bad is not None:
        raise bad[1]
for _ in range(int(repeats)):
    rep = make(trace.get("config", {}))
    apply = rep.apply if side == "vllm" else rep.dispatch
    t0 = clk()
    for op in ops:
        apply(op, False)
    runs.append(clk() - t0)
print(json.dumps({"ops_per_sec": len(ops) * len(runs) / sum(runs)}))
"""


def _ops_per_sec(python: str, side: str, trace: Path, repeats: int, clock: str) -> float:
    out = subprocess.run([python, "-c", DRIVER, side, str(trace), str(repeats), clock,
                          str(REFERENCE_DIR)], check=True, capture_output=True, text=True)
    return float(json.loads(out.stdout.strip().splitlines()[-1])["ops_per_sec"])


def measure(trace: Path, rounds: int, repeats: int, clock: str) -> tuple[float, float | None]:
    vllm_py = VENV / "bin" / "python"
    have_vllm = vllm_py.exists() and (REFERENCE_DIR / "vllm_reference.py").exists()
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(rounds):
        ours.append(_ops_per_sec(sys.executable, "kvplugin", trace, repeats, clock))
        if have_vllm:
            theirs.append(_ops_per_sec(str(vllm_py), "vllm", trace, repeats, clock))
    return statistics.median(ours), (statistics.median(theirs) if theirs else None)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = [str(SHARED / "conformance" / "bench" / f"{n}.json")
               for n in ("full_10k", "hybrid_swa_10k", "mamba_10k")]
    ap.add_argument("traces", nargs="*", default=default)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (median)")
    ap.add_argument("--repeats", type=int, default=3, help="replays per process")
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = ap.parse_args()
    summary: dict[str, float | None] = {}
    for t in args.traces:
        path = Path(t)
        ours, vllm = measure(path, args.rounds, args.repeats, args.clock)
        ratio = None if vllm is None else ours / vllm
        vllm_s = "n/a" if vllm is None else f"{vllm:.0f}"
        ratio_s = "n/a" if ratio is None else f"{ratio:.2f}"
        print(f"{path.stem}: kvplugin {ours:.0f} ops/s, vLLM {vllm_s} ops/s, "
              f"ratio {ratio_s} ({args.clock} clock, median of {args.rounds})")
        summary[path.stem] = None if ratio is None else round(ratio, 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
