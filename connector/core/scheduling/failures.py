"""What a failed L2 -> L1 load takes out of the index, and when.

vLLM reports the engine blocks whose load failed with the output of the step that ran it (``invalid_block_ids``),
or, for a hybrid model, the requests whose load failed as a whole (``failed_recving``). Such a request computed
its later pages on a broken prefix, and vLLM rolls it back and recomputes them. So its pages from the first failed
one on leave the index (with their L2 slots) as soon as nothing holds them locked, backups of pages its workers
never saved are cancelled, its lock moves back to the intact prefix, and the next plan names it in
``StepPlan.recomputed`` so the workers save its pages again. A request's load record (:class:`RequestState` ``load``
and ``saved``) is kept for :data:`LOAD_FAILURE_WINDOW` steps after the load's plan.
"""
from __future__ import annotations

import logging
from typing import Optional

from tierkv.connector.core.plan import StepPlan
from tierkv.connector.core.radix_index import RadixIndex
from .state import LOAD_FAILURE_WINDOW, RequestState, SchedulerCounters

logger = logging.getLogger("tierkv.scheduler")


def note_save(st: RequestState, step: int, start: int, end: int) -> None:
    """The request's pages ``[start, end)`` were ordered saved in the plan after ``step``: remembered while a failure
    of its last load could still be reported (that failure drops them too), its load record forgotten after."""
    if st.load is not None:
        if step + 1 - st.load[0] > LOAD_FAILURE_WINDOW:
            st.load, st.saved = None, []
        else:
            st.saved.append((start, end))


class LoadFailures:
    """Failed L2 -> L1 loads: their pages leave the index, at once or once nothing holds them locked.

    Args:
        index: the scheduler's radix index; allocator: its L2 slot allocator (freed slots go back there);
        counters: the scheduler's counters; ctl: the L3 controller or None; blocks_per_page: engine blocks per page.
    """

    def __init__(self, index: RadixIndex, allocator, counters: SchedulerCounters, ctl, blocks_per_page: int):
        self.index = index
        self.allocator = allocator
        self.counters = counters
        self.ctl = ctl
        self.blocks_per_page = blocks_per_page
        self.drops: list[list[bytes]] = []  # paths whose last page must leave the index once nothing there is locked

    def on_load_errors(self, requests, invalid_block_ids, plan: StepPlan) -> None:
        """Engine blocks whose load failed in a step: every live request (``requests``: id -> state) whose last
        L2 -> L1 load names one of them fails from its first such block. Blocks of asynchronous (L3) loads are
        ignored: such a request computes nothing before its load ended."""
        bad = set(invalid_block_ids or ())
        if bad:
            for st in requests.values():
                if st.load is not None and not bad.isdisjoint(st.load[1]):
                    self.load_failed(st, bad, plan)
        if self.drops:
            self.retry_drops()

    def on_failed_loads(self, requests, req_ids, plan: StepPlan) -> None:
        """Hybrid models: requests whose load failed as a whole; an L2 load fails from its first loaded page."""
        for rid in req_ids or ():
            st: Optional[RequestState] = requests.get(rid)
            if st is not None and st.load is not None and st.load[1]:
                self.load_failed(st, {st.load[1][0]}, plan)
        if self.drops:
            self.retry_drops()

    def load_failed(self, st: RequestState, bad: set[int], plan: StepPlan) -> None:
        _step, blocks, first_block = st.load
        f = (first_block + next(i for i, b in enumerate(blocks) if b in bad)) // self.blocks_per_page
        # an L2 page that failed its check leaves the index from there; the pages of a synchronous L3 load are
        # settled by its job's report (those that arrived late are intact in L2), only the request's later saves go
        drop = f if st.load_l3_end is None else max(f, st.load_l3_end)
        st.load, saved, st.saved = None, st.saved, []
        self.counters.load_failed_requests += 1
        plan.recomputed.append(st.req_id)
        keys = st.keys.extend(st.tokens)
        if st.lock is not None:
            self.index.unlock(st.lock)
            st.lock = None
        if f > 0:
            m = self.index.match_prefix(keys[:f], require_l2=False, split=True)
            if m.last_node is not self.index.root:
                st.lock = self.index.lock(m.last_node)
        if self.ctl is not None and saved:  # backups of pages whose save the workers did not make
            self.ctl.cancel_backups({k for a, b in saved for k in keys[a:b]})
        for i in [drop] + [a for a, _b in saved if a > drop]:
            if i < len(keys):
                self.drops.append(keys[: i + 1])
        st.num_indexed = min(st.num_indexed, f)
        logger.info("tierkv: %s: L2 -> L1 load failed from page %d; its pages from there on leave the index and are "
                    "saved again once recomputed", st.req_id, f)

    def retry_drops(self) -> None:
        """Remove the pages queued by :meth:`load_failed` where nothing holds them locked any more."""
        left = []
        for path in self.drops:
            freed = self.index.remove_from(path, len(path) - 1)
            if freed is None:
                left.append(path)
                continue
            if freed:
                self.allocator.free(freed)
                self.counters.load_failed_dropped_pages += len(freed)
        self.drops = left
