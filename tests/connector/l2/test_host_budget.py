"""One L2 budget per host shared by co-located workers (tierkv.connector.l2.host_budget), with real processes.

Each "worker" is a separate Python process that takes its share from a ledger in a temporary directory (the same
code path as a vLLM worker's connector before it allocates its pool), reports the outcome on stdout, and either
exits at once or stays alive until told to stop (a live engine). The budget is fixed by the test (``measure``), so
the numbers do not depend on this machine's free memory.
"""
import json
import subprocess
import sys
import textwrap

import pytest

from tierkv.connector.l2.host_budget import GiB, cgroup_room_bytes, group_bytes, measure_budget_bytes, reserve
from tierkv.storage_backends.common import ConfigError

BUDGET = 10 * GiB

WORKER = textwrap.dedent("""
    import json, sys
    from tierkv.connector.l2.host_budget import reserve
    from tierkv.storage_backends.common import ConfigError
    ledger, group, rank, ranks, req, hold = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), \\
        sys.argv[5], sys.argv[6] == "hold"
    try:
        r = reserve(group, rank, ranks, requested_bytes=None if req == "auto" else int(req), auto_fraction=0.5,
                    auto_max_bytes=8 << 30, reserve_bytes=0, page_bytes=4096, ledger_dir=ledger,
                    measure=lambda reserve_bytes: %d)
        print(json.dumps({"ok": True, "bytes": r.bytes, "budget": r.budget, "total": r.group_total}), flush=True)
    except ConfigError as e:
        print(json.dumps({"ok": False, "error": str(e)}), flush=True)
    if hold:
        sys.stdin.read()   # stays alive (its reservation counts) until the test closes stdin
""" % BUDGET)


def _start(ledger, group, rank, ranks, req, hold=False):
    return subprocess.Popen([sys.executable, "-c", WORKER, str(ledger), group, str(rank), str(ranks), str(req),
                             "hold" if hold else "exit"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _outcome(p) -> dict:
    return json.loads(p.stdout.readline())


def _stop(procs):
    for p in procs:
        p.stdin.close()
        p.wait(timeout=30)


def _engine(ledger, group, ranks, req, order=None):
    """Start ``ranks`` worker processes of one engine (in ``order``), all holding; returns (procs, outcomes)."""
    procs = [_start(ledger, group, r, ranks, req, hold=True) for r in (order or range(ranks))]
    return procs, [_outcome(p) for p in procs]


def test_four_ranks_that_fit_start_and_a_second_engine_that_does_not_stops_on_every_rank(tmp_path):
    procs, outs = _engine(tmp_path, "A", 4, 2 * GiB, order=[3, 1, 0, 2])
    try:
        assert all(o["ok"] and o["bytes"] == 2 * GiB and o["total"] == 8 * GiB for o in outs), outs
        assert group_bytes("A", str(tmp_path)) == (2 * GiB, BUDGET)
        # 2 ranks x 1.5 GiB = 3 GiB > 10 - 8: every rank of engine B stops, whatever order they run in
        b_procs, b_outs = _engine(tmp_path, "B", 2, int(1.5 * GiB), order=[1, 0])
        _stop(b_procs)
        assert [o["ok"] for o in b_outs] == [False, False]
        for o in b_outs:
            assert "host_pool.size_gb" in o["error"] and "3.00 GiB requested" in o["error"]
            assert "budget 10.00 GiB" in o["error"] and "8.00 GiB is held by other engines" in o["error"]
        # 2 x 1 GiB fits exactly in what is left
        c_procs, c_outs = _engine(tmp_path, "C", 2, GiB)
        _stop(c_procs)
        assert all(o["ok"] for o in c_outs), c_outs
    finally:
        _stop(procs)


def test_total_that_does_not_fit_stops_every_rank_and_reserves_nothing(tmp_path):
    procs, outs = _engine(tmp_path, "big", 4, 3 * GiB, order=[2, 0, 3, 1])   # 12 GiB > 10 GiB
    try:
        assert [o["ok"] for o in outs] == [False] * 4
        assert all("12.00 GiB requested" in o["error"] for o in outs)
        assert group_bytes("big", str(tmp_path)) == (None, None)
    finally:
        _stop(procs)


def test_reservations_of_exited_workers_are_released(tmp_path):
    p = _start(tmp_path, "gone", 0, 1, 9 * GiB)   # exits right after reserving
    assert _outcome(p)["ok"]
    p.wait(timeout=30)
    procs, outs = _engine(tmp_path, "next", 1, 9 * GiB)
    _stop(procs)
    assert outs[0]["ok"], outs


def test_automatic_size_divides_the_budget_among_ranks(tmp_path):
    procs, outs = _engine(tmp_path, "auto", 4, "auto", order=[1, 3, 2, 0])
    try:
        want = int(BUDGET * 0.5) // 4 // 4096 * 4096                 # auto_fraction 0.5 of the budget, 4 ranks
        assert [o["bytes"] for o in outs] == [want] * 4
        assert sum(o["bytes"] for o in outs) <= BUDGET * 0.5
        # a second automatic engine gets at most what the first left
        b_procs, b_outs = _engine(tmp_path, "auto2", 2, "auto")
        _stop(b_procs)
        assert all(o["ok"] and o["bytes"] == want * 2 for o in b_outs), b_outs   # min(10*0.5/2, (10-5)/2)
    finally:
        _stop(procs)


def test_in_process_message_and_cgroup_reading(tmp_path):
    with pytest.raises(ConfigError, match=r"host_pool.size_gb.*100.00 GiB requested, budget 4.00 GiB"):
        reserve("g", 0, 1, requested_bytes=100 * GiB, auto_fraction=0.25, auto_max_bytes=8 * GiB, reserve_bytes=0,
                ledger_dir=str(tmp_path), measure=lambda r: 4 * GiB)
    cg = tmp_path / "cg"
    cg.mkdir()
    (cg / "memory.max").write_text(str(6 * GiB))
    (cg / "memory.current").write_text(str(5 * GiB))
    (cg / "memory.stat").write_text(f"anon 1\ninactive_file {GiB // 2}\n")
    assert cgroup_room_bytes(str(cg)) == GiB + GiB // 2
    (cg / "memory.max").write_text("max")
    assert cgroup_room_bytes(str(cg)) is None
    assert 0 <= measure_budget_bytes(1 << 40) <= measure_budget_bytes(0)
