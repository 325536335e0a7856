"""examples/engine_integration.py: the minimal engine integration loads kvplugin from a
config, serves, hits the tiers on its second pass, checks every byte it did not compute,
and leaks nothing."""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvplugin.plugin import load_plugin

REPO = Path(__file__).resolve().parent.parent
EXAMPLE = REPO / "examples" / "engine_integration.py"


@pytest.fixture(scope="module")
def example() -> Any:
    spec = importlib.util.spec_from_file_location("engine_integration", EXAMPLE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(autouse=True)
def _no_env_overrides(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in list(os.environ):
        if name.startswith("KVPLUGIN_"):
            monkeypatch.delenv(name)


@pytest.mark.parametrize(("config", "tiers"), [
    (None, ["memory", "disk"]),
    ("multi_tenant.yaml", ["memory", "disk"]),
    ("two_groups_offload.yaml", ["memory", "disk"]),
])
def test_second_pass_hits_the_tiers(example: Any, config: str | None, tiers: list[str]) -> None:
    out = asyncio.run(example.main_async(None if config is None else
                                         str(REPO / "configs" / config)))
    assert out["tiers"] == tiers and out["leaked_blocks"] == 0
    first, second = out["passes"]
    # Pass 1: the shared system prompt is a device hit for each tenant's later requests;
    # the tiers were empty. Pass 2: the device was reset, every prompt's full blocks (8 of
    # 16 tokens: 96 system + 40 own tokens) come from the memory tier.
    assert first["hit_tokens"]["device"] > 0 and "memory" not in first["hit_tokens"]
    assert second["hit_tokens"] == {"device": 0, "memory": 12 * 128}
    assert first["mismatches"] == second["mismatches"] == 0


def test_the_check_catches_wrong_bytes(example: Any) -> None:
    """The example's check can fail: a model whose KV changed between the passes finds the
    loaded bytes wrong."""
    real = example.kv_of

    async def main() -> tuple[int, int]:
        async with load_plugin(env={}) as plugin:
            mgr = plugin.manager
            work = example.prompts(["acme"])
            counts = []
            for p in range(2):
                engine = example.ToyEngine(mgr)
                for i, (tenant, prompt) in enumerate(work):
                    engine.add(f"p{p}-{i}", tenant, prompt)
                await engine.serve()
                await mgr.drain()
                counts.append(engine.mismatches)
                mgr.core.reset_prefix_cache()
                example.kv_of = lambda tokens, upto: real([t + 1 for t in tokens], upto)
            return counts[0], counts[1]

    try:
        first, second = asyncio.run(main())
    finally:
        example.kv_of = real
    assert first == 0
    assert second == 12 * 128  # every loaded token's slot, in every one of the 12 requests


def test_runs_as_a_script() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVPLUGIN_")}
    proc = subprocess.run([sys.executable, str(EXAMPLE), str(REPO / "configs" / "tiered.yaml")],
                          capture_output=True, text=True, timeout=60,
                          env={**env, "KVPLUGIN_OFFLOAD__REMOTE_URL": "redis://127.0.0.1:1/0"})
    # Redis is unreachable here (port 1): the run still serves, from memory and disk.
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["tiers"] == ["memory", "disk", "redis"] and out["leaked_blocks"] == 0
    assert out["passes"][1]["hit_tokens"]["memory"] == 12 * 128
