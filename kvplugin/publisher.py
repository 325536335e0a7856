"""KV-cache events over ZMQ, in vLLM's wire format, for routers that already speak it.

vLLM's ``ZmqEventPublisher`` sends each ``KVEventBatch`` as a three-part message on a PUB
socket: the topic, an 8-byte big-endian sequence number, and the batch as msgpack (the
batch an array ``[ts, events, data_parallel_rank?]``; each event a map tagged ``"type":
"BlockStored" | "BlockRemoved" | "AllBlocksCleared"``, its optional fields left out when
they hold their defaults). :class:`ZmqEventPublisher` sends the same bytes, so a
subscriber written for vLLM (llm-d's indexer, vLLM's own decoder) reads kvplugin's stream:
the device cache's events and the tiers' (``AsyncKVManager.take_events``).

Sends never block the caller: a subscriber too slow to keep up loses whole batches at the
socket's high-water mark, counted in ``dropped`` (vLLM's replay socket is not offered).
Needs ``pyzmq`` and ``msgspec`` (``pip install 'kvplugin[events]'``).
"""

from __future__ import annotations

import dataclasses
import importlib
import itertools
import time
from collections.abc import Sequence
from typing import Any

from kvplugin.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["ZmqEventPublisher", "encode_batch"]

# Fields every event of the type carries (vLLM's required fields), in the wire's names.
_REQUIRED = {
    "BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size",
                    "lora_id", "medium", "lora_name"),
    "BlockRemoved": ("block_hashes", "medium"),
    "AllBlocksCleared": (),
}


def _wire(event: KVCacheEvent) -> dict[str, Any]:
    kind = type(event).__name__
    if not isinstance(event, BlockStored | BlockRemoved | AllBlocksCleared):
        raise TypeError(f"not a KV-cache event: {event!r}")
    out: dict[str, Any] = {"type": kind}
    required = _REQUIRED[kind]
    for f in dataclasses.fields(event):
        value = getattr(event, f.name)
        if f.name in required or value != f.default:  # omit_defaults, as vLLM encodes
            out[f.name] = value
    return out


def encode_batch(events: Sequence[KVCacheEvent], ts: float,
                 data_parallel_rank: int | None = None) -> bytes:
    """One ``KVEventBatch`` as vLLM's msgpack bytes."""
    msgpack = importlib.import_module("msgspec.msgpack")
    batch: list[Any] = [ts, [_wire(e) for e in events]]
    if data_parallel_rank is not None:
        batch.append(data_parallel_rank)
    return bytes(msgpack.encode(batch))


class ZmqEventPublisher:
    """Publishes batches of events on a ZMQ PUB socket bound to ``endpoint``."""

    def __init__(self, endpoint: str, *, topic: str = "", data_parallel_rank: int | None = None,
                 hwm: int = 100_000) -> None:
        try:
            zmq = importlib.import_module("zmq")
            importlib.import_module("msgspec")
        except ImportError as e:
            raise RuntimeError("the ZMQ event publisher needs pyzmq and msgspec: "
                               "pip install 'kvplugin[events]'") from e
        self._zmq = zmq
        self._ctx = zmq.Context.instance()
        self._sock = self._ctx.socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, hwm)
        self._sock.setsockopt(zmq.LINGER, 1000)  # close: a second for the last batches
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as e:
            self._sock.close(0)
            raise RuntimeError(f"cannot bind the KV event publisher to {endpoint}: {e}") from e
        self.endpoint = str(self._sock.getsockopt(zmq.LAST_ENDPOINT).decode())
        self._topic = topic.encode()
        self._rank = data_parallel_rank
        self._seq = itertools.count()
        self.published = 0  # batches sent
        self.dropped = 0  # batches a full socket refused
        self._closed = False

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        if self._closed:
            raise RuntimeError("the KV event publisher is closed")
        if not events:
            return
        payload = encode_batch(events, time.time(), self._rank)
        seq = next(self._seq).to_bytes(8, "big")
        try:
            self._sock.send_multipart((self._topic, seq, payload), flags=self._zmq.NOBLOCK)
            self.published += 1
        except self._zmq.Again:
            self.dropped += 1

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close()

    def __enter__(self) -> ZmqEventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
