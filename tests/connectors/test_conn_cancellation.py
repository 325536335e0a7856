"""Cancellation never leaks: connections go back to the pool, writes finish or clean up."""

from __future__ import annotations

import asyncio
import os
import time

import pytest
from conn_testlib import T, make_items, namespace, redis_options, same

from kvplugin.connectors import diskwrite
from kvplugin.connectors.base import ConnectorTimeout
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.faults import FaultInjector, FaultPlan, LocalRedisServer
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.redis import RedisConnector
from kvplugin.connectors.tiered import TieredConnector

pytestmark = pytest.mark.asyncio
MIB = 1 << 20


async def test_cancelled_redis_calls_give_their_connections_back(
    private_redis: LocalRedisServer,
) -> None:
    # Two connections, no socket timeout to speak of: only cancellation ends the calls.
    opts = redis_options(private_redis.url, max_connections=2, socket_timeout=60.0, retries=0)
    items = make_items(namespace(), 4)
    keys = [k for k, _ in items]
    async with RedisConnector(opts) as conn:
        await conn.put(items, timeout=T)
        private_redis.pause()
        try:
            stuck = [asyncio.ensure_future(conn.get(keys, timeout=60)) for _ in range(4)]
            stuck.append(asyncio.ensure_future(conn.put(items, timeout=60)))
            await asyncio.sleep(0.2)
            for task in stuck:
                task.cancel()
            results = await asyncio.gather(*stuck, return_exceptions=True)
            assert all(isinstance(r, asyncio.CancelledError) for r in results)
        finally:
            private_redis.resume()
        # Had a cancelled call kept a connection, these would wait for the pool and miss.
        for _ in range(3):
            got = await asyncio.gather(*(conn.get(keys, timeout=T) for _ in range(6)))
            assert all(same(g, b) for r in got for g, (_, b) in zip(r, items, strict=True))
        assert conn.breaker_state == "closed"


def slow_writes(monkeypatch: pytest.MonkeyPatch) -> None:
    def slow_write_all(fd: int, parts: object) -> None:
        for part in parts:  # type: ignore[attr-defined]
            view = memoryview(part).cast("B")
            for i in range(0, view.nbytes, 16384):
                os.write(fd, view[i : i + 16384])
                time.sleep(0.002)

    monkeypatch.setattr(diskwrite, "_write_all", slow_write_all)


async def test_cancelled_disk_put_lands_whole_or_not_at_all(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    slow_writes(monkeypatch)
    items = make_items(namespace(), 2, nbytes=256 * 1024)
    late = make_items(namespace(), 1, nbytes=256 * 1024)
    root = os.path.join(tmp_path, "d")
    async with DiskConnector(root, capacity_bytes=8 * MIB) as conn:
        task = asyncio.ensure_future(conn.put(items, timeout=T))
        await asyncio.sleep(0.02)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        with pytest.raises(ConnectorTimeout):  # a deadline is the same story
            await conn.put(late, timeout=0.01)
    # aclose() waited for the detached writes. A write already under way when its caller
    # gave up lands whole; one still queued is dropped (how far each got depends on the
    # machine's load): a fresh connector sees whole objects or nothing, never a torn one.
    async with DiskConnector(root, capacity_bytes=8 * MIB) as conn:
        both = items + late
        got = await conn.get([k for k, _ in both], timeout=T)
        assert all(g is None or same(g, b) for g, (_, b) in zip(got, both, strict=True))
        assert len(conn) == sum(g is not None for g in got)
        assert conn.stats().corrupt_detected == 0
        assert not [n for _, _, names in os.walk(root) for n in names if n.endswith(".tmp")]


async def test_cancelled_tiered_get_leaves_nothing_running() -> None:
    slow = FaultInjector(
        MemoryConnector(capacity_bytes=MIB), FaultPlan(latency_rate=1.0, latency=5.0), seed=3
    )
    items = make_items(namespace(), 1)
    tiered = TieredConnector([MemoryConnector(capacity_bytes=MIB, name="top"), slow])
    await slow.inner.put(items, timeout=T)
    task = asyncio.ensure_future(tiered.get([items[0][0]], timeout=T))
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await tiered.aclose()
    assert not tiered._promotions
