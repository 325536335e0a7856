"""Redis that answers badly: malformed replies, values of the wrong type under our keys,
refused credentials, abandoned sends.

Whatever the backend holds or replies, a public call returns a verified block, a counted
miss, or raises a ConnectorError, within its deadline; the connection that read a bad reply
is dropped. :class:`FakeRedis` (also used by test_conn_resp_fuzz.py) is a RESP server on
loopback that answers the connection handshake like Redis and every other command as the
test says. Real servers here are ones this session started.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import pytest
import pytest_asyncio
import redis.asyncio as aioredis
from conn_testlib import T, make_items, namespace, redis_options, same

from kvplugin import serde
from kvplugin.connectors.base import (
    BackendError,
    ConnectorError,
    ConnectorTimeout,
    StoragePermissionError,
)
from kvplugin.connectors.faults import LocalRedisServer
from kvplugin.connectors.redis import RedisConnector, RedisOptions
from kvplugin.serde import Block

pytestmark = pytest.mark.asyncio
MIB = 1 << 20
MAX_BULK = 512 * MIB  # Redis' proto-max-bulk-len: the reader's cap
DEADLINE = 1.0
MARGIN = 5.0  # how long "within its deadline" may take on a loaded CI machine

# --- a RESP server that says what the test wants -------------------------------------------

Answer = Callable[[list[bytes]], bytes | None]  # bytes to send, or None: close the connection
HANDSHAKE = {b"CLIENT", b"SELECT", b"AUTH"}
HELLO_3 = b"%1\r\n$5\r\nproto\r\n:3\r\n"


class FakeRedis:
    """A RESP server on 127.0.0.1 (port 0). The handshake is answered like Redis, every
    other command by ``answer``; with ``upstream`` set and ``hostile`` false, new
    connections are relayed to that (real) server instead."""

    def __init__(
        self,
        answer: Answer,
        *,
        protocol: int = 3,
        upstream: tuple[str, int] | None = None,
        trickle: tuple[int, float] | None = None,  # (chunk bytes, pause) for slow replies
        close_after: bool = False,  # close the connection after each answer
        hello: bytes = HELLO_3,  # the answer to HELLO (RESP3 connections only)
    ) -> None:
        self.hello = hello
        self.answer = answer
        self.protocol = protocol
        self.upstream = upstream
        self.trickle = trickle
        self.close_after = close_after
        self.hostile = True
        self.connections = 0  # accepted so far
        self.commands: list[list[bytes]] = []  # every non-handshake command seen
        self._open: set[asyncio.StreamWriter] = set()
        self._handlers: set[asyncio.Task[Any]] = set()
        self._server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        port = self._server.sockets[0].getsockname()[1]
        return f"redis://127.0.0.1:{port}/0?protocol={self.protocol}"

    @property
    def open_connections(self) -> int:
        return len(self._open)

    async def start(self) -> FakeRedis:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def aclose(self) -> None:
        if self._server is not None:
            self._server.close()
        self.drop_connections()
        if self._handlers:  # let them end on their own: a loop shutting down cancels them noisily
            await asyncio.wait(self._handlers, timeout=2)

    def drop_connections(self) -> None:
        for writer in list(self._open):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._open.add(writer)
        task = asyncio.current_task()
        assert task is not None
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)
        try:
            if self.hostile or self.upstream is None:
                await self._answer_all(reader, writer)
            else:
                await _relay(reader, writer, self.upstream)
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            self._open.discard(writer)
            writer.transport.abort()

    async def _answer_all(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while (args := await _read_command(reader)) is not None:
            name = args[0].upper()
            if name in HANDSHAKE:
                reply: bytes | None = b"+OK\r\n"
            elif name == b"HELLO":
                reply = self.hello
            else:
                self.commands.append(args)
                reply = self.answer(args)
            if reply is None:
                return
            await self._send(writer, reply)
            if self.close_after and name not in HANDSHAKE and name != b"HELLO":
                return

    async def _send(self, writer: asyncio.StreamWriter, reply: bytes) -> None:
        if self.trickle is None:
            writer.write(reply)
        else:
            size, pause = self.trickle
            for i in range(0, len(reply), size):
                writer.write(reply[i : i + size])
                await writer.drain()
                await asyncio.sleep(pause)
        await writer.drain()


async def _read_command(reader: asyncio.StreamReader) -> list[bytes] | None:
    try:
        head = await reader.readuntil(b"\r\n")
    except asyncio.IncompleteReadError:
        return None
    args = []
    for _ in range(int(head[1:-2])):
        size = int((await reader.readuntil(b"\r\n"))[1:-2])
        args.append((await reader.readexactly(size + 2))[:-2])
    return args


async def _relay(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, upstream: tuple[str, int]
) -> None:
    up_reader, up_writer = await asyncio.open_connection(*upstream)

    async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter) -> None:
        while data := await src.read(1 << 16):
            dst.write(data)
            await dst.drain()
        dst.transport.abort()

    try:
        await asyncio.gather(pump(reader, up_writer), pump(up_reader, writer))
    finally:
        up_writer.transport.abort()


@asynccontextmanager
async def fake_redis(answer: Answer, **kw: Any) -> AsyncIterator[FakeRedis]:
    fake = await FakeRedis(answer, **kw).start()
    try:
        yield fake
    finally:
        await fake.aclose()


def per_key(element: bytes) -> Answer:
    """``element`` as the answer for each key of a command (``MGET``, which the connector
    once loaded with, gets them in an array: these tests were run against it too)."""

    def answer(args: list[bytes]) -> bytes:
        if args[0].upper() == b"MGET":
            return b"*%d\r\n" % (len(args) - 1) + element * (len(args) - 1)
        return element

    return answer


def fast_options(url: str, **kw: Any) -> RedisOptions:
    base: dict[str, Any] = {"socket_timeout": 0.2, "retries": 0, "breaker_threshold": 1000}
    base.update(kw)
    return redis_options(url, **base)


async def within(aw: Any, deadline: float = DEADLINE) -> Any:
    """The call's value or ConnectorError, and it must come back within its deadline."""
    start = time.monotonic()
    try:
        async with asyncio.timeout(deadline + MARGIN):
            result = await aw
    except ConnectorError as exc:
        result = exc
    assert time.monotonic() - start < deadline + 0.5, "a call overran its deadline"
    return result


# --- malformed replies ---------------------------------------------------------------------

BAD_REPLIES = {
    "non-integer length": b"$abc\r\n",
    "length with blanks": b"$ 3 \r\nabc\r\n",
    "negative length": b"$-5\r\n",
    "length over the cap": b"$%d\r\n" % (MAX_BULK + 1),
    "absurd length": b"$99999999999999999999\r\n",
    "bulk without its CRLF": b"$3\r\nabcXY",
    "bad integer": b":12x\r\n",
    "short array": b"*3\r\n:1\r\n",
    "nested arrays": b"*1\r\n" * 5000 + b":1\r\n",
    "unknown type byte": b"?what\r\n",
    "RESP3 double": b",3.5\r\n",
    "RESP3 map": b"%1\r\n+a\r\n+b\r\n",
    "error reply": b"-ERR something went wrong\r\n",
    "line without end": b"+" + b"x" * 100_000,
}


BAD_ON_RESP2 = {  # RESP3 types, which a RESP2 connection never gets
    "null": b"_\r\n",
    "blob error": b"!3\r\nERR\r\n",
    "push": b">1\r\n+x\r\n:1\r\n",
    "attribute": b"|1\r\n+a\r\n+b\r\n:1\r\n",
}
BAD = [pytest.param(r, p, id=f"resp{p}-{n}") for n, r in BAD_REPLIES.items() for p in (2, 3)]
BAD += [pytest.param(r, 2, id=f"resp2-{n}") for n, r in BAD_ON_RESP2.items()]


@pytest.mark.parametrize("reply, protocol", BAD)
async def test_malformed_replies_are_misses_or_errors_and_drop_the_connection(
    reply: bytes, protocol: int
) -> None:
    ((key, block),) = make_items(namespace(), 1)
    fake_cm = fake_redis(per_key(reply), protocol=protocol)
    async with fake_cm as fake, RedisConnector(fast_options(fake.url)) as conn:
        assert await within(conn.lookup([key], timeout=DEADLINE)) == 0
        assert await within(conn.get([key], timeout=DEADLINE)) == [None]
        assert isinstance(await within(conn.put([(key, block)], timeout=DEADLINE)), BackendError)
        assert isinstance(await within(conn.delete([key], timeout=DEADLINE)), BackendError)
        assert not (await within(conn.health(timeout=DEADLINE))).ok
        stats = conn.stats()
        assert (stats.errors, stats.timeouts, stats.hits) == (4, 0, 0)
        await settle(lambda: fake.open_connections == 0)  # no connection was kept
        assert fake.connections == 5  # one per call: none was reused after a bad reply


BAD_HANDSHAKES = {
    "non-integer length": b"%1\r\n$abc\r\n",
    "unhashable map key": b"%1\r\n*1\r\n:1\r\n:2\r\n",
    "bad integer": b":x\r\n",
    "line without end": b"+" + b"x" * 100_000,
    "nested arrays": b"*1\r\n" * 5000 + b":1\r\n",
}


@pytest.mark.parametrize("hello", BAD_HANDSHAKES.values(), ids=BAD_HANDSHAKES.keys())
async def test_a_malformed_handshake_reply_is_an_error_and_the_connection_is_closed(
    hello: bytes,
) -> None:
    # redis-py reads the handshake itself and closes the connection only for its own error
    # classes: anything else left a half-set-up connection (maybe not authenticated, maybe
    # on the wrong database) in the pool.
    ((key, block),) = make_items(namespace(), 1)
    async with fake_redis(per_key(b"$-1\r\n"), hello=hello) as fake:
        conn = RedisConnector(fast_options(fake.url))
        async with conn:
            assert await within(conn.get([key], timeout=DEADLINE)) == [None]
            exc = await within(conn.put([(key, block)], timeout=DEADLINE))
            assert isinstance(exc, BackendError) and "protocol error" in str(exc), exc
            assert conn.stats().errors == 2 and not fake.commands  # nothing sent on them
            await settle(lambda: fake.open_connections == 0)


async def test_server_closing_mid_reply_is_a_retried_connection_error() -> None:
    ((key, block),) = make_items(namespace(), 1)
    fake_cm = fake_redis(per_key(b"$100\r\nabc"), close_after=True)
    async with fake_cm as fake, RedisConnector(fast_options(fake.url, retries=2)) as conn:
        assert await within(conn.get([key], timeout=DEADLINE)) == [None]
        exc = await within(conn.put([(key, block)], timeout=DEADLINE))
        assert isinstance(exc, ConnectorError) and "circuit" not in str(exc)
        assert fake.connections == 6  # three attempts each


async def settle(condition: Callable[[], bool], wait: float = 2.0) -> None:
    end = time.monotonic() + wait
    while not condition():
        assert time.monotonic() < end, "condition not reached"
        await asyncio.sleep(0.01)


WRONG_SHAPES = {
    "UNLINK answers a string": (b"UNLINK", b"$1\r\n1\r\n"),
    "UNLINK counts more keys than asked": (b"UNLINK", b":7\r\n"),
    "UNLINK answers OK": (b"UNLINK", b"+OK\r\n"),
    "PING answers a number": (b"PING", b":1\r\n"),
    "PING answers something else": (b"PING", b"+PANG\r\n"),
    "GET answers a number": (b"GET", b":5\r\n"),
    "GET answers OK": (b"GET", b"+OK\r\n"),
    "STRLEN answers null": (b"STRLEN", b"$-1\r\n"),
    "STRLEN answers a negative length": (b"STRLEN", b":-1\r\n"),
    "SET answers a string": (b"SET", b"$2\r\nOK\r\n"),
    "SET answers a number": (b"SET", b":1\r\n"),
}


@pytest.mark.parametrize("command, reply", WRONG_SHAPES.values(), ids=WRONG_SHAPES.keys())
async def test_replies_of_the_wrong_shape_are_protocol_errors(command: bytes, reply: bytes) -> None:
    def answer(args: list[bytes]) -> bytes:
        return reply if args[0].upper() == command else b"+OK\r\n"

    ((key, block),) = make_items(namespace(), 1)
    async with fake_redis(answer) as fake, RedisConnector(fast_options(fake.url)) as conn:
        if command == b"PING":
            health = await within(conn.health(timeout=DEADLINE))
            assert not health.ok and "protocol error" in health.detail, health
            return
        if command == b"STRLEN":
            assert await within(conn.lookup([key], timeout=DEADLINE)) == 0
            assert conn.stats().errors == 1
            return
        if command == b"UNLINK":
            exc = await within(conn.delete([key], timeout=DEADLINE))
        elif command == b"GET":
            assert await within(conn.get([key], timeout=DEADLINE)) == [None]
            exc = await within(conn.read_raw(key, timeout=DEADLINE))
        else:
            exc = await within(conn.put([(key, block)], timeout=DEADLINE))
        assert isinstance(exc, BackendError) and "protocol error" in str(exc), exc


async def test_protocol_errors_open_the_breaker() -> None:
    ((key, _),) = make_items(namespace(), 1)
    async with fake_redis(per_key(b"$abc\r\n")) as fake:
        conn = RedisConnector(fast_options(fake.url, breaker_threshold=2, breaker_cooldown=60.0))
        async with conn:
            for _ in range(2):
                assert await within(conn.get([key], timeout=DEADLINE)) == [None]
            assert conn.breaker_state == "open"  # a server we cannot understand is down
            seen = fake.connections
            assert await within(conn.get([key], timeout=DEADLINE)) == [None]
            assert fake.connections == seen  # failing fast, not asking again


async def test_resp3_pushes_and_attributes_before_a_reply_are_skipped() -> None:
    ((key, block),) = make_items(namespace(), 1)
    value = serde.encode(block.meta, block.payload).join()
    push = b">3\r\n$7\r\nmessage\r\n$4\r\nchan\r\n*2\r\n:1\r\n_\r\n"
    attribute = b"|1\r\n+key-popularity\r\n%1\r\n$1\r\na\r\n,0.19\r\n"
    reply = push + attribute + b"$%d\r\n%s\r\n" % (len(value), value)
    async with fake_redis(per_key(reply), protocol=3) as fake:
        conn = RedisConnector(fast_options(fake.url))
        async with conn:
            (got,) = await within(conn.get([key], timeout=DEADLINE))
            assert same(got, block)


async def test_a_big_value_on_a_slow_link_is_not_cut_by_the_socket_timeout() -> None:
    # 6 MiB arriving over ~1.5 s: the socket timeout (0.3 s) must not end the read while
    # bytes keep coming; the call's deadline still bounds it.
    ((key, block),) = make_items(namespace(), 1, nbytes=6 * MIB)
    value = serde.encode(block.meta, block.payload).join()
    reply = b"$%d\r\n%s\r\n" % (len(value), value)
    async with fake_redis(per_key(reply), trickle=(MIB // 2, 0.12)) as fake:
        conn = RedisConnector(fast_options(fake.url, socket_timeout=0.3))
        async with conn:
            (got,) = await within(conn.get([key], timeout=T), T)
            assert same(got, block)


# --- values of the wrong type under our keys (a real server) --------------------------------

PLANT = {
    "list": lambda raw, k: raw.lpush(k, b"x"),
    "hash": lambda raw, k: raw.hset(k, "f", "v"),
    "set": lambda raw, k: raw.sadd(k, b"m"),
    "zset": lambda raw, k: raw.zadd(k, {b"m": 1.0}),
    "stream": lambda raw, k: raw.xadd(k, {b"f": b"v"}),
}
EMPTY = {"empty string": lambda raw, k: raw.set(k, b"")}


@pytest_asyncio.fixture
async def raw(redis_server: LocalRedisServer) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(redis_server.url)
    yield client
    await client.aclose()


@pytest.mark.parametrize("kind", PLANT)
async def test_lookup_answers_a_wrong_type_as_a_miss_and_removes_it(
    redis_server: LocalRedisServer, raw: aioredis.Redis, kind: str
) -> None:
    items = make_items(namespace(), 3)
    keys = [k for k, _ in items]
    async with RedisConnector(redis_options(redis_server.url)) as conn:
        await conn.put([items[0], items[2]], timeout=T)
        await PLANT[kind](raw, conn.redis_key(keys[1].id))
        assert await conn.lookup(keys, timeout=T) == 1
        assert conn.stats().corrupt_detected == 1
        assert await raw.exists(conn.redis_key(keys[1].id)) == 0
        assert await conn.put(items, timeout=T) == 3  # the key is usable again
        assert await conn.lookup(keys, timeout=T) == 3


@pytest.mark.parametrize("kind", {**PLANT, **EMPTY})
async def test_get_counts_a_wrong_type_or_empty_value_as_corrupt_and_removes_it(
    redis_server: LocalRedisServer, raw: aioredis.Redis, kind: str
) -> None:
    items = make_items(namespace(), 2)
    keys = [k for k, _ in items]
    async with RedisConnector(redis_options(redis_server.url)) as conn:
        await conn.put(items[:1], timeout=T)
        await {**PLANT, **EMPTY}[kind](raw, conn.redis_key(keys[1].id))
        got = await conn.get(keys, timeout=T)
        assert same(got[0], items[0][1]) and got[1] is None
        stats = conn.stats()
        assert (stats.hits, stats.misses, stats.corrupt_detected) == (1, 1, 1)
        assert await raw.exists(conn.redis_key(keys[1].id)) == 0


@pytest.mark.parametrize("kind", {**PLANT, **EMPTY})
async def test_put_replaces_a_wrong_type_or_empty_value(
    redis_server: LocalRedisServer, raw: aioredis.Redis, kind: str
) -> None:
    items = make_items(namespace(), 3)
    keys = [k for k, _ in items]
    async with RedisConnector(redis_options(redis_server.url, ttl_seconds=100)) as conn:
        await conn.put(items[:1], timeout=T)
        await {**PLANT, **EMPTY}[kind](raw, conn.redis_key(keys[1].id))
        assert await conn.put(items, timeout=T) == 3
        stats = conn.stats()
        assert (stats.stored, stats.existing) == (3, 1)
        assert stats.corrupt_detected == (0 if kind in EMPTY else 1)
        got = await conn.get(keys, timeout=T)
        assert all(same(g, b) for g, (_, b) in zip(got, items, strict=True))
        assert 0 < await raw.ttl(conn.redis_key(keys[1].id)) <= 100


async def test_an_error_reply_for_one_key_fails_the_call_not_the_connector(
    redis_server: LocalRedisServer, raw: aioredis.Redis
) -> None:
    # An ACL user that may only touch "mine:" keys: every other key answers NOPERM.
    user, password = f"u{random.randrange(1 << 30)}", "user-pass-1"
    await raw.acl_setuser(user, enabled=True, passwords=[f"+{password}"], keys=["mine:*"],
                          commands=["+@all"])  # fmt: skip
    url = redis_server.url.replace("redis://", f"redis://{user}:{password}@")
    items = make_items(namespace(), 2)
    keys = [k for k, _ in items]
    try:
        async with RedisConnector(redis_options(url, prefix="theirs:")) as conn:
            assert await conn.lookup(keys, timeout=T) == 0
            assert await conn.get(keys, timeout=T) == [None, None]
            with pytest.raises(StoragePermissionError, match="lacks a permission"):
                await conn.put(items, timeout=T)
            assert conn.stats().errors == 3 and conn.breaker_state == "closed"
        async with RedisConnector(redis_options(url, prefix="mine:")) as conn:
            assert await conn.put(items, timeout=T) == 2
            assert await conn.lookup(keys, timeout=T) == 2
    finally:
        await raw.acl_deluser(user)


# --- refused credentials ---------------------------------------------------------------------

PASSWORD = "s3cret/P@ss w0rd"  # needs percent-encoding in a URL


def with_userinfo(url: str, userinfo: str) -> str:
    return url.replace("redis://", f"redis://{userinfo}@")


def secret_forms(password: str) -> list[str]:
    from urllib.parse import quote, quote_plus

    return [password, quote(password, safe=""), quote_plus(password, safe="")]


CREDENTIALS = {
    "no password": ("", None),
    "wrong password": (":" + "wr0ng%2Fpass", "wr0ng/pass"),
    "unknown ACL user": ("mallory:" + "s3cret%2FP%40ss%20w0rd", PASSWORD),
    "password in the query": ("", "wr0ng/pass"),
}


@pytest.mark.parametrize("case", CREDENTIALS)
async def test_refused_credentials_are_reported_in_our_words_without_the_password(
    private_redis: LocalRedisServer, caplog: pytest.LogCaptureFixture, case: str
) -> None:
    admin = aioredis.Redis.from_url(private_redis.url)
    await admin.config_set("requirepass", PASSWORD)
    await admin.aclose()
    userinfo, sent = CREDENTIALS[case]
    url = with_userinfo(private_redis.url, userinfo) if userinfo else private_redis.url
    if case == "password in the query":
        url += "?password=wr0ng%2Fpass"
    caplog.set_level(logging.DEBUG)
    ((key, block),) = make_items(namespace(), 1)
    async with RedisConnector(redis_options(url)) as conn:
        assert await conn.lookup([key], timeout=T) == 0  # reads are counted misses
        assert await conn.get([key], timeout=T) == [None]
        assert conn.stats().errors == 2
        with pytest.raises(StoragePermissionError) as info:
            await conn.put([(key, block)], timeout=T)
        health = await conn.health(timeout=T)
    message = str(info.value)
    assert "refused the credentials" in message, message
    assert f"{conn.url} refused" in message and f"127.0.0.1:{private_redis.port}/0" in conn.url
    assert not health.ok and "refused the credentials" in health.detail
    texts = [message, health.detail, repr(conn.options), str(info.value.__cause__)]
    texts += [r.getMessage() for r in caplog.records]
    for secret in secret_forms(PASSWORD) + (secret_forms(sent) if sent else []):
        assert not any(secret in text for text in texts), f"{secret!r} leaked"


async def test_the_right_password_is_accepted(private_redis: LocalRedisServer) -> None:
    admin = aioredis.Redis.from_url(private_redis.url)
    await admin.config_set("requirepass", PASSWORD)
    await admin.aclose()
    url = with_userinfo(private_redis.url, ":" + "s3cret%2FP%40ss%20w0rd")
    items = make_items(namespace(), 2)
    async with RedisConnector(redis_options(url)) as conn:
        assert await conn.put(items, timeout=T) == 2
        assert (await conn.health(timeout=T)).ok
        assert "***" in repr(conn.options) and PASSWORD not in repr(conn.options)


# --- abandoned sends are dropped, not flushed -------------------------------------------------


def buffered(conn: RedisConnector) -> int:
    """Bytes waiting in the connector's transports (a send the kernel did not take yet)."""
    pool: Any = conn._pool
    return sum(
        c._writer.transport.get_write_buffer_size()
        for c in pool._in_use_connections
        if c._writer is not None
    )


@pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
@pytest.mark.parametrize("how", ["cancelled", "deadline"])
async def test_an_abandoned_put_never_reaches_the_server(
    private_redis: LocalRedisServer, how: str, loop: str
) -> None:
    # A paused server and a value bigger than the socket buffers: most of the SET stays in
    # the transport. Aborting drops it; a graceful close would send it all on resume, after
    # the caller was told the put failed and has reused its payload buffer. (asyncio copies
    # what it buffers; uvloop keeps views, so there the reused bytes would be sent.)
    if loop == "asyncio":
        await abandon_a_put(private_redis, how)
    else:
        uvloop = pytest.importorskip("uvloop")
        await asyncio.to_thread(uvloop.run, abandon_a_put(private_redis, how))


async def abandon_a_put(server: LocalRedisServer, how: str) -> None:
    key = namespace().key(b"\x05" * 32)
    payload = bytearray(random.Random(5).randbytes(24 * MIB))
    meta = key.meta(token_start=0, token_end=16, dtype="uint8", shape=(2, len(payload) // 2))
    opts = redis_options(server.url, socket_timeout=30.0, retries=0)
    async with RedisConnector(opts) as conn:
        assert (await conn.health(timeout=T)).ok  # a connection is open before the pause
        server.pause()
        try:
            if how == "cancelled":
                task = asyncio.ensure_future(conn.put([(key, Block(meta, payload))], timeout=60))
                await settle(lambda: buffered(conn) > 0, wait=10)
                task.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await task
            else:
                with pytest.raises(ConnectorTimeout):
                    await conn.put([(key, Block(meta, payload))], timeout=0.5)
            payload[:] = bytes(len(payload))  # the caller reuses its buffer
        finally:
            server.resume()
        client = aioredis.Redis.from_url(server.url)
        try:
            for _ in range(20):  # a flushed SET would land within moments of the resume
                assert await client.exists(conn.redis_key(key.id)) == 0
                await asyncio.sleep(0.05)
        finally:
            await client.aclose()
        assert await conn.get([key], timeout=T) == [None]
