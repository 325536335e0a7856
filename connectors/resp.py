"""The Redis connector's wire layer: command packing, a strict reply reader, and the
connection mixin that sends and reads with them.

Why not redis-py's reader for our commands: it copies every value once more
(``data[:-2]``), trusts whatever length a server announces, and a malformed reply escapes it
as ``ValueError``, ``TypeError`` or ``RecursionError``. This reader

* returns bulk strings as views of the bytes read (zero-copy);
* returns error replies as values (:class:`ErrorReply`): in a pipeline, one key's
  ``WRONGTYPE`` is an answer about that key, not a failed batch;
* raises :class:`ProtocolError` for anything that is not well-formed RESP, not a reply our
  commands can get (aggregates, RESP3 doubles, ...), or bigger than :data:`MAX_BULK`, so a
  hostile or broken server cannot make us buffer without bound;
* skips RESP3 out-of-band pushes and attributes, which are not replies.

Only the connection handshake (``AUTH``/``HELLO``/``SELECT``) still goes through redis-py's
reader; :class:`WireConnection` turns whatever escapes it into a :class:`ProtocolError` too.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import redis.exceptions as rexc
from redis._parsers import BaseParser

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "MAX_BULK",
    "ErrorReply",
    "ProtocolError",
    "Reply",
    "WireConnection",
    "pack",
    "pack_set",
    "read_reply",
    "wire_class",
]

MIB = 1 << 20
# Redis' own limit on a bulk string (proto-max-bulk-len): no real reply is bigger.
MAX_BULK = 512 * MIB
# Out-of-band data (RESP3 pushes, attributes) is read only to be skipped: keep it small.
_MAX_SKIPPED_BULK = MIB
_MAX_SKIPPED_ITEMS = 1024
_MAX_SKIPPED_DEPTH = 4
# A value of n bytes may take n / _MIN_RATE seconds on top of the socket timeout: that
# timeout detects a dead server, it must not cut a big value arriving on a slow link.
_MIN_RATE = 4 * MIB
_LENGTH = re.compile(rb"-1|0|[1-9][0-9]{0,9}")
_INTEGER = re.compile(rb"-?(0|[1-9][0-9]{0,18})")


class ProtocolError(rexc.InvalidResponse):
    """The server's reply is malformed, oversized, or not one our command can get. The
    connection that read it is out of step with the server and must be dropped."""


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """An error reply (``-CODE message``), read as a value."""

    message: str

    @property
    def code(self) -> str:
        return self.message.split(" ", 1)[0]

    def exception(self) -> rexc.RedisError:
        """redis-py's exception class for this error (auth, OOM, read-only, ...)."""
        exc: rexc.RedisError = BaseParser.parse_error(self.message)  # type: ignore[no-untyped-call]
        return exc


# bulk string (a view) | simple string | integer | null | error
Reply = memoryview | str | int | None | ErrorReply


async def read_reply(
    reader: asyncio.StreamReader, *, resp3: bool, timeout: asyncio.Timeout | None = None
) -> Reply:
    """One reply. ``timeout``, the read's own, is extended for long bulk strings.

    Raises :class:`ProtocolError`; a closed connection raises ``IncompleteReadError``."""
    while True:
        line = await _line(reader)
        kind, body = line[:1], line[1:-2]
        if kind == b"$":
            n = _length(body)
            return None if n < 0 else await _bulk(reader, n, timeout)
        if kind == b"+":
            return body.decode("utf-8", "replace")
        if kind == b":":
            return _integer(body)
        if kind == b"-":
            return ErrorReply(body.decode("utf-8", "replace"))
        if resp3:
            if line == b"_\r\n":
                return None
            if kind == b"!" and (n := _length(body)) >= 0:
                message = await _bulk(reader, n, None, cap=_MAX_SKIPPED_BULK)
                return ErrorReply(bytes(message).decode("utf-8", "replace"))
            if kind in (b">", b"|"):  # a push or an attribute: not the reply, skip it
                count = _length(body) * (2 if kind == b"|" else 1)
                await _skip_items(reader, count, depth=1)
                continue
        raise ProtocolError(f"unexpected reply {line[:40]!r}")


async def _line(reader: asyncio.StreamReader) -> bytes:
    try:
        return await reader.readuntil(b"\r\n")
    except asyncio.LimitOverrunError as exc:
        raise ProtocolError(f"reply line longer than {exc.consumed} bytes") from None


def _length(body: bytes) -> int:
    if _LENGTH.fullmatch(body) is None:
        raise ProtocolError(f"bad length {body[:24]!r}")
    return int(body)


def _integer(body: bytes) -> int:
    if _INTEGER.fullmatch(body) is None:
        raise ProtocolError(f"bad integer {body[:24]!r}")
    return int(body)


async def _bulk(
    reader: asyncio.StreamReader, n: int, timeout: asyncio.Timeout | None, cap: int = MAX_BULK
) -> memoryview:
    if n > cap:
        raise ProtocolError(f"bulk string of {n} bytes, over the {cap}-byte cap")
    if timeout is not None and n >= MIB and (when := timeout.when()) is not None:
        timeout.reschedule(when + n / _MIN_RATE)
    data = await reader.readexactly(n + 2)
    if data[n:] != b"\r\n":
        raise ProtocolError("bulk string not terminated by CRLF")
    return memoryview(data)[:n]


async def _skip_items(reader: asyncio.StreamReader, count: int, depth: int) -> None:
    """Read and drop ``count`` RESP3 values (the body of a push or an attribute)."""
    if count < 0 or count > _MAX_SKIPPED_ITEMS or depth > _MAX_SKIPPED_DEPTH:
        raise ProtocolError("out-of-band data too large or too deeply nested")
    for _ in range(count):
        line = await _line(reader)
        kind, body = line[:1], line[1:-2]
        if kind in (b"$", b"!", b"=") and (n := _length(body)) >= 0:
            await _bulk(reader, n, None, cap=_MAX_SKIPPED_BULK)
        elif kind in (b"*", b"~", b">", b"%", b"|"):
            n = _length(body) * (2 if kind in (b"%", b"|") else 1)
            await _skip_items(reader, n, depth + 1)
        elif kind == b"_":
            if line != b"_\r\n":
                raise ProtocolError(f"bad null {line[:40]!r}")
        elif kind not in (b"+", b"-", b":", b",", b"#", b"(", b"$", b"!", b"="):
            raise ProtocolError(f"unknown reply type {line[:40]!r}")


# --- commands --------------------------------------------------------------------------------


def pack(*args: bytes) -> bytes:
    """A RESP command of bulk strings (keys are validated hex, names are constants)."""
    return b"*%d\r\n" % len(args) + b"".join(b"$%d\r\n%s\r\n" % (len(a), a) for a in args)


def pack_set(
    key: bytes, parts: Sequence[Buffer], nbytes: int, *, nx: bool, ttl: int | None
) -> list[Buffer]:
    """``SET key <value> [NX] [EX ttl]``, the value sent as its pieces (never joined)."""
    options = [b"NX"] if nx else []
    if ttl is not None:
        options += [b"EX", str(ttl).encode()]
    head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (3 + len(options), len(key), key, nbytes)
    tail = b"\r\n" + b"".join(b"$%d\r\n%s\r\n" % (len(o), o) for o in options)
    return [head, *parts, tail]


# --- the connection ------------------------------------------------------------------------------

_GATHER_BELOW = 16 * 1024  # pieces smaller than this are joined before a transport write


class WireConnection:
    """redis-py connection mixin: our sends and reads, and a hard close on failure.

    * **Sends.** redis-py sends a packed command with ``StreamWriter.writelines``, which on
      Python 3.11 joins every piece into one new bytes object first: for a stored value, one
      more copy of the whole object on the event loop (~100 us per MiB, measured).
      ``transport.write`` hands a large piece to ``socket.send`` directly and only buffers
      what the socket did not take. Small pieces are still joined into one write.
    * **Reads** go through :func:`read_reply` (see the module docstring).
    * **Failure closes abort.** redis-py closes a failed connection with
      ``StreamWriter.close()``, which keeps the transport open until its buffered bytes are
      flushed: after a cancelled or timed-out send, the rest of a command the caller gave up
      on would still reach the server (and, where the transport holds views, bytes of a
      payload the caller has since reused). ``disconnect(nowait=True)``, redis-py's and ours
      error path, aborts the transport instead: buffered bytes are dropped and the server
      sees a truncated command on a closed connection, which it discards.
    """

    _writer: asyncio.StreamWriter | None
    _reader: asyncio.StreamReader | None
    socket_timeout: float | None
    protocol: int | str

    async def send_packed_command(
        self, command: bytes | str | Iterable[Buffer], check_health: bool = True
    ) -> None:
        """redis-py's send under ``asyncio.timeout`` instead of ``asyncio.wait_for`` (which on
        Python 3.11 wraps every send in a new task); same errors, same disconnects."""
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
                await self._send_pieces(command)
        except TimeoutError:
            await self.disconnect(nowait=True)
            raise rexc.TimeoutError("Timeout writing to socket") from None
        except OSError as exc:
            await self.disconnect(nowait=True)
            raise rexc.ConnectionError(f"Error while writing to socket: {exc}") from exc
        except BaseException:
            await self.disconnect(nowait=True)
            raise

    async def read_replies(self, count: int) -> list[Reply]:
        """``count`` replies, under one socket timeout (extended for long values). A closed
        connection raises redis-py's ``ConnectionError``, a timeout its ``TimeoutError``,
        a malformed reply :class:`ProtocolError`; the caller disconnects on any of them."""
        reader = self._reader
        if reader is None:
            raise rexc.ConnectionError("Connection closed by server.")
        resp3 = str(self.protocol) == "3"
        try:
            async with asyncio.timeout(self.socket_timeout) as timeout:
                return [
                    await read_reply(reader, resp3=resp3, timeout=timeout) for _ in range(count)
                ]
        except TimeoutError:
            raise rexc.TimeoutError("Timeout reading from socket") from None
        except (asyncio.IncompleteReadError, OSError) as exc:
            raise rexc.ConnectionError(f"Error while reading from socket: {exc!r}") from exc

    async def disconnect(self, nowait: bool = False, *args: Any, **kwargs: Any) -> None:
        if nowait and self._writer is not None:
            self._writer.transport.abort()
        base: Any = super()
        await base.disconnect(nowait, *args, **kwargs)

    async def on_connect_check_health(self, check_health: bool = True) -> None:
        """redis-py's handshake; a reply its reader chokes on is a :class:`ProtocolError`,
        and the half-set-up connection (maybe not authenticated, maybe on the wrong db) is
        closed here: redis-py only closes it for its own exception classes."""
        base: Any = super()
        try:
            await base.on_connect_check_health(check_health)
        except rexc.RedisError:
            await self.disconnect(nowait=True)
            raise
        except Exception as exc:
            await self.disconnect(nowait=True)
            raise ProtocolError(f"malformed reply to the connection handshake: {exc!r}") from exc

    async def _send_pieces(self, command: Iterable[Buffer]) -> None:
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


_WIRE: dict[type[Any], type[Any]] = {}


def wire_class(cls: type[Any]) -> type[Any]:
    """``cls`` (the pool's connection class: TCP, TLS or Unix socket) with
    :class:`WireConnection`, one subclass per class."""
    if cls not in _WIRE:
        _WIRE[cls] = type(f"Wire{cls.__name__}", (WireConnection, cls), {})
    return _WIRE[cls]
