"""The offload layer's view of the core answers from the core's own state, reads through
a reset (the hash map is replaced then), and changes no allocation."""

from __future__ import annotations

from core_testlib import Core, full, ids, swa

from kvplugin.core.blocks import KVCacheBlock
from kvplugin.core.specs import FullAttentionSpec, MambaSpec
from kvplugin.core.view import OffloadView

PROMPT = list(range(40))  # 2 full blocks of 16 and a partial one


def finished(c: Core, rid: str, tokens: list[int]) -> list[int]:
    """Run a request through one step and free it: its full blocks stay cached."""
    r = c.request(rid, tokens)
    table = c.run(r)
    c.manager.free(r)
    return table


def test_one_view_per_manager_with_the_pool_figures() -> None:
    c = Core(num_blocks=11)
    view = c.manager.offload_view()
    assert view is c.manager.offload_view()
    assert (view.hash_block_size, view.lookup_unit, view.partial_hash_hits) == (16, 16, False)
    assert view.num_usable_blocks == 10 == view.num_free_blocks()
    assert all(view.blocks[i] is c.pool.blocks[i] for i in range(11))
    c.run(c.request("a", PROMPT))
    assert view.num_free_blocks() == c.pool.get_num_free_blocks() == 7


def test_the_lookup_unit_is_the_scheduler_block_without_partial_hits() -> None:
    c = Core([full(16), swa(64, 32)], block_size=16)
    view = c.manager.offload_view()
    assert (c.sbs, view.hash_block_size, view.lookup_unit) == (32, 16, 32)
    mamba = MambaSpec(block_size=16, mamba_cache_mode="align")
    h = Core([FullAttentionSpec(block_size=16), mamba], block_size=16, num_blocks=40,
             max_model_len=512, prefix_match_unit=8)
    hv = h.manager.offload_view()
    assert (h.sbs, hv.hash_block_size, hv.lookup_unit, hv.partial_hash_hits) == (16, 8, 8, True)


def test_caches_follows_eviction_reuse_and_reset() -> None:
    c = Core(num_blocks=6)
    view = c.manager.offload_view()
    table = finished(c, "a", PROMPT)
    req = c.requests["a"]
    k0, k1 = (c.key(req.block_hashes[i]) for i in range(2))
    assert view.caches(table[0], k0) and view.caches(table[1], k1)
    assert not view.caches(table[1], k0) and not view.caches(table[2], k0)
    c.manager.evict_blocks({table[1]})
    assert not view.caches(table[1], k1) and view.caches(table[0], k0)
    assert c.manager.reset_prefix_cache()  # replaces the pool's map: read through the pool
    assert not view.caches(table[0], k0)
    again = finished(c, "b", PROMPT)  # the same tokens cached anew, in the new map
    assert view.caches(again[0], k0) and view.caches(again[1], k1)


def test_next_evicted_walks_the_free_queue_from_its_head() -> None:
    c = Core(num_blocks=11)
    view = c.manager.offload_view()
    a = finished(c, "a", PROMPT)  # cached 2, 1 at the tail; 3 (no hash) at the head
    b = finished(c, "b", list(range(100, 140)))
    order = ids(c.pool.free_block_queue)
    cached = {*a[:2], *b[:2]}
    assert view.next_evicted(cached, 4) == [i for i in order if i in cached]
    assert view.next_evicted(cached, 1) == [a[1]]  # a request frees its tail first
    assert view.next_evicted(cached, 0) == []
    r = c.request("c", PROMPT)
    c.run(r)  # hits a's blocks: in use, no longer evictable
    assert view.next_evicted(cached, 4) == [i for i in order if i in set(b[:2])]


def test_watching_by_id_is_the_pools_hook() -> None:
    c = Core(num_blocks=6)
    view = c.manager.offload_view()
    seen: list[int] = []

    def on_reuse(block: KVCacheBlock) -> None:
        seen.append(block.block_id)

    table = finished(c, "a", PROMPT)
    mine = view.watch_reuse(table[:2], on_reuse)
    other = view.watch_reuse(table[:1], on_reuse)
    other.cancel()
    finished(c, "x", list(range(500, 580)))  # 5 blocks: every free one is handed out
    assert seen == table[1::-1] and not mine.active  # the tail was freed (and reused) first
    assert not c.pool._reuse_watchers


def test_a_view_changes_no_allocation() -> None:
    """Every manager builds its view; asking it questions leaves every id where it was."""
    def trace(ask: bool) -> list[object]:
        c = Core(num_blocks=9)
        view = c.manager.offload_view()
        out: list[object] = []
        for i, first in enumerate((0, 0, 200, 0, 400)):
            if ask:
                view.next_evicted(set(range(9)), 9)
                view.num_free_blocks()
                view.caches(1, b"x")
            out.append(finished(c, f"r{i}", list(range(first, first + 40))))
            out.append(ids(c.pool.free_block_queue))
        return out
    assert trace(True) == trace(False)
    assert isinstance(Core().manager.offload_view(), OffloadView)
