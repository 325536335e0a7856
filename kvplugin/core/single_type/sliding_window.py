"""Sliding-window attention: right-to-left hits needing a contiguous run of cached blocks.

Token ``n`` attends to ``[n - sw + 1, n]``; a block is released (replaced by the null
block) once every token in it has left the window of the next token to compute.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import BlockHash, KVCacheBlock
from kvplugin.core.hashing import resolve_block_hashes
from kvplugin.core.request import Request
from kvplugin.core.single_type.base import HitResult, SingleTypeKVCacheManager
from kvplugin.core.specs import KVCacheSpec, SlidingWindowSpec, cdiv


def contiguous_blocks_for_hit(window: int, block_size: int, use_eagle: bool) -> int:
    # EAGLE: match one more block, then drop it.
    return cdiv(window - 1, block_size) + (1 if use_eagle else 0)


class SlidingWindowManager(SingleTypeKVCacheManager):
    def __init__(self, kv_cache_spec: KVCacheSpec, **kwargs: object) -> None:
        if not isinstance(kv_cache_spec, SlidingWindowSpec):
            raise TypeError("SlidingWindowManager needs a SlidingWindowSpec")
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        self.sliding_window = kv_cache_spec.sliding_window
        self.extra_retained_tokens = kv_cache_spec.extra_retained_tokens

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
        assert isinstance(kv_cache_spec, SlidingWindowSpec)
        bs = kv_cache_spec.block_size
        # Always the group's physical block granularity (no fine-grained lookup).
        hashes = resolve_block_hashes(block_hashes, block_pool.hash_block_size, bs,
                                      alignment_tokens=alignment_tokens)
        need = contiguous_blocks_for_hit(kv_cache_spec.sliding_window, bs, drop_eagle_block)
        max_blocks = max_length // bs
        null = block_pool.null_block
        computed: tuple[list[KVCacheBlock], ...] = tuple(
            [null] * max_blocks for _ in kv_cache_group_ids)
        run = 0
        found = False
        single = len(kv_cache_group_ids) == 1
        get_one = block_pool.cached_block_hash_to_block.get_one_block
        suffix = kv_cache_group_ids[0].to_bytes(4, "big")
        cached: list[KVCacheBlock] | None
        for i in range(max_blocks - 1, -1, -1):
            if single:
                one = get_one(hashes[i] + suffix)
                cached = None if one is None else [one]
            else:
                cached = block_pool.get_cached_block(hashes[i], kv_cache_group_ids)
            if not cached:
                run = 0
                continue
            if run == 0 and bs != alignment_tokens:
                # A run must end on an aligned boundary (after the EAGLE pop, if any).
                edge = i if drop_eagle_block else i + 1
                if (edge * bs) % alignment_tokens:
                    continue
            for lst, blk in zip(computed, cached, strict=True):
                lst[i] = blk
            run += 1
            if run >= need:
                for lst in computed:
                    del lst[i + run:]
                found = True
                break
        if not found:
            # Only a run touching position 0 can hit: a prefix shorter than the window
            # needs nothing before it.
            for lst in computed:
                del lst[run:]
            cls._realign(computed, bs, alignment_tokens)
        if drop_eagle_block and computed[0]:
            for lst in computed:
                lst.pop()
            cls._realign(computed, bs, alignment_tokens)
        return computed, len(computed[0]) * bs

    @staticmethod
    def _realign(computed: tuple[list[KVCacheBlock], ...], bs: int, alignment: int) -> None:
        while bs != alignment and len(computed[0]) * bs % alignment:
            for lst in computed:
                lst.pop()

    def block_mask(self, request: Request, start_block: int, end_block: int,
                   retention_interval: int | None,
                   replay_boundaries: Sequence[int]) -> list[bool] | None:
        """Register only blocks a hit can use: the ``need`` blocks ending at boundaries."""
        alignment = self.cache_hit_alignment_tokens
        bs = self.block_size
        if alignment % bs:
            return None  # a sub-block alignment is not representable: stay dense
        need = contiguous_blocks_for_hit(self.sliding_window, bs, self.use_eagle)
        shift = 1 if self.use_eagle else 0
        mask = [False] * (end_block - start_block)
        segment = alignment if retention_interval is None else (retention_interval or None)
        if segment is not None:
            per = segment // bs
            if need >= per:
                return None
            for i in range(max(start_block, shift), end_block):
                if (i - shift) % per >= per - need:
                    mask[i - start_block] = True
        if retention_interval is not None:
            for b in self.reachable_boundaries(request, replay_boundaries):
                end = (b // alignment * alignment) // bs + shift
                for j in range(max(start_block, end - need), min(end_block, end)):
                    mask[j - start_block] = True
        return mask

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return max(0, num_computed_tokens - self.sliding_window + 1 - self.extra_retained_tokens)

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        # Hot path (every step of every request): the base rule, inlined.
        skipped = (processed_computed_tokens - self.sliding_window + 1
                   - self.extra_retained_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        n = skipped // self.block_size
        if n > len(blocks):
            n = len(blocks)
        if n and blocks[n - 1] is not self._null_block:
            self._remove_blocks_in_range(request_id, 0, n)
