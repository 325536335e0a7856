"""kvplugin's tiers as a secondary tier of vLLM 0.33's own offloading
(``kvplugin.integrations.vllm_tier``), against vLLM's real classes: its factory, its
``TieringOffloadingSpec`` / ``TieringOffloadingManager`` (CPU primary tier, cascades,
promotions, backpressure detector, stats) and its ``AsyncLookupManager``, as vLLM tests its
own tiers (a CPU tensor as the primary buffer, jobs submitted and polled). Scenarios in
``vllm_tier_scenarios.py``, run under the vLLM side virtualenv."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from redis_fixture import local_redis, start_local_cluster
from side_venv import run_scenarios, side_python

from kvplugin.connectors.cluster_testing import LocalRedisCluster

SCENARIOS = Path(__file__).with_name("vllm_tier_scenarios.py")
NAMES = ["roundtrip", "damaged", "dead_redis", "slow_tier", "tenants",
         "quota", "events", "window"]
ROW = 4096  # one primary chunk row of the scenarios (vllm_tier_scenarios.ROW)
K = [f"{i:016x}00000000" for i in range(4)]  # vLLM's OffloadKey hex: hash i, group 0


def _py() -> str:
    return side_python("KVPLUGIN_VLLM_PYTHON", "kvplugin-vllm-reference",
                       "tools/setup_vllm_side_venv.sh")


__all__ = ["local_redis"]  # a fixture this module uses (pytest finds it by its name here)


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_scenarios(_py(), SCENARIOS, NAMES)


def test_docs_config_builds_the_tier_in_vllms_manager(tmp_path: Path) -> None:
    """docs/vllm.md's --kv-transfer-config, verbatim: vLLM's TieringOffloadingSpec builds
    its manager, and vLLM's factory our tier from the entry (configs/vllm_tier.yaml; its
    disk directory moved by the deployment's env override, as an operator would)."""
    rec = run_scenarios(_py(), SCENARIOS, ["docs_factory"], env={
        "KVPLUGIN_OFFLOAD__LOCAL_DISK": f"file://{tmp_path}"})["docs_factory"]
    assert rec["kv_connector"] == "OffloadingConnector"
    assert rec["spec"] == "TieringOffloadingSpec"
    assert rec["class"] == rec["tier_type"] == "KVPluginSecondaryTier"
    assert rec["tiers"] == ["memory", "disk"]
    assert (rec["medium"], rec["locality"]) == ("STORAGE", "LOCAL")
    assert rec["row"] == ROW and rec["chunks"] == 8 * 2**30 // ROW


def test_store_then_load_is_byte_exact(results: dict[str, Any]) -> None:
    rec = results["roundtrip"]
    assert rec["stored"] == [{"job": 1, "success": True, "bytes": 4 * ROW, "ok_keys": None}]
    assert rec["loaded"] == [{"job": 2, "success": True, "bytes": 4 * ROW, "ok_keys": None}]
    assert rec["exact"] is True and rec["pending"] is False
    assert rec["lookups"] == ["HIT"] * 4 + ["MISS"]
    assert rec["stats"] == {"stored_bytes": {"default|memory": 4 * ROW,
                                             "default|disk": 4 * ROW},
                            "hit_tokens": {"default|memory": 64},
                            "queried_tokens": {"default": 80},
                            "loaded_bytes": {"default": 4 * ROW}}


def test_damaged_missing_and_misshapen_objects_fail_their_load(results: dict[str, Any]
                                                                ) -> None:
    """Object 1 has a flipped bit, 2 is gone, 3 is a row of another shape: the job fails,
    object 0 is copied in and named, nothing else is written, the failed keys' cached
    HITs turn to misses."""
    rec = results["damaged"]
    assert rec["before"] == ["HIT"] * 4
    assert rec["loaded"] == [{"job": 2, "success": False, "bytes": ROW, "ok_keys": [K[0]]}]
    assert rec["first_exact"] is True and rec["failed_rows_zero"] is True
    assert rec["after"] == ["HIT", "MISS", "MISS", "MISS"]
    assert rec["stats"]["refused_objects"] == {"disk": 1, "layout": 1}
    assert rec["stats"]["loads_failed"] == {"default": 1}
    assert rec["stats"]["loaded_bytes"] == {"default": ROW}


def test_a_dead_redis_misses_in_time_and_trips_vllms_backpressure(results: dict[str, Any]
                                                                   ) -> None:
    rec = results["dead_redis"]
    assert rec["lookups"] == ["MISS", "MISS"] and rec["resolved_s"] < 1.0
    # failure_threshold 3: three failed cascades put the tier under pressure, and vLLM
    # drops the next two instead of submitting them.
    assert rec["pressure"] == [False, False, True, True, True]
    assert rec["cascade_failures"] == 3 and rec["dropped"] == 2
    assert rec["stats"]["tier_errors"]["redis"] >= 3
    assert "stored_bytes" not in rec["stats"]


def test_a_slow_tier_is_a_miss_at_the_lookup_deadline(results: dict[str, Any]) -> None:
    rec = results["slow_tier"]  # every call sleeps up to 2 s; the deadline is 50 ms
    assert rec["lookups"] == ["MISS"] * 3 and rec["resolved_s"] < 0.5


def test_two_tenants_never_share_an_object(results: dict[str, Any]) -> None:
    """Same vLLM key, tenant a (kv_transfer_params) and b (a cache salt naming it): b's
    lookup misses (vLLM's lookup cache does not carry a's verdict over), its load fails
    and writes nothing; the storage ids differ."""
    rec = results["tenants"]
    assert rec["a"] == ["HIT"] and rec["b"] == ["MISS"]
    assert rec["b_load"] == [{"job": 2, "success": False, "bytes": 0, "ok_keys": None}]
    assert rec["ids_differ"] is True and rec["b_row_zero"] is True
    assert rec["stats"]["stored_bytes"] == {"a|memory": ROW}
    assert rec["stats"]["loads_failed"] == {"b": 1}


def test_a_tier_quota_binds_on_bytes_held(results: dict[str, Any]) -> None:
    rec = results["quota"]
    q, r = rec["q"], rec["r"]
    assert [s["bytes"] for s in q["stores"]] == [ROW, ROW, 0]
    assert all(s["success"] for s in q["stores"])  # a quota shed is no tier failure
    assert q["lookups"] == ["HIT", "HIT", "MISS"]
    assert [s["bytes"] for s in r["stores"]] == [ROW] * 3 and r["lookups"] == ["HIT"] * 3
    assert rec["undeclared"] == [{"job": 99, "success": True, "bytes": 0, "ok_keys": None}]
    st = rec["stats"]
    assert st["stores_shed"] == {"q|quota": 1}
    assert st["held_bytes"] == {"q|memory": 2 * ROW}
    assert st["stored_bytes"] == {"q|memory": 2 * ROW, "r|memory": 3 * ROW}


def test_events_match_what_the_tier_holds(results: dict[str, Any]) -> None:
    rec = results["events"]
    ev = [(e["keys"], e["removed"]) for e in rec["events"]]
    assert ev == [([K[0], K[1]], False), ([K[0]], True), ([K[2]], False)]
    assert {(e["medium"], e["locality"], e["ownership"]) for e in rec["events"]} == {
        ("CPU", "LOCAL", "KVPluginSecondaryTier")}
    assert rec["held"] == rec["found"] == [K[1], K[2]]


def test_a_window_group_is_looked_up_from_the_end(results: dict[str, Any]) -> None:
    rec = results["window"]
    assert rec["group0"] == ["MISS", "MISS", "MISS"]  # no prefix: chunk 0 is missing
    assert rec["group1"] == ["MISS", "HIT", "HIT"]


@pytest.fixture(scope="module")
def cluster_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A local Redis Cluster of three masters (kvplugin.connectors.cluster_testing)."""
    cluster = start_local_cluster(LocalRedisCluster(
        str(tmp_path_factory.mktemp("tier-cluster")), replicas=0))
    yield cluster.url
    cluster.kill_all()


@pytest.mark.parametrize("kind", ["disk", "redis", "cluster"])
def test_a_fresh_process_gets_hits_through_vllms_manager(kind: str, tmp_path: Path,
                                                         request: pytest.FixtureRequest
                                                         ) -> None:
    """One process's vLLM manager stores three chunks (vLLM cascades them to the tier);
    a fresh process's manager, its primary empty, finds them (RETRY, then HIT_PENDING while
    vLLM promotes them, then HIT) and they are the bytes the first one wrote. Disk, a
    redis-server and a Redis Cluster the test starts."""
    env = {"KVPLUGIN_TIER_WORKDIR": str(tmp_path)}
    if kind != "disk":
        env["KVPLUGIN_TIER_REDIS"] = (request.getfixturevalue("local_redis").url
                                      if kind == "redis"
                                      else request.getfixturevalue("cluster_url"))
    py = _py()
    store = run_scenarios(py, SCENARIOS, [f"store_fresh@{kind}"], env=env)
    load = run_scenarios(py, SCENARIOS, [f"load_fresh@{kind}"], env=env)
    tier = "disk" if kind == "disk" else "redis"  # a cluster is kvplugin's redis tier too
    assert store[f"store_fresh@{kind}"]["stats"] == {"stored_bytes": {f"default|{tier}":
                                                                       3 * ROW}}
    rec = load[f"load_fresh@{kind}"]
    assert rec["lookups"][0] == ["RETRY"] * 4
    assert rec["lookups"][-1] == ["HIT", "HIT", "HIT", "MISS"]
    assert rec["exact"] is True
    assert rec["stats"]["loaded_bytes"] == {"default": 3 * ROW}
    assert rec["stats"]["hit_tokens"] == {f"default|{tier}": 48}
