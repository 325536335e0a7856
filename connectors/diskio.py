"""The disk connector's blocking file operations, all beneath its open root directory.

Nothing in the root may block the event loop or a thread, or send an operation outside the
root, whoever put it there: a FIFO, socket or device node at an object's path, a directory
where a file belongs, a symbolic link for a namespace or shard directory.

* **One root descriptor.** :func:`lock_and_scan` opens the root once (:class:`RootDir`);
  every later operation is relative to that descriptor and resolves each path beneath it
  through no symbolic link: ``openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)`` where the
  kernel has it (Linux 5.6), else one ``O_NOFOLLOW`` open per component. Renames and
  unlinks run in a shard directory opened that way, on plain names.
* **Only regular files are read.** Opens use ``O_NONBLOCK`` (a FIFO's open waits for a
  writer otherwise) and ``O_NOCTTY``; anything ``fstat`` does not call a regular file, or
  that is bigger than the store could hold, is a :class:`ForeignObject`: a counted miss
  that the connector then removes (a directory with ``shutil.rmtree``, which follows no
  link).
* **The lock is the directory's.** An exclusive ``flock`` on the root's own descriptor:
  removing a file cannot release it, and the kernel drops it when the holder exits.
  ``.kvplugin.lock`` only names the holder's pid (also locked, so a connector of an older
  release, which locks only that file, still sees the directory as taken); failing to
  write it (a full disk) is logged, not fatal.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import functools
import logging
import os
import re
import shutil
import stat
import threading
from typing import TYPE_CHECKING, Any, TypeVar

import pyarrow as pa  # type: ignore[import-untyped]

from kvplugin.connectors.base import BackendUnavailable
from kvplugin.connectors.nowait import (
    RESOLVE_BENEATH,
    RESOLVE_NO_SYMLINKS,
    SYS_OPENAT2,
    OpenHow,
    libc_openat2,
)
from kvplugin.serde import BlockFormatError

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

T = TypeVar("T")

__all__ = [
    "LOCK_NAME",
    "DirectoryInUse",
    "ForeignObject",
    "RootDir",
    "create_file",
    "lock_and_scan",
    "open_dir",
    "publish",
    "read_file",
    "remove_entry",
    "remove_objects",
    "root_problem",
]

logger = logging.getLogger(__name__)

LOCK_NAME = ".kvplugin.lock"
_NS_RE = re.compile(r"[0-9a-f]{32}")
_SHARD_RE = re.compile(r"[0-9a-f]{2}")
_FILE_RE = re.compile(r"[0-9a-f]{64}\.kvb")
_NOATIME = getattr(os, "O_NOATIME", 0)
_READ = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# Open refusals meaning "something that is not an object file is there": a symbolic link
# (ELOOP), a socket or a device without a driver (ENXIO, ENODEV), a path leaving the root
# (EXDEV).
_FOREIGN = {errno.ELOOP, errno.ENXIO, errno.ENODEV, errno.EXDEV}
# The path cannot lead to a file: a component is missing or is not a directory.
_ABSENT = {errno.ENOENT, errno.ENOTDIR}


class DirectoryInUse(BackendUnavailable):
    """Another open DiskConnector (in this or another process) holds the directory."""


class ForeignObject(BlockFormatError):
    """What sits at an object's path is not an object file (a directory, FIFO, socket,
    device, link, or a file bigger than the store could hold)."""


# --- the root ------------------------------------------------------------------------------


class RootDir:
    """The open root: its descriptor (which holds the lock), the pid file's descriptor, and a
    count of the I/O jobs using them.

    :meth:`close` (on ``aclose``) closes the descriptors once the last job is done: a
    descriptor number closed under a running thread could be reused at once by any open in
    the process, and that thread's next ``openat`` would resolve against the wrong file. A
    thread stuck on a hung device therefore keeps the directory locked until it returns,
    which is right: it may still write there."""

    __slots__ = ("_closing", "_mutex", "_on_released", "_pid_fd", "_users", "fd", "path")

    def __init__(self, path: str, fd: int, pid_fd: int | None) -> None:
        self.path = path
        self.fd = fd
        self._pid_fd = pid_fd
        self._mutex = threading.Lock()
        self._users = 0
        self._closing = False
        self._on_released: Callable[[], None] | None = None

    def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(root_fd, *args)`` with the descriptor held open (on an I/O thread)."""
        with self._mutex:
            if self._closing:
                raise OSError(errno.EBADF, "the connector is closed", self.path)
            self._users += 1
        try:
            return fn(self.fd, *args)
        finally:
            with self._mutex:
                self._users -= 1
                last = self._closing and not self._users
            if last:
                self._close_fds()
                if self._on_released is not None:
                    self._on_released()

    def close(self, on_released: Callable[[], None] | None = None) -> bool:
        """Close the descriptors once no job uses them. True when that was now; otherwise
        ``on_released`` runs, on the last job's thread, when it happens (so that a closing
        connector can wait for the lock to go before a new one takes the directory)."""
        with self._mutex:
            if self._closing:
                return not self._users
            self._closing = True
            last = not self._users
            if not last:
                self._on_released = on_released
        if last:
            self._close_fds()
        return last

    def _close_fds(self) -> None:
        for fd in (self._pid_fd, self.fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)


Scanned = tuple[RootDir, list[tuple[str, int]], int, int]


def lock_and_scan(path: str, max_size: int) -> Scanned:
    """Take the directory (creating it), then scan it: the open root, the committed objects
    (oldest first), and how many temp files and foreign entries were removed. Nothing stays
    open if either step fails."""
    root = _lock_root(path)
    try:
        return (root, *_scan(root.fd, max_size))
    except BaseException:
        root.close()
        raise


def _lock_root(path: str) -> RootDir:
    """An exclusive ``flock`` on the root directory's own descriptor (see the module doc)."""
    os.makedirs(path, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    pid_fd = None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _in_use(path, fd) from None
        pid_fd = _claim_pid_file(path, fd)
        return RootDir(path, fd, pid_fd)
    except BaseException:
        for f in (pid_fd, fd):
            if f is not None:
                os.close(f)
        raise


def _claim_pid_file(path: str, dirfd: int) -> int | None:
    """Lock ``.kvplugin.lock`` too and write our pid in it. Only another holder of that
    lock is an error; anything else (a full disk, a FIFO or a link at that name) is logged
    and the pid left unwritten (``None``, or a descriptor whose write failed): the
    directory's own lock is what counts."""
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(LOCK_NAME, flags, 0o644, dir_fd=dirfd)
    except OSError as exc:
        logger.warning("%s: cannot open %s: %s", path, LOCK_NAME, exc)
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "not a regular file")
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:  # a connector of an older release, which locks only the file
        os.close(fd)
        raise _in_use(path, dirfd) from None
    except OSError as exc:
        os.close(fd)
        logger.warning("%s: cannot lock %s: %s", path, LOCK_NAME, exc)
        return None
    except BaseException:
        os.close(fd)
        raise
    try:
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    except OSError as exc:  # e.g. ENOSPC: the pid is only information
        logger.warning("%s: cannot write our pid to %s: %s", path, LOCK_NAME, exc)
    return fd


def _in_use(path: str, dirfd: int) -> DirectoryInUse:
    holder = "unknown"
    with contextlib.suppress(OSError):  # never block on, or follow, whatever is there
        fd = os.open(LOCK_NAME, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=dirfd)  # fmt: skip
        try:
            holder = os.pread(fd, 32, 0).decode("ascii", "replace").strip() or holder
        finally:
            os.close(fd)
    return DirectoryInUse(
        f"{path} is in use by another DiskConnector (pid {holder}); "
        "give each connector its own directory"
    )


PROBE_BYTES = 4096


def root_problem(dirfd: int, path: str, room: int = 0) -> str | None:
    """Why the root cannot take writes (``None``: it can): gone, replaced, read-only, less
    free space than the ``room`` the tier may still fill, or a test write that fails (a full
    file system, a quota)."""
    try:
        st, ours = os.stat(path), os.fstat(dirfd)
    except OSError as exc:
        return f"{path}: {exc.strerror}"
    if (st.st_dev, st.st_ino) != (ours.st_dev, ours.st_ino):
        return f"{path} was removed or replaced while open"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{path} is not writable"
    vfs = os.fstatvfs(dirfd)
    free = vfs.f_bavail * vfs.f_frsize
    if free < room:
        return (f"{path}: {free} bytes free, less than the {room} bytes the tier may still "
                "fill (its capacity): writes would fail before it evicts")
    name = f".probe-{os.getpid()}-{threading.get_ident()}"
    try:
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600,
                     dir_fd=dirfd)
        try:
            os.write(fd, bytes(PROBE_BYTES))
        finally:
            os.close(fd)
            os.unlink(name, dir_fd=dirfd)
    except OSError as exc:
        return f"{path}: a test write failed: {exc.strerror}"
    return None


# --- opening beneath the root -------------------------------------------------------------


_OPENAT2 = libc_openat2()


@functools.cache
def _how(flags: int) -> tuple[OpenHow, Any, int]:
    how = OpenHow(flags, 0, RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)
    return how, ctypes.byref(how), ctypes.sizeof(how)


def _open_beneath(dirfd: int, rel: str, flags: int) -> int:
    """``rel`` (``a/b/c``) opened relative to ``dirfd``, through no symbolic link and never
    outside it; raises ``OSError`` (ELOOP for a link, ENOTDIR for a component that is not a
    directory)."""
    if _OPENAT2 is not None:
        _, ref, size = _how(flags)
        fd: int = _OPENAT2(SYS_OPENAT2, dirfd, rel.encode(), ref, size)
        if fd >= 0:
            return fd
        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code), rel)
    *dirs, name = rel.split("/")
    parent = dirfd
    try:
        for part in dirs:
            sub = os.open(part, _DIR | os.O_NOFOLLOW, dir_fd=parent)
            if parent != dirfd:
                os.close(parent)
            parent = sub
        return os.open(name, flags | os.O_NOFOLLOW, dir_fd=parent)
    finally:
        if parent != dirfd:
            os.close(parent)


def open_dir(dirfd: int, rel: str, *, create: bool = False) -> int:
    """The directory ``rel`` beneath ``dirfd``. With ``create``, missing components are
    made and anything squatting on one (a file, a link, a FIFO) is removed first."""
    try:
        return _open_beneath(dirfd, rel, _DIR)
    except OSError as exc:
        if not create or exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise
    fd = dirfd
    try:
        for part in rel.split("/"):
            sub = _subdir(fd, part)
            if fd != dirfd:
                os.close(fd)
            fd = sub
    except BaseException:
        if fd != dirfd:
            os.close(fd)
        raise
    return fd


def _subdir(parent: int, name: str) -> int:
    for _ in range(3):  # a squatter or a concurrent rmdir may cost a round each
        try:
            return os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=parent)
        except FileNotFoundError:
            with contextlib.suppress(FileExistsError):
                os.mkdir(name, dir_fd=parent)
        except OSError as exc:
            if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
                raise
            # Never a directory: another thread may have just repaired this same entry.
            # (unlink cannot remove one, so checking first leaves no race.)
            with contextlib.suppress(FileNotFoundError, IsADirectoryError):
                st = os.stat(name, dir_fd=parent, follow_symlinks=False)
                if not stat.S_ISDIR(st.st_mode):
                    logger.warning("removing %r from the store: not a directory", name)
                    os.unlink(name, dir_fd=parent)
    return os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=parent)


# --- files -------------------------------------------------------------------------------


def read_file(dirfd: int, rel: str, limit: int) -> memoryview | ForeignObject | None:
    """The whole object file at ``rel`` in one pooled buffer; ``None`` when there is none,
    a :class:`ForeignObject` when something else is there or it exceeds ``limit`` bytes.

    One ``readv`` for the whole file: reading in L2-sized chunks and hashing each as it
    arrived measured slower (4 threads, 1 MiB: 220 vs 210 us per object for 256 KiB chunks,
    253 for 128 KiB; the extra syscalls cost more than the cache misses they avoid, since
    1 MiB fits in this machine's 2 MiB L2 anyway)."""
    try:
        fd = _open_read(dirfd, rel)
    except OSError as exc:
        if exc.errno in _ABSENT:
            return None
        if exc.errno in _FOREIGN:
            return ForeignObject(f"cannot be opened as a file ({exc.strerror})")
        raise
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return ForeignObject(f"not a regular file (mode {stat.filemode(st.st_mode)})")
        size = st.st_size
        if size > limit:  # a sparse 1 TB file must not become a 1 TB allocation
            return ForeignObject(f"{size} bytes, more than the store holds ({limit})")
        # A pooled, uninitialised buffer: no zero-fill and no fresh page faults while this
        # thread holds the GIL (a 1 MiB bytearray stalls the event loop thread noticeably).
        view = memoryview(pa.allocate_buffer(size))
        got = 0
        while got < size:  # at most the size fstat saw, even if the file grows meanwhile
            n = os.readv(fd, [view[got:]])
            if n == 0:  # shrank under us: hand back what is there, the checksum decides
                return view[:got]
            got += n
        return view
    finally:
        os.close(fd)


def _open_read(dirfd: int, rel: str) -> int:
    try:
        return _open_beneath(dirfd, rel, _READ | _NOATIME)
    except PermissionError as exc:  # O_NOATIME on a file this process does not own
        if exc.errno != errno.EPERM or not _NOATIME:
            raise
    return _open_beneath(dirfd, rel, _READ)


def create_file(dirfd: int, name: str) -> int:
    """A new file ``name`` in directory ``dirfd``, for writing; a stale entry of that name
    (whatever it is) is removed first."""
    try:
        return os.open(name, _CREATE, 0o644, dir_fd=dirfd)
    except FileExistsError:
        remove_entry(dirfd, name)
    return os.open(name, _CREATE, 0o644, dir_fd=dirfd)


def publish(dirfd: int, tmp: str, name: str) -> None:
    """Rename ``tmp`` over ``name`` (both in ``dirfd``). A rename replaces any file, link or
    FIFO atomically, but not a directory: one squatting there is removed first."""
    try:
        os.replace(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)
    except IsADirectoryError:
        logger.warning("removing a directory at object path %s", name)
        remove_entry(dirfd, name)
        os.replace(tmp, name, src_dir_fd=dirfd, dst_dir_fd=dirfd)


def remove_entry(dirfd: int, name: str) -> bool:
    """Remove ``name`` from directory ``dirfd`` whatever it is, following no link (a
    directory goes with everything in it); False if it was not there."""
    try:
        os.unlink(name, dir_fd=dirfd)
        return True
    except FileNotFoundError:
        return False
    except OSError as exc:  # Linux says EISDIR for a directory, POSIX allows EPERM
        if exc.errno not in (errno.EISDIR, errno.EPERM):
            raise
        if not stat.S_ISDIR(os.stat(name, dir_fd=dirfd, follow_symlinks=False).st_mode):
            raise
    shutil.rmtree(name, dir_fd=dirfd)
    return True


def remove_objects(dirfd: int, rels: Iterable[str]) -> int:
    """Remove objects (``ns/shard/name``); how many were there. A shard path that is not a
    real directory holds none of ours."""
    n = 0
    for rel in rels:
        parent, _, name = rel.rpartition("/")
        try:
            pfd = _open_beneath(dirfd, parent, _DIR)
        except OSError as exc:
            if exc.errno in _ABSENT or exc.errno in _FOREIGN:
                continue
            raise
        try:
            n += remove_entry(pfd, name)
        finally:
            os.close(pfd)
    return n


# --- the restart scan -------------------------------------------------------------------------


def _scan(dirfd: int, max_size: int) -> tuple[list[tuple[str, int]], int, int]:
    """Committed objects (oldest first), temp files removed, foreign entries removed.

    Only regular files are indexed; whatever else sits at an object's or a temp file's path
    is removed, and a namespace or shard name that is not a real directory is skipped (a
    put there replaces it). Nothing here opens anything but directories, so nothing blocks.
    """
    found: list[tuple[int, str, int]] = []
    temps = foreign = 0
    for ns in _entries(dirfd, _NS_RE):
        ns_fd = _scan_subdir(dirfd, ns)
        if ns_fd is None:
            continue
        try:
            for shard in _entries(ns_fd, _SHARD_RE):
                shard_fd = _scan_subdir(ns_fd, shard)
                if shard_fd is None:
                    continue
                try:
                    t, f = _scan_shard(shard_fd, ns, shard, max_size, found)
                finally:
                    os.close(shard_fd)
                temps += t
                foreign += f
        finally:
            os.close(ns_fd)
    found.sort()
    return [(sid, size) for _, sid, size in found], temps, foreign


def _scan_shard(
    dirfd: int, ns: str, shard: str, max_size: int, found: list[tuple[int, str, int]]
) -> tuple[int, int]:
    temps = foreign = 0
    for name in _entries(dirfd, None):
        if name.endswith(".tmp"):
            temps += remove_entry(dirfd, name)
        elif _FILE_RE.fullmatch(name) and name[:2] == shard:
            try:
                st = os.stat(name, dir_fd=dirfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if stat.S_ISREG(st.st_mode) and st.st_size <= max_size:
                found.append((st.st_mtime_ns, ns + name[:64], st.st_size))
            else:
                logger.warning("removing %s/%s/%s: not an object file", ns, shard, name)
                foreign += remove_entry(dirfd, name)
    return temps, foreign


def _entries(dirfd: int, pattern: re.Pattern[str] | None) -> list[str]:
    with os.scandir(dirfd) as it:
        return [e.name for e in it if pattern is None or pattern.fullmatch(e.name)]


def _scan_subdir(dirfd: int, name: str) -> int | None:
    try:
        return os.open(name, _DIR | os.O_NOFOLLOW, dir_fd=dirfd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno not in (errno.ENOTDIR, errno.ELOOP):
            raise
        logger.warning("skipping %r in the store: not a directory", name)
        return None
