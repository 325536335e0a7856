"""The block format: round trips, zero-copy both ways, every damaged byte detected."""

from __future__ import annotations

import json
import struct

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplugin import serde
from kvplugin.serde import Block, BlockMeta

KEY = "ab" * 48


def meta(**kw: object) -> BlockMeta:
    fields: dict[str, object] = {
        "key": KEY, "tenant": "t", "model": "org/m", "layout": "0123456789abcdef", "group": 1,
        "kind": "kv", "token_start": 32, "token_end": 64, "dtype": "bfloat16", "shape": (2, 8),
    }  # fmt: skip
    fields.update(kw)
    return BlockMeta(**fields)  # type: ignore[arg-type]


def encoded(m: BlockMeta | None = None, payload: bytes | None = None) -> bytes:
    m = m or meta()
    return serde.encode(m, payload if payload is not None else bytes(range(m.nbytes))).join()


def test_round_trip_keeps_metadata_and_bytes() -> None:
    m = meta(kind="mamba_state", boundary=48, shape=(1, 3, 4), dtype="float32")
    payload = bytes(range(256))[: m.nbytes] * 1
    block = serde.decode(encoded(m, payload), key=KEY, arrow_check=True)
    assert block.meta == m and bytes(block.payload) == payload
    assert block.as_numpy().shape == (1, 3, 4)


def test_objects_are_plain_arrow_streams_any_arrow_reader_can_open() -> None:
    import pyarrow as pa

    m = meta(shape=(4, 8), dtype="uint8")
    payload = bytes(range(32))
    table = pa.ipc.open_stream(serde.arrow_stream(encoded(m, payload))).read_all()
    assert table.column_names == ["blocks"] and table.num_rows == 4
    assert b"".join(v.as_py() for v in table.column("blocks")) == payload
    doc = json.loads(table.schema.metadata[serde.META_KEY])
    assert doc["tenant"] == "t" and doc["shape"] == [4, 8] and doc["format_version"] == 1
    assert len(bytes.fromhex(doc["payload_xxh3_128"])) == 16


def test_decode_is_zero_copy() -> None:
    buf = bytearray(encoded())
    block = serde.decode(buf)
    assert memoryview(block.payload).obj is buf
    assert block.encoded is not None and block.encoded.nbytes == len(buf)


def test_encode_does_not_copy_the_payload() -> None:
    payload = bytearray(meta().nbytes)
    enc = serde.encode(meta(), payload)
    assert memoryview(enc.parts[1]).obj is payload
    assert len(enc.join()) == enc.nbytes


def test_every_single_byte_flip_is_detected() -> None:
    raw = encoded()
    for pos in range(len(raw)):
        bad = bytearray(raw)
        bad[pos] ^= 0x01 if pos % 2 else 0x80
        with pytest.raises(serde.BlockFormatError):
            serde.decode(bad)


def test_every_truncation_and_any_extension_is_detected() -> None:
    raw = encoded()
    for n in range(len(raw)):
        with pytest.raises(serde.BlockFormatError):
            serde.decode(raw[:n])
    with pytest.raises(serde.TruncatedBlock):
        serde.decode(raw + b"\x00")


def test_specific_failures_have_specific_errors() -> None:
    raw = bytearray(encoded())
    with pytest.raises(serde.MetadataMismatch):
        serde.decode(raw, key="cd" * 48)
    v2 = bytearray(raw)
    struct.pack_into("<H", v2, 8, 2)
    with pytest.raises(serde.UnknownFormatVersion):
        serde.decode(v2)
    with pytest.raises(serde.TruncatedBlock):
        serde.decode(raw[:10])
    raw[-20] ^= 0xFF  # end-of-stream / padding area
    with pytest.raises(serde.ChecksumMismatch):
        serde.decode(raw)
    not_ours = bytearray(b"X" * 200)
    with pytest.raises(serde.BlockFormatError, match="magic"):
        serde.decode(not_ours)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"dtype": "complex64"}, "dtype"),
        ({"token_end": 1}, "token"),
        ({"shape": ()}, "shape"),
        ({"shape": (2, 0)}, "shape"),
        ({"group": -1}, "group"),
        ({"tenant": ""}, "tenant"),
        ({"boundary": -5}, "boundary"),
        ({"shape": [2, 8]}, "shape"),
    ],
)
def test_bad_metadata_is_rejected(kw: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        meta(**kw)


def test_payload_must_match_dtype_and_shape() -> None:
    with pytest.raises(ValueError, match="needs 32"):
        serde.encode(meta(), b"\x00" * 31)
    import numpy as np

    strided = np.zeros((4, 8), dtype=np.uint16)[:, ::2]
    with pytest.raises(ValueError, match="contiguous"):
        serde.encode(meta(), strided)


def test_numpy_payloads_are_accepted() -> None:
    import numpy as np

    arr = np.arange(16, dtype=np.float32).reshape(2, 8)
    block = serde.decode(serde.encode(meta(dtype="float32"), arr).join())
    assert (block.as_numpy() == arr).all()
    assert not block.as_numpy().flags.writeable


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    rows=st.integers(1, 6),
    width=st.integers(1, 300),
    dtype=st.sampled_from(["uint8", "float16", "float32", "float8_e4m3fn", "int64"]),
    data=st.data(),
)
def test_random_objects_round_trip_and_damage_is_caught(
    rows: int, width: int, dtype: str, data: st.DataObject
) -> None:
    m = meta(dtype=dtype, shape=(rows, width))
    payload = data.draw(st.binary(min_size=m.nbytes, max_size=m.nbytes))
    raw = encoded(m, payload)
    block = serde.decode(raw, key=KEY, arrow_check=True)
    assert block.meta == m and bytes(block.payload) == payload
    assert block == Block(m, payload)  # the encoded form is not part of equality
    bad = bytearray(raw)
    pos = data.draw(st.integers(0, len(raw) - 1))
    bad[pos] ^= data.draw(st.integers(1, 255))
    with pytest.raises(serde.BlockFormatError):
        serde.decode(bad)


@settings(max_examples=200, deadline=None)
@given(
    tenant=st.text(min_size=1, max_size=20),
    model=st.text(min_size=1, max_size=20),
    boundary=st.none() | st.integers(0, 2**62),
    shape=st.lists(st.integers(1, 9), min_size=1, max_size=4),
)
def test_metadata_json_is_what_json_dumps_writes(
    tenant: str, model: str, boundary: int | None, shape: list[int]
) -> None:
    m = meta(tenant=tenant, model=model, boundary=boundary, shape=tuple(shape), dtype="uint8")
    digest = bytes(range(16))
    expected = {
        "format_version": 1, "key": m.key, "tenant": m.tenant, "model": m.model,
        "layout": m.layout, "group": m.group, "kind": m.kind, "token_start": m.token_start,
        "token_end": m.token_end, "boundary": m.boundary, "dtype": m.dtype, "shape": shape,
        "payload_xxh3_128": digest.hex(),
    }  # fmt: skip
    assert serde._meta_json(m, digest) == json.dumps(expected, separators=(",", ":")).encode()
    block = serde.decode(encoded(m, bytes(m.nbytes)), arrow_check=True)
    assert block.meta == m
