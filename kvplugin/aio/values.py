"""The value objects the async manager takes and returns: its settings, what a lookup found,
what an admission decided, how a load ended, the counters and the latency histograms."""

from __future__ import annotations

import bisect
import enum
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # values only: the offload ledger's counters load no core manager
    from kvplugin.core.manager import KVCacheBlocks
    from kvplugin.core.metrics import KVCacheEvictionEvent

__all__ = [
    "BOUNDS",
    "RESIDENCY_BOUNDS",
    "Admission",
    "Histogram",
    "Latency",
    "LatencyRecorder",
    "LoadFailurePolicy",
    "LoadOutcome",
    "LoadStatus",
    "Lookup",
    "OffloadConfig",
    "OffloadStats",
    "Residency",
    "ResidencyRecorder",
    "StoreMode",
]


class StoreMode(enum.Enum):
    """How a store gets its bytes.

    ``COPY``: copied out of host memory when the store is decided, so the blocks are free to
    be reused at once (the device analogue: a D2H copy into a staging buffer). ``HOLD``: the
    store reads the blocks in place (zero-copy for one block per chunk); a request that
    finishes or is preempted meanwhile keeps its blocks until its stores end (vLLM's
    delayed free).
    """

    COPY = "copy"
    HOLD = "hold"


class LoadFailurePolicy(enum.Enum):
    """vLLM's ``kv_load_failure_policy``: keep the verified prefix and recompute the rest,
    or fail the request."""

    RECOMPUTE = "recompute"
    FAIL = "fail"


@dataclass(frozen=True, slots=True)
class OffloadConfig:
    model: str  # the model name in every key's namespace
    chunk_blocks: int = 1  # blocks per stored object (see kvplugin.aio.keys)
    lookup_timeout: float = 0.05  # a lookup slower than this is a miss
    load_timeout: float = 2.0  # a load slower than this keeps what arrived: nothing
    store_timeout: float = 5.0
    max_io: int = 8  # connector calls in flight at once (loads served first)
    store_budget_bytes: int = 256 << 20  # payload bytes of stores in flight; over it: shed
    store_mode: StoreMode = StoreMode.COPY
    load_failure_policy: LoadFailurePolicy = LoadFailurePolicy.RECOMPUTE
    store_prompt_only: bool = False  # vLLM's offload_prompt_only; chat follow-ups want False
    close_connector: bool = True  # aclose() closes the connector (the manager owns it)
    tier_events: bool = False  # take_events() includes the tiers' (see aio.tier_events)

    def __post_init__(self) -> None:
        for name in ("lookup_timeout", "load_timeout", "store_timeout"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or not 0 < value < math.inf:
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        for name in ("chunk_blocks", "max_io", "store_budget_bytes"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if not isinstance(self.store_mode, StoreMode):
            raise TypeError(f"store_mode must be a StoreMode, got {self.store_mode!r}")
        if not isinstance(self.load_failure_policy, LoadFailurePolicy):
            raise TypeError("load_failure_policy must be a LoadFailurePolicy, got "
                            f"{self.load_failure_policy!r}")


@dataclass(frozen=True, slots=True)
class Lookup:
    """What the device and the tiers held for a request when it was looked up.

    Group g's tiers hold chunks ``first[g] .. first[g] + len(levels[g])``, chunk
    ``first[g] + i`` at tier level ``levels[g][i]`` (0 = the fastest tier). ``allocate``
    re-checks the local hit and claims from these facts, so a lookup may go stale safely.
    """

    request_id: str
    local_tokens: int
    external_tokens: int  # what a claim would load if the local hit stays as it was
    first: tuple[int, ...]
    levels: tuple[tuple[int, ...], ...]
    timed_out: bool = False
    # Mamba layouts: (boundary, tier level) of the stored states found (the deepest usable
    # one), and the boundary whose state a claim would load.
    states: tuple[tuple[int, int], ...] = ()
    state_boundary: int | None = None

    @property
    def present(self) -> tuple[int, ...]:
        return tuple(len(lv) for lv in self.levels)


@dataclass(frozen=True, slots=True)
class Admission:
    """A successful ``allocate``: the blocks it added, the tokens it scheduled, and (on
    admission) where the computed tokens come from. ``loading``: the request waits for its
    KV (do not schedule it; see ``AsyncKVManager.wait_load``)."""

    blocks: KVCacheBlocks
    num_new_tokens: int  # tokens scheduled this step (0 while loading)
    local_tokens: int = 0
    external_tokens: int = 0
    loading: bool = False
    external_by_tier: dict[str, int] = field(default_factory=dict)
    # Mamba layouts: the boundary whose state is loaded (with ``external_tokens == 0`` it is
    # a diverged hit: the deeper local attention hit kept, only the lagging state loaded).
    state_boundary: int | None = None


class LoadStatus(enum.Enum):
    LOADED = "loaded"  # every claimed token verified and published
    PARTIAL = "partial"  # a verified prefix kept, the rest will be recomputed
    FAILED = "failed"  # fail policy: the request is finished with an error
    CANCELLED = "cancelled"  # the load was cancelled; the request starts over


@dataclass(frozen=True, slots=True)
class LoadOutcome:
    request_id: str
    status: LoadStatus
    claimed_tokens: int  # external tokens the load was to bring
    loaded_tokens: int  # of those, verified and published
    num_computed_tokens: int  # where the request resumes
    state_boundary: int | None = None  # a Mamba state restored there (LOADED only)


@dataclass(slots=True)
class OffloadStats:
    """Counters (hit rates are derived, never stored). Token counts are per request."""

    # Prefix-cache queries whose hits are booked: one per admission (a preempted request
    # admitted again queries again), with the request's tokens at that time. Hit rate =
    # (local_hit_tokens + external_hit_tokens) / queried_tokens.
    queries: int = 0
    queried_tokens: int = 0
    lookups: int = 0  # lookups that asked the tiers
    lookup_timeouts: int = 0
    local_hit_tokens: int = 0
    external_hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    loads: int = 0
    loads_failed: int = 0  # loads that verified less than they claimed
    loads_cancelled: int = 0
    loaded_chunks: int = 0
    loaded_bytes: int = 0
    loaded_bytes_by_tier: dict[str, int] = field(default_factory=dict)  # where it was found
    recomputed_tokens: int = 0  # claimed, not verified: computed again
    # Objects a load found but refused: not the object planned (key, token range, page
    # shape) or a payload of the wrong size (kvplugin.aio.objects). Checksum and format
    # failures are the connector's (a miss there).
    objects_refused: int = 0
    # Claims cut by cost (kvplugin.aio.loadcost): by the slowest tier of the part not
    # loaded, and the tokens computed instead of loaded.
    loads_skipped_slower_than_recompute: dict[str, int] = field(default_factory=dict)
    skipped_load_tokens: int = 0
    load_probes: int = 0  # objects of a skipped tier read aside to measure it again
    stores: int = 0  # store jobs started (after_step returns objects: stored_chunks)
    stored_chunks: int = 0
    stored_bytes: int = 0
    stores_failed: int = 0  # chunks of store jobs that failed or were cancelled
    stores_shed: int = 0  # chunks dropped over the in-flight byte budget
    stores_deduplicated: int = 0  # chunks already being stored by another request
    # Store copy-outs done when a block was handed out again before its store job ran
    # (normally the job copies while the next step runs; see stores.CopyWatch).
    copies_on_reuse: int = 0
    loaded_states: int = 0  # Mamba states restored (checkpoints and lagging states)
    stored_states: int = 0  # Mamba states written (each with its checkpoint's chunks)
    partial_tails: int = 0  # of those, finish-time partial tails handed over by the core
    states_dropped: int = 0  # state offers dropped: stale, unusable or incomplete
    # Tenant quotas (kvplugin.aio.tenants): admissions refused over a device in-use quota,
    # cached blocks evicted over a cached-block quota, objects shed over a tier byte quota
    # (also counted in stores_shed).
    quota_refusals: int = 0
    quota_evictions: int = 0
    stores_shed_quota: int = 0

    def copy(self) -> OffloadStats:
        out = OffloadStats(**{f.name: getattr(self, f.name) for f in fields(self)})
        out.hit_tokens_by_tier = dict(self.hit_tokens_by_tier)
        out.loaded_bytes_by_tier = dict(self.loaded_bytes_by_tier)
        out.loads_skipped_slower_than_recompute = dict(self.loads_skipped_slower_than_recompute)
        return out


# --------------------------------------------------------------------------- latency
#
# Histograms of the manager's I/O, recorded on the hot path: each observation is one
# ``time.perf_counter()`` pair (taken by the caller) and one ``bisect``, and nothing here
# depends on prometheus (kvplugin.metrics turns them into Prometheus histograms at scrape
# time). Timed: a lookup that asked the tiers (one per ``OffloadStats.lookups``: answered,
# timed out or cancelled), from its first tier call to the end; a load job from its start
# (the admission that claimed it) to its end, published, failed or cancelled (one per
# ``OffloadStats.loads``), booked under the slowest tier it reads from (the one its wait is
# for); a store job from its copy-out until the write to every tier ended (one per
# ``OffloadStats.stores``, failures and cancellations included).

# Bucket upper bounds in seconds: a memory-tier load is sub-millisecond, a disk read a few
# ms, Redis over a network tens of ms; the top buckets catch deadlines (seconds).
BOUNDS: tuple[float, ...] = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                             0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass(slots=True)
class Histogram:
    """Observations per bucket: ``counts[i]`` holds those ``<= bounds[i]`` (and above the
    previous bound); the last entry those above every bound (Prometheus' ``+Inf``)."""

    bounds: tuple[float, ...] = BOUNDS
    counts: list[int] = field(default_factory=list)
    count: int = 0
    sum: float = 0.0

    def __post_init__(self) -> None:
        if list(self.bounds) != sorted(set(self.bounds)) or not self.bounds:
            raise ValueError(f"bounds must be strictly increasing, got {self.bounds!r}")
        if not self.counts:
            self.counts = [0] * (len(self.bounds) + 1)
        elif len(self.counts) != len(self.bounds) + 1:
            raise ValueError(f"{len(self.counts)} counts for {len(self.bounds)} bounds + Inf")

    def observe(self, seconds: float) -> None:
        # bisect_left: a value equal to a bound belongs to that bound's bucket (le).
        self.counts[bisect.bisect_left(self.bounds, seconds)] += 1
        self.count += 1
        self.sum += seconds

    def cumulative(self) -> list[tuple[float, int]]:
        """(upper bound, observations <= it) per bucket, ``inf`` last: Prometheus' form."""
        out = []
        total = 0
        for le, n in zip((*self.bounds, float("inf")), self.counts, strict=True):
            total += n
            out.append((le, total))
        return out

    def copy(self) -> Histogram:
        return Histogram(self.bounds, list(self.counts), self.count, self.sum)

    def __add__(self, other: Histogram) -> Histogram:
        if other.bounds != self.bounds:
            raise ValueError("cannot add histograms with different bounds")
        return Histogram(self.bounds, [a + b for a, b in zip(self.counts, other.counts,
                                                             strict=True)],
                         self.count + other.count, self.sum + other.sum)


@dataclass(frozen=True, slots=True)
class Latency:
    """A snapshot of the manager's histograms (copies: later jobs do not change it).
    ``load`` is keyed by tier name (the connector's ``capabilities.tier``), one entry per
    tier level, so an offload-off manager has none."""

    lookup: Histogram
    store: Histogram
    load: Mapping[str, Histogram]

    def load_total(self) -> Histogram:
        """Every load, whatever its tier."""
        out = Histogram()
        for h in self.load.values():
            out = out + h
        return out


class LatencyRecorder:
    """The manager's live histograms (one per tier name for loads)."""

    __slots__ = ("load", "lookup", "store")

    def __init__(self, tiers: Sequence[str]) -> None:
        self.lookup = Histogram()
        self.store = Histogram()
        self.load = {t: Histogram() for t in tiers}

    def snapshot(self) -> Latency:
        return Latency(self.lookup.copy(), self.store.copy(),
                       MappingProxyType({t: h.copy() for t, h in self.load.items()}))


# Block residency (the core's KVCacheMetricsCollector, when the layout samples blocks): how
# long a device block lived before it was reused, how long it sat idle since its last hit,
# and the gaps between its hits. Seconds to hours, not the I/O's milliseconds.
RESIDENCY_BOUNDS: tuple[float, ...] = (0.1, 0.5, 1.0, 5.0, 15.0, 60.0, 300.0, 900.0, 3600.0,
                                       14400.0)


@dataclass(frozen=True, slots=True)
class Residency:
    """A snapshot of the residency histograms (copies)."""

    lifetime: Histogram
    idle: Histogram
    reuse_gap: Histogram


class ResidencyRecorder:
    """Cumulative residency histograms, fed with the collector's eviction events (which
    ``drain_events`` hands over once)."""

    __slots__ = ("idle", "lifetime", "reuse_gap")

    def __init__(self) -> None:
        self.lifetime = Histogram(RESIDENCY_BOUNDS)
        self.idle = Histogram(RESIDENCY_BOUNDS)
        self.reuse_gap = Histogram(RESIDENCY_BOUNDS)

    def absorb(self, events: Iterable[KVCacheEvictionEvent]) -> None:
        for e in events:
            self.lifetime.observe(e.lifetime_seconds)
            self.idle.observe(e.idle_seconds)
            for gap in e.reuse_gaps_seconds:
                self.reuse_gap.observe(gap)

    def snapshot(self) -> Residency:
        return Residency(self.lifetime.copy(), self.idle.copy(), self.reuse_gap.copy())
