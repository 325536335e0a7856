"""Storage keys: stable across processes and machines, namespaced, safe as paths and Redis keys.

A key is derived, never chosen: ``sha256`` over a length-prefixed canonical encoding of the
namespace (tenant, model, layout fingerprint, KV-cache group, optional salt) and the chained
block hash of the last block the object covers. Python's ``hash()`` is never involved, so two
processes (or two machines) with the same inputs compute the same key.

The storage id of an object is 96 lowercase hex characters: the 32-hex namespace digest
followed by the 64-hex object digest. Hex only means no separator, dot or slash can reach a
file path or a Redis key; the namespace prefix lets a store group (and drop) a tenant's objects.

Names that do appear in stored metadata (tenant, model, layout) are checked against a strict
charset and rejected with :class:`InvalidName`; the salt is hashed only and never stored.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # keys are named without the object format (pyarrow): see ObjectKey.meta
    from kvplugin.serde import BlockMeta

__all__ = [
    "KINDS",
    "Chunk",
    "Chunker",
    "InvalidName",
    "Namespace",
    "ObjectKey",
    "check_id",
    "layout_fingerprint",
]

_DOMAIN = b"kvplugin/storage-key/v1"
_TENANT_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
# Model names keep their Hugging Face shape ("org/name"); they are hashed, never a path.
_MODEL_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.:/+-]{0,255}")
_LAYOUT_RE = re.compile(r"[0-9a-f]{8,64}")
_ID_RE = re.compile(r"[0-9a-f]{96}")
NS_HEX_LEN = 32

KINDS = frozenset({"kv", "mamba_state", "partial_tail"})
"""What an object holds: KV pages, a Mamba boundary state, or a finish-time partial tail."""


# Each kind's length-prefixed encoding, as hashed into its objects' ids.
_KIND_TAGS = {kind: len(kind).to_bytes(4, "big") + kind.encode() for kind in KINDS}


class InvalidName(ValueError):
    """A tenant, model, layout, kind or storage id does not match its strict charset."""


def _check(value: object, pattern: re.Pattern[str], what: str) -> str:
    if not isinstance(value, str) or pattern.fullmatch(value) is None:
        raise InvalidName(f"invalid {what} {value!r}: must match {pattern.pattern}")
    return value


def _lp(data: bytes) -> bytes:
    """Length-prefixed field, so no two different field lists encode to the same bytes."""
    return len(data).to_bytes(4, "big") + data


def layout_fingerprint(**fields: object) -> str:
    """A 32-hex fingerprint of everything that makes stored bytes (in)compatible.

    Pass e.g. dtype, page bytes, block size, group spec and a TP-canonical flag. Values are
    encoded with ``repr`` after sorting by name, so use plain ints/strs/tuples.
    """
    if not fields:
        raise ValueError("layout_fingerprint needs at least one field")
    canon = "\n".join(f"{k}={fields[k]!r}" for k in sorted(fields)).encode()
    return hashlib.sha256(b"kvplugin/layout/v1\n" + canon).hexdigest()[:32]


@dataclass(frozen=True, slots=True)
class Namespace:
    """Who may see an object: two namespaces differing in any field never share a key.

    ``layout`` is a hex fingerprint (see :func:`layout_fingerprint`); ``salt`` carries a
    per-request cache salt or a deployment seed and is only ever hashed.
    """

    tenant: str
    model: str
    layout: str
    group: int = 0
    salt: bytes | str = field(default=b"", repr=False)
    hex: str = field(init=False, repr=False, compare=False)
    _digest: bytes = field(init=False, repr=False, compare=False)
    _object_prefix: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _check(self.tenant, _TENANT_RE, "tenant")
        _check(self.model, _MODEL_RE, "model")
        if ".." in self.model or "//" in self.model:
            raise InvalidName(f"invalid model {self.model!r}: no '..' or '//' segments")
        _check(self.layout, _LAYOUT_RE, "layout fingerprint")
        if type(self.group) is not int or not 0 <= self.group < 2**32:
            raise ValueError(f"group must be an integer in [0, 2**32), got {self.group!r}")
        salt = self.salt.encode() if isinstance(self.salt, str) else self.salt
        if not isinstance(salt, bytes):
            raise TypeError(f"salt must be bytes or str, got {type(self.salt).__name__}")
        digest = hashlib.sha256(
            _DOMAIN
            + _lp(b"namespace")
            + _lp(self.tenant.encode())
            + _lp(self.model.encode())
            + _lp(self.layout.encode())
            + self.group.to_bytes(4, "big")
            + _lp(salt)
        ).digest()
        object.__setattr__(self, "_digest", digest)
        object.__setattr__(self, "hex", digest[:16].hex())
        object.__setattr__(self, "_object_prefix", _DOMAIN + _lp(b"object") + digest)

    def key(self, block_hash: bytes, kind: str = "kv") -> ObjectKey:
        """The key of the object whose last block has chained hash ``block_hash``.

        On every lookup and store path (a key per chunk), so the fixed part of the hashed
        bytes is made once per namespace, and the key is built without validating again
        what is valid by construction (this namespace's prefix, a sha256 hex digest)."""
        if type(block_hash) is bytes:
            raw = block_hash
        elif isinstance(block_hash, bytearray | memoryview):
            raw = bytes(block_hash)
        else:
            raise TypeError(
                f"block hashes must be bytes (the chained hash), got {type(block_hash).__name__}"
            )
        if not raw:
            raise ValueError("empty block hash")
        tag = _KIND_TAGS.get(kind)
        if tag is None:
            raise InvalidName(f"unknown object kind {kind!r}; known: {sorted(KINDS)}")
        digest = hashlib.sha256(self._object_prefix + tag + _lp(raw)).hexdigest()
        key = object.__new__(ObjectKey)
        object.__setattr__(key, "namespace", self)
        object.__setattr__(key, "kind", kind)
        object.__setattr__(key, "id", self.hex + digest)
        return key

    def owns(self, storage_id: str) -> bool:
        """Whether a storage id belongs to this namespace."""
        return storage_id.startswith(self.hex)


@dataclass(frozen=True, slots=True)
class ObjectKey:
    """One stored object's identity. Build it with :meth:`Namespace.key`."""

    namespace: Namespace
    kind: str
    id: str

    def __post_init__(self) -> None:
        check_id(self.id)
        if not self.id.startswith(self.namespace.hex):
            raise InvalidName("storage id does not belong to the key's namespace")

    def __str__(self) -> str:
        return self.id

    def meta(
        self,
        *,
        token_start: int,
        token_end: int,
        dtype: str,
        shape: tuple[int, ...],
        boundary: int | None = None,
    ) -> BlockMeta:
        """The metadata to store with this key's object."""
        ns = self.namespace
        from kvplugin.serde import BlockMeta  # the format, loaded when a block is made

        return BlockMeta(
            key=self.id,
            tenant=ns.tenant,
            model=ns.model,
            layout=ns.layout,
            group=ns.group,
            kind=self.kind,
            token_start=token_start,
            token_end=token_end,
            dtype=dtype,
            shape=shape,
            boundary=boundary,
        )

    def matches(self, meta: BlockMeta) -> bool:
        """Whether stored metadata is exactly this key's (id and every namespace field)."""
        ns = self.namespace
        return (
            meta.key == self.id
            and meta.kind == self.kind
            and meta.tenant == ns.tenant
            and meta.model == ns.model
            and meta.layout == ns.layout
            and meta.group == ns.group
        )


def check_id(storage_id: object) -> str:
    """Validate a storage id (96 lowercase hex) before it reaches a path or a Redis key."""
    return _check(storage_id, _ID_RE, "storage id")


@dataclass(frozen=True, slots=True)
class Chunk:
    """Consecutive blocks ``[first_block, first_block + num_blocks)`` stored as one object."""

    key: ObjectKey
    first_block: int
    num_blocks: int
    token_start: int
    token_end: int


@dataclass(frozen=True, slots=True)
class Chunker:
    """Groups a request's chained block hashes into chunk objects (like LMCache's chunk_size).

    A chunk's key is the last block's hash in the namespace: the chain makes that hash depend
    on every earlier token, so one key identifies the whole prefix up to the chunk's end.
    """

    namespace: Namespace
    tokens_per_block: int
    blocks_per_chunk: int = 1
    kind: str = "kv"

    def __post_init__(self) -> None:
        for name in ("tokens_per_block", "blocks_per_chunk"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.kind not in KINDS:
            raise InvalidName(f"unknown object kind {self.kind!r}")

    def chunks(self, block_hashes: Sequence[bytes], *, partial_tail: bool = False) -> list[Chunk]:
        """Chunks covering the hashes from the start; a trailing short chunk only on request."""
        per = self.blocks_per_chunk
        n = len(block_hashes)
        end = n if partial_tail else n - n % per
        out = []
        for first in range(0, end, per):
            count = min(per, n - first)
            last = first + count - 1
            out.append(
                Chunk(
                    key=self.namespace.key(block_hashes[last], self.kind),
                    first_block=first,
                    num_blocks=count,
                    token_start=first * self.tokens_per_block,
                    token_end=(last + 1) * self.tokens_per_block,
                )
            )
        return out

    @staticmethod
    def blocks_covered(chunks: Sequence[Chunk], present: int) -> int:
        """Blocks covered by the first ``present`` chunks (the answer of a prefix lookup)."""
        if not 0 <= present <= len(chunks):
            raise ValueError(f"present={present} outside [0, {len(chunks)}]")
        return sum(c.num_blocks for c in chunks[:present])
