"""The tier lookup both engines run (kvplugin.aio.probe): the same answer from a tiered
connector asked by level or as one store, and one deadline for all its questions."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import time
from collections.abc import Sequence

import pytest

from kvplugin.aio import plans
from kvplugin.aio.keys import KeySpace
from kvplugin.aio.memory import PageShape, StateShape, layout_of
from kvplugin.aio.probe import STATE_PROBES, ask_tiers
from kvplugin.connectors.base import Deadline
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.serde import Block

BS = 16
FULL = PageShape(2, 2, 4, "float32", BS)
STATE = StateShape(2, 64, 64, ((4, 4),), ("float32",))
HASHES = [hashlib.sha256(f"b{i}".encode()).digest() for i in range(40)]


class SlowLookups(MemoryConnector):
    """A memory tier whose every lookup takes ``delay`` s and records the timeout it got."""

    def __init__(self, delay: float) -> None:
        super().__init__(capacity_bytes=1 << 20)
        self.delay = delay
        self.timeouts: list[float] = []

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        self.timeouts.append(timeout)
        await asyncio.sleep(self.delay)
        return await super().lookup(keys, timeout=timeout)


async def _put(conn: MemoryConnector, keys: list[ObjectKey]) -> None:
    await conn.put([(k, Block(k.meta(token_start=0, token_end=BS, dtype="uint8", shape=(8,)),
                              bytes(8))) for k in keys], timeout=5)


def _ask(conn: MemoryConnector | TieredConnector, keys: KeySpace, lay: plans.Layout,
         num_tokens: int, timeout: float, by_level: bool) -> plans.TierHit:
    hit = plans.LocalHit(0, 0)
    hash_tokens = num_tokens // BS * BS
    windows = plans.lookup_window(lay, num_tokens, 0, hash_tokens)
    chunk_keys = [keys.chunk_keys("t", g, HASHES, w.start, w.stop) if lay.chunked(g) else []
                  for g, w in enumerate(windows)]

    def state_keys(n: int) -> list[ObjectKey]:
        return [keys.state_key("t", g, HASHES, n) for g in lay.state_groups]

    async def main() -> plans.TierHit:
        async with asyncio.timeout(timeout):
            answer = await ask_tiers(conn, lay, windows, chunk_keys, state_keys,
                                     num_tokens=num_tokens, num_hash_tokens=hash_tokens,
                                     hit=hit, deadline=Deadline.after(timeout),
                                     by_level=by_level)
        return answer.tier_hit()
    return asyncio.run(main())


def test_by_level_or_as_one_store_the_tiers_reach_as_far() -> None:
    keys = KeySpace("m", [FULL, STATE], BS)
    lay = layout_of([FULL, STATE], 1, BS)
    fast = MemoryConnector(capacity_bytes=1 << 20, name="fast")
    slow = MemoryConnector(capacity_bytes=1 << 20, name="slow")
    asyncio.run(_put(fast, keys.chunk_keys("t", 0, HASHES, 0, 4)))
    asyncio.run(_put(slow, keys.chunk_keys("t", 0, HASHES, 4, 9)))
    asyncio.run(_put(slow, [keys.state_key("t", 1, HASHES, n) for n in (64, 128)]))
    tiered = TieredConnector([fast, slow])
    for by_level in (True, False):
        tier = _ask(tiered, keys, lay, 160, 5.0, by_level)
        assert tier == plans.TierHit((0, 0), (9, 0), frozenset({128})), by_level


def test_every_question_shares_one_deadline() -> None:
    # Mamba with no state stored: the state boundaries are asked STATE_PROBES at a time,
    # one batch after another, each batch within what is left of the one deadline.
    keys = KeySpace("m", [FULL, STATE], BS)
    lay = layout_of([FULL, STATE], 1, BS)
    conn = SlowLookups(0.05)
    asyncio.run(_put(conn, keys.chunk_keys("t", 0, HASHES, 0, 39)))
    started = time.monotonic()
    tier = _ask(conn, keys, lay, 39 * BS + 1, 5.0, by_level=False)
    took = time.monotonic() - started
    assert tier == plans.TierHit((0, 0), (39, 0), frozenset())
    batches = -(-39 // STATE_PROBES)  # 39 candidate boundaries
    assert len(conn.timeouts) == 1 + 39
    # One chunk lookup, then each batch's calls get what is left: strictly less each batch.
    firsts = [conn.timeouts[1 + b * STATE_PROBES] for b in range(batches)]
    assert all(later < earlier - 0.04 for earlier, later in itertools.pairwise(firsts))
    assert conn.timeouts[0] <= 5.0 and 5.0 - firsts[-1] <= took
    # A deadline too short for every batch: the whole lookup times out, not each call.
    conn.timeouts.clear()
    with pytest.raises(TimeoutError):
        _ask(conn, keys, lay, 39 * BS + 1, 0.12, by_level=False)
    assert len(conn.timeouts) <= 1 + 2 * STATE_PROBES
