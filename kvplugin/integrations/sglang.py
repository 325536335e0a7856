"""kvplugin's tiers as SGLang's HiCache storage backend (L3 below SGLang's host memory).

Loaded by SGLang's own factory (``storage/backend_factory.py``, the ``dynamic`` backend)::

    --enable-hierarchical-cache --hicache-storage-backend dynamic \\
    --hicache-storage-backend-extra-config '{"backend_name": "kvplugin",
        "module_path": "kvplugin.integrations.sglang", "class_name": "KVPluginHiCacheStorage",
        "config_file": "configs/sglang_hicache.yaml"}'

Extra-config keys besides SGLang's three: ``config_file`` (a kvplugin deployment config: its
``offload`` section builds the tiers, memory / disk / Redis / Redis Cluster / tiered, with
their deadlines and store budget; ``tenants`` their tier byte quotas), ``default_tenant``,
``tier_events`` (the tiers' stored / removed pages in :meth:`get_stats`), and SGLang's own
``interface_v1`` (SGLang then calls :meth:`batch_get_v1` / :meth:`batch_set_v1` with pages
addressed in its registered host pool).

Served: the legacy interface (``get``, ``batch_get``, ``set``, ``batch_set``, ``exists``,
``batch_exists``), v1, the hybrid v2 (``batch_exists_v2`` with SGLang's ``all_pages`` and
``trailing_pages`` hit policies, ``batch_get_v2`` / ``batch_set_v2`` per registered pool:
Mamba states, SWA, ...), ``clear``, ``get_stats``, ``close``. What each call decides and
how long it may take is :mod:`._hicache`'s. torch and SGLang are imported lazily: this
module imports without them; building the backend raises an ImportError naming SGLang.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvplugin.integrations._hicache import (
    KV,
    HiCacheCore,
    PageIdentity,
    PoolQuery,
    PoolShape,
    pool_hits,
)

__all__ = ["KVPluginHiCacheStorage"]


def _sglang() -> tuple[Any, ImportError | None]:
    try:
        return importlib.import_module("sglang.srt.mem_cache.hicache_storage"), None
    except ImportError as e:
        return None, e


_hs, _IMPORT_ERROR = _sglang()


class _Absent:
    """Stands in for SGLang's base class when SGLang is not installed."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        raise ImportError("kvplugin.integrations.sglang needs SGLang (sglang 0.5.23) and "
                          "torch") from _IMPORT_ERROR


HiCacheStorage: Any = _Absent if _hs is None else _hs.HiCacheStorage


def _pair(rank: Any, size: Any) -> tuple[int, int]:
    return int(rank or 0), int(size or 1)


def identity_of(config: Any) -> PageIdentity:
    """The page identity of SGLang's ``HiCacheStorageConfig`` (fields drift between
    versions: a missing one is its single-rank default)."""
    def g(name: str, default: Any = None) -> Any:
        return getattr(config, name, default)

    return PageIdentity(
        model=str(g("model_name") or ""), tp=_pair(g("tp_rank"), g("tp_size")),
        pp=_pair(g("pp_rank"), g("pp_size")), attn_cp=_pair(g("attn_cp_rank"),
                                                             g("attn_cp_size")),
        dcp=_pair(g("dcp_rank"), g("dcp_size")), mla=bool(g("is_mla_model", False)),
        page_first=bool(g("is_page_first_layout", False)))


def _shape(pool: Any) -> PoolShape:
    """A host pool's pages (SGLang's ``HostKVCache``)."""
    page = pool.get_dummy_flat_data_page()
    return PoolShape(dtype=_dtype(pool.dtype), host_layout=str(getattr(pool, "layout", "")),
                     page_size=int(pool.page_size),
                     page_bytes=int(page.numel() * page.element_size()))


def _dtype(tensor_or_dtype: Any) -> str:
    dtype = getattr(tensor_or_dtype, "dtype", tensor_or_dtype)
    return str(dtype).removeprefix("torch.")


class KVPluginHiCacheStorage(HiCacheStorage):  # type: ignore[misc]
    """SGLang's ``HiCacheStorage`` over kvplugin's tiers (see the module docstring)."""

    def __init__(self, storage_config: Any, kwargs: dict[str, Any] | None = None) -> None:
        if _IMPORT_ERROR is not None:
            _Absent()
        extra = dict(getattr(storage_config, "extra_config", None) or {})
        config_file = extra.get("config_file")
        if not isinstance(config_file, str) or not config_file:
            raise ValueError("kvplugin's HiCache backend: the extra config needs "
                             "'config_file', a kvplugin deployment config")
        self.storage_config = storage_config
        self._core = HiCacheCore(os.path.abspath(config_file), identity_of(storage_config),
                                 default_tenant=str(extra.get("default_tenant", "default")),
                                 events=bool(extra.get("tier_events", False)))
        self.mem_pool_host: Any = None

    @property
    def core(self) -> HiCacheCore:
        return self._core

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._core.set_pool(KV, _shape(mem_pool_host))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """A pool of SGLang's host pool group (KV, Mamba, SWA, ...), for the v2 calls."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._core.set_pool(str(host_pool_name), _shape(host_pool))

    def _tenant(self, extra_info: Any) -> str:
        return self._core.tenant(getattr(extra_info, "extra_info", None))

    # ------------------------------------------------------------------ legacy
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> Any:
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None, extra_info: Any = None) -> list[Any]:
        """Each page read into its target tensor (returned), or None."""
        targets = list(target_locations or [None] * len(keys))
        if any(t is None for t in targets):
            raise ValueError("kvplugin's HiCache backend reads into target tensors: pass "
                             "target_locations (SGLang's flat pages)")
        views = self._core.get_pages(self._tenant(extra_info), keys,
                                     [t.numel() * t.element_size() for t in targets],
                                     _dtype(targets[0]) if targets else "")
        return [None if v is None else _fill(t, v) for t, v in zip(targets, views,
                                                                    strict=True)]

    def set(self, key: str, value: Any = None, target_location: Any = None,
            target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None, extra_info: Any = None) -> bool:
        """True when the tiers hold every page afterwards."""
        return all(self._set(keys, list(values or []), extra_info)) if keys else True

    def _set(self, keys: Sequence[str], values: list[Any], extra_info: Any) -> list[bool]:
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        pages = [v.detach().contiguous().view(-1).view(_u8()).numpy() for v in values]
        return self._core.put_pages(self._tenant(extra_info), keys, pages,
                                    _dtype(values[0]) if values else "")

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists(self, keys: list[str], extra_info: Any = None) -> int:
        return self._core.exists_prefix(self._tenant(extra_info), keys)

    # ------------------------------------------------------------------ v1
    def batch_get_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        """Pages read straight into the registered host pool at ``host_indices`` (one
        page per ``page_size`` indices)."""
        pool = self._pool()
        targets = [pool.get_dummy_flat_data_page() for _ in keys]
        got = self.batch_get(keys, targets, extra_info=extra_info)
        out = []
        for i, page in enumerate(got):
            if page is not None:
                pool.set_from_flat_data_page(int(host_indices[i * pool.page_size]), page)
            out.append(page is not None)
        return out

    def batch_set_v1(self, keys: list[str], host_indices: Any,
                     extra_info: Any = None) -> list[bool]:
        pool = self._pool()
        pages = [pool.get_data_page(int(host_indices[i * pool.page_size]), flat=True)
                 for i in range(len(keys))]
        return self._set(keys, pages, extra_info)

    def _pool(self) -> Any:
        if self.mem_pool_host is None:
            raise RuntimeError("kvplugin's HiCache backend: v1 calls need the host pool "
                               "SGLang registers (register_mem_pool_host)")
        return self.mem_pool_host

    # ------------------------------------------------------------------ v2 (pools)
    def batch_exists_v2(self, keys: list[str], pool_transfers: Any = None,
                        extra_info: Any = None) -> Any:
        """The usable prefix where every side pool's hit policy holds (SGLang's
        ``PoolTransferResult``): the KV pages present from the first, then per pool its
        entries of those pages (``all_pages``: each up to the prefix; ``trailing_pages``:
        the last ``len(transfer.keys)`` before it)."""
        tenant = self._tenant(extra_info)
        kv_pages = self._core.exists_prefix(tenant, keys)
        queries = []
        for t in pool_transfers or []:
            name = str(t.name)
            present = (self._core.present(tenant, keys[:kv_pages], name)
                       if kv_pages and name in self._core.pools else [False] * kv_pages)
            queries.append(PoolQuery(name, str(getattr(t.hit_policy, "value", t.hit_policy)),
                                     len(t.keys or ()) or 1, tuple(present)))
        final, hits, restorable = pool_hits(kv_pages, queries)
        return _hs.PoolTransferResult(final, hits, restorable)

    def batch_get_v2(self, transfers: list[Any], extra_info: Any = None
                     ) -> dict[str, list[bool]]:
        """Each transfer's pages read into its registered host pool (per page: done)."""
        return self._v2(transfers, extra_info, self._get_into)

    def batch_set_v2(self, transfers: list[Any], extra_info: Any = None
                     ) -> dict[str, list[bool]]:
        return self._v2(transfers, extra_info, self._set_from)

    def _v2(self, transfers: list[Any], extra_info: Any, op: Any) -> dict[str, list[bool]]:
        tenant = self._tenant(extra_info)
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name, keys = str(t.name), list(t.keys or [])
            pool = getattr(self, "registered_pools", {}).get(t.name)
            if pool is None and name == KV:
                pool = self.mem_pool_host
            step = int(getattr(pool, "page_size", 1) or 1)
            idx = t.host_indices
            if pool is None or idx is None or int(idx.numel()) != len(keys) * step:
                out[name] = [False] * len(keys)  # SGLang's file backend answers the same
                continue
            slots = [int(idx[i * step]) for i in range(len(keys))]
            out[name] = op(tenant, name, pool, keys, slots)
        return out

    def _get_into(self, tenant: str, name: str, pool: Any, keys: list[str],
                  slots: list[int]) -> list[bool]:
        page = pool.get_dummy_flat_data_page()
        targets = [page.clone() for _ in keys]
        views = self._core.get_pages(tenant, keys,
                                     [page.numel() * page.element_size()] * len(keys),
                                     _dtype(page), name)
        for slot, target, view in zip(slots, targets, views, strict=True):
            if view is not None:
                pool.set_from_flat_data_page(slot, _fill(target, view))
        return [v is not None for v in views]

    def _set_from(self, tenant: str, name: str, pool: Any, keys: list[str],
                  slots: list[int]) -> list[bool]:
        pages = [pool.get_data_page(slot, flat=True) for slot in slots]
        arrays = [p.detach().contiguous().view(-1).view(_u8()).numpy() for p in pages]
        return self._core.put_pages(tenant, keys, arrays, _dtype(pages[0]) if pages else "",
                                    name)

    # ------------------------------------------------------------------ lifecycle
    def clear(self) -> None:
        """Drop the pages this backend stored (a shared tier's other pages are not its
        to drop)."""
        self._core.delete_stored()

    def get_stats(self) -> Any:
        """SGLang's ``StorageMetrics`` (pages and bandwidth per prefetch / backup since the
        last call), with kvplugin's per-tenant figures and tier events as ``.kvplugin``."""
        f = self._core.take_figures()
        try:
            cls = importlib.import_module(
                "sglang.srt.observability.metrics_collector").StorageMetrics
            metrics = cls()
        except (ImportError, AttributeError):  # an SGLang without it: a plain record
            metrics = type("StorageMetrics", (), {})()
        metrics.prefetch_pgs = f.prefetch_pgs
        metrics.backup_pgs = f.backup_pgs
        metrics.prefetch_bandwidth = f.prefetch_bandwidth
        metrics.backup_bandwidth = f.backup_bandwidth
        counters, gauges = self._core.figures()
        metrics.kvplugin = {
            "counters": {f"{n}|{'|'.join(lv)}": v for (n, lv), v in counters.items()},
            "gauges": {f"{n}|{'|'.join(lv)}": v for (n, lv), v in gauges.items()},
            "events": [{"tier": t, "removed": r, "keys": list(k)}
                       for t, r, k in self._core.events()]}
        return metrics

    def close(self) -> None:
        self._core.release()


def _u8() -> Any:
    return importlib.import_module("torch").uint8


def _fill(target: Any, view: memoryview) -> Any:
    """Copy a verified page into SGLang's (contiguous, CPU) target tensor."""
    dst = target.view(-1).view(_u8()).numpy()
    dst[:] = np.frombuffer(view, np.uint8)
    return target
