"""The disk connector's page-cache fast path: loads served on the loop only when the kernel
can serve them from memory, everything else on the I/O threads, with the same verification."""

from __future__ import annotations

import ctypes
import errno
import os
import threading
import time

import pytest
from conn_testlib import T, make_items, namespace, same

from kvplugin.connectors.base import PutItem
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.nowait import NoWaitReader

KIB = 1024


def _supported(tmp_path: os.PathLike[str]) -> NoWaitReader:
    reader = NoWaitReader.create()
    if reader is None:
        pytest.skip("no openat2/preadv2 on this platform")
    probe = os.path.join(tmp_path, "probe")
    with open(probe, "wb") as f:
        f.write(b"x" * 100)
    if reader.read(probe, 1 << 20) is None and not reader.supported:
        pytest.skip("this file system refuses no-wait reads")
    return NoWaitReader.create()  # type: ignore[return-value]


def evict_from_page_cache(path: str) -> None:
    """Drop the file's pages; skips the test where the file system keeps them (tmpfs)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages cannot be dropped
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        try:
            os.preadv(fd, [bytearray(1)], 0, os.RWF_NOWAIT)
        except BlockingIOError:
            # Gone from the page cache. The refused probe may have started readahead,
            # which would put the pages back before the test reads: let it land, drop again.
            time.sleep(0.05)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            return
    finally:
        os.close(fd)
    pytest.skip("this file system keeps the pages (tmpfs?): nothing to fall back from")


async def assert_all_load(conn: DiskConnector, items: list[PutItem]) -> None:
    got = await conn.get([k for k, _ in items], timeout=T)
    assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))


def test_reader_returns_cached_files_whole_and_nothing_else(tmp_path: os.PathLike[str]) -> None:
    reader = _supported(tmp_path)
    path = os.path.join(tmp_path, "f")
    data = os.urandom(300 * KIB)
    with open(path, "wb") as f:
        f.write(data)
    got = reader.read(path, 1 << 20)
    assert got is not None and bytes(got) == data
    assert reader.read(path, len(data) - 1) is None, "over the limit"
    assert reader.read(os.path.join(tmp_path, "missing"), 1 << 20) is None
    open(os.path.join(tmp_path, "empty"), "wb").close()
    assert reader.read(os.path.join(tmp_path, "empty"), 1 << 20) is None
    evict_from_page_cache(path)
    assert reader.read(path, 1 << 20) is None, "not cached: refused, not waited for"
    assert reader.supported, "EAGAIN is not a reason to switch off"


def test_reader_switches_itself_off_when_the_kernel_refuses(tmp_path: os.PathLike[str]) -> None:
    path = os.path.join(tmp_path, "f")
    with open(path, "wb") as f:
        f.write(b"x" * 100)
    calls = []

    def no_openat2(*args: object) -> int:
        calls.append(args)
        ctypes.set_errno(errno.ENOSYS)
        return -1

    reader = NoWaitReader(no_openat2)
    assert reader.read(path, 1 << 20) is None
    assert not reader.supported and len(calls) == 1


def test_reader_never_waits_on_a_fifo_and_reads_regular_files_only(
    tmp_path: os.PathLike[str],
) -> None:
    reader = _supported(tmp_path)
    fifo = os.path.join(tmp_path, "fifo")
    os.mkfifo(fifo)
    rescued = []

    def rescue() -> None:  # a reader blocked in open() is let go (and the test fails)
        try:
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            rescued.append(fifo)
        except OSError:
            pass

    timer = threading.Timer(2.0, rescue)
    timer.start()
    try:
        started = time.monotonic()
        assert reader.read(fifo, 1 << 20) is None
        assert time.monotonic() - started < 1.0 and not rescued
    finally:
        timer.cancel()
    os.mkdir(os.path.join(tmp_path, "dir"))
    assert reader.read(os.path.join(tmp_path, "dir"), 1 << 20) is None
    assert reader.supported


def test_reader_given_a_directory_stays_beneath_it_through_no_link(
    tmp_path: os.PathLike[str],
) -> None:
    reader = _supported(tmp_path)
    root = os.path.join(tmp_path, "root")
    os.makedirs(os.path.join(root, "sub"))
    data = os.urandom(1000)
    for path in (os.path.join(root, "sub", "f"), os.path.join(tmp_path, "outside")):
        with open(path, "wb") as f:
            f.write(data)
    os.symlink(os.path.join(tmp_path, "outside"), os.path.join(root, "sub", "link"))
    os.symlink(os.path.join(root, "sub"), os.path.join(root, "linked"))
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    try:
        got = reader.read("sub/f", 1 << 20, fd)
        assert got is not None and bytes(got) == data
        for path in ("sub/link", "linked/f", "../outside", os.path.join(tmp_path, "outside")):
            assert reader.read(path, 1 << 20, fd) is None, path
    finally:
        os.close(fd)
    assert reader.supported


@pytest.mark.parametrize("code", [errno.EPERM, errno.ELOOP, errno.ENXIO, errno.EXDEV])
def test_a_refusal_about_one_file_does_not_switch_the_reader_off(
    tmp_path: os.PathLike[str], code: int
) -> None:
    """EPERM: O_NOATIME on a file another user owns; the others: something that is not a
    plain file is there. The threads look at that file; the next one is read inline."""

    def refusing(*args: object) -> int:
        ctypes.set_errno(code)
        return -1

    reader = NoWaitReader(refusing)
    assert reader.read(os.path.join(tmp_path, "f"), 1 << 20) is None
    assert reader.supported


@pytest.mark.asyncio
async def test_cached_objects_load_on_the_loop(tmp_path: os.PathLike[str]) -> None:
    _supported(tmp_path)
    items = make_items(namespace(), 4, nbytes=64 * KIB)
    async with DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=1 << 24) as conn:
        await conn.put(items, timeout=T)
        await assert_all_load(conn, items)
        assert conn.inline_reads == 4
        assert conn.stats().hits == 4


@pytest.mark.asyncio
async def test_uncached_objects_go_to_the_threads(tmp_path: os.PathLike[str]) -> None:
    _supported(tmp_path)
    items = make_items(namespace(), 4, nbytes=64 * KIB)
    async with DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=1 << 24) as conn:
        await conn.put(items, timeout=T)
        for key, _ in items[1:3]:
            evict_from_page_cache(conn.path_for(key.id))
        await assert_all_load(conn, items)
        assert conn.inline_reads == 2, "the two evicted objects were read on the threads"
        # The threaded read brought them back into the page cache.
        await conn.get([k for k, _ in items], timeout=T)
        assert conn.inline_reads == 6


@pytest.mark.asyncio
async def test_the_allowance_bounds_inline_bytes_per_call(tmp_path: os.PathLike[str]) -> None:
    _supported(tmp_path)
    items = make_items(namespace(), 6, nbytes=64 * KIB)
    root = os.path.join(tmp_path, "d")
    object_bytes = None
    async with DiskConnector(root, capacity_bytes=1 << 24, inline_read_bytes=150 * KIB) as conn:
        await conn.put(items, timeout=T)
        object_bytes = os.path.getsize(conn.path_for(items[0][0].id))
        assert 2 * object_bytes <= 150 * KIB < 3 * object_bytes
        await assert_all_load(conn, items)
        assert conn.inline_reads == 2
        for key, _ in items:  # one object per call: each call has its own allowance
            await conn.get([key], timeout=T)
        assert conn.inline_reads == 8


@pytest.mark.asyncio
async def test_damaged_cached_object_is_caught_and_dropped(tmp_path: os.PathLike[str]) -> None:
    _supported(tmp_path)
    items = make_items(namespace(), 2, nbytes=16 * KIB)
    async with DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=1 << 24) as conn:
        await conn.put(items, timeout=T)
        path = conn.path_for(items[0][0].id)
        with open(path, "r+b") as f:  # in place: the damaged bytes are what the cache holds
            f.seek(os.path.getsize(path) // 2)
            byte = f.read(1)
            f.seek(-1, os.SEEK_CUR)
            f.write(bytes([byte[0] ^ 0x40]))
        got = await conn.get([k for k, _ in items], timeout=T)
        assert got[0] is None and same(got[1], items[1][1])
        assert conn.inline_reads == 2
        assert conn.stats().corrupt_detected == 1
        assert not os.path.exists(path) and len(conn) == 1


@pytest.mark.asyncio
async def test_switched_off_reader_falls_back_for_good(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 3)
    async with DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=1 << 24) as conn:
        await conn.put(items, timeout=T)
        calls = []

        def refusing(*args: object) -> int:
            calls.append(args)
            ctypes.set_errno(errno.EOPNOTSUPP)
            return -1

        conn._nowait = NoWaitReader(refusing)
        for _ in range(3):
            await assert_all_load(conn, items)
        assert len(calls) == 1 and conn.inline_reads == 0


def test_allowance_must_be_a_non_negative_int(tmp_path: os.PathLike[str]) -> None:
    for bad in (-1, 1.5, None):
        with pytest.raises(ValueError, match="inline_read_bytes"):
            DiskConnector(tmp_path, capacity_bytes=1 << 20, inline_read_bytes=bad)  # type: ignore[arg-type]
