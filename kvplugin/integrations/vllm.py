"""kvplugin as a vLLM 0.33 KV connector: offload and reuse KV through kvplugin's tiers.

Loaded by vLLM's own factory::

    kv_transfer_config = {"kv_connector": "KVPluginConnector",
                          "kv_connector_module_path": "kvplugin.integrations.vllm",
                          "kv_role": "kv_both",
                          "kv_connector_extra_config": {"config_file": "configs/vllm_disk.yaml"}}

The deployment config's ``offload`` section builds the tiers (memory / disk / Redis / extra
connectors, as :mod:`kvplugin.plugin` does) and its ``model.name`` and ``offload.chunk_size``
name the keys, so a block stored through vLLM has the key the native manager gives it for
the same model, layout and tenant. The tenant is ``kv_transfer_params["tenant"]``, else the
request's ``cache_salt``, else ``kv_connector_extra_config["default_tenant"]`` ("default").

Layouts: any mix of full-attention, MLA, sliding-window, chunked local and Mamba "align"
groups (at least one attention group), on the KV tensors vLLM allocates in any
``KVCacheLayout`` (:mod:`._groups` reads the layout from each tensor's strides). A hit is
claimed only where every group can be restored (the native manager's
:func:`kvplugin.aio.plans.reconcile`): attention chunks up to it, a window group only the
window before it, a Mamba group the state stored at exactly that boundary. Stores: each
group's completed chunks (a window group's blocks vLLM still holds), the Mamba boundary
states vLLM hands over each step (``kv_connector_block_state``) and the finish-time partial
tails (``register_finished_partial_tail``). Divergent local hybrid hits
(``supports_divergent_local_hybrid_hits``): vLLM may offer the attention groups' deeper
device hit; a claim from it restores the lagging Mamba state at its end (docs/vllm.md).

Scheduler side: a prefix lookup asked of the worker that owns the tiers (:mod:`._lookup`:
vLLM runs the roles in separate processes), bounded by ``offload.lookup_timeout_ms`` (a
slow or dead tier is a miss, never a stall); loads and stores planned per step into the
metadata; a finished request's blocks are freed at once (its stores were copied out at
their steps; a partial tail registered at finish holds them one step, ``delay_free``, until
it is copied). Worker side: the tiers, on an event loop on its own thread;
pages move between vLLM's tensors and kvplugin's layout-free page format in one gather /
scatter per group. A load that misses or fails verification is a miss vLLM recomputes
(the connector sets ``kv_load_failure_policy`` to "recompute"): with one full-attention
group its blocks are reported through ``get_block_ids_with_load_errors``; with several
groups (vLLM 0.33 rejects block ids, unique per group only) or a window / local group,
every load is asynchronous and a failed one is reported as a failed receive
(``get_transfer_results().failed_recving``). Counters go to vLLM's stats channel
(:mod:`._stats`); completed stores become ``BlockStored`` KV events (:mod:`._events`).

vLLM and torch are imported lazily: importing this module without them works, building the
connector raises an ImportError naming the ``vllm`` extra.
"""

from __future__ import annotations

import importlib
import logging
from typing import Any

from kvplugin.aio.memory import layout_of
from kvplugin.aio.offload_ledger import OffloadLedger, TierQuotas
from kvplugin.aio.plans import Layout
from kvplugin.config import KVPluginConfig
from kvplugin.integrations import _lookup, _runtime
from kvplugin.integrations._groups import GroupIO, group_ios, map_groups
from kvplugin.integrations._hits import Piece
from kvplugin.integrations._outcomes import KVPluginWorkerMeta
from kvplugin.integrations._runtime import refuse_unenforceable
from kvplugin.integrations._scheduler import (
    KVRole,
    LoadSpec,
    SaveSpec,
    SchedulerSide,
    StepPlan,
    tenant_of_salt,
)
from kvplugin.integrations._stats import KVPluginPromMetrics, KVPluginStats
from kvplugin.integrations._worker import WorkerSide, check_tiers
from kvplugin.plugin import offload_config

__all__ = ["KVPluginConnector", "KVPluginConnectorMetadata", "KVPluginWorkerMeta", "LoadSpec",
           "Piece", "SaveSpec", "refuse_unenforceable", "tenant_of_salt"]

logger = logging.getLogger(__name__)


def _import_vllm() -> tuple[Any, ImportError | None]:
    # By name, so neither importing this module nor type-checking kvplugin needs vLLM.
    try:
        return importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base"), None
    except ImportError as e:  # kvplugin never requires vLLM; only building the connector does
        return None, e


_base, _IMPORT_ERROR = _import_vllm()


class _Absent:
    """Stands in for vLLM's base classes when vLLM is not installed."""


KVConnectorBase_V1: Any = _Absent if _base is None else _base.KVConnectorBase_V1
KVConnectorMetadata: Any = _Absent if _base is None else _base.KVConnectorMetadata
SupportsHMA: Any = type("_AbsentHMA", (), {}) if _base is None else _base.SupportsHMA

_MISSING_VLLM = ("kvplugin.integrations.vllm needs vLLM 0.33 and torch: install the `vllm` "
                 "extra (pip install 'kvplugin[vllm]')")


class KVPluginConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the workers (:class:`~._scheduler.StepPlan`)."""

    def __init__(self, step: StepPlan | None = None) -> None:
        step = step if step is not None else StepPlan([], [], [])
        self.loads: list[LoadSpec] = step.loads
        self.saves: list[SaveSpec] = step.saves
        self.delayed_frees: list[str] = step.delayed_frees


class KVPluginConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM's KV connector API over kvplugin's tiers (see the module docstring): a façade
    over the scheduler half (:class:`~._scheduler.SchedulerSide`) or the worker half
    (:class:`~._worker.WorkerSide`), whichever role vLLM built it for."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _IMPORT_ERROR is not None:
            raise ImportError(_MISSING_VLLM) from _IMPORT_ERROR
        super().__init__(vllm_config, role, kv_cache_config)
        ktc = self._kv_transfer_config
        extra = dict(ktc.kv_connector_extra_config or {})
        config_file = extra.get("config_file")
        if not isinstance(config_file, str) or not config_file:
            raise ValueError("kv_connector_extra_config needs 'config_file': a kvplugin "
                             "deployment config (YAML / TOML / JSON)")
        if kv_cache_config is None:
            raise ValueError("KVPluginConnector needs vLLM's kv_cache_config")
        kv_role = KVRole.of(getattr(ktc, "kv_role", None))
        _adopt_vllm_logging()
        self._groups: list[GroupIO] = group_ios(kv_cache_config.kv_cache_groups)
        shapes = [g.shape for g in self._groups]
        block_size = vllm_config.cache_config.block_size
        hbs = getattr(kv_cache_config, "hash_block_size", None) or block_size
        config, timeouts = _runtime.settings(config_file)
        refuse_unenforceable(config)
        _load_failure_policy(ktc, extra, config)
        keys = _runtime.keyspace_for(config, shapes, hbs, block_size)
        _log_chunk_size(config, block_size, keys.groups[0].chunk_blocks)
        unit = getattr(kv_cache_config, "cache_hit_alignment_tokens", None) or hbs
        layout = layout_of(shapes, keys.groups[0].chunk_blocks, unit)
        # The worker owns the tiers and answers the scheduler's lookups (:mod:`._lookup`):
        # vLLM runs the two roles in different processes, and a tier has one owner.
        path = _lookup.socket_path(str(ktc.engine_id), int(getattr(
            vllm_config.parallel_config, "data_parallel_rank", 0) or 0), config_file)
        events_on = bool(getattr(vllm_config.kv_events_config, "enable_kv_cache_events",
                                 False))
        policy = config.tenants.policy()
        self._closed = False
        self._sched: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._server: _lookup.LookupServer | None = None
        self._rt: _runtime.Runtime | None = None
        if not _is_worker(role):
            self._sched = _scheduler_side(
                vllm_config, kv_cache_config, config, layout, keys, policy, extra, kv_role,
                _lookup.LookupClient(path, timeouts.lookup), events_on, self._groups)
            return
        rank0 = _tp_rank() == 0
        self._rt = _runtime.acquire(config_file, int(getattr(
            vllm_config.parallel_config, "world_size", 1) or 1))
        if self._rt.cpus:
            logger.info("KVPluginConnector: the tiers' loop and I/O threads run on CPUs %s "
                        "(offload.io_cpus %s)", sorted(self._rt.cpus),
                        config.offload.io_cpus)
        try:
            unhealthy = check_tiers(self._rt, config.offload.require_tiers)
            # Held bytes are counted on the scheduler only when a tenant has a tier quota;
            # one worker feeds it the tiers' events.
            feed = rank0 and TierQuotas.of_policy(policy).any()
            self._worker = WorkerSide(self._rt, self._groups, layout.chunk_blocks,
                                      events=events_on and config.offload.tier_events,
                                      feed=feed, unhealthy=unhealthy)
            if rank0:
                self._server = _lookup.LookupServer(path, self._rt, keys, layout).start()
        except BaseException:
            _runtime.release(self._rt)
            raise

    # ------------------------------------------------------------------ common
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._sched is not None:
            self._sched.close()
        if self._server is not None:
            self._server.close()
        if self._rt is not None:
            if not self.wait_for_stores():  # a tier that hangs must not hold shutdown
                logger.warning("kvplugin: shut down with stores still running after %.1f s; "
                               "their objects may be missing from the tiers",
                               self._rt.timeouts.store)
            _runtime.release(self._rt)

    @property
    def scheduler_side(self) -> SchedulerSide:
        if self._sched is None:
            raise RuntimeError("a scheduler call on a worker's KVPluginConnector")
        return self._sched

    @property
    def worker_side(self) -> WorkerSide:
        if self._worker is None:
            raise RuntimeError("a worker call on the scheduler's KVPluginConnector")
        return self._worker

    # --------------------------------------------------------------- scheduler
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self.scheduler_side.bind_kv_cache_manager(kv_cache_manager)

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """vLLM 0.33 then offers a hybrid request the full-attention groups' device hit
        even where a Mamba state behind it was evicted (``hit_diverged``): a claim from
        there loads the attention chunks beyond it and the state at its end, so the device
        blocks [reconciled, deep) are kept instead of loaded again, and a tier that lost
        some of them is no obstacle. A claim of 0 makes vLLM fall back to the reconciled
        hit without asking again; when a claim from *there* exists (the tiers' deepest
        state is at or before the deep hit), ``get_num_new_matched_tokens`` defers the
        request one step with this off, so the flag never costs a hit."""
        return self._sched is not None and self._sched.divergent_now

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVPluginConnectorMetadata:
        return KVPluginConnectorMetadata(self.scheduler_side.build_step(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        self.scheduler_side.update_connector_output(connector_output)

    def take_events(self) -> list[Any]:
        """``BlockStored`` of the objects every worker has stored (see :mod:`._events`)."""
        return self.scheduler_side.take_events()

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request), None

    def request_finished_all_groups(
            self, request: Any,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request), None

    def register_finished_partial_tail(self, request: Any, block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]
                                       ) -> bool:
        return self.scheduler_side.register_partial_tail(request, block_ids,
                                                         partial_tail_offloads)

    # ------------------------------------------------------------------ stats
    def get_kv_connector_stats(self) -> KVPluginStats | None:
        """The scheduler's: the ledger's per-tenant counts since the last call; a
        worker's: refused objects, withheld stores, tier errors (:mod:`._stats`)."""
        if self._sched is not None:
            return self._sched.stats()
        return self.worker_side.get_kv_connector_stats()

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVPluginStats:
        return KVPluginStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: Any, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> KVPluginPromMetrics:
        return KVPluginPromMetrics(vllm_config, metric_types, labelnames,
                                   per_engine_labelvalues)

    # ------------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        """Map every group's pages onto the tensors vLLM allocated (any KVCacheLayout);
        a layer that cannot be mapped fails the engine's start with the layer named."""
        self.worker_side.maps = map_groups(self._groups, kv_caches)

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        self.worker_side.start_load(self._get_connector_metadata())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # synchronous loads completed in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # pages are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        self.worker_side.wait_for_save(self._get_connector_metadata())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        return self.worker_side.get_finished()

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        return self.worker_side.get_transfer_results()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.get_block_ids_with_load_errors()

    def get_kv_connector_kv_cache_events(self) -> Any:
        return self.worker_side.get_kv_connector_kv_cache_events()

    def build_connector_worker_meta(self) -> KVPluginWorkerMeta | None:
        return self.worker_side.build_connector_worker_meta()

    def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Block until every store handed to the tiers so far has ended (see
        :meth:`~._worker.WorkerSide.wait_for_stores`)."""
        return self.worker_side.wait_for_stores(timeout)


def _scheduler_side(vllm_config: Any, kv_cache_config: Any, config: KVPluginConfig,
                    layout: Layout, keys: Any, policy: Any, extra: dict[str, Any], role: KVRole,
                    lookups: _lookup.LookupClient, events_on: bool,
                    groups: list[GroupIO]) -> SchedulerSide:
    """The scheduler half over a tracked offload ledger: the store budget, deduplication
    and tenant tier quotas of the native manager (its plans end when the workers say)."""
    oc = offload_config(config)
    ledger = OffloadLedger(layout, keys, page_bytes=[g.shape.page_bytes for g in groups],
                           tiers=config.offload.tier_kinds(),
                           store_budget_bytes=oc.store_budget_bytes,
                           store_prompt_only=config.offload.store_prompt_only,
                           quotas=TierQuotas.of_policy(policy),
                           # Built-in tiers report every object they store and drop: quotas
                           # count bytes held there.
                           reporting=config.offload.tier_kinds())
    # A failed load fails the whole request (vLLM recomputes it from 0) with several
    # groups (vLLM 0.33 raises on block ids, unique per group only) and with a
    # sliding-window or chunked local group (recomputing from the first bad block would
    # attend over the null blocks before the loaded window). That can only be reported
    # for an async load (failed_recving applies to requests waiting for remote KVs), so
    # such layouts load asynchronously.
    per_request = len(groups) > 1 or layout.has_null_blocks
    return SchedulerSide(
        ledger, lookups, policy=policy, default_tenant=str(extra.get("default_tenant",
                                                                     "default")),
        role=role, async_loads=per_request or bool(extra.get("async_loads", False)),
        per_request=per_request,
        # Divergent local hybrid hits: on only with a state group (vLLM ignores it
        # otherwise).
        divergent=bool(layout.state_groups) and bool(extra.get("divergent_hits", True)),
        events_on=events_on,
        spec_kinds=[_spec_kind(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups],
        num_workers=max(1, int(getattr(vllm_config.parallel_config, "world_size", 1))))


def _load_failure_policy(kv_transfer_config: Any, extra: dict[str, Any],
                         config: KVPluginConfig) -> None:
    """kvplugin's tiers are a cache: a missing or damaged object is a miss that vLLM
    recomputes, never a failed request. vLLM's default ``kv_load_failure_policy`` is
    "fail" (meant for disaggregated prefill, where the KV exists nowhere else); the
    Scheduler reads it right after building this connector, so it is set to "recompute"
    here unless the deployment asks for "fail" explicitly (the config's
    ``offload.load_failure_policy``, or the extra config's ``load_failure_policy``, which
    wins)."""
    wanted = str(extra.get("load_failure_policy", config.offload.load_failure_policy))
    if wanted not in ("recompute", "fail"):
        raise ValueError(f"kv_connector_extra_config load_failure_policy must be "
                         f"'recompute' or 'fail', got {wanted!r}")
    if getattr(kv_transfer_config, "kv_load_failure_policy", wanted) != wanted:
        logger.info("KVPluginConnector: kv_load_failure_policy %r -> %r (a tier miss is "
                    "recomputed)", kv_transfer_config.kv_load_failure_policy, wanted)
        kv_transfer_config.kv_load_failure_policy = wanted


def _adopt_vllm_logging() -> None:
    """kvplugin's lines in vLLM's log, in its format and at its level: vLLM configures its
    own ``vllm`` logger only, so an out-of-tree connector's INFO lines (the chunk size
    chosen at start) would be dropped. Left alone where the application configured
    logging itself (a handler on ``kvplugin`` or on the root logger)."""
    ours, theirs = logging.getLogger("kvplugin"), logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.level)
    ours.propagate = False


def _log_chunk_size(config: KVPluginConfig, block_size: int, chunk_blocks: int) -> None:
    how = config.offload.chunk_size or "auto"
    detail = (f" (auto: at least {config.offload.chunk_target_tokens} tokens)"
              if how == "auto" else "")
    logger.info("KVPluginConnector: stored objects of %d tokens, %d of vLLM's %d-token "
                "blocks%s", chunk_blocks * block_size, chunk_blocks, block_size, detail)


def _is_worker(role: Any) -> bool:
    return str(getattr(role, "name", role)).upper().endswith("WORKER")


def _tp_rank() -> int:
    """This worker's tensor-parallel rank (0 outside a distributed setup)."""
    try:
        ps = importlib.import_module("vllm.distributed.parallel_state")
        return int(ps.get_tensor_model_parallel_rank())
    except Exception:  # not initialised: one worker
        return 0


def _spec_kind(spec: Any) -> tuple[str | None, int | None]:
    """vLLM's kind name and sliding window of a group's spec, for its KV events."""
    try:
        iface = importlib.import_module("vllm.v1.kv_cache_interface")
        kind = iface.get_kv_cache_spec_kind(spec).value
    except (ImportError, AttributeError, ValueError):
        kind = None
    return kind, getattr(spec, "sliding_window", None)
