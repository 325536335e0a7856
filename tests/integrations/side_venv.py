"""Where the vLLM side virtualenvs' pythons are: from an environment variable, else the
default path their setup script uses. Missing: the test skips, or fails under
``KVPLUGIN_REQUIRE_VLLM=1`` (CI, which builds them)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest


def side_python(variable: str, venv: str, setup: str) -> str:
    py = os.environ.get(variable) or str(Path.home() / ".cache" / venv / "bin" / "python")
    if not os.access(py, os.X_OK):
        msg = f"no vLLM side virtualenv python at {py} (run {setup} or set {variable})"
        if os.environ.get("KVPLUGIN_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return py
