"""What the side-venv scenario scripts (``vllm_tier_scenarios.py``, ``sglang_scenarios.py``)
share: a kvplugin deployment config written for a scenario, and their ``NAME[@PARAM]...``
entry point that prints one JSON record per scenario (read by ``side_venv.run_scenarios``).
Imports nothing but the standard library, so it loads in any side venv."""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Callable
from typing import Any


def write_config(root: str, name: str, offload: dict[str, Any], *, model: str,
                 tenants: dict[str, Any] | None = None,
                 faults: dict[str, Any] | None = None) -> str:
    """A JSON deployment config: no tier unless ``offload`` names one."""
    path = os.path.join(root, f"{name}.json")
    body: dict[str, Any] = {"model": {"name": model},
                            "offload": {"local_cpu": False, "local_disk": None, **offload}}
    if tenants is not None:
        body["tenants"] = tenants
    if faults is not None:
        body["faults"] = faults
    with open(path, "w") as f:
        json.dump(body, f)
    return path


def scenario_main(argv: list[str], prefix: str,
                  run: Callable[[str, str, str], dict[str, Any]]) -> int:
    """Run each ``NAME[@PARAM]`` as ``run(name, param, root)`` in a scratch directory of
    its own and print its record, tagged with the argument."""
    with tempfile.TemporaryDirectory(prefix=prefix) as workdir:
        for arg in argv:
            name, _, param = arg.partition("@")
            root = os.path.join(workdir, arg.replace("@", "_"))
            os.makedirs(root)
            rec = run(name, param, root)
            rec["scenario"] = arg
            print(json.dumps(rec), flush=True)
    return 0
