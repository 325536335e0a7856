"""``offload.chunk_size``: a fixed size, ``auto`` (the smallest multiple of every group's
block size at or above ``offload.chunk_target_tokens``) and unset (auto under vLLM, 16 in
kvplugin's engine); the keys a size gives are the same in both engines."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from kvplugin.aio.keys import KeySpace
from kvplugin.aio.memory import PageShape
from kvplugin.config import (
    AUTO_CHUNK_TARGET,
    NATIVE_CHUNK_SIZE,
    KVPluginConfig,
    resolve_chunk_size,
)
from kvplugin.integrations import _runtime
from kvplugin.plugin import offload_config


@pytest.mark.parametrize(("block", "groups", "target", "want"), [
    (32, (), 128, 128),  # vLLM on CPU: four blocks
    (16, (), 128, 128),  # on a GPU: eight
    (32, (), 100, 128),  # rounded up to whole blocks
    (128, (128,), 128, 128),  # a small-mixer FalconH1: vLLM's block is already 128
    (2112, (2112,), 128, 2112),  # FalconH1's default mixer: one block is the least
    (32, (48,), 128, 192),  # a group with its own block size: the LCM's multiple (96 x 2)
    (16, (), 1, 16),
])
def test_auto_is_the_smallest_multiple_of_every_block_size_at_the_target(
        block: int, groups: tuple[int, ...], target: int, want: int) -> None:
    assert resolve_chunk_size("auto", block, groups, unset=16, target=target) == want


def test_a_fixed_size_is_kept_or_refused_in_one_line() -> None:
    assert resolve_chunk_size(256, 32, unset="auto") == 256
    assert resolve_chunk_size(None, 32, unset=64) == 64
    assert resolve_chunk_size(None, 32, unset="auto") == AUTO_CHUNK_TARGET
    with pytest.raises(ValueError) as e:
        resolve_chunk_size(64, 128, (128,), unset="auto", unit_name="vLLM's block size")
    assert str(e.value) == "offload.chunk_size 64 is not a multiple of vLLM's block size 128"
    for bad in (0, -32, "big", 32.0):
        with pytest.raises(ValueError, match="positive int or 'auto'"):
            resolve_chunk_size(bad, 32, unset="auto")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="block sizes must be positive ints"):
        resolve_chunk_size("auto", 0, unset="auto")


def _config(offload: dict[str, object], block_size: int = 16) -> KVPluginConfig:
    return KVPluginConfig.model_validate({"layout": {"block_size": block_size},
                                          "offload": offload})


def test_the_native_engine_resolves_it_against_its_layout() -> None:
    assert _config({}).chunk_tokens() == NATIVE_CHUNK_SIZE  # unset: as before auto existed
    auto = _config({"chunk_size": "auto"})
    assert auto.chunk_tokens() == 128 and offload_config(auto).chunk_blocks == 8
    assert _config({"chunk_size": "auto", "chunk_target_tokens": 200}).chunk_tokens() == 208
    assert offload_config(_config({"chunk_size": 48})).chunk_blocks == 3
    with pytest.raises(ValidationError, match=r"offload\.chunk_size 24 is not a multiple of "
                                          r"layout\.block_size 16"):
        _config({"chunk_size": 24})
    for bad in (0, "big"):
        with pytest.raises(ValidationError, match="chunk_size"):
            _config({"chunk_size": bad})


def test_vllm_takes_auto_when_unset_and_keys_match_the_native_managers() -> None:
    shape = PageShape(num_layers=2, num_kv_heads=2, head_size=32, block_size=32,
                           dtype="float32")
    unset = _config({})  # the vLLM connector's configs may leave it out
    assert _runtime.chunk_tokens_for(unset, 32) == AUTO_CHUNK_TARGET
    assert _runtime.chunk_tokens_for(unset, 128, [128]) == 128
    with pytest.raises(ValueError, match=r"^offload\.chunk_size 64 is not a multiple of vLLM's "
                                         r"block size 128$"):
        _runtime.chunk_tokens_for(_config({"chunk_size": 64}), 128, [128])
    ks = _runtime.keyspace_for(unset, [shape], 32, 32)
    native = KeySpace(unset.model.name, [shape], 32, AUTO_CHUNK_TARGET // 32)
    assert ks.groups == native.groups and ks.groups[0].chunk_blocks == 4
    hashes = [bytes([i]) * 32 for i in range(8)]
    assert (ks.chunk_keys("t", 0, hashes, 0, 2) == native.chunk_keys("t", 0, hashes, 0, 2))
