"""``benchmarks.crash_engine``'s helpers without an engine: the process tree a crash kills (every descendant and
session member of the process started, nothing else), the prompts and the file-store census."""
import subprocess
import sys

from benchmarks import crash_engine
from benchmarks.harness import servers
from benchmarks.harness.procs import tree_of

_TREE = """
import subprocess, sys
kids = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]) for _ in range(2)]
grand = subprocess.Popen([sys.executable, "-c",
    "import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); "
    "print(p.pid, flush=True); p.wait()"], stdout=subprocess.PIPE)
print(*(k.pid for k in kids), grand.pid, grand.stdout.readline().decode().strip(), flush=True)
kids[0].wait()
"""


def test_tree_of_walks_descendants_root_first_and_leaves_others_out():
    parent = {1: 0, 10: 1, 11: 10, 12: 10, 13: 11, 20: 1, 21: 20, 99: 1}
    assert tree_of(10, parent) == [10, 11, 12, 13]
    assert tree_of(21, parent) == [21]
    assert tree_of(10, {**parent, 10: 13}) == [10, 11, 12, 13]  # a cycle in a stale map ends


def test_sigkill_tree_kills_the_started_process_and_every_descendant_only(tmp_path):
    bystander = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    proc = subprocess.Popen([sys.executable, "-c", _TREE], stdout=subprocess.PIPE, start_new_session=True)
    try:
        pids = [int(x) for x in proc.stdout.readline().split()]
        assert len(pids) == 4
        out = servers.sigkill_tree(proc, timeout_s=30)
        assert set(out["killed"]) == {proc.pid, *pids}
        assert proc.returncode == -9
        assert not any(servers._alive(p) for p in [proc.pid, *pids])
        assert bystander.poll() is None
    finally:
        bystander.kill()
        bystander.wait()
        proc.stdout.close()


def test_prompts_share_prefixes_and_mix_them_per_wave():
    p = dict(crash_engine.QUICK)
    ps = crash_engine.prompts(p, vocab=4096)
    assert len(ps) == p["prefixes"] * p["per_prefix"]
    assert all(len(x) == p["prefix_len"] + p["suffix_len"] and min(x) >= 4 and max(x) < 4096 for x in ps)
    n = p["prefixes"]
    assert ps[0][:p["prefix_len"]] == ps[n][:p["prefix_len"]] != ps[1][:p["prefix_len"]]
    assert ps == crash_engine.prompts(p, vocab=4096)


def test_store_files_counts_records_temporaries_and_quarantine(tmp_path):
    (tmp_path / "ns" / "ab").mkdir(parents=True)
    (tmp_path / "ns" / "ab" / "abcd.page").write_bytes(b"x")
    (tmp_path / "ns" / "ab" / ".tmp.abcd.1.2.3").write_bytes(b"x")
    (tmp_path / "quarantine").mkdir()
    (tmp_path / "quarantine" / "abcd.page").write_bytes(b"x")
    assert crash_engine.store_files(tmp_path) == {"pages": 1, "tmp": 1, "quarantined": 1}
