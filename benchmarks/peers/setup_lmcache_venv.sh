#!/usr/bin/env bash
# Builds the LMCache 0.5.6 peer venv: the real LMCache multiprocess cache server that tierkv's `lmcache` L3 store
# (storage_backends/lmcache/store.py) talks to. Tests (tests/helpers/fixtures_lmcache.py) and benchmarks/storage.py start
# the server from this venv; tierkv's own venv never imports lmcache (the store speaks the wire protocol itself).
#
#   bash benchmarks/peers/setup_lmcache_venv.sh [VENV_DIR]      (default: benchmarks/peers/.lmcache-venv)
#
# Idempotent: a venv whose server module already imports is left alone. LMCache is installed without its
# dependencies (the full set pulls cupy, cuda-python, nvtx, cufile, transformers, google-cloud, ... that a CPU
# server never loads), plus the packages the server imports on CPU. Every pip step pins torch to the CPU build.
# Optional: TORCH_SPEC (default torch==2.13.0+cpu), LMCACHE_SPEC (default lmcache==0.5.6).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
VENV=${1:-$here/.lmcache-venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
PY=${PY:-python3}
check='import torch, lmcache.v1.multiprocess.server, blake3; assert "+cpu" in torch.__version__ or not torch.cuda.is_available()'
if [ -x "$VENV/bin/python" ] && "$VENV/bin/python" -c "$check" >/dev/null 2>&1; then
  echo "lmcache peer venv ok ($VENV, already built)"
  exit 0
fi
"$PY" -m venv "$VENV"
p="$VENV/bin/pip"
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
$p install -q --upgrade pip
$p install -q "$TORCH_SPEC"
"$VENV/bin/python" -c 'import torch; print(f"torch=={torch.__version__}")' > "$cons"
$p install -q --no-deps "${LMCACHE_SPEC:-lmcache==0.5.6}"
# what `python -m lmcache.v1.multiprocess.server` imports on a CPU machine (bounds as lmcache 0.5.6 declares them);
# numba: without it lmcache falls back to a CLI-only mode without device_ops; blake3: the server's token hasher.
$p install -q -c "$cons" py-cpuinfo psutil aiohttp requests "numpy<=2.2.6" sortedcontainers numba \
  "prometheus_client>=0.18.0,<=0.24.1" cachetools pyyaml cryptography msgspec "opentelemetry-api>=1.20.0,<=1.40.0" \
  "opentelemetry-sdk>=1.20.0" "opentelemetry-exporter-otlp>=1.20.0" "opentelemetry-exporter-prometheus>=0.50b0,<=0.61b0" \
  "pyzmq>=25.0.0" httpx blake3
LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 "$VENV/bin/python" -c "$check"
echo "lmcache peer venv ok ($VENV)"
