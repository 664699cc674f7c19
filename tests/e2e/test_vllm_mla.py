"""MLA end to end: the ``mla`` preset of ``examples/make_tiny_model.py`` (DeepSeek-V2 shape, a 576-value latent per
token and layer) served by vLLM 0.32's CPU MLA backend (``CPU_MLA``) with tierkv, an L2 and a file L3, in one engine
with ``tensor_parallel_size=2`` (one OpenMP thread per rank). Each rank's worker is a whole MLA worker (its own L1, L2
and store object), so the engine proves the single-rank path (L2 and L3 hits) and the TP rule (one record per page) at
once; one engine keeps the suite's time (a TP=1 engine alone costs as much again).

What vLLM's CPU backend does with an MLA model (``vllm/platforms/cpu.py``): on a CPU with AMX tiles it picks
``AMX_MLA`` (block sizes multiple of 32, prefix caching on), elsewhere ``CPU_MLA``. The engine here asks for ``CPU_MLA``
by name (``attention_backend``), so the test runs the same backend on every host: vLLM then forces ``block_size`` 16
(the CPU MLA decode kernel's only block size) and turns prefix caching and chunked prefill off.
With no L1 prefix reuse there is no "same engine reusing the prefix from L1" to compare with: the reference is the
same engine recomputing the same prompts under a fresh ``cache_salt`` each (a salted page key never hits, so the
whole prompt is computed), i.e. the prompt without any cache. Outputs are compared in sequential mode (one request
at a time, see ``tests/helpers/engine.py``).

The engine (tierkv: L2 of ``L2_PAGES`` pages, write_through to a file store, ``wait_complete`` prefetches,
checksums on) runs, in order:

- ``fill``: documents D0 (4 pages) and D1 (3 pages), each with a short question (never fills a page with its answer);
- ``l2``: D0 and D1 with new questions: every document page comes from tierkv's L2 (vLLM has no L1 hit to offer);
- ``flush``: 3 other documents of 3 pages, more pages than L2 holds: every page of D0 and D1 leaves L2 (LRU);
- ``l3``: D0 and D1 with new questions: every document page is read from the file L3 (asynchronous load);
- ``ref``: the prompts of ``l2`` and ``l3``, each under its own ``cache_salt``: computed from scratch;
- ``control``: ``l2``'s prompts with another first page, whose outputs differ: the comparison sees a wrong prefix.

Each rank holds the same latent pages: one L3 record per page under TP rank 0's namespace, written by rank 0 only
(rank 1 counts the page in ``l3_backup_other_rank_pages``) and read by both ranks. Each rank keeps its own L2 copy
(a rank's L2 -> L1 copies run in its own process, into its own L1), ``num_slots * page_bytes`` per rank.
"""
import importlib.util
import json
import random
from pathlib import Path

import pytest

from tests.helpers.engine import REPO_ROOT, run_job, stats_by_role, tierkv_kv_config

MLA_BACKEND = "CPU_MLA"  # named, else an AMX host gets AMX_MLA (block sizes multiple of 32, prefix caching on)
P = 16                # vLLM's CPU MLA block size (forced), tierkv's page
LAYERS, LATENT = 2, 576
PAGE_BYTES = LAYERS * P * LATENT * 2   # one bf16 latent plane per token and layer
DOC_PAGES = (4, 3)
FLUSH_DOCS, FLUSH_DOC_PAGES = 3, 3
L2_PAGES = 8          # fewer than the flush's 9 pages: D0's and D1's pages all leave L2
L1_BLOCKS = 32
MAX_TOKENS = 4
HIT_PAGES = sum(DOC_PAGES)
TP = 2
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_HOST_IP": "127.0.0.1"}


def _workloads():
    rng = random.Random(2026)
    vocab = lambda n: [rng.randrange(10, 2000) for _ in range(n)]
    question = lambda: vocab(rng.randrange(3, 8))   # question + 4 answer tokens < one page
    docs = [vocab(n * P) for n in DOC_PAGES]
    fill = {"name": "fill", "prompts": [d + question() for d in docs]}
    l2 = {"name": "l2", "prompts": [d + question() for d in docs]}
    flush = {"name": "flush", "prompts": [vocab(FLUSH_DOC_PAGES * P) + question() for _ in range(FLUSH_DOCS)]}
    l3 = {"name": "l3", "prompts": [d + question() for d in docs]}
    ref = {"name": "ref", "prompts": [{"prompt_token_ids": p, "cache_salt": f"ref-{i}"}
                                      for i, p in enumerate(l2["prompts"] + l3["prompts"])]}
    # l2's prompts with another first page: a prefix with wrong KV would answer differently
    control = {"name": "control", "prompts": [vocab(P) + p[P:] for p in l2["prompts"]]}
    return [fill, l2, flush, l3, ref, control]


def _kv(root):
    return tierkv_kv_config({"host_pool": {"num_pages": L2_PAGES}, "verify_checksums": True,
                             "l3": {"backend": "file", "file": {"root": str(root)}},
                             "controller": {"write_policy": "write_through", "prefetch_policy": "wait_complete",
                                            "exists_wait_s": 120.0}},
                            load_failure_policy="recompute")


@pytest.fixture(scope="module")
def mla_model():
    """Path (str) of the ``mla`` preset model (``<repo>/models/mla``), built on first use."""
    spec = importlib.util.spec_from_file_location("tierkv_make_tiny_model",
                                                  REPO_ROOT / "examples" / "make_tiny_model.py")
    maker = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(maker)
    return maker.make_model(None, "mla", quiet=True)


@pytest.fixture(scope="module")
def run(mla_model, tmp_path_factory):
    cfg = json.loads((Path(mla_model) / "config.json").read_text())
    assert cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"] == LATENT and cfg["num_hidden_layers"] == LAYERS, cfg
    root = tmp_path_factory.mktemp("l3")
    res = run_job(mla_model, _workloads(), kv_transfer_config=_kv(root), env=TP_ENV, max_tokens=MAX_TOKENS,
                  num_gpu_blocks_override=L1_BLOCKS,
                  extra_engine_args={"block_size": P, "max_model_len": 256, "tensor_parallel_size": TP,
                                     "attention_backend": MLA_BACKEND},
                  workdir=tmp_path_factory.mktemp("tp2"))
    res["root"] = root
    return res


def _namespaces(root: Path) -> list[dict]:
    return [{"info": json.loads(f.read_text()), "records": sorted(f.parent.glob("*/*.page"))}
            for f in sorted(root.glob("*/namespace.json"))]


def _workers(res) -> list[dict]:
    return [v for k, v in sorted(res["stats"].items()) if k.startswith("worker-")]


def test_l2_and_l3_hits_equal_recomputing_bit_for_bit(run):
    res = run  # the one TP=2 engine
    w = res["workloads"]
    ref = w["ref"]
    assert ref["num_cached_tokens"] == [0] * 4            # salted: computed from scratch
    assert w["l2"]["outputs"] == ref["outputs"][:2]
    assert w["l3"]["outputs"] == ref["outputs"][2:]
    assert all(a != b for a, b in zip(w["control"]["outputs"], ref["outputs"][:2])), w["control"]["outputs"]
    # vLLM turned prefix caching off for MLA on CPU: no phase ever asks its L1
    assert all(w[n]["vllm_counters"]["vllm:prefix_cache_queries"] == 0 for n in w)
    doc_tokens = [n * P for n in DOC_PAGES]
    for name, counter in (("l2", "vllm:tierkv_l2_hit_tokens"), ("l3", "vllm:tierkv_ctl_l3_hit_tokens")):
        assert w[name]["num_cached_tokens"] == doc_tokens, name
        vc = w[name]["vllm_counters"]
        assert vc["vllm:external_prefix_cache_hits"] == vc[counter] == HIT_PAGES * P, (name, vc)
    assert w["l3"]["vllm_counters"]["vllm:tierkv_l2_hit_tokens"] == 0    # L2 really was flushed
    sched = stats_by_role(res)["scheduler"]
    assert sched["l2_hit_tokens"] == sched["ctl_l3_hit_tokens"] == HIT_PAGES * P, sched
    assert sched["ctl_prefetch_loaded_pages"] == HIT_PAGES and sched["ctl_prefetch_failed_pages"] == 0, sched
    workers = _workers(res)
    assert len(workers) == TP
    for wk in workers:   # every rank loaded every hit page: L2 -> L1 (load_pages), L3 -> L2 -> L1 (async_load_pages)
        assert wk["page_bytes"] == PAGE_BYTES and wk["layout"] == "layer_first", wk
        assert wk["load_pages"] == wk["async_load_pages"] == HIT_PAGES, wk
        assert wk["l3_prefetch_pages"] == HIT_PAGES and wk["l3_prefetch_failed_pages"] == 0, wk
        assert wk["failed_load_blocks"] == 0 and wk["checksum_mismatches"] == 0 and wk["hook_errors"] == 0, wk
    assert sched["hook_errors"] == 0 and sched["locked_pages"] == 0 and sched["ctl_pending_jobs"] == 0
    assert res["leaked_processes"] == 0


def test_one_l3_record_per_page_written_by_rank_0_and_read_by_both(run):
    res = run
    (ns,) = _namespaces(run["root"])      # one namespace for both ranks
    info = ns["info"]
    assert info["use_mla"] is True and info["tp_rank"] == 0 and info["tp_size"] == TP, info
    assert (info["page_size"], info["num_kv_heads"], info["head_dim"]) == (P, 1, LATENT), info
    assert "-mla/" in info["kv_layout"], info
    sched = stats_by_role(res)["scheduler"]
    stored = sched["ctl_backup_stored_pages"]
    # every page ever saved (documents, flush, the salted reference) reached L3, once
    assert stored == sched["save_pages"] == HIT_PAGES + FLUSH_DOCS * FLUSH_DOC_PAGES + 3 * HIT_PAGES, sched
    assert len(ns["records"]) == stored
    assert {p.stat().st_size for p in ns["records"]} == {PAGE_BYTES + 64}     # payload + 64-byte header
    workers = _workers(res)
    writers = [wk for wk in workers if wk["l3_backup_pages"]]
    assert len(workers) == TP and len(writers) == 1 and writers[0]["l3_backup_pages"] == stored, workers
    assert writers[0]["l3_backup_bytes"] == stored * PAGE_BYTES and writers[0]["l3_backup_other_rank_pages"] == 0
    for wk in workers:
        assert wk["l3_backup_failed_pages"] == 0, wk
        if wk is not writers[0]:
            assert wk["l3_backup_pages"] == 0 and wk["l3_backup_other_rank_pages"] == stored, wk
        # each rank keeps its own copy of the latent pages in its L2 (L2_PAGES x PAGE_BYTES = 294,912 B per rank)
        assert wk["num_slots"] == L2_PAGES and wk["save_bytes"] == stored * PAGE_BYTES, wk
        assert wk["l3_prefetch_pages"] == HIT_PAGES, wk   # and both read the records rank 0 wrote
