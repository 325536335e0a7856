"""The vLLM worker's page copies on vLLM's real KV tensors, per KVCacheLayout.

Run under a python with vLLM (the side venv: ``PY=$(bash tools/setup_vllm_side_venv.sh)``),
this checkout on PYTHONPATH::

    PYTHONPATH=. $PY benchmarks/vllm_pages.py [--layers 8] [--blocks 32] [--repeats 15]

The tensors are vLLM's own: ``get_kv_cache_config_from_groups`` plans the allocation and
``allocate_kv_cache`` makes the per-layer ``[B, H, N, C]`` views in each layout. Per layout:

- **store copy-out**: ``pages_out`` of ``--blocks`` scattered blocks (kvplugin's
  layout-free page bytes, in a payload-pool slot) against the raw torch gather of the same
  blocks (``index_select`` per layer into a preallocated contiguous buffer: no format, no
  pool);
- **load copy-in**: ``pages_in`` of those bytes into other blocks against the raw torch
  scatter (``index_copy_`` per layer from a contiguous buffer).

Figures are bytes/s, medians of ``--repeats`` runs each, the ratio ours / raw measured in
the same run. CPU tensors here: on a GPU the copy-out's gather runs on the device and the
device-to-host copy is the one transfer (not measured here).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _allocate(groups: list[Any], layout: str, num_blocks: int, block_size: int,
              kernel: list[int] | None) -> dict[str, Any]:
    import torch
    from vllm.config import CacheConfig, DeviceConfig, VllmConfig
    from vllm.v1.core.kv_cache_planning import get_kv_cache_config_from_groups
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    vc = VllmConfig(cache_config=CacheConfig(block_size=block_size),
                    device_config=DeviceConfig("cpu"))
    vc.cache_config.kv_cache_layout = layout
    vc.cache_config.num_gpu_blocks_override = num_blocks
    kvc = get_kv_cache_config_from_groups(vc, groups, 1 << 40)
    kv: dict[str, Any] = allocate_kv_cache(kvc, torch.device("cpu"), KVCacheLayout[layout],
                                           kernel)
    return kv


def _median_s(fn: Any, repeats: int) -> float:
    fn()  # warm: pool slots, page faults
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _measure(kv: dict[str, Any], m: Any, names: list[str], src: list[int], dst: list[int],
             block_size: int, repeats: int, nbytes: int) -> dict[str, Any]:
    """One layout: ours against the raw torch gather / scatter of the same blocks."""
    import torch

    from kvplugin.integrations._groups import pages_in, pages_out

    r = block_size // next(iter(kv.values())).shape[2]  # kernel blocks per block
    isrc = torch.tensor([b * r + k for b in src for k in range(r)])
    idst = torch.tensor([b * r + k for b in dst for k in range(r)])
    raw_out = {n: torch.empty((len(isrc), *kv[n].shape[1:]), dtype=kv[n].dtype)
               for n in names}

    def raw_gather() -> None:
        for n in names:
            torch.index_select(kv[n], 0, isrc, out=raw_out[n])

    def raw_scatter() -> None:
        for n in names:
            kv[n].index_copy_(0, idst, raw_out[n])

    # The stronger raw scatter on a CPU: numpy's fancy assignment of the same contiguous
    # per-layer blocks (torch's index_copy_ is ~3x slower here).
    host = {n: kv[n].view(torch.int16).numpy() for n in names}
    src_np = {n: raw_out[n].view(torch.int16).numpy() for n in names}
    idst_np = idst.numpy()

    def raw_np_scatter() -> None:
        for n in names:
            host[n][idst_np] = src_np[n]

    payload = pages_out(m, src)
    out_s = _median_s(lambda: pages_out(m, src), repeats)
    raw_out_s = _median_s(raw_gather, repeats)
    in_s = _median_s(lambda: pages_in(m, dst, payload), repeats)
    raw_in_s = _median_s(raw_scatter, repeats)
    raw_np_s = _median_s(raw_np_scatter, repeats)
    return {"store_gbps": round(nbytes / out_s / 1e9, 2),
            "raw_gather_gbps": round(nbytes / raw_out_s / 1e9, 2),
            "store_ratio": round(raw_out_s / out_s, 3),
            "load_gbps": round(nbytes / in_s / 1e9, 2),
            "raw_scatter_gbps": round(nbytes / raw_in_s / 1e9, 2),
            "load_ratio": round(raw_in_s / in_s, 3),
            "raw_np_scatter_gbps": round(nbytes / raw_np_s / 1e9, 2),
            "load_ratio_np": round(raw_np_s / in_s, 3)}


def bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheGroupSpec
    from vllm.v1.kv_cache_layout import KVCacheLayout

    from kvplugin.integrations._groups import group_ios, map_groups

    torch.set_num_threads(1)  # one worker thread copies; the figures compare like with like
    spec = FullAttentionSpec(block_size=args.block_size, num_kv_heads=args.heads,
                             head_size=args.head_size, dtype=torch.float16)
    names = [f"layer{i}" for i in range(args.layers)]
    groups = [KVCacheGroupSpec(names, spec)]
    ios = group_ios(groups)
    gen = torch.Generator().manual_seed(0)
    src = torch.randperm(args.num_blocks, generator=gen)[:args.blocks].tolist()
    dst = torch.randperm(args.num_blocks, generator=gen)[:args.blocks].tolist()
    nbytes = args.blocks * ios[0].shape.page_bytes
    rows = []
    cases = [(lay.name, None) for lay in KVCacheLayout] + [("LBNHC", args.block_size // 2)]
    for layout, kernel in cases:
        kv = _allocate(groups, layout, args.num_blocks, args.block_size,
                       [kernel] if kernel else None)
        for t in kv.values():
            t.copy_(torch.randn(t.shape, generator=gen).to(t.dtype))
        lay = KVCacheLayout[layout]
        row = _measure(kv, map_groups(ios, kv)[0], names, src, dst, args.block_size,
                       args.repeats, nbytes)
        rows.append({"layout": layout + (f" (kernel {kernel})" if kernel else ""),
                     "block_contiguous": lay.is_block_contiguous, **row})
    return {"bytes_per_op": nbytes, "layers": args.layers, "blocks": args.blocks,
            "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--head-size", type=int, default=128)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--num-blocks", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=32, help="blocks per copy (one chunk)")
    ap.add_argument("--repeats", type=int, default=15)
    args = ap.parse_args(argv)
    res = bench(args)
    print(f"{res['blocks']} blocks x {res['layers']} layers = "
          f"{res['bytes_per_op'] / 2**20:.1f} MiB per copy; GB/s, medians of {args.repeats}")
    print(f"{'layout':<20}{'store':>8}{'raw':>8}{'ratio':>8}{'load':>8}{'raw':>8}{'ratio':>8}"
          f"{'raw np':>8}{'ratio':>8}")
    for r in res["rows"]:
        print(f"{r['layout']:<20}{r['store_gbps']:>8}{r['raw_gather_gbps']:>8}"
              f"{r['store_ratio']:>8}{r['load_gbps']:>8}{r['raw_scatter_gbps']:>8}"
              f"{r['load_ratio']:>8}{r['raw_np_scatter_gbps']:>8}{r['load_ratio_np']:>8}")
    print(json.dumps(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
