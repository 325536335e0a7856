"""The run report: the JSON object ``kvplugin run --json`` prints last (a contract other tools
check: the keys of :data:`CONTRACT_KEYS` are always there), a readable summary table, and
the side-by-side table of a run with offload against the same workload without it."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplugin.engine.workload import RequestSpec

__all__ = [
    "CONTRACT_KEYS",
    "DECIDED_KEYS",
    "RunReport",
    "Sample",
    "TenantRow",
    "compare_table",
    "comparison",
    "decided",
    "ledger_errors",
]

CONTRACT_KEYS = ("requests", "finished", "prompt_tokens", "computed_prompt_tokens", "hit_tokens",
                 "loads", "load_failures", "stores", "stores_shed", "kv_mismatches",
                 "cross_tenant_hits", "leaked_blocks", "loop_lag_p99_ms", "wall_s")

# The figures a deterministic run (engine.deterministic) decides: the same for the same seed
# on the same starting state of the tiers. The rest (wall_s, loop_lag_p99_ms, step_ms_*)
# measure this machine's real time and vary.
DECIDED_KEYS = ("requests", "finished", "prompt_tokens", "computed_prompt_tokens",
                "hit_tokens", "token_ledger", "recomputed_after", "discarded_tokens",
                "prefill_work_tokens", "loads", "load_failures", "stores", "stores_shed",
                "steps", "preemptions", "admissions", "parked", "ttft_p50_ms", "ttft_p99_ms",
                "bytes_stored", "bytes_loaded", "pages_checked", "simulated_compute_s",
                "per_tenant")

MIB = 1 << 20




@dataclass(frozen=True, slots=True)
class Sample:
    """One finished request, with the token ledger's totals at that moment (the books of
    the requests finished so far: cumulative)."""

    t_s: float  # finish time, seconds after the start
    tenant: str
    ttft_s: float | None
    prompt_tokens: int  # of the requests finished so far
    computed_prompt_tokens: int  # of those, computed (recomputation included)
    hit_tokens: Mapping[str, int]  # of those: "device" and each tier's label


@dataclass(frozen=True, slots=True)
class TenantRow:
    """A tenant's finished requests, from the same token ledger as the totals."""

    requests: int
    prompt_tokens: int
    hit_tokens: int
    computed_prompt_tokens: int  # as the totals' computed_prompt_tokens (prompt tokens only)
    queried_tokens: int  # of its prefix-cache queries (one per admission)
    ttft_p50_ms: float
    sources: Mapping[str, int] = field(default_factory=dict)  # its token ledger

    @property
    def hit_share(self) -> float:
        """Hit tokens over the prompt tokens: the headline's denominator."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def as_dict(self) -> dict[str, Any]:
        return {"requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "hit_tokens": self.hit_tokens,
                "computed_prompt_tokens": self.computed_prompt_tokens,
                "queried_tokens": self.queried_tokens, "hit_share": round(self.hit_share, 4),
                "token_ledger": dict(self.sources), "ttft_p50_ms": self.ttft_p50_ms}


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
    per_tenant: dict[str, TenantRow] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    # Not in the JSON: the time series (for --plot) and the specs served (for a rerun).
    timeline: list[Sample] = field(default_factory=list, repr=False)
    specs: Sequence[RequestSpec] = field(default=(), repr=False)

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {k: getattr(self, k) for k in CONTRACT_KEYS}
        out["failed"] = self.failed
        out["loop_lag_p99_ms"] = round(self.loop_lag_p99_ms, 3)
        out["wall_s"] = round(self.wall_s, 3)
        out["per_tenant"] = {t: row.as_dict() for t, row in self.per_tenant.items()}
        out.update(self.extra)
        return out

    @property
    def tier_hits(self) -> int:
        return sum(n for tier, n in self.hit_tokens.items() if tier != "device")

    @property
    def throughput(self) -> float:
        """Finished requests per second of the engine's clock (``extra["clock"]``: the
        simulated model time by default, real time with --realtime), from the first
        request to the last answer; this machine's wall time is ``wall_s``."""
        span = float(self.extra.get("served_s", 0.0))
        return self.finished / span if span > 0 else 0.0

    def share(self, tokens: int) -> float:
        """``tokens`` as a share of the prompt tokens (every share's denominator)."""
        return tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    def ok(self) -> bool:
        """Every request finished, the KV was right, nothing leaked, the books balance."""
        return (self.finished == self.requests and not self.kv_mismatches
                and not self.cross_tenant_hits and not self.leaked_blocks
                and not self.ledger_errors())

    def ledger_errors(self) -> list[str]:
        """:func:`ledger_errors` of this report."""
        return ledger_errors(self.as_dict())

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
        """The summary: totals, then where the prompt tokens came from (per tier, with the
        bytes each tier took and gave), then per tenant."""
        x = self.extra
        rows = [
            ("requests", f"{self.finished}/{self.requests} finished ({self.failed} failed), "
                         f"{x.get('steps', 0)} steps, {x.get('preemptions', 0)} preemptions"),
            ("prompt tokens", f"{self.prompt_tokens}, computed {self.computed_prompt_tokens} "
                              f"({x.get('recomputed_after', {}).get('preemption', 0)} again "
                              f"after a preemption, "
                              f"{x.get('recomputed_after', {}).get('failed_load', 0)} after a "
                              f"failed load)"),
            ("hit tokens", f"{sum(self.hit_tokens.values())} "
                           f"({self.share(sum(self.hit_tokens.values())):.1%} of the prompt "
                           f"tokens), {self.tier_hits} from the tiers"),
            ("prefill work", f"{x.get('prefill_work_tokens', 0)} tokens computed, "
                             f"{x.get('discarded_tokens', 0)} of them by passes a preemption "
                             f"ended"),
            ("loads", f"{self.loads} ({self.load_failures} failed, "
                      f"{x.get('loaded_chunks', 0)} objects, "
                      f"{x.get('recomputed_tokens', 0)} claimed tokens recomputed, "
                      f"{x.get('skipped_load_tokens', 0)} hit tokens computed: loading "
                      "them was slower)"),
            ("stores", f"{self.stores} objects ({self.stores_shed} shed, "
                       f"{x.get('stores_failed', 0)} failed"
                       + "".join(f", {n} failed on {t}" for t, n
                                 in x.get("store_failures_by_tier", {}).items() if n)
                       + ")"),
            ("tier errors", ", ".join(f"{t} {n}" for t, n in x.get("tier_errors", {}).items())
             or "none"),
            ("corrupt", _corrupt(x.get("corrupt_objects", {}))),
            ("KV checks", f"{x.get('pages_checked', 0)} pages, {self.kv_mismatches} mismatches, "
                          f"{self.cross_tenant_hits} cross-tenant"),
            *self._state_rows(),
            ("leaked blocks", str(self.leaked_blocks)),
            ("TTFT", f"p50 {x.get('ttft_p50_ms', 0)} ms, p99 {x.get('ttft_p99_ms', 0)} ms"
                     + (" (simulated time: the same for the same seed)"
                        if x.get("clock") == "simulated" else " (real time)")),
            ("model time", x.get("model_cost_deployment") or
             "the config's prefill_token_ms / decode_step_ms (loads cost nothing)"),
            ("step latency", f"p50 {x.get('step_ms_p50', 0)} ms, p99 "
                             f"{x.get('step_ms_p99', 0)} ms"),
            ("loop lag", f"p99 {self.loop_lag_p99_ms:.2f} ms ({x.get('loop', '?')})"),
            ("wall time", f"{self.wall_s:.2f} s"),
        ]
        width = max(len(k) for k, _ in rows)
        lines = [f"{k:<{width}} : {v}" for k, v in rows]
        return "\n".join([*lines, "", self.sources_table(), "", self.tenant_table()])

    def sources_table(self) -> str:
        """The token ledger: every prompt token once, by where it came from (the rows sum
        to the prompt tokens); a tier's bytes stored and loaded."""
        stored = self.extra.get("bytes_stored", {})
        loaded = self.extra.get("bytes_loaded", {})
        ledger = self.extra.get("token_ledger") or {
            **self.hit_tokens, "computed": self.computed_prompt_tokens}
        rows = [["source", "tokens", "share", "stored MiB", "loaded MiB"]]
        for src, n in ledger.items():
            if src == "unprocessed" and not n:
                continue
            tier = src in stored or src in loaded
            rows.append([src, str(n), f"{self.share(n):.1%}",
                         mib(stored.get(src, 0)) if tier else "-",
                         mib(loaded.get(src, 0)) if tier else "-"])
        rows.append(["total", str(sum(ledger.values())), f"{self.share(sum(ledger.values())):.1%}",
                     "", ""])
        return render(rows) + (
            "\n* each prompt token once, by the pass that finished its request; recomputed: "
            "computed before by a preempted pass, or claimed from a tier whose load failed"
            "\n* stored MiB: bytes a tier wrote (puts it confirmed), hits promoted into it "
            "from a lower tier included; loaded MiB: verified bytes read from it")

    def tenant_table(self) -> str:
        rows = [["tenant", "requests", "prompt tokens", "hit tokens", "computed", "hit share",
                 "TTFT p50 ms"]]
        for tenant, r in sorted(self.per_tenant.items()):
            rows.append([tenant, str(r.requests), str(r.prompt_tokens), str(r.hit_tokens),
                         str(r.computed_prompt_tokens), f"{r.hit_share:.1%}",
                         f"{r.ttft_p50_ms:.2f}"])
        return render(rows)


NOT_HITS = ("computed", "recomputed", "unprocessed")


def decided(report: Mapping[str, Any]) -> dict[str, Any]:
    """The :data:`DECIDED_KEYS` of a run report's JSON: what two runs of one seed share."""
    return {k: report[k] for k in DECIDED_KEYS}


def ledger_errors(report: Mapping[str, Any]) -> list[str]:
    """Where a run report's token ledger (its JSON) does not add up; empty: it does. Its
    sources against ``prompt_tokens``, its hits against ``hit_tokens``, its computed and
    recomputed tokens against ``computed_prompt_tokens``, the tenants' books against the
    totals."""
    ledger = report.get("token_ledger")
    if ledger is None:
        return ["no token_ledger"]
    errors = []
    if sum(ledger.values()) != report["prompt_tokens"]:
        errors.append(f"sources {sum(ledger.values())} != prompt tokens "
                      f"{report['prompt_tokens']}")
    hits = {k: v for k, v in ledger.items() if k not in NOT_HITS}
    if hits != report["hit_tokens"]:
        errors.append(f"hit tokens {report['hit_tokens']} != the ledger's {hits}")
    if ledger.get("computed", 0) + ledger.get("recomputed", 0) != \
            report["computed_prompt_tokens"]:
        errors.append("computed_prompt_tokens is not computed + recomputed")
    if sum(report.get("recomputed_after", {}).values()) != ledger.get("recomputed", 0):
        errors.append("recomputed_after does not add up to recomputed")
    rows = report.get("per_tenant", {}).values()
    for src, n in ledger.items():
        if rows and sum(r["token_ledger"].get(src, 0) for r in rows) != n:
            errors.append(f"the tenants' {src} tokens do not add up to {n}")
    for tenant, r in report.get("per_tenant", {}).items():
        if sum(r["token_ledger"].values()) != r["prompt_tokens"]:
            errors.append(f"tenant {tenant}'s sources do not add up to its prompt tokens")
    return errors


def mib(n: int) -> str:
    return f"{n / MIB:.2f}"


def render(rows: Sequence[Sequence[str]]) -> str:
    """Columns aligned: the first to the left, the others (numbers) to the right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths, strict=True)))
                     for r in rows)


def _ratio(a: float, b: float) -> float | None:
    return round(a / b, 4) if b else None


def comparison(on: RunReport, off: RunReport) -> dict[str, float | str | None]:
    """Offload on over off (None where off is zero): below 1 for the recomputation and the
    TTFT, above 1 for the throughput, when offload pays; TTFT and throughput on the
    engine's clock (``clock``), both runs on the same one."""
    return {
        "clock": str(on.extra.get("clock", "simulated")),
        "recompute_ratio": _ratio(on.computed_prompt_tokens, off.computed_prompt_tokens),
        "ttft_p50_ratio": _ratio(on.extra.get("ttft_p50_ms", 0.0),
                                 off.extra.get("ttft_p50_ms", 0.0)),
        "throughput_ratio": _ratio(on.throughput, off.throughput),
    }


def compare_table(on: RunReport, off: RunReport) -> str:
    """The two runs of the same workload side by side, then the ratios."""
    def row(name: str, f: Any) -> list[str]:
        return [name, str(f(on)), str(f(off))]

    sources = list(dict.fromkeys([*on.hit_tokens, *off.hit_tokens]))
    clock = f"{on.extra.get('clock', 'simulated')} time"
    rows = [
        ["", "offload on", "offload off"],
        row("requests finished", lambda r: f"{r.finished}/{r.requests}"),
        row("prompt tokens", lambda r: r.prompt_tokens),
        row("computed prompt tokens", lambda r: r.computed_prompt_tokens),
        *(row(f"hit tokens {s}", lambda r, s=s: r.hit_tokens.get(s, 0)) for s in sources),
        row(f"TTFT p50 ms ({clock})", lambda r: r.extra.get("ttft_p50_ms", 0)),
        row(f"TTFT p99 ms ({clock})", lambda r: r.extra.get("ttft_p99_ms", 0)),
        row(f"served in s ({clock})", lambda r: r.extra.get("served_s", 0)),
        row(f"requests/s ({clock})", lambda r: f"{r.throughput:.2f}"),
        row("step p50 ms (wall)", lambda r: r.extra.get("step_ms_p50", 0)),
        row("step p99 ms (wall)", lambda r: r.extra.get("step_ms_p99", 0)),
        row("run s (wall, this machine)", lambda r: f"{r.wall_s:.2f}"),
    ]
    ratios = ", ".join(f"{k} {'n/a' if v is None else v if isinstance(v, str) else f'{v:.3f}'}"
                       for k, v in comparison(on, off).items())
    return render(rows) + f"\nratios (on / off): {ratios}"


def _corrupt(by_tier: dict[str, dict[str, int]]) -> str:
    """"disk 12 (checksum 10, truncated 2), redis 0": the objects each tier refused."""
    parts = []
    for tier, reasons in by_tier.items():
        n = sum(reasons.values())
        why = ", ".join(f"{r} {k}" for r, k in reasons.items() if k)
        parts.append(f"{tier} {n}" + (f" ({why})" if why else ""))
    return (", ".join(parts) + " (damaged: dropped, recomputed)") if parts else "none"


NO_COST_MODEL = ("the config's engine timings (engine.prefill_token_ms / decode_step_ms; "
                 "loads cost nothing)")


def verdict(on: RunReport, off: RunReport) -> dict[str, Any]:
    """Did offload help this run? The same requests served with offload off: prefill tokens
    saved, TTFT p50 with and without, on which clock and whose model time.

    Prefill tokens are the work done (``prefill_work_tokens``: passes a preemption ended
    included), not the prompt tokens computed: a preempted request finds its own first
    pass's blocks in the device cache when it resumes, which counts them as device hits,
    so the device hits of a run that preempts more (offload off, here 23 preemptions against
    2) include work that was done and thrown away (docs: "Device hits with offload off")."""
    without = int(off.extra.get("prefill_work_tokens", off.computed_prompt_tokens))
    with_ = int(on.extra.get("prefill_work_tokens", on.computed_prompt_tokens))
    return {
        "requests": on.finished,
        "prefill_tokens_saved": without - with_,
        "prefill_tokens_without_offload": without,
        "ttft_p50_ms_with_offload": on.extra.get("ttft_p50_ms", 0.0),
        "ttft_p50_ms_without_offload": off.extra.get("ttft_p50_ms", 0.0),
        "clock": on.extra.get("clock", "simulated"),
        "model_time": on.extra.get("model_cost_deployment") or NO_COST_MODEL,
    }


def verdict_line(v: dict[str, Any]) -> str:
    """The headline: one line, last."""
    saved, without = v["prefill_tokens_saved"], v["prefill_tokens_without_offload"]
    share = f" ({saved / without:.1%})" if without else ""
    with_, no = v["ttft_p50_ms_with_offload"], v["ttft_p50_ms_without_offload"]
    ratio = f" ({with_ / no:.2f}x)" if no else ""
    return (f"verdict: offload saved {saved} of {without} prefill tokens computed{share} on "
            f"the same {v['requests']} requests; TTFT p50 {with_} ms with it, {no} ms "
            f"without{ratio}; {v['clock']} time, model time: {v['model_time']}")
