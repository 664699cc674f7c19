"""tierkv's ZMQ cache server next to LMCache's cache server as an L3, on the same pages, in one run (issue 11).

Per batch of 64 pages (default 256 KiB each; set = a batch of new pages, get = reading it back), four ways, taking
turns batch by batch (the order rotates every repetition, so machine noise hits all alike):

| variant | path |
|---|---|
| ``raw`` | pyzmq REQ/REP on loopback: one multipart message with the 64 payloads to a tiny store/echo process (the
  reference of ``benchmarks/storage.py``); the ceiling of any ZMQ store |
| ``zmq`` | tierkv's ``ZmqStore`` on a ``tierkv server`` process (sets pass their checksums; gets verify headers
  and XXH3) |
| ``zmq_shm`` | the same store and server with ``shm="on"``: pages move through the client's ``/dev/shm`` segment
  (one batch in size), control messages over ZMQ (docs/architecture.md §5); its own namespace on the server |
| ``lmcache`` | tierkv's ``LMCacheStore`` on a real LMCache 0.5.6 multiprocess server (its own venv,
  ``benchmarks/peers/setup_lmcache_venv.sh``): pages named by their token ids (one key range per batch), data through
  the server's ``/dev/shm`` segment; get = lookup + prefetch wait + prepare/commit retrieve, verified like ``zmq`` |
| ``lmcache_keys`` | the same store without token ids (how the controller's L3 I/O calls every store today): each
  page is a one-chunk key range of its own, the 64 ranges pipelined |
| ``lmcache_native`` | LMCache's own worker-side client (``benchmarks/peers/lmcache_native_peer.py`` in the LMCache
  venv: ``create_transfer_context`` in engine-driven mode, the path LMCache's vLLM integration takes for CPU KV
  caches) on a fresh server of its own: the same batch geometry as 64 blocks of a vLLM-shaped fp16 CPU KV cache
  (``submit_store``; ``lookup`` + ``wait_prefetch_status`` + ``submit_retrieve``, checked after each timed call).
  It runs after the three above, not interleaved with them, and LMCache verifies nothing on read |

The same source pages are used by all variants; every variant drops its pages after each repetition (untimed), so
all receive the next batch into memory their allocator already holds. MB/s = batch bytes / median batch time;
p50/p99 over the repetitions; the ratio the target is judged on is ``zmq`` MB/s / ``lmcache`` MB/s (target >= 1.5
on set and on get), plus the paired ratio (median over repetitions of the two batch times measured back to back);
the same ratios for ``zmq_shm`` (``zmq_shm_over_lmcache``, ``zmq_shm_meets_target``).

    .venv/bin/python -m benchmarks.storage_lmcache               # ~1-2 min on a 2-core box
    .venv/bin/python -m benchmarks.storage_lmcache --quick       # smoke run, fewer repetitions
    .venv/bin/python -m benchmarks.storage --backends lmcache    # the same, from the storage benchmark

Writes ``benchmarks/results/storage_lmcache.json`` (``--quick``: ``$TMPDIR/storage_lmcache_quick.json``).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks import storage as SB  # Series, keys_for, raw server, ...
from benchmarks.harness import servers
from benchmarks.harness.results import code_state

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "storage_lmcache.json"
NS = bytes(range(16))
BATCH = 64
PAGE_TOKENS = 16
TARGET = 1.5
KiB, MiB = 1024, 1024 * 1024
VARIANTS = ("raw", "zmq", "zmq_shm", "lmcache", "lmcache_keys")
NATIVE_PEER = ROOT / "benchmarks" / "peers" / "lmcache_native_peer.py"




def bench(pb: int, reps: int, src: list[torch.Tensor], sums: Optional[list[int]]) -> dict:
    """``reps`` batches per variant of 64 pages of ``pb`` bytes; returns ``{variant_op: Series.summary}``."""
    import zmq

    from tierkv.storage_backends.base import PageTokens
    from tierkv.storage_backends.lmcache.store import LMCacheStore
    from tierkv.storage_backends.zmq.client import ZmqStore

    rng = np.random.default_rng(pb + 11)
    S = {f"{v}_{op}": SB.Series() for v in VARIANTS for op in ("set", "get")}
    raw = subprocess.Popen([sys.executable, "-c", SB._RAW_ZMQ_SERVER], stdout=subprocess.PIPE, text=True)
    cap = 4 * BATCH * (pb + 4096) + (64 << 20)
    srv = servers.ZmqServer(capacity=cap)
    l1_gb = max(1.0, 4 * BATCH * (pb + 4096) / 2**30)
    lm_proc, lm_ep, lm_shm = servers.start_lmcache_server(PAGE_TOKENS, l1_size_gb=round(l1_gb, 2),
                                              log_path=os.path.join(tempfile.gettempdir(), "tierkv-bench-lmcache.log"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    zs = zsh = lm = None
    try:
        sock.connect(f"tcp://127.0.0.1:{int(raw.stdout.readline())}")
        zs = ZmqStore(NS, pb, endpoint=srv.endpoint, timeout_s=30.0)
        zsh = ZmqStore(bytes(range(48, 64)), pb, endpoint=srv.endpoint, timeout_s=30.0, shm="on", shm_bytes=BATCH * pb)
        lm = LMCacheStore(NS, pb, endpoint=lm_ep, page_tokens=PAGE_TOKENS, timeout_s=30.0)
        srcv = [memoryview(s.numpy()) for s in src]
        dst = [torch.empty(pb, dtype=torch.uint8) for _ in range(BATCH)]
        raw_dst = [np.empty(pb, dtype=np.uint8) for _ in range(BATCH)]
        root = bytes(range(32, 48))

        def raw_set(ks):
            sock.send_multipart([b"set", str(len(ks)).encode()] + [k.encode() for k in ks] + srcv, copy=False)
            assert sock.recv() == b"ok"
            return True

        def raw_get(ks):
            sock.send_multipart([b"get"] + [k.encode() for k in ks])
            for f, d in zip(sock.recv_multipart(copy=False), raw_dst):
                d[:] = np.frombuffer(f.buffer, dtype=np.uint8)
            return True

        def ok_all(res):
            return res == [True] * BATCH

        def ok_get(res):
            return ok_all(res) and torch.equal(dst[-1], src[-1]) and torch.equal(dst[0], src[0])

        for r in range(reps):
            ks = SB.keys_for(BATCH, rng)
            toks = [int(t) for t in rng.integers(0, 150_000, BATCH * PAGE_TOKENS)]
            pts = [PageTokens(toks[:(i + 1) * PAGE_TOKENS], root) for i in range(BATCH)]
            calls = {
                "raw": (lambda: raw_set(ks), bool, lambda: raw_get(ks), bool),
                "zmq": (lambda: zs.batch_set(ks, src, checksums=sums), ok_all, lambda: zs.batch_get(ks, dst), ok_get),
                "zmq_shm": (lambda: zsh.batch_set(ks, src, checksums=sums), ok_all, lambda: zsh.batch_get(ks, dst),
                            ok_get),
                "lmcache": (lambda: lm.batch_set(ks, src, checksums=sums, tokens=pts), ok_all,
                            lambda: lm.batch_get(ks, dst, tokens=pts), ok_get),
                "lmcache_keys": (lambda: lm.batch_set(ks, src, checksums=sums), ok_all,
                                 lambda: lm.batch_get(ks, dst), ok_get),
            }
            k = r % len(VARIANTS)
            order = VARIANTS[k:] + VARIANTS[:k]
            for v in order:
                fset, cset, fget, cget = calls[v]
                dt, res = SB.timed(fset)
                assert cset(res), (v, "set", res)
                S[f"{v}_set"].add(dt)
            for v in order:
                fset, cset, fget, cget = calls[v]
                for d in dst:
                    d.zero_()
                dt, res = SB.timed(fget)
                assert cget(res), (v, "get", res)
                S[f"{v}_get"].add(dt)
            sock.send(b"del")  # every variant drops the batch (untimed)
            sock.recv()
            zs.clear()
            zsh.clear()
            lm.clear()
        st = lm.stats()
        assert st["corrupt"] == 0 and st["timeouts"] == 0, st
        st = zsh.stats()
        assert st["shm_fallbacks"] == 0 and st["shm_pages_in"] == reps * BATCH and st["corrupt"] == 0, st
    finally:
        for s in (zs, zsh, lm):
            if s is not None:
                s.close()
        sock.close(linger=0)
        ctx.term()
        SB.stop_procs(raw)
        srv.stop()
        servers.stop_lmcache_server(lm_proc, lm_shm)
    return {k: v.summary(BATCH * pb) for k, v in S.items()}


def bench_native(pb: int, reps: int) -> dict:
    """LMCache's own client on its own server (see the module docstring); ``{"lmcache_native_set"/"_get": summary}``,
    or ``{"lmcache_native_error": text}`` when it cannot run."""
    heads, head_dim = 8, 128
    layers, rest = divmod(pb, 2 * PAGE_TOKENS * heads * head_dim * 2)
    if rest or layers < 1:
        return {"lmcache_native_error": f"no fp16 KV geometry for {pb}-byte pages"}
    proc, ep, shm = servers.start_lmcache_server(PAGE_TOKENS, l1_size_gb=round(max(1.0, 4 * BATCH * pb / 2**30), 2),
                                     log_path=os.path.join(tempfile.gettempdir(), "tierkv-bench-lmcache-native.log"))
    try:
        arg = {"endpoint": ep, "chunk_tokens": PAGE_TOKENS, "batch": BATCH, "reps": reps, "layers": layers,
               "heads": heads, "head_dim": head_dim}
        p = subprocess.run([servers.lmcache_python(), str(NATIVE_PEER), json.dumps(arg)], capture_output=True, text=True,
                           timeout=600, env=dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1"))
    finally:
        servers.stop_lmcache_server(proc, shm)
    if p.returncode != 0:
        return {"lmcache_native_error": (p.stderr.strip().splitlines() or ["?"])[-1]}
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert out["page_bytes"] == pb and not out["errors"], out
    res = {}
    for op in ("set", "get"):
        s = SB.Series()
        s.t = out[op]
        res[f"lmcache_native_{op}"] = s.summary(BATCH * pb)
    return res


def rows_for(pb: int, res: dict) -> list[dict]:
    rows = []
    for op in ("set", "get"):
        z, lmr, raw, lmk = res[f"zmq_{op}"], res[f"lmcache_{op}"], res[f"raw_{op}"], res[f"lmcache_keys_{op}"]
        zsh = res[f"zmq_shm_{op}"]
        ratio = z["mbps"] / lmr["mbps"] if z["mbps"] and lmr["mbps"] else None
        ratio_shm = zsh["mbps"] / lmr["mbps"] if zsh["mbps"] and lmr["mbps"] else None
        rows.append({"page_kib": pb // KiB, "op": op, "raw_mbps": raw["mbps"], "zmq_mbps": z["mbps"],
                     "lmcache_mbps": lmr["mbps"], "zmq_p50_ms": z["p50_ms"], "zmq_p99_ms": z["p99_ms"],
                     "lmcache_p50_ms": lmr["p50_ms"], "lmcache_p99_ms": lmr["p99_ms"], "raw_p50_ms": raw["p50_ms"],
                     "raw_p99_ms": raw["p99_ms"], "lmcache_keys_mbps": lmk["mbps"],
                     "lmcache_keys_p50_ms": lmk["p50_ms"], "lmcache_keys_p99_ms": lmk["p99_ms"],
                     "zmq_over_lmcache": round(ratio, 2) if ratio else None,
                     "zmq_over_lmcache_paired": _round(SB.paired_ratio(z, lmr)),
                     "zmq_shm_mbps": zsh["mbps"], "zmq_shm_p50_ms": zsh["p50_ms"], "zmq_shm_p99_ms": zsh["p99_ms"],
                     "zmq_shm_over_lmcache": _round(ratio_shm),
                     "zmq_shm_over_lmcache_paired": _round(SB.paired_ratio(zsh, lmr)),
                     "zmq_shm_meets_target": bool(ratio_shm and ratio_shm >= TARGET),
                     "lmcache_native_mbps": res.get(f"lmcache_native_{op}", {}).get("mbps"),
                     "lmcache_native_p50_ms": res.get(f"lmcache_native_{op}", {}).get("p50_ms"),
                     "lmcache_native_p99_ms": res.get(f"lmcache_native_{op}", {}).get("p99_ms"),
                     "target": TARGET,
                     "meets_target": bool(ratio and ratio >= TARGET)})
    return rows


def _round(v):
    return round(v, 2) if v is not None else None


def table(rows: list[dict]) -> str:
    head = ("| page | op | raw pyzmq MB/s | tierkv zmq MB/s (p50/p99 ms) | tierkv zmq shm MB/s (p50/p99 ms) | "
            "LMCache server via lmcache store MB/s "
            "(p50/p99 ms) | same, pages named by key MB/s (p50/p99 ms) | LMCache's own client MB/s (p50/p99 ms) | "
            "zmq / LMCache (paired) | zmq shm / LMCache (paired) | target |")
    out = [head, "|" + "---|" * 11]
    for r in rows:
        out.append(f"| {r['page_kib']} KiB x {BATCH} | {r['op']} | {r['raw_mbps']:.0f} | {r['zmq_mbps']:.0f} "
                   f"({r['zmq_p50_ms']}/{r['zmq_p99_ms']}) | {r['zmq_shm_mbps']:.0f} ({r['zmq_shm_p50_ms']}/"
                   f"{r['zmq_shm_p99_ms']}) | {r['lmcache_mbps']:.0f} ({r['lmcache_p50_ms']}/"
                   f"{r['lmcache_p99_ms']}) | {r['lmcache_keys_mbps']:.0f} ({r['lmcache_keys_p50_ms']}/"
                   f"{r['lmcache_keys_p99_ms']}) | {_native(r)} | {r['zmq_over_lmcache']}x ({r['zmq_over_lmcache_paired']}x) | "
                   f"{r['zmq_shm_over_lmcache']}x ({r['zmq_shm_over_lmcache_paired']}x) | >= {TARGET}x: zmq "
                   f"{_met(r['meets_target'])}, shm {_met(r['zmq_shm_meets_target'])} |")
    return "\n".join(out)


def _met(ok: bool) -> str:
    return "met" if ok else "NOT met"


def _native(r: dict) -> str:
    if r.get("lmcache_native_mbps") is None:
        return "not measured"
    return f"{r['lmcache_native_mbps']:.0f} ({r['lmcache_native_p50_ms']}/{r['lmcache_native_p99_ms']})"


def run(sizes: list[int], reps: Optional[int], quick: bool, sums_mode: str = "given",
        out: Optional[str] = None) -> dict:
    """Measure every page size in ``sizes``; print the table and write the JSON. Returns the result document."""
    t0 = time.time()
    with open("/proc/loadavg") as f:
        load0 = f.read().split()[:3]
    rows, raw = [], {}
    for pb in sizes:
        n = reps or ((16 if pb < MiB else 6) // (2 if quick else 1))
        print(f"== lmcache vs tierkv zmq: page {pb // KiB} KiB x batch {BATCH}, {n} batches per variant")
        rng = np.random.default_rng(pb)
        src = [torch.from_numpy(np.frombuffer(rng.bytes(pb), dtype=np.uint8).copy()) for _ in range(BATCH)]
        sums = SB.checksums_of(src) if sums_mode == "given" else None
        raw[pb] = bench(pb, n, src, sums)
        raw[pb].update(bench_native(pb, n))
        if "lmcache_native_error" in raw[pb]:
            print(f"  LMCache's own client not measured: {raw[pb]['lmcache_native_error']}")
        rows += rows_for(pb, raw[pb])
    with open("/proc/loadavg") as f:
        load1 = f.read().split()[:3]
    md = table(rows)
    print(md)
    doc = {"benchmark": "storage_lmcache", "code": code_state(), "batch_pages": BATCH, "page_tokens": PAGE_TOKENS, "rows": rows,
           "raw": {str(k): v for k, v in raw.items()}, "table_md": md,
           "conditions": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "lmcache": "0.5.6 (benchmarks/peers/.lmcache-venv)",
                          "loadavg_start": load0, "loadavg_end": load1, "wall_s": round(time.time() - t0, 1),
                          "set_checksums": sums_mode,
                          "note": "variants take turns batch by batch, order rotating per repetition"}}
    path = out or (str(Path(tempfile.gettempdir()) / "storage_lmcache_quick.json") if quick else str(RESULTS))
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(doc, indent=1))
    print(f"wrote {path} in {time.time() - t0:.0f}s (load {load0} -> {load1})")
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", default="256K", help="page sizes: 256K, 2M (comma separated)")
    ap.add_argument("--reps", type=int, default=None, help="batches per variant (default 16 for 256 KiB, 6 for 2 MiB)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--set-checksums", choices=("given", "computed"), default="given")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    sizes = [{"256K": 256 * KiB, "2M": 2 * MiB}[s] for s in a.pages.split(",")]
    doc = run(sizes, a.reps, a.quick, a.set_checksums, a.out)
    return 0 if doc["rows"] else 1


if __name__ == "__main__":
    sys.exit(main())
