"""Tiered composition: write-through, union prefix lookups, promotion, tolerance of a bad tier."""

from __future__ import annotations

import os

import pytest
from conn_testlib import T, make_items, namespace, same

from connectors.base import BackendUnavailable
from connectors.disk import DiskConnector
from connectors.faults import FaultInjector, FaultPlan
from connectors.memory import MemoryConnector
from connectors.tiered import TieredConnector

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


async def test_promotion_can_be_turned_off(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 1)
    tiers = [MemoryConnector(capacity_bytes=MIB), MemoryConnector(capacity_bytes=MIB)]
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
    good = MemoryConnector(capacity_bytes=MIB)
    async with TieredConnector([broken, good]) as tiered:
        assert await tiered.put(items, timeout=T) == 2
        got = await tiered.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        assert not (await tiered.health(timeout=T)).ok
        assert tiered.stats().errors >= 2


async def test_every_tier_failing_raises(tmp_path: os.PathLike[str]) -> None:
    plan = FaultPlan(error_rate=1.0)
    tiers = [FaultInjector(MemoryConnector(capacity_bytes=MIB), plan, seed=i) for i in range(2)]
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
