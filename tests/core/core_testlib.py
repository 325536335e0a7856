"""Helpers shared by the ``kvplugin.core`` tests: building a manager the way vLLM's engine
does, driving requests through it, and checking the invariants of the spec's section 7.

Everything here goes through the core's public API (plus read-only peeks at the pool's
state, which is what the invariants are about).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvplugin.core.block_pool import BlockPool
from kvplugin.core.blocks import (
    KVCacheBlock,
    external_block_hash,
    get_block_hash,
    get_group_id,
    make_block_hash_with_group_id,
)
from kvplugin.core.events import AllBlocksCleared, BlockRemoved, BlockStored
from kvplugin.core.hashing import BlockHasher, HashContext, resolve_block_hashes
from kvplugin.core.manager import KVCacheBlocks, KVCacheManager
from kvplugin.core.request import LoRAInfo, MMFeature, Request, RequestStatus
from kvplugin.core.specs import (
    ChunkedLocalAttentionSpec,
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
    KVCacheSpec,
    SlidingWindowSpec,
    cdiv,
    resolve_kv_cache_block_sizes,
)

__all__ = [
    "CONFORMANCE",
    "Core",
    "LoRAInfo",
    "MMFeature",
    "RequestStatus",
    "cdiv",
    "check_invariants",
    "chunked",
    "full",
    "ids",
    "require_shared",
    "snapshot",
    "swa",
]


REPO_ROOT = Path(__file__).resolve().parents[2]
# The shared conformance directory: ``<repo root>/../shared``, or ``$KVPLUGIN_SHARED_DIR``.
SHARED_DIR = Path(os.environ.get("KVPLUGIN_SHARED_DIR") or REPO_ROOT.parent / "shared")
CONFORMANCE = SHARED_DIR / "conformance"


def require_shared() -> None:
    """CI provides the shared directory: a missing one is a failure, not a skip."""
    if not CONFORMANCE.is_dir():
        pytest.fail(f"shared conformance directory not found at {CONFORMANCE}: check out "
                    "../shared next to the repository or set KVPLUGIN_SHARED_DIR "
                    "(CI provides it)")


def full(block_size: int = 16) -> FullAttentionSpec:
    return FullAttentionSpec(block_size=block_size)


def swa(window: int, block_size: int = 16) -> SlidingWindowSpec:
    return SlidingWindowSpec(block_size=block_size, sliding_window=window)


def chunked(chunk: int, block_size: int = 16) -> ChunkedLocalAttentionSpec:
    return ChunkedLocalAttentionSpec(block_size=block_size, attention_chunk_size=chunk)


def ids(blocks: Iterable[KVCacheBlock]) -> list[int]:
    return [b.block_id for b in blocks]


class Core:
    """A ``KVCacheManager`` plus the request-side hashing context, built like vLLM's engine
    (and like ``kvplugin.replay``): block sizes resolved by ``resolve_kv_cache_block_sizes``,
    a block hasher only when caching is on."""

    def __init__(
        self,
        groups: Sequence[KVCacheSpec] | None = None,
        *,
        block_size: int = 16,
        num_blocks: int = 11,
        hash_fn: str = "sha256_cbor",
        seed: str | None = None,
        enable_caching: bool = True,
        events: bool = True,
        log_stats: bool = True,
        use_eagle: bool = False,
        lookahead: int = 0,
        watermark: float = 0.0,
        max_model_len: int = 8192,
        max_in_flight_tokens: int | None = None,
        retention: int | None = None,
        prefix_match_unit: int | None = None,
    ) -> None:
        specs = list(groups) if groups is not None else [full(block_size)]
        self.config = KVCacheConfig(
            num_blocks=num_blocks,
            kv_cache_groups=[KVCacheGroupSpec([f"layer{i}"], s) for i, s in enumerate(specs)],
            prefix_cache_retention_interval=retention)
        self.sbs, self.hbs = resolve_kv_cache_block_sizes(
            self.config, block_size, prefix_match_unit=prefix_match_unit,
            enable_caching=enable_caching)
        self.manager = KVCacheManager(
            self.config, max_model_len=max_model_len, scheduler_block_size=self.sbs,
            hash_block_size=self.hbs, max_in_flight_tokens=max_in_flight_tokens,
            enable_caching=enable_caching, use_eagle=use_eagle,
            num_hash_lookahead_tokens=lookahead, log_stats=log_stats,
            enable_kv_cache_events=events, watermark=watermark)
        self.ctx = HashContext.create(hash_fn, seed)
        self.hasher = BlockHasher(self.ctx, self.hbs, lookahead) if enable_caching else None
        self.requests: dict[str, Request] = {}

    # ------------------------------------------------------------------ accessors
    @property
    def pool(self) -> BlockPool:
        return self.manager.block_pool

    def free_ids(self) -> list[int]:
        return ids(self.pool.free_block_queue.get_all_free_blocks())

    def num_free(self) -> int:
        return self.pool.get_num_free_blocks()

    def table(self, req: Request | str, group: int = 0) -> list[int]:
        rid = req if isinstance(req, str) else req.request_id
        return list(self.manager.get_block_ids(rid)[group])

    def key(self, block_hash: bytes, group: int = 0) -> bytes:
        return make_block_hash_with_group_id(block_hash, group)

    def blocks_under(self, block_hash: bytes, group: int = 0) -> list[int]:
        return ids(self.pool.cached_block_hash_to_block.blocks_under(self.key(block_hash, group)))

    def events(self) -> list[Any]:
        return self.manager.take_events()

    # ------------------------------------------------------------------ requests
    def request(self, rid: str, tokens: Sequence[int], **kw: Any) -> Request:
        req = Request(rid, list(tokens), block_hasher=self.hasher, **kw)
        self.requests[rid] = req
        return req

    def lookup(self, req: Request, max_len: int | None = None) -> tuple[KVCacheBlocks, int]:
        blocks, n, _ = self.manager.get_computed_blocks(req, max_len)
        return blocks, n

    def admit(self, req: Request, num_new_tokens: int | None = None,
              **kw: Any) -> tuple[list[list[int]], int, KVCacheBlocks | None]:
        """The scheduler's admission: lookup, then ``allocate_slots`` with the hit.

        Returns (hit block ids per group, hit tokens, allocate_slots' result).  On success
        the request becomes RUNNING with ``num_computed_tokens`` = the hit (as the
        scheduler does before the step executes).
        """
        blocks, n = self.lookup(req)
        if num_new_tokens is None:
            num_new_tokens = req.num_tokens - n
        out = self.manager.allocate_slots(req, num_new_tokens, n, blocks, **kw)
        if out is not None:
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = n
        return [ids(g) for g in blocks.blocks], n, out

    def run(self, req: Request, num_new_tokens: int | None = None, **kw: Any) -> list[int]:
        """Admit and "execute" the step (computed tokens advance); new block ids of group 0."""
        _, n, out = self.admit(req, num_new_tokens, **kw)
        assert out is not None, f"admission of {req.request_id} failed"
        req.num_computed_tokens = n + (req.num_tokens - n if num_new_tokens is None
                                       else num_new_tokens)
        return ids(out.blocks[0])


def new_ids(blocks: KVCacheBlocks | None) -> list[list[int]] | None:
    return None if blocks is None else [ids(g) for g in blocks.blocks]


# ----------------------------------------------------------------------------- state


def snapshot(mgr: KVCacheManager, request_ids: Iterable[str] = ()) -> dict[str, Any]:
    """Everything a read-only call must leave untouched."""
    pool = mgr.block_pool
    cmap = pool.cached_block_hash_to_block
    managers = mgr.coordinator.single_type_managers
    return {
        "refs": [b.ref_cnt for b in pool.blocks],
        "hashes": [(b.block_hash, b.block_hash_num_tokens) for b in pool.blocks],
        "free": ids(pool.free_block_queue.get_all_free_blocks()),
        "map": {k: ids(cmap.blocks_under(k)) for k in list(cmap.keys())},
        "secondary": {k: set(v) for k, v in pool.cached_block_hashes_by_block.items()},
        "tables": {rid: tuple(tuple(ids(t)) for t in mgr.coordinator.get_blocks(rid))
                   for rid in request_ids},
        "num_cached": [dict(m.num_cached_block) for m in managers],
        "events": len(pool.kv_event_queue),
    }


def check_invariants(mgr: KVCacheManager, requests: Iterable[Request]) -> None:
    """Section 7.1 (P1-P8) and 7.2 (H1-H3, H5, H6) for a manager whose live requests are
    ``requests`` (every request that may hold blocks)."""
    pool = mgr.block_pool
    n_blocks = pool.num_gpu_blocks
    null = pool.null_block
    coord = mgr.coordinator
    managers = coord.single_type_managers
    hbs = pool.hash_block_size
    free = pool.free_block_queue.get_all_free_blocks()
    free_ids = ids(free)
    free_set = set(free_ids)

    # P1: block 0 is the null block, never free, never hashed.
    assert null is pool.blocks[0] and null.block_id == 0 and null.is_null
    assert 0 not in free_set
    assert null.block_hash is None
    assert 0 not in pool.cached_block_hashes_by_block
    # P4: the queue's count matches its contents; no block linked twice.
    assert pool.get_num_free_blocks() == len(free) == len(free_set)
    assert all(pool.blocks[b.block_id] is b for b in free)
    # P2, P3
    for b in pool.blocks[1:]:
        assert not b.is_null
        assert b.ref_cnt >= 0, f"block {b.block_id} ref {b.ref_cnt}"
        assert (b.block_id in free_set) == (b.ref_cnt == 0), \
            f"block {b.block_id}: ref {b.ref_cnt}, in free queue {b.block_id in free_set}"
    # P5
    in_use = sum(1 for b in pool.blocks[1:] if b.ref_cnt > 0)
    assert len(free) + in_use + 1 == n_blocks
    # P7
    assert mgr.usage == (1.0 - len(free) / (n_blocks - 1) if n_blocks > 1 else 0.0)
    assert 0.0 <= mgr.usage <= 1.0

    reqs = list(requests)
    live = {r.request_id for r in reqs}
    refs: Counter[int] = Counter()
    owner: dict[int, int] = {}
    tables_by_req: dict[str, tuple[list[KVCacheBlock], ...]] = {}
    for req in reqs:
        tables = tuple(list(t) for t in coord.get_blocks(req.request_id))
        tables_by_req[req.request_id] = tables
        seen: set[int] = set()
        for gid, table in enumerate(tables):
            for b in table:
                if b.is_null:
                    assert b is null
                    continue
                # P8: no block twice in one request's tables.
                assert b.block_id not in seen, f"{req.request_id}: block {b.block_id} twice"
                seen.add(b.block_id)
                refs[b.block_id] += 1
                # A block belongs to one group at a time.
                assert owner.setdefault(b.block_id, gid) == gid
    # P6 (no copy-on-write or connector pins in these layouts)
    for b in pool.blocks[1:]:
        assert b.ref_cnt == refs[b.block_id], \
            f"block {b.block_id}: ref {b.ref_cnt} but {refs[b.block_id]} table slots"
    # Managers know only live requests; cached counts fit the tables.
    for m in managers:
        assert {rid for rid, t in m.req_to_blocks.items() if t} <= live
        assert set(m.num_cached_block) <= live
        for rid, n in m.num_cached_block.items():
            assert n <= len(m.req_to_blocks.get(rid, ())), (rid, n)

    # H1, H3, H5: every map entry is backed by the block's primary or secondary keys.
    cmap = pool.cached_block_hash_to_block
    secondary = pool.cached_block_hashes_by_block
    for key in list(cmap.keys()):
        blocks = cmap.blocks_under(key)
        assert blocks, "empty map entry"
        for b in blocks:
            assert not b.is_null
            assert b.block_hash == key or key in secondary.get(b.block_id, ()), \
                f"block {b.block_id} stored under a key it does not carry"
            if b.block_id in owner:
                assert get_group_id(key) == owner[b.block_id]
    # H2
    for b in pool.blocks:
        if b.block_hash is not None:
            assert cmap.contain(b.block_hash, b.block_id)
        for k in secondary.get(b.block_id, ()):
            assert cmap.contain(k, b.block_id)
    # H6: a hashed block at table position i carries the request's view hash i (or, for a
    # partial-prefix entry, the fine hash at its boundary inside block i).
    for req in reqs:
        for gid, (m, table) in enumerate(zip(managers, tables_by_req[req.request_id],
                                             strict=True)):
            bs = m.block_size
            view = resolve_block_hashes(req.block_hashes, hbs, bs)
            for i, b in enumerate(table):
                if b.is_null or b.block_hash is None:
                    continue
                n = b.block_hash_num_tokens
                if n == (i + 1) * bs:
                    assert b.block_hash == make_block_hash_with_group_id(view[i], gid), \
                        f"{req.request_id} group {gid} position {i}: wrong hash"
                else:
                    assert n is not None and i * bs < n < (i + 1) * bs and n % hbs == 0
                    assert b.block_hash == make_block_hash_with_group_id(
                        req.block_hashes[n // hbs - 1], gid)


def map_multiset(pool: BlockPool) -> Counter[tuple[int, int]]:
    """The prefix-cache map as KV events describe it: (event hash, group) -> #blocks."""
    cmap = pool.cached_block_hash_to_block
    out: Counter[tuple[int, int]] = Counter()
    keys = cmap.keys()
    for key in keys:
        out[(external_block_hash(get_block_hash(key)), get_group_id(key))] += len(
            cmap.blocks_under(key))
    return out


def apply_events(shadow: Counter[tuple[int, int]], events: Iterable[Any]) -> None:
    """Replay KV events onto a shadow of the map (see ``map_multiset``)."""
    for ev in events:
        if isinstance(ev, BlockStored):
            for h in ev.block_hashes:
                shadow[(h, ev.group_idx)] += 1
        elif isinstance(ev, BlockRemoved):
            assert len(ev.block_hashes) == 1
            k = (ev.block_hashes[0], ev.group_idx)
            assert shadow[k] > 0, f"BlockRemoved of an unknown key {k}"
            shadow[k] -= 1
            if not shadow[k]:
                del shadow[k]
        elif isinstance(ev, AllBlocksCleared):
            shadow.clear()
        else:  # pragma: no cover
            raise AssertionError(f"unexpected event {ev!r}")
