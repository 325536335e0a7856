"""Soak fixtures: the harness of ``benchmarks/soak.py`` (loaded from its file: putting
``benchmarks/`` on sys.path would let ``benchmarks/connectors.py`` shadow the ``connectors``
package), the async-layer helpers, and a redis-server of our own on a free loopback port.
When ``redis-server`` is missing the soak skips, unless ``KVPLUGIN_REQUIRE_REDIS=1`` (CI),
where it fails."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import pytest

from kvplugin.connectors.faults import LocalRedisServer

_HERE = Path(__file__).resolve().parent
for _dir in (_HERE, _HERE.parent / "aio"):
    if str(_dir) not in sys.path:
        sys.path.insert(0, str(_dir))


def _load_harness() -> ModuleType:
    path = _HERE.parent.parent / "benchmarks" / "soak.py"
    spec = importlib.util.spec_from_file_location("kvplugin_soak_harness", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def harness() -> ModuleType:
    return _load_harness()


def _fail_or_skip(message: str) -> None:
    if os.environ.get("KVPLUGIN_REQUIRE_REDIS") == "1":
        pytest.fail(f"{message} and KVPLUGIN_REQUIRE_REDIS=1")
    pytest.skip(message)


@pytest.fixture
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalRedisServer]:
    """A server this test may kill and restart."""
    if not LocalRedisServer.available():
        _fail_or_skip("redis-server is not available")
    server = LocalRedisServer(str(tmp_path_factory.mktemp("redis-soak")))
    try:
        server.start()
    except RuntimeError as exc:
        _fail_or_skip(f"redis-server did not start: {exc}")
    yield server
    server.kill()
