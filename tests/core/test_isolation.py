"""Layering: ``kvplugin.core`` is synchronous and I/O-free, and connectors never reach into it.

Each check imports in a fresh interpreter, so modules other tests loaded cannot hide a
violation.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[2]
CORE_DIR = REPO_ROOT / "kvplugin" / "core"
CONNECTORS_DIR = REPO_ROOT / "connectors"

# Roots of modules the core must never load (async runtime, sockets/TLS, file/network
# I/O libraries, array libraries, the connector layer, the async layer above it).
FORBIDDEN = ("asyncio", "socket", "_socket", "ssl", "_ssl", "selectors", "aiofiles", "redis",
             "pyarrow", "numpy", "kvplugin.connectors", "uvloop", "http", "urllib.request",
             "kvplugin.aio")

PROBE = """
import importlib, json, sys
names = json.loads(sys.argv[1])
for name in names:
    importlib.import_module(name)
print(json.dumps({"modules": sorted(sys.modules),
                  "files": {n: getattr(sys.modules[n], "__file__", None) for n in names}}))
"""


def _modules_under(root: Path, package: str) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).with_suffix("")
        parts = [p for p in rel.parts if p != "__init__"]
        out.append(".".join([package, *parts]))
    return sorted(set(out))


def _import_fresh(names: list[str]) -> dict[str, object]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.run([sys.executable, "-c", PROBE, json.dumps(names)], capture_output=True,
                          text=True, cwd=REPO_ROOT, env=env, timeout=120)
    assert proc.returncode == 0, f"importing {names} failed:\n{proc.stderr}"
    result: dict[str, object] = json.loads(proc.stdout)
    return result


def _loaded(modules: list[str], root: str) -> list[str]:
    return [m for m in modules if m == root or m.startswith(root + ".")]


def test_every_core_module_is_discovered() -> None:
    names = _modules_under(CORE_DIR, "kvplugin.core")
    for expected in ("kvplugin.core.manager", "kvplugin.core.block_pool",
                     "kvplugin.core.hashing", "kvplugin.core.single_type",
                     "kvplugin.core.single_type.full",
                     "kvplugin.core.single_type.sliding_window",
                     "kvplugin.core.single_type.chunked_local"):
        assert expected in names


def test_core_imports_no_async_or_io_library() -> None:
    names = ["kvplugin.core", *_modules_under(CORE_DIR, "kvplugin.core")]
    result = _import_fresh(names)
    modules = result["modules"]
    assert isinstance(modules, list)
    files = result["files"]
    assert isinstance(files, dict)
    # The tree under test, not some installed copy.
    for name in names[1:]:
        assert str(files[name]).startswith(str(CORE_DIR)), (name, files[name])
    offenders = {root: _loaded(modules, root) for root in FORBIDDEN}
    assert not any(offenders.values()), \
        f"kvplugin.core pulled in forbidden modules: { {k: v for k, v in offenders.items() if v} }"


def test_connectors_never_import_the_core() -> None:
    if not (CONNECTORS_DIR / "base.py").is_file():
        pytest.skip("connectors/base.py does not exist yet")
    # Statically: no connector source names kvplugin.core ...
    for path in sorted(CONNECTORS_DIR.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for node in ast.walk(tree):
            mods: list[str] = []
            if isinstance(node, ast.Import):
                mods = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                mods = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
            bad = [m for m in mods if m == "kvplugin.core" or m.startswith("kvplugin.core.")]
            assert not bad, f"{path.relative_to(REPO_ROOT)}:{node.lineno} imports {bad}"
    # ... and dynamically: importing every connector module loads none of it.
    names = ["kvplugin.connectors", *_modules_under(CONNECTORS_DIR, "kvplugin.connectors")]
    modules = _import_fresh(names)["modules"]
    assert isinstance(modules, list)
    assert not _loaded(modules, "kvplugin.core"), _loaded(modules, "kvplugin.core")
