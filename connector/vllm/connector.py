"""vLLM v1 KV connector for tierkv: the only module that imports vLLM (besides its helpers in this package).

Load it with ``--kv-transfer-config '{"kv_connector": "TierKVConnector", "kv_connector_module_path":
"tierkv.connector.vllm.connector", "kv_role": "kv_both", "kv_connector_extra_config": {"config_file": ...}}'``
(the extra config may override any key of :mod:`tierkv.connector.core.config`). One class serves both roles, which
share nothing but the per-step :class:`ConnectorPlan`: the scheduler role drives a
:class:`~tierkv.connector.core.scheduler.CacheScheduler` through :class:`.scheduler_side.SchedulerSide`, the worker
role a :class:`~tierkv.connector.l2.worker.CacheWorker` through :class:`~tierkv.connector.l2.step.WorkerStep`.
L2 loads are synchronous in vLLM's sense; L3 loads asynchronous (the request waits in ``WAITING_FOR_REMOTE_KVS``)
unless estimated short enough; saves complete in ``wait_for_save``. ``requires_kv_delivery`` is False (a
best-effort cache); with L3 set ``"kv_load_failure_policy": "recompute"``. Geometry and refused model kinds:
:mod:`.geometry`; namespace: :mod:`.namespace`; pool size: :mod:`.sizing`; stores: :mod:`.stores`. A store that
cannot start is a warning (served without L3); a bad configuration is a ConfigError naming the key.
"""
from __future__ import annotations

import atexit
import logging
from typing import TYPE_CHECKING, Any, Optional

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                               KVConnectorRole, KVConnectorTransferResults,
                                                               KVConnectorWorkerMetadata, SupportsHMA)

from tierkv.connector.core.config import TierKVConfig, config_from_extra
from tierkv.connector.obs.metrics import StatsFile
from tierkv.connector.core.plan import JobReport, StepPlan
from tierkv.connector.obs.store_metrics import TimedStore
from .geometry import _geometry, engine_geometry  # noqa: F401  (re-exported)
from .namespace import (device_packing, kv_dtype_name, lora_key, model_namespace,  # noqa: F401  (re-exported)
                        page_namespace_facts, rank_namespace, rank_namespaces)
from tierkv.connector.l2.step import STEP_READ_WAIT_FRACTION, WorkerStep  # noqa: F401  (re-exported)
from .pools import build_worker
from .scheduler_side import STATS_EVERY_S, SchedulerSide, build_scheduler_side  # noqa: F401  (re-exported)
from .sizing import pool_size
from .stores import SCHEDULER_EXISTS_TIMEOUT_S, build_worker_l3, scheduler_exists, scheduler_exists_for  # noqa: F401
from .hooks import PARAMS_LOG_EVERY_S, _hook_error, _params_log, _timed_hook  # noqa: F401
from .metrics import SCHEDULER_ONLY, CounterDeltas, TierKVPromMetrics, TierKVStats

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
        size = pool_size(self.cfg, vllm_config, geo.page_bytes, len(geo.layer_names), geo.page_size,
                         worker=role == KVConnectorRole.WORKER)
        pool_bytes, self._size_from, self._budget = size.bytes, size.size_from, size.budget
        self._local_ranks, self._group = size.local_ranks, size.group
        self.num_slots = pool_bytes // self.page_bytes
        self.tp_size = geo.tp_size
        self.namespace = model_namespace(vllm_config, kv_cache_config, geo, self.cfg)
        self.world_size = geo.world_size
        self.use_l3 = self.cfg.l3.backend != "none"
        self._side: Optional[SchedulerSide] = None  # scheduler: what its hooks call
        self._sched = None  # scheduler: the CacheScheduler (self._side.sched)
        self._worker = None
        self._step: Optional[WorkerStep] = None  # worker: the step protocol over _worker
        if role == KVConnectorRole.SCHEDULER:
            self._side = build_scheduler_side(vllm_config, kv_cache_config, self._kv_transfer_config, self.cfg, geo,
                                              self.namespace, size, ConnectorPlan)
            self._sched, self._stats = self._side.sched, self._side.stats_file
        else:
            self._stats = StatsFile(self.cfg.stats_path, "worker", self._worker_stats, snapshot_thread_safe=True)
            self._deltas = CounterDeltas(SCHEDULER_ONLY)
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
        if self._side is not None:
            return self._side.stats()
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
        self._side.track(request)

    @_timed_hook
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[Optional[int], bool]:
        """How many tokens beyond vLLM's own prefix-cache hit tierkv can add, from the request's full pages (hashed once
        per request) matched against the index: ``(n, False)`` for an L2 hit and for an L3 hit whose read is estimated
        to take at most ``controller.sync_load_max_s`` (loaded before the forward of the step that admits it),
        ``(n, True)`` for any other L3 hit (an asynchronous load) and for every hit of a model with several KV cache
        groups, ``(None, False)`` while an L3 existence answer or L2 staging room is pending (vLLM asks
        again next step), ``(0, False)`` after an error. The index changes only by existence answers (pages found in L3)
        and, under ``write_back``, by backups of L2 victims started to make room."""
        return self._side.lookup(request, num_computed_tokens)

    @_timed_hook
    def update_state_after_alloc(self, request: "Request", blocks, num_external_tokens: int) -> None:
        """L2 hit: lock the matched path and add a load order (L2 slots -> the request's new engine blocks) to the
        step's plan; L3 hit: give its L3-only pages staging slots and order a prefetch job. Several KV cache groups:
        the order carries every group's blocks (``blocks.get_block_ids()``). After an error the promised blocks go
        into the next plan as failed loads (vLLM recomputes them)."""
        self._side.allocated(request, blocks, num_external_tokens)

    @_timed_hook(step=True)
    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        """Release preempted requests; for each scheduled request order saves of the pages that are full once this step
        has run and have no L2 copy yet (slots allocated, unlocked L2 copies evicted; the plan's own new pages stay
        locked until it is handed over) and index them; count the step's prompt tokens; hand the plan
        (``ConnectorPlan``) over.

        Full means full of verified tokens: under speculative decoding the step's draft tokens
        (``scheduled_spec_decode_tokens``) do not count, and neither does any token not yet in the request's token
        list (the scheduler side caps at its length)."""
        return self._side.build_plan(scheduler_output, self._kv_cache_manager)

    @_timed_hook
    def update_connector_output(self, connector_output) -> None:
        """The workers' job reports and timed forwards; ``finished_recving`` (L3 loads ended: those blocks are never
        delayed again); vLLM's ``invalid_block_ids``: pages computed on a failed load leave the index."""
        if self._side is not None:
            self._side.output(connector_output)

    @_timed_hook
    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, Optional[dict]]:
        """Release the request's lock; ``(True, ...)`` (vLLM keeps the blocks) only while the workers have not named
        its L3 load as ended, else ``(False, ...)``; the dict (the response's ``kv_transfer_params``) is None, or
        ``{"tierkv_error": ...}`` when the request's tierkv controls were refused."""
        return self._side.finished(request)

    @_timed_hook
    def request_finished_all_groups(self, request: "Request",
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, Optional[dict]]:
        """vLLM's ``SupportsHMA`` hook, called instead of :meth:`request_finished` with one block list per KV cache
        group: the same answer (tierkv's pages were saved when computed, nothing is read from the blocks now)."""
        return self._side.finished(request)

    @_timed_hook
    def has_pending_push_work(self) -> bool:
        """Keeps vLLM's engine stepping (empty steps, no forward) while a backup or prefetch has not reported: its
        report arrives only with a step's output, and until then it pins L2 pages and slots. Without this an engine
        that went idle right after a burst kept them pinned until the next request. A job
        out longer than ``controller.shutdown_drain_s`` no longer counts: vLLM's shutdown waits for this too, and a
        store that stalls must not hold it up. Also one step more when the engine has no request left and the last
        plan told the workers to hold their counter deltas back (:data:`STATS_EVERY_S`): that step hands them over."""
        return self._side is not None and self._side.pending_push_work()

    @_timed_hook
    def take_events(self):
        """vLLM's ``BlockStored`` / ``BlockRemoved`` events for pages that entered or left L2 (``medium="CPU"``) or
        L3 (``medium="STORAGE"``, ``ownership="L3:<backend>"``) since the last step (:mod:`tierkv.connector.obs.kv_events`);
        vLLM publishes them after its own L1 events of the step. Empty when KV events are off."""
        return self._side.take_events() if self._side is not None else ()

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
        if self._side is not None:
            self._side.close()
        self._stats.close()  # the final counters, after the last backups drained

    # =========================================================== worker side
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Build the device pool adapter over vLLM's KV tensors and the host pool (as many slots as the scheduler side),
        with an L3 store this rank's store and I/O threads (a store that cannot start: a warning, served without L3);
        warm the kernels up."""
        self._worker, self._switch_prev = build_worker(self._vllm_config, self.kv_cache_config, self.cfg, self.geo,
                                                       self.namespace, self.num_slots, self._size_from, kv_caches)
        if self._worker is not None:
            self._step = WorkerStep(self._worker, self.page_size, self.hybrid, _hook_error,
                                    backup_pause=self.cfg.controller.backup_pause)
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
