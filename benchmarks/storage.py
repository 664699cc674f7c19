"""L3 storage benchmark: tierkv's file, ZMQ and Mooncake backends next to the raw medium each sits on, measured in
the same run the same way, and next to SGLang 0.5.23's own storage classes on the same pages (optional peer venv).

For each page size (256 KiB, 2 MiB) and batches of 64 pages, per batch (set = a batch of new keys, get = reading it
back, every tierkv get verifying every header and XXH3 checksum):

| tierkv backend (through StorageBackend) | reference measured in the same loop | target |
|---|---|---|
| file, ``fsync: false`` | one plain file per page written / read (page cache; cold: pages dropped with
  ``posix_fadvise(DONTNEED)`` first) in the same directory, no fsync | >= 70 % |
| file, ``fsync: true`` (set only) | plain file writes with ``fsync`` per file | >= 70 % |
| zmq (``tierkv server`` in another process) | pyzmq REQ/REP on loopback: one multipart message with the 64
  payloads to a tiny store/echo server process that keeps the received frames, zero-copy frames; both servers drop
  the batch after each repetition (untimed) | >= 85 % |
| mooncake (client with no memory; the segment in another process, TCP transport), sets from a host pool given to
  ``register_host_buffer``; ``set_staged``: from loose tensors | raw ``MooncakeDistributedStore.batch_put_from`` /
  ``batch_get_into`` of the same payloads from/into registered buffers, same master, same segment holder | >= 90 % |

Sets pass the pages' XXH3-64 checksums (``batch_set(..., checksums=...)``), computed once before the timed loop:
the connector hashes each page when it enters the L2 host pool and hands that value to L3 ("checksum once"), so the
store does not hash payloads. ``--set-checksums computed`` measures the store hashing every payload itself (how the
committed table up to 2026-11-29 was measured). Gets always verify every header and payload checksum.

Backend and reference alternate batch by batch (order flipped every repetition) so machine noise hits both alike;
MB/s is ``batch bytes / median batch time``; p50/p99 are over the repetitions. The ratio the target is judged on is tierkv MB/s /
reference MB/s (a ratio of medians); the "paired" column is the median over repetitions of reference batch time /
tierkv batch time, each pair measured right next to each other (less sensitive to drift during the run). SGLang's ``HiCacheFile`` and
``MooncakeStore`` run in ``benchmarks/peers/.sglang-venv`` (``setup_sglang_venv.sh``; rows are "not measured"
without it) on the same page sizes and batch, right after, against the same directory / master / segment holder.

    .venv/bin/python -m benchmarks.storage                 # all, ~2-4 min on a busy 2-core box
    .venv/bin/python -m benchmarks.storage --quick         # fewer repetitions
    .venv/bin/python -m benchmarks.storage --backends mooncake --pages 256K
    .venv/bin/python -m benchmarks.storage --set-checksums computed   # the store hashes every payload on set
    .venv/bin/python -m benchmarks.storage --backends lmcache --pages 256K   # tierkv zmq vs LMCache's server
                                                                   # (benchmarks/storage_lmcache.py, own JSON)

Writes ``benchmarks/results/storage.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from benchmarks.harness.results import code_state
from benchmarks.harness.servers import MooncakeMaster, MooncakeSegment, ZmqServer, stop_process

os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "storage.json"
PEER_DIR = ROOT / "benchmarks" / "peers"
PEER_VENV = Path(os.environ.get("TIERKV_SGLANG_VENV", PEER_DIR / ".sglang-venv"))
NS = bytes(range(16))
BATCH = 64
TARGETS = {"file": 0.70, "zmq": 0.85, "mooncake": 0.90}  # zmq 85 % since issue 8 (sets pass their checksums)
KiB, MiB = 1024, 1024 * 1024


def keys_for(n: int, rng: np.random.Generator) -> list[str]:
    return [rng.bytes(16).hex() for _ in range(n)]


class Series:
    """Per-batch seconds of one (variant, op)."""

    def __init__(self):
        self.t: list[float] = []

    def add(self, s: float) -> None:
        self.t.append(s)

    def summary(self, nbytes: int) -> dict:
        if not self.t:
            return {"mbps": None, "p50_ms": None, "p99_ms": None, "batches": 0}
        p50 = statistics.median(self.t)
        p99 = float(np.percentile(self.t, 99))
        return {"mbps": round(nbytes / p50 / 1e6, 1), "p50_ms": round(p50 * 1e3, 2), "p99_ms": round(p99 * 1e3, 2),
                "batches": len(self.t), "t_ms": [round(x * 1e3, 3) for x in self.t]}


def paired_ratio(ours: dict, ref: Optional[dict]) -> Optional[float]:
    """Median over repetitions of ``ref batch time / our batch time``, each pair measured right next to each other
    (same repetition, alternating order): less sensitive to drift of the machine over the run than the ratio of the
    two medians. None when the series do not pair up."""
    a, b = ours.get("t_ms"), (ref or {}).get("t_ms")
    if not a or not b or len(a) != len(b):
        return None
    return statistics.median(r / o for o, r in zip(a, b) if o > 0)


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    t = time.perf_counter()
    r = fn()
    return time.perf_counter() - t, r


def paired(r: int, S: dict, raw: tuple[str, Callable[[], object], Callable[[object], bool]],
           ours: tuple[str, Callable[[], object], Callable[[object], bool]]) -> None:
    """One repetition of a reference/tierkv pair: each side is ``(stats name, call, check of its result)``; the two
    calls run back to back, the reference first on even ``r`` and second on odd ``r``; a failed check aborts the
    benchmark (untimed)."""
    for name, fn, check in ((raw, ours) if r % 2 == 0 else (ours, raw)):
        dt, res = timed(fn)
        assert check(res), (name, res)
        S[name].add(dt)


def _any(_res: object) -> bool:
    return True


def _all_ok(res: object) -> bool:
    return res == [True] * BATCH


def drop_cache(paths: list[str]) -> None:
    """Write back and drop the page-cache pages of ``paths`` (a cold read afterwards hits the disk)."""
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def files_under(root: str, suffix: str) -> list[str]:
    out = []
    for d, _, fs in os.walk(root):
        out += [os.path.join(d, f) for f in fs if f.endswith(suffix)]
    return out


# ----------------------------------------------------------------------------------------------------- file


def checksums_of(src: list[torch.Tensor]) -> list[int]:
    """XXH3-64 of each page (what the L2 host pool records when a page enters it); computed outside the timing."""
    from tierkv.storage_backends.page_format import payload_checksum

    return [payload_checksum(s.numpy()) for s in src]


def bench_file(pb: int, reps: int, src: list[torch.Tensor], base: str, fsync_reps: int,
               sums: Optional[list[int]] = None) -> dict:
    from tierkv.storage_backends.file.store import FileStore

    rng = np.random.default_rng(pb)
    nbytes = BATCH * pb
    S = {k: Series() for k in ("raw_write", "file_set", "raw_read", "file_get", "raw_read_cold", "file_get_cold",
                               "raw_write_fsync", "file_set_fsync")}
    raw_dir = os.path.join(base, "raw")
    os.makedirs(raw_dir, exist_ok=True)
    dst = [torch.empty(pb, dtype=torch.uint8) for _ in range(BATCH)]
    bufs = [bytearray(pb) for _ in range(BATCH)]
    srcv = [memoryview(s.numpy()) for s in src]

    def raw_write(names: list[str], fsync: bool) -> None:
        for n, s in zip(names, srcv):
            with open(n, "wb") as f:
                f.write(s)
                if fsync:
                    f.flush()
                    os.fsync(f.fileno())

    def raw_read(names: list[str]) -> None:
        for n, b in zip(names, bufs):
            with open(n, "rb", buffering=0) as f:
                if f.readinto(b) != pb:
                    raise RuntimeError("short read")

    for fsync, reps_here in ((False, reps), (True, fsync_reps)):
        store = FileStore(NS, pb, root=os.path.join(base, f"store-fsync{int(fsync)}"), fsync=fsync)
        try:
            for r in range(reps_here):
                ks = keys_for(BATCH, rng)
                names = [os.path.join(raw_dir, f"{k}.bin") for k in ks]
                sfx = "_fsync" if fsync else ""
                paired(r, S, ("raw_write" + sfx, lambda: raw_write(names, fsync), _any),
                       ("file_set" + sfx, lambda: store.batch_set(ks, src, checksums=sums), _all_ok))
                if not fsync:
                    paired(r, S, ("raw_read", lambda: raw_read(names), _any),  # page-cache reads
                           ("file_get", lambda: store.batch_get(ks, dst),
                            lambda ok: _all_ok(ok) and torch.equal(dst[-1], src[-1])))
                    drop_cache(names + files_under(store.root, ".page"))
                    paired(r, S, ("raw_read_cold", lambda: raw_read(names), _any),  # cold reads
                           ("file_get_cold", lambda: store.batch_get(ks, dst), _all_ok))
                for n in names:
                    os.unlink(n)
                store.clear()
        finally:
            store.close()
    return {k: v.summary(nbytes) for k, v in S.items()}


# ------------------------------------------------------------------------------------------------------ zmq

_RAW_ZMQ_SERVER = r"""
import sys, zmq
ctx = zmq.Context()
s = ctx.socket(zmq.REP)
port = s.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
store = {}
while True:
    msg = s.recv_multipart(copy=False)
    op = msg[0].bytes
    if op == b"set":   # [set, n, k1..kn, p1..pn]
        n = int(msg[1].bytes)
        for k, p in zip(msg[2:2 + n], msg[2 + n:]):
            store[k.bytes] = p
        s.send(b"ok")
    elif op == b"get":
        s.send_multipart([store[k.bytes] for k in msg[1:]], copy=False)
    elif op == b"del":
        store.clear(); s.send(b"ok")
    else:
        s.send(b"bye"); break
"""


def stop_procs(*procs: subprocess.Popen) -> None:
    """End the benchmark's own server processes by PID (:func:`~benchmarks.harness.servers.stop_process`)."""
    for p in procs:
        stop_process(p)


def bench_zmq(pb: int, reps: int, src: list[torch.Tensor], sums: Optional[list[int]] = None) -> dict:
    import zmq

    from tierkv.storage_backends.zmq.client import ZmqStore

    rng = np.random.default_rng(pb + 1)
    nbytes = BATCH * pb
    S = {k: Series() for k in ("raw_set", "zmq_set", "raw_get", "zmq_get")}
    raw = subprocess.Popen([sys.executable, "-c", _RAW_ZMQ_SERVER], stdout=subprocess.PIPE, text=True)
    cap = 4 * BATCH * (pb + 4096) + (64 << 20)
    srv = ZmqServer(capacity=cap)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    store = None
    try:
        sock.connect(f"tcp://127.0.0.1:{int(raw.stdout.readline())}")
        store = ZmqStore(NS, pb, endpoint=srv.endpoint, timeout_s=30.0)
        srcv = [memoryview(s.numpy()) for s in src]
        dst = [torch.empty(pb, dtype=torch.uint8) for _ in range(BATCH)]
        raw_dst = [np.empty(pb, dtype=np.uint8) for _ in range(BATCH)]

        def raw_set(ks: list[str]) -> None:
            sock.send_multipart([b"set", str(len(ks)).encode()] + [k.encode() for k in ks] + srcv, copy=False)
            assert sock.recv() == b"ok"

        def raw_get(ks: list[str]) -> None:
            sock.send_multipart([b"get"] + [k.encode() for k in ks])
            frames = sock.recv_multipart(copy=False)
            for f, d in zip(frames, raw_dst):  # land the payloads in page buffers, as a store's get must
                d[:] = np.frombuffer(f.buffer, dtype=np.uint8)

        for r in range(reps):
            ks = keys_for(BATCH, rng)
            paired(r, S, ("raw_set", lambda: raw_set(ks), _any), ("zmq_set", lambda: store.batch_set(ks, src, checksums=sums), _all_ok))
            paired(r, S, ("raw_get", lambda: raw_get(ks), _any),
                   ("zmq_get", lambda: store.batch_get(ks, dst), lambda ok: _all_ok(ok) and torch.equal(dst[-1], src[-1])))
            # both servers drop the batch after each repetition (untimed), so both receive the next batch into
            # memory their allocator already holds: the same work on both sides
            sock.send(b"del")
            sock.recv()
            store.clear()
    finally:
        if store is not None:
            store.close()
        sock.close(linger=0)
        ctx.term()
        stop_procs(raw)
        srv.stop()
    return {k: v.summary(nbytes) for k, v in S.items()}


# ------------------------------------------------------------------------------------------------- mooncake

class MooncakeRig:
    """A master, a segment-holder process (the store's memory, so every page crosses the TCP transport) and a raw
    client with registered buffers."""

    def __init__(self, segment: int):
        self.master = MooncakeMaster(log_dir=tempfile.mkdtemp(prefix="tierkv-bench-mc-")).start()
        self.holder = MooncakeSegment(self.master, segment)
        from mooncake.store import MooncakeDistributedStore

        self.raw = MooncakeDistributedStore()
        assert self.raw.setup("127.0.0.1", self.master.metadata_server, 0, 16 << 20, "tcp", "",
                              self.master.master_address) == 0
        # touch the whole segment once so no variant pays its first page faults
        warm = torch.zeros(8 * MiB, dtype=torch.uint8)
        n = segment // (8 * MiB) - 2
        ks = [f"warm/{i}" for i in range(n)]
        self.raw.batch_put_from(ks, [warm.data_ptr()] * n, [warm.numel()] * n)
        self.raw.batch_remove(ks, True)

    def close(self) -> None:
        try:
            self.raw.close()
        finally:
            self.holder.stop()
            self.master.stop()


def bench_mooncake(pb: int, reps: int, src: list[torch.Tensor], rig: MooncakeRig,
                   sums: Optional[list[int]] = None) -> dict:
    from tierkv.storage_backends.mooncake.store import MooncakeStore

    rng = np.random.default_rng(pb + 2)
    nbytes = BATCH * pb
    S = {k: Series() for k in ("raw_set", "mooncake_set", "raw_get", "mooncake_get", "raw_set2", "mooncake_set_staged")}
    flat = torch.stack(src).reshape(-1)  # the "host pool": both clients send the pages from it
    pool_pages = list(flat.view(BATCH, pb))
    rdst = torch.zeros_like(flat)
    for t in (flat, rdst):
        assert rig.raw.register_buffer(t.data_ptr(), t.numel()) == 0
    sp = [flat.data_ptr() + i * pb for i in range(BATCH)]
    dp = [rdst.data_ptr() + i * pb for i in range(BATCH)]
    store = MooncakeStore(NS, pb, **rig.master.client_config(), global_segment_size=0, timeout_s=30.0,
                          staging_bytes=BATCH * (pb + 64))
    dst = [torch.empty(pb, dtype=torch.uint8) for _ in range(BATCH)]
    assert store.register_host_buffer(flat)  # zero-copy sets from the registered pool, as SGLang's class does
    try:
        for r in range(reps):
            ks = keys_for(BATCH, rng)
            rk = [f"raw/{k}" for k in ks]
            put_ok = lambda rc: all(x == 0 for x in rc)  # noqa: E731
            paired(r, S, ("raw_set", lambda: rig.raw.batch_put_from(rk, sp, [pb] * BATCH), put_ok),
                   ("mooncake_set", lambda: store.batch_set(ks, pool_pages, checksums=sums), _all_ok))
            paired(r, S, ("raw_get", lambda: rig.raw.batch_get_into(rk, dp, [pb] * BATCH),
                          lambda rc: all(x == pb for x in rc)),
                   ("mooncake_get", lambda: store.batch_get(ks, dst),
                    lambda ok: _all_ok(ok) and torch.equal(dst[-1], src[-1])))
            assert torch.equal(rdst, flat)
            rig.raw.batch_remove(rk, True)
            store.remove(ks)
            if pb < store.cfg.zero_copy_min_page_bytes:
                continue  # small pages are always staged: the "set" row is that path already
            # staged path: the same pages from buffers the store was not told about (copied behind their headers)
            ks2 = keys_for(BATCH, rng)
            rk2 = [f"raw/{k}" for k in ks2]
            paired(r, S, ("raw_set2", lambda: rig.raw.batch_put_from(rk2, sp, [pb] * BATCH), put_ok),
                   ("mooncake_set_staged", lambda: store.batch_set(ks2, src, checksums=sums), _all_ok))
            assert store.batch_get(ks2, dst) == [True] * BATCH and torch.equal(dst[7], src[7])
            rig.raw.batch_remove(rk2, True)
            store.remove(ks2)
        st = store.stats()
        assert st["corrupt"] == 0 and st["timeouts"] == 0, st
        zc = pb >= store.cfg.zero_copy_min_page_bytes
        assert st["zero_copy_sets"] == (reps * BATCH if zc else 0) and st["staged_sets"] == reps * BATCH, st
    finally:
        store.unregister_host_buffer(flat)
        store.close()
        for t in (flat, rdst):
            rig.raw.unregister_buffer(t.data_ptr())
    return {k: v.summary(nbytes) for k, v in S.items()}


# ----------------------------------------------------------------------------------------------------- peers


def run_peer(pb: int, reps: int, file_dir: str, rig: Optional[MooncakeRig]) -> Optional[dict]:
    py = PEER_VENV / "bin" / "python"
    if not py.exists():
        return None
    arg = {"page_bytes": pb, "batch": BATCH, "reps": reps, "file_dir": file_dir,
           "master": rig.master.master_address if rig else None, "metadata": rig.master.metadata_server if rig else None}
    p = subprocess.run([str(py), str(PEER_DIR / "sglang_storage_peer.py"), json.dumps(arg)], capture_output=True,
                       text=True, timeout=900, env=dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1"))
    if p.returncode != 0:
        print(f"  SGLang peer failed (rc {p.returncode}): {p.stderr.strip().splitlines()[-3:]}")
        return {"error": p.stderr.strip().splitlines()[-1:] }
    out = json.loads(p.stdout.strip().splitlines()[-1])
    res = {"errors": out.get("errors", [])}
    for cls in ("hicache_file", "mooncake"):
        if cls in out:
            for op, ts in out[cls].items():
                s = Series()
                s.t = ts
                res[f"{cls}_{op}"] = s.summary(BATCH * pb)
    return res


# ------------------------------------------------------------------------------------------------------ main


def rows_for(pb: int, file_r: Optional[dict], zmq_r: Optional[dict], mc_r: Optional[dict],
             peer: Optional[dict], set_checksums: str = "given") -> list[dict]:
    rows = []
    set_cond = ("; checksums given (computed before the timing)" if set_checksums == "given"
                else "; the store hashes every payload")

    def add(backend, op, ours, ref, ref_name, sgl=None, target_key=None, cond=""):
        if ours is None or ours.get("mbps") is None:
            return
        ratio = ours["mbps"] / ref["mbps"] if ref and ref.get("mbps") else None
        tgt = TARGETS[target_key or backend]
        row = {"backend": backend, "page_bytes": pb, "batch": BATCH, "op": op, **{k: v for k, v in ours.items() if k != "t_ms"},
               "reference": ref_name, "ref_mbps": ref["mbps"] if ref else None,
               "ref_p50_ms": ref["p50_ms"] if ref else None,
               "ratio": round(ratio, 3) if ratio is not None else None,
               "paired_ratio": round(pr, 3) if (pr := paired_ratio(ours, ref)) is not None else None, "target": tgt,
               "meets_target": (ratio is not None and ratio >= tgt),
               "sglang_mbps": sgl["mbps"] if sgl else None,
               "vs_sglang": round(ours["mbps"] / sgl["mbps"], 3) if sgl and sgl.get("mbps") else None,
               "conditions": cond + (set_cond if op.startswith("set") else "")}
        rows.append(row)

    peer = peer or {}
    if file_r:
        add("file", "set", file_r["file_set"], file_r["raw_write"], "plain file write, no fsync",
            peer.get("hicache_file_set"), cond="fsync: false; page cache")
        add("file", "get", file_r["file_get"], file_r["raw_read"], "plain file read, page cache",
            peer.get("hicache_file_get"), cond="warm (page cache)")
        add("file", "get_cold", file_r["file_get_cold"], file_r["raw_read_cold"],
            "plain file read after posix_fadvise(DONTNEED)", cond="cold (fdatasync + DONTNEED before the read)")
        add("file", "set_fsync", file_r["file_set_fsync"], file_r["raw_write_fsync"], "plain file write + fsync",
            cond="fsync: true (file + directory)")
    if zmq_r:
        add("zmq", "set", zmq_r["zmq_set"], zmq_r["raw_set"], "pyzmq REQ/REP, one multipart message per batch",
            cond="server process on 127.0.0.1 TCP")
        add("zmq", "get", zmq_r["zmq_get"], zmq_r["raw_get"], "pyzmq REQ/REP, one multipart message per batch",
            cond="server process on 127.0.0.1 TCP")
    if mc_r:
        add("mooncake", "set", mc_r["mooncake_set"], mc_r["raw_set"], "raw MooncakeDistributedStore.batch_put_from",
            peer.get("mooncake_set"), cond="client mounts 0 B; segment in another process; TCP transport")
        add("mooncake", "get", mc_r["mooncake_get"], mc_r["raw_get"], "raw MooncakeDistributedStore.batch_get_into",
            peer.get("mooncake_get"), cond="client mounts 0 B; segment in another process; TCP transport")
        if mc_r.get("mooncake_set_staged", {}).get("mbps"):
            add("mooncake", "set_staged", mc_r["mooncake_set_staged"], mc_r["raw_set2"],
                "raw MooncakeDistributedStore.batch_put_from",
                cond="sources outside any registered host buffer: copied into staging behind their headers")
    return rows


def fmt(v, spec="{:.0f}") -> str:
    return "-" if v is None else spec.format(v)


def print_table(rows: list[dict]) -> str:
    head = ("| backend | page | op | MB/s | p50 ms | p99 ms | reference | ref MB/s | ratio | paired | target | "
            "SGLang MB/s | vs SGLang |\n|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in rows:
        pg = f"{r['page_bytes'] // KiB} KiB" if r["page_bytes"] < MiB else f"{r['page_bytes'] // MiB} MiB"
        verdict = f"{r['target']:.0%} {'ok' if r['meets_target'] else 'MISSED'}"
        lines.append(f"| {r['backend']} | {pg} | {r['op']} | {fmt(r['mbps'])} | {fmt(r['p50_ms'], '{:.1f}')} | "
                     f"{fmt(r['p99_ms'], '{:.1f}')} | {r['reference']} | {fmt(r['ref_mbps'])} | "
                     f"{fmt(r['ratio'], '{:.0%}')} | {fmt(r['paired_ratio'], '{:.0%}')} | {verdict} | "
                     f"{fmt(r['sglang_mbps']) if r['sglang_mbps'] else 'not measured' if r['op'] in ('set', 'get') and r['backend'] != 'zmq' else '-'} | "
                     f"{fmt(r['vs_sglang'], '{:.2f}x')} |")
    table = "\n".join(lines)
    print(table)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--backends", default="file,zmq,mooncake,sglang",
                    help="sglang: the same stores through SGLang's HiCache interface next to SGLang's own classes "
                    "(benchmarks/storage_sglang.py)")
    ap.add_argument("--pages", default="256K,2M", help="page sizes: 256K, 2M")
    ap.add_argument("--reps", type=int, default=None, help="batches per variant (default 12 for 256 KiB, 5 for 2 MiB)")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-peer", action="store_true", help="skip SGLang's classes even if the peer venv exists")
    ap.add_argument("--set-checksums", choices=("given", "computed"), default="given",
                    help="given (default): sets pass the pages' XXH3-64, computed before the timed loop, as the "
                    "connector does from L2; computed: the store hashes every payload on set")
    ap.add_argument("--dir", default=str(ROOT / ".cache" / "storage-bench"),
                    help="directory for the file store and raw files (same disk as ~/.cache)")
    ap.add_argument("--out", default=None, help=f"results file (default {RESULTS}; with --quick "
                    "$TMPDIR/storage_quick.json, so a quick run never overwrites the committed results)")
    a = ap.parse_args(argv)
    if a.out is None:
        a.out = str(Path(tempfile.gettempdir()) / "storage_quick.json") if a.quick else str(RESULTS)
    backends = a.backends.split(",")
    sizes = [{"256K": 256 * KiB, "2M": 2 * MiB}[s] for s in a.pages.split(",")]
    if "lmcache" in backends:  # tierkv's ZMQ server next to LMCache's server: its own module and JSON (issue 11)
        from benchmarks import storage_lmcache

        storage_lmcache.run(sizes, a.reps, a.quick, a.set_checksums)
        backends.remove("lmcache")
        if not backends:
            return 0
    t_start = time.time()
    rig = None
    all_rows, raw = [], {}
    with open("/proc/loadavg") as f:
        load0 = f.read().split()[:3]
    try:
        if "mooncake" in backends:
            rig = MooncakeRig(segment=max(sizes) * BATCH * 4 + 64 * MiB)
        for pb in sizes:
            reps = a.reps or ((12 if pb < MiB else 5) // (2 if a.quick else 1))
            print(f"== page {pb // KiB} KiB x batch {BATCH}, {reps} batches per variant")
            rng = np.random.default_rng(pb)
            src = [torch.from_numpy(np.frombuffer(rng.bytes(pb), dtype=np.uint8).copy()) for _ in range(BATCH)]
            sums = checksums_of(src) if a.set_checksums == "given" else None
            base = tempfile.mkdtemp(prefix=f"p{pb}-", dir=_mkdir(a.dir))
            try:
                file_r = bench_file(pb, 2 * reps, src, base, max(3, reps // 2), sums) if "file" in backends else None
                zmq_r = bench_zmq(pb, 4 * reps, src, sums) if "zmq" in backends else None  # cheap, noisy: more
                mc_r = bench_mooncake(pb, 3 * reps if pb >= MiB else 2 * reps, src, rig, sums) if rig else None  # noisy
                peer = None
                if not a.no_peer:
                    pdir = os.path.join(base, "sglang-hicache-file")
                    os.makedirs(pdir)
                    peer = run_peer(pb, reps, pdir, rig)
                if "sglang" in backends:  # rows of benchmarks/storage_sglang.py, same pages sizes, rig and disk
                    from benchmarks import storage_sglang as sgl_if

                    raw.setdefault("sglang_interface", {})[pb] = r_if = sgl_if.bench(pb, reps, base, backends, rig)
                    all_rows += sgl_if.rows(r_if)
            finally:
                shutil.rmtree(base, ignore_errors=True)
            raw[pb] = {"file": file_r, "zmq": zmq_r, "mooncake": mc_r, "sglang": peer}
            all_rows += rows_for(pb, file_r, zmq_r, mc_r, peer, a.set_checksums)
    finally:
        if rig:
            rig.close()
    with open("/proc/loadavg") as f:
        load1 = f.read().split()[:3]
    print()
    table = print_table(all_rows)
    peer_state = "measured" if PEER_VENV.exists() and not a.no_peer else "not measured (no peer venv)"
    out = {"benchmark": "storage", "code": code_state(), "batch_pages": BATCH, "rows": all_rows, "raw": {str(k): v for k, v in raw.items()},
           "conditions": {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version(),
                          "torch": torch.__version__, "loadavg_start": load0, "loadavg_end": load1,
                          "dir": a.dir, "wall_s": round(time.time() - t_start, 1), "sglang_peer": peer_state,
                          "set_checksums": a.set_checksums,
                          "note": "shared, noisy machine: backend and reference alternate batch by batch"},
           "table_md": table}
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"\nwrote {a.out} in {time.time() - t_start:.0f}s (load {load0} -> {load1})")
    runpy.run_path(str(Path(__file__).with_name("plots.py")))["charts_for"](a.out)  # PNG charts next to the JSON
    return 0


def _mkdir(d: str) -> str:
    os.makedirs(d, exist_ok=True)
    return d


if __name__ == "__main__":
    sys.exit(main())
