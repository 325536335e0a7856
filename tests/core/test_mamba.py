"""Mamba manager: exact behaviour on small hand-built scenarios.

Block ids, hits and copies below were recorded by running the same call sequences on
vLLM 0.33.0's own ``KVCacheManager`` (conformance ``reference/``); the boundary-offload and
finalize hand-offs, which a trace cannot observe, follow the same code paths.
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvplugin.core.hashing import BlockHasher, HashContext
from kvplugin.core.manager import KVCacheBlocks, KVCacheManager
from kvplugin.core.request import Request, RequestStatus
from kvplugin.core.single_type.mamba import MambaManager
from kvplugin.core.single_type.mamba_checkpoints import (
    checkpoint_exportable,
    prefill_checkpoint_position,
    retention_mask,
)
from kvplugin.core.specs import (
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    resolve_kv_cache_block_sizes,
)


class Sim:
    """A manager plus the scheduler-side bookkeeping (like ``kvplugin.replay``)."""

    def __init__(self, specs: Sequence[KVCacheSpec], *, num_blocks: int = 30,
                 block_size: int = 16, prefix_match_unit: int | None = None,
                 enable_caching: bool = True, max_model_len: int = 1024,
                 retention_interval: int | None = None, **manager_kwargs: object) -> None:
        config = KVCacheConfig(num_blocks, [KVCacheGroupSpec([f"layer{i}"], s)
                                            for i, s in enumerate(specs)],
                               prefix_cache_retention_interval=retention_interval)
        sbs, hbs = resolve_kv_cache_block_sizes(config, block_size,
                                                prefix_match_unit=prefix_match_unit,
                                                enable_caching=enable_caching)
        self.manager = KVCacheManager(config, max_model_len=max_model_len,
                                      scheduler_block_size=sbs, hash_block_size=hbs,
                                      enable_caching=enable_caching,
                                      **manager_kwargs)  # type: ignore[arg-type]
        self.hasher = BlockHasher(HashContext.create(), hbs) if enable_caching else None
        self.lookups: dict[str, tuple[KVCacheBlocks, int]] = {}

    def add(self, rid: str, prompt: list[int]) -> Request:
        return Request(rid, prompt, block_hasher=self.hasher)

    def lookup(self, req: Request) -> tuple[list[list[int]], int]:
        blocks, hit, boundary = self.manager.get_computed_blocks(req)
        req.shared_prefix_boundary = boundary
        self.lookups[req.request_id] = (blocks, hit)
        return ids(blocks), hit

    def admit(self, req: Request, num_new: int) -> list[list[int]] | None:
        """Allocate with the pending lookup; on success the request runs."""
        blocks, hit = self.lookups.pop(req.request_id)
        out = self.manager.allocate_slots(req, num_new, hit, blocks)
        if out is None:
            return None
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = hit
        return ids(out)

    def step(self, req: Request, num_new: int, lookahead: int = 0) -> list[list[int]] | None:
        out = self.manager.allocate_slots(req, num_new, num_lookahead_tokens=lookahead)
        return None if out is None else ids(out)

    def executed(self, req: Request, num_computed: int, tokens: Sequence[int] = ()) -> None:
        req.num_computed_tokens = num_computed
        if tokens:
            req.append_output_token_ids(list(tokens))

    def table(self, rid: str) -> list[list[int]]:
        return [list(g) for g in self.manager.get_block_ids(rid)]

    def copies(self) -> list[list[int]]:
        """The scheduler's end-of-pass drain: run the copies, release their retention."""
        copies, retained = self.manager.take_kv_cache_block_copies()
        self.manager.block_pool.free_blocks(retained)
        return [[c.src_block_id, c.dst_block_id] for c in copies]

    def mamba(self) -> MambaManager:
        m = self.manager.coordinator.single_type_managers[-1]
        assert isinstance(m, MambaManager)
        return m


def ids(blocks: KVCacheBlocks) -> list[list[int]]:
    return [[b.block_id for b in g] for g in blocks.blocks]


def align(**kw: int) -> MambaSpec:
    return MambaSpec(block_size=16, mamba_cache_mode="align", **kw)  # type: ignore[arg-type]


FULL = FullAttentionSpec(block_size=16)


# ---------------------------------------------------------------------------- align mode
def test_e30_same_step_guard_defers_hit_to_next_pass() -> None:
    sim = Sim([FULL, align()])
    prompt = list(range(1, 51))
    sim.manager.new_step_starts()
    a = sim.add("a", prompt)
    assert sim.lookup(a) == ([[], []], 0)
    # State slots 0 and 1 are null gaps: only the chunk-end state is kept.
    assert sim.admit(a, 48) == [[1, 2, 3], [0, 0, 4]]
    b = sim.add("b", [*prompt[:48], 900, 901, 902])
    assert sim.lookup(b) == ([[1, 2, 3], [0, 0, 4]], 48)
    # Block 4's state is written by this very pass: the predictor asks for more than the
    # pool so admission fails, with nothing adopted.
    assert sim.admit(b, 3) is None
    assert sim.manager.block_pool.get_num_free_blocks() == 25
    sim.executed(a, 48)

    sim.manager.new_step_starts()
    assert sim.step(a, 2) == [[5], [6]]
    assert sim.lookup(b) == ([[1, 2, 3], [0, 0, 4]], 48)
    assert sim.admit(b, 3) == [[7], [8]]
    assert sim.table("a") == [[1, 2, 3, 5], [0, 0, 4, 6]]
    assert sim.table("b") == [[1, 2, 3, 7], [0, 0, 4, 8]]


def test_running_state_slot_retires_previous_states() -> None:
    sim = Sim([FULL, align()])
    a = sim.add("a", list(range(1, 51)))
    sim.lookup(a)
    assert sim.admit(a, 16) == [[1], [2]]
    sim.executed(a, 16)
    assert sim.step(a, 32) == [[3, 4], [0, 5]]
    sim.executed(a, 48)
    # Slot 0 (the state the chunk resumed from) is released once slot 2 is committed.
    assert sim.step(a, 2) == [[6], [7]]
    assert sim.table("a") == [[1, 3, 4, 6], [0, 0, 5, 7]]
    offloads = sim.manager.take_boundary_state_offloads()
    # Every committed full-slot state is offered with its exact block and boundary.
    assert offloads == {"a": [(1, 2, 16), (1, 5, 48)]}


def test_fine_grained_partial_hit_copy_on_write() -> None:
    sim = Sim([FULL, align()], prefix_match_unit=4)
    prompt = list(range(100, 122))  # 22 tokens: last reusable boundary at 20
    sim.manager.new_step_starts()
    a = sim.add("a", prompt)
    sim.lookup(a)
    assert sim.admit(a, 16) == [[1], [2]]
    assert sim.copies() == []
    sim.executed(a, 16)

    sim.manager.new_step_starts()
    assert sim.step(a, 4) == [[3], [4]]
    assert sim.copies() == []
    sim.executed(a, 20)
    # Block 4 now also answers the 20-token boundary (a partial entry inside slot 1).
    assert sim.mamba()._producer_partial_tail_reqs["a"][1] == 20

    sim.manager.new_step_starts()
    # The producer is about to overwrite block 4: the entry moves to a private copy (5)
    # while the table stays on block 4, and the copy is offered for offload.
    assert sim.step(a, 2) == [[], []]
    assert sim.manager.take_boundary_state_offloads() == {"a": [(1, 2, 16), (1, 5, 20)]}
    assert sim.copies() == [[4, 5]]
    assert sim.manager.block_pool.get_num_free_blocks() == 26
    sim.executed(a, 22, [7])

    sim.manager.new_step_starts()
    b = sim.add("b", [*prompt[:20], 500, 501, 502, 503, 504])
    assert sim.lookup(b) == ([[1, 3], [0, 5]], 20)
    # A new request privatises both shared tails: copy first, then the other new blocks.
    assert sim.admit(b, 5) == [[6], [7]]
    assert sim.copies() == [[3, 6], [5, 7]]
    assert sim.table("a") == [[1, 3], [0, 4]]
    assert sim.table("b") == [[1, 6], [0, 7]]
    assert sim.manager.block_pool.get_num_free_blocks() == 24


def test_moved_partial_entry_is_deferred_within_the_pass() -> None:
    sim = Sim([FULL, align()], prefix_match_unit=4)
    prompt = list(range(100, 122))
    a = sim.add("a", prompt)
    sim.lookup(a)
    sim.admit(a, 16)
    sim.executed(a, 16)
    sim.manager.new_step_starts()
    sim.step(a, 4)
    sim.executed(a, 20)
    sim.manager.new_step_starts()
    sim.step(a, 2)  # moves the 20-token entry onto the copy target, filled this pass
    b = sim.add("b", [*prompt[:20], 1, 2, 3])
    assert sim.lookup(b)[1] == 20
    assert sim.admit(b, 3) is None
    sim.copies()
    sim.manager.new_step_starts()
    sim.lookup(b)
    assert sim.admit(b, 3) is not None


def test_producer_finishing_at_its_boundary_hands_off_the_table_block() -> None:
    sim = Sim([FULL, align()], prefix_match_unit=4)
    a = sim.add("a", list(range(100, 122)))
    sim.lookup(a)
    sim.admit(a, 16)
    sim.executed(a, 16)
    sim.step(a, 4)
    sim.executed(a, 20)
    a.status = RequestStatus.FINISHED_ABORTED
    # Nothing overwrote block 4 yet, so the table block itself holds the boundary state.
    assert sim.manager.finalize_partial_tail_offloads(a) == [(1, 4, 20)]
    assert sim.manager.finalize_partial_tail_offloads(a) == []  # handed off once


def test_free_drops_undrained_boundary_offloads() -> None:
    sim = Sim([FULL, align()])
    a = sim.add("a", list(range(1, 40)))
    sim.lookup(a)
    sim.admit(a, 32)
    sim.manager.free(a)
    assert sim.manager.take_boundary_state_offloads() == {}


def test_speculative_blocks_are_relocated_behind_the_new_state_slot() -> None:
    sim = Sim([FULL, align(num_speculative_blocks=1)])
    a = sim.add("a", list(range(200, 250)))
    sim.lookup(a)
    assert sim.admit(a, 16) == [[1], [2, 3]]
    sim.executed(a, 16)
    # Slot 2 becomes the state slot: the scratch block 3 moves there (slot 1 turns null)
    # and one fresh block becomes the new scratch slot.
    assert sim.step(a, 32) == [[4, 5], [3, 6]]
    assert sim.table("a") == [[1, 4, 5], [2, 0, 3, 6]]
    sim.executed(a, 48)
    assert sim.step(a, 2) == [[7], [8]]
    assert sim.table("a") == [[1, 4, 5, 7], [0, 0, 3, 6, 8]]
    sim.executed(a, 50, [1])
    # Draft tokens get no state slot; the table already covers the step.
    assert sim.step(a, 3, lookahead=2) == [[], []]
    assert sim.table("a") == [[1, 4, 5, 7], [0, 0, 0, 6, 8]]
    free = [b.block_id for b in sim.manager.block_pool.free_block_queue]
    assert free == [*range(9, 30), 2, 3]


def test_prefill_checkpoint_slot_is_reserved_and_keyed() -> None:
    spec = align(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=4)
    sim = Sim([FULL, spec])
    prompt = list(range(300, 330))  # 30 tokens: reusable boundary at 16
    a = sim.add("a", prompt)
    sim.lookup(a)
    # One chunk runs past the boundary; slot 0 is reserved for the mid-chunk state.
    assert sim.admit(a, 30) == [[1, 2], [3, 4]]
    assert sim.mamba()._checkpoints["a"] == (16, 0)
    sim.executed(a, 30, [9])
    sim.manager.new_step_starts()
    b = sim.add("b", [*prompt[:16], 1, 2, 3, 4, 5])
    assert sim.lookup(b) == ([[1], [3]], 16)


def test_transient_checkpoint_loses_its_identity() -> None:
    spec = align(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=4)
    sim = Sim([FULL, spec], prefix_match_unit=4)
    prompt = list(range(300, 364))  # 64 tokens
    a = sim.add("a", prompt)
    sim.lookup(a)
    assert sim.admit(a, 40) is not None  # chunk 0..40: checkpoint at 36 (not reusable)
    position, slot = sim.mamba()._checkpoints["a"]
    assert (position, slot) == (36, 1)
    block = sim.manager.coordinator.single_type_managers[1].req_to_blocks["a"][slot]
    assert block.block_hash is None  # slot 1's full-block key was evicted again
    # So a sibling sharing 40 tokens finds no Mamba state at 32 or 36: no hit at all.
    b = sim.add("b", [*prompt[:40], 1, 2, 3])
    assert sim.lookup(b) == ([[], []], 0)


def test_mode_none_keeps_speculative_state_slots() -> None:
    spec = MambaSpec(block_size=1024, mamba_cache_mode="none", num_speculative_blocks=2)
    sim = Sim([FULL, spec], enable_caching=False)
    a = sim.add("a", list(range(200, 240)))
    assert sim.manager.allocate_slots(a, 40) is not None
    assert sim.table("a") == [[1, 2, 3], [4, 5, 6]]
    a.status = RequestStatus.RUNNING
    sim.executed(a, 40, [1])
    assert sim.step(a, 1, lookahead=2) == [[], []]
    sim.manager.free(a)
    assert sim.manager.block_pool.get_num_free_blocks() == 29


# ---------------------------------------------------------------------------- pure rules
def test_prefill_checkpoint_position() -> None:
    assert prefill_checkpoint_position(50, 16, False) == 48
    assert prefill_checkpoint_position(48, 16, False) == 32  # the last token is recomputed
    assert prefill_checkpoint_position(50, 16, True) == 32  # EAGLE gives one unit back
    assert prefill_checkpoint_position(50, 16, False, num_hash_lookahead_tokens=3) == 32
    assert prefill_checkpoint_position(10, 16, True) == 0


def test_checkpoint_exportable() -> None:
    assert checkpoint_exportable(0, 30, 16, 16, 16, 4)
    assert not checkpoint_exportable(0, 30, 16, 16, 16, None)  # backend cannot export
    assert not checkpoint_exportable(0, 30, 16, 16, 16, 5)  # not a whole backend step
    assert checkpoint_exportable(16, 40, 20, 4, 16, 4)
    assert not checkpoint_exportable(16, 32, 20, 4, 16, 4)  # slot would be the initial one
    assert not checkpoint_exportable(4, 40, 16, 16, 16, 4)  # start off a hash boundary


def test_retention_mask() -> None:
    assert retention_mask(0, 8, 16, 16, None, [100]) is None
    assert retention_mask(0, 8, 16, 16, 16, []) is None  # one slot per segment: dense
    assert retention_mask(0, 8, 16, 16, 64, []) == [False, False, False, True] * 2
    assert retention_mask(2, 8, 16, 16, 64, [49]) == [True, True, False, False, False, True]
    assert retention_mask(0, 4, 16, 16, 0, [63, 16]) == [True, False, True, False]


def test_sparse_retention_registers_only_reachable_states() -> None:
    sim = Sim([FULL, align()], retention_interval=0)
    a = sim.add("a", list(range(1, 80)))  # replay boundary 78 -> slot 3 (64 tokens)
    sim.lookup(a)
    sim.admit(a, 64)
    table = sim.manager.coordinator.single_type_managers[1].req_to_blocks["a"]
    assert [b.block_hash is not None for b in table] == [False, False, False, True]


# ---------------------------------------------------------------------------- layouts
def _build(spec: MambaSpec, enable_caching: bool) -> None:
    Sim([FULL, spec], enable_caching=enable_caching, block_size=16)


def test_mode_none_with_prefix_caching_is_rejected() -> None:
    spec = MambaSpec(block_size=16, mamba_cache_mode="none")
    with pytest.raises(ValueError, match="cannot prefix-cache"):
        _build(spec, True)


def test_bad_checkpoint_alignment_is_rejected() -> None:
    spec = align(num_prefill_checkpoint_blocks=1, prefill_checkpoint_alignment=0)
    with pytest.raises(ValueError, match="prefill_checkpoint_alignment"):
        _build(spec, True)


def test_checkpoint_blocks_need_align_mode() -> None:
    spec = MambaSpec(block_size=16, mamba_cache_mode="none", num_prefill_checkpoint_blocks=1)
    with pytest.raises(ValueError, match="checkpoint blocks need"):
        _build(spec, False)


def test_unknown_mode_is_rejected() -> None:
    with pytest.raises(ValueError, match="mamba_cache_mode"):
        MambaSpec(block_size=16, mamba_cache_mode="all")


def test_manager_rejects_other_specs() -> None:
    from kvplugin.core.block_pool import BlockPool

    with pytest.raises(TypeError, match="MambaSpec"):
        MambaManager(FULL, block_pool=BlockPool(4, True, 16), enable_caching=True,
                     kv_cache_group_id=0, scheduler_block_size=16)
