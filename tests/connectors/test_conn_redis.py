"""Redis under failure: killed, hung, restarted, full; shared between processes.

Every server here is one this test session started (never the machine's own Redis). The
deadline checks are liveness checks (a call must come back), not speed assertions: the outer
guard is the deadline plus a generous margin.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
from collections.abc import Awaitable
from typing import TypeVar

import pytest
import redis.asyncio as aioredis
from conn_testlib import T, make_items, namespace, redis_options, same

from kvplugin.connectors.base import ConnectorError, ConnectorTimeout, StorageFull
from kvplugin.connectors.faults import LocalRedisServer
from kvplugin.connectors.redis import RedisConnector, RedisOptions

pytestmark = pytest.mark.asyncio
R = TypeVar("R")
DEADLINE = 0.4
MARGIN = 5.0  # how long "returned within its deadline" may take on a loaded CI machine
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


async def returns(aw: Awaitable[R]) -> R:
    """The call must come back (value or exception) instead of hanging."""
    async with asyncio.timeout(DEADLINE + MARGIN):
        return await aw


async def outcome(aw: Awaitable[object]) -> object:
    try:
        return await returns(aw)
    except ConnectorError as exc:
        return exc


async def wait_until_serving(conn: RedisConnector, items: list) -> None:
    for _ in range(200):
        try:
            if await conn.put(items, timeout=DEADLINE) == len(items):
                return
        except ConnectorError:
            pass
        await asyncio.sleep(0.05)
    raise AssertionError("connector did not serve again after the restart")


async def test_killed_server_degrades_then_recovers_without_a_new_connector(
    private_redis: LocalRedisServer,
) -> None:
    conn = RedisConnector(redis_options(private_redis.url, breaker_threshold=3))
    items = make_items(namespace(), 4)
    keys = [k for k, _ in items]
    async with conn:
        assert await conn.put(items, timeout=T) == 4
        private_redis.kill()
        for _ in range(5):  # reads become misses, writes clear errors; nothing hangs
            assert await returns(conn.lookup(keys, timeout=DEADLINE)) == 0
            assert await returns(conn.get(keys, timeout=DEADLINE)) == [None] * 4
            assert isinstance(await outcome(conn.put(items, timeout=DEADLINE)), ConnectorError)
            assert isinstance(await outcome(conn.delete(keys, timeout=DEADLINE)), ConnectorError)
        assert not (await returns(conn.health(timeout=DEADLINE))).ok
        assert conn.breaker_state in ("open", "half_open")
        assert conn.stats().errors + conn.stats().timeouts >= 20

        private_redis.start()  # same port; no persistence, so the data is gone
        await wait_until_serving(conn, items)
        assert conn.breaker_state == "closed"
        got = await conn.get(keys, timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        assert (await conn.health(timeout=T)).ok


async def test_hung_server_calls_end_within_their_deadline(
    private_redis: LocalRedisServer,
) -> None:
    # Socket timeout above the deadline: only the deadline can end these calls.
    conn = RedisConnector(redis_options(private_redis.url, socket_timeout=30.0, retries=0))
    items = make_items(namespace(), 2)
    keys = [k for k, _ in items]
    async with conn:
        await conn.put(items, timeout=T)
        private_redis.pause()
        try:
            assert await returns(conn.get(keys, timeout=DEADLINE)) == [None, None]
            assert await returns(conn.lookup(keys, timeout=DEADLINE)) == 0
            with pytest.raises(ConnectorTimeout):
                await returns(conn.put(items, timeout=DEADLINE))
            assert conn.stats().timeouts >= 3
        finally:
            private_redis.resume()
        for _ in range(100):  # after the breaker's cool-down the same connector serves
            got = await conn.get(keys, timeout=T)
            if got[0] is not None:
                break
            await asyncio.sleep(0.05)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))


async def test_breaker_fails_fast_while_open(private_redis: LocalRedisServer) -> None:
    conn = RedisConnector(
        redis_options(private_redis.url, breaker_threshold=2, breaker_cooldown=60.0, retries=0)
    )
    ((key, block),) = make_items(namespace(), 1)
    async with conn:
        private_redis.kill()
        for _ in range(2):
            await outcome(conn.put([(key, block)], timeout=DEADLINE))
        assert conn.breaker_state == "open"
        errors = conn.stats().errors
        exc = await outcome(conn.put([(key, block)], timeout=DEADLINE))
        assert type(exc).__name__ == "CircuitOpen"
        assert await conn.get([key], timeout=DEADLINE) == [None]
        assert conn.stats().errors == errors + 2


async def test_ttl_is_applied(redis_server: LocalRedisServer) -> None:
    conn = RedisConnector(redis_options(redis_server.url, ttl_seconds=100))
    raw = aioredis.Redis.from_url(redis_server.url)
    ((key, block),) = make_items(namespace(), 1)
    async with conn:
        assert conn.capabilities.ttl
        await conn.put([(key, block)], timeout=T)
        assert 0 < await raw.ttl(conn.redis_key(key.id)) <= 100
    await raw.aclose()


async def test_server_out_of_memory_is_storage_full(private_redis: LocalRedisServer) -> None:
    raw = aioredis.Redis.from_url(private_redis.url)
    await raw.config_set("maxmemory", 2 * 1024 * 1024)
    await raw.config_set("maxmemory-policy", "noeviction")
    await raw.aclose()
    conn = RedisConnector(redis_options(private_redis.url))
    async with conn:
        items = make_items(namespace(), 1, nbytes=4 * 1024 * 1024)
        with pytest.raises(StorageFull):
            await conn.put(items, timeout=T)
        assert conn.breaker_state == "closed"  # an answering server is not a failing one
        small = make_items(namespace(), 1, nbytes=1024)
        await conn.put(small, timeout=T)  # still usable


async def test_options_are_validated() -> None:
    with pytest.raises(ValueError, match="prefix"):
        RedisOptions(prefix="bad prefix\r\n")
    with pytest.raises(ValueError, match="ttl"):
        RedisOptions(ttl_seconds=0)
    with pytest.raises(ValueError, match="max_connections"):
        RedisOptions(max_connections=0)


CHILD = textwrap.dedent(
    """
    import asyncio, sys
    sys.path.insert(0, {tests!r})
    from conn_testlib import make_items, namespace, same
    from kvplugin.connectors.redis import RedisConnector, RedisOptions

    async def main(mode, tenant, seed):
        items = make_items(namespace(tenant), 8, nbytes=3000, seed=seed)
        async with RedisConnector(RedisOptions(url={url!r})) as conn:
            if mode == "write":
                assert await conn.put(items, timeout=5) == 8
            else:
                got = await conn.get([k for k, _ in items], timeout=5)
                assert all(same(g, b) for g, (_, b) in zip(got, items)), "mismatch"
        print("ok")

    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3])))
    """
)


def run_child(url: str, mode: str, tenant: str, seed: int, hash_seed: str) -> None:
    code = CHILD.format(tests=os.path.dirname(os.path.abspath(__file__)), url=url)
    env = {**os.environ, "PYTHONHASHSEED": hash_seed, "PYTHONPATH": REPO}
    done = subprocess.run(
        [sys.executable, "-c", code, mode, tenant, str(seed)],
        env=env, capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr


async def test_two_processes_read_each_others_objects(redis_server: LocalRedisServer) -> None:
    tenant = namespace().tenant
    # Another process (another hash seed) writes, this one reads...
    await asyncio.to_thread(run_child, redis_server.url, "write", tenant, 1, "123")
    items = make_items(namespace(tenant), 8, nbytes=3000, seed=1)
    async with RedisConnector(RedisOptions(url=redis_server.url)) as conn:
        got = await conn.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        # ...and this one writes what a third process reads.
        mine = make_items(namespace(tenant), 8, nbytes=3000, seed=2)
        assert await conn.put(mine, timeout=T) == 8
    await asyncio.to_thread(run_child, redis_server.url, "read", tenant, 2, "456")


@pytest.mark.parametrize("protocol", [2, 3])
async def test_resp2_and_resp3_behave_alike(redis_server: LocalRedisServer, protocol: int) -> None:
    # Batches of 16: several pipelines per call, each reply read by the connector's reader
    # in the protocol the connection negotiated (redis-py defaults to RESP3).
    url = f"{redis_server.url}?protocol={protocol}"
    opts = redis_options(url, get_batch=16, lookup_batch=16)
    raw = aioredis.Redis.from_url(redis_server.url)
    items = make_items(namespace(), 40, nbytes=3000)
    keys = [k for k, _ in items]
    async with RedisConnector(opts) as conn:
        assert await conn.put(items, timeout=T) == 40
        await raw.delete(conn.redis_key(keys[30].id))
        await raw.lpush(conn.redis_key(keys[30].id), b"not ours")
        got = await conn.get(keys, timeout=T)  # the list is a counted corrupt miss...
        assert got[30] is None and conn.stats().corrupt_detected == 1
        assert all(same(g, b) for g, (_, b) in zip(got[:30], items[:30], strict=True))
        await raw.lpush(conn.redis_key(keys[30].id), b"not ours")
        assert await conn.lookup(keys, timeout=T) == 30  # ...here too
        assert conn.stats().corrupt_detected == 2
        assert await conn.put(items, timeout=T) == 40
        assert await conn.lookup(keys, timeout=T) == 40
        assert await conn.delete(keys, timeout=T) == 40
        assert (await conn.health(timeout=T)).ok
    await raw.aclose()
