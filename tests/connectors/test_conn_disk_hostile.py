"""Disk connector: whatever sits in its directory (FIFOs, sockets, device nodes,
directories, symbolic links, huge files) never blocks the loop or a thread, never sends a
read or a write outside the root, and costs at most a counted miss; the directory lock
survives its file being removed and a full disk.

Tests that would hang on a blocking open run a watchdog thread that opens the FIFOs for
writing after a grace period, which releases any reader stuck in ``open``; the test then
fails instead of hanging.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator

import pyarrow as pa
import pytest
from conn_testlib import T, make_items, namespace, same

from kvplugin.connectors import disk as disk_mod
from kvplugin.connectors import diskio, diskwrite
from kvplugin.connectors.base import PutItem
from kvplugin.connectors.disk import DirectoryInUse, DiskConnector
from kvplugin.serde import encode

pytestmark = pytest.mark.asyncio
MIB = 1 << 20
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
READ_PATHS = ["inline", "threads"]


@pytest.fixture(params=["openat2", "walk"])
def resolver(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """How paths are resolved beneath the root: openat2, or the per-component walk that
    kernels without it (before 5.6) get."""
    if request.param == "walk":
        monkeypatch.setattr(diskio, "_OPENAT2", None)
    elif diskio._OPENAT2 is None:
        pytest.skip("no openat2 on this kernel")
    return str(request.param)


def connector(root: str, read_path: str = "inline", **kw: object) -> DiskConnector:
    inline = 4 * MIB if read_path == "inline" else 0
    return DiskConnector(root, capacity_bytes=8 * MIB, inline_read_bytes=inline, **kw)  # type: ignore[arg-type]


@contextlib.asynccontextmanager
async def stored(
    tmp_path: os.PathLike[str], read_path: str, n: int = 2
) -> AsyncIterator[tuple[DiskConnector, list[PutItem]]]:
    items = make_items(namespace(), n)
    async with connector(os.path.join(tmp_path, "d"), read_path) as conn:
        assert await conn.put(items, timeout=T) == n
        yield conn, items


@contextlib.contextmanager
def fifo_watchdog(paths: list[str], grace: float = 1.5) -> Iterator[list[str]]:
    """Yields the FIFOs some reader was found blocked on (opening them for writing lets
    that reader go, so a blocking read fails the test instead of hanging it)."""
    rescued: list[str] = []
    stop = threading.Event()

    def watch() -> None:
        if stop.wait(grace):
            return
        while True:
            for path in paths:
                try:  # succeeds only if a reader has the FIFO open (or is opening it)
                    fd = os.open(path, os.O_WRONLY | os.O_NONBLOCK)
                except OSError:
                    continue
                rescued.append(path)
                os.close(fd)
            if stop.wait(0.2):
                return

    thread = threading.Thread(target=watch, daemon=True)
    thread.start()
    try:
        yield rescued
    finally:
        stop.set()
        thread.join()


def replace_with(path: str, kind: str, target: str | None = None) -> None:
    """Put something that is not an object file at ``path``."""
    if os.path.lexists(path):
        if os.path.isdir(path) and not os.path.islink(path):
            os.rmdir(path)
        else:
            os.unlink(path)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":
        os.mknod(path, stat.S_IFSOCK | 0o600)
    elif kind == "device":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, 5))  # /dev/zero
        except PermissionError:
            pytest.skip("creating device nodes needs CAP_MKNOD")
    elif kind == "directory":
        os.makedirs(os.path.join(path, "inside"))
        with open(os.path.join(path, "inside", "f"), "w") as f:
            f.write("x")
    elif kind == "symlink":
        assert target is not None
        os.symlink(target, path)
    else:
        raise ValueError(kind)


def outside_object(tmp_path: os.PathLike[str], item: PutItem) -> str:
    """A valid object file outside the store's root (what a planted link points to)."""
    path = os.path.join(tmp_path, "outside", "victim.kvb")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as f:
        f.write(encode(item[1].meta, item[1].payload).join())
    return path


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


# --- non-regular files at object paths --------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "socket", "device", "directory", "symlink"])
@pytest.mark.parametrize("read_path", READ_PATHS)
async def test_whatever_sits_at_an_object_path_is_a_counted_miss_and_removed(
    tmp_path: os.PathLike[str], read_path: str, kind: str, resolver: str
) -> None:
    async with stored(tmp_path, read_path) as (conn, items):
        path = conn.path_for(items[0][0].id)
        target = outside_object(tmp_path, items[0])
        replace_with(path, kind, target)
        with fifo_watchdog([path]) as rescued:
            async with asyncio.timeout(T):
                got = await conn.get([k for k, _ in items], timeout=1.0)
        assert not rescued, "a read blocked on the FIFO"
        assert got[0] is None and same(got[1], items[1][1])
        assert conn.stats().corrupt_detected == 1 and conn.stats().errors == 0
        assert not os.path.lexists(path), "the squatter is removed"
        assert os.path.exists(target), "nothing outside the root is touched"
        assert len(conn) == 1
        # The key is free again: a put stores it and a get finds it.
        assert await conn.put(items[:1], timeout=T) == 1 and conn.stats().stored == 3
        assert same((await conn.get([items[0][0]], timeout=T))[0], items[0][1])


async def test_fifos_never_wedge_the_io_threads(tmp_path: os.PathLike[str]) -> None:
    """More FIFOs than threads, read on the threads: later calls still work, aclose ends."""
    root = os.path.join(tmp_path, "d")
    items = make_items(namespace(), 8)
    conn = DiskConnector(root, capacity_bytes=8 * MIB, inline_read_bytes=0, io_threads=2)
    await conn.put(items, timeout=T)
    fifos = [conn.path_for(k.id) for k, _ in items[:6]]
    for path in fifos:
        replace_with(path, "fifo")
    with fifo_watchdog(fifos) as rescued:
        async with asyncio.timeout(T):
            for key, _ in items[:6]:
                assert await conn.get([key], timeout=0.5) == [None]
            more = make_items(namespace(), 2, seed=1)
            assert await conn.put(more, timeout=1.0) == 2
            got = await conn.get([k for k, _ in items[6:] + more], timeout=1.0)
            assert all(g is not None for g in got)
            await conn.aclose()
    assert not rescued, "an I/O thread blocked on a FIFO"


async def test_a_file_bigger_than_the_store_is_never_read_whole(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = os.path.join(tmp_path, "d")
    items = make_items(namespace(), 1)
    async with DiskConnector(root, capacity_bytes=MIB, inline_read_bytes=0) as conn:
        await conn.put(items, timeout=T)
        path = conn.path_for(items[0][0].id)
        with open(path, "r+b") as f:  # grown in place, sparse: 64 times the budget
            f.truncate(64 * MIB)
        sizes: list[int] = []
        real = pa.allocate_buffer

        def recording(size: int, *args: object, **kw: object) -> object:
            sizes.append(size)
            return real(size, *args, **kw)

        monkeypatch.setattr(pa, "allocate_buffer", recording)
        assert await conn.get([items[0][0]], timeout=T) == [None]
        assert all(size <= MIB for size in sizes), f"allocated {max(sizes)} bytes"
        assert conn.stats().corrupt_detected == 1 and not os.path.exists(path)


# --- links and squatters on the directories ---------------------------------------------------


@pytest.mark.parametrize("level", ["namespace", "shard"])
async def test_a_linked_directory_never_leads_outside_the_root(
    tmp_path: os.PathLike[str], level: str, resolver: str
) -> None:
    root = os.path.join(tmp_path, "d")
    items = make_items(namespace(), 2)
    async with DiskConnector(root, capacity_bytes=8 * MIB) as conn:
        await conn.put(items[:1], timeout=T)
        obj_path = conn.path_for(items[0][0].id)
        link = os.path.dirname(obj_path)
        if level == "namespace":
            link = os.path.dirname(link)
        # The directory moves outside and a link takes its place: reads, deletes and
        # writes through it would all reach the outside copy.
        outside = os.path.join(tmp_path, "outside")
        os.rename(link, outside)
        os.symlink(outside, link)
        outside_files = sorted(os.path.relpath(os.path.join(d, n), outside)
                               for d, _, names in os.walk(outside) for n in names)  # fmt: skip
        assert await conn.get([items[0][0]], timeout=T) == [None]
        await conn.delete([items[0][0]], timeout=T)
        assert await conn.put(items, timeout=T) == 2  # the link is replaced by a directory
        assert not os.path.islink(link)
        got = await conn.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        after = sorted(os.path.relpath(os.path.join(d, n), outside)
                       for d, _, names in os.walk(outside) for n in names)  # fmt: skip
        assert after == outside_files, "something outside the root changed"


async def test_a_file_where_a_shard_directory_belongs_is_replaced_by_a_put(
    tmp_path: os.PathLike[str], resolver: str
) -> None:
    root = os.path.join(tmp_path, "d")
    items = make_items(namespace(), 1)
    async with DiskConnector(root, capacity_bytes=8 * MIB) as conn:
        await conn.put(items, timeout=T)
        shard = os.path.dirname(conn.path_for(items[0][0].id))
        for name in os.listdir(shard):
            os.unlink(os.path.join(shard, name))
        os.rmdir(shard)
        with open(shard, "w") as f:
            f.write("in the way")
        assert await conn.get([items[0][0]], timeout=T) == [None]
        assert len(conn) == 0
        assert await conn.put(items, timeout=T) == 1
        assert same((await conn.get([items[0][0]], timeout=T))[0], items[0][1])


@pytest.mark.parametrize("kind", ["directory", "fifo"])
async def test_a_put_replaces_what_squats_on_its_path(
    tmp_path: os.PathLike[str], kind: str
) -> None:
    """At the object's path (a directory: a rename cannot replace it) or at the temp name
    the next write will use (a FIFO: an exclusive create fails on it)."""
    root = os.path.join(tmp_path, "d")
    items = make_items(namespace(), 1)
    async with DiskConnector(root, capacity_bytes=8 * MIB) as conn:
        await conn.start()
        path = conn.path_for(items[0][0].id)
        os.makedirs(os.path.dirname(path))
        if kind == "directory":
            replace_with(path, "directory")
        else:  # the first write of a fresh connector uses temp number 0
            name = os.path.basename(path)[: -len(disk_mod.SUFFIX)]
            replace_with(os.path.join(os.path.dirname(path), f".{name}.{os.getpid()}.0.tmp"), kind)
        assert await conn.put(items, timeout=T) == 1
        assert same((await conn.get([items[0][0]], timeout=T))[0], items[0][1])
        assert os.listdir(os.path.dirname(path)) == [os.path.basename(path)]


# --- the restart scan ---------------------------------------------------------------------------


async def test_the_scan_indexes_regular_files_only_and_never_blocks(
    tmp_path: os.PathLike[str],
) -> None:
    root = os.path.join(tmp_path, "d")
    items = make_items(namespace(), 6)
    async with DiskConnector(root, capacity_bytes=8 * MIB) as conn:
        await conn.put(items, timeout=T)
        paths = [conn.path_for(k.id) for k, _ in items]
    target = outside_object(tmp_path, items[0])
    replace_with(paths[0], "fifo")
    replace_with(paths[1], "directory")
    replace_with(paths[2], "symlink", target)
    replace_with(paths[3], "socket")
    shard = os.path.dirname(paths[4])
    fifo_tmp = os.path.join(shard, ".a.1.2.tmp")
    replace_with(fifo_tmp, "fifo")
    dir_tmp = os.path.join(shard, ".b.1.2.tmp")
    replace_with(dir_tmp, "directory")
    linked_ns = os.path.join(root, "f" * 32)  # a namespace name linked to a real tree
    os.symlink(os.path.dirname(os.path.dirname(paths[4])), linked_ns)
    with fifo_watchdog([paths[0], fifo_tmp]) as rescued:
        async with asyncio.timeout(T), DiskConnector(root, capacity_bytes=8 * MIB) as conn:
            await conn.start()
            assert sorted(conn._index) == sorted(k.id for k, _ in items[4:])
            assert conn.used_bytes == sum(os.path.getsize(p) for p in paths[4:])
    assert not rescued
    for path in [*paths[:4], fifo_tmp, dir_tmp]:
        assert not os.path.lexists(path), f"{path} was left"
    assert os.path.exists(target) and os.path.islink(linked_ns)


async def test_a_temp_directory_does_not_stop_the_store_from_starting(
    tmp_path: os.PathLike[str],
) -> None:
    root = os.path.join(tmp_path, "d")
    items = make_items(namespace(), 1)
    async with DiskConnector(root, capacity_bytes=8 * MIB) as conn:
        await conn.put(items, timeout=T)
        shard = os.path.dirname(conn.path_for(items[0][0].id))
    os.makedirs(os.path.join(shard, ".x.1.2.tmp", "deeper"))
    async with DiskConnector(root, capacity_bytes=8 * MIB) as conn:
        assert await conn.lookup([items[0][0]], timeout=T) == 1
        assert (await conn.health(timeout=T)).ok


# --- the lock ----------------------------------------------------------------------------------


async def test_a_full_disk_at_start_leaks_nothing_and_locks_nobody_out(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = os.path.join(tmp_path, "d")
    items = make_items(namespace(), 1)
    before = open_fds()

    def full(*args: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwrite", full)  # writing the pid (and truncating) fails
    monkeypatch.setattr(os, "ftruncate", full)
    first = DiskConnector(root, capacity_bytes=MIB)
    with contextlib.suppress(Exception):
        await first.start()  # the pid is only information: this start may succeed
    await first.aclose()
    monkeypatch.undo()
    assert open_fds() == before, "a descriptor leaked"
    async with DiskConnector(root, capacity_bytes=MIB) as second:  # space is back
        assert await second.put(items, timeout=T) == 1
    assert open_fds() == before


async def test_a_failed_scan_leaks_nothing_and_a_retry_works(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = os.path.join(tmp_path, "d")
    items = make_items(namespace(), 1)
    before = open_fds()

    def failing(*args: object) -> None:
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(os, "scandir", failing)
    conn = DiskConnector(root, capacity_bytes=MIB)
    with pytest.raises(Exception, match="I/O error"):
        await conn.put(items, timeout=T)
    assert open_fds() == before
    monkeypatch.undo()
    assert await conn.put(items, timeout=T) == 1  # the same connector retries its start
    await conn.aclose()
    assert open_fds() == before


async def test_removing_the_lock_file_does_not_let_a_second_connector_in(
    tmp_path: os.PathLike[str],
) -> None:
    root = os.path.join(tmp_path, "d")
    async with DiskConnector(root, capacity_bytes=MIB) as first:
        await first.start()
        os.unlink(os.path.join(root, disk_mod.LOCK_NAME))
        second = DiskConnector(root, capacity_bytes=MIB)
        with pytest.raises(DirectoryInUse):
            await second.start()
        await second.aclose()
        third = DiskConnector(root, capacity_bytes=MIB)
        with pytest.raises(DirectoryInUse):  # not with the file back either
            await third.start()
        await third.aclose()
    async with DiskConnector(root, capacity_bytes=MIB) as third:  # free once closed
        await third.start()


HOLDER = """
import asyncio, sys
from kvplugin.connectors.disk import DiskConnector

async def main(root):
    conn = DiskConnector(root, capacity_bytes=1 << 20)
    await conn.start()
    print("started", flush=True)
    await asyncio.sleep(3600)  # until SIGKILL

asyncio.run(main(sys.argv[1]))
"""


async def test_removing_the_lock_file_of_another_process_does_not_let_us_in(
    tmp_path: os.PathLike[str],
) -> None:
    root = os.path.join(tmp_path, "d")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, root],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    conn = DiskConnector(root, capacity_bytes=MIB)
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "started\n", proc.stderr.read() if proc.stderr else ""
        os.unlink(os.path.join(root, disk_mod.LOCK_NAME))
        with pytest.raises(DirectoryInUse):
            await conn.start()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    await conn.start()  # the kernel dropped the lock with the process
    await conn.aclose()


@pytest.mark.parametrize("kind", ["fifo", "symlink", "directory"])
async def test_whatever_sits_at_the_lock_file_never_blocks_or_gets_written_through(
    tmp_path: os.PathLike[str], kind: str
) -> None:
    root = os.path.join(tmp_path, "d")
    os.makedirs(root)
    target = os.path.join(tmp_path, "precious")
    with open(target, "w") as f:
        f.write("keep me")
    lock = os.path.join(root, disk_mod.LOCK_NAME)
    replace_with(lock, kind, target)
    before = open_fds()
    with fifo_watchdog([lock]) as rescued:
        async with asyncio.timeout(T), DiskConnector(root, capacity_bytes=MIB) as conn:
            assert await conn.put(make_items(namespace(), 1), timeout=T) == 1
            second = DiskConnector(root, capacity_bytes=MIB)
            with pytest.raises(DirectoryInUse):
                await second.start()
            await second.aclose()
    assert not rescued
    with open(target) as f:
        assert f.read() == "keep me"
    assert open_fds() == before


# --- shutting down ------------------------------------------------------------------------------


async def test_aclose_is_bounded_by_a_stuck_write_and_the_directory_stays_taken_meanwhile(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    root = os.path.join(tmp_path, "d")
    release = threading.Event()
    real = diskwrite._write_all

    def stuck(fd: int, parts: object) -> None:
        release.wait(30)
        real(fd, parts)  # type: ignore[arg-type]

    monkeypatch.setattr(diskwrite, "_write_all", stuck)
    monkeypatch.setattr(disk_mod, "_CLOSE_WAIT", 0.2)
    conn = DiskConnector(root, capacity_bytes=MIB)
    await conn.start()
    task = asyncio.ensure_future(conn.put(make_items(namespace(), 1), timeout=T))
    await asyncio.sleep(0.05)
    started = time.monotonic()
    await conn.aclose()
    assert time.monotonic() - started < 2.0
    # The stuck thread may still write there: nobody else may use the directory yet.
    second = DiskConnector(root, capacity_bytes=MIB)
    with pytest.raises(DirectoryInUse):
        await second.start()
    await second.aclose()
    release.set()
    with contextlib.suppress(Exception):
        await task
    async with asyncio.timeout(T):
        while True:  # the last job out closes the directory
            try:
                async with DiskConnector(root, capacity_bytes=MIB) as again:
                    await again.start()
                    assert not [n for _, _, ns in os.walk(root) for n in ns if n.endswith(".tmp")]
                break
            except DirectoryInUse:
                await asyncio.sleep(0.01)
