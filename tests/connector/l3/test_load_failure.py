"""A failed L2 -> L1 load never lets pages computed on the broken prefix into L2 or L3.

In the step whose synchronous load fails (a page that fails its checksum, or a copy that raises, all layers at once
or layer by layer), the engine's forward still computes the request's later pages on top of the broken prefix; vLLM
(``kv_load_failure_policy=recompute``) then rolls the request back to its first failed block and computes again. The
fake engine models exactly that (a page computed on a wrong prefix gets different bytes), with a real file store
under write_through, so a poisoned page would show up in the index, in L2, in L3 and in a later request's load.
"""
import pytest

from tests.helpers.fake_engine import P, FakeEngine, Req, inject_copy_fault
from tests.connector.l3.test_controller import file_store, keys_of
from tierkv.connector.l3.io import l3_key


def toks(a, n):
    return list(range(a, a + n))


def _indexed(e, tokens):
    """Leading pages of ``tokens`` the index holds (L2 or L3), no side effect."""
    return e.sched.index.match_prefix(keys_of(e, tokens), require_l2=False).num_pages


def _in_l3(e, keys):
    l3 = e.worker.l3
    assert l3.wait_idle(30)
    return [l3.store.batch_exists([l3_key(l3.rank_namespace, k)]) == 1 for k in keys]


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("fault", ["checksum", "copy"])
def test_pages_computed_on_a_failed_load_never_reach_l2_or_l3(tmp_path, monkeypatch, fault, layerwise):
    e = FakeEngine(store=file_store(tmp_path), controller={"write_policy": "write_through"}, layerwise=layerwise)
    doc = toks(1, 3 * P)
    assert e.run_l3(Req("seed", doc + [1])) == 0          # 3 pages saved to L2 and backed up to L3
    e.settle()
    if fault == "checksum":
        slot = e.sched.index.match_prefix(keys_of(e, doc)).host_slots[1]
        page = e.host.read_page(slot).clone()
        page[7] ^= 0xFF
        e.host.write_page(slot, page)
        first_bad = 1
    else:
        inject_copy_fault(monkeypatch, 1)                   # layer 0 copied, layer 1 raises: every block fails
        first_bad = 0
    r = Req("b", doc + toks(900, 2 * P) + [1])             # 5 full pages: 3 loaded from L2, 2 computed
    assert e.admit_l3(r) == 3 * P
    saves_before = e.worker.counters.save_pages
    e.step()                                               # the load fails; pages 3 and 4 are computed on it
    assert e.failed_blocks >= set(r.blocks[first_bad:3]) and r.req_id in e.rolled_back
    assert not e.page_ok(r, 3) and not e.page_ok(r, 4)     # the model: computed on a broken prefix = wrong bytes
    keys = keys_of(e, r.tokens)
    # nothing of the request from its first failed page on stays indexed; pages 3 and 4 were never written to L2
    # and never sent to L3
    assert _indexed(e, r.tokens) == first_bad
    assert e.worker.counters.save_pages == saves_before
    assert _in_l3(e, keys[3:5]) == [False, False]
    e.sched.check_invariants()
    monkeypatch.undo()
    e.step()                                               # vLLM's recompute from the first failed block
    assert all(e.page_ok(r, i) for i in range(5))
    assert e.worker.counters.save_pages == saves_before + 5 - first_bad  # the recomputed pages are saved
    e.finish(r)
    e.settle()
    assert _indexed(e, r.tokens) == 5 and _in_l3(e, keys[:5]) == [True] * 5
    c = Req("c", r.tokens[: 5 * P] + [7])
    assert e.run_l3(c) == 5 * P                            # bit-identical to a fresh prefill (run_l3 checks it)
    e.settle()
    e.idle_check()
    e.close()
    # a new engine on the same store loads the 5 pages from L3 alone: what L3 holds is right too
    e2 = FakeEngine(store=file_store(tmp_path))
    assert e2.run_l3(Req("d", r.tokens[: 5 * P] + [8])) == 5 * P
    e2.settle()
    e2.idle_check()
    e2.close()


def test_a_plan_built_before_the_failure_was_known_saves_nothing_of_that_request(tmp_path):
    """vLLM's asynchronous scheduling builds step N+1's plan before it has step N's output: a request whose load
    failed in step N still has saves in plan N+1 (its next chunk, computed on the same broken prefix). The worker
    makes none of them and sends none to L3 until a plan confirms the rollback (``StepPlan.recomputed``); the scheduler
    side drops both steps' pages; the plan after the rollback saves the recomputed pages."""
    e = FakeEngine(store=file_store(tmp_path), controller={"write_policy": "write_through"})
    w = e.worker
    doc = toks(1, 3 * P)
    assert e.run_l3(Req("seed", doc + [1])) == 0
    e.settle()
    slot = e.sched.index.match_prefix(keys_of(e, doc)).host_slots[1]
    page = e.host.read_page(slot).clone()
    page[7] ^= 0xFF
    e.host.write_page(slot, page)
    r = Req("b", doc + toks(900, 4 * P) + [1])             # 7 full pages: 3 loaded, then chunks of 2 and 2
    assert e.admit_l3(r) == 3 * P
    e.running.pop(r.req_id)                                # driven by hand below
    keys = keys_of(e, r.tokens)
    saves0 = w.counters.save_pages

    def run(plan, pages):
        w.start_loads(plan)
        w.finish_loads()
        for i in pages:
            e.write_page(r, i)
        w.run_saves(plan)
        w.submit_jobs(plan)
        return w.take_failed_blocks()

    e.sched.schedule_saves(r.req_id, 5 * P, r.blocks)
    plan_n = e.sched.build_plan()
    failed_n = run(plan_n, [3, 4])
    assert failed_n == {r.blocks[1], r.blocks[2]}
    e.sched.schedule_saves(r.req_id, 7 * P, r.blocks)      # plan N+1, built before step N's output arrived
    plan_n1 = e.sched.build_plan()
    assert [o.slots for o in plan_n1.saves if o.req_id == r.req_id] and not plan_n1.recomputed
    e.sched.on_reports(w.take_reports())
    e.sched.on_load_errors(failed_n)                       # step N's output
    assert _indexed(e, r.tokens) == 1
    assert run(plan_n1, [5, 6]) == set()                   # step N+1 runs: pages 5 and 6 on the broken prefix
    assert w.counters.save_pages == saves0 and w.counters.unsaved_pages == 4
    assert _in_l3(e, keys[3:7]) == [False] * 4
    e.sched.on_reports(w.take_reports())
    e.sched.on_load_errors(set())
    e.sched.schedule_saves(r.req_id, 7 * P, r.blocks)      # vLLM rolled back to page 1: it computes pages 1..6
    plan_n2 = e.sched.build_plan()
    assert plan_n2.recomputed == [r.req_id]
    assert run(plan_n2, range(1, 7)) == set()
    assert all(e.page_ok(r, i) for i in range(7))
    assert w.counters.save_pages == saves0 + 6
    e.sched.on_reports(w.take_reports())
    e.sched.on_load_errors(set())
    e.finish(r)
    e.settle()
    assert _indexed(e, r.tokens) == 7 and _in_l3(e, keys[:7]) == [True] * 7
    assert e.run_l3(Req("c", r.tokens[: 7 * P] + [5])) == 7 * P
    e.settle()
    e.idle_check()
    e.close()


@pytest.mark.parametrize("layerwise", [False, True])
def test_two_requests_loading_the_same_page_in_one_step_both_get_it(layerwise):
    """Two requests with one prefix admitted in the same step load the same L2 slots into their own blocks; the
    kernels take a slot once per call, so the worker copies in rounds instead of failing the whole load."""
    e = FakeEngine(layerwise=layerwise)
    doc = toks(1, 3 * P)
    assert e.run(Req("a", doc + [1])) == 0
    b, c = Req("b", doc + [2]), Req("c", doc + [3])
    assert e.admit(b) == 3 * P and e.admit(c) == 3 * P
    e.step()
    assert e.failed_blocks == set() and not e.rolled_back
    assert all(e.page_ok(x, i) for x in (b, c) for i in range(3))
    assert e.worker.counters.load_pages == 6 and e.worker.counters.failed_load_blocks == 0
    e.finish(b)
    e.finish(c)
    e.idle_check()


def test_a_page_whose_save_was_not_made_is_never_loaded(monkeypatch):
    """Without checksums (``verify_checksums: false``): a request admitted in plan N+1, built before step N's
    output, matches the pages its neighbour's failed step N indexed; their slots were never written, so its load
    stops there (recomputed) instead of copying whatever those slots held."""
    e = FakeEngine(verify=False)
    w = e.worker
    doc = toks(1, 3 * P)
    assert e.run(Req("seed", doc + [1])) == 0
    x = Req("x", doc + toks(900, 2 * P) + [1])
    assert e.admit(x) == 3 * P
    e.running.pop(x.req_id)
    e.sched.schedule_saves(x.req_id, 5 * P, x.blocks)
    plan_n = e.sched.build_plan()
    inject_copy_fault(monkeypatch, 0)
    w.start_loads(plan_n)
    w.finish_loads()
    monkeypatch.undo()
    for i in (3, 4):
        e.write_page(x, i)
    w.run_saves(plan_n)
    failed_n = w.take_failed_blocks()
    assert failed_n == set(x.blocks[:3]) and w.counters.unsaved_pages == 2
    z = Req("z", x.tokens[: 5 * P] + [2])                  # plan N+1: the index still holds x's 5 pages
    assert e.admit(z) == 5 * P
    e.running.pop(z.req_id)
    plan_n1 = e.sched.build_plan()
    w.start_loads(plan_n1)
    w.finish_loads()
    w.run_saves(plan_n1)
    assert w.take_failed_blocks() == {z.blocks[3], z.blocks[4]}
    assert all(e.page_ok(z, i) for i in range(3)) and w.counters.load_pages == 3
    e.sched.on_load_errors(failed_n)
    e.sched.check_invariants()


def test_a_request_preempted_before_its_failure_was_known_saves_again_once_resumed():
    """Asynchronous scheduling may preempt a request in plan N+1 before step N's output says its load failed. The
    failure still takes its pages out of the index, and the resumed request (computed from an intact prefix) has its
    pages saved again: the preemption tells the workers its later saves are good (``StepPlan.recomputed``)."""
    e = FakeEngine()
    w = e.worker
    doc = toks(1, 3 * P)
    assert e.run(Req("seed", doc + [1])) == 0
    slot = e.sched.index.match_prefix(keys_of(e, doc)).host_slots[1]
    page = e.host.read_page(slot).clone()
    page[7] ^= 0xFF
    e.host.write_page(slot, page)
    x = Req("x", doc + toks(900, 2 * P) + [1])
    assert e.admit(x) == 3 * P
    e.running.pop(x.req_id)
    e.sched.schedule_saves(x.req_id, 5 * P, x.blocks)
    plan_n = e.sched.build_plan()
    w.start_loads(plan_n)
    w.finish_loads()
    for i in (3, 4):
        e.write_page(x, i)
    w.run_saves(plan_n)
    failed_n = w.take_failed_blocks()
    assert failed_n == {x.blocks[1], x.blocks[2]} and w.counters.unsaved_pages == 2
    e.sched.on_preempted(x.req_id)                         # plan N+1 preempts x
    e.free_blocks.extend(x.blocks)
    plan_n1 = e.sched.build_plan()
    assert plan_n1.recomputed == [x.req_id]
    w.start_loads(plan_n1)
    w.run_saves(plan_n1)
    e.sched.on_load_errors(failed_n)                       # step N's output
    assert _indexed(e, x.tokens) == 1
    e.sched.check_invariants()
    saves = w.counters.save_pages
    x2 = Req("x", x.tokens)                                # resumed: page 0 from L2, pages 1..4 computed
    assert e.admit(x2) == P
    e.step()
    assert not e.rolled_back and all(e.page_ok(x2, i) for i in range(5))
    assert w.counters.save_pages == saves + 4
    e.finish(x2)
    assert e.run(Req("c", x.tokens[: 5 * P] + [3])) == 5 * P
    e.idle_check()
