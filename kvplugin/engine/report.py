"""The run report: the JSON object ``kvplugin run --json`` prints last (a contract other tools
check: the keys of :data:`CONTRACT_KEYS` are always there), and a readable table."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

__all__ = ["CONTRACT_KEYS", "RunReport", "percentile"]

CONTRACT_KEYS = ("requests", "finished", "prompt_tokens", "computed_prompt_tokens", "hit_tokens",
                 "loads", "load_failures", "stores", "stores_shed", "kv_mismatches",
                 "cross_tenant_hits", "leaked_blocks", "loop_lag_p99_ms", "wall_s")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q / 100 * len(ordered)))]


@dataclass(slots=True)
class RunReport:
    requests: int = 0
    finished: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    computed_prompt_tokens: int = 0
    hit_tokens: dict[str, int] = field(default_factory=dict)  # device, then each tier
    loads: int = 0
    load_failures: int = 0
    stores: int = 0  # objects stored
    stores_shed: int = 0
    kv_mismatches: int = 0
    cross_tenant_hits: int = 0
    leaked_blocks: int = 0
    loop_lag_p99_ms: float = 0.0
    wall_s: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in CONTRACT_KEYS}
        out["failed"] = self.failed
        out["loop_lag_p99_ms"] = round(self.loop_lag_p99_ms, 3)
        out["wall_s"] = round(self.wall_s, 3)
        out.update(self.extra)
        return out

    @property
    def tier_hits(self) -> int:
        return sum(n for tier, n in self.hit_tokens.items() if tier != "device")

    def ok(self) -> bool:
        """Every request finished, the KV was right, nothing leaked."""
        return (self.finished == self.requests and not self.kv_mismatches
                and not self.cross_tenant_hits and not self.leaked_blocks)

    def _state_rows(self) -> list[tuple[str, str]]:
        """Mamba layouts only: the boundary states stored, loaded and checked."""
        x = self.extra
        if not (x.get("states_checked") or x.get("stored_states")):
            return []
        return [("Mamba states", f"{x.get('stored_states', 0)} stored, "
                                 f"{x.get('loaded_states', 0)} loaded "
                                 f"({x.get('restored_partial_states', 0)} inside a block), "
                                 f"{x.get('states_checked', 0)} checked, "
                                 f"{x.get('state_mismatches', 0)} wrong")]

    def table(self) -> str:
        x = self.extra
        hits = ", ".join(f"{k} {v}" for k, v in self.hit_tokens.items())
        saved = (self.prompt_tokens - self.computed_prompt_tokens) / self.prompt_tokens \
            if self.prompt_tokens else 0.0
        rows = [
            ("requests", f"{self.finished}/{self.requests} finished ({self.failed} failed), "
                         f"{x.get('steps', 0)} steps, {x.get('preemptions', 0)} preemptions"),
            ("prompt tokens", f"{self.prompt_tokens}, computed {self.computed_prompt_tokens} "
                              f"({saved:.1%} not recomputed)"),
            ("hit tokens", hits),
            ("loads", f"{self.loads} ({self.load_failures} failed, "
                      f"{x.get('loaded_chunks', 0)} objects)"),
            ("stores", f"{self.stores} objects ({self.stores_shed} shed, "
                       f"{x.get('stores_failed', 0)} failed)"),
            ("KV checks", f"{x.get('pages_checked', 0)} pages, {self.kv_mismatches} mismatches, "
                          f"{self.cross_tenant_hits} cross-tenant"),
            *self._state_rows(),
            ("leaked blocks", str(self.leaked_blocks)),
            ("latency", f"TTFT p50 {x.get('ttft_p50_ms', 0)} ms, p99 "
                        f"{x.get('ttft_p99_ms', 0)} ms; loop lag p99 "
                        f"{self.loop_lag_p99_ms:.2f} ms ({x.get('loop', '?')})"),
            ("wall time", f"{self.wall_s:.2f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}} : {v}" for k, v in rows)
