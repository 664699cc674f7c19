"""``benchmarks/l3_hit_ttft.py``: the prompt sequence, the ratios against the same engine's misses and against the
no-connector engines, and the README table of the committed result."""
import json

from benchmarks import l3_hit_ttft as bench
from benchmarks.harness import REPO


def _role(ttft, queued=None, cached=None, outputs=None):
    n = len(ttft)
    return {"ttft_s": ttft, "queued_s": queued or [0.0] * n, "prefill_s": ttft,
            "num_cached_tokens": cached or [0] * n, "outputs": outputs or [[i] for i in range(n)]}


def _phase(hit, miss, **kw):
    return {"hit": _role(hit, **kw), "miss": _role(miss)}


def test_hits_are_compared_with_the_same_engines_misses_and_with_the_no_connector_engines():
    phases = {"recompute": _phase([1.0, 2.0], [1.0, 1.2]), "recompute_2": _phase([3.0, 2.0], [1.4, 1.6]),
              "healthy": {"hit": _role([0.5, 0.2], cached=[64, 64]), "miss": _role([4.0, 5.0, 5.0])},
              "paced": _phase([0.6, 0.4], [1.0]), "slow": _phase([2.2, 2.0], [2.0], queued=[0.1, 0.3]),
              "stalled": {"hit": _role([2.0, 2.4], outputs=[[0], [3]]), "miss": _role([2.0, 2.0])},
              "turns_stalled": _phase([0.2, 2.1], [2.0], cached=[64, 0])}
    s = bench.summarise(phases)
    # against the same engine's median miss (5.0 s), not against another engine's (2.0 s for these prompts)
    assert s["healthy"]["ratios"] == [0.1, 0.04] and s["healthy"]["ratios_vs_none"] == [0.25, 0.1]
    assert s["healthy"]["l3_hit_tokens"] == 128
    assert s["slow"]["max_ratio"] == 1.1 and s["slow"]["median_ratio"] == 1.05
    assert s["slow"]["max_wait_share"] == 0.15 and s["slow"]["queued_ms"] == [100.0, 300.0]
    # against the median of the prompt's two no-connector runs (2.0 and 2.0)
    assert s["slow"]["ratios_vs_none"] == [1.1, 1.0]
    # the no-connector engines' misses: median of 1.0, 1.2, 1.4, 1.6 = 1.3
    assert s["paced"]["miss_vs_none"] == round(1.0 / 1.3, 3) and s["_reference"]["miss_ttft_ms"] == 1300.0
    assert s["stalled"]["max_ratio"] == 1.2 and s["stalled"]["outputs_equal"] is False
    assert s["turns_stalled"]["ratios"] == [0.1, 1.05] and s["turns_stalled"]["l3_hit_tokens"] == 64
    # a result file from before a store condition existed: summarised (and drawn) without it
    del phases["turns_stalled"]
    assert "turns_stalled" not in bench.summarise(phases) and bench.stores(phases) == list(bench.STORES[:-1])
    assert s["_reference"]["ratios"] == [3.0, 1.0] and s["_reference"]["hit_vs_miss"] == [round(1.5 / 1.1, 3), round(2.5 / 1.5, 3)]


def test_every_phase_gets_its_own_miss_and_warm_up_documents():
    p = dict(bench.QUICK)
    assert bench.warmup_prompts(p) == 8                # 64 blocks of 32 tokens / prompts of 264 tokens, rounded up
    seqs = [bench.sequence(p, 1, k) for k in range(len(bench.STORES) + 2)]  # every phase's number
    for seq, roles in seqs:
        assert roles == ["warmup"] * bench.warmup_prompts(p) + ["hit", "miss"] * p["docs"]
    hits = [tuple(x) for x, r in zip(*seqs[0]) if r == "hit"]
    assert all([tuple(x) for x, r in zip(*sq) if r == "hit"] == hits for sq in seqs)
    others = [tuple(x[:bench.PAGE]) for sq in seqs for x, r in zip(*sq) if r != "hit"]
    first_pages = [h[:bench.PAGE] for h in hits]
    assert len(set(others)) == len(others) and not set(others) & set(first_pages)


def test_the_committed_result_renders_its_commit():
    data = json.loads((REPO / "benchmarks" / "results" / "l3_hit_ttft.json").read_text())
    assert data["code"]["commit"][:12] in bench.render_section(data)
