"""End-to-end benchmark on vLLM's CPU backend (tierkv issue 2, item 10): does tierkv's L2 turn recomputed
prefills into loads?

Model: the ``bench`` preset of ``examples/make_tiny_model.py`` (Llama architecture, hidden 1024, 8 layers,
16 heads, 4 KV heads, intermediate 2816, vocab 8192, bf16, random weights).

Workloads (token ids, greedy, one request at a time so batch composition never differs between configurations):

- ``docs``: 8 distinct 2,048-token documents, each followed by a question of 40-120 tokens that differs in every
  round (so a connector must match a prefix, not a whole prompt), asked round-robin for 3 rounds;
- ``chat``: multi-turn chats (a 1,024-token opening message, then turns); each turn's prompt is the previous
  prompt plus the model's answer plus a new 40-120-token user message; chats interleaved turn by turn.

Configurations, each in its own engine subprocess (``tests/helpers/engine.py``) with the same
``VLLM_CPU_NUM_OF_RESERVED_CPU`` (so thread counts and bf16 rounding are equal):

- ``no_connector``: L1 = 200 blocks of 32 tokens (too small for the 8 documents), no connector;
- ``example_connector``: vLLM's stock ``ExampleConnector`` (files under a temporary directory), L1 = 200;
- ``tierkv``: ``TierKVConnector`` with an L2 host pool, L1 = 200;
- ``ideal``: no connector, L1 = 1,000 blocks (every document stays in vLLM's own prefix cache).

Reported per configuration and round: seconds, TTFT p50, prompt tokens, tokens hit per tier (L1 = vLLM's
``prefix_cache_hits``; connector = ``external_prefix_cache_hits``, which for tierkv are L2 hits), and whether the
greedy output ids equal those of ``ideal``. Targets (issue 2): round 1 at most 5 % slower than ``no_connector``;
rounds 2+3 together within 1.5x of ``ideal`` (aim 1.1x).

    .venv/bin/python -m benchmarks.e2e_cpu             # full run -> results/e2e_cpu.json + its README table printed
    .venv/bin/python -m benchmarks.e2e_cpu --quick     # smoke run on the test model -> runs/e2e_cpu_quick.json
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness, plots
from benchmarks.harness import REPO, RESULTS
from benchmarks.harness import results as results_check
from benchmarks.harness.machine import machine
from benchmarks.harness.servers import MooncakeMaster, MooncakeSegment, ZmqServer

SECTION = "e2e_cpu"
engine = harness.e2e_engine()
make_tiny_model = harness.make_tiny_model()

#: keys every result file of this script has (``results_check.check_results``): the README tables are drawn only
#: from files that have all of them, so a file from an older version of this script or edited by hand is refused.
_ROW_KEYS = {k: None for k in ("seconds", "ttft_p50_s", "ttft_p90_s", "requests", "prompt_tokens", "cached_tokens",
                               "l1_hit_tokens", "connector_hit_tokens", "ttft_s", "cached_per_request")}
RESULT_SCHEMA = {
    "benchmark": None, "quick": None, "workloads": None, "targets": None, "l3_targets": None, "finished_at": None,
    "code": {"commit": None, "dirty": None},
    "params": {k: None for k in ("preset", "n_docs", "doc_len", "q_min", "q_max", "rounds", "l1_blocks",
                                 "ideal_blocks", "max_tokens", "n_chats", "chat_open_len", "chat_turns",
                                 "chat_answer", "l2_gb", "l3_l2_pages")},
    "conditions": {k: None for k in ("cpus", "cpu", "isa", "torch", "vllm_cpu", "python", "env")},
    "runs": {"*": {"elapsed_s": None, "load_before": None, "load_after": None}},
    "configs": {"*": {"startup_s": None, "shutdown_s": None, "leaked_processes": None,
                      "workloads": {"*": _ROW_KEYS}}},
}
#: counters the README text reads from a tierkv configuration's ``connector_stats``
_TIERKV_STATS = {"scheduler": {k: None for k in ("l2_hit_tokens", "lookup_tokens", "lookups", "lookup_seconds",
                                                 "evicted_pages")},
                 "worker": {k: None for k in ("save_pages", "save_bytes", "save_seconds", "load_pages",
                                              "load_bytes", "load_seconds")}}
_L3_STATS = {"scheduler": {"ctl_l3_hit_tokens": None, "lookups": None, "lookup_seconds": None},
             "worker": {"l3_prefetch_pages": None, "l3_backup_pages": None}}


def check_results(results: dict, name: str) -> None:
    """Refuse (``results_check.ResultsError``) a result file that cannot back a README table: a key the current
    version of this script writes is missing, no commit is recorded, the code was dirty, or it is a quick run."""
    configs_schema = dict(RESULT_SCHEMA["configs"])
    for cname in results.get("configs", {}) if isinstance(results.get("configs"), dict) else ():
        if cname == "tierkv":
            configs_schema[cname] = {"connector_stats": _TIERKV_STATS}
        elif cname in L3_CONFIGS or cname in RESTART:
            configs_schema[cname] = {"connector_stats": _L3_STATS}
    results_check.check_results(results, {**RESULT_SCHEMA, "configs": configs_schema}, name)

# Reference measured earlier on an idle machine (issue 2), seconds per docs round 1/2/3.
ISSUE_REFERENCE = {"no_connector": [6.9, 6.4, 6.3], "ideal": [7.4, 1.1, 1.1], "example_connector": [6.9, 6.6, 6.8]}

FULL = dict(preset="bench", n_docs=8, doc_len=2048, q_min=40, q_max=120, rounds=3, l1_blocks=200,
            ideal_blocks=1000, max_tokens=8, n_chats=6, chat_open_len=1024, chat_turns=4, chat_answer=32,
            l2_gb=1.0, l3_l2_pages=128)
QUICK = dict(preset="test", n_docs=4, doc_len=512, q_min=40, q_max=120, rounds=3, l1_blocks=48,
             ideal_blocks=200, max_tokens=4, n_chats=3, chat_open_len=256, chat_turns=3, chat_answer=8,
             l2_gb=0.25, l3_l2_pages=16)


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


#: L3 configurations: name -> (backend, write policy). Their L2 holds ``l3_l2_pages`` pages, too few for the
#: documents, so repeated prefixes must come back from L3.
L3_CONFIGS = {
    "tierkv_file_wt": ("file", "write_through"),
    "tierkv_file_wts": ("file", "write_through_selective"),
    "tierkv_file_wb": ("file", "write_back"),
    "tierkv_zmq_wt": ("zmq", "write_through"),
    "tierkv_mooncake_wt": ("mooncake", "write_through"),
}
#: restart runs: a writer engine serves round 1 only (write_through to a fresh file store), is shut down, and a new
#: engine on the same store serves rounds 2 and 3 (so its prefix reuse is the documents, as in ``ideal``)
RESTART = {"restart_file": "file"}


def l3_kv_config(p: dict, backend: str, policy: str, l3_section: dict) -> dict:
    """tierkv with a small L2 and the given L3 backend section (``l3_section``: the backend's keys)."""
    return engine.tierkv_kv_config(
        {"host_pool": {"num_pages": p["l3_l2_pages"]},
         "l3": {"backend": backend, backend: l3_section},
         "controller": {"write_policy": policy, "write_through_threshold": 1}},
        load_failure_policy="recompute")


def configs(p: dict, store_dir: Path) -> dict[str, tuple]:
    """name -> (kv_transfer_config or None, L1 blocks). L3 configurations get their kv_transfer_config when their
    server is up (:func:`l3_backend_section`); here their entry is (None, blocks) with the backend in ``L3_CONFIGS``."""
    out = {
        "ideal": (None, p["ideal_blocks"]),
        "no_connector": (None, p["l1_blocks"]),
        "example_connector": (engine.example_kv_config(store_dir), p["l1_blocks"]),
        "tierkv": (engine.tierkv_kv_config({"host_pool": {"size_gb": p["l2_gb"]}}, load_failure_policy="recompute"),
                   p["l1_blocks"]),
    }
    for name in list(L3_CONFIGS) + list(RESTART):
        out[name] = (None, p["l1_blocks"])
    return out


class L3Servers:
    """The L3 side of one configuration: a file directory, a fresh ``tierkv server`` (ZMQ) or a fresh
    ``mooncake_master`` plus a client of this process holding the store's memory segment (the engine's own client
    contributes none, so the pages outlive an engine), started before the engine and stopped after it, by PID
    (``tests/helpers/servers.py``)."""

    def __init__(self, work: Path):
        self.work = work
        self.stack = contextlib.ExitStack()

    def section(self, name: str, backend: str) -> dict:
        if backend == "file":
            return {"root": str(self.work / f"l3_{name}")}
        d = self.work / f"{backend}_{name}"
        d.mkdir(parents=True, exist_ok=True)
        if backend == "zmq":
            srv = ZmqServer(d / "zmq_server.log", capacity=4 << 30)
            self.stack.callback(srv.stop)
            return {"endpoint": srv.endpoint, "timeout_s": 5.0, "shm": "off", "reconnect_backoff_s": 0.05,
                    "max_backoff_s": 0.2}
        master = MooncakeMaster(str(d)).start()
        self.stack.callback(master.stop)
        segment = MooncakeSegment(master, 2 << 30)   # the store's memory; the engine is a pure client
        self.stack.callback(segment.stop)
        return {**master.client_config(), "global_segment_size": 0, "local_buffer_size": "4MiB", "timeout_s": 5.0,
                "setup_timeout_s": 30.0,
                "staging_bytes": "64MiB"}  # room for a batch of bench pages (16 x 256 KiB + headers)

    def stop(self) -> None:
        self.stack.close()
        self.stack = contextlib.ExitStack()


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
            "ttft_s": list(w["ttft_s"]),
            "cached_per_request": list(w["num_cached_tokens"]),
        }
        if ideal is not None and wname in ideal["workloads"]:
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


def conditions() -> dict:
    """The machine (:func:`~benchmarks.harness.machine.machine`: model, cores, ISA, flags), versions, engine env."""
    import torch
    try:
        from importlib.metadata import version
        vllm_v = version("vllm-cpu")
    except Exception:  # pragma: no cover
        vllm_v = "?"
    m = machine()
    return {"cpus": m["cpus"], "cpu": m["cpu"], "isa": m["isa"], "flags": m["flags"], "torch": torch.__version__,
            "vllm_cpu": vllm_v, "python": platform.python_version(), "env": dict(engine.DEFAULT_ENV)}


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
            if w not in c["workloads"]:
                continue
            r = c["workloads"][w]
            same = "ref" if cname == "ideal" else ("yes" if r.get("outputs_identical") else
                                                   f"no ({r.get('outputs_differing')}/{r['requests']} differ)")
            ttft = f"{r['ttft_p50_s'] * 1e3:.0f}" if r["ttft_p50_s"] is not None else "-"
            lines.append(f"| {cname} | {w} | {r['seconds']:.2f} | {ttft} | {r['prompt_tokens']} | "
                         f"{r['l1_hit_tokens']} | {r['connector_hit_tokens']} | {same} |")
    return "\n".join(lines)


def l3_targets(results: dict) -> dict:
    """Targets of the controller issue, per L3 configuration present: rounds 2+3 against ``ideal`` (file 1.5x,
    ZMQ/Mooncake 2x), round 1 against ``no_connector`` (write_through: at most 1.05x), the first round after a
    restart against ideal's warm round (1.5x), and no request that hit L3 with a TTFT above recomputing it (the
    same request's TTFT in ``no_connector``)."""
    cfg = results["configs"]
    ideal, noc = cfg.get("ideal"), cfg.get("no_connector")
    out = {}
    for name, c in cfg.items():
        if name not in L3_CONFIGS and name not in RESTART:
            continue
        w = c["workloads"]
        t = {}
        backend = "file" if name in RESTART else L3_CONFIGS[name][0]
        later = [x for x in ("docs_r2", "docs_r3") if x in w]
        if ideal is not None and later:
            if name in RESTART:
                r = w["docs_r2"]["seconds"] / ideal["workloads"]["docs_r2"]["seconds"]
                t["first_round_after_restart_vs_ideal"] = {"ratio": r, "target": 1.5, "met": r <= 1.5}
            else:
                r = sum(w[x]["seconds"] for x in later) / sum(ideal["workloads"][x]["seconds"] for x in later)
                lim = 1.5 if backend == "file" else 2.0
                t["rounds23_vs_ideal"] = {"ratio": r, "target": lim, "met": r <= lim}
        if noc is not None and "docs_r1" in w and name in L3_CONFIGS and L3_CONFIGS[name][1] == "write_through":
            r = w["docs_r1"]["seconds"] / noc["workloads"]["docs_r1"]["seconds"]
            t["round1_vs_no_connector"] = {"ratio": r, "target": 1.05, "met": r <= 1.05}
        if noc is not None:
            above, hits = 0, 0
            for x in later:
                mine, ref = w[x], noc["workloads"].get(x)
                if ref is None:
                    continue
                for tt, cached, rt in zip(mine["ttft_s"], mine["cached_per_request"], ref["ttft_s"]):
                    if cached and tt is not None and rt is not None:
                        hits += 1
                        above += tt > rt
            t["hits_slower_than_recompute"] = {"count": above, "of": hits, "target": 0, "met": above == 0}
        out[name] = t
    return out


def l3_table(results: dict) -> str:
    lines = ["| config | round 1 s | round 2 s | round 3 s | TTFT p50 r2/r3 ms | L3 hit tok | L3 pages read | "
             "pages backed up | lookups (mean us) | same as ideal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, c in results["configs"].items():
        if name not in L3_CONFIGS and name not in RESTART and name not in ("tierkv", "ideal", "no_connector"):
            continue
        w = c["workloads"]
        st = c.get("connector_stats", {})
        sc, wk = st.get("scheduler", {}), st.get("worker", {})

        def sec(x):
            return f"{w[x]['seconds']:.1f}" if x in w else "-"

        ttft = "/".join(f"{w[x]['ttft_p50_s'] * 1e3:.0f}" for x in ("docs_r2", "docs_r3") if x in w)
        same = all(w[x].get("outputs_identical", True) for x in w) if name != "ideal" else "ref"
        look = (f"{sc['lookups']} ({1e6 * sc['lookup_seconds'] / sc['lookups']:.0f})"
                if sc.get("lookups") else "-")
        lines.append(f"| {name} | {sec('docs_r1')} | {sec('docs_r2')} | {sec('docs_r3')} | {ttft} | "
                     f"{sc.get('ctl_l3_hit_tokens', '-')} | {wk.get('l3_prefetch_pages', '-')} | "
                     f"{wk.get('l3_backup_pages', '-')} | {look} | {same} |")
    return "\n".join(lines)


def l3_targets_text(results: dict) -> str:
    out = []
    for name, t in results.get("l3_targets", {}).items():
        for k, x in t.items():
            if "ratio" in x:
                out.append(f"- {name}, {k.replace('_', ' ')}: {x['ratio']:.3f} (target <= {x['target']}): "
                           f"{'met' if x['met'] else 'MISSED'}")
            else:
                out.append(f"- {name}, L3 hits with TTFT above recompute: {x['count']} of {x['of']}: "
                           f"{'met' if x['met'] else 'MISSED'}")
    return "\n".join(out)


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


def _provenance(results: dict, json_name: str) -> str:
    """The lines saying which code and machine produced a table (from the file itself)."""
    cond = results["conditions"]
    loads = ", ".join(f"{k} {v['load_before']:.1f}->{v['load_after']:.1f}" for k, v in results["runs"].items())
    return (f"Measured by `python -m benchmarks.e2e_cpu` at commit `{results_check.short(results['code']['commit'])}` "
            f"(run finished {results['finished_at']}), results `results/{json_name}`: {cond['cpus']} vCPU "
            f"({cond['cpu']}; {cond['isa']}), vLLM {cond['vllm_cpu']}, torch {cond['torch']}, configurations one "
            f"after another, nothing else running; load average before->after each configuration (the engine's "
            f"own load): {loads}.")


def _command(results: dict) -> str:
    kinds = sorted({"chat" if w == "chat" else "docs" for w in results["workloads"]})
    return f".venv/bin/python -m benchmarks.e2e_cpu --workloads {','.join(kinds)} --configs {','.join(results['configs'])}"


def render_section(results: dict, json_name: str = "e2e_cpu.json") -> str:
    """The README block of a run without L3 configurations (``## e2e_cpu``, or ``## e2e_cpu_chat`` for a chat-only
    run), drawn from ``results`` alone. Raises ``results_check.ResultsError`` for a file that cannot back it."""
    check_results(results, json_name)
    stats = results["configs"].get("tierkv", {}).get("connector_stats", {})
    s, w = stats.get("scheduler", {}), stats.get("worker", {})
    counters = ""
    if s or w:
        counters = (f"\n\ntierkv counters (whole run): L2 hit tokens {s['l2_hit_tokens']}, pages saved "
                    f"{w['save_pages']} ({w['save_seconds']:.3f} s of copies), loaded {w['load_pages']} "
                    f"({w['load_seconds']:.3f} s), L2 evictions {s['evicted_pages']}.")
    targets = targets_text(results)
    return f"""## {results.get("section", SECTION)}

```bash
{_command(results)}
```

{_provenance(results, json_name)}
{results.get("readme_note", "")}

{table(results)}
{"" if not targets else chr(10) + "Targets:" + chr(10) + chr(10) + targets}{counters}
"""


def write_readme(results: dict, json_name: str = "e2e_cpu.json") -> None:
    """Print the README block that ``results`` backs (see :func:`render_section`)."""
    results_check.print_section(render_section(results, json_name))


L3_SECTION = "e2e_cpu_l3"


def render_l3_section(results: dict, json_name: str = "e2e_cpu_l3.json") -> str:
    """The ``## e2e_cpu_l3`` README block (the L3 configurations' table and targets), drawn from ``results`` alone.
    Raises ``results_check.ResultsError`` for a file that cannot back it."""
    check_results(results, json_name)
    return f"""## {L3_SECTION}

```bash
{_command(results)}
```

{_provenance(results, json_name)}
{results.get("readme_note", "")}

{l3_table(results)}

Targets:

{l3_targets_text(results)}
"""


def write_l3_readme(results: dict, json_name: str = "e2e_cpu_l3.json") -> None:
    """Print the ``e2e_cpu_l3`` README block (:func:`render_l3_section`)."""
    results_check.print_section(render_l3_section(results, json_name))


def split_base(results: dict) -> dict:
    """The configurations without L3 of a combined run, as a result file of their own (``e2e_cpu.json``): the
    same measurements, so both README sections come from one run."""
    base = json.loads(json.dumps(results))
    base["configs"] = {k: v for k, v in results["configs"].items() if k not in L3_CONFIGS and k not in RESTART}
    base["runs"] = {k: v for k, v in results["runs"].items() if k in base["configs"]}
    base["l3_targets"] = {}
    base["same_run_as"] = "e2e_cpu_l3.json"
    base.pop("readme_note", None)
    return base


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: test model, small workload")
    ap.add_argument("--configs", default="ideal,no_connector,example_connector,tierkv",
                    help="comma-separated subset of: ideal,no_connector,example_connector,tierkv, "
                         + ",".join(list(L3_CONFIGS) + list(RESTART)) + "")
    ap.add_argument("--out", default=None, help="result JSON (default results/e2e_cpu.json; with L3 configurations e2e_cpu_l3.json plus "
                         "e2e_cpu.json for the others of the same run; chat only: e2e_cpu_chat.json; quick: "
                         "runs/e2e_cpu_quick.json)")
    ap.add_argument("--workloads", default="docs,chat", help="comma-separated subset of: docs,chat")
    ap.add_argument("--no-readme", action="store_true", help="do not print the README table at the end")
    ap.add_argument("--readme-from", default=None, metavar="JSON",
                    help="only print the README table of an existing result file (refused for a file that "
                         "lacks a current key, records no commit or was measured on uncommitted code)")
    ap.add_argument("--note", default="", help="extra paragraph for the README table (kept in the result file)")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds allowed per configuration")
    args = ap.parse_args(argv)

    if args.readme_from:
        src = Path(args.readme_from)
        res = json.loads(src.read_text())
        if args.note:  # the note is part of the result file, so the README section can always be redrawn from it
            res["readme_note"] = args.note
        try:
            if set(res.get("configs", {})) & (set(L3_CONFIGS) | set(RESTART)):
                write_l3_readme(res, src.name)
            else:
                write_readme(res, src.name)
        except results_check.ResultsError as e:
            print(f"e2e_cpu: no README table: {e}", file=sys.stderr)
            return 2
        if args.note:
            results_check.write_result(src, res)
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

    code = results_check.code_state()
    if code["dirty"] and not args.quick:
        print(f"[e2e_cpu] warning: uncommitted changes to {', '.join(code['dirty'][:8])}: the results will be "
              "written but no README table can be drawn from them", file=sys.stderr, flush=True)
    results = {"benchmark": SECTION, "quick": args.quick, "params": p, "workloads": wnames,
               "conditions": conditions(), "code": code, "issue_reference_s_per_round": ISSUE_REFERENCE,
               "runs": {}, "configs": {}, "readme_note": args.note}
    if kinds == {"chat"}:
        results["section"] = "e2e_cpu_chat"
    raw = {}
    servers = L3Servers(work)
    for name in names:
        kvc, blocks = cfgs[name]
        wl = workloads
        try:
            if name in L3_CONFIGS:
                backend, policy = L3_CONFIGS[name]
                section = servers.section(name, backend)
                kvc = l3_kv_config(p, backend, policy, section)
            elif name in RESTART:
                section = servers.section(name, RESTART[name])
                kvc = l3_kv_config(p, RESTART[name], "write_through", section)
                first = [w for w in workloads if w["name"] == "docs_r1"]
                print(f"[e2e_cpu] {name}: writer engine, round 1 only ...", flush=True)
                t0, wload0 = time.monotonic(), os.getloadavg()[0]
                wres = engine.run_job(model_dir, first, kv_transfer_config=kvc, num_gpu_blocks_override=blocks,
                                      max_tokens=p["max_tokens"], workdir=work / f"{name}_writer",
                                      timeout_s=args.timeout, extra_engine_args={"max_model_len": min(
                                          8192, (min(blocks, p["l1_blocks"]) - 1) * 32)})
                results["runs"][f"{name}_writer"] = {"elapsed_s": time.monotonic() - t0, "load_before": wload0,
                                                      "load_after": os.getloadavg()[0],
                                                      "stats": engine.stats_by_role(wres)}
                wl = [w for w in workloads if w["name"] not in ("docs_r1", "chat")]
            load0 = os.getloadavg()[0]
            print(f"[e2e_cpu] {name}: L1 {blocks} blocks, connector {kvc['kv_connector'] if kvc else 'none'} ...",
                  flush=True)
            t0 = time.monotonic()
            res = engine.run_job(model_dir, wl, kv_transfer_config=kvc, num_gpu_blocks_override=blocks,
                                 max_tokens=p["max_tokens"], workdir=work / name, timeout_s=args.timeout,
                                 extra_engine_args={"max_model_len": min(8192, (min(blocks, p["l1_blocks"]) - 1) * 32)})
        finally:
            servers.stop()
        raw[name] = res
        results["runs"][name] = {"elapsed_s": time.monotonic() - t0, "load_before": load0,
                                 "load_after": os.getloadavg()[0], "log": res["log_path"]}
        results["configs"][name] = summarise(name, res, raw.get("ideal"))
        rs = results["configs"][name]["workloads"]
        print("   " + "  ".join(f"{w} {rs[w]['seconds']:.2f}s" for w in wnames if w in rs), flush=True)
    results["targets"] = targets(results)
    results["l3_targets"] = l3_targets(results)

    print()
    print(table(results))
    print()
    print(targets_text(results))
    if results["l3_targets"]:
        print()
        print(l3_table(results))
        print()
        print(l3_targets_text(results))
    results["finished_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    # Quick (smoke) results are not committed: they go to the git-ignored runs/ folder.
    l3_run = bool(set(names) & (set(L3_CONFIGS) | set(RESTART)))
    default_name = ("e2e_cpu_l3.json" if l3_run else
                    "e2e_cpu_chat.json" if results.get("section") == "e2e_cpu_chat" else "e2e_cpu.json")
    out = Path(args.out) if args.out else (REPO / "runs" / "e2e_cpu_quick.json" if args.quick
                                           else RESULTS / default_name)
    written = [(out, results)]
    if l3_run and not args.out and not args.quick and {"ideal", "no_connector", "tierkv"} <= set(names):
        written.append((RESULTS / "e2e_cpu.json", split_base(results)))  # same run, the e2e_cpu section's file
    for path, data in written:
        results_check.write_result(path, data)
        print(f"wrote {path}")
        plots.charts_for(path)  # PNG charts next to the JSON
    if args.quick or args.no_readme:
        return 0
    try:
        for path, data in written:
            if set(data["configs"]) & (set(L3_CONFIGS) | set(RESTART)):
                write_l3_readme(data, path.name)
            elif {"ideal", "no_connector", "tierkv"} <= set(data["configs"]):
                write_readme(data, path.name)
    except results_check.ResultsError as e:
        print(f"e2e_cpu: no README table: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
