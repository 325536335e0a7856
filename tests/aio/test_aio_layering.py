"""Layering of the async layer: the core and the connectors never import it, and it loads
in a fresh interpreter without pulling in the CLI or the simulation."""

from __future__ import annotations

import ast
from pathlib import Path

from layering_testlib import loaded_after

REPO = Path(__file__).resolve().parents[2]
AIO = ["kvplugin.aio", "kvplugin.aio.manager", "kvplugin.aio.jobs", "kvplugin.aio.plans",
       "kvplugin.aio.memory", "kvplugin.aio.keys", "kvplugin.aio.values",
       "kvplugin.aio.reqstate", "kvplugin.aio.stores", "kvplugin.aio.loads",
       "kvplugin.aio.tenants", "kvplugin.aio.ledger", "kvplugin.aio.tier_events",
       "kvplugin.aio.loadcost", "kvplugin.aio.probe", "kvplugin.aio.loop",
       "kvplugin.aio.holdings", "kvplugin.aio.offload_ledger", "kvplugin.aio.admission",
       "kvplugin.aio.objects", "kvplugin.aio.offload_types", "kvplugin.aio.group_kinds"]


def _static_imports(root: Path) -> list[tuple[Path, int, str]]:
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                found += [(path, node.lineno, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                found.append((path, node.lineno, node.module))
    return found


def _is_aio(module: str) -> bool:
    return module == "kvplugin.aio" or module.startswith("kvplugin.aio.")


def test_core_and_connectors_never_name_the_async_layer() -> None:
    for root in (REPO / "kvplugin" / "core", REPO / "connectors"):
        bad = [(p.relative_to(REPO), line, m) for p, line, m in _static_imports(root)
               if _is_aio(m)]
        assert not bad, bad


def test_core_and_connectors_never_load_the_async_layer() -> None:
    core = [f"kvplugin.core.{p.stem}" for p in (REPO / "kvplugin" / "core").glob("*.py")
            if p.stem != "__init__"]
    conns = [f"kvplugin.connectors.{p.stem}" for p in (REPO / "connectors").glob("*.py")
             if p.stem != "__init__"]
    loaded = loaded_after(*core, *conns)
    assert set(core) <= loaded and set(conns) <= loaded
    assert not {m for m in loaded if _is_aio(m)}


def test_async_layer_imports_cleanly_and_alone() -> None:
    loaded = loaded_after(*AIO)
    assert set(AIO) <= loaded
    assert not {m for m in loaded if m in ("kvplugin.cli", "kvplugin.sim", "kvplugin.replay")}
    assert {p.stem for p in (REPO / "kvplugin" / "aio").glob("*.py")} - {"__init__"} \
        == {m.rsplit(".", 1)[1] for m in AIO[1:]}


# The core's internals the async layer must not name: it asks the core's OffloadView.
CORE_INTERNALS = {"block_pool", "coordinator", "single_type_managers",
                  "cached_block_hash_to_block", "free_block_queue", "_reuse_watchers"}


def test_async_layer_reaches_the_core_only_through_its_view() -> None:
    bad = []
    for path in sorted((REPO / "kvplugin" / "aio").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Attribute) and node.attr in CORE_INTERNALS:
                bad.append((path.relative_to(REPO), node.lineno, node.attr))
    assert not bad, bad


# The offload ledger's state machine and the decisions it takes: synchronous, no I/O, no
# core objects (both integrations execute it; neither's runtime may leak in).
PURE = ["offload_ledger", "offload_types", "plans", "holdings", "group_kinds"]
PURE_MAY_IMPORT = {"__future__", "collections.abc", "dataclasses", "enum", "typing", "itertools",
                   "math", "types", "kvplugin.aio", "kvplugin.aio.plans",
                   "kvplugin.aio.holdings", "kvplugin.aio.keys", "kvplugin.aio.values",
                   "kvplugin.aio.offload_types", "kvplugin.aio.group_kinds",
                   "kvplugin.core", "kvplugin.core.specs",
                   "kvplugin.connectors.events", "kvplugin.connectors.keys",
                   "kvplugin.core.single_type.mamba_checkpoints"}


def test_the_offload_ledger_is_synchronous_and_pure() -> None:
    for name in PURE:
        path = REPO / "kvplugin" / "aio" / f"{name}.py"
        tree = ast.parse(path.read_text(), filename=str(path))
        imports = {m for p, _, m in _static_imports(path.parent) if p == path}
        assert imports <= PURE_MAY_IMPORT, (name, sorted(imports - PURE_MAY_IMPORT))
        asyncs = [n.lineno for n in ast.walk(tree)
                  if isinstance(n, ast.AsyncFunctionDef | ast.Await | ast.AsyncWith)]
        assert not asyncs, (name, asyncs)


def test_the_offload_ledger_loads_nothing_else_in_a_fresh_interpreter() -> None:
    """What importing the offload core really loads (the static check above sees one file's
    imports, not what they pull in): no event loop, no numpy or pyarrow, no core manager,
    no host memory, no object format."""
    loaded = loaded_after("kvplugin.aio.offload_ledger")
    ours = {m for m in loaded if m.split(".")[0] == "kvplugin"}
    assert ours == {
        "kvplugin", "kvplugin.aio", "kvplugin.aio.group_kinds", "kvplugin.aio.holdings",
        "kvplugin.aio.keys", "kvplugin.aio.offload_ledger", "kvplugin.aio.offload_types",
        "kvplugin.aio.plans", "kvplugin.aio.values", "kvplugin.connectors",
        "kvplugin.connectors.events", "kvplugin.connectors.keys", "kvplugin.core",
        "kvplugin.core.single_type", "kvplugin.core.single_type.mamba_checkpoints",
        "kvplugin.core.specs"}
    for heavy in ("asyncio", "numpy", "pyarrow", "redis", "concurrent.futures"):
        assert heavy not in loaded, heavy
