"""A disposable local Redis Cluster for tests and benchmarks (yours too).

:class:`LocalRedisCluster` starts ``masters * (1 + replicas)`` ``redis-server`` processes with
``--cluster-enabled yes`` on free loopback ports, each in its own scratch directory (no
persistence; the cluster config file lives there, so a killed node restarted on its port
rejoins as the node it was), joins them with ``redis-cli --cluster create``, and waits until
every node reports ``cluster_state:ok`` and agrees on who serves every slot. It can kill and
restart a node, force a failover, move slots between masters key by key
(``CLUSTER SETSLOT ... IMPORTING/MIGRATING`` + ``MIGRATE``, what ``redis-cli --cluster
reshard`` does) and wait for the replicas to catch up. It never touches a server it did not
start.

The node timeout is short (1 s by default) so that an automatic failover after a kill takes
a couple of seconds, and ``cluster-replica-validity-factor 0`` lets any replica take over
whatever its replication lag (a test kills masters on purpose).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis

__all__ = ["ClusterNodeProcess", "LocalRedisCluster"]

HOST = "127.0.0.1"
SLOTS = 16384


@dataclass(slots=True)
class ClusterNodeProcess:
    """One ``redis-server`` of the cluster: its ports, directory and process."""

    port: int
    bus_port: int
    workdir: str
    proc: subprocess.Popen[bytes] | None = None

    @property
    def name(self) -> str:
        return f"{HOST}:{self.port}"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class LocalRedisCluster:
    """A throw-away Redis Cluster on 127.0.0.1 that a test controls."""

    def __init__(
        self,
        workdir: str,
        *,
        masters: int = 3,
        replicas: int = 1,
        node_timeout_ms: int = 1000,
        executable: str = "redis-server",
        cli: str = "redis-cli",
    ) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        if replicas < 0 or node_timeout_ms < 100:
            raise ValueError("replicas must be >= 0 and node_timeout_ms >= 100")
        self.workdir = workdir
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.executable = executable
        self.cli = cli
        self.nodes: list[ClusterNodeProcess] = []

    @staticmethod
    def available(executable: str = "redis-server", cli: str = "redis-cli") -> bool:
        return shutil.which(executable) is not None and shutil.which(cli) is not None

    # --- addresses ----------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis-cluster://`` with every node as a startup node."""
        if not self.nodes:
            raise RuntimeError("cluster not started")
        return "redis-cluster://" + ",".join(n.name for n in self.nodes)

    def node(self, port: int) -> ClusterNodeProcess:
        for n in self.nodes:
            if n.port == port:
                return n
        raise KeyError(f"no node on port {port}")

    def client(self, port: int, *, timeout: float = 2.0) -> redis.Redis:
        """A plain (non-cluster) client of one node; close it after use."""
        return redis.Redis(HOST, port, socket_timeout=timeout, socket_connect_timeout=timeout)

    def command(self, port: int, *args: object) -> object:
        with self.client(port) as c:
            return c.execute_command(*args)

    # --- lifecycle ----------------------------------------------------------------------------

    def start(self, *, timeout: float = 30.0) -> None:
        """Start the nodes, create the cluster, wait until it serves every slot."""
        os.makedirs(self.workdir, exist_ok=True)
        count = self.masters * (1 + self.replicas)
        ports = _free_ports(2 * count)
        try:
            for i in range(count):
                node = ClusterNodeProcess(
                    ports[2 * i], ports[2 * i + 1], os.path.join(self.workdir, f"node{i}")
                )
                os.makedirs(node.workdir, exist_ok=True)
                self.nodes.append(node)
                self._spawn(node)
            deadline = time.monotonic() + timeout
            for node in self.nodes:
                self._wait_up(node, deadline)
            self._create(deadline)
            self.wait_ok(timeout=max(1.0, deadline - time.monotonic()))
        except BaseException:
            self.kill_all()
            raise

    def _spawn(self, node: ClusterNodeProcess) -> None:
        args = [
            self.executable, "--port", str(node.port), "--bind", HOST,
            "--cluster-enabled", "yes", "--cluster-port", str(node.bus_port),
            "--cluster-config-file", "nodes.conf",
            "--cluster-node-timeout", str(self.node_timeout_ms),
            "--cluster-replica-validity-factor", "0",
            "--save", "", "--appendonly", "no", "--dir", node.workdir, "--daemonize", "no",
        ]  # fmt: skip
        with open(os.path.join(node.workdir, "redis.log"), "ab") as log:
            node.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)

    def _wait_up(self, node: ClusterNodeProcess, deadline: float) -> None:
        """Until *this* process answers on the node's port (never another server there)."""
        while time.monotonic() < deadline:
            if not node.alive:
                raise RuntimeError(f"redis-server on {node.name} exited: {self.log_tail(node)}")
            try:
                with self.client(node.port, timeout=0.5) as c:
                    info = c.info("server")
                if info.get("process_id") == node.proc.pid:  # type: ignore[union-attr]
                    return
                raise RuntimeError(f"another server answers on {node.name}")
            except redis.ConnectionError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server on {node.name} did not start: {self.log_tail(node)}")

    def _create(self, deadline: float) -> None:
        args = [self.cli, "--cluster", "create", *(n.name for n in self.nodes),
                "--cluster-replicas", str(self.replicas), "--cluster-yes"]  # fmt: skip
        done = subprocess.run(
            args,
            capture_output=True,
            timeout=max(1.0, deadline - time.monotonic()),
            check=False,
        )
        out = (done.stdout + done.stderr).decode(errors="replace")
        if done.returncode != 0 or "[OK] All 16384 slots covered" not in out:
            raise RuntimeError(f"redis-cli --cluster create failed: {out[-800:]}")

    def kill(self, port: int) -> None:
        """SIGKILL one node: its connections drop and (no persistence) its data is gone."""
        node = self.node(port)
        if node.proc is not None:
            if node.proc.poll() is None:
                node.proc.send_signal(signal.SIGCONT)  # a paused node must be able to die
            _reap(node.proc)
            node.proc = None

    def pause(self, port: int) -> None:
        """SIGSTOP: connections stay open but nothing answers (a hung node)."""
        proc = self.node(port).proc
        if proc is not None:
            proc.send_signal(signal.SIGSTOP)

    def resume(self, port: int) -> None:
        proc = self.node(port).proc
        if proc is not None:
            proc.send_signal(signal.SIGCONT)

    def restart(self, port: int, *, timeout: float = 10.0) -> None:
        """Start a killed node again on its port; it rejoins with its cluster identity."""
        node = self.node(port)
        if node.alive:
            raise RuntimeError(f"{node.name} is running")
        self._spawn(node)
        self._wait_up(node, time.monotonic() + timeout)

    def kill_all(self) -> None:
        for node in self.nodes:
            self.kill(node.port)

    stop = kill_all

    def __enter__(self) -> LocalRedisCluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill_all()

    def log_tail(self, node: ClusterNodeProcess) -> str:
        try:
            with open(os.path.join(node.workdir, "redis.log"), "rb") as f:
                return f.read()[-500:].decode(errors="replace")
        except OSError:
            return ""

    # --- topology -----------------------------------------------------------------------------

    def slot_owners(self, port: int | None = None) -> dict[int, int]:
        """Slot -> port of its master, as one live node (or ``port``) sees it."""
        ask = port if port is not None else self._live()[0].port
        owners: dict[int, int] = {}
        entries: list[list[Any]] = self.command(ask, "CLUSTER", "SLOTS")  # type: ignore[assignment]
        for entry in entries:
            start, end, master = int(entry[0]), int(entry[1]), entry[2]
            for slot in range(start, end + 1):
                owners[slot] = int(master[1])
        return owners

    def masters_ports(self) -> list[int]:
        """Ports of the live nodes that serve slots, as a live node sees it."""
        return sorted(set(self.slot_owners().values()) & {n.port for n in self._live()})

    def replica_of(self, master_port: int) -> int:
        """The port of a live replica of ``master_port``."""
        master_id = self.command(master_port, "CLUSTER", "MYID")
        if isinstance(master_id, bytes):
            master_id = master_id.decode()
        for node in self._live():
            text = self.command(node.port, "CLUSTER", "NODES")
            line = _myself(text)
            fields = line.split()
            if "slave" in fields[2] and fields[3] == master_id:
                return node.port
        raise LookupError(f"no live replica of {master_port}")

    def wait_ok(self, *, timeout: float = 20.0, exclude: Iterable[int] = ()) -> None:
        """Until every live node (but ``exclude``) says ``cluster_state:ok`` and all of them
        agree on the master of every slot, each master being a live node."""
        skip = set(exclude)
        end = time.monotonic() + timeout
        last = "no answer"
        while time.monotonic() < end:
            try:
                last = self._check_ok(skip)
                if not last:
                    return
            except redis.RedisError as exc:
                last = repr(exc)
            time.sleep(0.05)
        raise RuntimeError(f"cluster not ok after {timeout:.1f}s: {last}")

    def _check_ok(self, skip: set[int]) -> str:
        """What is not ok yet ('' when all is)."""
        live = [n for n in self._live() if n.port not in skip]
        views = []
        for node in live:
            info = self.command(node.port, "CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            if "cluster_state:ok" not in text:
                return f"{node.name}: {text.splitlines()[0]}"
            views.append(self.slot_owners(node.port))
        if any(len(v) != SLOTS for v in views):
            return "not every slot is served"
        if any(v != views[0] for v in views[1:]):
            return "nodes disagree on slot owners"
        live_ports = {n.port for n in self._live()}
        if not set(views[0].values()) <= live_ports:
            return "a slot is served by a dead node"
        return ""

    def wait_replicated(self, *, timeout: float = 10.0) -> None:
        """Until each live replica has every write its master acknowledged."""
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            lagging = False
            for port in self.masters_ports():
                with self.client(port) as c:
                    info = c.info("replication")
                offset = int(info["master_repl_offset"])
                replicas = [v for k, v in info.items() if k.startswith("slave")]
                lagging |= any(int(r["offset"]) < offset for r in replicas)
            if not lagging:
                return
            time.sleep(0.02)
        raise RuntimeError(f"replicas did not catch up within {timeout:.1f}s")

    def failover(self, replica_port: int, *, timeout: float = 20.0) -> None:
        """``CLUSTER FAILOVER`` on a replica (its master must be alive), then wait for it."""
        self.command(replica_port, "CLUSTER", "FAILOVER")
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if replica_port in self.slot_owners(replica_port).values():
                self.wait_ok(timeout=max(1.0, end - time.monotonic()))
                return
            time.sleep(0.05)
        raise RuntimeError(f"{HOST}:{replica_port} was not promoted within {timeout:.1f}s")

    def migrate_slots(
        self, slots: Sequence[int], source: int, target: int, *, batch: int = 10
    ) -> int:
        """Move ``slots`` from master ``source`` to master ``target`` while clients run:
        IMPORTING on the target, MIGRATING on the source, ``MIGRATE`` of the keys in
        batches, then the new owner announced to every master. Returns the keys moved."""
        src_id, dst_id = self._id(source), self._id(target)
        masters = self.masters_ports()
        clients: dict[int, Any] = {p: self.client(p) for p in {source, target, *masters}}
        src, dst = clients[source], clients[target]
        moved = 0
        try:
            for slot in slots:
                dst.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
                src.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
                while keys := src.execute_command("CLUSTER", "GETKEYSINSLOT", slot, batch):
                    src.execute_command("MIGRATE", HOST, target, "", 0, 5000, "KEYS", *keys)
                    moved += len(keys)
                # The target first, then the source (which then answers MOVED), then the rest.
                for port in (target, source, *masters):
                    clients[port].execute_command("CLUSTER", "SETSLOT", slot, "NODE", dst_id)
        finally:
            for client in clients.values():
                client.close()
        return moved

    def _id(self, port: int) -> str:
        node_id = self.command(port, "CLUSTER", "MYID")
        return node_id.decode() if isinstance(node_id, bytes) else str(node_id)

    def _live(self) -> list[ClusterNodeProcess]:
        live = [n for n in self.nodes if n.alive]
        if not live:
            raise RuntimeError("no live node")
        return live


def _myself(nodes_text: object) -> str:
    text = nodes_text.decode() if isinstance(nodes_text, bytes) else str(nodes_text)
    for line in text.splitlines():
        if "myself" in line.split()[2]:
            return line
    raise RuntimeError("CLUSTER NODES without a 'myself' line")


def _free_ports(count: int) -> list[int]:
    """``count`` distinct free loopback ports (all held open together while choosing)."""
    socks = []
    try:
        for _ in range(count):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((HOST, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _reap(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=10)
