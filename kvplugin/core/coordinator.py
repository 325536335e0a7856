"""Coordinators: fan calls out to one manager per KV-cache group and reconcile their hits.

``NoPrefixCache`` when caching is off, ``Unitary`` for one group, ``Hybrid`` otherwise
(per-group hits iterated to a fixed point at the LCM alignment of the group block sizes).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import NamedTuple

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import BlockHash, KVCacheBlock
from kvplugin.core.request import Request
from kvplugin.core.single_type import manager_class_for
from kvplugin.core.single_type.base import SingleTypeKVCacheManager
from kvplugin.core.single_type.cross_attention import CrossAttentionManager
from kvplugin.core.specs import (
    ChunkedLocalAttentionSpec,
    KVCacheConfig,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
    partial_hash_hits_possible,
)

Hits = tuple[list[KVCacheBlock], ...]


def replay_boundaries(num_prompt_tokens: int, scheduler_block_size: int,
                      use_eagle: bool) -> tuple[int, ...]:
    """Positions a later request replaying this prompt can resume at (kept by sparse masks).

    A resend is capped at ``P - 1``; an EAGLE hit matches one block past a boundary and
    drops it, so both the resend and the longer sibling keep the block below.
    """
    if not use_eagle:
        return (num_prompt_tokens - 1,)
    b = scheduler_block_size
    resend = (num_prompt_tokens - 1) // b * b
    extension = num_prompt_tokens // b * b
    return tuple(sorted({max(resend - b, 0), max(extension - b, 0)}))


def _validate_retention(interval: int | None, sbs: int, config: KVCacheConfig) -> None:
    if interval is None:
        return
    sparse = any(isinstance(g.kv_cache_spec, SlidingWindowSpec | MambaSpec)
                 for g in config.kv_cache_groups)
    if not sparse:
        if interval == 0:
            return
        raise ValueError("prefix_cache_retention_interval is set but this model has no "
                         "sliding-window or Mamba KV cache group, so retention has no effect. "
                         "Set it to 0 (it only applies to sliding-window and Mamba attention).")
    if interval < 0 or interval % sbs:
        raise ValueError(f"prefix_cache_retention_interval ({interval}) must be non-negative "
                         f"and a multiple of scheduler_block_size ({sbs}).")


class KVCacheCoordinator:
    """Common fan-out; subclasses implement ``find_longest_cache_hit``."""

    enable_partial_hash_hits = False

    def __init__(
        self,
        kv_cache_config: KVCacheConfig,
        max_model_len: int,
        max_in_flight_tokens: int,
        use_eagle: bool,
        enable_caching: bool,
        enable_kv_cache_events: bool,
        scheduler_block_size: int,
        hash_block_size: int,
        num_prefill_lookahead: int = 0,
        num_hash_lookahead_tokens: int = 0,
        *,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> None:
        if dcp_world_size < 1 or pcp_world_size < 1:
            raise ValueError(f"dcp_world_size ({dcp_world_size}) and pcp_world_size "
                             f"({pcp_world_size}) must be >= 1")
        self.dcp_world_size = dcp_world_size
        self.pcp_world_size = pcp_world_size
        groups = kv_cache_config.kv_cache_groups
        if scheduler_block_size % hash_block_size or any(
                scheduler_block_size % g.kv_cache_spec.block_size for g in groups):
            raise ValueError(
                f"scheduler_block_size {scheduler_block_size} must be a multiple of the hash "
                f"block size {hash_block_size} and of every group block size "
                f"{[g.kv_cache_spec.block_size for g in groups]}")
        self.kv_cache_config = kv_cache_config
        self.scheduler_block_size = scheduler_block_size
        self.hash_block_size = hash_block_size
        self.num_reprefillable_tokens = max(0, num_prefill_lookahead - 1)
        self.block_pool = BlockPool(kv_cache_config.num_blocks, enable_caching, hash_block_size,
                                    enable_kv_cache_events, num_hash_lookahead_tokens)
        self.eagle_group_ids = {i for i, g in enumerate(groups) if g.is_eagle_group}
        if use_eagle and not self.eagle_group_ids:
            self.eagle_group_ids = set(range(len(groups)))
        self.drop_eagle_group_ids = self.eagle_group_ids if use_eagle else set()
        if enable_caching and self.eagle_group_ids and scheduler_block_size < num_prefill_lookahead:
            raise ValueError(
                f"Multi-module MTP with prefix caching requires scheduler_block_size"
                f" (={scheduler_block_size}) >= num_speculative_tokens (={num_prefill_lookahead}).")
        zeroing = kv_cache_config.needs_kv_cache_zeroing
        self.single_type_managers: tuple[SingleTypeKVCacheManager, ...] = tuple(
            manager_class_for(g.kv_cache_spec)(
                g.kv_cache_spec,
                block_pool=self.block_pool,
                enable_caching=enable_caching,
                kv_cache_group_id=i,
                scheduler_block_size=scheduler_block_size,
                needs_kv_cache_zeroing=zeroing,
                max_admission_blocks_per_request=g.kv_cache_spec.max_admission_blocks_per_request(
                    max_in_flight_tokens, max_model_len),
                dcp_world_size=dcp_world_size,
                pcp_world_size=pcp_world_size,
            )
            for i, g in enumerate(groups)
        )
        if use_eagle:
            for m in self.single_type_managers:
                if isinstance(m.kv_cache_spec, MambaSpec):
                    m.drop_eagle_checkpoint_block = True  # type: ignore[attr-defined]
        self.group_block_sizes = tuple(m.block_size for m in self.single_type_managers)
        # Precomputed fan-out lists: the per-step paths below run for every request.
        self._indexed = tuple(enumerate(self.single_type_managers))
        self._has_cross = any(isinstance(m, CrossAttentionManager)
                              for m in self.single_type_managers)
        self._caching_managers = tuple((gid, m) for gid, m in self._indexed if m.enable_caching)
        # Whether any family can release out-of-window blocks (full attention never does),
        # so allocate_slots can skip the window-release fan-out for pure full attention.
        self._releasing = tuple(m for m in self.single_type_managers if m.releases_window_blocks)
        self.releases_blocks = bool(self._releasing)
        # Replay boundaries only matter to sparse (masked) caching.
        self._boundaries: dict[int, tuple[int, ...]] = {}
        self._needs_boundaries = any(
            not m._dense_caching or isinstance(m.kv_cache_spec, MambaSpec)
            for _, m in self._caching_managers)
        self.retention_interval = kv_cache_config.prefix_cache_retention_interval
        _validate_retention(self.retention_interval, scheduler_block_size, kv_cache_config)

    # ------------------------------------------------------------------ allocation
    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]], num_encoder_tokens: int,
        total_computed_tokens: int, num_local_computed_tokens: int, num_tokens_main_model: int,
        apply_admission_cap: bool = False, prefill_end: int = 0,
    ) -> int:
        if self.retention_interval != 0:
            prefill_end = 0  # only sparse retention restricts Mamba checkpoints
        total = 0
        for i, m in self._indexed:
            if self._has_cross and isinstance(m, CrossAttentionManager):
                total += m.get_num_blocks_to_allocate(
                    request_id, num_encoder_tokens, [], 0, 0, num_encoder_tokens,
                    apply_admission_cap=apply_admission_cap)
            else:
                total += m.get_num_blocks_to_allocate(
                    request_id, num_tokens, new_computed_blocks[i], total_computed_tokens,
                    num_local_computed_tokens, num_tokens_main_model, apply_admission_cap,
                    prefill_end)
        return total

    def allocate_new_computed_blocks(
        self, request_id: str, new_computed_blocks: Sequence[Sequence[KVCacheBlock]],
        num_local_computed_tokens: int, num_external_computed_tokens: int,
        skip_zeroing_group_ids: Sequence[int] = (),
    ) -> None:
        """Adopt hits in every group first, then allocate external-token blocks.

        Two phases, so that one group's fresh allocation can never evict another group's
        not-yet-touched evictable hit (handing one block out twice).
        """
        if any(request_id in m.num_cached_block for m in self.single_type_managers):
            if any(new_computed_blocks):
                raise AssertionError(f"request {request_id} is running; it cannot adopt hits")
            return
        for i, m in enumerate(self.single_type_managers):
            m.add_local_computed_blocks(request_id, new_computed_blocks[i],
                                        num_local_computed_tokens, num_external_computed_tokens)
        if num_external_computed_tokens > 0:
            for i, m in enumerate(self.single_type_managers):
                m.allocate_external_computed_blocks(
                    request_id, num_local_computed_tokens, num_external_computed_tokens,
                    record_for_zeroing=i not in skip_zeroing_group_ids)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                            num_encoder_tokens: int = 0) -> Hits:
        if not self._has_cross:
            return tuple([m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model)
                          for m in self.single_type_managers])
        return tuple([
            m.allocate_new_blocks(
                request_id,
                num_encoder_tokens if isinstance(m, CrossAttentionManager) else num_tokens,
                num_tokens_main_model)
            for m in self.single_type_managers])

    # ------------------------------------------------------------------ caching
    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        return max(0, num_computed_tokens - self.num_reprefillable_tokens)

    def replay_boundaries_for(self, num_prompt_tokens: int) -> tuple[int, ...]:
        """``replay_boundaries`` of a prompt length, memoised (it runs every step)."""
        if not self._needs_boundaries:
            return ()
        b = self._boundaries.get(num_prompt_tokens)
        if b is None:
            b = replay_boundaries(num_prompt_tokens, self.scheduler_block_size,
                                  bool(self.drop_eagle_group_ids))
            if len(self._boundaries) < 1 << 16:
                self._boundaries[num_prompt_tokens] = b
        return b

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        boundaries = self.replay_boundaries_for(request.num_prompt_tokens)
        for gid, m in self._caching_managers:
            m.cache_blocks(request, self.get_num_cacheable_tokens(num_computed_tokens, gid),
                           self.retention_interval, replay_boundaries=boundaries)

    def emit_cached_block_events(self, request: Request, computed_blocks: Hits) -> None:
        for gid, blocks in enumerate(computed_blocks):
            if blocks:
                m = self.single_type_managers[gid]
                m.block_pool.emit_cached_block_events(request, len(blocks), m.block_size, gid)

    def reset_prefix_cache(self) -> bool:
        pools = dict.fromkeys(m.block_pool for m in self.single_type_managers)
        return all([pool.reset_prefix_cache() for pool in pools])

    # ------------------------------------------------------------------ freeing
    def free(self, request_id: str) -> None:
        for m in self.single_type_managers:
            m.free(request_id)

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        out: list[KVCacheBlock] = []
        for m in self.single_type_managers:
            out.extend(m.pop_blocks_for_free(request_id))
        return out

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        for m in self._releasing:
            m.remove_skipped_blocks(request_id, processed_computed_tokens, num_prompt_tokens)

    def get_blocks(self, request_id: str) -> Hits:
        return tuple(m.req_to_blocks.get(request_id) or [] for m in self.single_type_managers)

    def new_step_starts(self) -> None:
        for m in self.single_type_managers:
            m.new_step_starts()

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[Hits, int, int]:
        raise NotImplementedError

    def lookup_spec(self, group_id: int) -> KVCacheSpec:
        """The group's spec as its lookups see it: DCP-scaled block size when sharded."""
        spec = self.kv_cache_config.kv_cache_groups[group_id].kv_cache_spec
        bs = self.single_type_managers[group_id].block_size
        return spec if bs == spec.block_size else dataclasses.replace(spec, block_size=bs)


# Families whose lookups vLLM 0.33.0 asserts against under DCP/PCP (message: theirs).
_NO_CP_LOOKUP = ((SlidingWindowSpec, "sliding window attn"),
                 (ChunkedLocalAttentionSpec, "chunked local attn"), (MambaSpec, "mamba"))


def check_cp_lookup(m: SingleTypeKVCacheManager) -> None:
    """vLLM accepts a lone sharded SWA / chunked-local group under DCP at construction but
    asserts at its first lookup; reproduce that (as an error, not a silent hit)."""
    for klass, what in _NO_CP_LOOKUP:
        if isinstance(m.kv_cache_spec, klass):
            if m.dcp_world_size > 1:
                raise AssertionError(f"DCP not support {what} now.")
            if m.pcp_world_size > 1:
                raise AssertionError(f"PCP not support {what} now.")


def check_lookup_layout(coord: KVCacheCoordinator, alignment: int) -> None:
    """Reject at construction the layouts whose prefix lookups vLLM would refuse later."""
    for gid, m in enumerate(coord.single_type_managers):
        if not isinstance(m.kv_cache_spec, ChunkedLocalAttentionSpec) or not m.enable_caching:
            continue
        if gid in coord.drop_eagle_group_ids:
            raise ValueError(f"group {gid}: EAGLE is not supported with chunked local "
                             "attention and prefix caching")
        if m.block_size != alignment:
            raise ValueError(
                f"group {gid}: chunked local attention needs its block size ({m.block_size}) "
                f"to equal the cache-hit alignment ({alignment}); mixed block sizes are not "
                "supported with chunked local attention and prefix caching")


class KVCacheCoordinatorNoPrefixCache(KVCacheCoordinator):
    """Caching off: any number of groups, never a hit."""

    def __init__(self, kv_cache_config: KVCacheConfig, max_model_len: int,
                 max_in_flight_tokens: int, use_eagle: bool, enable_kv_cache_events: bool,
                 scheduler_block_size: int, hash_block_size: int, num_prefill_lookahead: int = 0,
                 num_hash_lookahead_tokens: int = 0, *, dcp_world_size: int = 1,
                 pcp_world_size: int = 1) -> None:
        super().__init__(kv_cache_config, max_model_len, max_in_flight_tokens, use_eagle, False,
                         enable_kv_cache_events, scheduler_block_size, hash_block_size,
                         num_prefill_lookahead, num_hash_lookahead_tokens,
                         dcp_world_size=dcp_world_size, pcp_world_size=pcp_world_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[Hits, int, int]:
        return tuple([] for _ in self.single_type_managers), 0, 0


class UnitaryKVCacheCoordinator(KVCacheCoordinator):
    """One group.  Note: the legacy EAGLE drop has no proof margin here (unlike hybrid)."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        if len(self.kv_cache_config.kv_cache_groups) != 1:
            raise AssertionError("UnitaryKVCacheCoordinator needs exactly one group")
        m = self.single_type_managers[0]
        if m.enable_caching and self.hash_block_size != m.block_size:
            raise ValueError("with one KV-cache group the hash block size must equal the "
                             "group block size")
        self.kv_cache_spec = self.lookup_spec(0)
        self.block_size = m.block_size
        self._drop = 0 in self.drop_eagle_group_ids
        m.use_eagle = self._drop
        check_lookup_layout(self, self.block_size)
        self._find = type(m).find_longest_cache_hit
        self._m = m
        # One manager: the fan-out loops are pure overhead on the per-step path.
        self.remove_skipped_blocks = m.remove_skipped_blocks  # type: ignore[method-assign]

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[Hits, int, int]:
        if self._m.dcp_world_size > 1 or self._m.pcp_world_size > 1:
            check_cp_lookup(self._m)
        blocks, hit = self._find(block_hashes, max_cache_hit_length, (0,), self.block_pool,
                                 self.kv_cache_spec, self._drop, self.block_size)
        return blocks, hit, 0

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int,
        new_computed_blocks: Sequence[Sequence[KVCacheBlock]], num_encoder_tokens: int,
        total_computed_tokens: int, num_local_computed_tokens: int, num_tokens_main_model: int,
        apply_admission_cap: bool = False, prefill_end: int = 0,
    ) -> int:
        if self.retention_interval != 0:
            prefill_end = 0
        return self._m.get_num_blocks_to_allocate(
            request_id, num_tokens, new_computed_blocks[0], total_computed_tokens,
            num_local_computed_tokens, num_tokens_main_model, apply_admission_cap, prefill_end)

    def allocate_new_blocks(self, request_id: str, num_tokens: int, num_tokens_main_model: int,
                            num_encoder_tokens: int = 0) -> Hits:
        return (self._m.allocate_new_blocks(request_id, num_tokens, num_tokens_main_model),)

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        if not self._needs_boundaries and self._m.enable_caching:
            n = num_computed_tokens - self.num_reprefillable_tokens
            self._m.cache_blocks(request, n if n > 0 else 0, self.retention_interval,
                                 replay_boundaries=())
        else:
            super().cache_blocks(request, num_computed_tokens)


class SpecGroup(NamedTuple):
    """Groups with equal specs, looked up jointly (a hash counts only if all have it)."""

    spec: KVCacheSpec
    group_ids: list[int]
    manager_cls: type[SingleTypeKVCacheManager]
    use_eagle: bool


def eagle_proof_margin(block_size: int, hash_block_size: int, fine_grained: bool) -> int:
    """Tokens an EAGLE group matches past a hit before dropping them."""
    return hash_block_size if fine_grained and block_size > hash_block_size else block_size


def partial_hash_hits_enabled(config: KVCacheConfig, hash_block_size: int,
                              managers: Sequence[SingleTypeKVCacheManager],
                              dcp_world_size: int = 1) -> bool:
    """Fine-grained (sub-block) hits: a coarse Mamba "align" group, and every other
    cacheable group either supports fine-grained lookups or is hashed at its block size."""
    groups = config.kv_cache_groups
    if not partial_hash_hits_possible(groups, hash_block_size, dcp_world_size):
        return False
    return all(
        not g.kv_cache_spec.prefix_cacheable or m.supports_fine_grained_hash_lookup
        or m.block_size == hash_block_size
        for g, m in zip(groups, managers, strict=True))
