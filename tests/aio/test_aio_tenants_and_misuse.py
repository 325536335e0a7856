"""Tenant isolation on the device and in the tiers, host memory and keys, and misuse."""

from __future__ import annotations

import numpy as np
import pytest
from aio_testlib import (
    FakeModel,
    all_blocks,
    evict_device_cache,
    free_blocks,
    layout,
    make_manager,
    serve,
)

from kvplugin.aio.keys import KeySpace
from kvplugin.aio.manager import AsyncKVManager, device_salt
from kvplugin.aio.memory import HostKVMemory, PageShape
from kvplugin.aio.values import OffloadConfig
from kvplugin.connectors.keys import InvalidName
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.request import Request
from kvplugin.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    MambaSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
)

PROMPT = list(range(100, 130))


@pytest.mark.asyncio
async def test_tenants_with_identical_prompts_never_share_a_block() -> None:
    mem = MemoryConnector(capacity_bytes=16 << 20)
    async with make_manager(connector=mem) as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", PROMPT, tenant="acme")
        await serve(mgr, model, a)
        await mgr.drain()
        # Device: blocks of acme are cached, yet globex's identical prompt misses them.
        g = mgr.new_request("g", PROMPT, tenant="globex")
        found = await mgr.lookup(g)
        assert (found.local_tokens, found.external_tokens) == (0, 0)
        await serve(mgr, model, g, finish=False)
        assert model.check_pages(g, 28) == 7  # globex's own KV, not acme's
        mgr.finish(g)
        await mgr.drain()
        assert len(mem) == 14  # two namespaces, seven chunks each
        # Tiers: with the device cache gone, each tenant loads only its own chunks.
        evict_device_cache(mgr)
        for tenant in ("acme", "globex"):
            r = mgr.new_request(f"again-{tenant}", PROMPT, tenant=tenant)
            adm = await serve(mgr, model, r, finish=False)
            assert adm.external_tokens == 28 and model.check_pages(r, 28) == 7
            mgr.finish(r)
        # A third tenant finds nothing anywhere.
        evict_device_cache(mgr)
        i = mgr.new_request("i", PROMPT, tenant="initech")
        found = await mgr.lookup(i)
        assert (found.local_tokens, found.external_tokens) == (0, 0)
        mgr.finish(i)
        assert free_blocks(mgr) == all_blocks(mgr)


def test_tenant_keys_and_salts_are_disjoint() -> None:
    shapes = [PageShape(2, 2, 4, "float16", 4)]
    ks = KeySpace("org/m", shapes, 4)
    hashes = [bytes([i]) * 32 for i in range(4)]
    a = ks.chunk_keys("acme", 0, hashes, 0, 4)
    b = ks.chunk_keys("globex", 0, hashes, 0, 4)
    assert not {k.id for k in a} & {k.id for k in b}
    # Stable across instances (and processes: nothing but sha256 over the inputs).
    assert [k.id for k in KeySpace("org/m", shapes, 4).chunk_keys("acme", 0, hashes, 0, 4)] \
        == [k.id for k in a]
    # Another page shape is another layout, hence other keys.
    other = KeySpace("org/m", [PageShape(2, 2, 8, "float16", 4)], 4)
    assert other.chunk_keys("acme", 0, hashes, 0, 1)[0].id != a[0].id
    # Chunks of two blocks are keyed by their last block's hash.
    two = KeySpace("org/m", shapes, 4, chunk_blocks=2)
    assert two.namespaces("acme")[0].key(hashes[1]) == two.chunk_keys("acme", 0, hashes, 0, 1)[0]
    with pytest.raises(ValueError, match="not complete"):
        two.chunk_keys("acme", 0, hashes, 0, 3)
    assert device_salt("acme") != device_salt("acme", "") != device_salt("acmx", "")
    with pytest.raises(InvalidName):
        ks.namespaces("bad;tenant")


def test_host_memory_views_copies_and_bounds() -> None:
    mem = HostKVMemory.for_config(layout(8))
    assert mem.page_bytes(0) == 2 * 2 * 4 * 2 * 4 * 2
    rows = mem.pages(0, [3, 4])
    assert np.shares_memory(rows, mem.pages(0, [3]))  # consecutive ids: a view
    rows[:] = 7
    assert (mem.copy_out(0, [4]) == 7).all()
    gathered = mem.pages(0, [5, 3])
    assert not np.shares_memory(gathered, rows)  # gathered: a copy
    snap = mem.copy_out(0, [3])
    mem.copy_in(0, [3], bytes(mem.page_bytes(0)))
    assert (snap == 7).all() and (mem.pages(0, [3]) == 0).all()
    with pytest.raises(ValueError, match="do not fill"):
        mem.copy_in(0, [3, 4], bytes(5))
    for bad in ([0], [8], []):
        with pytest.raises(ValueError):
            mem.pages(0, bad)
    with pytest.raises(ValueError, match="group"):
        mem.pages(1, [1])
    with pytest.raises(ValueError):
        PageShape(0, 2, 4, "float16", 4)
    with pytest.raises(ValueError, match="dtype"):
        PageShape(1, 2, 4, "float13", 4)


@pytest.mark.asyncio
async def test_misuse_raises_clear_errors() -> None:
    async with make_manager() as mgr:
        model = FakeModel(mgr)
        a = mgr.new_request("a", PROMPT, tenant="acme")
        b = mgr.new_request("b", PROMPT, tenant="acme")
        with pytest.raises(ValueError, match="already exists"):
            mgr.new_request("a", PROMPT, tenant="acme")
        with pytest.raises(InvalidName):
            mgr.new_request("z", PROMPT, tenant="no spaces")
        found_b = await mgr.lookup(b)
        with pytest.raises(ValueError, match="lookup of 'b'"):
            mgr.allocate(a, found_b)
        with pytest.raises(ValueError, match="holds no blocks"):
            mgr.preempt(a)
        found_a = await mgr.lookup(a)
        await serve(mgr, model, a, finish=False)
        with pytest.raises(ValueError, match="already holds blocks"):
            await mgr.lookup(a)
        with pytest.raises(ValueError, match="already holds blocks"):
            mgr.allocate(a, found_a)
        with pytest.raises(ValueError, match="no load"):
            await mgr.wait_load(b)
        mgr.finish(a)
        with pytest.raises(ValueError, match="not managed"):
            mgr.allocate(a)
        with pytest.raises(ValueError, match="not managed"):
            await mgr.lookup(Request("b", PROMPT))  # same id, not the managed object
        mgr.finish(b)


def _core(groups: list[KVCacheGroupSpec], caching: bool = True) -> KVCacheManager:
    return KVCacheManager(KVCacheConfig(num_blocks=8, kv_cache_groups=groups),
                          max_model_len=64, scheduler_block_size=4, hash_block_size=4,
                          enable_caching=caching)


def test_construction_rejects_what_cannot_be_offloaded() -> None:
    conn = MemoryConnector(capacity_bytes=1 << 20)
    cfg = OffloadConfig(model="org/m")
    full = KVCacheGroupSpec(["l0"], FullAttentionSpec(block_size=4))
    swa = KVCacheGroupSpec(["l1"], SlidingWindowSpec(block_size=4, sliding_window=8))
    local = KVCacheGroupSpec(["l2"], ChunkedLocalAttentionSpec(block_size=4,
                                                               attention_chunk_size=8))
    mamba = KVCacheGroupSpec(["m0"], MambaSpec(block_size=4, mamba_cache_mode="align"))
    AsyncKVManager(_core([full, swa]), conn, cfg)  # hybrid layouts are supported
    AsyncKVManager(_core([full, mamba]), conn, cfg)
    AsyncKVManager(_core([full, local]), conn, cfg)  # Llama 4's chunked local layers too
    swa_mla = KVCacheGroupSpec(["l3"], SlidingWindowMLASpec(block_size=4, sliding_window=8))
    AsyncKVManager(_core([full, swa_mla]), conn, cfg)  # its own kind (test_aio_group_kinds)
    replayed = KVCacheGroupSpec(["l3"], SlidingWindowMLASpec(block_size=4, sliding_window=8,
                                                             bounded_replay=True))
    with pytest.raises(ValueError, match="sliding_window_mla groups is not supported: bounded"):
        AsyncKVManager(_core([full, replayed]), conn, cfg)
    with pytest.raises(ValueError, match="at least one attention"):
        AsyncKVManager(_core([mamba]), conn, cfg)
    with pytest.raises(ValueError, match="prefix caching"):
        AsyncKVManager(_core([full], caching=False), conn, cfg)
    with pytest.raises(ValueError, match="below one chunk"):
        AsyncKVManager(_core([full]), conn, OffloadConfig(model="org/m", store_budget_bytes=1))
    with pytest.raises(ValueError, match="does not match"):
        AsyncKVManager(_core([full]), conn, cfg, memory=HostKVMemory.for_config(layout(8)))
    with pytest.raises(InvalidName):
        AsyncKVManager(_core([full]), conn, OffloadConfig(model="../etc"))
    for bad in ({"lookup_timeout": 0}, {"chunk_blocks": 0}, {"max_io": -1},
                {"load_timeout": float("inf")}):
        with pytest.raises(ValueError):
            OffloadConfig(model="org/m", **bad)
    with pytest.raises(TypeError):
        OffloadConfig(model="org/m", store_mode="copy")  # type: ignore[arg-type]
