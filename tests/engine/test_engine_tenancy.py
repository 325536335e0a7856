"""Tenancy in the engine: prefix groups (a member's shared prefix is a hit for the other
members, checked and clean; anyone else gets nothing), the fake model's group KV and its
checks (a leak is still caught), the workload's tenants and groups, and step timings."""

from __future__ import annotations

import asyncio
import random

import numpy as np
import pytest
from engine_testlib import all_blocks, free_blocks, serve_all, small_config

from kvplugin.aio.memory import HostKVMemory, PageShape
from kvplugin.engine.build import deployment
from kvplugin.engine.config import WorkloadConfig
from kvplugin.engine.model import SLICE_BYTES, CheckResult, FakeModel, KVIdentity, Work, _Chain
from kvplugin.engine.workload import generate

SYSTEM = list(range(500, 516))  # the group's shared prefix: 4 blocks of 4 tokens
PROMPT = [*SYSTEM, *range(900, 908)]  # and a private part: 2 more blocks


def _grouped(**sections: dict[str, object]) -> object:
    tenants = {"declared": {"acme": {}, "globex": {}, "initech": {}},
               "prefix_groups": [{"name": "g", "tenants": ["acme", "globex"],
                                  "max_prefix_tokens": 256}]}
    return small_config(tenants=tenants, **sections)  # type: ignore[arg-type]


async def _one(dep: object, rid: str, tenant: str, group: str | None = None) -> None:
    eng = dep.engine  # type: ignore[attr-defined]
    runner = asyncio.get_running_loop().create_task(eng.run())
    try:
        await asyncio.wait_for(eng.generate(
            rid, PROMPT, tenant=tenant, max_tokens=2, prefix_group=group,
            shared_prefix_tokens=len(SYSTEM) if group else 0), 30)
    finally:
        eng.stop()
        await asyncio.wait_for(runner, 30)


# --------------------------------------------------------------------------- the engine


@pytest.mark.asyncio
async def test_a_groups_prefix_is_a_clean_hit_for_members_and_nothing_for_others() -> None:
    async with deployment(_grouped()) as dep:  # type: ignore[arg-type]
        es, model = dep.engine.stats, dep.model
        await _one(dep, "a1", "acme", "g")
        await _one(dep, "b1", "globex", "g")  # another member: the shared prefix hits
        assert es.device_hit_tokens == len(SYSTEM)
        assert model.pages_checked == 4
        assert (model.kv_mismatches, model.cross_tenant_hits) == (0, 0)
        await _one(dep, "c1", "initech")  # not a member, identical prompt: no hit
        await _one(dep, "a2", "acme")  # a member that does not declare the group: none
        assert es.device_hit_tokens == len(SYSTEM)
        await _one(dep, "b2", "globex", "g")  # its own private part too, now
        assert es.device_hit_tokens == len(SYSTEM) + 20
        # From the tier: the group's objects come back for a member, checked and clean.
        await dep.mgr.drain()
        assert dep.mgr.core.reset_prefix_cache()
        await _one(dep, "b3", "globex", "g")
        await _one(dep, "c2", "initech")
        # Each all but its last block: b3 the group's prefix and its own part, c2 its own.
        assert es.tier_hit_tokens == {"memory": 20 + 20}
        assert (model.kv_mismatches, model.cross_tenant_hits) == (0, 0)
        assert model.pages_checked == 4 + 5 + 5 + 5
        await dep.mgr.drain()
        assert free_blocks(dep) == all_blocks(dep)


@pytest.mark.asyncio
async def test_a_bad_group_declaration_is_refused_and_queues_nothing() -> None:
    async with deployment(_grouped()) as dep:
        eng = dep.engine
        with pytest.raises(ValueError, match="go together"):
            eng.add_request("x", PROMPT, tenant="acme", max_tokens=2, shared_prefix_tokens=8)
        with pytest.raises(ValueError, match="not a member"):
            eng.add_request("y", PROMPT, tenant="initech", max_tokens=2, prefix_group="g",
                            shared_prefix_tokens=8)
        with pytest.raises(ValueError, match="unknown prefix group"):
            eng.add_request("z", PROMPT, tenant="acme", max_tokens=2, prefix_group="h",
                            shared_prefix_tokens=8)
        with pytest.raises(ValueError, match="shared_prefix_tokens must be"):
            eng.add_request("w", PROMPT, tenant="acme", max_tokens=2, prefix_group="g")
        assert not eng.has_work() and eng.stats.requests == 0


@pytest.mark.asyncio
async def test_every_step_that_ran_has_its_wall_time() -> None:
    cfg = small_config(engine={"decode_step_ms": 10.0})
    async with deployment(cfg) as dep:
        await serve_all(dep.engine, [("a", list(range(40)), "t", 3),
                                     ("b", list(range(60, 90)), "t", 2)])
        es = dep.engine.stats
        n = es.step_s.count
        assert es.steps >= 3 and n == es.steps and es.step_s.is_exact
        # The model's (awaited) time is part of a step: every step that decodes took it
        # (the two longest steps at least), and none took long.
        assert es.step_s.percentile(100 * (n - 2) / n) >= 0.01 and es.step_s.max < 5


# --------------------------------------------------------------------------- the model

PAGE = PageShape(num_layers=2, num_kv_heads=1, head_size=8, dtype="float16", block_size=4)
WIDE = PageShape(num_layers=2, num_kv_heads=2, head_size=16, dtype="float16", block_size=4)


def test_group_kv_is_shared_by_members_only_and_a_leak_is_still_caught() -> None:
    model = FakeModel(HostKVMemory(16, [PAGE]))
    tokens = list(range(50, 62))  # 3 blocks; the first 8 tokens are the group's
    model.add("a", list(tokens), "acme", None, prefix_group="g", shared_prefix_tokens=8)
    model.add("b", list(tokens), "globex", None, prefix_group="g", shared_prefix_tokens=8)
    model.add("c", list(tokens), "initech", None)
    asyncio.run(model.execute([Work("a", 0, 12, ([1, 2, 3],))]))
    shared = model.check("b", ([1, 2, 3],), 0, 8)  # a member on a's shared blocks: clean
    assert (shared.pages, shared.mismatches, shared.cross_tenant) == (2, 0, 0)
    private = model.check("b", ([1, 2, 3],), 8, 12)  # a's own part: another tenant's KV
    assert (private.pages, private.mismatches, private.cross_tenant) == (1, 1, 1)
    outsider = model.check("c", ([1, 2, 3],), 0, 8)  # the group's KV, to a non-member
    assert (outsider.pages, outsider.mismatches, outsider.cross_tenant) == (2, 2, 2)
    assert (model.kv_mismatches, model.cross_tenant_hits) == (3, 3)


def test_a_shared_prefix_ending_inside_a_block_splits_that_block() -> None:
    model = FakeModel(HostKVMemory(16, [PAGE]))
    tokens = list(range(50, 62))
    model.add("a", list(tokens), "acme", None, prefix_group="g", shared_prefix_tokens=6)
    model.add("b", list(tokens), "globex", None, prefix_group="g", shared_prefix_tokens=6)
    asyncio.run(model.execute([Work("a", 0, 12, ([1, 2, 3],))]))
    res = model.check("b", ([1, 2, 3],), 0, 8)  # block 1 holds a's tokens 6 and 7
    assert (res.pages, res.mismatches, res.cross_tenant) == (2, 1, 1)


@pytest.mark.parametrize("offset", [0, 5, 16, 31])  # in a slot's value, then its template
def test_one_flipped_byte_anywhere_in_a_slot_is_a_mismatch(offset: int) -> None:
    model = FakeModel(HostKVMemory(16, [WIDE]))  # 64-byte slots: 16 of value, 48 of template
    model.add("a", list(range(8)), "acme", None)
    asyncio.run(model.execute([Work("a", 0, 8, ([3, 4],))]))
    assert model.check("a", ([3, 4],), 0, 8).mismatches == 0
    slot = 64 * 6 + offset  # (K, layer 1, token 2)
    model.memory.pages(0, [4])[0, slot] ^= 0x10
    res = model.check("a", ([3, 4],), 0, 8)
    assert (res.pages, res.mismatches, res.cross_tenant) == (2, 1, 0)


def test_a_page_written_into_the_wrong_layer_is_a_mismatch() -> None:
    model = FakeModel(HostKVMemory(16, [WIDE]))
    model.add("a", list(range(8)), "acme", None)
    asyncio.run(model.execute([Work("a", 0, 8, ([3, 4],))]))
    page = model.memory.pages(0, [3])[0].reshape(2, 2, -1)
    page[:, [0, 1]] = page[:, [1, 0]]  # layers swapped: every byte is still someone's KV
    assert model.check("a", ([3, 4],), 0, 8).mismatches == 1


def test_big_writes_and_checks_let_the_loop_run_between_slices() -> None:
    big = PageShape(num_layers=2, num_kv_heads=4, head_size=128, dtype="float16",
                    block_size=16)  # 64 KiB pages: 16 to a slice
    assert SLICE_BYTES // big.page_bytes == 16
    model = FakeModel(HostKVMemory(80, [big]))
    ids = list(range(70, 6, -1))  # 64 blocks, not consecutive in memory order
    model.add("a", list(range(1024)), "acme", None)
    seen: list[tuple[str, int]] = []

    async def main() -> CheckResult:
        ticks = 0
        stop = asyncio.Event()

        async def ticker() -> None:  # counts the loop's turns
            nonlocal ticks
            while not stop.is_set():
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.get_running_loop().create_task(ticker())
        await asyncio.sleep(0)

        async def then() -> None:  # runs once every page is written
            seen.append(("then", int(model.check("a", (ids,), 0, 1024).mismatches)))

        await model.execute([Work("a", 0, 1024, (ids,))], then=then)
        seen.append(("writes", ticks))
        model.memory.pages(0, [ids[50]])[0, 40000] ^= 1  # in the fourth slice
        before = ticks
        res = await model.acheck("a", (ids,), 0, 1024)
        seen.append(("check", ticks - before))
        stop.set()
        await task
        return res

    res = asyncio.run(main())
    assert res == CheckResult(64, 1, 0)
    assert seen[0] == ("then", 0)
    assert seen[1][1] >= 3 and seen[2][1] >= 3  # 4 slices each: the loop ran in between


def test_token_values_are_the_same_one_by_one_and_in_bulk() -> None:
    rng = random.Random(5)
    tokens = [rng.randrange(32000) for _ in range(300)]
    for ident in (KVIdentity("acme"), KVIdentity("acme", "lora1", "g", 45)):
        bulk = _Chain(ident, tokens).values(0, 300)
        single = _Chain(ident, tokens)
        one = np.concatenate([single.values(t, t + 1) for t in range(300)])
        assert np.array_equal(bulk, one)
        assert np.array_equal(_Chain(ident, tokens).values(33, 37), bulk[33:37])


def test_a_tokens_value_depends_on_every_token_before_it() -> None:
    tokens = list(range(100))
    base = _Chain(KVIdentity("acme"), tokens).values(0, 100)
    for changed in (0, 31, 32, 70):
        other = list(tokens)
        other[changed] += 1
        vals = _Chain(KVIdentity("acme"), other).values(0, 100)
        assert np.array_equal(vals[:changed], base[:changed])
        assert not (vals[changed:] == base[changed:]).all(axis=1).any()


def test_identity_refuses_half_a_group_declaration() -> None:
    with pytest.raises(ValueError, match="go together"):
        KVIdentity("acme", group="g")
    with pytest.raises(ValueError, match="go together"):
        KVIdentity("acme", shared=8)


# --------------------------------------------------------------------------- the workload


def test_workload_uses_the_given_tenants_and_declares_their_groups() -> None:
    w = WorkloadConfig(num_requests=80, seed=2, follow_up_prob=0.4, resend_prob=0.1)
    specs = generate(w, max_prompt_len=2000, tenants=["acme", "globex", "initech"],
                     prefix_groups={"g": ["acme", "globex"]})
    assert {s.tenant for s in specs} == {"acme", "globex", "initech"}
    for s in specs:
        if s.tenant == "initech":
            assert (s.prefix_group, s.shared_prefix_tokens) == (None, 0)
        else:
            assert s.prefix_group == "g"
            assert w.system_prompt_len[0] <= s.shared_prefix_tokens <= w.system_prompt_len[1]
            assert s.shared_prefix_tokens <= s.prompt_len
    by_id = {s.request_id: s for s in specs}
    children = [s for s in specs if s.after is not None]
    assert children and all(s.shared_prefix_tokens == by_id[s.after].shared_prefix_tokens
                            for s in children)
    with pytest.raises(ValueError, match="not one of the workload's tenants"):
        generate(w, max_prompt_len=2000, tenants=["acme"], prefix_groups={"g": ["globex"]})
    default = generate(w, max_prompt_len=2000)
    assert {s.tenant for s in default} == {f"tenant{i}" for i in range(w.num_tenants)}
    assert all(s.prefix_group is None for s in default)
