"""Eviction policies of the byte-bounded tiers (memory, disk): which object goes next.

A policy sees ids and sizes, never bytes. The tier tells it every change of what it holds
(:meth:`~EvictionPolicy.inserted`, :meth:`~EvictionPolicy.touched` on a hit,
:meth:`~EvictionPolicy.removed` when an object leaves other than by eviction) and asks it for
victims (:meth:`~EvictionPolicy.evict`) until an incoming object fits; the tier does the
dropping and reports each victim as a tier event. Whatever else a policy remembers (ARC's
ghosts) is its own business: it is never held, counted or reported as stored.

Built in: ``lru`` (recency: what a hit refreshes goes last) and ``arc`` (adaptive
replacement: Megiddo & Modha, FAST 2003; here sized in bytes). A third party subclasses
:class:`EvictionPolicy` and is named in the config by ``module:Class`` or by an entry point
of the ``kvplugin.eviction_policies`` group.

Why ARC for KV: a multi-turn conversation re-reads its prefix every round (frequency), while
one-off long prompts (a document summarised once, a batch job) are read once and would push
every conversation out of an LRU; ARC keeps such a scan in its recency list and, when the
ghosts show that evicted conversations come back, grows the frequency side.
"""

from __future__ import annotations

import abc
from collections import OrderedDict
from collections.abc import Callable, Iterator
from typing import ClassVar

from kvplugin.connectors.plugins import (
    PluginError,
    discover,
    import_target,
    load_entry_point,
)

__all__ = [
    "BUILTIN_POLICIES",
    "ENTRY_POINT_GROUP",
    "ARCPolicy",
    "EvictionPolicy",
    "LRUPolicy",
    "make_policy",
    "policy_problem",
    "resolve_policy",
]

ENTRY_POINT_GROUP = "kvplugin.eviction_policies"


class EvictionPolicy(abc.ABC):
    """The order in which a tier of ``capacity_bytes`` drops its objects.

    The tier calls, on the event loop and never concurrently: ``inserted`` once an object is
    held (it was not), ``touched`` on a hit on a held one, ``removed`` when a held one leaves
    other than by ``evict`` (deleted, found gone, replaced), and ``evict`` to pick and
    forget the next victim. Inserting an id already held raises ``KeyError``; touching or
    removing one that is not held is ignored (a hit may race a delete).
    """

    name: ClassVar[str] = ""

    def __init__(self, capacity_bytes: int) -> None:
        if type(capacity_bytes) is not int or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        self.capacity_bytes = capacity_bytes

    @abc.abstractmethod
    def inserted(self, sid: str, size: int) -> None:
        """``sid`` (``size`` bytes) is now held; KeyError if it already was."""

    @abc.abstractmethod
    def touched(self, sid: str) -> None:
        """A hit on ``sid`` (ignored when it is not held)."""

    @abc.abstractmethod
    def removed(self, sid: str) -> None:
        """``sid`` left the tier other than by eviction (ignored when it is not held)."""

    @abc.abstractmethod
    def evict(self, incoming: str | None = None) -> str | None:
        """Forget and return the next victim (None: nothing held). ``incoming``: the id the
        room is made for, when known (ARC adapts to it)."""

    @abc.abstractmethod
    def order(self) -> list[str]:
        """The held ids, in the order the policy lists them (LRU: next victim first)."""

    @abc.abstractmethod
    def __contains__(self, sid: object) -> bool: ...

    @abc.abstractmethod
    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[str]:
        return iter(self.order())


class LRUPolicy(EvictionPolicy):
    """Least recently used first; a hit (and a put of an object already held) refreshes."""

    name = "lru"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self._held: OrderedDict[str, None] = OrderedDict()

    def inserted(self, sid: str, size: int) -> None:
        if sid in self._held:
            raise KeyError(f"{sid!r} is already held")
        self._held[sid] = None

    def touched(self, sid: str) -> None:
        if sid in self._held:
            self._held.move_to_end(sid)

    def removed(self, sid: str) -> None:
        self._held.pop(sid, None)

    def evict(self, incoming: str | None = None) -> str | None:
        if not self._held:
            return None
        return self._held.popitem(last=False)[0]

    def order(self) -> list[str]:
        return list(self._held)

    def __contains__(self, sid: object) -> bool:
        return sid in self._held

    def __len__(self) -> int:
        return len(self._held)


class _Sized:
    """An ordered id -> size list with its byte total (least recent first)."""

    __slots__ = ("bytes", "items")

    def __init__(self) -> None:
        self.items: OrderedDict[str, int] = OrderedDict()
        self.bytes = 0

    def push(self, sid: str, size: int) -> None:
        self.items[sid] = size
        self.bytes += size

    def pop(self, sid: str) -> int:
        size = self.items.pop(sid)
        self.bytes -= size
        return size

    def pop_oldest(self) -> tuple[str, int]:
        sid, size = self.items.popitem(last=False)
        self.bytes -= size
        return sid, size


class ARCPolicy(EvictionPolicy):
    """Adaptive replacement, in bytes.

    ``T1`` holds objects hit once since they came in (recency), ``T2`` objects hit again
    (frequency); ``B1`` / ``B2`` remember the ids (and sizes) of what each list evicted, no
    bytes. The target size ``p`` of T1 moves with the ghosts: an id coming back from B1 says
    recency was too small, so p grows by its size (more when B1 is the smaller ghost list);
    one from B2 shrinks it. An eviction takes T1's oldest while T1 is over p, else T2's.
    Ghost lists are bounded as in the paper: T1 + B1 within the capacity, all four within
    twice it.
    """

    name = "arc"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.t1, self.t2, self.b1, self.b2 = _Sized(), _Sized(), _Sized(), _Sized()
        self.p = 0  # T1's target, bytes
        self._adapted: str | None = None  # the ghost p was already adapted for (see evict)

    @property
    def ghosts(self) -> list[str]:
        """Ids remembered but not held (B1 then B2, oldest first): never held or reported."""
        return [*self.b1.items, *self.b2.items]

    def inserted(self, sid: str, size: int) -> None:
        if sid in self.t1.items or sid in self.t2.items:
            raise KeyError(f"{sid!r} is already held")
        if sid in self.b1.items or sid in self.b2.items:
            # Evicted, and wanted again: it has been used twice, it goes to T2.
            if self._adapted != sid:
                self._adapt(sid)
            (self.b1 if sid in self.b1.items else self.b2).pop(sid)
            self.t2.push(sid, size)
        else:
            self.t1.push(sid, size)
        self._adapted = None
        self._trim_ghosts()

    def touched(self, sid: str) -> None:
        if sid in self.t1.items:
            self.t2.push(sid, self.t1.pop(sid))
        elif sid in self.t2.items:
            self.t2.items.move_to_end(sid)

    def removed(self, sid: str) -> None:
        # Deleted or lost, not evicted: nothing to learn from, no ghost.
        for held in (self.t1, self.t2):
            if sid in held.items:
                held.pop(sid)
                return

    def evict(self, incoming: str | None = None) -> str | None:
        if incoming is not None and self._adapted != incoming and (
                incoming in self.b1.items or incoming in self.b2.items):
            # Adapt before choosing, as the paper does on a ghost hit; once per insertion,
            # however many victims the incoming object needs.
            self._adapt(incoming)
            self._adapted = incoming
        if not self.t1.items and not self.t2.items:
            return None
        t1 = self.t1.bytes
        from_t1 = bool(self.t1.items) and (
            not self.t2.items or t1 > self.p or (incoming in self.b2.items and t1 == self.p))
        if from_t1:
            sid, size = self.t1.pop_oldest()
            self.b1.push(sid, size)
        else:
            sid, size = self.t2.pop_oldest()
            self.b2.push(sid, size)
        self._trim_ghosts()
        return sid

    def _adapt(self, sid: str) -> None:
        if sid in self.b1.items:
            size = self.b1.items[sid]
            ratio = self.b2.bytes / self.b1.bytes if self.b1.bytes else 1.0
            self.p = min(self.capacity_bytes, self.p + int(size * max(1.0, ratio)))
        else:
            size = self.b2.items[sid]
            ratio = self.b1.bytes / self.b2.bytes if self.b2.bytes else 1.0
            self.p = max(0, self.p - int(size * max(1.0, ratio)))

    def _trim_ghosts(self) -> None:
        c = self.capacity_bytes
        while self.b1.items and self.t1.bytes + self.b1.bytes > c:
            self._drop_ghost(self.b1)
        total = self.t1.bytes + self.t2.bytes + self.b1.bytes
        while self.b2.items and total + self.b2.bytes > 2 * c:
            self._drop_ghost(self.b2)

    def _drop_ghost(self, ghosts: _Sized) -> None:
        sid, _ = ghosts.pop_oldest()
        if sid == self._adapted:
            self._adapted = None

    def order(self) -> list[str]:
        return [*self.t1.items, *self.t2.items]

    def __contains__(self, sid: object) -> bool:
        return sid in self.t1.items or sid in self.t2.items

    def __len__(self) -> int:
        return len(self.t1.items) + len(self.t2.items)


BUILTIN_POLICIES: dict[str, type[EvictionPolicy]] = {"lru": LRUPolicy, "arc": ARCPolicy}

PolicyFactory = Callable[[int], EvictionPolicy]


def resolve_policy(spec: str) -> PolicyFactory:
    """The factory a policy spec names: a built-in (``lru``, ``arc``), a ``module:Class``
    string, or an entry point of ``kvplugin.eviction_policies``; called with the tier's
    capacity in bytes. ValueError (naming what exists) when it names nothing usable."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"an eviction policy is a non-empty string, got {spec!r}")
    what = f"eviction policy {spec!r}"
    try:
        if ":" in spec:
            target = import_target(spec, what)
        elif spec in BUILTIN_POLICIES:
            target = BUILTIN_POLICIES[spec]
        else:
            eps = discover(ENTRY_POINT_GROUP).get(spec)
            if not eps:
                known = sorted({*BUILTIN_POLICIES, *discover(ENTRY_POINT_GROUP)})
                raise PluginError(f"unknown {what}; known: {', '.join(known)}; or give a "
                                  "module:Class string")
            target = load_entry_point(eps, what)
    except PluginError as e:
        raise ValueError(str(e)) from None
    if not (isinstance(target, type) and issubclass(target, EvictionPolicy)):
        raise ValueError(f"{what} is {target!r}, not a subclass of "
                         "kvplugin.connectors.eviction.EvictionPolicy")
    return target


def policy_problem(spec: str) -> str | None:
    """Why ``spec`` names no usable policy (None: it does); for config validation."""
    try:
        resolve_policy(spec)
    except ValueError as e:
        return str(e)
    return None


def make_policy(spec: str | EvictionPolicy, capacity_bytes: int) -> EvictionPolicy:
    """A policy for a tier of ``capacity_bytes``: a spec resolved and built, or an instance
    given as is (its capacity must be the tier's)."""
    if isinstance(spec, EvictionPolicy):
        if spec.capacity_bytes != capacity_bytes or len(spec):
            raise ValueError("an eviction policy instance must be fresh and sized for its "
                             f"tier ({capacity_bytes} bytes)")
        return spec
    return resolve_policy(spec)(capacity_bytes)
