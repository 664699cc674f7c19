"""The L3 half of the worker's step: reads handed over before the forward, synchronous and asynchronous loads, jobs.

:class:`L3Jobs` is a mixin of :class:`tierkv.connector.l2.worker.CacheWorker` (it uses the worker's pools, counters,
checksum checks and copy helpers). Prefetches and existence queries go to the readers before the forward
(:meth:`~L3Jobs.start_reads`); synchronous prefetches are waited for before the forward, at most until their
deadlines (:meth:`~L3Jobs.finish_sync_reads`), and copied with the step's L2 loads; backups go to the writer after
the step's saves (:meth:`~L3Jobs.submit_jobs`). :meth:`~L3Jobs.poll` copies the intact leading pages of ended
prefetches L2 -> L1 and names their requests; without a store every job is answered at once with no page done.
A page whose save was not made is never loaded nor backed up; failures become failed blocks (one KV cache group)
or failed requests (several groups), never exceptions into the engine.
"""
from __future__ import annotations

import logging
import time
from typing import Sequence

from tierkv import kernels
from tierkv.connector.core.plan import JOB_BACKUP, JOB_PREFETCH, JobReport, PageOrder, StepPlan
from tierkv.connector.l3.load_policy import LoadPolicy

logger = logging.getLogger("tierkv.worker")


class L3Jobs:
    """The L3 job bookkeeping of :class:`~tierkv.connector.l2.worker.CacheWorker` (see the module docstring)."""

    def fail_jobs(self, jobs) -> None:
        """Answer ``jobs`` with no page done, at once (no store, or they could not be handed to it)."""
        for job in jobs:
            served = 0 if job.sync else None
            self._orphan_reports.append(JobReport(job.job_id, job.kind, [False] * job.num_pages, served=served))
            if job.kind == JOB_PREFETCH and job.req_id is not None:
                if not job.sync:  # a synchronous load's request is not waiting: it is never named ended
                    self._orphan_finished.add(job.req_id)
                self._failed_blocks.update(job.block_ids)
                self.counters.failed_load_blocks += len(job.block_ids)
                if self.group_layers is not None:
                    self._failed_reqs.add(job.req_id)

    # ----------------------------------------------------------------- L3 jobs
    def start_reads(self, plan: StepPlan) -> None:
        """Hand the plan's prefetches and existence queries to the readers now, before the step's forward (vLLM's
        ``bind_connector_metadata``): they read nothing the step writes, so the read overlaps the forward and a load
        that ends within it is named finished at this step's end (an L3 hit then costs one engine step more than an
        L2 hit).
        Backups wait for :meth:`submit_jobs`, after the step's saves."""
        reads = [j for j in plan.jobs if j.kind != JOB_BACKUP]
        if not reads:
            return
        for j in reads:
            if j.kind == JOB_PREFETCH:
                self._track_load(j.req_id, j.block_ids, j.groups)
        self.l3.submit(reads)
        self._step_reads = [j.job_id for j in reads if j.kind == JOB_PREFETCH and not j.sync]
        self._sync_jobs = [j for j in reads if j.kind == JOB_PREFETCH and j.sync]
        self._read_started.update(j.job_id for j in reads)

    def finish_sync_reads(self) -> list[PageOrder]:
        """Before the forward (vLLM's ``start_load_kv``, which it calls before the forward in a step with
        synchronous loads): wait for the synchronous prefetches :meth:`start_reads` handed over for this step, at most
        until their deadlines (counted from when a reader starts each), then end their request side. Returns the
        leading run of intact, verified pages of each, for :meth:`start_loads` to copy L2 -> L1 with the step's other
        loads; every block after that run is reported failed (:meth:`take_failed_blocks`: vLLM recomputes from there,
        and the request's saves of this step are not made: their KV follows a failed load). Pages that arrive later
        still reach L2 and are reported by the job."""
        jobs = self._sync_jobs
        if not jobs:
            return []
        t0 = time.perf_counter()
        wait_s = LoadPolicy.sync_reads_wait_s([j.deadline_max_s or j.deadline_s or 0.0 for j in jobs])
        self.l3.wait_reads([j.job_id for j in jobs], wait_s)
        self.counters.sync_wait_seconds += time.perf_counter() - t0
        out = self._end_sync(jobs, copy=True)
        self._sync_jobs = []  # kept until here: if this raised, end_sync_step fails what was not released
        return out

    def end_sync_step(self, plan: StepPlan) -> None:
        """After the forward, before the step's saves (vLLM's ``wait_for_save``): the plan's synchronous prefetches
        whose request side :meth:`finish_sync_reads` did not end (it was not called before the forward, or raised),
        and those never handed to the readers (:meth:`start_reads` raised), reached no L1 block in time: every
        block of theirs is reported failed and their request's saves of this step are not made (their KV follows a
        failed load). The ones never handed over are answered at once and not handed over later."""
        jobs, self._sync_jobs = self._sync_jobs, []
        if jobs:
            self._end_sync(jobs, copy=False)
        late = [j for j in plan.jobs if j.kind == JOB_PREFETCH and j.sync and j.job_id not in self._read_started]
        if late:
            self.fail_jobs(late)
            self._sync_orders.extend(j.page_order() for j in late)
            self._read_started.update(j.job_id for j in late)  # answered: submit_jobs does not hand them over

    def _end_sync(self, jobs, copy: bool) -> list[PageOrder]:
        by_id = {j.job_id: j for j in jobs}
        oks, failed = [], set()
        for jid, head, bad in self.l3.release(list(by_id)):
            job = by_id[jid]
            self._sync_orders.append(job.page_order())
            good = self._verified_prefix(head) if copy else 0
            self._sync_served[jid] = good
            if good:
                oks.append(head.head(good))
            failed.update(bad)
            failed.update(head.blocks_from(good))
        if failed:
            self._failed_blocks.update(failed)
            self.counters.failed_load_blocks += len(failed)
            self.counters.sync_failed_blocks += len(failed)
        self.counters.sync_load_pages += sum(len(o.slots) for o in oks)
        return oks

    def wait_step_reads(self, budget_s: float) -> None:
        """At the end of a step (before :meth:`poll`): wait at most ``budget_s`` seconds for the prefetch reads
        :meth:`start_reads` handed over before this step's forward, so that a read ending just after the forward is
        named finished by this step, not the next (an L3 hit then costs one engine step more than an L2 hit, not two).
        Each read is waited for once, in the step that started it; a read already ended costs nothing."""
        ids, self._step_reads = self._step_reads, []
        if not ids:
            return
        t0 = time.perf_counter()
        running, ended = self.l3.wait_reads(ids, budget_s)
        if running:
            c = self.counters
            c.read_waits += 1
            c.read_wait_seconds += time.perf_counter() - t0
            c.read_wait_timeouts += not ended

    def unsubmitted(self, plan: StepPlan) -> list:
        """The plan's jobs :meth:`start_reads` did not hand over (what :meth:`submit_jobs` will)."""
        return [j for j in plan.jobs if j.job_id not in self._read_started]

    def submit_jobs(self, plan: StepPlan) -> None:
        """Hand the plan's L3 jobs not handed over by :meth:`start_reads` to the I/O threads (after
        :meth:`run_saves` of the same plan). Without a store (:class:`NoL3`: none configured, or it could not start)
        every job is answered at once with no page done, so the scheduler side never waits for it: a prefetch's
        blocks are reported as load errors and its request as finished."""
        if not plan.jobs:
            return
        if self._read_started:
            jobs = self.unsubmitted(plan)
            self._read_started.difference_update(j.job_id for j in plan.jobs)
            if len(jobs) < len(plan.jobs):
                plan = StepPlan(step=plan.step, jobs=jobs)
            if not jobs:
                return
        for j in plan.jobs:
            if j.kind == JOB_PREFETCH:
                self._track_load(j.req_id, j.block_ids, j.groups)
        skip = {}
        if self._unwritten:  # a page whose save was not made is never sent to L3 (its KV followed a failed load)
            for job in plan.jobs:
                if job.kind == JOB_BACKUP:
                    idx = {i for i, (s, k) in enumerate(zip(job.slots, job.keys)) if self._unwritten.get(s) == k}
                    if idx:
                        skip[job.job_id] = idx
        self.l3.submit(plan.jobs, skip=skip)

    def poll(self, finished_req_ids: Sequence[str] = ()) -> set[str]:
        """Finish the request side of ended prefetches: copy their intact leading pages L2 -> L1, remember the
        blocks that failed (:meth:`take_failed_blocks`). Returns the ids of requests whose asynchronous load ended
        (vLLM: ``finished_recving``)."""
        if self._suspect and finished_req_ids:
            self._suspect.difference_update(finished_req_ids)
        if not self._orphan_finished and self.group_layers is None and not self.l3.has_prefetches():
            return set()  # no L3 load in flight nor one to report (most steps): nothing to copy or name
        orphans, self._orphan_finished = self._orphan_finished, set()
        res = self.l3.poll(finished_req_ids)
        res.finished |= orphans
        oks, pages = [], 0
        for order in res.orders:
            # the pages that were already in L2 pass the same checks as a synchronous load's: a slot whose save was
            # not made (computed after a failed load) or that fails its checksum is never copied; the request
            # recomputes from there
            good = self._verified_prefix(order)
            oks.append(order.head(good))
            pages += good
            res.failed_blocks.update(order.blocks_from(good))
        blocks = [b for o in oks for b in o.block_ids]
        if blocks:
            t0 = time.perf_counter()
            try:
                self._copy_all(kernels.load_pages, self._copies(oks))
                self.counters.async_load_pages += pages
            except Exception:  # never crash the engine: report the blocks, vLLM recomputes them
                logger.exception("tierkv: L2 -> L1 copy of %d prefetched pages failed", len(blocks))
                res.failed_blocks.update(blocks)
            self.counters.async_load_seconds += time.perf_counter() - t0
        if res.failed_blocks:
            self._failed_blocks.update(res.failed_blocks)
            self.counters.failed_load_blocks += len(res.failed_blocks)
        if self.group_layers is None:
            return res.finished
        return self._end_hybrid_loads(res.finished)

    def _end_hybrid_loads(self, finished: set[str]) -> set[str]:
        """Hybrid models: ``finished`` plus the requests whose L2 load ran since the last poll (every load is
        asynchronous); of those, the ones with a failed block or a load that could not be ordered go to
        :meth:`take_failed_requests`. Failed blocks of loads still in flight are kept for their own poll."""
        finished = set(finished) | self._loaded_reqs
        self._loaded_reqs = set()
        bad, self._failed_blocks = self._failed_blocks, set()
        for rid in finished:
            blocks = self._load_blocks.pop(rid, set())
            if rid in self._failed_reqs or not bad.isdisjoint(blocks):
                self._failed_recving.add(rid)
            self._failed_reqs.discard(rid)
        pending = set().union(*self._load_blocks.values()) if self._load_blocks else set()
        self._failed_blocks = bad & pending
        return finished

    def take_failed_requests(self) -> set[str]:
        """Hybrid models: requests named ended by :meth:`poll` whose load failed (vLLM's ``failed_recving``: it
        recomputes them), reported once; always empty for one KV cache group (failed blocks are reported)."""
        out, self._failed_recving = self._failed_recving, set()
        return out

    def has_reports(self) -> bool:
        """Whether a job report waits for :meth:`take_reports`: a job ended, and the I/O thread that ended it moved
        this worker's counters."""
        return bool(self._orphan_reports) or self.l3.has_reports()

    def take_reports(self) -> list[JobReport]:
        out, self._orphan_reports = self._orphan_reports, []
        out.extend(self.l3.take_reports())
        if self._sync_served:
            for r in out:
                served = self._sync_served.pop(r.job_id, None)
                if served is not None:
                    r.served = served
        return out
