"""The vLLM connector's scheduler-side planning (:mod:`kvplugin.integrations._hits`) without
vLLM: hits every group can be restored at, the objects a load fetches, over a real memory
tier. (The connector inside vLLM's Scheduler: test_vllm_connector.py.)"""

from __future__ import annotations

import asyncio
import hashlib
from types import SimpleNamespace
from typing import Any

from kvplugin.aio.keys import KeySpace
from kvplugin.aio.memory import GroupShape, PageShape, StateShape, layout_of
from kvplugin.aio.offload_ledger import OffloadLedger
from kvplugin.connectors.keys import ObjectKey
from kvplugin.connectors.memory import MemoryConnector
from kvplugin.integrations._hits import (
    claim_dropped,
    load_pieces,
    tier_claim,
    worth_reconciling,
)
from kvplugin.serde import Block

BS = 16
FULL = PageShape(2, 2, 4, "float32", BS)
WINDOW = PageShape(2, 2, 4, "float32", BS, window=32)
STATE = StateShape(2, 64, 64, ((4, 4),), ("float32",))


def _hashes(n: int) -> list[bytes]:
    return [hashlib.sha256(f"block{i}".encode()).digest() for i in range(n)]


def _put(conn: MemoryConnector, keys: list[ObjectKey]) -> None:
    items = [(k, Block(k.meta(token_start=0, token_end=BS, dtype="uint8", shape=(8,)),
                       bytes(8))) for k in keys]
    asyncio.run(conn.put(items, timeout=5))


def _claim(shapes: list[GroupShape], stored: dict[int, range], states: list[int],
           num_tokens: int, local: int = 0) -> tuple[int, int | None, KeySpace]:
    keys = KeySpace("m", shapes, BS)
    lay = layout_of(shapes, 1, BS)
    hashes = _hashes(num_tokens // BS)
    conn = MemoryConnector(capacity_bytes=1 << 20)
    for g, chunks in stored.items():
        _put(conn, keys.chunk_keys("t", g, hashes, chunks.start, chunks.stop))
    for n in states:
        _put(conn, [keys.state_key("t", g, hashes, n) for g in lay.state_groups])
    claim = asyncio.run(tier_claim(conn, keys, lay, "t", hashes, num_tokens, local, 1.0))
    return claim.external, claim.state_at, keys


def test_window_group_must_reach_the_hit_like_the_full_group() -> None:
    # 6 chunks in both groups, 100 tokens: the hit is 96 (the last token is computed).
    assert _claim([FULL, WINDOW], {0: range(6), 1: range(6)}, [], 100)[:2] == (96, None)
    # The window group stops at chunk 4: a hit deeper than 64 could not restore it.
    assert _claim([FULL, WINDOW], {0: range(6), 1: range(4)}, [], 100)[:2] == (64, None)


def test_mamba_hit_is_the_deepest_boundary_with_a_stored_state() -> None:
    chunks = {0: range(9)}
    assert _claim([FULL, STATE], chunks, [64, 128], 160)[:2] == (128, 128)
    assert _claim([FULL, STATE], chunks, [64, 96], 160)[:2] == (96, 96)
    # No state, no hit: the attention chunks alone cannot be resumed from.
    assert _claim([FULL, STATE], chunks, [], 160)[:2] == (0, None)
    # From a device hit of 64: only the part beyond it is claimed.
    assert _claim([FULL, STATE], chunks, [128], 160, local=64)[:2] == (64, 128)


def _load_pieces(keys: KeySpace, shapes: list[GroupShape], table: tuple[list[int], ...],
                 end: int, state_at: int | None) -> list[Any]:
    """The pieces of the ledger's load plan of ``[0, end)``, as the connector builds them."""
    lay = layout_of(shapes, 1, BS)
    ledger = OffloadLedger(lay, keys, page_bytes=[s.page_bytes for s in shapes], tiers=(),
                           store_budget_bytes=None)
    req = SimpleNamespace(block_hashes=_hashes(10), num_tokens=160, num_prompt_tokens=160)
    plan = ledger.prepare_load(ledger.open("r", "t", "t", 160), req, table, 0, end, state_at)
    return load_pieces(lay, plan)


def test_load_pieces_fetch_the_window_and_the_state_into_vllms_slots() -> None:
    hashes = _hashes(10)
    keys = KeySpace("m", [FULL, WINDOW], BS)
    table = ([11, 12, 13, 14, 15], [0, 0, 0, 24, 25])  # vLLM nulled the window's past
    pieces = _load_pieces(keys, [FULL, WINDOW], table, 80, None)
    assert [(p.group, p.block_ids, p.first_token) for p in pieces] == [
        (0, [11], 0), (0, [12], 16), (0, [13], 32), (0, [14], 48), (0, [15], 64),
        (1, [24], 48), (1, [25], 64)]
    assert pieces[5].key == keys.chunk_keys("t", 1, hashes, 3, 4)[0]
    skeys = KeySpace("m", [FULL, STATE], BS)
    table = ([11, 12, 13, 14, 15, 16], [0, 31])  # the state at 96 lives in slot 1
    pieces = _load_pieces(skeys, [FULL, STATE], table, 96, 96)
    assert [(p.group, p.block_ids, p.state) for p in pieces][-1] == (1, [31], True)
    assert pieces[-1].key == skeys.state_key("t", 1, hashes, 96)
    assert len(pieces) == 7


def test_claims_vllm_drops_on_a_diverged_hit() -> None:
    # (full attention, Mamba) hits; vLLM asks from the attention hit cut to 64.
    assert claim_dropped((160, 0), 0, 128, 0)  # diverged, nothing claimed
    assert claim_dropped((160, 0), 0, 128, 32)  # no further than the kept tail (160)
    assert not claim_dropped((160, 0), 0, 128, 48)  # past the tail: vLLM takes it
    assert not claim_dropped((160, 160), 0, 128, 0)  # not diverged: vLLM keeps 160
    assert not claim_dropped((160, 192), 0, 128, 0)  # Mamba deeper: vLLM reconciled itself
    assert claim_dropped((192, 64), 0, 192, 0)  # block-aligned attention hit, no claim


def test_a_reconciled_claim_counts_past_its_own_tail() -> None:
    assert worth_reconciling(0, 64, 16)
    assert not worth_reconciling(0, 64, 0)
    assert not worth_reconciling(80, 64, 16)  # vLLM keeps its 16-token tail instead
    assert worth_reconciling(80, 64, 32)
