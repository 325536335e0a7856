#!/usr/bin/env python3
"""Replay throughput of kvplugin's core against vLLM 0.33.0's own KVCacheManager.

Both sides replay the same trace with the same driver semantics (``--bench``: op dispatch
plus manager calls, no result construction), in alternating rounds so that machine noise
hits both alike; the ratio of medians is printed per trace, and the last line is a JSON
object ``{"<trace stem>": ratio, ...}``.

    python benchmarks/core_vs_vllm.py ../shared/conformance/bench/full_10k.json --rounds 5

vLLM runs in the side virtualenv built by ``../shared/conformance/reference/setup-reference.sh``
(``$VENV``, default ``~/.cache/kvplugin-vllm-reference``); it is never a kvplugin dependency.
Without that venv only kvplugin's figures are printed.
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
REFERENCE = SHARED / "conformance" / "reference" / "vllm_reference.py"
VENV = Path(os.environ.get("VENV", Path.home() / ".cache" / "kvplugin-vllm-reference"))


def _ops_per_sec(cmd: list[str]) -> float:
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return float(json.loads(out.strip().splitlines()[-1])["ops_per_sec"])


def measure(trace: Path, rounds: int, repeats: int) -> dict[str, float | None]:
    ours_cmd = [sys.executable, "-m", "kvplugin.cli", "replay", str(trace),
                "--bench", str(repeats)]
    vllm_py = VENV / "bin" / "python"
    vllm_cmd = [str(vllm_py), str(REFERENCE), str(trace), "--bench", str(repeats)]
    have_vllm = vllm_py.exists() and REFERENCE.exists()
    ours: list[float] = []
    theirs: list[float] = []
    for _ in range(rounds):
        ours.append(_ops_per_sec(ours_cmd))
        if have_vllm:
            theirs.append(_ops_per_sec(vllm_cmd))
    res: dict[str, float | None] = {"kvplugin_ops_per_sec": statistics.median(ours)}
    res["vllm_ops_per_sec"] = statistics.median(theirs) if theirs else None
    res["ratio"] = (res["kvplugin_ops_per_sec"] / res["vllm_ops_per_sec"]  # type: ignore[operator]
                    if theirs else None)
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    default = [str(SHARED / "conformance" / "bench" / f"{n}.json")
               for n in ("full_10k", "hybrid_swa_10k", "mamba_10k")]
    ap.add_argument("traces", nargs="*", default=default)
    ap.add_argument("--rounds", type=int, default=5, help="alternating rounds (median)")
    ap.add_argument("--repeats", type=int, default=3, help="replays per process")
    args = ap.parse_args()
    summary: dict[str, float | None] = {}
    for t in args.traces:
        path = Path(t)
        r = measure(path, args.rounds, args.repeats)
        vllm, ratio = r["vllm_ops_per_sec"], r["ratio"]
        vllm_s = "n/a" if vllm is None else f"{vllm:.0f}"
        ratio_s = "n/a" if ratio is None else f"{ratio:.2f}"
        print(f"{path.stem}: kvplugin {r['kvplugin_ops_per_sec']:.0f} ops/s, "
              f"vLLM {vllm_s} ops/s, ratio {ratio_s}")
        summary[path.stem] = None if r["ratio"] is None else round(r["ratio"], 3)
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
