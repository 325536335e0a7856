"""Eviction policies: hit rates of LRU and ARC on one tier, on the same request stream.

**The workload** is LMCache's multi-round QA (:class:`kvplugin.engine.workload.MultiRoundQA`,
its arrival rule: ``--users`` users at once, a user's rounds ``users / qps`` apart, a new
user every ``(rounds - 1) / qps``, pre-seeded users staggered), scaled by 1/10 as in
``benchmarks/end_to_end.py``: a 100-token system prompt shared by every user, a 2,000-token
history, 20-token questions, 100-token answers, 10 rounds. Each request looks up its
prompt's chunks (``--chunk-tokens`` tokens each, keyed as the manager keys them: a chunk
wholly inside the shared system prompt is shared, every later one is the user's), reads the
prefix found (``get``: a hit for the policy) and stores its prompt and answer (``put``:
present chunks are hits too, as in the manager's store path).

**The scan-polluted mix** adds one-off long prompts between the conversations (a document
summarised once, a batch job): after every ``--scan-every`` conversation requests, a prompt
of ``--scan-tokens`` unique tokens is looked up (a miss) and stored, read once and never
again.

The tier is the real :class:`~kvplugin.connectors.memory.MemoryConnector` (or the
:class:`~kvplugin.connectors.disk.DiskConnector` with ``--tier disk``) with ``--capacity``
as a fraction of the conversations' working set (every user's conversation at its longest),
objects of ``--object-bytes``. The hit rate counts the conversations' looked-up chunks found
in the tier (one-off prompts can never hit and are left out); each figure is the median over
``--seeds`` streams (send times jittered by up to half a gap per seed). The last line is
JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import random
import statistics
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass

from kvplugin.connectors.base import Connector, PutItem
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.keys import Namespace, ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.engine.workload import MultiRoundQA
from kvplugin.serde import Block

TIMEOUT = 30.0
# The scalar options and their defaults (see the module's doc).
OPTIONS: dict[str, int | float] = {
    "--users": 40, "--qps": 4.0, "--duration-s": 120.0, "--chunk-tokens": 64,
    "--object-bytes": 256, "--scan-every": 2, "--scan-tokens": 4000, "--seeds": 3}
NS = Namespace(tenant="bench", model="bench/model", layout="0" * 32)


@dataclass(frozen=True, slots=True)
class Request:
    user: str  # "" for a one-off prompt
    tokens: int  # the prompt
    stored: int  # prompt and answer: what is stored after it


def stream(shape: MultiRoundQA, seed: int, scan_every: int, scan_tokens: int
           ) -> list[Request]:
    """Every round of every user in send order (jittered), one-off prompts interleaved."""
    rng = random.Random(seed)
    sends = []
    for user, first, at in shape.starts():
        for r in range(first, shape.rounds):
            t = at + (r - first) * shape.gap_s + rng.uniform(0, shape.gap_s / 2)
            if t < shape.duration_s:
                sends.append((t, user, r))
    sends.sort()
    out = []
    for i, (_, user, r) in enumerate(sends):
        p = shape.prompt_len(r)
        out.append(Request(user, p, p + shape.answer_len))
        if scan_every and (i + 1) % scan_every == 0:
            out.append(Request("", scan_tokens, scan_tokens))
    return out


class Keys:
    """Chunk ids as the manager's chain keys name them: a chunk inside the shared system
    prompt is everyone's, a later one its user's, a one-off prompt's its own."""

    def __init__(self, shape: MultiRoundQA, chunk_tokens: int, object_bytes: int) -> None:
        self.shared_chunks = shape.system_prompt_len // chunk_tokens
        self.chunk_tokens = chunk_tokens
        self.payload = bytes(object_bytes)
        self._cache: dict[tuple[str, int], ObjectKey] = {}
        self._scans = 0

    def of(self, req: Request, n: int) -> list[ObjectKey]:
        owner = req.user
        if not owner:
            self._scans += 1
            owner = f"scan-{self._scans}"
        return [self._key("" if i < self.shared_chunks else owner, i) for i in range(n)]

    def _key(self, owner: str, i: int) -> ObjectKey:
        key = self._cache.get((owner, i))
        if key is None:
            key = NS.key(hashlib.sha256(f"{owner}/{i}".encode()).digest())
            self._cache[(owner, i)] = key
        return key

    def item(self, key: ObjectKey, i: int) -> PutItem:
        meta = key.meta(token_start=i * self.chunk_tokens,
                        token_end=(i + 1) * self.chunk_tokens,
                        dtype="uint8", shape=(1, len(self.payload)))
        return key, Block(meta, self.payload)


async def replay(conn: Connector, reqs: Sequence[Request], keys: Keys) -> dict[str, int]:
    looked = hit = 0
    for req in reqs:
        n = req.tokens // keys.chunk_tokens
        chain = keys.of(req, req.stored // keys.chunk_tokens)
        found = await conn.lookup(chain[:n], timeout=TIMEOUT)
        if found:
            await conn.get(chain[:found], timeout=TIMEOUT)
        if req.user:
            looked += n
            hit += found
        await conn.put([keys.item(k, i) for i, k in enumerate(chain)], timeout=TIMEOUT)
    return {"looked_up": looked, "hits": hit}


def object_size(keys: Keys) -> int:
    async def one() -> int:
        async with MemoryConnector(capacity_bytes=1 << 30) as m:
            await m.put([keys.item(NS.key(bytes(32)), 0)], timeout=TIMEOUT)
            return m.used_bytes
    return asyncio.run(one())


def run_one(shape: MultiRoundQA, args: argparse.Namespace, policy: str, seed: int,
            scan: bool) -> float:
    keys = Keys(shape, args.chunk_tokens, args.object_bytes)
    ws_chunks = shape.working_set_tokens // args.chunk_tokens
    capacity = int(ws_chunks * args.capacity * object_size(keys))
    reqs = stream(shape, seed, args.scan_every if scan else 0, args.scan_tokens)

    async def main() -> dict[str, int]:
        with tempfile.TemporaryDirectory() as tmp:
            conn: Connector = (
                MemoryConnector(capacity_bytes=capacity, eviction=policy)
                if args.tier == "memory" else
                DiskConnector(tmp, capacity_bytes=capacity, eviction=policy, io_threads=1))
            async with conn:
                return await replay(conn, reqs, keys)
    got = asyncio.run(main())
    return got["hits"] / got["looked_up"]


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for flag, default in OPTIONS.items():
        ap.add_argument(flag, type=type(default), default=default)
    ap.add_argument("--capacity", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0])
    ap.add_argument("--tier", choices=("memory", "disk"), default="memory")
    ap.add_argument("--quick", action="store_true", help="fewer users, shorter, 3 seeds")
    args = ap.parse_args(argv)
    if args.quick:
        args.users, args.duration_s = 20, 60.0
    shape = MultiRoundQA(users=args.users, rounds=10, qps=args.qps,
                         duration_s=args.duration_s, system_prompt_len=100,
                         history_len=2000, question_len=20, answer_len=100)
    rows: list[dict[str, object]] = []
    for mix in ("multi-round QA", "scan-polluted"):
        for cap in args.capacity:
            rate = {policy: statistics.median(
                run_one(shape, _with(args, cap), policy, seed, mix == "scan-polluted")
                for seed in range(args.seeds)) for policy in ("lru", "arc")}
            ratio = rate["arc"] / max(rate["lru"], 1e-9)
            rows.append({"mix": mix, "capacity": cap, "lru": round(rate["lru"], 4),
                         "arc": round(rate["arc"], 4), "arc_over_lru": round(ratio, 3)})
            print(f"{mix:>15}  capacity {cap:.2f}  LRU {rate['lru']:.3f}  ARC "
                  f"{rate['arc']:.3f}  ARC/LRU {ratio:.3f}", flush=True)
    print(json.dumps({"tier": args.tier, "users": args.users, "qps": args.qps,
                      "duration_s": args.duration_s, "chunk_tokens": args.chunk_tokens,
                      "scan_every": args.scan_every, "scan_tokens": args.scan_tokens,
                      "seeds": args.seeds, "rows": rows}))
    return 0


def _with(args: argparse.Namespace, cap: float) -> argparse.Namespace:
    out = argparse.Namespace(**vars(args))
    out.capacity = cap
    return out


if __name__ == "__main__":
    raise SystemExit(main())
