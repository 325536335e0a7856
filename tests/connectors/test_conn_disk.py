"""Disk connector: crash safety, restart recovery, the byte budget, local failures."""

from __future__ import annotations

import asyncio
import errno
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from conn_testlib import T, chain, make_items, namespace, same

from kvplugin.connectors import disk as disk_mod
from kvplugin.connectors import diskio, diskwrite
from kvplugin.connectors.base import BackendError, StorageFull, StoragePermissionError
from kvplugin.connectors.disk import DirectoryInUse, DiskConnector
from kvplugin.connectors.keys import ObjectKey
from kvplugin.serde import Block, encode

pytestmark = pytest.mark.asyncio
KIB = 1024
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def files(root: str, suffix: str) -> dict[str, int]:
    out = {}
    for dirpath, _, names in os.walk(root):
        for name in names:
            if name.endswith(suffix):
                out[os.path.join(dirpath, name)] = os.path.getsize(os.path.join(dirpath, name))
    return out


# --- crash safety ----------------------------------------------------------------------------

WRITER = textwrap.dedent(
    """
    import asyncio, os, sys, time
    sys.path.insert(0, {tests!r})
    from conn_testlib import make_items, namespace
    from kvplugin.connectors import disk, diskwrite

    def slow_write_all(fd, parts):  # a slow device: the kill lands mid-write
        for part in parts:
            view = memoryview(part).cast("B")
            for i in range(0, view.nbytes, 32768):
                os.write(fd, view[i : i + 32768])
                time.sleep(0.0005)

    diskwrite._write_all = slow_write_all

    async def main(root, capacity, fsync, start):
        ns = namespace("crash-tenant")
        conn = disk.DiskConnector(root, capacity_bytes=capacity, fsync=fsync, io_threads=2)
        seed = start
        while True:  # four writes in flight at any time, until SIGKILL
            batch = [make_items(ns, 1, nbytes={size}, seed=s)[0] for s in range(seed, seed + 4)]
            await asyncio.gather(*(conn.put([item], timeout=30) for item in batch))
            print(*range(seed, seed + 4), flush=True)
            seed += 4

    asyncio.run(main(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1", int(sys.argv[4])))
    """
)
OBJECT = 256 * KIB


def run_writer_and_kill(
    root: str, capacity: int, fsync: bool, start: int, rng: random.Random
) -> list[int]:
    """Start a writer process, SIGKILL it mid-stream; return the seeds it reported stored."""
    code = WRITER.format(tests=os.path.dirname(os.path.abspath(__file__)), size=OBJECT)
    proc = subprocess.Popen(
        [sys.executable, "-c", code, root, str(capacity), "1" if fsync else "0", str(start)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    assert proc.stdout is not None
    first = proc.stdout.readline()  # it is writing now
    assert first, proc.stderr.read() if proc.stderr else "writer died"
    time.sleep(rng.uniform(0.0, 0.15))
    proc.send_signal(signal.SIGKILL)
    rest, _ = proc.communicate(timeout=30)
    return [int(s) for line in (first + rest).splitlines() for s in line.split()]


def key_of(seed: int) -> ObjectKey:
    return namespace("crash-tenant").key(chain(1, seed)[0])


def block_of(seed: int) -> Block:
    return make_items(namespace("crash-tenant"), 1, nbytes=OBJECT, seed=seed)[0][1]


@pytest.mark.parametrize(("fsync", "capacity_objects"), [(False, 1000), (True, 1000), (False, 8)])
async def test_killed_writer_leaves_nothing_torn_and_everything_complete_is_found(
    tmp_path: os.PathLike[str], fsync: bool, capacity_objects: int
) -> None:
    root = os.path.join(tmp_path, "store")
    rng = random.Random(f"crash-{fsync}-{capacity_objects}")
    capacity = capacity_objects * (OBJECT + 2 * KIB)
    start = torn = cycles = 0
    # Kill, recover, kill again on the same directory; at least three times, and until one
    # kill has landed mid-write (about two in three do).
    while cycles < 3 or (not torn and cycles < 12):
        cycles += 1
        reported = await asyncio.to_thread(run_writer_and_kill, root, capacity, fsync, start, rng)
        start = max(reported, default=start) + 8  # the next writer uses fresh seeds
        on_disk = files(root, ".kvb")
        torn += len(files(root, ".tmp"))
        # The budget held on disk even at the moment of the kill (slack: one object).
        assert sum(on_disk.values()) <= capacity + OBJECT + 2 * KIB
        async with DiskConnector(root, capacity_bytes=capacity) as conn:
            await conn.start()
            assert not files(root, ".tmp"), "temp files are removed on start"
            if sum(on_disk.values()) <= capacity:
                assert len(conn) == len(on_disk), "every complete file is indexed"
            seeds = {key_of(s).id: s for s in range(start)}
            indexed = [seeds[sid] for sid in conn._index]  # nothing foreign either
            # Every indexed object is complete and verifies: nothing torn is readable.
            got = await conn.get([key_of(s) for s in indexed], timeout=T)
            assert all(same(g, block_of(s)) for g, s in zip(got, indexed, strict=True))
            assert conn.stats().corrupt_detected == 0
            if capacity_objects >= 1000:  # room for all: every reported object is there
                assert set(reported) <= set(indexed)
            else:  # LRU kept the newest reported objects
                assert set(reported[-2:]) <= set(indexed)
    assert torn, "no kill landed mid-write: the test did not test anything"


# --- restart recovery ----------------------------------------------------------------------


async def test_restart_rebuilds_the_index_and_cleans_temp_files(tmp_path: os.PathLike[str]) -> None:
    root = os.path.join(tmp_path, "store")
    items = make_items(namespace(), 5)
    async with DiskConnector(root, capacity_bytes=1 << 20) as conn:
        assert await conn.put(items, timeout=T) == 5
        stray_tmp = os.path.join(os.path.dirname(conn.path_for(items[0][0].id)), ".x.1.2.tmp")
    with open(stray_tmp, "wb") as f:
        f.write(b"half an object")
    foreign = os.path.join(root, "README.txt")
    with open(foreign, "w") as f:
        f.write("not ours")
    async with DiskConnector(root, capacity_bytes=1 << 20) as conn:
        assert await conn.lookup([k for k, _ in items], timeout=T) == 5
        got = await conn.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        assert not os.path.exists(stray_tmp)
        assert os.path.exists(foreign), "files that are not ours are left alone"


HOLDER = textwrap.dedent(
    """
    import asyncio, sys
    from kvplugin.connectors.disk import DirectoryInUse, DiskConnector

    async def main(root):
        conn = DiskConnector(root, capacity_bytes=1 << 20)
        await conn.start()
        print("started", flush=True)
        await asyncio.sleep(3600)  # until SIGKILL

    asyncio.run(main(sys.argv[1]))
    """
)


async def test_a_directory_serves_one_connector_at_a_time(tmp_path: os.PathLike[str]) -> None:
    root = os.path.join(tmp_path, "store")
    items = make_items(namespace(), 2)
    second = DiskConnector(root, capacity_bytes=1 << 20)
    async with DiskConnector(root, capacity_bytes=1 << 20) as first:
        await first.put(items[:1], timeout=T)
        with pytest.raises(DirectoryInUse, match=f"pid {os.getpid()}"):
            await second.put(items[1:], timeout=T)
        assert await second.lookup([items[0][0]], timeout=T) == 0, "a read: a counted miss"
        assert second.stats().errors == 2, "the failed put and the failed lookup"
        assert "DirectoryInUse" in (await second.health(timeout=T)).detail
        # The refused start touched nothing of the first connector's.
        assert same((await first.get([items[0][0]], timeout=T))[0], items[0][1])
    # Once the first one is closed, the second starts (no new object needed) and finds it.
    assert await second.lookup([items[0][0]], timeout=T) == 1
    assert await second.put(items[1:], timeout=T) == 1
    await second.aclose()


async def test_close_waits_for_a_read_its_cancelled_caller_left_on_a_thread(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """aclose returns with the directory free: the next connector starts at once even when a
    cancelled get left its read running (a CI flake of the cancellation storm)."""
    root = os.path.join(tmp_path, "store")
    items = make_items(namespace(), 1)
    entered, go_on = threading.Event(), threading.Event()
    real = disk_mod._read_hashed

    def slow_read(*args: object, **kwargs: object) -> object:
        entered.set()
        assert go_on.wait(30)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    conn = DiskConnector(root, capacity_bytes=1 << 20, inline_read_bytes=0)
    await conn.put(items, timeout=T)
    monkeypatch.setattr(disk_mod, "_read_hashed", slow_read)
    get = asyncio.ensure_future(conn.get([items[0][0]], timeout=T))
    assert await asyncio.to_thread(entered.wait, 30)
    get.cancel()
    closing = asyncio.ensure_future(conn.aclose())
    await asyncio.sleep(0.05)
    assert not closing.done(), "aclose waits for the read that holds the directory"
    go_on.set()
    await closing
    async with DiskConnector(root, capacity_bytes=1 << 20) as again:
        await again.start()  # no DirectoryInUse
        assert same((await again.get([items[0][0]], timeout=T))[0], items[0][1])


async def test_a_killed_holder_releases_the_directory(tmp_path: os.PathLike[str]) -> None:
    root = os.path.join(tmp_path, "store")
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, root],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": REPO},
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline() == "started\n", proc.stderr.read() if proc.stderr else ""
        conn = DiskConnector(root, capacity_bytes=1 << 20)
        with pytest.raises(DirectoryInUse, match=f"pid {proc.pid}"):
            await conn.start()
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=30)
    await conn.start()  # the kernel dropped the lock with the process
    assert await conn.put(make_items(namespace(), 1), timeout=T) == 1
    await conn.aclose()


async def test_restart_with_a_smaller_budget_trims_oldest_first(tmp_path: os.PathLike[str]) -> None:
    root = os.path.join(tmp_path, "store")
    items = make_items(namespace(), 6, nbytes=10 * KIB)
    async with DiskConnector(root, capacity_bytes=1 << 20) as conn:
        for item in items:
            await conn.put([item], timeout=T)
            await asyncio.sleep(0.01)  # distinct modification times
    size = items[0][1].meta.nbytes + 2 * KIB
    async with DiskConnector(root, capacity_bytes=3 * size) as conn:
        await conn.start()
        assert len(conn) == 3 and conn.used_bytes <= 3 * size
        assert await conn.lookup([k for k, _ in items[3:]], timeout=T) == 3
        assert sum(files(root, ".kvb").values()) <= 3 * size


# --- the budget ----------------------------------------------------------------------------


async def test_budget_evicts_least_recently_used(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 5, nbytes=10 * KIB)
    size = encode(items[0][1].meta, items[0][1].payload).nbytes
    capacity = 3 * size
    async with DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=capacity) as conn:
        for item in items[:3]:
            await conn.put([item], timeout=T)
        await conn.get([items[0][0]], timeout=T)  # 0 is now the most recently used
        await conn.put(items[3:4], timeout=T)  # evicts 1
        present = [await conn.lookup([k], timeout=T) for k, _ in items]
        assert present == [1, 0, 1, 1, 0]
        assert conn.used_bytes <= capacity
        assert sum(files(conn.root, ".kvb").values()) <= capacity
        assert conn.stats().evicted == 1


async def test_concurrent_puts_never_overshoot_the_budget(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 40, nbytes=20 * KIB)
    capacity = 5 * 21 * KIB
    async with DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=capacity) as conn:
        peak = 0

        async def watch() -> None:
            nonlocal peak
            while True:
                peak = max(peak, sum(files(conn.root, ".kvb").values()))
                await asyncio.sleep(0)

        watcher = asyncio.ensure_future(watch())
        stored = await asyncio.gather(*(conn.put([it], timeout=T) for it in items))
        watcher.cancel()
        assert stored == [1] * 40, "writes wait for room instead of being refused"
        assert conn.used_bytes <= capacity
        assert peak <= capacity + 21 * KIB


class Gates:
    """Every disk write stops before its first byte until the test lets it go."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.entered: list[tuple[int, threading.Event]] = []  # (object bytes, gate)
        real = diskwrite._write_all

        def gated(fd: int, parts: list[memoryview]) -> None:
            gate = threading.Event()
            self.entered.append((sum(memoryview(p).nbytes for p in parts), gate))
            gate.wait(30)
            real(fd, parts)

        monkeypatch.setattr(diskwrite, "_write_all", gated)

    async def wait_for(self, n: int) -> None:
        async with asyncio.timeout(T):
            while len(self.entered) < n:
                await asyncio.sleep(0.001)

    def release(self, i: int | None = None) -> None:
        for _, gate in self.entered if i is None else [self.entered[i]]:
            gate.set()


async def test_two_puts_of_one_object_never_write_it_at_once(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both wait for room; once there is room for both, the second must wait for the
    first write (a second write would leave one untracked: a budget wait on nothing, a
    delete that does not wait for it)."""
    small = make_items(namespace(), 3, nbytes=16 * KIB)
    ((xkey, xblock),) = make_items(namespace(), 1, nbytes=20 * KIB)
    s = encode(small[0][1].meta, small[0][1].payload).nbytes
    x = encode(xblock.meta, xblock.payload).nbytes
    capacity = s + 2 * x + KIB  # three small ones leave no room for x; one small one, for 2x
    assert 3 * s + x > capacity >= s + 2 * x and 2 * s + 2 * x > capacity
    gates = Gates(monkeypatch)
    # Four threads: three writes parked at the gate and x's first write run at once.
    async with DiskConnector(
        os.path.join(tmp_path, "d"), capacity_bytes=capacity, io_threads=4
    ) as conn:
        smalls = [asyncio.ensure_future(conn.put([it], timeout=T)) for it in small]
        await gates.wait_for(3)
        first = asyncio.ensure_future(conn.put([(xkey, xblock)], timeout=T))
        second = asyncio.ensure_future(conn.put([(xkey, xblock)], timeout=T))
        await asyncio.sleep(0.05)
        gates.release(0)
        await gates.wait_for(4)  # the first put of x is writing
        gates.release(1)
        await asyncio.sleep(0.1)  # room for a second write of x now
        assert [size for size, _ in gates.entered].count(x) == 1
        gates.release()
        results = await asyncio.gather(*smalls, first, second)
        assert results == [1] * 5
        assert conn._reserved == 0 and not conn._pending
        assert conn.used_bytes == sum(files(conn.root, ".kvb").values()) <= capacity
        assert same((await conn.get([xkey], timeout=T))[0], xblock)
        assert conn.stats().stored == 4 and conn.stats().existing == 1


async def test_object_larger_than_the_budget_is_rejected(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 1, nbytes=64 * KIB)
    async with DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=32 * KIB) as conn:
        assert await conn.put(items, timeout=T) == 0
        assert conn.stats().rejected == 1
        assert not files(conn.root, ".kvb")


# --- failures stay local -------------------------------------------------------------------


@pytest.mark.parametrize(
    ("code", "error"),
    [
        (errno.ENOSPC, StorageFull),
        (errno.EACCES, StoragePermissionError),
        (errno.EIO, BackendError),
    ],
)
async def test_write_errors_fail_that_store_only(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch, code: int, error: type
) -> None:
    items = make_items(namespace(), 3)
    async with DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=1 << 20) as conn:
        await conn.put(items[:1], timeout=T)

        def failing(fd: int, parts: object) -> None:
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(diskwrite, "_write_all", failing)
        with pytest.raises(error):
            await conn.put(items[1:2], timeout=T)
        monkeypatch.undo()
        assert not files(conn.root, ".tmp"), "the temp file is removed"
        assert await conn.lookup([k for k, _ in items[1:2]], timeout=T) == 0
        assert conn.stats().errors == 1
        # The store keeps working: old objects load, new ones store.
        assert same((await conn.get([items[0][0]], timeout=T))[0], items[0][1])
        assert await conn.put(items[1:], timeout=T) == 2
        assert conn.used_bytes == sum(files(conn.root, ".kvb").values())


async def test_read_errors_are_misses(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    items = make_items(namespace(), 2)
    root = os.path.join(tmp_path, "d")
    async with DiskConnector(root, capacity_bytes=1 << 20, inline_read_bytes=0) as conn:
        await conn.put(items, timeout=T)

        def failing(root_fd: int, rel: str, limit: int) -> None:
            raise OSError(errno.EIO, "I/O error")

        monkeypatch.setattr(diskio, "read_file", failing)
        assert await conn.get([k for k, _ in items], timeout=T) == [None, None]
        assert conn.stats().errors == 2
        monkeypatch.undo()
        # An unreadable object is forgotten: lookups agree with loads, and a put rewrites it
        # instead of answering "exists" for good.
        assert await conn.lookup([k for k, _ in items], timeout=T) == 0
        assert await conn.put(items, timeout=T) == 2 and conn.stats().stored == 4
        got = await conn.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))


async def test_unusable_root_is_reported_not_raised_on_reads(tmp_path: os.PathLike[str]) -> None:
    blocker = os.path.join(tmp_path, "file")
    with open(blocker, "w") as f:
        f.write("x")
    items = make_items(namespace(), 1)
    async with DiskConnector(os.path.join(blocker, "sub"), capacity_bytes=1 << 20) as conn:
        assert await conn.lookup([items[0][0]], timeout=T) == 0
        assert not (await conn.health(timeout=T)).ok
        with pytest.raises(BackendError):
            await conn.put(items, timeout=T)


async def test_health_reports_a_root_replaced_while_open(tmp_path: os.PathLike[str]) -> None:
    root = os.path.join(tmp_path, "d")
    async with DiskConnector(root, capacity_bytes=1 << 20) as conn:
        assert (await conn.health(timeout=T)).ok
        os.rename(root, root + ".old")
        os.makedirs(root)
        health = await conn.health(timeout=T)
        assert not health.ok and "replaced" in health.detail
        os.rmdir(root)
        assert not (await conn.health(timeout=T)).ok


async def test_file_deleted_behind_our_back_is_a_miss(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 1)
    async with DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=1 << 20) as conn:
        await conn.put(items, timeout=T)
        os.unlink(conn.path_for(items[0][0].id))
        assert await conn.get([items[0][0]], timeout=T) == [None]
        assert len(conn) == 0 and conn.used_bytes == 0


async def test_fsync_mode_round_trips(tmp_path: os.PathLike[str]) -> None:
    items = make_items(namespace(), 3)
    root = os.path.join(tmp_path, "d")
    async with DiskConnector(root, capacity_bytes=1 << 20, fsync=True) as conn:
        assert await conn.put(items, timeout=T) == 3
    async with DiskConnector(root, capacity_bytes=1 << 20, fsync=True) as conn:
        got = await conn.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))


async def test_paths_are_sharded_hex_under_the_root(tmp_path: os.PathLike[str]) -> None:
    ((key, _),) = make_items(namespace(), 1)
    conn = DiskConnector(os.path.join(tmp_path, "d"), capacity_bytes=1 << 20)
    path = conn.path_for(key.id)
    rel = os.path.relpath(path, conn.root).split(os.sep)
    assert rel == [key.namespace.hex, key.id[32:34], key.id[32:] + ".kvb"]
    await conn.aclose()


async def test_io_pool_defaults_to_the_cpus_less_one_for_the_loop(
    tmp_path: os.PathLike[str],
) -> None:
    assert [disk_mod.default_io_threads(n) for n in (1, 2, 3, 5, 64)] == [1, 1, 2, 4, 4]
    conn = DiskConnector(str(tmp_path), capacity_bytes=1 << 20)
    try:
        expected = disk_mod.default_io_threads(len(os.sched_getaffinity(0)))
        assert conn._executor._max_workers == expected
    finally:
        conn._executor.shutdown()
    for bad in (0, -1, 1.5, "2"):
        with pytest.raises(ValueError, match="io_threads"):
            DiskConnector(str(tmp_path), capacity_bytes=1 << 20, io_threads=bad)  # type: ignore[arg-type]
