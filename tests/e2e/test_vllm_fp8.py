"""FP8 KV cache in the real engine: vLLM's CPU backend with ``--kv-cache-dtype fp8_e4m3`` and ``fp8_e5m2``, tierkv with
an L2 and a file L3 shared by the engines of the module (three engine processes).

- An e4m3 engine serves documents A once, then a second round reusing them from its own L1 (the reference). It
  flushes L1 and L2 (its L2 holds fewer pages than the flush), so the second round's documents come from the file
  L3; it flushes L1 only, so they come from L2. Outputs of both equal the reference bit for bit (greedy).
- Meanwhile a bf16 engine writes documents B into the same store.
- Then an e5m2 engine gets no hit for documents A (e4m3 pages in the store) nor B (bf16 pages): the KV cache dtype
  is in the page namespace (every FP8 cache is a uint8 tensor in vLLM, so the tensor dtype could not tell e4m3 from
  e5m2). Its own L2 hits equal its L1 reuse.
- FP8 pages are half the bytes of bf16 pages, in L2 and in the L3 records.

k/v scales: vLLM 0.32 keeps per-tensor scales only, 1.0 or read from the checkpoint (no runtime calibration), so
the model (part of the namespace) fixes them; pages are stored without them and decode identically wherever they
load (checked through L2 and L3 here; no scale is stored, so none can be lost).

vLLM's CPU attention takes an FP8 KV cache only on a CPU with AVX-512 or AMX; an AVX2-only CPU (one of the machines
this suite runs on) refuses it at start-up. There the tests above cannot run, and the module checks instead what a
user of such a machine sees: the engine with tierkv stops with vLLM's reason, not a tierkv error in its place. FP8
pages are still checked on every machine by ``tests/connector/core/test_namespace_facts.py`` (namespaces, page bytes and
bit-exact copies of uint8 KV tensors, with vLLM made to see an AVX-512 CPU).
"""
import random
from pathlib import Path

import pytest
import torch

from tests.helpers.engine import EngineRunError, in_parallel, run_job, stats_by_role, tierkv_kv_config

P = 32
L1_BLOCKS = 24
L2_PAGES = 40
MAX_TOKENS = 4
HEAD_DIM = 32  # the test preset's head size (hidden 128 / 4 heads)


def _vllm_takes_fp8_kv_here() -> bool:
    """vLLM's own decision (its CPU attention's ISA choice) whether this CPU runs an FP8 KV cache."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
    try:
        _get_attn_isa(torch.bfloat16, P, HEAD_DIM, "fp8_e4m3")
    except NotImplementedError:
        return False
    return True


FP8_KV_HERE = _vllm_takes_fp8_kv_here()


def _prompts():
    rng = random.Random(20)
    vocab = lambda n: [rng.randrange(10, 2000) for _ in range(n)]
    docs = [vocab(3 * P) for _ in range(3)]
    first = [d + vocab(rng.randrange(3, 12)) for d in docs]
    second = [d + vocab(rng.randrange(3, 12)) for d in docs]
    other = [vocab(3 * P) + vocab(5) for _ in range(3)]          # documents B
    flush_l1 = [vocab(7 * P + 5) for _ in range(3)]   # more blocks than L1 holds, fewer pages than L2
    flush_l2 = [vocab(7 * P + 5) for _ in range(6)]   # more pages than L2 holds
    return first, second, other, flush_l1, flush_l2


def _engine(model, root, workdir, cache_dtype, workloads):
    cfg = {"host_pool": {"num_pages": L2_PAGES}, "verify_checksums": True,
           "l3": {"backend": "file", "file": {"root": str(root)}},
           "controller": {"write_policy": "write_through", "prefetch_policy": "wait_complete"}}
    return run_job(model, workloads, kv_transfer_config=tierkv_kv_config(cfg, load_failure_policy="recompute"),
                   num_gpu_blocks_override=L1_BLOCKS, max_tokens=MAX_TOKENS,
                   extra_engine_args={"kv_cache_dtype": cache_dtype}, workdir=workdir)


if not FP8_KV_HERE:  # an AVX2-only CPU: the one check that can run here (see the module docstring)
    def test_on_a_cpu_without_avx512_or_amx_an_fp8_engine_with_tierkv_stops_with_vllms_reason(tiny_model, tmp_path):
        with pytest.raises(EngineRunError) as err:
            _engine(tiny_model, tmp_path / "l3", tmp_path / "e4m3", "fp8_e4m3", [{"name": "first", "prompts": [[5] * P]}])
        # vLLM's own reason (raised by its ISA choice, which tierkv's connector asks for its page namespace)
        assert "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX." in str(err.value)


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    first, second, other, flush_l1, flush_l2 = _prompts()
    root = tmp_path_factory.mktemp("l3")
    wd = tmp_path_factory.mktemp
    reuse = [{"name": "second_l1", "prompts": second},
             {"name": "flush_l1", "prompts": flush_l1}, {"name": "second_l2", "prompts": second}]
    e4m3 = [{"name": "first", "prompts": first}, {"name": "second_l1", "prompts": second},
            {"name": "flush_l2", "prompts": flush_l2}, {"name": "second_l3", "prompts": second},
            {"name": "flush_l1", "prompts": flush_l1}, {"name": "second_l2", "prompts": second}]
    out = in_parallel(e4m3=lambda: _engine(tiny_model, root, wd("e4m3"), "fp8_e4m3", e4m3),
                       bf16=lambda: _engine(tiny_model, root, wd("bf16"), "auto", [{"name": "other", "prompts": other}]))
    out["e5m2"] = _engine(tiny_model, root, wd("e5m2"), "fp8_e5m2",
                          [{"name": "first", "prompts": first}, {"name": "other", "prompts": other}] + reuse)
    return dict(out, root=root)


def _doc_tokens():
    return [3 * P] * 3   # every document page, not the tail (one token is always left to compute)


def _external(w):
    return w["vllm_counters"].get("vllm:external_prefix_cache_hits", 0)


def test_fp8_e4m3_pages_from_l2_and_from_a_file_l3_equal_l1_reuse(runs):
    w = runs["e4m3"]["workloads"]
    ref = w["second_l1"]
    assert ref["num_cached_tokens"] == _doc_tokens() and _external(ref) == 0
    for tier in ("second_l3", "second_l2"):
        assert w[tier]["outputs"] == ref["outputs"], tier
        assert w[tier]["num_cached_tokens"] == _doc_tokens(), tier
        assert _external(w[tier]) == sum(_doc_tokens()), tier            # every reused token came from tierkv
        assert w[tier]["vllm_counters"]["vllm:prefix_cache_hits"] == 0, tier
    assert w["second_l3"]["vllm_counters"]["vllm:tierkv_ctl_l3_hit_tokens"] == sum(_doc_tokens())
    assert w["second_l2"]["vllm_counters"]["vllm:tierkv_l2_hit_tokens"] == sum(_doc_tokens())
    worker = stats_by_role(runs["e4m3"])["worker"]
    assert worker["failed_load_blocks"] == 0 and worker["checksum_mismatches"] == 0


def test_an_fp8_e5m2_engine_gets_no_hit_from_e4m3_or_bf16_pages_and_its_l2_hits_equal_l1_reuse(runs):
    w = runs["e5m2"]["workloads"]
    assert runs["bf16"]["workloads"]["other"]["num_cached_tokens"] == [0, 0, 0]
    for name in ("first", "other"):   # the store holds e4m3 pages of "first" and bf16 pages of "other"
        assert w[name]["num_cached_tokens"] == [0, 0, 0] and _external(w[name]) == 0, name
    assert stats_by_role(runs["e5m2"])["scheduler"].get("ctl_l3_hit_tokens", 0) == 0
    assert w["second_l1"]["num_cached_tokens"] == _doc_tokens() and _external(w["second_l1"]) == 0
    assert w["second_l2"]["outputs"] == w["second_l1"]["outputs"]
    assert _external(w["second_l2"]) == sum(_doc_tokens())
    assert w["second_l2"]["vllm_counters"]["vllm:prefix_cache_hits"] == 0


def _records(root: Path) -> dict[str, list[int]]:
    """Sizes of the L3 page records per namespace directory, keyed by the dtype the namespace names."""
    import json
    out = {}
    for info in root.glob("*/namespace.json"):
        ns = json.loads(info.read_text())
        out[ns["dtype"]] = sorted({p.stat().st_size for p in info.parent.glob("*/*.page")})
    return out


def test_fp8_pages_are_half_the_bytes_of_bf16_pages(runs):
    pb = {k: stats_by_role(runs[k])["worker"]["page_bytes"] for k in ("bf16", "e4m3", "e5m2")}
    assert pb["bf16"] == 2 * pb["e4m3"] == 2 * pb["e5m2"], pb
    rec = _records(runs["root"])
    assert set(rec) == {"bfloat16", "fp8_e4m3", "fp8_e5m2"}, rec
    assert all(len(v) == 1 for v in rec.values()), rec   # one record size per namespace
    header = rec["bfloat16"][0] - pb["bf16"]
    assert rec["fp8_e4m3"][0] - header == rec["fp8_e5m2"][0] - header == pb["e4m3"]
    for k in ("bf16", "e4m3", "e5m2"):
        assert runs[k]["leaked_processes"] == 0


if not FP8_KV_HERE:  # these need an engine that runs an FP8 cache (see the module docstring)
    del (runs, test_fp8_e4m3_pages_from_l2_and_from_a_file_l3_equal_l1_reuse,
         test_an_fp8_e5m2_engine_gets_no_hit_from_e4m3_or_bf16_pages_and_its_l2_hits_equal_l1_reuse,
         test_fp8_pages_are_half_the_bytes_of_bf16_pages)
