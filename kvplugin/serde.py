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

Decoding verifies the frame before parsing anything and returns the payload as a view into
the bytes that were read (zero-copy); ``decode(..., arrow_check=True)`` also reads the stream
with pyarrow and checks that both metadata copies agree and that the Arrow data buffer is
exactly the checksummed payload range (the tests do this for every shape). Encoding is
zero-copy too: :func:`encode` returns the small head and tail around a view of the caller's
payload, and writers gather them (``writev``, a RESP bulk string sent in pieces). Every
decode failure raises a :class:`BlockFormatError` subclass; callers turn it into a counted
miss and delete the object.

This module must stay importable on its own: no asyncio, no ``kvplugin.core``.
"""

from __future__ import annotations

import functools
import json
import struct
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa  # type: ignore[import-untyped]
import xxhash

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer

__all__ = [
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "META_KEY",
    "Block",
    "BlockFormatError",
    "BlockMeta",
    "ChecksumMismatch",
    "DraftBlock",
    "EncodedBlock",
    "MetadataMismatch",
    "TruncatedBlock",
    "UnknownFormatVersion",
    "arrow_stream",
    "decode",
    "encode",
    "hash_payload",
    "prepare",
]

FORMAT_VERSION = 1
MAGIC = b"KVPLGBLK"
_ENVELOPE = struct.Struct("<8sHHIQQQQ16s")
ENVELOPE_SIZE = _ENVELOPE.size  # 64
_HASHED_ENVELOPE = ENVELOPE_SIZE - 16  # everything but the frame checksum itself
_COLUMN = "blocks"
_CONTINUATION = b"\xff\xff\xff\xff"  # starts every Arrow IPC message
_MAX_INT = 1 << 63
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
            and shape
            and self.dtype in DTYPE_SIZES
        ):
            self._explain()
        for d in shape:
            if type(d) is not int or d <= 0:
                self._explain()

    def _explain(self) -> None:
        for name in ("key", "tenant", "model", "layout", "kind", "dtype"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value:
                raise ValueError(f"BlockMeta.{name} must be a non-empty string, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_SIZES)}")
        if not _is_uint(self.group, 32):
            raise ValueError(f"group must be an integer in [0, 2**32), got {self.group!r}")
        if not (_is_uint(self.token_start) and _is_uint(self.token_end)):
            raise ValueError("token_start and token_end must be non-negative integers")
        if self.token_end < self.token_start:
            raise ValueError(f"token_end < token_start: [{self.token_start}, {self.token_end})")
        if self.boundary is not None and not _is_uint(self.boundary):
            raise ValueError(f"boundary must be None or a non-negative integer: {self.boundary!r}")
        raise ValueError(f"shape must be a non-empty tuple of positive ints, got {self.shape!r}")

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
    concatenation.
    """

    parts: tuple[Buffer, ...]
    nbytes: int

    def join(self) -> bytes:
        """The object as one contiguous buffer (one copy)."""
        return b"".join(self.parts)


def encode(meta: BlockMeta, payload: Buffer) -> EncodedBlock:
    """Serialize one object without copying the payload (see :class:`EncodedBlock`)."""
    return prepare(meta, payload).seal()


_DIGEST_HEX = 32  # hex digits of the payload checksum in the metadata JSON
_DIGEST_TAIL = _DIGEST_HEX + 2  # the digest is the last JSON value: '<hex>"}'


def prepare(meta: BlockMeta, payload: Buffer) -> DraftBlock:
    """Everything of :func:`encode` except the payload checksum (see :class:`DraftBlock`)."""
    src = _byte_view(payload)
    if src.nbytes != meta.nbytes:
        raise ValueError(
            f"payload has {src.nbytes} bytes but dtype {meta.dtype} x shape {meta.shape} "
            f"needs {meta.nbytes}"
        )
    rows = meta.shape[0]
    width = src.nbytes // rows
    doc = _meta_json(meta, bytes(16))  # the digest is filled in by DraftBlock.finish
    schema_pre, schema_post = _schema_framing(len(doc), width)
    batch_head, tail = _batch_framing(rows, width)
    pad = bytes(-len(doc) % 8)  # keeps the Arrow stream 8-byte aligned
    meta_end = ENVELOPE_SIZE + len(doc) + len(pad)
    schema_doc = meta_end + len(schema_pre)
    payload_off = schema_doc + len(doc) + len(schema_post) + len(batch_head)
    total = payload_off + src.nbytes + len(tail)
    fields = (MAGIC, FORMAT_VERSION, 0, len(doc), total, payload_off, src.nbytes, 0, bytes(16))
    head = bytearray(
        b"".join((_ENVELOPE.pack(*fields), doc, pad, schema_pre, doc, schema_post, batch_head))
    )
    digest_at = (ENVELOPE_SIZE + len(doc) - _DIGEST_TAIL, schema_doc + len(doc) - _DIGEST_TAIL)
    return DraftBlock(head, src, tail, total, digest_at)


@dataclass(frozen=True, slots=True)
class DraftBlock:
    """An encoded object still missing its payload checksum.

    The checksum is the one pass over the payload an encode makes; a writer can compute it
    where the bytes go out (an I/O thread, chunk by chunk while each chunk is cache-hot) and
    call :meth:`finish`. ``payload`` is a view of the caller's bytes (not copied); the
    object is ``head + payload + tail`` once finished. ``head`` is a template: finishing
    never modifies it.
    """

    head: bytearray
    payload: memoryview
    tail: bytes
    nbytes: int
    digest_at: tuple[int, int]  # offsets of the two copies of the payload digest in head

    @property
    def payload_off(self) -> int:
        return len(self.head)

    def seal(self) -> EncodedBlock:
        """The finished object, hashing the payload here (what :func:`encode` does)."""
        return self.finish(xxhash.xxh3_128_digest(self.payload))

    def finish(self, payload_digest: bytes) -> EncodedBlock:
        """The finished object, given ``xxh3_128(payload).digest()``."""
        if len(payload_digest) != 16:
            raise ValueError("payload_digest must be an xxh3-128 digest (16 bytes)")
        head = bytearray(self.head)
        hexed = payload_digest.hex().encode()
        for at in self.digest_at:
            head[at : at + _DIGEST_HEX] = hexed
        h = xxhash.xxh3_128(memoryview(head)[:_HASHED_ENVELOPE])
        h.update(memoryview(head)[ENVELOPE_SIZE:])
        h.update(self.tail)
        head[_HASHED_ENVELOPE:ENVELOPE_SIZE] = h.digest()
        return EncodedBlock((head, self.payload, self.tail), self.nbytes)


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
    data: Buffer,
    *,
    key: str | None = None,
    arrow_check: bool = False,
    payload_digest: tuple[int, int, bytes] | None = None,
) -> Block:
    """Verify and parse one object; the payload is a view into ``data`` (zero-copy).

    ``key``, when given, must equal the object's recorded key: an intact object stored under
    the wrong name is as unusable as a corrupt one. ``arrow_check`` also validates the Arrow
    stream with pyarrow (see the module docstring). ``payload_digest`` is
    ``(offset, length, xxh3_128 digest)`` of a byte range of ``data`` that the reader already
    hashed (see :func:`hash_payload`); it stands in for the payload pass only when the range
    is exactly the payload range verified here, otherwise the payload is hashed again.
    """
    view = _byte_view(data)
    meta_len, payload_off, payload_len = _check_envelope(view)
    if _frame_digest(view, payload_off, payload_len) != view[_HASHED_ENVELOPE:ENVELOPE_SIZE]:
        raise ChecksumMismatch("frame checksum mismatch (header, metadata or padding damaged)")
    doc = view[ENVELOPE_SIZE : ENVELOPE_SIZE + meta_len]
    meta, digest = _meta_from_json(doc)
    if meta.nbytes != payload_len:
        raise BlockFormatError("payload size disagrees with the recorded dtype and shape")
    if arrow_check:
        _check_arrow(view, doc, meta, payload_off, payload_len)
    if key is not None and meta.key != key:
        raise MetadataMismatch(f"object records key {meta.key!r}, expected {key!r}")
    payload = view[payload_off : payload_off + payload_len]
    if payload_digest is not None and payload_digest[:2] == (payload_off, payload_len):
        actual = payload_digest[2]
    else:
        actual = xxhash.xxh3_128_digest(payload)
    if actual != digest:
        raise ChecksumMismatch("payload checksum mismatch")
    return Block(meta=meta, payload=payload, encoded=EncodedBlock((view,), view.nbytes))


def hash_payload(data: Buffer) -> tuple[int, int, bytes] | None:
    """``(offset, length, xxh3_128 digest)`` of the payload range an object's envelope claims,
    or ``None`` when there is no plausible range. Nothing is verified here: it is the one
    pass over the payload, done where the bytes land (an I/O thread, while the GIL is free),
    and :func:`decode` accepts it for exactly the range it verifies."""
    view = _byte_view(data)
    if view.nbytes < ENVELOPE_SIZE:
        return None
    magic, _v, _f, _m, _t, off, length, _r, _ = _ENVELOPE.unpack_from(view, 0)
    if magic != MAGIC or not (off > ENVELOPE_SIZE and length > 0 and off + length <= view.nbytes):
        return None
    return off, length, xxhash.xxh3_128_digest(view[off : off + length])


def arrow_stream(data: Buffer) -> memoryview:
    """The Arrow IPC stream inside an object (unverified), for Arrow tools:
    ``pyarrow.ipc.open_stream(arrow_stream(obj)).read_all()``."""
    view = _byte_view(data)
    meta_len = _check_envelope(view)[0]
    return view[ENVELOPE_SIZE + meta_len + (-meta_len % 8) :]


def _check_envelope(view: memoryview) -> tuple[int, int, int]:
    size = view.nbytes
    if size < ENVELOPE_SIZE:
        raise TruncatedBlock(f"object has {size} bytes, less than the {ENVELOPE_SIZE}-byte header")
    magic, version, _flags, meta_len, total, off, length, _r, _ = _ENVELOPE.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlockFormatError("not a kvplugin block (bad magic)")
    if version != FORMAT_VERSION:
        raise UnknownFormatVersion(f"format version {version}, this reader knows {FORMAT_VERSION}")
    if total != size:
        raise TruncatedBlock(f"object has {size} bytes, its header says {total}")
    if not (ENVELOPE_SIZE + meta_len < off and length > 0 and off + length <= size):
        raise BlockFormatError(f"payload range [{off}, {off + length}) outside the object")
    return meta_len, off, length


def _frame_digest(view: memoryview, payload_off: int, payload_len: int) -> bytes:
    h = xxhash.xxh3_128()
    h.update(view[:_HASHED_ENVELOPE])
    h.update(view[ENVELOPE_SIZE:payload_off])
    h.update(view[payload_off + payload_len :])
    return h.digest()


def _check_arrow(
    view: memoryview, doc: memoryview, meta: BlockMeta, payload_off: int, payload_len: int
) -> None:
    """Read the stream with pyarrow: the schema carries the same metadata, and the one
    ``blocks`` column's data buffer is exactly the checksummed payload range."""
    stream = arrow_stream(view)
    ipc = pa.py_buffer(stream)
    try:
        reader = pa.ipc.open_stream(ipc)
        batch = reader.read_next_batch()
    except (pa.ArrowException, StopIteration) as exc:
        raise BlockFormatError(f"unreadable Arrow IPC stream: {exc}") from exc
    if (reader.schema.metadata or {}).get(META_KEY) != doc:
        raise BlockFormatError("the Arrow schema metadata differs from the envelope's")
    if batch.num_columns != 1 or batch.schema.names != [_COLUMN]:
        raise BlockFormatError(f"unexpected columns {batch.schema.names}")
    column = batch.column(0)
    if not pa.types.is_fixed_size_binary(column.type) or column.null_count:
        raise BlockFormatError(f"unexpected column type {column.type}")
    if batch.num_rows != meta.shape[0] or meta.nbytes != payload_len:
        raise BlockFormatError("row count or payload size disagrees with dtype/shape")
    data = column.buffers()[1]
    base = ipc.address - (view.nbytes - stream.nbytes)
    if data is None or data.address != base + payload_off or data.size < payload_len:
        raise BlockFormatError("Arrow data buffer is not the checksummed payload range")


def _meta_json(meta: BlockMeta, digest: bytes) -> bytes:
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
        f'"boundary":{boundary},"dtype":{_json_str(meta.dtype)},"shape":[{shape}],'
        f'"payload_xxh3_128":"{digest.hex()}"}}'
    ).encode()


@functools.lru_cache(maxsize=1024)
def _namespace_json(tenant: str, model: str, layout: str, group: int, kind: str) -> str:
    return (
        f'"tenant":{_json_str(tenant)},"model":{_json_str(model)},'
        f'"layout":{_json_str(layout)},"group":{group},"kind":{_json_str(kind)},'
    )


def _json_str(value: str) -> str:
    return json.dumps(value)


@functools.lru_cache(maxsize=256)
def _column(width: int) -> pa.Field:
    return pa.field(_COLUMN, pa.binary(width), nullable=False)


def _meta_from_json(raw: Buffer) -> tuple[BlockMeta, bytes]:
    try:
        doc = json.loads(str(raw, "utf-8"))  # a str skips json's encoding detection
        if doc.pop("format_version") != FORMAT_VERSION:
            raise UnknownFormatVersion("metadata format version differs from the envelope's")
        digest = bytes.fromhex(doc.pop("payload_xxh3_128"))
        doc["shape"] = tuple(doc["shape"])
        meta = BlockMeta(**doc)
    except BlockFormatError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise BlockFormatError(f"bad block metadata: {exc!r}") from exc
    if len(digest) != 16:
        raise BlockFormatError("payload checksum has the wrong length")
    return meta, digest


def _byte_view(data: Buffer) -> memoryview:
    view = memoryview(data)
    if not view.c_contiguous:
        raise ValueError("block bytes must be a C-contiguous buffer")
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _is_uint(value: object, bits: int = 63) -> bool:
    return type(value) is int and 0 <= value < (1 << bits)
