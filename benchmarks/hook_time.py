"""What tierkv adds to each engine step (issue 19: "find what else tierkv takes from the engine's two cores"):
the wall time spent inside tierkv's vLLM hooks, per step, under concurrent load in vLLM's OpenAI server.

For each configuration (``tierkv_l2``, ``tierkv_l3_file`` of ``benchmarks/serve_cpu``, same sizes and model) one
server runs ``vllm bench serve`` once per workload (``random``: no reuse, ``prefix_repetition``, ``multiturn``) at
``--max-concurrency 8``; the counters ``hook_seconds``, ``hook_calls`` and ``hook_steps`` of the scheduler and the
worker (their stats files, ``stats_path``; :func:`tierkv.connector.vllm.connector._timed_hook`) are read before and
after each run. Reported per run: hook time per step on each side, the run's wall time per step (the client's
duration over the steps the scheduler planned: an upper bound of a step's length, since the engine also idles), and
both sides' hook time over the run's duration. Both sides run on the engine's critical path on vLLM's CPU backend
(synchronous scheduling: the engine core plans, the worker executes, one after the other); hook time is wall time,
so it includes waits for the GIL and for a CPU.

    .venv/bin/python -m benchmarks.hook_time                 # results/hook_time.json and its README table printed
    .venv/bin/python -m benchmarks.hook_time --readme-from benchmarks/results/hook_time.json
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import harness
from benchmarks import make_multiturn_trace as trace_gen
from benchmarks.harness import results as results_check
from benchmarks.harness.machine import loadavg
from benchmarks.harness.stats import read_stats
from benchmarks.serve_cpu.client import run_client, workload_args
from benchmarks.serve_cpu.configs import FULL, code_snapshot, conditions, kv_config, vllm_server

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
SECTION = "hook_time"
KEYS = ("hook_seconds", "hook_calls", "hook_steps")


def _counters(stats_dir: Path) -> dict:
    st = read_stats(stats_dir)
    return {r: {k: (st.get(r) or {}).get(k, 0) for k in KEYS} for r in ("scheduler", "worker")}


def _settled(srv, stats_dir: Path, timeout_s: float = 10.0) -> dict:
    """The hook counters once the stats files stop changing (they are written at most every second), after one
    1-token request that makes both sides run a step."""
    srv.complete(list(range(9, 29)), 1)
    last, t0 = None, time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        now = _counters(stats_dir)
        if now == last:
            return now
        last = now
        time.sleep(1.2)  # polling the files' writer interval, not a synchronisation with the engine
    return last


def run_config(name: str, p: dict, work: Path, pythonpath: str, concurrency: int) -> dict:
    cdir = work / name
    (cdir / "clients").mkdir(parents=True, exist_ok=True)
    kvc = kv_config(name, p, cdir, None)
    model_dir = str(work / "model")
    srv = vllm_server(model_dir, l1_blocks=p["l1_blocks"], max_model_len=p["max_model_len"],
                        kv_transfer_config=kvc, log_path=cdir / "server.log", pythonpath=pythonpath)
    out = {"load_before": loadavg(), "runs": []}
    try:
        srv.wait_ready(420)
        srv.complete(list(range(7, 27)), 2)
        for workload in ("random", "prefix_repetition", "multiturn"):
            trace = None
            if workload == "multiturn":
                rows = trace_gen.make_trace(seed=5, conversations=p["mt_conversations"], turns=p["mt_turns"],
                                               first_chunks=p["mt_first_chunks"], turn_chunks=p["mt_turn_chunks"],
                                               output_len=p["mt_output_len"])
                trace = trace_gen.write_trace(cdir / "trace.jsonl", rows)
            before = _settled(srv, cdir / "stats")
            res, err = run_client(srv, model_dir, workload_args(p, workload, 5, trace), concurrency,
                                     cdir / "clients", f"{workload}-c{concurrency}", 900)
            after = _settled(srv, cdir / "stats")
            d = {r: {k: after[r][k] - before[r][k] for k in KEYS} for r in after}
            row = {"workload": workload, "concurrency": concurrency, "error": err or None, "delta": d}
            if res:
                steps = max(1, d["scheduler"]["hook_steps"])
                row.update(duration_s=round(res["duration"], 3), request_throughput=round(res["request_throughput"], 2),
                           steps=d["scheduler"]["hook_steps"],
                           sched_ms_per_step=round(1000 * d["scheduler"]["hook_seconds"] / steps, 3),
                           worker_ms_per_step=round(1000 * d["worker"]["hook_seconds"] / max(1, d["worker"]["hook_steps"]), 3),
                           run_ms_per_step=round(1000 * res["duration"] / steps, 2),
                           hook_share=round((d["scheduler"]["hook_seconds"] + d["worker"]["hook_seconds"])
                                            / res["duration"], 4))
            out["runs"].append(row)
            print(f"   {name} {workload}: {json.dumps({k: v for k, v in row.items() if k != 'delta'})}", flush=True)
    finally:
        out["stop"] = srv.stop()
        out["load_after"] = loadavg()
    return out


def render(data: dict) -> str:
    def share(r):
        return "-" if r.get("hook_share") is None else f"{r['hook_share'] * 100:.1f} %"
    rows = "\n".join(
        f"| {c} | {r['workload']} | {r['concurrency']} | {r.get('steps', '-')} | {r.get('run_ms_per_step', '-')} | "
        f"{r.get('sched_ms_per_step', '-')} ({r.get('sched_cpu_ms_per_step', '-')}) | "
        f"{r.get('worker_ms_per_step', '-')} ({r.get('worker_cpu_ms_per_step', '-')}) | {share(r)} | "
        f"{r.get('request_throughput', '-')} |"
        for c, cfg in data["configs"].items() for r in cfg["runs"])
    cond = data["conditions"]
    loads = ", ".join(f"{n} {c['load_before'][0]}->{c['load_after'][0]}" for n, c in data["configs"].items())
    return f"""## {SECTION}

`benchmarks/hook_time.py` (issue 19): the wall time inside tierkv's vLLM hooks per engine step, under concurrent
load (vLLM's OpenAI server, `vllm bench serve` at `--max-concurrency {data['concurrency']}`, the `serve_cpu` sizes and
`demo` model; counters `hook_seconds` / `hook_steps` of each side from the stats files). On vLLM's CPU backend both
sides are on the critical path of every step. Hook time is wall time: it includes waits for the GIL and for a CPU;
in brackets the CPU time of the hooks' thread in them (``time.thread_time``), tierkv's own work, where the run
recorded it ("-": the hooks no longer read their thread's CPU clock, a system call per hook call).

```bash
.venv/bin/python -m benchmarks.hook_time
```

Measured on tierkv commit `{data['code']['commit'][:12]}` ({data['code'].get('source', '')}), {data['started_at']} ->
{data['finished_at']}, {cond['cpus']} vCPU ({cond['cpu']}), results `results/hook_time.json`; 1-minute load average
before->after each configuration: {loads}. {data.get('note') or ''}

| config | workload | conc | steps | run ms / step | scheduler hooks ms / step (CPU) | worker hooks ms / step (CPU) | hook time / run | req/s |
|---|---|---|---|---|---|---|---|---|
{rows}
"""


def write_readme(data: dict) -> None:
    results_check.print_section(render(data))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="tierkv_l2,tierkv_l3_file")
    ap.add_argument("--concurrency", type=int, default=8)
    results_check.add_result_args(ap, RESULTS / "hook_time.json")
    args = ap.parse_args(argv)
    if args.readme_from:
        write_readme(results_check.result_with_note(Path(args.readme_from), args.note))
        return 0
    p = dict(FULL)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = REPO / "runs" / time.strftime("hook_time-%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    mk = harness.make_tiny_model()
    src = mk.make_model(REPO / "runs" / "serve_cpu" / "models" / p["preset"], p["preset"])
    (work / "model").symlink_to(Path(src).resolve())
    pythonpath, code = code_snapshot(work)
    data = {"benchmark": SECTION, "started_at": started, "code": code, "conditions": conditions(),
            "concurrency": args.concurrency, "params": p, "configs": {}, "note": args.note}
    for name in [c.strip() for c in args.configs.split(",") if c.strip()]:
        print(f"[hook_time] {name}", flush=True)
        data["configs"][name] = run_config(name, p, work, str(pythonpath), args.concurrency)
    data["finished_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {args.out}")
    if not args.no_readme:
        write_readme(data)
    return 0


if __name__ == "__main__":
    sys.exit(main())
