"""Mamba / linear attention: a table position is a recurrent *state slot*, not token KV.

Slot ``i`` holds the state after ``(i+1)*bs`` tokens, and one state is all a request
needs to resume.  Two modes:

* ``"none"`` (no prefix caching): one running state plus ``num_speculative_blocks``
  scratch slots for draft tokens, for the whole request.
* ``"align"`` (prefix caching; the scheduler ends prefill chunks on slot boundaries):
  every chunk writes its final state into a fresh slot, earlier slots become null, and a
  slot is registered in the prefix cache once its state is final.  A hit is a single
  slot.  On top: a same-step guard (a state cached in this scheduling pass is not on the
  device yet), optional mid-chunk *prefill checkpoints*, fine-grained *partial* hits
  (a boundary inside a slot, served by copy-on-write), and hand-offs of committed
  boundary states to an external KV connector.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import ClassVar

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import BlockHash, BlockHashWithGroupId, KVCacheBlock
from kvplugin.core.hashing import resolve_block_hashes
from kvplugin.core.request import Request
from kvplugin.core.single_type.base import HitResult
from kvplugin.core.single_type.mamba_checkpoints import (
    checkpoint_exportable,
    prefill_checkpoint_position,
    retention_mask,
)
from kvplugin.core.single_type.mamba_tails import MambaTails
from kvplugin.core.specs import KVCacheSpec, MambaSpec, cdiv


def validate_mamba_spec(spec: MambaSpec, enable_caching: bool) -> None:
    """Reject layouts the manager cannot run (raised at construction, not mid-trace)."""
    if spec.mamba_cache_mode != "align" and enable_caching:
        raise ValueError(
            f"Mamba mode {spec.mamba_cache_mode!r} cannot prefix-cache; use "
            "mamba_cache_mode='align' or disable prefix caching")
    if spec.prefill_checkpoint_alignment is not None and spec.prefill_checkpoint_alignment <= 0:
        raise ValueError("Mamba prefill_checkpoint_alignment must be a positive token count "
                         f"or None, got {spec.prefill_checkpoint_alignment}")
    if spec.num_prefill_checkpoint_blocks and spec.mamba_cache_mode != "align":
        raise ValueError("Mamba prefill checkpoint blocks need mamba_cache_mode='align' "
                         "(mode 'none' keeps no intermediate states)")


class MambaManager(MambaTails):
    supports_fine_grained_hash_lookup: ClassVar[bool] = True

    def __init__(self, kv_cache_spec: KVCacheSpec, **kwargs: object) -> None:
        if not isinstance(kv_cache_spec, MambaSpec):
            raise TypeError("MambaManager needs a MambaSpec")
        validate_mamba_spec(kv_cache_spec, bool(kwargs.get("enable_caching")))
        super().__init__(kv_cache_spec, **kwargs)  # type: ignore[arg-type]
        self.mamba_cache_mode = kv_cache_spec.mamba_cache_mode
        self._align = self.mamba_cache_mode == "align"
        self.num_speculative_blocks = kv_cache_spec.num_speculative_blocks
        self.has_prefill_checkpoint_blocks = (
            self._align and kv_cache_spec.num_prefill_checkpoint_blocks > 0)
        self.prefill_checkpoint_alignment = kv_cache_spec.prefill_checkpoint_alignment
        self._hbs = self.block_pool.hash_block_size
        # Set by the coordinator under EAGLE: checkpoints follow its replay boundary.
        self.drop_eagle_checkpoint_block = False
        # Keys registered during the current scheduling pass: their states are written
        # by this pass's forward, so a hit on them must wait for the next pass.
        self.cached_blocks_this_step: set[BlockHashWithGroupId] = set()
        # --- "align" bookkeeping, all keyed by request id ---
        # Slot of the state the previous allocation resumed from; freed once the next
        # state exists (the running state is copied from it into the new slot).
        self.last_state_block_idx: dict[str, int] = {}
        # Retirement watermark: slots below it were already released.
        self._num_retired_blocks: dict[str, int] = {}
        # Requests that completed a first allocation (they own speculative slots).
        self._allocated_block_reqs: set[str] = set()
        # Mid-chunk checkpoint of the coming allocation: (token position, slot index).
        self._checkpoints: dict[str, tuple[int, int]] = {}
        # Producers of their own prompt-boundary partial tail: (table block, boundary).
        self._producer_partial_tail_reqs: dict[str, tuple[KVCacheBlock, int]] = {}

    @property
    def has_positionally_stable_blocks(self) -> bool:
        # "align" nulls interior states and relocates speculative slots in place.
        return not self._align

    # ------------------------------------------------------------------ lookup
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
        """Right to left, the first cached state wins (a state needs nothing before it).

        Never drops an EAGLE block: draft models have no Mamba layers.
        """
        if not isinstance(kv_cache_spec, MambaSpec):
            raise TypeError("MambaManager can only look up Mamba groups")
        bs = kv_cache_spec.block_size
        hashes = resolve_block_hashes(
            block_hashes, block_pool.hash_block_size, bs,
            supports_fine_grained_hash_lookup=True, alignment_tokens=alignment_tokens)
        if alignment_tokens < bs and bs % alignment_tokens == 0:
            # Fine-grained: any hash boundary may carry a partial-state entry.
            n = min(max_length // alignment_tokens, len(hashes))
            return cls._scan(hashes, n, alignment_tokens, bs // alignment_tokens,
                             alignment_tokens, kv_cache_group_ids, block_pool)
        # A slot hit must still end on an alignment boundary shared with the other groups.
        return cls._scan(hashes, max_length // bs, bs, 1, alignment_tokens,
                         kv_cache_group_ids, block_pool)

    @staticmethod
    def _scan(hashes: Sequence[BlockHash], n: int, unit: int, per_slot: int, alignment: int,
              group_ids: Sequence[int], pool: BlockPool) -> HitResult:
        """Scan entries ``n-1 .. 0``: entry ``i`` covers ``(i+1)*unit`` tokens and lives in
        slot ``i // per_slot``; entries whose right edge misses ``alignment`` are skipped.
        """
        null = pool.null_block
        out: tuple[list[KVCacheBlock], ...] = tuple([] for _ in group_ids)
        aligned = unit == alignment
        single = len(group_ids) == 1
        get_one = pool.cached_block_hash_to_block.get_one_block
        suffix = group_ids[0].to_bytes(4, "big")
        for i in range(n - 1, -1, -1):
            if not aligned and (i + 1) * unit % alignment:
                continue
            if single:
                block = get_one(hashes[i] + suffix)
                if block is None:
                    continue
                cached = [block]
            else:
                found = pool.get_cached_block(hashes[i], group_ids)
                if not found:
                    continue
                cached = found
            pad = [null] * (i // per_slot)
            for lst, blk in zip(out, cached, strict=True):
                lst.extend(pad)
                lst.append(blk)
            return out, (i + 1) * unit
        return out, 0

    # ------------------------------------------------------------------ prediction
    def get_num_blocks_to_allocate(
        self,
        request_id: str,
        num_tokens: int,
        new_computed_blocks: Sequence[KVCacheBlock],
        total_computed_tokens: int,
        num_local_computed_tokens: int,
        num_tokens_main_model: int,
        apply_admission_cap: bool = False,
        prefill_end: int = 0,
    ) -> int:
        """Blocks the coming allocation takes.  Under "align" this may be negative (a table
        over-allocated for rejected drafts), which lowers the total over all groups.

        Side effect (not as the admission gate): plans this step's prefill checkpoint, so it
        must run before :meth:`allocate_new_blocks`, as ``allocate_slots`` does.
        """
        if (new_computed_blocks and self.cached_blocks_this_step
                and new_computed_blocks[-1].block_hash in self.cached_blocks_this_step):
            # The hit state is written by this pass's forward: ask for more than the pool
            # holds so the request is retried next pass.
            return self.block_pool.num_gpu_blocks + 1
        if not self._align:
            return super().get_num_blocks_to_allocate(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                new_computed_blocks, total_computed_tokens, num_local_computed_tokens,
                num_tokens_main_model, apply_admission_cap, prefill_end)
        # Draft tokens get no slot: draft models have no Mamba layers, and counting them
        # would shift the state slots off the chunk boundaries.
        num_tokens = num_tokens_main_model
        table = self.req_to_blocks.get(request_id)
        num_new = (-(num_tokens // -self.block_size) + self.num_speculative_blocks
                   - len(new_computed_blocks) - (len(table) if table else 0))
        partial = ((len(new_computed_blocks) > 0
                    and num_local_computed_tokens % self.block_size != 0)
                   or request_id in self._partial_hit_reqs)
        if partial:
            num_new = max(num_new, 0) + 1  # the private copy of the shared tail
        checkpoint = 0
        if self.has_prefill_checkpoint_blocks:
            checkpoint = self._plan_checkpoint(request_id, total_computed_tokens, num_tokens,
                                               prefill_end, record=not apply_admission_cap)
        if num_new > 0:
            # At most one new state slot per step, plus the copy, the checkpoint slot and,
            # on the first allocation, the speculative slots.
            cap = 1 + int(partial) + checkpoint
            if request_id not in self._allocated_block_reqs:
                cap += self.num_speculative_blocks
            num_new = min(num_new, cap)
        evictable = 0
        for blk in new_computed_blocks:
            if blk.ref_cnt == 0 and not blk.is_null:
                evictable += 1
        return num_new + evictable

    def _plan_checkpoint(self, request_id: str, query_start: int, query_end: int,
                         prefill_end: int, record: bool) -> int:
        """1 if this chunk reserves a slot for a mid-chunk checkpoint, else 0.

        Keyed on the chunk end, like the worker that writes the state there.  With
        ``record`` the plan (position, slot) is remembered for allocation and caching.
        """
        position = prefill_checkpoint_position(
            query_end, self.cache_hit_alignment_tokens, self.drop_eagle_checkpoint_block,
            self.block_pool.num_hash_lookahead_tokens)
        slot = cdiv(query_end, self.block_size) - 2
        if not (query_end >= prefill_end and slot >= 0 and checkpoint_exportable(
                query_start, query_end, position, self.block_pool.hash_block_size,
                self.block_size, self.prefill_checkpoint_alignment)
                and self._checkpoint_slot_free(request_id, slot)):
            position = 0
        if record:
            if position > 0:
                self._checkpoints[request_id] = (position, slot)
            else:
                self._checkpoints.pop(request_id, None)
        return int(position > 0)

    def _checkpoint_slot_free(self, request_id: str, slot: int) -> bool:
        # Past the table, a null gap, or one of a running request's speculative slots.
        table = self.req_to_blocks.get(request_id) or []
        return (slot >= len(table) or table[slot].is_null
                or (request_id in self._allocated_block_reqs
                    and slot >= len(table) - self.num_speculative_blocks))

    # ------------------------------------------------------------------ allocation
    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Returns the table suffix this call added (nulls, relocated and new blocks); a
        new request's copy-on-write block comes first."""
        if not self._align:
            return super().allocate_new_blocks(
                request_id, num_tokens + self.block_size * self.num_speculative_blocks,
                num_tokens_main_model)
        table = self.req_to_blocks[request_id]
        num_spec = self.num_speculative_blocks
        required = -(num_tokens_main_model // -self.block_size) + num_spec
        checkpoint = int(request_id in self._checkpoints)
        partial = self._partial_hit_reqs.get(request_id)
        prev_len = len(table)
        if required <= prev_len and partial is None and not checkpoint:
            # Over-allocated earlier (rejected drafts): the current slots still fit.
            self._allocated_block_reqs.add(request_id)
            return []
        running = request_id in self._allocated_block_reqs
        # The state this step resumes from: the running slot (just before the speculative
        # ones), or for a new request the hit state at the table's end.
        if running:
            self.last_state_block_idx[request_id] = prev_len - 1 - num_spec
        elif prev_len > 0:
            self.last_state_block_idx[request_id] = prev_len - 1
        state_slot = required - num_spec - 1
        # Null gaps up to the new state slot; a reserved checkpoint slot stays open.
        if prev_len < state_slot - checkpoint:
            table.extend([self._null_block] * (state_slot - checkpoint - prev_len))
        if running:
            self._relocate_passed_speculative_blocks(table, prev_len, state_slot - checkpoint)
        num_new = max(required - len(table), 0)
        cap = 1 + checkpoint + (0 if running else num_spec)
        if partial is not None:
            num_new += 1
            cap += 1
        if num_new > cap:
            raise AssertionError(f"Mamba allocation of {request_id} wants {num_new} blocks, "
                                 f"more than the {cap} planned")
        new = self.block_pool.get_new_blocks(num_new)
        added = table[prev_len:]
        if partial is not None:
            idx, source = partial
            cow = new.pop(0)
            if running:
                self._move_own_partial_tail(request_id, idx, source, cow)
            else:
                self._apply_cow(request_id, idx, source, cow)
                added.insert(0, cow)
            del self._partial_hit_reqs[request_id]
        table.extend(new)
        self._allocated_block_reqs.add(request_id)
        added.extend(new)
        return added

    def _relocate_passed_speculative_blocks(self, table: list[KVCacheBlock], prev_len: int,
                                            end: int) -> None:
        """Move speculative scratch slots the new state slot leaves behind to the table's
        end: the worker's table is append-only, so their old positions become null."""
        for idx in range(prev_len - self.num_speculative_blocks, min(prev_len, end)):
            block = table[idx]
            if not self.block_pool.is_block_writable(block):
                raise AssertionError("speculative Mamba blocks must be exclusively owned and "
                                     f"unhashed to relocate (block {block.block_id})")
            table.append(block)
            table[idx] = self._null_block

    # ------------------------------------------------------------------ freeing
    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        # Only the state after the last computed token is needed.
        return num_computed_tokens - 1

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        if not self._align:
            super()._remove_blocks_in_range(request_id, first, last)
            return
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        # Prefill leaves null gaps between states, so walk over them (no early stop) but
        # never rescan below the retirement watermark.
        first = max(first, self._num_retired_blocks.get(request_id, 0))
        last = min(last, len(blocks))
        if first >= last:
            return
        null = self._null_block
        freed: list[KVCacheBlock] = []
        for i in range(last - 1, first - 1, -1):
            blk = blocks[i]
            if not blk.is_null:
                freed.append(blk)
                blocks[i] = null
        if freed:
            self.block_pool.free_blocks(freed)
        self._num_retired_blocks[request_id] = last

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        if not self._align:
            super().remove_skipped_blocks(request_id, processed_computed_tokens,
                                          num_prompt_tokens)
            return
        # Every state slot before the last processed token's is dead; most steps retire
        # nothing new, so check the watermark before walking.
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None:
            return
        bs = self.block_size
        if processed_computed_tokens > 1:
            last = min((processed_computed_tokens - 1) // bs, len(blocks))
            if last > self._num_retired_blocks.get(request_id, 0):
                self._remove_blocks_in_range(request_id, 0, last)
        # The previous step's source state may sit above the watermark (prefill tables
        # are not contiguous); release it once a newer state is committed.
        last_state = self.last_state_block_idx.get(request_id)
        if last_state is not None and last_state < -(processed_computed_tokens // -bs) - 1:
            blk = blocks[last_state]
            if not blk.is_null:
                self.block_pool.free_blocks((blk,))
                blocks[last_state] = self._null_block

    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        if self._align:
            self._allocated_block_reqs.discard(request_id)
            self.last_state_block_idx.pop(request_id, None)
            self._num_retired_blocks.pop(request_id, None)
            self._checkpoints.pop(request_id, None)
            self._producer_partial_tail_reqs.pop(request_id, None)
            if self._pending_boundary_state_offloads:
                # An undrained offer is only valid while the request holds its blocks.
                self._pending_boundary_state_offloads = [
                    e for e in self._pending_boundary_state_offloads if e[0] != request_id]
        return super().pop_blocks_for_free(request_id)

    def new_step_starts(self) -> None:
        if self.cached_blocks_this_step:
            self.cached_blocks_this_step.clear()

    # ------------------------------------------------------------------ caching
    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        rid = request.request_id
        before = self.num_cached_block.get(rid, 0)
        hbs = self._hbs
        if min(num_tokens, len(request.block_hashes) * hbs) // self.block_size > before:
            super().cache_blocks(request, num_tokens, retention_interval,
                                 replay_boundaries=replay_boundaries)
            after = self.num_cached_block.get(rid, 0)
        else:
            after = before  # no new full slot (the base class would return at once)
        # A partial tail sits on a hash boundary (or at a planned checkpoint).
        if self._align and (self._checkpoints or (num_tokens > 0 and num_tokens % hbs == 0)):
            key = self._cache_partial_tail_block(request, num_tokens, retention_interval)
            if key is not None:
                self.cached_blocks_this_step.add(key)
        if after <= before:
            return
        blocks = self.req_to_blocks[rid]
        for idx in range(before, after):
            blk = blocks[idx]
            # Null gaps and sparse-retention skips carry no hash.
            if blk.block_hash is None or blk.is_null:
                continue
            self.cached_blocks_this_step.add(blk.block_hash)
            if self._align:
                # Offer every committed boundary with its exact block: the table is not
                # positionally stable, so a connector cannot find it by index.
                boundary = blk.block_hash_num_tokens
                if boundary is None:
                    raise AssertionError(f"cached block {blk.block_id} has no token count")
                self._pending_boundary_state_offloads.append(
                    (rid, self.kv_cache_group_id, blk, boundary))

    def block_mask(self, request: Request, start_block: int, end_block: int,
                   retention_interval: int | None,
                   replay_boundaries: Sequence[int]) -> list[bool] | None:
        if retention_interval is None:
            return None
        return retention_mask(start_block, end_block, self.block_size,
                              self.cache_hit_alignment_tokens, retention_interval,
                              self.reachable_boundaries(request, replay_boundaries))

