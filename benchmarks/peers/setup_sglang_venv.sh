#!/usr/bin/env bash
# Builds the optional SGLang 0.5.23 peer venv that benchmarks/storage.py uses to measure SGLang's own L3 storage
# classes (HiCacheFile, MooncakeStore) on the same pages. The benchmark runs without it (those rows: not measured).
#
#   bash benchmarks/peers/setup_sglang_venv.sh [VENV_DIR]      (default: benchmarks/peers/.sglang-venv)
#
# SGLang is installed without its dependencies, plus what its storage modules import. Every pip step pins torch to
# the CPU build (a plain `pip install torchvision` silently replaces it with a CUDA torch); torchvision itself is not
# installed: sglang_cpu_shims.py (next to this script) keeps SGLang's import chain from needing it.
# Optional: TORCH_SPEC (default torch==2.13.0+cpu; where no configured index has it, set
# PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu), SGLANG_SPEC (sglang==0.5.23),
# MOONCAKE_SPEC (mooncake-transfer-engine-non-cuda==0.3.13.post1, the version tierkv's venv uses).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
VENV=${1:-$here/.sglang-venv}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0+cpu}
PY=${PY:-python3}
"$PY" -m venv "$VENV"
p="$VENV/bin/pip"
cons=$(mktemp)
trap 'rm -f "$cons"' EXIT
$p install -q --upgrade pip
$p install -q "$TORCH_SPEC" msgpack pyzmq numpy xxhash
"$VENV/bin/python" -c 'import torch; print(f"torch=={torch.__version__}")' > "$cons"
$p install -q --no-deps "${SGLANG_SPEC:-sglang==0.5.23}"
$p install -q -c "$cons" orjson psutil pybase64 requests triton packaging pillow starlette msgspec pydantic tqdm \
  IPython aiohttp "transformers==5.19.0" "apache-tvm-ffi==0.1.11" "sentencepiece==0.2.1" dill \
  "compressed-tensors==0.18.0" gguf "${MOONCAKE_SPEC:-mooncake-transfer-engine-non-cuda==0.3.13.post1}"
"$VENV/bin/python" -c "import torch; assert '+cpu' in torch.__version__ or not torch.cuda.is_available(), torch.__version__"
(cd "$here" && "$VENV/bin/python" -c "import sglang_cpu_shims; \
from sglang.srt.mem_cache.hicache_storage import HiCacheFile; \
from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore; print('sglang peer venv ok')")
