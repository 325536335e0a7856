"""Every misuse error the core raises leaves the manager exactly as it was.

One case per ``raise`` site in ``kvplugin/core`` reachable on a live manager: the case
provokes it and the test compares everything the manager owns (tables, ref counts, free
queue order, cache map, events, reuse watchers, zeroing lists) before and after. Sites
that only validate construction arguments change nothing by construction and are listed
as such; a new ``raise`` in the core fails :func:`test_every_raise_site_has_a_case` until
it gets a case or a reason.
"""

from __future__ import annotations

import ast
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from core_testlib import Core, RequestStatus, full, ids, snapshot, swa

from kvplugin.core.manager import KVCacheManager
from kvplugin.core.request import Request
from kvplugin.core.specs import (
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)

CORE = Path(__file__).resolve().parents[2] / "kvplugin" / "core"


@dataclass
class Case:
    core: Core
    live: list[Request]
    call: Callable[[], Any]
    error: type[Exception]
    match: str


def running(c: Core, rid: str, tokens: list[int]) -> Request:
    r = c.request(rid, tokens)
    assert c.manager.allocate_slots(r, len(tokens)) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, len(tokens)
    return r


def uncached(c: Core, rid: str, tokens: list[int]) -> Request:
    """Allocated, its blocks not in the prefix cache yet (an async load's admission)."""
    r = c.request(rid, tokens)
    assert c.manager.allocate_slots(r, len(tokens), delay_cache_blocks=True) is not None
    return r


def state(c: Core, live: list[Request]) -> dict[str, Any]:
    snap = snapshot(c.manager, [r.request_id for r in live])
    snap["events"] = list(c.pool.kv_event_queue)
    snap["watchers"] = {b: [(w, set(w.pending)) for w in ws]
                        for b, ws in c.pool._reuse_watchers.items()}
    managers = c.manager.coordinator.single_type_managers
    snap["zeroing"] = [list(m.new_block_ids) for m in managers]
    snap["known"] = [(sorted(m.req_to_blocks), dict(m.num_cached_block)) for m in managers]
    snap["free_order"] = ids(c.pool.free_block_queue.get_all_free_blocks())
    return snap


def blocks(c: Core, *bids: int) -> list[Any]:
    return [c.pool.blocks[b] for b in bids]


# ----------------------------------------------------------------------------- the cases


def _mask_length() -> Case:
    c = Core(num_blocks=12)
    r = uncached(c, "r", list(range(40)))
    table = c.manager.coordinator.get_blocks("r")[0]
    return Case(c, [r], lambda: c.pool.cache_full_blocks(r, table, 0, 2, 16, 0, [True]),
                AssertionError, "block_mask length")


def _already_cached_midway() -> Case:
    # The first block would be cached, the second is a full block of another prefix.
    c = Core(num_blocks=12)
    a = running(c, "a", list(range(48)))
    r = uncached(c, "r", list(range(100, 148)))
    table = [c.manager.coordinator.get_blocks("r")[0][0], c.pool.blocks[3]]
    return Case(c, [a, r], lambda: c.pool.cache_full_blocks(r, table, 0, 2, 16, 0),
                AssertionError, "block 3 is already cached")


def _partial(tokens: int, match: str) -> Callable[[], Case]:
    def build() -> Case:
        c = Core(num_blocks=12)
        r = uncached(c, "r", list(range(40)))
        blk = c.manager.coordinator.get_blocks("r")[0][2]
        return Case(c, [r], lambda: c.pool.cache_partial_block(r, blk, tokens, 0, 16),
                    AssertionError, match)
    return build


def _move_onto_cached() -> Case:
    c = Core(num_blocks=12)
    a = running(c, "a", list(range(48)))
    src, dst = blocks(c, 1, 2)
    return Case(c, [a], lambda: c.pool.move_block_hashes(src, dst), AssertionError,
                "block 2 is already cached")


def _negative_blocks() -> Case:
    c = Core()
    return Case(c, [], lambda: c.pool.get_new_blocks(-1), ValueError, "negative")


def _too_many_blocks() -> Case:
    c = Core()
    a = running(c, "a", list(range(48)))
    return Case(c, [a], lambda: c.pool.get_new_blocks(8), ValueError,
                "Cannot get 8 free blocks")


def _double_free() -> Case:
    c = Core()
    a = running(c, "a", list(range(48)))
    b1, b4 = blocks(c, 1, 4)  # held by a, and free: the first would be freed
    return Case(c, [a], lambda: c.pool.free_blocks([b1, b4]), ValueError,
                "block 4 whose ref count is 0")


def _unpin_free_block() -> Case:
    c = Core()
    a = running(c, "a", list(range(48)))
    b1, b4 = blocks(c, 1, 4)
    return Case(c, [a], lambda: c.pool.unpin_blocks([b1, b4], lambda _: None), ValueError,
                "unpin of block 4 with ref count 0")


def _watch_null() -> Case:
    c = Core()
    a = running(c, "a", list(range(48)))
    b1 = c.pool.blocks[1]
    return Case(c, [a], lambda: c.pool.watch_reuse([b1, c.pool.null_block], lambda _: None),
                ValueError, "null block")


def _evict_unknown_id() -> Case:
    c = Core()
    a = running(c, "a", list(range(48)))
    return Case(c, [a], lambda: c.manager.evict_blocks({1, 2, 99}), ValueError,
                "Invalid block_id 99")


def _set_hash_twice() -> Case:
    c = Core()
    a = running(c, "a", list(range(48)))
    b1 = c.pool.blocks[1]
    return Case(c, [a], lambda: b1.set_block_hash(b"x" * 36, 16), AssertionError,
                "already has a hash")


def _popleft_empty() -> Case:
    c = Core(num_blocks=4)
    a = running(c, "a", list(range(48)))
    return Case(c, [a], c.pool.free_block_queue.popleft, ValueError, "No free blocks")


def _popleft_n_too_many() -> Case:
    c = Core()
    a = running(c, "a", list(range(48)))
    return Case(c, [a], lambda: c.pool.free_block_queue.popleft_n(9), ValueError,
                "Cannot pop 9 blocks")


def _remove_held_block() -> Case:
    c = Core()
    a = running(c, "a", list(range(48)))
    b1 = c.pool.blocks[1]
    return Case(c, [a], lambda: c.pool.free_block_queue.remove(b1), RuntimeError,
                "not in the free queue")


def _adopt_while_running() -> Case:
    c = Core(num_blocks=16)
    a = running(c, "a", list(range(48)))
    hits, n = c.lookup(c.request("b", list(range(48))))
    # Straight to the coordinator: the manager's own check (below) runs first otherwise.
    return Case(c, [a], lambda: c.manager.coordinator.allocate_new_computed_blocks(
        "a", hits.blocks, n, 0), AssertionError, "running")


def _adopt_holding_blocks() -> Case:
    c = Core(num_blocks=16)
    a = running(c, "a", list(range(48)))
    hits, n = c.lookup(c.request("b", list(range(48))))
    return Case(c, [a], lambda: c.manager.allocate_slots(a, 1, n, hits), ValueError, "running")


def _cp_lookup(dcp: int, pcp: int) -> Callable[[], Case]:
    def build() -> Case:
        c = Core([swa(32)], num_blocks=20)
        cfg = KVCacheConfig(num_blocks=20, kv_cache_groups=[
            KVCacheGroupSpec(["l0"], swa(32))])
        span = 16 * dcp  # a DCP-sharded block spans every rank's tokens
        mgr = KVCacheManager(cfg, max_model_len=512, scheduler_block_size=span,
                             hash_block_size=span, dcp_world_size=dcp, pcp_world_size=pcp,
                             enable_kv_cache_events=True)
        c.manager = mgr
        r = c.request("r", list(range(64)))
        return Case(c, [r], lambda: mgr.get_computed_blocks(r), AssertionError,
                    f"{'DCP' if dcp > 1 else 'PCP'} not support sliding window")
    return build


def _unhashed_ids_many_groups() -> Case:
    c = Core([full(16), swa(32)], num_blocks=16)
    r = c.request("r", list(range(20)))
    out = c.manager.get_blocks("nobody")
    return Case(c, [r], out.get_unhashed_block_ids, ValueError, "one group only")


def _zero_new_tokens() -> Case:
    c = Core()
    r = c.request("r", list(range(20)))
    return Case(c, [r], lambda: c.manager.allocate_slots(r, 0), ValueError,
                "num_new_tokens must be greater than 0")


def _wrong_group_count() -> Case:
    c = Core([full(16), swa(32)], num_blocks=16)
    r = c.request("r", list(range(20)))
    other = Core(num_blocks=16).manager.get_blocks("nothing")
    return Case(c, [r], lambda: c.manager.allocate_slots(r, 20, 0, other), ValueError,
                "groups")


def _negative_processed() -> Case:
    c = Core([swa(32)], num_blocks=20)
    a = running(c, "a", list(range(100)))
    return Case(c, [a], lambda: c.manager.remove_skipped_blocks("a", -1), ValueError,
                "processed_computed_tokens")


def _truncate_noncacheable() -> Case:
    c = Core([full(16), CircularBufferSpec(block_size=64)], num_blocks=16)
    a = running(c, "a", list(range(48)))
    ring = c.manager.coordinator.get_blocks("a")[1]
    held = c.manager.create_kv_cache_blocks(([], list(ring)))
    return Case(c, [a], lambda: c.manager.truncate_computed_blocks(held, 0), ValueError,
                "non-cacheable")


def _truncate(tokens: int, match: str) -> Callable[[], Case]:
    def build() -> Case:
        c = Core(num_blocks=16)
        a = running(c, "a", list(range(48)))
        hits, _ = c.lookup(c.request("b", list(range(48))))  # two blocks
        return Case(c, [a], lambda: c.manager.truncate_computed_blocks(hits, tokens),
                    ValueError, match)
    return build


def _mixed_precision() -> Core:
    # Two attention dtypes: new blocks are zeroed (recorded) in both groups.
    return Core([FullAttentionSpec(block_size=16, dtype="float16"),
                 FullAttentionSpec(block_size=32, dtype="bfloat16")], num_blocks=24)


def _zeroing_unaligned() -> Case:
    c = _mixed_precision()
    a = running(c, "a", list(range(64)))
    c.manager.take_new_block_ids()
    # Aligned for the 16-token group (recorded first), not for the 32-token one.
    return Case(c, [a], lambda: c.manager.record_blocks_for_zeroing("a", 16), ValueError,
                "block-aligned")


def _zeroing_range() -> Case:
    c = _mixed_precision()
    a = running(c, "a", list(range(64)))
    return Case(c, [a], lambda: c.manager.get_zeroing_block_ids_in_range("a", 32, 16),
                ValueError, "0 <= start_token <= end_token")


def _count_type() -> Case:
    c = Core()
    r = c.request("r", list(range(20)))
    return Case(c, [r], lambda: c.manager.allocate_slots(r, 1.5), TypeError,  # type: ignore[arg-type]
                "num_new_tokens must be an int")


def _count_negative() -> Case:
    c = Core([swa(32)], num_blocks=20)
    a = running(c, "a", list(range(100)))
    return Case(c, [a], lambda: c.manager.allocate_slots(a, 1, num_lookahead_tokens=-1),
                ValueError, "num_lookahead_tokens must be >= 0")


def _window_release_over_freed_block() -> Case:
    c = Core([swa(32)], num_blocks=20)
    a = running(c, "a", list(range(100)))
    c.pool.blocks[2].ref_cnt = 0  # freed behind the manager's back (the misuse)
    return Case(c, [a], lambda: c.manager.remove_skipped_blocks("a", 100), ValueError,
                "ref count is 0")


def _hash_view_index() -> Case:
    from kvplugin.core.hashing import BlockHashListWithBlockSize

    c = Core(num_blocks=12)
    r = c.request("r", list(range(40)))
    view = BlockHashListWithBlockSize(r.block_hashes, 16, 32)
    return Case(c, [r], lambda: view[5], IndexError, "5")


def _single(c: Core, group: int = 0) -> Any:
    return c.manager.coordinator.single_type_managers[group]


def _group_adopt_while_running() -> Case:
    c = Core(num_blocks=16)
    a = running(c, "a", list(range(48)))
    hits, n = c.lookup(c.request("b", list(range(48))))
    return Case(c, [a], lambda: _single(c).get_num_blocks_to_allocate(
        "a", 64, hits.blocks[0], 32, n, 64), AssertionError, "running")


def _group_adopt_holding_blocks() -> Case:
    c = Core(num_blocks=16)
    a = running(c, "a", list(range(48)))
    hits, n = c.lookup(c.request("b", list(range(48))))
    return Case(c, [a], lambda: _single(c).add_local_computed_blocks(
        "a", hits.blocks[0], n, 0), AssertionError, "already has blocks")


def _group_hits_without_caching() -> Case:
    c = Core(num_blocks=16, enable_caching=False)
    a = running(c, "a", list(range(48)))
    held = list(c.manager.coordinator.get_blocks("a")[0])
    return Case(c, [a], lambda: _single(c).add_local_computed_blocks("new", held, 32, 0),
                AssertionError, "caching disabled")


def _cross_attention() -> Core:
    return Core([full(16), CrossAttentionSpec(block_size=16)], num_blocks=16,
                enable_caching=False)


def _cross_hits() -> Case:
    c = _cross_attention()
    a = running(c, "a", list(range(48)))
    held = list(c.manager.coordinator.get_blocks("a")[0])
    return Case(c, [a], lambda: _single(c, 1).add_local_computed_blocks("new", held, 32, 0),
                AssertionError, "never have prefix hits")


def _cross_cache() -> Case:
    c = _cross_attention()
    a = running(c, "a", list(range(48)))
    return Case(c, [a], lambda: _single(c, 1).cache_blocks(a, 32, replay_boundaries=()),
                ValueError, "never cached")


# site ("Qualname#k": the k-th raise in that function, from 1) -> its case
CASES: dict[str, Callable[[], Case]] = {
    "BlockPool.cache_full_blocks#1": _mask_length,
    "BlockPool.cache_full_blocks#2": _already_cached_midway,
    "BlockPool.cache_partial_block#1": _partial(8, "hash-block boundaries"),
    "BlockPool.cache_partial_block#2": _partial(48, "no block hash at token 48"),
    "BlockPool.move_block_hashes#1": _move_onto_cached,
    "BlockPool.get_new_blocks#1": _negative_blocks,
    "BlockPool.get_new_blocks#2": _too_many_blocks,
    "BlockPool.free_blocks#1": _double_free,
    "BlockPool.unpin_blocks#1": _unpin_free_block,
    "BlockPool.watch_reuse#1": _watch_null,
    "BlockPool.evict_blocks#1": _evict_unknown_id,
    "KVCacheBlock.set_block_hash#1": _set_hash_twice,
    "FreeBlockQueue.popleft#1": _popleft_empty,
    "FreeBlockQueue.popleft_n#1": _popleft_n_too_many,
    "FreeBlockQueue.remove#1": _remove_held_block,
    "KVCacheCoordinator.allocate_new_computed_blocks#1": _adopt_while_running,
    "check_cp_lookup#1": _cp_lookup(2, 1),
    "check_cp_lookup#2": _cp_lookup(1, 2),
    "BlockHashListWithBlockSize.__getitem__#1": _hash_view_index,
    "KVCacheBlocks.get_unhashed_block_ids#1": _unhashed_ids_many_groups,
    "KVCacheManager.allocate_slots#1": _zero_new_tokens,
    "KVCacheManager.allocate_slots#2": _wrong_group_count,
    "KVCacheManager._check_can_adopt#1": _adopt_holding_blocks,
    "KVCacheManager.remove_skipped_blocks#1": _negative_processed,
    "KVCacheManager.truncate_computed_blocks#1": _truncate_noncacheable,
    "KVCacheManager.truncate_computed_blocks#2": _truncate(20, "not a multiple"),
    "KVCacheManager.truncate_computed_blocks#3": _truncate(64, "cannot truncate 2 blocks to 4"),
    "StepDrains.record_blocks_for_zeroing#1": _zeroing_unaligned,
    "StepDrains.get_zeroing_block_ids_in_range#1": _zeroing_range,
    "_raise_bad_count#1": _count_type,
    "_raise_bad_count#2": _count_negative,
    "SingleTypeKVCacheManager.get_num_blocks_to_allocate#1": _group_adopt_while_running,
    "SingleTypeKVCacheManager.add_local_computed_blocks#1": _group_adopt_holding_blocks,
    "SingleTypeKVCacheManager.add_local_computed_blocks#2": _group_hits_without_caching,
    "CrossAttentionManager.add_local_computed_blocks#1": _cross_hits,
    "CrossAttentionManager.cache_blocks#1": _cross_cache,
    # Not a raise site of its own (free_blocks raises), but the path the outside run found:
    "SingleTypeKVCacheManager.remove_skipped_blocks(freed)": _window_release_over_freed_block,
}

# Assertions of the core's own bookkeeping: reachable only once the manager is already
# inconsistent (a bug, not a caller's misuse), so there is no "as it was" to keep.
INTERNAL = {
    "SingleTypeKVCacheManager._apply_cow#1": "copy-on-write list out of step with the table",
    "MambaManager.allocate_new_blocks#1": "its own block count, computed just before",
    "MambaManager._relocate_passed_speculative_blocks#1": "speculative blocks it owns",
    "MambaTails._move_own_partial_tail#1": "partial-tail bookkeeping",
    "MambaTails._move_own_partial_tail#2": "partial-tail bookkeeping",
    "MambaManager.cache_blocks#1": "a cached block without its token count",
    "MambaTails._cache_checkpoint#1": "a checkpoint slot it allocated",
}

# Argument and spec checks of lookups and factories that no live manager reaches: the
# layouts they refuse are refused when the manager is built (check_lookup_layout,
# manager_class_for), so they hold no state to change.
STATIC = {
    "manager_class_for#1", "manager_class_for#2", "manager_class_for#3",
    "ChunkedLocalAttentionManager.find_longest_cache_hit#1",
    "ChunkedLocalAttentionManager.find_longest_cache_hit#2",
    "MambaManager.find_longest_cache_hit#1",
    "validate_mamba_spec#1", "validate_mamba_spec#2", "validate_mamba_spec#3",
}

# Sites with nothing to roll back: they validate constructor arguments or configurations
# before any manager exists.
CONSTRUCTION = ("__init__", "__post_init__", "_validate", "resolve_kv_cache_block_sizes",
                "get_hash_fn_by_name", "check_cp_layout", "check_lookup_layout",
                "_split_groups")


def _sites_in(tree: ast.AST) -> list[str]:
    sites: list[str] = []
    counts: dict[str, int] = {}

    def visit(node: ast.AST, scope: list[str]) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                visit(child, [*scope, child.name])
                continue
            if isinstance(child, ast.Raise) and child.exc is not None:
                exc = child.exc.func if isinstance(child.exc, ast.Call) else child.exc
                name = getattr(exc, "id", getattr(exc, "attr", ""))
                if name != "NotImplementedError" and not any(
                        part.startswith(CONSTRUCTION) for part in scope):
                    fn = ".".join(scope)
                    counts[fn] = counts.get(fn, 0) + 1
                    sites.append(f"{fn}#{counts[fn]}")
            visit(child, scope)

    visit(tree, [])
    return sites


def raise_sites() -> list[str]:
    return [site for path in sorted(CORE.rglob("*.py"))
            for site in _sites_in(ast.parse(path.read_text()))]


def test_every_raise_site_has_a_case() -> None:
    missing = [s for s in raise_sites() if s not in CASES and s not in INTERNAL
               and s not in STATIC]
    assert not missing, f"misuse errors without an atomicity case: {missing}"


@pytest.mark.parametrize("site", sorted(CASES))
def test_misuse_leaves_the_manager_as_it_was(site: str) -> None:
    case = CASES[site]()
    before = state(case.core, case.live)
    with pytest.raises(case.error, match=case.match):
        case.call()
    assert state(case.core, case.live) == before
