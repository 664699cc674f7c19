"""Where the CPU of an in-process vLLM CPU engine goes, thread by thread: is any core ever idle for tierkv's threads?

One configuration (``--config``, a name of ``benchmarks/serve_cpu``'s full pass; default the file L3 at capacity)
of vLLM's offline ``LLM`` engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, worker, OpenMP team and tierkv's
threads in this one process; the ``demo`` model, float32 by default, L1 and tierkv sizes of ``serve_cpu``'s full
pass, TCMalloc preloaded when installed: the script starts itself again with it), warmed up on 4 prompts, then two phases on random 1,088-token prompts
with 16 output tokens: ``c1`` (16 prompts one after the other) and ``c8`` (48 prompts in one call, 8 at a time).
For every thread of the process, its CPU seconds over each phase (``/proc/self/task/*/stat``: user + system), as a
share of the phase's wall time, with its kernel name (tierkv's are ``tkv-*``) and the CPU it last ran on.

    .venv/bin/python -m benchmarks.engine_threads              # results/engine_threads.json + its README table printed
    .venv/bin/python -m benchmarks.engine_threads --readme-from benchmarks/results/engine_threads.json
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import results as results_check
from benchmarks.harness.machine import cpu_model
from benchmarks.serve_cpu.configs import BLOCK, FULL, kv_config

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results" / "engine_threads.json"
SECTION = "engine_threads"


def thread_cpu() -> dict[str, dict]:
    """tid -> {"name", "cpu_s" (user + system seconds), "last_cpu"} of every thread of this process."""
    tck = os.sysconf("SC_CLK_TCK")
    out = {}
    for d in glob.glob(f"/proc/{os.getpid()}/task/*"):
        try:
            stat, name = Path(d, "stat").read_text(), Path(d, "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        f = stat.rsplit(")", 1)[1].split()
        out[d.rsplit("/", 1)[1]] = {"name": name, "cpu_s": (int(f[11]) + int(f[12])) / tck, "last_cpu": int(f[36])}
    return out


def measure(args) -> dict:
    """Build the engine, run the two phases, return each phase's wall time and per-thread CPU."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from benchmarks import no_reuse_cost as nrc
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    p = FULL
    mk = harness.make_tiny_model()
    model = mk.make_model(ROOT / "runs" / "serve_cpu" / "models" / p["preset"], p["preset"])
    kvc = kv_config(args.config, p, Path(tempfile.mkdtemp(prefix="engine-threads-")), None)
    llm = LLM(model=str(model), dtype=args.dtype, block_size=BLOCK, num_gpu_blocks_override=p["l1_blocks"],
              max_model_len=p["max_model_len"], enable_prefix_caching=True, enforce_eager=True, max_num_seqs=8,
              seed=0, kv_transfer_config=KVTransferConfig(**kvc) if kvc else None)
    sp = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    vocab = llm.llm_engine.model_config.get_vocab_size()
    llm.generate([TokensPrompt(prompt_token_ids=q) for q in nrc.prompts(-1, "warm", 4, 1088, vocab)], sp,
                 use_tqdm=False)
    phases = {}
    for phase, n in (("c1", 16), ("c8", 48)):
        ps = [TokensPrompt(prompt_token_ids=q) for q in nrc.prompts(7, phase, n, 1088, vocab)]
        t0, w = thread_cpu(), time.perf_counter()
        if phase == "c1":
            for q in ps:
                llm.generate([q], sp, use_tqdm=False)
        else:
            llm.generate(ps, sp, use_tqdm=False)
        w, t1 = time.perf_counter() - w, thread_cpu()
        rows = [{"tid": tid, "name": v["name"], "last_cpu": v["last_cpu"],
                 "cpu_s": round(v["cpu_s"] - t0.get(tid, {"cpu_s": 0.0})["cpu_s"], 2)} for tid, v in t1.items()]
        phases[phase] = {"wall_s": round(w, 3), "threads": sorted((r for r in rows if r["cpu_s"] > 0),
                                                                 key=lambda r: -r["cpu_s"])}
    return phases


def readme(res: dict) -> str:
    """The ``## engine_threads`` section of ``benchmarks/README.md`` from a result file."""
    c = res["conditions"]
    lines = [f"## {SECTION}", "",
             "`benchmarks/engine_threads.py`: the CPU of each thread of an in-process vLLM CPU engine "
             f"(`{c['config']}`, demo model in {c['dtype']}, serve_cpu's full-pass sizes) over a c1 phase (16 random "
             "1,088-token prompts one after the other) and a c8 phase (48 in one call), as a share of the phase's "
             "wall time; threads with under 0.02 s not listed.", "",
             f"Conditions: {c['cpu']}, {c['cpus']} CPUs, load average {c['load_before']:.2f} before "
             f"({c['date']}, at {(c['commit'] or '?')[:7]}).", "",
             "| phase | wall s | thread | last CPU | CPU s | share of wall |", "|---|---|---|---|---|---|"]
    for phase, ph in res["phases"].items():
        for r in (r for r in ph["threads"] if r["cpu_s"] >= 0.02):
            lines.append(f"| {phase} | {ph['wall_s']:.2f} | {r['name']} | {r['last_cpu']} | {r['cpu_s']:.2f} | "
                         f"{100 * r['cpu_s'] / ph['wall_s']:.0f} % |")
    if res.get("note"):
        lines += ["", res["note"]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default="tierkv_l3_file_full", help="a serve_cpu configuration name")
    ap.add_argument("--dtype", default="float32")
    results_check.add_result_args(ap, RESULTS)
    args = ap.parse_args(argv)
    if not args.readme_from and "LD_PRELOAD" not in os.environ:  # the engine with TCMalloc, as the other benchmarks
        from tierkv.engine_env import preload_env, tcmalloc_path
        if tcmalloc_path():
            os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, **preload_env("tcmalloc")})
    if args.readme_from:
        res = results_check.result_with_note(Path(args.readme_from), args.note)
    else:
        load = os.getloadavg()[0]
        phases = measure(args)
        res = {"conditions": {"cpu": cpu_model(), "cpus": os.cpu_count(), "load_before": load,
                              "config": args.config, "dtype": args.dtype,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), **results_check.code_state()},
               "phases": phases, "note": args.note}
        Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    if not args.no_readme:
        results_check.print_section(readme(res))
    print(readme(res), end="")
    return 0


if __name__ == "__main__":
    rc = main()
    sys.stdout.flush()
    os._exit(rc)  # the in-process engine's threads would otherwise keep the interpreter from exiting promptly
