"""One manager class per attention family, chosen by the spec's type."""

from __future__ import annotations

import importlib

from kvplugin.core.single_type.base import SingleTypeKVCacheManager
from kvplugin.core.specs import (
    ChunkedLocalAttentionSpec,
    CrossAttentionSpec,
    FullAttentionSpec,
    KVCacheSpec,
    MambaSpec,
    SlidingWindowSpec,
)

# spec type -> "module:Class" (imported on first use so each family stays its own module)
_REGISTRY: dict[type[KVCacheSpec], str] = {
    FullAttentionSpec: "kvplugin.core.single_type.full:FullAttentionManager",
    SlidingWindowSpec: "kvplugin.core.single_type.sliding_window:SlidingWindowManager",
    ChunkedLocalAttentionSpec:
        "kvplugin.core.single_type.chunked_local:ChunkedLocalAttentionManager",
    MambaSpec: "kvplugin.core.single_type.mamba:MambaManager",
    CrossAttentionSpec: "kvplugin.core.single_type.cross_attention:CrossAttentionManager",
}


class UnsupportedSpecError(ValueError):
    """No manager is registered (or implemented) for a spec type."""


def manager_class_for(spec: KVCacheSpec) -> type[SingleTypeKVCacheManager]:
    for klass in type(spec).__mro__:
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
