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


def test_validate_config_help_is_plain_text() -> None:
    proc = _kvplugin("validate-config", "--help")
    assert proc.returncode == 0
    assert "``" not in proc.stdout and ":func:" not in proc.stdout
    assert "as kvplugin run would (the environment's\nKVPLUGIN_* overrides" in proc.stdout


def test_version_and_python_dash_m() -> None:
    from importlib.metadata import version

    proc = _kvplugin("--version")
    assert (proc.returncode, proc.stdout) == (0, f"kvplugin {version('kvplugin')}\n")
    top = subprocess.run([sys.executable, "-m", "kvplugin", "--version"], capture_output=True,
                         text=True, env=_env(), timeout=60, cwd=REPO)
    assert (top.returncode, top.stdout) == (0, proc.stdout)


def test_a_metrics_port_in_use_is_one_line() -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = _one_line_error(_kvplugin("run", "--requests", "5", "--metrics-port", str(port)))
    assert line == (f"kvplugin run: --metrics-port {port}: cannot listen on 127.0.0.1:{port} "
                    "(Address already in use); pick another port, or 0 for any free one")


def test_save_trace_says_what_it_wrote(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    proc = _kvplugin("run", "--save-trace", str(out), "--requests", "5")
    assert proc.returncode == 0, proc.stderr
    import json

    ops = len(json.loads(out.read_text())["ops"])
    assert proc.stderr.splitlines()[-1] == (f"kvplugin: wrote {out} ({ops} ops; replay it "
                                            f"with kvplugin replay {out})")


def test_replaying_a_traces_directory_leaves_the_expected_outputs_out(tmp_path: Path) -> None:
    proc = _kvplugin("run", "--save-trace", str(tmp_path / "a.json"), "--requests", "5")
    assert proc.returncode == 0, proc.stderr
    (tmp_path / "a.expected.json").write_text("{}")  # beside it, as in conformance/traces
    out = tmp_path / "results"
    proc = _kvplugin("replay", str(tmp_path / "a.expected.json"), str(tmp_path / "a.json"),
                     "--out-dir", str(out))
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines()[0] == (
        "kvplugin replay: 1 recorded output file(s) (*.expected.json) left out: they are the "
        "traces' expected results, compared with tools in conformance/")
    assert sorted(p.name for p in out.iterdir()) == ["a.result.json"]


def test_a_failing_op_is_said_on_stderr(tmp_path: Path) -> None:
    import json

    proc = _kvplugin("run", "--save-trace", str(tmp_path / "a.json"), "--requests", "3")
    trace = json.loads((tmp_path / "a.json").read_text())
    trace["ops"].insert(0, {"op": "free", "id": "nobody"})  # a request never added
    (tmp_path / "a.json").write_text(json.dumps(trace))
    proc = _kvplugin("replay", str(tmp_path / "a.json"), "-o", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith(f"kvplugin replay: {tmp_path / 'a.json'}: 1 op(s) failed; the "
                           "first, op 0 (free): ")


def _interrupted(tmp_path: Path, sig: int, *flags: str) -> tuple[int, str, str]:
    """``kvplugin run`` signalled once it has served a while: its exit code, stdout, stderr;
    and its temp:// disk directory must be gone."""
    import time

    env = {**_env(), "TMPDIR": str(tmp_path)}
    proc = subprocess.Popen([sys.executable, "-m", "kvplugin", "run", "--requests", "100000",
                             *flags], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=REPO)
    deadline = time.monotonic() + 60
    while not any(tmp_path.glob("kvplugin-disk-*")) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(1.0)  # serving by now
    proc.send_signal(sig)
    out, err = proc.communicate(timeout=120)
    assert not list(tmp_path.iterdir()), "the temp:// disk directory was left behind"
    assert "Traceback" not in err, err
    return proc.returncode, out, err


@pytest.mark.parametrize(("sig", "name", "rc"), [(2, "SIGINT", 130), (15, "SIGTERM", 143)])
def test_a_signal_ends_the_run_with_a_partial_summary(tmp_path: Path, sig: int, name: str,
                                                      rc: int) -> None:
    code, out, err = _interrupted(tmp_path, sig)
    assert code == rc
    lines = err.strip().splitlines()
    assert lines[0] == (f"kvplugin run: {name}: no new requests; finishing those in flight "
                        "(again to stop at once)")
    assert lines[-1].startswith(f"kvplugin run: interrupted by {name}: the summary covers "
                                "the ")
    served = int(lines[-1].split("covers the ")[1].split()[0])
    assert 0 < served < 100000
    assert out.startswith("kvplugin: served the embedded default config")


def test_a_signalled_json_run_says_so_in_its_json(tmp_path: Path) -> None:
    import json

    code, out, _ = _interrupted(tmp_path, 15, "--json")
    report = json.loads(out.strip().splitlines()[-1])
    assert code == 143 and report["interrupted"] == "SIGTERM"
    assert 0 < report["finished"] < 100000 and report["leaked_blocks"] == 0


def test_an_unknown_op_is_said_on_stderr(tmp_path: Path) -> None:
    import json

    proc = _kvplugin("run", "--save-trace", str(tmp_path / "a.json"), "--requests", "3")
    trace = json.loads((tmp_path / "a.json").read_text())
    trace["ops"].insert(1, {"op": "frobnicate"})
    (tmp_path / "a.json").write_text(json.dumps(trace))
    proc = _kvplugin("replay", str(tmp_path / "a.json"), "-o", str(tmp_path / "r.json"))
    assert proc.returncode == 1
    assert proc.stderr.strip().splitlines() == [
        f"kvplugin replay: {tmp_path / 'a.json'}: 1 op(s) failed; the first, op 1 "
        "(frobnicate): TraceError: unknown op 'frobnicate'"]
