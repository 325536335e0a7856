"""KVPluginConnector in vLLM 0.33.0's real Scheduler (CPU), run as subprocesses under the side
virtualenv (vLLM + CPU torch; ``tools/setup_vllm_side_venv.sh`` builds it). Its python comes
from ``KVPLUGIN_VLLM_PYTHON``, else the default venv path. Missing: skipped locally, a
failure under ``KVPLUGIN_REQUIRE_VLLM=1`` (CI)."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from side_venv import run_scenarios, side_python

from kvplugin.connectors.faults import LocalRedisServer

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("vllm_scenarios.py")
ALL = ["disk", "redis", "corrupt", "mislabelled", "mamba_mislabelled", "poison", "async",
       "preempt", "native", "dead", "multiturn",
       "events", "events_evict", "pages",
       "swa", "swa_corrupt", "native_swa", "mamba", "mamba_corrupt", "mamba_multiturn",
       "mamba_tail", "native_mamba", "mamba_preempt", "mamba_diverge", "mamba_diverge_exact",
       "mamba_preempt_alone", "refusals", "mla", "mla_corrupt", "native_mla", "local",
       "local_corrupt", "native_local"]
# The same scenarios on the tensors vLLM allocates in every other KVCacheLayout (the
# default run is LBHNC, vLLM's CPU attention layout), and with kernel blocks splitting each
# block. Hybrid Mamba layouts skip LHBNC: there vLLM's own overlay of an attention group
# (heads outside blocks) and a Mamba group (one page per block) aliases different block
# ids, so vLLM alone corrupts states (docs/vllm.md).
LAYOUTS = ["LBNHC", "LHBNC", "BLHNC", "BLNHC", "BHLNC", "LBNHC/split"]
MATRIX = ["disk", "corrupt", "async", "swa", "native_swa", "mamba_multiturn", "native_mamba",
          "mla", "local"]
MATRIX_RUNS = [f"{s}@{lay}" for lay in LAYOUTS for s in MATRIX
               if not (lay == "LHBNC" and "mamba" in s)]


def _side_python() -> str:
    return side_python("KVPLUGIN_VLLM_PYTHON", "kvplugin-vllm-reference",
                       "tools/setup_vllm_side_venv.sh")


def _scenarios() -> list[str]:
    if LocalRedisServer.available():
        return ALL + MATRIX_RUNS
    if os.environ.get("KVPLUGIN_REQUIRE_REDIS") == "1":
        pytest.fail("redis-server is not installed (KVPLUGIN_REQUIRE_REDIS=1)")
    return [s for s in ALL + MATRIX_RUNS if s != "redis"]


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, Any]]:
    return run_scenarios(_side_python(), SCENARIOS, _scenarios())


def _check_invariants(rec: dict[str, Any], finished: list[str]) -> None:
    assert rec["finished"] == finished
    # Every block is back in vLLM's free queue (the null block excepted): delayed frees
    # were all released, nothing leaked.
    assert rec["free_blocks"] == rec["num_blocks"] - 1
    assert rec["connector"] == "KVPluginConnector"  # loaded through vLLM's factory
    # Every store plan the scheduler's ledger prepared was completed from the workers'
    # reports (kv_connector_worker_meta): nothing left open, no byte still in flight.
    assert rec["open_plans"] == 0 and rec["bytes_in_flight"] == 0


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


def test_mislabelled_object_is_refused_by_the_workers_acceptance_check(
        results: dict[str, Any]) -> None:
    rec = results["mislabelled"]
    _check_invariants(rec, EVICTING)
    # The third object of b's load is valid (checksum, namespace) but holds the second
    # chunk's bytes and token range: the worker's check (kvplugin.aio.objects, the native
    # manager's) refuses it, blocks 3..5 are reported invalid and vLLM recomputes them.
    # Accepting it would load chunk 1's KV into chunk 2's blocks (mismatched 1).
    assert rec["loads"] == [{"req": "b", "first_token": 0, "blocks": 5, "async": False,
                             "verified": 2, "mismatched": 0, "invalid": 3}]
    assert rec["invalid_blocks"] == 3
    assert rec["worker_stats"]["objects_refused"] == 1


def test_mamba_state_labelled_for_another_boundary_fails_the_hybrid_load(
        results: dict[str, Any]) -> None:
    rec = results["mamba_mislabelled"]
    _check_invariants(rec, EVICTING)
    # The state piece says it is the state at another boundary: refused, the whole hybrid
    # load fails (a failed receive), vLLM recomputes b and no state it resumed from is wrong.
    assert rec["failed_loads"] == ["b"]
    [load] = rec["loads"]
    assert load["failed"] is True and load["verified"] == 0 == load["mismatched"]
    assert rec["worker_stats"]["objects_refused"] == 1
    assert rec["state_mismatches"] == 0


def test_kv_computed_over_a_failed_load_is_never_stored(results: dict[str, Any]) -> None:
    rec = results["poison"]
    _check_invariants(rec, sorted([*EVICTING, "c", "g0", "g1", "g2", "g3"]))
    # b's load failed at its third chunk; the step that loaded it also computed b's sixth
    # chunk over the blocks that never arrived (the fake model's attention makes that KV
    # wrong). That store is withheld, b's recomputation stores the chunk again, and c,
    # asking b's prompt once every block of b left the device, loads all six chunks right.
    assert rec["loads"] == [
        {"req": "b", "first_token": 0, "blocks": 5, "async": False, "verified": 2,
         "mismatched": 0, "invalid": 3},
        {"req": "c", "first_token": 0, "blocks": 6, "async": False, "verified": 6,
         "mismatched": 0, "invalid": 0}]
    assert rec["worker_stats"]["stores_withheld"] == 1


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
    # Every request stored chunks, and none kept its blocks at finish: each store was
    # copied out at its step, and the tiers write from the copies.
    assert rec["saved_chunks"] > 0 and rec["kept_blocks"] == []
    for ld in loads:
        assert ld["verified"] == ld["blocks"] and ld["mismatched"] == 0 == ld["invalid"]


def test_dead_tier_never_stalls_vllm(results: dict[str, Any]) -> None:
    rec = results["dead"]
    # Every tier call fails: lookups are misses (nothing loaded), stores fail (logged), yet
    # every request finishes and the delayed frees are all released.
    _check_invariants(rec, EVICTING)
    assert rec["loads"] == []
    assert rec["saved_chunks"] == 35  # planned and attempted (b computed its prefix too)


@pytest.mark.parametrize("name", ["native", "native_mla"])
def test_vllm_and_native_manager_share_keys_both_ways(results: dict[str, Any],
                                                      name: str) -> None:
    # native_mla: the same on MLA's latent pages (MLAAttentionSpec, no separate V).
    rec = results[name]
    # vLLM stored a's 5 chunks for tenant acme (cache_salt "tenant=acme", as the native
    # manager salts acme's requests); the native manager finds and loads all of them.
    assert rec["vllm_stored_chunks"] == 5
    assert rec["native_load"] == {"external_tokens": 80, "loaded_tokens": 80, "equal": True}
    # Another tenant's namespace holds none of it.
    assert rec["other_tenant_load"] == {"external_tokens": 0, "loaded_tokens": 0,
                                        "equal": False}
    # The reverse: the native manager stored 96 tokens (one store job), vLLM loads 6 blocks
    # equal to them (the fake KV is the same function of token and position).
    assert rec["native_store"] == {"steps": 1, "stores": 1}
    assert rec["vllm_loads"] == [{"req": "c", "first_token": 0, "blocks": 6, "async": False,
                                  "verified": 6, "mismatched": 0, "invalid": 0}]
    assert rec["vllm_free_blocks"] == rec["num_blocks"] - 1


# ---------------------------------------------------------------- hybrid layouts
def _hybrid_load(rec: dict[str, Any], groups: dict[str, int]) -> None:
    """b's one load: async (several groups), every block and state of every group verified
    equal to what a computed."""
    n = sum(groups.values())
    assert rec["loads"] == [{"req": "b", "first_token": 0, "blocks": n, "async": True,
                             "verified": n, "mismatched": 0, "invalid": 0, "pieces": n,
                             "failed": False, "groups": groups}]
    assert rec["invalid_blocks"] == 0 and rec["failed_loads"] == []


def test_sliding_window_loads_only_the_window_before_the_hit(results: dict[str, Any]) -> None:
    rec = results["swa"]
    _check_invariants(rec, EVICTING)
    # The 80-token hit: 5 full-attention blocks, and of the 32-token window group only the
    # blocks of the window before token 80 (48..80: 2 blocks); vLLM left the others null.
    _hybrid_load(rec, {"0": 5, "1": 2})
    # Both groups stored every chunk while vLLM still held its blocks (the window group's
    # blocks are freed behind the window, after their store was planned).
    assert rec["saved_pieces"] == {"0": 30, "1": 30}


@pytest.mark.parametrize("name", ["swa_corrupt", "mamba_corrupt"])
def test_hybrid_load_failure_is_a_failed_receive_and_vllm_recomputes(
        results: dict[str, Any], name: str) -> None:
    rec = results[name]
    _check_invariants(rec, EVICTING)
    # With several groups vLLM 0.33 raises on block-level errors: the damaged object fails
    # the whole (async) load as a failed receive, nothing is copied, no block id reported.
    assert rec["invalid_blocks"] == 0
    assert rec["failed_loads"] == ["b"]
    [load] = rec["loads"]
    assert load["req"] == "b" and load["failed"] is True and load["async"] is True
    assert load["verified"] == 0 == load["mismatched"]
    # vLLM recomputed b from scratch (no second claim from the tiers) and stored it again,
    # the damaged chunk included.
    assert rec["saved_chunks"] > (30 if name == "swa_corrupt" else 35)
    assert rec["state_mismatches"] == 0


def test_mamba_hit_loads_chunks_and_the_boundary_state(results: dict[str, Any]) -> None:
    rec = results["mamba"]
    _check_invariants(rec, EVICTING)
    # b shares a's 144 prompt tokens; the prompt's last reusable boundary is 128, where a
    # boundary state was stored: 8 attention chunks and the one Mamba state at 128.
    _hybrid_load(rec, {"0": 8, "1": 1})
    # Every state b resumed from (the loaded one included) equals recomputation.
    assert rec["states_checked"] > 0 and rec["state_mismatches"] == 0
    assert rec["saved_pieces"]["1"] >= 6  # a: 64, 128; each filler: 64 and 96


def test_mamba_multiturn_reloads_history_with_its_state(results: dict[str, Any]) -> None:
    rec = results["mamba_multiturn"]
    _check_invariants(rec, sorted(f"c{c}t{t}" for c in range(4) for t in range(3)))
    loads = rec["loads"]
    assert loads and all(ld["req"][-2:] in ("t1", "t2") for ld in loads)
    for ld in loads:
        # Each load restores both groups: attention chunks and exactly one state.
        assert ld["groups"]["1"] == 1 and ld["groups"]["0"] >= 1
        assert ld["verified"] == ld["blocks"] and ld["mismatched"] == 0 == ld["invalid"]
        assert ld["async"] is True and ld["failed"] is False
    assert rec["state_mismatches"] == 0 and rec["states_checked"] > 0


def test_mamba_partial_tail_is_stored_and_resumed_from(results: dict[str, Any]) -> None:
    rec = results["mamba_tail"]
    # t was aborted at 96 tokens (inside its 64..128 Mamba block): vLLM handed over the
    # running state block at 96 as a partial tail; the connector took it and kept the
    # blocks until it was copied out (all blocks free afterwards).
    assert rec["tail_calls"] == [{"req": "t", "boundaries": [96], "kept": True}]
    first = rec["first"]
    assert first["kept_blocks"] == ["t"]
    assert first["finished"] == ["t"] and first["free_blocks"] == first["num_blocks"] - 1
    assert first["saved_pieces"] == {"0": 6, "1": 2}  # 6 chunks; states at 64 and 96
    # A fresh engine: u resumes at 96 from the tier: 6 chunks and the tail state.
    second = rec["second"]
    assert second["loads"] == [{"req": "u", "first_token": 0, "blocks": 7, "async": True,
                                "verified": 7, "mismatched": 0, "invalid": 0, "pieces": 7,
                                "failed": False, "groups": {"0": 6, "1": 1}}]
    assert second["state_mismatches"] == 0 and second["finished"] == ["u"]
    assert second["free_blocks"] == second["num_blocks"] - 1


def test_mamba_preemption_keeps_vllms_invariants(results: dict[str, Any]) -> None:
    rec = results["mamba_preempt"]
    # A 10-block pool: p1 is preempted (its blocks, Mamba ones included, freed while
    # offers may be pending: none of them is read); both finish, every block comes back,
    # every state a step resumed from equals recomputation.
    _check_invariants(rec, ["p0", "p1"])
    assert rec["preempted"] == ["p1"]
    assert rec["states_checked"] > 0 and rec["state_mismatches"] == 0
    for ld in rec["loads"]:
        assert ld["verified"] == ld["blocks"] and ld["mismatched"] == 0 == ld["invalid"]


@pytest.mark.parametrize("name", ["native_swa", "native_mamba"])
def test_hybrid_blocks_stored_through_vllm_are_native_hits(results: dict[str, Any],
                                                          name: str) -> None:
    rec = results[name]
    # Same model, layout and tenant: the native manager finds what vLLM stored for every
    # group and loads it, every group's bytes (the window's blocks, the state) equal.
    hit = 80 if name == "native_swa" else 128
    assert rec["native_load"] == {"external_tokens": hit, "loaded_tokens": hit, "equal": True}
    assert rec["other_tenant_load"] == {"external_tokens": 0, "loaded_tokens": 0,
                                        "equal": False}


@pytest.mark.parametrize("name", ["native_swa", "native_mamba"])
def test_hybrid_blocks_stored_natively_are_vllm_hits(results: dict[str, Any],
                                                    name: str) -> None:
    rec = results[name]
    # The native manager computed c's prefix step by step (Mamba: its core split the
    # prefill at 128 to write the state there) and stored what its core handed over; vLLM
    # (salt "tenant=acme") loads every group from the tier through the connector.
    if name == "native_swa":
        # 96 tokens: 6 full-attention blocks and the 32-token window before 96 (2 blocks).
        assert rec["native_store"] == {"steps": 1, "stores": 1}
        groups, hit = {"0": 6, "1": 2}, 96
    else:
        # 144 tokens: the deepest state the native core offered is at 128 (as vLLM's is):
        # 8 chunks and that state, which c's first step resumes from.
        assert rec["native_store"] == {"steps": 2, "stores": 2}
        groups, hit = {"0": 8, "1": 1}, 128
        assert rec["vllm_states_checked"] > 0
    n = sum(groups.values())
    assert rec["vllm_loads"] == [{"req": "c", "first_token": 0, "blocks": n, "async": True,
                                  "verified": n, "mismatched": 0, "invalid": 0, "pieces": n,
                                  "failed": False, "groups": groups}]
    assert rec["vllm_state_mismatches"] == 0 and rec["vllm_failed_loads"] == []
    # vLLM computed only what follows the hit (+ one decode step), and freed every block.
    prompt_len = 106 if name == "native_swa" else 154
    assert rec["vllm_finished"] == ["c"] and rec["vllm_computed"] == {"c": prompt_len - hit + 1}
    assert rec["vllm_free_blocks"] == rec["num_blocks"] - 1


# ---------------------------------------------------------------- divergent hybrid hits
def _diverge_common(run: dict[str, Any]) -> None:
    assert run["first_finished"] == ["a", "f"] and run["finished"] == ["b"]
    assert run["free_blocks"] == run["num_blocks"] - 1
    assert run["state_mismatches"] == 0 and run["states_checked"] > 0
    assert run["invalid_blocks"] == 0 and run["failed_loads"] == []
    for ld in run["loads"]:
        assert ld["verified"] == ld["blocks"] and ld["mismatched"] == 0 == ld["invalid"]


def test_divergent_hit_restores_the_lagging_state_from_the_tier(
        results: dict[str, Any]) -> None:
    rec = results["mamba_diverge"]
    on, off = rec["on"], rec["off"]
    _diverge_common(on)
    _diverge_common(off)
    # The filler evicted a's Mamba states and its last attention blocks: vLLM offers b
    # the 160-token attention hit, diverged (no Mamba state behind it on the device), and
    # asks the connector from 128 (its 64-token scheduling block).
    assert on["local"] == [{"tokens": 160, "diverged": True}]
    assert on["answers"] == [{"local": 128, "external": 64}]
    # The load: chunks 128..192 (4) and the state at 192, both groups verified; the
    # device's blocks before 128 are kept (the tier lost a's first 4 chunks anyway).
    assert on["loads"] == [{"req": "b", "first_token": 128, "blocks": 5, "async": True,
                            "verified": 5, "mismatched": 0, "invalid": 0, "pieces": 5,
                            "failed": False, "groups": {"0": 4, "1": 1}}]
    # Without the flag vLLM offers the reconciled hit (0): the tiers miss chunks 0..64,
    # nothing is claimed and b is computed whole.
    assert off["local"] == [] and off["answers"] == [{"local": 0, "external": 0}]
    assert off["loads"] == []
    assert on["b_computed"] == on["b_tokens"] - 192 - 1  # 40 prompt tokens + 1 decode
    assert off["b_computed"] == off["b_tokens"] - 1
    assert on["b_computed"] < off["b_computed"]


def test_divergent_hit_the_tiers_cannot_extend_falls_back_without_losing_the_claim(
        results: dict[str, Any]) -> None:
    rec = results["mamba_diverge_exact"]
    on, off = rec["on"], rec["off"]
    _diverge_common(on)
    _diverge_common(off)
    # b's attention hit (192) reaches the tiers' deepest state: nothing to load beyond it,
    # and vLLM would fall back to the reconciled hit (0) without asking again. The
    # connector answers None (look again), vLLM looks b up next step on the reconciled
    # hit (the flag off for that step: no divergent lookup) and the tiers serve 192.
    assert on["local"] == [{"tokens": 192, "diverged": True}]
    assert on["answers"] == [{"local": 192, "external": None}, {"local": 0, "external": 192}]
    assert off["answers"] == [{"local": 0, "external": 192}]
    groups = {"0": 12, "1": 1}
    assert on["loads"] == off["loads"] == [{
        "req": "b", "first_token": 0, "blocks": 13, "async": True, "verified": 13,
        "mismatched": 0, "invalid": 0, "pieces": 13, "failed": False, "groups": groups}]
    assert on["b_computed"] == off["b_computed"] == on["b_tokens"] - 192 - 1


def test_mamba_pool_smaller_than_one_request_stalls_vllm_alone_too(
        results: dict[str, Any]) -> None:
    rec = results["mamba_preempt_alone"]
    # 9 blocks (8 usable): a 64-token prompt generating 60 tokens needs 8 attention blocks
    # + 1 Mamba block. vLLM WITHOUT a connector preempts p0 when it needs its 8th
    # attention block (113 tokens) and can never re-admit it; p1 waits behind it (FCFS).
    # In 300 steps (a 10-block pool finishes both in ~125) nothing finishes.
    alone = rec["alone"]
    assert alone["finished"] == [] and alone["preempted"] == ["p0"]
    assert alone["status"] == {"p0": ["PREEMPTED", 0, 113],
                               "p1": ["WAITING", 0, 64]}
    assert alone["computed"] == {"p0": 112}
    # With the connector: the same stall (which request ran first may differ with the
    # store timing), nothing corrupted.
    conn = rec["connector"]
    assert conn["finished"] == [] and conn["state_mismatches"] == 0
    assert all(s[0] != "RUNNING" for s in conn["status"].values())


# ---------------------------------------------------------------- KV events
def test_tier_stores_reach_vllms_kv_event_publisher(results: dict[str, Any]) -> None:
    ev = results["events"]["events"]
    # Every stored chunk became one BlockStored (medium DISK: the disk tier) that vLLM's
    # scheduler published with its own GPU events; each names blocks vLLM computed.
    assert ev["tier_stored"] == results["events"]["saved_chunks"] == 30
    assert ev["media"] == ["DISK"] and ev["ownership"] == ["kvplugin"]
    assert ev["groups"] == {"0": 30} and ev["kinds"] == ["full_attention"]
    assert ev["tier_hashes_on_gpu"] and ev["tier_tokens_ok"]
    assert ev["distinct_hashes"] == 30 and ev["gpu_stored"] > 0
    # A disk tier of about ten objects evicts; every eviction became a BlockRemoved, and a
    # router fed vLLM's stream believes exactly the blocks the tier holds at the end.
    router = results["events_evict"]["router"]
    assert router["evicted"] > 0 and router["removed"] == router["evicted"]
    assert router["equal"] and 0 < router["held"] == router["believed"] < 30
    # Hybrid: chunks and states, each tagged with its group and kind.
    mev = results["mamba"]["events"]
    # One BlockStored per object and tier: a chunk stored twice (the second put found it
    # there) is told once.
    assert mev["groups"] == results["mamba"]["saved_objects"]
    assert mev["kinds"] == ["full_attention", "mamba"] and mev["tier_hashes_on_gpu"]


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None,
                    reason="vLLM is installed in this environment")
def test_worker_page_copies_are_exact_and_big_pages_use_the_payload_pool(
        results: dict[str, Any]) -> None:
    rec = results["pages"]
    # Every layout vLLM allocates (and kernel-block splitting where vLLM allows it): one
    # gather per group (the layers form one strided run), exact page bytes out, and the
    # bytes loaded into the next layout's tensors give the same logical KV.
    cases = ["LBHNC", "LBHNC/split", "LBNHC", "LBNHC/split", "LHBNC", "BLHNC", "BLNHC",
             "BHLNC"]
    # 3 pages of 1.5 KiB (small) and of 192 KiB (big): only the big ones go to pool slots.
    assert rec["small"] == {c: {"runs": 1, "sealed": False, "out_equal": True,
                                "in_equal": True, "many_equal": True} for c in cases}
    assert rec["big"] == {c: {"runs": 1, "sealed": True, "out_equal": True,
                              "in_equal": True, "many_equal": True} for c in cases}
    # A Mamba group overlaid with full attention (block-compact layouts), padded pages.
    assert rec["state"] == {lay: {"sealed": True, "nbytes": 3 * 2 * 40_000, "in_equal": True,
                                  "many_equal": True}
                            for lay in ("BLHNC", "BLNHC")}


@pytest.mark.parametrize("run", MATRIX_RUNS)
def test_every_kv_cache_layout_gives_the_same_run(results: dict[str, Any], run: str) -> None:
    """The scenario on another physical layout loads, verifies, stores and frees exactly as
    on LBHNC: the connector reads the layout from the tensors vLLM registered."""
    name = run.split("@")[0]

    def canon(rec: dict[str, Any]) -> dict[str, Any]:
        # Async loads complete in wall-clock order: the step count and the order of the
        # loads may differ between runs, never what was loaded, verified or computed.
        out = {k: v for k, v in rec.items() if k not in ("scenario", "steps")}
        for k in ("loads", "vllm_loads"):
            if k in out:
                out[k] = sorted(out[k], key=lambda d: json.dumps(d, sort_keys=True))
        return out

    assert canon(results[run]) == canon(results[name])


def test_mla_latent_pages_load_verified_and_a_corrupt_one_recomputes(
        results: dict[str, Any]) -> None:
    # MLA (one latent per token and layer, no V) on vLLM's MLAAttentionSpec tensors
    # ([B, 1, N, head_size]): b's 80-token prefix comes back from disk, every block equal
    # to the latent a computed; a damaged third object is an error from block 3 on.
    rec = results["mla"]
    _check_invariants(rec, EVICTING)
    assert rec["loads"] == [{"req": "b", "first_token": 0, "blocks": 5, "async": False,
                             "verified": 5, "mismatched": 0, "invalid": 0}]
    assert rec["saved_chunks"] == 30
    bad = results["mla_corrupt"]
    _check_invariants(bad, EVICTING)
    assert bad["loads"] == [{"req": "b", "first_token": 0, "blocks": 5, "async": False,
                             "verified": 2, "mismatched": 0, "invalid": 3}]


def test_chunked_local_loads_only_the_hits_own_attention_chunk(
        results: dict[str, Any]) -> None:
    # Full attention + chunked local attention (32-token chunks, Llama 4 style): b's hit at
    # 80 loads 5 full-attention blocks and only the local block of [64, 80); vLLM left the
    # earlier local blocks null. A damaged object fails the whole request (a window-like
    # group cannot resume from a bad block): vLLM recomputes b and stores it again.
    rec = results["local"]
    _check_invariants(rec, EVICTING)
    assert rec["loads"] == [{"req": "b", "first_token": 0, "blocks": 6, "async": True,
                             "verified": 6, "mismatched": 0, "invalid": 0, "pieces": 6,
                             "failed": False, "groups": {"0": 5, "1": 1}}]
    assert rec["saved_pieces"] == {"0": 30, "1": 30} and rec["computed"]["b"] == 22
    bad = results["local_corrupt"]
    _check_invariants(bad, EVICTING)
    assert bad["failed_loads"] == ["b"] and bad["loads"][0]["failed"] is True
    assert bad["computed"]["b"] == 102  # all of b's 100 prompt tokens, then 2 decodes
    native = results["native_local"]
    assert native["native_load"] == {"external_tokens": 80, "loaded_tokens": 80,
                                     "equal": True}
    assert native["other_tenant_load"] == {"external_tokens": 0, "loaded_tokens": 0,
                                           "equal": False}
    # c's hit at 96 is a local chunk boundary: no local block to load, 6 full ones.
    assert native["vllm_loads"] == [{"req": "c", "first_token": 0, "blocks": 6,
                                     "async": True, "verified": 6, "mismatched": 0,
                                     "invalid": 0}]


def test_what_cannot_be_served_fails_at_start_with_one_line(results: dict[str, Any]) -> None:
    rec = results["refusals"]
    kinds = ("KVPluginConnector serves full-attention, MLA, sliding-window, chunked local "
             "and Mamba 'align' groups")
    assert rec["chunked_local"] is None  # served: tests below
    assert rec["mamba_none"] == f"{kinds}; group 1 is MambaSpec (mamba_cache_mode='none')"
    assert rec["mla"] is None  # served: tests below
    assert rec["mla_packed"].startswith("KVPluginConnector: group 0: MLAAttentionSpec with "
                                        "head_size 4, head_size_v 0")
    assert "'cache_dtype_str': 'fp8_ds_mla'" in rec["mla_packed"]
    assert rec["head_size_v"].startswith(
        "KVPluginConnector: group 0: FullAttentionSpec with head_size 4, head_size_v 8")
    assert rec["registered"] is None  # vLLM's [B, H, N, C] views map
    assert rec["missing_layer"] == ("KVPluginConnector: vLLM registered no KV tensor for "
                                    "layers ['layer1']")
    # The [2, blocks, slots, heads, dim] tensors the connector once expected.
    assert rec["old_layout"] == ("KVPluginConnector: layer layer0: KV tensor (2, 24, 16, 2, "
                                 "4) is not vLLM's [blocks, heads, slots, channels] view")
    assert rec["wrong_heads"] == ("KVPluginConnector: layer layer0: KV tensor (24, 3, 16, 8) "
                                  "torch.float32 is not [blocks * r, 2, 16 / r, 2 * 4] "
                                  "torch.float32")
    assert "torch.float16 is not" in rec["wrong_dtype"]
    assert all("\n" not in v for v in rec.values() if isinstance(v, str))


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
