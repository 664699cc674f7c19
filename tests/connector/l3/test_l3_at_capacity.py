"""A file L3 at capacity under the controller: backups evict older pages and, with ``recycle_evicted`` (the
default), overwrite their files; what is still in L3 after a restart is loaded bit for bit, what was evicted is
recomputed (fake engine, real L3 I/O threads, real file store). The workers name the pages the store evicted in
their backup reports, so the index stops taking them for L3 hits."""
from __future__ import annotations

import pytest

from tests.helpers.fake_engine import P, FakeEngine, Req
from tierkv.connector.l3.io.evicted import EvictedNames
from tierkv.storage_backends.file.store import FileStore
from tierkv.storage_backends.page_format import HEADER_BYTES

CAP_PAGES = 8
DOC_PAGES = 4


def _store(root, stores: list):
    def make(rank, ns, page_bytes):
        st = FileStore(ns, page_bytes, root=str(root), capacity_bytes=CAP_PAGES * (HEADER_BYTES + page_bytes))
        stores.append(st)
        return st
    return make


def _doc(i: int) -> list[int]:
    return list(range(1000 * (i + 1), 1000 * (i + 1) + DOC_PAGES * P))


def test_pages_backed_up_into_a_full_store_are_loaded_intact_after_a_restart(tmp_path):
    first: list = []
    e0 = FakeEngine(store=_store(tmp_path, first))
    for i in range(5):                                   # 20 pages through a store of 8: 12 evictions
        assert e0.run_l3(Req(f"w{i}", _doc(i) + [1])) == 0
    e0.settle()
    e0.close()
    st = first[0].stats()
    assert st["evictions"] == 5 * DOC_PAGES - CAP_PAGES
    assert st["recycled"] == st["evictions"]            # every eviction's file taken by a later backup
    second: list = []
    e = FakeEngine(store=_store(tmp_path, second))        # a restart: L2 empty, L3 holds the last two documents
    for i in (3, 4):
        assert e.run_l3(Req(f"r{i}", _doc(i) + [2])) == DOC_PAGES * P   # run_l3 checks every loaded page's bytes
    assert e.run_l3(Req("r0", _doc(0) + [2])) == 0        # evicted: recomputed
    e.settle()
    e.idle_check()
    e.close()


@pytest.mark.parametrize("tp_size", [1, 2])
def test_pages_l3_evicted_are_not_taken_for_l3_hits(tmp_path, tp_size):
    """Backups into a full store evict older pages; the workers name them in their backup reports, so a lookup of
    an evicted document finds no L3 hit and orders no read (before, the index kept the pages as in L3: a read that
    failed, then a recompute)."""
    stores: list = []
    e = FakeEngine(num_slots=2 * DOC_PAGES, store=_store(tmp_path, stores), tp_size=tp_size)
    ctl = e.sched.ctl
    for i in range(5):                                   # 20 pages through a store of 8 and an L2 of 8
        assert e.run_l3(Req(f"w{i}", _doc(i) + [1])) == 0
        e.settle()
    evictions = [s.stats()["evictions"] for s in stores]
    assert evictions == [5 * DOC_PAGES - CAP_PAGES] * tp_size
    assert ctl.counters.l3_evicted_pages == evictions[0]   # every eviction named (the ranks evict the same pages)
    assert ctl.counters.backup_stored_pages == 5 * DOC_PAGES
    for i in (0, 1, 2):                                  # evicted from L3, dropped from L2: recomputed, never read
        assert e.run_l3(Req(f"r{i}", _doc(i) + [2])) == 0
        e.settle()
    assert ctl.counters.prefetch_jobs == 0 and ctl.counters.prefetch_failed_pages == 0
    for _l1, _dev, _host, w in e.ranks:
        assert w.l3.counters.prefetch_failed_pages == 0 and w.l3.counters.evicted_unnamed_pages == 0
    assert ctl.counters.l3_evicted_pages == stores[0].stats()["evictions"]  # the recomputed pages' backups evicted
    e.idle_check()
    e.close()


def test_a_page_evicted_and_written_again_in_one_batch_is_reported_in_l3(tmp_path):
    """The writer's netting (:class:`EvictedNames`) on a real store of 2 records: a page whose old record a batch
    evicts and then writes again is in L3; one stored in an earlier batch and evicted in a later one is not."""
    page_bytes = 4096
    s = FileStore(bytes(16), page_bytes, root=str(tmp_path), capacity_bytes=2 * (HEADER_BYTES + page_bytes))
    names = EvictedNames(s)
    pk = {c: bytes([ord(c)]) * 16 for c in "abcde"}      # page keys, as the index names them
    lk = {c: f"{ord(c):032x}" for c in "abcde"}          # their L3 keys, as the store names them
    src = [bytes(page_bytes)] * 2

    def batch(cs: str, evicted: dict) -> None:
        res = s.batch_set([lk[c] for c in cs], src[:len(cs)])
        assert res == [True] * len(cs)
        names.after_batch([lk[c] for c in cs], [pk[c] for c in cs], res, evicted)

    job1: dict = {}
    batch("ab", job1)
    assert job1 == {}
    job2: dict = {}
    batch("ca", job2)                                    # c's room evicts a's old record, a's own room evicts b
    assert s.take_evicted() == ([], 0)
    assert list(job2) == [pk["b"]]                       # a was written again after its eviction: in L3
    job3: dict = {}
    batch("d", job3)                                     # evicts c
    batch("e", job3)                                     # evicts a
    assert list(job3) == [pk["c"], pk["a"]]
    assert names.unnamed == 0 and set(names.names) == {lk["d"], lk["e"]}


def test_pages_stored_then_evicted_by_one_backup_job_are_not_l3_hits(tmp_path):
    """One backup job of 4 pages in batches of 2 into a store of 2 records: its second batch evicts its first. The
    report says all 4 stored and names the first 2 evicted; the controller applies the eviction after the stores,
    so a later lookup reads nothing (applied the other way round, pages 0-1 would stay flagged: a failed read)."""
    def make(rank, ns, page_bytes):
        return FileStore(ns, page_bytes, root=str(tmp_path), capacity_bytes=2 * (HEADER_BYTES + page_bytes))
    e = FakeEngine(num_slots=DOC_PAGES, store=make, batch_pages=2)
    ctl = e.sched.ctl
    assert e.run_l3(Req("w0", _doc(0) + [1])) == 0
    e.settle()
    assert ctl.counters.backup_jobs == 1 and ctl.counters.backup_stored_pages == DOC_PAGES
    assert ctl.counters.l3_evicted_pages == 2
    assert e.run_l3(Req("w1", _doc(1) + [1])) == 0        # takes doc 0's L2 slots
    e.settle()
    assert e.run_l3(Req("r0", _doc(0) + [2])) == 0
    e.settle()
    assert ctl.counters.prefetch_jobs == 0 and ctl.counters.prefetch_failed_pages == 0
    e.idle_check()
    e.close()
