"""Redis Cluster connector: the Redis connector's objects and guarantees, on a cluster.

``remote_url: redis-cluster://[user[:password]@]host:port[,host:port...]`` (any reachable
nodes; the rest are discovered; options and URL parsing in
:mod:`kvplugin.connectors.redis_cluster_options`). What stays exactly as in
:mod:`kvplugin.connectors.redis`:

* **Keys and values.** ``<prefix><96 hex>``, one self-describing value per object written
  with ``SET key value NX [EX ttl]``: a key is a valid cluster key as it is (no braces, so
  no hash tag: objects spread over all the slots), and an object stored by the single-node
  connector is the same bytes under the same key (``redis-cli --cluster import`` moves a
  deployment over). Every command names one key, so no command can be cross-slot.
* **Verification.** Loads are decoded and verified (checksums or MACs, and the key check)
  by :class:`~kvplugin.connectors.base.StoreBase`: whatever a node, a failover or a reshard
  returns, a corrupt, foreign or misplaced object is a counted miss, never a block.
* **The wire.** Commands are packed and replies read by :mod:`kvplugin.connectors.resp` on pooled
  connections (a small pool per node, at most ``max_connections``): values go out as the
  encoder's pieces and come back as views, error replies are per-key answers.

What the cluster adds:

* **Routing.** The slot map is redis-py's (:class:`redis.asyncio.RedisCluster`'s
  ``NodesManager``: discovery from the startup nodes, ``CLUSTER SLOTS``, patched on
  ``MOVED``). A batch is grouped by the master serving each key's slot and each group is
  pipelined on one connection to its node, the groups in parallel: one round trip per node
  per batch, not per key. redis-py's ``ClusterPipeline`` is not used: it resends every
  redirected command alone, copies every value through its reader, and on ``CLUSTERDOWN``
  sleeps and drops every connection, outside any deadline.
* **Redirections.** ``MOVED`` patches the slot map and resends to the new owner; ``ASK``
  (a slot being migrated) resends with ``ASKING`` to the importing node on the same
  connection. Both are bounded by ``max_redirects``.
* **Failover and resharding.** A node that cannot be reached, or answers ``CLUSTERDOWN``,
  ``TRYAGAIN``, ``LOADING``, ``MASTERDOWN`` or ``READONLY``, is retried after a backoff and
  a refresh of the slot map (one shared refresh at a time), ``retries`` times, all inside
  the call's deadline. Then the keys it serves fail: a read answers them as misses (the
  other nodes' keys are still served; a prefix lookup stops at the first failed key), a
  write raises :class:`~kvplugin.connectors.base.BackendUnavailable`. Each node has its own circuit
  breaker, so a dead or hung master makes only its own keys fail fast. Once a replica is
  promoted, the refreshed map routes there: the connector never has to be rebuilt.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import math
import random
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

import redis.asyncio as aioredis
import redis.exceptions as rexc
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.crc import key_slot

from kvplugin.connectors.base import (
    BackendError,
    BackendUnavailable,
    CircuitBreaker,
    CircuitOpen,
    Connector,
    ConnectorError,
    StoragePermissionError,
    decode_all,
)
from kvplugin.connectors.redis import _PARSER_CRASHES, RedisConnector, RedisOptions
from kvplugin.connectors.redis_cluster_options import (
    SCHEME,
    RedisClusterOptions,
    is_cluster_url,
    remote_url_problem,
)
from kvplugin.connectors.redis_common import (
    DENIED,
    TRANSIENT,
    WRONG_TYPE,
    RedisStoreBase,
    Wrong,
    batches,
    denied_message,
    reply_count,
    reply_error,
    reply_pong,
    reply_strlen,
    reply_value,
)
from kvplugin.connectors.resp import ErrorReply, Reply, pack, wire_class

if TYPE_CHECKING:
    from typing_extensions import Buffer

    from kvplugin.connectors.base import Loaded
    from kvplugin.connectors.keys import ObjectKey

__all__ = [
    "SCHEME",
    "RedisClusterConnector",
    "RedisClusterOptions",
    "connector_from_url",
    "is_cluster_url",
    "remote_url_problem",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")
_ASKING = pack(b"ASKING")
_WIRE_TCP: Callable[..., Any] = wire_class(aioredis.Connection)
_REFRESH_EVERY = 0.1  # seconds: the most often the slot map is asked for while a node fails
# Replies that send a command elsewhere (MOVED, ASK) or say "not now" about its slot (a
# failover or a reshard in progress: retried after a refresh of the slot map, like a node
# that cannot be reached).
_REDIRECTS = frozenset(
    {"MOVED", "ASK", "CLUSTERDOWN", "TRYAGAIN", "LOADING", "MASTERDOWN", "READONLY"}
)
Outcome = Reply | ConnectorError  # one command's answer, or why its node could not give one


def connector_from_url(
    url: str,
    *,
    secret: bytes | None = None,
    previous_secrets: Sequence[bytes] = (),
    **options: Any,
) -> Connector:
    """The remote tier for ``remote_url``: a :class:`RedisClusterConnector` for
    ``redis-cluster://``, a :class:`~kvplugin.connectors.redis.RedisConnector` for anything else
    (``redis://``, ``rediss://``, ``unix://``); ``options`` are the options' other fields."""
    if is_cluster_url(url):
        return RedisClusterConnector(
            RedisClusterOptions.from_url(url, **options),
            secret=secret,
            previous_secrets=previous_secrets,
        )
    return RedisConnector(
        RedisOptions(url=url, **options), secret=secret, previous_secrets=previous_secrets
    )


# --- the connector ---------------------------------------------------------------------------


class _NodePool:
    """At most ``size`` connections to one node; a caller waits for a free one within its
    deadline. Lighter than redis-py's ``BlockingConnectionPool`` (no lock, no condition, no
    pending-data probe per checkout): a connection is only ever released after a complete
    exchange, and one that failed or was cut short was closed before its release (the next
    checkout reconnects it), so a free connection has nothing unread."""

    __slots__ = ("_all", "_free", "_new", "_room")

    def __init__(self, new: Callable[[], Any], size: int) -> None:
        self._new = new  # makes an unconnected WireConnection
        self._room = asyncio.Semaphore(size)
        self._free: collections.deque[Any] = collections.deque()
        self._all: list[Any] = []

    async def acquire(self) -> Any:
        await self._room.acquire()
        try:
            conn = self._free.pop() if self._free else self._create()
        except BaseException:
            self._room.release()
            raise
        try:
            if not conn.is_connected:
                await conn.connect()
        except BaseException:
            self.release(conn)
            raise
        return conn

    def _create(self) -> Any:
        conn = self._new()
        self._all.append(conn)
        return conn

    def release(self, conn: Any) -> None:
        self._free.append(conn)
        self._room.release()

    async def aclose(self) -> None:
        await asyncio.gather(*(c.disconnect(nowait=True) for c in self._all))


@dataclass(slots=True)
class _Round:
    """The commands of one exchange still waiting for an answer, and their redirections."""

    todo: list[int]
    asking: dict[int, str] = field(default_factory=dict)  # index -> node to send ASKING to
    results: dict[int, Outcome] = field(default_factory=dict)
    hops: int = 0
    failures: int = 0


class RedisClusterConnector(RedisStoreBase):
    """Objects as Redis string values under ``<prefix><storage id>``, on a Redis Cluster."""

    def __init__(
        self,
        options: RedisClusterOptions | None = None,
        *,
        name: str = "redis-cluster",
        rng: random.Random | None = None,
        secret: bytes | None = None,
        previous_secrets: Sequence[bytes] = (),
    ) -> None:
        opts = options or RedisClusterOptions()
        super().__init__(opts, name=name, rng=rng, secret=secret,
                         previous_secrets=previous_secrets, password=opts.password)
        self.options = opts
        # redis-py keeps the slot map; nothing connects before the first call.
        self._cluster = RedisCluster(
            startup_nodes=[ClusterNode(host, port) for host, port in opts.nodes],
            username=opts.username,
            password=opts.password,
            socket_timeout=opts.socket_timeout,
            socket_connect_timeout=opts.connect_timeout,
            require_full_coverage=False,  # a failed master's slots fail, not the whole map
            max_connections=2,  # its connections only ask for the slot map
            retry=Retry(NoBackoff(), 0),
        )
        self._slots = self._cluster.nodes_manager
        self._pools: dict[str, _NodePool] = {}
        self._breakers: dict[str, CircuitBreaker] = {}
        self.redirections = 0  # MOVED and ASK answers followed (a reshard or a failover)
        self._mapped = False
        self._refreshing: asyncio.Task[None] | None = None
        self._refreshed_at = -math.inf
        # Nodes a task was waiting on when it was cancelled: charged to their breakers if
        # the cancellation was the call's deadline (see _on_deadline).
        self._cut: weakref.WeakKeyDictionary[asyncio.Task[Any], list[str]] = (
            weakref.WeakKeyDictionary()
        )

    def breaker_state(self, node: str) -> str:
        """The circuit breaker state of ``node`` (``host:port``)."""
        breaker = self._breakers.get(node)
        return "closed" if breaker is None else breaker.state

    # primitives -----------------------------------------------------------------------------

    async def _prefix_present(self, ids: list[str]) -> int:
        n = 0
        for batch in batches(ids, self.options.lookup_batch):
            keys = [self.redis_key(s) for s in batch]
            lengths = await self._call(
                "lookup", keys, [[pack(b"STRLEN", k)] for k in keys], reply_strlen
            )
            wrong = [s for s, length in zip(batch, lengths, strict=True) if length is WRONG_TYPE]
            if wrong:
                await self._drop_wrong_type("lookup", wrong)
            for length in lengths:
                if isinstance(length, ConnectorError):
                    self._partial("lookup", length)
                    return n
                if length is WRONG_TYPE or length == 0:
                    return n
                n += 1
        return n

    async def _fetch_some(self, ids: list[str]) -> list[Buffer | ConnectorError | None]:
        """Stored bytes per id: ``None`` when absent, the error when its node failed."""
        out: list[Buffer | ConnectorError | None] = []
        for batch in batches(ids, self.options.get_batch):
            keys = [self.redis_key(s) for s in batch]
            values = await self._call("get", keys, [[pack(b"GET", k)] for k in keys], reply_value)
            for sid, got in zip(batch, values, strict=True):
                value: Buffer | ConnectorError | None
                if isinstance(got, Wrong):
                    # Loaded as an empty object: verification counts it as a corrupt miss
                    # and deletes it, as it does every other damaged object.
                    logger.warning("%s get: %s holds a non-string value", self.name, sid)
                    value = b""
                else:
                    value = got
                out.append(value)
        return out

    async def _fetch(self, ids: list[str]) -> list[Buffer | None]:
        out: list[Buffer | None] = []
        for value in await self._fetch_some(ids):
            if isinstance(value, ConnectorError):
                raise value
            out.append(value)
        return out

    async def _load(self, keys: list[ObjectKey]) -> list[Loaded]:
        raws: list[Buffer | None] = []
        failed: ConnectorError | None = None
        for value in await self._fetch_some([k.id for k in keys]):
            if isinstance(value, ConnectorError):
                failed, value = value, None  # a key whose node failed is a miss
            raws.append(value)
        if failed is not None:
            self._partial("get", failed)
        return decode_all(keys, raws, self._codec)

    async def _run(self, op: str, keys: list[bytes], commands: list[list[Buffer]],
                   check: Callable[[Reply], T]) -> list[T]:
        return _all_or_raise(await self._call(op, keys, commands, check))

    async def _remove(self, ids: list[str]) -> int:
        # One UNLINK per key: a multi-key UNLINK would be cross-slot.
        keys = [self.redis_key(s) for s in ids]
        counts = await self._call("delete", keys, [[pack(b"UNLINK", k)] for k in keys],
                                  reply_count(1))
        return sum(_all_or_raise(counts))

    async def _ping(self) -> None:
        """Every master answers ``PING``."""
        if not self._mapped:
            await self._refresh()
        masters = sorted({nodes[0].name for nodes in self._slots.slots_cache.values() if nodes})
        if not masters:
            raise BackendUnavailable(f"{self.name}: no master serves any slot of {self.url}")
        ping = [[pack(b"PING")]]
        for outcome in await asyncio.gather(*(self._send(m, ping, [False]) for m in masters)):
            if isinstance(outcome, ConnectorError):
                raise outcome
            self._checked("ping", list(outcome), reply_pong)

    async def _close(self) -> None:
        if self._refreshing is not None:
            self._refreshing.cancel()
            await asyncio.gather(self._refreshing, return_exceptions=True)
        await asyncio.gather(*(pool.aclose() for pool in self._pools.values()))
        await self._slots.aclose()
        await self._slots.aclose("startup_nodes")

    def _on_deadline(self) -> None:
        # A call cut by its deadline is a slow node: charge it to the breakers of the nodes
        # the call was still waiting on (cancelled for another reason, it charges nobody).
        task = asyncio.current_task()
        for node in self._cut.pop(task, []) if task is not None else []:
            self._breaker(node).failure()

    # the exchange: route, pipeline per node, follow redirections ------------------------------

    async def _call(
        self,
        op: str,
        keys: list[bytes],
        commands: Sequence[Sequence[Buffer]],
        check: Callable[[Reply], T],
    ) -> list[T | ConnectorError]:
        """Each command (``commands[i]`` names ``keys[i]``) sent to the master of its key's
        slot; its reply checked by ``check``, or the error of its node after retries."""
        outcomes = await self._exchange(op, keys, commands)
        return self._checked(op, outcomes, check)

    def _checked(
        self, op: str, outcomes: list[Outcome], check: Callable[[Reply], T]
    ) -> list[T | ConnectorError]:
        """``check`` each reply; an error reply it refuses fails the call, mapped as the
        single-node connector maps it (out of memory, read-only, denied, ...)."""
        try:
            return [o if isinstance(o, ConnectorError) else check(o) for o in outcomes]
        except DENIED as exc:
            raise self._error(StoragePermissionError, op, denied_message(self.url, exc)) from None
        except rexc.InvalidResponse as exc:
            raise self._error(BackendError, op, f"unexpected reply: {exc}") from None
        except rexc.RedisError as exc:
            kind, text = reply_error(exc)
            raise self._error(kind, op, text) from None

    async def _exchange(
        self, op: str, keys: list[bytes], commands: Sequence[Sequence[Buffer]]
    ) -> list[Outcome]:
        state = _Round(list(range(len(keys))))
        while state.todo:
            if not self._mapped:
                await self._refresh_or_keep()
            groups, retry, trouble = self._route(state, keys)
            for node, idxs, outcome in await self._send_groups(groups, commands, state):
                trouble = await self._settle(op, node, idxs, outcome, state) or trouble
                retry += [i for i in idxs if i not in state.results]
            state.todo = retry
            if retry:
                await self._before_retry(op, state, trouble)
        return [state.results[i] for i in range(len(keys))]

    def _route(
        self, state: _Round, keys: list[bytes]
    ) -> tuple[dict[str, list[int]], list[int], ConnectorError | None]:
        """Commands by node (the importing node for an ``ASK``, else the slot's master),
        the commands no node serves, and why."""
        groups: dict[str, list[int]] = {}
        unserved: list[int] = []
        trouble: ConnectorError | None = None
        for i in state.todo:
            node = state.asking.get(i)
            if node is None:
                slot = key_slot(keys[i])
                try:
                    node = self._slots.get_node_from_slot(slot).name
                except rexc.SlotNotCoveredError:
                    self._mapped = False
                    unserved.append(i)
                    trouble = BackendUnavailable(f"{self.name}: no node serves slot {slot}")
                    continue
            groups.setdefault(node, []).append(i)
        return groups, unserved, trouble

    async def _send_groups(
        self, groups: dict[str, list[int]], commands: Sequence[Sequence[Buffer]], state: _Round
    ) -> list[tuple[str, list[int], list[Reply] | ConnectorError]]:
        """Each node's commands pipelined on one of its connections, the nodes in parallel."""
        jobs = [
            (node, idxs, [commands[i] for i in idxs], [i in state.asking for i in idxs])
            for node, idxs in groups.items()
        ]
        if len(jobs) == 1:  # the common case: no task per call
            node, idxs, cmds, asking = jobs[0]
            try:
                return [(node, idxs, await self._send(node, cmds, asking))]
            except asyncio.CancelledError:
                self._note_cut([node])
                raise
        tasks = [asyncio.ensure_future(self._send(n, c, a)) for n, _, c, a in jobs]
        try:
            outcomes = await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            self._note_cut([job[0] for job, t in zip(jobs, tasks, strict=True) if t.cancelled()])
            raise
        return [(n, idxs, o) for (n, idxs, _, _), o in zip(jobs, outcomes, strict=True)]

    def _note_cut(self, nodes: list[str]) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._cut[task] = nodes

    async def _settle(
        self,
        op: str,
        node: str,
        idxs: list[int],
        outcome: list[Reply] | ConnectorError,
        state: _Round,
    ) -> ConnectorError | None:
        """Record the answers of one node; redirections and busy slots stay to be resent.
        Returns the trouble that calls for a backoff and a refresh, if any."""
        if isinstance(outcome, ConnectorError):
            if not isinstance(outcome, BackendUnavailable):
                raise outcome  # denied, or a reply we cannot read: not a matter of time
            self._mapped = False  # the node may be gone: its replica may serve the slot now
            if isinstance(outcome, CircuitOpen):  # known down: fail fast, no retry
                state.results.update((i, outcome) for i in idxs)
                return None
            return outcome
        trouble: ConnectorError | None = None
        for i, reply in zip(idxs, outcome, strict=True):
            state.asking.pop(i, None)
            if not isinstance(reply, ErrorReply) or reply.code not in _REDIRECTS:
                state.results[i] = reply
            elif reply.code == "MOVED":
                self.redirections += 1
                await self._moved(reply)
            elif reply.code == "ASK":
                self.redirections += 1
                state.asking[i] = _address(reply)
            else:  # busy: a failover or a reshard in progress
                self._mapped = False
                text = f"{self.name} {op}: {node} answered {reply.message}"
                trouble = BackendUnavailable(self._redact(text))
        return trouble

    async def _before_retry(self, op: str, state: _Round, trouble: ConnectorError | None) -> None:
        """Redirections are resent at once (up to ``max_redirects``), trouble after a
        backoff (``retries`` times; the next round refreshes the slot map first). Past
        that, the commands left fail with the trouble."""
        limit = self.options.max_redirects
        if trouble is None:
            state.hops += 1
            if state.hops <= limit:
                return
            trouble = BackendUnavailable(f"{self.name} {op}: more than {limit} redirections")
        else:
            state.failures += 1
            if state.failures <= self.options.retries:
                logger.debug("%s %s: attempt %d failed: %s", self.name, op, state.failures, trouble)
                await asyncio.sleep(self._backoff(state.failures))
                return
        for i in state.todo:
            state.results[i] = trouble
        state.todo = []

    async def _refresh_or_keep(self) -> None:
        """A call that finds the slot map stale routes by it anyway and leaves a refresh
        running for the calls after it: asking for the map may wait on the very node that
        is failing (a hung startup node costs a socket timeout), and the call has its own
        deadline to keep. Only a connector without any map yet waits for one. While a node
        is down every call wants a refresh; one per ``_REFRESH_EVERY`` is plenty (each
        costs the loop 10-20 ms of parsing ``CLUSTER SLOTS``)."""
        if not self._slots.slots_cache:
            await self._refresh()
        elif time.monotonic() - self._refreshed_at >= _REFRESH_EVERY:
            self._start_refresh()

    async def _moved(self, reply: ErrorReply) -> None:
        """Patch the slot map with the slot's new owner (a reshard, or a failover)."""
        moved = reply.exception()
        try:
            if not isinstance(moved, rexc.MovedError):
                raise ValueError(reply.message)
            await self._slots.move_slot(moved)
        except (KeyError, ValueError, IndexError):
            self._mapped = False  # not a slot we had mapped: ask the cluster

    async def _refresh(self) -> None:
        """Ask the cluster for its slot map and wait for it; concurrent callers share one
        refresh, and a caller's deadline does not cut it short for the others."""
        await asyncio.shield(self._start_refresh())

    def _start_refresh(self) -> asyncio.Task[None]:
        task = self._refreshing
        if task is None or task.done():
            task = asyncio.get_running_loop().create_task(self._discover())
            task.add_done_callback(_retrieve)
            self._refreshing = task
        return task

    async def _discover(self) -> None:
        try:
            await self._slots.initialize()
        except (rexc.RedisError, rexc.RedisClusterException, OSError) as exc:
            text = self._redact(f"{self.name}: no node of {self.url} gave a slot map: {exc}")
            raise BackendUnavailable(text) from None
        finally:
            self._refreshed_at = time.monotonic()
        self._mapped = True

    # one node -----------------------------------------------------------------------------------

    async def _send(
        self, node: str, commands: Sequence[Sequence[Buffer]], asking: list[bool]
    ) -> list[Reply] | ConnectorError:
        """One pipelined round trip to ``node``, behind its breaker. Backend trouble is
        returned (the caller decides: retry, miss or raise); cancellation propagates."""
        breaker = self._breaker(node)
        if not breaker.acquire():
            return CircuitOpen(f"{self.name}: {node} failed repeatedly, circuit open")
        settled = False
        try:
            replies = await self._roundtrip(node, commands, asking)
            settled = True
            breaker.success()
            return replies
        except DENIED as exc:
            settled = True
            breaker.success()  # the node answered
            return self._error(StoragePermissionError, "call", denied_message(self.url, exc))
        except rexc.InvalidResponse as exc:
            settled = True
            breaker.failure()
            return self._error(BackendError, "call", f"protocol error from {node}: {exc}")
        except TRANSIENT as exc:
            settled = True
            breaker.failure()
            return self._error(BackendUnavailable, "call", f"{node}: {exc}")
        except rexc.RedisError as exc:
            settled = True
            breaker.success()
            kind, text = reply_error(exc)
            return self._error(kind, "call", f"{node}: {text}")
        finally:
            if not settled:
                breaker.release()

    async def _roundtrip(
        self, node: str, commands: Sequence[Sequence[Buffer]], asking: list[bool]
    ) -> list[Reply]:
        """Send the commands (each behind ``ASKING`` where asked) on one connection, read
        one reply each (an ``ASKING`` reply is checked and dropped)."""
        pool = self._pool(node)
        conn = await pool.acquire()
        try:
            pieces: list[Buffer] = []
            for command, ask in zip(commands, asking, strict=True):
                if ask:
                    pieces.append(_ASKING)
                pieces.extend(command)
            await conn.send_packed_command(pieces, False)
            try:
                replies = await conn.read_replies(len(commands) + sum(asking))
            except _PARSER_CRASHES as exc:
                raise rexc.InvalidResponse(f"malformed reply: {exc!r}") from exc
            if not any(asking):
                return replies  # type: ignore[no-any-return]
            out: list[Reply] = []
            it = iter(replies)
            for ask in asking:
                if ask and next(it) != "OK":
                    raise rexc.InvalidResponse("ASKING was not answered OK")
                out.append(next(it))
            return out
        except BaseException:
            # Replies may be left unread or a send cut short: never reuse the connection.
            await conn.disconnect(nowait=True)
            raise
        finally:
            pool.release(conn)

    def _pool(self, node: str) -> _NodePool:
        pool = self._pools.get(node)
        if pool is None:
            host, _, port = node.rpartition(":")
            opts = self.options
            kwargs: dict[str, Any] = {
                "host": host.strip("[]"),
                "port": int(port),
                "username": opts.username,
                "password": opts.password,
                "socket_timeout": opts.socket_timeout,
                "socket_connect_timeout": opts.connect_timeout,
                "retry": Retry(NoBackoff(), 0),  # retries are ours, bounded by the deadline
            }
            connection = functools.partial(_WIRE_TCP, **kwargs)
            pool = self._pools[node] = _NodePool(connection, opts.max_connections)
        return pool

    def _breaker(self, node: str) -> CircuitBreaker:
        breaker = self._breakers.get(node)
        if breaker is None:
            opts = self.options
            breaker = self._breakers[node] = CircuitBreaker(
                opts.breaker_threshold, opts.breaker_cooldown
            )
        return breaker

    # messages -------------------------------------------------------------------------------

    def _partial(self, op: str, exc: ConnectorError) -> None:
        """A read answered some keys as misses because their node failed."""
        self._stats.errors += 1
        logger.debug("%s %s: answering a node's keys as misses: %s", self.name, op, exc)

# --- helpers ---------------------------------------------------------------------------------


def _all_or_raise(outcomes: Sequence[T | ConnectorError]) -> list[T]:
    """A write needs every command done: the first node failure is the call's error."""
    for outcome in outcomes:
        if isinstance(outcome, ConnectorError):
            raise outcome
    return list(outcomes)  # type: ignore[arg-type]


def _address(reply: ErrorReply) -> str:
    """``host:port`` of an ``ASK slot host:port`` redirection."""
    return reply.message.rsplit(" ", 1)[1]


def _retrieve(task: asyncio.Task[None]) -> None:
    """A refresh nobody waits for any more still has its exception read (no log noise)."""
    if not task.cancelled():
        task.exception()

