"""Connector kinds by name: the built-in tiers, third-party ones, explicit import paths.

A kind (``offload.connectors[].kind`` in a config) is resolved, in this order, as

* a ``module:attr`` string (``"mypkg.conn:MyConnector"``): imported as it says;
* a name given to :func:`register` in this process;
* a built-in: ``memory``, ``disk``, ``redis`` (the built-ins cannot be shadowed);
* an entry point of the ``kvplugin.connectors`` group, which a package declares in its
  metadata (``[project.entry-points."kvplugin.connectors"] myconn = "mypkg.conn:MyConnector"``).

What a kind resolves to is a *factory*: a connector class or any callable that returns a
:class:`kvplugin.connectors.base.Connector`, called with the spec's ``options`` as keyword arguments
(``redis`` takes :class:`kvplugin.connectors.redis.RedisOptions`' fields). Registering or
declaring the same factory twice is harmless; two different ones under one name are an
error, never a silent pick. A name that resolves to nothing is an error that lists what
exists.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from importlib.metadata import EntryPoint
from typing import Any

from kvplugin.connectors import plugins
from kvplugin.connectors.base import Connector

__all__ = [
    "BUILTINS",
    "ENTRY_POINT_GROUP",
    "RegistryError",
    "available",
    "check_options",
    "create",
    "discover",
    "register",
    "resolve",
]

ENTRY_POINT_GROUP = "kvplugin.connectors"
Factory = Callable[..., Connector]

# In tier order, fastest first: kvplugin.config.TIER_KINDS is these keys, in this order.
BUILTINS: dict[str, str] = {
    "memory": "kvplugin.connectors.memory:MemoryConnector",
    "disk": "kvplugin.connectors.disk:DiskConnector",
    "redis": "kvplugin.registry:redis_connector",
}

_registered: dict[str, Factory] = {}


class RegistryError(ValueError):
    """A connector kind that does not resolve, or options its factory does not take."""


def redis_connector(**options: Any) -> Connector:
    """The ``redis`` kind: a RedisConnector over ``RedisOptions(**options)``."""
    from kvplugin.connectors.redis import RedisConnector, RedisOptions

    return RedisConnector(RedisOptions(**options))


def _redis_signature() -> inspect.Signature:
    from kvplugin.connectors.redis import RedisOptions

    return inspect.signature(RedisOptions)


def register(name: str, factory: Factory) -> None:
    """Make ``name`` a connector kind in this process (the same factory again: no-op)."""
    if not name or ":" in name:
        raise RegistryError(f"a connector kind name is non-empty and has no ':', got {name!r}")
    if name in BUILTINS:
        raise RegistryError(f"{name!r} is a built-in connector kind")
    old = _registered.get(name)
    if old is not None and old is not factory:
        raise RegistryError(f"connector kind {name!r} is already registered as {old!r}")
    _registered[name] = factory


def discover() -> dict[str, list[EntryPoint]]:
    """The ``kvplugin.connectors`` entry points of the installed packages, by name."""
    return plugins.discover(ENTRY_POINT_GROUP)


def available() -> dict[str, str]:
    """Every kind by name -> where it comes from (for error messages and ``--help``)."""
    out = {name: f"built-in ({target})" for name, target in BUILTINS.items()}
    for name, eps in discover().items():
        if name not in out:
            out[name] = "entry point (" + " | ".join(
                f"{e.value} from {plugins.dist_name(e)}" for e in eps) + ")"
    for name, factory in _registered.items():
        out.setdefault(name, f"registered ({getattr(factory, '__qualname__', factory)!r})")
    return out


def _known() -> str:
    return "; ".join(f"{n}: {w}" for n, w in sorted(available().items()))


def _import(target: str, kind: str) -> Any:
    try:
        return plugins.import_target(target, f"connector kind {kind!r}")
    except plugins.PluginError as e:
        raise RegistryError(str(e)) from None


def resolve(kind: str) -> Factory:
    """The factory of ``kind`` (RegistryError naming every known kind when there is none)."""
    if ":" in kind:
        factory = _import(kind, kind)
    elif kind in _registered:
        factory = _registered[kind]
    elif kind in BUILTINS:
        factory = _import(BUILTINS[kind], kind)
    else:
        eps = discover().get(kind)
        if not eps:
            raise RegistryError(f"unknown connector kind {kind!r}; known kinds: {_known()}; "
                                f"or give a module:Class string")
        try:
            factory = plugins.load_entry_point(eps, f"connector kind {kind!r}")
        except plugins.PluginError as e:
            raise RegistryError(str(e)) from None
    if not callable(factory):
        raise RegistryError(f"connector kind {kind!r} resolves to {factory!r}, which is not "
                            "callable (a Connector class or factory)")
    return factory  # type: ignore[no-any-return]


def check_options(kind: str, factory: Factory, options: Mapping[str, Any]) -> None:
    """RegistryError when ``factory`` cannot take ``options`` (checked on its signature,
    without building anything)."""
    if factory is redis_connector:
        sig = _redis_signature()
    else:
        try:
            sig = inspect.signature(factory)
        except (TypeError, ValueError):
            return  # no signature to check against (a builtin callable): the call will tell
    try:
        sig.bind(**options)
    except TypeError as e:
        takes = ", ".join(p.name for p in sig.parameters.values()
                          if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)) or "nothing"
        raise RegistryError(f"connector kind {kind!r} does not take these options ({e}); "
                            f"it takes: {takes}") from None


def create(kind: str, options: Mapping[str, Any] | None = None) -> Connector:
    """A connector of ``kind`` built with ``options``."""
    factory = resolve(kind)
    opts = dict(options or {})
    check_options(kind, factory, opts)
    try:
        conn = factory(**opts)
    except (TypeError, ValueError) as e:
        raise RegistryError(f"connector kind {kind!r} refused its options: {e}") from None
    if not isinstance(conn, Connector):
        raise RegistryError(f"connector kind {kind!r} built {type(conn).__name__}, not a "
                            "kvplugin.connectors.base.Connector")
    return conn
