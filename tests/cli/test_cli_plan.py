"""``tierkv plan`` through the real console script: the table and JSON for a timed_trace, the chart, and bad input as
one line with exit code 2 (tierkv/cli_plan.py, tierkv/cli_common.py)."""
import json

from tests.helpers.cli import one_line_error, tierkv


def multiturn(path, conversations=6, turns=3, first=4, more=2):
    """Turn-major conversations (as benchmarks/make_multiturn_trace.py writes them): turn t + 1 extends turn t."""
    rows, nid = [], 0
    prompts = []
    for _ in range(conversations):
        prompts.append(list(range(nid, nid + first)))
        nid += first
    for t in range(turns):
        for c in range(conversations):
            if t:
                prompts[c] = prompts[c] + list(range(nid, nid + more))
                nid += more
            rows.append({"timestamp": len(rows), "input_length": 32 * len(prompts[c]), "output_length": 4,
                         "hash_ids": prompts[c]})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_plan_timed_trace_json_table_and_chart(tmp_path):
    trace = tmp_path / "t.jsonl"
    multiturn(trace)
    chart = tmp_path / "plan.png"
    r, out = tierkv("plan", str(trace), "--l2", "8,64", "--l3", "0,1024", "--json", json_out=True)
    assert r.returncode == 0, r.stderr
    res = {(x["l2_pages"], x["l3_pages"]): x for x in out["results"]}
    assert out["format"] == "timed_trace" and out["requests"] == 18 and set(res) == {(8, 0), (64, 0), (8, 1024),
                                                                                       (64, 1024)}
    lookup = 32 * 6 * (3 + 5 + 7)
    reusable = 32 * 6 * (4 + 6)  # turns 2 and 3 find the conversation's previous prompt
    assert all(x["lookup_tokens"] == lookup for x in res.values())
    assert res[(64, 0)]["l2_tokens"] == reusable and res[(64, 0)]["miss_tokens"] == lookup - reusable
    assert res[(8, 0)]["l2_tokens"] < reusable  # 8 pages cannot hold the other conversations' prompts
    assert res[(8, 1024)]["l2_tokens"] + res[(8, 1024)]["l3_tokens"] == reusable
    r = tierkv("plan", str(trace), "--l2", "8,64", "--l3", "0,1024", "--chart", str(chart))
    assert r.returncode == 0, r.stderr
    assert "hit rate" in r.stdout and "L3 tokens" in r.stdout and len(r.stdout.splitlines()) == 2 + 4 + 1
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_bad_input_is_one_line(tmp_path):
    trace = tmp_path / "t.jsonl"
    rows = multiturn(trace, conversations=2, turns=1)
    trace.write_text(json.dumps(rows[0]) + "\n" + json.dumps({"hash_ids": [1, 2], "input_length": "64"}) + "\n")
    r = tierkv("plan", str(trace), "--l2", "16")
    line = one_line_error(r)
    assert r.returncode == 2 and f"{trace}:2:" in line and "input_length" in line
    trace.write_text(json.dumps(rows[0]) + "\n{oops\n")
    r = tierkv("plan", str(trace))
    assert r.returncode == 2 and f"{trace}:2: not a JSON line" in one_line_error(r)
    r = tierkv("plan", str(tmp_path / "missing.jsonl"))
    assert r.returncode == 2 and "cannot read trace" in one_line_error(r)
    trace.write_text(json.dumps(rows[0]) + "\n")
    r = tierkv("plan", str(trace), "--l2", "16,lots")
    assert r.returncode == 2 and "--l2" in one_line_error(r)
    for bad in ("recorded", "lots"):
        r = tierkv("plan", str(trace), "--l1", bad)
        assert r.returncode == 2 and "--l1" in one_line_error(r)
    r = tierkv("plan", str(trace), "--chart", str(tmp_path / "no-dir" / "c.png"))
    assert r.returncode == 2 and "cannot write chart" in one_line_error(r)


def test_plan_recorded_trace_defaults_to_its_l2_size(tmp_path):
    trace = tmp_path / "rec.jsonl"
    keys = [f"{i:032x}" for i in range(1, 5)]
    rows = [{"tierkv_lookup_trace": 1, "page_size": 16, "l2_pages": 3, "eviction_policy": "lfu"},
            {"t": 0, "keys": keys, "lookup_pages": 3, "outcome": {"miss": 48}},
            {"t": 1, "keys": keys, "lookup_pages": 4, "outcome": {"l2": 48, "miss": 16}}]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r, out = tierkv("plan", str(trace), "--json", json_out=True)
    assert r.returncode == 0, r.stderr
    assert out["format"] == "tierkv" and out["page_size"] == 16 and out["policy"] == "lfu"
    assert out["recorded"] == {"l2": 48, "miss": 64}
    [res] = out["results"]
    assert (res["l2_pages"], res["l2_tokens"], res["miss_tokens"]) == (3, 48, 64)
    r = tierkv("plan", str(trace), "--l2", "0,8")
    assert r.returncode == 0 and "recorded run (L2 3 pages, lfu): l2 48, miss 64 tokens" in r.stdout
