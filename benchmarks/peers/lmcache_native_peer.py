"""LMCache's own worker-side client on a CPU machine, timed on the same batches as benchmarks/storage_lmcache.py.

Runs in the LMCache venv (benchmarks/peers/setup_lmcache_venv.sh), against a running LMCache multiprocess server
given on the command line. It uses LMCache's engine-driven transfer context (``create_transfer_context``, the path
LMCache's vLLM integration takes for CPU KV caches): pages are blocks of a vLLM-shaped CPU KV cache per layer, one
block per chunk; a set is ``submit_store`` of 64 blocks, a get is ``lookup`` + ``wait_prefetch_status`` +
``submit_retrieve`` into other blocks, checked byte for byte after the timed call.

    <lmcache venv>/bin/python benchmarks/peers/lmcache_native_peer.py '{"endpoint": "tcp://127.0.0.1:5555",
        "chunk_tokens": 16, "batch": 64, "reps": 8, "layers": 4, "heads": 8, "head_dim": 128}'

Prints one JSON line: {"set": [seconds per batch], "get": [...], "page_bytes": ..., "errors": [...]}.
"""
from __future__ import annotations

import json
import os
import random
import sys
import time
import uuid

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch  # noqa: E402
from lmcache.v1.multiprocess.custom_types import IPCCacheServerKey  # noqa: E402
from lmcache.v1.multiprocess.transfer_context.worker_transfer import create_transfer_context  # noqa: E402
from lmcache.v1.multiprocess.transport.zmq_impl import create_request_client  # noqa: E402


def main() -> int:
    a = json.loads(sys.argv[1])
    C, B, L, H, D = a["chunk_tokens"], a["batch"], a["layers"], a["heads"], a["head_dim"]
    reps = a["reps"]
    blocks = 2 * B
    # vLLM's CPU KV cache per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_size], fp16
    kv = {f"model.layers.{i}.self_attn.attn": torch.zeros(2, blocks, C, H, D, dtype=torch.float16) for i in range(L)}
    page_bytes = 2 * L * C * H * D * 2
    client = create_request_client(a["endpoint"])
    inst = random.getrandbits(62)
    model = f"native-{uuid.uuid4().hex[:8]}"
    ctx = create_transfer_context(kv, instance_id=inst, req_client=client, mode="engine_driven")
    ctx.register(kv, model, 1, 1, 30.0)
    src_ids, dst_ids = list(range(B)), list(range(B, 2 * B))
    gen = torch.Generator().manual_seed(0)
    times = {"set": [], "get": [], "errors": []}
    try:
        for r in range(reps):
            for t in kv.values():
                t[:, :B].copy_(torch.randn(t[:, :B].shape, generator=gen, dtype=torch.float32).half())
                t[:, B:].zero_()
            tokens = tuple(random.randrange(150_000) for _ in range(B * C))
            rid = f"set-{uuid.uuid4().hex}"
            key = IPCCacheServerKey(model_name=model, world_size=1, worker_id=0, token_ids=tokens, start=0,
                                    end=B * C, request_id=rid)
            t0 = time.perf_counter()
            ok = ctx.submit_store(rid, key, kv, [src_ids], None, 1).result(timeout=30)
            times["set"].append(time.perf_counter() - t0)
            client.end_session(rid).result(timeout=30)
            if not ok:
                times["errors"].append(f"store {r} failed")
            rid = f"get-{uuid.uuid4().hex}"
            lkey = IPCCacheServerKey(model_name=model, world_size=1, worker_id=None, token_ids=tokens, start=0,
                                     end=B * C, request_id=rid, num_kv_readers=1)
            rkey = IPCCacheServerKey(model_name=model, world_size=1, worker_id=0, token_ids=tokens, start=0,
                                     end=B * C, request_id=rid)
            t0 = time.perf_counter()
            client.lookup(lkey, 1).result(timeout=30)
            n = client.wait_prefetch_status(rid, 30.0).result(timeout=35)
            ok = n == B and ctx.submit_retrieve(rid, rkey, kv, [dst_ids], None, 1).result(timeout=30)
            times["get"].append(time.perf_counter() - t0)
            client.end_session(rid).result(timeout=30)
            same = all(torch.equal(t[:, :B], t[:, B:]) for t in kv.values())
            if not ok or not same:
                times["errors"].append(f"retrieve {r}: hits {n}, ok {ok}, identical {same}")
            client.clear(False).result(timeout=30)
    finally:
        try:
            ctx.unregister()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    print(json.dumps({**times, "page_bytes": page_bytes}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
