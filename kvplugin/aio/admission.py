"""Admission: how the async manager turns a lookup into the core's allocation.

A request that holds no blocks is admitted: the device hit is taken afresh (per group when a
Mamba state may lag the attention hit), what the lookup found in the tiers is reconciled into
a claim every group can be restored at (:func:`kvplugin.aio.plans.reconcile`), cut by load
cost where loading stops paying, checked against the tenant's in-use quota (through the
core's ``reserved_blocks``), allocated, and its load started; the offload ledger is told
where the request computes from and books the hits. A request that holds blocks grows.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvplugin.aio import plans
from kvplugin.aio.loadcost import Choice, LoadCosts
from kvplugin.aio.loads import Loads
from kvplugin.aio.memory import HostKVMemory
from kvplugin.aio.offload_ledger import OffloadLedger
from kvplugin.aio.plans import Claim, LocalHit, TierHit
from kvplugin.aio.reqstate import ReqState
from kvplugin.aio.tenants import Tenants
from kvplugin.aio.values import Admission, Lookup, OffloadStats
from kvplugin.core.manager import KVCacheBlocks, KVCacheManager
from kvplugin.core.request import Request

__all__ = ["Admissions", "DeviceHit", "Step"]


@dataclass(frozen=True, slots=True)
class Step:
    """What the engine grants one allocation (see ``AsyncKVManager.allocate``)."""

    max_tokens: int | None
    lookahead: int
    reserved: int
    has_scheduled: bool

    def tokens(self, remaining: int) -> int:
        if remaining < 1:
            raise ValueError("the request has no token left to compute")
        return remaining if self.max_tokens is None else min(self.max_tokens, remaining)


@dataclass(frozen=True, slots=True)
class DeviceHit:
    """The device's hit: the reconciled blocks, the per-group (diverged) ones, the token
    counts, and the reconciled lookup's shared-prefix boundary."""

    blocks: KVCacheBlocks
    deep_blocks: KVCacheBlocks
    hit: LocalHit
    boundary: int


class Admissions:
    """Admits and grows one manager's requests (see the module docstring)."""

    def __init__(self, core: KVCacheManager, layout: plans.Layout, memory: HostKVMemory, *,
                 tiers: tuple[str, ...], ledger: OffloadLedger, tenants: Tenants,
                 loads: Loads | None, costs: LoadCosts | None, stats: OffloadStats,
                 divergent: bool) -> None:
        self._core = core
        self._layout = layout
        self._memory = memory
        self._tiers = tiers
        self._ledger = ledger
        self._tenants = tenants
        self._loads = loads
        self._costs = costs
        self._stats = stats
        self._offload = loads is not None  # a connector backs the device cache
        # Per-group hits (a lagging Mamba state) are only reconciled for Mamba + full
        # attention layouts, as the core's get_computed_blocks_for_connector.
        self._divergent = divergent
        self._hash_block_size = ledger.keyspace.hash_block_size

    def _hash_tokens(self, req: Request) -> int:
        return len(req.block_hashes) * self._hash_block_size

    def local_hit(self, req: Request) -> DeviceHit:
        """The device hit, per group when a Mamba state may lag the attention hit (the
        reconciled one is then looked up too, as vLLM's scheduler does)."""
        core = self._core
        if self._divergent:
            deep_blocks, deep, boundary, diverged = core.get_computed_blocks_for_connector(req)
            if diverged:
                blocks, hit, boundary = core.get_computed_blocks(req)
                return DeviceHit(blocks, deep_blocks, LocalHit(hit, deep), boundary)
            return DeviceHit(deep_blocks, deep_blocks, LocalHit(deep, deep), boundary)
        blocks, hit, boundary = core.get_computed_blocks(req)
        return DeviceHit(blocks, blocks, LocalHit(hit, hit), boundary)

    def _cost_cut(self, costs: LoadCosts, claim: Claim,
                  lookup: Lookup) -> tuple[Claim, Choice]:
        """The claim cut where loading stops paying (kvplugin.aio.loadcost); the rest is
        computed. Layouts with states keep their claims (a state ends where it ends)."""
        units = plans.claim_units(self._layout, self._tiers, lookup.first, lookup.levels,
                                  claim.local, claim.local + claim.external)
        choice = costs.plan(units)
        if choice.slow is None:
            return claim, choice
        external = sum(n for _, _, n in units[:choice.keep])
        return dataclasses.replace(claim, external=external), choice

    def _cost_settled(self, st: ReqState, lookup: Lookup, claim: Claim, uncut: int,
                      choice: Choice) -> None:
        """The admitted claim's choice: counted once, however often admission was tried;
        a probe reads one of the skipped objects aside."""
        costs, loads = self._costs, self._loads
        if costs is None or loads is None:
            raise RuntimeError("admission: a load-cost choice was made without load costs "
                               "or a connector")
        costs.settle(choice)
        if choice.probe is not None:  # among the tokens cut: [kept end, claimed end)
            loads.probe(st, lookup, claim.local + claim.external, claim.local + uncut,
                              choice.probe)
        if choice.slow is not None:
            s = self._stats
            s.loads_skipped_slower_than_recompute[choice.slow] = (
                s.loads_skipped_slower_than_recompute.get(choice.slow, 0) + 1)
            s.skipped_load_tokens += uncut - claim.external

    def split(self, req: Request, start: int, n: int) -> int:
        if not self._layout.state_groups:
            return n
        partial = self._core.offload_view().partial_hash_hits
        return plans.mamba_split(
            start, n, num_prompt_tokens=req.num_prompt_tokens, num_tokens=req.num_tokens,
            block_size=self._layout.block_sizes[self._layout.state_groups[0]],
            checkpoint_unit=self._hash_block_size if partial else None)

    def run_copies(self) -> None:
        """The device's copy-on-write of shared partial (Mamba) tails, before the step that
        writes either block; then the core may let the retained endpoints go."""
        copies, retained = self._core.take_kv_cache_block_copies()
        for c in copies:
            self._memory.copy_block(c.src_block_id, c.dst_block_id)
        if retained:
            self._core.free_retained_blocks(retained)

    def admit(self, st: ReqState, lookup: Lookup | None, step: Step) -> Admission | None:
        req = st.req
        if req.num_computed_tokens:
            raise ValueError(f"request {req.request_id!r} holds no blocks but claims "
                             f"{req.num_computed_tokens} computed tokens")
        local = self.local_hit(req)
        claim = Claim(local.hit.reconciled)
        if lookup is not None and not st.skip_external and self._offload:
            tier = TierHit(lookup.first, lookup.present, frozenset(b for b, _ in lookup.states))
            claim = plans.reconcile(self._layout, req.num_tokens, self._hash_tokens(req),
                                    local.hit, tier)
        choice, uncut = None, claim.external
        if self._costs is not None and claim.external and claim.state_at is None:
            claim, choice = self._cost_cut(self._costs, claim,
                                           _looked_up(lookup, "a cost cut of tier tokens"))
        loads = claim.loads
        n = 0 if loads else self.split(req, claim.local,
                                        step.tokens(req.num_tokens - claim.local))
        req.shared_prefix_boundary = 0 if claim.deep else local.boundary
        hits = self._claim_blocks(local, claim)
        reserved = self._tenants.admission_reserve(st, hits, step.reserved, step.has_scheduled)
        blocks = self._core.allocate_slots(
            req, n, claim.local, hits,
            num_lookahead_tokens=0 if loads else step.lookahead,
            num_external_computed_tokens=claim.external, delay_cache_blocks=loads,
            reserved_blocks=reserved, has_scheduled_reqs=step.has_scheduled)
        if blocks is None:
            self._tenants.refused(st, reserved, step.reserved)
            return None
        self.run_copies()
        if choice is not None:
            self._cost_settled(st, _looked_up(lookup, "a load-cost choice"), claim, uncut,
                               choice)
        st.admitted = True
        st.outcome = None
        total = claim.local + claim.external
        req.num_computed_tokens = total  # optimistic during a load, as in vLLM
        self._core.record_prefix_cache_stats(req, claim.local)
        self._ledger.admit(st.offload, total, claim.stored_until)
        by_tier = self._count_hits(st, claim, lookup)
        if loads:
            # A claim of tier tokens comes from a lookup of a manager with a connector.
            if self._loads is None:
                raise RuntimeError("admission: a claim of tier tokens on a manager without "
                                   "a connector")
            self._loads.start(st, claim, _looked_up(lookup, "a claim of tier tokens"))
            self._tenants.load_started(st)
        return Admission(blocks, n, claim.local, claim.external, loads, by_tier, claim.state_at)

    def _claim_blocks(self, local: DeviceHit, claim: Claim) -> KVCacheBlocks:
        """The device blocks a claim adopts: attention groups cut to ``claim.local``, and
        no state when the state comes from a tier (the core then gives the state slot a
        fresh block)."""
        if not claim.deep and claim.state_at is None and claim.local == local.hit.reconciled:
            return local.blocks
        src = local.deep_blocks if claim.deep else local.blocks
        out = []
        for g, lst in enumerate(src.blocks):
            if not self._layout.chunked(g):
                out.append([] if claim.state_at is not None else list(lst))
            else:
                out.append(list(lst[:claim.local // self._layout.block_sizes[g]]))
        return self._core.create_kv_cache_blocks(tuple(out))

    def _count_hits(self, st: ReqState, claim: Claim, lookup: Lookup | None
                    ) -> dict[str, int]:
        """Book the admission's hits (per query: the hit rate's) and open the request's
        ledger pass (prompt positions only: see :mod:`kvplugin.aio.ledger`)."""
        req = st.req
        end, prompt = claim.local + claim.external, req.num_prompt_tokens
        if not claim.external or lookup is None:
            self._ledger.book_query(st.tenant, queried_tokens=req.num_tokens,
                                    local=claim.local, external=0, by_tier={})
            st.ledger.admitted(min(claim.local, prompt), {}, end, claim.loads)
            return {}
        state_level = next((lv for b, lv in lookup.states if b == claim.state_at), None)
        out = plans.tokens_by_tier(self._layout, self._tiers, lookup.first, lookup.levels,
                                   claim.local, end, state_level)
        self._ledger.book_query(st.tenant, queried_tokens=req.num_tokens, local=claim.local,
                                  external=claim.external, by_tier=out)
        booked = out if end <= prompt else plans.tokens_by_tier(
            self._layout, self._tiers, lookup.first, lookup.levels, claim.local, prompt,
            state_level)
        st.ledger.admitted(min(claim.local, prompt), booked, end, claim.loads)
        return out

    def grow(self, st: ReqState, step: Step) -> Admission | None:
        """Slots for the next step of a request that holds blocks."""
        req = st.req
        start = req.num_computed_tokens
        n = self.split(req, start, step.tokens(req.num_tokens - start))
        blocks = self._core.allocate_slots(
            req, n, num_lookahead_tokens=step.lookahead, reserved_blocks=step.reserved,
            has_scheduled_reqs=step.has_scheduled)
        if blocks is None:
            return None
        self.run_copies()
        return Admission(blocks, n)


def _looked_up(lookup: Lookup | None, what: str) -> Lookup:
    """The lookup ``what`` comes from: tier tokens are only ever claimed from one."""
    if lookup is None:
        raise RuntimeError(f"admission: {what} without a lookup")
    return lookup
