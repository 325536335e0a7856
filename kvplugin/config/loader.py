"""Loading: a YAML / TOML / JSON file (or the embedded default), the environment's
overrides and references, then validation with every problem at its key path."""

from __future__ import annotations

import json
import os
import tomllib
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any, TypeVar, overload

import yaml
from pydantic import ValidationError

from kvplugin.config.base import ConfigError, Loc
from kvplugin.config.env import _env_overrides
from kvplugin.config.offload import _ENV_NAME, unresolved_remote_url
from kvplugin.config.schema import KVPluginConfig

CONFIG_FILE_ENV = "KVPLUGIN_CONFIG_FILE"  # the file load_config(None) reads, when set
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
