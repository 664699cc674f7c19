"""Save planning: which pages of a request a step fills and are not in L2 yet, their L2 slots, their save orders.

For each such page :class:`SavePlanner` allocates an L2 slot (evicting, through the L3 controller when there is one),
inserts the page into the radix index and appends a :class:`~tierkv.connector.core.plan.PageOrder` (L1 blocks ->
L2 slots) to the plan being built. The saved path stays locked until that plan is handed over
(:meth:`SavePlanner.release_plan_locks`), so no later save or staging slot of the same plan can evict those pages
and be handed their slots. Pages that find no free slot (everything locked) are skipped and counted.
"""
from __future__ import annotations

from typing import Optional, Sequence

from tierkv.connector.core.plan import PageOrder, StepPlan, live_blocks
from tierkv.connector.core.radix_index import RadixIndex, RadixNode
from tierkv.connector.l3.controller import LookupStats, reclaim_l2
from .failures import note_save
from .state import RequestState, SchedulerCounters


class SavePlanner:
    """Save orders (L1 -> L2) of the pages a step fills.

    Args:
        index, allocator, counters, lookup_stats, ctl: the scheduler's radix index, L2 slot allocator, counters,
            lookup statistics and L3 controller (None without L3).
        page_size: tokens per page; block_size: the engine's block size in tokens.
    """

    def __init__(self, index: RadixIndex, allocator, counters: SchedulerCounters, lookup_stats: LookupStats, ctl,
                 page_size: int, block_size: int):
        self.index = index
        self.allocator = allocator
        self.counters = counters
        self.lookup_stats = lookup_stats
        self.ctl = ctl
        self.page_size = page_size
        self.block_size = block_size
        self.blocks_per_page = page_size // block_size
        # nodes holding pages whose save the plan being built orders: locked until the plan is handed over, so no
        # later save or staging slot of the same plan can evict them and be handed their slot
        self.plan_locks: list[RadixNode] = []

    def pages_to_save(self, st: RequestState, num_tokens_after_step: int) -> bool:
        """Whether a page of ``st`` beyond those already indexed is full once the step has run (its save cap
        allowed)."""
        full = min(num_tokens_after_step, len(st.tokens)) // self.page_size
        if st.save_cap is not None:
            full = min(full, st.save_cap)
        return full > st.num_indexed

    def release_plan_locks(self) -> None:
        """The plan was handed over: its saves complete within its step, so their pages may be evicted again."""
        for node in self.plan_locks:
            self.index.unlock(node)
        self.plan_locks = []

    def schedule(self, st: RequestState, plan: StepPlan, step: int, num_tokens_after_step: int,
                 block_ids: Sequence[int], groups: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Order into ``plan`` (built after ``step`` plans) the saves of the pages of ``st`` that are full once this
        step has run and not yet in L2 (:meth:`tierkv.connector.core.scheduler.CacheScheduler.schedule_saves`)."""
        req_id = st.req_id
        full = min(num_tokens_after_step, len(st.tokens), len(block_ids) * self.block_size) // self.page_size
        if st.save_cap is not None:  # the request's controls: only its first pages, or none
            full = min(full, st.save_cap)
        if full <= st.num_indexed:
            return
        keys = st.keys.extend(st.tokens)[:full]
        # every indexed page of the path, in whatever tier: a page that already has an L2 copy is never saved again
        # (its slot belongs to the index; saving into a second slot would be freed as a duplicate while the save
        # order still names it, and a later order of the same plan could be handed that slot)
        m = self.index.match_prefix(keys, require_l2=False, split=True, touch=True)
        ctl = self.ctl
        # a page the request's own running prefetch reads into a staging slot (its synchronous L3 load of this step)
        # gets its L2 copy from that job's report: not saved a second time
        missing = [i for i, s in enumerate(m.host_slots)
                   if s < 0 and (ctl is None or not ctl.fetches_for(req_id, keys[i]))]
        missing += list(range(m.num_pages, full))
        if groups:
            missing, full = self.live_pages(missing, m.num_pages, full, groups)
        if not missing:
            st.num_indexed = full
            return
        need = len(missing)
        guard = self.index.lock(m.last_node) if m.last_node is not self.index.root else None
        try:
            if self.allocator.num_free < need:
                before = self.index.evicted_pages
                if self.ctl is not None:
                    self.ctl.make_room(need)
                else:
                    reclaim_l2(self.index, self.allocator, need)
                self.counters.evicted_pages += self.index.evicted_pages - before
            k = min(need, self.allocator.num_free)
            slots = self.allocator.alloc(k) if k else []
        finally:
            if guard is not None:
                self.index.unlock(guard)
        if k < need:
            self.counters.save_skipped_pages += need - k
        if k == 0:
            return
        start, end = missing[0], missing[k - 1] + 1  # pages [start, end) all have an L2 copy once this runs
        given = [-1] * (end - start)
        for i, s in zip(missing, slots):
            given[i - start] = s
        if self.index.events is not None:  # KV events: the pages entering L2 now (kv_events.py)
            self.index.events.describe(req_id, keys, start, end)
        node, dups = self.index.insert(keys[:end], given, start=start)
        if dups:  # cannot happen: the path was matched just now and nothing on it changed since (it was locked)
            raise RuntimeError(f"{req_id}: slots {dups} handed out for pages already in L2")
        self.plan_locks.append(self.index.lock(node))
        self.lookup_stats.stored_l2(slots)
        bpp = self.blocks_per_page

        def page_blocks(ids: Sequence[int]) -> list[int]:
            return [b for i in missing[:k] for b in ids[i * bpp:(i + 1) * bpp]]
        plan.saves.append(PageOrder(req_id, page_blocks(block_ids), slots, [keys[i] for i in missing[:k]], bpp,
                                    groups=[page_blocks(g) for g in groups or ()]))
        self.counters.save_pages += k
        st.num_indexed = full if k == need else end
        note_save(st, step, start, end)
        if self.ctl is not None:
            self.ctl.after_save(keys[:end], start, req_id, keep=st.keep)

    def live_pages(self, missing: list[int], indexed: int, full: int,
                   groups: Sequence[Sequence[int]]) -> tuple[list[int], int]:
        """Hybrid models: ``missing`` less the pages that are not live in every group (:func:`live_blocks`), and
        ``full`` cut at the first such page that is not indexed (``>= indexed``): the index holds prefixes."""
        k = self.blocks_per_page

        def live(i: int) -> bool:
            return all(len(live_blocks(g[i * k:(i + 1) * k])) == k for g in groups)
        out = []
        for i in missing:
            if live(i):
                out.append(i)
            elif i >= indexed:
                return out, i
        return out, full
