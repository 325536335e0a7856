"""Tier events: what a consumer learns from ``take_events`` matches what each tier holds.

A random workload (puts under eviction pressure, deletes, damaged objects found by loads)
runs on each tier kind and on a tiered stack; a consumer applies the events as a router
would (stored adds, removed takes away, cleared forgets the tier) and must end believing
exactly what every tier holds. Redis's own removals (another writer's delete, standing in
for its LRU and TTLs) are learnt at the next lookup or load that meets them.
"""

from __future__ import annotations

import random
from collections import defaultdict

import pytest
from conn_testlib import T, make_items, namespace, redis_options, unique_tenant

from kvplugin.connectors.base import Connector, PutItem
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.events import EventLog, TierEvent
from kvplugin.connectors.faults import LocalRedisServer
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.redis import RedisConnector
from kvplugin.connectors.tiered import TieredConnector

pytestmark = pytest.mark.asyncio
KIB = 1024


class Router:
    """A router's belief, per tier, built from events only."""

    def __init__(self) -> None:
        self.present: dict[str, set[str]] = defaultdict(set)

    def apply(self, events: list[TierEvent]) -> None:
        for e in events:
            if e.kind == "stored":
                self.present[e.tier].update(e.ids)
            elif e.kind == "removed":
                self.present[e.tier].difference_update(e.ids)
            else:
                assert e.kind == "cleared"
                self.present[e.tier].clear()


def plain_tiers(conn: Connector) -> list[Connector]:
    return list(conn.tiers) if isinstance(conn, TieredConnector) else [conn]


async def held(tier: Connector, items: list[PutItem]) -> set[str]:
    """What a memory or disk tier holds of ``items`` (lookups there record no event)."""
    out = set()
    for k, _ in items:
        if await tier.lookup([k], timeout=T) == 1:
            out.add(k.id)
    return out


async def workload(conn: Connector, items: list[PutItem], router: Router, seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(120):
        op = rng.random()
        batch = rng.sample(items, rng.randint(1, 4))
        if op < 0.55:
            await conn.put(batch, timeout=T)
        elif op < 0.7:
            await conn.delete([k for k, _ in batch], timeout=T)
        elif op < 0.8:  # an object damaged in place: the next load drops it
            target = plain_tiers(conn)[-1]
            k = batch[0][0]
            if isinstance(target, DiskConnector | MemoryConnector) and await target.lookup(
                    [k], timeout=T):
                await target.write_raw(k, b"\0" * 64, timeout=T)
            await conn.get([k], timeout=T)
        else:
            await conn.get([k for k, _ in batch], timeout=T)
        if rng.random() < 0.3:
            router.apply(conn.take_events())
    router.apply(conn.take_events())


@pytest.mark.parametrize("kind", ["memory", "disk", "tiered"])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("eviction", ["lru", "arc"])  # ARC's ghosts: never an event
async def test_a_router_believes_what_the_tiers_hold(tmp_path: object, kind: str,
                                                     seed: int, eviction: str) -> None:
    items = make_items(namespace(), 24, nbytes=4 * KIB, seed=seed)
    size = 5224  # one encoded object
    memory = MemoryConnector(capacity_bytes=6 * size, eviction=eviction)
    disk = DiskConnector(f"{tmp_path}/d{seed}", capacity_bytes=10 * size, eviction=eviction)
    conn: Connector = {"memory": memory, "disk": disk,
                       "tiered": TieredConnector([memory, disk])}[kind]
    conn.watch_events()
    router = Router()
    async with conn:
        await workload(conn, items, router, seed)
        for tier in plain_tiers(conn):
            truth = await held(tier, items)
            assert router.present[tier.capabilities.tier] == truth, tier.name
        evictions = sum(t.stats().evicted for t in plain_tiers(conn))
        assert evictions > 0  # the workload did evict
    if kind == "memory":
        await disk.aclose()  # never used
    router.apply(conn.take_events())  # closed: nothing is reachable through it any more
    assert not any(router.present.values())


async def test_events_name_the_reason(tmp_path: object) -> None:
    items = make_items(namespace(), 4, nbytes=4 * KIB)
    size = 5224  # one encoded object
    async with MemoryConnector(capacity_bytes=2 * size) as mem:
        assert mem.take_events() == []  # nothing recorded before watch_events
        mem.watch_events()
        await mem.put(items[:2], timeout=T)  # a chain: stored tail first
        await mem.put(items[2:3], timeout=T)  # evicts the least recent: the chain's tail
        await mem.put(items[:1], timeout=T)  # already there: told at once
        await mem.delete([items[2][0]], timeout=T)
        ids = [k.id for k, _ in items]
        got = [(e.kind, e.ids, e.reason) for e in mem.take_events()]
        assert got == [("stored", (ids[1],), ""), ("stored", (ids[0],), ""),
                       ("removed", (ids[1],), "evicted"), ("stored", (ids[2],), ""),
                       ("stored", (ids[0],), ""), ("removed", (ids[2],), "deleted")]
        assert {e.tier for e in mem.take_events()} == set()


async def test_an_overflowing_log_tells_the_consumer_to_forget() -> None:
    log = EventLog("disk", limit=3)
    log.stored(["a", "b"])
    log.stored(["c", "d"])  # past the limit: held events are replaced by one clear
    log.stored(["e"])
    assert [(e.kind, e.ids, e.reason) for e in log.take()] == [
        ("cleared", (), "overflow"), ("stored", ("e",), "")]
    assert log.overflows == 1 and log.take() == []
    with pytest.raises(ValueError, match="positive"):
        EventLog("disk", limit=0)


async def test_redis_removals_by_others_are_learnt_at_lookup_and_load(
    redis_server: LocalRedisServer,
) -> None:
    ns = namespace(unique_tenant("ev"))
    items = make_items(ns, 3, nbytes=2 * KIB)
    ours = RedisConnector(redis_options(redis_server.url))
    other = RedisConnector(redis_options(redis_server.url))  # another writer, or Redis's LRU
    ours.watch_events()
    router = Router()
    async with ours, other:
        assert await ours.put(items, timeout=T) == 3
        router.apply(ours.take_events())
        assert router.present["redis"] == {k.id for k, _ in items}
        await other.delete([items[1][0], items[2][0]], timeout=T)
        assert ours.take_events() == []  # nobody told us
        assert await ours.lookup([k for k, _ in items], timeout=T) == 1  # meets item 1 gone
        router.apply(ours.take_events())
        assert router.present["redis"] == {items[0][0].id, items[2][0].id}
        assert await ours.get([items[2][0]], timeout=T) == [None]  # meets item 2 gone
        router.apply(ours.take_events())
        assert router.present["redis"] == {items[0][0].id}
