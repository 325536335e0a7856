"""A probe that measures how late the event loop runs its callbacks (loop lag); the loops
themselves (uvloop, the loop thread) are :mod:`kvplugin.aio.loop`'s."""

from __future__ import annotations

import asyncio
import contextlib
import time

from kvplugin.engine.quantiles import Quantiles

__all__ = ["LagProbe"]


class LagProbe:
    """A timer task that wakes every ``interval`` seconds and records how late it woke:
    how long a ready callback waits for the loop (blocking work on the loop shows here)."""

    def __init__(self, interval: float = 0.005, into: Quantiles | None = None) -> None:
        if not interval > 0:
            raise ValueError(f"interval must be > 0, got {interval!r}")
        self.interval = interval
        # Bounded (a sample every few ms, for as long as the run lasts); ``into``: several
        # probes' samples pooled (a benchmark's rounds).
        self.samples = into if into is not None else Quantiles()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kv-lag-probe")

    async def _run(self) -> None:
        while True:
            t0 = time.perf_counter()
            await asyncio.sleep(self.interval)
            self.samples.add(max(0.0, time.perf_counter() - t0 - self.interval))

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def percentile(self, q: float) -> float:
        """The ``q``-th percentile of the lag in seconds (0 without samples)."""
        return self.samples.percentile(q)
