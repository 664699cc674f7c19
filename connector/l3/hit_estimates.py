"""Hit estimates of the controller: is an L3 hit faster than recomputing it?

Running estimates (EWMA) of the seconds per fetched page (from prefetch reports, timed from the start of each read;
not from a rank's first, cold reads, which also time the store client's set-up) and of the engine's prefill seconds
per token (forward time of steps that computed prompt tokens). An L3 hit whose estimated load time exceeds the
recompute time of its tokens is declined (``l3_declined_slow_pages``); no estimate yet = no decline. A stale fetch
estimate (older than ``probe_interval_s``) lets the next hit go ahead as a probe, whose read's time replaces it (blended
in, one slow read would keep declining hits for several probe intervals). A read still running after its
request was released bounds the store's seconds per page from below (:meth:`HitEstimates.overdue_s_per_page`).
"""
from __future__ import annotations

from typing import Callable, Optional


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


class HitEstimates:
    """Mixin of :class:`~tierkv.connector.l3.controller.Controller`: the decline-slow-hits decision from the
    ``fetch_s_per_page`` and ``prefill_s_per_token`` estimates (:class:`_Ewma`)."""

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

    def observe_prefill(self, seconds: float, tokens: int) -> None:
        """One engine step that computed ``tokens`` prompt tokens in ``seconds``: updates the recompute estimate."""
        if tokens > 0 and seconds > 0:
            self.prefill_s_per_token.add(seconds / tokens)
