"""Serving benchmark on vLLM's CPU backend: vLLM's OpenAI server with and without tierkv under concurrent load,
driven by vLLM's own ``vllm bench serve`` client.

For each configuration (``--help`` lists them), one after the other (``--rounds``: again in rotated order; or all at
once, ``--interleave``): start the server (and a ``tierkv server`` for ZMQ L3), run every (workload, concurrency,
repeat) with the same seed in every configuration, read ``/metrics`` and the stats files before and after each run,
stop it by PID. The measured code is a ``git archive`` of HEAD (``--code worktree``: the working tree). ``--soak N``
runs the soak instead (:mod:`benchmarks.serve_cpu.soak`). Output: the result JSON (``--out``), a chart next to it,
the run's logs under ``runs/``, and the README block printed (``--readme-from JSON`` prints it again).

    .venv/bin/python -m benchmarks.serve_cpu --quick            # a few minutes: small prompts, demo model
    .venv/bin/python -m benchmarks.serve_cpu                    # full pass (demo model, every workload, c=1,4,8)
    .venv/bin/python -m benchmarks.serve_cpu --soak             # 2,000 requests with L3 faults and a killed server
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from benchmarks import make_multiturn_trace as trace_gen
from benchmarks.harness import REPO, results
from benchmarks.serve_cpu.client import client_main, random_seeds, run_seed
from benchmarks.serve_cpu.configs import (
    CONFIG_TEXT, CONFIGS, DTYPES, FULL, ONEDNN_CACHE_ENV, QUICK, SERVER_DTYPE, SERVER_ENV, SOAK, WORKLOADS,
    conditions, parse_sets)
from benchmarks.serve_cpu.passes import prepare, round_meta, round_order, run_config, run_interleaved
from benchmarks.serve_cpu.report import SECTION, SOAK_JSON, details, failures_text, plot, render_section, render_soak
from benchmarks.serve_cpu.soak import soak_main
from benchmarks.serve_cpu import trace as mooncake
from tierkv.engine_env import ALLOCATORS, preload_env

RESULTS = REPO / "benchmarks" / "results"


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--client"]:
        return client_main(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    ap = argparse.ArgumentParser(prog="python -m benchmarks.serve_cpu", description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter,
                                 epilog="configurations (sizes of the full pass):\n" + "\n".join(
                                     f"  {n}: {t.format(**FULL)}" for n, t in CONFIG_TEXT.items()))
    ap.add_argument("--quick", action="store_true", help="short prompts and few requests (a few minutes)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--concurrency", default="1,4,8", help="comma-separated --max-concurrency values (default 1,4,8)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (workload, concurrency), each on its own seed")
    ap.add_argument("--rounds", type=int, default=1,
                    help="passes over the configurations, each with a fresh server and its own repeats (interleaves "
                         "the configurations in time, so a slow minute of the machine does not land on one of them)")
    ap.add_argument("--interleave", action="store_true",
                    help="every configuration's server up at once (the others idle) and the configurations run back "
                         "to back per (repeat, workload, concurrency), so paired runs are seconds apart; one round")
    ap.add_argument("--preset", default=None, help="model preset of examples/make_tiny_model.py (default demo)")
    ap.add_argument("--code", choices=["head", "worktree"], default="head",
                    help="measure a git-archive snapshot of HEAD (default) or the working tree as it is")
    ap.add_argument("--start-timeout", type=float, default=420.0, help="seconds for a server to answer /health")
    ap.add_argument("--client-timeout", type=float, default=None,
                    help="seconds per client run (default 600 quick, 1800 full)")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/serve_cpu.json)")
    ap.add_argument("--no-readme", action="store_true", help="do not print the README table at the end")
    ap.add_argument("--readme-from", default=None, metavar="JSON", help="only print the README table (and redraw "
                    "the chart) of a result file")
    ap.add_argument("--note", default="", help="extra paragraph for the README table (kept in the JSON)")
    ap.add_argument("--soak", type=int, nargs="?", const=SOAK["requests"], default=None, metavar="N",
                    help=f"soak mode instead of the pass: N requests (default {SOAK['requests']}) at concurrency "
                    f"{SOAK['concurrency']} through tierkv_l3_zmq with {SOAK['fault_fraction'] * 100:.0f}%% injected L3 "
                    f"faults and one SIGKILL + restart of the ZMQ server at half; writes results/{SOAK_JSON} "
                    "(--out) and prints its README block; exit code 1 if a check fails. A warm-up of up to "
                    f"{SOAK['warmup_max_rounds']} rounds of {SOAK['warmup_requests']} requests comes first, whatever N "
                    "(until a round leaves threads and memory as they were), so even a short soak takes minutes")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the servers' --dtype (model and KV cache): "
                    "float32 where the CPU lacks AVX-512 and its bf16 forward is ~10x slower")
    ap.add_argument("--allocator", choices=ALLOCATORS, default="tcmalloc",
                    help="memory allocator of every server: tcmalloc (preloaded, as vLLM's CPU backend asks; "
                    "default) or glibc")
    ap.add_argument("--onednn-cache", type=int, default=None, metavar="N",
                    help=f"cap oneDNN's process-wide primitive cache at N primitives in every server ({ONEDNN_CACHE_ENV}; "
                    "default: oneDNN's own, 1024): vLLM's CPU GEMMs build one primitive per new token count of a step")
    ap.add_argument("--heap-watch", action="store_true",
                    help="soak only: record vLLM's worker with memray from the end of the warm-up to the end of the "
                    "run and keep what it allocated and did not free, by Python stack (benchmarks/heap_watch; memray "
                    "importable or its pip --target folder in TIERKV_HEAP_WATCH_MEMRAY)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                    help="override one size of the pass (a key of FULL/QUICK, e.g. pr_prefix_len=1536); repeatable")
    ap.add_argument("--soak-config", default="tierkv_l3_zmq", choices=["tierkv_l3_zmq", "tierkv_l2", "none"],
                    help="the soak's configuration (default tierkv_l3_zmq with faults and the kill; the others are "
                    "baselines for the memory and thread checks: no L3, no kill)")
    args = ap.parse_args(argv)

    if args.readme_from:
        src = Path(args.readme_from)
        data = results.load_result(src)
        if args.note:
            data["readme_note"] = args.note
        try:
            soak = data.get("benchmark") == "serve_cpu_soak"
            print(render_soak(data, src.name) if soak else render_section(data, src.name))
            if not soak:
                print(details(data))
                plot(data, src.with_suffix(".png"))
        except results.ResultsError as e:
            print(f"serve_cpu: no README table: {e}", file=sys.stderr)
            return 2
        if args.note:
            results.write_result(src, data)
        return 0

    SERVER_DTYPE[0] = args.dtype
    try:
        SERVER_ENV.update(preload_env(args.allocator))  # every server of this run (recorded in conditions)
    except RuntimeError as e:
        ap.error(str(e))
    if args.onednn_cache is not None:
        if args.onednn_cache < 0:
            ap.error(f"--onednn-cache must be >= 0, got {args.onednn_cache}")
        SERVER_ENV[ONEDNN_CACHE_ENV] = str(args.onednn_cache)
    p = dict(QUICK if args.quick else FULL)
    if args.preset:
        p["preset"] = args.preset
    try:
        p.update(parse_sets(args.set, p))
    except ValueError as e:
        ap.error(str(e))
    args.configs = _csv(args.configs)
    args.workloads = _csv(args.workloads)
    args.concurrency = [int(x) for x in _csv(args.concurrency)]
    bad = [c for c in args.configs if c not in CONFIGS] + [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.configs or not args.workloads or not args.concurrency or args.repeats < 1 or args.rounds < 1:
        ap.error(f"unknown or empty selection {bad}; configs from {CONFIGS}, workloads from {WORKLOADS}")
    if args.interleave and (args.rounds != 1 or args.soak is not None):
        ap.error("--interleave runs one round (use --repeats) and no soak")
    if args.client_timeout is None:
        args.client_timeout = 600.0 if args.quick else 1800.0
    if args.soak is not None:
        if args.soak < 2 * SOAK["num_prefixes"] or args.soak % SOAK["num_prefixes"]:
            # vLLM's prefix_repetition sends num_prompts // num_prefixes prompts per prefix
            ap.error(f"--soak N needs a multiple of {SOAK['num_prefixes']} (the prefixes), at least "
                     f"{2 * SOAK['num_prefixes']}")
        return soak_main(args, p)

    started, work, model_dir, pythonpath, code = prepare(args, p, "serve_cpu")
    traces: dict[tuple[str, int, int], tuple[Path, list[dict]]] = {}
    trace_info: dict[str, dict] = {"multiturn": {}, "trace": {}}
    for w in ("multiturn", "trace"):
        if w not in args.workloads:
            continue
        for c in args.concurrency:
            for r in range(args.repeats * args.rounds):
                seed = run_seed(w, c, r)
                if w == "trace":  # a window of Mooncake's conversation trace, its ids offset by the seed
                    rows, stats = mooncake.make_trace(p, seed), mooncake.reuse_stats
                else:
                    rows = trace_gen.make_trace(seed=seed, conversations=p["mt_conversations"], turns=p["mt_turns"],
                                                first_chunks=p["mt_first_chunks"], turn_chunks=p["mt_turn_chunks"],
                                                output_len=p["mt_output_len"])
                    stats = trace_gen.reuse_stats
                path = trace_gen.write_trace(work / "traces" / f"{w}-c{c}-r{r}.jsonl", rows)
                traces[(w, c, r)] = (path, rows)
                trace_info[w][f"c{c}-r{r}"] = stats(rows)
    args.random_seeds = {}
    if "random" in args.workloads:  # prompts with no page in common, in a run and between runs
        args.random_seeds = random_seeds(p, model_dir, args.concurrency, args.repeats * args.rounds)
    data = {"benchmark": SECTION, "quick": args.quick, "params": p, "started_at": started, "code": code,
            "conditions": conditions(), "run_dir": str(work.relative_to(REPO)),
            "selection": {"configs": args.configs, "workloads": args.workloads, "concurrency": args.concurrency,
                          "repeats": args.repeats, "rounds": args.rounds,
                          "order": "interleaved" if args.interleave else "rotated"},
            "multiturn_traces": trace_info["multiturn"], "trace_windows": trace_info["trace"], "configs": {}, "readme_note": args.note,
            "random_seeds": {f"c{c}-r{r}": v for (_, c, r), v in args.random_seeds.items()}}
    out = Path(args.out) if args.out else RESULTS / "serve_cpu.json"
    if args.interleave:
        for name, res in run_interleaved(p, args, model_dir, work, pythonpath, traces).items():
            data["configs"][name] = dict(res, rounds=[round_meta(res)])
    # round k: every configuration once, repeats k*R .. k*R+R-1 (same seeds in each)
    for k in range(0 if args.interleave else args.rounds):
        reps = list(range(k * args.repeats, (k + 1) * args.repeats))
        for pos, name in enumerate(round_order(args.configs, k)):
            res = run_config(name, p, args, model_dir, work, pythonpath, traces, reps, k)
            meta = dict(round_meta(res), position=pos)
            if name not in data["configs"]:
                data["configs"][name] = dict(res, rounds=[meta])
            else:
                c = data["configs"][name]
                c["runs"].extend(res["runs"])
                c["failures"].extend(res["failures"])
                c["rounds"].append(meta)
                c["elapsed_s"] = round(c["elapsed_s"] + res["elapsed_s"], 1)
                c["load_after"] = res["load_after"]
            (work / "partial.json").write_text(json.dumps(data, indent=1) + "\n")
    data["finished_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    results.write_result(out, data)
    print(f"wrote {out}")
    print(details(data))
    print()
    print(failures_text(data))
    png = plot(data, out.with_suffix(".png"))
    if png:
        print(f"wrote {png}")
    if not args.no_readme:
        try:
            results.print_section(render_section(data, out.name))
        except results.ResultsError as e:
            print(f"serve_cpu: no README table: {e}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
