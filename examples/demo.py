"""``make demo``: vLLM's OpenAI-compatible server with tierkv (L2 host pool + file L3) on a locally built model.

What it does:

1. builds the ``demo`` preset of ``examples/make_tiny_model.py`` (Llama architecture, random weights, local
   tokenizer; nothing is downloaded) into ``models/demo``;
2. starts ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1 with ``TierKVConnector`` enabled from
   the command line (``--kv-transfer-config``: ``config_file: l3_file.yaml`` with ``l3.file.root`` = ``l3/`` in
   the run directory, ``kv_load_failure_policy: recompute``), an L1 of ``--num-gpu-blocks-override`` blocks of 32
   tokens that holds fewer documents than the workload uses, and the connector's counters dumped to JSON stats
   files;
3. sends a shared-document workload through ``/v1/completions`` with streaming: round 1, ``--docs`` distinct
   2,048-token documents, each with a question; round 2, every document again with a different question (by then
   vLLM's own prefix cache has evicted most of them, so the prefix comes from tierkv's L2); every page also goes
   to the file L3 (``write_through``). TTFT is the time to the first streamed token;
4. stops the server (SIGINT, bounded wait, then SIGTERM/SIGKILL of its process group) and starts a new tierkv
   server process on the same L3 directory (empty L1 and L2); round 3 asks the first ``--restart-docs``
   documents with a third question, so their prefixes can only come from L3;
5. starts the server without the connector (same L1), runs rounds 1, 2 and 3, stops it;
6. prints a table per server and round: requests, TTFT p50/p90, tokens loaded from L2 and from L3 (the
   scheduler's ``l2_hit_tokens`` and ``ctl_l3_hit_tokens``, read from the stats files before and after each
   round), then pages saved, backed up and prefetched, and whether the completions match vLLM without tierkv.

Both servers run with TCMalloc preloaded (``--allocator``, :mod:`tierkv.engine_env`), as vLLM's CPU backend asks.

Run: ``make demo`` or ``.venv/bin/python examples/demo.py [--docs 6 --restart-docs 4 --l1-blocks 160]``.
Server logs, stats files and the L3 store go to ``runs/demo-<time>/`` (git-ignored).
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

from tierkv.engine_env import ALLOCATORS, preload_env  # noqa: E402

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


def build_workload(n_docs: int, doc_len: int, vocab: int, restart_docs: int = 0, seed: int = 7) -> list[dict]:
    """Pass 1: every document + question A; pass 2: every document + a different question B; pass 3 (the restart
    round, ``restart_docs`` > 0): the first ``restart_docs`` documents + a third question C."""
    rng = random.Random(seed)

    def toks(n):
        return [rng.randrange(4, vocab) for _ in range(n)]

    docs = [toks(doc_len) for _ in range(n_docs)]
    reqs = []
    for rnd in (1, 2):
        for i, d in enumerate(docs):
            reqs.append({"doc": i, "pass": rnd, "prompt": d + toks(rng.randint(40, 120))})
    for i, d in enumerate(docs[:restart_docs]):
        reqs.append({"doc": i, "pass": 3, "prompt": d + toks(rng.randint(40, 120))})
    return reqs


def warm_up(server: Server, label: str) -> None:
    """A request outside the measured set (first-request overheads), unrelated to the documents and to every other
    server's warm-up (so it finds nothing in L3)."""
    rng = random.Random(f"warm-up {label}")
    stream_completion(server.url, [rng.randrange(4, 4096) for _ in range(50)], 2)


def run_round(server: Server, reqs: list[dict], max_tokens: int, label: str) -> list[dict]:
    out = []
    for r in tqdm(reqs, desc=label, unit="req", leave=False, dynamic_ncols=True):
        res = stream_completion(server.url, r["prompt"], max_tokens)
        out.append({**{k: r[k] for k in ("doc", "pass")}, **res})
    return out


def settled_stats(server: Server, stats_dir: Path) -> dict[str, dict]:
    """The connector's counters as of now: the stats files are rewritten at most every 0.2 s from an engine step,
    so wait, send a 16-token request (no full page: it adds no hit, save or L3 job), wait, then read them."""
    time.sleep(0.3)
    stream_completion(server.url, list(range(100, 116)), 2)
    time.sleep(0.3)
    return read_stats(stats_dir)


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
ROUND_NAMES = {1: "new documents", 2: "same documents again", 3: "same documents, 3rd question"}


def _delta(after: dict, before: dict, key: str):
    if key not in after:
        return None
    return after[key] - before.get(key, 0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description="tierkv demo: vLLM server + TierKVConnector (L2 host pool, file L3) "
                                             "on a local model, a restart on the same L3, and vLLM without tierkv")
    ap.add_argument("--docs", type=int, default=6, help="distinct 2,048-token documents (default 6)")
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--l1-blocks", type=int, default=160,
                    help="vLLM KV blocks of 32 tokens (default 160 = 5,120 tokens: about 2 documents)")
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--l2-gb", type=float, default=0.5, help="tierkv host pool size, GiB")
    ap.add_argument("--restart-docs", type=int, default=4,
                    help="documents asked again by a new tierkv server on the same L3 directory (default 4; "
                         "0 = no restart round)")
    ap.add_argument("--no-baseline", action="store_true", help="skip the run without tierkv")
    ap.add_argument("--start-timeout", type=float, default=420.0, help="seconds to wait for /health")
    ap.add_argument("--allocator", choices=ALLOCATORS, default="tcmalloc",
                    help="memory allocator of both servers: tcmalloc (preloaded, as vLLM's CPU backend asks; the "
                         "default, glibc with a note where it is not installed) or glibc")
    args = ap.parse_args(argv)
    if not 0 <= args.restart_docs <= args.docs:
        ap.error(f"--restart-docs must be between 0 and --docs ({args.docs})")

    t_start = time.monotonic()
    run_dir = REPO / "runs" / time.strftime("demo-%Y%m%d-%H%M%S")
    l3_dir = run_dir / "l3"
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"tierkv demo: logs, stats and the L3 file store in {run_dir}")
    try:  # both servers alike, so the comparison does not depend on each process's heap layout
        SERVER_ENV.update(preload_env(args.allocator))
    except RuntimeError as e:
        print(f"note: {e}; the servers use the C library's malloc")
    model_dir = make_model(None, PRESET)
    vocab = PRESETS[PRESET]["vocab_size"]
    max_model_len = min(4096, (args.l1_blocks - 1) * BLOCK)
    if args.doc_len + 120 > max_model_len:
        ap.error(f"--l1-blocks {args.l1_blocks} is too small for one {args.doc_len}-token document")
    reqs = build_workload(args.docs, args.doc_len, vocab, args.restart_docs)
    doc_blocks = args.docs * (args.doc_len // BLOCK)
    print(f"workload: {args.docs} documents x {args.doc_len} tokens ({doc_blocks} blocks) > L1 {args.l1_blocks} "
          f"blocks; round 1: each document with a question, round 2: each again with another question"
          + (f", round 3 (new server, same L3): {args.restart_docs} of them with a third question"
             if args.restart_docs else ""))

    def tierkv_config(stats_dir: Path) -> dict:
        return {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connector.vllm.connector",
                "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                "kv_connector_extra_config": {"config_file": "l3_file.yaml", "l3.file.root": str(l3_dir),
                                              "host_pool": {"size_gb": args.l2_gb},
                                              "stats_path": str(stats_dir / "{role}-{pid}.json")}}

    # (label, connector?, rounds); each server run has its own stats directory
    runs = [("tierkv", True, [1, 2])]
    if args.restart_docs:
        runs.append(("tierkv restarted", True, [3]))
    if not args.no_baseline:
        runs.append(("no tierkv", False, [1, 2, 3] if args.restart_docs else [1, 2]))
    results: dict[tuple[str, int], list[dict]] = {}
    round_stats: dict[tuple[str, int], dict] = {}
    server_stats: dict[str, dict] = {}
    for label, use_tierkv, rounds in runs:
        slug = label.replace(" ", "_")
        stats_dir = run_dir / "stats" / slug
        stats_dir.mkdir(parents=True, exist_ok=True)
        print(f"starting vLLM server ({label}) ...", flush=True)
        srv = Server(model_dir, l1_blocks=args.l1_blocks, max_model_len=max_model_len,
                     kv_transfer_config=tierkv_config(stats_dir) if use_tierkv else None,
                     log_path=run_dir / f"server-{slug}.log", start_timeout_s=args.start_timeout)
        try:
            waited = srv.wait_ready()
            n = sum(r["pass"] in rounds for r in reqs)
            print(f"  healthy after {waited:.0f} s at {srv.url}; sending {n} requests (round "
                  f"{', '.join(map(str, rounds))})", flush=True)
            warm_up(srv, label)
            before = settled_stats(srv, stats_dir) if use_tierkv else {}
            for rnd in rounds:
                results[(label, rnd)] = run_round(srv, [r for r in reqs if r["pass"] == rnd], args.max_tokens,
                                                  f"{label} round {rnd}")
                if use_tierkv:
                    after = settled_stats(srv, stats_dir)
                    round_stats[(label, rnd)] = {
                        "l2_hit_tokens": _delta(after.get("scheduler", {}), before.get("scheduler", {}),
                                                "l2_hit_tokens"),
                        "l3_hit_tokens": _delta(after.get("scheduler", {}), before.get("scheduler", {}),
                                                "ctl_l3_hit_tokens")}
                    before = after
        finally:
            srv.stop()
        print(f"  server stopped (exit code {srv.proc.returncode})", flush=True)
        if use_tierkv:
            server_stats[label] = read_stats(stats_dir)  # final counters, written at shutdown

    def cell(v):
        return "n/a" if v is None else str(v)

    print()
    hdr = (f"| {'server':<16} | {'round':<31} | {'requests':>8} | {'TTFT p50 ms':>11} | {'TTFT p90 ms':>11} "
           f"| {'tokens from L2':>14} | {'tokens from L3':>14} |")
    print(hdr)
    print("|" + "|".join("-" * len(c) for c in hdr.split("|")[1:-1]) + "|")
    for (label, rnd), rs in results.items():
        t = [r["ttft_s"] * 1e3 for r in rs if r["ttft_s"] is not None]
        st = round_stats.get((label, rnd), {})
        print(f"| {label:<16} | {f'{rnd}: {ROUND_NAMES[rnd]}':<31} | {len(rs):>8} | {pct(t, 0.5):>11.0f} "
              f"| {pct(t, 0.9):>11.0f} | {cell(st.get('l2_hit_tokens')) if st else '-':>14} "
              f"| {cell(st.get('l3_hit_tokens')) if st else '-':>14} |")
    print()
    doc_tokens = (args.doc_len // BLOCK) * BLOCK
    print(f"reusable prefix per request: {doc_tokens} tokens (the document's full pages); "
          "'-' = no connector")
    s1 = server_stats.get("tierkv", {})
    sched, worker = s1.get("scheduler", {}), s1.get("worker", {})
    print(f"tierkv: saved to L2 {worker.get('save_pages', 'n/a')} pages, loaded from L2 "
          f"{worker.get('load_pages', 'n/a')} pages ({worker.get('load_bytes', 0) / 2**20:.1f} MiB); "
          f"backed up to L3 {sched.get('ctl_backup_stored_pages', 'n/a')} pages "
          f"({worker.get('l3_backup_bytes', 0) / 2**20:.1f} MiB, "
          f"{worker.get('l3_backup_failed_pages', 'n/a')} failed)")
    if "tierkv restarted" in server_stats:
        s2 = server_stats["tierkv restarted"]
        sched2, worker2 = s2.get("scheduler", {}), s2.get("worker", {})
        files = sum(1 for _ in l3_dir.rglob("*.page"))
        print(f"tierkv restarted (empty L1 and L2, {files} page files in {l3_dir.relative_to(REPO)}): "
              f"L3 existence queries {sched2.get('ctl_exists_queries', 'n/a')}, prefetched "
              f"{worker2.get('l3_prefetch_pages', 'n/a')} pages ({worker2.get('l3_prefetch_bytes', 0) / 2**20:.1f} "
              f"MiB, {worker2.get('l3_prefetch_failed_pages', 'n/a')} failed, "
              f"{worker2.get('l3_prefetch_late_pages', 'n/a')} late), "
              f"declined as slower than recomputing {sched2.get('ctl_l3_declined_slow_pages', 'n/a')} pages")

    def p50(label, rnd):
        rs = results.get((label, rnd)) or []
        return statistics.median(r["ttft_s"] for r in rs) if rs else None

    for rnd, tier in ((2, "L2"), (3, "L3")):
        a, b = p50("tierkv" if rnd == 2 else "tierkv restarted", rnd), p50("no tierkv", rnd)
        if a and b:
            print(f"round {rnd} TTFT p50: {a * 1e3:.0f} ms with tierkv (prefixes from {tier}) vs {b * 1e3:.0f} ms "
                  f"without ({b / a:.1f}x)")
    if not args.no_baseline:
        same = total = 0
        for (label, rnd), rs in results.items():
            if label != "no tierkv":
                base = results[("no tierkv", rnd)]
                same += sum(x["text"] == y["text"] for x, y in zip(rs, base))
                total += len(rs)
        print(f"identical completions with and without tierkv: {same}/{total}")
    out = {"results": {f"{label} round {rnd}": rs for (label, rnd), rs in results.items()},
           "round_stats": {f"{label} round {rnd}": v for (label, rnd), v in round_stats.items()},
           "stats": server_stats}
    (run_dir / "results.json").write_text(json.dumps(out, indent=1))
    print(f"\ndemo finished in {time.monotonic() - t_start:.0f} s; details in {run_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
