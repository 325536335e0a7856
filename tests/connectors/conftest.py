"""Fixtures: a redis-server and a Redis Cluster of our own, and one connector per
contract-suite variant.

Redis tests never touch a server they did not start: the session server (and each private
server of the kill/restart tests) runs on a free loopback port in a temp directory, and so
does every node of the session cluster (3 masters with a replica each; started on first
use) and of each private cluster of the failover tests. When ``redis-server`` is missing the
Redis variants skip, unless ``KVPLUGIN_REQUIRE_REDIS=1`` (CI), where they fail.
"""

from __future__ import annotations

import os
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import pytest
import pytest_asyncio
from conn_testlib import Subject, redis_options
from redis_fixture import start_local_cluster

from kvplugin.connectors.base import Connector
from kvplugin.connectors.cluster_testing import LocalRedisCluster
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.faults import FaultInjector, FaultPlan, LocalRedisServer
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.redis import RedisConnector
from kvplugin.connectors.redis_cluster import RedisClusterConnector, RedisClusterOptions
from kvplugin.connectors.tiered import TieredConnector

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


def _start_cluster(cluster: LocalRedisCluster) -> LocalRedisCluster:
    return start_local_cluster(cluster)


@pytest.fixture(scope="session")
def redis_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisCluster]:
    """The session's cluster: tests may reshard it, never kill its nodes."""
    cluster = _start_cluster(LocalRedisCluster(str(tmp_path_factory.mktemp("redis-cluster"))))
    yield cluster
    cluster.kill_all()


@pytest.fixture
def start_cluster(
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Callable[..., LocalRedisCluster]]:
    """``start_cluster(**LocalRedisCluster options)``: a cluster this test may kill or pause
    nodes of; torn down after the test."""
    started: list[LocalRedisCluster] = []

    def start(**options: Any) -> LocalRedisCluster:
        workdir = str(tmp_path_factory.mktemp("redis-cluster-private"))
        started.append(LocalRedisCluster(workdir, **options))
        return _start_cluster(started[-1])

    yield start
    for cluster in started:
        cluster.kill_all()


@pytest.fixture
def private_cluster(start_cluster: Callable[..., LocalRedisCluster]) -> LocalRedisCluster:
    """A cluster this test may kill nodes of (failover after 1 s without an answer)."""
    return start_cluster()


def _cluster_options(url: str, **kw: object) -> RedisClusterOptions:
    """Test settings: short socket timeouts and cool-downs so failure tests stay quick."""
    base: dict[str, object] = {
        "socket_timeout": 0.5,
        "connect_timeout": 0.25,
        "breaker_cooldown": 0.2,
        "max_connections": 8,
    }
    base.update(kw)
    return RedisClusterOptions.from_url(url, **base)


@pytest.fixture
def cluster_options() -> Callable[..., RedisClusterOptions]:
    """``cluster_options(url, **overrides)``: the cluster tests' connector options."""
    return _cluster_options


KINDS = ["memory", "memory_arc", "disk", "disk_threads", "redis", "redis_cluster", "tiered"]
VARIANTS = KINDS + [f"benign-{k}" for k in KINDS] + [f"faulty-{k}" for k in KINDS]


@pytest.fixture
def make_connector(
    request: pytest.FixtureRequest, tmp_path: os.PathLike[str]
) -> Callable[[str], Connector]:
    """Build a connector of one kind (memory, memory_arc, disk, disk_threads, redis,
    redis_cluster, tiered) on fresh storage."""
    counter = iter(range(1000))

    def build(kind: str) -> Connector:
        n = next(counter)
        if kind == "memory":
            return MemoryConnector(capacity_bytes=64 * MIB)
        if kind == "memory_arc":  # the contract holds whatever the eviction policy
            return MemoryConnector(capacity_bytes=64 * MIB, eviction="arc")
        if kind == "disk":
            return DiskConnector(os.path.join(tmp_path, f"disk{n}"), capacity_bytes=64 * MIB)
        if kind == "disk_threads":  # every read on the I/O threads (no page-cache fast path)
            return DiskConnector(
                os.path.join(tmp_path, f"disk{n}"), capacity_bytes=64 * MIB, inline_read_bytes=0
            )
        if kind == "redis":
            server = request.getfixturevalue("redis_server")
            return RedisConnector(redis_options(server.url))
        if kind == "redis_cluster":
            cluster = request.getfixturevalue("redis_cluster")
            return RedisClusterConnector(_cluster_options(cluster.url))
        if kind == "tiered":
            return TieredConnector(
                [MemoryConnector(capacity_bytes=8 * MIB, eviction="arc"), build("disk"),
                 build("redis")]
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
    # The cluster is a Redis tier to the suite (the same capabilities, asserted as "redis").
    family = {"redis_cluster": "redis", "memory_arc": "memory"}.get(kind, kind)
    async with conn:
        yield Subject(conn, family, reliable)
