"""Once ``put`` is back with its caller, however it ended (returned, out of time, cancelled,
failed), no later change to the caller's buffers reaches storage as a valid object.

The disk store hashes and writes on its I/O threads, so a put cut short leaves its write
running; these tests hold those threads still (the write queued, or stopped between the
hash and the write), change the caller's bytearray as soon as ``put`` is back, then let
the threads go. Every connector kind is asked the same questions.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import threading
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
from conn_testlib import T, make_block, namespace

from kvplugin.connectors import diskwrite
from kvplugin.connectors.base import Connector, ConnectorError, PutItem
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.serde import Block

pytestmark = pytest.mark.asyncio
KINDS = ["memory", "disk", "disk_threads", "redis", "redis_cluster", "tiered"]
ENDINGS = ["deadline", "cancelled"]
KIB = 1024


def reusable_item(seed: int, nbytes: int = 64 * KIB) -> tuple[PutItem, bytearray]:
    """An item whose payload is a bytearray the test changes later, as a caller reusing
    its buffer would."""
    key = namespace().key(seed.to_bytes(32, "big"))
    block = make_block(key, nbytes)
    payload = bytearray(block.payload)
    return (key, Block(block.meta, payload)), payload


def disk_stores(conn: Connector) -> list[DiskConnector]:
    tiers = conn.tiers if isinstance(conn, TieredConnector) else [conn]
    return [t for t in tiers if isinstance(t, DiskConnector)]


@contextlib.asynccontextmanager
async def threads_held(conn: Connector) -> AsyncIterator[None]:
    """Every I/O thread of every disk store busy until the block ends, so a write
    submitted meanwhile waits in the queue (deterministic: no sleeps, no luck)."""
    release = threading.Event()
    running: list[int] = []
    total = 0
    for store in disk_stores(conn):
        await store.start()
        workers = store._executor._max_workers
        total += workers
        for _ in range(workers):
            store._executor.submit(lambda: (running.append(1), release.wait(30)))
    await until(lambda: len(running) == total)
    try:
        yield
    finally:
        release.set()


@contextlib.contextmanager
def writes_stopped_after_the_hash(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Disk writes stop after the payload was hashed (the draft is finished before the
    write helper is called) until the returned event is set."""
    release, entered = threading.Event(), threading.Event()
    original = diskwrite._write_all

    def stopped(fd: int, parts: object) -> None:
        entered.set()
        release.wait(30)
        original(fd, parts)  # type: ignore[arg-type]

    monkeypatch.setattr(diskwrite, "_write_all", stopped)
    try:
        yield entered
    finally:
        release.set()


async def until(condition: Callable[[], bool], limit: float = 10.0) -> None:
    async with asyncio.timeout(limit):
        while not condition():
            await asyncio.sleep(0.001)


async def settle(conn: Connector) -> None:
    """Wait for the writes a cut-short put left running."""
    await until(lambda: not any(store._pending for store in disk_stores(conn)))


async def cut_short(
    conn: Connector, items: list[PutItem], ending: str, started: Callable[[], bool]
) -> None:
    """A put ended by its deadline or by cancellation once ``started()`` holds."""
    if ending == "deadline":
        with contextlib.suppress(ConnectorError):
            await conn.put(items, timeout=0.2 if disk_stores(conn) else T)
        return
    task = asyncio.ensure_future(conn.put(items, timeout=T))
    await until(lambda: started() or task.done())
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, ConnectorError):
        await task


async def assert_never_the_new_bytes(
    conn: Connector, items: list[PutItem], originals: list[bytes]
) -> list[Block | None]:
    """Every store (each tier of a tiered one, too) answers the original bytes or nothing."""
    keys = [k for k, _ in items]
    stores = [conn, *conn.tiers] if isinstance(conn, TieredConnector) else [conn]
    answers: list[Block | None] = []
    for store in stores:
        got = await store.get(keys, timeout=T)
        for block, original in zip(got, originals, strict=True):
            assert block is None or bytes(block.payload) == original, (
                f"{store.name} returned bytes the caller wrote after put was back"
            )
        answers = answers or got
    return answers


def pending_writes(conn: Connector) -> Callable[[], bool]:
    stores = disk_stores(conn)
    return lambda: bool(stores) and all(store._pending for store in stores)


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("kind", KINDS)
async def test_a_queued_write_never_takes_bytes_changed_after_put(
    make_connector: Callable[[str], Connector], kind: str, ending: str
) -> None:
    async with make_connector(kind) as conn:
        item, payload = reusable_item(1)
        original = bytes(payload)
        async with threads_held(conn):
            await cut_short(conn, [item], ending, pending_writes(conn))
            payload[:] = os.urandom(len(payload))  # the caller reuses its buffer at once
        await settle(conn)
        await assert_never_the_new_bytes(conn, [item], [original])
        # Nor a torn object (bytes sealed on the loop, written from the changed buffer).
        assert all(store.stats().corrupt_detected == 0 for store in disk_stores(conn))


@pytest.mark.parametrize("ending", ENDINGS)
@pytest.mark.parametrize("kind", KINDS)
async def test_a_write_stopped_mid_way_lands_whole_or_not_at_all(
    make_connector: Callable[[str], Connector],
    monkeypatch: pytest.MonkeyPatch,
    kind: str,
    ending: str,
) -> None:
    async with make_connector(kind) as conn:
        item, payload = reusable_item(2)
        original = bytes(payload)
        with writes_stopped_after_the_hash(monkeypatch) as entered:
            await cut_short(conn, [item], ending, entered.is_set)
            payload[:] = os.urandom(len(payload))
        await settle(conn)
        await assert_never_the_new_bytes(conn, [item], [original])
        for store in disk_stores(conn):
            # Not even a torn object: the write that was under way finished from the bytes
            # the caller had when it left.
            assert store.stats().corrupt_detected == 0
            if ending == "cancelled":
                got = await store.get([item[0]], timeout=T)
                assert got[0] is not None and bytes(got[0].payload) == original


@pytest.mark.parametrize("kind", KINDS)
async def test_a_batch_that_fails_leaves_nothing_to_change_later(
    make_connector: Callable[[str], Connector], monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    """One item's write fails (disk full) while the others are still under way; the batch
    raises only once they have all ended. Misuse (a block under the wrong key) fails the
    whole batch before any I/O."""
    async with make_connector(kind) as conn:
        pairs = [reusable_item(10 + i, nbytes=(64 + i) * KIB) for i in range(3)]
        items = [it for it, _ in pairs]
        originals = [bytes(p) for _, p in pairs]
        failing_size = items[1][1].meta.nbytes
        original_write = diskwrite._write_all

        def full_for_one(fd: int, parts: object) -> None:
            if any(memoryview(p).nbytes == failing_size for p in parts):  # type: ignore[attr-defined]
                raise OSError(errno.ENOSPC, "No space left on device")
            original_write(fd, parts)  # type: ignore[arg-type]

        monkeypatch.setattr(diskwrite, "_write_all", full_for_one)
        wrong = (items[0][0], items[2][1])  # a block that does not belong to its key
        with pytest.raises(ValueError):
            await conn.put([items[2], wrong], timeout=T)
        with contextlib.suppress(ConnectorError):
            await conn.put(items, timeout=T)
        for _, payload in pairs:
            payload[:] = os.urandom(len(payload))
        await settle(conn)
        monkeypatch.undo()
        await assert_never_the_new_bytes(conn, items, originals)


async def test_a_store_left_running_is_finished_before_aclose_returns(
    tmp_path: os.PathLike[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same through a restart: what the next connector finds is the original or
    nothing, and the index of the first one stayed exact."""
    root = os.path.join(tmp_path, "d")
    item, payload = reusable_item(3)
    original = bytes(payload)
    conn = DiskConnector(root, capacity_bytes=1 << 24)
    with writes_stopped_after_the_hash(monkeypatch) as entered:
        await cut_short(conn, [item], "cancelled", entered.is_set)
        payload[:] = os.urandom(len(payload))
    await conn.aclose()
    assert conn._reserved == 0 and not conn._pending
    assert conn.used_bytes == sum(conn._index.values())
    async with DiskConnector(root, capacity_bytes=1 << 24) as again:
        await assert_never_the_new_bytes(again, [item], [original])
        assert again.stats().corrupt_detected == 0
