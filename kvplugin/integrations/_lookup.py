"""Tier lookups across vLLM's processes: the worker owns the tiers, the scheduler asks it.

In vLLM's engine the scheduler's connector (in the EngineCore process) and the worker's
(in each worker process) are separate objects, usually in separate processes. The tiers
can only have one owner: a disk tier's directory lock admits one process, and a host-memory
tier lives in one process's memory. So the worker of TP rank 0 opens the tiers and serves
**claims** (how far the tiers extend a device hit, :func:`_hits.tier_claim`) on a Unix
socket; the scheduler sends (tenant, block hashes, tokens, device hit) and gets the claim.
One round trip per lookup (~0.1 ms), whatever the number of tiers and probes, as LMCache's
lookup server does. When both roles are in one process (vLLM's uniprocess executor, the
Scheduler-only tests) the scheduler calls the worker's server directly.

Failure is a miss, never a stall: a worker not up yet, a closed socket, a reply later than
``offload.lookup_timeout_ms`` all answer "no claim" (counted, logged once per kind), and
the next lookup reconnects. The socket only answers lookups (no KV crosses it), is created
owner-only (0600), and frames are size-bounded CBOR, never pickle.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import cbor2

from kvplugin.aio import plans
from kvplugin.aio.keys import KeySpace
from kvplugin.integrations._hits import tier_claim
from kvplugin.integrations._runtime import Runtime

__all__ = ["ClaimQuery", "LookupClient", "LookupServer", "local_server", "socket_path"]

logger = logging.getLogger(__name__)

_HEADER = struct.Struct("!I")
MAX_FRAME = 16 << 20  # a 100k-token prompt's 32-byte hashes: ~0.2 MiB at 16-token blocks


@dataclass(frozen=True, slots=True)
class ClaimQuery:
    """What the scheduler asks: the tiers' extension of a device hit of ``local`` tokens."""

    tenant: str
    block_hashes: Sequence[bytes]
    num_tokens: int
    local: int


def socket_path(engine_id: str, data_parallel_rank: int, config_file: str) -> str:
    """The rendezvous both processes derive from what vLLM hands both the same config."""
    tag = hashlib.sha256(f"{engine_id}\0{data_parallel_rank}\0"
                         f"{os.path.abspath(config_file)}".encode()).hexdigest()[:20]
    return os.path.join(tempfile.gettempdir(), f"kvplugin-{tag}.sock")


_LOCAL: dict[str, LookupServer] = {}
_LOCAL_LOCK = threading.Lock()


def local_server(path: str) -> LookupServer | None:
    """The server of ``path`` when it runs in this process (then no socket is needed)."""
    with _LOCAL_LOCK:
        return _LOCAL.get(path)


def _bound(frame: bytes) -> bytes:
    if len(frame) > MAX_FRAME:
        raise ValueError(f"lookup frame of {len(frame)} bytes exceeds {MAX_FRAME}")
    return _HEADER.pack(len(frame)) + frame


def _encode_query(q: ClaimQuery) -> bytes:
    return _bound(cbor2.dumps([q.tenant, [bytes(h) for h in q.block_hashes], q.num_tokens,
                               q.local]))


def _decode_query(frame: bytes) -> ClaimQuery:
    try:
        tenant, hashes, num_tokens, local = cbor2.loads(frame)
    except Exception as e:  # any bytes may arrive: a clear refusal, never a crash
        raise ValueError(f"malformed lookup query: {e!r}") from None
    if (not isinstance(tenant, str) or not isinstance(hashes, list)
            or not all(isinstance(h, bytes) for h in hashes)
            or type(num_tokens) is not int or type(local) is not int):
        raise ValueError("malformed lookup query")
    return ClaimQuery(tenant, hashes, num_tokens, local)


def _encode_claim(c: plans.Claim) -> bytes:
    return _bound(cbor2.dumps([c.local, c.external, c.state_at, c.deep, list(c.stored_until)]))


def _decode_claim(frame: bytes) -> plans.Claim:
    try:
        local, external, state_at, deep, stored = cbor2.loads(frame)
    except Exception as e:
        raise ValueError(f"malformed lookup reply: {e!r}") from None
    if (type(local) is not int or type(external) is not int
            or not (state_at is None or type(state_at) is int) or type(deep) is not bool
            or type(stored) is not list or any(type(n) is not int for n in stored)):
        raise ValueError("malformed lookup reply")
    return plans.Claim(local, external, state_at, deep, tuple(stored))


class LookupServer:
    """The worker's side: answers claims over the tiers of ``rt`` on its loop thread."""

    def __init__(self, path: str, rt: Runtime, keys: KeySpace, layout: plans.Layout) -> None:
        self.path = path
        self._rt = rt
        self._keys = keys
        self._layout = layout
        self._server: asyncio.AbstractServer | None = None
        self._conns: set[asyncio.StreamWriter] = set()
        self.served = 0

    async def claim(self, q: ClaimQuery) -> plans.Claim:
        return await tier_claim(self._rt.connector, self._keys, self._layout, q.tenant,
                                q.block_hashes, q.num_tokens, q.local,
                                self._rt.timeouts.lookup)

    def claim_sync(self, q: ClaimQuery, timeout: float) -> plans.Claim:
        """For a scheduler in this process: the claim, run on the tiers' loop."""
        return self._rt.loop.call(self.claim(q), timeout=timeout)

    def start(self) -> LookupServer:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a previous engine's, left by a crash
        self._server = self._rt.loop.call(self._listen(), timeout=10)
        with _LOCAL_LOCK:
            _LOCAL[self.path] = self
        return self

    async def _listen(self) -> asyncio.AbstractServer:
        old = os.umask(0o177)  # owner-only socket
        try:
            return await asyncio.start_unix_server(self._serve, path=self.path)
        finally:
            os.umask(old)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
                     ) -> None:
        self._conns.add(writer)
        try:
            while True:
                try:
                    (size,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
                except asyncio.IncompleteReadError:
                    return  # the scheduler closed the connection
                if size > MAX_FRAME:
                    logger.warning("kvplugin lookup server: frame of %d bytes refused", size)
                    return
                query = _decode_query(await reader.readexactly(size))
                try:
                    claim = await self.claim(query)
                except Exception as e:  # a tier failing a lookup: no claim, never an error
                    logger.warning("kvplugin lookup failed: %r", e)
                    claim = plans.Claim(query.local)
                self.served += 1
                writer.write(_encode_claim(claim))
                await writer.drain()
        except (ValueError, ConnectionError) as e:
            logger.warning("kvplugin lookup server: connection dropped: %r", e)
        finally:
            self._conns.discard(writer)
            writer.close()

    def close(self) -> None:
        with _LOCAL_LOCK:
            if _LOCAL.get(self.path) is self:
                del _LOCAL[self.path]
        server, self._server = self._server, None
        if server is not None and self._rt.loop.running:
            with contextlib.suppress(Exception):
                self._rt.loop.call(self._shutdown(server), timeout=5)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)


    async def _shutdown(self, server: asyncio.AbstractServer) -> None:
        """Stop listening and end every connection by EOF (its handler returns), so no
        handler is left to be cancelled with the loop."""
        server.close()
        for writer in list(self._conns):
            writer.close()
        for _ in range(100):
            if not self._conns:
                break
            await asyncio.sleep(0.01)
        await server.wait_closed()


class LookupClient:
    """The scheduler's side: one blocking request at a time (vLLM's scheduler is one
    thread), bounded by ``timeout``; any failure is a miss and drops the connection."""

    def __init__(self, path: str, timeout: float) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: socket.socket | None = None
        self.failures: dict[str, int] = {}
        self._retry_at = 0.0

    def claim(self, q: ClaimQuery) -> plans.Claim | None:
        """The worker's claim, or None (a miss) when it cannot be had in time."""
        server = local_server(self.path)
        if server is not None:
            return server.claim_sync(q, self.timeout + 0.05)
        deadline = time.monotonic() + self.timeout
        try:
            sock = self._connect()
            if sock is None:
                return None
            sock.settimeout(self.timeout)
            sock.sendall(_encode_query(q))
            (size,) = _HEADER.unpack(self._recv(sock, _HEADER.size, deadline))
            if size > MAX_FRAME:
                raise ValueError(f"reply frame of {size} bytes")
            return _decode_claim(self._recv(sock, size, deadline))
        except (OSError, ValueError) as e:
            self._fail(type(e).__name__, e)
            self.close()
            return None

    def _connect(self) -> socket.socket | None:
        if self._sock is not None:
            return self._sock
        now = time.monotonic()
        if now < self._retry_at:
            return None  # the worker was not there a moment ago: don't ask every request
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.path)
        except OSError as e:
            sock.close()
            self._retry_at = now + 0.05
            self._fail("unreachable", e)
            return None
        self._sock = sock
        return sock

    @staticmethod
    def _recv(sock: socket.socket, n: int, deadline: float) -> bytes:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError("lookup reply too late")
            sock.settimeout(left)
            chunk = sock.recv(n - len(buf))
            if not chunk:
                raise ConnectionResetError("the lookup server closed the connection")
            buf += chunk
        return bytes(buf)

    def _fail(self, kind: str, e: BaseException) -> None:
        n = self.failures.get(kind, 0)
        self.failures[kind] = n + 1
        if n == 0:
            logger.warning("kvplugin lookup through %s: %r (a miss; logged once per kind)",
                           self.path, e)

    def close(self) -> None:
        sock, self._sock = self._sock, None
        if sock is not None:
            sock.close()

