"""Circular-buffer scratch groups: exactly one block (the ring) per request, claimed at its
first allocation and freed with it.  Not prefix-cacheable: no hits, no caching, no events,
and its block is never recorded for zeroing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import BlockHash, KVCacheBlock
from kvplugin.core.request import Request
from kvplugin.core.single_type.base import HitResult
from kvplugin.core.single_type.full import FullAttentionManager
from kvplugin.core.specs import KVCacheSpec


class CircularBufferManager(FullAttentionManager):
    supports_fine_grained_hash_lookup: ClassVar[bool] = False

    def __init__(self, kv_cache_spec: KVCacheSpec, **kwargs: Any) -> None:
        super().__init__(kv_cache_spec, **kwargs)
        self._record_new_block_ids = False  # the ring is not zeroed (vLLM: not recorded)
        self.cache_blocks = self._no_caching  # type: ignore[method-assign]

    def _claim_ring_block(self, request_id: str) -> list[KVCacheBlock]:
        table = self.req_to_blocks[request_id]
        if table:
            return []
        new = self.block_pool.get_new_blocks(1)
        table.extend(new)
        return new

    def get_num_blocks_to_allocate(
        self, request_id: str, num_tokens: int, new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int, num_local_computed_tokens: int, num_tokens_main_model: int,
        apply_admission_cap: bool = False, prefill_end: int = 0,
    ) -> int:
        return 0 if self.req_to_blocks.get(request_id) else 1

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        return self._claim_ring_block(request_id)

    def allocate_external_computed_blocks(self, request_id: str, num_local_computed_tokens: int,
                                          num_external_computed_tokens: int,
                                          record_for_zeroing: bool = True) -> None:
        self._claim_ring_block(request_id)

    def add_local_computed_blocks(self, request_id: str,
                                  new_computed_blocks: Sequence[KVCacheBlock],
                                  num_local_computed_tokens: int,
                                  num_external_computed_tokens: int) -> None:
        return None  # never any hits to adopt

    @classmethod
    def find_longest_cache_hit(
        cls, block_hashes: Sequence[BlockHash], max_length: int, kv_cache_group_ids: Sequence[int],
        block_pool: BlockPool, kv_cache_spec: KVCacheSpec, drop_eagle_block: bool,
        alignment_tokens: int,
    ) -> HitResult:
        return tuple([] for _ in kv_cache_group_ids), 0

    def _no_caching(self, request: Request, num_tokens: int,
                    retention_interval: int | None = None, *,
                    replay_boundaries: Sequence[int]) -> None:
        return None
