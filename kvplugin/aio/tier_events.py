"""KV-cache events of the offload tiers, for routers: which blocks each tier holds.

The connectors tell what happened to storage ids (:mod:`kvplugin.connectors.events`); only the
manager knows what an id stands for, because it stored it: the block hashes, tokens and
group of the chunk (or state). :class:`TierEventView` keeps that description for every
object a store started, turns the tiers' events into vLLM's ``BlockStored`` /
``BlockRemoved`` shapes (:mod:`kvplugin.core.events`, the tier as the medium), and
remembers what it has told, so every ``BlockRemoved`` follows the ``BlockStored`` it
takes back and nothing is told twice.

What a router can learn this way: every object this process stored, per tier, and every
removal a tier makes itself (memory and disk evictions, deletes, corrupt objects). What it
learns late: Redis removes keys on its own (LRU, TTLs) and other processes delete them;
those are told when a lookup or load of this process meets them gone. What it never
learns: objects other processes stored, and objects a disk tier recovered at start (this
process did not store them: their block hashes are unknown here).

Synchronous and pure: the manager feeds it and hands its output to whoever subscribes.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvplugin.connectors.base import Connector
from kvplugin.connectors.events import TierEvent
from kvplugin.core.blocks import external_block_hash
from kvplugin.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

__all__ = ["ObjectInfo", "TierEventView", "describe_chunk", "describe_state", "tier_media",
           "tier_medium"]

# Tier kinds (capabilities.tier) -> the medium an event names: host memory is vLLM's "CPU".
_MEDIA = {"memory": "CPU", "disk": "DISK", "redis": "REDIS"}
OWNERSHIP = "kvplugin"


def tier_medium(kind: str) -> str:
    return _MEDIA.get(kind, kind.upper())


def tier_media(tiers: Sequence[Connector]) -> dict[str, str]:
    """Each tier's name -> the medium its events name (by its kind: two memory tiers are
    both vLLM's "CPU"; the events' tier is the name)."""
    return {t.name: tier_medium(t.capabilities.tier) for t in tiers}


@dataclass(frozen=True, slots=True)
class ObjectInfo:
    """What a stored object covers, in the events' terms."""

    group: int
    block_hashes: tuple[Any, ...]  # the publisher's form: ints (native), vLLM's own on vLLM
    parent: Any
    token_ids: tuple[int, ...]
    block_size: int
    spec_kind: str | None = None  # vLLM's kv_cache_spec_kind / sliding window, when known
    sliding_window: int | None = None


def chunk_span(block_hashes: Sequence[bytes], start: int, stop: int, hash_block_size: int,
               block_size: int) -> tuple[tuple[bytes, ...], bytes | None]:
    """The hashes of tokens ``[start, stop)``'s blocks as the device cache's own events name
    them (a block's hash is the hash ending at its last token), and its parent's."""
    stride = block_size // hash_block_size
    hashes = tuple(block_hashes[(b + 1) * stride - 1]
                   for b in range(start // block_size, stop // block_size))
    first = start // hash_block_size
    return hashes, block_hashes[first - 1] if first else None


def state_span(block_hashes: Sequence[bytes], boundary: int,
               hash_block_size: int) -> tuple[tuple[bytes, ...], bytes | None]:
    """A recurrent state taken at ``boundary`` tokens stands for the block ending there."""
    n = boundary // hash_block_size
    return (block_hashes[n - 1],), block_hashes[n - 2] if n > 1 else None


def describe_chunk(block_hashes: Sequence[bytes], token_ids: Sequence[int], group: int,
                   start: int, stop: int, hash_block_size: int,
                   block_size: int) -> ObjectInfo:
    """The chunk of tokens ``[start, stop)`` of a request (its hash list and tokens)."""
    hashes, parent = chunk_span(block_hashes, start, stop, hash_block_size, block_size)
    return ObjectInfo(group, tuple(external_block_hash(h) for h in hashes),
                      None if parent is None else external_block_hash(parent),
                      tuple(token_ids[start:stop]), block_size)


def describe_state(block_hashes: Sequence[bytes], token_ids: Sequence[int], group: int,
                   boundary: int, hash_block_size: int) -> ObjectInfo:
    """A recurrent state taken at ``boundary`` tokens."""
    (h,), parent = state_span(block_hashes, boundary, hash_block_size)
    return ObjectInfo(group, (external_block_hash(h),),
                      None if parent is None else external_block_hash(parent),
                      tuple(token_ids[boundary - hash_block_size:boundary]), hash_block_size)


class TierEventView:
    """Descriptions of the objects stores started, what has been told of each, and the
    events that tell the rest. At most ``max_objects`` described: past that the oldest
    is taken back (``BlockRemoved`` from every tier it was told in), so a router believes
    too little, never too much."""

    def __init__(self, *, max_objects: int = 1 << 18, max_events: int = 1 << 16,
                 media: dict[str, str] | None = None) -> None:
        """``media``: tier name -> medium (:func:`tier_media`); a tier not in it is named
        by :func:`tier_medium` of its name."""
        if max_objects < 1 or max_events < 1:
            raise ValueError("max_objects and max_events must be positive")
        self._media = dict(media or {})
        self.max_objects = max_objects
        self.max_events = max_events
        self._info: OrderedDict[str, ObjectInfo] = OrderedDict()
        self._told: dict[str, set[str]] = {}  # id -> tiers a BlockStored was told in
        self._storing: dict[str, int] = {}  # id -> store jobs of it in flight
        self._settled: list[str] = []  # ids whose store jobs ended since the last apply
        self._out: list[KVCacheEvent] = []
        self.overflows = 0

    def _medium(self, tier: str) -> str:
        return self._media.get(tier) or tier_medium(tier)

    def __len__(self) -> int:
        return len(self._info)

    def describe(self, sid: str, info: ObjectInfo) -> None:
        """A store of ``sid`` starts (its events may arrive from now on)."""
        self._info[sid] = info
        self._info.move_to_end(sid)
        self._storing[sid] = self._storing.get(sid, 0) + 1
        while len(self._info) > self.max_objects:
            old, _ = next(iter(self._info.items()))
            self._take_back(old, set(self._told.get(old, ())))
            self._drop(old)

    def settle(self, sids: Sequence[str]) -> None:
        """The store jobs of these ids ended (their writes' events are already recorded)."""
        for sid in sids:
            n = self._storing.get(sid, 0) - 1
            if n > 0:
                self._storing[sid] = n
            else:
                self._storing.pop(sid, None)
                self._settled.append(sid)

    def believed(self) -> dict[str, set[str]]:
        """Tier -> the ids a subscriber has been told it holds (for tests and tools)."""
        out: dict[str, set[str]] = {}
        for sid, tiers in self._told.items():
            for tier in tiers:
                out.setdefault(tier, set()).add(sid)
        return out

    def apply(self, events: Sequence[TierEvent]) -> list[KVCacheEvent]:
        """The KV-cache events the tiers' events make (and any held since the last call)."""
        for e in events:
            if e.kind == "stored":
                for sid in e.ids:
                    self._stored(sid, e.tier)
            elif e.kind == "removed":
                for sid in e.ids:
                    if e.tier in self._told.get(sid, ()):
                        self._take_back(sid, {e.tier})
            else:  # cleared: nothing of that tier is known any more
                for sid in [s for s, tiers in self._told.items() if e.tier in tiers]:
                    self._take_back(sid, {e.tier})
        # Told nowhere and not being stored: forget it, only now that every tier's events
        # are in (a composite lists one tier's events after another's: one tier's removal
        # may come before another tier's store of the same object).
        for sid in self._settled:
            if not self._told.get(sid) and sid not in self._storing:
                self._drop(sid)
        self._settled.clear()
        out, self._out = self._out, []
        return out

    def _stored(self, sid: str, tier: str) -> None:
        info = self._info.get(sid)
        if info is None:
            return  # not ours: stored elsewhere, or recovered at start
        told = self._told.setdefault(sid, set())
        if tier in told:
            return
        told.add(tier)
        self._emit(BlockStored(
            list(info.block_hashes), info.parent, list(info.token_ids), info.block_size,
            None, self._medium(tier), None, group_idx=info.group,
            kv_cache_spec_kind=info.spec_kind, kv_cache_spec_sliding_window=info.sliding_window,
            ownership=OWNERSHIP))

    def _take_back(self, sid: str, tiers: set[str]) -> None:
        info = self._info.get(sid)
        told = self._told.get(sid)
        if info is None or not told:
            return
        for tier in sorted(tiers & told):
            told.discard(tier)
            self._emit(BlockRemoved(list(info.block_hashes), self._medium(tier),
                                    group_idx=info.group, ownership=OWNERSHIP))
        if not told:
            del self._told[sid]
            self._settled.append(sid)  # forgotten at the end of apply unless told again

    def _drop(self, sid: str) -> None:
        self._info.pop(sid, None)
        self._told.pop(sid, None)
        self._storing.pop(sid, None)

    def _emit(self, event: KVCacheEvent) -> None:
        if len(self._out) >= self.max_events:
            # Nobody took the events for too long: tell the subscriber to forget every
            # tier's blocks (and this view forgets what it told), rather than drop some.
            self.overflows += 1
            self._out = [AllBlocksCleared()]
            self._told.clear()
            return
        self._out.append(event)
