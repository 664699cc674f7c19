"""Every wait for L3 comes from one LoadPolicy: its decisions, the controller's delegation to it, and the generated
table of its constants in docs/l3-waits.md."""
import pytest

from tierkv.connector.core.radix_index import RadixIndex
from tierkv.connector.l2.slot_allocator import SlotAllocator
from tierkv.connector.l3 import load_policy
from tierkv.connector.l3.controller import Controller
from tierkv.connector.l3.hit_estimates import _Ewma
from tierkv.connector.l3.load_policy import (BEST_EFFORT_MIN_WAIT_S, STEP_READ_WAIT_FRACTION, SYNC_DEADLINE_FACTOR,
                                             LoadPolicy)

P = 16


def _policy(**kw):
    clock = lambda: 0.0  # noqa: E731
    return LoadPolicy(page_size=P, fetch_s_per_page=_Ewma(clock), prefill_s_per_token=_Ewma(clock), **kw)


def test_a_hit_is_synchronous_only_with_an_estimate_that_fits_the_bound():
    pol = _policy(sync_load_max_s=0.02)
    assert not pol.load_sync(4)                         # no fetch estimate yet
    pol.fetch_s_per_page.add(0.005)
    assert pol.load_sync(4) and not pol.load_sync(5)    # 20 ms fits, 25 ms does not
    assert not _policy(sync_load_max_s=0.0).load_sync(1)
    waits = _policy(prefetch_policy="wait_complete")
    waits.fetch_s_per_page.add(1e-6)
    assert not waits.load_sync(1)


def test_deadlines_per_policy():
    assert _policy(prefetch_policy="wait_complete").deadline_s(10) is None
    assert _policy(prefetch_policy="timeout").deadline_s(10) == pytest.approx(0.5 + 0.005 * 10)
    pol = _policy(prefetch_policy="best_effort")
    assert pol.deadline_s(10) == pytest.approx(0.55) and pol.deadline_credit_s() == 0.0
    pol.prefill_s_per_token.add(1e-3)                   # 10 pages recompute in 0.16 s
    assert pol.deadline_s(10) == pytest.approx(0.05 * 0.16)
    assert pol.deadline_credit_s() == pytest.approx(1e-3 * P)
    pol.fetch_s_per_page.add(1e-6)
    assert pol.deadline_s(10) == BEST_EFFORT_MIN_WAIT_S


def test_a_synchronous_load_is_capped_by_the_sync_bound():
    pol = _policy(prefetch_policy="timeout", sync_load_max_s=0.01)
    assert pol.sync_deadline_s(10) == pytest.approx(SYNC_DEADLINE_FACTOR * 0.01)
    assert pol.deadline_max_s(True, 0.0) is None and pol.deadline_max_s(False, 1.0) is None
    assert pol.deadline_max_s(True, 1.0) == pytest.approx(SYNC_DEADLINE_FACTOR * 0.01)
    assert _policy(prefetch_policy="wait_complete", sync_load_max_s=0.01).sync_deadline_s(3) == pytest.approx(0.02)


def test_room_and_existence_waits():
    pol = _policy(prefetch_policy="best_effort", room_retry_steps=8, room_wait_s=0.5, exists_wait_s=1.0)
    assert pol.room_wait_limits(4) == (8, 0.5)
    pol.prefill_s_per_token.add(1e-3)
    assert pol.room_wait_limits(4) == (1, pytest.approx(pol.deadline_s(4)))
    assert not pol.exists_overdue(1.0) and pol.exists_overdue(1.01)


def test_worker_step_wait_and_hybrid_override():
    assert LoadPolicy.step_read_wait_s(None, 5.0) == 0.0
    assert LoadPolicy.step_read_wait_s(1.0, 1.6) == pytest.approx(STEP_READ_WAIT_FRACTION * 0.6)
    kw = {"sync_load_max_s": 0.05}
    assert LoadPolicy.hybrid_override(kw, False) == {"sync_load_max_s": 0.05}
    assert LoadPolicy.hybrid_override(kw, True) is kw and kw["sync_load_max_s"] == 0.0


@pytest.mark.parametrize("kw,key", [({"prefetch_policy": "soon"}, "prefetch_policy"),
                                    ({"prefetch_timeout_base_s": 0.0}, "prefetch_timeout_base_s"),
                                    ({"sync_load_max_s": -1.0}, "sync_load_max_s")])
def test_bad_settings_name_their_key(kw, key):
    with pytest.raises(ValueError, match=f"'controller.{key}'"):
        _policy(**kw)


def test_the_controller_delegates_every_wait_to_its_policy():
    ctl = Controller(RadixIndex(), SlotAllocator(8), page_size=P, prefetch_policy="timeout", sync_load_max_s=0.03)
    pol = ctl.load_policy
    assert pol.fetch_s_per_page is ctl.fetch_s_per_page and pol.prefill_s_per_token is ctl.prefill_s_per_token
    assert (ctl.prefetch_policy, ctl.sync_load_max_s, ctl.timeout_base_s) == ("timeout", 0.03, 0.5)
    ctl.sync_load_max_s = 0.0
    assert pol.sync_load_max_s == 0.0
    assert ctl.deadline_s(4) == pol.deadline_s(4) and ctl.sync_deadline_s(4) == pol.sync_deadline_s(4)


def test_the_table_of_waits_in_the_docs_is_current(tmp_path):
    doc = load_policy.doc_path()
    text = doc.read_text(encoding="utf-8")
    assert load_policy.render(text) == text, f"docs/l3-waits.md is out of date: run `{load_policy.REGENERATE}`"
    names = [n for n, _v, _t in load_policy.constants()]
    assert {"BEST_EFFORT_STALL_FRACTION", "BEST_EFFORT_MIN_WAIT_S", "SYNC_DEADLINE_FACTOR",
            "STEP_READ_WAIT_FRACTION"} <= set(names)
    stale = tmp_path / "l3-waits.md"
    stale.write_text(text.replace("| 0.25 |", "| 0.5 |"), encoding="utf-8")
    assert load_policy.main(["--doc", str(stale), "--check"]) == 1
    assert load_policy.main(["--doc", str(stale), "--write"]) == 0
    assert stale.read_text(encoding="utf-8") == text


def test_sync_reads_wait_is_the_queue_factor_times_the_longest_deadline():
    from tierkv.connector.l3.load_policy import SYNC_READ_QUEUE_FACTOR
    assert LoadPolicy.sync_reads_wait_s([0.01, 0.04, 0.02]) == pytest.approx(SYNC_READ_QUEUE_FACTOR * 0.04 + 0.001)
    assert LoadPolicy.sync_reads_wait_s([]) == pytest.approx(0.001)
