"""``controller.writer_priority: idle``: the L3 writer thread runs in Linux's SCHED_IDLE class while its backlog is
short, in the normal class from above ``high`` pages down to ``low`` (connector/cpu/thread_priority.py,
connector/l3/io/runners.py ``_serve``); where the process could not leave SCHED_IDLE again it keeps the normal class. Real file store; the
store's ``batch_set`` records the calling thread's class and the first call waits for the test to queue more."""

from __future__ import annotations

import logging
import os
import threading

import numpy as np
import pytest
import torch

from tierkv.connector.cpu import thread_priority
from tierkv.connector.l2.host_pool import HostPool
from tierkv.connector.l3.io import L3IO, l3_key
from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.core.plan import JOB_BACKUP, Job
from tierkv.storage_backends.file.store import FileStore

NS = bytes(range(16))


class RecordingFileStore(FileStore):
    """A file store whose ``batch_set`` records the caller's scheduling policy; its first call waits for ``gate``."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.policies: list[int] = []
        self.entered, self.gate = threading.Event(), threading.Event()

    def batch_set(self, keys, sources, checksums=None, tokens=None):
        self.policies.append(os.sched_getscheduler(0))
        self.entered.set()
        assert self.gate.wait(30.0)
        return super().batch_set(keys, sources, checksums=checksums, tokens=tokens)


def _backups(l3: L3IO, store: RecordingFileStore, host: HostPool, jobs: int, pages: int) -> list[Job]:
    """Queue ``jobs`` backups of ``pages`` pages each while the writer waits in its first store call; then let it go
    and wait until all are stored. Returns the jobs."""
    out = [Job(j + 1, JOB_BACKUP, [bytes([j, i]) * 8 for i in range(pages)],
               slots=[(j * pages + i) % host.num_slots for i in range(pages)]) for j in range(jobs)]
    l3.submit(out[:1])
    assert store.entered.wait(30.0)
    l3.submit(out[1:])
    store.gate.set()
    assert l3.wait_idle(30.0)
    return out


@pytest.fixture
def host():
    h = HostPool(16, 2, 4096)  # 16 slots: the writer leaves SCHED_IDLE above 8 waiting pages, returns at 4
    h.buffer.copy_(torch.from_numpy(np.random.default_rng(3).integers(0, 256, h.nbytes, dtype=np.uint8)))
    return h


def test_the_writer_is_idle_class_while_its_backlog_is_short_and_normal_above_it(tmp_path, host):
    assert thread_priority.can_return_from_idle()  # (root here; elsewhere CAP_SYS_NICE or RLIMIT_NICE >= 20)
    store = RecordingFileStore(NS, host.page_bytes, root=str(tmp_path))
    l3 = L3IO(store, host, NS, SlotChecksums(host.num_slots), batch_pages=2, read_threads=1, writer_priority="idle")
    try:
        assert (l3._writer_prio.high, l3._writer_prio.low) == (8, 4)
        jobs = _backups(l3, store, host, jobs=6, pages=2)
        # waiting when each job starts: 2 (idle), then 10, 8, 6 (normal: above 8, and not yet down to 4), 4, 2 (idle)
        idle, normal = os.SCHED_IDLE, os.SCHED_OTHER
        assert store.policies == [idle, normal, normal, normal, idle, idle]
        st = l3.stats()
        assert st["l3_writer_raised"] == 1 and st["l3_writer_idle_class"] == 1
        assert os.sched_getscheduler(0) == normal  # the engine's thread is untouched
        reps = {r.job_id: r.ok for r in l3.take_reports()}
        assert reps == {j.job_id: [True, True] for j in jobs}  # every page stored, whatever the class
        keys = [l3_key(NS, k) for j in jobs for k in j.keys]
        assert store.batch_exists(keys) == len(keys)
    finally:
        store.gate.set()
        l3.close()
        store.close()


def test_normal_priority_and_a_process_that_cannot_leave_idle_keep_the_writer_normal(tmp_path, host, monkeypatch,
                                                                                   caplog):
    store = RecordingFileStore(NS, host.page_bytes, root=str(tmp_path / "a"))
    l3 = L3IO(store, host, NS, SlotChecksums(host.num_slots), batch_pages=2, read_threads=1)  # default: normal
    try:
        _backups(l3, store, host, jobs=3, pages=2)
        assert store.policies == [os.SCHED_OTHER] * 3 and l3.stats()["l3_writer_idle_class"] == 0
    finally:
        l3.close()
        store.close()

    def no_way_back(idle: bool) -> None:  # what sched_setscheduler does without CAP_SYS_NICE and RLIMIT_NICE < 20
        if not idle:
            raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(thread_priority, "_set_idle", no_way_back)
    monkeypatch.setattr(thread_priority, "_probe", None)  # probed anew (and the earlier answer restored afterwards)
    store = RecordingFileStore(NS, host.page_bytes, root=str(tmp_path / "b"))
    with caplog.at_level(logging.INFO, logger="tierkv.l3"):
        l3 = L3IO(store, host, NS, SlotChecksums(host.num_slots), batch_pages=2, read_threads=1,
                  writer_priority="idle")
    try:
        assert "keeps the normal scheduling class" in caplog.text
        _backups(l3, store, host, jobs=3, pages=2)
        assert store.policies == [os.SCHED_OTHER] * 3 and l3.stats()["l3_writer_idle_class"] == 0
    finally:
        l3.close()
        store.close()
    with pytest.raises(ValueError, match="writer_priority must be one of idle, normal, got 'low'"):
        L3IO(store, host, NS, SlotChecksums(host.num_slots), writer_priority="low")
