"""The I/O threads' side of :class:`~tierkv.connector.l3.io.L3IO`: the loop each reader and the writer runs, and the
runner of each job kind (existence query, backup, prefetch) with its report.

Pages move between L2 slots and the store in batches of ``batch_pages`` pages. A failed batch fails only its own
pages; later batches still run (a page is done only if the store acknowledged it). Errors from the store never
reach the engine: they are counted, logged at most once per burst and turn into pages not done. While backups are
paused (``L3IO.pause_backups``) the writer starts no batch: it waits for the pause to end, at most until
``BACKUP_PAUSE_MAX_S`` after it began, and not at all while its backlog is long or the object is closing.
"""
from __future__ import annotations

import queue
import time
from typing import Optional, Sequence

import torch

from tierkv.storage_backends.page_format import payload_checksum

from tierkv.connector.core.plan import JOB_BACKUP, JOB_PREFETCH, Job, JobReport
from tierkv.connector.obs.thread_names import name_this_thread
from tierkv.connector.cpu.thread_priority import BackgroundPriority
from tierkv.connector.l3.io.types import _Prefetch, l3_key

#: see ``tierkv.connector.l3.io.BACKUP_PAUSE_MAX_S`` (defined here, where the writer waits, and re-exported there)
BACKUP_PAUSE_MAX_S = 2.0

#: pages in the first store call of a prefetch whose deadline earns credit (``Job.deadline_credit_s``): a whole
#: ``batch_pages`` batch arrives at once, and one slower than the first deadline would be cut before it earned any
CREDIT_FIRST_BATCH = 4


class L3JobRunners:
    """Mixin of :class:`~tierkv.connector.l3.io.L3IO` with what runs on its I/O threads. It uses the state that
    ``L3IO.__init__`` sets up: ``store``, ``host``, ``rank_namespace``, ``checksums``, ``batch_pages``, ``rank``,
    ``clock``, ``counters``, ``_log``, ``_lock``, ``_idle``, ``_gate``, ``_paused_since``, ``_pause_backlog``,
    ``_reports``, ``_prefetches``, ``_warm``, ``_skip``, ``_busy``, ``_closed``, ``_queued_backup_pages``,
    ``_evicted_names`` and the staging choices ``_direct``, ``_vectored``,
    ``_vectored_read``, ``_store_sums``, ``_wstage``."""

    def _serve(self, q: "queue.Queue[Optional[Job]]", stage: torch.Tensor,
               prio: Optional[BackgroundPriority] = None) -> None:
        name_this_thread()
        while True:
            job = q.get()
            if job is None:
                return
            if prio is not None:  # the writer: its scheduling class from the pages waiting for it, this job's included
                prio.update(self._queued_backup_pages)
            try:
                if job.kind == JOB_BACKUP:
                    self._run_backup(job)
                elif job.kind == JOB_PREFETCH:
                    self._run_prefetch(job, stage)
                else:
                    self._run_exists(job)
            except Exception as e:  # a bug or a store that raised: the job fails, the thread lives on
                self.counters.store_errors += 1
                self._log.warning("job_error", "tierkv L3: %s job %d failed: %r", job.kind, job.job_id, e)
                if job.kind == JOB_PREFETCH:
                    with self._lock:
                        p = self._prefetches.get(job.job_id)
                        if p is not None:
                            p.io_done = True
                            p.end = time.perf_counter()
                            self._finish_prefetches_locked()
                elif job.kind == JOB_BACKUP:
                    self._end_backup(job, [False] * job.num_pages, 0, 0.0)
                else:
                    self._report(JobReport(job.job_id, job.kind, [False] * job.num_pages))
            finally:
                with self._idle:
                    self._busy -= 1
                    self._idle.notify_all()

    def _keys(self, keys: Sequence[bytes]) -> list[str]:
        return [l3_key(self.rank_namespace, k) for k in keys]

    def _staging(self, n: int) -> torch.Tensor:
        return torch.empty((n, self.host.page_bytes), dtype=torch.uint8)

    def _run_exists(self, job: Job) -> None:
        t0 = time.perf_counter()
        n = 0
        try:
            n = int(self.store.batch_exists(self._keys(job.keys)))
        except Exception as e:
            self.counters.store_errors += 1
            self._log.warning("exists", "tierkv L3: existence query of %d pages failed: %r", job.num_pages, e)
        dt = time.perf_counter() - t0
        self.counters.exists_jobs += 1
        self.counters.exists_seconds += dt
        self._report(JobReport(job.job_id, job.kind, [i < n for i in range(job.num_pages)], seconds=dt))

    def _run_backup(self, job: Job) -> None:
        t0 = time.perf_counter()
        ok = [False] * job.num_pages
        nbytes = 0
        evicted: dict[bytes, None] = {}  # page keys the store evicted (net of those stored again since)
        pb = self.host.page_bytes
        with self._lock:
            skip = self._skip.pop(job.job_id, set())
        send = [i for i in range(job.num_pages) if i not in skip]
        for s in range(0, len(send), self.batch_pages):
            if self._paused_since is not None:
                self._wait_unpaused()
            if self._closed:  # shut down: the batches not started are dropped (close() counted them)
                break
            e = min(len(send), s + self.batch_pages)
            srcs, sums = [], []
            for i in send[s:e]:
                slot, key = job.slots[i], job.keys[i]
                if self._vectored:
                    src = self.host.page_runs(slot)
                elif self._direct:
                    src = self.host.read_page(slot)
                else:
                    src = self.host.read_page(slot, out=self._wstage[len(srcs)])
                c = self.checksums.get(slot, key)
                if c is None:  # not recorded (verify_checksums off: saves do not hash): hash it now, once
                    c = self.host.page_checksum(slot)
                srcs.append(src)
                sums.append(c)
            keys = [job.keys[i] for i in send[s:e]]
            l3_keys = self._keys(keys)
            try:
                res = self.store.batch_set(l3_keys, srcs, checksums=sums)
            except Exception as ex:
                res = [False] * (e - s)
                self.counters.store_errors += 1
                self._log.warning("backup", "tierkv L3: backup of %d pages failed: %r", e - s, ex)
            if self._evicted_names is not None:
                self._evicted_names.after_batch(l3_keys, keys, res, evicted)
            for i, r in zip(send[s:e], res):
                if r:
                    ok[i] = True
                    nbytes += pb
            if not all(res):
                self._log.warning("backup_pages", "tierkv L3: %d of %d pages not stored by %r",
                                  sum(1 for r in res if not r),
                                  e - s, self.store)
        self._end_backup(job, ok, nbytes, time.perf_counter() - t0, list(evicted))

    def _wait_unpaused(self) -> None:
        """Writer: wait while backups are paused, the pause is younger than ``BACKUP_PAUSE_MAX_S``, at most
        ``_pause_backlog`` pages are queued and the object is open; counted when it waited."""
        t0, waited = time.perf_counter(), False
        with self._gate:
            while self._paused_since is not None and not self._closed:
                if self._queued_backup_pages > self._pause_backlog:
                    break
                left = self._paused_since + BACKUP_PAUSE_MAX_S - time.perf_counter()
                if left <= 0:
                    break
                waited = True
                self._gate.wait(left)
        if waited:
            self.counters.backup_pauses += 1
            self.counters.backup_pause_seconds += time.perf_counter() - t0

    def _end_backup(self, job: Job, ok: list[bool], nbytes: int, dt: float, evicted: Sequence[bytes] = ()) -> None:
        c = self.counters
        c.evicted_pages += len(evicted)
        if self._evicted_names is not None:
            c.evicted_unnamed_pages = self._evicted_names.unnamed
        c.backup_jobs += 1
        c.backup_pages += sum(ok)
        c.backup_failed_pages += len(ok) - sum(ok)
        c.backup_bytes += nbytes
        c.backup_seconds += dt
        with self._lock:
            self._queued_backup_pages -= job.num_pages
        self._report(JobReport(job.job_id, job.kind, ok, seconds=dt, bytes=nbytes, evicted=list(evicted)))

    def _run_prefetch(self, job: Job, stage: torch.Tensor) -> None:
        with self._lock:
            p = self._prefetches[job.job_id]
            if not p.request_done:
                # the deadline runs from here: time spent queued behind other reads does not count against it
                p.start = time.perf_counter()
                p.cold = not self._warm
                p.read_t0 = self.clock()
                if job.deadline_s is not None:
                    p.deadline = p.read_t0 + job.deadline_s
        todo = [i for i, (f, s) in enumerate(zip(job.fetch, job.slots)) if f and s >= 0]
        first = min(CREDIT_FIRST_BATCH, self.batch_pages) if job.deadline_credit_s > 0 else self.batch_pages
        bounds = [0] + list(range(first, len(todo), self.batch_pages)) if todo else []  # no empty store call
        for b, e in zip(bounds, bounds[1:] + [len(todo)]):
            with self._lock:
                if p.cancel:
                    p.cancelled = len(todo) - b
                    break
            idx = todo[b:e]
            if self._vectored_read:  # straight into the slots' runs (a failed page leaves its slot unused)
                dsts = [self.host.page_runs(job.slots[i]) for i in idx]
            else:
                dsts = [stage[j] for j in range(len(idx))]
            sums = [None] * len(idx) if self._store_sums else None
            try:
                keys = self._keys([job.keys[i] for i in idx])
                res = (self.store.batch_get(keys, dsts, checksums=sums) if sums is not None
                       else self.store.batch_get(keys, dsts))
            except Exception as ex:
                res = [False] * len(idx)
                self.counters.store_errors += 1
                self._log.warning("prefetch", "tierkv L3: read of %d pages failed: %r", len(idx), ex)
            got = []
            for j, (i, r) in enumerate(zip(idx, res)):
                if not r:
                    continue
                slot = job.slots[i]
                if not self._vectored_read:
                    self.host.write_page(slot, dsts[j])
                c = sums[j] if sums is not None else None
                if c is None:  # the store did not say what it verified: hash what arrived
                    c = payload_checksum(dsts[j] if self._vectored_read else dsts[j].numpy())
                self.checksums.record(slot, job.keys[i], c)
                got.append(i)
            if len(got) < len(idx):
                self._log.warning("prefetch_pages", "tierkv L3: %d of %d pages missing or corrupt in %r",
                                  len(idx) - len(got),
                                  len(idx), self.store)
            with self._lock:
                for i in got:
                    p.ok[i] = True
                p.bytes += len(got) * self.host.page_bytes
                self._credit_locked(p)
        with self._lock:
            p.io_done = True
            p.end = time.perf_counter()
            self._warm = True
            self._finish_prefetches_locked()

    @staticmethod
    def _credit_locked(p: _Prefetch) -> None:
        """Move the deadline of prefetch ``p`` to its read's start + ``deadline_s`` + ``deadline_credit_s`` for each
        read page in the leading intact run (never earlier, at most ``deadline_max_s`` after the start)."""
        job = p.job
        if job.deadline_credit_s <= 0 or p.deadline is None or p.read_t0 is None or p.request_done:
            return
        lead = next((i for i, v in enumerate(p.ok) if not v), len(p.ok))
        read = sum(1 for f in job.fetch[:lead] if f)
        d = job.deadline_s + job.deadline_credit_s * read
        if job.deadline_max_s is not None:
            d = min(d, job.deadline_max_s)
        p.deadline = max(p.deadline, p.read_t0 + d)

    def _finish_prefetches_locked(self) -> None:
        # a prefetch is reported once both its request side and its I/O ended (no thread touches its slots)
        for jid in [j for j, p in self._prefetches.items() if p.io_done and p.request_done]:
            p = self._prefetches.pop(jid)
            fetched = sum(1 for f, v in zip(p.job.fetch, p.ok) if f and v)
            c = self.counters
            c.prefetch_jobs += 1
            c.prefetch_pages += fetched
            c.prefetch_failed_pages += sum(1 for f, v in zip(p.job.fetch, p.ok) if f and not v) - p.cancelled
            c.prefetch_cancelled_pages += p.cancelled
            c.prefetch_bytes += p.bytes
            c.prefetch_seconds += max(0.0, p.end - p.start)
            self._reports.append(JobReport(jid, JOB_PREFETCH, list(p.ok), rank=self.rank,
                                           seconds=max(0.0, p.end - p.start), bytes=p.bytes,
                                           cancelled=p.cancelled, cold=p.cold))

    def _report(self, r: JobReport) -> None:
        r.rank = self.rank
        with self._lock:
            self._reports.append(r)
