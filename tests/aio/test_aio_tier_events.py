"""TierEventView: the tiers' id events become exact KV-cache events, told once each."""

from __future__ import annotations

from kvplugin.aio.tier_events import (
    ObjectInfo,
    TierEventView,
    describe_chunk,
    describe_state,
    tier_medium,
)
from kvplugin.connectors.events import TierEvent
from kvplugin.core.events import AllBlocksCleared, BlockRemoved, BlockStored

H = [bytes([i]) * 31 + bytes([i + 1]) for i in range(6)]  # 32-byte chained hashes
INT = [int.from_bytes(h[-8:], "big") for h in H]


def stored(tier: str, *ids: str) -> TierEvent:
    return TierEvent("stored", tier, ids)


def removed(tier: str, *ids: str, reason: str = "evicted") -> TierEvent:
    return TierEvent("removed", tier, ids, reason)


def test_a_chunk_is_described_by_its_blocks_parent_and_tokens() -> None:
    info = describe_chunk(H, list(range(100, 124)), 1, 8, 16, 4, 4)
    assert info == ObjectInfo(1, (INT[2], INT[3]), INT[1], tuple(range(108, 116)), 4)
    # Blocks of 8 tokens over hashes of 4: a block's hash is the one ending at its end.
    assert describe_chunk(H, list(range(24)), 0, 0, 16, 4, 8) == ObjectInfo(
        0, (INT[1], INT[3]), None, tuple(range(16)), 8)
    assert describe_state(H, list(range(24)), 2, 12, 4) == ObjectInfo(
        2, (INT[2],), INT[1], (8, 9, 10, 11), 4)


def test_events_are_told_once_per_tier_and_taken_back_exactly() -> None:
    view = TierEventView()
    info = describe_chunk(H, list(range(24)), 0, 0, 8, 4, 4)
    view.describe("a", info)
    out = view.apply([stored("memory", "a"), stored("disk", "a"), stored("memory", "a"),
                      stored("memory", "stranger")])
    assert out == [
        BlockStored([INT[0], INT[1]], None, list(range(8)), 4, None, "CPU", None,
                    group_idx=0, ownership="kvplugin"),
        BlockStored([INT[0], INT[1]], None, list(range(8)), 4, None, "DISK", None,
                    group_idx=0, ownership="kvplugin")]
    view.settle(["a"])
    assert view.apply([removed("memory", "a"), removed("redis", "a")]) == [
        BlockRemoved([INT[0], INT[1]], "CPU", group_idx=0, ownership="kvplugin")]
    assert view.believed() == {"disk": {"a"}} and len(view) == 1
    assert view.apply([TierEvent("cleared", "disk", (), "closed")]) == [
        BlockRemoved([INT[0], INT[1]], "DISK", group_idx=0, ownership="kvplugin")]
    assert view.believed() == {} and len(view) == 0  # nothing held: forgotten


def test_one_tiers_removal_before_anothers_store_in_one_batch() -> None:
    # A composite lists its tiers' events one tier after another.
    view = TierEventView()
    view.describe("a", describe_chunk(H, list(range(24)), 0, 0, 4, 4, 4))
    view.settle(["a"])
    out = view.apply([stored("memory", "a"), removed("memory", "a"), stored("disk", "a")])
    assert [type(e).__name__ + str(e.medium) for e in out] == [  # type: ignore[union-attr]
        "BlockStoredCPU", "BlockRemovedCPU", "BlockStoredDISK"]
    assert view.believed() == {"disk": {"a"}}


def test_bounds_make_the_subscriber_believe_less_never_more() -> None:
    view = TierEventView(max_objects=2, max_events=8)
    for i, sid in enumerate("abc"):
        view.describe(sid, describe_chunk(H, list(range(24)), 0, 4 * i, 4 * i + 4, 4, 4))
        view.apply([stored("memory", sid)])
    assert len(view) == 2 and view.believed() == {"memory": {"b", "c"}}
    overflow = TierEventView(max_events=2)
    for sid in "xyz":
        overflow.describe(sid, describe_chunk(H, list(range(24)), 0, 0, 4, 4, 4))
    assert overflow.apply([stored("redis", "x", "y", "z")]) == [AllBlocksCleared()]
    assert overflow.overflows == 1 and overflow.believed() == {}
    assert tier_medium("memory") == "CPU" and tier_medium("s3") == "S3"
