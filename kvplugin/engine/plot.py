"""``kvplugin run --plot FILE.png``: where the prompt tokens came from over the run (device,
each tier, or computed: cumulative shares, stacked) and each request's TTFT over time (with
a rolling median), for the run and, with ``--compare-no-offload``, the run without offload.

matplotlib is imported here only, with the Agg backend (no display needed), so a run
without ``--plot`` never pays for it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

from kvplugin.engine.report import RunReport, Sample

if TYPE_CHECKING:
    from matplotlib.axes import Axes

__all__ = ["plot_runs", "rolling_median", "shares"]

# Prompt tokens the model computed (no hit served them): not "recomputed", which the report
# keeps for tokens a failed load or a preemption made it compute again.
COMPUTED = "computed"
# Fixed colours per source, so two panels (offload on / off) read alike.
COLOURS = {"device": "tab:green", "memory": "tab:blue", "disk": "tab:orange",
           "redis": "tab:red", COMPUTED: "tab:gray"}


def shares(timeline: Sequence[Sample], sources: Sequence[str]) -> dict[str, list[float]]:
    """Per source (each hit source, then ``computed``), its cumulative share of the
    prompt tokens served so far (hits + tokens computed) at each sample: the stack sums
    to 1."""
    out: dict[str, list[float]] = {s: [] for s in (*sources, COMPUTED)}
    for smp in timeline:
        values = [smp.hit_tokens.get(s, 0) for s in sources]
        values.append(smp.computed_prompt_tokens)
        total = sum(values)
        for s, v in zip(out, values, strict=True):
            out[s].append(v / total if total else 0.0)
    return out


def rolling_median(values: Sequence[float], window: int) -> list[float]:
    """The median of the last ``window`` values (fewer at the start) at each point."""
    if window < 1:
        raise ValueError(f"window must be >= 1, got {window}")
    out = []
    for i in range(len(values)):
        part = sorted(values[max(0, i - window + 1):i + 1])
        mid = len(part) // 2
        out.append(part[mid] if len(part) % 2 else (part[mid - 1] + part[mid]) / 2)
    return out


def _share_panel(ax: Axes, rep: RunReport, title: str) -> None:
    sources = list(rep.hit_tokens)
    t = [s.t_s for s in rep.timeline]
    stacked = shares(rep.timeline, sources)
    ax.stackplot(t, *stacked.values(), labels=list(stacked),
                 colors=[COLOURS.get(s, "tab:purple") for s in stacked])
    ax.set_ylim(0, 1)
    ax.set_ylabel("share of prompt tokens")
    ax.set_title(title)
    ax.legend(loc="lower right", fontsize="small")


def _ttft_panel(ax: Axes, runs: Sequence[tuple[str, RunReport]], clock: str) -> None:
    for (label, rep), colour in zip(runs, ("tab:blue", "tab:red"), strict=False):
        points = [(s.t_s, s.ttft_s * 1000) for s in rep.timeline if s.ttft_s is not None]
        if not points:
            continue
        t, ttft = zip(*points, strict=True)
        ax.scatter(t, ttft, s=6, alpha=0.35, color=colour, label=f"{label}: per request")
        window = max(5, len(ttft) // 20)
        ax.plot(t, rolling_median(ttft, window), color=colour,
                label=f"{label}: rolling median ({window})")
    ax.set_xlabel(f"seconds since the start ({clock})")
    ax.set_ylabel(f"TTFT (ms, {clock})")
    ax.set_title("time to first token")
    ax.legend(loc="upper left", fontsize="small")


def plot_runs(path: str | os.PathLike[str], on: RunReport, off: RunReport | None = None,
              *, heading: str = "") -> None:
    """Write the figure to ``path`` (the format from its suffix, e.g. ``.png``), titled
    ``heading`` (the config, the seed, the verdict); the time axis names the run's clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = [("offload on", on)] + ([("offload off", off)] if off is not None else [])
    clock = ("simulated time" if on.extra.get("clock", "simulated") == "simulated"
             else "real time")
    fig, axes = plt.subplots(len(runs) + 1, 1, figsize=(9, 3.2 * (len(runs) + 1) + 0.8),
                             sharex=True, squeeze=False)
    try:
        for ax, (label, rep) in zip(axes[:, 0], runs, strict=False):
            _share_panel(ax, rep, f"where the prompt tokens came from (cumulative), {label}")
        _ttft_panel(axes[-1, 0], runs, clock)
        if heading:
            fig.suptitle(heading, fontsize="small")
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
