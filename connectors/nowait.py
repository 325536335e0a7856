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

Other kernels, other platforms and file systems that do not support these flags make
:meth:`NoWaitReader.create` return ``None`` or :meth:`~NoWaitReader.read` switch itself
off (``supported`` becomes false) on the first refusal that is not ``EAGAIN``.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import sys
from collections.abc import Callable

import pyarrow as pa  # type: ignore[import-untyped]

__all__ = ["NoWaitReader"]

logger = logging.getLogger(__name__)

_SYS_OPENAT2 = 437  # the same number on every Linux architecture (new syscall table)
_AT_FDCWD = -100
_RESOLVE_CACHED = 0x20
# Refusals meaning "this kernel or file system cannot do it", as opposed to EAGAIN
# ("not cached right now"). EPERM: O_NOATIME on a file this process does not own.
_UNSUPPORTED = {errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EPERM, errno.E2BIG}


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class NoWaitReader:
    """Whole-file reads from the kernel's caches only; see the module docstring."""

    __slots__ = ("_how", "_how_ref", "_how_size", "_syscall", "supported")

    def __init__(self, syscall: Callable[..., int]) -> None:
        flags = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)
        self._how = _OpenHow(flags, 0, _RESOLVE_CACHED)
        self._how_ref = ctypes.byref(self._how)
        self._how_size = ctypes.sizeof(self._how)
        self._syscall = syscall
        self.supported = True

    @classmethod
    def create(cls) -> NoWaitReader | None:
        """A reader, or ``None`` where the platform lacks ``openat2``/``preadv2``."""
        if not sys.platform.startswith("linux") or not hasattr(os, "RWF_NOWAIT"):
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
        return cls(syscall)

    def read(self, path: str, limit: int) -> memoryview | None:
        """The whole file at ``path`` if it is at most ``limit`` bytes and entirely cached,
        else ``None`` (nothing is left open either way). Never blocks on a device."""
        name = os.fsencode(path)
        fd = self._syscall(_SYS_OPENAT2, _AT_FDCWD, name, self._how_ref, self._how_size)
        if fd < 0:
            self._refused(ctypes.get_errno(), "openat2")
            return None
        try:
            size = os.fstat(fd).st_size
            if size > limit or size == 0:
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
