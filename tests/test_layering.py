"""Layering of the library and the demo engine: the library (``plugin``, ``metrics``,
``config``, ``integrations``, ``aio``, ...) never imports the reference engine
(``kvplugin.engine``); only the engine itself, the CLI that runs it (``kvplugin run``), the
benchmarks and the tests do.

Two checks: statically (every import statement of every file, function-level and
TYPE_CHECKING ones included), and in a fresh interpreter (importing the library leaves no
``kvplugin.engine`` module loaded, whatever imports it indirectly)."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from layering_testlib import loaded_after

REPO = Path(__file__).resolve().parents[1]
ENGINE = "kvplugin.engine"

# Where the engine may be imported: folders (every file under them) and single files.
ALLOWED_DIRS = ("kvplugin/engine", "benchmarks", "tests")
ALLOWED_FILES = {
    "kvplugin/cli.py": "kvplugin run and validate-config drive and validate the engine",
    "kvplugin/sim.py": "the core-only simulation (kvplugin run --core-only) serves the run's "
                       "workload section, the engine's WorkloadConfig",
    "tools/gen_config_doc.py": "docs/config.md documents every key kvplugin run reads, the "
                               "engine's workload section included",
}
SKIP_DIRS = {".git", "__pycache__", "build", "dist", ".venv", "venv", ".mypy_cache",
             ".ruff_cache", ".pytest_cache", ".hypothesis"}


def _is_engine(module: str) -> bool:
    return module == ENGINE or module.startswith(ENGINE + ".")


def _package(rel: Path) -> list[str]:
    """The package a file's relative imports resolve against."""
    parts = list(rel.with_suffix("").parts)
    return parts[:-1]  # a package's __init__ and a plain module alike: the folder


def _imported(node: ast.AST, rel: Path) -> list[str]:
    """The modules an import statement (or an ``import_module("...")`` call) names; a
    relative import resolved, and ``from P import m`` counted as ``P.m`` too."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if isinstance(node, ast.ImportFrom):
        base = node.module or ""
        if node.level:
            pkg = _package(rel)
            pkg = pkg[:len(pkg) - node.level + 1]
            base = ".".join([*pkg, *([base] if base else [])])
        return [base, *(f"{base}.{a.name}" for a in node.names)]
    if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", "")
        if name in ("import_module", "__import__"):
            return [node.args[0].value]
    return []


def _allowed(rel: Path) -> bool:
    posix = rel.as_posix()
    return posix in ALLOWED_FILES or any(posix.startswith(d + "/") for d in ALLOWED_DIRS)


def _python_files() -> list[Path]:
    out = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.startswith("."))
        out += [Path(root, f) for f in sorted(files) if f.endswith(".py")]
    return out


def engine_imports(paths: list[Path]) -> list[tuple[str, int, str]]:
    """(file, line, module) of every import of the engine outside where it is allowed."""
    bad = []
    for path in paths:
        rel = path.relative_to(REPO)
        if _allowed(rel):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            named = [m for m in _imported(node, rel) if _is_engine(m)]
            if named:  # one entry per statement
                bad.append((rel.as_posix(), getattr(node, "lineno", 0), named[0]))
    return bad


def test_the_check_sees_every_form_of_import() -> None:
    forms = ["import kvplugin.engine", "from kvplugin.engine.build import Deployment",
             "from kvplugin import engine", "from .engine import loop",
             "def f():\n    from kvplugin.engine import run",
             "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
             "    from kvplugin.engine.build import Deployment",
             "import importlib\nimportlib.import_module('kvplugin.engine.run')"]
    where = Path("kvplugin", "plugin.py")  # as if written there (the relative import)
    for text in forms:
        found = [m for n in ast.walk(ast.parse(text)) for m in _imported(n, where)]
        assert any(_is_engine(m) for m in found), text
    assert not _is_engine("kvplugin.engines") and not _is_engine("kvplugin.engine_x")


def test_only_the_engine_the_cli_benchmarks_and_tests_import_the_engine() -> None:
    files = _python_files()
    assert REPO / "kvplugin" / "plugin.py" in files and REPO / "examples" / "quickstart.py" in files
    assert engine_imports(files) == []
    for name in ALLOWED_FILES:
        assert (REPO / name).is_file(), f"{name} is allowed but does not exist"


def _library_modules() -> list[str]:
    """Every module of the kvplugin package outside the engine and the allowed files."""
    mods = []
    for path in sorted((REPO / "kvplugin").rglob("*.py")):
        rel = path.relative_to(REPO)
        if _allowed(rel):
            continue
        parts = list(rel.with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods.append(".".join(parts))
    return mods


def test_the_library_loads_without_the_engine() -> None:
    mods = _library_modules()
    # What an engine imports to load the plugin (vLLM's connector included: it imports
    # without vLLM installed), alone; then every library module at once.
    named = ["kvplugin.plugin", "kvplugin.metrics", "kvplugin.config",
             "kvplugin.integrations._runtime", "kvplugin.integrations.vllm",
             "kvplugin.validate_cli"]
    assert set(named) <= set(mods)
    for group in (named, mods):
        loaded = loaded_after(*group)
        assert set(group) <= loaded
        assert sorted(m for m in loaded if _is_engine(m)) == []
    # The engine's former builders, now the library's, are among those checked.
    assert {"kvplugin.layouts", "kvplugin.aio.loop"} <= set(mods)
