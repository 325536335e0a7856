"""Where the side virtualenvs' pythons are (vLLM's, SGLang's): from an environment
variable, else the default path their setup script uses. Missing: the test skips, or fails
under its ``KVPLUGIN_REQUIRE_*=1`` (CI, which builds them)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]


def side_python(variable: str, venv: str, setup: str,
                require: str = "KVPLUGIN_REQUIRE_VLLM") -> str:
    py = os.environ.get(variable) or str(Path.home() / ".cache" / venv / "bin" / "python")
    if not os.access(py, os.X_OK):
        msg = f"no side virtualenv python at {py} (run {setup} or set {variable})"
        if os.environ.get(require) == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return py


def run_scenarios(py: str, script: Path, names: list[str], timeout: float = 240,
                  env: dict[str, str] | None = None) -> dict[str, dict[str, Any]]:
    """Run ``script``'s scenarios under the side python (this checkout on PYTHONPATH,
    vLLM's hash seed fixed, ``env`` on top): each prints one JSON record; every name must
    answer."""
    env = {**os.environ, **(env or {}), "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    proc = subprocess.run([py, str(script), *names], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            out[rec["scenario"]] = rec
    assert sorted(out) == sorted(names), proc.stdout[-2000:]
    return out
