"""The block pool: free queue, hash→block map, ref counts and KV events.

One pool is shared by every KV-cache group.  Eviction order (what ``get_new_blocks`` takes
first) is the free queue's head: freed blocks without a hash are prepended (they can never
hit, and LIFO reuse keeps device locality), freed cached blocks are appended (FIFO among
them, i.e. least recently released is evicted first).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from kvplugin.core.block_events import BlockEvents
from kvplugin.core.blocks import (
    BlockHash,
    BlockHashWithGroupId,
    FreeBlockQueue,
    KVCacheBlock,
    external_block_hash,
)
from kvplugin.core.events import (
    MEDIUM_GPU,
    AllBlocksCleared,
    KVCacheEvent,
)
from kvplugin.core.hashing import (
    _mm_cursor_for,
    resolve_block_hashes,
)
from kvplugin.core.metrics import KVCacheMetricsCollector
from kvplugin.core.request import Request

logger = logging.getLogger(__name__)


class BlockHashToBlockMap:
    """Key → the blocks cached under it, first inserted first.

    The pool never de-duplicates (block tables stay append-only), so several blocks may
    share a key; lookups return the first inserted one.  That block lives in a plain dict
    whose bound ``get`` *is* :meth:`get_one_block` (a C call on the lookup hot path); later
    duplicates wait in ``_extra`` in insertion order and the oldest is promoted when the
    current one leaves.
    """

    __slots__ = ("_cache", "_extra", "get_one_block")

    def __init__(self) -> None:
        self._cache: dict[BlockHashWithGroupId, KVCacheBlock] = {}
        self._extra: dict[BlockHashWithGroupId, dict[int, KVCacheBlock]] = {}
        self.get_one_block: Callable[[BlockHashWithGroupId], KVCacheBlock | None] = \
            self._cache.get

    def contain(self, key: BlockHashWithGroupId, block_id: int) -> bool:
        first = self._cache.get(key)
        if first is None:
            return False
        if first.block_id == block_id:
            return True
        extra = self._extra.get(key)
        return extra is not None and block_id in extra

    def insert(self, key: BlockHashWithGroupId, block: KVCacheBlock) -> None:
        first = self._cache.get(key)
        if first is None:
            self._cache[key] = block
        elif first.block_id != block.block_id:
            self._extra.setdefault(key, {})[block.block_id] = block

    def pop(self, key: BlockHashWithGroupId, block_id: int) -> KVCacheBlock | None:
        """Remove only ``block_id`` from ``key``; None when it is not cached there."""
        first = self._cache.get(key)
        if first is None:
            return None
        extra = self._extra.get(key)
        if first.block_id == block_id:
            if extra:
                oldest = next(iter(extra))
                self._cache[key] = extra.pop(oldest)
                if not extra:
                    del self._extra[key]
            else:
                del self._cache[key]
            return first
        if extra is None:
            return None
        block = extra.pop(block_id, None)
        if not extra:
            del self._extra[key]
        return block

    def keys(self) -> Iterable[BlockHashWithGroupId]:
        return self._cache.keys()

    def blocks_under(self, key: BlockHashWithGroupId) -> list[KVCacheBlock]:
        first = self._cache.get(key)
        if first is None:
            return []
        return [first, *self._extra.get(key, {}).values()]

    def __len__(self) -> int:
        return len(self._cache)


ReuseCallback = Callable[[KVCacheBlock], None]


@dataclass(slots=True, eq=False)
class ReuseWatch:
    """One subscriber's interest in the next reuse of some blocks (kvplugin's, not vLLM's).

    ``on_reuse(block)`` runs once per block in :attr:`pending`, when the pool next hands
    that block out (or on a prefix-cache reset); the block then leaves ``pending``.
    :meth:`cancel` ends the interest in the blocks left. Several watches may cover one
    block: each is called, in the order they were made, and none replaces another.
    Compared by identity (``eq=False``): a watch is a handle, not a value.
    """

    on_reuse: ReuseCallback
    # The pool's table (block id -> watches), shared, so cancel needs no pool reference.
    _table: dict[int, list[ReuseWatch]] = field(repr=False)
    pending: set[int] = field(default_factory=set)  # block ids not reused yet

    @property
    def active(self) -> bool:
        return bool(self.pending)

    def cancel(self) -> None:
        """Stop watching every block not reused yet; a no-op once nothing is pending."""
        table = self._table
        for bid in self.pending:
            watches = table.get(bid)
            # Not listed: ``bid``'s reuse is being notified now (its list was popped; a
            # callback may have started a new one), and this watch is skipped there.
            if watches is not None and self in watches:
                watches.remove(self)
                if not watches:
                    del table[bid]
        self.pending.clear()

    def _add(self, block_id: int) -> None:
        if block_id in self.pending:
            return  # listed twice: still one call per reuse
        self.pending.add(block_id)
        watches = self._table.get(block_id)
        if watches is None:
            self._table[block_id] = [self]
        else:
            watches.append(self)


class BlockPool(BlockEvents):
    """Owns every block of one device pool; block 0 is the null block."""

    def __init__(
        self,
        num_gpu_blocks: int,
        enable_caching: bool,
        hash_block_size: int,
        enable_kv_cache_events: bool = False,
        num_hash_lookahead_tokens: int = 0,
        medium: str = MEDIUM_GPU,
    ) -> None:
        if not isinstance(num_gpu_blocks, int) or num_gpu_blocks <= 0:
            raise ValueError(f"num_gpu_blocks must be a positive int, got {num_gpu_blocks!r}")
        self.num_gpu_blocks = num_gpu_blocks
        self.enable_caching = enable_caching
        self.hash_block_size = hash_block_size
        self.enable_kv_cache_events = enable_kv_cache_events
        self.num_hash_lookahead_tokens = num_hash_lookahead_tokens
        self.medium = medium
        self.blocks = [KVCacheBlock(i) for i in range(num_gpu_blocks)]
        self.free_block_queue = FreeBlockQueue(self.blocks)
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        # block id -> secondary keys (partial-prefix entries of a block that has a primary)
        self.cached_block_hashes_by_block: dict[int, set[BlockHashWithGroupId]] = {}
        self.null_block = self.free_block_queue.popleft()
        self.null_block.is_null = True
        self.kv_event_queue: list[KVCacheEvent] = []
        # block id -> the watches on its next reuse, oldest first (see ReuseWatch)
        self._reuse_watchers: dict[int, list[ReuseWatch]] = {}
        # Optional residency metrics (set by KVCacheManager); None keeps the hot paths bare.
        self.metrics_collector: KVCacheMetricsCollector | None = None

    # ------------------------------------------------------------------ lookup
    def get_cached_block(self, block_hash: BlockHash,
                         kv_cache_group_ids: Sequence[int]) -> list[KVCacheBlock] | None:
        """The first cached block of ``block_hash`` in every group, or None on any miss."""
        get = self.cached_block_hash_to_block.get_one_block
        out: list[KVCacheBlock] = []
        for gid in kv_cache_group_ids:
            block = get(block_hash + gid.to_bytes(4, "big"))
            if block is None:
                return None
            out.append(block)
        return out

    # ------------------------------------------------------------------ caching
    def cache_full_blocks(
        self,
        request: Request,
        blocks: Sequence[KVCacheBlock],
        num_cached_blocks: int,
        num_full_blocks: int,
        block_size: int,
        kv_cache_group_id: int,
        block_mask: Sequence[bool] | None = None,
    ) -> None:
        """Register table positions ``[num_cached_blocks, num_full_blocks)`` in the cache."""
        if num_cached_blocks >= num_full_blocks:
            return
        new_blocks = blocks[num_cached_blocks:num_full_blocks]
        if block_mask is not None and len(block_mask) != len(new_blocks):
            raise AssertionError("block_mask length does not match the new blocks")
        for i, blk in enumerate(new_blocks):  # checked first: a misuse changes nothing
            if blk.block_hash is not None and not blk.is_null and (
                    block_mask is None or block_mask[i]):
                # Only partial->full promotion of one block may meet a hashed block.
                done = blk.block_hash_num_tokens
                if done is None or done >= (num_cached_blocks + i + 1) * block_size:
                    raise AssertionError(f"block {blk.block_id} is already cached")
        hashes = resolve_block_hashes(request.block_hashes, self.hash_block_size, block_size)
        suffix = kv_cache_group_id.to_bytes(4, "big")
        events = self.enable_kv_cache_events
        stored: list[int] = []
        cache = self.cached_block_hash_to_block._cache
        for i, blk in enumerate(new_blocks):
            if blk.is_null or (block_mask is not None and not block_mask[i]):
                continue
            block_hash = hashes[num_cached_blocks + i]
            num_tokens = (num_cached_blocks + i + 1) * block_size
            key = block_hash + suffix
            if blk.block_hash is None and key not in cache:
                # The common case, inlined: a fresh block under a fresh key.
                blk.block_hash = key
                blk.block_hash_num_tokens = num_tokens
                cache[key] = blk
            else:
                if blk.block_hash is not None:  # a promotion (checked above)
                    self._emit_removed(self._remove_cached_block_hashes(blk))
                self._insert_block_hash(key, blk, num_tokens)
            if events:
                stored.append(int.from_bytes(block_hash[-8:], "big"))
        if events:
            parent = (external_block_hash(hashes[num_cached_blocks - 1])
                      if num_cached_blocks else None)
            extra = self._event_extra_keys(request, blocks, num_cached_blocks, num_full_blocks,
                                           block_size, block_mask)
            self.kv_event_queue.append(self._stored_event(
                request, stored, parent, num_cached_blocks * block_size,
                num_full_blocks * block_size, block_size, kv_cache_group_id, *extra))

    def cache_partial_block(
        self, request: Request, block: KVCacheBlock, num_tokens: int, kv_cache_group_id: int,
        block_size: int, replace_existing_hashes: bool = False,
    ) -> BlockHashWithGroupId | None:
        """Make an existing block reachable from a hash boundary that ends inside it."""
        if block.is_null:
            return None
        hbs = self.hash_block_size
        if block_size % hbs or num_tokens % hbs:
            raise AssertionError("partial entries must sit on hash-block boundaries")
        n_hash = num_tokens // hbs
        if not 0 < n_hash <= len(request.block_hashes):
            raise AssertionError(f"no block hash at token {num_tokens}")
        block_hash = request.block_hashes[n_hash - 1]
        key = block_hash + kv_cache_group_id.to_bytes(4, "big")
        already = block.block_hash == key or self.cached_block_hash_to_block.contain(
            key, block.block_id)
        if replace_existing_hashes:
            self._emit_removed(self._remove_cached_block_hashes(block))
            already = False
        elif (not already and block.block_hash is not None
              and block.block_hash_num_tokens is not None
              and block.block_hash_num_tokens < n_hash * hbs):
            self._emit_removed(self._remove_cached_block_hashes(block))
        self._insert_block_hash(key, block, n_hash * hbs)
        if self.enable_kv_cache_events and not already:
            parent = request.block_hashes[n_hash - 2] if n_hash > 1 else None
            start = (n_hash - 1) * hbs
            mm_idx = _mm_cursor_for(request, start, hbs)
            keys, _ = self._extra_keys(request, start, num_tokens, mm_idx)
            lookahead = ([self._lookahead_tokens(request, num_tokens)]
                         if self.num_hash_lookahead_tokens else None)
            self.kv_event_queue.append(self._stored_event(
                request, [external_block_hash(block_hash)],
                None if parent is None else external_block_hash(parent),
                start, num_tokens, num_tokens - start, kv_cache_group_id, [keys], lookahead))
        return key

    def _remove_cached_block_hashes(self, block: KVCacheBlock) -> list[BlockHashWithGroupId]:
        primary = block.block_hash
        if primary is None:
            return []
        keys = [primary]
        if self.cached_block_hashes_by_block:
            keys.extend(self.cached_block_hashes_by_block.pop(block.block_id, ()))
        cmap = self.cached_block_hash_to_block
        cache = cmap._cache
        removed = []
        for k in keys:
            if cache.get(k) is block and k not in cmap._extra:
                del cache[k]  # the common single-block entry
                removed.append(k)
            elif cmap.pop(k, block.block_id) is not None:
                removed.append(k)
        block.block_hash = None
        block.block_hash_num_tokens = None
        return removed

    def _insert_block_hash(self, key: BlockHashWithGroupId, block: KVCacheBlock,
                           num_tokens: int | None) -> None:
        if block.block_hash == key or self.cached_block_hash_to_block.contain(key, block.block_id):
            return
        if block.block_hash is None:
            block.block_hash = key
            block.block_hash_num_tokens = num_tokens
        else:
            self.cached_block_hashes_by_block.setdefault(block.block_id, set()).add(key)
        self.cached_block_hash_to_block.insert(key, block)

    def move_block_hashes(self, src_block: KVCacheBlock, dst_block: KVCacheBlock) -> None:
        """Re-point every key of ``src_block`` to the unhashed ``dst_block`` (no events)."""
        if (dst_block.block_hash is not None
                or dst_block.block_id in self.cached_block_hashes_by_block):
            raise AssertionError(f"block {dst_block.block_id} is already cached")
        num_tokens = src_block.block_hash_num_tokens
        for key in self._remove_cached_block_hashes(src_block):
            self._insert_block_hash(key, dst_block, num_tokens)

    # ------------------------------------------------------------------ allocation
    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        """Pop ``num_blocks`` from the head, evicting their cached identity."""
        if num_blocks < 0:
            raise ValueError(f"cannot allocate a negative number of blocks ({num_blocks})")
        if num_blocks > len(self.free_block_queue):
            raise ValueError(f"Cannot get {num_blocks} free blocks from the pool")
        ret = self.free_block_queue.popleft_n(num_blocks)
        if self._reuse_watchers:
            self._notify_reuse(ret)
        if self.enable_caching:
            for block in ret:
                # Secondary keys only exist on blocks that have a primary one.
                if block.block_hash is not None:
                    self._emit_removed(self._remove_cached_block_hashes(block))
                block.ref_cnt = 1
        else:
            for block in ret:
                block.ref_cnt = 1
        if self.metrics_collector is not None:
            self._metrics_on_new_blocks(ret)
        return ret

    def _metrics_on_new_blocks(self, blocks: list[KVCacheBlock]) -> None:
        # vLLM: with caching, a handed-out block's previous life ends (eviction event),
        # then the new one may be sampled; without caching it is only re-sampled.
        collector = self.metrics_collector
        assert collector is not None
        for block in blocks:
            if self.enable_caching:
                collector.on_block_evicted(block)
            collector.on_block_allocated(block)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-hit blocks, pulling evictable ones off the queue."""
        remove = self.free_block_queue.remove
        collector = self.metrics_collector
        for block in blocks:
            if block.is_null:
                continue
            if block.ref_cnt == 0:
                remove(block)
            block.ref_cnt += 1
            if collector is not None:
                collector.on_block_accessed(block)

    def is_block_writable(self, block: KVCacheBlock) -> bool:
        return not block.is_null and block.ref_cnt == 1 and block.block_hash is None

    def free_blocks(self, ordered_blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference per entry; ``ordered_blocks`` is in eviction-priority order.

        A count that would go below zero (a double free, also within one call) raises
        after undoing this call's decrements, so the pool is left exactly as it was.
        """
        first: list[KVCacheBlock] = []
        last: list[KVCacheBlock] = []
        caching = self.enable_caching
        done: list[KVCacheBlock] = []
        for b in ordered_blocks:
            if b.is_null:
                continue
            if b.ref_cnt <= 0:
                for d in done:
                    d.ref_cnt += 1
                raise ValueError(f"free of block {b.block_id} whose ref count is {b.ref_cnt}: "
                                 "double free or a block this pool never handed out")
            b.ref_cnt -= 1
            done.append(b)
            if b.ref_cnt == 0:
                if b.block_hash is None or not caching:
                    first.append(b)
                else:
                    last.append(b)
        if first:
            self.free_block_queue.prepend_n(first)
        if last:
            self.free_block_queue.append_n(last)

    def unpin_blocks(self, blocks: Iterable[KVCacheBlock],
                     on_reuse: ReuseCallback) -> ReuseWatch:
        """Release refs of blocks still being read until reused: tail of the queue.

        ``on_reuse`` is called when a block is handed out again (or on reset). vLLM keeps
        one callback per block and a second unpin replaces it; its caller (HiSparse)
        re-unpins a block with the *same* callback and expects one call per reuse. Here a
        block already watched by an equal callback stays with that watch, and any other
        block's or subscriber's watch is kept, never replaced: the returned watch covers
        the blocks it added."""
        blocks = list(blocks)
        for block in blocks:  # checked first: a misuse changes nothing
            if block.is_null or block.ref_cnt <= 0:
                raise ValueError(f"unpin of block {block.block_id} with ref count {block.ref_cnt}")
        watch = ReuseWatch(on_reuse, self._reuse_watchers)
        released = []
        for block in blocks:
            block.ref_cnt -= 1
            if not self._watched_by(block.block_id, on_reuse):
                watch._add(block.block_id)
            if block.ref_cnt == 0:
                released.append(block)
        self.free_block_queue.append_n(released)
        return watch

    def _watched_by(self, block_id: int, on_reuse: ReuseCallback) -> bool:
        # ``==``, not ``is``: a bound method is a new object at every attribute access.
        return any(w.on_reuse == on_reuse for w in self._reuse_watchers.get(block_id, ()))

    def watch_reuse(self, blocks: Iterable[KVCacheBlock],
                    on_reuse: ReuseCallback) -> ReuseWatch:
        """Call ``on_reuse(block)`` when ``get_new_blocks`` next hands a block out (before
        its new owner can write it) or on reset; refs are untouched. kvplugin's own hook
        (not in vLLM): a store copies a block out lazily and must copy it before reuse.
        Every call is its own subscription: the returned watch cancels only itself."""
        blocks = list(blocks)
        if any(block.is_null for block in blocks):  # checked first: a misuse changes nothing
            raise ValueError("the null block is never handed out: nothing to watch")
        watch = ReuseWatch(on_reuse, self._reuse_watchers)
        for block in blocks:
            watch._add(block.block_id)
        return watch

    def _notify_reuse(self, blocks: Iterable[KVCacheBlock]) -> None:
        table = self._reuse_watchers
        for block in blocks:
            watches = table.pop(block.block_id, None)
            if watches is None:
                continue
            bid = block.block_id
            # Popped first: a callback that watches this block again watches its next
            # reuse; one that cancels a later watch here took ``bid`` out of its pending.
            for watch in watches:
                pending = watch.pending
                if bid in pending:
                    pending.remove(bid)
                    watch.on_reuse(block)

    def evict_blocks(self, block_ids: Iterable[int]) -> None:
        """Drop the cache identity of blocks (ref counts and queue position unchanged)."""
        ids = list(block_ids)
        for bid in ids:
            if not isinstance(bid, int) or not 0 <= bid < self.num_gpu_blocks:
                raise ValueError(f"Invalid block_id {bid!r}: the pool has {self.num_gpu_blocks} "
                                 "blocks")
        for bid in ids:
            if self.metrics_collector is not None:
                self.metrics_collector.on_block_evicted(self.blocks[bid])
            self._emit_removed(self._remove_cached_block_hashes(self.blocks[bid]))

    def reset_prefix_cache(self) -> bool:
        """Forget every hash, only when no block but the null block is in use."""
        used = self.num_gpu_blocks - len(self.free_block_queue)
        if used != 1:
            logger.warning("Failed to reset prefix cache because some blocks (%d) are not "
                           "freed yet", used - 1)
            return False
        self.cached_block_hash_to_block = BlockHashToBlockMap()
        self.cached_block_hashes_by_block.clear()
        if self._reuse_watchers:
            self._notify_reuse([self.blocks[i] for i in list(self._reuse_watchers)])
        for block in self.blocks:
            block.block_hash = None
            block.block_hash_num_tokens = None
        if self.metrics_collector is not None:
            self.metrics_collector.reset()
        if self.enable_kv_cache_events:
            self.kv_event_queue.append(AllBlocksCleared())
        return True

    # ------------------------------------------------------------------ queries
    def get_num_free_blocks(self) -> int:
        return len(self.free_block_queue)

    def get_usage(self) -> float:
        total = self.num_gpu_blocks - 1
        if not total:
            return 0.0
        return 1.0 - len(self.free_block_queue) / total

    def take_events(self) -> list[KVCacheEvent]:
        if not self.enable_kv_cache_events:
            return []
        events, self.kv_event_queue = self.kv_event_queue, []
        return events
