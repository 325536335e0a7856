"""``benchmarks/lookup.py`` runs and says what it measured (loaded from its file, as
test_bench_end_to_end.py does); the figures themselves are the benchmark's, never timed
here."""

from __future__ import annotations

import asyncio

from bench_testlib import load_benchmark


def test_the_lookup_benchmark_claims_every_chunk_and_reports_its_figures() -> None:
    mod = load_benchmark("lookup")
    # bench() raises when a lookup claims less than the whole prompt or the tier lost a chunk.
    out = asyncio.run(mod.bench(mod.Settings(rounds=2, requests=3, chunks=4, chunk_blocks=2)))
    assert set(out) == {"lookup_us", "bare_lookup_us", "lookup_overhead_ratio", "key_us",
                        "settings"}
    assert out["settings"] == {"rounds": 2, "requests": 3, "chunks": 4, "chunk_blocks": 2,
                               "block_size": 16}
    assert all(isinstance(out[k], float) and out[k] > 0
               for k in ("lookup_us", "bare_lookup_us", "lookup_overhead_ratio", "key_us"))
