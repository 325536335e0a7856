"""Blocks, the free-block queue (eviction order) and block-hash keys.

A block id indexes one physical KV page.  All KV-cache groups share one pool and one id
space; block 0 is the *null block*, a placeholder for table positions that hold no KV.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple, TypeVar

# A raw digest from the configured hash function (32 bytes for sha256 variants).
BlockHash = bytes
# ``BlockHash`` followed by the KV-cache group id as 4 big-endian bytes: the key of the
# prefix-cache map, so the same content cached by two groups lives under two keys.
BlockHashWithGroupId = bytes

_MASK64 = (1 << 64) - 1


def make_block_hash_with_group_id(block_hash: BlockHash, group_id: int) -> BlockHashWithGroupId:
    return block_hash + group_id.to_bytes(4, "big")


def get_block_hash(key: BlockHashWithGroupId) -> BlockHash:
    return key[:-4]


def get_group_id(key: BlockHashWithGroupId) -> int:
    return int.from_bytes(key[-4:], "big")


def external_block_hash(block_hash: BlockHash) -> int:
    """The integer form KV events publish: the low 64 bits of the digest, big-endian."""
    return int.from_bytes(block_hash, "big") & _MASK64


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """Metadata of one physical block.  One instance per id, created once, reused forever.

    ``block_hash`` is the primary prefix-cache key (hash + group id); secondary keys of
    partial-prefix entries are tracked by the pool, not here.  ``ref_cnt == 0`` means the
    block sits in the free queue (except the null block, whose count is not maintained).
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHashWithGroupId | None = None
    block_hash_num_tokens: int | None = None
    is_null: bool = False

    def set_block_hash(self, block_hash: BlockHashWithGroupId, num_tokens: int | None) -> None:
        if self.block_hash is not None:
            raise AssertionError(f"block {self.block_id} already has a hash")
        self.block_hash = block_hash
        self.block_hash_num_tokens = num_tokens

    def reset_hash(self) -> None:
        self.block_hash = None
        self.block_hash_num_tokens = None

    def __repr__(self) -> str:
        return (
            f"KVCacheBlock(block_id={self.block_id}, ref_cnt={self.ref_cnt}, "
            f"hashed={self.block_hash is not None})"
        )


class KVCacheBlockCopy(NamedTuple):
    """A pending device copy (copy-on-write of a partial prefix hit)."""

    src_block_id: int
    dst_block_id: int


_Seq = TypeVar("_Seq", list[KVCacheBlock], Sequence[KVCacheBlock])


def null_head_len(blocks: Sequence[KVCacheBlock]) -> int:
    """Length of the leading run of null entries (e.g. a sliding window's skipped prefix)."""
    n = 0
    for block in blocks:
        if not block.is_null:
            break
        n += 1
    return n


def trim_null_head(blocks: _Seq) -> _Seq:
    """``blocks`` without its leading nulls; the same object when there are none."""
    if not blocks or not blocks[0].is_null:
        return blocks
    return blocks[null_head_len(blocks) :]


class FreeBlockQueue:
    """The free blocks in eviction order: allocation pops the head.

    Backed by an ``OrderedDict`` (a C-level doubly-linked list keyed by block id), which
    gives O(1) pops at both ends, O(1) removal from the middle (a prefix hit on an
    evictable block) and O(1) insertion at both ends without allocating per block.
    """

    __slots__ = ("_od", "size")

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._od: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in blocks)
        # ``size()`` is the free-block count as a C-level call (the capacity checks of every
        # allocation read it).
        self.size: Callable[[], int] = self._od.__len__

    @property
    def num_free_blocks(self) -> int:
        return len(self._od)

    def __len__(self) -> int:
        return len(self._od)

    def __contains__(self, block: KVCacheBlock) -> bool:
        return block.block_id in self._od

    def popleft(self) -> KVCacheBlock:
        if not self._od:
            raise ValueError("No free blocks available")
        return self._od.popitem(last=False)[1]

    def popleft_n(self, n: int) -> list[KVCacheBlock]:
        if n > len(self._od):
            raise ValueError(f"Cannot pop {n} blocks from a queue of {len(self._od)}")
        pop = self._od.popitem
        return [pop(False)[1] for _ in range(n)]

    def remove(self, block: KVCacheBlock) -> None:
        try:
            del self._od[block.block_id]
        except KeyError:
            raise RuntimeError(f"block {block.block_id} is not in the free queue") from None

    def append(self, block: KVCacheBlock) -> None:
        self._od[block.block_id] = block

    def append_n(self, blocks: Iterable[KVCacheBlock]) -> None:
        od = self._od
        for block in blocks:
            od[block.block_id] = block

    def prepend_n(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Insert at the head, keeping the given order (``blocks[0]`` becomes the head)."""
        od = self._od
        move = od.move_to_end
        for block in reversed(blocks):
            od[block.block_id] = block
            move(block.block_id, False)

    def get_all_free_blocks(self) -> list[KVCacheBlock]:
        return list(self._od.values())

    def __iter__(self) -> Iterator[KVCacheBlock]:
        return iter(self._od.values())
