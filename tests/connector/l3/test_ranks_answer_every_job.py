"""Tensor-parallel ranks with different stores each answer every job once; the scheduler acts on a job
only when every rank reported and takes the page-wise AND of their answers."""
from __future__ import annotations



from tests.helpers.fake_engine import P, FakeEngine, Req



from tests.helpers.l3_scenarios import (assert_nothing_reserved, complete_async_load, file_store, keys_of, l2_run, l3_keys, l3io, start_async_load, toks, vllm_finished_aggregation, write_to_l3)

# ================================================================ ranks that disagree
def test_ranks_whose_stores_differ_each_answer_every_job_once_and_the_hit_is_the_page_wise_and(tmp_path):
    """TP ranks must not issue a different number/size of collectives. tierkv has no collective: one scheduler half
    decides, every worker rank answers every job with exactly one report, whatever its store did, and the scheduler
    merges the reports page by page (AND). Rank 1's store lacks pages 5-7 of prompt A, fails the read of page 3 of
    prompt B and reads 20 ms slower than rank 0: both ranks answer both existence queries and both prefetches once,
    A gets the agreed 5 pages (rank 0's 8 are not used) and B the leading 3 that both ranks read intact; the pages
    rank 0 read beyond that are freed, never published; later both prompts are whole L2 hits on both ranks."""
    a, b = toks(1, 8 * P), toks(50_000, 8 * P)
    write_to_l3(tmp_path, [a, b], tp_size=2)
    e = FakeEngine(store=file_store(tmp_path, {1: {"delay_get_s": 0.02}}), tp_size=2)
    vllm_finished_aggregation(e)
    ka, kb = keys_of(e, a), keys_of(e, b)
    r1 = l3io(e, 1).store
    assert r1.inner.batch_delete(l3_keys(e, 1, ka[5:])) == 3              # rank 1 holds only pages 0-4 of A
    r1.set_faults(fail_get_keys=l3_keys(e, 1, kb[3:4]))                    # and cannot read page 3 of B
    assert e.run_l3(Req("ra", a + [2])) == 5 * P                           # run_l3 checks the bytes on both ranks
    assert e.run_l3(Req("rb", b + [2])) == 3 * P
    e.settle()
    c = e.sched.ctl.counters
    assert c.exists_queries == 2 and c.exists_found_pages == 5 + 8
    assert c.prefetch_loaded_pages == 5 + 3 and c.prefetch_failed_pages == 1
    w0, w1 = l3io(e, 0).counters, l3io(e, 1).counters
    assert (w0.exists_jobs, w1.exists_jobs) == (2, 2)                       # one report per rank and job
    assert (w0.prefetch_jobs, w1.prefetch_jobs) == (2, 2)
    assert (w0.prefetch_pages, w1.prefetch_pages) == (5 + 8, 5 + 7)         # rank 0's extra pages were not used
    e.sched.check_invariants()
    for rid, d in (("ra2", a), ("rb2", b)):                                 # recomputed pages were saved again
        assert e.run_l3(Req(rid, d + [3])) == 8 * P
    e.settle()
    e.idle_check()
    e.close()


def test_a_job_acts_only_once_every_rank_reported_and_a_hung_rank_blocks_nothing_else(tmp_path):
    """The scheduler must not act on one rank's view. Rank 1's read hangs (policy wait_complete) while rank 0
    read every page and reported: nothing is published, the staging slots stay pinned, the request is not named
    finished (vLLM waits for every rank), a second request for the same pages waits for this read instead of
    starting another, and an unrelated request is served from L2 meanwhile (no deadlock). Once rank 1 reports, the
    pages are published and both requests load the right bytes on both ranks."""
    a, other = toks(1, 4 * P), toks(70_000, 4 * P)
    write_to_l3(tmp_path, [a], tp_size=2)
    e = FakeEngine(store=file_store(tmp_path, {1: {}}), tp_size=2, controller={"prefetch_policy": "wait_complete"})
    vllm_finished_aggregation(e)
    assert e.run_l3(Req("o", other + [1])) == 0                              # computed: in L2 on both ranks
    e.settle()
    faulty = l3io(e, 1).store
    req = Req("b", a + [2])
    ext = start_async_load(e, req, 4)
    faulty.set_faults(hang_get=True)
    e.step(compute=False)                                                   # the job goes to both ranks
    assert faulty.wait_hanging(1, timeout=10)
    assert l3io(e, 0).wait_idle(10)                                         # rank 0 is done
    staged = sorted(e.sched.ctl.staging_slots())
    assert len(staged) == 4
    for _ in range(3):
        e.step(compute=False)
    assert l3io(e, 0).counters.prefetch_jobs == 1                           # rank 0's report was delivered
    assert e.sched.ctl.pending_jobs() == 1                                  # ... and the job is still open
    assert sorted(e.sched.ctl.staging_slots()) == staged
    assert all(e.sched.allocator.is_allocated(s) for s in staged)
    assert l2_run(e, keys_of(e, a)) == 0                                    # nothing published
    assert "b" not in e.recv
    e.sched.add_request("c", a + [3])
    assert e.sched.lookup("c", 0) is None                                   # waits for b's read
    assert e.run_l3(Req("o2", other + [2])) == 4 * P                        # others are served meanwhile
    faulty.release()
    assert complete_async_load(e, req, ext) == 4 * P
    assert l2_run(e, keys_of(e, a)) == 4
    assert e.sched.lookup("c", 0) == 4 * P and not e.sched.lookup_is_async("c")
    e.sched.on_finished("c")
    e.settle()
    assert e.sched.ctl.counters.prefetch_jobs == 1                          # one read served both requests
    assert_nothing_reserved(e)
    e.close()


def test_an_existence_answer_that_hangs_on_one_rank_delays_no_request_and_arrives_anded(tmp_path):
    """Rank 0 answers an existence query at once, rank 1's answer hangs. The lookup keeps waiting on rank 0's
    answer alone (nothing is indexed from one rank), gives up after ``exists_wait_s`` (the request goes on without
    L3: no hang), and the late merged answer indexes the minimum over ranks (rank 1 holds 4 of 6 pages), which the
    next request loads."""
    now = [0.0]
    a = toks(1, 6 * P)
    write_to_l3(tmp_path, [a], tp_size=2)
    e = FakeEngine(store=file_store(tmp_path, {1: {"hang_exists": True}}), tp_size=2, clock=lambda: now[0],
                   controller={"exists_wait_s": 1.0})
    vllm_finished_aggregation(e)
    faulty = l3io(e, 1).store
    assert faulty.inner.batch_delete(l3_keys(e, 1, keys_of(e, a)[4:])) == 2
    e.sched.add_request("b", a + [2])
    assert e.sched.lookup("b", 0) is None
    e.step(compute=False)
    assert faulty.wait_hanging(1, timeout=10)
    assert l3io(e, 0).wait_idle(10)
    e.step(compute=False)
    assert e.sched.lookup("b", 0) is None                                   # rank 0's answer alone is not used
    assert e.sched.index.total_pages == 0
    now[0] += 1.5
    assert e.sched.lookup("b", 0) == 0                                      # bounded: goes on without L3
    assert e.sched.ctl.counters.exists_late_answers == 1
    e.sched.on_finished("b")
    faulty.release()
    e.settle()
    m = e.sched.index.match_prefix(keys_of(e, a), require_l2=False)
    assert m.num_pages == 4 and all(m.in_l3)                                # the AND of 6 (rank 0) and 4 (rank 1)
    assert e.run_l3(Req("c", a + [3])) == 4 * P
    e.settle()
    assert_nothing_reserved(e)
    e.close()


