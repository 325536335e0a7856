"""What the engine drains from the KV-cache manager each step (mixed into
:class:`~kvplugin.core.manager.KVCacheManager`, vLLM 0.33's names): new block ids to zero,
copy-on-write copies, Mamba boundary-state offloads and finish-time partial tails, each
gathered over the coordinator's single-type managers."""

from __future__ import annotations

from kvplugin.core.blocks import KVCacheBlock, KVCacheBlockCopy
from kvplugin.core.coordinator import KVCacheCoordinator
from kvplugin.core.request import Request
from kvplugin.core.specs import cdiv

__all__ = ["StepDrains"]


class StepDrains:
    """Expects the manager's ``coordinator``."""

    coordinator: KVCacheCoordinator

    def take_new_block_ids(self) -> list[int]:
        ids: list[int] = []
        for m in self.coordinator.single_type_managers:
            ids.extend(m.take_new_block_ids())
        return ids

    def record_blocks_for_zeroing(self, request_id: str, start_token: int) -> None:
        managers = [m for m in self.coordinator.single_type_managers if m.records_new_block_ids]
        if any(start_token % m.block_size for m in managers):  # before any group records
            raise ValueError("start_token must be block-aligned")
        for m in managers:
            table = m.req_to_blocks.get(request_id, [])
            m.new_block_ids.extend(b.block_id for b in table[start_token // m.block_size:])

    def get_zeroing_block_ids_in_range(self, request_id: str, start_token: int,
                                       end_token: int) -> list[int]:
        """The request's block ids covering tokens ``[start_token, end_token)`` in every
        group whose new blocks are zeroed, group by group (null placeholders excluded:
        they hold nothing to zero).  An unknown request has none."""
        if not 0 <= start_token <= end_token:
            raise ValueError(f"need 0 <= start_token <= end_token, got [{start_token}, "
                             f"{end_token})")
        ids: list[int] = []
        for m in self.coordinator.single_type_managers:
            if not m.records_new_block_ids:
                continue
            table = m.req_to_blocks.get(request_id) or []
            ids.extend(b.block_id for b in table[start_token // m.block_size:
                                                 cdiv(end_token, m.block_size)]
                       if not b.is_null)
        return ids

    def take_kv_cache_block_copies(self) -> tuple[list[KVCacheBlockCopy], list[KVCacheBlock]]:
        """Pending copy-on-write copies and their retained endpoints ``[src, dst, ...]``;
        the caller releases one ref on each retained block once the copy has run."""
        pairs: list[tuple[KVCacheBlock, KVCacheBlock]] = []
        for m in self.coordinator.single_type_managers:
            pairs.extend(m.take_pending_cow_copies())
        copies = [KVCacheBlockCopy(s.block_id, d.block_id) for s, d in pairs]
        return copies, [b for pair in pairs for b in pair]

    def take_boundary_state_offloads(self) -> dict[str, list[tuple[int, int, int]]]:
        out: dict[str, list[tuple[int, int, int]]] = {}
        for m in self.coordinator.single_type_managers:
            for rid, gid, block, boundary in m.take_pending_boundary_state_offloads():
                out.setdefault(rid, []).append((gid, block.block_id, boundary))
        return out

    def finalize_partial_tail_offloads(self, request: Request) -> list[tuple[int, int, int]]:
        out = []
        for m in self.coordinator.single_type_managers:
            done = m.finalize_partial_tail_offload(request.request_id, request.num_computed_tokens,
                                                   request.num_in_flight_tokens)
            if done is not None:
                gid, block, boundary = done
                out.append((gid, block.block_id, boundary))
        return out
