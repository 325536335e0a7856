"""docs/vllm.md's CPU command, as the page writes it: vLLM's OpenAI server with
``configs/vllm_disk.yaml``, started twice one after the other; the second server's
completion of the first one's prompt is served from the disk tier the first left behind.

The command is read from the page (the bash block that starts the api_server), with only
what the page leaves to the reader filled in: ``$PY`` (this interpreter, the engine venv),
``DIR`` (a tiny random model), the port (a free one), and the disk directory through the
environment override the page documents (``KVPLUGIN_OFFLOAD__LOCAL_DISK``), so that a run
never touches the machine's /tmp/kvplugin-vllm-disk."""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
PAGE = REPO / "docs" / "vllm.md"


def page_command() -> list[str]:
    """The api_server command of the page's CPU block, as argv (``$PY`` and ``DIR`` left)."""
    blocks = re.findall(r"```bash\n(.*?)```", PAGE.read_text(), re.S)
    block = next(b for b in blocks if "vllm.entrypoints.openai.api_server" in b)
    start = block.rindex("\n", 0, block.index("api_server")) + 1
    argv = shlex.split(block[start:].replace("\\\n", " "), comments=True)
    if argv[0].startswith("PYTHONPATH="):
        argv = argv[1:]
    return argv


def _server(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as out:
        return subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, cwd=REPO, env=env)


def wait_up(proc: subprocess.Popen[Any], base: str, log: Path) -> None:
    """Until the server at ``base`` answers /health (RuntimeError with its log's tail if it
    exits or takes over 300 s)."""
    deadline = time.monotonic() + 300
    while True:
        try:
            with urllib.request.urlopen(base + "/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve did not start (exit {proc.poll()}): "
                                   f"{log.read_text()[-3000:]}") from None
            time.sleep(1)


def _complete(base: str, model: str, tokens: list[int]) -> dict[str, Any]:
    body = {"model": model, "prompt": tokens, "max_tokens": 4, "temperature": 0.0,
            "ignore_eos": True, "return_token_ids": True}
    req = urllib.request.Request(base + "/v1/completions", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        out = json.load(r)
    details = (out.get("usage") or {}).get("prompt_tokens_details") or {}
    return {"tokens": out["choices"][0].get("token_ids"),
            "cached": details.get("cached_tokens") or 0}


def doc_scenario(workdir: Path, make_model: Any, free_port: Any) -> dict[str, Any]:
    model = workdir / "model-llama-doc"
    make_model("llama", model)
    disk = workdir / "doc-disk"
    env = {**os.environ, "PYTHONPATH": str(REPO), "KVPLUGIN_OFFLOAD__LOCAL_DISK": str(disk),
           "VLLM_LOGGING_LEVEL": "INFO"}  # vLLM's default: the page's user sees INFO lines
    prompt = [(7 * i + 3) % 500 + 1 for i in range(160)]  # one 128-token chunk (auto)
    runs = []
    for n in (1, 2):
        port = free_port()
        argv = [sys.executable if a == "$PY" else str(model) if a == "DIR" else
                str(port) if a == "8000" else a for a in page_command()]
        log = workdir / f"doc-serve-{n}.log"
        proc = _server(argv, env, log)
        base = f"http://127.0.0.1:{port}"
        try:
            wait_up(proc, base, log)
            runs.append(_complete(base, str(model), prompt))
        finally:
            proc.terminate()  # the page's --shutdown-timeout lets the last stores land
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        runs[-1]["exit"] = proc.returncode
        # kvplugin's lines land in vLLM's own log (its handlers, its format).
        runs[-1]["chunk_lines"] = [line.split("] ", 1)[-1] for line in
                                   log.read_text(errors="replace").splitlines()
                                   if "stored objects of" in line]
    files = sorted(p.name for p in disk.rglob("*.kvb"))
    return {"scenario": "doc", "command": page_command(), "runs": runs,
            "objects_on_disk": len(files)}
