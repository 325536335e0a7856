"""A redis-server of the test's own on a free loopback port (never 127.0.0.1:6379).

Import the fixture into a test module (``from redis_fixture import local_redis``). When
``redis-server`` is missing or does not start, the tests using it skip, unless
``KVPLUGIN_REQUIRE_REDIS=1`` (CI), where they fail: the same rule as tests/connectors.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvplugin.connectors.cluster_testing import LocalRedisCluster
from kvplugin.connectors.faults import LocalRedisServer

__all__ = ["clean_env", "local_redis", "start_local_cluster", "start_local_redis"]


def _unavailable(message: str) -> None:
    if os.environ.get("KVPLUGIN_REQUIRE_REDIS") == "1":
        pytest.fail(f"{message} and KVPLUGIN_REQUIRE_REDIS=1")
    pytest.skip(message)


def start_local_redis(workdir: str) -> LocalRedisServer:
    server = LocalRedisServer(workdir)
    if not LocalRedisServer.available():
        _unavailable("redis-server is not available")
    try:
        server.start()
    except RuntimeError as exc:
        _unavailable(f"redis-server did not start: {exc}")
    return server


def start_local_cluster(cluster: LocalRedisCluster) -> LocalRedisCluster:
    """Start a :class:`LocalRedisCluster` of the test's own, or skip / fail as above."""
    if not LocalRedisCluster.available():
        _unavailable("redis-server / redis-cli are not available")
    try:
        cluster.start()
    except (RuntimeError, OSError, subprocess.SubprocessError) as exc:
        _unavailable(f"a local Redis Cluster did not start: {exc}")
    return cluster


@pytest.fixture(scope="module")
def local_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisServer]:
    """One server per test module; each test picks its own database for a clean slate."""
    server = start_local_redis(str(tmp_path_factory.mktemp("redis")))
    yield server
    server.kill()


def clean_env(**extra: str) -> dict[str, str]:
    """The environment for a ``kvplugin`` subprocess: no KVPLUGIN_* setting from the caller
    (they would override the config under test), plus ``extra``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUGIN_")}
    env.update(extra)
    return env


def run_engine(config: Path, requests: str, *, timeout: float, **env: str) -> dict[str, Any]:
    """``kvplugin run --config CONFIG --requests N --json`` in a fresh process (``env`` on
    top of :func:`clean_env`); its summary, once checked clean: every request finished,
    no KV mismatch, no cross-tenant hit, no leaked block."""
    proc = subprocess.run(
        [sys.executable, "-m", "kvplugin.cli", "run", "--config", str(config),
         "--requests", requests, "--json"],
        capture_output=True, text=True, timeout=timeout, env=clean_env(**env),
        cwd=Path(__file__).resolve().parent.parent)
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["finished"] == int(requests) and out["failed"] == 0
    assert out["kv_mismatches"] == 0 and out["cross_tenant_hits"] == 0
    assert out["leaked_blocks"] == 0
    return out
