"""One manager class per attention family, chosen by the spec's type."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kvplugin.core.specs import (
    ChunkedLocalAttentionSpec,
    CircularBufferSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    RSWASpec,
    SinkFullAttentionSpec,
    SlidingWindowSpec,
)

if TYPE_CHECKING:  # each family's module is loaded on first use; the package alone is light
    from kvplugin.core.single_type.base import SingleTypeKVCacheManager

# spec type -> "module:Class" (imported on first use so each family stays its own module)
_REGISTRY: dict[type[KVCacheSpec], str] = {
    FullAttentionSpec: "kvplugin.core.single_type.full:FullAttentionManager",
    SlidingWindowSpec: "kvplugin.core.single_type.sliding_window:SlidingWindowManager",
    ChunkedLocalAttentionSpec:
        "kvplugin.core.single_type.chunked_local:ChunkedLocalAttentionManager",
    MambaSpec: "kvplugin.core.single_type.mamba:MambaManager",
    CrossAttentionSpec: "kvplugin.core.single_type.cross_attention:CrossAttentionManager",
    RSWASpec: "kvplugin.core.single_type.rswa:RSWAManager",
    CircularBufferSpec: "kvplugin.core.single_type.circular_buffer:CircularBufferManager",
}
# Spec kinds vLLM 0.33.0 itself cannot build a manager for: refused, with vLLM's reason.
_REFUSED: dict[type[KVCacheSpec], str] = {
    SinkFullAttentionSpec: "sink full attention cannot be built by vLLM 0.33.0 (its "
                           "coordinator passes needs_kv_cache_zeroing= to a manager __init__ "
                           "that does not accept it)",
}


class UnsupportedSpecError(ValueError):
    """No manager is registered (or implemented) for a spec type."""


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    for klass in type(spec).__mro__:
        if klass in _REFUSED:
            raise TypeError(f"{type(spec).__name__}: {_REFUSED[klass]}")
        target = _REGISTRY.get(klass)
        if target is None:
            continue
        module, _, name = target.partition(":")
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name != module:
                raise
            raise UnsupportedSpecError(
                f"KV-cache group kind {spec.kind!r} is not implemented yet") from None
        cls: type[SingleTypeKVCacheManager] = getattr(mod, name)
        return cls
    raise UnsupportedSpecError(f"no manager registered for {type(spec).__name__}")
