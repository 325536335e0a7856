"""vLLM's KV-cache groups as kvplugin pages, and the copies between vLLM's tensors and them.

A group's page is what the native manager stores for it (:mod:`kvplugin.aio.memory`, built
by the same :mod:`kvplugin.aio.group_kinds` entry, which names the vLLM spec classes it
serves), so the layout fingerprint, and with it every key, is the native one:

* attention (full, sliding window, chunked local): one page per block,
  ``(K/V, layer, slot, head, dim)``; MLA the same with the latent alone on the K/V axis;
* Mamba "align": one page per state, ``(layer, bytes)``: each layer's state tensors packed
  back to back, as vLLM lays a Mamba layer's block out (the states first, then padding).

The tensors are those vLLM registers (``allocate_kv_cache``): per layer a logical
``[B * r, H, N, C]`` view (C: K then V; r kernel blocks per block) in any physical
``KVCacheLayout``; :func:`map_groups` reads the layout from each tensor's strides.

torch and vLLM are imported lazily (by name), so this module loads without them.
"""

from __future__ import annotations

import importlib
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvplugin.aio import group_kinds
from kvplugin.aio.memory import GroupShape, StateShape, shape_of_kind
from kvplugin.buffers import MIN_POOLED_BYTES, Sealed, default_pool

__all__ = ["DTYPES", "GroupIO", "PageMap", "group_ios", "map_groups", "pages_in", "pages_out",
           "pages_out_many"]

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


def _check_dense(gid: int, spec: Any, mla: bool = False) -> None:
    """An attention page kvplugin maps: one slot per KV head, K and V of ``head_size``
    each side by side (MLA: the latent alone), no packed or quantized content."""
    packed = {name: getattr(spec, name, None) for name in ("num_head_slots",
                                                          "state_content_bytes")}
    if mla and getattr(spec, "cache_dtype_str", None) not in (None, "auto"):
        packed["cache_dtype_str"] = spec.cache_dtype_str  # e.g. fp8_ds_mla: a packed page
    quant = getattr(getattr(spec, "kv_quant_mode", None), "name", "NONE")
    hv = getattr(spec, "head_size_v", spec.head_size)
    if (hv != (0 if mla else spec.head_size) or any(v is not None for v in packed.values())
            or quant != "NONE"):
        raise ValueError(f"KVPluginConnector: group {gid}: {type(spec).__name__} with "
                         f"head_size {spec.head_size}, head_size_v {hv}, {packed}, "
                         f"kv_quant_mode {quant}: only dense pages with K and V of equal "
                         f"size (or MLA's latent alone) are served")


def group_ios(groups: Sequence[Any]) -> list[GroupIO]:
    """The page of every group, or a ValueError naming the first one kvplugin cannot serve
    (a spec class no group kind maps for vLLM, Mamba outside "align" mode, ...)."""
    iface = importlib.import_module("vllm.v1.kv_cache_interface")
    served = [k for k in group_kinds.kinds() if k.vllm]
    by_class = {getattr(iface, name): k for k in served for name in k.vllm}
    out = []
    for gid, group in enumerate(groups):
        spec, layers = group.kv_cache_spec, tuple(group.layer_names)
        kind = by_class.get(type(spec))  # the exact class, as the native registry
        if kind is None or kind.refuse(spec) is not None:
            mode = getattr(spec, "mamba_cache_mode", None)
            name = type(spec).__name__ + (f" (mamba_cache_mode={mode!r})" if mode else "")
            raise ValueError(f"KVPluginConnector serves {group_kinds.served_labels(tuple(served))}"
                             f" groups; group {gid} is {name}")
        if kind.plan.chunked:
            _check_dense(gid, spec, mla=kind.kv_parts == 1)
        shape = shape_of_kind(kind, spec, len(layers), _dtype_name)
        if isinstance(shape, StateShape) and shape.layer_bytes != spec.state_content_size_bytes:
            # kvplugin sizes a state from its tensors; vLLM's layout must agree byte for byte
            raise ValueError(f"KVPluginConnector: group {gid}: vLLM's state holds "
                             f"{spec.state_content_size_bytes} bytes per layer, its tensors "
                             f"{shape.layer_bytes}")
        out.append(GroupIO(gid, shape, layers))
    if all(g.is_state for g in out):
        raise ValueError("KVPluginConnector needs at least one attention group")
    return out


@dataclass(frozen=True, slots=True)
class _Run:
    """Consecutive layers of a group that one strided view addresses: page layers
    ``first .. first + count``. Attention: ``[block, K/V, layer, kernel block, slot, head,
    dim]``; state: ``[block, layer, byte]``. Block-major layouts (and layer-major ones,
    whose layers sit a constant stride apart) make a group one run: one gather per group."""

    view: Any
    first: int
    count: int
    host: np.ndarray[Any, Any] | None = None  # a CPU run's view in numpy (see pages_in)


@dataclass(frozen=True, slots=True)
class PageMap:
    """Where a group's pages sit in the tensors vLLM registered, read from the tensors'
    own shapes and strides (any ``KVCacheLayout``, kernel blocks splitting a manager
    block, groups overlaid in the same bytes)."""

    group: GroupIO
    runs: tuple[_Run, ...]
    num_blocks: int
    device: Any


def map_groups(groups: Sequence[GroupIO], kv_caches: dict[str, Any]) -> list[PageMap]:
    """Every group's :class:`PageMap`, or a ValueError naming the first layer whose tensor
    kvplugin cannot map (and what it expected)."""
    missing = [n for g in groups for n in g.layers if n not in kv_caches]
    if missing:
        raise ValueError(f"KVPluginConnector: vLLM registered no KV tensor for layers "
                         f"{missing}")
    return [_map_group(g, [kv_caches[n] for n in g.layers]) for g in groups]


def _layer_view(group: GroupIO, name: str, t: Any) -> tuple[Any, tuple[int, ...], int]:
    """One layer's tensor as (the tensor, its view's strides in elements without the layer
    axis, manager blocks). vLLM registers a logical ``[B * r, H, N, C]`` view per layer (r
    kernel blocks per manager block, C the K and V channels side by side; a Mamba layer
    ``[B, 1, 1, bytes]``)."""
    torch = importlib.import_module("torch")
    s = group.shape
    if t.dim() != 4:
        raise ValueError(f"KVPluginConnector: layer {name}: KV tensor {tuple(t.shape)} is not "
                         f"vLLM's [blocks, heads, slots, channels] view")
    st = t.stride()
    if isinstance(s, StateShape):
        if t.element_size() != 1:
            t = t.view(torch.uint8) if st[3] == 1 else t
        if (t.element_size() != 1 or t.shape[1] != 1 or t.shape[2] != 1
                or t.shape[3] < s.layer_bytes):
            raise ValueError(f"KVPluginConnector: layer {name}: state tensor "
                             f"{tuple(t.shape)} {t.dtype} is not [blocks, 1, 1, >= "
                             f"{s.layer_bytes} bytes]")
        return t.view(torch.uint8), (t.stride(0), t.stride(3)), int(t.shape[0])
    want = getattr(torch, s.dtype)
    blocks, heads, slots, chans = (int(d) for d in t.shape)
    if (t.dtype != want or heads != s.num_kv_heads or chans != s.kv_parts * s.head_size
            or slots < 1 or s.block_size % slots or blocks % (s.block_size // slots)):
        raise ValueError(f"KVPluginConnector: layer {name}: KV tensor {tuple(t.shape)} "
                         f"{t.dtype} is not [blocks * r, {s.num_kv_heads}, "
                         f"{s.block_size} / r, {s.kv_parts} * {s.head_size}] {want}")
    r = s.block_size // slots
    d = s.head_size
    # [block, K/V, kernel block, slot, head, dim]: kernel blocks sit uniformly strided
    # inside a manager block (vLLM's rule for splitting), K then V along C (MLA: the
    # latent alone).
    return t, (st[0] * r, st[3] * d, st[0], st[2], st[1], st[3]), blocks // r


def _map_group(group: GroupIO, tensors: list[Any]) -> PageMap:
    torch = importlib.import_module("torch")
    s = group.shape
    views = [_layer_view(group, n, t) for n, t in zip(group.layers, tensors, strict=True)]
    counts = {v[2] for v in views}
    if len(counts) != 1:
        raise ValueError(f"KVPluginConnector: group {group.index}: its layers' tensors hold "
                         f"different numbers of blocks {sorted(counts)}")
    num_blocks = counts.pop()
    if isinstance(s, StateShape):
        size: tuple[int, ...] = (num_blocks, s.layer_bytes)
    else:
        r = s.block_size // int(tensors[0].shape[2])
        size = (num_blocks, s.kv_parts, r, s.block_size // r, s.num_kv_heads, s.head_size)
    runs: list[_Run] = []
    li = 0
    while li < len(views):
        base, strides, _ = views[li]
        count, step = 1, 0
        # Extend while the next layer is the same storage, with the same strides, one
        # constant step further on (every layout vLLM allocates: one run per tensor).
        while li + count < len(views):
            nxt, nst, _ = views[li + count]
            gap = nxt.storage_offset() - views[li + count - 1][0].storage_offset()
            if (nxt.untyped_storage().data_ptr() != base.untyped_storage().data_ptr()
                    or nst != strides or nxt.dtype != base.dtype or gap <= 0
                    or (step and gap != step)):
                break
            step, count = gap, count + 1
        full: tuple[int, ...]
        st: tuple[int, ...]
        if isinstance(s, StateShape):
            full, st = (size[0], count, size[1]), (strides[0], step or 1, strides[1])
        else:
            full = (size[0], size[1], count, *size[2:])
            st = (strides[0], strides[1], step or 1, *strides[2:])
        view = torch.as_strided(base, full, st, base.storage_offset())
        runs.append(_Run(view, li, count, _host_view(view)))
        li += count
    return PageMap(group, tuple(runs), num_blocks, tensors[0].device)


_INT_OF_SIZE = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}


def _host_view(view: Any) -> np.ndarray[Any, Any] | None:
    """A CPU view as a numpy array of same-sized integers (the bytes are only moved, and
    numpy has no bfloat16 / float8), sharing its memory; None on a device."""
    if view.device.type != "cpu":
        return None
    torch = importlib.import_module("torch")
    ints = getattr(torch, _INT_OF_SIZE[view.element_size()])
    arr: np.ndarray[Any, Any] = view.view(ints).numpy()
    return arr


def _index(m: PageMap, block_ids: Sequence[int]) -> Any:
    torch = importlib.import_module("torch")
    index = torch.tensor(block_ids, dtype=torch.long)
    if index.numel() and (int(index.min()) < 0 or int(index.max()) >= m.num_blocks):
        raise ValueError(f"block ids {list(block_ids)} out of range for group "
                         f"{m.group.index} ({m.num_blocks} blocks)")
    return index.to(m.device)


def _page_view(m: PageMap, flat: Any, n: int) -> Any:
    """``flat`` (uint8, ``n`` whole pages) as the runs' axes, layers on axis 2 (attention)
    or 1 (state)."""
    torch = importlib.import_module("torch")
    s = m.group.shape
    if isinstance(s, StateShape):
        return flat.view(n, s.num_layers, s.layer_bytes)
    r = m.runs[0].view.shape[3]
    return flat.view(getattr(torch, s.dtype)).view(
        n, s.kv_parts, s.num_layers, r, s.block_size // r, s.num_kv_heads, s.head_size)


def _layers(m: PageMap, pages: Any, run: _Run) -> Any:
    axis = 1 if m.group.is_state else 2
    return pages.narrow(axis, run.first, run.count)


def _gather(m: PageMap, index: Any, out: np.ndarray[Any, Any], n: int) -> None:
    """Pages ``index`` (``n`` of them) into ``out`` (uint8, whole pages back to back, or a
    ``(k, pages)`` array of rows): one gather per run, straight into ``out``; from a GPU
    the gather runs on the device and the one copy out is the device-to-host one."""
    torch = importlib.import_module("torch")
    if out.ndim == 2 and not out.flags.c_contiguous:
        # Rows padded to whole 4 KiB slots (a page size that is not a multiple of it):
        # gathered contiguously first, then moved into the rows.
        tmp = np.empty(out.shape, dtype=np.uint8)
        _gather(m, index, tmp, n)
        out[...] = tmp
        return
    pages = _page_view(m, torch.from_numpy(out.reshape(-1)), n)
    for run in m.runs:
        dst = _layers(m, pages, run)
        if run.view.device.type == "cpu":
            torch.index_select(run.view, 0, index, out=dst)
        else:
            dst.copy_(torch.index_select(run.view, 0, index))


def pages_out(m: PageMap, block_ids: Sequence[int]) -> bytes | Sealed:
    """The pages of ``block_ids`` in kvplugin's layout-independent page format
    (``(blocks, *dims)``) as one immutable buffer, in a payload-pool slot."""
    return pages_out_many(m, [block_ids])[0]


def pages_out_many(m: PageMap, objects: Sequence[Sequence[int]]) -> list[bytes | Sealed]:
    """One immutable buffer per object, each the pages of its block ids (every object the
    same number of blocks), copied out with as few gathers as the payload pool's free
    slots allow: one per run of adjacent slots (a step's objects usually fill one or a few
    slabs), not one per object. Objects under ``MIN_POOLED_BYTES`` are ``bytes`` cut from
    one gather (malloc's small bins are as fast as the pool there)."""
    if not objects:
        return []
    per = len(objects[0])
    if per < 1 or any(len(ids) != per for ids in objects):
        raise ValueError(f"objects of {sorted({len(ids) for ids in objects})} blocks: "
                         f"pages_out_many takes objects of one size, at least one block")
    index = _index(m, [b for ids in objects for b in ids])
    nbytes = per * m.group.shape.page_bytes
    if nbytes < MIN_POOLED_BYTES:
        buf = np.empty((len(objects), nbytes), dtype=np.uint8)
        _gather(m, index, buf, len(objects) * per)
        return [row.tobytes() for row in buf]

    def write(rows: np.ndarray[Any, Any], first: int) -> None:
        k = rows.shape[0]
        _gather(m, index[first * per:(first + k) * per], rows, k * per)

    return list(default_pool().fill_many(nbytes, len(objects), write))


def pages_in(m: PageMap, block_ids: Sequence[int], payload: Any, skip: int = 0) -> None:
    """Copy pages ``skip ..`` of ``payload`` (whole pages of this group, kvplugin's page
    format) into ``block_ids``: one scatter per run."""
    torch = importlib.import_module("torch")
    n = len(block_ids)
    with warnings.catch_warnings():  # read only: torch warns about a read-only buffer
        warnings.simplefilter("ignore", UserWarning)
        raw = torch.from_numpy(np.frombuffer(payload, dtype=np.uint8))
    page = m.group.shape.page_bytes
    if raw.numel() < (skip + n) * page:
        raise ValueError(f"payload of {raw.numel()} bytes holds fewer than {skip + n} pages "
                         f"of {page} bytes")
    pages = _page_view(m, raw[skip * page:(skip + n) * page], n)
    index = _index(m, block_ids)
    for run in m.runs:
        src = _layers(m, pages, run)
        if run.host is not None:
            # On the CPU numpy's fancy assignment scatters at memcpy speed; torch's
            # index_copy_ / index_put_ run ~3x slower here (benchmarks/vllm_pages.py).
            run.host[index.numpy()] = src.view(run.view.dtype).view(
                getattr(torch, _INT_OF_SIZE[run.view.element_size()])).numpy()
        else:
            run.view.index_copy_(0, index, src.to(run.view.device))
