"""The first-sight tax: what tierkv with a file L3 adds to the TTFT of documents it sees for the first time.

The demo's round 1 (``examples/demo.py``: new 2,048-token documents, one request at a time, write-through to a file
L3) through vLLM's OpenAI server, every configuration's server up at once: per repeat, six new documents (a seed
per repeat, so no server has seen them) go to each server back to back (as in the demo, each document's backup
runs while the next one is computed), the servers in rotated order. Configurations: ``none`` (no connector),
``tierkv`` (the code measured, the demo's tierkv config), ``tierkv_pause_prefill`` / ``tierkv_pause_forward`` (the
same with ``controller.backup_pause: prefill`` / ``forward``) and ``tierkv_old`` (the demo's config on a git archive of
``--old-rev``).
The ratio of each document's TTFT to ``none``'s (same repeat, same document) is the first-sight tax.

    .venv/bin/python -m benchmarks.first_sight --configs none,tierkv,tierkv_old --repeats 3
"""
from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import subprocess
import tarfile
import time
from pathlib import Path

import requests

from benchmarks.harness import REPO, make_tiny_model, results
from benchmarks.harness.machine import loadavg, machine
from benchmarks.harness.servers import VllmServer
from tierkv.engine_env import preload_env

BLOCK = 32
CONFIGS = ("none", "tierkv", "tierkv_pause_prefill", "tierkv_pause_forward", "tierkv_pause_never", "tierkv_old")
SERVER_ENV = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1",
              "VLLM_DO_NOT_TRACK": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false"}


def snapshot(rev: str, dest: Path) -> str:
    """``rev``'s tierkv packages laid out as the package ``tierkv`` under ``dest``; the folder for PYTHONPATH."""
    commit = subprocess.run(["git", "rev-parse", rev], cwd=REPO, capture_output=True, text=True, check=True,
                            timeout=30).stdout.strip()
    tar = subprocess.run(["git", "archive", "--format=tar", commit, "tierkv", "connector", "storage_backends",
                          "kernels", "configs"], cwd=REPO, capture_output=True, check=True, timeout=120).stdout
    pkg = dest / f"code-{commit[:12]}"
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        for m in tf.getmembers():
            if m.isfile():
                top, _, rest = m.name.partition("/")
                out = pkg / "tierkv" / (rest if top == "tierkv" else f"{top}/{rest}")
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_bytes(tf.extractfile(m).read())
    return str(pkg)


def kv_config(name: str, cdir: Path, l2_gb: float) -> dict | None:
    if name == "none":
        return None
    extra = {"config_file": "l3_file.yaml", "l3.file.root": str(cdir / "l3"), "host_pool": {"size_gb": l2_gb},
             "stats_path": str(cdir / "stats" / "{role}-{pid}.json")}
    if name.startswith("tierkv_pause_"):
        extra["controller"] = {"backup_pause": name.removeprefix("tierkv_pause_")}
    return {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connector.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def ttft(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """Seconds to the first streamed token of a ``/v1/completions`` request (the demo's client)."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True,
            "stream": True}
    t0 = time.perf_counter()
    first = None
    with requests.post(url + "/v1/completions", json=body, stream=True, timeout=600) as r:
        r.raise_for_status()
        for line in r.iter_lines():
            if not line.startswith(b"data: ") or line[6:] == b"[DONE]":
                continue
            ch = json.loads(line[6:]).get("choices") or []
            if first is None and ch and ch[0].get("text"):
                first = time.perf_counter() - t0
    return first if first is not None else float("nan")


def documents(rep: int, n: int, doc_len: int, vocab: int) -> list[list[int]]:
    """Repeat ``rep``'s ``n`` documents, each with a question (the demo's round 1 shape)."""
    rng = random.Random(f"first sight {rep}")
    return [[rng.randrange(4, vocab) for _ in range(doc_len + rng.randint(40, 120))] for _ in range(n)]


def summary(runs: list[dict], configs: list[str]) -> dict:
    """Per configuration: the ratio of each document's TTFT to ``none``'s (same repeat and document): p50, range,
    and the same for the documents after the first of each block (those that overlap a predecessor's backup)."""
    base = {(r["repeat"], r["doc"]): r["ttft_s"] for r in runs if r["config"] == "none"}
    out = {}
    for c in configs:
        rs = [r for r in runs if r["config"] == c]
        ratios = [r["ttft_s"] / base[(r["repeat"], r["doc"])] for r in rs if (r["repeat"], r["doc"]) in base]
        later = [r["ttft_s"] / base[(r["repeat"], r["doc"])] for r in rs
                 if (r["repeat"], r["doc"]) in base and r["doc"] > 0]
        t = [r["ttft_s"] * 1e3 for r in rs]
        out[c] = {"ttft_ms_p50": round(statistics.median(t), 1), "ttft_ms_min": round(min(t), 1),
                  "ttft_ms_max": round(max(t), 1)}
        if ratios and c != "none":
            out[c].update(ratio_p50=round(statistics.median(ratios), 3), ratio_min=round(min(ratios), 3),
                          ratio_max=round(max(ratios), 3), later_ratio_p50=round(statistics.median(later), 3),
                          pairs=len(ratios))
    return out


def stats_of(cdir: Path) -> dict:
    """The worker's and scheduler's counters from the stats files of a configuration (summed over processes)."""
    acc: dict = {}
    for p in sorted((cdir / "stats").glob("*.json")):
        try:
            d = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        role = acc.setdefault(d.get("role", p.stem), {})
        for k, v in d.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k in KEEP_STATS:
                role[k] = role.get(k, 0) + v
    return acc


KEEP_STATS = ("l3_backup_pages", "l3_backup_seconds", "l3_backup_pauses", "l3_backup_pause_seconds",
              "l3_backup_queued_pages", "save_pages", "hook_seconds", "hook_steps", "ctl_backup_stored_pages")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.first_sight", description=__doc__.split("\n\n")[0])
    ap.add_argument("--configs", default="none,tierkv,tierkv_old", help=f"comma-separated subset of {CONFIGS}")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--docs", type=int, default=6)
    ap.add_argument("--doc-len", type=int, default=2048)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--l1-blocks", type=int, default=160)
    ap.add_argument("--l2-gb", type=float, default=0.5)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--old-rev", default="main", help="the git revision tierkv_old runs (default main)")
    ap.add_argument("--settle-s", type=float, default=2.0, help="pause between two servers' blocks (s)")
    ap.add_argument("--profile", default="", metavar="CONFIGS",
                    help="record the servers of these configurations (comma-separated) with py-spy during their "
                    "blocks (raw stacks by thread, runs/.../pyspy-*.txt) and print their top frames")
    ap.add_argument("--profile-repeats", type=int, default=1,
                    help="with --profile: record only the first N repeats, left out of the summary (default 1)")
    ap.add_argument("--profile-args", default="--rate 100", help="extra py-spy record arguments (e.g. --native, --gil)")
    ap.add_argument("--top-of", default=None, metavar="PYSPY_TXT", help="only print the top frames of a py-spy file")
    ap.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "first_sight.json"))
    args = ap.parse_args(argv)
    if args.top_of:
        print(top_frames(Path(args.top_of).read_text()))
        return 0
    profile = [c.strip() for c in args.profile.split(",") if c.strip()]
    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if any(c not in CONFIGS for c in configs) or "none" not in configs:
        ap.error(f"--configs: a subset of {CONFIGS} with none")
    work = REPO / "runs" / time.strftime("first_sight-%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    print(f"[first_sight] run directory {work}", flush=True)
    env = dict(SERVER_ENV, **preload_env("tcmalloc"))
    tiny = make_tiny_model()
    model_dir = tiny.make_model(None, "demo")
    vocab = tiny.PRESETS["demo"]["vocab_size"]
    max_len = min(4096, (args.l1_blocks - 1) * BLOCK)
    old = snapshot(args.old_rev, work) if "tierkv_old" in configs else ""
    servers = {}
    try:
        for c in configs:
            cdir = work / c
            cdir.mkdir()
            servers[c] = VllmServer(model_dir, l1_blocks=args.l1_blocks, max_model_len=max_len,
                                    kv_transfer_config=kv_config(c, cdir, args.l2_gb), log_path=cdir / "server.log",
                                    pythonpath=old if c == "tierkv_old" else "", dtype=args.dtype,
                                    block_size=BLOCK, env=env)
        for c, s in servers.items():
            print(f"  {c}: healthy after {s.wait_ready(600):.0f} s", flush=True)
            ttft(s.url, model_dir, [random.Random(c).randrange(4, vocab) for _ in range(50)], 2)  # warm-up
        runs, blocks = [], []
        for rep in range(args.repeats):
            docs = documents(rep, args.docs, args.doc_len, vocab)
            for c in results.rotated(configs, rep):
                spy = None
                if c in profile and rep < args.profile_repeats:
                    spy = subprocess.Popen([str(REPO / ".venv" / "bin" / "py-spy"), "record", "--threads",
                                            "--subprocesses", "--format", "raw", *args.profile_args.split(),
                                            "-p", str(servers[c].proc.pid),
                                            "-o", str(work / f"pyspy-{c}-r{rep}.txt")],
                                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                    time.sleep(1.0)  # py-spy attaches to the server's processes
                load0 = loadavg()
                for i, d in enumerate(docs):
                    runs.append({"config": c, "repeat": rep, "doc": i, "profiled": spy is not None,
                                 "ttft_s": ttft(servers[c].url, model_dir, d, args.max_tokens)})
                if spy is not None:
                    time.sleep(1.0)
                    spy.send_signal(2)
                    spy.wait(60)
                blocks.append({"config": c, "repeat": rep, "load_before": load0, "load_after": loadavg()})
                print(f"  repeat {rep} {c}: TTFT ms " + " ".join(f"{r['ttft_s'] * 1e3:.0f}" for r in runs[-args.docs:]),
                      flush=True)
                time.sleep(args.settle_s)  # the next server's block starts after this one's backups are written
    finally:
        stops = {c: s.stop() for c, s in servers.items()}
    data = {"benchmark": "first_sight", "code": dict(results.code_state(), source="working tree"),
            "old_rev": args.old_rev, "machine": machine(), "args": vars(args), "runs": runs, "blocks": blocks,
            "summary": summary([r for r in runs if not (profile and r["repeat"] < args.profile_repeats)], configs), "stats": {c: stats_of(work / c) for c in configs if c != "none"},
            "run_dir": str(work.relative_to(REPO)), "stops": {c: str(v) for c, v in stops.items()}}
    results.write_result(Path(args.out), data)
    print(json.dumps(data["summary"], indent=1))
    print(json.dumps(data["stats"], indent=1))
    for f in sorted(work.glob("pyspy-*.txt")):
        print(f"\n== {f.name}\n{top_frames(f.read_text())}")
    print(f"wrote {args.out}")
    return 0


def top_frames(raw: str, n: int = 12) -> str:
    """A py-spy ``--format raw`` profile (``frame;frame;... count`` lines, with ``--threads`` and
    ``--subprocesses``) as text: samples per (process, thread), then per thread with over 2 % of the samples its top
    ``n`` frames by inclusive samples (a frame counted once per stack) and by own (leaf) samples, in percent."""
    per_thread: dict[str, dict] = {}
    total = 0
    for line in raw.splitlines():
        stack, _, cnt = line.rpartition(" ")
        if not stack or not cnt.isdigit():
            continue
        k = int(cnt)
        total += k
        frames = stack.split(";")
        proc = next((f for f in reversed(frames) if f.startswith("process ")), "process ?")
        thread = next((f for f in frames if f.startswith("thread ")), "thread ?")
        code = [f for f in frames if not f.startswith(("process ", "thread "))]
        key = f"{proc.split(':')[0]} {_cmd(proc)} / {thread}"
        t = per_thread.setdefault(key, {"n": 0, "incl": {}, "leaf": {}})
        t["n"] += k
        for f in set(code):
            t["incl"][f] = t["incl"].get(f, 0) + k
        if code:
            t["leaf"][code[-1]] = t["leaf"].get(code[-1], 0) + k
    out = [f"{total} samples"]
    for key, t in sorted(per_thread.items(), key=lambda kv: -kv[1]["n"]):
        out.append(f"{100 * t['n'] / max(total, 1):5.1f}%  {key}")
    for key, t in sorted(per_thread.items(), key=lambda kv: -kv[1]["n"]):
        if t["n"] < 0.02 * total:
            continue
        out.append(f"\n-- {key}: {t['n']} samples; inclusive / leaf, % of this thread")
        for title, d in (("incl", t["incl"]), ("leaf", t["leaf"])):
            for f, k in sorted(d.items(), key=lambda kv: -kv[1])[:n]:
                out.append(f"  {title} {100 * k / t['n']:5.1f}%  {f[:150]}")
    return "\n".join(out)


def _cmd(proc: str) -> str:
    """A short name for a py-spy process frame (``process 123:"python -m ..."``)."""
    for word in ("EngineCore", "api_server", "Worker", "worker"):
        if word in proc:
            return word
    return proc.split(":", 1)[-1][:40]


if __name__ == "__main__":
    raise SystemExit(main())
