"""``kvplugin.plugin.load_plugin`` (what an engine's startup calls), the reference engine's
deployment built on it, and third-party connectors through ``kvplugin.registry``."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
from plugin_testlib import example, install_package

from kvplugin import registry
from kvplugin.aio.manager import AsyncKVManager
from kvplugin.config import ConfigError, load_config, validate
from kvplugin.connectors import plugins
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.tiered import TieredConnector
from kvplugin.engine.build import deployment, workload_tenancy
from kvplugin.engine.config import RunConfig
from kvplugin.plugin import Plugin, load_plugin
from kvplugin.registry import RegistryError

REPO = Path(__file__).resolve().parent.parent
MODULE = __name__  # this module's import name: "test_plugin_loading"


class TinyConnector(MemoryConnector):
    """A third party's tier: a memory store under a tier kind of its own."""

    def __init__(self, *, capacity_kb: int, tier: str = "tiny") -> None:
        super().__init__(capacity_bytes=capacity_kb << 10, name=tier)
        self.capabilities = dataclasses.replace(self.capabilities, tier=tier)


def not_a_connector(**_: Any) -> object:
    return object()


@pytest.fixture(autouse=True)
def _isolated(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVPLUGIN_"):
            monkeypatch.delenv(name)
    monkeypatch.setattr(registry, "_registered", {})


def write(tmp_path: Path, text: str, name: str = "c.yaml") -> Path:
    p = tmp_path / name
    p.write_text(text)
    return p


# ----------------------------------------------------------------------------- lifecycle


def test_plugin_builds_the_configured_tiers_and_closes_them() -> None:
    async def main() -> str:
        async with load_plugin(env={}) as plugin:
            assert isinstance(plugin, Plugin) and isinstance(plugin.manager, AsyncKVManager)
            assert plugin.tier_labels == ["memory", "disk"]
            conn = plugin.connector
            assert isinstance(conn, TieredConnector)
            mem, disk = conn.tiers
            assert isinstance(mem, MemoryConnector) and isinstance(disk, DiskConnector)
            assert mem.capacity_bytes == int(0.001 * (1 << 30))  # the embedded default's
            assert os.path.isdir(disk.root) and plugin.config.layout.num_blocks == 160
            assert plugin.manager.memory.num_blocks == 160
            return disk.root
    root = asyncio.run(main())
    assert not os.path.exists(root)  # the temporary disk directory is removed


def test_plugin_sources(tmp_path: Path) -> None:
    f = write(tmp_path, "layout: {num_blocks: 96}\n")
    assert load_plugin(f, env={}).config.layout.num_blocks == 96
    assert load_plugin(str(f), env={"KVPLUGIN_LAYOUT__NUM_BLOCKS": "64"}
                       ).config.layout.num_blocks == 64
    assert load_plugin(env={"KVPLUGIN_CONFIG_FILE": str(f)}).config.layout.num_blocks == 96
    cfg = validate({"layout": {"num_blocks": 80}})
    assert load_plugin(cfg).config is cfg
    # A bad config fails at once, before anything is built.
    with pytest.raises(ConfigError, match=r"layout\.num_blocks"):
        load_plugin(write(tmp_path, "layout: {num_blocks: 1}\n"), env={})


def test_plugin_lifecycle_misuse() -> None:
    plugin = load_plugin(env={})
    with pytest.raises(RuntimeError, match="open it first"):
        _ = plugin.manager
    with pytest.raises(RuntimeError, match="open it first"):
        _ = plugin.connector

    async def main() -> None:
        await plugin.open()
        with pytest.raises(RuntimeError, match="already open"):
            await plugin.open()
        async with plugin:  # entering an open plugin uses it; leaving closes it
            pass
        await plugin.aclose()  # idempotent
        with pytest.raises(RuntimeError, match="already closed"):
            await plugin.open()
        with pytest.raises(RuntimeError, match="closed"):
            plugin.manager.new_request("r", [1, 2, 3], tenant="acme")
    asyncio.run(main())


def test_persistent_disk_directory_is_created_and_kept(tmp_path: Path) -> None:
    root = tmp_path / "kv" / "disk"
    f = write(tmp_path, f"offload:\n  local_disk: file://{root}\n")

    async def main() -> None:
        async with load_plugin(f, env={}) as plugin:
            assert isinstance(plugin.connector, TieredConnector)
            assert plugin.connector.tiers[1].root == str(root)  # type: ignore[attr-defined]
    asyncio.run(main())
    assert root.is_dir()


def test_disk_io_threads_are_passed_through(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int | None] = []

    class Recording(DiskConnector):
        def __init__(self, root: str, **kw: Any) -> None:
            seen.append(kw["io_threads"])
            super().__init__(root, **kw)

    monkeypatch.setattr("kvplugin.plugin.DiskConnector", Recording)

    async def main(env: dict[str, str]) -> None:
        async with load_plugin(env=env):
            pass
    asyncio.run(main({}))
    asyncio.run(main({"KVPLUGIN_OFFLOAD__DISK_IO_THREADS": "3"}))
    assert seen == [None, 3]


def test_local_cpu_reserve_faults_the_memory_tier_in_until_closed() -> None:
    from kvplugin.buffers import default_pool

    pool = default_pool()
    env = {"KVPLUGIN_OFFLOAD__LOCAL_CPU_RESERVE": "true",
           "KVPLUGIN_OFFLOAD__MAX_LOCAL_CPU_SIZE": "0.03"}  # 32 MB, 4 slabs of 8 MiB

    async def main() -> None:
        async with load_plugin(env=env) as plugin:
            mem = plugin.connector.tiers[0]  # type: ignore[attr-defined]
            assert isinstance(mem, MemoryConnector) and mem._reserved == mem.capacity_bytes
            assert pool._reserved >= mem.capacity_bytes
            assert pool.mapped_bytes >= mem.capacity_bytes
    before = pool._reserved
    asyncio.run(main())
    assert pool._reserved == before  # given back at close


def test_offload_off_builds_no_tier_and_drops_tier_quotas() -> None:
    path = REPO / "configs" / "multi_tenant.yaml"

    async def main() -> None:
        async with load_plugin(path, env={"KVPLUGIN_OFFLOAD__ENABLED": "false"}) as plugin:
            assert plugin.connector is None and plugin.manager.tiers == ()
            assert plugin.tier_labels == []
            q = plugin.manager.tenants.policy.quota("acme")
            assert q.max_blocks_in_use == 160 and dict(q.max_tier_bytes) == {}
    asyncio.run(main())


def test_the_manager_gets_the_configs_tenant_policy() -> None:
    async def main() -> None:
        async with load_plugin(REPO / "configs" / "multi_tenant.yaml", env={}) as plugin:
            mgr = plugin.manager
            policy = mgr.tenants.policy
            assert sorted(policy.tenants or {}) == ["acme", "globex", "initech"]
            assert dict(policy.quota("globex").max_tier_bytes) == {"memory": 16777216,
                                                                   "disk": 67108864}
            with pytest.raises(ValueError, match="unknown tenant 'mallory'"):
                mgr.new_request("r1", list(range(64)), tenant="mallory")
            with pytest.raises(ValueError, match="'initech' is not a member of prefix group"):
                mgr.new_request("r2", list(range(64)), tenant="initech",
                                prefix_group="shared-system", shared_prefix_tokens=32)
            mgr.new_request("r3", list(range(64)), tenant="acme",
                            prefix_group="shared-system", shared_prefix_tokens=32)
    asyncio.run(main())


def test_workload_tenancy() -> None:
    cfg = load_config(REPO / "configs" / "multi_tenant.yaml", env={}, schema=RunConfig)
    assert workload_tenancy(cfg) == (["acme", "globex", "initech"],
                                     {"shared-system": ["acme", "globex"]})
    assert workload_tenancy(load_config(env={}, schema=RunConfig)) == (None, {})
    open_groups = validate({"tenants": {"prefix_groups": [
        {"name": "g", "tenants": ["tenant0", "tenant2"], "max_prefix_tokens": 256}]}},
        schema=RunConfig)
    assert workload_tenancy(open_groups) == (None, {"g": ["tenant0", "tenant2"]})


def test_the_reference_deployment_builds_on_the_plugin() -> None:
    cfg = load_config(REPO / "configs" / "multi_tenant.yaml", env={}, schema=RunConfig)

    async def main(c: RunConfig) -> tuple[Any, ...]:
        async with deployment(c) as dep:
            return (dep.tier_labels, type(dep.connector).__name__,
                    dep.mgr.tenants.policy.quota("initech").max_blocks_in_use,
                    dep.engine.mgr is dep.mgr)
    assert asyncio.run(main(cfg)) == (["memory", "disk"], "TieredConnector", 128, True)
    off = cfg.model_copy(update={"offload": cfg.offload.model_copy(update={"enabled": False})})
    assert asyncio.run(main(off)) == ([], "NoneType", 128, True)


# ----------------------------------------------------------------------------- connectors


def tiny_config(tmp_path: Path, kind: str, extra: str = "", cpu: bool = False) -> Path:
    return write(tmp_path, (
        f"offload:\n  local_cpu: {str(cpu).lower()}\n  local_disk: null\n"
        f"  connectors:\n    - kind: {kind!r}\n      options: {{capacity_kb: 4096}}\n{extra}"))


def test_a_connector_by_module_path_serves_hits(tmp_path: Path) -> None:
    f = tiny_config(tmp_path, f"{MODULE}:TinyConnector")
    out = asyncio.run(example().main_async(str(f)))
    assert out["tiers"] == ["tiny"] and out["leaked_blocks"] == 0
    first, second = out["passes"]
    assert "tiny" not in first["hit_tokens"] and second["hit_tokens"]["tiny"] > 0
    assert first["mismatches"] == second["mismatches"] == 0


def test_extra_connectors_come_after_the_built_in_tiers(tmp_path: Path) -> None:
    quota = "tenants:\n  default_quota:\n    max_tier_bytes: {tiny: 1048576}\n"
    f = tiny_config(tmp_path, f"{MODULE}:TinyConnector", quota, cpu=True)

    async def main(path: Path) -> tuple[str, ...]:
        async with load_plugin(path, env={}) as plugin:
            return plugin.manager.tiers
    assert asyncio.run(main(f)) == ("memory", "tiny")
    # A quota on a tier no connector has: only the built manager can tell.
    bad = tiny_config(tmp_path, f"{MODULE}:TinyConnector",
                      "tenants:\n  default_quota:\n    max_tier_bytes: {disk: 1}\n")
    with pytest.raises(ConfigError, match=r"refuses this configuration: max_tier_bytes names "
                                          r"unknown tiers \['disk'\]"):
        asyncio.run(main(bad))


def test_a_connector_that_refuses_its_options_names_its_entry(tmp_path: Path) -> None:
    f = write(tmp_path, f"offload:\n  connectors:\n    - kind: {MODULE}:TinyConnector\n"
                        "      options: {capacity_kb: 0}\n")

    async def main() -> None:
        async with load_plugin(f, env={}):
            pass
    with pytest.raises(ConfigError, match=r"offload\.connectors\.0: connector kind "
                                          rf"'{MODULE}:TinyConnector' refused its options: "
                                          r"capacity_bytes must be a positive int"):
        asyncio.run(main())


def fake_entry_points(*eps: tuple[str, str]) -> Any:
    def entry_points(*, group: str) -> list[EntryPoint]:
        assert group == "kvplugin.connectors"
        return [EntryPoint(name, value, group) for name, value in eps]
    return entry_points


def test_entry_points_resolve_and_unknown_names_list_what_exists(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(plugins, "entry_points", fake_entry_points(
        ("tiny", f"{MODULE}:TinyConnector"), ("tiny", f"{MODULE}:TinyConnector")))
    assert registry.resolve("tiny") is TinyConnector  # declared twice, identically: harmless
    conn = registry.create("tiny", {"capacity_kb": 8})
    assert isinstance(conn, TinyConnector) and conn.capabilities.tier == "tiny"
    with pytest.raises(RegistryError) as e:
        registry.resolve("tinny")
    msg = str(e.value)
    assert msg.startswith("unknown connector kind 'tinny'; known kinds: disk: built-in")
    assert "memory: built-in" in msg and "redis: built-in" in msg
    assert f"tiny: entry point ({MODULE}:TinyConnector from an unnamed package)" in msg
    cfg = load_config(tiny_config(tmp_path, "tiny"), env={})
    assert cfg.offload.connectors[0].kind == "tiny"


def test_conflicting_entry_points_are_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(plugins, "entry_points", fake_entry_points(
        ("tiny", f"{MODULE}:TinyConnector"), ("tiny", "otherpkg:Tiny")))
    with pytest.raises(RegistryError, match="'tiny' is declared by several packages: "
                                            f"{MODULE}:TinyConnector"):
        registry.resolve("tiny")


@pytest.fixture
def installed_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A package installed on sys.path: a dist-info with an entry point, and its module."""
    install_package(tmp_path, monkeypatch, "kvp-tinyconn", {"kvp_tinyconn": (
        "import dataclasses\nfrom kvplugin.connectors.memory import MemoryConnector\n\n"
        "class Conn(MemoryConnector):\n"
        "    def __init__(self, *, capacity_bytes: int) -> None:\n"
        "        super().__init__(capacity_bytes=capacity_bytes)\n"
        "        self.capabilities = dataclasses.replace(self.capabilities, tier='tinyfs')\n")},
        "[kvplugin.connectors]\ntinyfs = kvp_tinyconn:Conn\n")


@pytest.mark.usefixtures("installed_plugin")
def test_an_installed_packages_entry_point(tmp_path: Path) -> None:
    assert registry.available()["tinyfs"] == "entry point (kvp_tinyconn:Conn from kvp-tinyconn)"
    f = write(tmp_path, "offload:\n  connectors:\n    - kind: tinyfs\n"
                        "      options: {capacity_bytes: 1048576}\n")

    async def main() -> tuple[str, ...]:
        async with load_plugin(f, env={}) as plugin:
            return plugin.manager.tiers
    assert asyncio.run(main()) == ("memory", "disk", "tinyfs")


def test_register_and_create_misuse() -> None:
    registry.register("tiny2", TinyConnector)
    registry.register("tiny2", TinyConnector)  # the same again: harmless
    assert registry.resolve("tiny2") is TinyConnector
    with pytest.raises(RegistryError, match="'tiny2' is already registered"):
        registry.register("tiny2", MemoryConnector)
    with pytest.raises(RegistryError, match="'memory' is a built-in connector kind"):
        registry.register("memory", TinyConnector)
    with pytest.raises(RegistryError, match="has no ':'"):
        registry.register("a:b", TinyConnector)
    with pytest.raises(RegistryError, match=r"built object, not a kvplugin\.connectors\.base"
                                            r"\.Connector"):
        registry.create(f"{MODULE}:not_a_connector")
    with pytest.raises(RegistryError, match=r"does not take these options \(got an unexpected "
                                            r"keyword argument 'size'\); it takes: capacity_kb, "
                                            r"tier"):
        registry.create(f"{MODULE}:TinyConnector", {"capacity_kb": 1, "size": 1})
    with pytest.raises(RegistryError, match="has no 'Nope'"):
        registry.resolve(f"{MODULE}:Nope")
    with pytest.raises(RegistryError, match="it takes: url, prefix, ttl_seconds"):
        registry.create("redis", {"host": "x"})
    redis = registry.create("redis", {"url": "redis://127.0.0.1:1/0", "prefix": "t:"})
    assert redis.capabilities.tier == "redis"


def test_a_kind_naming_the_old_top_level_package_gets_a_hint(
        monkeypatch: pytest.MonkeyPatch) -> None:
    # As in an installed kvplugin: no top-level "connectors" (in a checkout the folder
    # itself would import from the repository root).
    monkeypatch.setitem(sys.modules, "connectors", None)
    monkeypatch.delitem(sys.modules, "connectors.disk", raising=False)
    with pytest.raises(RegistryError, match=r"cannot import 'connectors\.disk': "
                                            r"ModuleNotFoundError: .*\(kvplugin's connectors "
                                            r"are kvplugin\.connectors\.disk\)$"):
        registry.resolve("connectors.disk:DiskConnector")
