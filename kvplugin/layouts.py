"""A deployment's KV-cache layout from a config: one spec per configured group (full
attention, sliding window, chunked local, Mamba), the allocation core over them
(:func:`build_core`: what :mod:`kvplugin.plugin` builds, and ``kvplugin run``'s engine
through it), and whether the offload manager serves it.

The model section describes the attention page (per group); each configured kind builds its
spec in its :mod:`kvplugin.aio.group_kinds` entry (a Mamba group's state has the shape of a
Mamba-2 layer's, derived from the same numbers: a convolution state of
``(conv_width - 1, heads * head_size)`` in the model's dtype and an SSM state of
``(heads, head_size, d_state)`` in float32: real states mix dtypes, and the tiers must carry
them byte for byte).
"""

from __future__ import annotations

from kvplugin.aio import group_kinds
from kvplugin.aio.group_kinds import SpecParams
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import OffloadConfig
from kvplugin.config import GroupConfig, LayoutConfig, ModelConfig
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.hashing import HashContext
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.metrics import KVCacheMetricsCollector
from kvplugin.core.specs import (
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    resolve_kv_cache_block_sizes,
)

__all__ = ["build_core", "engine_supports", "group_spec", "kv_cache_config"]


def group_spec(g: GroupConfig, layout: LayoutConfig, model: ModelConfig) -> KVCacheSpec:
    """The core spec of a configured group, built by the group kind the config names
    (:func:`kvplugin.aio.group_kinds.spec_of_config`)."""
    params = SpecParams(
        block_size=g.block_size or layout.block_size, num_kv_heads=model.num_kv_heads,
        head_size=model.head_size, dtype=model.dtype, sliding_window=g.sliding_window,
        attention_chunk_size=g.attention_chunk_size,
        mamba_mode=g.mode or ("align" if layout.enable_caching else "none"),
        num_speculative_blocks=g.num_speculative_blocks or 0)
    return group_kinds.spec_of_config(g.kind, params)


def kv_cache_config(layout: LayoutConfig, model: ModelConfig) -> KVCacheConfig:
    groups = [KVCacheGroupSpec([f"g{i}.layer{j}" for j in range(model.num_layers)],
                               group_spec(g, layout, model), bool(g.is_eagle_group))
              for i, g in enumerate(layout.groups)]
    return KVCacheConfig(num_blocks=layout.num_blocks, kv_cache_groups=groups,
                         prefix_cache_retention_interval=layout.prefix_cache_retention_interval)


def build_core(layout: LayoutConfig, model: ModelConfig) -> tuple[KVCacheManager, HashContext]:
    kv = kv_cache_config(layout, model)
    sbs, hbs = resolve_kv_cache_block_sizes(kv, layout.block_size,
                                            prefix_match_unit=layout.prefix_match_unit,
                                            enable_caching=True, connector_enabled=True)
    kv.hash_block_size = hbs
    core = KVCacheManager(
        kv, max_model_len=layout.max_model_len, scheduler_block_size=sbs, hash_block_size=hbs,
        max_in_flight_tokens=layout.max_in_flight_tokens, use_eagle=layout.use_eagle,
        log_stats=layout.log_stats, enable_kv_cache_events=layout.enable_kv_cache_events,
        watermark=layout.watermark,
        enable_mamba_shared_prefix_checkpoint=layout.enable_mamba_shared_prefix_checkpoint,
        metrics_collector=(None if layout.metrics_collector_sample_rate is None else
                           KVCacheMetricsCollector(layout.metrics_collector_sample_rate)))
    return core, HashContext.create(layout.hash_fn, layout.none_hash_seed)


def engine_supports(layout: LayoutConfig, model: ModelConfig | None = None) -> str | None:
    """None when the engine can serve this layout with offload, else the offload manager's
    reason for refusing it (asked of a real manager over the layout, so the engine and the
    manager can never disagree)."""
    if not layout.enable_caching:
        return "offload needs prefix caching (layout.enable_caching)"
    try:
        core, ctx = build_core(layout, model or ModelConfig())
        AsyncKVManager(core, MemoryConnector(capacity_bytes=1 << 20),
                       OffloadConfig(model="probe", close_connector=False), hash_context=ctx)
    except (ValueError, TypeError) as e:
        return f"the offload manager rejects this layout: {e}"
    return None
