#!/usr/bin/env python3
"""The minimal engine integration: what an engine's scheduler and model runner call.

A toy asyncio engine (not kvplugin's reference engine) loads kvplugin from a deployment
config and serves the same prompts twice. Between the passes the device prefix cache is
reset (as after a weight reload), so the second pass gets its prefixes back from the tiers.

Per request: ``new_request`` -> ``lookup`` (in the background, as soon as it is queued) ->
``allocate`` with the lookup (a tier hit parks the request while ``wait_load`` brings the KV
in) -> model steps write KV into ``mgr.memory`` -> ``after_step`` after every step (hands
finished chunks to the tiers) -> ``finish``. At the end ``drain`` lets the stores finish and
leaving the ``async with`` closes everything. Every block the request did not compute (a
device hit or loaded bytes) is checked against what the model would have written.

    python3 examples/engine_integration.py [CONFIG]    # default: the embedded config
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import sys
from collections import deque
from typing import Any

import numpy as np

from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import LoadOutcome, LoadStatus
from kvplugin.core.request import Request, RequestStatus
from kvplugin.plugin import load_plugin

MAX_TOKENS = 8  # tokens generated per request
BUDGET = 256  # tokens per step


def kv_of(tokens: list[int], upto: int) -> list[bytes]:
    """The toy model's KV: one 16-byte digest per token, chained over the prefix."""
    out, d = [], b"kv"
    for t in tokens[:upto]:
        d = hashlib.blake2b(d + t.to_bytes(8, "little"), digest_size=16).digest()
        out.append(d)
    return out


class ToyEngine:
    def __init__(self, mgr: AsyncKVManager) -> None:
        if any(s.kind != "full" for s in mgr.memory.shapes):
            raise SystemExit("this example serves full-attention layouts only")
        self.mgr = mgr
        self.waiting: deque[tuple[Request, asyncio.Task[Any]]] = deque()
        self.running: list[Request] = []
        self.loading: set[asyncio.Task[tuple[Request, LoadOutcome]]] = set()
        self.checks: list[tuple[Request, int]] = []
        self.hits: dict[str, int] = {}
        self.mismatches = 0

    def add(self, rid: str, tenant: str, prompt: list[int]) -> None:
        req = self.mgr.new_request(rid, prompt, tenant=tenant)
        self.waiting.append((req, asyncio.create_task(self.mgr.lookup(req))))

    def _slot(self, req: Request, group: int, token: int) -> np.ndarray[Any, Any]:
        bs = self.mgr.memory.shapes[group].block_size
        block = self.mgr.core.get_block_ids(req.request_id)[group][token // bs]
        return self.mgr.memory.pages(group, [block])[0].reshape(bs, -1)[token % bs]

    def model_step(self, batch: list[tuple[Request, int]]) -> None:
        """Write the KV of every scheduled token; sample when the last token was computed."""
        for req, n in batch:
            start = req.num_computed_tokens
            kv = kv_of(req.all_token_ids, start + n)
            for t in range(start, start + n):
                for g in range(self.mgr.memory.num_groups):
                    slot = self._slot(req, g, t)
                    slot[:] = np.resize(np.frombuffer(kv[t], np.uint8), slot.size)
            req.num_computed_tokens = start + n
            if req.num_computed_tokens == req.num_tokens:
                req.append_output_token_ids(int.from_bytes(kv[-1][:4], "little") % 32000)

    def check(self, req: Request, end: int) -> None:
        """Blocks the request got for free must hold what computing them writes."""
        kv = kv_of(req.all_token_ids, end)
        for g in range(self.mgr.memory.num_groups):
            bs = self.mgr.memory.shapes[g].block_size
            for t in range(end // bs * bs):
                slot = self._slot(req, g, t)
                want = np.resize(np.frombuffer(kv[t], np.uint8), slot.size)
                self.mismatches += int(not np.array_equal(slot, want))

    def admit(self, budget: int, batch: list[tuple[Request, int]]) -> int:
        while self.waiting and budget > 0 and len(self.running) < 8:
            req, lookup = self.waiting[0]
            if not lookup.done():
                break  # FCFS: wait for the head's lookup
            adm = self.mgr.allocate(req, lookup.result(), num_new_tokens=budget)
            if adm is None:
                break  # no room now
            self.waiting.popleft()
            for tier, n in {"device": adm.local_tokens, **adm.external_by_tier}.items():
                self.hits[tier] = self.hits.get(tier, 0) + n
            if adm.loading:  # WAITING_FOR_REMOTE_KVS: resumes when the load ended
                self.loading.add(asyncio.create_task(self._load(req)))
                continue
            self.checks.append((req, adm.local_tokens))
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            batch.append((req, adm.num_new_tokens))
            budget -= adm.num_new_tokens
        return budget

    async def _load(self, req: Request) -> tuple[Request, LoadOutcome]:
        return req, await self.mgr.wait_load(req)

    def loaded(self, req: Request, outcome: LoadOutcome) -> None:
        if outcome.status is LoadStatus.FAILED:  # load_failure_policy: fail
            req.status = RequestStatus.FINISHED_ERROR
            self.mgr.finish(req)
        elif outcome.num_computed_tokens == 0:  # nothing kept, blocks freed: start over
            self.waiting.appendleft((req, asyncio.create_task(self.mgr.lookup(req))))
        else:  # it holds its blocks, the verified prefix computed: it only grows
            self.check(req, outcome.num_computed_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)

    def grow(self, budget: int, batch: list[tuple[Request, int]]) -> int:
        for req in list(self.running):
            if budget <= 0:
                break
            n = min(budget, req.num_tokens - req.num_computed_tokens)
            adm = self.mgr.allocate(req, num_new_tokens=n)
            if adm is None:  # no room: give the blocks back, start over later
                self.running.remove(req)
                self.mgr.preempt(req)
                self.waiting.appendleft((req, asyncio.create_task(self.mgr.lookup(req))))
                continue
            batch.append((req, adm.num_new_tokens))
            budget -= adm.num_new_tokens
        return budget

    async def serve(self) -> None:
        while self.waiting or self.running or self.loading:
            for task in [t for t in self.loading if t.done()]:
                self.loading.discard(task)
                self.loaded(*task.result())
            batch: list[tuple[Request, int]] = []
            self.admit(self.grow(BUDGET, batch), batch)
            if not batch:
                await asyncio.sleep(0.001)  # lookups and loads run meanwhile
                continue
            self.model_step(batch)
            await asyncio.sleep(0)  # the GPU's time: the tiers' I/O runs meanwhile
            for req, end in self.checks:
                self.check(req, end)
            self.checks.clear()
            self.mgr.after_step([req for req, _ in batch])
            for req, _ in batch:
                if req.num_output_tokens >= MAX_TOKENS:
                    self.running.remove(req)
                    req.status = RequestStatus.FINISHED_LENGTH_CAPPED
                    self.mgr.finish(req)


def prompts(tenants: list[str]) -> list[tuple[str, list[int]]]:
    system = list(range(1000, 1096))  # a 96-token system prompt every request starts with
    return [(tenants[i % len(tenants)], [*system, *range(5000 + 100 * i, 5040 + 100 * i)])
            for i in range(12)]


async def main_async(config: str | None = None) -> dict[str, Any]:
    async with load_plugin(config) as plugin:
        mgr = plugin.manager
        declared = plugin.config.tenants.declared
        work = prompts(list(declared) if declared else ["acme", "globex"])
        passes = []
        for p in range(2):
            engine = ToyEngine(mgr)
            for i, (tenant, prompt) in enumerate(work):
                engine.add(f"pass{p}-{i}", tenant, prompt)
            await engine.serve()
            await mgr.drain()  # stores done: the tiers hold every chunk
            passes.append({"hit_tokens": engine.hits, "mismatches": engine.mismatches})
            mgr.core.reset_prefix_cache()  # the device forgets: pass 2 reads the tiers
        pool = mgr.core.block_pool
        leaked = pool.num_gpu_blocks - 1 - pool.get_num_free_blocks() + mgr.num_pending_jobs
        return {"tiers": plugin.tier_labels, "passes": passes, "leaked_blocks": leaked}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main_async(sys.argv[1] if len(sys.argv) > 1 else None))))
