"""Cross attention (encoder-decoder): one static allocation per request, never cached."""

from __future__ import annotations

from collections.abc import Sequence

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import BlockHash, KVCacheBlock
from kvplugin.core.request import Request
from kvplugin.core.single_type.base import HitResult, SingleTypeKVCacheManager
from kvplugin.core.specs import KVCacheSpec


class CrossAttentionManager(SingleTypeKVCacheManager):
    """Sized by ``num_encoder_tokens``; encoder states are unique per request."""

    releases_window_blocks = False

    def add_local_computed_blocks(self, request_id: str,
                                  new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        if new_computed_blocks:
            raise AssertionError("cross-attention groups never have prefix hits")

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        return None

    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        raise ValueError("cross-attention blocks are never cached; prefix caching must be "
                         "disabled for encoder-decoder models")

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
        raise NotImplementedError("CrossAttentionManager does not support caching")
