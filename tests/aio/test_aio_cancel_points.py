"""Cancellation at EVERY await point of lookup, load, store and finish (issue 9).

Systematic, not hand-picked: every connector call (``lookup``/``get``/``put``/``delete``,
per tier of a tiered stack, promotions included) and every I/O-gate acquisition is a
numbered suspension point. Each scenario is run once to enumerate its points (at import);
then, for every point k and every action, it is rerun from scratch, parked at k (a
connector call blocks on an event; a gate acquisition really queues behind a full gate),
and the action is taken while it is parked:

* ``cancel``: cancel the task a caller would cancel there (the engine's task awaiting
  ``lookup``, the load or store job's task, a tiered promotion's task), then release;
* ``grant-cancel``: release point k and cancel that task in the same loop iteration (a
  gate slot granted, then cancelled before the waiter ran);
* ``finish``: the engine finishes (aborts) the request the parked operation serves, then
  releases it;
* ``aclose``: close the manager while parked (it must not need the release), then release;
* ``engine-cancel``: cancel the engine's own await (``wait_load``, ``drain``, a step),
  whatever point a job is parked at.

Then the manager is driven to quiescence (every request finished, drained) and checked: no
leaked block (the core's free count is the pool minus the null block), no pending job, no
held block, no store byte in flight, the gate idle, every job ended once and the counters
agreeing with the jobs that ran; and nothing unverified is published: an identical request,
served from the device cache and then from the tiers, reads exactly what a recomputation
writes (the fake model asserts every input it reads).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import re
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
from aio_testlib import (
    FakeModel,
    all_blocks,
    evict_device_cache,
    free_blocks,
    make_hybrid,
    make_manager,
)

from kvplugin.aio import loads as loads_mod
from kvplugin.aio import manager as manager_mod
from kvplugin.aio import stores as stores_mod
from kvplugin.aio.jobs import IOGate, JobEnd, LoadJob, Priority, StoreJob
from kvplugin.aio.jobs import start as real_start_job
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.values import Admission, LoadStatus, StoreMode
from kvplugin.connectors.base import Connector, ConnectorStats, Health, PutItem
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.core.request import Request, RequestStatus
from kvplugin.serde import Block, Codec

MIB = 1 << 20
TENANT = "acme"
P30 = tuple(range(100, 130))
P40 = tuple(range(100, 140))
HANG = 3.0  # seconds: anything still waiting by then is a hang
# Long deadlines: a parked call must never be cut by a timeout instead of the action.
SLOW: dict[str, Any] = {"lookup_timeout": 30.0, "load_timeout": 30.0, "store_timeout": 30.0}
ACTIONS = ("cancel", "grant-cancel", "finish", "aclose", "engine-cancel")
START_ACTIONS = ("cancel", "finish", "aclose")  # before a job's first step

Job = LoadJob | StoreJob

# The job (load or store) whose task, or a task it spawned, makes a connector call: set
# around the manager's job start, so the job task's context (and its children's) has it.
_JOB: contextvars.ContextVar[Job | None] = contextvars.ContextVar("_JOB", default=None)


# --------------------------------------------------------------------------- points


@dataclass(eq=False)
class Point:
    index: int
    where: str  # "<request>:<phase>/<op>@<tier>", phase in lookup/load/store/promote
    task: asyncio.Task[Any]  # the task suspended there
    root: asyncio.Task[Any]  # the task a caller cancels: engine, job or promotion
    owner: str | None  # the request the operation serves
    release: Callable[[], None] = lambda: None
    # A job's start: its task exists and has not run yet (it would first run when the
    # engine yields). The engine acts there itself, synchronously, before yielding.
    at_start: bool = False


class Points:
    """Numbers every suspension point reached; parks the one numbered ``target``."""

    def __init__(self, target: int | None) -> None:
        self.target = target
        self.log: list[str] = []
        self.parked: Point | None = None
        self.reached = asyncio.Event()
        self.engine: asyncio.Task[Any] | None = None
        self.current: str | None = None  # the request the engine is serving
        self.jobs: list[Job] = []  # every job the manager started, in order

    def arrive(self, op: str, tier: str, task: asyncio.Task[Any] | None = None
               ) -> Point | None:
        task = task or asyncio.current_task()
        assert task is not None
        job = _JOB.get()
        root: asyncio.Task[Any] | None
        if getattr(task.get_coro(), "__qualname__", "").endswith("_promote_now"):
            phase, root, owner = "promote", task, job.request_id if job else None
        elif job is not None:
            phase = "load" if isinstance(job, LoadJob) else "store"
            root, owner = job.task, job.request_id
        else:
            phase, root, owner = "lookup", self.engine, self.current
        where = f"{owner}:{phase}/{op}@{tier}"
        index = len(self.log)
        self.log.append(where)
        if index != self.target:
            return None
        assert root is not None, where
        self.parked = Point(index, where, task, root, owner, at_start=op == "start")
        self.reached.set()
        return self.parked

    async def suspend(self, op: str, tier: str) -> None:
        point = self.arrive(op, tier)
        if point is not None:
            event = asyncio.Event()
            point.release = event.set
            await event.wait()


class PointConnector(Connector):
    """Delegates to ``inner``; every call is a suspension point."""

    def __init__(self, inner: Connector, points: Points, tier: str) -> None:
        self.inner = inner
        self.points = points
        self.tier = tier
        self.name = f"points-{inner.name}"
        self.capabilities = inner.capabilities
        self.put_keys: list[ObjectKey] = []

    @property
    def codec(self) -> Codec:
        return self.inner.codec

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        state = any(k.kind == "mamba_state" for k in keys)
        await self.points.suspend("lookup-state" if state else "lookup", self.tier)
        return await self.inner.lookup(keys, timeout=timeout)

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        await self.points.suspend("get", self.tier)
        return await self.inner.get(keys, timeout=timeout)

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        self.put_keys += [k for k, _ in items]
        await self.points.suspend("put", self.tier)
        return await self.inner.put(items, timeout=timeout)

    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        await self.points.suspend("delete", self.tier)
        return await self.inner.delete(keys, timeout=timeout)

    async def health(self, *, timeout: float) -> Health:
        return await self.inner.health(timeout=timeout)

    def stats(self) -> ConnectorStats:
        return self.inner.stats()

    async def aclose(self) -> None:
        await self.inner.aclose()


def _point_gate(points: Points) -> type[IOGate]:
    class PointGate(IOGate):
        """Each acquisition is a point; the parked one finds the gate full and really
        queues: its release hands the taken slots back through the gate's own queue."""

        async def _acquire(self, priority: Priority) -> None:
            point = points.arrive("gate", priority.name.lower())
            if point is not None:
                taken, self._free = self._free, 0
                given = False

                def give_back() -> None:
                    nonlocal given
                    if not given:
                        given = True
                        for _ in range(taken):
                            self._release()

                point.release = give_back
            await super()._acquire(priority)

    return PointGate


@contextlib.contextmanager
def _instrumented(points: Points) -> Iterator[None]:
    """Record the manager's jobs and tag their tasks' contexts with them; give the
    manager a gate whose acquisitions are points."""

    def start(job: Job, coro: Any, name: str, release: Callable[[Any], None]
              ) -> asyncio.Task[None]:
        points.jobs.append(job)
        token = _JOB.set(job)
        try:
            task = real_start_job(job, coro, name, release)
            points.arrive("start", "-", task)
            return task
        finally:
            _JOB.reset(token)

    with mock.patch.object(loads_mod, "start_job", start), \
            mock.patch.object(stores_mod, "start_job", start), \
            mock.patch.object(manager_mod, "IOGate", _point_gate(points)):
        yield


# --------------------------------------------------------------------------- scenarios


@dataclass(frozen=True)
class Scenario:
    name: str
    build: Callable[[Connector], AsyncKVManager]
    tiered: bool = False
    seed_budget: int | None = None  # chunked prefill of the seeding request


SCENARIOS = {s.name: s for s in [
    Scenario("full", lambda c: make_manager(connector=c, **SLOW)),
    Scenario("full2", lambda c: make_manager(num_blocks=48, block_sizes=(4, 8), connector=c,
                                             **SLOW), seed_budget=16),
    Scenario("mamba", lambda c: make_hybrid("mamba", connector=c, **SLOW), seed_budget=16),
    Scenario("hold", lambda c: make_manager(connector=c, store_mode=StoreMode.HOLD, **SLOW),
             seed_budget=16),
    Scenario("tiered", lambda c: make_manager(connector=c, **SLOW), tiered=True),
]}


@dataclass(eq=False)
class Run:
    sc: Scenario
    points: Points
    mgr: AsyncKVManager
    model: FakeModel
    tiers: list[PointConnector]
    tiered: TieredConnector | None
    action: str | None = None
    requests: list[Request] = field(default_factory=list)
    gone: set[str] = field(default_factory=set)  # finished requests
    closed: bool = False
    engine_cancelled: bool = False
    acted: asyncio.Event = field(default_factory=asyncio.Event)

    def managed(self, req: Request) -> bool:
        try:
            self.mgr.tenant_of(req)
        except ValueError:
            return False
        return True

    def finish(self, req: Request) -> None:
        if req.status not in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ERROR):
            req.status = RequestStatus.FINISHED_ABORTED
        self.gone.add(req.request_id)
        self.mgr.finish(req)

    async def pace(self) -> None:
        """The engine between steps: the jobs just started run (to their first point),
        and a step never starts while an action at a parked point is pending (but when
        the engine's own await is what gets cancelled, it runs on to where it blocks:
        ``wait_load``, ``lookup`` or ``drain``)."""
        for _ in range(3):
            await asyncio.sleep(0)
        if (self.points.parked is not None and not self.acted.is_set()
                and self.action != "engine-cancel"):
            await self.acted.wait()

    async def at_start(self) -> None:
        """Right after a manager call that may start a job: when that start is the point,
        act before the job's task first runs (no yield before this acts)."""
        point = self.points.parked
        if point is None or not point.at_start or self.acted.is_set():
            return
        self.acted.set()
        if self.action == "cancel":
            point.root.cancel()
        elif self.action == "finish":
            req = next(r for r in self.requests if r.request_id == point.owner)
            if self.managed(req):
                self.finish(req)
        else:
            assert self.action == "aclose", self.action
            self.closed = True
            await self.mgr.aclose()  # cancels the job before its first step

    async def settle_connector(self) -> None:
        if self.tiered is not None:
            await self.tiered.drain()  # promotions


def _build(sc: Scenario, points: Points, action: str | None) -> Run:
    if sc.tiered:
        tiers = [PointConnector(MemoryConnector(capacity_bytes=16 * MIB, name=f"m{i}"),
                                points, f"t{i}") for i in range(2)]
        stack = TieredConnector(tiers)
        tiered: TieredConnector | None = stack
        conn: Connector = stack
    else:
        tiers = [PointConnector(MemoryConnector(capacity_bytes=16 * MIB), points, "mem")]
        tiered, conn = None, tiers[0]
    mgr = sc.build(conn)
    return Run(sc, points, mgr, FakeModel(mgr), tiers, tiered, action)


async def _serve(run: Run, rid: str, prompt: Sequence[int], budget: int | None) -> None:
    """The engine's side of one request; it yields between steps, as an engine loop does,
    and stops serving a request that was finished meanwhile."""
    mgr, model = run.mgr, run.model
    req = mgr.new_request(rid, prompt, tenant=TENANT)
    run.requests.append(req)
    run.points.current = rid
    found = await mgr.lookup(req)
    if rid in run.gone:
        return
    adm = mgr.allocate(req, found, num_new_tokens=budget)
    assert adm is not None, "no room"
    await run.at_start()
    if rid in run.gone:
        return
    if adm.loading:
        await mgr.wait_load(req)
        if rid in run.gone:
            return
        nxt = mgr.allocate(req, num_new_tokens=budget)
        assert nxt is not None, "no room after the load"
        adm = nxt
    req.status = RequestStatus.RUNNING
    while True:
        model.step(req, adm.num_new_tokens)
        mgr.after_step([req])
        await run.at_start()
        await run.pace()
        if rid in run.gone:
            return
        if req.num_output_tokens >= 2:
            break
        step = mgr.allocate(req, num_new_tokens=budget)
        assert step is not None, "no room"
        adm = step
    req.status = RequestStatus.FINISHED_STOPPED
    run.finish(req)
    await run.at_start()


async def _engine(run: Run) -> None:
    """Seed the tiers with a request, then serve a longer one that hits them (and, with a
    tiered stack, only the lower tier: promotions)."""
    mgr = run.mgr
    try:
        await _serve(run, "a", P30, run.sc.seed_budget)
        await mgr.drain()
        await run.settle_connector()
        if run.tiered is not None:
            upper = run.tiers[0].inner  # not through the points: not the manager's call
            await upper.delete(run.tiers[0].put_keys, timeout=5.0)
        _evict_and_poison(mgr)
        await _serve(run, "b", P40, None)
        await mgr.drain()
        await run.settle_connector()
    except RuntimeError as exc:
        if not (run.closed and "closed" in str(exc)):
            raise


# --------------------------------------------------------------------------- checks


def _evict_and_poison(mgr: AsyncKVManager) -> None:
    """Drop the device cache and fill every (now free) page with garbage, as reused device
    memory would hold: a block published without its bytes then reads wrong, instead of
    happening to still hold the same tokens' KV from before."""
    evict_device_cache(mgr)
    ids = list(range(1, mgr.memory.num_blocks))
    for g in range(mgr.memory.num_groups):
        mgr.memory.copy_in(g, ids, b"\xa5" * (len(ids) * mgr.memory.page_bytes(g)))


def _check_quiescent(run: Run, what: str) -> None:
    mgr = run.mgr
    assert free_blocks(mgr) == all_blocks(mgr), \
        f"{what}: {all_blocks(mgr) - free_blocks(mgr)} block(s) leaked"
    assert mgr.num_pending_jobs == 0 and not mgr.has_pending_work(), f"{what}: jobs pending"
    assert mgr.num_held_blocks == 0, f"{what}: {mgr.num_held_blocks} block(s) still held"
    assert mgr.store_bytes_in_flight == 0, \
        f"{what}: {mgr.store_bytes_in_flight} store bytes still in flight"
    gate = mgr._gate  # no public view of the gate
    assert (gate.in_use, gate.waiting) == (0, 0), \
        f"{what}: gate in use {gate.in_use}, waiting {gate.waiting}"
    for job in run.points.jobs:
        assert job.ended is not None and job.task is not None and job.task.done(), \
            f"{what}: job {job} never ended"
    alive = [t.get_name() for t in asyncio.all_tasks() if t.get_name().startswith("kv-")]
    assert not alive, f"{what}: job tasks still alive: {alive}"


def _check_stats(run: Run, what: str, jobs: Sequence[Job]) -> None:
    """The counters agree with the jobs that actually ran, each counted exactly once."""
    s = run.mgr.stats()
    loads = [j for j in jobs if isinstance(j, LoadJob)]
    stores = [j for j in jobs if isinstance(j, StoreJob)]
    cancelled = sum(j.ended is JobEnd.CANCELLED for j in loads)
    assert (s.loads, s.loads_cancelled) == (len(loads), cancelled), \
        f"{what}: loads {s.loads}/{len(loads)}, cancelled {s.loads_cancelled}/{cancelled}"
    assert s.loads_failed <= s.loads - s.loads_cancelled, f"{what}: {s}"
    done = [j for j in stores if j.ended is JobEnd.DONE]
    expect = (len(stores), sum(len(j.items) - len(j.plan.states) for j in done),
              sum(len(j.plan.states) for j in done),
              sum(len(j.items) for j in stores if j.ended is not JobEnd.DONE))
    got = (s.stores, s.stored_chunks, s.stored_states, s.stores_failed)
    assert got == expect, f"{what}: (stores, chunks, states, failed) {got} != {expect}"


async def _verify(mgr: AsyncKVManager, model: FakeModel, what: str, evict: bool) -> None:
    """An identical request reads only recomputation-exact bytes from whatever it hits."""
    if evict:
        _evict_and_poison(mgr)
    v = mgr.new_request(f"verify-{int(evict)}", P40, tenant=TENANT)
    found = await mgr.lookup(v)
    adm: Admission | None = mgr.allocate(v, found)
    if adm is None:
        # A Mamba state cached this step (by a load that ended since the last step) is
        # hit only from the next one: an engine steps on, and retries.
        mgr.after_step([])
        adm = mgr.allocate(v, found)
    assert adm is not None, f"{what}: no room"
    state_at = adm.state_boundary
    if adm.loading:
        outcome = await mgr.wait_load(v)
        assert outcome.status in (LoadStatus.LOADED, LoadStatus.PARTIAL), f"{what}: {outcome}"
        if outcome.status is not LoadStatus.LOADED:
            state_at = None
        adm = mgr.allocate(v)
        assert adm is not None, f"{what}: no room after the load"
    hit = v.num_computed_tokens
    model.check_pages(v, hit)
    if state_at is not None and hit == state_at:
        model.check_state(v, state_at)
    v.status = RequestStatus.RUNNING
    while True:  # every step asserts the KV and state it reads are the recomputed ones
        model.step(v, adm.num_new_tokens)
        mgr.after_step([v])
        if v.num_output_tokens >= 1:
            break
        adm = mgr.allocate(v)
        assert adm is not None, f"{what}: no room"
    v.status = RequestStatus.FINISHED_STOPPED
    mgr.finish(v)
    await mgr.drain()


# --------------------------------------------------------------------------- the runs


async def _count(sc: Scenario) -> list[str]:
    points = Points(None)
    with _instrumented(points):
        run = _build(sc, points, None)
        points.engine = asyncio.current_task()
        await _engine(run)
        await run.mgr.aclose()
    return points.log


def _enumerate(sc: Scenario) -> list[str]:
    first, again = asyncio.run(_count(sc)), asyncio.run(_count(sc))
    assert first == again, f"{sc.name}: the suspension points are not deterministic"
    return first


POINTS = {name: _enumerate(sc) for name, sc in SCENARIOS.items()}


def _cases() -> list[Any]:
    out = []
    for name, log in POINTS.items():
        for k, where in enumerate(log):
            for action in ACTIONS:
                if action == "engine-cancel" and ":lookup/" in where:
                    continue  # the engine's own await: the same as "cancel"
                if "/start@" in where and action not in START_ACTIONS:
                    continue
                slug = re.sub(r"[^A-Za-z0-9]+", ".", where)
                out.append(pytest.param(name, k, action, id=f"{name}-k{k:02d}-{slug}-{action}"))
    return out


async def _wait_done(task: asyncio.Task[Any], what: str) -> None:
    done, _ = await asyncio.wait({task}, timeout=HANG)
    assert done, f"{what}: hangs"


async def _act(run: Run, point: Point, action: str, what: str) -> None:
    engine = run.points.engine
    assert engine is not None
    if action == "cancel":
        run.engine_cancelled |= point.root is engine
        point.root.cancel()
        await _wait_done(point.root, f"{what}: the cancelled task")  # without the release
        point.release()
    elif action == "grant-cancel":
        run.engine_cancelled |= point.root is engine
        point.release()
        point.root.cancel()
        await _wait_done(point.root, f"{what}: the cancelled task")
    elif action == "finish":
        req = next((r for r in run.requests if r.request_id == point.owner), None)
        if req is not None and run.managed(req):
            run.finish(req)
        await asyncio.sleep(0)
        point.release()
    elif action == "aclose":
        run.closed = True
        closing = asyncio.create_task(run.mgr.aclose())
        await _wait_done(closing, f"{what}: aclose while parked")
        closing.result()
        point.release()
    else:
        assert action == "engine-cancel"
        for _ in range(20):  # the engine runs on until it blocks (on the parked job)
            await asyncio.sleep(0)
        run.engine_cancelled = True
        engine.cancel()
        await _wait_done(engine, f"{what}: the cancelled engine")
        point.release()


async def _case(name: str, k: int, action: str) -> None:
    sc = SCENARIOS[name]
    expected = POINTS[name]
    what = f"scenario {name!r}, point k={k} ({expected[k]}), action {action!r}"
    points = Points(k)
    with _instrumented(points):
        run = _build(sc, points, action)
        engine = asyncio.create_task(_engine(run), name="engine")
        points.engine = engine
        reached = asyncio.create_task(points.reached.wait())
        await asyncio.wait({engine, reached}, timeout=HANG,
                           return_when=asyncio.FIRST_COMPLETED)
        reached.cancel()
        point = points.parked
        if engine.done() and engine.exception() is not None:
            raise AssertionError(f"{what}: the engine failed") from engine.exception()
        assert point is not None, f"{what}: never reached; points were {points.log}"
        assert points.log[:k + 1] == expected[:k + 1], f"{what}: the run diverged"

        if point.at_start:
            assert run.acted.is_set(), f"{what}: the engine did not act at the job's start"
        else:
            await _act(run, point, action, what)
            run.acted.set()

        # Quiescence: the engine ends, every request still held is finished, jobs drain.
        await _wait_done(engine, f"{what}: the engine after the action")
        if engine.cancelled():
            assert run.engine_cancelled, f"{what}: the engine was cancelled by someone else"
        elif engine.exception() is not None:
            raise AssertionError(f"{what}: the engine failed") from engine.exception()
        for req in run.requests:
            if run.managed(req):
                run.finish(req)
        await asyncio.wait_for(run.mgr.drain(), HANG)
        await asyncio.wait_for(run.settle_connector(), HANG)
        _check_quiescent(run, what)

        mgr = run.mgr
        jobs = points.jobs
        if not run.closed:
            for evict in (False, True):
                await _verify(mgr, run.model, f"{what}: verify (evicted={evict})", evict)
                await run.settle_connector()
                _check_quiescent(run, f"{what}: after verifying (evicted={evict})")
            await mgr.aclose()
        else:
            # The tiers are closed; what the device cache publishes is checked through a
            # fresh manager over the same core and host memory.
            jobs = list(points.jobs)  # not the fresh manager's
            fresh = AsyncKVManager(mgr.core, MemoryConnector(capacity_bytes=MIB), mgr.config,
                                   memory=mgr.memory)
            await _verify(fresh, FakeModel(fresh), f"{what}: verify after aclose", False)
            await fresh.aclose()
        _check_quiescent(run, f"{what}: after aclose")
        _check_stats(run, what, jobs)
        if action == "engine-cancel":
            # Cancelling the engine's await (wait_load, drain) cancels no job: only the
            # loads of the requests finished afterwards are.
            hit = [f"{type(j).__name__}({j.request_id})" for j in jobs
                   if j.ended is JobEnd.CANCELLED
                   and not (isinstance(j, LoadJob) and j.abandoned)]
            assert not hit, f"{what}: cancelling the engine cancelled {hit}"


@pytest.mark.asyncio
@pytest.mark.parametrize(("scenario", "k", "action"), _cases())
async def test_cancel_at_every_point(scenario: str, k: int, action: str) -> None:
    await asyncio.wait_for(_case(scenario, k, action), 4 * HANG)


def test_points_cover_lookup_load_store_gate_and_promotions() -> None:
    """The enumeration itself: every scenario suspends in each phase (else the cases
    above would silently test less)."""
    for name, log in POINTS.items():
        ops = {w.split(":", 1)[1] for w in log}
        for need in ("a:lookup", "b:lookup", "b:load/start", "b:load/gate@load",
                     "b:load/get", "a:store/start", "a:store/gate@store", "a:store/put",
                     "b:store/put"):
            assert any(w.startswith(need) for w in log), (name, need, log)
        assert any(o.startswith("store/") for o in ops), (name, ops)
    assert any(":lookup/lookup-state@" in w for w in POINTS["mamba"]), POINTS["mamba"]
    tiered = POINTS["tiered"]
    assert any(":promote/put@t0" in w for w in tiered), tiered
    assert any(":lookup/lookup@t1" in w for w in tiered), tiered
    assert any(":load/get@t1" in w for w in tiered), tiered
