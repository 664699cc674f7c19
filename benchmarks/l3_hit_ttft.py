"""Is an L3 hit ever slower than recomputing it? TTFT of L3 hits from a healthy, a paced, a slow and a stalled store against
the TTFT of recomputing the same prompts, in the real engine (issue "Serving under concurrent load", deliver 3:
"an L3 hit's TTFT is never above 1.1x the TTFT of recomputing it").

One engine subprocess per phase (``tests/e2e/_engine.py``, vLLM's CPU backend, the ``demo`` preset of
``examples/make_tiny_model.py`` unless ``--preset``), prompts sent one at a time, 1 output token (TTFT = latency):

1. ``write``: tierkv with a file L3 (``write_through``) computes ``docs`` documents of ``doc_tokens`` tokens, each
   followed by a question; every full page is backed up to the file store.
2. ``recompute``: no connector: the same documents with new questions, all computed (the reference).
3. ``healthy`` / ``paced`` / ``slow`` / ``stalled``: a fresh tierkv engine (empty L1 and L2) on the same file
   store, the same prompts as ``recompute``; the store is wrapped in ``l3.faults`` with ``delay_get_s`` 0
   (healthy), ``delay_get_page_s`` = :data:`PACED_FRACTION` of one page's share of the median recompute TTFT
   (paced: a read much faster than recomputing, but slower than the 5 % of it that ``best_effort`` waits before
   its deadline credit starts), ``delay_get_s`` about twice the median recompute TTFT of one document (slow: each
   read call takes longer than recomputing), or 600 s (stalled: no read returns within the run). Policy
   ``best_effort`` (the default).
4. ``recompute`` again, so the reference's own spread is seen.

Per phase and prompt: TTFT, tokens served from L3 (``ctl_l3_hit_tokens`` deltas are not per prompt: vLLM's
``num_cached_tokens``), and the ratio TTFT / recompute TTFT of the same prompt (median of the two reference runs);
outputs (the one greedy token) compared with the reference. The promise holds when every ratio is <= 1.1.

    .venv/bin/python benchmarks/l3_hit_ttft.py            # -> results/l3_hit_ttft.json + README section
    .venv/bin/python benchmarks/l3_hit_ttft.py --quick    # smoke run (test model, 2 short documents), no README
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "benchmarks" / "README.md"
SECTION = "l3_hit_ttft"
PAGE = 32
PROMISE = 1.1
#: paced store: each page read takes this fraction of the time to recompute one page
PACED_FRACTION = 0.15
STORES = ("healthy", "paced", "slow", "stalled")


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


engine = _load("tierkv_e2e_engine", REPO / "tests" / "e2e" / "_engine.py")
make_tiny_model = _load("tierkv_make_tiny_model", REPO / "examples" / "make_tiny_model.py")
serve = _load("tierkv_bench_serve_cpu", REPO / "benchmarks" / "serve_cpu.py")
results_check = serve.results_check

FULL = dict(preset="demo", docs=6, doc_tokens=1536, question_tokens=40, l1_blocks=256, l2_pages=128)
QUICK = dict(preset="test", docs=2, doc_tokens=256, question_tokens=8, l1_blocks=64, l2_pages=32)


def prompts(p: dict, round_no: int) -> list[list[int]]:
    """``docs`` documents (token ids 100.., distinct per document) each followed by a question of round
    ``round_no`` (different per round, so only the document is a prefix hit)."""
    out = []
    for d in range(p["docs"]):   # ids below 2,000: every preset's vocabulary holds them
        doc = [100 + (d * 7919 + i * 31) % 1500 for i in range(p["doc_tokens"])]
        q = [1650 + (round_no * 131 + d * 17 + i) % 300 for i in range(p["question_tokens"])]
        out.append(doc + q)
    return out


def tierkv_config(p: dict, root: Path, faults: dict | None) -> dict:
    """``faults``: the ``l3.faults`` section (None: no fault wrapper)."""
    extra = {"host_pool": {"num_pages": p["l2_pages"]}, "l3": {"backend": "file", "file": {"root": str(root)}}}
    if faults is not None:
        extra["l3"]["faults"] = faults
    return {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connector.vllm_connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def run_phase(name: str, model_dir: Path, p: dict, work: Path, prompts_: list, kvc) -> dict:
    t0 = time.monotonic()
    # one estimates directory for every phase: a tierkv engine starts from its predecessor's recompute estimate
    res = engine.run_job(model_dir, [{"name": name, "prompts": prompts_, "max_tokens": 1}], kv_transfer_config=kvc,
                         num_gpu_blocks_override=p["l1_blocks"], max_tokens=1, workdir=work / name,
                         env={"TIERKV_ESTIMATES_DIR": str(work)})
    w = res["workloads"][name]
    stats = engine.stats_by_role(res) if kvc else {}
    sched = stats.get("scheduler", {})
    out = {"ttft_s": w["ttft_s"], "num_cached_tokens": w["num_cached_tokens"], "outputs": w["outputs"],
           "startup_s": res.get("startup_s"), "shutdown_s": res.get("shutdown_s"), "wall_s": round(time.monotonic() - t0, 1),
           "load": serve.loadavg()}
    if kvc:
        out["scheduler"] = {k: sched.get(k) for k in ("ctl_l3_hit_tokens", "ctl_l3_declined_slow_pages",
                                                        "ctl_prefetch_loaded_pages", "ctl_prefetch_cancelled_pages",
                                                        "ctl_prefetch_failed_pages", "ctl_l3_probe_hits")}
    print(f"[l3_hit_ttft] {name}: TTFT ms {[round(t * 1000) for t in w['ttft_s']]}, cached "
          f"{w['num_cached_tokens']}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-readme", action="store_true")
    ap.add_argument("--readme-from", default=None, metavar="JSON")
    args = ap.parse_args(argv)
    if args.readme_from:
        write_readme(json.loads(Path(args.readme_from).read_text()))
        return 0
    p = dict(QUICK if args.quick else FULL)
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    code = results_check.code_state()
    model_dir = make_tiny_model.make_model(REPO / "runs" / "serve_cpu" / "models" / p["preset"], p["preset"])
    with tempfile.TemporaryDirectory(prefix="tierkv-l3ttft-", dir=REPO / "runs") as tmp:
        work, root = Path(tmp), Path(tmp) / "l3"
        phases = {"write": run_phase("write", model_dir, p, work, prompts(p, 0), tierkv_config(p, root, None))}
        again = prompts(p, 1)
        phases["recompute"] = run_phase("recompute", model_dir, p, work, again, None)
        rec = statistics.median(phases["recompute"]["ttft_s"])
        per_page = rec / (p["doc_tokens"] // PAGE)
        delays = {"healthy": {"delay_get_s": 0.0}, "paced": {"delay_get_page_s": round(PACED_FRACTION * per_page, 6)},
                  "slow": {"delay_get_s": round(2 * rec, 3)}, "stalled": {"delay_get_s": 600.0}}
        for name, faults in delays.items():
            phases[name] = run_phase(name, model_dir, p, work, again, tierkv_config(p, root, faults))
        phases["recompute_2"] = run_phase("recompute_2", model_dir, p, work, again, None)
    data = {"benchmark": SECTION, "quick": args.quick, "params": p, "delays_s": delays, "started_at": started,
            "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "code": code,
            "conditions": serve.conditions(), "phases": phases, "summary": summarise(phases)}
    out = Path(args.out) if args.out else (RESULTS / f"{SECTION}.json" if not args.quick else
                                           REPO / "runs" / f"{SECTION}_quick.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    print(table(data))
    if not args.quick and not args.no_readme:
        write_readme(data)
    return 0 if all(s["max_ratio"] <= PROMISE for s in data["summary"].values()) else 1


def summarise(phases: dict) -> dict:
    """Per store condition: TTFT / recompute TTFT of each prompt (recompute = median of the two reference runs of
    that prompt), their median and max, the L3 tokens served, and whether the outputs equal the reference's."""
    ref = [statistics.median(pair) for pair in zip(phases["recompute"]["ttft_s"], phases["recompute_2"]["ttft_s"])]
    out = {}
    for name in STORES:
        ph = phases[name]
        ratios = [t / r for t, r in zip(ph["ttft_s"], ref)]
        out[name] = {"ratios": [round(x, 3) for x in ratios], "median_ratio": round(statistics.median(ratios), 3),
                     "max_ratio": round(max(ratios), 3), "l3_hit_tokens": sum(ph["num_cached_tokens"]),
                     "outputs_equal": ph["outputs"] == phases["recompute"]["outputs"]}
    out["_reference"] = {"ratios": [round(a / b, 3) for a, b in zip(phases["recompute_2"]["ttft_s"],
                                                                    phases["recompute"]["ttft_s"])],
                         "median_ratio": None, "max_ratio": 0.0, "l3_hit_tokens": 0, "outputs_equal": True}
    return out


def table(data: dict) -> str:
    ph, s = data["phases"], data["summary"]
    lines = ["| store | read delay | TTFT ms per prompt | recompute TTFT ms (two runs) | ratio median | ratio max | "
             "L3 hit tokens | outputs equal |", "|---|---|---|---|---|---|---|---|"]
    rec = " / ".join(",".join(str(round(t * 1000)) for t in ph[k]["ttft_s"]) for k in ("recompute", "recompute_2"))
    for name in STORES:
        lines.append(f"| {name} | {_delay(data['delays_s'][name])} | {','.join(str(round(t * 1000)) for t in ph[name]['ttft_s'])}"
                     f" | {rec} | {s[name]['median_ratio']:.2f} | {s[name]['max_ratio']:.2f} | "
                     f"{s[name]['l3_hit_tokens']} | {'yes' if s[name]['outputs_equal'] else 'NO'} |")
    return "\n".join(lines)


def _shutdowns(data: dict) -> str:
    """The sentence on each phase's engine shutdown time (vLLM kills an engine that has not stopped after 60 s)."""
    return " Engine shutdown (s): " + ", ".join(f"{k} {v['shutdown_s']:.1f}" for k, v in data["phases"].items()) + "."


def _delay(d) -> str:
    """A store's ``l3.faults`` delays as table text."""
    parts = [f"{d['delay_get_s']} s a call"] if "delay_get_s" in d else []
    if "delay_get_page_s" in d:
        parts.append(f"{d['delay_get_page_s'] * 1000:.2f} ms a page")
    return ", ".join(parts)


def render_section(data: dict) -> str:
    """The ``## l3_hit_ttft`` section of ``benchmarks/README.md``, drawn from ``data`` alone (refused by
    ``results_check.ResultsError`` for a file without a commit, measured on uncommitted code, or lacking keys)."""
    results_check.check_results(data, {"params": None, "code": {"commit": None, "dirty": None}, "phases": None,
                                       "summary": None, "conditions": None}, f"{SECTION}.json")
    p, cond = data["params"], data["conditions"]
    ref = data["summary"]["_reference"]["ratios"]
    body = f"""## {SECTION}

`benchmarks/l3_hit_ttft.py` (issue 19, deliver 3): is an L3 hit ever slower than recomputing it? One engine per
phase (`tests/e2e/_engine.py`, vLLM's CPU backend, `{p['preset']}` preset, L1 {p['l1_blocks']} blocks, L2
{p['l2_pages']} pages, `best_effort`), prompts one at a time, 1 output token: {p['docs']} documents of
{p['doc_tokens']} tokens + {p['question_tokens']}-token questions written to a file L3, then asked with new
questions by a fresh engine whose store answers at once (healthy), takes {PACED_FRACTION:.0%} of a page's recompute
time per page read (paced, `l3.faults.delay_get_page_s`), answers after about twice a recompute (slow) or not
within the run (stalled, `l3.faults.delay_get_s`), against an engine without connector run before and after
(its second run / first run per prompt: {', '.join(f'{x:.2f}' for x in ref)}). Ratio = TTFT / recompute TTFT of the
same prompt (median of the two reference runs). Promise: every ratio <= {PROMISE}.

Measured {data['started_at']} on tierkv commit `{results_check.short(data['code']['commit'])}`, {cond['cpus']} vCPU
({cond['cpu']}; {cond['isa']}); 1-minute load average after each phase:
{', '.join(f"{k} {v['load'][0]}" for k, v in data['phases'].items())}.{_shutdowns(data)}

{table(data)}

```bash
.venv/bin/python benchmarks/l3_hit_ttft.py
.venv/bin/python benchmarks/l3_hit_ttft.py --readme-from benchmarks/results/l3_hit_ttft.json
```
"""
    return body


def write_readme(data: dict) -> None:
    """Replace (or add, before "Measurements behind code choices") the section in ``benchmarks/README.md``."""
    results_check.replace_readme_section(README, SECTION, render_section(data),
                                         before="## Measurements behind code choices")
    print(f"updated the {SECTION} section of {README}")


if __name__ == "__main__":
    sys.exit(main())
