"""``benchmarks.serve_cpu`` and ``benchmarks/make_multiturn_trace.py``: the trace format and its determinism, the
/metrics parser, the ratio, CPU and hook tables, the soak's checks and the README block of the current result."""
import argparse
import copy
import json
import os
import re
import time
from pathlib import Path

import pytest

import benchmarks.serve_cpu.__main__ as cli
from benchmarks import harness, hook_time, noop_connector
from benchmarks import make_multiturn_trace as trace
from benchmarks.harness import procs, results, stats
from benchmarks.serve_cpu import client, configs, passes, report, soak

REPO = harness.REPO

ARGS = dict(conversations=4, turns=3, first_chunks=3, turn_chunks=2, output_len=5)


def test_the_trace_is_deterministic_turn_major_and_each_turn_extends_the_last(tmp_path):
    rows = trace.make_trace(seed=7, **ARGS)
    assert rows == trace.make_trace(seed=7, **ARGS)
    a = trace.write_trace(tmp_path / "a.jsonl", rows).read_bytes()
    assert a == trace.write_trace(tmp_path / "b.jsonl", trace.make_trace(seed=7, **ARGS)).read_bytes()
    assert [(r["turn"], r["conversation"]) for r in rows] == [(t, c) for t in (1, 2, 3) for c in range(4)]
    for r in rows:
        assert set(r) >= {"timestamp", "input_length", "output_length", "hash_ids"}
        assert r["input_length"] == 32 * len(r["hash_ids"]) and r["output_length"] == 5
    by = {(r["conversation"], r["turn"]): r["hash_ids"] for r in rows}
    for c in range(4):
        assert len(by[(c, 1)]) == 3
        for t in (2, 3):
            assert by[(c, t)][:-2] == by[(c, t - 1)] and len(by[(c, t)]) == len(by[(c, t - 1)]) + 2
    other = trace.make_trace(seed=8, **ARGS)
    assert not {h for r in rows for h in r["hash_ids"]} & {h for r in other for h in r["hash_ids"]}
    st = trace.reuse_stats(rows)
    # smallest gap: conversation 0, turns 1 -> 2, the other three first turns (3 blocks each) in between;
    # largest: conversation 3, turns 2 -> 3, the other three third turns (7 blocks each) in between
    assert st["reuse_gap_blocks_min"] == 3 * 3 and st["reuse_gap_blocks_max"] == 3 * 7
    assert st["reusable_tokens"] == 32 * 4 * (3 + 5) and st["distinct_blocks"] == 4 * 7


def test_the_trace_refuses_bad_sizes():
    with pytest.raises(ValueError):
        trace.make_trace(seed=0, **{**ARGS, "turns": 0})


PROM = """# HELP vllm:prefix_cache_hits_total x
# TYPE vllm:prefix_cache_hits_total counter
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 64.0
vllm:prefix_cache_hits_total{engine="1",model_name="m"} 32.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.7e9
vllm:request_success_total{engine="0",finished_reason="length",model_name="m"} 3.0
vllm:tierkv_hit_tokens_total{engine="0",model_name="m",tier="L3"} 96.0
vllm:tierkv_l2_used_pages{engine="0",model_name="m"} 12.0
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.1",model_name="m"} 2.0
vllm:request_queue_time_seconds_sum{engine="0",model_name="m"} 0.5
vllm:request_queue_time_seconds_count{engine="0",model_name="m"} 4.0
vllm:num_requests_running{engine="0",model_name="m"} 1.0
"""


def test_metrics_are_summed_over_engines_and_keep_other_labels():
    m = stats.parse_metrics(PROM)
    assert m == {"vllm:prefix_cache_hits_total": 96.0, "vllm:request_success_total{finished_reason=length}": 3.0,
                 "vllm:tierkv_hit_tokens_total{tier=L3}": 96.0, "vllm:tierkv_l2_used_pages": 12.0,
                 "vllm:request_queue_time_seconds_sum": 0.5, "vllm:request_queue_time_seconds_count": 4.0}
    assert stats.metric(m, "vllm:request_success_total") == 3.0
    later = dict(m, **{"vllm:prefix_cache_hits_total": 160.0, "vllm:tierkv_l2_used_pages": 20.0,
                       "vllm:request_queue_time_seconds_sum": 0.9, "vllm:request_queue_time_seconds_count": 6.0})
    d = stats.deltas(later, m)
    assert d == {"vllm:prefix_cache_hits_total": 64.0, "vllm:tierkv_l2_used_pages": 20.0,
                 "vllm:request_queue_time_seconds_sum": 0.4, "vllm:request_queue_time_seconds_count": 2.0}
    assert stats.phase_means_ms(d) == {"queue": 200.0}   # 0.4 s over the run's 2 requests


#: the current result of the serving claim and of the soak (benchmarks/README.md names them)
CURRENT = "serve_cpu_house_fp32.json"
CURRENT_SOAK = "serve_cpu_soak_fp32_onednn0.json"


def _committed(name=CURRENT):
    return json.loads((REPO / "benchmarks" / "results" / name).read_text())


def test_the_current_result_renders_its_command_commit_and_headline_table():
    data = _committed()
    text = report.render_section(data, CURRENT)
    assert re.fullmatch(r"[0-9a-f]{40}", data["code"]["commit"]) and data["code"]["dirty"] == []
    assert text.startswith("```bash\n.venv/bin/python -m benchmarks.serve_cpu --preset demo --configs ")
    assert f"--dtype float32 --out benchmarks/results/{CURRENT}\n```" in text   # fp32 servers, TCMalloc (default)
    assert f"tierkv commit `{data['code']['commit'][:12]}`" in text and report.headline_table(data) in text
    soak_text = report.render_soak(_committed(CURRENT_SOAK), CURRENT_SOAK)
    assert f"--soak 2000 --dtype float32 --onednn-cache 0 --out benchmarks/results/{CURRENT_SOAK}" in soak_text


@pytest.mark.parametrize("change, says", [
    (lambda d: d["conditions"].pop("cpu"), "conditions.cpu"),
    (lambda d: d["code"].update(commit=None), "does not record the commit"),
    (lambda d: d["code"].update(dirty=["connector/l2/worker.py"]), "uncommitted changes to connector/l2/worker.py"),
])
def test_a_result_without_a_current_key_or_from_dirty_code_is_refused(change, says):
    data = copy.deepcopy(_committed())
    change(data)
    with pytest.raises(results.ResultsError, match=re.escape(says)):
        report.render_section(data, CURRENT)


def test_the_soak_file_without_a_current_key_is_refused():
    soak = copy.deepcopy(_committed(CURRENT_SOAK))
    soak["soak"].pop("checks")
    with pytest.raises(results.ResultsError, match=re.escape("soak.checks")):
        report.render_soak(soak)


def test_the_kv_usage_gauge_is_read_from_the_raw_text():
    text = ('# TYPE vllm:kv_cache_usage_perc gauge\nvllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25\n'
            'vllm:kv_cache_usage_perc_other 3\n')
    assert stats.raw_samples(text, "vllm:kv_cache_usage_perc") == [0.25]
    assert "vllm:kv_cache_usage_perc" in soak.KV_USAGE_GAUGES


def _soak_record(**change):
    procs = {"python3:10": {"name": "python3", "threads": 20, "rss_kib": 1000},
             "VLLM::EngineCor:11": {"name": "VLLM::EngineCor", "threads": 40, "rss_kib": 4000}}
    s = dict(configs.SOAK, requests=80, run={"completed": 80, "failed": 0}, client_error=None,
             server_alive_at_end=True,
             zmq_kill={"done": True, "counted_at_kill": 30, "killed_exit_code": -9, "restart_s": 1.0},
             idle={"kv_usage_gauge": "vllm:kv_cache_usage_perc", "kv_usage": 0.0, "locked_pages": 0,
                   "free_slots": 300, "l2_pages": 84, "num_slots": 384, "ctl_pending_jobs": 0, "l3_pending_jobs": 0,
                   "ctl_fetching_pages": 0, "ctl_backing_up_pages": 0},
             procs_after_warmup=procs, procs_at_end=copy.deepcopy(procs))
    for k, v in change.items():
        k1, _, k2 = k.partition("__")
        if k2:
            s[k1] = dict(s[k1], **{k2: v})
        else:
            s[k1] = v
    return s


def test_soak_checks_pass_on_a_clean_record():
    checks = soak.soak_checks(_soak_record())
    assert {n: c["result"] for n, c in checks.items()} == {n: "PASS" for n in checks}


@pytest.mark.parametrize("change, fails", [
    (dict(run={"completed": 79, "failed": 1}), "no_failed_request"),
    (dict(zmq_kill={"done": False, "error": "RuntimeError: no ready line"}), "zmq_killed_and_restarted"),
    (dict(idle__kv_usage=0.01), "kv_cache_usage_idle_0"),
    (dict(idle__locked_pages=3), "locked_pages_0"),
    (dict(idle__free_slots=299), "free_plus_l2_eq_num_slots"),
    (dict(idle__l3_pending_jobs=1), "pending_jobs_0"),
    (dict(idle__ctl_backing_up_pages=2), "fetching_backing_up_0"),
    (dict(procs_at_end={"python3:10": {"name": "python3", "threads": 21, "rss_kib": 1000},
                        "VLLM::EngineCor:11": {"name": "VLLM::EngineCor", "threads": 40, "rss_kib": 4000}}),
     "threads_as_after_warmup"),
    (dict(procs_at_end={"python3:10": {"name": "python3", "threads": 20, "rss_kib": 1060},
                        "VLLM::EngineCor:11": {"name": "VLLM::EngineCor", "threads": 40, "rss_kib": 4000}}),
     "rss_growth_under_limit"),
])
def test_soak_checks_fail_on_each_problem(change, fails):
    checks = soak.soak_checks(_soak_record(**change))
    assert [n for n, c in checks.items() if c["result"] == "FAIL"] == [fails]


def test_ratios_pair_runs_of_the_same_repeat_and_compare_random_with_no_connector():
    def run(w, c, r, rps, p99):
        return {"workload": w, "concurrency": c, "repeat": r, "request_throughput": rps, "p99_ttft_ms": p99}
    data = {"selection": {"workloads": ["multiturn", "random"], "concurrency": [4], "repeats": 1, "rounds": 3},
            "configs": {
                "ideal": {"runs": [run("multiturn", 4, 0, 10.0, 100.0), run("multiturn", 4, 1, 20.0, 100.0),
                                   run("random", 4, 0, 99.0, 1.0)]},
                "none": {"runs": [run("random", 4, 0, 8.0, 1.0), run("random", 4, 2, 4.0, 1.0)]},
                "tierkv_l2": {"runs": [run("multiturn", 4, 0, 9.0, 150.0), run("multiturn", 4, 1, 20.0, 110.0),
                                       run("multiturn", 4, 2, 5.0, 1.0), run("random", 4, 0, 8.0, 1.0),
                                       run("random", 4, 2, 2.0, 1.0)]}}}
    # repeat 2 of multiturn has no ideal run: left out; random is paired with no connector, not the ideal
    assert report.paired_ratios(data, "tierkv_l2", "ideal", "multiturn", 4, "request_throughput") == [0.9, 1.0]
    assert report.paired_ratios(data, "tierkv_l2", "none", "random", 4, "request_throughput") == [1.0, 0.5]
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in report.ratio_table(data).splitlines()}
    assert "| 0.90-1.00, 0.95 | ideal | >= 0.95 | yes | 1.10-1.50, 1.30 | 2 | 2.00 |" in rows[("tierkv_l2", "multiturn", "4")]
    assert "| 0.50-1.00, 0.75 | none | >= 0.97 | no | - | 2 | 2.00 |" in rows[("tierkv_l2", "random", "4")]
    assert report.spread(data, "ideal", "random", 4) is None            # one run: no spread
    # the do-nothing connector is compared with no connector on every workload, without a target
    data["configs"]["noop_connector"] = {"runs": [run("multiturn", 4, 0, 9.0, 1.0), run("random", 4, 0, 6.0, 1.0)]}
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): line for line in report.ratio_table(data).splitlines()}
    assert "| 0.75-0.75, 0.75 | none | - | - | - | 1 | 2.00 |" in rows[("noop_connector", "random", "4")]
    assert "| - | none | - | - |" in rows[("noop_connector", "multiturn", "4")]  # no run of none on multiturn


def test_the_noop_connector_is_complete_and_answers_nothing():
    """``noop_connector``: vLLM's connector path with nothing behind it. The class must implement every abstract
    hook (vLLM refuses to instantiate it otherwise) and offer no external token."""
    kvc = configs.kv_config("noop_connector", dict(configs.FULL), Path("/nonexistent"), None)
    assert kvc == {"kv_connector": "NoopConnector", "kv_connector_module_path": "noop_connector",
                   "kv_role": "kv_both"}
    mod = noop_connector
    cls = getattr(mod, kvc["kv_connector"])
    assert not cls.__abstractmethods__
    conn = object.__new__(cls)  # no vLLM config needed for hooks that keep no state
    assert conn.get_num_new_matched_tokens(object(), 0) == (0, False)
    assert isinstance(conn.build_connector_meta(object()), mod.NoopMetadata)


def test_the_cpu_table_splits_each_run_by_process_and_counts_tierkv_threads_wherever_they_run():
    def run(w, cpu):
        return {"workload": w, "concurrency": 8, "repeat": 0, "cpu_s": cpu}
    tk = {"python:1": 2.0, "python:1/python": 2.0, "VLLM::EngineCor:2": 4.0, "VLLM::EngineCor:2/tkv-stats-sched": 0.5,
          "VLLM::Worker:3": 34.0, "VLLM::Worker:3/VLLM::Worker": 32.0, "VLLM::Worker:3/tkv-l3-write": 1.5,
          "total": 40.0}
    tk2 = dict(tk, **{"VLLM::Worker:3": 54.0, "VLLM::Worker:3/tkv-l3-write": 3.5, "total": 60.0})
    data = {"configs": {"none": {"runs": [run("random", {"VLLM::Worker:9": 30.0, "VLLM::EngineCor:8": 2.0,
                                                         "total": 33.0})]},
                        "tierkv_l3_file": {"runs": [run("random", tk), run("random", tk2),
                                                    {"workload": "multiturn", "concurrency": 8, "repeat": 0}]}}}
    assert report.cpu_parts(tk) == {"total": 40.0, "worker": 34.0, "engine_core": 4.0, "tierkv_threads": 2.0}
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): [c.strip() for c in line.split("|")[4:-1]]
            for line in report.cpu_table(data).splitlines()[2:]}
    # tierkv threads 2.0 of 40 s (5 %) and 4.0 of 60 s (6.7 %); a run without cpu_s (older results) is left out
    assert rows[("tierkv_l3_file", "random", "8")] == ["2", "40.0-60.0", "34.0-54.0", "4.0", "2.00-4.00", "5.0-6.7 %"]
    assert rows[("none", "random", "8")] == ["1", "33.0", "30.0", "2.0", "0.00", "0.0 %"]
    assert ("tierkv_l3_file", "multiturn", "8") not in rows
    assert report.cpu_table({"configs": {"none": {"runs": [{"workload": "random", "concurrency": 1}]}}}) == ""
    # a ZMQ-L3 configuration's runs record the `tierkv server` process apart: one more column, "-" where absent
    data["configs"]["tierkv_l3_zmq"] = {"runs": [dict(run("random", tk), l3_server_cpu_s=0.41),
                                                 dict(run("random", tk2), l3_server_cpu_s=0.73)]}
    lines = report.cpu_table(data).splitlines()
    assert lines[0].endswith("| `tierkv server` process |") and lines[1].count("---") == 10
    rows = {tuple(c.strip() for c in line.split("|")[1:4]): [c.strip() for c in line.split("|")[4:-1]]
            for line in lines[2:]}
    assert rows[("tierkv_l3_zmq", "random", "8")][-1] == "0.41-0.73"
    assert rows[("tierkv_l3_file", "random", "8")][-1] == "-"


def test_hook_time_per_run_is_the_change_of_each_role_and_its_share_of_the_run(tmp_path):
    sdir = tmp_path / "stats"
    sdir.mkdir()

    def write(sched, workers):
        (sdir / "scheduler-1.json").write_text(json.dumps({"role": "scheduler", "pid": 1, "hook_seconds": sched}))
        for i, w in enumerate(workers):  # one file per worker process (TP ranks): summed
            (sdir / f"worker-{10 + i}.json").write_text(json.dumps({"role": "worker", "pid": 10 + i,
                                                                      "hook_seconds": w}))
    write(1.0, [2.0, 3.0])
    before = stats.settled_stats(sdir, quiet_s=0.2)
    write(1.25, [2.5, 3.5])
    assert stats.hook_delta(stats.settled_stats(sdir, quiet_s=0.2), before) == {"scheduler": 0.25, "worker": 1.0}
    assert stats.hook_delta({}, before) == {}

    def run(conc, hooks, duration):
        return {"workload": "random", "concurrency": conc, "repeat": 0, "duration": duration, "tierkv_hook_s": hooks}
    data = {"configs": {"none": {"runs": [{"workload": "random", "concurrency": 8, "repeat": 0, "duration": 5.0}]},
                        "tierkv_l2": {"runs": [run(8, {"scheduler": 0.05, "worker": 0.15}, 10.0),
                                               run(8, {"scheduler": 0.1, "worker": 0.2}, 5.0)]}}}
    rows = [[c.strip() for c in line.split("|")[1:-1]] for line in report.hook_table(data).splitlines()[2:]]
    # (0.05 + 0.15) / 10 s = 2 %, (0.1 + 0.2) / 5 s = 6 %; no connector: no row
    assert rows == [["tierkv_l2", "random", "8", "2", "0.05-0.10", "0.15-0.20", "2.0-6.0 %"]]
    assert report.hook_table({"configs": {"none": data["configs"]["none"]}}) == ""


def test_set_overrides_a_size_and_refuses_unknown_keys_and_bad_values():
    p = dict(configs.FULL)
    assert configs.parse_sets(["pr_prefix_len=1536", "pr_output_len=4"], p) == {"pr_prefix_len": 1536,
                                                                                "pr_output_len": 4}
    for bad, says in (("pr_prefix=3", "KEY one of"), ("preset=bench", "KEY one of"), ("pr_prefix_len", "KEY=INT"),
                      ("pr_prefix_len=0", "positive"), ("pr_prefix_len=x", "positive")):
        with pytest.raises(ValueError, match=says):
            configs.parse_sets([bad], p)


def test_the_command_names_the_changed_sizes_and_the_server_flags():
    data = copy.deepcopy(_committed())
    data["params"] = dict(data["params"], pr_prefix_len=1536)
    data["conditions"]["server_env"] = {k: v for k, v in data["conditions"]["server_env"].items() if k != "LD_PRELOAD"}
    cmd = report.command(data, "serve_cpu_long.json")
    assert cmd.startswith(".venv/bin/python -m benchmarks.serve_cpu --preset demo --configs ideal,none,")
    assert "--rounds 2 --set pr_prefix_len=1536 --dtype float32 --allocator glibc " in cmd
    assert cmd.endswith("--out benchmarks/results/serve_cpu_long.json")


def test_server_flags_name_only_what_differs_from_the_defaults():
    env = {"VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}
    tc = dict(env, LD_PRELOAD="/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4")
    assert configs.server_flags({"server_env": tc, "server_dtype": "bfloat16"}) == ""
    assert configs.server_flags({"server_env": tc, "server_dtype": "float32"}) == "--dtype float32 "
    assert configs.server_flags({"server_env": env, "server_dtype": "float32"}) == "--dtype float32 --allocator glibc "
    assert configs.server_flags({}) == ""   # older than both fields: bf16, allocator unknown
    capped = dict(tc, ONEDNN_PRIMITIVE_CACHE_CAPACITY="0")
    assert configs.server_flags({"server_env": capped, "server_dtype": "float32"}) == "--dtype float32 --onednn-cache 0 "
    assert configs.allocator_text({"server_env": capped, "server_dtype": "float32"}) == (
        "TCMalloc preloaded, model and KV cache in float32, oneDNN's primitive cache capped at 0 "
        "(`ONEDNN_PRIMITIVE_CACHE_CAPACITY`)")
    assert "oneDNN" not in configs.allocator_text({"server_env": tc})


def test_the_cpu_table_shows_the_client_and_what_ran_elsewhere_on_the_machine():
    def run(busy, client, total, **kw):
        return dict({"workload": "random", "concurrency": 8, "repeat": 0, "cpu_s": {"VLLM::Worker:3": total,
                     "total": total}, "machine_cpu_s": {"busy": busy, "client": client}}, **kw)
    data = {"configs": {"none": {"runs": [run(40.0, 3.0, 36.0), run(41.0, 3.5, 36.5)]},
                        "tierkv_l3_zmq": {"runs": [run(44.0, 3.0, 38.0, l3_server_cpu_s=0.5,
                                                       idle_cpu_s={"none": 0.2})]}}}
    assert report.elsewhere_cpu_s(data["configs"]["none"]["runs"][0]) == pytest.approx(1.0)
    # the tierkv server and an idle server (--interleave) are measured processes, not "elsewhere"
    assert report.elsewhere_cpu_s(data["configs"]["tierkv_l3_zmq"]["runs"][0]) == pytest.approx(2.3)
    assert report.elsewhere_cpu_s({"cpu_s": {"total": 1.0}}) is None
    lines = report.cpu_table(data).splitlines()
    assert lines[0].endswith("| client | elsewhere on the machine |") and lines[1].count("---") == 12
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[-3:-1]] for line in lines[2:]}
    assert rows == {"none": ["3.0-3.5", "1.0"], "tierkv_l3_zmq": ["3.0", "2.3"]}
    # busy time is the whole machine's since boot: this process's own 0.05 CPU s show in it (others may add more);
    # the children's count only waited-for children, and none ended meanwhile
    a, c, t = procs.machine_cpu_seconds(), procs.children_cpu_seconds(), time.process_time()
    while time.process_time() - t < 0.05:
        pass
    assert procs.machine_cpu_seconds() - a >= 0.03 and procs.children_cpu_seconds() == c


def test_the_hook_time_table_shows_each_sides_ms_per_step_of_the_committed_result():
    data = json.loads((REPO / "benchmarks" / "results" / "hook_time.json").read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", data["code"]["commit"]) and data["code"]["dirty"] == []
    row = data["configs"]["tierkv_l2"]["runs"][0]
    assert f"| {row['sched_ms_per_step']} ({row['sched_cpu_ms_per_step']}) |" in hook_time.render(data)


def test_rounds_rotate_the_order_of_the_configurations():
    """Over as many rounds as configurations, each configuration runs once at each position."""
    configs = ["ideal", "none", "tierkv_l2", "tierkv_l3_file"]
    orders = [passes.round_order(configs, k) for k in range(4)]
    assert orders[0] == configs and orders[1] == ["none", "tierkv_l2", "tierkv_l3_file", "ideal"]
    for pos in range(4):
        assert sorted(o[pos] for o in orders) == sorted(configs)
    assert passes.round_order(configs, 5) == orders[1] and passes.round_order([], 3) == []


def test_interleaved_runs_keep_every_server_up_and_run_the_configurations_back_to_back(monkeypatch, tmp_path):
    """``--interleave``: all servers start before the first run and stop after the last; each (repeat, workload,
    concurrency) cell runs every configuration once, in an order rotated from cell to cell; each run is told the
    other servers, which idle; a server that failed to start is left out of the runs, and still stopped."""
    events = []

    class FakeServer:
        def __init__(self, name, p, args, model_dir, work, pythonpath, traces, round_no=0):
            self.name, self.out = name, {"runs": [], "failures": []}

        def start(self):
            events.append(("start", self.name))
            return self.name != "broken"

        def run(self, workload, c, r, idle=()):
            events.append(("run", self.name, workload, c, r, tuple(o.name for o in idle)))
            run = {"workload": workload, "concurrency": c, "repeat": r}
            self.out["runs"].append(run)
            return run

        def finish(self):
            events.append(("finish", self.name))
            return self.out

    monkeypatch.setattr(passes, "ConfigServer", FakeServer)
    monkeypatch.setattr(passes, "wait_quiet", lambda servers: events.append(("quiet", sorted(x.name for x in servers)))
                        or 0.5)
    args = argparse.Namespace(configs=["none", "broken", "tierkv_l2", "noop_connector"], workloads=["random"],
                                    concurrency=[4, 8], repeats=2)
    records = passes.run_interleaved({}, args, "m", tmp_path, "", {})
    names = ["none", "broken", "tierkv_l2", "noop_connector"]
    assert events[:4] == [("start", n) for n in names] and events[-4:] == [("finish", n) for n in names]
    runs = [e for e in events if e[0] == "run"]
    for i, e in enumerate(events):   # before each run, the other servers were waited quiet
        if e[0] == "run":
            assert events[i - 1] == ("quiet", sorted(e[5]))
    up = ["none", "tierkv_l2", "noop_connector"]
    cells = [(r, c) for r in range(2) for c in (4, 8)]
    assert len(runs) == 3 * len(cells)
    for k, (r, c) in enumerate(cells):
        got = runs[3 * k:3 * k + 3]
        assert [e[1] for e in got] == passes.round_order(up, k)
        assert all(e[2:5] == ("random", c, r) for e in got)
        assert all(sorted(e[5]) == sorted(n for n in up if n != e[1]) for e in got)
    assert [run["position"] for run in records["none"]["runs"]] == [0, 2, 1, 0]
    assert {run["quiet_wait_s"] for cs in records.values() for run in cs["runs"]} == {0.5}
    assert records["broken"]["runs"] == []


def test_the_idle_servers_cpu_is_reported_for_an_interleaved_pass():
    data = {"configs": {"none": {"runs": [{"workload": "random", "concurrency": 4, "repeat": 0, "cpu_s": {"total": 9.5},
                                           "idle_cpu_s": {"tierkv_l2": 0.02, "noop_connector": 0.03}}]},
                        "tierkv_l2": {"runs": [{"workload": "random", "concurrency": 8, "repeat": 1,
                                                "cpu_s": {"total": 7.0}, "idle_cpu_s": {"none": 0.01}}]}}}
    assert report.idle_text(data) == (" The idle servers used at most 0.05 CPU s in all during one run (none, random "
                                     "c4 r0, whose own server used 9.5 s).")
    data["configs"]["none"]["runs"][0].pop("idle_cpu_s")
    data["configs"]["tierkv_l2"]["runs"][0].pop("idle_cpu_s")
    assert report.idle_text(data) == ""


@pytest.mark.parametrize("name", [c for c in configs.CONFIGS if c not in ("ideal", "none", "noop_connector")])
def test_every_tierkv_configuration_is_a_valid_connector_config(name, tmp_path):
    """Each configuration's ``kv_connector_extra_config`` loads through the connector's own parser; the L3
    configurations hold the same L2 bytes, so ``tierkv_l3_file_p4``'s pages of 4 blocks come in a quarter the
    number."""
    from tierkv.connector.core.config import config_from_extra

    p = dict(configs.FULL)
    kvc = configs.kv_config(name, p, tmp_path, "tcp://127.0.0.1:5555", l3_root=str(tmp_path / "l3"))
    cfg = config_from_extra(kvc["kv_connector_extra_config"])
    blocks = 1 if cfg.page_size is None else cfg.page_size // configs.BLOCK
    assert blocks == (configs.P4_BLOCKS if name == "tierkv_l3_file_p4" else 1)
    l2_blocks = cfg.host_pool.num_pages * blocks
    small = name.startswith("tierkv_l3_file_small")
    assert l2_blocks == (p["l2_pages"] if name == "tierkv_l2" else p["small_l2_pages"] if small else p["l3_l2_pages"])
    assert (cfg.l3.backend == "file") == (name in ("tierkv_l3_file", "tierkv_write_back", "tierkv_l3_file_shm",
                                                    "tierkv_l3_file_p4", "tierkv_l3_file_selective",
                                                    "tierkv_l3_file_gil_default", "tierkv_l3_file_full",
                                                    "tierkv_l3_file_full_writer_normal", "tierkv_l3_file_pause_prefill",
                                                    "tierkv_l3_file_pause_forward") or small)
    assert (cfg.l3.file or {}).get("capacity_bytes") == ("64MiB" if name.startswith("tierkv_l3_file_full") else
                                                         configs.small_l3_bytes(p) if small else None)
    assert cfg.controller.write_policy == {"tierkv_write_back": "write_back",
                                           "tierkv_l3_file_selective": "write_through_selective"}.get(
                                               name, "write_through")
    assert cfg.controller.gil_switch_interval_s == (0.0 if name == "tierkv_l3_file_gil_default" else 0.05)
    assert cfg.controller.writer_priority == "normal"  # (the default since session 33; _writer_normal says so)
    assert cfg.controller.backup_pause == name.removeprefix("tierkv_l3_file_pause_") if "_pause_" in name \
        else cfg.controller.backup_pause == "never"


def test_every_server_gets_tcmalloc_preloaded_or_the_allocator_named(monkeypatch, tmp_path):
    from tierkv import engine_env
    ldconfig = ("\tlibtcmalloc_minimal_debug.so.4 (libc6,x86-64) => /lib/x86_64-linux-gnu/libtcmalloc_minimal_debug.so.4\n"
                "\tlibtcmalloc_minimal.so.4 (libc6,x86-64) => /lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4\n")
    assert engine_env.tcmalloc_path(ldconfig) == "/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4"
    assert engine_env.tcmalloc_path("\tlibc.so.6 (libc6,x86-64) => /lib/x86_64-linux-gnu/libc.so.6\n") is None
    lib = tmp_path / "libtcmalloc_minimal.so.4"
    monkeypatch.setattr(engine_env, "tcmalloc_path", lambda: str(lib))
    assert cli.preload_env is engine_env.preload_env  # the benchmarks' servers and the demo's: one owner
    env = engine_env.preload_env("tcmalloc")
    assert env == {"LD_PRELOAD": str(lib)}
    assert engine_env.preload_env("glibc") == {}
    with pytest.raises(ValueError, match="allowed: tcmalloc, glibc"):
        engine_env.preload_env("jemalloc")
    monkeypatch.setattr(engine_env, "tcmalloc_path", lambda: None)
    with pytest.raises(RuntimeError, match="--allocator glibc"):
        engine_env.preload_env("tcmalloc")
    assert configs.allocator_text({"server_env": env}) == "TCMalloc preloaded"
    assert "no TCMalloc" in configs.allocator_text({"server_env": {}})


def test_random_runs_get_seeds_whose_prompts_share_no_first_page_within_or_between_runs():
    base = {key: client.run_seed(*key) for key in [("random", 1, 0), ("random", 1, 1), ("random", 8, 0)]}
    page = [[7] * 32, [8] * 32, [9] * 32, [10] * 32]

    def prompts_of(key, seed):
        if seed == base[("random", 1, 0)]:
            return [page[0] + [1], page[1] + [2]]
        if seed == base[("random", 1, 1)]:  # its first page was sent by run (1, 0)
            return [page[1] + [3], page[2]]
        if seed == base[("random", 8, 0)]:  # a page twice in the run itself
            return [page[3] + [4], page[3] + [5]]
        if seed == base[("random", 8, 0)] + client.SEED_STEP:  # the first page differs in one token: disjoint
            return [page[3], [10] * 31 + [11]]
        return [page[2][:31] + [99]]  # (1, 1)'s next try; only its first 32 tokens count
    got = client.disjoint_seeds(list(base), prompts_of)
    assert got == {("random", 1, 0): base[("random", 1, 0)],
                   ("random", 1, 1): base[("random", 1, 1)] + client.SEED_STEP,
                   ("random", 8, 0): base[("random", 8, 0)] + client.SEED_STEP}
    assert client.run_seed("random", 1, 1, got) == got[("random", 1, 1)]
    assert client.run_seed("multiturn", 1, 1, got) == client.run_seed("multiturn", 1, 1)
    assert report.random_seed_text({}) == ""  # older results: their seeds were run_seed's
    assert "c1-r1 102105" in report.random_seed_text({"random_seeds": {"c1-r0": 2002, "c1-r1": 102105}})
    with pytest.raises(RuntimeError, match="no seed among 3"):
        client.disjoint_seeds([("random", 1, 0), ("random", 1, 1)], lambda key, seed: [page[0]], tries=3)


def test_client_prompts_are_what_vllm_bench_serve_sends_tokenized_as_the_server_does(tmp_path):
    maker = harness.make_tiny_model()
    model = maker.make_model(tmp_path / "m", "test", quiet=True)
    p = dict(configs.QUICK, rnd_num_prompts=3, rnd_input_len=64)
    a = client.client_prompts(model, client.workload_args(p, "random", 5, None))
    assert len(a) == 3 and all(len(t) == 64 for t in a)
    assert a == client.client_prompts(model, client.workload_args(p, "random", 5, None))
    b = client.client_prompts(model, client.workload_args(p, "random", 6, None))
    assert [t[:32] for t in a] != [t[:32] for t in b]
    # vLLM's random dataset: consecutive ids of its allowed (non-special) tokens from a random offset
    assert all(t[2] - t[1] in (1, 1 - (maker.PRESETS["test"]["vocab_size"] - maker.NUM_SPECIAL)) for t in a)


def test_the_heap_watch_table_lists_the_largest_stacks_and_says_why_a_process_has_none():
    hw = {"41": {"allocations": 3, "mib": 2.5, "top": [{"mib": 2.0, "allocations": 2, "stack": "a.py:1 <- b.py:2"},
                                                      {"mib": 0.5, "allocations": 1, "stack": "c.py:3"}]},
          "42": {"error": "ModuleNotFoundError: No module named 'memray'"}}
    text = report.heap_table(hw, top=1)
    assert "| 2.00 | 2 | `a.py:1 <- b.py:2` |" in text and "c.py:3" not in text
    assert "2.50 MiB in 3 allocations" in text and "(PID 41)" in text
    assert "process 42: no result (ModuleNotFoundError" in text
    assert report.heap_table(None) == ""


def test_heap_report_names_each_process_whose_capture_failed(tmp_path):
    (tmp_path / "error-7").write_text("ImportError: no memray\n")
    assert soak.heap_report(tmp_path, wait_s=0) == {"7": {"error": "ImportError: no memray"}}
    assert "no capture" in soak.heap_report(tmp_path / "empty", wait_s=0)["none"]["error"]


def test_the_heap_watch_hook_waits_for_its_process_and_start_marker_and_reports_what_stopped_it(tmp_path):
    """The sitecustomize hook in a Python process named as the watched one: nothing before START; after it, a capture
    (memray importable) or an error file saying why not; the process keeps its extra thread either way."""
    import subprocess
    import sys
    code = ("import threading, time, os, sys\n"
            "names = lambda: sorted(t.name for t in threading.enumerate())\n"
            "print(names(), flush=True)\n"
            "sys.stdin.readline()\n"  # the test made START
            "d = os.environ['TIERKV_HEAP_WATCH']\n"
            "end = time.monotonic() + 60\n"
            "while not [f for f in os.listdir(d) if f.startswith(('error-', 'memray-'))] and time.monotonic() < end:\n"
            "    time.sleep(0.05)\n"
            "print(names(), flush=True)\n")
    env = dict(os.environ, PYTHONPATH=str(soak.HEAP_WATCH_DIR), TIERKV_HEAP_WATCH=str(tmp_path),
               TIERKV_HEAP_WATCH_PROC="python", TIERKV_HEAP_WATCH_MEMRAY=str(tmp_path / "no-memray-here"))
    p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                         env=env)
    try:
        first = p.stdout.readline()
        assert "heap-watch" in first and not list(tmp_path.iterdir())
        (tmp_path / "START").touch()
        p.stdin.write("\n")
        p.stdin.flush()
        second = p.stdout.readline()
        assert "heap-watch" in second
        made = sorted(f.name for f in tmp_path.iterdir())
        try:
            import memray  # noqa: F401
            assert f"memray-{p.pid}.bin" in made
        except ImportError:
            assert made == ["START", f"error-{p.pid}"]
            assert "memray" in (tmp_path / f"error-{p.pid}").read_text()
    finally:
        (tmp_path / "STOP").touch()
        p.stdin.close()
        p.wait(timeout=30)


def test_a_failed_thread_check_names_the_threads_that_came_or_went():
    def procs_of(api, worker):
        return {"python3:10": {"name": "python3", "threads": sum(api.values()), "rss_kib": 1000, "thread_names": api},
                "VLLM::Worker:12": {"name": "VLLM::Worker", "threads": sum(worker.values()), "rss_kib": 4000,
                                    "thread_names": worker}}
    s = _soak_record(procs_after_warmup=procs_of({"python3": 9, "ZMQbg/IO/0": 1}, {"VLLM::Worker": 50, "tkv-l3-w": 1}),
                     procs_at_end=procs_of({"python3": 10, "ZMQbg/IO/0": 1}, {"VLLM::Worker": 50, "tkv-l3-w": 1}))
    c = soak.soak_checks(s)["threads_as_after_warmup"]
    assert c["result"] == "FAIL"
    assert c["value"]["changed"] == {"python3:10": {"python3": 1}}
    assert c["value"]["VLLM::Worker:12"] == [51, 51]
    same = soak.soak_checks(_soak_record())["threads_as_after_warmup"]
    assert same["result"] == "PASS" and "changed" not in same["value"]
    names = procs.thread_names(os.getpid())
    assert sum(names.values()) == len(os.listdir(f"/proc/{os.getpid()}/task")) and names
