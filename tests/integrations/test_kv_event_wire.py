"""kvplugin's KV events on ZMQ are vLLM's wire format: a subscriber using vLLM's own
decoder (under the vLLM side venv) reads the native engine's stream during a run in which
both tiers evict, and believes exactly the blocks each tier holds at the end."""

from __future__ import annotations

import asyncio
import json
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from side_venv import side_python

sys.path.insert(0, str(Path(__file__).parents[1] / "engine"))  # the engine tests' helpers
from engine_testlib import conversations, serve_all, small_config

from kvplugin.aio.jobs import connector_tiers
from kvplugin.aio.tier_events import tier_medium
from kvplugin.engine.build import deployment

pytestmark = pytest.mark.asyncio
SUBSCRIBER = Path(__file__).with_name("kv_event_subscriber.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def test_a_vllm_subscriber_reads_the_native_stream() -> None:
    py = side_python("KVPLUGIN_VLLM_PYTHON", "kvplugin-vllm-reference",
                     "tools/setup_vllm_side_venv.sh")
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    cfg = small_config(blocks=32, disk=True, engine={"kv_events_endpoint": endpoint},
                       offload={"max_local_cpu_size": 12e-6, "max_local_disk_size": 30e-6})
    async with deployment(cfg) as dep:
        sub = subprocess.Popen([py, str(SUBSCRIBER), endpoint], stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
        try:
            assert sub.stdout is not None and sub.stdout.readline().strip() == "ready"
            await asyncio.sleep(1.0)  # ZMQ's slow joiner: the subscription reaches us
            reqs = conversations(40, seed=1)
            await serve_all(dep.engine, reqs)
            await serve_all(dep.engine, [(f"again-{r}", p, t, m) for r, p, t, m in reqs])
            await dep.mgr.drain()
            dep.engine.flush_events()
            out, err = sub.communicate(timeout=60)
        finally:
            if sub.poll() is None:
                sub.kill()
        assert sub.returncode == 0, err[-3000:]
        got = json.loads(out.strip().splitlines()[-1])
        view = dep.mgr.tier_events
        assert view is not None
        for tier in connector_tiers(dep.connector):
            medium = tier_medium(tier.capabilities.tier)
            held = tier.objects()  # type: ignore[attr-defined]
            truth = sorted({h for sid in held for h in view._info[sid].block_hashes})
            assert got["believed"].get(medium, []) == truth, medium
            assert got["counts"][f"BlockRemoved {medium}"] > 0
        assert got["counts"]["BlockStored GPU"] > 0
        assert got["seqs"] == list(range(len(got["seqs"]))) and got["seqs"]
