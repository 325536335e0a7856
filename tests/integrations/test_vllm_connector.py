"""KVPluginConnector in vLLM 0.33.0's real Scheduler (CPU), run as subprocesses under the side
virtualenv (vLLM + CPU torch; ``tools/setup_vllm_side_venv.sh`` builds it). Its python comes
from ``KVPLUGIN_VLLM_PYTHON``, else the default venv path. Missing: skipped locally, a
failure under ``KVPLUGIN_REQUIRE_VLLM=1`` (CI)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from connectors.faults import LocalRedisServer

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
DEFAULT_PY = Path.home() / ".cache" / "kvplugin-vllm-reference" / "bin" / "python"
ALL = ["disk", "redis", "corrupt", "async", "preempt", "native", "dead", "multiturn"]


def _side_python() -> str:
    py = os.environ.get("KVPLUGIN_VLLM_PYTHON") or str(DEFAULT_PY)
    if not os.access(py, os.X_OK):
        msg = (f"no vLLM side virtualenv python at {py} (run tools/setup_vllm_side_venv.sh "
               "or set KVPLUGIN_VLLM_PYTHON)")
        if os.environ.get("KVPLUGIN_REQUIRE_VLLM") == "1":
            pytest.fail(msg)
        pytest.skip(msg)
    return py


def _scenarios() -> list[str]:
    if LocalRedisServer.available():
        return ALL
    if os.environ.get("KVPLUGIN_REQUIRE_REDIS") == "1":
        pytest.fail("redis-server is not installed (KVPLUGIN_REQUIRE_REDIS=1)")
    return [s for s in ALL if s != "redis"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    py = _side_python()
    names = _scenarios()
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    proc = subprocess.run([py, str(SCENARIOS), *names], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            rec = json.loads(line)
            out[rec["scenario"]] = rec
    assert sorted(out) == sorted(names), proc.stdout[-2000:]
    return out


def _check_invariants(rec: dict[str, Any], finished: list[str]) -> None:
    assert rec["finished"] == finished
    # Every block is back in vLLM's free queue (the null block excepted): delayed frees
    # were all released, nothing leaked.
    assert rec["free_blocks"] == rec["num_blocks"] - 1
    assert rec["connector"] == "KVPluginConnector"  # loaded through vLLM's factory


EVICTING = ["a", "b", "f0", "f1", "f2", "f3"]


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_evicted_prefix_loads_from_tier_and_equals_stored(results: dict[str, Any],
                                                          tier: str) -> None:
    if tier not in results:
        pytest.skip("redis-server is not installed")
    rec = results[tier]
    # disk: x's cache_salt is no valid tenant name; it is served, without offload (it
    # stores nothing: the chunk count is b's and a's and the fillers' only).
    _check_invariants(rec, sorted([*EVICTING, "x"]) if tier == "disk" else EVICTING)
    # b's 80-token prefix (5 blocks) left the device pool and came back from the tier,
    # every block equal to the KV that a computed.
    assert rec["loads"] == [{"req": "b", "first_token": 0, "blocks": 5, "async": False,
                             "verified": 5, "mismatched": 0, "invalid": 0}]
    assert rec["invalid_blocks"] == 0
    assert rec["saved_chunks"] == 30


def test_corrupt_object_is_a_load_error_and_vllm_recomputes(results: dict[str, Any]) -> None:
    rec = results["corrupt"]
    _check_invariants(rec, EVICTING)
    # The third chunk was damaged after the lookup: blocks 3..5 are reported invalid
    # (vLLM recomputes from the first bad block), the first two still load correctly.
    assert rec["loads"] == [{"req": "b", "first_token": 0, "blocks": 5, "async": False,
                             "verified": 2, "mismatched": 0, "invalid": 3}]
    assert rec["invalid_blocks"] == 3


def test_async_load_waits_for_remote_kvs(results: dict[str, Any]) -> None:
    rec = results["async"]
    _check_invariants(rec, EVICTING)
    assert rec["loads"] == [{"req": "b", "first_token": 0, "blocks": 5, "async": True,
                             "verified": 5, "mismatched": 0, "invalid": 0}]
    # The loaded chunks are not stored again: only b's sixth chunk is new.
    assert rec["saved_chunks"] == 30


def test_preempted_request_reloads_its_stored_prefix(results: dict[str, Any]) -> None:
    rec = results["preempt"]
    _check_invariants(rec, ["p0", "p1"])
    assert rec["preempted"] == ["p1"]
    assert len(rec["loads"]) == 1
    load = rec["loads"][0]
    assert load["req"] == "p1" and load["async"] is False
    assert load["blocks"] >= 1 and load["verified"] == load["blocks"]
    assert load["mismatched"] == 0 and load["invalid"] == 0


def test_multiturn_with_a_pool_smaller_than_the_working_set(results: dict[str, Any]) -> None:
    rec = results["multiturn"]
    _check_invariants(rec, sorted(f"c{c}t{t}" for c in range(4) for t in range(3)))
    loads = rec["loads"]
    # Later turns find their history evicted from the 12-block pool and load it; how
    # many depends on store timing (delayed frees), what is loaded does not: every block
    # equals the KV the earlier turn computed.
    assert sum(ld["blocks"] for ld in loads) > 0
    assert all(ld["req"][-2:] in ("t1", "t2") for ld in loads)
    for ld in loads:
        assert ld["verified"] == ld["blocks"] and ld["mismatched"] == 0 == ld["invalid"]


def test_dead_tier_never_stalls_vllm(results: dict[str, Any]) -> None:
    rec = results["dead"]
    # Every tier call fails: lookups are misses (nothing loaded), stores fail (logged), yet
    # every request finishes and the delayed frees are all released.
    _check_invariants(rec, EVICTING)
    assert rec["loads"] == []
    assert rec["saved_chunks"] == 35  # planned and attempted (b computed its prefix too)


def test_vllm_and_native_manager_share_keys_both_ways(results: dict[str, Any]) -> None:
    rec = results["native"]
    # vLLM stored a's 5 chunks for tenant acme (cache_salt "tenant=acme", as the native
    # manager salts acme's requests); the native manager finds and loads all of them.
    assert rec["vllm_stored_chunks"] == 5
    assert rec["native_load"] == {"external_tokens": 80, "loaded_tokens": 80, "equal": True}
    # Another tenant's namespace holds none of it.
    assert rec["other_tenant_load"] == {"external_tokens": 0, "loaded_tokens": 0,
                                        "equal": False}
    # The reverse: the native manager stored 96 tokens (one store job), vLLM loads 6 blocks
    # equal to them (the fake KV is the same function of token and position).
    assert rec["native_stores"] == 1
    assert rec["vllm_loads"] == [{"req": "c", "first_token": 0, "blocks": 6, "async": False,
                                  "verified": 6, "mismatched": 0, "invalid": 0}]
    assert rec["vllm_free_blocks"] == rec["num_blocks"] - 1


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is installed in this environment")
def test_import_without_vllm_and_clear_error_on_build() -> None:
    import kvplugin.integrations.vllm as integ

    with pytest.raises(ImportError, match=r"`vllm` extra"):
        integ.KVPluginConnector(None, None, None)
    assert "torch" not in sys.modules or importlib.util.find_spec("torch") is not None


def test_tenant_of_salt_reads_the_native_managers_salts() -> None:
    from kvplugin.aio.tenants import device_salt
    from kvplugin.integrations.vllm import tenant_of_salt

    assert tenant_of_salt(device_salt("acme")) == "acme"
    assert tenant_of_salt(device_salt("acme", "s;alt")) == "acme"
    assert tenant_of_salt("bob") == "bob"
