"""The scheduler's rules: chunked prefill under the token budget, running requests first,
max_num_seqs, preemption by recompute, parking while a KV load runs."""

from __future__ import annotations

import asyncio

import pytest
from engine_testlib import (
    GatedReads,
    all_blocks,
    free_blocks,
    record_steps,
    serve_all,
    small_config,
)

from kvplugin.core.request import RequestStatus
from kvplugin.engine.build import deployment

PROMPT = list(range(1000, 1050))  # 50 tokens


@pytest.mark.asyncio
async def test_chunked_prefill_under_the_token_budget() -> None:
    async with deployment(small_config(budget=16)) as dep:
        steps = record_steps(dep)
        res = await serve_all(dep.engine, [("a", PROMPT, "t", 3)])
        assert [[w.num_tokens for w in s] for s in steps] == [[16], [16], [16], [2], [1], [1]]
        assert [w.decode for s in steps for w in s] == [False] * 4 + [True] * 2
        assert len(res["a"].output) == 3 and res["a"].status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert dep.engine.stats.computed_prompt_tokens == 50


@pytest.mark.asyncio
async def test_running_requests_are_served_before_waiting_ones() -> None:
    async with deployment(small_config(budget=16)) as dep:
        steps = record_steps(dep)
        await serve_all(dep.engine, [("a", PROMPT[:20], "t", 2), ("b", PROMPT[20:40], "t", 2)])
        # a takes the whole first budget; then a's rest first, b gets what is left.
        assert [(w.request_id, w.num_tokens) for w in steps[0]] == [("a", 16)]
        assert [(w.request_id, w.num_tokens) for w in steps[1]] == [("a", 4), ("b", 12)]


@pytest.mark.asyncio
async def test_max_num_seqs_caps_the_batch() -> None:
    async with deployment(small_config(seqs=2)) as dep:
        steps = record_steps(dep)
        reqs = [(f"r{i}", [i + 1] * 9 + PROMPT[:6], f"t{i}", 4) for i in range(5)]
        res = await serve_all(dep.engine, reqs)
        assert len(res) == 5
        assert max(len(s) for s in steps) == 2
        assert dep.model.kv_mismatches == 0


@pytest.mark.asyncio
async def test_preemption_recomputes_and_gives_the_same_answers() -> None:
    reqs = [(name, [k] * 3 + PROMPT[:13], "t", 12) for k, name in ((1, "a"), (2, "b"))]
    async with deployment(small_config(blocks=64)) as roomy:
        expected = await serve_all(roomy.engine, reqs)
        assert roomy.engine.stats.preemptions == 0
    # 11 usable blocks of 4 tokens; each request ends at 27 tokens (7 blocks): both cannot
    # run to the end together, so the newer one is preempted and computed again.
    async with deployment(small_config(blocks=12)) as tight:
        got = await serve_all(tight.engine, reqs)
        assert tight.engine.stats.preemptions >= 1
        assert max(r.preemptions for r in got.values()) >= 1
        assert {k: r.output for k, r in got.items()} == {k: r.output for k, r in expected.items()}
        assert tight.model.kv_mismatches == 0
        await tight.mgr.drain()
        assert free_blocks(tight) == all_blocks(tight)


@pytest.mark.asyncio
async def test_a_request_is_parked_while_its_kv_loads() -> None:
    gated: list[GatedReads] = []

    def wrap(tier):  # type: ignore[no-untyped-def]
        gated.append(GatedReads(tier))
        return gated[0]

    async with deployment(small_config(), wrap_tiers=wrap) as dep:
        eng = dep.engine
        await serve_all(eng, [("a", PROMPT, "t", 2)])
        await dep.mgr.drain()
        assert dep.mgr.core.reset_prefix_cache()  # the device forgets; the tier remembers
        gated[0].gate.clear()
        runner = asyncio.get_running_loop().create_task(eng.run())
        b = eng.add_request("b", PROMPT, tenant="t", max_tokens=2)
        c = eng.add_request("c", [7] * 30, tenant="t", max_tokens=2)
        for _ in range(200):
            if "b" in eng.loading:
                break
            await asyncio.sleep(0.005)
        assert eng.loading["b"].req.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        res_c = await asyncio.wait_for(c, 10)  # c runs while b waits for its KV
        assert not b.done() and "b" in eng.loading
        gated[0].gate.set()
        res_b = await asyncio.wait_for(b, 10)
        eng.stop()
        await runner
        assert res_c.status is res_b.status is RequestStatus.FINISHED_LENGTH_CAPPED
        assert eng.stats.parked == 1 and eng.stats.tier_hit_tokens == {"memory": 48}
        assert dep.mgr.stats().loaded_chunks == 12
        # The loaded pages were checked against recomputation (12 blocks), and matched.
        assert dep.model.pages_checked >= 12 and dep.model.kv_mismatches == 0
        assert eng.stats.computed_prompt_tokens == 50 + 30 + 2


@pytest.mark.asyncio
async def test_requests_that_can_never_run_are_refused() -> None:
    async with deployment(small_config(blocks=8)) as dep:
        with pytest.raises(ValueError, match="could never run"):
            dep.engine.add_request("big", list(range(40)), tenant="t", max_tokens=2)
        with pytest.raises(ValueError, match="max_model_len"):
            dep.engine.add_request("long", list(range(2048)), tenant="t", max_tokens=2)


@pytest.mark.asyncio
async def test_a_lookup_made_stale_by_evictions_is_redone_before_admission() -> None:
    # b's lookup sees a's prompt on the device (48 tokens) and so asks the tier for
    # nothing; the device then forgets it. Admitted on that lookup, b would compute all
    # 50 tokens again; looked up again, it loads 48 from the tier.
    async with deployment(small_config()) as dep:
        eng = dep.engine
        await serve_all(eng, [("a", PROMPT, "t", 2)])
        await dep.mgr.drain()
        done = eng.add_request("b", PROMPT, tenant="t", max_tokens=2)
        task = eng.waiting[0].lookup_task
        assert task is not None
        lookup = await asyncio.wait_for(task, 5)
        assert (lookup.local_tokens, lookup.external_tokens) == (48, 0)
        assert dep.mgr.core.reset_prefix_cache()
        runner = asyncio.get_running_loop().create_task(eng.run())
        await asyncio.wait_for(done, 10)
        eng.stop()
        await runner
        assert eng.stats.lookup_refreshes == 1
        assert eng.stats.tier_hit_tokens == {"memory": 48}
        assert eng.stats.computed_prompt_tokens == 50 + 2
        assert dep.model.kv_mismatches == 0 and dep.model.pages_checked == 12
