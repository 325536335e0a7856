"""Build the engine's parts from a deployment config: the core, the tiers, the manager, the
fake model and the scheduler; and close them again (the temporary disk tier included)."""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from connectors.base import Connector
from connectors.disk import DiskConnector
from connectors.faults import FaultInjector, FaultPlan
from connectors.memory import MemoryConnector
from connectors.tiered import TieredConnector
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import LoadFailurePolicy, OffloadConfig, StoreMode
from kvplugin.config import (
    GB,
    FaultsConfig,
    KVPluginConfig,
    OffloadConfigSection,
)
from kvplugin.engine.layouts import build_core, engine_supports, kv_cache_config
from kvplugin.engine.model import FakeModel, StepCosts
from kvplugin.engine.scheduler import Engine, SchedulerLimits

__all__ = [
    "TIER_LABELS",
    "Deployment",
    "build_connector",
    "deployment",
    "engine_supports",
    "fault_plan",
    "fault_wrapper",
    "kv_cache_config",
    "limits_of",
]

# Tier kinds (a connector's ``capabilities.tier``) as the run report names them.
TIER_LABELS = {"host": "memory", "disk": "disk", "remote": "redis"}

TierWrapper = Callable[[Connector], Connector]


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


def fault_plan(faults: FaultsConfig) -> FaultPlan:
    return FaultPlan(error_rate=faults.kind_rate("error"),
                     latency_rate=faults.kind_rate("latency"), latency=faults.latency_ms / 1000,
                     drop_write_rate=faults.kind_rate("drop"),
                     corrupt_write_rate=faults.kind_rate("corrupt"))


def fault_wrapper(faults: FaultsConfig, injectors: list[FaultInjector]) -> TierWrapper | None:
    """Wraps each tier in a FaultInjector (tier i seeded with ``seed + i``, so a drill
    repeats), appended to ``injectors``; None when the drill is off."""
    if not faults.rate:
        return None
    plan = fault_plan(faults)

    def wrap(tier: Connector) -> Connector:
        injectors.append(FaultInjector(tier, plan, seed=faults.seed + len(injectors)))
        return injectors[-1]

    return wrap


def _both(inner: TierWrapper | None, outer: TierWrapper | None) -> TierWrapper | None:
    if inner is None or outer is None:
        return inner or outer
    return lambda tier: outer(inner(tier))


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
    injectors: list[FaultInjector] = field(default_factory=list)  # the faults section's

    @property
    def tier_labels(self) -> list[str]:
        return [TIER_LABELS.get(t, t) for t in self.mgr.tiers]

    def faults_injected(self) -> dict[str, int]:
        """What the fault drill injected so far, summed over the tiers."""
        out = {"errors": 0, "delays": 0, "dropped": 0, "corrupted": 0}
        for inj in self.injectors:
            for k in out:
                out[k] += getattr(inj.injected, k)
        return out


@contextlib.asynccontextmanager
async def deployment(cfg: KVPluginConfig, *, wrap_tiers: TierWrapper | None = None
                     ) -> AsyncIterator[Deployment]:
    """The engine and everything under it; on exit the manager is closed (its jobs
    cancelled and awaited, the tiers closed) and a temporary disk directory removed.
    With a ``faults`` drill each tier is wrapped in its injector first, then in
    ``wrap_tiers``."""
    reason = engine_supports(cfg.layout, cfg.model)
    if reason is not None:
        raise ValueError(reason)
    tmp = None
    disk_root = cfg.offload.disk_path
    if cfg.offload.local_disk is not None and disk_root is None:
        tmp = disk_root = tempfile.mkdtemp(prefix="kvplugin-disk-")
    try:
        core, ctx = build_core(cfg.layout, cfg.model)
        injectors: list[FaultInjector] = []
        wrap = _both(fault_wrapper(cfg.faults, injectors), wrap_tiers)
        connector = build_connector(cfg.offload, disk_root, wrap)
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
                yield Deployment(mgr, model, engine, connector, injectors)
            finally:
                await engine.aclose()
        finally:
            await mgr.aclose()
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
