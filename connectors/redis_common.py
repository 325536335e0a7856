"""What the Redis and Redis Cluster connectors share: their base class (keys, stores with
their take-over of damaged values, retries' backoff, error messages without passwords),
which errors are transient or a refusal, the checks of each command's reply, and how URLs
and passwords are kept out of messages."""

from __future__ import annotations

import enum
import logging
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, NoReturn, Protocol, TypeVar
from urllib.parse import parse_qsl, quote, quote_plus, urlencode, urlsplit, urlunsplit

import redis.exceptions as rexc

from kvplugin.connectors.base import (
    BackendError,
    Capabilities,
    ConnectorError,
    Encoded,
    PutOutcome,
    StorageFull,
    StoragePermissionError,
    StoreBase,
    finish,
)
from kvplugin.connectors.resp import ErrorReply, ProtocolError, Reply, pack, pack_set

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvplugin.serde import EncodedBlock

__all__ = ["DENIED", "TRANSIENT", "WRONG_TYPE", "RedisStoreBase", "Wrong", "batches",
           "denied_message",
           "public_url", "raise_unexpected", "reply_count", "reply_error", "reply_ok",
           "reply_pong", "reply_set", "reply_strlen", "reply_value", "reply_wrong_type",
           "secret_forms"]

T = TypeVar("T")

# Errors worth another attempt: the connection broke or the server did not answer in time.
# BusyLoadingError (a ConnectionError) is a restarting server loading its data set.
TRANSIENT = (rexc.ConnectionError, rexc.TimeoutError, OSError)
DENIED = (rexc.AuthenticationError, rexc.AuthorizationError, rexc.NoPermissionError)


class Wrong(enum.Enum):
    """A key holding something other than a string (``WRONGTYPE``): not one of our objects."""

    TYPE = "wrong type"


WRONG_TYPE = Wrong.TYPE


# --- reply checks: each returns what its command can answer, or raises ------------------------


def reply_strlen(reply: Reply) -> int | Wrong:
    if type(reply) is int and reply >= 0:
        return reply
    return reply_wrong_type(reply)


def reply_value(reply: Reply) -> memoryview | Wrong | None:
    if reply is None or type(reply) is memoryview:
        return reply
    return reply_wrong_type(reply)


def reply_set(reply: Reply) -> bool:
    """``SET NX``: True when written, False when the key was taken."""
    if reply is None:
        return False
    return reply_ok(reply)


def reply_ok(reply: Reply) -> bool:
    if reply == "OK":
        return True
    raise_unexpected(reply)


def reply_pong(reply: Reply) -> None:
    if reply != "PONG":
        raise_unexpected(reply)


def reply_count(limit: int) -> Callable[[Reply], int]:
    def check(reply: Reply) -> int:
        if type(reply) is int and 0 <= reply <= limit:
            return reply
        raise_unexpected(reply)

    return check


def reply_wrong_type(reply: Reply) -> Wrong:
    if isinstance(reply, ErrorReply) and reply.code == "WRONGTYPE":
        return WRONG_TYPE
    raise_unexpected(reply)


def raise_unexpected(reply: Reply) -> NoReturn:
    """An error reply raises redis-py's exception for it; anything else is out of protocol."""
    if isinstance(reply, ErrorReply):
        raise reply.exception()
    shown = f"a {reply.nbytes}-byte string" if isinstance(reply, memoryview) else repr(reply)
    raise ProtocolError(f"unexpected reply {shown[:60]}")


def denied_message(url: str, exc: rexc.RedisError) -> str:
    if isinstance(exc, rexc.AuthenticationError):
        what = "refused the credentials (wrong or missing password, or unknown ACL user)"
    else:
        what = "denied the command (the ACL user lacks a permission)"
    return f"{url} {what}: {exc}"


def reply_error(exc: rexc.RedisError) -> tuple[type[ConnectorError], str]:
    if isinstance(exc, rexc.OutOfMemoryError):
        return StorageFull, f"server out of memory ({exc})"
    if isinstance(exc, rexc.ReadOnlyError):
        return StoragePermissionError, f"server is read-only ({exc})"
    return BackendError, str(exc)


def public_url(url: str) -> str:
    """``url`` without its password (in the userinfo or a ``password=`` query argument)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
        if parts.password is not None:
            user, host = parts.username or "", netloc.rpartition("@")[2]
            netloc = f"{user}:***@{host}"
        pairs = parse_qsl(parts.query, keep_blank_values=True)
        query = urlencode([(k, "***" if k == "password" else v) for k, v in pairs], safe="*")
        return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))
    except ValueError:  # not a URL redis-py accepts either; show nothing that could leak
        return "<unparsable redis url>"


def secret_forms(password: object) -> list[str]:
    """The ways a password can show up in a message: as is and percent-encoded."""
    if not isinstance(password, str) or not password:
        return []
    forms = {password, quote(password, safe=""), quote_plus(password, safe="")}
    return sorted(forms, key=len, reverse=True)  # longest first: no partial replacements


def batches(items: Sequence[T], size: int) -> list[Sequence[T]]:
    return [items[i : i + size] for i in range(0, len(items), size)]


# --- the base class --------------------------------------------------------------------------


class _Options(Protocol):
    @property
    def url(self) -> str: ...
    @property
    def prefix(self) -> str: ...
    @property
    def ttl_seconds(self) -> int | None: ...
    @property
    def backoff_base(self) -> float: ...
    @property
    def backoff_cap(self) -> float: ...


class RedisStoreBase(StoreBase):
    """Objects as Redis string values under ``<prefix><storage id>``: what a standalone
    server and a cluster store alike. A subclass sends commands (:meth:`_run`: every
    command answered, or an error) and reads, looks up and removes in its own way."""

    def __init__(self, opts: _Options, *, name: str, rng: random.Random | None,
                 secret: bytes | None, previous_secrets: Sequence[bytes],
                 password: object) -> None:
        super().__init__(
            name=name,
            capabilities=Capabilities(
                tier="redis", persistent=True, shared=True, ttl=opts.ttl_seconds is not None
            ),
            secret=secret,
            previous_secrets=previous_secrets,
        )
        self.url = public_url(opts.url)  # for messages: the password is never shown
        self._prefix = opts.prefix.encode()
        self._ttl = opts.ttl_seconds
        self._backoff_base, self._backoff_cap = opts.backoff_base, opts.backoff_cap
        self._rng = rng or random.Random()  # jitter only; never the global random state
        self._secrets = secret_forms(password)
        self._log = logging.getLogger(type(self).__module__)

    def redis_key(self, sid: str) -> bytes:
        return self._prefix + sid.encode()

    async def _run(self, op: str, keys: list[bytes], commands: list[list[Buffer]],
                   check: Callable[[Reply], T]) -> list[T]:
        """One checked answer per command (``keys[i]`` is command i's key)."""
        raise NotImplementedError

    async def _store(
        self, items: list[tuple[str, Encoded]], *, overwrite: bool
    ) -> list[PutOutcome]:
        keys = [self.redis_key(sid) for sid, _ in items]
        encs = [finish(enc) for _, enc in items]
        written = await self._run("put", keys, self._sets(keys, encs, nx=not overwrite),
                                  reply_set)
        taken = [i for i, done in enumerate(written) if not done]
        if taken:
            redone = await self._reclaim([keys[i] for i in taken], [encs[i] for i in taken])
            for i in redone:
                written[taken[i]] = True
        # Content-addressed: a string already under the key is the same object (a damaged
        # one is caught, counted and deleted by the next get).
        self._committed([sid for (sid, _), done in zip(items, written, strict=True) if done])
        return [PutOutcome.WRITTEN if done else PutOutcome.EXISTS for done in written]

    async def _reclaim(self, keys: list[bytes], encs: list[EncodedBlock]) -> list[int]:
        """``SET NX`` found these keys taken: confirm (one cheap round trip) that each holds
        a non-empty string, and overwrite the ones that do not (a wrong type, or an empty or
        vanished value). Returns the positions written."""
        lengths = await self._run("put", keys, [[pack(b"STRLEN", k)] for k in keys],
                                  reply_strlen)
        bad = [i for i, length in enumerate(lengths) if length is WRONG_TYPE or length == 0]
        wrong = sum(1 for length in lengths if length is WRONG_TYPE)
        if wrong:
            self._stats.refused("format", wrong)
            self._log.warning("%s put: replacing %d non-string value(s)", self.name, wrong)
        if bad:
            # A plain SET replaces a value of any type, atomically: no UNLINK needed.
            bad_keys = [keys[i] for i in bad]
            await self._run("put", bad_keys,
                            self._sets(bad_keys, [encs[i] for i in bad], nx=False), reply_ok)
        return bad

    def _sets(self, keys: list[bytes], encs: list[EncodedBlock], *, nx: bool) -> list[list[Buffer]]:
        pairs = zip(keys, encs, strict=True)
        return [pack_set(k, e.parts, e.nbytes, nx=nx, ttl=self._ttl) for k, e in pairs]

    async def _drop_wrong_type(self, op: str, ids: list[str]) -> None:
        """Non-string values under our keys: count them as corrupt and remove them (a failed
        removal is counted and retried by the next call that finds them)."""
        self._stats.refused("format", len(ids))
        self._evicted(ids, "corrupt")
        self._log.warning("%s %s: removing %d non-string value(s)", self.name, op, len(ids))
        try:
            await self._remove(ids)
        except ConnectorError as exc:
            self._stats.errors += 1
            self._log.warning("%s: could not remove non-string values: %s", self.name, exc)

    def _error(self, kind: type[ConnectorError], op: str, text: str) -> ConnectorError:
        return kind(self._redact(f"{self.name} {op}: {text}"))

    def _shown(self, cause: BaseException) -> BaseException | None:
        """The cause to chain: none when its message shows a secret (tracebacks print it)."""
        return cause if self._redact(str(cause)) == str(cause) else None

    def _redact(self, text: str) -> str:
        for secret in self._secrets:
            text = text.replace(secret, "***")
        return text

    def _backoff(self, attempt: int) -> float:
        """Exponential backoff with "equal jitter": half fixed, half random."""
        cap = min(self._backoff_cap, self._backoff_base * 2.0 ** (attempt - 1))
        return cap / 2 + self._rng.uniform(0, cap / 2)
