"""Retained hits (``retained_hit_group_ids``): a group whose manager has
``retains_longer_hit`` keeps its longer prefix hit through the hybrid lookup, and
``allocate_slots`` trims it to ``cdiv(num_new_computed_tokens + num_external_computed_tokens,
block_size)`` blocks.

No built-in kvplugin manager retains (in vLLM 0.33.0 only HiSparse's host-tier source
manager does), so these tests register a full-attention manager that does.  Every expected
block id below is what vLLM 0.33.0's own ``KVCacheManager`` returns for the same calls with
``FullAttentionManager.retains_longer_hit = True`` (checked with the side venv's
``vllm_reference.py``); the comments say why each value is what it is.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator
from typing import Any, ClassVar

import pytest
from core_testlib import Core, check_invariants, full, ids, snapshot, swa

from kvplugin.core.manager import KVCacheBlocks
from kvplugin.core.request import Request
from kvplugin.core.single_type import _REGISTRY
from kvplugin.core.single_type.full import FullAttentionManager
from kvplugin.core.specs import FullAttentionSpec

BS = 4
PROMPT = list(range(100, 133))  # 33 tokens: 8 full blocks and one partial
SHARED = PROMPT[:32] + [7] * 8  # the same 8 full blocks, then 2 new ones (40 tokens)


class RetainingFullAttentionManager(FullAttentionManager):
    """Full attention that keeps its longer hit (what vLLM's HiSparse source manager does)."""

    retains_longer_hit: ClassVar[bool] = True


@pytest.fixture
def retaining(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Full-attention groups get the retaining manager (through the core's registry)."""
    monkeypatch.setitem(_REGISTRY, FullAttentionSpec,
                        f"{__name__}:{RetainingFullAttentionManager.__name__}")
    yield


def hybrid() -> Core:
    return Core([full(BS), swa(4, BS)], block_size=BS, num_blocks=48)


def evicted_swa_tail(core: Core) -> tuple[Request, KVCacheBlocks, int]:
    """Cache PROMPT (full blocks 1-8, SWA blocks 10-17), then evict the SWA blocks of
    positions 6 and 7: full attention still hits 32 tokens, the window only 24."""
    a = core.request("a", PROMPT)
    out = core.manager.allocate_slots(a, len(PROMPT))
    assert out is not None and [ids(g) for g in out.blocks] == [
        list(range(1, 10)), list(range(10, 19))]
    core.manager.free(a)
    core.manager.evict_blocks({16, 17})
    b = core.request("b", SHARED)
    blocks, hit = core.lookup(b)
    return b, blocks, hit


def refs(core: Core, block_ids: range) -> list[int]:
    return [core.pool.blocks[i].ref_cnt for i in block_ids]


# ----------------------------------------------------------------------------- wiring


def test_no_builtin_manager_retains() -> None:
    for target in _REGISTRY.values():
        module, _, name = target.partition(":")
        try:
            cls = getattr(importlib.import_module(module), name)
        except ModuleNotFoundError:  # a family not built yet retains nothing either
            continue
        assert cls.retains_longer_hit is False, name
    assert hybrid().manager.retained_hit_group_ids == ()
    assert Core([full(BS)], block_size=BS).manager.retained_hit_group_ids == ()


def test_retained_hit_group_ids_name_the_retaining_groups(retaining: None) -> None:
    assert hybrid().manager.retained_hit_group_ids == (0,)
    swa_first = Core([swa(4, BS), full(BS), full(BS)], block_size=BS, num_blocks=48)
    assert swa_first.manager.retained_hit_group_ids == (1, 2)


# ----------------------------------------------------------------------------- lookup


def test_hybrid_lookup_keeps_the_longer_hit_only_for_retaining_groups(retaining: None
                                                                       ) -> None:
    core = hybrid()
    _, blocks, hit = evicted_swa_tail(core)
    # The reconciled hit is the window's 24 tokens; the retaining group keeps all 8 blocks.
    assert hit == 24
    assert [ids(g) for g in blocks.blocks] == [[1, 2, 3, 4, 5, 6, 7, 8], [0, 0, 0, 0, 0, 15]]


def test_hybrid_lookup_truncates_non_retaining_full_attention() -> None:
    _, blocks, hit = evicted_swa_tail(hybrid())
    assert hit == 24
    assert [ids(g) for g in blocks.blocks] == [[1, 2, 3, 4, 5, 6], [0, 0, 0, 0, 0, 15]]


# ----------------------------------------------------------------------------- allocate_slots


@pytest.mark.parametrize(
    ("ext", "new", "delay", "table", "new_ids", "num_free"),
    [
        # Local hit only: cdiv(24, 4) = 6 blocks adopted, blocks 7 and 8 cut off.
        (0, 16, False, [[1, 2, 3, 4, 5, 6, 18, 9, 19, 20], [0, 0, 0, 0, 0, 15, 21, 22, 23, 24]],
         [[18, 9, 19, 20], [21, 22, 23, 24]], 32),
        # 5 external tokens: cdiv(29, 4) = 8, so the hit blocks under the external tokens
        # (7 and 8) are adopted instead of allocated; the window group gets fresh ones.
        (5, 11, False, [[1, 2, 3, 4, 5, 6, 7, 8, 19, 20], [0, 0, 0, 0, 0, 0, 18, 9, 21, 22]],
         [[19, 20], [21, 22]], 33),
        (8, 8, True, [[1, 2, 3, 4, 5, 6, 7, 8, 9, 19], [0, 0, 0, 0, 0, 0, 0, 18, 20, 21]],
         [[9, 19], [20, 21]], 34),
        # External tokens past the retained hit: the retaining group adopts all 8 hit
        # blocks and allocates only beyond them.
        (12, 4, True, [[1, 2, 3, 4, 5, 6, 7, 8, 18, 19], [0, 0, 0, 0, 0, 0, 0, 0, 9, 20]],
         [[19], [20]], 35),
    ],
    ids=["local", "ext5", "ext8", "ext12"],
)
def test_allocate_slots_trims_to_local_plus_external(
        retaining: None, ext: int, new: int, delay: bool, table: list[list[int]],
        new_ids: list[list[int]], num_free: int) -> None:
    core = hybrid()
    b, blocks, hit = evicted_swa_tail(core)
    out = core.manager.allocate_slots(b, new, hit, blocks, num_external_computed_tokens=ext,
                                      delay_cache_blocks=delay)
    assert out is not None
    assert [ids(g) for g in out.blocks] == new_ids
    assert [list(t) for t in core.manager.get_block_ids("b")] == table
    assert core.num_free() == num_free
    kept = -(-(hit + ext) // BS)
    # Adopted hits hold one ref; the blocks cut off were never touched: unreferenced,
    # still cached, still in the free queue.
    assert refs(core, range(1, 1 + kept)) == [1] * kept
    for cut in range(1 + kept, 9):
        assert core.pool.blocks[cut].ref_cnt == 0
        assert core.pool.blocks[cut].block_hash is not None
        assert cut in core.free_ids()
    check_invariants(core.manager, [b])


def test_a_failed_allocation_adopts_nothing(retaining: None) -> None:
    core = hybrid()
    b, blocks, hit = evicted_swa_tail(core)
    before = snapshot(core.manager, ["b"])
    assert core.manager.allocate_slots(b, 16, hit, blocks, reserved_blocks=40) is None
    assert snapshot(core.manager, ["b"]) == before
    assert refs(core, range(1, 9)) == [0] * 8


def test_the_empty_singleton_is_adopted_as_hits(retaining: None,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Trimming builds a new tuple, so even the shared empty ``KVCacheBlocks`` then goes
    through ``allocate_new_computed_blocks`` (vLLM's identity test no longer matches); the
    allocation itself is the same."""
    core = hybrid()
    b, _, _ = evicted_swa_tail(core)
    coord = core.manager.coordinator
    calls: list[Any] = []
    adopt = coord.allocate_new_computed_blocks
    monkeypatch.setattr(coord, "allocate_new_computed_blocks",
                        lambda *a, **kw: (calls.append(a[1]), adopt(*a, **kw))[1])
    out = core.manager.allocate_slots(b, 40, 0, core.manager.empty_kv_cache_blocks)
    assert out is not None and [ids(g) for g in out.blocks] == [
        [18, 9, 19, 20, 21, 22, 23, 24, 25, 26], list(range(27, 37))]
    assert len(calls) == 1 and calls[0] is not core.manager.empty_kv_cache_blocks.blocks
    assert [list(g) for g in calls[0]] == [[], []]


def test_unitary_trims_to_what_the_caller_reuses(retaining: None) -> None:
    """One group: the lookup is untouched, but a caller that reuses fewer tokens than the
    hit gets only those blocks (vLLM without retention would adopt all 8)."""
    core = Core([full(BS)], block_size=BS, num_blocks=24)
    a = core.request("a", PROMPT)
    assert core.manager.allocate_slots(a, len(PROMPT)) is not None
    core.manager.free(a)
    b = core.request("b", SHARED)
    blocks, hit = core.lookup(b)
    assert (hit, ids(blocks.blocks[0])) == (32, [1, 2, 3, 4, 5, 6, 7, 8])
    out = core.manager.allocate_slots(b, 24, 16, blocks)
    assert out is not None and ids(out.blocks[0]) == [9, 10, 11, 12, 13, 14]
    assert core.table(b) == [1, 2, 3, 4, 9, 10, 11, 12, 13, 14]
    assert refs(core, range(1, 9)) == [1, 1, 1, 1, 0, 0, 0, 0]
    check_invariants(core.manager, [b])


def test_hits_trimmed_to_nothing_are_legal_for_a_running_request(retaining: None) -> None:
    """vLLM asserts a running request adopts no hits *after* trimming: hits cut to nothing
    pass, hits that survive the cut are misuse."""
    core = Core([full(BS)], block_size=BS, num_blocks=24)
    a = core.request("a", PROMPT)
    assert core.manager.allocate_slots(a, len(PROMPT)) is not None
    a.num_computed_tokens = len(PROMPT)
    a.append_output_token_ids([5])
    blocks, _ = core.lookup(a)
    out = core.manager.allocate_slots(a, 1, 0, blocks)
    assert out is not None and ids(out.blocks[0]) == []
    with pytest.raises(ValueError, match="already holds blocks"):
        core.manager.allocate_slots(a, 1, 4, blocks)
    assert core.table(a) == list(range(1, 10))
