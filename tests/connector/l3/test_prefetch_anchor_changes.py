"""A prefetch whose path changes while its read runs (L2 eviction, reset_cache, other saves, a deferred
drop after a load failure) attaches nothing under an invalid anchor at completion."""
from __future__ import annotations


import pytest

from tests.helpers import fake_engine
from tests.helpers.fake_engine import P, FakeEngine, Req, inject_copy_fault



from tests.helpers.l3_scenarios import (assert_nothing_reserved, complete_async_load, drain_backups, file_store, keys_of, l2_run, l3_keys, l3io, start_async_load, toks, wait_ios, write_to_l3)

# ================================================================ the path changes while a prefetch reads
TOUCHES = ("l2_eviction", "reset_cache", "other_request_saves", "drop_after_copy_fault",
               "drop_after_checksum_failure")


def _corrupt_l2_page(e, slot):
    """Flip one byte of an L2 page in place (the slot's recorded checksum stays: a verified load detects it)."""
    page = e.host.read_page(slot).clone()
    page[page.numel() // 2] ^= 0xFF
    e.host.write_page(slot, page)


@pytest.mark.parametrize("touch", TOUCHES)
def test_a_prefetch_completing_after_its_path_changed_attaches_nothing_under_an_invalid_anchor(
        tmp_path, monkeypatch, touch):
    """Prefetch completion must not graft pages under an anchor whose state changed during the I/O. tierkv's anchor is
    the prefetch's index path (locked from the order to the report, so nothing on it can be evicted, reset or dropped
    meanwhile) and, when the hit starts in L2, the L2 copies of its leading pages, which the request loads at
    completion. While the read of prompt X hangs: other requests evict L2 around the path; reset_cache drops every
    unlocked page; another request (device hit) saves X's pages into L2 itself; a request loading X's first pages from
    L2 fails (a copy fault) so they must be dropped (pages computed on a broken prefix), deferred while the path is
    locked. After completion the invariants hold at every step, the prefetched pages are not left under a dropped
    anchor, the request gets only pages with the right bytes and X is a whole hit again afterwards."""
    doc = toks(1, 8 * P)
    write_to_l3(tmp_path, [doc])
    e = FakeEngine(num_slots=24, num_blocks=96, store=file_store(tmp_path, {0: {}}), scheduler_exists=True,
                   controller={"prefetch_policy": "wait_complete"})
    keys = keys_of(e, doc)
    faulty = l3io(e).store
    anchored = touch.startswith("drop_after") or touch == "l2_eviction"
    if anchored:                                           # pages 0-1 in L2 first: the prefetch builds on them
        assert e.run_l3(Req("w", doc[:2 * P] + [1])) == 2 * P
        e.settle()
        assert l2_run(e, keys) == 2
    a = Req("a", doc + [2])
    ext = start_async_load(e, a, 8)
    faulty.set_faults(hang_get=True)
    e.step(compute=False)
    assert faulty.wait_hanging(1, timeout=10)
    job = next(iter(l3io(e)._prefetches.values())).job
    assert job.fetch == [not anchored or i >= 2 for i in range(8)]
    e.sched.check_invariants()
    first_invalid = None                                   # first page that must be dropped
    if touch == "l2_eviction":
        for k in range(5):                                 # 20 pages through 16 free slots
            drain_backups(e)
            e.run_l3(Req(f"o{k}", toks(100_000 * (k + 1), 4 * P) + [1]))
            e.sched.check_invariants()
        assert e.sched.counters.evicted_pages > 0
        assert l2_run(e, keys) == 2                        # the anchor (older than every other page) stayed
    elif touch == "reset_cache":
        e.run_l3(Req("o", toks(100_000, 4 * P) + [1]))
        drain_backups(e)
        assert e.sched.reset()
        e.sched.check_invariants()
        assert l2_run(e, keys_of(e, toks(100_000, 4 * P))) == 0                   # unlocked pages went
        assert e.sched.index.match_prefix(keys, require_l2=False).num_pages == 8  # the locked path stayed
    elif touch == "other_request_saves":
        d = Req("d", doc + [9])                            # its prefix is in L1 (device hit): it saves X's pages
        e.sched.add_request("d", d.tokens)
        assert e.sched.lookup("d", 8 * P) == 0
        d.blocks = [e.free_blocks.pop(0) for _ in range(9)]
        e.sched.on_alloc("d", d.blocks, 0)
        e.running["d"] = d
        e.step()                                           # computes its blocks, saves pages 0-7 into L2
        e.finish(d)
        e.sched.check_invariants()
        assert l2_run(e, keys) == 8                        # X's pages have L2 copies before the read ended
    else:
        c = Req("c", doc[:2 * P] + [5])                    # loads pages 0-1 from L2, synchronously
        if touch == "drop_after_copy_fault":
            inject_copy_fault(monkeypatch, layer=1)
            first_invalid = 0                              # a failed copy fails the whole load
        else:
            m = e.sched.index.match_prefix(keys[:2], require_l2=True)
            _corrupt_l2_page(e, m.host_slots[1])
            first_invalid = 1
        assert e.admit(c) == 2 * P
        e.step()
        monkeypatch.undo()
        assert "c" in e.rolled_back and e.sched.counters.load_failed_requests == 1
        assert e.sched._drops                              # deferred: the prefetch locks the path
        e.step()                                           # c recomputes
        e.finish(c)
        e.sched.check_invariants()
    faulty.release()
    wait_ios(e)
    e.step(compute=False)                                  # poll (copies into a's blocks) + the job's report
    assert "a" in e.recv and job.job_id not in e.sched.ctl._jobs
    e.sched.check_invariants()
    m = e.sched.index.match_prefix(keys, require_l2=False)
    if first_invalid is not None:                          # the drop ran: nothing stayed under the failed page
        assert m.num_pages == first_invalid and not e.sched._drops
    else:
        assert m.num_pages == 8 and l2_run(e, keys) == 8   # published
    assert e.sched.allocator.num_free + len(e.sched.index.all_slots()) == e.sched.num_slots
    want = 8 * P if first_invalid is None or touch == "drop_after_copy_fault" else first_invalid * P
    assert complete_async_load(e, a, ext) == want          # checks the bytes of every page it got
    e.settle()
    assert_nothing_reserved(e)
    assert e.run_l3(Req("again", doc + [3])) == 8 * P      # X whole again (recomputed pages saved), right bytes
    e.settle()
    assert_nothing_reserved(e)
    e.close()


# ================================================================ a prefetch and unmade saves
def test_a_prefetch_never_hands_its_request_an_l2_anchor_page_whose_save_was_not_made(tmp_path, monkeypatch):
    """The save of X's pages 0-1 raised inside a hook: slots unwritten, the index still lists them in L2. A later L3 hit
    of those 2 L2 pages + 6 L3 pages must not copy the unwritten slots into its blocks: recomputed from page 0. Before
    the fix a prefetch copied its leading L2 pages without the checks a synchronous load makes."""
    doc = toks(1, 8 * P)
    write_to_l3(tmp_path, [doc])
    e = FakeEngine(num_slots=24, num_blocks=96, store=file_store(tmp_path), scheduler_exists=True,
                   controller={"prefetch_policy": "wait_complete"})
    keys = keys_of(e, doc)
    assert l3io(e).store.batch_delete(l3_keys(e, 0, keys[:2])) == 2

    def failing_save(*_a, **_k):
        raise RuntimeError("injected save fault")
    w = Req("w", doc[:2 * P] + [1])
    assert e.admit(w) == 0
    monkeypatch.setattr(fake_engine.kernels, "save_pages", failing_save)
    e.step()
    monkeypatch.undo()
    e.finish(w)
    e.settle()
    assert e.worker.counters.save_failed_pages == 2 and l2_run(e, keys) == 2
    a = Req("a", doc + [2])
    ext = start_async_load(e, a, 8)
    assert complete_async_load(e, a, ext) == 0          # checks every page it was given
    e.settle()
    e.sched.check_invariants()
    e.close()


