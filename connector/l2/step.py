"""The worker's step protocol: the order of one engine step's calls on a :class:`~tierkv.connector.l2.worker.CacheWorker`.

An engine adapter makes one call per hook, in the engine's order: :meth:`WorkerStep.before_forward` (the plan is
bound: L3 reads handed to the readers so they overlap the forward, forward timing starts), :meth:`WorkerStep.load`
(synchronous L3 reads waited for, L2 -> L1 loads started; vLLM calls it before the forward only in steps with
synchronous loads, after it otherwise), :meth:`WorkerStep.layer_ready` (layer by layer: that layer's copies done),
:meth:`WorkerStep.after_forward` (loads finished, L1 -> L2 saves run, backups handed to the writer) and
:meth:`WorkerStep.end_step` (reads of this step waited for at most :data:`STEP_READ_WAIT_FRACTION` of the step so
far, then the requests whose asynchronous load ended, and those whose load failed with several KV cache groups).
With ``backup_pause`` ``prefill`` (``forward``) the L3 writer starts no backup batch from ``before_forward`` of a
step that computes prompt tokens (of every step) to the end of its ``after_forward`` (``L3IO.pause_backups``).
:meth:`WorkerStep.take_result` hands the job reports and timed forwards over, :meth:`WorkerStep.failed_blocks` the
blocks to recompute. An exception inside a call goes to ``on_error(counters, call, err)`` and becomes failed pages
or a miss, never an engine error. Times are ``time.perf_counter`` seconds.
"""
from __future__ import annotations

import time
from typing import Callable, Optional

from tierkv.connector.core.config import BACKUP_PAUSES
from tierkv.connector.core.plan import JobReport, StepPlan
from tierkv.connector.l3.load_policy import STEP_READ_WAIT_FRACTION, LoadPolicy  # noqa: F401  (re-exported)

from .worker import CacheWorker

#: a step is timed (its prefill time per token) when it computes at least this many pages of prompt tokens
TIMED_STEP_PAGES = 4


class WorkerStep:
    """Drives ``worker`` through each step (see the module docstring). ``page_size``: tokens per page;
    ``hybrid``: several KV cache groups (failed loads are reported as requests); ``on_error(counters, call, err)``:
    counts and logs an exception caught in a call; ``backup_pause``: one of :data:`BACKUP_PAUSES`.

    Raises:
        ValueError: an unknown ``backup_pause``."""

    def __init__(self, worker: CacheWorker, page_size: int, hybrid: bool,
                 on_error: Callable[[object, str, BaseException], None], backup_pause: str = "never"):
        if backup_pause not in BACKUP_PAUSES:
            raise ValueError(f"backup_pause must be one of {', '.join(BACKUP_PAUSES)}, got {backup_pause!r}")
        self.worker, self.page_size, self.hybrid, self.on_error = worker, page_size, hybrid, on_error
        self.backup_pause = backup_pause
        self.bound_at: Optional[float] = None             # perf_counter time the current plan was bound
        self._fwd: Optional[tuple[int, int, float]] = None  # (step, prompt tokens, start) of this forward
        self._forwards: list[tuple[int, int, float]] = []   # timed forwards not reported yet
        self.loads_ended = False  # end_step named a request whose L3 load ended, this step

    def before_forward(self, plan) -> None:
        """The plan is bound: hand its L3 reads to the readers, so they overlap the forward; time the forward."""
        if not isinstance(plan, StepPlan):
            return
        self.bound_at = time.perf_counter()
        if self.backup_pause == "forward" or (self.backup_pause == "prefill" and plan.prefill_tokens > 0):
            self.worker.l3.pause_backups()  # until after_forward: the writer leaves this forward's CPU alone
        if plan.prefill_tokens >= TIMED_STEP_PAGES * self.page_size:  # timed until after_forward
            self._fwd = (plan.step, plan.prefill_tokens, time.perf_counter())
        if plan.jobs:
            try:
                self.worker.start_reads(plan)
            except Exception as e:  # not handed over: after_forward hands them over with the backups
                self.on_error(self.worker.counters, "bind_connector_metadata", e)

    def load(self, plan) -> None:
        """Wait for the plan's synchronous L3 reads (at most their deadlines), then start its L2 -> L1 loads, those
        reads' leading intact pages included."""
        if not isinstance(plan, StepPlan):
            return
        w = self.worker
        try:
            w.take_plan_failures(plan)
            verified = w.finish_sync_reads()
            if plan.loads or verified:
                w.start_loads(plan, verified)
        except Exception as e:  # the step's loads are reported failed: vLLM recomputes them
            self.on_error(w.counters, "start_load_kv", e)
            w.fail_loads(plan)

    def layer_ready(self, layer_name: str, plan_fn: Callable[[], object]) -> None:
        """Wait until this layer's L2 -> L1 copies are done (``plan_fn`` gives the bound plan, read only after a
        failure, whose loads are then reported failed)."""
        try:
            self.worker.wait_layer(layer_name)
        except Exception as e:
            self.on_error(self.worker.counters, "wait_for_layer_load", e)
            plan = plan_fn()
            if isinstance(plan, StepPlan):
                self.worker.fail_loads(plan)

    def after_forward(self, plan) -> None:
        """End the forward's timing; finish the step's loads and run its saves (complete on return, none of a
        request whose load failed); then hand the plan's remaining L3 jobs to the I/O threads."""
        if not isinstance(plan, StepPlan):
            return
        w = self.worker
        fwd, self._fwd = self._fwd, None
        if fwd is not None and fwd[0] == plan.step:
            self._forwards.append((fwd[0], fwd[1], time.perf_counter() - fwd[2]))
            del self._forwards[:-64]  # bounded if the scheduler side never collects them
        try:
            w.end_sync_step(plan)
            w.finish_loads()
            w.run_saves(plan)  # every step: it also notes this step's failed loads
        except Exception as e:  # those pages are not in L2; a later hit on them recomputes
            self.on_error(w.counters, "wait_for_save", e)
            w.forget_saves(plan.saves)
        try:
            if plan.jobs:
                todo = w.unsubmitted(plan)
                try:
                    w.submit_jobs(plan)
                except Exception as e:  # answered "not done" at once, so the scheduler side never waits for them
                    self.on_error(w.counters, "wait_for_save", e)
                    w.fail_jobs(todo)
        finally:
            w.l3.resume_backups()  # the forward and its saves are done: the writer goes on

    def end_step(self, finished_req_ids: set[str], with_failed: bool = False
                 ) -> tuple[Optional[set[str]], set[str]]:
        """``(finished_recving or None, failed_recving)``: the requests whose asynchronous load ended, after waiting
        for this step's reads at most :meth:`LoadPolicy.step_read_wait_s` (a fraction of the time since :meth:`before_forward`);
        with ``with_failed`` and several KV cache groups also those whose load failed (else the set is empty)."""
        w = self.worker
        done: Optional[set[str]] = None
        try:
            w.wait_step_reads(LoadPolicy.step_read_wait_s(self.bound_at, time.perf_counter()))
            got = w.poll(finished_req_ids)
            self.loads_ended = bool(got)
            done = got or None
        except Exception as e:
            self.on_error(w.counters, "get_finished", e)
        failed: set[str] = set()
        if with_failed and self.hybrid:
            try:
                failed = w.take_failed_requests()
            except Exception as e:
                self.on_error(w.counters, "get_transfer_results", e)
        return done, failed

    def take_result(self) -> Optional[tuple[list[JobReport], list[tuple[int, int, float]]]]:
        """``(job reports, timed forwards (step, prompt tokens, seconds))`` of the steps since the last call, None
        when there are none (or the reports could not be taken)."""
        try:
            reports = self.worker.take_reports()
        except Exception as e:
            self.on_error(self.worker.counters, "build_connector_worker_meta", e)
            return None
        forwards, self._forwards = self._forwards, []
        return (reports, forwards) if reports or forwards else None

    def failed_blocks(self) -> set[int]:
        """Blocks whose load failed since the last call (vLLM recomputes them)."""
        try:
            return self.worker.take_failed_blocks()
        except Exception as e:
            self.on_error(self.worker.counters, "get_block_ids_with_load_errors", e)
            return set()

    def holds_stats_back(self, plan) -> bool:
        """Whether this step's counter hand-over can wait: the plan says so and moved nothing (no load, save or
        job, no load ended, no report waiting)."""
        return (isinstance(plan, StepPlan) and not plan.emit_stats and plan.is_empty() and not self.loads_ended
                and not self.worker.has_reports())
