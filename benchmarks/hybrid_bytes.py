"""Bytes a hybrid model's pages cost in tierkv with vLLM's hybrid KV cache manager on (per-group pages,
``SupportsHMA``) and off (one group, every layer kept for every token): stored per document and loaded per L2 hit.

The model is the geometry of the ``gemma`` preset of ``examples/make_tiny_model.py`` (4 layers alternating a
64-token sliding window and full attention, 2 KV heads of 32, bf16, 32-token blocks = pages). Nothing is timed: the
script builds tierkv's scheduler and worker connectors in this process from vLLM's own config and KV cache spec
objects (the groups ``get_kv_cache_groups`` makes with the manager on or off), saves a document of N pages through
the hooks, then serves a second request hitting all N pages, and reads the worker's ``save_bytes`` and
``load_bytes`` counters (what the copy kernels moved). With the manager on the second request's table gives the
sliding-window group vLLM's null block before the window of the hit's end, as vLLM's allocator does.

Usage::

    python -m benchmarks.hybrid_bytes [--pages 2 5 8 16 64] [--json out.json]

Prints one row per (pages, manager) with bytes stored per document, bytes loaded per hit, and the ratio on/off.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path
from types import SimpleNamespace

from benchmarks import harness

REPO = harness.REPO

BLOCK, WINDOW, KV_HEADS, HEAD_DIM, LAYERS = 32, 64, 2, 32, 4


def _model_dir(root: Path) -> str:
    """A config.json of the gemma preset's shape (the connector reads only the config)."""
    PRESETS = harness.make_tiny_model().PRESETS

    p = dict(PRESETS["gemma"])
    arch = p.pop("arch")
    d = root / "gemma"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForCausalLM"], "model_type": arch, "torch_dtype": "bfloat16",
        "query_pre_attn_scalar": p["head_dim"], **p}))
    return str(d)


def _connectors(model: str, hybrid: bool, pages: int):
    import torch
    from vllm.config import CacheConfig, KVTransferConfig, ModelConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

    from tierkv.connector.vllm.connector import TierKVConnector

    kt = KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.connector.vllm.connector",
                          kv_role="kv_both", kv_connector_extra_config={"host_pool.num_pages": 2 * pages + 2})
    mc = ModelConfig(model=model, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096)
    vc = VllmConfig(model_config=mc, cache_config=CacheConfig(block_size=BLOCK), kv_transfer_config=kt)
    vc.scheduler_config.disable_hybrid_kv_cache_manager = not hybrid
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    full = FullAttentionSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16)
    swa = SlidingWindowSpec(block_size=BLOCK, num_kv_heads=KV_HEADS, head_size=HEAD_DIM, dtype=torch.bfloat16,
                            sliding_window=WINDOW)
    layout, vc.cache_config.kv_cache_layout = vc.cache_config.kv_cache_layout, "NHD"
    groups = get_kv_cache_groups(vc, {n: (swa if i % 2 == 0 else full) for i, n in enumerate(names)})
    vc.cache_config.kv_cache_layout = layout
    num_blocks = 4 * pages + 8
    kcc = KVCacheConfig(num_blocks=num_blocks, kv_cache_tensors=[], kv_cache_groups=groups)
    s = TierKVConnector(vc, KVConnectorRole.SCHEDULER, kcc)
    w = TierKVConnector(vc, KVConnectorRole.WORKER, kcc)
    w.register_kv_caches({n: torch.zeros(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, dtype=torch.bfloat16)
                          for n in names})
    kinds = [type(g.kv_cache_spec).__name__ for g in groups]
    return s, w, kinds


def _req(rid, tokens):
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, lora_request=None, cache_salt=None,
                           kv_transfer_params=None, skip_reading_prefix_cache=False, num_prompt_tokens=len(tokens))


def _output(new):
    return SimpleNamespace(
        preempted_req_ids=[], num_scheduled_tokens={rid: n for rid, n, _t in new},
        kv_connector_block_state=SimpleNamespace(get_block_ids=lambda rid: {r: t for r, _n, t in new}[rid]),
        scheduled_new_reqs=[SimpleNamespace(req_id=rid, num_computed_tokens=0, block_ids=t) for rid, _n, t in new],
        scheduled_cached_reqs=SimpleNamespace(req_ids=[], num_computed_tokens=[]), scheduled_spec_decode_tokens={})


def _step(w, plan):
    w.bind_connector_metadata(plan)
    w.start_load_kv(None)
    w.wait_for_save()
    res = w.get_transfer_results(set())
    w.clear_connector_metadata()
    return res


def _table(kinds, hybrid: bool, first: int, n: int, null_before: int = 0):
    """A request's block table: one list per group; sliding-window groups with ``null_before`` null blocks."""
    if not hybrid:
        return (list(range(first, first + n)),)
    out, nxt = [], first
    for k in kinds:
        if k == "SlidingWindowSpec":
            out.append([0] * null_before + list(range(nxt, nxt + n - null_before)))
        else:
            out.append(list(range(nxt, nxt + n)))
        nxt += n
    return tuple(out)


def measure(pages: int, hybrid: bool, root: Path) -> dict:
    """Bytes stored for one document of ``pages`` pages and loaded by one L2 hit of all of them."""
    s, w, kinds = _connectors(_model_dir(root), hybrid, pages)
    doc = [(7 * i) % 1900 + 10 for i in range(pages * BLOCK)]
    a = doc + [1, 2, 3]
    s.on_new_request(_req("a", a))
    s.get_num_new_matched_tokens(_req("a", a), 0)
    _step(w, s.build_connector_meta(_output([("a", len(a), _table(kinds, hybrid, 1, pages + 1))])))
    stored = w._worker.counters.save_bytes
    b = doc + [4, 5]
    s.on_new_request(_req("b", b))
    hit, _async = s.get_num_new_matched_tokens(_req("b", b), 0)
    skipped = max(0, hit - WINDOW + 1) // BLOCK  # vLLM's null blocks of a sliding-window group before the window
    s.update_state_after_alloc(_req("b", b), SimpleNamespace(
        get_block_ids=lambda: _table(kinds, hybrid, 2 * pages + 4, pages + 1, skipped)), hit)
    res = _step(w, s.build_connector_meta(_output([])))
    assert hit == pages * BLOCK and not res.failed_recving, (hit, res)
    s.shutdown()
    w.shutdown()
    return {"pages": pages, "manager": "on" if hybrid else "off", "page_bytes": s.page_bytes,
            "stored_bytes_per_doc": stored, "loaded_bytes_per_hit": w._worker.counters.load_bytes}


def main(argv=None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, nargs="+", default=[2, 3, 5, 8, 16, 64])
    ap.add_argument("--json", help="write the rows to this file")
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("TIERKV_LEDGER_DIR", tmp)
        for n in args.pages:
            for hybrid in (False, True):
                d = Path(tmp) / f"{n}-{hybrid}"
                d.mkdir()
                rows.append(measure(n, hybrid, d))
    print("| pages | manager | page bytes | stored per document | loaded per hit | loaded, on / off |")
    print("|---|---|---|---|---|---|")
    off = {r["pages"]: r for r in rows if r["manager"] == "off"}
    for r in rows:
        ratio = r["loaded_bytes_per_hit"] / off[r["pages"]]["loaded_bytes_per_hit"]
        print(f"| {r['pages']} | {r['manager']} | {r['page_bytes']} | {r['stored_bytes_per_doc']} | "
              f"{r['loaded_bytes_per_hit']} | {ratio:.3f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
