"""The engine for synchronous callers: a deployment and its serving loop on a
:class:`~kvplugin.aio.loop.LoopThread`; ``generate`` blocks the calling thread only."""

from __future__ import annotations

import concurrent.futures
from collections.abc import Sequence
from contextlib import AbstractAsyncContextManager

from kvplugin.aio.loop import LoopThread
from kvplugin.engine.build import Deployment, TierWrapper, deployment
from kvplugin.engine.config import RunConfig
from kvplugin.engine.scheduler import Result

__all__ = ["EngineThread"]


class EngineThread:
    """``with EngineThread(cfg) as et: et.generate(...)`` from any thread."""

    def __init__(self, cfg: RunConfig, *, wrap_tiers: TierWrapper | None = None,
                 timeout: float = 60.0) -> None:
        self.timeout = timeout
        self.thread = LoopThread(use_uvloop=cfg.engine.uvloop)
        self._cm: AbstractAsyncContextManager[Deployment] = deployment(cfg,
                                                                       wrap_tiers=wrap_tiers)
        try:
            self.dep = self.thread.call(self._cm.__aenter__(), timeout)
        except BaseException:
            self.thread.close()
            raise
        self._runner: concurrent.futures.Future[None] = self.thread.submit(
            self.dep.engine.run())

    def generate(self, request_id: str, prompt: Sequence[int], *, tenant: str,
                 max_tokens: int, cache_salt: str | None = None,
                 lora: str | None = None) -> Result:
        coro = self.dep.engine.generate(request_id, prompt, tenant=tenant,
                                        max_tokens=max_tokens, cache_salt=cache_salt, lora=lora)
        return self.thread.call(coro, self.timeout)

    def close(self) -> None:
        """Let queued requests finish, close the deployment, stop the thread. Idempotent."""
        if not self.thread.running:
            return
        try:
            self.thread.call_soon(self.dep.engine.stop)
            self._runner.result(self.timeout)
            self.thread.call(self._cm.__aexit__(None, None, None), self.timeout)
        finally:
            self.thread.close()

    def __enter__(self) -> EngineThread:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
