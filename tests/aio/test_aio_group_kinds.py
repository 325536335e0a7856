"""The registry of offload group kinds: every core spec is served or refused with a reason,
the keys of every existing kind stay byte for byte what they were, sliding-window MLA is a
kind of its own (a native round trip through the async manager), and a new kind is one
registry entry that the plans, the keys and the host memory accept as it is."""

from __future__ import annotations

import inspect
import typing

import pytest
from aio_testlib import (
    MIB,
    FakeModel,
    clean,
    evict_device_cache,
    load_window_of_40,
    proceed,
    serve,
)
from layering_testlib import loaded_after

from kvplugin.aio import group_kinds, plans
from kvplugin.aio.group_kinds import GroupKind, PlanKind, SpecParams, UnsupportedGroupKind
from kvplugin.aio.keys import KeySpace
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.aio.memory import HostKVMemory, PageShape, StateShape, layout_of, shape_of_group
from kvplugin.aio.values import OffloadConfig
from kvplugin.config import GroupConfig
from kvplugin.connectors.keys import layout_fingerprint
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.core import specs as core_specs
from kvplugin.core.manager import KVCacheManager
from kvplugin.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    MambaSpec,
    MLAAttentionSpec,
    SlidingWindowMLASpec,
    SlidingWindowSpec,
    resolve_kv_cache_block_sizes,
)

P40 = list(range(100, 140))


def _group(spec: KVCacheSpec, layers: int = 2) -> KVCacheGroupSpec:
    return KVCacheGroupSpec([f"l{i}" for i in range(layers)], spec)


def test_every_core_spec_is_served_or_refused_with_a_reason() -> None:
    found = [c for _, c in inspect.getmembers(core_specs, inspect.isclass)
             if issubclass(c, KVCacheSpec) and c.__module__ == core_specs.__name__]
    assert len(found) >= 14  # the walk itself works
    served = {spec: k for k in group_kinds.kinds() for spec in k.specs}
    bad = []
    for cls in found:
        reason = group_kinds.REFUSED.get(cls, "")
        if (cls in served) == bool(reason.strip()):  # neither, or both
            bad.append(cls.__name__)
    assert not bad, f"neither served nor refused with a reason (or both): {bad}"


# The layout fingerprints the code gave every kind before the registry (computed with the
# if-chains it replaced): the namespaces, so the keys, of objects already in the tiers.
_SPECS = {
    "full": FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=8, dtype="float16"),
    "mla": MLAAttentionSpec(block_size=16, num_kv_heads=1, head_size=64, dtype="bfloat16"),
    "window": SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=8, dtype="float16",
                                sliding_window=64),
    "window_extra": SlidingWindowSpec(block_size=16, num_kv_heads=4, head_size=8,
                                      dtype="float32", sliding_window=64,
                                      extra_retained_tokens=3),
    "local": ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=8,
                                       dtype="float16", attention_chunk_size=128),
    "mamba": MambaSpec(block_size=32, shapes=((3, 16), (2, 8, 8)),
                       dtypes=("bfloat16", "float32"), mamba_cache_mode="align"),
}
_PINNED = {
    (1, "full"): "40cfd13a04e35ea470d617509818a8f0",
    (1, "mla"): "a0faabc8a0bcbe85ce7a859938468cd9",
    (1, "window"): "2a2f870ffce6915301c8c4282fd6c48d",
    (1, "window_extra"): "eac24bf1473e03fedb9427c98bafba7f",
    (1, "local"): "e27a98b7d040f7249b06a69632198084",
    (1, "mamba"): "d3e4476bb29f6922de041585f3f8940f",
    (4, "full"): "82f30121c18934b7363e3da4ba59f76e",
    (4, "mla"): "f0a092a2544146ab0280b09667454377",
    (4, "window"): "f52e475231f43e1d23ab8c5711cf315d",
    (4, "window_extra"): "14b878ba3ce64095a3147e423497f9bb",
    (4, "local"): "6d63f52d8df8ecd10df670cb8004e153",
    (4, "mamba"): "d3e4476bb29f6922de041585f3f8940f",  # a state has no chunks
}
_PLAN_KINDS = {"full": ("full", 0), "mla": ("full", 0), "window": ("window", 63),
               "window_extra": ("window", 66), "local": ("local", 128), "mamba": ("state", 0)}


@pytest.mark.parametrize(("chunk_blocks", "name"), sorted(_PINNED))
def test_fingerprints_of_the_existing_kinds_are_pinned(chunk_blocks: int, name: str) -> None:
    shape = shape_of_group(_group(_SPECS[name]))
    assert (shape.kind, shape.window_tokens) == _PLAN_KINDS[name]
    assert KeySpace("m", [shape], 16, chunk_blocks).groups[0].layout \
        == _PINNED[chunk_blocks, name]


def test_pages_built_field_by_field_get_the_kind_their_fields_describe() -> None:
    """Tests and tools build pages without naming a kind: the same kind, the same keys."""
    by_fields = {
        "full": PageShape(2, 2, 8, "float16", 16),
        "mla": PageShape(2, 1, 64, "bfloat16", 16, kv_parts=1),
        "window": PageShape(2, 4, 8, "float16", 16, window=64),
        "local": PageShape(2, 2, 8, "float16", 16, local_chunk=128),
        "mamba": StateShape(2, 608, 32, ((3, 16), (2, 8, 8)), ("bfloat16", "float32")),
    }
    for name, shape in by_fields.items():
        assert shape == shape_of_group(_group(_SPECS[name])), name
        assert KeySpace("m", [shape], 16).groups[0].layout == _PINNED[1, name]
    window_mla = PageShape(2, 1, 64, "bfloat16", 16, window=64, kv_parts=1)
    assert window_mla.family == "sliding_window_mla"
    # A kind that contradicts the page's fields is refused, never taken on trust.
    with pytest.raises(ValueError, match="sliding_window page has 2 K/V parts"):
        PageShape(2, 1, 64, "bfloat16", 16, window=64, kv_parts=1, family="sliding_window")


def _window_mla(window: int = 8, bounded_replay: bool = False) -> SlidingWindowMLASpec:
    return SlidingWindowMLASpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16",
                                sliding_window=window, bounded_replay=bounded_replay)


def test_window_mla_is_a_kind_of_its_own() -> None:
    spec = _window_mla(64)
    shape = shape_of_group(_group(spec))
    assert isinstance(shape, PageShape)
    assert shape.family == "sliding_window_mla" and shape.kv_parts == 1
    assert (shape.kind, shape.window_tokens) == ("window", 63)  # decides like a window
    fp = KeySpace("m", [shape], 4).groups[0].layout
    assert fp == layout_fingerprint(kind="sliding_window_mla", dtype="float16",
                                    dims=(1, 2, 4, 1, 8), page_bytes=2 * 4 * 8 * 2,
                                    chunk_blocks=1, window_tokens=63)
    # Neither the plain sliding window nor MLA of the same numbers.
    window = shape_of_group(_group(SlidingWindowSpec(
        block_size=4, num_kv_heads=1, head_size=8, dtype="float16", sliding_window=64)))
    mla = shape_of_group(_group(MLAAttentionSpec(block_size=4, num_kv_heads=1, head_size=8,
                                                 dtype="float16")))
    others = {KeySpace("m", [s], 4).groups[0].layout for s in (window, mla)}
    assert fp not in others and len(others) == 2
    with pytest.raises(UnsupportedGroupKind, match="bounded_replay: the group is never"):
        shape_of_group(_group(_window_mla(64, bounded_replay=True)))


def _window_mla_manager(connector: MemoryConnector) -> AsyncKVManager:
    full = KVCacheGroupSpec(["f.l0", "f.l1"], FullAttentionSpec(
        block_size=4, num_kv_heads=2, head_size=4, dtype="float16"))
    kv = KVCacheConfig(num_blocks=64, kv_cache_groups=[
        full, KVCacheGroupSpec(["o.l0", "o.l1"], _window_mla())])
    sbs, hbs = resolve_kv_cache_block_sizes(kv, 4)
    core = KVCacheManager(kv, max_model_len=1024, scheduler_block_size=sbs,
                          hash_block_size=hbs, log_stats=True)
    return AsyncKVManager(core, connector, OffloadConfig(model="org/tiny-window-mla"))


@pytest.mark.asyncio
async def test_window_mla_round_trip_loads_only_the_window() -> None:
    """Stored from one request, evicted from the device, loaded into the next: the latent
    pages of the window before the hit come back exactly, the rest stays null."""
    async with _window_mla_manager(MemoryConnector(capacity_bytes=16 * MIB)) as mgr:
        assert mgr.layout.kinds == ("full", "window")
        model = FakeModel(mgr)
        await serve(mgr, model, mgr.new_request("a", P40, tenant="acme"), budget=12)
        await mgr.drain()
        evict_device_cache(mgr)
        b = await load_window_of_40(mgr, model, P40)
        proceed(mgr, model, b)  # reads the loaded window: checked
        mgr.finish(b)
        await mgr.drain()
        clean(mgr)


# ----------------------------------------------------------------- a new kind: one entry


class _LocalMLASpec(ChunkedLocalAttentionSpec):
    """A kind the core module does not have: chunked local attention on MLA latents."""


def _sparse_skip(num_tokens: int, span: int, block_size: int) -> int:
    return num_tokens // span * span // block_size


_LOCAL_MLA = GroupKind(
    "chunked_local_mla", "chunked local MLA", (_LocalMLASpec,),
    PlanKind("local_mla", "chunks", _sparse_skip),
    page=lambda spec, dtype: {"num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
                              "dtype": dtype(spec.dtype), "block_size": spec.block_size,
                              "local_chunk": spec.attention_chunk_size},
    fingerprint=lambda page, cb: {"dtype": page.dtype, "dims": page.dims, "chunk_blocks": cb,
                                  "attention_chunk_size": page.local_chunk},
    kv_parts=1, span_field="local_chunk", span=lambda page: page.local_chunk)


def test_a_new_kind_is_one_registry_entry() -> None:
    spec = _LocalMLASpec(block_size=4, num_kv_heads=1, head_size=8, dtype="float16",
                         attention_chunk_size=16)
    full = shape_of_group(_group(FullAttentionSpec(block_size=4)))
    with pytest.raises(UnsupportedGroupKind, match="no offload kind is registered"):
        shape_of_group(_group(spec))
    group_kinds.register(_LOCAL_MLA)
    try:
        group_kinds.register(_LOCAL_MLA)  # the same entry again: harmless
        # memory: its page, its plan kind and span
        shape = shape_of_group(_group(spec))
        assert isinstance(shape, PageShape) and shape.dims == (1, 2, 4, 1, 8)
        assert (shape.family, shape.kind, shape.window_tokens) == ("chunked_local_mla",
                                                                  "local_mla", 16)
        assert HostKVMemory(8, [full, shape]).page_bytes(1) == 2 * 4 * 8 * 2
        # keys: its own fingerprint, from its own fields
        keys = KeySpace("m", [full, shape], 4)
        assert keys.groups[1].layout == layout_fingerprint(
            kind="chunked_local_mla", dtype="float16", dims=(1, 2, 4, 1, 8), chunk_blocks=1,
            attention_chunk_size=16)
        assert keys.groups[1].chunked
        # plans: a layout of it, with its skip rule
        layout = layout_of([full, shape], 1, 4)
        assert layout.kinds == ("full", "local_mla") and layout.has_null_blocks
        assert not layout.all_full
        loads = plans.load_plan(layout, 0, 40)
        assert [c.chunk for c in loads if c.group == 1] == [8, 9]  # [32, 40): its chunk
        # what is taken is refused twice over
        with pytest.raises(ValueError, match="already"):
            group_kinds.register(GroupKind("other", "other", (_LocalMLASpec,), group_kinds.FULL,
                                           _LOCAL_MLA.page, _LOCAL_MLA.fingerprint))
        with pytest.raises(ValueError, match="page key"):  # pages it could not tell apart
            group_kinds.register(GroupKind(
                "other", "other", (type("_Other", (ChunkedLocalAttentionSpec,), {}),),
                group_kinds.LOCAL, _LOCAL_MLA.page, _LOCAL_MLA.fingerprint, kv_parts=1,
                span_field="local_chunk", span=_LOCAL_MLA.span))
    finally:
        group_kinds.unregister("chunked_local_mla")
    with pytest.raises(ValueError, match="group kinds must be in"):
        plans.Layout((4, 4), 1, ("full", "local_mla"), (0, 16))
    with pytest.raises(UnsupportedGroupKind):
        shape_of_group(_group(spec))
    assert "local_mla" not in group_kinds.plan_kinds()


def test_every_configured_kind_builds_a_spec_its_kind_serves() -> None:
    configured = typing.get_args(GroupConfig.model_fields["kind"].annotation)
    for name in configured:
        params = SpecParams(block_size=16, num_kv_heads=2, head_size=8, dtype="float16",
                            sliding_window=32, attention_chunk_size=64, mamba_mode="align")
        spec = group_kinds.spec_of_config(name, params)
        assert group_kinds.of_spec(spec).config == name
    with pytest.raises(ValueError, match="needs sliding_window"):
        group_kinds.spec_of_config("sliding_window", SpecParams(16, 2, 8, "float16"))
    with pytest.raises(ValueError, match="no group kind is configured"):
        group_kinds.spec_of_config("rswa", SpecParams(16, 2, 8, "float16"))


def test_the_registry_and_the_plans_load_without_numpy_or_pyarrow() -> None:
    loaded = loaded_after("kvplugin.aio.group_kinds", "kvplugin.aio.plans")
    assert not {m for m in loaded if m.split(".")[0] in ("numpy", "pyarrow")}
