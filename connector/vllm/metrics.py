"""tierkv counters in vLLM's metrics pipeline (``KVConnectorStats`` and Prometheus), engine edge.

Each step, both connector roles hand vLLM a :class:`TierKVStats`: the *increase* of their counters since the
previous hand-over, the current value of the gauges that changed, and the L3 call latencies observed since then.
vLLM sums the workers' stats, logs them and feeds :class:`TierKVPromMetrics`, which exposes on ``/metrics`` one
counter per key of :data:`COUNTERS` (``vllm:tierkv_<key>_total``), the gauges of :data:`GAUGES`, hit tokens per tier,
lookup tokens per outcome (:data:`LOOKUP_OUTCOMES`) and histograms of L3 call seconds and reuse distances. Units are
as each key says (tokens, pages, bytes, seconds). The full list of series: ``docs/developer-guide.md``.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats
from vllm.v1.metrics.utils import create_metric_per_engine

from tierkv.connector.l3.controller import REUSE_BUCKETS_S

#: counter key -> Prometheus help text
COUNTERS = {
    "lookup_tokens": "Page-aligned prompt prefix tokens of admitted requests that may read a cache (tokens).",
    "lookup_l1_tokens": "Lookup tokens served from L1, the engine's own prefix cache (tokens).",
    "lookup_l2_tokens": "Lookup tokens served from the tierkv L2 host pool (tokens).",
    "lookup_l3_tokens": "Lookup tokens served from L3 (tokens).",
    "lookup_miss_tokens": "Lookup tokens in no tier (tokens).",
    "lookup_declined_slow_tokens": "Lookup tokens in L3 whose load was estimated slower than recomputing (tokens).",
    "lookup_no_room_tokens": "Lookup tokens in L3 not loaded for lack of L2 staging room (tokens).",
    "lookup_late_tokens": "Lookup tokens whose L3 read or existence answer came after the request's deadline (tokens).",
    "lookup_failed_tokens": "Lookup tokens whose L3 read failed or was corrupt, or whose copy failed its checks (tokens).",
    "lookup_skipped_tokens": "Lookup tokens the request's own kv_transfer_params excluded from loading (tokens).",
    "lookup_aborted_tokens": "Lookup tokens of requests that ended while their L3 load ran (tokens).",
    "request_params_refused": "Requests whose kv_transfer_params.tierkv was malformed (served without tierkv).",
    "device_hit_tokens": "Prefix tokens already in L1, the engine's own prefix cache (tokens).",
    "l2_hit_tokens": "Prefix tokens loaded from the tierkv L2 host pool instead of recomputed (tokens).",
    "load_pages": "Pages loaded into L1 from L2 (including pages that came L3 -> L2 first) (pages).",
    "save_pages": "Pages saved L1 -> L2 (pages).",
    "save_skipped_pages": "Pages not saved for lack of unlocked L2 space (pages).",
    "evicted_pages": "Pages evicted from L2 (pages).",
    "preemptions": "Preempted requests seen by the connector.",
    "load_bytes": "Bytes copied L2 -> L1, summed over the workers (bytes).",
    "save_bytes": "Bytes copied L1 -> L2, summed over the workers (bytes).",
    "load_seconds": "Time spent loading L2 -> L1 (seconds).",
    "save_seconds": "Time spent saving L1 -> L2 (seconds).",
    "checksum_mismatches": "L2 pages that failed their checksum and were recomputed.",
    "failed_load_blocks": "Blocks reported to vLLM as failed loads (recomputed).",
    "ctl_l3_hit_tokens": "Prefix tokens loaded from L3 (asynchronous loads) instead of recomputed (tokens).",
    "ctl_l3_declined_slow_pages": "L3 hits declined because loading was estimated slower than recomputing (pages).",
    "ctl_exists_queries": "L3 existence queries sent to the workers.",
    "ctl_backup_stored_pages": "Pages whose L2 -> L3 backup every rank confirmed (pages).",
    "ctl_prefetch_sync_jobs": "L3 hits loaded before the forward of the step that admitted them, like an L2 hit.",
    "ctl_l3_probe_hits": "L3 hits read although estimated slower than recomputing, to refresh a stale estimate.",
    "ctl_l3_evicted_pages": "Pages the L3 store reported evicted (file store): their L3 flag is cleared, so they are "
                            "not taken for L3 hits (pages).",
    "hook_errors": "Exceptions caught at a vLLM hook, each turned into a miss or recomputed pages.",
    "l3_writer_raised": "Times the idle-class L3 writer thread was raised to the normal class (backlog).",
    "l3_hits": "Requests whose L3 load ended (asynchronous loads).",
    "l3_hit_wait_steps": "Engine steps those requests waited for L3, summed (an L2 hit waits 0; an L3 hit at least 1 with "
                         "synchronous scheduling, vLLM's CPU backend, and 2 with asynchronous scheduling).",
    "l3_hit_wait_steps_1": "L3 hits that waited at most one engine step.",
    "l3_backup_pages": "Pages stored L2 -> L3, summed over the workers (each rank stores its shard; MLA: TP rank 0 stores the one shared record) (pages).",
    "l3_backup_failed_pages": "Pages whose L2 -> L3 backup failed or was dropped (pages).",
    "l3_backup_other_rank_pages": "MLA: pages a rank other than TP rank 0 did not send (rank 0 writes the shared record).",
    "l3_backup_bytes": "Bytes stored L2 -> L3 (bytes).",
    "l3_prefetch_pages": "Pages read L3 -> L2 intact, summed over the workers (pages).",
    "l3_prefetch_failed_pages": "Pages whose L3 read failed, was corrupt or missing (pages).",
    "l3_prefetch_bytes": "Bytes read L3 -> L2 (bytes).",
    "l3_prefetch_deadline_misses": "Requests released at their prefetch deadline with pages still missing.",
    "l3_store_errors": "L3 store calls that raised (connection, timeout, I/O errors).",
    "l3_evicted_pages": "Pages the L3 store evicted that the workers named in their backup reports, summed over the "
                        "workers (pages).",
    "l3_evicted_unnamed_pages": "L3 store evictions the workers could not name (a read finds those pages missing).",
    "l3_errors": "L3 store failures: calls that raised plus errors the store absorbed (I/O, connection).",
    "l3_timeouts": "L3 store calls abandoned after the store's timeout_s (ZMQ, Mooncake).",
    "kv_events_stored_pages": "L2/L3 pages announced to vLLM's KV event publisher as stored (pages).",
    "kv_events_removed_pages": "L2/L3 pages announced to vLLM's KV event publisher as removed (pages).",
    "kv_events_dropped": "L2/L3 page events dropped because the publisher's buffer was full (events).",
    "kv_events_undescribed_pages": "Pages that entered a tier without block hashes to announce (no event sent) (pages).",
    "l2_written_bytes": "Bytes written into L2 (pages saved L1 -> L2 x page bytes, every rank) (bytes).",
    "l2_served_bytes": "Bytes L2 served into L1 (L2 hit tokens x page bytes per token, every rank) (bytes).",
    "l3_written_bytes": "Bytes written to L3 (pages every rank confirmed stored x page bytes) (bytes).",
    "l3_served_bytes": "Bytes L3 served into L1 (L3 hit tokens x page bytes per token) (bytes).",
    "ctl_admission_offered_pages": "Pages offered to L3 admission (l3.admission) for a backup (pages).",
    "ctl_admission_admitted_pages": "Pages L3 admission let through to a backup (pages).",
    "ctl_admission_rejected_pages": "Pages L3 admission turned away (pages).",
    "ctl_admission_rejected_hit_pages": "Pages turned away by L3 admission that a later lookup wanted while no tier "
                                        "held them: what admission cost (pages).",
    "ctl_admission_kept_pages": "Pages L3 admission let through only because a request kept them (request control "
                                "keep), where l3.admission alone would have turned them away (pages).",
    "trace_lines": "Lookup lines written to the trace_path file.",
    "trace_errors": "Write errors of the trace_path file.",
    "trace_dropped_lines": "Lookup lines not written to the trace_path file (after a write error).",
}

#: counters that both roles keep; only the scheduler's count (one per engine) is reported: the workers' copies
#: would add the same pages once more per rank
SCHEDULER_ONLY = ("load_pages", "save_pages")

#: gauge key -> Prometheus help text (the latest value wins; scheduler side only, so ranks are never summed)
GAUGES = {
    "l2_used_pages": "L2 host pool slots in use: indexed pages plus staging slots of running prefetches (pages).",
    "l2_capacity_pages": "L2 host pool slots (pages).",
    "pending_backup_pages": "Pages ordered to L3 whose backup has not been confirmed by every rank yet (pages).",
    "pending_prefetch_pages": "Pages being read L3 -> L2 for waiting requests (pages).",
    "lookup_waiting_tokens": "Lookup tokens of L3 loads whose outcome is not known yet (tokens).",
}

#: counter key -> ``outcome`` label of ``vllm:tierkv_lookup_outcome_tokens_total``
LOOKUP_OUTCOMES = {f"lookup_{o}_tokens": o for o in ("l1", "l2", "l3", "miss", "declined_slow", "no_room", "late",
                                                     "failed", "skipped", "aborted")}

#: hit-token counter key -> tier label of ``vllm:tierkv_hit_tokens_total``
HIT_TIERS = {"l2_hit_tokens": "L2", "ctl_l3_hit_tokens": "L3"}

#: stats key holding a list of latencies (seconds) -> ``op`` label of ``vllm:tierkv_l3_op_seconds``
LATENCY_KEYS = {"l3_get_seconds": "get", "l3_set_seconds": "set", "l3_exists_seconds": "exists"}

#: stats key holding a list of reuse distances (seconds) -> ``tier`` label of ``vllm:tierkv_reuse_distance_seconds``
REUSE_KEYS = {"reuse_l2_seconds": "L2", "reuse_l3_seconds": "L3"}

#: stats keys that hold lists of samples (shipped as they are, concatenated when steps are merged)
SAMPLE_KEYS = {**LATENCY_KEYS, **REUSE_KEYS}

#: bucket bounds of ``vllm:tierkv_reuse_distance_seconds`` (seconds): a second to a day, as in the stats file
REUSE_BUCKETS = REUSE_BUCKETS_S

#: bucket bounds of ``vllm:tierkv_l3_op_seconds`` (seconds): local file reads to slow remote stores
L3_LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


@dataclass
class TierKVStats(KVConnectorStats):
    """One or more steps of tierkv stats: counter increases (:data:`COUNTERS`, summed), gauges (:data:`GAUGES`, the
    later value wins) and L3 latency samples (:data:`LATENCY_KEYS`, lists of seconds, concatenated)."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> "TierKVStats":
        out = dict(self.data)
        for k, v in (other.data or {}).items():
            if k in GAUGES:
                out[k] = v
            elif k in SAMPLE_KEYS:
                out[k] = list(out.get(k, ())) + list(v)
            else:
                out[k] = out.get(k, 0) + v
        return TierKVStats(data=out)

    def reduce(self) -> dict[str, int | float]:
        d = {k: v for k, v in self.data.items() if v and k not in SAMPLE_KEYS}
        if self.data.get("lookup_tokens"):
            d["l2_hit_rate"] = round(self.data.get("l2_hit_tokens", 0) / self.data["lookup_tokens"], 4)
        for k, op in LATENCY_KEYS.items():
            samples = self.data.get(k)
            if samples:
                d[f"l3_{op}_calls"] = len(samples)
                d[f"l3_{op}_ms_mean"] = round(1e3 * sum(samples) / len(samples), 3)
        return d

    def is_empty(self) -> bool:
        return not self.data


class CounterDeltas:
    """Turns a cumulative snapshot into what one :class:`TierKVStats` carries: the increase of each key of
    :data:`COUNTERS` and the value of each key of :data:`GAUGES` that changed since the previous call."""

    def __init__(self, exclude=()):
        self._last: dict[str, float] = {}
        self._keys = [k for k in COUNTERS if k not in set(exclude)]

    def take(self, snapshot: dict[str, Any], latencies: Optional[dict[str, list]] = None) -> Optional[TierKVStats]:
        """``latencies``: samples to ship as they are (keys of :data:`SAMPLE_KEYS`, lists of seconds)."""
        delta: dict[str, Any] = {}
        for k in self._keys:
            v = snapshot.get(k)
            if v is None:
                continue
            d = v - self._last.get(k, 0)
            if d:
                delta[k] = d
            self._last[k] = v
        for k in GAUGES:
            v = snapshot.get(k)
            if v is None:
                continue
            if v != self._last.get(k):
                delta[k] = v
            self._last[k] = v
        for k, v in (latencies or {}).items():
            if v and k in SAMPLE_KEYS:
                delta[k] = list(v)
        return TierKVStats(data=delta) if delta else None


def scheduler_gauges(stats: dict[str, Any]) -> dict[str, int]:
    """The :data:`GAUGES` from a :meth:`tierkv.connector.core.scheduler.CacheScheduler.stats` snapshot."""
    out = {"l2_capacity_pages": stats.get("num_slots", 0),
           "l2_used_pages": stats.get("num_slots", 0) - stats.get("free_slots", 0)}
    if "lookup_waiting_tokens" in stats:
        out["lookup_waiting_tokens"] = stats["lookup_waiting_tokens"]
    if "ctl_backing_up_pages" in stats:
        out["pending_backup_pages"] = stats["ctl_backing_up_pages"]
        out["pending_prefetch_pages"] = stats.get("ctl_fetching_pages", 0)
    return out


def _per_engine_and_label(metric, per_engine_labelvalues, values) -> dict:
    """{engine index: {label value: child}} for a metric with one label after the engine labels."""
    return {idx: {v: metric.labels(*lv, v) for v in values} for idx, lv in per_engine_labelvalues.items()}


class TierKVPromMetrics(KVConnectorPromMetrics):
    """Prometheus metrics ``vllm:tierkv_*`` per engine (see the module docstring for the list)."""

    def __init__(self, vllm_config, metric_types, labelnames, per_engine_labelvalues):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        labelnames = list(labelnames)
        self.counters = {
            k: create_metric_per_engine(
                self._counter_cls(name=f"vllm:tierkv_{k}", documentation=doc, labelnames=labelnames),
                per_engine_labelvalues)
            for k, doc in COUNTERS.items()
        }
        self.gauges = {
            k: create_metric_per_engine(
                self._gauge_cls(name=f"vllm:tierkv_{k}", documentation=doc, labelnames=labelnames,
                                multiprocess_mode="mostrecent"),
                per_engine_labelvalues)
            for k, doc in GAUGES.items()
        }
        self.hit_tokens = _per_engine_and_label(
            self._counter_cls(name="vllm:tierkv_hit_tokens",
                              documentation="Prompt tokens loaded from a tierkv tier instead of recomputed (tokens).",
                              labelnames=labelnames + ["tier"]),
            per_engine_labelvalues, HIT_TIERS.values())
        self.l3_latency = _per_engine_and_label(
            self._histogram_cls(name="vllm:tierkv_l3_op_seconds",
                                documentation="Wall time of one batched L3 store call (seconds).",
                                labelnames=labelnames + ["op"], buckets=list(L3_LATENCY_BUCKETS)),
            per_engine_labelvalues, LATENCY_KEYS.values())
        self.outcomes = _per_engine_and_label(
            self._counter_cls(name="vllm:tierkv_lookup_outcome_tokens",
                              documentation="Counted lookup tokens by where they were served or why they were not "
                                            "(tokens).",
                              labelnames=labelnames + ["outcome"]),
            per_engine_labelvalues, LOOKUP_OUTCOMES.values())
        self.reuse = _per_engine_and_label(
            self._histogram_cls(name="vllm:tierkv_reuse_distance_seconds",
                                documentation="Seconds between a page's store in a tier and a hit on it there (one "
                                              "sample per page hit).",
                                labelnames=labelnames + ["tier"], buckets=list(REUSE_BUCKETS)),
            per_engine_labelvalues, REUSE_KEYS.values())

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for k, v in (transfer_stats_data or {}).items():
            if k in GAUGES:
                g = self.gauges[k].get(engine_idx)
                if g is not None:
                    g.set(v)
                continue
            if k in SAMPLE_KEYS:
                h = (self.l3_latency.get(engine_idx, {}).get(LATENCY_KEYS[k]) if k in LATENCY_KEYS
                     else self.reuse.get(engine_idx, {}).get(REUSE_KEYS[k]))
                if h is not None:
                    for x in v:
                        h.observe(x)
                continue
            per_engine = self.counters.get(k)
            if per_engine is not None and v > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(v)
                tier = HIT_TIERS.get(k)
                if tier is not None:
                    self.hit_tokens[engine_idx][tier].inc(v)
                outcome = LOOKUP_OUTCOMES.get(k)
                if outcome is not None:
                    self.outcomes[engine_idx][outcome].inc(v)
