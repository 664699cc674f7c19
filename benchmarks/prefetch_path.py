"""What the L3 readers spend to prefetch one page from the file or the ZMQ store into a ``layer_first`` L2 slot (one
run per layer): read straight into the slot's runs with the checksum the store verified handed back (``vectored``:
the store's ``vectored_destinations`` and ``verified_checksums``; the file store's ``preadv``, the ZMQ store's copy
out of its shared-memory slot), or read into a staging page, copied into the slot and hashed again for the slot's
checksum (``staged``: the path of stores without them, e.g. Mooncake and LMCache; here the same store class with both
switched off, so both go through exactly the code a store of either kind gets).

The readers are the connector's own (:class:`tierkv.connector.l3.io.L3IO` over a :class:`HostPool` of each
``--shapes`` entry, as in ``benchmarks/backup_path.py``; one reader thread, default batches of 16 pages). Each
configuration has its own store holding ``--pages`` pages' worth of 128 KiB (written once: the file store's reads are
served from the page cache, so what is measured is the CPU of the read path, not a disk; the ZMQ store is a
``tierkv server`` process each, ``l3.zmq.shm: auto``); each repetition prefetches all of
them in jobs of 34 pages (a 1,088-token prompt) into the pool's slots, the configuration order rotated between
repetitions. Recorded per run: this process's CPU (user + system; the reader is the only thread working, the main
thread waits), for ZMQ the server process's CPU (``/proc``) and the wall time, per page; every page read is checked against what was written after each run.

    .venv/bin/python -m benchmarks.prefetch_path            # writes results/prefetch_path.json + its README table printed
    .venv/bin/python -m benchmarks.prefetch_path --readme-from benchmarks/results/prefetch_path.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import results as results_check
from benchmarks.backup_path import (JOB_PAGES, MODELS, NS, _server_cpu_s, parse_shape, start_zmq_server,  # noqa: E402
                         stop_zmq_server)
from benchmarks.harness.results import spread_cell

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "prefetch_path.json"
SECTION = "prefetch_path"
CONFIGS = ("file_staged", "file_vectored", "zmq_staged", "zmq_vectored")
DEFAULT_SHAPES = "demo,bench,32x64"


class Setup:
    """One configuration: its store (holding ``n`` pages of random bytes), its L3IO and, for ZMQ, its server."""

    def __init__(self, config: str, host, n: int, d: str):
        from tierkv.connector.l3.io import L3IO
        from tierkv.connector.core.page_checksums import SlotChecksums
        from tierkv.storage_backends.file.store import FileStore

        from tierkv.storage_backends.zmq.client import ZmqStore

        kind, path = config.split("_")
        self.server = None
        if kind == "zmq":
            self.server, endpoint = start_zmq_server(2 * n * host.page_bytes + (64 << 20))
            cls, opts = ZmqStore, {"endpoint": endpoint, "shm": "auto"}
        else:
            cls, opts = FileStore, {"root": os.path.join(d, config)}
        if path == "staged":
            cls = type(f"StagedRead{cls.__name__}", (cls,), {"vectored_destinations": False,
                                                             "verified_checksums": False})
        self.store = cls(NS, host.page_bytes, **opts)
        self.checksums = SlotChecksums(host.num_slots)
        self.l3 = L3IO(self.store, host, NS, self.checksums, read_threads=1)
        assert self.l3._vectored_read is (path == "vectored"), "the configuration's read path"
        self.host, self.n = host, n
        self.keys = [os.urandom(16) for _ in range(n)]
        self.pages = [os.urandom(host.page_bytes) for _ in range(n)]
        from tierkv.connector.l3.io import l3_key
        assert all(self.store.batch_set([l3_key(NS, k)], [p]) == [True] for k, p in zip(self.keys, self.pages))
        self.job_id = 0

    def prefetch(self) -> dict:
        """Prefetch every page (slots round-robin, a job of :data:`JOB_PAGES` at a time so no slot is read twice in
        one job); CPU and wall per page; raises AssertionError if a page read is not what was written."""
        from tierkv.connector.core.plan import JOB_PREFETCH, Job

        slots_n = self.host.num_slots
        cpu = wall = server = 0.0
        for s in range(0, self.n, JOB_PAGES):
            keys = self.keys[s:s + JOB_PAGES]
            self.job_id += 1
            slots = [(s + i) % slots_n for i in range(len(keys))]
            job = Job(self.job_id, JOB_PREFETCH, keys, slots=slots, block_ids=list(range(len(keys))),
                      fetch=[True] * len(keys), req_id=f"r{self.job_id}")
            r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
            s0 = _server_cpu_s(self.server.pid) if self.server else 0.0
            self.l3.submit([job])
            assert self.l3.wait_idle(600.0)
            wall += time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            server += (_server_cpu_s(self.server.pid) - s0) if self.server else 0.0
            cpu += (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
            self.l3.poll()
            (rep,) = self.l3.take_reports()
            assert all(rep.ok), f"job {self.job_id}: {rep.ok}"
            for i, slot in enumerate(slots):  # outside the timed span: the page and its recorded checksum
                assert bytes(self.host.read_page(slot).numpy()) == self.pages[s + i]
                assert self.checksums.get(slot, keys[i]) == self.host.page_checksum(slot)
        return {"pages": self.n, "cpu_us_per_page": cpu / self.n * 1e6,
                "server_cpu_us_per_page": server / self.n * 1e6, "wall_us_per_page": wall / self.n * 1e6}

    def close(self) -> None:
        self.l3.close()
        self.store.close()
        if self.server is not None:
            stop_zmq_server(self.server)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (shape, configuration): median, min and max per page over the repetitions."""
    return results_check.spread_rows(runs, CONFIGS, ("cpu_us_per_page", "server_cpu_us_per_page", "wall_us_per_page"),
                                     carry=("runs", "run_bytes"), totals=("pages",))


def readme(res: dict) -> str:
    """The ``## prefetch_path`` section of ``benchmarks/README.md`` from a result file."""
    c = res["conditions"]
    lines = [f"## {SECTION}", "",
             "`benchmarks/prefetch_path.py`: what the connector's L3 readers (`L3IO`, one reader, default batches) "
             "spend per page they prefetch from the file store (pages in the page cache) or a ZMQ server (shared "
             "memory) into a `layer_first` L2 slot: read straight into the slot's runs with the checksum the store "
             "verified handed back (`vectored`: `vectored_destinations` and `verified_checksums`), or read into a "
             "staging page, copied into the slot and hashed again (`staged`: the path of stores without them; here "
             "the same store class with both off). Shapes: runs per page x bytes per run (`demo`: the demo preset's fp32 KV, `bench`: "
             "the bench preset's bf16 KV, else synthetic). "
             f"{c['pages']} pages' worth of 128 KiB per run in jobs of {JOB_PAGES}, {c['reps']} repetitions, order "
             "rotated; median [min-max] microseconds per page of this process's CPU (user + system), of the ZMQ "
             "server process's CPU and of wall time; every page read checked against what was written.", "",
             f"Conditions: {c['cpu']}, {c['cpus']} CPUs, load average {c['load_before']:.2f} before and "
             f"{c['load_after']:.2f} after the {c['wall_s']:.0f} s run ({c['date']}, at {(c['commit'] or '?')[:7]}).",
             "",
             "| shape | page | configuration | reader CPU us/page | server CPU us/page | both, vs staged | wall us/page "
             "| pages |",
             "|---|---|---|---|---|---|---|---|"]
    by = {(r["shape"], r["config"]): r for r in res["rows"]}

    def both(r):
        return r["cpu_us_per_page"]["median"] + (r.get("server_cpu_us_per_page") or {}).get("median", 0.0)
    for r in res["rows"]:
        kind = r["config"].split("_")[0]
        ratio = both(r) / both(by[(r["shape"], f"{kind}_staged")])
        server = spread_cell(r["server_cpu_us_per_page"]) if kind == "zmq" else "-"
        lines.append(f"| {r['shape']} ({r['runs']} x {r['run_bytes'] // 1024} KiB) | "
                     f"{r['runs'] * r['run_bytes'] // 1024} KiB | {r['config']} | "
                     f"{spread_cell(r['cpu_us_per_page'])} | {server} | {ratio:.2f} | "
                     f"{spread_cell(r['wall_us_per_page'])} | {r['pages']} |")
    if res.get("note"):
        lines += ["", res["note"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help=f"comma-separated presets ({', '.join(MODELS)}) or LAYERSxKIB (default {DEFAULT_SHAPES})")
    ap.add_argument("--pages", type=int, default=2176, help="pages' worth of 128 KiB per configuration and run")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--dir", default=None, help="directory for the file stores (default: a temporary one under "
                                                "benchmarks/)")
    results_check.add_result_args(ap, RESULTS)
    args = ap.parse_args(argv)
    if args.readme_from:
        res = results_check.result_with_note(Path(args.readme_from), args.note)
    else:
        from tierkv.connector.l2.host_pool import HostPool
        try:
            shapes = {name: parse_shape(name) for name in args.shapes.split(",") if name}
        except ValueError as e:
            ap.error(str(e))
        load_before, t0 = os.getloadavg()[0], time.time()
        d = tempfile.mkdtemp(prefix="prefetch-path-", dir=args.dir or str(ROOT / "benchmarks"))
        runs = []
        try:
            for shape, (layers, run_bytes) in shapes.items():
                host = HostPool(256, layers, run_bytes)
                n = max(JOB_PAGES, args.pages * (128 << 10) // host.page_bytes)
                setups = {}
                try:
                    for c in CONFIGS:
                        setups[c] = Setup(c, host, n, os.path.join(d, shape))
                        setups[c].prefetch()  # warm: the page cache, the reader and the first-touch of the slots
                    for rep in range(args.reps):
                        for c in results_check.rotated(CONFIGS, rep):
                            r = {"shape": shape, "runs": layers, "run_bytes": run_bytes, "config": c, "rep": rep,
                                 **setups[c].prefetch()}
                            runs.append(r)
                            print(f"{shape} rep {rep} {c}: reader {r['cpu_us_per_page']:.0f} us CPU/page, wall "
                                  f"{r['wall_us_per_page']:.0f}", flush=True)
                finally:
                    for st in setups.values():
                        st.close()
        finally:
            shutil.rmtree(d, ignore_errors=True)
        res = {"conditions": results_check.run_conditions(load_before, t0, reps=args.reps, shapes=args.shapes,
                                                          pages=args.pages),
               "rows": summarize(runs), "runs": runs, "note": args.note}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if not args.no_readme:
        results_check.print_section(readme(res))
    print(readme(res), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
