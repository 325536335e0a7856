"""The worker side of the vLLM connector: loads into and stores out of vLLM's KV tensors.

Loads: a step's synchronous loads are in the tensors when ``start_load_kv`` returns (the
forward reads them); async ones report through ``get_transfer_results``. A load that
misses or fails verification is reported the way vLLM 0.33 accepts for the layout:

* one KV-cache group (``per_request`` False): the block ids from the first bad object on,
  through ``get_block_ids_with_load_errors`` (vLLM truncates to the first one);
* several groups: the request id, as finished *and* failed receiving (block ids are unique
  per group only; vLLM raises on them and resets the request to recompute).

Stores copy the pages out at ``wait_for_save`` (the device may reuse the blocks at once;
a Mamba state block is not even held by the request) and finish in the background.
"""

from __future__ import annotations

import concurrent.futures
import importlib
import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

from kvplugin.aio.objects import ObjectSpec, chunk_spec, state_spec
from kvplugin.aio.tier_events import TierEventView
from kvplugin.connectors.keys import ObjectKey
from kvplugin.integrations import _events
from kvplugin.integrations._groups import pages_out
from kvplugin.integrations._stats import KVPluginStats
from kvplugin.serde import Block

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvplugin.integrations._groups import GroupIO, PageMap
    from kvplugin.integrations._hits import Piece
    from kvplugin.integrations._runtime import Runtime

__all__ = ["WorkerSide"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class _Pending:
    """An async load in flight."""

    spec: Any  # LoadSpec
    future: concurrent.futures.Future[list[Block | None]]


@dataclass(slots=True)
class _Put:
    """A store in flight (``described``: its objects the tier event view knows)."""

    future: concurrent.futures.Future[int]
    count: int
    described: list[str]
    nbytes: int


@dataclass(slots=True)
class _WorkerState:
    saves: dict[str, list[_Put]] = field(default_factory=dict)
    loads: dict[str, _Pending] = field(default_factory=dict)
    awaiting_send: set[str] = field(default_factory=set)
    load_errors: set[int] = field(default_factory=set)
    failed_loads: set[str] = field(default_factory=set)  # finished with a failure
    stats: KVPluginStats = field(default_factory=KVPluginStats)
    # Tier events on: what this worker's stored objects stand for, and its subscription.
    view: TierEventView | None = None
    subscription: int = -1


class WorkerSide:
    """Mixed into the connector; expects ``_rt``, ``_groups`` and ``_copy_in``."""

    _rt: Runtime | None  # the tiers: on the worker's connector only
    _groups: list[GroupIO]
    _chunk_blocks: int  # pages per chunk object (the layout's)
    _maps: list[PageMap]
    _w: _WorkerState

    def _init_worker(self, chunk_blocks: int, events: bool) -> None:
        self._chunk_blocks = chunk_blocks
        self._maps = []
        self._w = _WorkerState()
        if events and self._rt is not None:
            self._w.view = TierEventView()
            self._w.subscription = self._rt.subscribe_events()

    if TYPE_CHECKING:  # provided by vLLM's base class and by the connector
        def _get_connector_metadata(self) -> Any: ...

        def _copy_in(self, piece: Piece, payload: Any) -> None: ...

    @property
    def _tiers(self) -> Runtime:
        if self._rt is None:
            raise RuntimeError("a worker call on the scheduler's KVPluginConnector")
        return self._rt

    def wait_for_stores(self, timeout: float | None = None) -> bool:
        """Block until every store handed to the tiers so far has ended (``timeout``
        seconds at most; the store timeout when None); False if some still run. vLLM never
        calls it: shutdown does, and a harness that must see a step's stores in the tiers
        before it sends the next request (stores otherwise end on the tiers' time)."""
        futures = [p.future for puts in self._w.saves.values() for p in puts]
        limit = self._tiers.timeouts.store if timeout is None else timeout
        return not concurrent.futures.wait(futures, timeout=limit).not_done

    # ------------------------------------------------------------------ loads
    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        """Start this step's loads; synchronous ones are in the tensors on return (the
        model reads them in this forward), async ones report through get_finished."""
        meta = self._get_connector_metadata()
        timeout = self._tiers.timeouts.load
        for spec in meta.loads:
            fut: concurrent.futures.Future[list[Block | None]]
            if spec.broken:
                fut = concurrent.futures.Future()
                fut.set_result([None] * len(spec.pieces))
            else:
                keys = [p.key for p in spec.pieces]
                fut = self._tiers.loop.submit(self._tiers.connector.get(keys, timeout=timeout))
            if spec.is_async:
                self._w.loads[spec.req_id] = _Pending(spec, fut)
            else:
                self._finish_load(spec, fut)
        for rid in meta.delayed_frees:
            self._w.awaiting_send.add(rid)

    def _finish_load(self, spec: Any, fut: concurrent.futures.Future[list[Block | None]]
                     ) -> bool:
        """Copy a finished load in; False when an object is missing or bad (reported)."""
        try:
            blocks: list[Block | None] = fut.result(self._tiers.timeouts.load + 1.0)
        except Exception as e:
            logger.warning("kvplugin load for %s failed: %r", spec.req_id, e)
            blocks = [None] * len(spec.pieces)
        stats = self._w.stats
        blocks = [b if self._expected(p).accepts(b) else None
                  for p, b in zip(spec.pieces, blocks, strict=True)]
        stats.add("objects_refused", sum(b is None for b in blocks))
        if spec.per_request and any(b is None for b in blocks):
            # Nothing is copied: vLLM starts the request over and recomputes it all.
            self._w.failed_loads.add(spec.req_id)
            stats.add("loads_failed")
            return False
        for i, (piece, block) in enumerate(zip(spec.pieces, blocks, strict=True)):
            if block is None:
                # vLLM recomputes from the first bad block: report every block from here.
                for p in spec.pieces[i:]:
                    self._w.load_errors.update(b for b in p.block_ids if b)
                stats.add("loads_failed")
                return False
            self._copy_in(piece, block.payload)
            stats.add("objects_loaded")
            stats.add("bytes_loaded", memoryview(block.payload).nbytes)
        stats.add("loads")
        return True

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # synchronous loads completed in start_load_kv

    # ------------------------------------------------------------------ stores
    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # pages are copied once per step, in wait_for_save

    def wait_for_save(self) -> None:
        """Copy this step's objects out of the KV tensors (the device may reuse the blocks
        at once) and hand them to the tiers; the puts finish in the background."""
        meta = self._get_connector_metadata()
        failed = self._w.load_errors  # this step's: vLLM collects them after the save
        for spec in meta.saves:
            if failed and not failed.isdisjoint(spec.reads):
                # Computed from a block whose bytes never arrived: storing it would put
                # wrong KV under the right key, for every later engine to load.
                logger.debug("kvplugin: store of %s withheld: it read a failed load",
                             spec.req_id)
                self._w.stats.add("stores_withheld", len(spec.pieces))
                continue
            items = self._items_out(spec.pieces)
            rt = self._tiers
            fut = rt.loop.submit(rt.connector.put(items, timeout=rt.timeouts.store))
            described = []
            if self._w.view is not None:
                for p in spec.pieces:
                    if p.event is not None:  # its events may come from now on
                        self._w.view.describe(p.key.id, _events.info_of(p.event))
                        described.append(p.key.id)
            nbytes = sum(memoryview(b.payload).nbytes for _, b in items)
            self._w.saves.setdefault(spec.req_id, []).append(
                _Put(fut, len(items), described, nbytes))

    def _items_out(self, pieces: list[Piece]) -> list[tuple[ObjectKey, Block]]:
        return [(p.key, Block(self._expected(p).meta(),
                              cast("Buffer", pages_out(self._maps[p.group], p.block_ids))))
                for p in pieces]

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
    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None,
                                                                set[str] | None]:
        """(finished_sending, finished_recving): delayed frees whose stores are done, async
        loads that completed (copied into the tensors here, errors recorded)."""
        sending = set()
        for rid in list(self._w.awaiting_send):
            puts = self._w.saves.get(rid, [])
            if all(p.future.done() for p in puts):
                self._settle(rid, puts)
                self._w.saves.pop(rid, None)
                self._w.awaiting_send.discard(rid)
                sending.add(rid)
        recving = set()
        for rid, pending in list(self._w.loads.items()):
            if pending.future.done():
                del self._w.loads[rid]
                self._finish_load(pending.spec, pending.future)
                recving.add(rid)
        # Saves of requests that finished without a delayed free (or still run).
        for rid in list(self._w.saves):
            if rid not in self._w.awaiting_send:
                done = [p for p in self._w.saves[rid] if p.future.done()]
                self._settle(rid, done)
                left = [p for p in self._w.saves[rid] if not p.future.done()]
                if left:
                    self._w.saves[rid] = left
                else:
                    del self._w.saves[rid]
        return sending or None, recving or None

    def get_transfer_results(self, finished_req_ids: set[str]) -> Any:
        """vLLM 0.33's results: get_finished's, plus the async loads that failed (a request
        of a multi-group layout; it is in finished_recving too, as vLLM requires)."""
        base = importlib.import_module("vllm.distributed.kv_transfer.kv_connector.v1.base")
        sending, recving = self.get_finished(finished_req_ids)
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
                logger.warning("kvplugin store for %s failed: %r", rid, exc)
                self._w.stats.add("stores_failed")
            elif p.future.result() >= p.count:
                self._w.stats.add("objects_stored", p.count)
                self._w.stats.add("bytes_stored", p.nbytes)
            else:
                self._w.stats.add("stores_failed")

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._w.load_errors = self._w.load_errors, set()
        return errors

    def get_kv_connector_stats(self) -> KVPluginStats | None:
        """This worker's counts since the last call (vLLM sums them over workers, logs
        them and exports them to Prometheus: :mod:`._stats`)."""
        stats = self._w.stats
        if stats.is_empty():
            return None
        self._w.stats = KVPluginStats()
        return stats

    def get_kv_connector_kv_cache_events(self) -> Any:
        """The tiers' ``BlockStored`` / ``BlockRemoved`` since the last call (:mod:`._events`)."""
        view = self._w.view
        if view is None or self._rt is None:
            return None
        told = view.apply(self._rt.take_events(self._w.subscription))
        if not told:
            return None
        events = _events.new_events(1)
        events.add_events([_events.to_vllm(e) for e in told])
        return events
