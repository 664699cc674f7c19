"""L3 records of several blocks (issue 20 item 4): what ``page_size`` = 1, 2 or 4 x the engine block size changes
for the file L3, through the worker's own path.

One L2 host pool of block rows (``layer_first``, :class:`tierkv.connector.l2.worker.MultiBlockPages` for k > 1 blocks
per page) holds ``--tokens`` tokens of KV of a model of each ``--models`` shape (``LAYERSxKV_HEADSxHEAD_DIM``,
bf16), ``--block`` tokens per engine block. For each shape and k, :class:`tierkv.connector.l3.io.L3IO` (the
connector's L3 threads, default ``controller`` settings: batches of 16 pages, the file store's 4 read threads) runs

- ``store``: one backup job of every page (the pages' XXH3 taken beforehand, as when they entered L2),
- ``load``: one prefetch job of every page back into the same slots, the records in the page cache,
- ``load_cold``: the same after ``fdatasync`` + ``posix_fadvise(DONTNEED)`` of every record file,

each timed from ``submit`` until the I/O threads are idle; the bytes read back are compared with the originals
(untimed). Reported per shape and k: microseconds per token (median over ``--reps`` repetitions and the range),
MB/s, records per token and L3 files. The order of k rotates between repetitions so drift of the (shared) machine hits every k.

    .venv/bin/python -m benchmarks.page_records                   # writes benchmarks/results/page_records.json
    .venv/bin/python -m benchmarks.page_records --readme-from benchmarks/results/page_records.json
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.harness.results import spread, spread_cell

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "page_records.json"
KS = (1, 2, 4)


def parse_model(text: str) -> tuple[int, int, int]:
    """``"16x4x64"`` -> (layers, KV heads, head dim). Raises ValueError for another form."""
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"bad model shape {text!r}: want LAYERSxKV_HEADSxHEAD_DIM, e.g. 16x4x64")
    return tuple(int(p) for p in parts)


def run_one(k: int, model: tuple[int, int, int], args, root: str, seed: int) -> dict:
    from tierkv.connector.l2.host_pool import HostPool
    from tierkv.connector.l3.io import L3IO
    from tierkv.connector.core.page_checksums import SlotChecksums
    from tierkv.connector.core.plan import JOB_BACKUP, JOB_PREFETCH, Job
    from tierkv.connector.l2.worker import MultiBlockPages
    from tierkv.storage_backends.file.store import FileStore

    layers, kv_heads, head_dim = model
    block_bytes = 2 * kv_heads * head_dim * args.block * 2  # one layer's K and V of one block, bf16
    n_blocks = args.tokens // args.block
    rows = HostPool(n_blocks, layers, block_bytes)
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
    out = {"model": "x".join(map(str, model)), "bytes_per_token": layers * 2 * kv_heads * head_dim * 2, "k": k,
           "page_bytes": host.page_bytes, "records": n, "tokens": n_blocks * args.block}
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
    """One row per (model shape, k): microseconds per token of each operation (median, min, max over the
    repetitions), MB/s (median), records per token, files written."""
    rows = []
    for model in dict.fromkeys(r["model"] for r in runs):
        for k in KS:
            mine = [r for r in runs if r["k"] == k and r["model"] == model]
            tok, pb = mine[0]["tokens"], mine[0]["page_bytes"]
            row = {"model": model, "bytes_per_token": mine[0]["bytes_per_token"], "k": k, "page_bytes": pb,
                   "records_per_token": mine[0]["records"] / tok, "files": mine[0]["files"]}
            for op in ("store", "load", "load_cold"):
                row[op + "_us_per_token"] = spread(1e6 * r[op + "_s"] / tok for r in mine)
                row[op + "_mbps"] = statistics.median(r["records"] * pb / r[op + "_s"] / 1e6 for r in mine)
            rows.append(row)
    return rows


def readme(res: dict) -> str:
    """The ``## page_records`` section of ``benchmarks/README.md`` from a result file."""
    c = res["conditions"]
    lines = ["## page_records", "",
             "`benchmarks/page_records.py` (issue 20 item 4): the file L3 through the connector's L3 threads "
             f"(`L3IO`, batches of 16 pages, 4 read threads) for pages of k = 1, 2, 4 engine blocks of {c['block']} "
             f"tokens; {c['tokens']} tokens of KV per run (bf16; model shape = layers x KV heads x head dim), one job "
             "per operation (store: back up every page; load: read every page back into L2, records in the page "
             "cache; load_cold: after `fdatasync` + `posix_fadvise(DONTNEED)` of every record). Microseconds per "
             f"token, median of {c['reps']} repetitions (k order rotated), [min-max]; gain = k=1 time / this time "
             "(medians).", "",
             f"Conditions: {c['cpu']}, {c['cpus']} CPUs, load average {c['load_before']:.2f} before and "
             f"{c['load_after']:.2f} after the {c['wall_s']:.0f} s run ({c['date']}, at "
             f"{(c['commit'] or '?')[:7]}); the machine is shared with other engineers' tests and engines, so single "
             "rows swing.", "",
             "| model | page | record | records/token | store | load | load_cold | store gain | load gain "
             "| load_cold gain |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = {r["model"]: r for r in res["rows"] if r["k"] == 1}

    def cell(v):
        return spread_cell(v, 2)

    for r in res["rows"]:
        b = base[r["model"]]
        gains = [f"{b[op]['median'] / r[op]['median']:.2f}x"
                 for op in ("store_us_per_token", "load_us_per_token", "load_cold_us_per_token")]
        lines.append(f"| {r['model']} ({r['bytes_per_token'] // 1024} KiB/token) | {r['k']} x {c['block']} tokens | "
                     f"{r['page_bytes'] // 1024} KiB | 1/{round(1 / r['records_per_token'])} | "
                     f"{cell(r['store_us_per_token'])} | {cell(r['load_us_per_token'])} | "
                     f"{cell(r['load_cold_us_per_token'])} | {' | '.join(gains)} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--block", type=int, default=32)
    ap.add_argument("--models", default="16x4x64,4x2x64",
                    help="comma-separated LAYERSxKV_HEADSxHEAD_DIM shapes (default: 16 KiB and 2 KiB a token)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default=None, help="store directory (default: a temporary one under benchmarks/)")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--readme-from", default=None, help="print the README section of a result file and exit")
    args = ap.parse_args(argv)
    if args.readme_from:
        print(readme(json.loads(Path(args.readme_from).read_text())), end="")
        return 0
    if args.tokens % (args.block * max(KS)):
        ap.error(f"--tokens must be a multiple of {args.block * max(KS)}")
    try:
        models = [parse_model(m) for m in args.models.split(",")]
    except ValueError as e:
        ap.error(str(e))
    from benchmarks.harness.results import rotated, run_conditions
    load_before = os.getloadavg()[0]
    t0 = time.time()
    runs = []
    with tempfile.TemporaryDirectory(prefix="page-records-", dir=args.dir or str(ROOT / "benchmarks")) as d:
        for rep in range(args.reps):
            order = rotated(KS, rep)
            for model in models:
                for k in order:
                    r = run_one(k, model, args, os.path.join(d, f"m{len(runs)}"), seed=rep)
                    r["rep"] = rep
                    runs.append(r)
                    print(f"rep {rep} {r['model']} k={k}: store {r['store_s']:.3f} s, load {r['load_s']:.3f} s, "
                          f"load_cold {r['load_cold_s']:.3f} s, {r['files']} files", flush=True)
    res = {"conditions": run_conditions(load_before, t0, reps=args.reps, tokens=args.tokens, block=args.block,
                                        models=args.models),
           "rows": summarize(runs), "runs": runs}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(readme(res), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
