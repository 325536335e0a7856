"""A small vLLM-style scheduler simulation that drives the core and records a trace.

It follows the scheduler rules of the conformance traces (``FORMAT.md``): running requests
first (preempting the newest until the allocation fits), then waiting requests FCFS with a
prefix lookup, one ``append_output_tokens`` per scheduled request.  Every call goes through
:class:`kvplugin.replay.Replayer`, so the recorded ops form a valid
``vllm-kv-oracle-trace/v1`` trace that vLLM's own manager can replay too — the basis of
differential testing on layouts and workloads of our own.
"""

from __future__ import annotations

import random
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from kvplugin.config import LimitsConfig as Limits
from kvplugin.engine.config import WorkloadConfig as Workload
from kvplugin.replay import FORMAT_TRACE, Replayer

__all__ = ["Limits", "SimResult", "Simulation", "Workload"]


@dataclass(slots=True)
class _Req:
    rid: str
    num_tokens: int
    max_tokens: int
    computed: int = 0
    outputs: int = 0


@dataclass(slots=True)
class SimResult:
    trace: dict[str, Any]
    requests: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    admissions: int = 0
    preemptions: int = 0
    failed_allocations: int = 0
    steps: int = 0
    final_free_blocks: int = 0
    total_blocks: int = 0
    summary: dict[str, Any] = field(default_factory=dict)


class Simulation:
    def __init__(self, config: dict[str, Any], workload: Workload | None = None,
                 limits: Limits | None = None) -> None:
        self.config = config
        self.workload = workload or Workload()
        self.limits = limits or Limits()
        self.rep = Replayer(config)
        self.rng = random.Random(self.workload.seed)
        self.ops: list[dict[str, Any]] = []
        self.waiting: deque[_Req] = deque()
        self.running: list[_Req] = []
        self.finished: list[str] = []  # ids whose tokens may seed follow-ups
        self.token_counts: dict[str, int] = {}
        groups = config.get("groups", [{"kind": "full"}])
        self.mamba = any(g.get("kind") == "mamba" for g in groups)
        self.res = SimResult(trace={})

    # ------------------------------------------------------------------ plumbing
    def _do(self, op: dict[str, Any]) -> dict[str, Any]:
        self.ops.append(op)
        return self.rep.apply(op) or {}

    def _tokens(self, n: int) -> list[int]:
        return [self.rng.randrange(self.workload.vocab) for _ in range(n)]

    # ------------------------------------------------------------------ arrivals
    def _new_request(self, idx: int) -> None:
        w, rng = self.workload, self.rng
        rid = f"r{idx}"
        prompt: list[Any]
        roll = rng.random()
        if self.finished and roll < w.resend_prob:
            src = rng.choice(self.finished)
            prompt = [{"from": src, "start": 0, "len": self.token_counts[src]}]
        elif self.finished and roll < w.resend_prob + w.follow_up_prob:
            src = rng.choice(self.finished)
            prompt = [{"from": src, "start": 0, "len": self.token_counts[src]},
                      *self._tokens(rng.randint(*w.user_len))]
        else:
            sp = rng.randrange(w.num_system_prompts)
            rng_sp = random.Random(w.seed * 1000 + sp)
            sp_len = rng_sp.randint(*w.system_prompt_len)
            prompt = [rng_sp.randrange(w.vocab) for _ in range(sp_len)]
            prompt += self._tokens(rng.randint(*w.user_len))
        op: dict[str, Any] = {"op": "add_request", "id": rid, "prompt": prompt,
                              "max_tokens": rng.randint(*w.output_len)}
        if rng.random() < w.salt_prob:
            op["cache_salt"] = f"tenant{rng.randrange(3)}"
        if rng.random() < w.lora_prob:
            op["lora_name"] = f"adapter{rng.randrange(2)}"
        res = self._do(op)
        n = int(res["num_tokens"])
        self.res.requests += 1
        self.res.prompt_tokens += n
        self.waiting.append(_Req(rid, n, op["max_tokens"]))

    # ------------------------------------------------------------------ one step
    def _chunk(self, req: _Req, budget: int) -> int:
        n = min(req.num_tokens - req.computed, budget)
        thr = self.limits.long_prefill_token_threshold
        if thr:
            n = min(n, thr)
        if self.mamba and req.computed + n < req.num_tokens:
            # Mamba "align": prefill chunks end on scheduler-block boundaries so the state
            # at each chunk end is a cacheable boundary state (when the budget allows one).
            sbs = self.rep.sbs
            aligned = (req.computed + n) // sbs * sbs - req.computed
            if aligned > 0:
                n = aligned
        return max(n, 0)

    def _schedule_running(self, budget: int, scheduled: dict[str, int]) -> tuple[int, bool]:
        preempted = False
        for req in list(self.running):
            if req not in self.running or budget <= 0:
                continue
            n = self._chunk(req, budget)
            if n <= 0:
                continue
            ok = False
            while True:
                ok = bool(self._do({"op": "allocate_slots", "id": req.rid,
                                    "num_new_tokens": n})["ok"])
                if ok:
                    break
                self.res.failed_allocations += 1
                victim = self.running.pop()
                self._do({"op": "preempt", "id": victim.rid})
                scheduled.pop(victim.rid, None)
                victim.computed = 0
                self.waiting.appendleft(victim)
                self.res.preemptions += 1
                preempted = True
                if victim is req:
                    break
            if not ok:
                break
            scheduled[req.rid] = n
            budget -= n
        return budget, preempted

    def _schedule_waiting(self, budget: int, scheduled: dict[str, int]) -> None:
        while budget > 0 and self.waiting and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting[0]
            hit = int(self._do({"op": "get_computed_blocks", "id": req.rid})
                      ["num_computed_tokens"])
            req.computed = hit
            n = self._chunk(req, budget)
            if n <= 0:
                req.computed = 0
                break
            res = self._do({"op": "allocate_slots", "id": req.rid, "num_new_tokens": n,
                            "num_new_computed_tokens": hit, "use_lookup": True,
                            "has_scheduled_reqs": bool(self.running),
                            "full_sequence_must_fit": self.limits.full_sequence_must_fit})
            if not res["ok"]:
                req.computed = 0
                self.res.failed_allocations += 1
                break
            self.waiting.popleft()
            self._do({"op": "update_request", "id": req.rid, "status": "RUNNING",
                      "num_computed_tokens": hit})
            self._do({"op": "record_prefix_cache_stats", "id": req.rid, "num_hits": hit})
            self.res.hit_tokens += hit
            self.res.admissions += 1
            self.running.append(req)
            scheduled[req.rid] = n
            budget -= n

    def _execute(self, scheduled: dict[str, int]) -> None:
        for req in list(self.running):
            n = scheduled.get(req.rid)
            if n is None:
                continue
            req.computed += n
            tokens: list[int] = []
            if req.computed >= req.num_tokens:
                tokens = self._tokens(1)
                req.num_tokens += 1
                req.outputs += 1
            self._do({"op": "append_output_tokens", "id": req.rid, "tokens": tokens,
                      "num_computed_tokens": req.computed})
            if req.outputs >= req.max_tokens:
                self._do({"op": "finish", "id": req.rid})
                self.running.remove(req)
                self.finished.append(req.rid)
                self.token_counts[req.rid] = req.num_tokens

    def step(self) -> None:
        self.res.steps += 1
        self._do({"op": "new_step"})
        scheduled: dict[str, int] = {}
        budget, preempted = self._schedule_running(self.limits.max_num_batched_tokens,
                                                   scheduled)
        if not preempted:
            self._schedule_waiting(budget, scheduled)
        if self.mamba:
            self._do({"op": "take_kv_cache_block_copies"})
        self._execute(scheduled)
        if self.res.steps % self.limits.stats_every == 0:
            self._do({"op": "take_events"})
            self._do({"op": "make_prefix_cache_stats"})
            self._do({"op": "usage"})

    # ------------------------------------------------------------------ driver
    def run(self, max_steps: int = 100_000) -> SimResult:
        w = self.workload
        next_idx = 0
        credit = 0.0
        while (next_idx < w.num_requests or self.waiting or self.running) \
                and self.res.steps < max_steps:
            credit += w.arrivals_per_step
            while credit >= 1 and next_idx < w.num_requests:
                self._new_request(next_idx)
                next_idx += 1
                credit -= 1
            self.step()
        self._do({"op": "take_events"})
        self._do({"op": "make_prefix_cache_stats"})
        self._do({"op": "free_queue"})
        pool = self.rep.manager.block_pool
        self.res.final_free_blocks = pool.get_num_free_blocks()
        self.res.total_blocks = pool.num_gpu_blocks - 1
        self.res.trace = {"format": FORMAT_TRACE,
                          "meta": {"source": "kvplugin.sim", "seed": w.seed},
                          "config": self.config, "ops": self.ops}
        return self.res
