"""Reads that never wait for a device: served from the kernel's caches, or refused at once.

An event loop may do file I/O itself only when that I/O cannot block. Linux can promise
exactly that for both halves of a read:

* ``openat2(..., RESOLVE_CACHED)`` (Linux 5.12) resolves the path from the dentry cache
  alone and fails with ``EAGAIN`` when any component would need a directory read;
* ``preadv2(..., RWF_NOWAIT)`` (Linux 4.14) copies only bytes already in the page cache and
  fails with ``EAGAIN`` (or reads short) when the rest would need the device.

``O_NOATIME`` keeps the read from dirtying the inode (an atime update can wait on the
file system journal). ``fstat`` and ``close`` of a read-only descriptor never touch the
device. So :meth:`NoWaitReader.read` either returns the whole file, copied from memory, or
``None`` at once, and the caller reads the file on a thread as usual. It is for the disk
connector's hot path: a file written or read recently is in the page cache, and copying it
on the loop costs less CPU than handing the read to a thread and back (see
``benchmarks/README.md``).

Only regular files are read: the file is opened with ``O_NONBLOCK`` (so a FIFO or a device
node at the path cannot make the open wait for a peer) and ``O_NOCTTY``, and anything that
``fstat`` does not call a regular file is refused, like an uncached one. Given a directory
descriptor, the path is resolved beneath it and through no symbolic link
(``RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS``), so a link planted in the tree cannot send the
read elsewhere.

Other kernels, other platforms and file systems that do not support these flags make
:meth:`NoWaitReader.create` return ``None`` or :meth:`~NoWaitReader.read` switch itself
off (``supported`` becomes false) on the first refusal that is not ``EAGAIN``.

:func:`libc_openat2` is the raw ``openat2`` binding, shared with the disk connector's
threaded reads and writes (which resolve beneath the root the same way, without
``RESOLVE_CACHED``).
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import stat
import sys
from collections.abc import Callable

import pyarrow as pa  # type: ignore[import-untyped]

__all__ = [
    "AT_FDCWD",
    "RESOLVE_BENEATH",
    "RESOLVE_CACHED",
    "RESOLVE_NO_SYMLINKS",
    "SYS_OPENAT2",
    "NoWaitReader",
    "OpenHow",
    "libc_openat2",
]

logger = logging.getLogger(__name__)

SYS_OPENAT2 = 437  # the same number on every Linux architecture (new syscall table)
AT_FDCWD = -100
RESOLVE_NO_SYMLINKS = 0x04
RESOLVE_BENEATH = 0x08
RESOLVE_CACHED = 0x20
# Refusals meaning "this kernel or file system cannot do it", as opposed to EAGAIN ("not
# cached right now") or a per-file answer (ELOOP, ENXIO, EPERM for O_NOATIME on a file this
# process does not own, ...), which only send that one file to the threads.
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.E2BIG}
# Opening must never wait: not for a FIFO's writer, not for a device; and never adopt a
# terminal. O_NOATIME keeps a read from dirtying the inode.
_READ_FLAGS = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_NOATIME", 0)


class OpenHow(ctypes.Structure):
    """``struct open_how`` of openat2(2)."""

    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


def libc_openat2() -> Callable[..., int] | None:
    """libc's ``syscall`` set up for ``syscall(SYS_OPENAT2, dirfd, path, &how, sizeof how)``
    (the descriptor, or -1 with ``ctypes.get_errno()`` set), or ``None`` off Linux and where
    the kernel (before 5.6) or a seccomp filter (EPERM) refuses ``openat2``."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        syscall = libc.syscall
    except (OSError, AttributeError):
        return None
    # syscall(2) is variadic and reads every argument as a long: pass longs, not ints.
    long_ = ctypes.c_long
    syscall.restype = long_
    syscall.argtypes = [long_, long_, ctypes.c_char_p, ctypes.c_void_p, long_]
    probe = OpenHow(os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, 0, RESOLVE_CACHED)
    fd = syscall(SYS_OPENAT2, AT_FDCWD, b"/", ctypes.byref(probe), ctypes.sizeof(probe))
    if fd < 0:
        return None
    os.close(fd)
    return syscall


class NoWaitReader:
    """Whole-file reads from the kernel's caches only; see the module docstring."""

    __slots__ = (
        "_beneath",
        "_beneath_ref",
        "_how",
        "_how_ref",
        "_how_size",
        "_syscall",
        "supported",
    )

    def __init__(self, syscall: Callable[..., int]) -> None:
        self._how = OpenHow(_READ_FLAGS, 0, RESOLVE_CACHED)
        self._how_ref = ctypes.byref(self._how)
        self._how_size = ctypes.sizeof(self._how)
        self._beneath = OpenHow(
            _READ_FLAGS, 0, RESOLVE_CACHED | RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS
        )
        self._beneath_ref = ctypes.byref(self._beneath)
        self._syscall = syscall
        self.supported = True

    @classmethod
    def create(cls) -> NoWaitReader | None:
        """A reader, or ``None`` where the platform lacks ``openat2``/``preadv2``."""
        if not hasattr(os, "RWF_NOWAIT"):
            return None
        syscall = libc_openat2()
        return None if syscall is None else cls(syscall)

    def read(self, path: str, limit: int, dirfd: int = AT_FDCWD) -> memoryview | None:
        """The whole regular file at ``path`` if it is at most ``limit`` bytes and entirely
        cached, else ``None`` (nothing is left open either way). Never blocks on a device.

        With ``dirfd``, ``path`` is relative to that directory and must resolve beneath it
        through no symbolic link (a refusal, like anything else unusual, is ``None``: the
        caller's threaded read looks at the file properly)."""
        name = os.fsencode(path)
        how = self._how_ref if dirfd == AT_FDCWD else self._beneath_ref
        fd = self._syscall(SYS_OPENAT2, dirfd, name, how, self._how_size)
        if fd < 0:
            self._refused(ctypes.get_errno(), "openat2")
            return None
        try:
            st = os.fstat(fd)
            size = st.st_size
            if size > limit or size == 0 or not stat.S_ISREG(st.st_mode):
                return None
            # Pooled and uninitialised, like the threaded read: no zero-fill, no page faults.
            view = memoryview(pa.allocate_buffer(size))
            n = os.preadv(fd, [view], 0, os.RWF_NOWAIT)
            return view if n == size else None  # short: part of it is not cached
        except OSError as exc:  # EAGAIN: not cached; anything else: the thread path reports it
            self._refused(exc.errno, "preadv2")
            return None
        finally:
            os.close(fd)

    def _refused(self, code: int | None, call: str) -> None:
        if code in _UNSUPPORTED:
            self.supported = False
            logger.info("no-wait reads switched off: %s refused (%s)", call, os.strerror(code or 0))
