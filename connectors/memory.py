"""In-process memory connector: a byte-bounded store of encoded objects, evicted in the
order of its policy (:mod:`kvplugin.connectors.eviction`; LRU unless configured).

It is both the CPU tier and the fake the tests use, so it stores the same verified format as
every other connector (a flipped byte in memory is caught exactly like one on disk).
Everything runs on the event loop without awaiting, so it never times out.

A put copies the object once, since the caller may reuse its buffers as soon as put
returns; except when the payload is immutable, a view of a ``bytes`` or a sealed slot of
the payload pool (the async manager's copy-out hands over such a private copy): nobody can
change that, so it is kept as it is, beside a copy of the small pieces around it
(:class:`~kvplugin.serde.SplitObject`). That saves the store path a second copy of every
payload. A payload that must be copied goes into a slot of the payload pool
(:mod:`kvplugin.buffers`), memory already faulted in, rather than a fresh allocation.

``reserve=True`` maps and faults in the whole capacity in that pool at construction, as
LMCache pre-allocates its CPU buffer: stores then never fault memory in on the serving path
(the first fill of fresh memory costs about 1 ms per MiB on the VMs measured here).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvplugin.buffers import MIN_POOLED_BYTES, PayloadPool, default_pool
from kvplugin.connectors.base import (
    Capabilities,
    Encoded,
    Loaded,
    PutOutcome,
    StoreBase,
    decode_or_error,
    finish,
)
from kvplugin.connectors.eviction import EvictionPolicy, make_policy
from kvplugin.serde import SplitObject, split_if_immutable

if TYPE_CHECKING:
    from collections.abc import Sequence

    from typing_extensions import Buffer

    from kvplugin.connectors.keys import ObjectKey
    from kvplugin.serde import EncodedBlock

__all__ = ["MemoryConnector"]


class MemoryConnector(StoreBase):
    """Evicts by its policy; a ``get`` (and a put of an object held) is a hit for it,
    a ``lookup`` is not."""

    tells_existing = True

    def __init__(
        self,
        *,
        capacity_bytes: int,
        name: str = "memory",
        secret: bytes | None = None,
        previous_secrets: Sequence[bytes] = (),
        reserve: bool = False,
        pool: PayloadPool | None = None,
        eviction: str | EvictionPolicy = "lru",
    ) -> None:
        """``secret``/``previous_secrets``: see :class:`~kvplugin.connectors.base.StoreBase`.
        ``reserve``: fault the capacity in now (see the module's doc); ``pool``: where
        copies go (the process's :func:`~kvplugin.buffers.default_pool` by default);
        ``eviction``: the policy (see :func:`~kvplugin.connectors.eviction.make_policy`)."""
        if type(capacity_bytes) is not int or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if type(reserve) is not bool:
            raise TypeError(f"reserve must be a bool, got {reserve!r}")
        super().__init__(
            name=name,
            capabilities=Capabilities(
                tier="memory", persistent=False, shared=False, max_object_bytes=capacity_bytes
            ),
            secret=secret,
            previous_secrets=previous_secrets,
        )
        self.capacity_bytes = capacity_bytes
        self._objects: dict[str, bytes | SplitObject] = {}
        self.policy = make_policy(eviction, capacity_bytes)
        self._used = 0
        self._pool = default_pool() if pool is None else pool
        self._reserved = capacity_bytes if reserve else 0
        if reserve:
            self._pool.reserve(capacity_bytes)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._objects)

    def objects(self) -> dict[str, int]:
        """Storage id -> bytes of each object held, in the policy's order (LRU: least
        recently used first; a copy, for tools and tests)."""
        return {sid: _size(self._objects[sid]) for sid in self.policy.order()}

    async def _prefix_present(self, ids: list[str]) -> int:
        n = 0
        for sid in ids:
            if sid not in self._objects:
                break
            n += 1
        return n

    async def _fetch(self, ids: list[str]) -> list[Buffer | None]:
        return [o.join() if isinstance(o, SplitObject) else o for o in self._take(ids)]

    def _load_now(self, keys: list[ObjectKey]) -> tuple[list[Loaded], Sequence[int]]:
        # Everything is here: decoded (and verified) on the loop, no deadline to arm.
        found = self._take([k.id for k in keys])
        return [None if o is None else decode_or_error(o, k.id, codec=self.codec)
                for k, o in zip(keys, found, strict=True)], ()

    def _take(self, ids: list[str]) -> list[bytes | SplitObject | None]:
        """The stored object per id (``None`` if absent); each hit is told to the policy,
        tail first (a chain's head the most recent)."""
        out = [self._objects.get(sid) for sid in ids]
        for sid, data in zip(reversed(ids), reversed(out), strict=True):
            if data is not None:
                self.policy.touched(sid)
        return out

    async def _store(
        self, items: list[tuple[str, Encoded]], *, overwrite: bool
    ) -> list[PutOutcome]:
        # Tail first (see kvplugin.connectors.eviction: a batch is a chain, its head the
        # last the policy hears of, so the last to go; and what does not fit is the tail).
        out = [self._store_one(sid, finish(enc), overwrite) for sid, enc in reversed(items)]
        out.reverse()
        return out

    def _store_one(self, sid: str, enc: EncodedBlock, overwrite: bool) -> PutOutcome:
        if sid in self._objects:
            if not overwrite:
                self.policy.touched(sid)
                self._committed((sid,))
                return PutOutcome.EXISTS
            self._used -= _size(self._objects.pop(sid))
            self.policy.removed(sid)
        if enc.nbytes > self.capacity_bytes:
            return PutOutcome.REJECTED
        victims = []
        while self._used + enc.nbytes > self.capacity_bytes:
            gone = self.policy.evict(sid)
            if gone is None:  # the policy lost track of what is held: a bug, never a hang
                raise RuntimeError(f"{self.name}: {self._used} bytes held but the eviction "
                                   f"policy {self.policy.name!r} has no victim")
            self._used -= _size(self._objects.pop(gone))
            self._stats.evicted += 1
            victims.append(gone)
        self._evicted(victims)
        # One copy at most: the caller's buffers may be reused as soon as put returns.
        self._objects[sid] = split_if_immutable(enc) or self._copy(enc)
        self.policy.inserted(sid, enc.nbytes)
        self._used += enc.nbytes
        self._committed((sid,))
        return PutOutcome.WRITTEN

    def _copy(self, enc: EncodedBlock) -> bytes | SplitObject:
        if len(enc.parts) != 3 or memoryview(enc.parts[1]).nbytes < MIN_POOLED_BYTES:
            return enc.join()
        head, payload, tail = enc.parts
        src = memoryview(payload).cast("B")

        def write(out: Any) -> None:
            out[:] = np.frombuffer(src, dtype=np.uint8)  # one memcpy

        view = memoryview(cast("Buffer", self._pool.fill(src.nbytes, write)))
        return SplitObject(bytes(head), view, bytes(tail))

    async def _remove(self, ids: list[str]) -> int:
        n = 0
        for sid in ids:
            data = self._objects.pop(sid, None)
            if data is not None:
                self._used -= _size(data)
                self.policy.removed(sid)
                n += 1
        return n

    async def _ping(self) -> None:
        return None

    async def _close(self) -> None:
        for sid in self._objects:
            self.policy.removed(sid)
        self._objects.clear()
        self._used = 0
        if self._reserved:
            self._pool.unreserve(self._reserved)
            self._reserved = 0


def _size(obj: bytes | SplitObject) -> int:
    return obj.nbytes if isinstance(obj, SplitObject) else len(obj)
