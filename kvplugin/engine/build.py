"""The reference engine's deployment: the plugin (core, tiers, manager: built by
:mod:`kvplugin.plugin`, the same code path an engine's startup takes), the fake model and
the scheduler; and closing them again (the temporary disk tier included)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.config import ConfigError, KVPluginConfig, Loc
from kvplugin.connectors.base import Connector
from kvplugin.connectors.faults import FaultInjector
from kvplugin.costs import ModelCost
from kvplugin.engine.clock import RealClock, SimClock
from kvplugin.engine.config import RunConfig
from kvplugin.engine.model import FakeModel, StepCosts
from kvplugin.engine.scheduler import Engine, SchedulerLimits
from kvplugin.layouts import engine_supports
from kvplugin.plugin import (
    TierWrapper,
    build_connector,
    build_tiers,
    deployment_cost,
    fault_plan,
    fault_wrapper,
    load_plugin,
    offload_config,
)

__all__ = [
    "Deployment",
    "TierWrapper",
    "build_connector",
    "build_tiers",
    "check_workload",
    "deployment",
    "fault_plan",
    "fault_wrapper",
    "limits_of",
    "offload_config",
    "workload_problems",
    "workload_tenancy",
]


def limits_of(cfg: KVPluginConfig) -> SchedulerLimits:
    """The engine section's limits, falling back to the limits section's."""
    e, lim = cfg.engine, cfg.limits
    return SchedulerLimits(
        max_num_batched_tokens=e.max_num_batched_tokens or lim.max_num_batched_tokens,
        max_num_seqs=e.max_num_seqs or lim.max_num_seqs,
        long_prefill_token_threshold=lim.long_prefill_token_threshold)


def workload_problems(cfg: RunConfig) -> list[tuple[Loc, str]]:
    """What keeps the reference engine's workload (``kvplugin run``) from serving this
    deployment's tenancy; nothing an engine loading the plugin cares about. Its requests
    belong to the declared tenants (else ``tenant0`` ..), and a group member's requests
    declare the whole system prompt shared."""
    problems: list[tuple[Loc, str]] = []
    t, w = cfg.tenants, cfg.workload
    names = list(t.declared) if t.declared is not None else [
        f"tenant{i}" for i in range(w.num_tenants)]
    if t.declared is not None and w.num_tenants != len(t.declared):
        problems.append((("workload", "num_tenants"), (
            f"the workload serves the {len(t.declared)} declared tenants; num_tenants "
            f"{w.num_tenants} disagrees (leave it out)")))
    hi = w.system_prompt_len[1]
    for i, g in enumerate(t.prefix_groups):
        strangers = [m for m in g.tenants if m not in names]
        if strangers:
            problems.append((("tenants", "prefix_groups", i, "tenants"), (
                f"{strangers} are not the workload's tenants {names}: declare the tenants, "
                f"or name workload tenants")))
        if g.max_prefix_tokens < hi:
            problems.append((("tenants", "prefix_groups", i, "max_prefix_tokens"), (
                f"{g.max_prefix_tokens} is below workload.system_prompt_len's upper bound "
                f"{hi}: the workload declares whole system prompts shared")))
    return problems


def check_workload(cfg: RunConfig, source: str = "<config>") -> None:
    """ConfigError when the reference engine's workload cannot serve ``cfg``
    (:func:`workload_problems`)."""
    problems = workload_problems(cfg)
    if problems:
        raise ConfigError("\n".join([f"{source}: the workload (kvplugin run) cannot serve this "
                                     "configuration", *(f"  {'.'.join(map(str, loc))}: {why}"
                                                        for loc, why in problems)]))


def workload_tenancy(cfg: RunConfig) -> tuple[list[str] | None, dict[str, list[str]]]:
    """Whom the workload's requests belong to: the declared tenant names (None when the
    config declares none: the workload names its own), and each prefix group's members.
    ConfigError when the workload cannot serve them (:func:`check_workload`: e.g. a group's
    max_prefix_tokens below the system prompts it would share)."""
    check_workload(cfg)
    t = cfg.tenants
    names = None if t.declared is None else list(t.declared)
    return names, {g.name: list(g.tenants) for g in t.prefix_groups}


@dataclass(slots=True)
class Deployment:
    mgr: AsyncKVManager
    model: FakeModel
    engine: Engine
    connector: Connector | None  # None: offload off
    injectors: list[FaultInjector] = field(default_factory=list)  # the faults section's

    @property
    def manager(self) -> AsyncKVManager:
        """``mgr`` by the name the plugin has it (what :mod:`kvplugin.metrics` reads)."""
        return self.mgr

    @property
    def tier_labels(self) -> list[str]:
        return list(self.mgr.tiers)

    def faults_injected(self) -> dict[str, int]:
        """What the fault drill injected so far, summed over the tiers."""
        out = {"errors": 0, "delays": 0, "dropped": 0, "corrupted": 0}
        for inj in self.injectors:
            for k in out:
                out[k] += getattr(inj.injected, k)
        return out


@contextlib.asynccontextmanager
async def deployment(cfg: RunConfig, *, wrap_tiers: TierWrapper | None = None
                     ) -> AsyncIterator[Deployment]:
    """The engine and everything under it; on exit the engine's tasks are stopped, then the
    plugin closes (the manager's jobs cancelled and awaited, the tiers closed, a temporary
    disk directory removed). With a ``faults`` drill each tier is wrapped in its injector
    first, then in ``wrap_tiers``."""
    reason = engine_supports(cfg.layout, cfg.model)
    if reason is not None:
        raise ValueError(reason)
    async with load_plugin(cfg, wrap_tiers=wrap_tiers) as plugin:
        mgr = plugin.manager
        e = cfg.engine
        clock = SimClock() if e.deterministic else RealClock()
        costs: StepCosts | ModelCost = (
            deployment_cost(cfg) or StepCosts(e.prefill_token_ms / 1000,
                                              e.decode_step_ms / 1000))
        model = FakeModel(mgr.memory, costs, cfg.workload.vocab, clock)
        engine = Engine(mgr, model, limits_of(cfg), clock)
        publisher = None
        if e.kv_events_endpoint is not None:
            from kvplugin.publisher import ZmqEventPublisher

            publisher = ZmqEventPublisher(e.kv_events_endpoint)
            engine.event_sinks.append(publisher.publish)
        try:
            yield Deployment(mgr, model, engine, plugin.connector, plugin.injectors)
        finally:
            try:
                await engine.aclose()
            finally:
                if publisher is not None:
                    publisher.close()
