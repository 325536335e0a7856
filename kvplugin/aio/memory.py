"""Paged host KV memory: the stand-in for the engine's device KV cache.

One numpy array per KV-cache group, one row per block id (all groups share the core's block
id space, as vLLM's tensors do), each row one page of raw bytes: K and V of every layer for
an attention group, the recurrent state of every layer for a Mamba group (what each kind
of group holds: :mod:`kvplugin.aio.group_kinds`). Stores read rows out, loads copy verified
bytes in; the core never sees any of it, it only hands out the ids.

Rows are raw ``uint8``: the page layout (``PageShape.dims`` in ``dtype``) is described to the
tiers through the stored object's metadata and the layout fingerprint, never interpreted here.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplugin.aio import group_kinds, plans
from kvplugin.aio.group_kinds import GroupKind
from kvplugin.buffers import MIN_POOLED_BYTES, Sealed, default_pool
from kvplugin.core.specs import KVCacheConfig, KVCacheGroupSpec, KVCacheSpec
from kvplugin.serde import DTYPE_SIZES

__all__ = ["GroupShape", "HostKVMemory", "PageShape", "StateShape", "layout_of", "shape_of_group",
           "shape_of_kind"]

Rows = np.ndarray[Any, np.dtype[np.uint8]]

# The PageShape fields that can hold a group's token span (one at most is set).
_SPAN_FIELDS = ("window", "local_chunk")


class _OfKind:
    """What a page or a state says of its kind: its entry in the registry (``family``)."""

    __slots__ = ()
    family: str

    @property
    def group_kind(self) -> GroupKind:
        return group_kinds.get(self.family)

    @property
    def kind(self) -> str:
        """The group kind in the offload plans (:func:`group_kinds.plan_kinds`)."""
        return self.group_kind.plan.name


@dataclass(frozen=True, slots=True)
class PageShape(_OfKind):
    """The bytes of one block of one attention group: K and V for every layer, or for
    multi-head latent attention (MLA, ``kv_parts=1``) the one latent vector per token.
    ``window``: the sliding window (tokens), 0 for full attention. ``family``: the
    :class:`~kvplugin.aio.group_kinds.GroupKind` (its name); a page built field by field
    leaves it empty and gets the kind its K/V parts and span field describe."""

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str
    block_size: int
    window: int = 0
    extra_retained: int = 0
    kv_parts: int = 2  # 2: K and V; 1: MLA's latent (no separate V)
    local_chunk: int = 0  # chunked local attention: its attention chunk (tokens), else 0
    family: str = ""

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_size", "block_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"PageShape.{name} must be a positive int, got {value!r}")
        for name in ("window", "extra_retained"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:
                raise ValueError(f"PageShape.{name} must be an int >= 0, got {value!r}")
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"unknown dtype {self.dtype!r}; known: {sorted(DTYPE_SIZES)}")
        if self.local_chunk < 0 or (self.local_chunk and self.window):
            raise ValueError("PageShape: a chunked local group has no sliding window, and "
                             f"local_chunk must be >= 0, got {self.local_chunk!r}")
        if self.kv_parts not in (1, 2):
            raise ValueError(f"PageShape.kv_parts must be 1 (MLA) or 2, got {self.kv_parts!r}")
        span = next((f for f in _SPAN_FIELDS if getattr(self, f)), "")
        if not self.family:
            object.__setattr__(self, "family", group_kinds.kind_of_page(self.kv_parts, span).name)
        kind = self.group_kind
        if (kind.kv_parts, kind.span_field) != (self.kv_parts, span):
            raise ValueError(f"PageShape: a {kind.name} page has {kind.kv_parts} K/V parts and "
                             f"span field {kind.span_field!r}, got {self.kv_parts} and {span!r}")

    @classmethod
    def of_group(cls, group: KVCacheGroupSpec) -> PageShape:
        """The page of an attention group (one layer per name in the group)."""
        shape = shape_of_group(group)
        if not isinstance(shape, PageShape):
            raise ValueError(f"{group.kv_cache_spec.kind} group: its blocks hold states")
        return shape

    @property
    def window_tokens(self) -> int:
        """The group's token span in the plans (:class:`kvplugin.aio.plans.Layout`): a
        window group keeps this many tokens behind the next one, a chunked local group
        attends within chunks of this many; 0 for full attention."""
        return self.group_kind.span_tokens(self)

    def skipped_blocks(self, num_tokens: int) -> int:
        """Leading blocks the core leaves null at ``num_tokens`` computed tokens (blocks
        that left the window, chunks before the current one); 0 without a span."""
        return self.group_kind.plan.skipped_blocks(num_tokens, self.window_tokens,
                                                   self.block_size)

    @property
    def dims(self) -> tuple[int, ...]:
        """The page as an array: (K/V, layer, token slot, head, head dim); MLA's K/V axis
        has the latent alone."""
        return (self.kv_parts, self.num_layers, self.block_size, self.num_kv_heads,
                self.head_size)

    @property
    def page_bytes(self) -> int:
        n = DTYPE_SIZES[self.dtype]
        for d in self.dims:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class StateShape(_OfKind):
    """The bytes of one block of a Mamba group: every layer's recurrent state at one token
    boundary, raw bytes (a layer's tensors may mix dtypes), ``dims = (layers, bytes)``."""

    num_layers: int
    layer_bytes: int
    block_size: int
    shapes: tuple[tuple[int, ...], ...] = ()  # the tensors, for the layout fingerprint
    dtypes: tuple[str, ...] = ()
    family: str = ""  # the group kind (empty: the state kind pages are recognised as)

    def __post_init__(self) -> None:
        for name in ("num_layers", "layer_bytes", "block_size"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"StateShape.{name} must be a positive int, got {value!r}")
        if not self.family:
            object.__setattr__(self, "family", group_kinds.kind_of_page(0, "").name)
        if self.group_kind.plan.chunked:
            raise ValueError(f"StateShape: {self.family} groups hold pages, not states")

    @classmethod
    def of_tensors(cls, num_layers: int, block_size: int, shapes: tuple[tuple[int, ...], ...],
                   dtypes: tuple[str, ...], family: str = "") -> StateShape:
        """The state of layers holding one tensor per ``shapes[i]`` in ``dtypes[i]``."""
        if len(shapes) != len(dtypes):
            raise ValueError("a state needs one dtype per state tensor")
        layer = 0
        for shape, dtype in zip(shapes, dtypes, strict=True):
            if dtype not in DTYPE_SIZES:
                raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(DTYPE_SIZES)}")
            layer += math.prod(shape) * DTYPE_SIZES[dtype]
        return cls(num_layers, layer, block_size, shapes, dtypes, family)

    @property
    def dtype(self) -> str:
        return "uint8"

    @property
    def window_tokens(self) -> int:
        return 0

    @property
    def dims(self) -> tuple[int, ...]:
        return (self.num_layers, self.layer_bytes)

    @property
    def page_bytes(self) -> int:
        return self.num_layers * self.layer_bytes


GroupShape = PageShape | StateShape


def shape_of_group(group: KVCacheGroupSpec) -> GroupShape:
    """The host page of any group offload serves (raises with the reason for the others)."""
    spec = group.kv_cache_spec
    return shape_of_kind(group_kinds.of_spec(spec), spec, len(group.layer_names))


def shape_of_kind(kind: GroupKind, spec: KVCacheSpec | Any, num_layers: int,
                  dtype: Callable[[Any], str] = str) -> GroupShape:
    """``kind``'s page for ``spec`` (a core spec, or vLLM's: ``dtype`` names its dtypes)
    over ``num_layers`` layers: attention pages for a chunked kind, a state otherwise."""
    fields = kind.page(spec, dtype)
    if kind.plan.chunked:
        return PageShape(num_layers=num_layers, kv_parts=kind.kv_parts, family=kind.name,
                         **fields)
    return StateShape.of_tensors(num_layers, family=kind.name, **fields)


class HostKVMemory:
    """``num_blocks`` pages per group. Block 0 (the core's null block) is never written."""

    def __init__(self, num_blocks: int, shapes: Sequence[GroupShape]) -> None:
        if type(num_blocks) is not int or num_blocks < 2:
            raise ValueError(f"num_blocks must be an int >= 2, got {num_blocks!r}")
        if not shapes:
            raise ValueError("host memory needs at least one group")
        self.num_blocks = num_blocks
        self.shapes = tuple(shapes)
        self._arrays: list[Rows] = [np.zeros((num_blocks, s.page_bytes), dtype=np.uint8)
                                    for s in self.shapes]
        self.pool = default_pool()  # where copy-outs go (shared with the memory tier)

    @classmethod
    def for_config(cls, config: KVCacheConfig) -> HostKVMemory:
        return cls(config.num_blocks, [shape_of_group(g) for g in config.kv_cache_groups])

    @property
    def num_groups(self) -> int:
        return len(self._arrays)

    def page_bytes(self, group: int) -> int:
        return self.shapes[group].page_bytes

    def pages(self, group: int, block_ids: Sequence[int]) -> Rows:
        """The rows of ``block_ids``: a zero-copy view when the ids are consecutive (always
        for a single block), a gathered copy otherwise."""
        ids = self._check_ids(group, block_ids)
        first = ids[0]
        if ids == list(range(first, first + len(ids))):
            return self._arrays[group][first:first + len(ids)]
        return self._arrays[group][ids]

    def copy_out(self, group: int, block_ids: Sequence[int]) -> Rows:
        """A private, read-only copy of the rows (the source blocks may be reused right
        after), over the buffer of :meth:`copy_out_bytes`."""
        data = self.copy_out_bytes(group, block_ids)  # checks the group and the ids
        return np.frombuffer(data, dtype=np.uint8).reshape(-1, self.shapes[group].page_bytes)

    def copy_out_bytes(self, group: int, block_ids: Sequence[int]) -> bytes | Sealed:
        """The rows' bytes, copied once into an immutable buffer: what a store hands the
        tiers in copy mode. Being immutable, the memory tier keeps it as it is instead of
        copying it again (see ``kvplugin.connectors.memory``). A big copy goes into a sealed slot of
        the payload pool (memory already faulted in, reused once the tiers let go of it),
        a small one into a new ``bytes``."""
        ids = self._check_ids(group, block_ids)
        arr = self._arrays[group]
        width = arr.shape[1]
        if len(ids) * width < MIN_POOLED_BYTES:
            return b"".join([arr[b].data for b in ids])

        def write(out: Rows) -> None:
            rows = out.reshape(len(ids), width)
            for i, b in enumerate(ids):  # row by row: faster than a gather into ``out``
                rows[i] = arr[b]

        return self.pool.fill(len(ids) * width, write)

    def copy_in(self, group: int, block_ids: Sequence[int], data: Any) -> None:
        """Write ``len(block_ids)`` pages of bytes (any buffer, e.g. a loaded payload)."""
        ids = self._check_ids(group, block_ids)
        src = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        width = self.shapes[group].page_bytes
        if src.size != len(ids) * width:
            raise ValueError(f"{src.size} bytes do not fill {len(ids)} pages of {width} bytes")
        self._arrays[group][ids] = src.reshape(len(ids), width)

    def copy_block(self, src: int, dst: int) -> None:
        """The device's copy-on-write of one block: every group's row (a block id belongs
        to one group at a time; the other rows are unused)."""
        self._check_ids(0, [src, dst])
        for arr in self._arrays:
            arr[dst] = arr[src]

    def _check_ids(self, group: int, block_ids: Sequence[int]) -> list[int]:
        if not 0 <= group < len(self._arrays):
            raise ValueError(f"group {group} out of range [0, {len(self._arrays)})")
        ids = list(block_ids)
        if not ids:
            raise ValueError("no block ids given")
        for b in ids:
            if type(b) is not int or not 0 < b < self.num_blocks:
                raise ValueError(f"block id {b!r} outside [1, {self.num_blocks})")
        return ids


def layout_of(shapes: Sequence[GroupShape], chunk_blocks: int, state_unit: int
              ) -> plans.Layout:
    """The offload layout of these pages (:class:`plans.Layout`), both engines'.
    ``state_unit``: where the engine's hits can land (the core's lookup unit; vLLM's
    ``cache_hit_alignment_tokens``), so a state boundary is one the engine can resume at."""
    has_state = any(not s.group_kind.plan.chunked for s in shapes)
    return plans.Layout(tuple(s.block_size for s in shapes), chunk_blocks,
                        tuple(s.kind for s in shapes), tuple(s.window_tokens for s in shapes),
                        state_unit if has_state else 0)
