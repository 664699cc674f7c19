"""The config key ``trace_path`` reaches the scheduler side of TierKVConnector (built in-process from vLLM's own config
objects, ``vllm_parts``): a lookup made through the connector's hooks is one line of the trace, which ``tierkv plan``
reads back."""
import json
import logging

import pytest

from tierkv.cli_plan import read_trace
from tierkv.connector.core.page_hash import page_keys, request_root
from tests.helpers.vllm_parts import BLOCK, SCHEDULER, TierkvLoggerState, connector, write_model


@pytest.fixture
def model(tmp_path, monkeypatch):
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    state = TierkvLoggerState()
    logging.getLogger("tierkv").propagate = False
    yield write_model(tmp_path / "model")
    state.restore()


def test_trace_path_records_the_connectors_lookups(model, tmp_path):
    path = tmp_path / "trace-{pid}.jsonl"
    assert connector(model, SCHEDULER, {"host_pool.num_pages": 8})._sched.trace is None
    c = connector(model, SCHEDULER, {"host_pool.num_pages": 8, "eviction_policy": "lfu", "trace_path": str(path)})
    s = c._sched
    T = list(range(1, 3 * BLOCK + 2))
    for rid, blocks in (("r", [1, 2, 3, 4]), ("q", [5, 6, 7, 8])):
        s.add_request(rid, T)
        n = s.lookup(rid, 0)
        s.on_alloc(rid, blocks, n)
        s.schedule_saves(rid, len(T), blocks)
        s.build_plan()
        s.on_finished(rid)
    s.trace.close()
    assert s.stats()["trace_lines"] == 2
    written = s.trace.path
    assert "{pid}" not in written
    lines = [json.loads(ln) for ln in open(written)]
    assert lines[0] == {"tierkv_lookup_trace": 1, "page_size": BLOCK, "l2_pages": 8, "eviction_policy": "lfu"}
    assert [ln["outcome"] for ln in lines[1:]] == [{"miss": 3 * BLOCK}, {"l2": 3 * BLOCK}]
    want = [k.hex() for k in page_keys(request_root(s.ns_digest, None, None), T, BLOCK)]
    assert len(want) == 3 and lines[1]["keys"] == lines[2]["keys"] == want and lines[1]["lookup_pages"] == 3
    t = read_trace(written)
    assert len(t.requests) == 2 and t.header["eviction_policy"] == "lfu"
    stats = c.get_kv_connector_stats()  # what vLLM ships to /metrics (vllm:tierkv_trace_lines_total)
    assert stats.data["trace_lines"] == 2 and "trace_dropped_lines" not in stats.data
