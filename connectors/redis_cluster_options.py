"""Redis Cluster URLs and options: ``redis-cluster://[user[:password]@]host:port[,...]``.

The options are the single-node connector's (:class:`~kvplugin.connectors.redis.RedisOptions`,
checked the same way) plus ``max_redirects``; the URL names startup nodes (any reachable
ones will do, the rest are discovered) and the credentials every node shares. A cluster has
only database 0, so the URL takes no database, path or query.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from kvplugin.connectors.redis import RedisOptions
from kvplugin.connectors.redis_common import public_url

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


@dataclass(frozen=True, slots=True, repr=False)  # RedisOptions' repr: no password shown
class RedisClusterOptions(RedisOptions):
    """Cluster connection, batching and failure-handling settings (times in seconds):
    :class:`~kvplugin.connectors.redis.RedisOptions`' fields, checked the same way
    (``max_connections`` is per node), plus ``max_redirects``; ``url`` is a
    ``redis-cluster://`` URL."""

    url: str = f"{SCHEME}://127.0.0.1:7000"
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
        RedisOptions.__post_init__(self)  # (slots dataclasses cannot use a bare super())

    @classmethod
    def from_url(cls, url: str, **options: Any) -> RedisClusterOptions:
        """Options for ``url`` (``redis-cluster://...``), the other fields as given."""
        return cls(url=url, **options)


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
