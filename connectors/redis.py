"""Redis connector: one self-describing value per object, written atomically.

* **Atomic publish.** An object is one value (envelope + Arrow IPC + checksums) written with
  ``SET key value NX [EX ttl]``: readers see the whole object or nothing, and there is no
  second "metadata" key to disagree with the payload (LMCache's two-key race).
* **Batching.** Prefix lookups pipeline ``EXISTS`` (stopping at the first missing batch),
  loads use ``MGET``, stores pipeline their ``SET``\\ s; all through one
  ``BlockingConnectionPool`` so concurrency is bounded and waits are bounded too. Commands
  are packed here and sent on pooled ``redis.asyncio`` connections: a stored value goes out
  as the encoder's pieces, never joined into one more 1 MiB copy.
* **Failure handling.** Connection errors and socket timeouts are retried with exponential
  backoff and jitter, inside the call's deadline. ``breaker_threshold`` consecutive failed
  calls open a circuit breaker: calls then fail fast (reads as misses) until one half-open
  probe succeeds after ``breaker_cooldown``. A restarted server is picked up by the pool's
  reconnects, so the connector never has to be recreated.

Capacity is the server's business (``maxmemory`` with an LRU policy, plus the optional TTL).
Keys are ``<prefix><96 hex>``; the prefix is validated, the rest is derived hex.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis._parsers import BaseParser
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from connectors.base import (
    BackendError,
    BackendUnavailable,
    Capabilities,
    CircuitBreaker,
    CircuitOpen,
    ConnectorError,
    Encoded,
    PutOutcome,
    StorageFull,
    StoragePermissionError,
    StoreBase,
    finish,
)

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvplugin.serde import EncodedBlock

__all__ = ["RedisConnector", "RedisOptions"]

logger = logging.getLogger(__name__)
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]{0,64}")
# Errors worth another attempt: the connection broke or the server did not answer in time.
# BusyLoadingError (a ConnectionError) is a restarting server loading its data set.
_TRANSIENT = (rexc.ConnectionError, rexc.TimeoutError, OSError)
_DENIED = (rexc.AuthenticationError, rexc.AuthorizationError, rexc.NoPermissionError)


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """Connection, batching and failure-handling settings (times in seconds)."""

    url: str = "redis://127.0.0.1:6379/0"
    prefix: str = "kvp:"
    ttl_seconds: int | None = None
    max_connections: int = 16
    socket_timeout: float = 1.0
    connect_timeout: float = 0.5
    retries: int = 2
    backoff_base: float = 0.01
    backoff_cap: float = 0.25
    breaker_threshold: int = 5
    breaker_cooldown: float = 1.0
    lookup_batch: int = 64
    get_batch: int = 32

    def __post_init__(self) -> None:
        if _PREFIX_RE.fullmatch(self.prefix) is None:
            raise ValueError(f"invalid key prefix {self.prefix!r}: must match {_PREFIX_RE.pattern}")
        if self.ttl_seconds is not None and (
            type(self.ttl_seconds) is not int or self.ttl_seconds <= 0
        ):
            raise ValueError(f"ttl_seconds must be None or a positive int: {self.ttl_seconds!r}")
        for name in ("max_connections", "breaker_threshold", "lookup_batch", "get_batch"):
            if type(getattr(self, name)) is not int or getattr(self, name) < 1:
                raise ValueError(f"{name} must be a positive int")
        if type(self.retries) is not int or self.retries < 0:
            raise ValueError("retries must be a non-negative int")
        for name in ("socket_timeout", "connect_timeout", "backoff_base", "backoff_cap"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0")
        if not self.breaker_cooldown >= 0:
            raise ValueError("breaker_cooldown must be >= 0")


class RedisConnector(StoreBase):
    """Objects as Redis string values under ``<prefix><storage id>``."""

    def __init__(
        self,
        options: RedisOptions | None = None,
        *,
        name: str = "redis",
        rng: random.Random | None = None,
    ) -> None:
        opts = options or RedisOptions()
        super().__init__(
            name=name,
            capabilities=Capabilities(
                tier="remote", persistent=True, shared=True, ttl=opts.ttl_seconds is not None
            ),
        )
        self.options = opts
        self._prefix = opts.prefix.encode()
        self._rng = rng or random.Random()  # jitter only; never the global random state
        self._breaker = CircuitBreaker(opts.breaker_threshold, opts.breaker_cooldown)
        self._pool = aioredis.BlockingConnectionPool.from_url(
            opts.url,
            max_connections=opts.max_connections,
            timeout=opts.socket_timeout,
            socket_timeout=opts.socket_timeout,
            socket_connect_timeout=opts.connect_timeout,
            retry=Retry(NoBackoff(), 0),  # retries are ours, bounded by the call's deadline
        )
        # Set before the first connection is made (the pool creates them lazily).
        self._pool.connection_class = _gathering(self._pool.connection_class)

    @property
    def breaker_state(self) -> str:
        return self._breaker.state

    def redis_key(self, sid: str) -> bytes:
        return self._prefix + sid.encode()

    # primitives -----------------------------------------------------------------------------
    # Every command goes through _roundtrip: packed here, pipelined on one pooled
    # connection. redis-py's command layer would add a copy of every stored value (set()
    # wants one buffer) and its response-callback machinery to every call.

    async def _prefix_present(self, ids: list[str]) -> int:
        n = 0
        for batch in _batches(ids, self.options.lookup_batch):
            commands = [[_pack(b"EXISTS", self.redis_key(s))] for s in batch]
            for present in await self._call("lookup", commands):
                if not present:
                    return n
                n += 1
        return n

    async def _fetch(self, ids: list[str]) -> list[Buffer | None]:
        out: list[Buffer | None] = []
        for batch in _batches(ids, self.options.get_batch):
            command = [_pack(b"MGET", *(self.redis_key(s) for s in batch))]
            (values,) = await self._call("get", [command], values=True)
            out.extend(values)
        return out

    async def _store(
        self, items: list[tuple[str, Encoded]], *, overwrite: bool
    ) -> list[PutOutcome]:
        ttl = self.options.ttl_seconds
        commands = [
            _pack_set(self.redis_key(sid), finish(enc), nx=not overwrite, ttl=ttl)
            for sid, enc in items
        ]
        replies = await self._call("put", commands)
        # SET NX answers nil when the key exists: content-addressed, so it is the same object.
        return [PutOutcome.EXISTS if reply is None else PutOutcome.WRITTEN for reply in replies]

    async def _remove(self, ids: list[str]) -> int:
        command = [_pack(b"UNLINK", *(self.redis_key(s) for s in ids))]
        (removed,) = await self._call("delete", [command])
        return int(removed)

    async def _ping(self) -> None:
        await self._call("ping", [[_pack(b"PING")]])

    async def _close(self) -> None:
        await self._pool.aclose()

    async def _roundtrip(
        self, commands: Sequence[Sequence[Buffer]], values: bool = False
    ) -> list[Any]:
        """Send packed commands on one pooled connection and read one reply each
        (``values``: each reply is an ``MGET`` array, read without copies)."""
        conn = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        try:
            # No per-send health check: the pool has none configured, and a broken
            # connection fails this send, which is retried.
            await conn.send_packed_command([c for cmd in commands for c in cmd], False)
            read = conn.read_values if values else conn.read_response
            return [await read() for _ in commands]
        except BaseException:
            # Replies may be left unread (an error reply, a cancellation): never reuse it.
            await conn.disconnect(nowait=True)
            raise
        finally:
            await self._pool.release(conn)

    def _on_deadline(self) -> None:
        # A call cut by its deadline is a slow backend: count it towards opening the breaker.
        self._breaker.failure()

    # retry and breaker ------------------------------------------------------------------------

    async def _call(
        self, op: str, commands: Sequence[Sequence[Buffer]], *, values: bool = False
    ) -> list[Any]:
        """One pipelined round trip, retried on connection trouble, behind the breaker."""
        if not self._breaker.acquire():
            raise CircuitOpen(f"{self.name} {op}: circuit open after repeated failures")
        settled = False
        try:
            attempt = 0
            while True:
                try:
                    result = await self._roundtrip(commands, values)
                except _DENIED as exc:
                    settled = True
                    self._breaker.success()  # the server answered
                    raise StoragePermissionError(f"{self.name} {op}: {exc}") from exc
                except _TRANSIENT as exc:
                    if attempt >= self.options.retries:
                        settled = True
                        self._breaker.failure()
                        raise BackendUnavailable(f"{self.name} {op}: {exc}") from exc
                    attempt += 1
                    logger.debug("%s %s: attempt %d failed: %s", self.name, op, attempt, exc)
                    await asyncio.sleep(self._backoff(attempt))
                except rexc.RedisError as exc:
                    settled = True
                    self._breaker.success()
                    raise _reply_error(self.name, op, exc) from exc
                else:
                    settled = True
                    self._breaker.success()
                    return result
        finally:
            if not settled:  # cancelled or cut by the deadline mid-call
                self._breaker.release()

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with "equal jitter": half fixed, half random."""
        cap = min(self.options.backoff_cap, self.options.backoff_base * 2.0 ** (attempt - 1))
        return cap / 2 + self._rng.uniform(0, cap / 2)


_GATHER_BELOW = 16 * 1024  # pieces smaller than this are joined before a transport write


class _GatherWrites:
    """Connection mixin: send a command's large pieces with a transport write each.

    redis-py sends a packed command with ``StreamWriter.writelines``, which on Python 3.11
    joins every piece into one new bytes object first: for a stored value, one more copy of
    the whole object on the event loop (~100 us per MiB, measured). ``transport.write`` hands
    a large piece to ``socket.send`` directly and only buffers (copies) what the socket did
    not take. Small pieces (headers, whole small commands) are still joined into one write.
    """

    _writer: asyncio.StreamWriter | None
    _reader: asyncio.StreamReader | None
    socket_timeout: float | None
    protocol: int

    async def send_packed_command(
        self, command: bytes | str | Iterable[Buffer], check_health: bool = True
    ) -> None:
        """redis-py's send under ``asyncio.timeout`` instead of ``asyncio.wait_for``, which on
        Python 3.11 wraps every send in a new task; same errors, same disconnects."""
        base: Any = super()
        if (
            not self.socket_timeout
            or self._writer is None
            or check_health
            or isinstance(command, bytes | str)
        ):
            return await base.send_packed_command(command, check_health)  # type: ignore[no-any-return]
        try:
            async with asyncio.timeout(self.socket_timeout):
                await self._send_packed_command(command)
        except TimeoutError:
            await base.disconnect(nowait=True)
            raise rexc.TimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await base.disconnect(nowait=True)
            raise rexc.ConnectionError(f"Error while writing to socket: {exc}") from exc
        except BaseException:
            await base.disconnect(nowait=True)
            raise

    async def read_values(self) -> list[Buffer | None]:
        """One ``MGET`` reply (an array of bulk strings or nulls; RESP2 or RESP3), each value
        a view of the bytes read: redis-py's parser copies every value once more
        (``data[:-2]``), one more 1 MiB copy per object on the event loop. Errors are
        redis-py's: an error reply raises its exception class, a timeout ``TimeoutError``, a
        closed connection ``ConnectionError``; the caller disconnects on any of them."""
        reader = self._reader
        if reader is None or self.protocol not in (2, 3):  # pragma: no cover - not connected
            base: Any = super()
            return await base.read_response()  # type: ignore[no-any-return]
        try:
            async with asyncio.timeout(self.socket_timeout):
                return await _read_bulk_array(reader)
        except TimeoutError:
            raise rexc.TimeoutError("Timeout reading from socket") from None
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise rexc.ConnectionError(f"Error while reading from socket: {exc!r}") from exc

    async def _send_packed_command(self, command: Iterable[Buffer]) -> None:
        writer = self._writer
        if writer is None:  # pragma: no cover - redis-py connects before sending
            raise rexc.ConnectionError("not connected")
        small: list[Buffer] = []
        for piece in command:
            view = memoryview(piece)
            if view.nbytes < _GATHER_BELOW:
                small.append(piece)
                continue
            if small:
                writer.write(b"".join(small))
                small = []
            writer.write(view)
        if small:
            writer.write(b"".join(small))
        await writer.drain()


async def _read_bulk_array(reader: asyncio.StreamReader) -> list[Buffer | None]:
    line = await reader.readuntil(b"\r\n")
    if line[:1] == b"-":
        raise BaseParser.parse_error(line[1:-2].decode(errors="replace"))  # type: ignore[no-untyped-call]
    if line[:1] != b"*":
        raise rexc.InvalidResponse(f"expected an array reply, got {line[:32]!r}")
    values: list[Buffer | None] = []
    for _ in range(int(line[1:-2])):
        line = await reader.readuntil(b"\r\n")
        if line == b"_\r\n":  # RESP3 null
            values.append(None)
            continue
        if line[:1] != b"$":
            raise rexc.InvalidResponse(f"expected a bulk string, got {line[:32]!r}")
        n = int(line[1:-2])
        if n < 0:
            values.append(None)
            continue
        data = await reader.readexactly(n + 2)
        if data[n:] != b"\r\n":
            raise rexc.InvalidResponse("bulk string not terminated by CRLF")
        values.append(memoryview(data)[:n])
    return values


_GATHERING: dict[type[Any], type[Any]] = {}


def _gathering(cls: type[Any]) -> type[Any]:
    """``cls`` (the pool's connection class: TCP, TLS or Unix socket) with
    :class:`_GatherWrites`, one subclass per class."""
    if cls not in _GATHERING:
        _GATHERING[cls] = type(f"Gathering{cls.__name__}", (_GatherWrites, cls), {})
    return _GATHERING[cls]


def _reply_error(name: str, op: str, exc: rexc.RedisError) -> ConnectorError:
    if isinstance(exc, rexc.OutOfMemoryError):
        return StorageFull(f"{name} {op}: server out of memory ({exc})")
    if isinstance(exc, rexc.ReadOnlyError):
        return StoragePermissionError(f"{name} {op}: server is read-only ({exc})")
    return BackendError(f"{name} {op}: {exc}")


def _pack_set(key: bytes, enc: EncodedBlock, *, nx: bool, ttl: int | None) -> list[Buffer]:
    """``SET key <value> [NX] [EX ttl]``, the value sent as the encoder's pieces (no join)."""
    options = [b"NX"] if nx else []
    if ttl is not None:
        options += [b"EX", str(ttl).encode()]
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (
        3 + len(options),
        len(key),
        key,
        enc.nbytes,
    )
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(o), o) for o in options)
    return [head, *enc.parts, tail]


def _pack(*args: bytes) -> bytes:
    """A RESP command of bulk strings (keys are validated hex, names are constants)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def _batches(ids: Sequence[str], size: int) -> list[Sequence[str]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]
