"""Two engine processes sharing a Redis Cluster: ``kvplugin run --config
configs/redis_cluster.yaml`` twice against the test session's own cluster; the second, a
fresh process (an empty device pool and memory tier) with the same workload seed, gets its
prefixes from the cluster, and other tenants never read them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from redis_fixture import run_engine

from kvplugin.connectors.cluster_testing import LocalRedisCluster

REPO = Path(__file__).resolve().parents[2]
REQUESTS = "24"


def run(url: str, **env: str) -> dict[str, Any]:
    return run_engine(REPO / "configs" / "redis_cluster.yaml", REQUESTS, timeout=120,
                      KVPLUGIN_OFFLOAD__REMOTE_URL=url, **env)


def sizes(cluster: LocalRedisCluster) -> list[int]:
    """Objects on each master."""
    out = []
    for port in cluster.masters_ports():
        with cluster.client(port) as client:
            out.append(int(client.dbsize()))
    return out


def test_a_second_engine_gets_its_prefixes_from_the_cluster(
    redis_cluster: LocalRedisCluster,
) -> None:
    for port in redis_cluster.masters_ports():  # objects of earlier tests, not this one's
        redis_cluster.command(port, "FLUSHALL")
    first = run(redis_cluster.url)
    assert first["tiers"] == ["memory", "redis"]
    assert first["hit_tokens"]["redis"] == 0  # the cluster was empty
    stored = sizes(redis_cluster)
    assert first["stores"] > 0 and all(n > 0 for n in stored)  # spread over the masters
    second = run(redis_cluster.url)  # same seed, fresh process: only the cluster remembers
    assert second["hit_tokens"]["redis"] > 0
    assert second["computed_prompt_tokens"] < first["computed_prompt_tokens"]
    other = run(redis_cluster.url, KVPLUGIN_TENANTS__DECLARED="{ann: {}, bob: {}, cyd: {}}")
    assert other["hit_tokens"]["redis"] == 0  # other tenants never read those objects
    assert sum(sizes(redis_cluster)) > sum(stored)
