"""serve_cpu's soak (``--soak N``): N requests through one server whose L3 fails 30 % of its operations and whose
``tierkv server`` is SIGKILLed and restarted halfway, then checks that nothing leaked.

:func:`run_soak` returns the record with its checks (:func:`soak_checks`: every request completed; at idle vLLM's KV
cache usage 0, no locked page, no pending job; thread counts unchanged and resident memory grown < 5 % since the
warm-up). ``--heap-watch`` records vLLM's worker with memray (``benchmarks/heap_watch``) and keeps what it did not
free, by Python stack (:func:`heap_report`).
"""
from __future__ import annotations

import contextlib
import json
import os
import signal
import time
import urllib.request
from pathlib import Path
from typing import Optional

from benchmarks.harness import REPO, results
from benchmarks.harness.machine import loadavg
from benchmarks.harness.procs import processes, thread_changes
from benchmarks.harness.servers import VllmServer, ZmqServer, free_port, tail
from benchmarks.harness.stats import deltas, metric, raw_samples, read_stats
from benchmarks.heap_watch.report import leaked_by_stack
from benchmarks.serve_cpu.client import run_client, summarise_run, wait_counted
from benchmarks.serve_cpu.configs import SERVER_ENV, SOAK, conditions, kv_config, vllm_server
from benchmarks.serve_cpu.passes import log_findings, prepare
from benchmarks.serve_cpu.report import SOAK_JSON, render_soak

#: The gauge of vLLM 0.32 for the share of L1 blocks in use (0..1; blocks only cached for prefix reuse are free).
KV_USAGE_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def kv_usage(server: VllmServer) -> tuple[str | None, float | None]:
    """(the name of vLLM's KV cache usage gauge this version exports, its value summed over engines)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for name in KV_USAGE_GAUGES:
        xs = raw_samples(text, name)
        if xs:
            return name, sum(xs)
    return None, None


def engine_processes(server: VllmServer) -> dict[str, dict]:
    """Threads and resident memory of the API server process and every process under it (EngineCore, vLLM's
    resource tracker...), keyed ``<name>:<pid>`` (:func:`~benchmarks.harness.procs.processes`)."""
    return processes(server.proc.pid)


class _SamplesOnly(Exception):
    pass


class ZmqKiller:
    """Watches the server's finished-request counter from a thread (polled every ``poll_s``); once ``at`` more
    requests than in ``before`` are counted, SIGKILLs the ``tierkv server`` by its PID and starts a new one on the
    same port. ``zmq`` is then the new server (the caller stops whichever is current)."""

    def __init__(self, srv: VllmServer, zmq: ZmqServer, port: int, before: dict, at: int, log_path: Path,
                 pythonpath: str, poll_s: float = 0.2):
        import threading
        self.srv, self.zmq, self.port, self.before, self.at = srv, zmq, port, before, at
        self.log_path, self.pythonpath, self.poll_s = log_path, pythonpath, poll_s
        self.record: dict = {"at_requests": at, "done": False}
        #: threads and memory of the engine's processes at every tenth of the run (``2 * at`` requests)
        self.samples: list[dict] = []
        self._next_sample = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zmq-killer", daemon=True)
        self._thread.start()

    def _count(self) -> int:
        n = int(metric(self.srv.metrics(), "vllm:request_success_total")
                - metric(self.before, "vllm:request_success_total"))
        if n >= self._next_sample:
            self.samples.append({"requests": n, "t": time.strftime("%H:%M:%S"), "procs": engine_processes(self.srv)})
            self._next_sample = n + max(1, self.at // 5)
        return n

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                n = self._count()
                if n >= self.at:
                    break
                self._stop.wait(self.poll_s)   # polling interval of the counter, not a synchronisation
            else:
                return
            if self.zmq is None:   # a baseline soak without L3: samples only
                raise _SamplesOnly
            old = self.zmq.proc
            t0 = time.monotonic()
            self.record.update(counted_at_kill=int(n), killed_pid=old.pid, time=time.strftime("%H:%M:%S"))
            os.kill(old.pid, signal.SIGKILL)
            old.wait(timeout=30)
            self.record["killed_exit_code"] = old.returncode
            self.zmq.stop()   # closes its log and pipe; nothing left to signal
            self.zmq = ZmqServer(self.log_path, self.pythonpath, port=self.port)
            self.record.update(restarted_pid=self.zmq.proc.pid, restarted_endpoint=self.zmq.endpoint,
                               restart_s=round(time.monotonic() - t0, 2), done=True)
        except _SamplesOnly:
            pass
        except Exception as e:  # recorded; the soak's checks fail on it
            self.record["error"] = f"{type(e).__name__}: {e}"
        with contextlib.suppress(Exception):
            while not self._stop.is_set():   # the second half: samples only
                self._count()
                self._stop.wait(self.poll_s)   # polling interval of the counter, not a synchronisation

    def join(self, timeout_s: float = 120.0) -> dict:
        self._stop.set()
        self._thread.join(timeout_s)
        self.record["thread_alive"] = self._thread.is_alive()
        return self.record


def idle_state(srv: VllmServer, stats_dir: Path, timeout_s: float, connector: bool = True) -> dict:
    """Poll (bounded) until the engine is idle and tierkv has nothing in flight: KV cache usage 0, and in the
    stats files locked pages 0, free slots + L2 pages = num_slots, no pending job, no page being fetched or backed
    up. Returns the last values seen (whether or not they got there) and the seconds waited."""
    t0 = time.monotonic()
    while True:
        gauge, usage = kv_usage(srv)
        st = read_stats(stats_dir)
        sch, wk = st.get("scheduler", {}), st.get("worker", {})
        state = {"kv_usage_gauge": gauge, "kv_usage": usage,
                 "running": metric(srv.metrics(), "vllm:num_requests_running"),
                 **{k: sch.get(k) for k in ("locked_pages", "free_slots", "l2_pages", "num_slots", "live_requests",
                                            "ctl_pending_jobs", "ctl_fetching_pages", "ctl_backing_up_pages")},
                 **{k: wk.get(k) for k in ("l3_pending_jobs", "l3_backup_queued_pages")}}
        quiet = (usage == 0 and not state["locked_pages"] and not state["ctl_pending_jobs"]
                 and not state["ctl_fetching_pages"] and not state["ctl_backing_up_pages"]
                 and not state["l3_pending_jobs"] and state["free_slots"] is not None
                 and state["free_slots"] + state["l2_pages"] == state["num_slots"])
        if quiet or (not connector and usage == 0) or time.monotonic() - t0 > timeout_s or not srv.alive():
            state["waited_s"] = round(time.monotonic() - t0, 1)
            return state
        time.sleep(0.5)  # polling interval of a condition on the gauges, not a synchronisation


def soak_checks(s: dict) -> dict:
    """PASS/FAIL per check from a soak record."""
    def chk(ok, value, want):
        return {"value": value, "want": want, "result": "PASS" if ok else "FAIL"}
    run, idle, kill = s.get("run") or {}, s.get("idle") or {}, s.get("zmq_kill") or {}
    th0, th1 = s.get("procs_after_warmup") or {}, s.get("procs_at_end") or {}
    rss0 = sum(v["rss_kib"] for v in th0.values())
    rss1 = sum(v["rss_kib"] for k, v in th1.items() if k in th0)
    growth = (rss1 - rss0) / rss0 if rss0 else None
    per_proc = {k: (round((th1[k]["rss_kib"] - v["rss_kib"]) / v["rss_kib"], 4) if k in th1 else None)
                for k, v in th0.items() if v["rss_kib"]}
    # information, not a criterion: growth over the second half (from the first sample at or after the kill)
    mid = next((x["procs"] for x in s.get("samples") or [] if x["requests"] >= s["requests"] // 2), None)
    second = None
    if mid:
        m0 = sum(v["rss_kib"] for k, v in mid.items() if k in th1)
        second = round((sum(th1[k]["rss_kib"] for k in mid if k in th1) - m0) / m0, 4) if m0 else None
    ok_req = run.get("completed") == s["requests"] and run.get("failed") == 0 and not s.get("client_error")
    lim = s["rss_growth_limit"]
    return {
        "no_failed_request": chk(ok_req, {"completed": run.get("completed"), "failed": run.get("failed"),
                                          "client_error": s.get("client_error") or None},
                                 f"{s['requests']} completed, 0 failed"),
        "server_alive": chk(bool(s.get("server_alive_at_end")), s.get("server_alive_at_end"), True),
        "zmq_killed_and_restarted": chk(bool(kill.get("done")) and not kill.get("error"),
                                        {k: kill.get(k) for k in ("counted_at_kill", "killed_exit_code",
                                                                  "restart_s", "error")},
                                        "SIGKILL mid-run, restarted on the same port"),
        "kv_cache_usage_idle_0": chk(idle.get("kv_usage") == 0, idle.get("kv_usage"),
                                     f"{idle.get('kv_usage_gauge')} == 0"),
        "locked_pages_0": chk(idle.get("locked_pages") == 0, idle.get("locked_pages"), 0),
        "free_plus_l2_eq_num_slots": chk(
            idle.get("free_slots") is not None and idle["free_slots"] + idle["l2_pages"] == idle["num_slots"],
            {k: idle.get(k) for k in ("free_slots", "l2_pages", "num_slots")}, "free_slots + l2_pages == num_slots"),
        "pending_jobs_0": chk(not idle.get("ctl_pending_jobs") and not idle.get("l3_pending_jobs")
                              and idle.get("ctl_pending_jobs") is not None,
                              {k: idle.get(k) for k in ("ctl_pending_jobs", "l3_pending_jobs")}, 0),
        "fetching_backing_up_0": chk(idle.get("ctl_fetching_pages") == 0 and idle.get("ctl_backing_up_pages") == 0,
                                     {k: idle.get(k) for k in ("ctl_fetching_pages", "ctl_backing_up_pages")}, 0),
        "threads_as_after_warmup": chk(
            bool(th0) and set(th0) == set(th1) and all(th1[k]["threads"] == v["threads"] for k, v in th0.items()),
            dict({k: [v["threads"], th1.get(k, {}).get("threads")] for k, v in th0.items()},
                 **({"changed": ch} if (ch := thread_changes(th0, th1)) else {})),
            "same processes, same thread counts [after warm-up, end]"),
        "rss_growth_under_limit": chk(growth is not None and growth < lim and all(
            g is not None and g < lim for g in per_proc.values()),
            {"total": None if growth is None else round(growth, 4), "per_process": per_proc,
             "total_second_half": second},
            f"< {lim:.0%} (total and per process)"),
    }


def run_soak(p: dict, sp: dict, model_dir: str, work: Path, pythonpath: str, client_timeout: float,
             config: str = "tierkv_l3_zmq", heap_watch: Optional[Path] = None) -> dict:
    """One soak: ``tierkv_l3_zmq`` with the faulty wrapper; warm-up, then ``sp['requests']`` prefix_repetition
    requests at ``sp['concurrency']`` with a SIGKILL + restart of the ZMQ server at half of them, then the idle
    checks. With ``heap_watch`` (the servers started with :func:`heap_watch_env`), vLLM's worker records its
    allocations with memray from the end of the warm-up to the end of the client's run, and the record gets
    ``heap_watch``: what was allocated then and not freed, by Python stack (:func:`heap_report`). Returns the record
    (the checks in ``checks``)."""
    cdir = work / "soak"
    (cdir / "clients").mkdir(parents=True, exist_ok=True)
    s: dict = dict(sp, config=config, load_before=loadavg())
    t_cfg = time.monotonic()
    port = free_port()
    zmq = ZmqServer(cdir / "zmq_server.log", pythonpath, port=port) if config == "tierkv_l3_zmq" else None
    srv = killer = None
    try:
        kvc = kv_config(config, p, cdir, zmq.endpoint if zmq else None)
        if zmq is not None:
            f = sp["fault_fraction"]
            kvc["kv_connector_extra_config"]["l3.faults"] = {"fail_get": f, "fail_set": f, "fail_exists": f,
                                                             "seed": sp["fault_seed"]}
            s["zmq_endpoint"] = zmq.endpoint
        s["kv_transfer_config"] = kvc
        srv = vllm_server(model_dir, l1_blocks=p["l1_blocks"], max_model_len=p["max_model_len"],
                         kv_transfer_config=kvc, log_path=cdir / "server.log", pythonpath=pythonpath)
        s["startup_s"] = round(srv.wait_ready(420.0), 1)
        srv.complete(list(range(7, 7 + 20)), 2)

        def wl(n, seed):
            return ["--dataset-name", "prefix_repetition", "--num-prompts", str(n),
                    "--prefix-repetition-prefix-len", str(sp["prefix_len"]),
                    "--prefix-repetition-suffix-len", str(sp["suffix_len"]),
                    "--prefix-repetition-num-prefixes", str(sp["num_prefixes"]),
                    "--prefix-repetition-output-len", str(sp["output_len"]), "--seed", str(seed)]
        # warm-up at the soak's concurrency, in rounds of the same workload on other prefixes, until a round
        # leaves the thread counts as they were and grows the processes' resident memory by less than
        # warmup_stable_growth (every pool started: vLLM's, tierkv's readers and writers; the allocators at their
        # working size), at most warmup_max_rounds rounds
        s["warmup"] = []
        prev = engine_processes(srv)
        for i in range(sp["warmup_max_rounds"]):
            before = srv.metrics()
            res, err = run_client(srv, model_dir, wl(sp["warmup_requests"], 90001 + i), sp["concurrency"],
                                  cdir / "clients", f"warmup{i}", client_timeout)
            wait_counted(srv, before, (res or {}).get("completed") or 0)
            s["idle_after_warmup"] = idle_state(srv, cdir / "stats", sp["idle_timeout_s"], kvc is not None)
            now = engine_processes(srv)
            r0, r1 = sum(v["rss_kib"] for v in prev.values()), sum(v["rss_kib"] for v in now.values())
            stable = (set(now) == set(prev) and all(now[k]["threads"] == v["threads"] for k, v in prev.items())
                      and all(now[k]["rss_kib"] - v["rss_kib"] < sp["warmup_stable_growth"] * v["rss_kib"]
                              for k, v in prev.items() if k in now))
            s["warmup"].append({"round": i, "error": err or None, "rss_kib": r1, "rss_growth": round((r1 - r0) / r0, 4),
                                "threads": {k: v["threads"] for k, v in now.items()}, "stable": stable,
                                **({k: res.get(k) for k in ("completed", "failed", "duration")} if res else {})})
            print(f"[serve_cpu] soak: warm-up round {i}: {s['warmup'][-1]}", flush=True)
            prev = now
            if stable or err:
                break
        s["procs_after_warmup"] = engine_processes(srv)
        print(f"[serve_cpu] soak: warm-up done, processes {s['procs_after_warmup']}", flush=True)

        before = srv.metrics()
        s["stats_after_warmup"] = read_stats(cdir / "stats")
        if heap_watch is not None:
            (heap_watch / "START").touch()
        killer = ZmqKiller(srv, zmq, port, before, sp["requests"] // 2, cdir / "zmq_server.log", pythonpath)
        t0 = time.monotonic()
        res, err = run_client(srv, model_dir, wl(sp["requests"], 90002), sp["concurrency"], cdir / "clients",
                              "soak", client_timeout)
        s["wall_s"] = round(time.monotonic() - t0, 1)
        if heap_watch is not None:
            (heap_watch / "STOP").touch()
            s["heap_watch"] = heap_report(heap_watch)
        s["zmq_kill"] = killer.join()
        s["samples"] = killer.samples
        zmq = killer.zmq
        after = wait_counted(srv, before, (res or {}).get("completed") or 0) if srv.alive() else before
        s["client_error"] = err or None
        if res is not None:
            s["run"] = summarise_run(res, deltas(after, before), None)
        s["idle"] = idle_state(srv, cdir / "stats", sp["idle_timeout_s"], kvc is not None)
        s["procs_at_end"] = engine_processes(srv)
        st = read_stats(cdir / "stats")
        s["stats_files"] = st
    except Exception as e:
        s["client_error"] = s.get("client_error") or f"{type(e).__name__}: {e}"
        print(f"[serve_cpu] soak: {type(e).__name__}: {e}", flush=True)
    finally:
        if killer is not None and "zmq_kill" not in s:
            s["zmq_kill"] = killer.join()
            zmq = killer.zmq
        if srv is not None:
            s["server_alive_at_end"] = srv.alive()
            s["stop"] = srv.stop()
        if zmq is not None:
            s["zmq_stop"] = zmq.stop()
    s["elapsed_s"] = round(time.monotonic() - t_cfg, 1)
    s["load_after"] = loadavg()
    s["log"] = log_findings(cdir / "server.log")
    if config == "tierkv_l3_zmq":
        s["zmq_log_tail"] = tail(cdir / "zmq_server.log", 1500)
    if s.get("client_error") or (s.get("run") or {}).get("failed") or s["log"].get("error_lines"):
        s["server_log_tail"] = tail(cdir / "server.log", 6000)
    s["checks"] = soak_checks(s)
    s["all_pass"] = all(c["result"] == "PASS" for c in s["checks"].values())
    return s


HEAP_WATCH_DIR = REPO / "benchmarks" / "heap_watch"


def heap_watch_env(d: Path) -> dict:
    """Server environment for ``--heap-watch``: ``benchmarks/heap_watch`` on ``PYTHONPATH`` (its sitecustomize
    records vLLM's worker with memray between ``d/START`` and ``d/STOP``) and ``TIERKV_HEAP_WATCH=d``; memray from
    the environment or from ``TIERKV_HEAP_WATCH_MEMRAY`` (a ``pip install --target`` folder), which the servers
    inherit."""
    return {"PYTHONPATH": str(HEAP_WATCH_DIR), "TIERKV_HEAP_WATCH": str(d)}


def heap_report(d: Path, wait_s: float = 120.0) -> dict:
    """``{"<pid>": leaked_by_stack(...) or {"error": why}}`` for each capture in ``d``, after waiting up to
    ``wait_s`` for its ``done-<pid>`` marker (memray closes its file when recording stops)."""
    out: dict = {}
    deadline = time.monotonic() + wait_s
    for e in sorted(d.glob("error-*")):
        out[e.name.split("-", 1)[1]] = {"error": e.read_text().strip()}
    for cap in sorted(d.glob("memray-*.bin")):
        pid = cap.stem.split("-", 1)[1]
        while not (d / f"done-{pid}").exists() and time.monotonic() < deadline:
            time.sleep(1)
        try:
            out[pid] = leaked_by_stack(str(cap))
        except Exception as e:  # recorded; the soak's own checks do not depend on it
            out[pid] = {"error": f"{type(e).__name__}: {e}"}
    return out or {"none": {"error": f"no capture in {d}"}}


def soak_main(args, p: dict) -> int:
    """``--soak N``: one soak (:func:`run_soak`), its JSON and its README block printed; 1 if a check failed."""
    sp = dict(SOAK, requests=args.soak)
    started, work, model_dir, pythonpath, code = prepare(args, p, "serve_cpu_soak")
    heap = None
    if args.heap_watch:
        heap = work / "heap_watch"
        heap.mkdir(parents=True, exist_ok=True)
        SERVER_ENV.update(heap_watch_env(heap))
    timeout = max(args.client_timeout, 3.0 * sp["requests"])
    s = run_soak(p, sp, model_dir, work, pythonpath, timeout, args.soak_config, heap)
    data = {"benchmark": "serve_cpu_soak", "quick": sp["requests"] < SOAK["requests"], "params": p,
            "started_at": started, "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "code": code, "conditions": conditions(), "run_dir": str(work.relative_to(REPO)), "soak": s,
            "readme_note": args.note}
    out = results.write_result(Path(args.out) if args.out else REPO / "benchmarks" / "results" / SOAK_JSON, data)
    print(f"wrote {out}")
    for name, c in s["checks"].items():
        print(f"  {c['result']}  {name}: {json.dumps(c['value'])[:200]} (want {c['want']})")
    print(f"soak: {'PASS' if s['all_pass'] else 'FAIL'}")
    if not args.no_readme:
        results.print_section(render_soak(data, out.name))
    return 0 if s["all_pass"] else 1

