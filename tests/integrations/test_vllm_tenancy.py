"""The offload core inside vLLM 0.33.0's real Scheduler (CPU): the scheduler connector's
ledger is tracked (its plans end when the worker reports them), tenants' tier byte quotas
bind on bytes held, two requests storing one object store it once, ``kv_role`` is
honoured, and a dead tier beside a live one is counted and logged, rate-limited.
Scenarios in ``vllm_tenancy.py``, run under the side virtualenv as test_vllm_connector.py
runs its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from side_venv import run_scenarios, side_python

SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
NAMES = ["tenant_quota", "dedup", "producer", "consumer", "dead_beside"]
CHUNK = 2048  # one 16-token chunk of the test model (vllm_tenancy.CHUNK_BYTES)


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    py = side_python("KVPLUGIN_VLLM_PYTHON", "kvplugin-vllm-reference",
                     "tools/setup_vllm_side_venv.sh")
    return run_scenarios(py, SCENARIOS, NAMES)


def _closed(rec: dict[str, Any]) -> None:
    """Every plan the scheduler prepared was completed from the worker's reports."""
    assert rec["open_plans"] == 0 and rec["bytes_in_flight"] == 0
    for book in rec["books"].values():
        assert book["store_bytes_in_flight"] == 0


def test_a_tenants_disk_quota_binds_on_bytes_held(results: dict[str, Any]) -> None:
    """a's objects on disk never exceed its quota, after any step (the ledger's belief and
    the disk's real contents); the quota is reached; b, with none, stores its whole
    working set; a's sheds are counted as quota sheds."""
    rec = results["tenant_quota"]
    _closed(rec)
    quota = rec["quota"]
    assert rec["max_true_a"] == rec["max_held_a"] == quota == 8 * CHUNK
    a, b = rec["books"]["a"], rec["books"]["b"]
    assert a["stored_chunks"] == 8 and a["stored_bytes_by_tier"] == {"disk": quota}
    assert a["stores_shed"] == a["stores_shed_quota"] == 24 - 8  # 4 prompts x 6 chunks
    assert b["stored_chunks"] == 24 and b["stores_shed"] == 0 and b["stores_failed"] == 0
    assert rec["held"] == {"a|disk": quota}  # only tenants with a quota are tracked
    assert rec["stored_by_req"] == {"a0": 6, "a1": 2, "b0": 6, "b1": 6, "b2": 6, "b3": 6}


def test_an_object_two_requests_store_at_once_is_stored_once(results: dict[str, Any]) -> None:
    rec = results["dedup"]
    _closed(rec)
    book = rec["books"]["default"]
    assert book["stores_deduplicated"] == 1 and book["stored_chunks"] == 2
    assert rec["saved_pieces"] == {"0": 2} and rec["stored_by_req"] == {"a": 2}


def test_a_producer_stores_and_never_loads(results: dict[str, Any]) -> None:
    rec = results["producer"]
    _closed(rec)
    book = rec["books"]["default"]
    # b's prefix is on the tier (a stored it) and gone from the device: a kv_both engine
    # loads it (test_vllm_connector's "disk"); the producer computes it.
    assert rec["loads"] == [] and book["loads"] == 0 and book["hit_tokens"] == {"device": 0}
    assert rec["stored_by_req"]["a"] == 5 and book["stored_chunks"] == 35


def test_a_consumer_loads_a_producers_objects_and_stores_nothing(
        results: dict[str, Any]) -> None:
    rec = results["consumer"]
    prod, cons = rec["producer"], rec["consumer"]
    _closed(prod)
    _closed(cons)
    assert prod["books"]["default"]["stored_chunks"] == 5 and prod["loads"] == []
    assert cons["loads"] == [{"req": "b", "first_token": 0, "blocks": 5, "async": False,
                              "verified": 5, "mismatched": 0, "invalid": 0}]
    book = cons["books"]["default"]
    assert book["hit_tokens"] == {"device": 0, "offload": 80} and book["loads"] == 1
    assert book["loaded_bytes"] == 5 * CHUNK
    assert cons["saved_pieces"] == {} and book["stores"] == 0 and book["stored_chunks"] == 0


def test_a_dead_tier_beside_a_live_one_is_counted_and_logged_once(
        results: dict[str, Any]) -> None:
    """Redis is dead, disk alive: stores complete through the disk (nothing charged to
    Redis), b loads from the disk, Redis's errors are counted per tier, and the log has
    one line: the health warning at start (the errors after it are held back, counted, for
    the rate limit's interval), not one per request."""
    rec = results["dead_beside"]
    _closed(rec)
    book = rec["books"]["default"]
    assert book["stored_bytes_by_tier"] == {"disk": 30 * CHUNK, "redis": 0}
    assert book["stores_failed"] == 0 and book["loads"] == 1 and book["loads_failed"] == 0
    assert rec["worker_stats"]["tier_errors||redis"] > 10
    assert set(rec["worker_stats"]) == {"tier_errors||redis"}
    (start,) = rec["warnings"]
    assert start.startswith("kvplugin: tier(s) failed their health check at start: redis (")
