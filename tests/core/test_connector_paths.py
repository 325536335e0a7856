"""The manager calls vLLM's Scheduler makes when a KV connector is configured, and the
public equivalents of what the Scheduler does past the manager.

Every block id, hit, offload and count below was recorded by running the same call
sequence on vLLM 0.33.0's own ``KVCacheManager`` (the conformance ``reference/``, traces
written for these scenarios); the reserved-block queries are checked against the Scheduler's
own values in ``test_conformance``.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from core_testlib import Core, full, ids, swa

from kvplugin.core.blocks import external_block_hash
from kvplugin.core.manager import KVCacheBlocks, KVCacheManager
from kvplugin.core.request import Request, RequestStatus
from kvplugin.core.specs import FullAttentionSpec, MambaSpec


def table(m: KVCacheManager, rid: str) -> list[list[int]]:
    return [list(g) for g in m.get_block_ids(rid)]


def as_ids(blocks: KVCacheBlocks | None) -> list[list[int]] | None:
    return None if blocks is None else [ids(g) for g in blocks.blocks]


def executed(req: Request, num_computed: int, tokens: Sequence[int] = ()) -> None:
    req.status = RequestStatus.RUNNING
    req.num_computed_tokens = num_computed
    if tokens:
        req.append_output_token_ids(list(tokens))


# ----------------------------------------------------------------------------- full attention


def _finished_producer() -> tuple[Core, Request]:
    """bs 4: r0 (14 prompt tokens) ran its prefill and sampled one token."""
    c = Core(block_size=4, num_blocks=12, max_model_len=128)
    r0 = c.request("r0", list(range(14)))
    assert as_ids(c.manager.allocate_slots(r0, 14)) == [[1, 2, 3, 4]]
    executed(r0, 14, [100])
    return c, r0


def test_block_ids_for_computed_tokens_and_cached_tokens_at_finish() -> None:
    c, r0 = _finished_producer()
    m = c.manager
    assert m.estimate_cached_tokens(r0) == 12  # three full blocks carry hashes
    assert m.get_block_ids_for_computed_tokens("r0", 5) == ([1, 2],)
    assert m.get_block_ids_for_computed_tokens("r0", 0) == ([],)
    m.remove_skipped_blocks("r0", 14, num_prompt_tokens=14)  # nothing leaves full attention
    assert table(m, "r0") == [[1, 2, 3, 4]] and c.num_free() == 7
    assert m.get_block_ids_for_computed_tokens("ghost", 8) == ([],)
    assert m.estimate_cached_tokens(c.request("ghost", [1])) == 0


def test_popped_blocks_stay_out_of_the_pool_until_freed() -> None:
    c, r0 = _finished_producer()
    m = c.manager
    r0.status = RequestStatus.FINISHED_STOPPED
    popped = m.pop_blocks_for_free(r0)
    assert ids(popped) == [1, 2, 3, 4]
    assert table(m, "r0") == [[]] and c.num_free() == 7  # forgotten, not yet freed
    assert m.pop_blocks_for_free(r0) == []
    # A later request still hits the popped blocks (they keep their hashes and refs).
    r1 = c.request("r1", [*range(12), *range(50, 58)])
    hits, n = c.lookup(r1)
    assert n == 12 and as_ids(hits) == [[1, 2, 3]]
    assert as_ids(m.allocate_slots(r1, 8, 12, hits)) == [[5, 6]]
    assert c.free_ids() == [7, 8, 9, 10, 11]
    m.free_popped_blocks(popped)  # tail first: the uncached block 4 is reused first
    assert c.free_ids() == [4, 7, 8, 9, 10, 11]
    with pytest.raises(ValueError, match="double free"):
        m.free_popped_blocks(popped)
    assert c.free_ids() == [4, 7, 8, 9, 10, 11]


def test_evict_blocks_drops_hashes_but_not_references() -> None:
    c, r0 = _finished_producer()
    m = c.manager
    r1 = c.request("r1", [*range(12), *range(50, 58)])
    hits, n = c.lookup(r1)
    m.allocate_slots(r1, 8, n, hits)
    m.free(r0)
    c.events()
    m.evict_blocks({3, 9})  # block 3 is in use by r1, block 9 is free and uncached
    assert c.num_free() == 6
    (removed,) = c.events()
    assert removed.block_hashes == [external_block_hash(r1.block_hashes[2])]
    r2 = c.request("r2", [*range(12), 70, 71, 72, 73])
    hits, n = c.lookup(r2)
    assert n == 8 and as_ids(hits) == [[1, 2]]
    assert m.estimate_cached_tokens(r1) == 20  # the largest keyed extent: block 6 ends at 20


def test_async_load_then_empty_computed_blocks() -> None:
    c = Core(block_size=4, num_blocks=12, max_model_len=128)
    m = c.manager
    r3 = c.request("r3", list(range(200, 216)))
    hits, n = c.lookup(r3)
    out = m.allocate_slots(r3, 0, n, hits, num_external_computed_tokens=12,
                           delay_cache_blocks=True, skip_zeroing_group_ids=(0,))
    assert out is m.empty_kv_cache_blocks and table(m, "r3") == [[1, 2, 3]]
    assert c.events() == []  # nothing is cached while the load runs
    r3.status, r3.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, 12
    m.cache_blocks(r3, 12)
    (stored,) = c.events()
    assert len(stored.block_hashes) == 3
    r3.status = RequestStatus.WAITING
    # The scheduler passes the shared empty KVCacheBlocks once the load finished.
    assert as_ids(m.allocate_slots(r3, 4, 0, m.empty_kv_cache_blocks)) == [[4]]
    assert table(m, "r3") == [[1, 2, 3, 4]]


def test_none_and_empty_computed_blocks_are_the_same_call_without_retained_hits() -> None:
    results = []
    for source in ("none", "empty"):
        c = Core(block_size=4, num_blocks=12)
        r = c.request("r", list(range(10)))
        blocks = None if source == "none" else c.manager.empty_kv_cache_blocks
        out = c.manager.allocate_slots(r, 6, 0, blocks, num_external_computed_tokens=4)
        results.append((as_ids(out), table(c.manager, "r"), c.num_free()))
    assert results[0] == results[1] == ([[2, 3]], [[1, 2, 3]], 8)


# ----------------------------------------------------------------------------- sliding window


def test_window_release_at_finish_before_the_table_goes_to_the_connector() -> None:
    c = Core([full(4), swa(8, 4)], block_size=4, num_blocks=24, max_model_len=128)
    m = c.manager
    a = c.request("a", list(range(30)))
    assert as_ids(m.allocate_slots(a, 30)) == [[1, 2, 3, 4, 5, 6, 7, 8],
                                               [9, 10, 11, 12, 13, 14, 15, 16]]
    executed(a, 30, [7])
    m.remove_skipped_blocks("a", 30, num_prompt_tokens=30)
    assert table(m, "a") == [[1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 14, 15, 16]]
    assert c.num_free() == 12
    assert m.get_block_ids_for_computed_tokens("a", 21) == ([1, 2, 3, 4, 5, 6],
                                                            [0, 0, 0, 0, 0, 14])
    assert m.estimate_cached_tokens(a) == 28
    assert c.free_ids() == [17, 18, 19, 20, 21, 22, 23, 13, 12, 11, 10, 9]
    popped = m.pop_blocks_for_free(a)  # leading nulls trimmed, groups concatenated
    assert ids(popped) == [1, 2, 3, 4, 5, 6, 7, 8, 14, 15, 16]
    m.free_popped_blocks(popped)
    assert c.num_free() == 23
    m.remove_skipped_blocks("a", 30)  # a forgotten request: harmless
    assert table(m, "a") == [[], []]
    assert c.free_ids() == [16, 8, 17, 18, 19, 20, 21, 22, 23, 13, 12, 11, 10, 9, 15, 14,
                            7, 6, 5, 4, 3, 2, 1]


# ----------------------------------------------------------------------------- full + Mamba

MAMBA = MambaSpec(block_size=16, mamba_cache_mode="align")
PROMPT = list(range(1000, 1075))  # 75 tokens: the last hash boundary (unit 8) is 72
OTHER = list(range(2000, 2100))


class Hybrid:
    """Full attention + Mamba align, bs 16, prefix-match unit 8 (fine-grained hits)."""

    def __init__(self) -> None:
        self.c = Core([FullAttentionSpec(block_size=16), MAMBA], block_size=16, num_blocks=40,
                      max_model_len=512, prefix_match_unit=8)
        self.m = self.c.manager

    def copies(self) -> list[list[int]]:
        copies, retained = self.m.take_kv_cache_block_copies()
        self.m.free_retained_blocks(retained)
        return [[c.src_block_id, c.dst_block_id] for c in copies]

    def producer(self) -> Request:
        """r0 computes 64, 8 (to its prompt's last hash boundary) and 3 tokens."""
        m = self.m
        m.new_step_starts()
        r0 = self.c.request("r0", PROMPT)
        hits, n, boundary, diverged = m.get_computed_blocks_for_connector(r0)
        assert (as_ids(hits), n, boundary, diverged) == ([[], []], 0, 0, False)
        assert as_ids(m.allocate_slots(r0, 64, n, hits)) == [[1, 2, 3, 4], [0, 0, 0, 5]]
        assert m.take_boundary_state_offloads() == {"r0": [(1, 5, 64)]}
        assert self.copies() == []
        assert m.take_new_block_ids() == [1, 2, 3, 4]  # Mamba layouts zero new KV blocks
        executed(r0, 64)
        m.new_step_starts()
        assert as_ids(m.allocate_slots(r0, 8)) == [[6], [7]]
        # The state at 72 is a partial tail of block 7 (offered once it is copied out).
        assert m.take_boundary_state_offloads() == {}
        assert m.take_new_block_ids() == [6]
        executed(r0, 72)
        m.new_step_starts()
        assert as_ids(m.allocate_slots(r0, 3)) == [[], []]
        # r0 overwrites its own partial tail: the key moves to a copy, which is offered.
        assert m.take_boundary_state_offloads() == {"r0": [(1, 8, 72)]}
        copies, retained = m.take_kv_cache_block_copies()
        assert [[x.src_block_id, x.dst_block_id] for x in copies] == [[7, 8]]
        assert ids(retained) == [7, 8] and self.c.num_free() == 32
        # Once the copy ran: the source keeps r0's reference, the copy only its key.
        m.free_retained_blocks(retained)
        assert self.c.num_free() == 33
        assert [b.ref_cnt for b in retained] == [1, 0]
        assert m.take_new_block_ids() == []
        assert table(m, "r0") == [[1, 2, 3, 4, 6], [0, 0, 0, 0, 7]]
        executed(r0, 75, [7])
        return r0


def test_boundary_state_offloads_and_a_producer_that_ran_past_its_tail() -> None:
    h = Hybrid()
    r0 = h.producer()
    m = h.m
    assert m.estimate_cached_tokens(r0) == 0  # its Mamba table holds no keyed state now
    r0.status = RequestStatus.FINISHED_STOPPED
    assert m.finalize_partial_tail_offloads(r0) == []  # block 7 was overwritten
    m.remove_skipped_blocks("r0", 75, 75)
    assert m.get_block_ids_for_computed_tokens("r0", 75) == ([1, 2, 3, 4, 6],
                                                             [0, 0, 0, 0, 7])
    m.free(r0)
    assert h.c.num_free() == 39


def test_a_producer_finishing_at_its_partial_boundary_hands_off_its_block() -> None:
    h = Hybrid()
    m = h.m
    m.free(h.producer())
    m.new_step_starts()
    r1 = h.c.request("r1", OTHER[:43])
    hits, n, _, _ = m.get_computed_blocks_for_connector(r1)
    assert as_ids(m.allocate_slots(r1, 40, n, hits)) == [[7, 9, 10], [0, 0, 11]]
    assert m.take_boundary_state_offloads() == {} and h.copies() == []
    assert m.take_new_block_ids() == [7, 9, 10]
    r1.status, r1.num_computed_tokens = RequestStatus.FINISHED_ABORTED, 40
    assert m.finalize_partial_tail_offloads(r1) == [(1, 11, 40)]
    assert m.finalize_partial_tail_offloads(r1) == []  # handed off once
    # Attention groups are clipped to the computed tokens, Mamba is handed over whole.
    assert m.get_block_ids_for_computed_tokens("r1", 40) == ([7, 9, 10], [0, 0, 11])
    assert m.get_block_ids_for_computed_tokens("r1", 20) == ([7, 9], [0, 0, 11])


def _hybrid_after_two_producers() -> Hybrid:
    h = Hybrid()
    m = h.m
    m.free(h.producer())
    m.new_step_starts()
    r1 = h.c.request("r1", OTHER[:43])
    hits, n, _, _ = m.get_computed_blocks_for_connector(r1)
    m.allocate_slots(r1, 40, n, hits)
    h.copies()
    m.take_boundary_state_offloads()
    m.take_new_block_ids()
    m.free(r1)
    m.new_step_starts()
    return h


def test_divergent_hybrid_hit_reports_full_attention_and_flags_the_lag() -> None:
    h = _hybrid_after_two_producers()
    r2 = h.c.request("r2", [*PROMPT[:56], *OTHER[50:70]])
    hits, n, boundary, diverged = h.m.get_computed_blocks_for_connector(r2)
    # Full attention hits 48 tokens; Mamba has no state at or below 48.
    assert (as_ids(hits), n, boundary, diverged) == ([[1, 2, 3], []], 48, 0, True)
    # The reconciled lookup (what the scheduler falls back to) agrees on nothing.
    blocks, n, boundary = h.m.get_computed_blocks(r2)
    assert (as_ids(blocks), n, boundary) == ([[], []], 0, 48)


def test_truncated_sub_block_hit_then_a_longer_external_hit() -> None:
    h = _hybrid_after_two_producers()
    m = h.m
    r3 = h.c.request("r3", [*PROMPT[:72], *OTHER[70:90]])
    hits, n, boundary, diverged = m.get_computed_blocks_for_connector(r3)
    assert (as_ids(hits), n, boundary, diverged) == ([[1, 2, 3, 4, 6], [0, 0, 0, 0, 8]], 72,
                                                     0, False)
    cut = m.truncate_computed_blocks(hits, 64)
    assert as_ids(cut) == [[1, 2, 3, 4], [0, 0, 0, 0]]
    assert as_ids(hits) == [[1, 2, 3, 4, 6], [0, 0, 0, 0, 8]]  # the lookup is untouched
    out = m.allocate_slots(r3, 0, 64, cut, num_external_computed_tokens=16,
                           delay_cache_blocks=True, skip_zeroing_group_ids=(0, 1))
    assert out is m.empty_kv_cache_blocks
    assert table(m, "r3") == [[1, 2, 3, 4, 12], [0, 0, 0, 0, 13]]
    assert m.take_new_block_ids() == []  # the load writes them: not zeroed
    m.record_blocks_for_zeroing("r3", 64)  # ... unless it failed
    assert m.take_new_block_ids() == [12]
    assert h.copies() == [] and h.c.num_free() == 33
    with pytest.raises(ValueError, match="block-aligned"):
        m.record_blocks_for_zeroing("r3", 8)
    with pytest.raises(ValueError, match="multiple of group block size"):
        m.truncate_computed_blocks(hits, 72)
    # Full attention must cover the endpoint; Mamba keeps what it has.
    with pytest.raises(ValueError, match="cannot truncate"):
        m.truncate_computed_blocks(cut, 80)


def test_a_deeper_mamba_hit_falls_back_to_the_reconciled_lookup() -> None:
    h = _hybrid_after_two_producers()
    m = h.m
    r3 = h.c.request("r3", [*PROMPT[:72], *OTHER[70:90]])
    hits, n, _, _ = m.get_computed_blocks_for_connector(r3)
    m.allocate_slots(r3, 0, 64, m.truncate_computed_blocks(hits, 64),
                     num_external_computed_tokens=16, delay_cache_blocks=True)
    m.evict_blocks({4})  # full attention loses 48..63, Mamba keeps its state at 64
    r4 = h.c.request("r4", [*PROMPT[:64], *OTHER[90:100]])
    hits, n, boundary, diverged = m.get_computed_blocks_for_connector(r4)
    assert (as_ids(hits), n, boundary, diverged) == ([[], []], 0, 48, False)
    assert h.c.free_ids()[-7:] == [5, 8, 6, 10, 9, 7, 11]


def test_non_hybrid_layouts_use_the_plain_lookup() -> None:
    c = Core(block_size=4, num_blocks=12)
    a = c.request("a", list(range(10)))
    c.manager.allocate_slots(a, 10)
    b = c.request("b", list(range(12)))
    blocks, n, boundary, diverged = c.manager.get_computed_blocks_for_connector(b)
    assert (as_ids(blocks), n, boundary, diverged) == ([[1, 2]], 8, 0, False)
    skip = c.request("s", list(range(12)), skip_reading_prefix_cache=True)
    assert c.manager.get_computed_blocks_for_connector(skip)[1:] == (0, 0, False)


# ----------------------------------------------------------------------------- reservations


def test_remaining_and_reserved_blocks() -> None:
    c = Core([full(4), swa(8, 4)], block_size=4, num_blocks=40, max_in_flight_tokens=16)
    m = c.manager
    # The window's admission cap: cdiv(min(8 - 1 + 16, max_model_len), 4) + 1 = 7 blocks.
    assert m.coordinator.single_type_managers[1].max_admission_blocks_per_request == 7
    a = c.request("a", list(range(30)))
    assert as_ids(m.allocate_slots(a, 12)) == [[1, 2, 3], [4, 5, 6]]  # a prefill chunk
    executed(a, 12)
    before = (table(m, "a"), c.num_free(), dict(m.coordinator.single_type_managers[1]
                                                  .num_cached_block))
    # Full attention: cdiv(30, 4) - 3 = 5 more; the window: min(8, 7) - 3 = 4 more.
    assert m.get_num_remaining_blocks(a) == 5 + 4
    # Drafts grow the sequence by 1 + 2 + 1 tokens: cdiv(34, 4) - 3 = 6, still capped at 7.
    assert m.get_num_remaining_blocks(a, num_spec_tokens=2, num_lookahead_tokens=1) == 6 + 4
    assert m.get_num_spec_decode_step_blocks(0) == 0
    assert m.get_num_spec_decode_step_blocks(2, 1) == 1 + 1  # cdiv(4, 4) per attention group
    b = c.request("b", list(range(100, 120)))  # unknown to the manager: the whole sequence
    assert m.get_num_remaining_blocks(b) == 5 + 5
    # What the Scheduler passes as reserved_blocks when admitting an async load.
    assert m.get_num_reserved_blocks([a, b]) == 9 + 10
    assert m.get_num_reserved_blocks([a], num_spec_tokens=2, num_lookahead_tokens=1) == 10 + 2
    assert m.get_num_reserved_blocks([]) == 0
    after = (table(m, "a"), c.num_free(), dict(m.coordinator.single_type_managers[1]
                                                 .num_cached_block))
    assert after == before  # read-only queries


def test_mamba_groups_count_no_spec_decode_step_blocks() -> None:
    h = Hybrid()
    assert h.m.get_num_spec_decode_step_blocks(3) == 1  # full attention only
    assert h.m.enable_partial_hash_hits is True
    assert Core(block_size=4).manager.enable_partial_hash_hits is False
