"""A third party's tier and eviction policy, from an installed package, chosen by a config:
each one module of the package plus its entry point (docs/extending.md), nothing of
kvplugin changed. Two tiers of the third party's one kind are told apart by name."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from plugin_testlib import example, install_package

from kvplugin.connectors.eviction import policy_problem
from kvplugin.plugin import load_plugin

REPO = Path(__file__).resolve().parents[1]

PACKAGE = '''
import dataclasses

from kvplugin.connectors.eviction import LRUPolicy
from kvplugin.connectors.memory import MemoryConnector


class WarmTier(MemoryConnector):
    """A tier of its own kind ("warmfs"), built on the memory tier."""

    def __init__(self, *, capacity_bytes: int, eviction: str = "lru") -> None:
        super().__init__(capacity_bytes=capacity_bytes, eviction=eviction)
        self.capabilities = dataclasses.replace(self.capabilities, tier="warmfs")


class Newest(LRUPolicy):
    """Evicts the most recently used object first."""

    name = "newest"

    def evict(self, incoming=None):
        return self._held.popitem()[0] if self._held else None
'''


@pytest.fixture
def third_party(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The package installed on sys.path: its module and a dist-info declaring both."""
    for name in list(os.environ):
        if name.startswith("KVPLUGIN_"):
            monkeypatch.delenv(name)
    install_package(tmp_path, monkeypatch, "kvp-warm", {"kvp_warm": PACKAGE},
                    "[kvplugin.connectors]\nwarmfs = kvp_warm:WarmTier\n\n"
                    "[kvplugin.eviction_policies]\nnewest = kvp_warm:Newest\n")


CONFIG = """\
offload:
  local_cpu: true
  local_cpu_eviction: arc
  local_disk: null
  connectors:
    - kind: warmfs
      name: warm
      options: {capacity_bytes: 4194304, eviction: newest}
    - kind: warmfs
      name: cold
      options: {capacity_bytes: 4194304}
tenants:
  default_quota:
    max_tier_bytes: {cold: 4194304}
"""


@pytest.mark.usefixtures("third_party")
def test_a_third_party_tier_and_policy_from_a_config(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text(CONFIG)

    async def built() -> tuple[list[str], list[str], list[str]]:
        async with load_plugin(f, env={}) as plugin:
            levels = list(plugin.connector.levels)  # type: ignore[union-attr]
            return ([t.name for t in levels], [t.capabilities.tier for t in levels],
                    [type(t.policy).__name__ for t in levels])  # type: ignore[attr-defined]
    names, kinds, policies = asyncio.run(built())
    assert names == ["memory", "warm", "cold"]
    assert kinds == ["memory", "warmfs", "warmfs"]
    assert policies == ["ARCPolicy", "Newest", "LRUPolicy"]
    assert policy_problem("newest") is None  # the entry point, by name
    # The engine example serves from them: the tiers named in its report, hits verified.
    out = asyncio.run(example().main_async(str(f)))
    assert out["tiers"] == ["memory", "warm", "cold"] and out["leaked_blocks"] == 0
    first, second = out["passes"]
    assert sum(second["hit_tokens"].values()) > 0
    assert first["mismatches"] == second["mismatches"] == 0


@pytest.mark.usefixtures("third_party")
def test_names_the_config_cannot_resolve_fail_with_their_key(tmp_path: Path) -> None:
    from kvplugin.config import ConfigError, load_config

    f = tmp_path / "c.yaml"
    f.write_text(CONFIG.replace("eviction: arc", "eviction: oldest"))
    with pytest.raises(ConfigError, match=r"offload\.local_cpu_eviction: unknown eviction "
                                          r"policy 'oldest'; known: arc, lru, newest; or give "
                                          r"a module:Class string"):
        load_config(f, env={})
    f.write_text(CONFIG.replace("{cold: 4194304}", "{tepid: 1}"))
    with pytest.raises(ConfigError, match=r"tenants\.default_quota\.max_tier_bytes\.tepid: no "
                                          r"'tepid' tier: this deployment's tiers are "
                                          r"\['memory', 'warm', 'cold'\]"):
        load_config(f, env={})
