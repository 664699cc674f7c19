"""Pages of several blocks in the real engine: ``page_size: 64`` over vLLM's block size 32, one engine process with an
L2 of 12 pages and a file L3 (write_through).

Round ``a`` computes two prompts of 4 pages and a tail shorter than a page; ``a_l1`` sends them again (vLLM reuses
every full block from its own L1: the reference). After ``reset_prefix_cache`` a short prompt ``y`` (the first 3
blocks of prompt 0 and 5 tokens) loads page 0 from L2 and computes block 2, so vLLM holds 3 blocks, one and a half
pages, of prompt 0 in L1; ``a_l2`` then hits prompt 0 from its third block (the second block of page 1) and prompt
1 from its first, from L2. Round ``b`` computes two other prompts whose pages push ``a``'s out of the 12-page L2
(the controller keeps a quarter of it free); after another reset ``a_l3`` hits both prompts from the file L3. Outputs equal ``a_l1`` bit for bit (greedy).
"""
import random

import pytest

from tests.helpers.engine import run_job, stats_by_role, tierkv_kv_config

BLOCK, PAGE = 32, 64
FULL = 4 * PAGE              # the full pages of each prompt
TAIL = 10                    # tokens after them (shorter than a page: never saved)
HELD = 3 * BLOCK             # prompt 0's blocks in vLLM's L1 when a_l2 starts


def _prompts():
    rng = random.Random(2064)
    doc = lambda: [rng.randrange(10, 1000) for _ in range(FULL + TAIL)]
    a, b = [doc(), doc()], [doc(), doc()]
    return a, b, [a[0][:HELD] + [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    a, b, y = _prompts()
    root = tmp_path_factory.mktemp("l3")
    cfg = {"page_size": PAGE, "host_pool": {"num_pages": 12}, "verify_checksums": True,
           "l3": {"backend": "file", "file": {"root": str(root)}},
           "controller": {"write_policy": "write_through", "prefetch_policy": "wait_complete"}}
    workloads = [{"name": "a", "prompts": a}, {"name": "a_l1", "prompts": a},
                 {"name": "reset1", "reset_prefix_cache": True},
                 {"name": "y", "prompts": y}, {"name": "a_l2", "prompts": a},
                 {"name": "b", "prompts": b},
                 {"name": "reset2", "reset_prefix_cache": True},
                 {"name": "a_l3", "prompts": a}]
    res = run_job(tiny_model, workloads, kv_transfer_config=tierkv_kv_config(cfg, load_failure_policy="recompute"),
                  num_gpu_blocks_override=64, max_tokens=8, extra_engine_args={"max_model_len": 512},
                  workdir=tmp_path_factory.mktemp("multiblock"))
    res["l3_root"] = root
    return res


def _c(w, name):
    return w["vllm_counters"].get(name, 0)


def test_l2_hits_of_two_block_pages_equal_l1_reuse_including_a_hit_starting_inside_a_page(run):
    w = run["workloads"]
    ref, l2 = w["a_l1"], w["a_l2"]
    assert ref["num_cached_tokens"] == [FULL, FULL] and _c(ref, "vllm:external_prefix_cache_hits") == 0
    assert w["y"]["num_cached_tokens"] == [PAGE]           # y: page 0 from L2, block 2 computed
    assert l2["num_cached_tokens"] == [FULL, FULL]
    assert _c(l2, "vllm:prefix_cache_hits") == HELD         # prompt 0's 3 blocks from vLLM's L1
    assert _c(l2, "vllm:external_prefix_cache_hits") == (FULL - HELD) + FULL
    assert _c(l2, "vllm:tierkv_l2_hit_tokens") == (FULL - HELD) + FULL
    assert l2["outputs"] == ref["outputs"]


def test_l3_hits_of_two_block_pages_equal_l1_reuse(run):
    w = run["workloads"]
    ref, l3 = w["a_l1"], w["a_l3"]
    assert l3["num_cached_tokens"] == [FULL, FULL]
    assert _c(l3, "vllm:prefix_cache_hits") == 0
    assert _c(l3, "vllm:external_prefix_cache_hits") == 2 * FULL
    assert l3["outputs"] == ref["outputs"]
    sched = stats_by_role(run)["scheduler"]
    assert sched["ctl_l3_hit_tokens"] == 2 * FULL, sched  # both prompts needed L3: b pushed a out of L2


def test_pages_are_whole_two_block_records_and_the_tokens_loaded_are_counted(run):
    s = stats_by_role(run)
    sched, worker = s["scheduler"], s["worker"]
    # a and b: 4 full pages each, every one saved once, backed up as one L3 record of two blocks
    assert sched["save_pages"] == worker["save_pages"] == 16
    assert worker["l3_backup_pages"] == sched["ctl_backup_stored_pages"] == 16
    assert worker["page_bytes"] * 16 == worker["save_bytes"]
    records = [p for p in run["l3_root"].rglob("*") if p.is_file() and p.stat().st_size >= worker["page_bytes"]]
    assert len(records) == 16
    # loaded: y page 0 (1 page), a_l2 pages 1-3 of prompt 0 (its first block of page 1 was in L1) and 4 of prompt 1
    # from L2, a_l3 8 pages from L3
    assert worker["load_pages"] == 1 + 3 + 4
    assert worker["load_bytes"] == (2 + 5 + 8) * worker["page_bytes"] // 2
    assert worker["async_load_pages"] == 8
    assert worker["failed_load_blocks"] == 0 and worker["checksum_mismatches"] == 0
    assert run["leaked_processes"] == 0
