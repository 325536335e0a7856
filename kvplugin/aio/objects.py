"""What a stored object is, written once: its description (the metadata a store writes
with it) and the acceptance check a load applies before a byte of it reaches a block.

Both executors use these two and nothing else: the native manager (:mod:`.stores`,
:mod:`.loads`) and the vLLM connector's worker (:mod:`kvplugin.integrations._worker`). An
object is one of

* a **chunk**: ``num_blocks`` consecutive pages of one group, tokens ``[token_start,
  token_start + num_blocks * block_size)``, array shape ``(num_blocks, *dims)``;
* a **state**: one page (a Mamba group's recurrent state, or a partial tail), valid at
  exactly ``boundary`` tokens, array shape ``(1, *dims)``, tokens ``[0, boundary)``.

The connector has already verified the checksum, the format and the namespace when a load
sees an object; what is checked here is that it is *the* object the plan asked for, in this
layout: its key, its token range or boundary, its dtype, its page shape, and a payload of
exactly that many bytes. A writer of another page shape (a different model build, a
misconfigured deployment sharing the tier) or an object stored under the wrong key must be
a visible miss, never KV copied into a block.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Protocol

from kvplugin.connectors.keys import ObjectKey
from kvplugin.serde import Block, BlockMeta

__all__ = ["ObjectSpec", "PageLike", "Refusal", "chunk_spec", "state_spec"]


class PageLike(Protocol):
    """What a description reads of a group's page (:class:`~kvplugin.aio.memory.PageShape`
    and :class:`~kvplugin.aio.memory.StateShape` both are)."""

    @property
    def dtype(self) -> str: ...
    @property
    def dims(self) -> tuple[int, ...]: ...
    @property
    def page_bytes(self) -> int: ...
    @property
    def block_size(self) -> int: ...


class Refusal(enum.Enum):
    """Why a load did not accept an object (a miss the engine computes again)."""

    MISSING = "missing"  # no tier had it, or the connector refused it (checksum, format)
    METADATA = "metadata"  # a valid object, but not the one planned (key, range, shape)
    TRUNCATED = "truncated"  # its payload is not the size its metadata says


@dataclass(frozen=True, slots=True)
class ObjectSpec:
    """One stored object as its plan expects it."""

    key: ObjectKey
    dtype: str
    shape: tuple[int, ...]
    token_start: int
    token_end: int
    boundary: int | None  # a state's boundary; None for a chunk
    nbytes: int  # the payload's size: pages x page bytes

    def meta(self) -> BlockMeta:
        """The metadata a store writes with the object."""
        return self.key.meta(token_start=self.token_start, token_end=self.token_end,
                             dtype=self.dtype, shape=self.shape, boundary=self.boundary)

    def refusal(self, block: Block | None) -> Refusal | None:
        """None when ``block`` is exactly this object; else why it is refused."""
        if block is None:
            return Refusal.MISSING
        meta = block.meta
        if not (self.key.matches(meta) and meta.dtype == self.dtype
                and meta.shape == self.shape and meta.token_start == self.token_start
                and meta.token_end == self.token_end and meta.boundary == self.boundary):
            return Refusal.METADATA
        if memoryview(block.payload).nbytes != self.nbytes or meta.nbytes != self.nbytes:
            return Refusal.TRUNCATED
        return None

    def accepts(self, block: Block | None) -> bool:
        return self.refusal(block) is None


def chunk_spec(key: ObjectKey, page: PageLike, token_start: int,
               num_blocks: int) -> ObjectSpec:
    """A chunk of ``num_blocks`` pages whose first holds token ``token_start``."""
    if num_blocks < 1 or token_start < 0 or token_start % page.block_size:
        raise ValueError(f"a chunk starts at a block boundary and has blocks: token_start "
                         f"{token_start}, num_blocks {num_blocks}, block {page.block_size}")
    return ObjectSpec(key, page.dtype, (num_blocks, *page.dims), token_start,
                      token_start + num_blocks * page.block_size, None,
                      num_blocks * page.page_bytes)


def state_spec(key: ObjectKey, page: PageLike, boundary: int) -> ObjectSpec:
    """A state (one page) valid at exactly ``boundary`` tokens."""
    if boundary < 1:
        raise ValueError(f"a state's boundary is a positive token count, got {boundary}")
    return ObjectSpec(key, page.dtype, (1, *page.dims), 0, boundary, boundary,
                      page.page_bytes)
