"""Scheduler half of the L3 controller: decides backups and prefetches and keeps their state; no torch, no I/O.

The worker half (:mod:`tierkv.connector.l3.io`) moves the bytes; the two talk only through
:class:`~tierkv.connector.core.plan.Job` s (in the step plan) and :class:`~tierkv.connector.core.plan.JobReport` s
(in the step output). Policies after SGLang HiCache's write and storage-prefetch policies. :class:`Controller` is a
facade over its seams, each in its own module: the job table (:mod:`~tierkv.connector.l3.jobs`), the backup policy
(:mod:`~tierkv.connector.l3.backup`), existence (:mod:`~tierkv.connector.l3.existence`), prefetch
(:mod:`~tierkv.connector.l3.prefetch`), hit estimates (:mod:`~tierkv.connector.l3.hit_estimates`) and lookup
accounting (:mod:`~tierkv.connector.l3.lookup_stats`); every wait for L3 is decided by its
:class:`~tierkv.connector.l3.load_policy.LoadPolicy`. A hit is never slower than recomputing it: a hit estimated to
load slower than recomputing its tokens is declined, and under ``best_effort`` a request waits for L3 at most a small
fraction of its recompute time.
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Callable, Optional, Sequence

from tierkv.connector.core.config import WRITE_POLICIES
from tierkv.connector.core.plan import Job
from tierkv.connector.core.radix_index import RadixIndex
from tierkv.connector.l2.slot_allocator import SlotAllocator
from tierkv.connector.l3.admission import DEFAULT_WINDOW_PAGES, Admission
from tierkv.connector.l3.backup import BackupPolicy, reclaim_l2
from tierkv.connector.l3.existence import Existence
from tierkv.connector.l3.hit_estimates import HitEstimates, _Ewma
from tierkv.connector.l3.jobs import ControllerCounters, JobTable, _JobState, logger
from tierkv.connector.l3.lookup_stats import (HIT_PARTS, MISS_REASONS, REUSE_BUCKETS_S, LookupAnswer, LookupStats,
                                              OutcomeTracking, _Outcome)
from tierkv.connector.l3.load_policy import (BEST_EFFORT_MIN_WAIT_S, BEST_EFFORT_STALL_FRACTION, SYNC_DEADLINE_FACTOR,
                                             LoadPolicy)
from tierkv.connector.l3.prefetch import Prefetch

__all__ = ["BEST_EFFORT_MIN_WAIT_S", "BEST_EFFORT_STALL_FRACTION", "HIT_PARTS", "MISS_REASONS", "REUSE_BUCKETS_S",
           "SYNC_DEADLINE_FACTOR", "Controller", "ControllerCounters", "LoadPolicy", "LookupAnswer", "LookupStats",
           "reclaim_l2", "logger", "_Ewma", "_JobState", "_Outcome"]


class Controller(JobTable, BackupPolicy, Existence, Prefetch, HitEstimates, OutcomeTracking):
    """Scheduler half of the controller for one engine (see the module docstring): a facade over the seams
    it inherits, each in its own module.

    Args:
        index: the scheduler's :class:`RadixIndex` (shared with :class:`~tierkv.connector.core.scheduler.CacheScheduler`).
        allocator: the L2 :class:`SlotAllocator` (shared).
        page_size: tokens per page.
        world_size: worker ranks that report every job (TP x PP); a job ends when all of them reported.
        write_policy / write_through_threshold / prefetch_policy / prefetch_timeout_base_s /
        prefetch_timeout_per_page_s: the ``controller`` config section.
        exists_wait_s: longest time (seconds) a request waits for an existence answer.
        negative_ttl_s: seconds an absent page is remembered.
        exists_fn: ``keys -> leading run present in L3 on every rank`` answered synchronously in this process (or
            None when it cannot answer: the workers are asked instead); None = always ask the workers.
        probe_interval_s: a fetch estimate older than this lets the next hit that it would decline go ahead (a
            probe that refreshes it).
        sync_load_max_s: an L3 hit whose read is estimated to take at most this many seconds is loaded
            synchronously, before the forward of the step that admits it (:meth:`load_sync`); 0 = every L3 hit is
            an asynchronous load.
        room_retry_steps / room_wait_s: a request waits for L2 staging room for at least this many lookups and at
            least this many seconds (both) before its L3 hit is declined.
        max_index_pages: bound on indexed pages; L3-only pages beyond it leave the index (LRU).
        shutdown_drain_s: a backup or prefetch out longer than this (seconds) no longer keeps the engine stepping
            (:meth:`pins_pending`), so that vLLM's shutdown, which waits for that, ends within it on a store that
            stalls; the workers give queued backups the same time at shutdown.
        admission / admission_window_pages: the ``l3.admission`` and ``l3.admission_window_pages`` config keys
            (:class:`~tierkv.connector.l3.admission.Admission`).
        clock: monotonic seconds.
        lookup_stats: the scheduler's :class:`LookupStats` (the controller resolves the outcome of L3 loads and
            records L3 store times into it); None = its own.
    Raises:
        ValueError: an unknown policy or admission (naming the allowed ones), a deadline <= 0, world_size < 1, a
            window <= 0.
    """

    def __init__(self, index: RadixIndex, allocator: SlotAllocator, *, page_size: int, world_size: int = 1,
                 write_policy: str = "write_through", write_through_threshold: int = 2,
                 prefetch_policy: str = "best_effort", prefetch_timeout_base_s: float = 0.5,
                 prefetch_timeout_per_page_s: float = 0.005, exists_wait_s: float = 1.0,
                 negative_ttl_s: float = 2.0, room_retry_steps: int = 8, room_wait_s: float = 0.5,
                 probe_interval_s: float = 5.0, sync_load_max_s: float = 0.02, exists_in_scheduler: bool = True,
                 exists_fn: Optional[Callable[[Sequence[bytes]], Optional[int]]] = None,
                 max_index_pages: int = 1 << 22, shutdown_drain_s: float = 10.0, admission: str = "always",
                 admission_window_pages: int = DEFAULT_WINDOW_PAGES,
                 clock: Callable[[], float] = time.monotonic, lookup_stats: Optional[LookupStats] = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"bad value {write_policy!r} for 'controller.write_policy': allowed values are "
                             f"{', '.join(WRITE_POLICIES)}")
        self.fetch_s_per_page = _Ewma(clock)
        self.prefill_s_per_token = _Ewma(clock)
        self.load_policy = LoadPolicy(page_size=page_size, fetch_s_per_page=self.fetch_s_per_page,
                                      prefill_s_per_token=self.prefill_s_per_token, prefetch_policy=prefetch_policy,
                                      prefetch_timeout_base_s=prefetch_timeout_base_s,
                                      prefetch_timeout_per_page_s=prefetch_timeout_per_page_s,
                                      sync_load_max_s=sync_load_max_s, room_retry_steps=room_retry_steps,
                                      room_wait_s=room_wait_s, exists_wait_s=exists_wait_s)
        if prefetch_timeout_per_page_s < 0 or exists_wait_s < 0 or negative_ttl_s < 0:
            raise ValueError("prefetch_timeout_per_page_s, exists_wait_s and negative_ttl_s must be >= 0 seconds")
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.index = index
        self.allocator = allocator
        self.page_size = page_size
        self.world_size = world_size
        self.write_policy = write_policy
        self.threshold = write_through_threshold
        self.negative_ttl_s = negative_ttl_s
        self.probe_interval_s = probe_interval_s
        self.exists_in_scheduler = exists_in_scheduler
        self.exists_fn = exists_fn if exists_in_scheduler else None
        self.max_index_pages = max_index_pages
        self.shutdown_drain_s = shutdown_drain_s
        self.clock = clock
        self.counters = ControllerCounters()
        self.admission = Admission(admission, admission_window_pages)
        self._next_id = 1
        self._outbox: list[Job] = []
        self._jobs: dict[int, _JobState] = {}
        self._backing_up: set[bytes] = set()
        self._fetching: dict[bytes, int] = {}
        self._exists_pending: dict[bytes, int] = {}
        self._absent: "OrderedDict[bytes, float]" = OrderedDict()
        self._l3_evicted: "OrderedDict[bytes, None]" = OrderedDict()  # pages L3 evicted, flag not yet cleared
        self._req_prefetch: dict[str, int] = {}   # request -> its prefetch job, until the job's report (I/O side)
        self._recv_open: set[str] = set()          # requests whose load the workers have not named as ended yet
        self._plans = 0                            # plans handed out (take_jobs): one per engine step
        self._released: dict[int, int] = {}        # prefetch job -> _plans when the workers released its request
        self._room_waits: dict[str, tuple[int, float]] = {}  # request -> (lookups waited, clock at the first)
        self._probe_req: Optional[str] = None       # the request whose hit went ahead as a probe, until its job
        self._probe_jobs: set[int] = set()          # prefetch jobs of probes: their sample replaces the estimate
        self.lookup_stats = lookup_stats if lookup_stats is not None else LookupStats(allocator.num_slots, clock)
        self._outcomes: dict[str, _Outcome] = {}  # request -> its counted L3 load, until its outcome is known

    def lookup(self, req_id: str, keys: Sequence[bytes], l2_run: int, first: int) -> Optional[LookupAnswer]:
        """How much of ``keys`` (the request's full pages that may count, at most all but its last token) request
        ``req_id`` can load, given that ``keys[:l2_run]`` have L2 copies and ``keys[:first]`` are in L1 already.
        None = not known yet (another request is fetching these pages, an existence answer or L2 staging room is
        pending): vLLM asks again next step. Counts the deferred lookups and the hits declined as slow."""
        m = self.index.match_prefix(keys, require_l2=False)
        if self._l3_evicted:
            m = self._forget_evicted(keys, m)
        if m.num_pages < len(keys):  # pages no tier holds: did admission turn them away?
            self.admission.wanted(keys[m.num_pages:])
        avail = self.usable_pages(keys, m.host_slots, m.in_l3)
        lo = max(first, l2_run)
        i, wait = self.fetch_state(keys[lo:avail + 1], req_id)
        if wait:
            self.counters.lookups_deferred += 1
            return None  # another request is fetching these pages: load them from L2 once they landed
        end = len(keys)
        # pages past the deadline of a fetch that still runs are not offered: late
        rest = [("late", avail), ("miss", end)] if lo + i < avail else [("miss", end)]
        avail = min(avail, lo + i)
        if avail == m.num_pages and avail < end:
            late = self.counters.exists_late_answers
            more = self.l3_extend(keys, avail)
            if more is None:
                self.counters.lookups_deferred += 1
                return None
            if self.counters.exists_late_answers != late:  # the request went on without the existence answer
                rest = [("late", end)]
            if more:  # answered at once (the scheduler's own existence check): the pages are indexed now
                m = self.index.match_prefix(keys, require_l2=False)
                avail = self.usable_pages(keys, m.host_slots, m.in_l3)
        if avail <= lo:
            return LookupAnswer(l2_run, rest=rest)
        fetch = sum(1 for s in m.host_slots[lo:avail] if s < 0)
        probes = self.counters.l3_probe_hits
        if not self.worth_loading(fetch):
            self.counters.l3_declined_slow_pages += fetch
            return LookupAnswer(l2_run, rest=[("declined_slow", avail)] + rest)
        if self.counters.l3_probe_hits != probes:
            self._probe_req = req_id
        room = self.wait_for_room(req_id, fetch)
        if room is None:
            self.counters.lookups_deferred += 1
            return None
        if not room:
            return LookupAnswer(l2_run, rest=[("no_room", avail)] + rest)
        if self.load_sync(fetch):
            return LookupAnswer(avail, sync=True, rest=rest)
        return LookupAnswer(avail, is_async=True, rest=rest)

    # ------------------------------------------------------------------ how long a load may wait (LoadPolicy)
    def load_sync(self, fetch_pages: int) -> bool:
        """:meth:`LoadPolicy.load_sync`: whether an L3 hit of ``fetch_pages`` pages is loaded synchronously."""
        return self.load_policy.load_sync(fetch_pages)

    def sync_deadline_s(self, fetch_pages: int) -> float:
        """:meth:`LoadPolicy.sync_deadline_s`: the deadline of a synchronous load."""
        return self.load_policy.sync_deadline_s(fetch_pages)

    def deadline_credit_s(self) -> float:
        """:meth:`LoadPolicy.deadline_credit_s`: seconds a deadline moves later per page that arrives."""
        return self.load_policy.deadline_credit_s()

    def deadline_s(self, fetch_pages: int) -> Optional[float]:
        """:meth:`LoadPolicy.deadline_s`: seconds a prefetch may run before its request is released."""
        return self.load_policy.deadline_s(fetch_pages)

    def end_request(self, req_id: str) -> bool:
        """:meth:`Prefetch.end_request`, and the admission forgets the request's lookups."""
        self.admission.end_request(req_id)
        return super().end_request(req_id)

    def stats(self) -> dict:
        d = self.counters.as_dict()
        d.update(self.admission.stats())
        d.update(ctl_pending_jobs=self.pending_jobs(), ctl_backing_up_pages=len(self._backing_up),
                 ctl_fetching_pages=len(self._fetching),
                 ctl_fetch_ms_per_page=None if self.fetch_s_per_page.value is None
                 else 1e3 * self.fetch_s_per_page.value,
                 ctl_prefill_us_per_token=None if self.prefill_s_per_token.value is None
                 else 1e6 * self.prefill_s_per_token.value)
        return d


def _policy_setting(name: str) -> property:
    """A :class:`Controller` attribute that is its :class:`LoadPolicy`'s setting of the same name."""
    return property(lambda self: getattr(self.load_policy, name),
                    lambda self, value: setattr(self.load_policy, name, value),
                    doc=f"The load policy's ``{name}``.")


for _name in ("prefetch_policy", "timeout_base_s", "timeout_per_page_s", "sync_load_max_s", "room_retry_steps",
              "room_wait_s", "exists_wait_s"):
    setattr(Controller, _name, _policy_setting(_name))
