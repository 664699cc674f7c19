"""Crash consistency of a real engine: vLLM's OpenAI server with tierkv and an L3 is SIGKILLed (the API server and
every EngineCore/worker process under it, by PID) while 8 concurrent greedy completions of long shared-prefix prompts
write pages to L3; a new engine on the same store then serves the same prompts.

Variants: ``file`` (file L3), ``zmq`` (``tierkv server`` L3, which keeps running) and ``zmq_server_killed`` (the
``tierkv server`` is SIGKILLed with the engine and restarted on its ``--spill-dir``; its memory capacity is small, so
most pages live in the spill directory). Per repeat and variant the checks are: every output of the restarted engine
equals, token for token, that of a reference engine without a connector (a wrong-bytes hit would change it), the
restarted engine loaded tokens from L3 (what survived the kill is reused), and the pages it found bad (checksum or
length) were misses, counted. Exit code 1 if a check fails.

    .venv/bin/python -m benchmarks.crash_engine              # 3 repeats of the 3 variants (~30 min on 2 cores)
    .venv/bin/python -m benchmarks.crash_engine --quick      # 1 repeat, fewer prompts
"""
from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from benchmarks import harness
from benchmarks.harness import RESULTS, results
from benchmarks.harness.machine import loadavg
from benchmarks.harness.servers import VllmServer, ZmqServer, sigkill_tree, tail
from benchmarks.harness.stats import metric, read_stats, settled_stats
from benchmarks.serve_cpu import configs as sc

VARIANTS = ("file", "zmq", "zmq_server_killed")
SIZES = dict(preset="demo", max_model_len=1024, l1_blocks=256, l3_l2_pages=96, prefixes=8, per_prefix=3,
             prefix_len=768, suffix_len=64, output_len=16, concurrency=8, kill_after=8, zmq_capacity="8MiB")
QUICK = dict(SIZES, per_prefix=2, kill_after=5)
#: lines of a server log that report a page found bad on read (checksum, header, length): a miss, never data
_BAD_PAGE = re.compile(r"bad page record|is not valid|wrong length|quarantin", re.I)


def prompts(p: dict, vocab: int, seed: int = 0) -> list[list[int]]:
    """``prefixes`` x ``per_prefix`` token lists: a shared prefix of ``prefix_len`` tokens and a suffix of
    ``suffix_len``, ordered so that each wave of ``concurrency`` requests mixes prefixes (ids 4..vocab-1)."""
    rng = random.Random(seed)
    heads = [[rng.randrange(4, vocab) for _ in range(p["prefix_len"])] for _ in range(p["prefixes"])]
    return [heads[i] + [rng.randrange(4, vocab) for _ in range(p["suffix_len"])]
            for _ in range(p["per_prefix"]) for i in range(p["prefixes"])]


def complete(srv: VllmServer, prompt: list[int], max_tokens: int) -> list[str]:
    """The greedy completion's tokens (as vLLM's logprobs name them)."""
    body = json.dumps({"model": srv.cmd[srv.cmd.index("--model") + 1], "prompt": prompt, "max_tokens": max_tokens,
                       "temperature": 0.0, "ignore_eos": True, "logprobs": 1}).encode()
    req = urllib.request.Request(srv.url + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=600) as r:
        return json.loads(r.read())["choices"][0]["logprobs"]["tokens"]


def drive(srv: VllmServer, ps: list[list[int]], p: dict, on_done=None) -> list:
    """Every prompt at ``concurrency``; per prompt its tokens or the error's text. ``on_done(n)`` after each."""
    done, lock = [0], threading.Lock()

    def one(prompt):
        try:
            out = complete(srv, prompt, p["output_len"])
        except Exception as e:  # a killed engine: the error is the outcome
            out = f"error: {type(e).__name__}: {e}"[:200]
        with lock:
            done[0] += 1
            n = done[0]
        if on_done is not None:
            on_done(n)
        return out
    with ThreadPoolExecutor(p["concurrency"]) as ex:
        return list(ex.map(one, ps))


def worker_stats(stats_dir: Path) -> tuple[dict, dict]:
    s = read_stats(stats_dir)
    return s.get("scheduler", {}), s.get("worker", {})


def store_files(root: Path) -> dict:
    """Page records, temporary files of writes in progress and quarantined records under a file store's root."""
    out = {"pages": 0, "tmp": 0, "quarantined": 0}
    for _d, _s, files in os.walk(root):
        for f in files:
            if _d.endswith("quarantine") or "/quarantine" in _d:
                out["quarantined"] += 1
            elif f.startswith(".tmp."):
                out["tmp"] += 1
            elif f.endswith(".page"):
                out["pages"] += 1
    return out


class Killer:
    """Watches the engine's completions and L3 write counter; once ``kill_after`` completions are done and the
    worker has written pages to L3, SIGKILLs the engine's process tree (and the ``tierkv server``, if given)."""

    def __init__(self, srv: VllmServer, stats_dir: Path, kill_after: int, zmq: ZmqServer | None):
        self.srv, self.stats_dir, self.kill_after, self.zmq = srv, stats_dir, kill_after, zmq
        self.record: dict = {}
        self.lock = threading.Lock()

    def on_done(self, n: int) -> None:
        with self.lock:
            if self.record or n < self.kill_after:
                return
            _sch, wk = worker_stats(self.stats_dir)
            if not wk.get("l3_backup_pages"):
                return  # no write reached L3 yet: wait for the next completion
            sch, wk = worker_stats(self.stats_dir)
            pending = (sch.get("ctl_backup_ordered_pages", 0) > wk.get("l3_backup_pages", 0)
                       or wk.get("l3_backup_queued_pages", 0) or sch.get("ctl_backing_up_pages", 0))
            if not pending and n < self.kill_after + 3:
                return  # the stats show no write pending: wait up to 3 more completions for one
            self.record = {"completed_at_kill": n, "writes_pending_seen": bool(pending), "l3_backup_pages_seen": wk.get("l3_backup_pages", 0),
                           "l3_backup_queued_pages_seen": wk.get("l3_backup_queued_pages", 0),
                           "ctl_backing_up_pages_seen": sch.get("ctl_backing_up_pages", 0),
                           "ctl_backup_ordered_pages_seen": sch.get("ctl_backup_ordered_pages", 0),
                           "running": int(metric(self.srv.metrics(), "vllm:num_requests_running"))}
            self.record["engine"] = sigkill_tree(self.srv.proc)
            if self.zmq is not None:
                self.record["tierkv_server"] = sigkill_tree(self.zmq.proc)
            self.srv._log.close()


def start_engine(model_dir: str, p: dict, kvc: dict | None, cdir: Path, pythonpath: str, timeout: float):
    cdir.mkdir(parents=True, exist_ok=True)
    srv = VllmServer(model_dir, l1_blocks=p["l1_blocks"], max_model_len=p["max_model_len"], kv_transfer_config=kvc,
                     log_path=cdir / "server.log", pythonpath=pythonpath, dtype="float32", block_size=sc.BLOCK,
                     env=sc.SERVER_ENV)
    try:
        startup = round(srv.wait_ready(timeout), 1)
        complete(srv, list(range(7, 27)), 2)  # warm-up: 20 tokens, no full page
    except Exception as e:
        srv.stop()
        raise RuntimeError(f"engine did not start: {e}: {tail(cdir / 'server.log', 3000)}") from e
    return srv, startup


def zmq_server(vdir: Path, p: dict, pythonpath: str, variant: str) -> ZmqServer:
    extra = ("--spill-dir", str(vdir / "spill")) if variant == "zmq_server_killed" else ()
    cap = p["zmq_capacity"] if variant == "zmq_server_killed" else "4GiB"
    return ZmqServer(vdir / "zmq_server.log", pythonpath, capacity=cap, extra_args=extra)


def bad_page_lines(log: Path) -> list[str]:
    try:
        return [ln[-240:] for ln in log.read_text(errors="replace").splitlines() if _BAD_PAGE.search(ln)]
    except OSError:
        return []


def run_variant(variant: str, rep: int, p: dict, ps: list, ref: list, model_dir: str, work: Path,
                pythonpath: str, timeout: float) -> dict:
    """One crash and restart of ``variant``; its record, with ``checks``."""
    vdir = work / f"{variant}-r{rep}"
    vdir.mkdir(parents=True, exist_ok=True)
    l3_root = vdir / "l3"
    zmq = zmq_server(vdir, p, pythonpath, variant) if variant != "file" else None
    rec: dict = {"variant": variant, "repeat": rep}
    srv = None
    try:
        name = "tierkv_l3_file" if variant == "file" else "tierkv_l3_zmq"
        kvc_a = sc.kv_config(name, p, vdir / "before", zmq.endpoint if zmq else None, l3_root=str(l3_root))
        srv, rec["startup_s_before"] = start_engine(model_dir, p, kvc_a, vdir / "before", pythonpath, timeout)
        killer = Killer(srv, vdir / "before" / "stats", p["kill_after"], zmq if variant == "zmq_server_killed" else None)
        t0 = time.monotonic()
        outs = drive(srv, ps, p, killer.on_done)
        rec["load_s"] = round(time.monotonic() - t0, 1)
        if not killer.record:
            raise RuntimeError("the engine finished every prompt before the kill condition held")
        rec["kill"] = killer.record
        rec["requests_before"] = {"ok": sum(isinstance(o, list) for o in outs),
                                  "failed": sum(isinstance(o, str) for o in outs)}
        sch, wk = worker_stats(vdir / "before" / "stats")
        rec["before_last_stats"] = {"l3_backup_pages": wk.get("l3_backup_pages", 0),
                                    "ctl_backup_ordered_pages": sch.get("ctl_backup_ordered_pages", 0)}
        if variant == "file":
            rec["store_after_kill"] = store_files(l3_root)
        if variant == "zmq_server_killed":
            rec["spill_after_kill"] = store_files(vdir / "spill")
            zmq = zmq_server(vdir, p, pythonpath, variant)
        kvc_b = sc.kv_config(name, p, vdir / "after", zmq.endpoint if zmq else None, l3_root=str(l3_root))
        srv, rec["startup_s_after"] = start_engine(model_dir, p, kvc_b, vdir / "after", pythonpath, timeout)
        outs = drive(srv, ps, p)
        sch, wk = settled_stats(vdir / "after" / "stats")["scheduler"], read_stats(vdir / "after" / "stats")["worker"]
        rec["stop"] = srv.stop()
        srv = None
        if variant == "file":
            rec["store_after_restart"] = store_files(l3_root)
        mism = [i for i, (a, b) in enumerate(zip(outs, ref)) if a != b]
        bad_lines = bad_page_lines(vdir / "after" / "server.log") + bad_page_lines(vdir / "zmq_server.log")
        rec["after"] = {
            "mismatched_prompts": mism, "failed_requests": sum(isinstance(o, str) for o in outs),
            "l3_hit_tokens": sch.get("ctl_l3_hit_tokens", 0), "lookup_l3_tokens": sch.get("lookup_l3_tokens", 0),
            "lookup_failed_tokens": sch.get("lookup_failed_tokens", 0),
            "l3_prefetch_pages": wk.get("l3_prefetch_pages", 0),
            "l3_prefetch_failed_pages": wk.get("l3_prefetch_failed_pages", 0),
            "checksum_mismatches": wk.get("checksum_mismatches", 0),
            "load_failed_requests": sch.get("load_failed_requests", 0),
            "failed_load_blocks": wk.get("failed_load_blocks", 0) + wk.get("sync_failed_blocks", 0),
            "l3_errors": wk.get("l3_errors", 0), "bad_page_log_lines": len(bad_lines),
            "bad_page_samples": bad_lines[:4]}
        if mism:
            rec["after"]["first_mismatch"] = {"prompt": mism[0], "got": outs[mism[0]], "want": ref[mism[0]]}
    except Exception as e:
        rec["error"] = f"{type(e).__name__}: {e}"[:3000]
    finally:
        if srv is not None and srv.alive():
            rec["stop"] = srv.stop()
        if zmq is not None:
            rec["zmq_stop"] = zmq.stop()
    a = rec.get("after", {})
    rec["checks"] = {"no_error": "error" not in rec,
                     "killed_while_writing": bool(rec.get("kill")) and rec.get("requests_before", {}).get("failed", 0) > 0,
                     "outputs_identical": bool(a) and not a["mismatched_prompts"] and not a["failed_requests"],
                     "l3_hits_after_restart": a.get("l3_hit_tokens", 0) > 0}
    print(f"[crash_engine] {variant} r{rep}: " + json.dumps({k: rec.get(k) for k in ("kill", "after", "error")})[:1500],
          flush=True)
    return rec


def summary(runs: list[dict]) -> dict:
    out = {}
    for v in dict.fromkeys(r["variant"] for r in runs):
        mine = [r for r in runs if r["variant"] == v]
        a = [r.get("after", {}) for r in mine]
        rng = lambda xs: results.spread(xs) if xs else None  # noqa: E731
        out[v] = {"repeats": len(mine), "all_checks_pass": all(all(r["checks"].values()) for r in mine),
                  "wrong_bytes_hits": sum(len(x.get("mismatched_prompts", [])) for x in a),
                  "l3_hit_tokens": rng([x["l3_hit_tokens"] for x in a if x]),
                  "bad_pages_detected": rng([x["l3_prefetch_failed_pages"] + x["checksum_mismatches"] for x in a if x]),
                  "load_failures": rng([x["load_failed_requests"] + x["failed_load_blocks"] for x in a if x]),
                  "completed_at_kill": rng([r["kill"]["completed_at_kill"] for r in mine if r.get("kill")]),
                  "requests_failed_by_kill": rng([r["requests_before"]["failed"] for r in mine if "requests_before" in r]),
                  "startup_s_after": rng([r["startup_s_after"] for r in mine if "startup_s_after" in r])}
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.crash_engine", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1 repeat, 16 prompts (24 without)")
    ap.add_argument("--repeats", type=int, default=None, help="repeats of every variant (default 3; --quick 1)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated subset of {','.join(VARIANTS)}")
    ap.add_argument("--start-timeout", type=float, default=600.0, help="seconds for an engine to answer /health")
    ap.add_argument("--out", default=str(RESULTS / "crash_engine.json"), help="result JSON (default %(default)s)")
    args = ap.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    if not variants or set(variants) - set(VARIANTS):
        ap.error(f"--variants: choose from {','.join(VARIANTS)}")
    p = dict(QUICK if args.quick else SIZES)
    repeats = args.repeats or (1 if args.quick else 3)
    t_start, load0 = time.time(), loadavg()
    work = harness.REPO / "runs" / time.strftime("crash_engine-%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    print(f"[crash_engine] run directory {work}", flush=True)
    model_dir = harness.make_tiny_model().make_model(harness.REPO / "runs" / "serve_cpu" / "models" / p["preset"],
                                                     p["preset"])
    pythonpath, code = sc.code_snapshot(work)
    vocab = harness.make_tiny_model().PRESETS[p["preset"]]["vocab_size"]
    ps = prompts(p, vocab)
    ref_srv, _ = start_engine(model_dir, p, None, work / "reference", str(pythonpath), args.start_timeout)
    try:
        ref = drive(ref_srv, ps, p)
    finally:
        ref_srv.stop()
    if any(isinstance(o, str) for o in ref):
        print(f"[crash_engine] reference engine failed: {[o for o in ref if isinstance(o, str)][:2]}", file=sys.stderr)
        return 2
    runs: list[dict] = []
    for rep in range(repeats):
        for v in results.rotated(variants, rep):
            runs.append(run_variant(v, rep, p, ps, ref, model_dir, work, str(pythonpath), args.start_timeout))
            data = record(args, p, repeats, code, load0, t_start, work, runs)
            results.write_result(Path(args.out), data)  # after every run: an interrupted pass keeps what it measured
    out = Path(args.out)
    print(f"wrote {out}\n" + json.dumps(data["summary"], indent=1))
    ok = all(all(r["checks"].values()) for r in runs)
    if not ok:
        print("[crash_engine] FAILED checks: " + json.dumps([(r["variant"], r["repeat"], r["checks"]) for r in runs
                                                              if not all(r["checks"].values())]), file=sys.stderr)
    return 0 if ok else 1


def record(args, p, repeats, code, load0, t_start, work, runs) -> dict:
    return {"benchmark": "crash_engine", "quick": args.quick, "params": p, "repeats": repeats, "code": code,
            "conditions": results.run_conditions(load0, t_start, server_dtype="float32",
                                                 server_env=dict(sc.SERVER_ENV)),
            "run_dir": str(work.relative_to(harness.REPO)), "summary": summary(runs), "runs": runs}


if __name__ == "__main__":
    sys.exit(main())
