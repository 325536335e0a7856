#!/usr/bin/env python3
"""Differential test against vLLM 0.33.0: random layouts x random workloads.

Each case simulates a scheduler on kvplugin's core (``kvplugin.sim``), records the calls
as a conformance trace, replays that trace on vLLM's own ``KVCacheManager`` (the side
virtualenv from ``../shared/conformance/reference/setup-reference.sh``) and on kvplugin,
and compares every result exactly, block ids included.

    python tools/differential_vllm.py --cases 40 --seed 7 [--keep DIR]

Run on demand (vLLM is never a kvplugin dependency, so this is not part of the test suite).
Exit status 1 when any case diverges; the diverging traces are kept for debugging.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from kvplugin.replay import dump_result, run_trace
from kvplugin.sim import Limits, Simulation, Workload

REPO = Path(__file__).resolve().parent.parent
SHARED = Path(os.environ.get("KVPLUGIN_SHARED_DIR", REPO.parent / "shared"))
REFERENCE = SHARED / "conformance" / "reference" / "vllm_reference.py"
COMPARE = SHARED / "conformance" / "compare.py"
VENV = Path(os.environ.get("VENV", Path.home() / ".cache" / "kvplugin-vllm-reference"))


def random_layout(rng: random.Random) -> dict[str, Any]:
    """One of the layout families vLLM supports, with random sizes and options."""
    family = rng.choice(["full", "full", "eagle", "swa_hybrid", "swa_only", "chunked",
                         "mamba", "mamba_fine", "mamba_swa", "no_cache", "lookahead"])
    bs = rng.choice([4, 8, 16])
    cfg: dict[str, Any] = {"block_size": bs, "max_model_len": 2048,
                           "num_blocks": rng.randint(24, 160),
                           "watermark": rng.choice([0.0, 0.0, 0.02]),
                           "max_in_flight_tokens": rng.choice([64, 128, 256])}
    swa = {"kind": "sliding_window", "sliding_window": rng.randint(bs, 6 * bs + 3)}
    if family == "eagle":
        cfg["use_eagle"] = True
        cfg["groups"] = rng.choice([[{"kind": "full"}], [{"kind": "full"}, swa]])
    elif family == "swa_hybrid":
        groups: list[dict[str, Any]] = [{"kind": "full", "block_size": 2 * bs}, swa]
        if rng.random() < 0.5:
            groups.append(dict(swa))
        cfg["groups"] = groups
        cfg["prefix_cache_retention_interval"] = rng.choice([None, 0, 4 * 2 * bs])
    elif family == "swa_only":
        cfg["groups"] = [swa]
    elif family == "chunked":
        cfg["groups"] = [{"kind": "full"},
                         {"kind": "chunked_local", "attention_chunk_size": bs * rng.randint(1, 6)}]
    elif family in ("mamba", "mamba_fine", "mamba_swa"):
        mamba: dict[str, Any] = {"kind": "mamba", "mode": "align"}
        if family == "mamba_fine":
            mamba["block_size"] = bs * rng.choice([2, 4])
            cfg["prefix_match_unit"] = bs
        cfg["groups"] = [{"kind": "full"}, mamba] + ([swa] if family == "mamba_swa" else [])
        cfg["prefix_cache_retention_interval"] = rng.choice([None, 0])
    elif family == "no_cache":
        cfg["enable_caching"] = False
        cfg["groups"] = rng.choice([[{"kind": "full"}], [
            {"kind": "full"}, {"kind": "mamba", "mode": "none", "block_size": 2048}]])
    elif family == "lookahead":
        cfg["num_hash_lookahead_tokens"] = rng.choice([1, 2])
        cfg["groups"] = [{"kind": "full"}]
    else:
        cfg["groups"] = [{"kind": "full"}]
    return cfg


def make_case(seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    layout = random_layout(rng)
    workload = Workload(num_requests=rng.randint(10, 40), seed=seed,
                        system_prompt_len=(8, rng.choice([64, 200])),
                        user_len=(1, rng.choice([40, 120])),
                        output_len=(1, rng.choice([8, 40])),
                        vocab=rng.choice([8, 1000, 50000]))
    limits = Limits(max_num_batched_tokens=rng.choice([32, 64, 128]),
                    max_num_seqs=rng.randint(2, 12),
                    full_sequence_must_fit=rng.random() < 0.7,
                    stats_every=rng.randint(1, 6))
    return Simulation(layout, workload, limits).run(max_steps=3000).trace


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", type=int, default=20)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--keep", help="directory for the traces and results (default: temp)")
    args = ap.parse_args()
    vllm_py = VENV / "bin" / "python"
    if not vllm_py.exists():
        print(f"no vLLM reference venv at {VENV}; run {SHARED}/conformance/reference/"
              "setup-reference.sh first", file=sys.stderr)
        return 2
    work = Path(args.keep or tempfile.mkdtemp(prefix="kvplugin-diff-"))
    (work / "vllm").mkdir(parents=True, exist_ok=True)
    traces = []
    for k in range(args.cases):
        seed = args.seed * 100_000 + k
        path = work / f"case{seed}.json"
        path.write_text(json.dumps(make_case(seed)))
        traces.append(path)
    subprocess.run([str(vllm_py), str(REFERENCE), *map(str, traces), "--out-dir",
                    str(work / "vllm")], check=False, capture_output=True)
    bad = 0
    for path in traces:
        ours = work / f"{path.stem}.kvplugin.json"
        with open(ours, "w") as f:
            dump_result(run_trace(json.loads(path.read_text())), f)
        theirs = work / "vllm" / f"{path.stem}.result.json"
        cmp = subprocess.run([sys.executable, str(COMPARE), str(theirs), str(ours)],
                             capture_output=True, text=True)
        status = cmp.stdout.strip().splitlines()[-1] if cmp.stdout.strip() else cmp.stderr
        layout = json.loads(path.read_text())["config"]
        print(f"{path.stem}: {status}  groups={[g['kind'] for g in layout['groups']]}")
        if cmp.returncode != 0:
            bad += 1
            print(cmp.stdout)
    print(json.dumps({"cases": len(traces), "diverged": bad, "dir": str(work)}))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
