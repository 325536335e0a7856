"""Peak memory of ``kvplugin run`` against the number of requests it serves.

Each point is a fresh ``kvplugin run --json --requests N`` process on the embedded default
config (simulated time, offload to memory + disk); its peak RSS comes from ``wait4`` (the
kernel's ``ru_maxrss`` of that child alone). The ratio to the smallest N is the figure: a run
whose memory is flat keeps it near 1 however long it runs (the workload is streamed, the
percentiles and the time series bounded, the tiers and memos capped).

    python3 benchmarks/rss.py                          # 1,000 and 10,000 requests
    python3 benchmarks/rss.py --requests 1000 100000   # a long one (~30 min here)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence


def peak_rss_mib(requests: int) -> tuple[float, float, dict[str, object]]:
    """(peak RSS MiB, wall s, the run's JSON) of one ``kvplugin run``."""
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "kvplugin.cli", "run", "--json",
                             "--requests", str(requests)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    assert proc.stdout is not None
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        raise SystemExit(f"kvplugin run --requests {requests} exited {proc.returncode}")
    return usage.ru_maxrss / 1024, time.perf_counter() - t0, json.loads(out.splitlines()[-1])


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, nargs="+", default=[1000, 10000])
    p.add_argument("--repeats", type=int, default=1, help="runs per point (median)")
    a = p.parse_args(argv)
    points: dict[int, dict[str, float]] = {}
    for n in a.requests:
        runs = [peak_rss_mib(n) for _ in range(a.repeats)]
        rss = statistics.median(r[0] for r in runs)
        points[n] = {"peak_rss_mib": round(rss, 1),
                     "wall_s": round(statistics.median(r[1] for r in runs), 1),
                     "ttft_p50_ms": float(str(runs[0][2]["ttft_p50_ms"]))}
        print(f"{n:>8} requests: peak RSS {rss:7.1f} MiB, {points[n]['wall_s']} s",
              file=sys.stderr)
    base = points[min(points)]["peak_rss_mib"]
    out = {"points": points, "rss_ratio": {n: round(v["peak_rss_mib"] / base, 3)
                                           for n, v in points.items()}}
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
