"""``tierkv plan --admission``: each L3 admission mode replayed on one scripted trace (tierkv/plan_admission.py).

The trace: document D, two one-time prompts, D again, a third one-time prompt, D a third time; 4 pages each, L2 of 4
pages (it holds one prompt), L3 of 1024 pages (it holds everything written).
"""
import json

import pytest

from tests.helpers.cli import one_line_error, tierkv
from tierkv.cli_common import CliError
from tierkv.cli_plan import read_trace, replay

PS = 32


def scripted(path):
    d = [0, 1, 2, 3]
    once = [[10 + 4 * i + j for j in range(4)] for i in range(3)]
    order = [d, once[0], once[1], d, once[2], d]
    path.write_text("".join(json.dumps({"timestamp": i, "input_length": PS * 4, "output_length": 0, "hash_ids": ids})
                            + "\n" for i, ids in enumerate(order)))


@pytest.mark.parametrize("mode, written, l3_pages_hit, rejected, rejected_hits", [
    ("always", 16, 6, 0, 0),        # every page; D's 3 lookup pages served from L3 twice
    ("second_sight", 4, 3, 16, 3),  # only D, once its second request saw it; that request paid the rejection
    ("reused_in_l2", 0, 0, 20, 6),  # nothing is ever hit in an L2 of one prompt: 5 prompts evicted, rejected
])
def test_each_admission_on_a_scripted_trace(tmp_path, mode, written, l3_pages_hit, rejected, rejected_hits):
    f = tmp_path / "t.jsonl"
    scripted(f)
    r = replay(read_trace(str(f), PS, output_pages=False), 4, 1024, admission=mode)
    assert r["l3_written_pages"] == written
    assert r["l3_tokens"] == l3_pages_hit * PS and r["l2_tokens"] == 0
    assert r["ctl_admission_rejected_pages"] == rejected
    assert r["ctl_admission_rejected_hit_pages"] == rejected_hits


def test_plan_admission_json_and_table(tmp_path):
    f = tmp_path / "t.jsonl"
    scripted(f)
    r, out = tierkv("plan", str(f), "--l2", "4", "--l3", "1024", "--page-size", str(PS), "--no-output-pages",
                    "--admission", "always,second_sight", "--page-bytes", "1MiB", "--json", json_out=True)
    assert r.returncode == 0, r.stderr
    res = {x["admission"]: x for x in out["results"]}
    assert out["admissions"] == ["always", "second_sight"]
    assert res["always"]["l3_written_bytes"] == 16 << 20 and res["second_sight"]["l3_written_bytes"] == 4 << 20
    assert res["second_sight"]["written_saved"] == pytest.approx(0.75)
    # lookups: 6 requests x 3 pages; always serves 6 of them from L3, second_sight 3
    assert res["second_sight"]["hit_rate_lost_points"] == pytest.approx(100 * 3 / 18)
    r = tierkv("plan", str(f), "--l2", "4", "--l3", "1024", "--page-size", str(PS), "--no-output-pages",
               "--admission", "second_sight,always")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert len(lines) == 4 and "second_sight" in lines[2] and "75%" in lines[2] and "16.67" in lines[2]


def test_plan_bad_admission_is_one_line(tmp_path):
    f = tmp_path / "t.jsonl"
    scripted(f)
    r = tierkv("plan", str(f), "--l3", "64", "--admission", "always,never")
    line = one_line_error(r)
    assert r.returncode == 2 and "--admission 'never'" in line and "second_sight" in line


def recorded(path, keep_first):
    """A recorded lookup trace (``trace_path``): document D (4 pages) then 3 one-time prompts, each once; the first
    request keeps its pages (request control ``keep``) when ``keep_first``."""
    head = {"tierkv_lookup_trace": 1, "page_size": PS, "l2_pages": 4, "eviction_policy": "lru"}
    recs = [{"keys": [f"{i:02x}{j:02x}" * 8 for j in range(4)], "lookup_pages": 3, "outcome": {"miss": 3 * PS}}
            for i in range(4)]
    if keep_first:
        recs[0]["keep"] = True
    path.write_text("".join(json.dumps(x) + "\n" for x in [head, *recs]))


@pytest.mark.parametrize("mode", ["second_sight", "reused_in_l2"])
@pytest.mark.parametrize("keep", [True, False])
def test_a_kept_request_of_a_recorded_trace_is_written_on_first_sight(tmp_path, mode, keep):
    f = tmp_path / "rec.jsonl"
    recorded(f, keep)
    trace = read_trace(str(f))
    assert [r.keep for r in trace.requests] == [keep, False, False, False]
    r = replay(trace, 4, 1024, admission=mode)
    assert r["l3_written_pages"] == r["ctl_admission_kept_pages"] == (4 if keep else 0)


def test_a_recorded_keep_that_is_not_a_bool_is_named(tmp_path):
    f = tmp_path / "rec.jsonl"
    recorded(f, True)
    f.write_text(f.read_text().replace('"keep": true', '"keep": 1'))
    with pytest.raises(CliError) as ei:
        read_trace(str(f))
    assert f"{f}:2:" in str(ei.value) and "'keep'" in str(ei.value)
