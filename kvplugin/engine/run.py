"""``kvplugin run``'s main job: the configured workload through the engine, then a report.

Clients arrive in real time (a follow-up a think time after its parent's answer), the
engine serves them, and at the end the manager drains its stores and closes; only then are
leaks counted: blocks not back in the core's free pool, plus jobs still pending.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence

from kvplugin.config import KVPluginConfig
from kvplugin.engine.build import Deployment, TierWrapper, deployment
from kvplugin.engine.loop import LagProbe, run, uvloop_available
from kvplugin.engine.report import RunReport, percentile
from kvplugin.engine.scheduler import Engine, Result
from kvplugin.engine.workload import Finished, RequestSpec, build_prompt, generate, kinds

__all__ = ["drive", "max_prompt_len", "report", "run_engine", "serve"]


async def drive(engine: Engine, specs: Sequence[RequestSpec]) -> dict[str, Result]:
    """Serve ``specs`` on ``engine`` (which this runs) until every one has finished."""
    loop = asyncio.get_running_loop()
    start = loop.time()
    done: dict[str, Finished] = {}
    ended = {s.request_id: asyncio.Event() for s in specs}
    results: dict[str, Result] = {}

    async def client(spec: RequestSpec) -> None:
        if spec.after is not None:
            await ended[spec.after].wait()
            await asyncio.sleep(spec.think_s)
        await asyncio.sleep(max(0.0, start + spec.at_s - loop.time()))
        res = await engine.generate(spec.request_id, build_prompt(spec, done),
                                    tenant=spec.tenant, max_tokens=spec.max_tokens,
                                    cache_salt=spec.cache_salt, lora=spec.lora)
        results[spec.request_id] = res
        done[spec.request_id] = Finished(res.prompt, res.output)
        ended[spec.request_id].set()

    async def clients() -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for s in specs:
                    tg.create_task(client(s), name=f"client-{s.request_id}")
        finally:
            engine.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(engine.run(), name="engine")
        tg.create_task(clients(), name="clients")
    return results


async def serve(cfg: KVPluginConfig, *, wrap_tiers: TierWrapper | None = None,
                specs: Sequence[RequestSpec] | None = None) -> RunReport:
    """Build the deployment, serve the workload (``specs``, or the config's), close, report."""
    t0 = time.perf_counter()
    probe = LagProbe(cfg.engine.lag_probe_ms / 1000)
    probe.start()
    try:
        async with deployment(cfg, wrap_tiers=wrap_tiers) as dep:
            if specs is None:
                specs = generate(cfg.workload, max_prompt_len=max_prompt_len(dep, cfg))
            results = await drive(dep.engine, specs)
            await dep.mgr.drain()
        wall = time.perf_counter() - t0
    finally:
        await probe.stop()
    out = report(dep, results, wall, probe)
    out.extra["workload"] = kinds(specs)
    out.extra["loop"] = type(asyncio.get_running_loop()).__module__.split(".")[0]
    return out


def max_prompt_len(dep: Deployment, cfg: KVPluginConfig) -> int:
    """Long enough for the workload, short enough that any request fits the pool and the
    model with its answer (the engine refuses requests that could never run)."""
    pool_tokens = (dep.mgr.core.block_pool.num_gpu_blocks - 1) * cfg.layout.block_size
    pool_tokens //= max(1, len(cfg.layout.groups))
    cap = min(cfg.layout.max_model_len, pool_tokens // 2)
    return max(2, cap - cfg.workload.output_len[1])


def report(dep: Deployment, results: dict[str, Result], wall: float,
           probe: LagProbe | None = None) -> RunReport:
    """The report of a deployment that has served ``results`` (count leaks after its
    manager closed)."""
    es, model = dep.engine.stats, dep.model
    ms = dep.mgr.stats()
    pool = dep.mgr.core.block_pool
    hits = {"device": es.device_hit_tokens}
    for tier, label in zip(dep.mgr.tiers, dep.tier_labels, strict=True):
        hits[label] = hits.get(label, 0) + es.tier_hit_tokens.get(tier, 0)
    ttft = [r.ttft_s * 1000 for r in results.values() if r.ttft_s is not None]
    out = RunReport(
        requests=es.requests, finished=es.finished, failed=es.failed,
        prompt_tokens=es.prompt_tokens, computed_prompt_tokens=es.computed_prompt_tokens,
        hit_tokens=hits, loads=ms.loads, load_failures=ms.loads_failed + ms.loads_cancelled,
        stores=ms.stored_chunks, stores_shed=ms.stores_shed,
        kv_mismatches=model.kv_mismatches, cross_tenant_hits=model.cross_tenant_hits,
        leaked_blocks=(pool.num_gpu_blocks - 1 - pool.get_num_free_blocks())
        + dep.mgr.num_pending_jobs,
        loop_lag_p99_ms=probe.percentile(99) * 1000 if probe else 0.0, wall_s=wall)
    out.extra.update(
        tiers=dep.tier_labels, steps=es.steps, preemptions=es.preemptions,
        admissions=es.admissions, parked=es.parked, lookup_skips=es.lookup_skips,
        lookup_refreshes=es.lookup_refreshes,
        lookups=ms.lookups, lookup_timeouts=ms.lookup_timeouts, loaded_chunks=ms.loaded_chunks,
        recomputed_tokens=ms.recomputed_tokens, store_jobs=ms.stores,
        stores_failed=ms.stores_failed, stores_deduplicated=ms.stores_deduplicated,
        pages_checked=model.pages_checked, states_checked=model.states_checked,
        state_mismatches=model.state_mismatches, loaded_states=ms.loaded_states,
        stored_states=ms.stored_states, partial_tails=ms.partial_tails,
        restored_states=es.restored_states, restored_partial_states=es.restored_partial_states,
        states_dropped=ms.states_dropped, computed_tokens=es.computed_tokens,
        simulated_compute_s=round(model.busy_s, 3),
        ttft_p50_ms=round(percentile(ttft, 50), 2), ttft_p99_ms=round(percentile(ttft, 99), 2),
        pool_blocks=pool.num_gpu_blocks - 1)
    return out


def run_engine(cfg: KVPluginConfig, *, wrap_tiers: TierWrapper | None = None) -> RunReport:
    """:func:`serve` on a fresh event loop (uvloop when configured and installed)."""
    return run(serve(cfg, wrap_tiers=wrap_tiers),
               use_uvloop=cfg.engine.uvloop and uvloop_available())
