"""Shared state and default rules of a per-attention-family manager (one per KV-cache group).

A manager owns its group's block tables (``req_to_blocks``) and decides how many blocks a
step needs, which prefix hits it can use, which blocks leave the attention window, and
which blocks get registered in the prefix cache.  Subclasses override the family-specific
parts; the block pool is shared.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from typing import ClassVar

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import BlockHash, KVCacheBlock, trim_null_head
from kvplugin.core.request import Request
from kvplugin.core.specs import AttentionSpec, KVCacheSpec, cdiv

HitResult = tuple[tuple[list[KVCacheBlock], ...], int]


class SingleTypeKVCacheManager:
    """Base class: full-attention-like defaults (nothing ever leaves the window)."""

    supports_fine_grained_hash_lookup: ClassVar[bool] = False
    # Keeps a hit longer than the reconciled one (vLLM: HiSparse's host tier): the hybrid
    # lookup does not truncate it and allocate_slots trims it to the reused tokens.
    retains_longer_hit: ClassVar[bool] = False
    # False only for families whose remove_skipped_blocks can never free anything.
    releases_window_blocks: ClassVar[bool] = True

    def __init__(
        self,
        kv_cache_spec: KVCacheSpec,
        block_pool: BlockPool,
        enable_caching: bool,
        kv_cache_group_id: int,
        scheduler_block_size: int,
        needs_kv_cache_zeroing: bool = False,
        max_admission_blocks_per_request: int | None = None,
        dcp_world_size: int = 1,
        pcp_world_size: int = 1,
    ) -> None:
        self.kv_cache_spec = kv_cache_spec
        self.block_pool = block_pool
        self.enable_caching = enable_caching
        self.kv_cache_group_id = kv_cache_group_id
        self.scheduler_block_size = scheduler_block_size
        # The hybrid coordinator lowers this to the hash unit when fine-grained hits are on.
        self.cache_hit_alignment_tokens = scheduler_block_size
        # DCP shards a sharded group's token positions across ranks, so one block of this
        # manager spans block_size * DCP tokens; a replicated group keeps its size.
        self.dcp_world_size = dcp_world_size if kv_cache_spec.dcp_sharded else 1
        self.pcp_world_size = pcp_world_size if kv_cache_spec.dcp_sharded else 1
        self.block_size = kv_cache_spec.block_size * self.dcp_world_size
        self.max_admission_blocks_per_request = max_admission_blocks_per_request
        self._record_new_block_ids = needs_kv_cache_zeroing and isinstance(
            kv_cache_spec, AttentionSpec)
        self.new_block_ids: list[int] = []
        self.req_to_blocks: defaultdict[str, list[KVCacheBlock]] = defaultdict(list)
        # Number of leading table positions already registered in the prefix cache.  Its
        # presence also means "this request is known": no new prefix hits will be adopted.
        self.num_cached_block: dict[str, int] = {}
        self._null_block = block_pool.null_block
        self.use_eagle = False
        self.shared_prefix_checkpoint = False
        # Pending copy-on-write of a partial (sub-block) prefix hit: req -> (index, source).
        self._partial_hit_reqs: dict[str, tuple[int, KVCacheBlock]] = {}
        self._pending_cow_copies: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        self._pending_boundary_state_offloads: list[tuple[str, int, KVCacheBlock, int]] = []
        # Families that do not override ``block_mask`` register every full block; skip the
        # call on the hot path.
        self._dense_caching = type(self).block_mask is SingleTypeKVCacheManager.block_mask
        self._cacheable = kv_cache_spec.prefix_cacheable
        self._hash_block_size = block_pool.hash_block_size

    @property
    def has_positionally_stable_blocks(self) -> bool:
        return True

    # ------------------------------------------------------------------ prediction
    def _has_partial_local_hit(self, hits: Sequence[KVCacheBlock], num_local: int) -> bool:
        return len(hits) > 0 and num_local % self.block_size != 0

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
        """How many blocks the next adoption + allocation takes from the free queue."""
        required = -(num_tokens // -self.block_size)
        cap = self.max_admission_blocks_per_request
        if apply_admission_cap and cap is not None:
            required = min(required, cap)
        table = self.req_to_blocks.get(request_id)
        num_req_blocks = len(table) if table else 0
        if request_id in self.num_cached_block:
            if new_computed_blocks:
                raise AssertionError(f"request {request_id} is running; it cannot adopt hits")
            # Rejected drafts can leave the table longer than needed.
            return required - num_req_blocks if required > num_req_blocks else 0
        skipped_blocks = self.get_num_skipped_tokens(total_computed_tokens) // self.block_size
        num_new = max(required - max(skipped_blocks, len(new_computed_blocks) + num_req_blocks),
                      0)
        first_adopted = max(0, skipped_blocks - num_req_blocks)
        # An adopted hit with ref_cnt 0 sits in the free queue; touching it consumes capacity.
        evictable = 0
        for i in range(first_adopted, len(new_computed_blocks)):
            blk = new_computed_blocks[i]
            if blk.ref_cnt == 0 and not blk.is_null:
                evictable += 1
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            num_new += 1  # the private copy of a shared tail block
        return num_new + evictable

    # ------------------------------------------------------------------ allocation
    def add_local_computed_blocks(
        self,
        request_id: str,
        new_computed_blocks: Sequence[KVCacheBlock],
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
    ) -> None:
        """First-time adoption of local prefix hits (touch, null-pad skipped positions)."""
        if self.req_to_blocks.get(request_id):
            raise AssertionError(f"request {request_id} already has blocks in this group")
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped_blocks = self.get_num_skipped_tokens(total) // self.block_size
        if skipped_blocks > 0:
            new_computed_blocks = new_computed_blocks[skipped_blocks:]
        if not self.enable_caching and any(new_computed_blocks):  # before the table exists
            raise AssertionError("prefix hits are impossible with caching disabled")
        table = self.req_to_blocks[request_id]
        if self.enable_caching:
            self.block_pool.touch(new_computed_blocks)
        if skipped_blocks:
            table.extend([self._null_block] * skipped_blocks)
        table.extend(new_computed_blocks)
        self.num_cached_block[request_id] = len(table)
        if self._has_partial_local_hit(new_computed_blocks, num_local_computed_tokens):
            # The shared tail gets a private copy at the first allocation; the copy is
            # cached again once it fills.
            idx = num_local_computed_tokens // self.block_size
            self._partial_hit_reqs[request_id] = (idx, new_computed_blocks[-1])
            self.num_cached_block[request_id] = idx

    def allocate_external_computed_blocks(
        self,
        request_id: str,
        num_local_computed_tokens: int,
        num_external_computed_tokens: int,
        record_for_zeroing: bool = True,
    ) -> None:
        """Fresh blocks for tokens a KV connector will write (after every group adopted)."""
        total = num_local_computed_tokens + num_external_computed_tokens
        skipped = self.get_num_skipped_tokens(total)
        if skipped > 0:
            num_external_computed_tokens = min(total - skipped, num_external_computed_tokens)
        if num_external_computed_tokens <= 0:
            return
        table = self.req_to_blocks[request_id]
        n = max(0, cdiv(total, self.block_size) - len(table))
        new = self.block_pool.get_new_blocks(n)
        table.extend(new)
        if self._record_new_block_ids and record_for_zeroing:
            self.new_block_ids.extend(b.block_id for b in new)

    def allocate_new_blocks(self, request_id: str, num_tokens: int,
                            num_tokens_main_model: int) -> list[KVCacheBlock]:
        """Grow the table to cover ``num_tokens`` slots; returns what this call added."""
        cow: list[KVCacheBlock] = []
        if self._partial_hit_reqs and request_id in self._partial_hit_reqs:
            idx, source = self._partial_hit_reqs.pop(request_id)
            copy = self.block_pool.get_new_blocks(1)[0]
            self._apply_cow(request_id, idx, source, copy)
            self.new_block_ids.append(copy.block_id)
            cow.append(copy)
        table = self.req_to_blocks[request_id]
        n = -(num_tokens // -self.block_size) - len(table)
        if n <= 0:
            return cow
        new = self.block_pool.get_new_blocks(n)
        table.extend(new)
        if self._record_new_block_ids:
            self.new_block_ids.extend(b.block_id for b in new)
        return cow + new if cow else new

    def _apply_cow(self, request_id: str, idx: int, source: KVCacheBlock,
                   copy: KVCacheBlock) -> None:
        """Swap a shared partial-hit tail for a private copy.

        Both endpoints stay retained until the device copy ran: the source keeps the hit's
        reference, the copy takes one extra beyond the request's.
        """
        table = self.req_to_blocks[request_id]
        if idx >= len(table) or table[idx] is not source or source.is_null or source.ref_cnt <= 0:
            raise AssertionError(f"copy-on-write bookkeeping of {request_id} is inconsistent")
        table[idx] = copy
        self._pending_cow_copies.append((source, copy))
        copy.ref_cnt += 1

    # ------------------------------------------------------------------ drains
    @property
    def records_new_block_ids(self) -> bool:
        return self._record_new_block_ids

    def take_new_block_ids(self) -> list[int]:
        ids, self.new_block_ids = self.new_block_ids, []
        return ids

    def take_pending_cow_copies(self) -> list[tuple[KVCacheBlock, KVCacheBlock]]:
        copies, self._pending_cow_copies = self._pending_cow_copies, []
        return copies

    def take_pending_boundary_state_offloads(self) -> list[tuple[str, int, KVCacheBlock, int]]:
        pending, self._pending_boundary_state_offloads = self._pending_boundary_state_offloads, []
        return pending

    def finalize_partial_tail_offload(self, request_id: str, num_computed_tokens: int,
                                      num_in_flight_tokens: int
                                      ) -> tuple[int, KVCacheBlock, int] | None:
        return None

    # ------------------------------------------------------------------ caching
    def cache_blocks(self, request: Request, num_tokens: int,
                     retention_interval: int | None = None, *,
                     replay_boundaries: Sequence[int]) -> None:
        """Register the request's full blocks up to ``num_tokens`` (capped by its hashes)."""
        if not self._cacheable:
            return
        rid = request.request_id
        num_cached = self.num_cached_block.get(rid, 0)
        hashed_tokens = len(request.block_hashes) * self._hash_block_size
        num_full = (num_tokens if num_tokens < hashed_tokens else hashed_tokens) // self.block_size
        if num_cached >= num_full:
            return
        mask = None if self._dense_caching else self.block_mask(
            request, num_cached, num_full, retention_interval, replay_boundaries)
        self.block_pool.cache_full_blocks(request, self.req_to_blocks[rid], num_cached, num_full,
                                          self.block_size, self.kv_cache_group_id, mask)
        self.num_cached_block[rid] = num_full

    def block_mask(self, request: Request, start_block: int, end_block: int,
                   retention_interval: int | None,
                   replay_boundaries: Sequence[int]) -> list[bool] | None:
        """Which new full blocks to register (None: all).  Sparse families override."""
        return None

    def reachable_boundaries(self, request: Request,
                             replay_boundaries: Sequence[int]) -> list[int]:
        """Token positions whose tail must survive sparse retention."""
        out = list(replay_boundaries)
        if request.shared_prefix_boundary:
            out.append(request.shared_prefix_boundary)
            if self.use_eagle:
                # A sibling diverging right after the junction cannot use the block past it
                # as the EAGLE peek, so its hit lands one block lower.
                out.append(request.shared_prefix_boundary - self.block_size)
        return out

    # ------------------------------------------------------------------ freeing
    def pop_blocks_for_free(self, request_id: str) -> list[KVCacheBlock]:
        """Forget the request; return its table (leading nulls trimmed) in table order."""
        table = self.req_to_blocks.pop(request_id, [])
        self.num_cached_block.pop(request_id, None)
        self._partial_hit_reqs.pop(request_id, None)
        return trim_null_head(table)

    def free(self, request_id: str) -> None:
        # Tail blocks first: the longest-prefix (least shareable) block is evicted first.
        blocks = self.pop_blocks_for_free(request_id)
        if blocks:
            self.block_pool.free_blocks(blocks[::-1])

    def _remove_blocks_in_range(self, request_id: str, first: int, last: int) -> None:
        """Null out and free ``[first, last)``, walking backwards to the first null."""
        blocks = self.req_to_blocks.get(request_id)
        if blocks is None or first >= last:
            return
        null = self._null_block
        end = min(last, len(blocks))
        freed: list[KVCacheBlock] = []
        for i in range(end - 1, first - 1, -1):
            if blocks[i] is null:
                break
            freed.append(blocks[i])
        if freed:
            # Freed first, the table nulled after: a double free raises with the pool
            # rolled back (free_blocks) and the table untouched, the manager as it was.
            # (vLLM nulls first; the outcome is the same when nothing raises.)
            self.block_pool.free_blocks(freed)
            for i in range(end - len(freed), end):
                blocks[i] = null

    def remove_skipped_blocks(self, request_id: str, processed_computed_tokens: int,
                              num_prompt_tokens: int | None = None) -> None:
        skipped = self.get_num_skipped_tokens(processed_computed_tokens)
        if skipped <= 0:
            return
        blocks = self.req_to_blocks[request_id]
        self._remove_blocks_in_range(request_id, 0, min(skipped // self.block_size, len(blocks)))

    def get_num_skipped_tokens(self, num_computed_tokens: int) -> int:
        return 0

    def new_step_starts(self) -> None:
        return None

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
        """Longest prefix hit (≤ max_length) common to all ``kv_cache_group_ids``."""
        raise NotImplementedError
