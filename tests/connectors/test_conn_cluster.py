"""Redis Cluster: URLs, per-node pipelining, redirections, a reshard under load, a master
killed mid-load, and what the checks refuse.

Every node is one this test session started (see the conftest). Deadline checks allow the
deadline plus a margin for a loaded 2-core CI machine; they catch a call that waits out a
socket timeout or a failover instead of its deadline.
"""

from __future__ import annotations

import asyncio
import random
import socket
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

import pytest
from conn_testlib import T, chain, make_block, make_items, namespace, same
from redis.crc import key_slot

from kvplugin.connectors.base import BackendUnavailable, ConnectorError, PutItem
from kvplugin.connectors.cluster_testing import LocalRedisCluster
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.redis import RedisConnector
from kvplugin.connectors.redis_cluster import (
    RedisClusterConnector,
    RedisClusterOptions,
    connector_from_url,
    is_cluster_url,
    remote_url_problem,
)
from kvplugin.serde import Block

pytestmark = pytest.mark.asyncio
R = TypeVar("R")
Options = Callable[..., RedisClusterOptions]
DEADLINE = 0.5
SLACK = 0.5  # event-loop lag on a busy machine; a call waiting out a failover takes seconds


# --- URLs and options (no cluster) ------------------------------------------------------------


async def test_url_names_the_startup_nodes_and_credentials() -> None:
    opts = RedisClusterOptions.from_url(
        "redis-cluster://app:s%40cret@10.0.0.1:7000,cache-2:7001,[::1]:7002,cache-3",
        prefix="kv:",
    )
    assert opts.nodes == (("10.0.0.1", 7000), ("cache-2", 7001), ("::1", 7002), ("cache-3", 6379))
    assert (opts.username, opts.password, opts.prefix) == ("app", "s@cret", "kv:")
    assert "s@cret" not in repr(opts) and "s%40cret" not in repr(opts)
    assert "app:***@10.0.0.1:7000" in repr(opts)


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("redis://127.0.0.1:7000", "not a redis-cluster:// URL"),
        ("redis-cluster://127.0.0.1:7000/1", "no database"),
        ("redis-cluster://127.0.0.1:7000?password=x", "no database, path or query"),
        ("redis-cluster://127.0.0.1:70000", "bad port"),
        ("redis-cluster://127.0.0.1:7000,", "bad node ''"),
        ("redis-cluster://:pw@", "bad node ''"),
    ],
)
async def test_bad_urls_are_refused_with_the_reason(url: str, why: str) -> None:
    with pytest.raises(ValueError, match=why):
        RedisClusterOptions.from_url(url)
    if is_cluster_url(url):
        problem = remote_url_problem(url)
        assert problem is not None and why in problem
        assert "pw" not in problem


async def test_options_are_checked_like_the_single_node_ones() -> None:
    url = "redis-cluster://127.0.0.1:7000"
    with pytest.raises(ValueError, match="invalid key prefix"):
        RedisClusterOptions.from_url(url, prefix="a{b}")  # a hash tag would pin every key
    with pytest.raises(ValueError, match="max_connections"):
        RedisClusterOptions.from_url(url, max_connections=0)
    with pytest.raises(ValueError, match="max_redirects"):
        RedisClusterOptions.from_url(url, max_redirects=0)
    assert remote_url_problem(url) is None


async def test_connector_from_url_picks_the_connector() -> None:
    secret = b"s" * 32
    cluster = connector_from_url("redis-cluster://127.0.0.1:7000", secret=secret, retries=1)
    single = connector_from_url("redis://127.0.0.1:7000/2", secret=secret)
    assert type(cluster) is RedisClusterConnector and type(single) is RedisConnector
    assert cluster.options.retries == 1  # type: ignore[attr-defined]
    assert cluster.codec == single.codec  # same secret: the tiers seal alike
    assert cluster.capabilities == single.capabilities
    await cluster.aclose()
    await single.aclose()


# --- helpers ---------------------------------------------------------------------------------


async def timed(aw: Awaitable[R]) -> tuple[R | ConnectorError, float]:
    """The call's outcome (a ConnectorError is an outcome) and how long it took."""
    start = time.monotonic()
    try:
        result: R | ConnectorError = await aw
    except ConnectorError as exc:
        result = exc
    return result, time.monotonic() - start


def slot_of(conn: RedisClusterConnector, key: ObjectKey) -> int:
    return key_slot(conn.redis_key(key.id))


def keys_sharing_a_slot(conn: RedisClusterConnector, n: int) -> list[ObjectKey]:
    """``n`` keys of one namespace that hash to the same slot."""
    ns = namespace()
    by_slot: dict[int, list[ObjectKey]] = {}
    for h in chain(6000, seed=random.randrange(1 << 30)):
        key = ns.key(h)
        same_slot = by_slot.setdefault(slot_of(conn, key), [])
        same_slot.append(key)
        if len(same_slot) == n:
            return same_slot
    raise AssertionError("no slot got enough keys")


def block_items(keys: list[ObjectKey]) -> list[PutItem]:
    return [(k, make_block(k, 1024, index=i)) for i, k in enumerate(keys)]


# --- routing ---------------------------------------------------------------------------------


async def test_batches_are_pipelined_once_per_node(
    redis_cluster: LocalRedisCluster, cluster_options: Options, monkeypatch: pytest.MonkeyPatch
) -> None:
    conn = RedisClusterConnector(cluster_options(redis_cluster.url))
    items = make_items(namespace(), 30, nbytes=512)
    keys = [k for k, _ in items]
    async with conn:
        assert await conn.put(items, timeout=T) == 30
        owners = redis_cluster.slot_owners()
        nodes = {owners[slot_of(conn, k)] for k in keys}
        assert len(nodes) == 3  # 30 keys over 3 masters: every master holds some
        sent: list[tuple[str, int]] = []
        roundtrip = conn._roundtrip

        async def counting(node: str, commands: list[object], asking: list[bool]) -> object:
            sent.append((node, len(commands)))
            return await roundtrip(node, commands, asking)  # type: ignore[arg-type]

        monkeypatch.setattr(conn, "_roundtrip", counting)
        got = await conn.get(keys, timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        assert len(sent) == 3  # one round trip per node, not per key
        assert {int(node.rsplit(":", 1)[1]) for node, _ in sent} == nodes
        assert sum(n for _, n in sent) == 30
        sent.clear()
        assert await conn.lookup(keys, timeout=T) == 30
        assert sorted(n for _, n in sent) == sorted(
            sum(1 for k in keys if owners[slot_of(conn, k)] == port) for port in nodes
        )
        sent.clear()
        assert await conn.delete(keys, timeout=T) == 30  # one UNLINK per key: no CROSSSLOT
        assert len(sent) == 3
        assert conn.stats().errors == 0


async def test_a_slot_being_migrated_is_served_through_ask_then_moved(
    redis_cluster: LocalRedisCluster, cluster_options: Options
) -> None:
    conn = RedisClusterConnector(cluster_options(redis_cluster.url))
    moved, stays, new = block_items(keys_sharing_a_slot(conn, 3))
    slot = slot_of(conn, moved[0])
    async with conn:
        assert await conn.put([moved, stays], timeout=T) == 2
        owners = redis_cluster.slot_owners()
        source = owners[slot]
        target = next(p for p in redis_cluster.masters_ports() if p != source)
        src_id, dst_id = redis_cluster._id(source), redis_cluster._id(target)
        redis_cluster.command(target, "CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
        redis_cluster.command(source, "CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
        key = conn.redis_key(moved[0].id)
        redis_cluster.command(source, "MIGRATE", "127.0.0.1", target, key, 0, 5000)

        # Mid-migration: one object on each side, a new one lands on the target (ASK).
        assert await conn.put([new], timeout=T) == 1
        assert await conn.put([moved], timeout=T) == 1  # already there: kept, not rewritten
        with redis_cluster.client(target) as c, c.pipeline(transaction=False) as pipe:
            pipe.execute_command("ASKING")
            pipe.execute_command("EXISTS", conn.redis_key(new[0].id))
            assert pipe.execute() == [True, 1]  # stored on the importing node
        keys = [moved[0], stays[0], new[0]]
        assert await conn.lookup(keys, timeout=T) == 3
        got = await conn.get(keys, timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, [moved, stays, new], strict=True))

        # Finished: every master announces the new owner; the source answers MOVED.
        key = conn.redis_key(stays[0].id)
        redis_cluster.command(source, "MIGRATE", "127.0.0.1", target, key, 0, 5000)
        for port in (target, source, *redis_cluster.masters_ports()):
            redis_cluster.command(port, "CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        got = await conn.get(keys, timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, [moved, stays, new], strict=True))
        assert conn._slots.get_node_from_slot(slot).port == target  # the map was patched
        stats = conn.stats()
        assert (stats.misses, stats.errors, stats.timeouts, stats.corrupt_detected) == (0, 0, 0, 0)
        assert (stats.stored, stats.existing, stats.hits) == (3, 1, 6)


async def test_slots_migrated_while_stores_and_loads_run(
    redis_cluster: LocalRedisCluster, cluster_options: Options
) -> None:
    conn = RedisClusterConnector(cluster_options(redis_cluster.url))
    items = make_items(namespace(), 240, nbytes=1024, seed=3)
    first, later = items[:120], items[120:]
    async with conn:
        assert await conn.put(first, timeout=T) == 120
        owners = redis_cluster.slot_owners()
        source, target = redis_cluster.masters_ports()[:2]
        slots = sorted({slot_of(conn, k) for k, _ in items if owners[slot_of(conn, k)] == source})
        there = sum(owners[slot_of(conn, k)] == source for k, _ in first)
        assert len(slots) >= 20 and there >= 20
        migration = asyncio.ensure_future(
            asyncio.to_thread(redis_cluster.migrate_slots, slots, source, target, batch=1)
        )
        rng = random.Random(7)
        answers = nones = 0
        stored: list[PutItem] = []
        while not migration.done():
            batch = rng.sample(first, 16)
            got = await conn.get([k for k, _ in batch], timeout=T)
            for g, (_, b) in zip(got, batch, strict=True):
                assert g is None or same(g, b), "a wrong object was returned"
                answers += 1
                nones += g is None
            if later:
                chunk, later = later[:4], later[4:]
                assert await conn.put(chunk, timeout=T) == 4  # writes never fail here
                stored += chunk
            await asyncio.sleep(0.005)  # leave the migrating thread some of the CPU
        moved = await migration
        assert moved >= there and answers > 0 and conn.redirections > 0
        stats = conn.stats()
        assert stats.misses == nones  # any miss is counted ...
        assert (stats.errors, stats.timeouts, stats.corrupt_detected) == (0, 0, 0)  # ... no error
        # Every object readable after, from its new owner.
        owners = redis_cluster.slot_owners()
        assert all(owners[s] == target for s in slots)
        everything = first + stored
        got = await conn.get([k for k, _ in everything], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, everything, strict=True))
        assert await conn.lookup([k for k, _ in everything], timeout=T) == len(everything)


# --- failover ----------------------------------------------------------------------------------


async def test_a_master_killed_mid_load(
    private_cluster: LocalRedisCluster, cluster_options: Options
) -> None:
    """Reads of the dead master's keys become misses (the others are still served), writes
    fail, every call ends within its deadline; the replica is promoted and the same
    connector serves every object again; nothing corrupt or foreign comes back."""
    cluster = private_cluster
    conn = RedisClusterConnector(cluster_options(cluster.url, breaker_threshold=3))
    items = make_items(namespace(), 60, nbytes=2048, seed=5)
    keys = [k for k, _ in items]
    async with conn:
        assert await conn.put(items, timeout=T) == 60
        await asyncio.to_thread(cluster.wait_replicated)
        owners = cluster.slot_owners()
        victim = owners[slot_of(conn, keys[0])]
        replica = cluster.replica_of(victim)
        on_victim = [owners[slot_of(conn, k)] == victim for k in keys]
        assert 0 < sum(on_victim) < 60

        cluster.kill(victim)
        promoted = asyncio.ensure_future(asyncio.to_thread(cluster.wait_ok, timeout=30))
        slowest = 0.0
        partial = write_errors = 0
        fresh = make_items(namespace(), 400, nbytes=512, seed=6)
        while not promoted.done():
            got, took = await timed(conn.get(keys, timeout=DEADLINE))
            slowest = max(slowest, took)
            assert isinstance(got, list)  # reads never raise
            for g, (_, b) in zip(got, items, strict=True):
                assert g is None or same(g, b), "a wrong object was returned"
            hits = [g is not None for g in got]
            partial += any(hits) and not all(hits)
            put, took = await timed(conn.put(fresh[:1], timeout=DEADLINE))
            slowest = max(slowest, took)
            if isinstance(put, ConnectorError):
                write_errors += 1
            else:
                fresh = fresh[1:]
            n, took = await timed(conn.lookup(keys, timeout=DEADLINE))
            slowest = max(slowest, took)
            assert isinstance(n, int) and 0 <= n <= 60
            await asyncio.sleep(0.005)
        await promoted
        assert slowest <= DEADLINE + SLACK, f"a call took {slowest:.2f}s"
        assert partial > 0  # the other masters' keys were served while one was down
        assert conn.stats().misses > 0 and conn.stats().errors > 0

        # The replica serves the dead master's slots; the same connector finds it (once
        # its slot map is refreshed, within a moment: calls never wait for that).
        assert cluster.slot_owners()[slot_of(conn, keys[0])] == replica
        for _ in range(100):
            got = await conn.get(keys, timeout=T)
            if all(g is not None for g in got):
                break
            await asyncio.sleep(0.05)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        assert await conn.lookup(keys, timeout=T) == 60
        assert await conn.put(fresh[:20], timeout=T) == 20
        assert (await conn.health(timeout=T)).ok
        assert conn.stats().corrupt_detected == 0


async def test_a_hung_master_is_cut_by_deadlines_then_fails_fast(
    start_cluster: Callable[..., LocalRedisCluster], cluster_options: Options
) -> None:
    """A master that stops answering (SIGSTOP; the cluster does not fail it over within
    this test) costs each call its deadline until the node's breaker opens; from then on
    calls come back at once with the other masters' keys, and the node is used again after
    it answers."""
    cluster = start_cluster(node_timeout_ms=10_000)
    conn = RedisClusterConnector(
        cluster_options(cluster.url, breaker_threshold=2, breaker_cooldown=0.5)
    )
    items = make_items(namespace(), 60, nbytes=1024, seed=8)
    keys = [k for k, _ in items]
    async with conn:
        assert await conn.put(items, timeout=T) == 60
        owners = cluster.slot_owners()
        hung = owners[slot_of(conn, keys[0])]
        on_hung = [owners[slot_of(conn, k)] == hung for k in keys]
        cluster.pause(hung)
        try:
            # Calls stuck on it and cancelled give their connections back, count nothing.
            stuck = [asyncio.ensure_future(conn.get(keys, timeout=60)) for _ in range(4)]
            stuck.append(asyncio.ensure_future(conn.put(items, timeout=60)))
            await asyncio.sleep(0.1)
            for task in stuck:
                task.cancel()
            outcomes = await asyncio.gather(*stuck, return_exceptions=True)
            assert all(isinstance(o, asyncio.CancelledError) for o in outcomes)
            assert all(pool._room._value == 8 for pool in conn._pools.values())
            assert conn.breaker_state(f"127.0.0.1:{hung}") == "closed"
            assert (conn.stats().errors, conn.stats().timeouts) == (0, 0)
            for _ in range(2):  # each waits for the hung node until its deadline
                got, took = await timed(conn.get(keys, timeout=0.2))
                assert got == [None] * 60 and took <= 0.2 + SLACK
            assert conn.stats().timeouts == 2
            assert conn.breaker_state(f"127.0.0.1:{hung}") == "open"
            got, took = await timed(conn.get(keys, timeout=0.2))  # fails fast for one node
            assert isinstance(got, list) and took < 0.2
            for g, (_, b), there in zip(got, items, on_hung, strict=True):
                assert g is None if there else same(g, b)
        finally:
            cluster.resume(hung)
        await asyncio.sleep(0.6)  # the breaker's cool-down: the next call probes the node
        got = await conn.get(keys, timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        assert conn.breaker_state(f"127.0.0.1:{hung}") == "closed"


async def test_no_reachable_node_reads_miss_and_writes_fail_within_the_deadline(
    cluster_options: Options,
) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    conn = RedisClusterConnector(cluster_options(f"redis-cluster://127.0.0.1:{port}"))
    items = make_items(namespace(), 3)
    keys = [k for k, _ in items]
    async with conn:
        for _ in range(3):
            n, took = await timed(conn.lookup(keys, timeout=DEADLINE))
            assert n == 0 and took <= DEADLINE + SLACK
            got, took = await timed(conn.get(keys, timeout=DEADLINE))
            assert got == [None] * 3 and took <= DEADLINE + SLACK
            put, took = await timed(conn.put(items, timeout=DEADLINE))
            assert isinstance(put, BackendUnavailable) and took <= DEADLINE + SLACK
        health = await conn.health(timeout=DEADLINE)
        assert not health.ok and "no node" in health.detail
        assert conn.stats().errors == 9


# --- what the checks refuse ------------------------------------------------------------------


async def test_corrupt_foreign_and_wrong_type_values_are_counted_misses(
    redis_cluster: LocalRedisCluster, cluster_options: Options
) -> None:
    conn = RedisClusterConnector(cluster_options(redis_cluster.url))
    items = make_items(namespace(), 4, nbytes=1024)
    (k0, b0), (k1, b1), (k2, b2), (k3, b3) = items
    async with conn:
        assert await conn.put(items[:2], timeout=T) == 2
        raw = await conn.read_raw(k0, timeout=T)
        assert raw is not None
        damaged = bytearray(raw)
        damaged[len(damaged) // 2] ^= 0xFF
        await conn.write_raw(k0, bytes(damaged), timeout=T)  # a flipped payload byte
        await conn.write_raw(k2, raw, timeout=T)  # k0's object under k2's key: foreign
        owner = redis_cluster.slot_owners()[slot_of(conn, k3)]
        redis_cluster.command(owner, "LPUSH", conn.redis_key(k3.id), "x")  # not a string
        got = await conn.get([k0, k1, k2, k3], timeout=T)
        assert got[0] is None and same(got[1], b1) and got[2] is None and got[3] is None
        stats = conn.stats()
        assert (stats.corrupt_detected, stats.misses, stats.hits) == (3, 3, 1)
        # All three were removed: a put stores fresh objects in their place.
        assert await conn.lookup([k0], timeout=T) == 0
        assert await conn.put([(k0, b0), (k2, b2), (k3, b3)], timeout=T) == 3
        got = await conn.get([k0, k2, k3], timeout=T)
        assert all(same(g, b) for g, b in zip(got, [b0, b2, b3], strict=True))


async def test_put_replaces_a_non_string_value_under_its_key(
    redis_cluster: LocalRedisCluster, cluster_options: Options
) -> None:
    conn = RedisClusterConnector(cluster_options(redis_cluster.url))
    ((key, block),) = make_items(namespace(), 1)
    async with conn:
        owner = redis_cluster.slot_owners()[slot_of(conn, key)]
        redis_cluster.command(owner, "SADD", conn.redis_key(key.id), "member")
        assert await conn.put([(key, block)], timeout=T) == 1
        (got,) = await conn.get([key], timeout=T)
        assert same(got, block)
        assert (conn.stats().stored, conn.stats().corrupt_detected) == (1, 1)


async def test_blocks_are_views_of_the_bytes_read(
    redis_cluster: LocalRedisCluster, cluster_options: Options
) -> None:
    conn = RedisClusterConnector(cluster_options(redis_cluster.url))
    ((key, block),) = make_items(namespace(), 1, nbytes=65536)
    async with conn:
        await conn.put([(key, block)], timeout=T)
        (got,) = await conn.get([key], timeout=T)
        assert isinstance(got, Block) and got.encoded is not None
        assert memoryview(got.payload).obj is memoryview(got.encoded.parts[0]).obj
