"""Per-tier bytes written and served, and the warning about a tier that only writes (fake clock)."""
import logging

import pytest

from tests.connector.l3.test_controller import file_store, toks
from tests.helpers.fake_engine import P, FakeEngine, Req
from tierkv.connector.obs.tier_bytes import WARN_EVERY_S, TierBytes

GIB = 1 << 30


class Clock:
    def __init__(self, t=0.0):
        self.t = t

    def __call__(self):
        return self.t


def snapshot(saved=0, l2_hit_tokens=0, stored=None, l3_hit_tokens=0):
    d = {"save_pages": saved, "l2_hit_tokens": l2_hit_tokens}
    if stored is not None:
        d.update(ctl_backup_stored_pages=stored, ctl_l3_hit_tokens=l3_hit_tokens)
    return d


def test_bytes_per_tier_from_the_scheduler_counters():
    tb = TierBytes(l2_page_bytes=1000, l3_page_bytes=500, page_size=16, warn_bytes=0)
    d = snapshot(saved=7, l2_hit_tokens=40, stored=3, l3_hit_tokens=32)
    tb.add_to(d)
    assert (d["l2_written_bytes"], d["l2_served_bytes"]) == (7000, 2500)   # 40 tokens x 1000 / 16
    assert (d["l3_written_bytes"], d["l3_served_bytes"]) == (1500, 1000)
    d2 = snapshot(saved=1)
    tb.add_to(d2)  # no controller: no L3 keys
    assert "l3_written_bytes" not in d2 and d2["l2_written_bytes"] == 1000


def test_a_write_only_tier_is_warned_about_once_an_hour_from_a_fresh_boot(caplog):
    clock = Clock(0.0)  # a machine booted just now: its monotonic clock starts near 0
    tb = TierBytes(GIB, GIB, 16, warn_bytes=GIB, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tierkv.tiers"):
        tb.add_to(snapshot(saved=1, stored=1))             # exactly the threshold: not more than it
        assert tb.warnings == 0
        tb.add_to(snapshot(saved=1, stored=2))             # L3 wrote 2 GiB and served nothing
        assert tb.warnings == 1 and tb.warned_at == {"L2": None, "L3": 0.0}
        clock.t = WARN_EVERY_S - 1
        tb.add_to(snapshot(saved=1, stored=3))
        assert tb.warnings == 1                            # within the hour: quiet
        clock.t = WARN_EVERY_S
        tb.add_to(snapshot(saved=1, stored=3))
        assert tb.warnings == 2
    msgs = [r.getMessage() for r in caplog.records]
    assert len(msgs) == 2
    assert "L3 wrote 2.0 GiB and served 0 B (0.00 %)" in msgs[0]
    assert "l3.admission: second_sight" in msgs[0] and "host_pool.size_gb" in msgs[0] and "l3.backend: none" in msgs[0]


def test_the_l2_tier_is_checked_on_its_own_and_one_percent_served_is_enough(caplog):
    clock = Clock(5.0)
    tb = TierBytes(GIB, GIB, 100, warn_bytes=GIB, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tierkv.tiers"):
        tb.add_to(snapshot(saved=200, l2_hit_tokens=200))   # 200 GiB written, 2 GiB served: 1 %, fine
        assert tb.warnings == 0
        tb.add_to(snapshot(saved=200, l2_hit_tokens=199))   # just under 1 %
        assert tb.warnings == 1 and tb.warned_at["L2"] == 5.0 and tb.warned_at["L3"] is None
    assert "L2 wrote 200.0 GiB" in caplog.records[0].getMessage()
    assert "save_max_tokens" in caplog.records[0].getMessage()


@pytest.mark.parametrize("warn_bytes", [0, 10 * GIB])
def test_no_warning_when_off_or_under_the_threshold(warn_bytes):
    tb = TierBytes(GIB, GIB, 16, warn_bytes=warn_bytes, clock=Clock())
    tb.add_to(snapshot(saved=5, stored=5))
    assert tb.warnings == 0


def test_the_scheduler_stats_carry_the_bytes_of_an_engine(tmp_path):
    e = FakeEngine(store=file_store(tmp_path))
    pb = e.host.page_bytes
    e.sched.tier_bytes = TierBytes(pb, pb, P, warn_bytes=0)
    doc = toks(300, 4 * P)
    e.run_l3(Req("a", doc + [1]))
    e.settle()
    e.run_l3(Req("b", doc + [2]))  # an L2 hit of the 4 pages
    e.settle()
    s = e.sched.stats()
    assert s["l2_written_bytes"] == 4 * pb and s["l2_served_bytes"] == 4 * pb
    assert s["l3_written_bytes"] == 4 * pb and s["l3_served_bytes"] == 0
    e.close()
