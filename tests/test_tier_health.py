"""Tiers that cannot be reached are loud (``kvplugin run`` through its real entry point, a
real redis-server for the live case): a warning naming the tier at start, ``tier_errors``
in the report, and with ``--strict`` / ``offload.require_tiers`` an error before any
request is served."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
from pathlib import Path

from redis_fixture import clean_env, local_redis

from connectors.faults import LocalRedisServer

__all__ = ["local_redis"]  # the fixture, imported for pytest

REPO = Path(__file__).resolve().parents[1]
REDIS_CFG = str(REPO / "configs" / "redis.yaml")


def _dead_url() -> str:
    with socket.socket() as s:  # a loopback port nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    return f"redis://127.0.0.1:{port}/0"


def _run(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvplugin.cli", "run", "--config", REDIS_CFG,
                           "--requests", "24", *args], capture_output=True, text=True,
                          timeout=180, cwd=REPO, env=clean_env(**env))


def test_a_dead_redis_is_a_warning_at_start_and_counted_in_tier_errors() -> None:
    url = _dead_url()
    proc = _run("--json", KVPLUGIN_OFFLOAD__REMOTE_URL=url)
    assert proc.returncode == 0, proc.stderr
    warn = [ln for ln in proc.stderr.splitlines() if "does not answer at start" in ln]
    assert len(warn) == 1 and "tier redis" in warn[0] and "Connection refused" in warn[0]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tier_errors"]["memory"] == 0 and out["tier_errors"]["redis"] > 0
    assert out["hit_tokens"]["redis"] == 0 and out["tier_warnings"] == [
        warn[0].split(": ", 1)[1]]
    summary = _run(KVPLUGIN_OFFLOAD__REMOTE_URL=url)
    assert summary.returncode == 0
    line = next(ln for ln in summary.stdout.splitlines() if ln.startswith("tier errors"))
    assert line.startswith("tier errors   : memory 0, redis ") and not line.endswith(" 0")


def test_strict_or_require_tiers_refuses_to_run_without_the_tier() -> None:
    url = _dead_url()
    for args, env in ((("--strict",), {}), ((), {"KVPLUGIN_OFFLOAD__REQUIRE_TIERS": "true"})):
        proc = _run(*args, KVPLUGIN_OFFLOAD__REMOTE_URL=url, **env)
        assert proc.returncode == 2 and proc.stdout == ""
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(
            "kvplugin run: tier redis does not answer at start: ")
        assert lines[0].endswith("(offload.require_tiers)")


def test_a_live_redis_is_quiet_and_error_free(local_redis: LocalRedisServer) -> None:
    proc = _run("--json", "--strict", KVPLUGIN_OFFLOAD__REMOTE_URL=local_redis.url)
    assert proc.returncode == 0, proc.stderr
    assert "does not answer" not in proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tier_errors"] == {"memory": 0, "redis": 0} and out["tier_warnings"] == []
