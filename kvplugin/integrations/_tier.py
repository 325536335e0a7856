"""The engine-independent half of kvplugin as a vLLM secondary tier (:mod:`.vllm_tier`):
kvplugin's tiers under vLLM's own CPU offloading, moving whole chunks between vLLM's primary
CPU buffer and the tiers.

vLLM's ``TieringOffloadingManager`` decides what to cascade and what to promote; it hands
this tier jobs of keys (a chunk's last block hash + the KV-cache group) and primary slots.
What is left to decide here is decided by the offload ledger (:mod:`kvplugin.aio.
offload_ledger`'s keyed verbs), the rules the native manager and the KV connector execute:
the tenant's tier byte quota (on bytes *held*, from the tiers' events), deduplication of an
object another job is storing, and the in-flight store budget. Everything else is I/O on the
runtime's loop thread (:mod:`._runtime`), bounded by the deployment's deadlines: a lookup
that times out is a miss, a load that finds an object missing, damaged or of another shape
fails its job (vLLM recomputes), a store that fails or is shed over the budget fails its job
(vLLM's backpressure detector sees it).

An object is one primary chunk row, opaque bytes in vLLM's CPU layout (direct or canonical,
every worker's slot side by side), keyed ``Namespace(tenant, model, layout, group).key(block
hash)`` as every kvplugin object. The layout fingerprint names what makes those bytes
readable (vLLM's model and dtype, the row size, blocks per chunk, tokens per block and hash,
the group's layers, the parallel sizes, the KV cache layout): a different deployment never
reads them, and neither does the KV connector, whose objects are kvplugin's layout-free pages
(:mod:`._groups`) under another fingerprint (docs/vllm.md says why they cannot be shared).

Nothing here imports vLLM or torch; every call from vLLM comes through :mod:`.vllm_tier`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import functools
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvplugin.aio.offload_ledger import StoreObject
from kvplugin.aio.offload_types import StorePlan
from kvplugin.buffers import default_pool
from kvplugin.connectors.keys import ObjectKey, layout_fingerprint
from kvplugin.integrations._keyed import KeyedTiers
from kvplugin.serde import Block

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["ChunkLayout", "JobOutcome", "TierCore"]

logger = logging.getLogger(__name__)

OBJECT_KIND = "vllm_primary_chunk"  # the layout fingerprint's kind
_KEEP_IDS = 1 << 20  # storage ids remembered for KV events (oldest forgotten first)


@dataclass(frozen=True, slots=True)
class ChunkLayout:
    """What vLLM's primary chunk rows hold (its ``OffloadingConfig``), and so what an
    object's bytes are."""

    model: str  # vLLM's model, beside the deployment's model name
    dtype: str
    chunk_bytes: int  # one primary row (every worker's slot, alignment padding included)
    blocks_per_chunk: int
    tokens_per_hash: int
    group_tokens: tuple[int, ...]  # tokens per block, per group
    group_layers: tuple[tuple[str, ...], ...]
    windowed: tuple[bool, ...]  # per group: a sliding window (suffix lookups)
    parallel: tuple[int, int, int, int] = (1, 1, 1, 1)  # tp, pp, pcp, dcp
    kv_cache_layout: str = ""
    canonical: bool = False
    replicated: bool = False

    def chunk_tokens(self, group: int) -> int:
        return self.group_tokens[group] * self.blocks_per_chunk

    def fingerprint(self, group: int) -> str:
        layers = hashlib.sha256("\n".join(self.group_layers[group]).encode()).hexdigest()
        return layout_fingerprint(
            kind=OBJECT_KIND, model=self.model, dtype=self.dtype, row_bytes=self.chunk_bytes,
            blocks_per_chunk=self.blocks_per_chunk, tokens_per_hash=self.tokens_per_hash,
            tokens_per_block=self.group_tokens[group], layers=layers,
            parallel=self.parallel, kv_cache_layout=self.kv_cache_layout,
            canonical=self.canonical, replicated=self.replicated)


@dataclass(frozen=True, slots=True)
class JobOutcome:
    """How a job ended, for vLLM's ``JobResult``: ``loaded`` lists the keys a load copied in
    (all of them when ``success``); ``nbytes`` the bytes moved, ``seconds`` the I/O time."""

    job_id: int
    success: bool
    loaded: tuple[bytes, ...] = ()
    failed: tuple[bytes, ...] = ()
    nbytes: int = 0
    seconds: float = 0.0
    stored: tuple[int, ...] = ()  # a store: per tier, how many of its objects it holds


class TierCore(KeyedTiers):
    """kvplugin's tiers behind one vLLM secondary tier: primary rows in, jobs out."""

    def __init__(self, config_file: str, layout: ChunkLayout, primary: Any, *,
                 default_tenant: str = "default", events: bool = False) -> None:
        rows = _rows_of(primary, layout.chunk_bytes)
        super().__init__(config_file,
                         fingerprints=[layout.fingerprint(g)
                                       for g in range(len(layout.group_tokens))],
                         group_tokens=layout.group_tokens,
                         blocks_per_chunk=layout.blocks_per_chunk,
                         object_bytes=layout.chunk_bytes, default_tenant=default_tenant,
                         events=events, who="kvplugin's vLLM secondary tier")
        self.layout = layout
        self._rows = rows
        self._jobs: dict[int, concurrent.futures.Future[JobOutcome]] = {}
        self._plans: dict[int, StorePlan] = {}
        self._done: collections.deque[JobOutcome] = collections.deque()

    def object_key(self, tenant: str, okey: bytes) -> ObjectKey:
        """The kvplugin key of vLLM's ``OffloadKey`` (block hash + 4-byte group index)."""
        return self.key(tenant, _group(okey), bytes(okey[:-4]))

    # ------------------------------------------------------------------ lookups
    def lookup(self, req_id: str, params: dict[str, Any] | None,
               items: Sequence[tuple[bytes, int | None]]) -> list[bool]:
        """Which of a request's keys (with their end tokens, when vLLM recorded them) the
        tiers hold, within the lookup deadline (blocking: vLLM's lookup thread calls it;
        a slow or dead tier answers misses). Hits are booked to the tenant per tier."""
        tenant = self.open_request(req_id, params)
        if not tenant or not items:
            return [False] * len(items)
        timeout = self.rt.timeouts.lookup
        try:
            found = self.rt.loop.call(self._lookup(tenant, items, timeout), timeout + 1.0)
        except (concurrent.futures.TimeoutError, RuntimeError):
            found = [None] * len(items)
        hits: dict[str, int] = {}
        for (okey, _), level in zip(items, found, strict=True):
            if level is not None:
                name = self.tiers[level]
                hits[name] = hits.get(name, 0) + self.layout.chunk_tokens(_group(okey))
        self.book_query(tenant, sum(self.layout.chunk_tokens(_group(k)) for k, _ in items),
                        hits)
        return [level is not None for level in found]

    async def _lookup(self, tenant: str, items: Sequence[tuple[bytes, int | None]],
                      timeout: float) -> list[int | None]:
        """Per group, the keys in token order: a prefix from the tiers' prefix lookup;
        past it, a window group's keys one by one (vLLM asks those from the end), a prefix
        group's are misses (vLLM stops at the first)."""
        conn = self.rt.connector
        out: list[int | None] = [None] * len(items)
        by_group: dict[int, list[int]] = {}
        for i, (okey, _) in enumerate(items):
            by_group.setdefault(_group(okey), []).append(i)
        for group, idx in by_group.items():
            idx.sort(key=lambda i: (items[i][1] is None, items[i][1] or 0, i))
            keys = [self.object_key(tenant, items[i][0]) for i in idx]
            levels = await conn.lookup_levels(keys, timeout=timeout)
            for i, level in zip(idx, levels, strict=False):
                out[i] = level
            if self.layout.windowed[group]:
                for i, key in zip(idx[len(levels):], keys[len(levels):], strict=True):
                    one = await conn.lookup_levels([key], timeout=timeout)
                    out[i] = one[0] if one else None
        return out

    # ------------------------------------------------------------------ stores
    def submit_store(self, job_id: int, req_id: str, params: dict[str, Any] | None,
                     okeys: Sequence[bytes], slots: Sequence[int],
                     ends: Sequence[int | None]) -> None:
        """Decide (ledger) and start a job's store: nothing waits here."""
        if len(okeys) != len(slots) or len(okeys) != len(ends):
            raise ValueError(f"store job {job_id}: {len(okeys)} keys, {len(slots)} slots, "
                             f"{len(ends)} positions")
        tenant = self.open_request(req_id, params)
        objects = [self._store_object(tenant, k, e) for k, e in zip(okeys, ends, strict=True)
                   ] if tenant else []
        d = self.decide_store(req_id, params, objects, okeys)
        if d.plan is None:
            # A refused tenant, a quota shed, duplicates: decisions, not the tier falling
            # behind; a budget shed is (vLLM's backpressure detector counts the failure).
            self._done.append(JobOutcome(job_id, not d.over_budget))
            return
        self._plans[job_id] = d.plan
        at = {o.key.id: i for i, o in enumerate(objects)}
        work = [(o, int(slots[at[o.key.id]])) for o in d.plan.objects]
        over_budget = d.over_budget
        self._start(job_id, self._store(job_id, work, over_budget))

    def _store_object(self, tenant: str, okey: bytes, end: int | None) -> StoreObject:
        group = _group(okey)
        tokens = self.layout.chunk_tokens(group)
        index = max(0, (end or tokens) // tokens - 1)
        return StoreObject(group, index, self.object_key(tenant, okey), (),
                           self.layout.chunk_bytes)

    async def _store(self, job_id: int, work: list[tuple[StoreObject, int]],
                     partial: bool) -> JobOutcome:
        clock = self.rt.loop.loop.time
        t0 = clock()
        pool, size = default_pool(), self.layout.chunk_bytes
        items = []
        for o, slot in work:
            row = self._rows[slot]
            tokens = self.layout.chunk_tokens(o.group)
            meta = o.key.meta(token_start=o.index * tokens, token_end=(o.index + 1) * tokens,
                              dtype="uint8", shape=(1, size))
            items.append((o.key, Block(meta, cast("Buffer", pool.fill(size, _copier(row))))))
        try:
            counts = await self.rt.connector.put_per_tier(items, timeout=self.rt.timeouts.store)
        except Exception as e:
            logger.info("kvplugin tier: store job %d failed: %r", job_id, e)
            counts = [None] * len(self.tiers)
        held = tuple(n or 0 for n in counts)
        ok = any(n == len(items) for n in held)  # some tier took every write
        return JobOutcome(job_id, ok and not partial, nbytes=size * len(items) if ok else 0,
                          seconds=clock() - t0, stored=held)

    # ------------------------------------------------------------------ loads
    def submit_load(self, job_id: int, req_id: str, params: dict[str, Any] | None,
                    okeys: Sequence[bytes], slots: Sequence[int]) -> None:
        if len(okeys) != len(slots):
            raise ValueError(f"load job {job_id}: {len(okeys)} keys, {len(slots)} slots")
        tenant = self.open_request(req_id, params)
        if not tenant:
            self._done.append(JobOutcome(job_id, False, failed=tuple(okeys)))
            return
        self._start(job_id, self._load(job_id, tenant, list(okeys), [int(s) for s in slots]))

    async def _load(self, job_id: int, tenant: str, okeys: list[bytes],
                    slots: list[int]) -> JobOutcome:
        """Fetch (every object verified by the tier: checksums, key and namespace), check
        it is a row of this layout, copy it into its primary slot."""
        clock = self.rt.loop.loop.time
        t0 = clock()
        keys = [self.object_key(tenant, k) for k in okeys]
        blocks, levels = await self.rt.connector.get_located(keys,
                                                             timeout=self.rt.timeouts.load)
        loaded, failed, copied = [], [], []
        for okey, block, level, slot in zip(okeys, blocks, levels, slots, strict=True):
            if block is None or not self._fits(block):
                failed.append(okey)
                continue
            np.copyto(self._rows[slot], np.frombuffer(memoryview(block.payload), np.uint8))
            loaded.append(okey)
            copied.append((self.tiers[level], self.layout.chunk_bytes, False))
        self.book_load(tenant, copied, bool(failed))
        return JobOutcome(job_id, not failed, tuple(loaded), tuple(failed),
                          len(loaded) * self.layout.chunk_bytes, clock() - t0)

    def _fits(self, block: Block) -> bool:
        """A verified object is still refused unless it is one row of this layout (the
        fingerprint already names the row size: a mismatch is a damaged writer)."""
        m = block.meta
        if (m.dtype == "uint8" and m.shape == (1, self.layout.chunk_bytes)
                and memoryview(block.payload).nbytes == self.layout.chunk_bytes):
            return True
        self.refused_objects += 1
        logger.warning("kvplugin tier: refused object %s: dtype %s shape %s", m.key,
                       m.dtype, m.shape)
        return False

    # ------------------------------------------------------------------ jobs
    def _start(self, job_id: int, coro: Any) -> None:
        fut: concurrent.futures.Future[JobOutcome] = self.rt.loop.submit(coro)
        self._jobs[job_id] = fut
        fut.add_done_callback(functools.partial(self._ended, job_id))

    def _ended(self, job_id: int, fut: concurrent.futures.Future[JobOutcome]) -> None:
        try:
            out = fut.result()
        except BaseException as e:
            logger.warning("kvplugin tier: job %d raised %r", job_id, e)
            out = JobOutcome(job_id, False)
        self._done.append(out)

    def finished(self) -> list[JobOutcome]:
        """Jobs ended since the last call (scheduler thread); their plans completed."""
        out: list[JobOutcome] = []
        while self._done:
            o = self._done.popleft()
            self._jobs.pop(o.job_id, None)
            out.append(o)
        ended = [(plan, o.nbytes > 0, o.stored) for o in out
                 if (plan := self._plans.pop(o.job_id, None)) is not None]
        self.complete(ended)
        return out

    def pending(self) -> bool:
        return bool(self._jobs) or bool(self._done)

    def drain(self, timeout: float | None = None) -> bool:
        """Wait until every submitted job has ended (their outcomes stay queued)."""
        futs = list(self._jobs.values())
        _, not_done = concurrent.futures.wait(futs, timeout)
        return not not_done

    def close(self) -> None:
        if self.closed:
            return
        if not self.drain(self.rt.timeouts.store + self.rt.timeouts.load):
            logger.warning("kvplugin tier: shut down with jobs still running")
        self.release()
        # No view of vLLM's primary buffer may outlive the tier: vLLM releases its
        # memoryview (and unmaps the region) after shutting its tiers down.
        self._rows = np.empty((0, self.layout.chunk_bytes), np.uint8)


def _copier(row: np.ndarray[Any, np.dtype[np.uint8]]
            ) -> Callable[[np.ndarray[Any, np.dtype[np.uint8]]], None]:
    """What fills a pool slot with a copy of a primary row."""
    def write(slot: np.ndarray[Any, np.dtype[np.uint8]]) -> None:
        slot[:] = row
    return write


def _group(okey: bytes) -> int:
    return int.from_bytes(okey[-4:], "big")


def _rows_of(primary: Any, chunk_bytes: int) -> np.ndarray[Any, np.dtype[np.uint8]]:
    """vLLM's primary memoryview (rows of ``chunk_bytes``, any item format) as writable
    uint8 rows over the same memory."""
    arr = np.asarray(primary)
    if arr.ndim < 1 or arr.strides[0] != chunk_bytes:
        raise ValueError(f"the primary KV view's rows are {arr.strides[:1]} bytes apart, "
                         f"not the chunk size {chunk_bytes}")
    if not arr.flags.c_contiguous:
        raise ValueError("the primary KV view must be C-contiguous")
    rows = arr.reshape(arr.shape[0], -1).view(np.uint8)
    if rows.shape[1] != chunk_bytes:
        raise ValueError(f"a primary row holds {rows.shape[1]} bytes, not {chunk_bytes}")
    return rows
