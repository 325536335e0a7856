"""The engine-independent half of the vLLM secondary tier (``kvplugin.integrations._tier``)
on real kvplugin tiers (memory, disk; a fault drill), without vLLM: a numpy buffer as the
primary, jobs submitted and polled as vLLM's manager does. vLLM's own classes drive the
same core in test_vllm_tier.py."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvplugin.connectors.keys import Namespace
from kvplugin.integrations._keyed import tenant_of_params
from kvplugin.integrations._tier import ChunkLayout, JobOutcome, TierCore

ROW = 4096
LAYOUT = ChunkLayout(model="test/model", dtype="float16", chunk_bytes=ROW, blocks_per_chunk=1,
                     tokens_per_hash=16, group_tokens=(16,), group_layers=(("l0", "l1"),),
                     windowed=(False,))


def okey(n: int, group: int = 0) -> bytes:
    return n.to_bytes(8, "big") + group.to_bytes(4, "big")


def _config(tmp: Path, **offload: Any) -> str:
    path = tmp / "tier.json"
    faults = offload.pop("faults", None)
    body: dict[str, Any] = {"model": {"name": "kvplugin/tier-test"},
                            "offload": {"local_cpu": False, "local_disk": None, **offload}}
    if faults:
        body["faults"] = faults
    path.write_text(json.dumps(body))
    return str(path)


def _wait(core: TierCore, n: int) -> list[JobOutcome]:
    out: list[JobOutcome] = []
    deadline = time.monotonic() + 10
    while len(out) < n and time.monotonic() < deadline:
        out += core.finished()
        time.sleep(0.002)
    return out


@pytest.fixture
def primary() -> np.ndarray[Any, Any]:
    return np.zeros((8, ROW // 4), np.float32)


def test_tenant_of_params() -> None:
    assert tenant_of_params({"tenant": "a", "cache_salt": "x"}, "d") == "a"
    assert tenant_of_params({"cache_salt": "tenant=b;salt=s"}, "d") == "b"
    assert tenant_of_params({"cache_salt": "plain"}, "d") == "plain"
    assert tenant_of_params(None, "d") == tenant_of_params({}, "d") == "d"


def test_fingerprints_differ_by_what_makes_the_bytes_readable() -> None:
    base = LAYOUT.fingerprint(0)
    for change in ({"dtype": "bfloat16"}, {"chunk_bytes": 2 * ROW}, {"model": "other"},
                   {"group_layers": (("l0",),)}, {"parallel": (2, 1, 1, 1)},
                   {"kv_cache_layout": "HND"}, {"canonical": True}):
        other = ChunkLayout(**{**{f: getattr(LAYOUT, f) for f in LAYOUT.__slots__},
                               **change})
        assert other.fingerprint(0) != base, change


def test_store_then_load_is_byte_exact_and_keys_are_kvplugin_keys(
        tmp_path: Path, primary: np.ndarray[Any, Any]) -> None:
    core = TierCore(_config(tmp_path, local_cpu=True, max_local_cpu_size=0.01,
                            local_disk=f"file://{tmp_path}/disk"), LAYOUT, primary)
    try:
        rng = np.random.default_rng(1)
        primary[:3] = rng.random((3, ROW // 4), dtype=np.float32)
        want = primary[:3].copy()
        core.open_request("r", None)
        core.submit_store(1, "r", None, [okey(i) for i in range(3)], [0, 1, 2], [16, 32, 48])
        (st,) = _wait(core, 1)
        assert (st.success, st.nbytes, st.stored) == (True, 3 * ROW, (3, 3))
        assert core.lookup("r", None, [(okey(i), 16 * (i + 1)) for i in range(4)]) == [
            True, True, True, False]
        primary[:] = 0
        core.submit_load(2, "r", None, [okey(2), okey(0)], [5, 6])
        (ld,) = _wait(core, 1)
        assert (ld.success, ld.loaded, ld.nbytes) == (True, (okey(2), okey(0)), 2 * ROW)
        assert np.array_equal(primary[5], want[2]) and np.array_equal(primary[6], want[0])
        ns = Namespace("default", "kvplugin/tier-test", LAYOUT.fingerprint(0), 0)
        assert core.object_key("default", okey(1)).id == ns.key((1).to_bytes(8, "big")).id
        assert not core.pending()
    finally:
        core.close()


def test_a_store_every_tier_refuses_fails_its_job_and_frees_the_budget(
        tmp_path: Path, primary: np.ndarray[Any, Any]) -> None:
    """A fault drill where every write errors: the job fails (vLLM's detector counts it),
    the plan completes, nothing stays in flight."""
    core = TierCore(_config(tmp_path, local_cpu=True, max_local_cpu_size=0.01,
                            faults={"rate": 1.0, "kinds": ["error"], "seed": 3}),
                    LAYOUT, primary)
    try:
        core.submit_store(1, "r", None, [okey(0)], [0], [16])
        (st,) = _wait(core, 1)
        assert (st.success, st.nbytes) == (False, 0)
        assert core.ledger.bytes_in_flight == 0
        assert core.ledger.tenant("default").stores_failed == 1
    finally:
        core.close()


def test_a_job_with_mismatched_slots_raises_before_anything_changes(
        tmp_path: Path, primary: np.ndarray[Any, Any]) -> None:
    core = TierCore(_config(tmp_path, local_cpu=True), LAYOUT, primary)
    try:
        with pytest.raises(ValueError, match="2 keys, 1 slots"):
            core.submit_store(1, "r", None, [okey(0), okey(1)], [0], [16, 32])
        with pytest.raises(ValueError, match="1 keys, 2 slots"):
            core.submit_load(2, "r", None, [okey(0)], [0, 1])
        assert not core.pending() and core.ledger.bytes_in_flight == 0
    finally:
        core.close()


def test_a_primary_view_of_another_row_size_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not the chunk size 4096"):
        TierCore(_config(tmp_path, local_cpu=True), LAYOUT, np.zeros((4, 512), np.float32))


def test_every_secondary_tier_figure_is_defined_once_in_the_metrics_doc() -> None:
    from kvplugin.integrations.vllm_tier import METRICS

    doc = (Path(__file__).resolve().parents[2] / "docs" / "metrics.md").read_text()
    for name, (kind, labels, _) in METRICS.items():
        rows = [r for r in doc.splitlines()
                if r.startswith(f"| `vllm:kvplugin_secondary_{name}` |")]
        assert len(rows) == 1, name
        assert rows[0].split("|")[2].strip() == kind, name
        assert rows[0].split("|")[3].strip() == ", ".join(labels), name


def test_the_tier_module_imports_without_vllm_and_building_it_names_the_extra() -> None:
    import importlib.util

    if importlib.util.find_spec("vllm") is not None:
        pytest.skip("vLLM is installed here")
    from kvplugin.integrations.vllm_tier import KVPluginSecondaryTier

    with pytest.raises(ImportError, match="vllm"):
        KVPluginSecondaryTier(None, memoryview(b""), "t", config_file="x.yaml")


def test_a_store_over_the_budget_fails_its_job_and_a_quota_shed_does_not(
        tmp_path: Path, primary: np.ndarray[Any, Any]) -> None:
    """Over offload.store_budget_mb the tier is falling behind: the job fails (vLLM's
    backpressure detector counts it). Over a tenant's quota it is a decision: the job
    succeeds with no bytes. Both are counted by reason."""
    path = _config(tmp_path, local_cpu=True, max_local_cpu_size=0.01,
                   store_budget_mb=1.5 * ROW / 2**20)
    body = json.loads(Path(path).read_text())
    body["tenants"] = {"declared": {"q": {"max_tier_bytes": {"memory": ROW}}, "r": {}}}
    Path(path).write_text(json.dumps(body))
    core = TierCore(path, LAYOUT, primary)
    try:
        core.submit_store(1, "r1", {"tenant": "r"}, [okey(0), okey(1)], [0, 1], [16, 32])
        (over_budget,) = _wait(core, 1)
        assert (over_budget.success, over_budget.nbytes) == (False, ROW)  # one of two fit
        core.submit_store(2, "q1", {"tenant": "q"}, [okey(5)], [2], [16])
        (first,) = _wait(core, 1)
        core.submit_store(3, "q1", {"tenant": "q"}, [okey(6)], [3], [32])
        (quota,) = _wait(core, 1)
        assert (first.success, first.nbytes) == (True, ROW)
        assert (quota.success, quota.nbytes) == (True, 0)
        counters, gauges = core.figures()
        assert counters[("stores_shed", ("r", "budget"))] == 1
        assert counters[("stores_shed", ("q", "quota"))] == 1
        assert gauges == {("held_bytes", ("q", "memory")): ROW}
    finally:
        core.close()
