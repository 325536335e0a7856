"""The worker half of the vLLM connector: loads into and stores out of vLLM's KV tensors,
and the reports of how each ended (:mod:`._outcomes`).

Loads: a step's synchronous loads are in the tensors when ``start_load`` returns (the
forward reads them); async ones report through ``get_finished``. A load that misses or
fails verification is reported the way vLLM 0.33 accepts for the layout:

* one KV-cache group (``per_request`` False): the block ids from the first bad object on,
  through ``get_block_ids_with_load_errors`` (vLLM truncates to the first one);
* several groups: the request id, as finished *and* failed receiving (block ids are unique
  per group only; vLLM raises on them and resets the request to recompute).

Stores copy the pages out at ``wait_for_save`` (the device may reuse the blocks at once;
a Mamba state block is not even held by the request) and finish in the background. How
every store plan and load ended goes back to the scheduler's ledger in the step's worker
metadata, with the tiers' object events (the tenants' held bytes).

Loud tiers: a tier that fails its health check at start is one warning (or, with
``offload.require_tiers``, a failed start); tier errors are counted per tier in vLLM's
stats and logged at most once per tier per interval, with the count.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from kvplugin.aio.jobs import connector_tiers
from kvplugin.aio.objects import ObjectSpec, chunk_spec, state_spec
from kvplugin.aio.tier_events import TierEventView, tier_media
from kvplugin.buffers import default_pool
from kvplugin.integrations import _events
from kvplugin.integrations._groups import pages_in, pages_out_many
from kvplugin.integrations._outcomes import KVPluginWorkerMeta, LoadOutcome, StoreOutcome
from kvplugin.integrations._stats import KVPluginStats, RateLimitedLog
from kvplugin.serde import Block

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvplugin.integrations._groups import GroupIO, PageMap
    from kvplugin.integrations._hits import Piece
    from kvplugin.integrations._runtime import Runtime

__all__ = ["WorkerSide", "check_tiers"]

logger = logging.getLogger(__name__)

@dataclass(slots=True)
class _Fetched:
    """A load's objects, fetched and verified on the loop thread, their pages staged for
    one scatter per group: ``staged`` holds (group, block ids, pages back to back, pages
    to skip). ``bad``: the first piece missing or refused (None: all good); ``copied``:
    (tier level, bytes, is a state) of each piece before it."""

    bad: int | None
    refused: int
    staged: list[tuple[int, list[int], Any, int]]
    copied: tuple[tuple[int, int, bool], ...]


@dataclass(slots=True)
class _Pending:
    """An async load in flight."""

    spec: Any  # LoadSpec
    future: concurrent.futures.Future[_Fetched]


@dataclass(slots=True)
class _Put:
    """A store in flight (``described``: its objects the tier event view knows)."""

    plan: int
    future: concurrent.futures.Future[list[int | None]]
    described: list[str]


@dataclass(slots=True)
class _WorkerState:
    saves: dict[str, list[_Put]] = field(default_factory=dict)
    loads: dict[str, _Pending] = field(default_factory=dict)
    awaiting_send: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)  # finished with a failure
    stats: KVPluginStats = field(default_factory=KVPluginStats)
    reports: KVPluginWorkerMeta = field(default_factory=KVPluginWorkerMeta)
    # Tier events on: what this worker's stored objects stand for, and its subscription.
    view: TierEventView | None = None
    subscription: int = -1
    feed: int = -1  # the subscription whose events go to the scheduler (held bytes)
    tier_errors: list[int] = field(default_factory=list)  # per tier, at the last report


class WorkerSide:
    """One worker's I/O over the tiers of ``rt``, into and out of vLLM's tensors as
    mapped by ``maps`` (set at ``register_kv_caches``).

    The engine's thread does the copies, one gather / scatter per group and object size
    for a whole step's objects; the loop thread does the rest (fetching, verifying and
    staging loaded pages; describing, encoding and writing stored objects)."""

    def __init__(self, rt: Runtime, groups: list[GroupIO], chunk_blocks: int, *,
                 events: bool, feed: bool, unhealthy: Sequence[str] = ()) -> None:
        self._rt = rt
        self._groups = groups
        self._chunk_blocks = chunk_blocks
        self.maps: list[PageMap] = []
        self._w = _WorkerState()
        tiers = connector_tiers(rt.connector)
        self._tier_names = [t.name for t in tiers]
        self._w.tier_errors = [0] * len(self._tier_names)
        self._log = RateLimitedLog()
        for name in unhealthy:  # the start's warning was its line: the errors wait their turn
            self._log.logged(f"tier:{name}")
        if events:
            self._w.view = TierEventView(media=tier_media(tiers))
            self._w.subscription = rt.subscribe_events()
        if feed:
            self._w.feed = rt.subscribe_events()

    @property
    def runtime(self) -> Runtime:
        return self._rt

    def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Block until every store handed to the tiers so far has ended (``timeout``
        seconds at most; the store timeout when None); False if some still run. vLLM never
        calls it: shutdown does, and a harness that must see a step's stores in the tiers
        before it sends the next request (stores otherwise end on the tiers' time)."""
        futures = [p.future for puts in self._w.saves.values() for p in puts]
        limit = self._rt.timeouts.store if timeout is None else timeout
        return not concurrent.futures.wait(futures, timeout=limit).not_done

    # ------------------------------------------------------------------ loads
    def start_load(self, meta: Any) -> None:
        """Start this step's loads; synchronous ones are in the tensors on return (the
        model reads them in this forward), async ones report through get_finished."""
        rt = self._rt
        for spec in meta.loads:
            fut: concurrent.futures.Future[_Fetched]
            if spec.broken:
                fut = concurrent.futures.Future()
                fut.set_result(_Fetched(0, len(spec.pieces), [], ()))
            else:
                fut = rt.loop.submit(self._fetch(spec))
            if spec.is_async:
                self._w.loads[spec.req_id] = _Pending(spec, fut)
            else:
                self._finish_load(spec, fut)
        for rid in meta.delayed_frees:
            self._w.awaiting_send.add(rid)

    async def _fetch(self, spec: Any) -> _Fetched:
        """On the loop thread: a load's objects from the tiers, each verified against what
        it must be, the good ones' pages staged per group (a miss or a refusal ends the
        copyable run; with ``per_request`` nothing is copied)."""
        pieces = spec.pieces
        try:
            blocks, levels = await self._rt.connector.get_located(
                [p.key for p in pieces], timeout=self._rt.timeouts.load)
        except Exception as e:
            self._log.warn("load", "load for %s failed: %r (a miss)", spec.req_id, e)
            return _Fetched(0, len(pieces), [], ())
        ok = [self._expected(p).accepts(b) for p, b in zip(pieces, blocks, strict=True)]
        bad = next((i for i, good in enumerate(ok) if not good), None)
        n = len(pieces) if bad is None else 0 if spec.per_request else bad
        good = cast("list[Block]", blocks[:n])
        copied = tuple((level, memoryview(b.payload).nbytes, p.state)
                       for p, b, level in zip(pieces[:n], good, levels[:n], strict=True))
        return _Fetched(bad, ok.count(False), self._stage(pieces[:n], good), copied)

    def _stage(self, pieces: list[Piece], blocks: list[Block]
               ) -> list[tuple[int, list[int], Any, int]]:
        """Per group, the pages the pieces fill, back to back in one pooled buffer (one
        piece: its payload as it is, with its skip), and their block ids in order."""
        by_group: dict[int, list[int]] = {}
        for i, p in enumerate(pieces):
            by_group.setdefault(p.group, []).append(i)
        out: list[tuple[int, list[int], Any, int]] = []
        for g, idx in by_group.items():
            if len(idx) == 1:
                p = pieces[idx[0]]
                out.append((g, p.block_ids, blocks[idx[0]].payload, p.skip))
                continue
            page = self._groups[g].shape.page_bytes
            spans = [(np.frombuffer(cast("Any", blocks[i].payload), dtype=np.uint8),
                      pieces[i].skip * page,
                      len(pieces[i].block_ids) * page) for i in idx]

            def write(out_buf: np.ndarray[Any, Any],
                      spans: list[tuple[Any, int, int]] = spans) -> None:
                at = 0
                for raw, start, size in spans:
                    out_buf[at:at + size] = raw[start:start + size]
                    at += size

            staged = default_pool().fill(sum(size for _, _, size in spans), write)
            out.append((g, [b for i in idx for b in pieces[i].block_ids], staged, 0))
        return out

    def _finish_load(self, spec: Any, fut: concurrent.futures.Future[_Fetched]) -> bool:
        """Copy a finished load in (one scatter per group); False when an object is
        missing or bad (reported)."""
        try:
            got = fut.result(self._rt.timeouts.load + 1.0)
        except Exception as e:  # the loop thread did not answer in time
            self._log.warn("load", "load for %s failed: %r (a miss)", spec.req_id, e)
            got = _Fetched(0, len(spec.pieces), [], ())
        self._w.stats.add("objects_refused", got.refused)
        if got.bad is not None and spec.per_request:
            # Nothing is copied: vLLM starts the request over and recomputes it all.
            self._w.failed_loads.add(spec.req_id)
            self._report_load(spec, spec.first_token, ())
            return False
        for group, block_ids, payload, skip in got.staged:
            pages_in(self.maps[group], block_ids, payload, skip)
        if got.bad is not None:
            # vLLM recomputes from the first bad block: report every block from here.
            for p in spec.pieces[got.bad:]:
                self._w.load_errors.update(b for b in p.block_ids if b)
            first = spec.pieces[got.bad]
            verified = max(spec.first_token, first.first_token)
            self._report_load(spec, verified, got.copied)
            return False
        self._report_load(spec, spec.end_token, got.copied)
        return True

    def _report_load(self, spec: Any, verified: int,
                     copied: tuple[tuple[int, int, bool], ...]) -> None:
        self._w.reports.loads.append(LoadOutcome(spec.req_id, spec.first_token,
                                                 spec.end_token, verified, copied))

    # ------------------------------------------------------------------ stores
    def wait_for_save(self, meta: Any) -> None:
        """Copy this step's objects out of the KV tensors (the device may reuse the blocks
        at once), all of them in one gather per group and object size; the loop thread
        describes and writes them, and the puts finish in the background."""
        failed = self._w.load_errors  # this step's: vLLM collects them after the save
        kept = []
        for spec in meta.saves:
            if failed and not failed.isdisjoint(spec.reads):
                # Computed from a block whose bytes never arrived: storing it would put
                # wrong KV under the right key, for every later engine to load.
                logger.debug("kvplugin: store of %s withheld: it read a failed load",
                             spec.req_id)
                self._w.stats.add("stores_withheld", len(spec.pieces))
                self._w.reports.stores.append(StoreOutcome(spec.plan, False))
            else:
                kept.append(spec)
        if not kept:
            return
        payloads = self._copy_out([p for spec in kept for p in spec.pieces])
        rt, at = self._rt, 0
        for spec in kept:
            n = len(spec.pieces)
            fut = rt.loop.submit(self._put(spec.pieces, payloads[at:at + n]))
            at += n
            described = []
            if self._w.view is not None:
                for p in spec.pieces:
                    if p.event is not None:  # its events may come from now on
                        self._w.view.describe(p.key.id, _events.info_of(p.event))
                        described.append(p.key.id)
            self._w.saves.setdefault(spec.req_id, []).append(
                _Put(spec.plan, fut, described))

    def _copy_out(self, pieces: list[Piece]) -> list[Any]:
        """Every piece's pages, one gather per group and object size (a step's chunks of
        a group are one size, its states another) into payloads of their own."""
        by_size: dict[tuple[int, int], list[int]] = {}
        for i, p in enumerate(pieces):
            by_size.setdefault((p.group, len(p.block_ids)), []).append(i)
        out: list[Any] = [None] * len(pieces)
        for (group, _), idx in by_size.items():
            got = pages_out_many(self.maps[group], [pieces[i].block_ids for i in idx])
            for i, payload in zip(idx, got, strict=True):
                out[i] = payload
        return out

    async def _put(self, pieces: list[Piece], payloads: list[Any]) -> list[int | None]:
        """On the loop thread: the pieces as stored objects, handed to every tier."""
        items = [(p.key, Block(self._expected(p).meta(), cast("Buffer", payload)))
                 for p, payload in zip(pieces, payloads, strict=True)]
        return await self._rt.connector.put_per_tier(items, timeout=self._rt.timeouts.store)

    def _expected(self, piece: Piece) -> ObjectSpec:
        """The stored object a piece is (:mod:`kvplugin.aio.objects`, the native manager's
        description): a load piece's first block is ``skip`` pages into its chunk, and the
        chunk has the layout's ``chunk_blocks`` pages; a store piece is a whole chunk."""
        shape = self._groups[piece.group].shape
        if piece.state:
            return state_spec(piece.key, shape, piece.first_token)
        start = piece.first_token - piece.skip * shape.block_size
        return chunk_spec(piece.key, shape, start, self._chunk_blocks)

    # ------------------------------------------------------------------ results
    def get_finished(self) -> tuple[set[str] | None, set[str] | None]:
        """(finished_sending, finished_recving): delayed frees, async loads that completed
        (copied into the tensors here, errors recorded).

        A delayed free is sent at once: its pages were copied out at this step's
        ``wait_for_save`` at the latest (a finished request's last pieces, a partial tail,
        are in the step that carries its free), and the tiers write from those copies, so
        vLLM may reuse the blocks now. Holding them until the writes end (a disk's, a
        remote's) kept finished requests' blocks from waiting ones for steps."""
        sending = set(self._w.awaiting_send)
        self._w.awaiting_send.clear()
        recving = set()
        for rid, pending in list(self._w.loads.items()):
            if pending.future.done():
                del self._w.loads[rid]
                self._finish_load(pending.spec, pending.future)
                recving.add(rid)
        # Stores whose writes ended, whatever became of their requests.
        for rid in list(self._w.saves):
            puts = self._w.saves[rid]
            done = [p for p in puts if p.future.done()]
            self._settle(rid, done)
            # The rest by what was settled, not by asking again: a put that ends between
            # the two looks would be in neither list, its plan never reported (the budget
            # bytes it holds on the scheduler never freed).
            settled = {id(p) for p in done}
            left = [p for p in puts if id(p) not in settled]
            if left:
                self._w.saves[rid] = left
            else:
                del self._w.saves[rid]
        return sending or None, recving or None

    def get_transfer_results(self) -> Any:
        """vLLM 0.33's results: get_finished's, plus the async loads that failed (a request
        of a multi-group layout; it is in finished_recving too, as vLLM requires)."""
        base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        sending, recving = self.get_finished()
        failed, self._w.failed_loads = self._w.failed_loads & set(recving or ()), set()
        return base.KVConnectorTransferResults(finished_sending=set(sending or ()),
                                               finished_recving=set(recving or ()),
                                               failed_recving=failed)

    def _settle(self, rid: str, puts: list[_Put]) -> None:
        for p in puts:
            if self._w.view is not None:
                self._w.view.settle(p.described)
            exc = None if p.future.cancelled() else p.future.exception()
            if p.future.cancelled() or exc is not None:
                self._log.warn("store", "store for %s failed: %r", rid, exc)
                self._w.reports.stores.append(StoreOutcome(p.plan, False))
                continue
            # Done as natively (:func:`kvplugin.aio.jobs.run_store`): some tier took the
            # write; each tier is charged what it holds.
            counts = tuple(0 if n is None else n for n in p.future.result())
            self._w.reports.stores.append(StoreOutcome(p.plan, True, counts))

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._w.load_errors = self._w.load_errors, set()
        return errors

    def build_connector_worker_meta(self) -> KVPluginWorkerMeta | None:
        """How this step's stores and loads ended, and the tiers' events since the last
        call, for the scheduler's ledger (:mod:`._outcomes`)."""
        reports = self._w.reports
        if self._w.feed >= 0:
            reports.events.extend(self._rt.take_events(self._w.feed))
        if not (reports.stores or reports.loads or reports.events):
            return None
        self._w.reports = KVPluginWorkerMeta()
        reports.tiers = tuple(self._tier_names)
        return reports

    def get_kv_connector_stats(self) -> KVPluginStats | None:
        """This worker's counts since the last call: refused objects, withheld stores and
        each tier's errors (a tier that fails is logged once per interval)."""
        stats = self._w.stats
        for i, tier in enumerate(connector_tiers(self._rt.connector)):
            errors = tier.stats().errors
            new = errors - self._w.tier_errors[i]
            if new > 0:
                name = self._tier_names[i]
                stats.add("tier_errors", new, tier=name)
                self._log.warn(f"tier:{name}", "tier %s: %d backend calls failed since the "
                               "last report (%d in all); stores and loads go on without it",
                               name, new, errors)
            self._w.tier_errors[i] = errors
        if stats.is_empty():
            return None
        self._w.stats = KVPluginStats()
        return stats

    def get_kv_connector_kv_cache_events(self) -> Any:
        """The tiers' ``BlockStored`` / ``BlockRemoved`` since the last call (:mod:`._events`)."""
        view = self._w.view
        if view is None:
            return None
        told = view.apply(self._rt.take_events(self._w.subscription))
        if not told:
            return None
        events = _events.new_events(1)
        events.add_events([_events.to_vllm(e) for e in told])
        return events


def check_tiers(rt: Runtime, require: bool) -> list[str]:
    """The tiers' health at engine start: the failing tiers are one warning in vLLM's log
    (their names returned); ``require`` (``offload.require_tiers``) makes any failure fail
    the start."""
    tiers = connector_tiers(rt.connector)
    timeout = min(rt.timeouts.store, 5.0)
    bad, names = [], []
    for t in tiers:
        try:
            h = rt.loop.call(t.health(timeout=timeout), timeout=timeout + 1.0)
            ok, detail = h.ok, h.detail
        except Exception as e:  # a probe that cannot run is a failed probe
            ok, detail = False, repr(e)
        if not ok:
            bad.append(f"{t.name} ({detail})")
            names.append(t.name)
    if not bad:
        return []
    msg = f"kvplugin: tier(s) failed their health check at start: {'; '.join(bad)}"
    if require:
        raise RuntimeError(msg + " (offload.require_tiers is true)")
    logger.warning("%s; kvplugin goes on with the others and counts the failures as "
                   "tier_errors", msg)
    return names
