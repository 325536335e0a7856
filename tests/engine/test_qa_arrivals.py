"""LMCache's multi-round QA arrival rule through the engine (``serve(..., stop_at_s=,
on_result=)``), in simulated time so every send time is exact: a user's rounds at most one
every ``gap_s``, never before the previous answer is done, nothing sent at or after the stop.

A request's send time is its result's finish time (``on_result``'s ``t``) minus its
``latency_s``: the engine's ``Result.latency_s`` is the finish minus the time it was added,
and the client adds it the moment it sends."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from engine_testlib import small_config

from kvplugin.engine.report import RunReport
from kvplugin.engine.run import serve
from kvplugin.engine.scheduler import Result
from kvplugin.engine.workload import MultiRoundQA, RequestSpec, multi_round_qa

pytestmark = pytest.mark.asyncio
EXACT = 1e-9  # the clock's floats: a finish minus a latency is the send up to rounding


def shape(**changes: object) -> MultiRoundQA:
    base: dict[str, object] = {"system_prompt_len": 8, "history_len": 12, "question_len": 4,
                               "answer_len": 4, "num_tenants": 2, "seed": 5}
    return MultiRoundQA(**{**base, **changes})  # type: ignore[arg-type]


@dataclass
class Run:
    specs: list[RequestSpec]
    report: RunReport
    sent: dict[str, float] = field(default_factory=dict)
    done: dict[str, float] = field(default_factory=dict)

    def by_id(self) -> dict[str, RequestSpec]:
        return {s.request_id: s for s in self.specs}


async def run(qa: MultiRoundQA, *, prefill_ms: float, decode_ms: float,
              stop_at_s: float | None) -> Run:
    specs = multi_round_qa(qa)
    sent: dict[str, float] = {}
    done: dict[str, float] = {}

    def on_result(res: Result, t: float) -> None:
        assert res.request_id not in done
        done[res.request_id] = t
        sent[res.request_id] = t - res.latency_s

    cfg = small_config(engine={"deterministic": True, "prefill_token_ms": prefill_ms,
                               "decode_step_ms": decode_ms})
    rep = await serve(cfg, specs=specs, stop_at_s=stop_at_s, on_result=on_result)
    assert rep.failed == 0 and rep.kv_mismatches == 0 and rep.leaked_blocks == 0
    return Run(specs, rep, sent, done)


# users=4, rounds=3, qps=1: gap 4 s, a new user every 2 s (u0-u4 at 0, 2, 4, 6, 8 < 9);
# pre-seeded p1 (round 2 at 2 s), p3 (rounds 1, 2 from 2 s), p2 (round 2 at 4 s).
OPEN = shape(users=4, rounds=3, qps=1.0, duration_s=9.0)
# With the stop at 8 s: what an open loop sends before it (8 s itself is too late).
OPEN_SENT = {"u0r0": 0.0, "u0r1": 4.0, "p1r2": 2.0, "p3r1": 2.0, "p3r2": 6.0, "u1r0": 2.0,
             "u1r1": 6.0, "p2r2": 4.0, "u2r0": 4.0, "u3r0": 6.0}


async def open_loop() -> Run:
    # A tiny model: an answer takes a few simulated milliseconds, far under the 4 s gap.
    return await run(OPEN, prefill_ms=0.01, decode_ms=1.0, stop_at_s=8.0)


async def test_below_saturation_a_users_rounds_are_sent_exactly_gap_s_apart() -> None:
    r = await open_loop()
    assert r.sent == pytest.approx(OPEN_SENT, abs=EXACT)
    by_id = r.by_id()
    for rid, t in r.sent.items():
        spec = by_id[rid]
        assert 0 < r.done[rid] - t < 0.05, "an answer takes milliseconds here"
        if spec.after is None:
            assert t == pytest.approx(spec.at_s, abs=EXACT)  # at its start time
        else:
            assert spec.gap_s == OPEN.gap_s == 4.0
            assert t - r.sent[spec.after] == pytest.approx(4.0, abs=EXACT)
            assert t > r.done[spec.after] + 3.9  # the gap, not the answer, set the time


async def test_nothing_is_sent_at_or_after_the_stop_nor_an_unsent_rounds_children() -> None:
    r = await open_loop()
    everything = {s.request_id for s in r.specs}
    assert everything - r.sent.keys() == {
        "u0r2", "u2r1", "u4r0",  # due at exactly 8 s
        "u1r2", "u3r1",  # due at 10 s
        "u2r2", "u3r2", "u4r1", "u4r2"}  # children of unsent rounds
    assert max(r.sent.values()) == pytest.approx(6.0, abs=EXACT)
    # What was sent is what the report counts, and its ledger balances.
    rep, by_id = r.report, r.by_id()
    assert rep.requests == rep.finished == len(OPEN_SENT) == 10
    # Round r's prompt is 24 + 8r tokens; the rounds sent add up to 0+1+2+1+2+0+1+2+0+0 = 9.
    assert [OPEN.prompt_len(r) for r in range(3)] == [24, 32, 40]
    assert sum(by_id[rid].prompt_len for rid in OPEN_SENT) == 10 * 24 + 9 * 8 == 312
    assert rep.prompt_tokens == 312 == rep.extra["workload_prompt_tokens"]
    assert rep.extra["workload"] == {"chat": 7, "follow_up": 3}
    assert rep.ledger_errors() == []


async def test_above_saturation_a_round_is_sent_when_the_previous_answer_is_done() -> None:
    # One user, a gap of 0.5 s, answers of 4 tokens at 1 s per decoding step (the first
    # token from the free prefill, then 3 steps): each answer takes 3 s, each round is sent
    # the moment the one before finished; round 2 would be at 6 s, past the stop at 5 s.
    qa = shape(users=1, rounds=3, qps=2.0, duration_s=0.5, num_tenants=1)
    assert qa.gap_s == 0.5
    r = await run(qa, prefill_ms=0.0, decode_ms=1000.0, stop_at_s=5.0)
    assert r.sent == pytest.approx({"u0r0": 0.0, "u0r1": 3.0}, abs=EXACT)
    assert r.done == pytest.approx({"u0r0": 3.0, "u0r1": 6.0}, abs=EXACT)
    assert r.report.requests == 2
    assert r.report.prompt_tokens == qa.prompt_len(0) + qa.prompt_len(1)
    assert r.report.ledger_errors() == []


# users=2, rounds=3, qps=1: gap 2 s, a new user every 2 s (u0-u2 at 0, 2, 4 < 5), p1's last
# round at 2 s; answers of 4 tokens at 1 s per decoding step take 3-4 s, over the gap. Every
# start falls on a step's end, so each first round goes out at its time exactly.
CLOSED = shape(users=2, rounds=3, qps=1.0, duration_s=5.0)
CLOSED_SENT = {"u0r0": 0.0, "u0r1": 3.0, "u0r2": 7.0, "p1r2": 2.0, "u1r0": 2.0, "u1r1": 6.0,
               "u1r2": 10.0, "u2r0": 4.0, "u2r1": 8.0, "u2r2": 12.0}


async def test_above_saturation_every_users_loop_closes_on_its_answers() -> None:
    assert CLOSED.starts() == [("u0", 0, 0.0), ("p1", 2, 2.0), ("u1", 0, 2.0), ("u2", 0, 4.0)]
    r = await run(CLOSED, prefill_ms=0.0, decode_ms=1000.0, stop_at_s=None)
    assert r.sent == pytest.approx(CLOSED_SENT, abs=EXACT)
    by_id = r.by_id()
    follow_ups = [s for s in r.specs if s.after is not None]
    assert len(follow_ups) == 6 and all(s.gap_s == 2.0 for s in follow_ups)
    for s in follow_ups:
        parent = s.after
        assert parent is not None
        assert r.done[parent] - r.sent[parent] > CLOSED.gap_s  # saturated
        assert r.sent[s.request_id] == pytest.approx(r.done[parent], abs=EXACT)
    for rid, t in r.sent.items():
        if by_id[rid].after is None:
            assert t == pytest.approx(by_id[rid].at_s, abs=EXACT)
    assert r.report.requests == 10
    assert r.report.prompt_tokens == sum(s.prompt_len for s in r.specs) \
        == 3 * 24 + 3 * 32 + 4 * 40
    assert r.report.ledger_errors() == []


async def test_a_closed_loop_stop_cuts_the_rest_of_each_conversation() -> None:
    # The run above, stopped at 8 s: u2r1 was due at 8 s exactly, u1r2 at 10 s; u2r2 is the
    # child of an unsent round. What is sent goes out as without the stop.
    r = await run(CLOSED, prefill_ms=0.0, decode_ms=1000.0, stop_at_s=8.0)
    before = {"u0r0", "u0r1", "u0r2", "p1r2", "u1r0", "u1r1", "u2r0"}
    assert r.sent == pytest.approx({rid: CLOSED_SENT[rid] for rid in before}, abs=EXACT)
    by_id = r.by_id()
    assert r.report.requests == r.report.finished == 7
    assert r.report.prompt_tokens == sum(by_id[rid].prompt_len for rid in before) \
        == 3 * 24 + 2 * 32 + 2 * 40
    assert r.report.ledger_errors() == []


async def test_a_request_due_during_a_simulated_step_counts_its_wait_for_that_step() -> None:
    # "b" is due at 0.5 s while "a"'s one-second decode step runs: its client wakes at the
    # step's end, but it was sent at 0.5 and its first token counts from then (a GPU
    # engine's request waits for the step in flight too).
    specs = [RequestSpec("a", "tenant0", "chat", 0.0, tuple(range(1, 9)), 4, 8),
             RequestSpec("b", "tenant0", "chat", 0.5, tuple(range(100, 108)), 4, 8)]
    cfg = small_config(engine={"deterministic": True, "prefill_token_ms": 0.0,
                               "decode_step_ms": 1000.0})
    got: dict[str, tuple[float, Result]] = {}
    await serve(cfg, specs=specs, on_result=lambda r, t: got.__setitem__(r.request_id, (t, r)))
    t, b = got["b"]
    assert t - b.latency_s == pytest.approx(0.5, abs=EXACT)
    assert b.ttft_s == pytest.approx(1.5, abs=EXACT)  # 0.5 waiting for the step, then its own
