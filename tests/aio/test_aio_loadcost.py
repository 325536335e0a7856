"""Load or recompute by cost: the prefix that saves the most time, a tier that slows down
skipped, and tried again later."""

from __future__ import annotations

import pytest

from kvplugin.aio.loadcost import Choice, LoadCosts, rate

MS = 1e-3


def costs(**kw: float) -> LoadCosts:
    # Recompute: 1 ms per token. Memory: 0.1 ms per token; redis: 0.5 ms + 2 ms per token.
    return LoadCosts.seeded(["memory", "redis"], rate(1000.0),
                            tier_s_per_token={"memory": 0.1 * MS, "redis": 2 * MS},
                            tier_latency_s={"redis": 0.5 * MS}, **kw)


def units(*tiers: str, size: int = 16) -> list[tuple[str, int, int]]:
    return [(t, i * size, size) for i, t in enumerate(tiers)]


def test_a_fast_tier_is_loaded_a_slow_one_computed() -> None:
    c = costs()
    assert c.choose(units("memory", "memory", "memory")) == (3, None)
    assert c.choose(units("redis", "redis")) == (0, "redis")
    # Memory's part first, then Redis's: the claim ends where Redis's would begin.
    assert c.choose(units("memory", "memory", "redis", "redis")) == (2, "redis")


def test_a_latency_is_paid_once_per_tier_and_can_tip_a_short_claim() -> None:
    c = LoadCosts.seeded(["disk"], rate(1000.0), tier_s_per_token={"disk": 0.5 * MS},
                         tier_latency_s={"disk": 10 * MS})
    # 16 tokens save 16 ms - 8 ms - 10 ms < 0; 64 tokens save 64 - 32 - 10 > 0.
    assert c.choose(units("disk")) == (0, "disk")
    assert c.choose(units("disk", "disk", "disk", "disk")) == (4, None)


def test_recompute_grows_with_context() -> None:
    # A model whose recompute is dearer deep in the context: a far chunk is worth loading.
    c = LoadCosts.seeded(["redis"], lambda start, n: n * (start + n) * 1e-6,
                         tier_s_per_token={"redis": 0.5 * MS}, tier_latency_s={})
    assert c.choose([("redis", 0, 16)]) == (0, "redis")
    assert c.choose([("redis", 4096, 16)]) == (1, None)


def test_a_tier_that_slowed_down_is_skipped_then_probed_and_used_again() -> None:
    c = costs(probe_every=4)
    fast = units("memory", "memory")
    assert c.choose(fast) == (2, None)
    c.observed("memory", 32, 32 * 0.1 * MS + 100 * MS)  # a load took 100 ms extra
    assert c.speeds["memory"].latency_s == pytest.approx(100 * MS)
    assert [c.choose(fast) for _ in range(3)] == [(0, "memory")] * 3
    # The fourth: skipped too, and one of its objects is to be read aside (a probe).
    assert c.plan(fast) == Choice(0, "memory", "memory")
    assert c.choose(fast) == (0, "memory") and c.probes == 1
    c.observed("memory", 32, 32 * 0.1 * MS)  # the probe was fast again
    c.observed("memory", 32, 32 * 0.1 * MS)
    c.observed("memory", 32, 32 * 0.1 * MS)
    c.observed("memory", 32, 32 * 0.1 * MS)  # EWMA, alpha 0.2: 100 ms * 0.8**4 = 41 ms
    assert c.speeds["memory"].latency_s == pytest.approx(100 * MS * 0.8 ** 4)
    for _ in range(12):
        c.observed("memory", 32, 32 * 0.1 * MS)
    assert c.choose(fast) == (2, None)


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="positive"):
        rate(0.0)
    with pytest.raises(ValueError, match="alpha"):
        LoadCosts.seeded(["memory"], rate(1.0), tier_s_per_token={}, tier_latency_s={},
                         alpha=0.0)
    with pytest.raises(ValueError, match="negative"):
        LoadCosts.seeded(["memory"], rate(1.0), tier_s_per_token={"memory": -1.0},
                         tier_latency_s={})


def test_a_simulated_run_decides_from_its_seeds_alone() -> None:
    c = costs(measure=False, probe_every=1)
    c.observed("memory", 32, 10.0)  # real time says nothing in simulated time
    assert c.speeds["memory"].latency_s == 0.0 and c.speeds["memory"].loads == 0
    assert c.choose(units("redis")) == (0, "redis") and c.probes == 0  # no probe either


def test_planning_is_pure_only_the_admitted_claim_counts_toward_a_probe() -> None:
    # An engine plans a claim again each step its admission finds no room: those plans
    # must not bring a probe closer (a tier would be probed every few steps, not claims).
    c = costs(probe_every=2)
    slow = units("redis")
    assert [c.plan(slow) for _ in range(5)] == [Choice(0, "redis", None)] * 5
    c.settle(c.plan(slow))  # the first admitted skip
    assert c.plan(slow) == Choice(0, "redis", "redis")  # the second would be the probe
    assert c.plan(slow) == Choice(0, "redis", "redis") and c.probes == 0
    c.settle(c.plan(slow))
    assert c.probes == 1 and c.plan(slow) == Choice(0, "redis", None)
    c.settle(Choice(3, None, None))  # a claim loaded whole counts for nothing
    assert c.plan(slow) == Choice(0, "redis", None)
