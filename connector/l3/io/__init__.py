"""Worker half of the backup/prefetch controller: the L3 store client and its I/O threads.

:class:`L3IO` takes each step's jobs (:mod:`tierkv.connector.core.plan`) after the step's L1 -> L2 saves: backups go
to one writer thread, prefetches and existence queries to ``read_threads`` reader threads
(:mod:`tierkv.connector.l3.io.runners`), so a slow backup never delays a load. A prefetch's deadline counts from the
moment a reader starts it. :meth:`L3IO.poll` (engine thread) ends a request once its pages arrived or its deadline
passed: the leading run of intact pages is copied to L1, the request's other blocks are load errors (vLLM recomputes
them). A job's :class:`~tierkv.connector.core.plan.JobReport` waits in :meth:`L3IO.take_reports` for the next
step's worker metadata; it is sent once no thread touches the job's slots.

Store errors never reach the engine: counted, logged, pages not done. Queued backup work is bounded
(``max_backup_pages``); a backup that does not fit is reported failed at once. Between :meth:`L3IO.pause_backups`
and :meth:`L3IO.resume_backups` (a forward that computes prompt tokens) the writer starts no backup batch, for at
most :data:`BACKUP_PAUSE_MAX_S` and while its backlog is short. The design in full: docs/developer-guide.md,
section "connector/l3/io".
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Callable, Optional, Sequence

import torch

from tierkv.storage_backends.common import RateLimitedLog

from tierkv.connector.core.page_checksums import SlotChecksums
from tierkv.connector.core.plan import JOB_BACKUP, JOB_PREFETCH, Job, JobReport, PageOrder
from tierkv.connector.cpu.thread_priority import WRITER_PRIORITIES, BackgroundPriority, can_return_from_idle
from tierkv.connector.l3.io.evicted import EvictedNames
from tierkv.connector.l3.io.types import L3Counters, PollResult, _Prefetch, default_read_threads, l3_key
from tierkv.connector.l3.io.runners import BACKUP_PAUSE_MAX_S, CREDIT_FIRST_BATCH, L3JobRunners
from tierkv.connector.l3.io.no_l3 import NoL3
from tierkv.connector.l3.io.switch_interval import raise_switch_interval, restore_switch_interval

logger = logging.getLogger("tierkv.l3")

#: what this module exports (some names now live in modules beside it and are re-exported here)
__all__ = ["BACKUP_PAUSE_MAX_S", "CREDIT_FIRST_BATCH", "L3Counters", "L3IO", "NoL3", "PollResult", "VECTORED_MIN_RUN_BYTES",
           "WRITER_IDLE_BACKLOG_FRACTION", "default_read_threads", "l3_key", "raise_switch_interval",
           "restore_switch_interval"]

#: shortest mean run (bytes) of an L2 page that the writer hands to a store with ``vectored_sources`` as runs; a page
#: of shorter runs is staged into one contiguous copy first: each run handed over costs a fixed 1-3 us of Python
#: (a view, a check, a hash update, an iovec or a slice copy), which a page of many short runs pays more than one
#: copy of the page costs (benchmarks/README.md, backup_path: a loss at 4 KiB runs, even at 16 KiB, a gain for both
#: stores from 32 KiB)
VECTORED_MIN_RUN_BYTES = 32 << 10

#: ``writer_priority: idle``: the writer leaves SCHED_IDLE when more than this fraction of the L2 slots (or of
#: ``max_backup_pages``) wait for backup, each locking its slot, so that saves keep finding free slots under sustained
#: load; it returns to SCHED_IDLE at half that
WRITER_IDLE_BACKLOG_FRACTION = 0.5

#: ``BACKUP_PAUSE_MAX_S``: the longest (s) a pause (:meth:`L3IO.pause_backups`) holds the writer back, counted from
#: its start: a forward that never ends its pause (a hook that was not called) delays backups by at most this; the
#: writer also goes on at once while more than :data:`WRITER_IDLE_BACKLOG_FRACTION` of the L2 slots (or of
#: ``max_backup_pages``) wait for it


class L3IO(L3JobRunners):
    """Moves pages between the L2 host pool and an L3 store on background threads, as ordered by jobs.

    Args:
        store: the rank's L3 store (a :class:`tierkv.storage_backends.base.StorageBackend` built with the rank's
            namespace).
        host: the L2 :class:`~tierkv.connector.l2.host_pool.HostPool` (``host.page_bytes`` bytes per page).
        rank_namespace: 16-byte namespace digest of this rank (model, dtype, layout, TP/PP rank...).
        checksums: the worker's :class:`SlotChecksums` (read for backups, written for prefetched pages).
        batch_pages: pages per store call (>= 1).
        read_threads: reader threads (>= 1): prefetches and existence queries in flight at once; None = the store's
            ``default_read_threads`` (looked up through wrappers such as the fault injector and the timing wrapper).
        max_backup_pages: pages queued for backup at most; more are dropped (reported failed, counted).
        log_every_s: at most one warning per kind of failure per this many seconds.
        rank: this worker's rank (written into its reports).
        clock: monotonic clock in seconds (tests pass a fake one to drive deadlines).
        backup_writer: False on a rank whose records another rank writes (MLA: every TP rank but 0 shares rank 0's
            namespace, so the same key and bytes): its backups send nothing and report their pages done (counted in
            ``backup_other_rank_pages``); the controller ends a backup with the minimum over ranks, i.e. the writer's
            outcome. Reads and existence queries are unaffected.
        writer_priority: ``normal``, or ``idle``: the writer thread runs in Linux's SCHED_IDLE class while at most
            :data:`WRITER_IDLE_BACKLOG_FRACTION` of the L2 slots (and of ``max_backup_pages``) wait for it, normal
            above that until half as many do (:mod:`tierkv.connector.cpu.thread_priority`); normal throughout where
            the process may not leave SCHED_IDLE again (logged at INFO).
    Raises:
        ValueError: bad ``batch_pages``, ``max_backup_pages``, ``read_threads``, ``writer_priority`` or namespace
            length.
    """

    def __init__(self, store, host, rank_namespace: bytes, checksums: SlotChecksums, *, batch_pages: int = 16,
                 max_backup_pages: int = 65536, log_every_s: float = 10.0, rank: int = 0, read_threads: Optional[int] = None,
                 clock: Callable[[], float] = time.monotonic, backup_writer: bool = True,
                 writer_priority: str = "normal"):
        if writer_priority not in WRITER_PRIORITIES:
            raise ValueError(f"writer_priority must be one of {', '.join(WRITER_PRIORITIES)}, got {writer_priority!r}")
        if read_threads is None:
            read_threads = default_read_threads(store)
        if batch_pages < 1 or max_backup_pages < 1 or read_threads < 1:
            raise ValueError(f"batch_pages ({batch_pages}), max_backup_pages ({max_backup_pages}) and read_threads "
                             f"({read_threads}) must be >= 1")
        if len(rank_namespace) != 16:
            raise ValueError(f"rank_namespace must be 16 bytes, got {len(rank_namespace)}")
        self.store = store
        self.host = host
        self.rank_namespace = rank_namespace
        self.checksums = checksums
        self.batch_pages = batch_pages
        self.max_backup_pages = max_backup_pages
        self.read_threads = read_threads
        self.clock = clock
        self.rank = rank
        self.backup_writer = backup_writer
        self.writer_priority = writer_priority
        self.counters = L3Counters()
        self._log = RateLimitedLog(logger, log_every_s)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._reports: list[JobReport] = []
        self._prefetches: dict[int, _Prefetch] = {}
        self._warm = False  # a prefetch read has ended in this process (later reads time the store, not its set-up)
        self._queued_backup_pages = 0
        self._gate = threading.Condition(self._lock)  # the writer waits here while backups are paused
        self._paused_since: Optional[float] = None    # perf_counter time of pause_backups, None = not paused
        self._skip: dict[int, set[int]] = {}  # backup job id -> page indices not to send
        self._busy = 0                      # jobs queued or running
        self._closed = False
        self._read_q: "queue.Queue[Optional[Job]]" = queue.Queue()
        self._write_q: "queue.Queue[Optional[Job]]" = queue.Queue()
        # staging pages for pages that are not one contiguous run in L2 (K and V are two runs), one set per thread,
        # kept for the life of the object; the writer's, like the pool itself, registered with stores that read
        # registered memory directly (Mooncake: zero-copy puts; a no-op returning False elsewhere)
        self._direct = host.read_page(0).untyped_storage().data_ptr() == host.buffer.untyped_storage().data_ptr()
        # a page in several runs goes to a store that takes runs as they lie in L2 (one writev, or one copy into
        # its shared memory) instead of being staged first, when its runs are long enough that handing over each
        # costs less than copying it
        runs = len(host.page_runs(0))
        self._vectored = (not self._direct and bool(getattr(store, "vectored_sources", False))
                          and host.page_bytes >= runs * VECTORED_MIN_RUN_BYTES)
        self._wstage = self._staging(0 if self._vectored else batch_pages)
        # the same rule for reads: a store that reads into runs gets the slot's runs, no staging page and no copy
        self._vectored_read = (not self._direct and bool(getattr(store, "vectored_destinations", False))
                               and host.page_bytes >= runs * VECTORED_MIN_RUN_BYTES)
        # a store that hands back the checksum it verified each page by: the readers do not hash the page again
        self._store_sums = bool(getattr(store, "verified_checksums", False))
        # a store that names what it evicted: the writer names those pages in its backup reports, for the index
        self._evicted_names = EvictedNames(store) if getattr(store, "reports_evictions", False) else None
        rstage = 0 if self._vectored_read else batch_pages
        self._threads = [threading.Thread(target=self._serve, args=(self._read_q, self._staging(rstage)),
                                          name=f"tierkv-l3-read-{i}", daemon=True) for i in range(read_threads)]
        idle = writer_priority == "idle" and can_return_from_idle()
        if writer_priority == "idle" and not idle:
            logger.info("tierkv L3: this process may not return a thread from SCHED_IDLE (no CAP_SYS_NICE, "
                        "RLIMIT_NICE < 20): the writer thread keeps the normal scheduling class")
        high = max(1, int(min(host.num_slots, max_backup_pages) * WRITER_IDLE_BACKLOG_FRACTION))
        self._writer_prio = BackgroundPriority(idle, high, high // 2)
        self._pause_backlog = high  # above this many queued pages a pause no longer holds the writer back
        self._threads.append(threading.Thread(target=self._serve, args=(self._write_q, self._wstage,
                                                                        self._writer_prio),
                                              name="tierkv-l3-write", daemon=True))
        for t in self._threads:
            t.start()
        self._registered: list[torch.Tensor] = []
        for buf in (host.buffer, self._wstage):
            try:
                if store.register_host_buffer(buf):
                    self._registered.append(buf)
            except Exception as e:  # registration is an optimisation: never fatal
                logger.warning("tierkv L3: could not register host memory with %r (%s); staged copies", store, e)
        self.zero_copy = bool(self._registered)

    # ------------------------------------------------------------------ engine thread
    def submit(self, jobs: Sequence[Job], skip: Optional[dict[int, set[int]]] = None) -> None:
        """Queue the step's jobs (call after the step's L1 -> L2 saves). Never blocks on the store.

        ``skip``: job id -> indices of backup pages that must not be sent (their slot was not written:
        pages computed on a failed load are never kept); they are reported not done, and a backup with nothing left to send is reported
        at once."""
        skip = skip or {}
        for job in jobs:
            if job.kind == JOB_BACKUP:
                sk = skip.get(job.job_id)
                if sk:
                    self.counters.backup_skipped_pages += len(sk)
                    if len(sk) >= job.num_pages:
                        self._report(JobReport(job.job_id, job.kind, [False] * job.num_pages))
                        continue
                    with self._lock:
                        self._skip[job.job_id] = set(sk)
                if not self.backup_writer:  # the writer rank stores the shared record; its report decides
                    with self._lock:
                        self._skip.pop(job.job_id, None)
                    done = [i not in (sk or ()) for i in range(job.num_pages)]
                    self.counters.backup_other_rank_pages += sum(done)
                    self._report(JobReport(job.job_id, job.kind, done))
                    continue
                with self._lock:
                    fits = self._queued_backup_pages + job.num_pages <= self.max_backup_pages and not self._closed
                    if fits:
                        self._queued_backup_pages += job.num_pages
                        self._busy += 1
                if not fits:
                    with self._lock:
                        self._skip.pop(job.job_id, None)
                    self.counters.backup_dropped_pages += job.num_pages
                    self._log.warning("backup_dropped",
                                      "tierkv L3: backup queue full (%d pages): %d pages not backed up",
                                      self.max_backup_pages, job.num_pages)
                    self._report(JobReport(job.job_id, job.kind, [False] * job.num_pages))
                    continue
                self._write_q.put(job)
            else:
                with self._lock:
                    self._busy += 1
                    if job.kind == JOB_PREFETCH:
                        # until a reader starts it, the request waits at most its deadline in the queue
                        now = self.clock()
                        self._prefetches[job.job_id] = _Prefetch(
                            job, time.perf_counter(), None if job.deadline_s is None else now + job.deadline_s,
                            ok=[(not f) and s >= 0 for f, s in zip(job.fetch, job.slots)])
                self._read_q.put(job)

    def pause_backups(self) -> None:
        """Hold back the backup batches not started yet (engine thread, before a forward that computes prompt
        tokens) until :meth:`resume_backups`: on a host whose cores the forward keeps busy, a page written meanwhile
        costs the forward more than its own CPU time. A batch already in a store call finishes. The pause ends on its
        own after :data:`BACKUP_PAUSE_MAX_S`, and holds nothing back while more than half the L2 slots (or of
        ``max_backup_pages``) wait for backup, so no page waits unbounded and saves keep finding free slots."""
        if self._paused_since is None:  # (only the engine thread sets it; the writer reads it under the lock)
            self._paused_since = time.perf_counter()

    def resume_backups(self) -> None:
        """End a pause of :meth:`pause_backups` (engine thread, after the forward and its saves): the writer goes on
        with the batches it held back."""
        if self._paused_since is None:
            return
        with self._gate:
            self._paused_since = None
            self._gate.notify_all()

    def poll(self, finished_req_ids: Sequence[str] = ()) -> PollResult:
        """Serve the request side of prefetches (engine thread, once per step). ``finished_req_ids``: requests
        the engine finished (aborted) since the last call; their loads still end (and are reported) but copy
        nothing into L1."""
        out = PollResult()
        gone = set(finished_req_ids)
        now = self.clock()
        with self._lock:
            for p in self._prefetches.values():
                if p.request_done or p.job.sync:  # a synchronous load's request side is ended by release()
                    continue
                if p.job.req_id in gone:
                    p.aborted = True
                    p.cancel = True
                if not (p.io_done or p.aborted or (p.deadline is not None and now >= p.deadline)):
                    continue
                head, failed = self._end_request_locked(p)
                if not p.aborted:
                    if head.slots:
                        out.orders.append(head)
                    out.failed_blocks.update(failed)
                out.finished.add(p.job.req_id)
            self._finish_prefetches_locked()
        return out

    def has_prefetches(self) -> bool:
        """Whether a prefetch is in flight or not yet reported, i.e. whether :meth:`poll` could find anything (read
        without the lock: prefetches are added on the engine thread, the caller's; one removed meanwhile only makes
        the caller poll for nothing)."""
        return bool(self._prefetches)

    def _end_request_locked(self, p: _Prefetch) -> tuple[PageOrder, list[int]]:
        """End the request side of prefetch ``p`` (its batches not started yet are skipped; the job is reported once
        its I/O ended too): the leading run of intact pages as a PageOrder and the engine blocks after it. Counts a
        deadline miss and the pages that missed it, unless the request was aborted."""
        p.request_done = True
        if not p.io_done:
            p.cancel = True
        lead = next((i for i, v in enumerate(p.ok) if not v), len(p.ok))
        if not p.aborted:
            self.counters.prefetch_deadline_misses += not p.io_done
            self.counters.prefetch_late_pages += sum(1 for v in p.ok[lead:] if not v)
        order = p.job.page_order()
        return order.head(lead), order.blocks_from(lead)

    def release(self, job_ids: Sequence[int]) -> list[tuple[int, PageOrder, list[int]]]:
        """End the request side of the synchronous prefetches ``job_ids`` now (engine thread, before the step's
        forward): batches not started yet are skipped, and the job is reported once its I/O ended. Returns, per job
        still tracked, ``(job id, the leading run of intact pages as a PageOrder, the engine blocks after it)``."""
        out = []
        with self._lock:
            for jid in job_ids:
                p = self._prefetches.get(jid)
                if p is not None and not p.request_done:
                    out.append((jid, *self._end_request_locked(p)))
            self._finish_prefetches_locked()
        return out

    def wait_reads(self, job_ids: Sequence[int], timeout_s: float) -> tuple[bool, bool]:
        """Block until the reads (I/O side) of prefetches ``job_ids`` ended, or their request side ended (abort), or
        ``timeout_s`` seconds passed, or (when every read still running has a deadline) the last of their deadlines
        passed: :meth:`poll` releases them then anyway. Returns (whether one of them was still reading when called,
        whether none is reading now). A job no longer tracked has ended."""
        def running() -> list:
            ps = (self._prefetches.get(j) for j in job_ids)
            return [p for p in ps if p is not None and not (p.io_done or p.request_done)]

        with self._idle:
            if not running():
                return False, True
            end = time.perf_counter() + timeout_s
            while True:  # a reader that starts a read moves its deadline: look again after every wake-up
                left = running()
                if not left:
                    return True, True
                wait = end - time.perf_counter()
                if all(p.deadline is not None for p in left):
                    wait = min(wait, max(p.deadline for p in left) - self.clock())
                if wait <= 0:
                    return True, False
                self._idle.wait(wait)

    def take_reports(self) -> list[JobReport]:
        """Reports of jobs that ended since the last call (each job reported exactly once)."""
        with self._lock:
            out, self._reports = self._reports, []
        return out

    def has_reports(self) -> bool:
        """Whether a report waits for :meth:`take_reports` (read without the lock: a report added meanwhile is seen
        by the next call)."""
        return bool(self._reports)

    def pending(self) -> int:
        """Jobs queued or running, plus prefetches whose request side has not ended."""
        with self._lock:
            return self._busy + sum(1 for p in self._prefetches.values() if not p.request_done)

    def wait_idle(self, timeout: Optional[float] = 30.0) -> bool:
        """Block until no job is queued or running (tests, shutdown). Returns False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._busy == 0, timeout)

    def close(self, drain_s: float = 10.0) -> int:
        """Stop the threads. Queued backups get up to ``drain_s`` seconds to reach the store; then batches not yet
        started are dropped, a batch in a store call finishes (bounded by the store's own timeout), and the count
        of pages not confirmed stored is logged and returned. Nothing is half-written: a store writes a record
        whole or not at all. Reads are not waited for (no request will use them):
        their batches not started are skipped, and a reader blocked in a store call is left to end on its own
        (the threads are daemons), so a store whose reads stall does not hold up shutdown."""
        with self._gate:
            if self._closed:
                return 0
            for p in self._prefetches.values():
                p.cancel = True
            self._paused_since = None  # queued backups drain now, whatever the last step said
            self._gate.notify_all()
        with self._idle:
            drained = self._idle.wait_for(lambda: self._queued_backup_pages == 0, drain_s)
        with self._lock:
            self._closed = True
            dropped = self._queued_backup_pages if not drained else 0
        for _ in range(self.read_threads):
            self._read_q.put(None)
        self._write_q.put(None)
        if dropped:
            logger.warning("tierkv L3: shutdown after %.1f s with %d pages still queued for backup: dropped",
                           drain_s, dropped)
        for t in self._threads:
            t.join(timeout=1.0)
        for buf in self._registered:
            try:
                self.store.unregister_host_buffer(buf)
            except Exception:  # pragma: no cover - best effort at shutdown
                pass
        self._registered = []
        return dropped

    def stats(self) -> dict:
        d = self.counters.as_dict()
        with self._lock:
            d["l3_backup_queued_pages"] = self._queued_backup_pages
            d["l3_pending_jobs"] = self._busy
        d["l3_writer_idle_class"] = int(self._writer_prio.enabled)
        d["l3_writer_raised"] = self._writer_prio.raised
        return d
