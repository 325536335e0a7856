"""The token ledger: where every prompt token of every finished request came from.

A request may be admitted several times (a preemption, a load that kept nothing) and each
admission may hit, load and compute; counting per admission (the hit rate's view) books a
token as often as it was served. The ledger books each prompt position **once**, by the pass
that completed the request (the last admission):

* ``device``: in the device hit of that admission;
* a tier's name: claimed from that tier and verified by its load;
* ``computed``: computed by that pass, for the first time in the request's life;
* ``recomputed``: computed by that pass, but computed before by a pass a preemption
  ended (``recomputed_after["preemption"]``), or claimed from a tier whose load failed
  verification (``recomputed_after["failed_load"]``, which wins where both apply);
* ``unprocessed``: not reached (the request ended before its prefill did: a failed load
  under the fail policy, a request finished while its KV loaded, an abort).

These add up to the request's prompt tokens, overall and per tenant. Work the ledger does
not book as a source, since no prompt token comes from it: ``discarded_tokens``, the prompt
tokens computed by passes a preemption ended (their blocks may still serve the next pass as
device hits, which is what ``recomputed`` is not).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

__all__ = ["COMPUTED", "DEVICE", "RECOMPUTED", "UNPROCESSED", "LedgerTotals",
           "RequestLedger", "TokenLedger"]

DEVICE = "device"
COMPUTED = "computed"
RECOMPUTED = "recomputed"
UNPROCESSED = "unprocessed"
PREEMPTION = "preemption"
FAILED_LOAD = "failed_load"


@dataclass(slots=True)
class RequestLedger:
    """One request's passes: what its current admission hit and loaded, how far it got,
    and the ranges earlier passes computed or failed to load."""

    device: int = 0
    tiers: dict[str, int] = field(default_factory=dict)
    base: int = 0  # where this pass's computing starts: the hit, then the verified load
    progress: int = 0  # the pass's num_computed_tokens (its optimistic hit included)
    loading: bool = False  # the claim is not verified yet
    preempted: list[tuple[int, int]] = field(default_factory=list)
    failed: list[tuple[int, int]] = field(default_factory=list)
    discarded: int = 0

    def admitted(self, device: int, tiers: Mapping[str, int], end: int,
                 loading: bool) -> None:
        """A new pass: the hit ends at position ``end``; of its prompt positions ``device``
        came from the device and ``tiers`` are claimed per tier (verified at once when
        nothing loads: a diverged Mamba hit loads only a state)."""
        self.device = device
        self.tiers = {t: n for t, n in tiers.items() if n}
        self.base = self.progress = end
        self.loading = loading

    def load_ended(self, verified: Mapping[str, int], start: int, end: int,
                   good: int) -> None:
        """The claim of ``[start, end)`` verified up to ``good`` (``verified``: its prompt
        positions per tier); what failed will be computed. ``good`` 0: the load kept
        nothing, the device hit went back too (the next admission opens a new pass)."""
        self.tiers = {t: n for t, n in verified.items() if n}
        self.loading = False
        if good < end:
            self.failed.append((max(good, start), end))
        if not good:
            self.device = 0
        self.base = self.progress = good

    def advanced(self, num_computed_tokens: int) -> None:
        self.progress = max(self.progress, num_computed_tokens)

    def preempt(self, num_computed_tokens: int, num_prompt_tokens: int) -> None:
        """The pass ends without finishing; the next admission starts a new one."""
        self.advanced(num_computed_tokens)
        hi = min(self.progress, num_prompt_tokens)
        if hi > self.base:
            self.preempted.append((self.base, hi))
            self.discarded += hi - self.base
        self.admitted(0, {}, 0, False)

    def restart(self) -> None:
        """The load kept nothing (its blocks went back): the next admission starts over."""
        self.admitted(0, {}, 0, False)

    def attribution(self, num_computed_tokens: int, num_prompt_tokens: int) -> dict[str, int]:
        """The final pass's books, summing to ``num_prompt_tokens``."""
        out = {DEVICE: self.device, COMPUTED: 0, RECOMPUTED: 0, UNPROCESSED: 0,
               PREEMPTION: 0, FAILED_LOAD: 0}
        if self.loading:  # finished while its KV loaded: only the device hit was served
            self.tiers, self.base, self.progress = {}, self.device, self.device
        else:
            self.advanced(num_computed_tokens)
        out.update(self.tiers)
        # The books hold prompt positions only: a preempted request's hit may reach into
        # its output tokens.
        lo = min(self.base, num_prompt_tokens)
        hi = min(max(self.progress, self.base), num_prompt_tokens)
        failed = _overlap(self.failed, lo, hi)
        again = _overlap(self.failed + self.preempted, lo, hi)
        out[RECOMPUTED] = again
        out[FAILED_LOAD] = failed
        out[PREEMPTION] = again - failed
        out[COMPUTED] = hi - lo - again
        out[UNPROCESSED] = num_prompt_tokens - hi
        if self.device + sum(self.tiers.values()) != lo:
            raise AssertionError(f"ledger: hits {self.device} + {self.tiers} do not end at "
                                 f"{lo}")
        return out


def _overlap(ranges: Sequence[tuple[int, int]], lo: int, hi: int) -> int:
    """Tokens of ``[lo, hi)`` inside the union of ``ranges``."""
    n, cursor = 0, lo
    for a, b in sorted(ranges):
        a, b = max(a, cursor), min(b, hi)
        if b > a:
            n += b - a
            cursor = b
    return n


@dataclass(frozen=True, slots=True)
class LedgerTotals:
    """The books of finished requests: ``sources`` (``device``, each tier, ``computed``,
    ``recomputed``, ``unprocessed``) sum to ``prompt_tokens``; ``recomputed_after`` splits
    ``recomputed`` by cause; ``discarded_tokens`` is work preemption threw away."""

    requests: int
    prompt_tokens: int
    sources: Mapping[str, int]
    recomputed_after: Mapping[str, int]
    discarded_tokens: int

    @property
    def hit_tokens(self) -> int:
        """Device and tier hits."""
        return sum(n for s, n in self.sources.items()
                   if s not in (COMPUTED, RECOMPUTED, UNPROCESSED))

    @property
    def computed_tokens(self) -> int:
        """Computed by the final passes, recomputation included."""
        return self.sources[COMPUTED] + self.sources[RECOMPUTED]

    def share(self, tokens: int) -> float:
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, object]:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "sources": dict(self.sources), "recomputed_after": dict(self.recomputed_after),
                "discarded_tokens": self.discarded_tokens}


@dataclass(slots=True)
class _Books:
    requests: int = 0
    prompt_tokens: int = 0
    sources: dict[str, int] = field(default_factory=dict)
    discarded: int = 0

    def add(self, books: Mapping[str, int], prompt: int, discarded: int) -> None:
        self.requests += 1
        self.prompt_tokens += prompt
        self.discarded += discarded
        for s, n in books.items():
            self.sources[s] = self.sources.get(s, 0) + n

    def freeze(self, tiers: Sequence[str]) -> LedgerTotals:
        src = self.sources
        sources = {DEVICE: src.get(DEVICE, 0), **{t: src.get(t, 0) for t in tiers},
                   COMPUTED: src.get(COMPUTED, 0), RECOMPUTED: src.get(RECOMPUTED, 0),
                   UNPROCESSED: src.get(UNPROCESSED, 0)}
        after = {PREEMPTION: src.get(PREEMPTION, 0), FAILED_LOAD: src.get(FAILED_LOAD, 0)}
        return LedgerTotals(self.requests, self.prompt_tokens, MappingProxyType(sources),
                            MappingProxyType(after), self.discarded)


class TokenLedger:
    """The books of one manager's finished requests, in total and per tenant."""

    __slots__ = ("_tenants", "_tiers", "_total")

    def __init__(self, tiers: Sequence[str]) -> None:
        self._tiers = tuple(tiers)
        self._total = _Books()
        self._tenants: dict[str, _Books] = {}

    def close(self, tenant: str, entry: RequestLedger, num_computed_tokens: int,
              num_prompt_tokens: int) -> dict[str, int]:
        """Book a finished request; returns its attribution."""
        books = entry.attribution(num_computed_tokens, num_prompt_tokens)
        unknown = set(books) - {DEVICE, COMPUTED, RECOMPUTED, UNPROCESSED, PREEMPTION,
                                FAILED_LOAD, *self._tiers}
        if unknown:
            raise ValueError(f"tokens booked at unknown tiers {sorted(unknown)}")
        self._total.add(books, num_prompt_tokens, entry.discarded)
        self._tenants.setdefault(tenant, _Books()).add(books, num_prompt_tokens,
                                                        entry.discarded)
        return books

    def totals(self) -> LedgerTotals:
        return self._total.freeze(self._tiers)

    def per_tenant(self) -> dict[str, LedgerTotals]:
        return {t: b.freeze(self._tiers) for t, b in sorted(self._tenants.items())}
