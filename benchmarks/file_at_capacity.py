"""The file L3 at capacity: what a page write costs when every new record evicts an old one, with evicted record
files overwritten (``l3.file.recycle_evicted: true``, the default) and unlinked then created anew (``false``).

For each ``--page-kib`` size and each repetition, three stores under one directory of the filesystem the store would
use (default: a temporary directory under ``benchmarks/``), each first filled to ``--capacity`` records (counted in
64 KiB pages: a store of larger pages holds and writes proportionally fewer, the same bytes):

- ``recycle``: ``recycle_evicted: true``; ``--writes`` more pages in batches of 16 (the L3 writer's batch), so every
  record written evicts one;
- ``unlink``: the same with ``recycle_evicted: false`` (the code before the option);
- ``below_capacity``: the same writes into a store large enough for all of them (no eviction): the reference.

Each is timed with the process's CPU time (user + system: the kernel's inode, block and directory work counts) and
wall time per page written. Nothing is deleted until the end of the run, because on ext4 a file created shortly
after many deletions pays for scanning past the recently deleted inodes, which would charge one configuration for
another's clean-up. The configuration order rotates between repetitions.

    .venv/bin/python -m benchmarks.file_at_capacity            # writes results/file_at_capacity.json + README
    .venv/bin/python -m benchmarks.file_at_capacity --readme-from benchmarks/results/file_at_capacity.json
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

import numpy as np

from benchmarks.harness import results as results_check
from benchmarks.harness.results import spread, spread_cell

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "file_at_capacity.json"
SECTION = "file_at_capacity"
CONFIGS = ("recycle", "unlink", "below_capacity")
BATCH = 16
NS = bytes(range(16))


def _keys(tag: str, n: int) -> list[str]:
    return [hashlib.blake2b(f"{tag}-{i}".encode(), digest_size=16).hexdigest() for i in range(n)]


def run_one(config: str, page_bytes: int, capacity: int, writes: int, root: str, seed: int) -> dict:
    """Fill a store to ``capacity`` records (untimed), then time ``writes`` more page writes in batches of 16."""
    from tierkv.storage_backends.file.store import FileStore
    from tierkv.storage_backends.page_format import HEADER_BYTES
    rec = HEADER_BYTES + page_bytes
    cap_records = capacity + writes if config == "below_capacity" else capacity
    store = FileStore(NS, page_bytes, root=root, capacity_bytes=cap_records * rec,
                      recycle_evicted=config != "unlink")
    rng = np.random.default_rng(seed)
    srcs = [rng.integers(0, 256, page_bytes, dtype=np.uint8) for _ in range(BATCH)]
    fill = _keys(f"fill-{seed}", capacity)
    for i in range(0, capacity, BATCH):
        store.batch_set(fill[i:i + BATCH], srcs[:len(fill[i:i + BATCH])])
    keys = _keys(f"write-{seed}", writes)
    c0, t0 = time.process_time(), time.perf_counter()
    ok = 0
    for i in range(0, writes, BATCH):
        ok += sum(store.batch_set(keys[i:i + BATCH], srcs[:len(keys[i:i + BATCH])]))
    cpu, wall = time.process_time() - c0, time.perf_counter() - t0
    st = store.stats()
    store.close()
    return {"config": config, "page_bytes": page_bytes, "written": ok, "cpu_us_per_page": 1e6 * cpu / writes,
            "wall_us_per_page": 1e6 * wall / writes, "evictions": st["evictions"], "recycled": st["recycled"]}


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (page size, configuration): CPU and wall microseconds per page (median, min, max)."""
    rows = []
    for pb in dict.fromkeys(r["page_bytes"] for r in runs):
        for c in CONFIGS:
            mine = [r for r in runs if r["page_bytes"] == pb and r["config"] == c]
            row = {"page_bytes": pb, "config": c, "evictions": mine[0]["evictions"], "recycled": mine[0]["recycled"]}
            for k in ("cpu_us_per_page", "wall_us_per_page"):
                row[k] = spread(r[k] for r in mine)
            rows.append(row)
    return rows


def readme(res: dict) -> str:
    """The ``## file_at_capacity`` section of ``benchmarks/README.md`` from a result file."""
    c = res["conditions"]
    lines = [f"## {SECTION}", "",
             "`benchmarks/file_at_capacity.py`: a page write into the file L3 at capacity (every record written "
             "evicts one), with the evicted record files overwritten (`recycle`, `l3.file.recycle_evicted: true`, "
             "the default) or unlinked and new ones created (`unlink`), and into a store with room for every write "
             f"(`below_capacity`, the reference). {c['capacity']} records of 64 KiB filled first, then {c['writes']} "
             f"writes in batches of {BATCH} (larger pages: as many bytes, fewer records); CPU time of the process (user + system) and wall time per page, median of "
             f"{c['reps']} repetitions (order rotated) [min-max]. Filesystem: {c['fs']}.", "",
             f"Conditions: {c['cpu']}, {c['cpus']} CPUs, load average {c['load_before']:.2f} before and "
             f"{c['load_after']:.2f} after the {c['wall_s']:.0f} s run ({c['date']}, at {(c['commit'] or '?')[:7]}).",
             "",
             "| page | configuration | CPU us/page | wall us/page | CPU vs unlink | evictions | recycled |",
             "|---|---|---|---|---|---|---|"]
    unlink = {r["page_bytes"]: r for r in res["rows"] if r["config"] == "unlink"}
    cell = spread_cell

    for r in res["rows"]:
        ratio = r["cpu_us_per_page"]["median"] / unlink[r["page_bytes"]]["cpu_us_per_page"]["median"]
        lines.append(f"| {r['page_bytes'] // 1024} KiB | {r['config']} | {cell(r['cpu_us_per_page'])} | "
                     f"{cell(r['wall_us_per_page'])} | {ratio:.2f} | {r['evictions']} | {r['recycled']} |")
    if res.get("note"):
        lines += ["", res["note"]]
    return "\n".join(lines) + "\n"


def write_readme(res: dict) -> None:
    results_check.print_section(readme(res))


def _fs_of(path: str) -> str:
    best = ("?", "")
    for line in open("/proc/mounts"):
        dev, mnt, fstype, opts = line.split()[:4]
        if path.startswith(mnt) and len(mnt) >= len(best[1]):
            best = (f"{fstype} ({opts})", mnt)
    return best[0]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--page-kib", default="64,256", help="comma-separated page sizes in KiB (default 64,256)")
    ap.add_argument("--capacity", type=int, default=1024, help="records of 64 KiB the store holds (default 1024)")
    ap.add_argument("--writes", type=int, default=2048, help="timed writes of 64 KiB pages per run (default 2048)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="directory for the stores (default: a temporary one under benchmarks/)")
    results_check.add_result_args(ap, RESULTS)
    args = ap.parse_args(argv)
    if args.readme_from:
        res = results_check.result_with_note(Path(args.readme_from), args.note)
        write_readme(res)
        print(readme(res), end="")
        return 0
    sizes = [int(x) * 1024 for x in args.page_kib.split(",")]
    load_before, t0 = os.getloadavg()[0], time.time()
    runs = []
    d = tempfile.mkdtemp(prefix="file-at-capacity-", dir=args.dir or str(ROOT / "benchmarks"))
    try:
        for rep in range(args.reps):
            order = results_check.rotated(CONFIGS, rep)
            for pb in sizes:
                for c in order:
                    scale = max(1, pb // 65536)
                    r = run_one(c, pb, args.capacity // scale, args.writes // scale,
                                os.path.join(d, f"r{len(runs)}"), seed=rep)
                    r["rep"] = rep
                    runs.append(r)
                    print(f"rep {rep} {pb // 1024} KiB {c}: {r['cpu_us_per_page']:.0f} us CPU/page, "
                          f"{r['wall_us_per_page']:.0f} us wall/page", flush=True)
        fs = _fs_of(os.path.realpath(d))
    finally:
        shutil.rmtree(d, ignore_errors=True)
    res = {"conditions": results_check.run_conditions(load_before, t0, reps=args.reps, capacity=args.capacity,
                                                      writes=args.writes, fs=fs),
           "rows": summarize(runs), "runs": runs, "note": args.note}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if not args.no_readme:
        write_readme(res)
    print(readme(res), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
