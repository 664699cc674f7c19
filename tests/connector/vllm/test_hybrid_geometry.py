"""Hybrid and sliding-window models at the connector's start-up, from vLLM's own KV cache specs: the groups are what
vLLM's ``get_kv_cache_groups`` makes of per-layer specs, with its hybrid KV cache manager off
(``--disable-hybrid-kv-cache-manager``) or on.

- Sliding-window + full-attention layers (Gemma-2/3 shape), manager off: one group of full-attention specs over every
  layer; tierkv serves it, every layer in each page, says so in its start-up line and keys the pages apart from the
  same layers under another scheme. The engine run of the same shape: ``tests/e2e/test_vllm_hybrid.py``.
- Manager on (vLLM's default now that tierkv is ``SupportsHMA``): a sliding-window and a full-attention group, served
  per group under their own namespace fact (the pages themselves: ``test_hma_pages.py``). Sliding window in every
  layer (vLLM frees blocks before the window), Mamba state or local chunks beside attention, no KV at all: refused,
  naming the model type and why.
"""
import json
import logging

import pytest
import torch
from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
from vllm.v1.kv_cache_interface import (ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec,
                                        MambaSpec, SlidingWindowSpec)

from tierkv.connector.core.config import ConfigError
from tierkv.connector.vllm.connector import TierKVConnector
from tests.helpers.vllm_parts import BLOCK, HEAD_DIM, KV_HEADS, SCHEDULER, WORKER, TierkvLoggerState, vllm_config

WINDOW = 64
NUM_LAYERS = 4
NAMES = [f"model.layers.{i}.self_attn.attn" for i in range(NUM_LAYERS)]
LAYER_BYTES = 2 * BLOCK * KV_HEADS * HEAD_DIM * 2          # K and V of one block of one layer, bf16


@pytest.fixture
def gemma(tmp_path, monkeypatch, caplog):
    """A Gemma-3 text config.json whose layers alternate sliding-window (64 tokens) and full attention; this test's
    host-memory ledger; the tierkv logger recorded by caplog (restored after)."""
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    state = TierkvLoggerState()
    tk = logging.getLogger("tierkv")
    tk.addHandler(caplog.handler)
    tk.propagate = False
    d = tmp_path / "gemma"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text", "hidden_size": 16,
        "intermediate_size": 32, "num_attention_heads": 2, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
        "num_hidden_layers": NUM_LAYERS, "vocab_size": 256, "max_position_embeddings": 1024, "sliding_window": WINDOW,
        "layer_types": ["sliding_attention", "full_attention"] * 2, "query_pre_attn_scalar": HEAD_DIM,
        "torch_dtype": "bfloat16"}))
    yield str(d)
    state.restore()


def _specs(kinds: str) -> dict:
    """Per-layer specs as vLLM's attention layers report them: ``s`` sliding window, ``f`` full attention."""
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
                            sliding_window=WINDOW)
    return {n: (swa if k == "s" else full) for n, k in zip(NAMES, kinds)}


def _engine_config(model, specs: dict, *, hybrid_manager: bool, extra=None):
    """(VllmConfig, KVCacheConfig) as vLLM builds them for ``specs`` with its hybrid KV cache manager on or off."""
    vc = vllm_config(model, {"host_pool.num_pages": 8, **(extra or {})})
    vc.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid_manager
    if hybrid_manager:  # vLLM's engine core resolves the layout before it groups the layers of a hybrid model
        vc.cache_config.kv_cache_layout = "NHD"
    groups = get_kv_cache_groups(vc, dict(specs))
    return vc, KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=groups)


def test_sliding_window_and_full_layers_are_served_as_one_group_with_every_layer_in_each_page(gemma, caplog):
    vc, kcc = _engine_config(gemma, _specs("sfsf"), hybrid_manager=False)
    assert len(kcc.kv_cache_groups) == 1 and type(kcc.kv_cache_groups[0].kv_cache_spec) is FullAttentionSpec
    caplog.set_level(logging.INFO, logger="tierkv")
    s = TierKVConnector(vc, SCHEDULER, kcc)
    assert s.layer_names == NAMES and s.local_window == WINDOW and s.local_layers == (2, 4)
    assert s.page_bytes == NUM_LAYERS * LAYER_BYTES              # the sliding-window layers' KV too, every token
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("tierkv: L1 "))
    assert line.endswith(" | hybrid model: 2 of 4 layers attend a 64-token sliding window; vLLM's hybrid KV cache "
                         "manager is off with tierkv, so their KV is kept, stored and loaded for every token like "
                         "the full-attention layers'")
    assert s.namespace.extra[-1] == ("local_attention_kv", "every_token")
    w = TierKVConnector(vc, WORKER, kcc)
    w.register_kv_caches({n: torch.zeros(16, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16) for n in NAMES})
    assert w._worker.host.page_bytes == s.page_bytes and w.namespace == s.namespace


def test_a_full_attention_model_keeps_its_namespace_and_start_up_line(gemma, caplog):
    """The same layers, all full attention: no note, no namespace fact (stores written before this change still hit)."""
    vc, kcc = _engine_config(gemma, _specs("ffff"), hybrid_manager=False)
    caplog.set_level(logging.INFO, logger="tierkv")
    s = TierKVConnector(vc, SCHEDULER, kcc)
    hvc, hkcc = _engine_config(gemma, _specs("sfsf"), hybrid_manager=False)
    hybrid = TierKVConnector(hvc, SCHEDULER, hkcc)
    assert s.local_window is None and ("local_attention_kv", "every_token") not in s.namespace.extra
    assert s.namespace.digest() != hybrid.namespace.digest()
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("tierkv: L1 "))
    assert "hybrid model" not in line


def test_the_hybrid_manager_on_gives_two_groups_served_per_group_under_their_own_namespace(gemma, caplog):
    """vLLM keeps its hybrid KV cache manager on for tierkv (``SupportsHMA``): a sliding-window and a full-attention
    group, served with every layer in each page, under a namespace of their own (``local_attention_kv=per_group``),
    apart from the same model with the manager off (``every_token``) and from a full-attention model (no fact)."""
    vc, kcc = _engine_config(gemma, _specs("sfsf"), hybrid_manager=True)
    kinds = [type(g.kv_cache_spec).__name__ for g in kcc.kv_cache_groups]
    assert sorted(kinds) == ["FullAttentionSpec", "SlidingWindowSpec"]
    caplog.set_level(logging.INFO, logger="tierkv")
    s = TierKVConnector(vc, SCHEDULER, kcc)
    assert s.hybrid and s.layer_names == NAMES and s.local_window == WINDOW and s.ref_group == kinds.index(
        "FullAttentionSpec")
    assert sorted(map(sorted, s.group_names)) == [[NAMES[0], NAMES[2]], [NAMES[1], NAMES[3]]]
    assert s.page_bytes == NUM_LAYERS * LAYER_BYTES
    assert s.namespace.extra[-1] == ("local_attention_kv", "per_group")
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("tierkv: L1 "))
    assert line.endswith(" | hybrid model: 2 of 4 layers attend a 64-token sliding window; vLLM's hybrid KV cache "
                         "manager is on: every page is stored with every layer, and a hit loads those layers' blocks "
                         "inside the window only")
    ovc, okcc = _engine_config(gemma, _specs("sfsf"), hybrid_manager=False)
    fvc, fkcc = _engine_config(gemma, _specs("ffff"), hybrid_manager=True)
    off, full = TierKVConnector(ovc, SCHEDULER, okcc), TierKVConnector(fvc, SCHEDULER, fkcc)
    assert not off.hybrid and not full.hybrid                    # one group each
    digests = {"on": s.namespace.digest(), "off": off.namespace.digest(), "full": full.namespace.digest()}
    assert len(set(digests.values())) == 3, digests              # every pair apart


def test_mamba_or_local_chunk_groups_beside_attention_stop_start_up(gemma):
    """With the manager on, a group that is neither full attention nor sliding window stops start-up naming the model
    type and the kind; so does a model with no full-attention group."""
    vc = vllm_config(gemma, {"host_pool.num_pages": 8})
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    chunked = ChunkedLocalAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM,
                                        dtype=torch.bfloat16, attention_chunk_size=WINDOW)
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.bfloat16, torch.bfloat16))
    swa = _specs("s")[NAMES[0]]

    def config(*specs):
        return KVCacheConfig(num_blocks=16, kv_cache_tensors=[],
                             kv_cache_groups=[KVCacheGroupSpec([NAMES[i]], sp) for i, sp in enumerate(specs)])
    for other, why in ((mamba, "MambaSpec ones are neither full attention nor sliding window (MambaSpec: Mamba/SSM "
                                "layers keep one recurrent state per request, not one KV entry per token, so no page "
                                "of a prefix holds what a hit needs)"),
                       (chunked, "ChunkedLocalAttentionSpec ones are neither full attention nor sliding window "
                                 "(ChunkedLocalAttentionSpec: every layer attends within local chunks, and vLLM frees "
                                 "each request's blocks before the current chunk, so those pages can be neither saved "
                                 "nor loaded)")):
        for role in (SCHEDULER, WORKER):
            with pytest.raises(ConfigError) as e:
                TierKVConnector(vc, role, config(full, other))
            assert str(e.value) == (f"tierkv cannot serve model type 'gemma3_text': of its 2 KV cache groups, {why}; "
                                    "serve it without tierkv")
    with pytest.raises(ConfigError) as e:
        TierKVConnector(vc, SCHEDULER, config(swa, swa))
    assert str(e.value) == ("tierkv cannot serve model type 'gemma3_text': none of its 2 KV cache groups is full "
                            "attention (every layer attends within a sliding window, so no page of a long prefix stays "
                            "in vLLM's cache); serve it without tierkv")


def test_sliding_window_in_every_layer_stops_start_up(gemma):
    """vLLM keeps such a model's group as sliding window (nothing to unify it with) and frees blocks before the
    window: their pages could be neither saved nor loaded."""
    vc, kcc = _engine_config(gemma, _specs("ssss"), hybrid_manager=False)
    assert [type(g.kv_cache_spec) for g in kcc.kv_cache_groups] == [SlidingWindowSpec]
    for role in (SCHEDULER, WORKER):
        with pytest.raises(ConfigError) as e:
            TierKVConnector(vc, role, kcc)
        assert str(e.value) == (
            "tierkv cannot serve model type 'gemma3_text' (SlidingWindowSpec): every layer attends within a sliding "
            "window, and vLLM frees each request's blocks before the window (its null block takes their place), so "
            "those pages can be neither saved nor loaded; serve it without tierkv (or with --disable-sliding-window, "
            "which caps the model length at the window)")


def test_mamba_state_and_attention_free_models_stop_start_up(gemma):
    vc = vllm_config(gemma, {"host_pool.num_pages": 8})
    mamba = MambaSpec(block_size=BLOCK, shapes=((4, 8), (2, 8, 8)), dtypes=(torch.bfloat16, torch.bfloat16))
    kcc = KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=get_kv_cache_groups(vc, {NAMES[0]: mamba}))
    with pytest.raises(ConfigError) as e:
        TierKVConnector(vc, SCHEDULER, kcc)
    assert str(e.value) == ("tierkv cannot serve model type 'gemma3_text' (MambaSpec): Mamba/SSM layers keep one "
                            "recurrent state per request, not one KV entry per token, so no page of a prefix holds "
                            "what a hit needs; serve it without tierkv")
    with pytest.raises(ConfigError) as e:
        TierKVConnector(vc, SCHEDULER, KVCacheConfig(num_blocks=16, kv_cache_tensors=[], kv_cache_groups=[]))
    assert str(e.value) == ("tierkv: model type 'gemma3_text' has no KV cache (attention-free); tierkv has nothing to "
                            "store: serve it without --kv-transfer-config")
