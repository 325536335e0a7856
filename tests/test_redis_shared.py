"""A Redis tier shared across processes: ``kvplugin run`` twice against the test's own
redis-server, the second a fresh process (an empty device pool, an empty memory tier) with
the same workload seed, which gets its prefixes from Redis; tenants stay apart across
processes; and the tiered config runs against the same server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import redis as redis_py
from redis_fixture import local_redis, run_engine

from kvplugin.connectors.faults import LocalRedisServer

__all__ = ["local_redis"]  # the fixture, imported for pytest

REPO = Path(__file__).resolve().parent.parent
REQUESTS = "24"


def run(config: str, url: str, **env: str) -> dict[str, Any]:
    return run_engine(REPO / "configs" / config, REQUESTS, timeout=60,
                      KVPLUGIN_OFFLOAD__REMOTE_URL=url, **env)


def db_url(server: LocalRedisServer, db: int) -> str:
    return server.url.rsplit("/", 1)[0] + f"/{db}"


def keys_in(url: str) -> int:
    client = redis_py.Redis.from_url(url)
    try:
        return int(client.dbsize())
    finally:
        client.close()


def test_a_second_process_gets_its_prefixes_from_redis(local_redis: LocalRedisServer) -> None:
    url = db_url(local_redis, 1)
    first = run("redis.yaml", url)
    assert first["tiers"] == ["memory", "redis"]
    assert first["hit_tokens"]["redis"] == 0  # the server was empty
    stored = keys_in(url)
    assert stored > 0 and first["stores"] > 0
    second = run("redis.yaml", url)  # same seed, fresh process: only Redis remembers
    assert second["hit_tokens"]["redis"] > 0
    assert second["computed_prompt_tokens"] < first["computed_prompt_tokens"]
    # Other tenants (same prompts, same model) never read those objects.
    other = run("redis.yaml", url,
                KVPLUGIN_TENANTS__DECLARED="{ann: {}, bob: {}, cyd: {}}")
    assert other["hit_tokens"]["redis"] == 0
    assert keys_in(url) > stored  # their own objects, beside the others'


def test_tiered_config_runs_against_the_server(local_redis: LocalRedisServer) -> None:
    url = db_url(local_redis, 2)
    out = run("tiered.yaml", url)
    assert out["tiers"] == ["memory", "disk", "redis"]
    assert set(out["hit_tokens"]) == {"device", "memory", "disk", "redis"}
    assert keys_in(url) > 0  # written through to Redis
    again = run("tiered.yaml", url)  # a fresh temporary disk: Redis serves the misses
    assert again["hit_tokens"]["redis"] > 0
