"""What the Redis and Redis Cluster connectors share: which errors are transient or a
refusal, the checks of each command's reply, and how URLs and passwords are kept out of
messages."""

from __future__ import annotations

import enum
from collections.abc import Callable, Sequence
from typing import NoReturn
from urllib.parse import parse_qsl, quote, quote_plus, urlencode, urlsplit, urlunsplit

import redis.exceptions as rexc

from connectors.base import BackendError, ConnectorError, StorageFull, StoragePermissionError
from connectors.resp import ErrorReply, ProtocolError, Reply

__all__ = ["DENIED", "TRANSIENT", "WRONG_TYPE", "Wrong", "batches", "denied_message",
           "public_url", "raise_unexpected", "reply_count", "reply_error", "reply_ok",
           "reply_pong", "reply_set", "reply_strlen", "reply_value", "reply_wrong_type",
           "secret_forms"]

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


def batches(ids: Sequence[str], size: int) -> list[Sequence[str]]:
    return [ids[i : i + size] for i in range(0, len(ids), size)]
