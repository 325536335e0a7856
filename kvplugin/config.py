"""Deployment configuration: YAML / TOML / JSON files validated by pydantic.

Unknown keys are errors (never warnings), reported with the file, the key path and the
reason.  Environment variables ``KVPLUGIN_<SECTION>__<KEY>=value`` override file values
(values are parsed as YAML scalars, so ``8``, ``true`` and ``0.1`` get their types).
"""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

ENV_PREFIX = "KVPLUGIN_"


class ConfigError(ValueError):
    """An invalid configuration: names the source, the key path and the reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class GroupConfig(_Strict):
    kind: Literal["full", "sliding_window", "chunked_local", "mamba"]
    block_size: int | None = Field(default=None, gt=0)
    sliding_window: int | None = Field(default=None, gt=0)
    attention_chunk_size: int | None = Field(default=None, gt=0)
    mode: Literal["none", "align"] | None = None
    num_speculative_blocks: int | None = Field(default=None, ge=0)
    is_eagle_group: bool | None = None

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
    """The KV-cache layout and manager options (the conformance trace ``config``)."""

    block_size: int = Field(default=16, gt=0)
    num_blocks: int = Field(default=512, ge=2)
    groups: list[GroupConfig] = Field(default_factory=lambda: [GroupConfig(kind="full")],
                                      min_length=1)
    enable_caching: bool = True
    max_model_len: int = Field(default=8192, gt=0)
    max_in_flight_tokens: int | None = Field(default=None, gt=0)
    watermark: float = Field(default=0.0, ge=0.0, lt=1.0)
    use_eagle: bool = False
    hash_fn: Literal["sha256_cbor", "sha256"] = "sha256_cbor"
    none_hash_seed: str | None = None
    log_stats: bool = True
    enable_kv_cache_events: bool = True
    prefix_match_unit: int | None = Field(default=None, gt=0)
    prefix_cache_retention_interval: int | None = Field(default=None, ge=0)
    num_hash_lookahead_tokens: int = Field(default=0, ge=0)
    enable_mamba_shared_prefix_checkpoint: bool = False

    def as_trace_config(self) -> dict[str, Any]:
        d = self.model_dump(exclude={"groups"})
        d["groups"] = [g.as_trace_group() for g in self.groups]
        return d


class WorkloadConfig(_Strict):
    num_requests: int = Field(default=48, ge=1)
    num_system_prompts: int = Field(default=3, ge=1)
    system_prompt_len: tuple[int, int] = (32, 256)
    user_len: tuple[int, int] = (8, 160)
    output_len: tuple[int, int] = (1, 48)
    follow_up_prob: float = Field(default=0.35, ge=0, le=1)
    resend_prob: float = Field(default=0.1, ge=0, le=1)
    salt_prob: float = Field(default=0.1, ge=0, le=1)
    lora_prob: float = Field(default=0.1, ge=0, le=1)
    arrivals_per_step: float = Field(default=1.5, gt=0)  # the core-only simulation's
    vocab: int = Field(default=32000, ge=2)
    seed: int = 0
    # The engine's workload (kvplugin.engine.workload): tenants share the system prompts'
    # tokens (the tiers must still keep them apart), ask about their own documents, and
    # arrive in real time; a follow-up comes a think time after its parent's answer.
    num_tenants: int = Field(default=3, ge=1)
    num_documents: int = Field(default=2, ge=1)  # per tenant
    document_len: tuple[int, int] = (256, 768)
    doc_qa_prob: float = Field(default=0.25, ge=0, le=1)
    requests_per_s: float = Field(default=200.0, gt=0)
    think_time_ms: tuple[int, int] = (0, 20)

    @model_validator(mode="after")
    def _ranges(self) -> WorkloadConfig:
        lo, hi = self.think_time_ms
        if not 0 <= lo <= hi:
            raise ValueError("think_time_ms must be a range [lo, hi] with 0 <= lo <= hi")
        for name in ("system_prompt_len", "user_len", "output_len", "document_len"):
            lo, hi = getattr(self, name)
            if not 0 < lo <= hi:
                raise ValueError(f"{name} must be a range [lo, hi] with 0 < lo <= hi")
        if self.follow_up_prob + self.resend_prob > 1:
            raise ValueError("follow_up_prob + resend_prob must not exceed 1")
        return self


class LimitsConfig(_Strict):
    max_num_batched_tokens: int = Field(default=256, gt=0)
    max_num_seqs: int = Field(default=16, gt=0)
    long_prefill_token_threshold: int = Field(default=0, ge=0)
    full_sequence_must_fit: bool = True
    stats_every: int = Field(default=8, gt=0)


GB = 1 << 30
TEMP_DISK = "temp://"  # offload.local_disk: a fresh temporary directory, removed afterwards


class ModelConfig(_Strict):
    """The model's KV page shape (per full-attention group) and its name in the tiers' keys."""

    name: str = Field(default="kvplugin/fake-model", min_length=1)
    num_layers: int = Field(default=2, gt=0)  # layers per KV-cache group
    num_kv_heads: int = Field(default=2, gt=0)
    head_size: int = Field(default=32, gt=0)
    dtype: Literal["float16", "bfloat16", "float32", "int8", "uint8"] = "float16"


class OffloadConfigSection(_Strict):
    """KV offload tiers. Key names follow LMCache's where one exists (sizes in GB, as
    LMCache); the rest are kvplugin's own."""

    chunk_size: int = Field(default=16, gt=0)  # tokens per stored object
    local_cpu: bool = True
    max_local_cpu_size: float = Field(default=0.001, gt=0)
    local_disk: str | None = TEMP_DISK  # a path ("file://" allowed), temp:// or null
    max_local_disk_size: float = Field(default=0.05, gt=0)
    remote_url: str | None = None  # redis://host:port/db adds a Redis tier
    store_mode: Literal["copy", "hold"] = "copy"
    load_failure_policy: Literal["recompute", "fail"] = "recompute"
    lookup_timeout_ms: float = Field(default=50.0, gt=0)
    load_timeout_ms: float = Field(default=2000.0, gt=0)
    store_timeout_ms: float = Field(default=5000.0, gt=0)
    max_io: int = Field(default=8, gt=0)
    store_budget_mb: float = Field(default=64.0, gt=0)
    store_prompt_only: bool = False

    @model_validator(mode="after")
    def _tiers(self) -> OffloadConfigSection:
        if not (self.local_cpu or self.local_disk or self.remote_url):
            raise ValueError("no tier: enable local_cpu, local_disk or remote_url")
        if self.remote_url is not None and not self.remote_url.startswith(
                ("redis://", "rediss://", "unix://")):
            raise ValueError("remote_url must be a redis://, rediss:// or unix:// URL")
        if self.local_disk == "":
            raise ValueError("local_disk must be a path, temp:// or null")
        return self

    @property
    def disk_path(self) -> str | None:
        """The disk tier's directory (None: no disk tier, or a temporary one)."""
        if self.local_disk is None or self.local_disk == TEMP_DISK:
            return None
        return self.local_disk.removeprefix("file://")


class EngineConfig(_Strict):
    """The reference async engine (``kvplugin run``). The token budget and max_num_seqs
    default to the ``limits`` section's, which the core-only simulation also reads."""

    max_num_batched_tokens: int | None = Field(default=None, gt=0)
    max_num_seqs: int | None = Field(default=None, gt=0)
    prefill_token_ms: float = Field(default=0.004, ge=0)  # simulated cost per prefill token
    decode_step_ms: float = Field(default=1.0, ge=0)  # simulated cost of a step with decodes
    uvloop: bool = True  # use uvloop when it is installed
    lag_probe_ms: float = Field(default=5.0, gt=0)  # period of the event-loop lag probe


FaultKind = Literal["error", "latency", "drop", "corrupt"]
FAULT_KINDS: tuple[FaultKind, ...] = ("error", "latency", "drop", "corrupt")


class FaultsConfig(_Strict):
    """Fault drills: every tier wrapped in a seeded ``connectors.faults.FaultInjector``.

    ``rate`` is the share of connector operations that go wrong, split evenly over
    ``kinds``: ``error`` (a call fails as if the backend were down), ``latency`` (a call
    first sleeps up to ``latency_ms``; past its deadline that is a timeout), ``drop`` (a
    write reported stored, never written), ``corrupt`` (an object stored damaged, which
    its load must catch). Errors and latency roll per call, drops and corruption per
    object. 0 (the default) injects nothing and wraps nothing.
    """

    rate: float = Field(default=0.0, ge=0, le=1)
    kinds: tuple[FaultKind, ...] = FAULT_KINDS
    seed: int = 0  # tier i's injector is seeded with seed + i: runs repeat exactly
    latency_ms: float = Field(default=20.0, ge=0)

    @model_validator(mode="after")
    def _kinds(self) -> FaultsConfig:
        if not self.kinds or len(set(self.kinds)) != len(self.kinds):
            raise ValueError("kinds must name each fault kind at most once, and at least one")
        return self

    def kind_rate(self, kind: FaultKind) -> float:
        return self.rate / len(self.kinds) if kind in self.kinds else 0.0


class KVPluginConfig(_Strict):
    layout: LayoutConfig = Field(default_factory=LayoutConfig)
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    offload: OffloadConfigSection = Field(default_factory=OffloadConfigSection)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)

    @model_validator(mode="after")
    def _chunks(self) -> KVPluginConfig:
        if self.offload.chunk_size % self.layout.block_size:
            raise ValueError(f"offload.chunk_size {self.offload.chunk_size} is not a multiple "
                             f"of layout.block_size {self.layout.block_size}")
        return self


# ----------------------------------------------------------------------------- loading


def _parse(text: str, suffix: str, source: str) -> dict[str, Any]:
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except (yaml.YAMLError, tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{source}: cannot parse: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    return data


def apply_env_overrides(data: dict[str, Any], env: Mapping[str, str]) -> dict[str, Any]:
    """``KVPLUGIN_LAYOUT__NUM_BLOCKS=64`` sets ``layout.num_blocks``."""
    out: dict[str, Any] = json.loads(json.dumps(data))  # deep copy of plain data
    for name, raw in env.items():
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        path = [p.lower() for p in name[len(ENV_PREFIX):].split("__")]
        node = out
        for part in path[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"environment {name}: {'.'.join(path)} is not a section")
        node[path[-1]] = yaml.safe_load(raw)
    return out


def _describe(e: ValidationError, source: str) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in e.errors():
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        lines.append(f"  {loc}: {err['msg']}")
    return "\n".join(lines)


def validate(data: dict[str, Any], source: str = "<config>") -> KVPluginConfig:
    try:
        return KVPluginConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, source)) from None


def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None) -> KVPluginConfig:
    """Load a config file (or the embedded default when ``path`` is None)."""
    if path is None:
        source = "embedded default.yaml"
        text = (resources.files("kvplugin") / "data" / "default.yaml").read_text()
        suffix = ".yaml"
    else:
        p = Path(path)
        source = str(p)
        try:
            text = p.read_text()
        except OSError as e:
            raise ConfigError(f"{source}: cannot read: {e.strerror}") from None
        suffix = p.suffix.lower()
    data = _parse(text, suffix, source)
    data = apply_env_overrides(data, os.environ if env is None else env)
    return validate(data, source)
