"""The token ledger: every prompt token of a finished request booked once, by the pass that
finished it (device, a tier, computed, recomputed, unprocessed), summing to the prompt."""

from __future__ import annotations

import pytest
from aio_testlib import BS, FakeModel, evict_device_cache, make_manager, serve
from hypothesis import given, settings
from hypothesis import strategies as st

from kvplugin.aio.ledger import RequestLedger, TokenLedger
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import LoadFailurePolicy, LoadStatus
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.request import RequestStatus

PROMPT = list(range(100, 130))  # 30 tokens: a claim of 7 blocks (28) at most

ZERO = {"device": 0, "computed": 0, "recomputed": 0, "unprocessed": 0, "preemption": 0,
        "failed_load": 0}


def books(**kw: int) -> dict[str, int]:
    return ZERO | kw


# ------------------------------------------------------------------ the pure books
def test_a_hit_then_computing() -> None:
    led = RequestLedger()
    led.admitted(8, {"disk": 12}, 20, True)
    led.load_ended({"disk": 12}, 8, 20, 20)
    led.advanced(26)
    led.advanced(31)  # decode: beyond the prompt
    assert led.attribution(31, 30) == books(device=8, disk=12, computed=10)


def test_a_preemption_recomputes_what_the_device_no_longer_holds() -> None:
    led = RequestLedger()
    led.admitted(4, {}, 4, False)
    led.advanced(20)
    led.preempt(20, 30)  # computed [4, 20) ...
    assert led.discarded == 16
    led.admitted(12, {}, 12, False)  # ... of which [4, 12) still on the device
    assert led.attribution(32, 30) == books(device=12, recomputed=8, preemption=8,
                                            computed=10)


def test_a_failed_load_books_its_claim_as_recomputed() -> None:
    led = RequestLedger()
    led.admitted(4, {"memory": 8, "disk": 16}, 28, True)
    led.load_ended({"memory": 8, "disk": 4}, 4, 28, 16)
    assert led.attribution(31, 30) == books(device=4, memory=8, disk=4, recomputed=12,
                                            failed_load=12, computed=2)


def test_a_load_that_kept_nothing_opens_a_new_pass() -> None:
    led = RequestLedger()
    led.admitted(8, {"disk": 20}, 28, True)
    led.load_ended({}, 8, 28, 0)  # nothing verified: the device hit went back too
    led.admitted(8, {}, 8, False)  # the retry hits the device only (no tier claims)
    assert led.attribution(30, 30) == books(device=8, recomputed=20, failed_load=20,
                                            computed=2)


def test_finished_while_loading_or_before_its_prefill() -> None:
    led = RequestLedger()
    led.admitted(4, {"disk": 24}, 28, True)
    assert led.attribution(28, 30) == books(device=4, unprocessed=26)
    led = RequestLedger()
    led.admitted(4, {}, 4, False)
    led.advanced(12)
    assert led.attribution(12, 30) == books(device=4, computed=8, unprocessed=18)
    assert RequestLedger().attribution(0, 30) == books(unprocessed=30)


def test_a_hit_beyond_the_prompt_books_prompt_positions_only() -> None:
    # Preempted after 6 outputs (36 tokens), admitted again with a hit of 32: 24 on the
    # device, [24, 32) claimed from the disk, of which the caller books [24, 30).
    led = RequestLedger()
    led.admitted(24, {"disk": 6}, 32, True)
    led.load_ended({"disk": 6}, 24, 32, 32)
    assert led.attribution(36, 30) == books(device=24, disk=6)


def test_books_that_do_not_meet_the_hit_are_a_bug() -> None:
    led = RequestLedger()
    led.admitted(4, {"disk": 4}, 16, True)  # 8 booked for a hit ending at 16
    led.load_ended({"disk": 4}, 4, 16, 16)
    with pytest.raises(AssertionError, match="do not end at 16"):
        led.attribution(16, 30)


def test_the_ledger_refuses_an_unknown_tier_and_sums_per_tenant() -> None:
    ledger = TokenLedger(["memory", "disk"])
    a = RequestLedger()
    a.admitted(0, {"redis": 8}, 8, False)
    with pytest.raises(ValueError, match="unknown tiers"):
        ledger.close("t", a, 30, 30)
    for tenant, hit in (("x", 8), ("y", 12), ("x", 4)):
        r = RequestLedger()
        r.admitted(hit, {}, hit, False)
        ledger.close(tenant, r, 30, 30)
    total = ledger.totals()
    assert dict(total.sources) == {"device": 24, "memory": 0, "disk": 0, "computed": 66,
                                   "recomputed": 0, "unprocessed": 0}
    assert (total.requests, total.prompt_tokens, total.hit_tokens) == (3, 90, 24)
    per = ledger.per_tenant()
    assert [(t, b.prompt_tokens, b.sources["device"]) for t, b in per.items()] == [
        ("x", 60, 12), ("y", 30, 12)]


PROMPT_LEN = 40


@st.composite
def lives(draw: st.DrawFn) -> list[tuple[str, int, int]]:
    """A request's life: passes (a hit, a load that verifies some of it, computing) ended
    by preemptions, then a last pass that finishes at some point."""
    events = []
    for _ in range(draw(st.integers(0, 3))):
        events.append(("pass", draw(st.integers(0, 48)), draw(st.integers(0, 48))))
        events.append(("preempt", draw(st.integers(0, 60)), 0))
    events.append(("pass", draw(st.integers(0, 48)), draw(st.integers(0, 48))))
    events.append(("finish", draw(st.integers(0, 60)), 0))
    return events


@settings(max_examples=300, derandomize=True)
@given(lives())
def test_every_life_books_each_prompt_token_once(life: list[tuple[str, int, int]]) -> None:
    led = RequestLedger()
    computed = 0
    for kind, a, b in life:
        if kind == "pass":
            local, end = min(a, b), max(a, b)  # a hit [0, local), a claim [local, end)
            cap = min(end, PROMPT_LEN)
            claim = {"disk": max(0, cap - local)} if end > local else {}
            led.admitted(min(local, PROMPT_LEN), claim, end, end > local)
            if end > local:
                good = local + (end - local) // 2
                led.load_ended({"disk": max(0, min(good, PROMPT_LEN) - local)}, local, end,
                               good)
                computed = good
            else:
                computed = local
        elif kind == "preempt":
            led.preempt(max(computed, a), PROMPT_LEN)
        else:
            out = led.attribution(max(computed, a), PROMPT_LEN)
    assert all(v >= 0 for v in out.values())
    assert out["device"] + out.get("disk", 0) + out["computed"] + out["recomputed"] \
        + out["unprocessed"] == PROMPT_LEN
    assert out["preemption"] + out["failed_load"] == out["recomputed"]


# ------------------------------------------------------------------ in the manager
def _ledger(mgr: AsyncKVManager) -> dict[str, int]:
    return dict(mgr.ledger.totals().sources)


@pytest.mark.asyncio
async def test_manager_books_a_partial_load_and_its_recomputation() -> None:
    mem = MemoryConnector(capacity_bytes=16 << 20)
    async with make_manager(connector=mem) as mgr:
        model = FakeModel(mgr)
        await serve(mgr, model, mgr.new_request("a", PROMPT, tenant="acme"))
        await mgr.drain()
        evict_device_cache(mgr)
        assert _ledger(mgr) == {"device": 0, "memory": 0, "computed": 30, "recomputed": 0,
                                "unprocessed": 0}
        probe = mgr.new_request("p", PROMPT, tenant="acme")
        bad = mgr.keyspace.chunk_keys("acme", 0, probe.block_hashes, 3, 4)[0]
        mgr.finish(probe)  # never admitted: every prompt token unprocessed
        await mem.write_raw(bad, b"\x00" * 100, timeout=1)
        b = mgr.new_request("b", PROMPT, tenant="acme")
        adm = mgr.allocate(b, await mgr.lookup(b))
        assert adm is not None and adm.external_by_tier == {"memory": 28}
        assert (await mgr.wait_load(b)).status is LoadStatus.PARTIAL
        rest = mgr.allocate(b)
        assert rest is not None
        model.step(b, rest.num_new_tokens)
        mgr.after_step([b])
        b.status = RequestStatus.FINISHED_STOPPED
        mgr.finish(b)
        total = mgr.ledger.totals()
        # a: 30 computed; p: 30 unprocessed; b: 3 blocks verified from the host, the
        # claim's other 16 tokens recomputed after the failed load, the last 2 computed.
        assert dict(total.sources) == {"device": 0, "memory": 12, "computed": 32,
                                       "recomputed": 16, "unprocessed": 30}
        assert dict(total.recomputed_after) == {"preemption": 0, "failed_load": 16}
        assert total.prompt_tokens == 90 and total.requests == 3
        # The per-query view books b's claim of 28 at the host.
        assert mgr.stats().hit_tokens_by_tier == {"memory": 28}


@pytest.mark.asyncio
async def test_manager_books_a_preempted_request_once() -> None:
    async with make_manager(connector=MemoryConnector(capacity_bytes=16 << 20)) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", PROMPT, tenant="acme")
        adm = mgr.allocate(a, await mgr.lookup(a), num_new_tokens=16)
        assert adm is not None
        model.step(a, 16)
        mgr.after_step([a])
        mgr.preempt(a)  # [0, 16) computed, its 4 blocks stay cached on the device
        again = mgr.allocate(a, await mgr.lookup(a))
        assert again is not None and again.local_tokens == 4 * BS
        model.step(a, again.num_new_tokens)
        mgr.after_step([a])
        a.status = RequestStatus.FINISHED_STOPPED
        mgr.finish(a)
        total = mgr.ledger.totals()
        assert dict(total.sources) == {"device": 16, "memory": 0, "computed": 14,
                                       "recomputed": 0, "unprocessed": 0}
        assert total.discarded_tokens == 16
        # Per query: two admissions, 16 device hit tokens on the second.
        assert (mgr.stats().queries, mgr.stats().local_hit_tokens) == (2, 16)


@pytest.mark.asyncio
async def test_manager_books_a_failed_request_and_one_finished_while_loading() -> None:
    mem = MemoryConnector(capacity_bytes=16 << 20)
    async with make_manager(connector=mem, load_failure_policy=LoadFailurePolicy.FAIL) as mgr:
        model = FakeModel(mgr)
        await serve(mgr, model, mgr.new_request("a", PROMPT, tenant="acme"))
        await mgr.drain()
        evict_device_cache(mgr)
        probe = mgr.new_request("p", PROMPT, tenant="acme")
        key = mgr.keyspace.chunk_keys("acme", 0, probe.block_hashes, 2, 3)[0]
        mgr.finish(probe)
        mgr.finish(mgr.new_request("z", PROMPT, tenant="zen"))
        await mem.write_raw(key, b"junk", timeout=1)
        b = mgr.new_request("b", PROMPT, tenant="acme")
        mgr.allocate(b, await mgr.lookup(b))
        assert (await mgr.wait_load(b)).status is LoadStatus.FAILED
        mgr.finish(b)  # 2 blocks verified, then the request failed
        c = mgr.new_request("c", PROMPT, tenant="acme")
        mgr.allocate(c, await mgr.lookup(c))
        mgr.finish(c)  # while its load runs: nothing of the claim is booked
        await mgr.drain()
        per = mgr.ledger.per_tenant()
        assert dict(per["acme"].sources) == {"device": 0, "memory": 8, "computed": 30,
                                             "recomputed": 0, "unprocessed": 30 + 22 + 30}
        assert dict(per["zen"].sources)["unprocessed"] == 30
        assert sum(b.prompt_tokens for b in per.values()) == mgr.ledger.totals().prompt_tokens
