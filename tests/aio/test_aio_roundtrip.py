"""End to end on MemoryConnector: computed, stored, evicted from the device, loaded back by an
identical request, and the loaded bytes are exactly what a recomputation writes."""

from __future__ import annotations

import pytest
from aio_testlib import (
    BS,
    FakeModel,
    all_blocks,
    evict_device_cache,
    free_blocks,
    make_manager,
    serve,
)

from kvplugin.aio.values import LoadStatus, StoreMode
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.tiered import TieredConnector

PROMPT = list(range(100, 130))  # 30 tokens: 7 full blocks of 4, a claim of 28 at most


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", [StoreMode.COPY, StoreMode.HOLD])
async def test_stored_blocks_come_back_byte_exact(mode: StoreMode) -> None:
    async with make_manager(store_mode=mode) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", PROMPT, tenant="acme")
        first = await serve(mgr, model, a, outputs=2)
        assert first.local_tokens == 0 and first.external_tokens == 0
        await mgr.drain()
        stats = mgr.stats()
        # 32 computed tokens at finish (30 prompt + 2 outputs, the last one has no KV): 7 blocks
        assert stats.stored_chunks == 7 and stats.stores_shed == 0
        evict_device_cache(mgr)

        b = mgr.new_request("b", PROMPT, tenant="acme")
        found = await mgr.lookup(b)
        assert (found.local_tokens, found.external_tokens) == (0, 28)
        adm = mgr.allocate(b, found)
        assert adm is not None and adm.loading and adm.num_new_tokens == 0
        assert adm.external_by_tier == {"memory": 28}
        outcome = await mgr.wait_load(b)
        assert outcome.status is LoadStatus.LOADED
        assert (outcome.loaded_tokens, b.num_computed_tokens) == (28, 28)
        assert model.check_pages(b, 28) == 7
        # Published only now, and exactly the loaded prefix: a third request hits it locally.
        c = mgr.new_request("c", PROMPT, tenant="acme")
        assert (await mgr.lookup(c)).local_tokens == 28
        rest = mgr.allocate(b)
        assert rest is not None and rest.num_new_tokens == 2
        mgr.finish(b)
        mgr.finish(c)
        await mgr.drain()
        assert free_blocks(mgr) == all_blocks(mgr) and mgr.num_pending_jobs == 0
        stats = mgr.stats()
        assert stats.loads == 1 and stats.loaded_chunks == 7 and stats.loads_failed == 0
        assert stats.hit_tokens_by_tier == {"memory": 28} and stats.external_hit_tokens == 28


@pytest.mark.asyncio
async def test_external_hit_extends_a_shorter_local_hit() -> None:
    async with make_manager(num_blocks=24) as mgr:
        model = FakeModel(mgr)
        await serve(mgr, model, mgr.new_request("a", PROMPT, tenant="acme"))
        await mgr.drain()
        evict_device_cache(mgr)
        # Re-warm only the first 3 blocks on the device.
        await serve(mgr, model, mgr.new_request("w", PROMPT[:13], tenant="acme"), outputs=1)
        b = mgr.new_request("b", [*PROMPT, 1, 2, 3], tenant="acme")
        adm = await serve(mgr, model, b, finish=False)
        assert (adm.local_tokens, adm.external_tokens) == (3 * BS, 4 * BS)
        assert model.check_pages(b, 28) == 7
        mgr.finish(b)
        await mgr.drain()
        assert free_blocks(mgr) == all_blocks(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize(("block_sizes", "chunk_blocks"), [((4, 4), 1), ((4, 8), 1),
                                                           ((4,), 3), ((4, 8), 2)])
async def test_several_groups_and_chunk_sizes(block_sizes: tuple[int, ...],
                                              chunk_blocks: int) -> None:
    async with make_manager(num_blocks=48, block_sizes=block_sizes,
                            chunk_blocks=chunk_blocks) as mgr:
        model = FakeModel(mgr)
        prompt = list(range(500, 553))  # 53 tokens
        await serve(mgr, model, mgr.new_request("a", prompt, tenant="t1"), budget=16)
        await mgr.drain()
        evict_device_cache(mgr)
        b = mgr.new_request("b", prompt, tenant="t1")
        adm = await serve(mgr, model, b, finish=False)
        align = mgr.layout.alignment
        assert adm.external_tokens == 52 // align * align > 0
        assert model.check_pages(b, adm.external_tokens) > 0
        mgr.finish(b)
        await mgr.drain()
        assert free_blocks(mgr) == all_blocks(mgr) and mgr.num_held_blocks == 0


@pytest.mark.asyncio
async def test_hits_are_attributed_to_the_tier_that_serves_them() -> None:
    upper = MemoryConnector(capacity_bytes=16 << 20, name="ram")
    lower = MemoryConnector(capacity_bytes=16 << 20, name="ram2")
    tiered = TieredConnector([upper, lower], promote=False)
    async with make_manager(connector=tiered) as mgr:
        model = FakeModel(mgr)
        await serve(mgr, model, mgr.new_request("a", PROMPT, tenant="acme"))
        await mgr.drain()
        evict_device_cache(mgr)
        # Drop blocks 3.. from the upper tier: they are served by the lower one.
        k = mgr.new_request("k", PROMPT, tenant="acme")
        a_keys = mgr.keyspace.chunk_keys("acme", 0, k.block_hashes, 3, 7)
        mgr.finish(k)
        assert await upper.delete(a_keys, timeout=1) == 4
        b = mgr.new_request("b", PROMPT, tenant="acme")
        found = await mgr.lookup(b)
        assert found.levels == ((0, 0, 0, 1, 1, 1, 1),)
        adm = mgr.allocate(b, found)
        # Two tiers of one kind, told apart by name.
        assert adm is not None and adm.external_by_tier == {"ram": 12, "ram2": 16}
        assert mgr.tiers == ("ram", "ram2")
        assert (await mgr.wait_load(b)).status is LoadStatus.LOADED
        assert model.check_pages(b, 28) == 7
        mgr.finish(b)
