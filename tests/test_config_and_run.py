"""Config validation, the scheduler simulation, and the ``kvplugin run`` main job."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from redis_fixture import local_redis

from kvplugin.config import ConfigError, apply_env_overrides, load_config, validate
from kvplugin.engine.config import RunConfig
from kvplugin.engine.report import decided
from kvplugin.engine.run import run_engine
from kvplugin.layouts import engine_supports
from kvplugin.replay import run_trace
from kvplugin.sim import Limits, Simulation, Workload

REPO = Path(__file__).resolve().parent.parent
__all__ = ["local_redis"]  # the fixture, imported for pytest


def test_embedded_default_loads() -> None:
    cfg = load_config(env={}, schema=RunConfig)
    assert cfg.layout.num_blocks == 160
    assert [g.kind for g in cfg.layout.groups] == ["full"]
    assert cfg.layout.as_trace_config()["groups"] == [{"kind": "full"}]
    # Offload on by default: host memory and a temporary disk directory, no Redis.
    off = cfg.offload
    assert off.local_cpu and off.local_disk == "temp://" and off.remote_url is None
    assert off.disk_path is None and off.chunk_size % cfg.layout.block_size == 0
    assert cfg.engine.prefill_token_ms > 0 and cfg.model.dtype == "float16"


# Shipped layouts the offload manager refuses (they run the core-only simulation), with
# what its reason names; every other shipped config runs on the engine. (None today:
# chunked local attention and MLA are offloaded too.)
CORE_ONLY: dict[str, str] = {}


@pytest.mark.parametrize("path", sorted((REPO / "configs").iterdir()), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path: Path, request: pytest.FixtureRequest,
                                   tmp_path: Path) -> None:
    cfg = load_config(path, env={}, schema=RunConfig)
    if cfg.offload.remote_url is not None:  # never the file's server: the test's own
        server = request.getfixturevalue("local_redis")
        cfg = cfg.model_copy(update={"offload": cfg.offload.model_copy(
            update={"remote_url": server.url})})
    persistent = cfg.offload.disk_path is not None

    def fresh(run: str) -> RunConfig:  # never the machine's directory: a fresh one per run
        if not persistent:
            return cfg
        return cfg.model_copy(update={"offload": cfg.offload.model_copy(
            update={"local_disk": str(tmp_path / run)})})
    # Every shipped layout must build a core manager.
    Simulation(cfg.layout.as_trace_config(), Workload(num_requests=1), Limits())
    reason = engine_supports(cfg.layout, cfg.model)
    if path.name in CORE_ONLY:
        assert reason is not None and CORE_ONLY[path.name] in reason
        return
    assert reason is None
    # And it serves a few requests on the engine, offload on, every hit checked.
    small = cfg.workload.model_copy(update={"num_requests": 6})
    report = run_engine(fresh("first").model_copy(update={"workload": small}))
    assert report.ok() and report.finished == 6 and report.failed == 0
    if cfg.offload.remote_url is None:  # Redis keeps the first run's objects: another state
        again = run_engine(fresh("again").model_copy(update={"workload": small}))
        assert decided(again.as_dict()) == decided(report.as_dict())  # the same seed
    assert report.ledger_errors() == []
    assert report.prompt_tokens == report.extra["workload_prompt_tokens"]
    assert report.extra["tiers"] and report.extra["pages_checked"] > 0
    if any(g.kind == "mamba" for g in cfg.layout.groups):
        assert report.extra["states_checked"] > 0


def test_unknown_key_is_rejected_with_file_and_path(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("layout:\n  num_blocks: 64\n  groups:\n    - kind: full\n      windw: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(f, env={})
    msg = str(e.value)
    assert str(f) in msg
    assert "layout.groups.0.windw" in msg
    assert "Extra inputs are not permitted" in msg


@pytest.mark.parametrize(("doc", "where"), [
    ({"layout": {"num_blocks": 1}}, "layout.num_blocks"),
    ({"layout": {"groups": [{"kind": "sliding_window"}]}}, "needs sliding_window"),
    ({"layout": {"groups": [{"kind": "full", "sliding_window": 8}]}}, "does not apply"),
    ({"layout": {"groups": []}}, "layout.groups"),
    ({"workload": {"output_len": [5, 2]}}, "output_len"),
    ({"limits": {"max_num_seqs": 0}}, "limits.max_num_seqs"),
    ({"tenants": {"declared": {"a b": {}}}}, "tenants.declared.a b"),
    ({"tenants": {"prefix_groups": [{"name": "g", "tenants": []}]}}, "tenants.prefix_groups.0"),
    ({"offload": {"max_local_cpu_size": 0}}, "offload.max_local_cpu_size"),
    ({"offload": {"local_cpu": False, "local_disk": None}}, "no tier"),
    ({"offload": {"remote_url": "http://x"}}, "redis://"),
    ({"offload": {"store_mode": "later"}}, "offload.store_mode"),
    ({"offload": {"chunk_size": 24}}, "not a multiple of layout.block_size"),
    ({"offload": {"max_local_cpu_szie": 1}}, "offload.max_local_cpu_szie"),
    ({"engine": {"decode_step_ms": -1}}, "engine.decode_step_ms"),
    ({"model": {"dtype": "float64"}}, "model.dtype"),
    ({"workload": {"think_time_ms": [5, 1]}}, "think_time_ms"),
])
def test_invalid_values_name_the_problem(doc: dict, where: str) -> None:
    with pytest.raises(ConfigError, match=r"(?s)invalid configuration.*") as e:
        validate(doc, "t.yaml", schema=RunConfig)
    assert where in str(e.value)


def test_parse_errors_and_toml(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="cannot parse"):
        load_config(bad, env={})
    with pytest.raises(ConfigError, match="cannot read"):
        load_config(tmp_path / "missing.yaml", env={})
    top = tmp_path / "list.yaml"
    top.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="mapping"):
        load_config(top, env={})


def test_env_overrides() -> None:
    data = apply_env_overrides({"layout": {"num_blocks": 64}},
                               {"KVPLUGIN_LAYOUT__NUM_BLOCKS": "99",
                                "KVPLUGIN_LIMITS__FULL_SEQUENCE_MUST_FIT": "false",
                                "UNRELATED": "1"})
    cfg = validate(data)
    assert cfg.layout.num_blocks == 99
    assert cfg.limits.full_sequence_must_fit is False
    with pytest.raises(ConfigError, match=r"layout\.bogus"):
        validate(apply_env_overrides({}, {"KVPLUGIN_LAYOUT__BOGUS": "1"}))
    off = validate(apply_env_overrides({}, {"KVPLUGIN_OFFLOAD__MAX_LOCAL_CPU_SIZE": "0.5",
                                            "KVPLUGIN_OFFLOAD__LOCAL_DISK": "file:///tmp/kv",
                                            "KVPLUGIN_ENGINE__MAX_NUM_SEQS": "4"}))
    assert off.offload.max_local_cpu_size == 0.5 and off.offload.disk_path == "/tmp/kv"
    assert off.engine.max_num_seqs == 4


def test_simulation_is_deterministic_and_replays_identically() -> None:
    layout = {"block_size": 8, "num_blocks": 40,
              "groups": [{"kind": "full"}, {"kind": "sliding_window", "sliding_window": 20}]}
    w = Workload(num_requests=12, seed=5, system_prompt_len=(8, 60), user_len=(1, 30),
                 output_len=(1, 12))
    a = Simulation(layout, w, Limits(max_num_batched_tokens=48, max_num_seqs=4)).run()
    b = Simulation(layout, w, Limits(max_num_batched_tokens=48, max_num_seqs=4)).run()
    assert a.trace == b.trace
    assert a.requests == 12 and a.hit_tokens > 0
    # The tight pool refuses allocations (admission waits), and still ends leak-free.
    assert a.failed_allocations > 0
    assert a.final_free_blocks == a.total_blocks
    # The recorded calls replay to the same decisions (the trace is self-consistent).
    result = run_trace(json.loads(json.dumps(a.trace)))
    assert result["summary"]["num_errors"] == 0
    assert result["summary"]["final_num_free_blocks"] == a.total_blocks


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvplugin.cli", "run", *args],
                          capture_output=True, text=True, timeout=120)


def test_kvplugin_run_default_and_bad_config(tmp_path: Path) -> None:
    proc = _run("--requests", "24")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "embedded default config on the async engine, offload to memory + disk" in out
    assert "requests      : 24/24 finished" in out and "leaked blocks : 0" in out
    assert ", 0 mismatches, 0 cross-tenant" in out
    out = _run("--core-only", "--requests", "8").stdout
    assert "embedded default config on the allocation core" in out
    assert "prefix hits" in out and "free blocks  : 159 of 159" in out
    bad = tmp_path / "c.yaml"
    bad.write_text("layout: {num_blocks: 0}\n")
    proc = _run("--config", str(bad))
    assert proc.returncode == 2
    assert "layout.num_blocks" in proc.stderr


def test_hybrid_layouts_run_on_the_engine() -> None:
    proc = _run("--config", str(REPO / "configs" / "hybrid_swa.yaml"), "--requests", "8",
                "--json")
    assert proc.returncode == 0, proc.stderr
    assert "core-only" not in proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["finished"] == 8 and out["kv_mismatches"] == 0 and out["leaked_blocks"] == 0
    assert set(out["hit_tokens"]) == {"device", "memory", "disk"}


@pytest.mark.parametrize("name", ["llama4_chunked.toml", "mla.yaml"])
def test_chunked_local_and_mla_layouts_run_offloaded(name: str) -> None:
    proc = _run("--config", str(REPO / "configs" / name), "--requests", "40", "--json")
    assert proc.returncode == 0, proc.stderr
    assert "core-only" not in proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["finished"] == 40 and out["kv_mismatches"] == 0 and out["leaked_blocks"] == 0
    assert out["cross_tenant_hits"] == 0
    assert set(out["hit_tokens"]) == {"device", "memory", "disk"}
    # Evicted prefixes came back from the tiers, every loaded page checked (a load whose
    # object the small tiers evicted after the lookup is a counted failure, recomputed).
    assert out["loads"] > 0 and out["hit_tokens"]["disk"] + out["hit_tokens"]["memory"] > 0


def test_layouts_the_manager_rejects_run_on_the_core(tmp_path: Path) -> None:
    cfg = tmp_path / "no_caching.yaml"  # no prefix caching: nothing to offload
    cfg.write_text("layout:\n  enable_caching: false\n")
    proc = _run("--config", str(cfg), "--requests", "6")
    assert proc.returncode == 0, proc.stderr
    assert "offload needs prefix caching" in proc.stderr
    assert "running the core-only simulation" in proc.stderr
    assert "on the allocation core" in proc.stdout
    trace = tmp_path / "t.json"
    proc = _run("--requests", "6", "--save-trace", str(trace))
    assert proc.returncode == 0 and run_trace(json.loads(trace.read_text()))["summary"][
        "num_errors"] == 0


def test_quickstart_example_runs() -> None:
    out = subprocess.run([sys.executable, str(REPO / "examples" / "quickstart.py")],
                         capture_output=True, text=True, check=True).stdout.splitlines()
    assert out[0] == "a: hit 0 tokens, blocks ([1, 2, 3, 4, 5],)"
    # b shares a's 64-token system prompt: 4 cached blocks, only its tail is new.
    assert out[1] == "b: hit 64 tokens, blocks ([1, 2, 3, 4, 6],)"
    assert out[3] == "prefix cache: 64 hit tokens of 136 queried; 1 KV events"
