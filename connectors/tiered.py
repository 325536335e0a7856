"""Tiered connector: e.g. memory → disk → Redis, write-through, hits promoted upwards.

* ``put`` writes every tier concurrently (write-through) and succeeds when at least one tier
  stored the objects; a tier that fails is counted (by the tier) and logged, not fatal.
* ``get`` asks the tiers top-down for what is still missing; each tier verifies its own
  objects (and deletes its own corrupt ones), so a bad copy in one tier falls through to
  the next. Hits from a lower tier are copied to every tier above it in the background,
  reusing the verified bytes (no re-encoding); :meth:`TieredConnector.drain` waits for them.
* ``lookup`` counts the prefix present in the *union* of the tiers; ``lookup_levels`` says
  which tier each key of it is read from (the one rule of the union, for every caller).
* ``delete`` sticks: once it returns, no read or promotion that overlapped it brings the
  object back (see :meth:`TieredConnector.delete`). It raises when any tier could not
  delete, even if the others did, because that tier may still hold the object; a retry is
  safe.

Promotions are best effort: at most ``max_promotions`` batches are in flight (the extra are
dropped and counted in ``promotions_dropped``), a key already being promoted is not promoted
twice, and a tier is skipped for objects bigger than its ``max_object_bytes``.

A tier's backend trouble never leaves a public call as anything but what the protocol
allows (a miss, an unhealthy report, a :class:`~kvplugin.connectors.base.ConnectorError`); any other
exception from a tier (misuse, a bug) propagates, after every tier's call has ended.

The tiered connector owns its tiers: ``aclose()`` closes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeVar

from kvplugin.connectors.base import (
    Capabilities,
    Connector,
    ConnectorError,
    ConnectorStats,
    ConnectorTimeout,
    Deadline,
    Guarded,
    Health,
    PutItem,
    check_items,
    check_keys,
    check_timeout,
    common_codec,
    encode_once,
)
from kvplugin.connectors.events import DEFAULT_EVENT_LIMIT, TierEvent
from kvplugin.connectors.keys import ObjectKey
from kvplugin.serde import Block, Codec

__all__ = ["TieredConnector"]

logger = logging.getLogger(__name__)
T = TypeVar("T")


@dataclass(eq=False, slots=True)
class _Read:
    """One ``get`` in flight: the ids of keys a delete touched while it ran. Such a key is
    never promoted by this get, since what it read may predate the delete."""

    tombstones: set[str]


@dataclass(frozen=True, slots=True)
class _Promotion:
    ids: frozenset[str]
    level: int  # the tier the objects were read from; they are copied to every tier above


@dataclass(slots=True)
class _Answer:
    """What one ``get`` found. Counted only once complete: a cancelled get counts nothing,
    so ``hits_by_tier`` always sums to the ``hits`` of :meth:`TieredConnector.stats`."""

    blocks: list[Block | None]
    by_tier: list[int]
    levels: list[int]  # per key, the level that served it (-1: a miss)
    timed_out: bool = False


class TieredConnector(Guarded, Connector):
    def __init__(
        self,
        tiers: Sequence[Connector],
        *,
        promote: bool = True,
        promote_timeout: float = 5.0,
        max_promotions: int = 64,
        name: str = "tiered",
    ) -> None:
        if not tiers:
            raise ValueError("a tiered connector needs at least one tier")
        if type(max_promotions) is not int or max_promotions <= 0:
            raise ValueError(f"max_promotions must be a positive int, got {max_promotions!r}")
        self.tiers = list(tiers)
        names = [t.name for t in self.tiers]
        if len(set(names)) != len(names):  # a tier's name is its identity in every report
            raise ValueError(f"the tiers of a tiered connector need distinct names, got "
                             f"{names}")
        self.name = name
        # Refused here, not at the first put: tiers that seal with different secrets could
        # never promote or write through the same bytes.
        self._codec = common_codec(self.tiers)
        self.promote = promote
        self.promote_timeout = check_timeout(promote_timeout)
        self.max_promotions = max_promotions
        self.capabilities = Capabilities(
            tier="tiered",
            persistent=any(t.capabilities.persistent for t in self.tiers),
            shared=any(t.capabilities.shared for t in self.tiers),
            ttl=any(t.capabilities.ttl for t in self.tiers),
        )
        self._stats = ConnectorStats()
        self._closed = False
        self.hits_by_tier = [0] * len(self.tiers)
        self.promotions_dropped = 0  # objects not promoted because max_promotions was reached
        self._promotions: dict[asyncio.Task[None], _Promotion] = {}
        # Key id -> the in-flight promotion copying it from the lowest tier (an optimisation
        # only: delete() relies on _promotions, never on this).
        self._promoting: dict[str, _Promotion] = {}
        self._reads: set[_Read] = set()
        self._deleting: dict[str, int] = {}  # key id -> deletes of it in progress

    @property
    def codec(self) -> Codec:
        return self._codec

    def watch_events(self, limit: int = DEFAULT_EVENT_LIMIT) -> None:
        for tier in self.tiers:  # each tier tells what it holds, under its own name
            tier.watch_events(limit)

    def take_events(self) -> list[TierEvent]:
        return [e for tier in self.tiers for e in tier.take_events()]

    @property
    def reports_objects(self) -> bool:
        return all(tier.reports_objects for tier in self.tiers)

    @property
    def levels(self) -> Sequence[Connector]:
        return self.tiers

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        return len(await self.lookup_levels(keys, timeout=timeout))

    async def lookup_levels(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[int]:
        """The union of the tiers, and per key the tier ``get`` reads it from.

        Key i may live only on disk and key i+1 only in Redis: at each position the tiers
        are asked top-down, the first that extends the prefix claiming its run (``get``
        asks top-down too, so that is where the object comes from), until none does."""
        self._check_open()
        keys = check_keys(keys)
        deadline = Deadline.after(timeout)
        levels: list[int] = []
        while len(levels) < len(keys):
            run = await self._first_holding(keys[len(levels):], deadline)
            if run is None:
                break
            level, found = run
            levels.extend([level] * found)
        self._stats.lookups += 1
        self._stats.lookup_keys += len(keys)
        self._stats.lookup_hits += len(levels)
        return levels

    async def _first_holding(self, keys: list[ObjectKey], deadline: Deadline
                             ) -> tuple[int, int] | None:
        """The first tier, top-down, holding ``keys[0]``: its level and how many keys on
        it holds (None: no tier, or no time left)."""
        for level, tier in enumerate(self.tiers):
            remaining = deadline.remaining()
            if remaining <= 0:
                self._stats.timeouts += 1
                return None
            found = await self._tier_read(tier, "lookup", keys, remaining, 0)
            if found:
                return level, found
        return None

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        return (await self.get_located(keys, timeout=timeout))[0]

    async def get_located(self, keys: Sequence[ObjectKey], *, timeout: float
                          ) -> tuple[list[Block | None], list[int]]:
        self._check_open()
        keys = check_keys(keys)
        deadline = Deadline.after(timeout)
        # Deletes already running count as tombstones too: this get may reach a lower tier
        # before their delete does there, and promote into a tier they have already cleared.
        read = _Read(set(self._deleting))
        self._reads.add(read)
        try:
            answer = await self._get(keys, deadline, read)
        finally:
            self._reads.discard(read)
        for level, n in enumerate(answer.by_tier):
            self.hits_by_tier[level] += n
        hits = sum(answer.by_tier)
        self._stats.hits += hits
        self._stats.misses += len(keys) - hits
        if answer.timed_out:
            self._stats.timeouts += 1
        return answer.blocks, answer.levels

    async def _get(self, keys: list[ObjectKey], deadline: Deadline, read: _Read) -> _Answer:
        answer = _Answer([None] * len(keys), [0] * len(self.tiers), [-1] * len(keys))
        missing = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            if not missing:
                break
            remaining = deadline.remaining()
            if remaining <= 0:
                answer.timed_out = True
                break
            asked = [keys[i] for i in missing]
            blocks = await self._tier_read(tier, "get", asked, remaining, [None] * len(asked))
            found: list[PutItem] = []
            for i, block in zip(missing, blocks, strict=True):
                if block is not None:
                    answer.blocks[i] = block
                    answer.levels[i] = level
                    found.append((keys[i], block))
            answer.by_tier[level] = len(found)
            if found and level and self.promote:
                self._promote(found, level, read)
            missing = [i for i in missing if answer.blocks[i] is None]
        return answer

    async def _tier_read(
        self, tier: Connector, op: str, keys: list[ObjectKey], timeout: float, miss: T
    ) -> T:
        """``tier.get``/``tier.lookup``. A tier answers misses for backend trouble itself;
        one that raises a ConnectorError anyway is read as missing everything, so that this
        read still degrades instead of failing. Anything else (misuse, a bug) propagates."""
        try:
            result: T = await getattr(tier, op)(keys, timeout=timeout)
        except ConnectorError as exc:
            self._stats.errors += 1
            logger.warning("%s: %s on %s raised, read as a miss: %r", self.name, op, tier.name, exc)
            return miss
        return result

    # promotion -------------------------------------------------------------------------------

    def _promote(self, found: list[PutItem], level: int, read: _Read) -> None:
        """Copy lower-tier hits to the tiers above ``level``, in the background."""
        items = [
            (key, block)
            for key, block in found
            if key.id not in read.tombstones
            and self._promoting_from(key.id) < level
            # Only the verified bytes are copied: re-encoding the payload, which the caller
            # holds and may change once get returns, could store a changed payload as valid.
            and block.encoded is not None
        ]
        if not items or self._closed:  # aclose() has stopped the promotions for good
            return
        if len(self._promotions) >= self.max_promotions:
            # A flood of lower-tier hits must not pile up tasks; a later hit promotes again.
            self.promotions_dropped += len(items)
            return
        promotion = _Promotion(frozenset(key.id for key, _ in items), level)
        task = asyncio.ensure_future(self._promote_now(items, self.tiers[:level]))
        self._promotions[task] = promotion
        for sid in promotion.ids:
            self._promoting[sid] = promotion
        task.add_done_callback(self._promoted)

    def _promoting_from(self, sid: str) -> int:
        """The level an in-flight promotion copies ``sid`` from; 0 for none (it copies to
        the same tiers or more, so a hit at that level or above needs no promotion)."""
        promotion = self._promoting.get(sid)
        return 0 if promotion is None else promotion.level

    def _promoted(self, task: asyncio.Task[None]) -> None:
        promotion = self._promotions.pop(task)
        for sid in promotion.ids:
            # A promotion from a lower tier may have taken the key over: leave it that one.
            if self._promoting.get(sid) is promotion:
                del self._promoting[sid]

    async def _promote_now(self, items: list[PutItem], upper: list[Connector]) -> None:
        for tier in upper:
            # A delete in progress waits for this promotion: do not copy what it removes.
            batch = [(k, b) for k, b in items if k.id not in self._deleting and _fits(tier, b)]
            if not batch:
                continue
            try:
                await tier.put(batch, timeout=self.promote_timeout)
            except ConnectorError as exc:  # counted by the tier itself
                logger.info("%s: promotion to %s failed: %s", self.name, tier.name, exc)
            except Exception:  # a bug in the tier: nobody awaits this task to see it raise
                logger.exception("%s: promotion to %s raised", self.name, tier.name)

    async def _stop_promotions(self) -> None:
        tasks = list(self._promotions)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def drain(self) -> None:
        """Wait until the background promotions started so far have finished."""
        while self._promotions:
            await asyncio.wait(list(self._promotions))

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        counts = await self.put_per_tier(items, timeout=timeout)
        return max((n for n in counts if n is not None), default=0)

    async def put_per_tier(self, items: Sequence[PutItem], *, timeout: float
                           ) -> list[int | None]:
        """Write through every tier at once; per tier, the objects present there now (None:
        that tier failed, counted in its errors). Raises only when every tier failed."""
        self._check_open()
        timeout = check_timeout(timeout)
        # Encode once for all tiers; each tier stores the same bytes (and counts its errors).
        codec = self._codec
        ready = [
            (k, Block(b.meta, b.payload, encode_once(b, codec))) for k, b in check_items(items)
        ]
        if not ready:
            return [0] * len(self.tiers)
        results = await asyncio.gather(
            *(t.put(ready, timeout=timeout) for t in self.tiers), return_exceptions=True
        )
        failures = self._failures("write-through", results)
        counts = [r if isinstance(r, int) else None for r in results]
        if any(n is not None for n in counts):
            return counts
        raise failures[0]

    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        """Remove the objects from every tier. Once this returns, no get or promotion that
        overlapped it brings them back:

        * every get in flight, and every get starting before this returns, gets the ids as
          tombstones and never promotes them (what it read may predate the delete);
        * promotions already started that copy any of them are waited for before the tiers
          delete (not cancelled: a cancelled write to a remote tier may still land after
          our delete); when they outlast the deadline this raises ConnectorTimeout.

        Raises when any tier failed, even if the others deleted their copies: the failed
        tier may still hold the objects. Deleting again is safe."""
        self._check_open()
        keys = check_keys(keys)
        deadline = Deadline.after(timeout)
        ids = [key.id for key in keys]
        self._tombstone(ids)
        try:
            await self._settle_promotions(frozenset(ids), deadline)
            remaining = self._remaining(deadline, "delete")
            results = await asyncio.gather(
                *(t.delete(keys, timeout=remaining) for t in self.tiers), return_exceptions=True
            )
        finally:
            self._untombstone(ids)
        failures = self._failures("delete", results)
        if failures:
            raise failures[0]
        counts = [r for r in results if isinstance(r, int)]
        self._stats.deleted += max(counts)
        return max(counts)

    def _tombstone(self, ids: list[str]) -> None:
        for sid in ids:
            self._deleting[sid] = self._deleting.get(sid, 0) + 1
        for read in self._reads:
            read.tombstones.update(ids)

    def _untombstone(self, ids: list[str]) -> None:
        for sid in ids:
            left = self._deleting[sid] - 1
            if left:
                self._deleting[sid] = left
            else:
                del self._deleting[sid]

    async def _settle_promotions(self, ids: frozenset[str], deadline: Deadline) -> None:
        """Wait for the promotions in flight that copy any of ``ids``."""
        tasks = [t for t, p in self._promotions.items() if not p.ids.isdisjoint(ids)]
        if not tasks:
            return
        _, pending = await asyncio.wait(tasks, timeout=max(deadline.remaining(), 0.0))
        if pending:
            self._stats.timeouts += 1
            raise ConnectorTimeout(
                f"{self.name} delete: {len(pending)} promotion(s) of these objects still "
                "running at the deadline"
            )

    def _remaining(self, deadline: Deadline, op: str) -> float:
        remaining = deadline.remaining()
        if remaining <= 0:
            self._stats.timeouts += 1
            raise ConnectorTimeout(f"{self.name} {op}: the deadline passed")
        return remaining

    def _failures(self, op: str, results: Sequence[object]) -> list[ConnectorError]:
        """The tiers' backend failures, logged. Any other exception (misuse, a bug) is
        raised, ahead of the backend failures, so that none hides it."""
        failures: list[ConnectorError] = []
        for res in results:
            if isinstance(res, BaseException) and not isinstance(res, ConnectorError):
                raise res
        for tier, res in zip(self.tiers, results, strict=True):
            if isinstance(res, ConnectorError):
                logger.info("%s: %s on %s failed: %s", self.name, op, tier.name, res)
                failures.append(res)
        return failures

    async def health(self, *, timeout: float) -> Health:
        self._check_open()
        timeout = check_timeout(timeout)
        results = await asyncio.gather(
            *(t.health(timeout=timeout) for t in self.tiers), return_exceptions=True
        )
        self._failures("health", results)  # a tier reporting trouble by raising is unhealthy
        reports = [h if isinstance(h, Health) else _unhealthy(h) for h in results]
        detail = "; ".join(
            f"{t.name}: {'ok' if h.ok else h.detail}"
            for t, h in zip(self.tiers, reports, strict=True)
        )
        return Health(all(h.ok for h in reports), detail)

    def stats(self) -> ConnectorStats:
        """Tiered hits/misses/lookups plus the tiers' storage-level counters summed."""
        own = self._stats.copy()
        total = ConnectorStats()
        for tier in self.tiers:
            total = total + tier.stats()
        for name in (
            "corrupt_detected",
            "corrupt_checksum",
            "corrupt_metadata",
            "corrupt_truncated",
            "corrupt_format",
            "stored",
            "existing",
            "rejected",
            "dropped",
            "evicted",
            "bytes_in",
            "bytes_out",
        ):
            setattr(own, name, getattr(total, name))
        own.errors += total.errors
        own.timeouts += total.timeouts
        return own

    def tier_stats(self) -> list[ConnectorStats]:
        return [t.stats() for t in self.tiers]

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        await self._stop_promotions()
        for tier in self.tiers:
            await tier.aclose()


def _fits(tier: Connector, block: Block) -> bool:
    """Whether ``tier`` can hold ``block`` (a promotion it must reject is not attempted)."""
    limit = tier.capabilities.max_object_bytes
    return limit is None or block.encoded is None or block.encoded.nbytes <= limit


def _unhealthy(exc: BaseException) -> Health:
    return Health(False, f"{type(exc).__name__}: {exc}")
