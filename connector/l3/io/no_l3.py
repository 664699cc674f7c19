"""The worker's L3 when there is none: a null object with :class:`~tierkv.connector.l3.io.L3IO`'s interface that
ends every job at once with no page done, so the scheduler side never waits for a store that is not there.
"""
from __future__ import annotations

from typing import Optional, Sequence

from tierkv.connector.core.plan import JOB_PREFETCH, Job, JobReport, PageOrder
from tierkv.connector.l3.io.types import PollResult


class NoL3:
    """The worker's L3 when no store is configured or the store could not start: the same interface as
    :class:`L3IO`, answering every job at once with no page done. A backup or existence query reports no page
    stored or found; a prefetch's request is named ended at the next :meth:`poll` with all its blocks failed, so
    vLLM recomputes them (the scheduler side never waits for a store that is not there)."""

    store = None

    def __init__(self) -> None:
        self._reports: list[JobReport] = []
        self._ended = PollResult()
        self._sync: dict[int, Job] = {}

    def submit(self, jobs: Sequence[Job], skip: Optional[dict[int, set[int]]] = None) -> None:
        for job in jobs:
            self._reports.append(JobReport(job.job_id, job.kind, [False] * job.num_pages))
            if job.kind == JOB_PREFETCH and job.sync:
                self._sync[job.job_id] = job
            elif job.kind == JOB_PREFETCH and job.req_id is not None:
                self._ended.finished.add(job.req_id)
                self._ended.failed_blocks.update(job.block_ids)

    def pause_backups(self) -> None:
        return None

    def resume_backups(self) -> None:
        return None

    def release(self, job_ids: Sequence[int]) -> list[tuple[int, PageOrder, list[int]]]:
        out = []
        for jid in job_ids:
            job = self._sync.pop(jid, None)
            if job is not None:
                order = job.page_order()
                out.append((jid, order.head(0), order.blocks_from(0)))
        return out

    def poll(self, finished_req_ids: Sequence[str] = ()) -> PollResult:
        out, self._ended = self._ended, PollResult()
        return out

    def has_prefetches(self) -> bool:
        return bool(self._ended.finished or self._ended.failed_blocks)

    def wait_reads(self, job_ids: Sequence[int], timeout_s: float) -> tuple[bool, bool]:
        return False, True

    def take_reports(self) -> list[JobReport]:
        out, self._reports = self._reports, []
        return out

    def has_reports(self) -> bool:
        return bool(self._reports)

    def pending(self) -> int:
        return 0

    def wait_idle(self, timeout: Optional[float] = 30.0) -> bool:
        return True

    def close(self, drain_s: float = 10.0) -> int:
        return 0

    def stats(self) -> dict:
        return {}
