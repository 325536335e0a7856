"""A KV-event subscriber as a router writes it against vLLM: vLLM's own ``KVEventBatch``
decoder on a ZMQ SUB socket. Run under the vLLM side venv::

    python kv_event_subscriber.py tcp://127.0.0.1:PORT

Prints ``ready`` once subscribed, then, after ``idle`` seconds without a message, one JSON
line: the batches' sequence numbers and what a router believes each medium holds."""

from __future__ import annotations

import json
import sys

import msgspec
import zmq
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch


def main(endpoint: str, idle: float = 3.0) -> None:
    sock = zmq.Context.instance().socket(zmq.SUB)
    sock.connect(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    print("ready", flush=True)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    seqs: list[int] = []
    believed: dict[str, set[int]] = {}
    counts: dict[str, int] = {}
    while sock.poll(int(idle * 1000)):
        _topic, seq, payload = sock.recv_multipart()
        seqs.append(int.from_bytes(seq, "big"))
        for e in decoder.decode(payload).events:
            name = type(e).__name__
            if isinstance(e, AllBlocksCleared):
                believed.clear()
                counts[name] = counts.get(name, 0) + 1
                continue
            assert isinstance(e, BlockStored | BlockRemoved)
            key = f"{name} {e.medium}"
            counts[key] = counts.get(key, 0) + 1
            blocks = believed.setdefault(str(e.medium), set())
            if isinstance(e, BlockStored):
                blocks.update(e.block_hashes)
            else:
                blocks.difference_update(e.block_hashes)
    print(json.dumps({"seqs": seqs, "counts": counts,
                      "believed": {m: sorted(b) for m, b in believed.items()}}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
