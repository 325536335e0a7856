"""The registry of the KV-cache group kinds offload serves, and of those it refuses.

One entry (:class:`GroupKind`) per kind says everything offload does differently for it:
the core spec types it serves (an exact type match, so a subclass never inherits a parent's
page or fingerprint: sliding-window MLA is its own entry, not a sliding window and not MLA),
its settings offload cannot serve (``refuse``), how the pure plans treat it
(:class:`PlanKind`: stored as chunks of blocks or as one state per boundary, and which
leading blocks the core leaves null), its host page (``page``, built by
:mod:`kvplugin.aio.memory`), the layout-fingerprint fields its keys are namespaced by
(``fingerprint``; the fingerprint's ``kind`` is the entry's name), the vLLM spec classes the
vLLM connector maps to it (:mod:`kvplugin.integrations._groups`), and the deployment
config's group kind that builds its spec (:mod:`kvplugin.layouts`).

Every other spec type of :mod:`kvplugin.core.specs` is refused with its reason
(:data:`REFUSED`), and a test walks that module so a new spec type cannot go unnoticed. A
new attention kind is one :func:`register` call: :mod:`~kvplugin.aio.plans`,
:mod:`~kvplugin.aio.keys`, :mod:`~kvplugin.aio.memory` and the vLLM connector read this
registry and compare no kind names of their own.

Pure: the standard library and the core's specs only (no numpy, no pyarrow), so the plans
stay importable alone.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Literal

from kvplugin.core import specs as core

__all__ = ["CHUNKED_LOCAL", "CONV_WIDTH", "D_STATE", "FULL", "FULL_ATTENTION", "LOCAL",
           "MAMBA_STATE", "MLA_ATTENTION", "REFUSED", "SLIDING_WINDOW", "SLIDING_WINDOW_MLA",
           "STATE", "WINDOW", "GroupKind", "PlanKind", "SpecParams", "UnsupportedGroupKind",
           "get", "kind_of_page", "kinds", "of_spec", "plan_kind", "plan_kinds", "register",
           "served_labels", "spec_of_config", "unregister"]

Restore = Literal["chunks", "state"]
Dtype = Callable[[Any], str]  # a spec's dtype as a kvplugin dtype name


class UnsupportedGroupKind(ValueError):
    """A group offload cannot serve (the message says why)."""


# --------------------------------------------------------------------------- plan kinds


@dataclass(frozen=True, slots=True)
class PlanKind:
    """How the pure plans (:mod:`kvplugin.aio.plans`) treat a group; ``name`` is what
    ``plans.Layout.kinds`` holds.

    ``restore``: ``"chunks"`` (a hit at N loads chunks of blocks up to N) or ``"state"``
    (a hit at N loads the one object stored at exactly N). ``skipped(num_tokens, span,
    block_size)``: the leading blocks the core leaves null at ``num_tokens`` computed tokens
    for a group with a token span (a window, an attention chunk); None: the kind has no
    span and needs every block before a hit. ``resume_anywhere``: any verified prefix is a
    valid resume point after a partly failed load (not so where the core sized a window or a
    state slot for the claimed end)."""

    name: str
    restore: Restore
    skipped: Callable[[int, int, int], int] | None = None
    resume_anywhere: bool = False

    @property
    def chunked(self) -> bool:
        return self.restore == "chunks"

    @property
    def spanned(self) -> bool:
        """The group has (and needs) a token span: blocks before a hit may be null."""
        return self.skipped is not None

    def skipped_blocks(self, num_tokens: int, span: int, block_size: int) -> int:
        return 0 if self.skipped is None else self.skipped(num_tokens, span, block_size)


def _window_skip(num_tokens: int, span: int, block_size: int) -> int:
    # The core's get_num_skipped_tokens: what left the window of the next token.
    return max(0, num_tokens - span) // block_size


def _local_skip(num_tokens: int, span: int, block_size: int) -> int:
    # Chunked local attention attends within its own chunk, [N // C * C, N).
    return num_tokens // span * span // block_size


FULL = PlanKind("full", "chunks", resume_anywhere=True)
WINDOW = PlanKind("window", "chunks", _window_skip)
LOCAL = PlanKind("local", "chunks", _local_skip)
STATE = PlanKind("state", "state")


# --------------------------------------------------------------------------- group kinds


@dataclass(frozen=True, slots=True)
class SpecParams:
    """What a deployment config says about one group (:func:`kvplugin.layouts.group_spec`
    fills it in from the model and layout sections)."""

    block_size: int
    num_kv_heads: int
    head_size: int
    dtype: str
    sliding_window: int | None = None
    attention_chunk_size: int | None = None
    mamba_mode: str = "none"
    num_speculative_blocks: int = 0


@dataclass(frozen=True, slots=True)
class GroupKind:
    """One kind of group offload serves (see the module docstring).

    ``page(spec, dtype)``: the fields of the group's host page (``PageShape``'s, or
    ``StateShape``'s for a state kind) but its layer count, read from a core spec or from
    vLLM's (whose attribute names are the same; ``dtype`` turns the spec's dtype into a
    name). ``kv_parts``: a page's K/V axis (2: K and V; 1: one latent, MLA; 0: a state).
    ``span_field`` / ``span``: the page field holding the token span and the span in
    tokens the plans use (``plans.Layout.window_tokens``). ``fingerprint(page,
    chunk_blocks)``: the layout-fingerprint fields besides ``kind=name``; changing them
    changes every key of the kind's stored objects. ``inferable``: a page built field by
    field (no kind named) is this kind when its K/V parts and span field match, a pair
    registration keeps unique. ``vllm``: vLLM's ``kv_cache_interface`` class names the
    vLLM connector serves as this kind (exact type). ``config`` / ``spec_of``: the
    deployment config's ``layout.groups[].kind`` building this kind's core spec."""

    name: str
    label: str  # in messages: "sliding-window"
    specs: tuple[type[core.KVCacheSpec], ...]
    plan: PlanKind
    page: Callable[[Any, Dtype], dict[str, Any]]
    fingerprint: Callable[[Any, int], dict[str, object]]
    kv_parts: int = 2
    span_field: str = ""
    span: Callable[[Any], int] | None = None
    refuse: Callable[[Any], str | None] = lambda spec: None
    inferable: bool = True
    vllm: tuple[str, ...] = ()
    config: str | None = None
    spec_of: Callable[[SpecParams], core.KVCacheSpec] | None = None

    def __post_init__(self) -> None:
        if not self.specs:
            raise ValueError(f"group kind {self.name!r} serves no spec type")
        if (self.kv_parts == 0) == self.plan.chunked:
            raise ValueError(f"group kind {self.name!r}: a state kind (and only one) has no "
                             "K/V parts")
        if self.plan.spanned != (self.span is not None and bool(self.span_field)):
            raise ValueError(f"group kind {self.name!r}: a span (field and tokens) goes with "
                             f"a plan kind that skips blocks, and only with one")
        if (self.config is None) != (self.spec_of is None):
            raise ValueError(f"group kind {self.name!r}: config and spec_of go together")

    @property
    def page_key(self) -> tuple[int, str] | None:
        """(K/V parts, span field): what a page built field by field is recognised by."""
        return (self.kv_parts, self.span_field) if self.inferable else None

    def span_tokens(self, page: Any) -> int:
        return 0 if self.span is None else self.span(page)


def _attention_page(spec: Any, dtype: Dtype) -> dict[str, Any]:
    return {"num_kv_heads": spec.num_kv_heads, "head_size": spec.head_size,
            "dtype": dtype(spec.dtype), "block_size": spec.block_size}


def _window_page(spec: Any, dtype: Dtype) -> dict[str, Any]:
    return {**_attention_page(spec, dtype), "window": spec.sliding_window,
            "extra_retained": spec.extra_retained_tokens}


def _local_page(spec: Any, dtype: Dtype) -> dict[str, Any]:
    return {**_attention_page(spec, dtype), "local_chunk": spec.attention_chunk_size}


def _state_page(spec: Any, dtype: Dtype) -> dict[str, Any]:
    # The layer's bytes follow from the tensors (memory.StateShape.of_tensors).
    return {"block_size": spec.block_size,
            "shapes": tuple(tuple(int(d) for d in s) for s in spec.shapes),
            "dtypes": tuple(dtype(d) for d in spec.dtypes)}


def _page_fields(page: Any, chunk_blocks: int) -> dict[str, object]:
    # Slice 1's fields exactly: objects stored before hybrid support still match.
    return {"dtype": page.dtype, "dims": page.dims, "page_bytes": page.page_bytes,
            "chunk_blocks": chunk_blocks}


def _window_fields(page: Any, chunk_blocks: int) -> dict[str, object]:
    return {**_page_fields(page, chunk_blocks), "window_tokens": page.window_tokens}


def _local_fields(page: Any, chunk_blocks: int) -> dict[str, object]:
    return {**_page_fields(page, chunk_blocks), "attention_chunk_size": page.local_chunk}


def _state_fields(page: Any, chunk_blocks: int) -> dict[str, object]:
    # One object per boundary: no chunk_blocks; the tensors say what the bytes mean.
    return {"dims": page.dims, "page_bytes": page.page_bytes, "block_size": page.block_size,
            "tensors": page.shapes, "dtypes": page.dtypes}


def _window_span(page: Any) -> int:
    # The tokens kept behind the next one (its own position aside).
    return int(page.window - 1 + page.extra_retained)


def _local_span(page: Any) -> int:
    return int(page.local_chunk)


def _needs(p: SpecParams, name: str, value: int | None) -> int:
    if value is None:  # the config's validator demands it; a direct caller may not
        raise ValueError(f"a {name} group needs {name}")
    return value


def _full_spec(p: SpecParams) -> core.KVCacheSpec:
    return core.FullAttentionSpec(block_size=p.block_size, num_kv_heads=p.num_kv_heads,
                             head_size=p.head_size, dtype=p.dtype)


def _mla_spec(p: SpecParams) -> core.KVCacheSpec:
    # DeepSeek / Kimi: one latent per token, shared by the heads.
    return core.MLAAttentionSpec(block_size=p.block_size, num_kv_heads=1, head_size=p.head_size,
                            dtype=p.dtype)


def _window_spec(p: SpecParams) -> core.KVCacheSpec:
    return core.SlidingWindowSpec(block_size=p.block_size, num_kv_heads=p.num_kv_heads,
                             head_size=p.head_size, dtype=p.dtype,
                             sliding_window=_needs(p, "sliding_window", p.sliding_window))


def _local_spec(p: SpecParams) -> core.KVCacheSpec:
    chunk = _needs(p, "chunked_local", p.attention_chunk_size)
    return core.ChunkedLocalAttentionSpec(block_size=p.block_size, num_kv_heads=p.num_kv_heads,
                                     head_size=p.head_size, dtype=p.dtype,
                                     attention_chunk_size=chunk)


CONV_WIDTH = 4  # a Mamba-2 causal convolution's kernel: it keeps 3 inputs as state
D_STATE = 8  # SSM state size per head dimension (small: states are stored per boundary)


def _mamba_spec(p: SpecParams) -> core.KVCacheSpec:
    # A Mamba-2 layer's state from the model's numbers: the convolution's inputs in the
    # model's dtype, the SSM state in float32 (real states mix dtypes, and the tiers must
    # carry them byte for byte).
    return core.MambaSpec(block_size=p.block_size,
                     shapes=((CONV_WIDTH - 1, p.num_kv_heads * p.head_size),
                             (p.num_kv_heads, p.head_size, D_STATE)),
                     dtypes=(p.dtype, "float32"), mamba_cache_mode=p.mamba_mode,
                     num_speculative_blocks=p.num_speculative_blocks)


def _bounded_replay(spec: Any) -> str | None:
    if getattr(spec, "bounded_replay", False):
        return ("bounded_replay: the group is never prefix-cached (the engine replays its "
                "window after a hit instead), so no claim could cover it")
    return None


def _not_align(spec: Any) -> str | None:
    mode = getattr(spec, "mamba_cache_mode", None)
    if mode != "align":
        return f"only Mamba 'align' states are offloaded (mamba_cache_mode={mode!r})"
    return None


FULL_ATTENTION = GroupKind(
    "full_attention", "full-attention", (core.FullAttentionSpec,), FULL, _attention_page,
    _page_fields, vllm=("FullAttentionSpec",), config="full", spec_of=_full_spec)
MLA_ATTENTION = GroupKind(
    # Decides like full attention; its page is the latent alone, under its own fingerprint.
    "mla_attention", "MLA", (core.MLAAttentionSpec,), FULL, _attention_page, _page_fields,
    kv_parts=1, vllm=("MLAAttentionSpec",), config="mla", spec_of=_mla_spec)
SLIDING_WINDOW = GroupKind(
    "sliding_window", "sliding-window", (core.SlidingWindowSpec,), WINDOW, _window_page,
    _window_fields, span_field="window", span=_window_span, vllm=("SlidingWindowSpec",),
    config="sliding_window", spec_of=_window_spec)
SLIDING_WINDOW_MLA = GroupKind(
    # Decides like a sliding window (docs/core-spec-extensions.md), pages like MLA. Not on
    # the vLLM side: vLLM's SlidingWindowMLASpec pages may carry DeepSeek-V4 alignment
    # padding or a packed cache dtype, and no vLLM scenario covers them.
    "sliding_window_mla", "sliding-window MLA", (core.SlidingWindowMLASpec,), WINDOW,
    _window_page, _window_fields, kv_parts=1, span_field="window", span=_window_span,
    refuse=_bounded_replay)
CHUNKED_LOCAL = GroupKind(
    # Llama 4's local layers: they attend within their own attention chunk.
    "chunked_local", "chunked local", (core.ChunkedLocalAttentionSpec,), LOCAL, _local_page,
    _local_fields, span_field="local_chunk", span=_local_span,
    vllm=("ChunkedLocalAttentionSpec",), config="chunked_local", spec_of=_local_spec)
MAMBA_STATE = GroupKind(
    "mamba_state", "Mamba 'align'", (core.MambaSpec,), STATE, _state_page, _state_fields,
    kv_parts=0, refuse=_not_align, vllm=("MambaSpec",), config="mamba", spec_of=_mamba_spec)

_ABSTRACT = "an abstract base: a group's spec is one of its subclasses"
REFUSED: Mapping[type[core.KVCacheSpec], str] = MappingProxyType({
    core.KVCacheSpec: _ABSTRACT,
    core.AttentionSpec: _ABSTRACT,
    core.HiddenStateCacheSpec: "hidden-state cache layers (vLLM's extract_hidden_states) hold a "
                          "model's hidden states for extraction, not attention KV a later "
                          "request resumes from",
    core.RSWASpec: "R-SWA frees the decode blocks between each request's own prompt and its last "
              "rswa_window tokens: no plan kind says which blocks a hit needs",
    core.CircularBufferSpec: "a per-request scratch ring, never prefix-cached: nothing to restore",
    core.SinkFullAttentionSpec: "the core refuses it (vLLM 0.33.0 cannot build its manager)",
    core.CrossAttentionSpec: "cross-attention KV is the encoder's output for one request, never "
                        "prefix-cached, so no block hash names it",
    core.EncoderOnlyAttentionSpec: "encoder-only attention keeps no KV across steps (the core "
                              "has no manager for it)",
})
"""Spec types offload does not serve, each with its reason (exact types, as the entries)."""

_KINDS: dict[str, GroupKind] = {}
_BY_SPEC: dict[type[core.KVCacheSpec], GroupKind] = {}
_PLANS: dict[str, PlanKind] = {}


def register(kind: GroupKind) -> None:
    """Serve ``kind`` (the same entry again: no-op). A name, spec type, plan kind name or
    page key another entry holds, or a refused spec type, raises."""
    if _KINDS.get(kind.name) is kind:
        return
    if kind.name in _KINDS:
        raise ValueError(f"group kind {kind.name!r} is already registered")
    for spec in kind.specs:
        if spec in _BY_SPEC or spec in REFUSED:
            raise ValueError(f"{spec.__name__} is already served or refused")
    plan = _PLANS.get(kind.plan.name)
    if plan is not None and plan != kind.plan:
        raise ValueError(f"plan kind {kind.plan.name!r} is already another one")
    key = kind.page_key
    if key is not None and any(k.page_key == key for k in _KINDS.values()):
        raise ValueError(f"group kind {kind.name!r}: page key {key} is already taken")
    _KINDS[kind.name] = kind
    _BY_SPEC.update(dict.fromkeys(kind.specs, kind))
    _PLANS.setdefault(kind.plan.name, kind.plan)


def unregister(name: str) -> None:
    """Forget a registered kind (and its plan kind, when no other kind uses it)."""
    kind = _KINDS.pop(name)
    for spec in kind.specs:
        del _BY_SPEC[spec]
    if all(k.plan.name != kind.plan.name for k in _KINDS.values()):
        del _PLANS[kind.plan.name]


for _kind in (FULL_ATTENTION, MLA_ATTENTION, SLIDING_WINDOW, SLIDING_WINDOW_MLA,
              CHUNKED_LOCAL, MAMBA_STATE):
    register(_kind)


def kinds() -> tuple[GroupKind, ...]:
    """The registered kinds, in registration order."""
    return tuple(_KINDS.values())


def get(name: str) -> GroupKind:
    try:
        return _KINDS[name]
    except KeyError:
        raise ValueError(f"unknown group kind {name!r}; known: {sorted(_KINDS)}") from None


def plan_kind(name: str) -> PlanKind:
    try:
        return _PLANS[name]
    except KeyError:
        raise ValueError(f"group kinds must be in {plan_kinds()}, got {name!r}") from None


def plan_kinds() -> tuple[str, ...]:
    return tuple(_PLANS)


def served_labels(kinds_: tuple[GroupKind, ...] | None = None) -> str:
    """"full-attention, MLA and Mamba 'align'": for messages listing what is served."""
    labels = [k.label for k in (kinds() if kinds_ is None else kinds_)]
    return labels[0] if len(labels) == 1 else f"{', '.join(labels[:-1])} and {labels[-1]}"


def of_spec(spec: core.KVCacheSpec) -> GroupKind:
    """The kind serving a core spec, or :class:`UnsupportedGroupKind` with the reason."""
    kind = _BY_SPEC.get(type(spec))
    if kind is not None:
        reason = kind.refuse(spec)
        if reason is None:
            return kind
    else:
        reason = REFUSED.get(type(spec)) or (
            f"no offload kind is registered for {type(spec).__name__}; offload takes "
            f"{served_labels()} groups")
    raise UnsupportedGroupKind(f"offload of {spec.kind} groups is not supported: {reason}")


def kind_of_page(kv_parts: int, span_field: str) -> GroupKind:
    """The kind of a page built field by field (no kind named): the inferable entry with
    these K/V parts and span field (unique by registration)."""
    for kind in _KINDS.values():
        if kind.page_key == (kv_parts, span_field):
            return kind
    raise ValueError(f"no group kind has pages of {kv_parts} K/V parts with span field "
                     f"{span_field!r}; name the kind")


def spec_of_config(name: str, params: SpecParams) -> core.KVCacheSpec:
    """The core spec of a deployment config's group of kind ``name``
    (``layout.groups[].kind``)."""
    for kind in _KINDS.values():
        if kind.config == name and kind.spec_of is not None:
            return kind.spec_of(params)
    raise ValueError(f"no group kind is configured as {name!r}; configured: "
                     f"{[k.config for k in _KINDS.values() if k.config]}")
