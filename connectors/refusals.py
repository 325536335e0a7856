"""Objects a tier refused on load, by reason, and their warnings in bounded number.

A damaged tier (a disk that flips bits, a Redis someone else writes to) can refuse
thousands of objects in a run: each one is counted (``ConnectorStats.corrupt_<reason>``),
but only the first few are logged one by one; after them, one line per interval says how
many more, by reason, so a log stays readable and nothing goes unsaid.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from kvplugin import serde

__all__ = ["REASONS", "RefusalLog", "reason_of"]

# Why an object was refused: its checksum or MAC does not verify; its metadata names another
# key, tenant, model or layout; it is cut short; or it is not a kvplugin object at all
# (another format version, a foreign value, a non-string Redis value).
REASONS = ("checksum", "metadata", "truncated", "format")


def reason_of(err: Exception) -> str:
    if isinstance(err, serde.ChecksumMismatch | serde.Unauthenticated):
        return "checksum"
    if isinstance(err, serde.MetadataMismatch):
        return "metadata"
    if isinstance(err, serde.TruncatedBlock):
        return "truncated"
    return "format"


class RefusalLog:
    """Warnings about refused objects: the first ``first`` one line each, then one line per
    ``interval_s`` with the count since (and one more from :meth:`flush`)."""

    def __init__(self, logger: logging.Logger, *, first: int = 5, interval_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._logger = logger
        self._first, self._interval, self._clock = first, interval_s, clock
        self._told = 0
        self._held: dict[str, int] = {}
        self._since = 0.0

    def refused(self, name: str, sid: str, reason: str, err: Exception) -> None:
        """Tier ``name`` refused object ``sid``."""
        if self._told < self._first:
            self._told += 1
            self._logger.warning("%s: dropping corrupt object %s (%s): %s%s", name, sid,
                                 reason, err, "" if self._told < self._first else
                                 "; more are counted, and summed up every "
                                 f"{self._interval:g} s")
            self._since = self._clock()
            return
        self._held[reason] = self._held.get(reason, 0) + 1
        if self._clock() - self._since >= self._interval:
            self.flush(name)

    def flush(self, name: str) -> None:
        """Say what is held back (nothing to say: nothing logged)."""
        if not self._held:
            return
        n = sum(self._held.values())
        by = ", ".join(f"{r} {k}" for r, k in sorted(self._held.items()))
        self._logger.warning("%s: %d more corrupt objects dropped (%s)", name, n, by)
        self._held.clear()
        self._since = self._clock()
