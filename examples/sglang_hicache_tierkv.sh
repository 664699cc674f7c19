#!/usr/bin/env bash
# SGLang HiCache with a tierkv store as its L3 (docs/architecture.md §10, README "Using it with SGLang").
#
#   examples/sglang_hicache_tierkv.sh file|zmq|mooncake|lmcache        (MODEL=... to serve another model)
#
# Needs a GPU machine with SGLang 0.5.23 and tierkv installed (pip install -e ".[sglang]" next to SGLang). SGLang
# loads tierkv's backend with `--hicache-storage-backend dynamic`; the extra config names the class and carries the
# tierkv `l3` section (the same keys as in a tierkv YAML config, configs/l3_*.yaml). "interface_v1": 1 selects the
# zero-copy path (pages read into / written from SGLang's host pool directly); 0 the copy path. Both store the
# same records. Every TP rank opens its own client; pages of another model, dtype, layout, page size or TP rank
# never match. tests/connector/sglang/test_sglang_server_args.py parses each launch line below with SGLang's own parser.
set -euo pipefail
backend=${1:?usage: $0 file|zmq|mooncake|lmcache}
MODEL=${MODEL:-Qwen/Qwen3-8B}

case $backend in
file)
  # pages in a directory (local disk or a shared file system); survives restarts
  python -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --page-size 64 \
    --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "tierkv", "module_path": "tierkv.connector.sglang.hicache", "class_name": "TierKVHiCacheStorage", "interface_v1": 1, "l3": {"backend": "file", "file": {"root": "/var/cache/tierkv-l3", "capacity_bytes": "200GiB"}}}'
  ;;
zmq)
  # one tierkv cache server shared by several engines (vLLM and SGLang alike); start it first
  tierkv server --host 127.0.0.1 --port 5557 --capacity-bytes 64GiB &
  python -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --page-size 64 \
    --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "tierkv", "module_path": "tierkv.connector.sglang.hicache", "class_name": "TierKVHiCacheStorage", "interface_v1": 1, "l3": {"backend": "zmq", "zmq": {"endpoint": "tcp://127.0.0.1:5557", "timeout_s": 1.0}}}'
  ;;
mooncake)
  # a Mooncake master (HTTP metadata server on); each rank contributes 4 GiB of store memory
  mooncake_master -rpc_port 50051 -rpc_address 127.0.0.1 -enable_http_metadata_server=true \
    -http_metadata_server_host 127.0.0.1 -http_metadata_server_port 8080 -metrics_host 127.0.0.1 &
  python -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --page-size 64 \
    --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "tierkv", "module_path": "tierkv.connector.sglang.hicache", "class_name": "TierKVHiCacheStorage", "interface_v1": 1, "l3": {"backend": "mooncake", "mooncake": {"master_address": "127.0.0.1:50051", "metadata_server": "http://127.0.0.1:8080/metadata", "protocol": "tcp", "global_segment_size": "4GiB", "timeout_s": 1.0}}}'
  ;;
lmcache)
  # LMCache's cache server (its own venv: benchmarks/peers/setup_lmcache_venv.sh); --chunk-size = SGLang's --page-size
  # = l3.lmcache.page_tokens; tierkv talks to it through its shared-memory segment (--shm-name). Usage reports and
  # the 0.0.0.0 Prometheus exporter off, as in configs/l3_lmcache.yaml.
  LMCACHE_TRACK_USAGE=false DO_NOT_TRACK=1 "${LMCACHE_PYTHON:-benchmarks/peers/.lmcache-venv/bin/python}" \
    -m lmcache.v1.multiprocess.server --host 127.0.0.1 --port 5555 --chunk-size 64 --l1-size-gb 64 \
    --supported-transfer-mode engine_driven --shm-name tierkv-sglang --disable-observability &
  python -m sglang.launch_server --model-path "$MODEL" --host 127.0.0.1 --page-size 64 \
    --enable-hierarchical-cache --hicache-ratio 2 --hicache-mem-layout page_first \
    --hicache-storage-backend dynamic \
    --hicache-storage-backend-extra-config '{"backend_name": "tierkv", "module_path": "tierkv.connector.sglang.hicache", "class_name": "TierKVHiCacheStorage", "interface_v1": 1, "l3": {"backend": "lmcache", "lmcache": {"endpoint": "tcp://127.0.0.1:5555", "page_tokens": 64, "timeout_s": 1.0}}}'
  ;;
*)
  echo "unknown backend '$backend': use file, zmq, mooncake or lmcache" >&2
  exit 2
  ;;
esac
