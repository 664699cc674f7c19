"""Lookup accounting of the controller: the answer to a lookup, where every looked-up token went, reuse distances,
and the outcome of counted L3 loads.

A request counts once, at its first admission; the tokens of an L3 load wait (``waiting``) until both the request
side (which leading pages reached L1) and the job's report (which pages arrived) are known, then go to a hit part
(:data:`HIT_PARTS`) or a miss reason (:data:`MISS_REASONS`).
"""
from __future__ import annotations

import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

from tierkv.connector.core.plan import Job
from tierkv.connector.core.radix_index import NO_SLOT


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


#: why a lookup token did not become a hit, each a counter ``lookup_<reason>_tokens``:
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


class OutcomeTracking:
    """Mixin of :class:`~tierkv.connector.l3.controller.Controller`: resolves the tokens of counted L3 loads
    (``_outcomes``) into :attr:`lookup_stats`."""

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
