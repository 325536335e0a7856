"""Reusable, pre-faulted host buffers for stored payloads.

Why: a store copies each chunk's pages out of device memory once, and the memory tier keeps
that copy. Into a fresh ``bytes`` per chunk, every copy lands on memory the process has never
touched: the kernel faults it in 4 KiB at a time and zeroes it first, and frees it again on
eviction. On the VMs measured for this project that made the copy-out of a 1 MiB chunk 5-30x
slower than the ``memcpy`` itself (0.2-1 GB/s against 8 GB/s), on the engine's step path.
LMCache avoids it the same way: its CPU tier is a pre-allocated buffer, not one allocation
per object.

:class:`PayloadPool` hands out fixed-size slots carved from large anonymous mappings (slabs)
advised to use huge pages, and takes a slot back when the last reference to it is gone. A
slot is filled once and then *sealed*: it is a read-only :class:`Sealed` array, which the
memory tier keeps as it is (no second copy) because nobody can change it while anyone still
refers to it. The return is reference-counted (a ``weakref.finalize`` on the sealed array;
every memoryview, cast or slice of it keeps it alive), so a slot is never reused under a
reader, from any thread. Freed slabs are kept for reuse up to ``retain_bytes`` of free
space, so a tier that churns in steady state allocates nothing.
"""

from __future__ import annotations

import mmap
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

__all__ = ["MIN_POOLED_BYTES", "PayloadPool", "Sealed", "default_pool"]

MIN_POOLED_BYTES = 64 * 1024  # below this, malloc's small bins are as fast: not pooled
_SLAB_BYTES = 8 << 20  # per slab, at least (huge pages are 2 MiB)
_ALIGN = 4096


class Sealed(np.ndarray):
    """A read-only, pool-owned payload: nobody writes it until every reference is gone."""


@dataclass(eq=False, slots=True)
class _Slab:
    slot_bytes: int
    mem: mmap.mmap
    arr: np.ndarray[Any, np.dtype[np.uint8]]
    num_slots: int
    free: list[int] = field(default_factory=list)


class PayloadPool:
    """Slots of exactly ``round_up(nbytes, 4 KiB)`` bytes, one slab list per slot size.

    Slabs are 8 MiB mappings (or one slot, for a bigger one). A wholly free slab goes back
    to a list of free mappings that any slot size can carve anew; free mappings beyond
    ``retain_bytes`` plus what :meth:`reserve` asked for are unmapped.
    """

    def __init__(self, *, retain_bytes: int = 1 << 30) -> None:
        if type(retain_bytes) is not int or retain_bytes < 0:
            raise ValueError(f"retain_bytes must be an int >= 0, got {retain_bytes!r}")
        self.retain_bytes = retain_bytes
        self._reserved = 0
        self._slabs: dict[int, list[_Slab]] = {}
        self._spare: list[mmap.mmap] = []  # free 8 MiB mappings, already faulted in
        self._lock = threading.Lock()
        self._mapped_bytes = 0

    @property
    def mapped_bytes(self) -> int:
        """Bytes of mappings the pool holds: slabs (slots in use or free) and spares."""
        return self._mapped_bytes

    @property
    def spare_bytes(self) -> int:
        return len(self._spare) * _SLAB_BYTES

    def fill(self, nbytes: int, write: Callable[[np.ndarray[Any, np.dtype[np.uint8]]], None]
             ) -> Sealed:
        """A slot of ``nbytes``: ``write`` fills it (a writable 1-D uint8 array), then it
        is sealed and returned. If ``write`` raises, the slot goes back at once."""
        if type(nbytes) is not int or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        slab, index = self._take(-(-nbytes // _ALIGN) * _ALIGN)
        start = index * slab.slot_bytes
        raw = slab.arr[start:start + nbytes]
        try:
            write(raw)
        except BaseException:
            self._give_back(slab, index)
            raise
        sealed = raw.view(Sealed)
        sealed.flags.writeable = False
        weakref.finalize(sealed, self._give_back, slab, index)
        return sealed

    def fill_many(self, nbytes: int, count: int,
                  write: Callable[[np.ndarray[Any, np.dtype[np.uint8]], int], None]
                  ) -> list[Sealed]:
        """``count`` slots of ``nbytes``, filled by as few ``write`` calls as the free slots
        allow, then each sealed on its own (it returns to the pool when its last reference
        goes, whatever becomes of the others). ``write(rows, first)`` fills payloads
        ``first .. first + len(rows)``: ``rows`` is a writable ``(k, nbytes)`` uint8 array
        over adjacent slots of one slab (row stride: the slot size), so one gather can fill
        many payloads. If ``write`` raises, every slot goes back at once."""
        if type(nbytes) is not int or nbytes <= 0 or type(count) is not int or count < 0:
            raise ValueError(f"nbytes and count must be ints > 0 and >= 0, got {nbytes!r}, "
                             f"{count!r}")
        slot = -(-nbytes // _ALIGN) * _ALIGN
        spans = self._take_many(slot, count)
        try:
            first = 0
            for slab, index, k in spans:
                start = index * slot
                write(slab.arr[start:start + k * slot].reshape(k, slot)[:, :nbytes], first)
                first += k
        except BaseException:
            for slab, index, k in spans:
                for i in range(index, index + k):
                    self._give_back(slab, i)
            raise
        out = []
        for slab, index, k in spans:
            for i in range(index, index + k):
                sealed = slab.arr[i * slot:i * slot + nbytes].view(Sealed)
                sealed.flags.writeable = False
                weakref.finalize(sealed, self._give_back, slab, i)
                out.append(sealed)
        return out

    def _take_many(self, slot_bytes: int, count: int) -> list[tuple[_Slab, int, int]]:
        """``count`` free slots as runs of adjacent ones: (slab, first index, length),
        lowest indices first, existing slabs before new ones."""
        spans: list[tuple[_Slab, int, int]] = []
        with self._lock:
            slabs = iter(list(self._slabs.get(slot_bytes, ())))
            while count > 0:
                slab = next((b for b in slabs if b.free), None) or self._new_slab(slot_bytes)
                free = sorted(slab.free)
                taken, slab.free = free[:count], free[count:][::-1]  # pop() gives the lowest
                count -= len(taken)
                run = taken[0]
                for a, b in zip(taken, [*taken[1:], -1], strict=True):
                    if b != a + 1:
                        spans.append((slab, run, a - run + 1))
                        run = b
        return spans

    def reserve(self, nbytes: int) -> None:
        """Map and fault in ``nbytes`` now (a tier's capacity, at startup), and keep that
        much even when free, so filling slots never faults memory in later."""
        if type(nbytes) is not int or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, got {nbytes!r}")
        with self._lock:
            self._reserved += nbytes
            have = self._mapped_bytes
        # Outside the lock: faulting in takes a while and fill() may run meanwhile.
        fresh = [_touched(_map(_SLAB_BYTES))
                 for _ in range(max(0, -(-(self._reserved - have) // _SLAB_BYTES)))]
        with self._lock:
            self._spare += fresh
            self._mapped_bytes += len(fresh) * _SLAB_BYTES

    def unreserve(self, nbytes: int) -> None:
        """Undo a :meth:`reserve` (the tier closed); spares beyond what is kept go."""
        with self._lock:
            if not 0 <= nbytes <= self._reserved:
                raise ValueError(f"unreserve of {nbytes} bytes; {self._reserved} reserved")
            self._reserved -= nbytes
            self._shed_spares()

    def _take(self, slot_bytes: int) -> tuple[_Slab, int]:
        with self._lock:
            for slab in self._slabs.get(slot_bytes, ()):
                if slab.free:
                    return slab, slab.free.pop()
            slab = self._new_slab(slot_bytes)
            return slab, slab.free.pop()

    def _new_slab(self, slot_bytes: int) -> _Slab:
        if slot_bytes <= _SLAB_BYTES:
            mem = self._spare.pop() if self._spare else self._grow(_SLAB_BYTES)
            n = _SLAB_BYTES // slot_bytes
        else:
            mem, n = self._grow(slot_bytes), 1
        slab = _Slab(slot_bytes, mem, np.frombuffer(mem, dtype=np.uint8), n,
                     list(range(n - 1, -1, -1)))  # pop() hands out slot 0 first
        self._slabs.setdefault(slot_bytes, []).append(slab)
        return slab

    def _grow(self, size: int) -> mmap.mmap:
        self._mapped_bytes += size
        return _map(size)

    def _give_back(self, slab: _Slab, index: int) -> None:
        # May run on any thread: wherever the last reference to the slot was dropped.
        with self._lock:
            slab.free.append(index)
            if len(slab.free) == slab.num_slots:
                if len(slab.mem) == _SLAB_BYTES:
                    self._slabs[slab.slot_bytes].remove(slab)
                    self._spare.append(slab.mem)
                # A payload bigger than a slab (a long chunk of a big model) keeps its free
                # mapping for the next payload of its size: mapping afresh would fault it
                # in again on every store.
                self._shed_spares()

    def _shed_spares(self, keep: int | None = None) -> None:
        if keep is None:
            keep = max(self.retain_bytes, self._reserved)
        while self._spare and self._mapped_bytes > keep:
            self._spare.pop()  # unmapped when garbage (no slot of it is referenced)
            self._mapped_bytes -= _SLAB_BYTES
        for size in [k for k in self._slabs if k > _SLAB_BYTES]:
            slabs = self._slabs[size]
            for slab in [b for b in slabs if len(b.free) == b.num_slots]:
                if self._mapped_bytes <= keep:
                    return
                slabs.remove(slab)
                self._mapped_bytes -= len(slab.mem)

    def trim(self) -> int:
        """Unmap every free mapping beyond what :meth:`reserve` keeps; the bytes freed."""
        with self._lock:
            before = self._mapped_bytes
            self._shed_spares(self._reserved)
            return before - self._mapped_bytes


def _map(size: int) -> mmap.mmap:
    mem = mmap.mmap(-1, size)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer, cheaper faults where the kernel allows
        mem.madvise(mmap.MADV_HUGEPAGE)
    return mem


def _touched(mem: mmap.mmap) -> mmap.mmap:
    np.frombuffer(mem, dtype=np.uint8)[::mmap.PAGESIZE] = 0  # fault every page in now
    return mem


_DEFAULT: PayloadPool | None = None
_DEFAULT_LOCK = threading.Lock()


def default_pool() -> PayloadPool:
    """The process's pool, shared by the async manager's copy-out and the memory tier."""
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            _DEFAULT = PayloadPool()
        return _DEFAULT
