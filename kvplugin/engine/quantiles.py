"""Percentiles in bounded memory, for figures a run records once per request or per step
(TTFT, step latency, loop lag): a run of any length keeps a fixed amount.

:class:`Quantiles` keeps every value while there are at most ``exact`` of them (the
percentile is then exact: :func:`nearest_rank`), then folds them into log-spaced buckets of
relative width ``rel_error`` (a percentile is then the bucket's geometric middle, within
``rel_error / 2`` of the true value; values at or below ``floor`` share bucket 0). The
buckets span any range in a few thousand entries at 1 %: memory is O(exact + log range).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

__all__ = ["Quantiles", "nearest_rank"]


def nearest_rank(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) of ``values`` by the rank ``floor(q/100 * n)``,
    the last value at 100 (0 for none): the definition every report of kvplugin uses."""
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


class Quantiles:
    __slots__ = ("_buckets", "_exact", "_floor", "_log_step", "_values", "count", "max")

    def __init__(self, *, exact: int = 4096, rel_error: float = 0.01,
                 floor: float = 1e-7) -> None:
        if exact < 1 or not 0 < rel_error < 1 or not floor > 0:
            raise ValueError("exact >= 1, 0 < rel_error < 1 and floor > 0 are needed")
        self._exact = exact
        self._floor = floor
        self._log_step = math.log1p(rel_error)
        self._values: list[float] | None = []
        self._buckets: dict[int, int] = {}
        self.count = 0
        self.max = 0.0  # the largest value added (0 for none)

    @property
    def is_exact(self) -> bool:
        return self._values is not None

    def add(self, value: float) -> None:
        self.count += 1
        self.max = value if self.count == 1 else max(self.max, value)
        if self._values is not None:
            self._values.append(value)
            if len(self._values) > self._exact:
                values, self._values = self._values, None
                for v in values:
                    self._bucket(v)
            return
        self._bucket(value)

    def extend(self, values: Iterable[float]) -> None:
        for v in values:
            self.add(v)

    def _bucket(self, value: float) -> None:
        i = 0 if value <= self._floor else 1 + int(math.log(value / self._floor)
                                                    / self._log_step)
        self._buckets[i] = self._buckets.get(i, 0) + 1

    def percentile(self, q: float) -> float:
        """As :func:`nearest_rank` (exact up to ``exact`` values, then within the buckets'
        relative error)."""
        if self._values is not None:
            return nearest_rank(self._values, q)
        rank = min(self.count - 1, int(q / 100 * self.count))
        seen = 0
        for i in sorted(self._buckets):
            seen += self._buckets[i]
            if seen > rank:
                if i == 0:
                    return self._floor
                # The bucket [floor * s**(i-1), floor * s**i): its geometric middle.
                return self._floor * math.exp((i - 0.5) * self._log_step)
        raise AssertionError("unreachable: the ranks are within count")

    def __len__(self) -> int:
        return self.count
