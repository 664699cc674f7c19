"""serve_cpu's client: each run is vLLM's own ``vllm bench serve`` (``vllm.benchmarks.serve``) in a subprocess.

:func:`workload_args` gives a workload's dataset arguments, :func:`run_seed` / :func:`disjoint_seeds` its seed,
:func:`run_client` runs it against a server and returns vLLM's result JSON, :func:`summarise_run` keeps what a
result records of it (throughputs in requests and tokens per second, latencies in ms, tokens per tier from the
server's counter deltas).
"""
from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness.servers import VllmServer, tail
from benchmarks.harness.stats import metric, phase_means_ms
from benchmarks.serve_cpu.configs import BLOCK, CLIENT_ENV, WORKLOADS

#: the client process: ``vllm bench serve`` with the arguments after ``-c`` (run by :func:`run_client`)
CLIENT_CODE = """import sys
from vllm.benchmarks.serve import add_cli_args, main
from vllm.utils.argparse_utils import FlexibleArgumentParser
parser = FlexibleArgumentParser(prog="vllm bench serve")
add_cli_args(parser)
main(parser.parse_args(sys.argv[1:]))
"""

def client_main(argv: list[str]) -> int:
    """The client process: ``vllm bench serve`` (``vllm.benchmarks.serve``) with ``argv``."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def workload_args(p: dict, workload: str, seed: int, trace: Path | None) -> list[str]:
    """``vllm bench serve``'s dataset arguments of one run; ``trace``: the run's timed_trace file (multiturn, trace)."""
    if workload == "prefix_repetition":
        return ["--dataset-name", "prefix_repetition", "--num-prompts", str(p["pr_num_prompts"]),
                "--prefix-repetition-prefix-len", str(p["pr_prefix_len"]),
                "--prefix-repetition-suffix-len", str(p["pr_suffix_len"]),
                "--prefix-repetition-num-prefixes", str(p["pr_num_prefixes"]),
                "--prefix-repetition-output-len", str(p["pr_output_len"]), "--seed", str(seed)]
    if workload in ("multiturn", "trace"):  # a timed_trace file (make_multiturn_trace / serve_cpu.trace)
        n = p["mt_conversations"] * p["mt_turns"] if workload == "multiturn" else p["tr_requests"]
        return ["--dataset-name", "timed_trace", "--dataset-path", str(trace),
                "--timed-trace-chunk-hash-size", str(BLOCK), "--no-self-timed", "--num-prompts", str(n),
                "--seed", str(seed)]
    if workload == "random":
        return ["--dataset-name", "random", "--num-prompts", str(p["rnd_num_prompts"]),
                "--random-input-len", str(p["rnd_input_len"]), "--random-output-len", str(p["rnd_output_len"]),
                "--random-range-ratio", "0.0", "--seed", str(seed)]
    raise ValueError(workload)


def run_seed(workload: str, concurrency: int, repeat: int, chosen: dict | None = None) -> int:
    """The seed of one run: the same in every configuration, different for every run of one server. ``chosen``:
    seeds picked by :func:`disjoint_seeds` for some runs, keyed ``(workload, concurrency, repeat)``; they win."""
    if chosen and (workload, concurrency, repeat) in chosen:
        return chosen[(workload, concurrency, repeat)]
    return 1 + 1000 * WORKLOADS.index(workload) + 100 * repeat + concurrency


#: the seed :func:`disjoint_seeds` tries after a run's base seed ``s``: ``s + k * SEED_STEP`` (k = 1, 2, ...), far
#: from every base seed of :func:`run_seed`
SEED_STEP = 100_003


def disjoint_seeds(runs: list[tuple], prompts_of, block: int = BLOCK, tries: int = 64) -> dict[tuple, int]:
    """A seed for each run of ``runs`` (keys ``(workload, concurrency, repeat)``, in order) whose prompts share no
    first page with each other nor with any earlier run's: so that a workload meant to have no reuse has none,
    neither inside a run nor between runs on one server (vLLM's ``random`` dataset makes each prompt a run of
    consecutive token ids from a random offset; with a small vocabulary, offsets repeat). Two prompts that differ in
    their first ``block`` tokens share no page of the server's hash chain.

    ``prompts_of(key, seed)`` -> the token ids of each prompt the run would send with that seed (as the server
    tokenizes them). Each run tries :func:`run_seed`'s seed, then that seed + k * :data:`SEED_STEP`. Raises
    RuntimeError when no seed of ``tries`` works (the vocabulary is too small for so many prompts)."""
    seen: set[tuple] = set()
    out: dict[tuple, int] = {}
    for key in runs:
        base = run_seed(*key)
        for k in range(tries):
            seed = base + k * SEED_STEP
            firsts = [tuple(t[:block]) for t in prompts_of(key, seed)]
            if len(set(firsts)) == len(firsts) and seen.isdisjoint(firsts):
                seen.update(firsts)
                out[key] = seed
                break
        else:
            raise RuntimeError(f"no seed among {tries} gives run {key} prompts disjoint from the earlier runs'")
    return out


def client_argv(url: str, model_dir: str, args: list[str], concurrency: int, out_dir: Path, name: str) -> list[str]:
    """The arguments of ``vllm bench serve`` for one run (``args``: :func:`workload_args`)."""
    return ["--backend", "vllm", "--base-url", url, "--endpoint", "/v1/completions", "--model", model_dir,
            "--tokenizer", model_dir, "--max-concurrency", str(concurrency), "--request-rate", "inf",
            "--temperature", "0", "--ignore-eos", "--percentile-metrics", "ttft,tpot,itl,e2el",
            "--metric-percentiles", "50,99", "--num-warmups", "0", "--disable-tqdm", "--label", name,
            "--save-result", "--save-detailed", "--result-dir", str(out_dir), "--result-filename", f"{name}.json",
            *args]


def client_prompts(model_dir: str, args: list[str]) -> list[list[int]]:
    """The prompts one client run with workload arguments ``args`` sends, as token ids the way vLLM's completions
    endpoint tokenizes them (special tokens added): built by vLLM's own ``get_samples`` from the arguments parsed
    by ``vllm bench serve``'s parser, so they are the client's prompts, not a re-implementation of its dataset."""
    import logging

    from vllm.benchmarks.datasets import get_samples
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    ns = parser.parse_args(client_argv("http://127.0.0.1:1", model_dir, args, 1, Path("."), "seeds"))
    tok = _tokenizer(model_dir)
    quiet = logging.getLogger("vllm")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # its per-sample notes on re-encoded lengths
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            samples = get_samples(ns, tok)
    finally:
        quiet.setLevel(level)
    # timed_trace samples are token ids already, sent as such (no special tokens added)
    return [list(s.prompt) if isinstance(s.prompt, list) else tok(s.prompt).input_ids for s in samples]


@functools.lru_cache(maxsize=4)
def _tokenizer(model_dir: str):
    """vLLM's tokenizer of ``model_dir``, loaded once per process."""
    from vllm.tokenizers import get_tokenizer
    return get_tokenizer(model_dir)


def random_seeds(p: dict, model_dir: str, concurrency: list[int], repeats: int) -> dict[tuple, int]:
    """:func:`disjoint_seeds` for every ``random`` run of a pass (``repeats`` = runs per concurrency over all
    rounds), with the prompts of :func:`client_prompts`."""
    runs = [("random", c, r) for c in concurrency for r in range(repeats)]
    return disjoint_seeds(runs, lambda key, seed: client_prompts(model_dir, workload_args(p, "random", seed, None)))


def run_client(server: VllmServer, model_dir: str, args: list[str], concurrency: int, out_dir: Path, name: str,
               timeout_s: float) -> tuple[dict | None, str]:
    cmd = [sys.executable, "-c", CLIENT_CODE, *client_argv(server.url, model_dir, args, concurrency, out_dir, name)]
    env = dict(os.environ)
    env.update(CLIENT_ENV)
    log = out_dir / f"{name}.client.log"
    with open(log, "wb") as f:
        try:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=str(out_dir),
                                stdin=subprocess.DEVNULL, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            return None, f"client timed out after {timeout_s:.0f} s; log tail: {tail(log, 1500)}"
    res_path = out_dir / f"{name}.json"
    if rc != 0 or not res_path.exists():
        return None, f"client exited with {rc}; log tail: {tail(log, 1500)}"
    return json.loads(res_path.read_text()), ""


def wait_counted(server: VllmServer, before: dict, n: int, timeout_s: float = 30.0) -> dict:
    """/metrics once vLLM has counted ``n`` more finished requests than in ``before`` (the counters of a run's
    last step reach Prometheus just after its last response), bounded by ``timeout_s``."""
    t0 = time.monotonic()
    m = server.metrics()
    while (metric(m, "vllm:request_success_total") - metric(before, "vllm:request_success_total") < n
           and time.monotonic() - t0 < timeout_s and server.alive()):
        time.sleep(0.1)  # polling interval for a condition on the counters, not a synchronisation
        m = server.metrics()
    return m


def _p(xs: list[float], q: float) -> float | None:
    xs = sorted(x for x in xs if x is not None)
    if not xs:
        return None
    k = (len(xs) - 1) * q
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarise_run(res: dict, delta: dict, trace_rows: list[dict] | None) -> dict:
    errors = [e for e in (res.get("errors") or []) if e]
    row = {k: res.get(k) for k in ("completed", "failed", "duration", "request_throughput", "output_throughput",
                                   "total_token_throughput", "total_input_tokens", "total_output_tokens",
                                   "mean_ttft_ms", "median_ttft_ms", "p50_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                                   "p50_tpot_ms", "p99_tpot_ms", "median_e2el_ms", "p99_e2el_ms")}
    row["errors"] = sorted({e.strip()[-300:] for e in errors})[:5]
    row["tokens"] = {
        "prompt": int(metric(delta, "vllm:prompt_tokens_total")),
        "l1_hit": int(metric(delta, "vllm:prefix_cache_hits_total")),
        "external_hit": int(metric(delta, "vllm:external_prefix_cache_hits_total")),
        "l2_hit": int(metric(delta, "vllm:tierkv_l2_hit_tokens_total")),
        "l3_hit": int(metric(delta, "vllm:tierkv_ctl_l3_hit_tokens_total")),
        # of those, tokens whose L3 read failed (missing: a bounded store evicted what the index still lists) and
        # were recomputed
        "l3_failed": int(metric(delta, "vllm:tierkv_lookup_failed_tokens_total")),
        "preemptions": int(metric(delta, "vllm:num_preemptions_total")),
        "requests_counted": int(metric(delta, "vllm:request_success_total")),
    }
    ttfts = res.get("ttfts") or []
    if trace_rows and len(ttfts) == len(trace_rows):
        later = [t * 1e3 for t, r in zip(ttfts, trace_rows) if r["turn"] > 1 and t]
        first = [t * 1e3 for t, r in zip(ttfts, trace_rows) if r["turn"] == 1 and t]
        row["ttft_p50_first_turn_ms"] = _p(first, 0.5)
        row["ttft_p50_later_turns_ms"] = _p(later, 0.5)
    row["phase_means_ms"] = phase_means_ms(delta)
    row["metrics_delta"] = delta
    return row
