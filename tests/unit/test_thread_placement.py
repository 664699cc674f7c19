"""tierkv's threads leave the CPU of the forward's OpenMP thread 0 and its background threads yield to the forward
(:mod:`tierkv.connector.thread_placement`).

vLLM's CPU backend binds its compute threads one to a CPU; the placement is checked in a child process that binds
its own threads the same way (the main thread to the first CPU, as vLLM's worker does), so the pytest process keeps
its affinity."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading

import pytest

from tierkv.connector.config import ConfigError, config_from_extra
from tierkv.connector.host_pool import HostPool
from tierkv.connector.l3_io import L3IO
from tierkv.connector.page_checksums import SlotChecksums
from tierkv.connector.thread_placement import check_cpus, configure, parse_cpu_list, policy
from tierkv.storage_backends.file import FileStore

NS = bytes(range(16))

CHILD = r"""
import json, os, sys, threading
from tierkv.connector import thread_placement as tp
allowed = sorted(os.sched_getaffinity(0))
c0, c1 = allowed[:2]
omp_threads, cpus, nice = int(sys.argv[1]), sys.argv[2], int(sys.argv[3])
os.sched_setaffinity(0, {c0})                      # the "engine" binds its main thread (OpenMP thread 0)
ready, stop = threading.Event(), threading.Event()
def omp1():
    os.sched_setaffinity(0, {c1}); ready.set(); stop.wait()
if omp_threads == 2:
    threading.Thread(target=omp1, daemon=True).start(); ready.wait()
tp.configure(cpus, nice)
out = {"allowed": allowed, "c0": c0, "c1": c1, "base_nice": os.getpriority(os.PRIO_PROCESS, 0)}
def probe(name, background):
    tp.setup_this_thread(background)
    out[name] = {"cpus": sorted(os.sched_getaffinity(0)),
                 "nice": os.getpriority(os.PRIO_PROCESS, threading.get_native_id())}
for name, bg in (("tierkv-l3-read-0", False), ("tierkv-l3-write", True)):
    t = threading.Thread(target=probe, args=(name, bg), name=name); t.start(); t.join()
out["main"] = {"cpus": sorted(os.sched_getaffinity(0)), "nice": os.getpriority(os.PRIO_PROCESS, 0)}
stop.set()
print(json.dumps(out))
"""


def _child(omp_threads: int, cpus: str = "auto", nice: int = 10) -> dict:
    r = subprocess.run([sys.executable, "-c", CHILD, str(omp_threads), cpus, str(nice)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_the_machine_has_two_cpus_to_place_threads_on():
    assert len(os.sched_getaffinity(0)) >= 2  # the placement tests below need a CPU besides the forward's


def test_every_cpu_computes_so_tierkv_threads_may_use_them_all_not_only_thread_0s():
    """Two compute threads on the first two CPUs: nothing is free, so tierkv's threads get every CPU of the
    process (the kernel places them where a core is idle) instead of OpenMP thread 0's alone."""
    out = _child(omp_threads=2)
    others = set(out["allowed"]) - {out["c0"], out["c1"]}
    want = sorted(others or out["allowed"])
    assert out["tierkv-l3-read-0"]["cpus"] == want
    assert out["tierkv-l3-write"]["cpus"] == want
    assert out["main"]["cpus"] == [out["c0"]]          # the engine's own threads are left alone


def test_a_cpu_the_engine_left_free_takes_tierkvs_threads():
    """One compute thread (vLLM reserved the other CPUs, ``VLLM_CPU_NUM_OF_RESERVED_CPU``): tierkv's threads run on
    the free CPUs, never on the compute thread's."""
    out = _child(omp_threads=1)
    want = sorted(set(out["allowed"]) - {out["c0"]})
    assert out["c1"] in want
    assert out["tierkv-l3-read-0"]["cpus"] == want
    assert out["tierkv-l3-write"]["cpus"] == want


def test_background_threads_yield_and_readers_keep_the_engines_priority():
    out = _child(omp_threads=2, nice=10)
    base = out["base_nice"]
    assert out["tierkv-l3-write"]["nice"] == max(base, 10)
    assert out["tierkv-l3-read-0"]["nice"] == base
    assert out["main"]["nice"] == base


def test_inherit_and_a_cpu_list():
    out = _child(omp_threads=2, cpus="inherit", nice=0)
    assert out["tierkv-l3-read-0"]["cpus"] == [out["c0"]]          # where it started, as before the placement
    assert out["tierkv-l3-write"]["nice"] == out["base_nice"]
    out = _child(omp_threads=2, cpus=str(sorted(os.sched_getaffinity(0))[1]))
    assert out["tierkv-l3-write"]["cpus"] == [out["c1"]]


def test_the_l3_writer_is_a_background_thread_and_the_readers_are_not(tmp_path):
    """The real :class:`L3IO`'s threads with ``threads.background_nice: 10``: the backup writer at that nice value,
    the readers at the process's."""
    base = os.getpriority(os.PRIO_PROCESS, 0)
    configure("auto", 10)
    host = HostPool(4, 2, 4096)
    store = FileStore(NS, host.page_bytes, root=str(tmp_path / "l3"))
    l3 = L3IO(store, host, NS, SlotChecksums(host.num_slots), read_threads=2)
    try:
        nices = {}
        for t in l3._threads:
            for _ in range(1000):   # each thread places itself when it starts running; poll until it has
                nices[t.name] = os.getpriority(os.PRIO_PROCESS, t.native_id)
                if t.name != "tierkv-l3-write" or nices[t.name] != base:
                    break
                threading.Event().wait(0.01)
        assert nices == {"tierkv-l3-read-0": base, "tierkv-l3-read-1": base, "tierkv-l3-write": max(base, 10)}
    finally:
        l3.close(0)
        configure()


def test_the_default_changes_no_priority():
    assert (policy().background_nice, policy().cpus) == (0, "auto")
    assert config_from_extra({}).threads.background_nice == 0


def test_cpu_lists_parse_and_bad_values_name_the_key():
    assert parse_cpu_list("2-3, 6") == {2, 3, 6}
    assert check_cpus("auto") == "auto"
    for bad in ("fast", "3-1", "", "1,,2"):
        with pytest.raises(ValueError):
            check_cpus(bad)
    with pytest.raises(ConfigError, match=r"threads\.cpus.*auto or inherit or a CPU list"):
        config_from_extra({"threads": {"cpus": "fast"}})
    with pytest.raises(ConfigError, match=r"threads\.background_nice"):
        config_from_extra({"threads": {"background_nice": 20}})
    assert config_from_extra({"threads.cpus": "0-1"}).threads.cpus == "0-1"
