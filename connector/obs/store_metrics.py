"""Latency and failure counts of an L3 store as the connector sees them, for ``/metrics``.

:class:`TimedStore` wraps the rank's store (any :class:`tierkv.storage_backends.base.StorageBackend`) without
changing what it does: each ``batch_get`` / ``batch_set`` / ``batch_exists`` is timed (wall seconds, including
the store's own waits and timeouts) and the samples wait in a bounded buffer until the connector hands them to
vLLM (:meth:`TimedStore.take_latencies`, once per engine step). Every other attribute is the store's.
:meth:`TimedStore.failure_counts` reads the store's own ``errors`` and ``timeouts`` counters (the stores turn
failures into misses / ``False`` and count them) and adds the calls that raised.
Pattern after vLLM's NIXL connector, which ships per-transfer durations with its stats.
"""
from __future__ import annotations

import threading
import time
from typing import Any

#: store method -> stats key of its latency samples (:data:`tierkv.connector.vllm.metrics.LATENCY_KEYS`)
TIMED_CALLS = {"batch_get": "l3_get_seconds", "batch_set": "l3_set_seconds", "batch_exists": "l3_exists_seconds"}


class TimedStore:
    """A store whose batch calls are timed.

    Args:
        store: the L3 store to wrap.
        max_samples: latency samples kept per call kind between two :meth:`take_latencies` calls; more are counted
            in ``dropped_samples`` and not kept (an engine that stops stepping keeps a bounded buffer).
    """

    def __init__(self, store, max_samples: int = 4096):
        self._store = store
        self._max = int(max_samples)
        self._lock = threading.Lock()
        self._samples: dict[str, list[float]] = {k: [] for k in TIMED_CALLS.values()}
        self.raised = 0
        self.dropped_samples = 0

    @property
    def store(self):
        """The wrapped store."""
        return self._store

    def _timed(self, name: str, *args, **kwargs):
        fn = getattr(self._store, name)
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        except Exception:
            with self._lock:
                self.raised += 1
            raise
        finally:
            dt = time.perf_counter() - t0
            with self._lock:
                buf = self._samples[TIMED_CALLS[name]]
                if len(buf) < self._max:
                    buf.append(dt)
                else:
                    self.dropped_samples += 1

    def batch_get(self, *args, **kwargs):
        return self._timed("batch_get", *args, **kwargs)

    def batch_set(self, *args, **kwargs):
        return self._timed("batch_set", *args, **kwargs)

    def batch_exists(self, *args, **kwargs):
        return self._timed("batch_exists", *args, **kwargs)

    def take_latencies(self) -> dict[str, list[float]]:
        """Samples (seconds) since the previous call, by stats key; kinds without samples are left out."""
        with self._lock:
            out = {k: v for k, v in self._samples.items() if v}
            for k in out:
                self._samples[k] = []
        return out

    def failure_counts(self) -> dict[str, int]:
        """``l3_errors`` (errors the store counted plus calls that raised) and ``l3_timeouts`` (the store's
        ``timeouts``; 0 for stores without timeouts, e.g. the file store). Cumulative."""
        try:
            s = self._store.stats() or {}
        except Exception:  # a store whose stats fail still reports what raised here
            s = {}
        return {"l3_errors": int(s.get("errors", 0) or 0) + self.raised, "l3_timeouts": int(s.get("timeouts", 0) or 0)}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)

    def __repr__(self) -> str:
        return repr(self._store)
