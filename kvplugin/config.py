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
    arrivals_per_step: float = Field(default=1.5, gt=0)
    vocab: int = Field(default=32000, ge=2)
    seed: int = 0

    @model_validator(mode="after")
    def _ranges(self) -> WorkloadConfig:
        for name in ("system_prompt_len", "user_len", "output_len"):
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


class KVPluginConfig(_Strict):
    layout: LayoutConfig = Field(default_factory=LayoutConfig)
    workload: WorkloadConfig = Field(default_factory=WorkloadConfig)
    limits: LimitsConfig = Field(default_factory=LimitsConfig)


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
    out = json.loads(json.dumps(data))  # deep copy of plain data
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
