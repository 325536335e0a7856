"""Chained block hashing, byte-identical to vLLM 0.33.0.

``h_i = H((h_{i-1} or NONE_HASH, tuple(block_tokens), extra_keys))`` where ``H`` is the
configured hash function and ``NONE_HASH = H(seed)``.  The hash function and the seed are
injected through :class:`HashContext`; nothing here is process-global, so two managers
with different seeds coexist in one interpreter.
"""

from __future__ import annotations

import bisect
import functools
import hashlib
import pickle
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, overload

import cbor2

from kvplugin.core.blocks import BlockHash

if TYPE_CHECKING:
    from kvplugin.core.request import Request

HashFn = Callable[[Any], bytes]

DEFAULT_NONE_HASH_SEED = "vllm-none-hash"


def sha256(obj: Any) -> bytes:
    """SHA-256 of the pickled object (vLLM's ``sha256``; Python-only)."""
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def sha256_cbor(obj: Any) -> bytes:
    """SHA-256 of canonical CBOR (vLLM's ``sha256_cbor``; language-neutral)."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


def _xxh3_128(data: bytes) -> bytes:
    import xxhash  # optional; imported lazily so the core has no hard dependency

    return xxhash.xxh3_128_digest(data)


def xxhash_pickle(obj: Any) -> bytes:
    return _xxh3_128(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def xxhash_cbor(obj: Any) -> bytes:
    return _xxh3_128(cbor2.dumps(obj, canonical=True))


HASH_FUNCTIONS: dict[str, HashFn] = {
    "sha256": sha256,
    "sha256_cbor": sha256_cbor,
    "xxhash": xxhash_pickle,
    "xxhash_cbor": xxhash_cbor,
}


def get_hash_fn_by_name(name: str) -> HashFn:
    try:
        return HASH_FUNCTIONS[name]
    except KeyError:
        raise ValueError(f"Unsupported hash function: {name}") from None


@dataclass(frozen=True, slots=True)
class HashContext:
    """The hash function and the root parent hash it chains from.

    vLLM derives the seed from ``PYTHONHASHSEED`` or a fixed string; here the seed is an
    explicit argument (``None`` means vLLM's default ``"vllm-none-hash"``) so that results
    never depend on the ambient environment.  The xxhash family is not collision
    resistant, so callers wanting vLLM's per-process random seed must pass one.
    """

    hash_fn: HashFn
    none_hash: BlockHash
    seed: str

    @classmethod
    def create(cls, hash_fn: HashFn | str = "sha256_cbor", seed: str | None = None) -> HashContext:
        fn = get_hash_fn_by_name(hash_fn) if isinstance(hash_fn, str) else hash_fn
        resolved = DEFAULT_NONE_HASH_SEED if seed is None else str(seed)
        return cls(fn, fn(resolved), resolved)

    def hash_block_tokens(
        self,
        parent: BlockHash | None,
        tokens: Sequence[int],
        extra_keys: tuple[Any, ...] | None = None,
    ) -> BlockHash:
        return self.hash_fn((parent or self.none_hash, tuple(tokens), extra_keys))


# ----------------------------------------------------------------------------- extra keys


def _mm_extra_keys(
    request: Request, start: int, end: int, start_mm_idx: int
) -> tuple[list[Any], int]:
    """("mm", identifier, offset relative to the block start) for items overlapping it."""
    feats = request.mm_features
    keys: list[Any] = []
    if not feats:
        return keys, start_mm_idx
    last = feats[-1]
    if last.offset + last.length <= start:
        return keys, start_mm_idx
    if start_mm_idx < 0:
        start_mm_idx += len(feats)
    idx = start_mm_idx
    while idx < len(feats):
        f = feats[idx]
        if end <= f.offset:
            break
        if start >= f.offset + f.length:
            idx += 1
            continue
        keys.append(("mm", f.identifier, f.offset - start))
        if end >= f.offset + f.length:
            idx += 1  # the block holds this item's end and may hold the next one too
        else:
            break
    return keys, idx


def _prompt_embeds_keys(request: Request, start: int, end: int) -> list[tuple[str, bytes]]:
    if request.prompt_embeds is None:
        return []
    memo = request.prompt_embeds_hashes
    digest = memo.get((start, end))
    if digest is None:
        digest = hashlib.sha256(request.prompt_embeds_bytes(start, end)).digest()
        memo[(start, end)] = digest
    return [("prompt_embeds", digest)]


def generate_block_hash_extra_keys(
    request: Request, start: int, end: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """Tagged extra keys of the block ``[start, end)``: LoRA, mm, cache salt, embeds."""
    mm_keys, next_mm_idx = _mm_extra_keys(request, start, end, start_mm_idx)
    keys: list[Any] = []
    lora = request.lora_request
    if lora is not None:
        keys.append(("lora", lora.lora_name, lora.lora_path))
    keys.extend(mm_keys)
    if start == 0 and request.cache_salt:
        keys.append(("cache_salt", request.cache_salt))
    keys.extend(_prompt_embeds_keys(request, start, end))
    return (tuple(keys) if keys else None), next_mm_idx


def generate_lookahead_block_hash_extra_keys(
    request: Request, start: int, end: int, hash_end: int, start_mm_idx: int
) -> tuple[tuple[Any, ...] | None, int]:
    """Extra keys over the widened window; the mm cursor rewinds to items past ``end``."""
    keys, mm_idx = generate_block_hash_extra_keys(request, start, hash_end, start_mm_idx)
    while mm_idx > 0:
        f = request.mm_features[mm_idx - 1]
        if f.offset + f.length <= end:
            break
        mm_idx -= 1
    return keys, mm_idx


def to_event_extra_keys(
    extra_keys: Sequence[tuple[Any, ...] | None] | None,
) -> list[tuple[Any, ...] | None] | None:
    """Untagged per-block extra keys as KV events publish them."""
    if not extra_keys:
        return None
    return [
        None if keys is None else tuple(k[1:] if k[0] == "mm" else k[1] for k in keys)
        for keys in extra_keys
    ]


def _mm_cursor_for(request: Request, start: int, hbs: int) -> int:
    feats = request.mm_features
    if start > 0 and feats:
        last = feats[-1]
        if last.offset + last.length > start:
            return bisect.bisect_left(feats, start + 1, key=lambda f: f.offset + f.length)
    return 0


# ----------------------------------------------------------------------------- hasher


class BlockHasher:
    """Computes a request's *new* full hash blocks as its tokens grow.

    With ``lookahead`` L > 0 a block's hash also commits to the L tokens after it (EAGLE
    drafters read them), so it exists only once those tokens do.
    """

    __slots__ = ("_ctx", "_fast", "_memo", "block_size", "lookahead")

    # Bound of the (parent, tokens) -> hash memo: shared system prompts and multi-turn
    # resends re-hash the same blocks again and again.
    MEMO_ENTRIES = 1 << 13  # ~3 MiB when full: bounded well below the pool it serves

    def __init__(self, ctx: HashContext, block_size: int, lookahead: int = 0) -> None:
        if block_size <= 0:
            raise ValueError(f"hash block size must be positive, got {block_size}")
        if lookahead < 0:
            raise ValueError(f"num_hash_lookahead_tokens must be >= 0, got {lookahead}")
        self._ctx = ctx
        self.block_size = block_size
        self.lookahead = lookahead
        self._fast = ctx.hash_fn is sha256_cbor and lookahead == 0
        self._memo: dict[tuple[bytes, bytes, tuple[int, ...]], BlockHash] = {}

    def __call__(self, request: Request) -> list[BlockHash]:
        bs = self.block_size
        start = len(request.block_hashes) * bs
        limit = request.num_tokens - self.lookahead
        if start + bs > limit:
            return []
        parent = request.block_hashes[-1] if request.block_hashes else self._ctx.none_hash
        if not (self._fast and request.uniform_after_first_block):
            return self._hash_general(request, start, limit, parent)
        out: list[BlockHash] = []
        if start == 0 and request.cache_salt:
            out = self._hash_general(request, 0, bs, parent)  # block 0 carries the salt
            parent, start = out[0], bs
        lora = request.lora_request
        # The extra keys of every remaining block are the same, so their canonical CBOR
        # encoding (the third element of the hashed triple) is computed once.
        tail = _NONE_TAIL if lora is None else _lora_tail(lora.lora_name, lora.lora_path)
        return out + self._hash_uniform(request.all_token_ids, start, limit, parent, tail)

    def _hash_uniform(self, tokens: Sequence[int], start: int, limit: int, parent: BlockHash,
                      tail: bytes) -> list[BlockHash]:
        """Blocks sharing one extra-keys encoding: memoised fast canonical-CBOR path."""
        bs = self.block_size
        memo = self._memo
        if len(memo) >= self.MEMO_ENTRIES:
            memo.clear()
        out: list[BlockHash] = []
        while start + bs <= limit:
            block = tuple(tokens[start:start + bs])
            key = (parent, tail, block)
            h = memo.get(key)
            if h is None:
                h = _sha256_cbor_block(parent, block, bs, tail)
                memo[key] = h
            out.append(h)
            parent = h
            start += bs
        return out

    def _hash_general(
        self, request: Request, start: int, limit: int, parent: BlockHash
    ) -> list[BlockHash]:
        bs, la, hash_fn = self.block_size, self.lookahead, self._ctx.hash_fn
        tokens = request.all_token_ids
        mm_idx = _mm_cursor_for(request, start, bs)
        out: list[BlockHash] = []
        while start + bs <= limit:
            end = start + bs
            extra: Any
            if la:
                extra, mm_idx = generate_lookahead_block_hash_extra_keys(
                    request, start, end, end + la, mm_idx
                )
                extra = (extra, tokens[end]) if la == 1 else (extra, *tokens[end : end + la])
            else:
                extra, mm_idx = generate_block_hash_extra_keys(request, start, end, mm_idx)
            parent = hash_fn((parent, tuple(tokens[start:end]), extra))
            out.append(parent)
            start = end
        return out


# --- a specialised canonical-CBOR encoder for the common case -----------------------------
# The hashed object of a block without extra keys is ``(parent: bytes, tokens: tuple[int],
# None)``.  Encoding it by hand (with a per-token memo) gives exactly cbor2's canonical bytes
# (tests compare the two on random inputs) at a fraction of the cost.

_TOKEN_ENC: dict[int, bytes] = {}


def _cbor_uint_head(major: int, n: int) -> bytes:
    m = major << 5
    if n < 24:
        return bytes((m | n,))
    if n < 0x100:
        return bytes((m | 24, n))
    if n < 0x10000:
        return bytes((m | 25,)) + n.to_bytes(2, "big")
    if n < 0x100000000:
        return bytes((m | 26,)) + n.to_bytes(4, "big")
    if n < 0x10000000000000000:
        return bytes((m | 27,)) + n.to_bytes(8, "big")
    return cbor2.dumps(n, canonical=True)  # bignum tags: defer to the reference encoder


def _encode_token(t: int) -> bytes:
    if 24 <= t < 0x10000:  # the common vocabulary range, without the generic helper
        enc = b"\x18" + t.to_bytes(1, "big") if t < 0x100 else b"\x19" + t.to_bytes(2, "big")
    elif t >= 0:
        enc = _cbor_uint_head(0, t)
    elif t >= -0x10000000000000000:
        enc = _cbor_uint_head(1, -1 - t)
    else:  # a negative bignum (tag 3): _cbor_uint_head would encode its magnitude as tag 2
        enc = cbor2.dumps(t, canonical=True)
    if len(_TOKEN_ENC) < 1 << 20:  # bound the memo; vocabularies are far smaller
        _TOKEN_ENC[t] = enc
    return enc


def _encode_tokens(tokens: Sequence[int]) -> bytes:
    enc = _TOKEN_ENC
    try:
        return b"".join([enc[t] for t in tokens])
    except KeyError:
        return b"".join([enc.get(t) or _encode_token(t) for t in tokens])


_ARRAY_HEADS: dict[int, bytes] = {}
_NONE_TAIL = b"\xf6"  # canonical CBOR of None


@functools.lru_cache(maxsize=1024)
def _lora_tail(name: str, path: str) -> bytes:
    return cbor2.dumps((("lora", name, path),), canonical=True)


def _sha256_cbor_block(parent: bytes, tokens: Sequence[int], bs: int,
                       tail: bytes = _NONE_TAIL) -> BlockHash:
    """sha256(cbor2.dumps((parent, tuple(tokens), extra), canonical=True)) for ``bs`` tokens,
    where ``tail`` is the canonical encoding of ``extra``."""
    head = _ARRAY_HEADS.get(bs)
    if head is None:
        head = _ARRAY_HEADS[bs] = _cbor_uint_head(4, bs)
    return hashlib.sha256(b"".join((b"\x83", _cbor_uint_head(2, len(parent)), parent, head,
                                    _encode_tokens(tokens), tail))).digest()


def _sha256_cbor_chain(
    parent: bytes, tokens: Sequence[int], start: int, limit: int, bs: int
) -> list[BlockHash]:
    out: list[BlockHash] = []
    while start + bs <= limit:
        parent = _sha256_cbor_block(parent, tokens[start:start + bs], bs)
        out.append(parent)
        start += bs
    return out


# ----------------------------------------------------------------------------- hash views


class BlockHashListWithBlockSize(Sequence[BlockHash]):
    """The hash list seen at a coarser group block size ``k * hbs``.

    Element i is the fine hash at the last hash boundary inside group block i, which
    (chained over the whole prefix) fingerprints that block's prefix.
    """

    __slots__ = ("block_hashes", "scale_factor")

    def __init__(self, block_hashes: Sequence[BlockHash], hash_block_size: int,
                 target_block_size: int) -> None:
        if target_block_size % hash_block_size:
            raise ValueError(
                f"block size {target_block_size} is not a multiple of the hash block size "
                f"{hash_block_size}"
            )
        self.block_hashes = block_hashes
        self.scale_factor = target_block_size // hash_block_size

    def __len__(self) -> int:
        return len(self.block_hashes) // self.scale_factor

    @overload
    def __getitem__(self, idx: int) -> BlockHash: ...

    @overload
    def __getitem__(self, idx: slice) -> list[BlockHash]: ...

    def __getitem__(self, idx: int | slice) -> BlockHash | list[BlockHash]:
        if isinstance(idx, slice):
            return [self.block_hashes[(i + 1) * self.scale_factor - 1]
                    for i in range(*idx.indices(len(self)))]
        if idx < 0:
            idx += len(self)
        if not 0 <= idx < len(self):
            raise IndexError(idx)
        return self.block_hashes[(idx + 1) * self.scale_factor - 1]

    def __iter__(self) -> Iterator[BlockHash]:
        k = self.scale_factor
        hashes = self.block_hashes
        return (hashes[(i + 1) * k - 1] for i in range(len(self)))


def resolve_block_hashes(
    block_hashes: Sequence[BlockHash],
    hash_block_size: int,
    block_size: int,
    *,
    supports_fine_grained_hash_lookup: bool = False,
    alignment_tokens: int | None = None,
) -> Sequence[BlockHash]:
    """The request's hash list viewed at ``block_size`` granularity."""
    if block_size == hash_block_size:
        return block_hashes
    if isinstance(block_hashes, BlockHashListWithBlockSize):
        assert block_hashes.scale_factor == block_size // hash_block_size
        return block_hashes
    if (
        supports_fine_grained_hash_lookup
        and alignment_tokens is not None
        and alignment_tokens < block_size
        and block_size % alignment_tokens == 0
    ):
        return block_hashes
    return BlockHashListWithBlockSize(block_hashes, hash_block_size, block_size)
