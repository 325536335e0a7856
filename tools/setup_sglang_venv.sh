#!/usr/bin/env bash
# Side virtualenv for kvplugin's SGLang HiCache tests: sglang 0.5.23 (the newest release; a
# cp311 wheel) on this machine's CPU torch 2.13.0, with only what SGLang's storage modules
# (hicache_storage, storage/backend_factory, memory_pool_host) need to import: sglang itself
# is installed without its dependencies (its pins ask for CUDA torch 2.14.1, flashinfer,
# deep-gemm, ... several GB that a storage backend never touches), torch stays 2.13.0+cpu
# (constrained). kvplugin is NOT installed there: the tests put this checkout on PYTHONPATH.
# Built once, cached under ~/.cache/kvplugin-sglang (override: KVPLUGIN_SGLANG_VENV).
# Idempotent; prints the venv's python last.
#
#   PY=$(bash tools/setup_sglang_venv.sh)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${KVPLUGIN_SGLANG_VENV:-$HOME/.cache/kvplugin-sglang}"
PY="$VENV/bin/python"
SGLANG="sglang==0.5.23"
CHECK="import sglang.srt.mem_cache.hicache_storage, sglang.srt.mem_cache.storage.backend_factory, \
sglang.srt.mem_cache.memory_pool_host, pyarrow, xxhash, blake3, redis, aiofiles, cbor2, yaml, \
prometheus_client"
if ! "$PY" -c "$CHECK" >/dev/null 2>&1; then
  start=$(date +%s)
  python3 -m venv "$VENV"
  PIP=("$PY" -m pip install -q --disable-pip-version-check)
  CONSTRAINTS="$VENV/constraints.txt"
  echo "torch==2.13.0" > "$CONSTRAINTS"
  "${PIP[@]}" "torch==2.13.0" numpy >&2
  "${PIP[@]}" --no-deps "$SGLANG" >&2
  # What sglang's package and storage modules import (found by importing them), at its pins.
  "${PIP[@]}" -c "$CONSTRAINTS" orjson psutil pybase64 requests packaging pillow starlette \
    msgspec pydantic pyzmq tqdm ipython aiohttp "transformers==5.19.0" dill \
    "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" "compressed-tensors==0.18.0" gguf triton >&2
  # kvplugin's runtime dependencies (pyproject's list).
  "${PIP[@]}" -c "$CONSTRAINTS" "pyarrow>=15" "xxhash>=3.4" "blake3>=1.0" "redis>=5.0" \
    "aiofiles>=23.2" cbor2 pyyaml prometheus-client >&2
  echo "sglang side venv built in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
fi
PYTHONPATH="$REPO" "$PY" -c "$CHECK; import kvplugin.integrations.sglang" >&2
echo "$PY"
