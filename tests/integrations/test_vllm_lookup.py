"""The scheduler's lookups through the worker that owns the tiers (:mod:`kvplugin.integrations.
_lookup`), over a real Unix socket and a real memory tier, without vLLM: the claim equals
the one computed on the tiers directly, and every failure is a miss in bounded time."""

from __future__ import annotations

import hashlib
import os
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import yaml

from kvplugin.aio.keys import KeySpace
from kvplugin.aio.memory import PageShape, layout_of
from kvplugin.integrations import _lookup, _runtime
from kvplugin.integrations._hits import tier_claim
from kvplugin.serde import Block

BS = 16
FULL = PageShape(2, 2, 4, "float32", BS)


def _hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(f"block{i}".encode()).digest() for i in range(n)]


@pytest.fixture()
def served(tmp_path: Path):  # type: ignore[no-untyped-def]
    cfg = tmp_path / "kv.yaml"
    cfg.write_text(yaml.safe_dump({"model": {"name": "m"},
                                   "offload": {"chunk_size": BS, "local_cpu": True,
                                               "local_disk": None,
                                               # The server's own deadline: generous, as
                                               # these tests are about the socket (a GC
                                               # pause on a loaded CI box passed 50 ms).
                                               "lookup_timeout_ms": 5000}}))
    rt = _runtime.acquire(str(cfg))
    keys = KeySpace("m", [FULL], BS)
    lay = layout_of([FULL], 1, BS)
    hashes = _hashes(10)
    items = [(k, Block(k.meta(token_start=0, token_end=BS, dtype="uint8", shape=(8,)),
                       bytes(8))) for k in keys.chunk_keys("t", 0, hashes, 0, 6)]
    rt.loop.call(rt.connector.put(items, timeout=5), timeout=10)
    path = _lookup.socket_path("engine-1", 0, str(cfg))
    server = _lookup.LookupServer(path, rt, keys, lay).start()
    try:
        yield rt, keys, lay, hashes, server
    finally:
        server.close()
        _runtime.release(rt)


def _out_of_process(path: str) -> None:
    """Serve as if the scheduler were in another process: no in-process shortcut."""
    with _lookup._LOCAL_LOCK:
        _lookup._LOCAL.pop(path, None)


def test_socket_claim_equals_the_tiers_claim(served) -> None:  # type: ignore[no-untyped-def]
    rt, keys, lay, hashes, server = served
    want = rt.loop.call(tier_claim(rt.connector, keys, lay, "t", hashes, 160, 0, 1.0))
    assert (want.local, want.external) == (0, 96)
    direct = _lookup.LookupClient(server.path, 1.0)
    assert direct.claim(_lookup.ClaimQuery("t", hashes, 160, 0)) == want
    assert server.served == 0  # in-process: no socket
    _out_of_process(server.path)
    client = _lookup.LookupClient(server.path, 1.0)
    try:
        for local, tenant, external in ((0, "t", 96), (32, "t", 64), (0, "other", 0)):
            got = client.claim(_lookup.ClaimQuery(tenant, hashes, 160, local))
            assert got is not None and (got.local, got.external) == (local, external)
        assert server.served == 3
        assert oct(os.stat(server.path).st_mode & 0o777) == "0o600"
    finally:
        client.close()


def test_no_worker_is_a_miss_then_the_worker_is_found(tmp_path: Path, served  # type: ignore[no-untyped-def]
                                                      ) -> None:
    _, _, _, hashes, server = served
    client = _lookup.LookupClient(str(tmp_path / "nobody.sock"), 0.2)
    t = time.monotonic()
    assert client.claim(_lookup.ClaimQuery("t", hashes, 160, 0)) is None
    assert time.monotonic() - t < 0.2
    assert client.failures == {"unreachable": 1}
    _out_of_process(server.path)
    client.path = server.path
    time.sleep(0.06)  # past the reconnect back-off
    got = client.claim(_lookup.ClaimQuery("t", hashes, 160, 0))
    assert got is not None and got.external == 96
    client.close()


def test_a_silent_server_is_a_miss_within_the_timeout(tmp_path: Path) -> None:
    path = str(tmp_path / "silent.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(1)
    held: list[socket.socket] = []
    th = threading.Thread(target=lambda: held.append(srv.accept()[0]), daemon=True)
    th.start()
    client = _lookup.LookupClient(path, 0.2)
    t = time.monotonic()
    assert client.claim(_lookup.ClaimQuery("t", _hashes(2), 40, 0)) is None
    assert 0.15 < time.monotonic() - t < 1.0
    assert client.failures == {"TimeoutError": 1}
    th.join(2)
    for s in (*held, srv):
        s.close()


def test_a_malformed_query_drops_only_that_connection(served) -> None:  # type: ignore[no-untyped-def]
    _, _, _, hashes, server = served
    _out_of_process(server.path)
    bad = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bad.connect(server.path)
    bad.sendall(struct.pack("!I", 1) + b"\x05")  # CBOR 5: not a query
    bad.settimeout(2)
    assert bad.recv(16) == b""  # the server closed it
    bad.close()
    huge = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    huge.connect(server.path)
    huge.sendall(struct.pack("!I", _lookup.MAX_FRAME + 1))
    huge.settimeout(2)
    assert huge.recv(16) == b""
    huge.close()
    client = _lookup.LookupClient(server.path, 1.0)
    got = client.claim(_lookup.ClaimQuery("t", hashes, 160, 0))
    assert got is not None and got.external == 96
    client.close()
