"""SGLang 0.5.23's own L3 storage classes on the pages benchmarks/storage.py uses; run in the SGLang peer venv
(``benchmarks/peers/setup_sglang_venv.sh``) by storage.py, never imported by tierkv.

Input: one JSON object as argv[1]: ``page_bytes``, ``batch``, ``reps``, ``file_dir`` (a fresh directory on the
same disk as tierkv's file store), ``master``/``metadata`` (a running mooncake_master whose segment lives in another
process, or null to skip Mooncake). Output: one JSON object on the last stdout line:
``{"hicache_file": {"set": [s, ...], "get": [s, ...]}, "mooncake": {"set": [...], "get": [...]}}`` (seconds per
batch) plus ``"errors"``.

The classes are driven the way SGLang's HiCacheController drives them: ``HiCacheFile.batch_set(keys, [tensor])`` /
``batch_get(keys, [dst tensor])`` (one ``.bin`` per page, temp file + rename, no fsync, no checksum), and
``MooncakeStore`` zero-copy ``batch_set(keys, None, ptrs, sizes)`` / ``batch_get(keys, ptrs, sizes)`` on a
registered host buffer, each page as its K and V halves (two objects, the MHA key scheme of ``batch_set_v1``).
Pages read back are compared with what was written (outside the timed region).
"""
from __future__ import annotations

import json
import os
import sys
import time

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
import sglang_cpu_shims  # noqa: E402,F401  (run as a script: its folder is first on the path; before any sglang import)

import numpy as np  # noqa: E402
import torch  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import HiCacheFile, HiCacheStorageConfig  # noqa: E402


def config(extra=None) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                                is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=True,
                                model_name="tierkv-bench/peer", extra_config=extra or {})


def keys_for(tag: str, n: int) -> list[str]:
    rng = np.random.default_rng(abs(hash(tag)) % (1 << 32))
    return [rng.bytes(32).hex() for _ in range(n)]


def main() -> int:
    a = json.loads(sys.argv[1])
    pb, n, reps = a["page_bytes"], a["batch"], a["reps"]
    src = torch.from_numpy(np.frombuffer(np.random.default_rng(7).bytes(n * pb), dtype=np.uint8).copy()).view(n, pb)
    out: dict = {"errors": []}

    store = HiCacheFile(config(), file_path=a["file_dir"])
    res = out["hicache_file"] = {"set": [], "get": []}
    for r in range(reps):
        ks = keys_for(f"f{r}{time.time_ns()}", n)
        t = time.perf_counter(); ok = store.batch_set(ks, [src[i] for i in range(n)]); res["set"].append(time.perf_counter() - t)
        dst = [torch.empty(pb, dtype=torch.uint8) for _ in range(n)]
        t = time.perf_counter(); got = store.batch_get(ks, dst); res["get"].append(time.perf_counter() - t)
        if ok is not True or any(g is None or not torch.equal(g, src[i]) for i, g in enumerate(got)):
            out["errors"].append(f"hicache_file rep {r}: set {ok}, get mismatch")
        store.clear()

    if a.get("master"):
        from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore

        mc = MooncakeStore(config({"master_server_address": a["master"], "metadata_server": a["metadata"],
                                   "protocol": "tcp", "device_name": "", "local_hostname": "127.0.0.1",
                                   "global_segment_size": "0", "check_server": False}))
        flat = src.reshape(-1)
        dst = torch.zeros_like(flat)
        mc.register_buffer(flat)
        mc.register_buffer(dst)
        half = pb // 2
        res = out["mooncake"] = {"set": [], "get": []}
        for r in range(reps):
            kv, sp, dp, sz = [], [], [], []
            for i, k in enumerate(mc._tag_keys(keys_for(f"m{r}{time.time_ns()}", n))):
                for j, s in enumerate(("k", "v")):
                    kv.append(f"{k}_{mc.mha_suffix}_{s}")
                    sp.append(flat.data_ptr() + i * pb + j * half)
                    dp.append(dst.data_ptr() + i * pb + j * half)
                    sz.append(half)
            t = time.perf_counter(); ok = mc.batch_set(kv, None, sp, sz); res["set"].append(time.perf_counter() - t)
            dst.zero_()
            t = time.perf_counter(); got = mc.batch_get(kv, dp, sz); res["get"].append(time.perf_counter() - t)
            if not torch.equal(dst, flat):
                out["errors"].append(f"mooncake rep {r}: set {ok}, get {got}, bytes differ")
            mc.store.batch_remove(kv, True)
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
