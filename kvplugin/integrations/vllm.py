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

Scheduler side: a prefix lookup through the tiers, bounded by ``offload.lookup_timeout_ms``
(a slow or dead tier is a miss, never a stall); loads and stores planned per step into the
metadata; a finished request that had stores keeps its blocks (``delay_free``) until the
worker reports its stores done. Worker side: pages move between vLLM's KV tensors
(``[2, num_blocks, block_size, heads, head_size]`` per layer) and kvplugin's block format
(one page = ``(2, layers, block_size, heads, head_size)``) on an event loop on its own
thread; a load that misses or fails verification is reported through
``get_block_ids_with_load_errors`` so vLLM recomputes those tokens.

Slice 1 serves one full-attention KV-cache group; other layouts are refused at build time.

vLLM and torch are imported lazily: importing this module without them works, building the
connector raises an ImportError naming the ``vllm`` extra.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any

from connectors.keys import ObjectKey
from kvplugin.aio.memory import PageShape
from kvplugin.integrations import _runtime
from kvplugin.serde import Block

__all__ = ["KVPluginConnector", "KVPluginConnectorMetadata", "LoadSpec", "SaveSpec",
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
_TORCH_DTYPES = {"float16": "float16", "bfloat16": "bfloat16", "float32": "float32",
                 "float64": "float64", "int8": "int8", "uint8": "uint8",
                 "float8_e4m3fn": "float8_e4m3fn", "float8_e5m2": "float8_e5m2"}


@dataclass(slots=True)
class LoadSpec:
    """Load ``keys`` (one chunk each) into ``block_ids`` (``chunk_blocks`` per key)."""

    req_id: str
    keys: list[ObjectKey]
    block_ids: list[int]
    is_async: bool
    first_token: int


@dataclass(slots=True)
class SaveSpec:
    """Store the chunks in ``block_ids`` under ``keys``, starting at token ``first_token``."""

    req_id: str
    keys: list[ObjectKey]
    block_ids: list[int]
    first_token: int


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
    stored_chunks: int = 0  # chunks already planned for store (or loaded / computed)
    had_saves: bool = False
    loading: bool = False  # an async load not yet reported finished
    local_tokens: int = 0  # the device's hit at the last lookup
    async_hit: bool = False  # the last external hit was reported as an async load
    load: LoadSpec | None = None


@dataclass(slots=True)
class _Pending:
    """Worker-side: an async load in flight."""

    spec: LoadSpec
    future: concurrent.futures.Future[list[Block | None]]


@dataclass(slots=True)
class _WorkerState:
    saves: dict[str, list[concurrent.futures.Future[int]]] = field(default_factory=dict)
    loads: dict[str, _Pending] = field(default_factory=dict)
    awaiting_send: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)


class KVPluginConnector(KVConnectorBase_V1, SupportsHMA):  # type: ignore[misc]
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
        self._async_loads = bool(extra.get("async_loads", False))
        if kv_cache_config is None:
            raise ValueError("KVPluginConnector needs vLLM's kv_cache_config")
        self._kv_cache_config = kv_cache_config
        groups = kv_cache_config.kv_cache_groups
        self._shape, self._layers = _full_attention_page(groups)
        block_size = self._shape.block_size
        hbs = getattr(kv_cache_config, "hash_block_size", None) or block_size
        self._rt = _runtime.acquire(config_file)
        try:
            self._keys = _runtime.keyspace_for(self._rt.config, [self._shape], hbs, block_size)
        except BaseException:
            _runtime.release(self._rt)
            raise
        self._chunk_blocks = self._keys.groups[0].chunk_blocks
        self._chunk_tokens = self._keys.groups[0].chunk_tokens
        self._closed = False
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._meta = KVPluginConnectorMetadata()
        self._kvm: Any = None
        # worker side
        self._kv: dict[str, Any] = {}
        self._w = _WorkerState()

    # ------------------------------------------------------------------ common
    def shutdown(self) -> None:
        if self._closed:
            return
        self._closed = True
        for futs in self._w.saves.values():
            concurrent.futures.wait(futs, timeout=self._rt.timeouts.store)
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
            st = self._reqs[request.request_id] = _ReqState(request, tenant)
        return st

    def _chunk_keys(self, st: _ReqState, first: int, stop: int) -> list[ObjectKey]:
        return self._keys.chunk_keys(st.tenant, 0, st.request.block_hashes, first, stop)

    # --------------------------------------------------------------- scheduler
    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        self._kvm = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """External hit tokens beyond the device's ``num_computed_tokens``: the tiers' prefix
        count, capped so vLLM still computes the last prompt token."""
        st = self._state(request)
        st.local_tokens = num_computed_tokens
        if not st.tenant:
            return 0, False
        ct = self._chunk_tokens
        first = num_computed_tokens // ct
        stop = min(self._keys.groups[0].num_chunks(len(request.block_hashes)),
                   (request.num_tokens - 1) // ct)
        if stop <= first or num_computed_tokens % ct:
            return 0, False
        keys = self._chunk_keys(st, first, stop)
        timeout = self._rt.timeouts.lookup
        try:
            found = self._rt.loop.call(self._rt.connector.lookup(keys, timeout=timeout),
                                       timeout=timeout + 0.05)
        except Exception as e:  # a tier that cannot answer in time is a miss, never a stall
            logger.warning("kvplugin lookup for %s failed: %r", request.request_id, e)
            return 0, False
        hit = (first + found) * ct - num_computed_tokens
        if hit <= 0:
            return 0, False
        st.async_hit = self._async_loads
        return hit, self._async_loads

    def update_state_after_alloc(self, request: Any, blocks: Any,
                                 num_external_tokens: int) -> None:
        st = self._state(request)
        # After an async load vLLM calls again (0 external tokens) with the loaded tokens
        # already computed and no new lookup.
        local = max(st.local_tokens, request.num_computed_tokens)
        ct = self._chunk_tokens
        # Device hits were stored by whoever computed them, loaded chunks came from a tier:
        # stores start after both (a resumed request restarts here too).
        st.stored_chunks = (local + num_external_tokens) // ct
        if num_external_tokens <= 0:
            return
        first, stop = local // ct, (local + num_external_tokens) // ct
        ids = blocks.get_block_ids()[0]
        cb = self._chunk_blocks
        spec = LoadSpec(request.request_id, self._chunk_keys(st, first, stop),
                        list(ids[first * cb:stop * cb]), st.async_hit, first * ct)
        st.loading = spec.is_async
        st.load = spec
        self._meta.loads.append(spec)

    def build_connector_meta(self, scheduler_output: Any) -> KVPluginConnectorMetadata:
        """This step's loads (planned at allocation), stores (the chunks this step's tokens
        complete) and delayed frees; resets the plan for the next step."""
        meta, self._meta = self._meta, KVPluginConnectorMetadata()
        for rid, n in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(rid)
            if st is not None:
                self._plan_save(st, st.request.num_computed_tokens + n, meta)
        return meta

    def _plan_save(self, st: _ReqState, computed_after: int,
                   meta: KVPluginConnectorMetadata) -> None:
        g = self._keys.groups[0]
        stop = min(computed_after // self._chunk_tokens,
                   g.num_chunks(len(st.request.block_hashes)))
        first = st.stored_chunks
        if stop <= first or self._kvm is None or not st.tenant:
            return
        ids = self._kvm.get_block_ids(st.request.request_id)[0]
        cb = self._chunk_blocks
        if len(ids) < stop * cb:
            return  # the blocks are not all there (cannot happen for computed tokens)
        meta.saves.append(SaveSpec(st.request.request_id, self._chunk_keys(st, first, stop),
                                   list(ids[first * cb:stop * cb]), first * self._chunk_tokens))
        st.stored_chunks = stop
        st.had_saves = True

    def update_connector_output(self, connector_output: Any) -> None:
        for rid in connector_output.finished_recving or ():
            st = self._reqs.get(rid)
            if st is not None:
                st.loading = False

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def request_finished_all_groups(
            self, request: Any,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self._finished(request)

    def _finished(self, request: Any) -> tuple[bool, dict[str, Any] | None]:
        """Keep the blocks while the request's stores run. Never while its async load is
        in flight: vLLM frees those itself when the load reports, and would free twice."""
        st = self._reqs.pop(request.request_id, None)
        if st is None or not st.had_saves or st.loading:
            return False, None
        self._meta.delayed_frees.append(request.request_id)
        return True, None

    # ------------------------------------------------------------------ worker
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        missing = [name for name in self._layers if name not in kv_caches]
        if missing:
            raise ValueError(f"no KV tensor for layers {missing}")
        for name in self._layers:
            t = kv_caches[name]
            s = self._shape
            if (t.dim() != 5 or t.shape[0] != 2 or tuple(t.shape[2:]) !=
                    (s.block_size, s.num_kv_heads, s.head_size)):
                raise ValueError(f"layer {name}: KV tensor shape {tuple(t.shape)} is not "
                                 f"[2, blocks, {s.block_size}, {s.num_kv_heads}, "
                                 f"{s.head_size}]")
        self._kv = {name: kv_caches[name] for name in self._layers}

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads; synchronous ones are in the tensors on return (the
        model reads them in this forward), async ones report through get_finished."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPluginConnectorMetadata)
        timeout = self._rt.timeouts.load
        for spec in meta.loads:
            fut = self._rt.loop.submit(self._rt.connector.get(spec.keys, timeout=timeout))
            if spec.is_async:
                self._w.loads[spec.req_id] = _Pending(spec, fut)
            else:
                self._finish_load(spec, fut)
        for rid in meta.delayed_frees:
            self._w.awaiting_send.add(rid)

    def _finish_load(self, spec: LoadSpec,
                     fut: concurrent.futures.Future[list[Block | None]]) -> None:
        try:
            blocks: list[Block | None] = fut.result(self._rt.timeouts.load + 1.0)
        except Exception as e:
            logger.warning("kvplugin load for %s failed: %r", spec.req_id, e)
            blocks = [None] * len(spec.keys)
        cb = self._chunk_blocks
        for i, block in enumerate(blocks):
            ids = spec.block_ids[i * cb:(i + 1) * cb]
            if block is None:
                # vLLM recomputes from the first bad block: report every block from here.
                self._w.load_errors.update(spec.block_ids[i * cb:])
                return
            self._copy_in(ids, block)

    def _copy_in(self, block_ids: list[int], block: Block) -> None:
        torch = importlib.import_module("torch")

        dtype = getattr(torch, self._shape.dtype)
        raw = torch.frombuffer(bytearray(block.payload), dtype=torch.uint8)
        pages = raw.view(dtype).reshape(len(block_ids), *self._shape.dims)
        index = torch.tensor(block_ids, dtype=torch.long)
        for li, name in enumerate(self._layers):
            t = self._kv[name]
            t[:, index] = pages[:, :, li].transpose(0, 1).to(t.device)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # synchronous loads completed in start_load_kv

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # pages are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        """Copy this step's completed chunks out of the KV tensors (the device may reuse the
        blocks at once) and hand them to the tiers; the puts finish in the background."""
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVPluginConnectorMetadata)
        for spec in meta.saves:
            items = self._pages_out(spec)
            fut = self._rt.loop.submit(
                self._rt.connector.put(items, timeout=self._rt.timeouts.store))
            self._w.saves.setdefault(spec.req_id, []).append(fut)

    def _pages_out(self, spec: SaveSpec) -> list[tuple[ObjectKey, Block]]:
        torch = importlib.import_module("torch")

        index = torch.tensor(spec.block_ids, dtype=torch.long)
        # (blocks, 2, layers, block_size, heads, head_size): one page per block.
        pages = torch.stack([self._kv[n][:, index].cpu() for n in self._layers], dim=2)
        pages = pages.transpose(0, 1).contiguous()
        cb, ct = self._chunk_blocks, self._chunk_tokens
        out = []
        for i, key in enumerate(spec.keys):
            chunk = pages[i * cb:(i + 1) * cb].contiguous()
            payload = chunk.view(torch.uint8).numpy().tobytes()
            start = spec.first_token + i * ct
            meta = key.meta(token_start=start, token_end=start + ct, dtype=self._shape.dtype,
                            shape=(cb, *self._shape.dims))
            out.append((key, Block(meta, payload)))
        return out

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        """(finished_sending, finished_recving): delayed frees whose stores are done, async
        loads that completed (copied into the tensors here, errors recorded)."""
        sending = set()
        for rid in list(self._w.awaiting_send):
            futs = self._w.saves.get(rid, [])
            if all(f.done() for f in futs):
                self._log_save_errors(rid, futs)
                self._w.saves.pop(rid, None)
                self._w.awaiting_send.discard(rid)
                sending.add(rid)
        recving = set()
        for rid, pending in list(self._w.loads.items()):
            if pending.future.done():
                del self._w.loads[rid]
                self._finish_load(pending.spec, pending.future)
                recving.add(rid)
        # Saves of requests that finished without a delayed free: drop the done ones.
        for rid in list(self._w.saves):
            if rid not in self._w.awaiting_send:
                left = [f for f in self._w.saves[rid] if not f.done()]
                if left:
                    self._w.saves[rid] = left
                else:
                    del self._w.saves[rid]
        return sending or None, recving or None

    @staticmethod
    def _log_save_errors(rid: str, futs: list[concurrent.futures.Future[int]]) -> None:
        for f in futs:
            if not f.cancelled() and f.exception() is not None:
                logger.warning("kvplugin store for %s failed: %r", rid, f.exception())

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._w.load_errors = self._w.load_errors, set()
        return errors


def tenant_of_salt(cache_salt: str) -> str:
    """The tenant a request's ``cache_salt`` names. The native manager salts a tenant's
    requests ``tenant=<t>`` or ``tenant=<t>;salt=<s>`` (:func:`kvplugin.aio.tenants.
    device_salt`): such a request hashes, and is keyed, exactly as the native one; any
    other salt is the tenant's name itself."""
    if cache_salt.startswith(_TENANT_SALT):
        return cache_salt[len(_TENANT_SALT):].split(";salt=", 1)[0]
    return cache_salt


def _full_attention_page(groups: Any) -> tuple[PageShape, list[str]]:
    """The page of the single full-attention group (other layouts: not in this slice)."""
    full_attention = importlib.import_module("vllm.v1.kv_cache_interface").FullAttentionSpec

    if len(groups) != 1 or type(groups[0].kv_cache_spec) is not full_attention:
        kinds = [type(g.kv_cache_spec).__name__ for g in groups]
        raise ValueError(f"KVPluginConnector serves one full-attention KV-cache group; got "
                         f"{kinds} (hybrid layouts are not supported yet)")
    spec = groups[0].kv_cache_spec
    dtype = str(spec.dtype).removeprefix("torch.")
    if dtype not in _TORCH_DTYPES:
        raise ValueError(f"KV dtype {spec.dtype} is not supported")
    layers = list(groups[0].layer_names)
    shape = PageShape(len(layers), spec.num_kv_heads, spec.head_size, dtype, spec.block_size)
    return shape, layers
