"""The backup/prefetch controller end to end without an engine: scheduler half + plan protocol + worker half on
real L1/L2 tensors and a real file store (the fault wrapper only where a fault must be produced on demand).

Every loaded page is checked byte for byte against the fingerprint of the tokens that produced it
(``fake_engine.fingerprint``); the invariants are listed in docs/architecture.md, "The fault model".
"""
import random
import threading

import pytest

from tests.helpers.fake_engine import P, FakeEngine, Req
from tierkv.connector.l3.controller import Controller
from tierkv.connector.l3.io import l3_key
from tierkv.connector.core.radix_index import RadixIndex
from tierkv.connector.l2.slot_allocator import SlotAllocator
from tierkv.storage_backends.faulty import FaultyBackend
from tierkv.storage_backends.file.store import FileStore


def toks(a, n):
    return list(range(a, a + n))


def file_store(root, **faults):
    def make(rank, ns, page_bytes):
        st = FileStore(ns, page_bytes, root=str(root))
        return FaultyBackend(st, **faults) if faults else st
    return make


def l3_has(engine, req, n_pages, rank=0):
    """Leading pages of ``req`` present in the rank's store, asked directly (no engine call)."""
    store = engine.ranks[rank][3].l3.store
    ns_rank = engine.ranks[rank][3].l3.rank_namespace
    keys = engine.sched.requests[req.req_id].keys.extend(req.tokens)[:n_pages] if req.req_id in engine.sched.requests \
        else None
    if keys is None:
        from tierkv.connector.core.page_hash import page_keys, request_root
        keys = page_keys(request_root(engine.sched.ns_digest), req.tokens, P)[:n_pages]
    return store.batch_exists([l3_key(ns_rank, k) for k in keys])


def write_to_l3(tmp_path, doc):
    """An earlier engine serves ``doc`` once with write_through to the file store at ``tmp_path`` and exits."""
    e1 = FakeEngine(store=file_store(tmp_path))
    e1.run_l3(Req("a", doc + [1]))
    e1.settle()
    e1.close()


def pump(e):
    """Send the pending jobs (one step), let the I/O threads end them, deliver the reports (another step)."""
    e.step(compute=False)
    for _l1, _dev, _host, w in e.ranks:
        assert w.l3.wait_idle(30)
    e.step(compute=False)


def keys_of(engine, tokens):
    from tierkv.connector.core.page_hash import page_keys, request_root
    return page_keys(request_root(engine.sched.ns_digest), tokens, P)


# ---------------------------------------------------------------- write policies
def test_write_through_backs_up_every_page_and_a_restarted_engine_loads_them_from_l3(tmp_path):
    doc = toks(100, 6 * P)
    e = FakeEngine(store=file_store(tmp_path), controller={"write_policy": "write_through"})
    assert e.run_l3(Req("a", doc + [1])) == 0
    e.settle()
    assert l3_has(e, Req("a", doc), 6) == 6
    c = e.sched.ctl.counters
    assert c.backup_stored_pages == 6 and c.backup_failed_pages == 0
    assert e.sched.index.l3_pages == 6           # acknowledged pages are marked as held by L3
    e.idle_check()
    e.close()
    # a new engine (empty L1, L2, index) on the same directory: the first request hits L3
    e2 = FakeEngine(store=file_store(tmp_path), controller={"write_policy": "write_through"})
    assert e2.run_l3(Req("b", doc + [2, 3])) == 6 * P
    c2 = e2.sched.ctl.counters
    assert c2.exists_queries == 1 and c2.exists_found_pages == 6
    assert c2.prefetch_loaded_pages == 6 and c2.l3_hit_tokens == 6 * P
    e2.settle()
    # the fetched pages are published into L2: the next request loads them synchronously from L2
    assert e2.run_l3(Req("c", doc + [4])) == 6 * P
    assert e2.sched.ctl.counters.prefetch_jobs == 1
    e2.settle()
    e2.idle_check()
    e2.close()


def test_write_through_selective_waits_for_the_hit_threshold(tmp_path):
    doc = toks(7, 4 * P)
    e = FakeEngine(store=file_store(tmp_path), controller={"write_policy": "write_through_selective",
                                                           "write_through_threshold": 2})
    e.run_l3(Req("a", doc + [1]))
    e.settle()
    assert e.sched.ctl.counters.backup_ordered_pages == 0 and l3_has(e, Req("x", doc), 4) == 0
    e.run_l3(Req("b", doc + [2]))     # first hit
    e.settle()
    assert l3_has(e, Req("x", doc), 4) == 0
    e.run_l3(Req("c", doc + [3]))     # second hit: threshold reached
    e.settle()
    assert l3_has(e, Req("x", doc), 4) == 4 and e.sched.ctl.counters.backup_stored_pages == 4
    e.run_l3(Req("d", doc + [4]))     # already in L3: not stored again
    e.settle()
    assert e.sched.ctl.counters.backup_ordered_pages == 4
    e.idle_check()
    e.close()


def test_write_back_stores_only_on_eviction_and_frees_the_slot_after_the_ack(tmp_path):
    e = FakeEngine(num_slots=8, store=file_store(tmp_path), controller={"write_policy": "write_back"})
    a, b = toks(1000, 4 * P), toks(2000, 8 * P)
    e.run_l3(Req("a", a + [1]))
    e.settle()
    assert l3_has(e, Req("x", a), 4) == 0          # nothing stored before an eviction
    e.run_l3(Req("b", b + [1]))                    # needs 8 slots: A must go, backed up first
    e.settle()
    c = e.sched.ctl.counters
    assert c.write_back_pages == 4 and c.backup_stored_pages == 4 and l3_has(e, Req("x", a), 4) == 4
    # B's pages could not be saved in the step that needed the room (the slots were pinned by the backup)
    assert e.sched.counters.save_skipped_pages > 0
    assert e.run_l3(Req("a2", a + [2])) == 4 * P   # A comes back from L3, bytes checked in run_l3
    e.settle()
    e.idle_check()
    e.close()


def test_write_back_with_failing_store_never_marks_a_page_stored(tmp_path):
    e = FakeEngine(num_slots=8, store=file_store(tmp_path, fail_set=1.0),
                   controller={"write_policy": "write_back"})
    a, b = toks(1000, 4 * P), toks(2000, 8 * P)
    e.run_l3(Req("a", a + [1]))
    e.run_l3(Req("b", b + [1]))
    e.settle()
    c = e.sched.ctl.counters
    assert c.backup_failed_pages == 4 and c.backup_stored_pages == 0
    assert c.write_back_dropped_pages == 4
    assert e.sched.index.l3_pages == 0             # never marked as stored
    e.sched.check_invariants()                     # every indexed page still has a copy
    assert e.run_l3(Req("a2", a + [2])) == 0       # A is recomputed, not loaded from nowhere
    e.settle()
    e.idle_check()
    e.close()


# ---------------------------------------------------------------- L2 eviction keeps L3 pages
def test_small_l2_under_write_through_reclaims_committed_copies(tmp_path):
    e = FakeEngine(num_slots=8, store=file_store(tmp_path), controller={"write_policy": "write_through"})
    prompts = [toks(1000 * k, 4 * P) for k in range(1, 7)]
    for k, pr in enumerate(prompts):
        e.run_l3(Req(f"p{k}", pr + [1]))
        e.settle()
    c = e.sched.ctl.counters
    assert c.backup_stored_pages == 24 and e.sched.counters.save_skipped_pages == 0
    for pr in prompts:
        assert l3_has(e, Req("x", pr), 4) == 4
    assert e.sched.index.l2_pages == 8 and e.sched.index.l3_pages == 24  # older pages kept as L3-only
    assert e.sched.ctl.make_room(8) == 8           # committed duplicates are reclaimable at once
    assert e.run_l3(Req("a", prompts[0] + [9])) == 4 * P
    assert e.run_l3(Req("f", prompts[5] + [9])) == 4 * P
    e.settle()
    e.idle_check()
    e.close()


# ---------------------------------------------------------------- faults
@pytest.mark.parametrize("sync_loads", [False, True], ids=["async", "sync"])
def test_faulty_store_30_percent_keeps_serving_correct_bytes(tmp_path, sync_loads):
    """30 % of reads, writes and existence queries fail: every page loaded is the right one, whether L3 hits are
    loaded asynchronously or before the forward of their step (a failed synchronous read rolls the request back and
    its saves of that step are not made: their backups are skipped, not sent)."""
    rng = random.Random(7)
    e = FakeEngine(num_slots=16, store=file_store(tmp_path, fail_get=0.3, fail_set=0.3, fail_exists=0.3, seed=3),
                   controller={"write_policy": "write_through"}, sync_loads=sync_loads)
    docs = [toks(500 * k, 4 * P) for k in range(1, 9)]
    hits = 0
    for i in range(40):
        d = rng.choice(docs)
        hits += e.run_l3(Req(f"r{i}", d + [i])) > 0   # run_l3 asserts every loaded page's bytes
    e.settle()
    c = e.sched.ctl.counters
    assert c.backup_failed_pages > 0 and hits > 0
    w = e.worker.l3.counters
    assert w.backup_failed_pages + w.backup_skipped_pages == c.backup_failed_pages
    assert (c.prefetch_sync_jobs > 0) == sync_loads and (e.rolled_back != set()) == sync_loads
    e.idle_check()
    e.close()


def test_a_failed_batch_does_not_stop_later_batches_and_is_stored_on_a_later_sighting(tmp_path):
    doc = toks(1, 10 * P)
    e = FakeEngine(num_slots=32, store=file_store(tmp_path), batch_pages=2,
                   controller={"write_policy": "write_through"})
    keys = keys_of(e, doc)
    ns = e.worker.l3.rank_namespace
    faulty = FaultyBackend(e.worker.l3.store, fail_set_keys=[l3_key(ns, k) for k in keys[2:4]])
    e.worker.l3.store = faulty
    e.run_l3(Req("a", doc + [1]))
    e.settle()
    c = e.sched.ctl.counters
    assert c.backup_stored_pages == 8 and c.backup_failed_pages == 2
    assert [e.sched.index.match_prefix(keys, require_l2=False).in_l3[i] for i in range(10)] == \
        [True, True, False, False] + [True] * 6   # failed pages stay invisible as L3 copies
    assert faulty.inner.batch_exists([l3_key(ns, k) for k in keys]) == 2
    faulty.set_faults(fail_set_keys=[])
    # evict L2 and sight the prompt again: it is recomputed from page 2 and the missing pages are stored now
    assert e.sched.ctl.make_room(32) == 32          # every L2 copy dropped; pages in L3 stay indexed
    ext = e.run_l3(Req("b", doc + [2]))
    assert ext == 2 * P
    e.settle()
    assert faulty.inner.batch_exists([l3_key(ns, k) for k in keys]) == 10
    e.idle_check()
    e.close()


def _hanging_l3_load(tmp_path, doc, **engine_kw):
    """An engine whose first request is an L3 hit of ``doc`` (4 pages written by an earlier engine) and whose
    prefetch read hangs in the store: returns (engine, fault wrapper, request) with the job started."""
    write_to_l3(tmp_path, doc)
    e = FakeEngine(store=file_store(tmp_path), **engine_kw)
    faulty = FaultyBackend(e.worker.l3.store)
    e.worker.l3.store = faulty
    req = Req("b", doc + [2])
    e.sched.add_request("b", req.tokens)
    assert e.sched.lookup("b", 0) is None          # existence query pending
    pump(e)
    assert e.sched.lookup("b", 0) == 4 * P and e.sched.lookup_is_async("b")
    faulty.set_faults(hang_get=True)
    req.blocks = [e.free_blocks.pop(0) for _ in range(5)]
    e.sched.on_alloc("b", req.blocks, 4 * P)
    e.waiting["b"] = req
    e.step(compute=False)                           # the job starts, the read hangs
    assert faulty.wait_hanging(1, timeout=10)
    return e, faulty, req


def test_hanging_store_releases_the_request_at_its_deadline(tmp_path):
    now = [0.0]
    e, faulty, req = _hanging_l3_load(tmp_path, toks(40, 4 * P), clock=lambda: now[0],
                                      controller={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.5,
                                                  "prefetch_timeout_per_page_s": 0.0})
    assert "b" not in e.recv
    now[0] += 0.6                                   # past the deadline (a fake clock: no sleeps)
    e.step(compute=False)
    assert "b" in e.recv                            # released without the store
    assert set(req.blocks[:4]) <= e.failed_blocks   # every page recomputed
    assert e.sched.lookup("b", 0) == 0              # asked again: its own expired fetch is not waited for
    assert e.worker.l3.counters.prefetch_deadline_misses == 1
    assert len(e.sched.ctl.staging_slots()) == 4    # still pinned: a thread may still write them
    faulty.release()
    e.worker.l3.wait_idle()
    e.step(compute=False)
    assert e.sched.ctl.staging_slots() == [] and e.sched.ctl.pending_jobs() == 0
    e.recv.clear()
    e.failed_blocks.clear()
    e.waiting.clear()
    e.free_blocks.extend(req.blocks)
    e.sched.on_finished("b")
    e.idle_check()
    e.close()


def test_abort_during_l3_load_delays_the_free_and_leaks_nothing(tmp_path):
    e, faulty, req = _hanging_l3_load(tmp_path, toks(60, 4 * P))
    free_before = len(e.free_blocks)
    e.finish(req)                                   # abort while the read hangs
    assert "b" in e.delayed                         # blocks kept until the worker acknowledged the abort
    e.step(compute=False)
    # the worker never copies into an aborted request's blocks, so they go back at once (finished_recving)
    # while the read still hangs; only the L2 staging slots stay pinned until the I/O really ended
    assert "b" not in e.delayed and len(e.free_blocks) == free_before + 5
    assert len(e.sched.ctl.staging_slots()) == 4
    faulty.release()
    e.worker.l3.wait_idle()
    e.step(compute=False)
    assert e.sched.ctl.staging_slots() == []
    assert e.worker.counters.async_load_pages == 0  # nothing copied into the aborted request's blocks
    e.idle_check()
    e.close()


# ---------------------------------------------------------------- sharing, TP, dedup, negative cache
def test_tp_ranks_report_the_minimum_and_no_rank_uses_a_page_another_lacks(tmp_path):
    doc = toks(1, 8 * P)
    e = FakeEngine(store=file_store(tmp_path), tp_size=2)
    e.run_l3(Req("a", doc + [1]))
    e.settle()
    keys = keys_of(e, doc)
    for rank in (0, 1):
        l3 = e.ranks[rank][3].l3
        assert l3.store.batch_exists([l3_key(l3.rank_namespace, k) for k in keys]) == 8
    assert e.sched.ctl.counters.backup_stored_pages == 8  # merged: a page counts once all ranks stored it
    e.close()
    e2 = FakeEngine(store=file_store(tmp_path), tp_size=2)
    r1 = e2.ranks[1][3].l3
    r1.store.batch_delete([l3_key(r1.rank_namespace, keys[3])])    # rank 1 lost page 4
    assert e2.run_l3(Req("b", doc + [2])) == 3 * P                  # the minimum over ranks
    e2.settle()
    e2.idle_check()
    e2.close()


def test_one_l3_read_serves_every_waiting_request(tmp_path):
    doc = toks(5, 4 * P)
    write_to_l3(tmp_path, doc)
    e = FakeEngine(store=file_store(tmp_path))
    assert e.admit_l3(Req("b", doc + [2])) == 4 * P
    # b's prefetch is done and published: c gets the same pages from L2, no second read
    assert e.admit_l3(Req("c", doc + [3])) == 4 * P
    assert e.sched.ctl.counters.prefetch_jobs == 1 and e.worker.l3.counters.prefetch_pages == 4
    # while a fetch runs, a second request for the same pages waits (None) instead of reading them again
    e.step()
    for r in list(e.running.values()):
        e.finish(r)
    e.settle()
    e.idle_check()
    e.close()


def test_existence_answers_are_cached_and_never_stall(tmp_path):
    now = [0.0]
    e = FakeEngine(store=file_store(tmp_path), clock=lambda: now[0],
                   controller={"negative_ttl_s": 2.0, "exists_wait_s": 1.0})
    other = toks(7000, 4 * P) + [1]
    e.sched.add_request("x1", other)
    assert e.sched.lookup("x1", 0) is None         # query started
    assert e.sched.lookup("x1", 0) is None         # pending: not asked twice
    assert e.sched.ctl.counters.exists_queries == 1
    pump(e)
    assert e.sched.lookup("x1", 0) == 0            # absent
    e.sched.add_request("x2", other)
    assert e.sched.lookup("x2", 0) == 0            # remembered: answered at once, no new query
    assert e.sched.ctl.counters.exists_queries == 1
    now[0] += 2.5                                  # the negative answer expires
    assert e.sched.lookup("x2", 0) is None and e.sched.ctl.counters.exists_queries == 2
    # an answer that does not come within exists_wait_s: the request goes on without L3
    faulty = FaultyBackend(e.worker.l3.store, hang_exists=True)
    e.worker.l3.store = faulty
    now[0] += 2.5
    e.sched.add_request("x3", toks(9000, 3 * P) + [1])
    assert e.sched.lookup("x3", 0) is None
    e.step(compute=False)
    assert faulty.wait_hanging(1, timeout=10)
    now[0] += 1.5
    assert e.sched.lookup("x3", 0) == 0 and e.sched.ctl.counters.exists_late_answers == 1
    faulty.release()
    for rid in ("x1", "x2", "x3"):
        e.sched.on_finished(rid)
    e.settle()
    e.idle_check()
    e.close()


def test_controller_rejects_bad_policies_and_deadlines():
    idx, alloc = RadixIndex(), SlotAllocator(4)
    with pytest.raises(ValueError, match="controller.write_policy.*write_through, write_through_selective, write_back"):
        Controller(idx, alloc, page_size=P, write_policy="write_sometimes")
    with pytest.raises(ValueError, match="controller.prefetch_policy"):
        Controller(idx, alloc, page_size=P, prefetch_policy="eager")
    with pytest.raises(ValueError, match="prefetch_timeout_base_s"):
        Controller(idx, alloc, page_size=P, prefetch_timeout_base_s=0)


def test_slow_l3_hits_are_declined(tmp_path):
    doc = toks(3, 4 * P)
    write_to_l3(tmp_path, doc)
    e = FakeEngine(store=file_store(tmp_path))
    e.sched.ctl.fetch_s_per_page.add(1.0)           # 1 s per page ...
    e.sched.ctl.observe_prefill(1.0, 10_000)         # ... against 0.1 ms per token: recompute is faster
    assert e.run_l3(Req("b", doc + [2])) == 0
    assert e.sched.ctl.counters.l3_declined_slow_pages == 4
    e.settle()
    e.idle_check()
    e.close()


def test_the_first_l3_reads_of_a_process_do_not_set_the_fetch_estimate(tmp_path):
    """A store client's first reads in a new process also time its set-up (a Mooncake client's first operations
    took about a second after a restart), and the first sample of the running average sets it outright: the next
    hits were declined as slower than recomputing until a probe. A read that started before the rank's first read
    ended is reported ``cold`` and not timed; the next hit's read is."""
    from tierkv.connector.core.plan import JOB_PREFETCH, JobReport, merge_reports
    doc1, doc2 = toks(3, 4 * P), toks(900, 4 * P)
    write_to_l3(tmp_path, doc1)
    write_to_l3(tmp_path, doc2)
    e = FakeEngine(store=file_store(tmp_path))
    assert e.run_l3(Req("b", doc1 + [2])) == 4 * P
    e.settle()
    assert e.sched.ctl.counters.prefetch_loaded_pages == 4
    assert e.sched.ctl.fetch_s_per_page.value is None       # the cold read is not a sample
    assert e.run_l3(Req("c", doc2 + [2])) == 4 * P
    e.settle()
    assert e.sched.ctl.fetch_s_per_page.value is not None and e.sched.ctl.fetch_s_per_page.value > 0
    e.idle_check()
    e.close()
    r = [JobReport(1, JOB_PREFETCH, [True], rank=0, seconds=0.1), JobReport(1, JOB_PREFETCH, [True], rank=1, cold=True)]
    assert merge_reports(r).cold and not merge_reports(r[:1]).cold  # one cold rank makes the job's time cold


# ---------------------------------------------------------------- backups, shutdown, long runs
def test_backups_reach_l3_without_further_engine_calls(tmp_path):
    doc = toks(11, 16 * P)
    e = FakeEngine(store=file_store(tmp_path))
    e.run_l3(Req("a", doc + [1]))                   # the step that saved the pages also handed over the backup
    assert e.worker.l3.wait_idle(10)               # no engine call: the I/O thread finishes on its own
    reader = FileStore(e.worker.l3.rank_namespace, e.host.page_bytes, root=str(tmp_path))
    keys = keys_of(e, doc)
    assert reader.batch_exists([l3_key(e.worker.l3.rank_namespace, k) for k in keys]) == 16
    reader.close()
    e.settle()
    e.close()


def test_seeded_long_run_returns_to_baseline(tmp_path):
    rng = random.Random(21)
    threads0 = threading.active_count()
    e = FakeEngine(num_blocks=128, num_slots=16, store=file_store(tmp_path, fail_get=0.05, fail_set=0.05, seed=1),
                   controller={"write_policy": "write_through"})
    threads_started = threading.active_count()
    prefixes = [toks(10_000 * k, 2 * P) for k in range(1, 21)]
    for i in range(2000):
        r = Req(f"r{i}", rng.choice(prefixes) + toks(100 * i, rng.randint(0, 2 * P)) + [i])
        if rng.random() < 0.02:                     # abort right after admission
            e.admit_l3(r)
            e.finish(r)
        else:
            e.run_l3(r)
        if i % 500 == 499:
            e.settle()
            e.idle_check()
            assert e.sched.allocator.num_free + len(e.sched.index.all_slots()) == 16
            assert threading.active_count() == threads_started
    e.settle()
    e.idle_check()
    e.close()
    assert threading.active_count() == threads0


def _manual_step(e, req, computed_after):
    """One engine step of ``req`` alone that leaves KV for ``computed_after`` tokens: plan (saves of the pages
    full after the step), 'forward' (fingerprints of the pages full after it), saves, L3 jobs."""
    e.sched.schedule_saves(req.req_id, computed_after, req.blocks)
    plan = e.sched.build_plan()
    for i in range(req.num_computed // P, computed_after // P):
        e.write_page(req, i)
    req.num_computed = computed_after
    e.worker.run_saves(plan)
    e.worker.submit_jobs(plan)
    e.worker.poll(())
    e.sched.on_reports(e.worker.take_reports())


@pytest.mark.parametrize("n_out, stored_pages", [(17, 3), (20, 3), (16, 2)])
def test_the_page_completed_in_the_last_step_is_stored_and_no_later_one(tmp_path, n_out, stored_pages):
    prompt = toks(1, 80)                    # 2.5 pages
    e = FakeEngine(store=file_store(tmp_path))
    req = Req("r", list(prompt))
    assert e.admit_l3(req) == 0
    req.blocks += [e.free_blocks.pop(0)]   # room for the decoded tokens (4 blocks = 128 tokens)
    _manual_step(e, req, 80)               # prefill; samples output 1
    for j in range(1, n_out):               # decode step j computes the KV of output j and samples output j+1
        req.tokens.append(5000 + j)
        _manual_step(e, req, 80 + j)
    req.tokens.append(5000 + n_out)         # the last sampled token: it has no KV
    e.finish(req)
    e.settle()
    kv_tokens = 80 + n_out - 1
    assert kv_tokens // P == stored_pages
    keys = keys_of(e, req.tokens)
    ns = e.worker.l3.rank_namespace
    present = e.worker.l3.store.batch_exists([l3_key(ns, k) for k in keys])
    assert present == stored_pages          # every page whose KV exists, and none beyond
    e.idle_check()
    e.close()
    # a new engine: the stored pages come back from L3 with the bytes of this request
    e2 = FakeEngine(store=file_store(tmp_path))
    probe = Req("p", req.tokens[: stored_pages * P] + [9, 9, 9])
    assert e2.run_l3(probe) == stored_pages * P
    e2.settle()
    e2.close()


def test_shutdown_drains_or_drops_whole_pages_and_says_how_many(tmp_path, caplog):
    doc = toks(300, 8 * P)
    e = FakeEngine(store=file_store(tmp_path), batch_pages=2)
    faulty = FaultyBackend(e.worker.l3.store, hang_set=True)
    e.worker.l3.store = faulty
    e.run_l3(Req("a", doc + [1]))            # 8 pages handed to the writer in 4 batches; the first one hangs
    assert faulty.wait_hanging(1, timeout=10)
    caplog.set_level("WARNING", logger="tierkv.l3")
    l3 = e.worker.l3
    releaser = threading.Timer(0.0, faulty.release)
    dropped = None
    try:
        # drain bound 0: nothing more is waited for; the queued pages are dropped and counted
        dropped = l3.close(drain_s=0.0)
    finally:
        releaser.start()
        releaser.join()
    assert dropped == 8
    assert "dropped" in caplog.text and "8 pages" in caplog.text
    reader = FileStore(l3.rank_namespace, e.host.page_bytes, root=str(tmp_path))
    keys = keys_of(e, doc)
    n = reader.batch_exists([l3_key(l3.rank_namespace, k) for k in keys])
    out = [bytearray(e.host.page_bytes) for _ in range(n)]
    assert all(reader.batch_get([l3_key(l3.rank_namespace, k) for k in keys[:n]], out))  # whole pages only
    reader.close()
    l3.store.close()


def test_preempted_request_with_backup_in_flight_leaks_nothing(tmp_path):
    doc = toks(400, 4 * P)
    e = FakeEngine(store=file_store(tmp_path))
    faulty = FaultyBackend(e.worker.l3.store, hang_set=True)
    e.worker.l3.store = faulty
    req = Req("a", doc + [1])
    e.admit_l3(req)
    e.step()                                  # saves + backup job; the backup hangs
    assert faulty.wait_hanging(1, timeout=10)
    e.preempt(req)                            # blocks back to the engine: the backup reads L2, not them
    assert e.sched.index.locked_pages > 0     # the backup pins its L2 pages until its report
    faulty.release()
    e.settle()
    assert e.sched.ctl.counters.backup_stored_pages == 4
    assert e.run_l3(Req("a", doc + [1])) == 4 * P   # re-admitted: its pages come from L2
    e.settle()
    e.idle_check()
    e.close()


def test_pages_that_fail_to_read_from_l3_are_stored_again_once_recomputed(tmp_path):
    doc = toks(800, 4 * P)
    write_to_l3(tmp_path, doc)
    e = FakeEngine(store=file_store(tmp_path))
    ns = e.worker.l3.rank_namespace
    keys = keys_of(e, doc)
    faulty = FaultyBackend(e.worker.l3.store, fail_get_keys=[l3_key(ns, keys[2])])
    e.worker.l3.store = faulty
    assert e.run_l3(Req("b", doc + [2])) == 2 * P    # page 3 failed to read: recomputed from there
    e.settle()
    m = e.sched.index.match_prefix(keys, require_l2=False)
    assert m.num_pages == 4 and m.in_l3 == [True] * 4  # the recomputed pages were backed up again
    assert e.sched.ctl.counters.backup_stored_pages == 2
    e.idle_check()
    e.close()


def test_a_worker_without_a_store_answers_every_job(tmp_path):
    e = FakeEngine(store=file_store(tmp_path))
    from tierkv.connector.l3.io import NoL3
    from tierkv.connector.core.plan import JOB_PREFETCH, Job
    e.worker.l3.close(drain_s=0)
    e.worker.l3 = NoL3()                            # as when the store could not start (CacheWorker(l3=None))
    assert e.run_l3(Req("a", toks(1, 4 * P) + [1])) == 0
    e.settle()
    c = e.sched.ctl.counters
    assert c.exists_queries == 1 and c.backup_failed_pages == 4
    assert e.sched.ctl.pending_jobs() == 0 and e.sched.index.locked_pages == 0
    e.idle_check()
    # a prefetch: its request is named ended at the next poll, every block failed (vLLM recomputes), no page read
    e.worker.l3.submit([Job(7, JOB_PREFETCH, [b"k" * 16] * 2, slots=[0, 1], req_id="r", block_ids=[5, 6],
                            fetch=[True, True])])
    assert e.worker.poll() == {"r"} and e.worker.take_failed_blocks() == {5, 6}
    assert [(r.job_id, r.ok) for r in e.worker.take_reports()] == [(7, [False, False])]
    assert e.worker.poll() == set() and e.worker.stats()["failed_load_blocks"] == 2


def test_write_back_frees_a_quarter_of_l2_ahead_of_need(tmp_path):
    e = FakeEngine(num_slots=8, store=file_store(tmp_path), controller={"write_policy": "write_back"})
    e.run_l3(Req("a", toks(1000, 4 * P) + [1]))
    e.run_l3(Req("b", toks(2000, 3 * P) + [1]))    # 7 of 8 slots used: below the quarter free
    e.settle()
    c = e.sched.ctl.counters
    assert c.write_back_pages == 4 and c.backup_stored_pages == 4   # A (least recent) backed up ahead of need
    assert e.sched.allocator.num_free >= 2 and e.sched.counters.save_skipped_pages == 0
    assert e.run_l3(Req("a2", toks(1000, 4 * P) + [2])) == 4 * P      # and still served, from L3
    e.settle()
    e.idle_check()
    e.close()


def test_shutdown_waits_for_queued_backups_but_not_for_a_read_that_hangs(tmp_path):
    """vLLM's shutdown on a store whose reads stall: the worker's ``close`` waited ``shutdown_drain_s`` for every job,
    the hung read included, and vLLM's engine waited for it too (``has_pending_push_work``) until it was killed after
    60 s. Now ``close`` ends once the queued backups reached the store (the read is abandoned, its thread a daemon),
    and a job older than ``shutdown_drain_s`` no longer keeps the engine stepping."""
    import threading
    e, faulty, req = _hanging_l3_load(tmp_path, toks(80, 4 * P))
    l3 = e.worker.l3
    done = threading.Event()
    dropped = []
    threading.Thread(target=lambda: (dropped.append(l3.close(drain_s=60.0)), done.set()), daemon=True).start()
    assert done.wait(20), "close waited for a read that hangs"
    assert dropped == [0]
    now = [0.0]
    ctl = e.sched.ctl
    ctl.clock = lambda: now[0]
    for st in ctl._jobs.values():
        st.t0 = 0.0
    assert ctl.pins_pending()                      # the hung prefetch has not reported
    now[0] = ctl.shutdown_drain_s + 0.1
    assert not ctl.pins_pending()
    faulty.release()
