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
from kvplugin.core.single_type.base import HitResult, SingleTypeKVCacheManager
from kvplugin.core.single_type.mamba_checkpoints import (
    checkpoint_exportable,
    prefill_checkpoint_position,
    retention_mask,
)
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


class MambaManager(SingleTypeKVCacheManager):
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
            unit = alignment_tokens
            per_block = bs // unit
            last = min(max_length // unit, len(hashes))
            return cls._scan(hashes, last, 1, kv_cache_group_ids, block_pool,
                             lambda i: i // per_block, unit)
        # A hit must end on an alignment boundary (shared with the attention groups).
        step = 1 if bs == alignment_tokens else None
        return cls._scan(hashes, max_length // bs, step, kv_cache_group_ids, block_pool,
                         None, bs, alignment_tokens)

    @staticmethod
    def _scan(hashes: Sequence[BlockHash], n: int, step: int | None,
              group_ids: Sequence[int], pool: BlockPool, slot_of: object, unit: int,
              alignment: int = 0) -> HitResult:
        """Scan entries ``n-1 .. 0``; entry ``i`` covers ``(i+1)*unit`` tokens.

        ``slot_of`` maps a fine entry to its table slot (None: entry == slot).  With
        ``step`` None, entries whose right edge misses ``alignment`` are skipped.
        """
        null = pool.null_block
        out: tuple[list[KVCacheBlock], ...] = tuple([] for _ in group_ids)
        single = len(group_ids) == 1
        get_one = pool.cached_block_hash_to_block.get_one_block
        suffix = group_ids[0].to_bytes(4, "big") if single else b""
        for i in range(n - 1, -1, -1):
            if step is None and (i + 1) * unit % alignment:
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
            slot = i if slot_of is None else slot_of(i)  # type: ignore[operator]
            for lst, blk in zip(out, cached, strict=True):
                if slot:
                    lst.extend([null] * slot)
                lst.append(blk)
            return out, (i + 1) * unit
        return out, 0
