"""kvplugin as SGLang's HiCache storage backend, driven by SGLang's real classes (sglang
0.5.23 on CPU): its ``StorageBackendFactory`` loads the backend from the documented extra
config, its ``MHATokenToKVPoolHost`` (over an ``MHATokenToKVPool`` on the CPU) is the host
pool the v1 calls address, its ``HiCacheFile`` answers the same calls in the differential,
its ``HiCacheStorageFailureInjector`` wraps the backend, its ``get_storage_hash_str`` makes
the page hashes. Run under the SGLang side venv: ``python sglang_scenarios.py NAME...``;
each scenario prints one JSON record. ``KVPLUGIN_SG_REDIS``: a Redis URL the test started.
"""

from __future__ import annotations

import json
import os
import re
import socket
import sys
import time
from pathlib import Path
from typing import Any

import scenario_testlib
import torch
from sglang.srt.mem_cache.device_pool_info import MambaStateBufferInfo
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheFile,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    HiCacheStorageFailureInjector,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
from sglang.srt.mem_cache.pool_host.mamba import MambaPoolHost
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_storage_hash_str

REPO = Path(__file__).resolve().parents[2]
PAGE = 16  # tokens per page
EXTRA = {"backend_name": "kvplugin", "module_path": "kvplugin.integrations.sglang",
         "class_name": "KVPluginHiCacheStorage"}


def storage_config(extra: dict[str, Any], *, tp: tuple[int, int] = (0, 1),
                   model: str = "test/model") -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=tp[0], tp_size=tp[1], pp_rank=0, pp_size=1,
                                attn_cp_rank=0, attn_cp_size=1, is_mla_model=False,
                                enable_storage_metrics=True, is_page_first_layout=False,
                                model_name=model, extra_config=extra)


def write_config(root: str, name: str, offload: dict[str, Any],
                 tenants: dict[str, Any] | None = None,
                 faults: dict[str, Any] | None = None) -> str:
    return scenario_testlib.write_config(root, name, offload, model="kvplugin/sglang-test",
                                         tenants=tenants, faults=faults)


def backend(config_file: str, **extra: Any) -> Any:
    """Built as SGLang builds a dynamic backend (no failure injector: its env unset)."""
    return StorageBackendFactory.create_backend(
        "dynamic", storage_config({**EXTRA, "config_file": config_file, **extra}), None)


def host_pool(layout: str = "layer_first") -> MHATokenToKVPoolHost:
    dev = MHATokenToKVPool(size=256, page_size=PAGE, dtype=torch.bfloat16, head_num=2,
                           head_dim=8, layer_num=2, device="cpu", enable_memory_saver=False,
                           enable_alt_stream=False)
    return MHATokenToKVPoolHost(dev._mha_buffer_info(), 2.0, 0, PAGE, layout,
                                pin_memory=False, device="cpu", device_capacity_tokens=256,
                                start_layer=0, end_layer=2)


def hashes(n: int, salt: str | None = None, seed: int = 0) -> list[str]:
    """SGLang's own storage page hashes of n pages (a cache salt seeds the chain)."""
    key = _Key(list(range(seed, seed + n * PAGE)), salt)
    out = get_storage_hash_str(key, None, page_size=PAGE)
    assert isinstance(out, list)
    return out


class _Key(list):  # what get_storage_hash_str reads of a RadixKey: tokens, salt, extra key
    def __init__(self, tokens: list[int], salt: str | None) -> None:
        super().__init__(tokens)
        self.cache_salt = salt
        self.extra_key = None


def pages(n: int, seed: int, numel: int = 1024) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.rand(numel, generator=gen).to(torch.bfloat16) for _ in range(n)]


def zeros(n: int, numel: int = 1024) -> list[torch.Tensor]:
    return [torch.zeros(numel, dtype=torch.bfloat16) for _ in range(n)]


def ours(metrics: Any) -> dict[str, Any]:
    return {k: v for k, v in metrics.kvplugin["counters"].items() if v}


# --------------------------------------------------------------------------- scenarios
def docs_factory(root: str) -> dict[str, Any]:
    """docs/sglang.md's --hicache-storage-backend-extra-config, verbatim, through SGLang's
    factory (the disk directory moved by the deployment's env override)."""
    text = (REPO / "docs" / "sglang.md").read_text()
    block = text.split("<!-- hicache-launch -->", 1)[1]
    extra = json.loads(re.search(r"--hicache-storage-backend-extra-config '([^']+)'",
                                 block).group(1))
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    try:
        return {"class": type(b).__name__, "tiers": list(b.core.tiers),
                "backend": re.search(r"--hicache-storage-backend (\S+)", block).group(1),
                "hierarchical": "--enable-hierarchical-cache" in block}
    finally:
        b.close()


def roundtrip(root: str) -> dict[str, Any]:
    cfg = write_config(root, "rt", {"local_cpu": True, "max_local_cpu_size": 0.01,
                                    "local_disk": f"file://{root}/disk"})
    b = backend(cfg, tier_events=True)
    try:
        keys, want = hashes(3), pages(3, seed=1)
        stored = b.batch_set(keys, want)
        exist = [b.batch_exists(keys), b.batch_exists([*keys[:2], "ab" * 32, keys[2]]),
                 b.exists(keys[1]), b.exists("cd" * 32)]
        got = b.batch_get(keys, zeros(3))
        wrong = b.get(keys[0], torch.zeros(512, dtype=torch.bfloat16))
        stats = b.get_stats()
        exact = [g is not None and torch.equal(g, w) for g, w in zip(got, want, strict=True)]
        return {"stored": stored, "exist": exist, "exact": exact,
                "wrong_size": wrong is None, "backup_pgs": stats.backup_pgs,
                "prefetch_pgs": stats.prefetch_pgs, "counters": ours(stats),
                "events": stats.kvplugin["events"], "keys": keys}
    finally:
        b.close()


def v1(root: str, layout: str) -> dict[str, Any]:
    """Pages addressed in SGLang's real host pool: written from three pages of it, read
    back into three others."""
    cfg = write_config(root, "v1", {"local_disk": f"file://{root}/disk"})
    b = backend(cfg, interface_v1=1)
    pool = host_pool(layout)
    b.register_mem_pool_host(pool)
    try:
        keys, want = hashes(3, seed=7), pages(3, seed=2)
        src = torch.tensor([i * PAGE for i in (1, 2, 3)], dtype=torch.int64)
        src = torch.cat([torch.arange(s, s + PAGE) for s in src.tolist()])
        for i, p in enumerate(want):
            pool.set_from_flat_data_page(int(src[i * PAGE]), p)
        stored = b.batch_set_v1(keys, src)
        dst = torch.cat([torch.arange(s, s + PAGE) for s in (8 * PAGE, 9 * PAGE, 10 * PAGE)])
        got = b.batch_get_v1(keys, dst)
        back = [pool.get_data_page(int(dst[i * PAGE]), flat=True) for i in range(3)]
        missing = b.batch_get_v1(["ef" * 32], dst[:PAGE])
        return {"stored": stored, "got": got, "missing": missing,
                "exact": [torch.equal(x, w) for x, w in zip(back, want, strict=True)],
                "page_bytes": b.core.pools["kv"].page_bytes, "dtype": b.core.pools["kv"].dtype,
                "layout": b.core.pools["kv"].host_layout}
    finally:
        b.close()


def differential(root: str) -> dict[str, Any]:
    """The same calls on SGLang's HiCacheFile and on kvplugin (disk): the same answers,
    except where kvplugin is stricter (recorded apart)."""
    ref = HiCacheFile(storage_config({"file_storage_path": f"{root}/hicache-file"}))
    cfg = write_config(root, "diff", {"local_disk": f"file://{root}/disk"})
    kv = backend(cfg)
    keys, data = hashes(6, seed=3), pages(6, seed=3)
    answers: dict[str, list[Any]] = {"file": [], "kvplugin": []}
    try:
        for name, b in (("file", ref), ("kvplugin", kv)):
            a = answers[name]
            a.append(b.batch_set(keys[:3], data[:3]))
            a.append(b.set(keys[4], data[4]))
            a.append(b.batch_set(keys[:3], data[:3]))  # already there
            a.append([b.exists(k) for k in keys])
            a.append(b.batch_exists(keys))
            a.append(b.batch_exists(keys[4:]))
            got = b.batch_get(keys[:3], zeros(3))
            a.append([g is not None and torch.equal(g, d) for g, d in zip(got, data, strict=False)])
            a.append(b.get(keys[3], torch.zeros(1024, dtype=torch.bfloat16)) is None)
        # Stricter: a page read into a target of another size.
        stricter: dict[str, Any] = {}
        try:
            r = ref.get(keys[0], torch.zeros(512, dtype=torch.bfloat16))
            stricter["file_wrong_size"] = "returned" if r is not None else "none"
        except Exception as e:  # HiCacheFile raises on a short read
            stricter["file_wrong_size"] = type(e).__name__
        stricter["kvplugin_wrong_size"] = kv.get(
            keys[0], torch.zeros(512, dtype=torch.bfloat16)) is None
        # Stricter: one flipped byte in each backend's stored page.
        path = Path(ref.file_path) / f"{ref._get_suffixed_key(keys[1])}.bin"
        raw = bytearray(path.read_bytes())
        raw[100] ^= 0x01
        path.write_bytes(bytes(raw))
        r = ref.get(keys[1], torch.zeros(1024, dtype=torch.bfloat16))
        stricter["file_damaged"] = ("wrong bytes" if r is not None
                                    and not torch.equal(r, data[1]) else repr(r))
        disk = kv.core.rt.connector.levels[-1]
        kid = kv.core.keys("default", [keys[1]])[0].id
        dpath = Path(disk.path_for(kid))
        raw = bytearray(dpath.read_bytes())
        raw[len(raw) // 2] ^= 0x01
        dpath.write_bytes(bytes(raw))
        stricter["kvplugin_damaged"] = repr(kv.get(keys[1], torch.zeros(
            1024, dtype=torch.bfloat16)))
        stricter["kvplugin_refused"] = ours(kv.get_stats()).get("refused_objects|disk", 0)
        return {"file": answers["file"], "kvplugin": answers["kvplugin"], **stricter}
    finally:
        kv.close()


def injector(root: str) -> dict[str, Any]:
    """SGLang's failure injector around kvplugin (half the calls fail, random delays):
    every read is a miss or exactly the stored bytes, and a store it reports done is
    there."""
    cfg = write_config(root, "inj", {"local_cpu": True, "max_local_cpu_size": 0.01})
    inner = backend(cfg)
    b = HiCacheStorageFailureInjector(inner, 0.002, 0.5)
    keys, data = hashes(4, seed=9), pages(4, seed=9)
    assert inner.batch_set(keys, data)
    outcomes = {"exact": 0, "miss": 0, "wrong": 0}
    for _ in range(40):
        got = b.batch_get(keys, zeros(4))
        for g, d in zip(got, data, strict=True):
            if g is None:
                outcomes["miss"] += 1
            elif torch.equal(g, d):
                outcomes["exact"] += 1
            else:
                outcomes["wrong"] += 1
    fresh, fdata = hashes(20, seed=500), pages(20, seed=500)
    said = [b.set(k, d) for k, d in zip(fresh, fdata, strict=True)]
    there = [inner.exists(k) for k in fresh]
    inner.close()
    return {**outcomes, "set_true": sum(said),
            "said_but_missing": sum(s and not t for s, t in zip(said, there, strict=True))}


def tenants(root: str) -> dict[str, Any]:
    """Two servers on one Redis, tenants a and b, the same page hashes: b finds nothing of
    a's. SGLang's own hashing keeps two cache salts apart too."""
    cfg = write_config(root, "ten", {"remote_url": os.environ["KVPLUGIN_SG_REDIS"]})
    a, b = backend(cfg, default_tenant="a"), backend(cfg, default_tenant="b")
    try:
        keys, data = hashes(2, seed=5), pages(2, seed=5)
        a.batch_set(keys, data)
        per_call = HiCacheStorageExtraInfo(extra_info={"tenant": "a"})
        return {"a": a.batch_exists(keys), "b": b.batch_exists(keys),
                "b_get": [g is None for g in b.batch_get(keys, zeros(2))],
                "b_as_a": b.batch_exists(keys, per_call),
                "salts_differ": hashes(2, salt="x") != hashes(2, salt="y"),
                "salt_vs_none": hashes(2, salt="x") != hashes(2)}
    finally:
        a.close()
        b.close()


def dead_redis(root: str) -> dict[str, Any]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cfg = write_config(root, "dead", {"remote_url": f"redis://127.0.0.1:{port}/0",
                                      "lookup_timeout_ms": 50, "load_timeout_ms": 200,
                                      "store_timeout_ms": 200})
    b = backend(cfg)
    try:
        keys, data = hashes(2, seed=4), pages(2, seed=4)
        t0 = time.monotonic()
        exists = b.batch_exists(keys)
        t_exists = time.monotonic() - t0
        stored = b.batch_set(keys, data)
        got = b.batch_get(keys, zeros(2))
        return {"exists": exists, "exists_s": t_exists, "stored": stored,
                "got": [g is None for g in got], "total_s": time.monotonic() - t0,
                "errors": ours(b.get_stats()).get("tier_errors|redis", 0)}
    finally:
        b.close()


def slow_tier(root: str) -> dict[str, Any]:
    """Every tier call sleeps up to 2 s (the config's fault drill): each answer is a miss
    at its deadline (50 ms to look up, 200 ms to read or write), never a stalled thread."""
    path = write_config(root, "slow", {"local_cpu": True, "max_local_cpu_size": 0.01,
                                       "lookup_timeout_ms": 50, "load_timeout_ms": 200,
                                       "store_timeout_ms": 200},
                        faults={"rate": 1.0, "kinds": ["latency"], "latency_ms": 2000,
                                "seed": 1})
    b = backend(path)
    try:
        keys = hashes(2, seed=8)
        t0 = time.monotonic()
        exists = b.batch_exists(keys)
        t1 = time.monotonic()
        got = b.batch_get(keys, zeros(2))
        t2 = time.monotonic()
        return {"exists": exists, "exists_s": t1 - t0, "got": [g is None for g in got],
                "get_s": t2 - t1}
    finally:
        b.close()


def quota(root: str) -> dict[str, Any]:
    cfg = write_config(root, "quota", {"local_cpu": True, "max_local_cpu_size": 0.01},
                       {"declared": {"q": {"max_tier_bytes": {"memory": 2 * 2048}}}})
    b = backend(cfg, default_tenant="q")
    try:
        keys, data = hashes(3, seed=6), pages(3, seed=6)
        stored = [b.set(k, d) for k, d in zip(keys, data, strict=True)]
        stats = b.get_stats()
        return {"stored": stored, "exists": b.batch_exists(keys),
                "counters": ours(stats), "gauges": stats.kvplugin["gauges"]}
    finally:
        b.close()


def mamba_pool() -> MambaPoolHost:
    info = MambaStateBufferInfo(temporal=torch.zeros(2, 8, 4, 4),
                                conv=(torch.zeros(2, 8, 3, 4),))
    return MambaPoolHost(info, 2.0, 0, device_capacity=8, pin_memory=False, device="cpu",
                         layout="page_first")


def _hybrid(b: Any) -> dict[str, Any]:
    """v2 calls on a backend with SGLang's KV host pool and its Mamba host pool: four KV
    pages, Mamba states at the ends of pages 2 and 4 (a trailing-pages pool), existence
    checks with and without a hole, states and pages read back into other slots."""
    kv, mamba = host_pool("page_first"), mamba_pool()
    b.register_mem_pool_host(kv)
    b.register_mem_host_pool_v2(kv, PoolName.KV)
    b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
    keys, data = hashes(5, seed=11), pages(4, seed=11)
    kv_idx = torch.arange(0, 4 * PAGE)
    for i, d in enumerate(data):
        kv.set_from_flat_data_page(i * PAGE, d)
    states = [torch.randint(0, 255, (224,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(s)) for s in (1, 2)]
    for slot, st in zip((1, 2), states, strict=True):
        mamba.set_from_flat_data_page(slot, st)
    wrote = b.batch_set_v2([PoolTransfer(name=PoolName.KV, keys=keys[:4], host_indices=kv_idx)])
    wrote.update(b.batch_set_v2([PoolTransfer(name=PoolName.MAMBA, keys=[keys[1], keys[3]],
                                              host_indices=torch.tensor([1, 2]))]))

    def exists(n: int, policy: PoolHitPolicy, trailing: int = 1) -> dict[str, Any]:
        r = b.batch_exists_v2(keys[:n], [PoolTransfer(
            name=PoolName.MAMBA, keys=keys[n - trailing:n], hit_policy=policy)])
        return {"kv_hit_pages": r.kv_hit_pages, "extra": {str(k): v for k, v in
                                                          r.extra_pool_hit_pages.items()},
                "restorable": r.restorable_prefix_pages}

    checks = {"trailing4": exists(4, PoolHitPolicy.TRAILING_PAGES),
              "trailing5_hole": exists(5, PoolHitPolicy.TRAILING_PAGES),
              "trailing3": exists(3, PoolHitPolicy.TRAILING_PAGES),
              "window2": exists(4, PoolHitPolicy.TRAILING_PAGES, 2),
              "all_pages": exists(4, PoolHitPolicy.ALL_PAGES)}
    read = b.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, keys=[keys[3], keys[0]],
                                        host_indices=torch.tensor([6, 7])),
                           PoolTransfer(name=PoolName.KV, keys=keys[:2],
                                        host_indices=torch.arange(8 * PAGE, 10 * PAGE))])
    return {"wrote": {str(k): v for k, v in wrote.items()}, **checks,
            "read": {str(k): v for k, v in read.items()},
            "state_exact": torch.equal(mamba.get_data_page(6, flat=True), states[1]),
            "kv_exact": [torch.equal(kv.get_data_page((8 + i) * PAGE, flat=True), data[i])
                         for i in range(2)]}


def hybrid(root: str) -> dict[str, Any]:
    """The v2 calls on SGLang's HiCacheFile and on kvplugin: the same answers."""
    ref = HiCacheFile(storage_config({"file_storage_path": f"{root}/hicache-file"}))
    kvp = backend(write_config(root, "hyb", {"local_disk": f"file://{root}/disk"}))
    try:
        return {"file": _hybrid(ref), "kvplugin": _hybrid(kvp)}
    finally:
        kvp.close()


SCENARIOS = {f.__name__: f for f in (docs_factory, roundtrip, differential, injector,
                                     tenants, dead_redis, slow_tier, quota, hybrid)}


def _run(name: str, param: str, root: str) -> dict[str, Any]:
    return v1(root, param) if name == "v1" else SCENARIOS[name](root)


if __name__ == "__main__":
    sys.exit(scenario_testlib.scenario_main(sys.argv[1:], "kvplugin-sglang-", _run))
