"""The benchmark workloads: multi-round QA (LMCache's arrival rule) and no-reuse, as specs
and served end to end on the engine. The arrival rule through the engine's clock:
``test_qa_arrivals.py``."""

from __future__ import annotations

import dataclasses
import math

import pytest
from engine_testlib import small_config

from kvplugin.engine.run import serve
from kvplugin.engine.workload import (
    Finished,
    MultiRoundQA,
    RequestSpec,
    _text,
    build_prompt,
    multi_round_qa,
    no_reuse,
    warm_up_tokens,
)

# gap_s = 4 / 2 = 2.0, join_s = (5 - 1) / 2 = 2.0; users join at 0, 2, 4, 6 (< 7).
SMALL = MultiRoundQA(users=4, rounds=5, qps=2.0, duration_s=7.0, system_prompt_len=20,
                     history_len=30, question_len=5, answer_len=7, num_tenants=2, seed=1)


def _prompts(specs: list[RequestSpec], answer_len: int) -> dict[str, list[int]]:
    """Every spec's prompt, with made-up answers of ``answer_len`` tokens (id-dependent)."""
    done: dict[str, Finished] = {}
    out: dict[str, list[int]] = {}
    for s in specs:  # user by user, round by round: a parent always comes first
        out[s.request_id] = build_prompt(s, done)
        done[s.request_id] = Finished(tuple(out[s.request_id]), _answer(s.request_id, answer_len))
    return out


def _answer(rid: str, n: int) -> tuple[int, ...]:
    return tuple(90_000 + 100 * sum(map(ord, rid)) + i for i in range(n))


def _with(shape: MultiRoundQA, **changes: object) -> MultiRoundQA:
    return dataclasses.replace(shape, **changes)


# --------------------------------------------------------------------------- the arrival rule


def test_gap_and_join_follow_users_rounds_and_qps() -> None:
    assert (SMALL.gap_s, SMALL.join_s) == (2.0, 2.0)
    other = _with(SMALL, users=10, rounds=10, qps=0.5)
    assert (other.gap_s, other.join_s) == (20.0, 18.0)
    assert SMALL.working_set_tokens == 4 * (SMALL.prompt_len(4) + 7)
    assert [SMALL.prompt_len(r) for r in range(5)] == [55, 67, 79, 91, 103]


def test_pre_seeded_users_start_where_lmcaches_ramp_up_puts_them() -> None:
    # users=4, rounds=5, qps=2: gap 2 s, a life of 4 gaps. User i is 4 * (4 - i) / 4 gaps
    # into its life: p1 3 gaps (4 rounds done, next at (4 - 3) gaps = 2 s), p2 2 gaps (3
    # done, 2 s), p3 1 gap (2 done, 2 s); p0 would be 4 gaps in, all 5 rounds done: absent.
    assert SMALL.starts() == [("u0", 0, 0.0), ("p1", 4, 2.0), ("p2", 3, 2.0), ("p3", 2, 2.0),
                              ("u1", 0, 2.0), ("u2", 0, 4.0), ("u3", 0, 6.0)]
    # users=4, rounds=3, qps=1: gap 4 s, life 2 gaps, join every 2 s. p1: 1.5 gaps in, 2
    # done, next (2 - 1.5) * 4 = 2 s; p2: 1 gap, 2 done, 4 s; p3: 0.5 gap, 1 done, 2 s.
    shape = _with(SMALL, users=4, rounds=3, qps=1.0, duration_s=5.0)
    assert shape.starts() == [("u0", 0, 0.0), ("p1", 2, 2.0), ("p3", 1, 2.0), ("u1", 0, 2.0),
                              ("p2", 2, 4.0), ("u2", 0, 4.0)]
    # users=3, rounds=3, qps=1: gap 3 s, life 2 gaps. p1: 4/3 gaps in, 2 done, next at
    # (2 - 4/3) * 3 = 2 s; p2: 2/3 gap in, 1 done, next at 1 s.
    shape = _with(SMALL, users=3, rounds=3, qps=1.0, duration_s=5.0)
    assert shape.starts() == [("u0", 0, 0.0), ("p2", 1, 1.0), ("p1", 2, 2.0), ("u1", 0, 2.0),
                              ("u2", 0, 4.0)]
    # One user: nobody is pre-seeded (gap 0.5 s; still a new user every 4 / 2 = 2 s).
    assert _with(SMALL, users=1, duration_s=5.0).starts() == [("u0", 0, 0.0), ("u1", 0, 2.0),
                                                              ("u2", 0, 4.0)]


@pytest.mark.parametrize("users,rounds,qps", [(10, 10, 0.7), (7, 4, 3.0), (5, 6, 1.3),
                                              (3, 2, 10.0)])
def test_pre_seeded_starts_match_lmcaches_own_arithmetic(users: int, rounds: int,
                                                         qps: float) -> None:
    # LMCache's UserSessionManager._ramp_up and UserSession.set_internal_state, in floats.
    gap = users / qps
    between_users = gap * (rounds - 1) / users
    want = []
    for i in range(users):
        offset = users * between_users - i * between_users
        passed = int(offset / gap + 1e-9) + 1
        if passed < rounds:  # LMCache's user is finished at once otherwise
            want.append((f"p{i}", passed, passed * gap - offset))
    want.sort(key=lambda x: round(x[2], 9))  # in time order, ties by user (a stable sort)
    shape = MultiRoundQA(users=users, rounds=rounds, qps=qps, duration_s=1e-3)
    got = [s for s in shape.starts() if s[0].startswith("p")]
    assert [(n, r) for n, r, _ in got] == [(n, r) for n, r, _ in want]
    assert [t for *_, t in got] == pytest.approx([t for *_, t in want], abs=1e-9)
    assert "p0" not in {n for n, *_ in got}
    assert all(0 < t <= gap * (1 + 1e-12) for *_, t in got)  # in (0, gap_s]
    assert [s for s in shape.starts() if not s[0].startswith("p")] == [("u0", 0, 0.0)]


def test_users_join_every_join_s_strictly_before_the_duration() -> None:
    def joins(shape: MultiRoundQA) -> list[tuple[str, int, float]]:
        return [s for s in shape.starts() if s[0].startswith("u")]

    assert joins(_with(SMALL, duration_s=6.0)) == [("u0", 0, 0.0), ("u1", 0, 2.0),
                                                   ("u2", 0, 4.0)]  # 6.0 is not < 6.0
    assert joins(_with(SMALL, duration_s=6.5)) == [*joins(_with(SMALL, duration_s=6.0)),
                                                   ("u3", 0, 6.0)]
    assert joins(_with(SMALL, duration_s=0.1)) == [("u0", 0, 0.0)]
    # join_s = 3 / 0.75 = 4 s.
    shape = _with(SMALL, rounds=4, qps=0.75, duration_s=12.0)
    assert joins(shape) == [("u0", 0, 0.0), ("u1", 0, 4.0), ("u2", 0, 8.0)]


# --------------------------------------------------------------------------- the specs


def test_specs_are_each_users_rounds_in_start_order() -> None:
    specs = multi_round_qa(SMALL)
    rounds = {"u0": 0, "p1": 4, "p2": 3, "p3": 2, "u1": 0, "u2": 0, "u3": 0}
    assert [s.request_id for s in specs] == [f"{u}r{r}" for u, first in rounds.items()
                                             for r in range(first, 5)]
    starts = {u: (tenant, at) for u, tenant, at in [
        ("u0", "tenant0", 0.0), ("p1", "tenant1", 2.0), ("p2", "tenant0", 2.0),
        ("p3", "tenant1", 2.0), ("u1", "tenant0", 2.0), ("u2", "tenant1", 4.0),
        ("u3", "tenant0", 6.0)]}  # tenants round robin over the users in start order
    for s in specs:
        user, r = s.request_id.split("r")[0], int(s.request_id.split("r")[1])
        tenant, at = starts[user]
        assert (s.tenant, s.max_tokens, s.prompt_len, s.think_s) == (tenant, 7,
                                                                     SMALL.prompt_len(r), 0.0)
        assert (s.prefix_group, s.shared_prefix_tokens, s.cache_salt, s.lora) == (None, 0, None,
                                                                                 None)
        if r == rounds[user]:
            assert (s.kind, s.at_s, s.after, s.gap_s) == ("chat", at, None, 0.0)
            assert len(s.new_tokens) == SMALL.prompt_len(r)
        else:
            assert (s.kind, s.at_s, s.after, s.gap_s) == ("follow_up", 0.0, f"{user}r{r - 1}",
                                                          2.0)
            assert len(s.new_tokens) == 5


def test_each_round_resends_the_conversation_plus_a_new_question() -> None:
    specs = multi_round_qa(SMALL)
    prompts = _prompts(specs, SMALL.answer_len)
    by_id = {s.request_id: s for s in specs}
    for s in specs:
        r = int(s.request_id.split("r")[1])
        assert len(prompts[s.request_id]) == s.prompt_len == SMALL.prompt_len(r)
        if s.after is None:
            continue
        parent = prompts[s.after]
        assert prompts[s.request_id] == [*parent, *_answer(s.after, 7), *by_id[s.request_id]
                                         .new_tokens]
        assert prompts[s.request_id][-5:] != parent[-5:]  # a new question each round


def test_a_pre_seeded_first_prompt_carries_made_up_earlier_rounds() -> None:
    # p2 starts at round 3: system prompt, history, then 3 x (question, answer), a question.
    specs = {s.request_id: s for s in multi_round_qa(SMALL)}
    got = specs["p2r3"].new_tokens

    def text(*what: object, n: int) -> tuple[int, ...]:
        return _text(1, *what, n=n, vocab=32000)

    want = (*text("system", "tenant0", n=20), *text("history", "p2", n=30))
    for r in range(3):
        want += (*text("question", "p2", r, n=5), *text("answer", "p2", r, n=7))
    assert got == (*want, *text("question", "p2", 3, n=5))
    assert specs["p2r4"].new_tokens == text("question", "p2", 4, n=5)
    # u0's first round has no earlier round in it.
    assert specs["u0r0"].new_tokens == (*text("system", "tenant0", n=20),
                                        *text("history", "u0", n=30),
                                        *text("question", "u0", 0, n=5))


def test_one_system_prompt_per_tenant_one_history_per_user() -> None:
    prompts = _prompts(multi_round_qa(SMALL), SMALL.answer_len)
    firsts = {"u0": "u0r0", "p1": "p1r4", "p2": "p2r3", "p3": "p3r2", "u1": "u1r0",
              "u2": "u2r0", "u3": "u3r0"}
    system = {u: tuple(prompts[rid][:20]) for u, rid in firsts.items()}
    history = {u: tuple(prompts[rid][20:50]) for u, rid in firsts.items()}
    assert system["u0"] == system["p2"] == system["u1"] == system["u3"]  # tenant0
    assert system["p1"] == system["p3"] == system["u2"]  # tenant1
    assert system["u0"] != system["p1"]
    assert len(set(history.values())) == 7
    # Every later round of a user starts with its first round's prompt.
    for s in multi_round_qa(SMALL):
        user = s.request_id.split("r")[0]
        assert prompts[s.request_id][:SMALL.prompt_len(0) - 5] == prompts[firsts[user]][:50]


def test_group_members_share_one_system_prompt_and_declare_it() -> None:
    shape = _with(SMALL, num_tenants=3)
    specs = multi_round_qa(shape, tenants=["acme", "globex", "initech"],
                           prefix_groups={"g": ["acme", "globex"]})
    prompts = _prompts(specs, shape.answer_len)
    tenant = {s.request_id: s.tenant for s in specs}
    assert [tenant[rid] for rid in ("u0r0", "p1r4", "p2r3", "p3r2", "u1r0", "u2r0", "u3r0")] \
        == ["acme", "globex", "initech", "acme", "globex", "initech", "acme"]
    assert prompts["u0r0"][:20] == prompts["p1r4"][:20] == prompts["p3r2"][:20]
    assert prompts["u0r0"][:20] != prompts["p2r3"][:20] == prompts["u2r0"][:20]
    for s in specs:
        member = s.tenant != "initech"
        assert (s.prefix_group, s.shared_prefix_tokens) == (("g", 20) if member else (None, 0))
    # Without the group, acme and globex have system prompts of their own.
    alone = _prompts(multi_round_qa(shape, tenants=["acme", "globex", "initech"]), 7)
    assert alone["u0r0"][:20] != alone["p1r4"][:20]


def test_multi_round_qa_is_a_function_of_its_seed() -> None:
    assert multi_round_qa(SMALL) == multi_round_qa(SMALL)
    other = multi_round_qa(_with(SMALL, seed=2))
    assert [s.request_id for s in other] == [s.request_id for s in multi_round_qa(SMALL)]
    assert all(a.new_tokens != b.new_tokens
               for a, b in zip(other, multi_round_qa(SMALL), strict=True))


def test_warm_up_requests_come_first_and_shift_the_rest() -> None:
    cold = multi_round_qa(SMALL)
    warm = multi_round_qa(SMALL, warm_s=3.0)
    heads = {"p1": 4, "p2": 3, "p3": 2}
    assert [s.request_id for s in warm[:3]] == ["p1w", "p2w", "p3w"]
    by_id = {s.request_id: s for s in cold}
    for s, (user, first) in zip(warm[:3], heads.items(), strict=True):
        # The conversation so far: the first round's prompt without its question.
        assert (s.kind, s.at_s, s.after, s.max_tokens) == ("chat", 0.0, None, 1)
        assert s.new_tokens == by_id[f"{user}r{first}"].new_tokens[:-5]
        assert s.prompt_len == len(s.new_tokens) == SMALL.prompt_len(first) - 5
    assert warm[3:] == [dataclasses.replace(s, at_s=s.at_s + 3.0) if s.after is None else s
                        for s in cold]
    assert warm_up_tokens(SMALL) == [SMALL.prompt_len(r) - 5 for r in heads.values()]


@pytest.mark.parametrize("bad", [{"rounds": 1}, {"rounds": 0}, {"rounds": 3.0}, {"qps": 0.0},
                                 {"qps": -1.0}, {"qps": math.nan}, {"duration_s": 0.0},
                                 {"users": 0}, {"users": 1.5}, {"history_len": -1},
                                 {"answer_len": 0}, {"question_len": 0},
                                 {"system_prompt_len": 0}, {"num_tenants": 0}, {"vocab": 1}])
def test_a_bad_shape_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        _with(SMALL, **bad)


def test_the_least_shape_is_accepted() -> None:
    shape = MultiRoundQA(users=1, rounds=2, qps=1.0, duration_s=0.5, history_len=0)
    assert shape.starts() == [("u0", 0, 0.0)]
    assert [s.request_id for s in multi_round_qa(shape)] == ["u0r0", "u0r1"]


# --------------------------------------------------------------------------- no reuse


def test_no_reuse_prompts_share_no_block() -> None:
    specs = no_reuse(300, prompt_len=40, answer_len=3, num_tenants=2, seed=4, vocab=50)
    assert len(specs) == 300 and all(s.at_s == 0 and s.after is None for s in specs)
    assert all(len(s.new_tokens) == s.prompt_len == 40 and s.max_tokens == 3 for s in specs)
    assert len({s.new_tokens[:2] for s in specs}) == 300  # even the first block differs
    assert {s.tenant for s in specs} == {"tenant0", "tenant1"}
    with pytest.raises(ValueError, match="unique"):
        no_reuse(2501, prompt_len=40, answer_len=3, vocab=50)


# --------------------------------------------------------------------------- served


@pytest.mark.asyncio
async def test_multi_round_qa_serves_with_earlier_rounds_back_from_the_tier() -> None:
    # 64 blocks of 4 tokens hold about 3 of the 7 users' conversations: evicted rounds come
    # back from the memory tier, every page checked. Simulated time: the 4 s gaps cost
    # nothing.
    shape = MultiRoundQA(users=4, rounds=3, qps=1.0, duration_s=5.0, system_prompt_len=16,
                         history_len=40, question_len=4, answer_len=4, num_tenants=2, seed=3)
    specs = multi_round_qa(shape)
    assert len(specs) == 13  # u0-u2: 3 rounds each; p1, p2: 1; p3: 2
    out = await serve(small_config(engine={"deterministic": True}), specs=specs)
    assert out.finished == out.requests == 13 and out.failed == 0
    assert out.kv_mismatches == 0 and out.cross_tenant_hits == 0 and out.leaked_blocks == 0
    assert out.tier_hits > 0 and out.extra["pages_checked"] > 0
    assert out.computed_prompt_tokens < out.prompt_tokens == sum(s.prompt_len for s in specs)
    assert out.ledger_errors() == []
