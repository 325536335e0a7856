"""The connector protocol: async, keys and blocks only, every call bounded by a deadline.

What a caller can rely on, for every connector:

* ``lookup(keys)`` answers how many keys are present *from the start* (a prefix count);
  ``get(keys)`` returns one :class:`~kvplugin.serde.Block` or ``None`` per key, and a block is
  only ever returned after its checksums and metadata verified. A corrupt, truncated, foreign
  or misplaced object is a counted miss and is deleted.
* Reads degrade, writes report: when the backend is dead, slow or broken, ``lookup``/``get``
  return misses (0 / ``None``) within their deadline and count the failure in
  :meth:`Connector.stats`; ``put``/``delete`` raise a :class:`ConnectorError` subclass.
* Every public call takes ``timeout`` (seconds) and returns or raises within it; misuse
  (bad keys, bad timeouts, a closed connector) raises ``ValueError``/``TypeError``/
  :class:`ConnectorClosed` right away.
* Cancellation is safe: nothing half-written becomes readable and no resource leaks.
* With a ``secret`` (see :mod:`kvplugin.serde_mac`), a store seals objects with keyed MACs and
  loads only objects sealed with its secret (or a previous one it was given): an object
  forged by a writer without the secret is a counted miss like a corrupt one.

:class:`StoreBase` implements all of that over five small primitives, so a backend only
writes raw byte I/O. Connectors never import ``kvplugin.core`` or the async manager layer.
"""

from __future__ import annotations

import abc
import asyncio
import enum
import logging
import math
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import TYPE_CHECKING, Self, TypeVar

from kvplugin import serde
from kvplugin.connectors.events import DEFAULT_EVENT_LIMIT, EventLog, TierEvent
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.refusals import RefusalLog, reason_of
from kvplugin.serde import PLAIN, Block, BlockFormatError, Codec, DraftBlock, EncodedBlock

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "BackendError",
    "BackendUnavailable",
    "Capabilities",
    "CircuitBreaker",
    "CircuitOpen",
    "Connector",
    "ConnectorClosed",
    "ConnectorError",
    "ConnectorStats",
    "ConnectorTimeout",
    "Deadline",
    "Encoded",
    "Health",
    "PutItem",
    "PutOutcome",
    "StorageFull",
    "StoragePermissionError",
    "StoreBase",
    "check_items",
    "check_keys",
    "check_timeout",
    "common_codec",
    "decode_all",
    "decode_or_error",
    "encode_once",
    "finish",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
PutItem = tuple[ObjectKey, Block]
Loaded = Block | BlockFormatError | None  # what a store read: verified, damaged, or absent
# What a store writes: finished bytes, or a draft whose payload checksum the store computes
# where the bytes go out (only for stores that ask for drafts, see StoreBase._encode).
Encoded = EncodedBlock | DraftBlock


# --- errors -------------------------------------------------------------------------------


class ConnectorError(Exception):
    """A backend failed; the operation did not (fully) happen."""


class ConnectorTimeout(ConnectorError, TimeoutError):
    """The call's deadline passed before the backend answered."""


class BackendUnavailable(ConnectorError):
    """The backend cannot be reached (refused, reset, down)."""


class CircuitOpen(BackendUnavailable):
    """Failing fast: the backend failed repeatedly and is in its cool-down."""


class StorageFull(ConnectorError):
    """The backend is out of space (ENOSPC, EDQUOT, Redis OOM)."""


class StoragePermissionError(ConnectorError):
    """The backend refused access (EACCES, EPERM, EROFS, Redis NOPERM/NOAUTH)."""


class BackendError(ConnectorError):
    """Any other backend failure (I/O error, unexpected reply)."""


class ConnectorClosed(RuntimeError):
    """The connector was used after ``aclose()``: a programming error, never read as a miss."""


# --- value objects -----------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Capabilities:
    """What a connector promises. ``tier`` maps to vLLM's cache-hit sources."""

    tier: str  # "memory", "disk", "redis" or "tiered": the name every report uses
    persistent: bool  # survives a restart of this process
    shared: bool  # other processes see its objects
    atomic_put: bool = True  # an object is either fully readable or absent
    ttl: bool = False  # objects can expire on their own
    max_object_bytes: int | None = None


@dataclass(slots=True)
class ConnectorStats:
    """Plain counters; ``stats()`` returns a copy. Hit rates are derived, never stored."""

    lookups: int = 0  # lookup calls
    lookup_keys: int = 0  # keys asked about
    lookup_hits: int = 0  # keys answered present (the prefix)
    hits: int = 0  # objects returned by get
    misses: int = 0  # keys get did not return (absent, corrupt, failed)
    corrupt_detected: int = 0  # objects that failed verification (and were deleted)
    # ... of which, by reason (kvplugin.connectors.refusals.REASONS):
    corrupt_checksum: int = 0
    corrupt_metadata: int = 0
    corrupt_truncated: int = 0
    corrupt_format: int = 0
    errors: int = 0  # calls that failed in the backend
    timeouts: int = 0  # calls cut by their deadline
    stored: int = 0  # objects written
    existing: int = 0  # puts of objects already present
    rejected: int = 0  # puts refused by policy (bigger than the budget)
    dropped: int = 0  # puts reported stored but deliberately not written (fault injection)
    deleted: int = 0  # objects removed by delete()
    evicted: int = 0  # objects removed to respect a budget
    bytes_in: int = 0  # bytes of verified objects read from the backend
    bytes_out: int = 0  # bytes written to the backend

    def refused(self, reason: str, n: int = 1) -> None:
        """``n`` objects refused for ``reason`` (one of refusals.REASONS)."""
        self.corrupt_detected += n
        name = f"corrupt_{reason}"
        setattr(self, name, getattr(self, name) + n)

    def copy(self) -> ConnectorStats:
        return ConnectorStats(**{f.name: getattr(self, f.name) for f in fields(self)})

    def __add__(self, other: ConnectorStats) -> ConnectorStats:
        return ConnectorStats(
            **{f.name: getattr(self, f.name) + getattr(other, f.name) for f in fields(self)}
        )


@dataclass(frozen=True, slots=True)
class Health:
    ok: bool
    detail: str = ""
    latency_s: float | None = None


class PutOutcome(enum.Enum):
    WRITTEN = "written"
    EXISTS = "exists"
    REJECTED = "rejected"


def check_timeout(timeout: float) -> float:
    """A deadline must be a finite positive number of seconds."""
    if isinstance(timeout, bool) or not isinstance(timeout, int | float):
        raise TypeError(f"timeout must be a number of seconds, got {type(timeout).__name__}")
    if not (0 < timeout < math.inf):
        raise ValueError(f"timeout must be finite and > 0, got {timeout!r}")
    return float(timeout)


@dataclass(slots=True)
class Deadline:
    """An absolute deadline on the monotonic clock, shared by the steps of one call."""

    at: float

    @classmethod
    def after(cls, timeout: float) -> Deadline:
        return cls(time.monotonic() + check_timeout(timeout))

    def remaining(self) -> float:
        return self.at - time.monotonic()


@dataclass(slots=True)
class CircuitBreaker:
    """Closed → open after ``threshold`` consecutive failures → one half-open probe after
    ``cooldown`` seconds → closed on success, open again on failure.

    While open, calls fail fast instead of each waiting out its deadline on a dead backend.
    """

    threshold: int = 5
    cooldown: float = 1.0
    clock: Callable[[], float] = time.monotonic
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False

    @property
    def state(self) -> str:
        if self.opened_at is None:
            return "closed"
        return "half_open" if self.probing else "open"

    def acquire(self) -> bool:
        """Whether a call may go to the backend; True may make this call the probe."""
        if self.opened_at is None:
            return True
        if self.probing or self.clock() - self.opened_at < self.cooldown:
            return False
        self.probing = True
        return True

    def success(self) -> None:
        self.failures = 0
        self.opened_at = None
        self.probing = False

    def failure(self) -> None:
        self.failures += 1
        if self.probing or self.failures >= self.threshold:
            self.opened_at = self.clock()
        self.probing = False

    def release(self) -> None:
        """A call ended with neither verdict (cancelled): let another call probe."""
        self.probing = False


def encode_once(block: Block, codec: Codec) -> EncodedBlock:
    """The bytes to store for ``block`` with ``codec``, encoded at most once: bytes already
    sealed the way ``codec`` seals (e.g. verified bytes read from another tier) are reused,
    anything else (no bytes yet, or sealed with another secret or none) is encoded."""
    enc = block.encoded
    if enc is not None and enc.key_id == codec.key_id:
        return enc
    return serde.encode(block.meta, block.payload, codec)


def common_codec(conns: Sequence[Connector]) -> Codec:
    """The codec all of ``conns`` seal with (:data:`~kvplugin.serde.PLAIN` for none);
    ``ValueError`` when they differ, e.g. tiers given different secrets, or only some a
    secret: objects would then be sealed for one tier and refused by another."""
    codecs = [c.codec for c in conns]
    if any(c != codecs[0] for c in codecs[1:]):
        described = ", ".join(f"{c.name}: {c.codec!r}" for c in conns)
        raise ValueError(
            f"connectors seal objects differently ({described}); give them the same secret"
        )
    return codecs[0] if codecs else PLAIN


def finish(enc: Encoded) -> EncodedBlock:
    """The finished bytes of an object (a draft's payload is hashed here)."""
    if isinstance(enc, DraftBlock):
        return enc.seal()
    return enc


def check_keys(keys: Sequence[ObjectKey]) -> list[ObjectKey]:
    """Validate a batch of keys before any I/O (misuse must not look like a miss)."""
    if type(keys) is not list:  # the hot path passes lists; anything else is checked first
        if isinstance(keys, str | bytes) or not isinstance(keys, Sequence):
            raise TypeError(f"keys must be a sequence of ObjectKey, got {type(keys).__name__}")
        keys = list(keys)
    for key in keys:
        if type(key) is not ObjectKey and not isinstance(key, ObjectKey):
            raise TypeError(f"keys must be ObjectKey, got {type(key).__name__}")
    return keys


def check_items(items: Sequence[PutItem]) -> list[PutItem]:
    """Validate a batch of (key, block) pairs before any I/O."""
    if type(items) is not list:
        if not isinstance(items, Sequence):
            raise TypeError(
                f"items must be a sequence of (ObjectKey, Block), got {type(items).__name__}"
            )
        items = list(items)
    for key, block in items:
        if not isinstance(key, ObjectKey):
            raise TypeError(f"keys must be ObjectKey, got {type(key).__name__}")
        if not isinstance(block, Block):
            raise TypeError(f"values must be kvplugin.serde.Block, got {type(block).__name__}")
        if not key.matches(block.meta):
            raise ValueError(
                f"block metadata does not belong to key {key.id} (build it with key.meta)"
            )
    return items


def decode_or_error(
    raw: Buffer | serde.SplitObject,
    key_id: str,
    payload_digest: tuple[int, int, bytes] | None = None,
    *,
    codec: Codec,
) -> Block | BlockFormatError:
    """Decode and verify with ``codec`` (the store's: required, so that no call site can
    verify a keyed store's objects without its key); a damaged object is returned as its
    error, not raised. ``payload_digest``: see :func:`kvplugin.serde.decode`."""
    try:
        return serde.decode(raw, key=key_id, payload_digest=payload_digest, codec=codec)
    except BlockFormatError as exc:
        return exc
    except Exception as exc:
        # The decoder promises BlockFormatError for any bytes; if some input breaks that
        # promise, it is still a counted miss and the object is deleted, not a key that
        # raises on every load. Logged with the traceback: it is a decoder bug.
        logger.error("decoding object %s raised instead of rejecting it", key_id, exc_info=True)
        return BlockFormatError(f"decoder failed: {type(exc).__name__}")


def decode_all(
    keys: Sequence[ObjectKey], raws: Sequence[Buffer | None], codec: Codec
) -> list[Loaded]:
    """:func:`decode_or_error` for each stored object, ``None`` where nothing was stored."""
    pairs = zip(keys, raws, strict=True)
    return [None if raw is None else decode_or_error(raw, k.id, codec=codec) for k, raw in pairs]


def _ids(keys: Sequence[ObjectKey]) -> list[str]:
    return [key.id for key in check_keys(keys)]


# --- the protocol ------------------------------------------------------------------------


class Connector(abc.ABC):
    """The async connector protocol. Use as ``async with``; always ``aclose()``."""

    name: str
    capabilities: Capabilities
    _event_log: EventLog | None = None  # set by watch_events

    def watch_events(self, limit: int = DEFAULT_EVENT_LIMIT) -> None:
        """Record this tier's events from now on (:mod:`kvplugin.connectors.events`): objects
        stored, removed (evicted, deleted, corrupt, found gone), the tier cleared. Idempotent; at
        most ``limit`` held between two :meth:`take_events`. A composite watches its tiers;
        a connector that records nothing (a third-party one) returns no events."""
        if self._event_log is None:
            self._event_log = EventLog(self.name, limit)

    def take_events(self) -> list[TierEvent]:
        """The events recorded since the last call, oldest first."""
        return [] if self._event_log is None else self._event_log.take()

    @property
    def reports_objects(self) -> bool:
        """Whether, once watched, :meth:`take_events` reports every object this process
        stores in it and every one it evicts, deletes or finds gone (a shared store's other
        writers and a TTL's expiries excepted). False by default: a connector that records
        nothing. Byte quotas count what such a tier holds from its events, and what a tier
        that does not report was written."""
        return False

    @property
    def codec(self) -> Codec:
        """How this connector seals and verifies objects (:class:`kvplugin.serde.Codec`).

        A store has its own, from its secret (see :class:`StoreBase`); a connector built on
        others (tiered, a fault injector) answers theirs, which must agree
        (:func:`common_codec`). A third-party connector without a secret keeps this default."""
        return PLAIN

    @abc.abstractmethod
    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        """How many of ``keys`` are present, counted from the first; 0 on failure."""

    @abc.abstractmethod
    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        """Verified blocks (payloads are zero-copy views), ``None`` for every miss."""

    @property
    def levels(self) -> Sequence[Connector]:
        """The tiers behind this connector, fastest first, each known by its ``name``: the
        connector itself for a plain one (a composite lists its tiers)."""
        return (self,)

    async def lookup_levels(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[int]:
        """:meth:`lookup`, saying where: per key present from the first, the level (index
        in :attr:`levels`) its ``get`` reads it from; as long as ``lookup``'s count."""
        return [0] * await self.lookup(keys, timeout=timeout)

    async def get_located(self, keys: Sequence[ObjectKey], *, timeout: float
                          ) -> tuple[list[Block | None], list[int]]:
        """:meth:`get`, saying where each block came from: per key the level of the tier
        that served it (its index in :attr:`levels`), -1 for a miss."""
        blocks = await self.get(keys, timeout=timeout)
        return blocks, [-1 if b is None else 0 for b in blocks]

    @abc.abstractmethod
    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        """Store objects that are not yet present; returns how many are present now.

        Each object is written atomically, so a failed or cancelled batch leaves some
        objects fully stored and the rest absent. The payloads must stay unchanged until
        the call returns; once it has returned, by any path (done, deadline, cancellation,
        error), no later change to them can reach storage as a valid object (an object
        whose write was under way lands with the bytes of the call, or not at all).
        """

    async def put_per_tier(self, items: Sequence[PutItem], *, timeout: float
                           ) -> list[int | None]:
        """:meth:`put`, saying what each tier ended with: per tier (fastest first, as a
        composite lists them in ``tiers``) how many of the objects are present there now,
        None where that tier's write failed. A plain connector is one tier, and a failure
        raises as ``put`` does; a composite raises only when every tier failed."""
        return [await self.put(items, timeout=timeout)]

    @abc.abstractmethod
    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        """Remove objects; returns how many were present."""

    @abc.abstractmethod
    async def health(self, *, timeout: float) -> Health:
        """A liveness probe; never raises for backend trouble."""

    @abc.abstractmethod
    def stats(self) -> ConnectorStats:
        """A snapshot of the counters."""

    @abc.abstractmethod
    async def aclose(self) -> None:
        """Release every resource; idempotent. Later calls raise :class:`ConnectorClosed`."""

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.aclose()


class Guarded:
    """Deadline and failure bookkeeping shared by every connector implementation."""

    name: str
    _stats: ConnectorStats
    _closed: bool

    def _check_open(self) -> None:
        if self._closed:
            raise ConnectorClosed(f"connector {self.name!r} is closed")

    def _on_deadline(self) -> None:
        """Hook: a call ran out of time (backends with a circuit breaker count it)."""

    async def _read(
        self, op: str, aw: Awaitable[T], timeout: float, miss: T, *, misses: int = 0
    ) -> T:
        """Run a read under its deadline; any backend failure becomes ``miss``
        (and counts ``misses`` keys as missed)."""
        try:
            async with asyncio.timeout(timeout):
                return await aw
        except ConnectorError as exc:
            self._stats.errors += 1
            logger.debug("%s %s failed, answering a miss: %s", self.name, op, exc)
        except TimeoutError:
            self._stats.timeouts += 1
            self._on_deadline()
            logger.debug(
                "%s %s: deadline of %.3fs passed, answering a miss", self.name, op, timeout
            )
        self._stats.misses += misses
        return miss

    async def _write(self, op: str, aw: Awaitable[T], timeout: float) -> T:
        """Run a write under its deadline; failures raise :class:`ConnectorError`."""
        try:
            async with asyncio.timeout(timeout):
                return await aw
        except ConnectorError:
            self._stats.errors += 1
            raise
        except TimeoutError:
            self._stats.timeouts += 1
            self._on_deadline()
            raise ConnectorTimeout(f"{self.name} {op}: no answer within {timeout:.3f}s") from None


class StoreBase(Guarded, Connector):
    """A connector over five raw primitives; subclasses do byte I/O only.

    The primitives receive validated storage ids (96 hex chars) and may raise only
    :class:`ConnectorError` subclasses for backend trouble.
    """

    # A tier that evicts by itself tells an EXISTS answer as it gives it (_committed): told
    # after the batch, it could follow the eviction of that object by a later item.
    tells_existing = False

    @property
    def reports_objects(self) -> bool:
        return True  # every write, eviction, delete and drop goes through the event log

    def __init__(
        self,
        *,
        name: str,
        capabilities: Capabilities,
        secret: bytes | None = None,
        previous_secrets: Sequence[bytes] = (),
    ) -> None:
        """``secret`` (at least 16 bytes) seals objects with keyed MACs; objects without a
        valid MAC under it, or under one of ``previous_secrets`` (key rotation: accepted on
        load, never used to write), are refused. Without it, objects use xxh3 checksums as
        they always did, and MAC'd objects are refused (they cannot be verified). Only keys
        derived from the secrets are kept, and they never appear in a repr or a log."""
        self.name = name
        self.capabilities = capabilities
        self._codec = Codec.create(secret, previous_secrets)
        self._stats = ConnectorStats()
        self._refusals = RefusalLog(logger)
        self._closed = False

    @property
    def codec(self) -> Codec:
        return self._codec

    # primitives ---------------------------------------------------------------------------

    @abc.abstractmethod
    async def _prefix_present(self, ids: list[str]) -> int:
        """How many ids are present from the start."""

    @abc.abstractmethod
    async def _fetch(self, ids: list[str]) -> list[Buffer | None]:
        """The stored bytes (unverified) or ``None`` per id."""

    async def _load(self, keys: list[ObjectKey]) -> list[Loaded]:
        """Fetch and decode. A store may override it to decode where the bytes land
        (the disk store verifies on its I/O thread, next to the read)."""
        return decode_all(keys, await self._fetch([k.id for k in keys]), self._codec)

    def _load_now(self, keys: list[ObjectKey]) -> tuple[list[Loaded], Sequence[int]]:
        """Serve what can be served without waiting, on the loop and before the deadline
        starts (memory, or the page cache): the loaded items (``None`` where not served) and
        the positions left for :meth:`_load`. Must not block and must not raise for
        backend trouble."""
        return [None] * len(keys), range(len(keys))

    def _encode(self, block: Block) -> Encoded:
        """What :meth:`put` hands to :meth:`_store` for ``block``. A store that can hash the
        payload where it writes it (off the event loop) returns a draft; see :func:`finish`."""
        return encode_once(block, self._codec)

    @abc.abstractmethod
    async def _store(
        self, items: list[tuple[str, Encoded]], *, overwrite: bool
    ) -> list[PutOutcome]:
        """Write each object atomically; without ``overwrite``, keep existing ones."""

    @abc.abstractmethod
    async def _remove(self, ids: list[str]) -> int:
        """Delete; returns how many existed."""

    @abc.abstractmethod
    async def _ping(self) -> None:
        """Raise a :class:`ConnectorError` when the backend is not usable."""

    async def _close(self) -> None:
        """Release backend resources."""

    # public API -----------------------------------------------------------------------------

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        self._check_open()
        ids = _ids(keys)
        timeout = check_timeout(timeout)
        if not ids:
            return 0
        n = await self._read("lookup", self._present(ids), timeout, 0)
        self._stats.lookups += 1
        self._stats.lookup_keys += len(ids)
        self._stats.lookup_hits += n
        return n

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        self._check_open()
        keys = check_keys(keys)
        timeout = check_timeout(timeout)
        deadline = Deadline(time.monotonic() + timeout)
        if not keys:
            return []
        loaded, rest = self._load_now(keys)
        if rest:
            sub = [keys[i] for i in rest]
            misses: list[Loaded] = [None] * len(sub)
            more = await self._read("get", self._load_seen(sub), timeout, misses)
            for i, item in zip(rest, more, strict=True):
                loaded[i] = item
        corrupt: list[str] = []
        out = [self._accept(key, item, corrupt) for key, item in zip(keys, loaded, strict=True)]
        if corrupt:
            await self._drop_corrupt(corrupt, deadline)
        return out

    async def _present(self, ids: list[str]) -> int:
        n = await self._prefix_present(ids)
        if n < len(ids) and self._event_log is not None and self.capabilities.shared:
            # A shared tier answered that a key is not there: if this process stored it,
            # the tier's own eviction or TTL (or another writer) removed it.
            self._event_log.removed((ids[n],), "gone")
        return n

    async def _load_seen(self, keys: list[ObjectKey]) -> list[Loaded]:
        loaded = await self._load(keys)
        if self._event_log is not None and self.capabilities.shared:
            self._event_log.removed([k.id for k, item in zip(keys, loaded, strict=True)
                                     if item is None], "gone")
        return loaded

    def _accept(self, key: ObjectKey, item: Loaded, corrupt: list[str]) -> Block | None:
        if isinstance(item, Block) and not key.matches(item.meta):
            item = serde.MetadataMismatch("namespace fields differ from the key's")
        if isinstance(item, BlockFormatError):
            reason = reason_of(item)
            self._stats.refused(reason)
            corrupt.append(key.id)
            self._refusals.refused(self.name, key.id, reason, item)
            item = None
        if item is None:
            self._stats.misses += 1
            return None
        self._stats.hits += 1
        if item.encoded is not None:
            self._stats.bytes_in += item.encoded.nbytes
        return item

    async def _drop_corrupt(self, ids: list[str], deadline: Deadline) -> None:
        """Delete objects that failed verification, within what is left of the deadline.

        With no time left the delete is skipped rather than overrunning the caller's
        deadline: the object is never returned, and the next load that meets it drops it."""
        if self._event_log is not None:  # never returned again, whether or not deleted now
            self._event_log.removed(ids, "corrupt")
        budget = deadline.remaining()
        if budget <= 0:
            logger.info("%s: no time left to delete %d corrupt object(s)", self.name, len(ids))
            return
        try:
            async with asyncio.timeout(budget):
                await self._remove(ids)
        except (TimeoutError, ConnectorError) as exc:
            self._stats.errors += 1
            logger.warning(
                "%s: could not delete %d corrupt object(s): %r", self.name, len(ids), exc
            )

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        self._check_open()
        timeout = check_timeout(timeout)
        # Encoded here, on the event loop (encoding on the disk I/O threads measured slower:
        # GIL hand-offs); only the payload checksum, which releases the GIL, may be left to
        # the store (see _encode).
        batch = [(k.id, self._encode(b)) for k, b in check_items(items)]
        if not batch:
            return 0
        outcomes = await self._write("put", self._store(batch, overwrite=False), timeout)
        return self._count_puts(batch, outcomes)

    def _count_puts(self, batch: list[tuple[str, Encoded]], outcomes: list[PutOutcome]) -> int:
        present = 0
        if self._event_log is not None and not self.tells_existing:
            # Writes were told as they landed (see _committed); objects already there now.
            self._event_log.stored([sid for (sid, _), outcome in zip(batch, outcomes, strict=True)
                                    if outcome is PutOutcome.EXISTS])
        for (_, enc), outcome in zip(batch, outcomes, strict=True):
            if outcome is PutOutcome.WRITTEN:
                self._stats.stored += 1
                self._stats.bytes_out += enc.nbytes
                present += 1
            elif outcome is PutOutcome.EXISTS:
                self._stats.existing += 1
                present += 1
            else:
                self._stats.rejected += 1
        return present

    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        self._check_open()
        ids = _ids(keys)
        timeout = check_timeout(timeout)
        if not ids:
            return 0
        if self._event_log is not None:
            # Told first: a delete cut short may still remove them (a router that believes
            # too little routes worse; one that believes too much routes to a miss).
            self._event_log.removed(ids, "deleted")
        n = await self._write("delete", self._remove(ids), timeout)
        self._stats.deleted += n
        return n

    async def health(self, *, timeout: float) -> Health:
        self._check_open()
        timeout = check_timeout(timeout)
        start = time.monotonic()
        try:
            async with asyncio.timeout(timeout):
                await self._ping()
        except TimeoutError:
            return Health(False, f"no answer within {timeout:.3f}s")
        except ConnectorError as exc:
            return Health(False, f"{type(exc).__name__}: {exc}")
        return Health(True, "ok", time.monotonic() - start)

    def stats(self) -> ConnectorStats:
        return self._stats.copy()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._refusals.flush(self.name)  # what the last interval held back
        await self._close()
        if self._event_log is not None:  # nothing of it is reachable through us any more
            self._event_log.cleared("closed")

    def _committed(self, ids: Sequence[str]) -> None:
        """Objects a write just made present (told at once: a caller that stopped waiting
        does not stop a write that lands)."""
        if self._event_log is not None:
            self._event_log.stored(ids)

    def _evicted(self, ids: Sequence[str], reason: str = "evicted") -> None:
        if self._event_log is not None:
            self._event_log.removed(ids, reason)

    # raw access (tooling, migration, fault tests) --------------------------------------------

    async def read_raw(self, key: ObjectKey, *, timeout: float) -> bytes | None:
        """The stored bytes of one object, NOT verified. For tools and tests."""
        self._check_open()
        (sid,) = _ids([key])
        raws = await self._write("read_raw", self._fetch([sid]), check_timeout(timeout))
        return None if raws[0] is None else bytes(raws[0])

    async def write_raw(self, key: ObjectKey, data: Buffer, *, timeout: float) -> None:
        """Store arbitrary bytes under ``key``, replacing what is there. For tools and tests."""
        self._check_open()
        (sid,) = _ids([key])
        view = memoryview(data)
        enc = EncodedBlock((view,), view.nbytes)
        await self._write(
            "write_raw", self._store([(sid, enc)], overwrite=True), check_timeout(timeout)
        )
