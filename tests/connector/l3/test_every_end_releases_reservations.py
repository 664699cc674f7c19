"""Every terminal path of a request (finish, abort at each stage, preemption, load failure, deadline)
gives back every reservation: index locks, staging slots, jobs, room and existence waits."""
from __future__ import annotations

import random

import pytest

from tests.helpers.fake_engine import P, FakeEngine, Req, inject_copy_fault



from tests.helpers.l3_scenarios import (assert_nothing_reserved, complete_async_load, file_store, l3io, pump, start_async_load, toks, write_to_l3)

# ================================================================ every reservation released on every path
END_POINTS = ("finished", "before_lookup", "waiting_for_existence", "waiting_for_room", "during_prefetch",
              "after_load_before_running", "preempted", "load_failure", "deadline_then_finish")


def _end_engine(tmp_path, n_docs=8):
    now = [0.0]
    docs = [toks(10_000 * (i + 1), 4 * P) for i in range(n_docs)]
    write_to_l3(tmp_path, docs)
    e = FakeEngine(num_slots=16, num_blocks=96, store=file_store(tmp_path, {0: {}}), clock=lambda: now[0],
                   controller={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.5,
                               "prefetch_timeout_per_page_s": 0.0})
    return e, docs, now


def _end_at(e, req, point, now, monkeypatch):
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


def _replay_all(e, docs, tag):
    declined = e.sched.ctl.counters.l3_declined_room_pages
    for i, d in enumerate(docs):
        assert e.run_l3(Req(f"{tag}-{i}", d + [5, i])) == 4 * P, f"replay of doc {i} lost its hit"
    e.settle()
    assert e.sched.ctl.counters.l3_declined_room_pages == declined
    assert_nothing_reserved(e)


@pytest.mark.parametrize("point", END_POINTS)
def test_every_terminal_path_releases_every_reservation(tmp_path, monkeypatch, point):
    """An abort from a side queue must not leak the prefetch budget. tierkv's reservations are index locks, staging
    slots, pending jobs, the controller's request state (request-side-open set, room waits, existence waits, fetches
    in flight) and the scheduler's per-request state. A request ended at ``point`` (normal finish, abort before its
    lookup, while its existence answer is pending, while it waits for L2 room, during its L3 read, after its load
    ended but before it ran, while preempted, after a failed L2 -> L1 load, after its deadline released it while the
    read still hung) leaves none of them behind once its jobs ended, and every prompt replayed afterwards gets its
    whole hit without a room decline."""
    e, docs, now = _end_engine(tmp_path, n_docs=4)
    _end_at(e, Req("x", docs[0] + [2]), point, now, monkeypatch)
    assert_nothing_reserved(e)
    _replay_all(e, docs, "replay")
    e.close()


def test_seeded_rounds_of_random_end_points_leave_no_reservation(tmp_path, monkeypatch):
    """Rounds in which every prompt ends at a random point (seeded); after each round nothing is
    reserved, every replay gets its whole hit, and the free + indexed slot count is the pool size."""
    rng = random.Random(35)
    e, docs, now = _end_engine(tmp_path, n_docs=8)
    points = [p for p in END_POINTS if p not in ("waiting_for_room", "load_failure")]
    for rnd in range(4):
        e.sched.reset()                                                    # every prompt comes from L3 again
        for i, d in enumerate(docs):
            _end_at(e, Req(f"r{rnd}-{i}", d + [rnd, i]), rng.choice(points), now, monkeypatch)
        assert_nothing_reserved(e)
        _replay_all(e, docs, f"replay{rnd}")
    e.close()


