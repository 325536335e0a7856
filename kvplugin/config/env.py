"""Environment overrides: ``KVPLUGIN_<SECTION>__<KEY>=value`` sets a key at any depth."""

from __future__ import annotations

import json
import types
import typing
from collections.abc import Mapping
from typing import Any

import yaml
from pydantic import BaseModel

from kvplugin.config.base import ConfigError, Loc
from kvplugin.config.schema import KVPluginConfig

ENV_PREFIX = "KVPLUGIN_"


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

