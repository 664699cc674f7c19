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
    """``time.monotonic`` and ``time.perf_counter`` as on a machine booted a moment ago: both read 0.0 at ``start``
    and advance with the real clocks. Code that takes a time of 0.0 to mean "long ago" (a first write held back for
    an interval, a registration skipped) fails under it, as it did on freshly booted machines."""

    def __init__(self) -> None:
        import time

        self._time = time
        self.real_monotonic, self.real_perf_counter = time.monotonic, time.perf_counter
        self.start()

    def start(self) -> None:
        """Both clocks read 0.0 from now on."""
        self.mono0, self.perf0 = self.real_monotonic(), self.real_perf_counter()

    def install(self, monkeypatch) -> None:
        monkeypatch.setattr(self._time, "monotonic", lambda: self.real_monotonic() - self.mono0)
        monkeypatch.setattr(self._time, "perf_counter", lambda: self.real_perf_counter() - self.perf0)


#: this test process's clocks start at 0.0 when it starts, and never run backwards from one test to the next (state
#: kept across tests, such as a rate-limited log's last line, stays consistent)
_PROCESS_CLOCK = YoungClock()


@pytest.fixture(autouse=True)
def _young_process_clock(request, monkeypatch):
    """Every in-process test runs under the process's ``YoungClock`` (engines and servers in other processes keep
    the real clocks); a test that compares its clock with another process's marks itself ``real_clock``."""
    if request.node.get_closest_marker("real_clock") is None:
        _PROCESS_CLOCK.install(monkeypatch)


@pytest.fixture
def young_clock(monkeypatch) -> YoungClock:
    """Clocks that read 0.0 when this test starts: for objects whose first action must not wait for the clock to
    grow old (use it with ``pytestmark = pytest.mark.usefixtures("young_clock")``)."""
    clock = YoungClock()
    clock.install(monkeypatch)
    return clock
