"""Local-disk connector: one file per object, atomic publish, a byte budget, restart recovery.

Layout: ``<root>/<namespace hex>/<2 hex shard>/<object hex>.kvb``. Storage ids are validated
hex, so no name from a request can reach the file system.

* **Atomic publish.** An object is written to ``.<name>.<pid>.<n>.tmp`` in its shard and then
  renamed over the final name; with ``fsync=True`` the file is fsynced before the rename and
  the directory after it. A killed process leaves at most a temp file, which the next start
  deletes; a torn file after a power loss (``fsync=False``) fails its checksum on load.
* **Budget.** Committed plus in-flight bytes never exceed ``capacity_bytes``: room is reserved
  before a write starts, least-recently-used objects are evicted to make it, and their files
  are unlinked before the new file is created.
* **Recovery.** :meth:`DiskConnector.start` (run on first use) rebuilds the index by scanning
  the tree, oldest modification first, and trims it to the budget. Only regular files are
  indexed.
* **Nothing in the directory is trusted** (see :mod:`kvplugin.connectors.diskio`). Every file
  operation is relative to the root's descriptor and resolves through no symbolic link, so
  nothing planted in the tree sends a read, write or delete outside it; files are opened
  without waiting (a FIFO, socket or device node cannot block the loop or an I/O thread);
  whatever is not an object file at an object's path (or is bigger than the budget) is a
  miss counted in ``corrupt_detected`` and removed, and a put replaces whatever squats on
  its path, its temp name or its directories.
* **Failures stay local.** ENOSPC/EDQUOT become :class:`StorageFull`, EACCES/EPERM/EROFS
  :class:`StoragePermissionError`, the temp file is removed and the index is unchanged.

* **Loads from the page cache run on the loop.** A load first tries
  :class:`~kvplugin.connectors.nowait.NoWaitReader`, which opens and reads the file only if the
  kernel can serve every path component and every byte from memory, and refuses at once
  otherwise; refused objects go to the I/O threads. It never waits for the device, and at
  most ``inline_read_bytes`` (default 4 MiB) are copied on the loop per call. A hot object
  costs the loop about what the thread hand-off alone would (and saves the thread), so a
  warm disk tier loads at memory-copy speed. ``inline_read_bytes=0`` turns it off.

Everything else that touches the disk runs on a dedicated thread pool. Each object is one
executor job (open, write, fsync, rename; or open, read, verify), so a 1 MiB object costs
one thread hand-off, not four. The payload checksum is computed on the I/O thread, next to
the write or read (xxh3 releases the GIL, so the event loop keeps running meanwhile): a
store gets a :class:`~kvplugin.serde.DraftBlock` from the loop and hashes its payload right
before writing it; a threaded load is verified right after its read (every load is
verified).

A store whose caller times out or is cancelled is settled before the caller gets control
back (see :class:`~kvplugin.connectors.diskwrite.Write`): a write not yet begun is
dropped, one under way finishes from a copy of the caller's bytes taken then, so no later
change to the caller's buffer can reach the disk, and the index stays exact either way.
Jobs on one file never overlap: a write holds its object and its victims, a delete's
unlink its objects, until the job ends, whether or not its caller still waits, and a later
put or delete of those ids waits for it (so a cancelled delete cannot unlink the file a
later put published). ``aclose`` waits at most ``_CLOSE_WAIT`` seconds for file jobs and
reads in flight, so that when it returns the directory is free for the next connector.

One connector per directory, enforced: an open connector holds an exclusive ``flock`` on
the root directory itself, and a second one (in any process) fails to start with
:class:`DirectoryInUse`, which names the holder's pid (from ``<root>/.kvplugin.lock``, an
informational file: removing it releases nothing). The kernel releases the lock when its
holder exits, even by SIGKILL; a thread of a closed connector still stuck on a hung device
keeps it until that thread returns.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import errno
import functools
import itertools
import logging
import os
from typing import TYPE_CHECKING, Any, TypeVar

import aiofiles.os

from kvplugin import serde
from kvplugin.connectors import diskio
from kvplugin.connectors.base import (
    BackendError,
    BackendUnavailable,
    Capabilities,
    ConnectorError,
    Encoded,
    Loaded,
    PutOutcome,
    StorageFull,
    StoragePermissionError,
    StoreBase,
    decode_or_error,
    encode_once,
)
from kvplugin.connectors.diskio import LOCK_NAME, DirectoryInUse, ForeignObject, RootDir
from kvplugin.connectors.diskwrite import Write, write_object
from kvplugin.connectors.eviction import EvictionPolicy, make_policy
from kvplugin.connectors.keys import NS_HEX_LEN, ObjectKey
from kvplugin.connectors.nowait import NoWaitReader
from kvplugin.serde import Block

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable, Sequence

    from typing_extensions import Buffer

T = TypeVar("T")

__all__ = ["LOCK_NAME", "DirectoryInUse", "DiskConnector", "default_io_threads"]

logger = logging.getLogger(__name__)

SUFFIX = ".kvb"
_CLOSE_WAIT = 30.0  # seconds aclose() waits for writes in flight
_FULL = {errno.ENOSPC, errno.EDQUOT}
_DENIED = {errno.EACCES, errno.EPERM, errno.EROFS}
_UNREADABLE = {errno.EACCES, errno.EPERM, errno.EIO}


def default_io_threads(cpus: int | None = None) -> int:
    """The I/O pool's size when none is given: the CPUs this process may run on, less one
    for the event loop, at most 4 (at least 1).

    Why not more: each I/O thread runs some Python between its system calls, so it holds
    the GIL then, and a thread the OS preempts while holding it stalls the loop until it
    runs again. With more runnable threads than cores that happens all the time: on 2
    cores, 4 threads gave a loop lag p99 of 15-20 ms while stores streamed, 1 thread about
    3 ms, for about 2/3 of the write throughput (benchmarks/event_loop.py). A host with
    spare cores gets the throughput back by itself; a deployment can set ``io_threads``
    (the config's ``offload.disk_io_threads``) to trade the other way.
    """
    if cpus is None:
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count() or 1
    return max(1, min(4, cpus - 1))


class DiskConnector(StoreBase):
    """Objects as files under ``root`` within ``capacity_bytes``."""

    tells_existing = True

    def __init__(
        self,
        root: str | os.PathLike[str],
        *,
        capacity_bytes: int,
        fsync: bool = False,
        io_threads: int | None = None,
        inline_read_bytes: int = 4 << 20,
        name: str = "disk",
        secret: bytes | None = None,
        previous_secrets: Sequence[bytes] = (),
        eviction: str | EvictionPolicy = "lru",
    ) -> None:
        """``eviction``: the policy (see :func:`~kvplugin.connectors.eviction.make_policy`);
        the rest: see the class and :class:`~kvplugin.connectors.base.StoreBase`."""
        if type(capacity_bytes) is not int or capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be a positive int, got {capacity_bytes!r}")
        if io_threads is None:
            io_threads = default_io_threads()
        if type(io_threads) is not int or io_threads < 1:
            raise ValueError(f"io_threads must be a positive int or None, got {io_threads!r}")
        if type(inline_read_bytes) is not int or inline_read_bytes < 0:
            raise ValueError(
                f"inline_read_bytes must be a non-negative int, got {inline_read_bytes!r}"
            )
        super().__init__(
            name=name,
            capabilities=Capabilities(
                tier="disk", persistent=True, shared=False, max_object_bytes=capacity_bytes
            ),
            secret=secret,
            previous_secrets=previous_secrets,
        )
        self.root = os.fspath(root)
        self.capacity_bytes = capacity_bytes
        self.fsync = fsync
        self.io_threads = io_threads
        self._executor = self._new_executor()
        self._index: dict[str, int] = {}  # id -> size of every committed object
        self.policy = make_policy(eviction, capacity_bytes)  # their eviction order
        self._used = 0  # bytes of committed objects
        self._reserved = 0  # bytes of writes in flight
        self._pending: dict[str, Write] = {}  # at most one write in flight per id
        # Every file job in flight (write, victim or delete unlink), by the ids it touches:
        # a later job on an id waits for it, so jobs on one file never reorder on the I/O
        # threads and the index follows the file's last change.
        self._busy: dict[str, asyncio.Future[Any]] = {}
        self._born: dict[str, int] = {}  # id -> when it was indexed (see _reads)
        self._indexed = 0
        self._started: asyncio.Task[None] | None = None
        self._ready = False
        self._tmp_names = itertools.count()
        self._root: RootDir | None = None  # the open, locked directory (see diskio)
        # Cached reads on the loop: at most this many bytes per call (0: never).
        self.inline_read_bytes = inline_read_bytes
        self._nowait = NoWaitReader.create() if inline_read_bytes else None
        self.inline_reads = 0  # loads served on the loop from the page cache

    # lifecycle ----------------------------------------------------------------------------

    async def start(self) -> None:
        """Scan the directory and rebuild the index (idempotent; also done on first use)."""
        if self._ready:
            return
        if self._started is None:
            self._started = asyncio.ensure_future(self._scan())
        # Shielded: a caller's deadline must not abandon the scan half way.
        await asyncio.shield(self._started)

    async def _scan(self) -> None:
        job = self._executor.submit(diskio.lock_and_scan, self.root, self.capacity_bytes)
        try:
            root, found, temps, foreign = await asyncio.wrap_future(job)
        except OSError as exc:
            self._failed_start()
            raise _os_error(exc, f"scanning {self.root}") from exc
        except ConnectorError:  # e.g. the directory's owner exits later
            self._failed_start()
            raise
        except asyncio.CancelledError:  # the loop is going away: let the directory go
            self._started = None
            job.add_done_callback(_close_scanned_root)
            raise
        if self._closed:  # closed while the scan ran: let the directory go again
            root.close()
            return
        self._root = root
        self._stats.refused("format", foreign)  # removed: not object files
        for sid, size in found:
            self._add(sid, size)
        victims = self._evict_until(0)
        if victims:
            await self._unlink(victims)
        self._ready = True
        logger.info(
            "%s: %d objects (%d bytes) recovered from %s; %d temp files and %d foreign "
            "entries removed, %d evicted",
            self.name,
            len(self._index),
            self._used,
            self.root,
            temps,
            foreign,
            len(victims),
        )

    def _new_executor(self) -> concurrent.futures.ThreadPoolExecutor:
        # Threads start on the first job (the scan), not here: building takes nothing.
        return concurrent.futures.ThreadPoolExecutor(
            self.io_threads, thread_name_prefix=f"kvplugin-{self.name}"
        )

    def _failed_start(self) -> None:
        """The scan failed (lock_and_scan closed what it opened): give back its thread too,
        and let a later call start again from scratch."""
        self._started = None
        # The job is done, so the pool's threads are idle and exit at once.
        self._executor.shutdown(wait=True)
        self._executor = self._new_executor()

    async def _close(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _CLOSE_WAIT
        pending = set(self._busy.values())
        if pending:  # file jobs in flight finish: no temp file left, no unlink after reopen
            _, stuck = await asyncio.wait(pending, timeout=_CLOSE_WAIT)
            if stuck:  # a hung device must not hang shutdown; the next start cleans up
                logger.warning("%s: closing with %d file jobs still running", self.name,
                               len(stuck))
        self._executor.shutdown(wait=False)
        root, self._root = self._root, None
        if root is not None:
            await self._unlock_root(root, deadline - loop.time())

    async def _unlock_root(self, root: RootDir, timeout: float) -> None:
        """Close the directory and wait (within what is left of the close's wait) for reads
        a cancelled caller left on the threads: when ``aclose`` returns, the lock is gone and
        a new connector on this directory starts, in this process or another."""
        loop = asyncio.get_running_loop()
        released: asyncio.Future[None] = loop.create_future()

        def tell() -> None:  # on the last job's thread
            with contextlib.suppress(RuntimeError):  # the loop closed without waiting
                loop.call_soon_threadsafe(_resolve, released)

        if root.close(on_released=tell):
            return
        done, _ = await asyncio.wait({released}, timeout=max(timeout, 0.0))
        if not done:
            logger.warning("%s: closed; a thread still on the disk keeps %s locked until it "
                           "returns", self.name, root.path)

    @property
    def used_bytes(self) -> int:
        return self._used

    def __len__(self) -> int:
        return len(self._index)

    def objects(self) -> dict[str, int]:
        """The index: storage id -> bytes of each committed object, least recently used
        first under LRU: the policy's order (a copy; for tools and tests)."""
        return {sid: self._index[sid] for sid in self.policy.order()}

    async def quiesce(self) -> None:
        """Wait until no file job is in flight, including those whose callers stopped
        waiting (an abandoned write, a cancelled delete's unlink): afterwards the index and
        the files agree."""
        while self._busy:
            await asyncio.wait(set(self._busy.values()))

    def path_for(self, sid: str) -> str:
        """The final file path of a storage id (validated hex: nothing to escape)."""
        return f"{self.root}/{_rel(sid)}"

    # primitives -----------------------------------------------------------------------------

    def _encode(self, block: Block) -> Encoded:
        # A draft: the I/O thread hashes the payload as it writes it (see diskwrite.write_object).
        if block.encoded is not None:
            return encode_once(block, self.codec)
        return serde.prepare(block.meta, block.payload, self.codec)

    async def _prefix_present(self, ids: list[str]) -> int:
        if not self._ready:
            await self.start()
        n = 0
        for sid in ids:
            if sid not in self._index:
                break
            n += 1
        return n

    async def _fetch(self, ids: list[str]) -> list[Buffer | None]:
        reads = await self._reads(ids, diskio.read_file)
        return [None if isinstance(r, ForeignObject) else r for r in reads]

    async def _load(self, keys: list[ObjectKey]) -> list[Loaded]:
        # The payload is hashed on the I/O thread right after the read (cache-hot, GIL
        # free); the rest of the verification (envelope, frame checksum, metadata) is small
        # Python and runs here: on the I/O threads it waited for the GIL behind the loop.
        ids = [k.id for k in keys]
        reads = await self._reads(ids, functools.partial(_read_hashed, codec=self.codec))
        out: list[Loaded] = []
        for sid, r in zip(ids, reads, strict=True):
            if r is None or isinstance(r, ForeignObject):  # a foreign one is dropped as corrupt
                out.append(r)
            else:
                out.append(decode_or_error(r[0], sid, r[1], codec=self.codec))
        return out

    def _load_now(self, keys: list[ObjectKey]) -> tuple[list[Loaded], Sequence[int]]:
        """Load on the loop what the kernel can serve from memory without waiting (see
        :mod:`kvplugin.connectors.nowait`), at most ``inline_read_bytes`` per call; the rest goes to
        the I/O threads.

        The loop pays about as much per object either way (measured, 1 MiB: 62 us of loop
        time through a thread, with the future hand-off and decoding, against 67 us inline),
        so this saves the threads' CPU and the hand-off latency; the allowance bounds how
        long one call holds the loop."""
        out: list[Loaded] = [None] * len(keys)
        reader, index, root = self._nowait, self._index, self._root
        if reader is None or not reader.supported or not self._ready or root is None:
            return out, range(len(keys))
        left = self.inline_read_bytes
        rest = []
        for i, key in enumerate(keys):
            sid = key.id
            # Beneath the root's descriptor, through no link; anything unusual (not cached,
            # not a regular file, ...) is left to the threads, which look at it properly.
            raw = reader.read(_rel(sid), left, root.fd) if sid in index else None
            if raw is None:
                rest.append(i)
                if not reader.supported:  # switched itself off: the threads do the rest
                    rest.extend(range(i + 1, len(keys)))
                    break
                continue
            left -= raw.nbytes
            self.inline_reads += 1
            out[i] = decode_or_error(raw, sid, codec=self.codec)
        for key, got in zip(reversed(keys), reversed(out), strict=True):
            if got is not None:  # read here (the rest: on the threads, touched there)
                self.policy.touched(key.id)  # tail first: a chain's head the most recent
        return out, rest

    async def _reads(
        self, ids: list[str], read: Callable[[int, str, int], T | ForeignObject | None]
    ) -> list[T | ForeignObject | None]:
        """Run ``read(root_fd, rel_path, max_bytes)`` on the I/O threads per indexed id;
        unreadable or vanished files are misses, foreign ones come back as values."""
        if not self._ready:
            await self.start()
        root = self._root
        if root is None:
            raise BackendUnavailable(f"{self.name} is closed")
        index = self._index
        began = self._indexed  # an entry indexed after this is not the file these reads saw
        wanted = [i for i, sid in enumerate(ids) if sid in index]
        for i in reversed(wanted):  # tail first: a chain's head the most recent
            self.policy.touched(ids[i])
        ex, cap = self._executor, self.capacity_bytes
        jobs = [_in_thread(root.run, read, _rel(ids[i]), cap, executor=ex) for i in wanted]
        if len(jobs) == 1:  # the common case, without a task per file
            try:
                results: list[object] = [await jobs[0]]
            except OSError as exc:
                results = [exc]
        else:
            results = await asyncio.gather(*jobs, return_exceptions=True)
        out: list[T | ForeignObject | None] = [None] * len(ids)
        for i, res in zip(wanted, results, strict=True):
            # A ForeignObject is a value (an exception, but returned, never raised).
            sid = ids[i]
            current = self._born.get(sid, began + 1) <= began
            if isinstance(res, BaseException) and not isinstance(res, ForeignObject):
                self._read_failed(sid, res, current)
            elif res is None:  # deleted behind our back (unless it was put again since)
                if current:
                    self._forget(sid)
                    self._evicted((sid,), "gone")
            else:
                out[i] = res  # type: ignore[assignment]
        return out

    def _read_failed(self, sid: str, exc: BaseException, current: bool) -> None:
        """One unreadable file is one miss, not a failed batch."""
        if not isinstance(exc, OSError):
            raise exc
        self._stats.errors += 1
        logger.warning("%s: reading %s failed: %s", self.name, sid, exc)
        if exc.errno in _UNREADABLE and current:
            # For good, as far as we can tell: forget it, so that lookups agree with loads
            # and a later put replaces the file instead of answering EXISTS forever.
            self._forget(sid)
            self._evicted((sid,), "gone")

    async def _store(
        self, items: list[tuple[str, Encoded]], *, overwrite: bool
    ) -> list[PutOutcome]:
        if not self._ready:
            await self.start()
        if len(items) == 1:  # the common case, without a task per item
            return [await self._store_one(*items[0], overwrite)]
        # Tail first: evictions and the policy see a chain's head last (see _take).
        results = await asyncio.gather(
            *(self._store_one(sid, enc, overwrite) for sid, enc in reversed(items)),
            return_exceptions=True,
        )
        for res in results:
            if isinstance(res, BaseException):
                raise res
        results.reverse()
        return results  # type: ignore[return-value]

    async def _store_one(self, sid: str, enc: Encoded, overwrite: bool) -> PutOutcome:
        size = enc.nbytes
        # Everything is checked again after each wait: another put of this id may have begun
        # or ended meanwhile. One write per id at a time keeps _pending exact, so every
        # reserved byte belongs to a write that can be waited for.
        while True:
            busy = self._busy.get(sid)
            if busy is not None:  # a job on this file is in flight: wait for it
                await asyncio.wait([busy])
            elif sid in self._index and not overwrite:
                self.policy.touched(sid)
                self._committed((sid,))
                return PutOutcome.EXISTS
            elif size > self.capacity_bytes:
                return PutOutcome.REJECTED
            elif size + self._reserved > self.capacity_bytes:
                # The budget is held by writes in flight: wait for one instead of overshooting.
                held = [w.done for w in self._pending.values()]
                await asyncio.wait(held, return_when=asyncio.FIRST_COMPLETED)
            else:
                break
        root = self._root
        if root is None:
            raise BackendUnavailable(f"{self.name} is closed")
        victims = self._evict_until(size, sid)
        if sid in self._index:  # an overwrite: the old file goes first, like a victim
            self._forget(sid)
            victims.append(sid)
        return await self._write_file(root, sid, enc, victims)

    async def _write_file(
        self, root: RootDir, sid: str, enc: Encoded, victims: list[str]
    ) -> PutOutcome:
        directory, _, name = _rel(sid).rpartition("/")
        tmp = f".{sid[NS_HEX_LEN:]}.{os.getpid()}.{next(self._tmp_names)}.tmp"
        loop = asyncio.get_running_loop()
        # Two futures: ``write.done`` marks the write as pending for the budget and for
        # later writers of the same object, and no caller ever awaits it directly, so
        # nothing cancels it; ``waiter`` is the caller's. _write_done keeps the index and
        # the budget exact however the write ends, then wakes the caller. The job reports
        # back with one call_soon_threadsafe (run_in_executor would add a wrapping future
        # and two chaining callbacks, ~4 us of loop time per store).
        write = Write(loop.create_future())
        waiter: asyncio.Future[None] = loop.create_future()
        job = self._executor.submit(
            root.run, write_object, directory, name, tmp, enc, self.fsync,
            [_rel(v) for v in victims], write,
        )
        self._reserved += enc.nbytes
        self._pending[sid] = write
        held = (sid, *victims)
        for v in held:
            self._busy[v] = write.done
        report = functools.partial(self._write_done, held, enc.nbytes, waiter, write)
        job.add_done_callback(functools.partial(_call_on, loop, report))
        try:
            await waiter
        except OSError as exc:
            raise _os_error(exc, f"writing {self.path_for(sid)}") from exc
        except asyncio.CancelledError:
            # Cancelled, or out of time: the caller gets control back when this propagates
            # and may reuse its buffers at once, so the job must be done with them first.
            write.abandon(enc)
            raise
        return PutOutcome.WRITTEN

    def _write_done(
        self,
        held: tuple[str, ...],
        size: int,
        waiter: asyncio.Future[None],
        write: Write,
        job: concurrent.futures.Future[bool],
    ) -> None:
        """Runs on the loop when a write job ends, before any waiter resumes."""
        sid = held[0]
        self._reserved -= size
        if self._pending.get(sid) is write:
            del self._pending[sid]
        self._release(write.done, held)
        write.done.set_result(None)
        exc = None if job.cancelled() else job.exception()
        published = exc is None and not job.cancelled() and job.result()
        if exc is not None:
            logger.debug("%s: writing %s failed: %s", self.name, sid, exc)
        if published:
            self._forget(sid)
            self._add(sid, size)
            self._committed((sid,))
        if waiter.done():  # the caller was cancelled: nobody to tell
            return
        if job.cancelled():
            waiter.cancel()
        elif exc is not None:
            waiter.set_exception(exc)
        elif not published:  # only an abandoned write is dropped, so this is defensive
            waiter.set_exception(OSError(errno.ECANCELED, "the write was dropped"))
        else:
            waiter.set_result(None)

    async def _remove(self, ids: list[str]) -> int:
        if not self._ready:
            await self.start()
        while True:  # jobs on these files end first (and a new one may begin meanwhile)
            busy = {self._busy[sid] for sid in ids if sid in self._busy}
            if not busy:
                break
            await asyncio.wait(busy)
        for sid in ids:
            self._forget(sid)
        return await self._unlink(ids)

    async def _ping(self) -> None:
        if not self._ready:
            await self.start()
        root = self._root
        if root is None:
            raise BackendUnavailable(f"{self.name} is closed")
        try:
            problem = await _in_thread(
                root.run, diskio.root_problem, self.root, self.capacity_bytes - self._used,
                executor=self._executor)
        except OSError as exc:
            raise _os_error(exc, f"checking {self.root}") from exc
        if problem is not None:
            raise BackendUnavailable(problem)

    # index helpers --------------------------------------------------------------------------

    def _add(self, sid: str, size: int) -> None:
        self._indexed += 1
        self._index[sid] = size
        self.policy.inserted(sid, size)
        self._born[sid] = self._indexed
        self._used += size

    def _forget(self, sid: str) -> None:
        size = self._index.pop(sid, None)
        if size is not None:
            self.policy.removed(sid)
            self._used -= size
            del self._born[sid]

    def _release(self, job: asyncio.Future[Any], ids: Sequence[str]) -> None:
        """A file job ended: the ids it held are free for the next one."""
        for sid in ids:
            if self._busy.get(sid) is job:
                del self._busy[sid]

    def _evict_until(self, incoming: int, sid: str | None = None) -> list[str]:
        """Drop the policy's victims until ``incoming`` more bytes (of object ``sid``) fit;
        the caller unlinks them."""
        victims = []
        while self._index and self._used + self._reserved + incoming > self.capacity_bytes:
            victim = self.policy.evict(sid)
            if victim is None:  # the policy lost track of what is held: a bug, never a hang
                raise RuntimeError(f"{self.name}: {len(self._index)} objects held but the "
                                   f"eviction policy {self.policy.name!r} has no victim")
            self._used -= self._index.pop(victim)
            del self._born[victim]
            victims.append(victim)
        self._stats.evicted += len(victims)
        self._evicted(victims)
        return victims

    async def _unlink(self, ids: Sequence[str]) -> int:
        root = self._root
        if root is None:
            raise BackendUnavailable(f"{self.name} is closed")
        loop = asyncio.get_running_loop()
        # Held in _busy until the job ends, which a cancelled caller does not wait for: a
        # put of one of these ids waits for it, so the unlink cannot remove the new file.
        done: asyncio.Future[concurrent.futures.Future[int]] = loop.create_future()
        job = self._executor.submit(root.run, diskio.remove_objects, [_rel(s) for s in ids])
        for sid in ids:
            self._busy[sid] = done
        job.add_done_callback(functools.partial(_call_on, loop, functools.partial(
            self._unlinked, done, ids)))
        try:
            return (await asyncio.shield(done)).result()
        except OSError as exc:
            raise _os_error(exc, "deleting objects") from exc

    def _unlinked(self, done: asyncio.Future[Any], ids: Sequence[str],
                  job: concurrent.futures.Future[int]) -> None:
        self._release(done, ids)
        done.set_result(job)


def _apply(func: Callable[..., T], *args: object) -> T:
    return func(*args)


# Reads, deletes and health checks: one job each on the connector's I/O threads, through
# aiofiles' executor wrapper (stores submit to the executor directly, see _store_one).
_in_thread: Callable[..., Awaitable[Any]] = aiofiles.os.wrap(_apply)


def _call_on(loop: asyncio.AbstractEventLoop, callback: Callable[[T], object], job: T) -> None:
    """Run ``callback(job)`` on ``loop`` (from a worker thread); a closed loop means the
    connector is gone and nobody is left to tell."""
    with contextlib.suppress(RuntimeError):
        loop.call_soon_threadsafe(callback, job)


def _os_error(exc: OSError, what: str) -> ConnectorError:
    if exc.errno in _FULL:
        return StorageFull(f"{what}: disk full ({exc.strerror})")
    if exc.errno in _DENIED:
        return StoragePermissionError(f"{what}: permission denied ({exc.strerror})")
    return BackendError(f"{what}: {exc}")


def _resolve(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)


def _close_scanned_root(job: concurrent.futures.Future[diskio.Scanned]) -> None:
    """A scan finished after its connector stopped waiting for it: release the directory."""
    if not job.cancelled() and job.exception() is None:
        job.result()[0].close()


def _rel(sid: str) -> str:
    """``<namespace>/<shard>/<object>.kvb``: where an object lives beneath the root."""
    ns, obj = sid[:NS_HEX_LEN], sid[NS_HEX_LEN:]
    return f"{ns}/{obj[:2]}/{obj}{SUFFIX}"


PayloadDigest = tuple[int, int, bytes]


def _read_hashed(
    root_fd: int, rel: str, limit: int, codec: serde.Codec
) -> tuple[memoryview, PayloadDigest | None] | ForeignObject | None:
    raw = diskio.read_file(root_fd, rel, limit)
    if raw is None or isinstance(raw, ForeignObject):
        return raw
    return raw, serde.hash_payload(raw, codec)
