"""The L3 stores a vLLM engine builds: the scheduler's own existence copy, and each worker rank's store and I/O threads.

:func:`scheduler_exists` answers "how many leading pages are in L3" inside the scheduler's process when the store
is local (file store, ZMQ server on this machine); otherwise the workers are asked. :func:`build_worker_l3` builds
one rank's store under its rank namespace (:func:`~tierkv.connector.vllm.namespace.rank_namespace`) with its
:class:`~tierkv.connector.l3.io.L3IO` threads; a store that cannot start is a logged warning and the worker serves
without L3, unless the store says the configuration itself is refused (``stops_startup``), which is raised.
"""
from __future__ import annotations

import logging
from typing import Optional

from tierkv.connector.core.config import TierKVConfig
from tierkv.connector.core.page_hash import ModelNamespace
from tierkv.connector.obs.store_metrics import TimedStore

from .namespace import rank_namespace, rank_namespaces

logger = logging.getLogger("tierkv.vllm")


#: seconds the scheduler's own copy of a networked store (``local_exists``) waits for an existence answer: a dead or
#: busy server costs the scheduler's loop at most this once per back-off window, and the workers are asked instead
SCHEDULER_EXISTS_TIMEOUT_S = 0.05


def scheduler_exists(l3_cfg, digests: list, page_bytes: int):
    """``(exists, stores)`` answering "how many leading page keys are in L3 under every one of ``digests``" in the
    calling (the engine scheduler's) process, or None when the store cannot answer here: it is not ``local_exists``
    (the file store and a ZMQ server on this machine are) or could not be built (logged at INFO; the workers are
    asked instead).

    ``exists(keys) -> int | None`` takes connector page keys (bytes); it returns None, so the lookup asks the workers
    instead of taking a dead or slow server's silence for "absent", when the store counted a failure during the query
    (``errors``, ``timeouts`` or ``fast_fails`` in its ``stats()``). ``stores`` are the
    :class:`~tierkv.connector.obs.store_metrics.TimedStore` wrappers (one per digest; the caller closes them). A store with
    a ``timeout_s`` waits at most :data:`SCHEDULER_EXISTS_TIMEOUT_S` here.
    """
    from tierkv.storage_backends.factory import build_backend

    from tierkv.connector.l3.io import l3_key
    stores: list = []
    try:
        for digest in digests:
            stores.append((digest, TimedStore(build_backend(l3_cfg, digest, page_bytes))))
            store = stores[-1][1].store
            if not getattr(store, "local_exists", False):
                raise LookupError(f"the {getattr(l3_cfg, 'backend', '?')} store answers existence over the network")
            if hasattr(store, "timeout_s"):
                store.timeout_s = min(float(store.timeout_s), SCHEDULER_EXISTS_TIMEOUT_S)
    except Exception as e:  # not local, or could not start here: the workers answer existence
        logger.info("tierkv: L3 existence is asked through the workers (%s)", e)
        for _d, store in stores:
            store.close()
        return None

    def failures(store) -> int:
        st = store.stats() or {}
        return sum(int(st.get(k, 0) or 0) for k in ("errors", "timeouts", "fast_fails"))

    def exists(keys):
        n = len(keys)
        for digest, store in stores:
            before = failures(store)
            n = min(n, int(store.batch_exists([l3_key(digest, k) for k in keys[:n]])))
            if failures(store) != before:
                return None
            if n == 0:
                break
        return n
    return exists, [s for _d, s in stores]


def scheduler_exists_for(cfg: TierKVConfig, ns: ModelNamespace, num_slots: int, page_bytes: int):
    """``(exists, stores)`` of :func:`scheduler_exists` over every rank namespace (MLA ranks share rank 0's), or
    ``(None, [])`` (the workers are asked): also with no L2, ``controller.exists_in_scheduler: false`` or injected
    existence faults (the fault wrapper's ``local_exists``)."""
    if num_slots == 0 or not cfg.controller.exists_in_scheduler:
        return None, []
    built = scheduler_exists(cfg.l3, [r.digest() for r in rank_namespaces(ns)], page_bytes)
    return built if built is not None else (None, [])


def _this_rank() -> tuple[int, int]:
    """(TP rank, PP rank) of this worker; (0, 0) without distributed state (single process)."""
    try:
        from vllm.distributed.parallel_state import get_pipeline_model_parallel_rank, get_tensor_model_parallel_rank
        return get_tensor_model_parallel_rank(), get_pipeline_model_parallel_rank()
    except Exception:  # no distributed state (single process): rank 0
        return 0, 0


def build_worker_l3(cfg: TierKVConfig, ns: ModelNamespace, host, page_bytes: int):
    """``(l3, checksums, switch_prev)``: this rank's :class:`~tierkv.connector.l3.io.L3IO` and slot checksums, and the
    GIL switch interval it replaced (None: unchanged); ``(None, None, None)`` with a warning when the store cannot
    start."""
    from tierkv.connector.core.page_checksums import SlotChecksums
    from tierkv.connector.l3.io import L3IO, raise_switch_interval
    from tierkv.storage_backends.factory import build_backend
    tp_rank, pp_rank = _this_rank()
    rank_ns = rank_namespace(ns, tp_rank, pp_rank)
    digest = rank_ns.digest()
    try:
        store = TimedStore(build_backend(cfg.l3, digest, page_bytes))
    except Exception as e:  # server down, directory unwritable...: serve without L3, say so once
        if getattr(e, "stops_startup", False):  # the server answered and refused the config: stop here
            raise
        logger.warning("tierkv worker: L3 store '%s' could not start (%s); serving without L3 (jobs are "
                       "answered 'not done', every prefix beyond L2 is recomputed)", cfg.l3.backend, e)
        return None, None, None
    store.store.describe_namespace(rank_ns.describe())  # for `tierkv store stats`; never matched on
    c = cfg.controller
    checksums = SlotChecksums(host.num_slots)
    l3 = L3IO(store, host, digest, checksums, batch_pages=c.batch_pages, max_backup_pages=c.max_backup_pages,
              rank=tp_rank + ns.tp_size * pp_rank, read_threads=c.read_threads,
              backup_writer=not ns.use_mla or tp_rank == 0,  # MLA: TP rank 0 writes the one shared record
              writer_priority=c.writer_priority)
    switch_prev: Optional[float] = raise_switch_interval(c.gil_switch_interval_s)
    if switch_prev is not None:
        logger.info("tierkv worker: Python's GIL switch interval raised from %g to %g s for the L3 threads "
                    "(controller.gil_switch_interval_s)", switch_prev, c.gil_switch_interval_s)
    return l3, checksums, switch_prev
