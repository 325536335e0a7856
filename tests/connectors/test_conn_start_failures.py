"""A connector whose start fails gives back everything it took at once (descriptors, locks,
threads, sockets), and starts once the cause is gone, without being rebuilt.

Each failure is real where this machine can make it real: a full filesystem and a read-only
one are small tmpfs mounts (root with mount rights, as the CI container is; a non-root
user gets a directory it may not write instead), a held lock is another connector's, and
a dead Redis is a loopback port nobody listens on, later served by a real redis-server.
Where a tmpfs cannot be mounted, the same errno is injected at the directory's creation
(the test id says ``injected``), so the cleanup path is exercised either way.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import socket
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conn_testlib import T, make_items, namespace, redis_options, same

from kvplugin.connectors.base import BackendUnavailable, ConnectorError, StorageFull
from kvplugin.connectors.disk import DirectoryInUse, DiskConnector
from kvplugin.connectors.faults import LocalRedisServer
from kvplugin.connectors.redis import RedisConnector

MIB = 1 << 20
pytestmark = pytest.mark.asyncio


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def io_threads() -> set[int]:
    return {t.ident or 0 for t in threading.enumerate() if t.name.startswith("kvplugin-")}


@contextlib.contextmanager
def tmpfs(path: Path, options: str) -> Iterator[bool]:
    """A tmpfs at ``path`` (True), or False where this user may not mount one."""
    path.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)],
                          capture_output=True)
    if done.returncode != 0:
        yield False
        return
    try:
        yield True
    finally:
        subprocess.run(["umount", "-l", str(path)], capture_output=True)


async def check_failed_start(conn: DiskConnector, error: type[Exception]) -> None:
    """start() fails with ``error`` and holds nothing afterwards."""
    fds, threads = open_fds(), io_threads()
    with pytest.raises(error):
        await conn.start()
    assert open_fds() - fds == set(), "a failed start kept descriptors"
    assert io_threads() - threads == set(), "a failed start kept its I/O thread"


async def check_works(conn: DiskConnector) -> None:
    """Starts now, stores and loads (the same object, never rebuilt)."""
    await conn.start()
    items = make_items(namespace(), 2)
    assert await conn.put(items, timeout=T) == 2
    got = await conn.get([k for k, _ in items], timeout=T)
    assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))


def inject(monkeypatch: pytest.MonkeyPatch, code: int) -> list[int]:
    """Creating the store's directory fails with ``code`` while the list is non-empty."""
    armed = [code]
    real = os.makedirs

    def makedirs(name: str, *args: object, **kw: object) -> None:
        if armed:
            raise OSError(armed[0], os.strerror(armed[0]), name)
        real(name, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(os, "makedirs", makedirs)
    return armed


@pytest.mark.parametrize("how", ["real", "injected"])
async def test_disk_start_on_a_full_filesystem(tmp_path: Path, how: str,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    mnt = tmp_path / "fs"
    with tmpfs(mnt, "size=256k,nr_inodes=32") as mounted:
        if how == "real" and not mounted:
            pytest.skip("no tmpfs here (mount refused): the injected variant runs instead")
        fillers: list[Path] = []
        armed: list[int] = []
        if how == "real":
            # Every inode taken: the store's directory cannot be created (ENOSPC).
            with contextlib.suppress(OSError):
                for i in range(64):
                    (mnt / f"fill{i}").touch()
                    fillers.append(mnt / f"fill{i}")
        else:
            armed = inject(monkeypatch, errno.ENOSPC)
        conn = DiskConnector(mnt / "store", capacity_bytes=MIB, io_threads=2)
        async with conn:
            await check_failed_start(conn, StorageFull)
            await check_failed_start(conn, StorageFull)  # retried while still full: the same
            for f in fillers:  # space freed
                f.unlink()
            armed.clear()
            await check_works(conn)


@pytest.mark.parametrize("how", ["real", "injected"])
async def test_disk_start_on_an_unwritable_directory(tmp_path: Path, how: str,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    parent = tmp_path / "ro"
    armed: list[int] = []
    with contextlib.ExitStack() as stack:
        if how == "injected":
            parent.mkdir()
            armed = inject(monkeypatch, errno.EACCES)
        elif os.geteuid() != 0:
            parent.mkdir()
            parent.chmod(0o555)
            stack.callback(parent.chmod, 0o755)
        elif not stack.enter_context(tmpfs(parent, "size=1m,ro")):
            pytest.skip("root, and no tmpfs here: the injected variant runs instead")
        conn = DiskConnector(parent / "store", capacity_bytes=MIB, io_threads=2)
        async with conn:
            await check_failed_start(conn, ConnectorError)
            # The cause goes away: writable again.
            if how == "injected":
                armed.clear()
            elif os.geteuid() != 0:
                parent.chmod(0o755)
            else:
                subprocess.run(["mount", "-o", "remount,rw", str(parent)], check=True)
            await check_works(conn)


async def test_disk_start_while_another_connector_holds_the_directory(tmp_path: Path) -> None:
    root = tmp_path / "shared"
    holder = DiskConnector(root, capacity_bytes=MIB)
    await holder.start()
    conn = DiskConnector(root, capacity_bytes=MIB, io_threads=2)
    async with conn:
        await check_failed_start(conn, DirectoryInUse)
        await holder.aclose()  # the lock's holder goes away
        await check_works(conn)


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_redis_down_at_start_then_served(tmp_path: Path) -> None:
    """Nothing listens: calls are visible failures and keep no socket; once a real server
    answers on that port, the same connector serves (after the breaker's cooldown)."""
    if not LocalRedisServer.available():
        if os.environ.get("KVPLUGIN_REQUIRE_REDIS") == "1":
            pytest.fail("redis-server is not installed (KVPLUGIN_REQUIRE_REDIS=1)")
        pytest.skip("redis-server is not installed")
    port = _dead_port()
    url = f"redis://127.0.0.1:{port}/0"
    conn = RedisConnector(redis_options(url, breaker_cooldown=0.2))
    server = LocalRedisServer(str(tmp_path / "redis"))
    items = make_items(namespace(), 2)
    try:
        fds = open_fds()
        health = await conn.health(timeout=T)
        assert not health.ok
        with pytest.raises(BackendUnavailable):
            await conn.put(items, timeout=T)
        assert await conn.lookup([k for k, _ in items], timeout=T) == 0  # a miss, counted
        assert conn.stats().errors >= 1
        assert open_fds() - fds == set(), "a refused connection kept a socket"
        server.port = port  # the cause goes away: a server on that very port
        server.start()
        await asyncio.sleep(0.25)  # the breaker's cooldown
        assert (await conn.health(timeout=T)).ok
        assert await conn.put(items, timeout=T) == 2
        got = await conn.get([k for k, _ in items], timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
    finally:
        await conn.aclose()
        server.kill()
