"""Load orders: what the scheduler side orders for a request the engine allocated blocks for.

An L2 hit locks the matched path of the radix index (until the request is released) and appends a
:class:`~tierkv.connector.core.plan.PageOrder` (L2 slots -> L1 blocks) to the plan being built, skipping the blocks
of its first page the engine already holds in L1. An L3 hit has the controller start a prefetch job instead (read
before the step's forward when synchronous, else awaited across steps). Either way the request's load record is
kept so a failed load can be rolled back (:mod:`.failures`). When the hook raised, :meth:`LoadPlanner.alloc_failed`
has the next plan report the promised blocks as failed loads, so the engine recomputes them.
"""
from __future__ import annotations

from typing import Optional, Sequence

from tierkv.connector.core.plan import PageOrder, StepPlan
from tierkv.connector.core.radix_index import RadixIndex
from tierkv.connector.l3.controller import LookupStats
from .state import RequestState, SchedulerCounters


class LoadPlanner:
    """Load orders (L2 -> L1) and L3 prefetches of admitted requests.

    Args:
        index, counters, lookup_stats, ctl: the scheduler's radix index, counters, lookup statistics and L3
            controller (None without L3).
        page_size: tokens per page; block_size: the engine's block size in tokens.
    """

    def __init__(self, index: RadixIndex, counters: SchedulerCounters, lookup_stats: LookupStats, ctl,
                 page_size: int, block_size: int):
        self.index = index
        self.counters = counters
        self.lookup_stats = lookup_stats
        self.ctl = ctl
        self.page_size = page_size
        self.block_size = block_size
        self.blocks_per_page = page_size // block_size

    def order(self, st: RequestState, plan: StepPlan, step: int, l3_since: dict[str, int], block_ids: Sequence[int],
              num_external_tokens: int, groups: Optional[Sequence[Sequence[int]]] = None) -> None:
        """The engine allocated ``block_ids`` for ``st`` and takes ``num_external_tokens`` from us: order the load
        into ``plan`` (built after ``step`` plans) or start the L3 prefetch (``l3_since``: request -> plan count
        when it first waited for L3, for the wait histogram of a synchronous load)
        (:meth:`tierkv.connector.core.scheduler.CacheScheduler.on_alloc`)."""
        req_id = st.req_id
        c = st.last_num_computed
        l3_hit = (st.async_hit or st.sync_hit) and self.ctl is not None
        from_l2 = 0 if l3_hit else num_external_tokens  # L3 hits: the controller's counters
        self.counters.l2_hit_tokens += from_l2
        if c >= self.page_size and self.ctl is not None and self.ctl.l1_hits_offer:
            # a prefix the engine's own cache (L1) served is a hit too: without this, pages vLLM keeps hitting in
            # L1 never reach the threshold and are never backed up
            dev = st.keys.extend(st.tokens)[: c // self.page_size]
            self.index.match_prefix(dev, require_l2=False, touch=True)
            self.ctl.after_hit(dev, len(dev))
        if num_external_tokens <= 0:
            return
        first, last = c // self.page_size, (c + num_external_tokens) // self.page_size
        k = self.blocks_per_page
        # the engine's L1 hit ``c`` is whole blocks, not always whole pages: the first page's blocks in L1 stay as
        # they are and only the blocks after them are loaded
        b0 = c // self.block_size
        skip, blocks = b0 - first * k, list(block_ids[b0:last * k])
        gblocks = [list(g[b0:last * k]) for g in groups or ()]
        keys = st.keys.extend(st.tokens)[:last]
        if l3_hit:
            sync, st.async_hit, st.sync_hit = st.sync_hit, False, False
            self.ctl.forget_request(req_id)
            self.ctl.start_prefetch(req_id, keys, first, last, blocks, k, skip, gblocks, sync=sync)
            self.counters.load_pages += last - first
            st.num_indexed = 0  # known after the report; schedule_saves matches again
            if sync:  # loaded before this step's forward, which computes the request's other tokens on it
                st.load, st.saved, st.load_l3_end = (step + 1, blocks, b0), [], last
                since = l3_since.pop(req_id, None)
                self.counters.note_l3_wait(0 if since is None else step - since)
            return
        m = self.index.match_prefix(keys, require_l2=True, split=True, touch=True)
        self.lookup_stats.hit_l2(m.host_slots[first:last])
        if m.num_pages < last:  # cannot happen: nothing evicts between lookup and alloc in one schedule()
            raise RuntimeError(f"{req_id}: promised {last} pages from L2 but only {m.num_pages} are there")
        if st.lock is not None:
            self.index.unlock(st.lock)
        st.lock = self.index.lock(m.last_node)
        plan.loads.append(PageOrder(req_id, blocks, m.host_slots[first:last], keys[first:last], k, skip,
                                    groups=gblocks))
        self.counters.load_pages += last - first
        st.num_indexed = last
        st.load, st.saved, st.load_l3_end = (step + 1, blocks, b0), [], None
        if self.ctl is not None:
            self.ctl.after_hit(keys, last)

    def alloc_failed(self, req_id: str, st: Optional[RequestState], plan: StepPlan, block_ids: Sequence[int],
                     num_external_tokens: int, is_async: bool) -> None:
        """Ordering the load of ``req_id`` (state ``st``, None if not live) raised: ``plan`` names its promised
        blocks as failed loads and, for an asynchronous load, the request as ended
        (:meth:`tierkv.connector.core.scheduler.CacheScheduler.alloc_failed`)."""
        self.counters.hook_errors += 1
        c = st.last_num_computed if st is not None else 0
        if num_external_tokens > 0:
            last = (c + num_external_tokens) // self.page_size
            plan.failed_blocks.extend(block_ids[c // self.block_size:last * self.blocks_per_page])
            if is_async:
                plan.failed_requests.append(req_id)
            if self.ctl is not None:
                self.ctl.outcome_failed(req_id)
        if st is not None:
            st.async_hit = st.sync_hit = False
            st.num_indexed = 0
