"""Mamba "align" partial tails and checkpoints (mixed into
:class:`~kvplugin.core.single_type.mamba.MambaManager`): registering a state at a boundary
inside its slot, the copy-on-write move of a running request's own partial tail, the
finish-time hand-over of a producer's tail, and the re-keying of a reserved checkpoint
slot."""

from __future__ import annotations

from kvplugin.core.blocks import BlockHashWithGroupId, KVCacheBlock
from kvplugin.core.request import Request
from kvplugin.core.single_type.base import SingleTypeKVCacheManager
from kvplugin.core.single_type.mamba_checkpoints import (
    prefill_checkpoint_position,
    retention_mask,
)
from kvplugin.core.specs import cdiv

__all__ = ["MambaTails"]


class MambaTails(SingleTypeKVCacheManager):
    """The partial-tail and checkpoint half of :class:`MambaManager` (which sets these)."""

    _align: bool
    _hbs: int
    drop_eagle_checkpoint_block: bool
    cached_blocks_this_step: set[BlockHashWithGroupId]
    _checkpoints: dict[str, tuple[int, int]]
    _producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]]

    def _move_own_partial_tail(self, request_id: str, idx: int,
                               source: KVCacheBlock, cow: KVCacheBlock) -> None:
        """A running request is about to overwrite the partial state it registered itself.

        Its table stays on ``source`` (append-only for the worker); the cache entry moves
        to ``cow``, which this step's queued copy fills before the forward overwrites
        ``source``.  ``source`` keeps a retention ref until the copy ran.
        """
        if self.req_to_blocks[request_id][idx] is not source:
            raise AssertionError(f"partial tail bookkeeping of {request_id} is inconsistent")
        self.block_pool.move_block_hashes(source, cow)
        self._pending_cow_copies.append((source, cow))
        source.ref_cnt += 1
        producer = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer is not None:
            marker, boundary = producer
            if marker is not source:
                raise AssertionError(f"producer tail of {request_id} is not its CoW source")
            # The copy now preserves the producer's own boundary state: offer it.
            self._pending_boundary_state_offloads.append(
                (request_id, self.kv_cache_group_id, cow, boundary))
        if cow.block_hash is not None:
            # Only this step's copy fills the moved entry.
            self.cached_blocks_this_step.add(cow.block_hash)

    def finalize_partial_tail_offload(self, request_id: str,
                                      num_computed_tokens: int, num_in_flight_tokens: int
                                      ) -> tuple[int, KVCacheBlock, int] | None:
        """A producer finishing exactly at its partial boundary, with nothing in flight,
        still holds the boundary state in its table block: hand that block over."""
        if not self._align:
            return None
        producer = self._producer_partial_tail_reqs.pop(request_id, None)
        if producer is None:
            return None
        source, boundary = producer
        if num_in_flight_tokens != 0 or num_computed_tokens != boundary:
            return None
        return self.kv_cache_group_id, source, boundary

    def _cache_partial_tail_block(self, request: Request, num_tokens: int,
                                  retention_interval: int | None
                                  ) -> BlockHashWithGroupId | None:
        """Register a state at a boundary inside its slot; returns the new key, if any."""
        if self._checkpoints:
            checkpoint = self._checkpoints.get(request.request_id)
            if checkpoint is not None:
                return self._cache_checkpoint(request, checkpoint, retention_interval)
        hbs = self._hbs
        if num_tokens <= 0 or num_tokens % hbs:
            return None
        prompt_boundary = prefill_checkpoint_position(
            request.num_prompt_tokens, hbs, self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens)
        # Besides the prompt's last boundary, a sibling resumes at the shared-prefix
        # junction; only inside the prompt chunk being computed (a decode state block is
        # mutated in place and matches its key only after the step's forward).
        if num_tokens != prompt_boundary and not (
                self.shared_prefix_checkpoint
                and num_tokens == request.shared_prefix_boundary
                and request.num_computed_tokens < num_tokens <= request.num_prompt_tokens):
            return None
        idx = cdiv(num_tokens, self.block_size) - 1
        blocks = self.req_to_blocks[request.request_id]
        if idx >= len(blocks):
            return None
        source = blocks[idx]
        # Re-keying a block already keyed here would defer every sibling hitting it.
        if source.is_null or source.block_hash_num_tokens == num_tokens:
            return None
        key = self.block_pool.cache_partial_block(request, source, num_tokens,
                                                  self.kv_cache_group_id, self.block_size)
        if key is not None and num_tokens % self.block_size:
            # This request produced a partial tail its next forward overwrites: its next
            # allocation copies the state out (and offers the copy to a connector).
            rid = request.request_id
            self._partial_hit_reqs[rid] = (idx, source)
            self.num_cached_block[rid] = idx
            self._producer_partial_tail_reqs[rid] = (source, num_tokens)
        return key

    def _cache_checkpoint(self, request: Request,
                          checkpoint: tuple[int, int], retention_interval: int | None
                          ) -> BlockHashWithGroupId | None:
        """Re-key the reserved checkpoint slot at the exported boundary, or drop its
        identity when that boundary is transient (nobody can resume there)."""
        position, idx = checkpoint
        blocks = self.req_to_blocks[request.request_id]
        if not 0 <= idx < len(blocks):
            raise AssertionError(f"checkpoint slot {idx} of {request.request_id} is missing")
        block = blocks[idx]
        # The prompt's final chunk caches only its full blocks, so its checkpoint is the
        # prompt's reusable boundary even though num_tokens < num_prompt_tokens there.
        keep = position == prefill_checkpoint_position(
            request.num_prompt_tokens, self.cache_hit_alignment_tokens,
            self.drop_eagle_checkpoint_block, self.block_pool.num_hash_lookahead_tokens)
        if not keep and position % self.block_size == 0:
            slot = position // self.block_size - 1
            mask = retention_mask(slot, slot + 1, self.block_size,
                                  self.cache_hit_alignment_tokens, retention_interval, ())
            keep = mask is None or mask[0]
        if not keep and position != request.shared_prefix_boundary:
            # The slot's content is overwritten: neither the checkpoint nor a full-block
            # key registered earlier this step is reusable.
            self.block_pool.evict_blocks((block.block_id,))
            return None
        if block.block_hash_num_tokens == position:
            return None
        return self.block_pool.cache_partial_block(
            request, block, position, self.kv_cache_group_id, self.block_size,
            replace_existing_hashes=True)
