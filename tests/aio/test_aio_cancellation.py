"""Cancellation at every await of the lookup, load and store paths, aborts during loads,
delayed frees, and ``aclose``: invariants hold (no leaked or held block, no pending job,
nothing unverified published) and the request can carry on."""

from __future__ import annotations

import asyncio

import pytest
from aio_testlib import (
    FakeModel,
    Gated,
    admit,
    all_blocks,
    evict_device_cache,
    free_blocks,
    job_task,
    make_manager,
    serve,
)

from kvplugin.aio.jobs import IOGate, Priority
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import LoadStatus, StoreMode
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.request import RequestStatus

PROMPT = list(range(100, 130))


def _clean(mgr: AsyncKVManager) -> None:
    assert free_blocks(mgr) == all_blocks(mgr)
    assert mgr.num_pending_jobs == 0 and mgr.num_held_blocks == 0
    assert mgr.store_bytes_in_flight == 0


async def _setup(mode: StoreMode = StoreMode.COPY) -> tuple[AsyncKVManager, FakeModel, Gated]:
    gated = Gated(MemoryConnector(capacity_bytes=16 << 20))
    mgr = make_manager(connector=gated, store_mode=mode, lookup_timeout=5.0)
    model = FakeModel(mgr)
    await serve(mgr, model, mgr.new_request("a", PROMPT, tenant="acme"))
    await mgr.drain()
    evict_device_cache(mgr)
    return mgr, model, gated


@pytest.mark.asyncio
async def test_cancelled_lookup_changes_nothing() -> None:
    mgr, model, gated = await _setup()
    async with mgr:
        b = mgr.new_request("b", PROMPT, tenant="acme")
        gated.hold("lookup")
        task = asyncio.create_task(mgr.lookup(b))
        await gated.entered["lookup"].wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gated.open("lookup")
        _clean(mgr)
        assert b.num_computed_tokens == 0 and b.status is RequestStatus.WAITING
        await serve(mgr, model, b)
        assert mgr.stats().loads == 1
        _clean(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("where", ["queued", "fetching"])
async def test_cancelled_load_puts_the_request_back(where: str) -> None:
    mgr, model, gated = await _setup()
    async with mgr:
        b = mgr.new_request("b", PROMPT, tenant="acme")
        found = await mgr.lookup(b)
        gated.hold("get")
        adm = mgr.allocate(b, found)
        assert adm is not None and adm.loading
        if where == "fetching":
            await gated.entered["get"].wait()
        job_task("load", "b").cancel()  # "queued": before the task ever ran
        outcome = await mgr.wait_load(b)
        gated.open("get")
        assert outcome.status is LoadStatus.CANCELLED
        assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
        _clean(mgr)
        probe = mgr.new_request("p", PROMPT, tenant="acme")
        assert (await mgr.lookup(probe)).local_tokens == 0  # nothing unverified published
        mgr.finish(probe)
        adm2 = await serve(mgr, model, b, finish=False)
        assert not adm2.loading and model.check_pages(b, 28) == 7
        mgr.finish(b)
        assert mgr.stats().loads_cancelled == 1


@pytest.mark.asyncio
async def test_abort_during_load_frees_blocks_only_when_the_load_stopped() -> None:
    mgr, _, gated = await _setup()
    async with mgr:
        b = mgr.new_request("b", PROMPT, tenant="acme")
        found = await mgr.lookup(b)
        gated.hold("get")
        mgr.allocate(b, found)
        await gated.entered["get"].wait()
        b.status = RequestStatus.FINISHED_ABORTED
        assert mgr.finish(b) is True  # delayed: the load may still write the blocks
        assert mgr.num_held_blocks == 7 and free_blocks(mgr) == all_blocks(mgr) - 7
        gated.open("get")
        await mgr.drain()
        _clean(mgr)
        probe = mgr.new_request("p", PROMPT, tenant="acme")
        assert (await mgr.lookup(probe)).local_tokens == 0
        mgr.finish(probe)


@pytest.mark.asyncio
@pytest.mark.parametrize("mode", [StoreMode.COPY, StoreMode.HOLD])
async def test_cancelled_store_releases_budget_and_dedupe(mode: StoreMode) -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 << 20))
    async with make_manager(connector=gated, store_mode=mode) as mgr:
        model = FakeModel(mgr)
        gated.hold("put")
        a = mgr.new_request("a", PROMPT, tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        assert mgr.after_step([a]) == 7
        await gated.entered["put"].wait()
        job_task("store", "a").cancel()
        await mgr.drain()
        gated.open("put")
        assert mgr.store_bytes_in_flight == 0 and mgr.stats().stores_failed == 7
        mgr.finish(a)
        _clean(mgr)
        # Nothing was stored, and the keys are no longer "in flight": c stores them.
        evict_device_cache(mgr)
        c = mgr.new_request("c", PROMPT, tenant="acme")
        assert (await mgr.lookup(c)).external_tokens == 0
        await serve(mgr, model, c)
        await mgr.drain()
        assert mgr.stats().stored_chunks == 7
        _clean(mgr)


@pytest.mark.asyncio
async def test_hold_mode_delays_the_free_until_stores_end() -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 << 20))
    async with make_manager(connector=gated, store_mode=StoreMode.HOLD) as mgr:
        model = FakeModel(mgr)
        gated.hold("put")
        a = mgr.new_request("a", PROMPT, tenant="acme")
        await serve(mgr, model, a, finish=False)
        a.status = RequestStatus.FINISHED_STOPPED
        assert mgr.finish(a) is True
        assert mgr.num_held_blocks == 8  # 31 tokens: 8 blocks, read by the store
        assert free_blocks(mgr) == all_blocks(mgr) - 8
        gated.open("put")
        await mgr.drain()
        _clean(mgr)


@pytest.mark.asyncio
async def test_hold_mode_preemption_keeps_blocks_for_stores() -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 << 20))
    async with make_manager(connector=gated, store_mode=StoreMode.HOLD) as mgr:
        model = FakeModel(mgr)
        gated.hold("put")
        a = mgr.new_request("a", PROMPT, tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        mgr.after_step([a])
        assert mgr.preempt(a) is True
        assert a.status is RequestStatus.PREEMPTED and a.num_computed_tokens == 0
        assert mgr.num_held_blocks == 8
        # Re-admitted while its old blocks are held: they are still a local hit.
        adm, _ = await admit(mgr, a)
        assert adm.local_tokens == 28
        gated.open("put")
        await mgr.drain()
        assert mgr.num_held_blocks == 0
        mgr.finish(a)
        _clean(mgr)


@pytest.mark.asyncio
async def test_copy_mode_frees_at_once_and_stores_the_bytes_of_decision_time() -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 << 20))
    async with make_manager(connector=gated, store_mode=StoreMode.COPY) as mgr:
        model = FakeModel(mgr)
        gated.hold("put")
        a = mgr.new_request("a", PROMPT, tenant="acme")
        await serve(mgr, model, a, finish=False)
        assert mgr.finish(a) is False and free_blocks(mgr) == all_blocks(mgr)
        # Reuse (overwrite) every block while the store still waits to write.
        evict_device_cache(mgr)
        other = mgr.new_request("x", list(range(900, 1020)), tenant="acme")
        await serve(mgr, model, other, outputs=1)
        gated.open("put")
        await mgr.drain()
        evict_device_cache(mgr)
        b = mgr.new_request("b", PROMPT, tenant="acme")
        adm = await serve(mgr, model, b, finish=False)
        assert adm.external_tokens == 28 and model.check_pages(b, 28) == 7
        mgr.finish(b)
        _clean(mgr)


@pytest.mark.asyncio
async def test_aclose_cancels_every_job_and_holds_nothing() -> None:
    mgr, model, gated = await _setup(StoreMode.HOLD)
    b = mgr.new_request("b", PROMPT, tenant="acme")
    found = await mgr.lookup(b)
    gated.hold("get")
    gated.hold("put")
    mgr.allocate(b, found)
    c = mgr.new_request("c", list(range(300, 340)), tenant="other")
    await serve(mgr, model, c, finish=False)
    c.status = RequestStatus.FINISHED_STOPPED
    assert mgr.finish(c) is True
    assert mgr.num_pending_jobs == 2
    await mgr.aclose()
    assert mgr.num_pending_jobs == 0 and mgr.num_held_blocks == 0
    assert (await mgr.wait_load(b)).status is LoadStatus.CANCELLED
    assert free_blocks(mgr) == all_blocks(mgr)
    with pytest.raises(RuntimeError, match="closed"):
        await mgr.lookup(b)
    await mgr.aclose()  # idempotent


@pytest.mark.asyncio
async def test_gate_serves_loads_before_stores_and_survives_cancelled_waiters() -> None:
    gate = IOGate(1)
    order: list[str] = []
    hold = asyncio.Event()

    async def use(name: str, prio: Priority) -> None:
        async with gate.slot(prio):
            order.append(name)
            if name == "first":
                await hold.wait()

    first = asyncio.create_task(use("first", Priority.STORE))
    await asyncio.sleep(0)
    store = asyncio.create_task(use("store", Priority.STORE))
    doomed = asyncio.create_task(use("doomed", Priority.LOAD))
    load = asyncio.create_task(use("load", Priority.LOAD))
    await asyncio.sleep(0)
    assert gate.waiting == 3
    doomed.cancel()
    hold.set()
    await asyncio.gather(first, store, load, doomed, return_exceptions=True)
    assert order == ["first", "load", "store"]
    assert gate.in_use == 0 and gate.waiting == 0


@pytest.mark.asyncio
@pytest.mark.parametrize("release_first", [True, False],
                         ids=["granted-then-cancelled", "cancelled-then-skipped"])
async def test_gate_waiter_cancelled_around_a_release(release_first: bool) -> None:
    """A waiter granted the slot and then cancelled before it runs passes the slot on; a
    waiter cancelled and then skipped by a release (its cancelled future popped before its
    clean-up ran) ends as a cancellation, not a ValueError (the clean-up once looked for the
    future again: seen as a traceback under load in ``kvplugin run``)."""
    gate = IOGate(1)
    ran: list[str] = []

    async def use(name: str) -> None:
        async with gate.slot(Priority.LOAD):
            ran.append(name)

    await gate._acquire(Priority.LOAD)  # the holder
    w1 = asyncio.create_task(use("w1"))
    w2 = asyncio.create_task(use("w2"))
    await asyncio.sleep(0)
    assert gate.waiting == 2
    if release_first:
        gate._release()  # grants w1 ...
        w1.cancel()  # ... which is cancelled before it runs
    else:
        w1.cancel()  # its future is cancelled now, its clean-up runs later
        gate._release()  # skips w1's cancelled future, grants w2
    results = await asyncio.gather(w1, w2, return_exceptions=True)
    assert isinstance(results[0], asyncio.CancelledError) and results[1] is None
    assert ran == ["w2"] and gate.in_use == 0 and gate.waiting == 0


@pytest.mark.asyncio
async def test_a_job_never_released_makes_drain_and_aclose_raise_not_spin() -> None:
    """A job left registered after its task ended (a bookkeeping bug) must not turn drain()
    or aclose() into a loop that never yields: no deadline could fire. They raise."""
    mgr, _, _ = await _setup()
    b = mgr.new_request("b", PROMPT, tenant="acme")
    found = await mgr.lookup(b)
    mgr.allocate(b, found)
    (job,) = list(mgr._jobs)
    await mgr.wait_load(b)
    mgr._jobs.add(job)  # the bug: an ended job still registered
    async with asyncio.timeout(2):
        with pytest.raises(RuntimeError, match="never released"):
            await mgr.drain()
        with pytest.raises(RuntimeError, match="never released"):
            await mgr.aclose()
