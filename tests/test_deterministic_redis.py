"""Deterministic runs on a real redis-server (started here): the same seed on the same
starting state of the tiers gives the same run. A Redis tier outlives a run, so each run
gets a database of its own: a second run on the first one's database starts with what that
run stored (more hits), which is the tier's state, not timing (README: Reproducible runs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from redis_fixture import local_redis, run_engine

from kvplugin.connectors.faults import LocalRedisServer
from kvplugin.engine.report import decided

REPO = Path(__file__).resolve().parents[1]

__all__ = ["local_redis"]


@pytest.mark.parametrize("config", ["redis.yaml", "tiered.yaml"])
def test_same_seed_same_state_same_run(local_redis: LocalRedisServer, config: str) -> None:
    base = local_redis.url.rsplit("/", 1)[0]
    db = 1 if config == "redis.yaml" else 3
    runs = [run_engine(REPO / "configs" / config, "40", timeout=300,
                       KVPLUGIN_REDIS_URL=f"{base}/{db + i}") for i in range(2)]
    assert runs[0]["clock"] == "simulated" and runs[0]["tier_errors"]["redis"] == 0
    assert decided(runs[0]) == decided(runs[1])
    # The second run on the first run's database: it finds what that run stored.
    again = run_engine(REPO / "configs" / config, "40", timeout=300,
                       KVPLUGIN_REDIS_URL=f"{base}/{db}")
    assert again["hit_tokens"]["redis"] > runs[0]["hit_tokens"]["redis"] or \
        sum(again["hit_tokens"].values()) > sum(runs[0]["hit_tokens"].values())
