"""``kvplugin run``'s progress bar: requests finished of the total, with the share of prompt
tokens served from a cache and the tier hits as its postfix, on stderr.

The bar is fed by a task that reads the engine's counters every 100 ms (:func:`follow`),
never by the engine's step: a step stays free of terminal I/O however fast it runs.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, NoReturn, Protocol, TextIO

from kvplugin.aio.ledger import COMPUTED, RECOMPUTED, UNPROCESSED

if TYPE_CHECKING:
    from tqdm import tqdm

    from kvplugin.aio.ledger import LedgerTotals

__all__ = ["Progress", "ProgressBar", "follow", "hit_sources", "ledger_sources", "postfix",
           "wanted"]

NOT_HITS = (COMPUTED, RECOMPUTED, UNPROCESSED)

INTERVAL_S = 0.1


class Progress(Protocol):
    """What :func:`kvplugin.engine.run.serve` reports progress to."""

    def begin(self, total: int) -> None: ...

    def update(self, finished: int, postfix: str) -> None: ...

    def end(self) -> None: ...


def wanted(force: bool | None, *, json: bool, stream: TextIO) -> bool:
    """Whether to draw the bar: ``force`` (``--progress`` / ``--no-progress``) decides when
    given; else only on a terminal and never when the output is JSON for a program."""
    if force is not None:
        return force
    return not json and stream.isatty()


class ProgressBar:
    """A tqdm bar on ``stream`` (stderr by default); tqdm is imported when the bar begins."""

    def __init__(self, stream: TextIO | None = None, *, desc: str = "requests") -> None:
        self.stream = stream
        self.desc = desc
        self._bar: tqdm[NoReturn] | None = None

    def begin(self, total: int) -> None:
        from tqdm import tqdm

        self._bar = tqdm(total=total, desc=self.desc, unit="req",
                         file=self.stream or sys.stderr, dynamic_ncols=True, leave=True,
                         mininterval=0)

    def update(self, finished: int, postfix: str) -> None:
        if self._bar is None:
            raise RuntimeError("ProgressBar.update before begin")
        self._bar.n = finished
        self._bar.set_postfix_str(postfix, refresh=False)
        self._bar.refresh()

    def end(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None


def ledger_sources(totals: LedgerTotals, labels: Mapping[str, str]) -> dict[str, int]:
    """The token ledger's sources (``device``, each tier, ``computed``, ``recomputed``,
    ``unprocessed``), the tiers by their labels (``labels`` maps a tier's name to the
    report's name for it; two tiers of one kind add up)."""
    out: dict[str, int] = {}
    for src, n in totals.sources.items():
        key = labels.get(src, src)
        out[key] = out.get(key, 0) + n
    return out


def hit_sources(sources: Mapping[str, int]) -> dict[str, int]:
    """The hits of :func:`ledger_sources`: ``device`` and the tiers."""
    return {s: n for s, n in sources.items() if s not in NOT_HITS}


def postfix(hits: Mapping[str, int], prompt_tokens: int) -> str:
    """``hit 61% | memory 1200 disk 350``: the hits' share of the finished requests'
    prompt tokens (the token ledger, as the summary counts it), then the tiers' hits."""
    share = sum(hits.values()) / prompt_tokens if prompt_tokens else 0.0
    tiers = " ".join(f"{k} {v}" for k, v in hits.items() if k != "device")
    return f"hit {share:.0%}" + (f" | {tiers}" if tiers else "")


async def follow(stats: Callable[[], tuple[int, str]], bar: Progress, *,
                 interval: float = INTERVAL_S) -> None:
    """Update ``bar`` from ``stats()`` (finished, postfix) every ``interval`` seconds until
    cancelled, then once more so the bar ends on the final numbers."""
    try:
        while True:
            bar.update(*stats())
            await asyncio.sleep(interval)
    finally:
        bar.update(*stats())
