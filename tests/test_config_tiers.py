"""Tier names in the config: the built-in tiers by kind, ``offload.connectors[]`` by their
``name`` (else their kind), one name per tier; tenant tier quotas checked against those
names with extra connectors too; the built-in tiers' eviction policies; and the
``kvplugin.config`` package's module sizes."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from layering_testlib import loaded_after

from kvplugin import registry
from kvplugin.config import TIER_KINDS, ConfigError, KVPluginConfig, validate
from kvplugin.connectors.eviction import policy_problem

REPO = Path(__file__).resolve().parent.parent
MEM = {"capacity_bytes": 1 << 20}  # a memory connector's options


def memory(name: str | None = None) -> dict[str, Any]:
    """An ``offload.connectors[]`` entry: a memory connector, named ``name`` if given."""
    return {"kind": "memory", "options": MEM, **({} if name is None else {"name": name})}


def offload(**keys: Any) -> dict[str, Any]:
    return {"offload": keys}


def problems(data: dict[str, Any]) -> list[str]:
    """The lines of the ConfigError that validating ``data`` raises."""
    with pytest.raises(ConfigError) as e:
        validate(data)
    head, *lines = str(e.value).splitlines()
    assert head == "<config>: invalid configuration"
    return [line.strip() for line in lines]


# ----------------------------------------------------------------------------- names


def test_tier_kinds_are_the_registrys_built_in_kinds_fastest_first() -> None:
    assert TIER_KINDS == tuple(registry.BUILTINS) == ("memory", "disk", "redis")


def test_tier_names_are_the_built_in_kinds_then_each_connectors_name_or_kind() -> None:
    assert KVPluginConfig().offload.tier_names() == ["memory", "disk"]
    off = validate(offload(remote_url="redis://localhost:6379/0", connectors=[
        memory("fast"), {"kind": "disk", "options": {"root": "/nowhere", **MEM}, "name": "cold"},
    ])).offload
    assert off.tier_names() == ["memory", "disk", "redis", "fast", "cold"]
    assert off.tier_kinds() == ["memory", "disk", "redis"]  # the built-in tiers only
    # Unnamed: a connector goes by its kind (here no built-in tier has that name).
    off = validate(offload(local_cpu=False, local_disk=None, connectors=[
        memory(), memory("second")])).offload
    assert off.tier_names() == ["memory", "second"]
    assert off.tier_kinds() == []
    assert off.connectors[0].name is None and off.connectors[1].name == "second"


def test_offload_off_has_no_tier_names() -> None:
    off = validate(offload(enabled=False, connectors=[memory("fast")])).offload
    assert off.tier_names() == [] and off.tier_kinds() == []


def test_two_tiers_with_one_name_are_an_error_at_the_later_ones_key() -> None:
    # Unnamed: located at its kind (the name it goes by), naming the built-in tier.
    assert problems(offload(connectors=[memory()])) == [
        "offload.connectors.0.kind: tier name 'memory' (its kind) is taken by the built-in "
        "memory tier (offload.local_cpu): give this connector a name"]
    # Named: located at its name, naming the other connector.
    assert problems(offload(connectors=[memory("fast"), memory("fast")])) == [
        "offload.connectors.1.name: tier name 'fast' is taken by offload.connectors.0: give "
        "this connector another name"]
    assert problems(offload(connectors=[memory("disk")])) == [
        "offload.connectors.0.name: tier name 'disk' is taken by the built-in disk tier "
        "(offload.local_disk): give this connector another name"]
    assert problems(offload(remote_url="redis://h:1/0", connectors=[
        {"kind": "redis", "options": {"url": "redis://h:2/0"}}])) == [
        "offload.connectors.0.kind: tier name 'redis' (its kind) is taken by the built-in "
        "redis tier (offload.remote_url): give this connector a name"]
    # A name set apart passes; so does a kind whose built-in tier is off.
    validate(offload(connectors=[memory("extra")]))
    validate(offload(local_cpu=False, connectors=[memory()]))


def test_a_name_is_a_non_empty_string() -> None:
    assert problems(offload(connectors=[memory("")])) == [
        "offload.connectors.0.name: String should have at least 1 character"]


# ----------------------------------------------------------------------------- quotas


def quota(tiers: dict[str, int]) -> dict[str, Any]:
    return {"tenants": {"declared": {"acme": {"max_tier_bytes": tiers}}}}


def test_tier_quotas_are_checked_against_the_names_with_connectors_too() -> None:
    cfg = validate({**offload(connectors=[memory("fast")]),
                    **quota({"memory": 1, "disk": 2, "fast": 3})})
    assert cfg.tenants.declared is not None
    assert cfg.tenants.declared["acme"].max_tier_bytes == {"memory": 1, "disk": 2, "fast": 3}
    # An unnamed connector goes by its kind.
    validate({**offload(local_cpu=False, connectors=[memory()]), **quota({"memory": 1})})
    assert problems({**offload(connectors=[memory("fast")]), **quota({"slow": 1})}) == [
        "tenants.declared.acme.max_tier_bytes.slow: no 'slow' tier: this deployment's tiers "
        "are ['memory', 'disk', 'fast']; offload.connectors[] tiers go by their name, else "
        "their kind"]
    assert problems({**offload(connectors=[memory("fast")]), **quota({"host": 1})}) == [
        "tenants.declared.acme.max_tier_bytes.host: the 'host' tier is now named 'memory'"]


def test_tier_quotas_without_connectors_and_with_offload_off_are_as_before() -> None:
    assert problems(quota({"redis": 1})) == [
        "tenants.declared.acme.max_tier_bytes.redis: no 'redis' tier: this deployment's "
        "tiers are ['memory', 'disk']"]
    # Offload off: tier quotas have nothing to limit and are left out, whatever they name.
    validate({**offload(enabled=False, connectors=[memory("fast")]), **quota({"slow": 1})})


# ----------------------------------------------------------------------------- eviction


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_built_in_tiers_take_an_eviction_policy(policy: str) -> None:
    off = validate(offload(local_cpu_eviction=policy, local_disk_eviction=policy)).offload
    assert (off.local_cpu_eviction, off.local_disk_eviction) == (policy, policy)
    assert KVPluginConfig().offload.local_cpu_eviction == "lru"
    assert KVPluginConfig().offload.local_disk_eviction == "lru"


@pytest.mark.parametrize("key", ["local_cpu_eviction", "local_disk_eviction"])
def test_an_unusable_eviction_policy_is_an_error_at_its_key(key: str) -> None:
    why = policy_problem("mru")
    assert why is not None and "mru" in why
    assert problems(offload(**{key: "mru"})) == [f"offload.{key}: {why}"]


# ----------------------------------------------------------------------------- package


def test_config_modules_stay_short() -> None:
    sizes = {p.name: len(p.read_text().splitlines())
             for p in (REPO / "kvplugin" / "config").glob("*.py")}
    assert {"__init__.py", "schema.py", "offload.py", "tenants.py", "env.py",
            "loader.py"} <= set(sizes)
    assert {name: n for name, n in sizes.items() if n >= 800} == {}


def test_importing_the_config_loads_no_policy_and_no_redis_client() -> None:
    loaded = loaded_after("kvplugin.config")
    assert "kvplugin.config.loader" in loaded
    assert sorted(m for m in loaded if m == "redis" or m.startswith(
        ("redis.", "kvplugin.connectors.eviction", "kvplugin.connectors.redis"))) == []
