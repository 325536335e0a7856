"""Tiered connector: e.g. memory → disk → Redis, write-through, hits promoted upwards.

* ``put`` writes every tier concurrently (write-through) and succeeds when at least one tier
  stored the objects; a tier that fails is counted (by the tier) and logged, not fatal.
* ``get`` asks the tiers top-down for what is still missing; each tier verifies its own
  objects (and deletes its own corrupt ones), so a bad copy in one tier falls through to
  the next. Hits from a lower tier are copied to every tier above it in the background,
  reusing the verified bytes (no re-encoding); :meth:`TieredConnector.drain` waits for them.
* ``lookup`` counts the prefix present in the *union* of the tiers.

The tiered connector owns its tiers: ``aclose()`` closes them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

from connectors.base import (
    Capabilities,
    Connector,
    ConnectorError,
    ConnectorStats,
    Deadline,
    Guarded,
    Health,
    PutItem,
    check_items,
    check_keys,
    check_timeout,
    encode_once,
)
from connectors.keys import ObjectKey
from kvplugin.serde import Block

__all__ = ["TieredConnector"]

logger = logging.getLogger(__name__)


class TieredConnector(Guarded, Connector):
    def __init__(
        self,
        tiers: Sequence[Connector],
        *,
        promote: bool = True,
        promote_timeout: float = 5.0,
        name: str = "tiered",
    ) -> None:
        if not tiers:
            raise ValueError("a tiered connector needs at least one tier")
        self.tiers = list(tiers)
        self.name = name
        self.promote = promote
        self.promote_timeout = check_timeout(promote_timeout)
        self.capabilities = Capabilities(
            tier="tiered",
            persistent=any(t.capabilities.persistent for t in self.tiers),
            shared=any(t.capabilities.shared for t in self.tiers),
            ttl=any(t.capabilities.ttl for t in self.tiers),
        )
        self._stats = ConnectorStats()
        self._closed = False
        self.hits_by_tier = [0] * len(self.tiers)
        self._promotions: set[asyncio.Task[None]] = set()

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        self._check_open()
        keys = check_keys(keys)
        deadline = Deadline.after(timeout)
        n = 0
        # Key i may live only on disk and key i+1 only in Redis: go round the tiers from the
        # first key nobody had yet, until every tier in a row fails to extend the prefix.
        stalled = 0
        turn = 0
        while n < len(keys) and stalled < len(self.tiers):
            remaining = deadline.remaining()
            if remaining <= 0:
                self._stats.timeouts += 1
                break
            tier = self.tiers[turn % len(self.tiers)]
            turn += 1
            found = await tier.lookup(keys[n:], timeout=remaining)
            n += found
            # A tier that answered stopped at a key it lacks: it is stalled at the new start.
            stalled = 1 if found else stalled + 1
        self._stats.lookups += 1
        self._stats.lookup_keys += len(keys)
        self._stats.lookup_hits += n
        return n

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        self._check_open()
        keys = check_keys(keys)
        deadline = Deadline.after(timeout)
        out: list[Block | None] = [None] * len(keys)
        missing = list(range(len(keys)))
        for level, tier in enumerate(self.tiers):
            remaining = deadline.remaining()
            if not missing or remaining <= 0:
                break
            blocks = await tier.get([keys[i] for i in missing], timeout=remaining)
            found = [(keys[i], b) for i, b in zip(missing, blocks, strict=True) if b is not None]
            for i, block in zip(missing, blocks, strict=True):
                out[i] = block
            self.hits_by_tier[level] += len(found)
            if found and level and self.promote:
                self._promote(found, self.tiers[:level])
            missing = [i for i in missing if out[i] is None]
        self._stats.hits += len(keys) - len(missing)
        self._stats.misses += len(missing)
        return out

    def _promote(self, items: list[PutItem], upper: list[Connector]) -> None:
        task = asyncio.ensure_future(self._promote_now(items, upper))
        self._promotions.add(task)
        task.add_done_callback(self._promotions.discard)

    async def _promote_now(self, items: list[PutItem], upper: list[Connector]) -> None:
        for tier in upper:
            try:
                await tier.put(items, timeout=self.promote_timeout)
            except ConnectorError as exc:  # counted by the tier itself
                logger.info("%s: promotion to %s failed: %s", self.name, tier.name, exc)

    async def _stop_promotions(self) -> None:
        tasks = list(self._promotions)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    async def drain(self) -> None:
        """Wait until the background promotions started so far have finished."""
        while self._promotions:
            await asyncio.gather(*self._promotions, return_exceptions=True)

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        self._check_open()
        timeout = check_timeout(timeout)
        # Encode once for all tiers; each tier stores the same bytes (and counts its errors).
        ready = [(k, Block(b.meta, b.payload, encode_once(b))) for k, b in check_items(items)]
        if not ready:
            return 0
        results = await asyncio.gather(
            *(t.put(ready, timeout=timeout) for t in self.tiers), return_exceptions=True
        )
        for tier, res in zip(self.tiers, results, strict=True):
            if isinstance(res, BaseException):
                if not isinstance(res, ConnectorError):
                    raise res  # misuse or a bug, not a backend failure
                logger.info("%s: write-through to %s failed: %s", self.name, tier.name, res)
        counts = [r for r in results if isinstance(r, int)]
        if counts:
            return max(counts)
        raise _first_error(results)

    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        self._check_open()
        keys = check_keys(keys)
        timeout = check_timeout(timeout)
        await self._stop_promotions()  # a promotion landing later would resurrect the object
        results = await asyncio.gather(
            *(t.delete(keys, timeout=timeout) for t in self.tiers), return_exceptions=True
        )
        counts = [r for r in results if isinstance(r, int)]
        if len(counts) < len(results):
            raise _first_error(results)
        self._stats.deleted += max(counts)
        return max(counts)

    async def health(self, *, timeout: float) -> Health:
        self._check_open()
        timeout = check_timeout(timeout)
        results = await asyncio.gather(*(t.health(timeout=timeout) for t in self.tiers))
        detail = "; ".join(
            f"{t.name}: {'ok' if h.ok else h.detail}"
            for t, h in zip(self.tiers, results, strict=True)
        )
        return Health(all(h.ok for h in results), detail)

    def stats(self) -> ConnectorStats:
        """Tiered hits/misses/lookups plus the tiers' storage-level counters summed."""
        own = self._stats.copy()
        total = ConnectorStats()
        for tier in self.tiers:
            total = total + tier.stats()
        for name in (
            "corrupt_detected",
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


def _first_error(results: Sequence[object]) -> BaseException:
    for res in results:
        if isinstance(res, BaseException):
            return res
    raise AssertionError("no error among the results")
