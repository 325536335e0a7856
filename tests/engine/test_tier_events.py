"""A router subscribed to the native engine's KV events believes what the tiers hold.

A run with both tiers far smaller than its working set (every tier evicts), its event
stream (``Engine.event_sinks``: the device cache's events, then the tiers') applied as a
KV-aware router applies vLLM's: BlockStored adds a block in its medium, BlockRemoved takes
it away. At the end the router's blocks per medium must be exactly the blocks of the
objects each tier holds.
"""

from __future__ import annotations

from collections import defaultdict

import pytest
from engine_testlib import conversations, serve_all, small_config

from kvplugin.aio.jobs import connector_tiers
from kvplugin.aio.tier_events import tier_medium
from kvplugin.core.events import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent
from kvplugin.engine.build import deployment

pytestmark = pytest.mark.asyncio


class Router:
    def __init__(self) -> None:
        self.blocks: dict[str, set[tuple[int | None, int]]] = defaultdict(set)
        self.seen: dict[str, int] = defaultdict(int)

    def apply(self, events: list[KVCacheEvent]) -> None:
        for e in events:
            if isinstance(e, BlockStored):
                self.blocks[str(e.medium)].update((e.group_idx, h) for h in e.block_hashes)
                self.seen[f"stored {e.medium}"] += 1
            elif isinstance(e, BlockRemoved):
                self.blocks[str(e.medium)].difference_update(
                    (e.group_idx, h) for h in e.block_hashes)
                self.seen[f"removed {e.medium}"] += 1
            else:
                assert isinstance(e, AllBlocksCleared)
                self.blocks.clear()


async def test_a_router_believes_exactly_what_the_tiers_hold() -> None:
    cfg = small_config(blocks=32, disk=True, offload={
        "max_local_cpu_size": 12e-6, "max_local_disk_size": 30e-6})
    router = Router()
    async with deployment(cfg) as dep:
        assert dep.mgr.tier_events is not None
        dep.engine.event_sinks.append(router.apply)
        reqs = conversations(40, seed=1)
        await serve_all(dep.engine, reqs)
        # The same prompts again: loads from both tiers, promotions, more evictions.
        await serve_all(dep.engine, [(f"again-{rid}", p, t, m) for rid, p, t, m in reqs])
        await dep.mgr.drain()
        dep.engine.flush_events()
        view = dep.mgr.tier_events
        tiers = connector_tiers(dep.connector)
        assert [t.capabilities.tier for t in tiers] == ["memory", "disk"]
        for tier in tiers:
            medium = tier_medium(tier.capabilities.tier)
            held = tier.objects()  # type: ignore[attr-defined]
            assert tier.stats().evicted > 0, f"{medium} never evicted: the test proves little"
            truth = {(info.group, h) for sid in held
                     for info in [view._info[sid]] for h in info.block_hashes}
            assert router.blocks[medium] == truth, medium
            assert router.seen[f"removed {medium}"] > 0
        assert router.seen["stored GPU"] > 0  # the device cache's events share the stream
        assert dep.engine.stats.tier_events == sum(
            v for k, v in router.seen.items() if not k.endswith("GPU"))
