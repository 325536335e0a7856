"""Model-based test of the public ``KVCacheManager`` API (spec sec. 7.5).

A hypothesis ``RuleBasedStateMachine`` plays a small scheduler: requests with prompts drawn
from a tiny alphabet and shared prefixes are admitted (lookup + ``allocate_slots``), run
prefill chunks and decode steps (drafts, lookahead slots, rejections), get preempted,
finished (``free`` or ``pop_blocks_for_free`` + ``free_blocks(reversed)``), and the cache
is poked with ``evict_blocks``, ``reset_prefix_cache``, ``cache_blocks`` and
``new_step_starts``.  After every step the section-7 invariants are checked (P1-P9,
H1-H7, L1-L5, L7, A1-A4, A6, A7, A9) and the KV event stream is replayed onto a shadow of
the prefix-cache map, which must equal the real map.

Layouts: one full-attention group, and hybrids (full + sliding window with different block
sizes; full + two sliding windows, equal or different; full + chunked local).
"""

from __future__ import annotations

from collections import Counter
from typing import Any, ClassVar

import pytest
from core_testlib import (
    Core,
    RequestStatus,
    apply_events,
    cdiv,
    check_invariants,
    chunked,
    full,
    ids,
    map_multiset,
    snapshot,
    swa,
)
from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from kvplugin.core.blocks import (
    KVCacheBlock,
    make_block_hash_with_group_id,
    null_head_len,
    trim_null_head,
)
from kvplugin.core.events import AllBlocksCleared
from kvplugin.core.hashing import resolve_block_hashes
from kvplugin.core.request import Request
from kvplugin.core.single_type.full import FullAttentionManager
from kvplugin.core.single_type.sliding_window import (
    SlidingWindowManager,
    contiguous_blocks_for_hit,
)
from kvplugin.core.specs import ChunkedLocalAttentionSpec, SlidingWindowSpec

MAX_MODEL_LEN = 256
MAX_TOKENS = 80  # a request finishes once it grows past this
ALPHABET = st.integers(0, 2)
PREFIXES = ([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2], [1] * 20, [2, 2, 0, 0, 1, 1, 2, 2, 0])
STATE_SETTINGS = settings(max_examples=80, stateful_step_count=50, deadline=None)


class ManagerMachine(RuleBasedStateMachine):
    layout: ClassVar[dict[str, Any]] = {}

    @initialize()
    def build(self) -> None:
        self.c = Core(max_model_len=MAX_MODEL_LEN, **self.layout)
        self.m = self.c.manager
        self.pool = self.m.block_pool
        self.managers = self.m.coordinator.single_type_managers
        self.waiting: list[str] = []
        self.running: list[str] = []
        self.reqs: dict[str, Request] = {}
        self.next_id = 0
        self.shadow: Counter[tuple[int, int]] = Counter()
        self.stats = [0, 0, 0, 0, 0, 0]  # requests, queries, hits, preempted_*
        self.stats_reset = False
        self.hybrid = len(self.managers) > 1

    # ------------------------------------------------------------------ helpers
    def drain(self) -> list[Any]:
        events = self.m.take_events()
        apply_events(self.shadow, events)
        return events

    def live(self) -> list[Request]:
        return list(self.reqs.values())

    def align(self) -> int:
        return self.c.sbs

    def cacheable(self, n: int) -> int:
        return n // self.c.sbs * self.c.sbs if self.hybrid else n

    def num_cached(self, rid: str) -> list[int]:
        return [m.num_cached_block.get(rid, 0) for m in self.managers]

    def expected_num_cached(self, req: Request, before: list[int], target: int) -> list[int]:
        """A4: after caching up to ``target`` tokens, every group has registered its full
        blocks up to the hashed length (sparse masks skip registrations, not the count)."""
        hashed = len(req.block_hashes) * self.c.hbs
        n = min(self.cacheable(target), hashed)
        return [max(b, n // m.block_size) for b, m in zip(before, self.managers, strict=True)]

    def expected_free_queue(self, calls: list[list[KVCacheBlock]]) -> list[int]:
        """H4 / A7: simulate ``free_blocks`` calls on the current queue."""
        queue = self.c.free_ids()
        ref = {b.block_id: b.ref_cnt for b in self.pool.blocks}
        for call in calls:
            first: list[int] = []
            last: list[int] = []
            for b in call:
                if b.is_null:
                    continue
                ref[b.block_id] -= 1
                if ref[b.block_id] == 0:
                    (last if b.block_hash is not None else first).append(b.block_id)
            queue = first + queue + last
        return queue

    def check_lookup(self, req: Request, blocks: Any, n: int) -> None:
        """L2-L5, L7 on a ``get_computed_blocks`` result."""
        if req.skip_reading_prefix_cache:
            assert blocks is self.m.empty_kv_cache_blocks and n == 0
            return
        assert 0 <= n <= req.num_tokens - 1  # L2
        assert n % self.align() == 0  # L3
        if n == 0:
            assert blocks is self.m.empty_kv_cache_blocks
        cmap = self.pool.cached_block_hash_to_block
        for gid, (m, lst) in enumerate(zip(self.managers, blocks.blocks, strict=True)):
            bs = m.block_size
            assert len(lst) == cdiv(n, bs)  # L4
            view = resolve_block_hashes(req.block_hashes, self.c.hbs, bs)
            seen_real = False
            for i, b in enumerate(lst):
                if b.is_null:
                    assert not seen_real, "a null placeholder after a real hit block"
                    assert not isinstance(m, FullAttentionManager)
                    continue
                seen_real = True
                # L5: the hit is the cached block of its prefix hash, the first inserted
                # one when identical content was cached twice.
                assert b is cmap.blocks_under(make_block_hash_with_group_id(view[i], gid))[0]
            if isinstance(m, SlidingWindowManager) and lst:  # L7
                spec = m.kv_cache_spec
                assert isinstance(spec, SlidingWindowSpec)
                need = contiguous_blocks_for_hit(spec.sliding_window, bs, False)
                real = [not b.is_null for b in lst]
                assert all(real) or (len(lst) >= need and all(real[-need:]))
        if not self.hybrid and isinstance(self.managers[0], FullAttentionManager):
            # L5 maximality (unitary full attention): the next block is not cached.
            bs = self.managers[0].block_size
            k = n // bs
            if k < min((req.num_tokens - 1) // bs, len(req.block_hashes)):
                assert cmap.get_one_block(
                    make_block_hash_with_group_id(req.block_hashes[k], 0)) is None

    def check_window(self, rid: str, basis: int, before: list[int] | None) -> None:
        """Window release (spec 3.3/3.4, E15): a windowed table is a run of null blocks
        covering the blocks every token of which is out of the window of token ``basis``,
        then real blocks.  ``before`` (running requests): the null runs before the call."""
        tables = self.m.coordinator.get_blocks(rid)
        for g, (m, table) in enumerate(zip(self.managers, tables, strict=True)):
            nulls = null_head_len(table)
            assert not any(b.is_null for b in table[nulls:]), "null block after a real one"
            spec = m.kv_cache_spec
            if isinstance(spec, SlidingWindowSpec):
                dead = max(0, basis - spec.sliding_window + 1)
            elif isinstance(spec, ChunkedLocalAttentionSpec):
                dead = basis // spec.attention_chunk_size * spec.attention_chunk_size
            else:
                assert nulls == 0
                continue
            want = min(dead // m.block_size, len(table))
            if before is None:
                assert nulls >= want, (g, nulls, want)
            else:
                assert nulls == max(before[g], want), (g, nulls, before[g], want)

    def null_runs(self, rid: str) -> list[int]:
        return [null_head_len(t) for t in self.m.coordinator.get_blocks(rid)]

    def forget(self, rid: str) -> None:
        self.reqs.pop(rid)
        if rid in self.running:
            self.running.remove(rid)
        if rid in self.waiting:
            self.waiting.remove(rid)

    def assert_forgotten(self, rid: str) -> None:  # A6
        assert all(len(t) == 0 for t in self.m.coordinator.get_blocks(rid))
        assert all(rid not in m.num_cached_block for m in self.managers)

    # ------------------------------------------------------------------ rules
    @rule(prompts=st.lists(st.tuples(st.integers(0, len(PREFIXES)),
                                     st.lists(ALPHABET, max_size=28)), min_size=1, max_size=3),
          salt=st.sampled_from([None, None, None, "s"]),
          skip_read=st.sampled_from([False] * 7 + [True]))
    def add_requests(self, prompts: list[tuple[int, list[int]]], salt: str | None,
                     skip_read: bool) -> None:
        for prefix, suffix in prompts:
            tokens = (list(PREFIXES[prefix]) if prefix < len(PREFIXES) else []) + suffix
            rid = f"r{self.next_id}"
            self.next_id += 1
            self.reqs[rid] = self.c.request(rid, tokens or [0], cache_salt=salt,
                                            skip_reading_prefix_cache=skip_read)
            self.waiting.append(rid)
            skip_read = False

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def schedule(self, data: st.DataObject) -> None:
        """One scheduler pass: every running request steps (a failure preempts it), then
        waiting requests are admitted first-come-first-served until one does not fit."""
        self.m.new_step_starts()
        for rid in list(self.running):
            if rid in self.running:
                self.step_request(rid, data)
                self.invariants_hold()
        for rid in list(self.waiting):
            admitted = self.admit_request(rid, data)
            self.invariants_hold()
            if not admitted:
                break

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def admit(self, data: st.DataObject) -> None:
        self.admit_request(data.draw(st.sampled_from(self.waiting)), data)

    def admit_request(self, rid: str, data: st.DataObject) -> bool:
        req = self.reqs[rid]
        m = self.m
        before = snapshot(m, self.reqs)
        blocks, n, boundary = m.get_computed_blocks(req)
        assert snapshot(m, self.reqs) == before  # L1: lookups are read-only
        self.check_lookup(req, blocks, n)
        req.shared_prefix_boundary = boundary

        chunk = data.draw(st.sampled_from([4, 8, 16, 1000]), label="chunk")
        num_new = min(req.num_tokens - n, chunk)
        lookahead = data.draw(st.sampled_from([0, 0, 0, 1, 3]), label="lookahead")
        gate = data.draw(st.booleans(), label="full_sequence_must_fit")
        has_sched = bool(self.running)
        local = req.num_computed_tokens + n
        assert req.num_computed_tokens == 0
        total = min(local, MAX_MODEL_LEN)
        main = total + num_new
        slots = min(main + lookahead, MAX_MODEL_LEN)
        coord = m.coordinator
        need = coord.get_num_blocks_to_allocate(rid, slots, blocks.blocks, 0, local, local, main)
        full_n = min(req.num_tokens, MAX_MODEL_LEN)
        need_full = coord.get_num_blocks_to_allocate(rid, full_n, blocks.blocks, 0, total, local,
                                                     full_n, apply_admission_cap=True)
        wm = m.watermark_blocks if has_sched else 0  # WAITING or PREEMPTED here
        free0 = self.c.num_free()
        queue0 = self.c.free_ids()
        adopted: set[int] = set()
        skipped = [mm.get_num_skipped_tokens(local) // mm.block_size for mm in self.managers]
        for s, lst in zip(skipped, blocks.blocks, strict=True):
            adopted.update(b.block_id for b in lst[s:] if not b.is_null)
        ncb_pre = [0] * len(self.managers) if blocks is m.empty_kv_cache_blocks else [
            max(s, len(lst)) for s, lst in zip(skipped, blocks.blocks, strict=True)]

        out = m.allocate_slots(req, num_new, n, blocks, num_lookahead_tokens=lookahead,
                               full_sequence_must_fit=gate, has_scheduled_reqs=has_sched)
        event("admit: " + ("no room" if out is None else "hit" if n else "miss"))
        if out is None:
            # A1: nothing adopted, nothing allocated (a new request has no window to free).
            assert snapshot(m, self.reqs) == before
            # A9 (converse): it really did not fit.
            assert need + wm > free0 or (gate and need_full + wm > free0)
            return False
        assert need + wm <= free0 and (not gate or need_full + wm <= free0)  # A9
        assert free0 - self.c.num_free() == need  # A2: the predictor is exact
        # P9: fresh blocks come from the head of the queue (after the hits left it).
        fresh = [b for g in out.blocks for b in g]
        assert ids(fresh) == [i for i in queue0 if i not in adopted][:len(fresh)]
        tables = m.coordinator.get_blocks(rid)
        for mm, t in zip(self.managers, tables, strict=True):
            assert len(t) >= cdiv(slots, mm.block_size)  # A3
        target = min(total + num_new, req.num_tokens)
        assert self.num_cached(rid) == self.expected_num_cached(req, ncb_pre, target)  # A4
        self.check_window(rid, total, None)

        if not req.skip_reading_prefix_cache:
            m.record_prefix_cache_stats(req, n)
            k = 3 if req.num_preemptions else 0
            self.stats[k] += 1
            self.stats[k + 1] += req.num_tokens
            self.stats[k + 2] += n
        req.status = RequestStatus.RUNNING
        self.waiting.remove(rid)
        self.running.append(rid)
        self.advance(req, n + num_new, data)
        return True

    def advance(self, req: Request, computed: int, data: st.DataObject, drafts: int = 0) -> None:
        """The step ran: computed tokens advance; at the end of the sequence tokens are
        sampled (accepted drafts + one bonus token)."""
        if computed >= req.num_tokens:
            accepted = data.draw(st.integers(0, drafts), label="accepted")
            end = req.num_tokens
            req.append_output_token_ids(data.draw(
                st.lists(ALPHABET, min_size=accepted + 1, max_size=accepted + 1)))
            req.num_computed_tokens = end + accepted
        else:
            req.num_computed_tokens = computed
        if req.num_tokens > MAX_TOKENS:
            self.finish_request(req.request_id)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        self.step_request(data.draw(st.sampled_from(self.running)), data)

    def step_request(self, rid: str, data: st.DataObject) -> None:
        req = self.reqs[rid]
        m = self.m
        c0, t0 = req.num_computed_tokens, req.num_tokens
        chunk = data.draw(st.sampled_from([1, 4, 16, 1000]), label="chunk")
        n_real = min(t0 - c0, chunk)
        drafts = data.draw(st.integers(0, 2), label="drafts") if c0 + n_real == t0 else 0
        lookahead = data.draw(st.sampled_from([0, 0, 1, 2]), label="lookahead")
        total = min(c0, MAX_MODEL_LEN)
        main = total + n_real + drafts
        slots = min(main + lookahead, MAX_MODEL_LEN)
        pre_removed = data.draw(st.booleans(), label="pre_removed")
        if pre_removed:
            m.remove_skipped_blocks(rid, max(0, total - req.num_in_flight_tokens),
                                    req.num_prompt_tokens)
            check_invariants(m, self.live())
        before = snapshot(m, self.reqs)
        free0 = self.c.num_free()
        queue0 = self.c.free_ids()
        need = m.coordinator.get_num_blocks_to_allocate(rid, slots, ((),) * len(self.managers),
                                                        0, c0, c0, main)
        ncb_pre = self.num_cached(rid)
        runs = self.null_runs(rid)
        out = m.allocate_slots(req, n_real + drafts, num_lookahead_tokens=lookahead)
        event("step: " + ("no room" if out is None else f"{len(fresh_ids(out))} new"))
        if out is None:
            if pre_removed:
                assert snapshot(m, self.reqs) == before  # A1
            assert need > free0
            self.preempt_request(rid)  # the scheduler's answer to "no room"
            return
        fresh = [b for g in out.blocks for b in g]
        assert len(fresh) == need  # A2 (running requests: no hits to adopt)
        if pre_removed:  # otherwise the window release inside the call added capacity
            assert need <= free0  # A9
            assert free0 - self.c.num_free() == need
            assert ids(fresh) == queue0[:need]  # P9
        for mm, t in zip(self.managers, m.coordinator.get_blocks(rid), strict=True):
            assert len(t) >= cdiv(slots, mm.block_size)  # A3
        target = min(total + n_real + drafts, req.num_tokens)
        assert self.num_cached(rid) == self.expected_num_cached(req, ncb_pre, target)  # A4
        self.check_window(rid, total, runs)
        self.advance(req, c0 + n_real, data, drafts)

    def preempt_request(self, rid: str) -> None:
        req = self.reqs[rid]
        expected = self.expected_free_queue(
            [list(reversed(t)) for t in self.m.coordinator.get_blocks(rid)])
        self.m.free(req)
        assert self.c.free_ids() == expected  # A7
        self.assert_forgotten(rid)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_in_flight_tokens = 0
        req.num_preemptions += 1
        self.running.remove(rid)
        self.waiting.append(rid)

    def finish_request(self, rid: str, pop: bool = False) -> None:
        req = self.reqs[rid]
        tables = self.m.coordinator.get_blocks(rid)
        req.status = RequestStatus.FINISHED_STOPPED
        if pop:
            blocks = self.m.pop_blocks_for_free(req)
            # Groups concatenated in order, each without its leading null run.
            assert ids(blocks) == [b.block_id for t in tables for b in trim_null_head(t)]
            expected = self.expected_free_queue([list(reversed(blocks))])
            self.assert_forgotten(rid)
            self.pool.free_blocks(reversed(blocks))
        else:
            expected = self.expected_free_queue([list(reversed(t)) for t in tables])
            self.m.free(req)
            self.m.free(req)  # a second free is a no-op
            self.assert_forgotten(rid)
        assert self.c.free_ids() == expected  # A7
        self.forget(rid)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def preempt(self, data: st.DataObject) -> None:
        self.preempt_request(data.draw(st.sampled_from(self.running)))

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), pop=st.booleans())
    def finish(self, data: st.DataObject, pop: bool) -> None:
        self.finish_request(data.draw(st.sampled_from(sorted(self.reqs))), pop)

    @rule(data=st.data())
    def evict(self, data: st.DataObject) -> None:
        valid = data.draw(st.sets(st.integers(0, self.pool.num_gpu_blocks - 1), max_size=4))
        before = snapshot(self.m, self.reqs)
        self.m.evict_blocks(valid)
        event(f"evict: {len(self.drain())} removed")
        after = snapshot(self.m, self.reqs)
        assert after["refs"] == before["refs"] and after["free"] == before["free"]
        assert after["tables"] == before["tables"]
        for i in valid:
            b = self.pool.blocks[i]
            assert b.block_hash is None and i not in self.pool.cached_block_hashes_by_block

    @rule()
    def reset(self) -> None:
        in_use = any(b.ref_cnt > 0 for b in self.pool.blocks[1:])
        self.drain()
        queue = self.c.free_ids()
        ok = self.m.reset_prefix_cache()
        event(f"reset: {ok}")
        assert ok is (not in_use)  # H7
        events = self.drain()
        if ok:
            assert events == [AllBlocksCleared()]
            assert len(self.pool.cached_block_hash_to_block) == 0
            assert all(b.block_hash is None for b in self.pool.blocks)
            assert not self.pool.cached_block_hashes_by_block
            assert self.c.free_ids() == queue
            self.stats_reset = True
        else:
            assert events == []

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def cache_blocks(self, data: st.DataObject) -> None:
        rid = data.draw(st.sampled_from(self.running))
        req = self.reqs[rid]
        n = data.draw(st.integers(0, req.num_computed_tokens), label="n")
        before = self.num_cached(rid)
        self.m.cache_blocks(req, n)
        assert self.num_cached(rid) == self.expected_num_cached(req, before, n)

    @rule()
    def new_step(self) -> None:
        self.m.new_step_starts()

    @rule()
    def take_stats(self) -> None:
        s = self.m.make_prefix_cache_stats()
        assert s is not None
        got = [s.requests, s.queries, s.hits, s.preempted_requests, s.preempted_queries,
               s.preempted_hits]
        assert got == self.stats
        assert s.reset is self.stats_reset
        self.stats = [0] * 6
        self.stats_reset = False

    @invariant()
    def invariants_hold(self) -> None:
        if not hasattr(self, "c"):
            return
        check_invariants(self.m, self.live())
        self.drain()
        # The event stream describes the prefix-cache map exactly.
        assert self.shadow == map_multiset(self.pool)


def fresh_ids(out: Any) -> list[int]:
    return [b.block_id for g in out.blocks for b in g]


def machine(name: str, **layout: Any) -> type[ManagerMachine]:
    return STATE_SETTINGS(type(name, (ManagerMachine,), {"layout": layout}))


FullMachine = machine("FullMachine", groups=[full(4)], block_size=4, num_blocks=32,
                      watermark=0.1)
FullSwaMachine = machine("FullSwaMachine", groups=[full(8), swa(4, 4)], num_blocks=40)
FullTwoSwaMachine = machine("FullTwoSwaMachine", groups=[full(4), swa(8, 4), swa(12, 4)],
                            num_blocks=64)
FullSameSwaMachine = machine("FullSameSwaMachine", groups=[full(4), swa(6, 4), swa(6, 4)],
                             num_blocks=56)
FullChunkedMachine = machine("FullChunkedMachine", groups=[full(4), chunked(8, 4)],
                             num_blocks=48)

# Generation takes ~25 s for all layouts; shrinking a failure can take Hypothesis up to
# five minutes, so the timeout leaves room for the report.
_slow_on_failure = pytest.mark.timeout(900)
TestFullAttention = _slow_on_failure(FullMachine.TestCase)
TestFullPlusSlidingWindowMixedBlockSizes = _slow_on_failure(FullSwaMachine.TestCase)
TestFullPlusTwoSlidingWindows = _slow_on_failure(FullTwoSwaMachine.TestCase)
TestFullPlusTwoEqualSlidingWindows = _slow_on_failure(FullSameSwaMachine.TestCase)
TestFullPlusChunkedLocal = _slow_on_failure(FullChunkedMachine.TestCase)
