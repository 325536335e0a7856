"""Event-loop lag while the manager streams stores, and its store throughput beside the bare
connectors', measured in the same run on the same connector stack.

Manager side: requests of ``--chunks`` chunks each are admitted (``allocate``), marked
computed and handed off (``after_step``: chunk keys from the block hashes, pages copied out
of host memory, one store job per request, the I/O gate, the budget), then finished; a new
request is handed off whenever fewer than ``--window`` store jobs are in flight, so stores
stream at full speed without an unbounded queue. A timer task wakes every ``--probe-ms``
and records how late it woke (loop lag).

Baseline side: ``TieredConnector.put`` of the same number of objects of the same size (the
same metadata shape, fresh keys), one call per "request" of ``--chunks`` objects, at most
``--max-io`` calls at once (the manager's I/O gate) and the same ``--window``.

Both sides write to the same memory → disk tiered stack (built by the engine's
``build_connector``), fresh keys each, alternating which side goes first; a round's ratio
is manager bytes/s ÷ baseline bytes/s; the reported figure is the median over rounds. The
collector is off while timing. Last line: JSON with ``loop_lag_p99_ms`` (manager side),
``store_throughput_ratio`` and the rest.

The loop is the one ``kvplugin run`` serves on: uvloop when installed (``--asyncio`` for
asyncio's own); the disk tier's I/O pool has its default size (``--io-threads`` to choose:
see ``kvplugin.connectors.disk.default_io_threads`` for why the default leaves a core to the loop).

    python3 benchmarks/event_loop.py             # targets: lag p99 <= 5 ms, ratio >= 0.80
    python3 benchmarks/event_loop.py --rounds 9 --object-kib 1024 --asyncio --io-threads 4
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvplugin.aio.loop import new_event_loop, uvloop_available
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import OffloadConfig, StoreMode
from kvplugin.config import KVPluginConfig, validate
from kvplugin.connectors.base import Connector, PutItem
from kvplugin.connectors.disk import default_io_threads
from kvplugin.core.request import Request
from kvplugin.engine.build import build_connector
from kvplugin.engine.loop import LagProbe
from kvplugin.engine.quantiles import Quantiles
from kvplugin.layouts import build_core
from kvplugin.serde import Block

BLOCK = 16  # tokens per block
TIMEOUT = 30.0


@dataclass(frozen=True, slots=True)
class Settings:
    rounds: int
    requests: int  # per side per round
    chunks: int  # objects per request
    object_kib: int
    max_io: int
    window: int  # store calls in flight or queued at the gate, at most
    probe_ms: float
    store_mode: str
    io_threads: int | None

    @property
    def object_bytes(self) -> int:
        return self.object_kib << 10


def config(s: Settings, tmp: str) -> KVPluginConfig:
    """One block per object; a page of ``object_kib`` KiB (K and V of 2 layers, fp16)."""
    head = s.object_bytes // (2 * 2 * BLOCK * 2 * 4)  # K/V, layers, slots, fp16, heads
    per_round = 2 * s.requests * s.chunks * s.object_bytes
    return validate({
        "layout": {"block_size": BLOCK, "num_blocks": 4 * s.window * s.chunks + 1,
                   "max_model_len": 1 << 16},
        "model": {"num_layers": 2, "num_kv_heads": 4, "head_size": head},
        "offload": {"chunk_size": BLOCK, "max_local_cpu_size": 2 * per_round / (1 << 30),
                    "local_disk": os.path.join(tmp, "disk"),
                    "max_local_disk_size": 2 * per_round / (1 << 30),
                    **({"disk_io_threads": s.io_threads} if s.io_threads else {})},
    }, "event_loop")


@dataclass(slots=True)
class Side:
    seconds: list[float] = field(default_factory=list)
    lag: Quantiles = field(default_factory=Quantiles)  # every probe sample (s), every round

    def p99(self) -> float:
        return self.lag.percentile(99) * 1000


# ----------------------------------------------------------------------------- manager side


def _manager(cfg: KVPluginConfig, conn: Connector, s: Settings) -> AsyncKVManager:
    core, ctx = build_core(cfg.layout, cfg.model)
    off = OffloadConfig(model=cfg.model.name, max_io=s.max_io, store_mode=StoreMode(s.store_mode),
                        store_budget_bytes=4 * s.window * s.chunks * s.object_bytes,
                        close_connector=False)
    return AsyncKVManager(core, conn, off, hash_context=ctx)


def _prompts(s: Settings, rng: random.Random) -> list[list[int]]:
    # Fresh tokens: fresh hashes, fresh keys (nothing is deduplicated by a tier).
    return [[rng.randrange(32000) for _ in range(s.chunks * BLOCK)] for _ in range(s.requests)]


async def manager_side(mgr: AsyncKVManager, prompts: list[list[int]], s: Settings,
                       tag: str) -> None:
    for i, prompt in enumerate(prompts):
        while mgr.num_pending_jobs >= s.window:
            await asyncio.sleep(0.0005)  # the engine's next step, once a store job ended
        req = mgr.new_request(f"{tag}-{i}", prompt, tenant="bench")
        if mgr.allocate(req, None) is None:
            raise RuntimeError("the pool is too small for the window")
        req.num_computed_tokens = req.num_tokens  # the model step wrote every block
        if mgr.after_step([req]) != s.chunks:
            raise RuntimeError("a chunk was not stored (shed or deduplicated)")
        mgr.finish(req)
        await asyncio.sleep(0)
    await mgr.drain()


# ----------------------------------------------------------------------------- baseline side


def baseline_items(mgr: AsyncKVManager, prompts: list[list[int]], tag: str
                   ) -> list[list[PutItem]]:
    """The manager's objects for other keys: same metadata shape, same payload size, the
    payload one host-memory page (a view, as the connector gets in HOLD mode)."""
    shape = mgr.memory.shapes[0]
    page = mgr.memory.pages(0, [1])
    out = []
    for i, prompt in enumerate(prompts):
        req = Request(f"{tag}-{i}", prompt, block_hasher=mgr.hasher)
        keys = mgr.keyspace.chunk_keys("baseline", 0, req.block_hashes, 0, len(prompt) // BLOCK)
        out.append([(k, Block(k.meta(token_start=c * BLOCK, token_end=(c + 1) * BLOCK,
                                     dtype=shape.dtype, shape=(1, *shape.dims)), page.data))
                    for c, k in enumerate(keys)])
    return out


async def baseline_side(conn: Connector, batches: list[list[PutItem]], s: Settings) -> None:
    gate = asyncio.Semaphore(s.max_io)
    window = asyncio.Semaphore(s.window)

    async def put(items: list[PutItem]) -> None:
        try:
            async with gate:
                await conn.put(items, timeout=TIMEOUT)
        finally:
            window.release()

    async with asyncio.TaskGroup() as tg:
        for items in batches:
            await window.acquire()
            tg.create_task(put(items))
            await asyncio.sleep(0)


# ----------------------------------------------------------------------------- rounds


async def timed(side: Side, s: Settings, coro: Any) -> None:
    gc.collect()
    gc.disable()
    probe = LagProbe(s.probe_ms / 1000, into=side.lag)
    probe.start()
    t0 = time.perf_counter()
    try:
        await coro
    finally:
        side.seconds.append(time.perf_counter() - t0)
        await probe.stop()
        gc.enable()


async def one_round(r: int, s: Settings, mgr_side: Side, raw_side: Side) -> None:
    tmp = tempfile.mkdtemp(prefix="kvplugin-evloop-")
    try:
        cfg = config(s, tmp)
        conn = build_connector(cfg.offload, os.path.join(tmp, "disk"))
        try:
            mgr = _manager(cfg, conn, s)
            rng = random.Random(r)
            mine, theirs = _prompts(s, rng), _prompts(s, rng)
            batches = baseline_items(mgr, theirs, f"b{r}")
            sides = [(mgr_side, manager_side(mgr, mine, s, f"m{r}")),
                     (raw_side, baseline_side(conn, batches, s))]
            for side, coro in sides if r % 2 == 0 else sides[::-1]:
                await timed(side, s, coro)
            await mgr.aclose()
        finally:
            await conn.aclose()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


async def bench(s: Settings) -> dict[str, Any]:
    mgr_side, raw_side = Side(), Side()
    for r in range(s.rounds):
        await one_round(r, s, mgr_side, raw_side)
    nbytes = s.requests * s.chunks * s.object_bytes
    ratios = [raw / mine for mine, raw in zip(mgr_side.seconds, raw_side.seconds, strict=True)]
    return {
        "loop_lag_p99_ms": round(mgr_side.p99(), 3),
        "loop_lag_p50_ms": round(mgr_side.lag.percentile(50) * 1000, 3),
        "loop_lag_max_ms": round(mgr_side.lag.max * 1000, 3),
        "store_throughput_ratio": round(statistics.median(ratios), 3),
        "round_ratios": [round(x, 3) for x in ratios],
        "manager_mib_s": round(nbytes / statistics.median(mgr_side.seconds) / (1 << 20), 1),
        "baseline_mib_s": round(nbytes / statistics.median(raw_side.seconds) / (1 << 20), 1),
        "baseline_loop_lag_p99_ms": round(raw_side.p99(), 3),
        "object_kib": s.object_kib, "objects_per_side": s.requests * s.chunks,
        "max_io": s.max_io, "window": s.window, "store_mode": s.store_mode,
        "rounds": s.rounds, "loop": type(asyncio.get_running_loop()).__module__.split(".")[0],
        "io_threads": s.io_threads or default_io_threads(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--requests", type=int, default=48, help="per side per round")
    ap.add_argument("--chunks", type=int, default=4, help="objects per request")
    ap.add_argument("--object-kib", type=int, default=256)
    ap.add_argument("--max-io", type=int, default=8)
    ap.add_argument("--window", type=int, default=16)
    ap.add_argument("--probe-ms", type=float, default=1.0)
    ap.add_argument("--store-mode", choices=["copy", "hold"], default="copy")
    ap.add_argument("--asyncio", action="store_true",
                    help="asyncio's own loop instead of uvloop")
    ap.add_argument("--io-threads", type=int, help="the disk tier's I/O threads (default: auto)")
    a = ap.parse_args(argv)
    s = Settings(a.rounds, a.requests, a.chunks, a.object_kib, a.max_io, a.window, a.probe_ms,
                 a.store_mode, a.io_threads)
    loop = new_event_loop(not a.asyncio and uvloop_available())
    try:
        out = loop.run_until_complete(bench(s))
    finally:
        loop.close()
    for k, v in out.items():
        print(f"{k:26} {v}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
