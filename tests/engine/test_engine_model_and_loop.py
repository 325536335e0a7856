"""The fake model's KV and its checks (they must catch wrong bytes and other tenants' bytes),
the loop-thread adapter for synchronous engines, and the loop-lag probe."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest
from engine_testlib import serve_all, small_config

from kvplugin.aio.loop import LoopThread, new_event_loop, uvloop_available
from kvplugin.aio.memory import HostKVMemory, PageShape
from kvplugin.engine.build import deployment
from kvplugin.engine.loop import LagProbe
from kvplugin.engine.model import FakeModel, StepCosts, Work
from kvplugin.engine.threaded import EngineThread

SHAPE = PageShape(num_layers=2, num_kv_heads=1, head_size=8, dtype="float16", block_size=4)


def _model() -> FakeModel:
    return FakeModel(HostKVMemory(16, [SHAPE]), StepCosts())


def test_checks_catch_wrong_bytes_and_other_tenants_kv() -> None:
    model = _model()
    tokens = list(range(50, 62))  # 3 blocks
    model.add("a", list(tokens), "acme", None)
    model.add("b", list(tokens), "globex", None)
    asyncio.run(model.execute([Work("a", 0, 12, ([1, 2, 3],)), Work("b", 0, 12, ([4, 5, 6],))]))
    assert model.check("a", ([1, 2, 3],), 0, 12).mismatches == 0
    # b's blocks hold the same tokens for another tenant: a hit on them is a leak.
    leak = model.check("a", ([4, 5, 6],), 0, 12)
    assert (leak.pages, leak.mismatches, leak.cross_tenant) == (3, 3, 3)
    # One flipped byte is a mismatch, not a cross-tenant hit.
    model.memory.pages(0, [2])[0, 100] ^= 1
    bad = model.check("a", ([1, 2, 3],), 4, 12)
    assert (bad.pages, bad.mismatches, bad.cross_tenant) == (2, 1, 0)
    assert (model.kv_mismatches, model.cross_tenant_hits) == (4, 3)


def test_kv_is_a_function_of_tenant_adapter_and_prefix() -> None:
    model = _model()
    model.add("a", [1, 2, 3, 4, 5], "acme", None)
    model.add("b", [1, 2, 3, 4, 9], "acme", None)
    model.add("c", [1, 2, 3, 4, 5], "acme", "adapter1")
    sampled = asyncio.run(model.execute([Work("a", 0, 5, ([1, 2],)), Work("b", 0, 5, ([3, 4],)),
                                         Work("c", 0, 5, ([5, 6],))]))
    rows = [model.memory.pages(0, [i])[0] for i in (1, 3, 5)]
    assert np.array_equal(rows[0], rows[1])  # same tenant, same first 4 tokens
    assert not np.array_equal(rows[0], rows[2])  # the adapter changes the KV
    assert all(isinstance(t, int) for t in sampled) and sampled[0] != sampled[1]


def test_steps_take_their_simulated_time() -> None:
    model = FakeModel(HostKVMemory(16, [SHAPE]), StepCosts(prefill_token_s=0.002,
                                                           decode_step_s=0.03))
    model.add("a", list(range(20)), "t", None)
    t0 = time.perf_counter()
    asyncio.run(model.execute([Work("a", 0, 10, ([1, 2, 3],))]))
    assert time.perf_counter() - t0 >= 0.02
    assert model.costs.of(10, 1) == pytest.approx(0.05)


def test_the_loop_thread_serves_synchronous_callers() -> None:
    with EngineThread(small_config()) as et:
        assert et.thread.loop is not None and et.thread.running
        answers: dict[str, tuple[int, ...]] = {}

        def client(i: int) -> None:  # plain threads block for their answers
            res = et.generate(f"r{i}", [i + 1] * 12, tenant="t", max_tokens=3)
            answers[res.request_id] = res.output

        threads = [threading.Thread(target=client, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert sorted(answers) == ["r0", "r1", "r2", "r3"]
        assert all(len(o) == 3 for o in answers.values())
        # The same prompt again hits the device cache on the loop thread's engine.
        et.generate("again", [1] * 12, tenant="t", max_tokens=3)
        assert et.dep.engine.stats.device_hit_tokens == 8
    assert not et.thread.running
    with pytest.raises(RuntimeError, match="closed"):
        et.thread.submit(asyncio.sleep(0))


def test_loop_thread_call_raises_the_coroutines_error() -> None:
    async def boom() -> None:
        raise KeyError("x")

    with LoopThread(use_uvloop=False) as lt, pytest.raises(KeyError):
        lt.call(boom(), timeout=5)


def test_uvloop_is_used_when_installed() -> None:
    loop = new_event_loop(use_uvloop=True)
    try:
        assert (type(loop).__module__.startswith("uvloop")) == uvloop_available()
    finally:
        loop.close()
    plain = new_event_loop(use_uvloop=False)
    try:
        assert type(plain).__module__.startswith("asyncio")
    finally:
        plain.close()


@pytest.mark.asyncio
async def test_the_lag_probe_sees_a_blocked_loop() -> None:
    probe = LagProbe(0.002)
    probe.start()
    await asyncio.sleep(0.02)
    time.sleep(0.05)  # blocks the loop on purpose
    await asyncio.sleep(0.01)
    await probe.stop()
    assert probe.percentile(100) >= 0.04
    assert probe.percentile(50) < 0.04


@pytest.mark.asyncio
async def test_engine_serves_many_tenants_on_one_loop() -> None:
    async with deployment(small_config(seqs=4)) as dep:
        reqs = [(f"r{i}", [i % 3] * 20, f"t{i % 2}", 2) for i in range(8)]
        res = await serve_all(dep.engine, reqs)
        assert len(res) == 8 and dep.model.kv_mismatches == 0
