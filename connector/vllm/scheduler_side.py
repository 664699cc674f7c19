"""The vLLM connector's scheduler role: one call per vLLM scheduler hook, onto a CacheScheduler.

:class:`SchedulerSide` maps vLLM's requests and scheduler outputs onto
:class:`~tierkv.connector.core.scheduler.CacheScheduler`: :meth:`~SchedulerSide.lookup`
(``get_num_new_matched_tokens``), :meth:`~SchedulerSide.allocated` (``update_state_after_alloc``),
:meth:`~SchedulerSide.build_plan` (``build_connector_meta``), :meth:`~SchedulerSide.output`
(``update_connector_output``) and :meth:`~SchedulerSide.finished` (``request_finished``); it also hands counter
deltas over (:meth:`~SchedulerSide.stats`, at most once per :data:`STATS_EVERY_S` seconds while requests run), turns
tier events into vLLM's, and keeps the engine's recompute estimate (seconds per prompt token) in its estimates file.
An exception inside a call is counted and logged and becomes a miss or failed blocks, never an engine error.
:func:`build_scheduler_side` builds it (existence stores, events, lookup trace, estimates) and logs the start-up line.
"""
from __future__ import annotations

import logging
import math
import time
from typing import Any, Optional

from tierkv.connector.core.config import TierKVConfig
from tierkv.connector.core.request_params import RequestControls, RequestParamsError, parse_controls
from tierkv.connector.l3.load_policy import LoadPolicy
from tierkv.connector.obs.metrics import StatsFile

from .geometry import Geometry
from .hooks import _hook_error, _params_log
from .metrics import REUSE_KEYS, CounterDeltas, scheduler_gauges
from .namespace import lora_key
from .sizing import _SIZE_KEYS, startup_line
from .stores import scheduler_exists_for

logger = logging.getLogger("tierkv.vllm")

#: seconds between two hand-overs of counter deltas to vLLM's metrics (``get_kv_connector_stats``, both roles). A
#: hand-over snapshots every counter of the role and diffs it against the previous one; vLLM calls the hook every
#: step, its loggers read the result every few seconds. In the steps between, the hook returns None and the increases
#: accumulate (nothing is lost); steps without a scheduled request (the engine draining) always hand over, and an
#: engine that goes idle in between is kept stepping once more so that the workers hand over theirs
#: (:meth:`SchedulerSide.pending_push_work`).
STATS_EVERY_S = 0.1


class SchedulerSide:
    """The scheduler role's state and hook work (see the module docstring). ``sched``: the CacheScheduler;
    ``geo``: the engine geometry; ``stats``: the role's stats file; ``events`` / ``estimates`` / ``exists_stores``:
    the tier events, estimates file and L3 existence stores (None / None / () when not used); ``requests``: the dict
    the events resolve request ids in."""

    def __init__(self, sched, geo: Geometry, stats: StatsFile, *, events=None, estimates=None, exists_stores=(),
                 requests: Optional[dict] = None):
        self.sched, self.geo, self.hybrid, self.ref_group = sched, geo, geo.hybrid, geo.ref_group
        self.stats_file, self.events, self.estimates, self.exists_stores = stats, events, estimates, exists_stores
        self.requests: dict[str, Any] = requests if requests is not None else {}  # request id -> vLLM's Request
        self.param_errors: dict[str, str] = {}  # request -> why its kv_transfer_params["tierkv"] was refused
        self.clock = time.perf_counter  # seconds; the counter hand-overs' clock (tests replace it)
        self._stats_due = -math.inf       # ``clock`` time of the next counter hand-over (STATS_EVERY_S)
        self._plan_stats_due = -math.inf  # same for the workers, ordered through the plan (emit_stats)
        self.worker_stats_owed = False    # the last plan told the workers to hold their deltas back
        self._deltas = CounterDeltas()

    # ------------------------------------------------------------------ requests
    def track(self, request) -> None:
        """Register the request (tokens, LoRA name, cache salt, tierkv controls) once."""
        if request.request_id not in self.requests:
            self.requests[request.request_id] = request
            lora = lora_key(getattr(request, "lora_request", None))
            self.sched.add_request(request.request_id, request.all_token_ids, lora=lora,
                                   cache_salt=getattr(request, "cache_salt", None), controls=self._controls(request))

    def _controls(self, request) -> Optional[RequestControls]:
        """The request's tierkv controls (``kv_transfer_params["tierkv"]``, :mod:`tierkv.connector.core.request_params`).
        Malformed ones (a front-end without the :mod:`tierkv.connector.vllm.params_check` validator let them through)
        are refused here: the request is served without tierkv (nothing loaded, nothing saved), the refusal is
        counted (``request_params_refused``) and logged, and its response's ``kv_transfer_params`` carries
        ``{"tierkv_error": <message naming the field>}``."""
        try:
            return parse_controls(getattr(request, "kv_transfer_params", None))
        except RequestParamsError as e:
            self.sched.counters.request_params_refused += 1
            self.param_errors[request.request_id] = str(e)
            _params_log().warning("params", "tierkv: request %s: %s; served without tierkv", request.request_id, e)
            return RequestControls(load=False, save=False)

    # ------------------------------------------------------------------ lookup and allocation
    def lookup(self, request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """``get_num_new_matched_tokens``'s answer; ``(0, False)`` after an error (a miss, never an engine crash)."""
        try:
            return self._matched(request, num_computed_tokens)
        except Exception as e:  # a miss, never an engine crash
            _hook_error(self.sched.counters, "get_num_new_matched_tokens", e)
            self.sched.drop_async_hit(request.request_id)
            return 0, False

    def _matched(self, request, num_computed_tokens: int) -> tuple[Optional[int], bool]:
        self.track(request)
        if getattr(request, "skip_reading_prefix_cache", False):  # vLLM ignores any answer: not counted either
            self.sched.no_read(request.request_id, num_computed_tokens)
            return 0, False
        n = self.sched.lookup(request.request_id, num_computed_tokens)
        if n is None:
            return None, False  # an L3 answer or L2 room is pending: vLLM asks again next step
        # several KV cache groups: every hit is an asynchronous load, because vLLM takes a failed load of such a model
        # only as a failed request (failed_recving), never as failed block ids
        return n, bool(n > 0 and (self.hybrid or self.sched.lookup_is_async(request.request_id)))

    def allocated(self, request, blocks, num_external_tokens: int) -> None:
        """``update_state_after_alloc``: lock the hit and order its load or prefetch; after an error the promised
        blocks go into the next plan as failed loads (vLLM recomputes them)."""
        block_ids: list[int] = []
        is_async = False
        try:
            self.track(request)
            groups = blocks.get_block_ids() if num_external_tokens else ()
            block_ids = groups[self.ref_group] if num_external_tokens else []
            is_async = self.hybrid or self.sched.lookup_is_async(request.request_id)
            if self.hybrid:
                self.sched.on_alloc(request.request_id, block_ids, num_external_tokens, groups)
            else:
                self.sched.on_alloc(request.request_id, block_ids, num_external_tokens)
        except Exception as e:  # the promised tokens are reported as failed loads: vLLM recomputes them
            _hook_error(None, "update_state_after_alloc", e)
            self.sched.alloc_failed(request.request_id, list(block_ids), num_external_tokens, is_async)

    # ------------------------------------------------------------------ the step's plan
    def build_plan(self, scheduler_output, kv_cache_manager=None):
        """``build_connector_meta``: release preempted requests, order the step's saves (full pages of verified
        tokens: a step's draft tokens do not count), count its prompt tokens and say whether the workers hand their
        counters over; returns the plan. ``kv_cache_manager``: where block tables come from when the output has
        none."""
        sched = self.sched
        try:
            for rid in scheduler_output.preempted_req_ids or ():
                sched.on_preempted(rid)
        except Exception as e:
            _hook_error(sched.counters, "build_connector_meta", e)
        n_sched = scheduler_output.num_scheduled_tokens
        state = getattr(scheduler_output, "kv_connector_block_state", None)
        todo = [(nr.req_id, nr.num_computed_tokens + n_sched.get(nr.req_id, 0), nr.block_ids)
                for nr in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        todo += [(rid, cached.num_computed_tokens[i] + n_sched.get(rid, 0), None) for i, rid in enumerate(cached.req_ids)]
        drafts = getattr(scheduler_output, "scheduled_spec_decode_tokens", None) or {}
        for rid, tokens_after, blocks in todo:
            try:
                # speculative decoding: the step's draft tokens are verified only after it, so a page they would fill
                # is saved in a later step, once its tokens are verified (the KV of a rejected draft, written in this
                # step, never reaches L2, and the page's key is that of the final tokens)
                self._plan_saves(rid, tokens_after - len(drafts.get(rid, ())), state, blocks, kv_cache_manager)
            except Exception as e:  # that request's pages are not saved this step; nothing else changes
                _hook_error(sched.counters, "build_connector_meta", e)
        meta = sched.build_plan()  # a ConnectorPlan (plan_type): vLLM's metadata as built, no copy
        meta.prefill_tokens = sum(self._prompt_tokens(rid, done, after - done) for rid, after, _b in todo
                                  for done in [after - n_sched.get(rid, 0)])
        now = self.clock()
        meta.emit_stats = not todo or now >= self._plan_stats_due  # (STATS_EVERY_S; a step without requests: always)
        if meta.emit_stats:
            self._plan_stats_due = now + STATS_EVERY_S
        self.worker_stats_owed = not meta.emit_stats
        return meta

    def _prompt_tokens(self, rid: str, computed: int, scheduled: int) -> int:
        """Of the ``scheduled`` tokens of ``rid`` in a step starting at ``computed``, how many are prompt tokens."""
        req = self.requests.get(rid)
        prompt = int(getattr(req, "num_prompt_tokens", 0) or 0) if req is not None else 0
        return max(0, min(computed + scheduled, prompt) - computed)

    def _plan_saves(self, rid: str, tokens_after: int, state, fallback_blocks, kv_cache_manager) -> None:
        if not self.sched.needs_saves(rid, tokens_after):  # no new full page (most decode steps): no block table
            return
        ids = state.get_block_ids(rid) if state is not None else None
        if ids is None:
            if fallback_blocks is not None:
                ids = fallback_blocks
            elif kv_cache_manager is not None:
                ids = kv_cache_manager.get_block_ids(rid)
            else:
                return
        if self.hybrid:  # every group's table; the full-attention group's for the page count
            self.sched.schedule_saves(rid, tokens_after, ids[self.ref_group], ids)
        else:
            self.sched.schedule_saves(rid, tokens_after, ids[0])

    # ------------------------------------------------------------------ the step's output
    def output(self, connector_output) -> None:
        """``update_connector_output``: the workers' job reports and timed forwards, the loads that ended or failed."""
        try:
            self._connector_output(connector_output)
        except Exception as e:
            _hook_error(self.sched.counters, "update_connector_output", e)

    def _connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if meta is not None:
            self.sched.on_reports(getattr(meta, "reports", []) or [])
            self.observe_forwards(getattr(meta, "forwards", []) or [])
        # requests whose L3 load the workers named as ended: their blocks are never delayed again at finish; the
        # blocks whose load failed in that step say where each load was cut (the lookup statistics)
        failed = getattr(connector_output, "failed_recving", None) or ()
        self.sched.on_finished_recving(getattr(connector_output, "finished_recving", None) or (),
                                       getattr(connector_output, "invalid_block_ids", None) or (), failed)
        # blocks whose load failed in that step (every rank's): pages computed on them leave the index
        self.sched.on_load_errors(getattr(connector_output, "invalid_block_ids", None) or ())
        if self.hybrid and failed:  # several groups: failed loads come as requests; their loaded pages leave too
            self.sched.on_failed_loads(failed)
        if meta is not None and not self.sched.has_requests():  # idle: the last reports of the drained work
            self.stats_file.write_soon()

    def observe_forwards(self, forwards) -> None:
        """The engine's prefill time per token, for the controller's "never slower than recomputing" check: forwards
        the workers timed (bind_connector_metadata -> wait_for_save) in steps that computed at least four pages of prompt
        tokens; idle time between steps and decode-only steps do not count. Several ranks: the slowest."""
        if self.estimates is None or not forwards:  # no L3: nothing decides by the estimate
            return
        by_step: dict[int, tuple[int, float]] = {}
        for step, tokens, seconds in forwards:
            t, s = by_step.get(step, (tokens, 0.0))
            by_step[step] = (t, max(s, seconds))
        estimate = None
        for tokens, seconds in by_step.values():
            estimate = self.sched.observe_prefill(seconds, tokens)
        self.estimates.maybe_save(estimate)

    # ------------------------------------------------------------------ end of a request, idle engine
    def finished(self, request) -> tuple[bool, Optional[dict]]:
        """``request_finished``: ``(delay, kv_transfer_params)``; after an error the blocks go back at once."""
        try:
            delay = self.sched.on_finished(request.request_id)
        except Exception as e:  # the blocks go back at once: the workers never copy into a finished request's blocks
            _hook_error(self.sched.counters, "request_finished", e)
            delay = False
        self.requests.pop(request.request_id, None)
        if not self.sched.has_requests():  # the engine may go idle now, and no later step would write the counters
            self.stats_file.write_soon()
        err = self.param_errors.pop(request.request_id, None)
        return delay, ({"tierkv_error": err} if err is not None else None)  # the response's kv_transfer_params

    def pending_push_work(self) -> bool:
        """``has_pending_push_work``: a job pins pages, or an idle engine owes the workers a counter hand-over."""
        try:
            return self.sched.pins_pending() or (self.worker_stats_owed and not self.sched.has_requests())
        except Exception as e:
            _hook_error(self.sched.counters, "has_pending_push_work", e)
            return False

    # ------------------------------------------------------------------ metrics and events
    def stats(self):
        """The counter deltas, changed gauges and latency samples since the last hand-over (a ``TierKVStats``), or None
        inside :data:`STATS_EVERY_S` of it while requests run; writes the stats file from the same snapshot."""
        now = self.clock()
        if now < self._stats_due and self.sched.has_requests():
            return None
        self._stats_due = now + STATS_EVERY_S
        snap = self.sched.stats()
        self.stats_file.maybe_write(data=dict(snap))   # the stats file, from the same snapshot (once a hand-over)
        snap.update(scheduler_gauges(snap))
        lat: dict[str, list] = {}
        for store in self.exists_stores:  # existence answered in this process
            for k, v in store.take_latencies().items():
                lat.setdefault(k, []).extend(v)
        tiers = {tier: key for key, tier in REUSE_KEYS.items()}
        for tier, v in self.sched.lookup_stats.take_samples().items():
            lat[tiers[tier]] = v
        return self._deltas.take(snap, lat or None)

    def take_events(self):
        """vLLM's KV events for the pages that entered or left L2 / L3 since the last step; () when events are off
        or converting them raised (those events are counted as dropped)."""
        events = self.events
        if events is None:
            return ()
        records = events.take()
        try:
            return events.to_vllm(records)
        except Exception as e:  # those events are lost (counted as dropped); the engine goes on
            _hook_error(self.sched.counters, "take_events", e)
            events.counters["kv_events_dropped"] += len(records)
            return ()

    def close(self) -> None:
        """Close the L3 existence stores."""
        for store in self.exists_stores:
            store.close()


def _tier_events(vllm_config, kv_cache_config, cfg: TierKVConfig, geo: Geometry, num_slots: int, requests: dict):
    """The :class:`~tierkv.connector.obs.kv_events.TierEvents` feeding ``take_events``, when vLLM publishes KV events
    (``--kv-events-config`` with ``enable_kv_cache_events``) and L2 holds pages; None otherwise (then the index pays
    nothing for events). ``requests``: the live request objects by id (read when an event is resolved)."""
    ev_cfg = getattr(vllm_config, "kv_events_config", None)
    if ev_cfg is None or not getattr(ev_cfg, "enable_kv_cache_events", False) or num_slots == 0:
        return None
    from tierkv.connector.obs.kv_events import TierEvents, page_infos
    hash_block_size = int(getattr(kv_cache_config, "hash_block_size", 0) or geo.block_size)

    def resolve(req_id: str, start: int, end: int):
        return page_infos(requests.get(req_id), start, end, geo.block_size, hash_block_size, geo.blocks_per_page)

    try:
        from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
        kind = get_kv_cache_spec_kind(geo.spec).value
    except Exception:  # a vLLM without the helper: the events go out without it
        kind = None
    return TierEvents(resolve, block_size=geo.block_size, spec_kind=kind,
                      l3_backend=cfg.l3.backend if cfg.l3.backend != "none" else None)


def build_scheduler_side(vllm_config, kv_cache_config, kv_transfer_config, cfg: TierKVConfig, geo: Geometry,
                         namespace, size, plan_type) -> SchedulerSide:
    """The scheduler role of one engine: its CacheScheduler (``plan_type`` plans; with L3 the existence stores and the
    controller), tier events, lookup trace and estimates file, with the start-up warnings and line logged. ``size``:
    the host pool's sizing (:func:`~tierkv.connector.vllm.sizing.pool_size`)."""
    from tierkv.connector.core.scheduler import CacheScheduler
    num_slots = size.bytes // geo.page_bytes
    if num_slots == 0:
        logger.warning("tierkv: host pool of %d bytes (%s) holds no page of %d bytes; serving without L2",
                       size.bytes, _SIZE_KEYS[size.size_from], geo.page_bytes)
    ctl, exists_stores = None, ()
    if cfg.l3.backend != "none":
        exists, exists_stores = scheduler_exists_for(cfg, namespace, num_slots, geo.page_bytes)
        ctl = dict(cfg.controller.scheduler_kwargs(), world_size=geo.world_size, exists_fn=exists,
                   admission=cfg.l3.admission, admission_window_pages=cfg.l3.admission_window_pages)
        LoadPolicy.hybrid_override(ctl, geo.hybrid)
        if getattr(kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
            logger.warning("tierkv: with an L3 store set \"kv_load_failure_policy\": \"recompute\" in "
                           "--kv-transfer-config; with \"fail\" a page that arrives late or corrupt from L3 "
                           "ends its request with an error instead of being recomputed")
    sched = CacheScheduler(namespace, geo.page_size, geo.block_size, num_slots, cfg.eviction_policy, controller=ctl,
                           plan_type=plan_type, eviction_params={"protected_fraction": cfg.slru_protected_fraction,
                                                                 "small_fraction": cfg.s3fifo_small_fraction})
    requests: dict[str, Any] = {}
    events = _tier_events(vllm_config, kv_cache_config, cfg, geo, num_slots, requests)
    if events is not None:
        sched.index.events = events
    if num_slots > 0:  # bytes per tier written and served, and the write-only warning (connector/obs/tier_bytes.py)
        from tierkv.connector.obs.tier_bytes import TierBytes
        sched.tier_bytes = TierBytes(geo.page_bytes * geo.world_size,
                                     geo.page_bytes * (1 if geo.use_mla else geo.world_size), geo.page_size,
                                     cfg.controller.write_only_warn_bytes)
    if cfg.trace_path:  # the lookup trace for `tierkv plan` (connector/obs/lookup_trace.py)
        from tierkv.connector.obs.lookup_trace import LookupTrace
        sched.trace = LookupTrace(cfg.trace_path, geo.page_size, num_slots, cfg.eviction_policy)
    estimates = None
    if ctl is not None and num_slots > 0:  # a predecessor's recompute estimate (connector/l3/estimates.py)
        from tierkv.connector.l3.estimates import EstimateFile
        estimates = EstimateFile(namespace.digest().hex())
        prior = estimates.load()
        if prior is not None:
            sched.observe_prefill(prior, 1)
            logger.info("tierkv: recompute estimate %.1f us/token from %s", 1e6 * prior, estimates.path)
    max_pages = (int(vllm_config.model_config.max_model_len) + geo.page_size - 1) // geo.page_size
    if 0 < num_slots < max_pages:
        logger.warning("tierkv: L2 holds %d pages, fewer than one request of max_model_len (%d pages); "
                       "pages that do not fit are not cached", num_slots, max_pages)
    logger.info(startup_line(cfg, num_slots=num_slots, page_bytes=geo.page_bytes, page_size=geo.page_size,
                             ranks=size.local_ranks, size_from=size.size_from, budget=size.budget,
                             num_blocks=geo.num_blocks, layout=namespace.kv_layout,
                             namespace_hex=namespace.digest().hex(), local=(*geo.local_layers, geo.local_window),
                             hybrid=geo.hybrid))
    return SchedulerSide(sched, geo, StatsFile(cfg.stats_path, "scheduler", sched.stats), events=events,
                         estimates=estimates, exists_stores=exists_stores, requests=requests)
