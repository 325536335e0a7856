"""The wheel as a user installs it: built from this checkout, installed into a fresh venv
beside an unrelated top-level ``connectors`` package (PyPI has one), then ``kvplugin run
--json`` from that venv. kvplugin's connectors install as ``kvplugin.connectors``; nothing
of kvplugin may import the top-level name, and the checkout must not be what runs."""

from __future__ import annotations

import ast
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import venv
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
# The dummy raises on import (not ImportError, which an optional import might swallow).
DUMMY = "raise RuntimeError('the unrelated top-level connectors package was imported')\n"


def _copy_sources(dst: Path) -> None:
    """What the wheel is built from, copied: building in the checkout would leave build/
    and egg-info there. kvplugin/connectors stays a symlink, as in the checkout."""
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dst / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("kvplugin", "connectors"):
        shutil.copytree(REPO / name, dst / name, symlinks=True, ignore=ignore)


def _build_wheel(src: Path, out: Path) -> Path:
    # No build isolation: setuptools and wheel come with the test extras, so no index is
    # needed to build.
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                    "--no-build-isolation", "--wheel-dir", str(out), str(src)],
                   check=True, capture_output=True, text=True, cwd=src)
    wheels = list(out.glob("kvplugin-*.whl"))
    assert len(wheels) == 1, wheels
    return wheels[0]


def _fresh_venv(root: Path) -> tuple[Path, Path]:
    """A venv whose own site-packages comes first, then this interpreter's (for kvplugin's
    dependencies only: a path line in a .pth does not run that directory's .pth files, so
    an editable kvplugin installed there stays invisible)."""
    venv.EnvBuilder(with_pip=True).create(root)
    py = root / "bin" / "python"
    site = Path(subprocess.run(
        [str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        check=True, capture_output=True, text=True).stdout.strip())
    outer = {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}
    (site / "zz_outer_deps.pth").write_text("".join(f"{p}\n" for p in sorted(outer)))
    (site / "connectors").mkdir()
    (site / "connectors" / "__init__.py").write_text(DUMMY)
    return py, site


@pytest.mark.timeout(600)
def test_the_wheel_installs_beside_a_top_level_connectors_and_runs(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    _copy_sources(src)
    wheel = _build_wheel(src, tmp_path / "dist")
    py, site = _fresh_venv(tmp_path / "venv")
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                    str(wheel)], check=True, capture_output=True, text=True)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    work = tmp_path / "work"
    work.mkdir()

    where = subprocess.run(
        [str(py), "-c", "import kvplugin, kvplugin.connectors.disk as d; "
                        "print(kvplugin.__file__); print(d.__file__)"],
        check=True, capture_output=True, text=True, env=env, cwd=work).stdout.split()
    assert where == [str(site / "kvplugin" / "__init__.py"),
                     str(site / "kvplugin" / "connectors" / "disk.py")]
    dummy = subprocess.run([str(py), "-c", "import connectors"], capture_output=True,
                           text=True, env=env, cwd=work)
    assert dummy.returncode == 1
    assert "the unrelated top-level connectors package was imported" in dummy.stderr

    run = subprocess.run([str(tmp_path / "venv" / "bin" / "kvplugin"), "run", "--json"],
                         capture_output=True, text=True, env=env, cwd=work, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads(run.stdout)
    assert report["requests"] == report["finished"] > 0
    assert report["kv_mismatches"] == report["leaked_blocks"] == report["failed"] == 0
    assert set(report["tiers"]) >= {"memory", "disk"}


def test_nothing_imports_the_top_level_name() -> None:
    # In a checkout the connectors/ folder also imports as "connectors" from the repository
    # root: a module doing so would load every connector twice, under two names.
    bad = []
    for top in ("kvplugin", "connectors", "tests", "benchmarks", "examples", "tools"):
        for path in sorted((REPO / top).rglob("*.py")):
            if top == "kvplugin" and "connectors" in path.relative_to(REPO / top).parts:
                continue  # the symlink: the same files as connectors/
            for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module or ""] if isinstance(node, ast.ImportFrom)
                         and node.level == 0 else [])
                bad += [f"{path.relative_to(REPO)}:{node.lineno} {n}" for n in names
                        if n == "connectors" or n.startswith("connectors.")]
    assert not bad, bad
