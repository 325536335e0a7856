"""The disk tier's write job, run on an I/O thread: one object into a temp file beneath the
root, renamed into place (victims unlinked first), and the hand-shake with a caller that
stops waiting while its buffer is being read (:class:`Write`)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvplugin.connectors import diskio
from kvplugin.connectors.base import Encoded, finish
from kvplugin.serde import EncodedBlock

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["Write", "write_object"]

_QUEUED, _READING, _WRITTEN, _DROPPED = range(4)


class Write:
    """One object write, shared by the loop and the I/O thread that runs it.

    The payload is the caller's buffer, read (hashed, copied out) by the thread, and the
    caller may reuse that buffer as soon as ``put`` is back with it, however it ended. So a
    caller that stops waiting (cancelled, or out of time) calls :meth:`abandon` before it
    gets control back, and the thread checks in with the lock held at two points:

    * :meth:`begin`, before it touches the payload: an abandoned write is dropped;
    * :meth:`written`, once the payload is in the temp file: if the caller left while the
      thread was reading its buffer, the file may hold bytes changed since (hashed before
      or after the change), so the thread writes it again from the copy that
      :meth:`abandon` took (the bytes as they were when the caller left, sealed on the loop).

    After :meth:`written` the file holds its final bytes and abandoning changes nothing.
    Hashing stays on the I/O thread for every write that is not cut short; one that is cut
    short while being written costs the loop one copy, and at most one write per I/O
    thread can be in that state."""

    __slots__ = ("_copy", "_mutex", "_state", "done")

    def __init__(self, done: asyncio.Future[None]) -> None:
        self.done = done  # resolved by _write_done; never awaited by a caller directly
        self._mutex = threading.Lock()
        self._state = _QUEUED
        self._copy: EncodedBlock | None = None

    def begin(self) -> bool:
        with self._mutex:
            if self._state == _DROPPED:
                return False
            self._state = _READING
            return True

    def written(self) -> EncodedBlock | None:
        with self._mutex:
            self._state = _WRITTEN
            return self._copy

    def abandon(self, enc: Encoded) -> None:
        with self._mutex:
            if self._state == _QUEUED:
                self._state = _DROPPED
            elif self._state == _READING:
                sealed = finish(enc)
                self._copy = dataclasses.replace(sealed, parts=(sealed.join(),))


def write_object(
    root_fd: int,
    directory: str,
    name: str,
    tmp: str,
    enc: Encoded,
    fsync: bool,
    victims: Sequence[str],
    write: Write,
) -> bool:
    """Write ``enc`` to ``tmp`` and rename it to ``name`` in ``directory`` (beneath the
    root); False when the caller abandoned it before it began (nothing written)."""
    diskio.remove_objects(root_fd, victims)  # room first: the budget holds on disk too
    if not write.begin():
        return False
    dfd = diskio.open_dir(root_fd, directory, create=True)
    try:
        fd = diskio.create_file(dfd, tmp)
        try:
            try:
                # A draft's payload is hashed here, right before the write copies it out, so
                # the copy reads it from this core's cache (measured: writing the payload in
                # hashed chunks and the head last, at offset 0, was slower).
                _write_all(fd, finish(enc).parts)
                copy = write.written()
                if copy is not None:  # see Write: the caller's bytes may have changed since
                    os.ftruncate(fd, 0)
                    os.lseek(fd, 0, os.SEEK_SET)
                    _write_all(fd, copy.parts)
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            diskio.publish(dfd, tmp, name)
        except BaseException:
            with contextlib.suppress(OSError):
                diskio.remove_entry(dfd, tmp)
            raise
        if fsync:
            os.fsync(dfd)
    finally:
        os.close(dfd)
    return True


def _write_all(fd: int, parts: Sequence[Buffer]) -> None:
    views = [memoryview(p).cast("B") for p in parts if memoryview(p).nbytes]
    while views:
        n = os.writev(fd, views)
        while n:
            if n >= views[0].nbytes:
                n -= views.pop(0).nbytes
            else:
                views[0] = views[0][n:]
                n = 0
