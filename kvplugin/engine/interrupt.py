"""Ctrl-C and SIGTERM during ``kvplugin run``: stop as a server drains, then report.

The first SIGINT or SIGTERM stops sending requests; those in flight finish (in simulated
time that is a few steps), the tiers drain and close (a ``temp://`` disk directory is
removed with them) and the run reports what it served: the CLI prints that partial summary
and exits 128 + the signal's number (130, 143), as a shell expects. A second signal stops at
once: the run's task is cancelled, every job releases what it holds on the way out, and the
CLI exits with the same code and one line, without a summary.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["Interrupt", "interruptible"]

SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass(slots=True)
class Interrupt:
    """What the signals asked: ``halt`` is set by the first, the run's task cancelled by
    the second; ``by`` is the first (None: none came)."""

    task: asyncio.Task[object] | None
    halt: asyncio.Event = field(default_factory=asyncio.Event)
    by: signal.Signals | None = None
    at_once: bool = False

    @property
    def exit_code(self) -> int:
        return 128 + int(self.by) if self.by is not None else 0

    def received(self, sig: signal.Signals) -> None:
        if self.by is None:
            self.by = sig
            self.halt.set()
            print(f"kvplugin run: {sig.name}: no new requests; finishing those in flight "
                  f"(again to stop at once)", file=sys.stderr, flush=True)
        elif not self.at_once and self.task is not None:
            self.at_once = True
            self.task.cancel()


# The interrupt of the run in progress (one at a time: the CLI's), for the CLI's exit code.
current: Interrupt | None = None


@contextlib.contextmanager
def interruptible(enabled: bool) -> Iterator[Interrupt | None]:
    """Handle SIGINT and SIGTERM on the running loop while the block runs (``enabled``, and
    only where the loop can: the main thread of a Unix process); None otherwise."""
    global current
    if not enabled:
        yield None
        return
    loop = asyncio.get_running_loop()
    intr = Interrupt(asyncio.current_task())
    installed = []
    try:
        for sig in SIGNALS:
            try:
                loop.add_signal_handler(sig, intr.received, sig)
            except (NotImplementedError, RuntimeError, ValueError):
                break  # not the main thread, or no signals here: the defaults stay
            installed.append(sig)
        current = intr
        yield intr
    finally:
        for sig in installed:
            loop.remove_signal_handler(sig)
