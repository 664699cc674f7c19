"""A hybrid model in the real engine: Gemma-3 shape (``gemma`` preset of ``examples/make_tiny_model.py``: 4 layers
alternating a 64-token sliding window and full attention), served by vLLM's CPU backend with tierkv, an L2 and a file
L3; one engine process.

tierkv is ``SupportsHMA``, so vLLM keeps its hybrid KV cache manager on: a sliding-window and a full-attention KV cache
group, each with its own block table (the sliding-window one holds vLLM's null block before the window). tierkv stores
each page with all four layers and a hit loads, per group, the blocks vLLM allocated: every page of the
full-attention layers, only the window's pages of the sliding-window layers. The documents (5 pages, 2.5 windows) are
served once, then again reusing them from the engine's own L1 (the reference); with L1 dropped they come from L2, and
with L2 flushed too from the file L3. Outputs from L2 and from L3 equal the reference bit for bit (greedy), every
document token comes from tierkv, no load fails, and the bytes loaded are those of the window rule. The manager-off
case (one group, every layer kept for every token) is covered in ``tests/connector/vllm/test_hybrid_geometry.py``.
"""
import importlib.util
import json
import random
from pathlib import Path

import pytest

from tests.helpers.engine import REPO_ROOT, run_job, stats_by_role, tierkv_kv_config

P = 32                      # tokens per page = engine block
DOC_PAGES = 5               # > 2 sliding windows of 64 tokens
L1_BLOCKS = 48              # shared by the 2 KV cache groups: blocks of 2 layers, the bytes of 24 of 4 layers
L2_PAGES = 16
LAYERS, KV_HEADS, HEAD_DIM = 4, 2, 32


@pytest.fixture(scope="module")
def gemma_model() -> str:
    spec = importlib.util.spec_from_file_location("tierkv_make_tiny_model", REPO_ROOT / "examples" / "make_tiny_model.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.make_model(REPO_ROOT / "models" / "gemma", "gemma", quiet=True)


@pytest.fixture(scope="module")
def run(gemma_model, tmp_path_factory):
    rng = random.Random(3)
    vocab = lambda n: [rng.randrange(10, 2000) for _ in range(n)]
    docs = [vocab(DOC_PAGES * P) for _ in range(2)]
    first = [d + vocab(rng.randrange(3, 12)) for d in docs]
    second = [d + vocab(rng.randrange(3, 12)) for d in docs]
    flush_l2 = [vocab(7 * P + 5) for _ in range(2)]      # 14 new pages: with the documents' 10, more than L2 holds
    root = tmp_path_factory.mktemp("l3")
    cfg = {"host_pool": {"num_pages": L2_PAGES}, "verify_checksums": True,
           "l3": {"backend": "file", "file": {"root": str(root)}},
           "controller": {"write_policy": "write_through", "prefetch_policy": "wait_complete"}}
    workloads = [{"name": "first", "prompts": first}, {"name": "second_l1", "prompts": second},
                 {"name": "drop_l1", "reset_prefix_cache": True}, {"name": "second_l2", "prompts": second},
                 {"name": "flush_l2", "prompts": flush_l2}, {"name": "drop_l1_again", "reset_prefix_cache": True},
                 {"name": "second_l3", "prompts": second}]
    res = run_job(gemma_model, workloads, kv_transfer_config=tierkv_kv_config(cfg, load_failure_policy="recompute"),
                  num_gpu_blocks_override=L1_BLOCKS, extra_engine_args={"max_model_len": 736}, max_tokens=4,
                  workdir=tmp_path_factory.mktemp("engine"))
    return dict(res, root=root)


def _external(w):
    return w["vllm_counters"].get("vllm:external_prefix_cache_hits", 0)


def test_a_sliding_window_and_full_attention_model_hits_from_l2_and_file_l3_bit_identical_to_l1_reuse(run):
    w = run["workloads"]
    doc = [DOC_PAGES * P] * 2
    ref = w["second_l1"]
    assert ref["num_cached_tokens"] == doc and _external(ref) == 0          # the reference: vLLM's own L1
    assert w["first"]["outputs"] != ref["outputs"]                           # other questions, other answers
    for tier in ("second_l2", "second_l3"):
        assert w[tier]["outputs"] == ref["outputs"], tier
        assert w[tier]["num_cached_tokens"] == doc, tier
        assert _external(w[tier]) == sum(doc), tier                          # every reused token from tierkv
        assert w[tier]["vllm_counters"]["vllm:prefix_cache_hits"] == 0, tier
    assert w["second_l2"]["vllm_counters"]["vllm:tierkv_l2_hit_tokens"] == sum(doc)
    assert w["second_l3"]["vllm_counters"]["vllm:tierkv_ctl_l3_hit_tokens"] == sum(doc)
    worker = stats_by_role(run)["worker"]
    assert worker["failed_load_blocks"] == 0 and worker["checksum_mismatches"] == 0
    assert run["leaked_processes"] == 0


def test_pages_hold_every_layer_and_a_hit_loads_only_the_window_of_sliding_window_layers(run):
    layer_block = 2 * P * KV_HEADS * HEAD_DIM * 2                           # K,V of one block of one layer, bf16
    worker = stats_by_role(run)["worker"]
    assert worker["page_bytes"] == LAYERS * layer_block                     # every layer in each page
    # each L2 hit of a 5-page document: 5 pages x 2 full-attention layers, and of the 2 sliding-window layers only
    # the 2 pages inside the 64-token window before the hit's end (vLLM's null block before it)
    per_doc = (DOC_PAGES * 2 + 2 * 2) * layer_block
    assert worker["load_bytes"] == 2 * per_doc
    (info,) = run["root"].glob("*/namespace.json")
    assert ["local_attention_kv", "per_group"] in json.loads(info.read_text())["extra"]
    log = Path(run["log_path"]).read_text()
    assert "Turning off hybrid kv cache manager" not in log                  # vLLM kept it on
    assert (" | hybrid model: 2 of 4 layers attend a 64-token sliding window; vLLM's hybrid KV cache manager is on: "
            "every page is stored with every layer, and a hit loads those layers' blocks inside the window only"
            ) in log
