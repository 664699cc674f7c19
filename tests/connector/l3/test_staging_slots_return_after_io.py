"""Staging slots of an aborted or timed-out prefetch go back only after the I/O thread stopped writing
them; no late write lands in a slot that another owner holds."""
from __future__ import annotations

import time

import pytest

from tests.helpers import fake_engine
from tests.helpers.fake_engine import P, FakeEngine, Req



from tests.helpers.l3_scenarios import (assert_nothing_reserved, complete_async_load, drain_backups, file_store, keys_of, l2_run, l3io, start_async_load, toks, wait_ios, write_to_l3)

# ================================================================ staging slots and the I/O thread
def _record_io_writes(e, rank=0):
    """Wrap the rank's L2 ``write_page`` (what a reader calls for each fetched page): at each write note the slot and
    whether it is, right then, a staging slot of a prefetch that has not reported (allocated, held by a running job,
    in no index node). The test keeps the engine thread idle while a reader writes."""
    host = e.ranks[rank][2]
    real = host.write_page
    log = []

    def write_page(slot, src):
        owned = (e.sched.allocator.is_allocated(slot) and slot in e.sched.ctl.staging_slots()
                 and slot not in e.sched.index.all_slots())
        log.append((slot, owned))
        return real(slot, src)
    host.write_page = write_page
    return log


def _churn(e, staged, tag):
    """Other requests need L2 while the aborted read is still in the store: 5 new prompts of 4 pages (more than the
    free slots, so unlocked pages are evicted and slots freed and reused). The staging slots stay pinned and are
    never given to another page. (The engines answer existence in the scheduler, so a new prompt is a miss at once
    and nothing waits for the hung reader.)"""
    others = [toks(100_000 * (k + 1), 4 * P) for k in range(5)]
    for k, d in enumerate(others):
        drain_backups(e)                                     # their reports unlock the earlier prompts' pages
        e.run_l3(Req(f"{tag}{k}", d + [1]))
        assert sorted(e.sched.ctl.staging_slots()) == staged
        assert all(e.sched.allocator.is_allocated(s) for s in staged)
        assert not set(staged) & set(e.sched.index.all_slots())
        e.sched.check_invariants()
    assert e.sched.counters.evicted_pages > 0
    return others


def _after_release(e, writes, job, handed, others, tag):
    assert writes, "the read in the store never wrote its pages"
    assert all(owned for _s, owned in writes), f"a late write landed in a slot its job no longer owned: {writes}"
    assert [s for s, _o in writes] == handed[:2]        # the batch in the store ended; later batches were skipped
    e.step(compute=False)                                # its report frees the staging slots now
    assert e.sched.ctl.staging_slots() == [] and job.job_id not in e.sched.ctl._jobs
    assert not any(e.sched.allocator.is_allocated(s) for s in handed if s not in e.sched.index.all_slots())
    assert job.slots == handed                           # the list the reader held was never changed under it
    for k, d in enumerate(others):                       # their L2 pages hold their own bytes (verified loads)
        in_l2 = l2_run(e, keys_of(e, d))
        assert e.run_l3(Req(f"{tag}{k}-again", d + [2])) >= in_l2 * P
    assert e.worker.counters.checksum_mismatches == 0 and e.worker.counters.verified_pages > 0
    e.settle()
    assert_nothing_reserved(e)


@pytest.mark.parametrize("end", ["abort", "deadline"])
def test_staging_slots_go_back_only_after_the_io_thread_stopped_writing_them(tmp_path, end):
    """An abort must not free host slots while the storage I/O thread still reads into them. A prefetch of 8 pages
    (batches of 2) whose first batch is inside the store is aborted (or released at its deadline, request computed
    and finished); meanwhile other requests allocate, evict and free L2 slots. tierkv keeps the job's staging slots
    allocated and out of every other owner's hands until the reader finished with them (its report): the late write
    of the batch lands in the job's own slots, the other batches are skipped, the slot list the reader holds is the
    one it was given, and no other page is overwritten (verified reloads)."""
    now = [0.0]
    doc = toks(1, 8 * P)
    write_to_l3(tmp_path, [doc])
    e = FakeEngine(num_slots=24, num_blocks=96, store=file_store(tmp_path, {0: {}}), batch_pages=2,
                   scheduler_exists=True, clock=lambda: now[0],
                   controller={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.5,
                               "prefetch_timeout_per_page_s": 0.0})
    writes = _record_io_writes(e)
    faulty = l3io(e).store
    req = Req("b", doc + [2])
    ext = start_async_load(e, req, 8)
    faulty.set_faults(hang_get=True)
    e.step(compute=False)
    assert faulty.wait_hanging(1, timeout=10)
    job = next(iter(l3io(e)._prefetches.values())).job  # the job object the reader works on
    handed = list(job.slots)
    staged = sorted(e.sched.ctl.staging_slots())
    assert sorted(handed) == staged and len(staged) == 8
    if end == "abort":
        e.finish(req)
        e.step(compute=False)
        assert "b" not in e.delayed                      # its blocks went back; its staging slots did not
    else:
        now[0] += 1.0
        assert complete_async_load(e, req, ext) == 0     # released: every page recomputed, then finished
    others = _churn(e, staged, "o")
    assert not writes
    faulty.release()
    wait_ios(e)
    _after_release(e, writes, job, handed, others, "o")
    e.close()


def test_a_read_held_by_a_stopped_zmq_server_keeps_its_staging_slots_until_it_returns(tmp_path):
    """The same with a real ``tierkv server``: the server is SIGSTOPped while a prefetch's first batch is on the wire,
    the request is aborted and other requests churn L2; after SIGCONT the reply arrives and is written into the job's
    own staging slots only, which go back to the allocator with the job's report."""
    from tests.helpers.fixtures_zmq import make_backend
    doc = toks(1, 8 * P)
    page_bytes = fake_engine.LAYERS * fake_engine.HEADS * P * 2 * fake_engine.HEAD_DIM * 2
    (tmp_path / "zmq").mkdir()
    with make_backend(tmp_path / "zmq", page_bytes, bytes(16), timeout_s=20.0) as h:
        def store(rank, ns, pb):
            assert pb == page_bytes
            return h.new_client(namespace=ns)
        write_to_l3(store, [doc])
        # no backups (they would wait for the stopped server and pin the pages the churn must be able to evict)
        e = FakeEngine(num_slots=24, num_blocks=96, store=store, batch_pages=2,
                       controller={"prefetch_policy": "wait_complete", "write_policy": "write_through_selective",
                                   "write_through_threshold": 1000})
        writes = _record_io_writes(e)
        req = Req("b", doc + [2])
        start_async_load(e, req, 8)
        e.sched.ctl.exists_fn = lambda keys: 0            # the churn's new prompts: misses, without the server
        h.stop()                                          # SIGSTOP: the server answers nothing
        try:
            e.step(compute=False)
            deadline = time.monotonic() + 10
            while l3io(e).store.stats()["pending"] < 1:   # the reader's request is waiting for its reply
                assert time.monotonic() < deadline, "the read never reached the server"
                time.sleep(0.005)
            job = next(iter(l3io(e)._prefetches.values())).job
            handed = list(job.slots)
            staged = sorted(e.sched.ctl.staging_slots())
            assert sorted(handed) == staged and len(staged) == 8
            e.finish(req)
            e.step(compute=False)
            assert "b" not in e.delayed
            others = _churn(e, staged, "z")
            assert not writes
        finally:
            h.cont()
        wait_ios(e)
        _after_release(e, writes, job, handed, others, "z")
        assert l3io(e).store.stats()["timeouts"] == 0     # the reply came in time: the late write really happened
        e.close()


