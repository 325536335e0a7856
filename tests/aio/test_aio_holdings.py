"""Tier bytes held per tenant (kvplugin.aio.holdings), from the tiers' events, exactly."""

from __future__ import annotations

from kvplugin.aio.holdings import TierHoldings
from kvplugin.connectors.events import TierEvent
from kvplugin.connectors.faults import FaultInjector, FaultPlan
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.tiered import TieredConnector


def stored(tier: str, *ids: str) -> TierEvent:
    return TierEvent("stored", tier, ids)


def removed(tier: str, *ids: str, reason: str = "evicted") -> TierEvent:
    return TierEvent("removed", tier, ids, reason)


def test_charged_when_stored_released_when_removed_per_tier() -> None:
    h = TierHoldings()
    h.expect("a", [("x", 100), ("y", 30)])
    assert h.held("a", "memory") == 0  # expected, not yet stored anywhere
    h.apply([stored("memory", "x", "y"), stored("disk", "x"), stored("memory", "x")])
    assert (h.held("a", "memory"), h.held("a", "disk")) == (130, 100)  # a repeat is no news
    h.settle(["x", "y"])
    h.apply([removed("memory", "x"), removed("memory", "x"), removed("redis", "y")])
    assert (h.held("a", "memory"), h.held("a", "disk"), len(h)) == (30, 100, 2)
    h.apply([TierEvent("cleared", "disk", (), "closed")])
    assert (h.held("a", "disk"), len(h)) == (0, 1)  # x is on no tier now: forgotten
    h.apply([removed("memory", "y", reason="deleted")])
    assert (h.held("a", "memory"), len(h)) == (0, 0)


def test_unknown_objects_the_first_writer_and_failed_writes() -> None:
    h = TierHoldings()
    h.apply([stored("memory", "z")])  # not ours (another process, a recovered index)
    assert len(h) == 0 and h.held("a", "memory") == 0
    h.expect("a", [("s", 10)])
    h.expect("b", [("s", 10)])  # a shared prefix object: charged once, to its first writer
    h.apply([stored("memory", "s")])
    assert (h.held("a", "memory"), h.held("b", "memory")) == (10, 0)
    h.expect("a", [("f", 7)])
    h.settle(["f"])  # its write failed: no stored event, nothing kept
    h.settle(["s", "s"])
    assert len(h) == 1 and h.held("a", "memory") == 10


def test_which_connectors_report_their_objects() -> None:
    class Silent(MemoryConnector):
        @property
        def reports_objects(self) -> bool:
            return False

    mem = MemoryConnector(capacity_bytes=1 << 20)
    assert mem.reports_objects
    assert FaultInjector(MemoryConnector(capacity_bytes=1 << 20), FaultPlan(),
                         seed=0).reports_objects
    top = MemoryConnector(capacity_bytes=1 << 20, name="top")
    assert TieredConnector([top, mem]).reports_objects
    silent = Silent(capacity_bytes=1 << 20)
    assert not TieredConnector([top, silent]).reports_objects
