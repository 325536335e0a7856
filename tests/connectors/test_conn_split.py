"""Objects kept in pieces: a memory tier keeps an immutable payload as it is (no second
copy) and verifies the pieces exactly as it would the joined object."""

from __future__ import annotations

import numpy as np
import pytest
from conn_testlib import T, make_block, namespace

from kvplugin import serde
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.serde import BlockFormatError, SplitObject, decode, encode, split_if_immutable

NS = namespace()


def _encoded(payload_kind: str) -> tuple[str, serde.Block, serde.EncodedBlock]:
    key = NS.key(b"\x07" * 32)
    block = make_block(key, 4096, rows=2)
    raw = bytes(memoryview(block.payload).cast("B"))
    payload = {"bytes": raw, "bytearray": bytearray(raw),
               "numpy": np.frombuffer(raw, dtype=np.uint8).copy()}[payload_kind]
    block = serde.Block(block.meta, payload)
    return key.id, block, encode(block.meta, block.payload)


def test_only_a_view_of_bytes_is_kept_as_it_is() -> None:
    _, _, enc = _encoded("bytes")
    split = split_if_immutable(enc)
    assert isinstance(split, SplitObject) and split.nbytes == enc.nbytes
    assert split.join() == enc.join()
    for kind in ("bytearray", "numpy"):  # the caller could change these under the tier
        assert split_if_immutable(_encoded(kind)[2]) is None


def test_pieces_verify_like_the_joined_object() -> None:
    key, block, enc = _encoded("bytes")
    split = split_if_immutable(enc)
    assert split is not None
    got = decode(split, key=key)
    assert got.meta == decode(enc.join(), key=key).meta
    assert bytes(got.payload) == bytes(memoryview(block.payload).cast("B"))
    assert got.encoded is not None and got.encoded.nbytes == enc.nbytes


@pytest.mark.parametrize("piece", ["head", "payload", "tail"])
def test_a_flipped_byte_in_any_piece_is_caught(piece: str) -> None:
    key, _, enc = _encoded("bytes")
    split = split_if_immutable(enc)
    assert split is not None
    intact = {"head": split.head, "payload": bytes(split.payload), "tail": split.tail}
    for at in range(0, len(intact[piece]), 97):
        parts = dict(intact)
        bad = bytearray(parts[piece])
        bad[at] ^= 0x40
        parts[piece] = bytes(bad)
        damaged = SplitObject(parts["head"], memoryview(parts["payload"]), parts["tail"])
        with pytest.raises(BlockFormatError):
            decode(damaged, key=key)


def test_pieces_that_disagree_with_the_envelope_are_refused() -> None:
    key, _, enc = _encoded("bytes")
    split = split_if_immutable(enc)
    assert split is not None
    moved = SplitObject(split.head[:-8], memoryview(split.head[-8:] + bytes(split.payload)),
                        split.tail)
    with pytest.raises(BlockFormatError):
        decode(moved, key=key)
    with pytest.raises(BlockFormatError):
        decode(SplitObject(split.head[:40], split.payload, split.tail), key=key)
    with pytest.raises(BlockFormatError):
        decode(split, key="another key")


@pytest.mark.asyncio
async def test_memory_tier_keeps_a_bytes_payload_without_copying_it() -> None:
    key_id, block, enc = _encoded("bytes")
    key = NS.key(b"\x07" * 32)
    assert key.id == key_id
    async with MemoryConnector(capacity_bytes=1 << 20) as conn:
        assert await conn.put([(key, block)], timeout=T) == 1
        kept = conn._objects[key.id]
        assert isinstance(kept, SplitObject) and kept.payload.obj is block.payload
        assert conn.used_bytes == enc.nbytes
        (got,) = await conn.get([key], timeout=T)
        assert got is not None and bytes(got.payload) == block.payload
        assert await conn.read_raw(key, timeout=T) == enc.join()  # raw: the joined object
        assert await conn.delete([key], timeout=T) == 1 and conn.used_bytes == 0
        _, mutable, _ = _encoded("bytearray")
        assert await conn.put([(key, mutable)], timeout=T) == 1
        assert isinstance(conn._objects[key.id], bytes)  # copied: the caller may change it
