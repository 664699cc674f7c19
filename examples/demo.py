"""``make demo``: vLLM's OpenAI-compatible server with tierkv's L2 host pool, on a locally built model.

What it does (tierkv issue 2, item 8):

1. builds the ``demo`` preset of ``examples/make_tiny_model.py`` (Llama architecture, random weights, local
   tokenizer; nothing is downloaded) into ``models/demo``;
2. starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with ``TierKVConnector`` enabled from
   the command line (``--kv-transfer-config``), an L1 of ``--num-gpu-blocks-override`` blocks of 32 tokens that
   holds fewer documents than the workload uses, and the connector's counters dumped to a JSON stats file;
3. sends a shared-document workload through ``/v1/completions`` with streaming: ``--docs`` distinct
   2,048-token documents, each with a question, then every document again with a different question (by then
   vLLM's own prefix cache has evicted it, so the prefix must come from tierkv's L2); TTFT is the time to the
   first streamed token;
4. stops the server (SIGINT, bounded wait, then SIGTERM/SIGKILL of its process group), starts it again without
   the connector and the same L1, runs the same workload, stops it;
5. prints a table: requests, TTFT p50/p90 of first-time prompts and of repeated prompts (L2 hits) with tierkv,
   and the same without tierkv; tokens loaded from L2 and hit rate from the connector's stats file.

Run: ``make demo`` or ``.venv/bin/python examples/demo.py [--docs 6 --l1-blocks 160 --keep-logs]``.
Server logs and stats files go to ``runs/demo-<time>/`` (git-ignored).
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from make_tiny_model import PRESETS, make_model  # noqa: E402

import requests  # noqa: E402
from tqdm import tqdm  # noqa: E402

PRESET = "demo"
BLOCK = 32
SERVER_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",  # same thread count with and without the connector
    "VLLM_CPU_KVCACHE_SPACE": "1",        # GiB; --num-gpu-blocks-override sets the real L1 size
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


# ------------------------------------------------------------------------------------------------ server
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One ``vllm.entrypoints.openai.api_server`` process (and its EngineCore/worker children)."""

    def __init__(self, model_dir: str, *, l1_blocks: int, max_model_len: int, kv_transfer_config: dict | None,
                 log_path: Path, start_timeout_s: float):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.start_timeout_s = start_timeout_s
        cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server",
               "--model", model_dir, "--served-model-name", PRESET,
               "--host", "127.0.0.1", "--port", str(self.port),
               "--dtype", "bfloat16", "--block-size", str(BLOCK),
               "--num-gpu-blocks-override", str(l1_blocks), "--max-model-len", str(max_model_len),
               "--enable-prefix-caching", "--enforce-eager", "--max-num-seqs", "8",
               "--seed", "0", "--uvicorn-log-level", "warning"]
        if kv_transfer_config is not None:
            cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        self.cmd = cmd
        env = dict(os.environ)
        env.update(SERVER_ENV)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO), env.get("PYTHONPATH")] if p)
        self._log = open(log_path, "wb")
        # Own session: a last-resort kill of the group reaches EngineCore and the worker, which we started.
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(REPO), start_new_session=True)

    def wait_ready(self) -> float:
        """Poll ``/health`` until 200 (bounded by ``start_timeout_s``); return seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < self.start_timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with code {self.proc.returncode} during start-up; log "
                                   f"{self.log_path}:\n{tail(self.log_path)}")
            try:
                if requests.get(self.url + "/health", timeout=2).status_code == 200:
                    return time.monotonic() - t0
            except requests.RequestException:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"server not healthy after {self.start_timeout_s:.0f} s; log {self.log_path}:\n"
                           f"{tail(self.log_path)}")

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGINT (graceful: the connector writes its final stats), wait, then SIGTERM, then SIGKILL the group."""
        if self.proc.poll() is None:
            for sig, wait in ((signal.SIGINT, grace_s), (signal.SIGTERM, 15.0)):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.proc.pid, sig)
                try:
                    self.proc.wait(timeout=wait)
                    break
                except subprocess.TimeoutExpired:
                    continue
            else:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        # Children of the server (EngineCore, worker) exit with it; make sure none is left behind.
        deadline = time.monotonic() + 15.0
        while time.monotonic() < deadline and _group_alive(self.proc.pid):
            time.sleep(0.2)
        if _group_alive(self.proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
        self._log.close()


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # killpg(0) also succeeds for zombies; look for a live member.
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                f = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(f[2]) == pgid and f[0] != "Z":
                return True
    return False


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


# ------------------------------------------------------------------------------------------------ client
def stream_completion(url: str, prompt: list[int], max_tokens: int) -> dict:
    """POST a token-id prompt to ``/v1/completions`` with ``stream=true``; return TTFT and total seconds."""
    body = {"model": PRESET, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True}
    t0 = time.perf_counter()
    ttft = None
    text = []
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line or not line.startswith(b"data: "):
                continue
            data = line[6:]
            if data == b"[DONE]":
                break
            chunk = json.loads(data)
            choices = chunk.get("choices") or []
            if choices and choices[0].get("text"):
                if ttft is None:
                    ttft = time.perf_counter() - t0
                text.append(choices[0]["text"])
    return {"ttft_s": ttft, "total_s": time.perf_counter() - t0, "text": "".join(text)}


def build_workload(n_docs: int, doc_len: int, vocab: int, seed: int = 7) -> list[dict]:
    """Pass 1: every document + question A; pass 2: every document + a different question B."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(4, vocab) for _ in range(n)]

    docs = [toks(doc_len) for _ in range(n_docs)]
    reqs = []
    for rnd in (1, 2):
        for i, d in enumerate(docs):
            reqs.append({"doc": i, "pass": rnd, "prompt": d + toks(rng.randint(40, 120))})
    return reqs


def run_workload(server: Server, reqs: list[dict], max_tokens: int, label: str) -> list[dict]:
    # A warm-up request outside the measured set (first-request overheads), unrelated to the documents.
    stream_completion(server.url, list(range(10, 60)), 2)
    out = []
    for r in tqdm(reqs, desc=label, unit="req", leave=False, dynamic_ncols=True):
        res = stream_completion(server.url, r["prompt"], max_tokens)
        out.append({**{k: r[k] for k in ("doc", "pass")}, **res})
    return out


def read_stats(stats_dir: Path) -> dict[str, dict]:
    merged: dict[str, dict] = {}
    for p in sorted(stats_dir.glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        role = d.get("role") or p.stem.rsplit("-", 1)[0]
        acc = merged.setdefault(role, {})
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k != "pid":
                acc[k] = acc.get(k, 0) + v
            else:
                acc[k] = v
    return merged


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[int(q * 100) - 1] if q < 1 else xs[-1]


# ------------------------------------------------------------------------------------------------ main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="tierkv demo: vLLM server + TierKVConnector on a local model")
    ap.add_argument("--docs", type=int, default=6, help="distinct 2,048-token documents (default 6)")
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--l1-blocks", type=int, default=160,
                    help="vLLM KV blocks of 32 tokens (default 160 = 5,120 tokens: about 2 documents)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--l2-gb", type=float, default=0.5, help="tierkv host pool size, GiB")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run without tierkv")
    ap.add_argument("--start-timeout", type=float, default=420.0, help="seconds to wait for /health")
    args = ap.parse_args(argv)

    t_start = time.monotonic()
    run_dir = REPO / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")
    stats_dir = run_dir / "stats"
    stats_dir.mkdir(parents=True, exist_ok=True)
    print(f"tierkv demo: logs and stats in {run_dir}")
    model_dir = make_model(None, PRESET)
    vocab = PRESETS[PRESET]["vocab_size"]
    max_model_len = min(4096, (args.l1_blocks - 1) * BLOCK)
    reqs = build_workload(args.docs, args.doc_len, vocab)
    if args.doc_len + 120 > max_model_len:
        ap.error(f"--l1-blocks {args.l1_blocks} is too small for one {args.doc_len}-token document")
    doc_blocks = args.docs * (args.doc_len // BLOCK)
    print(f"workload: {args.docs} documents x {args.doc_len} tokens ({doc_blocks} blocks) > L1 {args.l1_blocks} "
          f"blocks; {len(reqs)} requests (each document twice, different questions)")

    kv_cfg = {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connector.vllm_connector",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"host_pool": {"size_gb": args.l2_gb},
                                            "stats_path": str(stats_dir / "{role}-{pid}.json")}}
    runs = [("tierkv", kv_cfg)] + ([] if args.no_baseline else [("no tierkv", None)])
    results: dict[str, list[dict]] = {}
    for label, kvc in runs:
        print(f"starting vLLM server ({label}) ...", flush=True)
        srv = Server(model_dir, l1_blocks=args.l1_blocks, max_model_len=max_model_len, kv_transfer_config=kvc,
                     log_path=run_dir / f"server-{label.replace(' ', '_')}.log", start_timeout_s=args.start_timeout)
        try:
            waited = srv.wait_ready()
            print(f"  healthy after {waited:.0f} s at {srv.url}; sending {len(reqs)} requests", flush=True)
            results[label] = run_workload(srv, reqs, args.max_tokens, label)
        finally:
            srv.stop()
        print(f"  server stopped (exit code {srv.proc.returncode})", flush=True)

    stats = read_stats(stats_dir)
    sched, worker = stats.get("scheduler", {}), stats.get("worker", {})

    def row(name, rs):
        t = [r["ttft_s"] * 1e3 for r in rs if r["ttft_s"] is not None]
        return f"| {name:<42} | {len(rs):>8} | {pct(t, 0.5):>12.0f} | {pct(t, 0.9):>12.0f} |"

    print()
    print(f"| {'requests':<42} | {'count':>8} | {'TTFT p50 ms':>12} | {'TTFT p90 ms':>12} |")
    print(f"|{'-' * 44}|{'-' * 10}|{'-' * 14}|{'-' * 14}|")
    for label, rs in results.items():
        first = [r for r in rs if r["pass"] == 1]
        again = [r for r in rs if r["pass"] == 2]
        print(row(f"{label}: first-time prompts", first))
        print(row(f"{label}: repeated prefixes" + (" (L2 hits)" if label == "tierkv" else " (recomputed)"), again))
    print()
    repeated_prefix_tokens = args.docs * (args.doc_len // BLOCK) * BLOCK
    l2_hit = sched.get("l2_hit_tokens")
    lookup = sched.get("lookup_tokens")
    print(f"tokens loaded from L2: {l2_hit if l2_hit is not None else 'n/a'}"
          f" ({worker.get('load_pages', 'n/a')} pages, {worker.get('load_bytes', 0) / 2**20:.1f} MiB)")
    if l2_hit is not None and lookup:
        print(f"L2 hit rate: {l2_hit / lookup:.1%} of {lookup} tokens looked up in L2 "
              f"({l2_hit / repeated_prefix_tokens:.1%} of the {repeated_prefix_tokens} document tokens asked again)")
    print(f"saved to L2: {worker.get('save_pages', 'n/a')} pages; connector requests: {sched.get('requests', 'n/a')}")
    if "tierkv" in results and "no tierkv" in results:
        a = statistics.median(r["ttft_s"] for r in results["tierkv"] if r["pass"] == 2)
        b = statistics.median(r["ttft_s"] for r in results["no tierkv"] if r["pass"] == 2)
        print(f"repeated-prefix TTFT p50: {a * 1e3:.0f} ms with tierkv vs {b * 1e3:.0f} ms without ({b / a:.1f}x)")
        same = sum(x["text"] == y["text"] for x, y in zip(results["tierkv"], results["no tierkv"]))
        print(f"identical completions with and without tierkv: {same}/{len(reqs)}")
    (run_dir / "results.json").write_text(json.dumps({"results": results, "stats": stats}, indent=1))
    print(f"\ndemo finished in {time.monotonic() - t_start:.0f} s; details in {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
