"""Scheduler-side planning of the vLLM connector over any layout kvplugin offloads: the hit
the tiers back (every group restorable at it), the objects a load fetches, the objects a
step stores. The decisions are :mod:`kvplugin.aio.plans`' (the native manager's), so both
engines claim, load and store the same objects under the same keys.

Nothing here imports vLLM or torch: requests are read through ``block_hashes``,
``num_tokens`` and ``all_token_ids`` only.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

from kvplugin.aio import plans
from kvplugin.aio.keys import KeySpace
from kvplugin.aio.memory import GroupShape
from kvplugin.connectors.base import Connector
from kvplugin.connectors.keys import ObjectKey
from kvplugin.integrations._events import StoredObject

__all__ = ["Piece", "claim_dropped", "layout_of", "load_pieces", "state_pieces", "tier_claim",
           "worth_reconciling"]

STATE_PROBES = 8  # boundaries asked at once, deepest first (as the native manager does)


@dataclass(slots=True)
class Piece:
    """One stored object and the blocks of one group it fills (load) or comes from (store).

    Chunks: pages ``skip ..`` of the object map to ``block_ids``, whose first holds token
    ``first_token``. States: one page, ``block_ids == [block]``, ``first_token`` is the
    boundary the state was taken at. ``event``: what a ``BlockStored`` reports (stores)."""

    key: ObjectKey
    group: int
    block_ids: list[int]
    first_token: int
    state: bool = False
    skip: int = 0
    event: StoredObject | None = None


def layout_of(shapes: Sequence[GroupShape], chunk_blocks: int, state_unit: int
              ) -> plans.Layout:
    """The native manager's layout for these pages; ``state_unit`` is where vLLM's hits land
    (its ``cache_hit_alignment_tokens``), so a state boundary is one vLLM can resume at."""
    has_state = any(s.kind == "state" for s in shapes)
    return plans.Layout(tuple(s.block_size for s in shapes), chunk_blocks,
                        tuple(s.kind for s in shapes), tuple(s.window_tokens for s in shapes),
                        state_unit if has_state else 0)


async def tier_claim(connector: Connector, keys: KeySpace, layout: plans.Layout, tenant: str,
                     block_hashes: Sequence[bytes], num_tokens: int, local: int,
                     timeout: float) -> plans.Claim:
    """How far the tiers extend vLLM's device hit of ``local`` tokens, at a point every group
    can be restored at (attention chunks up to it, and for state groups the state at it)."""
    hit = plans.LocalHit(local, local)
    hash_tokens = len(block_hashes) * keys.hash_block_size
    windows = plans.lookup_window(layout, num_tokens, plans.device_base(layout, hit),
                                  hash_tokens)
    if not all(windows[g] for g in layout.chunked_groups):
        return plans.Claim(local)
    async with asyncio.timeout(timeout):
        found = await asyncio.gather(*(
            connector.lookup(keys.chunk_keys(tenant, g, block_hashes, w.start, w.stop),
                             timeout=timeout)
            for g, w in enumerate(windows) if layout.chunked(g)))
        present = iter(found)
        tier = plans.TierHit(tuple(w.start for w in windows),
                             tuple(next(present) if layout.chunked(g) else 0
                                   for g, _ in enumerate(windows)))
        states = await _probe_states(connector, keys, layout, tenant, block_hashes,
                                     num_tokens, hit, tier, timeout)
    tier = plans.TierHit(tier.first, tier.present, frozenset(states))
    return plans.reconcile(layout, num_tokens, hash_tokens, hit, tier)


async def _probe_states(connector: Connector, keys: KeySpace, layout: plans.Layout,
                        tenant: str, block_hashes: Sequence[bytes], num_tokens: int,
                        hit: plans.LocalHit, tier: plans.TierHit, timeout: float) -> list[int]:
    """The deepest boundary where the tiers hold every state group's state (or none)."""
    todo = plans.state_candidates(layout, num_tokens, len(block_hashes) * keys.hash_block_size,
                                  hit, tier)
    groups = layout.state_groups
    for i in range(0, len(todo), STATE_PROBES):
        batch = todo[i:i + STATE_PROBES]
        found = await asyncio.gather(*(
            connector.lookup([keys.state_key(tenant, g, block_hashes, n) for g in groups],
                             timeout=timeout) for n in batch))
        for n, count in zip(batch, found, strict=True):
            if count == len(groups):
                return [n]
    return []


def load_pieces(keys: KeySpace, layout: plans.Layout, tenant: str,
                block_hashes: Sequence[bytes], table: Sequence[Sequence[int]], start: int,
                end: int, state_at: int | None) -> list[Piece]:
    """The objects a load of tokens ``[start, end)`` (and the states at ``state_at``)
    fetches, and the blocks of ``table`` (vLLM's block ids per group) they land in. A
    window group fetches only the window before ``end``; vLLM left the rest null."""
    out = []
    for c in plans.load_plan(layout, start, end):
        key = keys.chunk_keys(tenant, c.group, block_hashes, c.chunk, c.chunk + 1)[0]
        ids = list(table[c.group][c.first_block:c.first_block + c.num_blocks])
        out.append(Piece(key, c.group, ids, c.first_block * layout.block_sizes[c.group],
                         skip=c.skip))
    for s in plans.state_plan(layout, state_at):
        key = keys.state_key(tenant, s.group, block_hashes, s.boundary)
        out.append(Piece(key, s.group, [table[s.group][s.slot]], s.boundary, state=True))
    return out


def state_pieces(keys: KeySpace, layout: plans.Layout, tenant: str,
                 block_hashes: Sequence[bytes], offers: Sequence[plans.StateOffer],
                 events: list[StoredObject | None]) -> list[Piece]:
    """Store pieces of the (already selected) state offers."""
    return [Piece(keys.state_key(tenant, o.group, block_hashes, o.boundary), o.group,
                  [o.block_id], o.boundary, state=True, event=ev)
            for o, ev in zip(offers, events, strict=True)]


# ------------------------------------------------------------ divergent local hybrid hits
# vLLM 0.33 (connector declaring supports_divergent_local_hybrid_hits): the per-group device
# hits diverge when full attention reaches deeper than a lagging group and no group deeper
# than it; vLLM then asks the connector from the attention hit cut to its scheduling block
# (``local``), keeps the cut-off sub-block tail unless the claim goes past it, and, the hit
# diverged, falls back to the reconciled hit without asking again when no claim is taken.


def claim_dropped(per_group_hits: Sequence[int], attention_group: int, local: int,
                  external: int) -> bool:
    """Whether vLLM drops a claim of ``external`` tokens from ``local`` on this lookup and
    falls back to the reconciled hit: the hit diverged and the claim does not go past the
    attention hit's sub-block tail (0 included)."""
    deep = per_group_hits[attention_group]
    diverged = min(per_group_hits) < deep and max(per_group_hits) <= deep
    return diverged and external <= deep - local


def worth_reconciling(reconciled_hit: int, scheduler_block: int, external: int) -> bool:
    """Whether a claim of ``external`` tokens from the reconciled hit cut to its scheduling
    block is one vLLM takes (past the reconciled hit's own sub-block tail), i.e. better than
    the reconciled hit alone."""
    return external > reconciled_hit % scheduler_block
