"""Hybrid layouts on the engine: full attention + sliding window and full attention + Mamba
"align", served end to end with offload (tier hits, every hit, load and resumed state
checked), on faulty tiers too; and the model's checks catch a corrupted window page and a
wrong Mamba state, so the counters the runs assert on can fail."""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from engine_testlib import small_config

from kvplugin.aio.memory import HostKVMemory, PageShape, StateShape
from kvplugin.connectors.base import Connector
from kvplugin.connectors.faults import FaultInjector, FaultPlan
from kvplugin.engine.build import TierWrapper, deployment
from kvplugin.engine.config import RunConfig
from kvplugin.engine.model import FakeModel, Work
from kvplugin.engine.report import RunReport
from kvplugin.engine.run import drive, max_prompt_len, report
from kvplugin.engine.served import Served
from kvplugin.engine.workload import RequestSpec, generate

WINDOW = {"kind": "sliding_window", "sliding_window": 16}
MAMBA = {"kind": "mamba", "mode": "align", "block_size": 16}
# Short prompts sharing system prompts and documents: a 120-block pool of 4-token blocks
# keeps only part of them, so evicted prefixes come back from the tiers.
WORKLOAD = {"num_requests": 40, "seed": 3, "requests_per_s": 2000.0,
            "system_prompt_len": [16, 48], "user_len": [4, 24], "output_len": [1, 8],
            "document_len": [24, 64], "follow_up_prob": 0.4, "resend_prob": 0.15}


def _hybrid(other: dict[str, Any], **workload: Any) -> RunConfig:
    layout: dict[str, Any] = {"groups": [{"kind": "full"}, other]}
    if other["kind"] == "mamba":
        layout["prefix_match_unit"] = 4  # states at sub-block boundaries: partial tails
    return small_config(blocks=120, disk=True, layout=layout,
                        workload={**WORKLOAD, **workload})


def _again(specs: list[RequestSpec]) -> list[RequestSpec]:
    """The same traffic once more, under new request ids."""
    return [replace(s, request_id=f"{s.request_id}+",
                    after=None if s.after is None else f"{s.after}+") for s in specs]


async def _serve_twice(cfg: RunConfig, wrap: TierWrapper | None = None) -> RunReport:
    """The workload (under pool pressure: the device evicts, the tiers answer), then the
    device cache dropped and the same traffic again: every stored prefix, window and state
    can only come back from the tiers, whatever the timing of the first pass was."""
    async with deployment(cfg, wrap_tiers=wrap) as dep:
        specs = generate(cfg.workload, max_prompt_len=max_prompt_len(dep, cfg))
        served = Served()
        await drive(dep.engine, specs, on_finish=served.finished, on_feed=served.fed)
        await dep.mgr.drain()
        assert dep.mgr.core.reset_prefix_cache()
        await drive(dep.engine, _again(specs), on_finish=served.finished, on_feed=served.fed)
        await dep.mgr.drain()
    return report(dep, served, 0.0)


def _assert_clean(out: RunReport, requests: int) -> None:
    assert out.finished == out.requests == requests and out.failed == 0
    assert out.kv_mismatches == 0 and out.cross_tenant_hits == 0
    assert out.leaked_blocks == 0


@pytest.mark.asyncio
async def test_sliding_window_hybrid_serves_with_tier_hits() -> None:
    out = await _serve_twice(_hybrid(WINDOW))
    _assert_clean(out, 80)
    assert out.tier_hits > 0 and out.loads > 0
    assert out.extra["pages_checked"] > 0
    assert out.extra["states_checked"] == 0  # no state group


@pytest.mark.asyncio
async def test_mamba_hybrid_stores_and_restores_boundary_states() -> None:
    out = await _serve_twice(_hybrid(MAMBA))
    _assert_clean(out, 80)
    assert out.tier_hits > 0
    x = out.extra
    assert x["stored_states"] > 0 and x["loaded_states"] > 0
    assert x["restored_states"] > 0  # requests resumed from a loaded state...
    assert x["states_checked"] >= x["restored_states"]  # ...each checked when read
    assert x["restored_partial_states"] > 0  # some inside a Mamba block (partial tails)
    assert x["state_mismatches"] == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("other", [WINDOW, MAMBA], ids=["window", "mamba"])
async def test_faulty_tiers_cost_hybrid_hits_never_correctness(other: dict[str, Any]) -> None:
    plan = FaultPlan(error_rate=0.1, latency_rate=0.2, latency=0.005, drop_write_rate=0.1,
                     corrupt_write_rate=0.15)
    faulty: list[FaultInjector] = []

    def wrap(tier: Connector) -> Connector:
        faulty.append(FaultInjector(tier, plan, seed=len(faulty) + 1))
        return faulty[-1]

    out = await _serve_twice(_hybrid(other), wrap)
    _assert_clean(out, 80)
    assert out.loads > 0 and out.tier_hits > 0
    injected = [f.injected for f in faulty]
    assert sum(i.errors for i in injected) > 0 and sum(i.corrupted for i in injected) > 0


# --------------------------------------------------------------------------- the checks

PAGE = PageShape(num_layers=2, num_kv_heads=1, head_size=8, dtype="float16", block_size=4)
WINDOW_PAGE = PageShape(num_layers=2, num_kv_heads=1, head_size=8, dtype="float16",
                        block_size=4, window=8)
STATE = StateShape(num_layers=2, layer_bytes=40, block_size=8)


def _model(*shapes: PageShape | StateShape) -> FakeModel:
    return FakeModel(HostKVMemory(32, list(shapes)))


def test_window_checks_skip_null_blocks_and_catch_corrupt_or_missing_pages() -> None:
    model = _model(PAGE, WINDOW_PAGE)
    model.add("a", list(range(40, 56)), "acme", None)  # 4 blocks
    asyncio.run(model.execute([Work("a", 0, 16, ([1, 2, 3, 4], [5, 6, 7, 8]))]))
    # Token 16 attends to [9, 16]: window blocks 0 and 1 may be null (never checked).
    ok = model.check("a", ([1, 2, 3, 4], [0, 0, 7, 8]), 0, 16)
    assert (ok.pages, ok.mismatches) == (4 + 2, 0)
    # A corrupted byte in a window page is a mismatch.
    model.memory.pages(1, [7])[0, 3] ^= 0x40
    bad = model.check("a", ([1, 2, 3, 4], [0, 0, 7, 8]), 0, 16)
    assert (bad.pages, bad.mismatches, bad.cross_tenant) == (6, 1, 0)
    # A null block inside the window is KV the next token needs and nobody wrote.
    missing = model.check("a", ([1, 2, 3, 4], [0, 0, 0, 8]), 0, 16)
    assert missing.mismatches == 1
    assert model.kv_mismatches == 2


def test_a_wrong_or_foreign_mamba_state_is_caught_when_read() -> None:
    model = _model(PAGE, STATE)
    tokens = list(range(70, 90))
    model.add("a", list(tokens), "acme", None)
    model.add("b", list(tokens), "globex", None)
    # Chunks end on the state block (8 tokens): the state after 8 tokens sits in slot 0.
    asyncio.run(model.execute([Work("a", 0, 8, ([1, 2], [3])),
                               Work("b", 0, 8, ([4, 5], [6]))]))
    asyncio.run(model.execute([Work("a", 8, 4, ([1, 2, 9], [3, 10]))]))  # reads slot 0
    assert (model.states_checked, model.kv_mismatches) == (1, 0)
    # Resuming a from b's state (same tokens, another tenant) is a leak.
    asyncio.run(model.execute([Work("a", 8, 4, ([1, 2, 9], [6, 11]))]))
    assert (model.state_mismatches, model.cross_tenant_hits) == (1, 1)
    # A state one token off (written after 12 tokens, read as the one after 8) is wrong.
    asyncio.run(model.execute([Work("a", 8, 4, ([1, 2, 9], [10, 12]))]))
    assert (model.state_mismatches, model.cross_tenant_hits) == (2, 1)
    # A null slot where the state should be is a mismatch too, not a crash.
    asyncio.run(model.execute([Work("a", 8, 4, ([1, 2, 9], [0, 13]))]))
    assert model.state_mismatches == model.kv_mismatches == 3
