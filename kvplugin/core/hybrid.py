"""The hybrid coordinator: several KV-cache groups (full + sliding window / chunked / Mamba).

A hit must be valid in every group.  Each group can only *lower* the candidate length, so
the per-group lookups are iterated until a full pass lowers nothing.  Full attention is
downward-closed (any shorter prefix of a hit is a hit), so it is searched once, first and
with the largest bound, then merely truncated.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplugin.core.blocks import BlockHash, KVCacheBlock
from kvplugin.core.coordinator import (
    Hits,
    KVCacheCoordinator,
    SpecGroup,
    check_lookup_layout,
    eagle_proof_margin,
    partial_hash_hits_enabled,
)
from kvplugin.core.request import Request
from kvplugin.core.specs import (
    AttentionSpec,
    FullAttentionSpec,
    KVCacheGroupSpec,
    MambaSpec,
    cdiv,
)


def check_cp_layout(groups: Sequence[KVCacheGroupSpec], dcp: int, pcp: int) -> None:
    """The hybrid layouts vLLM 0.33.0 refuses under context parallelism."""
    for i, g in enumerate(groups):
        spec = g.kv_cache_spec
        replicated = not spec.dcp_sharded
        if pcp > 1 and not (isinstance(spec, FullAttentionSpec)
                            or (isinstance(spec, AttentionSpec) and replicated)):
            raise ValueError(f"group {i} ({type(spec).__name__}): PCP only supports full "
                             "attention and replicated draft groups")
        if dcp > 1 and not (isinstance(spec, FullAttentionSpec) or replicated):
            raise ValueError(f"group {i}: DCP with hybrid KV cache layouts only supports "
                             f"full-attention, Mamba, and replicated draft groups, got: "
                             f"{type(spec).__name__}")


class HybridKVCacheCoordinator(KVCacheCoordinator):
    def __init__(self, *args: object, allow_partial_hash_hits: bool = True,
                 **kwargs: object) -> None:
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]
        hbs = self.hash_block_size
        groups = self.kv_cache_config.kv_cache_groups
        for g, m in zip(groups, self.single_type_managers, strict=True):
            if g.kv_cache_spec.prefix_cacheable and m.block_size % hbs:
                raise ValueError(
                    f"KV cache group block size {m.block_size} is not divisible by the hash "
                    f"block size {hbs}")
        check_cp_layout(groups, self.dcp_world_size, self.pcp_world_size)
        self.enable_partial_hash_hits = allow_partial_hash_hits and partial_hash_hits_enabled(
            self.kv_cache_config, hbs, self.single_type_managers, self.dcp_world_size)
        self.cache_hit_alignment_tokens = hbs if self.enable_partial_hash_hits else \
            self.scheduler_block_size
        for m in self.single_type_managers:
            m.cache_hit_alignment_tokens = self.cache_hit_alignment_tokens
        check_lookup_layout(self, self.cache_hit_alignment_tokens)
        self._split_groups()

    def _split_groups(self) -> None:
        """Merge groups with equal specs into SpecGroups; full attention first."""
        self.attention_groups: list[SpecGroup] = []
        for i, g in enumerate(self.kv_cache_config.kv_cache_groups):
            if not g.kv_cache_spec.prefix_cacheable:
                continue
            cls = type(self.single_type_managers[i])
            eagle = i in self.drop_eagle_group_ids
            for idx, sg in enumerate(self.attention_groups):
                if sg.spec == g.kv_cache_spec and sg.manager_cls is cls:
                    sg.group_ids.append(i)
                    if eagle and not sg.use_eagle:
                        self.attention_groups[idx] = sg._replace(use_eagle=True)
                    break
            else:
                self.attention_groups.append(SpecGroup(g.kv_cache_spec, [i], cls, eagle))
        # Lookups see a sharded group's DCP-scaled block (grouping used the declared specs).
        self.attention_groups = [sg._replace(spec=self.lookup_spec(sg.group_ids[0]))
                                 for sg in self.attention_groups]
        if not self.attention_groups:
            raise ValueError("the hybrid coordinator needs at least one prefix-cacheable group")
        self.attention_groups.sort(key=lambda sg: not isinstance(sg.spec, FullAttentionSpec))
        first = self.attention_groups[0]
        self.full_attention_group_id: int | None = (
            first.group_ids[0] if isinstance(first.spec, FullAttentionSpec) else None)
        for sg in self.attention_groups:
            if sg.use_eagle:
                for gid in sg.group_ids:
                    self.single_type_managers[gid].use_eagle = True
        self._simple = (len(self.attention_groups) == 2
                        and isinstance(self.attention_groups[0].spec, FullAttentionSpec))

    def _align_cacheable(self, n: int) -> int:
        # Hits are sbs-aligned unless fine-grained hits are on; then no rounding at all
        # (rounding to the hash unit would re-register a privatised Mamba tail).
        if self.enable_partial_hash_hits:
            return n
        return n // self.scheduler_block_size * self.scheduler_block_size

    def get_num_cacheable_tokens(self, num_computed_tokens: int, kv_cache_group_id: int) -> int:
        aligned = self._align_cacheable(num_computed_tokens)
        m = self.single_type_managers[kv_cache_group_id]
        if m.use_eagle and aligned > 0:
            # One block past the boundary: the block an EAGLE lookup matches then drops.
            finalized = max(0, num_computed_tokens - self.num_reprefillable_tokens)
            return min(finalized, self._align_cacheable(finalized) + m.block_size)
        return aligned

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        # Same as the base fan-out with get_num_cacheable_tokens inlined for the common
        # (non-EAGLE) groups: this runs for every scheduled request every step.
        boundaries = self.replay_boundaries_for(request.num_prompt_tokens)
        aligned = num_computed_tokens if self.enable_partial_hash_hits else \
            num_computed_tokens // self.scheduler_block_size * self.scheduler_block_size
        retention = self.retention_interval
        for gid, m in self._caching_managers:
            n = self.get_num_cacheable_tokens(num_computed_tokens, gid) if m.use_eagle \
                else aligned
            m.cache_blocks(request, n, retention, replay_boundaries=boundaries)

    def _margin(self, sg: SpecGroup, num_hashes: int, length: int) -> int:
        bs = self.single_type_managers[sg.group_ids[0]].block_size
        margin = eagle_proof_margin(
            bs, self.hash_block_size,
            self.enable_partial_hash_hits and sg.manager_cls.supports_fine_grained_hash_lookup)
        return min(length + margin, num_hashes * self.hash_block_size)

    def find_longest_cache_hit(self, block_hashes: Sequence[BlockHash],
                               max_cache_hit_length: int) -> tuple[Hits, int, int]:
        n_groups = len(self.kv_cache_config.kv_cache_groups)
        hit_length = max_cache_hit_length
        longest = 0
        blocks_by_group: list[list[KVCacheBlock] | None] = [None] * n_groups
        len_by_group = [0] * n_groups
        align = self.cache_hit_alignment_tokens
        # Each EAGLE group drops at most once per candidate length; a shrink by a
        # non-EAGLE group invalidates every verification.
        eagle_verified: set[int] = set()
        while True:
            curr = hit_length
            for idx, sg in enumerate(self.attention_groups):
                first = sg.group_ids[0]
                is_full = isinstance(sg.spec, FullAttentionSpec)
                if is_full and blocks_by_group[first] is not None:
                    curr = min(curr, len_by_group[first])
                    continue
                drop = sg.use_eagle and idx not in eagle_verified
                bound = curr
                if drop and not isinstance(sg.spec, MambaSpec):
                    bound = self._margin(sg, len(block_hashes), curr)
                hits, new_len = sg.manager_cls.find_longest_cache_hit(
                    block_hashes, bound, sg.group_ids, self.block_pool, sg.spec, drop, align)
                if drop:
                    eagle_verified.add(idx)
                elif new_len < curr:
                    eagle_verified.clear()
                curr = new_len
                for gid, lst in zip(sg.group_ids, hits, strict=True):
                    blocks_by_group[gid] = lst
                    len_by_group[gid] = new_len
                longest = max(longest, curr)
            if curr >= hit_length:
                break
            hit_length = curr
            if self._simple:
                break
        for sg in self.attention_groups:
            if not isinstance(sg.spec, FullAttentionSpec):
                continue
            m = self.single_type_managers[sg.group_ids[0]]
            if m.retains_longer_hit:
                # Keeps its longer hit (and length); allocate_slots trims it to the reuse.
                continue
            keep = cdiv(hit_length, m.block_size)
            for gid in sg.group_ids:
                kept = blocks_by_group[gid]
                if kept is not None:
                    del kept[keep:]
                    len_by_group[gid] = hit_length
        out = tuple(lst if lst is not None else [] for lst in blocks_by_group)
        return out, hit_length, longest - hit_length

    def find_longest_cache_hit_per_group(
        self, block_hashes: Sequence[BlockHash], max_cache_hit_length: int,
    ) -> tuple[Hits, tuple[int, ...]]:
        """Each SpecGroup searched independently with the full bound (no reconciliation)."""
        n_groups = len(self.kv_cache_config.kv_cache_groups)
        blocks: list[list[KVCacheBlock]] = [[] for _ in range(n_groups)]
        lengths = [0] * n_groups
        for sg in self.attention_groups:
            bound = max_cache_hit_length
            if sg.use_eagle and not isinstance(sg.spec, MambaSpec):
                bound = self._margin(sg, len(block_hashes), max_cache_hit_length)
            hits, n = sg.manager_cls.find_longest_cache_hit(
                block_hashes, bound, sg.group_ids, self.block_pool, sg.spec, sg.use_eagle,
                self.cache_hit_alignment_tokens)
            for gid, lst in zip(sg.group_ids, hits, strict=True):
                blocks[gid] = lst
                lengths[gid] = n
        return tuple(blocks), tuple(lengths)
