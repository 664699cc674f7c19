"""Start-up scan of the file L3 store: how long opening a store directory of N records takes, and whether the store
serves while it scans.

Writes N records of ``--page-bytes`` into a fresh directory (default under /tmp), drops nothing from the page cache
(a warm scan, what a restarted engine on the same host sees) and then opens the store ``--repeats`` times, timing
the constructor (``scan_seconds``: the walk, one ``stat`` per file) and the first hit after it. Result:
``benchmarks/results/file_scan.json``.

Usage: ``python benchmarks/file_scan.py [--records 100000] [--page-bytes 1024] [--dir /tmp/x]``.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import tempfile
import time

import numpy as np


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--page-bytes", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--dir", default=None)
    p.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "file_scan.json"))
    a = p.parse_args()
    from tierkv.storage_backends.file.store import FileStore

    root = a.dir or tempfile.mkdtemp(prefix="tierkv-scan-")
    ns = bytes(range(16))
    keys = [f"{i:032x}" for i in range(a.records)]
    page = np.frombuffer(np.random.default_rng(1).bytes(a.page_bytes), dtype=np.uint8)
    try:
        s = FileStore(ns, a.page_bytes, root=root, capacity_bytes=a.records * (a.page_bytes + 64) * 2)
        t0 = time.perf_counter()
        for i in range(0, a.records, 1024):
            s.batch_set(keys[i:i + 1024], [page] * len(keys[i:i + 1024]))
        write_s = time.perf_counter() - t0
        s.close()
        runs = []
        for _ in range(a.repeats):
            t0 = time.perf_counter()
            s = FileStore(ns, a.page_bytes, root=root, capacity_bytes=a.records * (a.page_bytes + 64) * 2)
            open_s = time.perf_counter() - t0
            buf = np.zeros(a.page_bytes, dtype=np.uint8)
            t1 = time.perf_counter()
            hit = s.batch_get([keys[a.records // 2]], [buf])[0]
            runs.append({"open_s": round(open_s, 3), "scan_seconds": round(s.stats()["scan_seconds"], 3),
                         "scan_files": s.stats()["scan_files"], "first_get_ms": round((time.perf_counter() - t1) * 1e3, 3),
                         "hit_ok": bool(hit and np.array_equal(buf, page))})
            s.close()
    finally:
        if a.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    out = {"commit": head, "machine": platform.machine(), "cores": os.cpu_count(),
           "cpu_flags": sorted(x for x in flags if x.startswith(("avx512f", "amx", "avx2"))),
           "records": a.records, "page_bytes": a.page_bytes, "write_s": round(write_s, 2), "runs": runs}
    with open(a.out, "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
