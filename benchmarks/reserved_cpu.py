"""Decode speed with and without ``VLLM_CPU_NUM_OF_RESERVED_CPU`` (README: "Operating tierkv: metrics, logs, memory").

vLLM's CPU backend keeps one core per worker away from its OpenMP compute threads for the scheduler, and one more
per worker whenever a KV connector is configured. This benchmark measures what that costs a decode-heavy workload
and what setting the variable gives back. Configurations (each its own engine process, ``tests/helpers/engine.py``),
run in interleaved order ``--repeats`` times:

- ``no_connector``: vLLM without a connector, variable unset (vLLM's own reservation);
- ``tierkv_default``: tierkv's connector (L2 only), variable unset (vLLM reserves the extra core);
- ``tierkv_reserved``: tierkv's connector with ``VLLM_CPU_NUM_OF_RESERVED_CPU`` = workers on the host (1), the value
  vLLM uses without a connector.

Workload: ``--prompts`` distinct prompts of ``--prompt-len`` tokens sent one at a time, ``--max-tokens`` generated
each (greedy, ``ignore_eos``); nothing is shared between prompts, so tierkv only saves pages (its cost on the decode
path is in the numbers too). Reported per configuration: decode milliseconds per output token (TPOT = (latency -
TTFT) / (max_tokens - 1), median over requests, then median and range over repeats), TTFT, the compute threads
vLLM logged (``core ids``), load average before and after each engine.

Run (idle machine; ~8 min with the defaults on 2 vCPUs)::

    .venv/bin/python -m benchmarks.reserved_cpu                 # benchmarks/results/reserved_cpu.json + PNG
    .venv/bin/python -m benchmarks.reserved_cpu --quick         # smoke run (test model; runs/reserved_cpu_quick.json)
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import runpy
import statistics
import sys
import tempfile
import time
from pathlib import Path

from benchmarks import harness
from benchmarks.harness.results import code_state

REPO = Path(__file__).resolve().parents[1]
RESULTS = Path(__file__).resolve().parent / "results"


engine = harness.e2e_engine()
make_tiny_model = harness.make_tiny_model()

#: configuration -> (connector?, VLLM_CPU_NUM_OF_RESERVED_CPU or None = unset)
CONFIGS = {"no_connector": (False, None), "tierkv_default": (True, None), "tierkv_reserved": (True, "1")}


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def _threads(log_path: str) -> str | None:
    """The ``core ids=[...]`` vLLM logged for rank 0 (its OpenMP compute threads)."""
    try:
        text = Path(log_path).read_text(errors="replace")
    except OSError:
        return None
    m = re.search(r"local_rank=0, core ids=(\[[^\]]*\])", text)
    return m.group(1) if m else None


def run_config(name: str, model_dir: str, prompts: list, max_tokens: int, work: Path, timeout: float) -> dict:
    connector, reserved = CONFIGS[name]
    kvc = engine.tierkv_kv_config({"host_pool": {"num_pages": 256}}) if connector else None
    blocks = 8 + sum(-(-(len(p) + max_tokens) // 32) for p in prompts)
    load0 = os.getloadavg()[0]
    res = engine.run_job(model_dir, [{"name": "decode", "prompts": prompts}], kv_transfer_config=kvc,
                         num_gpu_blocks_override=blocks, max_tokens=max_tokens, workdir=work,
                         env={"VLLM_CPU_NUM_OF_RESERVED_CPU": reserved}, timeout_s=timeout,
                         extra_engine_args={"max_model_len": min(8192, (blocks - 1) * 32)})
    w = res["workloads"]["decode"]
    tpot = [(lat - ttft) / (max_tokens - 1) for lat, ttft in zip(w["latency_s"], w["ttft_s"])
            if lat is not None and ttft is not None]
    return {"tpot_ms": 1e3 * _median(tpot), "ttft_ms": 1e3 * _median(w["ttft_s"]), "core_ids": _threads(res["log_path"]),
            "load_before": load0, "load_after": os.getloadavg()[0], "wall_s": w["wall_s"],
            "leaked_processes": res["leaked_processes"]}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smoke run: test model, 2 prompts, 1 repeat")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"subset of {','.join(CONFIGS)}")
    ap.add_argument("--out", default=None, help="result JSON (default results/reserved_cpu.json)")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds allowed per engine")
    a = ap.parse_args(argv)
    if a.quick:
        a.repeats, a.prompts, a.prompt_len, a.max_tokens = 1, 2, 64, 8
    names = [n.strip() for n in a.configs.split(",") if n.strip()]
    bad = [n for n in names if n not in CONFIGS]
    if bad:
        ap.error(f"--configs: unknown {bad}; allowed {list(CONFIGS)}")
    if a.max_tokens < 2:
        ap.error("--max-tokens must be >= 2 (decode time needs a second token)")
    preset = "test" if a.quick else "bench"
    model_dir = make_tiny_model.make_model(None, preset)
    vocab = make_tiny_model.PRESETS[preset]["vocab_size"]
    rng = random.Random(7)
    prompts = [[rng.randrange(10, vocab) for _ in range(a.prompt_len)] for _ in range(a.prompts)]
    work = Path(tempfile.mkdtemp(prefix="tierkv-reserved-cpu-"))
    runs: dict[str, list] = {n: [] for n in names}
    t0 = time.time()
    for rep in range(a.repeats):
        order = names if rep % 2 == 0 else list(reversed(names))   # interleaved: drift hits every configuration
        for n in order:
            print(f"[reserved_cpu] repeat {rep + 1}/{a.repeats}: {n} ...", flush=True)
            r = run_config(n, model_dir, prompts, a.max_tokens, work / f"{n}_{rep}", a.timeout)
            print(f"[reserved_cpu]   TPOT {r['tpot_ms']:.1f} ms, TTFT {r['ttft_ms']:.0f} ms, cores {r['core_ids']}, "
                  f"load {r['load_before']:.1f}->{r['load_after']:.1f}", flush=True)
            runs[n].append(r)
    summary = {n: {"tpot_ms_median": _median([r["tpot_ms"] for r in rs]),
                   "tpot_ms_range": [min(r["tpot_ms"] for r in rs), max(r["tpot_ms"] for r in rs)],
                   "ttft_ms_median": _median([r["ttft_ms"] for r in rs]),
                   "core_ids": rs[0]["core_ids"]} for n, rs in runs.items()}
    out = {"benchmark": "reserved_cpu", "code": code_state(), "quick": a.quick, "preset": preset,
           "params": {"repeats": a.repeats, "prompts": a.prompts, "prompt_len": a.prompt_len,
                      "max_tokens": a.max_tokens},
           "configs": {n: {"connector": CONFIGS[n][0], "VLLM_CPU_NUM_OF_RESERVED_CPU": CONFIGS[n][1]} for n in names},
           "conditions": {"cpus": os.cpu_count(), "wall_s": round(time.time() - t0, 1),
                          "env": {k: v for k, v in engine.DEFAULT_ENV.items() if k != "VLLM_CPU_NUM_OF_RESERVED_CPU"}},
           "runs": runs, "summary": summary}
    path = Path(a.out) if a.out else (REPO / "runs" / "reserved_cpu_quick.json" if a.quick
                                      else RESULTS / "reserved_cpu.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(out, indent=1) + "\n")
    print("\n| configuration | VLLM_CPU_NUM_OF_RESERVED_CPU | compute cores | TPOT ms (median, range) | TTFT ms |")
    print("|---|---|---|---|---|")
    for n, s in summary.items():
        lo, hi = s["tpot_ms_range"]
        print(f"| {n} | {CONFIGS[n][1] or 'unset'} | {s['core_ids']} | {s['tpot_ms_median']:.1f} ({lo:.1f}-{hi:.1f}) "
              f"| {s['ttft_ms_median']:.0f} |")
    print(f"\nwrote {path} in {time.time() - t0:.0f} s")
    runpy.run_path(str(Path(__file__).with_name("plots.py")))["charts_for"](path)  # PNG chart next to the JSON
    return 0


if __name__ == "__main__":
    sys.exit(main())
