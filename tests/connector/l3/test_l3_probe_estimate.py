"""A probe's read replaces a stale fetch estimate: one slow L3 read must not keep declining hits for several probe
intervals (counts on the fake engine with the real file store, under a fake clock)."""
from __future__ import annotations

from tests.helpers.fake_engine import P, FakeEngine, Req
from tierkv.storage_backends.file.store import FileStore


def _docs():
    return [list(range(1000 * i, 1000 * i + 4 * P)) for i in range(1, 5)]


def _file_store(root):
    def make(rank, ns, page_bytes):
        return FileStore(ns, page_bytes, root=str(root))
    return make


def test_a_probe_read_replaces_a_stale_slow_fetch_estimate(tmp_path):
    docs = _docs()
    e1 = FakeEngine(store=_file_store(tmp_path))
    for i, d in enumerate(docs):
        e1.run_l3(Req(f"w{i}", d + [1]))
    e1.settle()
    e1.close()

    now = [1000.0]
    e = FakeEngine(store=_file_store(tmp_path), clock=lambda: now[0])
    ctl = e.sched.ctl
    assert e.run_l3(Req("cold", docs[0] + [2])) == 4 * P   # the process's first read: not a sample
    e.settle()
    ctl.observe_prefill(0.010 * P, P)      # recomputing: 10 ms per token, 10 * P ms per page
    ctl.fetch_s_per_page.add(2.0)          # one slow read: 2 s per page
    assert e.run_l3(Req("declined", docs[1] + [2])) == 0
    assert ctl.counters.l3_declined_slow_pages == 4
    e.settle()
    now[0] += ctl.probe_interval_s + 1.0   # the estimate is stale: the next hit goes ahead as a probe
    assert e.run_l3(Req("probe", docs[2] + [2])) == 4 * P
    assert ctl.counters.l3_probe_hits == 1
    e.settle()
    # the probe read 4 pages from the page cache, far below recomputing them: its time is the estimate now, and the
    # next hit (within the same probe interval) loads instead of being declined again
    assert ctl.fetch_s_per_page.value < 0.010 * P
    assert e.run_l3(Req("after", docs[3] + [2])) == 4 * P
    assert ctl.counters.l3_declined_slow_pages == 4 and ctl.counters.l3_probe_hits == 1
    e.settle()
    e.idle_check()
    e.close()
