"""The trace ops that read or drain the manager's state, and the connector-path ops (mixed
into :class:`~kvplugin.replay.Replayer`, whose ``op_*`` methods are its handlers): each
runs the manager call and, when recording, returns what FORMAT.md says it records."""

from __future__ import annotations

from collections import deque
from typing import TYPE_CHECKING, Any

from kvplugin.core.blocks import KVCacheBlock
from kvplugin.core.manager import KVCacheBlocks, KVCacheManager
from kvplugin.core.metrics import KVCacheMetricsCollector
from kvplugin.trace_format import TraceError

if TYPE_CHECKING:
    from kvplugin.core.request import Request

__all__ = ["ReadOps"]


class ReadOps:
    """Expects the replayer's manager, lookups, popped blocks and metrics collector."""

    manager: KVCacheManager
    lookups: dict[str, tuple[KVCacheBlocks, int]]
    popped: dict[str, deque[list[KVCacheBlock]]]
    metrics: KVCacheMetricsCollector | None

    if TYPE_CHECKING:  # the replayer's own
        def _req(self, op: dict[str, Any]) -> Request: ...

        def _known_id(self, op: dict[str, Any]) -> str: ...

        def _free(self) -> int: ...

        def _event(self, ev: Any) -> dict[str, Any]: ...

    def op_get_num_common_prefix_blocks(self, op: dict[str, Any],
                                        record: bool) -> dict[str, Any] | None:
        r = self.manager.get_num_common_prefix_blocks(self._known_id(op))
        return {"num_common_prefix_blocks": list(r)} if record else None

    def op_get_block_ids(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        ids = self.manager.get_block_ids(self._known_id(op))
        return {"block_ids": [list(g) for g in ids]} if record else None

    def op_take_events(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        events = self.manager.take_events()
        return {"events": [self._event(e) for e in events]} if record else None

    def op_make_prefix_cache_stats(self, op: dict[str, Any],
                                   record: bool) -> dict[str, Any] | None:
        s = self.manager.make_prefix_cache_stats()
        if not record:
            return None
        if s is None:
            return {"stats": None}
        return {"stats": {"reset": s.reset, "requests": s.requests, "queries": s.queries,
                          "hits": s.hits, "preempted_requests": s.preempted_requests,
                          "preempted_queries": s.preempted_queries,
                          "preempted_hits": s.preempted_hits}}

    def op_take_kv_cache_block_copies(self, op: dict[str, Any],
                                      record: bool) -> dict[str, Any] | None:
        copies, retained = self.manager.take_kv_cache_block_copies()
        if op.get("free_retained", True) and retained:
            self.manager.free_retained_blocks(retained)
        if not record:
            return None
        return {"copies": [[c.src_block_id, c.dst_block_id] for c in copies],
                "num_free_blocks": self._free()}

    def op_free_queue(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        q = self.manager.block_pool.free_block_queue.get_all_free_blocks()
        return {"free_block_ids": [b.block_id for b in q]} if record else None

    # ------------------------------------------------------------------ connector paths
    def op_take_boundary_state_offloads(self, op: dict[str, Any],
                                        record: bool) -> dict[str, Any] | None:
        offloads = self.manager.take_boundary_state_offloads()
        if not record:
            return None
        return {"offloads": {rid: [list(e) for e in entries]
                             for rid, entries in offloads.items()}}

    def op_finalize_partial_tail_offloads(self, op: dict[str, Any],
                                          record: bool) -> dict[str, Any] | None:
        offloads = self.manager.finalize_partial_tail_offloads(self._req(op))
        return {"offloads": [list(e) for e in offloads]} if record else None

    def op_remove_skipped_blocks(self, op: dict[str, Any],
                                 record: bool) -> dict[str, Any] | None:
        self.manager.remove_skipped_blocks(self._known_id(op), op["processed_computed_tokens"],
                                           op.get("num_prompt_tokens"))
        return {"num_free_blocks": self._free()} if record else None

    def op_get_block_ids_for_computed_tokens(self, op: dict[str, Any],
                                             record: bool) -> dict[str, Any] | None:
        ids = self.manager.get_block_ids_for_computed_tokens(self._known_id(op),
                                                             op["num_computed_tokens"])
        return {"block_ids": [list(g) for g in ids]} if record else None

    def op_estimate_cached_tokens(self, op: dict[str, Any],
                                  record: bool) -> dict[str, Any] | None:
        n = self.manager.estimate_cached_tokens(self._req(op))
        return {"num_cached_tokens": n} if record else None

    def op_evict_blocks(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        self.manager.evict_blocks(set(op["block_ids"]))
        return {"num_free_blocks": self._free()} if record else None

    def op_take_new_block_ids(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        ids = self.manager.take_new_block_ids()
        return {"block_ids_to_zero": ids} if record else None

    def op_record_blocks_for_zeroing(self, op: dict[str, Any],
                                     record: bool) -> dict[str, Any] | None:
        self.manager.record_blocks_for_zeroing(self._known_id(op), op["start_token"])
        return {} if record else None

    def op_pop_blocks_for_free(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        blocks = self.manager.pop_blocks_for_free(req)
        self.lookups.pop(req.request_id, None)
        self.popped.setdefault(req.request_id, deque()).append(blocks)
        if not record:
            return None
        return {"popped_block_ids": [b.block_id for b in blocks],
                "num_free_blocks": self._free()}

    def op_free_popped_blocks(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        rid = self._known_id(op)
        pending = self.popped.get(rid)
        if not pending:
            raise TraceError(f"free_popped_blocks without a pending pop_blocks_for_free of "
                             f"{rid!r}")
        self.manager.free_popped_blocks(pending.popleft())
        if not pending:
            del self.popped[rid]
        return {"num_free_blocks": self._free()} if record else None

    def op_take_metrics_events(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        if self.metrics is None:
            raise TraceError("take_metrics_events without metrics_collector_sample_rate")
        events = self.metrics.drain_events()
        if not record:
            return None
        return {"num_eviction_events": len(events),
                "reuse_gap_counts": [len(e.reuse_gaps_seconds) for e in events],
                "sampled_block_ids": sorted(self.metrics.block_metrics)}
