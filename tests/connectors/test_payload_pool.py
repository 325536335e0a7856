"""The payload pool (kvplugin.buffers): sealed slots are read-only, come back only when the
last reference is gone (from any thread), are reused, and reservations keep memory mapped;
the memory tier copies mutable payloads into it and keeps sealed ones as they are."""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest
from conn_testlib import T, make_block, namespace

from kvplugin import serde
from kvplugin.buffers import _SLAB_BYTES, MIN_POOLED_BYTES, PayloadPool, Sealed
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.serde import SplitObject, decode, encode, split_if_immutable

NS = namespace()
SLOT = 1 << 20


def _fill(pool: PayloadPool, value: int, nbytes: int = SLOT) -> Sealed:
    return pool.fill(nbytes, lambda out: out.fill(value))


def _addr(a: np.ndarray) -> int:
    return int(a.__array_interface__["data"][0])


def test_a_sealed_slot_is_read_only_and_holds_what_was_written() -> None:
    pool = PayloadPool()
    s = _fill(pool, 7, 100_000)
    assert type(s) is Sealed and s.nbytes == 100_000 and (s == 7).all()
    assert memoryview(s).readonly
    with pytest.raises(ValueError):
        s[0] = 1


def test_a_slot_comes_back_only_when_every_view_of_it_is_gone() -> None:
    pool = PayloadPool()
    s = _fill(pool, 1)
    first = _addr(s)
    view = memoryview(s).cast("B")[10:]  # keeps the slot alive on its own
    del s
    gc.collect()
    t = _fill(pool, 2)
    assert _addr(t) != first and view[0] == 1  # not reused under a reader
    del view
    gc.collect()
    u = _fill(pool, 3)
    assert _addr(u) == first and (t == 2).all()  # reused once nobody refers to it


def test_a_failing_write_gives_the_slot_back() -> None:
    pool = PayloadPool()

    def boom(out: np.ndarray) -> None:
        raise RuntimeError("copy failed")

    with pytest.raises(RuntimeError):
        pool.fill(SLOT, boom)
    s = _fill(pool, 4)
    assert pool.mapped_bytes == _SLAB_BYTES and (s == 4).all()


def _rows_writer(calls: list[tuple[int, int, bool]]) -> object:
    """A fill_many writer: payload i is filled with i + 1; each call is recorded."""
    def write(rows: np.ndarray, first: int) -> None:
        calls.append((first, rows.shape[0], bool(rows.flags.c_contiguous)))
        for k in range(rows.shape[0]):
            rows[k] = first + k + 1
    return write


def test_fill_many_fills_adjacent_slots_in_one_write_and_frees_each_alone() -> None:
    pool = PayloadPool()
    calls: list[tuple[int, int, bool]] = []
    out = pool.fill_many(SLOT, 5, _rows_writer(calls))  # type: ignore[arg-type]
    assert calls == [(0, 5, True)]  # one slab: one write over five adjacent slots
    assert [int(p[0]) for p in out] == [1, 2, 3, 4, 5]
    assert all(type(p) is Sealed and p.nbytes == SLOT and (p == i + 1).all()
               for i, p in enumerate(out))
    assert [_addr(p) - _addr(out[0]) for p in out] == [i * SLOT for i in range(5)]
    with pytest.raises(ValueError):
        out[2][0] = 0
    third = _addr(out[2])
    del out[2]  # its slot alone comes back; the others stay as they are
    gc.collect()
    again = _fill(pool, 9)
    assert _addr(again) == third and [int(p[0]) for p in out] == [1, 2, 4, 5]


def test_fill_many_spans_slabs_and_holes_in_as_few_writes_as_they_allow() -> None:
    pool = PayloadPool()
    per_slab = _SLAB_BYTES // SLOT
    held = [_fill(pool, 1) for _ in range(per_slab)]
    del held[1:3]  # slots 1 and 2 of the first slab are free again
    gc.collect()
    calls: list[tuple[int, int, bool]] = []
    out = pool.fill_many(SLOT, 2 + per_slab + 1, _rows_writer(calls))  # type: ignore[arg-type]
    # the hole (2 slots), a new slab's slots (all of them), and one more slab's first
    assert calls == [(0, 2, True), (2, per_slab, True), (2 + per_slab, 1, True)]
    assert [int(p[0]) for p in out] == list(range(1, len(out) + 1))
    assert pool.mapped_bytes == 3 * _SLAB_BYTES


def test_fill_many_pads_rows_to_whole_slots_and_gives_all_back_on_failure() -> None:
    pool = PayloadPool()
    calls: list[tuple[int, int, bool]] = []
    out = pool.fill_many(5000, 3, _rows_writer(calls))  # type: ignore[arg-type]
    assert calls == [(0, 3, False)]  # rows of 5,000 bytes, 8 KiB apart
    assert [p.nbytes for p in out] == [5000] * 3 and [int(p[-1]) for p in out] == [1, 2, 3]
    assert pool.fill_many(SLOT, 0, _rows_writer(calls)) == []  # type: ignore[arg-type]

    def boom(rows: np.ndarray, first: int) -> None:
        raise RuntimeError("copy failed")

    del out
    gc.collect()
    with pytest.raises(RuntimeError):
        pool.fill_many(SLOT, 3, boom)
    # The failed call's slots came back: a whole slab's worth fits in the one mapping.
    per = _SLAB_BYTES // SLOT
    again = pool.fill_many(SLOT, per, _rows_writer(calls))  # type: ignore[arg-type]
    assert len(again) == per and pool.mapped_bytes == _SLAB_BYTES
    for bad in ((0, 1), (SLOT, -1), (1.5, 1)):
        with pytest.raises(ValueError):
            pool.fill_many(bad[0], bad[1], _rows_writer(calls))  # type: ignore[arg-type]


def test_slots_given_back_from_other_threads_are_reused() -> None:
    pool = PayloadPool()
    slots = [_fill(pool, i) for i in range(16)]
    assert pool.mapped_bytes == 2 * _SLAB_BYTES
    box = [slots]
    del slots

    def drop() -> None:
        box.clear()  # the last references die on this thread

    th = threading.Thread(target=drop)
    th.start()
    th.join()
    gc.collect()
    again = [_fill(pool, 9) for _ in range(16)]
    assert pool.mapped_bytes == 2 * _SLAB_BYTES and all((s == 9).all() for s in again)


def test_free_slabs_are_kept_up_to_the_retained_bytes_then_unmapped() -> None:
    pool = PayloadPool(retain_bytes=_SLAB_BYTES)
    slots = [_fill(pool, 1) for _ in range(24)]  # 3 slabs of 8 slots
    assert pool.mapped_bytes == 3 * _SLAB_BYTES
    del slots
    gc.collect()
    assert pool.mapped_bytes == _SLAB_BYTES and pool.spare_bytes == _SLAB_BYTES
    assert pool.trim() == _SLAB_BYTES and pool.mapped_bytes == 0


def test_a_spare_slab_is_carved_anew_for_another_slot_size() -> None:
    pool = PayloadPool()
    s = _fill(pool, 1)
    del s
    gc.collect()
    assert pool.spare_bytes == _SLAB_BYTES
    t = _fill(pool, 2, 3 * SLOT)  # the free mapping, now two 3 MiB slots
    assert pool.mapped_bytes == _SLAB_BYTES and (t == 2).all()
    big = _fill(pool, 3, _SLAB_BYTES + 1)  # bigger than a slab: its own mapping
    assert big.nbytes == _SLAB_BYTES + 1 and pool.mapped_bytes > 2 * _SLAB_BYTES


def test_a_free_mapping_bigger_than_a_slab_is_reused_up_to_the_retained_bytes() -> None:
    pool = PayloadPool(retain_bytes=4 * _SLAB_BYTES)
    size = 2 * _SLAB_BYTES + 4096
    first = _fill(pool, 1, size)
    addr = _addr(first)
    del first
    gc.collect()
    assert pool.mapped_bytes == size  # kept, free
    again = _fill(pool, 2, size)
    assert _addr(again) == addr and (again == 2).all()
    assert pool.mapped_bytes == size
    del again
    gc.collect()
    assert pool.trim() == size and pool.mapped_bytes == 0
    small = PayloadPool(retain_bytes=0)
    big = _fill(small, 3, size)
    del big
    gc.collect()
    assert small.mapped_bytes == 0  # beyond what is retained: unmapped at once


def test_reserve_maps_now_and_keeps_it_until_unreserved() -> None:
    pool = PayloadPool(retain_bytes=0)
    pool.reserve(3 * _SLAB_BYTES)
    assert pool.mapped_bytes == pool.spare_bytes == 3 * _SLAB_BYTES
    slots = [_fill(pool, 5) for _ in range(24)]
    assert pool.mapped_bytes == 3 * _SLAB_BYTES  # filled from the reservation
    del slots
    gc.collect()
    assert pool.mapped_bytes == 3 * _SLAB_BYTES  # retain 0, but reserved
    pool.unreserve(3 * _SLAB_BYTES)
    assert pool.mapped_bytes == 0
    with pytest.raises(ValueError):
        pool.unreserve(1)


@pytest.mark.parametrize("bad", [0, -1, 1.5, "1"])
def test_misuse_is_refused(bad: object) -> None:
    pool = PayloadPool()
    with pytest.raises(ValueError):
        pool.fill(bad, lambda out: None)  # type: ignore[arg-type]
    if bad != 0:
        with pytest.raises(ValueError):
            pool.reserve(bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        PayloadPool(retain_bytes=-1)


def _big_block(kind: str) -> tuple[serde.Block, bytes]:
    key = NS.key(b"\x09" * 32)
    block = make_block(key, MIN_POOLED_BYTES, rows=2)
    raw = bytes(memoryview(block.payload).cast("B"))
    payload = {"bytearray": bytearray(raw),
               "sealed": PayloadPool().fill(len(raw), lambda out: out.__setitem__(
                   slice(None), np.frombuffer(raw, dtype=np.uint8)))}[kind]
    return serde.Block(block.meta, payload), raw


def test_split_keeps_a_sealed_payload_as_it_is() -> None:
    block, raw = _big_block("sealed")
    enc = encode(block.meta, block.payload)
    split = split_if_immutable(enc)
    assert isinstance(split, SplitObject) and split.payload.obj is block.payload
    assert bytes(decode(split, key=NS.key(b"\x09" * 32).id).payload) == raw


@pytest.mark.asyncio
async def test_memory_tier_copies_a_mutable_payload_into_a_pool_slot() -> None:
    key = NS.key(b"\x09" * 32)
    block, raw = _big_block("bytearray")
    pool = PayloadPool()
    async with MemoryConnector(capacity_bytes=4 << 20, pool=pool) as conn:
        assert await conn.put([(key, block)], timeout=T) == 1
        kept = conn._objects[key.id]
        assert isinstance(kept, SplitObject) and type(kept.payload.obj) is Sealed
        block.payload[:] = bytes(len(raw))  # type: ignore[index]  # the caller reuses it
        (got,) = await conn.get([key], timeout=T)
        assert got is not None and bytes(got.payload) == raw
        assert pool.mapped_bytes == _SLAB_BYTES
        assert await conn.delete([key], timeout=T) == 1
    del kept, got
    gc.collect()
    assert pool.spare_bytes == _SLAB_BYTES  # the slot came back


@pytest.mark.asyncio
async def test_a_reserving_memory_tier_maps_its_capacity_until_closed() -> None:
    pool = PayloadPool(retain_bytes=0)
    conn = MemoryConnector(capacity_bytes=2 * _SLAB_BYTES, pool=pool, reserve=True)
    assert pool.mapped_bytes == 2 * _SLAB_BYTES
    await conn.aclose()
    assert pool.mapped_bytes == 0
    with pytest.raises(TypeError):
        MemoryConnector(capacity_bytes=1 << 20, reserve=1)  # type: ignore[arg-type]
