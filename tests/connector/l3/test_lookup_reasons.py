"""Lookup accounting and per-request controls on the fake engine with real scheduler/worker halves and a real file
store: every counted lookup token is served from a tier or has a reason (the parts sum to the lookup total), reuse
distances per tier, and the per-request controls of ``kv_transfer_params["tierkv"]``."""
from types import SimpleNamespace

import pytest

from tests.helpers.fake_engine import P, FakeEngine, Req
from tests.connector.l3.test_controller import _hanging_l3_load, file_store, pump, write_to_l3
from tierkv.connector.l3.controller import HIT_PARTS, MISS_REASONS
from tierkv.connector.core.request_params import RequestControls, RequestParamsError, parse_controls
from tierkv.storage_backends.faulty import FaultyBackend


def toks(a, n):
    return [(a * 7919 + i) % 30000 + 1 for i in range(n)]


def parts(e) -> dict:
    """The lookup statistics of ``e``; asserts that the parts and the waiting tokens sum to the lookup total."""
    s = e.sched.stats()
    got = {k: s[f"lookup_{k}_tokens"] for k in HIT_PARTS + MISS_REASONS}
    assert sum(got.values()) + s["lookup_waiting_tokens"] == s["lookup_tokens"], (got, s["lookup_waiting_tokens"],
                                                                                   s["lookup_tokens"])
    got["waiting"] = s["lookup_waiting_tokens"]
    got["total"] = s["lookup_tokens"]
    return {k: v for k, v in got.items() if v}


def admit_async(e, req):
    """Admit ``req`` through the controller up to its L3 load being ordered (not ended); returns its hit."""
    e.sched.add_request(req.req_id, req.tokens)
    for _ in range(50):
        ext = e.sched.lookup(req.req_id, 0)
        if ext is not None:
            break
        pump(e)
    assert ext and e.sched.lookup_is_async(req.req_id)
    req.blocks = [e.free_blocks.pop(0) for _ in range((len(req.tokens) + P - 1) // P)]
    e.sched.on_alloc(req.req_id, req.blocks, ext)
    e.waiting[req.req_id] = req
    return ext


def test_a_mixed_workload_is_partitioned_exactly(tmp_path):
    doc = toks(1, 4 * P)
    write_to_l3(tmp_path, toks(2, 4 * P))       # an earlier engine left a second document in L3
    e = FakeEngine(store=file_store(tmp_path), controller={"prefetch_policy": "wait_complete"})
    e.run_l3(Req("a", doc + [1]))               # computes: 4 pages in no tier
    assert parts(e) == {"miss": 4 * P, "total": 4 * P}
    e.run_l3(Req("a2", doc + [2]))              # L2
    # vLLM never lets a request with prompt logprobs read a cache: it is not counted at all
    e.sched.add_request("n", doc + [3])
    e.sched.no_read("n", 0)
    n = Req("n", doc + [3], blocks=[e.free_blocks.pop(0) for _ in range(5)])
    e.sched.on_alloc("n", n.blocks, 0)
    e.running["n"] = n
    e.step()
    e.finish(n)
    e.sched.add_request("s", doc + [4], controls=RequestControls(load=False))
    assert e.run_l3(Req("s", doc + [4])) == 0   # skipped: the request asked
    e.sched.add_request("m", doc + [5], controls=RequestControls(load_max_tokens=2 * P + 7))
    assert e.run_l3(Req("m", doc + [5])) == 2 * P
    assert e.run_l3(Req("b", toks(2, 4 * P) + [1])) == 4 * P   # the L3 document, read from L3
    e.settle()
    assert parts(e) == {"miss": 4 * P, "l2": 4 * P + 2 * P, "skipped": 4 * P + 2 * P, "l3": 4 * P, "total": 20 * P}
    # declined as slower than recomputing: a slow fetch estimate against a fast recompute estimate
    assert e.sched.reset()
    e.sched.ctl.fetch_s_per_page.add(10.0)
    e.sched.ctl.prefill_s_per_token.add(1e-9)
    assert e.run_l3(Req("d", doc + [6])) == 0
    assert parts(e)["declined_slow"] == 4 * P
    e.sched.ctl.fetch_s_per_page.value = e.sched.ctl.prefill_s_per_token.value = None
    # an L3 load still running is "waiting"; the request ends before its load did: aborted
    assert e.sched.reset()
    req = Req("x", doc + [7])
    admit_async(e, req)
    assert parts(e)["waiting"] == 4 * P
    e.waiting.pop("x")
    e.finish(req)
    e.settle()
    got = parts(e)
    assert got["aborted"] == 4 * P and "waiting" not in got
    assert got == {"miss": 4 * P, "l2": 6 * P, "skipped": 6 * P, "l3": 4 * P, "declined_slow": 4 * P,
                   "aborted": 4 * P, "total": 28 * P}
    e.idle_check()
    e.close()


def test_a_failed_read_and_a_late_read_are_told_apart(tmp_path):
    doc = toks(3, 4 * P)
    write_to_l3(tmp_path / "f", doc)
    e = FakeEngine(store=file_store(tmp_path / "f"), controller={"prefetch_policy": "wait_complete"})
    e.worker.l3.store = FaultyBackend(e.worker.l3.store, fail_get=1.0)
    assert e.run_l3(Req("f", doc + [1])) == 0
    e.settle()
    assert parts(e) == {"failed": 4 * P, "total": 4 * P}
    e.close()
    # the read hangs past the request's deadline, then completes: the pages arrived intact, too late
    now = [0.0]
    e, faulty, req = _hanging_l3_load(tmp_path / "l", toks(4, 4 * P), clock=lambda: now[0],
                                      controller={"prefetch_policy": "timeout", "prefetch_timeout_base_s": 0.5,
                                                  "prefetch_timeout_per_page_s": 0.0})
    assert parts(e) == {"waiting": 4 * P, "total": 4 * P}
    now[0] += 0.6
    e.step(compute=False)                        # released at its deadline; the read still hangs
    assert parts(e) == {"waiting": 4 * P, "total": 4 * P}
    faulty.release()
    e.settle()
    assert parts(e) == {"late": 4 * P, "total": 4 * P}
    e.close()


def test_no_l2_room_for_the_staging_slots(tmp_path):
    doc = toks(5, 4 * P)
    write_to_l3(tmp_path, doc)
    e = FakeEngine(num_slots=4, store=file_store(tmp_path),
                   controller={"room_retry_steps": 0, "room_wait_s": 0.0, "write_policy": "write_through"})
    other = toks(6, 4 * P)
    e.run_l3(Req("o", other + [1]))              # L2 full with another document ...
    e.settle()
    holder = Req("o2", other + [2])
    e.admit_l3(holder)                           # ... whose pages a running request keeps locked
    assert e.run_l3(Req("b", doc + [1])) == 0
    assert parts(e)["no_room"] == 4 * P
    e.step()
    e.finish(holder)
    e.settle()
    parts(e)
    e.close()


def test_reuse_distance_per_tier(tmp_path):
    now = [100.0]
    doc = toks(7, 4 * P)
    e = FakeEngine(store=file_store(tmp_path), clock=lambda: now[0], controller={"prefetch_policy": "wait_complete"})
    e.run_l3(Req("a", doc + [1]))                # stored in L2 and (write-through) L3 at t=100
    e.settle()
    now[0] += 30.0
    e.run_l3(Req("b", doc + [2]))                # L2 hit after 30 s
    h = e.sched.stats()["reuse_distance_seconds"]   # the snapshot's histograms follow every later hit
    assert h["L2"]["count"] == 4 and h["L3"]["count"] == 0
    assert e.sched.reset()
    now[0] += 600.0
    e.run_l3(Req("c", doc + [3]))                # L3 hit 630 s after the backup
    e.settle()
    h = e.sched.stats()["reuse_distance_seconds"]
    assert h["L2"]["count"] == 4 and h["L2"]["le"]["10"] == 0 and h["L2"]["le"]["60"] == 4
    assert h["L3"]["count"] == 4 and h["L3"]["le"]["300"] == 0 and h["L3"]["le"]["1800"] == 4
    assert h["L3"]["sum"] == pytest.approx(4 * 630.0)
    samples = e.sched.lookup_stats.take_samples()
    assert samples == {"L2": [30.0] * 4, "L3": [630.0] * 4}
    assert e.sched.lookup_stats.take_samples() == {}
    e.close()


# ------------------------------------------------------------------ per-request controls
def test_save_controls():
    e = FakeEngine()
    doc = toks(8, 4 * P)
    e.sched.add_request("a", doc + [1], controls=RequestControls(save=False))
    e.run(Req("a", doc + [1]))
    assert e.sched.counters.save_pages == 0 and e.sched.index.total_pages == 0
    e.sched.add_request("b", doc + [2], controls=RequestControls(save_max_tokens=2 * P + 31))
    e.run(Req("b", doc + [2]))
    assert e.sched.counters.save_pages == 2
    assert e.run(Req("c", doc + [3])) == 2 * P   # only the saved prefix is in L2; c saves the rest
    assert e.run(Req("d", doc + [4])) == 4 * P
    e.idle_check()


def test_load_controls_without_l3():
    e = FakeEngine()
    doc = toks(9, 4 * P)
    e.run(Req("a", doc + [1]))
    e.sched.add_request("b", doc + [2], controls=RequestControls(load_max_tokens=P))
    assert e.run(Req("b", doc + [2])) == P
    e.sched.add_request("c", doc + [3], controls=RequestControls(load=False, load_max_tokens=4 * P))
    assert e.run(Req("c", doc + [3])) == 0
    assert parts(e) == {"miss": 4 * P, "l2": P, "skipped": 7 * P, "total": 12 * P}


@pytest.mark.parametrize("raw, field", [
    ({"tierkv": {"load": "no"}}, "kv_transfer_params.tierkv.load"),
    ({"tierkv": {"load": 0}}, "kv_transfer_params.tierkv.load"),
    ({"tierkv": {"save_max_tokens": -1}}, "kv_transfer_params.tierkv.save_max_tokens"),
    ({"tierkv": {"load_max_tokens": True}}, "kv_transfer_params.tierkv.load_max_tokens"),
    ({"tierkv": {"load_max_tokens": 1.5}}, "kv_transfer_params.tierkv.load_max_tokens"),
    ({"tierkv": {"lod": False}}, "kv_transfer_params.tierkv.lod"),
    ({"tierkv": {"keep": "yes"}}, "kv_transfer_params.tierkv.keep"),
    ({"tierkv": {"keep": 1}}, "kv_transfer_params.tierkv.keep"),
    ({"tierkv": [False]}, "kv_transfer_params.tierkv"),
])
def test_malformed_controls_are_refused_naming_the_field(raw, field):
    with pytest.raises(RequestParamsError) as exc:
        parse_controls(raw)
    assert str(exc.value).startswith(field + ":"), str(exc.value)


def test_wellformed_controls():
    assert parse_controls(None) is None and parse_controls({"do_remote_prefill": True}) is None
    c = parse_controls({"tierkv": {"save": False, "load_max_tokens": 64}, "other_connector": {"x": 1}})
    assert c == RequestControls(save=False, load_max_tokens=64)
    assert (c.load_pages(32), c.save_pages(32)) == (2, 0)
    assert parse_controls({"tierkv": {}}).load_pages(32) is None
    assert parse_controls({"tierkv": {}}).keep is False
    assert parse_controls({"tierkv": {"keep": True, "save_max_tokens": 64}}) == RequestControls(keep=True,
                                                                                              save_max_tokens=64)


# ------------------------------------------------------------------ the connector's side (vLLM objects)
def _vllm_request(rid, tokens, params):
    from vllm import SamplingParams
    from vllm.v1.request import Request
    sp = SamplingParams(max_tokens=4, extra_args={"kv_transfer_params": params} if params is not None else None)
    return Request(rid, prompt_token_ids=list(tokens), sampling_params=sp, pooling_params=None)


@pytest.fixture
def sched_connector(tmp_path, monkeypatch):
    from tests.helpers.vllm_parts import SCHEDULER, TierkvLoggerState, connector, write_model
    monkeypatch.setenv("TIERKV_LEDGER_DIR", str(tmp_path))
    state = TierkvLoggerState()
    yield connector(write_model(tmp_path / "model"), SCHEDULER, {"host_pool.num_pages": 8})
    state.restore()


def test_the_connector_reads_controls_from_kv_transfer_params(sched_connector):
    c = sched_connector
    T = list(range(1, 3 * 32 + 2))
    r = _vllm_request("r", T, {"tierkv": {"save_max_tokens": 40, "keep": True}})
    assert r.kv_transfer_params == {"tierkv": {"save_max_tokens": 40, "keep": True}}  # vLLM: extra_args -> request
    c.on_new_request(r)
    assert c._sched.requests["r"].save_cap == 1 and c._sched.requests["r"].keep is True
    assert c.request_finished(r, []) == (False, None)


def test_malformed_controls_reaching_the_scheduler_serve_the_request_without_tierkv(sched_connector, caplog):
    c = sched_connector
    s = c._sched
    T = list(range(1, 3 * 32 + 2))
    s.add_request("w", T)                       # a request that put 3 pages into L2
    s.lookup("w", 0)
    s.schedule_saves("w", len(T), [1, 2, 3, 4])
    s.build_plan()
    s.on_finished("w")
    r = _vllm_request("r", T, {"tierkv": {"load": "no"}})
    c.on_new_request(r)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)   # nothing loaded ...
    c.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8],)), 0)
    s.schedule_saves("r", len(T) + 40, [5, 6, 7, 8])
    assert s.counters.save_pages == 3                          # ... nothing saved (only w's 3 pages)
    assert s.counters.request_params_refused == 1
    delay, params = c.request_finished(r, [5, 6, 7, 8])
    assert delay is False and params["tierkv_error"].startswith("kv_transfer_params.tierkv.load:")
    assert s.stats()["lookup_skipped_tokens"] == 3 * 32


def test_a_request_that_never_reads_the_cache_is_not_counted(sched_connector):
    c = sched_connector
    from vllm import SamplingParams
    from vllm.v1.request import Request
    T = list(range(1, 3 * 32 + 2))
    r = Request("p", prompt_token_ids=T, sampling_params=SamplingParams(max_tokens=1, prompt_logprobs=1),
                pooling_params=None)
    assert r.skip_reading_prefix_cache
    c.on_new_request(r)
    assert c.get_num_new_matched_tokens(r, 0) == (0, False)
    c.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([5, 6, 7, 8],)), 0)
    assert c._sched.stats()["lookup_tokens"] == 0


def test_outcomes_and_reuse_distances_reach_prometheus():
    from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

    from tierkv.connector.vllm.metrics import CounterDeltas, TierKVPromMetrics, scheduler_gauges
    reg = CollectorRegistry()

    def bind(cls):
        class B(cls):
            def __init__(self, *a, **kw):
                kw.pop("multiprocess_mode", None)
                super().__init__(*a, registry=reg, **kw)
        return B

    m = TierKVPromMetrics(SimpleNamespace(kv_transfer_config=None),
                          {Gauge: bind(Gauge), Counter: bind(Counter), Histogram: bind(Histogram)},
                          ["model_name", "engine"], {0: ["m", "0"]})
    snap = {"lookup_tokens": 320, "lookup_l2_tokens": 64, "lookup_miss_tokens": 96, "lookup_late_tokens": 32,
            "lookup_waiting_tokens": 128, "num_slots": 8, "free_slots": 8}
    s = CounterDeltas().take({**snap, **scheduler_gauges(snap)}, {"reuse_l2_seconds": [30.0, 30.0],
                                                                  "reuse_l3_seconds": [700.0]})
    m.observe(s.data)
    lab = {"model_name": "m", "engine": "0"}
    assert reg.get_sample_value("vllm:tierkv_lookup_outcome_tokens_total", {**lab, "outcome": "l2"}) == 64
    assert reg.get_sample_value("vllm:tierkv_lookup_outcome_tokens_total", {**lab, "outcome": "late"}) == 32
    assert reg.get_sample_value("vllm:tierkv_lookup_outcome_tokens_total", {**lab, "outcome": "l3"}) == 0
    assert reg.get_sample_value("vllm:tierkv_lookup_waiting_tokens", lab) == 128
    assert reg.get_sample_value("vllm:tierkv_lookup_tokens_total", lab) == 320
    assert reg.get_sample_value("vllm:tierkv_reuse_distance_seconds_bucket", {**lab, "tier": "L2", "le": "60.0"}) == 2
    assert reg.get_sample_value("vllm:tierkv_reuse_distance_seconds_count", {**lab, "tier": "L3"}) == 1
    assert reg.get_sample_value("vllm:tierkv_reuse_distance_seconds_bucket", {**lab, "tier": "L3", "le": "300.0"}) == 0


@pytest.mark.parametrize("cancelled, reason", [(4, "late"), (2, "failed"), (0, "failed")])
def test_pages_never_read_because_the_request_was_released_first_are_late(cancelled, reason):
    """A prefetch whose request was released at its deadline before its reads were sent reports those pages as not
    done and ``cancelled``: they count as late, not as failed reads (the first unserved page decides)."""
    from tests.connector.core.test_concurrent_load import _controller, _keys
    from tierkv.connector.core.plan import JobReport
    _index, _alloc, ctl = _controller(8)
    keys = _keys(11, 4)
    ctl._found([], keys, 4)                       # indexed as L3-only (an existence answer)
    ctl.expect_outcome("r", 4 * P)
    job = ctl.start_prefetch("r", keys, 0, 4, [1, 2, 3, 4])
    ctl.on_reports([JobReport(job.job_id, job.kind, [False] * 4, cancelled=cancelled)])
    ctl.on_finished_recving({"r"}, {1, 2, 3, 4})
    assert ctl.lookup_stats.tokens[reason] == 4 * P and ctl.lookup_stats.waiting == 0


@pytest.mark.parametrize("ok, cancelled, reason", [([True] * 4, 0, "late"), ([True, False, True, True], 0, "failed"),
                                                   ([False] * 4, 4, "late")])
def test_a_load_failed_as_a_whole_request_serves_nothing(ok, cancelled, reason):
    """A model of several KV cache groups: the workers name a failed load by request (vLLM's ``failed_recving``,
    never block ids), and vLLM recomputes it from its first token. None of its tokens count as served from L3;
    all go to the reason of its first page to read that did not arrive intact (``late`` when every page read
    arrived, the request having been released first)."""
    from tests.connector.core.test_concurrent_load import _controller, _keys
    from tierkv.connector.core.plan import JobReport
    _index, _alloc, ctl = _controller(8)
    keys = _keys(12, 4)
    ctl._found([], keys, 4)
    ctl.expect_outcome("r", 4 * P)
    job = ctl.start_prefetch("r", keys, 0, 4, [1, 2, 3, 4])
    ctl.on_reports([JobReport(job.job_id, job.kind, ok, cancelled=cancelled)])
    ctl.on_finished_recving({"r"}, set(), {"r"})
    ls = ctl.lookup_stats
    assert ls.tokens[reason] == 4 * P and ls.tokens["l3"] == ls.tokens["l2"] == 0 and ls.waiting == 0
