"""kvplugin: an asyncio KV-cache manager with KV offload for LLM serving engines.

Run the main job (the reference engine on a deployment config), replay conformance traces
on the allocation core, or validate config files."""

from __future__ import annotations

import argparse
import errno
import importlib.util
import json
import logging
import os
import signal
import sys
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvplugin.engine.config import RunConfig


def _stem(path: str) -> str:
    stem = os.path.basename(path)
    for suffix in (".json", ".trace"):
        stem = stem.removesuffix(suffix)
    return stem


def _trace_error(cmd: str, path: str, e: Exception) -> int:
    """A trace that cannot be replayed, in one line: 3 when it is valid but unsupported,
    2 when it cannot be read or is not a trace."""
    from kvplugin.replay import UnsupportedTraceError

    if isinstance(e, UnsupportedTraceError):
        print(f"kvplugin {cmd}: {path}: not supported: {e}", file=sys.stderr)
        return 3
    print(f"kvplugin {cmd}: {path}: {e}", file=sys.stderr)
    return 2


EXPECTED_SUFFIX = ".expected.json"  # a trace's recorded vLLM outputs, beside the trace


def _traces(paths: list[str]) -> list[str]:
    """The traces among ``paths``: with several (a glob over a traces directory), the
    recorded outputs beside them (``*.expected.json``) are left out, and said so."""
    if len(paths) < 2:
        return paths
    kept = [p for p in paths if not p.endswith(EXPECTED_SUFFIX)]
    if len(kept) < len(paths):
        print(f"kvplugin replay: {len(paths) - len(kept)} recorded output file(s) "
              f"(*{EXPECTED_SUFFIX}) left out: they are the traces' expected results, "
              "compared with tools in conformance/", file=sys.stderr)
    return kept


def cmd_replay(args: argparse.Namespace) -> int:
    from kvplugin.replay import TraceError, bench, dump_result, load_trace, run_trace

    traces = _traces(args.traces)
    if len(traces) > 1 and not (args.out_dir or args.bench):
        print("kvplugin replay: several traces need --out-dir", file=sys.stderr)
        return 2
    rc = 0
    for path in traces:
        try:
            trace = load_trace(path)
            if args.bench:
                stats = bench(trace, args.bench)
                stats["trace"] = path
                print(json.dumps(stats))
                continue
            result = run_trace(trace, stop_on_error=args.stop_on_error)
        except (TraceError, OSError, ValueError) as e:  # UnsupportedTraceError included
            return _trace_error("replay", path, e)
        if result["summary"]["num_errors"]:
            rc = 1
            first = next(r for r in result["results"] if "error" in r)
            print(f"kvplugin replay: {path}: {result['summary']['num_errors']} op(s) failed; "
                  f"the first, op {first['i']} ({first['op']}): {first['error']}",
                  file=sys.stderr)
        if args.out_dir:
            os.makedirs(args.out_dir, exist_ok=True)
            out = os.path.join(args.out_dir, _stem(path) + ".result.json")
            with open(out, "w") as f:
                dump_result(result, f)
            s = result["summary"]
            print(f"{path}: {s['num_results']}/{s['num_ops']} ops, {s['num_errors']} errors, "
                  f"{s['allocate_slots_failed']} failed allocations, final free blocks "
                  f"{s['final_num_free_blocks']}", file=sys.stderr)
        elif args.output:
            with open(args.output, "w") as f:
                dump_result(result, f)
        else:
            dump_result(result, sys.stdout)
    return rc


def summarize(result: dict[str, Any]) -> str:
    rows = result["results"]
    s = result["summary"]
    requests = sum(1 for r in rows if r["op"] == "add_request")
    lookups = [r for r in rows if r["op"] == "get_computed_blocks"]
    hit_tokens = sum(r.get("num_computed_tokens", 0) for r in lookups)
    allocs = [r for r in rows if r["op"] == "allocate_slots"]
    prompt_tokens = sum(r.get("num_tokens", 0) for r in rows if r["op"] == "add_request")
    res = result["resolved"]
    return "\n".join([
        f"layout       : {res['coordinator']} {res['managers']} block sizes "
        f"{res['group_block_sizes']}",
        f"requests     : {requests} ({prompt_tokens} prompt tokens)",
        f"lookups      : {len(lookups)}, hit tokens {hit_tokens}",
        f"allocations  : {len(allocs)}, failed (no room) {s['allocate_slots_failed']}",
        f"errors       : {s['num_errors']}",
        f"free blocks  : {s['final_num_free_blocks']} of {res['num_free_blocks']} at the end",
    ])


def cmd_run(args: argparse.Namespace) -> int:
    """The main job: the engine with offload on the configured deployment; or the core-only
    simulation (``--core-only``, ``--save-trace``, layouts the offload manager rejects);
    or a trace replay (``--trace``)."""
    if args.trace:
        from kvplugin.replay import TraceError, load_trace, run_trace

        try:
            result = run_trace(load_trace(args.trace))
        except (TraceError, OSError, ValueError) as e:
            return _trace_error("run", args.trace, e)
        print(f"kvplugin: replayed {os.path.basename(args.trace)} on the allocation core")
        print(summarize(result))
        return 1 if result["summary"]["num_errors"] else 0

    from kvplugin.config import ConfigError, load_config
    from kvplugin.engine.config import RunConfig

    problem = _check_run_flags(args)
    if problem is not None:
        print(f"kvplugin run: {problem}", file=sys.stderr)
        return 2
    try:
        cfg = load_config(args.config, schema=RunConfig)
    except ConfigError as e:
        print(f"kvplugin run: {e}", file=sys.stderr)
        return 2
    overrides = {k: v for k, v in (("num_requests", args.requests), ("seed", args.seed))
                 if v is not None}
    cfg = cfg.model_copy(update={"workload": cfg.workload.model_copy(update=overrides)})
    if args.strict:
        cfg = cfg.model_copy(update={"offload": cfg.offload.model_copy(
            update={"require_tiers": True})})
    if args.realtime:
        cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(
            update={"deterministic": False})})
    source = (args.config or os.environ.get("KVPLUGIN_CONFIG_FILE")
              or "the embedded default config")
    if args.compare_no_offload and not cfg.offload.enabled:
        print("kvplugin run: --compare-no-offload needs a config with offload enabled",
              file=sys.stderr)
        return 2
    if args.core_only or args.save_trace:
        return _run_core(cfg, args, source)
    from kvplugin.config import unresolved_remote_url
    from kvplugin.engine.build import check_workload
    from kvplugin.layouts import engine_supports

    waiting = unresolved_remote_url(cfg.offload.remote_url) if cfg.offload.enabled else None
    if waiting is not None:
        print(f"kvplugin run: {source}: offload.remote_url is env:{waiting}, but {waiting} is "
              f"not set: set it to your Redis URL (or set KVPLUGIN_OFFLOAD__REMOTE_URL)",
              file=sys.stderr)
        return 2

    reason = engine_supports(cfg.layout, cfg.model)
    if reason is not None:
        print(f"kvplugin run: {reason}; running the core-only simulation", file=sys.stderr)
        return _run_core(cfg, args, source)
    try:
        check_workload(cfg, source)
    except ConfigError as e:
        print(f"kvplugin run: {e}", file=sys.stderr)
        return 2
    return _run_engine(cfg, args, source)


def _run_engine(cfg: RunConfig, args: argparse.Namespace, source: str) -> int:
    import asyncio

    from kvplugin.engine import interrupt
    from kvplugin.engine.progress import ProgressBar, wanted
    from kvplugin.engine.report import compare_table, comparison, verdict, verdict_line
    from kvplugin.engine.run import TierUnavailable, run_compare, run_engine

    show = wanted(args.progress, json=args.json, stream=sys.stderr)

    def bar(label: str) -> ProgressBar | None:
        return ProgressBar(sys.stderr, desc=label) if show else None

    port, linger = args.metrics_port, args.metrics_linger
    # The verdict compares with offload off on the same requests: a second, shorter run.
    compare = args.compare_no_offload or (cfg.offload.enabled and not args.no_verdict)
    try:
        if compare:
            on, off = run_compare(cfg, progress=bar, metrics_port=port,
                                  metrics_linger_s=linger, interruptible=True)
        else:
            on = run_engine(cfg, progress=bar("requests"), metrics_port=port,
                            metrics_linger_s=linger, interruptible=True)
            off = None
    except asyncio.CancelledError:  # a second SIGINT / SIGTERM: stopped at once
        intr = interrupt.current
        code = intr.exit_code if intr is not None else 130
        name = intr.by.name if intr is not None and intr.by is not None else "signal"
        print(f"kvplugin run: stopped at once ({name} twice); no summary", file=sys.stderr)
        return code
    except TierUnavailable as e:
        print(f"kvplugin run: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        if port is None or e.errno not in (errno.EADDRINUSE, errno.EACCES):
            raise
        print(f"kvplugin run: --metrics-port {port}: cannot listen on 127.0.0.1:{port} "
              f"({e.strerror}); pick another port, or 0 for any free one", file=sys.stderr)
        return 2
    found = None if off is None else verdict(on, off)
    if args.plot:
        from kvplugin.engine.plot import plot_runs

        head = f"{source}, seed {cfg.workload.seed}, {on.finished} requests"
        if found is not None:  # the verdict's figures, without its model-time clause
            head += "\n" + verdict_line(found).split(", model time")[0]
        plot_runs(args.plot, on, off, heading=head)
        print(f"kvplugin: wrote {args.plot}", file=sys.stderr)
    if args.json:
        out = on.as_dict()
        if off is not None and args.compare_no_offload:
            out["no_offload"] = off.as_dict()
            out["comparison"] = comparison(on, off)
        out["verdict"] = found
        print(json.dumps(out))
    else:
        tiers = on.extra["tiers"]
        print(f"kvplugin: served {source} on the async engine, "
              + (f"offload to {' + '.join(tiers)}" if tiers else "offload off"))
        print(on.table())
        if off is not None and args.compare_no_offload:
            print("\nthe same requests with offload off:")
            print(compare_table(on, off))
        print("\n" + (verdict_line(found) if found is not None else _no_verdict(cfg, args)))
    for rep in (on, off):
        for err in rep.ledger_errors() if rep is not None else ():
            print(f"kvplugin run: the token ledger does not add up: {err}", file=sys.stderr)
    stopped = on.extra.get("interrupted")
    if stopped is not None:
        print(f"kvplugin run: interrupted by {stopped}: the summary covers the "
              f"{on.finished} requests served"
              + (" (no comparison run)" if args.compare_no_offload else ""), file=sys.stderr)
        return 128 + int(getattr(signal, stopped))
    return 0 if on.ok() and (off is None or off.ok()) else 1


def _no_verdict(cfg: RunConfig, args: argparse.Namespace) -> str:
    if not cfg.offload.enabled:
        return "verdict: none: offload is off in this config (nothing to compare)"
    if args.no_verdict:
        return ("verdict: not asked (--no-verdict); drop it, or add --compare-no-offload for "
                "the side-by-side table")
    return "verdict: none: the run was interrupted before the comparison"


def cmd_validate_config(args: argparse.Namespace) -> int:
    """``kvplugin validate-config`` (:mod:`kvplugin.validate_cli`): each file loaded as
    ``kvplugin run`` loads it, the manager built over it, the workload's tenancy checked."""
    from kvplugin.config import CONFIG_FILE_ENV, ConfigError, load_config
    from kvplugin.engine.build import check_workload
    from kvplugin.engine.config import RunConfig
    from kvplugin.validate_cli import check_manager

    env = {} if args.no_env else {k: v for k, v in os.environ.items() if k != CONFIG_FILE_ENV}
    rc = 0
    for path in args.files:
        try:
            cfg = load_config(path, env, schema=RunConfig)
            check_manager(cfg, path)
            check_workload(cfg, path)
        except ConfigError as e:
            print(f"kvplugin validate-config: {e}", file=sys.stderr)
            rc = 2
            continue
        print(f"OK {path}")
    return rc


# Flags only the engine run has; the core-only simulation says it ignores them.
ENGINE_ONLY = ("compare_no_offload", "no_verdict", "plot", "metrics_port")


def _check_run_flags(args: argparse.Namespace) -> str | None:
    if args.requests is not None and args.requests < 1:
        return f"--requests must be >= 1, got {args.requests}"
    if args.metrics_port is not None and not 0 <= args.metrics_port <= 65535:
        return f"--metrics-port must be 0..65535, got {args.metrics_port}"
    if args.metrics_linger < 0:
        return f"--metrics-linger must be >= 0, got {args.metrics_linger}"
    if args.metrics_linger and args.metrics_port is None:
        return "--metrics-linger needs --metrics-port"
    if args.plot and not os.path.isdir(os.path.dirname(os.path.abspath(args.plot))):
        return f"--plot {args.plot}: no such directory"
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        # Checked before the run, not after it: matplotlib is an optional extra.
        return ("--plot needs matplotlib: pip install -e '.[plot]' (from a checkout) or "
                "pip install 'kvplugin[plot]'")
    return None


def _run_core(cfg: RunConfig, args: argparse.Namespace, source: str) -> int:
    from kvplugin.sim import Simulation

    ignored = [f"--{f.replace('_', '-')}" for f in ENGINE_ONLY if getattr(args, f)
               not in (None, False)]
    if ignored:
        print(f"kvplugin run: the core-only simulation ignores {', '.join(ignored)}",
              file=sys.stderr)
    sim = Simulation(cfg.layout.as_trace_config(), cfg.workload, cfg.limits)
    r = sim.run()
    if args.save_trace:
        with open(args.save_trace, "w") as f:
            json.dump(r.trace, f)
        print(f"kvplugin: wrote {args.save_trace} ({len(r.trace['ops'])} ops; replay it with "
              f"kvplugin replay {args.save_trace})", file=sys.stderr)
    rate = r.hit_tokens / r.prompt_tokens if r.prompt_tokens else 0.0
    res = sim.rep.describe()
    if args.json:
        print(json.dumps({"requests": r.requests, "prompt_tokens": r.prompt_tokens,
                          "hit_tokens": r.hit_tokens, "preemptions": r.preemptions,
                          "failed_allocations": r.failed_allocations, "steps": r.steps,
                          "free_blocks": r.final_free_blocks, "total_blocks": r.total_blocks}))
        return 0
    print(f"kvplugin: simulated {source} on the allocation core")
    print("\n".join([
        f"layout       : {res['coordinator']} {res['managers']} block sizes "
        f"{res['group_block_sizes']}, {r.total_blocks} usable blocks",
        f"requests     : {r.requests} ({r.prompt_tokens} prompt tokens) in {r.steps} steps",
        f"prefix hits  : {r.hit_tokens} tokens at admission ({rate:.1%} of prompt tokens)",
        f"allocations  : {r.failed_allocations} failed (no room), {r.preemptions} preemptions",
        f"free blocks  : {r.final_free_blocks} of {r.total_blocks} at the end",
    ]))
    return 0


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("kvplugin")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "(not installed)"


def build_parser() -> argparse.ArgumentParser:
    from kvplugin.validate_cli import add_parser as add_validate_parser

    ap = argparse.ArgumentParser(prog="kvplugin", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = ap.add_subparsers(dest="command", required=True)
    rp = sub.add_parser("replay", help="replay conformance traces on kvplugin's core")
    rp.add_argument("traces", nargs="+", help="trace JSON file(s)")
    rp.add_argument("-o", "--output", help="result file (single trace; default stdout)")
    rp.add_argument("--out-dir", help="write DIR/<trace-stem>.result.json per trace")
    rp.add_argument("--stop-on-error", action="store_true")
    rp.add_argument("--bench", type=int, metavar="N",
                    help="replay each trace N times and print ops/sec as JSON")
    rp.set_defaults(func=cmd_replay)
    run = sub.add_parser("run", help="run the main job (default: the embedded config)")
    run.add_argument("--config", help="deployment config (YAML / TOML / JSON)")
    run.add_argument("--trace", help="replay this trace instead of simulating")
    run.add_argument("--requests", type=int, help="override workload.num_requests")
    run.add_argument("--seed", type=int, help="override workload.seed")
    run.add_argument("--save-trace", metavar="OUT",
                     help="write the simulated calls as a conformance trace (core-only)")
    run.add_argument("--core-only", action="store_true",
                     help="simulate the scheduler on the allocation core alone (no engine, "
                          "no offload)")
    run.add_argument("--strict", action="store_true",
                     help="a tier that does not answer at start is an error (exit 2), not a "
                          "warning (offload.require_tiers)")
    run.add_argument("--realtime", action="store_true",
                     help="serve in real time: each I/O lands when it completes, so hits and "
                          "TTFT vary with this machine's timing (default: simulated time, "
                          "the same seed gives the same run; engine.deterministic)")
    run.add_argument("--json", action="store_true",
                     help="print the report as one JSON object (the last line)")
    run.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                     help="draw a progress bar on stderr (default: on a terminal, not with "
                          "--json)")
    run.add_argument("--compare-no-offload", action="store_true",
                     help="print the side-by-side table of the same requests served with "
                          "offload off (the verdict line always compares them)")
    run.add_argument("--no-verdict", action="store_true",
                     help="skip the comparison run behind the verdict line")
    run.add_argument("--plot", metavar="FILE.png",
                     help="plot the hit share by tier and the TTFT over time to FILE.png")
    run.add_argument("--metrics-port", type=int, metavar="N",
                     help="serve Prometheus metrics on 127.0.0.1:N during the run (0: any "
                          "free port)")
    run.add_argument("--metrics-linger", type=float, default=0.0, metavar="SECONDS",
                     help="keep serving metrics this long after the run (default 0)")
    run.set_defaults(func=cmd_run)
    add_validate_parser(sub).set_defaults(func=cmd_validate_config)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.command in ("replay", "run"):
        # A refused reset_prefix_cache is a recorded result of the trace, not news.
        logging.getLogger("kvplugin.core").setLevel(logging.ERROR)
    if getattr(args, "metrics_port", None) is not None:
        # Where to scrape (the port is chosen here when asked for 0).
        logging.getLogger("kvplugin.engine.run").setLevel(logging.INFO)
    try:
        rc: int = args.func(args)
        sys.stdout.flush()
    except KeyboardInterrupt:  # outside a run's own handling (starting, a replay, ...)
        print("kvplugin: interrupted", file=sys.stderr)
        return 128 + signal.SIGINT
    except BrokenPipeError:
        # `kvplugin run | head -1`: the reader left. Quietly, as a Unix tool on SIGPIPE
        # (stdout to /dev/null so the interpreter's own flush at exit does not fail too).
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 128 + 13
    return rc


if __name__ == "__main__":
    sys.exit(main())
