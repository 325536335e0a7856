"""The model cost (``engine.model_cost``): its arithmetic, and a load that waits for the
model's bytes to cross the host link in simulated time."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
from engine_testlib import serve_all, small_config

from kvplugin.config import ModelCostName
from kvplugin.costs import PRESETS, ModelCost, TierLink, model_cost
from kvplugin.engine.build import deployment
from kvplugin.engine.model import Work
from kvplugin.engine.scheduler import Result

COST = ModelCost(name="t", description="a test deployment", source="made up",
                 kv_bytes_per_token=1000, weights_read_s=0.005, tokens_per_s=1000.0,
                 attention_pairs_per_s=1e6, kv_read_s_per_token=1e-6,
                 host_link_bytes_per_s=1e6, tiers={"disk": TierLink(5e5, 0.01)})


def w(start: int, n: int, decode: bool = False) -> Work:
    return Work("r", start, n, ([],), decode)


def test_a_step_is_linear_layers_then_attention_then_kv_reads() -> None:
    # 100 prefill tokens from 0: linear 0.1 s (above the 5 ms weight floor), 5050 pairs.
    assert COST.step_s([w(0, 100)]) == pytest.approx(0.1 + 5050 / 1e6)
    # From 1000: each token also attends to the 1000 before it.
    assert COST.step_s([w(1000, 100)]) == pytest.approx(0.1 + (100_000 + 5050) / 1e6)
    # Two decodes at contexts 500 and 300: memory-bound (the weight floor), 802 KV reads.
    assert COST.step_s([w(500, 1, True), w(300, 1, True)]) == pytest.approx(0.005 + 802e-6)
    assert COST.step_s([]) == 0.0
    assert COST.prefill_s(250, chunk=100) == pytest.approx(
        COST.step_s([w(0, 100)]) + COST.step_s([w(100, 100)]) + COST.step_s([w(200, 50)]))


def test_a_load_is_the_models_bytes_over_the_slower_of_link_and_tier() -> None:
    assert COST.load_s({"memory": 500}) == pytest.approx(500 * 1000 / 1e6)
    assert COST.load_s({"disk": 500}) == pytest.approx(0.01 + 500 * 1000 / 5e5)
    assert COST.load_s({"memory": 0, "disk": 0}) == 0.0
    with pytest.raises(ValueError, match="tokens_per_s"):
        ModelCost(name="x", description="", source="", kv_bytes_per_token=1, weights_read_s=1,
                  tokens_per_s=0, attention_pairs_per_s=1, kv_read_s_per_token=1,
                  host_link_bytes_per_s=1)


def test_the_h100_preset_matches_its_published_shape() -> None:
    m = model_cost("llama-3.1-8b-h100")
    assert m.kv_bytes_per_token == 128 * 1024  # 32 layers x 8 KV heads x 128 x K,V x bf16
    decode_1 = m.step_s([w(1000, 1, True)])
    decode_100 = m.step_s([w(1000, 1, True)] * 100)
    assert 0.004 < decode_1 < 0.006 and 0.007 < decode_100 < 0.010  # ~5 ms, ~8 ms
    assert 25_000 < 2048 / m.step_s([w(0, 2048)]) < 31_000  # prefill ~25-35k tokens/s
    assert m.load_s({"memory": 20_000}) == pytest.approx(20_000 * 131072 / 20e9)
    # Redis over 25 GbE brings 20k tokens slower than the GPU recomputes them.
    assert m.load_s({"redis": 20_000}) > m.prefill_s(20_000)
    assert sorted(PRESETS) == sorted(typing.get_args(ModelCostName))
    with pytest.raises(ValueError, match="unknown model cost"):
        model_cost("gpt-5-tpu")


SLOW_LINK = 1e6  # bytes/s: a load takes seconds, a step milliseconds


def slow_link(monkeypatch: pytest.MonkeyPatch) -> ModelCost:
    slow = dataclasses.replace(model_cost("llama-3.1-8b-h100"), host_link_bytes_per_s=SLOW_LINK)
    monkeypatch.setitem(PRESETS, "llama-3.1-8b-h100", slow)
    return slow


async def asked_again(cfg: Any) -> tuple[Result, Result, Any, Any]:
    """Prompt ``a``, three others that take the device pool (a's blocks then live in the
    memory tier only), then ``a``'s prompt again as ``b``: (a, b, engine stats, manager
    stats)."""
    prompt = list(range(1, 65))
    async with deployment(cfg) as dep:
        first = await serve_all(dep.engine, [("a", prompt, "t0", 2)])
        await serve_all(dep.engine, [(f"f{i}", [200 + 64 * i + j for j in range(64)], "t0", 2)
                                     for i in range(3)])
        again = await serve_all(dep.engine, [("b", prompt, "t0", 2)])
        return first["a"], again["b"], dep.engine.stats, dep.mgr.stats()


@pytest.mark.asyncio
async def test_a_loaded_request_waits_for_its_bytes_on_the_link(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The wait shows in the first token's (simulated) time; the test takes no longer.
    slow = slow_link(monkeypatch)
    cfg = small_config(blocks=20, engine={"deterministic": True,
                                          "model_cost": "llama-3.1-8b-h100"},
                       offload={"cost_aware_loads": False})  # loaded however slow
    a, b, stats, _ = await asked_again(cfg)
    loaded = stats.tier_hit_tokens.get("memory", 0)
    assert loaded > 0, "the test needs the second request to load from the tier"
    took = slow.load_s({"memory": loaded})
    assert took > 1.0 and stats.transfer_s == pytest.approx(took)
    # Its first token comes no earlier than its KV has crossed the link, and not much
    # later (a few steps' milliseconds).
    assert b.ttft_s is not None and took <= b.ttft_s < took + 0.1
    assert a.ttft_s is not None and a.ttft_s < 0.1
    assert a.output == b.output


@pytest.mark.asyncio
async def test_a_load_slower_than_recomputing_is_not_claimed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The same slow link with cost-aware loads (the default): the hit is computed instead.
    slow_link(monkeypatch)
    cfg = small_config(blocks=20, engine={"deterministic": True,
                                          "model_cost": "llama-3.1-8b-h100"})
    a, b, stats, s = await asked_again(cfg)
    assert s.loads_skipped_slower_than_recompute == {"memory": 1}
    assert s.skipped_load_tokens > 0 and stats.transfer_s == 0
    assert b.ttft_s is not None and b.ttft_s < 0.1  # computed in milliseconds, not loaded
    assert a.output == b.output

@pytest.mark.asyncio
async def test_with_a_model_cost_one_seed_is_still_one_run() -> None:
    from kvplugin.engine.report import decided
    from kvplugin.engine.run import serve

    cfg = small_config(blocks=40, disk=True, engine={"deterministic": True,
                                                     "model_cost": "llama-3.1-8b-h100"},
                       workload={"num_requests": 60})
    first, second = (await serve(cfg)).as_dict(), (await serve(cfg)).as_dict()
    assert first["model_cost"] == "llama-3.1-8b-h100" and first["link_transfer_s"] > 0
    assert decided(first) == decided(second)


def test_tier_links_override_a_presets_tier_and_leave_the_rest() -> None:
    from kvplugin.config import validate
    from kvplugin.plugin import deployment_cost

    preset = model_cost("llama-3.1-8b-h100")
    cfg = validate({"engine": {"model_cost": "llama-3.1-8b-h100",
                               "tier_links": {"redis": {"gb_per_s": 10, "latency_ms": 0.2}}}},
                   "test")
    mc = deployment_cost(cfg)
    assert mc is not None
    assert mc.tiers["redis"] == TierLink(bytes_per_s=1e10, latency_s=0.2 / 1000)
    assert mc.tiers["redis"].latency_s == pytest.approx(2e-4, rel=1e-12)
    assert mc.tiers["disk"] == preset.tiers["disk"] == TierLink(6e9, 100e-6)  # the preset's
    assert dataclasses.replace(mc, tiers=preset.tiers) == preset  # nothing else changed
    assert PRESETS["llama-3.1-8b-h100"].tiers["redis"] == TierLink(2.5e9, 0.5e-3)  # untouched
    # Redis at 10 GB/s: the 20 GB/s host link is no longer the slower side, the tier is.
    assert mc.load_s({"redis": 1000}) == pytest.approx(0.2e-3 + 1000 * 131072 / 1e10)
    assert mc.tier_s_per_token("redis") == pytest.approx(131072 / 1e10)
    # A link's latency defaults to 0; a link faster than the host's is capped by the host's.
    cfg = validate({"engine": {"model_cost": "llama-3.1-8b-h100",
                               "tier_links": {"disk": {"gb_per_s": 50}}}}, "test")
    mc = deployment_cost(cfg)
    assert mc is not None and mc.tiers["disk"] == TierLink(5e10, 0.0)
    assert mc.tiers["redis"] == preset.tiers["redis"]
    assert mc.tier_s_per_token("disk") == preset.kv_bytes_per_token / 20e9
    # No tier_links: the preset itself; no model cost: none.
    assert deployment_cost(validate({"engine": {"model_cost": "llama-3.1-8b-h100"}})) == preset
    assert deployment_cost(validate({})) is None


@pytest.mark.parametrize("engine,error", [
    ({"tier_links": {"redis": {"gb_per_s": 10}}},
     "engine: Value error, tier_links are figures of a model cost: set engine.model_cost"),
    ({"model_cost": "llama-3.1-8b-h100", "tier_links": {"memory": {"gb_per_s": 10}}},
     "engine.tier_links.memory"),
    ({"model_cost": "llama-3.1-8b-h100", "tier_links": {"redis": {"gb_per_s": 0}}},
     "engine.tier_links.redis.gb_per_s: Input should be greater than 0"),
    ({"model_cost": "llama-3.1-8b-h100",
      "tier_links": {"redis": {"gb_per_s": 1, "latency_ms": -1}}},
     "engine.tier_links.redis.latency_ms: Input should be greater than or equal to 0"),
    ({"model_cost": "llama-3.1-8b-h100", "tier_links": {"redis": {"latency_ms": 1}}},
     "engine.tier_links.redis.gb_per_s"),
])
def test_tier_links_are_validated(engine: dict[str, Any], error: str) -> None:
    from kvplugin.config import ConfigError, validate

    with pytest.raises(ConfigError) as e:
        validate({"engine": engine}, "test")
    assert error in str(e.value)


@pytest.mark.asyncio
async def test_a_run_reports_the_tier_links_it_ran_with() -> None:
    from kvplugin.engine.run import serve

    cfg = small_config(disk=True, engine={"deterministic": True,
                                          "model_cost": "llama-3.1-8b-h100",
                                          "tier_links": {"disk": {"gb_per_s": 2.5,
                                                                  "latency_ms": 1.5}}})
    out = (await serve(cfg)).as_dict()
    assert out["model_cost_tier_links"] == {"disk": {"gb_per_s": 2.5, "latency_ms": 1.5}}
    assert out["model_cost"] == "llama-3.1-8b-h100"
    plain = small_config(disk=True, engine={"deterministic": True,
                                            "model_cost": "llama-3.1-8b-h100"})
    assert "model_cost_tier_links" not in (await serve(plain)).as_dict()
