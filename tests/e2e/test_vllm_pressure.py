"""Real engine under pressure: a batch that makes vLLM preempt, an L2 far smaller than the working set
(eviction), and layer-by-layer loading that really loads. Nothing may leak, hang or load a wrong byte.

Workload: 4 documents of 5-7 pages, each asked twice in one batch of 8 (96 generated tokens each) with an L1 of 20
blocks: vLLM runs a few requests at a time and preempts some; the second copy of each document finds its pages in L2
(tierkv's ``load_pages``, loaded layer by layer). Then each document is asked once more, one request at a time: L1 has
long dropped them, so every full page of each prompt comes from L2. L2 holds 40 pages, fewer than the distinct full
pages the batch computes (documents plus decoded tails, 48 here; asserted > 40): L2 evicts, the deepest pages first, so
the shared document pages, ancestors of the decoded tails, stay (docs/architecture.md, "The structures").
(With 14 pages, as before, eviction also took the document pages and nothing was ever loaded.)
"""
import random

from tests.helpers.engine import run_job, stats_by_role, tierkv_kv_config

P = 32
L2_PAGES = 40


def test_preemption_eviction_layerwise(tiny_model, tmp_path):
    rng = random.Random(99)
    docs = [[rng.randrange(10, 1000) for _ in range(n)] for n in (160, 192, 224, 200)]
    batch = [d + [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 20))] for d in docs * 2]
    tail = [d + [7, 7, 7] for d in docs]
    res = run_job(
        tiny_model,
        [{"name": "batch", "prompts": batch, "sequential": False, "max_tokens": 96},
         {"name": "again", "prompts": tail, "sequential": True, "max_tokens": 4}],
        kv_transfer_config=tierkv_kv_config({"host_pool": {"num_pages": L2_PAGES}, "verify_checksums": True,
                                             "layerwise_load": True}, load_failure_policy="recompute"),
        num_gpu_blocks_override=20, max_tokens=8, extra_engine_args={"max_model_len": 512},
        workdir=tmp_path)
    b, a = res["workloads"]["batch"], res["workloads"]["again"]
    assert [len(o) for o in b["outputs"]] == [96] * len(batch)
    assert [len(o) for o in a["outputs"]] == [4] * len(tail)
    s = stats_by_role(res)
    sched, worker = s["scheduler"], s["worker"]
    bc, ac = b["vllm_counters"], a["vllm_counters"]
    print("scheduler", sched, "\nworker", worker)
    assert sched["num_slots"] == L2_PAGES
    line = [ln for ln in open(res["log_path"], errors="replace") if "tierkv: L1 20 blocks" in ln]
    assert len(line) == 1 and "verify_checksums=True, layerwise_load=True," in line[0], line
    # vLLM preempted, and tierkv saw every preemption
    assert sched["preemptions"] == bc["vllm:num_preemptions"] > 0
    assert ac["vllm:num_preemptions"] == 0
    # L2 really was too small: it evicted, and what it holds is what it saved less what it evicted
    assert sched["evicted_pages"] > 0
    assert sched["l2_pages"] == sched["save_pages"] - sched["evicted_pages"]
    assert sched["save_pages"] == worker["save_pages"] > L2_PAGES
    # the repeated documents: every full page of each prompt from L2, none from L1
    assert a["num_cached_tokens"] == [((len(t) - 1) // P) * P for t in tail]
    assert ac["vllm:prefix_cache_hits"] == 0
    assert ac["vllm:external_prefix_cache_hits"] == sum(a["num_cached_tokens"]) == ac["vllm:tierkv_l2_hit_tokens"]
    # the batch: tokens reused are L1 hits plus L2 hits, and vLLM counted the L2 ones as the connector's
    assert sum(b["num_cached_tokens"]) == bc["vllm:prefix_cache_hits"] + bc["vllm:external_prefix_cache_hits"]
    assert bc["vllm:external_prefix_cache_hits"] == bc["vllm:tierkv_l2_hit_tokens"] > 0
    # layer-wise loads really ran, each page verified against its save checksum, none failed
    assert sched["l2_hit_tokens"] == bc["vllm:tierkv_l2_hit_tokens"] + ac["vllm:tierkv_l2_hit_tokens"]
    assert worker["load_pages"] == sched["load_pages"] == sched["l2_hit_tokens"] // P > 0
    assert worker["verified_pages"] == worker["load_pages"]
    assert worker["checksum_mismatches"] == 0 and worker["failed_load_blocks"] == 0
    assert worker["load_bytes"] == worker["load_pages"] * worker["page_bytes"]
    assert sched["locked_pages"] == 0 and sched["live_requests"] == 0
    assert sched["free_slots"] + sched["l2_pages"] == L2_PAGES
    assert res["leaked_processes"] == 0
