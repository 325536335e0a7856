"""Asking the tiers how far they extend a device hit: the one lookup both engines run.

The native manager (:meth:`AsyncKVManager.lookup`) and the vLLM connector's lookup server
(:class:`kvplugin.integrations._lookup.LookupServer`) both call :func:`lookup`, so they ask
the same questions in the same order:
each chunked group's chunks past the device hit, all groups at once, then the state groups'
states at the candidate boundaries, a few boundaries at a time, deepest first, until one
has every state group. Every question shares one :class:`Deadline`: the whole lookup, not
each call, is bounded by the caller's timeout. What the answers mean (the claim) is
:func:`plans.reconcile`'s.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvplugin.aio import plans
from kvplugin.aio.jobs import lookup_levels
from kvplugin.aio.keys import KeyScope, KeySpace
from kvplugin.connectors.base import Connector, Deadline
from kvplugin.connectors.keys import ObjectKey

__all__ = ["STATE_PROBES", "ChunkKeys", "TierAnswer", "TierLookup", "ask_tiers", "lookup"]

# ``(group, first, stop)`` -> the keys of that group's chunks ``[first, stop)``.
ChunkKeys = Callable[[int, int, int], list[ObjectKey]]

STATE_PROBES = 8  # state boundaries asked at once, deepest first, until one is found


@dataclass(frozen=True, slots=True, kw_only=True)
class TierAnswer:
    """What the tiers hold past the device hit: per group, the level (index among the
    tiers, fastest first) of each chunk present from the window's first (``()`` for state
    groups); and the deepest boundary where every state group's state is held, with its
    slowest level (``()`` when none is, or the layout has no state group)."""

    first: tuple[int, ...]
    levels: tuple[tuple[int, ...], ...]
    states: tuple[tuple[int, int], ...]

    def tier_hit(self) -> plans.TierHit:
        return plans.TierHit(self.first, tuple(len(lv) for lv in self.levels),
                             frozenset(b for b, _ in self.states))


async def ask_tiers(connector: Connector, layout: plans.Layout,
                    windows: Sequence[range], chunk_keys: Sequence[Sequence[ObjectKey]],
                    state_keys: Callable[[int], list[ObjectKey]], *, num_tokens: int,
                    num_hash_tokens: int, hit: plans.LocalHit, deadline: Deadline,
                    by_level: bool = True) -> TierAnswer:
    """The tiers' answer for one request. ``chunk_keys[g]``: the keys of ``windows[g]``
    (empty for state groups); ``state_keys(n)``: every state group's key at boundary ``n``.
    ``by_level=False`` asks the connector as one store (levels all 0): enough for a caller
    that only needs how far the tiers reach, and one call per question on a tiered one.
    Raises TimeoutError past ``deadline`` (the caller's ``asyncio.timeout`` cancels the
    calls in flight)."""
    found = await asyncio.gather(*(lookup_levels(connector, k, deadline, by_level=by_level)
                                   for k in chunk_keys))
    first = tuple(w.start for w in windows)
    levels = tuple(tuple(lv) for lv in found)
    chunks_only = TierAnswer(first=first, levels=levels, states=())
    todo = plans.state_candidates(layout, num_tokens, num_hash_tokens, hit,
                                  chunks_only.tier_hit())
    wanted = len(layout.state_groups)
    for i in range(0, len(todo), STATE_PROBES):
        batch = todo[i:i + STATE_PROBES]
        answers = await asyncio.gather(*(
            lookup_levels(connector, state_keys(n), deadline, by_level=by_level)
            for n in batch))
        for n, got in zip(batch, answers, strict=True):
            if len(got) == wanted:
                return TierAnswer(first=first, levels=levels, states=((n, max(got)),))
    return chunks_only


@dataclass(frozen=True, slots=True)
class TierLookup:
    """One request's lookup: the windows asked (per group, the chunks past the device hit),
    and, when anything was worth asking, the tiers' answer and the claim it makes."""

    windows: tuple[range, ...]
    answer: TierAnswer | None = None
    claim: plans.Claim | None = None

    @property
    def first(self) -> tuple[int, ...]:
        return tuple(w.start for w in self.windows)


def windows_past(layout: plans.Layout, num_tokens: int, num_hash_tokens: int,
                 hit: plans.LocalHit) -> TierLookup:
    """The windows of a lookup, before anything is asked."""
    base = plans.device_base(layout, hit)
    return TierLookup(plans.lookup_window(layout, num_tokens, base, num_hash_tokens))


def worth_asking(layout: plans.Layout, todo: TierLookup, hit: plans.LocalHit) -> bool:
    """Whether the tiers could add anything: chunks past the hit in every chunked group, or
    a lagging device state (a deeper attention hit) the tiers may hold the state for."""
    return all(todo.windows[g] for g in layout.chunked_groups) or hit.deep > hit.reconciled


async def lookup(connector: Connector, layout: plans.Layout, keyspace: KeySpace,
                 scope: str | KeyScope, block_hashes: Sequence[bytes], todo: TierLookup, *,
                 num_tokens: int, hit: plans.LocalHit, timeout: float,
                 chunk_keys: ChunkKeys | None = None, by_level: bool = True) -> TierLookup:
    """Ask the tiers about ``todo``'s windows, every question within one ``timeout``
    (TimeoutError past it), and reconcile their answer with the device hit into the claim.
    ``chunk_keys`` may serve the keys from a per-request cache."""
    if chunk_keys is None:
        def chunk_keys(g: int, first: int, stop: int) -> list[ObjectKey]:
            return keyspace.chunk_keys(scope, g, block_hashes, first, stop)
    keys = [chunk_keys(g, w.start, w.stop) if layout.chunked(g) else []
            for g, w in enumerate(todo.windows)]
    groups = layout.state_groups

    def state_keys(n: int) -> list[ObjectKey]:
        return [keyspace.state_key(scope, g, block_hashes, n) for g in groups]

    hash_tokens = len(block_hashes) * keyspace.hash_block_size
    async with asyncio.timeout(timeout):
        answer = await ask_tiers(connector, layout, todo.windows, keys, state_keys,
                                 num_tokens=num_tokens, num_hash_tokens=hash_tokens, hit=hit,
                                 deadline=Deadline.after(timeout), by_level=by_level)
    claim = plans.reconcile(layout, num_tokens, hash_tokens, hit, answer.tier_hit())
    return TierLookup(todo.windows, answer, claim)
