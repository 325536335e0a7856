"""Block hashing: byte-identity with vLLM 0.33.0.

The references below are written from the definition (``H((parent, tuple(tokens),
extra_keys))`` with ``H`` = sha256 of canonical CBOR or of a pickle), never by calling
the code under test.  The golden hashes were recorded with vLLM 0.33.0's own hasher
(``conformance/reference/vllm_reference.py``).
"""

from __future__ import annotations

import hashlib
import pickle
from typing import Any

import cbor2
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplugin.core.hashing import (
    DEFAULT_NONE_HASH_SEED,
    BlockHasher,
    HashContext,
    _sha256_cbor_chain,
    get_hash_fn_by_name,
    sha256,
    sha256_cbor,
)
from kvplugin.core.request import LoRAInfo, Request
from kvplugin.replay import hex16

# Token ids: mostly vocabulary-sized, sometimes anything CBOR has to encode specially
# (every head width, 64-bit limits, bignums of both signs).
EDGE_TOKENS = [0, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**64 - 1, 2**64,
               -1, -24, -25, -256, -257, -2**64, -2**64 - 1, 2**70, -2**70]
tokens_st = st.one_of(
    st.integers(0, 300),
    st.integers(0, 200_000),
    st.integers(-(2**72), 2**72),
    st.sampled_from(EDGE_TOKENS),
)


def ref_cbor(obj: Any) -> bytes:
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def ref_pickle(obj: Any) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


REF = {"sha256_cbor": ref_cbor, "sha256": ref_pickle}


def ref_chain(hash_fn: str, seed: str, tokens: list[int], bs: int, *,
              salt: str | None = None, lora: LoRAInfo | None = None,
              lookahead: int = 0) -> list[bytes]:
    """vLLM's request block hasher, from its definition."""
    h = REF[hash_fn]
    parent = h(seed)
    out = []
    start = 0
    while start + bs <= len(tokens) - lookahead:
        keys: list[Any] = []
        if lora is not None:
            keys.append(("lora", lora.lora_name, lora.lora_path))
        if start == 0 and salt:
            keys.append(("cache_salt", salt))
        extra: Any = tuple(keys) if keys else None
        if lookahead:
            extra = (extra, *tokens[start + bs:start + bs + lookahead])
        parent = h((parent, tuple(tokens[start:start + bs]), extra))
        out.append(parent)
        start += bs
    return out


# ----------------------------------------------------------------------------- fast path


@settings(max_examples=300, deadline=None)
@given(tokens=st.lists(tokens_st, max_size=80), bs=st.integers(1, 20),
       parent=st.binary(min_size=1, max_size=40))
def test_fast_cbor_chain_is_byte_identical_to_cbor2(tokens: list[int], bs: int,
                                                     parent: bytes) -> None:
    expected = []
    p = parent
    for start in range(0, len(tokens) - bs + 1, bs):
        p = ref_cbor((p, tuple(tokens[start:start + bs]), None))
        expected.append(p)
    assert _sha256_cbor_chain(parent, tokens, 0, len(tokens), bs) == expected


def test_fast_cbor_chain_edge_tokens_one_per_block() -> None:
    none = sha256_cbor(DEFAULT_NONE_HASH_SEED)
    for t in EDGE_TOKENS:
        assert _sha256_cbor_chain(none, [t], 0, 1, 1) == [ref_cbor((none, (t,), None))], t


def test_fast_cbor_chain_respects_start_and_limit() -> None:
    toks = list(range(50))
    p = b"\x01" * 32
    got = _sha256_cbor_chain(p, toks, 8, 30, 4)  # blocks [8,12) ... [24,28)
    assert len(got) == 5
    assert got[0] == ref_cbor((p, tuple(range(8, 12)), None))
    assert got[-1] == ref_cbor((got[-2], tuple(range(24, 28)), None))


@settings(max_examples=150, deadline=None)
@given(tokens=st.lists(tokens_st, max_size=70), bs=st.integers(1, 16),
       hash_fn=st.sampled_from(["sha256_cbor", "sha256"]),
       seed=st.one_of(st.none(), st.text(max_size=12)),
       salt=st.one_of(st.none(), st.sampled_from(["", "s1", "tenant-9"])),
       lora=st.one_of(st.none(), st.builds(LoRAInfo, st.sampled_from(["L", "M"]),
                                           st.integers(1, 5), st.sampled_from(["", "/p"]))),
       lookahead=st.sampled_from([0, 0, 1, 2]))
def test_request_hasher_matches_the_definition(tokens: list[int], bs: int, hash_fn: str,
                                               seed: str | None, salt: str | None,
                                               lora: LoRAInfo | None, lookahead: int) -> None:
    ctx = HashContext.create(hash_fn, seed)
    hasher = BlockHasher(ctx, bs, lookahead)
    req = Request("r", tokens, block_hasher=hasher, cache_salt=salt, lora_request=lora)
    expected = ref_chain(hash_fn, DEFAULT_NONE_HASH_SEED if seed is None else seed, tokens, bs,
                         salt=salt, lora=lora, lookahead=lookahead)
    assert req.block_hashes == expected
    # A second request through the same (memoising) hasher gets the same answer.
    again = Request("r2", tokens, block_hasher=hasher, cache_salt=salt, lora_request=lora)
    assert again.block_hashes == expected


@settings(max_examples=150, deadline=None)
@given(prompt=st.lists(tokens_st, min_size=1, max_size=40),
       chunks=st.lists(st.lists(tokens_st, max_size=9), max_size=12),
       bs=st.integers(1, 8),
       hash_fn=st.sampled_from(["sha256_cbor", "sha256"]),
       salt=st.sampled_from([None, "s"]),
       lora=st.sampled_from([None, LoRAInfo("L", 1, "/p")]),
       lookahead=st.sampled_from([0, 1, 3]))
def test_incremental_hashing_equals_hashing_all_at_once(
        prompt: list[int], chunks: list[list[int]], bs: int, hash_fn: str, salt: str | None,
        lora: LoRAInfo | None, lookahead: int) -> None:
    ctx = HashContext.create(hash_fn)
    grown = Request("g", prompt, block_hasher=BlockHasher(ctx, bs, lookahead),
                    cache_salt=salt, lora_request=lora)
    for chunk in chunks:
        if len(chunk) == 1 and chunk[0] % 2:
            grown.append_output_token_ids(chunk[0])  # the single-int form
        else:
            grown.append_output_token_ids(chunk)
    everything = prompt + [t for c in chunks for t in c]
    assert grown.all_token_ids == everything
    whole = Request("w", everything, block_hasher=BlockHasher(ctx, bs, lookahead),
                    cache_salt=salt, lora_request=lora)
    assert grown.block_hashes == whole.block_hashes
    assert len(whole.block_hashes) == max(0, len(everything) - lookahead) // bs


@settings(max_examples=100, deadline=None)
@given(tokens=st.lists(st.integers(0, 50), min_size=8, max_size=64), data=st.data())
def test_changing_a_token_changes_its_block_and_every_later_hash(tokens: list[int],
                                                                  data: st.DataObject) -> None:
    """H8: hashes before the changed block stay, all from it on change."""
    bs = 4
    j = data.draw(st.integers(0, len(tokens) - 1))
    alt = list(tokens)
    alt[j] += 1000
    hasher = BlockHasher(HashContext.create(), bs)
    a = Request("a", tokens, block_hasher=hasher).block_hashes
    b = Request("b", alt, block_hasher=hasher).block_hashes
    k = j // bs
    assert a[:k] == b[:k]
    assert all(x != y for x, y in zip(a[k:], b[k:], strict=True))


# ----------------------------------------------------------------------------- seeds


def test_default_seed_none_hash_is_vllms() -> None:
    ctx = HashContext.create()
    assert ctx.seed == DEFAULT_NONE_HASH_SEED == "vllm-none-hash"
    assert ctx.hash_fn is sha256_cbor
    assert ctx.none_hash == ref_cbor("vllm-none-hash")
    assert hex16(ctx.none_hash) == "941b276b9581eef0"  # the traces' resolved none_hash
    pickled = HashContext.create("sha256")
    assert pickled.none_hash == ref_pickle("vllm-none-hash")
    assert hex16(pickled.none_hash) == "105ae6b4f0d71198"  # vLLM 0.33.0, hash_fn sha256


def test_seed_is_injected_not_read_from_the_environment(monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    assert HashContext.create().none_hash == ref_cbor("vllm-none-hash")
    seeded = HashContext.create("sha256_cbor", "123")
    assert seeded.seed == "123" and seeded.none_hash == ref_cbor("123")
    # Two contexts with different seeds coexist and produce different chains.
    toks = list(range(16))
    a = Request("a", toks, block_hasher=BlockHasher(HashContext.create(), 16)).block_hashes
    b = Request("b", toks, block_hasher=BlockHasher(seeded, 16)).block_hashes
    assert a != b and b == [ref_cbor((ref_cbor("123"), tuple(toks), None))]


def test_hash_functions_by_name() -> None:
    import xxhash

    obj = (b"p", (1, 2, 3), None)
    assert get_hash_fn_by_name("sha256")(obj) == ref_pickle(obj) == sha256(obj)
    assert get_hash_fn_by_name("sha256_cbor")(obj) == ref_cbor(obj)
    assert get_hash_fn_by_name("xxhash")(obj) == xxhash.xxh3_128_digest(
        pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))
    assert get_hash_fn_by_name("xxhash_cbor")(obj) == xxhash.xxh3_128_digest(
        cbor2.dumps(obj, canonical=True))
    with pytest.raises(ValueError, match="Unsupported hash function: md5"):
        get_hash_fn_by_name("md5")
    with pytest.raises(ValueError, match="Unsupported hash function"):
        HashContext.create("md5")


def test_hasher_rejects_bad_sizes() -> None:
    ctx = HashContext.create()
    with pytest.raises(ValueError, match="hash block size"):
        BlockHasher(ctx, 0)
    with pytest.raises(ValueError, match="lookahead"):
        BlockHasher(ctx, 16, -1)


# ----------------------------------------------------------------------------- golden


GOLDEN_TOKENS = [0, 23, 24, 255, 256, 65535, 65536, 2**32, 2**64 - 1, 2**64, -1, -25, -257,
                 -2**64, -2**64 - 1, 7]


@pytest.mark.parametrize(("hash_fn", "tokens", "kw", "expected"), [
    ("sha256_cbor", list(range(1, 10)), {}, ["84b146b151d55111", "d43b57df56b58fb1"]),
    ("sha256_cbor", list(range(1, 10)), {"cache_salt": "s1", "lora": True},
     ["bf1e539525184781", "ebb28d2f32d99e18"]),
    ("sha256_cbor", GOLDEN_TOKENS, {},
     ["ae74c52db0f7a8e2", "6f2325eac34be5d8", "3169bb3b0db9d2b8", "956380a47ee7ac4a"]),
    ("sha256", list(range(1, 10)), {}, ["1a1eb4e3edd9361a", "d41bc1f76b956dde"]),
    ("sha256", list(range(1, 10)), {"cache_salt": "s1", "lora": True},
     ["fda7a432a1b65e6d", "a3fb6c862c2eb5ae"]),
])
def test_golden_hashes_recorded_on_vllm(hash_fn: str, tokens: list[int], kw: dict[str, Any],
                                        expected: list[str]) -> None:
    lora = LoRAInfo("L", 1, "/loras/L") if kw.pop("lora", False) else None
    hasher = BlockHasher(HashContext.create(hash_fn), 4)
    req = Request("r", tokens, block_hasher=hasher, lora_request=lora, **kw)
    assert [hex16(h) for h in req.block_hashes] == expected


def test_golden_lookahead_hashes_recorded_on_vllm() -> None:
    hasher = BlockHasher(HashContext.create(), 4, lookahead=1)
    a = Request("a", list(range(1, 9)), block_hasher=hasher)
    assert [hex16(h) for h in a.block_hashes] == ["e7dba598d2abc4b0"]
    a.append_output_token_ids(9)
    assert [hex16(h) for h in a.block_hashes] == ["e7dba598d2abc4b0", "081fc5f805366036"]
    b = Request("b", [*range(1, 9), 10], block_hasher=hasher)
    assert [hex16(h) for h in b.block_hashes] == ["e7dba598d2abc4b0", "8c0ca1c6a4e65afa"]
