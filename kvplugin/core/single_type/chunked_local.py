"""Chunked local attention (e.g. Llama-4 local layers): token t attends within its chunk."""

from __future__ import annotations

from collections.abc import Sequence

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import BlockHash, KVCacheBlock
from kvplugin.core.hashing import resolve_block_hashes
from kvplugin.core.single_type.base import HitResult, SingleTypeKVCacheManager
from kvplugin.core.specs import ChunkedLocalAttentionSpec, KVCacheSpec


class ChunkedLocalAttentionManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: KVCacheSpec, **kwargs: object) -> None:
        if not isinstance(kv_cache_spec, ChunkedLocalAttentionSpec):
            raise TypeError("ChunkedLocalAttentionManager needs a ChunkedLocalAttentionSpec")
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        self.attention_chunk_size = kv_cache_spec.attention_chunk_size

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
        """Earlier chunks count as computed (null placeholders); scan the current chunk."""
        assert isinstance(kv_cache_spec, ChunkedLocalAttentionSpec)
        if drop_eagle_block:
            raise ValueError("EAGLE is not supported with chunked local attention")
        bs = kv_cache_spec.block_size
        if bs != alignment_tokens:
            raise ValueError("chunked local attention needs its block size to equal the "
                             "cache-hit alignment (no mixed block sizes)")
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, bs,
                                      alignment_tokens=alignment_tokens)
        chunk = kv_cache_spec.attention_chunk_size
        start = max_length // chunk * chunk if max_length > 0 else 0
        start_block = start // bs
        null = block_pool.null_block
        computed: tuple[list[KVCacheBlock], ...] = tuple(
            [null] * start_block for _ in kv_cache_group_ids)
        for i in range(start_block, max_length // bs):
            cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if not cached:
                break
            for lst, blk in zip(computed, cached, strict=True):
                lst.append(blk)
        return computed, len(computed[0]) * bs

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return num_computed_tokens // self.attention_chunk_size * self.attention_chunk_size
