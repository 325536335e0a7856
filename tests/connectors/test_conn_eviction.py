"""Eviction policies: each one's order pinned on a scripted sequence, on the policy alone and
through the real memory and disk tiers (a hit refreshes; lookups do not), ARC's invariants
under random traffic, ghosts never held or reported, and policies found by name."""

from __future__ import annotations

from pathlib import Path

import pytest
from conn_testlib import T, make_items, namespace
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplugin.connectors.base import Connector, PutItem
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.eviction import (
    ARCPolicy,
    EvictionPolicy,
    LRUPolicy,
    make_policy,
    policy_problem,
    resolve_policy,
)
from kvplugin.connectors.memory import MemoryConnector

KIB = 1024
SIZE = 5224  # one encoded object of make_items(..., nbytes=4 KiB)


def arc_state(p: ARCPolicy) -> tuple[list[str], list[str], list[str], list[str], int]:
    return list(p.t1.items), list(p.t2.items), list(p.b1.items), list(p.b2.items), p.p


# The script: a..d fill a four-object tier, a and b are hit, then e, f, c (back after its
# eviction), g and a (back after its eviction) come in.
SCRIPT = [("put", "abcd"), ("hit", "ab"), ("put", "e"), ("put", "f"), ("put", "c"),
          ("put", "g"), ("put", "a")]


def run_script(policy: EvictionPolicy) -> list[str]:
    victims = []
    for op, ids in SCRIPT:
        for sid in ids:
            if op == "hit":
                policy.touched(sid)
                continue
            if len(policy) == 4:
                v = policy.evict(sid)
                assert v is not None
                victims.append(v)
            policy.inserted(sid, 10)
    return victims


def test_lru_order_on_the_script() -> None:
    lru = LRUPolicy(40)
    assert run_script(lru) == ["c", "d", "a", "b", "e"]
    assert lru.order() == ["f", "c", "g", "a"]


def test_arc_lists_and_target_on_the_script() -> None:
    arc = ARCPolicy(40)
    for sid in "abcd":
        arc.inserted(sid, 10)
    assert arc_state(arc) == (["a", "b", "c", "d"], [], [], [], 0)
    arc.touched("a")
    arc.touched("b")  # hit again: frequency
    assert arc_state(arc) == (["c", "d"], ["a", "b"], [], [], 0)
    assert arc.evict("e") == "c"  # T1 over its target (0): its oldest goes, remembered
    arc.inserted("e", 10)
    assert arc.evict("f") == "d"
    arc.inserted("f", 10)
    assert arc_state(arc) == (["e", "f"], ["a", "b"], ["c", "d"], [], 0)
    # c comes back from B1: recency was too small, p grows by its size (B2 empty: x1).
    assert arc.evict("c") == "e"
    assert arc_state(arc) == (["f"], ["a", "b"], ["c", "d", "e"], [], 10)
    arc.inserted("c", 10)  # used twice now: T2, not adapted a second time
    assert arc_state(arc) == (["f"], ["a", "b", "c"], ["d", "e"], [], 10)
    # T1 at its target: T2's oldest goes to B2.
    assert arc.evict("g") == "a"
    arc.inserted("g", 10)
    assert arc_state(arc) == (["f", "g"], ["b", "c"], ["d", "e"], ["a"], 10)
    # a comes back from B2: p shrinks by its size times |B1| / |B2| = 2.
    assert arc.evict("a") == "f"
    arc.inserted("a", 10)
    assert arc_state(arc) == (["g"], ["b", "c", "a"], ["d", "e", "f"], [], 0)
    assert arc.order() == ["g", "b", "c", "a"]
    assert arc.ghosts == ["d", "e", "f"]


def test_arc_scan_resistance() -> None:
    """A scan of one-off objects passes through T1 and leaves what was hit twice alone."""
    arc, lru = ARCPolicy(40), LRUPolicy(40)
    for policy in (arc, lru):
        for sid in "ab":
            policy.inserted(sid, 10)
            policy.touched(sid)
        for i in range(20):  # a scan: twenty objects read once
            if len(policy) == 4:
                policy.evict(f"s{i}")
            policy.inserted(f"s{i}", 10)
    assert {"a", "b"} <= set(arc.order())
    assert not {"a", "b"} & set(lru.order())


def test_arc_sizes_in_bytes() -> None:
    arc = ARCPolicy(100)
    arc.inserted("big", 60)
    arc.inserted("s1", 20)
    arc.inserted("s2", 20)
    assert arc.evict("x") == "big"
    # The ghost of 60 bytes fits beside T1's 40 (T1 + B1 within the capacity) ...
    assert arc_state(arc) == (["s1", "s2"], [], ["big"], [], 0)
    arc.inserted("x", 50)
    # ... and not beside 90: the oldest ghost goes (dropped silently, it was never held).
    assert arc_state(arc) == (["s1", "s2", "x"], [], [], [], 0)
    # A ghost coming back grows p by its size.
    assert arc.evict("y") == "s1"
    arc.inserted("y", 10)  # T1 90 bytes + s1's ghost: at the capacity, the ghost stays
    assert arc.evict("s1") == "s2"
    assert arc.p == 20
    arc.inserted("s1", 20)
    assert arc_state(arc) == (["x", "y"], ["s1"], ["s2"], [], 20)


@pytest.mark.parametrize("policy", [LRUPolicy(10), ARCPolicy(10)], ids=["lru", "arc"])
def test_misuse_and_unknown_ids(policy: EvictionPolicy) -> None:
    assert policy.evict() is None  # nothing held
    policy.inserted("a", 5)
    with pytest.raises(KeyError, match="'a' is already held"):
        policy.inserted("a", 5)
    policy.touched("zz")  # a hit racing a delete: ignored
    policy.removed("zz")
    policy.removed("a")  # deleted, not evicted: no ghost
    assert len(policy) == 0 and "a" not in policy
    assert policy.evict() is None
    assert getattr(policy, "ghosts", []) == []
    with pytest.raises(ValueError, match="capacity_bytes must be a positive int"):
        type(policy)(0)


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "hit", "del"]), st.integers(0, 15),
                          st.integers(1, 40)), max_size=120))
def test_arc_invariants_under_random_traffic(ops: list[tuple[str, int, int]]) -> None:
    """A tier of 100 bytes over ARC: held ids are exactly the model's, within capacity;
    ghosts are disjoint from them and bounded; p stays in [0, c]; a victim was held."""
    c = 100
    arc, held = ARCPolicy(c), dict[str, int]()
    for op, n, size in ops:
        sid = f"o{n}"
        if op == "put" and sid not in held:
            while sum(held.values()) + size > c:
                v = arc.evict(sid)
                assert v in held
                del held[v]
            arc.inserted(sid, size)
            held[sid] = size
        elif op == "hit":
            arc.touched(sid)
        elif op == "del":
            arc.removed(sid)
            held.pop(sid, None)
        assert set(arc.order()) == set(held) and len(arc) == len(held)
        assert arc.t1.bytes + arc.t2.bytes == sum(held.values()) <= c
        assert not set(arc.ghosts) & set(held)
        assert arc.t1.bytes + arc.b1.bytes <= c
        assert arc.t1.bytes + arc.t2.bytes + arc.b1.bytes + arc.b2.bytes <= 2 * c
        assert 0 <= arc.p <= c


# ---------------------------------------------------------------------------- real tiers


def tier(kind: str, eviction: str, tmp_path: Path) -> MemoryConnector | DiskConnector:
    if kind == "memory":
        return MemoryConnector(capacity_bytes=4 * SIZE, eviction=eviction)
    return DiskConnector(tmp_path / "d", capacity_bytes=4 * SIZE, eviction=eviction,
                         inline_read_bytes=0)


async def run_on_tier(conn: Connector, items: dict[str, PutItem]) -> list[tuple[str, ...]]:
    """The script through a tier's own API: a hit is a ``get``; a lookup before each put
    must not count as one."""
    conn.watch_events()
    for op, ids in SCRIPT:
        for sid in ids:
            await conn.lookup([items[sid][0]], timeout=T)
            if op == "hit":
                (got,) = await conn.get([items[sid][0]], timeout=T)
                assert got is not None
            else:
                assert await conn.put([items[sid]], timeout=T) == 1
    return [e.ids for e in conn.take_events() if e.kind == "removed"]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["memory", "disk"])
@pytest.mark.parametrize(("eviction", "victims", "order"), [
    ("lru", "cdabe", "fcga"),
    ("arc", "cdeaf", "gbca"),
])
async def test_the_tiers_evict_in_their_policys_order(
        tmp_path: Path, kind: str, eviction: str, victims: str, order: str) -> None:
    made = make_items(namespace(), 7, nbytes=4 * KIB)
    items = dict(zip("abcdefg", made, strict=True))
    names = {k.id: n for n, (k, _) in items.items()}
    async with tier(kind, eviction, tmp_path) as conn:
        removed = await run_on_tier(conn, items)
        assert [names[i] for ids in removed for i in ids] == list(victims)
        assert [names[i] for i in conn.objects()] == list(order)
        assert conn.used_bytes == 4 * SIZE
        assert conn.stats().evicted == 5
        assert conn.policy.name == eviction


@pytest.mark.asyncio
async def test_a_put_of_a_held_object_is_a_hit() -> None:
    items = make_items(namespace(), 3, nbytes=4 * KIB)
    async with MemoryConnector(capacity_bytes=2 * SIZE) as mem:
        await mem.put(items[:2], timeout=T)
        await mem.put(items[:1], timeout=T)  # already there: refreshed
        await mem.put(items[2:], timeout=T)
        assert list(mem.objects()) == [items[0][0].id, items[2][0].id]


# ---------------------------------------------------------------------------- by name


class MostRecentFirst(EvictionPolicy):
    """A third-party policy: evicts the newest object (a stack)."""

    name = "mru"

    def __init__(self, capacity_bytes: int) -> None:
        super().__init__(capacity_bytes)
        self.held: list[str] = []

    def inserted(self, sid: str, size: int) -> None:
        self.held.append(sid)

    def touched(self, sid: str) -> None:
        pass

    def removed(self, sid: str) -> None:
        self.held = [h for h in self.held if h != sid]

    def evict(self, incoming: str | None = None) -> str | None:
        return self.held.pop() if self.held else None

    def order(self) -> list[str]:
        return self.held[:]

    def __contains__(self, sid: object) -> bool:
        return any(h == sid for h in self.held)

    def __len__(self) -> int:
        return len(self.held)


HERE = f"{__name__}:MostRecentFirst"


def test_policies_by_name() -> None:
    assert resolve_policy("lru") is LRUPolicy
    assert resolve_policy("arc") is ARCPolicy
    assert resolve_policy(HERE) is MostRecentFirst
    assert type(make_policy("arc", 10)) is ARCPolicy
    assert policy_problem("lru") is None
    assert policy_problem("mru") == ("unknown eviction policy 'mru'; known: arc, lru; or "
                                     "give a module:Class string")
    assert policy_problem("string:digits") == ("eviction policy 'string:digits' is "
                                               "'0123456789', not a subclass of "
                                               "kvplugin.connectors.eviction.EvictionPolicy")
    assert policy_problem("no_such_mod:X") == (
        "eviction policy 'no_such_mod:X': cannot import 'no_such_mod': "
        "ModuleNotFoundError: No module named 'no_such_mod'")
    used = LRUPolicy(10)
    used.inserted("a", 1)
    with pytest.raises(ValueError, match="must be fresh and sized for its tier"):
        make_policy(used, 10)
    with pytest.raises(ValueError, match="must be fresh and sized for its tier"):
        make_policy(LRUPolicy(20), 10)


@pytest.mark.asyncio
async def test_a_policy_by_module_path_serves_a_tier() -> None:
    items = make_items(namespace(), 3, nbytes=4 * KIB)
    async with MemoryConnector(capacity_bytes=2 * SIZE, eviction=HERE) as mem:
        # A chain is stored tail first: 2, 1, then 0, for which the newest (1) goes.
        await mem.put(items, timeout=T)
        assert type(mem.policy) is MostRecentFirst
        assert list(mem.objects()) == [items[2][0].id, items[0][0].id]


@pytest.mark.asyncio
@pytest.mark.parametrize("kind", ["memory", "disk"])
@pytest.mark.parametrize("eviction", ["lru", "arc"])
async def test_a_chain_keeps_its_head(tmp_path: Path, kind: str, eviction: str) -> None:
    """A batch is a chain, head first: what does not fit is its tail (a lookup counts from
    the head), and a hit leaves the head the most recent."""
    items = make_items(namespace(), 6, nbytes=4 * KIB)
    ids = [k.id for k, _ in items]
    async with tier(kind, eviction, tmp_path) as conn:
        await conn.put(items, timeout=T)  # the tail's 2 were written, then made room
        assert await conn.lookup([k for k, _ in items], timeout=T) == 4
        assert set(conn.objects()) == set(ids[:4])
        await conn.get([k for k, _ in items[:4]], timeout=T)
        await conn.put(items[4:5], timeout=T)  # one more: the tail goes
        assert set(conn.objects()) == {*ids[:3], ids[4]}
