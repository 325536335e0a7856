"""Scenarios for KVPluginConnector in vLLM 0.33.0's real Scheduler, on CPU.

Run under the side virtualenv's python (vLLM + CPU torch), with this checkout on PYTHONPATH:

    PYTHONPATH=. $PY tests/integrations/vllm_scenarios.py disk redis corrupt async preempt

Prints one JSON object per scenario (one line each); test_vllm_connector.py asserts on them.
The Scheduler, its KVCacheManager and the connector factory are vLLM's; this script plays
EngineCore and the model runner (:mod:`vllm_fake`): per step ``schedule()`` -> worker
connector (loads into CPU torch tensors standing in for the GPU KV cache, a fake forward
writing each token's KV and the Mamba states, saves) -> ``update_from_output()``.
"""

from __future__ import annotations

import asyncio
import os
import sys
import tempfile
import time
from typing import Any

import torch
import vllm_fake
from vllm_fake import (
    BS,
    HEAD,
    HEADS,
    LAYERS,
    MAMBA_BS,
    Runner,
    build,
    expected_pages,
    sampled,
    state_value,
    write_config,
)

DEFAULT_LAYOUT = vllm_fake.KV_LAYOUT


def drive(scheduler: Any, runner: Runner, workload: list[dict[str, Any]],
          max_steps: int = 2000) -> dict[str, Any]:
    """Run ``workload`` to the end. An item with ``abort_at`` is aborted (as a client
    would) right after the step that computed exactly that many tokens."""
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request, RequestStatus

    arrivals: dict[int, list[dict[str, Any]]] = {}
    for w in workload:
        arrivals.setdefault(w["arrival"], []).append(w)
    finished: list[str] = []
    kept = _spy_delayed_frees(scheduler.get_kv_connector())
    last_arrival = max(arrivals)
    bp = scheduler.kv_cache_manager.block_pool
    step = 0
    for step in range(max_steps):
        if step in arrivals:
            runner.settle_stores()
        for w in arrivals.get(step, []):
            sp = SamplingParams(max_tokens=w["max_tokens"], ignore_eos=True)
            scheduler.add_request(Request(request_id=w["id"], prompt_token_ids=w["prompt"],
                                          sampling_params=sp, pooling_params=None,
                                          block_hasher=runner.hasher,
                                          cache_salt=w.get("salt")))
        if step > last_arrival and not scheduler.has_requests() and not runner.pending \
                and bp.get_num_free_blocks() == bp.num_gpu_blocks - 1 \
                and not _open_plans(scheduler):
            break  # idle steps carry the last stores' outcomes to the ledger
        so = scheduler.schedule()
        if not so.total_num_scheduled_tokens:
            time.sleep(0.005)  # an idle engine polls its transfers; stores take real time
        out = scheduler.update_from_output(so, runner.step(so))
        if runner.after_step is not None:
            runner.after_step()
        for outs in out.values():
            finished += [o.request_id for o in outs.outputs if o.finish_reason is not None]
        for w in workload:
            req = scheduler.requests.get(w["id"])
            if (req is not None and "abort_at" in w and not req.num_in_flight_tokens
                    and req.num_computed_tokens == w["abort_at"]):
                scheduler.finish_requests(w["id"], RequestStatus.FINISHED_ABORTED)
                finished.append(w["id"])
    return {"finished": sorted(set(finished)), "steps": step,
            "loads": [ld.as_dict() for ld in runner.loads],
            "free_blocks": bp.get_num_free_blocks(), "num_blocks": bp.num_gpu_blocks,
            "invalid_blocks": len(runner.invalid_total),
            "failed_loads": sorted(runner.failed_total), "preempted": sorted(runner.preempted),
            "saved_chunks": runner.saved_chunks,
            "saved_pieces": {str(g): n for g, n in sorted(runner.saved_pieces.items())},
            "saved_objects": {str(g): sum(1 for og, _ in runner.saved_objects if og == g)
                              for g in sorted(runner.saved_pieces)},
            "states_checked": runner.states_checked,
            "state_mismatches": runner.state_mismatches, "computed": dict(runner.computed),
            "worker_stats": dict(runner.worker_stats), "kept_blocks": sorted(kept),
            **books(scheduler)}


def _open_plans(scheduler: Any) -> int:
    conn = scheduler.get_kv_connector()
    return 0 if conn is None else len(conn.scheduler_side._plans)


def _spy_delayed_frees(conn: Any) -> set[str]:
    """The requests whose blocks the connector kept at finish (``delay_free``)."""
    kept: set[str] = set()
    if conn is None:  # vLLM alone
        return kept

    def spying(orig: Any) -> Any:
        def spy(request: Any, block_ids: Any) -> Any:
            delay, params = orig(request, block_ids)
            if delay:
                kept.add(request.request_id)
            return delay, params
        return spy

    for name in ("request_finished", "request_finished_all_groups"):
        setattr(conn, name, spying(getattr(conn, name)))
    return kept


def books(scheduler: Any) -> dict[str, Any]:
    """The scheduler connector's offload ledger: per-tenant counters, bytes held per
    tenant and tier, and what is still open (plans, bytes in flight)."""
    import dataclasses

    conn = scheduler.get_kv_connector()
    if conn is None:
        return {}
    side = conn.scheduler_side
    ledger = side.ledger
    held = ledger.holdings.by_tenant_tier() if ledger.holdings is not None else {}
    return {"books": {t: dataclasses.asdict(c) for t, c in sorted(ledger.tenants().items())},
            "held": {f"{t}|{tier}": n for (t, tier), n in sorted(held.items())},
            "open_plans": len(side._plans), "bytes_in_flight": ledger.bytes_in_flight}


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 131) % 900 + 100 for i in range(n)]


def evicting_workload(bad_salt: bool = False, shared_len: int = 80) -> list[dict[str, Any]]:
    """``a`` stores a ``shared_len``-token prefix; fillers push it out of the device pool;
    ``b`` shares that prefix (plus a new tail) and must load it from the tiers. ``bad_salt``:
    plus ``x``, whose cache_salt is no valid tenant name (served without offload)."""
    shared = prompt(1, shared_len)
    wl = [{"id": "a", "prompt": shared, "arrival": 0, "max_tokens": 2}]
    wl += [{"id": f"f{i}", "prompt": prompt(10 + i, 100), "arrival": 8 + 3 * i,
            "max_tokens": 2} for i in range(4)]
    wl.append({"id": "b", "prompt": shared + prompt(99, 20), "arrival": 40, "max_tokens": 3})
    if bad_salt:
        wl.append({"id": "x", "prompt": prompt(77, 40), "arrival": 1, "max_tokens": 2,
                   "salt": "not a tenant!"})
    return wl


def multiturn_workload(conversations: int = 4, turns: int = 3) -> list[dict[str, Any]]:
    """Conversations whose every turn resends the history (prompt + answer) plus a new
    message; the pool is smaller than the working set, so later turns find their history
    evicted from the device and in the tiers."""
    wl = []
    for c in range(conversations):
        history = prompt(200 + c, 40)
        for t in range(turns):
            rid = f"c{c}t{t}"
            wl.append({"id": rid, "prompt": list(history), "arrival": 2 * c + 14 * t,
                       "max_tokens": 4})
            history += sampled(rid, len(history), 4) + prompt(300 + 10 * c + t, 20)
    return wl


# ------------------------------------------------------------------------------ scenarios
# name -> (layout, tier, workload, async loads, pool blocks)
SCENARIOS: dict[str, tuple[str, str, str, bool, int]] = {
    "disk": ("full", "disk", "evict_bad_salt", False, 24),
    "redis": ("full", "redis", "evict", False, 24),
    "corrupt": ("full", "disk", "evict", False, 24),
    "poison": ("full", "disk", "evict_reload", False, 24),
    "async": ("full", "disk", "evict", True, 24),
    "preempt": ("full", "disk", "preempt", False, 12),
    "dead": ("full", "dead", "evict", False, 24),
    "multiturn": ("full", "disk", "multiturn", False, 12),
    "events": ("full", "disk", "evict", False, 24),
    "events_evict": ("full", "disk", "evict", False, 24),  # a disk tier of ~10 objects
    "swa": ("swa", "disk", "evict", False, 24),
    "swa_corrupt": ("swa", "disk", "evict", False, 24),
    "mamba": ("mamba", "disk", "evict_mamba", False, 28),
    "mamba_corrupt": ("mamba", "disk", "evict_mamba", False, 28),
    "mislabelled": ("full", "disk", "evict", False, 24),
    "mamba_mislabelled": ("mamba", "disk", "evict_mamba", False, 28),
    "mamba_multiturn": ("mamba", "disk", "multiturn", False, 20),
    "mamba_preempt": ("mamba", "disk", "preempt", False, 10),
    "mla": ("mla", "disk", "evict", False, 24),
    "mla_corrupt": ("mla", "disk", "evict", False, 24),
    "local": ("local", "disk", "evict", False, 24),
    "local_corrupt": ("local", "disk", "evict", False, 24),
}


# Scenarios of vllm_hybrid.py: divergent local hybrid hits, the Mamba preemption stall.
HYBRID = ("mamba_diverge", "mamba_diverge_exact", "mamba_preempt_alone")
# Scenarios of vllm_tenancy.py: tenants' tier quotas, deduplication, kv_role, a dead tier.
TENANCY = ("tenant_quota", "dedup", "producer", "consumer", "dead_beside")


def workload_of(name: str) -> list[dict[str, Any]]:
    if name == "multiturn":
        return multiturn_workload()
    if name == "evict_reload":
        # b, then fillers that push b's blocks out too, then c asking b's prompt again: c
        # loads every chunk b left in the tier, including the ones b computed itself.
        wl = evicting_workload()
        b = next(r for r in wl if r["id"] == "b")
        wl += [{"id": f"g{i}", "prompt": prompt(30 + i, 100), "arrival": 60 + 3 * i,
                "max_tokens": 2} for i in range(4)]
        wl.append({"id": "c", "prompt": b["prompt"], "arrival": 100, "max_tokens": 2})
        return wl
    if name == "preempt":
        return [{"id": f"p{i}", "prompt": prompt(50 + i, 64), "arrival": 0, "max_tokens": 60}
                for i in range(2)]
    # Mamba: a 144-token prefix holds the states at 64 and 128 (block boundaries) and at
    # 144 (inside a Mamba block: where b resumes).
    return evicting_workload(bad_salt=name == "evict_bad_salt",
                             shared_len=144 if name == "evict_mamba" else 80)


class Capture:
    """vLLM's KV event publisher, replaced: keeps every published batch."""

    def __init__(self) -> None:
        self.batches: list[Any] = []

    def publish(self, events: Any) -> None:
        self.batches.append(events)

    def shutdown(self) -> None:
        return None


def _allocate(groups: list[Any], layout: str, num_blocks: int,
              kernel: list[int] | None = None) -> tuple[Any, dict[str, torch.Tensor]]:
    """vLLM's own planning (``get_kv_cache_config_from_groups``) and allocation
    (``allocate_kv_cache``) of ``groups`` in ``layout``: the tensors a worker registers."""
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vc = VllmConfig(cache_config=CacheConfig(block_size=BS), device_config=DeviceConfig("cpu"))
    vc.cache_config.kv_cache_layout = layout
    vc.cache_config.num_gpu_blocks_override = num_blocks
    kvc = get_kv_cache_config_from_groups(vc, groups, 1 << 30)
    return kvc, allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout[layout], kernel)


def _logical_page(t: torch.Tensor, bid: int, head: int) -> torch.Tensor:
    """kvplugin's page of one layer, (K/V, slot, head, dim), read through vLLM's logical
    [B * r, H, N, C] view (C: K then V) alone."""
    n = t.shape[2]
    r = BS // n
    kb = t[bid * r:(bid + 1) * r]  # [r, H, N, C]
    rows = kb.permute(0, 2, 1, 3).reshape(BS, t.shape[1], 2, head)
    return rows.permute(2, 0, 1, 3)


def pages_scenario() -> dict[str, Any]:
    """The worker's page copies on the tensors vLLM allocates, for every KVCacheLayout
    (with kernel blocks splitting a block where vLLM allows it) and an attention group
    overlaid with a Mamba group in one allocation: pages_out gives kvplugin's layout-free
    page bytes (sealed pool slots for big pages); pages_in of those bytes into another
    layout's tensors gives equal logical contents."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec, MambaSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvplugin.buffers import Sealed
    from kvplugin.integrations._groups import (
        group_ios,
        map_groups,
        pages_in,
        pages_out,
        pages_out_many,
    )

    torch.manual_seed(0)
    src_ids, dst_ids = [3, 7, 5], [1, 2, 4]
    out: dict[str, Any] = {"scenario": "pages"}
    for label, heads, head in (("small", 2, 4), ("big", 8, 128)):
        spec = FullAttentionSpec(block_size=BS, num_kv_heads=heads, head_size=head,
                                 dtype=torch.float16)
        groups = [KVCacheGroupSpec(["l0", "l1", "l2"], spec)]
        ios = group_ios(groups)
        rec: dict[str, Any] = {}
        for lay in KVCacheLayout:
            for kernel in (None, [BS // 2]):
                if kernel and (not lay.is_layer_compact or lay.name == "LHBNC"):
                    continue  # vLLM itself refuses to split blocks there
                _, kv = _allocate(groups, lay.name, 12, kernel)
                for t in kv.values():
                    t.copy_(torch.randn(t.shape, dtype=t.dtype))
                m = map_groups(ios, kv)
                payload = pages_out(m[0], src_ids)
                want = torch.stack([torch.stack([_logical_page(kv[n], b, head)
                                                 for n in ios[0].layers], dim=1)
                                    for b in src_ids])
                # Loaded into another layout (the next one), as a fresh engine would.
                other = list(KVCacheLayout)[(list(KVCacheLayout).index(lay) + 1) % 6]
                _, back = _allocate(groups, other.name, 12)
                pages_in(map_groups(ios, back)[0], dst_ids, payload)
                # A step's objects in one call: each equals its own copy-out.
                objects = [[3, 7], [5, 1], [9, 2], [0, 11]]
                many = pages_out_many(m[0], objects)
                rec[lay.name + ("/split" if kernel else "")] = {
                    "many_equal": [bytes(memoryview(p)) for p in many]
                    == [bytes(memoryview(pages_out(m[0], ids))) for ids in objects],
                    "runs": len(m[0].runs), "sealed": isinstance(payload, Sealed),
                    "out_equal": bytes(memoryview(payload)) == want.contiguous().view(
                        torch.uint8).numpy().tobytes(),
                    "in_equal": all(torch.equal(_logical_page(back[n], d, head),
                                                _logical_page(kv[n], s, head))
                                    for n in ios[0].layers
                                    for s, d in zip(src_ids, dst_ids, strict=True))}
        out[label] = rec
    # Full attention overlaid with a Mamba group (the hybrid allocator: mixed page sizes
    # need a block-compact layout), the Mamba page padded past its 40,000 state bytes.
    full = FullAttentionSpec(block_size=BS, num_kv_heads=2, head_size=4, dtype=torch.float32)
    mamba = MambaSpec(block_size=MAMBA_BS, shapes=((10_000,),), dtypes=(torch.float32,),
                      page_size_padded=40_064, mamba_cache_mode="align")
    groups = [KVCacheGroupSpec(["a0", "a1"], full), KVCacheGroupSpec(["m0", "m1"], mamba)]
    ios = group_ios(groups)
    states: dict[str, Any] = {}
    for lay in ("BLHNC", "BLNHC"):
        _, kv = _allocate(groups, lay, 12)
        for n in ("m0", "m1"):
            kv[n].copy_(torch.randint(-128, 127, kv[n].shape, dtype=torch.int8))
        m = map_groups(ios, kv)
        payload = pages_out(m[1], src_ids)
        _, back = _allocate(groups, "BLHNC" if lay != "BLHNC" else "BLNHC", 12)
        pages_in(map_groups(ios, back)[1], dst_ids, payload)
        many = pages_out_many(m[1], [[b] for b in src_ids])
        states[lay] = {
            "many_equal": [bytes(memoryview(p)) for p in many]
            == [bytes(memoryview(pages_out(m[1], [b]))) for b in src_ids],
            "sealed": isinstance(payload, Sealed), "nbytes": memoryview(payload).nbytes,
            "in_equal": all(torch.equal(back[n][d, 0, 0, :40_000], kv[n][s, 0, 0, :40_000])
                            for n in ("m0", "m1")
                            for s, d in zip(src_ids, dst_ids, strict=True))}
    out["state"] = states
    return out


def refusals_scenario(workdir: str) -> dict[str, Any]:
    """What cannot be served fails when vLLM builds the connector or registers the KV
    tensors, with one line naming the group or layer and what was expected."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
    )

    from kvplugin.integrations.vllm import KVPluginConnector

    scen_dir = os.path.join(workdir, "refusals")
    os.makedirs(scen_dir)
    config_file = write_config(scen_dir, disk=True, remote_url=None)
    _, _, vllm_config, kvc = build(scen_dir, config_file, 24, False)
    out: dict[str, Any] = {"scenario": "refusals"}

    def attempt(label: str, groups: list[Any] | None, tensors: Any = None) -> None:
        conf = kvc if groups is None else KVCacheConfig(
            num_blocks=24, kv_cache_tensors=[], kv_cache_groups=groups)
        conn = None
        try:
            conn = KVPluginConnector(vllm_config, KVConnectorRole.WORKER, conf)
            if tensors is not None:
                conn.register_kv_caches(tensors)
            out[label] = None
        except ValueError as e:
            out[label] = str(e)
        finally:
            if conn is not None:
                conn.shutdown()

    attempt("chunked_local", [KVCacheGroupSpec(["l0"], ChunkedLocalAttentionSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
        attention_chunk_size=64))])
    attempt("mamba_none", [KVCacheGroupSpec(["l0"], FullAttentionSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32)),
        KVCacheGroupSpec(["m0"], MambaSpec(block_size=MAMBA_BS, shapes=((4,),),
                                           dtypes=(torch.float32,), mamba_cache_mode="none"))])
    attempt("mla", [KVCacheGroupSpec(["l0"], MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=HEAD, dtype=torch.float32))])
    attempt("mla_packed", [KVCacheGroupSpec(["l0"], MLAAttentionSpec(
        block_size=BS, num_kv_heads=1, head_size=HEAD, dtype=torch.float32,
        cache_dtype_str="fp8_ds_mla"))])
    attempt("head_size_v", [KVCacheGroupSpec(["l0"], FullAttentionSpec(
        block_size=BS, num_kv_heads=HEADS, head_size=HEAD, head_size_v=2 * HEAD,
        dtype=torch.float32))])
    good = {n: torch.zeros(24, HEADS, BS, 2 * HEAD) for n in LAYERS}
    attempt("registered", None, good)
    attempt("missing_layer", None, {LAYERS[0]: good[LAYERS[0]]})
    attempt("old_layout", None, {n: torch.zeros(2, 24, BS, HEADS, HEAD) for n in LAYERS})
    attempt("wrong_heads", None, {n: torch.zeros(24, HEADS + 1, BS, 2 * HEAD)
                                  for n in LAYERS})
    attempt("wrong_dtype", None, {n: torch.zeros(24, HEADS, BS, 2 * HEAD,
                                                 dtype=torch.float16) for n in LAYERS})
    return out


def scenario(name: str, workdir: str, redis_url: str | None) -> dict[str, Any]:
    if name in HYBRID:
        import vllm_hybrid

        return vllm_hybrid.SCENARIOS[name](workdir, name)
    if name in TENANCY:
        import vllm_tenancy

        return vllm_tenancy.SCENARIOS[name](workdir, redis_url)
    if name in ("native", "native_swa", "native_mamba", "native_mla", "native_local"):
        return native_scenario(workdir, name)
    if name == "mamba_tail":
        return tail_scenario(workdir)
    if name == "pages":
        return pages_scenario()
    if name == "refusals":
        return refusals_scenario(workdir)
    layout, tier, wl_name, async_loads, num_blocks = SCENARIOS[name]
    scen_dir = os.path.join(workdir, name)
    os.makedirs(scen_dir)
    # "dead": every tier call fails (a dead backend): lookups miss, stores fail.
    faults = {"rate": 1.0, "kinds": ["error"]} if tier == "dead" else None
    config_file = write_config(scen_dir, disk=tier != "redis",
                               remote_url=redis_url if tier == "redis" else None,
                               faults=faults, layout=layout,
                               disk_gb=3e-5 if name == "events_evict" else None)
    events = name in ("events", "mamba", "events_evict")
    scheduler, runner = engine(workdir, config_file, num_blocks, async_loads, layout,
                               events=events)
    capture = Capture()
    if events:  # vLLM's publisher, replaced: the events still come through its scheduler
        scheduler.kv_event_publisher = capture
    conn, worker = scheduler.get_kv_connector(), runner.w
    if name.endswith("corrupt") or name == "poison":
        def corrupt(spec: Any) -> None:
            # Damage the third object of b's load after the lookup found it.
            if spec.req_id == "b":
                rt = worker._rt
                rt.loop.call(rt.connector.write_raw(spec.pieces[2].key, b"garbage" * 20,
                                                    timeout=5))
        runner.before_load = corrupt
    if name.endswith("mislabelled"):
        def mislabel(spec: Any) -> None:
            # Valid objects under the wrong key (checksummed, the key's namespace): the
            # third piece of b's load holds the second's bytes and range, its state
            # piece (Mamba) the state at another boundary's label.
            if spec.req_id == "b":
                rt = worker._rt
                if name == "mislabelled":
                    relabel(rt, spec.pieces[2].key, spec.pieces[1].key)
                else:
                    st = next(p for p in spec.pieces if p.state)
                    relabel(rt, st.key, st.key, boundary=st.first_token - 16,
                            token_end=st.first_token - 16)
        runner.before_load = mislabel
    try:
        result = drive(scheduler, runner, workload_of(wl_name))
        if name == "events_evict":
            result["router"] = router_check(capture.batches, worker)
    finally:
        worker.shutdown()
        conn.shutdown()
    result["scenario"] = name
    result["connector"] = type(conn).__name__
    if events:
        result["events"] = event_summary(capture.batches)
    return result


def relabel(rt: Any, key: Any, source: Any, **changes: Any) -> None:
    """Put ``source``'s object again under ``key``: valid, with its metadata's key (and
    ``changes``) rewritten, so only the load's acceptance check can refuse it."""
    import dataclasses

    from kvplugin.serde import Block

    async def go() -> None:
        (blk,) = await rt.connector.get([source], timeout=5)
        assert blk is not None, "the object to relabel is missing"
        meta = dataclasses.replace(blk.meta, key=key.id, **changes)
        await rt.connector.delete([key], timeout=5)
        assert await rt.connector.put([(key, Block(meta, bytes(blk.payload)))], timeout=5) == 1

    rt.loop.call(go())


def router_check(batches: list[Any], worker: Any) -> dict[str, Any]:
    """A KV-aware router fed what vLLM published (and what the worker still holds back:
    the last step's), against the blocks of the objects the tier holds now."""
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvplugin.aio.jobs import connector_tiers

    events = [e for b in batches for e in b.events]
    last = worker.get_kv_connector_kv_cache_events()
    if last is not None:
        events += last.get_all_events()
    believed: dict[str, set[Any]] = {}
    counts = {"stored": 0, "removed": 0}
    for e in events:
        if getattr(e, "medium", "GPU") == "GPU":
            continue
        blocks = believed.setdefault(e.medium, set())
        if isinstance(e, BlockStored):
            blocks.update(e.block_hashes)
            counts["stored"] += 1
        elif isinstance(e, BlockRemoved):
            blocks.difference_update(e.block_hashes)
            counts["removed"] += 1
    view = worker.worker_side._w.view
    truth: dict[str, set[Any]] = {}
    for tier in connector_tiers(worker._rt.connector):
        held = tier.objects()
        truth["DISK"] = {h for sid in held for h in view._info[sid].block_hashes}
        evicted = tier.stats().evicted
    return {"equal": {k: sorted(map(str, v)) for k, v in believed.items()}
            == {k: sorted(map(str, v)) for k, v in truth.items()},
            "believed": len(believed.get("DISK", ())), "held": len(truth.get("DISK", ())),
            "evicted": evicted, **counts}


def event_summary(batches: list[Any]) -> dict[str, Any]:
    """What vLLM published: its own GPU BlockStored, and the connector's (tier medium)."""
    from vllm.distributed.kv_events import BlockStored

    stored = [e for b in batches for e in b.events if isinstance(e, BlockStored)]
    tier = [e for e in stored if e.medium != "GPU"]
    gpu = {h for e in stored if e.medium == "GPU" for h in e.block_hashes}
    groups: dict[str, int] = {}
    for e in tier:
        groups[str(e.group_idx)] = groups.get(str(e.group_idx), 0) + 1
    return {"gpu_stored": sum(1 for e in stored if e.medium == "GPU"),
            "tier_stored": len(tier), "media": sorted({e.medium for e in tier}),
            "groups": groups, "kinds": sorted({str(e.kv_cache_spec_kind) for e in tier}),
            # Every stored object is a block vLLM computed (and announced) on the GPU.
            "tier_hashes_on_gpu": all(h in gpu for e in tier for h in e.block_hashes),
            "ownership": sorted({str(e.ownership) for e in tier}),
            "tier_blocks": sum(len(e.block_hashes) for e in tier),
            "tier_tokens_ok": all(len(e.token_ids) == e.block_size for e in tier),
            "distinct_hashes": len({h for e in tier for h in e.block_hashes})}


def engine(workdir: str, config_file: str, num_blocks: int, async_loads: bool = False,
           layout: str = "full", events: bool = False, connector: bool = True,
           divergent: bool = True, kv_role: str = "kv_both") -> tuple[Any, Runner]:
    """vLLM's Scheduler (its connector built by vLLM's factory; none when ``connector``
    is False) and a runner with the connector's worker side."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvplugin.integrations.vllm import KVPluginConnector

    scheduler, hasher, vllm_config, kvc = build(workdir, config_file, num_blocks, async_loads,
                                                layout, events, connector, divergent,
                                                kv_role)
    worker = KVPluginConnector(vllm_config, KVConnectorRole.WORKER, kvc) if connector else None
    runner = Runner(scheduler, worker, kvc, layout)
    runner.hasher = hasher
    return scheduler, runner


def run_vllm(workdir: str, config_file: str, workload: list[dict[str, Any]],
             layout: str = "full") -> dict[str, Any]:
    scheduler, runner = engine(workdir, config_file, 28, layout=layout)
    try:
        return drive(scheduler, runner, workload)
    finally:
        runner.w.shutdown()
        scheduler.get_kv_connector().shutdown()  # the disk tier's lock is released here


def tail_scenario(workdir: str) -> dict[str, Any]:
    """A finish-time partial tail: ``t`` (100-token prompt) is aborted right after its
    prefill stopped at 96, the prompt's last hash boundary, inside a Mamba block: vLLM hands
    the connector the running state block (``register_finished_partial_tail``). A fresh
    engine (empty device cache, same tier) then serves ``u``, which shares those 96 tokens:
    it loads the six chunks and the state at 96."""
    scen_dir = os.path.join(workdir, "mamba_tail")
    os.makedirs(scen_dir)
    config_file = write_config(scen_dir, disk=True, remote_url=None, layout="mamba")
    scheduler, runner = engine(workdir, config_file, 28, layout="mamba")
    conn = scheduler.get_kv_connector()
    calls: list[dict[str, Any]] = []
    register = conn.register_finished_partial_tail

    def spy(request: Any, block_ids: Any, tails: Any) -> bool:
        kept = register(request, block_ids, tails)
        calls.append({"req": request.request_id, "boundaries": [t[2] for t in tails],
                      "kept": kept})
        return kept

    conn.register_finished_partial_tail = spy
    t = prompt(5, 100)
    try:
        first = drive(scheduler, runner,
                      [{"id": "t", "prompt": t, "arrival": 0, "max_tokens": 4, "abort_at": 96}])
    finally:
        runner.w.shutdown()
        conn.shutdown()
    second = run_vllm(workdir, config_file, [
        {"id": "u", "prompt": t[:96] + prompt(55, 20), "arrival": 0, "max_tokens": 2}],
        "mamba")
    return {"scenario": "mamba_tail", "tail_calls": calls, "first": first, "second": second}


# --------------------------------------------------------------------------- native side
def _group_rows(mgr: Any, group: int, ids: list[int]) -> Any:
    import numpy as np

    return torch.from_numpy(np.array(mgr.memory.pages(group, ids)).copy())


async def native_load(config_file: str, tokens: list[int], tenant: str, layout: str = "full"
                      ) -> dict[str, Any]:
    """The native async manager looks ``tokens`` up and loads what the tiers hold; every
    group's loaded blocks (and the state) are compared with the fake KV."""
    from kvplugin.plugin import load_plugin

    async with load_plugin(config_file) as plugin:
        mgr = plugin.manager
        req = mgr.new_request("n-load", tokens, tenant=tenant)
        found = await mgr.lookup(req)
        adm = mgr.allocate(req, found)
        assert adm is not None
        outcome = await mgr.wait_load(req) if adm.loading else None
        hit = adm.external_tokens
        n = hit // BS
        table = mgr.core.get_block_ids(req.request_id)
        equal = n > 0
        if n:
            got = _group_rows(mgr, 0, table[0][:n]).view(torch.float32)
            want = expected_pages(tokens, 0, n, 0, layout)
            equal = torch.equal(got.reshape(want.shape), want)
        if n and layout in ("swa", "local"):  # only the window before the hit: rest null
            ids = [b for b in table[1][:n] if b]
            first = n - len(ids)
            got = _group_rows(mgr, 1, ids).view(torch.float32)
            equal = equal and torch.equal(
                got.reshape(len(ids), 2, len(LAYERS), BS, HEADS, HEAD),
                expected_pages(tokens, first * BS, len(ids), 1))
        if n and layout == "mamba":
            bid = table[1][-(hit // -MAMBA_BS) - 1]
            row = _group_rows(mgr, 1, [bid]).reshape(-1)
            want = state_value(tokens[:hit]).reshape(-1)
            equal = equal and torch.equal(row[:want.numel()], want)
        mgr.finish(req)
        await mgr.drain()
        return {"external_tokens": hit,
                "loaded_tokens": outcome.loaded_tokens if outcome else 0, "equal": equal}


def _native_forward(mgr: Any, rid: str, tokens: list[int], start: int, end: int,
                    layout: str) -> None:
    """The native engine's model step over ``[start, end)``, writing the vLLM fake's values:
    every attention block it touches (whole pages: ``tokens`` is a whole number of blocks;
    a window group's null blocks skipped) and, for Mamba, the state at ``end`` in the block
    "align" mode keeps it in."""
    table = mgr.core.get_block_ids(rid)
    for g in (0, 1) if layout in ("swa", "local") else (0,):
        for b in range(start // BS, -(end // -BS)):
            if table[g][b]:
                page = expected_pages(tokens, b * BS, 1, g, layout).contiguous()
                mgr.memory.copy_in(g, [table[g][b]], page.view(torch.uint8).numpy().tobytes())
    if layout == "mamba":
        bid = table[1][-(end // -MAMBA_BS) - 1]
        mgr.memory.copy_in(1, [bid], state_value(tokens[:end]).numpy().tobytes())


async def native_store(config_file: str, tokens: list[int], tenant: str, layout: str = "full"
                       ) -> dict[str, Any]:
    """The native async manager computes ``tokens`` step by step (the same fake KV and
    states as vLLM's runner; Mamba steps end where the core wants a state) and stores what
    its core hands over: every group's chunks, the boundary states, the partial tail."""
    from kvplugin.plugin import load_plugin

    assert len(tokens) % BS == 0
    async with load_plugin(config_file) as plugin:
        mgr = plugin.manager
        req = mgr.new_request("n-store", tokens, tenant=tenant)
        adm = mgr.allocate(req, await mgr.lookup(req))
        assert adm is not None and adm.local_tokens == adm.external_tokens == 0
        steps = 0
        while True:
            start = req.num_computed_tokens
            end = start + adm.num_new_tokens
            _native_forward(mgr, req.request_id, tokens, start, end, layout)
            req.num_computed_tokens = end
            mgr.after_step([req])
            steps += 1
            if end >= len(tokens):
                break
            adm = mgr.allocate(req)
            assert adm is not None and adm.num_new_tokens > 0
        mgr.finish(req)
        await mgr.drain()
        return {"steps": steps, "stores": int(mgr.stats().stores)}


def native_scenario(workdir: str, name: str) -> dict[str, Any]:
    """Same tier, same keys: vLLM stores and the native manager loads, and the reverse
    (every layout)."""
    layout = {"native": "full", "native_swa": "swa", "native_mamba": "mamba",
              "native_mla": "mla", "native_local": "local"}[name]
    scen_dir = os.path.join(workdir, name)
    os.makedirs(scen_dir)
    config_file = write_config(scen_dir, disk=True, remote_url=None, layout=layout)
    salt = "tenant=acme"  # what the native manager salts tenant acme's requests with
    shared = prompt(1, 144 if layout == "mamba" else 80)
    stored = run_vllm(workdir, config_file, [
        {"id": "a", "prompt": shared, "arrival": 0, "max_tokens": 2, "salt": salt}], layout)
    tail = prompt(98, 20)
    native = asyncio.run(native_load(config_file, shared + tail, "acme", layout))
    other = asyncio.run(native_load(config_file, shared + tail, "other", layout))
    out: dict[str, Any] = {"scenario": name, "vllm_stored_chunks": stored["saved_chunks"],
                           "vllm_saved_pieces": stored["saved_pieces"],
                           "native_load": native, "other_tenant_load": other}
    theirs = prompt(2, 144 if layout == "mamba" else 96)
    out["native_store"] = asyncio.run(native_store(config_file, theirs, "acme", layout))
    loaded = run_vllm(workdir, config_file, [
        {"id": "c", "prompt": theirs + prompt(97, 10), "arrival": 0, "max_tokens": 2,
         "salt": salt}], layout)
    out.update(vllm_loads=loaded["loads"], vllm_free_blocks=loaded["free_blocks"],
               num_blocks=loaded["num_blocks"], vllm_finished=loaded["finished"],
               vllm_computed=loaded["computed"], vllm_states_checked=loaded["states_checked"],
               vllm_state_mismatches=loaded["state_mismatches"],
               vllm_failed_loads=loaded["failed_loads"])
    return out


def main(argv: list[str]) -> int:
    import json

    from kvplugin.connectors.faults import LocalRedisServer

    with tempfile.TemporaryDirectory(prefix="kvplugin-vllm-") as workdir:
        server = None
        if "redis" in argv:
            server = LocalRedisServer(os.path.join(workdir, "redis-server"))
            server.start()
        try:
            for arg in argv:
                # ``name@LAYOUT`` (``name@LAYOUT/split``: kernel blocks of half a block):
                # the scenario on tensors vLLM allocates in that KVCacheLayout.
                name, _, physical = arg.partition("@")
                layout, _, split = physical.partition("/")
                vllm_fake.KV_LAYOUT = layout or DEFAULT_LAYOUT
                vllm_fake.KERNEL_BS = BS // 2 if split else None
                url = server.url if server is not None else None
                scen_root = os.path.join(workdir, arg.replace("/", "_"))
                os.makedirs(scen_root)
                rec = scenario(name, scen_root, url)
                rec["scenario"] = arg
                print(json.dumps(rec), flush=True)
        finally:
            if server is not None:
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
