"""What keeps a run's memory flat: percentiles in bounded memory, a thinned time series, a
workload generated as it is consumed, referring only to its recent history."""

from __future__ import annotations

import random

import pytest
from engine_testlib import small_config
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplugin.engine.quantiles import Quantiles, nearest_rank
from kvplugin.engine.report import Sample
from kvplugin.engine.served import Timeline
from kvplugin.engine.workload import HISTORY, generate, stream


def test_quantiles_are_exact_up_to_the_limit_then_within_the_relative_error() -> None:
    rng = random.Random(3)
    values = [rng.lognormvariate(0, 2) for _ in range(5000)]
    q = Quantiles(exact=1000, rel_error=0.01)
    q.extend(values[:1000])
    assert q.is_exact
    for p in (0, 50, 90, 99, 100):
        assert q.percentile(p) == nearest_rank(values[:1000], p)
    q.extend(values[1000:])
    assert not q.is_exact and q.count == len(q) == 5000 and q.max == max(values)
    for p in (1, 50, 90, 99, 100):
        want = nearest_rank(values, p)
        assert abs(q.percentile(p) - want) <= 0.006 * want  # half a 1 % bucket, and rounding
    assert Quantiles().percentile(50) == 0.0
    with pytest.raises(ValueError):
        Quantiles(rel_error=0.0)


@settings(max_examples=50, derandomize=True)
@given(st.lists(st.floats(0, 1e4, allow_nan=False), min_size=1, max_size=300),
       st.sampled_from([0, 10, 50, 99, 100]))
def test_folded_quantiles_stay_within_their_error(values: list[float], p: float) -> None:
    q = Quantiles(exact=1, rel_error=0.02, floor=1e-6)
    q.extend(values)
    want = nearest_rank(values, p)
    assert abs(q.percentile(p) - want) <= max(0.011 * want, 1e-6)


def test_timeline_keeps_at_most_its_limit_evenly() -> None:
    tl = Timeline(limit=8)
    for i in range(100):
        tl.add(Sample(float(i), "t", None, i, 0, {}))
    times = [s.t_s for s in tl.samples]
    assert len(times) <= 8 and times[0] == 0.0 and tl.stride == 16
    assert times == [float(i) for i in range(0, 100, 16)]  # every 16th, from the first


def test_stream_is_generate_and_refers_only_to_recent_history() -> None:
    cfg = small_config(workload={"num_requests": 3 * HISTORY, "seed": 2,
                                 "resend_prob": 0.3, "follow_up_prob": 0.4})
    specs = generate(cfg.workload, max_prompt_len=400)
    assert specs == list(stream(cfg.workload, max_prompt_len=400))
    index = {s.request_id: i for i, s in enumerate(specs)}
    back = [i - index[s.after] for i, s in enumerate(specs) if s.after is not None]
    assert back and max(back) <= HISTORY and max(back) > HISTORY // 4
