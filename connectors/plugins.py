"""Finding a plug-in by name: a ``module:attr`` string, or an entry point of a group.

The one lookup behind every pluggable family (connector kinds in :mod:`kvplugin.registry`,
eviction policies in :mod:`kvplugin.connectors.eviction`): each family keeps its own
built-ins and error type, and asks here for the rest, so a third party declares any of
them the same way (``[project.entry-points."<group>"] name = "pkg.mod:Class"``).
"""

from __future__ import annotations

import importlib
from importlib.metadata import EntryPoint, entry_points
from typing import Any

__all__ = ["PluginError", "discover", "dist_name", "import_target", "load_entry_point"]


class PluginError(ValueError):
    """A name that does not resolve to a plug-in (the message says why, and what exists)."""


def import_target(target: str, what: str) -> Any:
    """The object a ``module:attr`` string names (``attr`` may be dotted); ``what`` names
    the plug-in in the error ("connector kind 'x'")."""
    module, _, attr = target.partition(":")
    if not module or not attr:
        raise PluginError(f"{what}: {target!r} is not a module:attr string")
    try:
        obj: Any = importlib.import_module(module)
    except Exception as e:  # missing, or broken: either way the name does not resolve
        raise PluginError(f"{what}: cannot import {module!r}: {type(e).__name__}: {e}"
                          f"{_renamed_hint(module)}") from None
    for part in attr.split("."):
        try:
            obj = getattr(obj, part)
        except AttributeError:
            raise PluginError(f"{what}: module {module!r} has no {attr!r}") from None
    return obj


def _renamed_hint(module: str) -> str:
    # kvplugin's connectors were a top-level ``connectors`` package before 0.1 shipped; a
    # config written then names e.g. connectors.disk:DiskConnector (which, in an environment
    # with PyPI's unrelated ``connectors``, would import that one instead).
    if module == "connectors" or module.startswith("connectors."):
        return f" (kvplugin's connectors are kvplugin.{module})"
    return ""


def discover(group: str) -> dict[str, list[EntryPoint]]:
    """The entry points of ``group`` in the installed packages, by name (one package seen
    twice on the path counts once)."""
    out: dict[str, list[EntryPoint]] = {}
    for ep in entry_points(group=group):
        same = out.setdefault(ep.name, [])
        if all(e.value != ep.value for e in same):
            same.append(ep)
    return out


def dist_name(ep: EntryPoint) -> str:
    dist = getattr(ep, "dist", None)
    return getattr(dist, "name", None) or "an unnamed package"


def load_entry_point(eps: list[EntryPoint], what: str) -> Any:
    """The object of the one entry point declared under a name; several packages declaring
    one name is an error, never a silent pick."""
    if len(eps) > 1:
        raise PluginError(f"{what} is declared by several packages: "
                          + ", ".join(f"{e.value} ({dist_name(e)})" for e in eps))
    try:
        return eps[0].load()
    except Exception as e:  # a broken third-party package: say which, and why
        raise PluginError(f"{what}: entry point {eps[0].value} ({dist_name(eps[0])}) does "
                          f"not load: {e!r}") from None
