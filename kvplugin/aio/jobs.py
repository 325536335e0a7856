"""Connector I/O with deadlines: tier-attributed lookups, load jobs, store jobs, the I/O gate.

A job is a task that does its I/O and then hands the result to a synchronous callback of the
manager (``apply``), with no await in between, so what the result decides is booked in the
same loop iteration it arrived in. Every job ends exactly once (done, failed or cancelled)
and its ``release`` callback runs in ``finally`` whatever happened, cancellation included:
that is where budgets, pins and deferred frees are given back.

Loads go before stores: a request waiting for its KV is latency, a store is best effort.
"""

from __future__ import annotations

import asyncio
import enum
import logging
from collections import deque
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Coroutine,
    Iterator,
    Sequence,
)
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvplugin.aio.offload_ledger import LoadPlan, StorePlan
from kvplugin.aio.plans import ChunkLoad, StateLoad
from kvplugin.connectors.base import Connector, ConnectorError, Deadline, PutItem
from kvplugin.connectors.keys import ObjectKey
from kvplugin.serde import Block

if TYPE_CHECKING:
    from kvplugin.aio.reqstate import ReqState

__all__ = [
    "IOGate",
    "JobEnd",
    "LoadJob",
    "PendingCopy",
    "Priority",
    "RunningJobs",
    "StoreJob",
    "connector_tiers",
    "lookup_levels",
    "run_load",
    "run_store",
    "start",
    "tier_names",
]

logger = logging.getLogger(__name__)


class Priority(enum.IntEnum):
    LOAD = 0
    STORE = 1


class JobEnd(enum.Enum):
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


class IOGate:
    """At most ``limit`` connector operations at once; waiters are served loads first,
    FIFO within a priority. A slot is handed from the releaser straight to the next waiter,
    so a waiter cancelled after being granted passes the slot on instead of leaking it."""

    def __init__(self, limit: int) -> None:
        if type(limit) is not int or limit < 1:
            raise ValueError(f"the I/O limit must be a positive int, got {limit!r}")
        self.limit = limit
        self._free = limit
        self._waiters: tuple[deque[asyncio.Future[None]], ...] = tuple(
            deque() for _ in Priority)

    @property
    def in_use(self) -> int:
        return self.limit - self._free

    @property
    def waiting(self) -> int:
        return sum(len(q) for q in self._waiters)

    @asynccontextmanager
    async def slot(self, priority: Priority) -> AsyncIterator[None]:
        await self._acquire(priority)
        try:
            yield
        finally:
            self._release()

    async def _acquire(self, priority: Priority) -> None:
        if self._free > 0 and not self.waiting:
            self._free -= 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        queue = self._waiters[priority]
        queue.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self._release()  # granted, then cancelled before running: pass it on
            elif fut in queue:
                queue.remove(fut)
            # else: a release already popped the cancelled future and skipped it
            raise

    def _release(self) -> None:
        for queue in self._waiters:
            while queue:
                fut = queue.popleft()
                if not fut.done():
                    fut.set_result(None)
                    return
        self._free += 1


# --------------------------------------------------------------------------- lookups


def tier_names(connector: Connector) -> tuple[str, ...]:
    """The name of each level: a tiered connector's tiers top-down, else the connector."""
    return tuple(t.name for t in connector.levels)


def connector_tiers(connector: Connector) -> list[Connector]:
    """The connectors of each level of :func:`tier_names`."""
    return list(connector.levels)


async def lookup_levels(connector: Connector, keys: Sequence[ObjectKey],
                        deadline: Deadline, *, by_level: bool = True) -> list[int]:
    """The level (index in :func:`tier_names`) of each key present from the first
    (``by_level=False``: the connector asked as one store, every level 0); the union of
    the tiers is the connector's own rule (:meth:`Connector.lookup_levels`)."""
    if not keys:
        return []
    if not by_level:
        return [0] * await connector.lookup(keys, timeout=_left(deadline))
    return await connector.lookup_levels(keys, timeout=_left(deadline))


def _left(deadline: Deadline) -> float:
    remaining = deadline.remaining()
    if remaining <= 0:
        raise TimeoutError
    return remaining


# --------------------------------------------------------------------------- jobs


@dataclass(eq=False, slots=True)
class LoadJob:
    """Fetch ``keys`` (one per planned chunk, then one per planned state) into the
    request's blocks ``dst``."""

    request_id: str
    start: int  # tokens [start, end) claimed from the tiers
    end: int
    plan: tuple[ChunkLoad, ...]
    keys: list[ObjectKey]
    dst: list[list[int]]  # per planned chunk (then state): the block ids it lands in
    owner: ReqState | None = field(default=None, repr=False)  # the manager's request
    states: tuple[StateLoad, ...] = ()  # Mamba states at ``end``, after the chunks
    levels: tuple[int, ...] = ()  # per key: the tier level the lookup found it at
    # The lookup's rows the claim came from (per group: first chunk, levels) and the
    # level of the state loaded: the verified tokens' tiers (the ledger's).
    first: tuple[int, ...] = ()
    found: tuple[tuple[int, ...], ...] = ()
    state_level: int | None = None
    tier: str = ""  # the slowest tier it reads from (its latency is booked there)
    started: float = 0.0  # time.perf_counter() at its start
    abandoned: bool = False  # the request went away: apply nothing, only release
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    ended: JobEnd | None = None
    ledger_plan: LoadPlan | None = field(default=None, repr=False)  # the ledger's plan
    copied: list[tuple[str, int, bool]] = field(default_factory=list)  # (tier, bytes, state)


@dataclass(eq=False, slots=True)
class PendingCopy:
    """A store job's copy-outs not done at hand-off: ``(item index, group, block ids)``
    (see :class:`kvplugin.aio.stores.CopyWatch`)."""

    items: list[PutItem]
    copies: list[tuple[int, int, list[int]]]
    copied: int = 0  # ``copies[:copied]`` are done
    done: bool = False


@dataclass(eq=False, slots=True)
class StoreJob:
    """Write ``items`` (bytes already copied out, or views of held blocks): the ledger's
    ``plan``, one item per planned object, in its order."""

    request_id: str
    items: list[PutItem]
    plan: StorePlan = field(repr=False)
    owner: ReqState | None = field(default=None, repr=False)  # the manager's request
    # Per tier (tier_names' order), the items present there once the put returned: a
    # tier's bytes are charged from these, never from a put that failed there.
    tier_counts: tuple[int, ...] = ()
    started: float = 0.0  # time.perf_counter() before its copy-out
    task: asyncio.Task[None] | None = field(default=None, repr=False)
    ended: JobEnd | None = None
    # Copy-outs not done at hand-off: run first thing in the job (see Stores._start).
    prepare: Callable[[], Awaitable[None]] | None = field(default=None, repr=False)
    pending: PendingCopy | None = field(default=None, repr=False)  # what ``prepare`` copies


class RunningJobs:
    """The jobs one manager runs: added at their start, discarded at their release."""

    __slots__ = ("_jobs",)

    def __init__(self) -> None:
        self._jobs: set[LoadJob | StoreJob] = set()

    def add(self, job: LoadJob | StoreJob) -> None:
        self._jobs.add(job)

    def discard(self, job: LoadJob | StoreJob) -> None:
        self._jobs.discard(job)

    def __len__(self) -> int:
        return len(self._jobs)

    def __bool__(self) -> bool:
        return bool(self._jobs)

    def __iter__(self) -> Iterator[LoadJob | StoreJob]:
        return iter(list(self._jobs))

    def by_kind(self) -> dict[str, int]:
        """Jobs running now, by kind (``"load"``, ``"store"``)."""
        loads = sum(isinstance(j, LoadJob) for j in self._jobs)
        return {"load": loads, "store": len(self._jobs) - loads}

    async def wait_all(self, *, cancel: bool = False) -> None:
        """Until every job (and any they lead to) has ended; ``cancel`` cancels them first."""
        while self._jobs:
            if cancel:
                for job in list(self._jobs):
                    if job.task is not None:
                        job.task.cancel()
            await self._wait()

    async def _wait(self) -> None:
        """Wait for the running jobs' tasks (not gather: cancelling this wait must not
        cancel them). A job still registered after its task ended is a bookkeeping bug:
        raise instead of spinning, since a loop that never yields lets no deadline fire."""
        running = [j.task for j in self._jobs if j.task is not None and not j.task.done()]
        if running:
            await asyncio.wait(running)
            return
        await asyncio.sleep(0)  # a done callback that releases them may still be queued
        if self._jobs and all(j.task is None or j.task.done() for j in self._jobs):
            raise RuntimeError(f"{len(self._jobs)} offload job(s) ended but were never "
                               "released; their pins and budget are lost")


def start(job: LoadJob | StoreJob, coro: Coroutine[Any, Any, None], name: str,
          release: Callable[[Any], None]) -> asyncio.Task[None]:
    """Run a job's coroutine as a task. A task cancelled before its first step never
    enters the coroutine, so its ``finally`` never runs: the done callback releases it then.
    """
    task = asyncio.get_running_loop().create_task(coro, name=name)
    job.task = task

    def done(t: asyncio.Task[None]) -> None:
        if job.ended is None:
            job.ended = JobEnd.CANCELLED
            release(job)
        elif not t.cancelled() and t.exception() is not None:
            logger.error("offload job %s crashed", name, exc_info=t.exception())

    task.add_done_callback(done)
    return task


async def run_load(job: LoadJob, connector: Connector, gate: IOGate, timeout: float,
                   apply: Callable[[LoadJob, list[Block | None]], Awaitable[None]],
                   release: Callable[[LoadJob], None]) -> None:
    """Fetch under one deadline (queueing for the gate included); a slow tier is a miss.
    ``apply`` gets one block or ``None`` per key; ``release`` always runs last."""
    try:
        try:
            async with asyncio.timeout(timeout):
                deadline = Deadline.after(timeout)
                async with gate.slot(Priority.LOAD):
                    blocks = await connector.get(job.keys, timeout=_left(deadline))
        except TimeoutError:
            logger.info("load for %s: no answer within %.3fs", job.request_id, timeout)
            blocks = [None] * len(job.keys)
        except Exception:
            # Not backend trouble (reads answer misses for that): a bug or a closed
            # connector. Nobody awaits this task to see it, so log it and load nothing.
            logger.exception("load for %s raised", job.request_id)
            blocks = [None] * len(job.keys)
        await apply(job, blocks)
        job.ended = JobEnd.DONE if all(b is not None for b in blocks) else JobEnd.FAILED
    except asyncio.CancelledError:
        job.ended = JobEnd.CANCELLED
        raise
    finally:
        if job.ended is None:  # apply itself raised
            job.ended = JobEnd.FAILED
        release(job)


async def run_store(job: StoreJob, connector: Connector, gate: IOGate, timeout: float,
                    release: Callable[[StoreJob], None]) -> None:
    """Write under one deadline; a failure is logged and counted (by ``release``, which
    reads ``job.ended``), never raised: nobody waits for a store."""
    try:
        if job.prepare is not None:
            await job.prepare()
        async with asyncio.timeout(timeout):
            deadline = Deadline.after(timeout)
            async with gate.slot(Priority.STORE):
                counts = await connector.put_per_tier(job.items, timeout=_left(deadline))
        job.tier_counts = tuple(0 if n is None else n for n in counts)
        job.ended = JobEnd.DONE
    except asyncio.CancelledError:
        job.ended = JobEnd.CANCELLED
        raise
    except (ConnectorError, TimeoutError) as exc:
        logger.info("store for %s failed: %r", job.request_id, exc)
        job.ended = JobEnd.FAILED
    except Exception:
        logger.exception("store for %s raised", job.request_id)
        job.ended = JobEnd.FAILED
    finally:
        if job.ended is None:
            job.ended = JobEnd.FAILED
        release(job)
