"""Redis connector: one self-describing value per object, written atomically.

* **Atomic publish.** An object is one value (envelope + Arrow IPC + checksums) written with
  ``SET key value NX [EX ttl]``: readers see the whole object or nothing, and there is no
  second "metadata" key to disagree with the payload (LMCache's two-key race).
* **Batching.** Prefix lookups pipeline ``STRLEN`` (stopping at the first missing batch),
  loads pipeline ``GET``\\ s, stores pipeline their ``SET``\\ s: one round trip per batch,
  one command per key, so each key gets its own answer (and a cluster could split them).
  All go through one ``BlockingConnectionPool`` so concurrency and waits are bounded.
  Commands are packed and replies read in :mod:`kvplugin.connectors.resp`: a stored value goes
  out as the encoder's pieces and comes back as a view of the bytes read, never copied again.
* **Whatever the server holds or says.** A value that is not a string (someone ran
  ``LPUSH`` on one of our keys), an empty one, or a corrupt one is a counted miss and is
  replaced or removed; an error reply for one key (``WRONGTYPE``) is that key's answer, not a
  failed batch; a malformed, oversized or unexpected reply is a :class:`BackendError` and
  the connection that read it is dropped. No other exception leaves a public call.
* **Failure handling.** Connection errors and socket timeouts are retried with exponential
  backoff and jitter, inside the call's deadline. ``breaker_threshold`` consecutive failed
  calls (protocol errors included) open a circuit breaker: calls then fail fast (reads as
  misses) until one half-open probe succeeds after ``breaker_cooldown``. A restarted server
  is picked up by the pool's reconnects, so the connector never has to be recreated.
  Refused credentials are a :class:`StoragePermissionError` naming the URL, never the
  password (which is redacted from every message this module produces).

Capacity is the server's business (``maxmemory`` with an LRU policy, plus the optional TTL).
Keys are ``<prefix><96 hex>``; the prefix is validated, the rest is derived hex.
"""

from __future__ import annotations

import asyncio
import logging
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from typing import TYPE_CHECKING, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff

from kvplugin.connectors.base import (
    BackendError,
    BackendUnavailable,
    CircuitBreaker,
    CircuitOpen,
    StoragePermissionError,
)
from kvplugin.connectors.redis_common import (
    DENIED,
    TRANSIENT,
    WRONG_TYPE,
    RedisStoreBase,
    batches,
    denied_message,
    public_url,
    reply_count,
    reply_error,
    reply_pong,
    reply_strlen,
    reply_value,
    secret_forms,
)
from kvplugin.connectors.resp import Reply, pack, wire_class

if TYPE_CHECKING:
    from typing_extensions import Buffer


__all__ = ["RedisConnector", "RedisOptions"]

logger = logging.getLogger(__name__)
T = TypeVar("T")
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.:-]{0,64}")


# redis-py's own RESP3 parser crashes on some malformed replies (an empty push ``>0``, a
# push whose type is not UTF-8) instead of raising a protocol error: read as one, a server
# we cannot understand.
_PARSER_CRASHES = (IndexError, KeyError, TypeError, ValueError)


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

    def __repr__(self) -> str:
        # Options get logged; the URL may carry a password.
        shown = ", ".join(
            f"{f.name}={public_url(self.url) if f.name == 'url' else getattr(self, f.name)!r}"
            for f in fields(self) if f.repr
        )
        return f"{type(self).__name__}({shown})"


class RedisConnector(RedisStoreBase):
    """Objects as Redis string values under ``<prefix><storage id>``."""

    def __init__(
        self,
        options: RedisOptions | None = None,
        *,
        name: str = "redis",
        rng: random.Random | None = None,
        secret: bytes | None = None,
        previous_secrets: Sequence[bytes] = (),
    ) -> None:
        opts = options or RedisOptions()
        super().__init__(opts, name=name, rng=rng, secret=secret,
                         previous_secrets=previous_secrets, password=None)
        self.options = opts
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
        self._pool.connection_class = wire_class(self._pool.connection_class)
        # The password redis-py will send, wherever the URL put it (userinfo or query).
        self._secrets = secret_forms(self._pool.connection_kwargs.get("password"))

    @property
    def breaker_state(self) -> str:
        return self._breaker.state

    # primitives -----------------------------------------------------------------------------
    # Every command goes through _call/_roundtrip: packed here, pipelined on one pooled
    # connection, each reply checked by the caller's `check` before the connection is
    # released. redis-py's command layer would add a copy of every stored value (set()
    # wants one buffer) and its response-callback machinery to every call.

    async def _prefix_present(self, ids: list[str]) -> int:
        n = 0
        for batch in batches(ids, self.options.lookup_batch):
            commands = [[pack(b"STRLEN", self.redis_key(s))] for s in batch]
            lengths = await self._call("lookup", commands, reply_strlen)
            # O(1) per key, unlike GET; an empty string reads 0 (a miss, dropped by get/put).
            wrong = [s for s, length in zip(batch, lengths, strict=True) if length is WRONG_TYPE]
            if wrong:
                await self._drop_wrong_type("lookup", wrong)
            for length in lengths:
                if length is WRONG_TYPE or length == 0:
                    return n
                n += 1
        return n

    async def _fetch(self, ids: list[str]) -> list[Buffer | None]:
        out: list[Buffer | None] = []
        for batch in batches(ids, self.options.get_batch):
            commands = [[pack(b"GET", self.redis_key(s))] for s in batch]
            values = await self._call("get", commands, reply_value)
            for sid, value in zip(batch, values, strict=True):
                if value is not WRONG_TYPE:
                    out.append(value)
                    continue
                # Loaded as an empty object: the store's verification counts it as a corrupt
                # miss and deletes it, as it does every other damaged object.
                logger.warning("%s get: %s holds a non-string value", self.name, sid)
                out.append(b"")
        return out

    async def _run(self, op: str, keys: list[bytes], commands: list[list[Buffer]],
                   check: Callable[[Reply], T]) -> list[T]:
        return await self._call(op, commands, check)

    async def _remove(self, ids: list[str]) -> int:
        command = [pack(b"UNLINK", *(self.redis_key(s) for s in ids))]
        (removed,) = await self._call("delete", [command], reply_count(len(ids)))
        return removed

    async def _ping(self) -> None:
        await self._call("ping", [[pack(b"PING")]], reply_pong)

    async def _close(self) -> None:
        await self._pool.aclose()

    async def _roundtrip(
        self, commands: Sequence[Sequence[Buffer]], check: Callable[[Reply], T]
    ) -> list[T]:
        """Send packed commands on one pooled connection, read and check one reply each."""
        try:
            conn = await self._pool.get_connection()  # type: ignore[no-untyped-call]
        except _PARSER_CRASHES as exc:  # a pending push read on a pooled connection
            raise rexc.InvalidResponse(f"malformed reply: {exc!r}") from exc
        try:
            # No per-send health check: the pool has none configured, and a broken
            # connection fails this send, which is retried.
            await conn.send_packed_command([c for cmd in commands for c in cmd], False)
            try:
                replies = await conn.read_replies(len(commands))
            except _PARSER_CRASHES as exc:
                raise rexc.InvalidResponse(f"malformed reply: {exc!r}") from exc
            return [check(reply) for reply in replies]
        except BaseException:
            # Replies may be left unread, or the server is out of step (a protocol error), or
            # a send was cut short: never reuse it. This aborts, dropping unsent bytes.
            await conn.disconnect(nowait=True)
            raise
        finally:
            await self._pool.release(conn)

    def _on_deadline(self) -> None:
        # A call cut by its deadline is a slow backend: count it towards opening the breaker.
        self._breaker.failure()

    # retry and breaker ------------------------------------------------------------------------

    async def _call(
        self, op: str, commands: Sequence[Sequence[Buffer]], check: Callable[[Reply], T]
    ) -> list[T]:
        """One pipelined round trip, retried on connection trouble, behind the breaker."""
        if not self._breaker.acquire():
            raise CircuitOpen(f"{self.name} {op}: circuit open after repeated failures")
        settled = False
        try:
            attempt = 0
            while True:
                try:
                    result = await self._roundtrip(commands, check)
                except DENIED as exc:
                    settled = True
                    self._breaker.success()  # the server answered
                    text = denied_message(self.url, exc)
                    raise self._error(StoragePermissionError, op, text) from self._shown(exc)
                except rexc.InvalidResponse as exc:
                    settled = True
                    self._breaker.failure()  # a server we cannot understand is not working
                    text = f"protocol error from {self.url} (connection dropped): {exc}"
                    raise self._error(BackendError, op, text) from self._shown(exc)
                except TRANSIENT as exc:
                    if attempt >= self.options.retries:
                        settled = True
                        self._breaker.failure()
                        text = str(exc)
                        raise self._error(BackendUnavailable, op, text) from self._shown(exc)
                    attempt += 1
                    text = self._redact(str(exc))
                    logger.debug("%s %s: attempt %d failed: %s", self.name, op, attempt, text)
                    await asyncio.sleep(self._backoff(attempt))
                except rexc.RedisError as exc:
                    settled = True
                    self._breaker.success()
                    kind, text = reply_error(exc)
                    raise self._error(kind, op, text) from self._shown(exc)
                else:
                    settled = True
                    self._breaker.success()
                    return result
        finally:
            if not settled:  # cancelled or cut by the deadline mid-call
                self._breaker.release()
