"""Scheduler half of the backup/prefetch controller: decisions, jobs and per-page job state (docs/architecture.md §4).

No torch and no I/O: it decides and keeps state; the worker half (:mod:`tierkv.connector.l3.io`) moves the bytes.
The two halves talk only through :class:`~tierkv.connector.core.plan.Job` s (in the step plan) and
:class:`~tierkv.connector.core.plan.JobReport` s (in the step output). Policies after SGLang HiCache
(``--hicache-write-policy``, ``--hicache-storage-prefetch-policy``), adapted to vLLM's connector API:

Backup (L2 -> L3)
    ``write_through``: every page saved into L2 is backed up in the same step's plan.
    ``write_through_selective``: a page is backed up once its node was hit ``write_through_threshold`` times.
    ``write_back``: a page is backed up only when L2 eviction picks it (on demand, and ahead of demand to keep a
    quarter of the slots free or being freed); its slot is freed only after the store acknowledged the page, and a
    page whose backup failed is dropped, never marked as stored
    (docs/architecture.md §8 R07).
    While a backup runs, the index node holding its pages is locked (its slots cannot be evicted or reused).

Existence (is the rest of this prompt in L3?)
    A lookup whose prefix ends in the index asks for the leading run present in L3 after it. Where the store can
    answer from the scheduler's process at once (``exists_fn``: the file store, one ``stat`` per key and rank) the
    answer is used in the same lookup, so neither a miss nor a hit waits a step for it. Otherwise the workers (all
    ranks) are asked with a job: while the answer is pending :meth:`Controller.l3_extend` returns None (vLLM asks
    again next step), for at most ``exists_wait_s``; then the request goes on without L3 and the late answer still
    fills the index. Pages found are inserted as L3-only; the first absent page is remembered for ``negative_ttl_s``
    (one query per miss).

Prefetch (L3 -> L2 -> L1)
    :meth:`start_prefetch` gives the L3-only pages staging slots (evicting if needed), locks the path, and orders one
    job; the worker copies the leading run that arrived intact into the request's blocks and reports the rest as load
    errors. A hit whose read is estimated to take at most ``sync_load_max_s`` is loaded synchronously
    (:meth:`load_sync`): the worker waits for the read before the forward of the step that admits the request, which
    then computes its other tokens in that step, like an L2 hit's. Any other hit is an asynchronous load: the request
    waits outside the batch, and is scheduled in the step after the one whose output names its load ended. Deadline
    per policy: ``wait_complete`` none (the store's own timeout bounds each call), ``timeout``
    ``base + per_page * pages``, ``best_effort`` the time recomputing those tokens would take (by the running
    estimate; ``timeout``'s deadline until one exists). The report publishes the fetched pages into the index (slot +
    L3) and frees the rest; a page that failed to read is remembered as absent. A page being fetched is not fetched again: another request
    that needs it waits (lookup answers None) and then loads it from L2, so one L3 read serves every waiting request.

A hit is never slower than recomputing it
    Running estimates (EWMA) of the seconds per fetched page (from prefetch reports, timed from the start of each
    read; not from a rank's first reads in its process, which also time the store client's set-up: a Mooncake
    client's first operations took about a second) and of the engine's prefill seconds per token
    (:meth:`observe_prefill`: forward time of steps that computed prompt tokens, measured by the workers); an L3 hit
    whose estimated load time exceeds the recompute time of its tokens is declined and counted
    (``l3_declined_slow_pages``). No estimate yet = no decline. A declined hit reads
    nothing, so the fetch estimate would never change again: once it is older than ``probe_interval_s`` the next
    hit goes ahead as a probe (``l3_probe_hits``) and its read refreshes it. A read that outlives its request (the
    workers released the request at its deadline; a synchronous load's request is released within its step)
    reports only when it ends, which for a stalled store may be never; from the step after the release on, its time so far divided by its pages bounds the store's seconds per
    page from below (:meth:`overdue_s_per_page`), and once that bound exceeds recomputing a page, hits are declined
    without a probe (the overdue read is the probe): on a stalled store only the hits ordered before the first read
    was overdue for a whole recompute wait their deadline. Under ``best_effort`` a request waits at
    most ``BEST_EFFORT_STALL_FRACTION`` of its estimated recompute time (and at most three times its estimated fetch
    time), so a store that stalls costs at most that much on top of recomputing: the leading pages that arrived by
    then are used, the rest recomputed.
"""
from __future__ import annotations

import logging
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field, fields
from typing import Callable, Optional, Sequence

from tierkv.storage_backends.common import RateLimitedLog

from tierkv.connector.core.config import PREFETCH_POLICIES, WRITE_POLICIES
from tierkv.connector.core.plan import JOB_BACKUP, JOB_EXISTS, JOB_PREFETCH, Job, JobReport, merge_reports
from tierkv.connector.core.radix_index import NO_SLOT, RadixIndex, RadixNode
from tierkv.connector.l2.slot_allocator import SlotAllocator

logger = logging.getLogger("tierkv.controller")
_rate_limited = RateLimitedLog(logger)  # one line per kind per 10 s, with the count of those suppressed


def reclaim_l2(index: RadixIndex, allocator, target: int, *,
               back_up: Optional[Callable[[RadixNode], Optional[int]]] = None, freeing: Optional[int] = None) -> None:
    """The one L2 reclaim loop (the scheduler without an L3 and the controller both use it): take victims in the
    index's policy order (:meth:`RadixIndex.pop_l2_victim`) until ``target`` slots are free, or no victim is left.

    ``back_up(victim)`` may keep a victim's L2 copy for now (write_back: its pages go to L3 first) and return how
    many slots it will free later; None drops the victim's L2 copy at once and returns its slots to ``allocator``.
    With ``freeing`` (slots already being freed that way) the target counts those as free, so it is met by slots
    free *or being freed* (reclaiming ahead of need); without it only free slots count (room needed now).
    """
    ahead = freeing is not None
    pending = freeing or 0
    while allocator.num_free + pending < target:
        v = index.pop_l2_victim()
        if v is None:
            return
        later = back_up(v) if back_up is not None else None
        if later is None:
            allocator.free(index.drop_l2(v))
        elif ahead:
            pending += later


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
    backup_cancelled_pages: int = 0     # backups cancelled: their pages were computed on a failed load (R31)

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


#: best_effort: the longest wait for L3, as a fraction of the estimated time to recompute the hit's tokens
BEST_EFFORT_STALL_FRACTION = 0.05
#: best_effort: the shortest wait for L3 (seconds), whatever the estimates say
BEST_EFFORT_MIN_WAIT_S = 0.005
#: a synchronous L3 load's deadline is at most this many times ``sync_load_max_s`` (the forward waits for it)
SYNC_DEADLINE_FACTOR = 2.0


@dataclass
class LookupAnswer:
    """The controller's answer to one lookup (:meth:`Controller.lookup`): the request can load the leading
    ``pages`` pages of its path (from L2 only, or with ``is_async`` from L2 and L3: an asynchronous load)."""

    pages: int
    is_async: bool = False
    #: an L3 hit loaded synchronously: read and copied into L1 before the forward of the step that admits it
    #: (:meth:`Controller.load_sync`); ``is_async`` is then False
    sync: bool = False
    #: why the pages after ``pages`` are not a hit: ``(reason, end)`` segments in page order, each covering the pages
    #: from the previous segment's end (or ``pages``) to ``end``; a reason of :data:`MISS_REASONS`
    rest: list[tuple[str, int]] = field(default_factory=list)


#: why a lookup token did not become a hit, each a counter ``lookup_<reason>_tokens`` (docs/architecture.md §4):
#: ``miss`` in no tier (or known absent), ``declined_slow`` in L3 but loading was estimated slower than recomputing,
#: ``no_room`` no L2 staging slot for it, ``late`` its L3 read (or the existence answer) came after the deadline,
#: ``failed`` its read failed, was corrupt or its copy did not pass the checks, ``skipped`` the request's own
#: controls (``kv_transfer_params``) excluded it, ``aborted`` the request ended while its L3 load ran
MISS_REASONS = ("miss", "declined_slow", "no_room", "late", "failed", "skipped", "aborted")
#: the parts a lookup token can be served from
HIT_PARTS = ("l1", "l2", "l3")
#: upper bounds (seconds) of the reuse-distance histogram's buckets (and +Inf)
REUSE_BUCKETS_S = (1.0, 10.0, 60.0, 300.0, 1800.0, 3600.0, 14400.0, 86400.0)
_REUSE_BUCKET_LABELS = (*(f"{b:g}" for b in REUSE_BUCKETS_S), "+Inf")   # the stats file's ``le`` keys


class LookupStats:
    """Where the tokens of every counted lookup went, and how long pages waited in a tier for their hit.

    A request counts once, at its first admission: its page-aligned prefix (all but its last token) is split into
    :data:`HIT_PARTS` and :data:`MISS_REASONS`; the tokens of an L3 load are ``waiting`` until the load's outcome is
    known (which pages reached L1, and why the others did not). So ``sum(parts) + waiting`` is the lookup total.

    Reuse distance: seconds between a page's store in a tier (its L1 -> L2 save or its publication after a
    prefetch for L2; its confirmed backup for L3) and a hit on it there, one sample per page hit. L3 store times
    are kept for the latest ``max_l3_times`` backed-up pages only (pages of earlier backups, or stored by another
    engine, are not measured).

    Args:
        num_slots: L2 slots (one store time each).
        clock: monotonic seconds.
        max_samples: samples kept per tier between two :meth:`take_samples` calls (more are counted in the
            histogram but not shipped).
        max_l3_times: L3 store times kept.
    """

    def __init__(self, num_slots: int, clock: Callable[[], float] = time.monotonic, max_samples: int = 4096,
                 max_l3_times: int = 1 << 17):
        self.tokens = dict.fromkeys(HIT_PARTS + MISS_REASONS, 0)
        self.waiting = 0
        self.clock = clock
        self.l2_stored_at = array("d", [-1.0]) * num_slots  # 8 bytes per slot
        self.l3_stored_at: "OrderedDict[bytes, float]" = OrderedDict()
        self.max_l3_times = max_l3_times
        self.max_samples = max_samples
        self.samples: dict[str, list[float]] = {"L2": [], "L3": []}
        self.hist = {t: [0] * (len(REUSE_BUCKETS_S) + 1) for t in self.samples}
        self.hist_sum = dict.fromkeys(self.samples, 0.0)
        self._hist_view: Optional[dict] = None   # as_dict's histograms, built again only after a new sample

    def add(self, part: str, tokens: int) -> None:
        if tokens > 0:
            self.tokens[part] += tokens

    def stored_l2(self, slots: Sequence[int]) -> None:
        now = self.clock()
        for s in slots:
            if 0 <= s < len(self.l2_stored_at):
                self.l2_stored_at[s] = now

    def stored_l3(self, keys: Sequence[bytes]) -> None:
        now = self.clock()
        for k in keys:
            self.l3_stored_at[k] = now
            self.l3_stored_at.move_to_end(k)
        while len(self.l3_stored_at) > self.max_l3_times:
            self.l3_stored_at.popitem(last=False)

    def hit_l2(self, slots: Sequence[int]) -> None:
        """Pages in these L2 slots were hit now."""
        n = len(self.l2_stored_at)
        self._observe("L2", [self.l2_stored_at[s] for s in slots if 0 <= s < n])

    def hit_l3(self, keys: Sequence[bytes]) -> None:
        """Pages with these keys are read from L3 for a hit now."""
        self._observe("L3", [self.l3_stored_at.get(k, -1.0) for k in keys])

    def _observe(self, tier: str, times: list[float]) -> None:
        self._hist_view = None
        now = self.clock()
        buf, hist = self.samples[tier], self.hist[tier]
        for t in times:
            if t < 0:
                continue
            d = max(0.0, now - t)
            hist[next((i for i, b in enumerate(REUSE_BUCKETS_S) if d <= b), len(REUSE_BUCKETS_S))] += 1
            self.hist_sum[tier] += d
            if len(buf) < self.max_samples:
                buf.append(d)

    def take_samples(self) -> dict[str, list[float]]:
        """Reuse distances (seconds) observed since the last call, by tier (``L2``, ``L3``); tiers without one are
        left out."""
        out = {t: v for t, v in self.samples.items() if v}
        for t in out:
            self.samples[t] = []
        return out

    def as_dict(self) -> dict:
        d = {f"lookup_{k}_tokens": v for k, v in self.tokens.items()}
        d["lookup_waiting_tokens"] = self.waiting
        if self._hist_view is None:   # the stats file's cumulative form; unchanged in steps without a hit
            hist = {}
            for tier, counts in self.hist.items():
                cum, le = 0, {}
                for b, n in zip(_REUSE_BUCKET_LABELS, counts):
                    cum += n
                    le[b] = cum
                hist[tier] = {"count": cum, "sum": round(self.hist_sum[tier], 3), "le": le}
            self._hist_view = hist
        d["reuse_distance_seconds"] = self._hist_view
        return d


@dataclass
class _Outcome:
    """The counted admission of a request whose hit needs an L3 read: its tokens wait in :class:`LookupStats` until
    both the request side (which leading pages reached L1) and the job's report (which pages arrived) are known."""

    tokens: int
    job: Optional[Job] = None
    served: Optional[int] = None        # leading pages of the job copied into the request's blocks
    ok: Optional[list[bool]] = None     # the job's merged report
    cancelled: int = 0                  # of its pages to read, the last ones never read (request released first)
    request_failed: bool = False        # the workers named the whole request failed (several KV cache groups)


class _Ewma:
    """Exponentially weighted running average (weight ``alpha`` for each new sample; the first sample sets it) that
    remembers when it last got a sample (``clock`` seconds)."""

    def __init__(self, clock: Callable[[], float], alpha: float = 0.2):
        self.alpha = alpha
        self.clock = clock
        self.value: Optional[float] = None
        self.at: Optional[float] = None

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x
        self.at = self.clock()

    def age(self) -> float:
        """Seconds since the last sample (infinite without one)."""
        return float("inf") if self.at is None else self.clock() - self.at


class Controller:
    """Scheduler half of the controller for one engine (see the module docstring).

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
        clock: monotonic seconds.
        lookup_stats: the scheduler's :class:`LookupStats` (the controller resolves the outcome of L3 loads and
            records L3 store times into it); None = its own.
    Raises:
        ValueError: an unknown policy (naming the allowed ones), a deadline <= 0, world_size < 1.
    """

    def __init__(self, index: RadixIndex, allocator: SlotAllocator, *, page_size: int, world_size: int = 1,
                 write_policy: str = "write_through", write_through_threshold: int = 2,
                 prefetch_policy: str = "best_effort", prefetch_timeout_base_s: float = 0.5,
                 prefetch_timeout_per_page_s: float = 0.005, exists_wait_s: float = 1.0,
                 negative_ttl_s: float = 2.0, room_retry_steps: int = 8, room_wait_s: float = 0.5,
                 probe_interval_s: float = 5.0, sync_load_max_s: float = 0.02, exists_in_scheduler: bool = True,
                 exists_fn: Optional[Callable[[Sequence[bytes]], Optional[int]]] = None,
                 max_index_pages: int = 1 << 22, shutdown_drain_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic, lookup_stats: Optional[LookupStats] = None):
        if write_policy not in WRITE_POLICIES:
            raise ValueError(f"bad value {write_policy!r} for 'controller.write_policy': allowed values are "
                             f"{', '.join(WRITE_POLICIES)}")
        if prefetch_policy not in PREFETCH_POLICIES:
            raise ValueError(f"bad value {prefetch_policy!r} for 'controller.prefetch_policy': allowed values are "
                             f"{', '.join(PREFETCH_POLICIES)}")
        if prefetch_timeout_base_s <= 0:
            raise ValueError(f"bad value {prefetch_timeout_base_s!r} for 'controller.prefetch_timeout_base_s': "
                             "must be > 0 seconds")
        if sync_load_max_s < 0:
            raise ValueError(f"bad value {sync_load_max_s!r} for 'controller.sync_load_max_s': must be >= 0 seconds "
                             "(0: every L3 hit is loaded asynchronously)")
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
        self.prefetch_policy = prefetch_policy
        self.timeout_base_s = prefetch_timeout_base_s
        self.timeout_per_page_s = prefetch_timeout_per_page_s
        self.exists_wait_s = exists_wait_s
        self.negative_ttl_s = negative_ttl_s
        self.room_retry_steps = room_retry_steps
        self.room_wait_s = room_wait_s
        self.probe_interval_s = probe_interval_s
        self.sync_load_max_s = sync_load_max_s
        self.exists_in_scheduler = exists_in_scheduler
        self.exists_fn = exists_fn if exists_in_scheduler else None
        self.max_index_pages = max_index_pages
        self.shutdown_drain_s = shutdown_drain_s
        self.clock = clock
        self.counters = ControllerCounters()
        self._next_id = 1
        self._outbox: list[Job] = []
        self._jobs: dict[int, _JobState] = {}
        self._backing_up: set[bytes] = set()
        self._fetching: dict[bytes, int] = {}
        self._exists_pending: dict[bytes, int] = {}
        self._absent: "OrderedDict[bytes, float]" = OrderedDict()
        self._req_prefetch: dict[str, int] = {}   # request -> its prefetch job, until the job's report (I/O side)
        self._recv_open: set[str] = set()          # requests whose load the workers have not named as ended yet
        self._plans = 0                            # plans handed out (take_jobs): one per engine step
        self._released: dict[int, int] = {}        # prefetch job -> _plans when the workers released its request
        self._room_waits: dict[str, tuple[int, float]] = {}  # request -> (lookups waited, clock at the first)
        self.fetch_s_per_page = _Ewma(clock)
        self.prefill_s_per_token = _Ewma(clock)
        self.lookup_stats = lookup_stats if lookup_stats is not None else LookupStats(allocator.num_slots, clock)
        self._outcomes: dict[str, _Outcome] = {}  # request -> its counted L3 load, until its outcome is known

    # ------------------------------------------------------------------ plan / report plumbing
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

    # ------------------------------------------------------------------ backup
    def after_save(self, path: Sequence[bytes], start: int) -> None:
        """Pages ``path[start:]`` were just given L2 slots and saved (in this step's plan)."""
        if self.write_policy == "write_through" and start < len(path):
            self._backup(path, range(start, len(path)))

    def after_hit(self, path: Sequence[bytes], upto: int) -> None:
        """Pages ``path[:upto]`` were hit (matched and loaded or kept): under ``write_through_selective``, back up
        those whose node reached the hit threshold."""
        if self.write_policy != "write_through_selective" or upto <= 0:
            return
        due = [i for node, j, i in self.index.walk(path[:upto])
               if node.hit_count >= self.threshold and not node.in_l3[j] and node.host_slots[j] != NO_SLOT]
        if due:
            self._backup(path, due)

    def _backup(self, path: Sequence[bytes], idxs, victim: Optional[RadixNode] = None) -> bool:
        path = list(path)
        idxs = [i for i in idxs if path[i] not in self._backing_up]
        if not idxs:
            return False
        last = max(idxs) + 1
        m = self.index.match_prefix(path[:last], require_l2=False, split=True)
        idxs = [i for i in idxs if i < m.num_pages and m.host_slots[i] != NO_SLOT and not m.in_l3[i]]
        if not idxs:
            return False
        lock = self.index.lock(m.last_node)
        keys = [path[i] for i in idxs]
        self._backing_up.update(keys)
        job = Job(self._new_id(), JOB_BACKUP, keys, slots=[m.host_slots[i] for i in idxs])
        self._order(_JobState(job, lock=lock, path=path[: m.num_pages], idx=idxs, victim=victim))
        self.counters.backup_jobs += 1
        self.counters.backup_ordered_pages += len(keys)
        return True

    def _end_backup(self, st: _JobState, r: JobReport) -> None:
        if st.cancelled:  # cancel_backups released everything; its pages left the index
            return
        self._backing_up.difference_update(st.job.keys)
        flags = [False] * len(st.path)
        for i, ok in zip(st.idx, r.ok):
            flags[i] = ok
        self.index.set_in_l3(st.path, flags)
        for k, ok in zip(st.job.keys, r.ok):
            if ok:
                self._absent.pop(k, None)  # an earlier "absent" answer is stale now
        self.lookup_stats.stored_l3([k for k, ok in zip(st.job.keys, r.ok) if ok])
        stored = sum(r.ok)
        self.counters.backup_stored_pages += stored
        self.counters.backup_failed_pages += len(r.ok) - stored
        if st.lock is not None:
            self.index.unlock(st.lock)
        v = st.victim
        if v is not None and v.parent is not None and v.lock_ref == 0 and any(s != NO_SLOT for s in v.host_slots):
            # write_back: the eviction that started this backup goes on now; pages whose backup failed are
            # dropped with it, never marked as stored (R07)
            self.counters.write_back_dropped_pages += sum(1 for f in v.in_l3 if not f)
            self.allocator.free(self.index.drop_l2(v))

    def cancel_backups(self, keys: set[bytes]) -> None:
        """The pages ``keys`` are leaving the index because they were computed on a broken prefix (their saves were
        not made; docs/architecture.md §8 R31). A backup job whose pages are all among them is cancelled now: its
        lock is released and its report, when it comes (every page "not done": the worker does not send a page whose
        save was not made), changes nothing. A job that also holds other pages keeps running; those pages leave the
        index once it ended."""
        for st in self._jobs.values():
            if st.job.kind != JOB_BACKUP or st.cancelled or not set(st.job.keys) <= keys:
                continue
            st.cancelled = True
            self._backing_up.difference_update(st.job.keys)
            if st.lock is not None:
                self.index.unlock(st.lock)
                st.lock = None
            self.counters.backup_cancelled_pages += st.job.num_pages

    # ------------------------------------------------------------------ L2 room
    def make_room(self, need: int) -> int:
        """Free L2 slots until ``need`` are free or nothing more can go now (:func:`reclaim_l2`, with this
        controller's write-back rule: a victim with pages not yet in L3 is backed up first and freed when the store
        acknowledged it, later). Returns the number of free slots."""
        reclaim_l2(self.index, self.allocator, need, back_up=self._write_back_victim)
        return self.allocator.num_free

    def keep_free(self, target: int) -> None:
        """``write_back`` only: start backups of L2 victims ahead of need, so that about ``target`` slots are free
        or being freed (their backup acknowledged, they are dropped by the report). Without it every save or
        staging slot that needs room would wait a step for a backup. Victims already held by L3 are freed now."""
        if self.write_policy != "write_back":
            return
        freeing = sum(sum(1 for sl in st.victim.host_slots if sl != NO_SLOT)
                      for st in self._jobs.values() if st.victim is not None)
        reclaim_l2(self.index, self.allocator, target, back_up=self._write_back_victim, freeing=freeing)

    def _write_back_victim(self, v: RadixNode) -> Optional[int]:
        """:func:`reclaim_l2`'s ``back_up`` under ``write_back``: back up the victim's pages L3 lacks and keep its L2
        copy until the report; returns how many of its slots that will free, or None (nothing to back up, another
        policy, or the backup could not start: drop it now)."""
        missing = [j for j, f in enumerate(v.in_l3) if not f]
        if self.write_policy != "write_back" or not missing:
            return None
        path = self.index.path_keys(v)
        off = len(path) - v.num_pages
        if not self._backup(path, [off + j for j in missing], victim=v):
            return None
        self.counters.write_back_pages += len(missing)
        return sum(1 for sl in v.host_slots if sl != NO_SLOT)

    def room_possible(self, need: int) -> bool:
        """Whether ``need`` slots can be had now: free slots plus L2 copies on unlocked nodes (an unlocked node's
        whole subtree is unlocked, so :meth:`make_room` reaches every one of them). O(1), no side effect. Pages a
        running prefetch locks but has not fetched yet are L3-only (no L2 copy) and hide nothing."""
        return self.allocator.num_free + max(0, self.index.l2_pages - self.index.locked_l2_pages) >= need

    # ------------------------------------------------------------------ existence
    def _is_absent(self, key: bytes) -> bool:
        exp = self._absent.get(key)
        if exp is None:
            return False
        if exp < self.clock():
            del self._absent[key]
            return False
        return True

    def _mark_absent(self, key: bytes) -> None:
        self._absent[key] = self.clock() + self.negative_ttl_s
        self._absent.move_to_end(key)
        while len(self._absent) > 65536:
            self._absent.popitem(last=False)

    def usable_pages(self, path: Sequence[bytes], m_host_slots: Sequence[int], m_in_l3: Sequence[bool]) -> int:
        """Leading pages of a ``require_l2=False`` match that can be loaded: in L2, or in L3 and not known bad."""
        for i, (s, f) in enumerate(zip(m_host_slots, m_in_l3)):
            if s == NO_SLOT and (not f or self._is_absent(path[i])):
                return i
        return len(m_host_slots)

    def fetch_state(self, keys: Sequence[bytes], req_id: str) -> tuple[int, bool]:
        """``(i, wait)``: ``keys[i]`` is the first key a running prefetch is fetching (``len(keys)`` if none), and
        whether ``req_id`` should wait for that fetch (it belongs to another request and is within its deadline).
        A request never waits for its own earlier fetch (vLLM asks again after the worker released it at its
        deadline) nor for one past its deadline: those pages are simply not offered. "Its deadline" is the job's
        first one (``deadline_s`` from the order): the worker may move it later as pages arrive
        (``deadline_credit_s``), but the scheduler does not see that progress, so a request sharing pages with a
        slow but progressing fetch stops waiting at the first deadline and recomputes them; waiting to the credited
        bound instead would let a stalled fetch hold the second request up to a whole recompute."""
        now = self.clock()
        for i, k in enumerate(keys):
            jid = self._fetching.get(k)
            if jid is None:
                continue
            st = self._jobs.get(jid)
            wait = (st is not None and st.job.req_id != req_id
                    and (st.job.deadline_s is None or now - st.t0 <= st.job.deadline_s))
            return i, wait
        return len(keys), False

    def l3_extend(self, path: Sequence[bytes], start: int) -> Optional[int]:
        """How many pages after ``path[:start]`` (indexed) are in L3 beyond what the index knows: 0 when known
        absent or when the answer is overdue, None while an existence query is pending (one is started if none
        is)."""
        if start >= len(path) or self._is_absent(path[start]):
            return 0
        first = path[start]
        if self.exists_fn is not None and first not in self._exists_pending:
            n = self._exists_here(path, start)
            if n is not None:
                return n
        jid = self._exists_pending.get(first)
        if jid is not None:
            st = self._jobs.get(jid)
            if st is not None and self.clock() - st.t0 > self.exists_wait_s:
                self.counters.exists_late_answers += 1
                return 0
            return None
        job = Job(self._new_id(), JOB_EXISTS, list(path[start:]))
        self._exists_pending[first] = job.job_id
        self._order(_JobState(job, path=list(path[:start])))
        self.counters.exists_queries += 1
        return None

    def _exists_here(self, path: Sequence[bytes], start: int) -> Optional[int]:
        """Ask ``exists_fn`` about ``path[start:]``; index what it found. None when it could not answer."""
        try:
            n = self.exists_fn(list(path[start:]))
        except Exception as e:  # the workers answer instead
            _rate_limited.warning("exists_here", "tierkv: existence check in the scheduler failed (%r); asking the "
                                  "workers", e)
            return None
        if n is None:
            return None
        self.counters.exists_queries += 1
        self.counters.exists_local_queries += 1
        self._found(path[:start], list(path[start:]), n)
        return n

    def _end_exists(self, st: _JobState, r: JobReport) -> None:
        keys = st.job.keys
        self._exists_pending.pop(keys[0], None)
        self._found(st.path, keys, r.leading)

    def _found(self, prefix: list, keys: list, n: int) -> None:
        """``keys[:n]`` (after the indexed ``prefix``) are in L3, ``keys[n]`` is not: remember the absent page and
        index the found ones as L3-only."""
        if n < len(keys):
            self._mark_absent(keys[n])
        if n == 0:
            return
        self.counters.exists_found_pages += n
        start = len(prefix)
        m = self.index.match_prefix(prefix, require_l2=False)
        if m.num_pages < start:
            return  # the prefix left the index meanwhile: a later lookup asks again
        self.index.insert(list(prefix) + keys[:n], [NO_SLOT] * n, in_l3=[True] * n, start=start)
        if self.index.total_pages > self.max_index_pages:
            excess = self.index.total_pages - self.max_index_pages
            self.counters.index_l3_evicted_pages += self.index.evict_l3_only(excess + self.max_index_pages // 16)

    # ------------------------------------------------------------------ lookup
    def lookup(self, req_id: str, keys: Sequence[bytes], l2_run: int, first: int) -> Optional[LookupAnswer]:
        """How much of ``keys`` (the request's full pages that may count, at most all but its last token) request
        ``req_id`` can load, given that ``keys[:l2_run]`` have L2 copies and ``keys[:first]`` are in L1 already.
        None = not known yet (another request is fetching these pages, an existence answer or L2 staging room is
        pending): vLLM asks again next step. Counts the deferred lookups and the hits declined as slow."""
        m = self.index.match_prefix(keys, require_l2=False)
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
        if not self.worth_loading(fetch):
            self.counters.l3_declined_slow_pages += fetch
            return LookupAnswer(l2_run, rest=[("declined_slow", avail)] + rest)
        room = self.wait_for_room(req_id, fetch)
        if room is None:
            self.counters.lookups_deferred += 1
            return None
        if not room:
            return LookupAnswer(l2_run, rest=[("no_room", avail)] + rest)
        if self.load_sync(fetch):
            return LookupAnswer(avail, sync=True, rest=rest)
        return LookupAnswer(avail, is_async=True, rest=rest)

    # ------------------------------------------------------------------ prefetch
    def worth_loading(self, fetch_pages: int) -> bool:
        """False when fetching ``fetch_pages`` pages from L3 is estimated to take longer than recomputing them: by
        the fetch estimate (a stale one lets one probe through per ``probe_interval_s``), or by a read still running
        after its request was released (:meth:`overdue_s_per_page`; no probe then)."""
        per_page, per_token = self.fetch_s_per_page.value, self.prefill_s_per_token.value
        if fetch_pages <= 0 or per_token is None:
            return True
        if self._released and self.overdue_s_per_page() > self.page_size * per_token:
            return False
        if per_page is None or per_page <= self.page_size * per_token:
            return True
        if self.fetch_s_per_page.age() > self.probe_interval_s:  # stale: this hit reads, and refreshes it
            self.fetch_s_per_page.at = self.clock()  # one probe per interval, not one per waiting request
            self.counters.l3_probe_hits += 1
            return True
        return False

    def overdue_s_per_page(self) -> float:
        """A lower bound on the store's seconds per page read, from prefetches whose request the workers released
        (named its load ended at its deadline) while the read went on, or synchronous loads (whose request side ends
        within the step of their plan, at the latest at their deadline), and which a later step's output still did
        not report: such a read of n pages has taken longer than its time so far (from its order), so each of its pages
        takes more than that time / n. The largest over those reads; 0.0 when there is none. A read that ended in
        time reports with its request's release; one that ended after the release but within the next step
        reports with that step's output, so it is not counted before that output was seen (a long step would
        otherwise pass for a slow store)."""
        now, floor = self.clock(), 0.0
        for jid, released in list(self._released.items()):
            st = self._jobs.get(jid)
            if st is None:
                del self._released[jid]
                continue
            if self._plans <= released:
                continue
            need = sum(st.job.fetch)
            if need:
                floor = max(floor, (now - st.t0) / need)
        return floor

    def load_sync(self, fetch_pages: int) -> bool:
        """Whether an L3 hit that reads ``fetch_pages`` pages is loaded synchronously: the worker reads them and
        copies them into L1 before the forward of the step that admits the request, which then computes its other
        tokens in that same step, like an L2 hit. True when the store's fetch estimate (seconds per page, measured
        from the start of each read) puts the read at most ``sync_load_max_s``, and the policy bounds the wait
        (not ``wait_complete``). The forward of every request of that step waits for the read, at most
        :meth:`sync_deadline_s`; an asynchronous load instead costs the hit's request one engine step more
        (docs/architecture.md §4). Without an estimate yet (the first reads of a store) the load is asynchronous."""
        per_page = self.fetch_s_per_page.value
        return (self.sync_load_max_s > 0 and self.prefetch_policy != "wait_complete" and per_page is not None
                and fetch_pages * per_page <= self.sync_load_max_s)

    def sync_deadline_s(self, fetch_pages: int) -> float:
        """Deadline (seconds from the start of the read) of a synchronous load of ``fetch_pages`` pages: the policy's
        deadline, at most :data:`SYNC_DEADLINE_FACTOR` x ``sync_load_max_s``; the credit for pages that arrive
        (:meth:`deadline_credit_s`) moves it at most to that cap too, since every request of the step waits for it.
        Pages not read by then are recomputed (reported as failed blocks); they still land in L2."""
        d = self.deadline_s(fetch_pages)
        cap = SYNC_DEADLINE_FACTOR * self.sync_load_max_s
        return cap if d is None else min(d, cap)

    def fetches_for(self, req_id: str, key: bytes) -> bool:
        """Whether the running prefetch of request ``req_id`` reads page ``key`` into a staging slot (published by
        the job's report)."""
        jid = self._fetching.get(key)
        return jid is not None and self._req_prefetch.get(req_id) == jid

    def wait_for_room(self, req_id: str, fetch_pages: int) -> Optional[bool]:
        """Whether a request whose L3 hit needs ``fetch_pages`` staging slots can go ahead (True), should wait a
        step (None), or must give up its L3 hit (False, once it waited ``room_retry_steps`` lookups and
        ``room_wait_s`` seconds: on an engine that loops fast, lookups alone would run out in milliseconds). Under
        ``best_effort`` with a recompute estimate the wait for room is part of the same stall budget as the wait for
        the read (:meth:`deadline_s`): it gives up after one retry once that budget is spent, so a job stuck on a
        stalled store, which keeps its staging slots, does not make every later hit wait ``room_wait_s``."""
        if self.write_policy == "write_back" and self.allocator.num_free < fetch_pages:
            # an L2 copy L3 does not hold yet frees its slot only once its backup is acknowledged: start those
            # backups now (and free what L3 already holds), and go ahead once the slots are really free, so that the
            # prefetch gets a staging slot for every page instead of failing the ones it could not have
            self.make_room(fetch_pages)
            if self.allocator.num_free >= fetch_pages:
                self._room_waits.pop(req_id, None)
                return True
        elif self.room_possible(fetch_pages):
            self._room_waits.pop(req_id, None)
            return True
        now = self.clock()
        n, t0 = self._room_waits.get(req_id, (0, now))
        n += 1
        steps, wait_s = self.room_retry_steps, self.room_wait_s
        if self.prefetch_policy == "best_effort" and self.prefill_s_per_token.value is not None:
            steps, wait_s = min(steps, 1), min(wait_s, self.deadline_s(fetch_pages))
        if n > steps and now - t0 >= wait_s:
            self._room_waits.pop(req_id, None)
            self.counters.l3_declined_room_pages += fetch_pages
            return False
        self._room_waits[req_id] = (n, t0)
        return None

    def deadline_credit_s(self) -> float:
        """Seconds a ``best_effort`` prefetch's deadline moves later for each page read from L3 that extends its
        leading intact run: the estimated time to recompute one page. The time a request waits is then always paid
        for by the pages that arrived: released at any moment, it recomputes only the pages not read yet, so a hit
        costs at most its first wait (:meth:`deadline_s`) plus recomputing, however slow the store, and a read that
        keeps ahead of recomputing is never cut short. 0.0 (a fixed deadline) under the other policies and until a
        recompute estimate exists."""
        per_token = self.prefill_s_per_token.value
        if self.prefetch_policy != "best_effort" or per_token is None:
            return 0.0
        return per_token * self.page_size

    def deadline_s(self, fetch_pages: int) -> Optional[float]:
        """Seconds a prefetch of ``fetch_pages`` L3 pages may run before its request is released (from the read's
        start; None = until it ends, ``wait_complete``). ``best_effort``: at most :data:`BEST_EFFORT_STALL_FRACTION`
        of the estimated recompute time and 3 x the estimated fetch time, at least :data:`BEST_EFFORT_MIN_WAIT_S`,
        then moved later by :meth:`deadline_credit_s` per page that arrives; ``timeout``'s deadline, capped the same
        way, until a recompute estimate exists."""
        if self.prefetch_policy == "wait_complete":
            return None
        base = self.timeout_base_s + self.timeout_per_page_s * fetch_pages
        per_token = self.prefill_s_per_token.value
        if self.prefetch_policy != "best_effort" or per_token is None:
            return base
        wait = BEST_EFFORT_STALL_FRACTION * per_token * fetch_pages * self.page_size
        if self.fetch_s_per_page.value is not None:
            wait = min(wait, 3.0 * self.fetch_s_per_page.value * fetch_pages)
        else:
            wait = min(wait, base)
        return max(wait, BEST_EFFORT_MIN_WAIT_S)

    def start_prefetch(self, req_id: str, path: Sequence[bytes], first: int, last: int,
                       block_ids: Sequence[int], blocks_per_page: int = 1, skip_blocks: int = 0,
                       groups: Sequence[Sequence[int]] = (), sync: bool = False) -> Job:
        """Order the load (``sync``: before this step's forward, :meth:`load_sync`; else asynchronous) of pages
        ``path[first:last]`` into ``block_ids`` (``blocks_per_page`` per page, less the first ``skip_blocks`` blocks
        of page ``first``, which the engine holds in L1; ``groups``: the same blocks per KV cache group of a hybrid
        model, :class:`~tierkv.connector.core.plan.Job`). Pages without an L2 copy get staging slots (evicting others if
        needed); the path is locked until the report. Pages for which no slot could be had are in the job with slot
        -1: the worker reports them as load errors."""
        path = list(path[:last])
        m = self.index.match_prefix(path, require_l2=False, split=True, touch=True)
        if m.num_pages < last:
            raise RuntimeError(f"{req_id}: promised {last} pages but only {m.num_pages} are indexed")
        lock = self.index.lock(m.last_node)
        slots = list(m.host_slots[first:last])
        fetch = [s == NO_SLOT for s in slots]
        need = sum(fetch)
        if need:
            self.make_room(need)
            got = self.allocator.alloc(min(need, self.allocator.num_free)) or []
            it = iter(got)
            for i, f in enumerate(fetch):
                if f:
                    slots[i] = next(it, NO_SLOT)
            short = need - len(got)
            if short:
                self.counters.prefetch_no_room_pages += short
        credit = self.deadline_credit_s() if need else 0.0
        job = Job(self._new_id(), JOB_PREFETCH, path[first:last], slots=slots, block_ids=list(block_ids),
                  fetch=fetch, req_id=req_id,
                  deadline_s=self.sync_deadline_s(need) if sync else self.deadline_s(need),
                  deadline_credit_s=credit,
                  deadline_max_s=SYNC_DEADLINE_FACTOR * self.sync_load_max_s if sync and credit else None,
                  blocks_per_page=blocks_per_page, skip_blocks=skip_blocks, groups=[list(g) for g in groups],
                  sync=sync)
        for k, f, s in zip(job.keys, fetch, slots):
            if f and s != NO_SLOT:
                self._fetching[k] = job.job_id
        self._req_prefetch[req_id] = job.job_id
        if not sync:  # a synchronous load's request side ends within its step: vLLM never delays its free
            self._recv_open.add(req_id)
        else:  # ... so its read, if it goes on past that step (its blocks failed at the deadline), is overdue
            self._released[job.job_id] = self._plans + 1
        self.lookup_stats.hit_l2([s for s, f in zip(slots, fetch) if not f])
        self.lookup_stats.hit_l3([k for k, f in zip(job.keys, fetch) if f])
        o = self._outcomes.get(req_id)
        if o is not None and o.job is None:
            o.job = job
        self._order(_JobState(job, lock=lock, path=path, idx=list(range(first, last))))
        self.counters.prefetch_jobs += 1
        self.counters.prefetch_sync_jobs += sync
        self.counters.prefetch_ordered_pages += need
        self.counters.l3_hit_tokens += (last - first) * self.page_size
        return job

    def _end_prefetch(self, st: _JobState, r: JobReport) -> None:
        job = st.job
        self._released.pop(job.job_id, None)
        if self._req_prefetch.get(job.req_id) == job.job_id:
            del self._req_prefetch[job.req_id]
        for k in job.keys:
            if self._fetching.get(k) == job.job_id:
                del self._fetching[k]
        fetched = [i for i, f in enumerate(job.fetch) if f and job.slots[i] != NO_SLOT]
        lead = r.leading  # only the leading run of intact pages is published; the rest is released
        ok_idx = [i for i in fetched if i < lead]
        bad_idx = [i for i in fetched if i >= lead]
        if ok_idx and r.seconds > 0 and not r.cold:  # a cold read times the client's set-up, not the store
            self.fetch_s_per_page.add(r.seconds / len(ok_idx))
        self.counters.prefetch_loaded_pages += len(ok_idx)
        # pages a rank never read (its request was released first) are not failures of the store
        self.counters.prefetch_failed_pages += max(0, sum(1 for i in bad_idx if not r.ok[i]) - r.cancelled)
        self.counters.prefetch_cancelled_pages += r.cancelled
        first = st.idx[0] if st.idx else 0
        # publish the pages that arrived intact (the path is locked, so every page is still indexed)
        if ok_idx:
            self.lookup_stats.stored_l2([job.slots[i] for i in ok_idx])
            ok_set = set(ok_idx)
            last = first + max(ok_idx) + 1
            slots = [job.slots[i] if i in ok_set else NO_SLOT for i in range(last - first)]
            _node, dups = self.index.insert(st.path[:last], slots,
                                            in_l3=[i in ok_set for i in range(last - first)], start=first)
            if dups:
                self.allocator.free(dups)
        if bad_idx:
            self.allocator.free([job.slots[i] for i in bad_idx])
        if st.lock is not None:
            self.index.unlock(st.lock)
        failed = [first + i for i in bad_idx if not r.ok[i]]
        if failed:
            # missing or corrupt in L3: not asked for again soon, and no longer taken for stored, so the recomputed
            # page is backed up again (it may already be back in L2, saved by the request that recomputed it)
            for i in bad_idx:
                if not r.ok[i]:
                    self._mark_absent(job.keys[i])
            freed = self.index.clear_l3(st.path, failed)
            if freed:
                self.allocator.free(freed)
            self.after_save(st.path, 0)  # write_through: back up again what is in L2 and no longer in L3
        o = self._outcomes.get(job.req_id)
        if o is not None and o.job is not None and o.job.job_id == job.job_id:
            o.ok, o.cancelled = list(r.ok), r.cancelled
            if job.sync:  # its request side ended before the step's forward: what every rank copied into L1
                o.served = min(r.served or 0, job.num_pages)
            self._resolve(job.req_id)

    def staging_slots(self) -> list[int]:
        """Slots held by running prefetches for pages not yet published into the index."""
        return [s for st in self._jobs.values() if st.job.kind == JOB_PREFETCH
                for s, f in zip(st.job.slots, st.job.fetch) if f and s != NO_SLOT]

    def request_side_open(self, req_id: str) -> bool:
        """Whether the workers have not yet named ``req_id``'s load as ended (vLLM's ``finished_recving``). Only
        then must the engine keep the request's blocks when it finishes: once the load was named ended the workers
        never touch its blocks again (a deadline release copies nothing later), and they will not name it a second
        time, so a delayed free would never end. The I/O side (the job, until its report) pins only L2 staging
        slots, which its report frees."""
        return req_id in self._recv_open

    def on_finished_recving(self, req_ids, invalid_block_ids=(), failed_req_ids=()) -> None:
        """The requests the workers named as having ended their load in a step (every rank agreed), with the blocks
        whose load failed in that step (vLLM's ``invalid_block_ids``, delivered with the same output) and the
        requests whose load failed as a whole (vLLM's ``failed_recving``: a model of several KV cache groups, whose
        failed loads cannot be named by block; vLLM recomputes such a request from its first token)."""
        self._recv_open.difference_update(req_ids)
        for rid in req_ids:
            jid = self._req_prefetch.get(rid)
            if jid is not None:  # released while its read goes on (the job reports separately)
                self._released[jid] = self._plans
        bad = set(invalid_block_ids or ())
        failed = set(failed_req_ids or ())
        for rid in req_ids:
            o = self._outcomes.get(rid)
            if o is not None and o.job is not None and o.served is None:
                if rid in failed:
                    o.served, o.request_failed = 0, True
                else:
                    o.served = next((o.job.page_of_block(i) for i, b in enumerate(o.job.block_ids) if b in bad),
                                    o.job.num_pages)
                self._resolve(rid)

    # ------------------------------------------------------------------ outcome of counted L3 loads
    def expect_outcome(self, req_id: str, tokens: int) -> None:
        """The counted admission of ``req_id`` takes ``tokens`` through an L3 load (ordered next by
        :meth:`start_prefetch`): they wait in :attr:`lookup_stats` until the load's outcome is known."""
        self._outcomes[req_id] = _Outcome(tokens)
        self.lookup_stats.waiting += tokens

    def outcome_failed(self, req_id: str) -> None:
        """The load expected for ``req_id`` could not be ordered: its tokens were not served (``failed``)."""
        o = self._outcomes.get(req_id)
        if o is not None and o.job is None:
            del self._outcomes[req_id]
            self.lookup_stats.waiting -= o.tokens
            self.lookup_stats.add("failed", o.tokens)

    def _resolve(self, req_id: str) -> None:
        """Split a counted L3 load's tokens once both sides are known: the leading pages copied into L1 by the tier
        they came from (already in L2, or read from L3), the rest by why the first of them was not: no staging slot
        (``no_room``), arrived intact after the request was released or never read because it was released first
        (``late``), else ``failed``. A request failed as a whole (several KV cache groups) had nothing served: all
        its tokens go to the reason of its first page to read that did not arrive intact in time (``late`` when
        every read page arrived intact, the request having been released first; ``failed`` when no page was to be
        read, i.e. an L2 page failed its check)."""
        o = self._outcomes.get(req_id)
        if o is None or o.job is None or o.served is None or o.ok is None:
            return
        del self._outcomes[req_id]
        ls, job, ps = self.lookup_stats, o.job, self.page_size
        ls.waiting -= o.tokens
        served = min(o.served, job.num_pages, o.tokens // ps)
        from_l3 = sum(1 for f in job.fetch[:served] if f)
        ls.add("l3", from_l3 * ps)
        ls.add("l2", (served - from_l3) * ps)
        if served < job.num_pages:
            f = served
            to_read = [i for i in range(job.num_pages) if job.fetch[i] and job.slots[i] != NO_SLOT]
            never_read = set(to_read[len(to_read) - o.cancelled:]) if o.cancelled else set()
            if o.request_failed:  # nothing served; the reason is that of the first page to read that did not arrive
                fetched = [i for i in range(job.num_pages) if job.fetch[i]]
                f = next((i for i in fetched if job.slots[i] == NO_SLOT or not o.ok[i] or i in never_read),
                         fetched[0] if fetched else 0)
            reason = ("no_room" if job.fetch[f] and job.slots[f] == NO_SLOT
                      else "late" if job.fetch[f] and (o.ok[f] or f in never_read) else "failed")
            ls.add(reason, o.tokens - served * ps)

    def forget_request(self, req_id: str) -> None:
        self._room_waits.pop(req_id, None)

    def end_request(self, req_id: str) -> bool:
        """``req_id`` finished (or was aborted): returns whether the engine must keep its blocks until the workers
        name its load as ended (see :meth:`request_side_open`)."""
        self.forget_request(req_id)
        o = self._outcomes.get(req_id)
        # ended before its load did: nothing reached its blocks. A synchronous load ended within its step; its job's
        # report (which may come later, if the read outlived the deadline) says what was served
        if o is not None and o.served is None and not (o.job is not None and o.job.sync):
            del self._outcomes[req_id]
            self.lookup_stats.waiting -= o.tokens
            self.lookup_stats.add("aborted", o.tokens)
        open_ = req_id in self._recv_open
        if open_ and req_id not in self._req_prefetch:  # cannot stay open without a job: never delay for nothing
            self._recv_open.discard(req_id)
            return False
        return open_

    # ------------------------------------------------------------------ estimates
    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """One engine step that computed ``tokens`` prompt tokens in ``seconds``: updates the recompute estimate."""
        if tokens > 0 and seconds > 0:
            self.prefill_s_per_token.add(seconds / tokens)

    def stats(self) -> dict:
        d = self.counters.as_dict()
        d.update(ctl_pending_jobs=self.pending_jobs(), ctl_backing_up_pages=len(self._backing_up),
                 ctl_fetching_pages=len(self._fetching),
                 ctl_fetch_ms_per_page=None if self.fetch_s_per_page.value is None
                 else 1e3 * self.fetch_s_per_page.value,
                 ctl_prefill_us_per_token=None if self.prefill_s_per_token.value is None
                 else 1e6 * self.prefill_s_per_token.value)
        return d
