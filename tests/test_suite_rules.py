"""Rules of the test suite itself: a skipped / xfail test fails the run (``tests/conftest.py``), and no test seeds a
random generator from something that changes between runs (so a failure reproduces)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
CONFTEST = (TESTS / "conftest.py").read_text()


@pytest.fixture
def run(pytester, monkeypatch):
    """``run(source, env=None)``: run pytest (in-process) on one test module with tierkv's ``tests/conftest.py``;
    returns the ``RunResult``."""
    monkeypatch.delenv("TIERKV_ALLOW_SKIPS", raising=False)
    pytester.makeconftest(CONFTEST)

    def go(source: str, **env: str):
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        pytester.makepyfile(test_inner=source)
        return pytester.runpytest_inprocess("-p", "no:cacheprovider")

    return go


PASS_AND_SKIP = """
import pytest
def test_ok(): pass
def test_skipped(): pytest.skip("fixture cannot corrupt")
"""


def test_all_passing_run_exits_0(run):
    r = run("def test_a(): pass\ndef test_b(): assert 1 + 1 == 2\n")
    assert r.ret == pytest.ExitCode.OK
    r.assert_outcomes(passed=2)
    assert "did not run" not in r.stdout.str()


def test_one_skip_among_passes_fails_the_run_and_is_listed(run):
    r = run(PASS_AND_SKIP)
    r.assert_outcomes(passed=1, skipped=1)  # plain pytest would exit 0 here
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*tests that did not run*", "test_inner.py::test_skipped [[]call[]]: Skipped: fixture "
                            "cannot corrupt*", "FAILED: 1 test(s) did not run*"])


def test_allow_skips_env_lets_a_partial_run_pass_but_still_lists(run):
    r = run(PASS_AND_SKIP, TIERKV_ALLOW_SKIPS="1")
    assert r.ret == pytest.ExitCode.OK
    r.stdout.fnmatch_lines(["test_inner.py::test_skipped*", "1 not run; allowed by TIERKV_ALLOW_SKIPS"])


@pytest.mark.parametrize("body,outcome", [
    ("@pytest.mark.skipif(True, reason='numba missing')\ndef test_x(): pass", {"skipped": 1}),
    ("def test_x(): pytest.importorskip('no_such_module_tierkv')", {"skipped": 1}),
    ("@pytest.mark.xfail(reason='known bug')\ndef test_x(): assert False", {"xfailed": 1}),
    ("@pytest.mark.xfail(reason='known bug')\ndef test_x(): pass", {"xpassed": 1}),
    ("def test_x(): pytest.xfail('known bug')", {"xfailed": 1}),
    ("@pytest.mark.parametrize('p', [])\ndef test_x(p): pass", {"skipped": 1}),
    ("@pytest.fixture\ndef f(): pytest.skip('no server')\ndef test_x(f): pass", {"skipped": 1}),
])
def test_every_kind_of_not_run_fails_the_run(run, body, outcome):
    r = run("import pytest\ndef test_ok(): pass\n" + body + "\n")
    r.assert_outcomes(passed=1, **outcome)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*test_inner.py::test_x*", "FAILED: 1 test(s) did not run*"])


def test_module_skipped_at_collection_fails_the_run(run, pytester):
    pytester.makepyfile(test_other="def test_fine(): pass\n")
    r = run("import pytest\npytest.skip('no numba', allow_module_level=True)\ndef test_x(): pass\n")
    r.assert_outcomes(passed=1, skipped=1)
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.stdout.fnmatch_lines(["*test_inner.py* [[]collect[]]: *no numba*"])


def test_a_failure_stays_a_failure(run):
    r = run("import pytest\ndef test_bad(): assert 0\ndef test_s(): pytest.skip('x')\n")
    assert r.ret == pytest.ExitCode.TESTS_FAILED
    r.assert_outcomes(failed=1, skipped=1)


# ------------------------------------------------------------------------------------------------ stable seeds
# str/bytes/tuple hash() is salted per process (PYTHONHASHSEED), id() is an address, the clock differs every run
_UNSTABLE_SEED = re.compile(r"(Random|default_rng|seed|manual_seed|RandomState)\s*\(\s*(hash|id)\s*\(|"
                            r"(Random|default_rng|seed|manual_seed|RandomState)\s*\([^)]*time\.(time|monotonic|perf_counter)")


def test_no_test_seeds_a_generator_from_hash_id_or_the_clock():
    root = TESTS.parent
    bad = []
    for path in sorted(list(TESTS.rglob("*.py")) + list((root / "examples").rglob("*.py"))):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if _UNSTABLE_SEED.search(line):
                bad.append(f"{path.relative_to(root)}:{n}: {line.strip()}")
    assert bad == [], "seeds that change between runs:\n" + "\n".join(bad)
