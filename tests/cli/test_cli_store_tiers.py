"""``tierkv store stats --engine-stats``: the bytes each tier wrote and served, a tier that only writes flagged, and
a tierkv server's own counts of pages written and read (tierkv/cli_store.py)."""
from __future__ import annotations

import json

from tests.cli.test_cli_store import PB_A, run_json, store  # noqa: F401 - the store fixture
from tests.helpers.cli import NS_A, key, one_line_error, page, tierkv
from tierkv.cli import main
from tierkv.cli_common import EXIT_OK, EXIT_USAGE

GIB = 1 << 30


def engine_file(tmp_path, **counters):
    f = tmp_path / "tierkv-scheduler-1.json"
    f.write_text(json.dumps({"role": "scheduler", "pid": 1, **counters}))
    return str(f)


def test_engine_stats_show_each_tier_and_flag_the_one_that_only_writes(store, tmp_path, capsys):  # noqa: F811
    f = engine_file(tmp_path, l2_written_bytes=40 * GIB, l2_served_bytes=8 * GIB, l3_written_bytes=35 * GIB,
                    l3_served_bytes=GIB // 4)
    rc, d = run_json(capsys, "store", "stats", store, "--engine-stats", f)
    assert rc == EXIT_OK and d["pages"] == 5
    tiers = d["engine"]["tiers"]
    assert tiers["L2"] == {"written_bytes": 40 * GIB, "served_bytes": 8 * GIB, "served_fraction": 0.2,
                           "write_only": False}
    assert tiers["L3"]["write_only"] is True and tiers["L3"]["served_fraction"] == 0.25 / 35
    assert main(["store", "stats", store, "--engine-stats", f, "-q"]) == EXIT_OK
    text = capsys.readouterr().out
    assert "engine L2: wrote 40.0 GiB, served 8.0 GiB (20.00 %)\n" in text
    assert "engine L3: wrote 35.0 GiB, served 256.0 MiB (0.71 %): writes only; for L3 consider l3.admission: " \
           "second_sight" in text


def test_a_stats_file_without_tier_bytes_is_one_line(store, tmp_path):  # noqa: F811
    f = engine_file(tmp_path, save_pages=3)
    f2 = tmp_path / "w.json"
    f2.write_text(json.dumps({"role": "worker", "save_bytes": 5}))
    for path, says in ((f, "scheduler's stats_path file"), (str(f2), "a worker's file"),
                       (str(tmp_path / "none.json"), "cannot read it")):
        r = tierkv("store", "stats", store, "--engine-stats", path)
        line = one_line_error(r)
        assert r.returncode == EXIT_USAGE and "--engine-stats" in line and says in line, line


def test_a_server_says_how_many_pages_it_wrote_and_served(tmp_path, capsys, fresh_env):
    from tests.helpers.fixtures_zmq import ZmqHandle

    h = ZmqHandle(tmp_path, PB_A, NS_A)
    try:
        assert all(h.backend.batch_set([key(i) for i in range(4)], [page(i, PB_A) for i in range(4)]))
        import torch
        assert h.backend.batch_get([key(0), key(1)], [torch.empty(PB_A, dtype=torch.uint8) for _ in range(2)]) == \
            [True, True]
        rc, d = run_json(capsys, "store", "stats", h.endpoint)
        assert rc == EXIT_OK
        t = d["traffic"]
        assert t["written_pages"] == 4 and t["written_bytes"] == 4 * PB_A
        assert t["read_pages"] == 2 and t["read_bytes"] == 2 * PB_A
        assert main(["store", "stats", h.endpoint, "-q"]) == EXIT_OK
        assert f"  written: 4 pages ({4 * PB_A / 1024:.1f} KiB), read: 2 pages" in capsys.readouterr().out
    finally:
        h.close()
