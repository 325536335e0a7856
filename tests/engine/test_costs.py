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
