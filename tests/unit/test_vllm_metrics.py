"""tierkv counters through vLLM's KVConnectorStats and Prometheus classes."""
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tierkv.connector.vllm_metrics import COUNTERS, CounterDeltas, TierKVPromMetrics, TierKVStats


def test_deltas_aggregate_reduce():
    d = CounterDeltas()
    assert d.take({"lookup_tokens": 0, "l2_hit_tokens": 0}) is None
    s1 = d.take({"lookup_tokens": 100, "l2_hit_tokens": 64, "num_slots": 9})
    assert s1.data == {"lookup_tokens": 100, "l2_hit_tokens": 64}   # non-counter keys ignored
    s2 = d.take({"lookup_tokens": 300, "l2_hit_tokens": 64})
    assert s2.data == {"lookup_tokens": 200}
    agg = s1.aggregate(s2).aggregate(TierKVStats(data={"load_bytes": 5}))
    assert agg.data == {"lookup_tokens": 300, "l2_hit_tokens": 64, "load_bytes": 5}
    r = agg.reduce()
    assert r["l2_hit_rate"] == round(64 / 300, 4) and r["load_bytes"] == 5
    assert TierKVStats().is_empty() and not agg.is_empty()


def test_prometheus_counters_per_engine():
    reg = CollectorRegistry()

    class C(Counter):
        def __init__(self, *a, **kw):
            super().__init__(*a, registry=reg, **kw)

    class VC:  # minimal vllm_config stand-in: only kv_transfer_config is read
        kv_transfer_config = None

    m = TierKVPromMetrics(VC(), {Gauge: Gauge, Counter: C, Histogram: Histogram}, ["model_name", "engine"],
                          {0: ["m", "0"], 1: ["m", "1"]})
    m.observe({"l2_hit_tokens": 64, "load_bytes": 4096}, engine_idx=1)
    m.observe({"l2_hit_tokens": 32}, engine_idx=1)
    assert reg.get_sample_value("vllm:tierkv_l2_hit_tokens_total", {"model_name": "m", "engine": "1"}) == 96
    assert reg.get_sample_value("vllm:tierkv_load_bytes_total", {"model_name": "m", "engine": "1"}) == 4096
    assert reg.get_sample_value("vllm:tierkv_l2_hit_tokens_total", {"model_name": "m", "engine": "0"}) == 0
    assert len(COUNTERS) == len(m.counters)
