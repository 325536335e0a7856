"""The block pool's KV events (mixed into :class:`~kvplugin.core.block_pool.BlockPool`):
what a ``BlockStored`` of a request's blocks says (hashes, tokens, extra keys, lookahead
tokens, LoRA, medium, group) and the ``BlockRemoved`` of keys that left the cache, queued on
the pool's ``kv_event_queue`` exactly as vLLM 0.33's ``BlockPool`` emits them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from kvplugin.core.blocks import BlockHashWithGroupId, KVCacheBlock, external_block_hash
from kvplugin.core.events import BlockRemoved, BlockStored, KVCacheEvent
from kvplugin.core.hashing import (
    generate_block_hash_extra_keys,
    generate_lookahead_block_hash_extra_keys,
    resolve_block_hashes,
    to_event_extra_keys,
)
from kvplugin.core.request import Request

__all__ = ["BlockEvents"]


class BlockEvents:
    """Expects the pool's event switch, medium, hash block size, lookahead and queue."""

    enable_kv_cache_events: bool
    medium: str
    hash_block_size: int
    num_hash_lookahead_tokens: int
    kv_event_queue: list[KVCacheEvent]

    def _event_extra_keys(
        self, request: Request, blocks: Sequence[KVCacheBlock], first: int, last: int,
        block_size: int, block_mask: Sequence[bool] | None,
    ) -> tuple[list[tuple[Any, ...] | None], list[list[int]] | None]:
        keys: list[tuple[Any, ...] | None] = []
        lookahead: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
        if lookahead is None and (request.has_no_extra_keys or (
                first > 0 and request.uniform_after_first_block)):
            # Every block here carries the same keys (LoRA or nothing).
            if block_mask is None:
                n = last - first
                for i in range(first, last):
                    if blocks[i].is_null:
                        n -= 1
            else:
                n = sum(1 for i in range(first, last)
                        if block_mask[i - first] and not blocks[i].is_null)
            lora = request.lora_request
            k = None if lora is None else (("lora", lora.lora_name, lora.lora_path),)
            return [k] * n, None
        mm_idx = 0
        for i in range(first, last):
            if blocks[i].is_null or (block_mask is not None and not block_mask[i - first]):
                continue
            start = i * block_size
            k, mm_idx = self._extra_keys(request, start, start + block_size, mm_idx)
            keys.append(k)
            if lookahead is not None:
                lookahead.append(self._lookahead_tokens(request, start + block_size))
        return keys, lookahead

    def _extra_keys(self, request: Request, start: int, end: int,
                    mm_idx: int) -> tuple[tuple[Any, ...] | None, int]:
        if self.num_hash_lookahead_tokens:
            return generate_lookahead_block_hash_extra_keys(
                request, start, end, end + self.num_hash_lookahead_tokens, mm_idx)
        return generate_block_hash_extra_keys(request, start, end, mm_idx)

    def _lookahead_tokens(self, request: Request, block_end: int) -> list[int]:
        return request.all_token_ids[block_end:block_end + self.num_hash_lookahead_tokens]

    def _stored_event(
        self, request: Request, hashes: list[int], parent: int | None, start: int, end: int,
        block_size: int, group_id: int, extra_keys: list[tuple[Any, ...] | None],
        lookahead: list[list[int]] | None,
    ) -> BlockStored:
        lora = request.lora_request
        if not extra_keys:
            event_keys = None
        elif extra_keys[0] is None and extra_keys[-1] is None and not any(extra_keys):
            event_keys = list(extra_keys)
        else:
            event_keys = to_event_extra_keys(extra_keys)
        return BlockStored(
            hashes, parent, request.all_token_ids[start:end], block_size,
            lora.lora_int_id if lora else None, self.medium, lora.lora_name if lora else None,
            event_keys, group_id, None, None, None, None, request.session_id, lookahead)

    def emit_cached_block_events(self, request: Request, num_cached_blocks: int,
                                 block_size: int, kv_cache_group_id: int) -> None:
        """Re-announce the first ``num_cached_blocks`` blocks of a hit (no state change)."""
        if not self.enable_kv_cache_events or num_cached_blocks == 0:
            return
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        ext = [external_block_hash(hashes[i]) for i in range(num_cached_blocks)]
        keys: list[tuple[Any, ...] | None] = []
        lookahead: list[list[int]] | None = [] if self.num_hash_lookahead_tokens else None
        mm_idx = 0
        for i in range(num_cached_blocks):
            k, mm_idx = self._extra_keys(request, i * block_size, (i + 1) * block_size, mm_idx)
            keys.append(k)
            if lookahead is not None:
                lookahead.append(self._lookahead_tokens(request, (i + 1) * block_size))
        self.kv_event_queue.append(self._stored_event(
            request, ext, None, 0, num_cached_blocks * block_size, block_size,
            kv_cache_group_id, keys, lookahead))

    def _emit_removed(self, keys: list[BlockHashWithGroupId]) -> None:
        if not self.enable_kv_cache_events:
            return
        queue = self.kv_event_queue
        medium = self.medium
        for key in keys:
            # key = hash + 4-byte group id; events carry the hash's low 64 bits.
            queue.append(BlockRemoved([int.from_bytes(key[-12:-4], "big")], medium,
                                      int.from_bytes(key[-4:], "big")))
