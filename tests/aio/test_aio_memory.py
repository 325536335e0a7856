"""Host KV memory's copy-out: a private, read-only, exact copy of gathered rows."""

from __future__ import annotations

import numpy as np
import pytest

from kvplugin.aio.memory import HostKVMemory, PageShape


def _mem() -> HostKVMemory:
    return HostKVMemory(6, [PageShape(block_size=4, num_layers=2, num_kv_heads=2, head_size=4,
                                      dtype="float16")])


def test_copy_out_gathers_in_the_order_asked_and_owns_its_bytes() -> None:
    mem = _mem()
    width = mem.page_bytes(0)
    for b in range(1, 6):
        mem.copy_in(0, [b], bytes([b]) * width)
    rows = mem.copy_out(0, [4, 2, 5])
    assert rows.shape == (3, width) and rows.dtype == np.uint8
    assert [int(r[0]) for r in rows] == [4, 2, 5] and all((r == r[0]).all() for r in rows)
    assert not rows.flags.writeable  # a store's payload: nobody may change it under the I/O
    with pytest.raises(ValueError):
        rows[0, 0] = 9
    mem.copy_in(0, [4, 2, 5], bytes(3 * width))  # the blocks are reused right after
    assert [int(r[0]) for r in rows] == [4, 2, 5]
    assert not np.shares_memory(rows, mem.pages(0, [1, 2, 3, 4, 5]))


def test_copy_out_checks_ids_like_every_other_access() -> None:
    mem = _mem()
    for bad in ([0], [6], [], [1.0]):
        with pytest.raises(ValueError):
            mem.copy_out(0, bad)  # type: ignore[list-item]
    with pytest.raises(ValueError, match="group"):
        mem.copy_out(1, [1])


def test_an_mla_page_holds_the_latent_alone_under_its_own_fingerprint() -> None:
    from kvplugin.aio.keys import KeySpace
    from kvplugin.core.specs import FullAttentionSpec, KVCacheGroupSpec, MLAAttentionSpec

    mla = PageShape.of_group(KVCacheGroupSpec(["a", "b"], MLAAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16")))
    assert mla == PageShape(2, 1, 64, "bfloat16", 16, kv_parts=1)
    assert mla.dims == (1, 2, 16, 1, 64) and mla.page_bytes == 2 * 16 * 64 * 2
    assert mla.kind == "full"  # it decides like full attention
    full = PageShape.of_group(KVCacheGroupSpec(["a", "b"], FullAttentionSpec(
        block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16")))
    assert full.dims == (2, 2, 16, 1, 64)
    # Never the same namespace: an MLA latent is no K/V page of any shape.
    assert (KeySpace("m", [mla], 16).groups[0].layout
            != KeySpace("m", [full], 16).groups[0].layout)
    with pytest.raises(ValueError, match="kv_parts"):
        PageShape(2, 1, 64, "bfloat16", 16, kv_parts=3)
