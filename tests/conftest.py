"""Suite-wide rule: a skipped or xfail test fails the run.

A test that skips proves nothing, and a change (of storage layout, of an installed package) can silently turn a test
into a skip. So when any test, or any collected module, was skipped, xfailed or xpassed, the run exits with
``pytest.ExitCode.TESTS_FAILED`` (1) even if every other test passed, and the terminal summary lists each one with
its reason. ``TIERKV_ALLOW_SKIPS=1`` turns the rule off for local partial runs (the list is still printed).

Tested by ``tests/test_suite_rules.py`` (runs pytest on throwaway test files with ``pytester``).
"""
from __future__ import annotations

import os

import pytest

ALLOW_ENV = "TIERKV_ALLOW_SKIPS"


def _reason(report) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}" if report.skipped else f"xpass: {report.wasxfail}"
    lr = report.longrepr
    if isinstance(lr, tuple) and len(lr) == 3:  # (path, line, "Skipped: reason")
        return f"{lr[2]} ({lr[0]}:{lr[1]})"
    return str(lr)


class NotRun:
    """Collects every test (or module) that was skipped, xfailed or xpassed in this session."""

    def __init__(self) -> None:
        self.found: list[tuple[str, str, str]] = []  # (node id, phase, reason)

    def pytest_runtest_logreport(self, report) -> None:
        # a skip (skip, skipif, importorskip, empty parametrisation) or an xfail is reported as "skipped"; a
        # non-strict xpass as "passed" with ``wasxfail``: each one is a test that did not prove what it claims
        if report.skipped or (report.passed and hasattr(report, "wasxfail")):
            self.found.append((report.nodeid, report.when, _reason(report)))

    def pytest_collectreport(self, report) -> None:
        if report.skipped:  # a module skipped at collection (allow_module_level skip, importorskip)
            self.found.append((report.nodeid or "<collection>", "collect", _reason(report)))


_KEY = pytest.StashKey[NotRun]()


def pytest_configure(config) -> None:
    plugin = NotRun()
    config.stash[_KEY] = plugin
    config.pluginmanager.register(plugin, "tierkv-not-run")


@pytest.hookimpl(tryfirst=True)
def pytest_sessionfinish(session, exitstatus) -> None:
    found = session.config.stash[_KEY].found
    if found and not os.environ.get(ALLOW_ENV) and session.exitstatus == pytest.ExitCode.OK:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter, exitstatus, config) -> None:
    found = config.stash[_KEY].found
    if not found:
        return
    allowed = bool(os.environ.get(ALLOW_ENV))
    terminalreporter.section("tests that did not run (skipped / xfail / xpass)", red=not allowed, yellow=allowed)
    for nodeid, when, why in found:
        terminalreporter.line(f"{nodeid} [{when}]: {why}")
    if allowed:
        terminalreporter.line(f"{len(found)} not run; allowed by {ALLOW_ENV}")
    else:
        terminalreporter.line(f"FAILED: {len(found)} test(s) did not run; every test must run and pass "
                              f"(set {ALLOW_ENV}=1 for a local partial run)", red=True, bold=True)


@pytest.fixture(autouse=True)
def _own_estimates_dir(tmp_path_factory, monkeypatch):
    """Every test's engines and connectors keep their stored recompute estimate (connector/l3/estimates.py) in a
    directory of their own, so no test starts from another test's estimate."""
    monkeypatch.setenv("TIERKV_ESTIMATES_DIR", str(tmp_path_factory.mktemp("estimates")))


class YoungClock:
    """``time.monotonic`` and ``time.perf_counter`` as on a machine booted a moment ago: both read 0.0 when the
    test starts and advance with the real clocks. Code that takes a time of 0.0 to mean "long ago" (a first write
    held back for an interval, a registration skipped) fails under it, as it did on freshly booted machines."""

    def __init__(self, monkeypatch) -> None:
        import time

        real_mono, real_perf = time.monotonic, time.perf_counter
        mono0, perf0 = real_mono(), real_perf()
        monkeypatch.setattr(time, "monotonic", lambda: real_mono() - mono0)
        monkeypatch.setattr(time, "perf_counter", lambda: real_perf() - perf0)


@pytest.fixture(autouse=True)
def young_clock(request, monkeypatch):
    """Every in-process test runs under a ``YoungClock`` (engines and servers in other processes keep the real
    clocks); a test that compares its clock with another process's marks itself ``real_clock``."""
    if request.node.get_closest_marker("real_clock") is None:
        YoungClock(monkeypatch)
