"""tierkv counters in vLLM's metrics pipeline (``KVConnectorStats`` and Prometheus), engine edge.

Each step, both connector roles hand vLLM the *increase* of their counters since the previous step as a
:class:`TierKVStats`; vLLM sums the workers' stats, ships them to the front-end, logs them with the other
periodic stats, and feeds :class:`TierKVPromMetrics`, which exposes one Prometheus counter per key as
``vllm:tierkv_<key>`` (tokens, pages, bytes, seconds as the key's suffix says) on the server's ``/metrics``.
Modelled on how vLLM's own offloading connector reports its transfers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

#: counter key -> Prometheus help text
COUNTERS = {
    "lookup_tokens": "Page-aligned prompt prefix tokens of admitted requests (tokens).",
    "device_hit_tokens": "Prefix tokens already in L1, the engine's own prefix cache (tokens).",
    "l2_hit_tokens": "Prefix tokens loaded from the tierkv L2 host pool instead of recomputed (tokens).",
    "load_pages": "Pages loaded L2 -> L1 (pages).",
    "save_pages": "Pages saved L1 -> L2 (pages).",
    "save_skipped_pages": "Pages not saved for lack of unlocked L2 space (pages).",
    "evicted_pages": "Pages evicted from L2 (pages).",
    "preemptions": "Preempted requests seen by the connector.",
    "load_bytes": "Bytes copied L2 -> L1 (bytes).",
    "save_bytes": "Bytes copied L1 -> L2 (bytes).",
    "load_seconds": "Time spent loading L2 -> L1 (seconds).",
    "save_seconds": "Time spent saving L1 -> L2 (seconds).",
    "checksum_mismatches": "L2 pages that failed their checksum and were recomputed.",
    "failed_load_blocks": "Blocks reported to vLLM as failed loads (recomputed).",
    "ctl_l3_hit_tokens": "Prefix tokens loaded from L3 (asynchronous loads) instead of recomputed (tokens).",
    "ctl_l3_declined_slow_pages": "L3 hits declined because loading was estimated slower than recomputing (pages).",
    "ctl_exists_queries": "L3 existence queries sent to the workers.",
    "l3_backup_pages": "Pages stored L2 -> L3 (pages).",
    "l3_backup_failed_pages": "Pages whose L2 -> L3 backup failed or was dropped (pages).",
    "l3_backup_bytes": "Bytes stored L2 -> L3 (bytes).",
    "l3_prefetch_pages": "Pages read L3 -> L2 intact (pages).",
    "l3_prefetch_failed_pages": "Pages whose L3 read failed, was corrupt or missing (pages).",
    "l3_prefetch_bytes": "Bytes read L3 -> L2 (bytes).",
    "l3_prefetch_deadline_misses": "Requests released at their prefetch deadline with pages still missing.",
    "l3_store_errors": "L3 store calls that raised (connection, timeout, I/O errors).",
}


@dataclass
class TierKVStats(KVConnectorStats):
    """Counter increases (keys of :data:`COUNTERS`) over one or more steps, summed across workers."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "TierKVStats":
        out = dict(self.data)
        for k, v in (other.data or {}).items():
            out[k] = out.get(k, 0) + v
        return TierKVStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        d = {k: v for k, v in self.data.items() if v}
        if self.data.get("lookup_tokens"):
            d["l2_hit_rate"] = round(self.data.get("l2_hit_tokens", 0) / self.data["lookup_tokens"], 4)
        return d

    def is_empty(self) -> bool:
        return not any(self.data.values())


class CounterDeltas:
    """Turns a cumulative counter snapshot into per-call increases (only the keys in :data:`COUNTERS`)."""

    def __init__(self):
        self._last: dict[str, float] = {}

    def take(self, snapshot: dict[str, Any]) -> Optional[TierKVStats]:
        delta = {}
        for k in COUNTERS:
            v = snapshot.get(k)
            if v is None:
                continue
            d = v - self._last.get(k, 0)
            if d:
                delta[k] = d
            self._last[k] = v
        return TierKVStats(data=delta) if delta else None


class TierKVPromMetrics(KVConnectorPromMetrics):
    """Prometheus counters ``vllm:tierkv_<key>`` per engine."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self.counters = {
            k: create_metric_per_engine(
                self._counter_cls(name=f"vllm:tierkv_{k}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for k, doc in COUNTERS.items()
        }

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in (transfer_stats_data or {}).items():
            per_engine = self.counters.get(k)
            if per_engine is not None and v > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
