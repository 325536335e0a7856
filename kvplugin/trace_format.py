"""The ``vllm-kv-oracle-trace/v1`` format as the replayer reads it, and its strict checks.

Every op, op field, config key and group field the conformance FORMAT.md defines is listed
here with the type it must have.  Anything else is a :class:`TraceError`, never ignored: an
ignored ``num_external_computed_tokens`` or ``dtype`` would silently give different block
ids.  What FORMAT.md documents but this build does not implement (the seed-completeness
features) is an :class:`UnsupportedTraceError`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from kvplugin.core.request import RequestStatus

FORMAT_TRACE = "vllm-kv-oracle-trace/v1"
FORMAT_RESULT = "vllm-kv-oracle-result/v1"

DEFAULT_CONFIG: dict[str, Any] = {
    "block_size": 16,
    "num_blocks": 256,
    "groups": [{"kind": "full"}],
    "enable_caching": True,
    "max_model_len": 8192,
    "max_in_flight_tokens": None,
    "watermark": 0.0,
    "use_eagle": False,
    "hash_fn": "sha256_cbor",
    "none_hash_seed": None,
    "log_stats": True,
    "enable_kv_cache_events": True,
    "prefix_match_unit": None,
    "prefix_cache_retention_interval": None,
    "num_hash_lookahead_tokens": 0,
    "enable_mamba_shared_prefix_checkpoint": False,
    "record_block_tables": False,
    "record_block_hashes": True,
    "events_full_token_ids": False,
}
SUPPORTED_HASH_FNS = ("sha256_cbor", "sha256")
TRACE_KEYS = frozenset({"format", "meta", "config", "ops"})


class TraceError(Exception):
    """The trace itself is malformed or inconsistent (not a manager decision)."""


class UnsupportedTraceError(TraceError):
    """The trace needs a feature this build does not implement (e.g. a group kind)."""


def _is_opt_int(v: Any) -> bool:
    return v is None or type(v) is int


def _is_opt_bool(v: Any) -> bool:
    return v is None or type(v) is bool


def _is_opt_str(v: Any) -> bool:
    return v is None or type(v) is str


def _is_number(v: Any) -> bool:
    return type(v) is int or type(v) is float


def _is_int_list(v: Any) -> bool:
    return type(v) is list and all(type(x) is int for x in v)


def _is_status(v: Any) -> bool:
    return type(v) is str and v in RequestStatus.__members__


def _is_computed_blocks(v: Any) -> bool:
    return v is None or v == "empty" or v == "lookup"


def _is_scalar(v: Any) -> bool:
    return v is None or type(v) in (str, int, float, bool)


def _is_mamba_mode(v: Any) -> bool:
    return v in ("align", "none")


# A field's check is either an exact type (``int`` rejects ``bool``) or a predicate.
Check = type | Callable[[Any], bool]


def _ok(check: Check, value: Any) -> bool:
    if type(value) is check:
        return True
    return not isinstance(check, type) and bool(check(value))


# op -> {field: check} and its required fields ("op" is implied).
_ID: dict[str, Check] = {"op": str, "id": str}
_NONE: dict[str, Check] = {"op": str}
OP_FIELDS: dict[str, tuple[dict[str, Check], frozenset[str]]] = {
    "add_request": ({**_ID, "prompt": list, "cache_salt": _is_opt_str, "lora_name": _is_opt_str,
                     "lora_int_id": int, "lora_path": str,
                     "skip_reading_prefix_cache": _is_opt_bool, "max_tokens": int,
                     "arrival_time": _is_number}, frozenset({"id", "prompt"})),
    # set_shared_prefix_boundary (default true) is the reference replayer's switch for
    # hand-written traces that model a scheduler ignoring the boundary.
    "get_computed_blocks": ({**_ID, "max_cache_hit_length": _is_opt_int,
                             "set_shared_prefix_boundary": bool}, frozenset({"id"})),
    "allocate_slots": ({**_ID, "num_new_tokens": int, "num_new_computed_tokens": int,
                        "use_lookup": bool, "num_lookahead_tokens": int,
                        "full_sequence_must_fit": bool, "has_scheduled_reqs": bool,
                        "reserved_blocks": int, "delay_cache_blocks": bool,
                        "num_external_computed_tokens": int,
                        "new_computed_blocks": _is_computed_blocks,
                        "skip_zeroing_group_ids": _is_int_list},
                       frozenset({"id", "num_new_tokens"})),
    "update_request": ({**_ID, "num_computed_tokens": int, "status": _is_status,
                        "num_preemptions": int, "shared_prefix_boundary": int,
                        "num_in_flight_tokens": int}, frozenset({"id"})),
    "append_output_tokens": ({**_ID, "tokens": list, "num_computed_tokens": int},
                             frozenset({"id"})),
    "record_prefix_cache_stats": ({**_ID, "num_hits": int}, frozenset({"id", "num_hits"})),
    "free": (_ID, frozenset({"id"})),
    "preempt": (_ID, frozenset({"id"})),
    "finish": ({**_ID, "status": _is_status, "forget": bool}, frozenset({"id"})),
    "new_step": (_NONE, frozenset()),
    "take_kv_cache_block_copies": ({**_NONE, "free_retained": bool}, frozenset()),
    "cache_blocks": ({**_ID, "num_computed_tokens": int},
                     frozenset({"id", "num_computed_tokens"})),
    "reset_prefix_cache": (_NONE, frozenset()),
    "usage": (_NONE, frozenset()),
    "get_num_common_prefix_blocks": (_ID, frozenset({"id"})),
    "get_block_ids": (_ID, frozenset({"id"})),
    "take_events": (_NONE, frozenset()),
    "make_prefix_cache_stats": (_NONE, frozenset()),
    "free_queue": (_NONE, frozenset()),
    # Connector-path ops (FORMAT.md, "Connector-path ops").
    "get_computed_blocks_for_connector": ({**_ID, "max_cache_hit_length": _is_opt_int},
                                          frozenset({"id"})),
    "truncate_computed_blocks": ({**_ID, "num_computed_tokens": int},
                                 frozenset({"id", "num_computed_tokens"})),
    "take_boundary_state_offloads": (_NONE, frozenset()),
    "finalize_partial_tail_offloads": (_ID, frozenset({"id"})),
    "remove_skipped_blocks": ({**_ID, "processed_computed_tokens": int,
                               "num_prompt_tokens": _is_opt_int},
                              frozenset({"id", "processed_computed_tokens"})),
    "get_block_ids_for_computed_tokens": ({**_ID, "num_computed_tokens": int},
                                          frozenset({"id", "num_computed_tokens"})),
    "estimate_cached_tokens": (_ID, frozenset({"id"})),
    "evict_blocks": ({**_NONE, "block_ids": _is_int_list}, frozenset({"block_ids"})),
    "take_new_block_ids": (_NONE, frozenset()),
    "record_blocks_for_zeroing": ({**_ID, "start_token": int}, frozenset({"id", "start_token"})),
    "pop_blocks_for_free": (_ID, frozenset({"id"})),
    "free_popped_blocks": (_ID, frozenset({"id"})),
    # Seed-completeness op (FORMAT.md).
    "take_metrics_events": (_NONE, frozenset()),
}
# Documented ops this build does not implement (FORMAT.md, seed-completeness features).
UNSUPPORTED_OPS: frozenset[str] = frozenset()
# op -> (field checks, allowed keys, required keys): what check_op reads per op.
_OP_TABLE = {name: (checks, frozenset(checks), required | {"op"})
             for name, (checks, required) in OP_FIELDS.items()}

CONFIG_FIELDS: dict[str, Check] = {
    "block_size": int, "num_blocks": int, "groups": list, "enable_caching": bool,
    "max_model_len": int, "max_in_flight_tokens": _is_opt_int, "watermark": _is_number,
    "use_eagle": bool, "hash_fn": str, "none_hash_seed": _is_scalar, "log_stats": bool,
    "enable_kv_cache_events": bool, "prefix_match_unit": _is_opt_int,
    "prefix_cache_retention_interval": _is_opt_int, "num_hash_lookahead_tokens": int,
    "enable_mamba_shared_prefix_checkpoint": bool, "record_block_tables": bool,
    "record_block_hashes": bool, "events_full_token_ids": bool,
    # Seed-completeness keys (FORMAT.md): context parallelism.
    "dcp_world_size": int, "pcp_world_size": int,
    # ... and the residency metrics collector.
    "metrics_collector_sample_rate": lambda v: v is None or _is_number(v),
    "metrics_collector_seed": _is_scalar,
}
# Documented in FORMAT.md ("Seed-completeness fields and ops") but not implemented here:
# a trace using one is unsupported, never replayed without it.
UNSUPPORTED_CONFIG_KEYS: frozenset[str] = frozenset()
UNSUPPORTED_GROUP_FIELDS: frozenset[str] = frozenset()
ATTENTION_DTYPES = ("float32", "float16", "bfloat16")
# The seed-completeness config keys, group kinds and group fields: a trace using any of
# them gets the extra ``resolved`` entries FORMAT.md lists.
SEED_CONFIG_KEYS = frozenset({"dcp_world_size", "pcp_world_size",
                              "metrics_collector_sample_rate", "metrics_collector_seed"})
SEED_GROUP_KINDS = frozenset({"mla", "hidden_state", "sliding_window_mla", "rswa",
                              "circular_buffer", "sink_full"})
SEED_GROUP_FIELDS = frozenset({"dtype", "dcp_sharded"})
def _is_dtype(v: Any) -> bool:
    return v in ATTENTION_DTYPES


_GROUP: dict[str, Check] = {"kind": str, "block_size": int, "is_eagle_group": bool,
                            "dcp_sharded": bool}
# Attention kinds also take a dtype (mixed precision turns on zeroing); Mamba does not.
_ATTN: dict[str, Check] = {**_GROUP, "dtype": _is_dtype}
GROUP_FIELDS: dict[str, tuple[dict[str, Check], frozenset[str]]] = {
    "full": (_ATTN, frozenset()),
    "sliding_window": ({**_ATTN, "sliding_window": int}, frozenset({"sliding_window"})),
    "chunked_local": ({**_ATTN, "attention_chunk_size": int},
                      frozenset({"attention_chunk_size"})),
    "mamba": ({**_GROUP, "mode": _is_mamba_mode, "num_speculative_blocks": int}, frozenset()),
    # Seed-completeness kinds (FORMAT.md).
    "mla": (_ATTN, frozenset()),
    "hidden_state": (_ATTN, frozenset()),
    "sliding_window_mla": ({**_ATTN, "sliding_window": int, "bounded_replay": bool},
                           frozenset({"sliding_window"})),
    "rswa": ({**_ATTN, "rswa_window": int}, frozenset({"rswa_window"})),
    "circular_buffer": (_ATTN, frozenset()),
    "sink_full": ({**_ATTN, "sink_len": int}, frozenset({"sink_len"})),
}


def _check_fields(what: str, obj: dict[str, Any], checks: dict[str, Check],
                  required: frozenset[str], unsupported: frozenset[str] = frozenset()) -> None:
    for key, value in obj.items():
        check = checks.get(key)
        if check is None:
            if key in unsupported:
                raise UnsupportedTraceError(f"{what}: field {key!r} is not supported by this "
                                            "build")
            raise TraceError(f"{what}: unknown field {key!r}")
        if not _ok(check, value):
            raise TraceError(f"{what}: bad value for {key!r}: {value!r}")
    missing = required - obj.keys()
    if missing:
        raise TraceError(f"{what}: missing field(s) {sorted(missing)}")


def check_op(op: Any) -> str:
    """Validate one op: a known name, only known fields, each of the right type, and the
    required ones present.  Returns the op name; raises :class:`TraceError`."""
    try:
        name = op["op"]
        checks, allowed, required = _OP_TABLE[name]
    except (KeyError, TypeError):
        name = op.get("op") if type(op) is dict else None
        if type(name) is str and name in UNSUPPORTED_OPS:
            raise UnsupportedTraceError(f"op {name!r} is not supported by this build") from None
        if type(op) is not dict:
            raise TraceError(f"an op must be an object, got {op!r}") from None
        raise TraceError(f"unknown op {name!r}") from None
    if type(op) is not dict:
        raise TraceError(f"an op must be an object, got {op!r}")
    keys = op.keys()
    if not (keys <= allowed and keys >= required):
        _check_fields(f"op {name!r}", op, checks, required)
    for key, value in op.items():
        check = checks[key]
        if type(value) is not check and not _ok(check, value):
            raise TraceError(f"op {name!r}: bad value for {key!r}: {value!r}")
    return str(name)


def check_ops(ops: Sequence[Any]) -> tuple[int, TraceError] | None:
    """The first op :func:`check_op` rejects, with the error; None if all are valid."""
    for i, op in enumerate(ops):
        try:
            check_op(op)
        except TraceError as e:
            return i, e
    return None


def check_config(config: Any) -> None:
    """Validate the trace header: known keys of the right types, and every group's fields
    for its kind (unknown kinds and documented-but-unimplemented fields are unsupported)."""
    if type(config) is not dict:
        raise TraceError("config must be an object")
    _check_fields("config", config, CONFIG_FIELDS, frozenset(), UNSUPPORTED_CONFIG_KEYS)
    for i, g in enumerate(config.get("groups", DEFAULT_CONFIG["groups"])):
        if type(g) is not dict:
            raise TraceError(f"config.groups[{i}] must be an object")
        kind = g.get("kind")
        if type(kind) is not str or kind not in GROUP_FIELDS:
            raise UnsupportedTraceError(f"unsupported group kind {kind!r}")
        checks, required = GROUP_FIELDS[kind]
        _check_fields(f"config.groups[{i}] ({kind})", g, checks, required,
                      UNSUPPORTED_GROUP_FIELDS)


def uses_seed_features(config: dict[str, Any]) -> bool:
    """Whether a (checked) config uses any seed-completeness key, kind or group field."""
    if config.keys() & SEED_CONFIG_KEYS:
        return True
    return any(g.get("kind") in SEED_GROUP_KINDS or g.keys() & SEED_GROUP_FIELDS
               for g in config.get("groups", ()))


def check_trace_keys(trace: dict[str, Any]) -> None:
    """The top level: ``format``, ``meta``, ``config`` and an ``ops`` list, nothing else."""
    unknown = trace.keys() - TRACE_KEYS
    if unknown:
        raise TraceError(f"unknown top-level trace keys: {sorted(unknown)}")
    if type(trace.get("ops")) is not list:
        raise TraceError("a trace needs an 'ops' list")
