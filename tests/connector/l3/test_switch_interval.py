"""A worker with L3 threads raises its process's GIL switch interval (``controller.gil_switch_interval_s``) and
gives the old one back at shutdown, unless something else changed it meanwhile."""
import sys

import pytest

from tierkv.connector.l3.io import raise_switch_interval, restore_switch_interval


@pytest.fixture
def interval():
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.005)
    yield
    sys.setswitchinterval(before)


def test_raised_to_the_key_and_restored(interval):
    prev = raise_switch_interval(0.05)
    assert prev == pytest.approx(0.005) and sys.getswitchinterval() == pytest.approx(0.05)
    restore_switch_interval(prev, 0.05)
    assert sys.getswitchinterval() == pytest.approx(0.005)


def test_zero_or_a_longer_interval_already_set_is_left_alone(interval):
    assert raise_switch_interval(0) is None and sys.getswitchinterval() == pytest.approx(0.005)
    sys.setswitchinterval(0.1)
    assert raise_switch_interval(0.05) is None and sys.getswitchinterval() == pytest.approx(0.1)
    restore_switch_interval(None, 0.05)
    assert sys.getswitchinterval() == pytest.approx(0.1)


def test_an_interval_changed_by_someone_else_is_not_undone(interval):
    prev = raise_switch_interval(0.05)
    sys.setswitchinterval(0.2)
    restore_switch_interval(prev, 0.05)
    assert sys.getswitchinterval() == pytest.approx(0.2)
