"""vLLM's KV-cache groups as kvplugin pages, and the copies between vLLM's tensors and them.

A group's page is what the native manager stores for it (:mod:`kvplugin.aio.memory`), so
the layout fingerprint, and with it every key, is the native one:

* full attention / sliding window: one page per block, ``(K/V, layer, slot, head, dim)``
  from the per-layer tensors ``[2, num_blocks, block_size, heads, head_size]``;
* Mamba "align": one page per state, ``(layer, bytes)``: each layer's state tensors packed
  back to back, which is how vLLM 0.33 lays a Mamba layer's block out (its per-layer view is
  ``[num_blocks, 1, 1, page_bytes]`` of raw bytes, the states first, then any padding).

torch and vLLM are imported lazily (by name), so this module loads without them.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplugin.aio.memory import GroupShape, PageShape, StateShape
from kvplugin.buffers import MIN_POOLED_BYTES, Sealed, default_pool

__all__ = ["DTYPES", "GroupIO", "group_ios", "pages_in", "pages_out"]

DTYPES = ("float16", "bfloat16", "float32", "float64", "int8", "uint8", "float8_e4m3fn",
          "float8_e5m2")


@dataclass(frozen=True, slots=True)
class GroupIO:
    """One KV-cache group: its page and its layers, in vLLM's order."""

    index: int
    shape: GroupShape
    layers: tuple[str, ...]

    @property
    def is_state(self) -> bool:
        return isinstance(self.shape, StateShape)


def _dtype_name(dtype: Any) -> str:
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise ValueError(f"KV dtype {dtype} is not supported")
    return name


def group_ios(groups: Sequence[Any]) -> list[GroupIO]:
    """The page of every group, or a ValueError naming the first one kvplugin cannot serve
    (chunked local attention, MLA, Mamba outside "align" mode, ...)."""
    iface = importlib.import_module("vllm.v1.kv_cache_interface")
    out = []
    for gid, group in enumerate(groups):
        spec, layers = group.kv_cache_spec, tuple(group.layer_names)
        shape: GroupShape
        if type(spec) is iface.FullAttentionSpec:
            shape = PageShape(len(layers), spec.num_kv_heads, spec.head_size,
                              _dtype_name(spec.dtype), spec.block_size)
        elif type(spec) is iface.SlidingWindowSpec:
            shape = PageShape(len(layers), spec.num_kv_heads, spec.head_size,
                              _dtype_name(spec.dtype), spec.block_size, spec.sliding_window,
                              spec.extra_retained_tokens)
        elif type(spec) is iface.MambaSpec and spec.mamba_cache_mode == "align":
            shapes = tuple(tuple(int(d) for d in s) for s in spec.shapes)
            shape = StateShape(len(layers), spec.state_content_size_bytes, spec.block_size,
                               shapes, tuple(_dtype_name(d) for d in spec.dtypes))
        else:
            mode = getattr(spec, "mamba_cache_mode", None)
            kind = type(spec).__name__ + (f" (mamba_cache_mode={mode!r})" if mode else "")
            raise ValueError(f"KVPluginConnector serves full-attention, sliding-window and "
                             f"Mamba 'align' groups; group {gid} is {kind}")
        out.append(GroupIO(gid, shape, layers))
    if all(g.is_state for g in out):
        raise ValueError("KVPluginConnector needs at least one attention group")
    return out


def check_tensors(groups: Sequence[GroupIO], kv_caches: dict[str, Any]) -> dict[str, Any]:
    """The tensors of every group's layers, their shapes checked against the pages."""
    missing = [n for g in groups for n in g.layers if n not in kv_caches]
    if missing:
        raise ValueError(f"no KV tensor for layers {missing}")
    for g in groups:
        s = g.shape
        for name in g.layers:
            t = kv_caches[name]
            if isinstance(s, StateShape):
                if t.dim() < 2 or t[0].numel() * t.element_size() < s.layer_bytes:
                    raise ValueError(f"layer {name}: state tensor {tuple(t.shape)} holds "
                                     f"less than {s.layer_bytes} bytes per block")
            elif (t.dim() != 5 or t.shape[0] != 2 or tuple(t.shape[2:]) !=
                    (s.block_size, s.num_kv_heads, s.head_size)):
                raise ValueError(f"layer {name}: KV tensor shape {tuple(t.shape)} is not "
                                 f"[2, blocks, {s.block_size}, {s.num_kv_heads}, "
                                 f"{s.head_size}]")
    return {n: kv_caches[n] for g in groups for n in g.layers}


def _state_rows(t: Any, layer_bytes: int) -> Any:
    """A state layer's blocks as ``(num_blocks, layer_bytes)`` uint8 (a view)."""
    torch = importlib.import_module("torch")
    return t.reshape(t.shape[0], -1).view(torch.uint8)[:, :layer_bytes]


def pages_out(group: GroupIO, kv: dict[str, Any], block_ids: list[int]) -> bytes | Sealed:
    """The pages of ``block_ids``, ``(blocks, *dims)``, as one immutable buffer. Each
    layer's blocks are gathered and copied once, straight into a payload-pool slot (from
    a GPU tensor, that copy is the device-to-host one): no staging tensor, no fresh
    allocation to fault in, and the memory tier keeps the sealed slot without copying."""
    torch = importlib.import_module("torch")
    index = torch.tensor(block_ids, dtype=torch.long)
    s = group.shape
    n = len(block_ids)

    def write(out: Any) -> None:
        dst = torch.from_numpy(out)  # the slot itself
        if isinstance(s, StateShape):
            rows = dst.view(n, s.num_layers, s.layer_bytes)
            for li, name in enumerate(group.layers):
                rows[:, li].copy_(_state_rows(kv[name], s.layer_bytes)[index])
            return
        # (2, blocks, slot, head, dim) per layer -> (blocks, 2, layer, ...): a page a block.
        pages = dst.view(getattr(torch, s.dtype)).view(n, *s.dims)
        for li, name in enumerate(group.layers):
            pages[:, :, li].copy_(kv[name][:, index].transpose(0, 1))

    nbytes = n * s.page_bytes
    if nbytes < MIN_POOLED_BYTES:  # small: a bytes, as malloc's small bins are as fast
        buf = np.empty(nbytes, dtype=np.uint8)
        write(buf)
        return buf.tobytes()
    return default_pool().fill(nbytes, write)


def pages_in(group: GroupIO, kv: dict[str, Any], block_ids: list[int], payload: Any,
             skip: int = 0) -> None:
    """Copy pages ``skip ..`` of ``payload`` (whole pages of this group) into ``block_ids``."""
    torch = importlib.import_module("torch")
    s = group.shape
    with warnings.catch_warnings():  # read only: torch warns about a read-only buffer
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8))
    index = torch.tensor(block_ids, dtype=torch.long)
    n = len(block_ids)
    if isinstance(s, StateShape):
        pages = raw.reshape(-1, s.num_layers, s.layer_bytes)[skip:skip + n]
        for li, name in enumerate(group.layers):
            t = kv[name]
            _state_rows(t, s.layer_bytes)[index] = pages[:, li].to(t.device)
        return
    dtype = getattr(torch, s.dtype)
    pages = raw.view(dtype).reshape(-1, *s.dims)[skip:skip + n]
    for li, name in enumerate(group.layers):
        t = kv[name]
        t[:, index] = pages[:, :, li].transpose(0, 1).to(t.device)
