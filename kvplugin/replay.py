"""Replay a ``vllm-kv-oracle-trace/v1`` trace on kvplugin's core and record every result.

The output has the shape of ``vllm-kv-oracle-result/v1`` (see the conformance FORMAT.md), so
``compare.py`` can diff it against what vLLM 0.33.0's own ``KVCacheManager`` returned.
This module is the driver only: every decision comes from :mod:`kvplugin.core`.
"""

from __future__ import annotations

import hashlib
import json
import random
import time
from collections import deque
from collections.abc import Callable
from typing import Any, TextIO

from kvplugin.core.blocks import KVCacheBlock
from kvplugin.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvplugin.core.hashing import BlockHasher, HashContext
from kvplugin.core.manager import KVCacheBlocks, KVCacheManager
from kvplugin.core.metrics import KVCacheMetricsCollector
from kvplugin.core.request import LoRAInfo, Request, RequestStatus
from kvplugin.core.single_type import UnsupportedSpecError
from kvplugin.core.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    FullAttentionSpec,
    HiddenStateCacheSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    resolve_kv_cache_block_sizes,
)
from kvplugin.replay_ops import ReadOps
from kvplugin.trace_format import (
    DEFAULT_CONFIG,
    FORMAT_RESULT,
    FORMAT_TRACE,
    SUPPORTED_HASH_FNS,
    TraceError,
    UnsupportedTraceError,
    check_config,
    check_op,
    check_ops,
    check_trace_keys,
    uses_seed_features,
)

__all__ = [
    "FORMAT_RESULT",
    "FORMAT_TRACE",
    "Replayer",
    "TraceError",
    "UnsupportedTraceError",
    "bench",
    "check_op",
    "check_ops",
    "dump_result",
    "load_trace",
    "run_trace",
]

VLLM_VERSION = "0.33.0"  # the behaviour kvplugin's core reproduces

COORDINATOR_NAMES = {
    "KVCacheCoordinatorNoPrefixCache": "KVCacheCoordinatorNoPrefixCache",
    "UnitaryKVCacheCoordinator": "UnitaryKVCacheCoordinator",
    "HybridKVCacheCoordinator": "HybridKVCacheCoordinator",
}


def hex16(h: bytes | int | None) -> str | None:
    if h is None:
        return None
    if isinstance(h, int):
        return f"{h & ((1 << 64) - 1):016x}"
    return bytes(h)[-8:].hex()


def token_digest(tokens: list[int]) -> str:
    return hashlib.sha256(",".join(map(str, tokens)).encode()).hexdigest()[:16]


def jsonable(x: Any) -> Any:
    if isinstance(x, bytes | bytearray):
        return bytes(x).hex()
    if isinstance(x, list | tuple):
        return [jsonable(v) for v in x]
    if isinstance(x, dict):
        return {str(k): jsonable(v) for k, v in x.items()}
    return x


def build_spec(g: dict[str, Any], default_block_size: int, enable_caching: bool) -> KVCacheSpec:
    kind = g.get("kind")
    common: dict[str, Any] = {"block_size": int(g.get("block_size", default_block_size))}
    if "dcp_sharded" in g:  # else the spec's default: sharded attention, replicated Mamba
        common["dcp_sharded"] = bool(g["dcp_sharded"])
    if kind == "mamba":
        return MambaSpec(**common,
                         mamba_cache_mode=g.get("mode", "align" if enable_caching else "none"),
                         num_speculative_blocks=int(g.get("num_speculative_blocks", 0)))
    if "dtype" in g:
        common["dtype"] = str(g["dtype"])
    if kind == "full":
        return FullAttentionSpec(**common)
    if kind == "sliding_window":
        return SlidingWindowSpec(**common, sliding_window=int(g["sliding_window"]))
    if kind == "chunked_local":
        return ChunkedLocalAttentionSpec(**common,
                                         attention_chunk_size=int(g["attention_chunk_size"]))
    return _build_seed_spec(kind, g, common)


def _build_seed_spec(kind: Any, g: dict[str, Any], common: dict[str, Any]) -> KVCacheSpec:
    """The seed-completeness kinds (FORMAT.md)."""
    if kind == "mla":
        return MLAAttentionSpec(**common)
    if kind == "hidden_state":
        return HiddenStateCacheSpec(**common)
    if kind == "sliding_window_mla":
        return SlidingWindowMLASpec(**common, sliding_window=int(g["sliding_window"]),
                                    bounded_replay=bool(g.get("bounded_replay", False)))
    if kind == "rswa":
        return RSWASpec(**common, rswa_window=int(g["rswa_window"]))
    if kind == "circular_buffer":
        return CircularBufferSpec(**common)
    if kind == "sink_full":
        return SinkFullAttentionSpec(**common, sink_len=int(g["sink_len"]))
    raise UnsupportedTraceError(f"unsupported group kind {kind!r}")


def _list_ids(blocks: KVCacheBlocks) -> list[list[int]]:
    return [[b.block_id for b in g] for g in blocks.blocks]


class Replayer(ReadOps):
    """One manager plus the scheduler-side request bookkeeping a trace assumes."""

    def __init__(self, config: dict[str, Any]) -> None:
        check_config(config)
        cfg = {**DEFAULT_CONFIG, **config}
        if cfg["hash_fn"] not in SUPPORTED_HASH_FNS:
            raise TraceError(f"hash_fn must be one of {SUPPORTED_HASH_FNS}")
        caching = bool(cfg["enable_caching"])
        groups = cfg["groups"]
        if not groups:
            raise TraceError("config.groups must not be empty")
        specs = [build_spec(g, int(cfg["block_size"]), caching) for g in groups]
        self.ctx = HashContext.create(cfg["hash_fn"], cfg["none_hash_seed"])
        self.kv_cache_config = KVCacheConfig(
            num_blocks=int(cfg["num_blocks"]),
            kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s, bool(g.get("is_eagle_group")))
                             for i, (g, s) in enumerate(zip(groups, specs, strict=True))],
            prefix_cache_retention_interval=cfg["prefix_cache_retention_interval"])
        self.dcp = int(config.get("dcp_world_size", 1))
        self.pcp = int(config.get("pcp_world_size", 1))
        if self.dcp < 1 or self.pcp < 1:
            raise TraceError("dcp_world_size and pcp_world_size must be >= 1")
        self.seed_features = uses_seed_features(config)
        self.sbs, self.hbs = resolve_kv_cache_block_sizes(
            self.kv_cache_config, int(cfg["block_size"]),
            prefix_match_unit=cfg["prefix_match_unit"], enable_caching=caching,
            dcp_world_size=self.dcp)
        self.kv_cache_config.hash_block_size = self.hbs
        lookahead = int(cfg["num_hash_lookahead_tokens"])
        self.metrics = self._metrics_collector(config)
        try:
            self.manager = KVCacheManager(
                self.kv_cache_config, max_model_len=int(cfg["max_model_len"]),
                scheduler_block_size=self.sbs, hash_block_size=self.hbs,
                max_in_flight_tokens=cfg["max_in_flight_tokens"], enable_caching=caching,
                use_eagle=bool(cfg["use_eagle"]), num_hash_lookahead_tokens=lookahead,
                log_stats=bool(cfg["log_stats"]),
                enable_kv_cache_events=bool(cfg["enable_kv_cache_events"]),
                watermark=float(cfg["watermark"]),
                enable_mamba_shared_prefix_checkpoint=bool(
                    cfg["enable_mamba_shared_prefix_checkpoint"]),
                dcp_world_size=self.dcp, pcp_world_size=self.pcp,
                metrics_collector=self.metrics)
        except UnsupportedSpecError as e:
            raise UnsupportedTraceError(str(e)) from None
        self.metrics_rate = None if self.metrics is None else self.metrics.sample_rate
        # As in vLLM's EngineCore: requests get a block hasher only when caching.
        self.hasher = BlockHasher(self.ctx, self.hbs, lookahead) if caching else None
        self.requests: dict[str, Request] = {}
        self.tokens: dict[str, list[int]] = {}
        self.lookups: dict[str, tuple[KVCacheBlocks, int]] = {}
        # pop_blocks_for_free results not yet freed, oldest first, per request id.
        self.popped: dict[str, deque[list[KVCacheBlock]]] = {}
        self.loras: dict[str, LoRAInfo] = {}
        self.record_tables = bool(cfg["record_block_tables"])
        self.record_hashes = bool(cfg["record_block_hashes"])
        self.full_event_tokens = bool(cfg["events_full_token_ids"])
        self.initial = self.describe()
        self.handlers: dict[str, Callable[[dict[str, Any], bool], dict[str, Any] | None]] = {
            name[3:]: getattr(self, name) for name in dir(self) if name.startswith("op_")}

    @staticmethod
    def _metrics_collector(config: dict[str, Any]) -> KVCacheMetricsCollector | None:
        """FORMAT.md: ``random.seed(seed)`` just before the collector is built; a private
        generator with that seed draws the same sequence without touching global state."""
        rate = config.get("metrics_collector_sample_rate")
        if rate is None:
            if "metrics_collector_seed" in config:
                raise TraceError("metrics_collector_seed without metrics_collector_sample_rate")
            return None
        if not 0 < rate <= 1:
            raise TraceError(f"metrics_collector_sample_rate must be in (0, 1], got {rate}")
        seed = config.get("metrics_collector_seed", 0)
        return KVCacheMetricsCollector(float(rate), random.Random(seed))

    def describe(self) -> dict[str, Any]:
        coord = self.manager.coordinator
        out = {
            "scheduler_block_size": self.sbs,
            "hash_block_size": self.hbs,
            "coordinator": type(coord).__name__,
            "managers": [type(m).__name__ for m in coord.single_type_managers],
            "group_block_sizes": [m.block_size for m in coord.single_type_managers],
            "enable_partial_hash_hits": bool(coord.enable_partial_hash_hits),
            "watermark_blocks": self.manager.watermark_blocks,
            "none_hash": hex16(self.ctx.none_hash),
            "num_free_blocks": self.manager.block_pool.get_num_free_blocks(),
        }
        if self.seed_features:  # FORMAT.md: only traces using seed-completeness features
            managers = coord.single_type_managers
            out.update({
                "dcp_world_size": self.dcp,
                "pcp_world_size": self.pcp,
                "prefix_cacheable_group_ids": [i for i, m in enumerate(managers)
                                               if m.kv_cache_spec.prefix_cacheable],
                "retained_hit_group_ids": list(self.manager.retained_hit_group_ids),
                "zeroing_group_ids": [i for i, m in enumerate(managers)
                                      if m._record_new_block_ids],
                "metrics_collector_sample_rate": self.metrics_rate,
            })
        return out

    # ------------------------------------------------------------------ helpers
    def _req(self, op: dict[str, Any]) -> Request:
        try:
            return self.requests[op["id"]]
        except (KeyError, TypeError):  # unknown, removed or missing id
            raise TraceError(f"unknown or removed request id {op.get('id')!r}") from None

    def _known_id(self, op: dict[str, Any]) -> str:
        """An id the trace added (it may be finished or forgotten since)."""
        rid: str = op["id"]
        if rid not in self.tokens:
            raise TraceError(f"unknown request id {rid!r}")
        return rid

    def _free(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    def _expand(self, spec: list[Any]) -> list[int]:
        out: list[int] = []
        for item in spec:
            if type(item) is int:
                out.append(item)
            elif isinstance(item, dict) and "from" in item:
                src = self.tokens.get(item["from"])
                if src is None:
                    raise TraceError(f"token segment refers to unknown {item['from']!r}")
                start, n = int(item.get("start", 0)), int(item["len"])
                if start < 0 or n < 0 or start + n > len(src):
                    raise TraceError(f"segment {item} out of range (source has {len(src)})")
                out.extend(src[start:start + n])
            else:
                raise TraceError(f"bad token item {item!r}")
        return out

    def _lora(self, op: dict[str, Any]) -> LoRAInfo | None:
        name = op.get("lora_name")
        if name is None:
            if "lora_int_id" in op or "lora_path" in op:
                raise TraceError("lora_int_id / lora_path without a lora_name")
            return None
        lora = self.loras.get(name)
        if lora is None:
            lora = LoRAInfo(name, int(op.get("lora_int_id", len(self.loras) + 1)),
                            str(op.get("lora_path", f"/loras/{name}")))
            self.loras[name] = lora
        elif op.get("lora_int_id", lora.lora_int_id) != lora.lora_int_id or \
                op.get("lora_path", lora.lora_path) != lora.lora_path:
            raise TraceError(f"LoRA {name!r} was defined with another id or path")
        return lora

    def _hashes(self, req: Request, before: int) -> dict[str, Any]:
        res: dict[str, Any] = {"num_block_hashes": len(req.block_hashes)}
        if self.record_hashes:
            res["new_block_hashes"] = [h[-8:].hex() for h in req.block_hashes[before:]]
        return res

    def _event(self, ev: Any) -> dict[str, Any]:
        if isinstance(ev, BlockStored):
            d: dict[str, Any] = {
                "type": "BlockStored",
                "block_hashes": [hex16(h) for h in ev.block_hashes],
                "parent_block_hash": hex16(ev.parent_block_hash),
                "block_size": ev.block_size,
                "num_token_ids": len(ev.token_ids),
                "group_idx": ev.group_idx,
                "lora_id": ev.lora_id,
                "lora_name": ev.lora_name,
                "medium": ev.medium,
                "extra_keys": jsonable(ev.extra_keys),
                "kv_cache_spec_kind": ev.kv_cache_spec_kind,
                "kv_cache_spec_sliding_window": ev.kv_cache_spec_sliding_window,
            }
            if self.full_event_tokens:
                d["token_ids"] = list(ev.token_ids)
            else:
                d["token_ids_digest"] = token_digest(list(ev.token_ids))
            return d
        if isinstance(ev, BlockRemoved):
            return {"type": "BlockRemoved", "block_hashes": [hex16(h) for h in ev.block_hashes],
                    "group_idx": ev.group_idx, "medium": ev.medium}
        if isinstance(ev, AllBlocksCleared):
            return {"type": "AllBlocksCleared"}
        return {"type": type(ev).__name__}

    # ------------------------------------------------------------------ ops
    def op_add_request(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        rid = op["id"]
        if rid in self.tokens:
            raise TraceError(f"request id {rid!r} reused")
        prompt = self._expand(op["prompt"])
        if not prompt:
            raise TraceError("empty prompt")
        req = Request(rid, prompt, block_hasher=self.hasher, lora_request=self._lora(op),
                      cache_salt=op.get("cache_salt"),
                      skip_reading_prefix_cache=bool(op.get("skip_reading_prefix_cache")))
        self.requests[rid] = req
        self.tokens[rid] = req.all_token_ids
        if not record:
            return None
        res: dict[str, Any] = {"num_tokens": req.num_tokens}
        res.update(self._hashes(req, 0))
        return res

    def op_get_computed_blocks(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        blocks, n, boundary = self.manager.get_computed_blocks(req, op.get("max_cache_hit_length"))
        if op.get("set_shared_prefix_boundary", True):  # the scheduler stores it
            req.shared_prefix_boundary = boundary
        self.lookups[req.request_id] = (blocks, n)
        if not record:
            return None
        return {"num_computed_tokens": n, "block_ids": _list_ids(blocks),
                "shared_prefix_boundary": boundary}

    def op_get_computed_blocks_for_connector(self, op: dict[str, Any],
                                             record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        blocks, n, boundary, diverged = self.manager.get_computed_blocks_for_connector(
            req, op.get("max_cache_hit_length"))
        req.shared_prefix_boundary = boundary
        self.lookups[req.request_id] = (blocks, n)
        if not record:
            return None
        return {"num_computed_tokens": n, "block_ids": _list_ids(blocks),
                "shared_prefix_boundary": boundary, "hit_diverged": diverged}

    def op_truncate_computed_blocks(self, op: dict[str, Any],
                                    record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        pending = self.lookups.get(req.request_id)
        if pending is None:
            raise TraceError("truncate_computed_blocks without a pending lookup")
        n = op["num_computed_tokens"]
        blocks = self.manager.truncate_computed_blocks(pending[0], n)
        self.lookups[req.request_id] = (blocks, n)
        return {"block_ids": _list_ids(blocks)} if record else None

    def _computed_blocks(self, op: dict[str, Any], rid: str) -> KVCacheBlocks | None:
        """The ``new_computed_blocks`` an allocate_slots op names: the pending lookup, the
        manager's shared empty ``KVCacheBlocks``, or None."""
        source = op.get("new_computed_blocks")
        if op.get("use_lookup", False):
            if source is not None and source != "lookup":
                raise TraceError(f"use_lookup contradicts new_computed_blocks={source!r}")
            source = "lookup"
        if source == "lookup":
            if rid not in self.lookups:
                raise TraceError("use_lookup without a preceding get_computed_blocks")
            return self.lookups[rid][0]
        return self.manager.empty_kv_cache_blocks if source == "empty" else None

    def op_allocate_slots(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        rid = req.request_id
        hits = None
        if "new_computed_blocks" in op or "use_lookup" in op:
            hits = self._computed_blocks(op, rid)
        if self.lookups:
            self.lookups.pop(rid, None)
        # Positional, in allocate_slots' parameter order; the core validates the counts.
        # Most fields are absent from most ops, and on this hot path a membership test is
        # cheaper than op.get (it keeps the replay at the cost it had before the connector
        # fields were added).
        blocks = self.manager.allocate_slots(
            req, op["num_new_tokens"],
            op["num_new_computed_tokens"] if "num_new_computed_tokens" in op else 0,  # noqa: SIM401
            hits,
            op["num_lookahead_tokens"] if "num_lookahead_tokens" in op else 0,  # noqa: SIM401
            op["num_external_computed_tokens"] if "num_external_computed_tokens" in op  # noqa: SIM401
            else 0,
            "delay_cache_blocks" in op and op["delay_cache_blocks"], 0,
            "full_sequence_must_fit" in op and op["full_sequence_must_fit"],
            op["reserved_blocks"] if "reserved_blocks" in op else 0,  # noqa: SIM401
            "has_scheduled_reqs" not in op or op["has_scheduled_reqs"],
            tuple(op["skip_zeroing_group_ids"]) if "skip_zeroing_group_ids" in op else ())
        if not record:
            return None
        res: dict[str, Any] = {"ok": blocks is not None,
                               "new_block_ids": None if blocks is None else _list_ids(blocks),
                               "num_free_blocks": self._free()}
        if self.record_tables:
            res["block_ids"] = [list(g) for g in self.manager.get_block_ids(rid)]
        return res

    def op_update_request(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        if "num_computed_tokens" in op:
            req.num_computed_tokens = int(op["num_computed_tokens"])
        if "status" in op:
            req.status = RequestStatus[op["status"]]
        if "num_preemptions" in op:
            req.num_preemptions = int(op["num_preemptions"])
        if "shared_prefix_boundary" in op:
            req.shared_prefix_boundary = int(op["shared_prefix_boundary"])
        if "num_in_flight_tokens" in op:
            req.num_in_flight_tokens = int(op["num_in_flight_tokens"])
        return {} if record else None

    def op_append_output_tokens(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        if "num_computed_tokens" in op:
            req.num_computed_tokens = int(op["num_computed_tokens"])
        before = len(req.block_hashes)
        spec = op.get("tokens")
        if spec:
            tokens = self._expand(spec)
            if tokens:
                req.append_output_token_ids(tokens)
        if not record:
            return None
        res: dict[str, Any] = {"num_tokens": req.num_tokens}
        res.update(self._hashes(req, before))
        return res

    def op_record_prefix_cache_stats(self, op: dict[str, Any],
                                     record: bool) -> dict[str, Any] | None:
        self.manager.record_prefix_cache_stats(self._req(op), int(op["num_hits"]))
        return {} if record else None

    def op_free(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        self.manager.free(req)
        self.lookups.pop(req.request_id, None)
        return {"num_free_blocks": self._free()} if record else None

    def op_preempt(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        self.manager.free(req)
        self.lookups.pop(req.request_id, None)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_in_flight_tokens = 0
        req.num_preemptions += 1
        return {"num_free_blocks": self._free()} if record else None

    def op_finish(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        req = self._req(op)
        req.status = RequestStatus[op.get("status", "FINISHED_STOPPED")]
        self.manager.free(req)
        self.lookups.pop(req.request_id, None)
        if op.get("forget", True):
            del self.requests[req.request_id]
        return {"num_free_blocks": self._free()} if record else None

    def op_new_step(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        self.manager.new_step_starts()
        return {} if record else None

    def op_cache_blocks(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        self.manager.cache_blocks(self._req(op), int(op["num_computed_tokens"]))
        return {} if record else None

    def op_reset_prefix_cache(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        ok = self.manager.reset_prefix_cache()
        return {"ok": ok, "num_free_blocks": self._free()} if record else None

    def op_usage(self, op: dict[str, Any], record: bool) -> dict[str, Any] | None:
        usage = self.manager.usage
        return {"usage": round(usage, 12), "num_free_blocks": self._free()} if record else None

    def apply(self, op: dict[str, Any], record: bool = True) -> dict[str, Any] | None:
        """Validate one op (TraceError on anything unknown or ill-typed), then run it."""
        return self.handlers[check_op(op)](op, record)

    def dispatch(self, op: dict[str, Any], record: bool = True) -> dict[str, Any] | None:
        """Run an op that :func:`check_ops` already accepted (the drivers validate a whole
        trace once, up front, so the timed loop pays no per-op validation)."""
        return self.handlers[op["op"]](op, record)


# ----------------------------------------------------------------------------- drivers


def load_trace(path: str) -> dict[str, Any]:
    with open(path) as f:
        trace: dict[str, Any] = json.load(f)
    if type(trace) is not dict or trace.get("format") != FORMAT_TRACE:
        raise TraceError(f"{path}: expected format {FORMAT_TRACE!r}")
    check_trace_keys(trace)
    return trace


def run_trace(trace: dict[str, Any], stop_on_error: bool = False) -> dict[str, Any]:
    """Replay every op; a manager exception becomes an ``error`` result, a trace error stops."""
    check_trace_keys(trace)
    rep = Replayer(trace.get("config", {}))
    results: list[dict[str, Any]] = []
    errors = 0
    counts: dict[str | None, int] = {}
    # Validate every op once; ops before the first malformed one replay, and it stops there
    # (exactly as validating op by op would).
    invalid = check_ops(trace["ops"])
    bad_index = len(trace["ops"]) if invalid is None else invalid[0]
    for i, op in enumerate(trace["ops"]):
        name = op.get("op") if type(op) is dict else None
        counts[name] = counts.get(name, 0) + 1
        entry: dict[str, Any] = {"i": i, "op": name}
        if type(op) is dict and "id" in op:
            entry["id"] = op["id"]
        try:
            if i == bad_index and invalid is not None:
                raise invalid[1]
            entry.update(rep.dispatch(op) or {})
        except Exception as e:
            errors += 1
            entry["error"] = f"{type(e).__name__}: {e}"
            results.append(entry)
            if stop_on_error or isinstance(e, TraceError):
                break
            continue
        results.append(entry)
    summary = {
        "num_ops": len(trace["ops"]),
        "num_results": len(results),
        "num_errors": errors,
        "op_counts": counts,
        "final_num_free_blocks": rep.manager.block_pool.get_num_free_blocks(),
        "final_num_live_requests": sum(1 for r in rep.requests.values() if not r.is_finished()),
        "allocate_slots_failed": sum(1 for r in results
                                     if r["op"] == "allocate_slots" and r.get("ok") is False),
    }
    return {"format": FORMAT_RESULT, "vllm_version": VLLM_VERSION,
            "trace_meta": trace.get("meta", {}), "resolved": rep.initial, "summary": summary,
            "results": results}


def dump_result(result: dict[str, Any], fp: TextIO) -> None:
    """JSON with one op result per line, so a plain ``diff`` lines ops up."""
    head = json.dumps({k: v for k, v in result.items() if k != "results"}, sort_keys=True)
    fp.write(head[:-1] + ', "results": [\n')
    rows = result["results"]
    for k, r in enumerate(rows):
        fp.write(json.dumps(r, separators=(",", ":")))
        fp.write(",\n" if k + 1 < len(rows) else "\n")
    fp.write("]}\n")


def bench(trace: dict[str, Any], repeats: int) -> dict[str, Any]:
    """Replay ``repeats`` times on fresh managers, timing only the replay loop (the trace is
    validated once, before any timing)."""
    check_trace_keys(trace)
    ops = trace["ops"]
    invalid = check_ops(ops)
    if invalid is not None:
        index, error = invalid
        raise type(error)(f"op {index}: {error}") from error
    per_run: list[float] = []
    for _ in range(repeats):
        rep = Replayer(trace.get("config", {}))
        apply = rep.dispatch
        t0 = time.perf_counter()
        for op in ops:
            apply(op, False)
        per_run.append(time.perf_counter() - t0)
    total = sum(per_run)
    # One extra, separately timed pass for a per-op breakdown (kept out of the headline).
    rep = Replayer(trace.get("config", {}))
    per_op: dict[str, list[float]] = {}
    clock = time.perf_counter
    for op in ops:
        t0 = clock()
        rep.dispatch(op, False)
        acc = per_op.setdefault(op["op"], [0, 0.0])
        acc[0] += 1
        acc[1] += clock() - t0
    return {
        "num_ops": len(ops),
        "repeats": repeats,
        "seconds_per_run": [round(t, 4) for t in per_run],
        "per_op_us": {k: {"count": int(c), "us_per_op": round(t / c * 1e6, 2)}
                      for k, (c, t) in sorted(per_op.items(), key=lambda kv: -kv[1][1])},
        "best_ops_per_sec": round(len(ops) / min(per_run), 1),
        "ops_per_sec": round(len(ops) * repeats / total, 1),
    }
