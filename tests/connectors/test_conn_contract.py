"""The connector contract, run against every connector and fault-injection variant.

Variants: memory, disk, real Redis, tiered (memory → disk → Redis); each also wrapped in a
benign fault injector (must be indistinguishable) and a faulty one (errors, latency, dropped
and corrupted writes), for which only the safety half of the contract is asserted: answers
are exact or misses, never wrong data, and calls always come back.
"""

from __future__ import annotations

import asyncio
import math
import random

import pytest
from conn_testlib import Subject, T, chain, make_block, make_items, namespace, same

from kvplugin.connectors.base import ConnectorClosed, ConnectorStats, Health
from kvplugin.connectors.keys import Chunker
from kvplugin.serde import Block

pytestmark = pytest.mark.asyncio


async def test_empty_batches_are_no_ops(subject: Subject) -> None:
    c = subject.conn
    assert await c.lookup([], timeout=T) == 0
    assert await c.get([], timeout=T) == []
    assert await c.put([], timeout=T) == 0
    assert await c.delete([], timeout=T) == 0


async def test_put_then_get_returns_the_same_blocks(subject: Subject) -> None:
    items = make_items(namespace(), 4, nbytes=4096)
    stored = await subject.put(items)
    if subject.reliable:
        assert stored == 4
    got = await subject.conn.get([k for k, _ in items], timeout=T)
    subject.check_blocks(got, [b for _, b in items])


async def test_dtypes_shapes_and_numpy_view_survive(subject: Subject) -> None:
    ns = namespace()
    k1, k2 = ns.key(b"\x01" * 32), ns.key(b"\x02" * 32)
    b1 = make_block(k1, 4 * 3 * 8 * 2, rows=4, dtype="bfloat16")
    b2 = make_block(k2, 1024, rows=1, dtype="float32")
    await subject.put([(k1, b1), (k2, b2)])
    got = await subject.conn.get([k1, k2], timeout=T)
    subject.check_blocks(got, [b1, b2])
    if got[0] is not None:
        arr = got[0].as_numpy()
        assert arr.shape == b1.meta.shape and arr.dtype.itemsize == 2
        assert arr.tobytes() == bytes(b1.payload)


async def test_lookup_counts_only_the_prefix(subject: Subject) -> None:
    items = make_items(namespace(), 6)
    keys = [k for k, _ in items]
    await subject.put(items[:3] + items[4:])  # index 3 is missing
    subject.check_count(await subject.conn.lookup(keys, timeout=T), 3)
    assert await subject.conn.lookup(keys[3:], timeout=T) == 0
    subject.check_count(await subject.conn.lookup(keys[4:], timeout=T), 2)


async def test_prefix_lookup_and_get_across_batch_boundaries(subject: Subject) -> None:
    items = make_items(namespace(), 150, nbytes=64)  # more than one Redis pipeline/MGET batch
    keys = [k for k, _ in items]
    await subject.put(items[:140])
    subject.check_count(await subject.conn.lookup(keys, timeout=T), 140)
    got = await subject.conn.get(keys, timeout=T)
    subject.check_blocks(got, [b for _, b in items[:140]] + [None] * 10)


async def test_missing_keys_are_misses(subject: Subject) -> None:
    keys = [k for k, _ in make_items(namespace(), 3)]
    assert await subject.conn.get(keys, timeout=T) == [None, None, None]
    assert await subject.conn.lookup(keys, timeout=T) == 0
    assert subject.conn.stats().misses >= 3


async def test_put_is_idempotent(subject: Subject) -> None:
    items = make_items(namespace(), 2)
    first = await subject.put(items)
    second = await subject.put(items)
    if subject.reliable:
        assert first == second == 2
        assert subject.conn.stats().existing >= 2
    got = await subject.conn.get([k for k, _ in items], timeout=T)
    subject.check_blocks(got, [b for _, b in items])


async def test_delete_removes_objects(subject: Subject) -> None:
    items = make_items(namespace(), 3)
    keys = [k for k, _ in items]
    await subject.put(items)
    try:
        deleted = await subject.conn.delete(keys[:2], timeout=T)
    except Exception:
        assert not subject.reliable
        return
    if subject.reliable:
        assert deleted == 2
        assert await subject.conn.delete(keys[:2], timeout=T) == 0
    assert await subject.conn.lookup(keys, timeout=T) == 0
    got = await subject.conn.get(keys, timeout=T)
    assert got[:2] == [None, None]
    subject.check_blocks(got[2:], [items[2][1]])


@pytest.mark.parametrize(
    "other",
    [
        {"tenant": "tenant-b"},
        {"model": "org/other-model"},
        {"layout": "fedcba9876543210"},
        {"group": 1},
        {"salt": "another-salt"},
    ],
    ids=["tenant", "model", "layout", "group", "salt"],
)
async def test_namespaces_are_isolated(subject: Subject, other: dict[str, object]) -> None:
    """Same tokens (same chained hashes): another namespace never sees the object."""
    base = {
        "tenant": "tenant-a",
        "model": "org/model-7b",
        "layout": "0123456789abcdef",
        "group": 0,
        "salt": "",
    }
    hashes = chain(3, seed=random.randrange(1 << 30))
    ns_a = namespace(**base)
    ns_b = namespace(**{**base, **other})
    items_a = [(ns_a.key(h), make_block(ns_a.key(h), index=i)) for i, h in enumerate(hashes)]
    keys_b = [ns_b.key(h) for h in hashes]
    await subject.put(items_a)
    assert await subject.conn.lookup(keys_b, timeout=T) == 0
    assert await subject.conn.get(keys_b, timeout=T) == [None] * 3
    # ...and B's own objects do not leak back into A.
    items_b = [(k, make_block(k, index=i)) for i, k in enumerate(keys_b)]
    await subject.put(items_b)
    got_a = await subject.conn.get([k for k, _ in items_a], timeout=T)
    subject.check_blocks(got_a, [b for _, b in items_a])


async def test_chunked_objects_answer_in_blocks(subject: Subject) -> None:
    ns = namespace()
    chunker = Chunker(ns, tokens_per_block=16, blocks_per_chunk=4)
    hashes = chain(10)
    chunks = chunker.chunks(hashes)
    assert [c.num_blocks for c in chunks] == [4, 4]
    items = []
    for c in chunks:
        meta = c.key.meta(
            token_start=c.token_start,
            token_end=c.token_end,
            dtype="uint8",
            shape=(c.num_blocks, 256),
        )
        items.append((c.key, Block(meta, random.randbytes(c.num_blocks * 256))))
    await subject.put(items[:1])
    n = await subject.conn.lookup([c.key for c in chunks], timeout=T)
    subject.check_count(n, 1)
    assert chunker.blocks_covered(chunks, n) == 4 * n
    got = await subject.conn.get([chunks[0].key], timeout=T)
    subject.check_blocks(got, [items[0][1]])
    if got[0] is not None:
        assert (got[0].meta.token_start, got[0].meta.token_end) == (0, 64)


async def test_concurrent_calls_stay_consistent(subject: Subject) -> None:
    items = make_items(namespace(), 24, nbytes=1024)
    await asyncio.gather(*(subject.put([it]) for it in items))
    results = await asyncio.gather(*(subject.conn.get([k], timeout=T) for k, _ in items))
    subject.check_blocks([r[0] for r in results], [b for _, b in items])


async def test_payload_is_a_view_not_a_copy_of_the_object(subject: Subject) -> None:
    ((key, block),) = make_items(namespace(), 1, nbytes=8192)
    await subject.put([(key, block)])
    (got,) = await subject.conn.get([key], timeout=T)
    if got is None:
        assert not subject.reliable
        return
    assert same(got, block)
    assert got.encoded is not None
    # One contiguous object, or its pieces (a memory tier that kept an immutable payload).
    assert any(memoryview(got.payload).obj is memoryview(p).obj for p in got.encoded.parts)


async def test_misuse_raises_clear_errors(subject: Subject) -> None:
    c = subject.conn
    ((key, block),) = make_items(namespace(), 1)
    for bad in (0, -1, math.inf, math.nan):
        with pytest.raises(ValueError, match="timeout"):
            await c.lookup([key], timeout=bad)
    for wrong in ("1", True, None):
        with pytest.raises(TypeError, match="timeout"):
            await c.get([key], timeout=wrong)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="ObjectKey"):
        await c.get([key.id], timeout=T)  # type: ignore[list-item]
    with pytest.raises(TypeError, match="sequence of ObjectKey"):
        await c.lookup(key.id, timeout=T)  # type: ignore[arg-type]
    other = namespace().key(b"\x07" * 32)
    with pytest.raises(ValueError, match="does not belong"):
        await c.put([(other, block)], timeout=T)
    with pytest.raises(TypeError, match="Block"):
        await c.put([(key, bytes(block.payload))], timeout=T)  # type: ignore[list-item]


async def test_closed_connector_refuses_calls(subject: Subject) -> None:
    ((key, _),) = make_items(namespace(), 1)
    await subject.conn.aclose()
    await subject.conn.aclose()  # idempotent
    with pytest.raises(ConnectorClosed):
        await subject.conn.get([key], timeout=T)
    with pytest.raises(ConnectorClosed):
        await subject.conn.health(timeout=T)


async def test_stats_are_a_snapshot(subject: Subject) -> None:
    items = make_items(namespace(), 2)
    await subject.put(items)
    await subject.conn.get([k for k, _ in items], timeout=T)
    snap = subject.conn.stats()
    assert isinstance(snap, ConnectorStats)
    if subject.reliable:
        assert snap.hits == 2 and snap.stored >= 2 and snap.bytes_out > 0 and snap.bytes_in > 0
        assert snap.corrupt_detected == 0 and snap.errors == 0
    snap.hits += 100
    assert subject.conn.stats().hits != snap.hits


async def test_health(subject: Subject) -> None:
    health = await subject.conn.health(timeout=T)
    assert isinstance(health, Health)
    if subject.reliable:
        assert health.ok, health.detail


async def test_capabilities_are_declared(subject: Subject) -> None:
    caps = subject.conn.capabilities
    expected = {
        "memory": "memory",
        "disk": "disk",
        "disk_threads": "disk",
        "redis": "redis",
        "tiered": "tiered",
    }
    assert caps.tier == expected[subject.kind]
    assert caps.persistent == (subject.kind != "memory")
    assert caps.shared == (subject.kind in ("redis", "tiered"))
    assert caps.atomic_put
