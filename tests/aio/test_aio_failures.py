"""Load failures keep the longest verified prefix and recompute the rest (or fail the
request); slow or broken tiers are misses; stores over budget are shed, never queued."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from aio_testlib import (
    BS,
    FakeModel,
    Gated,
    admit,
    all_blocks,
    evict_device_cache,
    free_blocks,
    make_manager,
    serve,
)

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import LoadFailurePolicy, LoadStatus
from kvplugin.connectors.faults import FaultInjector, FaultPlan
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.request import RequestStatus

PROMPT = list(range(100, 130))  # 7 full blocks below the one-token cap


async def _stored(mgr: AsyncKVManager, model: FakeModel, tenant: str = "acme") -> None:
    await serve(mgr, model, mgr.new_request("a", PROMPT, tenant=tenant))
    await mgr.drain()
    evict_device_cache(mgr)


def _chunk_keys(mgr: AsyncKVManager, first: int, stop: int) -> list:  # type: ignore[type-arg]
    probe = mgr.new_request(f"probe{first}", PROMPT, tenant="acme")
    keys = mgr.keyspace.chunk_keys("acme", 0, probe.block_hashes, first, stop)
    mgr.finish(probe)
    return keys


@pytest.mark.asyncio
async def test_corrupt_chunk_keeps_the_verified_prefix_and_recomputes() -> None:
    mem = MemoryConnector(capacity_bytes=16 << 20)
    async with make_manager(connector=mem) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model)
        (bad,) = _chunk_keys(mgr, 3, 4)
        await mem.write_raw(bad, b"\x00" * 100, timeout=1)
        b = mgr.new_request("b", PROMPT, tenant="acme")
        found = await mgr.lookup(b)
        assert found.external_tokens == 28  # a lookup cannot see damage, a load does
        adm = mgr.allocate(b, found)
        assert adm is not None and adm.loading
        outcome = await mgr.wait_load(b)
        assert outcome.status is LoadStatus.PARTIAL
        assert (outcome.loaded_tokens, b.num_computed_tokens) == (3 * BS, 3 * BS)
        assert b.status is RequestStatus.WAITING
        assert model.check_pages(b, 3 * BS) == 3
        # The published prefix is exactly the verified one.
        probe = mgr.new_request("p", PROMPT, tenant="acme")
        assert (await mgr.lookup(probe)).local_tokens == 3 * BS
        mgr.finish(probe)
        # Recompute the rest; the recomputed chunks are stored again.
        rest = mgr.allocate(b)
        assert rest is not None and rest.num_new_tokens == len(PROMPT) - 3 * BS
        model.step(b, rest.num_new_tokens)
        mgr.after_step([b])
        assert model.check_pages(b, 28) == 7
        mgr.finish(b)
        await mgr.drain()
        assert mem.stats().corrupt_detected == 1
        stats = mgr.stats()
        assert stats.loads_failed == 1 and stats.recomputed_tokens == 16
        evict_device_cache(mgr)
        c = mgr.new_request("c", PROMPT, tenant="acme")
        adm = await serve(mgr, model, c, finish=False)
        assert adm.external_tokens == 28 and mgr.load_outcome(c) is not None
        assert model.check_pages(c, 28) == 7
        mgr.finish(c)
        assert free_blocks(mgr) == all_blocks(mgr)


@pytest.mark.asyncio
async def test_object_evicted_after_the_lookup_is_a_shorter_load() -> None:
    mem = MemoryConnector(capacity_bytes=16 << 20)
    async with make_manager(connector=mem) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model)
        b = mgr.new_request("b", PROMPT, tenant="acme")
        found = await mgr.lookup(b)
        assert await mem.delete(_chunk_keys(mgr, 5, 6), timeout=1) == 1
        mgr.allocate(b, found)
        outcome = await mgr.wait_load(b)
        assert (outcome.status, outcome.loaded_tokens) == (LoadStatus.PARTIAL, 5 * BS)
        assert model.check_pages(b, 5 * BS) == 5
        mgr.finish(b)
        assert free_blocks(mgr) == all_blocks(mgr)


@pytest.mark.asyncio
async def test_fail_policy_fails_the_request_and_publishes_nothing() -> None:
    mem = MemoryConnector(capacity_bytes=16 << 20)
    async with make_manager(connector=mem,
                            load_failure_policy=LoadFailurePolicy.FAIL) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model)
        await mem.write_raw(_chunk_keys(mgr, 6, 7)[0], b"junk", timeout=1)
        b = mgr.new_request("b", PROMPT, tenant="acme")
        mgr.allocate(b, await mgr.lookup(b))
        outcome = await mgr.wait_load(b)
        assert outcome.status is LoadStatus.FAILED
        assert b.status is RequestStatus.FINISHED_ERROR
        probe = mgr.new_request("p", PROMPT, tenant="acme")
        assert (await mgr.lookup(probe)).local_tokens == 0
        mgr.finish(probe)
        assert mgr.finish(b) is False
        assert free_blocks(mgr) == all_blocks(mgr) and mgr.num_pending_jobs == 0


@pytest.mark.asyncio
async def test_a_slow_lookup_is_a_miss_within_its_deadline() -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 << 20))
    async with make_manager(connector=gated, lookup_timeout=0.05) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model)
        gated.hold("lookup")
        b = mgr.new_request("b", PROMPT, tenant="acme")
        t0 = time.monotonic()
        found = await mgr.lookup(b)
        assert time.monotonic() - t0 < 1.0
        assert found.timed_out and found.external_tokens == 0
        assert mgr.stats().lookup_timeouts == 1
        adm = mgr.allocate(b, found)
        assert adm is not None and not adm.loading and adm.num_new_tokens == len(PROMPT)
        gated.open("lookup")
        mgr.finish(b)


@pytest.mark.asyncio
async def test_a_slow_load_times_out_and_the_request_recomputes() -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 << 20))
    async with make_manager(connector=gated, load_timeout=0.05) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model)
        gated.hold("get")
        b = mgr.new_request("b", PROMPT, tenant="acme")
        mgr.allocate(b, await mgr.lookup(b))
        outcome = await mgr.wait_load(b)
        assert (outcome.status, outcome.loaded_tokens) == (LoadStatus.PARTIAL, 0)
        assert b.num_computed_tokens == 0 and free_blocks(mgr) == all_blocks(mgr)
        gated.open("get")
        # It starts over without the tier (which just failed it) and is computed locally.
        assert (await mgr.lookup(b)).external_tokens == 0
        adm = await serve(mgr, model, b, finish=False)
        assert adm.local_tokens == 0 and not adm.loading
        assert model.check_pages(b, 28) == 7
        mgr.finish(b)


@pytest.mark.asyncio
async def test_a_dead_tier_is_a_miss_and_stores_fail_counted() -> None:
    broken = FaultInjector(MemoryConnector(capacity_bytes=16 << 20),
                           FaultPlan(error_rate=1.0), seed=1)
    async with make_manager(connector=broken) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model)
        assert mgr.stats().stores_failed == 7 and mgr.stats().stored_chunks == 0
        b = mgr.new_request("b", PROMPT, tenant="acme")
        found = await mgr.lookup(b)
        assert found.external_tokens == 0 and not found.timed_out
        mgr.finish(b)


@pytest.mark.asyncio
async def test_stores_over_the_byte_budget_are_shed_not_queued() -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 << 20))
    async with make_manager(connector=gated, store_budget_bytes=2 * 256) as mgr:
        page = mgr.memory.page_bytes(0)
        assert page == 256
        model = FakeModel(mgr)
        gated.hold("put")
        a = mgr.new_request("a", PROMPT, tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        assert mgr.after_step([a]) == 2
        assert mgr.store_bytes_in_flight == 2 * page
        assert mgr.stats().stores_shed == 5
        gated.open("put")
        await mgr.drain()
        assert mgr.store_bytes_in_flight == 0 and mgr.stats().stored_chunks == 2
        mgr.finish(a)


@pytest.mark.asyncio
async def test_identical_prefixes_in_flight_are_stored_once() -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 << 20))
    async with make_manager(connector=gated) as mgr:
        model = FakeModel(mgr)
        gated.hold("put")
        a = mgr.new_request("a", PROMPT, tenant="acme")
        b = mgr.new_request("b", [*PROMPT, 9], tenant="acme")
        for r in (a, b):
            _, step = await admit(mgr, r)
            model.step(r, step.num_new_tokens)
        # b hit a's 7 blocks on the device: it offers nothing it did not compute.
        assert mgr.after_step([a, b]) == 7
        assert mgr.stats().stores_deduplicated == 0
        mgr.finish(a)
        mgr.finish(b)
        # a's stores are still in flight when the device forgets the prefix: c computes it
        # again, and its chunks are not stored a second time.
        evict_device_cache(mgr)
        c = mgr.new_request("c", PROMPT, tenant="acme")
        adm = mgr.allocate(c)
        assert adm is not None and adm.local_tokens == 0
        model.step(c, adm.num_new_tokens)
        assert mgr.after_step([c]) == 0
        assert mgr.stats().stores_deduplicated == 7
        gated.open("put")
        mgr.finish(c)
        await mgr.drain()
        assert mgr.stats().stored_chunks == 7 and gated.calls["put"] == 1
        assert free_blocks(mgr) == all_blocks(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("seed", range(4))
async def test_faulty_tier_never_yields_a_wrong_byte(seed: int) -> None:
    """Errors, latency, dropped and corrupted writes, concurrent requests sharing prefixes,
    device eviction under pressure: every loaded page equals its recomputation, and
    nothing leaks."""
    plan = FaultPlan(error_rate=0.1, latency_rate=0.3, latency=0.003, drop_write_rate=0.1,
                     corrupt_write_rate=0.15)
    faulty = FaultInjector(MemoryConnector(capacity_bytes=64 << 10), plan, seed=seed)
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(8, 24))] for _ in range(3)]
    async with make_manager(num_blocks=64, connector=faulty, lookup_timeout=0.5,
                            load_timeout=0.5) as mgr:
        model = FakeModel(mgr)

        async def one(i: int) -> int:
            prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(9))]
            req = mgr.new_request(f"r{i}", prompt, tenant=rng.choice(["t1", "t2"]))
            await asyncio.sleep(rng.random() * 0.002)
            adm, step = await admit(mgr, req, budget=rng.choice([None, 8]))
            loaded = adm.external_tokens if adm.loading else 0
            checked = model.check_pages(req, req.num_computed_tokens)
            while req.num_output_tokens < 2:
                model.step(req, step.num_new_tokens)
                mgr.after_step([req])
                if req.num_output_tokens < 2:
                    nxt = mgr.allocate(req, num_new_tokens=8)
                    assert nxt is not None
                    step = nxt
            checked += model.check_pages(req, req.num_computed_tokens)
            req.status = RequestStatus.FINISHED_STOPPED
            mgr.finish(req)
            return loaded + checked

        for wave in range(8):
            await asyncio.gather(*(one(wave * 4 + j) for j in range(4)))
            if wave % 2:
                await mgr.drain()
                evict_device_cache(mgr)  # later waves must come back from the tier
        await mgr.drain()
        stats = mgr.stats()
        assert stats.loads > 0 and stats.stored_chunks > 0
        assert free_blocks(mgr) == all_blocks(mgr)
        assert mgr.num_pending_jobs == 0 and mgr.num_held_blocks == 0
