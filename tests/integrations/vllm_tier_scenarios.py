"""kvplugin's tiers as a secondary tier of vLLM 0.33's own offloading, driven by vLLM's real
classes: ``SecondaryTierFactory`` builds the tier from a config entry, and (where a scenario
says ``manager``) vLLM's ``TieringOffloadingSpec`` builds its real ``TieringOffloadingManager``
with a CPU primary tier over a shared-memory region, which cascades stores to the tier and
promotes its hits. The primary buffer is a CPU tensor's memoryview, as vLLM's own tier tests
use. Run under the vLLM side virtualenv: ``python vllm_tier_scenarios.py NAME...``; each
scenario prints one JSON record. ``KVPLUGIN_TIER_WORKDIR`` is where a scenario pair that
spans two processes (``store_fresh`` / ``load_fresh``) keeps its tiers;
``KVPLUGIN_TIER_REDIS`` a Redis or Redis Cluster URL (a server the test started).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import scenario_testlib
import torch
from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadingKVEventsConfig,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.base import TransferJob
from vllm.v1.kv_offload.tiering.factory import SecondaryTierFactory
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

REPO = Path(__file__).resolve().parents[2]
ROW_ELEMS = 1024  # float32: 4 KiB rows (a primary chunk of the direct tier scenarios)
ROW = ROW_ELEMS * 4
ENTRY = {"type": "KVPluginSecondaryTier", "module_path": "kvplugin.integrations.vllm_tier"}
PREFIX = "vllm:kvplugin_secondary_"
END = ScheduleEndContext(new_req_ids=(), preempted_req_ids=())


def offloading_config(extra: dict[str, Any] | None = None, *, events: bool = False,
                      engine_id: str = "kvplugin-tier-test",
                      window: int | None = None) -> OffloadingConfig:
    """One full-attention group of two layers (``window``: a second group, sliding window
    of that many chunks)."""
    groups = [OffloadingGroupConfig(tokens_per_block=16, layer_names=("l0", "l1"),
                                    group_id=0)]
    if window is not None:
        groups.append(OffloadingGroupConfig(tokens_per_block=16, layer_names=("w0",),
                                            group_id=1, sliding_window_size_in_chunks=window))
    return OffloadingConfig(
        groups=tuple(groups),
        worker_kv_bytes_per_block=ROW, enable_kv_cache_events=events,
        extra_config=extra or {}, engine_id=engine_id,
        model=OffloadingModelConfig(name="test/model", dtype="float16"),
        cache=OffloadingCacheConfig(tokens_per_hash=16, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(
            rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
            data_parallel_index=0, data_parallel_size=1, data_parallel_rank_local=None,
            is_parallelism_agnostic=False))


def spec_stub(events: bool = False, window: int | None = None) -> SimpleNamespace:
    """What vLLM's tier tests hand a tier: its config and the global KV events flag."""
    return SimpleNamespace(config=offloading_config(events=events, window=window),
                           kv_events_config=OffloadingKVEventsConfig(events, False))


def write_config(root: str, name: str, offload: dict[str, Any],
                 tenants: dict[str, Any] | None = None,
                 faults: dict[str, Any] | None = None) -> str:
    return scenario_testlib.write_config(root, name, offload, model="kvplugin/tier-test",
                                         tenants=tenants, faults=faults)


def direct_tier(config_file: str, rows: int = 8, events: bool = False,
                window: int | None = None, **entry: Any) -> tuple[Any, torch.Tensor]:
    """The tier as vLLM's factory builds it, over a CPU tensor as the primary buffer."""
    primary = torch.zeros((rows, ROW_ELEMS), dtype=torch.float32)
    tier = SecondaryTierFactory.create_secondary_tier(
        {**ENTRY, "config_file": config_file, **entry}, memoryview(primary.numpy()),
        spec_stub(events, window))
    return tier, primary


def key(n: int, group: int = 0) -> bytes:
    return make_offload_key(n.to_bytes(8, "big"), group)


def ctx_of(req_id: str, keys: list[bytes], params: dict[str, Any] | None = None
           ) -> ReqContext:
    ctx = ReqContext(req_id=req_id, kv_transfer_params=params)
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    return ctx


def job(job_id: int, keys: list[bytes], slots: list[int], ctx: ReqContext,
        promotion: bool = False) -> TransferJob:
    return TransferJob(job_id, keys, np.array(slots, dtype=np.int32), promotion, ctx)


def settle(tier: Any, n: int, timeout: float = 10.0) -> list[Any]:
    """Poll get_finished_jobs until n jobs ended."""
    out: list[Any] = []
    deadline = time.monotonic() + timeout
    while len(out) < n and time.monotonic() < deadline:
        out.extend(tier.get_finished_jobs())
        time.sleep(0.005)
    return out


def resolve(tier: Any, keys: list[bytes], ctx: ReqContext, timeout: float = 10.0
            ) -> tuple[list[str], float]:
    """Lookups as vLLM's scheduler runs them, one round per step: the first answers RETRY
    (asked of the lookup thread at the step's end); then until none is RETRY. Returns the
    answers and how long they took from the first step's end."""
    first = [tier.lookup(k, ctx) for k in keys]
    assert all(r is LookupResult.RETRY for r in first), first
    tier.on_schedule_end(END)
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        time.sleep(0.002)
        got = [tier.lookup(k, ctx) for k in keys]
        tier.on_schedule_end(END)
        if LookupResult.RETRY not in got:
            return [r.name for r in got], time.monotonic() - t0
    raise AssertionError("lookups never resolved")


def fill(primary: torch.Tensor, slots: list[int], seed: int) -> list[list[float]]:
    gen = torch.Generator().manual_seed(seed)
    for s in slots:
        primary[s] = torch.rand(ROW_ELEMS, generator=gen)
    return [primary[s].tolist() for s in slots]


def result(r: Any) -> dict[str, Any]:
    keys = r.successful_keys
    return {"job": r.job_id, "success": r.success, "bytes": r.transfer_bytes,
            "ok_keys": None if keys is None else sorted(k.hex() for k in keys)}


def stat(tier: Any) -> dict[str, Any]:
    s = tier.get_stats()
    return {} if s is None else ours(s.data["data"])


def ours(data: dict[str, Any]) -> dict[str, Any]:
    """kvplugin's series of a stats payload, by short name and joined label values."""
    return {name.removeprefix(PREFIX): {"|".join(lv): v for lv, v in vals.items()}
            for name, vals in data.items() if name.startswith(PREFIX)}


# --------------------------------------------------------------------------- scenarios
def docs_factory(root: str) -> dict[str, Any]:
    """docs/vllm.md's --kv-transfer-config, verbatim, into vLLM's TieringOffloadingSpec:
    its real manager builds our tier through the factory."""
    text = (REPO / "docs" / "vllm.md").read_text()
    block = text.split("<!-- secondary-tier-config -->", 1)[1]
    ktc = json.loads(re.search(r"--kv-transfer-config '([^']+)'", block).group(1))
    spec = TieringOffloadingSpec(offloading_config(ktc["kv_connector_extra_config"],
                                                   engine_id="kvplugin-docs"))
    manager = spec.get_manager()
    try:
        (tier,) = manager.secondary_tiers
        return {"kv_connector": ktc["kv_connector"], "spec": ktc["kv_connector_extra_config"][
                "spec_name"], "class": type(tier).__name__, "tier_type": tier.tier_type,
                "tiers": list(tier.core.tiers), "medium": tier.medium.name,
                "locality": tier.locality.name, "row": tier.block_size_bytes,
                "chunks": spec.num_chunks}
    finally:
        manager.shutdown()


def roundtrip(root: str) -> dict[str, Any]:
    cfg = write_config(root, "rt", {"local_cpu": True, "max_local_cpu_size": 0.01,
                                    "local_disk": f"file://{root}/disk"})
    tier, primary = direct_tier(cfg)
    try:
        keys = [key(i) for i in range(4)]
        ctx = ctx_of("r", keys)
        tier.on_new_request(ctx)
        want = fill(primary, [0, 1, 2, 3], seed=1)
        tier.submit_store(job(1, keys, [0, 1, 2, 3], ctx))
        stored = [result(r) for r in settle(tier, 1)]
        looked, _ = resolve(tier, [*keys, key(9)], ctx)
        primary.zero_()
        tier.submit_load(job(2, keys, [7, 6, 5, 4], ctx, promotion=True))
        loaded = [result(r) for r in settle(tier, 1)]
        got = [primary[s].tolist() for s in (7, 6, 5, 4)]
        tier.on_request_finished(ctx)
        return {"stored": stored, "loaded": loaded, "lookups": looked,
                "exact": got == want, "pending": tier.has_pending_work(), "stats": stat(tier)}
    finally:
        tier.shutdown()


def _manager(config_file: str, engine_id: str, **entry: Any) -> tuple[Any, Any]:
    extra = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 64 * ROW,
             "secondary_tiers": [{**ENTRY, "config_file": config_file, **entry}]}
    spec = TieringOffloadingSpec(offloading_config(extra, engine_id=engine_id))
    return spec, spec.get_manager()


def step_until_idle(m: Any, timeout: float = 10.0) -> None:
    """Idle scheduler steps (vLLM polls its tiers at each step's end) until the tier has
    no job left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with m.lock:
            m.on_schedule_end(END)
            if not m.secondary_tiers[0].has_pending_work():
                return
        time.sleep(0.01)


def _fresh_config(kind: str) -> str:
    root = os.environ["KVPLUGIN_TIER_WORKDIR"]
    offload = ({"local_disk": f"file://{root}/disk"} if kind == "disk"
               else {"remote_url": os.environ["KVPLUGIN_TIER_REDIS"]})
    return write_config(root, kind, offload)


def store_fresh(root: str, kind: str) -> dict[str, Any]:
    """A process's vLLM manager stores three chunks; vLLM cascades them to the tier."""
    _, m = _manager(_fresh_config(kind), f"kvplugin-store-{kind}")
    try:
        keys = [key(100 + i) for i in range(3)]
        ctx = ctx_of("w", keys)
        with m.lock:
            m.on_new_request(ctx)
            out = m.prepare_store(keys, ctx)
        view = torch.frombuffer(m.primary_tier.get_kv_memoryview(), dtype=torch.float32
                                ).view(-1, ROW_ELEMS)
        fill(view, [int(s) for s in out.store_spec.chunk_ids], seed=7)
        with m.lock:
            m.complete_store(keys, ctx)
        step_until_idle(m)
        with m.lock:
            m.on_request_finished(ctx)
        return {"slots": [int(s) for s in out.store_spec.chunk_ids],
                "stats": stat(m.secondary_tiers[0])}
    finally:
        m.shutdown()


def load_fresh(root: str, kind: str) -> dict[str, Any]:
    """A fresh process's manager (empty primary) finds the chunks in the tier, promotes
    them into its primary tier, and they are the bytes the first process wrote."""
    _, m = _manager(_fresh_config(kind), f"kvplugin-load-{kind}")
    try:
        keys = [key(100 + i) for i in range(3)]
        ctx = ctx_of("r", keys)
        with m.lock:
            m.on_new_request(ctx)
        seen: list[list[str]] = []
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with m.lock:
                got = [m.lookup(k, ctx).name for k in [*keys, key(999)]]
                m.on_schedule_end(END)
            if not seen or seen[-1] != got:
                seen.append(got)
            if got[:3] == ["HIT"] * 3:
                break
            time.sleep(0.01)
        with m.lock:
            spec = m.prepare_load(keys, ctx)
        view = torch.frombuffer(m.primary_tier.get_kv_memoryview(), dtype=torch.float32
                                ).view(-1, ROW_ELEMS)
        got_rows = [view[int(s)].tolist() for s in spec.chunk_ids]
        scratch = torch.zeros((3, ROW_ELEMS), dtype=torch.float32)
        want = fill(scratch, [0, 1, 2], seed=7)
        with m.lock:
            m.complete_load(keys, ctx)
            m.on_request_finished(ctx)
        return {"lookups": seen, "exact": got_rows == want,
                "stats": stat(m.secondary_tiers[0])}
    finally:
        m.shutdown()


def damaged(root: str) -> dict[str, Any]:
    """A damaged object, a missing one and one of another shape each fail their load job:
    the good ones are copied in and named (successful_keys), the failed keys' lookups turn
    to misses (vLLM's livelock guard)."""
    cfg = write_config(root, "dmg", {"local_disk": f"file://{root}/disk"})
    tier, primary = direct_tier(cfg)
    try:
        keys = [key(i) for i in range(4)]
        ctx = ctx_of("r", keys)
        tier.on_new_request(ctx)
        want = fill(primary, [0, 1, 2, 3], seed=3)
        tier.submit_store(job(1, keys, [0, 1, 2, 3], ctx))
        settle(tier, 1)
        ids = [tier.core.object_key("default", k).id for k in keys]
        conn = tier.core.rt.connector
        files = [Path(conn.levels[-1].path_for(i)) for i in ids]
        raw = bytearray(files[1].read_bytes())
        raw[len(raw) // 2] ^= 0x40  # one bit inside the payload
        files[1].write_bytes(bytes(raw))
        files[2].unlink()
        k3 = tier.core.object_key("default", keys[3])
        from kvplugin.serde import Block
        odd = Block(k3.meta(token_start=48, token_end=64, dtype="uint8", shape=(1, 16)),
                    bytes(16))
        tier.core.rt.loop.call(conn.delete([k3], timeout=5))
        tier.core.rt.loop.call(conn.put([(k3, odd)], timeout=5))
        before, _ = resolve(tier, keys, ctx)
        primary.zero_()
        tier.submit_load(job(2, keys, [4, 5, 6, 7], ctx, promotion=True))
        loaded = [result(r) for r in settle(tier, 1)]
        after = [tier.lookup(k, ctx).name for k in keys]
        return {"before": before, "loaded": loaded, "after": after,
                "first_exact": primary[4].tolist() == want[0],
                "failed_rows_zero": all(not primary[s].any() for s in (5, 6, 7)),
                "keys": [k.hex() for k in keys], "stats": stat(tier)}
    finally:
        tier.shutdown()


def dead_redis(root: str) -> dict[str, Any]:
    """A Redis that is not there: lookups resolve as misses within the lookup deadline;
    stores fail their jobs, and vLLM's backpressure detector (failure_threshold) puts the
    tier under pressure through the real manager, which then drops its cascades."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    cfg = write_config(root, "dead", {"remote_url": f"redis://127.0.0.1:{port}/0",
                                      "lookup_timeout_ms": 50, "store_timeout_ms": 200})
    _, m = _manager(cfg, "kvplugin-dead", backpressure={
        "backpressure_cls": "EMABackpressureDetector", "failure_threshold": 3})
    tier = m.secondary_tiers[0]
    try:
        keys = [key(i) for i in range(8)]
        ctx = ctx_of("r", keys)
        with m.lock:
            m.on_new_request(ctx)
        looked, took = resolve(tier, keys[:2], ctx)
        outcomes = []
        for i in range(5):
            with m.lock:
                m.prepare_store([keys[i]], ctx)
                m.complete_store([keys[i]], ctx)
            step_until_idle(m)
            outcomes.append(tier.bp_detector.is_under_pressure())
        st = m.get_stats().data["data"]
        return {"lookups": looked, "resolved_s": took, "pressure": outcomes,
                "cascade_failures": sum(st.get(
                    "vllm:kv_offload_tiering_cascade_job_failures", {}).values()),
                "dropped": sum(st.get("vllm:kv_offload_tiering_backpressure_stores_dropped",
                                      {}).values()),
                "stats": ours(st)}
    finally:
        m.shutdown()


def slow_tier(root: str) -> dict[str, Any]:
    """Every tier call sleeps (the config's fault drill): a lookup is a miss at its
    deadline, not a stalled scheduler."""
    path = write_config(root, "slow", {"local_cpu": True, "max_local_cpu_size": 0.01,
                                       "lookup_timeout_ms": 50},
                        faults={"rate": 1.0, "kinds": ["latency"], "latency_ms": 2000,
                                "seed": 1})
    tier, _ = direct_tier(path)
    try:
        keys = [key(i) for i in range(3)]
        ctx = ctx_of("r", keys)
        tier.on_new_request(ctx)
        looked, took = resolve(tier, keys, ctx)
        return {"lookups": looked, "resolved_s": took}
    finally:
        tier.shutdown()


def tenants(root: str) -> dict[str, Any]:
    """Two tenants, the same vLLM key: a's object is a's alone."""
    cfg = write_config(root, "ten", {"local_cpu": True, "max_local_cpu_size": 0.01})
    tier, primary = direct_tier(cfg)
    try:
        keys = [key(1)]
        a = ctx_of("a", keys, {"tenant": "a"})
        b = ctx_of("b", keys, {"cache_salt": "tenant=b;salt=x"})
        for c in (a, b):
            tier.on_new_request(c)
        fill(primary, [0], seed=5)
        tier.submit_store(job(1, keys, [0], a))
        settle(tier, 1)
        la, _ = resolve(tier, keys, a)
        lb, _ = resolve(tier, keys, b)
        tier.submit_load(job(2, keys, [1], b, promotion=True))
        loaded_b = [result(r) for r in settle(tier, 1)]
        ids = {t: tier.core.object_key(t, keys[0]).id for t in ("a", "b")}
        return {"a": la, "b": lb, "b_load": loaded_b, "ids_differ": ids["a"] != ids["b"],
                "b_row_zero": not primary[1].any(), "stats": stat(tier)}
    finally:
        tier.shutdown()


def quota(root: str) -> dict[str, Any]:
    """Tenant q may hold two rows in memory: its third store is shed (a decision, so the
    job succeeds and moves no bytes), its held bytes are two rows; r has no quota."""
    cfg = write_config(root, "quota", {"local_cpu": True, "max_local_cpu_size": 0.01},
                       {"declared": {"q": {"max_tier_bytes": {"memory": 2 * ROW}},
                                     "r": {}}})
    tier, primary = direct_tier(cfg)
    try:
        out: dict[str, Any] = {}
        for tenant in ("q", "r"):
            keys = [key(10 + i) for i in range(3)]
            ctx = ctx_of(tenant, keys, {"tenant": tenant})
            tier.on_new_request(ctx)
            fill(primary, [0, 1, 2], seed=11)
            results = []
            for i, k in enumerate(keys):
                tier.submit_store(job(10 * ord(tenant[0]) + i, [k], [i], ctx))
                results += [result(r) for r in settle(tier, 1)]
            looked, _ = resolve(tier, keys, ctx)
            out[tenant] = {"stores": results, "lookups": looked}
        undeclared = ctx_of("x", [key(1)], {"tenant": "mallory"})
        tier.on_new_request(undeclared)
        tier.submit_store(job(99, [key(1)], [0], undeclared))
        out["undeclared"] = [result(r) for r in settle(tier, 1)]
        out["stats"] = stat(tier)
        return out
    finally:
        tier.shutdown()


def events(root: str) -> dict[str, Any]:
    """With KV events on, the tier's events say what it holds: a memory tier of two rows
    stores three (the first evicted); replaying the events gives the keys lookups find."""
    cfg = write_config(root, "ev", {"local_cpu": True,
                                    "max_local_cpu_size": 3 * ROW / 2**30})
    tier, primary = direct_tier(cfg, events=True, enable_kv_events=True)
    try:
        keys = [key(i) for i in range(3)]
        ctx = ctx_of("r", keys)
        tier.on_new_request(ctx)
        fill(primary, [0, 1, 2], seed=2)
        for i, k in enumerate(keys):
            tier.submit_store(job(i + 1, [k], [i], ctx))
            settle(tier, 1)
        evs = list(tier.take_events())
        held: set[str] = set()
        for e in evs:
            (held.difference_update if e.removed else held.update)(k.hex() for k in e.keys)
        found = [k.hex() for i, k in enumerate(keys)  # one request per key: no prefix between
                 if resolve(tier, [k], ctx_of(f"q{i}", [k]))[0] == ["HIT"]]
        return {"events": [{"keys": [k.hex() for k in e.keys], "removed": e.removed,
                            "medium": e.medium.name, "locality": e.locality.name,
                            "ownership": e.ownership} for e in evs],
                "held": sorted(held),
                "found": found}
    finally:
        tier.shutdown()


def window(root: str) -> dict[str, Any]:
    """vLLM asks a sliding-window group's chunks from the end: chunks 1 and 2 stored, 0
    not, are found in the window group, and are no prefix in the full-attention group."""
    cfg = write_config(root, "win", {"local_cpu": True, "max_local_cpu_size": 0.01})
    tier, _ = direct_tier(cfg, window=2)
    try:
        out = {}
        for g in (0, 1):
            keys = [key(i, g) for i in range(3)]
            ctx = ctx_of(f"s{g}", keys)
            tier.on_new_request(ctx)
            tier.submit_store(job(g + 1, keys[1:], [1, 2], ctx))
            settle(tier, 1)
            out[f"group{g}"] = resolve(tier, keys, ctx_of(f"r{g}", keys))[0]
        return out
    finally:
        tier.shutdown()


SCENARIOS = {f.__name__: f for f in (docs_factory, roundtrip, damaged, dead_redis, slow_tier,
                                     tenants, quota, events, window)}


def _run(name: str, kind: str, root: str) -> dict[str, Any]:
    if name in ("store_fresh", "load_fresh"):
        return (store_fresh if name == "store_fresh" else load_fresh)(root, kind)
    return SCENARIOS[name](root)


if __name__ == "__main__":
    sys.exit(scenario_testlib.scenario_main(sys.argv[1:], "kvplugin-tier-", _run))
