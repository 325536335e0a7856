"""The pure planners, against brute-force references (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from kvplugin.aio import plans
from kvplugin.aio.offload_ledger import NO_HOLE
from kvplugin.aio.plans import Layout


@st.composite
def layouts(draw: st.DrawFn) -> Layout:
    sizes = draw(st.lists(st.sampled_from([2, 4, 8]), min_size=1, max_size=3))
    return Layout(tuple(sizes), draw(st.integers(1, 3)))


@st.composite
def spans(draw: st.DrawFn, layout: Layout) -> tuple[int, int]:
    """A load span: start on every group's block boundary, end on every chunk boundary."""
    end = draw(st.integers(1, 6)) * layout.alignment
    start = draw(st.integers(0, end // layout.block_alignment)) * layout.block_alignment
    return start, end


@given(layouts(), st.integers(0, 200), st.integers(0, 200), st.integers(0, 200),
       st.integers(0, 200))
def test_claim_is_aligned_capped_and_maximal(layout: Layout, num_tokens: int, local: int,
                                             start: int, end: int) -> None:
    local -= local % layout.block_alignment
    n = plans.claim_external(layout, num_tokens, local, (start, end))
    assert n >= 0
    if n == 0:
        # Nothing claimable: the span does not reach back to the local hit, or no aligned
        # point beyond the local hit fits under both the span and num_tokens - 1.
        limit = min(end, num_tokens - 1)
        nxt = (local // layout.alignment + 1) * layout.alignment
        assert local < start or nxt > limit or limit <= local
        return
    total = local + n
    assert local >= start and total <= end and total <= num_tokens - 1
    assert total % layout.alignment == 0
    assert total + layout.alignment > min(end, num_tokens - 1)


@given(layouts(), st.data())
def test_load_plan_covers_each_block_once(layout: Layout, data: st.DataObject) -> None:
    start, end = data.draw(spans(layout))
    plan = plans.load_plan(layout, start, end)
    for g, bs in enumerate(layout.block_sizes):
        mine = [c for c in plan if c.group == g]
        covered = [b for c in mine for b in range(c.first_block, c.first_block + c.num_blocks)]
        assert covered == list(range(start // bs, end // bs))
        assert [c.chunk for c in mine] == list(range(mine[0].chunk, mine[0].chunk + len(mine))) \
            if mine else True
        for c in mine:
            assert c.first_block == c.chunk * layout.chunk_blocks + c.skip
            assert c.skip + c.num_blocks == layout.chunk_blocks
            assert c.skip == 0 or c is mine[0]


def _verified_reference(layout: Layout, plan: tuple[plans.ChunkLoad, ...],
                        ok: list[bool], start: int, end: int) -> int:
    best = start
    for t in range(start, end + 1, layout.block_alignment):
        if all(fine for c, fine in zip(plan, ok, strict=True)
               if c.chunk * layout.chunk_tokens(c.group) < t):
            best = t
    return best


@given(layouts(), st.data())
def test_verified_end_is_the_longest_good_prefix(layout: Layout, data: st.DataObject) -> None:
    start, end = data.draw(spans(layout))
    plan = plans.load_plan(layout, start, end)
    ok = data.draw(st.lists(st.booleans(), min_size=len(plan), max_size=len(plan)))
    got = plans.verified_end(layout, plan, ok, start, end)
    assert got == _verified_reference(layout, plan, ok, start, end)
    assert plans.verified_end(layout, plan, [True] * len(plan), start, end) == end


def test_verified_end_rejects_a_result_count_mismatch() -> None:
    layout = Layout((4,), 1)
    plan = plans.load_plan(layout, 0, 8)
    with pytest.raises(ValueError, match="results"):
        plans.verified_end(layout, plan, [True], 0, 8)


@given(layouts(), st.data())
def test_tokens_by_level_counts_each_token_at_its_slowest_group(
        layout: Layout, data: st.DataObject) -> None:
    start, end = data.draw(spans(layout))
    first = [start // layout.chunk_tokens(g) for g in range(layout.num_groups)]
    levels = [data.draw(st.lists(st.integers(0, 2), min_size=end // layout.chunk_tokens(g) - f,
                                 max_size=end // layout.chunk_tokens(g) - f))
              for g, f in enumerate(first)]
    got = plans.tokens_by_level(layout, first, levels, start, end)
    ref: dict[int, int] = {}
    for t in range(start, end):
        lv = max(levels[g][t // layout.chunk_tokens(g) - f] for g, f in enumerate(first))
        ref[lv] = ref.get(lv, 0) + 1
    assert got == ref


@given(layouts(), st.integers(1, 300), st.integers(0, 300), st.integers(0, 300))
def test_lookup_window_asks_only_for_claimable_chunks(layout: Layout, num_tokens: int,
                                                      local: int, hashed: int) -> None:
    local -= local % layout.block_alignment
    assume(local < num_tokens)
    for g, w in enumerate(plans.lookup_window(layout, num_tokens, local, hashed)):
        ct = layout.chunk_tokens(g)
        assert w.start == local // ct
        assert w.stop * ct <= max(min(num_tokens - 1, hashed), w.start * ct)
        # One chunk more would cross the claim cap.
        cap = max(0, min(num_tokens - 1, hashed))
        cap -= cap % layout.alignment
        assert (w.stop + 1) * ct > cap or w.stop * ct >= cap


@given(layouts(), st.integers(0, 10), st.integers(0, 200), st.integers(0, 200))
def test_store_window_holds_only_complete_hashed_chunks(layout: Layout, nxt: int,
                                                        committed: int, hashed: int) -> None:
    for g in range(layout.num_groups):
        w = plans.store_window(layout, g, nxt, committed, hashed)
        ct = layout.chunk_tokens(g)
        assert w.start == nxt
        assert w.stop * ct <= max(min(committed, hashed), nxt * ct)
        assert (w.stop + 1) * ct > min(committed, hashed)


@given(st.lists(st.tuples(st.sampled_from("abcdef"), st.integers(1, 50)), max_size=12),
       st.sets(st.sampled_from("abcdef")), st.integers(0, 100), st.integers(1, 150))
def test_select_stores_respects_budget_and_dedupes(
        cands: list[tuple[str, int]], in_flight: set[str], used: int, budget: int) -> None:
    sel = plans.select_stores(cands, in_flight, used, budget)
    taken = [cands[i] for i in sel.take]
    assert len(sel.take) + sel.duplicates + sel.shed == len(cands)
    assert not {k for k, _ in taken} & in_flight
    assert len({k for k, _ in taken}) == len(taken)
    assert used + sum(n for _, n in taken) <= budget or not taken
    # Greedy in order: a shed candidate did not fit at its turn.
    total = used
    for i, (key, n) in enumerate(cands):
        if i in sel.take:
            total += n
        elif key not in in_flight and key not in {cands[j][0] for j in sel.take if j < i}:
            assert total + n > budget


def test_layout_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Layout((), 1)
    with pytest.raises(ValueError):
        Layout((4,), 0)
    with pytest.raises(ValueError, match="aligned"):
        plans.load_plan(Layout((4,), 2), 2, 8)


# --------------------------------------------------------------------------- hybrids


@st.composite
def hybrid_layouts(draw: st.DrawFn) -> Layout:
    """Full attention first, then a window or a state group (or more full ones)."""
    fa = draw(st.sampled_from([2, 4, 8]))
    kinds = ["full"]
    sizes = [fa]
    windows = [0]
    other = draw(st.sampled_from(["window", "state", "full"]))
    ob = draw(st.sampled_from([fa, 2 * fa]))
    kinds.append(other)
    sizes.append(ob)
    windows.append(draw(st.integers(1, 20)) if other == "window" else 0)
    unit = draw(st.sampled_from([fa, ob])) if other == "state" else 0
    return Layout(tuple(sizes), draw(st.integers(1, 2)), tuple(kinds), tuple(windows), unit)


def _reference_claim(layout: Layout, num_tokens: int, hashed: int, hit: plans.LocalHit,
                     tier: plans.TierHit) -> plans.Claim:
    """Every N tried: restorable when each attention group has it on the device or in a
    tier span reaching back to the device prefix, and each state group has a state."""
    base = hit.deep - hit.deep % layout.block_alignment
    start, end = plans.external_span(layout, tier.first, tier.present)
    best = 0
    for n in range(layout.alignment, min(num_tokens - 1, hashed) + 1, layout.alignment):
        attention = n <= hit.deep or (start <= base and n <= end)
        state = not layout.state_groups or n in tier.states
        if n > hit.reconciled and attention and state:
            best = n
    if not best:
        return plans.Claim(hit.reconciled)
    at = best if layout.state_groups else None
    if best > hit.deep:
        return plans.Claim(base, best - base, at, hit.deep > hit.reconciled)
    return plans.Claim(best, 0, at, True)


@given(hybrid_layouts(), st.data())
def test_reconcile_takes_the_deepest_boundary_every_group_can_restore(
        layout: Layout, data: st.DataObject) -> None:
    num_tokens = data.draw(st.integers(1, 120))
    hashed = data.draw(st.integers(0, 120))
    reconciled = data.draw(st.integers(0, 60)) // layout.block_alignment * \
        layout.block_alignment
    deep = reconciled
    if layout.state_groups and data.draw(st.booleans()):
        deep += data.draw(st.integers(0, 40)) // layout.block_alignment * \
            layout.block_alignment
    hit = plans.LocalHit(reconciled, deep)
    first = tuple(data.draw(st.integers(0, 8)) for _ in range(layout.num_groups))
    present = tuple(data.draw(st.integers(0, 12)) for _ in range(layout.num_groups))
    states = frozenset(data.draw(st.lists(st.integers(1, 30), max_size=6)))
    tier = plans.TierHit(first, present, frozenset(s * layout.alignment for s in states))
    got = plans.reconcile(layout, num_tokens, hashed, hit, tier)
    assert got == _reference_claim(layout, num_tokens, hashed, hit, tier)
    assert got.local + got.external <= max(hit.reconciled, num_tokens - 1)
    if got.loads and got.external:
        assert got.local % layout.block_alignment == 0
        assert (got.local + got.external) % layout.alignment == 0


def test_reconcile_branches_by_example() -> None:
    fa_mamba = Layout((4, 4), 1, ("full", "state"), (0, 0), 4)
    tier = plans.TierHit((3, 0), (4, 0), frozenset({28}))
    # External hit longer than the local one: load [12, 28) and the state at 28.
    assert plans.reconcile(fa_mamba, 40, 40, plans.LocalHit(12, 12), tier) \
        == plans.Claim(12, 16, 28)
    # Shorter: the local hit stands.
    assert plans.reconcile(fa_mamba, 40, 40, plans.LocalHit(32, 32), tier) == plans.Claim(32)
    # Diverged, nothing past the attention hit in the tiers: only the state at 28.
    assert plans.reconcile(fa_mamba, 40, 40, plans.LocalHit(0, 28),
                           plans.TierHit((7, 0), (0, 0), frozenset({28}))) \
        == plans.Claim(28, 0, 28, True)
    # Diverged, no state anywhere: the reconciled hit.
    assert plans.reconcile(fa_mamba, 40, 40, plans.LocalHit(8, 28),
                           plans.TierHit((7, 0), (0, 0))) == plans.Claim(8)
    # A sub-block local tail (28 in a 16-token Mamba block) superseded by a state at 36.
    fine = Layout((4, 16), 1, ("full", "state"), (0, 0), 4)
    assert plans.reconcile(fine, 44, 44, plans.LocalHit(28, 28),
                           plans.TierHit((7, 0), (3, 0), frozenset({36}))) \
        == plans.Claim(28, 8, 36)


@given(st.lists(st.tuples(st.integers(0, 1), st.integers(0, 5), st.integers(0, 50)),
                max_size=10),
       st.booleans(), st.integers(0, 50), st.integers(0, 50), st.integers(0, 50))
def test_select_states_keeps_only_complete_live_aligned_states(
        raw: list[tuple[int, int, int]], alive: bool, known: int, save_end: int,
        hole: int) -> None:
    layout = Layout((4, 4), 1, ("full", "state"), (0, 0), 4)
    offers = [plans.StateOffer(g, b, n) for g, b, n in raw]
    kept, dropped = plans.select_states(layout, offers, alive=alive, known_until=known,
                                        save_end=save_end, hole=hole)
    assert len(kept) + dropped == len(offers)
    for o in kept:
        assert alive and o.block_id != 0 and o.boundary % 4 == 0
        assert known < o.boundary <= min(save_end, hole)
    for o in offers:
        if o not in kept:
            assert not (alive and o.block_id and known < o.boundary <= min(save_end, hole)
                        and o.boundary % 4 == 0)


@given(st.integers(0, 100), st.integers(1, 64), st.integers(1, 100), st.integers(0, 20),
       st.sampled_from([4, 8, 16]), st.booleans())
def test_mamba_split_ends_chunks_where_states_are_valid(
        start: int, n: int, prompt: int, extra: int, bs: int, fine: bool) -> None:
    num_tokens = prompt + extra
    assume(start < num_tokens)
    n = min(n, num_tokens - start)
    got = plans.mamba_split(start, n, num_prompt_tokens=prompt, num_tokens=num_tokens,
                            block_size=bs, checkpoint_unit=4 if fine else None)
    assert 0 <= got <= n
    end = start + got
    prefill_end = max(prompt, num_tokens - 1)
    if start >= prefill_end:
        assert got == n  # decode: no split
        return
    if got < n:
        # Cut: at a block boundary, or at the prompt's last reusable boundary.
        tail = (prompt - 1) // 4 * 4 if fine else -1
        assert end % bs == 0 or end == tail
    if end < prefill_end and start % bs == 0 and n >= bs:
        # Mid-prefill with a budget that reaches a boundary: never inside a block (a
        # smaller budget advances sub-block, as vLLM does for a block wider than a chunk).
        assert got > 0
        assert end % bs == 0 or end == ((prompt - 1) // 4 * 4 if fine else -1)


def test_window_load_plan_skips_blocks_outside_the_window() -> None:
    layout = Layout((4, 4), 1, ("full", "window"), (0, 7), 0)
    plan = plans.load_plan(layout, 0, 40)
    assert [c.chunk for c in plan if c.group == 0] == list(range(10))
    # Token 40 attends to 33..39: blocks 8 and 9; the core leaves 0..7 null.
    assert [c.first_block for c in plan if c.group == 1] == [8, 9]
    assert layout.skipped_blocks(1, 40) == 8
    assert plans.state_plan(Layout((4, 16), 1, ("full", "state"), (0, 0), 4), 36) \
        == (plans.StateLoad(1, 36, 2),)


@given(hybrid_layouts(), st.data())
def test_resume_point_is_all_or_nothing_unless_every_group_is_full(
        layout: Layout, data: st.DataObject) -> None:
    end = data.draw(st.integers(1, 4)) * layout.alignment
    start = data.draw(st.integers(0, (end - 1) // layout.block_alignment)) * \
        layout.block_alignment
    plan = plans.load_plan(layout, start, end)
    ok = data.draw(st.lists(st.booleans(), min_size=len(plan), max_size=len(plan)))
    states_ok = data.draw(st.lists(st.booleans(), min_size=len(layout.state_groups),
                                   max_size=len(layout.state_groups)))
    got = plans.resume_point(layout, plan, ok, states_ok, start, end)
    if all(ok) and all(states_ok):
        assert got == end
    elif layout.all_full:
        assert got == plans.verified_end(layout, plan, ok, start, end)
    else:
        assert got == 0


def test_a_chunked_local_group_loads_only_the_hits_own_attention_chunk() -> None:
    # Full attention + chunked local attention (64-token chunks), 16-token blocks, one
    # block per stored chunk: a hit at N needs the local blocks of [N // 64 * 64, N).
    lay = plans.Layout((16, 16), 1, ("full", "local"), (0, 64))
    assert [lay.skipped_blocks(1, n) for n in (0, 63, 64, 100, 128)] == [0, 0, 4, 4, 8]
    assert lay.skipped_blocks(0, 100) == 0 and lay.has_null_blocks and not lay.all_full
    got = plans.load_plan(lay, 0, 96)
    assert [(c.group, c.chunk) for c in got if c.group == 0] == [(0, c) for c in range(6)]
    assert [(c.group, c.chunk, c.first_block, c.num_blocks) for c in got if c.group == 1] == [
        (1, 4, 4, 1), (1, 5, 5, 1)]
    assert [c for c in plans.load_plan(lay, 0, 128) if c.group == 1] == []  # a boundary
    with pytest.raises(ValueError, match="token span"):
        plans.Layout((16,), 1, ("local",), (0,))


# ------------------------------------------------------------- chunk offers (both engines)
def test_chunk_offers_read_the_table_and_advance_every_cursor() -> None:
    # Full attention and a window group, blocks of 4, chunks of 2 blocks (8 tokens).
    lay = Layout((4, 4), 2, ("full", "window"), (0, 7))
    table = ([1, 2, 3, 4, 5, 6, 7], [0, 0, 13, 14, 15, 16, 17])  # the window freed 11, 12
    offers = plans.chunk_offers(lay, [0, 0], 27, 28, table, NO_HOLE)
    assert offers.chunks == (
        plans.ChunkOffer(0, 0, (1, 2)), plans.ChunkOffer(0, 1, (3, 4)),
        plans.ChunkOffer(0, 2, (5, 6)),
        plans.ChunkOffer(1, 1, (13, 14)), plans.ChunkOffer(1, 2, (15, 16)))
    assert offers.next_chunk == (3, 3)  # chunk 3 needs token 32: not computed yet
    assert offers.hole == 0  # window chunk 0 is gone: no state can be restored past 0
    # From the cursors on, nothing is offered twice; the hole stays where it was.
    again = plans.chunk_offers(lay, offers.next_chunk, 27, 28, table, offers.hole)
    assert again.chunks == () and again.next_chunk == (3, 3) and again.hole == 0


def test_chunk_offers_treat_a_short_table_as_released_blocks() -> None:
    # An engine may hand over only the blocks it still holds (vLLM's table for the step).
    lay = Layout((4,), 2)
    offers = plans.chunk_offers(lay, [1], 24, 24, ([1, 2, 3],), NO_HOLE)
    assert offers.chunks == ()
    assert offers.next_chunk == (3,) and offers.hole == 8  # chunk 1 starts at token 8
    # Fewer hashed tokens than computed: the window stops at the hashes.
    offers = plans.chunk_offers(lay, [0], 24, 9, ([1, 2, 3, 4, 5, 6],), NO_HOLE)
    assert offers.chunks == (plans.ChunkOffer(0, 0, (1, 2)),) and offers.next_chunk == (1,)
