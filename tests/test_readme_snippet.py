"""The README's engine snippet is code that runs, not a picture of it: extracted from the
README and run in a fresh interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
MARK = "# README snippet (tests/test_readme_snippet.py runs it)"


def test_the_readme_engine_snippet_runs_and_stores_every_chunk(tmp_path: Path) -> None:
    text = (REPO / "README.md").read_text()
    start = text.index(MARK)
    code = text[start:text.index("```", start)]
    script = tmp_path / "snippet.py"
    script.write_text(code)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUGIN_")}
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=120, cwd=tmp_path, env=env)
    assert proc.returncode == 0, proc.stderr
    # 300 prompt tokens + the answer's first tokens: 18 whole 16-token chunks stored.
    assert proc.stdout.strip() == "18"
