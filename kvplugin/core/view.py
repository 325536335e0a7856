"""The offload layer's door into the core: what it may ask, named for what it means.

The async layer (:mod:`kvplugin.aio`) and the library around it (metrics) read the pool's
size and free count, ask whether a block still caches a key, walk eviction order and
watch blocks for reuse. They used to reach through ``block_pool``, ``coordinator`` and
the hash map for that, which tied them to the core's internals (and to vLLM's names for
them). :class:`OffloadView` answers those questions and nothing else; it changes no core
state except through :meth:`OffloadView.watch_reuse`, a kvplugin hook that allocation
ignores, so the core stays vLLM-exact with or without it.

One view per manager (:meth:`KVCacheManager.offload_view`), built once: every method is
a lookup on objects the pool never replaces (the hash map, which a reset replaces, is
read through the pool each call), so the hot paths allocate nothing the old reach-ins
did not.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvplugin.core.block_pool import BlockPool, ReuseCallback, ReuseWatch
from kvplugin.core.blocks import BlockHashWithGroupId, KVCacheBlock

if TYPE_CHECKING:
    from kvplugin.core.manager import KVCacheManager

__all__ = ["OffloadView", "ReuseWatch"]


@dataclass(slots=True, frozen=True)
class OffloadView:
    """A read-mostly view of one :class:`KVCacheManager` for the offload layer.

    ``hash_block_size``: tokens per block hash (a store key's unit). ``lookup_unit``: the
    token granularity of a prefix boundary the core can hit — the hash block under
    partial (sub-block) hits, else the scheduler block. ``num_usable_blocks``: the pool
    less the null block, which is never handed out. ``blocks``: every block by id, to
    read (ref count, hash); a block is changed only through the manager.
    """

    _pool: BlockPool
    hash_block_size: int
    lookup_unit: int
    partial_hash_hits: bool
    num_usable_blocks: int
    blocks: Sequence[KVCacheBlock]

    @classmethod
    def of(cls, core: KVCacheManager) -> OffloadView:
        pool = core.block_pool
        partial = core.enable_partial_hash_hits
        unit = pool.hash_block_size if partial else core.coordinator.scheduler_block_size
        return cls(pool, pool.hash_block_size, unit, partial, pool.num_gpu_blocks - 1,
                   tuple(pool.blocks))

    def num_free_blocks(self) -> int:
        """Blocks the pool can hand out now (free, cached or not)."""
        return len(self._pool.free_block_queue)

    def caches(self, block_id: int, key: BlockHashWithGroupId) -> bool:
        """Whether block ``block_id`` is cached under ``key`` (its primary key or a
        partial-prefix one): false once it was evicted or reused for other tokens."""
        return self._pool.cached_block_hash_to_block.contain(key, block_id)

    def next_evicted(self, among: Container[int], n: int) -> list[int]:
        """The first ``n`` of the free blocks ``among`` in the order the pool hands free
        blocks out (and so evicts cached ones): oldest released first. Fewer when fewer
        of them are free; ids in ``among`` that are in use are not listed."""
        out: list[int] = []
        if n <= 0:
            return out
        for block in self._pool.free_block_queue:
            if block.block_id in among:
                out.append(block.block_id)
                if len(out) == n:
                    break
        return out

    def watch_reuse(self, block_ids: Iterable[int], on_reuse: ReuseCallback) -> ReuseWatch:
        """Call ``on_reuse(block)`` once per block when the pool next hands it out (before
        its new owner writes it) or resets the prefix cache. Each call is one subscriber:
        others on the same blocks are kept, and the returned watch cancels only this one.
        Refs and allocation order are untouched."""
        blocks = self.blocks
        return self._pool.watch_reuse([blocks[b] for b in block_ids], on_reuse)
