"""Authenticated blocks: with a deployment secret, only its holders can write what loads.

Per store kind: round trips with a secret; objects forged without it (valid xxh3 objects,
or MAC'd with another secret) and MAC'd objects shown to a reader without a secret are
counted misses and deleted; damage to MAC'd objects is caught. Plus the plumbing: key
rotation, re-sealing when bytes move between connectors that seal differently, the tiered
connector's common codec, fault injection, and secrets kept out of every repr.
"""

from __future__ import annotations

import hashlib
import json
import random
import struct
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest
from conn_forge import forge_doc, meta_doc
from conn_testlib import T, make_block, make_items, namespace, redis_options, same
from test_conn_serde import GOLDEN, golden_inputs

from kvplugin import serde
from kvplugin.connectors.base import Connector, StoreBase, common_codec
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.faults import FaultInjector, FaultPlan
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.redis import RedisConnector
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.serde import Codec
from kvplugin.serde_mac import FLAG_MAC

MIB = 1 << 20
SECRET = b"deployment-secret-0123456789abcdef"
OTHER = b"some-other-secret-0123456789abcdef"
STORE_KINDS = ["memory", "disk", "disk_threads", "redis", "redis_cluster"]


@pytest.fixture
def make_store(request: pytest.FixtureRequest, tmp_path: Path) -> Callable[..., StoreBase]:
    """A store of one kind with the given secret(s), on fresh storage."""
    counter = iter(range(1000))

    def build(
        kind: str, secret: bytes | None = SECRET, previous: Sequence[bytes] = ()
    ) -> StoreBase:
        n, cap = next(counter), 64 * MIB
        if kind == "memory":
            return MemoryConnector(capacity_bytes=cap, secret=secret, previous_secrets=previous)
        if kind.startswith("disk"):
            return DiskConnector(
                tmp_path / f"disk{n}",
                capacity_bytes=cap,
                inline_read_bytes=0 if kind == "disk_threads" else 4 * MIB,
                secret=secret,
                previous_secrets=previous,
            )
        url = request.getfixturevalue("redis_server").url
        return RedisConnector(redis_options(url), secret=secret, previous_secrets=previous)

    return build


def damage(raw: bytes, rng: random.Random, flip: bool) -> bytes:
    """One random byte flipped, or the object cut short at a random length."""
    bad = bytearray(raw)
    if flip:
        bad[rng.randrange(len(bad))] ^= rng.randrange(1, 256)
    else:
        del bad[rng.randrange(len(bad)) :]
    return bytes(bad)


def envelope(raw: bytes) -> tuple[int, int]:
    """(flags, reserved word) of a stored object."""
    flags = struct.unpack_from("<H", raw, 10)[0]
    word = struct.unpack_from("<Q", raw, 40)[0]
    return flags, word


def metadata(raw: bytes) -> dict[str, object]:
    (meta_len,) = struct.unpack_from("<I", raw, 12)
    doc: dict[str, object] = json.loads(raw[64 : 64 + meta_len])
    return doc


# --- the codec ---------------------------------------------------------------------------


def test_short_or_non_bytes_secrets_are_refused_without_echoing_them() -> None:
    with pytest.raises(ValueError, match="at least 16 bytes") as info:
        Codec.create(b"short-secret")
    assert "short-secret" not in str(info.value)
    with pytest.raises(TypeError, match="bytes"):
        Codec.create("a text secret, not bytes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="current secret"):
        Codec.create(None, [SECRET])
    with pytest.raises(TypeError):
        Codec.create(SECRET, SECRET)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least 16"):
        MemoryConnector(capacity_bytes=MIB, secret=b"x" * 15)


def test_secrets_and_keys_never_show_in_a_repr() -> None:
    codec = Codec.create(SECRET, [OTHER])
    conn = MemoryConnector(capacity_bytes=MIB, secret=SECRET)
    block = serde.decode(serde.encode(meta(), bytes(32), codec).join(), codec=codec)
    draft = serde.prepare(meta(), bytes(32), codec)
    texts = [repr(codec), str(codec), repr(codec.sealer), repr(conn.codec), repr(conn)]
    texts += [repr(block), repr(block.encoded), repr(draft), repr(vars(conn))]
    keys = [codec.sealer._frame_key, codec.sealer._payload_key]
    for text in texts:
        for secret in (SECRET, OTHER, *keys):
            assert secret.hex() not in text and repr(secret)[2:-1] not in text
    assert "key_id" in repr(codec) and "previous_keys=1" in repr(codec)


def meta(**kw: object) -> serde.BlockMeta:
    fields: dict[str, object] = {
        "key": "ab" * 48, "tenant": "t", "model": "org/m", "layout": "0123456789abcdef",
        "group": 1, "kind": "kv", "token_start": 0, "token_end": 16, "dtype": "uint8",
        "shape": (2, 16),
    }  # fmt: skip
    fields.update(kw)
    return serde.BlockMeta(**fields)  # type: ignore[arg-type]


def test_mac_format_flags_field_names_and_key_ids() -> None:
    codec = Codec.create(SECRET)
    raw = serde.encode(meta(), bytes(32), codec).join()
    plain = serde.encode(meta(), bytes(32)).join()
    assert envelope(plain) == (0, 0) and "payload_xxh3_128" in metadata(plain)
    assert envelope(raw) == (FLAG_MAC, codec.key_id)
    doc = metadata(raw)
    assert "payload_blake3_mac" in doc and "payload_xxh3_128" not in doc
    assert serde.decode(raw, arrow_check=True, codec=codec).meta == meta()  # Arrow intact
    # The key id is a fingerprint of the secret: stable, and different per secret.
    assert Codec.create(SECRET).key_id == codec.key_id != Codec.create(OTHER).key_id
    # The draft path (disk hashes on its I/O thread) seals the same way.
    assert serde.prepare(meta(), bytes(32), codec).seal().join() == raw


def test_keyed_and_unkeyed_readers_refuse_each_others_objects() -> None:
    keyed, other = Codec.create(SECRET), Codec.create(OTHER)
    plain = serde.encode(meta(), bytes(32)).join()
    mac = serde.encode(meta(), bytes(32), keyed).join()
    assert serde.decode(mac, codec=keyed).encoded.key_id == keyed.key_id  # type: ignore[union-attr]
    for raw, codec, why in [
        (plain, keyed, "not MAC'd"),
        (mac, serde.PLAIN, "no secret"),
        (mac, other, "unknown secret"),
    ]:
        with pytest.raises(serde.Unauthenticated, match=why):
            serde.decode(raw, codec=codec)
        assert serde.hash_payload(raw, codec) is None  # no wasted pass on the I/O thread


def test_a_forger_without_the_secret_cannot_get_through() -> None:
    """Setting the flag and the key id (both public) with an xxh3 frame, or a MAC'd
    object with its metadata changed and the payload tag kept, both fail the frame tag."""
    keyed = Codec.create(SECRET)
    mac = bytearray(serde.encode(meta(), bytes(32), keyed).join())
    payload = bytes(32)
    doc = meta_doc(meta(), payload)
    doc["payload_blake3_mac"] = doc.pop("payload_xxh3_128")
    forged = forge_doc(doc, payload, flags=1, word=keyed.key_id or 0)
    with pytest.raises(serde.ChecksumMismatch):
        serde.decode(forged, codec=keyed)
    mac[64 + 40] ^= 1  # inside the metadata, frame tag left as it was
    with pytest.raises(serde.ChecksumMismatch):
        serde.decode(mac, codec=keyed)


def test_every_flip_and_truncation_of_a_mac_d_object_is_detected() -> None:
    codec = Codec.create(SECRET)
    rng = random.Random("mac-damage")
    objects = [
        serde.encode(meta(shape=(2, n // 2)), rng.randbytes(n), codec).join()
        for n in (64, 1000, 6000)
    ]
    for i in range(2000):  # 1,000 flips and 1,000 truncations
        bad = damage(objects[i % 3], rng, flip=i % 2 == 0)
        with pytest.raises(serde.BlockFormatError):
            serde.decode(bad, codec=codec)


def test_rotation_reads_old_secrets_and_seals_with_the_new_one() -> None:
    old, new = Codec.create(OTHER), Codec.create(SECRET, [OTHER])
    raw = serde.encode(meta(), bytes(32), old).join()
    block = serde.decode(raw, codec=new)
    assert block.encoded is not None and block.encoded.key_id == old.key_id
    assert new.key_id != old.key_id
    with pytest.raises(serde.Unauthenticated):
        serde.decode(raw, codec=Codec.create(SECRET))  # rotation finished: refused


def test_payload_digests_from_the_io_thread_are_the_codec_s() -> None:
    codec = Codec.create(SECRET)
    raw = serde.encode(meta(), bytes(range(32)), codec).join()
    digest = serde.hash_payload(raw, codec)
    assert digest is not None
    assert serde.decode(raw, payload_digest=digest, codec=codec).meta == meta()
    wrong = (digest[0], digest[1], bytes(16))
    with pytest.raises(serde.ChecksumMismatch):
        serde.decode(raw, payload_digest=wrong, codec=codec)


# --- in the stores -----------------------------------------------------------------------


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_round_trip_with_a_secret(kind: str, make_store: Callable[..., StoreBase]) -> None:
    items = make_items(namespace(), 4, nbytes=4096)
    async with make_store(kind) as conn:
        assert await conn.put(items, timeout=T) == 4
        got = await conn.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        sealed_by = {g.encoded.key_id for g in got if g is not None and g.encoded is not None}
        assert sealed_by == {conn.codec.key_id}
        raw = await conn.read_raw(items[0][0], timeout=T)
        assert raw is not None and envelope(raw) == (1, conn.codec.key_id)
        assert conn.stats().corrupt_detected == 0


def forged_objects(key: ObjectKey) -> dict[str, bytes]:
    """What a writer without the secret can store: an intact unkeyed object, or one MAC'd
    with a secret of its own."""
    block = make_block(key, 64, rows=2)
    return {
        "xxh3, no MAC": serde.encode(block.meta, block.payload).join(),
        "MAC'd with another secret": serde.encode(
            block.meta, block.payload, Codec.create(OTHER)
        ).join(),
    }


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_forged_objects_are_counted_misses_and_deleted(
    kind: str, make_store: Callable[..., StoreBase]
) -> None:
    key = namespace().key(b"\x05" * 32)
    block = make_block(key, 64, rows=2)
    async with make_store(kind) as conn:
        forged = forged_objects(key)
        for n, raw in enumerate(forged.values(), start=1):
            await conn.write_raw(key, raw, timeout=T)
            assert await conn.get([key], timeout=T) == [None]
            assert await conn.read_raw(key, timeout=T) is None, "forged object kept"
            assert conn.stats().corrupt_detected == n
        assert await conn.put([(key, block)], timeout=T) == 1
        assert same((await conn.get([key], timeout=T))[0], block)


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_a_reader_without_a_secret_refuses_mac_d_objects(
    kind: str, make_store: Callable[..., StoreBase]
) -> None:
    key = namespace().key(b"\x06" * 32)
    block = make_block(key, 64, rows=2)
    async with make_store(kind, secret=None) as conn:
        await conn.write_raw(
            key, serde.encode(block.meta, block.payload, Codec.create(SECRET)).join(), timeout=T
        )
        assert await conn.get([key], timeout=T) == [None]
        assert conn.stats().corrupt_detected == 1
        assert await conn.read_raw(key, timeout=T) is None


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", STORE_KINDS)
async def test_damaged_mac_d_objects_are_detected_in_every_store(
    kind: str, make_store: Callable[..., StoreBase]
) -> None:
    rng = random.Random(f"mac-store-{kind}")
    key = namespace().key(b"\x07" * 32)
    block = make_block(key, 700, rows=2)
    async with make_store(kind) as conn:
        raw = serde.encode(block.meta, block.payload, conn.codec).join()
        for i in range(200):
            await conn.write_raw(key, damage(raw, rng, flip=i % 2 == 0), timeout=T)
            assert await conn.get([key], timeout=T) == [None]
        assert conn.stats().corrupt_detected == 200
        await conn.write_raw(key, raw, timeout=T)
        assert same((await conn.get([key], timeout=T))[0], block)


@pytest.mark.asyncio
async def test_without_a_secret_stores_write_exactly_the_old_bytes(
    make_store: Callable[..., StoreBase],
) -> None:
    """What every store writes without a secret is the pre-MAC encoding (golden, see
    test_conn_serde), e.g. the memory store's copy of a put."""
    async with make_store("memory", secret=None) as conn:
        assert conn.codec == serde.PLAIN
        for (m, payload), (length, sha) in zip(golden_inputs(), GOLDEN, strict=True):
            raw = serde.encode(m, payload, conn.codec).join()
            assert (len(raw), hashlib.sha256(raw).hexdigest()) == (length, sha)
        items = make_items(namespace(), 1)
        await conn.put(items, timeout=T)
        stored = await conn.read_raw(items[0][0], timeout=T)
        assert stored == serde.encode(items[0][1].meta, items[0][1].payload).join()


async def copy(src: StoreBase, dst: StoreBase, keys: list[ObjectKey]) -> None:
    """Read verified blocks from ``src`` (they carry the bytes read) and store them in
    ``dst``, as a tiered promotion does."""
    blocks = await src.get(keys, timeout=T)
    moved = [(k, b) for k, b in zip(keys, blocks, strict=True) if b is not None]
    assert len(moved) == len(keys) and all(b.encoded is not None for _, b in moved)
    assert await dst.put(moved, timeout=T) == len(keys)


@pytest.mark.asyncio
async def test_bytes_are_resealed_when_they_move_to_a_store_that_seals_otherwise(
    make_store: Callable[..., StoreBase],
) -> None:
    items = make_items(namespace(), 2)
    keys = [k for k, _ in items]
    async with (
        make_store("memory", secret=None) as plain,
        make_store("disk") as keyed,
        make_store("memory", secret=None) as plain_again,
        make_store("memory", secret=OTHER) as old,
        make_store("memory", secret=SECRET, previous=[OTHER]) as rotated,
    ):
        await plain.put(items, timeout=T)
        await copy(plain, keyed, keys)  # unkeyed bytes: MAC'd on the way in
        await copy(keyed, plain_again, keys)  # and back
        for store in (keyed, plain_again):
            got = await store.get(keys, timeout=T)
            assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
            raw = await store.read_raw(keys[0], timeout=T)
            assert raw is not None and envelope(raw)[1] == (store.codec.key_id or 0)
        # Rotation: bytes sealed with the previous secret load, and are re-sealed with the
        # current one when stored.
        await old.put(items, timeout=T)
        await copy(old, rotated, keys)
        raw = await rotated.read_raw(keys[0], timeout=T)
        assert raw is not None and envelope(raw)[1] == rotated.codec.key_id != old.codec.key_id


# --- tiered and fault injection ----------------------------------------------------------


@pytest.mark.asyncio
async def test_tiered_encodes_once_with_its_tiers_secret(
    make_store: Callable[..., StoreBase],
) -> None:
    tiers = [make_store("memory"), make_store("disk"), make_store("redis")]
    items = make_items(namespace(), 3)
    async with TieredConnector(tiers) as tiered:
        assert tiered.codec == tiers[0].codec and tiered.codec.keyed
        assert await tiered.put(items, timeout=T) == 3
        raws = [await t.read_raw(items[0][0], timeout=T) for t in tiers]
        assert raws[0] == raws[1] == raws[2] and envelope(raws[0] or b"")[0] == 1
        await tiers[0].delete([k for k, _ in items], timeout=T)
        got = await tiered.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        await tiered.drain()
        assert await tiers[0].lookup([k for k, _ in items], timeout=T) == 3  # promoted
        assert tiered.stats().corrupt_detected == 0


@pytest.mark.asyncio
async def test_tiered_refuses_tiers_with_different_secrets(
    make_store: Callable[..., StoreBase],
) -> None:
    for secrets in [(SECRET, None), (SECRET, OTHER), (None, SECRET)]:
        tiers = [make_store("memory", secret=secrets[0]), make_store("disk", secret=secrets[1])]
        with pytest.raises(ValueError, match="same secret"):
            common_codec(tiers)
        with pytest.raises(ValueError, match="same secret"):  # at construction, not first put
            TieredConnector(tiers)
        for tier in tiers:
            await tier.aclose()


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["memory", "disk", "redis", "tiered"])
async def test_injected_corruption_of_mac_d_objects_is_still_caught(
    kind: str, make_store: Callable[..., StoreBase]
) -> None:
    inner: Connector
    if kind == "tiered":
        inner = TieredConnector([make_store("memory"), make_store("disk")])
    else:
        inner = make_store(kind)
    plan = FaultPlan(corrupt_write_rate=1.0)
    items = make_items(namespace(), 10, nbytes=512)
    async with FaultInjector(inner, plan, seed=7) as conn:
        assert conn.codec == inner.codec and conn.codec.keyed
        await conn.put(items, timeout=T)
        assert await conn.get([k for k, _ in items], timeout=T) == [None] * 10
        # Each damaged object was stored as the injector made it (a MAC'd object with one
        # flip or a truncation), not re-encoded by the store: caught by its checksums.
        assert conn.injected.corrupted == 10
        assert conn.stats().corrupt_detected >= 10
