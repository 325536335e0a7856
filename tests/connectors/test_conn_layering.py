"""Layering: connectors and the block format never pull in the core or the async layer."""

from __future__ import annotations

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
MODULES = [f"kvplugin.connectors.{m}" for m in (
    "base", "keys", "memory", "disk", "redis", "redis_cluster", "redis_cluster_options",
    "cluster_testing", "tiered", "faults")]


def imported_after(module: str) -> set[str]:
    code = f"import sys, {module}; print('\\n'.join(sys.modules))"
    env = {**os.environ, "PYTHONPATH": REPO}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         check=True).stdout  # fmt: skip
    return set(out.split())


def test_serde_imports_neither_asyncio_nor_the_core() -> None:
    loaded = imported_after("kvplugin.serde")
    assert "asyncio" not in loaded
    assert not {m for m in loaded
                if m.startswith(("kvplugin.core", "kvplugin.aio", "kvplugin.connectors"))}


def test_connectors_never_import_the_core_or_the_async_layer() -> None:
    loaded = imported_after(", ".join(MODULES))
    assert set(MODULES) <= loaded
    assert not {m for m in loaded if m.startswith(("kvplugin.core", "kvplugin.aio"))}
