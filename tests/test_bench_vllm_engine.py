"""``benchmarks/vllm_engine.py``'s own logic (loaded from its file): the workloads it
sends, the ratios, hook shares and output checks it reports from the engine processes'
records. The engines themselves run only in the benchmark; nothing is timed here."""

from __future__ import annotations

import json
from typing import Any

import pytest
from bench_testlib import load_benchmark


@pytest.fixture(scope="module")
def bench() -> Any:
    return load_benchmark("vllm_engine")


def test_the_workloads_are_the_issues(bench: Any) -> None:
    reuse = bench.workload(0, "reuse")
    assert [len(p) for p in reuse["round1"]] == [2048, 2208, 2368, 2528, 2688, 2848]
    assert [len(p) for p in reuse["fill"]] == [1024] * 6
    assert all(b[:len(a)] == a and len(b) == len(a) + 40
               for a, b in zip(reuse["round1"], reuse["round2"], strict=True))
    assert bench.workload(0, "repeat")["round2"] == reuse["round1"]
    unique = bench.workload(0, "unique")
    firsts = {tuple(p[:64]) for r in unique.values() for p in r}
    assert len(firsts) == 18 and not firsts & {tuple(p[:64]) for p in reuse["round1"]}
    assert bench.workload(1, "reuse")["round1"] != reuse["round1"]  # fresh every repetition
    assert bench.workload(0, "reuse") == reuse  # and the same in every engine process


def _rec(wall: float, hooks: float = 0.0, outputs: int = 1, steps_s: float | None = None,
         **where: Any) -> dict[str, Any]:
    return {"wall_s": wall, "steps_s": steps_s or wall, "steps": 10,
            "hooks_s": {"wait_for_save": hooks} if hooks else {}, "cached": [0],
            "ttft_s": [0.1], "outputs": [[outputs]], **where}


def _records(ours: dict[tuple[int, str, str], float]) -> dict[str, list[dict[str, Any]]]:
    base = {"vllm alone": [], "memory": [], "memory + disk": []}
    for rep in range(3):
        for variant in ("reuse", "unique"):
            for rnd in ("round1", "fill", "round2"):
                w = dict(rep=rep, variant=variant, round=rnd)
                base["vllm alone"].append(_rec(2.0, **w))
                t = ours.get((rep, variant, rnd), 2.0)
                base["memory"].append(_rec(t, **w))
                base["memory + disk"].append(_rec(t, hooks=0.02 * (rep + 1), **w))
    return base


def test_ratios_are_medians_of_each_repetitions_ratio(bench: Any) -> None:
    rec = _records({(0, "reuse", "round1"): 2.2, (1, "reuse", "round1"): 2.1,
                    (2, "reuse", "round1"): 4.0, (0, "reuse", "round2"): 0.2,
                    (1, "reuse", "round2"): 0.3, (2, "reuse", "round2"): 0.24})
    assert bench._median_ratio(rec, "memory", "reuse", "round1", 3) == pytest.approx(1.1)
    assert bench._median_ratio(rec, "memory", "reuse", "round2", 3) == pytest.approx(0.12)
    # Hooks over steps per repetition (6 s of steps each), the median of the three.
    share, per_hook = bench.hook_share(rec["memory + disk"], "unique")
    assert share == pytest.approx(3 * 0.04 / 6.0)
    assert per_hook == {"wait_for_save": pytest.approx(1000 * 3 * 0.04 / 30)}
    out = bench.report(rec, 3, "auto")
    assert out["store_round_ratio_memory"] == pytest.approx(1.1)
    assert out["reuse_round_ratio"] == pytest.approx(0.12)
    assert json.loads(json.dumps(out)) == out


def test_an_output_that_differs_from_vllm_alone_is_named(bench: Any) -> None:
    rec = _records({})
    assert bench.check_outputs(rec) == []
    rec["memory"][4]["outputs"] = [[9]]
    assert bench.check_outputs(rec) == ["memory rep 0 unique fill"]
