"""Hybrid (full attention + Mamba "align") scenarios in vLLM 0.33.0's real Scheduler: divergent
local hybrid hits, and the preemption stall of a pool smaller than one request. Run through
``vllm_scenarios.py`` (same interpreter, same fake runner).

Divergent hits: vLLM evicts a finished request's Mamba states before its attention blocks
(align mode frees the interior states while the request runs, so they are older in the free
queue), so a later request sharing the prefix finds full attention deeper on the device than
any Mamba state. Each scenario runs twice on identical engines, with the connector declaring
``supports_divergent_local_hybrid_hits`` and without, and reports what vLLM computed.
"""

from __future__ import annotations

import os
from typing import Any

from vllm_fake import write_config
from vllm_scenarios import drive, engine, prompt

SHARED = 208  # a's prompt: Mamba states at 64, 128, 192 (and the tail at 208)
RESUMED = 192  # b shares a's first 192 tokens, then 40 of its own
POOL = 24


def _spy(scheduler: Any, conn: Any, rid: str) -> dict[str, list[Any]]:
    """Record vLLM's local lookups of ``rid`` (the hit it offers the connector, and whether
    it diverged) and the connector's answers."""
    seen: dict[str, list[Any]] = {"local": [], "answers": []}
    kvm = scheduler.kv_cache_manager
    local_hit = kvm.get_computed_blocks_for_connector

    def for_connector(request: Any, *args: Any) -> Any:
        out = local_hit(request, *args)
        if request.request_id == rid:
            seen["local"].append({"tokens": out[1], "diverged": out[3]})
        return out

    kvm.get_computed_blocks_for_connector = for_connector
    matched = conn.get_num_new_matched_tokens

    def answer(request: Any, num_computed_tokens: int) -> Any:
        ext, is_async = matched(request, num_computed_tokens)
        if request.request_id == rid:
            seen["answers"].append({"local": num_computed_tokens, "external": ext})
        return ext, is_async

    conn.get_num_new_matched_tokens = answer
    return seen


def _hashes(runner: Any, tokens: list[int]) -> list[bytes]:
    from vllm.sampling_params import SamplingParams
    from vllm.v1.request import Request

    req = Request(request_id="hash", prompt_token_ids=tokens, sampling_params=SamplingParams(),
                  pooling_params=None, block_hasher=runner.hasher)
    return list(req.block_hashes)


def _diverge_run(workdir: str, name: str, divergent: bool) -> dict[str, Any]:
    """a (208 tokens) finishes; a filler's blocks evict a's Mamba states and the tail of
    its attention blocks; ``mamba_diverge``: the tier also lost a's first 4 chunks (the
    oldest objects, as an LRU tier drops them); then b (a's first 192 tokens + 40)."""
    scen_dir = os.path.join(workdir, f"{name}-{'on' if divergent else 'off'}")
    os.makedirs(scen_dir)
    config_file = write_config(scen_dir, disk=True, remote_url=None, layout="mamba")
    scheduler, runner = engine(workdir, config_file, POOL, layout="mamba", divergent=divergent)
    conn = scheduler.get_kv_connector()
    shared = prompt(1, SHARED)
    filler = 128 if name == "mamba_diverge" else 96
    try:
        first = drive(scheduler, runner, [
            {"id": "a", "prompt": shared, "arrival": 0, "max_tokens": 2},
            {"id": "f", "prompt": prompt(10, filler), "arrival": 20, "max_tokens": 2}])
        if name == "mamba_diverge":
            rt = runner.w._rt  # the worker owns the tiers
            keyspace = conn.scheduler_side.ledger.keyspace
            keys = keyspace.chunk_keys("default", 0, _hashes(runner, shared), 0, 4)
            rt.loop.call(rt.connector.delete(keys, timeout=5))
        seen = _spy(scheduler, conn, "b")
        loads_before = len(runner.loads)
        b = shared[:RESUMED] + prompt(99, 40)
        second = drive(scheduler, runner, [{"id": "b", "prompt": b, "arrival": 0,
                                            "max_tokens": 2}])
    finally:
        runner.w.shutdown()
        conn.shutdown()
    return {"first_finished": first["finished"], "finished": second["finished"],
            "free_blocks": second["free_blocks"], "num_blocks": second["num_blocks"],
            "local": seen["local"], "answers": seen["answers"],
            "loads": second["loads"][loads_before:], "b_computed": second["computed"]["b"],
            "b_tokens": len(b) + 2, "states_checked": second["states_checked"],
            "state_mismatches": second["state_mismatches"],
            "invalid_blocks": second["invalid_blocks"], "failed_loads": second["failed_loads"]}


def diverge_scenario(workdir: str, name: str) -> dict[str, Any]:
    """``mamba_diverge``: the tiers hold what lies beyond the device's attention hit but
    lost part of what lies before it: only a divergent hit is served. ``mamba_diverge_exact``:
    the device's attention hit reaches the tiers' deepest state: vLLM would fall back to the
    reconciled hit, so the connector defers the request one step and claims from there."""
    return {"scenario": name, "on": _diverge_run(workdir, name, True),
            "off": _diverge_run(workdir, name, False)}


def preempt_alone_scenario(workdir: str, name: str) -> dict[str, Any]:
    """``mamba_preempt``'s workload on a 9-block pool (8 usable), with the connector and
    with vLLM alone (no KV connector): two 64-token prompts generating 60 tokens each need
    8 attention blocks + 1 Mamba block apiece, more than the pool holds."""
    out: dict[str, Any] = {"scenario": name}
    wl = [{"id": f"p{i}", "prompt": prompt(50 + i, 64), "arrival": 0, "max_tokens": 60}
          for i in range(2)]
    for label, connector in (("alone", False), ("connector", True)):
        scen_dir = os.path.join(workdir, f"{name}-{label}")
        os.makedirs(scen_dir)
        config_file = write_config(scen_dir, disk=True, remote_url=None, layout="mamba")
        scheduler, runner = engine(workdir, config_file, 9, layout="mamba",
                                   connector=connector)
        try:
            res = drive(scheduler, runner, wl, max_steps=300)
        finally:
            if connector:
                runner.w.shutdown()
                scheduler.get_kv_connector().shutdown()
        out[label] = {"finished": res["finished"], "steps": res["steps"],
                      "preempted": res["preempted"], "computed": res["computed"],
                      "state_mismatches": res["state_mismatches"],
                      "status": {rid: [r.status.name, r.num_computed_tokens, r.num_tokens]
                                 for rid, r in sorted(scheduler.requests.items())}}
    return out


SCENARIOS = {"mamba_diverge": diverge_scenario, "mamba_diverge_exact": diverge_scenario,
             "mamba_preempt_alone": preempt_alone_scenario}
