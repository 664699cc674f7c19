"""``benchmarks.serve_cpu``'s ``trace`` workload (a window of Mooncake's conversation trace as vLLM ``timed_trace``)
and its bounded-L3 configurations (eviction policy and L3 admission on a small file store)."""
import pytest

from benchmarks import make_multiturn_trace
from benchmarks.serve_cpu import client, configs, report
from benchmarks.serve_cpu import trace as mooncake

# three conversations: key 5 (turns at 0, 3), key 9 (1, 4), key 12 (2); every request starts with the shared id 0
ROWS = [{"hash_ids": [0, 5, 6]}, {"hash_ids": [0, 9]}, {"hash_ids": [0, 12, 13, 14]},
        {"hash_ids": [0, 5, 6, 7, 8]}, {"hash_ids": [0, 9, 10, 11]}]


def test_ids_map_one_to_one_to_full_chunks_offset_by_the_seed_and_cut_to_fit_the_model():
    picked = mooncake.window(ROWS, offset=0, requests=5, sample=1)
    assert [i for i, _ in picked] == [0, 1, 2, 3, 4]
    # max_model_len 150, output 16: (150 - 16) // 32 = 4 pages of prompt at most
    rows = mooncake.to_timed_trace(picked, seed=3, max_model_len=150, output_len=16)
    base = 3 * 10 ** 9
    assert [r["hash_ids"] for r in rows] == [[base, base + 5, base + 6], [base, base + 9],
                                             [base, base + 12, base + 13, base + 14],
                                             [base, base + 5, base + 6, base + 7], [base, base + 9, base + 10, base + 11]]
    assert [r["input_length"] for r in rows] == [96, 64, 128, 128, 128]
    assert all(r["output_length"] == 16 and r["input_length"] + 16 <= 150 for r in rows)
    assert rows == mooncake.to_timed_trace(picked, seed=3, max_model_len=150, output_len=16)
    # equal trace ids give equal chunk ids in every request: the prefix of request 0 is request 3's
    assert rows[3]["hash_ids"][:3] == rows[0]["hash_ids"]
    other = mooncake.to_timed_trace(picked, seed=4, max_model_len=150, output_len=16)
    assert not {h for r in rows for h in r["hash_ids"]} & {h for r in other for h in r["hash_ids"]}
    st = mooncake.reuse_stats(rows)
    # 17 pages sent, 10 distinct (0, 5-7, 9-11, 12-14; 8 was cut): 7 pages an earlier request already sent
    assert st == {"requests": 5, "prompt_pages": 17, "distinct_pages": 10, "reusable_tokens": 7 * 32,
                  "trace_indices": [0, 4]}
    with pytest.raises(ValueError):
        mooncake.to_timed_trace(picked, seed=0, max_model_len=40, output_len=16)


def test_the_window_keeps_whole_conversations_from_the_offset_and_refuses_a_short_trace():
    key = {k: (k * 2654435761) % (1 << 32) % 2 for k in (5, 9, 12)}
    kept = [i for i, r in enumerate(ROWS) if key[r["hash_ids"][1]] == 0]
    assert 0 < len(kept) < len(ROWS)  # the sample drops some conversation and keeps another
    picked = mooncake.window(ROWS, offset=0, requests=len(kept), sample=2)
    assert [i for i, _ in picked] == kept
    assert [ids for _, ids in picked] == [ROWS[i]["hash_ids"] for i in kept]
    assert [i for i, _ in mooncake.window(ROWS, offset=2, requests=2, sample=1)] == [2, 3]
    with pytest.raises(ValueError, match="not 4"):
        mooncake.window(ROWS, offset=2, requests=4, sample=1)


def test_the_real_windows_fit_the_model_and_reuse_pages():
    for p in (configs.QUICK, configs.FULL):
        rows = mooncake.make_trace(p, 1)
        st = mooncake.reuse_stats(rows)
        assert st["requests"] == p["tr_requests"] == len(rows)
        assert max(r["input_length"] for r in rows) + p["tr_output_len"] <= p["max_model_len"]
        assert 0.1 < st["reusable_tokens"] / (32 * st["prompt_pages"]) < 0.5
        # rows are the window's requests in trace order, their first ids as in the file
        src = mooncake.load()
        for r in rows[:5]:
            n = len(r["hash_ids"])
            assert [h - 10 ** 9 for h in r["hash_ids"]] == src[r["trace_index"]]["hash_ids"][:n]


def test_the_trace_workload_replays_its_file_as_timed_trace_closed_loop(tmp_path):
    p = dict(configs.QUICK)
    args = client.workload_args(p, "trace", 11, tmp_path / "t.jsonl")
    assert args == ["--dataset-name", "timed_trace", "--dataset-path", str(tmp_path / "t.jsonl"),
                    "--timed-trace-chunk-hash-size", "32", "--no-self-timed", "--num-prompts", str(p["tr_requests"]),
                    "--seed", "11"]
    assert "trace" in configs.WORKLOADS and client.run_seed("trace", 4, 0) != client.run_seed("multiturn", 4, 0)


def test_client_prompts_of_the_trace_repeat_the_pages_of_equal_ids(tmp_path):
    """vLLM's own timed_trace turns the file into these prompts: equal ids, equal 32-token chunks (PYTHONHASHSEED
    fixed by the client environment; within one process equal anyway)."""
    from benchmarks import harness

    model_dir = harness.make_tiny_model().make_model(tmp_path / "m", "test", quiet=True)
    rows = mooncake.make_trace(configs.QUICK, 5)
    path = make_multiturn_trace.write_trace(tmp_path / "t.jsonl", rows)
    prompts = client.client_prompts(model_dir, client.workload_args(configs.QUICK, "trace", 5, path))
    assert [len(x) for x in prompts] == [r["input_length"] for r in rows]
    chunks = {}
    for prompt, r in zip(prompts, rows):
        for k, h in enumerate(r["hash_ids"]):
            chunks.setdefault(h, prompt[32 * k:32 * k + 32])
            assert prompt[32 * k:32 * k + 32] == chunks[h]
    assert len({tuple(c) for c in chunks.values()}) == len(chunks) == mooncake.reuse_stats(rows)["distinct_pages"]


#: what each bounded-L3 configuration must carry (eviction policy of index/L2 and L3, L3 admission)
SMALL = {"tierkv_l3_file_small": ("lru", "always"), "tierkv_l3_file_small_s3fifo": ("s3fifo", "always"),
         "tierkv_l3_file_small_slru": ("slru", "always"), "tierkv_l3_file_small_lfu": ("lfu", "always"),
         "tierkv_l3_file_small_second_sight": ("lru", "second_sight"),
         "tierkv_l3_file_small_reused_in_l2": ("lru", "reused_in_l2")}


@pytest.mark.parametrize("name", sorted(SMALL))
def test_each_bounded_l3_configuration_carries_its_policy_admission_and_bound(name, tmp_path, monkeypatch):
    from tierkv.connector.core.config import config_from_extra

    monkeypatch.setattr(configs, "SERVER_DTYPE", ["float32"])
    p = dict(configs.FULL)
    extra = configs.kv_config(name, p, tmp_path, None, l3_root=str(tmp_path / "l3"))["kv_connector_extra_config"]
    pol, adm = SMALL[name]
    # the keys are set, not left to defaults: lru / always are the defaults too
    assert (extra["eviction_policy"], extra["l3.file.eviction_policy"], extra["l3.admission"]) == (pol, pol, adm)
    cfg = config_from_extra(extra)
    assert (cfg.eviction_policy, cfg.l3.file["eviction_policy"], cfg.l3.admission) == (pol, pol, adm)
    assert cfg.l3.backend == "file" and cfg.host_pool.num_pages == p["small_l2_pages"] == 128
    # demo model in float32: 2 (K, V) x 4 layers x 2 KV heads x 64 x 32 tokens x 4 bytes, and a 64-byte header
    assert cfg.l3.file["capacity_bytes"] == 384 * (131072 + 64) == p["l3_small_pages"] * (131072 + 64)
    assert name in configs.CONFIGS and name in configs.CONFIG_TEXT and name in report.TARGETS


def test_the_bound_holds_part_of_each_workloads_distinct_pages():
    """About half of a multiturn run's distinct pages and a third of a trace run's fit the bounded L3, and L2 holds
    less than L3, in both sizes: so evictions happen and the policy decides which pages stay."""
    for p in (configs.QUICK, configs.FULL):
        mt = make_multiturn_trace.reuse_stats(make_multiturn_trace.make_trace(
            seed=1, conversations=p["mt_conversations"], turns=p["mt_turns"], first_chunks=p["mt_first_chunks"],
            turn_chunks=p["mt_turn_chunks"], output_len=p["mt_output_len"]))["distinct_blocks"]
        tr = mooncake.reuse_stats(mooncake.make_trace(p, 1))["distinct_pages"]
        assert 0.4 < p["l3_small_pages"] / mt < 0.6 and 0.25 < p["l3_small_pages"] / tr < 0.4
        assert p["small_l2_pages"] <= p["l3_small_pages"] / 2


def test_a_run_records_the_l3_hit_tokens_whose_read_failed_apart():
    """A bounded store evicts pages the index still lists: the lookup counts them as L3 hits, the read fails and the
    engine recomputes them; the run keeps those tokens apart (``l3_failed``) so that loaded = l3_hit - l3_failed."""
    delta = {"vllm:tierkv_ctl_l3_hit_tokens_total": 672.0, "vllm:tierkv_lookup_failed_tokens_total": 96.0,
             "vllm:prompt_tokens_total": 12576.0}
    t = client.summarise_run({"completed": 24}, delta, None)["tokens"]
    assert (t["prompt"], t["l3_hit"], t["l3_failed"], t["l2_hit"]) == (12576, 672, 96, 0)
