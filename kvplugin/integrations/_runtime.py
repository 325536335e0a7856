"""The engine-independent half of the vLLM connector: the kvplugin tiers of a deployment
config, an event loop on its own thread to drive them, and the keys.

vLLM builds one connector per role (the scheduler's and each worker's), usually in
different processes. Only workers open the tiers (the scheduler asks the worker,
:mod:`._lookup`); workers of one process share one :class:`Runtime` per config file
(reference counted), so a disk tier's directory lock is taken once. Nothing here imports
vLLM or torch.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvplugin.aio.keys import KeySpace
from kvplugin.aio.loop import LoopThread
from kvplugin.aio.memory import GroupShape
from kvplugin.config import KVPluginConfig, load_config
from kvplugin.connectors.base import Connector
from kvplugin.connectors.events import TierEvent
from kvplugin.connectors.faults import FaultInjector
from kvplugin.plugin import build_connector, fault_wrapper, offload_config

__all__ = ["Runtime", "Timeouts", "acquire", "keyspace_for", "release", "settings"]


@dataclass(frozen=True, slots=True)
class Timeouts:
    lookup: float
    load: float
    store: float


def _timeouts(config: KVPluginConfig, source: str) -> Timeouts:
    if not config.offload.enabled:
        raise ValueError(f"{source}: offload is disabled; the vLLM connector needs a tier")
    oc = offload_config(config)
    return Timeouts(oc.lookup_timeout, oc.load_timeout, oc.store_timeout)


def settings(config_file: str) -> tuple[KVPluginConfig, Timeouts]:
    """A deployment config and its timeouts, without opening any tier (the scheduler's
    side: it looks up through the worker, :mod:`._lookup`)."""
    path = os.path.abspath(config_file)
    config = load_config(path)
    return config, _timeouts(config, path)


class Runtime:
    """One deployment's tiers and the loop thread every call to them runs on."""

    def __init__(self, config: KVPluginConfig, source: str) -> None:
        off = config.offload
        self.timeouts = _timeouts(config, source)
        self.config = config
        self.source = source
        self._tmp: str | None = None
        disk_root = off.disk_path
        if off.local_disk is not None and disk_root is None:
            self._tmp = disk_root = tempfile.mkdtemp(prefix="kvplugin-vllm-disk-")
        elif disk_root is not None:
            os.makedirs(disk_root, exist_ok=True)
        # The config's fault drill applies here as in the native plugin.
        self.injectors: list[FaultInjector] = []
        self.connector: Connector = build_connector(
            off, disk_root, fault_wrapper(config.faults, self.injectors))
        self.loop = LoopThread(name="kvplugin-vllm-loop")
        self.refs = 0
        # Tier events, fanned out: every worker sharing these tiers sees every event.
        self._events_lock = threading.Lock()
        self._subscribers: dict[int, list[TierEvent]] = {}

    def subscribe_events(self) -> int:
        """A worker's token for :meth:`take_events` (the tiers start recording)."""
        with self._events_lock:
            self.connector.watch_events()
            token = len(self._subscribers)
            self._subscribers[token] = []
            return token

    def take_events(self, token: int) -> list[TierEvent]:
        """The tiers' events since this subscriber's last call (recorded on the loop
        thread; taken from a worker's, so under a lock)."""
        with self._events_lock:
            new = self.connector.take_events()
            if new:
                for queue in self._subscribers.values():
                    queue.extend(new)
            out, self._subscribers[token] = self._subscribers[token], []
            return out

    def close(self) -> None:
        try:
            if self.loop.running:
                self.loop.call(self.connector.aclose(), timeout=30)
        finally:
            self.loop.close()
            if self._tmp is not None:
                shutil.rmtree(self._tmp, ignore_errors=True)
                self._tmp = None


_LOCK = threading.Lock()
_RUNTIMES: dict[str, Runtime] = {}


def acquire(config_file: str) -> Runtime:
    """The shared runtime of ``config_file`` (built on first use; env overrides apply)."""
    path = os.path.abspath(config_file)
    with _LOCK:
        rt = _RUNTIMES.get(path)
        if rt is None:
            rt = Runtime(load_config(path), path)
            _RUNTIMES[path] = rt
        rt.refs += 1
        return rt


def release(rt: Runtime) -> None:
    """Drop one reference; the last one closes the tiers and the loop."""
    with _LOCK:
        rt.refs -= 1
        if rt.refs > 0:
            return
        _RUNTIMES.pop(rt.source, None)
    rt.close()


def keyspace_for(config: KVPluginConfig, shapes: Sequence[GroupShape], hash_block_size: int,
                 block_size: int) -> KeySpace:
    """Keys as the native manager derives them for the same model, layout and tenant:
    the config's model name and chunk size (in vLLM's blocks)."""
    chunk_size = config.offload.chunk_size
    if chunk_size % block_size:
        raise ValueError(f"offload.chunk_size {chunk_size} is not a multiple of vLLM's "
                         f"block size {block_size}")
    return KeySpace(config.model.name, shapes, hash_block_size, chunk_size // block_size)
