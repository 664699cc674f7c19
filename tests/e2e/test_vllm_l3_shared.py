"""Two engines, one after the other, share one networked L3 store: a real ``tierkv server`` (ZMQ) process, and a
real ``mooncake_master`` with the store's memory held by the test process. Pages the first engine computed are
loaded by the second one from L3; greedy outputs are bit-identical to vLLM reusing the same prefixes from its L1.

Reference (module fixture, shared): one engine without a connector and with an L1 large enough for everything runs
``first`` and then ``again`` (same documents, new questions), so ``again`` reuses the documents from its own L1.
tierkv: engine 1 runs ``first`` with write_through to the store, engine 2 (a new process: empty L1 and L2) runs
``again``; its document prefixes can only come from the store. The two stores' pairs run side by side, each engine 1
next to the reference or the other store's engine 1 (fixture ``engines``). The ZMQ engines run with ``l3.zmq.shm:
auto``: pages move through shared memory and engine 2's scheduler answers existence from the server's presence table.
"""
import random

import pytest

from tests.helpers.engine import in_parallel, run_job, stats_by_role, tierkv_kv_config
from tests.helpers.servers import mooncake_l3, mooncake_store, zmq_l3, zmq_server

P = 32
MAX_LEN = 512
ARGS = {"max_model_len": MAX_LEN}
SMALL_L1 = MAX_LEN // P + 2
MAX_TOKENS = 6
#: ``timeout_s`` of both stores. In one CI run (two test workers, so four engines on two cores) a 2 s ZMQ timeout
#: turned one request's existence query into a miss: 0 tokens from L3 where 128 were expected. A timeout is a miss
#: by design (test_vllm_l3_faults.py tests it); here it would only hide what this file checks.
STORE_TIMEOUT_S = 30.0


def _rounds():
    rng = random.Random(5)
    vocab = lambda n: [rng.randrange(10, 1000) for _ in range(n)]
    docs = [vocab(n) for n in (96, 161, 130)]
    first = [d + vocab(rng.randrange(3, 20)) for d in docs]
    again = [d + vocab(rng.randrange(3, 20)) for d in docs]
    return first, again


def _common_pages(a, b):
    """Leading full pages two prompts share (page keys chain over every earlier token)."""
    n = 0
    while (n + 1) * P <= min(len(a), len(b)) and a[n * P:(n + 1) * P] == b[n * P:(n + 1) * P]:
        n += 1
    return n


def _full_pages(prompts):
    """Pages whose KV the engine computes: the prompt and every generated token but the last one."""
    return sum((len(p) + MAX_TOKENS - 1) // P for p in prompts)


def _config(l3):
    """Every hit is taken whatever the timing: a new process's first store operations can take a second (the
    Mooncake client sets up its connections; once, under a parallel engine, 1.2 s for 3 existence queries and
    140 ms a page for the first read), which would make the existence answer late (``exists_wait_s``) or the fetch
    estimate decline later hits as slower than recomputing; a probe interval of 1 us lets every such hit go ahead.
    The stores' own timeouts are generous for the same reason (``STORE_TIMEOUT_S``). Those timing decisions have
    their own tests (test_vllm_l3_faults.py, tests/connector)."""
    return tierkv_kv_config({"host_pool": {"num_pages": 12}, "verify_checksums": True, "l3": l3,
                             "controller": {"write_policy": "write_through", "prefetch_policy": "wait_complete",
                                            "exists_wait_s": 60.0, "probe_interval_s": 1e-6}},
                            load_failure_policy="recompute")


def _engine(tiny_model, tmp_path_factory, name, prompts, l3):
    wd = tmp_path_factory.mktemp(name)   # here, not in the engine's thread
    return lambda: run_job(tiny_model, [{"name": name, "prompts": prompts}], kv_transfer_config=_config(l3),
                           num_gpu_blocks_override=SMALL_L1, max_tokens=MAX_TOKENS, extra_engine_args=ARGS,
                           workdir=wd)


@pytest.fixture(scope="module")
def engines(tiny_model, tmp_path_factory):
    """Every engine of this file, two at a time (``_engine.in_parallel``), with both stores up: first the reference
    and the two stores' engines 1 (independent of each other), then the two engines 2. Returns the results and what
    the tests read of the stores between and after the engines: ``{"ref", "zmq": {"e1", "e2", "held_after_e1", "st",
    "pid"}, "mooncake": {"e1", "e2", "master_alive"}}``."""
    first, again = _rounds()
    ref_wd = tmp_path_factory.mktemp("ref")
    with zmq_server(tmp_path_factory.mktemp("zmq")) as srv, mooncake_store(tmp_path_factory.mktemp("mooncake")) as mc:
        zl3 = zmq_l3(srv.endpoint, timeout_s=STORE_TIMEOUT_S, shm="auto")
        ml3 = mooncake_l3(mc.master.master_address, mc.master.metadata_server, timeout_s=STORE_TIMEOUT_S)
        one = in_parallel(
            ref=lambda: run_job(tiny_model, [{"name": "first", "prompts": first}, {"name": "again", "prompts": again}],
                                kv_transfer_config=None, num_gpu_blocks_override=200, max_tokens=MAX_TOKENS,
                                extra_engine_args=ARGS, workdir=ref_wd),
            zmq=_engine(tiny_model, tmp_path_factory, "first", first, zl3),
            mooncake=_engine(tiny_model, tmp_path_factory, "first", first, ml3))
        held_after_e1 = srv.server_stats()["keys"]
        two = in_parallel(zmq=_engine(tiny_model, tmp_path_factory, "again", again, zl3),
                          mooncake=_engine(tiny_model, tmp_path_factory, "again", again, ml3))
        st = srv.server_stats()
        pid = srv.pid
        master_alive = mc.master.alive()
    return {"ref": one["ref"],
            "zmq": {"e1": one["zmq"], "e2": two["zmq"], "held_after_e1": held_after_e1, "st": st, "pid": pid},
            "mooncake": {"e1": one["mooncake"], "e2": two["mooncake"], "master_alive": master_alive}}


@pytest.fixture(scope="module")
def ref(engines):
    return engines["ref"]


def _check_pair(ref, e1, e2):
    """Assertions common to both stores: engine 1 stored every full page; engine 2 loaded from L3 exactly what the
    reference reused from L1, bit-exact."""
    first, again = _rounds()
    # engine 1: every computed page went to L3, outputs as computed by the reference
    assert e1["workloads"]["first"]["outputs"] == ref["workloads"]["first"]["outputs"]
    s1 = stats_by_role(e1)
    w1, c1 = s1["worker"], s1["scheduler"]
    assert w1["l3_backup_pages"] == _full_pages(first), w1
    assert w1["l3_backup_failed_pages"] == 0 and w1["l3_store_errors"] == 0, w1
    assert c1["ctl_backup_stored_pages"] <= w1["l3_backup_pages"] and c1["ctl_l3_hit_tokens"] == 0, c1
    # engine 2: the documents' pages come from L3
    out, want = e2["workloads"]["again"], ref["workloads"]["again"]
    reused = sum(want["num_cached_tokens"])
    expected = sum(min(_common_pages(a, b), (len(b) - 1) // P) * P for a, b in zip(first, again))
    assert reused == expected > 0, (want["num_cached_tokens"], expected)  # the reference reused every shared page
    assert out["outputs"] == want["outputs"]
    s2 = stats_by_role(e2)
    w2, c2 = s2["worker"], s2["scheduler"]
    # no store call failed or timed out in either engine (each would have been a miss): checked first, so that a
    # miss caused by one says so
    for w in (w1, w2):
        assert w["l3_errors"] == 0 and w["l3_timeouts"] == 0, w
    assert out["num_cached_tokens"] == want["num_cached_tokens"], (c2, w2)
    assert c2["ctl_l3_hit_tokens"] == reused, c2
    # engine 2 starts with an empty index: each request's first lookup asks L3 once for its whole prefix (at most
    # (len - 1) // P pages), the answer finds the shared pages and marks the next one absent, so no request asks twice
    assert c2["ctl_exists_queries"] == len(again), c2
    assert c2["ctl_exists_found_pages"] == reused // P, c2
    assert w2["l3_prefetch_pages"] == reused // P and w2["async_load_pages"] == reused // P, w2
    assert w2["l3_prefetch_failed_pages"] == 0 and w2["failed_load_blocks"] == 0, w2
    assert w2["checksum_mismatches"] == 0 and w2["l3_store_errors"] == 0, w2
    assert c2["l2_hit_tokens"] == 0, c2  # a new process: nothing came from its own L2
    assert c2["locked_pages"] == 0 and c2["live_requests"] == 0, c2
    assert e1["leaked_processes"] == 0 and e2["leaked_processes"] == 0
    return w1, w2


def test_zmq_server_shared_by_two_engines(ref, engines):
    first, again = _rounds()
    z = engines["zmq"]
    e1, e2, held_after_e1, st, pid = z["e1"], z["e2"], z["held_after_e1"], z["st"], z["pid"]
    w1, w2 = _check_pair(ref, e1, e2)
    # the server (one process all along) holds exactly the pages both engines reported stored
    assert held_after_e1 == w1["l3_backup_pages"] == _full_pages(first), held_after_e1
    new_in_e2 = _full_pages(again) - sum(_common_pages(a, b) for a, b in zip(first, again))
    assert w2["l3_backup_pages"] == new_in_e2 and w2["l3_backup_failed_pages"] == 0, w2
    assert st["keys"] == held_after_e1 + new_in_e2, st
    # the server counts hits and misses of reads only (existence checks count neither); engine 1 read nothing and
    # engine 2 read exactly the pages it loaded, every one present
    assert st["pid"] == pid, st
    assert st["hits"] == w2["l3_prefetch_pages"] == sum(ref["workloads"]["again"]["num_cached_tokens"]) // P, st
    assert st["misses"] == 0, st
    # the engines used the shared-memory path and asked for the presence table, from which engine 2's existence
    # answers (checked in _check_pair: one query per request, exactly the shared pages found) came
    assert st["shm_attached"] >= 2 and st["shm_bytes_in"] > 0 and st["shm_bytes_out"] > 0, st
    assert st["presence"] is not None and st["presence_tables"] >= 1, st


def test_mooncake_store_shared_by_two_engines(ref, engines):
    first, again = _rounds()
    m = engines["mooncake"]
    e1, e2, master_alive = m["e1"], m["e2"], m["master_alive"]
    assert master_alive
    _w1, w2 = _check_pair(ref, e1, e2)
    new_in_e2 = _full_pages(again) - sum(_common_pages(a, b) for a, b in zip(first, again))
    assert w2["l3_backup_pages"] == new_in_e2 and w2["l3_backup_failed_pages"] == 0, w2
