"""Hybrid layouts end to end: one test per reconciliation branch, checking the block tables
the core ends up with and the bytes (loaded pages and states equal their recomputation; the
fake model also checks every input it reads on the next step)."""

from __future__ import annotations

import pytest
from aio_testlib import (
    FakeModel,
    clean,
    evict_device_cache,
    load_window_of_40,
    make_hybrid,
    proceed,
    serve,
)

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.request import Request, RequestStatus

P40 = list(range(100, 140))  # 40 tokens
P30 = P40[:30]
MIB = 1 << 20


def _keys(mgr: AsyncKVManager, tokens: list[int], chunks: range = range(0),
          states: tuple[int, ...] = (), group: int = 0) -> list[ObjectKey]:
    """Tier keys of a prompt's chunks (of ``group``) and states (of the last group)."""
    probe = mgr.new_request("probe", tokens, tenant="acme")
    keys = mgr.keyspace.chunk_keys("acme", group, probe.block_hashes, chunks.start,
                                   chunks.stop) if chunks else []
    keys += [mgr.keyspace.state_key("acme", 1, probe.block_hashes, n) for n in states]
    mgr.finish(probe)
    return keys


def _evict_device_state(mgr: AsyncKVManager, tokens: list[int], boundary: int) -> None:
    """Drop the Mamba state at ``boundary`` from the device cache, keeping the attention
    blocks: the diverged hit a full pool produces."""
    probe = Request("probe", tokens, block_hasher=mgr.hasher,
                    cache_salt="tenant=acme")
    hsh = probe.block_hashes[boundary // mgr.keyspace.hash_block_size - 1]
    found = mgr.core.block_pool.get_cached_block(hsh, [1])
    assert found, f"no device state at {boundary}"
    mgr.core.evict_blocks({b.block_id for b in found})


async def _stored(mgr: AsyncKVManager, model: FakeModel, tokens: list[int],
                  rid: str = "a", budget: int | None = None) -> None:
    await serve(mgr, model, mgr.new_request(rid, tokens, tenant="acme"), budget=budget)
    await mgr.drain()


@pytest.mark.asyncio
async def test_sliding_window_loads_only_the_window() -> None:
    async with make_hybrid("window", window=8) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model, P40, budget=12)
        evict_device_cache(mgr)
        b = await load_window_of_40(mgr, model, P40)
        rest = mgr.allocate(b)
        assert rest is not None
        model.step(b, rest.num_new_tokens)  # reads the loaded window: checked
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
async def test_external_hit_longer_than_the_local_hit() -> None:
    async with make_hybrid("mamba") as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model, P40)  # states at 36 and 40, chunks 0..9
        evict_device_cache(mgr)
        await _stored(mgr, model, P40[:13], rid="w")  # device: 12 tokens, state at 12
        b = mgr.new_request("b", [*P40, 1, 2, 3], tenant="acme")
        found = await mgr.lookup(b)
        assert (found.local_tokens, found.external_tokens, found.state_boundary) == (12, 28, 40)
        adm = mgr.allocate(b, found)
        assert adm is not None and adm.loading and adm.state_boundary == 40
        outcome = await mgr.wait_load(b)
        assert outcome.state_boundary == 40 and b.num_computed_tokens == 40
        full, state = mgr.core.get_block_ids("b")
        w_full = full[:3]
        assert len(full) == 10 and 0 not in full and len(set(full)) == 10
        assert state == [0] * 9 + [state[9]] and state[9] != 0
        assert model.check_pages(b, 40) == 10 and model.check_state(b, 40) == 1
        proceed(mgr, model, b)  # resumes from the loaded state: checked
        assert mgr.core.get_block_ids("b")[0][:3] == w_full
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
async def test_external_hit_shorter_than_the_local_hit_is_ignored() -> None:
    mem = MemoryConnector(capacity_bytes=16 * MIB)
    async with make_hybrid("mamba", connector=mem) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model, P30)  # device and tier: 28 tokens, state at 28
        assert await mem.delete(_keys(mgr, P30, range(3, 7), (28,)), timeout=1) == 5
        b = mgr.new_request("b", P40, tenant="acme")
        found = await mgr.lookup(b)
        assert (found.local_tokens, found.external_tokens) == (28, 0)
        adm = mgr.allocate(b, found)
        assert adm is not None and not adm.loading and adm.local_tokens == 28
        assert mgr.stats().loads == 0
        model.step(b, adm.num_new_tokens)  # resumes from the device state at 28: checked
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
async def test_partial_local_tail_kept_or_superseded() -> None:
    """FA blocks of 4, Mamba blocks of 16, hashes every 4: sub-block (partial) hits."""
    async with make_hybrid("mamba", other_block_size=16, prefix_match_unit=4) as mgr:
        model = FakeModel(mgr)
        # Chunks [0, 32), [32, 36) (the prompt's last reusable boundary), [36, 40): states
        # at 32 and, through the copy-on-write of its own tail, at 36.
        await _stored(mgr, model, P40)
        assert mgr.stats().stored_states == 2
        evict_device_cache(mgr)
        await _stored(mgr, model, P30, rid="w")  # device: 28 tokens, partial state at 28
        before = mgr.stats()
        # Nothing deeper in the tiers for a 31-token prompt: the local tail is kept (CoW).
        k = mgr.new_request("k", [*P30, 5], tenant="acme")
        adm = await serve(mgr, model, k, finish=False)
        assert (adm.local_tokens, adm.external_tokens, adm.loading) == (28, 0, False)
        mgr.finish(k)
        # A longer prompt: the tier's state at 36 supersedes the local tail at 28; the
        # attention blocks stay local up to 28, only [28, 36) and the state are loaded.
        b = mgr.new_request("b", [*P40, 1, 2, 3], tenant="acme")
        found = await mgr.lookup(b)
        assert (found.local_tokens, found.external_tokens, found.state_boundary) == (28, 8, 36)
        adm = mgr.allocate(b, found)
        assert adm is not None and adm.loading
        await mgr.wait_load(b)
        full, state = mgr.core.get_block_ids("b")
        assert len(full) == 9 and 0 not in full
        assert state[:2] == [0, 0] and state[2] != 0 and len(state) == 3
        assert model.check_pages(b, 36) == 9 and model.check_state(b, 36) == 1
        assert mgr.stats().loaded_chunks - before.loaded_chunks == 2
        proceed(mgr, model, b)
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
async def test_diverged_hit_with_external_tokens() -> None:
    async with make_hybrid("mamba") as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model, P40)
        evict_device_cache(mgr)
        await _stored(mgr, model, P30, rid="w")
        _evict_device_state(mgr, P30, 28)  # device: attention 28 tokens, no state
        b = mgr.new_request("b", [*P40, 1, 2, 3], tenant="acme")
        found = await mgr.lookup(b)
        assert (found.local_tokens, found.external_tokens, found.state_boundary) == (28, 12, 40)
        adm = mgr.allocate(b, found)
        assert adm is not None and adm.loading and adm.local_tokens == 28
        await mgr.wait_load(b)
        full, state = mgr.core.get_block_ids("b")
        assert 0 not in full and len(full) == 10
        assert state == [0] * 9 + [state[9]] and state[9] != 0
        assert model.check_pages(b, 40) == 10 and model.check_state(b, 40) == 1
        assert mgr.stats().loaded_chunks == 3
        proceed(mgr, model, b)
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
async def test_diverged_hit_restores_only_the_lagging_state() -> None:
    """No vLLM offload connector does this: the deeper local attention hit is kept and
    only the Mamba state at its boundary is loaded (vLLM recomputes all 28 tokens)."""
    async with make_hybrid("mamba") as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model, P30)  # tier: chunks 0..6, state at 28
        _evict_device_state(mgr, P30, 28)
        b = mgr.new_request("b", P40, tenant="acme")
        found = await mgr.lookup(b)
        assert (found.local_tokens, found.external_tokens, found.state_boundary) == (28, 0, 28)
        adm = mgr.allocate(b, found)
        assert adm is not None and adm.loading and adm.num_new_tokens == 0
        assert b.status is RequestStatus.WAITING_FOR_REMOTE_KVS
        outcome = await mgr.wait_load(b)
        assert outcome.state_boundary == 28 and b.num_computed_tokens == 28
        full, state = mgr.core.get_block_ids("b")
        a_full = full
        assert len(full) == 7 and 0 not in full
        assert state == [0] * 6 + [state[6]] and state[6] != 0
        assert model.check_pages(b, 28) == 7 and model.check_state(b, 28) == 1
        stats = mgr.stats()
        assert (stats.loaded_states, stats.loaded_chunks, stats.external_hit_tokens) == (1, 0, 0)
        # Published: a twin request now hits 28 tokens with every group on the device.
        twin = mgr.new_request("twin", P40, tenant="acme")
        assert (await mgr.lookup(twin)).local_tokens == 28
        mgr.finish(twin)
        proceed(mgr, model, b)  # resumes from the restored state
        assert mgr.core.get_block_ids("b")[0][:7] == a_full
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
async def test_diverged_hit_without_a_stored_state_falls_back_to_the_reconciled_hit() -> None:
    mem = MemoryConnector(capacity_bytes=16 * MIB)
    async with make_hybrid("mamba", connector=mem) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model, P30)
        _evict_device_state(mgr, P30, 28)
        assert await mem.delete(_keys(mgr, P30, states=(28,)), timeout=1) == 1
        b = mgr.new_request("b", P40, tenant="acme")
        found = await mgr.lookup(b)
        assert (found.local_tokens, found.external_tokens, found.state_boundary) == (0, 0, None)
        adm = mgr.allocate(b, found)
        assert adm is not None and not adm.loading and adm.local_tokens == 0
        full, state = mgr.core.get_block_ids("b")
        assert len(full) == adm.num_new_tokens // 4 == 9  # fresh: nothing adopted
        assert state[:8] == [0] * 8 and state[8] != 0
        model.step(b, adm.num_new_tokens)
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("missing", ["chunk", "chunk+state"])
async def test_checkpoint_with_a_missing_part_is_no_hit_at_its_boundary(missing: str) -> None:
    mem = MemoryConnector(capacity_bytes=16 * MIB)
    async with make_hybrid("mamba", connector=mem) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model, P40)  # checkpoints at 36 and 40
        evict_device_cache(mgr)
        gone = _keys(mgr, P40, range(9, 10), (36,) if missing == "chunk+state" else ())
        assert await mem.delete(gone, timeout=1) == len(gone)
        b = mgr.new_request("b", [*P40, 1, 2, 3], tenant="acme")
        found = await mgr.lookup(b)
        # The state at 40 is stored but its last attention chunk is not: no hit at 40.
        expect = (36, 36) if missing == "chunk" else (0, None)
        assert (found.external_tokens, found.state_boundary) == expect
        adm = await serve(mgr, model, b, finish=False)
        assert adm.external_tokens == expect[0]
        if expect[0]:
            assert model.check_pages(b, 36) == 9
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
async def test_window_checkpoint_needs_its_window_chunks() -> None:
    mem = MemoryConnector(capacity_bytes=16 * MIB)
    async with make_hybrid("window", window=8, connector=mem) as mgr:
        model = FakeModel(mgr)
        await _stored(mgr, model, P40, budget=12)
        evict_device_cache(mgr)
        # Window block 9 (tokens 36..40) gone: 40 cannot be restored, 36 can.
        assert await mem.delete(_keys(mgr, P40, range(9, 10), group=1), timeout=1) == 1
        b = mgr.new_request("b", [*P40, 1, 2, 3], tenant="acme")
        adm = await serve(mgr, model, b, finish=False)
        assert (adm.local_tokens, adm.external_tokens) == (0, 36)
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)
