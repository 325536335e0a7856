"""Scenarios for KVPluginConnector in vLLM 0.33.0's real Scheduler, on CPU.

Run under the side virtualenv's python (vLLM + CPU torch), with this checkout on PYTHONPATH:

    PYTHONPATH=. $PY tests/integrations/vllm_scenarios.py disk redis corrupt async preempt

Prints one JSON object per scenario (one line each); test_vllm_connector.py asserts on them.
The Scheduler, its KVCacheManager and the connector factory are vLLM's; this script plays
EngineCore and the model runner: per step ``schedule()`` -> worker connector (loads into CPU
torch tensors standing in for the GPU KV cache, a fake forward writing each token's KV,
saves) -> ``update_from_output()``. A token's fake KV depends only on (token id, position),
so a block loaded for a prefix must equal what any request computed for it.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import zlib
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_CACHE_ROOT", os.path.join(tempfile.gettempdir(),
                                                      "kvplugin_vllm_cache"))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch
import yaml

BS = 16  # tokens per block
HEADS, HEAD = 2, 4
LAYERS = ["layer0", "layer1"]
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float16",
         "bos_token_id": 1, "eos_token_id": 2}


def write_config(workdir: str, *, disk: bool, remote_url: str | None,
                 faults: dict[str, Any] | None = None) -> str:
    cfg = {
        # The native manager hashes as this vLLM does: sha256, NONE_HASH from PYTHONHASHSEED
        # when set (vLLM's rule), else the shared default seed.
        "layout": {"block_size": BS, "num_blocks": 64, "groups": [{"kind": "full"}],
                   "hash_fn": "sha256", "none_hash_seed": os.environ.get("PYTHONHASHSEED")},
        "model": {"name": "kvplugin/vllm-test", "num_layers": len(LAYERS),
                  "num_kv_heads": HEADS, "head_size": HEAD, "dtype": "float32"},
        "offload": {"chunk_size": BS, "local_cpu": False,
                    "local_disk": os.path.join(workdir, "disk") if disk else None,
                    "remote_url": remote_url, "lookup_timeout_ms": 500,
                    "load_timeout_ms": 3000, "store_timeout_ms": 5000},
    }
    if faults:
        cfg["faults"] = faults
    path = os.path.join(workdir, "kvplugin.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def build(workdir: str, config_file: str, num_blocks: int, async_loads: bool) -> Any:
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = os.path.join(workdir, "tiny_llama")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MODEL, f)
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16",
                               seed=42, max_model_len=1024)
    cache = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True)
    cache.kv_cache_layout = "NHD"
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
            enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=False),
        model_config=model_config, cache_config=cache, device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPluginConnector",
            kv_connector_module_path="kvplugin.integrations.vllm", kv_role="kv_both",
            kv_connector_extra_config={"config_file": config_file,
                                       "async_loads": async_loads},
            kv_load_failure_policy="recompute"))
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    kvc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec(list(LAYERS), spec)])
    vllm_config.cache_config.num_gpu_blocks = num_blocks
    sched_bs, hash_bs = resolve_kv_cache_block_sizes(kvc, vllm_config)
    kvc.hash_block_size = hash_bs
    kvc.cache_hit_alignment_tokens = resolve_cache_hit_alignment_tokens(
        kvc, vllm_config, sched_bs, hash_bs)
    scheduler = Scheduler(vllm_config=vllm_config, kv_cache_config=kvc,
                          structured_output_manager=StructuredOutputManager(vllm_config),
                          block_size=sched_bs, hash_block_size=hash_bs, log_stats=True)
    hash_fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    init_none_hash(hash_fn)
    hasher = get_request_block_hasher(hash_bs, hash_fn, vllm_config.num_hash_lookahead_tokens)
    return scheduler, hasher, vllm_config, kvc


def kv_value(token: int, pos: int) -> torch.Tensor:
    """The fake KV of one token: (K/V, layer, head, dim), from (token, position) only."""
    base = float(token * 4096 + pos)
    idx = torch.arange(2 * len(LAYERS) * HEADS * HEAD, dtype=torch.float32)
    return (base + idx / 64).reshape(2, len(LAYERS), HEADS, HEAD)


class Runner:
    """EngineCore + model runner + the connector's worker side."""

    def __init__(self, scheduler: Any, worker: Any, num_blocks: int) -> None:
        self.s = scheduler
        self.w = worker
        self.kv = {n: torch.zeros(2, num_blocks, BS, HEADS, HEAD) for n in LAYERS}
        worker.register_kv_caches(self.kv)
        self.loads: list[dict[str, Any]] = []  # every load, with its verification
        self.pending: dict[str, Any] = {}  # async loads in flight: req_id -> spec
        self.invalid_total: set[int] = set()
        self.preempted: set[str] = set()
        self.saved_chunks = 0
        self.steps = 0
        self.before_load: Any = None  # hook(spec): the test corrupts objects here
        self.hasher: Any = None

    def block(self, bid: int) -> torch.Tensor:
        """(slot, K/V, layer, head, dim) of one block."""
        return torch.stack([self.kv[n][:, bid] for n in LAYERS], dim=1).permute(2, 0, 1, 3, 4)

    def verify(self, spec: Any, invalid: set[int]) -> None:
        req = self.s.requests.get(spec.req_id)
        tokens = list(req.all_token_ids) if req is not None else None
        good = bad = 0
        for j, bid in enumerate(spec.block_ids):
            if bid in invalid or tokens is None:
                continue
            start = spec.first_token + j * BS
            want = torch.stack([kv_value(tokens[p], p) for p in range(start, start + BS)])
            if torch.equal(self.block(bid), want):
                good += 1
            else:
                bad += 1
        self.loads.append({"req": spec.req_id, "first_token": spec.first_token,
                           "blocks": len(spec.block_ids), "async": spec.is_async,
                           "verified": good, "mismatched": bad,
                           "invalid": len([b for b in spec.block_ids if b in invalid])})

    def step(self, so: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput

        self.steps += 1
        meta = so.kv_connector_metadata
        self.preempted |= set(so.preempted_req_ids or ())
        self.w.bind_connector_metadata(meta)
        for spec in meta.loads:
            if self.before_load is not None:
                self.before_load(spec)
            for n in LAYERS:  # device memory holds garbage until the load lands
                self.kv[n][:, spec.block_ids] = -1.0
        self.w.start_load_kv(None)
        sync_invalid = set()
        for spec in meta.loads:
            if spec.is_async:
                self.pending[spec.req_id] = spec
        # The fake forward: KV for every scheduled token (schedule() already advanced
        # num_computed_tokens past them).
        for rid, n in so.num_scheduled_tokens.items():
            req = self.s.requests[rid]
            ids = self.s.kv_cache_manager.get_block_ids(rid)[0]
            toks = req.all_token_ids
            for p in range(req.num_computed_tokens - n, req.num_computed_tokens):
                val = kv_value(toks[p], p)
                for li, name in enumerate(LAYERS):
                    self.kv[name][:, ids[p // BS], p % BS] = val[:, li]
        self.saved_chunks += sum(len(s.keys) for s in meta.saves)
        self.w.wait_for_save()
        sending, recving = self.w.get_finished(set(so.finished_req_ids))
        invalid = self.w.get_block_ids_with_load_errors()
        sync_invalid |= invalid
        self.invalid_total |= invalid
        for spec in meta.loads:
            if not spec.is_async:
                self.verify(spec, sync_invalid)
        for rid in recving or ():
            self.verify(self.pending.pop(rid), invalid)
        self.w.clear_connector_metadata()
        req_ids = list(so.num_scheduled_tokens)
        out: list[list[int]] = []
        for rid in req_ids:
            req = self.s.requests.get(rid)
            done = req is not None and req.num_computed_tokens >= req.num_tokens
            out.append(sampled(rid, req.num_tokens, 1) if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=out, logprobs=None, prompt_logprobs_dict={},
            pooler_output=None,
            kv_connector_output=KVConnectorOutput(
                finished_sending=sending, finished_recving=recving,
                invalid_block_ids=invalid))


def drive(scheduler: Any, runner: Any, hasher: Any, workload: list[dict[str, Any]],
          max_steps: int = 2000) -> dict[str, Any]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    arrivals: dict[int, list[dict[str, Any]]] = {}
    for w in workload:
        arrivals.setdefault(w["arrival"], []).append(w)
    finished: list[str] = []
    last_arrival = max(arrivals)
    bp = scheduler.kv_cache_manager.block_pool
    step = 0
    for step in range(max_steps):
        for w in arrivals.get(step, []):
            sp = SamplingParams(max_tokens=w["max_tokens"], ignore_eos=True)
            scheduler.add_request(Request(request_id=w["id"], prompt_token_ids=w["prompt"],
                                          sampling_params=sp, pooling_params=None,
                                          block_hasher=hasher, cache_salt=w.get("salt")))
        if step > last_arrival and not scheduler.has_requests() and not runner.pending \
                and bp.get_num_free_blocks() == bp.num_gpu_blocks - 1:
            break
        so = scheduler.schedule()
        if not so.total_num_scheduled_tokens:
            time.sleep(0.005)  # an idle engine polls its transfers; stores take real time
        out = scheduler.update_from_output(so, runner.step(so))
        for outs in out.values():
            finished += [o.request_id for o in outs.outputs if o.finish_reason is not None]
    return {"finished": sorted(finished), "steps": step, "loads": runner.loads,
            "free_blocks": bp.get_num_free_blocks(), "num_blocks": bp.num_gpu_blocks,
            "invalid_blocks": len(runner.invalid_total), "preempted": sorted(runner.preempted),
            "saved_chunks": runner.saved_chunks}


def prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + i * 131) % 900 + 100 for i in range(n)]


def evicting_workload(bad_salt: bool = False) -> list[dict[str, Any]]:
    """``a`` stores a 5-block prefix; fillers push it out of the device pool; ``b`` shares
    that prefix (plus a new tail) and must load it from the tiers. ``bad_salt``: plus ``x``,
    whose cache_salt is no valid tenant name (served without offload)."""
    shared = prompt(1, 80)
    wl = [{"id": "a", "prompt": shared, "arrival": 0, "max_tokens": 2}]
    wl += [{"id": f"f{i}", "prompt": prompt(10 + i, 100), "arrival": 8 + 3 * i,
            "max_tokens": 2} for i in range(4)]
    wl.append({"id": "b", "prompt": shared + prompt(99, 20), "arrival": 40, "max_tokens": 3})
    if bad_salt:
        wl.append({"id": "x", "prompt": prompt(77, 40), "arrival": 1, "max_tokens": 2,
                   "salt": "not a tenant!"})
    return wl


def sampled(rid: str, prompt_len: int, max_tokens: int) -> list[int]:
    """The tokens Runner.step samples for a request (a function of id and length)."""
    return [zlib.crc32(f"{rid}:{prompt_len + i}".encode()) % 900 + 10
            for i in range(max_tokens)]


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


def scenario(name: str, workdir: str, redis_url: str | None) -> dict[str, Any]:
    if name == "native":
        return native_scenario(workdir)
    disk = name != "redis"
    scen_dir = os.path.join(workdir, name)
    os.makedirs(scen_dir)
    # "dead": every tier call fails (a dead backend): lookups miss, stores fail.
    faults = {"rate": 1.0, "kinds": ["error"]} if name == "dead" else None
    config_file = write_config(scen_dir, disk=disk,
                               remote_url=redis_url if name == "redis" else None,
                               faults=faults)
    num_blocks = 12 if name in ("preempt", "multiturn") else 24
    scheduler, runner = engine(workdir, config_file, num_blocks, async_loads=name == "async")
    conn, worker = scheduler.get_kv_connector(), runner.w
    if name == "corrupt":
        def corrupt(spec: Any) -> None:
            # Damage the third stored chunk of b's prefix after the lookup found it.
            if spec.req_id == "b":
                rt = worker._rt
                rt.loop.call(rt.connector.write_raw(spec.keys[2], b"garbage" * 20,
                                                    timeout=5))
        runner.before_load = corrupt
    if name == "multiturn":
        wl = multiturn_workload()
    elif name == "preempt":
        wl = [{"id": f"p{i}", "prompt": prompt(50 + i, 64), "arrival": 0, "max_tokens": 60}
              for i in range(2)]
    else:
        wl = evicting_workload(bad_salt=name == "disk")
    try:
        result = drive(scheduler, runner, runner.hasher, wl)
    finally:
        worker.shutdown()
        conn.shutdown()
    result["scenario"] = name
    result["connector"] = type(conn).__name__
    return result


def engine(workdir: str, config_file: str, num_blocks: int, async_loads: bool = False
           ) -> tuple[Any, Runner]:
    """vLLM's Scheduler (its connector built by vLLM's factory) and a runner with the
    connector's worker side."""
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvplugin.integrations.vllm import KVPluginConnector

    scheduler, hasher, vllm_config, kvc = build(workdir, config_file, num_blocks, async_loads)
    worker = KVPluginConnector(vllm_config, KVConnectorRole.WORKER, kvc)
    runner = Runner(scheduler, worker, num_blocks)
    runner.hasher = hasher
    return scheduler, runner


def run_vllm(workdir: str, config_file: str, workload: list[dict[str, Any]]
             ) -> dict[str, Any]:
    scheduler, runner = engine(workdir, config_file, 24)
    try:
        return drive(scheduler, runner, runner.hasher, workload)
    finally:
        runner.w.shutdown()
        scheduler.get_kv_connector().shutdown()  # the disk tier's lock is released here


def expected_pages(tokens: list[int], first: int, n: int) -> torch.Tensor:
    """kvplugin's page format of ``n`` blocks from token ``first``: (block, K/V, layer,
    slot, head, dim)."""
    pages = []
    for b in range(n):
        start = first + b * BS
        slots = torch.stack([kv_value(tokens[p], p) for p in range(start, start + BS)])
        pages.append(slots.permute(1, 2, 0, 3, 4))
    return torch.stack(pages)


async def native_load(config_file: str, tokens: list[int], tenant: str) -> dict[str, Any]:
    """The native async manager looks ``tokens`` up and loads what the tiers hold."""
    import numpy as np

    from kvplugin.plugin import load_plugin

    async with load_plugin(config_file) as plugin:
        mgr = plugin.manager
        req = mgr.new_request("n-load", tokens, tenant=tenant)
        found = await mgr.lookup(req)
        adm = mgr.allocate(req, found)
        assert adm is not None
        outcome = await mgr.wait_load(req) if adm.loading else None
        n = adm.external_tokens // BS
        ids = mgr.core.get_block_ids(req.request_id)[0][:n]
        equal = False
        if n:
            rows = np.array(mgr.memory.pages(0, ids)).view(np.float32)
            got = torch.from_numpy(rows.copy()).reshape(n, 2, len(LAYERS), BS, HEADS, HEAD)
            equal = torch.equal(got, expected_pages(tokens, 0, n))
        mgr.finish(req)
        await mgr.drain()
        return {"external_tokens": adm.external_tokens,
                "loaded_tokens": outcome.loaded_tokens if outcome else 0, "equal": equal}


async def native_store(config_file: str, tokens: list[int], tenant: str) -> int:
    """The native async manager computes ``tokens`` (the same fake KV) and stores them."""
    from kvplugin.plugin import load_plugin

    async with load_plugin(config_file) as plugin:
        mgr = plugin.manager
        req = mgr.new_request("n-store", tokens, tenant=tenant)
        adm = mgr.allocate(req, await mgr.lookup(req))
        assert adm is not None and adm.num_new_tokens == len(tokens)
        n = len(tokens) // BS
        ids = mgr.core.get_block_ids(req.request_id)[0][:n]
        pages = expected_pages(tokens, 0, n).contiguous()
        mgr.memory.copy_in(0, ids, pages.view(torch.uint8).numpy().tobytes())
        req.num_computed_tokens = len(tokens)
        mgr.after_step([req])
        mgr.finish(req)
        await mgr.drain()
        return mgr.stats().stores


def native_scenario(workdir: str) -> dict[str, Any]:
    """Same tier, same keys: vLLM stores and the native manager loads, and the reverse."""
    import asyncio

    scen_dir = os.path.join(workdir, "native")
    os.makedirs(scen_dir)
    config_file = write_config(scen_dir, disk=True, remote_url=None)
    salt = "tenant=acme"  # what the native manager salts tenant acme's requests with
    shared = prompt(1, 80)
    stored = run_vllm(workdir, config_file, [
        {"id": "a", "prompt": shared, "arrival": 0, "max_tokens": 2, "salt": salt}])
    native = asyncio.run(native_load(config_file, shared + prompt(98, 20), "acme"))
    other = asyncio.run(native_load(config_file, shared + prompt(98, 20), "other"))
    theirs = prompt(2, 96)
    stores = asyncio.run(native_store(config_file, theirs, "acme"))
    loaded = run_vllm(workdir, config_file, [
        {"id": "c", "prompt": theirs + prompt(97, 10), "arrival": 0, "max_tokens": 2,
         "salt": salt}])
    return {"scenario": "native", "vllm_stored_chunks": stored["saved_chunks"],
            "native_load": native, "other_tenant_load": other, "native_stores": stores,
            "vllm_loads": loaded["loads"], "vllm_free_blocks": loaded["free_blocks"],
            "num_blocks": loaded["num_blocks"]}


def main(argv: list[str]) -> int:
    from connectors.faults import LocalRedisServer

    with tempfile.TemporaryDirectory(prefix="kvplugin-vllm-") as workdir:
        server = None
        if "redis" in argv:
            server = LocalRedisServer(os.path.join(workdir, "redis-server"))
            server.start()
        try:
            for name in argv:
                url = server.url if server is not None else None
                print(json.dumps(scenario(name, workdir, url)), flush=True)
        finally:
            if server is not None:
                server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
