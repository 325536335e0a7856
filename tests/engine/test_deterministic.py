"""Deterministic runs (``engine.deterministic``, ``kvplugin run``'s default): simulated time,
every I/O settled at the step boundary, so the same seed gives the same run, however slow
or fast the tiers answer."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Sequence
from typing import Any

import pytest
from engine_testlib import GatedReads, small_config

from kvplugin.connectors.base import Connector, PutItem
from kvplugin.connectors.keys import ObjectKey
from kvplugin.engine.clock import SimClock
from kvplugin.engine.report import decided
from kvplugin.engine.run import serve
from kvplugin.serde import Block


def _run(*args: str) -> dict[str, Any]:
    proc = subprocess.run([sys.executable, "-m", "kvplugin.cli", "run", "--json", *args],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return dict(json.loads(proc.stdout.strip().splitlines()[-1]))


def test_kvplugin_run_with_one_seed_is_one_run() -> None:
    first, second = _run("--seed", "7"), _run("--seed", "7")
    assert first["clock"] == "simulated"
    assert decided(first) == decided(second)
    # Not the same run whatever the seed: another seed is another workload.
    other = _run("--seed", "8")
    assert other["prompt_tokens"] != first["prompt_tokens"]
    assert first["preemptions"] > 0 and first["loads"] > 0  # the hard parts happened


def test_realtime_is_said_and_varies_only_in_what_it_says() -> None:
    out = _run("--realtime", "--requests", "20")
    assert out["clock"] == "real" and out["finished"] == 20 and not out["kv_mismatches"]


class Slow(GatedReads):
    """Delegates to ``inner`` (its gate open); lookups, gets and puts first sleep ``delay``
    seconds of real time."""

    def __init__(self, inner: Connector, delay: float) -> None:
        super().__init__(inner)
        self.delay = delay

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        await asyncio.sleep(self.delay)
        return await super().lookup(keys, timeout=timeout)

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        await asyncio.sleep(self.delay)
        return await super().get(keys, timeout=timeout)

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        await asyncio.sleep(self.delay)
        return await super().put(items, timeout=timeout)


@pytest.mark.asyncio
async def test_the_tiers_timing_changes_no_decision() -> None:
    cfg = small_config(blocks=40, disk=True, engine={"deterministic": True,
                                                     "prefill_token_ms": 0.01,
                                                     "decode_step_ms": 1.0},
                       workload={"num_requests": 40, "seed": 5})
    runs = []
    for delay in (0.0, 0.004, 0.0):
        rep = await serve(cfg, wrap_tiers=lambda t, d=delay: Slow(t, d))  # type: ignore[misc]
        assert rep.ok() and rep.extra["clock"] == "simulated"
        runs.append(decided(rep.as_dict()))
    # 4 ms per tier call is an age to the engine's steps (1 ms); in real time it would
    # decide which prefixes are stored when the next request looks: here it cannot.
    assert runs[0] == runs[1] == runs[2]
    assert runs[0]["loads"] > 0 and runs[0]["hit_tokens"]["memory"] > 0


@pytest.mark.asyncio
async def test_sim_clock_wakes_in_time_order_and_jumps() -> None:
    clock = SimClock()
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, t: float) -> None:
        await clock.sleep_until(t)
        woke.append((name, clock.now()))

    tasks = [asyncio.ensure_future(sleeper(n, t))
             for n, t in (("c", 3.0), ("a", 1.0), ("b", 1.0), ("d", 0.0))]
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert woke == [("d", 0.0)] and clock.next_wake() == 1.0
    await clock.elapse(0.0, 0.5)  # a step of 0.5 s: nobody due yet
    assert clock.now() == 0.5 and len(woke) == 1
    assert await clock.jump()  # the idle engine skips to 1.0: a and b, in their order
    assert woke[1:] == [("a", 1.0), ("b", 1.0)]
    await clock.elapse(1.0, 5.0)  # a long step passes c's time: it wakes at the step's end
    assert woke[3:] == [("c", 6.0)]
    assert not await clock.jump() and clock.now() == 6.0
    await asyncio.gather(*tasks)
