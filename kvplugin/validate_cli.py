"""``kvplugin validate-config FILE [FILE...]``: check deployment configs without running them.

Each file is read, parsed and validated as ``kvplugin run`` would (the environment's
``KVPLUGIN_*`` overrides included, unless ``--no-env``):

* unknown keys, wrong types, values out of range;
* the rules that span sections: chunk size vs. block size, prefix groups vs. declared
  tenants, quotas vs. the tiers built, the Redis URL, the disk directory, extra connector
  kinds and their options;
* what the offload manager itself refuses (e.g. a store budget below one chunk), asked of a
  manager built over the layout on a throw-away tier (nothing is created or connected);
* whether the reference engine's workload can serve the tenancy (``kvplugin run``: e.g. a
  prefix group's ``max_prefix_tokens`` covers the system prompts it shares).

A layout the manager does not serve at all is valid: ``kvplugin run`` simulates it on the
core alone. Exit 0 with one ``OK <file>`` line per file when every file is valid; otherwise
exit 2, each invalid file's errors (file, key path, reason) on stderr.
"""

from __future__ import annotations

import argparse
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplugin.config import KVPluginConfig

__all__ = ["add_parser", "check_manager", "plain_text"]


def plain_text(doc: str) -> str:
    """A docstring as help text: reST's ``literals`` and :role:`targets` as plain words."""
    doc = re.sub(r":[a-z]+:`~?([^`]+)`", r"\1", doc)
    return doc.replace("``", "")


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``validate-config`` command to ``kvplugin``'s subparsers; its handler is
    :func:`kvplugin.cli.cmd_validate_config` (which loads the files as ``kvplugin run``
    does, with the engine's schema: the library here never imports the engine)."""
    p: argparse.ArgumentParser = subparsers.add_parser(
        "validate-config", help="validate deployment configs (exit 2 if any is invalid)",
        description=plain_text(__doc__ or ""),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", metavar="FILE", help="config files (YAML / TOML / JSON)")
    p.add_argument("--no-env", action="store_true",
                   help="ignore KVPLUGIN_* environment overrides: the files alone")
    return p


def check_manager(cfg: KVPluginConfig, source: str) -> None:
    """Build the offload manager over the layout, on a throw-away memory tier (no real tier
    is built: validating must not create directories or connect anywhere)."""
    from kvplugin.aio.manager import AsyncKVManager
    from kvplugin.config import ConfigError
    from kvplugin.connectors.memory import MemoryConnector
    from kvplugin.layouts import build_core, engine_supports
    from kvplugin.plugin import offload_config

    if not cfg.offload.enabled or engine_supports(cfg.layout, cfg.model) is not None:
        return
    core, ctx = build_core(cfg.layout, cfg.model)
    probe = MemoryConnector(capacity_bytes=1 << 20)
    try:
        AsyncKVManager(core, probe, offload_config(cfg), hash_context=ctx,
                       tenants=cfg.tenants.policy(tier_quotas=False))
    except ValueError as e:
        raise ConfigError(f"{source}: the offload manager refuses this configuration: "
                          f"{e}") from None
