"""End-to-end benchmark on vLLM's CPU backend (tierkv issue 2, item 10): does tierkv's L2 turn recomputed
prefills into loads?

Model: the ``bench`` preset of ``examples/make_tiny_model.py`` (Llama architecture, hidden 1024, 8 layers,
16 heads, 4 KV heads, intermediate 2816, vocab 8192, bf16, random weights).

Workloads (token ids, greedy, one request at a time so batch composition never differs between configurations):

- ``docs``: 8 distinct 2,048-token documents, each followed by a question of 40-120 tokens that differs in every
  round (so a connector must match a prefix, not a whole prompt), asked round-robin for 3 rounds;
- ``chat``: multi-turn chats (a 1,024-token opening message, then turns); each turn's prompt is the previous
  prompt plus the model's answer plus a new 40-120-token user message; chats interleaved turn by turn.

Configurations, each in its own engine subprocess (``tests/e2e/_engine.py``) with the same
``VLLM_CPU_NUM_OF_RESERVED_CPU`` (so thread counts and bf16 rounding are equal):

- ``no_connector``: L1 = 200 blocks of 32 tokens (too small for the 8 documents), no connector;
- ``example_connector``: vLLM's stock ``ExampleConnector`` (files under a temporary directory), L1 = 200;
- ``tierkv``: ``TierKVConnector`` with an L2 host pool, L1 = 200;
- ``ideal``: no connector, L1 = 1,000 blocks (every document stays in vLLM's own prefix cache).

Reported per configuration and round: seconds, TTFT p50, prompt tokens, tokens hit per tier (L1 = vLLM's
``prefix_cache_hits``; connector = ``external_prefix_cache_hits``, which for tierkv are L2 hits), and whether the
greedy output ids equal those of ``ideal``. Targets (issue 2): round 1 at most 5 % slower than ``no_connector``;
rounds 2+3 together within 1.5x of ``ideal`` (aim 1.1x).

    .venv/bin/python benchmarks/e2e_cpu.py             # full run -> results/e2e_cpu.json + README section
    .venv/bin/python benchmarks/e2e_cpu.py --quick     # smoke run on the test model -> runs/e2e_cpu_quick.json
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "benchmarks" / "README.md"
SECTION = "e2e_cpu"


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


engine = _load("tierkv_e2e_engine", REPO / "tests" / "e2e" / "_engine.py")
make_tiny_model = _load("tierkv_make_tiny_model", REPO / "examples" / "make_tiny_model.py")

# Reference measured earlier on an idle machine (issue 2), seconds per docs round 1/2/3.
ISSUE_REFERENCE = {"no_connector": [6.9, 6.4, 6.3], "ideal": [7.4, 1.1, 1.1], "example_connector": [6.9, 6.6, 6.8]}

FULL = dict(preset="bench", n_docs=8, doc_len=2048, q_min=40, q_max=120, rounds=3, l1_blocks=200,
            ideal_blocks=1000, max_tokens=8, n_chats=6, chat_open_len=1024, chat_turns=4, chat_answer=32,
            l2_gb=1.0)
QUICK = dict(preset="test", n_docs=4, doc_len=512, q_min=40, q_max=120, rounds=3, l1_blocks=48,
             ideal_blocks=200, max_tokens=4, n_chats=3, chat_open_len=256, chat_turns=3, chat_answer=8,
             l2_gb=0.25)


def build_workloads(p: dict, vocab: int, seed: int = 1234) -> list[dict]:
    """The docs rounds (``docs_r1``...) and the chat workload as :func:`_engine.run_job` workloads."""
    rng = random.Random(seed)

    def toks(n: int) -> list[int]:
        return [rng.randrange(4, vocab) for _ in range(n)]  # ids 0-3 are special tokens

    docs = [toks(p["doc_len"]) for _ in range(p["n_docs"])]
    workloads = []
    for r in range(p["rounds"]):
        prompts = [d + toks(rng.randint(p["q_min"], p["q_max"])) for d in docs]
        workloads.append({"name": f"docs_r{r + 1}", "prompts": prompts, "max_tokens": p["max_tokens"]})
    chats = [[toks(p["chat_open_len"])] + [toks(rng.randint(p["q_min"], p["q_max"]))
                                          for _ in range(p["chat_turns"] - 1)] for _ in range(p["n_chats"])]
    workloads.append({"name": "chat", "chats": chats, "max_tokens": p["chat_answer"]})
    return workloads


def configs(p: dict, store_dir: Path) -> dict[str, tuple]:
    """name -> (kv_transfer_config or None, L1 blocks)."""
    return {
        "ideal": (None, p["ideal_blocks"]),
        "no_connector": (None, p["l1_blocks"]),
        "example_connector": (engine.example_kv_config(store_dir), p["l1_blocks"]),
        "tierkv": (engine.tierkv_kv_config({"host_pool": {"size_gb": p["l2_gb"]}}, load_failure_policy="recompute"),
                   p["l1_blocks"]),
    }


def _p50(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def summarise(name: str, res: dict, ideal: dict | None) -> dict:
    out = {"startup_s": res["startup_s"], "shutdown_s": res["shutdown_s"], "leaked_processes": res["leaked_processes"],
           "workloads": {}}
    for wname, w in res["workloads"].items():
        c = w.get("vllm_counters", {})
        row = {
            "seconds": w["wall_s"],
            "ttft_p50_s": _p50(w["ttft_s"]),
            "ttft_p90_s": _quantile(w["ttft_s"], 0.9),
            "requests": len(w["outputs"]),
            "prompt_tokens": sum(w["prompt_lens"]),
            "cached_tokens": sum(x or 0 for x in w["num_cached_tokens"]),
            "l1_hit_tokens": int(c.get("vllm:prefix_cache_hits", 0)),
            "connector_hit_tokens": int(c.get("vllm:external_prefix_cache_hits", 0)),
        }
        if ideal is not None:
            ref = ideal["workloads"][wname]["outputs"]
            row["outputs_differing"] = sum(a != b for a, b in zip(w["outputs"], ref))
            row["outputs_identical"] = row["outputs_differing"] == 0
        out["workloads"][wname] = row
    if res.get("stats"):
        out["connector_stats"] = engine.stats_by_role(res)
    return out


def _quantile(xs, q):
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _isa() -> str:
    """Which of the CPU's matrix/vector extensions that matter for bf16 GEMMs are present."""
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    except OSError:
        return "flags unknown"
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return "has " + ", ".join(have) if have else "no AVX2/AVX-512/AMX"


def conditions() -> dict:
    import torch
    try:
        from importlib.metadata import version
        vllm_v = version("vllm-cpu")
    except Exception:  # pragma: no cover
        vllm_v = "?"
    cpu = "?"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpus": os.cpu_count(), "cpu": cpu, "isa": _isa(), "torch": torch.__version__, "vllm_cpu": vllm_v,
            "python": platform.python_version(), "env": dict(engine.DEFAULT_ENV)}


def targets(results: dict) -> dict:
    cfg = results["configs"]
    out = {}
    if "tierkv" in cfg and "no_connector" in cfg and "docs_r1" in results["workloads"]:
        t1 = cfg["tierkv"]["workloads"]["docs_r1"]["seconds"]
        n1 = cfg["no_connector"]["workloads"]["docs_r1"]["seconds"]
        out["round1_vs_no_connector"] = {"ratio": t1 / n1, "target": 1.05, "met": t1 / n1 <= 1.05}
    later = [w for w in ("docs_r2", "docs_r3") if w in results["workloads"]]
    if "tierkv" in cfg and "ideal" in cfg and later:
        t = sum(cfg["tierkv"]["workloads"][w]["seconds"] for w in later)
        i = sum(cfg["ideal"]["workloads"][w]["seconds"] for w in later)
        out["rounds23_vs_ideal"] = {"ratio": t / i, "target": 1.5, "aim": 1.1, "met": t / i <= 1.5}
    return out


def table(results: dict) -> str:
    wnames = results["workloads"]
    lines = ["| config | workload | s | TTFT p50 ms | prompt tok | L1 hit tok | connector hit tok | same as ideal |",
             "|---|---|---|---|---|---|---|---|"]
    for cname, c in results["configs"].items():
        for w in wnames:
            r = c["workloads"][w]
            same = "ref" if cname == "ideal" else ("yes" if r.get("outputs_identical") else
                                                   f"no ({r.get('outputs_differing')}/{r['requests']} differ)")
            ttft = f"{r['ttft_p50_s'] * 1e3:.0f}" if r["ttft_p50_s"] is not None else "-"
            lines.append(f"| {cname} | {w} | {r['seconds']:.2f} | {ttft} | {r['prompt_tokens']} | "
                         f"{r['l1_hit_tokens']} | {r['connector_hit_tokens']} | {same} |")
    return "\n".join(lines)


def targets_text(results: dict) -> str:
    t = results["targets"]
    out = []
    if "round1_vs_no_connector" in t:
        x = t["round1_vs_no_connector"]
        out.append(f"- round 1, tierkv / no connector: {x['ratio']:.3f} (target <= 1.05): "
                   f"{'met' if x['met'] else 'MISSED'}")
    if "rounds23_vs_ideal" in t:
        x = t["rounds23_vs_ideal"]
        out.append(f"- rounds 2+3, tierkv / ideal: {x['ratio']:.3f} (target <= 1.5, aim 1.1): "
                   f"{'met' if x['met'] else 'MISSED'}")
    return "\n".join(out)


def write_readme(results: dict, note: str = "") -> None:
    """Replace (or append) the ``## e2e_cpu`` section of ``benchmarks/README.md``; other sections are kept."""
    p = results["params"]
    cond = results["conditions"]
    ran_cfgs = list(results["configs"])
    ran_w = results["workloads"]
    loads = ", ".join(f"{k} {v['load_before']:.1f}->{v['load_after']:.1f}" for k, v in results["runs"].items())
    stats = results["configs"].get("tierkv", {}).get("connector_stats", {})
    s, w = stats.get("scheduler", {}), stats.get("worker", {})
    chat_txt = (f"`chat`: {p['n_chats']} chats of {p['chat_turns']} turns ({p['chat_open_len']:,}-token opening "
                f"message; each turn adds the {p['chat_answer']}-token answer and a {p['q_min']}-{p['q_max']}-token "
                "user message), interleaved turn by turn.")
    body = f"""## {SECTION}

`benchmarks/e2e_cpu.py` (issue 2, item 10): vLLM {cond['vllm_cpu']} CPU backend serving the `bench` model
(Llama, hidden 1024, 8 layers, 16 heads, 4 KV heads, intermediate 2816, vocab 8192, bf16, random weights) with
token-id prompts, greedy, one request at a time. `docs`: {p['n_docs']} distinct {p['doc_len']:,}-token documents,
each followed by a {p['q_min']}-{p['q_max']}-token question that differs every round, round-robin for {p['rounds']}
rounds, {p['max_tokens']} output tokens. {chat_txt} L1 = {p['l1_blocks']} blocks of 32 tokens, except `ideal`
({p['ideal_blocks']} blocks); tierkv L2 = {p['l2_gb']} GiB host pool (`layer_first`). Configurations: `ideal` (no
connector, big L1), `no_connector`, `example_connector` (vLLM's stock ExampleConnector), `tierkv`; each runs in
its own engine process with `VLLM_CPU_NUM_OF_RESERVED_CPU=0` (equal thread counts, so equal bf16 rounding).
"L1 hit tok" = vLLM's `prefix_cache_hits`; "connector hit tok" = `external_prefix_cache_hits` (for tierkv:
tokens loaded from L2). "same as ideal" compares greedy output ids with the `ideal` run.

```bash
.venv/bin/python benchmarks/e2e_cpu.py           # all configurations and workloads (or: make bench)
.venv/bin/python benchmarks/e2e_cpu.py --configs ideal,no_connector,tierkv --workloads docs
.venv/bin/python benchmarks/e2e_cpu.py --quick   # smoke run on the test model (runs/e2e_cpu_quick.json, not committed)
```

Last committed run: configurations {", ".join(ran_cfgs)}; workloads {", ".join(ran_w)}.
Conditions: {cond['cpus']} vCPU ({cond['cpu']}; {cond.get('isa') or _isa()}), shared with other jobs; load average
before->after each configuration: {loads}. Timings are noisy; compare rows of the same run. Reference measured
earlier on a faster idle machine (s per docs round 1/2/3): no connector 6.9/6.4/6.3, ideal 7.4/1.1/1.1,
ExampleConnector 6.9/6.6/6.8.
{note}

{table(results)}

Targets (issue 2):

{targets_text(results)}

tierkv counters (whole run): L2 hit tokens {s.get('l2_hit_tokens', '-')}, lookup tokens {s.get('lookup_tokens', '-')},
pages saved {w.get('save_pages', '-')} ({w.get('save_bytes', 0) / 2**20:.0f} MiB, copy time
{w.get('save_seconds', 0):.2f} s), pages loaded {w.get('load_pages', '-')} ({w.get('load_bytes', 0) / 2**20:.0f} MiB,
copy time {w.get('load_seconds', 0):.2f} s), L2 evictions {s.get('evicted_pages', '-')}. Results:
`results/e2e_cpu.json`.
"""
    text = README.read_text() if README.exists() else "# tierkv benchmarks\n"
    start = text.find(f"\n## {SECTION}\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + body
    else:
        end = text.find("\n## ", start + 1)
        text = text[:start + 1] + body + (text[end:] if end >= 0 else "")
    README.write_text(text)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: test model, small workload")
    ap.add_argument("--configs", default="ideal,no_connector,example_connector,tierkv",
                    help="comma-separated subset of: ideal,no_connector,example_connector,tierkv")
    ap.add_argument("--out", default=None, help="result JSON (default results/e2e_cpu.json, quick: e2e_cpu_quick.json)")
    ap.add_argument("--workloads", default="docs,chat", help="comma-separated subset of: docs,chat")
    ap.add_argument("--no-readme", action="store_true", help="do not update benchmarks/README.md")
    ap.add_argument("--readme-from", default=None, metavar="JSON",
                    help="only rewrite the README section from an existing result file")
    ap.add_argument("--note", default="", help="extra paragraph for the README section")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per configuration")
    args = ap.parse_args(argv)

    if args.readme_from:
        write_readme(json.loads(Path(args.readme_from).read_text()), args.note)
        print(f"updated the {SECTION} section of {README}")
        return 0
    p = dict(QUICK if args.quick else FULL)
    model_dir = make_tiny_model.make_model(None, p["preset"])
    vocab = make_tiny_model.PRESETS[p["preset"]]["vocab_size"]
    kinds = {k.strip() for k in args.workloads.split(",") if k.strip()}
    if not kinds or kinds - {"docs", "chat"}:
        ap.error(f"--workloads {args.workloads!r}: allowed docs, chat")
    workloads = [w for w in build_workloads(p, vocab) if ("chat" if w["name"] == "chat" else "docs") in kinds]
    wnames = [w["name"] for w in workloads]
    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    work = Path(tempfile.mkdtemp(prefix="tierkv-e2e-bench-"))
    cfgs = configs(p, work / "example_store")
    unknown = [n for n in names if n not in cfgs]
    if unknown:
        ap.error(f"--configs: unknown {unknown}; allowed {sorted(cfgs)}")
    if "ideal" in names:  # the reference for output identity runs first
        names.remove("ideal")
        names.insert(0, "ideal")

    results = {"benchmark": SECTION, "quick": args.quick, "params": p, "workloads": wnames,
               "conditions": conditions(), "issue_reference_s_per_round": ISSUE_REFERENCE, "runs": {},
               "configs": {}}
    raw = {}
    for name in names:
        kvc, blocks = cfgs[name]
        load0 = os.getloadavg()[0]
        print(f"[e2e_cpu] {name}: L1 {blocks} blocks, connector {kvc['kv_connector'] if kvc else 'none'} ...",
              flush=True)
        t0 = time.monotonic()
        res = engine.run_job(model_dir, workloads, kv_transfer_config=kvc, num_gpu_blocks_override=blocks,
                             max_tokens=p["max_tokens"], workdir=work / name, timeout_s=args.timeout,
                             extra_engine_args={"max_model_len": min(8192, (min(blocks, p["l1_blocks"]) - 1) * 32)})
        raw[name] = res
        results["runs"][name] = {"elapsed_s": time.monotonic() - t0, "load_before": load0,
                                 "load_after": os.getloadavg()[0], "log": res["log_path"]}
        results["configs"][name] = summarise(name, res, raw.get("ideal"))
        rs = results["configs"][name]["workloads"]
        print("   " + "  ".join(f"{w} {rs[w]['seconds']:.2f}s" for w in wnames), flush=True)
    results["targets"] = targets(results)

    print()
    print(table(results))
    print()
    print(targets_text(results))
    # Quick (smoke) results are not committed: they go to the git-ignored runs/ folder.
    out = Path(args.out) if args.out else (REPO / "runs" / "e2e_cpu_quick.json" if args.quick
                                           else RESULTS / "e2e_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=1, sort_keys=False) + "\n")
    print(f"\nwrote {out}")
    if not args.quick and not args.no_readme and set(names) >= {"ideal", "no_connector", "tierkv"}:
        write_readme(results, args.note)
        print(f"updated the {SECTION} section of {README}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
