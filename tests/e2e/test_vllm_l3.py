"""The real vLLM engine with tierkv's controller and a file L3: a prefill computed by one engine is loaded by the
next one from L3 (restart persistence), outputs bit-identical to vLLM reusing the same prefix from L1.

Reference: one engine without a connector and an L1 large enough for everything runs the first round and then
the second round, so the second round's prefixes come from its own L1. tierkv: engine 1 runs the first round with
write_through to a file store and an L2 too small for the working set; engine 2 (a new process, empty L1 and L2)
runs the second round on the same directory, so its prefixes can only come from L3. Its requests run one at a time:
the first read of a process is cold (it times the store client's set-up), so the first two hits are asynchronous
loads and give the fetch estimate; the last two are then loaded synchronously, before the forward of the step that
admits them (``controller.sync_load_max_s``).

A second pair of engines runs the same rounds into a file store of 16 records, smaller than round 1's 26 pages: the
store evicts and overwrites the evicted files (``l3.file.recycle_evicted``), and what it kept is loaded bit-exact.

On a CPU with AMX tiles engine 2 is also the restart path of a crash seen under concurrent load: its first forward is an
L3 hit, and vLLM's AMX attention kernel dies of SIGILL unless the process asked for AMX tile permission first
(``connector/cpu/cpu_features.py``). The namespace test checks which packing the engines ran, so a run on such a host
says it covered that path.
"""
import random

import pytest

from tests.helpers.engine import in_parallel, run_job, stats_by_role, tierkv_kv_config

P = 32
MAX_LEN = 512


def _rounds():
    rng = random.Random(77)
    vocab = lambda n: [rng.randrange(10, 1000) for _ in range(n)]
    docs = [vocab(n) for n in (160, 224, 257, 192)]
    first = [d + vocab(rng.randrange(3, 20)) for d in docs]
    again = [d + vocab(rng.randrange(3, 20)) for d in docs]
    return first, again


def _tier_config(root, **extra):
    cfg = {"host_pool": {"num_pages": 12}, "verify_checksums": True,
           "l3": {"backend": "file", "file": {"root": str(root)}},
           # deadlines long enough that a slow machine never misses one: outputs compare bit for bit
           "controller": {"write_policy": "write_through", "prefetch_policy": "timeout",
                          "prefetch_timeout_base_s": 30.0, "sync_load_max_s": 0.25}}
    cfg.update(extra)
    return tierkv_kv_config(cfg, load_failure_policy="recompute")


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    first, again = _rounds()
    args = {"max_model_len": MAX_LEN}
    root = tmp_path_factory.mktemp("l3")
    ref_wd, e1_wd = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("e1")
    # the reference does not touch the store: it runs next to engine 1 (``in_parallel``); engine 2 starts after both
    first_pair = in_parallel(
        ref=lambda: run_job(tiny_model, [{"name": "first", "prompts": first}, {"name": "again", "prompts": again}],
                            kv_transfer_config=None, num_gpu_blocks_override=200, max_tokens=6,
                            extra_engine_args=args, workdir=ref_wd),
        e1=lambda: run_job(tiny_model, [{"name": "first", "prompts": first}], kv_transfer_config=_tier_config(root),
                           num_gpu_blocks_override=MAX_LEN // P + 2, max_tokens=6, extra_engine_args=args,
                           workdir=e1_wd))
    ref, e1 = first_pair["ref"], first_pair["e1"]
    e2 = run_job(tiny_model, [{"name": "again", "prompts": again}], kv_transfer_config=_tier_config(root),
                 num_gpu_blocks_override=MAX_LEN // P + 2, max_tokens=6, extra_engine_args=args,
                 workdir=tmp_path_factory.mktemp("e2"))
    e1["l3_root"] = root
    return first, again, ref, e1, e2


def test_first_engine_backs_up_every_full_page(runs):
    first, _again, ref, e1, _e2 = runs
    assert e1["workloads"]["first"]["outputs"] == ref["workloads"]["first"]["outputs"]
    s = stats_by_role(e1)
    sched, worker = s["scheduler"], s["worker"]
    full_pages = sum(len(p) // P for p in first)            # every page whose KV was computed, incl. the last one
    assert worker["l3_backup_pages"] == sched["ctl_backup_stored_pages"] == full_pages, (sched, worker)
    assert worker["l3_backup_failed_pages"] == 0 and sched["ctl_pending_jobs"] == 0
    assert sched["locked_pages"] == 0 and sched["live_requests"] == 0
    assert e1["leaked_processes"] == 0


def test_restarted_engine_loads_prefixes_from_l3_bit_exact(runs):
    _first, again, ref, _e1, e2 = runs
    out, want = e2["workloads"]["again"], ref["workloads"]["again"]
    assert out["outputs"] == want["outputs"]
    # the engine reused as many prefix tokens as vLLM did from its own L1 (all full pages but the last token's)
    assert out["num_cached_tokens"] == want["num_cached_tokens"]
    s = stats_by_role(e2)
    sched, worker = s["scheduler"], s["worker"]
    assert sched["ctl_l3_hit_tokens"] == sum(want["num_cached_tokens"]) > 0, sched
    assert worker["l3_prefetch_failed_pages"] == 0 and worker["failed_load_blocks"] == 0
    # two asynchronous loads (no fetch estimate before them), then two synchronous ones
    assert sched["ctl_prefetch_jobs"] == 4 and sched["ctl_prefetch_sync_jobs"] == 2, sched
    assert worker["sync_failed_blocks"] == 0 and worker["sync_load_pages"] > 0
    assert worker["async_load_pages"] + worker["sync_load_pages"] == sched["ctl_l3_hit_tokens"] // P
    assert sched["l3_hits"] == 4
    # vLLM's own counters agree: every reused token was supplied by the connector (L1 and L2 started empty), and
    # tierkv's Prometheus counters moved by the stats files' counts
    vc = out["vllm_counters"]
    assert vc["vllm:prefix_cache_hits"] == 0 and sched["l2_hit_tokens"] == 0
    assert vc["vllm:external_prefix_cache_hits"] == sched["ctl_l3_hit_tokens"] == vc["vllm:tierkv_ctl_l3_hit_tokens"]
    assert vc["vllm:tierkv_hit_tokens"] == sched["ctl_l3_hit_tokens"]
    assert vc["vllm:tierkv_l3_prefetch_pages"] == worker["l3_prefetch_pages"] == sched["ctl_l3_hit_tokens"] // P
    assert vc["vllm:tierkv_load_pages"] == sched["load_pages"] == sched["ctl_l3_hit_tokens"] // P
    assert sched["locked_pages"] == 0 and sched["free_slots"] + sched["l2_pages"] == sched["num_slots"]
    assert e2["leaked_processes"] == 0


def test_store_records_what_its_namespace_stands_for(runs, tiny_model):
    """The engine describes its namespace in the file store (namespace.json), so `tierkv store stats` names the
    model, dtype and layout of the pages; the digest itself cannot be decoded."""
    import json
    import subprocess
    import sys

    _first, _again, _ref, e1, _e2 = runs
    root = e1["l3_root"]
    infos = sorted(root.glob("*/namespace.json"))
    assert len(infos) == 1, infos                      # one rank, one namespace
    info = json.loads(infos[0].read_text())
    assert info["model_id"].startswith(str(tiny_model)) and info["page_size"] == P and info["tp_rank"] == 0
    # vLLM's CPU attention packs bf16 pages for AMX where the CPU has AMX bf16 tiles: the namespace names it
    from tierkv.connector.cpu.cpu_features import cpu_flags
    assert ("/cpu-amx/" in info["kv_layout"]) == ("amx_bf16" in cpu_flags()), info["kv_layout"]
    out = subprocess.run([sys.executable, "-m", "tierkv.cli", "store", "stats", str(root)], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert info["dtype"] in out.stdout and infos[0].parent.name[:8] in out.stdout, out.stdout


# ------------------------------------------------------------------ a file L3 at capacity (recycled record files)
CAP_PAGES = 16


@pytest.fixture(scope="module")
def full_store(runs, tiny_model, tmp_path_factory):
    """Engine 1 of a second pair runs the first round into a file store of 16 records (26 pages: 10 evictions,
    each evicted file overwritten by a later backup, ``recycle_evicted``), engine 2 the second round in reverse
    order, so the two documents still in the store come first (in the original order each miss's backups would
    evict the next document's pages before it is asked for: LRU at work, no hit to check)."""
    first, again, _ref, e1, _e2 = runs
    record = next(e1["l3_root"].glob("*/*/*.page")).stat().st_size
    root = tmp_path_factory.mktemp("l3_full")
    cfg = _tier_config(root)
    cfg["kv_connector_extra_config"]["l3"]["file"]["capacity_bytes"] = CAP_PAGES * record
    kw = dict(kv_transfer_config=cfg, num_gpu_blocks_override=MAX_LEN // P + 2, max_tokens=6,
              extra_engine_args={"max_model_len": MAX_LEN})
    f1 = run_job(tiny_model, [{"name": "first", "prompts": first}], workdir=tmp_path_factory.mktemp("f1"), **kw)
    f2 = run_job(tiny_model, [{"name": "again", "prompts": again[::-1]}], workdir=tmp_path_factory.mktemp("f2"),
                 **kw)
    return root, f1, f2


def test_a_full_file_store_serves_what_it_kept_bit_exact_and_leaves_no_spare(runs, full_store):
    first, again, ref, _e1, _e2 = runs
    root, f1, f2 = full_store
    assert f1["workloads"]["first"]["outputs"] == ref["workloads"]["first"]["outputs"]
    assert f2["workloads"]["again"]["outputs"] == ref["workloads"]["again"]["outputs"][::-1]
    pages = [len(p) // P for p in first]                  # pages each document left in L3, in write order
    assert sum(pages) > CAP_PAGES >= pages[-1] + pages[-2]
    want = ref["workloads"]["again"]["num_cached_tokens"][::-1]
    # the last two documents of round 1 are whole in the store: loaded from L3; the others were evicted
    assert f2["workloads"]["again"]["num_cached_tokens"] == want[:2] + [0, 0]
    s = stats_by_role(f2)
    assert s["scheduler"]["ctl_l3_hit_tokens"] == sum(want[:2])
    assert s["worker"]["l3_prefetch_failed_pages"] == 0 and s["worker"]["failed_load_blocks"] == 0
    records = list(root.glob("*/*/*.page"))
    spares = [p for p in root.rglob(".tmp.*")]
    assert len(records) == CAP_PAGES and spares == []    # at capacity; no spare left behind by either engine
    assert f1["leaked_processes"] == 0 and f2["leaked_processes"] == 0
