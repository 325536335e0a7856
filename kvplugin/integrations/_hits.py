"""Scheduler-side planning of the vLLM connector over any layout kvplugin offloads: the hit
the tiers back (every group restorable at it), the objects a load fetches, the objects a
step stores. The decisions are :mod:`kvplugin.aio.plans`' (the native manager's), so both
engines claim, load and store the same objects under the same keys.

Nothing here imports vLLM or torch: requests are read through ``block_hashes``,
``num_tokens`` and ``all_token_ids`` only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvplugin.aio import plans, probe
from kvplugin.aio.keys import KeySpace
from kvplugin.aio.offload_ledger import LoadPlan
from kvplugin.connectors.base import Connector
from kvplugin.connectors.keys import ObjectKey
from kvplugin.integrations._events import StoredObject

__all__ = ["Piece", "claim_dropped", "load_pieces", "tier_claim",
           "worth_reconciling"]


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


async def tier_claim(connector: Connector, keys: KeySpace, layout: plans.Layout, tenant: str,
                     block_hashes: Sequence[bytes], num_tokens: int, local: int,
                     timeout: float) -> plans.Claim:
    """How far the tiers extend vLLM's device hit of ``local`` tokens, at a point every group
    can be restored at: the native manager's lookup (:func:`kvplugin.aio.probe.lookup`),
    every question within one ``timeout``."""
    hit = plans.LocalHit(local, local)
    todo = probe.windows_past(layout, num_tokens, len(block_hashes) * keys.hash_block_size,
                              hit)
    if not probe.worth_asking(layout, todo, hit):
        return plans.Claim(local)
    done = await probe.lookup(connector, layout, keys, tenant, block_hashes, todo,
                              num_tokens=num_tokens, hit=hit, timeout=timeout,
                              by_level=False)
    if done.claim is None:
        raise RuntimeError(f"tier lookup for tenant {tenant!r} answered without a claim")
    return done.claim


def load_pieces(layout: plans.Layout, plan: LoadPlan) -> list[Piece]:
    """The offload ledger's load plan as pieces: chunks (``skip`` pages of the object
    before the first block it fills), then states, each with the vLLM blocks it lands in."""
    out = []
    for c, key, ids in zip(plan.chunks, plan.keys, plan.dst, strict=False):
        out.append(Piece(key, c.group, list(ids), c.first_block * layout.block_sizes[c.group],
                         skip=c.skip))
    k = len(plan.chunks)
    for s, key, ids in zip(plan.states, plan.keys[k:], plan.dst[k:], strict=True):
        out.append(Piece(key, s.group, list(ids), s.boundary, state=True))
    return out


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
