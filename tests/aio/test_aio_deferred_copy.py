"""Copy mode copies a store's chunks out of host memory in the store job's first step, not
on the step path; a block handed out again before that is copied first, by the core's
reuse hook. Either way the tiers get the bytes of hand-off time, the core hands out the
blocks it would without offload, and nothing is left watching when the jobs end. Both
copies (out for stores, in for loads) take one chunk per loop callback."""

from __future__ import annotations

import asyncio

import pytest
from aio_testlib import FakeModel, admit, all_blocks, free_blocks, make_manager, serve

from kvplugin.aio import memory as aio_memory
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import StoreMode
from kvplugin.buffers import Sealed
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.request import RequestStatus

PROMPT = list(range(100, 130))  # 30 tokens: 7 full blocks of 4, 3 chunks of 2 blocks (8 tokens)


def _clean(mgr: AsyncKVManager) -> None:
    assert free_blocks(mgr) == all_blocks(mgr)
    assert mgr.num_pending_jobs == 0 and mgr.num_held_blocks == 0
    assert mgr.store_bytes_in_flight == 0
    assert not mgr._stores.copies._watches  # type: ignore[union-attr]  # nothing watched
    assert not mgr.core.block_pool._reuse_watchers  # and the core holds no watch


async def _reload_and_check(mgr: AsyncKVManager, model: FakeModel, rid: str) -> int:
    b = mgr.new_request(rid, PROMPT, tenant="acme")
    adm, step = await admit(mgr, b)
    assert adm.external_tokens == 24
    model.step(b, step.num_new_tokens)
    n = model.check_pages(b, 24)
    b.status = RequestStatus.FINISHED_STOPPED
    mgr.finish(b)
    return n


async def _reload_a_and_clean(mgr: AsyncKVManager, model: FakeModel) -> None:
    """Once every store ended: a's prefix comes back from the tier, byte for byte."""
    await mgr.drain()
    mgr.core.reset_prefix_cache()
    assert await _reload_and_check(mgr, model, "b") == 6
    await mgr.drain()
    _clean(mgr)


@pytest.mark.asyncio
async def test_the_store_job_copies_while_the_next_step_runs() -> None:
    async with make_manager(num_blocks=32, store_mode=StoreMode.COPY, chunk_blocks=2) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", PROMPT, tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        assert mgr.after_step([a]) == 3
        (job,) = mgr._jobs
        assert all(bytes(blk.payload) == b"" for _, blk in job.items)  # not copied yet
        await mgr.drain()
        assert mgr.stats().stored_chunks == 3 and mgr.stats().copies_on_reuse == 0
        a.status = RequestStatus.FINISHED_STOPPED
        mgr.finish(a)
        await _reload_a_and_clean(mgr, model)
        assert mgr.stats().copies_on_reuse == 0


@pytest.mark.asyncio
async def test_a_block_handed_out_before_its_store_ran_is_copied_first() -> None:
    # 9 blocks: the null block and 8, all a's; x must take a's blocks at once.
    async with make_manager(num_blocks=9, store_mode=StoreMode.COPY, chunk_blocks=2) as mgr:
        model = FakeModel(mgr)
        x = mgr.new_request("x", list(range(900, 929)), tenant="acme")
        found = await mgr.lookup(x)  # asked first: no await between a's steps and x's
        a = mgr.new_request("a", PROMPT, tenant="acme")
        await serve(mgr, model, a, outputs=2)  # finished: COPY frees at once
        assert mgr.num_pending_jobs >= 1 and mgr.stats().copies_on_reuse == 0
        step = mgr.allocate(x, found)  # takes a's blocks before its store jobs ran
        assert step is not None and not step.loading
        x.status = RequestStatus.RUNNING
        assert mgr.stats().copies_on_reuse >= 1
        model.step(x, step.num_new_tokens)  # overwrites every block a had
        x.status = RequestStatus.FINISHED_STOPPED
        mgr.finish(x)
        await _reload_a_and_clean(mgr, model)  # a's bytes, not x's


@pytest.mark.asyncio
async def test_same_blocks_handed_out_as_without_offload() -> None:
    on = make_manager(num_blocks=9, store_mode=StoreMode.COPY, chunk_blocks=2)
    c = on.core
    off = AsyncKVManager(KVCacheManager(c.kv_cache_config, max_model_len=c.max_model_len,
                                        scheduler_block_size=c.coordinator.scheduler_block_size,
                                        hash_block_size=c.block_pool.hash_block_size),
                         None, on.config)
    ids = []
    for mgr in (on, off):
        async with mgr:
            model = FakeModel(mgr)
            for rid, first in (("a", 100), ("x", 900), ("y", 500)):
                r = mgr.new_request(rid, list(range(first, first + 29)), tenant="acme")
                await serve(mgr, model, r, outputs=2, finish=False)
                ids.append(mgr.core.get_block_ids(rid))
                r.status = RequestStatus.FINISHED_STOPPED
                mgr.finish(r)
            await mgr.drain()
            assert free_blocks(mgr) == all_blocks(mgr)
    assert ids[:3] == ids[3:]


@pytest.mark.asyncio
async def test_jobs_closed_before_their_copy_leave_nothing_watched() -> None:
    mgr = make_manager(num_blocks=32, store_mode=StoreMode.COPY, chunk_blocks=2)
    model = FakeModel(mgr)
    a = mgr.new_request("a", PROMPT, tenant="acme")
    _, step = await admit(mgr, a)
    model.step(a, step.num_new_tokens)
    assert mgr.after_step([a]) == 3
    assert mgr._stores.copies._watches  # type: ignore[union-attr]
    await mgr.aclose()  # cancels the job before its first step
    assert not mgr._stores.copies._watches  # type: ignore[union-attr]
    assert not mgr.core.block_pool._reuse_watchers
    assert mgr.stats().stored_chunks == 0 and mgr.stats().stores_failed == 3


@pytest.mark.asyncio
async def test_big_copies_go_to_sealed_pool_slots_the_memory_tier_keeps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(aio_memory, "MIN_POOLED_BYTES", 1)  # these pages are small
    conn = MemoryConnector(capacity_bytes=1 << 20)
    async with make_manager(num_blocks=32, connector=conn, chunk_blocks=2) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", PROMPT, tenant="acme")
        await serve(mgr, model, a, outputs=2)
        await mgr.drain()
        kept = list(conn._objects.values())
        assert len(kept) == 3
        assert all(type(o.payload.obj) is Sealed for o in kept)  # type: ignore[union-attr]
        await _reload_a_and_clean(mgr, model)


@pytest.mark.asyncio
async def test_a_job_copies_one_chunk_per_callback_and_the_hook_takes_the_rest() -> None:
    async with make_manager(num_blocks=9, store_mode=StoreMode.COPY, chunk_blocks=2) as mgr:
        model = FakeModel(mgr)
        x = mgr.new_request("x", list(range(900, 929)), tenant="acme")
        found = await mgr.lookup(x)
        a = mgr.new_request("a", PROMPT, tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        assert mgr.after_step([a]) == 3
        (job,) = mgr._jobs
        await asyncio.sleep(0)  # the job's first step: one chunk
        assert [bool(bytes(blk.payload)) for _, blk in job.items] == [True, False, False]
        a.status = RequestStatus.FINISHED_STOPPED
        mgr.finish(a)
        step = mgr.allocate(x, found)  # takes a's blocks: the hook copies the other two
        assert step is not None
        x.status = RequestStatus.RUNNING
        assert all(bytes(blk.payload) for _, blk in job.items)
        assert mgr.stats().copies_on_reuse == 1
        model.step(x, step.num_new_tokens)
        x.status = RequestStatus.FINISHED_STOPPED
        mgr.finish(x)
        await _reload_a_and_clean(mgr, model)


@pytest.mark.asyncio
async def test_a_load_copies_in_one_chunk_per_callback() -> None:
    async with make_manager(num_blocks=32, store_mode=StoreMode.COPY, chunk_blocks=2) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", PROMPT, tenant="acme")
        await serve(mgr, model, a, outputs=2)
        await mgr.drain()
        mgr.core.reset_prefix_cache()
        b = mgr.new_request("b", PROMPT, tenant="acme")
        adm = mgr.allocate(b, await mgr.lookup(b))
        assert adm is not None and adm.loading and adm.external_tokens == 24
        job = mgr._requests["b"].load
        assert job is not None
        seen = []
        for _ in range(50):
            await asyncio.sleep(0)
            seen.append(len(job.copied))  # the pieces copied in so far (booked at the end)
            if seen[-1] == 3:
                break
        # Each chunk in a callback of its own: the count goes up one at a time.
        steps = sorted(set(seen))
        assert steps[-3:] == [1, 2, 3] and all(seen.count(n) >= 1 for n in (1, 2))
        await mgr.wait_load(b)
        assert mgr.stats().loaded_chunks == 3  # booked once the load completed
        b.status = RequestStatus.FINISHED_STOPPED
        mgr.finish(b)
        await mgr.drain()
        _clean(mgr)
