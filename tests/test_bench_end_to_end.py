"""The end-to-end benchmark's figures (``benchmarks/end_to_end.py``, loaded from its file:
``benchmarks/`` on sys.path would let ``benchmarks/connectors.py`` shadow ``connectors``):
the sustainable QPS read off a sweep, and the JSON's contract keys."""

from __future__ import annotations

from typing import Any

import pytest
from bench_testlib import load_benchmark


@pytest.fixture(scope="module")
def e2e() -> Any:
    return load_benchmark("end_to_end")  # the script drops its own directory from sys.path


def test_sustainable_qps_is_interpolated_between_the_points_around_the_slo(e2e: Any) -> None:
    f = e2e.sustainable_qps
    # p90 100 ms at 2 QPS, 1,000 at 6, 5,000 at 10: the 2 s SLO is crossed a quarter of
    # the way from 6 to 10.
    assert f([(10, 5000.0), (2, 100.0), (6, 1000.0)], 2000.0) == (7.0, "within")
    assert f([(2, 100.0), (6, 1000.0)], 2000.0) == (6, "at least")  # never over
    assert f([(2, 2500.0), (6, 9000.0)], 2000.0) == (2, "below")  # over from the start
    assert f([(4, 2000.0), (8, 2000.0)], 2000.0) == (8, "at least")  # at the SLO is under
    with pytest.raises(ValueError):
        f([], 2000.0)


def _point(e2e: Any, config: str, qps: float, p50: float, p90: float,
           computed: int) -> Any:
    return e2e.Point(config, qps, 100, p50, p90, 1000.0, 1.0, 10_000, computed, 0, 0, 0, 0,
                     8192, 0, 1.0, 1.0, "")


def test_the_sweep_figures_carry_the_contract_keys(e2e: Any) -> None:
    pts = [_point(e2e, "off", 2, 100.0, 150.0, 9000), _point(e2e, "off", 6, 3000.0, 4000.0,
                                                              9500),
           _point(e2e, "memory+disk", 2, 25.0, 75.0, 1200),
           _point(e2e, "memory+disk", 6, 30.0, 80.0, 1300)]
    figs = e2e.sweep_figures(pts, 2000.0)
    assert figs["ttft_p50_ratio"] == 0.25 and figs["recompute_ratio"] == round(1200 / 9000, 4)
    # off: 2 + (2000 - 150) * 4 / 3850; memory + disk never over: at least 6.
    off = 2 + 1850 * 4 / 3850
    assert figs["sustainable_qps"] == {"off": round(off, 3), "memory+disk": 6}
    assert figs["sustainable_qps_ratio"] == round(6 / off, 4)
    assert figs["sustainable_qps_bound"] == {"off": "within", "memory+disk": "at least"}
    assert figs["lowest_qps"] == 2 and figs["off_saturated_at_lowest_qps"] is False
    assert [p["qps"] for p in figs["sweep"]["off"]] == [2, 6]
    ok = e2e.verdicts({**figs, "no_reuse_throughput_ratio": 0.99, "loop_lag_p99_ms": 6.0,
                       "slow_tier_ttft_ratio": float("nan")})
    assert ok == {"ttft_p50_ratio": True, "sustainable_qps_ratio": True,
                  "no_reuse_throughput_ratio": True, "loop_lag_p99_ms": False,
                  "slow_tier_ttft_ratio": None}
