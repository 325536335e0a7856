"""kvplugin as SGLang's HiCache storage backend (``kvplugin.integrations.sglang``) against
SGLang 0.5.23's real classes: its factory, host pool, file backend (a differential), failure
injector and page hashing. Scenarios in ``sglang_scenarios.py``, run under the SGLang side
venv (``tools/setup_sglang_venv.sh``; missing: skipped, or failed under
``KVPLUGIN_REQUIRE_SGLANG=1`` as CI sets it)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from redis_fixture import local_redis
from side_venv import run_scenarios, side_python

from kvplugin.connectors.faults import LocalRedisServer

SCENARIOS = Path(__file__).with_name("sglang_scenarios.py")
NAMES = ["roundtrip", "v1@layer_first", "v1@page_first", "differential", "injector",
         "tenants", "dead_redis", "slow_tier", "quota", "hybrid"]
PAGE_BYTES = 2048  # 2 layers x K/V x 16 tokens x 2 heads x 8 dims x bf16
__all__ = ["local_redis"]  # a fixture this module uses (pytest finds it by its name here)


def _py() -> str:
    return side_python("KVPLUGIN_SGLANG_PYTHON", "kvplugin-sglang",
                       "tools/setup_sglang_venv.sh", require="KVPLUGIN_REQUIRE_SGLANG")


@pytest.fixture(scope="module")
def results(local_redis: LocalRedisServer) -> dict[str, dict[str, Any]]:
    return run_scenarios(_py(), SCENARIOS, NAMES, env={"KVPLUGIN_SG_REDIS": local_redis.url})


def test_docs_launch_flags_build_the_backend_through_sglangs_factory(tmp_path: Path) -> None:
    rec = run_scenarios(_py(), SCENARIOS, ["docs_factory"], env={
        "KVPLUGIN_OFFLOAD__LOCAL_DISK": f"file://{tmp_path}"})["docs_factory"]
    assert rec == {"class": "KVPluginHiCacheStorage", "tiers": ["disk"],
                   "backend": "dynamic", "hierarchical": True, "scenario": "docs_factory"}


def test_legacy_round_trip_is_byte_exact(results: dict[str, Any]) -> None:
    rec = results["roundtrip"]
    assert rec["stored"] is True
    assert rec["exist"] == [3, 2, True, False]
    assert rec["exact"] == [True, True, True] and rec["wrong_size"] is True
    assert rec["backup_pgs"] == [3] and rec["prefetch_pgs"] == [3]
    c = rec["counters"]
    assert c["stored_bytes|default|memory"] == c["stored_bytes|default|disk"] == 3 * PAGE_BYTES
    assert c["loaded_bytes|default"] == 3 * PAGE_BYTES
    assert c["refused_objects|layout"] == 1  # the read into a target of another size
    # tier_events: the tiers' stores, by SGLang's page hashes.
    assert [(e["tier"], e["removed"], sorted(e["keys"])) for e in rec["events"]] == [
        ("memory", False, sorted(rec["keys"])), ("disk", False, sorted(rec["keys"]))]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_v1_round_trip_through_sglangs_host_pool(results: dict[str, Any], layout: str
                                                 ) -> None:
    rec = results[f"v1@{layout}"]
    assert rec["stored"] == [True] * 3 and rec["got"] == [True] * 3
    assert rec["exact"] == [True] * 3 and rec["missing"] == [False]
    assert (rec["page_bytes"], rec["dtype"], rec["layout"]) == (PAGE_BYTES, "bfloat16",
                                                                layout)


def test_same_answers_as_sglangs_file_backend_and_stricter_where_said(
        results: dict[str, Any]) -> None:
    rec = results["differential"]
    assert rec["kvplugin"] == rec["file"] == [
        True, True, True, [True, True, True, False, True, False], 3, 1,
        [True, True, True], True]
    # HiCacheFile fills a smaller target with the page's first bytes and returns it.
    assert rec["file_wrong_size"] == "returned" and rec["kvplugin_wrong_size"] is True
    assert rec["file_damaged"] == "wrong bytes" and rec["kvplugin_damaged"] == "None"
    assert rec["kvplugin_refused"] == 1


def test_sglangs_failure_injector_never_yields_a_wrong_page(results: dict[str, Any]) -> None:
    rec = results["injector"]
    assert rec["wrong"] == 0
    assert rec["exact"] > 0 and rec["miss"] > 0  # both happened: the injector bit
    assert rec["exact"] + rec["miss"] == 160
    assert 0 < rec["set_true"] < 20 and rec["said_but_missing"] == 0


def test_two_tenants_never_share_a_page(results: dict[str, Any]) -> None:
    rec = results["tenants"]
    assert (rec["a"], rec["b"], rec["b_get"]) == (2, 0, [True, True])
    assert rec["b_as_a"] == 2  # a caller naming the tenant per call
    assert rec["salts_differ"] is True and rec["salt_vs_none"] is True


def test_a_dead_redis_answers_within_its_deadlines(results: dict[str, Any]) -> None:
    rec = results["dead_redis"]
    assert rec["exists"] == 0 and rec["exists_s"] < 1.0
    assert rec["stored"] is False and rec["got"] == [True, True]
    assert rec["total_s"] < 3.0 and rec["errors"] >= 2


def test_a_slow_tier_is_a_miss_at_each_deadline(results: dict[str, Any]) -> None:
    rec = results["slow_tier"]
    assert rec["exists"] == 0 and rec["exists_s"] < 0.5
    assert rec["got"] == [True, True] and rec["get_s"] < 1.0


def test_a_tenants_quota_binds_on_bytes_held(results: dict[str, Any]) -> None:
    rec = results["quota"]
    assert rec["stored"] == [True, True, False] and rec["exists"] == 2
    assert rec["counters"]["stores_shed|q|quota"] == 1
    assert rec["gauges"] == {"held_bytes|q|memory": 2 * PAGE_BYTES}


def test_hybrid_v2_answers_as_sglangs_file_backend(results: dict[str, Any]) -> None:
    """SGLang's KV host pool and its real MambaPoolHost: four KV pages, Mamba states at the
    ends of pages 2 and 4. The same answers as HiCacheFile for every existence check (a
    trailing-pages pool, a hole, a window of 2, all pages) and every read."""
    rec = results["hybrid"]
    assert rec["kvplugin"] == rec["file"]
    k = rec["kvplugin"]
    assert k["wrote"] == {"kv": [True] * 4, "mamba": [True, True]}
    assert k["trailing4"] == {"kv_hit_pages": 4, "extra": {"kv": 4, "mamba": 4},
                              "restorable": [2, 4]}
    assert k["trailing3"] == {"kv_hit_pages": 2, "extra": {"kv": 3, "mamba": 2},
                              "restorable": [2]}
    assert k["window2"]["kv_hit_pages"] == k["all_pages"]["kv_hit_pages"] == 0
    assert k["read"] == {"mamba": [True, False], "kv": [True, True]}
    assert k["state_exact"] is True and k["kv_exact"] == [True, True]
