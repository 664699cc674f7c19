"""Hybrid models with vLLM's hybrid KV cache manager on (``SupportsHMA``): pages through the connector's scheduler and
worker hooks, with vLLM's own KV cache specs and groups (``get_kv_cache_groups``) of a Gemma-3 shape (4 layers
alternating a 64-token sliding window and full attention: one sliding-window and one full-attention group) and KV
tensors shared by one layer of each group, as vLLM allocates them.

Block ids are per group (one block pool, so never the same id in two groups); a sliding-window group's table holds
vLLM's null block (0) before the window. The rule (:func:`tierkv.connector.core.plan.live_blocks`): a page is stored with
every layer when all its blocks are live; a hit copies each group's live blocks only, so a hit that ends past two
windows loads only the window's blocks of the sliding-window layers, and block 0 is never read or written.
"""
import json
from types import SimpleNamespace

import pytest
import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

from tierkv.connector.vllm.connector import TierKVConnector
from tests.helpers.vllm_parts import BLOCK, HEAD_DIM, KV_HEADS, SCHEDULER, WORKER, TierkvLoggerState, vllm_config

WINDOW = 64
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
SW_LAYERS, FULL_LAYERS = (0, 2), (1, 3)
NUM_BLOCKS = 48
LAYER_BLOCK = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2          # K and V of one block of one layer, bf16
DOC = 5 * BLOCK                                             # 5 pages: a hit ending there is past 2 windows


@pytest.fixture
def engine(tmp_path, monkeypatch):
    """(scheduler connector, worker connector, KV tensors by layer, group order) of one engine: a Gemma-3 text
    config, vLLM's groups with the hybrid KV cache manager on, KV tensors [blocks, H, N, 2D] bf16 shared by
    layers 0/1 and 2/3 (a sliding-window and a full-attention layer each, as vLLM shares them)."""
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    state = TierkvLoggerState()
    d = tmp_path / "gemma"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 16,
        "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": 4, "vocab_size": 256, "max_position_embeddings": 1024, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "query_pre_attn_scalar": HEAD_DIM,
        "torch_dtype": "bfloat16"}))
    made = {}

    def build(extra=None):
        vc = vllm_config(str(d), {"host_pool.num_pages": 16, "verify_checksums": True, **(extra or {})})
        vc.scheduler_config.disable_hybrid_kv_cache_manager = False
        layout, vc.cache_config.kv_cache_layout = vc.cache_config.kv_cache_layout, "NHD"  # resolved before grouping
        full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
        swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
                                sliding_window=WINDOW)
        groups = get_kv_cache_groups(vc, {n: (swa if i in SW_LAYERS else full) for i, n in enumerate(NAMES)})
        vc.cache_config.kv_cache_layout = layout  # the CPU backend's own layout for its tensors
        kcc = KVCacheConfig(num_blocks=NUM_BLOCKS, kv_cache_tensors=[], kv_cache_groups=groups)
        s = TierKVConnector(vc, SCHEDULER, kcc)
        w = TierKVConnector(vc, WORKER, kcc)
        g = torch.Generator().manual_seed(1)
        shared = [torch.randn(NUM_BLOCKS, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=g).to(torch.bfloat16)
                  for _ in range(2)]
        caches = {n: shared[i // 2] for i, n in enumerate(NAMES)}
        w.register_kv_caches(caches)
        kinds = [type(gr.kv_cache_spec).__name__ for gr in groups]
        made.update(s=s, w=w, caches=caches, kinds=kinds)
        return s, w, caches, kinds

    yield build
    state.restore()


def request(rid: str, tokens: list[int]):
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, lora_request=None, cache_salt=None,
                           kv_transfer_params=None, skip_reading_prefix_cache=False, num_prompt_tokens=len(tokens))


def table(kinds, sw: list[int], full: list[int]) -> tuple[list[int], ...]:
    """The request's block table per group, in vLLM's group order."""
    return tuple(list(sw) if k == "SlidingWindowSpec" else list(full) for k in kinds)


def blocks_of(ids):
    return SimpleNamespace(get_block_ids=lambda: ids)


def step_output(new: list[tuple[str, int, tuple]]):
    """A SchedulerOutput of new requests ``(id, tokens computed after the step, block table)`` (computed from 0)."""
    return SimpleNamespace(
        preempted_req_ids=[], num_scheduled_tokens={rid: n for rid, n, _t in new},
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda rid: {r: t for r, _n, t in new}[rid]),
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=0, block_ids=t) for rid, _n, t in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]), scheduled_spec_decode_tokens={})


def worker_step(w, plan, finished=()):
    """One worker step as vLLM's model runner drives it; returns (transfer results, load errors)."""
    w.bind_connector_metadata(plan)
    w.start_load_kv(None)
    for name in NAMES:
        w.wait_for_layer_load(name)
    w.wait_for_save()
    res = w.get_transfer_results(set(finished))
    errors = w.get_block_ids_with_load_errors()
    w.clear_connector_metadata()
    return res, errors


def block(caches, layer: int, b: int) -> torch.Tensor:
    return caches[NAMES[layer]][b].clone()


def save_document(s, w, caches, kinds, tail=7, saved_blocks=5):
    """Request "a": the document and a tail, computed in one step (every block live), its pages saved."""
    tokens = list(range(100, 100 + DOC + tail))
    ids = table(kinds, sw=list(range(11, 17)), full=list(range(1, 7)))
    s.on_new_request(request("a", tokens))
    assert s.get_num_new_matched_tokens(request("a", tokens), 0) == (0, False)
    plan = s.build_connector_meta(step_output([("a", len(tokens), ids)]))
    assert [o.groups for o in plan.saves] == [[list(g[:saved_blocks]) for g in ids]]
    res, errors = worker_step(w, plan)
    assert errors == set() and res.failed_recving == set()
    return tokens, ids


@pytest.mark.parametrize("layerwise", [False, True])
def test_a_hit_past_two_windows_loads_every_full_attention_page_and_only_the_window_of_sliding_window_layers(
        engine, layerwise):
    s, w, caches, kinds = engine({"layerwise_load": layerwise})
    assert s.hybrid and sorted(kinds) == ["FullAttentionSpec", "SlidingWindowSpec"]
    assert w._worker.dev.layer_names == NAMES and s.page_bytes == 4 * LAYER_BLOCK
    doc, a = save_document(s, w, caches, kinds)
    a_sw, a_full = a[kinds.index("SlidingWindowSpec")], a[kinds.index("FullAttentionSpec")]
    tokens = doc[:DOC] + [7, 8, 9]
    req = request("b", tokens)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (DOC, True)      # several groups: every hit is asynchronous
    # vLLM's table for a 160-token hit: the sliding-window group gets null blocks before the window (tokens 0..95)
    b = table(kinds, sw=[0, 0, 0, 33, 34, 35], full=list(range(21, 27)))
    null_before = [block(caches, li, 0) for li in range(4)]
    s.update_state_after_alloc(req, blocks_of(b), DOC)
    plan = s.build_connector_meta(step_output([]))
    (order,) = plan.loads
    assert order.groups == [list(g[:5]) for g in b]
    loaded_before = w._worker.counters.load_bytes
    res, errors = worker_step(w, plan)
    assert res.finished_recving == {"b"} and res.failed_recving == set() and errors == set()
    for li in FULL_LAYERS:                                           # every page of full-attention layers
        for src, dst in zip(a_full[:5], range(21, 26)):
            assert torch.equal(block(caches, li, dst), block(caches, li, src)), (li, dst)
    for li in SW_LAYERS:                                             # the window only: pages 3 and 4
        for src, dst in ((a_sw[3], 33), (a_sw[4], 34)):
            assert torch.equal(block(caches, li, dst), block(caches, li, src)), (li, dst)
    for li in range(4):
        assert torch.equal(block(caches, li, 0), null_before[li]), li   # vLLM's null block untouched
    # bytes: 5 pages x 2 full-attention layers + 2 window pages x 2 sliding-window layers (not 5 x 4 layers)
    assert w._worker.counters.load_bytes - loaded_before == (5 * 2 + 2 * 2) * LAYER_BLOCK


def test_pages_of_two_blocks_load_the_window_blocks_of_sliding_window_layers_block_by_block(engine):
    """page_size = 2 blocks: the document's 5 blocks are 2 whole pages; a hit of both (128 tokens) gets the
    sliding-window group's null block for blocks 0 and 1 (before the window), so page 0's sliding-window layers are
    not copied at all and page 1's are, while the full-attention layers get all 4 blocks."""
    s, w, caches, kinds = engine({"page_size": 2 * BLOCK})
    doc, a = save_document(s, w, caches, kinds, saved_blocks=4)
    a_sw, a_full = a[kinds.index("SlidingWindowSpec")], a[kinds.index("FullAttentionSpec")]
    req = request("b", doc[:4 * BLOCK] + [5])
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (4 * BLOCK, True)
    s.update_state_after_alloc(req, blocks_of(table(kinds, sw=[0, 0, 33, 34, 35], full=list(range(21, 26)))),
                               4 * BLOCK)
    res, errors = worker_step(w, s.build_connector_meta(step_output([])))
    assert res.finished_recving == {"b"} and res.failed_recving == set() and errors == set()
    pairs = {li: list(zip(a_full[:4], range(21, 25))) for li in FULL_LAYERS}
    pairs.update({li: [(a_sw[2], 33), (a_sw[3], 34)] for li in SW_LAYERS})
    for li, copied in pairs.items():
        assert all(torch.equal(block(caches, li, d), block(caches, li, src)) for src, d in copied), li
    assert w._worker.counters.load_bytes == (4 * 2 + 2 * 2) * LAYER_BLOCK


def test_a_page_whose_sliding_window_block_is_null_is_not_stored_and_never_hits(engine):
    s, w, caches, kinds = engine()
    doc, _a = save_document(s, w, caches, kinds)
    # "d": the document (its pages in L2) then 2 new pages; its sliding-window blocks of the document are null (an
    # engine prefix-cache hit older than the window): the new pages, live in every group, are stored
    d = doc[:DOC] + list(range(500, 500 + 2 * BLOCK + 3))
    s.on_new_request(request("d", d))
    ids_d = table(kinds, sw=[0, 0, 0, 0, 0, 40, 41, 42], full=list(range(1, 6)) + [27, 28, 29])
    plan = s.build_connector_meta(step_output([("d", len(d), ids_d)]))
    (order,) = plan.saves
    assert order.block_ids == [27, 28] and order.groups == [list(g[5:7]) for g in ids_d]
    worker_step(w, plan)
    # "e": 3 pages never saved, whose first sliding-window block is already null: nothing of it is stored, so no
    # later request can hit a page whose sliding-window layers were never written
    e = list(range(900, 900 + 3 * BLOCK + 2))
    s.on_new_request(request("e", e))
    ids_e = table(kinds, sw=[0, 44, 45, 46], full=[30, 31, 32, 36])
    plan = s.build_connector_meta(step_output([("e", len(e), ids_e)]))
    assert plan.saves == []
    e2 = e[:3 * BLOCK] + [1, 2]
    s.on_new_request(request("e2", e2))
    assert s.get_num_new_matched_tokens(request("e2", e2), 0) == (0, False)


def test_a_failed_load_is_a_failed_request_never_failed_block_ids(engine):
    """vLLM cannot take failed block ids of a model with several groups (it raises): a page that fails its checksum
    names the request in failed_recving (vLLM recomputes it), and its pages from the first loaded one leave the
    index."""
    s, w, caches, kinds = engine()
    doc, _a = save_document(s, w, caches, kinds)
    slot = s._sched.index.match_prefix(s._sched.requests["a"].keys.extend(doc)[:5]).host_slots[2]
    raw = w._worker.host.read_page(slot)                              # page 2 of the document, corrupted in L2
    raw[0] ^= 0xFF
    w._worker.host.write_page(slot, raw)
    tokens = doc[:DOC] + [3]
    req = request("b", tokens)
    s.on_new_request(req)
    assert s.get_num_new_matched_tokens(req, 0) == (DOC, True)
    s.update_state_after_alloc(req, blocks_of(table(kinds, sw=[0, 0, 0, 33, 34, 35], full=list(range(21, 27)))),
                               DOC)
    plan = s.build_connector_meta(step_output([]))
    res, errors = worker_step(w, plan)
    assert errors == set() and res.failed_recving == {"b"} and res.finished_recving == {"b"}
    assert w._worker.counters.checksum_mismatches == 1
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=None, finished_recving={"b"},
                                              invalid_block_ids=set(), failed_recving={"b"}))
    c = request("c", doc[:DOC] + [4])
    s.on_new_request(c)
    assert s.get_num_new_matched_tokens(c, 0) == (0, False)           # pages 0.. of b's load left the index
