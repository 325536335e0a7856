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
  # torchvision: only SGLang's multimodal configs import it (never a storage backend), and
  # no torchvision release imports beside torch 2.13.0+cpu, so a stub stands in: importing
  # it works, using anything from it raises.
  SITE="$("$PY" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
  rm -rf "$SITE/torchvision"
  mkdir -p "$SITE/torchvision"
  cat > "$SITE/torchvision/__init__.py" <<'PYEOF'
"""A stub (kvplugin's SGLang side venv): every torchvision.* module imports, anything
used from one raises. Only SGLang's multimodal configs and transformers' image utilities
import torchvision, never a storage backend."""
import enum
import importlib.abc
import importlib.machinery
import sys
import types

__version__ = "0.0.0+kvplugin.stub"


class InterpolationMode(enum.Enum):
    NEAREST = "nearest"
    NEAREST_EXACT = "nearest-exact"
    BILINEAR = "bilinear"
    BICUBIC = "bicubic"
    BOX = "box"
    HAMMING = "hamming"
    LANCZOS = "lanczos"


class ImageReadMode(enum.Enum):
    UNCHANGED = 0
    RGB = 3


class _Unavailable:
    def __init__(self, *args, **kwargs):
        raise RuntimeError("torchvision is a stub in kvplugin's SGLang side venv")


def _attr(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return {"InterpolationMode": InterpolationMode,
            "ImageReadMode": ImageReadMode}.get(name, _Unavailable)


__getattr__ = _attr


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = types.ModuleType(spec.name)
        mod.__path__ = []
        mod.__getattr__ = _attr
        return mod

    def exec_module(self, module):
        return None


sys.meta_path.append(_Finder())
PYEOF
  # kvplugin's runtime dependencies (pyproject's list).
  "${PIP[@]}" -c "$CONSTRAINTS" "pyarrow>=15" "xxhash>=3.4" "blake3>=1.0" "redis>=5.0" \
    "aiofiles>=23.2" cbor2 pyyaml prometheus-client >&2
  echo "sglang side venv built in $(( $(date +%s) - start )) s, $(du -sh "$VENV" | cut -f1)" >&2
fi
PYTHONPATH="$REPO" "$PY" -c "$CHECK; import kvplugin.integrations.sglang" >&2
echo "$PY"
