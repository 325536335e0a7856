"""Conformance with vLLM 0.33.0: every recorded trace replays with exact equality.

The traces and what vLLM's own ``KVCacheManager`` returned for them live in the shared
conformance directory (``<repo root>/../shared/conformance``, or ``$KVPLUGIN_SHARED_DIR``):
``traces/`` and ``bench/`` (the manager alone), and ``connector-traces/`` (recorded from
vLLM's real Scheduler driving a KV connector: external tokens, async loads, divergent hybrid
hits, boundary-state offloads, ...).  CI has it; a missing directory is a failure, not a
skip.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from core_testlib import CONFORMANCE, REPO_ROOT, require_shared

from kvplugin.core.request import Request, RequestStatus
from kvplugin.replay import Replayer, UnsupportedTraceError, load_trace, run_trace

COMPARE = CONFORMANCE / "compare.py"
# Every folder of recorded traces the suite replays exactly.
TRACE_DIRS = ("traces", "bench", "connector-traces", "seed-traces")
# seed-traces/ profiles (meta.profile) this build replays exactly.  Every other profile is
# tracked as a strict xfail that must raise UnsupportedTraceError (never be ignored): it
# XPASSes, failing the run, once its feature lands without being listed here.
SUPPORTED_SEED_PROFILES = frozenset({"full_dcp", "zeroing", "rswa", "circular", "mla", "metrics"})
ALL_SEED_PROFILES = frozenset({"full_dcp", "rswa", "circular", "mla", "metrics", "zeroing"})

# Group kinds whose manager has not landed yet.  A trace using one is expected to fail
# with UnsupportedTraceError naming the kind (strict xfail: once the manager lands the
# test XPASSes, which fails the run until the kind is removed from this set).  Mamba was
# the last one; it landed with the Mamba manager.
PENDING_KINDS: frozenset[str] = frozenset()


def _trace_paths(dirs: tuple[str, ...] = TRACE_DIRS) -> list[Path]:
    paths = [p for d in dirs for p in sorted((CONFORMANCE / d).glob("*.json"))]
    return [p for p in paths if not p.name.endswith(".expected.json")]


def _kinds(path: Path) -> set[str]:
    with open(path) as f:
        config = json.load(f).get("config", {})
    return {str(g.get("kind")) for g in config.get("groups", [{"kind": "full"}])}


def _profile(path: Path) -> str | None:
    if path.parent.name != "seed-traces":
        return None
    with open(path) as f:
        return str(json.load(f).get("meta", {}).get("profile"))


def _params() -> list[Any]:
    if not CONFORMANCE.is_dir():
        return [pytest.param(None, id="shared-conformance-missing")]
    params = []
    for path in _trace_paths():
        pending = _kinds(path) & PENDING_KINDS
        profile = _profile(path)
        marks = [pytest.mark.xfail(strict=True, raises=UnsupportedTraceError,
                                   reason=f"group kind(s) {sorted(pending)} not implemented")
                 ] if pending else []
        if profile is not None and profile not in SUPPORTED_SEED_PROFILES:
            marks = [pytest.mark.xfail(strict=True, raises=UnsupportedTraceError,
                                       reason=f"seed profile {profile!r} not implemented")]
        params.append(pytest.param(path, id=f"{path.parent.name}/{path.stem}", marks=marks))
    for d in TRACE_DIRS:  # a folder that vanished must fail, not shrink the suite
        if not _trace_paths((d,)):
            params.append(pytest.param(None, id=f"no-traces-found-in-{d}"))
    return params


def _first_difference(expected: list[dict[str, Any]], actual: list[dict[str, Any]]) -> str:
    for e, a in zip(expected, actual, strict=False):
        if e != a:
            keys = sorted(k for k in set(e) | set(a) if e.get(k) != a.get(k))
            return (f"first divergence at op {e.get('i')} ({e.get('op')} {e.get('id', '')}): "
                    + "; ".join(f"{k}: expected {json.dumps(e.get(k))[:200]}, "
                                f"actual {json.dumps(a.get(k))[:200]}" for k in keys))
    return f"result count differs: expected {len(expected)}, actual {len(actual)}"


@pytest.mark.parametrize("path", _params())
def test_trace_replays_exactly(path: Path | None) -> None:
    require_shared()
    assert path is not None, f"no traces found under {CONFORMANCE}"
    expected_path = path.with_name(path.stem + ".expected.json")
    assert expected_path.is_file(), f"{expected_path} is missing"
    with open(expected_path) as f:
        expected = json.load(f)
    try:
        result = run_trace(load_trace(str(path)))
    except UnsupportedTraceError as e:
        pending = _kinds(path) & PENDING_KINDS
        if _profile(path) not in (None, *SUPPORTED_SEED_PROFILES):
            raise  # a tracked, not-yet-supported seed profile
        if not any(repr(k) in str(e) for k in pending):
            pytest.fail(f"{path.name}: unsupported for an unexpected reason: {e}")
        raise
    assert result["resolved"] == expected["resolved"]
    if result["results"] != expected["results"]:
        pytest.fail(f"{path.name}: " + _first_difference(expected["results"], result["results"]))
    assert result["summary"]["num_results"] == len(expected["results"])


def _connector_traces_with_reservations() -> list[Any]:
    if not CONFORMANCE.is_dir():
        return [pytest.param(None, id="shared-conformance-missing")]
    paths = [p for p in _trace_paths(("connector-traces",))
             if '"reserved_blocks"' in p.read_text()]
    return [pytest.param(p, id=p.stem) for p in paths] or [
        pytest.param(None, id="no-reserved-blocks-in-connector-traces")]


@pytest.mark.parametrize("path", _connector_traces_with_reservations())
def test_reserved_blocks_are_what_the_scheduler_computed(path: Path | None) -> None:
    """``KVCacheManager.get_num_reserved_blocks`` (the public form of the Scheduler's
    coordinator reach-in) gives every ``reserved_blocks`` vLLM's Scheduler passed, from the
    in-flight prefills the trace implies: admitted requests still prefilling after their
    chunk, and async loads in progress (no speculative decoding in these traces)."""
    require_shared()
    assert path is not None, f"no connector trace with reserved_blocks under {CONFORMANCE}"
    trace = load_trace(str(path))
    rep = Replayer(trace["config"])
    inflight: dict[str, Request] = {}
    checked = 0
    for op in trace["ops"]:
        name, rid = op["op"], op.get("id")
        if name != "allocate_slots":
            if name in ("free", "preempt", "finish", "pop_blocks_for_free") or (
                    name == "update_request"
                    and op.get("status", "").startswith(("FINISHED", "PREEMPTED"))):
                inflight.pop(rid, None)
            rep.apply(op)
            continue
        req = rep.requests[rid]
        if "reserved_blocks" in op:
            others = [r for r in inflight.values() if r is not req]
            assert rep.manager.get_num_reserved_blocks(others) == op["reserved_blocks"], \
                (op, sorted(inflight))
            checked += 1
        admitted = req.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED)
        result = rep.apply(op)
        assert result is not None
        if not result["ok"]:
            continue
        after = (req.num_computed_tokens + op.get("num_new_computed_tokens", 0)
                 + op.get("num_external_computed_tokens", 0) + op["num_new_tokens"])
        if op.get("delay_cache_blocks") or (admitted and after < req.num_tokens):
            inflight[rid] = req
        elif after >= req.num_tokens:
            inflight.pop(rid, None)
    assert checked > 0


def test_seed_profiles_are_all_tracked() -> None:
    """Every seed-traces/ profile is either supported or tracked as pending, and every
    supported one has traces (a vanished profile must not shrink the suite silently)."""
    require_shared()
    found = {_profile(p) for p in _trace_paths(("seed-traces",))}
    assert found == ALL_SEED_PROFILES
    assert found >= SUPPORTED_SEED_PROFILES


def test_pending_kinds_are_real_group_kinds() -> None:
    assert frozenset({"mamba", "sliding_window", "chunked_local", "full"}) >= PENDING_KINDS


# ----------------------------------------------------------------------------- the CLI


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(REPO_ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    return subprocess.run([sys.executable, "-m", "kvplugin.cli", *args], capture_output=True,
                          text=True, cwd=REPO_ROOT, env=env, timeout=300)


def _compare(expected: Path, actual: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(COMPARE), str(expected), str(actual)],
                          capture_output=True, text=True, timeout=120)


def _trace(name: str) -> Path:
    require_shared()
    path = CONFORMANCE / "traces" / f"{name}.json"
    assert path.is_file(), f"{path} is missing"
    return path


def test_cli_replay_output_is_accepted_by_compare(tmp_path: Path) -> None:
    trace = _trace("full_s1000")
    out = tmp_path / "full_s1000.result.json"
    proc = _cli("replay", str(trace), "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    cmp = _compare(trace.with_name("full_s1000.expected.json"), out)
    assert cmp.returncode == 0, cmp.stdout
    assert "MATCH" in cmp.stdout
    result = json.loads(out.read_text())
    assert result["format"] == "vllm-kv-oracle-result/v1"
    # One result per line, so a plain diff lines ops up.
    assert len(out.read_text().splitlines()) == len(result["results"]) + 2


def test_cli_replay_several_traces_to_an_out_dir(tmp_path: Path) -> None:
    names = ["unit_prefill", "hybrid_swa_s1004", "swa_only_s1006"]
    out_dir = tmp_path / "results"
    proc = _cli("replay", *(str(_trace(n)) for n in names), "--out-dir", str(out_dir))
    assert proc.returncode == 0, proc.stderr
    assert sorted(p.name for p in out_dir.iterdir()) == sorted(f"{n}.result.json"
                                                                for n in names)
    for n in names:
        cmp = _compare(_trace(n).with_name(f"{n}.expected.json"), out_dir / f"{n}.result.json")
        assert cmp.returncode == 0, f"{n}: {cmp.stdout}"


def test_cli_several_traces_need_an_out_dir() -> None:
    proc = _cli("replay", str(_trace("unit_prefill")), str(_trace("swa_only_s1006")))
    assert proc.returncode == 2 and "--out-dir" in proc.stderr


def test_cli_bench_prints_ops_per_sec_last() -> None:
    trace = _trace("unit_prefill")
    proc = _cli("replay", str(trace), "--bench", "1")
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["ops_per_sec"] > 0
    assert last["num_ops"] == len(load_trace(str(trace))["ops"])
    assert last["repeats"] == 1


def test_cli_unsupported_group_kind_exits_nonzero_naming_it(tmp_path: Path) -> None:
    trace = tmp_path / "bogus.json"
    trace.write_text(json.dumps({
        "format": "vllm-kv-oracle-trace/v1", "meta": {},
        "config": {"groups": [{"kind": "full"}, {"kind": "bogus"}]},
        "ops": [{"op": "add_request", "id": "a", "prompt": [1, 2, 3]}]}))
    proc = _cli("replay", str(trace), "-o", str(tmp_path / "out.json"))
    assert proc.returncode != 0
    assert "bogus" in proc.stderr
    assert not (tmp_path / "out.json").exists()
    with pytest.raises(UnsupportedTraceError, match="bogus"):
        run_trace(load_trace(str(trace)))
