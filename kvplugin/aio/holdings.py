"""The bytes each tenant holds on each tier, learned from the tiers' own events.

A tenant's tier byte quota bounds what it *holds*: an object counts on a tier from the
tier's ``stored`` event until its ``removed`` (evicted, deleted, corrupt, found gone) or the
tier's ``cleared``. Counting what was written instead refuses a long-running tenant whose
objects are long evicted, and does not follow a tier that drops objects as fast as they come.

Synchronous and pure: the manager tells it which objects a store job writes (``expect``),
hands it the tiers' events (``apply``) and says when the job ended (``settle``). Only
objects of tenants with a tier quota are tracked, so what it keeps is bounded by those
quotas (one entry per held object). An object belongs to the tenant whose store wrote it
first (a prefix group's shared object is charged once, to that tenant).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from kvplugin.connectors.events import TierEvent

__all__ = ["TierHoldings"]


@dataclass(slots=True)
class _Object:
    tenant: str
    nbytes: int
    tiers: set[str] = field(default_factory=set)  # tiers whose stored event came
    writing: int = 0  # store jobs of it in flight


class TierHoldings:
    """Per (tenant, tier): the bytes of that tenant's objects the tier holds now."""

    def __init__(self) -> None:
        self._objects: dict[str, _Object] = {}
        self._held: dict[tuple[str, str], int] = {}

    def __len__(self) -> int:
        return len(self._objects)

    def held(self, tenant: str, tier: str) -> int:
        return self._held.get((tenant, tier), 0)

    def by_tenant_tier(self) -> dict[tuple[str, str], int]:
        """Every (tenant, tier) holding bytes now, and how many."""
        return dict(self._held)

    def expect(self, tenant: str, objects: Iterable[tuple[str, int]]) -> None:
        """A store job of ``tenant`` writes these ``(object id, bytes)``."""
        for sid, nbytes in objects:
            obj = self._objects.get(sid)
            if obj is None:
                obj = self._objects[sid] = _Object(tenant, nbytes)
            obj.writing += 1

    def settle(self, ids: Iterable[str]) -> None:
        """The store job of these ids ended (its events applied): an object no tier holds
        and no job writes is forgotten."""
        for sid in ids:
            obj = self._objects.get(sid)
            if obj is not None:
                obj.writing -= 1
                self._forget_if_gone(sid, obj)

    def apply(self, events: Iterable[TierEvent]) -> None:
        for e in events:
            if e.kind == "stored":
                for sid in e.ids:
                    obj = self._objects.get(sid)
                    if obj is not None and e.tier not in obj.tiers:
                        obj.tiers.add(e.tier)
                        self._add(obj, e.tier, obj.nbytes)
            elif e.kind == "removed":
                for sid in e.ids:
                    self._remove(sid, e.tier)
            else:  # cleared (closed, or the log overflowed): the tier holds none we know of
                for sid in [s for s, o in self._objects.items() if e.tier in o.tiers]:
                    self._remove(sid, e.tier)

    def _remove(self, sid: str, tier: str) -> None:
        obj = self._objects.get(sid)
        if obj is not None and tier in obj.tiers:
            obj.tiers.discard(tier)
            self._add(obj, tier, -obj.nbytes)
            self._forget_if_gone(sid, obj)

    def _add(self, obj: _Object, tier: str, nbytes: int) -> None:
        key = (obj.tenant, tier)
        left = self._held.get(key, 0) + nbytes
        if left:
            self._held[key] = left
        else:
            self._held.pop(key, None)

    def _forget_if_gone(self, sid: str, obj: _Object) -> None:
        if not obj.tiers and obj.writing <= 0:
            del self._objects[sid]
