"""The engine's clocks: real time, or simulated time for deterministic runs.

:class:`RealClock` is the event loop's: a step's simulated cost is slept, the loads and
stores in flight run meanwhile and land whenever their I/O completes, so which request hits
what depends on this machine's timing.

:class:`SimClock` is a count of simulated seconds that only the engine moves: a step adds its
cost, an idle engine jumps to the next client's arrival. Nothing sleeps. With it the engine
settles every I/O at each step boundary (:meth:`kvplugin.engine.scheduler.Engine.run`):
lookups answered, loads applied, stores written, before the next scheduling decision. So a
decision depends only on what happened before it in simulated time, never on how fast the
disk or Redis answered, and the same seed gives the same run (``kvplugin run``'s default).
"""

from __future__ import annotations

import asyncio
import heapq
import itertools

__all__ = ["HANDOFF_PASSES", "Clock", "RealClock", "SimClock", "let_clients_run"]


class Clock:
    """What the engine and its clients read the time from and wait on."""

    def now(self) -> float:
        raise NotImplementedError

    async def sleep_until(self, t: float) -> None:
        raise NotImplementedError

    async def elapse(self, start: float, cost: float) -> None:
        """A step that began at ``start`` and costs ``cost`` seconds is over on return."""
        raise NotImplementedError


class RealClock(Clock):
    """The running event loop's clock."""

    def now(self) -> float:
        return asyncio.get_running_loop().time()

    async def sleep_until(self, t: float) -> None:
        await asyncio.sleep(max(0.0, t - self.now()))

    async def elapse(self, start: float, cost: float) -> None:
        await asyncio.sleep(max(0.0, start + cost - self.now()))


class SimClock(Clock):
    """Simulated seconds from 0; waiters wake in time order (ties: in the order they began
    to wait), when the engine's steps or :meth:`jump` pass their time."""

    def __init__(self) -> None:
        self._t = 0.0
        self._seq = itertools.count()
        self._waiters: list[tuple[float, int, asyncio.Future[None]]] = []

    def now(self) -> float:
        return self._t

    async def sleep_until(self, t: float) -> None:
        if t <= self._t:
            # No yield: a client due already submits in the same loop pass, so how many
            # passes the engine leaves it (see HANDOFF_PASSES) is known in advance.
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (t, next(self._seq), fut))
        await fut

    async def elapse(self, start: float, cost: float) -> None:
        self._advance(max(self._t, start + cost))
        await let_clients_run()

    def next_wake(self) -> float | None:
        """The earliest time a waiter waits for (cancelled ones dropped)."""
        while self._waiters and self._waiters[0][2].done():
            heapq.heappop(self._waiters)
        return self._waiters[0][0] if self._waiters else None

    async def jump(self) -> bool:
        """Nothing can happen before the next waiter's time: go there and let it (and any
        other due then) run. False when nobody waits."""
        t = self.next_wake()
        if t is None:
            return False
        self._advance(t)
        await let_clients_run()
        return True

    def _advance(self, t: float) -> None:
        self._t = t
        while self._waiters and self._waiters[0][0] <= t:
            _, _, fut = heapq.heappop(self._waiters)
            if not fut.done():
                fut.set_result(None)


# Loop passes the engine leaves the clients before it decides again: a woken waiter runs in
# the first (the feeder spawns a due client's task), the client submits in the second; a
# finished request's client wakes its follow-up in the first, which waits or submits in the
# second. Every pass runs every ready callback, whatever the I/O, so this is deterministic.
HANDOFF_PASSES = 3


async def let_clients_run() -> None:
    """Yield :data:`HANDOFF_PASSES` loop passes (see there)."""
    for _ in range(HANDOFF_PASSES):
        await asyncio.sleep(0)

