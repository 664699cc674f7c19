"""The controller under concurrent load (docs/architecture.md, "The fault model"): several requests in flight at once,
some hitting L1, L2, L3 or nothing, on the real scheduler and worker halves, real L1/L2 tensors and a real file store
(the fault wrapper only where a fault must be made on demand). Each test fails on the code before its fix (named in its
docstring)."""
from __future__ import annotations

import pytest

from tests.helpers.fake_engine import P, FakeEngine, Req
from tests.helpers.namespace import make_namespace
from tierkv.connector.core.page_hash import page_keys, request_root
from tierkv.connector.core.radix_index import NO_SLOT
from tierkv.connector.core.scheduler import CacheScheduler
from tests.connector.l3.test_controller import keys_of


def toks(a, n):
    return list(range(a, a + n))


# ---------------------------------------------------------------- one slot, one save per plan
def test_pages_already_in_l2_behind_l3_only_pages_are_not_saved_again_and_no_slot_is_given_twice():
    """A prefix whose first pages are L3-only (their L2 copies were evicted; the engine still holds them in L1) and
    whose later pages are back in L2 (an L3 prefetch for a request with a device hit published them): the next
    request's saves must cover only the pages without an L2 copy. Before the fix the scheduler allocated a slot for
    every page after the L2 run, freed the slots of pages already in L2 as duplicates but still ordered saves into
    them, so a second save of the same plan was handed one of those slots: the worker's kernel refused the step
    ("slot 50 given twice") and vLLM's worker died."""
    s = CacheScheduler(make_namespace(page_size=P), P, P, num_slots=16, controller={})
    doc = toks(1000, 6 * P)
    prompt = doc + toks(5000, P + 1)                                           # 7 full pages + 1 token
    keys = page_keys(request_root(s.ns_digest), prompt, P)
    s.index.insert(keys[:2], [NO_SLOT, NO_SLOT], in_l3=[True, True])          # pages 0-1: L3 only
    held = s.allocator.alloc(4)
    s.index.insert(keys[:6], held, in_l3=[True] * 4, start=2)                 # pages 2-5: in L2 (and L3)
    s.add_request("c", prompt)
    s.add_request("d", toks(9000, 2 * P + 1))                                  # another prompt, same step
    s.schedule_saves("c", 7 * P + 1, list(range(100, 108)))
    s.schedule_saves("d", 2 * P + 1, list(range(200, 203)))
    plan = s.build_plan()
    saved = [(o.req_id, b, sl, k) for o in plan.saves for b, sl, k in zip(o.block_ids, o.slots, o.keys)]
    slots = [sl for _r, _b, sl, _k in saved]
    assert len(slots) == len(set(slots)), f"a slot is saved into twice in one plan: {slots}"
    # c saves exactly its pages without an L2 copy (0, 1 and 6), from the blocks holding them
    assert [(b, k) for r, b, _sl, k in saved if r == "c"] == [(100, keys[0]), (101, keys[1]), (106, keys[6])]
    assert s.counters.save_pages == 3 + 2
    # every slot a save names belongs to the index, under the page saved into it, and none is free
    where = {}
    for node, j, _i in s.index.walk(keys[:7]):
        where[node.host_slots[j]] = node.keys[j]
    for r, _b, sl, k in saved:
        assert s.allocator.is_allocated(sl)
        if r == "c":
            assert where[sl] == k
    assert all(where[sl] == k for sl, k in zip(held, keys[2:6]))               # the L2 copies kept their slots
    s.check_invariants()


# ---------------------------------------------------------------- blocks of a request released at its deadline
def _l3_engine_with_doc(tmp_path, doc, **kw):
    from tests.connector.l3.test_controller import file_store, write_to_l3
    write_to_l3(tmp_path, doc)
    return FakeEngine(store=file_store(tmp_path), **kw)


def test_a_request_released_at_its_deadline_that_finishes_while_its_read_hangs_gets_its_blocks_freed(tmp_path):
    """The worker named the request as finished-receiving at its deadline; the request then
    ran and finished while its L3 read still hung. Before the fix ``request_finished`` asked vLLM to delay the free
    (the I/O side was still running) but the worker never names a request twice, so vLLM never freed its blocks
    (the real engine's KV usage stayed at 77 % at idle)."""
    from tests.connector.l3.test_controller import _hanging_l3_load
    now = [0.0]
    e, faulty, req = _hanging_l3_load(tmp_path, toks(40, 4 * P), clock=lambda: now[0],
                                      controller={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.5,
                                                  "prefetch_timeout_per_page_s": 0.0})
    baseline = len(e.free_blocks) + len(req.blocks)
    now[0] += 0.6                                    # past the deadline (a fake clock: no sleeps)
    e.step(compute=False)
    assert "b" in e.recv                             # released: its pages are recomputed
    e.recv.discard("b")
    e.waiting.pop("b")
    e.failed_blocks.clear()
    e.sched.on_alloc("b", req.blocks, 0)
    req.external = 0
    e.running["b"] = req
    e.step()                                         # it computes its prompt ...
    e.finish(req)                                    # ... and finishes while the read still hangs
    assert "b" not in e.delayed, "blocks of a request whose load already ended were held back"
    assert len(e.free_blocks) == baseline
    assert len(e.sched.ctl.staging_slots()) == 4     # the staging slots stay pinned until the I/O ended
    faulty.release()
    e.settle()
    assert e.sched.ctl.staging_slots() == []
    assert e.worker.counters.async_load_pages == 0   # nothing was copied into its blocks after the release
    e.idle_check()
    e.close()


def test_pages_never_read_because_their_request_was_released_count_as_cancelled_not_failed(tmp_path):
    """The serve benchmark's unexplained "failed" L3 reads (32 pages with a healthy ZMQ server): pages a prefetch
    never read, because its request was released at its deadline first, were counted as failed reads of the store
    (worker and scheduler side)."""
    from tests.connector.l3.test_controller import _hanging_l3_load
    now = [0.0]
    e, faulty, req = _hanging_l3_load(tmp_path, toks(40, 4 * P), clock=lambda: now[0], batch_pages=1,
                                      controller={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.5,
                                                  "prefetch_timeout_per_page_s": 0.0})
    now[0] += 0.6                                    # past the deadline while the first page's read hangs
    e.step(compute=False)
    assert "b" in e.recv
    faulty.release()                                 # the first read returns; the other three are never sent
    e.settle()
    w, c = e.worker.l3.counters, e.sched.ctl.counters
    assert (w.prefetch_pages, w.prefetch_failed_pages, w.prefetch_cancelled_pages) == (1, 0, 3)
    assert (c.prefetch_failed_pages, c.prefetch_cancelled_pages) == (0, 3)
    assert w.prefetch_late_pages == 4 and w.prefetch_deadline_misses == 1
    e.close()


# ---------------------------------------------------------------- staging room while other prefetches run
def _controller(num_slots, **kw):
    from tierkv.connector.l3.controller import Controller
    from tierkv.connector.core.radix_index import RadixIndex
    from tierkv.connector.l2.slot_allocator import SlotAllocator
    index, alloc = RadixIndex(), SlotAllocator(num_slots)
    return index, alloc, Controller(index, alloc, page_size=P, **kw)


def _keys(seed, n):
    return page_keys(request_root(b"\0" * 16), toks(seed, n * P), P)


def test_a_running_prefetch_hides_no_evictable_l2_page_from_the_room_check():
    """An L2 of 40 slots holding 16 committed, unlocked pages; while a 16-page prefetch runs
    (its path locked, 16 staging slots taken), a second 16-page hit can have 8 free + 16 evictable slots. Before the
    fix the room check subtracted every locked page, including the L3-only pages the running prefetch locks, and
    deferred then declined the hit."""
    index, alloc, ctl = _controller(40)
    c, a, b = _keys(1, 16), _keys(100000, 16), _keys(200000, 16)
    index.insert(c, alloc.alloc(16), in_l3=[True] * 16)             # committed to L3, unlocked, in L2
    index.insert(a, [NO_SLOT] * 16, in_l3=[True] * 16)              # L3 only
    index.insert(b, [NO_SLOT] * 16, in_l3=[True] * 16)
    ctl.start_prefetch("a", a, 0, 16, list(range(16)))              # running: locks a, takes 16 staging slots
    assert alloc.num_free == 8
    assert ctl.wait_for_room("b", 16) is True
    job = ctl.start_prefetch("b", b, 0, 16, list(range(16, 32)))
    assert NO_SLOT not in job.slots and ctl.counters.prefetch_no_room_pages == 0
    assert index.l2_pages == 0                                      # c's L2 copies made the room; L3 keeps them


def test_waiting_for_room_counts_time_as_well_as_lookups():
    """The retry budget counted lookups only, so an engine looping fast ran it out in milliseconds: a hit is
    declined only after ``room_retry_steps`` lookups *and* ``room_wait_s`` seconds."""
    now = [0.0]
    index, alloc, ctl = _controller(8, room_retry_steps=2, room_wait_s=0.5, clock=lambda: now[0])
    a, b = _keys(1, 8), _keys(100000, 8)
    index.insert(a, [NO_SLOT] * 8, in_l3=[True] * 8)
    index.insert(b, [NO_SLOT] * 8, in_l3=[True] * 8)
    ctl.start_prefetch("a", a, 0, 8, list(range(8)))                # every slot staged, nothing evictable
    for _ in range(10):                                             # many lookups within 0.4 s: still waiting
        now[0] += 0.04
        assert ctl.wait_for_room("b", 8) is None
    now[0] += 0.2
    assert ctl.wait_for_room("b", 8) is False                       # both budgets spent: declined
    assert ctl.counters.l3_declined_room_pages == 8


def test_under_best_effort_waiting_for_room_spends_the_same_stall_budget_as_the_read():
    """l3_hit_ttft's stalled store: a job stuck on the store keeps its staging slots, so every later L3 hit found no
    room and waited ``room_wait_s`` (0.5 s) before recomputing: 5x a recompute of 100 ms. With a recompute estimate
    the room wait is bounded by the best_effort budget (5 % of recomputing the hit)."""
    now = [0.0]
    index, alloc, ctl = _controller(8, room_retry_steps=8, room_wait_s=0.5, clock=lambda: now[0])
    ctl.observe_prefill(1.0, 1000)                                  # 1 ms per prompt token
    budget = ctl.deadline_s(8)
    assert budget == pytest.approx(0.05 * 1e-3 * 8 * P) and budget < 0.5
    a, b = _keys(1, 8), _keys(100000, 8)
    index.insert(a, [NO_SLOT] * 8, in_l3=[True] * 8)
    index.insert(b, [NO_SLOT] * 8, in_l3=[True] * 8)
    ctl.start_prefetch("a", a, 0, 8, list(range(8)))                # every slot staged, nothing evictable
    assert ctl.wait_for_room("b", 8) is None
    now[0] += budget
    assert ctl.wait_for_room("b", 8) is False                       # declined after the budget, not after 0.5 s
    assert ctl.counters.l3_declined_room_pages == 8


# ---------------------------------------------------------------- L3 reads of several requests at once
def _doc_keys(e, doc):
    return page_keys(request_root(e.sched.ns_digest), doc, P)


class _GatedStore:
    """Wraps a real store; call ``i`` of ``batch_get`` first runs ``before[i]`` (if any): a read whose duration is
    set by the test (an event it waits for, a fake clock it moves), which a real store cannot do on demand."""

    def __init__(self, inner, before):
        self.inner, self.before, self.calls = inner, before, 0
        import threading
        self._lock = threading.Lock()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def batch_get(self, keys, dsts, **kw):
        with self._lock:
            i, self.calls = self.calls, self.calls + 1
        if i in self.before:
            self.before[i]()
        return self.inner.batch_get(keys, dsts, **kw)


def _prefetch_job(jid, rid, keys, slots, blocks, deadline_s=None):
    from tierkv.connector.core.plan import JOB_PREFETCH, Job
    return Job(jid, JOB_PREFETCH, keys, slots=slots, block_ids=blocks, fetch=[True] * len(keys), req_id=rid,
               deadline_s=deadline_s)


def test_reads_of_four_requests_are_in_flight_at_once(tmp_path):
    """One reader thread served every L3 read, so four distinct hits queued behind each other
    and the last ones ran out of time. The file store's default is four readers: four reads that each block in the
    store are all in flight together, and all complete."""
    import threading
    from tests.connector.l3.test_controller import file_store
    docs = [toks(1000 * (i + 1), 2 * P) for i in range(4)]
    e0 = FakeEngine(store=file_store(tmp_path))
    for i, d in enumerate(docs):
        e0.run_l3(Req(f"w{i}", d + [1]))
    e0.settle()
    e0.close()
    e = FakeEngine(store=file_store(tmp_path))
    l3 = e.worker.l3
    assert l3.read_threads == 4
    gate, started = threading.Event(), threading.Semaphore(0)
    l3.store = _GatedStore(l3.store, {i: (lambda: (started.release(), gate.wait(30))) for i in range(4)})
    l3.submit([_prefetch_job(i + 1, f"r{i}", _doc_keys(e, d), [2 * i, 2 * i + 1], [10 + 2 * i, 11 + 2 * i])
               for i, d in enumerate(docs)])
    for _ in range(4):                                   # every read is inside the store at the same time
        assert started.acquire(timeout=10), "reads are serialised: fewer than 4 in flight"
    gate.set()
    assert l3.wait_idle(30)
    res = l3.poll()
    assert res.finished == {"r0", "r1", "r2", "r3"} and not res.failed_blocks
    assert [r.ok for r in sorted(l3.take_reports(), key=lambda r: r.job_id)] == [[True, True]] * 4
    e.close()


def test_a_prefetch_deadline_counts_from_the_start_of_its_read(tmp_path):
    """The deadline ran from submission, so a read that waited behind another one lost its time in the
    queue. With one reader: A's read blocks; B waits in the queue; A ends at t = 0.4 s and B's read starts then
    (deadline 0.5 s, so until 0.9 s). At t = 0.7 s, B's first batch arrived and its second is still being read: B is
    not released as late (before the fix it was, at 0.5 s after submission)."""
    import threading
    from tests.connector.l3.test_controller import file_store
    now = [0.0]
    a, b = toks(1000, 2 * P), toks(5000, 8 * P)
    e0 = FakeEngine(store=file_store(tmp_path))
    e0.run_l3(Req("wa", a + [1]))
    e0.run_l3(Req("wb", b + [1]))
    e0.settle()
    e0.close()
    e = FakeEngine(store=file_store(tmp_path), clock=lambda: now[0], batch_pages=4)
    e.worker.l3.close()                                  # rebuild it with one reader and the fake clock
    from tierkv.connector.l3.io import L3IO
    w = e.worker
    l3 = L3IO(w.l3.store, w.host, w.l3.rank_namespace, w.checksums, batch_pages=4, read_threads=1,
              clock=lambda: now[0])
    w.l3 = l3
    gate_a, gate_b, in_b = threading.Event(), threading.Event(), threading.Event()

    def b_second_batch():
        in_b.set()
        gate_b.wait(30)
    l3.store = _GatedStore(l3.store, {0: lambda: gate_a.wait(30), 1: lambda: now.__setitem__(0, 0.7),
                                      2: b_second_batch})
    l3.submit([_prefetch_job(1, "a", _doc_keys(e, a), [0, 1], [10, 11], deadline_s=0.5),
               _prefetch_job(2, "b", _doc_keys(e, b), list(range(2, 10)), list(range(20, 28)), deadline_s=0.5)])
    now[0] = 0.4
    assert l3.poll().finished == set()
    gate_a.set()                                         # A ends; B's read starts at 0.4 and moves the clock to 0.7
    assert in_b.wait(30)
    res = l3.poll()
    assert res.finished == {"a"}, "B was released while its read was running within its deadline"
    gate_b.set()
    assert l3.wait_idle(30)
    res = l3.poll()
    assert res.finished == {"b"} and [o.block_ids for o in res.orders] == [list(range(20, 28))] and not res.failed_blocks
    l3.close()
    e.close()


# ---------------------------------------------------------------- estimates that recover
def test_a_stale_slow_estimate_lets_one_probe_through_and_a_fast_read_restores_hits():
    """After one slow fetch every later hit was declined, so no read ever refreshed the estimate (ten hits
    on a healthy store declined, estimate frozen). Now, once the estimate is older than ``probe_interval_s``, one hit
    goes ahead as a probe; its (fast) read brings the estimate down and hits are taken again."""
    now = [0.0]
    _index, _alloc, ctl = _controller(8, probe_interval_s=5.0, clock=lambda: now[0])
    ctl.observe_prefill(1.0, 10_000)                    # 0.1 ms per token: 3.2 ms per page to recompute
    ctl.fetch_s_per_page.add(0.125)                     # one slow fetch: 125 ms per page
    assert [ctl.worth_loading(4) for _ in range(10)] == [False] * 10
    now[0] += 6.0                                       # the estimate is stale now
    assert [ctl.worth_loading(4) for _ in range(3)] == [True, False, False]   # one probe per interval
    assert ctl.counters.l3_probe_hits == 1
    for _ in range(25):                                 # the probe's read and later ones are fast: 1 ms per page
        ctl.fetch_s_per_page.add(0.001)
    assert ctl.worth_loading(4)


def test_a_read_that_outlives_its_request_makes_later_hits_recompute_at_once(tmp_path):
    """A stalled store never reports its reads, so the fetch estimate never learns: on vLLM with a stalled file
    store every later L3 hit waited its deadline, or for staging room the stalled reads held, before recomputing
    (the l3_hit_ttft benchmark: 12-32 ms queued per hit, up to 13 % of the recompute time). Now a read still running
    after its request was released bounds the store's time per page from below (its time so far / its pages), and
    once that exceeds recomputing a page, hits are declined as slow at their first lookup, without a probe. A read
    counts from the step after its release on: one that ended within that step reports with its output."""
    from tests.connector.l3.test_controller import _hanging_l3_load
    now = [0.0]
    e, faulty, _req = _hanging_l3_load(tmp_path, toks(40, 4 * P), clock=lambda: now[0],
                                       controller={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.5,
                                                   "prefetch_timeout_per_page_s": 0.0})
    ctl = e.sched.ctl
    ctl.observe_prefill(1.0, 100_000)                   # 10 us a token: a page recomputes in 0.32 ms
    now[0] = 0.3
    assert ctl.overdue_s_per_page() == 0.0 and ctl.worth_loading(4)   # b's read is within its deadline
    now[0] = 0.6
    e.step(compute=False)
    assert "b" in e.recv                                # released at its deadline; the read still hangs
    assert ctl.overdue_s_per_page() == 0.0              # it may still end within the next step and report then
    now[0] = 0.8
    e.step(compute=False)                               # that step's output came without b's report
    assert ctl.overdue_s_per_page() == pytest.approx(0.8 / 4)
    doc_c = toks(900, 4 * P) + [3]
    e.sched.index.insert(keys_of(e, doc_c)[:4], [NO_SLOT] * 4, in_l3=[True] * 4)   # c's pages: in L3 too
    e.sched.add_request("c", doc_c)
    assert e.sched.lookup("c", 0) == 0                  # recomputed at once: not deferred, no load ordered
    assert ctl.counters.l3_declined_slow_pages == 4 and ctl.counters.l3_probe_hits == 0
    faulty.release()                                    # the read ends and reports: the bound goes with it
    assert e.worker.l3.wait_idle(30)
    e.step(compute=False)
    assert ctl.overdue_s_per_page() == 0.0 and ctl.pending_jobs() == 0 and ctl.worth_loading(4)
    e.close()


def test_best_effort_waits_at_most_a_twentieth_of_the_recompute_time():
    """The best_effort policy waited as long as recomputing would take, then recomputed: a stalled store cost about
    twice the recompute. The wait is now at most 5 % of the estimated recompute time (and at most three times the
    estimated fetch time), so a stall costs at most 1.05x recomputing."""
    from tierkv.connector.l3.controller import BEST_EFFORT_MIN_WAIT_S
    _index, _alloc, ctl = _controller(8, prefetch_policy="best_effort")
    assert ctl.deadline_s(10) == 0.5 + 0.005 * 10       # no estimate yet: the timeout policy's deadline
    ctl.observe_prefill(1.0, 1000)                      # 1 ms per token: 10 pages recompute in 0.32 s
    assert ctl.deadline_s(10) == pytest.approx(0.05 * 0.32)
    ctl.fetch_s_per_page.add(0.0002)                    # a fast store: 0.2 ms per page
    assert ctl.deadline_s(10) == pytest.approx(max(3 * 0.0002 * 10, BEST_EFFORT_MIN_WAIT_S))
    assert ctl.deadline_s(10) <= 0.05 * 0.32


def test_the_recompute_estimate_comes_from_timed_forwards_of_prefill_steps(tmp_path, monkeypatch):
    """The prefill estimate was the wall time between two plan builds, idle time and decode steps
    included. The workers now time the forward (bind_connector_metadata -> wait_for_save: vLLM calls start_load_kv
    *after* the forward in steps without a synchronous load) of steps with at least four pages of prompt tokens;
    the scheduler side takes the slowest rank's time per step."""
    from types import SimpleNamespace
    from tierkv.connector.vllm.connector import ConnectorPlan, TierKVWorkerMeta
    from tests.helpers.vllm_parts import worker_connector, connector, SCHEDULER, write_model
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    model = write_model(tmp_path / "model")
    import time
    w, _l1 = worker_connector(model, {"host_pool.num_pages": 8})
    now = [100.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    for step, tokens in ((1, 4 * P), (2, 4 * P - 1), (3, 0)):    # only the first has enough prompt tokens
        w.bind_connector_metadata(ConnectorPlan(step=step, prefill_tokens=tokens))
        now[0] += 0.25                                          # the forward
        w.start_load_kv(None)                                   # vLLM: after the forward (no synchronous load)
        w.wait_for_save()
        w.clear_connector_metadata()
    monkeypatch.undo()
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    meta = w.build_connector_worker_meta()
    assert meta.forwards == [(1, 4 * P, 0.25)]
    assert w.build_connector_worker_meta() is None               # reported once
    s = connector(model, SCHEDULER, {"host_pool.num_pages": 8, "l3.backend": "file", "l3.file.root": str(tmp_path)})
    two_ranks = TierKVWorkerMeta([], [(7, 1000, 0.5)]).aggregate(TierKVWorkerMeta([], [(7, 1000, 0.8)]))
    s.update_connector_output(SimpleNamespace(kv_connector_worker_meta=two_ranks, finished_recving=None,
                                              invalid_block_ids=None))
    assert s._sched.ctl.prefill_s_per_token.value == pytest.approx(0.8 / 1000)


@pytest.mark.parametrize("with_l3", [False, True])
def test_pages_saved_in_a_plan_are_not_evicted_for_a_later_save_of_the_same_plan(with_l3):
    """Another way to one slot in two saves of a plan: under L2 pressure, a later request's save evicted the pages
    that an earlier save of the same plan had just been given (they were unlocked and not written yet) and was handed
    their slot. The plan's own pages are now locked until it is handed over: the later save is skipped instead."""
    s = CacheScheduler(make_namespace(page_size=P), P, P, num_slots=4, controller={"write_policy": "write_through_selective"}
                       if with_l3 else None)
    s.add_request("x", toks(1, 4 * P + 1))
    s.add_request("y", toks(90000, 2 * P + 1))
    s.schedule_saves("x", 4 * P + 1, list(range(10, 15)))
    s.schedule_saves("y", 2 * P + 1, list(range(20, 23)))
    plan = s.build_plan()
    slots = [sl for o in plan.saves for sl in o.slots]
    assert len(slots) == len(set(slots)) == 4, slots
    assert [o.req_id for o in plan.saves] == ["x"] and s.counters.save_skipped_pages == 2
    assert s.index.locked_pages == 0                    # released with the plan
    s.schedule_saves("y", 2 * P + 1, list(range(20, 23)))   # next step: x's pages may make room now
    assert [o.req_id for o in s.build_plan().saves] == ["y"]
    s.check_invariants()


# ---------------------------------------------------------------- engine steps an L3 hit costs
def test_an_l3_hit_whose_read_ends_within_the_forward_costs_one_step(tmp_path):
    """Item 4: reads start before the step's forward (``bind_connector_metadata``), so a read that ends within the forward is
    named finished at the end of the step that ordered it: one step more than an L2 hit. Before, reads were handed
    over after the forward and the load ended a step later. The steps each L3 hit waited are counted
    (``l3_hit_wait_steps`` and its histogram)."""
    from tests.connector.l3.test_controller import file_store, write_to_l3
    doc = toks(7, 4 * P)
    write_to_l3(tmp_path, doc)
    e = FakeEngine(store=file_store(tmp_path), reads_end_in_forward=True)
    assert e.run_l3(Req("b", doc + [2])) == 4 * P       # a restart: existence query, then the load
    c = e.sched.counters
    assert (c.l3_hits, c.l3_hit_wait_steps) == (1, 2)   # one step for the existence answer, one for the load
    e.sched.reset()                                     # L2 and the index forget the pages; L3 keeps them
    e.settle()
    e.sched.index.insert(_doc_keys(e, doc), [NO_SLOT] * 4, in_l3=[True] * 4)   # indexed as L3-only
    assert e.run_l3(Req("c", doc + [3])) == 4 * P
    assert (c.l3_hits, c.l3_hit_wait_steps, c.l3_hit_wait_steps_1) == (2, 3, 1)   # the load alone: one step
    e.settle()
    e.idle_check()
    e.close()


def test_existence_answered_in_the_scheduler_makes_a_restart_hit_cost_one_step_and_a_miss_none(tmp_path):
    """Item 4: with the file store the scheduler's process answers existence itself (one stat per key and rank), in
    the lookup: a restarted engine's L3 hit is ordered in the step of its first lookup (one step in all, like a hit
    the index already knew), and a prompt L3 does not hold is not deferred at all (before, every new prompt waited
    for a worker round trip: the tax on misses)."""
    from tests.connector.l3.test_controller import file_store, write_to_l3
    doc = toks(7, 4 * P)
    write_to_l3(tmp_path, doc)
    e = FakeEngine(store=file_store(tmp_path), reads_end_in_forward=True, scheduler_exists=True)
    assert e.run_l3(Req("b", doc + [2])) == 4 * P
    c, cc = e.sched.counters, e.sched.ctl.counters
    assert (c.l3_hits, c.l3_hit_wait_steps, cc.exists_local_queries, cc.lookups_deferred) == (1, 1, 1, 0)
    assert e.worker.l3.counters.exists_jobs == 0        # no round trip through the workers
    e.sched.add_request("new", toks(50000, 4 * P + 1))
    assert e.sched.lookup("new", 0) == 0                # a miss: answered at once, not None
    assert cc.exists_local_queries == 2 and cc.lookups_deferred == 0
    e.settle()
    e.idle_check()
    e.close()


def _sync_engine(tmp_path, doc, faulty=None):
    """An engine restarted over a file L3 holding ``doc`` (and L2 empty), whose fetch estimate exists: two L3 hits
    were read asynchronously (without an estimate; the first read of a process is cold, it times the store client's
    set-up and does not count), L2 and the index being reset after each."""
    from tests.connector.l3.test_controller import write_to_l3
    from tests.helpers.l3_scenarios import file_store
    write_to_l3(tmp_path, doc)
    e = FakeEngine(store=file_store(tmp_path, faulty), scheduler_exists=True, sync_loads=True)
    for k in range(2):
        assert e.run_l3(Req(f"warm{k}", doc + [1])) == 4 * P
        e.settle()
        assert e.sched.reset()
        e.settle()
    assert e.sched.ctl.counters.prefetch_sync_jobs == 0 and e.sched.ctl.fetch_s_per_page.value is not None
    assert e.sched.index.match_prefix(_doc_keys(e, doc), require_l2=False).num_pages == 0
    return e


def test_a_fast_l3_hit_is_loaded_before_the_forward_of_the_step_that_admits_it(tmp_path):
    """Item 4: an L3 hit whose read the fetch estimate puts under ``sync_load_max_s`` is a synchronous load, like an
    L2 hit's: vLLM is told ``load_async=False`` and schedules the request at once; the worker waits for the read
    before the forward and copies the pages with the step's L2 -> L1 loads, so the request computes its other
    tokens in the step that admitted it (zero steps more than an L2 hit; before, one, and two with asynchronous
    scheduling). The request is never named in ``finished_recving`` and its free is never delayed; the pages reach
    the index (L2 + L3) through the job's report and are not saved a second time from L1."""
    doc = toks(7, 4 * P)
    e = _sync_engine(tmp_path, doc)
    c, cc = e.sched.counters, e.sched.ctl.counters
    served_l3 = e.sched.lookup_stats.tokens["l3"]
    hits, waited = c.l3_hits, c.l3_hit_wait_steps
    r = Req("c", doc + toks(90_000, 2 * P) + [3])      # 4 pages in L3, then 2 new pages to compute
    e.sched.add_request("c", r.tokens)
    assert e.sched.lookup("c", 0) == 4 * P and not e.sched.lookup_is_async("c")
    assert e.admit_l3(r) == 4 * P and "c" in e.running and not e.waiting
    assert cc.prefetch_sync_jobs == 1
    saves = c.save_pages
    e.step()                                           # the read, the L2 -> L1 copy and the forward: one step
    assert r.num_computed == len(r.tokens) and "c" not in e.rolled_back
    assert all(e.page_ok(r, i) for i in range(6))
    assert c.save_pages == saves + 2                   # only the two computed pages; the hit's come from the job
    assert e.worker.counters.sync_load_pages == 4 and e.worker.counters.sync_failed_blocks == 0
    assert e.recv == set() and (c.l3_hits, c.l3_hit_wait_steps) == (hits + 1, waited)   # it waited no step
    e.finish(r)
    assert "c" not in e.delayed                        # freed at once: no load of it is in flight
    e.settle()
    assert l2_run(e, _doc_keys(e, doc) + keys_of_doc(e, r.tokens)[4:6]) == 6
    assert e.sched.lookup_stats.tokens["l3"] == served_l3 + 4 * P
    e.idle_check()
    e.close()


def keys_of_doc(e, tokens):
    return page_keys(request_root(e.sched.ns_digest), tokens, P)


def l2_run(e, keys):
    return e.sched.index.match_len(keys, len(keys), require_l2=True)[0]


def test_a_synchronous_l3_load_on_a_stalled_store_waits_a_bounded_time_then_recomputes(tmp_path):
    """Item 3 under a synchronous load: the store hangs once the hit was ordered. The forward waits at most the
    load's deadline (``SYNC_DEADLINE_FACTOR`` x ``sync_load_max_s``, queueing included), then every block of the
    hit is reported failed: vLLM rolls the request back and recomputes it, with the right bytes; the request's saves
    of that step, computed on the broken prefix, are not made, and they are made once it is
    recomputed. The read's staging slots stay pinned until the hung read ends; then nothing is left reserved."""
    from tests.helpers.l3_scenarios import assert_nothing_reserved, l3io
    doc = toks(7, 4 * P)
    e = _sync_engine(tmp_path, doc, faulty={0: {}})
    store = l3io(e).store
    r = Req("c", doc + toks(90_000, 2 * P) + [3])
    assert e.admit_l3(r) == 4 * P and e.sched.ctl.counters.prefetch_sync_jobs == 1
    store.set_faults(hang_get=True)
    e.step()
    w = e.worker.counters
    assert store.hanging == 1 and w.sync_failed_blocks == 4
    assert w.sync_wait_seconds < 2 * 2 * e.sched.ctl.sync_load_max_s + 1.0   # bounded by the deadline, not the hang
    assert "c" in e.rolled_back and r.num_computed == 0 and w.unsaved_pages == 2
    e.step()                                           # recomputed from its first page
    assert r.num_computed == len(r.tokens) and all(e.page_ok(r, i) for i in range(6))
    e.finish(r)
    assert "c" not in e.delayed
    assert e.sched.ctl.staging_slots() != []           # the hung read still owns its staging slots
    store.release()
    store.set_faults(hang_get=False)
    e.settle()
    ls = e.sched.lookup_stats
    assert ls.tokens["l3"] == 2 * 4 * P                # only the two asynchronous hits were served from L3
    assert ls.tokens["late"] == 4 * P and ls.tokens["aborted"] == 0   # the request finished before the report
    keys = keys_of_doc(e, r.tokens)
    assert l2_run(e, keys[:6]) == 6                    # the recomputed pages were saved (and the late read landed)
    assert_nothing_reserved(e)
    e.close()


def test_a_synchronous_read_that_outlives_its_step_makes_later_hits_recompute_at_once(tmp_path):
    """A synchronous load whose read stalls fails its blocks at its deadline within its step and goes on reading;
    its request is never named in ``finished_recving``, so nothing told the scheduler: the last (fast) fetch
    estimate kept ordering synchronous loads, each holding the forward of its step up to the sync deadline while
    the store stalled. Now a synchronous job still without a report after the output of the step that follows its
    own counts as an overdue read (``overdue_s_per_page``), and the next hit is recomputed at its first lookup."""
    from tests.helpers.l3_scenarios import l3io
    doc = toks(7, 4 * P)
    e = _sync_engine(tmp_path, doc, faulty={0: {}})
    ctl, store = e.sched.ctl, l3io(e).store
    r = Req("c", doc + toks(90_000, 2 * P) + [3])
    assert e.admit_l3(r) == 4 * P and ctl.counters.prefetch_sync_jobs == 1
    store.set_faults(hang_get=True)
    e.step()                                            # the forward waited the sync deadline; c rolled back
    assert store.hanging == 1 and "c" in e.rolled_back
    assert ctl.overdue_s_per_page() == 0.0              # a read could still end and report with the next step
    e.step()                                            # c recomputed; the read still hangs: no report
    floor = ctl.overdue_s_per_page()
    assert floor > 0.0
    ctl.fetch_s_per_page.value = floor / 10             # the estimate alone: a store 5x faster than recomputing
    ctl.prefill_s_per_token.value = floor / 2 / P       # recomputing a page takes half the overdue bound
    d = Req("d", toks(50_000, 4 * P) + [3])
    e.sched.index.insert(keys_of_doc(e, d.tokens)[:4], [NO_SLOT] * 4, in_l3=[True] * 4)
    e.sched.add_request("d", d.tokens)
    declined = ctl.counters.l3_declined_slow_pages
    assert e.sched.lookup("d", 0) == 0 and ctl.counters.l3_declined_slow_pages == declined + 4
    store.release()
    store.set_faults(hang_get=False)
    e.finish(r)
    e.settle()
    assert ctl.overdue_s_per_page() == 0.0 and ctl.pending_jobs() == 0   # the read reported: the bound went
    e.close()


def test_the_connector_answers_existence_in_the_scheduler_only_for_a_local_store(tmp_path, monkeypatch):
    """The scheduler role builds its own file store objects (one per rank namespace) and finds a page a worker
    stored; with ``controller.exists_in_scheduler: false`` or injected existence faults the workers are asked
    instead (read faults leave existence to the scheduler, as without them)."""
    import dataclasses
    from tierkv.connector.l3.io import l3_key
    from tierkv.storage_backends.file.store import FileStore
    from tests.helpers.vllm_parts import SCHEDULER, connector, write_model
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    model = write_model(tmp_path / "model")
    base = {"host_pool.num_pages": 8, "l3.backend": "file", "l3.file.root": str(tmp_path / "l3")}
    s = connector(model, SCHEDULER, base)
    fn = s._sched.ctl.exists_fn
    assert fn is not None
    key = b"\x01" * 16
    digest = dataclasses.replace(s.namespace, tp_rank=0, pp_rank=0).digest()
    worker_side = FileStore(digest, s.page_bytes, root=str(tmp_path / "l3"))
    assert fn([key]) == 0
    assert worker_side.batch_set([l3_key(digest, key)], [bytes(s.page_bytes)]) == [True]
    assert fn([key, b"\x02" * 16]) == 1
    s.shutdown()
    assert connector(model, SCHEDULER, {**base, "controller.exists_in_scheduler": False})._sched.ctl.exists_fn is None
    assert connector(model, SCHEDULER, {**base, "l3.faults": {"fail_exists": 0.1}})._sched.ctl.exists_fn is None
    slow_reads = connector(model, SCHEDULER, {**base, "l3.faults": {"fail_get": 0.1, "delay_get_s": 1.0}})
    assert slow_reads._sched.ctl.exists_fn is not None
    slow_reads.shutdown()


# ---------------------------------------------------------------- write policies
def test_write_through_selective_counts_hits_the_engine_served_from_l1():
    """Only L2 hits counted towards the threshold, so a prefix vLLM's own prefix cache kept serving from L1
    was never backed up (nothing reached L3 on the docs workload). Hits of any tier count now."""
    s = CacheScheduler(make_namespace(page_size=P), P, P, num_slots=16, controller={"write_policy": "write_through_selective",
                                                              "write_through_threshold": 2})
    doc = toks(1, 4 * P)
    s.add_request("a", doc + [1])
    s.schedule_saves("a", 4 * P + 1, list(range(10, 15)))           # computed and saved to L2 (no backup yet)
    assert [j.kind for j in s.build_plan().jobs] == []
    for rid in ("b", "c"):                                           # two requests whose prefix L1 still holds
        s.add_request(rid, doc + [2])
        assert s.lookup(rid, 4 * P) == 0                             # nothing beyond vLLM's own hit
        s.on_alloc(rid, list(range(10, 15)), 0)
        s.on_finished(rid)
    jobs = s.build_plan().jobs
    assert [(j.kind, j.num_pages) for j in jobs] == [("backup", 4)]


def test_write_back_waits_for_acknowledged_slots_instead_of_fetching_without_them():
    """Under write_back an L2 page L3 does not hold frees its slot only after its backup is acknowledged,
    but the room check counted it as free at once: the prefetch then found no staging slot for those pages and they
    were recomputed (42 of 1,024 pages in the benchmark). Now the lookup starts those backups and waits until the
    slots are really free; then every page gets a staging slot."""
    from tierkv.connector.core.plan import JobReport
    index, alloc, ctl = _controller(8, write_policy="write_back")
    own, hit = _keys(1, 8), _keys(100000, 4)
    index.insert(own, alloc.alloc(8))                                # 8 L2 pages not in L3 yet, unlocked
    index.insert(hit, [NO_SLOT] * 4, in_l3=[True] * 4)               # a 4-page L3 hit
    assert ctl.wait_for_room("r", 4) is None                         # backups of victims started; slots not free
    backups = ctl.take_jobs()
    assert backups and all(j.kind == "backup" for j in backups)
    ctl.on_reports([JobReport(j.job_id, j.kind, [True] * j.num_pages) for j in backups])   # the store acknowledged
    assert alloc.num_free >= 4 and ctl.wait_for_room("r", 4) is True
    job = ctl.start_prefetch("r", hit, 0, 4, [1, 2, 3, 4])
    assert NO_SLOT not in job.slots and ctl.counters.prefetch_no_room_pages == 0


def test_room_needed_now_passes_over_victims_that_must_first_be_written_back():
    """One reclaim routine (``controller.reclaim_l2``) serves room needed now (``make_room``) and room made ahead of
    need (``keep_free``). Needed now, a write_back victim whose pages L3 lacks frees nothing yet, so the routine goes
    on to victims L3 already holds; ahead of need, the slots of started backups count as being freed."""
    index, alloc, ctl = _controller(8, write_policy="write_back")
    old, held = _keys(1, 4), _keys(100000, 4)
    index.insert(old, alloc.alloc(4))                                # least recent: not in L3, must be backed up
    index.insert(held, alloc.alloc(4), in_l3=[True] * 4)             # in L3 already: its L2 copy can go now
    assert alloc.num_free == 0
    assert ctl.make_room(4) == 4                                     # the held pages went; old is being backed up
    assert [j.kind for j in ctl.take_jobs()] == ["backup"] and ctl.counters.write_back_pages == 4
    index2, alloc2, ctl2 = _controller(8, write_policy="write_back")
    index2.insert(old, alloc2.alloc(4))
    index2.insert(held, alloc2.alloc(4), in_l3=[True] * 4)
    ctl2.keep_free(4)                                                # 4 slots being freed are enough ahead of need
    assert alloc2.num_free == 0 and ctl2.counters.write_back_pages == 4


def test_the_engine_keeps_stepping_while_a_backup_or_prefetch_has_not_reported(tmp_path, monkeypatch):
    """Job reports arrive only with a step's output: an engine that went idle right after a burst kept the pins of
    its last backups and prefetches until the next request (the soak's "back to baseline at idle"). The connector
    asks vLLM to keep stepping (``has_pending_push_work``) exactly while such a job is out; an existence query
    pins nothing and does not count."""
    from types import SimpleNamespace
    from tierkv.connector.core.plan import JobReport
    from tierkv.connector.vllm.connector import TierKVWorkerMeta
    from tests.helpers.vllm_parts import SCHEDULER, connector, write_model
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    model = write_model(tmp_path / "model")
    s = connector(model, SCHEDULER, {"host_pool.num_pages": 8, "l3.backend": "file", "l3.file.root": str(tmp_path),
                                     "controller.exists_in_scheduler": False})
    ctl = s._sched.ctl
    assert not s.has_pending_push_work()
    keys = _keys(1, 3)
    assert ctl.l3_extend(keys, 0) is None                 # an existence job: pins nothing
    assert not s.has_pending_push_work()
    s._sched.index.insert(keys, s._sched.allocator.alloc(3))
    ctl.after_save(keys, 0)                               # a backup: pins its pages until its report
    assert s.has_pending_push_work()
    jobs = ctl.take_jobs()
    assert s.has_pending_push_work()
    out = SimpleNamespace(kv_connector_worker_meta=TierKVWorkerMeta([JobReport(j.job_id, j.kind, [True] * j.num_pages)
                                                                      for j in jobs]),
                          finished_recving=None, invalid_block_ids=None)
    s.update_connector_output(out)
    assert not s.has_pending_push_work() and s._sched.index.locked_pages == 0
    now = [0.0]
    ctl.clock = lambda: now[0]                            # a job out for good stops keeping the engine stepping
    s._sched.index.insert(_keys(500, 2), s._sched.allocator.alloc(2))
    ctl.after_save(_keys(500, 2), 0)
    ctl.take_jobs()
    assert s.has_pending_push_work()
    now[0] += ctl.shutdown_drain_s + 1
    assert not s.has_pending_push_work()


def test_a_step_that_fills_no_new_page_needs_no_save_planning():
    """``needs_saves`` (the connector asks it before fetching a request's block table every step): true exactly when
    the step fills a page beyond those already indexed, within the prompt and the request's save cap."""
    s = CacheScheduler(make_namespace(page_size=P), P, P, num_slots=16, controller={})
    prompt = toks(1000, 3 * P + 5)
    s.add_request("a", prompt)
    assert not s.needs_saves("nobody", 3 * P)
    assert not s.needs_saves("a", P - 1)                  # no page full yet
    assert s.needs_saves("a", P)                          # page 0 full after this step
    s.schedule_saves("a", 2 * P + 3, list(range(100, 104)))
    s.build_plan()
    assert not s.needs_saves("a", 2 * P + 9)              # pages 0-1 indexed, page 2 not full: a decode-like step
    assert s.needs_saves("a", 3 * P)
    assert s.needs_saves("a", 9 * P)                      # page 2 still to save (tokens past the prompt: no page)
    s.schedule_saves("a", 3 * P + 5, list(range(100, 104)))
    s.build_plan()
    assert not s.needs_saves("a", 9 * P)                  # every full page of the prompt indexed
    empty = CacheScheduler(make_namespace(page_size=P), P, P, num_slots=0, controller={})
    empty.add_request("b", prompt)
    assert not empty.needs_saves("b", 3 * P)              # no L2: nothing is ever saved


# ---------------------------------------------------------------- best_effort: deadline credit
def _credit_run(tmp_path, credit_s, max_s=None, batch_pages=16):
    """One 12-page prefetch on one reader with a fake clock: deadline 0.1 s, ``credit_s`` per page read. The first
    store call moves the clock to 0.15 s (past the first deadline) and returns its pages; the second blocks until
    the test opens it. Returns (store call sizes, finished at t = 0.5, finished at t = 0.95 with its result)."""
    import threading
    from tests.connector.l3.test_controller import file_store
    from tierkv.connector.l3.io import L3IO
    from tierkv.connector.core.plan import JOB_PREFETCH, Job
    now = [0.0]
    doc = toks(7000, 12 * P)
    e0 = FakeEngine(store=file_store(tmp_path))
    e0.run_l3(Req("w", doc + [1]))
    e0.settle()
    e0.close()
    e = FakeEngine(store=file_store(tmp_path), clock=lambda: now[0])
    w = e.worker
    w.l3.close()
    l3 = L3IO(w.l3.store, w.host, w.l3.rank_namespace, w.checksums, batch_pages=batch_pages, read_threads=1,
              clock=lambda: now[0])
    w.l3 = l3
    gate, in_second = threading.Event(), threading.Event()
    sizes = []
    inner = l3.store

    class Sized(_GatedStore):
        def batch_get(self, keys, dsts, **kw):
            sizes.append(len(keys))
            return super().batch_get(keys, dsts, **kw)

    def second():
        in_second.set()
        gate.wait(30)
    l3.store = Sized(inner, {0: lambda: now.__setitem__(0, 0.15), 1: second})
    job = Job(1, JOB_PREFETCH, _doc_keys(e, doc), slots=list(range(12)), block_ids=list(range(20, 32)),
              fetch=[True] * 12, req_id="r", deadline_s=0.1, deadline_credit_s=credit_s, deadline_max_s=max_s)
    l3.submit([job])
    assert in_second.wait(30)
    now[0] = 0.5
    at_05 = l3.poll().finished
    now[0] = 0.95
    res = l3.poll()
    gate.set()
    assert l3.wait_idle(30)
    l3.close()
    e.close()
    return sizes, at_05, res


def test_a_best_effort_read_that_keeps_ahead_of_recomputing_earns_time_page_by_page(tmp_path):
    """The fixed best_effort deadline (5 % of the recompute time) cut every read slower than that, however much
    faster than recomputing it was. With a credit of 0.2 s a page, the first call's 4 pages (a short first batch)
    move the 0.1 s deadline to 0.1 + 4 x 0.2 = 0.9 s: the request is still waiting at 0.5 s, and released at 0.95 s
    with those 4 pages loaded and the other 8 blocks recomputed; waiting 0.9 s and recomputing 8 pages (1.6 s) cost
    no more than the first wait plus recomputing all 12 (2.5 s)."""
    sizes, at_05, res = _credit_run(tmp_path, credit_s=0.2)
    assert sizes[0] == 4
    assert at_05 == set(), "released at its first deadline although pages kept arriving"
    assert res.finished == {"r"}
    assert [o.block_ids for o in res.orders] == [list(range(20, 24))]
    assert res.failed_blocks == set(range(24, 32))


def test_without_credit_or_past_its_cap_the_deadline_stays_put(tmp_path):
    """No credit (the other policies, or no recompute estimate yet; store calls of 4 pages here too): the request is
    released at its first deadline although 4 pages arrived. With credit capped at 0.3 s after the read's start (a
    synchronous load: every request of the step waits for it) it is released by 0.5 s with the 4 pages."""
    sizes, at_05, res = _credit_run(tmp_path / "a", credit_s=0.0, batch_pages=4)
    assert sizes[0] == 4 and at_05 == {"r"}
    sizes, at_05, res = _credit_run(tmp_path / "b", credit_s=0.2, max_s=0.3)
    assert sizes[0] == 4 and at_05 == {"r"}


def test_best_effort_credit_is_the_estimated_recompute_time_of_one_page():
    """The controller's credit per page: the prefill estimate x page size under best_effort (0 before an estimate
    and under the other policies); a prefetch job carries it, and a synchronous one carries the cap of
    2 x ``sync_load_max_s``."""
    from tierkv.connector.l3.controller import SYNC_DEADLINE_FACTOR
    _index, _alloc, ctl = _controller(8, prefetch_policy="best_effort")
    assert ctl.deadline_credit_s() == 0.0
    ctl.observe_prefill(1.0, 1000)                      # 1 ms per token
    assert ctl.deadline_credit_s() == pytest.approx(0.001 * P)
    _i, _a, t = _controller(8, prefetch_policy="timeout")
    t.observe_prefill(1.0, 1000)
    assert t.deadline_credit_s() == 0.0
    keys = _keys(1, 4)
    ctl.index.insert(keys, [NO_SLOT] * 4, in_l3=[True] * 4)
    job = ctl.start_prefetch("a", keys, 0, 4, list(range(4)))
    assert job.deadline_credit_s == pytest.approx(0.001 * P) and job.deadline_max_s is None
    sync = ctl.start_prefetch("b", keys, 0, 4, list(range(4, 8)), sync=True)
    assert sync.deadline_max_s == pytest.approx(SYNC_DEADLINE_FACTOR * ctl.sync_load_max_s)


def test_a_credited_prefetch_with_nothing_to_read_makes_no_store_call(tmp_path):
    """A prefetch whose pages are all in L2 already reads nothing: no ``batch_get`` with zero keys (a round trip
    to a networked store for nothing), with or without the deadline credit."""
    from tests.connector.l3.test_controller import file_store
    from tierkv.connector.core.plan import JOB_PREFETCH, Job
    e = FakeEngine(store=file_store(tmp_path))
    l3 = e.worker.l3
    calls = []
    l3.store = _GatedStore(l3.store, {i: (lambda: calls.append(1)) for i in range(4)})
    doc = toks(9000, 2 * P)
    l3.submit([Job(1, JOB_PREFETCH, _doc_keys(e, doc), slots=[0, 1], block_ids=[10, 11], fetch=[False, False],
                   req_id="r", deadline_s=0.1, deadline_credit_s=0.2)])
    assert l3.wait_idle(30)
    assert calls == [] and l3.poll().finished == {"r"}
    e.close()
