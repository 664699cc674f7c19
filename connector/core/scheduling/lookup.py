"""Lookups: how many tokens of a request's prefix L2 or L3 can give, and how that prefix is counted.

:meth:`PrefixLookup.answer` hashes the request's full pages (each once: the keys are cached per request), resumes the
radix index's L2 match from the last lookup's cursor and, when L2 does not hold the whole prefix and an L3 store is
configured, asks the controller (an existence query, answered in a later step: None until then). At most
``(len(tokens) - 1) // page_size`` pages count, so one token is always left to compute. :meth:`PrefixLookup.count`
adds a request's prefix, once, to the lookup statistics, split into where its tokens came from (L1, L2, L3) and why
the rest were not a hit, and writes it to the lookup trace when one is configured. Nothing here changes the index.
"""
from __future__ import annotations

from typing import Optional

from tierkv.connector.core.radix_index import RadixIndex
from tierkv.connector.l3.controller import LookupStats
from .state import RequestState, SchedulerCounters


class PrefixLookup:
    """Lookup answers and lookup statistics of the scheduler side.

    Args:
        index, counters, lookup_stats, ctl: the scheduler's radix index, counters, lookup statistics and L3
            controller (None without L3).
        page_size: tokens per page; num_slots: pages in the L2 host pool (0: every lookup answers 0).
    """

    def __init__(self, index: RadixIndex, counters: SchedulerCounters, lookup_stats: LookupStats, ctl,
                 page_size: int, num_slots: int):
        self.index = index
        self.counters = counters
        self.lookup_stats = lookup_stats
        self.ctl = ctl
        self.page_size = page_size
        self.num_slots = num_slots

    def answer(self, st: RequestState, num_computed_tokens: int) -> Optional[int]:
        """:meth:`tierkv.connector.core.scheduler.CacheScheduler.lookup` for request ``st``, untimed: tokens beyond
        ``num_computed_tokens`` loadable from L2 or L3, or None while an L3 answer or L2 room is pending."""
        req_id = st.req_id
        st.last_num_computed = num_computed_tokens
        st.async_hit = st.sync_hit = False
        st.reads = True
        full = max(0, (len(st.tokens) - 1) // self.page_size)
        cap_pages = full if st.load_cap is None else min(full, st.load_cap)
        # pages the request's controls exclude: skipped, whatever the tiers hold
        st.rest = [("miss", cap_pages), ("skipped", full)]
        if cap_pages == 0 or self.num_slots == 0:
            return 0
        all_keys = st.keys.extend(st.tokens)  # hashes only pages not hashed before: O(1) for a waiting request
        # the L2 run, resumed from the last lookup's cursor: O(1) when nothing on the path changed
        l2_run, st.cursor = self.index.match_len(all_keys, cap_pages, require_l2=True, cursor=st.cursor)
        first = num_computed_tokens // self.page_size
        if self.ctl is not None:  # l3.admission second_sight: the request saw these keys
            self.ctl.admission.seen_lookup(req_id, all_keys, cap_pages)
        if self.ctl is None or l2_run == cap_pages:  # with L3 too: nothing more to find when L2 holds every page
            return max(0, l2_run * self.page_size - num_computed_tokens)
        if self.index.events is not None:  # KV events: pages an L3 existence answer may index (kv_events.py)
            self.index.events.describe(req_id, all_keys, l2_run, cap_pages)
        ans = self.ctl.lookup(req_id, all_keys[:cap_pages], l2_run, first)
        if ans is None:
            return None
        st.async_hit, st.sync_hit = ans.is_async, ans.sync
        st.rest = ans.rest + [("skipped", full)]
        return max(0, ans.pages * self.page_size - num_computed_tokens)

    def count_prefix(self, st: RequestState, c: int, ext: int) -> None:
        """The first admission of a request that may read a cache: its prefix tokens into the lookup total, split
        into L1 (the engine's device hit ``c``), the ``ext`` tokens it takes from us (L2 now, or waiting for the
        outcome of its L3 load) and, for the pages after those, the reasons the last lookup gave."""
        ps = self.page_size
        full = max(0, (len(st.tokens) - 1) // ps)
        self.counters.lookup_tokens += full * ps
        c = min(c, full * ps)  # pages of several blocks: vLLM's hit may reach into blocks past the last whole page
        self.counters.device_hit_tokens += c
        ls = self.lookup_stats
        ls.add("l1", c)
        if ext > 0 and (st.async_hit or st.sync_hit) and self.ctl is not None:
            self.ctl.expect_outcome(st.req_id, ext)
        else:
            ls.add("l2", ext)
        pos = c + ext  # tokens; with pages of several blocks the L1 hit may end inside a page
        for reason, end in st.rest:
            end = min(end, full) * ps
            if end > pos:
                ls.add(reason, end - pos)
                pos = end
        ls.add("miss", max(0, full * ps - pos))

    def count(self, st: RequestState, c: int, ext: int, trace=None) -> None:
        """Count the request's first admission (:meth:`count_prefix`) and, with a lookup trace (config
        ``trace_path``), write this lookup's page keys and where its tokens went."""
        if trace is None:
            self.count_prefix(st, c, ext)
            return
        ls = self.lookup_stats
        before, waiting = dict(ls.tokens), ls.waiting
        self.count_prefix(st, c, ext)
        outcome = {k: v - before[k] for k, v in ls.tokens.items()}
        outcome["l3"] += ls.waiting - waiting
        trace.lookup(st.keys.extend(st.tokens), max(0, (len(st.tokens) - 1) // self.page_size),
                     outcome, st.load_cap, st.save_cap, st.keep)
