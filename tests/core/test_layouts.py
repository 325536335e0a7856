"""Layouts that cannot work are rejected when the manager is built, with a clear message."""

from __future__ import annotations

import pytest

from kvplugin.core.manager import KVCacheManager
from kvplugin.core.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    EncoderOnlyAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    resolve_kv_cache_block_sizes,
)


def _manager(*specs: KVCacheSpec, caching: bool = True, eagle: bool = False,
             **kw: int) -> KVCacheManager:
    cfg = KVCacheConfig(num_blocks=32, kv_cache_groups=[
        KVCacheGroupSpec([f"l{i}"], s) for i, s in enumerate(specs)])
    sbs, hbs = resolve_kv_cache_block_sizes(cfg, specs[0].block_size, enable_caching=caching)
    return KVCacheManager(cfg, max_model_len=1024, scheduler_block_size=sbs, hash_block_size=hbs,
                          enable_caching=caching, use_eagle=eagle, **kw)


def test_chunked_local_with_eagle_is_rejected() -> None:
    with pytest.raises(ValueError, match="EAGLE is not supported with chunked local"):
        _manager(FullAttentionSpec(block_size=16),
                 ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64), eagle=True)
    with pytest.raises(ValueError, match="EAGLE is not supported with chunked local"):
        _manager(ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64), eagle=True)


def test_chunked_local_with_mixed_block_sizes_is_rejected() -> None:
    with pytest.raises(ValueError, match=r"block size \(8\) to equal the cache-hit alignment "
                                         r"\(32\)"):
        _manager(FullAttentionSpec(block_size=32),
                 ChunkedLocalAttentionSpec(block_size=8, attention_chunk_size=64))
    # Without prefix caching nothing is looked up, so the layout is fine.
    m = _manager(FullAttentionSpec(block_size=32),
                 ChunkedLocalAttentionSpec(block_size=8, attention_chunk_size=64), caching=False)
    assert type(m.coordinator).__name__ == "KVCacheCoordinatorNoPrefixCache"


def test_mamba_without_align_cannot_cache() -> None:
    with pytest.raises(ValueError, match="cannot prefix-cache"):
        _manager(FullAttentionSpec(block_size=16),
                 MambaSpec(block_size=1024, mamba_cache_mode="none"))
    _manager(FullAttentionSpec(block_size=16), MambaSpec(block_size=1024), caching=False)


def test_cross_and_encoder_only_groups() -> None:
    with pytest.raises(ValueError, match="cross-attention groups need prefix caching disabled"):
        _manager(FullAttentionSpec(block_size=16), CrossAttentionSpec(block_size=16))
    m = _manager(FullAttentionSpec(block_size=16), CrossAttentionSpec(block_size=16),
                 caching=False)
    assert [type(x).__name__ for x in m.coordinator.single_type_managers] == [
        "FullAttentionManager", "CrossAttentionManager"]
    with pytest.raises(ValueError, match="encoder-only layers need no KV cache"):
        _manager(FullAttentionSpec(block_size=16), EncoderOnlyAttentionSpec(block_size=16),
                 caching=False)


def test_context_parallelism_refuses_what_vllm_refuses() -> None:
    # Issue 13: DCP/PCP are supported; only vLLM's refused hybrid layouts are errors.
    with pytest.raises(ValueError, match="DCP with hybrid KV cache layouts"):
        _manager(FullAttentionSpec(block_size=16),
                 ChunkedLocalAttentionSpec(block_size=16, attention_chunk_size=64),
                 dcp_world_size=2)
