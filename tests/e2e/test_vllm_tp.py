"""The real vLLM engine with tensor parallelism (``tensor_parallel_size=2`` on vLLM's CPU backend, one OpenMP thread
per rank: ``VLLM_CPU_OMP_THREADS_BIND="0|1"``) and tierkv with a file L3 (docs/architecture.md, "The controller's
protocol").

The ``test`` preset model has 2 KV heads, so each rank holds one; each rank's L2 holds its own heads' bytes and each
rank writes its L3 records under its own namespace (``root/<rank namespace hex>/<key[:2]>/<key>.page``).

Engines (two at a time, in threads: ``ref`` with ``tier``, then the two restarts; every engine is TP=2):

- ``ref``: vLLM without a connector, an L1 that keeps every prefix. It runs ``tier``'s workloads, then drops its
  prefix cache (``reset_prefix_cache``) and replays ``fill``, which leaves its L1 exactly as the restarted engines
  find L3 for the prompts of ``restart`` (same pages, computed by the same requests from scratch), then ``restart``.
- ``tier``: tierkv (L2 of ``L2_PAGES`` pages, write_through to a file store, ``wait_complete`` prefetches, checksums
  on), an L1 of ``L1_BLOCKS`` blocks. ``fill``: documents D0 (4 pages) and D1 (3 pages) with a question, and the
  first 3 pages of D2 (5 pages) with a short tail; ``drop_l1``: ``reset_prefix_cache`` (L1 forgets every cached
  block, tierkv's L2 keeps its pages; a batch of short prompts meant to take every L1 block left one block cached
  once when vLLM admitted it in two steps); ``l2``: D0, D1 and all of D2 with new questions: every document
  page ``fill`` computed is loaded from L2 (D2's last 2 pages are computed and saved).
- two restarts (empty L1 and L2), each on its own copy of ``tier``'s store directory from which D2's page 3 was
  deleted in rank 1's namespace only (a page one rank lacks), running ``restart``: D0, D1, D2 with new
  questions. L3 holds D0 and D1 on both ranks and D2's pages 0-2 on both, page 3 on rank 0 only: the L3 hit must
  stop at page 3 and both ranks recompute it (and D2's page 4, after the gap). ``sched``: existence answered in
  the scheduler's process (``controller.exists_in_scheduler``, the default: one file-store object per rank
  namespace, the minimum over ranks); ``workers``: ``exists_in_scheduler: false``, every rank answers an ``exists``
  job and the scheduler takes the page-wise AND of the reports.

Outputs are compared in sequential mode only (one request at a time, so bf16 rounding depends on nothing but the
computation itself, see ``tests/helpers/engine.py``), and each compared request finds exactly the same prefix pages, computed by
the same requests, as in ``ref``: bit-identical KV, so identical greedy tokens.
"""
import dataclasses
import json
import random
import shutil
from pathlib import Path

import pytest

from tests.helpers.engine import in_parallel, run_job, stats_by_role, tierkv_kv_config

P = 32
MAX_LEN = 256
MAX_TOKENS = 4
L1_BLOCKS = 13        # 12 usable blocks plus vLLM's null block: fill's documents take all 12
L2_PAGES = 16         # every page of the run fits: L2 evicts nothing
FLUSH_PROMPTS = 16    # one block each, more than L1 has: every cached block is evicted
DOC_PAGES = (4, 3, 5)
HEAD_PAGES = 3        # D2's pages computed (and stored) by fill; D2's page HEAD_PAGES is the one rank 1 loses
MISSING_PAGE = HEAD_PAGES
RECORDS_PER_RANK = 4 + 3 + 5   # every document page, once per rank (questions and answers never fill a page)
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_HOST_IP": "127.0.0.1"}
ENGINE_ARGS = {"tensor_parallel_size": 2, "max_model_len": MAX_LEN, "max_num_seqs": FLUSH_PROMPTS}


def _workloads():
    rng = random.Random(2025)
    vocab = lambda n: [rng.randrange(10, 1000) for _ in range(n)]
    docs = [vocab(n * P) for n in DOC_PAGES]
    question = lambda: vocab(rng.randrange(3, 12))   # with the answer, never fills the page after the document
    d0, d1, d2 = docs
    fill = {"name": "fill", "prompts": [d0 + question(), d1 + question(), d2[:HEAD_PAGES * P] + question()]}
    flush = {"name": "flush", "sequential": False, "max_tokens": 1, "prompts": [vocab(8) for _ in range(FLUSH_PROMPTS)]}
    l2 = {"name": "l2", "prompts": [d + question() for d in docs]}
    restart = {"name": "restart", "prompts": [d + question() for d in docs]}
    return docs, fill, flush, l2, restart


def _tier_kv(root, **controller):
    ctl = {"write_policy": "write_through", "prefetch_policy": "wait_complete",
           "exists_wait_s": 120.0}   # a workers' existence answer is never given up on, however slow the machine
    ctl.update(controller)
    return tierkv_kv_config({"host_pool": {"num_pages": L2_PAGES}, "verify_checksums": True,
                             "l3": {"backend": "file", "file": {"root": str(root)}}, "controller": ctl},
                            load_failure_policy="recompute")


def _namespaces(root: Path) -> dict[int, dict]:
    """``{tp_rank: {"dir", "info", "records"}}`` of every namespace directory under a file store's ``root``."""
    out = {}
    for info_file in sorted(root.glob("*/namespace.json")):
        info = json.loads(info_file.read_text())
        d = info_file.parent
        out[info["tp_rank"]] = {"dir": d, "info": info, "records": sorted(p.name for p in d.glob("*/*.page"))}
    return out


def _record_path(namespaces: dict, rank: int, tokens: list[int], page: int) -> Path:
    """Where rank ``rank`` stores the page ``page`` of the token sequence ``tokens`` (no LoRA, no cache salt)."""
    from tierkv.connector.l3.io import l3_key
    from tierkv.connector.core.page_hash import ModelNamespace, page_keys, request_root

    def ns(info):
        return ModelNamespace(**{**info, "extra": tuple(info["extra"])})

    # page keys are chained from the scheduler's namespace (tp_rank 0); each rank's record name adds its own
    sched_ns = dataclasses.replace(ns(namespaces[0]["info"]), tp_rank=0, pp_rank=0)
    key = page_keys(request_root(sched_ns.digest()), tokens, P)[page]
    rank_digest = ns(namespaces[rank]["info"]).digest()
    name = l3_key(rank_digest, key)
    return namespaces[rank]["dir"] / name[:2] / f"{name}.page"


@pytest.fixture(scope="module")
def runs(tiny_model, tmp_path_factory):
    cfg = json.loads((Path(tiny_model) / "config.json").read_text())
    assert cfg["num_key_value_heads"] % 2 == 0, cfg   # each of the 2 ranks holds whole KV heads
    docs, fill, flush, l2, restart = _workloads()
    replay = dict(fill, name="replay")
    root = tmp_path_factory.mktemp("l3")
    common = dict(max_tokens=MAX_TOKENS, extra_engine_args=ENGINE_ARGS, env=TP_ENV)
    first = in_parallel(
        ref=lambda: run_job(tiny_model, [fill, flush, l2, {"name": "reset", "reset_prefix_cache": True}, replay,
                                         restart],
                            kv_transfer_config=None, num_gpu_blocks_override=200,
                            workdir=tmp_path_factory.mktemp("ref"), **common),
        tier=lambda: run_job(tiny_model, [fill, {"name": "drop_l1", "reset_prefix_cache": True}, l2],
                             kv_transfer_config=_tier_kv(root),
                             num_gpu_blocks_override=L1_BLOCKS, workdir=tmp_path_factory.mktemp("tier"), **common))
    after_tier = _namespaces(root)

    # a page one rank lacks: rank 1 loses D2's page 3 (in each restart's own copy of the store); rank 0 keeps it
    roots, lost = {}, {}
    for mode in ("sched", "workers"):
        roots[mode] = tmp_path_factory.mktemp(f"l3-{mode}") / "store"
        shutil.copytree(root, roots[mode])
        ns = _namespaces(roots[mode])
        lost[mode] = _record_path(ns, 1, docs[2], MISSING_PAGE)
        assert lost[mode].is_file() and _record_path(ns, 0, docs[2], MISSING_PAGE).is_file()
        lost[mode].unlink()
    second = in_parallel(**{
        mode: (lambda mode=mode: run_job(
            tiny_model, [restart], kv_transfer_config=_tier_kv(roots[mode], exists_in_scheduler=(mode == "sched")),
            num_gpu_blocks_override=L1_BLOCKS, workdir=tmp_path_factory.mktemp(f"restart-{mode}"), **common))
        for mode in ("sched", "workers")})
    return {"docs": docs, "ref": first["ref"], "tier": first["tier"], "root": root, "after_tier": after_tier,
            "restart": second, "roots": roots, "lost": lost}


def _workers(res) -> list[dict]:
    """The connector stats of each worker (one per rank), in no particular rank order."""
    ws = [v for k, v in res["stats"].items() if k.startswith("worker-")]
    assert len(ws) == 2, sorted(res["stats"])
    return ws


def test_l2_hits_under_tp_equal_the_reference(runs):
    ref, tier = runs["ref"], runs["tier"]
    for name in ("fill", "l2"):
        got, want = tier["workloads"][name], ref["workloads"][name]
        assert got["outputs"] == want["outputs"], name
        assert got["num_cached_tokens"] == want["num_cached_tokens"], name
    assert ref["workloads"]["replay"]["outputs"] == ref["workloads"]["fill"]["outputs"]
    l2 = tier["workloads"]["l2"]
    # D0, D1 whole and D2's first 3 pages, all from tierkv's L2 (L1 was flushed, L3 is never asked for them)
    assert l2["num_cached_tokens"] == [4 * P, 3 * P, HEAD_PAGES * P]
    vc = l2["vllm_counters"]
    assert vc["vllm:prefix_cache_hits"] == 0
    assert vc["vllm:external_prefix_cache_hits"] == vc["vllm:tierkv_l2_hit_tokens"] == (4 + 3 + HEAD_PAGES) * P
    sched = stats_by_role(tier)["scheduler"]
    assert sched["l2_hit_tokens"] == sched["load_pages"] * P == (4 + 3 + HEAD_PAGES) * P, sched
    assert sched["ctl_l3_hit_tokens"] == 0 and sched["evicted_pages"] == 0
    # every page computed was saved into L2 and backed up, by both ranks
    assert sched["save_pages"] == sched["ctl_backup_stored_pages"] == RECORDS_PER_RANK, sched
    for w in _workers(tier):
        assert w["load_pages"] == (4 + 3 + HEAD_PAGES) and w["save_pages"] == RECORDS_PER_RANK, w
        assert w["l3_backup_pages"] == RECORDS_PER_RANK and w["l3_backup_failed_pages"] == 0, w
        assert w["failed_load_blocks"] == 0 and w["checksum_mismatches"] == 0 and w["hook_errors"] == 0, w
    assert sched["hook_errors"] == 0 and sched["locked_pages"] == 0 and sched["ctl_pending_jobs"] == 0
    assert tier["leaked_processes"] == 0 and ref["leaked_processes"] == 0


def test_each_rank_stores_under_its_own_namespace(runs):
    from tierkv.connector.core.page_hash import ModelNamespace

    ns = runs["after_tier"]
    assert sorted(ns) == [0, 1]
    dirs = {ns[r]["dir"].name for r in ns}
    assert len(dirs) == 2
    assert sorted(p.name for p in runs["root"].iterdir()) == sorted(dirs)
    for r in (0, 1):
        info = ns[r]["info"]
        assert info["tp_size"] == 2 and info["num_kv_heads"] == 1 and info["page_size"] == P, info
        assert ModelNamespace(**{**info, "extra": tuple(info["extra"])}).digest().hex() == ns[r]["dir"].name, info
        assert len(ns[r]["records"]) == RECORDS_PER_RANK, r
    # the same pages under other names: a record's name hashes the rank's namespace with the page key
    assert not set(ns[0]["records"]) & set(ns[1]["records"])
    for i, d in enumerate(runs["docs"]):
        for page in range(DOC_PAGES[i]):
            for r in (0, 1):
                assert _record_path(ns, r, d, page).is_file(), (i, page, r)


@pytest.mark.parametrize("mode", ["sched", "workers"])
def test_a_page_one_rank_lacks_is_recomputed_by_both(runs, mode):
    ref, res = runs["ref"], runs["restart"][mode]
    got, want = res["workloads"]["restart"], ref["workloads"]["restart"]
    assert got["outputs"] == want["outputs"]
    # D0 and D1 whole from L3; D2 up to the page rank 1 lacks, although rank 0 holds it and the page after
    hit_pages = 4 + 3 + MISSING_PAGE
    assert got["num_cached_tokens"] == want["num_cached_tokens"] == [4 * P, 3 * P, MISSING_PAGE * P]
    vc = got["vllm_counters"]
    assert vc["vllm:prefix_cache_hits"] == 0
    assert vc["vllm:external_prefix_cache_hits"] == vc["vllm:tierkv_ctl_l3_hit_tokens"] == hit_pages * P
    sched = stats_by_role(res)["scheduler"]
    assert sched["ctl_l3_hit_tokens"] == hit_pages * P and sched["l2_hit_tokens"] == 0, sched
    assert sched["ctl_exists_found_pages"] == hit_pages, sched
    assert sched["ctl_prefetch_ordered_pages"] == sched["ctl_prefetch_loaded_pages"] == hit_pages, sched
    assert sched["ctl_prefetch_failed_pages"] == 0 and sched["ctl_exists_late_answers"] == 0, sched
    assert sched["ctl_l3_declined_slow_pages"] == 0 and sched["ctl_l3_declined_room_pages"] == 0, sched
    if mode == "sched":   # one store object per rank namespace in the scheduler's process, no exists job
        assert sched["ctl_exists_local_queries"] == sched["ctl_exists_queries"] == 3, sched
    else:                 # every rank answered every exists job
        assert sched["ctl_exists_local_queries"] == 0 and sched["ctl_exists_queries"] == 3, sched
    # no rank read, loaded or failed a page beyond the common run: both did exactly the same
    workers = _workers(res)
    for w in workers:
        assert w["l3_prefetch_pages"] == w["async_load_pages"] == hit_pages, w
        assert w["l3_prefetch_failed_pages"] == 0 and w["l3_prefetch_late_pages"] == 0, w
        assert w["failed_load_blocks"] == 0 and w["checksum_mismatches"] == 0 and w["hook_errors"] == 0, w
        assert w["l3_exists_jobs"] == (0 if mode == "sched" else 3), w
        # D2's pages 3 and 4 were recomputed and backed up again by both ranks
        assert w["save_pages"] == w["l3_backup_pages"] == DOC_PAGES[2] - MISSING_PAGE, w
    # rank 1's lost record is back, and both namespaces hold every document page again
    assert runs["lost"][mode].is_file()
    ns = _namespaces(runs["roots"][mode])
    assert [len(ns[r]["records"]) for r in (0, 1)] == [RECORDS_PER_RANK] * 2
    assert sched["hook_errors"] == 0 and sched["locked_pages"] == 0 and sched["ctl_pending_jobs"] == 0
    assert res["leaked_processes"] == 0
