"""The offload ledger's keyed verbs (vLLM's secondary tier names its objects itself): the
same quota, deduplication and budget rules as ``prepare_store``, the same plan lifecycle,
and loads booked per tenant."""

from __future__ import annotations

import pytest

from kvplugin.aio import plans
from kvplugin.aio.offload_ledger import (
    OffloadLedger,
    PlanError,
    StoreObject,
    StoreResult,
    TierQuotas,
)
from kvplugin.connectors.events import TierEvent
from kvplugin.connectors.keys import Namespace

ROW = 4096
NS = Namespace("a", "m", "0" * 32)


def _ledger(budget: int | None = 10 * ROW, quotas: TierQuotas | None = None) -> OffloadLedger:
    return OffloadLedger(plans.Layout((16,), 1), None, page_bytes=[ROW], tiers=("memory",),
                         store_budget_bytes=budget, quotas=quotas or TierQuotas(),
                         reporting=("memory",))


def _obj(n: int, ns: Namespace = NS) -> StoreObject:
    return StoreObject(0, n, ns.key(n.to_bytes(8, "big")), (), ROW)


def test_a_keyed_ledger_has_no_keyspace_for_request_plans() -> None:
    with pytest.raises(PlanError, match="no key space"):
        _ = _ledger().keyspace


def test_a_keyed_store_is_registered_deduplicated_and_completed_once() -> None:
    led = _ledger()
    rq = led.open("r", "a", "a", 0)
    plan = led.prepare_keyed_store(rq, [_obj(0), _obj(1)])
    assert plan is not None and [o.index for o in plan.objects] == [0, 1]
    assert led.storing(_obj(0).key.id) and led.bytes_in_flight == 2 * ROW
    # A second job of the same objects while the first runs: both deduplicated.
    assert led.prepare_keyed_store(led.open("s", "a", "a", 0), [_obj(0), _obj(1)]) is None
    assert led.tenant("a").stores_deduplicated == 2
    led.complete_store(plan, StoreResult(True, (2,)))
    assert not led.storing(_obj(0).key.id) and led.bytes_in_flight == 0
    c = led.tenant("a")
    assert (c.stored_chunks, c.stored_bytes, c.stored_bytes_by_tier) == (2, 2 * ROW,
                                                                         {"memory": 2 * ROW})
    with pytest.raises(PlanError, match="completed twice"):
        led.complete_store(plan, StoreResult(True, (2,)))


def test_a_keyed_store_over_the_budget_is_shed() -> None:
    led = _ledger(budget=3 * ROW)
    rq = led.open("r", "a", "a", 0)
    plan = led.prepare_keyed_store(rq, [_obj(i) for i in range(5)])
    assert plan is not None and len(plan.objects) == 3
    c = led.tenant("a")
    assert (c.stores_shed, c.stores_shed_quota) == (2, 0)


def test_a_keyed_store_over_the_tenants_quota_is_shed_whole() -> None:
    led = _ledger(quotas=TierQuotas(tenants={"a": {"memory": 2 * ROW}}))
    rq = led.open("r", "a", "a", 0)
    first = led.prepare_keyed_store(rq, [_obj(0), _obj(1)])
    assert first is not None
    # Held bytes come from the tier's events (applied before the plan completes, as an
    # executor does): the first two landed.
    led.apply_tier_events([TierEvent("stored", "memory", (_obj(0).key.id, _obj(1).key.id))])
    led.complete_store(first, StoreResult(True, (2,)))
    assert led.prepare_keyed_store(rq, [_obj(2)]) is None
    c = led.tenant("a")
    assert (c.stores_shed, c.stores_shed_quota) == (1, 1)
    # The tier evicted one: room again.
    led.apply_tier_events([TierEvent("removed", "memory", (_obj(0).key.id,), "evicted")])
    assert led.prepare_keyed_store(rq, [_obj(2)]) is not None


def test_keyed_loads_are_booked_per_tenant_and_tier() -> None:
    led = _ledger()
    led.book_keyed_load("a", copied=[("memory", ROW, False), ("disk", ROW, False)],
                        failed=False)
    led.book_keyed_load("a", copied=[("disk", ROW, False)], failed=True)
    c, s = led.tenant("a"), led.stats
    assert (c.loads, c.loads_failed, c.loaded_bytes) == (2, 1, 3 * ROW)
    assert s.loaded_chunks == 3 and s.loaded_bytes_by_tier == {"memory": ROW,
                                                               "disk": 2 * ROW}
