"""Lookup cost: ``AsyncKVManager.lookup`` beside the bare connector's ``lookup`` of the same
keys, in the same process, alternating rounds.

A lookup runs on the event loop of every admission that misses the device cache, so its
loop time is paid once per request before the first token. The manager's lookup derives
the request's chunk keys (a sha256 per chunk), works out the window past the device hit,
asks the tier and reconciles the answer; the baseline asks the same memory tier about keys
derived beforehand, which is the least any lookup must do. The ratio is what the manager
adds; ``key_us`` is the cost of one key's derivation alone.

The prompt's chunks are all in the tier (stored through the manager), the device cache is
reset, so every lookup walks the whole window and claims it. Requests are built (and their
block hashes computed) outside the timed part. The garbage collector is off while timing.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass

from kvplugin.aio.loop import new_event_loop, uvloop_available
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import OffloadConfig
from kvplugin.config import validate
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.request import Request
from kvplugin.layouts import build_core

BLOCK = 16
TIMEOUT = 5.0


@dataclass(frozen=True, slots=True)
class Settings:
    rounds: int
    requests: int  # lookups per side per round
    chunks: int  # chunks of the prompt, all in the tier
    chunk_blocks: int


def _manager(s: Settings) -> tuple[AsyncKVManager, MemoryConnector]:
    tokens = s.chunks * s.chunk_blocks * BLOCK
    cfg = validate({
        "layout": {"block_size": BLOCK, "num_blocks": 2 * tokens // BLOCK + 8,
                   "max_model_len": 2 * tokens + BLOCK},
        "model": {"num_layers": 2, "num_kv_heads": 2, "head_size": 16},
        "offload": {"chunk_size": BLOCK * s.chunk_blocks},
    }, "lookup")
    core, ctx = build_core(cfg.layout, cfg.model)
    conn = MemoryConnector(capacity_bytes=1 << 30)
    off = OffloadConfig(model=cfg.model.name, chunk_blocks=s.chunk_blocks,
                        close_connector=False)
    return AsyncKVManager(core, conn, off, hash_context=ctx), conn


async def _store(mgr: AsyncKVManager, prompt: list[int]) -> None:
    """Every chunk of the prompt into the tier, then the device cache emptied."""
    req = mgr.new_request("store", prompt, tenant="bench")
    if mgr.allocate(req, None, num_new_tokens=len(prompt)) is None:
        raise RuntimeError("the pool cannot hold the prompt")
    req.num_computed_tokens = len(prompt)
    mgr.after_step([req])
    await mgr.drain()
    mgr.finish(req)
    await mgr.drain()
    if not mgr.core.reset_prefix_cache():
        raise RuntimeError("the device cache could not be reset")


def _requests(mgr: AsyncKVManager, prompt: list[int], n: int, tag: str) -> list[Request]:
    # One token more per request: a fresh request id, the same chunk hashes.
    return [mgr.new_request(f"{tag}-{i}", [*prompt, i], tenant="bench") for i in range(n)]


def _keys(mgr: AsyncKVManager, req: Request, chunks: int) -> list[ObjectKey]:
    return mgr.keyspace.chunk_keys("bench", 0, req.block_hashes, 0, chunks)


async def _manager_side(mgr: AsyncKVManager, reqs: list[Request], chunks: int) -> float:
    t = time.perf_counter()
    for r in reqs:
        found = await mgr.lookup(r)
        if found.external_tokens != chunks * mgr.keyspace.groups[0].chunk_tokens:
            raise RuntimeError(f"lookup claimed {found.external_tokens} tokens")
    return (time.perf_counter() - t) / len(reqs)


async def _bare_side(conn: MemoryConnector, keys: list[list[ObjectKey]], chunks: int) -> float:
    t = time.perf_counter()
    for k in keys:
        if await conn.lookup(k, timeout=TIMEOUT) != chunks:
            raise RuntimeError("the tier lost a chunk")
    return (time.perf_counter() - t) / len(keys)


def _key_cost(mgr: AsyncKVManager, reqs: list[Request], chunks: int) -> float:
    t = time.perf_counter()
    for r in reqs:
        _keys(mgr, r, chunks)
    return (time.perf_counter() - t) / (len(reqs) * chunks)


async def bench(s: Settings) -> dict[str, object]:
    mgr, conn = _manager(s)
    prompt = [(7 * i) % 32000 for i in range(s.chunks * s.chunk_blocks * BLOCK)]
    await _store(mgr, prompt)
    ratios, lookups, bares, key_costs = [], [], [], []
    gc.collect()
    gc.disable()
    try:
        for rnd in range(s.rounds):
            reqs = _requests(mgr, prompt, s.requests, f"m{rnd}")
            others = _requests(mgr, prompt, s.requests, f"b{rnd}")
            keys = [_keys(mgr, r, s.chunks) for r in others]
            if rnd % 2:  # the side going first alternates
                bare = await _bare_side(conn, keys, s.chunks)
                full = await _manager_side(mgr, reqs, s.chunks)
            else:
                full = await _manager_side(mgr, reqs, s.chunks)
                bare = await _bare_side(conn, keys, s.chunks)
            key_costs.append(_key_cost(mgr, others, s.chunks))
            lookups.append(full)
            bares.append(bare)
            ratios.append(full / bare)
            for r in (*reqs, *others):
                mgr.finish(r)
    finally:
        gc.enable()
        await mgr.aclose()
        await conn.aclose()
    return {
        "lookup_us": round(statistics.median(lookups) * 1e6, 1),
        "bare_lookup_us": round(statistics.median(bares) * 1e6, 1),
        "lookup_overhead_ratio": round(statistics.median(ratios), 3),
        "key_us": round(statistics.median(key_costs) * 1e6, 3),
        "settings": {"rounds": s.rounds, "requests": s.requests, "chunks": s.chunks,
                     "chunk_blocks": s.chunk_blocks, "block_size": BLOCK},
    }


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--requests", type=int, default=300, help="lookups per side per round")
    ap.add_argument("--chunks", type=int, default=128, help="chunks of the prompt in the tier")
    ap.add_argument("--chunk-blocks", type=int, default=1, help="blocks per chunk")
    ap.add_argument("--asyncio", action="store_true",
                    help="asyncio's own loop instead of uvloop")
    a = ap.parse_args(argv)
    s = Settings(a.rounds, a.requests, a.chunks, a.chunk_blocks)
    loop = new_event_loop(not a.asyncio and uvloop_available())
    try:
        out = loop.run_until_complete(bench(s))
    finally:
        loop.close()
    for k, v in out.items():
        print(f"{k:24} {v}")
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
