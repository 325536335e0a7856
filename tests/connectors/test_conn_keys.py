"""Keys: stable across processes, namespaced, safe for paths and Redis; chunking."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conn_testlib import chain, make_block

from kvplugin import serde
from kvplugin.connectors.keys import (
    Chunker,
    InvalidName,
    Namespace,
    ObjectKey,
    check_id,
    layout_fingerprint,
)

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
HEX96 = re.compile(r"[0-9a-f]{96}")


def ns(**kw: object) -> Namespace:
    base: dict[str, object] = {
        "tenant": "tenant-a",
        "model": "org/model-7b",
        "layout": "0123456789abcdef",
        "group": 2,
        "salt": "s3cret",
    }
    base.update(kw)
    return Namespace(**base)  # type: ignore[arg-type]


GOLDEN_NS = "206cdb1f922f66036ec40e860511f67e"
GOLDEN_KV = GOLDEN_NS + "adfb78b95a9dce8341604e7186fa7b02fffb907e805a6d821f1d8d3d8e7d712a"


def test_keys_are_a_pure_function_of_their_inputs() -> None:
    """Golden values: a change here breaks every stored cache; bump the key version instead."""
    key = ns().key(bytes(range(32)))
    assert ns().hex == GOLDEN_NS
    assert key.id == GOLDEN_KV
    assert ns().key(bytes(range(32)), "mamba_state").id != key.id


def test_keys_agree_across_processes_with_different_hash_seeds() -> None:
    code = (
        "from kvplugin.connectors.keys import Namespace;"
        "n = Namespace('tenant-a', 'org/model-7b', '0123456789abcdef', group=2, salt='s3cret');"
        "print(n.key(bytes(range(32))).id)"
    )
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed, "PYTHONPATH": REPO}
        out = subprocess.run(
            [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
        ).stdout.strip()
        assert out == GOLDEN_KV


@pytest.mark.parametrize(
    "change",
    [
        {"tenant": "tenant-b"},
        {"model": "org/model-8b"},
        {"layout": "0123456789abcdee"},
        {"group": 3},
        {"salt": ""},
        {"salt": b"s3cret2"},
    ],
)
def test_every_namespace_field_changes_the_key(change: dict[str, object]) -> None:
    h = bytes(range(32))
    assert ns(**change).key(h).id != ns().key(h).id
    assert ns(**change).hex != ns().hex
    assert ns(**change) != ns()


def test_ids_are_hex_and_prefixed_by_the_namespace() -> None:
    n = ns()
    for h in chain(20):
        key = n.key(h)
        assert HEX96.fullmatch(key.id) and key.id.startswith(n.hex) and n.owns(key.id)
        assert str(key) == key.id


# Pinned ids: every object stored on disk or in Redis is found by these bytes, so the
# derivation may never change silently (a change is a new _DOMAIN, and a migration note).
GOLDEN = {
    "kv": "c91526fec43292a9b62000d93df585b4317cbc84f9ecd5ef9670edfd3133ce396dfcf2ad01f48a35"
          "a4d7e36f1c7fe7ed",
    "mamba_state": "c91526fec43292a9b62000d93df585b42ccbf741c8e32725fd12e6c02be7af53c2b7484dbd"
                   "b81e7c26001788cdf77caa",
    "partial_tail": "c91526fec43292a9b62000d93df585b47a07510e17570ff3c371ae4684714f280152c4ff"
                    "a4f46323570bc90e5ebbd1bd",
}


def test_ids_are_the_pinned_derivation_whatever_the_hash_buffer() -> None:
    n = Namespace("acme", "org/model-1", "0123456789abcdef", 2, b"salt")
    raw = bytes(range(32))
    for kind, want in GOLDEN.items():
        for h in (raw, bytearray(raw), memoryview(raw)):
            key = n.key(h, kind)
            assert (key.id, key.kind, key.namespace) == (want, kind, n)
            # Built without validating again, it is the key the checked constructor makes.
            assert key == ObjectKey(n, kind, want) and hash(key) == hash(ObjectKey(n, kind, want))
    assert Namespace("acme", "org/model-1", "0123456789abcdef").key(b"\x01").id == (
        "61c0902a43f798f29b0ee298cba2ef61766f2004596e2ea9108e504a1b550cdeee94962022a0d004"
        "9407a0a01dd04f3f")


@pytest.mark.parametrize(
    "tenant",
    ["", "../etc", "a/b", "a b", "a\nb", "ténant", "x" * 65, ".hidden", "-dash", "a:b", "a*"],
)
def test_bad_tenants_are_rejected(tenant: str) -> None:
    with pytest.raises(InvalidName, match="tenant"):
        ns(tenant=tenant)


@pytest.mark.parametrize("model", ["", "../x", "org/../x", "org//x", "a b", "m\x00", "é"])
def test_bad_models_are_rejected(model: str) -> None:
    with pytest.raises(InvalidName, match="model"):
        ns(model=model)


@pytest.mark.parametrize("layout", ["", "xyz", "ABCDEF01", "0123", "0" * 65])
def test_layout_must_be_a_hex_fingerprint(layout: str) -> None:
    with pytest.raises(InvalidName, match="layout"):
        ns(layout=layout)


def test_other_misuse() -> None:
    with pytest.raises(ValueError, match="group"):
        ns(group=-1)
    with pytest.raises(TypeError, match="salt"):
        ns(salt=1)
    with pytest.raises(TypeError, match="bytes"):
        ns().key(12345)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="empty"):
        ns().key(b"")
    with pytest.raises(InvalidName, match="kind"):
        ns().key(b"x", kind="blob")
    for bad in ("../" + "0" * 93, "A" * 96, "0" * 95, 7):
        with pytest.raises(InvalidName):
            check_id(bad)
    with pytest.raises(InvalidName, match="namespace"):
        ObjectKey(ns(), "kv", ns(tenant="other").key(b"x").id)


def test_salt_is_hashed_never_stored() -> None:
    key = ns(salt="very-secret-salt").key(b"\x01" * 32)
    block = make_block(key)
    encoded = serde.encode(block.meta, block.payload).join()
    assert b"very-secret-salt" not in encoded
    assert b"tenant-a" in encoded  # the tenant is recorded


def test_layout_fingerprint() -> None:
    a = layout_fingerprint(dtype="bfloat16", page_bytes=65536, block_size=16, tp_canonical=True)
    b = layout_fingerprint(page_bytes=65536, dtype="bfloat16", tp_canonical=True, block_size=16)
    c = layout_fingerprint(dtype="float16", page_bytes=65536, block_size=16, tp_canonical=True)
    assert a == b != c and re.fullmatch(r"[0-9a-f]{32}", a)
    ns(layout=a)  # usable as a namespace layout
    with pytest.raises(ValueError):
        layout_fingerprint()


def test_chunker_groups_blocks_and_keys_by_the_last_hash() -> None:
    n = ns()
    hashes = chain(10)
    chunker = Chunker(n, tokens_per_block=16, blocks_per_chunk=4)
    chunks = chunker.chunks(hashes)
    assert [(c.first_block, c.num_blocks) for c in chunks] == [(0, 4), (4, 4)]
    assert [c.key for c in chunks] == [n.key(hashes[3]), n.key(hashes[7])]
    assert [(c.token_start, c.token_end) for c in chunks] == [(0, 64), (64, 128)]
    tail = chunker.chunks(hashes, partial_tail=True)
    assert [(c.first_block, c.num_blocks) for c in tail][-1] == (8, 2)
    assert tail[-1].key == n.key(hashes[9]) and tail[-1].token_end == 160
    assert [Chunker.blocks_covered(tail, i) for i in range(4)] == [0, 4, 8, 10]
    assert Chunker(n, tokens_per_block=16).chunks(hashes[:2])[1].key == n.key(hashes[1])
    with pytest.raises(ValueError):
        Chunker.blocks_covered(chunks, 3)
    with pytest.raises(ValueError):
        Chunker(n, tokens_per_block=0)
    with pytest.raises(InvalidName):
        Chunker(n, tokens_per_block=16, kind="nope")
