"""What the plug-in tests share: a package installed on sys.path as pip would leave it (its
modules and a dist-info declaring its entry points), and the engine integration example."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parent.parent


def install_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, dist: str,
                    modules: dict[str, str], entry_points: str) -> None:
    """``modules`` (name -> source) and ``<dist>-1.0.dist-info`` with ``entry_points``
    (the entry_points.txt text) under ``tmp_path``, put first on sys.path; the modules are
    forgotten again when the test ends."""
    for name, source in modules.items():
        (tmp_path / f"{name}.py").write_text(source)
        monkeypatch.delitem(sys.modules, name, raising=False)
    info = tmp_path / f"{dist.replace('-', '_')}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    (info / "entry_points.txt").write_text(entry_points)
    monkeypatch.syspath_prepend(str(tmp_path))


def example() -> Any:
    """examples/engine_integration.py as a module (its main_async runs a config)."""
    spec = importlib.util.spec_from_file_location(
        "engine_integration", REPO / "examples" / "engine_integration.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
