"""The ``redis`` L3 store (standalone and cluster) next to tierkv's own server (TCP and shared memory) and the
Mooncake store, on the same pages, in one run.

Per page size (64 KiB, 256 KiB, 1 MiB, 2 MiB) and batches of ``--batch`` pages (default 32), per repetition every
variant runs set (new keys; sets pass the pages' checksums, as the connector does), exists (the whole batch present)
and get (read back, every header and XXH3 verified) back to back; the variants take turns, the order rotating every
repetition, so machine noise hits all alike; every variant drops its pages after each repetition (untimed).

| variant | store |
|---|---|
| ``redis`` | ``RedisStore`` on one ``redis-server`` 7 (Debian package; loopback TCP, persistence off) |
| ``redis_cluster`` | ``RedisStore`` in cluster mode on 3 masters (no replicas: a replica doubles every write) |
| ``zmq`` | ``ZmqStore`` on a ``tierkv server`` process (TCP) |
| ``zmq_shm`` | the same with ``shm="on"`` (pages through ``/dev/shm``, control over ZMQ) |
| ``mooncake`` | ``MooncakeStore`` (TCP transport; the segment held by another process, as in ``storage.py``) |

MB/s = batch bytes / median batch time; p50/p99 over the repetitions (benchmarks/storage.py's ``Series``).
``exists`` moves no page, so its MB/s is "page bytes answered for", shown for comparison only.

    flock /tmp/tierkv-engine.lock .venv/bin/python -m benchmarks.storage_redis          # ~3 min
    flock /tmp/tierkv-engine.lock .venv/bin/python -m benchmarks.storage_redis --quick  # smoke run

Writes ``benchmarks/results/storage_redis.json`` (``--quick``: ``$TMPDIR/storage_redis_quick.json``).
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

import numpy as np
import torch

from benchmarks import storage as SB  # Series, timed, MooncakeRig, checksums_of
from benchmarks.harness import RESULTS as RESULTS_DIR
from benchmarks.harness.results import code_state

RESULTS = RESULTS_DIR / "storage_redis.json"
NS = bytes(range(16))
KiB, MiB = 1024, 1024 * 1024
VARIANTS = ("redis", "redis_cluster", "zmq", "zmq_shm", "mooncake")
OPS = ("set", "exists", "get")


def bench(pb: int, batch: int, reps: int, rig) -> dict:
    from benchmarks.harness.servers import ZmqServer
    from tests.helpers.redis_servers import RedisClusterServers, RedisServer
    from tierkv.storage_backends.mooncake.store import MooncakeStore
    from tierkv.storage_backends.redis import RedisStore
    from tierkv.storage_backends.zmq.client import ZmqStore

    rng = np.random.default_rng(pb)
    src = [torch.from_numpy(np.frombuffer(rng.bytes(pb), dtype=np.uint8).copy()) for _ in range(batch)]
    sums = SB.checksums_of(src)
    dst = [torch.empty(pb, dtype=torch.uint8) for _ in range(batch)]
    work = tempfile.mkdtemp(prefix="tierkv-bench-redis-")
    solo = RedisServer(os.path.join(work, "solo"))
    cluster = RedisClusterServers(os.path.join(work, "cluster"), masters=3, replicas=0)
    cap = 4 * batch * (pb + 4096) + (64 << 20)
    srv = ZmqServer(capacity=cap)
    stores = {}
    try:
        stores["redis"] = RedisStore(NS, pb, url=solo.url, timeout_s=30.0)
        stores["redis_cluster"] = RedisStore(NS, pb, mode="cluster", nodes=cluster.nodes, timeout_s=30.0)
        stores["zmq"] = ZmqStore(NS, pb, endpoint=srv.endpoint, timeout_s=30.0)
        stores["zmq_shm"] = ZmqStore(bytes(range(48, 64)), pb, endpoint=srv.endpoint, timeout_s=30.0, shm="on",
                                     shm_bytes=batch * pb)
        if rig is not None:
            stores["mooncake"] = MooncakeStore(NS, pb, **rig.master.client_config(), global_segment_size=0,
                                               timeout_s=30.0, staging_bytes=batch * (pb + 64))
        S = {(v, op): SB.Series() for v in stores for op in OPS}
        names = list(stores)
        for r in range(reps):
            order = names[r % len(names):] + names[:r % len(names)]
            for v in order:
                st, ks = stores[v], [rng.bytes(16).hex() for _ in range(batch)]
                for op, call, ok in (("set", lambda: st.batch_set(ks, src, checksums=sums), [True] * batch),
                                     ("exists", lambda: st.batch_exists(ks), batch),
                                     ("get", lambda: st.batch_get(ks, dst), [True] * batch)):
                    dt, res = SB.timed(call)
                    assert res == ok, (v, op, res)
                    S[(v, op)].add(dt)
                assert torch.equal(dst[-1], src[-1]) and torch.equal(dst[0], src[0])
                if v == "mooncake":
                    st.remove(ks)
                else:
                    st.clear()
        for v, st in stores.items():
            s = st.stats()
            assert s["corrupt"] == 0 and s["errors"] == 0, (v, s)
        out = {}
        for (v, op), ser in S.items():
            summ = ser.summary(batch * pb)
            summ.pop("t_ms", None)
            out.setdefault(v, {})[op] = summ
        return out
    finally:
        for st in stores.values():
            st.close()
        SB.stop_procs(srv)
        solo.close()
        cluster.close()


def table(results: dict) -> str:
    lines = ["| page | op | " + " | ".join(VARIANTS) + " |", "|---|---|" + "---|" * len(VARIANTS)]
    for size, by_v in results.items():
        for op in OPS:
            cells = []
            for v in VARIANTS:
                s = by_v.get(v, {}).get(op)
                cells.append("n/a" if not s else f"{s['mbps']:.0f} MB/s ({s['p50_ms']:.2f}/{s['p99_ms']:.2f} ms)")
            lines.append(f"| {size} | {op} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--pages", default="64K,256K,1M,2M")
    ap.add_argument("--no-mooncake", action="store_true")
    a = ap.parse_args(argv)
    sizes = {"64K": 64 * KiB, "256K": 256 * KiB, "1M": MiB, "2M": 2 * MiB}
    reps = 5 if a.quick else 30
    rig = None
    if not a.no_mooncake:
        rig = SB.MooncakeRig(segment=max(256 * MiB, 3 * a.batch * 2 * MiB))
    t0 = time.time()
    results = {}
    load = {"before": os.getloadavg()}
    try:
        for name in a.pages.split(","):
            pb = sizes[name]
            r = reps if pb < MiB else max(3, reps // 2)
            results[name] = bench(pb, a.batch, r, rig)
            print(f"{name}: done", flush=True)
    finally:
        if rig is not None:
            rig.close()
    load["after"] = os.getloadavg()
    redis_version = subprocess.run(["redis-server", "--version"], capture_output=True, text=True).stdout.strip()
    flags = [f for f in open("/proc/cpuinfo").read().split() if f.startswith(("amx", "avx512f", "avx512_bf16"))]
    from redis.utils import HIREDIS_AVAILABLE

    doc = {"what": "redis L3 store vs tierkv server (tcp, shm) and mooncake", "batch_pages": a.batch,
           "redis_parser": "hiredis" if HIREDIS_AVAILABLE else "python (redis-py's own; hiredis not installed)",
           "reps": reps, "wall_s": round(time.time() - t0, 1), "load_average": load, "redis_server": redis_version,
           "host": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                    "flags": sorted(set(flags))},
           "code": code_state(), "results": results}
    out = Path(tempfile.gettempdir()) / "storage_redis_quick.json" if a.quick else RESULTS
    out.write_text(json.dumps(doc, indent=1))
    print(table(results))
    print(f"load average before {load['before']}, after {load['after']}; wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
