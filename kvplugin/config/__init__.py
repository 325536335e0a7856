"""Deployment configuration: YAML / TOML / JSON files validated by pydantic.

Unknown keys are errors (never warnings), reported with the file, the key path and the
reason; so are values that only go wrong together (``offload.chunk_size`` not a multiple of
``layout.block_size``, a prefix group naming an undeclared tenant, a quota on a tier the
deployment does not build, two tiers with one name). Environment variables
``KVPLUGIN_<SECTION>__<KEY>=value`` override file values at any depth (values are parsed as
YAML, so ``8``, ``true``, ``0.1`` and ``{a: 1}`` get their types; a string key keeps the
text as it is), and ``KVPLUGIN_CONFIG_FILE`` names the file to load when no path is given.

Every field carries a description: ``tools/gen_config_doc.py`` renders them as
``docs/config.md``.

The modules: :mod:`~kvplugin.config.base` (the error type, strict models, problems at key
paths), :mod:`~kvplugin.config.schema` (the sections and the whole config),
:mod:`~kvplugin.config.offload` (the tiers), :mod:`~kvplugin.config.tenants`,
:mod:`~kvplugin.config.env` (environment overrides) and :mod:`~kvplugin.config.loader`
(files, validation). Import from ``kvplugin.config``: every public name is here.
"""

from __future__ import annotations

from kvplugin.config.base import ConfigError, Loc
from kvplugin.config.env import ENV_PREFIX, apply_env_overrides
from kvplugin.config.loader import CONFIG_FILE_ENV, CONFIG_SUFFIXES, C, load_config, validate
from kvplugin.config.offload import (
    AUTO_CHUNK_TARGET,
    CLUSTER_SCHEME,
    ENV_REF,
    GB,
    NATIVE_CHUNK_SIZE,
    OLD_TIER_NAMES,
    TEMP_DISK,
    TIER_KINDS,
    ConnectorSpec,
    OffloadConfigSection,
    directory_problem,
    redis_url_problem,
    resolve_chunk_size,
    unresolved_remote_url,
)
from kvplugin.config.schema import (
    FAULT_KINDS,
    EngineConfig,
    FaultKind,
    FaultsConfig,
    GroupConfig,
    KVPluginConfig,
    LayoutConfig,
    LimitsConfig,
    LinkTier,
    ModelConfig,
    ModelCostName,
    TierLinkConfig,
)
from kvplugin.config.tenants import PrefixGroupConfig, TenantQuotaConfig, TenantsConfig

__all__ = [
    "AUTO_CHUNK_TARGET",
    "CLUSTER_SCHEME",
    "CONFIG_FILE_ENV",
    "CONFIG_SUFFIXES",
    "ENV_PREFIX",
    "ENV_REF",
    "FAULT_KINDS",
    "GB",
    "NATIVE_CHUNK_SIZE",
    "OLD_TIER_NAMES",
    "TEMP_DISK",
    "TIER_KINDS",
    "C",
    "ConfigError",
    "ConnectorSpec",
    "EngineConfig",
    "FaultKind",
    "FaultsConfig",
    "GroupConfig",
    "KVPluginConfig",
    "LayoutConfig",
    "LimitsConfig",
    "LinkTier",
    "Loc",
    "ModelConfig",
    "ModelCostName",
    "OffloadConfigSection",
    "PrefixGroupConfig",
    "TenantQuotaConfig",
    "TenantsConfig",
    "TierLinkConfig",
    "apply_env_overrides",
    "directory_problem",
    "load_config",
    "redis_url_problem",
    "resolve_chunk_size",
    "unresolved_remote_url",
    "validate",
]
