"""Pure offload decisions: functions of values, no awaits, no I/O, no core objects.

The manager gathers the facts (the local hit, what a lookup found, what a load returned,
how far a request has computed), asks these functions what to do, and carries it out. Token
counts are absolute positions in the request; chunk indices count from the request's start.

Four kinds of group (:class:`Layout`; their behaviour is registered in
:mod:`kvplugin.aio.group_kinds`, which maps every KV-cache spec offload serves to one):

* ``"full"`` — full attention (and MLA): every block before a hit is needed, stored as
  chunks of ``chunk_blocks`` blocks keyed by the chain hash of their last block;
* ``"window"`` — sliding window (and sliding-window MLA): stored like full attention, but a
  hit at N needs only the blocks of the window before N (the core puts null blocks
  elsewhere, nothing to load);
* ``"local"`` — chunked local attention (Llama 4): the same, the blocks needed being those
  of N's own attention chunk, ``[N // C * C, N)``;
* ``"state"`` — Mamba "align": a hit at N needs the recurrent state at exactly N, one
  object per boundary.

A hit at N is usable only when *every* group can be restored at N, from the device or from
a tier (:func:`reconcile`); a store of a state goes out with the chunks it needs, and is
dropped when one of them cannot be stored (:func:`select_states`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Iterable, Sequence, Set
from dataclasses import dataclass, field

from kvplugin.aio import group_kinds
from kvplugin.aio.group_kinds import PlanKind
from kvplugin.core.single_type.mamba_checkpoints import prefill_checkpoint_position

__all__ = [
    "ChunkLoad",
    "ChunkOffer",
    "ChunkOffers",
    "Claim",
    "Layout",
    "LocalHit",
    "StateLoad",
    "StateOffer",
    "StoreSelection",
    "TierHit",
    "chunk_offers",
    "claim_external",
    "device_base",
    "external_span",
    "load_plan",
    "lookup_window",
    "mamba_split",
    "reconcile",
    "resume_point",
    "select_states",
    "select_stores",
    "state_candidates",
    "state_plan",
    "store_window",
    "tokens_by_level",
    "verified_end",
]


@dataclass(frozen=True, slots=True)
class Layout:
    """Per group: block size, plan kind (:func:`group_kinds.plan_kinds`), and its token
    span (a window group: the tokens kept behind the next one; a chunked local group: its
    attention chunk); blocks per stored chunk; the token unit a state boundary is a
    multiple of."""

    block_sizes: tuple[int, ...]
    chunk_blocks: int
    kinds: tuple[str, ...] = ()  # () means every group is "full"
    window_tokens: tuple[int, ...] = ()  # window: sliding_window - 1 + extra retained;
    # local: attention_chunk_size; 0 for the others
    state_unit: int = 0  # the core's hit alignment; needed when a group is a state
    plan_kinds: tuple[PlanKind, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        n = len(self.block_sizes)
        if not n or any(b < 1 for b in self.block_sizes):
            raise ValueError(f"block sizes must be positive, got {self.block_sizes!r}")
        if self.chunk_blocks < 1:
            raise ValueError(f"chunk_blocks must be positive, got {self.chunk_blocks!r}")
        if not self.kinds:
            object.__setattr__(self, "kinds", (group_kinds.FULL.name,) * n)
        if not self.window_tokens:
            object.__setattr__(self, "window_tokens", (0,) * n)
        if len(self.kinds) != n or len(self.window_tokens) != n:
            raise ValueError("kinds and window_tokens need one entry per group")
        kinds = tuple(group_kinds.plan_kind(k) for k in self.kinds)  # unknown: raises
        object.__setattr__(self, "plan_kinds", kinds)
        if not any(p.chunked for p in kinds):
            raise ValueError("a layout needs at least one attention (chunked: full, window, "
                             "local, ...) group")
        if not all(p.chunked for p in kinds) and self.state_unit < 1:
            raise ValueError("a layout with a state group needs a positive state_unit")
        for g, p in enumerate(kinds):
            if p.spanned != (self.window_tokens[g] > 0):
                raise ValueError(f"group {g}: only window and local groups have (and need) "
                                 f"a token span")

    @property
    def num_groups(self) -> int:
        return len(self.block_sizes)

    def chunked(self, group: int) -> bool:
        """Whether the group is stored as chunks of blocks (attention), not as states."""
        return self.plan_kinds[group].chunked

    @property
    def chunked_groups(self) -> tuple[int, ...]:
        return tuple(g for g in range(self.num_groups) if self.chunked(g))

    @property
    def state_groups(self) -> tuple[int, ...]:
        return tuple(g for g in range(self.num_groups) if not self.chunked(g))

    @property
    def all_full(self) -> bool:
        """Every group resumes anywhere (full attention): any verified prefix is a valid
        resume point."""
        return all(p.resume_anywhere for p in self.plan_kinds)

    def chunk_tokens(self, group: int) -> int:
        return self.block_sizes[group] * self.chunk_blocks

    @property
    def alignment(self) -> int:
        """Where every group can be restored together: external claims, and the states
        worth storing, are multiples of it."""
        units = [self.chunk_tokens(g) for g in self.chunked_groups]
        if self.state_groups:
            units.append(self.state_unit)
        return math.lcm(*units)

    @property
    def block_alignment(self) -> int:
        """Where every attention group's blocks end together: a device prefix and a
        verified prefix are cut to it."""
        return math.lcm(*(self.block_sizes[g] for g in self.chunked_groups))

    def skipped_blocks(self, group: int, num_tokens: int) -> int:
        """Leading blocks of a window or local group the core leaves null at
        ``num_tokens`` computed tokens (the core's ``get_num_skipped_tokens //
        block_size``); 0 for the others."""
        return self.plan_kinds[group].skipped_blocks(num_tokens, self.window_tokens[group],
                                                self.block_sizes[group])

    @property
    def has_null_blocks(self) -> bool:
        """A window or local group: blocks before a resume point may be null."""
        return any(p.spanned for p in self.plan_kinds)


@dataclass(frozen=True, slots=True)
class ChunkLoad:
    """Fetch chunk ``chunk`` of ``group``; copy its blocks from ``skip`` on into table
    positions ``first_block .. first_block + num_blocks``."""

    group: int
    chunk: int
    skip: int
    first_block: int
    num_blocks: int


@dataclass(frozen=True, slots=True)
class StateLoad:
    """Fetch ``group``'s state at ``boundary`` into table position ``slot``."""

    group: int
    boundary: int
    slot: int


@dataclass(frozen=True, slots=True)
class StoreSelection:
    """Positions of the candidates to store now, and how many were dropped and why."""

    take: tuple[int, ...]
    duplicates: int  # already being stored by another job
    shed: int  # over the in-flight byte budget


@dataclass(frozen=True, slots=True)
class LocalHit:
    """The device's prefix hit: ``reconciled`` tokens every group agrees on, and ``deep``
    tokens the attention groups hold (more only when a Mamba state lags behind them)."""

    reconciled: int
    deep: int

    def __post_init__(self) -> None:
        if not 0 <= self.reconciled <= self.deep:
            raise ValueError(f"need 0 <= reconciled <= deep, got {self!r}")


@dataclass(frozen=True, slots=True)
class TierHit:
    """What the tiers hold: attention group g has chunks ``first[g] .. first[g] +
    present[g]`` (state groups: unused), and a state is stored at each of ``states``."""

    first: tuple[int, ...]
    present: tuple[int, ...]
    states: frozenset[int] = field(default_factory=frozenset)


@dataclass(frozen=True, slots=True)
class Claim:
    """How to admit a request: adopt ``local`` device tokens (the per-group ``deep`` hits
    or the reconciled ones), load ``external`` more from the tiers, and the state at
    ``state_at`` (== ``local + external``) when the layout has state groups."""

    local: int
    external: int = 0
    state_at: int | None = None
    deep: bool = False
    # Per group, the end of the chunks the lookup found stored (the tiers' run from the
    # lookup window's start; 0 for a state group): chunks below it need no store, whatever
    # was claimed. A fact of the lookup
    # the claim came from, not part of the decision (equal claims may differ here).
    stored_until: tuple[int, ...] = field(default=(), compare=False)

    @property
    def loads(self) -> bool:
        return self.external > 0 or self.state_at is not None


# --------------------------------------------------------------------------- lookups


def device_base(layout: Layout, hit: LocalHit) -> int:
    """Where tier chunks must take over from the device: the attention groups' hit cut to
    their whole blocks (a sub-block Mamba tail is dropped when a claim goes past it)."""
    return hit.deep - hit.deep % layout.block_alignment


def lookup_window(layout: Layout, num_tokens: int, local_tokens: int,
                  num_hash_tokens: int) -> tuple[range, ...]:
    """Per group, the chunks worth asking the tiers about (empty for state groups).

    From the chunk holding the end of the local hit (anything before it is on the device,
    whether or not the tiers still have it) up to the last chunk a claim could use: claims
    stop at ``num_tokens - 1`` (one token must be computed to sample) and at the hashes the
    request has.
    """
    cap = _claim_cap(layout, num_tokens, num_hash_tokens)
    out = []
    for g in range(layout.num_groups):
        if not layout.chunked(g):
            out.append(range(0, 0))
            continue
        ct = layout.chunk_tokens(g)
        first = local_tokens // ct
        out.append(range(first, max(first, cap // ct)))
    return tuple(out)


def _claim_cap(layout: Layout, num_tokens: int, num_hash_tokens: int) -> int:
    cap = max(0, min(num_tokens - 1, num_hash_tokens))
    return cap - cap % layout.alignment


def external_span(layout: Layout, first: Sequence[int], present: Sequence[int]) -> tuple[int, int]:
    """Tokens ``[start, end)`` every attention group has in the tiers: group g has its
    chunks ``first[g] .. first[g] + present[g]``. ``end <= start`` means nothing usable."""
    groups = layout.chunked_groups
    start = max(first[g] * layout.chunk_tokens(g) for g in groups)
    end = min((first[g] + present[g]) * layout.chunk_tokens(g) for g in groups)
    return start, end


def claim_external(layout: Layout, num_tokens: int, local_tokens: int,
                   span: tuple[int, int]) -> int:
    """How many tokens beyond the local hit to load: the tiers' span must reach back to the
    local hit (it may have shrunk since the lookup), the claim ends on a chunk boundary of
    every group, and at least one token is left to compute (vLLM's rule for prefills)."""
    start, end = span
    if local_tokens < start or num_tokens < 1:
        return 0
    end = min(end, num_tokens - 1)
    end -= end % layout.alignment
    return max(0, end - local_tokens)


def _chunks_reach(layout: Layout, hit: LocalHit, tier: TierHit) -> int:
    """How far the attention groups can be restored: the device prefix, extended by the
    tiers' chunks when they start no later than it."""
    base = device_base(layout, hit)
    start, end = external_span(layout, tier.first, tier.present)
    return max(hit.deep, end) if start <= base else hit.deep


def state_candidates(layout: Layout, num_tokens: int, num_hash_tokens: int, hit: LocalHit,
                     tier: TierHit) -> list[int]:
    """Boundaries worth asking the tiers for a state at, best (deepest) first: beyond the
    reconciled hit, no deeper than the attention groups reach, on the claim alignment."""
    if not layout.state_groups:
        return []
    top = min(_claim_cap(layout, num_tokens, num_hash_tokens), _chunks_reach(layout, hit, tier))
    a = layout.alignment
    top -= top % a
    return list(range(top, hit.reconciled, -a))


def reconcile(layout: Layout, num_tokens: int, num_hash_tokens: int, hit: LocalHit,
              tier: TierHit) -> Claim:
    """The deepest N every group can be restored at, and where each part comes from.

    * Attention groups: from the device up to ``hit.deep``, then from the tiers' chunks
      (which must start at or before the device prefix).
    * State groups: the device only holds a state at the reconciled hit, so any deeper N
      needs a stored state at exactly N.
    * N > deep: adopt the device prefix (cut to whole blocks), load ``[base, N)``.
    * reconciled < N <= deep (a diverged hit): keep the deeper attention hit, load only the
      lagging state at N — the case vLLM's offload connectors give up on.
    * No such N: the reconciled hit alone (a local sub-block tail stays).
    """
    claim = _reconcile(layout, num_tokens, num_hash_tokens, hit, tier)
    # Below a window's start the device holds the chunks: whoever computed them offered them.
    stored = tuple(f + p if layout.chunked(g) else 0
                   for g, (f, p) in enumerate(zip(tier.first, tier.present, strict=True)))
    return dataclasses.replace(claim, stored_until=stored)


def _reconcile(layout: Layout, num_tokens: int, num_hash_tokens: int, hit: LocalHit,
               tier: TierHit) -> Claim:
    reach = _chunks_reach(layout, hit, tier)
    cap = _claim_cap(layout, num_tokens, num_hash_tokens)
    best = 0
    for n in state_candidates(layout, num_tokens, num_hash_tokens, hit, tier):
        if n in tier.states:
            best = n
            break
    if not layout.state_groups:
        top = min(cap, reach)
        best = top - top % layout.alignment
    if best <= hit.reconciled:
        return Claim(hit.reconciled)
    state_at = best if layout.state_groups else None
    diverged = hit.deep > hit.reconciled
    if best > hit.deep:
        base = device_base(layout, hit)
        return Claim(base, best - base, state_at, diverged)
    return Claim(best, 0, state_at, True)


def tokens_by_level(layout: Layout, first: Sequence[int], levels: Sequence[Sequence[int]],
                    start: int, end: int, state_level: int | None = None) -> dict[int, int]:
    """Tokens of ``[start, end)`` per tier level (0 = fastest). Attention group g's chunk
    ``first[g] + i`` sits at ``levels[g][i]``; where groups disagree a token counts at the
    slowest level, the one its load waits for (vLLM reports the outermost tier too), and
    a loaded state holds back every token."""
    out: dict[int, int] = {}
    groups = layout.chunked_groups
    cuts = {start, end}
    for g in groups:
        f, ct = first[g], layout.chunk_tokens(g)
        cuts.update(c for i in range(len(levels[g]) + 1) if start < (c := (f + i) * ct) < end)
    for lo, hi in itertools.pairwise(sorted(cuts)):
        level = state_level or 0
        for g in groups:
            i = lo // layout.chunk_tokens(g) - first[g]
            level = max(level, levels[g][i])
        out[level] = out.get(level, 0) + hi - lo
    return out


def claim_units(layout: Layout, tiers: Sequence[str], first: Sequence[int],
                levels: Sequence[Sequence[int]], start: int, end: int
                ) -> list[tuple[str, int, int]]:
    """``[start, end)`` in units a claim may end on (``layout.alignment`` tokens): each
    one's tier (the slowest any attention group reads it from), first token and length."""
    out = []
    unit = layout.alignment
    for lo in range(start, end, unit):
        level = 0
        for g in layout.chunked_groups:
            level = max(level, levels[g][lo // layout.chunk_tokens(g) - first[g]])
        out.append((tiers[level], lo, min(unit, end - lo)))
    return out


def tokens_by_tier(layout: Layout, tiers: Sequence[str], first: Sequence[int],
                   levels: Sequence[Sequence[int]], start: int, end: int,
                   state_level: int | None = None) -> dict[str, int]:
    """:func:`tokens_by_level` by tier name (``tiers[level]``; two levels may share one)."""
    out: dict[str, int] = {}
    if end <= start:
        return out
    for level, n in tokens_by_level(layout, first, levels, start, end, state_level).items():
        out[tiers[level]] = out.get(tiers[level], 0) + n
    return out


# --------------------------------------------------------------------------- loads


def load_plan(layout: Layout, start: int, end: int) -> tuple[ChunkLoad, ...]:
    """The chunks to fetch for tokens ``[start, end)`` (``start`` on every attention
    group's block boundary, ``end`` on every chunk boundary), grouped by group, in chunk
    order. A chunk reaching below the first block needed is fetched whole and only its
    blocks from there copied. A window group needs only the blocks of the window before
    ``end``: the core left the earlier positions null."""
    out = []
    cb = layout.chunk_blocks
    for g in layout.chunked_groups:
        bs = layout.block_sizes[g]
        if start % bs or end % (bs * cb):
            raise ValueError(f"[{start}, {end}) is not aligned to group {g}'s blocks/chunks")
        first_block = max(start // bs, layout.skipped_blocks(g, end))
        for c in range(first_block // cb, end // (bs * cb)):
            skip = max(0, first_block - c * cb)
            out.append(ChunkLoad(g, c, skip, c * cb + skip, cb - skip))
    return tuple(out)


def state_plan(layout: Layout, boundary: int | None) -> tuple[StateLoad, ...]:
    """The states to fetch for a claim ending at ``boundary``: each state group's, into the
    slot the core gives the state at ``boundary`` (slot i holds the state after up to
    ``(i + 1) * block_size`` tokens)."""
    if boundary is None:
        return ()
    if boundary <= 0:
        raise ValueError(f"a state boundary must be positive, got {boundary}")
    return tuple(StateLoad(g, boundary, -(boundary // -layout.block_sizes[g]) - 1)
                 for g in layout.state_groups)


def verified_end(layout: Layout, plan: Sequence[ChunkLoad], ok: Sequence[bool],
                 start: int, end: int) -> int:
    """The longest prefix every group has verified bytes for: a group is good up to its
    first bad chunk; the result is cut to a block boundary of every group."""
    if len(plan) != len(ok):
        raise ValueError(f"{len(ok)} results for {len(plan)} planned chunks")
    good = end
    for load, fine in zip(plan, ok, strict=True):
        if not fine:
            good = min(good, max(start, load.chunk * layout.chunk_tokens(load.group)))
    return good - (good - start) % layout.block_alignment if good > start else start


def resume_point(layout: Layout, plan: Sequence[ChunkLoad], ok: Sequence[bool],
                 states_ok: Sequence[bool], start: int, end: int) -> int:
    """Where a request resumes after its load: ``end`` when everything verified. Otherwise
    a full-attention layout keeps its verified prefix; any other layout starts over (0):
    the core sized the window and the state slot for ``end``, so no shorter point has its
    window blocks or its state in the table."""
    if all(ok) and all(states_ok) and len(ok) == len(plan):
        return end
    if layout.all_full:
        return verified_end(layout, plan, ok, start, end)
    return 0


# --------------------------------------------------------------------------- scheduling


def mamba_split(start: int, num_new_tokens: int, *, num_prompt_tokens: int, num_tokens: int,
                block_size: int, checkpoint_unit: int | None) -> int:
    """The tokens a Mamba-"align" step may compute from ``start`` (vLLM's
    ``_mamba_block_aligned_split``, without internal checkpoints or junctions).

    A state is written only at a chunk's end, and slot p must hold the state after exactly
    ``(p + 1) * block_size`` tokens, so a prefill chunk ends on a block boundary (the
    prompt's last chunk aside) and, with sub-block hits (``checkpoint_unit``), stops at the
    prompt's last reusable boundary so its partial tail is produced.
    """
    prefill_end = max(num_prompt_tokens, num_tokens - 1)
    if start >= prefill_end or num_new_tokens <= 0:
        return num_new_tokens
    end = start + num_new_tokens
    last_cache = prefill_checkpoint_position(num_tokens, block_size, False)
    tail = (prefill_checkpoint_position(num_prompt_tokens, checkpoint_unit, False)
            if checkpoint_unit else 0)
    if end < prefill_end:
        aligned = end // block_size * block_size
        if aligned > start or block_size <= num_new_tokens:
            end = aligned
    stops = (
        (start // block_size + 1) * block_size if start % block_size else 0,
        last_cache,
        tail if last_cache < tail < num_prompt_tokens else 0,
    )
    end = min((s for s in stops if start < s < end), default=end)
    return max(end - start, 0)


# --------------------------------------------------------------------------- stores


def store_window(layout: Layout, group: int, next_chunk: int, committed_tokens: int,
                 num_hash_tokens: int) -> range:
    """Chunks of ``group`` whose every block is computed (its KV written) and hashed, from
    the first one not yet offered (``next_chunk``)."""
    ct = layout.chunk_tokens(group)
    return range(next_chunk, max(next_chunk, min(committed_tokens, num_hash_tokens) // ct))


@dataclass(frozen=True, slots=True)
class ChunkOffer:
    """A chunk ready to store: chunk ``chunk`` of ``group``, in the request's blocks
    ``block_ids`` (``layout.chunk_blocks`` of them, none null)."""

    group: int
    chunk: int
    block_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ChunkOffers:
    """What a step offers for storage: the chunks, each group's cursor after them (every
    chunk in a window is offered once: stored, deduplicated or shed), and the first token
    no state can be restored past (``hole``; unchanged when every chunk could be read)."""

    chunks: tuple[ChunkOffer, ...]
    next_chunk: tuple[int, ...]
    hole: int


def chunk_offers(layout: Layout, next_chunk: Sequence[int], committed_tokens: int,
                 num_hash_tokens: int, block_table: Sequence[Sequence[int]],
                 hole: int) -> ChunkOffers:
    """The chunks of every chunked group that became storable (:func:`store_window`),
    read from ``block_table`` (the request's block ids per group). A chunk whose blocks a
    window group already released (a null block, or a table shorter than the chunk: an
    engine may hand over only the blocks it still holds) cannot be stored, and no state
    past it can be restored: ``hole`` moves back to its first token."""
    cb = layout.chunk_blocks
    cursors = list(next_chunk)
    out: list[ChunkOffer] = []
    for g in layout.chunked_groups:
        window = store_window(layout, g, cursors[g], committed_tokens, num_hash_tokens)
        for c in window:
            ids = tuple(block_table[g][c * cb:(c + 1) * cb])
            if len(ids) < cb or 0 in ids:
                hole = min(hole, c * layout.chunk_tokens(g))
            else:
                out.append(ChunkOffer(g, c, ids))
        cursors[g] = window.stop
    return ChunkOffers(tuple(out), tuple(cursors), hole)


def select_stores(candidates: Sequence[tuple[str, int]], in_flight: Set[str],
                  bytes_in_flight: int, budget: int) -> StoreSelection:
    """Which ``(key id, bytes)`` candidates to store: not one already being stored (by
    another request with the same prefix), and only while the in-flight bytes stay within
    ``budget``. Over budget a store is shed, never queued: offload is best effort and a
    backlog of stores would only delay loads and pin memory."""
    take: list[int] = []
    seen: set[str] = set()
    duplicates = shed = 0
    used = bytes_in_flight
    for i, (key_id, nbytes) in enumerate(candidates):
        if key_id in in_flight or key_id in seen:
            duplicates += 1
        elif used + nbytes > budget:
            shed += 1
        else:
            take.append(i)
            seen.add(key_id)
            used += nbytes
    return StoreSelection(tuple(take), duplicates, shed)


@dataclass(frozen=True, slots=True)
class StateOffer:
    """The core's hand-off: ``group``'s state at ``boundary`` tokens is in ``block_id``."""

    group: int
    block_id: int
    boundary: int


def select_states(layout: Layout, offers: Iterable[StateOffer], *, alive: bool,
                  known_until: int, save_end: int, hole: int) -> tuple[list[StateOffer], int]:
    """The state offers worth storing, and how many were dropped.

    Dropped: every offer of a request that is gone or lost its blocks (finished, preempted,
    loading — its blocks may be reused: reading them would publish unrelated bytes under a
    valid key); null blocks; states at or below ``known_until`` (the hit it was admitted
    with: they came from the device or a tier); past ``save_end`` (prompt-only offload);
    off the claim alignment (no hit could ever use them); and past ``hole``, the first
    token of an attention chunk this request could not store — a state without its
    attention chunks is a checkpoint that can never be completely restored.
    """
    kept: list[StateOffer] = []
    dropped = 0
    for o in offers:
        if (alive and o.block_id != 0 and known_until < o.boundary <= min(save_end, hole)
                and o.boundary % layout.alignment == 0):
            kept.append(o)
        else:
            dropped += 1
    return kept, dropped
