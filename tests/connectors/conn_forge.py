"""Forging stored objects: valid checksums (or MACs) around whatever metadata a test wants.

The decoder must never trust a stored object because its checksums hold: without a secret
anyone can compute them. These helpers build objects the way a hostile writer would, from
the documented layout alone (see :mod:`kvplugin.serde`), not through the encoder, so the
tests that use them exercise the decoder on documents the encoder would never write.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable

import xxhash

from kvplugin.serde import BlockMeta

ENVELOPE = struct.Struct("<8sHHIQQQQ16s")
MAGIC = b"KVPLGBLK"


def meta_doc(meta: BlockMeta, payload: bytes, **changes: object) -> dict[str, object]:
    """The metadata document the encoder writes for ``meta`` (xxh3 payload checksum),
    with ``changes`` applied (a value of ``...`` removes the field)."""
    doc: dict[str, object] = {
        "format_version": 1, "key": meta.key, "tenant": meta.tenant, "model": meta.model,
        "layout": meta.layout, "group": meta.group, "kind": meta.kind,
        "token_start": meta.token_start, "token_end": meta.token_end,
        "boundary": meta.boundary, "dtype": meta.dtype, "shape": list(meta.shape),
        "payload_xxh3_128": xxhash.xxh3_128_digest(payload).hex(),
    }  # fmt: skip
    for name, value in changes.items():
        if value is ...:
            doc.pop(name, None)
        else:
            doc[name] = value
    return doc


def dumps(doc: object) -> bytes:
    return json.dumps(doc, separators=(",", ":")).encode()


def forge(
    doc: bytes,
    payload: bytes,
    *,
    filler: bytes = b"\0" * 8,
    tail: bytes = b"\xff\xff\xff\xff\0\0\0\0",
    meta_len: int | None = None,
    flags: int = 0,
    word: int = 0,
    frame: Callable[..., bytes] | None = None,
) -> bytes:
    """An object ``envelope | doc | pad | filler | payload | tail`` whose frame checksum is
    valid: xxh3, or what ``frame(*parts)`` computes (e.g. a ``Sealer.frame`` holding a key).

    ``filler`` stands where the Arrow stream's messages would be; ``meta_len`` overrides the
    length the envelope claims for ``doc``. The payload digest is whatever ``doc`` says."""
    pad = b"\0" * (-len(doc) % 8)
    payload_off = 64 + len(doc) + len(pad) + len(filler)
    total = payload_off + len(payload) + len(tail)
    claimed = len(doc) if meta_len is None else meta_len
    head = ENVELOPE.pack(
        MAGIC, 1, flags, claimed, total, payload_off, len(payload), word, b"\0" * 16
    )
    body = doc + pad + filler
    return head[:48] + seal_frame(head[:48], body, tail, frame=frame) + body + payload + tail


def seal_frame(*parts: bytes, frame: Callable[..., bytes] | None) -> bytes:
    """The frame digest of ``parts``: xxh3-128, or ``frame(*parts)``."""
    if frame is not None:
        return frame(*parts)
    h = xxhash.xxh3_128()
    for part in parts:
        h.update(part)
    return h.digest()


def reseal(raw: bytes, frame: Callable[..., bytes] | None = None) -> bytes:
    """``raw`` with its frame checksum recomputed, as a writer who changed any bytes
    outside the payload would; unchanged when its envelope has no usable payload range."""
    if len(raw) < 64:
        return raw
    off, length = struct.unpack_from("<QQ", raw, 24)
    if not 64 <= off <= off + length <= len(raw):
        return raw
    parts = (raw[:48], raw[64:off], raw[off + length :])
    return raw[:48] + seal_frame(*parts, frame=frame) + raw[64:]


def forge_doc(doc: object, payload: bytes, **kw: object) -> bytes:
    """:func:`forge` around ``doc`` serialized as compact JSON (or raw bytes as given)."""
    raw = doc if isinstance(doc, bytes) else dumps(doc)
    return forge(raw, payload, **kw)  # type: ignore[arg-type]


def nested(depth: int, open_: str = "[", close: str = "]") -> str:
    return open_ * depth + close * depth


def hostile_docs(meta: BlockMeta, payload: bytes) -> dict[str, bytes]:
    """Metadata documents a hostile writer could wrap in valid checksums, by name."""
    good = meta_doc(meta, payload)
    canonical = dumps(good)

    def with_(**changes: object) -> bytes:
        return dumps(meta_doc(meta, payload, **changes))

    def raw_field(name: str, json_text: str) -> bytes:
        # Splices raw JSON text in as a field's value (for what json.dumps cannot write).
        body = dumps({k: v for k, v in good.items() if k != name})
        return body[:-1] + f',"{name}":{json_text}}}'.encode()

    return {
        "arrays nested 30,000 deep": nested(30_000).encode(),
        "objects nested 10,000 deep": ('{"a":' * 10_000 + "1" + "}" * 10_000).encode(),
        "shape nested 20,000 deep": raw_field("shape", nested(20_000)),
        "key nested 900 deep": raw_field("key", nested(900)),
        "shape nested 900 deep": raw_field("shape", nested(900)),
        "arrays nested 200,000 deep (over the size cap)": nested(200_000).encode(),
        "a 1 MiB key (over the size cap)": with_(key="k" * (1 << 20)),
        "a 60 KiB key": with_(key="k" * (60 << 10)),
        "a 4,000 digit group": raw_field("group", "9" * 4000),
        "a 5,000 digit token_start": raw_field("token_start", "9" * 5000),
        "an infinite token_end": raw_field("token_end", "1e999"),
        "NaN group": raw_field("group", "NaN"),
        "shape of 10,000 huge dims": with_(shape=[2**62] * 10_000),
        "shape of huge dims": with_(shape=[10**300, 10**300]),
        "shape is a string": with_(shape="16"),
        "shape is a number": with_(shape=5),
        "shape is an object": with_(shape={"a": 1}),
        "shape holds a bool": with_(shape=[True, 8]),
        "shape holds a float": with_(shape=[2.0, 8]),
        "group is a bool": with_(group=True),
        "group is a float": with_(group=1.0),
        "format_version is true": with_(format_version=True),
        "format_version is 1.0": with_(format_version=1.0),
        "format_version is 2": with_(format_version=2),
        "key is a number": with_(key=5),
        "key is null": with_(key=None),
        "boundary is a string": with_(boundary="48"),
        "digest is a number": with_(payload_xxh3_128=5),
        "digest has spaces": with_(payload_xxh3_128=" ".join(["00"] * 11)),
        "digest is not hex": with_(payload_xxh3_128="zz" * 16),
        "digest missing": with_(payload_xxh3_128=...),
        "digest under the MAC name": with_(
            payload_xxh3_128=..., payload_blake3_mac=good["payload_xxh3_128"]
        ),
        "an extra field": with_(extra="x"),
        "an extra field instead of boundary": with_(boundary=..., extra=None),
        "a missing field": with_(tenant=...),
        "a list, not an object": dumps([good]),
        "a string, not an object": dumps("x"),
        "a number": b"1",
        "null": b"null",
        "empty": b"",
        "not UTF-8": b'{"key":"\xff\xfe"}',
        "lone surrogate in the key": raw_field("key", '"\\ud800"'),
        "truncated JSON": canonical[:-1],
        "trailing garbage": canonical + b"x",
    }
