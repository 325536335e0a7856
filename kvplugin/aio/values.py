"""The value objects the async manager takes and returns: its settings, what a lookup found,
what an admission decided, how a load ended, and the counters."""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field, fields

from kvplugin.core.manager import KVCacheBlocks

__all__ = [
    "Admission",
    "LoadFailurePolicy",
    "LoadOutcome",
    "LoadStatus",
    "Lookup",
    "OffloadConfig",
    "OffloadStats",
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

    lookups: int = 0
    lookup_timeouts: int = 0
    local_hit_tokens: int = 0
    external_hit_tokens: int = 0
    hit_tokens_by_tier: dict[str, int] = field(default_factory=dict)
    loads: int = 0
    loads_failed: int = 0  # loads that verified less than they claimed
    loads_cancelled: int = 0
    loaded_chunks: int = 0
    loaded_bytes: int = 0
    recomputed_tokens: int = 0  # claimed, not verified: computed again
    stores: int = 0  # store jobs started
    stored_chunks: int = 0
    stored_bytes: int = 0
    stores_failed: int = 0  # chunks of store jobs that failed or were cancelled
    stores_shed: int = 0  # chunks dropped over the in-flight byte budget
    stores_deduplicated: int = 0  # chunks already being stored by another request
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
        return out
