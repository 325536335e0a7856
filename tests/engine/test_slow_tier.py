"""Load or recompute against a tier that slows down and recovers, in real time, through the
engine: the manager measures the tier's loads, stops claiming from it once loading is
slower than computing, reads one of its objects aside every ``probe_every`` skipped claims
(no request waits for that read), and claims from it again once those reads are fast."""

from __future__ import annotations

from typing import Any

import pytest
from engine_testlib import serve_all, small_config

from kvplugin.connectors.base import Connector
from kvplugin.connectors.faults import FaultInjector, FaultPlan
from kvplugin.engine.build import deployment

PROMPT = list(range(1, 257))  # 256 tokens: ~9 ms to compute on the preset, ~2 ms to load
THROTTLE = FaultPlan(get_delay=0.1)  # every get waits 100 ms: far slower than computing


@pytest.mark.asyncio
async def test_a_throttled_tier_is_skipped_probed_aside_and_used_again() -> None:
    injectors: list[FaultInjector] = []

    def wrap(tier: Connector) -> Connector:
        injectors.append(FaultInjector(tier, FaultPlan(), seed=0))
        return injectors[-1]

    cfg = small_config(blocks=40, block_size=16, budget=256,
                       engine={"deterministic": False, "model_cost": "llama-3.1-8b-h100"})
    async with deployment(cfg, wrap_tiers=wrap) as dep:
        mgr = dep.mgr
        costs = mgr.load_costs
        assert costs is not None and costs.measure  # real time: the tier is measured
        costs.probe_every = 2
        rounds = iter(range(1000))

        async def asked_again() -> tuple[Any, dict[str, int], int, int]:
            """Fill the device pool (the prompt's blocks then live in the tier only), ask
            the prompt again, let every job and probe end: (result, skipped claims,
            probes, tokens loaded from the tier so far)."""
            n = next(rounds)
            fill = [(f"f{n}-{i}", [1000 + 10_000 * n + 300 * i + j for j in range(200)],
                     "t0", 1) for i in range(3)]
            await serve_all(dep.engine, fill)
            res = (await serve_all(dep.engine, [(f"b{n}", PROMPT, "t0", 2)]))[f"b{n}"]
            await mgr.drain()
            s = mgr.stats()
            return (res, dict(s.loads_skipped_slower_than_recompute), s.load_probes,
                    dep.engine.stats.tier_hit_tokens.get("memory", 0))

        first = (await serve_all(dep.engine, [("a", PROMPT, "t0", 2)]))["a"]
        await mgr.drain()
        res, skipped, probes, loaded = await asked_again()  # fast: loaded
        assert loaded >= 200 and skipped == {} and res.output == first.output

        injectors[0].plan = THROTTLE
        res, skipped, probes, loaded2 = await asked_again()
        # Still believed fast: loaded; that load took the throttle's 100 ms (EWMA, alpha 0.2).
        assert loaded2 > loaded and skipped == {} and injectors[0].injected.throttled == 1
        assert costs.speeds["memory"].latency_s >= 0.018

        res, skipped, probes, loaded3 = await asked_again()  # now computed
        assert (skipped, probes, loaded3) == ({"memory": 1}, 0, loaded2)
        res, skipped, probes, loaded3 = await asked_again()  # computed, and a probe
        assert (skipped, probes, loaded3) == ({"memory": 2}, 1, loaded2)
        assert injectors[0].injected.throttled == 2  # the probe's read, aside
        assert costs.speeds["memory"].latency_s >= 0.03  # it was slow: still skipped
        assert res.output == first.output

        injectors[0].plan = FaultPlan()  # the tier recovers
        for _ in range(60):
            res, skipped, probes, loaded4 = await asked_again()
            if loaded4 > loaded2:
                break
        else:
            raise AssertionError(f"the recovered tier was never claimed again: {skipped}, "
                                 f"{probes} probes, latency {costs.speeds['memory']}")
        # Only probes brought the estimate down (no request paid for the slow tier), and
        # the claim that loaded again is whole.
        assert probes >= 2 and skipped["memory"] == 2 * probes
        assert loaded4 - loaded2 >= 200 and res.output == first.output
        assert injectors[0].injected.throttled == 2
