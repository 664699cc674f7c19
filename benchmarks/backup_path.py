"""What the L3 writer spends to back up one page of a ``layer_first`` L2 slot (one run per layer), given to the store
as its runs (``vectored``: ``StorageBackend.vectored_sources``, the file store's one ``writev`` of header + runs, the
ZMQ store's copy of each run into its shared-memory slot) or first gathered into one contiguous staging page
(``staged``: the path the writer takes for stores without ``vectored_sources``, e.g. Mooncake and LMCache).

The writer is the connector's own (:class:`tierkv.connector.l3.io.L3IO` over a :class:`HostPool` of each
``--shapes`` entry: a preset's KV pages, ``demo`` in float32 (4 layers x 32 KiB, 128 KiB pages) or ``bench`` in
bfloat16 (8 x 32 KiB), or ``LAYERSxKIB``: that many runs of that many KiB), with its default batches of 16 pages and
no checksum recorded at save time (``controller.verify_checksums`` off, the default: the writer hashes each page).
The staged variant of each store is the same class with ``vectored_sources`` switched off, so both go through
exactly the code a store of either kind gets; the vectored variant is forced for every shape (the connector itself
hands over runs only from ``VECTORED_MIN_RUN_BYTES`` on; the table says which path it takes for the shape). Per
shape, four configurations, each with its own store at
capacity (``--capacity-mib``, 64 MiB: every page written evicts one, as in a store that has filled): ``file_staged``,
``file_vectored`` (file L3 in a directory under ``--dir``), ``zmq_staged``, ``zmq_vectored`` (a ``tierkv server``
process each, ``l3.zmq.shm: auto``). Each is first filled with twice its capacity, then each repetition times the
backup of ``--pages`` pages' worth of 128 KiB (fewer, larger pages for larger shapes) per configuration, in jobs of 34
pages (a 1,088-token prompt), the configuration order rotated between repetitions. Recorded per run: this process's CPU (user + system; the writer is the only thread working, the
main thread waits) and, for ZMQ, the server process's CPU (``/proc``), each per page, and the wall time per page.

    .venv/bin/python -m benchmarks.backup_path            # writes results/backup_path.json + its README table printed
    .venv/bin/python -m benchmarks.backup_path --readme-from benchmarks/results/backup_path.json
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import results as results_check
from benchmarks.harness.results import spread_cell

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "backup_path.json"
SECTION = "backup_path"
CONFIGS = ("file_staged", "file_vectored", "zmq_staged", "zmq_vectored")
JOB_PAGES = 34
NS = bytes(range(16))
#: KV page shapes of examples/make_tiny_model.py's presets: (layers, bytes of one layer's K and V of a 32-token block)
MODELS = {"demo": (4, 2 * 2 * 64 * 32 * 4), "bench": (8, 2 * 4 * 64 * 32 * 2)}
DEFAULT_SHAPES = "demo,bench,64x4,80x16,32x64"


def parse_shape(text: str) -> tuple[int, int]:
    """A ``--shapes`` entry: a :data:`MODELS` preset, or ``LAYERSxKIB`` (runs x KiB per run) -> (runs, run bytes).
    Raises ValueError for anything else."""
    if text in MODELS:
        return MODELS[text]
    parts = text.lower().split("x")
    if len(parts) != 2 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ValueError(f"bad shape {text!r}: a preset ({', '.join(MODELS)}) or LAYERSxKIB, e.g. 64x4")
    return int(parts[0]), int(parts[1]) << 10


def _server_cpu_s(pid: int) -> float:
    f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")


class Setup:
    """One configuration: its store (at capacity once :meth:`fill` ran), its L3IO and, for ZMQ, its server."""

    def __init__(self, config: str, host, capacity: int, d: str):
        from tierkv.connector.l3 import io as l3_io
        from tierkv.connector.l3.io import L3IO
        from tierkv.connector.core.page_checksums import SlotChecksums
        from tierkv.storage_backends.file.store import FileStore
        from tierkv.storage_backends.zmq.client import ZmqStore

        kind, path = config.split("_")
        self.server = None
        if kind == "zmq":
            self.server, endpoint = start_zmq_server(capacity)
            cls, opts = ZmqStore, {"endpoint": endpoint, "shm": "auto"}
        else:
            cls, opts = FileStore, {"root": os.path.join(d, config), "capacity_bytes": capacity}
        if path == "staged":
            cls = type(f"Staged{cls.__name__}", (cls,), {"vectored_sources": False})
        self.store = cls(NS, host.page_bytes, **opts)
        rule = l3_io.VECTORED_MIN_RUN_BYTES
        l3_io.VECTORED_MIN_RUN_BYTES = 1  # vectored whatever the run length (the connector's rule: ``picks``)
        try:
            self.l3 = L3IO(self.store, host, NS, SlotChecksums(host.num_slots), read_threads=1)
        finally:
            l3_io.VECTORED_MIN_RUN_BYTES = rule
        assert self.l3._vectored is (path == "vectored")
        self.host, self.job_id = host, 0

    def backup(self, n: int) -> dict:
        """Back up ``n`` pages (new keys; slots round-robin) in jobs of :data:`JOB_PAGES`; CPU and wall per page."""
        from tierkv.connector.core.plan import JOB_BACKUP, Job

        jobs = []
        for s in range(0, n, JOB_PAGES):
            self.job_id += 1
            jobs.append(Job(self.job_id, JOB_BACKUP, [os.urandom(16) for _ in range(JOB_PAGES)],
                            slots=[(s + i) % self.host.num_slots for i in range(JOB_PAGES)]))
        n = len(jobs) * JOB_PAGES
        r0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        s0 = _server_cpu_s(self.server.pid) if self.server else 0.0
        self.l3.submit(jobs)
        assert self.l3.wait_idle(600.0)
        wall = time.perf_counter() - t0
        r1 = resource.getrusage(resource.RUSAGE_SELF)
        s1 = _server_cpu_s(self.server.pid) if self.server else 0.0
        done = sum(sum(r.ok) for r in self.l3.take_reports())
        cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
        return {"pages": n, "stored": done, "client_cpu_us_per_page": cpu / n * 1e6,
                "server_cpu_us_per_page": (s1 - s0) / n * 1e6, "wall_us_per_page": wall / n * 1e6}

    def close(self) -> None:
        self.l3.close()
        self.store.close()
        if self.server is not None:
            stop_zmq_server(self.server)


def summarize(runs: list[dict]) -> list[dict]:
    """One row per (shape, configuration): median, min and max of each per-page measure over the repetitions."""
    return results_check.spread_rows(runs, CONFIGS, ("client_cpu_us_per_page", "server_cpu_us_per_page",
                                                     "wall_us_per_page"),
                                     carry=("runs", "run_bytes", "picks"), totals=("stored", "pages"))


def start_zmq_server(capacity: int) -> tuple[subprocess.Popen, str]:
    """A ``tierkv server`` process of ``capacity`` bytes on a free loopback port: the process and its endpoint."""
    proc = subprocess.Popen([sys.executable, "-m", "tierkv.cli_server", "--port", "0",
                             "--capacity-bytes", str(capacity)], stdout=subprocess.PIPE, text=True)
    return proc, proc.stdout.readline().split()[-1]


def stop_zmq_server(proc: subprocess.Popen) -> None:
    """End a server :func:`start_zmq_server` started (its PID) and reap it."""
    proc.terminate()
    proc.wait(30)


def readme(res: dict) -> str:
    """The ``## backup_path`` section of ``benchmarks/README.md`` from a result file."""
    c = res["conditions"]
    lines = [f"## {SECTION}", "",
             "`benchmarks/backup_path.py`: what the connector's L3 writer (`L3IO`, default batches, the writer "
             "hashing each page) spends per page it backs up from a `layer_first` L2 slot into a store at capacity "
             f"({c['capacity_mib']} MiB, every write evicting one): the page given as its runs (`vectored`: the "
             "store's `vectored_sources`, forced here for every shape) or gathered into a staging page first "
             "(`staged`: the path of stores without it; here the same store class with it switched off). Shapes: "
             "runs per page x bytes per run (`demo`: the demo preset's fp32 KV, `bench`: the bench preset's bf16 KV, "
             "else synthetic); `picks`: the path the connector takes for that shape (vectored from "
             f"`VECTORED_MIN_RUN_BYTES` = {c['min_run_bytes'] // 1024} KiB per run on). "
             f"{c['pages']} pages' worth of 128 KiB per run in jobs of {JOB_PAGES}, {c['reps']} repetitions, order "
             "rotated; median [min-max] microseconds per page of this process's CPU (user + system), of the ZMQ "
             "server process's CPU and of wall time.", "",
             f"Conditions: {c['cpu']}, {c['cpus']} CPUs, load average {c['load_before']:.2f} before and "
             f"{c['load_after']:.2f} after the {c['wall_s']:.0f} s run ({c['date']}, at {(c['commit'] or '?')[:7]}).",
             "",
             "| shape | page | picks | configuration | writer CPU us/page | server CPU us/page | both, vs staged "
             "| wall us/page | stored |",
             "|---|---|---|---|---|---|---|---|---|"]
    by = {(r["shape"], r["config"]): r for r in res["rows"]}
    cell = spread_cell
    for r in res["rows"]:
        kind = r["config"].split("_")[0]
        both = r["client_cpu_us_per_page"]["median"] + r["server_cpu_us_per_page"]["median"]
        ref = by[(r["shape"], f"{kind}_staged")]
        ratio = both / (ref["client_cpu_us_per_page"]["median"] + ref["server_cpu_us_per_page"]["median"])
        server = cell(r["server_cpu_us_per_page"]) if kind == "zmq" else "-"
        lines.append(f"| {r['shape']} ({r['runs']} x {r['run_bytes'] // 1024} KiB) | "
                     f"{r['runs'] * r['run_bytes'] // 1024} KiB | {r['picks']} | {r['config']} | "
                     f"{cell(r['client_cpu_us_per_page'])} | {server} | {ratio:.2f} | "
                     f"{cell(r['wall_us_per_page'])} | {r['stored']} of {r['pages']} |")
    if res.get("note"):
        lines += ["", res["note"]]
    return "\n".join(lines) + "\n"


def write_readme(res: dict) -> None:
    results_check.print_section(readme(res))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shapes", default=DEFAULT_SHAPES,
                    help=f"comma-separated presets ({', '.join(MODELS)}) or LAYERSxKIB (default {DEFAULT_SHAPES})")
    ap.add_argument("--pages", type=int, default=8704,
                    help="timed pages' worth of 128 KiB per configuration and repetition (the server's CPU is read in "
                         "10 ms ticks)")
    ap.add_argument("--capacity-mib", type=int, default=64, help="each store's capacity (MiB)")
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--dir", default=None, help="directory for the file stores (default: a temporary one under "
                                                "benchmarks/, on the filesystem a file L3 there would use)")
    results_check.add_result_args(ap, RESULTS)
    args = ap.parse_args(argv)
    if args.readme_from:
        res = results_check.result_with_note(Path(args.readme_from), args.note)
        write_readme(res)
        print(readme(res), end="")
        return 0
    import numpy as np
    import torch

    from tierkv.connector.l3 import io as l3_io
    from tierkv.connector.l2.host_pool import HostPool

    try:
        shapes = {name: parse_shape(name) for name in args.shapes.split(",") if name}
    except ValueError as e:
        ap.error(str(e))
    capacity = args.capacity_mib << 20
    load_before, t0 = os.getloadavg()[0], time.time()
    d = tempfile.mkdtemp(prefix="backup-path-", dir=args.dir or str(ROOT / "benchmarks"))
    runs = []
    try:
        for shape, (layers, run_bytes) in shapes.items():
            host = HostPool(256, layers, run_bytes)
            host.buffer.copy_(torch.from_numpy(np.random.default_rng(0).integers(0, 256, host.nbytes,
                                                                                  dtype=np.uint8)))
            picks = "vectored" if run_bytes >= l3_io.VECTORED_MIN_RUN_BYTES else "staged"
            n = max(JOB_PAGES, args.pages * (128 << 10) // host.page_bytes)
            setups = {}
            try:
                for c in CONFIGS:
                    setups[c] = Setup(c, host, capacity, os.path.join(d, shape))
                    setups[c].backup(2 * capacity // host.page_bytes)  # fill: from here on every write evicts one
                for rep in range(args.reps):
                    for c in results_check.rotated(CONFIGS, rep):
                        r = {"shape": shape, "runs": layers, "run_bytes": run_bytes, "picks": picks, "config": c,
                             "rep": rep, **setups[c].backup(n)}
                        runs.append(r)
                        print(f"{shape} rep {rep} {c}: writer {r['client_cpu_us_per_page']:.0f} us CPU/page, server "
                              f"{r['server_cpu_us_per_page']:.0f}, wall {r['wall_us_per_page']:.0f}", flush=True)
            finally:
                for st in setups.values():
                    st.close()
    finally:
        shutil.rmtree(d, ignore_errors=True)
    res = {"conditions": results_check.run_conditions(load_before, t0, reps=args.reps, shapes=args.shapes,
                                                      min_run_bytes=l3_io.VECTORED_MIN_RUN_BYTES,
                                                      capacity_mib=args.capacity_mib, pages=args.pages),
           "rows": summarize(runs), "runs": runs, "note": args.note}
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if not args.no_readme:
        write_readme(res)
    print(readme(res), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
