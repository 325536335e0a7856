"""Load or recompute, decided by cost: claim a tier's hit only where loading it is faster.

A tier that answers slower than the GPU recomputes (a Redis across a congested network,
a throttled disk) makes every hit it serves a loss: the request waits longer for its KV
than the model would have taken to compute it. :class:`LoadCosts` keeps, per tier, an
estimate of a load's time: seconds per token for the model's bytes (its bandwidth, from the
deployment's figures or the config) plus a latency per load, seeded likewise and then an
EWMA of what completed loads took beyond their bytes' time (a throttled or congested tier
shows there). With the engine's recompute time (a declared rate, or the deployment's
model), it cuts a claim at the prefix end that saves the most time: unit by unit along the
claim, each tier's first unit paying its latency.

A tier no longer used is no longer measured, so a tier that was slow once would stay
skipped forever: after ``probe_every`` skipped claims one of the skipped objects is read
aside (a probe: no request waits for it) and its time refreshes the estimate.
Synchronous and pure: the manager asks, the load jobs and probes report.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

__all__ = ["Choice", "LoadCosts", "Recompute", "TierSpeed", "rate"]


@dataclass(slots=True)
class TierSpeed:
    """A tier's load time: ``latency_s`` (an EWMA of the loads) ``+ tokens * s_per_token``."""

    latency_s: float
    s_per_token: float
    loads: int = 0

    def predict(self, tokens: int) -> float:
        return self.latency_s + tokens * self.s_per_token

    def observe(self, tokens: int, seconds: float, alpha: float) -> None:
        # The bytes' time is the deployment's (the reference engine moves small test
        # pages, whose own time says nothing of the model's bytes); what a load took beyond
        # it is the tier's latency now.
        extra = max(0.0, seconds - tokens * self.s_per_token)
        self.latency_s = extra if self.loads == 0 else (1 - alpha) * self.latency_s + alpha * extra
        self.loads += 1


@dataclass(frozen=True, slots=True)
class Choice:
    """Load the claim's first ``keep`` units. ``slow``: the slowest tier of the part left
    out (None: nothing is); ``probe``: that tier, when it has been skipped so long that one
    of its objects is to be read aside (off the request's path) to measure it again."""

    keep: int
    slow: str | None
    probe: str | None


Recompute = Callable[[int, int], float]  # (first token, tokens) -> seconds to compute them


def rate(tokens_per_s: float) -> Recompute:
    """A declared prefill rate, the same at every position."""
    if not tokens_per_s > 0:
        raise ValueError("the recompute rate must be positive")
    return lambda start, tokens: tokens / tokens_per_s


@dataclass(slots=True)
class LoadCosts:
    recompute_s: Recompute
    speeds: dict[str, TierSpeed]
    alpha: float = 0.2
    probe_every: int = 32
    # False: decide from the seeds alone (a simulated run: real timings must not change
    # its decisions, or one seed would give different runs).
    measure: bool = True
    probes: int = 0  # claims let through to re-measure a tier that was skipped
    _since_probe: dict[str, int] = field(default_factory=dict)

    @classmethod
    def seeded(cls, tiers: Sequence[str], recompute_s: Recompute, *,
               tier_s_per_token: Mapping[str, float], tier_latency_s: Mapping[str, float],
               alpha: float = 0.2, probe_every: int = 32, measure: bool = True) -> LoadCosts:
        """Tiers' seeds: seconds per token of their bytes (absent: 0, only the measured
        latency counts) and latency per load (absent: 0 until measured)."""
        if not 0 < alpha <= 1 or probe_every < 1:
            raise ValueError("need 0 < alpha <= 1 and probe_every >= 1")
        speeds = {}
        for t in tiers:
            per, lat = tier_s_per_token.get(t, 0.0), tier_latency_s.get(t, 0.0)
            if per < 0 or lat < 0:
                raise ValueError(f"tier {t}: negative seconds")
            speeds[t] = TierSpeed(lat, per)
        return cls(recompute_s, speeds, alpha, probe_every, measure)

    def plan(self, chunks: Sequence[tuple[str, int, int]]) -> Choice:
        """How many of the claim's units to load, in order (``chunks``: each one's tier,
        first token and tokens): the prefix that saves the most time (0 when none saves
        any). Pure: a claim may be planned again (its admission found no room) and only
        the admitted one counts (:meth:`settle`)."""
        best, best_at, saved = 0.0, 0, 0.0
        used: set[str] = set()
        for i, (tier, start, tokens) in enumerate(chunks):
            speed = self.speeds[tier]
            cost = tokens * speed.s_per_token + (0.0 if tier in used else speed.latency_s)
            used.add(tier)
            saved += self.recompute_s(start, tokens) - cost
            if saved > best:
                best, best_at = saved, i + 1
        if best_at == len(chunks):
            return Choice(best_at, None, None)
        slow = max((t for t, _, _ in chunks[best_at:]), key=lambda t: self.speeds[t].predict(1))
        probe = self.measure and self._since_probe.get(slow, 0) + 1 >= self.probe_every
        return Choice(best_at, slow, slow if probe else None)

    def settle(self, choice: Choice) -> None:
        """``choice`` was admitted: a skip counts toward its tier's next probe."""
        if choice.probe is not None:
            self._since_probe[choice.probe] = 0
            self.probes += 1
        elif choice.slow is not None and self.measure:
            self._since_probe[choice.slow] = self._since_probe.get(choice.slow, 0) + 1

    def choose(self, chunks: Sequence[tuple[str, int, int]]) -> tuple[int, str | None]:
        """:meth:`plan` then :meth:`settle`: (units to load, the slowest tier left out)."""
        choice = self.plan(chunks)
        self.settle(choice)
        return choice.keep, choice.slow

    def observed(self, tier: str, tokens: int, seconds: float) -> None:
        """A load of ``tokens`` whose slowest tier was ``tier`` took ``seconds``."""
        if self.measure and tokens > 0 and tier in self.speeds:
            self.speeds[tier].observe(tokens, seconds, self.alpha)
