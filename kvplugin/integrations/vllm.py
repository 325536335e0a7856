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
metadata; a finished request that had stores keeps its blocks (``delay_free``) until the
worker reports its stores done. Worker side: the tiers, on an event loop on its own thread;
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

import collections
import importlib
import logging
from dataclasses import dataclass
from typing import Any

from kvplugin.aio import plans
from kvplugin.aio.memory import layout_of
from kvplugin.aio.offload_ledger import OffloadLedger, OffloadRequest, StorePlan
from kvplugin.integrations import _events, _lookup, _runtime
from kvplugin.integrations._groups import GroupIO, group_ios, map_groups, pages_in
from kvplugin.integrations._hits import Piece, claim_dropped, load_pieces, worth_reconciling
from kvplugin.integrations._stats import KVPluginPromMetrics, KVPluginStats
from kvplugin.integrations._worker import WorkerSide

__all__ = ["KVPluginConnector", "KVPluginConnectorMetadata", "LoadSpec", "Piece", "SaveSpec",
           "tenant_of_salt"]

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
_TENANT_SALT = "tenant="


@dataclass(slots=True)
class LoadSpec:
    """Load ``pieces`` for tokens ``[first_token, end_token)``. ``per_request``: a failure
    fails the whole request (several groups), else the blocks from the first bad one."""

    req_id: str
    pieces: list[Piece]
    is_async: bool
    first_token: int
    end_token: int
    per_request: bool = False
    broken: bool = False  # a piece has no block to land in: fails without fetching


@dataclass(slots=True)
class SaveSpec:
    """Store ``pieces`` (chunks first, then the states they make restorable). ``reads``:
    the blocks of this step's synchronous loads that the request's table holds (its own
    claim, or another request's it hit on the device): when one of them fails, this step
    computed the pieces from bytes that never arrived, and they are withheld."""

    req_id: str
    pieces: list[Piece]
    reads: tuple[int, ...] = ()


class KVPluginConnectorMetadata(KVConnectorMetadata):  # type: ignore[misc]
    """One step's work for the workers."""

    def __init__(self) -> None:
        self.loads: list[LoadSpec] = []
        self.saves: list[SaveSpec] = []
        self.delayed_frees: list[str] = []  # finished requests waiting for their stores


@dataclass(slots=True)
class _ReqState:
    """Scheduler-side bookkeeping of one live request."""

    request: Any
    tenant: str  # "" when the request's tenant is not a valid name: no offload
    offload: OffloadRequest | None  # the ledger's state of it (None: no offload)
    had_saves: bool = False
    loading: bool = False  # an async load not yet reported finished
    local_tokens: int = 0  # the device's hit at the last lookup
    async_hit: bool = False  # the last external hit was reported as an async load
    state_at: int | None = None  # the boundary of the claimed states
    stored_until: tuple[int, ...] = ()  # per group, where the tiers' chunks end (lookup)
    load_failed: bool = False  # never claim from the tiers again: vLLM recomputes
    settle: bool = False  # admitted without a load: the local hit is read at the step's end


class KVPluginConnector(WorkerSide, KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
    """vLLM's KV connector API over kvplugin's tiers (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        if _IMPORT_ERROR is not None:
            raise ImportError(_MISSING_VLLM) from _IMPORT_ERROR
        super().__init__(vllm_config, role, kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        config_file = extra.get("config_file")
        if not isinstance(config_file, str) or not config_file:
            raise ValueError("kv_connector_extra_config needs 'config_file': a kvplugin "
                             "deployment config (YAML / TOML / JSON)")
        self._default_tenant = str(extra.get("default_tenant", "default"))
        if kv_cache_config is None:
            raise ValueError("KVPluginConnector needs vLLM's kv_cache_config")
        self._kv_cache_config = kv_cache_config
        self._groups: list[GroupIO] = group_ios(kv_cache_config.kv_cache_groups)
        shapes = [g.shape for g in self._groups]
        block_size = vllm_config.cache_config.block_size
        hbs = getattr(kv_cache_config, "hash_block_size", None) or block_size
        # A failed load fails the whole request (vLLM recomputes it from 0) with several
        # groups (vLLM 0.33 raises on block ids, unique per group only) and with a
        # sliding-window or chunked local group (recomputing from the first bad block
        # would attend over the null blocks before the loaded window). That can only be
        # reported for an async load (failed_recving applies to requests waiting for
        # remote KVs), so such layouts load asynchronously.
        self._per_request = len(self._groups) > 1 or any(
            g.shape.kind in ("window", "local") for g in self._groups)
        self._async_loads = self._per_request or bool(extra.get("async_loads", False))
        self._config, timeouts = _runtime.settings(config_file)
        _recompute_on_load_failure(self._kv_transfer_config, extra)
        self._keys = _runtime.keyspace_for(self._config, shapes, hbs, block_size)
        unit = getattr(kv_cache_config, "cache_hit_alignment_tokens", None) or hbs
        self._layout = layout_of(shapes, self._keys.groups[0].chunk_blocks, unit)
        # The native manager's store decisions, untracked: vLLM tells the scheduler when a
        # running request's stores end to no one, so the in-flight budget and duplicate
        # suppression are the worker's I/O gate's and the tiers' (a put is idempotent).
        self._ledger = OffloadLedger(self._layout, self._keys,
                                     page_bytes=[s.page_bytes for s in shapes], tiers=(),
                                     store_budget_bytes=None,
                                     store_prompt_only=self._config.offload.store_prompt_only)
        # The worker owns the tiers and answers the scheduler's lookups (:mod:`._lookup`):
        # vLLM runs the two roles in different processes, and a tier has one owner.
        path = _lookup.socket_path(str(self._kv_transfer_config.engine_id),
                                   int(getattr(vllm_config.parallel_config,
                                               "data_parallel_rank", 0) or 0), config_file)
        self._server: _lookup.LookupServer | None = None
        self._lookups = _lookup.LookupClient(path, timeouts.lookup)
        self._rt: _runtime.Runtime | None = None
        if _is_worker(role):
            self._rt = _runtime.acquire(config_file)
            try:
                if _tp_rank() == 0:
                    self._server = _lookup.LookupServer(path, self._rt, self._keys,
                                                        self._layout).start()
            except BaseException:
                _runtime.release(self._rt)
                raise
        self._closed = False
        # Divergent local hybrid hits (see supports_divergent_local_hybrid_hits): on only
        # with a state group (vLLM ignores it otherwise); off for one scheduling step while
        # a request waits to be looked up on the reconciled hit.
        self._divergent = bool(self._layout.state_groups) and bool(
            extra.get("divergent_hits", True))
        self._divergent_now = self._divergent
        self._reconcile_for: set[str] = set()
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._meta = KVPluginConnectorMetadata()
        self._kvm: Any = None
        self._events_on = bool(getattr(vllm_config.kv_events_config, "enable_kv_cache_events",
                                       False))
        self._spec_kinds = [_spec_kind(g.kv_cache_spec) for g in kv_cache_config.kv_cache_groups]
        self._event_counts: collections.Counter[Any] = collections.Counter()
        self._num_workers = max(1, int(getattr(vllm_config.parallel_config, "world_size", 1)))
        # worker side
        self._init_worker(self._layout.chunk_blocks,
                          self._events_on and self._config.offload.tier_events)

    # ------------------------------------------------------------------ common
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._lookups.close()
        if self._server is not None:
            self._server.close()
        if self._rt is not None:
            if not self.wait_for_stores():  # a tier that hangs must not hold shutdown
                logger.warning("kvplugin: shut down with stores still running after %.1f s; "
                               "their objects may be missing from the tiers",
                               self._rt.timeouts.store)
            _runtime.release(self._rt)

    def _tenant(self, request: Any) -> str:
        params = request.kv_transfer_params or {}
        tenant = params.get("tenant") if isinstance(params, dict) else None
        if tenant:
            return str(tenant)
        salt = getattr(request, "cache_salt", None)
        return tenant_of_salt(salt) if salt else self._default_tenant

    def _state(self, request: Any) -> _ReqState:
        st = self._reqs.get(request.request_id)
        if st is None:
            tenant = self._tenant(request)
            try:
                self._keys.namespaces(tenant)
            except ValueError as e:
                # A user-supplied salt must not crash the scheduler: no offload for it.
                logger.warning("request %s: no KV offload: %s", request.request_id, e)
                tenant = ""
            offload = self._ledger.open(request.request_id, tenant, tenant,
                                        request.num_prompt_tokens) if tenant else None
            st = self._reqs[request.request_id] = _ReqState(request, tenant, offload)
        return st

    # --------------------------------------------------------------- scheduler
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kvm = kv_cache_manager

    @property
    def supports_divergent_local_hybrid_hits(self) -> bool:
        """vLLM 0.33 then offers a hybrid request the full-attention groups' device hit
        even where a Mamba state behind it was evicted (``hit_diverged``): a claim from
        there loads the attention chunks beyond it and the state at its end, so the device
        blocks [reconciled, deep) are kept instead of loaded again, and a tier that lost
        some of them is no obstacle. A claim of 0 makes vLLM fall back to the reconciled
        hit without asking again; when a claim from *there* exists (the tiers' deepest
        state is at or before the deep hit), :meth:`get_num_new_matched_tokens` defers
        the request one step with this off, so the flag never costs a hit."""
        return self._divergent_now

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """External hit tokens beyond the device's ``num_computed_tokens``: the deepest
        point every group can be restored at from the tiers, capped so vLLM still computes
        the last prompt token. ``None`` (look again next step): a diverged hit the tiers
        cannot extend, whose reconciled hit they can (see
        :attr:`supports_divergent_local_hybrid_hits`)."""
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        st.state_at, st.stored_until = None, ()
        if not st.tenant or st.load_failed:
            return 0, False
        claim = self._tier_claim(st, request, num_computed_tokens)
        st.stored_until = () if claim is None else claim.stored_until
        ext = claim.external if claim is not None and claim.local == num_computed_tokens else 0
        if self._divergent_now and self._dropped(st, request, num_computed_tokens, ext):
            self._reconcile_for.add(request.request_id)
            return None, False
        if ext <= 0:
            return 0, False
        assert claim is not None
        st.async_hit = self._async_loads
        st.state_at = claim.state_at
        return ext, self._async_loads

    def _tier_claim(self, st: _ReqState, request: Any, local: int) -> plans.Claim | None:
        """What the tiers add to a device hit of ``local`` tokens, asked of the worker
        that owns them; None when the lookup failed or timed out (a miss, never a
        stall)."""
        try:
            return self._lookups.claim(_lookup.ClaimQuery(
                st.tenant, request.block_hashes, request.num_tokens, local))
        except Exception as e:
            logger.warning("kvplugin lookup for %s failed: %r", request.request_id, e)
            return None

    def _dropped(self, st: _ReqState, request: Any, local: int, ext: int) -> bool:
        """Whether vLLM will drop this claim on a diverged hit and fall back to the
        reconciled hit (:func:`claim_dropped`), which the tiers extend
        (:func:`worth_reconciling`): then the request is better looked up again on the
        reconciled hit. The device lookups repeat vLLM's own (block hashes against the
        pool, nothing changed)."""
        co = getattr(self._kvm, "coordinator", None)
        fa = getattr(co, "full_attention_group_id", None)
        if (co is None or fa is None or ext >= co.scheduler_block_size
                or getattr(request, "skip_reading_prefix_cache", False)):
            return False  # no hybrid coordinator, a claim past any sub-block tail, no lookup
        cap = request.num_tokens - 1
        if not claim_dropped(co.find_longest_cache_hit_per_group(request.block_hashes, cap)[1],
                             fa, local, ext):
            return False
        _, hit, _ = co.find_longest_cache_hit(request.block_hashes, cap)
        base = hit - hit % co.scheduler_block_size
        claim = self._tier_claim(st, request, base)
        if (claim is None or claim.local != base
                or not worth_reconciling(hit, co.scheduler_block_size, claim.external)):
            return False
        logger.debug("kvplugin: %s diverged at %d (reconciled %d): the tiers extend the "
                     "reconciled hit to %d; looked up again next step", request.request_id,
                     local, hit, base + claim.external)
        return True

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        self._reconcile_for.discard(request.request_id)
        if num_external_tokens <= 0:
            # vLLM settles the local hit after this call (a kept sub-block tail, the
            # reconciled hit of a diverged one, the end of an async load or 0 after a
            # failed one): it is request.num_computed_tokens when the step's metadata is
            # built.
            st.settle = True
            return
        local = max(st.local_tokens, request.num_computed_tokens)
        end = local + num_external_tokens
        self._admit(st, end)
        assert st.offload is not None  # a claim is only made for a valid tenant
        plan = self._ledger.load_plan(st.offload, request, blocks.get_block_ids(), local, end,
                                      st.state_at)
        pieces = load_pieces(self._layout, plan)
        # vLLM allocated every block the plan names (the native core's rules), and a state
        # lands in a fresh block (on a diverged hit too: the claim ends past every Mamba
        # block vLLM found). A null block, or a state slot holding a cached block (another
        # prefix's state), would mean it did not: the load fails (vLLM recomputes) instead
        # of writing there.
        broken = plan.lands_on_null or self._on_cached(blocks, pieces)
        if broken:
            logger.warning("kvplugin load for %s: vLLM gave a null or cached block for a "
                           "planned object; the load fails and vLLM recomputes",
                           request.request_id)
        spec = LoadSpec(request.request_id, pieces, st.async_hit, local, end, self._per_request,
                        broken)
        st.loading = spec.is_async
        self._meta.loads.append(spec)

    def _on_cached(self, blocks: Any, pieces: list[Piece]) -> bool:
        """Whether a state piece would land in a block vLLM's prefix cache holds."""
        for p in pieces:
            if p.state:
                slot = -(p.first_token // -self._layout.block_sizes[p.group]) - 1
                if getattr(blocks.blocks[p.group][slot], "block_hash", None) is not None:
                    return True
        return False

    def _admit(self, st: _ReqState, end: int) -> None:
        """The request computes from ``end``: device hits were stored by whoever computed
        them, loaded chunks came from a tier, so stores start after both (a resumed
        request restarts here too)."""
        if st.offload is not None:
            self._ledger.admitted(st.offload, end, st.stored_until)
        st.settle = False

    def build_connector_meta(self, scheduler_output: Any) -> KVPluginConnectorMetadata:
        """This step's loads (planned at allocation), stores (the chunks this step's tokens
        complete, the Mamba states vLLM hands over) and delayed frees; resets the plan."""
        meta, self._meta = self._meta, KVPluginConnectorMetadata()
        # The next step looks deferred requests up on their reconciled hits.
        self._divergent_now = self._divergent and not self._reconcile_for
        block_state = getattr(scheduler_output, "kv_connector_block_state", None)
        offers: dict[str, list[tuple[int, int, int]]] = (
            dict(block_state.boundary_state_offloads) if block_state is not None else {})
        gone = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        gone |= set(getattr(scheduler_output, "finished_req_ids", None) or ())
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is not None:
                if st.settle:
                    self._admit(st, st.request.num_computed_tokens)
                self._rewind(st)
                self._plan_save(st, st.request.num_computed_tokens + n, meta,
                                offers.pop(rid, ()), rid not in gone)
        for rid, rest in offers.items():  # offers of requests not scheduled this step
            st = self._reqs.get(rid)
            if st is not None:
                self._plan_save(st, st.request.num_computed_tokens, meta, rest,
                                rid not in gone)
        self._mark_reads(meta)
        return meta

    def _rewind(self, st: _ReqState) -> None:
        """vLLM took computed tokens back (a failed load, recomputed from its first bad
        block): the chunks from there are computed again and offered again (the worker
        withheld what the failed step computed)."""
        if st.offload is not None:
            self._ledger.rewind(st.offload, st.request.num_computed_tokens)

    def _mark_reads(self, meta: KVPluginConnectorMetadata) -> None:
        """Name in each store the blocks of this step's synchronous loads its request
        reads (see :class:`SaveSpec`). Synchronous loads only serve one-group layouts, so
        block ids are the first group's."""
        loaded = {b for spec in meta.loads if not spec.is_async
                  for p in spec.pieces for b in p.block_ids}
        if not loaded or self._kvm is None:
            return
        for spec in meta.saves:
            table = self._kvm.get_block_ids(spec.req_id)
            spec.reads = tuple(b for b in table[0] if b in loaded) if table else ()

    def _plan_save(self, st: _ReqState, computed_after: int, meta: KVPluginConnectorMetadata,
                   offers: Any = (), alive: bool = True) -> None:
        """The ledger's plan for what this step computes (``computed_after`` tokens
        computed once it ran) and the states vLLM handed over; a preempted or finished
        request's blocks may be reused already: none of them is read."""
        if self._kvm is None or st.offload is None:
            return
        req = st.request
        plan = self._ledger.offer(
            st.offload, req, computed=computed_after,
            table=self._kvm.get_block_ids(req.request_id) if alive else (),
            offers=[plans.StateOffer(*o) for o in offers], alive=alive and not st.loading)
        if plan is not None:
            meta.saves.append(SaveSpec(req.request_id, self._pieces(st, plan)))
            st.had_saves = True

    def _pieces(self, st: _ReqState, plan: StorePlan) -> list[Piece]:
        lay = self._layout
        return [Piece(o.key, o.group, list(o.block_ids),
                      o.index if o.state else o.index * lay.chunk_tokens(o.group), state=o.state,
                      event=_events.describe(o, st.request, self._keys,
                                             self._spec_kinds[o.group])
                      if self._events_on else None)
                for o in plan.objects]

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.loading = False
        for rid in getattr(connector_output, "failed_recving", None) or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.load_failed = True
        events = getattr(connector_output, "kv_cache_events", None)
        if events is not None:
            self._event_counts.update(events.get_all_events())

    def take_events(self) -> list[Any]:
        """``BlockStored`` of the objects every worker has stored (see :mod:`._events`)."""
        done = [e for e, n in self._event_counts.items() if n >= self._num_workers]
        for e in done:
            del self._event_counts[e]
        return done

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(
            self, request: Any,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def register_finished_partial_tail(self, request: Any, block_ids: tuple[list[int], ...],
                                       partial_tail_offloads: list[tuple[int, int, int]]
                                       ) -> bool:
        """Store the Mamba state the request's own block holds at its last prompt boundary
        (no token was forwarded past it). The blocks stay until the store is done: the
        request's ``request_finished`` delays the free."""
        st = self._reqs.get(request.request_id)
        if st is None or st.offload is None or st.loading:
            return False
        plan = self._ledger.offer(st.offload, request, computed=request.num_computed_tokens,
                                  table=block_ids,
                                  tails=[plans.StateOffer(*t) for t in partial_tail_offloads])
        if plan is None:
            return False
        self._meta.saves.append(SaveSpec(request.request_id, self._pieces(st, plan)))
        st.had_saves = True
        return True

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while the request's stores run. Never while its async load is
        in flight: vLLM frees those itself when the load reports, and would free twice."""
        self._reconcile_for.discard(request.request_id)
        st = self._reqs.pop(request.request_id, None)
        if st is None or not st.had_saves or st.loading:
            return False, None
        self._meta.delayed_frees.append(request.request_id)
        return True, None

    # ------------------------------------------------------------------ stats
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
        self._maps = map_groups(self._groups, kv_caches)

    def _copy_in(self, piece: Piece, payload: Any) -> None:
        pages_in(self._maps[piece.group], piece.block_ids, payload, piece.skip)


def _recompute_on_load_failure(kv_transfer_config: Any, extra: dict[str, Any]) -> None:
    """kvplugin's tiers are a cache: a missing or damaged object is a miss that vLLM
    recomputes, never a failed request. vLLM's default ``kv_load_failure_policy`` is
    "fail" (meant for disaggregated prefill, where the KV exists nowhere else); the
    Scheduler reads it right after building this connector, so it is set to "recompute"
    here unless the deployment asks for "fail" explicitly (extra config
    ``load_failure_policy: fail``)."""
    wanted = str(extra.get("load_failure_policy", "recompute"))
    if wanted not in ("recompute", "fail"):
        raise ValueError(f"kv_connector_extra_config load_failure_policy must be "
                         f"'recompute' or 'fail', got {wanted!r}")
    if getattr(kv_transfer_config, "kv_load_failure_policy", wanted) != wanted:
        logger.info("KVPluginConnector: kv_load_failure_policy %r -> %r (a tier miss is "
                    "recomputed)", kv_transfer_config.kv_load_failure_policy, wanted)
        kv_transfer_config.kv_load_failure_policy = wanted


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


def tenant_of_salt(cache_salt: str) -> str:
    """The tenant a request's ``cache_salt`` names. The native manager salts a tenant's
    requests ``tenant=<t>`` or ``tenant=<t>;salt=<s>`` (:func:`kvplugin.aio.tenants.
    device_salt`): such a request hashes, and is keyed, exactly as the native one; any
    other salt is the tenant's name itself."""
    if cache_salt.startswith(_TENANT_SALT):
        return cache_salt[len(_TENANT_SALT):].split(";salt=", 1)[0]
    return cache_salt
