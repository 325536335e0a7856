"""Tiers that cannot be reached are loud (``kvplugin run`` through its real entry point, a
real redis-server for the live case): a warning naming the tier at start, ``tier_errors``
in the report, and with ``--strict`` / ``offload.require_tiers`` an error before any
request is served."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis_fixture import clean_env, local_redis

from kvplugin.connectors.faults import LocalRedisServer
from kvplugin.engine.report import ledger_errors

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
    assert ledger_errors(out) == []  # a dead tier costs hits, the books still balance
    assert out["hit_tokens"]["redis"] == 0 and out["tier_warnings"] == [
        warn[0].split(": ", 1)[1]]
    # Every store reached memory and none reached Redis: counted per tier, not "0 failed".
    failed = out["store_failures_by_tier"]
    assert failed["memory"] == 0 and failed["redis"] == out["stores"] > 0
    summary = _run(KVPLUGIN_OFFLOAD__REMOTE_URL=url)
    assert summary.returncode == 0
    line = next(ln for ln in summary.stdout.splitlines() if ln.startswith("tier errors"))
    assert line.startswith("tier errors   : memory 0, redis ") and not line.endswith(" 0")
    stores = next(ln for ln in summary.stdout.splitlines() if ln.startswith("stores"))
    assert stores.endswith(" failed on redis)") and "failed on memory" not in stores


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


def test_shipped_redis_configs_name_no_default_server(local_redis: LocalRedisServer) -> None:
    from kvplugin.config import ConfigError, load_config, unresolved_remote_url

    for name, var in (("redis.yaml", "KVPLUGIN_REDIS_URL"), ("tiered.yaml", "KVPLUGIN_REDIS_URL"),
                      ("tiered.toml", "KVPLUGIN_REDIS_URL"),
                      ("redis_cluster.yaml", "KVPLUGIN_REDIS_CLUSTER_URL")):
        cfg = load_config(REPO / "configs" / name, env={})
        assert cfg.offload.remote_url == f"env:{var}"
        assert unresolved_remote_url(cfg.offload.remote_url) == var
    # Unset: kvplugin run refuses to start, in one line naming the variable.
    proc = _run()
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == (
        f"kvplugin run: {REDIS_CFG}: offload.remote_url is env:KVPLUGIN_REDIS_URL, but "
        "KVPLUGIN_REDIS_URL is not set: set it to your Redis URL (or set "
        "KVPLUGIN_OFFLOAD__REMOTE_URL)")
    # Set: the URL is the variable's, validated as any URL, and served.
    with_env = load_config(REPO / "configs" / "redis.yaml",
                           env={"KVPLUGIN_REDIS_URL": local_redis.url})
    assert with_env.offload.remote_url == local_redis.url
    with pytest.raises(ConfigError, match=r"\(set by environment variable KVPLUGIN_REDIS_URL\)"):
        load_config(REPO / "configs" / "redis.yaml", env={"KVPLUGIN_REDIS_URL": "ftp://x"})
    proc = _run("--json", KVPLUGIN_REDIS_URL=local_redis.url)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tiers"] == ["memory", "redis"] and out["tier_errors"]["redis"] == 0


def test_an_env_reference_needs_a_variable_name_and_the_plugin_refuses_it_unset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from kvplugin.config import ConfigError, load_config
    from kvplugin.plugin import load_plugin

    bad = tmp_path / "bad.yaml"
    bad.write_text("offload:\n  remote_url: 'env:not a name'\n")
    with pytest.raises(ConfigError, match="environment variable name"):
        load_config(bad, env={})
    for name in [n for n in os.environ if n.startswith("KVPLUGIN_")]:
        monkeypatch.delenv(name)

    async def build() -> None:
        async with load_plugin(REPO / "configs" / "redis.yaml"):
            pass

    with pytest.raises(ValueError, match="KVPLUGIN_REDIS_URL is not set"):
        asyncio.run(build())


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    """A real 1 MiB file system (tmpfs), for a disk tier bigger than its room."""
    where = tmp_path / "tiny"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(where)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.strip()}")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


def test_a_disk_tier_that_cannot_take_its_capacity_is_unhealthy(tiny_fs: Path) -> None:
    env = {"KVPLUGIN_OFFLOAD__LOCAL_DISK": str(tiny_fs / "kv")}  # 50 MB on 1 MiB
    run = [sys.executable, "-m", "kvplugin.cli", "run", "--requests", "12"]
    proc = subprocess.run([*run, "--strict"], capture_output=True, text=True, timeout=180,
                          cwd=REPO, env=clean_env(**env))
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("kvplugin run: tier disk does not answer at start: ")
    assert "bytes free, less than the 53687091" in line and line.endswith(
        "(offload.require_tiers)")
    # Without --strict: one warning, and the run goes on (what the disk refuses is counted).
    proc = subprocess.run([*run, "--json"], capture_output=True, text=True, timeout=180,
                          cwd=REPO, env=clean_env(**env))
    assert proc.returncode == 0, proc.stderr
    warn = [ln for ln in proc.stderr.splitlines() if "does not answer at start" in ln]
    assert len(warn) == 1 and "tier disk" in warn[0]


def test_the_disk_health_probe_sees_a_full_file_system(tmp_path: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The free-space check and the test write, on a real directory: room taken away by a
    patched statvfs, then a write refused as a full device refuses it."""
    import errno

    from kvplugin.connectors import diskio

    fd = os.open(tmp_path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        assert diskio.root_problem(fd, str(tmp_path), 1 << 20) is None
        assert not list(tmp_path.iterdir())  # the probe leaves nothing behind
        real = os.fstatvfs

        class Full:
            f_bavail, f_frsize = 3, 4096

        monkeypatch.setattr(os, "fstatvfs", lambda _fd: Full())
        assert diskio.root_problem(fd, str(tmp_path), 1 << 20) == (
            f"{tmp_path}: 12288 bytes free, less than the 1048576 bytes the tier may still "
            "fill (its capacity): writes would fail before it evicts")
        monkeypatch.setattr(os, "fstatvfs", real)

        def enospc(_fd: int, _data: bytes) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "write", enospc)
        assert diskio.root_problem(fd, str(tmp_path)) == (
            f"{tmp_path}: a test write failed: No space left on device")
        monkeypatch.undo()
        assert not list(tmp_path.iterdir())
    finally:
        os.close(fd)
