"""vLLM 0.33.0's real Scheduler on CPU, with a fake model runner, for the connector scenarios.

Layouts (``LAYOUTS``): ``full`` (one full-attention group), ``swa`` (full + a sliding
window) and ``mamba`` (full + Mamba "align", the Mamba block ``MAMBA_BS`` tokens, hits every
``BS`` tokens, so partial tails exist). The KVCacheConfig is built by hand, as vLLM's engine
would, with one KVCacheGroupSpec per group.

The fake forward writes, for every scheduled token, KV that depends only on (token, position,
group), and after each step the Mamba state of the computed prefix (a function of its
tokens) into the block vLLM's "align" mode keeps it in (slot ``ceil(n / MAMBA_BS) - 1``), so
a block or a state loaded for a prefix must equal what any request computed for it.
"""

from __future__ import annotations

import json
import math
import os
import tempfile
import zlib
from dataclasses import dataclass
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

BS = 16  # tokens per attention block (and per hash block)
MAMBA_BS = 64  # tokens per Mamba block
WINDOW = 32  # the sliding window
POISON = 0.5  # added to KV computed over a prefix that holds wrong bytes
HEADS, HEAD = 2, 4
LAYERS = ["layer0", "layer1"]  # the full-attention group's layers
SECOND = ["layer2", "layer3"]  # the second group's layers
STATE_SHAPES = ((3, HEADS * HEAD), (HEADS, HEAD, 8))  # the native engine's Mamba-2 shapes
STATE_BYTES = sum(math.prod(s) for s in STATE_SHAPES) * 4  # float32
# vLLM pads a hybrid model's Mamba page to the attention page (one page size: every
# KVCacheLayout can express it); the state comes first.
STATE_PAGE = 2 * BS * HEADS * HEAD * 4
# The physical layout vLLM allocates (``KVCacheLayout`` name) and the kernel block size
# (None: the manager's), from the environment, so one scenario runs on every layout.
KV_LAYOUT = os.environ.get("KVPLUGIN_TEST_KV_LAYOUT", "LBHNC")
KERNEL_BS = int(os.environ.get("KVPLUGIN_TEST_KERNEL_BLOCK", "0")) or None
MODEL = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
         "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
         "num_hidden_layers": 2, "vocab_size": 1024, "max_position_embeddings": 4096,
         "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "torch_dtype": "float16",
         "bos_token_id": 1, "eos_token_id": 2}
LAYOUTS = ("full", "swa", "mamba", "mla", "local")
LOCAL_CHUNK = 32  # chunked local attention's chunk (layout "local", Llama 4 style)


def kv_parts(layout: str) -> int:
    """K and V per token (2), or MLA's one latent (1)."""
    return 1 if layout == "mla" else 2


def heads_of(layout: str) -> int:
    return 1 if layout == "mla" else HEADS


def native_groups(layout: str) -> list[dict[str, Any]]:
    """The native config's groups for a layout (the same pages, so the same keys)."""
    groups: list[dict[str, Any]] = [{"kind": "mla" if layout == "mla" else "full"}]
    if layout == "swa":
        groups.append({"kind": "sliding_window", "sliding_window": WINDOW})
    elif layout == "local":
        groups.append({"kind": "chunked_local", "attention_chunk_size": LOCAL_CHUNK})
    elif layout == "mamba":
        groups.append({"kind": "mamba", "mode": "align", "block_size": MAMBA_BS})
    return groups


def write_config(workdir: str, *, disk: bool, remote_url: str | None,
                 faults: dict[str, Any] | None = None, layout: str = "full",
                 events: bool = False, disk_gb: float | None = None,
                 more: dict[str, Any] | None = None) -> str:
    """A deployment config; ``more``: sections merged in (``offload`` key by key)."""
    del events  # the connector follows vLLM's kv_events_config
    lay: dict[str, Any] = {
        # The native manager hashes as this vLLM does: sha256, NONE_HASH from PYTHONHASHSEED
        # when set (vLLM's rule), else the shared default seed.
        "block_size": BS, "num_blocks": 96, "groups": native_groups(layout),
        "hash_fn": "sha256", "none_hash_seed": os.environ.get("PYTHONHASHSEED")}
    if layout == "mamba":
        lay["prefix_match_unit"] = BS
    cfg: dict[str, Any] = {
        "layout": lay,
        "model": {"name": "kvplugin/vllm-test", "num_layers": len(LAYERS),
                  "num_kv_heads": HEADS, "head_size": HEAD, "dtype": "float32"},
        "offload": {"chunk_size": BS, "local_cpu": False,
                    "local_disk": os.path.join(workdir, "disk") if disk else None,
                    "remote_url": remote_url, "lookup_timeout_ms": 500,
                    "load_timeout_ms": 3000, "store_timeout_ms": 5000},
    }
    if disk_gb is not None:
        cfg["offload"]["max_local_disk_size"] = disk_gb
    if faults:
        cfg["faults"] = faults
    for section, value in (more or {}).items():
        if section == "offload":
            cfg["offload"].update(value)
        else:
            cfg[section] = value
    path = os.path.join(workdir, "kvplugin.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(cfg, f)
    return path


def kv_groups(layout: str) -> list[Any]:
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheGroupSpec,
        MambaSpec,
        MLAAttentionSpec,
        SlidingWindowSpec,
    )

    if layout == "mla":  # one latent of HEAD per token and layer
        return [KVCacheGroupSpec(list(LAYERS), MLAAttentionSpec(
            block_size=BS, num_kv_heads=1, head_size=HEAD, dtype=torch.float32))]
    full = FullAttentionSpec(block_size=BS, num_kv_heads=HEADS, head_size=HEAD,
                             dtype=torch.float32)
    groups = [KVCacheGroupSpec(list(LAYERS), full)]
    if layout == "swa":
        groups.append(KVCacheGroupSpec(list(SECOND), SlidingWindowSpec(
            block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
            sliding_window=WINDOW)))
    elif layout == "local":
        groups.append(KVCacheGroupSpec(list(SECOND), ChunkedLocalAttentionSpec(
            block_size=BS, num_kv_heads=HEADS, head_size=HEAD, dtype=torch.float32,
            attention_chunk_size=LOCAL_CHUNK)))
    elif layout == "mamba":
        groups.append(KVCacheGroupSpec(list(SECOND), MambaSpec(
            block_size=MAMBA_BS, shapes=STATE_SHAPES, dtypes=(torch.float32, torch.float32),
            page_size_padded=STATE_PAGE, mamba_cache_mode="align")))
    return groups


def build(workdir: str, config_file: str, num_blocks: int, async_loads: bool,
          layout: str = "full", events: bool = False, connector: bool = True,
          divergent: bool = True, kv_role: str = "kv_both") -> Any:
    """vLLM's Scheduler with the connector loaded through its factory (``connector``
    False: no KV connector at all, vLLM alone; ``divergent`` False: the connector does
    not take divergent local hybrid hits), the block hasher, the config and the
    KVCacheConfig."""
    from vllm.config import (
        CacheConfig,
        DeviceConfig,
        KVEventsConfig,
        KVTransferConfig,
        ModelConfig,
        SchedulerConfig,
        VllmConfig,
    )
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.core.kv_cache_utils import (
        get_request_block_hasher,
        init_none_hash,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    model_dir = os.path.join(workdir, "tiny_llama")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(MODEL, f)
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="float16",
                               seed=42, max_model_len=1024)
    cache = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, cache_dtype="auto",
                        enable_prefix_caching=True,
                        mamba_cache_mode="align" if layout == "mamba" else "none")
    cache.kv_cache_layout = KV_LAYOUT
    extra = {"config_file": config_file, "async_loads": async_loads,
             "divergent_hits": divergent}
    vllm_config = VllmConfig(
        scheduler_config=SchedulerConfig(
            max_num_seqs=8, max_num_batched_tokens=64, max_model_len=1024,
            enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=False),
        model_config=model_config, cache_config=cache, device_config=DeviceConfig("cpu"),
        kv_transfer_config=KVTransferConfig(
            kv_connector="KVPluginConnector",
            kv_connector_module_path="kvplugin.integrations.vllm", kv_role=kv_role,
            kv_connector_extra_config=extra, kv_load_failure_policy="recompute")
        if connector else None,
        kv_events_config=KVEventsConfig(enable_kv_cache_events=True, publisher="null")
        if events else None)
    # The KV cache's placement as the engine plans it (vLLM's own planner: per-layer
    # KVCacheTensors with the layout's strides, groups overlaid in one allocation).
    vllm_config.cache_config.num_gpu_blocks_override = num_blocks
    kvc = get_kv_cache_config_from_groups(vllm_config, kv_groups(layout), 1 << 30)
    assert kvc.num_blocks == num_blocks
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


# ---------------------------------------------------------------------------- fake KV
def kv_value(token: int, pos: int, group: int = 0) -> torch.Tensor:
    """The fake KV of one token in one attention group: (K/V, layer, head, dim), from
    (token, position, group) only."""
    base = float(token * 4096 + pos)
    idx = torch.arange(2 * len(LAYERS) * HEADS * HEAD, dtype=torch.float32)
    val = (base + idx / 64).reshape(2, len(LAYERS), HEADS, HEAD)
    return -val if group else val


def state_value(tokens: list[int]) -> torch.Tensor:
    """The fake Mamba state after ``tokens``: (layer, STATE_BYTES) bytes."""
    digest = zlib.crc32(json.dumps(tokens).encode()) % 100_003
    n = STATE_BYTES // 4
    layers = [torch.arange(n, dtype=torch.float32) + digest + 0.25 * li
              for li in range(len(SECOND))]
    return torch.stack(layers).view(torch.uint8)


def group_value(token: int, pos: int, group: int, layout: str) -> torch.Tensor:
    """:func:`kv_value` as the layout's group holds it: MLA keeps the first head's K as
    its latent (1, layer, 1, dim)."""
    val = kv_value(token, pos, group)
    return val[:1, :, :1] if layout == "mla" else val


def expected_pages(tokens: list[int], first: int, n: int, group: int = 0,
                   layout: str = "full") -> torch.Tensor:
    """kvplugin's page format of ``n`` blocks from token ``first``: (block, K/V, layer,
    slot, head, dim)."""
    pages = []
    for b in range(n):
        start = first + b * BS
        slots = torch.stack([group_value(tokens[p], p, group, layout)
                             for p in range(start, start + BS)])
        pages.append(slots.permute(1, 2, 0, 3, 4))
    return torch.stack(pages)


def sampled(rid: str, prompt_len: int, max_tokens: int) -> list[int]:
    """The tokens Runner.step samples for a request (a function of id and length)."""
    return [zlib.crc32(f"{rid}:{prompt_len + i}".encode()) % 900 + 10
            for i in range(max_tokens)]


@dataclass
class LoadRecord:
    req: str
    first_token: int
    blocks: int  # full-attention blocks (the slice-1 count)
    pieces: int
    is_async: bool
    verified: int = 0
    mismatched: int = 0
    invalid: int = 0
    failed: bool = False
    groups: dict[int, int] | None = None  # blocks / states per group

    def as_dict(self) -> dict[str, Any]:
        out = {"req": self.req, "first_token": self.first_token, "blocks": self.blocks,
               "async": self.is_async, "verified": self.verified,
               "mismatched": self.mismatched, "invalid": self.invalid}
        if (self.groups and len(self.groups) > 1) or self.failed:
            out.update(pieces=self.pieces, failed=self.failed,
                       groups={str(g): n for g, n in sorted((self.groups or {}).items())})
        return out


class Runner:
    """EngineCore + model runner + the connector's worker side (``worker`` None: vLLM
    without a KV connector)."""

    def __init__(self, scheduler: Any, worker: Any, kvc: Any, layout: str) -> None:
        from vllm.v1.kv_cache_layout import KVCacheLayout
        from vllm.v1.worker.utils import allocate_kv_cache

        self.s = scheduler
        self.w = worker
        self.layout = layout
        # vLLM's own allocation: one backing buffer, a logical [B, H, N, C] view per layer
        # (C: K then V), in the physical order of KV_LAYOUT; kernel blocks of KERNEL_BS
        # tokens split each attention block when set.
        kernel = None
        if KERNEL_BS is not None:
            kernel = [MAMBA_BS if layout == "mamba" and g else KERNEL_BS
                      for g in range(len(kvc.kv_cache_groups))]
        self.kv = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout[KV_LAYOUT],
                                    kernel)
        if worker is not None:
            worker.register_kv_caches(self.kv)
        self.loads: list[LoadRecord] = []  # every load, with its verification
        self.pending: dict[str, Any] = {}  # async loads in flight: req_id -> spec
        self.invalid_total: set[int] = set()
        self.failed_total: set[str] = set()
        self.preempted: set[str] = set()
        self.saved_pieces: dict[int, int] = {}  # per group: chunks / states stored
        self.saved_objects: set[tuple[int, str]] = set()  # (group, key): distinct objects
        self.saved_by_req: dict[str, set[str]] = {}  # request -> key ids it stored
        self.after_step: Any = None  # hook(): called after each step's output
        self.computed: dict[str, int] = {}  # per request: tokens the forward computed
        self.states_checked = 0
        self.state_mismatches = 0
        self.steps = 0
        self.before_load: Any = None  # hook(spec): the test corrupts objects here
        self.worker_stats: dict[str, int] = {}  # the connector's counters, summed
        self.hasher: Any = None

    @property
    def saved_chunks(self) -> int:
        return self.saved_pieces.get(0, 0)

    def layers(self, group: int) -> list[str]:
        return LAYERS if group == 0 else SECOND

    def _blocks(self, name: str, bid: int) -> torch.Tensor:
        """Layer ``name``'s manager block ``bid``: its kernel blocks (attention) or its
        state page (Mamba), through vLLM's logical view."""
        t = self.kv[name]
        if t.dtype == torch.int8:
            return t[bid]
        r = BS // t.shape[2]
        return t[bid * r:(bid + 1) * r]

    def write_token(self, group: int, bid: int, slot: int, val: torch.Tensor) -> None:
        """Token slot ``slot`` of block ``bid``: K and V side by side in C, as vLLM's
        attention writes its cache."""
        for li, name in enumerate(self.layers(group)):
            t = self.kv[name]
            n = t.shape[2]
            row = t[bid * (BS // n) + slot // n, :, slot % n]
            for part in range(val.shape[0]):
                row[:, part * HEAD:(part + 1) * HEAD] = val[part, li]

    def block(self, group: int, bid: int) -> torch.Tensor:
        """(slot, K/V, layer, head, dim) of one attention block."""
        per_layer = []
        parts, heads = kv_parts(self.layout), heads_of(self.layout)
        for name in self.layers(group):
            kb = self._blocks(name, bid)  # [r, H, N, 2 * D]
            rows = kb.permute(0, 2, 1, 3).reshape(BS, heads, parts, HEAD)
            per_layer.append(rows.permute(0, 2, 1, 3))  # [slot, K/V, H, D]
        return torch.stack(per_layer, dim=2)

    def state(self, bid: int) -> torch.Tensor:
        """(layer, bytes) of one Mamba block."""
        return torch.stack([self._blocks(n, bid).reshape(-1)[:STATE_BYTES].view(torch.uint8)
                            for n in SECOND])

    def _fill(self, bid: int, value: float) -> None:
        for name, t in self.kv.items():
            self._blocks(name, bid)[...] = int(value) if t.dtype == torch.int8 else value

    def verify(self, spec: Any, invalid: set[int], failed: set[str]) -> None:
        req = self.s.requests.get(spec.req_id)
        tokens = list(req.all_token_ids) if req is not None else None
        rec = LoadRecord(spec.req_id, spec.first_token,
                         sum(len(p.block_ids) for p in spec.pieces), len(spec.pieces),
                         spec.is_async, failed=spec.req_id in failed, groups={})
        for piece in spec.pieces:
            assert rec.groups is not None
            rec.groups[piece.group] = rec.groups.get(piece.group, 0) + len(piece.block_ids)
            for j, bid in enumerate(piece.block_ids):
                if bid in invalid:
                    rec.invalid += 1
                    continue
                if tokens is None or rec.failed:
                    continue
                if piece.state:
                    ok = torch.equal(self.state(bid), state_value(tokens[:piece.first_token]))
                else:
                    start = piece.first_token + j * BS
                    want = torch.stack([group_value(tokens[p], p, piece.group, self.layout)
                                        for p in range(start, start + BS)])
                    ok = torch.equal(self.block(piece.group, bid), want)
                rec.verified += ok
                rec.mismatched += not ok
        self.loads.append(rec)

    def _forward(self, so: Any) -> None:
        """KV for every scheduled token (schedule() already advanced num_computed_tokens
        past them); the Mamba state read at the step's start (checked) and written at its
        end."""
        for rid, n in so.num_scheduled_tokens.items():
            req = self.s.requests[rid]
            table = self.s.kv_cache_manager.get_block_ids(rid)
            toks = req.all_token_ids
            end = req.num_computed_tokens
            start = end - n
            attn = [0, 1] if self.layout in ("swa", "local") else [0]
            # Attention reads the prefix: KV computed over a wrong prefix is wrong too (a
            # distinct value, so a store of it is caught where it is loaded).
            off = POISON if self.layout == "full" and not self._prefix_ok(
                toks, table[0], start) else 0.0
            for p in range(start, end):
                for g in attn:
                    self.write_token(g, table[g][p // BS], p % BS,
                                     group_value(toks[p], p, g, self.layout) + off)
            if self.layout == "mamba":
                if start > 0:
                    bid = table[1][-(start // -MAMBA_BS) - 1]
                    self.states_checked += 1
                    self.state_mismatches += not torch.equal(self.state(bid),
                                                             state_value(list(toks[:start])))
                bid = table[1][-(end // -MAMBA_BS) - 1]
                rows = state_value(list(toks[:end]))
                for li, name in enumerate(SECOND):
                    self._blocks(name, bid).reshape(-1)[:STATE_BYTES].view(torch.uint8)[:] = (
                        rows[li])

    def _prefix_ok(self, toks: Any, ids: list[int], start: int) -> bool:
        """Whether the full-attention blocks below ``start`` hold the prefix's KV."""
        for b in range(-(start // -BS)):
            n = min(BS, start - b * BS)
            want = torch.stack([group_value(toks[q], q, 0, self.layout)
                                for q in range(b * BS, b * BS + n)])
            if not torch.equal(self.block(0, ids[b])[:n], want):
                return False
        return True

    def settle_stores(self) -> None:
        """Every store handed to the tiers so far has ended: what a request arriving now
        finds in them is what the steps before it stored, on any machine's clock."""
        if self.w is not None:
            assert self.w.wait_for_stores(), "a store did not end within its timeout"

    def step(self, so: Any) -> Any:
        from vllm.v1.outputs import KVConnectorOutput

        self.steps += 1
        for rid, n in so.num_scheduled_tokens.items():
            self.computed[rid] = self.computed.get(rid, 0) + n
        self.preempted |= set(so.preempted_req_ids or ())
        if self.w is None:
            self._device_ops(so)
            self._forward(so)
            return self._output(so, None)
        meta = so.kv_connector_metadata
        self._device_ops(so)
        self.w.bind_connector_metadata(meta)
        for spec in meta.loads:
            if self.before_load is not None:
                self.before_load(spec)
            for piece in spec.pieces:  # device memory holds garbage until the load lands
                for bid in piece.block_ids:
                    self._fill(bid, -1.0)
        self.w.start_load_kv(None)
        for spec in meta.loads:
            if spec.is_async:
                self.pending[spec.req_id] = spec
        self._forward(so)
        for spec in meta.saves:
            for p in spec.pieces:
                self.saved_pieces[p.group] = self.saved_pieces.get(p.group, 0) + 1
                self.saved_objects.add((p.group, p.key.id))
                self.saved_by_req.setdefault(spec.req_id, set()).add(p.key.id)
        self.w.wait_for_save()
        res = self.w.get_transfer_results(set(so.finished_req_ids))
        invalid = self.w.get_block_ids_with_load_errors()
        events = self.w.get_kv_connector_kv_cache_events()
        stats = self.w.get_kv_connector_stats()
        for k, v in (stats.data if stats is not None else {}).items():
            self.worker_stats[k] = self.worker_stats.get(k, 0) + v
        worker_meta = self.w.build_connector_worker_meta()  # in vLLM's order: after stats
        self.invalid_total |= invalid
        self.failed_total |= res.failed_recving
        for spec in meta.loads:
            if not spec.is_async:
                self.verify(spec, invalid, set())
        for rid in res.finished_recving:
            self.verify(self.pending.pop(rid), invalid, res.failed_recving)
        self.w.clear_connector_metadata()
        return self._output(so, KVConnectorOutput(
            finished_sending=res.finished_sending or None,
            finished_recving=res.finished_recving or None,
            failed_recving=res.failed_recving, invalid_block_ids=invalid,
            kv_cache_events=events, kv_connector_worker_meta=worker_meta))

    def _device_ops(self, so: Any) -> None:
        """What the model runner does to the KV cache before the forward: zero new blocks,
        run the scheduler's copy-on-write."""
        for bid in so.new_block_ids_to_zero or ():
            self._fill(bid, 0.0)
        for copy in so.kv_cache_block_copies or ():
            for name in self.kv:
                self._blocks(name, copy.dst_block_id)[...] = self._blocks(
                    name, copy.src_block_id)

    def _output(self, so: Any, kv_output: Any) -> Any:
        from vllm.v1.outputs import ModelRunnerOutput

        req_ids = list(so.num_scheduled_tokens)
        out: list[list[int]] = []
        for rid in req_ids:
            req = self.s.requests.get(rid)
            done = req is not None and req.num_computed_tokens >= req.num_tokens
            out.append(sampled(rid, req.num_tokens, 1) if done else [])
        return ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={r: i for i, r in enumerate(req_ids)},
            sampled_token_ids=out, logprobs=None, prompt_logprobs_dict={},
            pooler_output=None, kv_connector_output=kv_output)
