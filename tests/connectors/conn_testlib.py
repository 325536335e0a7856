"""Shared helpers for the connector tests (blocks, keys, tolerant assertions)."""

from __future__ import annotations

import random
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from kvplugin.connectors.base import Connector, ConnectorError, PutItem
from kvplugin.connectors.keys import Namespace, ObjectKey
from kvplugin.connectors.redis import RedisOptions
from kvplugin.serde import Block

T = 5.0  # default deadline: generous, the tests never assert speed
LAYOUT = "0123456789abcdef"


def unique_tenant(prefix: str = "t") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


def namespace(tenant: str | None = None, **kw: object) -> Namespace:
    fields: dict[str, object] = {
        "tenant": tenant or unique_tenant(),
        "model": "org/model-7b",
        "layout": LAYOUT,
    }
    fields.update(kw)
    return Namespace(**fields)  # type: ignore[arg-type]


def chain(n: int, seed: int = 0) -> list[bytes]:
    """n chained 32-byte block hashes, deterministic in ``seed``."""
    import hashlib

    out, prev = [], seed.to_bytes(8, "big")
    for i in range(n):
        prev = hashlib.sha256(prev + i.to_bytes(4, "big")).digest()
        out.append(prev)
    return out


def make_block(
    key: ObjectKey,
    nbytes: int = 2048,
    *,
    rng: random.Random | None = None,
    rows: int = 2,
    dtype: str = "uint8",
    index: int = 0,
) -> Block:
    """A block whose bytes are random (seeded) and whose token range follows ``index``."""
    rng = rng or random.Random(key.id)
    payload = rng.randbytes(nbytes)
    itemsize = {"uint8": 1, "float16": 2, "bfloat16": 2, "float32": 4}[dtype]
    meta = key.meta(
        token_start=index * 16,
        token_end=(index + 1) * 16,
        dtype=dtype,
        shape=(rows, nbytes // rows // itemsize),
    )
    return Block(meta, payload)


def make_items(ns: Namespace, n: int, *, nbytes: int = 2048, seed: int = 0) -> list[PutItem]:
    rng = random.Random(seed)
    keys = [ns.key(h) for h in chain(n, seed)]
    return [(k, make_block(k, nbytes, rng=rng, index=i)) for i, k in enumerate(keys)]


def same(a: Block | None, b: Block) -> bool:
    return a is not None and a.meta == b.meta and bytes(a.payload) == bytes(b.payload)


@dataclass
class Subject:
    """A connector under test and what may be asserted about it."""

    conn: Connector
    kind: str  # memory / disk / redis / tiered
    reliable: bool  # False when the fault injector drops, corrupts or fails calls

    async def put(self, items: Sequence[PutItem], timeout: float = T) -> int | None:
        """put(); a faulty subject may raise a ConnectorError, reported as None."""
        try:
            return await self.conn.put(items, timeout=timeout)
        except ConnectorError:
            if self.reliable:
                raise
            return None

    def check_blocks(self, got: Sequence[Block | None], expected: Sequence[Block | None]) -> None:
        """Exact for reliable subjects; otherwise every answer is the right block or None."""
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            if e is None:
                assert g is None
            elif self.reliable:
                assert same(g, e), "a stored block was not returned intact"
            else:
                assert g is None or same(g, e), "a faulty connector returned wrong data"

    def check_count(self, got: int, expected: int) -> None:
        if self.reliable:
            assert got == expected
        else:
            assert 0 <= got <= expected


def redis_options(url: str, **kw: object) -> RedisOptions:
    """Test settings: short socket timeouts and cool-downs so failure tests stay quick."""
    base: dict[str, object] = {
        "url": url,
        "socket_timeout": 0.5,
        "connect_timeout": 0.25,
        "breaker_cooldown": 0.2,
        "max_connections": 8,
    }
    base.update(kw)
    return RedisOptions(**base)  # type: ignore[arg-type]
