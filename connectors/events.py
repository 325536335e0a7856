"""What a tier tells about its contents: objects stored, removed, or every object gone.

A connector records these only once someone asked (:meth:`Connector.watch_events`): a
stored object on a confirmed write (or a put that found it present), a removed one when the
tier evicts it, deletes it, drops it as corrupt, or finds it gone (a shared tier, Redis, is
emptied by its own eviction and TTLs and by other writers, and tells no one: a miss at a
lookup or load is the first this process learns of it). ``cleared`` says the tier's
contents are no longer reachable through this connector (it closed), or that the log
overflowed and the consumer must forget what it believed of that tier.

Events name storage ids; what the ids stand for (block hashes, tokens) is known to whoever
stored them (the offload manager), which turns them into KV-cache events for routers.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["DEFAULT_EVENT_LIMIT", "EventLog", "TierEvent"]

DEFAULT_EVENT_LIMIT = 1 << 16  # events held for the consumer before the log overflows

STORED = "stored"
REMOVED = "removed"
CLEARED = "cleared"


@dataclass(frozen=True, slots=True)
class TierEvent:
    """``kind`` stored / removed / cleared, in tier ``tier`` (the connector's name);
    ``reason`` for removals: evicted, deleted, corrupt, gone; for clears: closed, overflow."""

    kind: str
    tier: str
    ids: tuple[str, ...]
    reason: str = ""


class EventLog:
    """A tier's events since the consumer last took them (bounded: on overflow the held
    events are replaced by one ``cleared``, so a consumer under-believes, never over)."""

    __slots__ = ("_events", "_held", "limit", "overflows", "tier")

    def __init__(self, tier: str, limit: int = DEFAULT_EVENT_LIMIT) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"the event limit must be a positive int, got {limit!r}")
        self.tier = tier
        self.limit = limit
        self.overflows = 0
        self._events: deque[TierEvent] = deque()
        self._held = 0  # ids in the held events

    def stored(self, ids: Iterable[str]) -> None:
        self._add(STORED, tuple(ids), "")

    def removed(self, ids: Iterable[str], reason: str) -> None:
        self._add(REMOVED, tuple(ids), reason)

    def cleared(self, reason: str) -> None:
        self._events.clear()
        self._held = 0
        self._events.append(TierEvent(CLEARED, self.tier, (), reason))

    def take(self) -> list[TierEvent]:
        """The held events, oldest first. Safe from another thread than the recording one
        (each event is popped once; the bound's count may lag by the events in between)."""
        out = []
        pop = self._events.popleft
        try:
            while True:
                out.append(pop())
        except IndexError:
            pass
        self._held = max(0, self._held - sum(len(e.ids) for e in out))
        return out

    def _add(self, kind: str, ids: tuple[str, ...], reason: str) -> None:
        if not ids:
            return
        if self._held + len(ids) > self.limit:
            self.overflows += 1
            self.cleared("overflow")
            return
        self._held += len(ids)
        self._events.append(TierEvent(kind, self.tier, ids, reason))
