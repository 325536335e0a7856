"""Misuse that would corrupt state raises a clear exception naming the problem *before*
anything changes, and the pool's invariants hold afterwards; valid call sequences keep
vLLM's behaviour (including its tolerance of freeing a request it no longer knows)."""

from __future__ import annotations

from typing import Any

import pytest
from core_testlib import Core, RequestStatus, check_invariants, full, ids, snapshot, swa

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.events import BlockRemoved
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.request import Request
from kvplugin.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    SlidingWindowSpec,
    resolve_kv_cache_block_sizes,
)


def running(c: Core, rid: str, tokens: list[int]) -> Request:
    """A request computed through its prompt, with one sampled token appended."""
    r = c.request(rid, tokens)
    assert c.manager.allocate_slots(r, len(tokens)) is not None
    r.status, r.num_computed_tokens = RequestStatus.RUNNING, len(tokens)
    r.append_output_token_ids(7)
    return r


def unchanged(c: Core, live: list[Request]) -> Any:
    """Context: the call inside must leave the manager exactly as it was."""
    rids = [r.request_id for r in live]

    class _Guard:
        def __enter__(self) -> None:
            self.before = snapshot(c.manager, rids)

        def __exit__(self, *exc: object) -> None:
            assert snapshot(c.manager, rids) == self.before, "state changed"
            check_invariants(c.manager, live)

    return _Guard()


# ----------------------------------------------------------------------------- ref counts


def test_double_free_on_the_pool_raises_before_any_count_moves() -> None:
    c = Core()
    a = running(c, "a", list(range(40)))
    blocks = c.manager.pop_blocks_for_free(a)
    assert ids(blocks) == [1, 2, 3]
    c.pool.free_blocks(reversed(blocks))
    assert c.free_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]
    with unchanged(c, []), pytest.raises(ValueError, match=r"block 3 .*ref count is 0"):
        c.pool.free_blocks(reversed(blocks))
    # A never-allocated block cannot be freed either.
    with unchanged(c, []), pytest.raises(ValueError, match="double free"):
        c.pool.free_blocks([c.pool.blocks[9]])


def test_duplicate_within_one_free_call_raises_and_rolls_back() -> None:
    c = Core()
    a = running(c, "a", list(range(40)))
    b1, b2, b3 = (c.pool.blocks[i] for i in c.table(a))
    # b2 twice with one reference: the second decrement would go below zero.  The
    # earlier entries of the call must not stay decremented either.
    with unchanged(c, [a]), pytest.raises(ValueError, match=r"block 2 .*double free"):
        c.pool.free_blocks([b3, b2, b1, b2])
    assert [b.ref_cnt for b in (b1, b2, b3)] == [1, 1, 1]
    # A block held twice may legitimately be freed twice in one call.
    c.pool.touch([b2])
    c.pool.free_blocks([b2, b2])
    assert b2.ref_cnt == 0 and c.free_ids()[-1] == 2
    c.pool.touch([b2])  # back to one reference, held by a's table
    check_invariants(c.manager, [a])


def test_manager_free_twice_and_unknown_requests_are_harmless() -> None:
    c = Core([swa(32)], num_blocks=16)
    a = running(c, "a", list(range(40)))
    c.manager.free(a)
    queue = c.free_ids()
    with unchanged(c, []):
        c.manager.free(a)  # the second free is a no-op (vLLM tolerates it)
        c.manager.free(Request("ghost", [1, 2, 3]))
        assert c.manager.pop_blocks_for_free(Request("ghost", [1])) == []
        # A window release for an unknown request is harmless too.
        c.manager.remove_skipped_blocks("ghost", 500)
        assert c.manager.get_block_ids("ghost") == ([],)
    assert c.free_ids() == queue


# ----------------------------------------------------------------------------- counts


@pytest.mark.parametrize("name", ["num_new_tokens", "num_new_computed_tokens",
                                  "num_lookahead_tokens", "num_external_computed_tokens",
                                  "num_encoder_tokens", "reserved_blocks"])
def test_negative_token_counts_raise_before_window_release(name: str) -> None:
    # A sliding-window request whose next allocation would release out-of-window blocks:
    # the argument check has to come first.
    c = Core([swa(32)], num_blocks=20)
    a = running(c, "a", list(range(100)))
    assert c.table(a) == [1, 2, 3, 4, 5, 6, 7]
    kwargs = {"num_new_tokens": 1, name: -1}
    with unchanged(c, [a]), pytest.raises(ValueError, match=f"{name} must be >= 0, got -1"):
        c.manager.allocate_slots(a, **kwargs)
    assert c.table(a) == [1, 2, 3, 4, 5, 6, 7]
    assert c.manager.allocate_slots(a, 1) is not None  # the valid call releases the window
    assert c.table(a)[:4] == [0, 0, 0, 0]


def test_negative_processed_tokens_for_window_release() -> None:
    c = Core([swa(32)], num_blocks=20)
    a = running(c, "a", list(range(100)))
    with unchanged(c, [a]), pytest.raises(ValueError, match="processed_computed_tokens"):
        c.manager.remove_skipped_blocks("a", -1)


def test_zero_new_tokens_with_nothing_to_adopt_is_vllms_value_error() -> None:
    c = Core()
    r = c.request("r", list(range(20)))
    with unchanged(c, [r]), pytest.raises(ValueError) as err:
        c.manager.allocate_slots(r, 0)
    assert str(err.value) == ("num_new_tokens must be greater than 0 when there are no "
                              "computed tokens to adopt")
    # Zero new tokens is legal when computed tokens are adopted (an async KV load).
    out = c.manager.allocate_slots(r, 0, num_external_computed_tokens=16,
                                   delay_cache_blocks=True)
    assert out is c.manager.empty_kv_cache_blocks and c.table(r) == [1]


def test_negative_block_request_on_the_pool() -> None:
    c = Core()
    with unchanged(c, []), pytest.raises(ValueError, match="negative"):
        c.pool.get_new_blocks(-1)


# ----------------------------------------------------------------------------- hits


def test_hits_for_a_running_full_attention_request_are_rejected() -> None:
    c = Core(num_blocks=16)
    a = running(c, "a", list(range(48)))
    b = c.request("b", list(range(48)))
    hits, n = c.lookup(b)
    assert n == 32
    with unchanged(c, [a, b]), pytest.raises(ValueError, match="running"):
        c.manager.allocate_slots(a, 1, n, hits)


def test_hits_for_a_running_sliding_window_request_are_rejected_before_window_release(
) -> None:
    c = Core([swa(32)], num_blocks=20)
    a = running(c, "a", list(range(100)))
    b = c.request("b", list(range(100)))
    hits, n = c.lookup(b)
    assert n == 96
    for gate in (False, True):
        with unchanged(c, [a, b]), pytest.raises(ValueError, match="running"):
            c.manager.allocate_slots(a, 1, n, hits, full_sequence_must_fit=gate)
    assert c.table(a) == [1, 2, 3, 4, 5, 6, 7]


def test_hits_for_a_request_that_already_holds_blocks_are_rejected() -> None:
    # Allocated, but nothing cached yet (a prompt shorter than a block): not "known" to
    # the prefix cache, yet adopting hits would overwrite its table.
    c = Core(num_blocks=16)
    full_req = running(c, "full", list(range(48)))
    small = c.request("small", list(range(5)))
    assert c.manager.allocate_slots(small, 5) is not None
    hits, n = c.lookup(c.request("probe", list(range(48))))
    assert n == 32
    with unchanged(c, [full_req, small]), pytest.raises(ValueError, match="already holds"):
        c.manager.allocate_slots(small, 1, n, hits)


def test_hits_with_the_wrong_number_of_groups() -> None:
    c = Core([full(16), swa(32)], num_blocks=16)
    r = c.request("r", list(range(20)))
    other = Core(num_blocks=16)
    blocks = other.manager.get_blocks("nothing")
    with unchanged(c, [r]), pytest.raises(ValueError, match="groups"):
        c.manager.allocate_slots(r, 20, 0, blocks)


# ----------------------------------------------------------------------------- ids


@pytest.mark.parametrize("bad", [11, 1000, -1])
def test_evict_blocks_out_of_range_raises_before_evicting_anything(bad: int) -> None:
    c = Core()
    a = running(c, "a", list(range(48)))
    assert all(c.pool.blocks[i].block_hash is not None for i in (1, 2, 3))
    with unchanged(c, [a]), pytest.raises(ValueError, match=f"Invalid block_id {bad}"):
        c.manager.evict_blocks({1, 2, bad})
    assert c.pool.blocks[1].block_hash is not None
    assert not any(isinstance(e, BlockRemoved) for e in c.events())


# ----------------------------------------------------------------------------- configs


@pytest.mark.parametrize("num_blocks", [0, 1, -3])
def test_config_without_usable_blocks(num_blocks: int) -> None:
    with pytest.raises(ValueError, match="num_blocks"):
        KVCacheConfig(num_blocks=num_blocks,
                      kv_cache_groups=[KVCacheGroupSpec(["l"], FullAttentionSpec(block_size=16))])


@pytest.mark.parametrize("n", [0, -1])
def test_pool_without_blocks(n: int) -> None:
    with pytest.raises(ValueError, match="num_gpu_blocks"):
        BlockPool(n, enable_caching=True, hash_block_size=16)


def test_config_without_groups() -> None:
    config = KVCacheConfig(num_blocks=8, kv_cache_groups=[])
    with pytest.raises(ValueError, match="no KV-cache groups"):
        KVCacheManager(config, max_model_len=64, scheduler_block_size=16, hash_block_size=16)


@pytest.mark.parametrize(("make", "match"), [
    (lambda: SlidingWindowSpec(block_size=16, sliding_window=0), "sliding_window"),
    (lambda: SlidingWindowSpec(block_size=16, sliding_window=-4), "sliding_window"),
    (lambda: ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=0),
     "attention_chunk_size"),
    (lambda: FullAttentionSpec(block_size=0), "block_size"),
    (lambda: SlidingWindowSpec(block_size=-16, sliding_window=32), "block_size"),
])
def test_specs_reject_empty_windows_and_blocks(make: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        make()


def _config(*specs: Any) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=32, kv_cache_groups=[
        KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])


def test_prefix_match_unit_must_divide_every_group() -> None:
    config = _config(FullAttentionSpec(block_size=32), SlidingWindowSpec(block_size=16,
                                                                         sliding_window=64))
    assert resolve_kv_cache_block_sizes(config, 16) == (32, 16)
    assert resolve_kv_cache_block_sizes(config, 16, prefix_match_unit=8) == (32, 8)
    with pytest.raises(ValueError, match="prefix_match_unit=12"):
        resolve_kv_cache_block_sizes(config, 16, prefix_match_unit=12)


def test_single_group_prefix_match_unit_must_be_the_block_size() -> None:
    config = _config(FullAttentionSpec(block_size=16))
    with pytest.raises(ValueError, match="prefix_match_unit=8"):
        resolve_kv_cache_block_sizes(config, 16, prefix_match_unit=8)
    assert resolve_kv_cache_block_sizes(config, 16, prefix_match_unit=16) == (16, 16)
    # Without caching or a connector the unit is irrelevant.
    assert resolve_kv_cache_block_sizes(config, 16, prefix_match_unit=8,
                                        enable_caching=False) == (16, 16)


def test_single_group_hash_block_size_must_equal_the_block_size() -> None:
    config = _config(FullAttentionSpec(block_size=16))
    with pytest.raises(ValueError, match="hash block size"):
        KVCacheManager(config, max_model_len=256, scheduler_block_size=16, hash_block_size=8)


@pytest.mark.parametrize(("sbs", "hbs", "match"), [
    (48, 16, "scheduler_block_size"),  # not a multiple of the 32-token group
    (32, 12, "hash block size"),  # 12 does not divide 32
    (64, 64, "hash block size"),  # hash unit coarser than the 16-token group
])
def test_hybrid_block_sizes_that_cannot_be_aligned(sbs: int, hbs: int, match: str) -> None:
    config = _config(FullAttentionSpec(block_size=32), SlidingWindowSpec(block_size=16,
                                                                         sliding_window=64))
    with pytest.raises(ValueError, match=match):
        KVCacheManager(config, max_model_len=256, scheduler_block_size=sbs, hash_block_size=hbs)


def test_bad_manager_arguments() -> None:
    config = _config(FullAttentionSpec(block_size=16))
    with pytest.raises(ValueError, match="max_model_len"):
        KVCacheManager(config, max_model_len=0, scheduler_block_size=16, hash_block_size=16)
    with pytest.raises(ValueError, match="watermark"):
        KVCacheManager(config, max_model_len=64, scheduler_block_size=16, hash_block_size=16,
                       watermark=-0.1)


def test_remove_skipped_blocks_over_a_block_already_freed_changes_nothing() -> None:
    # Found by vLLM's own unit tests run against the core: a window release over a table
    # holding a block whose ref count is already 0 nulled the entries, then raised.
    c = Core([swa(32)], num_blocks=20)
    a = running(c, "a", list(range(100)))
    assert c.table(a) == [1, 2, 3, 4, 5, 6, 7]
    c.pool.blocks[2].ref_cnt = 0  # freed behind the manager's back (the misuse)
    before = snapshot(c.manager, ["a"])
    with pytest.raises(ValueError, match=r"block 2 .*ref count is 0"):
        c.manager.remove_skipped_blocks("a", 100)
    # Tables, ref counts, free queue, cache map, events: exactly as before the call (the
    # invariants cannot hold while block 2's count is the misuse's).
    assert snapshot(c.manager, ["a"]) == before
    assert c.table(a) == [1, 2, 3, 4, 5, 6, 7]  # no entry nulled
    c.pool.blocks[2].ref_cnt = 1
    c.manager.remove_skipped_blocks("a", 100)  # the valid call then releases as vLLM does
    assert c.table(a)[:4] == [0, 0, 0, 0] and c.table(a)[4:] == [5, 6, 7]
    check_invariants(c.manager, [a])
