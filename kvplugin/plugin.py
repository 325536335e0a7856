"""kvplugin as an engine loads it: a deployment config in, a ready manager out.

An engine's startup code::

    async with load_plugin("configs/tiered.yaml") as plugin:
        mgr = plugin.manager          # AsyncKVManager: lookup / allocate / after_step / finish
        ...serve...
    # closed: jobs cancelled and awaited, tiers closed, a temporary disk directory removed

``load_plugin`` reads and validates the config at once (a bad one raises
:class:`~kvplugin.config.ConfigError` before anything is built); entering builds the core,
the tiers (memory, disk, Redis, then ``offload.connectors`` through
:mod:`kvplugin.registry`, each wrapped in its fault injector when a drill is configured)
and the manager with the config's tenant policy. ``offload.enabled: false`` builds no tier
(``plugin.connector is None``): the manager serves device hits only. The reference
engine's :func:`kvplugin.engine.build.deployment` builds on this, so there is one way to
build a deployment.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping, Sequence

from kvplugin.aio.jobs import tier_names
from kvplugin.aio.loadcost import LoadCosts, rate
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import LoadFailurePolicy, OffloadConfig, StoreMode
from kvplugin.config import (
    CLUSTER_SCHEME,
    GB,
    ConfigError,
    FaultsConfig,
    KVPluginConfig,
    OffloadConfigSection,
    unresolved_remote_url,
)
from kvplugin.config import load_config as _load_config
from kvplugin.connectors.base import Connector
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.faults import FaultInjector, FaultPlan
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.costs import ModelCost, TierLink, model_cost
from kvplugin.layouts import build_core
from kvplugin.registry import RegistryError, create

__all__ = [
    "Plugin",
    "TierWrapper",
    "build_connector",
    "build_tiers",
    "fault_plan",
    "fault_wrapper",
    "load_plugin",
    "offload_config",
]

TierWrapper = Callable[[Connector], Connector]


def build_tiers(off: OffloadConfigSection, disk_root: str | None,
                wrap: TierWrapper | None = None) -> list[Connector]:
    """The configured tiers, fastest first (none when offload is off). ``wrap`` wraps each
    one (fault injection). Connectors acquire nothing before their first use, so a tier
    that fails to build leaves nothing to close behind it."""
    if not off.enabled:
        return []
    tiers: list[Connector] = []
    if off.local_disk is not None:
        if disk_root is None:
            raise ValueError("a disk tier needs a directory")
        tiers.append(DiskConnector(disk_root, capacity_bytes=int(off.max_local_disk_size * GB),
                                   io_threads=off.disk_io_threads,
                                   eviction=off.local_disk_eviction))
    if off.remote_url is not None:
        waiting = unresolved_remote_url(off.remote_url)
        if waiting is not None:
            raise ValueError(f"offload.remote_url is env:{waiting}, but the environment "
                             f"variable {waiting} is not set: set it to the Redis URL")
        tiers.append(_remote(off.remote_url))
    for i, spec in enumerate(off.connectors):
        try:
            tiers.append(create(spec.kind, spec.options))
        except RegistryError as e:
            raise ConfigError(f"offload.connectors.{i}: {e}") from None
    if off.local_cpu:  # built last: a reserved tier holds memory from construction on
        tiers.insert(0, MemoryConnector(capacity_bytes=int(off.max_local_cpu_size * GB),
                                        reserve=off.local_cpu_reserve,
                                        eviction=off.local_cpu_eviction))
    # Each tier is known by its configured name (reports, metrics, tenants' quotas, events):
    # built-ins by their kind, an extra one by its name, else its kind.
    for tier, name in zip(tiers, off.tier_names(), strict=True):
        tier.name = name or tier.capabilities.tier
    return [wrap(t) for t in tiers] if wrap is not None else tiers


def _remote(url: str) -> Connector:
    if url.startswith(CLUSTER_SCHEME):
        from kvplugin.connectors.redis_cluster import connector_from_url

        return connector_from_url(url)
    from kvplugin.connectors.redis import RedisConnector, RedisOptions

    return RedisConnector(RedisOptions(url=url))


def _combine(tiers: list[Connector]) -> Connector | None:
    if not tiers:
        return None
    return tiers[0] if len(tiers) == 1 else TieredConnector(tiers)


def build_connector(off: OffloadConfigSection, disk_root: str | None,
                    wrap: TierWrapper | None = None) -> Connector:
    """The configured tiers behind one TieredConnector when there are several."""
    conn = _combine(build_tiers(off, disk_root, wrap))
    if conn is None:
        raise ValueError("offload is off: no tier to build")
    return conn


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


def deployment_cost(cfg: KVPluginConfig) -> ModelCost | None:
    """``engine.model_cost`` with ``engine.tier_links`` over its tiers' figures; None when
    no model cost is set."""
    e = cfg.engine
    if e.model_cost is None:
        return None
    links: dict[str, TierLink] = {t: TierLink(link.gb_per_s * 1e9, link.latency_ms / 1000)
             for t, link in e.tier_links.items()}
    return model_cost(e.model_cost, links)


def load_costs_for(cfg: KVPluginConfig, tiers: Sequence[str]) -> LoadCosts | None:
    """Load or recompute by cost (``offload.cost_aware_loads``): the deployment's model
    (``engine.model_cost``: its recompute time, its tiers' bandwidth and latency), else a
    declared prefill rate (tiers' latency measured); None without a recompute time."""
    off = cfg.offload
    if not off.cost_aware_loads or not tiers:
        return None
    mc = deployment_cost(cfg)
    if mc is not None:
        # A simulated run decides from the deployment's figures alone (same seed, same run).
        return LoadCosts.seeded(
            tiers, mc.recompute_s, tier_s_per_token={t: mc.tier_s_per_token(t) for t in tiers},
            tier_latency_s={t: link.latency_s for t, link in mc.tiers.items()},
            measure=not cfg.engine.deterministic)
    if off.recompute_tokens_per_s is not None:
        return LoadCosts.seeded(tiers, rate(off.recompute_tokens_per_s), tier_s_per_token={},
                                tier_latency_s={})
    return None


def offload_config(cfg: KVPluginConfig) -> OffloadConfig:
    off = cfg.offload
    return OffloadConfig(
        model=cfg.model.name, chunk_blocks=cfg.chunk_tokens() // cfg.layout.block_size,
        lookup_timeout=off.lookup_timeout_ms / 1000, load_timeout=off.load_timeout_ms / 1000,
        store_timeout=off.store_timeout_ms / 1000, max_io=off.max_io,
        store_budget_bytes=int(off.store_budget_mb * (1 << 20)),
        store_mode=StoreMode(off.store_mode),
        load_failure_policy=LoadFailurePolicy(off.load_failure_policy),
        store_prompt_only=off.store_prompt_only,
        tier_events=off.tier_events and cfg.layout.enable_kv_cache_events)


class Plugin:
    """A loaded deployment: ``config`` now; ``manager`` and ``connector`` once opened
    (``async with``, or ``await plugin.open()`` ... ``await plugin.aclose()``)."""

    __slots__ = ("_connector", "_manager", "_state", "_tmp", "_wrap", "config", "injectors",
                 "source")

    def __init__(self, config: KVPluginConfig, *, source: str = "<config>",
                 wrap_tiers: TierWrapper | None = None) -> None:
        self.config = config
        self.source = source
        self.injectors: list[FaultInjector] = []  # the faults section's, once opened
        self._wrap = wrap_tiers
        self._manager: AsyncKVManager | None = None
        self._connector: Connector | None = None
        self._tmp: str | None = None
        self._state = "new"  # -> open -> closed

    def _opened(self) -> AsyncKVManager:
        if self._manager is None:
            raise RuntimeError(f"the plugin is {self._state}: open it first "
                               "(async with load_plugin(...) as plugin)")
        return self._manager

    @property
    def manager(self) -> AsyncKVManager:
        """The engine-facing manager (still readable after closing: its stats)."""
        return self._opened()

    @property
    def connector(self) -> Connector | None:
        """The tiers (a TieredConnector when several); None when offload is off."""
        self._opened()
        return self._connector

    @property
    def tier_labels(self) -> list[str]:
        """Each tier's name (``offload.tier_names()``: memory, disk, redis, then the extra
        tiers' names), fastest first."""
        return list(self.manager.tiers)

    async def open(self) -> Plugin:
        """Build the core, the tiers and the manager (once)."""
        if self._state != "new":
            raise RuntimeError(f"the plugin is already {self._state}")
        self._state = "opening"
        try:
            self._build()
        except BaseException:
            self._state = "closed"
            await self._cleanup()
            raise
        self._state = "open"
        return self

    def _build(self) -> None:
        cfg = self.config
        disk_root = cfg.offload.disk_path
        if cfg.offload.enabled and cfg.offload.local_disk is not None and disk_root is None:
            self._tmp = disk_root = tempfile.mkdtemp(prefix="kvplugin-disk-")
        elif disk_root is not None:
            os.makedirs(disk_root, exist_ok=True)
        core, ctx = build_core(cfg.layout, cfg.model)
        wrap = _both(fault_wrapper(cfg.faults, self.injectors), self._wrap)
        self._connector = _combine(build_tiers(cfg.offload, disk_root, wrap))
        try:
            policy = cfg.tenants.policy(tier_quotas=cfg.offload.enabled)
            costs = (None if self._connector is None
                     else load_costs_for(cfg, tier_names(self._connector)))
            self._manager = AsyncKVManager(core, self._connector, offload_config(cfg),
                                           hash_context=ctx, tenants=policy, load_costs=costs)
        except ValueError as e:
            # The manager refuses what the config alone cannot show: a layout offload does
            # not serve, a quota on a tier an extra connector does not have.
            raise ConfigError(f"{self.source}: the offload manager refuses this "
                              f"configuration: {e}") from None

    async def _cleanup(self) -> None:
        try:
            if self._manager is not None:
                await self._manager.aclose()  # cancels its jobs, closes the tiers
            elif self._connector is not None:
                await self._connector.aclose()  # the disk tier holds its directory's lock
        finally:
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None

    async def aclose(self) -> None:
        """Close the manager (its jobs cancelled and awaited, the tiers closed) and remove
        a temporary disk directory. Idempotent."""
        if self._state in ("closed", "new"):
            self._state = "closed"
            return
        self._state = "closed"
        await self._cleanup()

    async def __aenter__(self) -> Plugin:
        return self if self._state == "open" else await self.open()

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


def load_plugin(config: str | os.PathLike[str] | KVPluginConfig | None = None, *,
                env: Mapping[str, str] | None = None,
                wrap_tiers: TierWrapper | None = None) -> Plugin:
    """The plugin of a deployment config: a file (YAML / TOML / JSON), a validated
    :class:`KVPluginConfig`, or None (``KVPLUGIN_CONFIG_FILE``, else the embedded
    default). File configs take the environment's overrides (``env``: os.environ).
    ``wrap_tiers`` wraps each tier after its fault injector (tests)."""
    if isinstance(config, KVPluginConfig):
        return Plugin(config, wrap_tiers=wrap_tiers)
    cfg = _load_config(config, env)
    source = os.fspath(config) if config is not None else "the default config"
    return Plugin(cfg, source=source, wrap_tiers=wrap_tiers)
