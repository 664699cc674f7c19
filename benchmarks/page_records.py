"""L3 records of several blocks (issue 20 item 4): what ``page_size`` = 1, 2 or 4 x the engine block size changes
for the file L3, through the worker's own path.

One L2 host pool of block rows (``layer_first``, :class:`tierkv.connector.worker.MultiBlockPages` for k > 1 blocks
per page) holds ``--tokens`` tokens of KV of a model with ``--layers`` layers, ``--kv-heads`` KV heads of
``--head-dim`` (bf16), ``--block`` tokens per engine block. For each k, :class:`tierkv.connector.l3_io.L3IO` (the
connector's L3 threads, default ``controller`` settings: batches of 16 pages, the file store's 4 read threads) runs

- ``store``: one backup job of every page (the pages' XXH3 taken beforehand, as when they entered L2),
- ``load``: one prefetch job of every page back into the same slots, the records in the page cache,
- ``load_cold``: the same after ``fdatasync`` + ``posix_fadvise(DONTNEED)`` of every record file,

each timed from ``submit`` until the I/O threads are idle; the bytes read back are compared with the originals
(untimed). Reported per k: microseconds per token (median over ``--reps`` repetitions and the range), MB/s, records
per token and L3 files. The order of k rotates between repetitions so drift of the (shared) machine hits every k.

    .venv/bin/python benchmarks/page_records.py                   # writes benchmarks/results/page_records.json
    .venv/bin/python benchmarks/page_records.py --readme-from benchmarks/results/page_records.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "page_records.json"
KS = (1, 2, 4)


def cpu_model() -> str:
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        return next(line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name"))
    except Exception:  # lscpu missing: the platform's name
        return platform.processor() or "unknown"


def run_one(k: int, args, root: str, seed: int) -> dict:
    from tierkv.connector.host_pool import HostPool
    from tierkv.connector.l3_io import L3IO
    from tierkv.connector.page_checksums import SlotChecksums
    from tierkv.connector.plan import JOB_BACKUP, JOB_PREFETCH, Job
    from tierkv.connector.worker import MultiBlockPages
    from tierkv.storage_backends.file import FileStore

    block_bytes = 2 * args.kv_heads * args.head_dim * args.block * 2  # one layer's K and V of one block, bf16
    n_blocks = args.tokens // args.block
    rows = HostPool(n_blocks, args.layers, block_bytes)
    host = MultiBlockPages(rows, k) if k > 1 else rows
    n = host.num_slots
    g = torch.Generator().manual_seed(seed)
    rows.buffer.copy_(torch.randint(0, 256, rows.buffer.shape, dtype=torch.uint8, generator=g))
    want = rows.buffer.clone()
    ns = os.urandom(16)
    store = FileStore(ns, host.page_bytes, root=root)
    sums = SlotChecksums(n)
    keys = [os.urandom(16) for _ in range(n)]
    for s, key in enumerate(keys):
        sums.record(s, key, host.page_checksum(s))
    l3 = L3IO(store, host, ns, sums)
    out = {"k": k, "page_bytes": host.page_bytes, "records": n, "tokens": n_blocks * args.block}
    try:
        def timed(job) -> float:
            t0 = time.perf_counter()
            l3.submit([job])
            assert l3.wait_idle(600), "L3 jobs did not end"
            dt = time.perf_counter() - t0
            l3.poll()
            reps = l3.take_reports()
            assert len(reps) == 1 and all(reps[0].ok), (job.kind, reps)
            return dt

        out["store_s"] = timed(Job(1, JOB_BACKUP, keys, slots=list(range(n))))
        files = [os.path.join(d, f) for d, _, fs in os.walk(root) for f in fs if f.endswith(".page")]
        out["files"] = len(files)
        for name, jid in (("load_s", 2), ("load_cold_s", 3)):
            if name == "load_cold_s":
                for p in files:
                    fd = os.open(p, os.O_RDONLY)
                    try:
                        os.fdatasync(fd)
                        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    finally:
                        os.close(fd)
            rows.buffer.zero_()
            out[name] = timed(Job(jid, JOB_PREFETCH, keys, slots=list(range(n)), block_ids=[0] * (n * k),
                                  fetch=[True] * n, req_id="bench", blocks_per_page=k))
            assert torch.equal(rows.buffer, want), f"k={k}: bytes read back differ"
    finally:
        l3.close(10)
        store.clear()
        store.close()
    return out


def summarize(runs: list[dict]) -> list[dict]:
    rows = []
    for k in KS:
        mine = [r for r in runs if r["k"] == k]
        tok, pb = mine[0]["tokens"], mine[0]["page_bytes"]
        row = {"k": k, "page_bytes": pb, "records_per_token": 1 / (tok / mine[0]["records"]),
               "files": mine[0]["files"]}
        for op in ("store_s", "load_s", "load_cold_s"):
            us = sorted(1e6 * r[op] / tok for r in mine)
            row[op.replace("_s", "_us_per_token")] = {"median": statistics.median(us), "min": us[0], "max": us[-1]}
            row[op.replace("_s", "_mbps")] = statistics.median(r["records"] * pb / r[op] / 1e6 for r in mine)
        rows.append(row)
    return rows


def readme(res: dict) -> str:
    c = res["conditions"]
    base = {r["k"]: r for r in res["rows"]}[1]
    lines = ["## page_records", "",
             f"`benchmarks/page_records.py` (issue 20 item 4): the file L3 through the connector's L3 threads "
             f"(`L3IO`, batches of 16 pages, 4 read threads) for pages of k = 1, 2, 4 engine blocks of "
             f"{c['block']} tokens; {c['tokens']} tokens of KV of {c['layers']} layers x {c['kv_heads']} KV heads "
             f"x {c['head_dim']} (bf16, {c['bytes_per_token'] // 1024} KiB a token), one job per operation "
             f"(store: back up every page; load: read every page back into L2, records in the page cache; "
             f"load_cold: after `posix_fadvise(DONTNEED)`). Median of {c['reps']} repetitions (k order rotated), "
             "[min-max] in brackets; gain = k=1 time / this time (medians).", "",
             f"Conditions: {c['cpu']}, {c['cpus']} CPUs, load average {c['load_before']:.2f} before and "
             f"{c['load_after']:.2f} after the {c['wall_s']:.0f} s run ({c['date']}, at {(c['commit'] or '?')[:7]}); the machine "
             "is shared with other engineers' tests and builds, so single rows swing.", "",
             "| page | record | records/token | store us/token | load us/token | load_cold us/token | store gain "
             "| load gain | load_cold gain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        def cell(op):
            v = r[op]
            return f"{v['median']:.2f} [{v['min']:.2f}-{v['max']:.2f}]"

        def gain(op):
            return f"{base[op]['median'] / r[op]['median']:.2f}x"
        lines.append(f"| {r['k']} block{'s' if r['k'] > 1 else ''} ({r['k'] * c['block']} tokens) | "
                     f"{r['page_bytes'] // 1024} KiB | 1/{round(1 / r['records_per_token'])} | "
                     f"{cell('store_us_per_token')} | {cell('load_us_per_token')} | {cell('load_cold_us_per_token')} | "
                     f"{gain('store_us_per_token')} | {gain('load_us_per_token')} | {gain('load_cold_us_per_token')} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--layers", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="store directory (default: a temporary one under the repository)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--readme-from", default=None, help="print the README section of a result file and exit")
    args = ap.parse_args(argv)
    if args.readme_from:
        print(readme(json.loads(Path(args.readme_from).read_text())), end="")
        return 0
    if args.tokens % (args.block * max(KS)):
        ap.error(f"--tokens must be a multiple of {args.block * max(KS)}")
    from results_check import code_state  # benchmarks/ is on sys.path (__main__)
    load_before = os.getloadavg()[0]
    t0 = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="page-records-", dir=args.dir or str(ROOT / "benchmarks")) as d:
        for rep in range(args.reps):
            order = KS[rep % len(KS):] + KS[:rep % len(KS)]
            for k in order:
                r = run_one(k, args, os.path.join(d, f"k{k}-r{rep}"), seed=rep)
                r["rep"] = rep
                runs.append(r)
                print(f"rep {rep} k={k}: store {r['store_s']:.3f} s, load {r['load_s']:.3f} s, "
                      f"load_cold {r['load_cold_s']:.3f} s, {r['files']} files", flush=True)
    res = {"conditions": {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_before": load_before,
                          "load_after": os.getloadavg()[0], "wall_s": time.time() - t0, "reps": args.reps,
                          "tokens": args.tokens, "block": args.block, "layers": args.layers,
                          "kv_heads": args.kv_heads, "head_dim": args.head_dim,
                          "bytes_per_token": args.layers * 2 * args.kv_heads * args.head_dim * 2,
                          "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **code_state()},
           "rows": None, "runs": runs}
    res["rows"] = summarize(runs)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(readme(res), end="")
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    sys.exit(main())
