"""``controller.backup_pause``: between ``L3IO.pause_backups`` and ``resume_backups`` (a forward that computes prompt
tokens) the L3 writer starts no backup batch; the pause holds nothing back once the backlog is long or the pause
older than ``BACKUP_PAUSE_MAX_S``, and ``close`` drains what it held (connector/l3/io, connector/l2/step.py).
Real file store; the writer's wait is observed through its condition, never timed."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from tierkv.connector.core.config import ConfigError, load_config
from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.core.plan import JOB_BACKUP, Job, StepPlan
from tierkv.connector.l2.host_pool import HostPool
from tierkv.connector.l2.step import WorkerStep
from tierkv.connector.l3.io import L3IO, l3_key, runners
from tierkv.storage_backends.file.store import FileStore

NS = bytes(range(16))


class SeenWaiting(threading.Condition):
    """The writer's gate: sets ``waiting`` each time a thread waits on it."""

    def __init__(self, lock):
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout=None):
        self.waiting.set()
        return super().wait(timeout)


@pytest.fixture
def l3(tmp_path):
    host = HostPool(16, 2, 4096)  # 16 slots: a pause holds the writer back while at most 8 pages wait
    host.buffer.copy_(torch.from_numpy(np.random.default_rng(5).integers(0, 256, host.nbytes, dtype=np.uint8)))
    store = FileStore(NS, host.page_bytes, root=str(tmp_path))
    io = L3IO(store, host, NS, SlotChecksums(host.num_slots), batch_pages=2, read_threads=1)
    io._gate = SeenWaiting(io._lock)
    yield io
    io.close()


def _job(jid: int, pages: int) -> Job:
    return Job(jid, JOB_BACKUP, [bytes([jid, i]) * 8 for i in range(pages)], slots=list(range(pages)))


def _stored(io: L3IO, job: Job) -> int:
    return sum(io.store.batch_exists([l3_key(NS, k)]) for k in job.keys)


def test_a_paused_writer_stores_nothing_until_resumed(l3):
    job = _job(1, 4)
    l3.pause_backups()
    l3.submit([job])
    assert l3._gate.waiting.wait(30.0)  # the writer holds its first batch back
    assert _stored(l3, job) == 0 and l3.pending() == 1
    l3.resume_backups()
    assert l3.wait_idle(30.0)
    assert _stored(l3, job) == 4
    assert [r.ok for r in l3.take_reports()] == [[True] * 4]
    st = l3.stats()
    assert st["l3_backup_pauses"] == 1 and st["l3_backup_pause_seconds"] > 0


def test_a_pause_holds_nothing_back_once_the_backlog_is_long(l3):
    job = _job(2, 10)  # 10 pages waiting > 8 (half the 16 slots)
    l3.pause_backups()
    l3.submit([job])
    assert l3.wait_idle(30.0)  # written during the pause
    assert _stored(l3, job) == 10 and not l3._gate.waiting.is_set()
    assert l3.stats()["l3_backup_pauses"] == 0


def test_a_pause_older_than_its_bound_holds_nothing_back(l3, monkeypatch):
    monkeypatch.setattr(runners, "BACKUP_PAUSE_MAX_S", 0.0)
    job = _job(3, 2)
    l3.pause_backups()
    l3.submit([job])
    assert l3.wait_idle(30.0)
    assert _stored(l3, job) == 2 and l3.stats()["l3_backup_pauses"] == 0


def test_close_drains_the_backups_a_pause_held(l3):
    job = _job(4, 4)
    l3.pause_backups()
    l3.submit([job])
    assert l3._gate.waiting.wait(30.0)
    assert l3.close(drain_s=30.0) == 0  # nothing dropped
    assert _stored(l3, job) == 4


class _L3Calls:
    def __init__(self):
        self.calls: list[str] = []

    def pause_backups(self):
        self.calls.append("pause")

    def resume_backups(self):
        self.calls.append("resume")


class _Worker:
    """What WorkerStep calls on a worker around a forward without loads, saves or jobs."""

    def __init__(self):
        self.l3 = _L3Calls()
        self.counters = object()

    def end_sync_step(self, plan):
        pass

    def finish_loads(self):
        pass

    def run_saves(self, plan):
        self.l3.calls.append("saves")


@pytest.mark.parametrize("policy, expect", [
    ("prefill", ["pause", "saves", "resume", "saves", "resume"]),
    ("forward", ["pause", "saves", "resume", "pause", "saves", "resume"]),
    ("never", ["saves", "resume", "saves", "resume"]),
])
def test_the_step_pauses_backups_around_the_forwards_its_policy_names(policy, expect):
    w = _Worker()
    step = WorkerStep(w, page_size=16, hybrid=False, on_error=lambda *a: None, backup_pause=policy)
    for plan in (StepPlan(step=1, prefill_tokens=100), StepPlan(step=2, prefill_tokens=0)):  # a prefill, a decode
        step.before_forward(plan)
        step.after_forward(plan)
    assert w.l3.calls == expect


def test_backup_pause_values_are_checked():
    assert load_config().controller.backup_pause == "never"  # the default until a quiet-machine measurement says otherwise
    with pytest.raises(ConfigError, match=r"controller\.backup_pause.*prefill.*forward.*never"):
        load_config(overrides={"controller.backup_pause": "sometimes"})
    with pytest.raises(ValueError, match="backup_pause"):
        WorkerStep(_Worker(), 16, False, lambda *a: None, backup_pause="sometimes")
