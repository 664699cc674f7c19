"""The controller's job table: ids, the outbox of jobs for the next step's plan, and the merge of the workers' reports.

A job ends when every rank (``world_size``) reported it; the merged report (a page counts as done only where every
rank did it) goes to the seam that ordered the job (backup, existence, prefetch). Also the controller's counters.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field, fields
from typing import Optional, Sequence

from tierkv.storage_backends.common import RateLimitedLog

from tierkv.connector.core.plan import JOB_BACKUP, JOB_EXISTS, JOB_PREFETCH, Job, JobReport, merge_reports
from tierkv.connector.core.radix_index import RadixNode

logger = logging.getLogger("tierkv.controller")
_rate_limited = RateLimitedLog(logger)  # one line per kind per 10 s, with the count of those suppressed

@dataclass
class ControllerCounters:
    """Counters of the scheduler half (pages unless named otherwise)."""

    backup_jobs: int = 0
    backup_ordered_pages: int = 0
    backup_stored_pages: int = 0
    backup_failed_pages: int = 0
    write_back_pages: int = 0           # backups started by L2 eviction
    write_back_dropped_pages: int = 0   # evicted although their backup failed (never marked as stored)
    exists_queries: int = 0
    exists_found_pages: int = 0
    exists_late_answers: int = 0        # lookups that stopped waiting for an existence answer
    exists_local_queries: int = 0       # of exists_queries, answered in the scheduler's process at once
    lookups_deferred: int = 0           # lookups answered None (waiting for L3 or for L2 room)
    prefetch_jobs: int = 0
    prefetch_ordered_pages: int = 0
    prefetch_loaded_pages: int = 0      # leading pages that reached L2 intact
    prefetch_failed_pages: int = 0
    prefetch_cancelled_pages: int = 0   # never read: the request was released (deadline) or aborted first
    prefetch_no_room_pages: int = 0     # pages not fetched for lack of L2 staging slots
    prefetch_sync_jobs: int = 0         # of prefetch_jobs, loaded before the forward of the step admitting the hit
    l3_hit_tokens: int = 0
    l3_declined_slow_pages: int = 0     # hits declined: loading would take longer than recomputing
    l3_probe_hits: int = 0              # hits taken although estimated slow, to refresh a stale fetch estimate
    l3_declined_room_pages: int = 0     # hits declined after waiting for L2 room
    index_l3_evicted_pages: int = 0     # L3-only pages dropped from the index to bound it
    backup_cancelled_pages: int = 0     # backups cancelled: their pages were computed on a failed load
    l3_evicted_pages: int = 0           # pages the workers' stores reported evicted (their L3 flag is cleared)

    def as_dict(self) -> dict:
        """Every counter under its stats key, ``ctl_<field>`` (one snapshot a step: the keys are made once)."""
        d = self.__dict__
        return {key: d[f] for f, key in _CTL_STATS_KEYS}


_CTL_STATS_KEYS = tuple((f.name, f"ctl_{f.name}") for f in fields(ControllerCounters))


@dataclass
class _JobState:
    job: Job
    lock: Optional[RadixNode] = None
    path: list[bytes] = field(default_factory=list)   # keys from the root (backup / exists / prefetch)
    idx: list[int] = field(default_factory=list)      # position of each job page in ``path``
    victim: Optional[RadixNode] = None                # write_back: the node to drop once stored
    reports: list[JobReport] = field(default_factory=list)
    t0: float = 0.0
    cancelled: bool = False                           # backup of pages that left the index (cancel_backups)


class JobTable:
    """Mixin of :class:`~tierkv.connector.l3.controller.Controller`: the table of running jobs (``_jobs``), the
    outbox (``_outbox``) and the report plumbing. Needs ``world_size``, ``clock``, ``shutdown_drain_s`` and the
    ``_end_backup`` / ``_end_prefetch`` / ``_end_exists`` handlers of the other seams."""

    def take_jobs(self) -> list[Job]:
        """Jobs ordered since the last call, for this step's plan."""
        self._plans += 1
        out, self._outbox = self._outbox, []
        return out

    def _order(self, st: _JobState) -> Job:
        self._jobs[st.job.job_id] = st
        st.t0 = self.clock()
        self._outbox.append(st.job)
        return st.job

    def _new_id(self) -> int:
        jid = self._next_id
        self._next_id += 1
        return jid

    def on_reports(self, reports: Sequence[JobReport]) -> None:
        """Take the workers' reports (any order, any step). A job ends when all ``world_size`` ranks reported;
        their reports are merged page by page (a page counts as done only if every rank did it)."""
        for r in reports:
            st = self._jobs.get(r.job_id)
            if st is None:
                _rate_limited.warning("unknown_job", "tierkv: report for unknown job %d ignored", r.job_id)
                continue
            st.reports.append(r)
            if len(st.reports) < self.world_size:
                continue
            del self._jobs[r.job_id]
            merged = merge_reports(st.reports)
            if st.job.kind == JOB_BACKUP:
                self._end_backup(st, merged)
            elif st.job.kind == JOB_PREFETCH:
                self._end_prefetch(st, merged)
            else:
                self._end_exists(st, merged)

    def pending_jobs(self) -> int:
        return len(self._jobs) + len(self._outbox)

    def pins_pending(self) -> bool:
        """Whether a backup or prefetch (jobs that pin index nodes or staging slots), ordered less than
        ``shutdown_drain_s`` ago, has not reported yet: vLLM keeps stepping an idle engine while this holds, and its
        shutdown waits for it to end. A job out longer no longer does (a store that stalls must neither keep the
        engine core spinning nor hold up shutdown): its pins are released by the first step after its report."""
        if any(j.kind != JOB_EXISTS for j in self._outbox):
            return True
        oldest = self.clock() - self.shutdown_drain_s
        return any(st.job.kind != JOB_EXISTS and st.t0 >= oldest for st in self._jobs.values())
