"""The replayer is strict: an op, op field, config key or group field it does not know is a
``TraceError`` (never ignored: an ignored ``num_external_computed_tokens`` silently gives
other block ids), a documented-but-unimplemented one an ``UnsupportedTraceError``, and a
value of the wrong type is rejected before the manager sees it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import pytest
from core_testlib import CONFORMANCE, require_shared

from kvplugin.replay import Replayer, bench, run_trace
from kvplugin.trace_format import (
    CONFIG_FIELDS,
    GROUP_FIELDS,
    OP_FIELDS,
    UNSUPPORTED_CONFIG_KEYS,
    UNSUPPORTED_OPS,
    TraceError,
    UnsupportedTraceError,
    check_config,
    check_op,
)

FORMAT = "vllm-kv-oracle-trace/v1"

# One valid value per field (the ops below are syntactically valid, not meaningful).
VALID: dict[str, Any] = {
    "id": "r", "prompt": [1, 2, 3], "cache_salt": "s", "lora_name": "a", "lora_int_id": 1,
    "lora_path": "/p", "skip_reading_prefix_cache": False, "max_tokens": 4,
    "arrival_time": 0.5, "max_cache_hit_length": 3, "set_shared_prefix_boundary": True,
    "num_new_tokens": 1,
    "num_new_computed_tokens": 0, "use_lookup": False, "num_lookahead_tokens": 0,
    "full_sequence_must_fit": False, "has_scheduled_reqs": True, "reserved_blocks": 0,
    "delay_cache_blocks": False, "num_external_computed_tokens": 0,
    "new_computed_blocks": "empty", "skip_zeroing_group_ids": [0],
    "num_computed_tokens": 0, "status": "RUNNING", "num_preemptions": 0,
    "shared_prefix_boundary": 0, "num_in_flight_tokens": 0, "tokens": [5], "num_hits": 0,
    "forget": True, "free_retained": True, "processed_computed_tokens": 0,
    "num_prompt_tokens": 3, "block_ids": [1], "start_token": 0,
}
# Per field, values of the wrong type or out of the field's domain.
INVALID: dict[str, list[Any]] = {
    "id": [1, None], "prompt": ["1,2", None], "cache_salt": [1], "lora_name": [1],
    "lora_int_id": ["1", True], "lora_path": [None], "skip_reading_prefix_cache": [1, "no"],
    "set_shared_prefix_boundary": [1, None],
    "max_tokens": [1.0], "arrival_time": ["0"], "max_cache_hit_length": ["3", 3.0],
    "num_new_tokens": ["1", 1.0, True, None], "num_new_computed_tokens": [False],
    "use_lookup": [1, "true"], "num_lookahead_tokens": [None],
    "full_sequence_must_fit": [0], "has_scheduled_reqs": ["false"],
    "reserved_blocks": [2.0], "delay_cache_blocks": [1, "yes", None],
    "num_external_computed_tokens": ["48", 48.0, True, None],
    "new_computed_blocks": ["lookups", "EMPTY", [], 0],
    "skip_zeroing_group_ids": [0, [True], ["0"], None], "num_computed_tokens": ["0"],
    "status": ["running", 5, "FINISHED"], "num_preemptions": [None],
    "shared_prefix_boundary": ["0"], "num_in_flight_tokens": [0.0], "tokens": [5],
    "num_hits": [None], "forget": [0], "free_retained": [None],
    "processed_computed_tokens": ["0"], "num_prompt_tokens": ["3"],
    "block_ids": [1, [1.0], [None]], "start_token": [None],
}


def _op(name: str, fields: dict[str, Any] | None = None) -> dict[str, Any]:
    required = OP_FIELDS[name][1]
    op: dict[str, Any] = {"op": name}
    op.update({k: VALID[k] for k in sorted(required)})
    op.update(fields or {})
    return op


def _fields(name: str) -> list[str]:
    return sorted(k for k in OP_FIELDS[name][0] if k != "op")


ALL_FIELDS = [(name, f) for name in sorted(OP_FIELDS) for f in _fields(name)]


def test_every_field_has_a_valid_and_an_invalid_example() -> None:
    fields = {f for _, f in ALL_FIELDS}
    assert fields <= VALID.keys() and fields <= INVALID.keys()


@pytest.mark.parametrize("name", sorted(OP_FIELDS))
def test_every_op_accepts_all_its_documented_fields(name: str) -> None:
    assert check_op(_op(name, {f: VALID[f] for f in _fields(name)})) == name
    assert check_op(_op(name)) == name  # optional fields may be absent


@pytest.mark.parametrize("name", sorted(OP_FIELDS))
def test_an_unknown_field_on_any_op_is_a_trace_error(name: str) -> None:
    for extra in ("bogus", "num_external_tokens", "external_tokens"):
        with pytest.raises(TraceError, match=f"unknown field '{extra}'"):
            check_op(_op(name, {extra: 0}))


@pytest.mark.parametrize(("name", "field"), ALL_FIELDS)
def test_a_badly_typed_field_is_a_trace_error(name: str, field: str) -> None:
    for value in INVALID[field]:
        with pytest.raises(TraceError, match=f"bad value for '{field}'"):
            check_op(_op(name, {field: value}))


@pytest.mark.parametrize("name", sorted(n for n, (_, req) in OP_FIELDS.items() if req))
def test_a_missing_required_field_is_a_trace_error(name: str) -> None:
    for field in OP_FIELDS[name][1]:
        op = _op(name)
        del op[field]
        with pytest.raises(TraceError, match="missing field"):
            check_op(op)


def test_unknown_and_unsupported_ops() -> None:
    for bad in ({"op": "allocate"}, {"op": None}, {"id": "r"}, {"op": ["new_step"]}, [], "x"):
        with pytest.raises(TraceError) as info:
            check_op(bad)
        assert type(info.value) is TraceError
    assert check_op({"op": "take_metrics_events"}) == "take_metrics_events"
    with pytest.raises(TraceError, match="unknown field 'id'"):
        check_op({"op": "take_metrics_events", "id": "r"})
    with pytest.raises(TraceError, match="without metrics_collector_sample_rate"):
        Replayer({}).apply({"op": "take_metrics_events"})


# ----------------------------------------------------------------------------- config


def test_config_keys_and_types() -> None:
    check_config({k: v for k, v in {"block_size": 16, "watermark": 0, "none_hash_seed": 3,
                                    "groups": [{"kind": "full"}]}.items()})
    with pytest.raises(TraceError, match="unknown field 'num_gpu_blocks'"):
        check_config({"num_gpu_blocks": 8})
    for key, value in [("block_size", "16"), ("enable_caching", 1), ("watermark", "0.1"),
                       ("groups", {"kind": "full"}), ("prefix_match_unit", 8.0),
                       ("max_in_flight_tokens", True)]:
        with pytest.raises(TraceError, match=f"bad value for '{key}'"):
            check_config({key: value})
    for key in UNSUPPORTED_CONFIG_KEYS:
        with pytest.raises(UnsupportedTraceError, match=key):
            check_config({key: 2})


def test_group_fields_are_checked_per_kind() -> None:
    check_config({"groups": [{"kind": "full", "block_size": 32, "is_eagle_group": True},
                             {"kind": "sliding_window", "sliding_window": 64},
                             {"kind": "chunked_local", "attention_chunk_size": 64},
                             {"kind": "mamba", "mode": "align", "num_speculative_blocks": 1}]})
    bad = [({"kind": "full", "sliding_window": 64}, "unknown field 'sliding_window'"),
           ({"kind": "full", "window": 64}, "unknown field 'window'"),
           ({"kind": "sliding_window"}, "missing field"),
           ({"kind": "chunked_local", "attention_chunk_size": "64"}, "bad value"),
           ({"kind": "mamba", "mode": "aligned"}, "bad value for 'mode'"),
           ({"kind": "full", "block_size": 16.0}, "bad value for 'block_size'"),
           ({"kind": "full", "is_eagle_group": 1}, "bad value")]
    for group, message in bad:
        with pytest.raises(TraceError, match=message) as info:
            check_config({"groups": [group]})
        assert type(info.value) is TraceError
    check_config({"groups": [{"kind": "full", "dcp_sharded": False}]})
    with pytest.raises(TraceError, match="bad value for 'dcp_sharded'"):
        check_config({"groups": [{"kind": "full", "dcp_sharded": 0}]})
    for group in ({"kind": "full", "dtype": "bfloat16"}, {"kind": "mla"},
                  {"kind": "hidden_state", "dtype": "float16"}, {"kind": "circular_buffer"},
                  {"kind": "rswa", "rswa_window": 8}, {"kind": "sink_full", "sink_len": 4},
                  {"kind": "sliding_window_mla", "sliding_window": 8, "bounded_replay": True}):
        check_config({"groups": [group]})
    for group, message in [({"kind": "mamba", "dtype": "float16"}, "unknown field 'dtype'"),
                           ({"kind": "full", "dtype": "float64"}, "bad value for 'dtype'"),
                           ({"kind": "rswa"}, "missing field"),
                           ({"kind": "mla", "sliding_window": 8}, "unknown field")]:
        with pytest.raises(TraceError, match=message) as info:
            check_config({"groups": [group]})
        assert type(info.value) is TraceError
    for group in ({"kind": "bogus"}, {"kind": ["full"]}):
        with pytest.raises(UnsupportedTraceError):
            check_config({"groups": [group]})
    with pytest.raises(TraceError, match="must be an object"):
        check_config({"groups": ["full"]})


def test_the_replayer_checks_its_config() -> None:
    mixed = Replayer({"groups": [{"kind": "full"}, {"kind": "full", "dtype": "bfloat16"}]})
    assert mixed.describe()["zeroing_group_ids"] == [0, 1]
    with pytest.raises(TypeError, match="cannot be built by vLLM"):
        Replayer({"groups": [{"kind": "sink_full", "sink_len": 4}]})
    with pytest.raises(TraceError, match="unknown field 'bogus'"):
        run_trace({"format": FORMAT, "config": {"bogus": 1}, "ops": []})
    with pytest.raises(TraceError, match="top-level"):
        run_trace({"format": FORMAT, "config": {}, "ops": [], "extra": 1})


# ----------------------------------------------------------------------------- FORMAT.md


def _format_tables() -> dict[str, list[tuple[str, str]]]:
    """FORMAT.md's tables by the name of their first column: (first cell, second cell)."""
    require_shared()
    text = (CONFORMANCE / "FORMAT.md").read_text()
    tables: dict[str, list[tuple[str, str]]] = {}
    header: str | None = None
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")] if \
            line.startswith("|") else []
        if not cells:
            header = None
        elif header is None:
            header = cells[0].strip("`")
            tables.setdefault(header, [])
        elif not set(cells[0]) <= set("-: "):
            tables[header].append((cells[0].strip("`"), cells[1] if len(cells) > 1 else ""))
    return tables


def test_every_op_format_md_documents_is_known_or_unsupported() -> None:
    documented: dict[str, set[str]] = {}
    for name, fields in _format_tables()["op"]:
        names = set(re.findall(r"`([a-z_]+)`", fields))
        documented.setdefault(name, set()).update(names)
    assert documented.keys() == OP_FIELDS.keys() | UNSUPPORTED_OPS
    for name, fields in documented.items():
        if name in OP_FIELDS:
            assert fields <= OP_FIELDS[name][0].keys(), (name, fields - OP_FIELDS[name][0].keys())
    # The allocate_slots extras of "Connector-path ops" live in a table of their own.
    extras = {f for f, _ in _format_tables()["field"]}
    assert extras <= OP_FIELDS["allocate_slots"][0].keys()


def test_every_config_key_and_group_kind_format_md_documents_is_handled() -> None:
    tables = _format_tables()
    keys = {k for k, _ in tables["key"]}
    assert keys == CONFIG_FIELDS.keys() | UNSUPPORTED_CONFIG_KEYS
    kinds = {k for k, _ in tables["kind"]}
    assert set(GROUP_FIELDS) <= kinds


# ----------------------------------------------------------------------------- drivers


def _trace(ops: list[dict[str, Any]], **config: Any) -> dict[str, Any]:
    return {"format": FORMAT, "meta": {}, "config": {"block_size": 4, "num_blocks": 16,
                                                     **config}, "ops": ops}


def test_a_malformed_op_stops_the_replay_exactly_where_it_is() -> None:
    ops = [{"op": "add_request", "id": "r", "prompt": list(range(10))},
           {"op": "allocate_slots", "id": "r", "num_new_tokens": 10},
           {"op": "allocate_slots", "id": "r", "num_new_tokens": 1,
            "num_external_tokens": 4},  # a misspelt field: never silently dropped
           {"op": "free", "id": "r"}]
    result = run_trace(_trace(ops))
    rows = result["results"]
    assert [r["op"] for r in rows] == ["add_request", "allocate_slots", "allocate_slots"]
    assert rows[1]["new_block_ids"] == [[1, 2, 3]]
    assert rows[2]["error"].startswith("TraceError") and "num_external_tokens" in rows[2]["error"]
    assert result["summary"]["num_errors"] == 1
    # Op by op, through apply, the same op is refused before the manager sees it.
    rep = Replayer(_trace(ops)["config"])
    rep.apply(ops[0])
    rep.apply(ops[1])
    free = rep.manager.block_pool.get_num_free_blocks()
    with pytest.raises(TraceError):
        rep.apply(ops[2])
    assert rep.manager.block_pool.get_num_free_blocks() == free
    with pytest.raises(TraceError, match="op 2"):
        bench(_trace(ops), 1)


def test_external_tokens_are_honoured_not_ignored() -> None:
    prompt = list(range(20))
    ops = [{"op": "add_request", "id": "r", "prompt": prompt},
           {"op": "get_computed_blocks", "id": "r"},
           {"op": "allocate_slots", "id": "r", "num_new_tokens": 4, "use_lookup": True,
            "num_external_computed_tokens": 16},
           {"op": "get_block_ids", "id": "r"}]
    rows = run_trace(_trace(ops))["results"]
    # Four blocks for the connector's 16 tokens come first; the step's own block after.
    assert rows[2]["new_block_ids"] == [[5]]
    assert rows[3]["block_ids"] == [[1, 2, 3, 4, 5]]


def test_lookup_sources_must_agree_and_exist() -> None:
    ops = [{"op": "add_request", "id": "r", "prompt": list(range(10))},
           {"op": "get_computed_blocks", "id": "r"},
           {"op": "allocate_slots", "id": "r", "num_new_tokens": 10, "use_lookup": True,
            "new_computed_blocks": "empty"}]
    assert "contradicts" in run_trace(_trace(ops))["results"][-1]["error"]
    for op in ({"op": "truncate_computed_blocks", "id": "r", "num_computed_tokens": 0},
               {"op": "free_popped_blocks", "id": "r"},
               {"op": "remove_skipped_blocks", "id": "ghost", "processed_computed_tokens": 0},
               {"op": "allocate_slots", "id": "r", "num_new_tokens": 1,
                "new_computed_blocks": "lookup"}):
        rows = run_trace(_trace([ops[0], op]))["results"]
        assert rows[-1]["error"].startswith("TraceError"), (op, rows[-1])


def test_lora_fields_are_never_silently_dropped() -> None:
    add = {"op": "add_request", "prompt": [1, 2, 3, 4, 5]}
    ok = [{**add, "id": "a", "lora_name": "x", "lora_int_id": 7},
          {**add, "id": "b", "lora_name": "x"},  # the same adapter again
          {**add, "id": "c", "lora_name": "x", "lora_int_id": 7, "lora_path": "/loras/x"}]
    assert all("error" not in r for r in run_trace(_trace(ok))["results"])
    for bad in ({**add, "id": "d", "lora_int_id": 3},  # no adapter to carry the id
                {**add, "id": "d", "lora_path": "/p"},
                {**add, "id": "d", "lora_name": "x", "lora_int_id": 8},  # conflicts with a
                {**add, "id": "d", "lora_name": "x", "lora_path": "/elsewhere"}):
        rows = run_trace(_trace([*ok, bad]))["results"]
        assert rows[-1]["error"].startswith("TraceError"), (bad, rows[-1])


def test_recorded_traces_use_only_known_fields() -> None:
    """Guard for the strictness itself: every shared trace validates (so a field the
    replayer would reject cannot hide behind a replay that stopped early)."""
    require_shared()
    for folder in ("traces", "bench", "connector-traces"):
        for path in sorted((CONFORMANCE / folder).glob("*.json")):
            if path.name.endswith(".expected.json"):
                continue
            trace = json.loads(path.read_text())
            check_config(trace["config"])
            for op in trace["ops"]:
                check_op(op)
