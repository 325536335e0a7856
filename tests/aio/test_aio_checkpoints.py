"""Streaming Mamba offloads: boundary states stored with their attention chunks as one
checkpoint, stale offers dropped, finish-time partial tails stored; cancellation at the new
awaits; a faulty tier under concurrency never yields a wrong byte on hybrid layouts."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence

import pytest
from aio_testlib import (
    FakeModel,
    Gated,
    admit,
    clean,
    evict_device_cache,
    job_task,
    make_hybrid,
    proceed,
    serve,
)

from kvplugin.aio.values import Admission, LoadStatus, Lookup
from kvplugin.connectors.faults import FaultInjector, FaultPlan
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.request import Request, RequestStatus

P30 = list(range(100, 130))
P40 = list(range(100, 140))
MIB = 1 << 20


def _state_block(mgr: object, req: Request, boundary: int) -> int:
    table = mgr.core.get_block_ids(req.request_id)[1]  # type: ignore[attr-defined]
    bs = mgr.layout.block_sizes[1]  # type: ignore[attr-defined]
    block: int = table[-(boundary // -bs) - 1]
    return block


@pytest.mark.asyncio
async def test_state_is_dropped_when_a_chunk_of_its_checkpoint_is_shed() -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 * MIB))
    async with make_hybrid("mamba", connector=gated, store_budget_bytes=3 * 256) as mgr:
        assert mgr.memory.page_bytes(0) == 256
        model = FakeModel(mgr)
        gated.hold("put")
        a = mgr.new_request("a", P30, tenant="acme")
        _, step = await admit(mgr, a)
        assert step.num_new_tokens == 28
        model.step(a, step.num_new_tokens)
        assert mgr.after_step([a]) == 3  # 3 chunks fit, 4 shed: the state at 28 is not stored
        stats = mgr.stats()
        assert (stats.stores_shed, stats.states_dropped) == (4, 1)
        gated.open("put")
        proceed(mgr, model, a)
        mgr.finish(a)
        await mgr.drain()
        assert mgr.stats().stored_states == 0
        evict_device_cache(mgr)
        b = mgr.new_request("b", P40, tenant="acme")
        found = await mgr.lookup(b)
        assert found.external_tokens == 0 and found.states == ()
        mgr.finish(b)
        clean(mgr)


@pytest.mark.asyncio
async def test_stale_offers_are_dropped() -> None:
    async with make_hybrid("mamba") as mgr:
        model = FakeModel(mgr)
        # An offered block evicted (and so reusable) before the step's hand-off.
        a = mgr.new_request("a", P30, tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        mgr.core.evict_blocks({_state_block(mgr, a, 28)})
        assert mgr.after_step([a]) == 7  # the chunks only
        assert mgr.stats().states_dropped == 1
        # A preempted request's pending offers go with its blocks.
        proceed(mgr, model, a, outputs=1)
        c = mgr.new_request("c", list(range(500, 530)), tenant="acme")
        _, step = await admit(mgr, c)
        mgr.preempt(c)
        assert mgr.after_step([]) == 0
        mgr.finish(a)
        mgr.finish(c)
        await mgr.drain()
        assert mgr.stats().stored_states == 0
        # A state the core re-offers after restoring it came from the tier: not stored again.
        q = list(range(300, 340))
        await serve(mgr, model, mgr.new_request("s", q[:30], tenant="acme"))
        await mgr.drain()
        before = mgr.stats()
        evict_device_cache(mgr)
        b = mgr.new_request("b", q, tenant="acme")
        adm = await serve(mgr, model, b, finish=False)
        assert (adm.external_tokens, adm.state_boundary) == (28, 28)
        await mgr.drain()
        after = mgr.stats()
        assert after.stored_states - before.stored_states == 2  # 36 and 40 by b; not 28
        assert after.states_dropped - before.states_dropped == 1  # the restored 28
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
async def test_finish_time_partial_tail_is_stored_and_restores() -> None:
    async with make_hybrid("mamba", other_block_size=16, prefix_match_unit=4) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", P30, tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)  # [0, 16)
        mgr.after_step([a])
        nxt = mgr.allocate(a)
        assert nxt is not None and nxt.num_new_tokens == 12  # stops at the tail, 28
        model.step(a, nxt.num_new_tokens)
        mgr.after_step([a])
        a.status = RequestStatus.FINISHED_ABORTED
        mgr.finish(a)  # finished exactly at its partial boundary: the core hands it over
        await mgr.drain()
        stats = mgr.stats()
        assert (stats.stored_states, stats.partial_tails) == (2, 1)  # 16, and the tail 28
        evict_device_cache(mgr)
        b = mgr.new_request("b", [*P30, 7, 8], tenant="acme")
        found = await mgr.lookup(b)
        assert (found.external_tokens, found.state_boundary) == (28, 28)
        adm = mgr.allocate(b, found)
        assert adm is not None and (await mgr.wait_load(b)).status is LoadStatus.LOADED
        assert mgr.core.get_block_ids("b")[1] == [0, _state_block(mgr, b, 28)]
        assert model.check_pages(b, 28) == 7 and model.check_state(b, 28) == 1
        proceed(mgr, model, b)  # resumes inside the Mamba block from the restored tail
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


class StateGated(Gated):
    """Holds only the lookups of Mamba states (the probe after the chunk lookup)."""

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        if any(k.kind == "mamba_state" for k in keys):
            await self._pass("lookup")
        return await self.inner.lookup(keys, timeout=timeout)


@pytest.mark.asyncio
async def test_cancelled_state_probe_changes_nothing() -> None:
    conn = StateGated(MemoryConnector(capacity_bytes=16 * MIB))
    async with make_hybrid("mamba", connector=conn, lookup_timeout=5.0) as mgr:
        model = FakeModel(mgr)
        await serve(mgr, model, mgr.new_request("a", P30, tenant="acme"))
        await mgr.drain()
        evict_device_cache(mgr)
        b = mgr.new_request("b", P40, tenant="acme")
        conn.hold("lookup")
        task = asyncio.create_task(mgr.lookup(b))
        await conn.entered["lookup"].wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        conn.open("lookup")
        clean(mgr)
        assert b.num_computed_tokens == 0 and b.status is RequestStatus.WAITING
        adm = await serve(mgr, model, b, finish=False)
        assert adm.state_boundary == 28
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize("how", ["cancel", "abort"])
async def test_cancelled_or_aborted_state_restore_publishes_nothing(how: str) -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 * MIB))
    async with make_hybrid("mamba", connector=gated) as mgr:
        model = FakeModel(mgr)
        await serve(mgr, model, mgr.new_request("a", P30, tenant="acme"))
        await mgr.drain()
        probe = Request("x", P30, block_hasher=mgr.hasher, cache_salt="tenant=acme")
        hsh = probe.block_hashes[6]
        mgr.core.evict_blocks({b.block_id for b in mgr.core.block_pool.get_cached_block(
            hsh, [1]) or []})
        b = mgr.new_request("b", P40, tenant="acme")
        found = await mgr.lookup(b)
        gated.hold("get")
        adm = mgr.allocate(b, found)
        assert adm is not None and adm.loading and adm.external_tokens == 0
        await gated.entered["get"].wait()
        if how == "cancel":
            job_task("load", "b").cancel()
            assert (await mgr.wait_load(b)).status is LoadStatus.CANCELLED
            assert b.status is RequestStatus.WAITING and b.num_computed_tokens == 0
        else:
            b.status = RequestStatus.FINISHED_ABORTED
            assert mgr.finish(b) is True
            assert mgr.num_held_blocks == 8  # 7 attention blocks + the state slot
        gated.open("get")
        await mgr.drain()
        twin = mgr.new_request("twin", P40, tenant="acme")
        assert mgr.core.get_computed_blocks(twin)[1] == 0  # no unverified state published
        mgr.finish(twin)
        if how == "cancel":
            # It starts over without the tier that just failed it, computing locally.
            adm = await serve(mgr, model, b, finish=False)
            assert (adm.local_tokens, adm.state_boundary, adm.loading) == (0, None, False)
            mgr.finish(b)
        await mgr.drain()
        clean(mgr)


@pytest.mark.asyncio
async def test_cancelled_checkpoint_store_leaves_a_hole() -> None:
    gated = Gated(MemoryConnector(capacity_bytes=16 * MIB))
    async with make_hybrid("mamba", connector=gated) as mgr:
        model = FakeModel(mgr)
        gated.hold("put")
        a = mgr.new_request("a", P40, tenant="acme")
        _, step = await admit(mgr, a, budget=16)
        model.step(a, step.num_new_tokens)
        assert mgr.after_step([a]) == 5  # chunks 0..3 and the state at 16, one job
        await gated.entered["put"].wait()
        job_task("store", "a").cancel()
        await mgr.drain()
        assert mgr.store_bytes_in_flight == 0 and mgr.stats().stores_failed == 5
        gated.open("put")
        proceed(mgr, model, a)  # later states lack chunks 0..3: dropped, never stored
        mgr.finish(a)
        await mgr.drain()
        assert mgr.stats().stored_states == 0 and mgr.stats().states_dropped >= 1
        evict_device_cache(mgr)
        b = mgr.new_request("b", P40, tenant="acme")
        assert (await mgr.lookup(b)).external_tokens == 0
        mgr.finish(b)
        clean(mgr)


@pytest.mark.asyncio
@pytest.mark.parametrize(("other", "seed"), [("mamba", 0), ("mamba", 1), ("window", 2),
                                             ("mamba16", 3)])
async def test_faulty_tier_never_yields_a_wrong_byte_on_hybrids(other: str, seed: int) -> None:
    """Errors, latency, dropped and corrupted writes, shared prefixes, concurrency and
    device eviction: every input a step reads (attention window, resumed state) equals
    its recomputation (the fake model asserts it), and nothing leaks."""
    plan = FaultPlan(error_rate=0.1, latency_rate=0.3, latency=0.003, drop_write_rate=0.1,
                     corrupt_write_rate=0.15)
    faulty = FaultInjector(MemoryConnector(capacity_bytes=256 << 10), plan, seed=seed)
    rng = random.Random(seed)
    systems = [[rng.randrange(1000) for _ in range(rng.randrange(12, 40))] for _ in range(3)]
    kw: dict[str, object] = ({"other_block_size": 16, "prefix_match_unit": 4}
                             if other == "mamba16" else {})
    async with make_hybrid("window" if other == "window" else "mamba", num_blocks=96,
                           connector=faulty, lookup_timeout=0.5, load_timeout=0.5,
                           **kw) as mgr:  # type: ignore[arg-type]
        model = FakeModel(mgr)

        async def allocate(req: Request, found: Lookup | None = None) -> Admission:
            while True:  # a state cached this step cannot be hit before the next step
                adm = mgr.allocate(req, found, num_new_tokens=rng.choice([None, 8]))
                if adm is not None:
                    return adm
                mgr.after_step([])
                await asyncio.sleep(0.001)

        async def one(i: int) -> None:
            prompt = rng.choice(systems) + [rng.randrange(1000) for _ in range(rng.randrange(9))]
            req = mgr.new_request(f"r{i}", prompt, tenant=rng.choice(["t1", "t2"]))
            await asyncio.sleep(rng.random() * 0.002)
            adm = await allocate(req, await mgr.lookup(req))
            if adm.loading:
                await mgr.wait_load(req)  # loaded, or starting over locally
                adm = await allocate(req)
            req.status = RequestStatus.RUNNING
            while True:
                model.step(req, adm.num_new_tokens)
                mgr.after_step([req])
                if req.num_output_tokens >= 2:
                    break
                adm = await allocate(req)
            req.status = RequestStatus.FINISHED_STOPPED
            mgr.finish(req)

        # Loads follow a wave that drained and evicted; 6 waves gave 2-11 of them (once 0
        # on a CI machine), 16 give 18-38.
        for wave in range(16):
            await asyncio.gather(*(one(wave * 4 + j) for j in range(4)))
            if wave % 2:
                await mgr.drain()
                evict_device_cache(mgr)
        await mgr.drain()
        stats = mgr.stats()
        assert stats.loads > 0 and stats.stored_chunks > 0
        if other != "window":
            assert stats.stored_states > 0
        clean(mgr)
