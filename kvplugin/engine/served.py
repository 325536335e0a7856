"""Serving a workload in memory that does not grow with it: :func:`drive` feeds the engine
its clients as their arrival comes (the specs may be a lazy :func:`~kvplugin.engine.workload.
stream`), keeps a finished request's prompt and answer only while a later request may still
build on them, and :class:`Served` keeps what the report needs of the finished requests in
bounded structures (percentiles, a thinned time series)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvplugin.engine.quantiles import Quantiles
from kvplugin.engine.report import Sample
from kvplugin.engine.scheduler import Engine, Result
from kvplugin.engine.workload import HISTORY, Finished, RequestSpec, build_prompt

__all__ = ["Served", "Timeline", "drive"]


class Timeline:
    """At most ``limit`` samples, evenly thinned: when full, every other one goes and only
    every ``stride``-th new one is kept (the stride doubling each time)."""

    __slots__ = ("_limit", "_seen", "samples", "stride")

    def __init__(self, limit: int = 4096) -> None:
        if limit < 2:
            raise ValueError("a timeline keeps at least 2 samples")
        self._limit = limit
        self._seen = 0
        self.stride = 1
        self.samples: list[Sample] = []

    def add(self, sample: Sample) -> None:
        if self._seen % self.stride == 0:
            self.samples.append(sample)
            if len(self.samples) > self._limit:
                self.samples = self.samples[::2]
                self.stride *= 2
        self._seen += 1


@dataclass(slots=True)
class Served:
    """What a run keeps of its requests: counts and TTFT percentiles (overall and per
    tenant), the workload's kinds and prompt tokens as sent, the time series."""

    ttft_ms: Quantiles = field(default_factory=Quantiles)
    tenant_ttft_ms: dict[str, Quantiles] = field(default_factory=dict)
    tenant_requests: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0  # of the specs sent (a prompt's length is known in advance)
    timeline: Timeline = field(default_factory=Timeline)
    span_s: float = 0.0  # from the first request to the last answer, on the engine's clock

    def fed(self, spec: RequestSpec) -> None:
        self.kinds[spec.kind] = self.kinds.get(spec.kind, 0) + 1
        self.prompt_tokens += spec.prompt_len

    def finished(self, res: Result) -> None:
        t = res.tenant
        self.tenant_requests[t] = self.tenant_requests.get(t, 0) + 1
        if res.ttft_s is not None:
            self.ttft_ms.add(res.ttft_s * 1000)
            self.tenant_ttft_ms.setdefault(t, Quantiles()).add(res.ttft_s * 1000)


@dataclass(slots=True)
class _Family:
    """Finished requests a later one may still build on: dropped once nothing can."""

    history: int
    done: dict[str, Finished] = field(default_factory=dict)
    ended: dict[str, asyncio.Event] = field(default_factory=dict)
    ended_at: dict[str, float] = field(default_factory=dict)
    sent_at: dict[str, float] = field(default_factory=dict)
    unsent: set[str] = field(default_factory=set)  # past the stop: its children are too
    waiting: dict[str, int] = field(default_factory=dict)  # children not yet built
    order: list[str] = field(default_factory=list)  # fed, newest last (the window)

    def feed(self, spec: RequestSpec) -> None:
        self.ended[spec.request_id] = asyncio.Event()
        if spec.after is not None:
            self.waiting[spec.after] = self.waiting.get(spec.after, 0) + 1
        self.order.append(spec.request_id)
        if len(self.order) > 2 * self.history:  # amortized: trim in batches
            old, self.order = self.order[:-self.history], self.order[-self.history:]
            for rid in old:
                self._forget(rid)

    def built(self, parent: str) -> None:
        self.waiting[parent] -= 1
        if not self.waiting[parent]:
            del self.waiting[parent]
            if parent not in self.order:  # out of the window: no new child can come
                self._forget(parent)

    def _forget(self, rid: str) -> None:
        if rid in self.waiting or not self.ended[rid].is_set():
            return  # a child still needs it, or it runs: its finish forgets it
        for d in (self.done, self.ended, self.ended_at, self.sent_at):
            d.pop(rid, None)
        self.unsent.discard(rid)

    def finished(self, rid: str, fin: Finished, now: float) -> None:
        self.done[rid], self.ended_at[rid] = fin, now
        self.ended[rid].set()
        if rid not in self.order and rid not in self.waiting:
            self._forget(rid)

    def not_sent(self, rid: str) -> None:
        """Its time came after the stop: it ends unsent, and so do its children."""
        self.unsent.add(rid)
        self.ended[rid].set()
        if rid not in self.order and rid not in self.waiting:
            self._forget(rid)


async def drive(engine: Engine, specs: Iterable[RequestSpec], *,
                on_finish: Callable[[Result], None] | None = None,
                on_feed: Callable[[RequestSpec], None] | None = None,
                keep_results: bool = True, stop_at_s: float | None = None,
                halt: asyncio.Event | None = None) -> dict[str, Result]:
    """Serve ``specs`` on ``engine`` (which this runs) until every one has finished;
    ``on_finish`` sees each result as its client gets it, ``on_feed`` each spec as its
    client sends it. A request without a parent is sent at its arrival time; a follow-up or
    resend waits for its parent's answer, then sends once its think time after that answer
    and its gap after the parent was sent have both passed. With ``stop_at_s``, a request
    whose time comes at or after that many seconds from the start is not sent, nor are its
    children (a benchmark that runs for a fixed time); once ``halt`` is set, likewise for
    every request not sent yet (an interrupted run drains what is in flight). Returns the
    results by id (empty with ``keep_results`` off: a long run keeps none)."""
    clock = engine.clock
    start = clock.now()
    stop = None if stop_at_s is None else start + stop_at_s
    # A lazy stream refers at most HISTORY specs back; a list may refer anywhere in it.
    family = _Family(len(specs) if isinstance(specs, Sequence) else HISTORY)
    results: dict[str, Result] = {}

    async def client(spec: RequestSpec) -> None:
        at = start + spec.at_s
        if spec.after is not None:
            await family.ended[spec.after].wait()
            if spec.after not in family.unsent:
                at = max(at, family.ended_at[spec.after] + spec.think_s,
                         family.sent_at[spec.after] + spec.gap_s)
        if (spec.after is not None and spec.after in family.unsent) or (
                stop is not None and at >= stop):
            if spec.after is not None:
                family.built(spec.after)
            family.not_sent(spec.request_id)
            return
        await clock.sleep_until(at)
        if halt is not None and halt.is_set():
            if spec.after is not None:
                family.built(spec.after)
            family.not_sent(spec.request_id)
            return
        prompt = build_prompt(spec, family.done)
        if spec.after is not None:
            family.built(spec.after)
        # Sent when due: with a simulated clock the client wakes at the end of the step
        # that passed its time, but it sent then and waited for that step like any other.
        family.sent_at[spec.request_id] = at
        if on_feed is not None:
            on_feed(spec)
        res = await engine.generate(spec.request_id, prompt, tenant=spec.tenant,
                                    max_tokens=spec.max_tokens, cache_salt=spec.cache_salt,
                                    lora=spec.lora, prefix_group=spec.prefix_group,
                                    shared_prefix_tokens=spec.shared_prefix_tokens,
                                    arrived=at)
        if keep_results:
            results[spec.request_id] = res
        if on_finish is not None:
            on_finish(res)
        family.finished(spec.request_id, Finished(res.prompt, res.output), clock.now())

    async def feeder() -> None:
        try:
            async with asyncio.TaskGroup() as tg:
                for spec in specs:
                    if halt is not None and halt.is_set():
                        break
                    if spec.after is None and (stop is None or start + spec.at_s < stop):
                        await clock.sleep_until(start + spec.at_s)
                    family.feed(spec)
                    tg.create_task(client(spec), name=f"client-{spec.request_id}")
        finally:
            engine.stop()

    async with asyncio.TaskGroup() as tg:
        tg.create_task(engine.run(), name="engine")
        tg.create_task(feeder(), name="clients")
    return results
