"""``kvplugin run`` as a user sees it: the summary table (per source, per tier, per tenant,
the same numbers as the JSON), the progress bar (drawn when asked or on a terminal, fed from
a task, never with ``--json``), ``--compare-no-offload``, ``--plot`` and the metrics
endpoint's lifecycle."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import subprocess
import sys
import time
import types
from pathlib import Path
from typing import Any

import pytest
from engine_testlib import small_config

from kvplugin.cli import build_parser, main
from kvplugin.engine.plot import plot_runs, rolling_median, shares
from kvplugin.engine.progress import ProgressBar, postfix, wanted
from kvplugin.engine.report import CONTRACT_KEYS, RunReport, Sample, mib
from kvplugin.engine.run import serve

_find_spec = importlib.util.find_spec

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvplugin.cli", "run", *args],
                          capture_output=True, text=True, timeout=120)


def _last_json(proc: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    assert proc.returncode == 0, proc.stderr
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def _tiered_config() -> Any:
    """Small pool, memory + disk, requests arriving fast: the tiers serve hits."""
    return small_config(blocks=48, disk=True, workload={"num_requests": 30, "seed": 3,
                                                        "requests_per_s": 2000.0})


class Recorder:
    """A Progress that records what it was told."""

    def __init__(self) -> None:
        self.totals: list[int] = []
        self.updates: list[tuple[int, str]] = []
        self.ended = 0

    def begin(self, total: int) -> None:
        self.totals.append(total)

    def update(self, finished: int, postfix: str) -> None:
        self.updates.append((finished, postfix))

    def end(self) -> None:
        self.ended += 1


@pytest.mark.asyncio
async def test_summary_table_shows_the_reports_numbers_per_source_and_tenant() -> None:
    rep = await serve(_tiered_config())
    d = rep.as_dict()
    assert set(CONTRACT_KEYS) <= set(d) and rep.ok()
    assert d["requests"] == d["finished"] == 30 and rep.tier_hits > 0
    for key in ("ttft_p50_ms", "ttft_p99_ms", "step_ms_p50", "step_ms_p99",
                "recomputed_tokens", "bytes_stored", "bytes_loaded", "per_tenant"):
        assert key in d
    assert d["step_ms_p50"] > 0 and d["step_ms_p99"] >= d["step_ms_p50"]
    assert set(d["bytes_stored"]) == set(d["bytes_loaded"]) == {"memory", "disk"}
    assert d["bytes_stored"]["memory"] > 0 and d["bytes_loaded"]["memory"] > 0
    lines = rep.table().splitlines()
    rows = {ln.split()[0]: ln.split() for ln in lines if ln and not ln[0].isspace()}
    # The token ledger: every prompt token once, the shares of the prompt tokens.
    computed, prompt = d["computed_prompt_tokens"], d["prompt_tokens"]
    ledger = d["token_ledger"]
    assert prompt == d["workload_prompt_tokens"] == sum(ledger.values())
    assert list(ledger) == ["device", "memory", "disk", "computed", "recomputed", "unprocessed"]
    assert ledger["computed"] + ledger["recomputed"] == computed and ledger["unprocessed"] == 0
    assert {k: ledger[k] for k in ("device", "memory", "disk")} == d["hit_tokens"]
    assert sum(d["recomputed_after"].values()) == ledger["recomputed"]
    assert d["prefill_work_tokens"] == computed + d["discarded_tokens"]
    assert rows["device"] == ["device", str(ledger["device"]),
                              f"{ledger['device'] / prompt:.1%}", "-", "-"]
    for tier in ("memory", "disk"):
        n = d["hit_tokens"][tier]
        assert rows[tier] == [tier, str(n), f"{n / prompt:.1%}",
                              mib(d["bytes_stored"][tier]), mib(d["bytes_loaded"][tier])]
    for src in ("computed", "recomputed"):
        assert rows[src] == [src, str(ledger[src]), f"{ledger[src] / prompt:.1%}", "-", "-"]
    assert "unprocessed" not in rows  # shown only when a request ended before its prefill
    assert rows["total"] == ["total", str(prompt), "100.0%"]
    # Per tenant: the same books, the same denominator; they add up to the totals.
    tenants = d["per_tenant"]
    assert sorted(tenants) == ["tenant0", "tenant1", "tenant2"]
    for name, t in tenants.items():
        share = t["hit_tokens"] / t["prompt_tokens"]
        assert t["hit_share"] == round(share, 4) and 0 <= share <= 1
        assert sum(t["token_ledger"].values()) == t["prompt_tokens"]
        assert t["hit_tokens"] + t["computed_prompt_tokens"] == t["prompt_tokens"]
        assert rows[name] == [name, str(t["requests"]), str(t["prompt_tokens"]),
                              str(t["hit_tokens"]), str(t["computed_prompt_tokens"]),
                              f"{share:.1%}", f"{t['ttft_p50_ms']:.2f}"]
    assert sum(t["requests"] for t in tenants.values()) == d["finished"]
    assert sum(t["prompt_tokens"] for t in tenants.values()) == prompt
    assert sum(t["queried_tokens"] for t in tenants.values()) == d["queried_tokens"]
    assert sum(t["hit_tokens"] for t in tenants.values()) == sum(d["hit_tokens"].values())
    for src in ledger:
        assert sum(t["token_ledger"][src] for t in tenants.values()) == ledger[src]
    assert f"leaked blocks : {d['leaked_blocks']}" in lines
    assert (f"TTFT          : p50 {d['ttft_p50_ms']} ms, p99 {d['ttft_p99_ms']} ms (real time)"
            in lines)
    # The time series: one sample per finished request, cumulative counters.
    # The workload was streamed: no spec is kept (only a run given a list keeps it).
    assert len(rep.timeline) == 30 and rep.specs == ()
    assert sum(d["workload"].values()) == 30
    last = rep.timeline[-1]
    assert dict(last.hit_tokens) == d["hit_tokens"]
    assert last.computed_prompt_tokens == computed
    assert [s.t_s for s in rep.timeline] == sorted(s.t_s for s in rep.timeline)


@pytest.mark.asyncio
async def test_progress_is_fed_by_a_periodic_task_and_ends_on_the_final_count() -> None:
    bar = Recorder()
    rep = await serve(_tiered_config(), progress=bar)
    assert bar.totals == [30] and bar.ended == 1
    finished = [n for n, _ in bar.updates]
    assert finished == sorted(finished) and finished[-1] == 30
    # Every 100 ms (plus the first and the final update), not once per engine step.
    assert len(bar.updates) <= rep.wall_s / 0.1 + 3
    assert len(bar.updates) < rep.extra["steps"]
    hits = rep.hit_tokens
    assert bar.updates[-1][1] == postfix(hits, rep.prompt_tokens)


def test_postfix_and_when_a_bar_is_drawn() -> None:
    assert postfix({"device": 30, "memory": 20, "disk": 10}, 200) == "hit 30% | memory 20 disk 10"
    assert postfix({"device": 0}, 0) == "hit 0%"

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert wanted(None, json=False, stream=Tty()) is True
    assert wanted(None, json=True, stream=Tty()) is False
    assert wanted(None, json=False, stream=io.StringIO()) is False
    assert wanted(True, json=True, stream=io.StringIO()) is True
    assert wanted(False, json=False, stream=Tty()) is False
    out = io.StringIO()
    bar = ProgressBar(out, desc="requests")
    with pytest.raises(RuntimeError, match="before begin"):
        bar.update(1, "")
    bar.begin(4)
    bar.update(3, "hit 50%")
    bar.end()
    assert "3/4" in out.getvalue() and "hit 50%" in out.getvalue()


def _main(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str, str]:
    """``kvplugin run ARGS`` in this process (stderr is captured: not a terminal)."""
    core = logging.getLogger("kvplugin.core")
    level = core.level
    try:
        rc = main(["run", *args])
    finally:
        core.setLevel(level)  # main quiets it for the process; not for the other tests
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_the_bar_appears_only_when_forced_and_json_stays_parseable(
        capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _main(capsys, "--requests", "10", "--progress", "--json")
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["finished"] == 10
    # Two runs: the one reported, and the same requests with offload off for the verdict.
    assert "offload on: 100%" in err and "offload off: 100%" in err and "10/10" in err
    assert "hit " in err
    rc, out, err = _main(capsys, "--requests", "10", "--json")
    assert rc == 0 and json.loads(out.strip().splitlines()[-1])["finished"] == 10
    assert "req/s" not in err and "10/10" not in err


def test_compare_no_offload_and_plot_on_the_default_config(tmp_path: Path) -> None:
    png = tmp_path / "run.png"
    proc = _cli("--compare-no-offload", "--json", "--plot", str(png), "--requests", "48")
    d = _last_json(proc)
    assert "req/s" not in proc.stderr  # stderr is a pipe: no bar
    off = d["no_offload"]
    assert set(CONTRACT_KEYS) <= set(off) and set(CONTRACT_KEYS) <= set(d)
    assert d["finished"] == off["finished"] == 48
    # The same requests: the same prompts, token for token.
    assert off["prompt_tokens"] == d["prompt_tokens"]
    assert off["tiers"] == [] and off["hit_tokens"] == {"device": off["hit_tokens"]["device"]}
    assert off["loads"] == off["stores"] == 0 and off["leaked_blocks"] == 0
    cmp = d["comparison"]
    assert set(cmp) == {"clock", "recompute_ratio", "ttft_p50_ratio", "throughput_ratio"}
    assert cmp["clock"] == "simulated"
    # Throughput on the engine's (simulated) clock, never this machine's wall time.
    assert cmp["throughput_ratio"] == round(
        (d["finished"] / d["served_s"]) / (off["finished"] / off["served_s"]), 4)
    v = d["verdict"]
    assert v["prefill_tokens_saved"] == off["prefill_work_tokens"] - d[
        "prefill_work_tokens"] > 0
    assert v["prefill_tokens_without_offload"] == off["prefill_work_tokens"]
    assert (v["ttft_p50_ms_with_offload"], v["ttft_p50_ms_without_offload"]) == (
        d["ttft_p50_ms"], off["ttft_p50_ms"])
    assert v["clock"] == "simulated" and v["requests"] == 48
    assert cmp["recompute_ratio"] == round(d["computed_prompt_tokens"]
                                           / off["computed_prompt_tokens"], 4)
    assert cmp["recompute_ratio"] < 1
    assert cmp["ttft_p50_ratio"] == round(d["ttft_p50_ms"] / off["ttft_p50_ms"], 4)
    data = png.read_bytes()
    assert data[:8] == PNG_SIGNATURE and len(data) > 1000


def test_text_mode_tables_and_the_comparison(capsys: pytest.CaptureFixture[str]) -> None:
    rc, out, err = _main(capsys, "--requests", "8", "--compare-no-offload")
    assert rc == 0, err
    assert "req/s" not in err
    assert "\nsource " in out and "\ntenant " in out
    assert "the same requests with offload off:" in out
    header = next(ln for ln in out.splitlines() if "offload on" in ln and "offload off" in ln)
    assert header.split() == ["offload", "on", "offload", "off"]
    finished = next(ln for ln in out.splitlines() if ln.startswith("requests finished"))
    assert finished.split() == ["requests", "finished", "8/8", "8/8"]
    assert "ratios (on / off): clock simulated, recompute_ratio " in out
    rows = {ln.split("  ")[0]: ln for ln in out.splitlines()}
    assert "requests/s (simulated time)" in rows and "run s (wall, this machine)" in rows
    assert out.strip().splitlines()[-1].startswith("verdict: offload saved ")


def _sample(t: float, ttft: float | None, device: int, memory: int, computed: int) -> Sample:
    return Sample(t, "a", ttft, 0, computed, {"device": device, "memory": memory})


def test_plot_helpers_and_a_single_run_plot(tmp_path: Path) -> None:
    timeline = [_sample(0.1, 0.05, 0, 0, 10), _sample(0.2, 0.01, 10, 10, 20),
                _sample(0.3, None, 0, 0, 0)]
    assert shares(timeline, ["device", "memory"]) == {
        "device": [0.0, 0.25, 0.0], "memory": [0.0, 0.25, 0.0], "computed": [1.0, 0.5, 0.0]}
    assert rolling_median([5, 1, 3, 10], 3) == [5, 3.0, 3, 3]
    with pytest.raises(ValueError, match="window"):
        rolling_median([1.0], 0)
    rep = RunReport(hit_tokens={"device": 10, "memory": 10}, timeline=timeline)
    path = tmp_path / "one.png"
    plot_runs(path, rep)
    assert path.read_bytes()[:8] == PNG_SIGNATURE


@pytest.mark.asyncio
async def test_metrics_server_starts_on_the_built_deployment_and_closes_after_linger(
        monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[Any] = []

    class Handle:
        port = 12345

        def close(self) -> None:
            events.append("close")

    def start(dep: Any, *, port: int) -> Handle:
        # Started on a live deployment: its manager answers stats already.
        events.append(("start", port, dep.mgr.stats().loads))
        return Handle()

    fake = types.ModuleType("kvplugin.metrics")
    fake.start_metrics_server = start  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvplugin.metrics", fake)
    cfg = small_config(workload={"num_requests": 4})
    t0 = time.perf_counter()
    rep = await serve(cfg, metrics_port=0, metrics_linger_s=0.2)
    assert events == [("start", 0, 0), "close"] and rep.finished == 4
    assert time.perf_counter() - t0 >= rep.wall_s + 0.2  # lingered before closing
    events.clear()
    await serve(cfg)
    assert events == []


def test_bad_flags_are_refused_before_the_run_and_validate_config_is_a_command(
        tmp_path: Path, capsys: pytest.CaptureFixture[str],
        monkeypatch: pytest.MonkeyPatch) -> None:
    for args, why in [(["--metrics-linger", "1"], "--metrics-linger needs --metrics-port"),
                      (["--metrics-port", "70000"], "--metrics-port must be 0..65535"),
                      (["--plot", str(tmp_path / "missing" / "x.png")], "no such directory")]:
        rc, _, err = _main(capsys, *args)
        assert rc == 2 and why in err
    with monkeypatch.context() as m:  # matplotlib is an optional extra: said before the run
        m.setattr("importlib.util.find_spec",
                  lambda name, *a: None if name == "matplotlib" else _find_spec(name, *a))
        rc, out, err = _main(capsys, "--plot", str(tmp_path / "x.png"))
        assert rc == 2 and "pip install -e '.[plot]'" in err and not out
    monkeypatch.setenv("KVPLUGIN_OFFLOAD__ENABLED", "false")
    rc, _, err = _main(capsys, "--compare-no-offload")
    assert rc == 2 and "needs a config with offload enabled" in err
    rc, out, err = _main(capsys, "--requests", "4")
    assert rc == 0, err
    assert "on the async engine, offload off" in out
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    assert {"run", "replay", "validate-config"} <= set(sub.choices or ())


def test_the_default_run_ends_with_the_verdict() -> None:
    proc = _cli("--requests", "24")
    assert proc.returncode == 0, proc.stderr
    last = proc.stdout.strip().splitlines()[-1]
    d = _last_json(_cli("--requests", "24", "--json"))
    v = d["verdict"]
    assert "no_offload" not in d  # the table's runs only with --compare-no-offload
    saved, without = v["prefill_tokens_saved"], v["prefill_tokens_without_offload"]
    assert last == (
        f"verdict: offload saved {saved} of {without} prefill tokens computed "
        f"({saved / without:.1%}) "
        f"on the same 24 requests; TTFT p50 {v['ttft_p50_ms_with_offload']} ms with it, "
        f"{v['ttft_p50_ms_without_offload']} ms without "
        f"({v['ttft_p50_ms_with_offload'] / v['ttft_p50_ms_without_offload']:.2f}x); "
        "simulated time, model time: the config's engine timings "
        "(engine.prefill_token_ms / decode_step_ms; loads cost nothing)")
    skipped = _cli("--requests", "24", "--no-verdict")
    assert skipped.stdout.strip().splitlines()[-1].startswith("verdict: not asked")
    assert _last_json(_cli("--requests", "24", "--json", "--no-verdict"))["verdict"] is None


def test_offload_costs_no_device_hits_once_discarded_passes_are_counted() -> None:
    """README, "Device hits with offload off": the offload-off run's extra device hits are a
    preempted request's own first-pass blocks found again when it resumes."""
    d = _last_json(_cli("--compare-no-offload", "--json"))
    off = d["no_offload"]
    assert off["preemptions"] > d["preemptions"]
    assert off["hit_tokens"]["device"] > d["hit_tokens"]["device"]
    again = off["discarded_tokens"] - off["recomputed_after"]["preemption"]
    assert off["hit_tokens"]["device"] - again <= d["hit_tokens"]["device"]
    assert d["verdict"]["prefill_tokens_saved"] == (off["prefill_work_tokens"]
                                                    - d["prefill_work_tokens"])
