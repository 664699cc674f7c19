"""``tierkv plan --policy``: several eviction policies in one run (table, JSON, chart), replayed through the real
index and the file store's key policies for the L3 model; gzipped traces; bad names refused in one line."""
import gzip
import json

from tests.helpers.cli import one_line_error, tierkv
from tierkv.cli_plan import read_trace, replay
from tierkv.plan_l3 import PolicyStore
from tierkv.storage_backends.eviction import POLICIES


def scan_trace(path, cycles=6):
    """A 4-page working set used twice, then per cycle two one-time scans of 8 pages and the working set again."""
    rows, nid = [], 100

    def req(ids):
        rows.append({"timestamp": len(rows), "input_length": 32 * len(ids), "output_length": 1, "hash_ids": ids})

    work = [0, 1, 2, 3]
    req(work)
    req(work)
    for _ in range(cycles):
        for _scan in range(2):
            req(list(range(nid, nid + 8)))
            nid += 8
        req(work)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_scan_resistant_policies_beat_lru_on_a_scan_through_l2(tmp_path):
    p = tmp_path / "scan.jsonl"
    scan_trace(p)
    trace = read_trace(str(p), output_pages=False)
    hits = {pol: replay(trace, 16, 0, pol)["l2_tokens"] for pol in POLICIES}
    per_use = 32 * 3  # the working set's lookup: 3 pages (its last page is always computed)
    assert hits["lru"] == per_use  # only its immediate re-use: the scans push it out every cycle
    assert hits["slru"] == hits["s3fifo"] == hits["lfu"] == per_use * 7


def test_plan_reports_every_policy_and_reads_gzip(tmp_path):
    p = tmp_path / "scan.jsonl"
    scan_trace(p)
    gz = tmp_path / "scan.jsonl.gz"
    gz.write_bytes(gzip.compress(p.read_bytes()))
    r, out = tierkv("plan", str(gz), "--l2", "16,64", "--l3", "0,64", "--policy", "all", "--no-output-pages",
                    "--json", json_out=True)
    assert r.returncode == 0, r.stderr
    assert out["policies"] == list(POLICIES) and len(out["results"]) == 4 * 2 * 2
    got = {(x["policy"], x["l2_pages"], x["l3_pages"]): x["hit_rate"] for x in out["results"]}
    assert got[("slru", 16, 0)] > got[("lru", 16, 0)]
    assert got[("lru", 16, 64)] == got[("lru", 64, 0)]  # an L3 that holds everything serves what L2 dropped
    plain = tierkv("plan", str(p), "--l2", "16", "--policy", "lru,s3fifo", "--no-output-pages")
    chart = tmp_path / "c.png"
    zipped = tierkv("plan", str(gz), "--l2", "16", "--policy", "lru,s3fifo", "--no-output-pages", "--chart",
                    str(chart))
    assert plain.returncode == zipped.returncode == 0, zipped.stderr
    table = plain.stdout.splitlines()[1:4]
    assert table[0].split()[0] == "policy" and [t.split()[0] for t in table[1:]] == ["lru", "s3fifo"]
    assert zipped.stdout.splitlines()[1:4] == table
    assert chart.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plan_refuses_an_unknown_policy_in_one_line(tmp_path):
    p = tmp_path / "scan.jsonl"
    scan_trace(p, cycles=1)
    r = tierkv("plan", str(p), "--l2", "16", "--policy", "lru,arc")
    line = one_line_error(r)
    assert r.returncode == 2 and "--policy" in line and "lru, lfu, slru, s3fifo" in line


def test_plan_refuses_a_damaged_gzip_in_one_line(tmp_path):
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(b'{"hash_ids": [1], "input_length": 32}\n' * 50)[:-20])
    r = tierkv("plan", str(gz), "--l2", "16")
    assert r.returncode == 2 and "cannot read trace" in one_line_error(r)


def test_the_l3_model_evicts_with_the_file_stores_policy_code():
    from tierkv.storage_backends.file.evictor import Evictor

    for pol in POLICIES:
        m = PolicyStore(4, pol)
        ev = Evictor(None, "/x", 1, 0, None, None, None, pol)
        assert type(m.pages) is type(ev.order)
    m = PolicyStore(4, "s3fifo")
    for k in "abcd":
        m.write(k.encode())
    for k in "bcd":
        m.read(k.encode())
    m.write(b"e")
    assert m.leading([b"a"]) == 0 and m.leading([b"b", b"c", b"d", b"e"]) == 4


def test_l3_policy_sets_the_l3_model_alone(tmp_path, monkeypatch):
    import tierkv.plan_l3 as plan_l3

    p = tmp_path / "scan.jsonl"
    scan_trace(p, cycles=2)
    trace = read_trace(str(p), output_pages=False)
    built = []

    class Spy(PolicyStore):
        def __init__(self, capacity, policy="lru"):
            built.append(policy)
            super().__init__(capacity, policy)

    monkeypatch.setattr(plan_l3, "PolicyStore", Spy)
    row = replay(trace, 16, 64, "s3fifo", l3_policy="lru")
    assert built == ["lru"] and row["policy"] == "s3fifo" and row["l3_policy"] == "lru"
    assert replay(trace, 16, 64, "slru")["l3_policy"] == "slru" and built[-1] == "slru"
    r, out = tierkv("plan", str(p), "--l2", "16", "--l3", "64", "--policy", "slru,s3fifo", "--l3-policy", "lru",
                    "--json", json_out=True)
    assert r.returncode == 0, r.stderr
    assert out["l3_policy"] == "lru" and [x["l3_policy"] for x in out["results"]] == ["lru", "lru"]
    assert tierkv("plan", str(p), "--l3-policy", "arc").returncode == 2
