"""Whatever a backend holds loads as a verified block or a counted miss, never an exception.

Thrown at ``serde.decode``, ``decode_or_error`` and ``hash_payload``: arbitrary bytes,
arbitrary edits of valid objects (with and without their checksums recomputed, so the edits
reach the parsers), and arbitrary JSON documents wrapped in valid checksums (or valid MACs:
a holder of the secret is the only writer that gets past the frame tag, but the parser must
hold up even then). Only a verified Block for the key asked for, or a BlockFormatError,
may come out. Then the same hostile objects stored in every store kind: ``get`` answers a
miss, counts it, deletes the object, and the key works again.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable

import pytest
from conn_forge import dumps, forge_doc, hostile_docs, meta_doc, reseal
from conn_testlib import T, make_block, namespace, same
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplugin import serde
from kvplugin.connectors.base import Connector, StoreBase, decode_or_error
from kvplugin.serde import Block, BlockFormatError, BlockMeta, Codec

KEY = "ab" * 48
META = BlockMeta(
    key=KEY, tenant="t", model="org/m", layout="0123456789abcdef", group=1, kind="kv",
    token_start=32, token_end=64, dtype="uint8", shape=(2, 8),
)  # fmt: skip
PAYLOAD = bytes(range(16))
CODECS = {"plain": serde.PLAIN, "keyed": Codec.create(b"fuzz-secret-0123456789")}
OBJECTS = {name: serde.encode(META, PAYLOAD, codec).join() for name, codec in CODECS.items()}
# caplog is reused across examples on purpose (check_all clears it first).
FAST = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def check_all(raw: bytes, codec: Codec, caplog: pytest.LogCaptureFixture) -> Block | None:
    """Every entry point on ``raw``: a verified block for KEY or a BlockFormatError, and
    ``decode_or_error`` agrees with ``decode`` without falling back on its bug net."""
    result: Block | None = None
    for arrow_check in (False, True):
        try:
            block = serde.decode(raw, key=KEY, arrow_check=arrow_check, codec=codec)
        except BlockFormatError:
            continue
        assert block.meta.key == KEY and block.meta.nbytes == len(bytes(block.payload))
        result = block
    digest = serde.hash_payload(raw, codec)
    assert digest is None or (len(digest) == 3 and len(digest[2]) == 16)
    caplog.clear()
    loaded = decode_or_error(raw, KEY, digest, codec=codec)
    assert isinstance(loaded, Block | BlockFormatError)
    assert not caplog.records, "decode raised something other than a BlockFormatError"
    return result


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=5) | st.dictionaries(st.text(max_size=10), children, max_size=5)
    ),
    max_leaves=25,
)
FIELDS = sorted(meta_doc(META, PAYLOAD))


@FAST
@given(data=st.binary(max_size=1500), header=st.booleans(), codec=st.sampled_from(sorted(CODECS)))
def test_arbitrary_bytes(
    data: bytes, header: bool, codec: str, caplog: pytest.LogCaptureFixture
) -> None:
    raw = (OBJECTS[codec][:64] + data) if header else data  # a real envelope gets further
    check_all(raw, CODECS[codec], caplog)


edits = st.lists(
    st.tuples(
        st.sampled_from(["flip", "set", "delete", "insert", "truncate"]),
        st.integers(0, 2000),
        st.integers(1, 255),
        st.binary(min_size=1, max_size=8),
    ),
    min_size=1,
    max_size=3,
)


def apply(raw: bytes, ops: list[tuple[str, int, int, bytes]]) -> bytes:
    out = bytearray(raw)
    for op, pos, n, blob in ops:
        pos %= max(len(out), 1)
        if op == "flip" and out:
            out[pos] ^= n
        elif op == "set":
            out[pos : pos + len(blob)] = blob[: len(out) - pos]
        elif op == "delete":
            del out[pos : pos + n]
        elif op == "insert":
            out[pos:pos] = blob
        else:
            del out[pos:]
    return bytes(out)


@FAST
@given(ops=edits, resealed=st.booleans(), codec=st.sampled_from(sorted(CODECS)))
def test_edited_objects(
    ops: list[tuple[str, int, int, bytes]],
    resealed: bool,
    codec: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sealer = CODECS[codec].sealer
    raw = apply(OBJECTS[codec], ops)
    if resealed:  # as a writer holding the secret (or anyone, without one) could
        raw = reseal(raw, sealer.frame if CODECS[codec].keyed else None)
    block = check_all(raw, CODECS[codec], caplog)
    if block is not None and not resealed:  # the checksums held: nothing changed
        assert block.meta == META and bytes(block.payload) == PAYLOAD


@FAST
@given(
    doc=json_values | st.dictionaries(st.sampled_from(FIELDS), json_values),
    changes=st.dictionaries(st.sampled_from([*FIELDS, "extra"]), json_values, max_size=3),
    whole=st.booleans(),
    codec=st.sampled_from(sorted(CODECS)),
)
def test_checksummed_metadata_documents(
    doc: object,
    changes: dict[str, object],
    whole: bool,
    codec: str,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Arbitrary documents, or the real one with a few fields replaced or added."""
    c = CODECS[codec]
    document = doc if whole else meta_doc(META, PAYLOAD, **changes)
    if c.keyed and not whole:  # the MAC'd form names its digest differently
        document = dict(document)  # type: ignore[call-overload]
        document["payload_blake3_mac"] = document.pop("payload_xxh3_128", None)
    raw = forge_doc(
        dumps(document),
        PAYLOAD,
        flags=1 if c.keyed else 0,
        word=c.key_id or 0,
        frame=c.sealer.frame if c.keyed else None,
    )
    block = check_all(raw, c, caplog)
    if block is not None:  # only the key's own, valid metadata can get through
        assert block.meta.key == KEY and bytes(block.payload) == PAYLOAD


def test_the_unchanged_document_gets_through_the_fuzz_path(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The property tests above can see a valid block: their forging is right."""
    raw = forge_doc(dumps(meta_doc(META, PAYLOAD)), PAYLOAD)
    assert check_all(raw, serde.PLAIN, caplog) is not None


# --- stored in a connector -----------------------------------------------------------------

STORE_KINDS = ["memory", "disk", "disk_threads", "redis", "redis_cluster"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_hostile_objects_are_counted_misses_and_deleted(
    kind: str, make_connector: Callable[[str], Connector]
) -> None:
    conn = make_connector(kind)
    assert isinstance(conn, StoreBase)
    key = namespace().key(b"\x01" * 32)
    block = make_block(key, 16, rows=2)
    docs = hostile_docs(block.meta, bytes(block.payload))
    async with conn:
        for n, doc in enumerate(docs.values(), start=1):
            await conn.write_raw(key, forge_doc(doc, bytes(block.payload)), timeout=T)
            assert await conn.get([key], timeout=T) == [None]
            assert await conn.read_raw(key, timeout=T) is None, "hostile object kept"
            assert conn.stats().corrupt_detected == n
        assert await conn.put([(key, block)], timeout=T) == 1
        assert same((await conn.get([key], timeout=T))[0], block)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_a_decoder_bug_is_a_counted_miss_not_a_poisoned_key(
    kind: str,
    make_connector: Callable[[str], Connector],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    conn = make_connector(kind)
    key = namespace().key(b"\x02" * 32)
    block = make_block(key, 64, rows=2)
    real = serde.decode

    def broken(*args: object, **kw: object) -> Block:
        raise RecursionError(f"simulated decoder bug {random.random()}")

    async with conn:
        assert await conn.put([(key, block)], timeout=T) == 1
        monkeypatch.setattr(serde, "decode", broken)
        with caplog.at_level(logging.ERROR, logger="kvplugin.connectors.base"):
            assert await conn.get([key], timeout=T) == [None]
        assert "raised instead of rejecting" in caplog.text
        assert conn.stats().corrupt_detected == 1
        monkeypatch.setattr(serde, "decode", real)
        assert await conn.lookup([key], timeout=T) == 0, "the object was not deleted"
        assert await conn.put([(key, block)], timeout=T) == 1
        assert same((await conn.get([key], timeout=T))[0], block)
