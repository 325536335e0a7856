"""Tiered delete sticks: once delete() returns, no read or promotion that overlapped it brings
the object back. Each interleaving is forced with :class:`Gated` tiers, never with sleeps."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import pytest
from conn_testlib import T, make_items, namespace, same

from kvplugin.connectors.base import Connector, ConnectorStats, ConnectorTimeout, Health, PutItem
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.serde import Block

pytestmark = pytest.mark.asyncio
MIB = 1 << 20


class Gate:
    """Holds every call that reaches it until :meth:`open`; ``reached`` is set by the first."""

    def __init__(self) -> None:
        self.reached = asyncio.Event()
        self._open = asyncio.Event()

    def open(self) -> None:
        self._open.set()

    async def wait(self) -> None:
        self.reached.set()
        await self._open.wait()

    async def until_reached(self) -> None:
        await asyncio.wait_for(self.reached.wait(), T)


class Gated(Connector):
    """A memory tier whose calls can be held at gates, so that a test forces an interleaving.

    ``hold(op)`` holds ``op`` before the real call; ``hold("get", after=True)`` lets the get
    read, then holds its answer (a read of the pre-delete object, returned late). A ``put``
    behaves like a request already sent to a remote server: cancelling the caller does not
    stop it from landing once its gate opens (``landing`` holds such writes). ``fail(op,
    exc)`` makes ``op`` raise; ``bare`` answers blocks without their verified bytes, in a
    buffer the caller may reuse (as a connector that does not keep them might).
    """

    def __init__(self, name: str, *, capacity_bytes: int = MIB) -> None:
        self.inner = MemoryConnector(capacity_bytes=capacity_bytes, name=name)
        self.name = name
        self.capabilities = self.inner.capabilities
        self.bare = False
        self.landing: set[asyncio.Task[int]] = set()
        self._before: dict[str, Gate] = {}
        self._after: dict[str, Gate] = {}
        self._raise: dict[str, BaseException] = {}

    def hold(self, op: str, *, after: bool = False) -> Gate:
        gate = Gate()
        (self._after if after else self._before)[op] = gate
        return gate

    def fail(self, op: str, exc: BaseException) -> None:
        self._raise[op] = exc

    async def _enter(self, op: str) -> None:
        if op in self._raise:
            exc = self._raise[op]
            raise type(exc)(*exc.args)  # a fresh one per call: no traceback piling up
        if op in self._before:
            await self._before[op].wait()

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        await self._enter("lookup")
        return await self.inner.lookup(keys, timeout=timeout)

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        await self._enter("get")
        blocks = await self.inner.get(keys, timeout=timeout)
        if "get" in self._after:
            await self._after["get"].wait()
        if self.bare:
            return [None if b is None else Block(b.meta, bytearray(b.payload)) for b in blocks]
        return blocks

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        landing = asyncio.ensure_future(self._land(list(items)))
        self.landing.add(landing)
        landing.add_done_callback(self.landing.discard)
        return await asyncio.shield(landing)

    async def _land(self, items: list[PutItem]) -> int:
        await self._enter("put")
        return await self.inner.put(items, timeout=T)

    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        await self._enter("delete")
        return await self.inner.delete(keys, timeout=timeout)

    async def health(self, *, timeout: float) -> Health:
        await self._enter("health")
        return await self.inner.health(timeout=timeout)

    def stats(self) -> ConnectorStats:
        return self.inner.stats()

    async def aclose(self) -> None:
        # Let every held call go, so that a failed test leaves no task waiting forever.
        for gate in (*self._before.values(), *self._after.values()):
            gate.open()
        await asyncio.gather(*self.landing, return_exceptions=True)
        await self.inner.aclose()


def two_tiers(**kw: object) -> tuple[TieredConnector, Gated, Gated]:
    top, low = Gated("top"), Gated("low")
    return TieredConnector([top, low], **kw), top, low  # type: ignore[arg-type]


async def nowhere(tiered: TieredConnector, keys: list[ObjectKey]) -> None:
    """The objects are in no tier, now and after every background write has ended."""
    await tiered.drain()
    for tier in tiered.tiers:
        assert isinstance(tier, Gated)
        await asyncio.gather(*tier.landing)
        assert await tier.inner.lookup(keys, timeout=T) == 0, f"{tier.name} has it back"
    assert await tiered.get(keys, timeout=T) == [None] * len(keys)


async def test_a_get_that_read_before_the_delete_does_not_promote_after_it() -> None:
    items = make_items(namespace(), 1)
    keys = [k for k, _ in items]
    tiered, _, low = two_tiers()
    async with tiered:
        await low.inner.put(items, timeout=T)
        answer = low.hold("get", after=True)  # low has read the object, not yet answered
        reading = asyncio.ensure_future(tiered.get(keys, timeout=T))
        await answer.until_reached()
        assert await tiered.delete(keys, timeout=T) == 1
        answer.open()
        got = await reading
        assert same(got[0], items[0][1])  # it overlapped the delete: the old object is fine
        await nowhere(tiered, keys)


@pytest.mark.parametrize("promoted", ["during the delete", "after the delete returned"])
async def test_a_get_that_starts_during_the_delete_does_not_promote(promoted: str) -> None:
    # The tiers delete concurrently: the get misses the top tier, already cleared, and reads
    # the low one before its delete ran.
    items = make_items(namespace(), 1)
    keys = [k for k, _ in items]
    tiered, top, low = two_tiers()
    async with tiered:
        await tiered.put(items, timeout=T)
        low_delete = low.hold("delete")
        deleting = asyncio.ensure_future(tiered.delete(keys, timeout=T))
        await low_delete.until_reached()
        assert await top.inner.lookup(keys, timeout=T) == 0
        if promoted == "during the delete":
            assert same((await tiered.get(keys, timeout=T))[0], items[0][1])
            await tiered.drain()
            low_delete.open()
            assert await deleting == 1
        else:
            answer = low.hold("get", after=True)
            reading = asyncio.ensure_future(tiered.get(keys, timeout=T))
            await answer.until_reached()
            low_delete.open()
            assert await deleting == 1
            answer.open()
            assert same((await reading)[0], items[0][1])
        await nowhere(tiered, keys)


async def test_delete_waits_for_a_promotion_in_flight_instead_of_cancelling_it() -> None:
    # A cancelled write to a remote tier may still land after the delete: cancelling the
    # promotion would not stop it, waiting for it does.
    items = make_items(namespace(), 1)
    keys = [k for k, _ in items]
    tiered, top, low = two_tiers()
    async with tiered:
        await low.inner.put(items, timeout=T)
        promotion = top.hold("put")
        await tiered.get(keys, timeout=T)
        await promotion.until_reached()
        deleting = asyncio.ensure_future(tiered.delete(keys, timeout=T))
        await asyncio.sleep(0.02)
        deleted_early = deleting.done()
        promotion.open()
        assert await deleting == 1
        await nowhere(tiered, keys)
        assert not deleted_early, "delete did not wait for the promotion"


async def test_a_promotion_outlasting_the_deadline_fails_the_delete_and_a_retry_sticks() -> None:
    items = make_items(namespace(), 1)
    keys = [k for k, _ in items]
    tiered, top, low = two_tiers()
    async with tiered:
        await low.inner.put(items, timeout=T)
        promotion = top.hold("put")
        await tiered.get(keys, timeout=T)
        await promotion.until_reached()
        with pytest.raises(ConnectorTimeout):
            await tiered.delete(keys, timeout=0.05)
        assert tiered._promotions, "the promotion was cancelled, not waited for"
        promotion.open()
        await tiered.drain()
        assert await top.inner.lookup(keys, timeout=T) == 1  # the failed delete left it
        assert await tiered.delete(keys, timeout=T) == 1
        await nowhere(tiered, keys)


async def test_a_delete_does_not_wait_for_or_stop_promotions_of_other_objects() -> None:
    items = make_items(namespace(), 2)
    (a, _), (b, _) = items
    tiered, top, low = two_tiers()
    async with tiered:
        await low.inner.put(items, timeout=T)
        promotion = top.hold("put")
        await tiered.get([a], timeout=T)
        await promotion.until_reached()
        assert await tiered.delete([b], timeout=T) == 1
        assert tiered._promotions, "the promotion of another object was cancelled"
        promotion.open()
        await tiered.drain()
        assert await top.inner.lookup([a], timeout=T) == 1


async def test_a_promotion_skips_the_tiers_it_has_not_reached_for_deleted_objects() -> None:
    items = make_items(namespace(), 1)
    keys = [k for k, _ in items]
    top, middle, low = Gated("top"), Gated("middle"), Gated("low")
    async with TieredConnector([top, middle, low]) as tiered:
        await low.inner.put(items, timeout=T)
        promotion = top.hold("put")  # promotions copy top-down: middle comes next
        await tiered.get(keys, timeout=T)
        await promotion.until_reached()
        deleting = asyncio.ensure_future(tiered.delete(keys, timeout=T))
        await asyncio.sleep(0.02)
        promotion.open()
        assert await deleting == 1
        await nowhere(tiered, keys)
        assert middle.stats().stored == 0, "copied an object being deleted"
