"""Tiered composition: write-through, union prefix lookups, promotion, tolerance of a bad tier."""

from __future__ import annotations

import asyncio
import logging
import os

import pytest
from conn_testlib import T, chain, make_items, namespace, same
from test_conn_tiered_delete import Gated

from kvplugin.connectors.base import BackendUnavailable
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.faults import FaultInjector, FaultPlan
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.serde import Block

pytestmark = pytest.mark.asyncio
MIB = 1 << 20


def three_tiers(tmp_path: os.PathLike[str]) -> TieredConnector:
    return TieredConnector(
        [
            MemoryConnector(capacity_bytes=MIB, name="mem"),
            DiskConnector(os.path.join(tmp_path, "d1"), capacity_bytes=MIB, name="disk1"),
            DiskConnector(os.path.join(tmp_path, "d2"), capacity_bytes=MIB, name="disk2"),
        ]
    )


async def test_put_writes_through_every_tier(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 3)
    async with three_tiers(tmp_path) as tiered:
        assert await tiered.put(items, timeout=T) == 3
        for tier in tiered.tiers:
            assert await tier.lookup([k for k, _ in items], timeout=T) == 3
        assert tiered.stats().stored == 9  # the tiers' counters, summed


async def test_lower_tier_hit_is_promoted_to_the_tiers_above(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 2)
    keys = [k for k, _ in items]
    async with three_tiers(tmp_path) as tiered:
        mem, disk1, disk2 = tiered.tiers
        await disk2.put(items, timeout=T)
        got = await tiered.get(keys, timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        assert tiered.hits_by_tier == [0, 0, 2]
        await tiered.drain()
        assert await mem.lookup(keys, timeout=T) == 2
        assert await disk1.lookup(keys, timeout=T) == 2
        await tiered.get(keys, timeout=T)
        assert tiered.hits_by_tier == [2, 0, 2]


async def test_tiers_are_told_apart_by_name() -> None:
    twins = [MemoryConnector(capacity_bytes=MIB), MemoryConnector(capacity_bytes=MIB)]
    with pytest.raises(ValueError, match=r"need distinct names, got \['memory', 'memory'\]"):
        TieredConnector(twins)
    named = [MemoryConnector(capacity_bytes=MIB, name="hot"), twins[0]]
    async with TieredConnector(named) as tiered:
        assert [t.name for t in tiered.levels] == ["hot", "memory"]
        items = make_items(namespace(), 3)
        await named[1].put(items[1:], timeout=T)
        await named[0].put(items[:2], timeout=T)
        # The union, and per key the tier its get reads it from (top-down at each key).
        assert await tiered.lookup_levels([k for k, _ in items], timeout=T) == [0, 0, 1]
        assert await tiered.lookup([k for k, _ in items], timeout=T) == 3
    await twins[1].aclose()


async def test_promotion_can_be_turned_off(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 1)
    tiers = [MemoryConnector(capacity_bytes=MIB, name=f"m{i}") for i in range(2)]
    async with TieredConnector(tiers, promote=False) as tiered:
        await tiers[1].put(items, timeout=T)
        assert (await tiered.get([items[0][0]], timeout=T))[0] is not None
        await tiered.drain()
        assert await tiers[0].lookup([items[0][0]], timeout=T) == 0


async def test_lookup_counts_the_prefix_across_tiers(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 5)
    keys = [k for k, _ in items]
    async with three_tiers(tmp_path) as tiered:
        mem, disk1, disk2 = tiered.tiers
        await disk1.put([items[0]], timeout=T)
        await mem.put([items[1]], timeout=T)
        await disk2.put([items[2]], timeout=T)
        await disk1.put([items[4]], timeout=T)  # 3 is nowhere: the prefix stops there
        assert await tiered.lookup(keys, timeout=T) == 3
        got = await tiered.get(keys, timeout=T)
        assert [g is not None for g in got] == [True, True, True, False, True]


async def test_a_failing_tier_does_not_fail_the_others(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 2)
    broken = FaultInjector(MemoryConnector(capacity_bytes=MIB), FaultPlan(error_rate=1.0), seed=1)
    good = MemoryConnector(capacity_bytes=MIB, name="good")
    async with TieredConnector([broken, good]) as tiered:
        assert await tiered.put(items, timeout=T) == 2
        got = await tiered.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        assert not (await tiered.health(timeout=T)).ok
        assert tiered.stats().errors >= 2
        # What each tier ended with: the broken one nothing (None), the good one both.
        more = make_items(namespace(), 3)
        assert await tiered.put_per_tier(more, timeout=T) == [None, 3]
        assert await good.put_per_tier(more, timeout=T) == [3]  # a plain connector: one tier


async def test_put_per_tier_counts_what_each_tier_holds(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 3)
    async with three_tiers(tmp_path) as tiered:
        mem, disk1, _ = tiered.tiers
        await disk1.put(items[:1], timeout=T)
        # Present counts, as put's: objects already there count once written.
        assert await tiered.put_per_tier(items, timeout=T) == [3, 3, 3]
        assert await tiered.put_per_tier([], timeout=T) == [0, 0, 0]
        assert disk1.stats().existing == 1 and mem.stats().stored == 3


async def test_every_tier_failing_raises(tmp_path: os.PathLike[str]) -> None:
    plan = FaultPlan(error_rate=1.0)
    tiers = [FaultInjector(MemoryConnector(capacity_bytes=MIB, name=f"m{i}"), plan, seed=i)
             for i in range(2)]
    async with TieredConnector(tiers) as tiered:
        with pytest.raises(BackendUnavailable):
            await tiered.put(make_items(namespace(), 1), timeout=T)


async def test_delete_removes_every_copy(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 2)
    keys = [k for k, _ in items]
    async with three_tiers(tmp_path) as tiered:
        await tiered.put(items, timeout=T)
        assert await tiered.delete(keys, timeout=T) == 2
        for tier in tiered.tiers:
            assert await tier.lookup(keys, timeout=T) == 0
        assert await tiered.get(keys, timeout=T) == [None, None]


async def test_a_tiered_connector_needs_tiers() -> None:
    with pytest.raises(ValueError, match="at least one tier"):
        TieredConnector([])


# --- promotion under load, reads and health over a misbehaving tier ---------------------------


def gated_pair(**kw: object) -> tuple[TieredConnector, Gated, Gated]:
    top, low = Gated("top"), Gated("low")
    return TieredConnector([top, low], **kw), top, low  # type: ignore[arg-type]


async def test_promotions_in_flight_are_capped_and_the_extra_dropped() -> None:
    items = make_items(namespace(), 5)
    tiered, top, low = gated_pair(max_promotions=2)
    async with tiered:
        await low.inner.put(items, timeout=T)
        promotions = top.hold("put")
        for key, _ in items:
            assert (await tiered.get([key], timeout=T))[0] is not None
        assert len(tiered._promotions) == 2 and tiered.promotions_dropped == 3
        promotions.open()
        await tiered.drain()
        assert len(top.inner) == 2
        assert (await tiered.get([items[4][0]], timeout=T))[0] is not None  # promoted later
        await tiered.drain()
        assert len(top.inner) == 3


async def test_max_promotions_is_validated() -> None:
    with pytest.raises(ValueError, match="max_promotions"):
        TieredConnector([MemoryConnector(capacity_bytes=MIB)], max_promotions=0)


async def test_an_object_being_promoted_is_not_promoted_again() -> None:
    items = make_items(namespace(), 1)
    keys = [k for k, _ in items]
    tiered, top, low = gated_pair()
    async with tiered:
        await low.inner.put(items, timeout=T)
        promotion = top.hold("put")
        await asyncio.gather(*(tiered.get(keys, timeout=T) for _ in range(4)))
        assert len(tiered._promotions) == 1
        promotion.open()
        await tiered.drain()
        assert top.stats().stored == 1 and top.stats().existing == 0


async def test_no_promotion_to_a_tier_too_small_for_the_object() -> None:
    items = make_items(namespace(), 1, nbytes=8192)
    keys = [k for k, _ in items]
    small = MemoryConnector(capacity_bytes=4096, name="small")
    big = MemoryConnector(capacity_bytes=MIB, name="big")
    async with TieredConnector([small, big]) as tiered:
        await big.put(items, timeout=T)
        for _ in range(3):
            assert (await tiered.get(keys, timeout=T))[0] is not None
        await tiered.drain()
        assert small.stats().rejected == 0 and not tiered._promotions


async def test_blocks_without_their_verified_bytes_are_not_promoted() -> None:
    # Promoting them means encoding the payload the caller holds, after get returned: a
    # payload the caller changed meanwhile would be stored as a valid object.
    items = make_items(namespace(), 1)
    keys = [k for k, _ in items]
    tiered, top, low = gated_pair()
    async with tiered:
        await low.inner.put(items, timeout=T)
        low.bare = True
        (got,) = await tiered.get(keys, timeout=T)
        assert isinstance(got, Block) and isinstance(got.payload, bytearray)
        got.payload[0] ^= 0xFF  # the caller reuses its buffer
        await tiered.drain()
        stored = (await top.inner.get(keys, timeout=T))[0]
        assert stored is None or same(stored, items[0][1]), "the changed payload was stored"


async def test_a_cancelled_get_counts_nothing() -> None:
    items = make_items(namespace(), 2)
    (a, _), (b, _) = items
    tiered, top, low = gated_pair()
    async with tiered:
        await top.inner.put([items[0]], timeout=T)
        await low.inner.put([items[1]], timeout=T)
        stuck = low.hold("get")
        reading = asyncio.ensure_future(tiered.get([a, b], timeout=T))
        await stuck.until_reached()  # the top tier has answered its hit
        reading.cancel()
        with pytest.raises(asyncio.CancelledError):
            await reading
        stats = tiered.stats()
        assert sum(tiered.hits_by_tier) == stats.hits == 0 and stats.misses == 0


async def test_a_get_out_of_time_before_the_lower_tiers_counts_a_timeout() -> None:
    items = make_items(namespace(), 1)
    slow = FaultInjector(
        MemoryConnector(capacity_bytes=MIB), FaultPlan(latency_rate=1.0, latency=30.0), seed=1
    )
    lower = MemoryConnector(capacity_bytes=MIB, name="lower")
    async with TieredConnector([slow, lower]) as tiered:
        await lower.put(items, timeout=T)
        assert await tiered.get([items[0][0]], timeout=0.05) == [None]
        tier_timeouts = sum(s.timeouts for s in tiered.tier_stats())
        assert tiered.stats().timeouts == tier_timeouts + 1
        assert tiered.stats().misses == 1


async def test_a_tier_raising_a_backend_error_on_reads_is_a_miss() -> None:
    items = make_items(namespace(), 1)
    keys = [k for k, _ in items]
    tiered, top, low = gated_pair()
    async with tiered:
        await low.inner.put(items, timeout=T)
        top.fail("get", BackendUnavailable("down"))
        top.fail("lookup", BackendUnavailable("down"))
        assert await tiered.lookup(keys, timeout=T) == 1
        assert same((await tiered.get(keys, timeout=T))[0], items[0][1])
        assert tiered.stats().errors == 2


@pytest.mark.parametrize("op", ["get", "lookup"])
async def test_a_tier_raising_anything_else_on_reads_propagates(op: str) -> None:
    items = make_items(namespace(), 1)
    tiered, top, _ = gated_pair()
    async with tiered:
        top.fail(op, TypeError("a bug, not backend trouble"))
        with pytest.raises(TypeError, match="a bug"):
            await getattr(tiered, op)([items[0][0]], timeout=T)


async def test_delete_raises_misuse_ahead_of_a_backend_failure() -> None:
    tiered, top, low = gated_pair()
    async with tiered:
        top.fail("delete", BackendUnavailable("down"))
        low.fail("delete", TypeError("a bug"))
        with pytest.raises(TypeError, match="a bug"):
            await tiered.delete([make_items(namespace(), 1)[0][0]], timeout=T)


async def test_delete_raises_when_a_tier_failed_though_the_others_deleted() -> None:
    items = make_items(namespace(), 1)
    keys = [k for k, _ in items]
    tiered, top, low = gated_pair()
    async with tiered:
        await tiered.put(items, timeout=T)
        top.fail("delete", BackendUnavailable("down"))
        with pytest.raises(BackendUnavailable):  # the top tier may still hold it
            await tiered.delete(keys, timeout=T)
        assert await low.inner.lookup(keys, timeout=T) == 0
        assert await top.inner.lookup(keys, timeout=T) == 1


async def test_health_reads_a_tier_raising_a_backend_error_as_unhealthy() -> None:
    tiered, top, _ = gated_pair()
    async with tiered:
        top.fail("health", BackendUnavailable("down"))
        health = await tiered.health(timeout=T)
        assert not health.ok and "top: BackendUnavailable: down" in health.detail


async def test_health_propagates_a_bug_only_once_every_tier_answered() -> None:
    tiered, top, low = gated_pair()
    async with tiered:
        top.fail("health", RuntimeError("a bug"))
        answer = low.hold("health")
        probing = asyncio.ensure_future(tiered.health(timeout=T))
        await answer.until_reached()
        await asyncio.sleep(0.01)
        answered_early = probing.done()
        answer.open()
        with pytest.raises(RuntimeError, match="a bug"):
            await probing
        assert not answered_early, "a tier's health call was left running"


async def test_a_promotion_failing_with_a_bug_is_logged(caplog: pytest.LogCaptureFixture) -> None:
    items = make_items(namespace(), 1)
    tiered, top, low = gated_pair()
    async with tiered:
        await low.inner.put(items, timeout=T)
        top.fail("put", RuntimeError("a bug"))
        with caplog.at_level(logging.ERROR, logger="kvplugin.connectors.tiered"):
            await tiered.get([items[0][0]], timeout=T)
            await tiered.drain()
        assert "promotion to top raised" in caplog.text and "a bug" in caplog.text


async def test_a_get_answered_after_aclose_starts_no_promotion() -> None:
    items = make_items(namespace(), 1)
    tiered, _, low = gated_pair()
    await low.inner.put(items, timeout=T)
    answer = low.hold("get", after=True)
    reading = asyncio.ensure_future(tiered.get([items[0][0]], timeout=T))
    await answer.until_reached()
    closing = asyncio.ensure_future(tiered.aclose())
    await asyncio.sleep(0)
    answer.open()
    await reading
    promotions = len(tiered._promotions)
    await closing
    assert promotions == 0


async def test_a_cancelled_put_never_stores_the_changed_buffer_as_valid() -> None:
    # A tier's write may still land after the cancelled put returned (a request already sent
    # to Redis): the bytes were checksummed before any tier saw them, so a payload the
    # caller changed since is caught on load.
    ns = namespace()
    key = ns.key(chain(1)[0])
    payload = bytearray(b"\x07" * 2048)
    block = Block(key.meta(token_start=0, token_end=16, dtype="uint8", shape=(2, 1024)), payload)
    original = Block(block.meta, bytes(payload))
    tiered, top, _ = gated_pair()
    async with tiered:
        landing = top.hold("put")
        putting = asyncio.ensure_future(tiered.put([(key, block)], timeout=T))
        await landing.until_reached()
        putting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await putting
        payload[:] = b"\x09" * 2048
        landing.open()
        await asyncio.gather(*top.landing)
        stored = (await top.inner.get([key], timeout=T))[0]
        assert stored is None or same(stored, original), "the changed payload was stored"
