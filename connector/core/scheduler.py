"""Scheduler side of the cache: prefix matching over L2 and L3, locks, L2 slot allocation, per-step plans.

Engine-free and tensor-free: :class:`tierkv.connector.vllm.connector.TierKVConnector` maps vLLM's scheduler hooks onto
:class:`CacheScheduler` (tests drive it with a scheduler stub). With an L3 store it owns the scheduler half of
:class:`tierkv.connector.l3.controller.Controller` (backups, prefetches). Its parts: :mod:`.scheduling`.

1. ``lookup`` [``get_num_new_matched_tokens``]: tokens loadable beyond the device hit, None while L3 or room pends.
2. ``on_alloc`` [``update_state_after_alloc``]: lock the L2 path and order the load, or start an L3 prefetch.
3. ``schedule_saves``, ``build_plan`` [``build_connector_meta``]: save newly full pages; hand over the step's plan.
4. ``on_preempted``, ``on_finished`` [``request_finished``]: release the request; keep its blocks while L3 loads.
5. ``on_reports`` [``update_connector_output``]: job reports free pins and publish pages.

A plan's loads and saves finish within its step, so what they name is free from the next step; L3 jobs outlive
steps and keep what they name pinned until their report.
"""
from __future__ import annotations

import logging
import time
from typing import Optional, Sequence

from tierkv.connector.l3.controller import Controller, LookupStats
from .page_hash import ModelNamespace, RequestKeys, request_root, warm_up
from .plan import JobReport, StepPlan
from .radix_index import RadixIndex, RadixNode
from .request_params import RequestControls
from .scheduling.failures import LoadFailures
from .scheduling.loads import LoadPlanner
from .scheduling.lookup import PrefixLookup
from .scheduling.saves import SavePlanner
from .scheduling.state import NoSlots, RequestState, SchedulerCounters, check_page_size
from tierkv.connector.l2.slot_allocator import SlotAllocator

logger = logging.getLogger("tierkv.scheduler")


class CacheScheduler:
    """Scheduler-side state of tierkv for one engine.

    Args:
        namespace: identity of the engine's pages (model, dtype, layout, page size, geometry, TP size).
        page_size: tokens per page: ``k`` x ``block_size`` for an integer ``k`` >= 1 (a page spans ``k``
            consecutive engine blocks of a request; hits, loads, saves, L2 slots and L3 records are whole pages,
            except that a load skips the blocks of its first page the engine already holds in L1).
        block_size: the engine's block size in tokens.
        num_slots: pages in the L2 host pool (same number on every worker rank).
        eviction_policy: ``"lru"``, ``"lfu"``, ``"slru"`` or ``"s3fifo"`` for the radix index; ``eviction_params``:
            its ``protected_fraction`` (slru) and ``small_fraction`` (s3fifo).
        controller: keyword arguments of :class:`~tierkv.connector.l3.controller.Controller` (policies, deadlines,
            ``world_size``) when an L3 store is configured; None = L1 <-> L2 only.
        plan_type: the class :meth:`build_plan` returns, :class:`~tierkv.connector.core.plan.StepPlan` or a subclass
            taking the same fields (the vLLM connector's metadata class, so a plan is handed over without a copy).
    Raises:
        ValueError: page_size not a whole multiple of block_size, num_slots < 0, or a bad controller setting.
    """

    def __init__(self, namespace: ModelNamespace, page_size: int, block_size: int, num_slots: int,
                 eviction_policy: str = "lru", controller: Optional[dict] = None, plan_type: type = StepPlan,
                 eviction_params: Optional[dict] = None):
        check_page_size(page_size, block_size)
        if num_slots < 0:
            raise ValueError(f"num_slots must be >= 0, got {num_slots}")
        self.namespace = namespace
        self.ns_digest = namespace.digest()
        self.page_size = page_size
        self.block_size = block_size
        self.blocks_per_page = page_size // block_size
        self.num_slots = num_slots
        self.index = RadixIndex(eviction_policy, **(eviction_params or {}))
        warm_up()  # load the compiled page hash now, not in the first request's lookup
        self.allocator = SlotAllocator(num_slots) if num_slots > 0 else NoSlots()
        self.lookup_stats = LookupStats(num_slots, (controller or {}).get("clock", time.monotonic))
        self.requests: dict[str, RequestState] = {}
        self.counters = SchedulerCounters()
        self.plan_type = plan_type  # what build_plan hands over: StepPlan or a subclass (the engine's metadata class)
        self._plan = plan_type()
        self._step = 0
        self._l3_since: dict[str, int] = {}  # request -> plans built when its lookup first waited for / hit L3
        #: the lookup trace writer (config ``trace_path``, :class:`tierkv.connector.obs.lookup_trace.LookupTrace`) or None
        self.trace = None
        #: per-tier bytes written and served, and the write-only warning (:mod:`tierkv.connector.obs.tier_bytes`) or None
        self.tier_bytes = None
        self.ctl: Optional[Controller] = None
        if controller is not None and num_slots > 0:
            self.ctl = Controller(self.index, self.allocator, page_size=page_size, lookup_stats=self.lookup_stats,
                                  **controller)
        self._failures = LoadFailures(self.index, self.allocator, self.counters, self.ctl, self.blocks_per_page)
        self._lookups = PrefixLookup(self.index, self.counters, self.lookup_stats, self.ctl, page_size, num_slots)
        self._loads = LoadPlanner(self.index, self.counters, self.lookup_stats, self.ctl, page_size, block_size)
        self._saves = SavePlanner(self.index, self.allocator, self.counters, self.lookup_stats, self.ctl, page_size,
                                  block_size)

    # ----------------------------------------------------------------- requests
    def add_request(self, req_id: str, tokens: Sequence[int], lora: Optional[str] = None,
                    cache_salt: Optional[str] = None, controls: Optional[RequestControls] = None) -> None:
        """Register a request (idempotent). ``tokens`` is a live sequence of all its token ids; ``controls`` its
        per-request controls (what tierkv may load and save for it, whether its saved pages bypass L3 admission)."""
        st = self.requests.get(req_id)
        if st is None:
            root = request_root(self.ns_digest, lora, cache_salt)
            st = self.requests[req_id] = RequestState(req_id, RequestKeys(root, self.page_size), tokens)
            self.counters.requests += 1
            if controls is not None:
                st.load_cap, st.save_cap = controls.load_pages(self.page_size), controls.save_pages(self.page_size)
                st.keep = controls.keep
        else:
            st.tokens = tokens

    def no_read(self, req_id: str, num_computed_tokens: int) -> None:
        """The engine never lets ``req_id`` read a cache (vLLM: ``skip_reading_prefix_cache``, e.g. prompt logprobs):
        it loads nothing and is not counted in the lookup statistics."""
        st = self.requests[req_id]
        st.last_num_computed = num_computed_tokens
        st.reads = False
        st.async_hit = st.sync_hit = False

    def lookup(self, req_id: str, num_computed_tokens: int) -> Optional[int]:
        """Tokens beyond ``num_computed_tokens`` (the engine's device hit, page-aligned) loadable from L2 or L3, or
        None while the answer is not known yet (an L3 existence query or L2 staging room is pending).

        At most ``(len(tokens) - 1) // page_size`` pages count, so one token is always left to compute.
        Side-effect free on the index, apart from caching the request's page keys (and, with L3, starting an
        existence query whose answer a later call uses).
        """
        t0 = time.perf_counter()
        try:
            st = self.requests[req_id]
            n = self._lookups.answer(st, num_computed_tokens)
            if n is None or st.async_hit or st.sync_hit:  # waiting for L3, or an L3 hit: its wait starts now
                self._l3_since.setdefault(req_id, self._step)
            else:
                self._l3_since.pop(req_id, None)
            return n
        finally:
            dt = time.perf_counter() - t0
            c = self.counters
            c.lookups += 1
            c.lookup_seconds += dt
            c.max_lookup_us = max(c.max_lookup_us, 1e6 * dt)

    def lookup_is_async(self, req_id: str) -> bool:
        """Whether the last :meth:`lookup` answer of ``req_id`` needs an L3 read (vLLM: ``load_async=True``)."""
        st = self.requests.get(req_id)
        return bool(st is not None and st.async_hit)

    def on_alloc(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int,
                 groups: Optional[Sequence[Sequence[int]]] = None) -> None:
        """The engine allocated ``block_ids`` (the request's whole table) and will take
        ``num_external_tokens`` from us: lock the matched path and order the load for this step. ``groups``
        (hybrid models): the whole table of every KV cache group, ``block_ids`` being a full-attention group's; the
        load then copies each group's live blocks (:func:`tierkv.connector.core.plan.live_blocks`)."""
        st = self.requests[req_id]
        if not st.counted and st.reads:
            st.counted = True
            self._lookups.count(st, st.last_num_computed, num_external_tokens, self.trace)
        self._loads.order(st, self._plan, self._step, self._l3_since, block_ids, num_external_tokens, groups)

    def alloc_failed(self, req_id: str, block_ids: Sequence[int], num_external_tokens: int, is_async: bool) -> None:
        """:meth:`on_alloc` raised for a request promised ``num_external_tokens``: the next plan tells
        the workers to report those blocks as failed loads (vLLM recomputes them) and, for an L3 hit, to name the
        request as ended, so the engine never computes on KV that was not loaded, nor waits for a load never
        ordered."""
        self._loads.alloc_failed(req_id, self.requests.get(req_id), self._plan, block_ids, num_external_tokens,
                                 is_async)

    def schedule_saves(self, req_id: str, num_tokens_after_step: int, block_ids: Sequence[int],
                       groups: Optional[Sequence[Sequence[int]]] = None) -> None:
        """Order saves for the pages of ``req_id`` that are full once this step has run
        (``num_tokens_after_step`` = computed + scheduled tokens) and not yet in L2. ``block_ids`` is the
        request's whole block table. ``groups`` (hybrid models): every KV cache group's whole table, ``block_ids``
        being a full-attention group's; a page is saved only when all its blocks in every group are live
        (:func:`tierkv.connector.core.plan.live_blocks`): one that is not and is already indexed (an L3 copy) is left as
        it is, one that is not indexed ends this step's saves there."""
        if not self.needs_saves(req_id, num_tokens_after_step):
            return
        self._saves.schedule(self.requests[req_id], self._plan, self._step, num_tokens_after_step, block_ids, groups)

    @property
    def _plan_locks(self) -> list[RadixNode]:
        """Nodes locked until the plan being built is handed over (:class:`SavePlanner`)."""
        return self._saves.plan_locks

    def on_preempted(self, req_id: str) -> None:
        """The engine freed the request's blocks; it will be looked up again when resumed."""
        st = self.requests.get(req_id)
        if st is None:
            return
        self.counters.preemptions += 1
        self._release(st)
        st.num_indexed = 0
        # its load record stays: a failure of that load reported later still takes its pages out of the index. The
        # resumed request computes on an intact prefix, so the workers may save its pages again
        self._plan.recomputed.append(req_id)

    def on_finished(self, req_id: str) -> bool:
        """Finished, aborted or errored: release everything held for it. Idempotent. Returns True while the workers
        have not named the request's L3 load as ended: the engine must keep the blocks until they do (vLLM:
        ``request_finished`` -> delay, then ``finished_recving``). A request whose load they already named as ended
        (released at its deadline while the read still runs) is never delayed: they would not name it again, and
        its blocks would never be freed (the read's staging slots stay pinned until its report)."""
        st = self.requests.pop(req_id, None)
        if st is not None:
            self._release(st)
        self._l3_since.pop(req_id, None)
        if self.trace is not None and not self.requests:  # the engine may go idle: its lookups reach the file now
            self.trace.flush()
        if self.ctl is None:
            return False
        return self.ctl.end_request(req_id)

    def on_finished_recving(self, req_ids, invalid_block_ids=(), failed_req_ids=()) -> None:
        """Requests whose asynchronous (L3) load the workers named as ended in a step (vLLM:
        ``KVConnectorOutput.finished_recving``, delivered with ``update_connector_output``), the blocks whose load
        failed in that step (``invalid_block_ids``: where each request's load was cut) and, for a model of several
        KV cache groups, the requests whose load failed as a whole (``failed_recving``)."""
        if self.ctl is not None and req_ids:
            self.ctl.on_finished_recving(req_ids, invalid_block_ids, failed_req_ids)
            for rid in req_ids:
                since = self._l3_since.pop(rid, None)
                if since is not None:
                    self.counters.note_l3_wait(self._step - since)

    def _release(self, st: RequestState) -> None:
        if st.lock is not None:
            self.index.unlock(st.lock)
            st.lock = None

    # ----------------------------------------------------------------- plans
    def build_plan(self) -> StepPlan:
        """Hand over everything ordered since the last call as one :class:`StepPlan` and start a new one."""
        self._step += 1
        plan, self._plan = self._plan, self.plan_type(step=self._step + 1)
        plan.step = self._step
        self._saves.release_plan_locks()  # the plan's saves complete within its step: their pages may go from now on
        if self.ctl is not None:
            self.ctl.keep_free(self.num_slots // 4)
            plan.jobs = self.ctl.take_jobs()
        return plan

    def on_reports(self, reports: Sequence[JobReport]) -> None:
        """The workers' job reports of a step (vLLM: ``update_connector_output``)."""
        if self.ctl is not None and reports:
            self.ctl.on_reports(reports)
            if self._failures.drops:
                self._failures.retry_drops()

    def on_load_errors(self, invalid_block_ids) -> None:
        """Engine blocks whose load failed in a step (vLLM: ``KVConnectorOutput.invalid_block_ids``, the union of
        every rank's ``get_block_ids_with_load_errors``), delivered with that step's output.

        A request whose last L2 -> L1 load names one of them computed its later pages in that step (and in any plan
        built before this call) on a broken prefix; vLLM rolls it back to its first failed block and recomputes.
        So: its pages from the first failed one on leave the index (those saved since
        the load were never written: the worker refused them) and their slots are freed, at once or, where
        something else holds them locked, as soon as it no longer does; a backup of only those pages is cancelled;
        its lock moves back to the intact prefix, so a page that failed its checksum is not kept pinned; the next
        plan tells the workers that its saves are good again (``StepPlan.recomputed``), and ``num_indexed`` goes
        back, so the recomputed pages are saved. Blocks of asynchronous (L3) loads are ignored here: such a request
        computes nothing before its load ended."""
        self._failures.on_load_errors(self.requests, invalid_block_ids, self._plan)

    def on_failed_loads(self, req_ids) -> None:
        """Hybrid models (several KV cache groups): requests whose asynchronous load failed (vLLM's
        ``failed_recving``; vLLM recomputes them from their first token, since it cannot take failed block ids of
        several groups). An L2 load's pages from its first loaded page on leave the index, as for a failed block of
        that page (:meth:`on_load_errors`); an L3 prefetch's outcome is the controller's."""
        self._failures.on_failed_loads(self.requests, req_ids, self._plan)

    @property
    def _drops(self) -> list[list[bytes]]:
        """Paths whose last page leaves the index once nothing there is locked (:class:`LoadFailures`)."""
        return self._failures.drops

    def reset(self) -> bool:
        """Drop every unlocked page from the index (``reset_prefix_cache(reset_connector=True)``)."""
        freed = self.index.clear()
        self.allocator.free(freed)
        return True

    # ----------------------------------------------------------------- what the engine edge asks
    def needs_saves(self, req_id: str, num_tokens_after_step: int) -> bool:
        """Whether :meth:`schedule_saves` could order anything for ``req_id`` this step: it is live, L2 exists, and a
        page beyond those already indexed is full once the step has run (its save cap allowed). False in most decode
        steps, so the caller skips fetching the request's block table (O(blocks) per request per step)."""
        st = self.requests.get(req_id)
        if st is None or self.num_slots == 0:
            return False
        return self._saves.pages_to_save(st, num_tokens_after_step)

    def tracks(self, req_id: str) -> bool:
        """Whether request ``req_id`` is live here (added and not finished)."""
        return req_id in self.requests

    def has_requests(self) -> bool:
        """Whether any request is live (False: the engine may go idle after this step)."""
        return bool(self.requests)

    def drop_async_hit(self, req_id: str) -> None:
        """Forget that the last lookup of ``req_id`` answered with an asynchronous (L3) hit (its hook failed, so vLLM
        was told no hit)."""
        st = self.requests.get(req_id)
        if st is not None:
            st.async_hit = st.sync_hit = False

    def pins_pending(self) -> bool:
        """Whether a backup or prefetch still pins L2 pages or staging slots (:meth:`Controller.pins_pending`);
        False without an L3."""
        return self.ctl is not None and self.ctl.pins_pending()

    def observe_prefill(self, seconds: float, tokens: int) -> Optional[float]:
        """Feed the recompute estimate with a forward that computed ``tokens`` prompt tokens in ``seconds``; returns
        the estimate afterwards (seconds per token), or None without an L3 (nothing decides by it)."""
        if self.ctl is None:
            return None
        self.ctl.observe_prefill(seconds, tokens)
        return self.ctl.prefill_s_per_token.value

    def stats(self) -> dict:
        d = self.counters.as_dict()
        d.update(self.lookup_stats.as_dict())
        s = self.index.stats()
        if self.ctl is not None:
            d.update(self.ctl.stats())
        if self.index.events is not None:
            d.update(self.index.events.stats())
        if self.trace is not None:
            d.update(self.trace.stats())
        d.update(index_nodes=s.nodes, index_pages=s.pages, l2_pages=s.l2_pages, l3_pages=s.l3_pages,
                 locked_pages=s.locked_pages,
                 free_slots=self.allocator.num_free, num_slots=self.num_slots,
                 live_requests=len(self.requests))
        if self.tier_bytes is not None:
            self.tier_bytes.add_to(d)
        return d

    def check_invariants(self) -> None:
        """Index invariants plus: slots held by the index + staging slots of running prefetches + free slots ==
        num_slots (nothing leaked)."""
        self.index.check_invariants()
        used = self.index.all_slots()
        staging = self.ctl.staging_slots() if self.ctl is not None else []
        assert not set(used) & set(staging), "a staging slot is also indexed"
        assert len(used) + len(staging) + self.allocator.num_free == self.num_slots, \
            (len(used), len(staging), self.allocator.num_free)
