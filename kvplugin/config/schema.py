"""The deployment's sections (layout, limits, model, engine, faults) and the whole config,
with the rules that span sections; the offload and tenants sections are in
:mod:`kvplugin.config.offload` and :mod:`kvplugin.config.tenants`."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from kvplugin.config.base import Loc, _fail, _Strict
from kvplugin.config.offload import (
    NATIVE_CHUNK_SIZE,
    OLD_TIER_NAMES,
    OffloadConfigSection,
    resolve_chunk_size,
)
from kvplugin.config.tenants import TenantQuotaConfig, TenantsConfig

# ----------------------------------------------------------------------------- layout


class GroupConfig(_Strict):
    """One KV-cache group (``layout.groups[]``): layers that share a page shape and an
    attention family."""

    kind: Literal["full", "mla", "sliding_window", "chunked_local", "mamba"] = Field(
        description="the attention family: full attention, multi-head latent attention "
                    "(MLA: one latent vector of model.head_size per token and layer, no "
                    "separate V), a sliding window, chunked local attention or a Mamba state")
    block_size: int | None = Field(
        default=None, gt=0, description="tokens per block of this group (null: layout.block_size)")
    sliding_window: int | None = Field(
        default=None, gt=0, description="the window in tokens (sliding_window groups only)")
    attention_chunk_size: int | None = Field(
        default=None, gt=0, description="the attention chunk in tokens (chunked_local only)")
    mode: Literal["none", "align"] | None = Field(
        default=None, description="Mamba prefix caching: align caches states at block "
                                  "boundaries, none caches nothing (mamba only)")
    num_speculative_blocks: int | None = Field(
        default=None, ge=0, description="extra state blocks for speculative decoding (mamba only)")
    is_eagle_group: bool | None = Field(
        default=None, description="the group holds the EAGLE draft model's layers")

    @model_validator(mode="after")
    def _kind_fields(self) -> GroupConfig:
        need = {"sliding_window": "sliding_window", "chunked_local": "attention_chunk_size"}
        key = need.get(self.kind)
        if key and getattr(self, key) is None:
            raise ValueError(f"a {self.kind} group needs {key}")
        for k in ("sliding_window", "attention_chunk_size"):
            if getattr(self, k) is not None and need.get(self.kind) != k:
                raise ValueError(f"{k} does not apply to a {self.kind} group")
        if self.kind != "mamba" and (self.mode or self.num_speculative_blocks is not None):
            raise ValueError(f"mode / num_speculative_blocks do not apply to a {self.kind} group")
        return self

    def as_trace_group(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class LayoutConfig(_Strict):
    """The KV-cache layout and the allocation core's options (the conformance trace's
    ``config``)."""

    block_size: int = Field(default=16, gt=0, description="tokens per block (the scheduler's)")
    num_blocks: int = Field(default=512, ge=2, description="device blocks in the pool "
                                                          "(block 0 is the null block)")
    groups: list[GroupConfig] = Field(
        default_factory=lambda: [GroupConfig(kind="full")], min_length=1,
        description="the KV-cache groups, one entry per group (see layout.groups[])")
    enable_caching: bool = Field(default=True, description="prefix caching (offload needs it)")
    max_model_len: int = Field(default=8192, gt=0, description="the longest request, in tokens")
    max_in_flight_tokens: int | None = Field(
        default=None, gt=0, description="cap on the tokens a request's window groups keep "
                                        "allocated (null: no cap)")
    watermark: float = Field(default=0.0, ge=0.0, lt=1.0,
                             description="share of the pool kept free when admitting")
    use_eagle: bool = Field(default=False, description="EAGLE speculative decoding: the last "
                                                       "hit block is dropped, as in vLLM")
    hash_fn: Literal["sha256_cbor", "sha256"] = Field(
        default="sha256_cbor", description="the block hash (vLLM's names)")
    none_hash_seed: str | None = Field(
        default=None, description="seed of the first block's parent hash (null: the fixed "
                                  "default, so keys are stable across processes)")
    log_stats: bool = Field(default=True, description="keep prefix-cache statistics")
    enable_kv_cache_events: bool = Field(default=True, description="record KV-cache events")
    prefix_match_unit: int | None = Field(
        default=None, gt=0, description="hash granularity in tokens when below the block size "
                                        "(sub-block prefix hits, e.g. Mamba partial tails)")
    prefix_cache_retention_interval: int | None = Field(
        default=None, ge=0, description="keep every Nth boundary cached in window groups "
                                        "(0: replay boundaries only; null: all)")
    num_hash_lookahead_tokens: int = Field(default=0, ge=0,
                                           description="tokens hashed ahead of the prompt")
    enable_mamba_shared_prefix_checkpoint: bool = Field(
        default=False, description="cache the Mamba state at a prompt's last hash boundary "
                                   "inside a block (partial tails)")
    metrics_collector_sample_rate: float | None = Field(
        default=None, gt=0, le=1,
        description="share of device blocks whose residency (lifetime, idle time, reuse "
                    "gaps) is tracked, as vLLM's KVCacheMetricsCollector (null: off); "
                    "exported as kvplugin_block_*_seconds histograms")

    def as_trace_config(self) -> dict[str, Any]:
        d = self.model_dump(exclude={"groups"})
        d["groups"] = [g.as_trace_group() for g in self.groups]
        return d


# ----------------------------------------------------------------------------- limits


class LimitsConfig(_Strict):
    """The scheduler limits of the core-only simulation (and the engine's by default)."""

    max_num_batched_tokens: int = Field(default=256, gt=0, description="tokens per step")
    max_num_seqs: int = Field(default=16, gt=0, description="requests running at once")
    long_prefill_token_threshold: int = Field(
        default=0, ge=0, description="per-request cap on prefill tokens per step (0: none)")
    full_sequence_must_fit: bool = Field(
        default=True, description="admit only requests whose whole sequence fits (simulation)")
    stats_every: int = Field(default=8, gt=0, description="steps between statistics records "
                                                          "(simulation)")


# ----------------------------------------------------------------------------- model, engine


class ModelConfig(_Strict):
    """The model's KV page shape (per attention group) and its name in the tiers' keys."""

    name: str = Field(default="kvplugin/fake-model", min_length=1,
                      description="the model's name: part of every tier key, so two models "
                                  "never read each other's KV")
    num_layers: int = Field(default=2, gt=0, description="layers per KV-cache group")
    num_kv_heads: int = Field(default=2, gt=0, description="KV heads per layer")
    head_size: int = Field(default=32, gt=0, description="head dimension")
    dtype: Literal["float16", "bfloat16", "float32", "int8", "uint8"] = Field(
        default="float16", description="KV element type")


# The presets of kvplugin.costs (a test keeps the two lists equal).
ModelCostName = Literal["llama-3.1-8b-h100"]
LinkTier = Literal["disk", "redis"]  # the tiers whose figures a model cost holds


class TierLinkConfig(_Strict):
    """A tier's figures in the deployment, over the model cost preset's."""

    gb_per_s: float = Field(gt=0, description="bandwidth to the host, GB/s (1e9 bytes)")
    latency_ms: float = Field(default=0.0, ge=0, description="per load, ms")


class EngineConfig(_Strict):
    """The reference async engine (``kvplugin run``). The token budget and max_num_seqs
    default to the ``limits`` section's, which the core-only simulation also reads."""

    max_num_batched_tokens: int | None = Field(default=None, gt=0,
                                               description="tokens per step (null: limits')")
    max_num_seqs: int | None = Field(default=None, gt=0,
                                     description="requests running at once (null: limits')")
    prefill_token_ms: float = Field(default=0.004, ge=0,
                                    description="simulated model time per prefill token, ms")
    decode_step_ms: float = Field(default=1.0, ge=0,
                                  description="simulated model time of a step with decodes, ms")
    uvloop: bool = Field(default=True, description="use uvloop when it is installed")
    model_cost: ModelCostName | None = Field(
        default=None, description="simulated time of a named GPU deployment (a step of its "
                                  "model, its KV bytes over the host link and each tier): "
                                  "llama-3.1-8b-h100; unset: prefill_token_ms and "
                                  "decode_step_ms, and loads cost nothing")
    tier_links: dict[LinkTier, TierLinkConfig] = Field(
        default_factory=dict, description="a tier's bandwidth and latency in the deployment "
                                          "(disk, redis), over model_cost's figures, e.g. "
                                          "redis: {gb_per_s: 10, latency_ms: 0.2} for "
                                          "100 GbE; needs model_cost")
    kv_events_endpoint: str | None = Field(
        default=None, description="publish the KV events (device cache and tiers) on this "
                                  "ZMQ endpoint in vLLM's wire format, e.g. "
                                  "tcp://127.0.0.1:5557 (needs kvplugin[events])")
    deterministic: bool = Field(
        default=True, description="simulated time: every lookup, load and store settles "
                                  "at the step boundary, so the same seed gives the same "
                                  "hits, ledger and TTFT (false: real time, the I/O lands "
                                  "when it completes and the figures vary with timing)")
    lag_probe_ms: float = Field(default=5.0, gt=0, description="period of the event-loop "
                                                               "lag probe, ms")

    @model_validator(mode="after")
    def _links_need_a_cost(self) -> EngineConfig:
        if self.tier_links and self.model_cost is None:
            raise ValueError("tier_links are figures of a model cost: set engine.model_cost")
        return self


FaultKind = Literal["error", "latency", "drop", "corrupt"]
FAULT_KINDS: tuple[FaultKind, ...] = ("error", "latency", "drop", "corrupt")


class FaultsConfig(_Strict):
    """Fault drills: every tier wrapped in a seeded ``kvplugin.connectors.faults.FaultInjector``.

    ``rate`` is the share of connector operations that go wrong, split evenly over
    ``kinds``: ``error`` (a call fails as if the backend were down), ``latency`` (a call
    first sleeps up to ``latency_ms``; past its deadline that is a timeout), ``drop`` (a
    write reported stored, never written), ``corrupt`` (an object stored damaged, which
    its load must catch). Errors and latency roll per call, drops and corruption per
    object. 0 (the default) injects nothing and wraps nothing.
    """

    rate: float = Field(default=0.0, ge=0, le=1,
                        description="share of connector operations that go wrong (0: off)")
    kinds: tuple[FaultKind, ...] = Field(
        default=FAULT_KINDS, description="what goes wrong: error, latency, drop, corrupt "
                                         "(each at most once)")
    seed: int = Field(default=0, description="tier i's injector is seeded with seed + i, so a "
                                             "drill repeats exactly")
    latency_ms: float = Field(default=20.0, ge=0, description="the longest injected delay, ms")

    @model_validator(mode="after")
    def _kinds(self) -> FaultsConfig:
        if not self.kinds or len(set(self.kinds)) != len(self.kinds):
            raise ValueError("kinds must name each fault kind at most once, and at least one")
        return self

    def kind_rate(self, kind: FaultKind) -> float:
        return self.rate / len(self.kinds) if kind in self.kinds else 0.0


# ----------------------------------------------------------------------------- the whole


class KVPluginConfig(_Strict):
    """A deployment: the layout, the model's page, the tiers, the tenants; and the reference
    engine's traffic, limits and fault drills."""

    layout: LayoutConfig = Field(default_factory=LayoutConfig, description="the KV-cache layout")
    # The demo engine's section: the library keeps it as given (kvplugin.engine.config's
    # RunConfig validates it, for kvplugin run and validate-config).
    workload: dict[str, Any] = Field(default_factory=dict,
                                     description="the reference engine's traffic")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="scheduler limits")
    model: ModelConfig = Field(default_factory=ModelConfig, description="the KV page shape")
    offload: OffloadConfigSection = Field(default_factory=OffloadConfigSection,
                                          description="the offload tiers")
    engine: EngineConfig = Field(default_factory=EngineConfig,
                                 description="the reference async engine")
    faults: FaultsConfig = Field(default_factory=FaultsConfig, description="fault drills")
    tenants: TenantsConfig = Field(default_factory=TenantsConfig,
                                   description="tenants, quotas, shared prefix groups")

    @model_validator(mode="after")
    def _across(self) -> KVPluginConfig:
        problems: list[tuple[Loc, str]] = []
        try:
            self.chunk_tokens()
        except ValueError as e:
            problems.append((("offload", "chunk_size"), str(e)))
        problems += self._tenant_problems()
        _fail("config", problems)
        return self

    def chunk_tokens(self) -> int:
        """Tokens per stored object in kvplugin's engine (``offload.chunk_size`` resolved
        against the layout's block sizes; unset is the native default)."""
        lay, off = self.layout, self.offload
        return resolve_chunk_size(off.chunk_size, lay.block_size,
                                  [g.block_size for g in lay.groups if g.block_size],
                                  unset=NATIVE_CHUNK_SIZE, target=off.chunk_target_tokens,
                                  unit_name="layout.block_size")

    def _blocks_of_longest(self) -> int:
        """Device blocks a request of max_model_len tokens holds at least: its full-attention
        groups keep every block (window and Mamba groups need fewer; not counted)."""
        lay = self.layout
        return sum(-(-lay.max_model_len // (g.block_size or lay.block_size))
                   for g in lay.groups if g.kind == "full")

    def _tenant_problems(self) -> list[tuple[Loc, str]]:
        problems: list[tuple[Loc, str]] = []
        t = self.tenants
        need = self._blocks_of_longest()
        quotas: list[tuple[Loc, TenantQuotaConfig]] = [
            (("tenants", "default_quota"), t.default_quota)]
        quotas += [(("tenants", "declared", n), q) for n, q in (t.declared or {}).items()]
        for loc, q in quotas:
            if q.max_blocks_in_use is not None and q.max_blocks_in_use < need:
                problems.append(((*loc, "max_blocks_in_use"), (
                    f"{q.max_blocks_in_use} blocks cannot hold one request of "
                    f"layout.max_model_len {self.layout.max_model_len} tokens ({need} blocks "
                    f"in the full-attention groups): such a request would wait forever")))
        if not self.offload.enabled:
            return problems  # offload off: tier quotas have nothing to limit and are left out
        names = self.offload.tier_names()
        tiers = [n for n in names if n is not None]
        hint = ("; offload.connectors[] tiers go by their name, else their kind"
                if self.offload.connectors else "")
        for loc, q in quotas:
            for tier in q.max_tier_bytes:
                if tier in tiers or None in names:  # a name only the built tier tells:
                    continue  # the manager checks the quotas' names when it is built
                if tier in OLD_TIER_NAMES:
                    problems.append(((*loc, "max_tier_bytes", tier), (
                        f"the {tier!r} tier is now named {OLD_TIER_NAMES[tier]!r}")))
                else:
                    problems.append(((*loc, "max_tier_bytes", tier), (
                        f"no {tier!r} tier: this deployment's tiers are {tiers or 'none'}"
                        f"{hint}")))
        return problems

