"""Issue 13 unit tests: context parallelism, R-SWA, circular buffers, MLA kinds, mixed
precision zeroing, ``get_zeroing_block_ids_in_range`` and the residency metrics collector.
(The seed traces in the conformance suite check the same against vLLM 0.33.0 itself.)"""

from __future__ import annotations

import random

import pytest
from core_testlib import Core, full, ids, swa
from test_cp_rswa_state_machines import CpCore

from kvplugin.core.blocks import KVCacheBlock
from kvplugin.core.events import BlockStored
from kvplugin.core.metrics import KVCacheMetricsCollector
from kvplugin.core.specs import (
    CircularBufferSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    MLAAttentionSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowMLASpec,
    resolve_kv_cache_block_sizes,
)

PROMPT = list(range(100, 140))  # 40 tokens


def _config(*specs: FullAttentionSpec | MambaSpec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=32, kv_cache_groups=[
        KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])


# ----------------------------------------------------------------------------- DCP / PCP


def test_dcp_block_sizes_resolve_like_vllm() -> None:
    assert resolve_kv_cache_block_sizes(_config(full(8)), 8, dcp_world_size=4) == (32, 32)
    # A replicated single group keeps the default block size.
    assert resolve_kv_cache_block_sizes(
        _config(FullAttentionSpec(block_size=8, dcp_sharded=False)), 8,
        dcp_world_size=4) == (8, 8)
    # Hybrid: sharded attention scales, Mamba (replicated) does not.
    assert resolve_kv_cache_block_sizes(
        _config(full(16), MambaSpec(block_size=16, mamba_cache_mode="align")), 16,
        dcp_world_size=2) == (32, 16)


def test_dcp_scales_hits_and_events() -> None:
    c = CpCore([full(8)], block_size=8, num_blocks=20, dcp=4, pcp=2)
    assert c.manager.coordinator.single_type_managers[0].block_size == 32
    a = c.request("a", PROMPT)
    c.run(a)
    c.manager.cache_blocks(a, a.num_tokens)
    stored = [e for e in c.events() if isinstance(e, BlockStored)]
    assert [(e.block_size, len(e.block_hashes)) for e in stored] == [(32, 1)]
    b = c.request("b", [*PROMPT, 1])
    _, hit = c.lookup(b)
    assert hit == 32  # one 32-token DCP block, not four 8-token ones


@pytest.mark.parametrize(("specs", "dcp", "pcp", "message"), [
    ([full(16), swa(64, 16)], 2, 1, "DCP with hybrid KV cache layouts"),
    ([full(16), CircularBufferSpec(block_size=16)], 2, 1, "DCP with hybrid"),
    ([full(16), MambaSpec(block_size=16, mamba_cache_mode="align")], 1, 2, "PCP only supports"),
])
def test_refused_cp_layouts(specs: list[FullAttentionSpec], dcp: int, pcp: int,
                            message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CpCore(specs, block_size=16, num_blocks=32, dcp=dcp, pcp=pcp)


def test_lone_sharded_sliding_window_asserts_at_lookup_like_vllm() -> None:
    c = CpCore([swa(64, 16)], block_size=16, num_blocks=32, dcp=2)
    with pytest.raises(AssertionError, match=r"DCP not support sliding window attn now\."):
        c.lookup(c.request("a", PROMPT))


# ----------------------------------------------------------------------------- kinds


def test_rswa_frees_the_gap_between_prompt_and_window() -> None:
    c = Core([RSWASpec(block_size=4, rswa_window=4)], block_size=4, num_blocks=32)
    a = c.request("a", list(range(10)))  # prompt: blocks 0-2 (block 2 partly prompt)
    c.run(a)
    for t in range(14):  # decode to 24 tokens
        a.append_output_token_ids([500 + t])
        assert c.manager.allocate_slots(a, 1) is not None
        a.num_computed_tokens += 1
    table = c.table(a)
    # Gap = blocks inside [12, max(10, 23 - 4) = 19): block 3 only; prompt blocks kept.
    assert table[:3] != [0, 0, 0] and table[3] == 0 and 0 not in table[4:]
    assert len(table) == 6


def test_circular_buffer_holds_one_uncached_block_per_request() -> None:
    c = Core([full(4), CircularBufferSpec(block_size=4)], block_size=4, num_blocks=32)
    a = c.request("a", PROMPT)
    c.run(a)
    assert len(c.table(a, 1)) == 1 and len(c.table(a, 0)) == 10
    c.manager.cache_blocks(a, a.num_tokens)
    assert {e.group_idx for e in c.events() if isinstance(e, BlockStored)} == {0}
    b = c.request("b", PROMPT)
    blocks, hit = c.lookup(b)
    assert hit == 36 and ids(blocks.blocks[1]) == []
    free = c.num_free()
    c.manager.free(a)
    assert c.num_free() == free + 11


def test_mla_kinds_and_bounded_replay() -> None:
    c = Core([MLAAttentionSpec(block_size=8),
              SlidingWindowMLASpec(block_size=8, sliding_window=16, bounded_replay=True)],
             block_size=8, num_blocks=40)
    assert c.manager.kv_cache_event_metadata == (("mla_attention", None),
                                                 ("sliding_window_mla", 16))
    a = c.request("a", PROMPT)
    c.run(a)
    c.manager.cache_blocks(a, a.num_tokens)
    assert {e.group_idx for e in c.events() if isinstance(e, BlockStored)} == {0}


def test_sink_full_attention_is_refused_as_vllm_cannot_build_it() -> None:
    with pytest.raises(TypeError, match="cannot be built by vLLM"):
        Core([SinkFullAttentionSpec(block_size=16, sink_len=4)])


# ----------------------------------------------------------------------------- zeroing


def test_mixed_precision_turns_zeroing_on_and_ranges_select_blocks() -> None:
    uniform = Core([full(4), swa(8, 4)], block_size=4, num_blocks=40)
    assert not uniform.config.needs_kv_cache_zeroing
    c = Core([full(4), FullAttentionSpec(block_size=4, dtype="bfloat16"),
              CircularBufferSpec(block_size=4, dtype="float16")], block_size=4, num_blocks=40)
    assert c.config.needs_kv_cache_zeroing
    a = c.request("a", list(range(10)))
    c.run(a)
    g0, g1 = c.table(a, 0), c.table(a, 1)
    assert c.manager.take_new_block_ids() == g0 + g1  # the ring is never zeroed
    assert c.manager.take_new_block_ids() == []
    m = c.manager
    assert m.get_zeroing_block_ids_in_range("a", 4, 9) == g0[1:3] + g1[1:3]
    assert m.get_zeroing_block_ids_in_range("a", 0, 0) == []
    assert m.get_zeroing_block_ids_in_range("a", 8, 100) == g0[2:] + g1[2:]
    assert m.get_zeroing_block_ids_in_range("nobody", 0, 8) == []
    with pytest.raises(ValueError, match="start_token <= end_token"):
        m.get_zeroing_block_ids_in_range("a", 8, 4)
    m.record_blocks_for_zeroing("a", 4)
    assert m.take_new_block_ids() == g0[1:] + g1[1:]


# ----------------------------------------------------------------------------- metrics


def test_metrics_collector_lifecycle() -> None:
    c = Core([full(4)], block_size=4, num_blocks=6)
    collector = KVCacheMetricsCollector(1.0)
    c.manager.block_pool.metrics_collector = collector
    a = c.request("a", list(range(8)))
    c.run(a)
    c.manager.cache_blocks(a, 8)
    assert sorted(collector.block_metrics) == sorted(c.table(a))
    c.manager.free(a)
    b = c.request("b", list(range(9)))
    _, hit, _ = c.admit(b)  # touches both cached blocks: one access each
    assert hit == 8
    c.manager.free(b)
    d = c.request("d", list(range(50, 70)))  # 5 blocks: reuses every free block
    c.run(d)
    events = collector.drain_events()
    assert len(events) == 3  # a's two blocks and b's tail block
    assert sorted(len(e.reuse_gaps_seconds) for e in events) == [0, 0, 0]
    assert all(e.lifetime_seconds >= e.idle_seconds >= 0 for e in events)
    assert collector.drain_events() == []
    c.manager.free(d)
    assert c.manager.reset_prefix_cache()
    assert collector.block_metrics == {}


def test_metrics_sampling_follows_the_seeded_generator() -> None:
    rng = random.Random(7)
    expected = [rng.random() < 0.5 for _ in range(20)]
    collector = KVCacheMetricsCollector(0.5, random.Random(7))
    for i in range(20):
        collector.on_block_allocated(KVCacheBlock(i + 1))
    assert sorted(collector.block_metrics) == [i + 1 for i, s in enumerate(expected) if s]
    with pytest.raises(ValueError, match="sample_rate"):
        KVCacheMetricsCollector(0.0)
