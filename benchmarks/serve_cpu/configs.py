"""serve_cpu's configurations, sizes and environments: what each server runs with.

A configuration is a name of :data:`CONFIGS`; :func:`kv_config` gives its vLLM ``kv_transfer_config`` (None
without a connector). Sizes (:data:`QUICK`, :data:`FULL`) are in blocks and pages of :data:`BLOCK` tokens and in
tokens. :data:`SERVER_ENV` and :data:`SERVER_DTYPE` are set once per run by the command line (``--allocator``,
``--onednn-cache``, ``--dtype``) and recorded in the result's ``conditions`` (:func:`conditions`).
"""
from __future__ import annotations

import io
import platform
import subprocess
import tarfile
from pathlib import Path

from benchmarks.harness import REPO
from benchmarks.harness.machine import machine
from benchmarks.harness.servers import VllmServer

BLOCK = 32


CONFIGS = ["ideal", "none", "tierkv_l2", "tierkv_l3_file", "tierkv_l3_zmq", "tierkv_write_back",
           "tierkv_l3_file_shm", "tierkv_l3_file_p4", "noop_connector", "tierkv_l3_file_selective",
           "tierkv_l3_file_gil_default", "tierkv_l3_file_full", "tierkv_l3_zmq_full",
           "tierkv_l3_file_full_writer_normal", "tierkv_l3_redis", "tierkv_l3_file_pause_prefill",
           "tierkv_l3_file_pause_forward", "tierkv_l3_file_small", "tierkv_l3_file_small_s3fifo",
           "tierkv_l3_file_small_slru", "tierkv_l3_file_small_lfu", "tierkv_l3_file_small_second_sight",
           "tierkv_l3_file_small_reused_in_l2"]


P4_BLOCKS = 4   # blocks per page of tierkv_l3_file_p4


FILE_L3_CONFIGS = ("tierkv_l3_file", "tierkv_write_back", "tierkv_l3_file_shm", "tierkv_l3_file_p4",
                   "tierkv_l3_file_selective", "tierkv_l3_file_gil_default", "tierkv_l3_file_full",
                   "tierkv_l3_file_full_writer_normal", "tierkv_l3_file_pause_prefill", "tierkv_l3_file_pause_forward",
                   "tierkv_l3_file_small", "tierkv_l3_file_small_s3fifo", "tierkv_l3_file_small_slru",
                   "tierkv_l3_file_small_lfu", "tierkv_l3_file_small_second_sight", "tierkv_l3_file_small_reused_in_l2")


#: file-L3 configurations whose store is ``FULL_L3_BYTES``
FULL_FILE_L3_CONFIGS = ("tierkv_l3_file_full", "tierkv_l3_file_full_writer_normal")


#: L3 capacity of ``tierkv_l3_file_full`` and ``tierkv_l3_zmq_full`` (less than one no_reuse_cost repeat writes: the
#: store runs at capacity)
FULL_L3_BYTES = "64MiB"


#: the bounded-L3 configurations: (eviction policy of the index, L2 and file store, ``l3.admission``). Their L2 is
#: ``small_l2_pages`` and their store holds ``l3_small_pages`` pages (:func:`small_l3_bytes`), chosen from the
#: distinct pages of one run: multiturn 704 (FULL; 192 QUICK), trace 1,230 (FULL; 321 QUICK), so about half of a
#: multiturn run and a third of a trace run fit L3 and a quarter or less L2: which pages stay decides the hits
SMALL_L3 = {"tierkv_l3_file_small": ("lru", "always"), "tierkv_l3_file_small_s3fifo": ("s3fifo", "always"),
            "tierkv_l3_file_small_slru": ("slru", "always"), "tierkv_l3_file_small_lfu": ("lfu", "always"),
            "tierkv_l3_file_small_second_sight": ("lru", "second_sight"),
            "tierkv_l3_file_small_reused_in_l2": ("lru", "reused_in_l2")}


def page_bytes(preset: str, dtype: str) -> int:
    """Bytes of one page (:data:`BLOCK` tokens, K and V of every layer) of a ``make_tiny_model`` preset's model."""
    from benchmarks.harness import make_tiny_model

    spec = make_tiny_model().PRESETS[preset]
    per_token = (spec["kv_lora_rank"] + spec["qk_rope_head_dim"] if "kv_lora_rank" in spec else
                 2 * spec["num_key_value_heads"] * spec.get("head_dim",
                                                            spec["hidden_size"] // spec["num_attention_heads"]))
    return per_token * spec["num_hidden_layers"] * BLOCK * (4 if dtype == "float32" else 2)


def small_l3_bytes(p: dict) -> int:
    """``l3.file.capacity_bytes`` of the bounded-L3 configurations: ``l3_small_pages`` records (page + 64-byte header)
    of this run's model and dtype."""
    from tierkv.storage_backends.page_format import HEADER_BYTES

    return p["l3_small_pages"] * (page_bytes(p["preset"], SERVER_DTYPE[0]) + HEADER_BYTES)


#: write policy of each file-L3 configuration that does not write through
WRITE_POLICY = {"tierkv_write_back": "write_back", "tierkv_l3_file_selective": "write_through_selective"}


#: other controller keys of a file-L3 configuration
CONTROLLER_KEYS = {"tierkv_l3_file_gil_default": {"gil_switch_interval_s": 0.0},
                   "tierkv_l3_file_full_writer_normal": {"writer_priority": "normal"},
                   "tierkv_l3_file_pause_prefill": {"backup_pause": "prefill"},
                   "tierkv_l3_file_pause_forward": {"backup_pause": "forward"}}


WORKLOADS = ["prefix_repetition", "multiturn", "random", "trace"]


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
    "tierkv_l3_file_pause_prefill": "as tierkv_l3_file, the L3 writer paused during a forward computing "
                                    "prompt tokens (`controller.backup_pause: prefill`)",
    "tierkv_l3_file_pause_forward": "as tierkv_l3_file, the L3 writer paused during every forward "
                                    "(`controller.backup_pause: forward`)",
    "tierkv_l3_redis": "L1 {l1_blocks} + L2 {l3_l2_pages} pages + redis L3 (`redis-server` on loopback, 4 GiB "
                       "allkeys-lru), write_through",
    "tierkv_l3_file_small": "L1 {l1_blocks} + L2 {small_l2_pages} pages + file L3 of {l3_small_pages} pages (about half "
                            "a multiturn run's distinct pages, a third of a trace run's), lru, every page admitted, "
                            "write_through",
    **{n: f"as tierkv_l3_file_small, {pol} eviction in the index, L2 and L3 (`eviction_policy`, "
          "`l3.file.eviction_policy`)" for n, (pol, adm) in SMALL_L3.items() if pol != "lru"},
    **{n: f"as tierkv_l3_file_small, L3 admission `{adm}` (`l3.admission`)" for n, (pol, adm) in SMALL_L3.items()
       if adm != "always"},
}


#: ZMQ-L3 configurations (each gets its own ``tierkv server``) and the server's capacity of each
ZMQ_L3_CAPACITY = {"tierkv_l3_zmq": "4GiB", "tierkv_l3_zmq_full": FULL_L3_BYTES}


#: ``--dtype`` choices of the benchmarks' engines (model weights and KV cache): float32 where the CPU lacks AVX-512
#: and its bf16 forward is ~10x slower, so that tierkv's fixed costs show as on a faster one
DTYPES = ("bfloat16", "float32")


#: the servers' ``--dtype``; ``--dtype`` of this script sets it for a run
SERVER_DTYPE = ["bfloat16"]


#: Environment of every vLLM server (as tests/helpers/engine.py DEFAULT_ENV).
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
             rnd_num_prompts=16, rnd_input_len=320, rnd_output_len=8, small_l2_pages=48, l3_small_pages=96,
             tr_offset=6000, tr_requests=24, tr_sample=64, tr_output_len=8)


FULL = dict(preset="demo", max_model_len=2048, l1_blocks=384, ideal_blocks=4096, l2_pages=8192, l3_l2_pages=384,
            pr_prefix_len=1024, pr_suffix_len=64, pr_num_prefixes=16, pr_num_prompts=64, pr_output_len=16,
            mt_conversations=16, mt_turns=4, mt_first_chunks=32, mt_turn_chunks=4, mt_output_len=16,
            rnd_num_prompts=32, rnd_input_len=1088, rnd_output_len=16, small_l2_pages=128, l3_small_pages=384,
            tr_offset=6000, tr_requests=96, tr_sample=16, tr_output_len=16)


#: the soak's sizes and limits (``--soak``)
SOAK = dict(requests=2000, concurrency=8, warmup_requests=200, warmup_max_rounds=6, warmup_stable_growth=0.01,
            warmup_stable_per_process=True,
            num_prefixes=40, prefix_len=1024, suffix_len=64,
            output_len=16, fault_fraction=0.3, fault_seed=7, rss_growth_limit=0.05, idle_timeout_s=60.0)


def conditions() -> dict:
    """The machine (``lscpu`` model, cores, flags), the versions and the environments a result was measured with."""
    from importlib.metadata import PackageNotFoundError, version

    def ver(name):
        try:
            return version(name)
        except PackageNotFoundError:
            return "?"
    m = machine()
    return {"cpu": m["cpu"], "cpus": m["cpus"], "isa": m["isa"], "flags": m["flags"], "python": platform.python_version(),
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


def kv_config(name: str, p: dict, cdir: Path, zmq_endpoint: str | None, l3_root: str | None = None,
              l3_url: str | None = None) -> dict | None:
    """vLLM's ``kv_transfer_config`` of configuration ``name`` (None without a connector); ``l3_root``: the file
    store's root (default ``cdir/l3``); ``l3_url``: the redis server's URL."""
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
                      **(small_l3_keys(name, p) if name in SMALL_L3 else {}),
                      "controller": {"write_policy": WRITE_POLICY.get(name, "write_through"),
                                     **CONTROLLER_KEYS.get(name, {})}})
    elif name == "tierkv_l3_redis":
        extra.update({"config_file": "l3_zmq.yaml", "l3.backend": "redis",
                      "l3.redis.url": l3_url or "redis://127.0.0.1:6379/0",
                      "l3.redis.timeout_s": 5.0, "host_pool": {"num_pages": p["l3_l2_pages"]},
                      "controller": {"write_policy": "write_through"}})
    elif name in ZMQ_L3_CAPACITY:
        extra.update({"config_file": "l3_zmq.yaml", "l3.zmq.endpoint": zmq_endpoint, "l3.zmq.shm": "auto",
                      "l3.zmq.timeout_s": 5.0, "host_pool": {"num_pages": p["l3_l2_pages"]},
                      "controller": {"write_policy": "write_through"}})
    else:
        raise ValueError(name)
    return {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connector.vllm.connector",
            "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


def small_l3_keys(name: str, p: dict) -> dict:
    """The keys a bounded-L3 configuration adds to the file-L3 ones: small L2, bounded store, policy, admission."""
    pol, adm = SMALL_L3[name]
    return {"host_pool": {"num_pages": p["small_l2_pages"]}, "l3.file.capacity_bytes": small_l3_bytes(p),
            "eviction_policy": pol, "l3.file.eviction_policy": pol, "l3.admission": adm}


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


def vllm_server(model_dir: str, **kw) -> VllmServer:
    """vLLM's OpenAI server with this run's dtype, block size and environment (:data:`SERVER_DTYPE`,
    :data:`BLOCK`, :data:`SERVER_ENV`); ``kw``: :class:`~benchmarks.harness.servers.VllmServer`'s other arguments."""
    return VllmServer(model_dir, dtype=SERVER_DTYPE[0], block_size=BLOCK, env=SERVER_ENV, **kw)
