"""tierkv's stores through SGLang's HiCache interface next to SGLang 0.5.23's own storage classes, on the same pages
of SGLang's own host pool, in one run (docs/architecture.md §10).

Rows (per page size, batches of 64 pages, each batch new keys), every call made the way SGLang's
``HiCacheController`` makes it, including its host-pool work:

| tierkv row | SGLang reference (same loop, alternating order) |
|---|---|
| file, copy path: ``batch_set(keys, [get_data_page(i)])`` / ``batch_get`` + ``set_from_flat_data_page`` | ``HiCacheFile`` on the same path (SGLang's file backend only has this path) |
| file, v1 path: ``batch_set_v1`` / ``batch_get_v1`` over host indices (one record per page: staged) | ``HiCacheFile`` copy path |
| mooncake, copy path and v1 path (K and V records read / written in place in the host pool: zero-copy) | SGLang's ``MooncakeStore`` ``batch_set_v1`` / ``batch_get_v1`` (its only path; host pool registered) |
| zmq, copy path and v1 path (zero-copy, as Mooncake) | none (SGLang has no ZMQ cache-server backend) |

tierkv verifies every record's header and XXH3-64 checksum on every get and computes the checksum on every set
(SGLang's classes check neither); every batch read back is compared with the pages written (untimed). The target is
tierkv >= SGLang's class on every row (ratio >= 100 %). The file rows: warm page cache, no fsync, on both sides.
Mooncake: the segment lives in another process (``storage.MooncakeRig``), TCP transport, both clients mount 0 B.

The host pool is SGLang's ``MHATokenToKVPoolHost`` (layout ``page_first``, bfloat16, 8 layers, 64 tokens per
page; 1 KV head of 128 for 256 KiB pages, 8 heads for 2 MiB).

Run through ``benchmarks/storage.py`` (``--backends ...,sglang``; rows appended to its table and JSON), or alone:

    .venv/bin/python -m benchmarks.storage_sglang [--pages 256K,2M] [--reps N] [--backends file,zmq,mooncake]

Torch intra-op threads: 1 (``--torch-threads``), as in an SGLang GPU server, whose model runner calls
``torch.set_num_threads(1)`` in the scheduler process that also runs the HiCache controller (SGLang 0.5.23,
``ModelRunner.load_model``). With torch's default (one OpenMP thread per core) the OpenMP barriers of SGLang's own
host-pool copies (``get_data_page``, ``get_dummy_flat_data_page``, ``set_from_flat_data_page``: the copy-path
rows) spin against the Mooncake transfer threads; on 2 loaded cores they took 10-20x longer (profiled), which
timed SGLang's pool under contention rather than the stores.

``TIERKV_BENCH_MC_OPTS='{"zero_copy_min_page_bytes": 0}'`` adds ``l3.mooncake`` keys to tierkv's Mooncake client
(experiments; the committed rows use the defaults).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

from benchmarks.harness import REPO, load_file
from benchmarks.harness.results import code_state
from benchmarks.harness.servers import ZmqServer

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
ROOT = REPO

import torch  # noqa: E402

KiB, MiB = 1024, 1024 * 1024
BATCH = 64
TARGET = 1.0  # at least as fast as SGLang's own class
MC_OPTS: dict = json.loads(os.environ.get("TIERKV_BENCH_MC_OPTS", "{}"))  # extra l3.mooncake keys (experiments)


def sgl_helpers():
    """``tests/helpers/sgl.py`` as a module: SGLang's host pools and the tierkv adapter built as its tests build
    them (it imports ``benchmarks/peers/sglang_cpu_shims.py`` first)."""
    return load_file("tierkv_sgl_helpers", REPO / "tests" / "helpers" / "sgl.py")


def _geometry(pb: int) -> dict:
    layers, ps, hd = 8, 64, 128
    heads = pb // (2 * layers * ps * hd * 2)
    if heads < 1 or 2 * layers * ps * heads * hd * 2 != pb:
        raise ValueError(f"page of {pb} bytes does not fit 8 layers x 64 tokens x heads x 128 x bf16 x (K, V)")
    return {"layers": layers, "heads": heads, "head_dim": hd, "page_size": ps, "pages": BATCH}


def _keys(tag: str) -> list[str]:
    return [hashlib.sha256(f"{tag}/{time.time_ns()}/{i}".encode()).hexdigest() for i in range(BATCH)]


class _Series:
    def __init__(self):
        self.t: list[float] = []

    def summary(self, nbytes: int) -> dict:
        import statistics

        import numpy as np

        if not self.t:
            return {"mbps": None, "p50_ms": None, "p99_ms": None, "batches": 0, "t_ms": []}
        p50 = statistics.median(self.t)
        return {"mbps": round(nbytes / p50 / 1e6, 1), "p50_ms": round(p50 * 1e3, 2),
                "p99_ms": round(float(np.percentile(self.t, 99)) * 1e3, 2), "batches": len(self.t),
                "t_ms": [round(x * 1e3, 3) for x in self.t]}


class _Driver:
    """One backend driven as SGLang's controller drives it: ``copy`` (``_generic_page_set/_get``: flat pages,
    then ``set_from_flat_data_page``) or ``v1`` (``_page_set/_get_zero_copy``: host indices)."""

    def __init__(self, name: str, backend, src_pool, dst_pool, path: str):
        self.name, self.b, self.src, self.dst, self.path = name, backend, src_pool, dst_pool, path
        self.idx = torch.arange(BATCH * src_pool.page_size, dtype=torch.int64)

    def set(self, keys: list[str]) -> bool:
        if self.path == "v1":
            return all(self.b.batch_set_v1(keys, self.idx))
        ps = self.src.page_size
        return self.b.batch_set(keys, [self.src.get_data_page(i * ps) for i in range(len(keys))]) is True

    def get(self, keys: list[str]) -> int:
        if self.path == "v1":
            res = self.b.batch_get_v1(keys, self.idx)
            return next((i for i, r in enumerate(res) if not r), len(res))
        ps = self.dst.page_size
        pages = self.b.batch_get(keys, [self.dst.get_dummy_flat_data_page() for _ in keys])
        n = 0
        for i, p in enumerate(pages):
            if p is None:
                break
            self.dst.set_from_flat_data_page(i * ps, p)
            n += 1
        return n


def _pools(pb: int):
    _sgl = sgl_helpers()

    g = _geometry(pb)
    mk = lambda: _sgl.mha_pool("page_first", layers=g["layers"], heads=g["heads"], head_dim=g["head_dim"],  # noqa: E731
                               page_size=g["page_size"], pages=g["pages"])
    src = mk()
    _sgl.fill_pages(src, BATCH, seed=pb)
    return src, mk


def _same(src, dst) -> bool:
    ps = src.page_size
    u8 = lambda pool: pool.kv_buffer[:, : BATCH * ps].contiguous().view(torch.uint8)  # noqa: E731 (bytes: NaN != NaN)
    return torch.equal(u8(src), u8(dst))


def bench(pb: int, reps: int, base_dir: str, backends: list[str], rig=None, torch_threads: int = 1) -> dict:
    """Per-batch seconds for every (driver, op) of page size ``pb`` bytes. ``rig``: a running
    ``storage.MooncakeRig`` (master + segment holder), needed for the Mooncake rows. ``torch_threads``: torch
    intra-op threads while it runs (1: as SGLang's GPU server process, see the module docstring; 0: unchanged);
    restored on return."""
    prev_threads = torch.get_num_threads()
    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    try:
        return _bench(pb, reps, base_dir, backends, rig)
    finally:
        torch.set_num_threads(prev_threads)


def _bench(pb: int, reps: int, base_dir: str, backends: list[str], rig) -> dict:
    _sgl = sgl_helpers()
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    src, mk = _pools(pb)
    dst = mk()
    nbytes = BATCH * pb
    out: dict = {"page_bytes": pb, "batch": BATCH, "reps": reps, "errors": [], "torch_threads": torch.get_num_threads()}
    closers: list[Callable[[], None]] = []

    def tierkv(l3: dict, path: str, name: str) -> _Driver:
        b = _sgl.attach(_sgl.extra_config(l3, interface_v1=int(path == "v1")), dst)
        closers.append(b.close)
        return _Driver(name, b, src, dst, path)

    def adapter_for_src(drv: _Driver) -> _Driver:
        # sets read the source pool, gets fill the destination pool: the v1 set needs its own registration on src
        b = _sgl.attach(_sgl.extra_config(drv.b.cfg.l3), src)
        closers.append(b.close)
        return _Driver(drv.name, b, src, dst, drv.path)

    groups: list[tuple[str, _Driver, list[tuple[_Driver, _Driver]]]] = []
    sproc = None
    try:
        if "file" in backends:
            d = tempfile.mkdtemp(prefix="sgl-file-", dir=base_dir)
            hf = HiCacheFile(_sgl.storage_config({}), file_path=d)
            ref = _Driver("sglang HiCacheFile (copy)", hf, src, dst, "copy")
            l3 = {"backend": "file", "file": {"root": tempfile.mkdtemp(prefix="tkv-file-", dir=base_dir)}}
            groups.append(("file", ref, [(tierkv(l3, "copy", "tierkv file (copy)"), None),
                                          (tierkv(l3, "v1", "tierkv file (v1)"), None)]))
        if "mooncake" in backends and rig is not None:
            from sglang.srt.mem_cache.storage.mooncake_store.mooncake_store import MooncakeStore as SglMooncake

            mc_extra = {"master_server_address": rig.master.master_address,
                        "metadata_server": rig.master.metadata_server, "protocol": "tcp", "device_name": "",
                        "local_hostname": "127.0.0.1", "global_segment_size": "0", "check_server": False}
            sm = SglMooncake(_sgl.storage_config(mc_extra), dst)
            sm.register_mem_pool_host(dst)
            sm_src = SglMooncake(_sgl.storage_config(mc_extra), src)
            sm_src.register_mem_pool_host(src)
            closers += [sm.store.close, sm_src.store.close]
            ref = _Driver("sglang MooncakeStore (v1)", sm, src, dst, "v1")
            ref.setter = _Driver(ref.name, sm_src, src, dst, "v1")
            l3 = {"backend": "mooncake", "mooncake": {"master_address": rig.master.master_address,
                                                      "metadata_server": rig.master.metadata_server,
                                                      "protocol": "tcp", "local_hostname": "127.0.0.1",
                                                      "global_segment_size": 0, "timeout_s": 30.0,
                                                      **MC_OPTS}}
            groups.append(("mooncake", ref, [(tierkv(l3, "copy", "tierkv mooncake (copy)"), None),
                                              (tierkv(l3, "v1", "tierkv mooncake (v1)"), None)]))
        if "zmq" in backends:
            cap = 4 * BATCH * (pb + 4096) + (64 << 20)
            sproc = ZmqServer(capacity=cap)
            l3 = {"backend": "zmq", "zmq": {"endpoint": sproc.endpoint, "timeout_s": 30.0}}
            groups.append(("zmq", None, [(tierkv(l3, "copy", "tierkv zmq (copy)"), None),
                                         (tierkv(l3, "v1", "tierkv zmq (v1)"), None)]))
        # writers: v1 sets read the source pool, so each v1 driver gets a twin attached to src
        for _, ref, pairs in groups:
            for i, (drv, _w) in enumerate(pairs):
                pairs[i] = (drv, adapter_for_src(drv) if drv.path == "v1" else drv)

        series = {}
        for backend, ref, pairs in groups:
            for drv, _w in pairs:  # the reference is timed next to each tierkv driver: its own series per pair
                for op in ("set", "get"):
                    series[(drv.name, op)] = _Series()
                    if ref is not None:
                        series[(f"{ref.name}#{drv.name}", op)] = _Series()
        for r in range(-1, reps):  # r = -1: one untimed warm-up round (first-touch page faults, directories)
            for backend, ref, pairs in groups:
                for drv, writer in pairs:
                    sides = [(drv, writer)] + ([(ref, getattr(ref, "setter", ref))] if ref is not None else [])
                    if r % 2:
                        sides.reverse()
                    for reader, w in sides:
                        sname = reader.name if reader is drv else f"{ref.name}#{drv.name}"
                        ks = _keys(reader.name)
                        t = time.perf_counter()
                        ok = w.set(ks)
                        t_set = time.perf_counter() - t
                        dst.kv_buffer.zero_()
                        t = time.perf_counter()
                        n = reader.get(ks)
                        t_get = time.perf_counter() - t
                        if r >= 0:
                            series[(sname, "set")].t.append(t_set)
                            series[(sname, "get")].t.append(t_get)
                        if not ok or n != BATCH or not _same(src, dst):
                            st = w.b.stats().get("store", {}) if hasattr(w.b, "stats") else {}
                            out["errors"].append(f"{reader.name} rep {r}: set {ok}, got {n}/{BATCH}, "
                                                 f"bytes equal {_same(src, dst)}; writer store stats {st}")
                        if backend == "mooncake":  # forced removal of every object (reads hold leases)
                            rig.raw.remove_by_regex(".*", True)
                        else:
                            reader.b.clear()
        out["series"] = {f"{k[0]}|{k[1]}": s.summary(nbytes) for k, s in series.items()}
        out["groups"] = [(b, ref.name if ref else None, [d.name for d, _ in pairs]) for b, ref, pairs in groups]
    finally:
        for c in closers:
            try:
                c()
            except Exception as e:  # noqa: BLE001
                out["errors"].append(f"close: {e}")
        if sproc is not None:
            sproc.stop()
    return out


def rows(res: dict) -> list[dict]:
    """Rows in ``benchmarks/storage.py``'s schema: reference = SGLang's class, target = 100 % of it."""
    pb, S = res["page_bytes"], res.get("series", {})
    out = []
    for backend, ref, names in res.get("groups", []):
        for name in names:
            for op in ("set", "get"):
                ours, sgl = S.get(f"{name}|{op}"), S.get(f"{ref}#{name}|{op}") if ref else None
                if not ours or ours["mbps"] is None:
                    continue
                ratio = ours["mbps"] / sgl["mbps"] if sgl and sgl.get("mbps") else None
                pr = None
                if sgl and len(sgl["t_ms"]) == len(ours["t_ms"]):
                    import statistics

                    pr = statistics.median(b / a for a, b in zip(ours["t_ms"], sgl["t_ms"]) if a > 0)
                path = "v1 path" if name.endswith("(v1)") else "copy path"
                out.append({"backend": f"{backend} via SGLang", "page_bytes": pb, "batch": BATCH,
                            "op": f"{op} ({path})", **{k: v for k, v in ours.items() if k != "t_ms"},
                            "reference": ref or "none (SGLang has no ZMQ backend)",
                            "ref_mbps": sgl["mbps"] if sgl else None, "ref_p50_ms": sgl["p50_ms"] if sgl else None,
                            "ratio": round(ratio, 3) if ratio is not None else None,
                            "paired_ratio": round(pr, 3) if pr is not None else None,
                            "target": TARGET if sgl else 0.0, "meets_target": ratio is None or ratio >= TARGET,
                            "sglang_mbps": sgl["mbps"] if sgl else None,
                            "vs_sglang": round(ratio, 3) if ratio is not None else None,
                            "conditions": f"SGLang MHATokenToKVPoolHost page_first bf16; torch intra-op threads "
                                          f"{res.get('torch_threads', '?')}; tierkv verifies every "
                                          "checksum on get and hashes every page on set; "
                                          + ("warm page cache, no fsync" if backend == "file" else
                                             "segment in another process, TCP" if backend == "mooncake" else
                                             "tierkv server process on 127.0.0.1")})
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="file,zmq,mooncake")
    ap.add_argument("--pages", default="256K,2M")
    ap.add_argument("--reps", type=int, default=None, help="batches per driver (default 10 for 256 KiB, 5 for 2 MiB)")
    ap.add_argument("--dir", default=str(ROOT / ".cache" / "storage-bench"))
    ap.add_argument("--out", default=str(Path(tempfile.gettempdir()) / "storage_sglang.json"))
    ap.add_argument("--torch-threads", type=int, default=1,
                    help="torch intra-op threads (default 1, as SGLang's GPU server process; 0 keeps torch's default)")
    a = ap.parse_args(argv)
    from benchmarks import storage  # MooncakeRig, table printer

    backends = a.backends.split(",")
    sizes = [{"256K": 256 * KiB, "2M": 2 * MiB}[s] for s in a.pages.split(",")]
    rig = storage.MooncakeRig(segment=max(sizes) * BATCH * 4 + 64 * MiB) if "mooncake" in backends else None
    os.makedirs(a.dir, exist_ok=True)
    t0 = time.time()
    with open("/proc/loadavg") as f:
        load0 = f.read().split()[:3]
    all_rows, raw = [], {}
    try:
        for pb in sizes:
            base = tempfile.mkdtemp(prefix=f"sgl-p{pb}-", dir=a.dir)
            try:
                res = bench(pb, a.reps or (10 if pb < MiB else 5), base, backends, rig, a.torch_threads)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            raw[pb] = res
            all_rows += rows(res)
            for e in res["errors"]:
                print("ERROR", e)
    finally:
        if rig:
            rig.close()
    with open("/proc/loadavg") as f:
        load1 = f.read().split()[:3]
    table = storage.print_table(all_rows)
    Path(a.out).write_text(json.dumps({"benchmark": "storage_sglang", "code": code_state(), "rows": all_rows, "raw": {str(k): v for k, v in raw.items()},
                                       "conditions": {"loadavg_start": load0, "loadavg_end": load1,
                                                      "torch_threads": a.torch_threads or "default",
                                                      "wall_s": round(time.time() - t0, 1)},
                                       "table_md": table}, indent=1))
    print(f"\nwrote {a.out} in {time.time() - t0:.0f}s (load {load0} -> {load1})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
