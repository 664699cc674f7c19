"""Speculative decoding in the real engine: vLLM's CPU backend with n-gram speculative decoding
(``speculative_config={"method": "ngram", ...}``; vLLM turns async scheduling off for it) and tierkv with an L2, one
engine process.

Round 1 sends prompts that repeat a short pattern (so n-gram drafts are proposed and some accepted) and decodes
enough tokens to fill pages while decoding. Round 2 extends each round-1 prompt by its own output and a short tail:
first right away (vLLM reuses round 1's blocks from its L1: the reference), then, after ``reset_prefix_cache``,
again (every reused token must come from tierkv's L2, decoded pages included). Outputs are equal bit for bit
(greedy), and every page tierkv stored in round 1 is loaded in round 2: pages stored only for verified tokens, under
the keys of the final tokens, so none is stored and never served (vLLM #52735).
"""
import pytest

from tests.helpers.engine import run_job, stats_by_role, tierkv_kv_config

P = 32
PROMPT_LEN = 72
MAX_TOKENS = 64              # PROMPT_LEN + MAX_TOKENS = 4 pages + 8 tokens
TAIL = 3
ROUND2_TOKENS = 8            # round 2 computes up to 4 pages + 8 + 3 + 7 tokens: no new full page
SPEC = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}


def _prompts():
    first = [[10 + i] + [100 + 8 * i + j for j in range(7)] * 10 + [50 + i] for i in range(3)]
    tails = [[900 + i, 901 + i, 902 + i] for i in range(3)]
    assert all(len(p) == PROMPT_LEN for p in first) and all(len(t) == TAIL for t in tails)
    return first, tails


@pytest.fixture(scope="module")
def run(tiny_model, tmp_path_factory):
    first, tails = _prompts()
    workloads = [{"name": "first", "prompts": first, "sequential": False},
                 {"name": "second_l1", "prompts": tails, "extend": "first", "max_tokens": ROUND2_TOKENS},
                 {"name": "reset", "reset_prefix_cache": True},
                 {"name": "second_l2", "prompts": tails, "extend": "first", "max_tokens": ROUND2_TOKENS}]
    return run_job(tiny_model, workloads, kv_transfer_config=tierkv_kv_config({"host_pool": {"num_pages": 64}}),
                   num_gpu_blocks_override=64, max_tokens=MAX_TOKENS, extra_engine_args={"speculative_config": SPEC},
                   workdir=tmp_path_factory.mktemp("spec"))


def _c(w, name):
    return w["vllm_counters"].get(name, 0)


def test_ngram_drafts_are_proposed_and_accepted(run):
    w = run["workloads"]["first"]
    assert all(len(o) == MAX_TOKENS for o in w["outputs"])
    assert _c(w, "vllm:spec_decode_num_draft_tokens") > 0
    assert _c(w, "vllm:spec_decode_num_accepted_tokens") > 0


def test_pages_written_while_decoding_hit_from_l2_and_outputs_equal_l1_reuse(run):
    w = run["workloads"]
    reused = [(PROMPT_LEN + MAX_TOKENS) // P * P] * 3       # every full page of round 1's prompt and output
    ref, l2 = w["second_l1"], w["second_l2"]
    assert ref["num_cached_tokens"] == reused and _c(ref, "vllm:external_prefix_cache_hits") == 0
    assert l2["num_cached_tokens"] == reused
    assert _c(l2, "vllm:prefix_cache_hits") == 0                 # nothing from vLLM's L1 after the reset
    assert _c(l2, "vllm:external_prefix_cache_hits") == sum(reused)
    assert _c(l2, "vllm:tierkv_l2_hit_tokens") == sum(reused)
    assert l2["outputs"] == ref["outputs"]


def test_every_page_stored_under_speculative_decoding_is_loaded_on_the_repeated_workload(run):
    sched, worker = stats_by_role(run)["scheduler"], stats_by_role(run)["worker"]
    pages = 3 * ((PROMPT_LEN + MAX_TOKENS) // P)                 # 2 prompt pages + 2 decoded pages per request
    assert sched["save_pages"] == worker["save_pages"] == pages  # round 1 only: round 2 adds no full page
    assert sched["load_pages"] == worker["load_pages"] == pages  # stored but never loaded: save - load = 0
    assert worker["failed_load_blocks"] == 0 and worker["checksum_mismatches"] == 0
