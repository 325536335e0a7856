"""The CLI's rough edges, through the real ``kvplugin`` entry point in a subprocess: every
bad input is one line on stderr and a non-zero exit, never a traceback."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("KVPLUGIN_")}


def _kvplugin(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvplugin.cli", *args], capture_output=True,
                          text=True, env=_env(), timeout=120, cwd=REPO)


def _one_line_error(proc: subprocess.CompletedProcess[str], rc: int = 2) -> str:
    assert proc.returncode == rc, (proc.returncode, proc.stderr)
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr
    return lines[0]


@pytest.mark.parametrize("n", ["-5", "0"])
def test_a_request_count_below_one_is_refused(n: str) -> None:
    line = _one_line_error(_kvplugin("run", "--requests", n))
    assert line == f"kvplugin run: --requests must be >= 1, got {n}"


def test_a_missing_or_broken_trace_is_one_line(tmp_path: Path) -> None:
    missing = tmp_path / "nope.json"
    line = _one_line_error(_kvplugin("run", "--trace", str(missing)))
    assert line.startswith(f"kvplugin run: {missing}: ") and "No such file" in line
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    line = _one_line_error(_kvplugin("run", "--trace", str(bad)))
    assert line.startswith(f"kvplugin run: {bad}: ")


@pytest.mark.parametrize("name", ["deploy.ini", "deploy.txt", "deploy"])
def test_a_config_of_an_unknown_format_is_refused_not_parsed_as_yaml(tmp_path: Path,
                                                                       name: str) -> None:
    cfg = tmp_path / name
    cfg.write_text("layout:\n  num_blocks: 64\n")  # valid YAML: must still be refused
    line = _one_line_error(_kvplugin("run", "--config", str(cfg)))
    suffix = repr(cfg.suffix or "(no suffix)")
    assert line == (f"kvplugin run: {cfg}: unknown config format {suffix}; use .yaml, "
                    ".yml, .toml, .json")
    line = _one_line_error(_kvplugin("validate-config", str(cfg)))
    assert "unknown config format" in line and str(cfg) in line


def test_a_yaml_syntax_error_names_the_file_and_the_line(tmp_path: Path) -> None:
    cfg = tmp_path / "broken.yaml"
    cfg.write_text("layout:\n  num_blocks: 64\n  groups: [\n")
    line = _one_line_error(_kvplugin("run", "--config", str(cfg)))
    assert line.startswith(f"kvplugin run: {cfg}: cannot parse: line ")
    assert "<unicode string>" not in line


def test_a_reader_that_leaves_early_is_no_error() -> None:
    # `kvplugin run --core-only | head -0`: the pipe is closed before the report is printed.
    proc = subprocess.Popen([sys.executable, "-m", "kvplugin.cli", "run", "--core-only",
                             "--requests", "20"], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=REPO, env=_env())
    assert proc.stdout is not None and proc.stderr is not None
    proc.stdout.close()  # the reader left
    err = proc.stderr.read().decode()
    rc = proc.wait(60)
    assert "Traceback" not in err and "BrokenPipe" not in err, err
    assert err == "" and rc == 141  # quiet, as a Unix tool ended by SIGPIPE


def test_help_is_plain_text() -> None:
    proc = _kvplugin("--help")
    assert proc.returncode == 0
    assert "``" not in proc.stdout and proc.stdout.startswith("usage: kvplugin")
    assert "asyncio KV-cache manager" in proc.stdout
