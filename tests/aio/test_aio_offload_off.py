"""Offload off: ``AsyncKVManager(core, None, config)`` is the device prefix cache alone.

The reference for "the same, without tiers" is a manager whose connector never holds
anything: on the same call sequence both must give the same hits and the same block ids,
and the offload-off one must never store, never await in ``lookup``, and keep every offload
counter at 0."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import fields
from typing import Any

import pytest
from aio_testlib import FakeModel, admit, clean, make_hybrid, make_manager, proceed

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.tenants import PrefixGroup, TenantPolicy, TenantQuota
from kvplugin.aio.values import Lookup, OffloadStats
from kvplugin.connectors.base import Capabilities, Connector, ConnectorStats, Health, PutItem
from kvplugin.connectors.keys import ObjectKey
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.request import Request, RequestStatus
from kvplugin.serde import Block


class NeverHits(Connector):
    """A tier that accepts every put and never holds anything."""

    name = "void"
    capabilities = Capabilities(tier="memory", persistent=False, shared=False)

    def __init__(self) -> None:
        self.calls = 0
        self.closed = False

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        self.calls += 1
        return 0

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        self.calls += 1
        return [None] * len(keys)

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        self.calls += 1
        return 0

    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        return 0

    async def health(self, *, timeout: float) -> Health:
        return Health(True)

    def stats(self) -> ConnectorStats:
        return ConnectorStats()

    async def aclose(self) -> None:
        self.closed = True


def _on(kind: str) -> AsyncKVManager:
    if kind == "full":
        return make_manager(num_blocks=40, connector=NeverHits())
    if kind == "window":
        return make_hybrid("window", num_blocks=64, window=8, connector=NeverHits())
    return make_hybrid("mamba", num_blocks=64, other_block_size=16, prefix_match_unit=4,
                       connector=NeverHits())


def _off_twin(on: AsyncKVManager, **kw: Any) -> AsyncKVManager:
    """A fresh core exactly like ``on``'s, managed with offload off."""
    c = on.core
    core = KVCacheManager(c.kv_cache_config, max_model_len=c.max_model_len,
                          scheduler_block_size=c.coordinator.scheduler_block_size,
                          hash_block_size=c.block_pool.hash_block_size, log_stats=True)
    return AsyncKVManager(core, None, on.config, **kw)


SYSTEM = list(range(1000, 1012))  # a 12-token system prompt many requests start with
WAVES: list[list[tuple[str, str, list[int]]]] = [
    [("a", "acme", [*SYSTEM, *range(1, 20)]), ("b", "acme", [*SYSTEM, *range(50, 61)]),
     ("c", "zen", [*SYSTEM, *range(1, 20)])],
    [("d", "acme", [*SYSTEM, *range(1, 20), 9, 9, 9]), ("e", "zen", [*SYSTEM, *range(1, 20)]),
     ("f", "acme", [*SYSTEM, *range(80, 110)])],
    [("g", "acme", [*SYSTEM, *range(50, 61)]), ("h", "zen", [*SYSTEM, *range(200, 237)])],
    [("i", "acme", [*SYSTEM, *range(1, 20), 9, 9, 9, 4]), ("j", "zen", list(range(300, 337)))],
]


async def _script(mgr: AsyncKVManager) -> list[tuple[Any, ...]]:
    """Serve ``WAVES`` (each wave's requests side by side, 8-token steps, 2 outputs) and
    record every allocation: hits, tokens scheduled and the request's block table."""
    model = FakeModel(mgr)
    trace: list[tuple[Any, ...]] = []
    for wave in WAVES:
        steps: dict[Request, int] = {}
        for rid, tenant, prompt in wave:
            req = mgr.new_request(rid, prompt, tenant=tenant)
            adm = mgr.allocate(req, await mgr.lookup(req), num_new_tokens=8)
            assert adm is not None and not adm.loading
            trace.append((rid, adm.local_tokens, adm.external_tokens, adm.num_new_tokens,
                          mgr.core.get_block_ids(rid)))
            req.status = RequestStatus.RUNNING
            steps[req] = adm.num_new_tokens
        while steps:
            for req, n in steps.items():
                model.step(req, n)
            mgr.after_step(list(steps))
            for req in [r for r in steps if r.num_output_tokens >= 2]:
                req.status = RequestStatus.FINISHED_STOPPED
                assert mgr.finish(req) is False
                del steps[req]
            for req in steps:
                nxt = mgr.allocate(req, num_new_tokens=8)
                assert nxt is not None, "no room"
                trace.append((req.request_id, nxt.num_new_tokens,
                              mgr.core.get_block_ids(req.request_id)))
                steps[req] = nxt.num_new_tokens
        await mgr.drain()
    return trace


def _offload_counters_zero(s: OffloadStats) -> None:
    device = {"queries", "queried_tokens", "local_hit_tokens"}
    for f in fields(s):
        if f.name not in device:
            assert getattr(s, f.name) in (0, {}), f.name


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["full", "window", "mamba"])
async def test_same_hits_and_blocks_as_a_tier_that_never_hits(kind: str) -> None:
    on = _on(kind)
    off = _off_twin(on)
    async with on, off:
        want = await _script(on)
        got = await _script(off)
        assert got == want
        assert sum(t[1] for t in got if len(t) == 5) > 0  # the script does hit the device
        s_on, s_off = on.stats(), off.stats()
        assert (s_off.queries, s_off.queried_tokens, s_off.local_hit_tokens) == \
            (s_on.queries, s_on.queried_tokens, s_on.local_hit_tokens)
        assert s_off.queries == sum(len(w) for w in WAVES)
        assert s_on.stores > 0  # the reference did offer (into the void)
        _offload_counters_zero(s_off)
        assert off.tiers == () and off.tier_stats() == [] and not off.offload
        lat = off.latency()
        assert dict(lat.load) == {} and lat.lookup.count == 0 and lat.store.count == 0
        clean(on)
        clean(off)


@pytest.mark.asyncio
async def test_lookup_answers_the_device_hit_without_suspending() -> None:
    async with _off_twin(make_manager()) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", list(range(30)), tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        mgr.after_step([a])
        mgr.finish(a)
        b = mgr.new_request("b", list(range(30)), tenant="acme")
        coro = mgr.lookup(b)
        with pytest.raises(StopIteration) as done:  # one send: it never awaited anything
            coro.send(None)
        found = done.value.value
        assert isinstance(found, Lookup)
        assert (found.local_tokens, found.external_tokens, found.timed_out) == (28, 0, False)
        assert found.levels == ((),) and found.states == ()
        adm = mgr.allocate(b, found)
        assert adm is not None and (adm.local_tokens, adm.external_tokens) == (28, 0)
        assert not adm.loading and adm.external_by_tier == {}
        mgr.finish(b)
        assert mgr.stats().lookups == 0 and mgr.num_pending_jobs == 0
        clean(mgr)


@pytest.mark.asyncio
async def test_after_step_and_finish_store_nothing_and_drain_at_once() -> None:
    async with _off_twin(make_manager()) as mgr:
        model = FakeModel(mgr)
        reqs = [mgr.new_request(f"r{i}", list(range(i, i + 21)), tenant="acme")
                for i in range(3)]
        for r in reqs:
            _, step = await admit(mgr, r)
            model.step(r, step.num_new_tokens)
        assert mgr.after_step(reqs) == 0
        assert mgr.num_pending_jobs == 0 and mgr.store_bytes_in_flight == 0
        assert mgr.pending_jobs() == {"load": 0, "store": 0}
        assert [mgr.finish(r) for r in reqs] == [False, False, False]
        await mgr.drain()
        _offload_counters_zero(mgr.stats())
        clean(mgr)
    await mgr.aclose()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        mgr.new_request("late", [1, 2, 3], tenant="acme")


@pytest.mark.asyncio
async def test_a_partial_tail_stays_on_the_device_only() -> None:
    # A Mamba request finishing exactly at its partial boundary makes the core hand the
    # tail over for storing; offload off, nothing is stored and nothing leaks, and the
    # device cache still serves the tail.
    on = make_hybrid("mamba", other_block_size=16, prefix_match_unit=4)
    async with on, _off_twin(on) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", list(range(100, 130)), tenant="acme")
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        mgr.after_step([a])
        nxt = mgr.allocate(a)
        assert nxt is not None and nxt.num_new_tokens == 12  # stops at the tail, 28
        model.step(a, nxt.num_new_tokens)
        mgr.after_step([a])
        a.status = RequestStatus.FINISHED_ABORTED
        assert mgr.finish(a) is False
        assert mgr.core.take_boundary_state_offloads() == {}
        _offload_counters_zero(mgr.stats())
        clean(mgr)
        # The device still serves the prefix, up to the partial tail the core cached.
        b = mgr.new_request("b", list(range(100, 130)), tenant="acme")
        adm = mgr.allocate(b, await mgr.lookup(b))
        assert adm is not None and (adm.local_tokens, adm.external_tokens) == (28, 0)
        assert adm.num_new_tokens == 2
        b.status = RequestStatus.RUNNING
        model.step(b, adm.num_new_tokens)
        mgr.after_step([b])
        proceed(mgr, model, b)
        mgr.finish(b)
        clean(mgr)


@pytest.mark.asyncio
async def test_misuse_still_raises() -> None:
    async with _off_twin(make_manager()) as mgr, make_manager() as other:
        a = mgr.new_request("a", list(range(20)), tenant="acme")
        with pytest.raises(ValueError, match="already exists"):
            mgr.new_request("a", [1, 2], tenant="acme")
        stranger = other.new_request("s", list(range(20)), tenant="acme")
        with pytest.raises(ValueError, match="not managed here"):
            await mgr.lookup(stranger)
        with pytest.raises(ValueError, match="not managed here"):
            mgr.after_step([stranger])
        with pytest.raises(ValueError, match="holds no blocks"):
            mgr.preempt(a)
        with pytest.raises(ValueError, match="has no load"):
            await mgr.wait_load(a)
        found = await mgr.lookup(a)
        assert mgr.allocate(a, found) is not None
        with pytest.raises(ValueError, match="already holds blocks"):
            await mgr.lookup(a)
        with pytest.raises(ValueError, match="unknown prefix group"):
            mgr.new_request("g", list(range(20)), tenant="acme", prefix_group="x",
                            shared_prefix_tokens=8)
        mgr.finish(a)
        other.finish(stranger)
        clean(mgr)


@pytest.mark.asyncio
async def test_tenants_and_groups_work_without_tiers() -> None:
    policy = TenantPolicy(
        {"acme": TenantQuota(max_tier_bytes={"memory": 1}), "zen": TenantQuota()},
        groups=[PrefixGroup("shared", frozenset({"acme", "zen"}), max_prefix_tokens=12)])
    # A tier quota cannot bind with nothing stored: the config stays valid with offload off.
    async with _off_twin(make_manager(), tenants=policy) as mgr:
        model = FakeModel(mgr)
        prompt = [*range(500, 512), *range(20)]
        a = mgr.new_request("a", prompt, tenant="acme", prefix_group="shared",
                            shared_prefix_tokens=12)
        _, step = await admit(mgr, a)
        model.step(a, step.num_new_tokens)
        mgr.after_step([a])
        mgr.finish(a)
        z = mgr.new_request("z", prompt, tenant="zen", prefix_group="shared",
                            shared_prefix_tokens=12)
        adm = mgr.allocate(z, await mgr.lookup(z))
        assert adm is not None and adm.local_tokens == 12  # the group's part only
        mgr.finish(z)
        with pytest.raises(ValueError, match="unknown tenant"):
            mgr.new_request("x", [1, 2, 3], tenant="other")
        ts = mgr.tenant_stats()
        assert dict(ts["zen"].hit_tokens) == {"device": 12}
        assert dict(ts["acme"].hit_tokens) == {"device": 0}
        assert (ts["acme"].queries, ts["acme"].queried_tokens) == (1, 32)
        assert (ts["zen"].queries, ts["zen"].queried_tokens) == (1, 32)
        assert dict(ts["acme"].stored_bytes_by_tier) == {} and ts["acme"].stores == 0
        clean(mgr)
