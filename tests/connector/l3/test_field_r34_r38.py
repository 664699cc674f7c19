"""Field scenarios R34-R38 (``shared/cases/field-scenarios.md``) translated to tierkv's design and run on the fake
engine with the real scheduler and worker halves, real L1/L2 tensors and real stores: the file store, the ZMQ cache
server (``tierkv server``, started by the storage fixtures) and a real Mooncake master. The fault wrapper
(``storage_backends/faulty.py``) is used only where a real store cannot produce the fault on demand (a read that
hangs until the test releases it, one key failing on one rank).

- R34 (TP ranks disagree in number/size of collectives): tierkv has no collectives; one scheduler decides and every
  rank answers every job with exactly one report; the scheduler acts on a job only once all ranks reported and
  merges them page by page (AND). Tested with ranks whose stores differ in content, failures and timing.
- R35 (an abort from a side queue leaks a reservation): every reservation (index locks, staging slots, pending jobs,
  room waits, existence waits, the request-side-open set) is released on every terminal path.
- R36 (slots freed while the I/O thread still uses them): staging slots of an aborted or timed-out prefetch go
  back only after the I/O thread stopped writing them; no write of the thread lands in a slot another owner has.
- R37 (prefetch completion grafts pages under an anchor that changed during the I/O): the path of a prefetch is
  touched while its read runs (L2 eviction, reset_cache, another request's saves, a load failure whose R31 drop is
  deferred); at completion nothing is attached under an invalid anchor and ``check_invariants`` holds.
- R38 (existence probes pin objects so eviction finds nothing): the file store and the ZMQ server do not refresh
  recency on a probe; Mooncake's ``batch_is_exist`` grants a read lease (``default_kv_lease_ttl``) on every object
  it finds, so tierkv must not keep probing objects it does not read.
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from tests.helpers import fake_engine
from tests.helpers.fake_engine import P, FakeEngine, Req, inject_copy_fault
from tierkv.connector.l3.io import l3_key
from tierkv.connector.core.page_hash import page_keys, request_root
from tierkv.storage_backends.faulty import FaultyBackend
from tierkv.storage_backends.file.store import FileStore



# ---------------------------------------------------------------- helpers
def toks(a, n):
    return list(range(a, a + n))


def file_store(root, faulty=None):
    """Store factory of FakeEngine: a FileStore at ``root`` per rank; ranks named in ``faulty`` (rank -> fault
    settings, possibly empty) get it wrapped in a FaultyBackend whose faults the test arms."""
    def make(rank, ns, page_bytes):
        st = FileStore(ns, page_bytes, root=str(root))
        if faulty is not None and rank in faulty:
            return FaultyBackend(st, **faulty[rank])
        return st
    return make


def write_to_l3(store, docs, tp_size=1):
    """An earlier engine serves every doc once with write_through (all ranks) and exits: L3 holds their pages.
    ``store``: a directory (file store) or a FakeEngine store factory."""
    e = FakeEngine(store=store if callable(store) else file_store(store), tp_size=tp_size)
    for i, d in enumerate(docs):
        e.run_l3(Req(f"w{i}", d + [1]))
    e.settle()
    e.close()


def keys_of(e, tokens):
    return page_keys(request_root(e.sched.ns_digest), tokens, P)


def l3_keys(e, rank, keys):
    ns = e.ranks[rank][3].l3.rank_namespace
    return [l3_key(ns, k) for k in keys]


def l3io(e, rank=0):
    return e.ranks[rank][3].l3


def wait_ios(e):
    for _l1, _dev, _host, w in e.ranks:
        assert w.l3.wait_idle(30), "L3 jobs did not end"


def pump(e):
    """Send the pending jobs (one step), let the I/O threads end them, deliver the reports (another step)."""
    e.step(compute=False)
    wait_ios(e)
    e.step(compute=False)


def drain_backups(e):
    """Let queued backups reach the store and deliver their reports (their pages are locked until then), while a
    reader may be hung on purpose (so ``wait_idle`` would not return)."""
    deadline = time.monotonic() + 10
    while any(w.l3._queued_backup_pages for _l1, _dev, _host, w in e.ranks):
        assert time.monotonic() < deadline, "backups did not reach the store"
        time.sleep(0.002)
    e.step(compute=False)


def l2_run(e, keys):
    return e.sched.index.match_len(keys, len(keys), require_l2=True)[0]


def assert_nothing_reserved(e):
    """R35's invariant: at idle every reservation is back. Index invariants, slots (indexed + free == pool), no
    lock, no job, no staging slot, no request state on either side of the controller."""
    e.idle_check()
    s, c = e.sched, e.sched.ctl
    assert s.allocator.num_free + len(s.index.all_slots()) == s.num_slots
    assert not s.requests, f"request state kept: {sorted(s.requests)}"
    assert not s._l3_since and not s._drops and not s._plan_locks
    assert not c._recv_open, f"request side still open: {c._recv_open}"
    assert not c._req_prefetch and not c._fetching and not c._backing_up
    assert not c._room_waits, f"room waits kept: {c._room_waits}"
    assert not c._exists_pending, f"existence waits kept: {c._exists_pending}"
    for _l1, _dev, _host, w in e.ranks:
        assert not w.l3._prefetches and w.l3._busy == 0 and w.l3._queued_backup_pages == 0


class _EveryRequest:
    """Identity of ``&``: lets a rank's poll leave the decision to the last rank's (see vllm_finished_aggregation)."""

    def __and__(self, other):
        return other


def vllm_finished_aggregation(e):
    """Make the engine treat ``finished_recving`` as vLLM's KVOutputAggregator does: a request's load ended once every
    rank named it, in whatever steps (FakeEngine intersects the ranks' answers within one step only)."""
    seen: dict[str, set[int]] = {}
    n = len(e.ranks)
    for rank, (_l1, _dev, _host, w) in enumerate(e.ranks):
        real = w.poll

        def poll(finished=(), _real=real, _rank=rank):
            for rid in _real(finished):
                seen.setdefault(rid, set()).add(_rank)
            if _rank < n - 1:
                return _EveryRequest()
            done = {rid for rid, rs in seen.items() if len(rs) == n}
            for rid in done:
                del seen[rid]
            return done
        w.poll = poll


def start_async_load(e, req, expect_pages, max_steps=20):
    """Look ``req`` up until the answer is known (pumping the existence query), check it is an L3 hit of
    ``expect_pages`` pages, allocate its blocks and order the prefetch (not yet handed to the workers)."""
    e.sched.add_request(req.req_id, req.tokens)
    for _ in range(max_steps):
        ext = e.sched.lookup(req.req_id, 0)
        if ext is not None:
            break
        pump(e)
    assert ext == expect_pages * P and e.sched.lookup_is_async(req.req_id), ext
    req.blocks = [e.free_blocks.pop(0) for _ in range((len(req.tokens) + P - 1) // P)]
    e.sched.on_alloc(req.req_id, req.blocks, ext)
    e.waiting[req.req_id] = req
    return ext


def complete_async_load(e, req, ext, max_steps=50):
    """After ``start_async_load``: step until every rank named the load ended, cut the hit at the first failed block
    (kv_load_failure_policy=recompute), compute the rest, check every loaded page on every rank, finish. Returns the
    tokens actually loaded."""
    for _ in range(max_steps):
        if req.req_id in e.recv:
            break
        e.step(compute=False)
        if req.req_id in e.recv:
            break
        wait_ios(e)  # (not reached for a request its deadline released while its read still hangs)
    assert req.req_id in e.recv, f"{req.req_id}: load never ended"
    e.recv.discard(req.req_id)
    e.waiting.pop(req.req_id)
    bad = [i for i, b in enumerate(req.blocks) if b in e.failed_blocks]
    if bad:
        ext = min(ext, bad[0] * P)
        e.failed_blocks -= set(req.blocks)
    e.sched.on_alloc(req.req_id, req.blocks, 0)
    req.external, req.num_computed = ext, 0
    e.running[req.req_id] = req
    e.step()
    for rank in range(e.tp_size):
        for i in range(ext // P):
            assert e.page_ok(req, i, rank), f"{req.req_id}: page {i} loaded on rank {rank} has wrong bytes"
    e.finish(req)
    return ext


# ================================================================ R34: ranks that disagree
def test_r34_ranks_whose_stores_differ_each_answer_every_job_once_and_the_hit_is_the_page_wise_and(tmp_path):
    """R34 (TP ranks issue a different number/size of collectives). tierkv has no collective: one scheduler half
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


def test_r34_a_job_acts_only_once_every_rank_reported_and_a_hung_rank_blocks_nothing_else(tmp_path):
    """R34: the scheduler must not act on one rank's view. Rank 1's read hangs (policy wait_complete) while rank 0
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


def test_r34_an_existence_answer_that_hangs_on_one_rank_delays_no_request_and_arrives_anded(tmp_path):
    """R34: rank 0 answers an existence query at once, rank 1's answer hangs. The lookup keeps waiting on rank 0's
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


# ================================================================ R35: every reservation released on every path
R35_POINTS = ("finished", "before_lookup", "waiting_for_existence", "waiting_for_room", "during_prefetch",
              "after_load_before_running", "preempted", "load_failure", "deadline_then_finish")


def _r35_engine(tmp_path, n_docs=8):
    now = [0.0]
    docs = [toks(10_000 * (i + 1), 4 * P) for i in range(n_docs)]
    write_to_l3(tmp_path, docs)
    e = FakeEngine(num_slots=16, num_blocks=96, store=file_store(tmp_path, {0: {}}), clock=lambda: now[0],
                   controller={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.5,
                               "prefetch_timeout_per_page_s": 0.0})
    return e, docs, now


def _r35_end_at(e, req, point, now, monkeypatch):
    """Drive ``req`` (a prompt of 4 pages held by L3) to ``point`` and end it there (abort, preemption, failure or
    normal finish), as vLLM would, then let every job end."""
    faulty = l3io(e).store
    rid = req.req_id
    if point == "finished":
        assert e.run_l3(req) == 4 * P
    elif point == "before_lookup":
        e.sched.add_request(rid, req.tokens)
        assert e.sched.on_finished(rid) is False
    elif point == "waiting_for_existence":
        e.sched.add_request(rid, req.tokens)
        assert e.sched.lookup(rid, 0) is None and e.sched.ctl._exists_pending
        assert e.sched.on_finished(rid) is False                          # the answer is still on its way
        pump(e)
    elif point == "waiting_for_room":
        big = toks(900_000, 16 * P)                                        # 16 pages: every L2 slot, then locked
        e.run_l3(Req(rid + "-big", big + [1]))
        holder = Req(rid + "-holder", big + [2])
        assert e.admit_l3(holder) == 16 * P                                # running: its L2 hit locks all of L2
        e.sched.add_request(rid, req.tokens)
        for _ in range(5):
            ext = e.sched.lookup(rid, 0)
            if rid in e.sched.ctl._room_waits:
                break
            assert ext is None
            pump(e)
        assert ext is None and rid in e.sched.ctl._room_waits              # waiting for room
        assert e.sched.on_finished(rid) is False
        e.finish(holder)
    elif point in ("during_prefetch", "deadline_then_finish"):
        ext = start_async_load(e, req, 4)
        faulty.set_faults(hang_get=True)
        e.step(compute=False)
        assert faulty.wait_hanging(1, timeout=10)
        if point == "during_prefetch":
            e.finish(req)                                                  # abort while the read hangs
            assert rid in e.delayed
            e.step(compute=False)
            assert rid not in e.delayed                                    # blocks back, staging still pinned
        else:
            now[0] += 10.0                                                 # past the deadline: released
            complete_async_load(e, req, ext)                               # computes and finishes; read still hangs
        assert len(e.sched.ctl.staging_slots()) == 4
        faulty.release()
        faulty.set_faults(hang_get=False)
    elif point == "after_load_before_running":
        assert e.admit_l3(req) == 4 * P
        e.finish(req)
    elif point == "preempted":
        assert e.run_l3(Req(rid + "-first", req.tokens[:-1] + [7])) == 4 * P   # now in L2: a synchronous hit
        e.settle()
        assert e.admit(req) == 4 * P
        assert e.sched.index.locked_pages == 4                             # its lock, while it runs
        e.step()
        e.preempt(req)
        assert e.sched.index.locked_pages == 0                             # released by the preemption itself
        assert e.sched.on_finished(rid) is False                           # aborted while preempted
    elif point == "load_failure":
        assert e.run_l3(Req(rid + "-first", req.tokens[:-1] + [7])) == 4 * P   # now in L2: a synchronous hit
        inject_copy_fault(monkeypatch, layer=1)
        assert e.admit(req) == 4 * P
        e.step()                                                           # the L2 -> L1 copy fails: rolled back
        monkeypatch.undo()
        assert rid in e.rolled_back and e.sched.counters.load_failed_requests >= 1
        e.step()                                                           # recomputed
        e.finish(req)
    else:
        raise AssertionError(point)
    e.settle()


def _r35_replay_all(e, docs, tag):
    declined = e.sched.ctl.counters.l3_declined_room_pages
    for i, d in enumerate(docs):
        assert e.run_l3(Req(f"{tag}-{i}", d + [5, i])) == 4 * P, f"replay of doc {i} lost its hit"
    e.settle()
    assert e.sched.ctl.counters.l3_declined_room_pages == declined
    assert_nothing_reserved(e)


@pytest.mark.parametrize("point", R35_POINTS)
def test_r35_every_terminal_path_releases_every_reservation(tmp_path, monkeypatch, point):
    """R35 (an abort from a side queue leaks the prefetch budget). tierkv's reservations are index locks, staging
    slots, pending jobs, the controller's request state (request-side-open set, room waits, existence waits, fetches
    in flight) and the scheduler's per-request state. A request ended at ``point`` (normal finish, abort before its
    lookup, while its existence answer is pending, while it waits for L2 room, during its L3 read, after its load
    ended but before it ran, while preempted, after a failed L2 -> L1 load, after its deadline released it while the
    read still hung) leaves none of them behind once its jobs ended, and every prompt replayed afterwards gets its
    whole hit without a room decline."""
    e, docs, now = _r35_engine(tmp_path, n_docs=4)
    _r35_end_at(e, Req("x", docs[0] + [2]), point, now, monkeypatch)
    assert_nothing_reserved(e)
    _r35_replay_all(e, docs, "replay")
    e.close()


def test_r35_seeded_rounds_of_random_end_points_leave_no_reservation(tmp_path, monkeypatch):
    """R35, step 4: rounds in which every prompt ends at a random point (seeded); after each round nothing is
    reserved, every replay gets its whole hit, and the free + indexed slot count is the pool size."""
    rng = random.Random(35)
    e, docs, now = _r35_engine(tmp_path, n_docs=8)
    points = [p for p in R35_POINTS if p not in ("waiting_for_room", "load_failure")]
    for rnd in range(4):
        e.sched.reset()                                                    # every prompt comes from L3 again
        for i, d in enumerate(docs):
            _r35_end_at(e, Req(f"r{rnd}-{i}", d + [rnd, i]), rng.choice(points), now, monkeypatch)
        assert_nothing_reserved(e)
        _r35_replay_all(e, docs, f"replay{rnd}")
    e.close()


# ================================================================ R36: staging slots and the I/O thread
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


def _r36_churn(e, staged, tag):
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


def _r36_after_release(e, writes, job, handed, others, tag):
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
def test_r36_staging_slots_go_back_only_after_the_io_thread_stopped_writing_them(tmp_path, end):
    """R36 (an abort frees host slots while the storage I/O thread still reads into them). A prefetch of 8 pages
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
    others = _r36_churn(e, staged, "o")
    assert not writes
    faulty.release()
    wait_ios(e)
    _r36_after_release(e, writes, job, handed, others, "o")
    e.close()


def test_r36_a_read_held_by_a_stopped_zmq_server_keeps_its_staging_slots_until_it_returns(tmp_path):
    """R36 with a real ``tierkv server``: the server is SIGSTOPped while a prefetch's first batch is on the wire, the
    request is aborted and other requests churn L2; after SIGCONT the reply arrives and is written into the job's own
    staging slots only, which go back to the allocator with the job's report."""
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
            others = _r36_churn(e, staged, "z")
            assert not writes
        finally:
            h.cont()
        wait_ios(e)
        _r36_after_release(e, writes, job, handed, others, "z")
        assert l3io(e).store.stats()["timeouts"] == 0     # the reply came in time: the late write really happened
        e.close()


# ================================================================ R37: the path changes while a prefetch reads
R37_TOUCHES = ("l2_eviction", "reset_cache", "other_request_saves", "r31_drop_after_copy_fault",
               "r31_drop_after_checksum_failure")


def _corrupt_l2_page(e, slot):
    """Flip one byte of an L2 page in place (the slot's recorded checksum stays: a verified load detects it)."""
    page = e.host.read_page(slot).clone()
    page[page.numel() // 2] ^= 0xFF
    e.host.write_page(slot, page)


@pytest.mark.parametrize("touch", R37_TOUCHES)
def test_r37_a_prefetch_completing_after_its_path_changed_attaches_nothing_under_an_invalid_anchor(
        tmp_path, monkeypatch, touch):
    """R37 (prefetch completion grafts pages under an anchor whose state changed during the I/O). tierkv's anchor is
    the prefetch's index path (locked from the order to the report, so nothing on it can be evicted, reset or dropped
    meanwhile) and, when the hit starts in L2, the L2 copies of its leading pages, which the request loads at
    completion. While the read of prompt X hangs: other requests evict L2 around the path; reset_cache drops every
    unlocked page; another request (device hit) saves X's pages into L2 itself; a request loading X's first pages
    from L2 fails (a copy fault) so R31 must drop them, deferred while the path is locked. After completion the
    invariants hold at every step, the prefetched pages are not left under a dropped anchor, the request gets only
    pages with the right bytes and X is a whole hit again afterwards."""
    doc = toks(1, 8 * P)
    write_to_l3(tmp_path, [doc])
    e = FakeEngine(num_slots=24, num_blocks=96, store=file_store(tmp_path, {0: {}}), scheduler_exists=True,
                   controller={"prefetch_policy": "wait_complete"})
    keys = keys_of(e, doc)
    faulty = l3io(e).store
    anchored = touch.startswith("r31") or touch == "l2_eviction"
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
    first_invalid = None                                   # first page R31 must drop
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
        if touch == "r31_drop_after_copy_fault":
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
    want = 8 * P if first_invalid is None or touch == "r31_drop_after_copy_fault" else first_invalid * P
    assert complete_async_load(e, a, ext) == want          # checks the bytes of every page it got
    e.settle()
    assert_nothing_reserved(e)
    assert e.run_l3(Req("again", doc + [3])) == 8 * P      # X whole again (recomputed pages saved), right bytes
    e.settle()
    assert_nothing_reserved(e)
    e.close()


# ================================================================ R38: existence probes and eviction
def test_r37_a_prefetch_never_hands_its_request_an_l2_anchor_page_whose_save_was_not_made(tmp_path, monkeypatch):
    """R37: the save of X's pages 0-1 raised (R41): slots unwritten, the index still lists them in L2. A later L3 hit
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


def _fixture(kind):
    import importlib
    return importlib.import_module(f"tests.helpers.fixtures_{kind}")


@pytest.mark.parametrize("kind", ["file", "zmq"])
def test_r38_probes_do_not_refresh_recency_and_a_full_store_still_takes_every_write(tmp_path, kind):
    """R38 (existence probes pin objects, so eviction finds nothing). The rule for the file store and the ZMQ
    server: an existence query changes nothing (no lease, no recency); a read makes a page most recently used. A store
    of 16 pages at capacity whose every page is probed over and over (with absent keys mixed in) but only pages 0-1
    are read takes all 8 new writes, and its victims are exactly the 8 least recently *read or written* pages (2-9),
    probed or not."""
    pb = 4096
    (tmp_path / kind).mkdir()
    with _fixture(kind).make_backend(tmp_path / kind, pb, bytes(16), capacity_pages=16) as h:
        assert h.capacity_pages == 16
        st = h.backend
        rng = random.Random(38)
        ks = [rng.randbytes(16).hex() for _ in range(34)]
        src = [torch.full((pb,), i, dtype=torch.uint8) for i in range(24)]
        for i in range(16):
            assert st.batch_set([ks[i]], [src[i]]) == [True]
        dst = [torch.zeros(pb, dtype=torch.uint8) for _ in range(2)]
        for _ in range(20):
            assert st.batch_exists(ks[:16]) == 16
            assert st.batch_exists(ks[24:34]) == 0
            assert st.batch_exists(list(reversed(ks[:16]))) == 16
            assert st.batch_get(ks[:2], dst) == [True, True]
        assert [st.batch_set([ks[i]], [src[i]]) for i in range(16, 24)] == [[True]] * 8
        assert [st.batch_exists([k]) for k in ks[:24]] == [1, 1] + [0] * 8 + [1] * 14
        out = [torch.zeros(pb, dtype=torch.uint8) for _ in range(24)]
        got = st.batch_get(ks[:24], out)
        assert all(torch.equal(out[i], src[i]) for i in range(24) if got[i])


MC_PROMPTS, MC_PAGES = 28, 120          # 3,360 pages of 4 KiB (+ 64 B header) fill ~83 % of a 16 MiB segment
MC_LEASE_MS = 300                       # the master's default_kv_lease_ttl (10 s by default): short, for a fast test


def _mooncake_probe_run(tmp_path, first_absent: bool):
    """A real Mooncake master (lease ``MC_LEASE_MS``) with one 16 MiB segment, an engine whose L3 is that store, and
    28 prompts of 120 pages written by an earlier engine (with ``first_absent``: page 0 of each is missing). Traffic:
    every prompt is looked up again and again for 3 lease times (at least) while a writer gets 128 pages of 256 KiB
    accepted (four times the segment);
    every L3 hit is declined as slower than recomputing, so probed pages are never read. Returns (existence jobs
    the engine sent, old pages still in the store, writes accepted, writes tried)."""
    import numpy as np
    (tmp_path / "mc").mkdir()
    now = [0.0]
    mc = _fixture("mooncake")
    with mc.make_backend(tmp_path / "mc", 4096, bytes(16), global_segment_size=16 << 20,
                         master_args=("-default_kv_lease_ttl", str(MC_LEASE_MS))) as h:
        e = FakeEngine(store=lambda rank, ns, pb: h.new_client(namespace=ns), clock=lambda: now[0],
                       controller={"probe_interval_s": 1e9, "negative_ttl_s": 2.0})
        st, ns = l3io(e).store, l3io(e).rank_namespace
        prompts = [toks(1_000_000 * (i + 1), MC_PAGES * P) for i in range(MC_PROMPTS)]
        old = []
        for p in prompts:
            ks = [l3_key(ns, k) for k in keys_of(e, p)]
            old += ks[1:]
            put = ks[1:] if first_absent else ks
            assert all(st.batch_set(put, [torch.zeros(4096, dtype=torch.uint8)] * len(put)))
        ctl = e.sched.ctl
        ctl.fetch_s_per_page.add(1.0)                      # 1 s per page vs 0.1 ms per token: every hit declined
        ctl.observe_prefill(1.0, 10_000)
        n = [0]

        def traffic():
            now[0] += 2.1                                  # past negative_ttl_s: an absent page may be asked again
            for p in prompts:
                rid = f"q{n[0]}"
                n[0] += 1
                e.sched.add_request(rid, p + [1])
                assert e.sched.lookup(rid, 0) in (None, 0)
                e.sched.on_finished(rid)
            pump(e)
        traffic()
        writer = h.backend.client                         # another client's writes (raw Mooncake puts)
        rng = np.random.default_rng(38)
        big = bytes(256 << 10)
        ok = tried = 0
        t0 = time.monotonic()
        while time.monotonic() - t0 < 3 * MC_LEASE_MS / 1000 or ok < 256:   # 256 accepted: four times the segment
            assert time.monotonic() - t0 < 30, f"only {ok} of {tried} writes accepted"
            traffic()
            res = [writer.upsert(f"r38-writer/{rng.bytes(16).hex()}", big) == 0 for _ in range(4)]
            ok, tried = ok + sum(res), tried + len(res)
        assert l3io(e).counters.prefetch_jobs == 0         # nothing was read
        assert first_absent or ctl.counters.l3_declined_slow_pages > 0
        exists_jobs = l3io(e).counters.exists_jobs
        left = sum(1 for r in st.client.batch_is_exist([st.object_name(k) for k in old]) if r == 1)
        e.close()
    return exists_jobs, left, ok, tried


def test_r38_mooncake_pages_probed_but_not_read_stay_evictable(tmp_path):
    """R38 with a real Mooncake master. Mooncake's ``batch_is_exist`` (tierkv's ``MooncakeStore.batch_exists``)
    grants a read lease on every object it finds, and eviction skips leased objects. tierkv asks L3 about a page
    only while its index does not know it: a found page is indexed (L3-only) and never probed again, however many
    requests look it up. So pages probed once and then not read (every hit declined) lose their lease after
    ``default_kv_lease_ttl`` and eviction takes them: after writes of four times the segment, (almost) none of the 3,332
    old pages is left, and the engine sent one existence query per prompt."""
    exists_jobs, left, ok, tried = _mooncake_probe_run(tmp_path, first_absent=False)
    assert exists_jobs == MC_PROMPTS
    assert left <= MC_PROMPTS * (MC_PAGES - 1) // 10, f"{left} probed-but-unread pages were never evicted"
    assert ok > 0


def test_r38_mooncake_pages_after_an_absent_page_are_not_kept_leased_by_repeated_probes(tmp_path):
    """R38: page 0 of each prompt is missing, pages 1-119 present; existence probes repeated every negative_ttl_s must
    not keep the unreadable pages from eviction. Before the fix one query asked every page of the rest of the prompt
    and Mooncake leased every page it found, although none after the hole can ever be read."""
    exists_jobs, left, ok, tried = _mooncake_probe_run(tmp_path, first_absent=True)
    assert exists_jobs > MC_PROMPTS
    assert left <= MC_PROMPTS * (MC_PAGES - 1) // 10, \
        f"{left} of {MC_PROMPTS * (MC_PAGES - 1)} pages nobody can read stayed leased by existence probes"
