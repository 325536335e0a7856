#!/usr/bin/env bash
# Side virtualenv for kvplugin's vLLM integration tests: vLLM 0.33.0 + CPU torch (built by
# ../shared/vllm/setup-vllm-cpu.sh), plus kvplugin's own runtime dependencies, so that the
# side venv's python imports this checkout's kvplugin through PYTHONPATH. kvplugin itself is
# NOT installed there (no `pip install -e`): the tests pick the checkout up via PYTHONPATH, and
# installing with deps could move vLLM's pins. Idempotent; prints the venv's python last.
#
#   PY=$(bash tools/setup_vllm_side_venv.sh)
set -euo pipefail
REPO="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
SHARED="${KVPLUGIN_SHARED_DIR:-$REPO/../shared}"
PY="$(bash "$SHARED/vllm/setup-vllm-cpu.sh" | tail -n 1)"
# kvplugin's runtime deps that vLLM's venv does not already bring (pyproject's list).
DEPS=(pyarrow xxhash blake3 redis aiofiles cbor2 pydantic pyyaml prometheus-client numpy tqdm)
if ! "$PY" -c "import pyarrow, xxhash, blake3, redis, aiofiles, cbor2, pydantic, yaml, \
prometheus_client, numpy, tqdm" 2>/dev/null; then
  # Only what is missing; never upgrade what vLLM pinned (numpy, pydantic, ...).
  "$PY" -m pip install -q --disable-pip-version-check "pyarrow>=15" "xxhash>=3.4" \
    "blake3>=1.0" "redis>=5.0" "aiofiles>=23.2" >&2
fi
PYTHONPATH="$REPO" "$PY" -c "import kvplugin.plugin, kvplugin.integrations.vllm, vllm" >&2
echo "$PY"
