"""The kvplugin block format: one Arrow IPC stream per stored object, checksummed end to end.

An object holds one chunk of KV bytes (one or more consecutive blocks of one KV-cache group,
or one Mamba boundary state) together with the metadata needed to prove what it is::

    offset 0   envelope (64 bytes, little endian)
               magic "KVPLGBLK" | version u16 | flags u16 | reserved u32
               object_len u64 | payload_off u64 | payload_len u64 | reserved u64
               frame_xxh3_128 (16 bytes)
    offset 64  Arrow IPC stream: schema message (metadata below), one record batch with a
               single ``fixed_size_binary`` column "blocks" (one row per block), end-of-stream

Two checksums cover every byte exactly once, so verification costs one pass over the object:

* ``payload_xxh3_128`` (in the Arrow schema metadata) covers the payload bytes, which are the
  Arrow data buffer of the "blocks" column;
* ``frame_xxh3_128`` (in the envelope) covers everything else: the envelope's first 48 bytes,
  the Arrow messages (so the metadata and the payload checksum itself) and the padding.

The frame is verified *before* pyarrow parses anything, so a flipped or truncated object never
reaches the Arrow reader, and decoding is zero-copy: the returned payload is a view into the
bytes that were read. Encoding is zero-copy too: :func:`encode` returns the small head and tail
around a view of the caller's payload, and writers gather them (``writev``, a RESP bulk string
sent in pieces). Every decode failure raises a :class:`BlockFormatError` subclass; callers turn
it into a counted miss and delete the object.

This module must stay importable on its own: no asyncio, no ``kvplugin.core``.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import pyarrow as pa
import xxhash

if TYPE_CHECKING:
    import numpy as np
    from typing_extensions import Buffer

__all__ = [
    "DTYPE_SIZES",
    "FORMAT_VERSION",
    "Block",
    "BlockFormatError",
    "BlockMeta",
    "ChecksumMismatch",
    "EncodedBlock",
    "MetadataMismatch",
    "TruncatedBlock",
    "UnknownFormatVersion",
    "decode",
    "encode",
]

FORMAT_VERSION = 1
MAGIC = b"KVPLGBLK"
_ENVELOPE = struct.Struct("<8sHHIQQQQ16s")
ENVELOPE_SIZE = _ENVELOPE.size  # 64
_HASHED_ENVELOPE = ENVELOPE_SIZE - 16  # everything but the frame checksum itself
_COLUMN = "blocks"

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

_P = "kvplugin."  # metadata key prefix


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
        shape = self.shape
        if not isinstance(shape, tuple) or not shape or not all(_is_pos(d) for d in shape):
            raise ValueError(f"shape must be a non-empty tuple of positive ints, got {shape!r}")

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
        arr = np.frombuffer(self.payload, dtype=np.dtype(dtype)).reshape(self.meta.shape)
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
    src = _byte_view(payload)
    if src.nbytes != meta.nbytes:
        raise ValueError(
            f"payload has {src.nbytes} bytes but dtype {meta.dtype} x shape {meta.shape} "
            f"needs {meta.nbytes}"
        )
    rows = meta.shape[0]
    col_type = pa.binary(src.nbytes // rows)
    schema = pa.schema(
        [pa.field(_COLUMN, col_type, nullable=False)],
        metadata=_meta_to_arrow(meta, xxhash.xxh3_128_digest(src)),
    )
    src_buf = pa.py_buffer(src)
    array = pa.Array.from_buffers(col_type, rows, [None, src_buf])
    sink = _PartsSink(src_buf.address, src.nbytes)
    with pa.ipc.new_stream(pa.PythonFile(sink, mode="w"), schema) as writer:
        writer.write_batch(pa.RecordBatch.from_arrays([array], schema=schema))
    head_ipc, tail = sink.split()
    total = ENVELOPE_SIZE + len(head_ipc) + src.nbytes + len(tail)
    envelope = bytearray(ENVELOPE_SIZE)
    _ENVELOPE.pack_into(
        envelope,
        0,
        MAGIC,
        FORMAT_VERSION,
        0,
        0,
        total,
        ENVELOPE_SIZE + len(head_ipc),
        src.nbytes,
        0,
        bytes(16),
    )
    h = xxhash.xxh3_128(memoryview(envelope)[:_HASHED_ENVELOPE])
    h.update(head_ipc)
    h.update(tail)
    envelope[_HASHED_ENVELOPE:] = h.digest()
    return EncodedBlock((bytes(envelope) + head_ipc, src, tail), total)


class _PartsSink:
    """A write-only file for pyarrow that keeps the pieces instead of copying them.

    pyarrow hands the record-batch body to ``write`` as a zero-copy ``pa.Buffer`` over the
    caller's memory; every other piece (messages, padding, end-of-stream) is small bytes.
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


def decode(data: Buffer, *, key: str | None = None) -> Block:
    """Verify and parse one object; the payload is a view into ``data`` (zero-copy).

    ``key``, when given, must equal the object's recorded key: an intact object stored under
    the wrong name is as unusable as a corrupt one.
    """
    view = _byte_view(data)
    payload_off, payload_len = _check_envelope(view)
    if _frame_digest(view, payload_off, payload_len) != bytes(view[_HASHED_ENVELOPE:ENVELOPE_SIZE]):
        raise ChecksumMismatch("frame checksum mismatch (header, metadata or padding damaged)")
    ipc = pa.py_buffer(view[ENVELOPE_SIZE:])
    try:
        reader = pa.ipc.open_stream(ipc)
        batch = reader.read_next_batch()
    except (pa.ArrowException, StopIteration) as exc:
        raise BlockFormatError(f"unreadable Arrow IPC stream: {exc}") from exc
    meta, digest = _meta_from_arrow(reader.schema.metadata)
    _check_layout(batch, meta, ipc.address - ENVELOPE_SIZE, payload_off, payload_len)
    if key is not None and meta.key != key:
        raise MetadataMismatch(f"object records key {meta.key!r}, expected {key!r}")
    payload = view[payload_off : payload_off + payload_len]
    if xxhash.xxh3_128_digest(payload) != digest:
        raise ChecksumMismatch("payload checksum mismatch")
    return Block(meta=meta, payload=payload, encoded=EncodedBlock((view,), view.nbytes))


def _check_envelope(view: memoryview) -> tuple[int, int]:
    size = view.nbytes
    if size < ENVELOPE_SIZE:
        raise TruncatedBlock(f"object has {size} bytes, less than the {ENVELOPE_SIZE}-byte header")
    magic, version, _flags, _r1, total, off, length, _r2, _ = _ENVELOPE.unpack_from(view, 0)
    if magic != MAGIC:
        raise BlockFormatError("not a kvplugin block (bad magic)")
    if version != FORMAT_VERSION:
        raise UnknownFormatVersion(f"format version {version}, this reader knows {FORMAT_VERSION}")
    if total != size:
        raise TruncatedBlock(f"object has {size} bytes, its header says {total}")
    if not (off > ENVELOPE_SIZE and length > 0 and off + length <= size):
        raise BlockFormatError(f"payload range [{off}, {off + length}) outside the object")
    return off, length


def _frame_digest(view: memoryview, payload_off: int, payload_len: int) -> bytes:
    h = xxhash.xxh3_128()
    h.update(view[:_HASHED_ENVELOPE])
    h.update(view[ENVELOPE_SIZE:payload_off])
    h.update(view[payload_off + payload_len :])
    return h.digest()


def _check_layout(
    batch: pa.RecordBatch, meta: BlockMeta, base: int, payload_off: int, payload_len: int
) -> None:
    """The Arrow column must be exactly the payload range the envelope checksummed."""
    if batch.num_columns != 1 or batch.schema.names != [_COLUMN]:
        raise BlockFormatError(f"unexpected columns {batch.schema.names}")
    column = batch.column(0)
    if not pa.types.is_fixed_size_binary(column.type) or column.null_count:
        raise BlockFormatError(f"unexpected column type {column.type}")
    if batch.num_rows != meta.shape[0] or meta.nbytes != payload_len:
        raise BlockFormatError("row count or payload size disagrees with dtype/shape")
    data = column.buffers()[1]
    if data is None or data.address != base + payload_off or data.size < payload_len:
        raise BlockFormatError("Arrow data buffer is not the checksummed payload range")


def _meta_to_arrow(meta: BlockMeta, digest: bytes) -> dict[bytes, bytes]:
    md = {
        "format_version": str(FORMAT_VERSION),
        "key": meta.key,
        "tenant": meta.tenant,
        "model": meta.model,
        "layout": meta.layout,
        "group": str(meta.group),
        "kind": meta.kind,
        "token_start": str(meta.token_start),
        "token_end": str(meta.token_end),
        "dtype": meta.dtype,
        "shape": ",".join(map(str, meta.shape)),
        "payload_xxh3_128": digest.hex(),
    }
    if meta.boundary is not None:
        md["boundary"] = str(meta.boundary)
    return {(_P + k).encode(): v.encode() for k, v in md.items()}


def _meta_from_arrow(raw: Mapping[bytes, bytes] | None) -> tuple[BlockMeta, bytes]:
    try:
        md = {k.decode()[len(_P) :]: v.decode() for k, v in (raw or {}).items()}
        if md.get("format_version") != str(FORMAT_VERSION):
            raise UnknownFormatVersion(f"metadata format version {md.get('format_version')!r}")
        boundary = md.get("boundary")
        meta = BlockMeta(
            key=md["key"],
            tenant=md["tenant"],
            model=md["model"],
            layout=md["layout"],
            group=int(md["group"]),
            kind=md["kind"],
            token_start=int(md["token_start"]),
            token_end=int(md["token_end"]),
            dtype=md["dtype"],
            shape=tuple(int(d) for d in md["shape"].split(",")),
            boundary=None if boundary is None else int(boundary),
        )
        digest = bytes.fromhex(md["payload_xxh3_128"])
    except BlockFormatError:
        raise
    except (KeyError, ValueError, UnicodeDecodeError) as exc:
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


def _is_pos(value: object) -> bool:
    return type(value) is int and value > 0
