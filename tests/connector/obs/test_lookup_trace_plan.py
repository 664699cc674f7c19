"""The lookup trace (config ``trace_path``, connector/obs/lookup_trace.py) and the capacity planner (``tierkv plan``,
tierkv/cli_plan.py): a trace recorded by the fake engine, replayed through the planner with the same L2 size, gives
the same L2 hit counts as the run that recorded it; the writer never fails the engine."""
import json
import logging
import random

import pytest

from tests.helpers.fake_engine import P, FakeEngine, Req
from tierkv.cli_common import CliError
from tierkv.cli_plan import read_trace, recorded_totals, replay
from tierkv.connector.core.config import ConfigError, load_config
from tierkv.connector.obs.lookup_trace import LookupTrace


def conversations(seed: int, n: int = 12, turns: int = 4) -> list[list[int]]:
    """Prompts of ``n`` conversations of ``turns`` turns in turn-major order, with a shared system prompt; turn t + 1
    extends turn t's prompt by a few tokens (not page-aligned), so prefixes are reused at several depths."""
    rng = random.Random(seed)
    system = [rng.randrange(1, 30000) for _ in range(2 * P)]
    prompts = [system + [rng.randrange(1, 30000) for _ in range(rng.randrange(P, 4 * P))] for _ in range(n)]
    out = []
    for _t in range(turns):
        for c in range(n):
            out.append(list(prompts[c]))
            prompts[c] = prompts[c] + [rng.randrange(1, 30000) for _ in range(rng.randrange(P // 2, 2 * P))]
    rng.shuffle(out[n:])  # later turns interleaved: reuse distances vary
    return out


def record(tmp_path, num_slots: int, policy: str, seed: int = 1):
    path = tmp_path / f"trace-{num_slots}-{policy}.jsonl"
    e = FakeEngine(num_blocks=64, num_slots=num_slots, policy=policy)
    e.sched.trace = LookupTrace(str(path), P, num_slots, policy)
    for i, toks in enumerate(conversations(seed)):
        e.run(Req(f"q{i}", toks))
    e.idle_check()
    e.sched.trace.close()
    return e, path


@pytest.mark.parametrize("policy", ["lru", "lfu"])
def test_recorded_trace_replays_to_the_same_l2_hits(tmp_path, policy):
    e, path = record(tmp_path, num_slots=40, policy=policy)
    run_l2 = e.sched.lookup_stats.tokens["l2"]
    assert e.sched.counters.evicted_pages > 0 and 0 < run_l2 < e.sched.counters.lookup_tokens  # L2 was too small

    lines = path.read_text().splitlines()
    assert len(lines) == 1 + len(conversations(1))  # the header and one line per lookup
    assert "30000" not in path.read_text() and all("tokens" not in json.loads(ln) for ln in lines)
    trace = read_trace(str(path))
    assert trace.kind == "tierkv" and trace.page_size == P and trace.header["eviction_policy"] == policy
    assert recorded_totals(trace)["l2"] == run_l2

    got = replay(trace, 40, 0, policy)
    assert got["l2_tokens"] == run_l2
    assert got["lookup_tokens"] == e.sched.counters.lookup_tokens
    assert got["evicted_pages"] == e.sched.counters.evicted_pages
    assert got["l2_tokens"] + got["l3_tokens"] + got["miss_tokens"] == got["lookup_tokens"]
    # the replay depends on the L2 size: a bigger L2 hits more, a smaller one less
    assert replay(trace, 96, 0, policy)["l2_tokens"] > run_l2 > replay(trace, 8, 0, policy)["l2_tokens"]
    # an L3 holding everything serves what a small L2 lost
    small = replay(trace, 8, 4096, policy)
    assert small["l2_tokens"] + small["l3_tokens"] == replay(trace, 4096, 0, policy)["l2_tokens"]


def test_timed_trace_keys_follow_prefixes(tmp_path):
    p = tmp_path / "t.jsonl"
    rows = [{"hash_ids": [1, 2, 3, 4], "input_length": 4 * 32, "output_length": 1, "timestamp": 0},
            {"hash_ids": [1, 2, 3, 9, 10], "input_length": 5 * 32 - 7, "output_length": 40, "timestamp": 1},
            {"hash_ids": [2, 3], "input_length": 64, "output_length": 1, "timestamp": 2}]  # same ids, not a prefix
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = read_trace(str(p))
    assert t.kind == "timed_trace" and [r.lookup_pages for r in t.requests] == [3, 4, 1]
    assert t.requests[1].keys[:3] == t.requests[0].keys[:3] and t.requests[1].keys[3] != t.requests[0].keys[3]
    # 153 prompt tokens + 39 computed output tokens: 6 pages; the 5th chunk is cut, so pages 4 and 5 are its own
    assert len(t.requests[1].keys) == 6
    assert t.requests[2].keys[0] not in t.requests[0].keys
    r = replay(t, 64)
    assert (r["lookup_tokens"], r["l2_tokens"]) == ((3 + 4 + 1) * 32, 3 * 32)
    assert len(read_trace(str(p), output_pages=False).requests[1].keys) == 4
    # an L1 model: vLLM's prefix cache serves the first pages, tierkv is asked for the rest
    big = replay(t, 64, l1=64)
    assert (big["l1_tokens"], big["l2_tokens"], big["miss_tokens"]) == (3 * 32, 0, 5 * 32)
    small = replay(t, 64, l1=2)  # L1 keeps the first two pages of request 0 (its first pages are freed last)
    assert (small["l1_tokens"], small["l2_tokens"], small["miss_tokens"]) == (2 * 32, 32, 5 * 32)
    assert small["hit_rate"] == big["hit_rate"] == 3 / 8
    # no L2, no L3 (tierkv reads L3 through L2)
    assert replay(t, 0, 4096)["l3_tokens"] == 0
    # an L2 of one page: request 0 saves page 0 only (the rest is skipped); it reaches L3, the skipped pages do not
    one = replay(t, 1, 4096)
    assert (one["l2_tokens"], one["l3_tokens"], one["save_skipped_pages"]) == (32, 0, 3 + 5 + 1)
    p.write_text("".join(json.dumps({"hash_ids": ids, "input_length": 32 * n, "output_length": 1}) + "\n"
                         for ids, n in (([1, 2, 3, 4], 4), ([5, 6, 7, 8], 4), ([1, 2, 3, 4, 5], 5))))
    t = read_trace(str(p))  # the second request pushes the first out of an L2 of 4 pages; L3 still has it
    assert [(r["l2_tokens"], r["l3_tokens"]) for r in (replay(t, 4), replay(t, 4, 8), replay(t, 4, 4), replay(t, 8))] \
        == [(0, 0), (0, 128), (0, 0), (128, 0)]


def test_l1_as_recorded(tmp_path):
    p = tmp_path / "rec.jsonl"
    keys = ["0a" * 16, "0b" * 16, "0c" * 16, "0d" * 16]
    rows = [{"tierkv_lookup_trace": 1, "page_size": 32, "l2_pages": 16, "eviction_policy": "lru"},
            {"t": 0, "keys": keys, "lookup_pages": 3, "outcome": {"miss": 96}},
            {"t": 1, "keys": keys, "lookup_pages": 3, "outcome": {"l1": 64, "l2": 32}}]
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    t = read_trace(str(p))
    r = replay(t, 16, l1="recorded")
    assert (r["l1_tokens"], r["l2_tokens"], r["miss_tokens"]) == (64, 32, 96) == (
        recorded_totals(t)["l1"], recorded_totals(t)["l2"], recorded_totals(t)["miss"])
    assert replay(t, 16)["l2_tokens"] == 96  # without an L1 model, L2 serves all three pages


@pytest.mark.parametrize("line,what", [
    ("{not json", "not a JSON line"),
    ('[1, 2]', "a JSON object"),
    ('{"hash_ids": [1, "x"], "input_length": 64}', "'hash_ids'"),
    ('{"hash_ids": [1, 2], "input_length": -1}', "'input_length'"),
    ('{"hash_ids": [1, 2]}', "'input_length'"),
    ('{"foo": 1}', "neither"),
    ('{"keys": ["00"], "lookup_pages": 0}', "header"),
])
def test_malformed_line_is_named(tmp_path, line, what):
    p = tmp_path / "bad.jsonl"
    p.write_text('{"hash_ids": [1, 2], "input_length": 64, "output_length": 1}\n\n' + line + "\n")
    with pytest.raises(CliError) as ei:
        read_trace(str(p))
    assert ei.value.code == 2 and f"{p}:3:" in str(ei.value) and what in str(ei.value)


def test_malformed_recorded_line_is_named(tmp_path):
    head = json.dumps({"tierkv_lookup_trace": 1, "page_size": 32, "l2_pages": 8, "eviction_policy": "lru"})
    good = json.dumps({"keys": ["00" * 16, "11" * 16], "lookup_pages": 1, "outcome": {"miss": 32}})
    for bad, what in [({"keys": ["zz" * 16], "lookup_pages": 0}, "32 hex"),
                      ({"keys": ["00" * 16], "lookup_pages": 2}, "exceeds"),
                      ({"keys": ["00" * 16], "lookup_pages": 1, "outcome": [1]}, "'outcome'")]:
        p = tmp_path / "rec.jsonl"
        p.write_text("\n".join([head, good, json.dumps(bad)]) + "\n")
        with pytest.raises(CliError) as ei:
            read_trace(str(p))
        assert f"{p}:3:" in str(ei.value) and what in str(ei.value)
    p.write_text("\n".join([head, good]) + "\n")
    assert read_trace(str(p)).requests[0].recorded == {"miss": 32}


def test_writer_oserror_is_counted_and_logged_once(tmp_path, caplog):
    e = FakeEngine(num_blocks=64, num_slots=16)
    e.sched.trace = LookupTrace(str(tmp_path / "no-such-dir" / "t.jsonl"), P, 16, "lru")
    with caplog.at_level(logging.WARNING, logger="tierkv.trace"):
        for i in range(3):
            e.sched.trace.flush()  # each flush tries to write
            assert e.run(Req(f"w{i}", list(range(3 * P)))) == (0 if i == 0 else 2 * P)
        e.sched.trace.close()
    s = e.sched.stats()
    assert s["trace_errors"] == 1 and s["trace_lines"] == 0 and s["trace_dropped_lines"] == 3
    assert len([r for r in caplog.records if "lookup trace" in r.getMessage()]) == 1
    e.idle_check()


def test_writer_buffers_and_is_bounded(tmp_path, monkeypatch):
    from tierkv.connector.obs import lookup_trace

    monkeypatch.setattr(lookup_trace, "FLUSH_LINES", 3)
    now = [0.0]
    path = tmp_path / "t.jsonl"
    w = LookupTrace(str(path), P, 4, "lru", clock=lambda: now[0])
    for i in range(2):
        w.lookup([bytes([i]) * 16], 1, {"miss": 32, "l2": 0})
    assert not path.exists()  # nothing written before a flush is due
    w.lookup([b"\x02" * 16], 1, {"miss": 32})  # the third buffered line: written now
    assert len(path.read_text().splitlines()) == 4 and w.stats()["trace_lines"] == 3
    w.lookup([b"\x03" * 16], 1, {"l2": 32})
    assert len(path.read_text().splitlines()) == 4
    now[0] = 5.0
    w.lookup([b"\x04" * 16], 1, {"l2": 32})  # a lookup after FLUSH_S seconds writes what waits
    lines = [json.loads(ln) for ln in path.read_text().splitlines()]
    assert lines[0] == {"tierkv_lookup_trace": 1, "page_size": P, "l2_pages": 4, "eviction_policy": "lru"}
    assert lines[1] == {"t": 0.0, "keys": ["00" * 16], "lookup_pages": 1, "outcome": {"miss": 32}}
    assert len(lines) == 6 and lines[-1]["t"] == 5.0
    w.close()
    w.close()


def test_trace_is_written_when_the_last_request_ends(tmp_path):
    e = FakeEngine(num_blocks=64, num_slots=16)
    path = tmp_path / "t.jsonl"
    e.sched.trace = LookupTrace(str(path), P, 16, "lru", clock=lambda: 0.0)  # no time-based flush
    a, b = Req("a", list(range(2 * P + 1))), Req("b", list(range(2 * P + 1)))
    e.admit(a)
    e.admit(b)
    e.step()
    e.finish(a)
    assert not path.exists()  # one request still runs: the lines wait in the buffer
    e.finish(b)
    assert len(path.read_text().splitlines()) == 3


def test_trace_path_config_key(tmp_path):
    assert load_config(None, {"trace_path": str(tmp_path / "t.jsonl")}).trace_path == str(tmp_path / "t.jsonl")
    assert load_config(None, {}).trace_path is None
    for bad in (str(tmp_path), str(tmp_path / "missing" / "t.jsonl"), "", 5):
        with pytest.raises(ConfigError, match="'trace_path'"):
            load_config(None, {"trace_path": bad})


def test_a_kept_request_is_recorded_with_keep(tmp_path):
    from tierkv.connector.core.request_params import RequestControls
    path = tmp_path / "trace.jsonl"
    e = FakeEngine(num_blocks=64, num_slots=16)
    e.sched.trace = LookupTrace(str(path), P, 16, "lru")
    doc = list(range(1, 2 * P + 2))
    e.sched.add_request("k", doc, controls=RequestControls(keep=True, save_max_tokens=P))
    e.run(Req("k", doc))
    e.run(Req("n", doc[:-1] + [7]))
    e.sched.trace.close()
    recs = [json.loads(ln) for ln in path.read_text().splitlines()[1:]]
    assert [(r.get("keep"), r.get("save_cap")) for r in recs] == [(True, 1), (None, None)]
    assert [r.keep for r in read_trace(str(path)).requests] == [True, False]
