"""The fault injector itself: seeded, each fault kind does what it says, deadlines hold."""

from __future__ import annotations

import asyncio
import contextlib
import random
import time

import pytest
from conn_testlib import T, make_items, namespace, same

from kvplugin.connectors.base import CircuitBreaker, ConnectorTimeout
from kvplugin.connectors.faults import FaultInjector, FaultPlan, InjectedFault
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.serde import Block

pytestmark = pytest.mark.asyncio
MIB = 1 << 20


def wrap(plan: FaultPlan, seed: int = 7) -> FaultInjector:
    return FaultInjector(MemoryConnector(capacity_bytes=MIB), plan, seed=seed)


async def run_script(conn: FaultInjector) -> list[object]:
    items = make_items(namespace("fixed-tenant"), 20, seed=3)
    trace: list[object] = []
    for key, block in items:
        try:
            trace.append(await conn.put([(key, block)], timeout=T))
        except InjectedFault:
            trace.append("error")
        got = await conn.get([key], timeout=T)
        trace.append(got[0] is not None)
    return trace


async def test_same_seed_same_faults() -> None:
    plan = FaultPlan(error_rate=0.3, drop_write_rate=0.3, corrupt_write_rate=0.3)
    async with wrap(plan, seed=11) as a, wrap(plan, seed=11) as b, wrap(plan, seed=12) as c:
        ta, tb, tc = await run_script(a), await run_script(b), await run_script(c)
        assert ta == tb and a.injected == b.injected
        assert ta != tc


async def test_global_random_state_is_untouched() -> None:
    state = random.getstate()
    async with wrap(FaultPlan(error_rate=0.5, corrupt_write_rate=0.5)) as conn:
        await run_script(conn)
    assert random.getstate() == state


async def test_benign_plan_is_transparent() -> None:
    plan = FaultPlan()
    assert plan.benign
    async with wrap(plan) as conn:
        trace = await run_script(conn)
        assert all(t is True or t == 1 for t in trace)
        assert conn.injected.errors == conn.injected.dropped == conn.injected.corrupted == 0


async def test_errors_make_reads_miss_and_writes_raise() -> None:
    items = make_items(namespace(), 1)
    async with wrap(FaultPlan(error_rate=1.0)) as conn:
        await conn.inner.put(items, timeout=T)
        assert await conn.get([items[0][0]], timeout=T) == [None]
        assert await conn.lookup([items[0][0]], timeout=T) == 0
        with pytest.raises(InjectedFault):
            await conn.put(items, timeout=T)
        with pytest.raises(InjectedFault):
            await conn.delete([items[0][0]], timeout=T)
        assert not (await conn.health(timeout=T)).ok
        assert conn.stats().errors >= 4 and conn.stats().misses >= 1


async def test_latency_beyond_the_deadline_becomes_a_timeout() -> None:
    items = make_items(namespace(), 1)
    async with wrap(FaultPlan(latency_rate=1.0, latency=30.0), seed=1) as conn:
        async with asyncio.timeout(5):  # liveness: each call ends at its 0.05 s deadline
            assert await conn.get([items[0][0]], timeout=0.05) == [None]
            with pytest.raises(ConnectorTimeout):
                await conn.put(items, timeout=0.05)
        assert conn.stats().timeouts == 2


async def test_dropped_writes_are_reported_stored_but_absent() -> None:
    items = make_items(namespace(), 3)
    async with wrap(FaultPlan(drop_write_rate=1.0)) as conn:
        assert await conn.put(items, timeout=T) == 3
        assert await conn.lookup([k for k, _ in items], timeout=T) == 0
        assert conn.stats().dropped == 3


async def test_corrupted_writes_are_caught_by_the_wrapped_connector() -> None:
    items = make_items(namespace(), 10)
    async with wrap(FaultPlan(corrupt_write_rate=1.0)) as conn:
        await conn.put(items, timeout=T)
        assert await conn.inner.lookup([k for k, _ in items], timeout=T) == 10  # stored...
        assert await conn.get([k for k, _ in items], timeout=T) == [None] * 10  # ...unusable
        assert conn.stats().corrupt_detected == 10 == conn.injected.corrupted
        assert await conn.inner.lookup([k for k, _ in items], timeout=T) == 0  # and deleted


async def test_partially_faulty_connector_never_returns_wrong_data() -> None:
    items = make_items(namespace(), 60, nbytes=512)
    plan = FaultPlan(error_rate=0.2, drop_write_rate=0.2, corrupt_write_rate=0.3)
    async with wrap(plan, seed=5) as conn:
        for item in items:
            with contextlib.suppress(InjectedFault):
                await conn.put([item], timeout=T)
        got = await conn.get([k for k, _ in items], timeout=T)
        assert all(g is None or same(g, b) for g, (_, b) in zip(got, items, strict=True))


@pytest.mark.parametrize(
    "kwargs",
    [{"error_rate": 1.5}, {"drop_write_rate": -0.1}, {"latency": -1.0}, {"corrupt_write_rate": 2},
     {"get_delay": -0.01}, {"get_delay": float("nan")}],
)
async def test_plan_is_validated(kwargs: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        FaultPlan(**kwargs)


async def test_get_delay_slows_every_get_and_nothing_else() -> None:
    items = make_items(namespace(), 3)
    keys = [k for k, _ in items]
    plan = FaultPlan(get_delay=0.05)
    assert not plan.benign and plan.get_delay == 0.05
    async with wrap(plan) as conn:
        assert await conn.put(items, timeout=T) == 3
        assert await conn.lookup(keys, timeout=T) == 3
        assert await conn.delete(keys[2:], timeout=T) == 1
        assert conn.injected.throttled == 0  # lookups, puts and deletes wait for nothing
        for n in (1, 2):
            began = time.perf_counter()
            got = await conn.get(keys, timeout=T)
            assert time.perf_counter() - began >= 0.05
            assert [g is not None and same(g, b) for g, (_, b) in zip(got, items, strict=True)] \
                == [True, True, False]  # then reads as it would have
            assert conn.injected.throttled == n
        assert await conn.get([], timeout=T) == []  # an empty batch does no I/O
        assert conn.injected.throttled == 2
        assert conn.injected.delays == conn.injected.errors == 0  # not a latency roll
        assert conn.stats().errors == conn.stats().timeouts == 0


async def test_a_get_delay_beyond_the_deadline_becomes_a_miss() -> None:
    items = make_items(namespace(), 1)
    async with wrap(FaultPlan(get_delay=30.0)) as conn:
        await conn.put(items, timeout=T)
        async with asyncio.timeout(5):  # liveness: the get ends at its 0.05 s deadline
            assert await conn.get([items[0][0]], timeout=0.05) == [None]
        assert conn.injected.throttled == 1 and conn.stats().timeouts == 1
        assert await conn.lookup([items[0][0]], timeout=0.05) == 1  # not delayed


async def test_circuit_breaker_state_machine() -> None:
    now = [0.0]
    breaker = CircuitBreaker(threshold=2, cooldown=1.0, clock=lambda: now[0])
    assert breaker.acquire() and breaker.state == "closed"
    breaker.failure()
    assert breaker.state == "closed"
    breaker.failure()
    assert breaker.state == "open" and not breaker.acquire()
    now[0] = 1.5
    assert breaker.acquire() and breaker.state == "half_open"
    assert not breaker.acquire(), "one probe at a time"
    breaker.failure()
    assert breaker.state == "open" and not breaker.acquire()
    now[0] = 3.0
    assert breaker.acquire()
    breaker.release()  # a cancelled probe frees the slot
    assert breaker.acquire()
    breaker.success()
    assert breaker.state == "closed" and breaker.acquire()


FAULTS = {
    "none": FaultPlan(),
    "drop": FaultPlan(drop_write_rate=1.0),
    "corrupt": FaultPlan(corrupt_write_rate=1.0),
    "error": FaultPlan(error_rate=1.0),
    "late": FaultPlan(latency_rate=1.0, latency=30.0),  # cut by the deadline, or cancelled
}


@pytest.mark.parametrize("ending", ["returns", "is cancelled"])
@pytest.mark.parametrize("fault", sorted(FAULTS))
async def test_no_fault_uses_the_callers_payload_after_put_ended(fault: str, ending: str) -> None:
    # However put ends, a payload the caller changes afterwards never reaches the store as a
    # valid object: no injected fault works on it in the background, or in place.
    [(key, block)] = make_items(namespace(), 1)
    payload = bytearray(block.payload)
    async with wrap(FAULTS[fault]) as conn:
        call = asyncio.ensure_future(conn.put([(key, Block(block.meta, payload))], timeout=0.05))
        if ending == "is cancelled":
            await asyncio.sleep(0)
            call.cancel()
        with contextlib.suppress(InjectedFault, ConnectorTimeout, asyncio.CancelledError):
            await call
        payload[:] = bytes(len(payload))
        await asyncio.sleep(0.1)  # anything left running would have run by now
        stored = (await conn.inner.get([key], timeout=T))[0]
        assert stored is None or same(stored, block), "a changed payload was stored as valid"
