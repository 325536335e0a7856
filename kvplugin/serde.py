"""The kvplugin block format: an Arrow IPC stream per stored object, checksummed end to end.

An object holds one chunk of KV bytes (one or more consecutive blocks of one KV-cache group,
or one Mamba boundary state) together with the metadata needed to prove what it is::

    offset 0    envelope (64 bytes, little endian)
                magic "KVPLGBLK" | version u16 | flags u16 | meta_len u32
                object_len u64 | payload_off u64 | payload_len u64 | reserved u64
                frame_xxh3_128 (16 bytes)
    offset 64   metadata: one JSON document (meta_len bytes), zero-padded to 8 bytes
    then        Arrow IPC stream: a schema message carrying the same JSON document under the
                ``kvplugin.block`` metadata key, one record batch with a single
                ``fixed_size_binary`` column "blocks" (one row per block), end-of-stream

The metadata (format version, key, tenant, model, layout fingerprint, group, kind, token
range or boundary, dtype, shape, payload checksum) is stored twice on purpose: in the Arrow
schema, so any Arrow reader sees what the stream is, and right after the envelope, so a load
reads it with one ``json.loads``. Calling pyarrow's reader per load costs ~100 us under
thread contention, more than the rest of a verified 1 MiB load.

Two checksums cover every byte exactly once, so verification costs one pass over the object:

* ``payload_xxh3_128`` (in the metadata) covers the payload bytes, which are the Arrow data
  buffer of the "blocks" column;
* ``frame_xxh3_128`` (in the envelope) covers everything else: the envelope's first 48 bytes,
  both copies of the metadata, the Arrow messages and the padding.

With a deployment secret both become 16-byte keyed BLAKE3 tags (``frame_blake3_mac``,
``payload_blake3_mac``), flags bit 0 is set and the reserved word holds the key's id; see
:mod:`kvplugin.serde_mac`. Without one, objects are exactly as above, byte for byte.

Decoding verifies the frame before parsing anything and returns the payload as a view into
the bytes that were read (zero-copy); ``decode(..., arrow_check=True)`` also reads the stream
with pyarrow and checks that both metadata copies agree and that the Arrow data buffer is
exactly the checksummed payload range (the tests do this for every shape). Encoding is
zero-copy too: :func:`encode` returns the small head and tail around a view of the caller's
payload, and writers gather them (``writev``, a RESP bulk string sent in pieces). Every
decode failure raises a :class:`BlockFormatError` subclass; callers turn it into a counted
miss and delete the object.

Stored bytes are untrusted even when their checksums hold (without a secret anyone can compute
them), so the decoder bounds and validates everything before using it: the metadata is at
most :data:`MAX_META_LEN` bytes (checked from the envelope, before parsing) and must be a
flat JSON object with exactly the known fields, each of its type and range; unknown envelope
flags and a reserved word set without the MAC flag are refused; and any failure of pyarrow
reading a hostile stream (``arrow_check``) is a :class:`BlockFormatError` too.

This module must stay importable on its own: no asyncio, no ``kvplugin.core``.
"""

from __future__ import annotations

import functools
import json
import reprlib
import struct
from dataclasses import dataclass, field, fields
from hmac import compare_digest
from typing import TYPE_CHECKING, Any

import pyarrow as pa  # type: ignore[import-untyped]

from kvplugin.buffers import Sealed
from kvplugin.serde_mac import FLAG_MAC, PLAIN, PLAIN_DIGEST, Codec, Sealer

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer

__all__ = [
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "MAX_META_LEN",
    "META_KEY",
    "PLAIN",
    "Block",
    "BlockFormatError",
    "BlockMeta",
    "ChecksumMismatch",
    "Codec",
    "DraftBlock",
    "EncodedBlock",
    "MetadataMismatch",
    "SplitObject",
    "TruncatedBlock",
    "Unauthenticated",
    "UnknownFormatVersion",
    "arrow_stream",
    "decode",
    "encode",
    "hash_payload",
    "prepare",
    "split_if_immutable",
]

FORMAT_VERSION = 1
MAGIC = b"KVPLGBLK"
_ENVELOPE = struct.Struct("<8sHHIQQQQ16s")
ENVELOPE_SIZE = _ENVELOPE.size  # 64
_HASHED_ENVELOPE = ENVELOPE_SIZE - 16  # everything but the frame checksum itself
_COLUMN = "blocks"
_CONTINUATION = b"\xff\xff\xff\xff"  # starts every Arrow IPC message
_MAX_INT = 1 << 63
_MAX_DIMS = 32  # with dims below 2**63, bounds BlockMeta.nbytes's work for a hostile shape
MAX_META_LEN = 64 << 10  # metadata bytes a reader parses; real ones are well under 1 KiB
META_KEY = b"kvplugin.block"  # the Arrow schema metadata key holding the JSON metadata

# Element sizes of the dtypes a KV cache uses. Names follow torch/numpy spelling; the bytes
# are opaque to this module, the dtype only has to make shape * itemsize == payload size.
DTYPE_SIZES: dict[str, int] = {
    "bool": 1,
    "int8": 1,
    "uint8": 1,
    "int16": 2,
    "uint16": 2,
    "int32": 4,
    "uint32": 4,
    "int64": 8,
    "uint64": 8,
    "float16": 2,
    "bfloat16": 2,
    "float32": 4,
    "float64": 8,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
# numpy has no bfloat16 / float8: expose those as same-width unsigned integers.
_NUMPY_VIEW = {"bfloat16": "uint16", "float8_e4m3fn": "uint8", "float8_e5m2": "uint8"}


class BlockFormatError(ValueError):
    """A stored object is not a valid block (corrupt, truncated, foreign or misplaced)."""


class TruncatedBlock(BlockFormatError):
    """The object is shorter (or longer) than its envelope says."""


class UnknownFormatVersion(BlockFormatError):
    """The envelope carries a format version this code does not read."""


class ChecksumMismatch(BlockFormatError):
    """The frame or payload checksum does not match the bytes."""


class MetadataMismatch(BlockFormatError):
    """The object is intact but is not the object that was asked for."""


class Unauthenticated(BlockFormatError):
    """The object's authenticity cannot be established by this reader: it is unkeyed but the
    reader requires a MAC, MAC'd with a secret the reader does not hold, or MAC'd while the
    reader has no secret."""


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """What a stored object claims to be; written into, and checked against, every object.

    ``token_start``/``token_end`` is the token range the chunk covers. A Mamba state (or a
    partial tail) is valid at exactly one token count, ``boundary``; ``None`` for KV pages.
    ``shape[0]`` is the number of blocks in the chunk (one Arrow row each).
    """

    key: str
    tenant: str
    model: str
    layout: str
    group: int
    kind: str
    token_start: int
    token_end: int
    dtype: str
    shape: tuple[int, ...]
    boundary: int | None = None

    def __post_init__(self) -> None:
        # Runs on every load too, so the common case is a handful of cheap checks; the
        # detailed messages are built only when something is wrong.
        # Plain loops, not all() over generators: this is on every load's path.
        for v in (self.key, self.tenant, self.model, self.layout, self.kind, self.dtype):
            if type(v) is not str or not v:
                self._explain()
        for n in (self.group, self.token_start, self.token_end):
            if type(n) is not int or not 0 <= n < _MAX_INT:
                self._explain()
        shape = self.shape
        if not (
            self.group < 1 << 32
            and self.token_start <= self.token_end
            and (self.boundary is None or _is_uint(self.boundary))
            and type(shape) is tuple
            and 0 < len(shape) <= _MAX_DIMS
            and self.dtype in DTYPE_SIZES
        ):
            self._explain()
        for d in shape:
            if type(d) is not int or not 0 < d < _MAX_INT:
                self._explain()

    def _explain(self) -> None:
        # Values are shown shortened: they may come from a hostile stored object.
        for name in ("key", "tenant", "model", "layout", "kind", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(
                    f"BlockMeta.{name} must be a non-empty string, got {_short(value)}"
                )
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {_short(self.dtype)}; known: {sorted(DTYPE_SIZES)}")
        if not _is_uint(self.group, 32):
            raise ValueError(f"group must be an integer in [0, 2**32), got {_short(self.group)}")
        if not (_is_uint(self.token_start) and _is_uint(self.token_end)):
            raise ValueError("token_start and token_end must be integers in [0, 2**63)")
        if self.token_end < self.token_start:
            raise ValueError(f"token_end < token_start: [{self.token_start}, {self.token_end})")
        if self.boundary is not None and not _is_uint(self.boundary):
            raise ValueError(
                f"boundary must be None or an integer in [0, 2**63): {_short(self.boundary)}"
            )
        raise ValueError(
            f"shape must be a tuple of 1 to {_MAX_DIMS} ints in [1, 2**63), "
            f"got {_short(self.shape)}"
        )

    @property
    def nbytes(self) -> int:
        """Payload size implied by dtype and shape."""
        n = DTYPE_SIZES[self.dtype]
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Block:
    """A chunk's metadata and payload bytes.

    ``encoded`` is set by :func:`decode` (the verified object the payload is a view of) so the
    object can be copied to another tier without re-encoding. Leave it ``None`` when building
    a block to store.
    """

    meta: BlockMeta
    payload: Buffer
    encoded: EncodedBlock | None = field(default=None, repr=False, compare=False)

    def as_numpy(self) -> np.ndarray[Any, Any]:
        """The payload as a read-only numpy view shaped ``meta.shape`` (no copy).

        bfloat16 and float8 payloads come back as same-width unsigned integers.
        """
        import numpy as np

        dtype = _NUMPY_VIEW.get(self.meta.dtype, self.meta.dtype)
        flat: np.ndarray[Any, Any] = np.frombuffer(memoryview(self.payload), dtype=np.dtype(dtype))
        arr = flat.reshape(self.meta.shape)
        arr.flags.writeable = False
        return arr


@dataclass(frozen=True, slots=True)
class EncodedBlock:
    """One encoded object as a few buffers, so writers can gather instead of copying.

    :func:`encode` returns ``(head, payload, tail)`` where ``payload`` is a view of the
    caller's bytes (not copied) and ``head``/``tail`` are the small envelope and Arrow pieces
    around it. A decoded object is one contiguous part. The stored object is their
    concatenation. ``key_id`` says what sealed it: ``None`` for xxh3 checksums, else the id
    of the MAC key (:attr:`Codec.key_id`); a store re-encodes bytes sealed otherwise than
    it seals.
    """

    parts: tuple[Buffer, ...]
    nbytes: int
    key_id: int | None = None

    def join(self) -> bytes:
        """The object as one contiguous buffer (one copy)."""
        return b"".join(self.parts)


def encode(meta: BlockMeta, payload: Buffer, codec: Codec = PLAIN) -> EncodedBlock:
    """Serialize one object without copying the payload (see :class:`EncodedBlock`)."""
    return prepare(meta, payload, codec).seal()


_DIGEST_HEX = 32  # hex digits of the payload checksum in the metadata JSON
_DIGEST_TAIL = _DIGEST_HEX + 2  # the digest is the last JSON value: '<hex>"}'


def prepare(meta: BlockMeta, payload: Buffer, codec: Codec = PLAIN) -> DraftBlock:
    """Everything of :func:`encode` except the payload checksum (see :class:`DraftBlock`)."""
    src = _byte_view(payload)
    if src.nbytes != meta.nbytes:
        raise ValueError(
            f"payload has {src.nbytes} bytes but dtype {meta.dtype} x shape {meta.shape} "
            f"needs {meta.nbytes}"
        )
    sealer = codec.sealer
    rows = meta.shape[0]
    width = src.nbytes // rows
    doc = _meta_json(meta, bytes(16), sealer.digest_field)  # digest: see DraftBlock.finish
    if len(doc) > MAX_META_LEN:  # never write what no reader would parse
        raise ValueError(f"metadata of {len(doc)} bytes exceeds {MAX_META_LEN}")
    schema_pre, schema_post = _schema_framing(len(doc), width)
    batch_head, tail = _batch_framing(rows, width)
    pad = bytes(-len(doc) % 8)  # keeps the Arrow stream 8-byte aligned
    meta_end = ENVELOPE_SIZE + len(doc) + len(pad)
    schema_doc = meta_end + len(schema_pre)
    payload_off = schema_doc + len(doc) + len(schema_post) + len(batch_head)
    total = payload_off + src.nbytes + len(tail)
    # The reserved word holds the MAC key's id (0 without a secret, as it always was).
    key_word = sealer.key_id or 0
    fields = (MAGIC, FORMAT_VERSION, sealer.flags, len(doc), total, payload_off, src.nbytes)
    envelope = _ENVELOPE.pack(*fields, key_word, bytes(16))
    head = bytearray(b"".join((envelope, doc, pad, schema_pre, doc, schema_post, batch_head)))
    digest_at = (ENVELOPE_SIZE + len(doc) - _DIGEST_TAIL, schema_doc + len(doc) - _DIGEST_TAIL)
    return DraftBlock(head, src, tail, total, digest_at, sealer)


@dataclass(frozen=True, slots=True)
class DraftBlock:
    """An encoded object still missing its payload checksum.

    The checksum is the one pass over the payload an encode makes; a writer can compute it
    where the bytes go out (an I/O thread, chunk by chunk while each chunk is cache-hot) and
    call :meth:`finish`. ``payload`` is a view of the caller's bytes (not copied); the
    object is ``head + payload + tail`` once finished. ``head`` is a template: finishing
    never modifies it. ``sealer`` computes the digests (xxh3, or keyed BLAKE3 with a secret).
    """

    head: bytearray
    payload: memoryview
    tail: bytes
    nbytes: int
    digest_at: tuple[int, int]  # offsets of the two copies of the payload digest in head
    sealer: Sealer = field(default=PLAIN.sealer, repr=False)

    @property
    def payload_off(self) -> int:
        return len(self.head)

    def seal(self) -> EncodedBlock:
        """The finished object, hashing the payload here (what :func:`encode` does)."""
        return self.finish(self.sealer.payload(self.payload))

    def finish(self, payload_digest: bytes) -> EncodedBlock:
        """The finished object, given the payload's digest (``self.sealer.payload``)."""
        if len(payload_digest) != 16:
            raise ValueError("payload_digest must be a 16-byte digest")
        head = bytearray(self.head)
        hexed = payload_digest.hex().encode()
        for at in self.digest_at:
            head[at : at + _DIGEST_HEX] = hexed
        view = memoryview(head)
        frame = self.sealer.frame(view[:_HASHED_ENVELOPE], view[ENVELOPE_SIZE:], self.tail)
        head[_HASHED_ENVELOPE:ENVELOPE_SIZE] = frame
        return EncodedBlock((head, self.payload, self.tail), self.nbytes, self.sealer.key_id)


@functools.lru_cache(maxsize=256)
def _schema_framing(doc_len: int, width: int) -> tuple[bytes, bytes]:
    """The Arrow schema message around its ``doc_len``-byte metadata value.

    The message (a flatbuffer) stores the value verbatim at a position that depends only on
    the lengths of its strings, so it is built once per (length, width) and the document is
    spliced in per object. Checked here against pyarrow with two different documents.
    """
    column = _column(width)
    docs = (b"a" * doc_len, b"b" * doc_len)
    msgs = [pa.schema([column], {META_KEY: d}).serialize().to_pybytes() for d in docs]
    at = msgs[0].find(docs[0])
    ok = at >= 0 and msgs[0].count(docs[0]) == 1
    pre, post = msgs[0][:at], msgs[0][at + doc_len :]
    if not (ok and msgs[1] == pre + docs[1] + post):  # pragma: no cover - pyarrow changed
        raise RuntimeError("unexpected Arrow schema framing; kvplugin.serde needs updating")
    return pre, post


@functools.lru_cache(maxsize=256)
def _batch_framing(rows: int, width: int) -> tuple[bytes, bytes]:
    """The record-batch message header and the stream tail for ``rows`` x ``width`` bytes.

    A record-batch message depends only on row count and buffer sizes, never on the schema
    metadata, so it is built once per shape, by letting pyarrow write one stream into a
    sink that keeps the pieces (the body arrives as a zero-copy view and is dropped).
    """
    column = _column(width)
    schema = pa.schema([column])
    body = pa.allocate_buffer(rows * width)
    array = pa.Array.from_buffers(column.type, rows, [None, body])
    sink = _PartsSink(body.address, body.size)
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays([array], schema=schema))
    head_ipc, tail = sink.split()
    schema_len = schema.serialize().size
    if head_ipc[schema_len : schema_len + 4] != _CONTINUATION:  # pragma: no cover
        raise RuntimeError("unexpected Arrow IPC framing; kvplugin.serde needs updating")
    return head_ipc[schema_len:], tail


class _PartsSink:
    """A write-only file for pyarrow that keeps the pieces instead of copying them.

    pyarrow hands the record-batch body to ``write`` as a zero-copy ``pa.Buffer``; every
    other piece (messages, padding, end-of-stream) is small bytes.
    """

    def __init__(self, payload_address: int, payload_size: int) -> None:
        self._address = payload_address
        self._size = payload_size
        self._before: list[bytes] = []
        self._after: list[bytes] = []
        self._seen_payload = False
        self.closed = False

    def write(self, data: Any) -> int:
        if isinstance(data, pa.Buffer) and data.address == self._address:
            if data.size != self._size or self._seen_payload:
                raise RuntimeError("pyarrow wrote the payload in an unexpected way")
            self._seen_payload = True
        elif self._seen_payload:
            self._after.append(bytes(data))
        else:
            self._before.append(bytes(data))
        return memoryview(data).nbytes

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.closed = True

    def split(self) -> tuple[bytes, bytes]:
        if not self._seen_payload:  # pragma: no cover - guards a pyarrow behaviour change
            raise RuntimeError("pyarrow copied the payload; kvplugin.serde needs updating")
        return b"".join(self._before), b"".join(self._after)


def decode(
    data: Buffer | SplitObject,
    *,
    key: str | None = None,
    arrow_check: bool = False,
    payload_digest: tuple[int, int, bytes] | None = None,
    codec: Codec = PLAIN,
) -> Block:
    """Verify and parse one object; the payload is a view into ``data`` (zero-copy).

    ``key``, when given, must equal the object's recorded key: an intact object stored under
    the wrong name is as unusable as a corrupt one. ``arrow_check`` also validates the Arrow
    stream with pyarrow (see the module docstring). ``payload_digest`` is
    ``(offset, length, digest)`` of a byte range of ``data`` that the reader already hashed
    with this codec (see :func:`hash_payload`); it stands in for the payload pass only when
    the range is exactly the payload range verified here, otherwise the payload is hashed
    again. ``codec`` decides which objects are authentic (see :mod:`kvplugin.serde_mac`):
    without a secret, xxh3-sealed ones; with one, those MAC'd with its secrets.
    """
    if isinstance(data, SplitObject):
        return _decode_split(data, key=key, codec=codec)
    view = _byte_view(data)
    flags, key_word, meta_len, payload_off, payload_len = _envelope(view, view.nbytes)
    head, tail = view[:payload_off], view[payload_off + payload_len :]
    payload = view[payload_off : payload_off + payload_len]
    meta, sealer, digest = _verify_frame(head, tail, flags, key_word, meta_len, payload_len,
                                         key, codec)
    if arrow_check:
        _check_arrow(view, view[ENVELOPE_SIZE : ENVELOPE_SIZE + meta_len], meta, payload_off,
                     payload_len)
    if payload_digest is not None and payload_digest[:2] == (payload_off, payload_len):
        actual = payload_digest[2]
    else:
        actual = sealer.payload(payload)
    if not compare_digest(actual, digest):
        raise ChecksumMismatch("payload checksum mismatch")
    encoded = EncodedBlock((view,), view.nbytes, sealer.key_id)
    return Block(meta=meta, payload=payload, encoded=encoded)


@dataclass(frozen=True, slots=True)
class SplitObject:
    """A stored object kept as its three pieces, the way :func:`encode` produced them: the
    bytes before the payload, the payload, the bytes after. A store that may keep the
    payload buffer as it is (an immutable one, e.g. a ``bytes`` the caller handed over)
    keeps this instead of joining the object into a new contiguous copy; :func:`decode`
    verifies it exactly as the joined bytes (``join`` gives them)."""

    head: bytes
    payload: memoryview
    tail: bytes

    @property
    def nbytes(self) -> int:
        return len(self.head) + self.payload.nbytes + len(self.tail)

    def join(self) -> bytes:
        return b"".join((self.head, self.payload, self.tail))


def split_if_immutable(enc: EncodedBlock) -> SplitObject | None:
    """``enc`` as a :class:`SplitObject` when its payload piece is a view of ``bytes`` or
    of a sealed pool slot (:class:`kvplugin.buffers.Sealed`): nobody can change either,
    so keeping it is as safe as a copy. Else None."""
    if len(enc.parts) != 3:
        return None
    head, payload, tail = enc.parts
    if not (isinstance(payload, memoryview) and payload.readonly and payload.c_contiguous
            and (type(payload.obj) is bytes or isinstance(payload.obj, Sealed))):
        return None
    view = payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B")
    return SplitObject(bytes(head), view, bytes(tail))


def _decode_split(obj: SplitObject, *, key: str | None, codec: Codec) -> Block:
    head, payload, tail = memoryview(obj.head), obj.payload, memoryview(obj.tail)
    flags, key_word, meta_len, payload_off, payload_len = _envelope(head, obj.nbytes)
    if payload_off != head.nbytes or payload_len != payload.nbytes:
        raise BlockFormatError("the pieces of a split object disagree with its envelope")
    meta, sealer, digest = _verify_frame(head, tail, flags, key_word, meta_len, payload_len,
                                         key, codec)
    if not compare_digest(sealer.payload(payload), digest):
        raise ChecksumMismatch("payload checksum mismatch")
    encoded = EncodedBlock((head, payload, tail), obj.nbytes, sealer.key_id)
    return Block(meta=meta, payload=payload, encoded=encoded)


def _verify_frame(head: memoryview, tail: memoryview, flags: int, key_word: int,
                  meta_len: int, payload_len: int, key: str | None, codec: Codec
                  ) -> tuple[BlockMeta, Sealer, bytes]:
    """The frame checks of :func:`decode` (envelope, metadata, padding, Arrow framing and the
    key): the metadata, the sealer that verifies the payload, and the payload's digest."""
    sealer = _sealer_for(codec, flags, key_word)
    frame = sealer.frame(head[:_HASHED_ENVELOPE], head[ENVELOPE_SIZE:], tail)
    # Constant-time comparisons: with a secret, a timing oracle must not help a forger.
    if not compare_digest(frame, head[_HASHED_ENVELOPE:ENVELOPE_SIZE]):
        raise ChecksumMismatch("frame checksum mismatch (header, metadata or padding damaged)")
    doc = head[ENVELOPE_SIZE : ENVELOPE_SIZE + meta_len]
    meta, digest = _meta_from_json(doc, sealer.digest_field)
    if meta.nbytes != payload_len:
        raise BlockFormatError("payload size disagrees with the recorded dtype and shape")
    if key is not None and meta.key != key:
        raise MetadataMismatch(f"object records key {_short(meta.key)}, expected {key!r}")
    return meta, sealer, digest


def hash_payload(data: Buffer, codec: Codec = PLAIN) -> tuple[int, int, bytes] | None:
    """``(offset, length, digest)`` of the payload range an object's envelope claims, hashed
    the way ``codec`` would verify this object, or ``None`` when there is no plausible range
    (or ``codec`` would refuse the object). Nothing is verified here: it is the one pass over
    the payload, done where the bytes land (an I/O thread, while the GIL is free), and
    :func:`decode` accepts it for exactly the range it verifies."""
    try:
        view = _byte_view(data)
        flags, key_word, _meta_len, off, length = _envelope(view, view.nbytes)
        sealer = _sealer_for(codec, flags, key_word)
    except (BlockFormatError, ValueError):  # decode will say what is wrong
        return None
    return off, length, sealer.payload(view[off : off + length])


def arrow_stream(data: Buffer) -> memoryview:
    """The Arrow IPC stream inside an object (unverified), for Arrow tools:
    ``pyarrow.ipc.open_stream(arrow_stream(obj)).read_all()``."""
    view = _byte_view(data)
    meta_len = _envelope(view, view.nbytes)[2]
    return view[ENVELOPE_SIZE + meta_len + (-meta_len % 8) :]


def _envelope(view: memoryview, size: int) -> tuple[int, int, int, int, int]:
    """``(flags, reserved word, meta_len, payload_off, payload_len)``, once the envelope is
    plausible: ours, this version, the object's true size (``size``: ``view`` may be its
    first piece only), every range inside it."""
    if view.nbytes < ENVELOPE_SIZE:
        raise TruncatedBlock(
            f"object has {view.nbytes} bytes, less than the {ENVELOPE_SIZE}-byte header")
    magic, version, flags, meta_len, total, off, length, word, _ = _ENVELOPE.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlockFormatError("not a kvplugin block (bad magic)")
    if version != FORMAT_VERSION:
        raise UnknownFormatVersion(f"format version {version}, this reader knows {FORMAT_VERSION}")
    if total != size:
        raise TruncatedBlock(f"object has {size} bytes, its header says {total}")
    if meta_len > MAX_META_LEN:  # before anything reads it: a parse is bounded by this
        raise BlockFormatError(f"metadata length {meta_len} exceeds {MAX_META_LEN}")
    if not (ENVELOPE_SIZE + meta_len < off and length > 0 and off + length <= size):
        raise BlockFormatError(f"payload range [{off}, {off + length}) outside the object")
    return flags, word, meta_len, off, length


def _sealer_for(codec: Codec, flags: int, key_word: int) -> Sealer:
    """How ``codec`` verifies an object with these envelope fields, or why it will not."""
    sealer = codec.sealer
    if not (flags or key_word) and sealer.key_id is None:  # unkeyed object and reader
        return sealer
    if flags & ~FLAG_MAC:
        raise BlockFormatError(f"unknown envelope flags {flags:#06x}")
    if not flags:
        if key_word:
            raise BlockFormatError("reserved envelope word is set on an unkeyed object")
        # The reader has a secret: accepting xxh3 here would let a forger skip the MAC.
        raise Unauthenticated("object is not MAC'd and this reader requires a MAC")
    if sealer.key_id is None:
        raise Unauthenticated("object is MAC'd and this reader has no secret to verify it")
    verifier = codec.verifier(key_word)
    if verifier is None:
        raise Unauthenticated(f"object is MAC'd with an unknown secret (key id {key_word:#x})")
    return verifier


def _check_arrow(
    view: memoryview, doc: memoryview, meta: BlockMeta, payload_off: int, payload_len: int
) -> None:
    """Read the stream with pyarrow: the schema carries the same metadata, and the one
    ``blocks`` column's data buffer is exactly the checksummed payload range."""
    try:
        problem = _arrow_problem(view, doc, meta, payload_off, payload_len)
    except Exception as exc:  # pyarrow parsing hostile bytes: any failure is a bad object
        raise BlockFormatError(f"unreadable Arrow IPC stream: {_short(exc)}") from exc
    if problem:
        raise BlockFormatError(problem)


def _arrow_problem(
    view: memoryview, doc: memoryview, meta: BlockMeta, payload_off: int, payload_len: int
) -> str | None:
    stream = arrow_stream(view)
    ipc = pa.py_buffer(stream)
    reader = pa.ipc.open_stream(ipc)
    batch = reader.read_next_batch()
    if (reader.schema.metadata or {}).get(META_KEY) != doc:
        return "the Arrow schema metadata differs from the envelope's"
    if batch.num_columns != 1 or batch.schema.names != [_COLUMN]:
        return f"unexpected columns {_short(batch.schema.names)}"
    column = batch.column(0)
    if not pa.types.is_fixed_size_binary(column.type) or column.null_count:
        return f"unexpected column type {_short(column.type)}"
    if batch.num_rows != meta.shape[0] or meta.nbytes != payload_len:
        return "row count or payload size disagrees with dtype/shape"
    data = column.buffers()[1]
    base = ipc.address - (view.nbytes - stream.nbytes)
    if data is None or data.address != base + payload_off or data.size < payload_len:
        return "Arrow data buffer is not the checksummed payload range"
    return None


def _meta_json(meta: BlockMeta, digest: bytes, digest_field: str = PLAIN_DIGEST) -> bytes:
    """The metadata as one compact JSON document (what ``json.dumps`` would write).

    The namespace strings are escaped once per namespace (cached); everything else is hex
    or integers and needs no escaping.
    """
    boundary = "null" if meta.boundary is None else str(meta.boundary)
    shape = ",".join(map(str, meta.shape))
    return (
        f'{{"format_version":{FORMAT_VERSION},"key":{_json_str(meta.key)},'
        f"{_namespace_json(meta.tenant, meta.model, meta.layout, meta.group, meta.kind)}"
        f'"token_start":{meta.token_start},"token_end":{meta.token_end},'
        f'"boundary":{boundary},"dtype":{_DTYPE_JSON[meta.dtype]},"shape":[{shape}],'
        f'"{digest_field}":"{digest.hex()}"}}'
    ).encode()


@functools.lru_cache(maxsize=1024)
def _namespace_json(tenant: str, model: str, layout: str, group: int, kind: str) -> str:
    return (
        f'"tenant":{_json_str(tenant)},"model":{_json_str(model)},'
        f'"layout":{_json_str(layout)},"group":{group},"kind":{_json_str(kind)},'
    )


def _json_str(value: str) -> str:
    # What json.dumps writes. ASCII letters and digits need no escaping, and storage ids
    # are hex: this skips json.dumps (~0.5 us) for every encode's key.
    if value.isascii() and value.isalnum():
        return f'"{value}"'
    return json.dumps(value)


_DTYPE_JSON = {name: json.dumps(name) for name in DTYPE_SIZES}


@functools.lru_cache(maxsize=256)
def _column(width: int) -> pa.Field:
    return pa.field(_COLUMN, pa.binary(width), nullable=False)


# BlockMeta's fields, plus the format version and the payload digest.
_DOC_FIELDS = len(fields(BlockMeta)) + 2


def _meta_from_json(raw: memoryview, digest_field: str) -> tuple[BlockMeta, bytes]:
    """The metadata and payload digest recorded in a metadata document, which must be a flat
    JSON object with exactly the fields :func:`_meta_json` writes, each of its type and
    range. Checksums only say who wrote an object (anyone, without a secret), so nothing in
    it is trusted: anything else is a :class:`BlockFormatError`, never another exception.

    On every load's path, so the field set is checked by count and by ``BlockMeta(**doc)``
    (an unknown or missing field is a TypeError), not by comparing sets. Checking that the
    document is byte for byte what _meta_json renders for it was measured at ~2 us per load,
    more than the rest together, and would only add rejecting key order, spacing and escapes,
    which this parser reads the same anyway."""
    try:
        doc = json.loads(str(raw, "utf-8"))  # a str skips json's encoding detection
    except (ValueError, RecursionError, MemoryError) as exc:
        # ValueError: bad UTF-8, bad JSON, an integer too long to convert; RecursionError:
        # arrays nested thousands deep. MAX_META_LEN bounds the rest.
        raise BlockFormatError(f"unreadable block metadata ({type(exc).__name__})") from None
    if type(doc) is not dict or len(doc) != _DOC_FIELDS:
        raise BlockFormatError("block metadata is not an object with the known fields")
    try:
        version, hexed, shape = doc.pop("format_version"), doc.pop(digest_field), doc["shape"]
        if type(hexed) is not str or len(hexed) != _DIGEST_HEX or type(shape) is not list:
            raise ValueError("payload digest or shape malformed")
        digest = bytes.fromhex(hexed)
        doc["shape"] = tuple(shape)
        meta = BlockMeta(**doc)
    except (KeyError, TypeError, ValueError) as exc:
        # Messages quote stored values shortened (see BlockMeta._explain).
        raise BlockFormatError(f"bad block metadata: {_short(str(exc))}") from None
    if type(version) is not int or version != FORMAT_VERSION:
        raise UnknownFormatVersion("metadata format version differs from the envelope's")
    if len(digest) != 16:  # fromhex skips spaces
        raise BlockFormatError("bad block metadata: payload digest malformed")
    return meta, digest


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80


def _short(value: object) -> str:
    """A bounded repr, for messages about values read from stored objects."""
    return _REPR.repr(value)


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("block bytes must be a C-contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _is_uint(value: object, bits: int = 63) -> bool:
    return type(value) is int and 0 <= value < (1 << bits)
