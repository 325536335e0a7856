"""Damaged objects are detected on every load, counted, deleted, and never returned.

Per connector kind: 1,000 random single-byte flips and 1,000 random truncations of stored
objects (header, Arrow metadata, padding and payload alike), each followed by a load.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable

import pytest
from conn_testlib import T, make_block, make_items, namespace, same

from kvplugin import serde
from kvplugin.connectors.base import Connector, StoreBase
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.tiered import TieredConnector

pytestmark = pytest.mark.asyncio
DAMAGES = 1000  # of each: flips and truncations
STORE_KINDS = ["memory", "disk", "disk_threads", "redis", "redis_cluster"]  # every backend store


def damage(raw: bytes, rng: random.Random, flip: bool) -> bytearray:
    bad = bytearray(raw)
    if flip:
        bad[rng.randrange(len(bad))] ^= rng.randrange(1, 256)
    else:
        del bad[rng.randrange(len(bad)) :]
    return bad


def objects(n_sizes: tuple[int, ...] = (64, 1000, 6000)) -> list[tuple[ObjectKey, bytes]]:
    """Small objects so a good share of flips lands in the header and Arrow metadata."""
    ns = namespace()
    out = []
    for i, size in enumerate(n_sizes):
        key = ns.key(bytes([i]) * 32)
        block = make_block(key, size, rows=2)
        out.append((key, serde.encode(block.meta, block.payload).join()))
    return out


@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_random_flips_and_truncations_are_all_detected(
    kind: str, make_connector: Callable[[str], Connector]
) -> None:
    conn = make_connector(kind)
    assert isinstance(conn, StoreBase)
    rng = random.Random(f"corruption-{kind}")
    stored = objects()
    async with conn:
        for i in range(2 * DAMAGES):
            key, raw = stored[i % len(stored)]
            await conn.write_raw(key, damage(raw, rng, flip=i % 2 == 0), timeout=T)
            assert await conn.get([key], timeout=T) == [None]
            assert await conn.read_raw(key, timeout=T) is None, "bad object was not deleted"
        stats = conn.stats()
        assert stats.corrupt_detected == 2 * DAMAGES
        assert stats.hits == 0 and stats.misses == 2 * DAMAGES
        # Intact objects still load after all that.
        for key, raw in stored:
            await conn.write_raw(key, raw, timeout=T)
        got = await conn.get([k for k, _ in stored], timeout=T)
        assert all(
            b is not None and b.meta.key == k.id for b, (k, _) in zip(got, stored, strict=True)
        )


async def test_tiered_serves_a_good_copy_past_a_damaged_one(
    make_connector: Callable[[str], Connector],
) -> None:
    tiered = make_connector("tiered")
    assert isinstance(tiered, TieredConnector)
    tiers = tiered.tiers
    rng = random.Random("corruption-tiered")
    items = make_items(namespace(), 3, nbytes=700)
    async with tiered:
        await tiered.put(items, timeout=T)
        for i in range(DAMAGES):
            key, block = items[i % len(items)]
            level = rng.randrange(len(tiers) - 1)  # a tier with a good copy below it
            for upper in tiers[:level]:  # make the get read the damaged copy first
                await upper.delete([key], timeout=T)
            damaged_tier = tiers[level]
            assert isinstance(damaged_tier, StoreBase)
            raw = serde.encode(block.meta, block.payload).join()
            await damaged_tier.write_raw(key, damage(raw, rng, flip=i % 2 == 0), timeout=T)
            (got,) = await tiered.get([key], timeout=T)
            assert same(got, block), "tiered get must skip the damaged copy"
            await tiered.drain()
            for tier in tiers[: level + 1]:  # the damaged copy was replaced by a promotion
                assert same((await tier.get([key], timeout=T))[0], block)
        assert tiered.stats().corrupt_detected == DAMAGES
        # Every copy damaged: a miss, never wrong data.
        key, block = items[0]
        raw = serde.encode(block.meta, block.payload).join()
        for tier in tiers:
            assert isinstance(tier, StoreBase)
            await tier.write_raw(key, damage(raw, rng, flip=True), timeout=T)
        assert await tiered.get([key], timeout=T) == [None]
        assert tiered.stats().corrupt_detected == DAMAGES + len(tiers)


@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_intact_object_under_the_wrong_key_is_rejected(
    kind: str, make_connector: Callable[[str], Connector]
) -> None:
    """Tenant B's key holding tenant A's (valid) bytes is a miss, not A's data."""
    conn = make_connector(kind)
    assert isinstance(conn, StoreBase)
    ns_a, ns_b = namespace("tenant-a"), namespace("tenant-b")
    key_a, key_b = ns_a.key(b"\x05" * 32), ns_b.key(b"\x05" * 32)
    block = make_block(key_a)
    async with conn:
        await conn.put([(key_a, block)], timeout=T)
        raw = await conn.read_raw(key_a, timeout=T)
        assert raw is not None
        await conn.write_raw(key_b, raw, timeout=T)
        assert await conn.get([key_b], timeout=T) == [None]
        assert conn.stats().corrupt_detected == 1
        assert same((await conn.get([key_a], timeout=T))[0], block)


@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_unknown_format_version_is_a_counted_miss(
    kind: str, make_connector: Callable[[str], Connector]
) -> None:
    conn = make_connector(kind)
    assert isinstance(conn, StoreBase)
    ((key, block),) = make_items(namespace(), 1)
    raw = bytearray(serde.encode(block.meta, block.payload).join())
    struct.pack_into("<H", raw, 8, serde.FORMAT_VERSION + 1)
    async with conn:
        await conn.write_raw(key, raw, timeout=T)
        assert await conn.get([key], timeout=T) == [None]
        assert conn.stats().corrupt_detected == 1
        assert await conn.read_raw(key, timeout=T) is None
