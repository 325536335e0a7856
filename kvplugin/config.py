"""Deployment configuration: YAML / TOML / JSON files validated by pydantic.

Unknown keys are errors (never warnings), reported with the file, the key path and the
reason; so are values that only go wrong together (``offload.chunk_size`` not a multiple of
``layout.block_size``, a prefix group naming an undeclared tenant, a quota on a tier the
deployment does not build). Environment variables ``KVPLUGIN_<SECTION>__<KEY>=value``
override file values at any depth (values are parsed as YAML, so ``8``, ``true``, ``0.1`` and
``{a: 1}`` get their types; a string key keeps the text as it is), and
``KVPLUGIN_CONFIG_FILE`` names the file to load when no path is given.

Every field carries a description: ``tools/gen_config_doc.py`` renders them as
``docs/config.md``.
"""

from __future__ import annotations

import json
import os
import re
import tomllib
import types
import typing
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, Literal, NoReturn, TypeVar, overload
from urllib.parse import urlsplit

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import InitErrorDetails, PydanticCustomError

from kvplugin.aio.tenants import PrefixGroup, TenantPolicy, TenantQuota, check_name
from kvplugin.registry import RegistryError, check_options, resolve

ENV_PREFIX = "KVPLUGIN_"
CONFIG_FILE_ENV = "KVPLUGIN_CONFIG_FILE"  # the file load_config(None) reads, when set

Loc = tuple[str | int, ...]


class ConfigError(ValueError):
    """An invalid configuration: names the source, the key path and the reason."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _raise(title: str, problems: list[tuple[Loc, str]]) -> NoReturn:
    """Raise every problem at its own key path (pydantic prefixes the caller's location), so
    a rule that spans fields still names the exact key."""
    raise ValidationError.from_exception_data(title, [
        InitErrorDetails(type=PydanticCustomError("config", "{reason}", {"reason": why}),
                         loc=loc, input=None) for loc, why in problems])


def _fail(title: str, problems: list[tuple[Loc, str]]) -> None:
    if problems:
        _raise(title, problems)


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


GB = 1 << 30
TEMP_DISK = "temp://"  # offload.local_disk: a fresh temporary directory, removed afterwards
# The tier kinds (a connector's capabilities.tier) of the built-in tiers: the one name each
# tier has everywhere (reports, metrics, the tenant quotas' max_tier_bytes, mgr.tiers).
TIER_KINDS = ("memory", "disk", "redis")
# Names of the tiers before they had one name everywhere: refused with the new one.
OLD_TIER_NAMES = {"host": "memory", "remote": "redis"}
# remote_url: a Redis Cluster (kvplugin.connectors.redis_cluster)
CLUSTER_SCHEME = "redis-cluster://"
# remote_url: "env:NAME" reads the URL from the environment variable NAME when the config is
# loaded (the shipped configs point at no shared default Redis: the deployment says which).
ENV_REF = "env:"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def unresolved_remote_url(url: str | None) -> str | None:
    """The environment variable an ``env:NAME`` remote_url still waits for, else None."""
    return url[len(ENV_REF):] if url is not None and url.startswith(ENV_REF) else None


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


# ----------------------------------------------------------------------------- offload


class ConnectorSpec(_Strict):
    """An extra tier (``offload.connectors[]``), appended below the built-in ones."""

    kind: str = Field(min_length=1, description="a built-in kind (memory, disk, redis), an "
                      "entry point of the kvplugin.connectors group, or a module:Class string")
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="keyword arguments of the connector's factory")


class OffloadConfigSection(_Strict):
    """KV offload tiers. Key names follow LMCache's where one exists (sizes in GB, as
    LMCache); the rest are kvplugin's own. Tiers are ordered memory, disk, Redis, then
    ``connectors``; with several, a tiered connector writes through all of them."""

    enabled: bool = Field(default=True, description="false: no tier at all, the manager serves "
                                                    "device hits only (the rest is ignored)")
    chunk_size: int = Field(default=16, gt=0, description="tokens per stored object, a "
                                                         "multiple of layout.block_size")
    local_cpu: bool = Field(default=True, description="a host-memory tier")
    max_local_cpu_size: float = Field(default=0.001, gt=0,
                                      description="the host-memory tier's capacity, GB")
    local_cpu_reserve: bool = Field(
        default=False, description="map and fault in the host-memory tier's whole capacity "
                                   "at startup, as LMCache pre-allocates its CPU buffer: "
                                   "stores then never fault fresh memory in while serving "
                                   "(startup takes about 1 s per GB)")
    local_disk: str | None = Field(
        default=TEMP_DISK, description="a disk tier: a directory (file:// allowed; created if "
                                       "missing), temp:// (a temporary one, removed "
                                       "afterwards) or null (none)")
    max_local_disk_size: float = Field(default=0.05, gt=0,
                                       description="the disk tier's capacity, GB")
    disk_io_threads: int | None = Field(
        default=None, ge=1, description="the disk tier's I/O threads (null: sized to the "
                                        "CPUs, leaving one for the event loop)")
    remote_url: str | None = Field(
        default=None, description="a Redis tier: redis://host:port/db, rediss://..., "
                                  "unix:///path.sock, or a Redis Cluster: "
                                  "redis-cluster://host:port[,host:port...] (null: none); "
                                  "env:NAME takes the URL from the environment variable NAME "
                                  "(kvplugin run refuses to start while it is unset)")
    connectors: list[ConnectorSpec] = Field(
        default_factory=list, description="extra tiers after the built-in ones (see "
                                          "offload.connectors[])")
    require_tiers: bool = Field(
        default=False, description="a tier that does not answer a health check at start "
                                   "is an error (kvplugin run exits 2) instead of a "
                                   "warning; kvplugin run --strict sets it")
    store_mode: Literal["copy", "hold"] = Field(
        default="copy", description="copy: a store copies the blocks out at once; hold: it "
                                    "pins them until written")
    load_failure_policy: Literal["recompute", "fail"] = Field(
        default="recompute", description="a load that fails: recompute what is missing, or "
                                         "fail the request")
    lookup_timeout_ms: float = Field(default=50.0, gt=0,
                                     description="a lookup slower than this is a miss")
    load_timeout_ms: float = Field(default=2000.0, gt=0, description="deadline of a load")
    store_timeout_ms: float = Field(default=5000.0, gt=0, description="deadline of a store")
    max_io: int = Field(default=8, gt=0, description="connector calls in flight at once")
    store_budget_mb: float = Field(default=64.0, gt=0,
                                   description="bytes of stores in flight, MB; more is shed")
    store_prompt_only: bool = Field(default=False,
                                    description="store prompt tokens only, not answers")
    cost_aware_loads: bool = Field(
        default=True, description="claim a tier's hit only where loading it is faster than "
                                  "recomputing it (needs a recompute time: engine.model_cost "
                                  "or recompute_tokens_per_s; without one every hit is loaded)")
    recompute_tokens_per_s: float | None = Field(
        default=None, gt=0, description="the engine's prefill rate for cost_aware_loads "
                                        "(engine.model_cost, when set, gives its own)")
    tier_events: bool = Field(default=True,
                              description="KV events (stored / removed) from every tier, "
                                          "beside the device cache's")

    @model_validator(mode="after")
    def _tiers(self) -> OffloadConfigSection:
        problems: list[tuple[Loc, str]] = []
        if self.enabled and not (self.local_cpu or self.local_disk or self.remote_url
                                 or self.connectors):
            problems.append(((), "no tier: enable local_cpu, local_disk, remote_url or "
                                 "connectors (or set enabled: false)"))
        if self.remote_url is not None:
            if self.remote_url.startswith(ENV_REF):
                name = self.remote_url[len(ENV_REF):]
                why = (None if _ENV_NAME.fullmatch(name) else
                       f"remote_url {self.remote_url!r}: env: needs an environment variable "
                       f"name ([A-Za-z_][A-Za-z0-9_]*)")
            else:
                why = redis_url_problem(self.remote_url)
            if why:
                problems.append((("remote_url",), why))
        if self.local_disk == "":
            problems.append((("local_disk",), "local_disk must be a path, temp:// or null"))
        elif self.enabled and self.disk_path is not None:
            why = directory_problem(self.disk_path)
            if why:
                problems.append((("local_disk",), why))
        for i, spec in enumerate(self.connectors):
            problems += [(("connectors", i, *loc), why) for loc, why in _connector_problems(spec)]
        _fail("offload", problems)
        return self

    @property
    def disk_path(self) -> str | None:
        """The disk tier's directory (None: no disk tier, or a temporary one)."""
        if self.local_disk is None or self.local_disk == TEMP_DISK:
            return None
        return self.local_disk.removeprefix("file://")

    def tier_kinds(self) -> list[str]:
        """The built-in tiers this section builds, by tier kind, fastest first."""
        if not self.enabled:
            return []
        return [k for k, on in zip(TIER_KINDS, (self.local_cpu, self.local_disk is not None,
                                                self.remote_url is not None), strict=True) if on]


def redis_url_problem(url: str) -> str | None:
    """Why ``url`` is not a Redis URL the Redis tier can connect to (None: it is)."""
    if url.startswith(CLUSTER_SCHEME):
        from kvplugin.connectors.redis_cluster import remote_url_problem

        return remote_url_problem(url)
    try:
        parts = urlsplit(url)
        _ = parts.port  # a bad port raises here
    except ValueError as e:
        return f"remote_url {url!r} is not a valid URL: {e}"
    if parts.scheme == "unix":
        return None if parts.path else f"remote_url {url!r}: a unix:// URL needs a socket path"
    if parts.scheme not in ("redis", "rediss"):
        return (f"remote_url must be a redis://, rediss://, unix:// or {CLUSTER_SCHEME} URL, "
                f"got {url!r}")
    if not parts.hostname:
        return f"remote_url {url!r} has no host"
    db = parts.path.lstrip("/")
    if db and not db.isdigit():
        return f"remote_url {url!r}: the database ({db!r}) must be a number"
    return None


def directory_problem(path: str) -> str | None:
    """Why the disk tier could not use ``path`` (None: it is a directory, or can be made)."""
    p = Path(path)
    if p.exists():
        if not p.is_dir():
            return f"local_disk {path!r} exists and is not a directory"
        return None if os.access(p, os.W_OK | os.X_OK) else f"local_disk {path!r} is not writable"
    parent = p.absolute().parent
    while not parent.exists():
        parent = parent.parent
    if not parent.is_dir():
        return f"local_disk {path!r} cannot be created: {str(parent)!r} is not a directory"
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"local_disk {path!r} cannot be created: {str(parent)!r} is not writable"
    return None


def _connector_problems(spec: ConnectorSpec) -> list[tuple[Loc, str]]:
    try:
        factory = resolve(spec.kind)
    except RegistryError as e:
        return [(("kind",), str(e))]
    try:
        check_options(spec.kind, factory, spec.options)
    except RegistryError as e:
        return [(("options",), str(e))]
    return []


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


# ----------------------------------------------------------------------------- tenants


def _surface(title: str, loc: Loc, build: typing.Callable[[], Any]) -> Any:
    """Run a runtime constructor; its ValueError becomes a config error at ``loc``."""
    try:
        return build()
    except ValueError as e:
        _raise(title, [(loc, str(e))])


class TenantQuotaConfig(_Strict):
    """A tenant's limits (``tenants.declared.<name>``, ``tenants.default_quota``): null or
    left out means unlimited (kvplugin.aio.tenants.TenantQuota)."""

    max_blocks_in_use: int | None = Field(
        default=None, ge=0, description="device blocks its requests may hold; an admission "
                                        "over it waits")
    max_cached_blocks: int | None = Field(
        default=None, ge=0, description="free-but-cached device blocks it may keep; its own "
                                        "oldest lose their cache identity beyond it")
    max_tier_bytes: dict[str, int] = Field(
        default_factory=dict, description="bytes of its objects each tier may hold (learned "
                                          "from the tier's events: evicted and deleted objects "
                                          "no longer count), by tier: memory, disk, redis; "
                                          "offers beyond it are shed")

    @model_validator(mode="after")
    def _runtime(self) -> TenantQuotaConfig:
        _fail("quota", [(("max_tier_bytes", t), f"must be an int >= 0, got {n}")
                        for t, n in self.max_tier_bytes.items() if n < 0])
        if self.model_fields_set:  # the default is valid: nothing to check
            self.quota()
        return self

    def quota(self) -> TenantQuota:
        q: TenantQuota = _surface("quota", (), lambda: TenantQuota(
            self.max_blocks_in_use, self.max_cached_blocks, dict(self.max_tier_bytes)))
        return q


class PrefixGroupConfig(_Strict):
    """Tenants that share a declared prefix, e.g. a system prompt (``tenants.prefix_groups[]``;
    kvplugin.aio.tenants.PrefixGroup)."""

    name: str = Field(description="the group's name (a tenant-name charset: letters, digits, "
                                  "_ . -)")
    tenants: list[str] = Field(min_length=1, description="its members (declared tenants, "
                                                        "when tenants.declared is given)")
    max_prefix_tokens: int = Field(gt=0, description="the longest prefix a request may "
                                                     "declare shared")
    max_cached_blocks: int | None = Field(default=None, ge=0, description="the group's own "
                                          "cached-block quota for its shared blocks")

    @model_validator(mode="after")
    def _runtime(self) -> PrefixGroupConfig:
        self.group()
        return self

    def group(self) -> PrefixGroup:
        g: PrefixGroup = _surface("prefix group", (), lambda: PrefixGroup(
            self.name, frozenset(self.tenants), self.max_prefix_tokens,
            self.max_cached_blocks))
        return g


class TenantsConfig(_Strict):
    """Whom requests belong to (kvplugin.aio.tenants.TenantPolicy): declared tenants, each
    with its quota, or (``declared`` left out) any tenant name with ``default_quota``; and
    the prefix groups whose members share a declared prefix."""

    declared: dict[str, TenantQuotaConfig] | None = Field(
        default=None, description="tenant name -> its quota (tenants.declared.<name>); "
                                  "any other tenant is refused. Null: open policy")
    default_quota: TenantQuotaConfig = Field(
        default_factory=TenantQuotaConfig, description="the quota of every tenant under the "
                                                       "open policy")
    prefix_groups: list[PrefixGroupConfig] = Field(
        default_factory=list, description="shared prefix groups (see tenants.prefix_groups[])")

    @model_validator(mode="after")
    def _runtime(self) -> TenantsConfig:
        if not self.model_fields_set:
            return self  # the open policy, no quota, no group: nothing to check
        problems: list[tuple[Loc, str]] = []
        for name in self.declared or {}:
            try:
                check_name(name)
            except ValueError as e:
                problems.append((("declared", name), str(e)))
        seen: set[str] = set()
        for i, g in enumerate(self.prefix_groups):
            if g.name in seen:
                problems.append((("prefix_groups", i, "name"),
                                 f"prefix group {g.name!r} is named twice"))
            seen.add(g.name)
            if self.declared is None:
                continue
            for t in g.tenants:
                if t not in self.declared:
                    problems.append((("prefix_groups", i, "tenants"), (
                        f"tenant {t!r} of prefix group {g.name!r} is not declared (declared: "
                        f"{', '.join(sorted(self.declared)) or 'none'})")))
        _fail("tenants", problems)
        self.policy()
        return self

    def policy(self, *, tier_quotas: bool = True) -> TenantPolicy:
        """The manager's tenant policy; ``tier_quotas=False`` (offload off: no tier to
        limit) leaves the tier byte quotas out."""
        def quota(q: TenantQuotaConfig) -> TenantQuota:
            return q.quota() if tier_quotas else q.model_copy(update={"max_tier_bytes": {}}
                                                              ).quota()

        declared = None if self.declared is None else {
            n: quota(q) for n, q in self.declared.items()}
        p: TenantPolicy = _surface("tenants", (), lambda: TenantPolicy(
            declared, quota(self.default_quota), [g.group() for g in self.prefix_groups]))
        return p


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
        off, lay = self.offload, self.layout
        if off.chunk_size % lay.block_size:
            problems.append((("offload", "chunk_size"), (
                f"offload.chunk_size {off.chunk_size} is not a multiple of layout.block_size "
                f"{lay.block_size}")))
        problems += self._tenant_problems()
        _fail("config", problems)
        return self

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
        if not self.offload.enabled or self.offload.connectors:
            # Offload off: tier quotas have nothing to limit and are left out; extra tiers
            # name their own kinds, which the manager checks when it is built.
            return problems
        tiers = self.offload.tier_kinds()
        for loc, q in quotas:
            for tier in q.max_tier_bytes:
                if tier in OLD_TIER_NAMES:
                    problems.append(((*loc, "max_tier_bytes", tier), (
                        f"the {tier!r} tier is now named {OLD_TIER_NAMES[tier]!r}")))
                elif tier not in tiers:
                    problems.append(((*loc, "max_tier_bytes", tier), (
                        f"no {tier!r} tier: this deployment's tiers are {tiers or 'none'}")))
        return problems


# ----------------------------------------------------------------------------- loading


CONFIG_SUFFIXES = (".yaml", ".yml", ".toml", ".json")


def _parse(text: str, suffix: str, source: str) -> dict[str, Any]:
    if suffix not in CONFIG_SUFFIXES:
        # Never guessed: an .ini or .txt parsed as YAML would "load" as nonsense.
        raise ConfigError(f"{source}: unknown config format {suffix or '(no suffix)'!r}; "
                          f"use {', '.join(CONFIG_SUFFIXES)}")
    try:
        if suffix == ".toml":
            data: Any = tomllib.loads(text)
        elif suffix == ".json":
            data = json.loads(text)
        else:
            data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        raise ConfigError(f"{source}: cannot parse: {_yaml_problem(e)}") from None
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{source}: cannot parse: {e}") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    return data


def _yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML error in one line, at the file's line and column (PyYAML's own message names
    ``<unicode string>`` and spans several lines)."""
    mark = getattr(e, "problem_mark", None)
    problem = getattr(e, "problem", None) or str(e).splitlines()[0]
    where = f"line {mark.line + 1}, column {mark.column + 1}: " if mark is not None else ""
    context = getattr(e, "context", None)
    return where + (f"{problem} ({context})" if context else str(problem))


def _field_type(path: list[str], schema: type[KVPluginConfig]) -> Any:
    """The annotation of the key at ``path`` (None when the path leaves the models)."""
    ann: Any = schema
    for part in path:
        ann = _unwrap(ann)
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            field = ann.model_fields.get(part)
            if field is None:
                return None
            ann = field.annotation
        elif typing.get_origin(ann) in (dict, list):
            ann = typing.get_args(ann)[-1]
        else:
            return None
    return ann


def _unwrap(ann: Any) -> Any:
    """``X | None`` -> ``X``."""
    if typing.get_origin(ann) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        if len(args) == 1:
            return args[0]
    return ann


def _env_value(name: str, path: list[str], raw: str, schema: type[KVPluginConfig]) -> Any:
    ann = _field_type(path, schema)
    if _unwrap(ann) is str and raw not in ("null", "~"):
        return raw  # a string key keeps its text: a model name or hash seed may look numeric
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError as e:
        raise ConfigError(f"environment variable {name} ({'.'.join(path)}): cannot parse "
                          f"{raw!r}: {e}") from None


def _env_overrides(data: dict[str, Any], env: Mapping[str, str], schema: type[KVPluginConfig]
                   ) -> tuple[dict[str, Any], dict[Loc, str]]:
    """The data with the overrides applied, and which variable set which key path."""
    out: dict[str, Any] = json.loads(json.dumps(data))  # deep copy of plain data
    origins: dict[Loc, str] = {}
    for name in sorted(env):
        if not name.startswith(ENV_PREFIX) or "__" not in name:
            continue
        parts = name[len(ENV_PREFIX):].split("__")
        node: Any = out
        path: list[str | int] = []
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            if isinstance(node, list):
                if not (part.isdigit() and int(part) < len(node)):
                    raise ConfigError(f"environment variable {name}: {'.'.join(map(str, path))} "
                                      f"is a list of {len(node)}; {part!r} is not an index in it")
                key: str | int = int(part)
            elif isinstance(node, dict):
                # Keys match case-insensitively (variable names are upper case by habit).
                key = next((k for k in node if k.lower() == part.lower()), part.lower())
            else:
                raise ConfigError(f"environment variable {name}: {'.'.join(map(str, path))} "
                                  f"is a value, not a section")
            path.append(key)
            if last:
                node[key] = _env_value(name, [str(p) for p in path], env[name], schema)
            else:
                if isinstance(node, dict) and node.get(key) is None:
                    node[key] = {}  # a section the file left out
                node = node[key]
        origins[tuple(path)] = name
    return out, origins


def apply_env_overrides(data: dict[str, Any], env: Mapping[str, str], *,
                        schema: type[KVPluginConfig] = KVPluginConfig) -> dict[str, Any]:
    """``KVPLUGIN_LAYOUT__NUM_BLOCKS=64`` sets ``layout.num_blocks``; deeper keys the same
    way (``KVPLUGIN_TENANTS__DEFAULT_QUOTA__MAX_BLOCKS_IN_USE=8``, list items by index:
    ``KVPLUGIN_LAYOUT__GROUPS__0__KIND=full``). ``schema`` says which keys are strings."""
    return _env_overrides(data, env, schema)[0]


def _describe(e: ValidationError, source: str, origins: Mapping[Loc, str]) -> str:
    lines = [f"{source}: invalid configuration"]
    for err in e.errors():
        loc = tuple(err["loc"])
        path = ".".join(str(p) for p in loc) or "(top level)"
        line = f"  {path}: {err['msg']}"
        # The variable that set this key, or the section above it, or a key inside it.
        var = next((v for at, v in sorted(origins.items(), key=lambda x: -len(x[0]))
                    if loc[:len(at)] == at or (loc and at[:len(loc)] == loc)), None)
        if var is not None:
            line += f" (set by environment variable {var})"
        lines.append(line)
    return "\n".join(lines)


# A config schema: KVPluginConfig, or an engine's extension of it (kvplugin run's RunConfig
# validates the workload section the library keeps as given).
C = TypeVar("C", bound=KVPluginConfig)


@overload
def validate(data: dict[str, Any], source: str = ...,
             origins: Mapping[Loc, str] | None = ...) -> KVPluginConfig: ...
@overload
def validate(data: dict[str, Any], source: str = ..., origins: Mapping[Loc, str] | None = ...,
             *, schema: type[C]) -> C: ...
def validate(data: dict[str, Any], source: str = "<config>",
             origins: Mapping[Loc, str] | None = None, *,
             schema: type[KVPluginConfig] = KVPluginConfig) -> KVPluginConfig:
    """``data`` validated as ``schema``; ConfigError (source, key path, reason) if not."""
    try:
        return schema.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_describe(e, source, origins or {})) from None


@overload
def load_config(path: str | os.PathLike[str] | None = ...,
                env: Mapping[str, str] | None = ...) -> KVPluginConfig: ...
@overload
def load_config(path: str | os.PathLike[str] | None = ..., env: Mapping[str, str] | None = ...,
                *, schema: type[C]) -> C: ...
def load_config(path: str | os.PathLike[str] | None = None,
                env: Mapping[str, str] | None = None, *,
                schema: type[KVPluginConfig] = KVPluginConfig) -> KVPluginConfig:
    """Load a config file: ``path``, else the file ``KVPLUGIN_CONFIG_FILE`` names, else the
    embedded default; then apply the environment's overrides (``env``: os.environ) and
    validate it as ``schema`` (kvplugin run: the engine's RunConfig)."""
    env = os.environ if env is None else env
    if path is None and env.get(CONFIG_FILE_ENV):
        path = env[CONFIG_FILE_ENV]
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
    data, origins = _env_overrides(data, env, schema)
    _resolve_env_refs(data, env, origins)
    return validate(data, source, origins, schema=schema)


def _resolve_env_refs(data: dict[str, Any], env: Mapping[str, str],
                      origins: dict[Loc, str]) -> None:
    """``offload.remote_url: env:NAME`` takes NAME's value when it is set (and is validated
    as a URL then); unset, the reference stays, for :func:`unresolved_remote_url`."""
    off = data.get("offload")
    url = off.get("remote_url") if isinstance(off, dict) else None
    name = unresolved_remote_url(url) if isinstance(url, str) else None
    if name is not None and _ENV_NAME.fullmatch(name) and env.get(name):
        off["remote_url"] = env[name]  # type: ignore[index]
        origins[("offload", "remote_url")] = name
