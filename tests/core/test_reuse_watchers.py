"""The pool's reuse hook has several subscribers: each watch fires once per block when the
pool hands that block out again, cancels only itself, and leaves nothing behind; and
watching changes no allocation (same block ids, same order)."""

from __future__ import annotations

from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st

from kvplugin.core.block_pool import BlockPool, ReuseWatch
from kvplugin.core.blocks import KVCacheBlock

Log = list[tuple[str, int]]


def pool(n: int = 8) -> BlockPool:
    return BlockPool(num_gpu_blocks=n, enable_caching=True, hash_block_size=16)


def fresh() -> tuple[BlockPool, Log]:
    return pool(), []


def recorder(log: Log, name: str) -> Callable[[KVCacheBlock], None]:
    return lambda block: log.append((name, block.block_id))


def table(p: BlockPool) -> dict[int, list[ReuseWatch]]:
    return p._reuse_watchers


def test_two_subscribers_on_one_block_both_fire_once_in_order() -> None:
    p, log = fresh()
    a = p.watch_reuse([p.blocks[1], p.blocks[2]], recorder(log, "a"))
    b = p.watch_reuse([p.blocks[1]], recorder(log, "b"))
    assert [b_.block_id for b_ in p.get_new_blocks(1)] == [1]
    assert log == [("a", 1), ("b", 1)]
    assert a.pending == {2} and a.active and not b.active
    p.free_blocks(p.blocks[1:2])  # 1 again free (an unhashed block: the queue's head)
    p.get_new_blocks(2)  # 1 (nobody watches it now), then 2
    assert log == [("a", 1), ("b", 1), ("a", 2)]
    assert not table(p)


def test_cancelling_one_leaves_the_other() -> None:
    p, log = fresh()
    a = p.watch_reuse([p.blocks[1]], recorder(log, "a"))
    p.watch_reuse([p.blocks[1]], recorder(log, "b"))
    a.cancel()
    a.cancel()  # idempotent
    p.get_new_blocks(1)
    assert log == [("b", 1)] and not table(p)


def test_the_same_callback_twice_is_two_subscriptions() -> None:
    p, log = fresh()
    cb = recorder(log, "x")
    first = p.watch_reuse([p.blocks[1]], cb)
    p.watch_reuse([p.blocks[1], p.blocks[1]], cb)  # listed twice in one call: one
    first.cancel()
    p.get_new_blocks(1)
    assert log == [("x", 1)] and not table(p)


def test_unpin_keeps_other_subscribers() -> None:
    """``unpin_blocks`` used to replace a block's watcher: a store's deferred copy watching
    the block would never have been told of its reuse."""
    p, log = fresh()
    held = p.get_new_blocks(2)  # blocks 1, 2
    store = p.watch_reuse(held, recorder(log, "store"))
    unpin = p.unpin_blocks(held, recorder(log, "unpin"))
    assert unpin.pending == {1, 2} and store.pending == {1, 2}
    assert p.get_num_free_blocks() == 7 and [b.block_id for b in p.get_new_blocks(7)][-2:] \
        == [1, 2]  # unpinned blocks are last-resort: the queue's tail
    assert log == [("store", 1), ("unpin", 1), ("store", 2), ("unpin", 2)]
    assert not table(p)


def test_re_unpinning_with_the_same_callback_fires_once() -> None:
    """vLLM's HiSparse unpins a block shared by two owners twice, with one callback, and
    expects one call per reuse (vLLM replaced the block's callback with itself)."""
    p, log = fresh()
    (blk,) = p.get_new_blocks(1)
    p.touch([blk])  # two owners
    owner = _Owner(log)
    first = p.unpin_blocks([blk], owner.on_reuse)  # a new bound method object each time
    second = p.unpin_blocks([blk], owner.on_reuse)
    assert first.pending == {1} and not second.active
    p.get_new_blocks(7)
    assert log == [("owner", 1)] and not table(p)


class _Owner:
    def __init__(self, log: Log) -> None:
        self.log = log

    def on_reuse(self, block: KVCacheBlock) -> None:
        self.log.append(("owner", block.block_id))


def test_reset_fires_every_watch_and_empties_the_table() -> None:
    p, log = fresh()
    p.watch_reuse([p.blocks[3]], recorder(log, "a"))
    p.watch_reuse([p.blocks[3], p.blocks[5]], recorder(log, "b"))
    assert p.reset_prefix_cache()
    assert sorted(log) == [("a", 3), ("b", 3), ("b", 5)] and not table(p)


def test_a_callback_may_cancel_a_later_watch_or_watch_again() -> None:
    p, log = fresh()
    later: list[ReuseWatch] = []

    def first(block: KVCacheBlock) -> None:
        log.append(("first", block.block_id))
        later[0].cancel()
        p.watch_reuse([block], recorder(log, "again"))  # its next reuse, not this one

    p.watch_reuse([p.blocks[1]], first)
    later.append(p.watch_reuse([p.blocks[1]], recorder(log, "cancelled")))
    (blk,) = p.get_new_blocks(1)
    assert log == [("first", 1)]
    assert [w.pending for w in table(p)[1]] == [{1}]
    p.free_blocks([blk])
    p.get_new_blocks(1)
    assert log == [("first", 1), ("again", 1)] and not table(p)


def test_watching_changes_no_allocation() -> None:
    def run(watch: bool) -> list[list[int]]:
        p = pool(12)
        if watch:
            p.watch_reuse(p.blocks[1:], lambda _b: None)
            p.watch_reuse(p.blocks[3:7], lambda _b: None)
        out = [[b.block_id for b in p.get_new_blocks(4)]]
        p.free_blocks(p.blocks[2:4])
        held = p.get_new_blocks(3)
        out.append([b.block_id for b in held])
        p.unpin_blocks(held[:1], lambda _b: None)
        out.append([b.block_id for b in p.free_block_queue])
        return out
    assert run(True) == run(False)


# ------------------------------------------------------------------ the property

N = 7  # blocks; 6 can be handed out
OP = st.one_of(
    st.tuples(st.just("watch"), st.sets(st.integers(1, N - 1), min_size=1, max_size=4)),
    st.tuples(st.just("cancel"), st.integers(0, 20)),
    st.tuples(st.just("alloc"), st.integers(0, N - 1)),
    st.tuples(st.just("free"), st.integers(0, 20)),
    st.tuples(st.just("unpin"), st.integers(0, 20), st.sampled_from(["u0", "u1"])),
    st.tuples(st.just("reset")),
)


def _callback(name: str) -> str:
    """The name a watch's callback logs: unpin watches share one per key ("u0#5" -> "u0")."""
    return name.split("#")[0]


class _Model:
    """The expected watches: name -> pending block ids, in creation order."""

    def __init__(self) -> None:
        self.p = pool(N)
        self.log: Log = []
        self.handles: list[tuple[str, ReuseWatch]] = []
        self.expected: dict[str, set[int]] = {}  # live names -> pending ids
        self.cancelled: set[int] = set()  # id() of cancelled handles
        self.held: list[KVCacheBlock] = []
        self.shared = {k: recorder(self.log, k) for k in ("u0", "u1")}

    def apply(self, op: tuple[object, ...]) -> None:
        getattr(self, "_" + str(op[0]))(*op[1:])
        self.check()

    def _watch(self, bids: set[int]) -> None:
        name = f"w{len(self.handles)}"
        w = self.p.watch_reuse([self.p.blocks[b] for b in sorted(bids)],
                               recorder(self.log, name))
        self.handles.append((name, w))
        self.expected[name] = set(bids)

    def _cancel(self, i: int) -> None:
        if not self.handles:
            return
        name, w = self.handles[i % len(self.handles)]
        w.cancel()
        self.cancelled.add(id(w))
        self.expected.pop(name, None)

    def _alloc(self, n: int) -> None:
        n = min(n, self.p.get_num_free_blocks())
        order = [name for name, _ in self.handles]
        self.log.clear()
        got = self.p.get_new_blocks(n)
        fired = [(name, b.block_id) for b in got for name in order
                 if b.block_id in self.expected.get(name, ())]
        assert self.log == [(_callback(n), b) for n, b in fired]  # once each, oldest first
        for name, bid in fired:
            self.expected[name].discard(bid)
        self.held += got

    def _free(self, i: int) -> None:
        if self.held:
            self.p.free_blocks([self.held.pop(i % len(self.held))])

    def _unpin(self, i: int, key: str) -> None:
        if not self.held:
            return
        blk = self.held.pop(i % len(self.held))
        watching = any(blk.block_id in self.expected.get(n, ()) and _callback(n) == key
                       for n, _ in self.handles)
        w = self.p.unpin_blocks([blk], self.shared[key])
        name = f"{key}#{len(self.handles)}"
        self.handles.append((name, w))
        self.expected[name] = set() if watching else {blk.block_id}
        assert w.pending == self.expected[name]

    def _reset(self) -> None:
        if self.held:
            return
        self.log.clear()
        assert self.p.reset_prefix_cache()
        assert sorted(self.log) == sorted((_callback(n), b)
                                          for n, ids in self.expected.items() for b in ids)
        for ids in self.expected.values():
            ids.clear()

    def check(self) -> None:
        listed = {(id(w), b) for b, ws in table(self.p).items() for w in ws}
        assert not {h for h, _ in listed} & self.cancelled  # no cancelled handle is kept
        live = {(id(w), b) for name, w in self.handles for b in self.expected.get(name, ())}
        assert listed == live  # and every pending interest is listed, once
        assert all(ws for ws in table(self.p).values())  # no empty lists left behind
        for name, w in self.handles:
            assert w.pending == self.expected.get(name, set())


@settings(max_examples=300, deadline=None)
@given(ops=st.lists(OP, max_size=40))
def test_every_live_watch_fires_once_and_cancelled_ones_never(ops: list[tuple[object, ...]]
                                                              ) -> None:
    m = _Model()
    for op in ops:
        m.apply(op)
    for blk in m.held:  # the end: every block free, then all handed out once more
        m.p.free_blocks([blk])
    m.held.clear()
    m.apply(("alloc", N - 1))
    assert not table(m.p)
    assert all(not w.active for _, w in m.handles)
