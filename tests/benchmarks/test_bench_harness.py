"""``benchmarks.harness``: the servers every benchmark starts answer a real tierkv store and are gone, by PID, once
stopped; the machine record names the CPU's flags; result files round-trip."""
import json
import os
import subprocess
import sys

import pytest
import torch

from benchmarks import harness
from benchmarks.harness import machine, results, servers

NS = bytes(range(16))
PAGE = 4096
KEY = "0123456789abcdef" * 2


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    with open(f"/proc/{pid}/stat") as f:   # a zombie of another parent still has an entry
        return f.read().rsplit(")", 1)[1].split()[0] == "Z"


def _round_trip(store) -> None:
    page = torch.arange(PAGE, dtype=torch.int32).to(torch.uint8)
    assert store.batch_set([KEY], [page]) == [True]
    out = torch.zeros(PAGE, dtype=torch.uint8)
    assert store.batch_get([KEY], [out]) == [True] and torch.equal(out, page)


def test_the_tierkv_server_serves_a_store_and_is_stopped_by_pid(tmp_path):
    from tierkv.storage_backends.zmq.client import ZmqStore

    srv = servers.ZmqServer(tmp_path / "zmq.log", capacity="64MiB")
    try:
        assert srv.endpoint.startswith("tcp://127.0.0.1:")
        store = ZmqStore(NS, PAGE, endpoint=srv.endpoint, timeout_s=10.0)
        try:
            _round_trip(store)
        finally:
            store.close()
    finally:
        stopped = srv.stop()
    assert stopped["exit_code"] is not None and stopped["leftover_processes_killed"] == 0 and _gone(srv.proc.pid)


def test_a_mooncake_master_and_segment_serve_a_client_that_mounts_nothing(tmp_path):
    from tierkv.storage_backends.mooncake.store import MooncakeStore

    master = servers.MooncakeMaster(str(tmp_path)).start()
    segment = None
    try:
        segment = servers.MooncakeSegment(master, 64 << 20)
        store = MooncakeStore(NS, PAGE, **master.client_config(), global_segment_size=0, timeout_s=10.0)
        try:
            _round_trip(store)   # the page lives in the segment process's memory
        finally:
            store.close()
    finally:
        if segment is not None:
            segment.stop()
        master.stop()
    assert _gone(master.proc.pid) and _gone(segment.proc.pid)


def test_a_server_that_exits_before_it_is_ready_names_itself_and_its_log(tmp_path, monkeypatch):
    monkeypatch.setattr(servers, "mooncake_master_binary", lambda: sys.executable)   # exits at once: bad flags
    with pytest.raises(RuntimeError, match="mooncake_master exited .* before it was ready"):
        servers.MooncakeMaster(str(tmp_path), ready_timeout_s=30.0).start()


def test_the_machine_record_names_the_cpu_flags_and_load():
    m = machine.machine()
    assert m["cpus"] == os.cpu_count() and len(m["load"]) == 3
    flags = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    assert m["flags"] and all(f in flags for f in m["flags"][:5])
    assert machine.isa(["avx2", "avx512f"]) == "has avx2, avx512f" and machine.isa([]) == "no AVX2/AVX-512/AMX"


def test_result_files_round_trip_and_a_broken_one_is_named(tmp_path):
    path = results.write_result(tmp_path / "sub" / "r.json", {"a": [1, 2]})
    assert results.load_result(path) == {"a": [1, 2]} and path.read_text().endswith("\n")
    path.write_text("{")
    with pytest.raises(results.ResultsError, match="r.json"):
        results.load_result(path)


def test_package_path_makes_only_the_benchmarks_importable(tmp_path):
    d = harness.package_path(tmp_path)
    r = subprocess.run([sys.executable, "-c", "import benchmarks.harness, importlib.util, json; "
                        "print(json.dumps([importlib.util.find_spec(n) is None for n in ('kernels', 'configs')]))"],
                       env=dict(os.environ, PYTHONPATH=d), cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout) == [True, True]   # the repository's top-level folders stay out of the path
