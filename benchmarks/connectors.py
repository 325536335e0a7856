"""Connector throughput beside a raw baseline, measured in the same run on the same bytes.

For each object size (64 KiB and 1 MiB) and backend, stores and then loads are timed on both
sides:

* Redis — raw: ``redis.asyncio`` ``SET``/``GET`` of the payload bytes through a
  ``BlockingConnectionPool`` of the same size, at the same concurrency, against the same
  self-started ``redis-server``. Connector: ``RedisConnector.put``/``get`` (encode with
  both checksums, ``SET NX``; one pipelined ``GET`` per key, verify, zero-copy decode).
* Redis Cluster — raw: ``redis.asyncio.RedisCluster`` ``SET``/``GET`` of the payload bytes
  (at most ``--concurrency`` connections per node), at the same concurrency, against the
  same self-started local cluster (3 masters with a replica each). Connector:
  ``RedisClusterConnector.put``/``get`` (the Redis connector's format and checks, routed to
  the slot's master).
* Disk — raw: temp file write + rename, and a whole-file read into a pooled buffer (the
  connector's threaded read path), one job per object on a thread pool of the same size, with the
  same fsync policy. Connector: ``DiskConnector.put``/``get`` (the same I/O plus encoding,
  verification, the index and the budget; loads of objects in the page cache are copied on
  the loop without a thread hand-off, ``--inline-read-bytes 0`` measures the threaded path).

Every object moves once per round, one object per call, ``--concurrency`` calls in flight.
Within a round the two sides alternate in chunks of ``--chunk`` objects (the side that goes
first alternates too; dirty pages are flushed, untimed, before each disk chunk), so load
from other processes on a shared machine lands on both sides alike. A round's ratio is
connector throughput / raw throughput; the reported ratio is the median over rounds. The
last line printed is a JSON object whose ``disk_store_ratio``, ``disk_load_ratio``,
``redis_store_ratio``, ``redis_load_ratio``, ``cluster_store_ratio`` and
``cluster_load_ratio`` are for 1 MiB objects (``*_64k`` for 64 KiB).

``--secret`` runs the connectors with a deployment secret (keyed BLAKE3 MACs instead of xxh3
checksums, see :mod:`kvplugin.serde_mac`); the raw side is unchanged.

    python3 benchmarks/connectors.py --quick
    python3 benchmarks/connectors.py --quick --secret
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import pyarrow as pa
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode

from kvplugin.connectors.base import Connector
from kvplugin.connectors.cluster_testing import LocalRedisCluster
from kvplugin.connectors.disk import DiskConnector
from kvplugin.connectors.faults import LocalRedisServer
from kvplugin.connectors.keys import Namespace, ObjectKey
from kvplugin.connectors.redis import RedisConnector, RedisOptions
from kvplugin.connectors.redis_cluster import RedisClusterConnector, RedisClusterOptions
from kvplugin.serde import Block

KIB = 1024
MIB = 1024 * KIB
TIMEOUT = 30.0
Job = Callable[[int], Awaitable[object]]


@dataclass(slots=True)
class Phase:
    """Seconds per round for one side of one operation."""

    raw: list[float] = field(default_factory=list)
    conn: list[float] = field(default_factory=list)

    def ratios(self) -> list[float]:
        return [r / c for r, c in zip(self.raw, self.conn, strict=True)]

    def ratio(self) -> float:
        return statistics.median(self.ratios())


async def run_concurrently(indices: Sequence[int], concurrency: int, job: Job) -> float:
    """Seconds to run ``job(i)`` for every index with ``concurrency`` jobs in flight."""
    it = iter(indices)

    async def worker() -> None:
        for i in it:
            await job(i)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return time.perf_counter() - start


async def interleaved(
    phase: Phase, raw_job: Job, conn_job: Job, args: argparse.Namespace, count: int,
    settle: Callable[[], Awaitable[None]] | None = None,
) -> None:  # fmt: skip
    """One round: raw and connector alternate in chunks of ``args.chunk`` objects, so load
    from other processes lands on both sides alike; each side's chunk times are summed."""
    raw_s = conn_s = 0.0
    for n, start in enumerate(range(0, count, args.chunk)):
        chunk = range(start, min(start + args.chunk, count))
        sides = [(True, raw_job), (False, conn_job)]
        for is_raw, job in sides if n % 2 == 0 else sides[::-1]:
            if settle is not None:
                await settle()
            seconds = await run_concurrently(chunk, args.concurrency, job)
            if is_raw:
                raw_s += seconds
            else:
                conn_s += seconds
    phase.raw.append(raw_s)
    phase.conn.append(conn_s)


def make_items(size: int, count: int, distinct: int, tenant: str) -> list[tuple[ObjectKey, Block]]:
    """``count`` blocks over ``distinct`` random payloads of ``size`` bytes (16 rows each)."""
    payloads = [os.urandom(size) for _ in range(distinct)]
    ns = Namespace(tenant, "bench/model", "0123456789abcdef")
    items = []
    for i in range(count):
        key = ns.key(i.to_bytes(8, "big") + os.urandom(8))
        meta = key.meta(token_start=0, token_end=256, dtype="bfloat16", shape=(16, size // 32))
        items.append((key, Block(meta, payloads[i % distinct])))
    return items


# --- Redis ---------------------------------------------------------------------------------


Op = Callable[[int], Awaitable[None]]


def _redis_ops(raw: Any, conn: Connector, items: Sequence[tuple[ObjectKey, Block]]
               ) -> tuple[Op, Op, Op, Op]:
    """Item i's raw SET / GET (``raw``: a redis-py client, single node or cluster) and the
    connector's put / get of the same payload."""
    raw_keys = [f"raw:{i}".encode() for i in range(len(items))]

    async def raw_set(i: int) -> None:
        await raw.set(raw_keys[i], items[i][1].payload)

    async def raw_get(i: int) -> None:
        if await raw.get(raw_keys[i]) is None:
            raise RuntimeError("raw GET missed")

    async def conn_put(i: int) -> None:
        if await conn.put([items[i]], timeout=TIMEOUT) != 1:
            raise RuntimeError("connector put failed")

    async def conn_get(i: int) -> None:
        if (await conn.get([items[i][0]], timeout=TIMEOUT))[0] is None:
            raise RuntimeError("connector get missed")

    return raw_set, raw_get, conn_put, conn_get


async def bench_redis(
    url: str, items: Sequence[tuple[ObjectKey, Block]], args: argparse.Namespace
) -> tuple[Phase, Phase]:
    conc = args.concurrency
    raw_pool = aioredis.BlockingConnectionPool.from_url(url, max_connections=conc)
    raw = aioredis.Redis(connection_pool=raw_pool)
    conn = RedisConnector(
        RedisOptions(url=url, max_connections=conc, socket_timeout=TIMEOUT), secret=args.key
    )
    store, load = Phase(), Phase()
    raw_set, raw_get, conn_put, conn_get = _redis_ops(raw, conn, items)

    try:
        for _ in range(args.rounds):
            await raw.flushall()  # our own server, started by this script
            await interleaved(store, raw_set, conn_put, args, len(items))
            await interleaved(load, raw_get, conn_get, args, len(items))
    finally:
        await conn.aclose()
        await raw.aclose()
        await raw_pool.aclose()
    return store, load


# --- Redis Cluster ---------------------------------------------------------------------------


async def bench_cluster(
    url: str, items: Sequence[tuple[ObjectKey, Block]], args: argparse.Namespace
) -> tuple[Phase, Phase]:
    conc = args.concurrency
    nodes = url.removeprefix("redis-cluster://").split(",")
    raw = aioredis.RedisCluster(
        startup_nodes=[ClusterNode(*n.rsplit(":", 1)) for n in nodes], max_connections=conc
    )
    await raw.initialize()
    conn = RedisClusterConnector(
        RedisClusterOptions(url=url, max_connections=conc, socket_timeout=TIMEOUT), secret=args.key
    )
    store, load = Phase(), Phase()
    raw_set, raw_get, conn_put, conn_get = _redis_ops(raw, conn, items)

    try:
        for _ in range(args.rounds):
            await raw.flushall(target_nodes=aioredis.RedisCluster.PRIMARIES)  # our own cluster
            await interleaved(store, raw_set, conn_put, args, len(items))
            await interleaved(load, raw_get, conn_get, args, len(items))
    finally:
        await conn.aclose()
        await raw.aclose()
    return store, load


# --- disk ----------------------------------------------------------------------------------


def raw_write(path: str, data: memoryview, fsync: bool) -> None:
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    try:
        view = data
        while view.nbytes:
            view = view[os.write(fd, view) :]
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        dfd = os.open(os.path.dirname(path), os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)


def raw_read(path: str) -> memoryview:
    """Whole-file read into a pooled buffer, the way the disk connector reads."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        view = memoryview(pa.allocate_buffer(os.fstat(fd).st_size))
        got = 0
        while got < view.nbytes:
            got += os.readv(fd, [view[got:]])
        return view
    finally:
        os.close(fd)


async def bench_disk(
    root: str, items: Sequence[tuple[ObjectKey, Block]], args: argparse.Namespace
) -> tuple[Phase, Phase]:
    loop = asyncio.get_running_loop()
    pool = ThreadPoolExecutor(args.io_threads)
    raw_root = os.path.join(root, "raw")
    raw_paths = [os.path.join(raw_root, f"{i % 256:02x}", f"{i}.bin") for i in range(len(items))]
    for p in {os.path.dirname(p) for p in raw_paths}:
        os.makedirs(p, exist_ok=True)
    conn = DiskConnector(
        os.path.join(root, "conn"),
        capacity_bytes=1 << 40,
        fsync=args.fsync,
        io_threads=args.io_threads,
        inline_read_bytes=args.inline_read_bytes,
        secret=args.key,
    )
    await conn.start()
    payloads = [memoryview(block.payload) for _, block in items]
    keys = [key for key, _ in items]
    store, load = Phase(), Phase()

    async def raw_put(i: int) -> None:
        await loop.run_in_executor(pool, raw_write, raw_paths[i], payloads[i], args.fsync)

    async def raw_get(i: int) -> None:
        await loop.run_in_executor(pool, raw_read, raw_paths[i])

    async def conn_put(i: int) -> None:
        if await conn.put([items[i]], timeout=TIMEOUT) != 1:
            raise RuntimeError("connector put failed")

    async def conn_get(i: int) -> None:
        if (await conn.get([keys[i]], timeout=TIMEOUT))[0] is None:
            raise RuntimeError("connector get missed")

    async def settle() -> None:
        # Flush dirty pages (untimed) so write-back started by one side is not billed to
        # the other.
        await asyncio.to_thread(os.sync)

    try:
        for _ in range(args.rounds):
            for p in raw_paths:
                if os.path.exists(p):
                    os.unlink(p)
            await conn.delete(keys, timeout=TIMEOUT)
            await interleaved(store, raw_put, conn_put, args, len(items), settle)
            await interleaved(load, raw_get, conn_get, args, len(items), settle)
    finally:
        await conn.aclose()
        pool.shutdown()
    loads = args.rounds * len(items)
    print(f"disk loads served from the page cache on the loop: {conn.inline_reads}/{loads}")
    return store, load


# --- driver --------------------------------------------------------------------------------


def report(label: str, size: int, count: int, phase: Phase) -> None:
    raw_gbs = size * count / statistics.median(phase.raw) / 1e9
    conn_gbs = size * count / statistics.median(phase.conn) / 1e9
    rounds = " ".join(f"{r:.2f}" for r in phase.ratios())
    print(
        f"{label:<14} {size // KIB:>5} KiB  raw {raw_gbs:6.2f} GB/s  connector {conn_gbs:6.2f} GB/s"
        f"  ratio {phase.ratio():.3f}  (rounds: {rounds})"
    )


async def main_async(args: argparse.Namespace) -> dict[str, object]:
    work = tempfile.mkdtemp(prefix="kvplugin-bench-")
    server = LocalRedisServer(os.path.join(work, "redis"))
    cluster = LocalRedisCluster(os.path.join(work, "cluster"))
    result: dict[str, object] = {}
    try:
        if "redis" in args.backends:
            server.start()
        if "cluster" in args.backends:
            cluster.start()
        for size, count in ((64 * KIB, args.count_64k), (MIB, args.count_1m)):
            items = make_items(size, count, distinct=8, tenant="bench")
            suffix = "" if size == MIB else "_64k"
            for backend in args.backends:
                if backend == "redis":
                    store, load = await bench_redis(server.url, items, args)
                elif backend == "cluster":
                    store, load = await bench_cluster(cluster.url, items, args)
                else:
                    store, load = await bench_disk(os.path.join(work, f"disk{suffix}"), items, args)
                report(f"{backend} store", size, count, store)
                report(f"{backend} load", size, count, load)
                result[f"{backend}_store_ratio{suffix}"] = round(store.ratio(), 3)
                result[f"{backend}_load_ratio{suffix}"] = round(load.ratio(), 3)
    finally:
        server.kill()
        cluster.kill_all()
        shutil.rmtree(work, ignore_errors=True)
    return result


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="small run, under a minute")
    p.add_argument("--concurrency", type=int, default=4, help="calls in flight (default 4)")
    p.add_argument("--io-threads", type=int, default=4, help="disk thread pool size")
    p.add_argument("--fsync", action="store_true", help="fsync files and directories")
    p.add_argument("--rounds", type=int, default=None)
    p.add_argument(
        "--inline-read-bytes",
        type=int,
        default=4 * MIB,
        help="DiskConnector page-cache reads on the loop, bytes per call (0: all on threads)",
    )
    p.add_argument("--chunk", type=int, default=8, help="objects per alternating chunk")
    p.add_argument(
        "--backends",
        default="redis,cluster,disk",
        help="comma-separated, of redis, cluster, disk (default: all three)",
    )
    p.add_argument("--uvloop", action="store_true", help="run on uvloop instead of asyncio")
    p.add_argument(
        "--secret", action="store_true", help="connectors seal with keyed MACs (a random secret)"
    )
    args = p.parse_args(argv)
    args.key = os.urandom(32) if args.secret else None
    args.backends = [b for b in args.backends.split(",") if b]
    if not args.backends or set(args.backends) - {"redis", "cluster", "disk"}:
        p.error(f"--backends: choose among redis, cluster, disk, got {args.backends}")
    if args.rounds is None:
        args.rounds = 9 if args.quick else 15
    args.count_1m = 96 if args.quick else 256
    args.count_64k = 384 if args.quick else 2048
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if not LocalRedisServer.available():
        print("redis-server not found on PATH", file=sys.stderr)
        return 2
    if "cluster" in args.backends and not LocalRedisCluster.available():
        print("redis-cli not found on PATH (needed for the cluster)", file=sys.stderr)
        return 2
    start = time.perf_counter()
    gc.disable()  # no collector pauses inside timed chunks (either side)
    if args.uvloop:
        import uvloop

        result = uvloop.run(main_async(args))
    else:
        result = asyncio.run(main_async(args))
    result.update(
        concurrency=args.concurrency,
        fsync=args.fsync,
        inline_read_bytes=args.inline_read_bytes,
        rounds=args.rounds,
        loop="uvloop" if args.uvloop else "asyncio",
        secret=args.secret,
        backends=args.backends,
        seconds=round(time.perf_counter() - start, 1),
    )
    print(json.dumps(result, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
