"""The engine-independent half of kvplugin as SGLang's HiCache storage backend
(:mod:`.sglang`): pages in and out of kvplugin's tiers, by SGLang's page hashes.

SGLang's cache controller calls a storage backend from its prefetch and backup threads and
waits for each answer, so every call here blocks its caller, never longer than the
deployment's deadline for it (``offload.lookup_timeout_ms`` for existence checks, load and
store timeouts for the rest): a slow or dead tier answers misses (0, None, False) in time.
Every page read is verified by the tier (checksums, key and namespace) and then checked to
be a page of the size and dtype the caller reads into; anything else is a miss.

Keys: ``Namespace(tenant, model, layout, pool).key(page hash)``. The layout fingerprint
(:class:`PageIdentity`) holds what SGLang's own backends put in their key suffixes (model,
TP / PP / attention-CP / DCP ranks and sizes; MLA pages shared across TP ranks) and what
they leave out (sglang#33268): the KV dtype, the host pool's layout, page size and page
bytes. The tenant is the call's ``extra_info["tenant"]`` (or ``"cache_salt"``), else the
deployment's ``default_tenant``: SGLang hands a backend no request identity, and since 0.5.23
seeds its storage hash chains with the request's ``cache_salt`` and ``extra_key``, two salts
never share a page hash anyway.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvplugin.aio.offload_ledger import StoreObject
from kvplugin.buffers import default_pool
from kvplugin.connectors.keys import ObjectKey, layout_fingerprint
from kvplugin.integrations._keyed import KeyedTiers, tenant_of_params
from kvplugin.serde import DTYPE_SIZES, Block

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["HiCacheCore", "PageIdentity", "StorageFigures"]

logger = logging.getLogger(__name__)

POOLS = ("kv",)  # the pools served: kvplugin group index = position


@dataclass(frozen=True, slots=True)
class PageIdentity:
    """What makes a stored page readable by another SGLang process."""

    model: str
    tp: tuple[int, int] = (0, 1)  # rank, size
    pp: tuple[int, int] = (0, 1)
    attn_cp: tuple[int, int] = (0, 1)
    dcp: tuple[int, int] = (0, 1)
    mla: bool = False
    page_first: bool = False
    # The host pool's, once SGLang registers it ("" before: legacy calls carry their own).
    dtype: str = ""
    host_layout: str = ""
    page_size: int = 0
    page_bytes: int = 0

    def fingerprint(self, pool: str) -> str:
        # MLA pages are the same bytes on every TP rank (SGLang's file backend shares them).
        tp = (0, 1) if self.mla else self.tp
        return layout_fingerprint(
            kind="sglang_page", pool=pool, model=self.model, tp=tp, pp=self.pp,
            attn_cp=self.attn_cp, dcp=self.dcp, mla=self.mla, page_first=self.page_first,
            dtype=self.dtype, host_layout=self.host_layout, page_size=self.page_size,
            page_bytes=self.page_bytes)


@dataclass(slots=True)
class StorageFigures:
    """What SGLang's storage metrics take (pages per batch, bandwidth in GB/s), since the
    last :meth:`HiCacheCore.take_figures`."""

    prefetch_pgs: list[int] = field(default_factory=list)
    backup_pgs: list[int] = field(default_factory=list)
    prefetch_bandwidth: list[float] = field(default_factory=list)
    backup_bandwidth: list[float] = field(default_factory=list)


class HiCacheCore(KeyedTiers):
    """kvplugin's tiers behind one SGLang rank's HiCache storage backend."""

    def __init__(self, config_file: str, identity: PageIdentity, *,
                 default_tenant: str = "default", events: bool = False) -> None:
        super().__init__(config_file, fingerprints=[identity.fingerprint(p) for p in POOLS],
                         group_tokens=[max(1, identity.page_size)] * len(POOLS),
                         blocks_per_chunk=1, object_bytes=max(1, identity.page_bytes),
                         default_tenant=default_tenant, events=events,
                         who="kvplugin's SGLang HiCache backend", engine="SGLang")
        self.identity = identity
        self._figures = StorageFigures()

    def set_pool(self, *, dtype: str, host_layout: str, page_size: int,
                 page_bytes: int) -> None:
        """SGLang registered its host pool: its pages' dtype, layout and size enter every
        key from now on."""
        self.identity = replace(self.identity, dtype=dtype, host_layout=host_layout,
                                page_size=page_size, page_bytes=page_bytes)
        with self._lock:
            self.fingerprints = tuple(self.identity.fingerprint(p) for p in POOLS)
            self._ns.clear()

    def tenant(self, extra: dict[str, Any] | None) -> str:
        """The call's tenant (``""``: refused, every call a miss)."""
        name = tenant_of_params(extra, self._default)
        return self.open_request(f"tenant:{name}", {"tenant": name})

    def keys(self, tenant: str, hashes: Sequence[str], pool: int = 0) -> list[ObjectKey]:
        return [self.key(tenant, pool, _raw(h)) for h in hashes]

    def _call(self, coro: Any, timeout: float, default: Any) -> Any:
        """Run on the tiers' loop; past the deadline (and a second of grace for the loop
        itself) or on a closed loop, the default."""
        try:
            return self.rt.loop.call(coro, timeout + 1.0)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            logger.warning("%s: a tier call gave up: %r", self.who, e)
            return default

    # ------------------------------------------------------------------ reads
    def exists_prefix(self, tenant: str, hashes: Sequence[str]) -> int:
        """How many pages are present from the first, within the lookup deadline."""
        if not tenant or not hashes:
            return 0
        timeout = self.rt.timeouts.lookup
        keys = self.keys(tenant, hashes)
        levels: list[int] = self._call(self.rt.connector.lookup_levels(keys, timeout=timeout),
                                       timeout, [])
        hits: dict[str, int] = {}
        for level in levels:
            name = self.tiers[level]
            hits[name] = hits.get(name, 0) + max(1, self.identity.page_size)
        self.book_query(tenant, len(hashes) * max(1, self.identity.page_size), hits)
        return len(levels)

    def get_pages(self, tenant: str, hashes: Sequence[str], nbytes: Sequence[int],
                  dtype: str) -> list[memoryview | None]:
        """Each page's verified bytes, or None: missing, damaged, of another size or dtype,
        or not read within the load deadline."""
        if not tenant:
            return [None] * len(hashes)
        t0 = time.perf_counter()
        timeout = self.rt.timeouts.load
        keys = self.keys(tenant, hashes)
        got: tuple[list[Block | None], list[int]] = self._call(
            self.rt.connector.get_located(keys, timeout=timeout), timeout,
            ([None] * len(keys), [-1] * len(keys)))
        out: list[memoryview | None] = []
        copied = []
        for block, level, n in zip(*got, nbytes, strict=True):
            view = None if block is None else self._fits(block, n, dtype)
            out.append(view)
            if view is not None:
                copied.append((self.tiers[level], n, False))
        self.book_load(tenant, copied, len(copied) < len(hashes))
        self._figure(self._figures.prefetch_pgs, self._figures.prefetch_bandwidth,
                     len(copied), sum(c[1] for c in copied), time.perf_counter() - t0)
        return out

    def _fits(self, block: Block, nbytes: int, dtype: str) -> memoryview | None:
        view = memoryview(block.payload).cast("B")
        if view.nbytes == nbytes and block.meta.dtype == _stored_dtype(dtype):
            return view
        self.refused_objects += 1
        logger.warning("%s: refused page %s: %d bytes of %s, the reader wants %d of %s",
                       self.who, block.meta.key, view.nbytes, block.meta.dtype, nbytes, dtype)
        return None

    # ------------------------------------------------------------------ writes
    def put_pages(self, tenant: str, hashes: Sequence[str],
                  pages: Sequence[np.ndarray[Any, Any]], dtype: str) -> list[bool]:
        """Store each page (a copy is taken before returning: SGLang reuses its host
        buffers); per page whether the tiers hold it now. The ledger decides first: over
        the tenant's tier byte quota or the store budget a page is not written (False);
        a page another call is storing is True."""
        if not tenant or not hashes:
            return [False] * len(hashes)
        t0 = time.perf_counter()
        keys = self.keys(tenant, hashes)
        objects = [StoreObject(0, i, k, (), int(p.nbytes))
                   for i, (k, p) in enumerate(zip(keys, pages, strict=True))]
        d = self.decide_store(f"tenant:{tenant}", {"tenant": tenant}, objects, list(hashes))
        taken = {o.key.id for o in d.plan.objects} if d.plan is not None else set()
        dup = {o.key.id for o in objects if o.key.id not in taken and self.ledger.storing(
            o.key.id)}
        ok = {o.key.id: False for o in objects}
        if d.plan is not None:
            pool = default_pool()
            items = []
            for o in d.plan.objects:
                page = np.ascontiguousarray(pages[o.index]).reshape(-1).view(np.uint8)
                stored = _stored_dtype(dtype)
                meta = o.key.meta(token_start=0, token_end=max(1, self.identity.page_size),
                                  dtype=stored, shape=(page.nbytes // DTYPE_SIZES[stored],))
                items.append((o.key, Block(meta, cast("Buffer", pool.fill(
                    page.nbytes, _copier(page))))))
            timeout = self.rt.timeouts.store
            counts = self._call(self._put(items, timeout), timeout, None)
            held = tuple(n or 0 for n in counts) if counts else (0,) * len(self.tiers)
            done = any(n == len(items) for n in held)
            self.complete([(d.plan, done, held)])
            for k, _ in items:
                ok[k.id] = done
            self._figure(self._figures.backup_pgs, self._figures.backup_bandwidth,
                         len(items) if done else 0,
                         sum(int(pages[o.index].nbytes) for o in d.plan.objects) if done
                         else 0, time.perf_counter() - t0)
        return [ok[o.key.id] or o.key.id in dup for o in objects]

    async def _put(self, items: list[tuple[ObjectKey, Block]], timeout: float
                   ) -> list[int | None] | None:
        try:
            return await self.rt.connector.put_per_tier(items, timeout=timeout)
        except Exception as e:  # every tier failed: False per page, counted
            logger.info("%s: a store of %d pages failed: %r", self.who, len(items), e)
            return None

    def delete_stored(self) -> int:
        """Delete every page this process stored (SGLang's ``clear``): a shared tier holds
        other deployments' pages too, which are not this backend's to drop."""
        with self._lock:
            ids = list(self._tracked.keys)
        keys = [k for k in (self._known_key(i) for i in ids) if k is not None]
        if not keys:
            return 0
        timeout = self.rt.timeouts.store
        n: int = self._call(self.rt.connector.delete(keys, timeout=timeout), timeout, 0)
        return n

    def _known_key(self, sid: str) -> ObjectKey | None:
        for ns in list(self._ns.values()):
            if ns.owns(sid):
                return ObjectKey(ns, "kv", sid)
        return None

    # ------------------------------------------------------------------ figures
    def _figure(self, pages: list[int], bandwidth: list[float], n: int, nbytes: int,
                seconds: float) -> None:
        if n:
            pages.append(n)
            bandwidth.append(nbytes / max(seconds, 1e-9) / 1e9)

    def take_figures(self) -> StorageFigures:
        out, self._figures = self._figures, StorageFigures()
        return out


def _raw(page_hash: str) -> bytes:
    """SGLang's page hash (SHA-256 hex) as bytes; any other string as its UTF-8."""
    try:
        return bytes.fromhex(page_hash)
    except ValueError:
        return page_hash.encode()


def _stored_dtype(dtype: str) -> str:
    """The page's dtype as stored: SGLang's name where kvplugin's format knows it, else
    raw bytes (the pool's dtype is in the key's layout either way)."""
    return dtype if dtype in DTYPE_SIZES else "uint8"


def _copier(page: np.ndarray[Any, np.dtype[np.uint8]]) -> Any:
    def write(slot: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        slot[:] = page
    return write
