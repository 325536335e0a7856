"""Fixtures: a redis-server of our own, and one connector per contract-suite variant.

Redis tests never touch a server they did not start: the session server (and each private
server of the kill/restart tests) runs on a free loopback port in a temp directory. When
``redis-server`` is missing the Redis variants skip, unless ``KVPLUGIN_REQUIRE_REDIS=1``
(CI), where they fail.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import pytest_asyncio
from conn_testlib import Subject, redis_options

from connectors.base import Connector
from connectors.disk import DiskConnector
from connectors.faults import FaultInjector, FaultPlan, LocalRedisServer
from connectors.memory import MemoryConnector
from connectors.redis import RedisConnector
from connectors.tiered import TieredConnector

MIB = 1 << 20
FAULTY = FaultPlan(
    error_rate=0.15, latency_rate=0.2, latency=0.01, drop_write_rate=0.15, corrupt_write_rate=0.2
)


def _need_redis() -> None:
    message = "redis-server is not available"
    if os.environ.get("KVPLUGIN_REQUIRE_REDIS") == "1":
        pytest.fail(f"{message} and KVPLUGIN_REQUIRE_REDIS=1")
    pytest.skip(message)


def _start(server: LocalRedisServer) -> LocalRedisServer:
    if not LocalRedisServer.available():
        _need_redis()
    try:
        server.start()
    except RuntimeError as exc:
        if os.environ.get("KVPLUGIN_REQUIRE_REDIS") == "1":
            pytest.fail(f"redis-server did not start: {exc}")
        pytest.skip(f"redis-server did not start: {exc}")
    return server


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisServer]:
    server = _start(LocalRedisServer(str(tmp_path_factory.mktemp("redis"))))
    yield server
    server.kill()


@pytest.fixture
def private_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisServer]:
    """A server this test may kill, pause and restart."""
    server = _start(LocalRedisServer(str(tmp_path_factory.mktemp("redis-private"))))
    yield server
    server.kill()


KINDS = ["memory", "disk", "disk_threads", "redis", "tiered"]
VARIANTS = KINDS + [f"benign-{k}" for k in KINDS] + [f"faulty-{k}" for k in KINDS]


@pytest.fixture
def make_connector(
    request: pytest.FixtureRequest, tmp_path: os.PathLike[str]
) -> Callable[[str], Connector]:
    """Build a connector of one kind (memory, disk, disk_threads, redis, tiered) on fresh
    storage."""
    counter = iter(range(1000))

    def build(kind: str) -> Connector:
        n = next(counter)
        if kind == "memory":
            return MemoryConnector(capacity_bytes=64 * MIB)
        if kind == "disk":
            return DiskConnector(os.path.join(tmp_path, f"disk{n}"), capacity_bytes=64 * MIB)
        if kind == "disk_threads":  # every read on the I/O threads (no page-cache fast path)
            return DiskConnector(
                os.path.join(tmp_path, f"disk{n}"), capacity_bytes=64 * MIB, inline_read_bytes=0
            )
        if kind == "redis":
            server = request.getfixturevalue("redis_server")
            return RedisConnector(redis_options(server.url))
        if kind == "tiered":
            return TieredConnector(
                [MemoryConnector(capacity_bytes=8 * MIB), build("disk"), build("redis")]
            )
        raise ValueError(kind)

    return build


@pytest_asyncio.fixture(params=VARIANTS)
async def subject(
    request: pytest.FixtureRequest, make_connector: Callable[[str], Connector]
) -> AsyncIterator[Subject]:
    variant: str = request.param
    mode, _, kind = variant.rpartition("-")
    conn = make_connector(kind)
    reliable = mode != "faulty"
    if mode:
        plan = FAULTY if mode == "faulty" else FaultPlan()
        conn = FaultInjector(conn, plan, seed=sum(map(ord, request.node.name)))
    async with conn:
        yield Subject(conn, kind, reliable)
