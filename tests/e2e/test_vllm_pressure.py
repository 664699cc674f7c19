"""Real engine under pressure: a batch that makes vLLM preempt, an L2 far smaller than the working set
(eviction, skipped saves), and layer-by-layer loading. Nothing may leak, hang or load a wrong byte."""
import random

from _engine import run_job, stats_by_role, tierkv_kv_config

P = 32


def test_preemption_eviction_layerwise(tiny_model, tmp_path):
    rng = random.Random(99)
    docs = [[rng.randrange(10, 1000) for _ in range(n)] for n in (160, 192, 224, 200)]
    batch = [d + [rng.randrange(10, 1000) for _ in range(rng.randrange(1, 20))] for d in docs * 2]
    tail = [d + [7, 7, 7] for d in docs]
    res = run_job(
        tiny_model,
        [{"name": "batch", "prompts": batch, "sequential": False, "max_tokens": 96},
         {"name": "again", "prompts": tail, "sequential": True, "max_tokens": 4}],
        kv_transfer_config=tierkv_kv_config({"host_pool": {"num_pages": 14}, "verify_checksums": True,
                                             "layerwise_load": True}, load_failure_policy="recompute"),
        num_gpu_blocks_override=20, max_tokens=8, extra_engine_args={"max_model_len": 512},
        workdir=tmp_path)
    b, a = res["workloads"]["batch"], res["workloads"]["again"]
    assert [len(o) for o in b["outputs"]] == [96] * len(batch)
    assert [len(o) for o in a["outputs"]] == [4] * len(tail)
    s = stats_by_role(res)
    sched, worker = s["scheduler"], s["worker"]
    print("scheduler", sched, "\nworker", worker)
    assert sched["num_slots"] == 14
    assert sched["evicted_pages"] > 0 or sched["save_skipped_pages"] > 0   # L2 really was too small
    assert sched["locked_pages"] == 0 and sched["live_requests"] == 0
    assert sched["free_slots"] + sched["l2_pages"] == 14
    assert worker["checksum_mismatches"] == 0 and worker["failed_load_blocks"] == 0
    assert worker["verified_pages"] == worker["load_pages"]
    assert res["leaked_processes"] == 0
