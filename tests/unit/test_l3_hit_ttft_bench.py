"""``benchmarks/l3_hit_ttft.py``: the ratios against recomputing, and (once results are committed) the README
section drawn from the committed result file."""
import importlib.util
import json
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location("tierkv_bench_l3_hit_ttft", REPO / "benchmarks" / "l3_hit_ttft.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


def _phase(ttft, cached, outputs):
    return {"ttft_s": ttft, "num_cached_tokens": cached, "outputs": outputs}


def test_each_prompt_is_compared_with_the_median_of_its_two_recompute_runs():
    out = [[1], [2]]
    phases = {"recompute": _phase([1.0, 2.0], [0, 0], out), "recompute_2": _phase([3.0, 2.0], [0, 0], out),
              "healthy": _phase([0.5, 0.2], [64, 64], out), "paced": _phase([0.6, 0.4], [64, 64], out), "slow": _phase([2.2, 2.0], [0, 0], out),
              "stalled": _phase([2.0, 2.4], [0, 0], [[1], [3]])}
    s = bench.summarise(phases)
    assert s["healthy"]["ratios"] == [0.25, 0.1] and s["healthy"]["l3_hit_tokens"] == 128
    assert s["slow"]["max_ratio"] == 1.1 and s["slow"]["median_ratio"] == 1.05
    assert s["stalled"]["max_ratio"] == 1.2 and s["stalled"]["outputs_equal"] is False
    assert s["_reference"]["ratios"] == [3.0, 1.0]


def test_the_readme_section_is_drawn_from_the_committed_results():
    path = REPO / "benchmarks" / "results" / "l3_hit_ttft.json"
    readme = (REPO / "benchmarks" / "README.md").read_text()
    if not path.exists():   # before the first committed run there is no section either
        assert "## l3_hit_ttft\n" not in readme
        return
    assert bench.render_section(json.loads(path.read_text())) in readme
