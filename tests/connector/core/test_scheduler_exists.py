"""The scheduler's own existence answer (``connector.vllm.connector.scheduler_exists``) for a ZMQ server on this
machine: answered in one short round trip, over every rank's namespace, and "cannot answer" (None: the workers are
asked) instead of "absent" when the server is silent."""
from __future__ import annotations

import time

from tests.helpers.fixtures_zmq import make_backend  # noqa: E402

from tierkv.connector.core.config import L3Config  # noqa: E402
from tierkv.connector.l3.io import l3_key  # noqa: E402
from tierkv.connector.vllm.connector import SCHEDULER_EXISTS_TIMEOUT_S, scheduler_exists  # noqa: E402

PAGE_BYTES = 4096
D0, D1 = bytes(range(16)), bytes(range(1, 17))   # two ranks' namespace digests
KEYS = [bytes([i]) * 16 for i in range(1, 6)]


def _l3(endpoint: str) -> L3Config:
    return L3Config(backend="zmq", zmq={"endpoint": endpoint, "timeout_s": 3.0, "max_backoff_s": 0.2})


def _write(client, digest: bytes, keys) -> None:
    assert all(client.batch_set([l3_key(digest, k) for k in keys], [bytes([7]) * PAGE_BYTES] * len(keys)))


def test_a_local_zmq_server_answers_existence_in_the_scheduler_over_every_rank(tmp_path):
    with make_backend(tmp_path, PAGE_BYTES, D0, timeout_s=3.0) as h:
        _write(h.new_client(namespace=D0), D0, KEYS[:4])
        _write(h.new_client(namespace=D1), D1, KEYS[:2] + KEYS[3:4])   # rank 1 lacks the third page
        built = scheduler_exists(_l3(h.endpoint), [D0, D1], PAGE_BYTES)
        assert built is not None
        exists, stores = built
        try:
            assert [s.store.timeout_s for s in stores] == [SCHEDULER_EXISTS_TIMEOUT_S] * 2
            assert exists(KEYS) == 2                  # the leading run present under both namespaces
            assert exists(KEYS[3:]) == 1
            assert exists(KEYS[4:]) == 0              # an answer: absent
            assert sum(len(v) for s in stores for v in s.take_latencies().values()) == 5   # 2 + 2 + 1 queries
        finally:
            for s in stores:
                s.close()


def test_a_silent_server_is_cannot_answer_not_absent(tmp_path):
    with make_backend(tmp_path, PAGE_BYTES, D0, timeout_s=3.0) as h:
        _write(h.new_client(namespace=D0), D0, KEYS)
        exists, stores = scheduler_exists(_l3(h.endpoint), [D0], PAGE_BYTES)
        try:
            assert exists(KEYS) == 5
            h.stop()                                  # SIGSTOP: the server answers nothing
            try:
                t0 = time.monotonic()
                assert exists(KEYS) is None           # times out: the workers are asked, nothing marked absent
                assert exists(KEYS) is None           # next one (reconnect or back-off): still no false "absent"
                assert time.monotonic() - t0 < 3.0    # the store's own timeout_s (3 s) was not waited
            finally:
                h.cont()
        finally:
            for s in stores:
                s.close()


def test_a_store_that_answers_over_the_network_is_not_asked_in_the_scheduler():
    # the LMCache client has no local existence check (nothing listens on port 1: its start-up probe fails fast)
    l3 = L3Config(backend="lmcache", lmcache={"endpoint": "tcp://127.0.0.1:1", "page_tokens": 16, "timeout_s": 0.1})
    assert scheduler_exists(l3, [D0], PAGE_BYTES) is None
