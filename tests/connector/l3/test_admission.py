"""Admission to L3 (``l3.admission``): each mode's decisions on one scripted sequence of requests, the counters, the
bounded ghost, and the config keys.

The sequence: ``a`` reads document D once, ``b`` reads document E once (one-time prompts), ``c`` reads D again. The
engine is the fake one over a real file store, so "stored" means the store holds the page.
"""
import pytest

from tests.connector.l3.test_controller import file_store, l3_has, toks
from tests.helpers.fake_engine import P, FakeEngine, Req
from tierkv.connector.core.config import ConfigError, load_config
from tierkv.connector.core.request_params import RequestControls
from tierkv.connector.l3.admission import Admission

D, E = toks(100, 4 * P), toks(5000, 4 * P)


def engine(tmp_path, admission, num_slots=64, **ctl):
    return FakeEngine(num_slots=num_slots, store=file_store(tmp_path),
                      controller={"admission": admission, **ctl})


def counters(e, *more):
    s = e.sched.stats()
    return {k.removeprefix("ctl_admission_"): s[k] for k in ("ctl_admission_offered_pages",
                                                             "ctl_admission_admitted_pages",
                                                             "ctl_admission_rejected_pages",
                                                             "ctl_admission_rejected_hit_pages", *more)}


def run(e, *reqs):
    for r in reqs:
        e.run_l3(r)
        e.settle()


@pytest.mark.parametrize("mode, stored_after_once, stored_after_repeat", [
    ("always", 8, 8),          # both one-time documents written at once
    ("second_sight", 0, 4),    # nothing until a second request reads D; E never
    ("reused_in_l2", 0, 0),    # nothing until L2 evicts (it never has to here)
])
def test_each_mode_writes_what_it_admits_on_one_time_and_repeated_prompts(tmp_path, mode, stored_after_once,
                                                                          stored_after_repeat):
    e = engine(tmp_path, mode)
    run(e, Req("a", D + [1]), Req("b", E + [1]))
    c = e.sched.ctl.counters
    assert c.backup_stored_pages == stored_after_once
    run(e, Req("c", D + [2]))  # D again: an L2 hit
    assert c.backup_stored_pages == stored_after_repeat
    assert l3_has(e, Req("x", D), 4) == (4 if stored_after_repeat else 0)
    assert l3_has(e, Req("x", E), 4) == (4 if mode == "always" else 0)
    e.idle_check()
    e.close()


def test_second_sight_counters_and_what_a_rejection_cost(tmp_path):
    e = engine(tmp_path, "second_sight")
    run(e, Req("a", D + [1]), Req("b", E + [1]))
    assert counters(e) == {"offered_pages": 8, "admitted_pages": 0, "rejected_pages": 8, "rejected_hit_pages": 0}
    run(e, Req("c", D + [2]))  # the hit admits D: offered again and admitted, never rejected twice
    assert counters(e) == {"offered_pages": 12, "admitted_pages": 4, "rejected_pages": 8, "rejected_hit_pages": 0}
    e.sched.reset()  # L2 flushed: D is in L3, E nowhere
    assert e.run_l3(Req("d", D + [3])) == 4 * P  # the repeated prefix is served from L3
    assert e.sched.ctl.counters.l3_hit_tokens == 4 * P
    e.settle()
    assert e.run_l3(Req("f", E + [3])) == 0  # E was turned away: recomputed, and counted as admission's cost
    e.settle()
    assert counters(e)["rejected_hit_pages"] == 4
    # its second request saved it again: admitted now
    assert l3_has(e, Req("x", E), 4) == 4
    e.idle_check()
    e.close()


def test_a_request_that_sees_its_own_pages_twice_does_not_admit_them(tmp_path):
    e = engine(tmp_path, "second_sight")
    r = Req("a", D + [1])
    e.admit_l3(r)
    assert e.sched.lookup("a", 0) == 0  # the same request looks up again (vLLM asks every step while it waits)
    e.step()
    e.finish(r)
    e.settle()
    assert e.sched.ctl.counters.backup_stored_pages == 0 and counters(e)["rejected_pages"] == 4
    e.close()


def test_reused_in_l2_writes_on_eviction_only_the_pages_hit_in_l2(tmp_path):
    e = engine(tmp_path, "reused_in_l2", num_slots=8)
    run(e, Req("a", D + [1]), Req("b", E + [1]), Req("c", D + [2]))  # D hit in L2 by c, E never
    c = e.sched.ctl.counters
    assert c.backup_stored_pages == 0 and counters(e)["offered_pages"] == 0
    run(e, Req("f", toks(9000, 4 * P) + [1]))  # L2 full: E (least recent) is evicted, not reused: dropped
    assert c.backup_stored_pages == 0
    assert counters(e) == {"offered_pages": 4, "admitted_pages": 0, "rejected_pages": 4, "rejected_hit_pages": 0}
    run(e, Req("g", toks(12000, 4 * P) + [1]))  # then D: hit once in L2, written as it leaves
    assert c.backup_stored_pages == 4 and l3_has(e, Req("x", D), 4) == 4 and l3_has(e, Req("x", E), 4) == 0
    assert counters(e)["admitted_pages"] == 4
    assert e.run_l3(Req("h", E + [5])) == 0  # E, turned away, is wanted again
    assert counters(e)["rejected_hit_pages"] == 4
    e.settle()
    assert e.run_l3(Req("i", D + [5])) == 4 * P  # D, written on eviction, is served from L3
    e.settle()
    e.idle_check()
    e.close()


def test_always_counts_every_offer_as_admitted(tmp_path):
    e = engine(tmp_path, "always")
    run(e, Req("a", D + [1]), Req("b", E + [1]))
    assert counters(e) == {"offered_pages": 8, "admitted_pages": 8, "rejected_pages": 0, "rejected_hit_pages": 0}
    e.close()


def test_write_back_victims_pass_second_sight(tmp_path):
    e = engine(tmp_path, "second_sight", num_slots=8, write_policy="write_back")
    run(e, Req("a", D + [1]), Req("b", E + [1]), Req("c", D + [2]))  # D seen by a and c, E by b only
    run(e, Req("f", toks(9000, 4 * P) + [1]), Req("g", toks(12000, 4 * P) + [1]))  # both leave L2
    assert l3_has(e, Req("x", D), 4) == 4 and l3_has(e, Req("x", E), 4) == 0
    assert e.sched.ctl.counters.backup_stored_pages == 4
    assert e.sched.ctl.counters.write_back_dropped_pages == 0  # E was turned away, not a failed backup
    e.idle_check()
    e.close()


# ---------------------------------------------------------------- request control ``keep``
def run_kept(e, req, **controls):
    """Run ``req`` with the request controls ``controls`` (the scheduler keeps those of its first add_request)."""
    e.sched.add_request(req.req_id, req.tokens, controls=RequestControls(**controls))
    run(e, req)


@pytest.mark.parametrize("mode, ctl", [
    ("second_sight", {}),                             # write-through offer at the save
    ("second_sight", {"write_policy": "write_back"}),  # offer when L2 evicts
    ("reused_in_l2", {}),                             # offer when L2 evicts, never hit in L2
])
@pytest.mark.parametrize("keep", [True, False])
def test_a_kept_request_writes_its_pages_on_first_sight(tmp_path, mode, ctl, keep):
    """One request reads D once, then two other one-time documents push it out of L2: D reaches L3 (and is served
    from it after L2 is flushed, as after a restart) only when the request keeps it."""
    e = engine(tmp_path, mode, num_slots=8, **ctl)
    run_kept(e, Req("a", D + [1]), keep=keep)
    run(e, Req("f", toks(9000, 4 * P) + [1]), Req("g", toks(12000, 4 * P) + [1]))  # L2 holds 8 pages: D leaves
    c = e.sched.ctl.counters
    assert c.backup_stored_pages == (4 if keep else 0)
    assert l3_has(e, Req("x", D), 4) == (4 if keep else 0)
    assert counters(e, "ctl_admission_kept_pages")["kept_pages"] == (4 if keep else 0)
    e.sched.reset()
    assert e.run_l3(Req("b", D + [2])) == (4 * P if keep else 0)
    e.settle()
    e.idle_check()
    e.close()


def test_keep_writes_only_what_the_request_saves(tmp_path):
    """``keep`` with ``save_max_tokens``: only the saved leading pages are kept and written; with ``save: false``
    nothing is saved, so nothing is written."""
    e = engine(tmp_path, "second_sight")
    run_kept(e, Req("a", D + [1]), keep=True, save_max_tokens=2 * P + 5)
    assert e.sched.ctl.counters.backup_stored_pages == 2 and l3_has(e, Req("x", D), 4) == 2
    run_kept(e, Req("n", E + [1]), keep=True, save=False)
    assert e.sched.counters.save_pages == 2 and e.sched.ctl.counters.backup_stored_pages == 2
    assert l3_has(e, Req("x", E), 4) == 0 and len(e.sched.ctl.admission.kept.d) == 2
    e.close()


def test_keep_changes_nothing_under_always(tmp_path):
    e = engine(tmp_path, "always")
    run_kept(e, Req("a", D + [1]), keep=True)
    run(e, Req("b", E + [1]))
    assert e.sched.ctl.counters.backup_stored_pages == 8
    assert counters(e, "ctl_admission_kept_pages") == {"offered_pages": 8, "admitted_pages": 8, "rejected_pages": 0,
                                                       "rejected_hit_pages": 0, "kept_pages": 0}
    assert e.sched.ctl.admission.memory_keys() == 0
    e.close()


# ---------------------------------------------------------------- the ghost on its own
def keys(n, base=0):
    return [bytes([0] * 12) + (base + i).to_bytes(4, "big") for i in range(n)]


def test_ghost_memory_is_bounded_by_the_window_and_old_keys_are_forgotten():
    a = Admission("second_sight", window_pages=4)
    ks = keys(10)
    a.seen("r1", ks)
    assert len(a.ghost.d) == 4 and a.memory_keys() == 4
    a.seen("r2", ks[:1])     # key 0 left the window: seen for the first time again
    a.seen("r2", ks[9:])     # key 9 is in it: seen by a second request
    assert a.admit_run(ks[:1]) == 0 and a.admit_run(ks[9:]) == 1
    a.admit_run(keys(20, 100))  # twenty rejections: the rejected keys stay bounded too
    assert len(a.rejected.d) == 4 and len(a.ghost.d) <= 4


def test_admission_takes_a_leading_run_and_a_lookup_counts_each_rejected_page_once():
    a = Admission("second_sight", window_pages=64)
    ks = keys(4)
    a.seen("r1", ks)
    a.seen("r2", ks[:2] + ks[3:], 0)  # keys 0, 1 and 3 seen twice, key 2 once
    assert a.admit_run(ks) == 2          # 3 is behind a rejected page: an L3 copy after a gap is useless
    assert (a.offered_pages, a.admitted_pages, a.rejected_pages) == (4, 2, 2)
    assert a.wanted(ks[2:]) == 2 and a.wanted(ks[2:]) == 0
    assert a.rejected_hit_pages == 2


def test_seen_lookup_costs_only_new_keys_and_is_forgotten_at_the_end():
    a = Admission("second_sight", window_pages=64)
    ks = keys(6)
    a.seen_lookup("r1", ks, 3)
    a.seen_lookup("r1", ks, 6)
    assert a._looked == {"r1": 6} and len(a.ghost.d) == 6
    a.end_request("r1")
    assert a._looked == {}


@pytest.mark.parametrize("mode", ["second_sight", "reused_in_l2"])
def test_a_kept_page_is_admitted_where_the_mode_rejects_it(mode):
    a = Admission(mode, window_pages=64)
    ks = keys(4)
    a.seen("r1", ks)                      # first sight, never hit in L2
    assert a.admit_run(ks[:2]) == 0 and a.kept_pages == 0
    a.keep(ks[1:3])                       # a request keeps keys 1 and 2 (not 0)
    assert a.admit_run(ks[:3]) == 0       # key 0 heads the run: a leading run, kept or not
    assert a.admit_run(ks[1:]) == 2       # 1 and 2 bypass admission, 3 is still turned away
    assert (a.kept_pages, a.admitted_pages) == (2, 2)
    assert a.stats()["ctl_admission_kept_pages"] == 2
    assert ks[1] not in a.rejected.d and ks[3] in a.rejected.d


def test_a_kept_page_admitted_by_the_mode_is_not_counted_as_kept():
    a = Admission("second_sight", window_pages=64)
    ks = keys(2)
    a.seen("r1", ks)
    a.seen("r2", ks[:1])                  # key 0 seen twice: the mode admits it
    a.keep(ks)
    assert a.admit_run(ks) == 2 and a.kept_pages == 1


def test_always_remembers_no_kept_key():
    a = Admission("always", window_pages=64)
    a.keep(keys(8))
    assert a.memory_keys() == 0 and a.admit_run(keys(8)) == 8 and a.stats()["ctl_admission_kept_pages"] == 0


def test_kept_keys_are_bounded_by_the_window_and_counted_in_memory():
    a = Admission("reused_in_l2", window_pages=4)
    ks = keys(10)
    a.keep(ks)
    assert len(a.kept.d) == 4 and a.memory_keys() == 4
    assert a.admit_run(ks[:1]) == 0       # key 0 fell out of the window: the mode decides again
    assert a.admit_run(ks[6:]) == 4 and a.kept_pages == 4


def test_bad_modes_and_windows_are_refused_naming_the_key():
    with pytest.raises(ValueError, match="l3.admission.*always, second_sight, reused_in_l2"):
        Admission("sometimes")
    with pytest.raises(ValueError, match="l3.admission_window_pages"):
        Admission("second_sight", 0)


@pytest.mark.parametrize("over, match", [
    ({"l3.admission": "sometimes"}, r"'l3.admission'.*'always', 'second_sight' or 'reused_in_l2'"),
    ({"l3.admission_window_pages": 0}, r"'l3.admission_window_pages'.*greater than 0"),
    ({"l3.admission_window_pages": -5}, r"'l3.admission_window_pages'"),
    ({"controller.write_only_warn_bytes": -1}, r"'controller.write_only_warn_bytes'"),
])
def test_config_keys_are_validated(over, match):
    with pytest.raises(ConfigError, match=match):
        load_config(overrides={"l3.backend": "file", "l3.file": {"root": "/tmp"}, **over})


def test_config_defaults_and_the_warn_key_without_l3():
    cfg = load_config()
    assert (cfg.l3.admission, cfg.l3.admission_window_pages) == ("always", 1 << 18)
    assert cfg.controller.write_only_warn_bytes == 1 << 30
    # read for L2 too: not refused as a controller key that does nothing without an L3 store
    assert load_config(overrides={"controller.write_only_warn_bytes": 5}).controller.write_only_warn_bytes == 5
    assert "write_only_warn_bytes" not in cfg.controller.scheduler_kwargs()


def test_a_second_request_served_from_l1_admits_the_pages_it_shares(tmp_path):
    e = engine(tmp_path, "second_sight")
    run(e, Req("a", D + [1]))
    assert e.sched.ctl.counters.backup_ordered_pages == 0
    b = Req("b", D + [2])
    e.sched.add_request("b", b.tokens)
    assert e.sched.lookup("b", 4 * P) == 0  # vLLM's own prefix cache (L1) holds D: tierkv adds nothing
    b.blocks = [e.free_blocks.pop(0) for _ in range(5)]
    e.sched.on_alloc("b", b.blocks, 0)
    e.sched.on_finished("b")
    e.free_blocks.extend(b.blocks)
    e.settle()
    assert e.sched.ctl.counters.backup_stored_pages == 4 and l3_has(e, Req("x", D), 4) == 4
    e.idle_check()
    e.close()
