"""Is an L3 hit ever slower than recomputing it? TTFT of L3 hits from a healthy, a paced, a slow and a stalled store against
the TTFT of recomputing the same prompts, in the real engine (issue "Serving under concurrent load", deliver 3:
"an L3 hit's TTFT is never above 1.1x the TTFT of recomputing it").

One engine subprocess per phase (``tests/helpers/engine.py``, vLLM's CPU backend, the ``demo`` preset of
``examples/make_tiny_model.py`` unless ``--preset``), prompts sent one at a time, 1 output token (TTFT = latency):

1. ``write``: tierkv with a file L3 (``write_through``) computes ``docs`` documents of ``doc_tokens`` tokens, each
   followed by a question; every full page is backed up to the file store.
2. ``recompute``: no connector: the same documents with new questions, all computed (the reference).
3. ``healthy`` / ``paced`` / ``slow`` / ``stalled`` / ``turns_stalled``: a fresh tierkv engine (empty L1 and L2)
   on the same file store, the same prompts as ``recompute``; the store is wrapped in ``l3.faults`` with
   ``delay_get_s`` 0 (healthy), ``delay_get_page_s`` = :data:`PACED_FRACTION` of one page's share of the median
   recompute TTFT (paced: a read much faster than recomputing, but slower than the 5 % of it that ``best_effort``
   waits before its deadline credit starts), ``delay_get_s`` about twice the median recompute TTFT of one document
   (slow: each read call takes longer than recomputing), or 600 s (stalled: no read returns within the run; turns
   stalled: the same after :data:`HEALTHY_HITS` documents' worth of pages, ``healthy_get_pages``, so the stall comes
   during a read that the fetch estimate, learnt on the fast store, made synchronous). Policy ``best_effort`` (the
   default).
4. ``recompute`` again, so the reference's own spread is seen.

Every phase first sends warm-up prompts (documents never written, enough to fill L1 once: an engine's first
prompts are slower than its later ones; not measured), then alternates the ``docs`` hit prompts with ``docs`` miss
prompts: documents of the same length that were never written, so the same engine recomputes them (tierkv's miss
path) between its hits. The promise is judged against those: ratio = hit TTFT / the median miss TTFT of the same
engine, both measured alternately in one process (engines differ from each other by more than the promise's 10 %:
see the reference's own spread). Also per phase: the ratio against the no-connector engines (hit TTFT / median of
that prompt's two reference runs), vLLM's own split of each TTFT into the time queued before the request's first
compute step (tierkv's wait for L3 is in it) and the compute, tokens served from L3 (vLLM's
``num_cached_tokens``), and the outputs (the one greedy token) compared with the reference.

    .venv/bin/python -m benchmarks.l3_hit_ttft            # -> results/l3_hit_ttft.json + its README table printed
    .venv/bin/python -m benchmarks.l3_hit_ttft --quick    # smoke run (test model, 2 short documents), no README
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import results as results_check
from benchmarks.harness.machine import loadavg
from benchmarks.serve_cpu.configs import conditions

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
SECTION = "l3_hit_ttft"
PAGE = 32
PROMISE = 1.1
#: paced store: each page read takes this fraction of the time to recompute one page
PACED_FRACTION = 0.15
STORES = ("healthy", "paced", "slow", "stalled", "turns_stalled")
#: turns_stalled store: documents' worth of pages served before its reads stall
HEALTHY_HITS = 3


engine = harness.e2e_engine()
make_tiny_model = harness.make_tiny_model()

FULL = dict(preset="demo", docs=6, doc_tokens=1536, question_tokens=40, l1_blocks=256, l2_pages=128)
QUICK = dict(preset="test", docs=2, doc_tokens=256, question_tokens=8, l1_blocks=64, l2_pages=32)


#: first document numbers of phase k's miss prompts (MISS_DOC0 + MISS_STRIDE * k ..) and warm-up prompts
#: (WARMUP_DOC + MISS_STRIDE * k ..; at most MISS_STRIDE of each a phase). Each phase gets its own: a tierkv engine
#: backs its misses up to L3 (``write_through``), so a later phase would hit them. Documents d < 1,500 are all
#: distinct (see :func:`prompts`).
MISS_DOC0, MISS_STRIDE, WARMUP_DOC = 100, 10, 200


def prompts(p: dict, round_no: int, first_doc: int = 0) -> list[list[int]]:
    """``docs`` documents ``first_doc``.. each followed by a question of round ``round_no`` (different per round,
    so only the document is a prefix hit). Document d is the cycle ``100 + (i * 31) % 1500`` started at offset
    ``(d * 7919) % 1500``: distinct for every d < 1,500 (7919 and 1500 are coprime), so the page hashes differ
    from the first page."""
    out = []
    for d in range(first_doc, first_doc + p["docs"]):   # ids below 2,000: every preset's vocabulary holds them
        doc = [100 + (d * 7919 + i * 31) % 1500 for i in range(p["doc_tokens"])]
        q = [1650 + (round_no * 131 + d * 17 + i) % 300 for i in range(p["question_tokens"])]
        out.append(doc + q)
    return out


def warmup_prompts(p: dict) -> int:
    """Warm-up prompts per engine: enough to fill every L1 block once (an engine's first prompts were slower than
    its later ones, by up to 70 %, for about as many prompts as fill L1)."""
    return -(-p["l1_blocks"] * PAGE // (p["doc_tokens"] + p["question_tokens"]))


def sequence(p: dict, round_no: int, phase_no: int) -> tuple[list[list[int]], list[str]]:
    """Phase ``phase_no``'s prompts and their roles: :func:`warmup_prompts` ``warmup`` prompts, then ``hit`` i
    (document i, written in the ``write`` phase) and ``miss`` i (a document of this phase alone, never written
    before) alternately."""
    hits, misses = prompts(p, round_no), prompts(p, round_no, MISS_DOC0 + MISS_STRIDE * phase_no)
    n = warmup_prompts(p)
    seq, roles = prompts(dict(p, docs=n), round_no, WARMUP_DOC + MISS_STRIDE * phase_no), ["warmup"] * n
    for h, m in zip(hits, misses):
        seq += [h, m]
        roles += ["hit", "miss"]
    return seq, roles


def tierkv_config(p: dict, root: Path, faults: dict | None) -> dict:
    """``faults``: the ``l3.faults`` section (None: no fault wrapper)."""
    extra = {"host_pool": {"num_pages": p["l2_pages"]}, "l3": {"backend": "file", "file": {"root": str(root)}}}
    if faults is not None:
        extra["l3"]["faults"] = faults
    return {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connector.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def run_phase(name: str, model_dir: Path, p: dict, work: Path, seq: tuple, kvc) -> dict:
    """Run ``seq`` (:func:`sequence`) in a fresh engine; per role (``hit``, ``miss``, ``warmup``) the lists
    ``ttft_s``, ``queued_s``, ``prefill_s``, ``num_cached_tokens``, ``outputs``."""
    t0 = time.monotonic()
    prompts_, roles = seq
    # one estimates directory for every phase: a tierkv engine starts from its predecessor's recompute estimate
    res = engine.run_job(model_dir, [{"name": name, "prompts": prompts_, "max_tokens": 1}], kv_transfer_config=kvc,
                         num_gpu_blocks_override=p["l1_blocks"], max_tokens=1, workdir=work / name,
                         env={"TIERKV_ESTIMATES_DIR": str(work)})
    w = res["workloads"][name]
    stats = engine.stats_by_role(res) if kvc else {}
    sched = stats.get("scheduler", {})
    out = {"startup_s": res.get("startup_s"), "shutdown_s": res.get("shutdown_s"),
           "wall_s": round(time.monotonic() - t0, 1), "load": loadavg()}
    for role in ("hit", "miss", "warmup"):
        idx = [i for i, r in enumerate(roles) if r == role]
        out[role] = {k: [w[k][i] for i in idx] for k in ("ttft_s", "queued_s", "prefill_s", "num_cached_tokens",
                                                         "outputs")}
    if kvc:
        out["scheduler"] = {k: sched.get(k) for k in ("ctl_l3_hit_tokens", "ctl_l3_declined_slow_pages",
                                                        "ctl_prefetch_loaded_pages", "ctl_prefetch_cancelled_pages",
                                                        "ctl_prefetch_failed_pages", "ctl_l3_probe_hits")}
    print(f"[l3_hit_ttft] {name}: hit TTFT ms {_ms(out['hit']['ttft_s'])} (queued {_ms(out['hit']['queued_s'])}),"
          f" miss TTFT ms {_ms(out['miss']['ttft_s'])}, hit cached {out['hit']['num_cached_tokens']}", flush=True)
    return out


def _ms(xs: list) -> list:
    return [None if x is None else round(x * 1000) for x in xs]


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
        phases = {"write": run_phase("write", model_dir, p, work, (prompts(p, 0), ["hit"] * p["docs"]),
                                     tierkv_config(p, root, None))}
        phases["recompute"] = run_phase("recompute", model_dir, p, work, sequence(p, 1, 0), None)
        rec = statistics.median(phases["recompute"]["hit"]["ttft_s"])
        per_page = rec / (p["doc_tokens"] // PAGE)
        delays = {"healthy": {"delay_get_s": 0.0}, "paced": {"delay_get_page_s": round(PACED_FRACTION * per_page, 6)},
                  "slow": {"delay_get_s": round(2 * rec, 3)}, "stalled": {"delay_get_s": 600.0},
                  "turns_stalled": {"delay_get_s": 600.0, "healthy_get_pages": HEALTHY_HITS * (p["doc_tokens"] // PAGE)}}
        for k, (name, faults) in enumerate(delays.items(), start=1):
            phases[name] = run_phase(name, model_dir, p, work, sequence(p, 1, k), tierkv_config(p, root, faults))
        phases["recompute_2"] = run_phase("recompute_2", model_dir, p, work, sequence(p, 1, len(delays) + 1), None)
    data = {"benchmark": SECTION, "quick": args.quick, "params": p, "delays_s": delays, "started_at": started,
            "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "code": code,
            "conditions": conditions(), "phases": phases, "summary": summarise(phases)}
    out = Path(args.out) if args.out else (RESULTS / f"{SECTION}.json" if not args.quick else
                                           REPO / "runs" / f"{SECTION}_quick.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    print(table(data))
    if not args.quick and not args.no_readme:
        write_readme(data)
    return 0 if all(data["summary"][k]["max_ratio"] <= PROMISE for k in stores(phases)) else 1


def stores(phases: dict) -> list[str]:
    """The store conditions of :data:`STORES` that ``phases`` holds (a result file older than a condition lacks it)."""
    return [name for name in STORES if name in phases]


def summarise(phases: dict) -> dict:
    """Per store condition, for the hit prompts: ``ratios`` = TTFT / the median miss TTFT of the same engine (the
    promise's measure), their median and max; ``ratios_vs_none`` = TTFT / the median of that prompt's two
    no-connector runs; ``queued_ms`` (vLLM's time before the first compute step) of the hits and the median of the
    misses'; ``max_wait_share`` = the longest hit's queued time / the median miss TTFT (what waiting for L3 added,
    free of the compute's noise); ``miss_vs_none`` = the engine's median miss TTFT / the no-connector engines'
    (what the connector costs a prompt it cannot help); the L3 tokens served; whether the hits' outputs equal the reference's.
    ``_reference``: the no-connector engines' second run / first run per hit prompt, and their median hit TTFT /
    median miss TTFT (hit and miss documents cost the same to compute: about 1)."""
    rec, rec2 = phases["recompute"], phases["recompute_2"]
    ref = [statistics.median(pair) for pair in zip(rec["hit"]["ttft_s"], rec2["hit"]["ttft_s"])]
    none_miss = statistics.median(rec["miss"]["ttft_s"] + rec2["miss"]["ttft_s"])
    out = {}
    for name in stores(phases):
        ph = phases[name]
        miss = statistics.median(ph["miss"]["ttft_s"])
        ratios = [t / miss for t in ph["hit"]["ttft_s"]]
        vs_none = [t / r for t, r in zip(ph["hit"]["ttft_s"], ref)]
        out[name] = {"ratios": [round(x, 3) for x in ratios], "median_ratio": round(statistics.median(ratios), 3),
                     "max_ratio": round(max(ratios), 3), "miss_ttft_ms": round(miss * 1000, 1),
                     "ratios_vs_none": [round(x, 3) for x in vs_none],
                     "median_ratio_vs_none": round(statistics.median(vs_none), 3),
                     "max_ratio_vs_none": round(max(vs_none), 3),
                     "queued_ms": [round(q * 1000, 1) for q in ph["hit"]["queued_s"]],
                     "miss_queued_ms": round(statistics.median(ph["miss"]["queued_s"]) * 1000, 1),
                     "max_wait_share": round(max(ph["hit"]["queued_s"]) / miss, 3),
                     "miss_vs_none": round(miss / none_miss, 3),
                     "l3_hit_tokens": sum(ph["hit"]["num_cached_tokens"]),
                     "outputs_equal": ph["hit"]["outputs"] == rec["hit"]["outputs"]}
    out["_reference"] = {"ratios": [round(a / b, 3) for a, b in zip(rec2["hit"]["ttft_s"], rec["hit"]["ttft_s"])],
                         "hit_vs_miss": [round(statistics.median(r["hit"]["ttft_s"]) /
                                               statistics.median(r["miss"]["ttft_s"]), 3) for r in (rec, rec2)],
                         "miss_ttft_ms": round(none_miss * 1000, 1)}
    return out


def table(data: dict) -> str:
    ph, s = data["phases"], data["summary"]
    lines = ["| store | read delay | hit TTFT ms per prompt | miss TTFT ms (median, same engine) | ratio median | "
             "ratio max | hit queued ms (max / miss TTFT) | vs no connector median (max) | miss / no connector | L3 hit tokens | "
             "outputs equal |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name in stores(ph):
        x = s[name]
        lines.append(f"| {name} | {_delay(data['delays_s'][name])} | {','.join(map(str, _ms(ph[name]['hit']['ttft_s'])))}"
                     f" | {x['miss_ttft_ms']:.0f} | {x['median_ratio']:.2f} | {x['max_ratio']:.2f} | "
                     f"{','.join(str(round(q)) for q in x['queued_ms'])} ({x['max_wait_share']:.2f}) | {x['median_ratio_vs_none']:.2f} "
                     f"({x['max_ratio_vs_none']:.2f}) | {x['miss_vs_none']:.2f} | {x['l3_hit_tokens']} | "
                     f"{'yes' if x['outputs_equal'] else 'NO'} |")
    for k in ("recompute", "recompute_2"):
        lines.append(f"| no connector ({k}) | - | {','.join(map(str, _ms(ph[k]['hit']['ttft_s'])))} | "
                     f"{statistics.median(ph[k]['miss']['ttft_s']) * 1000:.0f} | - | - | "
                     f"{','.join(map(str, _ms(ph[k]['hit']['queued_s'])))} | - | - | 0 | - |")
    return "\n".join(lines)


def _shutdowns(data: dict) -> str:
    """The sentence on each phase's engine shutdown time (vLLM kills an engine that has not stopped after 60 s)."""
    return " Engine shutdown (s): " + ", ".join(f"{k} {v['shutdown_s']:.1f}" for k, v in data["phases"].items()) + "."


def _delay(d) -> str:
    """A store's ``l3.faults`` delays as table text."""
    parts = [f"{d['delay_get_s']} s a call"] if "delay_get_s" in d else []
    if "delay_get_page_s" in d:
        parts.append(f"{d['delay_get_page_s'] * 1000:.2f} ms a page")
    if d.get("healthy_get_pages"):
        parts.append(f"after {d['healthy_get_pages']} pages")
    return ", ".join(parts)


def _turns(data: dict) -> str:
    """The words on the turns-stalled store, for a result file that has it."""
    d = data.get("delays_s", {}).get("turns_stalled")
    if d is None:
        return ""
    read = data["phases"]["turns_stalled"]["hit"]["num_cached_tokens"][0] // PAGE
    return (f", or serves {d['healthy_get_pages']} pages and then stalls (turns stalled,"
            " `l3.faults.healthy_get_pages`: the stall comes during a hit's read that the fetch estimate, learnt on"
            f" the fast store, made synchronous, the forward of its step waiting for it; its first hit read {read}"
            " pages)")


def render_section(data: dict) -> str:
    """The ``## l3_hit_ttft`` section of ``benchmarks/README.md``, drawn from ``data`` alone (refused by
    ``results_check.ResultsError`` for a file without a commit, measured on uncommitted code, or lacking keys)."""
    results_check.check_results(data, {"params": None, "code": {"commit": None, "dirty": None}, "phases": None,
                                       "summary": None, "conditions": None}, f"{SECTION}.json")
    p, cond = data["params"], data["conditions"]
    r = data["summary"]["_reference"]
    body = f"""## {SECTION}

`benchmarks/l3_hit_ttft.py` (issue 19, deliver 3): is an L3 hit ever slower than recomputing it? One engine per
phase (`tests/helpers/engine.py`, vLLM's CPU backend, `{p['preset']}` preset, L1 {p['l1_blocks']} blocks, L2
{p['l2_pages']} pages, `best_effort`), prompts one at a time, 1 output token: {p['docs']} documents of
{p['doc_tokens']} tokens + {p['question_tokens']}-token questions written to a file L3, then asked with new
questions by a fresh engine whose store answers at once (healthy), takes {PACED_FRACTION:.0%} of a page's recompute
time per page read (paced, `l3.faults.delay_get_page_s`), answers after about twice a recompute (slow) or not
within the run (stalled, `l3.faults.delay_get_s`){_turns(data)}. Every engine first computes {warmup_prompts(p)} warm-up prompts (not counted),
then alternates the hit prompts with as many miss prompts (documents of the same length never written: the
same engine recomputes them). Ratio = hit TTFT / median miss TTFT of the same engine; promise: every ratio <=
{PROMISE}. Beside it: against engines without connector run before and after (hit TTFT / median of the prompt's
two runs; their second run / first run per prompt: {', '.join(f'{x:.2f}' for x in r['ratios'])}; their hit /
miss medians {', '.join(f'{x:.2f}' for x in r['hit_vs_miss'])}), vLLM's time queued before each hit's first
compute step (tierkv's wait for L3 is in it; in brackets the longest as a share of the miss TTFT: what waiting
added, apart from the compute's own noise), and each engine's median miss TTFT / the no-connector engines'
({r['miss_ttft_ms']:.0f} ms).

Measured {data['started_at']} on tierkv commit `{results_check.short(data['code']['commit'])}`, {cond['cpus']} vCPU
({cond['cpu']}; {cond['isa']}); 1-minute load average after each phase:
{', '.join(f"{k} {v['load'][0]}" for k, v in data['phases'].items())}.{_shutdowns(data)}

{table(data)}

```bash
.venv/bin/python -m benchmarks.l3_hit_ttft
.venv/bin/python -m benchmarks.l3_hit_ttft --readme-from benchmarks/results/l3_hit_ttft.json
```
"""
    return body


def write_readme(data: dict) -> None:
    """Print the README block (:func:`render_section`)."""
    results_check.print_section(render_section(data))


if __name__ == "__main__":
    sys.exit(main())
