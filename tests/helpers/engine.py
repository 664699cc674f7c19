"""Run a real vLLM engine (``vllm.LLM``) on token-id workloads in a *subprocess* and collect the results as JSON.

Why a subprocess: one test or benchmark can run several engine configurations one after the other (no
connector, ExampleConnector, tierkv, a large L1 ...), each with its own environment (``VLLM_CPU_*`` variables
are read once per process), and every engine, with its EngineCore and worker processes, is gone before the
next starts (where the EngineCore runs: :data:`ENGINE_CORE_IN_PROCESS`). The child is started in its own session;
after it exits, any process left in that session is terminated (and counted in ``leaked_processes``), so a crashed
engine never outlives the call.

Determinism: greedy sampling (temperature 0, ``ignore_eos``), ``skip_tokenizer_init=True`` (prompts are token
ids), ``enable_prefix_caching=True``, ``block_size=32``, ``enforce_eager=True`` and, by default,
``VLLM_CPU_NUM_OF_RESERVED_CPU=0`` so that a run with a connector uses the same OpenMP thread count as a run
without one (vLLM's CPU backend reserves a core for any connector otherwise, which changes bf16 reduction
order; see docs/architecture.md, "Two roles in vLLM"). In ``sequential`` mode prompts are sent
one at a time, so batch composition - and with it bf16 rounding - is the same in every configuration.

Public API (parent side, nothing here imports vLLM)::

    res = run_workload(model_dir, [[1, 2, 3, ...], ...], kv_transfer_config=tierkv_kv_config(),
                       num_gpu_blocks_override=64, max_tokens=8)
    res["outputs"][i]            # list[int]: generated token ids of prompt i
    res["num_cached_tokens"][i]  # int | None: prefix tokens vLLM did not compute (L1 hits + connector hits)
    res["ttft_s"][i], res["latency_s"][i]   # float seconds (sequential mode only; None in batch mode)
    res["queued_s"][i], res["prefill_s"][i]  # float seconds from vLLM's request stats (sequential mode only): in the
                                 # engine core before the request's first compute step (a connector's wait for
                                 # L3 included), and from that step to the first token
    res["stats"]                 # {file name: JSON} written by the connector under res["stats_dir"]
    stats_by_role(res)           # {"scheduler": {...summed counters...}, "worker": {...}}

:func:`run_job` runs several named workloads (token-id prompts, or multi-turn chats whose prompts grow by
the model's own answer plus the next user message) in one engine; the benchmarks use it. :func:`in_parallel` runs
independent engines two at a time.

The same file is the child program: ``python _engine.py JOB.json RESULT.json``.
"""
from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Optional

REPO_ROOT = Path(__file__).resolve().parents[2]

TIERKV_CONNECTOR = "TierKVConnector"
TIERKV_MODULE = "tierkv.connector.vllm.connector"

#: Environment every engine subprocess gets unless the caller overrides a key.
DEFAULT_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",   # same thread count with and without a connector
    "VLLM_CPU_KVCACHE_SPACE": "1",         # GiB; num_gpu_blocks_override decides the real L1 size
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}

#: Engine arguments used unless the caller overrides them in ``extra_engine_args``.
DEFAULT_ENGINE_ARGS = {
    "skip_tokenizer_init": True,
    "enable_prefix_caching": True,
    "block_size": 32,
    "enforce_eager": True,
    "dtype": "bfloat16",
    "seed": 0,
    "max_num_seqs": 16,
    "disable_log_stats": False,  # keeps vLLM's Prometheus counters, read per workload (``vllm_counters``)
}


#: Process layout of every engine :func:`run_job` starts. False (the default, what ``vllm serve`` and the benchmarks
#: run): the child process is vLLM's front end, the EngineCore (tierkv's scheduler-side connector) runs in a process
#: of its own and the model in a worker process (tierkv's worker-side connector). True (``tests/e2e/conftest.py``
#: sets it for the test suite): the EngineCore runs inside the child (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) while the
#: worker keeps its own process (``distributed_executor_backend="mp"``), so the connector's two roles still live in
#: two processes and every step's metadata still crosses between them pickled; an engine then starts and stops in
#: about a third of the time (one interpreter fewer to import vLLM into and tear down). An ``env`` or
#: ``extra_engine_args`` entry given to :func:`run_job` overrides either setting.
ENGINE_CORE_IN_PROCESS = False

#: Seconds the EngineCore gets to stop (and its connector to flush/dump stats) before vLLM force-kills it.
SHUTDOWN_TIMEOUT_S = 60.0


class EngineRunError(RuntimeError):
    """The engine subprocess failed, timed out or wrote no result; the message holds the end of its log."""


# ----------------------------------------------------------------------------------------------------------
# parent side
# ----------------------------------------------------------------------------------------------------------

def tierkv_kv_config(extra: Optional[dict] = None, *, load_failure_policy: Optional[str] = None) -> dict:
    """A ``kv_transfer_config`` dict that loads tierkv's connector out of tree (``kv_both``).

    ``extra`` becomes ``kv_connector_extra_config`` (tierkv config overrides, e.g.
    ``{"host_pool": {"size_gb": 1}}`` or ``{"config_file": "..."}``); :func:`run_job` adds ``stats_path``.
    """
    cfg = {
        "kv_connector": TIERKV_CONNECTOR,
        "kv_connector_module_path": TIERKV_MODULE,
        "kv_role": "kv_both",
        "kv_connector_extra_config": dict(extra or {}),
    }
    if load_failure_policy is not None:
        cfg["kv_load_failure_policy"] = load_failure_policy
    return cfg


def example_kv_config(storage_dir: str | os.PathLike) -> dict:
    """A ``kv_transfer_config`` dict for vLLM's stock ``ExampleConnector`` storing under ``storage_dir``."""
    return {
        "kv_connector": "ExampleConnector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"shared_storage_path": str(storage_dir)},
    }


def run_job(
    model_dir: str | os.PathLike,
    workloads: list[dict],
    *,
    kv_transfer_config: Optional[dict] = None,
    num_gpu_blocks_override: Optional[int] = None,
    max_tokens: int = 8,
    extra_engine_args: Optional[dict] = None,
    env: Optional[dict] = None,
    workdir: Optional[str | os.PathLike] = None,
    timeout_s: float = 900.0,
) -> dict:
    """Start one engine in a subprocess, run ``workloads`` in order, shut it down, return the results.

    Each workload is a dict with ``name`` and either

    - ``"prompts": list[list[int]]`` (token ids), optional ``"sequential": bool`` (default True: one request
      at a time, timed; False: all in one ``LLM.generate`` call), optional ``"max_tokens"``, optional
      ``"extend": NAME`` (an earlier prompts workload: prompt ``i`` sent is that workload's prompt ``i``, its output
      ``i`` and then prompt ``i`` given here, so a later round can reuse pages the engine wrote while decoding); or
    - ``"chats": list[list[list[int]]]`` (per chat, the user messages as token ids): turn ``t`` of every
      chat is sent (chats interleaved, turn-major), its prompt being the chat's previous prompt, the model's
      previous answer (generated ids) and user message ``t``.
    - ``"barrier": PATH`` (a hook for tests that act on the world between two workloads of one engine, e.g.
      kill a store server): the engine, idle, creates ``PATH.reached`` and waits until ``PATH.go`` exists
      (polled every 10 ms, at most ``"timeout_s"``, default 600 s, else the child fails). The test runs
      :func:`run_job` in a thread, waits for ``PATH.reached`` (:func:`wait_for_file`), acts, then creates
      ``PATH.go`` (:func:`release_barrier`). A barrier yields no results (its name is not in ``workloads``).
    - ``"reset_prefix_cache": True``: the engine drops every cached block of its L1 (``LLM.reset_prefix_cache()``;
      the child fails if vLLM refuses), e.g. so that a reference engine can rebuild the exact L1 state another
      engine starts from. Yields no results.

    ``kv_transfer_config`` is passed to ``LLM(kv_transfer_config=...)``; for tierkv's connector a
    ``stats_path`` inside ``<workdir>/stats`` is added to its extra config unless one is given.
    ``env`` entries override :data:`DEFAULT_ENV` (a value of None removes the variable).

    Returns a dict: ``workloads`` ({name: per-request lists ``outputs``, ``num_cached_tokens``, ``ttft_s``,
    ``latency_s``, ``prompt_lens``, ``finish_reasons``, plus ``wall_s`` and ``vllm_counters``, the change of
    vLLM's Prometheus counters over the workload: ``vllm:prefix_cache_hits`` = L1 hit tokens,
    ``vllm:external_prefix_cache_hits`` = tokens a connector supplied, ``vllm:prompt_tokens`` ...}), ``startup_s``, ``shutdown_s``,
    ``stats`` ({file name: JSON content} of every ``*.json`` under ``stats_dir``), ``stats_dir``,
    ``log_path``, ``leaked_processes`` (processes of the engine's session still alive after the child exited,
    which were then killed; should be 0). Raises :class:`EngineRunError` on failure or timeout, or
    ``ValueError`` for a malformed workload.
    """
    for w in workloads:
        if "name" not in w or sum(k in w for k in ("prompts", "chats", "barrier", "reset_prefix_cache")) != 1:
            raise ValueError(f"workload {w.get('name')!r}: give a name and exactly one of 'prompts', 'chats', "
                             "'barrier' or 'reset_prefix_cache'")
    workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="tierkv-e2e-"))
    workdir.mkdir(parents=True, exist_ok=True)
    stats_dir = workdir / "stats"
    stats_dir.mkdir(exist_ok=True)

    kvc = copy.deepcopy(kv_transfer_config) if kv_transfer_config else None
    if kvc is not None and kvc.get("kv_connector") == TIERKV_CONNECTOR:
        extra = kvc.setdefault("kv_connector_extra_config", {})
        extra.setdefault("stats_path", str(stats_dir / "{role}-{pid}.json"))

    engine_args = dict(DEFAULT_ENGINE_ARGS)
    if ENGINE_CORE_IN_PROCESS:
        engine_args["distributed_executor_backend"] = "mp"
    engine_args.update(extra_engine_args or {})
    engine_args["model"] = str(model_dir)
    if num_gpu_blocks_override is not None:
        engine_args["num_gpu_blocks_override"] = int(num_gpu_blocks_override)
        if "max_model_len" not in engine_args:
            # vLLM refuses to start if one max-length request does not fit in L1 (less its null block).
            engine_args["max_model_len"] = min(_model_max_len(model_dir),
                                               (int(num_gpu_blocks_override) - 1) * int(engine_args["block_size"]))

    job = {"engine_args": engine_args, "kv_transfer_config": kvc, "max_tokens": int(max_tokens),
           "workloads": workloads}
    job_path, result_path, log_path = workdir / "job.json", workdir / "result.json", workdir / "engine.log"
    job_path.write_text(json.dumps(job))
    if result_path.exists():
        result_path.unlink()

    child_env = dict(os.environ)
    # each engine starts without a predecessor's recompute estimate (connector/l3/estimates.py) unless ``env`` names
    # a directory shared by several engines
    child_env["TIERKV_ESTIMATES_DIR"] = str(workdir)
    layout_env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"} if ENGINE_CORE_IN_PROCESS else {}
    for k, v in {**DEFAULT_ENV, **layout_env, **(env or {})}.items():
        if v is None:
            child_env.pop(k, None)
        else:
            child_env[k] = str(v)
    # The connector must be importable in the EngineCore and worker processes too.
    child_env["PYTHONPATH"] = os.pathsep.join(p for p in [str(REPO_ROOT), child_env.get("PYTHONPATH")] if p)

    t0 = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), str(job_path), str(result_path)],
                                stdout=log, stderr=subprocess.STDOUT, env=child_env, cwd=str(workdir),
                                start_new_session=True)
        timed_out = False
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
            rc = None
        except BaseException:  # KeyboardInterrupt: never leave the engine behind
            _kill_session(proc.pid, grace_s=0)
            proc.wait()
            raise
        finally:
            if timed_out:
                proc.kill()
            leaked = _kill_session(proc.pid, grace_s=0 if timed_out else 5.0)
            if timed_out:
                proc.wait()
    elapsed = time.monotonic() - t0

    if timed_out or rc != 0 or not result_path.exists():
        why = f"timed out after {timeout_s:.0f} s" if timed_out else f"exit code {rc}"
        raise EngineRunError(f"engine subprocess failed ({why}); log {log_path}:\n{_tail(log_path)}")
    result = json.loads(result_path.read_text())
    result["stats"] = read_stats(stats_dir)
    result["stats_dir"] = str(stats_dir)
    result["log_path"] = str(log_path)
    result["leaked_processes"] = len(leaked)
    result["leaked_cmdlines"] = leaked
    result["elapsed_s"] = elapsed
    return result


def run_workload(
    model_dir: str | os.PathLike,
    prompts: list[list[int]],
    *,
    kv_transfer_config: Optional[dict] = None,
    num_gpu_blocks_override: Optional[int] = None,
    max_tokens: int = 8,
    sequential: bool = True,
    extra_engine_args: Optional[dict] = None,
    env: Optional[dict] = None,
    workdir: Optional[str | os.PathLike] = None,
    timeout_s: float = 900.0,
) -> dict:
    """Run one list of token-id prompts through a fresh engine (see :func:`run_job`) and return a flat dict.

    Keys: ``outputs`` (list[list[int]], generated ids per prompt), ``num_cached_tokens`` (list[int | None]),
    ``ttft_s`` / ``latency_s`` (list of seconds, None in batch mode), ``prompt_lens``, ``finish_reasons``,
    ``wall_s``, ``startup_s``, ``stats``, ``stats_dir``, ``log_path``, ``leaked_processes``.
    """
    res = run_job(model_dir, [{"name": "main", "prompts": [_norm_prompt(p) for p in prompts],
                               "sequential": sequential}],
                  kv_transfer_config=kv_transfer_config, num_gpu_blocks_override=num_gpu_blocks_override,
                  max_tokens=max_tokens, extra_engine_args=extra_engine_args, env=env, workdir=workdir,
                  timeout_s=timeout_s)
    flat = dict(res.pop("workloads")["main"])
    flat.update(res)
    return flat


def in_parallel(max_at_once: int = 2, **calls) -> dict[str, Any]:
    """Run the zero-argument callables ``calls`` (each typically a :func:`run_job`, i.e. its own engine subprocess),
    at most ``max_at_once`` at a time, in threads; return ``{name: result}``.

    For engines that do not depend on each other (no shared store, no order between them): their start-ups, which
    run one process after the other within an engine, overlap. Outputs are those of the engines run one by one (each
    engine is its own set of processes with its own OpenMP threads; in sequential mode a request's computation does
    not depend on what else the machine runs); times are not (``ttft_s``, ``latency_s`` and deadlines see the other
    engine's load), so engines whose test bounds a time run alone. Every call runs to its end even if another fails;
    then the first failure (in ``calls`` order) is raised as ``RuntimeError`` naming the call, chained to the
    original exception. ``ValueError`` if ``max_at_once`` < 1.
    """
    if max_at_once < 1:
        raise ValueError(f"max_at_once must be at least 1, got {max_at_once}")
    results: dict[str, Any] = {}
    errors: dict[str, BaseException] = {}
    slots = threading.BoundedSemaphore(max_at_once)

    def run(name, fn):
        with slots:
            try:
                results[name] = fn()
            except BaseException as e:  # re-raised below, in the caller's thread
                errors[name] = e

    threads = [threading.Thread(target=run, args=item, name=f"engine-{item[0]}") for item in calls.items()]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for name in calls:
        if name in errors:
            raise RuntimeError(f"engine {name!r} failed") from errors[name]
    return results


def _model_max_len(model_dir) -> int:
    try:
        return int(json.loads((Path(model_dir) / "config.json").read_text())["max_position_embeddings"])
    except (OSError, ValueError, KeyError):
        return 1 << 30


def _norm_prompt(p):
    """A prompt is a list of token ids, or a dict ``{"prompt_token_ids": [...], "cache_salt": "..."}``."""
    if isinstance(p, dict):
        return {"prompt_token_ids": [int(t) for t in p["prompt_token_ids"]],
                **({"cache_salt": str(p["cache_salt"])} if p.get("cache_salt") is not None else {})}
    return [int(t) for t in p]


def _prompt_len(p) -> int:
    return len(p["prompt_token_ids"]) if isinstance(p, dict) else len(p)


def _tokens_prompt(p):
    from vllm.inputs import TokensPrompt
    return TokensPrompt(**p) if isinstance(p, dict) else TokensPrompt(prompt_token_ids=p)


def wait_for_file(path: str | os.PathLike, timeout_s: float, alive=None) -> None:
    """Return once ``path`` exists (polled every 10 ms). Raises TimeoutError after ``timeout_s`` seconds, or
    RuntimeError as soon as ``alive()`` (optional) returns False (e.g. the engine thread died)."""
    deadline = time.monotonic() + timeout_s
    while not os.path.exists(path):
        if alive is not None and not alive():
            raise RuntimeError(f"gave up waiting for {path}: the other side is gone")
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear within {timeout_s} s")
        time.sleep(0.01)  # polling interval of the condition, not a synchronisation sleep


def release_barrier(path: str | os.PathLike) -> None:
    """Let an engine waiting at the barrier ``path`` (a workload ``{"barrier": path}``) go on."""
    Path(str(path) + ".go").touch()


def read_stats(stats_dir: str | os.PathLike) -> dict[str, Any]:
    """``{file name: parsed JSON}`` for every ``*.json`` file in ``stats_dir`` (unreadable files -> their error)."""
    out: dict[str, Any] = {}
    for p in sorted(Path(stats_dir).glob("*.json")):
        try:
            out[p.name] = json.loads(p.read_text())
        except (OSError, ValueError) as e:
            out[p.name] = {"_error": f"{type(e).__name__}: {e}"}
    return out


def stats_by_role(result_or_stats: dict) -> dict[str, dict]:
    """Sum numeric counters of the connector's stats files per role.

    File names follow ``{role}-{pid}.json`` (the ``stats_path`` set by :func:`run_job`), so the role is the
    part before the last ``-``. Numbers are summed across files of the same role (one file per process: the
    scheduler, and one worker per rank); nested dicts are summed key by key; ``pid`` and non-numbers keep the last seen. Gauges (``num_slots``,
    ``free_slots``) are summed too, which is right for per-rank pools.
    """
    stats = result_or_stats.get("stats", result_or_stats) if "stats" in result_or_stats else result_or_stats
    merged: dict[str, dict] = {}
    for name, content in stats.items():
        role = name[:-5].rsplit("-", 1)[0] if name.endswith(".json") else name
        if isinstance(content, dict):
            _sum_into(merged.setdefault(role, {}), content)
    return merged


def _sum_into(acc: dict, new: dict) -> None:
    for k, v in new.items():
        if isinstance(v, bool) or not isinstance(v, (int, float, dict)) or k == "pid":
            acc[k] = v
        elif isinstance(v, dict):
            _sum_into(acc.setdefault(k, {}) if isinstance(acc.get(k), dict) else acc.setdefault(k, {}), v)
        else:
            prev = acc.get(k, 0)
            acc[k] = (prev if isinstance(prev, (int, float)) and not isinstance(prev, bool) else 0) + v


def _kill_session(sid: int, grace_s: float = 5.0) -> list[str]:
    """End every process whose session id is ``sid`` (the child and what it spawned).

    Processes get ``grace_s`` seconds to exit on their own (e.g. multiprocessing's resource tracker after its
    parent is gone), then SIGTERM, then SIGKILL. Returns ``"pid command line"`` of each process that had to
    be signalled.
    """
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and _session_pids(sid):
        time.sleep(0.1)
    pids = _session_pids(sid)
    described = [f"{p} {_cmdline(p)}" for p in pids]
    for sig in (signal.SIGTERM, signal.SIGKILL):
        alive = [p for p in pids if _alive(p)]
        if not alive:
            break
        for p in alive:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline and any(_alive(p) for p in alive):
            time.sleep(0.1)
    return described


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")[:200]
    except OSError:
        return "?"


def _session_pids(sid: int) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        # fields after the command: state ppid pgrp session ...
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(d.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _tail(path: Path, n: int = 6000) -> str:
    try:
        data = path.read_bytes()
    except OSError:
        return "(no log)"
    return data[-n:].decode(errors="replace")


# ----------------------------------------------------------------------------------------------------------
# child side
# ----------------------------------------------------------------------------------------------------------

def _child(job_path: str, result_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = dict(job["engine_args"])
    if job.get("kv_transfer_config"):
        kwargs["kv_transfer_config"] = KVTransferConfig(**job["kv_transfer_config"])
    t0 = time.monotonic()
    llm = LLM(**kwargs)
    startup_s = time.monotonic() - t0
    engine = llm.llm_engine
    counter = [0]

    def params(max_tokens: int) -> SamplingParams:
        return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def one(prompt: list[int], max_tokens: int) -> dict:
        """Send one request alone and step the engine until it finishes, timing the first token."""
        counter[0] += 1
        rid = f"r{counter[0]}"
        t_start = time.perf_counter()
        engine.add_request(rid, _tokens_prompt(prompt), params(max_tokens))
        ttft, final = None, None
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.request_id != rid:
                    continue
                if ttft is None and out.outputs and len(out.outputs[0].token_ids) > 0:
                    ttft = time.perf_counter() - t_start
                if out.finished:
                    final = out
        latency = time.perf_counter() - t_start
        if final is None:
            raise RuntimeError(f"request {rid} produced no final output")
        st = final.metrics   # vLLM's RequestStateStats (engine-core monotonic timestamps; log stats are on)
        timed = st is not None and getattr(st, "scheduled_ts", 0.0) > 0.0
        return {"output": list(final.outputs[0].token_ids), "num_cached_tokens": final.num_cached_tokens,
                "ttft_s": ttft, "latency_s": latency, "finish_reason": final.outputs[0].finish_reason,
                "prompt_len": _prompt_len(prompt),
                "queued_s": st.scheduled_ts - st.queued_ts if timed else None,
                "prefill_s": st.first_token_ts - st.scheduled_ts if timed else None}

    inproc_core = getattr(engine.engine_core, "engine_core", None)   # the EngineCore when it runs in this process

    def drain(timeout_s: float = 600.0) -> None:
        """With the EngineCore in this process (``ENGINE_CORE_IN_PROCESS``), step it while its scheduler still holds
        requests (finished ones whose blocks a connector keeps until its transfers end), as vLLM's EngineCore process
        does on its own between requests; without this, a connector's reads in flight when a workload ends would
        never report. No-op in vLLM's default layout. RuntimeError after ``timeout_s``."""
        if inproc_core is None:
            return
        deadline = time.monotonic() + timeout_s
        while inproc_core.scheduler.has_requests():
            if time.monotonic() > deadline:
                raise RuntimeError(f"the engine still holds requests after {timeout_s:.0f} s of idle steps")
            engine.step()

    def collect(rows: list[dict], wall: float) -> dict:
        keys = {"outputs": "output", "num_cached_tokens": "num_cached_tokens", "ttft_s": "ttft_s",
                "latency_s": "latency_s", "finish_reasons": "finish_reason", "prompt_lens": "prompt_len",
                "queued_s": "queued_s", "prefill_s": "prefill_s"}
        res = {k: [r.get(v) for r in rows] for k, v in keys.items()}
        res["wall_s"] = wall
        return res

    def counters() -> dict[str, float]:
        """vLLM's own counters (e.g. ``vllm:prefix_cache_hits``, ``vllm:external_prefix_cache_hits``, tokens)."""
        snap: dict[str, float] = {}
        try:
            metrics = llm.get_metrics()
        except Exception:  # stats disabled or reader unavailable
            return snap
        for m in metrics:
            if type(m).__name__ == "Counter":
                snap[m.name] = snap.get(m.name, 0) + m.value
        return snap

    results: dict[str, dict] = {}
    sent: dict[str, list] = {}   # the prompts each prompts workload sent (for ``extend``)
    for w in job["workloads"]:
        if "barrier" in w:
            Path(str(w["barrier"]) + ".reached").touch()
            wait_for_file(str(w["barrier"]) + ".go", float(w.get("timeout_s", 600.0)))
            continue
        if "reset_prefix_cache" in w:
            if not llm.reset_prefix_cache():
                raise RuntimeError(f"workload {w['name']!r}: vLLM refused to reset its prefix cache")
            continue
        max_tokens = int(w.get("max_tokens", job["max_tokens"]))
        before = counters()
        t_w = time.monotonic()
        extra_cols: dict[str, list] = {}
        prompts = w.get("prompts")
        if prompts is not None and "extend" in w:
            base = sent[w["extend"]]
            prompts = [list(b) + list(results[w["extend"]]["outputs"][i]) + list(p)
                       for i, (b, p) in enumerate(zip(base, prompts))]
        if prompts is not None:
            sent[w["name"]] = prompts
        if prompts is not None and w.get("sequential", True):
            rows = [one(p, max_tokens) for p in prompts]
        elif prompts is not None:
            outs = llm.generate([_tokens_prompt(p) for p in prompts], params(max_tokens),
                                use_tqdm=False)
            rows = [{"output": list(o.outputs[0].token_ids), "num_cached_tokens": o.num_cached_tokens,
                     "ttft_s": None, "latency_s": None, "finish_reason": o.outputs[0].finish_reason,
                     "prompt_len": _prompt_len(p)} for o, p in zip(outs, prompts)]
        else:
            chats = w["chats"]
            history = [[] for _ in chats]
            rows = []
            for turn in range(max(len(c) for c in chats)):
                for ci, chat in enumerate(chats):
                    if turn >= len(chat):
                        continue
                    prompt = history[ci] + list(chat[turn])
                    row = one(prompt, max_tokens)
                    row.update(chat=ci, turn=turn)
                    rows.append(row)
                    history[ci] = prompt + row["output"]
            extra_cols = {"chat": [r["chat"] for r in rows], "turn": [r["turn"] for r in rows]}
        res = collect(rows, time.monotonic() - t_w)
        res.update(extra_cols)
        after = counters()
        res["vllm_counters"] = {k: v - before.get(k, 0) for k, v in after.items()}
        results[w["name"]] = res
        drain()

    t_s = time.monotonic()
    try:
        engine.engine_core.shutdown(timeout=SHUTDOWN_TIMEOUT_S)
    finally:
        shutdown_s = time.monotonic() - t_s
    Path(result_path).write_text(json.dumps({"workloads": results, "startup_s": startup_s,
                                             "shutdown_s": shutdown_s}))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: {sys.argv[0]} JOB.json RESULT.json")
    _child(sys.argv[1], sys.argv[2])
    # Do not linger in interpreter teardown (vLLM's atexit/finalizers can be slow): the result is written.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
