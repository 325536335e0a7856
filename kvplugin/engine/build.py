"""Build the engine's parts from a deployment config: the core, the tiers, the manager, the
fake model and the scheduler; and close them again (the temporary disk tier included)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from connectors.base import Connector
from connectors.disk import DiskConnector
from connectors.memory import MemoryConnector
from connectors.tiered import TieredConnector
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import LoadFailurePolicy, OffloadConfig, StoreMode
from kvplugin.config import GB, KVPluginConfig, LayoutConfig, ModelConfig, OffloadConfigSection
from kvplugin.core.hashing import HashContext
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    resolve_kv_cache_block_sizes,
)
from kvplugin.engine.model import FakeModel, StepCosts
from kvplugin.engine.scheduler import Engine, SchedulerLimits

__all__ = [
    "TIER_LABELS",
    "Deployment",
    "build_connector",
    "deployment",
    "engine_supports",
    "kv_cache_config",
    "limits_of",
]

# Tier kinds (a connector's ``capabilities.tier``) as the run report names them.
TIER_LABELS = {"host": "memory", "disk": "disk", "remote": "redis"}

TierWrapper = Callable[[Connector], Connector]


def engine_supports(layout: LayoutConfig) -> str | None:
    """None when the engine can serve this layout with offload, else the reason."""
    if not layout.enable_caching:
        return "offload needs prefix caching (layout.enable_caching)"
    kinds = sorted({g.kind for g in layout.groups if g.kind != "full"})
    if kinds:
        return f"host KV memory for {', '.join(kinds)} groups is not supported yet"
    return None


def kv_cache_config(layout: LayoutConfig, model: ModelConfig) -> KVCacheConfig:
    groups = []
    for i, g in enumerate(layout.groups):
        spec = FullAttentionSpec(block_size=g.block_size or layout.block_size,
                                 num_kv_heads=model.num_kv_heads, head_size=model.head_size,
                                 dtype=model.dtype)
        names = [f"g{i}.layer{j}" for j in range(model.num_layers)]
        groups.append(KVCacheGroupSpec(names, spec, bool(g.is_eagle_group)))
    return KVCacheConfig(num_blocks=layout.num_blocks, kv_cache_groups=groups,
                         prefix_cache_retention_interval=layout.prefix_cache_retention_interval)


def build_core(layout: LayoutConfig, model: ModelConfig) -> tuple[KVCacheManager, HashContext]:
    kv = kv_cache_config(layout, model)
    sbs, hbs = resolve_kv_cache_block_sizes(kv, layout.block_size,
                                            prefix_match_unit=layout.prefix_match_unit,
                                            enable_caching=True, connector_enabled=True)
    kv.hash_block_size = hbs
    core = KVCacheManager(kv, max_model_len=layout.max_model_len, scheduler_block_size=sbs,
                          hash_block_size=hbs, max_in_flight_tokens=layout.max_in_flight_tokens,
                          use_eagle=layout.use_eagle, log_stats=layout.log_stats,
                          enable_kv_cache_events=layout.enable_kv_cache_events,
                          watermark=layout.watermark)
    return core, HashContext.create(layout.hash_fn, layout.none_hash_seed)


def build_connector(off: OffloadConfigSection, disk_root: str | None,
                    wrap: TierWrapper | None = None) -> Connector:
    """The configured tiers, fastest first, behind one TieredConnector when there are
    several. ``wrap`` wraps each tier (fault injection in tests)."""
    tiers: list[Connector] = []
    if off.local_cpu:
        tiers.append(MemoryConnector(capacity_bytes=int(off.max_local_cpu_size * GB)))
    if off.local_disk is not None:
        if disk_root is None:
            raise ValueError("a disk tier needs a directory")
        tiers.append(DiskConnector(disk_root, capacity_bytes=int(off.max_local_disk_size * GB)))
    if off.remote_url is not None:
        from connectors.redis import RedisConnector, RedisOptions

        tiers.append(RedisConnector(RedisOptions(url=off.remote_url)))
    if wrap is not None:
        tiers = [wrap(t) for t in tiers]
    return tiers[0] if len(tiers) == 1 else TieredConnector(tiers)


def offload_config(cfg: KVPluginConfig) -> OffloadConfig:
    off = cfg.offload
    return OffloadConfig(
        model=cfg.model.name, chunk_blocks=off.chunk_size // cfg.layout.block_size,
        lookup_timeout=off.lookup_timeout_ms / 1000, load_timeout=off.load_timeout_ms / 1000,
        store_timeout=off.store_timeout_ms / 1000, max_io=off.max_io,
        store_budget_bytes=int(off.store_budget_mb * (1 << 20)),
        store_mode=StoreMode(off.store_mode),
        load_failure_policy=LoadFailurePolicy(off.load_failure_policy),
        store_prompt_only=off.store_prompt_only)


def limits_of(cfg: KVPluginConfig) -> SchedulerLimits:
    """The engine section's limits, falling back to the limits section's."""
    e, lim = cfg.engine, cfg.limits
    return SchedulerLimits(
        max_num_batched_tokens=e.max_num_batched_tokens or lim.max_num_batched_tokens,
        max_num_seqs=e.max_num_seqs or lim.max_num_seqs,
        long_prefill_token_threshold=lim.long_prefill_token_threshold)


@dataclass(slots=True)
class Deployment:
    mgr: AsyncKVManager
    model: FakeModel
    engine: Engine
    connector: Connector

    @property
    def tier_labels(self) -> list[str]:
        return [TIER_LABELS.get(t, t) for t in self.mgr.tiers]


@contextlib.asynccontextmanager
async def deployment(cfg: KVPluginConfig, *, wrap_tiers: TierWrapper | None = None
                     ) -> AsyncIterator[Deployment]:
    """The engine and everything under it; on exit the manager is closed (its jobs
    cancelled and awaited, the tiers closed) and a temporary disk directory removed."""
    reason = engine_supports(cfg.layout)
    if reason is not None:
        raise ValueError(reason)
    tmp = None
    disk_root = cfg.offload.disk_path
    if cfg.offload.local_disk is not None and disk_root is None:
        tmp = disk_root = tempfile.mkdtemp(prefix="kvplugin-disk-")
    try:
        core, ctx = build_core(cfg.layout, cfg.model)
        connector = build_connector(cfg.offload, disk_root, wrap_tiers)
        try:
            mgr = AsyncKVManager(core, connector, offload_config(cfg), hash_context=ctx)
        except BaseException:
            await connector.aclose()  # the disk tier holds its directory's lock
            raise
        try:
            e = cfg.engine
            model = FakeModel(mgr.memory, StepCosts(e.prefill_token_ms / 1000,
                                                    e.decode_step_ms / 1000),
                              cfg.workload.vocab)
            engine = Engine(mgr, model, limits_of(cfg))
            try:
                yield Deployment(mgr, model, engine, connector)
            finally:
                await engine.aclose()
        finally:
            await mgr.aclose()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
