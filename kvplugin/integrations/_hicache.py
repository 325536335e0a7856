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

import asyncio
import concurrent.futures
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvplugin.aio.offload_ledger import StoreObject
from kvplugin.buffers import default_pool
from kvplugin.connectors.keys import ObjectKey, layout_fingerprint
from kvplugin.integrations._keyed import KeyedTiers, tenant_of_params
from kvplugin.serde import DTYPE_SIZES, Block

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["KV", "HiCacheCore", "PageIdentity", "PoolQuery", "PoolShape", "StorageFigures",
           "pool_hits"]

logger = logging.getLogger(__name__)

KV = "kv"  # SGLang's KV pool (PoolName.KV): kvplugin group 0; side pools follow in order


@dataclass(frozen=True, slots=True)
class PoolShape:
    """A host pool's pages, as SGLang registered the pool ("" / 0 before: legacy calls
    carry their own sizes, checked on every read)."""

    dtype: str = ""
    host_layout: str = ""
    page_size: int = 0
    page_bytes: int = 0


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

    def fingerprint(self, pool: str, shape: PoolShape) -> str:
        # MLA KV pages are the same bytes on every TP rank (SGLang's file backend shares
        # them); a side pool's state (Mamba) is sharded by TP whatever the attention.
        tp = (0, 1) if self.mla and pool == KV else self.tp
        return layout_fingerprint(
            kind="sglang_page", pool=pool, model=self.model, tp=tp, pp=self.pp,
            attn_cp=self.attn_cp, dcp=self.dcp, mla=self.mla, page_first=self.page_first,
            dtype=shape.dtype, host_layout=shape.host_layout, page_size=shape.page_size,
            page_bytes=shape.page_bytes)


@dataclass(frozen=True, slots=True)
class PoolQuery:
    """A side pool in an existence check (SGLang's ``PoolTransfer``): its name, hit policy
    (``all_pages`` / ``trailing_pages``), the window a trailing pool needs, and per KV page
    whether the pool holds that page's entry."""

    name: str
    policy: str
    trailing: int
    present: tuple[bool, ...]


def pool_hits(kv_pages: int, pools: Sequence[PoolQuery]
              ) -> tuple[int, dict[str, int], list[int]]:
    """SGLang's ``batch_exists_v2`` verdict from what the tiers hold: the usable prefix
    (pages), each pool's hit pages, and every restorable prefix length. ``all_pages``: the
    pool must hold every page up to the prefix; ``trailing_pages``: only the last
    ``trailing`` before it (a Mamba state at the node boundary), so prefix 5 may be
    restorable while 4 is not."""
    hit: dict[str, int] = {KV: kv_pages} if kv_pages else {}
    restorable = list(range(1, kv_pages + 1))
    for q in pools:
        if not restorable:
            break
        if q.policy == "all_pages":
            boundary = next((i for i in range(kv_pages) if not q.present[i]), kv_pages)
            ok = set(range(1, boundary + 1))
        elif q.policy == "trailing_pages":
            window = max(1, q.trailing)
            ok = {n for n in range(1, kv_pages + 1)
                  if all(q.present[i] for i in range(max(0, n - window), n))}
            boundary = max(ok, default=0)
        else:
            raise ValueError(f"pool {q.name}: hit policy {q.policy!r} is not served")
        if boundary:
            hit[q.name] = boundary
        restorable = [n for n in restorable if n in ok]
    return (restorable[-1] if restorable else 0), hit, restorable


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
        # The ledger sees every page as one object of one group (its sizes come with each
        # store); the pools are namespaces of their own.
        super().__init__(config_file, fingerprints=[identity.fingerprint(KV, PoolShape())],
                         group_tokens=[1], blocks_per_chunk=1, object_bytes=1,
                         default_tenant=default_tenant, events=events,
                         who="kvplugin's SGLang HiCache backend", engine="SGLang")
        self.identity = identity
        self.pools: dict[str, PoolShape] = {KV: PoolShape()}  # in group order
        self._figures = StorageFigures()

    @property
    def page_tokens(self) -> int:
        """Tokens per KV page (1 until SGLang registers its host pool)."""
        return max(1, self.pools[KV].page_size)

    def set_pool(self, name: str, shape: PoolShape) -> None:
        """SGLang registered a host pool: its pages' dtype, layout and size enter its keys
        from now on (a new side pool gets the next group)."""
        with self._lock:
            self.pools[name] = shape
            self.fingerprints = tuple(self.identity.fingerprint(n, s)
                                      for n, s in self.pools.items())
            self._ns.clear()

    def group_of(self, pool: str) -> int:
        try:
            return list(self.pools).index(pool)
        except ValueError:
            raise ValueError(f"pool {pool!r} is not registered (register_mem_host_pool_v2)"
                             ) from None

    def tenant(self, extra: dict[str, Any] | None) -> str:
        """The call's tenant (``""``: refused, every call a miss)."""
        name = tenant_of_params(extra, self._default)
        return self.open_request(f"tenant:{name}", {"tenant": name})

    def keys(self, tenant: str, hashes: Sequence[str], pool: str = KV) -> list[ObjectKey]:
        group = self.group_of(pool)
        return [self.key(tenant, group, _raw(h)) for h in hashes]

    def _call(self, coro: Any, timeout: float, default: Any) -> Any:
        """Run on the tiers' loop; past the deadline (and a second of grace for the loop
        itself) or on a closed loop, the default."""
        try:
            return self.rt.loop.call(coro, timeout + 1.0)
        except (concurrent.futures.TimeoutError, RuntimeError) as e:
            logger.warning("%s: a tier call gave up: %r", self.who, e)
            return default

    # ------------------------------------------------------------------ reads
    def exists_prefix(self, tenant: str, hashes: Sequence[str], pool: str = KV) -> int:
        """How many pages are present from the first, within the lookup deadline."""
        if not tenant or not hashes:
            return 0
        timeout = self.rt.timeouts.lookup
        keys = self.keys(tenant, hashes, pool)
        levels: list[int] = self._call(self.rt.connector.lookup_levels(keys, timeout=timeout),
                                       timeout, [])
        hits: dict[str, int] = {}
        for level in levels:
            name = self.tiers[level]
            hits[name] = hits.get(name, 0) + self.page_tokens
        if pool == KV:
            self.book_query(tenant, len(hashes) * self.page_tokens, hits)
        return len(levels)

    def present(self, tenant: str, hashes: Sequence[str], pool: str) -> list[bool]:
        """Per page, whether ``pool`` holds its entry (side pools' hit policies look at
        windows, not prefixes), all asked at once within the lookup deadline."""
        if not tenant or not hashes:
            return [False] * len(hashes)
        timeout = self.rt.timeouts.lookup
        keys = self.keys(tenant, hashes, pool)
        conn = self.rt.connector

        async def each() -> list[bool]:
            got = await asyncio.gather(*(conn.lookup([k], timeout=timeout) for k in keys))
            return [n == 1 for n in got]

        found: list[bool] = self._call(each(), timeout, [False] * len(keys))
        return found

    def get_pages(self, tenant: str, hashes: Sequence[str], nbytes: Sequence[int],
                  dtype: str, pool: str = KV) -> list[memoryview | None]:
        """Each page's verified bytes, or None: missing, damaged, of another size or dtype,
        or not read within the load deadline."""
        if not tenant:
            return [None] * len(hashes)
        t0 = time.perf_counter()
        timeout = self.rt.timeouts.load
        keys = self.keys(tenant, hashes, pool)
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
                  pages: Sequence[np.ndarray[Any, Any]], dtype: str, pool: str = KV
                  ) -> list[bool]:
        """Store each page (a copy is taken before returning: SGLang reuses its host
        buffers); per page whether the tiers hold it now. The ledger decides first: over
        the tenant's tier byte quota or the store budget a page is not written (False);
        a page another call is storing is True."""
        if not tenant or not hashes:
            return [False] * len(hashes)
        t0 = time.perf_counter()
        keys = self.keys(tenant, hashes, pool)
        objects = [StoreObject(0, i, k, (), int(p.nbytes))
                   for i, (k, p) in enumerate(zip(keys, pages, strict=True))]
        d = self.decide_store(f"tenant:{tenant}", {"tenant": tenant}, objects, list(hashes))
        taken = {o.key.id for o in d.plan.objects} if d.plan is not None else set()
        dup = {o.key.id for o in objects if o.key.id not in taken and self.ledger.storing(
            o.key.id)}
        ok = {o.key.id: False for o in objects}
        if d.plan is not None:
            payloads = default_pool()
            items = []
            for o in d.plan.objects:
                page = np.ascontiguousarray(pages[o.index]).reshape(-1).view(np.uint8)
                stored = _stored_dtype(dtype)
                meta = o.key.meta(token_start=0, token_end=self.page_tokens,
                                  dtype=stored, shape=(page.nbytes // DTYPE_SIZES[stored],))
                items.append((o.key, Block(meta, cast("Buffer", payloads.fill(
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
