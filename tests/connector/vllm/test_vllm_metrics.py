"""tierkv counters through vLLM's KVConnectorStats and Prometheus classes."""
import pytest
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from tierkv.connector.vllm.metrics import COUNTERS, CounterDeltas, TierKVPromMetrics, TierKVStats


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


def test_gauges_latencies_and_tier_hits():
    from tierkv.connector.vllm.metrics import scheduler_gauges

    d = CounterDeltas()
    snap = {"num_slots": 10, "free_slots": 10, "ctl_backing_up_pages": 0, "ctl_fetching_pages": 0,
            "l2_hit_tokens": 0, "ctl_l3_hit_tokens": 0}
    s0 = d.take({**snap, **scheduler_gauges(snap)})
    assert s0.data == {"l2_capacity_pages": 10, "l2_used_pages": 0, "pending_backup_pages": 0,
                       "pending_prefetch_pages": 0}            # first values of the gauges, even 0
    assert not s0.is_empty()
    snap.update(free_slots=6, ctl_backing_up_pages=3, l2_hit_tokens=64, ctl_l3_hit_tokens=32)
    s1 = d.take({**snap, **scheduler_gauges(snap)}, {"l3_get_seconds": [0.002, 0.004]})
    assert s1.data == {"l2_used_pages": 4, "pending_backup_pages": 3, "l2_hit_tokens": 64, "ctl_l3_hit_tokens": 32,
                       "l3_get_seconds": [0.002, 0.004]}      # unchanged gauges are not sent again
    snap.update(ctl_backing_up_pages=0)
    s2 = d.take({**snap, **scheduler_gauges(snap)}, {"l3_get_seconds": [0.3]})
    agg = s1.aggregate(s2)
    assert agg.data["pending_backup_pages"] == 0 and agg.data["l2_used_pages"] == 4   # gauges: latest value
    assert agg.data["l3_get_seconds"] == [0.002, 0.004, 0.3] and agg.data["l2_hit_tokens"] == 64
    r = agg.reduce()
    assert r["l3_get_calls"] == 3 and r["l3_get_ms_mean"] == round(1e3 * 0.306 / 3, 3)

    reg = CollectorRegistry()

    def bind(cls):
        class B(cls):
            def __init__(self, *a, **kw):
                kw.pop("multiprocess_mode", None)
                super().__init__(*a, registry=reg, **kw)
        return B

    class VC:
        kv_transfer_config = None

    m = TierKVPromMetrics(VC(), {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)},
                          ["model_name", "engine"], {0: ["m", "0"]})
    m.observe(s0.data)
    m.observe(agg.data)
    lab = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:tierkv_l2_used_pages", lab) == 4
    assert reg.get_sample_value("vllm:tierkv_l2_capacity_pages", lab) == 10
    assert reg.get_sample_value("vllm:tierkv_pending_backup_pages", lab) == 0
    assert reg.get_sample_value("vllm:tierkv_hit_tokens_total", {**lab, "tier": "L2"}) == 64
    assert reg.get_sample_value("vllm:tierkv_hit_tokens_total", {**lab, "tier": "L3"}) == 32
    assert reg.get_sample_value("vllm:tierkv_l3_op_seconds_count", {**lab, "op": "get"}) == 3
    assert reg.get_sample_value("vllm:tierkv_l3_op_seconds_bucket", {**lab, "op": "get", "le": "0.005"}) == 2
    assert reg.get_sample_value("vllm:tierkv_l3_op_seconds_count", {**lab, "op": "set"}) == 0


def test_timed_store_times_calls_and_counts_failures():
    from tierkv.connector.obs.store_metrics import TimedStore

    class Store:
        def __init__(self):
            self.c = {"errors": 2, "timeouts": 1}

        def batch_get(self, keys, dsts):
            return [True] * len(keys)

        def batch_set(self, keys, srcs, checksums=None):
            raise ConnectionError("down")

        def stats(self):
            return dict(self.c)

    t = TimedStore(Store(), max_samples=2)
    assert t.batch_get(["a", "b"], [None, None]) == [True, True]
    for _ in range(2):
        with pytest.raises(ConnectionError):
            t.batch_set(["a"], [b"x"], checksums=[1])
    lat = t.take_latencies()
    assert len(lat["l3_get_seconds"]) == 1 and len(lat["l3_set_seconds"]) == 2 and "l3_exists_seconds" not in lat
    assert t.take_latencies() == {}
    t.batch_get([], []); t.batch_get([], []); t.batch_get([], [])
    assert len(t.take_latencies()["l3_get_seconds"]) == 2 and t.dropped_samples == 1
    assert t.failure_counts() == {"l3_errors": 4, "l3_timeouts": 1}   # 2 absorbed by the store + 2 raised
    assert t.stats() == {"errors": 2, "timeouts": 1}                   # everything else is the store's


def _record_writer_threads(monkeypatch) -> list:
    """Names of the threads that write a StatsFile from now on (one per write), in order."""
    import threading as _threading

    from tierkv.connector.obs.metrics import StatsFile
    writers = []
    write = StatsFile._write

    def recording_write(self, data, seq, force=False):
        writers.append(_threading.current_thread().name)
        return write(self, data, seq, force)
    monkeypatch.setattr(StatsFile, "_write", recording_write)
    return writers


def test_stats_file_keeps_the_last_change_without_another_call(tmp_path, monkeypatch):
    """A change inside the write interval is written by the flusher when the interval ends, with no further call:
    the file does not lag behind an engine that stopped stepping (or was killed before its shutdown hook). Every
    write of ``maybe_write`` is the flusher's: a hook calling it every step never writes a file itself."""
    import json as _json
    import time as _time

    from tierkv.connector.obs.metrics import StatsFile

    writers = _record_writer_threads(monkeypatch)
    counters = {"n": 1}
    f = StatsFile(str(tmp_path / "{role}.json"), "scheduler", lambda: dict(counters), min_interval_s=0.05)
    f.maybe_write()
    counters["n"] = 2
    f.maybe_write()                     # inside the interval: not written now
    path = tmp_path / "scheduler.json"
    deadline = _time.monotonic() + 10
    while not path.exists() or _json.loads(path.read_text())["n"] != 2:
        assert _time.monotonic() < deadline, path.read_text() if path.exists() else "no file"
        _time.sleep(0.01)
    assert writers and set(writers) == {"tierkv-stats-scheduler"}, writers
    # a thread-safe snapshot is polled: counters moved by other threads reach the file without any call
    w = {"io": 0}
    g = StatsFile(str(tmp_path / "{role}.json"), "worker", lambda: dict(w), min_interval_s=0.05,
                  snapshot_thread_safe=True)
    g.start_polling()
    w["io"] = 7
    wpath = tmp_path / "worker.json"
    while not wpath.exists() or _json.loads(wpath.read_text())["io"] != 7:
        assert _time.monotonic() < deadline
        _time.sleep(0.01)
    f.close()
    g.close()
    assert _json.loads(path.read_text())["role"] == "scheduler"


def test_a_hook_never_waits_for_the_stats_file_write(tmp_path, monkeypatch):
    """The flusher wrote the JSON file while holding the lock that the engine's hook takes every step to hand over
    its snapshot, so a step overlapping a write waited for the JSON and the file system (py-spy of the engine core
    under load: a third of tierkv's scheduler hook samples in that hand-over). The write now runs without that lock:
    while the flusher is stuck in a write, ``maybe_write`` returns, and its newer snapshot is written after."""
    import json as _json
    import threading as _threading

    import tierkv.connector.obs.metrics as m

    in_write, release = _threading.Event(), _threading.Event()
    replace = m.os.replace

    def slow_replace(src, dst):
        in_write.set()
        assert release.wait(30)
        return replace(src, dst)
    monkeypatch.setattr(m.os, "replace", slow_replace)
    counters = {"n": 1}
    f = m.StatsFile(str(tmp_path / "{role}.json"), "scheduler", lambda: dict(counters), min_interval_s=0.0)
    f.maybe_write()
    assert in_write.wait(30)                        # the flusher is inside its write of n=1
    counters["n"] = 2
    returned = _threading.Event()
    hook = _threading.Thread(target=lambda: (f.maybe_write(), returned.set()))
    hook.start()
    try:
        assert returned.wait(5), "maybe_write waited for the flusher's file write"
    finally:
        release.set()
        hook.join()
    f.close()
    assert _json.loads((tmp_path / "scheduler.json").read_text())["n"] == 2


def test_write_soon_is_written_at_once_by_the_flusher_not_the_hook(tmp_path, monkeypatch):
    """When the engine goes idle the scheduler side asks for its counters to reach the file at once (a stopped idle
    engine leaves exact totals), but not on the hook's thread: at concurrency 1 that is the end of every request, and
    the JSON and file writes there cost the next request's TTFT (about 1 ms a request, cProfile of a multi-turn run).
    ``write_soon`` hands the snapshot to the flusher, which writes it without waiting for the interval."""
    import json as _json
    import time as _time

    from tierkv.connector.obs.metrics import StatsFile

    writers = _record_writer_threads(monkeypatch)
    counters = {"n": 1}
    f = StatsFile(str(tmp_path / "{role}.json"), "scheduler", lambda: dict(counters), min_interval_s=600.0)
    path = tmp_path / "scheduler.json"
    f.maybe_write()                                  # the first write: at once (no write before it)
    deadline = _time.monotonic() + 10
    while not path.exists():
        assert _time.monotonic() < deadline
        _time.sleep(0.01)
    counters["n"] = 2
    f.write_soon()                                   # inside the 600 s interval, yet written now
    counters["n"] = 3                                # the snapshot was taken by write_soon, on this thread
    while _json.loads(path.read_text())["n"] != 2:
        assert _time.monotonic() < deadline, path.read_text()
        _time.sleep(0.01)
    assert set(writers) == {"tierkv-stats-scheduler"}, writers
    f.close()
    assert _json.loads(path.read_text())["n"] == 3


def test_a_snapshot_every_step_wakes_the_flusher_once_per_interval(tmp_path, monkeypatch):
    """The scheduler side hands a snapshot over every engine step. Each hand-over used to wake the flusher, which
    only found its interval not yet over and slept again: a thread woken (and handed the GIL) every step for nothing
    (in-engine hook timing, 2026-12-04: get_kv_connector_stats 89 us a call against 17 us with the engine idle).
    While a snapshot is pending the flusher sleeps to the end of the interval and writes the newest one; only a
    hand-over that finds nothing pending (the flusher may wait without a deadline) or an urgent one wakes it."""
    import json as _json
    import time as _time

    from tierkv.connector.obs.metrics import StatsFile

    writers = _record_writer_threads(monkeypatch)
    counters = {"n": 0}
    f = StatsFile(str(tmp_path / "{role}.json"), "scheduler", lambda: dict(counters), min_interval_s=600.0)
    wakes = []
    notify = f._wake.notify
    monkeypatch.setattr(f._wake, "notify", lambda n=1: (wakes.append(n), notify(n)))
    path = tmp_path / "scheduler.json"
    f.maybe_write()                                  # the first write: at once (nothing written before)
    deadline = _time.monotonic() + 10
    while not path.exists():
        assert _time.monotonic() < deadline
        _time.sleep(0.01)
    for n in range(1, 101):                          # 100 steps inside the interval
        counters["n"] = n
        f.maybe_write()
    assert len(wakes) == 2, wakes                    # the first hand-over, and the first one after its write
    assert _json.loads(path.read_text())["n"] == 0 and len(writers) == 1, writers
    f.write_soon()                                   # urgent: wakes it, and the newest snapshot is written
    while _json.loads(path.read_text())["n"] != 100:
        assert _time.monotonic() < deadline, path.read_text()
        _time.sleep(0.01)
    assert len(wakes) == 3, wakes
    f.close()


def test_a_counters_file_that_cannot_be_written_at_shutdown_is_a_warning(tmp_path, caplog):
    """The last write (``close``, the connector's ``shutdown`` and ``atexit``) runs on the caller's thread: a file that
    cannot be written there (its name taken by a directory since start-up, a full disk) is logged, never raised into
    vLLM's engine shutdown."""
    import logging as _logging

    from tierkv.connector.obs.metrics import StatsFile

    f = StatsFile(str(tmp_path / "{role}.json"), "scheduler", lambda: {"n": 1})
    (tmp_path / "scheduler.json").mkdir()
    with caplog.at_level(_logging.WARNING, logger="tierkv.metrics"):
        f.close()
    assert any("cannot write the counters file" in r.getMessage() and "scheduler.json" in r.getMessage()
               for r in caplog.records), caplog.text


def test_counter_deltas_go_to_vllm_once_per_interval_and_none_is_lost(tmp_path, monkeypatch):
    """vLLM asks both roles for their counter deltas every step; building them snapshots every counter, which took
    as long as all of tierkv's other hooks of a decode step together. Now they are handed over once per
    ``STATS_EVERY_S`` (the scheduler side decides, and tells the workers through the plan's ``emit_stats``); in the
    steps between both roles return None and the increases accumulate: the next hand-over carries them all. A step
    without a scheduled request always hands over, and an engine that goes idle while the workers hold deltas back is
    kept stepping once more (``has_pending_push_work``) so that they hand them over."""
    from types import SimpleNamespace

    from tierkv.connector.core.plan import JobReport, PageOrder
    from tierkv.connector.vllm.connector import STATS_EVERY_S, ConnectorPlan
    from tests.helpers.vllm_parts import BLOCK, SCHEDULER, connector, worker_connector, write_model
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    model = write_model(tmp_path / "model")
    s = connector(model, SCHEDULER, {"host_pool.num_pages": 8})
    now = [100.0]
    s._side.clock = lambda: now[0]

    def req(rid, base):
        return SimpleNamespace(request_id=rid, all_token_ids=list(range(base, base + 2 * BLOCK + 1)),
                               lora_request=None, cache_salt=None, kv_transfer_params=None,
                               skip_reading_prefix_cache=False, num_prompt_tokens=2 * BLOCK + 1)

    def step(running):
        return s.build_connector_meta(SimpleNamespace(
            preempted_req_ids=[], num_scheduled_tokens={r: 1 for r in running}, kv_connector_block_state=None,
            scheduled_new_reqs=[], scheduled_cached_reqs=SimpleNamespace(req_ids=list(running),
                                                                         num_computed_tokens=[2 * BLOCK + 1] * len(running)),
            scheduled_spec_decode_tokens={}))

    def lookup(r):
        s.on_new_request(r)
        assert s.get_num_new_matched_tokens(r, 0) == (0, False)   # a miss: 2 pages of lookup_miss_tokens
        s.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([1, 2, 3],)), 0)

    lookup(req("a", 1000))
    assert step(["a"]).emit_stats and s.get_kv_connector_stats().data["lookup_miss_tokens"] == 2 * BLOCK
    now[0] += STATS_EVERY_S / 4
    lookup(req("b", 5000))
    assert not step(["a", "b"]).emit_stats and s.get_kv_connector_stats() is None   # inside the interval
    assert not s.has_pending_push_work()                                           # requests still run
    now[0] += STATS_EVERY_S
    assert step(["a", "b"]).emit_stats
    assert s.get_kv_connector_stats().data["lookup_miss_tokens"] == 2 * BLOCK       # b's, held back one step
    now[0] += STATS_EVERY_S / 4
    assert not step(["a", "b"]).emit_stats
    lookup(req("c", 9000))
    assert s.get_kv_connector_stats() is None
    for rid, base in (("a", 1000), ("b", 5000), ("c", 9000)):
        s.request_finished(req(rid, base), [1, 2])
    assert s.has_pending_push_work()              # idle, with the workers' deltas of that last plan held back
    assert s.get_kv_connector_stats().data["lookup_miss_tokens"] == 2 * BLOCK   # no request left: at once
    assert step([]).emit_stats                    # the extra step: the workers hand over theirs
    assert not s.has_pending_push_work()

    w, _l1 = worker_connector(model, {"host_pool.num_pages": 8})

    def worker_step(plan):
        w.bind_connector_metadata(plan)
        w.start_load_kv(None)
        w.wait_for_save()
        w.get_transfer_results(set())
        got = w.get_kv_connector_stats()
        w.build_connector_worker_meta()               # (vLLM's order: the stats, then the job reports)
        w.clear_connector_metadata()
        return got

    def save(n, slot, emit):
        return ConnectorPlan(step=n, emit_stats=emit, saves=[PageOrder("a", [n], [slot], [bytes([n]) * 16])])

    page = w.page_bytes
    assert worker_step(save(1, 1, True)).data["save_bytes"] == page
    assert worker_step(ConnectorPlan(step=2, emit_stats=False)) is None            # a decode step: nothing moved
    # a step that moved pages hands its copies over whatever the plan says: an offline engine with its EngineCore
    # in-process stops stepping when its requests are done, and no later step would carry them
    assert worker_step(save(3, 3, False)).data["save_bytes"] == page
    assert worker_step(ConnectorPlan(step=4, emit_stats=False)) is None
    snapshots = []
    take = w._worker_stats
    monkeypatch.setattr(w, "_worker_stats", lambda: snapshots.append(1) or take())
    assert worker_step(ConnectorPlan(step=5, emit_stats=False)) is None and snapshots == []
    w._worker._orphan_reports.append(JobReport(7, "backup", [False]))             # a job ended (its counters moved)
    worker_step(ConnectorPlan(step=6, emit_stats=False))
    assert snapshots == [1] and not w._worker.has_reports()                         # handed over, report taken


def test_a_hook_that_calls_another_counts_its_time_once(tmp_path, monkeypatch):
    """``get_transfer_results`` (what vLLM calls) runs ``get_finished``'s work and ``request_finished_all_groups``
    runs ``request_finished``'s: both inner hooks were timed too, so their time was added to ``hook_seconds`` twice
    and each such call counted as two in ``hook_calls``."""
    from types import SimpleNamespace

    from tests.helpers.vllm_parts import SCHEDULER, connector, worker_connector, write_model
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    model = write_model(tmp_path / "model")
    w, _l1 = worker_connector(model, {"host_pool.num_pages": 8})
    c = w._worker.counters
    calls = c.hook_calls
    w.get_transfer_results(set())
    assert c.hook_calls == calls + 1
    s = connector(model, SCHEDULER, {"host_pool.num_pages": 8})
    r = SimpleNamespace(request_id="a", all_token_ids=list(range(70)), lora_request=None, cache_salt=None,
                        kv_transfer_params=None, skip_reading_prefix_cache=False, num_prompt_tokens=70)
    s.on_new_request(r)
    calls = s._sched.counters.hook_calls
    assert s.request_finished_all_groups(r, ([1, 2, 3],)) == (False, None)
    assert s._sched.counters.hook_calls == calls + 1 and not s._sched.has_requests()


def test_controller_counters_the_docs_name_reach_the_prometheus_counters():
    """Counters kept by the scheduler's controller and the hooks (not only the stats file) are shipped as deltas."""
    from tierkv.connector.l3.controller import ControllerCounters

    c = ControllerCounters()
    d = CounterDeltas()
    assert d.take({**c.as_dict(), "hook_errors": 0}) is None          # nothing changed yet
    c.backup_stored_pages, c.prefetch_sync_jobs, c.l3_probe_hits = 12, 2, 1
    s = d.take({**c.as_dict(), "hook_errors": 1})
    assert s.data == {"ctl_backup_stored_pages": 12, "ctl_prefetch_sync_jobs": 2, "ctl_l3_probe_hits": 1,
                      "hook_errors": 1}



def test_tier_bytes_and_admission_counters_reach_prometheus():
    """A scheduler snapshot's per-tier bytes and admission counters go out as deltas and become
    ``vllm:tierkv_<key>_total`` series."""
    from tierkv.connector.l3.admission import Admission
    from tierkv.connector.obs.tier_bytes import TierBytes

    reg = CollectorRegistry()

    def own(cls):  # every metric in this test's registry: the default one already holds another test's
        class Mine(cls):
            def __init__(self, *a, **kw):
                super().__init__(*a, registry=reg, **kw)
        return Mine

    class VC:
        kv_transfer_config = None

    m = TierKVPromMetrics(VC(), {Gauge: own(Gauge), Counter: own(Counter), Histogram: own(Histogram)},
                          ["model_name", "engine"], {0: ["m", "0"]})
    adm = Admission("second_sight", 8)
    adm.admit_run([b"k" * 16, b"j" * 16])   # neither seen twice: both rejected
    adm.keep([b"i" * 16])                    # a request keeps i (request control keep): admitted all the same
    adm.admit_run([b"i" * 16])
    snap = {"save_pages": 3, "l2_hit_tokens": 16, "ctl_backup_stored_pages": 2, "ctl_l3_hit_tokens": 0,
            **adm.stats()}
    TierBytes(100, 50, 16, warn_bytes=0).add_to(snap)
    d = CounterDeltas()
    m.observe(d.take(snap).data, engine_idx=0)
    lab = {"model_name": "m", "engine": "0"}
    got = {k: reg.get_sample_value(f"vllm:tierkv_{k}_total", lab)
           for k in ("l2_written_bytes", "l2_served_bytes", "l3_written_bytes", "l3_served_bytes",
                     "ctl_admission_offered_pages", "ctl_admission_rejected_pages", "ctl_admission_admitted_pages",
                     "ctl_admission_kept_pages")}
    assert got == {"l2_written_bytes": 300, "l2_served_bytes": 100, "l3_written_bytes": 100, "l3_served_bytes": 0,
                   "ctl_admission_offered_pages": 3, "ctl_admission_rejected_pages": 2,
                   "ctl_admission_admitted_pages": 1, "ctl_admission_kept_pages": 1}

# every test here starts its objects on a machine booted a moment ago (both clocks at 0.0)
pytestmark = pytest.mark.usefixtures("young_clock")
