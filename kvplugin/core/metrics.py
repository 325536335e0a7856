"""Block-residency metrics (vLLM's ``KVCacheMetricsCollector``).

A sampled block is tracked from its allocation; every prefix-cache hit on it records an
access; when the pool hands the block out again (or a connector evicts it) an eviction
event carries its lifetime, idle time and the gaps between its last accesses.  A prefix
cache reset forgets everything.  Sampling draws from a ``random.Random`` (Python's
Mersenne Twister, as vLLM's module-level ``random``), so a seeded rate below 1 samples
the same blocks; rate 1.0 samples every block.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field

from kvplugin.core.blocks import KVCacheBlock

# Touches kept per block: bounded so a hot block cannot grow without limit.
ACCESS_HISTORY = 4


@dataclass(slots=True, frozen=True)
class KVCacheEvictionEvent:
    lifetime_seconds: float
    idle_seconds: float
    reuse_gaps_seconds: tuple[float, ...]


@dataclass(slots=True)
class BlockMetricsState:
    birth_time_ns: int
    last_access_ns: int
    access_history: deque[int] = field(default_factory=lambda: deque(maxlen=ACCESS_HISTORY))

    def record_access(self, now_ns: int) -> None:
        self.last_access_ns = now_ns
        self.access_history.append(now_ns)

    def reuse_gaps_seconds(self) -> tuple[float, ...]:
        h = self.access_history
        return tuple((h[i] - h[i - 1]) / 1e9 for i in range(1, len(h)))


class KVCacheMetricsCollector:
    """Residency metrics of a sample of blocks; ``drain_events`` is read-and-reset."""

    def __init__(self, sample_rate: float = 0.01, rng: random.Random | None = None) -> None:
        if not 0 < sample_rate <= 1.0:
            raise ValueError(f"sample_rate must be in (0, 1.0], got {sample_rate}")
        self.sample_rate = sample_rate
        # None: the process-wide generator, as vLLM (random.seed(...) then reproduces it).
        self._random = rng.random if rng is not None else random.random
        self.block_metrics: dict[int, BlockMetricsState] = {}
        self._eviction_events: list[KVCacheEvictionEvent] = []

    def should_sample_block(self) -> bool:
        return self._random() < self.sample_rate

    def on_block_allocated(self, block: KVCacheBlock) -> None:
        if self.should_sample_block():
            now = time.monotonic_ns()
            self.block_metrics[block.block_id] = BlockMetricsState(now, now)

    def on_block_accessed(self, block: KVCacheBlock) -> None:
        metrics = self.block_metrics.get(block.block_id)
        if metrics is not None:
            metrics.record_access(time.monotonic_ns())

    def on_block_evicted(self, block: KVCacheBlock) -> None:
        metrics = self.block_metrics.pop(block.block_id, None)
        if metrics is None:
            return
        now = time.monotonic_ns()
        self._eviction_events.append(KVCacheEvictionEvent(
            lifetime_seconds=(now - metrics.birth_time_ns) / 1e9,
            idle_seconds=(now - metrics.last_access_ns) / 1e9,
            reuse_gaps_seconds=metrics.reuse_gaps_seconds()))

    def reset(self) -> None:
        self.block_metrics.clear()
        self._eviction_events.clear()

    def drain_events(self) -> list[KVCacheEvictionEvent]:
        events, self._eviction_events = self._eviction_events, []
        return events
