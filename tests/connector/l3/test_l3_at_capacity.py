"""A file L3 at capacity under the controller: backups evict older pages and, with ``recycle_evicted`` (the
default), overwrite their files; what is still in L3 after a restart is loaded bit for bit, what was evicted is
recomputed (fake engine, real L3 I/O threads, real file store)."""
from __future__ import annotations

from tests.helpers.fake_engine import P, FakeEngine, Req
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
