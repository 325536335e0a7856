"""Redis Cluster URLs and options: ``redis-cluster://[user[:password]@]host:port[,...]``.

The options are the single-node connector's (:class:`~connectors.redis.RedisOptions`,
checked the same way) plus ``max_redirects``; the URL names startup nodes (any reachable
ones will do, the rest are discovered) and the credentials every node shares. A cluster has
only database 0, so the URL takes no database, path or query.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from connectors.redis import RedisOptions
from connectors.redis_common import public_url

__all__ = ["SCHEME", "RedisClusterOptions", "is_cluster_url", "remote_url_problem"]

SCHEME = "redis-cluster"


def _parse_nodes(url: str) -> tuple[str | None, str | None, tuple[tuple[str, int], ...]]:
    """(username, password, startup nodes) of a ``redis-cluster://`` URL; ValueError."""
    scheme, sep, rest = url.partition("://")
    if not sep or scheme != SCHEME:
        raise ValueError(f"not a {SCHEME}:// URL: {public_url(url)}")
    netloc, _, tail = rest.partition("/")
    if tail not in ("", "0") or "?" in rest or "#" in rest:
        raise ValueError(
            f"{SCHEME}:// takes no database, path or query (a cluster has only db 0): "
            f"{public_url(url)}"
        )
    userinfo, at, hosts = netloc.rpartition("@")
    user = password = None
    if at:
        name, colon, secret = userinfo.partition(":")
        user = unquote(name) or None
        password = unquote(secret) if colon else None
    nodes = tuple(_host_port(part, url) for part in hosts.split(","))
    return user, password, nodes


def _host_port(part: str, url: str) -> tuple[str, int]:
    if part.startswith("["):  # [IPv6]:port
        host, _, port = part[1:].partition("]")
        port = port.removeprefix(":")
    else:
        host, _, port = part.rpartition(":") if ":" in part else (part, "", "")
    if not host or any(c in host for c in "[]@/ "):
        raise ValueError(f"bad node {part!r} in {public_url(url)}: expected host:port")
    if not port:
        return host, 6379
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"bad port in node {part!r} of {public_url(url)}")
    return host, int(port)


@dataclass(frozen=True, slots=True)
class RedisClusterOptions:
    """Cluster connection, batching and failure-handling settings (times in seconds).

    The fields are :class:`~connectors.redis.RedisOptions`' (``max_connections`` is per
    node) plus ``max_redirects``; ``url`` is a ``redis-cluster://`` URL."""

    url: str = f"{SCHEME}://127.0.0.1:7000"
    prefix: str = "kvp:"
    ttl_seconds: int | None = None
    max_connections: int = 16
    socket_timeout: float = 1.0
    connect_timeout: float = 0.5
    retries: int = 2
    backoff_base: float = 0.01
    backoff_cap: float = 0.25
    breaker_threshold: int = 5
    breaker_cooldown: float = 1.0
    lookup_batch: int = 64
    get_batch: int = 32
    max_redirects: int = 5
    username: str | None = field(init=False, repr=False, compare=False)
    password: str | None = field(init=False, repr=False, compare=False)
    nodes: tuple[tuple[str, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        user, password, nodes = _parse_nodes(self.url)
        object.__setattr__(self, "username", user)
        object.__setattr__(self, "password", password)
        object.__setattr__(self, "nodes", nodes)
        if type(self.max_redirects) is not int or self.max_redirects < 1:
            raise ValueError("max_redirects must be a positive int")
        # Everything else is checked the way the single-node connector checks it.
        RedisOptions(**{k: getattr(self, k) for k in _SHARED if k != "url"})

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisClusterOptions:
        """Options for ``url`` (``redis-cluster://...``), the other fields as given."""
        return cls(url=url, **options)

    def __repr__(self) -> str:
        # Options get logged; the URL may carry a password.
        shown = ", ".join(
            f"{name}={public_url(self.url) if name == 'url' else getattr(self, name)!r}"
            for name in _FIELDS
        )
        return f"RedisClusterOptions({shown})"


_DERIVED = ("username", "password", "nodes")
_FIELDS = [f for f in RedisClusterOptions.__dataclass_fields__ if f not in _DERIVED]
_SHARED = [f for f in _FIELDS if f in RedisOptions.__dataclass_fields__]


def is_cluster_url(url: str) -> bool:
    return url.startswith(f"{SCHEME}://")


def remote_url_problem(url: str) -> str | None:
    """Why a ``redis-cluster://`` URL is unusable (None: it is fine). Other schemes are the
    single-node tier's business (``kvplugin.config.redis_url_problem``)."""
    try:
        _parse_nodes(url)
    except ValueError as exc:
        return f"remote_url: {exc}"
    return None
