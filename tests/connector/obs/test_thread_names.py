"""tierkv's threads carry their names into the kernel (``/proc/<pid>/task/<tid>/comm``), so ``top -H`` and the
serving benchmark's per-thread CPU accounting can tell them from the engine's threads."""

from __future__ import annotations

import threading
import time

from tierkv.connector.l2.host_pool import HostPool
from tierkv.connector.l3.io import L3IO
from tierkv.connector.obs.metrics import StatsFile
from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.obs.thread_names import os_thread_name
from tierkv.storage_backends.file.store import FileStore

NS = bytes(range(16))


def _comm(t: threading.Thread) -> str:
    with open(f"/proc/self/task/{t.native_id}/comm") as f:
        return f.read().strip()


def _comms_once_named(threads, want: list[str], timeout_s: float = 10.0) -> list[str]:
    """The kernel names of ``threads``, polled until they equal ``want`` or ``timeout_s`` passed (each thread names
    itself when it starts running, which the test cannot otherwise wait for)."""
    deadline = time.monotonic() + timeout_s
    while True:
        got = [_comm(t) for t in threads]
        if got == want or time.monotonic() > deadline:
            return got
        time.sleep(0.01)  # polling interval for an observed state, not a synchronisation sleep


def test_os_names_are_the_python_names_shortened_to_the_kernels_15_bytes():
    assert os_thread_name("tierkv-l3-write") == b"tkv-l3-write"
    assert os_thread_name("tierkv-stats-scheduler") == b"tkv-stats-sched"
    assert os_thread_name("worker") == b"worker"


def test_l3_io_and_stats_threads_are_named_in_the_kernel(tmp_path):
    host = HostPool(4, 2, 4096)
    store = FileStore(NS, host.page_bytes, root=str(tmp_path / "l3"))
    l3 = L3IO(store, host, NS, SlotChecksums(host.num_slots), read_threads=2)
    stats = StatsFile(str(tmp_path / "stats-{role}.json"), "worker", lambda: {"n": 1}, snapshot_thread_safe=True)
    try:
        stats.maybe_write()  # the flusher starts with the first snapshot handed over
        threads = [*l3._threads, stats._flusher]
        want = ["tkv-l3-read-0", "tkv-l3-read-1", "tkv-l3-write", "tkv-stats-worke"]
        assert _comms_once_named(threads, want) == want
        assert _comm(threading.current_thread()) != "tkv-l3-write"  # only each thread itself was renamed
    finally:
        l3.close(0)
        stats.close()
