"""vLLM v1 KV connector for tierkv: the only module that imports vLLM (besides its helpers in this package).

Load it with ``--kv-transfer-config '{"kv_connector": "TierKVConnector", "kv_connector_module_path":
"tierkv.connector.vllm.connector", "kv_role": "kv_both", "kv_connector_extra_config": {"config_file": ...}}'``
(the extra config may override any key of :mod:`tierkv.connector.core.config`). One class serves both roles, which
share nothing but the per-step :class:`ConnectorPlan`: the scheduler role drives
:class:`tierkv.connector.core.scheduler.CacheScheduler`, the worker role a
:class:`tierkv.connector.l2.worker.CacheWorker` through :class:`tierkv.connector.l2.step.WorkerStep`.
L2 loads are synchronous in vLLM's sense; L3 loads asynchronous (the request waits in ``WAITING_FOR_REMOTE_KVS``)
unless estimated short enough; saves complete in ``wait_for_save``. ``requires_kv_delivery`` is False (a
best-effort cache); with L3 set ``"kv_load_failure_policy": "recompute"``. Geometry and refused model kinds:
:mod:`.geometry`; namespace: :mod:`.namespace`; pool size: :mod:`.sizing`; stores: :mod:`.stores`. A store that
cannot start is a warning (served without L3); a bad configuration is a ConfigError naming the key.
"""
from __future__ import annotations

import math
import atexit
import logging
import time
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorTransferResults,
                                                               KVConnectorWorkerMetadata, SupportsHMA)

from tierkv.connector.core.config import TierKVConfig, config_from_extra
from tierkv.connector.obs.metrics import StatsFile
from tierkv.connector.core.plan import JobReport, StepPlan
from tierkv.connector.core.request_params import RequestControls, RequestParamsError, parse_controls
from tierkv.connector.obs.store_metrics import TimedStore
from .geometry import _geometry, engine_geometry  # noqa: F401  (re-exported)
from .namespace import (device_packing, kv_dtype_name, lora_key, model_namespace,  # noqa: F401  (re-exported)
                        page_namespace_facts, rank_namespace, rank_namespaces)
from tierkv.connector.l2.step import STEP_READ_WAIT_FRACTION, WorkerStep  # noqa: F401  (re-exported)
from tierkv.connector.l3.load_policy import LoadPolicy
from .pools import build_worker
from .sizing import _SIZE_KEYS, pool_size, startup_line
from .stores import SCHEDULER_EXISTS_TIMEOUT_S, build_worker_l3, scheduler_exists, scheduler_exists_for  # noqa: F401
from .hooks import PARAMS_LOG_EVERY_S, _hook_error, _params_log, _timed_hook  # noqa: F401
from .metrics import (REUSE_KEYS, SCHEDULER_ONLY, CounterDeltas, TierKVPromMetrics, TierKVStats,
                           scheduler_gauges)

if TYPE_CHECKING:  # pragma: no cover
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

logger = logging.getLogger("tierkv.vllm")


class ConnectorPlan(StepPlan, KVConnectorMetadata):
    """The per-step metadata vLLM pickles to every worker: a :class:`StepPlan` (the scheduler side builds its plans
    as this class, ``CacheScheduler(plan_type=...)``, so handing one over copies nothing)."""


class TierKVWorkerMeta(KVConnectorWorkerMetadata):
    """Worker -> scheduler: the :class:`~tierkv.connector.core.plan.JobReport` s of one step and the timed forwards
    (``(step, prompt tokens, seconds)``) of steps that computed enough prompt tokens. vLLM merges the ranks' objects
    with :meth:`aggregate` (concatenation: the scheduler side waits for every rank's report of a job and merges
    them page by page; of a step timed by several ranks it takes the slowest)."""

    def __init__(self, reports: Optional[list[JobReport]] = None,
                 forwards: Optional[list[tuple[int, int, float]]] = None):
        self.reports: list[JobReport] = list(reports or [])
        self.forwards: list[tuple[int, int, float]] = list(forwards or [])

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "TierKVWorkerMeta":
        return TierKVWorkerMeta(self.reports + list(getattr(other, "reports", []) or []),
                                self.forwards + list(getattr(other, "forwards", []) or []))



def route_logs_to_vllm(level: str) -> None:
    """Send the ``tierkv`` loggers' records to vLLM's handlers (same format and stream as vLLM's own lines).

    ``tierkv.*`` is not under vLLM's ``vllm`` logger, so without this its records reach only Python's last-resort
    handler (warnings and errors on stderr, no INFO line). Idempotent."""
    from vllm.logger import init_logger
    init_logger("vllm.tierkv")  # makes sure vLLM configured its root logger
    tk, vl = logging.getLogger("tierkv"), logging.getLogger("vllm")
    tk.setLevel(level.upper())
    if vl.handlers and not tk.handlers:
        for h in vl.handlers:
            tk.addHandler(h)
        tk.propagate = False


#: seconds between two hand-overs of counter deltas to vLLM's metrics (:meth:`TierKVConnector.get_kv_connector_stats`,
#: both roles). A hand-over snapshots every counter of the role and diffs it against the previous one; vLLM calls the
#: hook every step, its loggers read the result every few seconds. In the steps between, the hook returns None and the
#: increases accumulate (nothing is lost); steps without a scheduled request (the engine draining) always hand over,
#: and an engine that goes idle in between is kept stepping once more so that the workers hand over theirs
#: (:meth:`TierKVConnector.has_pending_push_work`).
STATS_EVERY_S = 0.1


class TierKVConnector(KVConnectorBase_V1, SupportsHMA):
    """tierkv as a vLLM ``KVConnectorBase_V1`` (see the module docstring); ``SupportsHMA``, so vLLM keeps its hybrid
    KV cache manager on and calls :meth:`request_finished_all_groups`."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        from tierkv.connector.cpu.cpu_features import request_amx_permission
        request_amx_permission()  # before any page moves: vLLM's AMX kernels die of SIGILL without it (cpu_features)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.cfg: TierKVConfig = config_from_extra(extra)
        route_logs_to_vllm(self.cfg.log_level)
        geo = engine_geometry(vllm_config, kv_cache_config, self.cfg)
        self.geo, self.kv_cache_config, self.spec = geo, kv_cache_config, geo.spec
        self.block_size, self.page_size, self.blocks_per_page = geo.block_size, geo.page_size, geo.blocks_per_page
        self.layer_names, self.local_window, self.group_names = geo.layer_names, geo.local_window, geo.group_names
        self.ref_group, self.hybrid, self.local_layers = geo.ref_group, geo.hybrid, geo.local_layers
        self.num_blocks, self.use_mla, self.page_bytes = geo.num_blocks, geo.use_mla, geo.page_bytes
        mc = vllm_config.model_config
        size = pool_size(self.cfg, vllm_config, geo.page_bytes, len(geo.layer_names), geo.page_size,
                         worker=role == KVConnectorRole.WORKER)
        pool_bytes, self._size_from, self._budget = size.bytes, size.size_from, size.budget
        self._local_ranks, self._group = size.local_ranks, size.group
        self.num_slots = pool_bytes // self.page_bytes
        self.tp_size = geo.tp_size
        self.namespace = model_namespace(vllm_config, kv_cache_config, geo, self.cfg)
        self.world_size = geo.world_size
        self.use_l3 = self.cfg.l3.backend != "none"
        self._sched = None
        self._worker = None
        self._step: Optional[WorkerStep] = None  # worker: the step protocol over _worker
        self._requests: dict[str, "Request"] = {}
        self._param_errors: dict[str, str] = {}  # request -> why its kv_transfer_params["tierkv"] was refused
        self._clock = time.perf_counter  # seconds; the counter hand-overs' clock (tests replace it)
        self._stats_due = -math.inf         # scheduler: ``_clock`` time of its next counter hand-over (STATS_EVERY_S)
        self._plan_stats_due = -math.inf    # scheduler: same for the workers, ordered through the plan (emit_stats)
        self._worker_stats_owed = False  # scheduler: the last plan told the workers to hold their deltas back
        if role == KVConnectorRole.SCHEDULER:
            from tierkv.connector.core.scheduler import CacheScheduler
            if self.num_slots == 0:
                logger.warning("tierkv: host pool of %d bytes (%s) holds no page of %d bytes; serving without L2",
                               pool_bytes, _SIZE_KEYS[self._size_from], self.page_bytes)
            ctl = None
            if self.use_l3:
                exists, self._exists_stores = scheduler_exists_for(self.cfg, self.namespace, self.num_slots,
                                                                   self.page_bytes)
                ctl = dict(self.cfg.controller.scheduler_kwargs(), world_size=self.world_size, exists_fn=exists)
                LoadPolicy.hybrid_override(ctl, self.hybrid)
                if getattr(self._kv_transfer_config, "kv_load_failure_policy", "recompute") != "recompute":
                    logger.warning("tierkv: with an L3 store set \"kv_load_failure_policy\": \"recompute\" in "
                                   "--kv-transfer-config; with \"fail\" a page that arrives late or corrupt from L3 "
                                   "ends its request with an error instead of being recomputed")
            self._sched = CacheScheduler(self.namespace, self.page_size, self.block_size, self.num_slots,
                                         self.cfg.eviction_policy, controller=ctl, plan_type=ConnectorPlan)
            self._events = self._tier_events(vllm_config)
            if self.cfg.trace_path:  # the lookup trace for `tierkv plan` (connector/obs/lookup_trace.py)
                from tierkv.connector.obs.lookup_trace import LookupTrace
                self._sched.trace = LookupTrace(self.cfg.trace_path, self.page_size, self.num_slots,
                                                self.cfg.eviction_policy)
            self._estimates = None
            if ctl is not None and self.num_slots > 0:  # a predecessor's recompute estimate (connector/l3/estimates.py)
                from tierkv.connector.l3.estimates import EstimateFile
                self._estimates = EstimateFile(self.namespace.digest().hex())
                prior = self._estimates.load()
                if prior is not None:
                    self._sched.observe_prefill(prior, 1)
                    logger.info("tierkv: recompute estimate %.1f us/token from %s", 1e6 * prior,
                                self._estimates.path)
            max_pages = (int(mc.max_model_len) + self.page_size - 1) // self.page_size
            if 0 < self.num_slots < max_pages:
                logger.warning("tierkv: L2 holds %d pages, fewer than one request of max_model_len (%d pages); "
                               "pages that do not fit are not cached", self.num_slots, max_pages)
            logger.info(startup_line(self.cfg, num_slots=self.num_slots, page_bytes=self.page_bytes,
                                     page_size=self.page_size, ranks=self._local_ranks, size_from=self._size_from,
                                     budget=self._budget, num_blocks=self.num_blocks,
                                     layout=self.namespace.kv_layout, namespace_hex=self.namespace.digest().hex(),
                                     local=(*self.local_layers, self.local_window), hybrid=self.hybrid))
            self._stats = StatsFile(self.cfg.stats_path, "scheduler", self._sched.stats)
        else:
            self._stats = StatsFile(self.cfg.stats_path, "worker", self._worker_stats, snapshot_thread_safe=True)
        self._deltas = CounterDeltas() if role == KVConnectorRole.SCHEDULER else CounterDeltas(SCHEDULER_ONLY)
        atexit.register(self._stats.close)

    # =========================================================== class-level hooks
    @property
    def requires_kv_delivery(self) -> bool:
        """False: tierkv is a best-effort cache, a page it cannot deliver is recomputed."""
        return False

    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: "VllmConfig") -> Optional[str]:
        """None: any KV cache layout; the device pool adapter reads the one vLLM resolved from the strides."""
        return None  # any layout: the device pool adapter reads the one vLLM resolved

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[dict] = None) -> TierKVStats:
        """A ``TierKVStats`` over ``data`` (vLLM rebuilds the workers' stats)."""
        return TierKVStats(data=dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        """The ``vllm:tierkv_*`` Prometheus series (``TierKVPromMetrics``)."""
        return TierKVPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    @_timed_hook
    def get_kv_connector_stats(self) -> Optional[TierKVStats]:
        """Counter increases, changed gauges and L3 latency samples since the previous hand-over (both roles; vLLM
        sums the workers'), see :mod:`tierkv.connector.vllm.metrics`; None in the steps between two hand-overs
        (:data:`STATS_EVERY_S`): the scheduler side hands over once that time has passed or when it has no request
        left, a worker when the step's plan says so (``StepPlan.emit_stats``, or no plan bound) and in every step
        that moved its counters: a plan with loads, saves or jobs, a load that ended (:meth:`get_finished`) or a job
        report waiting. So an engine that stops stepping as soon as its requests are done (vLLM's offline ``LLM``
        with the EngineCore in its process) has handed over every step's copies."""
        if self._sched is not None:
            now = self._clock()
            if now < self._stats_due and self._sched.has_requests():
                return None
            self._stats_due = now + STATS_EVERY_S
            snap = self._sched.stats()
            self._stats.maybe_write(data=dict(snap))   # the stats file, from the same snapshot (once a hand-over)
            snap.update(scheduler_gauges(snap))
            lat: dict[str, list] = {}
            for store in getattr(self, "_exists_stores", ()):  # existence answered in this process
                for k, v in store.take_latencies().items():
                    lat.setdefault(k, []).extend(v)
            tiers = {tier: key for key, tier in REUSE_KEYS.items()}
            for tier, v in self._sched.lookup_stats.take_samples().items():
                lat[tiers[tier]] = v
            return self._deltas.take(snap, lat or None)
        plan = getattr(self, "_connector_metadata", None)
        if (self._step.holds_stats_back(plan) if self._step is not None
                else isinstance(plan, StepPlan) and not plan.emit_stats and plan.is_empty()):
            return None
        snap = self._worker_stats()
        lat = None
        l3 = self._worker.l3 if self._worker is not None else None
        if l3 is not None and isinstance(l3.store, TimedStore):
            lat = l3.store.take_latencies()
        return self._deltas.take(snap, lat)

    # =========================================================== scheduler side
    @_timed_hook
    def on_new_request(self, request: "Request") -> None:
        """Register the request (tokens, LoRA name, cache salt) with the scheduler side."""
        self._track(request)

    def _track(self, request: "Request") -> None:
        if request.request_id not in self._requests:
            self._requests[request.request_id] = request
            lora = lora_key(getattr(request, "lora_request", None))
            self._sched.add_request(request.request_id, request.all_token_ids, lora=lora,
                                    cache_salt=getattr(request, "cache_salt", None), controls=self._controls(request))

    def _controls(self, request: "Request") -> Optional[RequestControls]:
        """The request's tierkv controls (``kv_transfer_params["tierkv"]``, :mod:`tierkv.connector.core.request_params`).
        Malformed ones (a front-end without the :mod:`tierkv.connector.vllm.params_check` validator let them through)
        are refused here: the request is served without tierkv (nothing loaded, nothing saved), the refusal is
        counted (``request_params_refused``) and logged, and its response's ``kv_transfer_params`` carries
        ``{"tierkv_error": <message naming the field>}``."""
        try:
            return parse_controls(getattr(request, "kv_transfer_params", None))
        except RequestParamsError as e:
            self._sched.counters.request_params_refused += 1
            self._param_errors[request.request_id] = str(e)
            _params_log().warning("params", "tierkv: request %s: %s; served without tierkv", request.request_id, e)
            return RequestControls(load=False, save=False)

    @_timed_hook
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """How many tokens beyond vLLM's own prefix-cache hit tierkv can add, from the request's full pages (hashed once
        per request) matched against the index: ``(n, False)`` for an L2 hit and for an L3 hit whose read is estimated
        to take at most ``controller.sync_load_max_s`` (loaded before the forward of the step that admits it),
        ``(n, True)`` for any other L3 hit (an asynchronous load) and for every hit of a model with several KV cache
        groups, ``(None, False)`` while an L3 existence answer or L2 staging room is pending (vLLM asks
        again next step), ``(0, False)`` after an error. The index changes only by existence answers (pages found in L3)
        and, under ``write_back``, by backups of L2 victims started to make room."""
        try:
            return self._matched(request, num_computed_tokens)
        except Exception as e:  # a miss, never an engine crash
            _hook_error(self._sched.counters, "get_num_new_matched_tokens", e)
            self._sched.drop_async_hit(request.request_id)
            return 0, False

    def _matched(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        self._track(request)
        if getattr(request, "skip_reading_prefix_cache", False):  # vLLM ignores any answer: not counted either
            self._sched.no_read(request.request_id, num_computed_tokens)
            return 0, False
        n = self._sched.lookup(request.request_id, num_computed_tokens)
        if n is None:
            return None, False  # an L3 answer or L2 room is pending: vLLM asks again next step
        # several KV cache groups: every hit is an asynchronous load, because vLLM takes a failed load of such a model
        # only as a failed request (failed_recving), never as failed block ids
        return n, bool(n > 0 and (self.hybrid or self._sched.lookup_is_async(request.request_id)))

    @_timed_hook
    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        """L2 hit: lock the matched path and add a load order (L2 slots -> the request's new engine blocks) to the
        step's plan; L3 hit: give its L3-only pages staging slots and order a prefetch job. Several KV cache groups:
        the order carries every group's blocks (``blocks.get_block_ids()``). After an error the promised blocks go
        into the next plan as failed loads (vLLM recomputes them)."""
        block_ids: list[int] = []
        is_async = False
        try:
            self._track(request)
            groups = blocks.get_block_ids() if num_external_tokens else ()
            block_ids = groups[self.ref_group] if num_external_tokens else []
            is_async = self.hybrid or self._sched.lookup_is_async(request.request_id)
            if self.hybrid:
                self._sched.on_alloc(request.request_id, block_ids, num_external_tokens, groups)
            else:
                self._sched.on_alloc(request.request_id, block_ids, num_external_tokens)
        except Exception as e:  # the promised tokens are reported as failed loads: vLLM recomputes them
            _hook_error(None, "update_state_after_alloc", e)
            self._sched.alloc_failed(request.request_id, list(block_ids), num_external_tokens, is_async)

    @_timed_hook(step=True)
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Release preempted requests; for each scheduled request order saves of the pages that are full once this step
        has run and have no L2 copy yet (slots allocated, unlocked L2 copies evicted; the plan's own new pages stay
        locked until it is handed over) and index them; count the step's prompt tokens; hand the plan
        (``ConnectorPlan``) over.

        Full means full of verified tokens: under speculative decoding the step's draft tokens
        (``scheduled_spec_decode_tokens``) do not count, and neither does any token not yet in the request's token
        list (the scheduler side caps at its length)."""
        sched = self._sched
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
                self._plan_saves(rid, tokens_after - len(drafts.get(rid, ())), state, blocks)
            except Exception as e:  # that request's pages are not saved this step; nothing else changes
                _hook_error(sched.counters, "build_connector_meta", e)
        meta = sched.build_plan()  # a ConnectorPlan (plan_type): vLLM's metadata as built, no copy
        meta.prefill_tokens = sum(self._prompt_tokens(rid, done, after - done) for rid, after, _b in todo
                                  for done in [after - n_sched.get(rid, 0)])
        now = self._clock()
        meta.emit_stats = not todo or now >= self._plan_stats_due  # (STATS_EVERY_S; a step without requests: always)
        if meta.emit_stats:
            self._plan_stats_due = now + STATS_EVERY_S
        self._worker_stats_owed = not meta.emit_stats
        return meta

    def _prompt_tokens(self, rid: str, computed: int, scheduled: int) -> int:
        """Of the ``scheduled`` tokens of ``rid`` in a step starting at ``computed``, how many are prompt tokens."""
        req = self._requests.get(rid)
        prompt = int(getattr(req, "num_prompt_tokens", 0) or 0) if req is not None else 0
        return max(0, min(computed + scheduled, prompt) - computed)

    @_timed_hook
    def update_connector_output(self, connector_output) -> None:
        """The workers' job reports and timed forwards; ``finished_recving`` (L3 loads ended: those blocks are never
        delayed again); vLLM's ``invalid_block_ids``: pages computed on a failed load leave the index."""
        if self._sched is None:
            return
        try:
            self._connector_output(connector_output)
        except Exception as e:
            _hook_error(self._sched.counters, "update_connector_output", e)

    def _connector_output(self, connector_output) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if meta is not None:
            self._sched.on_reports(getattr(meta, "reports", []) or [])
            self._observe_forwards(getattr(meta, "forwards", []) or [])
        # requests whose L3 load the workers named as ended: their blocks are never delayed again at finish; the
        # blocks whose load failed in that step say where each load was cut (the lookup statistics)
        failed = getattr(connector_output, "failed_recving", None) or ()
        self._sched.on_finished_recving(getattr(connector_output, "finished_recving", None) or (),
                                        getattr(connector_output, "invalid_block_ids", None) or (), failed)
        # blocks whose load failed in that step (every rank's): pages computed on them leave the index
        self._sched.on_load_errors(getattr(connector_output, "invalid_block_ids", None) or ())
        if self.hybrid and failed:  # several groups: failed loads come as requests; their loaded pages leave too
            self._sched.on_failed_loads(failed)
        if meta is not None and not self._sched.has_requests():  # idle: the last reports of the drained work
            self._stats.write_soon()

    def _observe_forwards(self, forwards) -> None:
        """The engine's prefill time per token, for the controller's "never slower than recomputing" check: forwards
        the workers timed (bind_connector_metadata -> wait_for_save) in steps that computed at least four pages of prompt
        tokens; idle time between steps and decode-only steps do not count. Several ranks: the slowest."""
        if self._estimates is None or not forwards:  # no L3: nothing decides by the estimate
            return
        by_step: dict[int, tuple[int, float]] = {}
        for step, tokens, seconds in forwards:
            t, s = by_step.get(step, (tokens, 0.0))
            by_step[step] = (t, max(s, seconds))
        estimate = None
        for tokens, seconds in by_step.values():
            estimate = self._sched.observe_prefill(seconds, tokens)
        self._estimates.maybe_save(estimate)

    def _plan_saves(self, rid: str, tokens_after: int, state, fallback_blocks) -> None:
        if not self._sched.needs_saves(rid, tokens_after):  # no new full page (most decode steps): no block table
            return
        ids = state.get_block_ids(rid) if state is not None else None
        if ids is None:
            if fallback_blocks is not None:
                ids = fallback_blocks
            elif self._kv_cache_manager is not None:
                ids = self._kv_cache_manager.get_block_ids(rid)
            else:
                return
        if self.hybrid:  # every group's table; the full-attention group's for the page count
            self._sched.schedule_saves(rid, tokens_after, ids[self.ref_group], ids)
        else:
            self._sched.schedule_saves(rid, tokens_after, ids[0])

    @_timed_hook
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """Release the request's lock; ``(True, ...)`` (vLLM keeps the blocks) only while the workers have not named
        its L3 load as ended, else ``(False, ...)``; the dict (the response's ``kv_transfer_params``) is None, or
        ``{"tierkv_error": ...}`` when the request's tierkv controls were refused."""
        return self._request_finished(request)

    def _request_finished(self, request: "Request") -> tuple[bool, Optional[dict]]:
        """:meth:`request_finished`'s work, untimed (so :meth:`request_finished_all_groups` does not count it twice)."""
        try:
            delay = self._sched.on_finished(request.request_id)
        except Exception as e:  # the blocks go back at once: the workers never copy into a finished request's blocks
            _hook_error(self._sched.counters, "request_finished", e)
            delay = False
        self._requests.pop(request.request_id, None)
        if not self._sched.has_requests():  # the engine may go idle now, and no later step would write the counters
            self._stats.write_soon()
        err = self._param_errors.pop(request.request_id, None)
        return delay, ({"tierkv_error": err} if err is not None else None)  # the response's kv_transfer_params

    @_timed_hook
    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict]]:
        """vLLM's ``SupportsHMA`` hook, called instead of :meth:`request_finished` with one block list per KV cache
        group: the same answer (tierkv's pages were saved when computed, nothing is read from the blocks now)."""
        return self._request_finished(request)

    @_timed_hook
    def has_pending_push_work(self) -> bool:
        """Keeps vLLM's engine stepping (empty steps, no forward) while a backup or prefetch has not reported: its
        report arrives only with a step's output, and until then it pins L2 pages and slots. Without this an engine
        that went idle right after a burst kept them pinned until the next request. A job
        out longer than ``controller.shutdown_drain_s`` no longer counts: vLLM's shutdown waits for this too, and a
        store that stalls must not hold it up. Also one step more when the engine has no request left and the last
        plan told the workers to hold their counter deltas back (:data:`STATS_EVERY_S`): that step hands them over."""
        try:
            return self._sched is not None and (self._sched.pins_pending()
                                                or (self._worker_stats_owed and not self._sched.has_requests()))
        except Exception as e:
            _hook_error(self._sched.counters, "has_pending_push_work", e)
            return False

    def _tier_events(self, vllm_config):
        """The :class:`~tierkv.connector.obs.kv_events.TierEvents` feeding :meth:`take_events`, attached to the index,
        when vLLM publishes KV events (``--kv-events-config`` with ``enable_kv_cache_events``) and L2 holds pages;
        None otherwise (then the index pays nothing for events)."""
        ev_cfg = getattr(vllm_config, "kv_events_config", None)
        if ev_cfg is None or not getattr(ev_cfg, "enable_kv_cache_events", False) or self.num_slots == 0:
            return None
        from tierkv.connector.obs.kv_events import TierEvents, page_infos
        hash_block_size = int(getattr(self.kv_cache_config, "hash_block_size", 0) or self.block_size)

        def resolve(req_id: str, start: int, end: int):
            return page_infos(self._requests.get(req_id), start, end, self.block_size, hash_block_size,
                              self.blocks_per_page)

        try:
            from vllm.v1.kv_cache_interface import get_kv_cache_spec_kind
            kind = get_kv_cache_spec_kind(self.spec).value
        except Exception:  # a vLLM without the helper: the events go out without it
            kind = None
        events = TierEvents(resolve, block_size=self.block_size, spec_kind=kind,
                            l3_backend=self.cfg.l3.backend if self.use_l3 else None)
        self._sched.index.events = events
        return events

    @_timed_hook
    def take_events(self):
        """vLLM's ``BlockStored`` / ``BlockRemoved`` events for pages that entered or left L2 (``medium="CPU"``) or
        L3 (``medium="STORAGE"``, ``ownership="L3:<backend>"``) since the last step (:mod:`tierkv.connector.obs.kv_events`);
        vLLM publishes them after its own L1 events of the step. Empty when KV events are off."""
        events = getattr(self, "_events", None)
        if events is None:
            return ()
        records = events.take()
        try:
            return events.to_vllm(records)
        except Exception as e:  # those events are lost (counted as dropped); the engine goes on
            _hook_error(self._sched.counters, "take_events", e)
            events.counters["kv_events_dropped"] += len(records)
            return ()

    def reset_cache(self) -> Optional[bool]:
        """Drop every unlocked page from the index and free its L2 slots (vLLM's ``reset_prefix_cache``); None on a
        worker."""
        return self._sched.reset() if self._sched is not None else None

    def shutdown(self) -> None:
        """Both roles: write the final counters; a worker finishes its running loads and gives queued backups
        ``controller.shutdown_drain_s`` to reach the store."""
        self._stats.maybe_write(force=True)
        if self._worker is not None:
            self._worker.finish_loads()  # a layer-wise load still running (no-op otherwise)
            self._worker.close(self.cfg.controller.shutdown_drain_s)
            from tierkv.connector.l3.io import restore_switch_interval
            restore_switch_interval(getattr(self, "_switch_prev", None), self.cfg.controller.gil_switch_interval_s)
            self._switch_prev = None
        for store in getattr(self, "_exists_stores", ()):
            store.close()
        self._stats.close()  # the final counters, after the last backups drained

    # =========================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the device pool adapter over vLLM's KV tensors and the host pool (as many slots as the scheduler side),
        with an L3 store this rank's store and I/O threads (a store that cannot start: a warning, served without L3);
        warm the kernels up."""
        self._worker, self._switch_prev = build_worker(self._vllm_config, self.kv_cache_config, self.cfg, self.geo,
                                                       self.namespace, self.num_slots, self._size_from, kv_caches)
        if self._worker is not None:
            self._step = WorkerStep(self._worker, self.page_size, self.hybrid, _hook_error)
            self._stats.start_polling()  # counters moved by the L3 I/O threads between steps reach stats_path too

    @_timed_hook
    def get_finished(self, finished_req_ids: set[str]) -> tuple[Optional[set[str]], Optional[set[str]]]:
        """Requests whose asynchronous (L3) load ended (``finished_recving``), after their leading run of intact pages
        was copied L2 -> L1 (several KV cache groups: also those whose L2 load ran in this step, every hit of such a
        model being asynchronous); never ``finished_sending`` (saves end within their step).

        The L3 reads this step handed over before its forward and still running are waited for first, at most
        the wait :meth:`tierkv.connector.l3.load_policy.LoadPolicy.step_read_wait_s` allows since
        ``bind_connector_metadata`` (:class:`tierkv.connector.l2.step.WorkerStep`)."""
        return None, (self._step.end_step(finished_req_ids)[0] if self._step is not None else None)

    @_timed_hook
    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """:meth:`get_finished` as vLLM's transfer results; with several KV cache groups also the requests whose
        (asynchronous) load failed, as ``failed_recving`` (and ended): vLLM recomputes them."""
        recving, failed = (self._step.end_step(finished_req_ids, with_failed=True) if self._step is not None
                           else (None, set()))
        return KVConnectorTransferResults(finished_sending=set(), finished_recving=set(recving or ()) | failed,
                                          failed_recving=failed)

    @_timed_hook
    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        """The step's job reports and timed forwards (``TierKVWorkerMeta``), None when there are none."""
        result = self._step.take_result() if self._step is not None else None
        return TierKVWorkerMeta(*result) if result is not None else None

    def _worker_stats(self) -> dict:
        """The worker's counters, with the L3 store's own failure counts (``l3_errors``, ``l3_timeouts``: a ZMQ or
        Mooncake call abandoned after its ``timeout_s`` is a miss that nothing else counts); {} without a worker."""
        if self._worker is None:
            return {}
        d = self._worker.stats()
        l3 = self._worker.l3
        if l3 is not None and isinstance(l3.store, TimedStore):
            d.update(l3.store.failure_counts())
        return d

    @_timed_hook
    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        """Wait for the plan's synchronous L3 reads (at most their deadlines), then start its L2 -> L1 loads, those
        reads' leading intact pages included (all at once, or layer by layer with ``layerwise_load``) so they end
        before the layers read them; vLLM calls it before the forward only in steps with such synchronous loads, after
        it otherwise."""
        if self._step is not None:
            self._step.load(self._get_connector_metadata())

    @_timed_hook(step=True)
    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Before every forward (vLLM calls ``start_load_kv`` only after it when the step has no synchronous load):
        hand the plan's L3 reads to the readers, so they overlap the forward, and start timing the forward."""
        super().bind_connector_metadata(connector_metadata)
        if self._step is not None:
            self._step.before_forward(connector_metadata)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Layer by layer: wait until this layer's L2 -> L1 copies are done; a failed copy reports the step's loads as
        failed blocks. vLLM calls it for every layer of every step: without a load in flight it returns at once,
        untimed (the hook timer would cost more than the call)."""
        w = self._worker
        if w is not None and w.loading:
            self._wait_for_layer_load(layer_name)

    @_timed_hook
    def _wait_for_layer_load(self, layer_name: str) -> None:
        self._step.layer_ready(layer_name, self._get_connector_metadata)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        """Nothing (and untimed: vLLM calls it for every layer of every step): saves run once per step in
        ``wait_for_save``, after every layer wrote its KV."""
        return None  # saves run once per step in wait_for_save, after every layer wrote its KV

    @_timed_hook
    def wait_for_save(self) -> None:
        """End the forward's timing; finish the step's loads and run its L1 -> L2 saves, complete when the hook returns
        (none of a request whose load failed); then hand the plan's backups to the writer."""
        if self._step is None:
            return
        plan = self._get_connector_metadata()
        self._step.after_forward(plan)
        if isinstance(plan, StepPlan):
            self._stats.maybe_write()

    def get_kv_connector_kv_cache_events(self):
        """None (untimed: it does nothing): a worker has no tier events of its own. What a worker learns about L3
        (a page stored, missing or corrupt) reaches the scheduler side in its job reports, where the index changes
        and :meth:`take_events` publishes it."""
        return None

    @_timed_hook
    def get_block_ids_with_load_errors(self) -> set[int]:
        """Blocks whose page failed its checksum, whose copy raised or whose L3 page did not arrive in time; vLLM
        recomputes them."""
        return self._step.failed_blocks() if self._step is not None else set()
