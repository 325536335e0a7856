"""KV-cache specs (one per attention family), groups, the config, and block-size resolution.

Specs are frozen value objects: two groups with equal specs are looked up together by the
hybrid coordinator, exactly as in vLLM.  Only what allocation needs is modelled; page sizes
enter only as layout fingerprints for external tiers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field


def cdiv(a: int, b: int) -> int:
    return -(a // -b)


@dataclass(frozen=True, kw_only=True)
class KVCacheSpec:
    block_size: int
    # Whether decode context parallelism shards this cache's token positions across ranks
    # (then a manager block spans ``block_size * dcp_world_size`` tokens).
    dcp_sharded: bool = False
    kind: str = field(default="unknown", init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size <= 0:
            raise ValueError(f"{type(self).__name__}: block_size must be a positive int, "
                             f"got {self.block_size!r}")

    @property
    def prefix_cacheable(self) -> bool:
        return True

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int | None:
        """Per-request block cap of the full-sequence admission gate (None: no cap)."""
        return None


@dataclass(frozen=True, kw_only=True)
class AttentionSpec(KVCacheSpec):
    dcp_sharded: bool = True
    num_kv_heads: int = 1
    head_size: int = 1
    dtype: str = "float32"


@dataclass(frozen=True, kw_only=True)
class FullAttentionSpec(AttentionSpec):
    kind: str = field(default="full_attention", init=False)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowSpec(AttentionSpec):
    sliding_window: int
    extra_retained_tokens: int = 0
    kind: str = field(default="sliding_window", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.sliding_window, int) or self.sliding_window <= 0:
            raise ValueError(f"sliding_window must be a positive int, got {self.sliding_window!r}")
        if self.extra_retained_tokens < 0:
            raise ValueError("extra_retained_tokens must be >= 0")

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        # The live-window plateau during chunked prefill; +1 covers a window that
        # straddles a block boundary.
        n = min(self.sliding_window - 1 + self.extra_retained_tokens + max_in_flight_tokens,
                max_model_len)
        return cdiv(n, self.block_size) + 1


@dataclass(frozen=True, kw_only=True)
class MLAAttentionSpec(FullAttentionSpec):
    """Multi-head latent attention: decides like full attention, its own spec (so an MLA
    group and a full group are looked up separately)."""

    kind: str = field(default="mla_attention", init=False)


@dataclass(frozen=True, kw_only=True)
class HiddenStateCacheSpec(MLAAttentionSpec):
    """Marker subclass of MLA for hidden-state cache layers."""


@dataclass(frozen=True, kw_only=True)
class RSWASpec(FullAttentionSpec):
    """Reference sliding window: full attention that keeps the prompt; during decode only
    the last ``rswa_window`` tokens are kept (the gap goes to null blocks)."""

    rswa_window: int
    kind: str = field(default="full_attention", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.rswa_window, int) or self.rswa_window <= 0:
            raise ValueError(f"rswa_window must be a positive int, got {self.rswa_window!r}")


@dataclass(frozen=True, kw_only=True)
class CircularBufferSpec(AttentionSpec):
    """A scratch ring: one block (of ``block_size`` = capacity) per request, never cached."""

    kind: str = field(default="circular_buffer", init=False)

    @property
    def prefix_cacheable(self) -> bool:
        return False


@dataclass(frozen=True, kw_only=True)
class SinkFullAttentionSpec(FullAttentionSpec):
    """Full attention with attention sinks.  vLLM 0.33.0 cannot build its manager (the
    coordinator passes an argument its ``__init__`` lacks), so construction refuses it."""

    sink_len: int | None = None


@dataclass(frozen=True, kw_only=True)
class ChunkedLocalAttentionSpec(AttentionSpec):
    attention_chunk_size: int
    kind: str = field(default="chunked_local_attention", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if not isinstance(self.attention_chunk_size, int) or self.attention_chunk_size <= 0:
            raise ValueError("attention_chunk_size must be a positive int, "
                             f"got {self.attention_chunk_size!r}")

    def max_admission_blocks_per_request(self, max_in_flight_tokens: int,
                                         max_model_len: int) -> int:
        n = min(self.attention_chunk_size + max_in_flight_tokens, max_model_len)
        return cdiv(n, self.block_size)


@dataclass(frozen=True, kw_only=True)
class SlidingWindowMLASpec(SlidingWindowSpec):
    """Sliding window with the MLA cache format.  ``bounded_replay`` makes the group not
    prefix-cacheable (never looked up, never cached, outside the hash block size)."""

    bounded_replay: bool = False
    kind: str = field(default="sliding_window_mla", init=False)

    @property
    def prefix_cacheable(self) -> bool:
        return not self.bounded_replay


@dataclass(frozen=True, kw_only=True)
class CrossAttentionSpec(AttentionSpec):
    kind: str = field(default="cross_attention", init=False)


@dataclass(frozen=True, kw_only=True)
class EncoderOnlyAttentionSpec(AttentionSpec):
    kind: str = field(default="encoder_only_attention", init=False)


MAMBA_CACHE_MODES = ("none", "align")


@dataclass(frozen=True, kw_only=True)
class MambaSpec(KVCacheSpec):
    shapes: tuple[tuple[int, ...], ...] = ((1, 1),)
    dtypes: tuple[str, ...] = ("float32",)
    mamba_cache_mode: str = "none"
    num_speculative_blocks: int = 0
    num_prefill_checkpoint_blocks: int = 0
    prefill_checkpoint_alignment: int | None = None
    tokens_per_state: int = -1
    kind: str = field(default="mamba", init=False)

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.mamba_cache_mode not in MAMBA_CACHE_MODES:
            raise ValueError(f"mamba_cache_mode must be one of {MAMBA_CACHE_MODES}, "
                             f"got {self.mamba_cache_mode!r}")
        if self.num_speculative_blocks < 0 or self.num_prefill_checkpoint_blocks < 0:
            raise ValueError("Mamba speculative / checkpoint block counts must be >= 0")


@dataclass(frozen=True)
class KVCacheGroupSpec:
    layer_names: Sequence[str]
    kv_cache_spec: KVCacheSpec
    is_eagle_group: bool = False


@dataclass
class KVCacheConfig:
    num_blocks: int
    kv_cache_groups: list[KVCacheGroupSpec]
    prefix_cache_retention_interval: int | None = None
    hash_block_size: int | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.num_blocks, int) or self.num_blocks < 2:
            raise ValueError(
                f"num_blocks must be an int >= 2 (block 0 is the null block, so at least one "
                f"usable block is needed), got {self.num_blocks!r}")

    @property
    def has_mamba_layers(self) -> bool:
        return any(isinstance(g.kv_cache_spec, MambaSpec) for g in self.kv_cache_groups)

    @property
    def has_mixed_precision_kv_cache(self) -> bool:
        """Attention groups of more than one dtype: a block reused across groups would be
        reinterpreted under another precision (stale bytes can decode to NaN/Inf)."""
        return len({g.kv_cache_spec.dtype for g in self.kv_cache_groups
                    if isinstance(g.kv_cache_spec, AttentionSpec)}) > 1

    @property
    def needs_kv_cache_zeroing(self) -> bool:
        return self.has_mamba_layers or self.has_mixed_precision_kv_cache


def resolve_dcp_kv_block_size(spec: KVCacheSpec, dcp_world_size: int) -> int:
    """The token span of one of the spec's blocks under DCP."""
    return spec.block_size * (dcp_world_size if spec.dcp_sharded else 1)


def get_kv_cache_spec_sliding_window(spec: KVCacheSpec) -> int | None:
    return spec.sliding_window if isinstance(spec, SlidingWindowSpec) else None


def partial_hash_hits_possible(groups: Sequence[KVCacheGroupSpec], hash_block_size: int,
                               dcp_world_size: int = 1) -> bool:
    """Some Mamba "align" group is coarser than the hash unit (fine-grained hits).  Under
    DCP equality suffices: DCP scales the full-attention block instead."""
    return any(
        isinstance(g.kv_cache_spec, MambaSpec)
        and g.kv_cache_spec.mamba_cache_mode == "align"
        and (g.kv_cache_spec.block_size > hash_block_size
             or (dcp_world_size > 1 and g.kv_cache_spec.block_size == hash_block_size))
        for g in groups
    )


def resolve_kv_cache_block_sizes(
    config: KVCacheConfig,
    block_size: int,
    *,
    prefix_match_unit: int | None = None,
    enable_caching: bool = True,
    connector_enabled: bool = False,
    dcp_world_size: int = 1,
) -> tuple[int, int]:
    """vLLM's ``(scheduler_block_size, hash_block_size)`` for a layout.  DCP scales every
    sharded group's block (a single group: the default block size, as vLLM does)."""
    groups = config.kv_cache_groups
    if len(groups) <= 1:
        if groups and groups[0].kv_cache_spec.dcp_sharded:
            block_size *= dcp_world_size
        if (prefix_match_unit not in (None, block_size) and len(groups) == 1
                and (enable_caching or connector_enabled)):
            raise ValueError(
                f"Invalid prefix_match_unit={prefix_match_unit}; with a single KV cache "
                f"group, prefix-cache hits land on the block size ({block_size}). "
                f"Unset it or set it to {block_size}.")
        return block_size, block_size
    sizes = [resolve_dcp_kv_block_size(g.kv_cache_spec, dcp_world_size) for g in groups]
    sbs = math.lcm(*sizes)
    if not (enable_caching or connector_enabled):
        return sbs, sbs
    if any(isinstance(g.kv_cache_spec, MambaSpec) and g.kv_cache_spec.mamba_cache_mode != "align"
           for g in groups):
        return sbs, sbs
    hashing = [s for g, s in zip(groups, sizes, strict=True)
               if g.kv_cache_spec.prefix_cacheable] or sizes
    hbs = prefix_match_unit if prefix_match_unit is not None else math.gcd(*hashing)
    if hbs <= 0 or any(s % hbs for s in hashing):
        raise ValueError(
            f"Invalid prefix_match_unit={hbs}; prefix-cacheable KV cache group block sizes "
            f"must be divisible by prefix_match_unit. Got group block sizes={sizes}, "
            f"prefix-cacheable={hashing}.")
    alignments = {g.kv_cache_spec.tokens_per_state for g in groups
                  if isinstance(g.kv_cache_spec, MambaSpec)
                  and g.kv_cache_spec.tokens_per_state > 1}
    hit_alignment = hbs if partial_hash_hits_possible(groups, hbs, dcp_world_size) else sbs
    if any(hit_alignment % a for a in alignments):
        raise ValueError(f"Invalid prefix_match_unit={hbs}; prefix-cache boundaries must align "
                         f"with each spec's per-state compression {sorted(alignments)}.")
    return sbs, hbs
