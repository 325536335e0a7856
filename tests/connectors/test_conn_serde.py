"""The block format: round trips, zero-copy both ways, every damaged byte detected, and
hostile metadata behind valid checksums rejected as a BlockFormatError."""

from __future__ import annotations

import hashlib
import json
import struct

import pytest
from conn_forge import forge, forge_doc, hostile_docs, meta_doc
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
        ({"shape": (1,) * 33}, "shape"),
        ({"shape": (2**63, 1)}, "shape"),
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


# --- the format without a secret is frozen ---------------------------------------------------

# (length, sha256) of objects encoded by the code before MACs existed (commit 19ab360).
GOLDEN = [
    (1152, "4c213d8f3fe46cf68666ba7e713aa1ac3579c0362bfadd3b2523aa94a20f0b3e"),
    (1096, "c9cc7ad85023ba74811c2ea5d43926dbac11f0c68364c7c9d5dc75a62be0f990"),
    (66664, "0121f0208ab536ee16e19b9e0d8498ca5bf2f16c9f4fc4e64faadbd6931940ef"),
]


def golden_inputs() -> list[tuple[BlockMeta, bytes]]:
    m1 = meta(
        tenant='t\u00e9n"ant', group=3, kind="mamba_state", token_start=32, token_end=64,
        dtype="float16", shape=(1, 3, 4), boundary=48,
    )  # fmt: skip
    m2 = meta(key="cd" * 48, group=0, token_start=0, token_end=16, dtype="uint8", shape=(2, 8))
    m3 = meta(
        key="ef" * 48, tenant="tenant-7", model="bench/model", layout="fedcba9876543210",
        token_start=256, token_end=512, dtype="bfloat16", shape=(16, 2048),
    )  # fmt: skip
    p3 = hashlib.shake_256(b"golden").digest(m3.nbytes)
    return [(m1, bytes(range(24))), (m2, bytes(range(16))), (m3, p3)]


def test_objects_without_a_secret_are_byte_identical_to_the_old_format() -> None:
    for (m, payload), (length, sha) in zip(golden_inputs(), GOLDEN, strict=True):
        raw = serde.encode(m, payload).join()
        assert (len(raw), hashlib.sha256(raw).hexdigest()) == (length, sha)
        draft = serde.prepare(m, payload)
        assert draft.seal().join() == raw  # the draft path writes the same bytes


# --- hostile metadata behind valid checksums -------------------------------------------------

M = meta(dtype="uint8", shape=(2, 8))
P = bytes(range(16))


def test_the_forger_builds_objects_the_decoder_accepts() -> None:
    """The helper is right: the document the encoder writes, forged around, decodes."""
    block = serde.decode(forge_doc(meta_doc(M, P), P), key=KEY)
    assert block.meta == M and bytes(block.payload) == P


@pytest.mark.parametrize("name", sorted(hostile_docs(M, P)))
def test_hostile_metadata_is_a_block_format_error(name: str) -> None:
    raw = forge_doc(hostile_docs(M, P)[name], P)
    with pytest.raises(serde.BlockFormatError) as info:
        serde.decode(raw, key=KEY)
    # Messages are logged per dropped object: a stored value is never quoted in full.
    assert len(str(info.value)) < 400
    serde.hash_payload(raw)  # the disk store's pass on its I/O thread must not raise either


def test_metadata_length_is_capped_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    cap = 64 << 10
    doc = json.dumps({"key": "k" * cap}).encode()

    def no_parse(*args: object, **kw: object) -> object:
        raise AssertionError("parsed metadata over the cap")

    monkeypatch.setattr(json, "loads", no_parse)
    with pytest.raises(serde.BlockFormatError, match="exceeds"):
        serde.decode(forge(doc, P))
    # A claimed length past the object is refused the same way, whatever the object's size.
    with pytest.raises(serde.BlockFormatError):
        serde.decode(forge(b"{}", P, meta_len=(1 << 32) - 1))


def test_encode_refuses_metadata_no_reader_would_parse() -> None:
    big = meta(key="k" * (64 << 10), dtype="uint8", shape=(2, 8))
    with pytest.raises(ValueError, match="exceeds"):
        serde.encode(big, P)


def test_unknown_flags_and_a_set_reserved_word_are_rejected() -> None:
    doc = json.dumps(meta_doc(M, P), separators=(",", ":")).encode()
    assert serde.decode(forge(doc, P)).meta == M
    for kw in ({"flags": 2}, {"flags": 0x8000}, {"word": 7}):
        with pytest.raises(serde.BlockFormatError):
            serde.decode(forge(doc, P, **kw))  # type: ignore[arg-type]


def test_the_arrow_check_turns_any_reader_failure_into_a_block_format_error() -> None:
    # Valid checksums around a stream pyarrow cannot read (the forger's filler).
    raw = forge_doc(meta_doc(M, P), P)
    with pytest.raises(serde.BlockFormatError, match="Arrow"):
        serde.decode(raw, arrow_check=True)
