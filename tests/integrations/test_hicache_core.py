"""The engine-independent half of the SGLang HiCache backend (``_hicache.HiCacheCore``) on
real kvplugin tiers, without SGLang: pages as numpy arrays. SGLang's own classes drive it in
test_sglang_hicache.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvplugin.integrations._hicache import (
    HiCacheCore,
    PageIdentity,
    PoolQuery,
    PoolShape,
    pool_hits,
)

H = [f"{i:064x}" for i in range(1, 5)]  # SGLang's page hashes are SHA-256 hex


def _core(tmp_path: Path, **offload: object) -> HiCacheCore:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"offload": {"local_cpu": True, "local_disk": None,
                                           **offload}}))
    return HiCacheCore(str(cfg), PageIdentity(model="m", tp=(0, 2)))


def test_pages_round_trip_and_keys_name_rank_dtype_and_layout(tmp_path: Path) -> None:
    core = _core(tmp_path)
    try:
        t = core.tenant(None)
        pages = [np.arange(256, dtype=np.uint16) + i for i in range(3)]
        assert core.put_pages(t, H[:3], pages, "uint16") == [True] * 3
        assert core.exists_prefix(t, H) == 3
        got = core.get_pages(t, H, [512] * 4, "uint16")
        assert [g is None for g in got] == [False, False, False, True]
        assert all(np.array_equal(np.frombuffer(g, np.uint16), p)
                   for g, p in zip(got, pages, strict=False) if g is not None)
        # Another dtype or size read is a miss, counted.
        assert core.get_pages(t, H[:1], [512], "float16") == [None]
        assert core.get_pages(t, H[:1], [256], "uint16") == [None]
        assert core.refused_objects == 2
        before = core.keys(t, H[:1])[0].id
        core.set_pool("kv", PoolShape("bfloat16", "page_first", 16, 512))
        assert core.keys(t, H[:1])[0].id != before  # the pool's dtype and layout name keys
        assert core.exists_prefix(t, H) == 0
    finally:
        core.release()


def test_identities_differ_by_rank_except_mla(tmp_path: Path) -> None:
    s = PoolShape("bfloat16", "layer_first", 16, 2048)
    a, b = PageIdentity(model="m", tp=(0, 2)), PageIdentity(model="m", tp=(1, 2))
    assert a.fingerprint("kv", s) != b.fingerprint("kv", s)
    ma = PageIdentity(model="m", tp=(0, 2), mla=True)
    mb = PageIdentity(model="m", tp=(1, 2), mla=True)
    assert ma.fingerprint("kv", s) == mb.fingerprint("kv", s)
    assert ma.fingerprint("mamba", s) != mb.fingerprint("mamba", s)  # states are sharded
    assert a.fingerprint("kv", s) != a.fingerprint("kv", PoolShape("float16", "layer_first",
                                                                  16, 2048))


def test_delete_stored_drops_only_this_backends_pages(tmp_path: Path) -> None:
    core = _core(tmp_path)
    try:
        t = core.tenant(None)
        assert core.put_pages(t, H[:2], [np.zeros(8, np.uint8)] * 2, "uint8") == [True] * 2
        assert core.delete_stored() == 2 and core.exists_prefix(t, H[:2]) == 0
    finally:
        core.release()


def test_the_module_imports_without_sglang_and_building_it_names_sglang() -> None:
    import importlib.util

    if importlib.util.find_spec("sglang") is not None:
        pytest.skip("SGLang is installed here")
    from kvplugin.integrations.sglang import KVPluginHiCacheStorage

    with pytest.raises(ImportError, match="SGLang"):
        KVPluginHiCacheStorage(None, {})


def test_a_key_the_backend_cannot_enforce_fails_its_construction(tmp_path: Path) -> None:
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"offload": {"local_cpu": True},
                               "tenants": {"declared": {"a": {"max_blocks_in_use": 1000}}}}))
    with pytest.raises(ValueError, match="max_blocks_in_use: device block quotas belong to "
                                         "SGLang's scheduler"):
        HiCacheCore(str(cfg), PageIdentity(model="m"))


@pytest.mark.parametrize(("kv", "pools", "want"), [
    (0, [], (0, {}, [])),
    (4, [], (4, {"kv": 4}, [1, 2, 3, 4])),
    # all_pages: a hole at page 2 cuts the prefix to 2.
    (4, [PoolQuery("dsa", "all_pages", 1, (True, True, False, True))],
     (2, {"kv": 4, "dsa": 2}, [1, 2])),
    # trailing_pages, a window of 1: a Mamba state at pages 2 and 4 only: 4 is restorable,
    # 3 is not, the usable prefix is 4.
    (4, [PoolQuery("mamba", "trailing_pages", 1, (False, True, False, True))],
     (4, {"kv": 4, "mamba": 4}, [2, 4])),
    # A window of 2 needs the two last pages.
    (4, [PoolQuery("swa", "trailing_pages", 2, (False, True, True, False))],
     (3, {"kv": 4, "swa": 3}, [3])),
    (3, [PoolQuery("mamba", "trailing_pages", 1, (False, False, False))],
     (0, {"kv": 3}, [])),
])
def test_pool_hits_follow_sglangs_policies(kv: int, pools: list[PoolQuery],
                                           want: tuple[int, dict[str, int], list[int]]
                                           ) -> None:
    assert pool_hits(kv, pools) == want


def test_an_unknown_hit_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="hit policy 'block_groups' is not served"):
        pool_hits(2, [PoolQuery("c", "block_groups", 1, (True, True))])
