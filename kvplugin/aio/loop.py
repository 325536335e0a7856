"""Event loops: uvloop when installed, and a loop on its own thread for engines that are not
async (the vLLM connector drives its tiers on one)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import os
import threading
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread", "new_event_loop", "run", "uvloop_available"]

T = TypeVar("T")


def uvloop_available() -> bool:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return False
    return True


def new_event_loop(use_uvloop: bool = True) -> asyncio.AbstractEventLoop:
    """A uvloop loop when asked for and installed, else asyncio's default."""
    if use_uvloop and uvloop_available():
        import uvloop

        return uvloop.new_event_loop()
    return asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T], *, use_uvloop: bool = True) -> T:
    """``asyncio.run`` on :func:`new_event_loop`."""
    with asyncio.Runner(loop_factory=lambda: new_event_loop(use_uvloop)) as runner:
        return runner.run(main)


class LoopThread:
    """An event loop running on its own (daemon) thread, for engines that are not async:
    ``submit`` a coroutine from any thread and get a ``concurrent.futures.Future``, or
    ``call`` it and block for the result. Everything async (the manager, its jobs, the
    connectors) lives on that one loop, so it still needs no locks."""

    def __init__(self, *, use_uvloop: bool = True, name: str = "kvplugin-loop",
                 cpus: set[int] | None = None) -> None:
        self.loop = new_event_loop(use_uvloop)
        self._cpus = cpus
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._main, name=name, daemon=True)
        self._thread.start()
        self._ready.wait()

    def _main(self) -> None:
        if self._cpus:
            # This thread's CPUs, and those of every thread it starts (the executors' I/O
            # threads start from here): see kvplugin.integrations._runtime.io_cpus. CPUs
            # this process may not use leave the thread where it was.
            with contextlib.suppress(OSError):
                os.sched_setaffinity(0, self._cpus)
        asyncio.set_event_loop(self.loop)
        self.loop.call_soon(self._ready.set)
        try:
            self.loop.run_forever()
        finally:
            self.loop.run_until_complete(self.loop.shutdown_asyncgens())
            self.loop.close()

    @property
    def running(self) -> bool:
        return self._thread.is_alive()

    def submit(self, coro: Coroutine[Any, Any, T]) -> concurrent.futures.Future[T]:
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("submit() from the loop thread itself would deadlock a call(); "
                               "await the coroutine instead")
        if not self.running:
            coro.close()
            raise RuntimeError("the loop thread is closed")
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def call(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run ``coro`` on the loop and wait for its result (its exception is raised here;
        on timeout the coroutine is cancelled)."""
        fut = self.submit(coro)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise

    def call_soon(self, fn: Callable[[], object]) -> None:
        self.loop.call_soon_threadsafe(fn)

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what still runs on the loop, stop it and join the thread. Idempotent."""
        if not self.running:
            return
        with contextlib.suppress(concurrent.futures.TimeoutError):
            self.call(_cancel_others(), timeout)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout)

    def __enter__(self) -> LoopThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def _cancel_others() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
