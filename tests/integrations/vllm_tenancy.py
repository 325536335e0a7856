"""The offload core inside vLLM 0.33.0's real Scheduler: tenants' tier byte quotas,
deduplication of an object two requests store at once, ``kv_role``, and a dead tier beside
a live one. Run through ``vllm_scenarios.py`` (same interpreter, same fake runner); each
scenario returns one JSON-able record with the scheduler connector's books.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from vllm_fake import write_config
from vllm_scenarios import books, drive, engine, evicting_workload, prompt

CHUNK_BYTES = 2048  # one 16-token block of the test model (the books say it: stored / chunks)
QUOTA = 8 * CHUNK_BYTES  # tenant a's disk quota: a third of its working set


class _Lines(logging.Handler):
    """The WARNING lines kvplugin writes (what vLLM's log would show)."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def _run(workdir: str, name: str, workload: list[dict[str, Any]], *, kv_role: str = "kv_both",
         more: dict[str, Any] | None = None, disk: str | None = None, redis: str | None = None,
         watch: Any = None) -> dict[str, Any]:
    scen = os.path.join(workdir, name)
    os.makedirs(scen)
    more = dict(more or {})
    more["offload"] = {"local_disk": disk, **more.get("offload", {})}
    config = write_config(scen, disk=False, remote_url=redis, more=more)
    lines = _Lines()
    logging.getLogger("kvplugin").addHandler(lines)
    try:
        scheduler, runner = engine(scen, config, 24, kv_role=kv_role)
        try:
            if watch is not None:
                runner.after_step = lambda: watch(scheduler, runner)
            out = drive(scheduler, runner, workload)
        finally:
            runner.w.shutdown()
            scheduler.get_kv_connector().shutdown()
    finally:
        logging.getLogger("kvplugin").removeHandler(lines)
    out["warnings"] = lines.lines
    out["stored_by_req"] = {r: len(k) for r, k in sorted(runner.saved_by_req.items())}
    return out


def tenant_quota(workdir: str, redis_url: str | None) -> dict[str, Any]:
    """Tenants a and b each send four 100-token prompts (six chunks each); a's disk quota
    holds 8 chunks. After every step: what the ledger believes a holds on disk, and what
    the disk really holds of a's objects."""
    disk = os.path.join(workdir, "disk")
    seen = {"max_held_a": 0, "max_true_a": 0, "steps": 0}
    keys_a: set[str] = set()

    def watch(scheduler: Any, runner: Any) -> None:
        ledger = scheduler.get_kv_connector().scheduler_side.ledger
        tier = runner.w.worker_side.runtime.connector
        for rid, ids in runner.saved_by_req.items():
            if rid.startswith("a"):
                keys_a.update(ids)
        on_disk = set(tier.objects()) & keys_a
        assert ledger.holdings is not None
        seen["max_held_a"] = max(seen["max_held_a"], ledger.holdings.held("a", "disk"))
        seen["max_true_a"] = max(seen["max_true_a"], len(on_disk) * CHUNK_BYTES)
        seen["steps"] += 1

    wl = []
    for i in range(4):
        for t in ("a", "b"):
            wl.append({"id": f"{t}{i}", "prompt": prompt(40 + i + (10 if t == "b" else 0), 100),
                       "arrival": 6 * i, "max_tokens": 2, "salt": t})
    tenants = {"declared": {"a": {"max_tier_bytes": {"disk": QUOTA}}, "b": {}}}
    out = _run(workdir, "tenant_quota", wl, more={"tenants": tenants}, disk=disk, watch=watch)
    return {**out, **seen, "quota": QUOTA}


def dedup(workdir: str, redis_url: str | None) -> dict[str, Any]:
    """Two requests with one 32-token prompt, computed in the same step: both offer the
    same two chunks; the second's are deduplicated (one store per object)."""
    p = prompt(5, 32)
    wl = [{"id": "a", "prompt": p, "arrival": 0, "max_tokens": 2},
          {"id": "a2", "prompt": p, "arrival": 0, "max_tokens": 2}]
    return _run(workdir, "dedup", wl, disk=os.path.join(workdir, "disk"))


def producer(workdir: str, redis_url: str | None) -> dict[str, Any]:
    """The evicting workload under ``kv_producer``: a stores, fillers evict it from the
    device, b finds a's prefix on the populated tier and loads nothing."""
    return _run(workdir, "producer", evicting_workload(), kv_role="kv_producer",
                disk=os.path.join(workdir, "disk"))


def consumer(workdir: str, redis_url: str | None) -> dict[str, Any]:
    """A producer engine serves a (its prefix stored); a fresh consumer engine on the same
    tier serves b, which shares a's prefix: it loads it, and stores nothing."""
    disk = os.path.join(workdir, "disk")
    shared = prompt(1, 80)
    first = _run(workdir, "consumer_producer", [
        {"id": "a", "prompt": shared, "arrival": 0, "max_tokens": 2}],
        kv_role="kv_producer", disk=disk)
    second = _run(workdir, "consumer", [
        {"id": "b", "prompt": shared + prompt(99, 20), "arrival": 0, "max_tokens": 2}],
        kv_role="kv_consumer", disk=disk)
    return {"producer": first, "consumer": second}


def dead_beside(workdir: str, redis_url: str | None) -> dict[str, Any]:
    """A disk tier and a Redis tier nobody listens on: stores go on through the disk, the
    Redis tier's failures are counted per tier and logged, rate-limited."""
    return _run(workdir, "dead_beside", evicting_workload(), disk=os.path.join(workdir, "disk"),
                redis="redis://127.0.0.1:9/0",
                more={"offload": {"lookup_timeout_ms": 200, "store_timeout_ms": 1000}})


SCENARIOS = {"tenant_quota": tenant_quota, "dedup": dedup, "producer": producer,
             "consumer": consumer, "dead_beside": dead_beside}
__all__ = ["SCENARIOS", "books"]
