"""What the layering tests share: the modules a fresh interpreter has loaded after
importing some, with this checkout on its path."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def loaded_after(*modules: str) -> set[str]:
    code = f"import sys, {', '.join(modules)}; print('\\n'.join(sys.modules))"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                         text=True, check=True, cwd=REPO).stdout
    return set(out.split())
