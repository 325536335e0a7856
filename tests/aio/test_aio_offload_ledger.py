"""The offload ledger alone (no loop, no core, no tier): exact plans, cursors, holes, the
budget and duplicates, tier quotas, and the counters booked from reported outcomes."""

from __future__ import annotations

import copy
import hashlib
from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplugin.aio.keys import KeySpace
from kvplugin.aio.memory import PageShape, StateShape, layout_of
from kvplugin.aio.offload_ledger import (
    NO_HOLE,
    LoadResult,
    OffloadLedger,
    PlanError,
    PlanState,
    StorePlan,
    StoreResult,
    TierQuotas,
)
from kvplugin.aio.plans import StateOffer
from kvplugin.connectors.events import TierEvent

BS = 16
FULL = PageShape(2, 2, 4, "float32", BS)  # 2 layers * K,V * 2 heads * 4 * 4 B * 16 = 2 KiB
STATE = StateShape(2, 64, 64, ((4, 4),), ("float32",))
PAGE = FULL.page_bytes


@dataclass
class Req:
    """A request as the ledger reads it (the native core's and vLLM's have these)."""

    n: int
    num_prompt_tokens: int = 0
    block_hashes: list[bytes] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.num_prompt_tokens = self.num_prompt_tokens or self.n
        self.block_hashes = [hashlib.sha256(f"{self.n}:{i}".encode()).digest()
                             for i in range(self.n // BS)]

    @property
    def num_tokens(self) -> int:
        return self.n


def _ledger(budget: int | None = 1 << 30, *, chunk_blocks: int = 1, state: bool = False,
            quota: dict[str, dict[str, int]] | None = None,
            tiers: tuple[str, ...] = ("memory", "disk")) -> OffloadLedger:
    shapes = [FULL, STATE] if state else [FULL]
    keys = KeySpace("m", shapes, BS, chunk_blocks)
    lay = layout_of(shapes, chunk_blocks, BS)
    return OffloadLedger(lay, keys, page_bytes=[s.page_bytes for s in shapes], tiers=tiers,
                         store_budget_bytes=budget, quotas=TierQuotas(tenants=quota or {}),
                         reporting=["memory"])


def _table(n: int, first: int = 1) -> list[list[int]]:
    return [list(range(first, first + n))]


def _desc(plan: StorePlan | None) -> list[tuple[int, int, bool]]:
    return [] if plan is None else [(o.group, o.index, o.state) for o in plan.objects]


def test_a_step_stores_the_chunks_it_completed_once() -> None:
    led = _ledger()
    req = Req(64)
    rq = led.open("r", "acme", "acme", 64)
    assert not led.has_new_chunks(rq, req, 15)
    assert led.has_new_chunks(rq, req, 40)
    plan = led.prepare_store(rq, req, computed=40, table=_table(4))
    assert _desc(plan) == [(0, 0, False), (0, 1, False)]
    assert plan is not None and plan.nbytes == 2 * PAGE and plan.first_token == 0
    assert [o.block_ids for o in plan.objects] == [(1,), (2,)]
    assert plan.objects[1].key == led.keyspace.chunk_keys("acme", 0, req.block_hashes, 1, 2)[0]
    assert rq.next_chunk == [2] and led.bytes_in_flight == 2 * PAGE
    assert led.prepare_store(rq, req, computed=47, table=_table(4)) is None  # nothing new
    led.complete_store(plan, StoreResult(True, (2, 2)))
    c = led.tenant("acme")
    assert (led.stats.stores, led.stats.stored_chunks, led.stats.stored_bytes) == (1, 2, 2 * PAGE)
    assert (c.stores, c.stored_chunks, c.stored_bytes, c.store_bytes_in_flight) == (
        1, 2, 2 * PAGE, 0)
    assert c.stored_bytes_by_tier == {"memory": 2 * PAGE, "disk": 2 * PAGE}
    assert led.bytes_in_flight == 0


def _books(led: OffloadLedger) -> tuple[object, ...]:
    return copy.deepcopy((led.stats, led.tenants(), led.bytes_in_flight))


@pytest.mark.parametrize("first", [True, False])
def test_completing_a_store_plan_twice_raises_and_changes_nothing(first: bool) -> None:
    led = _ledger(budget=4 * PAGE)
    req = Req(64)
    rq = led.open("r", "t", "t", 64)
    plan = led.prepare_store(rq, req, computed=48, table=_table(4))
    assert plan is not None and plan.state is PlanState.OPEN
    led.complete_store(plan, StoreResult(first, (3, 3)))
    assert plan.state is (PlanState.DONE if first else PlanState.FAILED)
    before, hole = _books(led), rq.hole
    for again in (True, False):
        with pytest.raises(PlanError, match="completed twice"):
            led.complete_store(plan, StoreResult(again, (3, 3)))
    assert _books(led) == before and rq.hole == hole
    # The objects are no longer in flight: the same chunks offered by another request
    # are stored again, not deduplicated against a plan that ended.
    other = led.open("o", "t", "t", 64)
    again_plan = led.prepare_store(other, req, computed=48, table=_table(4, 9))
    assert _desc(again_plan) == [(0, 0, False), (0, 1, False), (0, 2, False)]


def test_a_plan_of_another_ledger_raises_and_changes_nothing() -> None:
    mine, theirs = _ledger(), _ledger()
    req = Req(32)
    plan = theirs.prepare_store(theirs.open("r", "t", "t", 32), req, computed=32, table=_table(2))
    assert plan is not None
    mine.open("r", "t", "t", 32)
    before = _books(mine)
    with pytest.raises(PlanError, match="did not prepare it"):
        mine.complete_store(plan, StoreResult(True, (2, 2)))
    assert _books(mine) == before and plan.state is PlanState.OPEN
    theirs.complete_store(plan, StoreResult(True, (2, 2)))  # its own ledger completes it
    assert theirs.bytes_in_flight == 0 and theirs.stats.stored_chunks == 2


def test_a_duplicate_is_not_stored_twice_and_the_budget_sheds_with_a_hole() -> None:
    led = _ledger(budget=3 * PAGE)
    req = Req(64)
    a = led.open("a", "t", "t", 64)
    b = led.open("b", "t", "t", 64)
    first = led.prepare_store(a, req, computed=32, table=_table(4))
    assert _desc(first) == [(0, 0, False), (0, 1, False)]
    # b has the same prefix: chunks 0, 1 are being stored by a; 2 fits, 3 is over budget.
    second = led.prepare_store(b, req, computed=64, table=_table(4, 10))
    assert _desc(second) == [(0, 2, False)]
    assert (led.stats.stores_deduplicated, led.stats.stores_shed) == (2, 1)
    assert b.hole == 48 and b.next_chunk == [4]  # shed, not deduplicated: a hole at 48
    assert a.hole == NO_HOLE
    assert second is not None
    led.complete_store(second, StoreResult(False))  # a failed store: a hole at its first chunk
    assert b.hole == 32 and led.stats.stores_failed == 1
    assert led.tenant("t").stores_failed == 1


def test_states_go_with_their_chunks_and_not_past_a_hole() -> None:
    led = _ledger(state=True)
    req = Req(96)
    rq = led.open("r", "t", "t", 96)
    led.admit(rq, 16)  # the hit: states up to 16 came with it
    offers = [StateOffer(1, 7, 16), StateOffer(1, 8, 32), StateOffer(1, 0, 48)]
    plan = led.prepare_store(rq, req, computed=48, table=[[1, 2, 3], [0, 0, 8]], offers=offers)
    # Chunk 0 is inside the hit; chunks 1, 2 stored; the state at 16 is the hit's, the
    # one in block 0 is null: only the state at 32 goes, after its chunks.
    assert _desc(plan) == [(0, 1, False), (0, 2, False), (1, 32, True)]
    assert led.stats.states_dropped == 2
    # A window the engine nulled: the chunk cannot be read, no later state is complete.
    plan = led.prepare_store(rq, req, computed=80, table=[[1, 2, 3, 0, 5], [0, 0, 8, 9, 10]],
                     offers=[StateOffer(1, 10, 80)])
    assert _desc(plan) == [(0, 4, False)] and rq.hole == 48
    assert led.stats.states_dropped == 3
    # A request that lost its blocks reads none of them.
    assert led.prepare_store(rq, req, computed=96, table=(), offers=[StateOffer(1, 11, 96)],
                     alive=False) is None
    assert led.stats.states_dropped == 4 and rq.next_chunk[0] == 5


def test_an_offered_state_its_block_no_longer_holds_is_dropped() -> None:
    """``stale``: the executor found the offered block reused since the offer (data, not a
    callback): that state is dropped, counted; the others go."""
    led = _ledger(state=True)
    req = Req(64)
    rq = led.open("r", "t", "t", 64)
    offers = [StateOffer(1, 7, 16), StateOffer(1, 8, 32)]
    plan = led.prepare_store(rq, req, computed=32, table=[[1, 2], [0, 8]], offers=offers,
                             stale=[offers[0]])
    assert _desc(plan) == [(0, 0, False), (0, 1, False), (1, 32, True)]
    assert led.stats.states_dropped == 1


def test_admission_skips_what_the_lookup_found_and_a_failed_load_rewinds() -> None:
    led = _ledger()
    req = Req(128)
    rq = led.open("r", "t", "t", 128)
    led.admit(rq, 32, stored_until=(5,))
    assert rq.next_chunk == [5] and rq.known_until == 32
    led.rewind(rq, 32)  # vLLM's step at the admitted hit: nothing taken back
    led.rewind(rq, 64)
    assert rq.next_chunk == [5]
    assert _desc(led.prepare_store(rq, req, computed=96, table=_table(8))) == [(0, 5, False)]
    led.rewind(rq, 16)  # a load verified less than claimed: recomputed from 16
    assert rq.next_chunk == [1] and rq.known_until == 16


def test_an_untracked_ledger_decides_the_same_without_a_registry() -> None:
    tracked, untracked = _ledger(), _ledger(budget=None)
    req = Req(64)
    plans = []
    for led in (tracked, untracked):
        a, b = led.open("a", "t", "t", 64), led.open("b", "t", "t", 64)
        plans.append((_desc(led.prepare_store(a, req, computed=64, table=_table(4))),
                      _desc(led.prepare_store(b, req, computed=64, table=_table(4, 9)))))
    assert plans[0][0] == plans[1][0]
    assert plans[0][1] == [] and len(plans[1][1]) == 4  # the vLLM side cannot deduplicate
    assert untracked.bytes_in_flight == 0 and untracked.stats.stores == 2


def test_a_tier_quota_counts_held_bytes_from_the_tiers_events() -> None:
    led = _ledger(quota={"t": {"memory": 3 * PAGE}})
    assert led.needs_tier_events("t") and not led.needs_tier_events("other")
    req = Req(160)
    rq = led.open("r", "t", "t", 160)
    plan = led.prepare_store(rq, req, computed=32, table=_table(10))
    assert plan is not None and _desc(plan) == [(0, 0, False), (0, 1, False)]
    ids = sorted(plan.key_ids)
    led.apply_tier_events([TierEvent("stored", "memory", tuple(ids))])  # before completing
    led.complete_store(plan, StoreResult(True, (2, 2)))
    assert led.holdings is not None and led.holdings.held("t", "memory") == 2 * PAGE
    # 2 held + 2 more > 3: the whole offer is shed, counted, with a hole.
    assert led.prepare_store(rq, req, computed=64, table=_table(10)) is None
    c = led.tenant("t")
    assert (c.stores_shed, c.stores_shed_quota, led.stats.stores_shed_quota) == (2, 2, 2)
    assert rq.hole == 32 and rq.next_chunk == [4]
    # The tier evicted both: held bytes go back to 0, and the next offer fits.
    led.apply_tier_events([TierEvent("removed", "memory", tuple(ids), "evicted")])
    plan = led.prepare_store(rq, req, computed=96, table=_table(10))
    assert _desc(plan) == [(0, 4, False), (0, 5, False)]
    assert led.holdings.held("t", "memory") == 0


def test_loads_are_booked_from_what_the_executor_reports() -> None:
    led = _ledger()
    req = Req(64)
    rq = led.open("r", "t", "t", 64)
    plan = led.prepare_load(rq, req, _table(4), 0, 64, None)
    assert plan.state is PlanState.OPEN and plan.start == 0 and plan.end == 64
    assert [(o.group, o.load.chunk, o.dst) for o in plan.objects] == [
        (0, i, (i + 1,)) for i in range(4)]
    assert plan.keys == tuple(led.keyspace.chunk_keys("t", 0, req.block_hashes, 0, 4))
    led.complete_load(plan, LoadResult(verified=48, copied=(
        ("disk", 2 * PAGE, False), ("memory", 100, True))))
    assert plan.state is PlanState.FAILED
    s, c = led.stats, led.tenant("t")
    assert (s.loads, s.loads_failed, s.recomputed_tokens) == (1, 1, 16)
    assert (s.loaded_chunks, s.loaded_states, s.loaded_bytes) == (1, 1, 2 * PAGE + 100)
    assert s.loaded_bytes_by_tier == {"disk": 2 * PAGE, "memory": 100}
    assert (c.loads, c.loads_failed, c.loaded_bytes) == (1, 1, 2 * PAGE + 100)
    again = led.prepare_load(rq, req, _table(4), 0, 64, None)
    led.complete_load(again, LoadResult(cancelled=True))
    s = led.stats  # a snapshot: taken again
    assert (s.loads_cancelled, c.loads_cancelled, s.loads_failed) == (1, 1, 1)


def test_completing_a_load_twice_or_loading_for_a_closed_request_raises() -> None:
    led, other = _ledger(), _ledger()
    req = Req(64)
    rq = led.open("r", "t", "t", 64)
    plan = led.prepare_load(rq, req, _table(4), 0, 64, None)
    led.complete_load(plan, LoadResult(verified=64))
    assert plan.state is PlanState.DONE
    before = _books(led)
    with pytest.raises(PlanError, match="completed twice"):
        led.complete_load(plan, LoadResult(verified=64))
    theirs = other.prepare_load(other.open("r", "t", "t", 64), req, _table(4), 0, 64, None)
    with pytest.raises(PlanError, match="unknown"):
        led.complete_load(theirs, LoadResult(verified=64))
    led.close(rq)
    with pytest.raises(PlanError, match="is closed"):
        led.prepare_load(rq, req, _table(4), 0, 64, None)
    with pytest.raises(PlanError, match="is closed"):
        led.admit(rq, 16)
    assert _books(led) == before


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 8), st.booleans()),
                min_size=1, max_size=30),
       st.integers(1, 6))
def test_the_budget_and_registry_return_to_zero_and_tenants_sum_to_the_total(
        steps: list[tuple[int, int, bool]], budget_chunks: int) -> None:
    """Any interleaving of offers and completions: bytes in flight never exceed the budget,
    equal the open plans', and go back to 0; no object is in two open plans; the tenants'
    counters sum to the global ones."""
    led = _ledger(budget=budget_chunks * PAGE)
    reqs = [(led.open(f"r{i}", f"t{i % 2}", f"t{i % 2}", 128), Req(128)) for i in range(4)]
    computed = [0] * 4
    open_plans: list[StorePlan] = []
    for who, more, ok in steps:
        rq, req = reqs[who]
        computed[who] = min(128, computed[who] + more * BS)
        plan = led.prepare_store(rq, req, computed=computed[who], table=_table(8, 1 + 8 * who))
        if plan is not None:
            open_plans.append(plan)
        ids = [k for p in open_plans for k in p.key_ids]
        assert len(ids) == len(set(ids))
        assert led.bytes_in_flight == sum(p.nbytes for p in open_plans) <= budget_chunks * PAGE
        if open_plans and ok:
            led.complete_store(open_plans.pop(0), StoreResult(who % 2 == 0, (9, 9)))
    for p in open_plans:
        led.complete_store(p, StoreResult(True, (9, 9)))
    assert led.bytes_in_flight == 0
    per = led.tenants().values()
    s = led.stats
    for name in ("stores", "stored_chunks", "stored_bytes", "stores_failed", "stores_shed",
                 "stores_deduplicated"):
        assert sum(getattr(c, name) for c in per) == getattr(s, name), name
    assert all(c.store_bytes_in_flight == 0 for c in per)
