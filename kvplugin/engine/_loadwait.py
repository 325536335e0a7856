"""The reference engine's waits on the manager's I/O (mixed into
:class:`~kvplugin.engine.scheduler.Engine`): requests parked while their KV loads, loaded
KV crossing the host link (with a model cost), the unsticking of loaded requests that
would wait on each other, and the checks of every hit's bytes once the step that admitted
it has run."""

from __future__ import annotations

import asyncio
from collections import deque
from typing import TYPE_CHECKING

from kvplugin.aio.values import LoadOutcome, LoadStatus
from kvplugin.core.request import RequestStatus

if TYPE_CHECKING:
    from kvplugin.aio.manager import AsyncKVManager
    from kvplugin.costs import ModelCost
    from kvplugin.engine.clock import Clock
    from kvplugin.engine.model import FakeModel
    from kvplugin.engine.scheduler import EngineRequest, EngineStats

__all__ = ["LoadWaits"]


class LoadWaits:
    """Expects the engine's queues, clock, stats and model (see :class:`Engine`)."""

    mgr: AsyncKVManager
    model: FakeModel
    clock: Clock
    stats: EngineStats
    running: list[EngineRequest]
    waiting: deque[EngineRequest]
    kv_holding: deque[EngineRequest]
    loading: dict[str, EngineRequest]
    transferring: list[EngineRequest]
    _load_cost: ModelCost | None
    _link_free: float
    _timers: set[asyncio.Task[None]]
    _watchers: set[asyncio.Task[None]]
    _wake: asyncio.Event
    _checks: list[tuple[EngineRequest, int, int]]
    _state_block_sizes: list[int]

    if TYPE_CHECKING:  # the engine's own
        def _finish(self, er: EngineRequest, status: RequestStatus) -> None: ...

        def _preempt(self, er: EngineRequest) -> None: ...

        def _start_lookup(self, er: EngineRequest) -> None: ...

    def _check(self, er: EngineRequest, start: int, end: int) -> None:
        """Check the hit's bytes once the step in flight has run: as in vLLM, a hit may be
        on blocks another request computes in the very step that admits it (the core caches
        a step's blocks when it allocates them; the model writes them before attending)."""
        if end > start:
            self._checks.append((er, start, end))

    async def _run_checks(self) -> None:
        """The queued checks, each in slices (the loop runs in between): nothing frees or
        rewrites a request's checked blocks meanwhile, since only the step's bookkeeping
        (after this) finishes or preempts requests."""
        checks, self._checks = self._checks, []
        for er, start, end in checks:
            if er.holds_blocks:  # a load that kept nothing has given the blocks back
                await self.model.acheck(er.rid, self.mgr.core.get_block_ids(er.rid), start,
                                        end)

    # ------------------------------------------------------------------ loads
    def _book_transfer(self, er: EngineRequest, tokens_by_tier: dict[str, int]) -> None:
        """The deployment's time for this load: the link takes loads one after another."""
        if self._load_cost is None:
            return
        took = self._load_cost.load_s(tokens_by_tier)
        start = max(self.clock.now(), self._link_free)
        self._link_free = er.ready_at = start + took
        self.stats.transfer_s += took

    async def _transferred(self, er: EngineRequest) -> None:
        await self.clock.sleep_until(er.ready_at)
        self.transferring.remove(er)
        self.kv_holding.append(er)
        self._wake.set()

    def _park(self, er: EngineRequest) -> None:
        """``WAITING_FOR_REMOTE_KVS`` until the load ends; a watcher resumes it."""
        self.stats.parked += 1
        self.loading[er.rid] = er
        task = asyncio.get_running_loop().create_task(self._watch_load(er),
                                                      name=f"kv-watch-{er.rid}")
        self._watchers.add(task)
        task.add_done_callback(self._watchers.discard)

    async def _watch_load(self, er: EngineRequest) -> None:
        outcome = await self.mgr.wait_load(er.req)
        self._load_ended(er, outcome)

    def _load_ended(self, er: EngineRequest, outcome: LoadOutcome) -> None:
        del self.loading[er.rid]
        self._wake.set()
        if outcome.status is LoadStatus.FAILED:
            self._finish(er, RequestStatus.FINISHED_ERROR)
            return
        self._count_restored(outcome)
        if outcome.num_computed_tokens:  # the verified prefix is kept: the request holds it
            # The device hit is checked with what was loaded, where the request resumes: a
            # window group keeps only the blocks the resume point's window needs.
            self._check(er, 0, outcome.num_computed_tokens)
            if er.ready_at > self.clock.now():  # its bytes are still on the link
                self.transferring.append(er)
                task = asyncio.get_running_loop().create_task(self._transferred(er),
                                                              name=f"kv-link-{er.rid}")
                self._timers.add(task)
                task.add_done_callback(self._timers.discard)
                return
            self.kv_holding.append(er)
            return
        er.holds_blocks = False  # nothing kept: the manager freed its blocks
        self.waiting.appendleft(er)
        self._start_lookup(er)

    def _count_restored(self, outcome: LoadOutcome) -> None:
        if outcome.state_boundary is None:
            return
        self.stats.restored_states += 1
        if any(outcome.state_boundary % bs for bs in self._state_block_sizes):
            self.stats.restored_partial_states += 1

    def _unstick(self) -> bool:
        """Loaded requests hold blocks while they wait; when nothing runs and nothing will
        come back, the newest of them gives its blocks back so the oldest can grow."""
        if (self.running or len(self.kv_holding) < 2 or self.loading or self.transferring
                or self.mgr.has_pending_work() or self.mgr.num_held_blocks):
            return False
        er = self.kv_holding.pop()
        self.stats.unstuck += 1
        self._preempt(er)
        self.stats.preemptions -= 1  # not the running loop's preemption
        return True
