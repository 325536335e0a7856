"""Full attention: left-to-right, prefix-closed hits; every block lives until freed."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import BlockHash, KVCacheBlock
from kvplugin.core.hashing import BlockHashListWithBlockSize, resolve_block_hashes
from kvplugin.core.request import Request
from kvplugin.core.single_type.base import HitResult, SingleTypeKVCacheManager
from kvplugin.core.specs import KVCacheSpec, cdiv


class FullAttentionManager(SingleTypeKVCacheManager):
    supports_fine_grained_hash_lookup: ClassVar[bool] = True
    releases_window_blocks: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: KVCacheSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        if self.block_size == self._hash_block_size:
            # No prompt tail can end inside a block: skip this class's wrapper frame on
            # the hot path.
            self.cache_blocks = super().cache_blocks  # type: ignore[method-assign]

    @classmethod
    def find_longest_cache_hit(
        cls,
        block_hashes: Sequence[BlockHash],
        max_length: int,
        kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool,
        kv_cache_spec: KVCacheSpec,
        drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> HitResult:
        bs = kv_cache_spec.block_size
        hashes = resolve_block_hashes(
            block_hashes, block_pool.hash_block_size, bs,
            supports_fine_grained_hash_lookup=cls.supports_fine_grained_hash_lookup,
            alignment_tokens=alignment_tokens)
        # Fine-grained: interior hash boundaries of the first missing block may still hit
        # (a partial-prefix entry registered by a request whose prompt ended there).
        fine = alignment_tokens < bs and bs % alignment_tokens == 0
        full_hashes = BlockHashListWithBlockSize(hashes, alignment_tokens, bs) if fine else hashes
        groups = len(kv_cache_group_ids)
        computed: tuple[list[KVCacheBlock], ...] = tuple([] for _ in range(groups))
        n = min(max_length // bs, len(full_hashes))
        if groups == 1:
            hits = computed[0]
            get = block_pool.cached_block_hash_to_block.get_one_block
            suffix = kv_cache_group_ids[0].to_bytes(4, "big")
            for i in range(n):
                block = get(full_hashes[i] + suffix)
                if block is None:
                    break
                hits.append(block)
        else:
            for i in range(n):
                cached = block_pool.get_cached_block(full_hashes[i], kv_cache_group_ids)
                if not cached:
                    break
                for lst, blk in zip(computed, cached, strict=True):
                    lst.append(blk)
        hit = len(computed[0]) * bs
        if fine:
            k = bs // alignment_tokens
            first = len(computed[0]) * k
            last = min(first + k - 1, max_length // alignment_tokens, len(hashes))
            for fine_idx in range(last - 1, first - 1, -1):
                tail = block_pool.get_cached_block(hashes[fine_idx], kv_cache_group_ids)
                if not tail:
                    continue
                for lst, blk in zip(computed, tail, strict=True):
                    lst.append(blk)
                hit = (fine_idx + 1) * alignment_tokens
                break
        if drop_eagle_block and hit > 0:
            hit -= min(alignment_tokens, bs)
        hit -= hit % alignment_tokens
        keep = cdiv(hit, bs)
        for lst in computed:
            del lst[keep:]
        return computed, hit

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        return None  # nothing ever leaves a full-attention window

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        super().cache_blocks(request, num_tokens, retention_interval,
                             replay_boundaries=replay_boundaries)
        if self.block_size != self.block_pool.hash_block_size:
            self._cache_partial_tail_block(request, num_tokens)

    def _cache_partial_tail_block(self, request: Request, num_tokens: int) -> None:
        """Register the prompt's last hash boundary when it ends inside a block."""
        hbs = self.block_pool.hash_block_size
        # A resend matches at most P - 1 tokens; EAGLE lookups read the whole prompt and
        # then drop a hash unit.
        limit = request.num_prompt_tokens if self.use_eagle else request.num_prompt_tokens - 1
        boundary = min(limit // hbs, len(request.block_hashes)) * hbs
        if boundary == 0 or boundary > num_tokens or boundary % self.block_size == 0:
            return
        table = self.req_to_blocks[request.request_id]
        idx = boundary // self.block_size
        if idx >= len(table):
            return
        self.block_pool.cache_partial_block(request, table[idx], boundary,
                                            self.kv_cache_group_id, self.block_size)
