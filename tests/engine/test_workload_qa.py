"""The benchmark workloads: multi-round QA (LMCache's shape) and no-reuse, as specs and
served end to end on the engine."""

from __future__ import annotations

import pytest
from engine_testlib import small_config

from kvplugin.engine.run import serve
from kvplugin.engine.workload import (
    Finished,
    MultiRoundQA,
    RequestSpec,
    build_prompt,
    multi_round_qa,
    no_reuse,
)

SMALL = MultiRoundQA(users=4, rounds=3, system_prompt_len=20, history_len=30, question_len=5,
                     answer_len=7, num_tenants=2, think_s=0.1, user_gap_s=0.2, seed=1)


def _prompts(specs: list[RequestSpec], answer_len: int) -> dict[str, list[int]]:
    """Every spec's prompt, with made-up answers of ``answer_len`` tokens."""
    done: dict[str, Finished] = {}
    out: dict[str, list[int]] = {}
    for s in specs:  # round-major: a parent always comes first
        out[s.request_id] = build_prompt(s, done)
        done[s.request_id] = Finished(tuple(out[s.request_id]),
                                      tuple(range(1, answer_len + 1)))
    return out


def test_multi_round_qa_has_lmcaches_shape() -> None:
    specs = multi_round_qa(SMALL)
    assert [s.request_id for s in specs] == [f"u{u}r{r}" for r in range(3) for u in range(4)]
    by_id = {s.request_id: s for s in specs}
    prompts = _prompts(specs, SMALL.answer_len)
    for s in specs:
        u, r = int(s.request_id[1]), int(s.request_id[3])
        assert s.tenant == f"tenant{u % 2}" and s.max_tokens == 7 and s.at_s == u * 0.2
        assert len(prompts[s.request_id]) == s.prompt_len == 55 + r * 12 == SMALL.prompt_len(r)
        if r == 0:
            assert (s.kind, s.after, s.think_s) == ("chat", None, 0.0)
            continue
        parent = by_id[f"u{u}r{r - 1}"]
        assert (s.kind, s.after, s.think_s) == ("follow_up", parent.request_id, 0.1)
        # The whole conversation so far, resent, then a new question.
        assert prompts[s.request_id][:-5] == [*prompts[parent.request_id], *range(1, 8)]
    p = prompts
    assert p["u0r0"][:20] == p["u2r0"][:20]  # one system prompt per tenant
    assert p["u0r0"][:20] != p["u1r0"][:20]
    assert p["u0r0"][20:50] != p["u2r0"][20:50]  # each user's own history
    assert p["u0r0"][50:] != p["u0r1"][-5:]  # a new question each round
    assert all(s.prefix_group is None and s.shared_prefix_tokens == 0 for s in specs)
    assert SMALL.working_set_tokens == 4 * (55 + 2 * 12 + 7)


def test_multi_round_qa_is_a_function_of_its_seed() -> None:
    assert multi_round_qa(SMALL) == multi_round_qa(SMALL)
    other = multi_round_qa(MultiRoundQA(**{**_fields(SMALL), "seed": 2}))
    assert other[0].new_tokens != multi_round_qa(SMALL)[0].new_tokens


def _fields(shape: MultiRoundQA) -> dict[str, object]:
    return {name: getattr(shape, name) for name in shape.__dataclass_fields__}


def test_group_members_share_one_system_prompt_and_declare_it() -> None:
    specs = multi_round_qa(MultiRoundQA(**{**_fields(SMALL), "users": 6, "num_tenants": 3}),
                           tenants=["acme", "globex", "initech"],
                           prefix_groups={"g": ["acme", "globex"]})
    prompts = _prompts(specs, SMALL.answer_len)
    tenant = {s.request_id: s.tenant for s in specs}
    assert [tenant[f"u{u}r0"] for u in range(3)] == ["acme", "globex", "initech"]
    assert prompts["u0r0"][:20] == prompts["u1r0"][:20] != prompts["u2r0"][:20]
    for s in specs:
        member = s.tenant != "initech"
        assert (s.prefix_group, s.shared_prefix_tokens) == (("g", 20) if member else (None, 0))


def test_no_reuse_prompts_share_no_block() -> None:
    specs = no_reuse(300, prompt_len=40, answer_len=3, num_tenants=2, seed=4, vocab=50)
    assert len(specs) == 300 and all(s.at_s == 0 and s.after is None for s in specs)
    assert all(len(s.new_tokens) == s.prompt_len == 40 and s.max_tokens == 3 for s in specs)
    assert len({s.new_tokens[:2] for s in specs}) == 300  # even the first block differs
    assert {s.tenant for s in specs} == {"tenant0", "tenant1"}
    with pytest.raises(ValueError, match="unique"):
        no_reuse(2501, prompt_len=40, answer_len=3, vocab=50)


@pytest.mark.parametrize("bad", [{"users": 0}, {"rounds": 0}, {"history_len": -1},
                                 {"answer_len": 0}, {"think_s": -1.0}, {"users": 1.5}])
def test_a_bad_shape_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        MultiRoundQA(**{**_fields(SMALL), **bad})


@pytest.mark.asyncio
async def test_multi_round_qa_serves_with_earlier_rounds_back_from_the_tier() -> None:
    # 64 blocks of 4 tokens hold about 3 users' conversations of 4: evicted rounds come
    # back from the memory tier, every page checked.
    shape = MultiRoundQA(users=4, rounds=3, system_prompt_len=16, history_len=40,
                         question_len=4, answer_len=4, num_tenants=2, think_s=0.0,
                         user_gap_s=0.0, seed=3)
    specs = multi_round_qa(shape)
    out = await serve(small_config(), specs=specs)
    assert out.finished == out.requests == 12 and out.failed == 0
    assert out.kv_mismatches == 0 and out.cross_tenant_hits == 0 and out.leaked_blocks == 0
    assert out.tier_hits > 0 and out.extra["pages_checked"] > 0
    assert out.computed_prompt_tokens < out.prompt_tokens == sum(s.prompt_len for s in specs)
