"""Fault injection for connector tests (yours too): a wrapper and a disposable redis-server.

:class:`FaultInjector` wraps any :class:`~kvplugin.connectors.base.Connector` and, driven by its own
seeded ``random.Random`` (never the global random state), injects:

* **errors** — a call fails as if the backend were down (reads answer misses, writes raise
  :class:`InjectedFault`, a :class:`~kvplugin.connectors.base.BackendUnavailable`);
* **latency** — a call sleeps first, inside its deadline (latency above the deadline turns
  into the connector's timeout behaviour);
* **dropped writes** — ``put`` reports an object stored and never writes it;
* **corrupted bytes** — an object is stored with one byte flipped or truncated, so the wrapped
  connector's verification must catch it on load.

With the default :class:`FaultPlan` nothing is injected and the wrapper is transparent.

:class:`LocalRedisServer` runs ``redis-server`` on a free loopback port in a scratch
directory, without persistence, and can kill, pause and restart it.
"""

from __future__ import annotations

import asyncio
import os
import random
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, fields
from typing import TypeVar

from kvplugin.connectors.base import (
    BackendUnavailable,
    Connector,
    ConnectorStats,
    Deadline,
    Guarded,
    Health,
    PutItem,
    check_items,
    check_keys,
    check_timeout,
    encode_once,
)
from kvplugin.connectors.events import DEFAULT_EVENT_LIMIT, TierEvent
from kvplugin.connectors.keys import ObjectKey
from kvplugin.serde import Block, Codec, EncodedBlock

__all__ = ["FaultCounters", "FaultInjector", "FaultPlan", "InjectedFault", "LocalRedisServer"]

T = TypeVar("T")


class InjectedFault(BackendUnavailable):
    """A failure made up by :class:`FaultInjector`."""


@dataclass(frozen=True, slots=True)
class FaultPlan:
    """Probabilities per call (errors, latency) or per object (drops, corruption)."""

    error_rate: float = 0.0
    latency_rate: float = 0.0
    latency: float = 0.0  # seconds; each delayed call sleeps uniformly in [0, latency]
    drop_write_rate: float = 0.0
    corrupt_write_rate: float = 0.0
    # Seconds every get waits before it reads (a throttled tier, slow to hand bytes back):
    # a fixed delay, not a roll, so a load-or-recompute decision has a steady speed to learn.
    get_delay: float = 0.0

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if f.name not in ("latency", "get_delay") and not 0.0 <= value <= 1.0:
                raise ValueError(f"{f.name} must be a probability in [0, 1], got {value!r}")
        for name in ("latency", "get_delay"):
            if not getattr(self, name) >= 0:
                raise ValueError(f"{name} must be >= 0, got {getattr(self, name)!r}")

    @property
    def benign(self) -> bool:
        return not any(getattr(self, f.name) for f in fields(self))


@dataclass(slots=True)
class FaultCounters:
    errors: int = 0
    delays: int = 0
    dropped: int = 0
    corrupted: int = 0
    throttled: int = 0  # gets delayed by get_delay


class FaultInjector(Guarded, Connector):
    """Wraps ``inner``; owns it (``aclose`` closes it)."""

    def __init__(
        self, inner: Connector, plan: FaultPlan, *, seed: int, name: str | None = None
    ) -> None:
        self.inner = inner
        self.plan = plan
        # It stands in for the tier (in a drill, reports and quotas name the tier): by
        # default it goes by the tier's name, and the events it passes on carry that name.
        self.name = name or inner.name
        self.capabilities = inner.capabilities
        self.injected = FaultCounters()
        self._rng = random.Random(seed)
        self._stats = ConnectorStats()
        self._closed = False

    @property
    def codec(self) -> Codec:
        return self.inner.codec

    def watch_events(self, limit: int = DEFAULT_EVENT_LIMIT) -> None:
        self.inner.watch_events(limit)  # what the tier really did, faults included

    def take_events(self) -> list[TierEvent]:
        return self.inner.take_events()

    @property
    def reports_objects(self) -> bool:
        return self.inner.reports_objects

    async def lookup(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        self._check_open()
        keys = check_keys(keys)
        deadline = Deadline.after(timeout)
        return await self._read("lookup", self._after_faults(deadline, "lookup", keys), timeout, 0)

    async def get(self, keys: Sequence[ObjectKey], *, timeout: float) -> list[Block | None]:
        self._check_open()
        keys = check_keys(keys)
        deadline = Deadline.after(timeout)
        misses: list[Block | None] = [None] * len(keys)
        return await self._read(
            "get", self._after_faults(deadline, "get", keys), timeout, misses, misses=len(keys)
        )

    async def put(self, items: Sequence[PutItem], *, timeout: float) -> int:
        self._check_open()
        items = check_items(items)
        deadline = Deadline.after(timeout)
        return await self._write("put", self._put(deadline, items), timeout)

    async def delete(self, keys: Sequence[ObjectKey], *, timeout: float) -> int:
        self._check_open()
        keys = check_keys(keys)
        deadline = Deadline.after(timeout)
        return await self._write("delete", self._after_faults(deadline, "delete", keys), timeout)

    async def health(self, *, timeout: float) -> Health:
        self._check_open()
        check_timeout(timeout)
        if self._roll(self.plan.error_rate):
            self.injected.errors += 1
            return Health(False, "InjectedFault: injected error")
        return await self.inner.health(timeout=timeout)

    def stats(self) -> ConnectorStats:
        merged = self.inner.stats() + self._stats
        merged.dropped += self.injected.dropped
        return merged

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            await self.inner.aclose()

    # fault machinery ----------------------------------------------------------------------------

    def _roll(self, rate: float) -> bool:
        return rate > 0 and self._rng.random() < rate

    async def _faults(self) -> None:
        """Latency, then maybe an error; called once per operation."""
        if self._roll(self.plan.latency_rate):
            self.injected.delays += 1
            await asyncio.sleep(self._rng.uniform(0, self.plan.latency))
        if self._roll(self.plan.error_rate):
            self.injected.errors += 1
            raise InjectedFault(f"{self.name}: injected error")

    def _after_faults(self, deadline: Deadline, op: str, keys: Sequence[ObjectKey]) -> Awaitable[T]:
        async def run() -> T:
            if keys:  # an empty batch does no I/O, so nothing can fail
                if op == "get" and self.plan.get_delay > 0:
                    self.injected.throttled += 1
                    await asyncio.sleep(self.plan.get_delay)
                await self._faults()
            method = getattr(self.inner, op)
            result: T = await method(keys, timeout=max(deadline.remaining(), 1e-3))
            return result

        return run()

    async def _put(self, deadline: Deadline, items: Sequence[PutItem]) -> int:
        if not items:
            return 0
        await self._faults()
        forward: list[PutItem] = []
        dropped = 0
        for key, block in items:
            if self._roll(self.plan.drop_write_rate):
                self.injected.dropped += 1
                dropped += 1
            elif self._roll(self.plan.corrupt_write_rate):
                self.injected.corrupted += 1
                forward.append((key, self._corrupt(block)))
            else:
                forward.append((key, block))
        if not forward:
            return dropped
        stored = await self.inner.put(forward, timeout=max(deadline.remaining(), 1e-3))
        return stored + dropped

    def _corrupt(self, block: Block) -> Block:
        # Sealed the way the wrapped connector seals (its secret, if any) and marked so, so
        # that it stores these bytes as they are and the damage is all its check can find.
        codec = self.inner.codec
        data = bytearray(encode_once(block, codec).join())
        if self._rng.random() < 0.5:
            pos = self._rng.randrange(len(data))
            data[pos] ^= self._rng.randrange(1, 256)
        else:
            del data[self._rng.randrange(len(data)) :]
        return Block(block.meta, block.payload, EncodedBlock((data,), len(data), codec.key_id))


class LocalRedisServer:
    """A throw-away ``redis-server`` on 127.0.0.1 (no persistence) that a test controls."""

    def __init__(self, workdir: str, *, executable: str = "redis-server") -> None:
        self.workdir = workdir
        self.executable = executable
        self.port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None

    @staticmethod
    def available(executable: str = "redis-server") -> bool:
        return shutil.which(executable) is not None

    @property
    def url(self) -> str:
        if self.port is None:
            raise RuntimeError("server not started")
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, *, timeout: float = 10.0) -> None:
        """Start on a free port (or on the previous port after a kill: a restart)."""
        os.makedirs(self.workdir, exist_ok=True)
        attempts = 1 if self.port is not None else 5
        last = ""
        for _ in range(attempts):
            port = self.port or _free_port()
            proc = self._spawn(port)
            if _wait_ready(proc, port, timeout):
                self.port, self._proc = port, proc
                return
            _reap(proc)
            last = self._log_tail()
        raise RuntimeError(f"redis-server did not start: {last}")

    def _spawn(self, port: int) -> subprocess.Popen[bytes]:
        args = [
            self.executable, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
            "--appendonly", "no", "--dir", self.workdir, "--daemonize", "no",
        ]  # fmt: skip
        with open(os.path.join(self.workdir, "redis.log"), "ab") as log:
            return subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def _log_tail(self) -> str:
        try:
            with open(os.path.join(self.workdir, "redis.log"), "rb") as f:
                return f.read()[-500:].decode(errors="replace")
        except OSError:
            return ""

    def kill(self) -> None:
        """SIGKILL: the server dies with every connection and (no persistence) every key."""
        if self._proc is not None:
            if self._proc.poll() is None:
                self._proc.send_signal(signal.SIGCONT)  # a paused server must be able to die
            _reap(self._proc)
            self._proc = None

    def pause(self) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung server)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def restart(self) -> None:
        self.kill()
        self.start()

    stop = kill

    def __enter__(self) -> LocalRedisServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _wait_ready(proc: subprocess.Popen[bytes], port: int, timeout: float) -> bool:
    """True once *this* process answers on ``port`` (never some other server on it)."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            return False
        try:
            if _server_pid(port) == proc.pid:
                return True
        except OSError:
            pass
        time.sleep(0.02)
    return False


def _server_pid(port: int) -> int | None:
    with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
        s.sendall(b"INFO server\r\n")
        data = b""
        while b"\r\n" not in data.partition(b"process_id:")[2]:
            chunk = s.recv(65536)
            if not chunk:
                return None
            data += chunk
    line = data.partition(b"process_id:")[2].split(b"\r\n", 1)[0]
    return int(line)


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
