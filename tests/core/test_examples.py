"""The spec's worked examples (vllm-kv-core.md sec. 1.6, 2, 8: E1-E29), pinned to exact block
ids, hits, ``None``s, free-queue (eviction) order, events and stats.

Unless a test says otherwise: one full-attention group, block size 16, 11 blocks (null
block 0, usable 1..10, initial queue [1..10]), caching and events on.  ``blk(x)`` is 16
copies of token ``x``.  E30 (Mamba) belongs to the Mamba tests.
"""

from __future__ import annotations

import pytest
from core_testlib import (
    Core,
    LoRAInfo,
    MMFeature,
    RequestStatus,
    check_invariants,
    chunked,
    full,
    ids,
    snapshot,
    swa,
)
from core_testlib import new_ids as new

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import (
    FreeBlockQueue,
    KVCacheBlock,
    external_block_hash,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvplugin.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvplugin.core.hashing import (
    BlockHashListWithBlockSize,
    generate_block_hash_extra_keys,
    to_event_extra_keys,
)
from kvplugin.core.request import Request


def blk(x: int, n: int = 16) -> list[int]:
    return [x] * n


P48 = blk(0) + blk(1) + blk(2)


def ext(h: bytes) -> int:
    return external_block_hash(h)


def refs(c: Core, *block_ids: int) -> list[int]:
    return [c.pool.blocks[i].ref_cnt for i in block_ids]


def hashed(c: Core, *block_ids: int) -> list[bool]:
    return [c.pool.blocks[i].block_hash is not None for i in block_ids]


def removed(events: list[object]) -> list[tuple[int, int | None]]:
    return [(e.block_hashes[0], e.group_idx) for e in events if isinstance(e, BlockRemoved)]


def stored(events: list[object]) -> list[BlockStored]:
    return [e for e in events if isinstance(e, BlockStored)]


# ----------------------------------------------------------------------------- sec. 2


def test_free_queue_operations_keep_order() -> None:
    blocks = [KVCacheBlock(i) for i in range(6)]
    q = FreeBlockQueue(blocks)
    assert ids(q.get_all_free_blocks()) == [0, 1, 2, 3, 4, 5]
    assert q.popleft().block_id == 0
    assert ids(q.popleft_n(2)) == [1, 2]
    assert q.popleft_n(0) == []
    q.remove(blocks[4])  # O(1) removal from the middle
    assert ids(q.get_all_free_blocks()) == [3, 5]
    q.prepend_n([blocks[2], blocks[1]])  # the first given block becomes the head
    q.append_n([blocks[0], blocks[4]])
    assert ids(q.get_all_free_blocks()) == [2, 1, 3, 5, 0, 4]
    assert q.num_free_blocks == 6
    with pytest.raises(RuntimeError):
        q.remove(KVCacheBlock(9))
    q.popleft_n(6)
    with pytest.raises(ValueError, match="No free blocks"):
        q.popleft()


def test_pool_construction_null_block_and_usage() -> None:
    pool = BlockPool(5, enable_caching=True, hash_block_size=16)
    assert pool.null_block is pool.blocks[0] and pool.null_block.is_null
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [1, 2, 3, 4]
    assert pool.get_usage() == 0.0
    got = pool.get_new_blocks(3)
    assert ids(got) == [1, 2, 3] and [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.get_usage() == 0.75
    with pytest.raises(ValueError, match="Cannot get 2 free blocks"):
        pool.get_new_blocks(2)
    assert BlockPool(1, True, 16).get_usage() == 0.0


def test_free_blocks_prepends_uncached_and_appends_cached_in_given_order() -> None:
    """H4: uncached blocks reaching 0 form the new head, cached ones the new tail."""
    pool = BlockPool(8, enable_caching=True, hash_block_size=16)
    b = pool.get_new_blocks(5)  # ids 1..5, queue [6, 7]
    b[1].set_block_hash(make_block_hash_with_group_id(b"x" * 32, 0), 16)  # id 2 cached
    b[3].set_block_hash(make_block_hash_with_group_id(b"y" * 32, 0), 16)  # id 4 cached
    pool.touch([b[4]])  # id 5 now has ref 2
    pool.free_blocks([b[4], b[3], b[2], b[1], b[0]])
    # 5 stays in use; uncached 3, 1 prepended in that order; cached 4, 2 appended.
    assert ids(pool.free_block_queue.get_all_free_blocks()) == [3, 1, 6, 7, 4, 2]
    assert b[4].ref_cnt == 1
    # With caching off every freed block goes to the head.
    pool2 = BlockPool(5, enable_caching=False, hash_block_size=16)
    got = pool2.get_new_blocks(3)
    pool2.free_blocks(reversed(got))
    assert ids(pool2.free_block_queue.get_all_free_blocks()) == [3, 2, 1, 4]


def test_touch_pulls_evictable_block_and_refree_refreshes_recency() -> None:
    c = Core()
    a = c.request("a", blk(1))
    b = c.request("b", blk(2))
    assert c.run(a) == [1] and c.run(b) == [2]
    c.manager.free(a)
    c.manager.free(b)
    assert c.free_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 1, 2]
    a2 = c.request("a2", [*blk(1), 5])
    hits, n, out = c.admit(a2)
    assert hits == [[1]] and n == 16 and new(out) == [[3]]
    c.manager.free(a2)
    # Block 1 was freed again after 2: it is now the most recently released.
    assert c.free_ids() == [3, 4, 5, 6, 7, 8, 9, 10, 2, 1]


# ----------------------------------------------------------------------------- hashes


def test_hash_view_at_coarser_block_size() -> None:
    """Sec. 1.7: fine hashes A B C D at hbs 16 -> group hashes B, D at bs 32."""
    fine = [b"A", b"B", b"C", b"D", b"E"]
    view = BlockHashListWithBlockSize(fine, 16, 32)
    assert len(view) == 2 and list(view) == [b"B", b"D"] and view[1] == b"D"
    assert view[0:2] == [b"B", b"D"] and view[-1] == b"D"
    with pytest.raises(IndexError):
        view[2]


def test_block_hash_key_encoding() -> None:
    key = make_block_hash_with_group_id(b"\x01" * 32, 258)
    assert key[-4:] == b"\x00\x00\x01\x02"
    assert get_group_id(key) == 258 and get_block_hash(key) == b"\x01" * 32
    assert external_block_hash(bytes(24) + bytes.fromhex("0102030405060708")) == 0x0102030405060708


def test_hash_chaining_each_block_fingerprints_its_prefix() -> None:
    c = Core()
    tokens = list(range(48))
    r = c.request("r", tokens)
    fn, none = c.ctx.hash_fn, c.ctx.none_hash
    h0 = fn((none, tuple(tokens[0:16]), None))
    h1 = fn((h0, tuple(tokens[16:32]), None))
    h2 = fn((h1, tuple(tokens[32:48]), None))
    assert r.block_hashes == [h0, h1, h2]
    # E12: changing token 20 (block 1) changes hashes 1.. and keeps hash 0.
    alt = list(tokens)
    alt[20] = 999
    r2 = c.request("r2", alt)
    assert r2.block_hashes[0] == h0
    assert r2.block_hashes[1] != h1 and r2.block_hashes[2] != h2


def test_cache_salt_enters_block_zero_only() -> None:
    c = Core()
    tokens = list(range(48))
    r = c.request("r", tokens, cache_salt="s1")
    fn, none = c.ctx.hash_fn, c.ctx.none_hash
    h0 = fn((none, tuple(tokens[0:16]), (("cache_salt", "s1"),)))
    h1 = fn((h0, tuple(tokens[16:32]), None))
    h2 = fn((h1, tuple(tokens[32:48]), None))
    assert r.block_hashes == [h0, h1, h2]
    assert generate_block_hash_extra_keys(r, 0, 16, 0)[0] == (("cache_salt", "s1"),)
    assert generate_block_hash_extra_keys(r, 16, 32, 0)[0] is None


def test_lora_enters_every_block() -> None:
    c = Core()
    tokens = list(range(48))
    lora = LoRAInfo("L", 3, "/loras/L")
    r = c.request("r", tokens, lora_request=lora, cache_salt="s")
    fn = c.ctx.hash_fn
    parent = c.ctx.none_hash
    expected = []
    for i in range(3):
        keys: tuple[object, ...] = (("lora", "L", "/loras/L"),)
        if i == 0:
            keys += (("cache_salt", "s"),)
        parent = fn((parent, tuple(tokens[16 * i:16 * i + 16]), keys))
        expected.append(parent)
    assert r.block_hashes == expected


def test_multimodal_extra_keys_worked_example() -> None:
    """Sec. 1.6: items A at 11 (len 10), B at 30 (len 18), bs 16."""
    feats = [MMFeature("B", 30, 18), MMFeature("A", 11, 10)]  # sorted by offset on entry
    req = Request("m", list(range(64)), mm_features=feats)
    k0, idx = generate_block_hash_extra_keys(req, 0, 16, 0)
    assert k0 == (("mm", "A", 11),) and idx == 0
    k1, idx = generate_block_hash_extra_keys(req, 16, 32, idx)
    assert k1 == (("mm", "A", -5), ("mm", "B", 14)) and idx == 1
    k2, idx = generate_block_hash_extra_keys(req, 32, 48, idx)
    assert k2 == (("mm", "B", -2),) and idx == 2
    k3, idx = generate_block_hash_extra_keys(req, 48, 64, idx)
    assert k3 is None and idx == 2
    # Events publish the untagged shapes.
    assert to_event_extra_keys([k0, k1, k2, k3]) == [
        (("A", 11),), (("A", -5), ("B", 14)), (("B", -2),), None]
    # The hasher chains exactly these keys.
    c = Core()
    r = c.request("r", list(range(64)), mm_features=feats)
    fn, parent = c.ctx.hash_fn, c.ctx.none_hash
    for i, keys in enumerate([k0, k1, k2, k3]):
        parent = fn((parent, tuple(range(16 * i, 16 * i + 16)), keys))
        assert r.block_hashes[i] == parent
    # LoRA first, then mm, then the salt.
    lora = LoRAInfo("L", 1, "/p")
    req2 = Request("m2", list(range(64)), mm_features=feats, lora_request=lora, cache_salt="s")
    assert generate_block_hash_extra_keys(req2, 0, 16, 0)[0] == (
        ("lora", "L", "/p"), ("mm", "A", 11), ("cache_salt", "s"))


# ----------------------------------------------------------------------------- E1-E5


def test_e1_aligned_prompt_recomputes_its_last_block() -> None:
    c = Core()
    a = c.request("a", P48)
    blocks, n = c.lookup(a)
    assert n == 0 and blocks is c.manager.empty_kv_cache_blocks
    assert new(c.manager.allocate_slots(a, 48)) == [[1, 2, 3]]
    (ev,) = c.events()
    assert isinstance(ev, BlockStored)
    assert ev.block_hashes == [ext(h) for h in a.block_hashes]
    assert ev.parent_block_hash is None and ev.token_ids == P48 and ev.block_size == 16
    assert ev.group_idx == 0 and ev.medium == "GPU" and ev.lora_id is None
    assert ev.extra_keys == [None, None, None]
    assert ev.kv_cache_spec_kind == "full_attention" and ev.kv_cache_spec_sliding_window is None
    a.status, a.num_computed_tokens = RequestStatus.RUNNING, 48

    b = c.request("b", P48)
    blocks, n = c.lookup(b)  # capped at T - 1 = 47: two blocks
    assert n == 32 and [ids(g) for g in blocks.blocks] == [[1, 2]]
    assert refs(c, 1, 2, 3) == [1, 1, 1]  # lookups are read-only
    assert c.manager.coordinator.get_num_blocks_to_allocate(
        "b", 48, blocks.blocks, 0, 32, 32, 48) == 1
    assert new(c.manager.allocate_slots(b, 16, 32, blocks)) == [[4]]
    assert refs(c, 1, 2, 3, 4) == [2, 2, 1, 1]
    # No de-duplication: H2 now maps to blocks 3 and 4; lookups return the first.
    assert c.blocks_under(a.block_hashes[2]) == [3, 4]
    assert c.pool.get_cached_block(a.block_hashes[2], [0])[0].block_id == 3
    (ev,) = c.events()
    assert ev.block_hashes == [ext(a.block_hashes[2])]
    assert ev.parent_block_hash == ext(a.block_hashes[1]) and len(ev.token_ids) == 16
    check_invariants(c.manager, [a, b])


def test_e2_partial_last_block_is_cached_once_it_fills() -> None:
    c = Core()
    prompt = P48 + [3] * 7  # 55 tokens
    a = c.request("a", prompt)
    assert c.run(a) == [1, 2, 3, 4]
    assert hashed(c, 1, 2, 3, 4) == [True, True, True, False]
    b = c.request("b", prompt)
    hits, n, out = c.admit(b)
    assert hits == [[1, 2, 3]] and n == 48 and new(out) == [[5]]
    c.events()
    for k in range(9):  # decode a from T = 56 to T = 64
        a.append_output_token_ids(100 + k)
        assert len(a.block_hashes) == a.num_tokens // 16
        out = c.manager.allocate_slots(a, 1)
        a.num_computed_tokens += 1
        assert out is c.manager.empty_kv_cache_blocks
        assert hashed(c, 4) == [a.num_tokens == 64]
    (ev,) = c.events()
    assert ev.block_hashes == [ext(a.block_hashes[3])]
    assert ev.parent_block_hash == ext(a.block_hashes[2])
    check_invariants(c.manager, [a, b])


@pytest.mark.parametrize(("prompt", "hit"), [([*blk(5), 6], 16), (blk(5), 0)])
def test_e2_short_prompts(prompt: list[int], hit: int) -> None:
    c = Core()
    x = c.request("x", [*blk(5), 7])
    assert c.run(x) == [1, 2]
    y = c.request("y", prompt)
    blocks, n = c.lookup(y)
    assert n == hit and [ids(g) for g in blocks.blocks] == [[1] if hit else []]


def test_e3_free_queue_order_lifo_uncached_lru_cached() -> None:
    c = Core()
    a = c.request("a", P48 + [3] * 7)
    assert c.run(a) == [1, 2, 3, 4]
    b = c.request("b", P48 + [3] * 5)
    hits, n, out = c.admit(b)
    assert (hits, n, new(out)) == ([[1, 2, 3]], 48, [[5]])
    assert refs(c, 1, 2, 3) == [2, 2, 2]
    assert c.free_ids() == [6, 7, 8, 9, 10]
    c.manager.free(a)
    assert c.free_ids() == [4, 6, 7, 8, 9, 10]
    c.manager.free(b)
    assert c.free_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    assert c.num_free() == 10

    cc = c.request("c", P48 + [3] * 6)
    blocks, n = c.lookup(cc)
    # 1 new block + 3 evictable hits (touching them consumes free capacity).
    assert c.manager.coordinator.get_num_blocks_to_allocate(
        "c", 54, blocks.blocks, 0, 48, 48, 54) == 4
    out = c.manager.allocate_slots(cc, 6, n, blocks)
    assert new(out) == [[5]] and c.num_free() == 6
    assert c.free_ids() == [4, 6, 7, 8, 9, 10]
    c.manager.free(cc)
    assert c.free_ids() == [5, 4, 6, 7, 8, 9, 10, 3, 2, 1]
    c.events()

    d = c.request("d", list(range(1000, 1160)))  # 160 unrelated tokens: the whole pool
    hits, n, out = c.admit(d)
    assert n == 0 and new(out) == [[5, 4, 6, 7, 8, 9, 10, 3, 2, 1]]
    ev = c.events()
    h = a.block_hashes
    assert removed(ev) == [(ext(h[2]), 0), (ext(h[1]), 0), (ext(h[0]), 0)]
    assert isinstance(ev[-1], BlockStored) and len(ev) == 4
    check_invariants(c.manager, [d])


@pytest.mark.parametrize(("num_blocks", "new_block"), [(11, 3), (3, 2)])
def test_e4_hit_refreshes_recency_and_is_never_evicted(num_blocks: int, new_block: int) -> None:
    c = Core(num_blocks=num_blocks)
    a = c.request("a", blk(1))
    b = c.request("b", blk(2))
    assert c.run(a) == [1] and c.run(b) == [2]
    c.manager.free(a)
    c.manager.free(b)
    assert c.free_ids() == [*range(3, num_blocks), 1, 2]
    cc = c.request("c", blk(1) + blk(2))
    hits, n, out = c.admit(cc)
    assert hits == [[1]] and n == 16 and new(out) == [[new_block]]
    assert c.table(cc) == [1, new_block]
    # With two usable blocks the other cached block (B's) is evicted, never the hit.
    assert hashed(c, 1) == [True]
    if num_blocks == 3:
        assert removed(c.events()) == [(ext(b.block_hashes[0]), 0)]


def test_e5_capacity_counts_evictable_hits_and_failure_changes_nothing() -> None:
    c = Core()
    a = c.request("a", P48)
    assert c.run(a) == [1, 2, 3]
    b = c.request("b", P48 + P48)
    hits, n, out = c.admit(b)
    assert (hits, n, new(out)) == ([[1, 2, 3]], 48, [[4, 5, 6]])
    assert hashed(c, 4, 5, 6) == [True, True, True]
    c.manager.free(b)
    assert c.free_ids() == [7, 8, 9, 10, 6, 5, 4]
    x = c.request("x", blk(7) + blk(8))
    assert c.run(x) == [7, 8]
    assert c.free_ids() == [9, 10, 6, 5, 4]

    d = c.request("d", P48 * 3)
    blocks, n = c.lookup(d)
    assert n == 96 and [ids(g) for g in blocks.blocks] == [[1, 2, 3, 4, 5, 6]]
    # (9 - 6) new + 3 evictable (4, 5, 6) = 6 > 5 free.
    assert c.manager.coordinator.get_num_blocks_to_allocate(
        "d", 144, blocks.blocks, 0, 96, 96, 144) == 6
    before = snapshot(c.manager, ["a", "x", "d"])
    assert c.manager.allocate_slots(d, 48, 96, blocks) is None
    assert snapshot(c.manager, ["a", "x", "d"]) == before
    assert refs(c, 1, 2, 3, 4, 5, 6) == [1, 1, 1, 0, 0, 0]
    assert c.free_ids() == [9, 10, 6, 5, 4]
    check_invariants(c.manager, [a, x, d])


# ----------------------------------------------------------------------------- E6-E11


def test_e6_watermark() -> None:
    c = Core(num_blocks=1000, watermark=0.01, max_model_len=1 << 15)
    assert c.manager.watermark_blocks == 10
    filler = c.request("filler", list(range(899 * 16)))
    assert len(c.run(filler)) == 899
    assert c.num_free() == 100
    base = 100_000

    def req(rid: str, nblocks: int, status: RequestStatus) -> Request:
        nonlocal base
        base += 10_000
        r = c.request(rid, list(range(base, base + 16 * nblocks)))
        r.status = status
        return r

    m = c.manager
    # 95 + 10 > 100 for waiting / preempted requests while others run ...
    assert m.allocate_slots(req("w", 95, RequestStatus.WAITING), 95 * 16) is None
    assert m.allocate_slots(req("p", 95, RequestStatus.PREEMPTED), 95 * 16) is None
    # ... exactly at the edge: 90 + 10 == 100 fits, 91 + 10 does not.
    assert m.allocate_slots(req("w91", 91, RequestStatus.WAITING), 91 * 16) is None
    w90 = req("w90", 90, RequestStatus.WAITING)
    assert m.allocate_slots(w90, 90 * 16) is not None
    m.free(w90)
    # ... an idle engine admits without the watermark, a running request never pays it.
    w = req("w2", 95, RequestStatus.WAITING)
    assert m.allocate_slots(w, 95 * 16, has_scheduled_reqs=False) is not None
    m.free(w)
    r = req("r", 95, RequestStatus.RUNNING)
    assert m.allocate_slots(r, 95 * 16) is not None
    assert c.num_free() == 5


def test_e7_full_sequence_gate_uses_the_swa_admission_cap() -> None:
    kw = {"max_in_flight_tokens": 128, "max_model_len": 1024}
    c = Core([full(16), swa(64, 16)], num_blocks=51, **kw)
    r = c.request("r", list(range(512)))
    # full: cdiv(512, 16) = 32; SWA: min(32, cdiv(min(63 + 128, 1024), 16) + 1 = 13).
    assert c.manager.coordinator.get_num_blocks_to_allocate(
        "r", 512, ((), ()), 0, 0, 0, 512, apply_admission_cap=True) == 45
    out = c.manager.allocate_slots(r, 16, full_sequence_must_fit=True)
    assert new(out) == [[1], [2]]
    # 64 full-attention blocks alone exceed the 50 usable ones.
    big = c.request("big", list(range(5000, 6024)))
    assert c.manager.allocate_slots(big, 16, full_sequence_must_fit=True) is None
    assert new(c.manager.allocate_slots(big, 16)) == [[3], [4]]  # no gate: first chunk fits
    # With 44 usable blocks the 512-token prompt (45) is rejected.
    c2 = Core([full(16), swa(64, 16)], num_blocks=45, **kw)
    r2 = c2.request("r", list(range(512)))
    assert c2.manager.allocate_slots(r2, 16, full_sequence_must_fit=True) is None
    assert c2.num_free() == 44


def test_e8_reserved_blocks() -> None:
    c = Core(num_blocks=51)
    assert c.num_free() == 50
    r19 = c.request("r19", list(range(19 * 16)))
    assert c.manager.allocate_slots(r19, 19 * 16, reserved_blocks=32) is None
    r18 = c.request("r18", list(range(1000, 1000 + 18 * 16)))
    out = c.manager.allocate_slots(r18, 18 * 16, reserved_blocks=32)
    assert new(out) == [list(range(1, 19))]


@pytest.mark.parametrize(("num_new", "lookahead", "n_blocks"),
                         [(3, 2, 2), (3, 4, 2), (3, 6, 3), (8, 4, 3)])
def test_e9_lookahead_slots(num_new: int, lookahead: int, n_blocks: int) -> None:
    c = Core(block_size=4)
    r = c.request("r", list(range(num_new)))
    out = c.manager.allocate_slots(r, num_new, num_lookahead_tokens=lookahead)
    assert new(out) == [list(range(1, n_blocks + 1))]
    # Lookahead slots are never cached: only the prompt's full blocks are.
    assert hashed(c, *range(1, n_blocks + 1)) == [i < num_new // 4 for i in range(n_blocks)]


def test_e10_drafts_are_allocated_not_cached_and_rejection_keeps_the_table() -> None:
    c = Core()
    r = c.request("r", list(range(31)))
    assert c.run(r) == [1, 2]
    assert hashed(c, 1, 2) == [True, False]
    r.append_output_token_ids(500)  # T = 32, C = 31
    out = c.manager.allocate_slots(r, 4)  # one real token + 3 drafts: 35 slots
    assert new(out) == [[3]]
    assert hashed(c, 1, 2, 3) == [True, True, False]  # cached up to T = 32 only
    # All drafts rejected: C = 32, one more token sampled.
    r.num_computed_tokens = 32
    r.append_output_token_ids(501)
    assert c.manager.coordinator.get_num_blocks_to_allocate("r", 33, ((),), 0, 32, 32, 33) == 0
    assert c.manager.allocate_slots(r, 1) is c.manager.empty_kv_cache_blocks
    assert c.table(r) == [1, 2, 3]


def test_e11_max_model_len_clamps_slots() -> None:
    c = Core(max_model_len=64)
    r = c.request("r", list(range(60)))
    out = c.manager.allocate_slots(r, 60, num_lookahead_tokens=7)
    assert new(out) == [[1, 2, 3, 4]]  # min(67, 64) = 64 slots, not 5 blocks
    r.num_computed_tokens = 60
    r.append_output_token_ids(7)
    assert c.manager.allocate_slots(r, 4, num_lookahead_tokens=3) is \
        c.manager.empty_kv_cache_blocks
    assert c.table(r) == [1, 2, 3, 4]


# ----------------------------------------------------------------------------- E12


def test_e12_salts_and_lora_partition_the_cache() -> None:
    c = Core(num_blocks=40)
    tokens = list(range(48))
    s1 = c.request("s1", tokens, cache_salt="s1")
    c.run(s1)
    ev = stored(c.events())[0]
    assert ev.extra_keys == [("s1",), None, None]
    s2 = c.request("s2", tokens, cache_salt="s2")
    assert all(x != y for x, y in zip(s1.block_hashes, s2.block_hashes, strict=True))
    assert c.lookup(s2)[1] == 0
    assert c.lookup(c.request("plain", tokens))[1] == 0
    assert c.lookup(c.request("s1b", tokens, cache_salt="s1"))[1] == 32

    lora = LoRAInfo("L", 7, "/loras/L")
    lr = c.request("lr", [*tokens, 1], lora_request=lora)
    assert c.lookup(lr)[1] == 0  # base / salted blocks never serve a LoRA request
    c.run(lr)
    ev = stored(c.events())[0]
    assert ev.lora_id == 7 and ev.lora_name == "L"
    assert ev.extra_keys == [("L",), ("L",), ("L",)]
    assert c.lookup(c.request("base", [*tokens, 1]))[1] == 0
    assert c.lookup(c.request("lr2", [*tokens, 2], lora_request=lora))[1] == 48
    moved = LoRAInfo("L", 7, "/loras/L-v2")  # same name, new adapter: no hit
    assert c.lookup(c.request("lr3", [*tokens, 2], lora_request=moved))[1] == 0
    both = c.request("both", tokens, lora_request=lora, cache_salt="s")
    c.run(both)
    assert stored(c.events())[0].extra_keys == [("L", "s"), ("L",), ("L",)]


# ----------------------------------------------------------------------------- E13


def test_e13_chunked_local_hit_of_null_placeholders() -> None:
    c = Core([chunked(8, 4)], block_size=4)
    a = c.request("a", list(range(17)))
    blocks, n = c.lookup(a)  # cap 16: everything before token 16's chunk
    assert n == 16 and [ids(g) for g in blocks.blocks] == [[0, 0, 0, 0]]
    assert blocks is not c.manager.empty_kv_cache_blocks
    assert c.manager.coordinator.get_num_blocks_to_allocate(
        "a", 17, blocks.blocks, 0, 16, 16, 17) == 1
    out = c.manager.allocate_slots(a, 1, 16, blocks)
    assert new(out) == [[1]] and c.table(a) == [0, 0, 0, 0, 1]
    check_invariants(c.manager, [a])


def test_e13_chunked_local_cap_inside_a_chunk_and_window_release() -> None:
    c = Core([chunked(8, 4)], block_size=4)
    x = c.request("x", list(range(17)))
    blocks, n = c.lookup(x, 15)
    assert n == 8 and [ids(g) for g in blocks.blocks] == [[0, 0]]
    y = c.request("y", list(range(20)))
    # Computed from scratch (a lookup would hit 16 tokens of null placeholders).
    assert new(c.manager.allocate_slots(y, 20)) == [[1, 2, 3, 4, 5]]
    y.num_computed_tokens = 20
    assert hashed(c, 1, 2, 3, 4, 5) == [True] * 5
    blocks, n = c.lookup(x, 15)
    assert n == 12 and [ids(g) for g in blocks.blocks] == [[0, 0, 3]]
    blocks, n = c.lookup(x)
    assert n == 16 and [ids(g) for g in blocks.blocks] == [[0, 0, 0, 0]]
    # y decodes token 20: the previous chunks (positions 0-3) leave the window, freed
    # backwards (position 3 first); cached, so they join the tail.
    y.append_output_token_ids(99)
    out = c.manager.allocate_slots(y, 1)
    assert new(out) == [[6]]
    assert c.table(y) == [0, 0, 0, 0, 5, 6]
    assert c.free_ids() == [7, 8, 9, 10, 4, 3, 2, 1]
    check_invariants(c.manager, [y])


# ----------------------------------------------------------------------------- E14-E16


P96 = list(range(96))


@pytest.mark.parametrize(("evict", "hit", "table"), [
    (set(), 96, [0, 0, 0, 0, 5, 6]),
    ({6}, 80, [0, 0, 0, 4, 5]),
    ({1}, 96, [0, 0, 0, 0, 5, 6]),
    ({2, 5}, 64, [0, 0, 3, 4]),
])
def test_e14_sliding_window_hits(evict: set[int], hit: int, table: list[int]) -> None:
    c = Core([swa(32)], num_blocks=16)
    a = c.request("a", P96)
    assert c.run(a) == [1, 2, 3, 4, 5, 6]
    assert len(c.pool.cached_block_hash_to_block) == 6
    c.manager.evict_blocks(evict)
    b = c.request("b", [*P96, 900, 901, 902, 903])
    blocks, n = c.lookup(b)
    assert n == hit and [ids(g) for g in blocks.blocks] == [table]
    out = c.manager.allocate_slots(b, 100 - n, n, blocks)
    assert out is not None
    assert c.table(b)[:len(table)] == table
    check_invariants(c.manager, [a, b])


def test_e14_run_touching_position_zero() -> None:
    c = Core([swa(32)], num_blocks=16)
    c.run(c.request("a", blk(3)))
    blocks, n = c.lookup(c.request("b", [*blk(3), 1, 2, 3, 4]))
    assert n == 16 and [ids(g) for g in blocks.blocks] == [[1]]


@pytest.mark.parametrize("caching", [True, False])
def test_e15_sliding_window_release(caching: bool) -> None:
    c = Core([swa(4, 2)], block_size=2, num_blocks=16, enable_caching=caching)
    r = c.request("r", list(range(22)))
    assert new(c.manager.allocate_slots(r, 22)) == [list(range(1, 12))]
    # (n, table prefix, free queue with caching, free queue without): freed blocks are
    # cached (tail, in the order freed) or not (head, in the order freed: b3 before b2).
    steps = [
        (4, [1, 2, 3], [12, 13, 14, 15], [12, 13, 14, 15]),
        (5, [0, 2, 3], [12, 13, 14, 15, 1], [1, 12, 13, 14, 15]),
        (6, [0, 2, 3], [12, 13, 14, 15, 1], [1, 12, 13, 14, 15]),
        (7, [0, 0, 3], [12, 13, 14, 15, 1, 2], [2, 1, 12, 13, 14, 15]),
        (11, [0, 0, 0, 0, 5], [12, 13, 14, 15, 1, 2, 4, 3], [4, 3, 2, 1, 12, 13, 14, 15]),
    ]
    for n, prefix, cached_queue, uncached_queue in steps:
        c.manager.remove_skipped_blocks("r", n)
        assert c.table(r)[:len(prefix)] == prefix, n
        assert c.free_ids() == (cached_queue if caching else uncached_queue), n
    check_invariants(c.manager, [r])


def test_e16_sparse_retention_keeps_only_the_replay_tail() -> None:
    c = Core([swa(16)], num_blocks=40, retention=0)
    a = c.request("a", list(range(256)))
    assert c.run(a) == list(range(1, 17))
    h = a.block_hashes
    assert list(c.pool.cached_block_hash_to_block.keys()) == [c.key(h[14])]
    (ev,) = c.events()
    assert ev.block_hashes == [ext(h[14])] and ev.parent_block_hash is None
    assert ev.token_ids == list(range(256)) and ev.extra_keys == [None]
    assert ev.kv_cache_spec_kind == "sliding_window" and ev.kv_cache_spec_sliding_window == 16
    blocks, n = c.lookup(c.request("resend", list(range(256))))
    assert n == 240 and [ids(g) for g in blocks.blocks] == [[0] * 14 + [15]]
    assert c.lookup(c.request("p240", list(range(240))))[1] == 0


@pytest.mark.parametrize(("retention", "cached", "hit240"), [
    (None, list(range(16)), 224),
    (64, [3, 7, 11, 14, 15], 192),
])
def test_e16_dense_and_interval_retention(retention: int | None, cached: list[int],
                                          hit240: int) -> None:
    c = Core([swa(16)], num_blocks=40, retention=retention)
    a = c.request("a", list(range(256)))
    c.run(a)
    keys = set(c.pool.cached_block_hash_to_block.keys())
    assert keys == {c.key(a.block_hashes[i]) for i in cached}
    assert c.lookup(c.request("p240", list(range(240))))[1] == hit240


def test_e16_hybrid_sparse_retention() -> None:
    c = Core([full(32), swa(8, 8)], num_blocks=40, retention=0)
    assert (c.sbs, c.hbs) == (32, 8)
    a = c.request("a", list(range(128)))
    out = c.manager.allocate_slots(a, 128)
    assert new(out) == [[1, 2, 3, 4], list(range(5, 21))]
    keys = list(c.pool.cached_block_hash_to_block.keys())
    swa_keys = [k for k in keys if get_group_id(k) == 1]
    assert swa_keys == [c.key(a.block_hashes[11], 1)]
    blocks, n = c.lookup(c.request("resend", list(range(128))))
    assert n == 96
    assert [ids(g) for g in blocks.blocks] == [[1, 2, 3], [0] * 11 + [16]]
    assert c.lookup(c.request("p96", list(range(96))))[1] == 0


# ----------------------------------------------------------------------------- E17-E20


def test_e17_hybrid_lcm_alignment() -> None:
    c = Core([full(32), swa(32, 16)], num_blocks=20)
    assert (c.sbs, c.hbs) == (32, 16)
    a = c.request("a", list(range(160)))
    out = c.manager.allocate_slots(a, 112)  # first chunk; cacheable = 96
    assert new(out) == [[1, 2, 3, 4], [5, 6, 7, 8, 9, 10, 11]]
    assert hashed(c, 1, 2, 3, 4) == [True, True, True, False]
    assert hashed(c, *range(5, 12)) == [True] * 6 + [False]
    b = c.request("b", list(range(113)))
    blocks, n, boundary = c.manager.get_computed_blocks(b)
    assert n == 96 and boundary == 0
    assert [ids(g) for g in blocks.blocks] == [[1, 2, 3], [0, 0, 0, 0, 9, 10]]
    c.manager.evict_blocks({10})  # SWA position 5
    blocks, n, _ = c.manager.get_computed_blocks(b)
    # position 4 would end a run at 80 (not a multiple of 32): skipped; 3, 2 -> 64.
    assert n == 64 and [ids(g) for g in blocks.blocks] == [[1, 2], [0, 0, 7, 8]]


def test_e18_hybrid_fixed_point_three_spec_groups() -> None:
    c = Core([full(16), swa(32), swa(64)], num_blocks=32)
    a = c.request("a", P96)
    out = c.manager.allocate_slots(a, 96)
    assert new(out) == [[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18]]
    c.manager.evict_blocks({10, 17})  # G1 position 3, G2 position 4
    b = c.request("b", [*P96, 1, 2, 3, 4])
    blocks, n, boundary = c.manager.get_computed_blocks(b)
    assert n == 48
    assert [ids(g) for g in blocks.blocks] == [[1, 2, 3], [0, 8, 9], [13, 14, 15]]
    assert boundary == 96  # the longest single-group result (full attention: 96)


@pytest.mark.parametrize(("evict", "hit"), [({3, 4, 7}, 0), ({3, 4}, 0), ({3}, 32)])
def test_e19_groups_that_disagree(evict: set[int], hit: int) -> None:
    c = Core([full(16), swa(32), swa(32)], num_blocks=16)
    a = c.request("a", P48)
    assert new(c.manager.allocate_slots(a, 48)) == [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    c.manager.evict_blocks(evict)
    blocks, n = c.lookup(c.request("b", [*P48, 1, 2, 3, 4, 5]))
    assert n == hit
    expected = [[1, 2], [4, 5], [7, 8]] if hit else [[], [], []]
    assert [ids(g) for g in blocks.blocks] == expected


def test_e20_unitary_eagle_drop() -> None:
    c = Core(use_eagle=True, num_blocks=16)
    a = c.request("a", list(range(80)))
    assert c.run(a) == [1, 2, 3, 4, 5]
    blocks, n = c.lookup(c.request("b", list(range(90))))
    assert n == 64 and [ids(g) for g in blocks.blocks] == [[1, 2, 3, 4]]
    c2 = Core(use_eagle=True)
    c2.run(c2.request("a", P48))
    blocks, n = c2.lookup(c2.request("b", P48))  # no proof margin in the unitary case
    assert n == 16 and [ids(g) for g in blocks.blocks] == [[1]]


@pytest.mark.parametrize(("evict", "hit"), [(set(), 16), ({1}, 0)])
def test_e20_sliding_window_eagle(evict: set[int], hit: int) -> None:
    c = Core([swa(16)], use_eagle=True)
    prompt = list(range(37))
    c.run(c.request("a", prompt))
    c.manager.evict_blocks(evict)
    blocks, n = c.lookup(c.request("b", prompt))
    assert n == hit and [ids(g) for g in blocks.blocks] == [[1] if hit else []]


def test_e20_hybrid_eagle_proof_margin() -> None:
    c = Core([full(16), swa(48)], use_eagle=True, num_blocks=20)
    a = c.request("a", P96)
    assert new(c.manager.allocate_slots(a, 96)) == [[1, 2, 3, 4, 5, 6],
                                                    [7, 8, 9, 10, 11, 12]]
    blocks, n = c.lookup(c.request("b", P96))
    assert n == 80
    assert [ids(g) for g in blocks.blocks] == [[1, 2, 3, 4, 5], [0, 0, 9, 10, 11]]


# ----------------------------------------------------------------------------- E21-E24


def test_e21_lookahead_hashes() -> None:
    c = Core(lookahead=1)
    p = list(range(48))
    a = c.request("a", p)
    fn, none = c.ctx.hash_fn, c.ctx.none_hash
    h0 = fn((none, tuple(p[0:16]), (None, 16)))
    h1 = fn((h0, tuple(p[16:32]), (None, 32)))
    assert a.block_hashes == [h0, h1]  # block 2's hash needs token 48
    assert new(c.manager.allocate_slots(a, 48)) == [[1, 2, 3]]
    assert hashed(c, 1, 2, 3) == [True, True, False]
    (ev,) = c.events()
    assert ev.lookahead_token_ids == [[16], [32]]
    a.num_computed_tokens = 48
    a.append_output_token_ids(500)
    assert a.block_hashes[2] == fn((h1, tuple(p[32:48]), (None, 500)))
    c.manager.allocate_slots(a, 1)
    assert hashed(c, 3) == [True]
    (ev,) = c.events()
    assert ev.block_hashes == [ext(a.block_hashes[2])] and ev.lookahead_token_ids == [[500]]
    b = c.request("b", [*p, 501])
    assert b.block_hashes[:2] == [h0, h1] and b.block_hashes[2] != a.block_hashes[2]
    blocks, n = c.lookup(b)
    assert n == 32 and [ids(g) for g in blocks.blocks] == [[1, 2]]
    # With L = 2 the extra keys carry both following tokens.
    c2 = Core(lookahead=2)
    r = c2.request("r", list(range(18)))
    assert r.block_hashes == [c2.ctx.hash_fn((c2.ctx.none_hash, tuple(range(16)),
                                              (None, 16, 17)))]


def test_e22_skip_reading_still_writes_and_is_not_counted() -> None:
    c = Core()
    a = c.request("a", P48)
    _hits, n, _out = c.admit(a)
    c.manager.record_prefix_cache_stats(a, n)
    s = c.request("s", P48, skip_reading_prefix_cache=True)
    blocks, n, boundary = c.manager.get_computed_blocks(s)
    assert (blocks, n, boundary) == (c.manager.empty_kv_cache_blocks, 0, 0)
    assert new(c.manager.allocate_slots(s, 48)) == [[4, 5, 6]]
    assert c.blocks_under(s.block_hashes[0]) == [1, 4]
    assert c.blocks_under(s.block_hashes[2]) == [3, 6]
    c.manager.record_prefix_cache_stats(s, 0)  # lookup disabled: not recorded
    stats = c.manager.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 48, 0)


def test_e23_preemption_and_recompute() -> None:
    c = Core()
    r = c.request("r", P48 + [3] * 7)
    assert c.run(r) == [1, 2, 3, 4]
    for t in range(5):  # T = 60
        r.append_output_token_ids(100 + t)
        assert c.manager.allocate_slots(r, 1) is c.manager.empty_kv_cache_blocks
        r.num_computed_tokens += 1
    assert c.table(r) == [1, 2, 3, 4] and r.num_tokens == 60
    c.manager.free(r)
    r.status, r.num_computed_tokens, r.num_preemptions = RequestStatus.PREEMPTED, 0, 1
    assert c.free_ids() == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    hits, n, out = c.admit(r)
    assert hits == [[1, 2, 3]] and n == 48 and new(out) == [[4]]
    c.manager.record_prefix_cache_stats(r, n)
    s = c.manager.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (0, 0, 0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 60, 48)
    assert c.manager.make_prefix_cache_stats().preempted_requests == 0  # read-and-reset


def test_e24_reset_prefix_cache() -> None:
    c = Core()
    a = c.request("a", P48)
    assert c.run(a) == [1, 2, 3]
    c.events()
    before = snapshot(c.manager, ["a"])
    assert c.manager.reset_prefix_cache() is False
    assert snapshot(c.manager, ["a"]) == before and c.events() == []
    c.manager.free(a)
    queue = c.free_ids()
    assert queue == [4, 5, 6, 7, 8, 9, 10, 3, 2, 1]
    assert c.manager.reset_prefix_cache() is True
    assert len(c.pool.cached_block_hash_to_block) == 0
    assert all(b.block_hash is None for b in c.pool.blocks)
    assert not c.pool.cached_block_hashes_by_block
    assert c.events() == [AllBlocksCleared()]
    assert c.manager.make_prefix_cache_stats().reset is True
    assert c.free_ids() == queue  # order unchanged
    b = c.request("b", P48)
    _hits, n, out = c.admit(b)
    assert n == 0 and new(out) == [[4, 5, 6]]
    d = c.request("d", list(range(1000, 1112)))  # 7 blocks: takes 7..10, 3, 2, 1
    assert c.run(d) == [7, 8, 9, 10, 3, 2, 1]
    assert removed(c.events()) == []  # reset hashes are gone: nothing left to evict


# ----------------------------------------------------------------------------- E25-E29


def test_e25_async_kv_load() -> None:
    c = Core(num_blocks=16)
    p = list(range(100))
    a = c.request("a", p[:40])
    assert c.run(a) == [1, 2, 3]
    r = c.request("r", p)
    blocks, n = c.lookup(r)
    assert n == 32 and [ids(g) for g in blocks.blocks] == [[1, 2]]
    assert c.manager.coordinator.get_num_blocks_to_allocate(
        "r", 96, blocks.blocks, 0, 96, 32, 96) == 4
    c.events()
    out = c.manager.allocate_slots(r, 0, 32, blocks, num_external_computed_tokens=64,
                                   delay_cache_blocks=True)
    assert out is c.manager.empty_kv_cache_blocks  # external blocks are not "new" slots
    assert c.table(r) == [1, 2, 4, 5, 6, 7]
    assert hashed(c, 4, 5, 6, 7) == [False] * 4 and c.events() == []
    r.status, r.num_computed_tokens = RequestStatus.WAITING_FOR_REMOTE_KVS, 96
    c.manager.cache_blocks(r, 96)  # the load finished
    assert hashed(c, 4, 5, 6, 7) == [True] * 4
    (ev,) = c.events()
    assert ev.block_hashes == [ext(h) for h in r.block_hashes[2:6]]
    assert ev.parent_block_hash == ext(r.block_hashes[1]) and len(ev.token_ids) == 64
    r.status = RequestStatus.RUNNING
    assert new(c.manager.allocate_slots(r, 4)) == [[8]]
    check_invariants(c.manager, [a, r])


def test_e26_external_tokens_under_a_sliding_window() -> None:
    c = Core([swa(32)], num_blocks=16)
    r = c.request("r", list(range(100)))
    assert c.manager.coordinator.get_num_blocks_to_allocate(
        "r", 96, ((),), 0, 96, 0, 96) == 2
    out = c.manager.allocate_slots(r, 0, num_external_computed_tokens=96,
                                   delay_cache_blocks=True)
    assert out is c.manager.empty_kv_cache_blocks
    assert c.table(r) == [0, 0, 0, 0, 1, 2]
    assert c.num_free() == 13


def test_e27_two_phase_adoption_across_groups() -> None:
    c = Core([full(16), swa(128)], num_blocks=15)
    a = c.request("a", list(range(80)))
    assert new(c.manager.allocate_slots(a, 80)) == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    g = c.request("g", list(range(500, 532)))
    assert new(c.manager.allocate_slots(g, 32)) == [[11, 12], [13, 14]]
    c.manager.free(a)
    c.manager.free(g)
    assert c.free_ids() == [5, 4, 3, 2, 1, 10, 9, 8, 7, 6, 12, 11, 14, 13]
    c.events()
    b = c.request("b", [*range(80), *range(900, 940)])
    blocks, n = c.lookup(b)
    assert n == 80 and [ids(x) for x in blocks.blocks] == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 10]]
    out = c.manager.allocate_slots(b, 0, 80, blocks, num_external_computed_tokens=32,
                                   delay_cache_blocks=True)
    assert out is c.manager.empty_kv_cache_blocks
    # Every hit was touched before any external block was taken from the head.
    assert c.manager.get_block_ids("b") == ([1, 2, 3, 4, 5, 12, 11], [6, 7, 8, 9, 10, 14, 13])
    assert c.num_free() == 0
    ev = c.events()
    gh = g.block_hashes
    assert removed(ev) == [(ext(gh[1]), 0), (ext(gh[0]), 0), (ext(gh[1]), 1), (ext(gh[0]), 1)]
    check_invariants(c.manager, [b])


def test_e28_same_key_duplicates() -> None:
    c = Core()
    a = c.request("a", P48)
    c.run(a)
    b = c.request("b", P48)
    c.admit(b)
    h2 = a.block_hashes[2]
    assert c.blocks_under(h2) == [3, 4]
    c.events()
    c.manager.evict_blocks({3})
    assert c.blocks_under(h2) == [4] and hashed(c, 3, 4) == [False, True]
    assert removed(c.events()) == [(ext(h2), 0)]
    longer = c.request("l", [*P48, 7])
    blocks, n = c.lookup(longer)
    assert n == 48 and [ids(g) for g in blocks.blocks] == [[1, 2, 4]]
    c.manager.evict_blocks({4})
    assert c.key(h2) not in set(c.pool.cached_block_hash_to_block.keys())
    assert c.events() == [BlockRemoved([ext(h2)], "GPU", 0)]
    assert c.lookup(longer)[1] == 32
    c.manager.evict_blocks({3, 4, 0})  # nothing left to remove: no events
    assert c.events() == []
    check_invariants(c.manager, [a, b])


@pytest.mark.parametrize(("in_flight", "nulls", "queue_tail"),
                         [(4, 4, [4, 3, 2, 1]), (0, 5, [5, 4, 3, 2, 1])])
def test_e29_in_flight_tokens_keep_their_window(in_flight: int, nulls: int,
                                                queue_tail: list[int]) -> None:
    c = Core([swa(32)], num_blocks=20)
    r = c.request("r", list(range(200)))
    assert new(c.manager.allocate_slots(r, 113)) == [list(range(1, 9))]
    r.status, r.num_computed_tokens, r.num_in_flight_tokens = RequestStatus.RUNNING, 113, in_flight
    out = c.manager.allocate_slots(r, 4)
    assert out is c.manager.empty_kv_cache_blocks
    assert c.table(r) == [0] * nulls + list(range(nulls + 1, 9))
    assert c.free_ids() == [*range(9, 20), *queue_tail]


def test_e28_duplicates_are_served_first_inserted_first() -> None:
    """Three blocks under one key (requests that skip reading the cache recompute it); the
    oldest remaining registration serves lookups, a re-registered block queues last.
    (Same sequence on vLLM 0.33.0: 1, 1, 3, 3, 1.)"""
    c = Core(num_blocks=20)
    p = blk(4)
    for rid, block in (("x", 1), ("y", 2), ("z", 3)):
        r = c.request(rid, p, skip_reading_prefix_cache=True)
        assert new(c.manager.allocate_slots(r, 16)) == [[block]]
    key_hash = c.requests["x"].block_hashes[0]
    assert c.blocks_under(key_hash) == [1, 2, 3]
    probe = c.request("probe", [*p, 1])

    def served() -> list[list[int]]:
        return [ids(g) for g in c.lookup(probe)[0].blocks]

    assert served() == [[1]]
    c.manager.evict_blocks({2})
    assert served() == [[1]] and c.blocks_under(key_hash) == [1, 3]
    c.manager.evict_blocks({1})
    assert served() == [[3]]
    c.manager.free(c.requests["x"])  # block 1 (no longer hashed) goes to the head
    assert c.free_ids()[:3] == [1, 4, 5]
    w = c.request("w", p, skip_reading_prefix_cache=True)
    assert new(c.manager.allocate_slots(w, 16)) == [[1]]
    assert c.blocks_under(key_hash) == [3, 1] and served() == [[3]]
    c.manager.evict_blocks({3})
    assert served() == [[1]]
    check_invariants(c.manager, [c.requests[r] for r in ("y", "z", "w")])
