"""Pure arithmetic of Mamba state checkpoints: where a reusable state can sit, whether a
backend can export one mid-chunk, and which state slots sparse retention keeps.

Kept apart from the manager so the rules can be read (and tested) without any block
bookkeeping.  Positions are token counts; slot ``i`` holds the state after ``(i+1)*bs``
tokens.
"""

from __future__ import annotations

from collections.abc import Iterable

from kvplugin.core.specs import cdiv


def prefill_checkpoint_position(num_tokens: int, unit: int, drop_eagle_block: bool,
                                num_hash_lookahead_tokens: int = 0) -> int:
    """The last ``unit``-aligned boundary of an ``num_tokens``-token prefill a later
    request can resume at.

    Without EAGLE at least one token (or the hash lookahead) must stay behind the boundary:
    the last token is recomputed for logits and a lookahead hash needs tokens past it.
    EAGLE's lookup already gives one unit back, so the boundary sits one unit lower.
    """
    if drop_eagle_block:
        position = num_tokens // unit * unit - unit
    else:
        position = (num_tokens - max(1, num_hash_lookahead_tokens)) // unit * unit
    return position if position > 0 else 0


def checkpoint_exportable(query_start: int, query_end: int, position: int,
                          hash_block_size: int, block_size: int,
                          alignment: int | None) -> bool:
    """Whether the backend can write the state at ``position`` while computing
    ``[query_start, query_end)``.

    The chunk must start on a hash boundary, the checkpoint must lie strictly inside it
    (at least one hash unit past its start, a whole number of backend steps in), and the
    checkpoint slot must come after the slot holding the chunk's initial state.
    """
    if alignment is None:
        return False
    initial_slot = (query_start - 1) // block_size
    checkpoint_slot = cdiv(query_end, block_size) - 2
    return (query_start % hash_block_size == 0
            and checkpoint_slot > initial_slot
            and query_start + hash_block_size <= position
            and query_start < position < query_end
            and (position - query_start) % alignment == 0)


def retention_mask(start_block: int, end_block: int, block_size: int, alignment: int,
                   retention_interval: int | None,
                   boundaries: Iterable[int]) -> list[bool] | None:
    """Which state slots in ``[start_block, end_block)`` sparse retention registers.

    ``None`` means all of them (dense).  A state is self-contained, so a hit needs only the
    one slot ending on its boundary: one per ``retention_interval`` segment, plus the slot
    ending at each (aligned) reachable boundary.  Interval 0 keeps the boundaries only.
    """
    if retention_interval is None:
        return None
    mask = [False] * (end_block - start_block)
    if retention_interval:
        per = retention_interval // block_size
        if per <= 1:
            return None  # every slot ends a segment
        first = (start_block + per) // per * per - 1
        for i in range(first - start_block, len(mask), per):
            mask[i] = True
    for b in boundaries:
        slot = b // alignment * alignment // block_size - 1
        if start_block <= slot < end_block:
            mask[slot - start_block] = True
    return mask
