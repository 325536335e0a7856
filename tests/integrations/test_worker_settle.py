"""The vLLM worker half reports every store's end exactly once, even one that ends while
``get_finished`` is looking at it (found by test_dead_tier_never_stalls_vllm: a plan left
open for good, its bytes held against the store budget)."""

from __future__ import annotations

import concurrent.futures
import json
from pathlib import Path

from kvplugin.integrations import _runtime
from kvplugin.integrations._worker import WorkerSide, _Put


class _EndsWhileLooked(concurrent.futures.Future[list[int | None]]):
    """A put that is still running at the first look and done at every later one."""

    def __init__(self) -> None:
        super().__init__()
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        if self.looks == 2 and not super().done():
            self.set_result([1])
        return self.looks > 1


def test_a_put_ending_between_two_looks_is_reported_once(tmp_path: Path) -> None:
    cfg = tmp_path / "w.json"
    cfg.write_text(json.dumps({"offload": {"local_cpu": True, "local_disk": None}}))
    rt = _runtime.acquire(str(cfg))
    try:
        w = WorkerSide(rt, [], 1, events=False, feed=False)
        fut = _EndsWhileLooked()
        w._w.saves["r"] = [_Put(7, fut, [])]
        reported = []
        for _ in range(3):
            w.get_finished()
            meta = w.build_connector_worker_meta()
            if meta is not None:
                reported += [(s.plan, s.ok) for s in meta.stores]
        assert reported == [(7, True)]
        assert w._w.saves == {}
    finally:
        _runtime.release(rt)
