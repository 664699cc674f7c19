"""serve_cpu's passes: one server per configuration, every (workload, concurrency, repeat) run against it.

:class:`ConfigServer` starts one configuration's servers (vLLM's, and a ``tierkv server`` or a tmpfs L3 root where it
needs one), runs client runs against it and stops it by PID, recording per run the client's result, the counter
deltas, the CPU seconds of each process and thread, and tierkv's hook time. :func:`run_config` runs a configuration's
runs one after another; :func:`run_interleaved` keeps every server up and rotates the configurations run by run.
:func:`prepare` makes the run directory, the model and the code snapshot measured.
"""
from __future__ import annotations

import os
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Optional

from benchmarks import harness
from benchmarks.harness import REPO, results
from benchmarks.harness.machine import loadavg
from benchmarks.harness.procs import children_cpu_seconds, cpu_delta, cpu_seconds, machine_cpu_seconds
from benchmarks.harness.servers import RedisServer, VllmServer, ZmqServer, tail
from benchmarks.harness.stats import deltas, hook_delta, read_stats, settled_stats
from benchmarks.serve_cpu.client import run_client, run_seed, summarise_run, wait_counted, workload_args
from benchmarks.serve_cpu.configs import ZMQ_L3_CAPACITY, code_snapshot, kv_config, vllm_server

_LOG_PROBLEM = re.compile(r"\bERROR\b|Traceback|CRITICAL|given twice|EngineDeadError|EngineCore.*died")


def log_findings(log_path: Path, limit: int = 12) -> dict:
    """Warnings and errors of a server log: counts, and the first distinct lines of each kind (timestamps cut).
    Error lines after vLLM's ``[shutdown] API server: shutdown triggered`` (our SIGTERM: vLLM then stops its engine
    with a zero timeout, and its output handler may log the dead engine) are counted apart from those while
    serving."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    warn, err, err_shutdown = [], [], []
    stopping = False
    for ln in lines:
        if "shutdown triggered" in ln:
            stopping = True
        text = re.sub(r"^\S*\s*(\(\w+ pid=\d+\)\s*)?(INFO|WARNING|ERROR|DEBUG)?\s*\d\d-\d\d \d\d:\d\d:\d\d\s*", "",
                      ln).strip()
        if "WARNING" in ln and "tierkv" in ln.lower():
            warn.append(text[:300])
        elif _LOG_PROBLEM.search(ln):
            (err_shutdown if stopping else err).append(text[:300])

    def distinct(xs):
        seen, out = set(), []
        for x in xs:
            k = re.sub(r"\d+", "N", x)
            if k not in seen:
                seen.add(k)
                out.append(x)
        return out[:limit]
    return {"tierkv_warnings": len(warn), "tierkv_warning_samples": distinct(warn), "error_lines": len(err),
            "error_samples": distinct(err), "error_lines_at_shutdown": len(err_shutdown),
            "error_samples_at_shutdown": distinct(err_shutdown)}


class ConfigServer:
    """One configuration's server, with its ZMQ server or tmpfs L3 root, for a series of runs: :meth:`start`, one
    (workload, concurrency, repeat) run per :meth:`run`, then :meth:`finish`, which stops it and returns the
    configuration's record (``load_before``, ``runs``, ``failures``, start-up time, the server log's findings, the
    stats files). Round ``round_no`` > 0 works in its own directory."""

    def __init__(self, name: str, p: dict, args, model_dir: str, work: Path, pythonpath: str,
                 traces: dict[tuple[str, int, int], tuple[Path, list[dict]]], round_no: int = 0):
        self.name, self.p, self.args, self.model_dir, self.traces = name, p, args, model_dir, traces
        self.pythonpath = pythonpath
        self.cdir = work / (name if round_no == 0 else f"{name}-round{round_no}")
        (self.cdir / "clients").mkdir(parents=True, exist_ok=True)
        self.out: dict = {"load_before": loadavg(), "runs": [], "failures": []}
        self.zmq: Optional[ZmqServer | RedisServer] = None  # the L3 server
        self.kvc: Optional[dict] = None
        self.shm_root: Optional[str] = None
        self.srv: Optional[VllmServer] = None
        self.t0 = time.monotonic()

    def start(self) -> bool:
        """Start the servers and send the warm-up request; False (recorded as a failure) if that failed."""
        name, out = self.name, self.out
        try:
            if name in ZMQ_L3_CAPACITY:
                self.zmq = ZmqServer(self.cdir / "zmq_server.log", self.pythonpath, capacity=ZMQ_L3_CAPACITY[name])
                out["zmq_endpoint"] = self.zmq.endpoint
            if name == "tierkv_l3_redis":  # the L3 server is a redis-server; started, measured and stopped alike
                self.zmq = RedisServer(self.cdir / "redis_server.log")
                out["zmq_endpoint"] = self.zmq.endpoint
            if name == "tierkv_l3_file_shm":
                self.shm_root = tempfile.mkdtemp(prefix="tierkv-serve-l3-", dir="/dev/shm")
            self.kvc = kv_config(name, self.p, self.cdir, self.zmq.endpoint if self.zmq else None,
                                 l3_root=self.shm_root, l3_url=getattr(self.zmq, "url", None))
            blocks = self.p["ideal_blocks"] if name == "ideal" else self.p["l1_blocks"]
            out["kv_transfer_config"] = self.kvc
            out["l1_blocks"] = blocks
            print(f"[serve_cpu] {name}: L1 {blocks} blocks, connector "
                  f"{self.kvc['kv_connector'] if self.kvc else 'none'}", flush=True)
            extra = str(REPO / "benchmarks") if name == "noop_connector" else ""
            self.srv = vllm_server(self.model_dir, l1_blocks=blocks, max_model_len=self.p["max_model_len"],
                                  kv_transfer_config=self.kvc, log_path=self.cdir / "server.log",
                                  pythonpath=os.pathsep.join(x for x in [self.pythonpath, extra] if x))
            out["server_log"] = str(self.cdir / "server.log")
            out["startup_s"] = round(self.srv.wait_ready(self.args.start_timeout), 1)
            self.srv.complete(list(range(7, 7 + 20)), 2)   # warm-up: 20 tokens, no full page, unrelated to every run
            return True
        except Exception as e:  # start-up failure: recorded, the next configuration runs
            out["failures"].append({"run": "(server)", "error": f"{type(e).__name__}: {e}"})
            print(f"[serve_cpu] {name}: {type(e).__name__}: {e}", flush=True)
            return False

    @property
    def has_stats(self) -> bool:
        return bool(self.kvc and self.kvc.get("kv_connector_extra_config", {}).get("stats_path"))

    def run(self, workload: str, c: int, r: int, idle: tuple["ConfigServer", ...] = ()) -> Optional[dict]:
        """One client run of (``workload``, concurrency ``c``, repeat ``r``) against this server, appended to
        ``runs`` (and ``failures`` if it failed); None if the server was not running. ``idle``: servers of other
        configurations that are up meanwhile (``--interleave``): their CPU seconds during the run are recorded as
        ``idle_cpu_s``, the proof that they did not compete with this one."""
        srv, out, args = self.srv, self.out, self.args
        seed = run_seed(workload, c, r, getattr(args, "random_seeds", None))
        label = f"{workload}-c{c}-r{r}"
        if srv is None or not srv.alive():
            out["failures"].append({"run": label, "error": "server not running (exited "
                                    f"{srv.proc.returncode if srv else None}) before the run"})
            return None
        trace, rows = self.traces.get((workload, c, r), (None, None))
        before = srv.metrics()
        st0 = settled_stats(self.cdir / "stats") if self.has_stats else None
        load0 = loadavg()
        cpu0 = cpu_seconds(srv.proc.pid)
        zmq0 = cpu_seconds(self.zmq.proc.pid) if self.zmq is not None else None
        others0 = {o.name: cpu_seconds(o.srv.proc.pid) for o in idle if o.srv is not None}
        machine0, client0 = machine_cpu_seconds(), children_cpu_seconds()
        t0 = time.monotonic()
        res, err = run_client(srv, self.model_dir, workload_args(self.p, workload, seed, trace), c,
                              self.cdir / "clients", label, args.client_timeout)
        wall = time.monotonic() - t0
        machine_s, client_s = machine_cpu_seconds() - machine0, children_cpu_seconds() - client0
        after = wait_counted(srv, before, (res or {}).get("completed") or 0) if srv.alive() else before
        run = {"workload": workload, "concurrency": c, "repeat": r, "seed": seed,
               "wall_s": round(wall, 2), "load_before": load0, "load_after": loadavg(),
               "cpu_s": cpu_delta(cpu_seconds(srv.proc.pid), cpu0),
               "machine_cpu_s": {"busy": round(machine_s, 2), "client": round(client_s, 2)}}
        if zmq0 is not None:  # the ``tierkv server`` process: a third process on the engine's CPUs
            run["l3_server_cpu_s"] = cpu_delta(cpu_seconds(self.zmq.proc.pid), zmq0)["total"]
        if others0:
            run["idle_cpu_s"] = {o.name: cpu_delta(cpu_seconds(o.srv.proc.pid), others0[o.name])["total"]
                                 for o in idle if o.name in others0}
        if st0 is not None:
            run["tierkv_hook_s"] = hook_delta(settled_stats(self.cdir / "stats"), st0)
        if res is None:
            run["client_error"] = err
            out["failures"].append({"run": label, "error": err, "server_alive": srv.alive()})
        else:
            run.update(summarise_run(res, deltas(after, before), rows if workload == "multiturn" else None))
            if run.get("failed"):
                out["failures"].append({"run": label, "failed_requests": run["failed"],
                                        "errors": run["errors"], "server_alive": srv.alive()})
        out["runs"].append(run)
        t = run.get("tokens", {})
        print(f"   {self.name} {label}: " + (
            f"{run.get('completed')} ok / {run.get('failed')} failed, "
            f"{run.get('request_throughput', 0):.2f} req/s, TTFT p50 "
            f"{run.get('p50_ttft_ms') or 0:.0f} ms p99 {run.get('p99_ttft_ms') or 0:.0f} ms, "
            f"tokens prompt {t.get('prompt')} L1 {t.get('l1_hit')} L2 {t.get('l2_hit')} "
            f"L3 {t.get('l3_hit')} (failed {t.get('l3_failed')})" if res else f"FAILED: {err[:300]}"), flush=True)
        if not srv.alive():
            out["failures"].append({"run": label, "error": f"server exited with code "
                                    f"{srv.proc.returncode} during the run"})
        return run

    def finish(self) -> dict:
        """Stop the servers (by PID) and return the configuration's record."""
        out = self.out
        try:
            if self.srv is not None:
                out["server_alive_at_end"] = self.srv.alive()
                out["stop"] = self.srv.stop()
        finally:
            if self.zmq is not None:
                out["zmq_stop"] = self.zmq.stop()
            if self.shm_root is not None:  # RAM: gone with the server that wrote it
                shutil.rmtree(self.shm_root, ignore_errors=True)
        out["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        out["load_after"] = loadavg()
        out["log"] = log_findings(self.cdir / "server.log")
        if out["failures"] or out["log"].get("error_lines"):
            out["server_log_tail"] = tail(self.cdir / "server.log", 6000)
        if self.kvc is not None:
            out["stats_files"] = read_stats(self.cdir / "stats")
        return out


def run_config(name: str, p: dict, args, model_dir: str, work: Path, pythonpath: str,
               traces: dict[tuple[str, int, int], tuple[Path, list[dict]]], repeats: Optional[list[int]] = None,
               round_no: int = 0) -> dict:
    """One server of configuration ``name`` and every (workload, concurrency, repeat in ``repeats``) run on it
    (``repeats`` default ``range(args.repeats)``); round ``round_no`` > 0 works in its own directory."""
    repeats = list(range(args.repeats)) if repeats is None else repeats
    cs = ConfigServer(name, p, args, model_dir, work, pythonpath, traces, round_no)
    try:
        if cs.start():
            try:
                for workload in args.workloads:
                    for c in args.concurrency:
                        for r in repeats:
                            cs.run(workload, c, r)
            except Exception as e:  # an unexpected error: recorded, the next configuration runs
                cs.out["failures"].append({"run": "(server)", "error": f"{type(e).__name__}: {e}"})
                print(f"[serve_cpu] {name}: {type(e).__name__}: {e}", flush=True)
    finally:
        out = cs.finish()
    return out


def wait_quiet(servers: list["ConfigServer"], cpu_s: float = 0.02, every_s: float = 0.25,
               timeout_s: float = 10.0) -> float:
    """Poll until the process trees of ``servers`` used under ``cpu_s`` CPU seconds in all over ``every_s`` (bounded by
    ``timeout_s``); returns the seconds waited. vLLM's worker busy-polls its input queue for about a second of CPU after
    its last step; an interleaved run waits this out on the other servers so that none competes with it."""
    t0 = time.monotonic()
    pids = [cs.srv.proc.pid for cs in servers if cs.srv is not None and cs.srv.alive()]
    while time.monotonic() - t0 < timeout_s:
        before = [cpu_seconds(pid) for pid in pids]
        time.sleep(every_s)  # a sampling interval of a CPU meter, not a synchronisation
        used = sum(cpu_delta(cpu_seconds(pid), b)["total"] for pid, b in zip(pids, before))
        if used < cpu_s:
            break
    return round(time.monotonic() - t0, 2)


def run_interleaved(p: dict, args, model_dir: str, work: Path, pythonpath: str,
                    traces: dict[tuple[str, int, int], tuple[Path, list[dict]]]) -> dict[str, dict]:
    """``--interleave``: every configuration's server up at once, then for each repeat, workload and concurrency
    one run per configuration, back to back, in an order rotated from one such cell to the next (:func:`round_order`),
    so the runs a ratio pairs (same seed) are seconds apart instead of a whole configuration's runs apart and the
    machine's slow drift of speed falls on both sides alike. Only the server under test gets requests; the others
    idle: each run first waits until they are quiet (:func:`wait_quiet`) and records their CPU seconds meanwhile
    (``idle_cpu_s``). Returns ``{name: record}`` as
    :func:`run_config` makes them."""
    servers = [ConfigServer(n, p, args, model_dir, work, pythonpath, traces) for n in args.configs]
    try:
        up = [cs for cs in servers if cs.start()]
        cell = 0
        for r in range(args.repeats):
            for workload in args.workloads:
                for c in args.concurrency:
                    for pos, cs in enumerate(round_order(up, cell)):
                        idle = tuple(x for x in up if x is not cs)
                        try:
                            quiet_s = wait_quiet(list(idle))
                            run = cs.run(workload, c, r, idle=idle)
                        except Exception as e:  # an unexpected error: recorded, the other runs go on
                            cs.out["failures"].append({"run": f"{workload}-c{c}-r{r}",
                                                       "error": f"{type(e).__name__}: {e}"})
                            continue
                        if run is not None:
                            run["position"] = pos
                            run["quiet_wait_s"] = quiet_s
                    cell += 1
    finally:
        records = {}
        for cs in servers:
            try:
                records[cs.name] = cs.finish()
            except Exception as e:  # stop the others regardless
                records[cs.name] = dict(cs.out, stop_error=f"{type(e).__name__}: {e}")
    return records


def round_meta(res: dict) -> dict:
    """What a configuration's record keeps of one round: load average before and after, seconds, start-up time."""
    return {key: res.get(key) for key in ("load_before", "load_after", "elapsed_s", "startup_s")}


def round_order(configs: list, k: int) -> list:
    """The order in which round ``k`` (0-based) starts the configurations: ``configs`` rotated by ``k``, so over a
    number of rounds that is a multiple of ``len(configs)`` every configuration runs first, second ... equally often.
    A fixed order would favour or handicap whichever configuration always runs at one position (a pass where the
    ideal, always first, outran no connector on ``random``, where both do the same work, showed it)."""
    n = len(configs)
    return list(configs[k % n:]) + list(configs[:k % n]) if n else []


def prepare(args, p: dict, name: str):
    """Start time, a new run directory ``runs/<name>-<time>``, the model of ``p["preset"]`` and the code measured
    (``--code``: a git-archive snapshot of HEAD on PYTHONPATH, or the working tree): ``(started, work, model_dir,
    pythonpath, code)``."""
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = REPO / "runs" / time.strftime(f"{name}-%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    print(f"[serve_cpu] run directory {work}", flush=True)
    model_dir = harness.make_tiny_model().make_model(REPO / "runs" / "serve_cpu" / "models" / p["preset"], p["preset"])
    if args.code == "head":
        pythonpath, code = code_snapshot(work)
        return started, work, model_dir, str(pythonpath), code
    return started, work, model_dir, "", dict(results.code_state(), source="working tree")
