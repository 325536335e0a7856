"""Section-7 invariants on hybrid layouts driven by the scheduler simulation.

Hypothesis picks a layout (full attention with sliding windows, chunked local attention,
Mamba "align" with and without sub-block hits, several block sizes), a pool size and a
workload; ``kvplugin.sim`` then schedules it the way vLLM's scheduler does (block-aligned
Mamba chunks, copy-on-write drains, preemption), and after every step the pool, map and
table invariants must hold.  Mamba layouts live here rather than in the rule-based machine
because their prefill chunks must end on block boundaries, which the simulation enforces.
"""

from __future__ import annotations

from typing import Any

from core_testlib import check_invariants
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplugin.sim import Limits, Simulation, Workload

LAYOUTS: dict[str, list[dict[str, Any]]] = {
    "full+swa(2 sizes)": [{"kind": "full", "block_size": 16},
                          {"kind": "sliding_window", "sliding_window": 24, "block_size": 8}],
    "full+2swa": [{"kind": "full"}, {"kind": "sliding_window", "sliding_window": 17},
                  {"kind": "sliding_window", "sliding_window": 40}],
    "full+chunked": [{"kind": "full"}, {"kind": "chunked_local", "attention_chunk_size": 16}],
    "full+mamba": [{"kind": "full"}, {"kind": "mamba", "mode": "align"}],
    "full+mamba(sub-block)": [{"kind": "full"},
                              {"kind": "mamba", "mode": "align", "block_size": 32}],
    "full+swa+mamba": [{"kind": "full"}, {"kind": "sliding_window", "sliding_window": 20},
                       {"kind": "mamba", "mode": "align"}],
}


class CheckedSimulation(Simulation):
    """Checks the invariants at every step boundary (copies drained, nothing in flight)."""

    def step(self) -> None:
        super().step()
        live = [r for r in self.rep.requests.values() if not r.is_finished()]
        check_invariants(self.rep.manager, live)


@settings(max_examples=30, deadline=None)
@given(layout=st.sampled_from(sorted(LAYOUTS)), num_blocks=st.integers(12, 80),
       seed=st.integers(0, 10_000), budget=st.sampled_from([16, 48, 128]),
       retention=st.sampled_from([None, 0]), seqs=st.integers(1, 6))
def test_hybrid_invariants_under_simulated_scheduling(layout: str, num_blocks: int, seed: int,
                                                      budget: int, retention: int | None,
                                                      seqs: int) -> None:
    config: dict[str, Any] = {"block_size": 8, "num_blocks": num_blocks, "max_model_len": 512,
                              "groups": LAYOUTS[layout],
                              "prefix_cache_retention_interval": retention}
    if layout == "full+mamba(sub-block)":
        config["prefix_match_unit"] = 8
    work = Workload(num_requests=8, seed=seed, num_system_prompts=2,
                    system_prompt_len=(4, 60), user_len=(1, 30), output_len=(1, 10),
                    vocab=6, follow_up_prob=0.4, resend_prob=0.2)
    sim = CheckedSimulation(config, work, Limits(max_num_batched_tokens=budget,
                                                 max_num_seqs=seqs, stats_every=2))
    result = sim.run(max_steps=400)
    if result.steps < 400:  # everything finished: nothing may be leaked
        assert result.final_free_blocks == result.total_blocks
