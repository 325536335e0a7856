"""Benchmarks under test: a script of ``benchmarks/`` loaded from its file as a module."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def load_benchmark(name: str) -> Any:
    """``benchmarks/<name>.py`` as a module (registered, so its dataclasses find it); the
    script may change ``sys.path`` while it loads, which is put back."""
    spec = importlib.util.spec_from_file_location(f"kvplugin_bench_{name}",
                                                  BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    saved = list(sys.path)
    try:
        spec.loader.exec_module(mod)
    finally:
        sys.path[:] = saved
    return mod
