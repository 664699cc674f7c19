"""``tierkv plan`` through the real console script: the table and JSON for a timed_trace, the chart, and bad input as
one line with exit code 2 (tierkv/cli_plan.py, tierkv/cli_common.py); the page size read off a timed_trace in
Mooncake's format (one hash id per 512 tokens, tierkv/plan_chunks.py)."""
import json
import random

import pytest

from tests.helpers.cli import one_line_error, tierkv
from tierkv.cli_common import CliError
from tierkv.cli_plan import read_trace, replay
from tierkv.plan_chunks import detect


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


def mooncake_like(path, chunk=512, requests=40, seed=0, bad=0):
    """A trace in Mooncake's published format: one hash id per ``chunk`` tokens, ``input_length`` not a multiple of
    it (the last chunk cut), prompts sharing a few prefixes; the first ``bad`` requests' lengths disagree with their
    ids."""
    rng = random.Random(seed)
    prefixes = [list(range(100 * p, 100 * p + rng.randrange(2, 6))) for p in range(4)]
    rows, nid = [], 10_000
    for i in range(requests):
        ids = list(rng.choice(prefixes)) + list(range(nid, nid + rng.randrange(1, 4)))
        nid += 10
        n_in = chunk * (len(ids) - 1) + rng.randrange(1, chunk + 1)
        if i < bad:
            n_in = chunk * (len(ids) + 3)
        rows.append({"timestamp": i * 1000, "input_length": n_in, "output_length": rng.randrange(1, 300),
                     "hash_ids": ids})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def test_plan_reads_the_chunk_size_off_a_mooncake_trace(tmp_path):
    trace = tmp_path / "mooncake.jsonl"
    mooncake_like(trace, bad=3)  # a few odd requests do not hide the chunk size
    r, out = tierkv("plan", str(trace), "--l2", "64", "--l3", "0", "--json", json_out=True)
    assert r.returncode == 0, r.stderr
    assert out["page_size"] == 512 and out["page_size_from"] == "detected"
    given = replay(read_trace(str(trace), 512), 64)
    assert out["results"][0]["l2_tokens"] == given["l2_tokens"] > 0
    r = tierkv("plan", str(trace), "--l2", "64")
    assert r.returncode == 0 and "page 512 tokens (detected from the trace: 37 of 40 requests" in r.stdout
    # the default of earlier versions, given explicitly: refused, naming the flag and the size the trace shows
    r = tierkv("plan", str(trace), "--l2", "64", "--page-size", "32")
    line = one_line_error(r)
    assert r.returncode == 2 and "--page-size 32 disagrees with the trace" in line and "--page-size 512" in line


@pytest.mark.parametrize("chunk", [16, 32, 256, 512, 1024])
def test_chunk_size_detected_for_any_chunk(tmp_path, chunk):
    trace = tmp_path / "t.jsonl"
    mooncake_like(trace, chunk=chunk, seed=chunk)
    t = read_trace(str(trace))
    assert (t.page_size, t.page_size_from, t.chunks.agree, t.chunks.total) == (chunk, "detected", 40, 40)


def test_chunk_size_of_whole_chunks_and_of_traces_that_tell_nothing(tmp_path):
    trace = tmp_path / "t.jsonl"
    multiturn(trace)  # input_length = 32 x ids exactly (benchmarks/make_multiturn_trace.py)
    assert read_trace(str(trace)).page_size == 32
    assert read_trace(str(trace), 32).page_size_from == "given"
    # lengths unrelated to the ids: no size explains them, with or without --page-size
    rows = [{"input_length": 1000 + 7 * i, "hash_ids": list(range(i % 3 + 2 + 9 * (i % 2)))} for i in range(12)]
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    for ps in (None, 64):
        with pytest.raises(CliError, match="--page-size") as e:
            read_trace(str(trace), ps)
        assert e.value.code == 2
    # one id per request tells nothing: the default page size when it fits
    trace.write_text("".join(json.dumps({"input_length": 20 + i, "hash_ids": [i]}) + "\n" for i in range(5)))
    assert (read_trace(str(trace)).page_size, read_trace(str(trace)).page_size_from) == (32, "default")
    assert detect([(6955, 14), (1500, 3), (512, 1), (0, 0)]).size == 512


def plan_in_process(capsys, *argv):
    """``tierkv plan ARGV`` in this process (what the console script runs): (exit code, stdout, stderr)."""
    import argparse

    from tierkv.cli_plan import add_arguments, run
    code = run(add_arguments(argparse.ArgumentParser()).parse_args(list(argv)))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_plan_sizes_in_bytes_need_the_page_bytes(tmp_path, capsys):
    trace = tmp_path / "t.jsonl"
    multiturn(trace)
    code, out, _ = plan_in_process(capsys, str(trace), "--l2", "8MiB,64", "--l3", "0,1GiB", "--page-bytes", "1MiB",
                                   "--json")
    assert code == 0
    res = json.loads(out)
    assert res["page_bytes"] == 1 << 20
    # L2 holds pages of 1 MiB; an L3 record is the page and its 64-byte header
    assert {(r["l2_pages"], r["l3_pages"]) for r in res["results"]} == {(8, 0), (64, 0), (8, 1023), (64, 1023)}
    assert all(r["l2_bytes"] == r["l2_pages"] << 20 for r in res["results"])
    code, out, _ = plan_in_process(capsys, str(trace), "--l2", "8MiB", "--page-bytes", "1048576")
    assert code == 0 and "page 1,048,576 bytes" in out.splitlines()[1]
    for argv, flag in ((("--l2", "8GiB"), "--l2"), (("--l3", "0,100GiB"), "--l3"),
                       (("--l2", "8GiB", "--page-bytes", "lots"), "--page-bytes"),
                       (("--l2", "8 parsecs", "--page-bytes", "4096"), "--l2")):
        code, _, err = plan_in_process(capsys, str(trace), *argv)
        assert code == 2 and flag in err and len(err.strip().splitlines()) == 1, err
    code, _, err = plan_in_process(capsys, str(trace), "--l3", "100GiB")
    assert "needs --page-bytes" in err
