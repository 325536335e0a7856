"""The disk tier's index, byte accounting and files agree under cancellation storms.

Random interleavings of put / get / delete / raw overwrite, with evictions (a small
capacity) and callers cancelled at random points, on one I/O thread and on several, with
inline page-cache reads on and off. After every settle the connector's index must equal a
rescan of the directory (same objects, same sizes), its byte count the index's sum, and
nothing may be reserved; after close, a connector reopened on the directory must rebuild
exactly that index. Hypothesis drives the interleavings (derandomized under CI); the I/O
threads' timing adds its own variety, which the invariants must survive too.
"""

from __future__ import annotations

import asyncio
import os
import random
from dataclasses import dataclass
from pathlib import Path

from conn_testlib import make_block, namespace, redis_options, unique_tenant
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvplugin.connectors.base import ConnectorError, PutItem
from kvplugin.connectors.disk import SUFFIX, DiskConnector
from kvplugin.connectors.faults import LocalRedisServer
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.connectors.redis import RedisConnector
from kvplugin.connectors.tiered import TieredConnector

SIZES = [3000 + 700 * i for i in range(8)]  # distinct sizes: a wrong size shows
T = 5.0
FIXTURES = [HealthCheck.function_scoped_fixture]  # tmp_path is shared: each run makes its dir


class Data:
    """Eight objects of one namespace (a fresh one per run: a shared Redis starts empty)."""

    def __init__(self, tenant: str = "storm") -> None:
        ns = namespace(tenant)
        self.keys = [ns.key(bytes([i]) * 32) for i in range(8)]
        self.blocks = [make_block(k, n, index=i)
                       for i, (k, n) in enumerate(zip(self.keys, SIZES, strict=True))]
        self.raw: dict[int, bytes] = {}

    async def encoded(self, i: int) -> bytes:
        """The encoded bytes of block i (as a put writes them), from a scratch store."""
        if i not in self.raw:
            async with MemoryConnector(capacity_bytes=1 << 20) as scratch:
                await scratch.put([(self.keys[i], self.blocks[i])], timeout=T)
                raw = await scratch.read_raw(self.keys[i], timeout=T)
            assert raw is not None
            self.raw[i] = raw
        return self.raw[i]


DATA = Data()


@dataclass(frozen=True)
class Op:
    kind: str  # put / get / delete / raw / settle
    keys: tuple[int, ...]
    cancel_after: int | None  # loop turns before the caller is cancelled; None: never


ops = st.one_of(
    st.just(Op("settle", (), None)),
    st.builds(
        Op,
        st.sampled_from(["put", "put", "get", "delete", "raw"]),
        st.lists(st.integers(0, 7), min_size=1, max_size=4, unique=True).map(tuple),
        st.one_of(st.none(), st.integers(0, 12)),
    ),
)


def on_disk(root: str) -> dict[str, int]:
    """A rescan of the directory: storage id -> file size (temp files are not objects)."""
    found = {}
    for ns in os.listdir(root):
        ns_dir = os.path.join(root, ns)
        if not os.path.isdir(ns_dir):
            continue
        for dirpath, _, names in os.walk(ns_dir):
            for name in names:
                if name.endswith(SUFFIX):
                    found[ns + name[: -len(SUFFIX)]] = os.path.getsize(os.path.join(dirpath, name))
    return found


def check(conn: DiskConnector, root: str) -> None:
    index = conn.objects()
    assert index == on_disk(root), "the index and the files disagree"
    assert conn.used_bytes == sum(index.values())
    assert conn.used_bytes <= conn.capacity_bytes


async def call(conn: DiskConnector | TieredConnector, op: Op, data: Data) -> None:
    keys = [data.keys[i] for i in op.keys]
    items: list[PutItem] = [(data.keys[i], data.blocks[i]) for i in op.keys]
    try:
        if op.kind == "put":
            await conn.put(items, timeout=T)
        elif op.kind == "get":
            got = await conn.get(keys, timeout=T)
            for g, i in zip(got, op.keys, strict=True):  # a hit is the block, never another
                assert g is None or bytes(g.payload) == bytes(data.blocks[i].payload)
        elif op.kind == "delete":
            await conn.delete(keys, timeout=T)
        elif isinstance(conn, DiskConnector):  # raw: an overwrite with the same bytes
            await conn.write_raw(keys[0], await data.encoded(op.keys[0]), timeout=T)
    except ConnectorError:
        pass  # a full budget, say: an outcome, not a broken invariant


async def storm(conn: DiskConnector | TieredConnector, script: list[Op], disk: DiskConnector,
                root: str, data: Data = DATA) -> None:
    running: list[asyncio.Task[None]] = []

    async def settle() -> None:
        await asyncio.gather(*running, return_exceptions=True)
        running.clear()
        await disk.quiesce()
        check(disk, root)

    async def cancel_later(task: asyncio.Task[None], turns: int) -> None:
        for _ in range(turns):
            await asyncio.sleep(0)
        task.cancel()

    for op in script:
        if op.kind == "settle":
            await settle()
            continue
        task = asyncio.ensure_future(call(conn, op, data))
        running.append(task)
        if op.cancel_after is not None:
            running.append(asyncio.ensure_future(cancel_later(task, op.cancel_after)))
        await asyncio.sleep(0)
    await settle()


def run_disk(tmp: Path, script: list[Op], threads: int, inline: bool) -> None:
    root = str(tmp / f"d{random.getrandbits(48):x}")
    cap = sum(SIZES) // 2 + 4096  # about half the objects fit: puts evict

    async def main() -> None:
        disk = DiskConnector(root, capacity_bytes=cap, io_threads=threads,
                             inline_read_bytes=(1 << 20) if inline else 0)
        async with disk:
            await disk.start()
            await storm(disk, script, disk, root)
            final = disk.objects()
        async with DiskConnector(root, capacity_bytes=cap, io_threads=threads) as again:
            await again.start()
            assert again.objects() == final, "a restart rebuilt a different index"
            check(again, root)

    asyncio.run(main())


@settings(max_examples=200, deadline=None, suppress_health_check=FIXTURES)
@given(script=st.lists(ops, min_size=1, max_size=30), threads=st.sampled_from([1, 4]),
       inline=st.booleans())
def test_disk_index_equals_files_under_cancellation(tmp_path: Path, script: list[Op],
                                                    threads: int, inline: bool) -> None:
    run_disk(tmp_path, script, threads, inline)


@settings(max_examples=80, deadline=None, suppress_health_check=FIXTURES)
@given(script=st.lists(ops, min_size=1, max_size=30), threads=st.sampled_from([1, 4]))
def test_tiered_disk_tier_equals_files_under_cancellation(
    tmp_path: Path, redis_server: LocalRedisServer, script: list[Op], threads: int
) -> None:
    """Memory over disk over a real Redis, as the outside run had it: promotions into the
    disk tier and tiered deletes join the storm."""
    root = str(tmp_path / f"t{random.getrandbits(48):x}")
    cap = sum(SIZES) // 2 + 4096
    data = Data(unique_tenant("storm"))

    async def main() -> None:
        disk = DiskConnector(root, capacity_bytes=cap, io_threads=threads)
        tiers = [MemoryConnector(capacity_bytes=3 * 4096), disk,
                 RedisConnector(redis_options(redis_server.url))]
        async with TieredConnector(tiers) as tiered:
            await disk.start()
            await storm(tiered, script, disk, root, data)
            final = disk.objects()
        async with DiskConnector(root, capacity_bytes=cap, io_threads=threads) as again:
            await again.start()
            assert again.objects() == final
            check(again, root)

    asyncio.run(main())
