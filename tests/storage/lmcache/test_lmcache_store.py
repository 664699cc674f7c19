"""The ``lmcache`` L3 store against a real LMCache 0.5.6 cache server, beyond the shared contract suite
(test_contract.py runs that suite on it too): pages named by their token ids, LMCache's own naming, foreign models,
a server of another chunk size, a rejected request (no reply), a vanished shared-memory segment, config errors."""
from __future__ import annotations

import os
import time

import numpy as np
import pytest
import torch

from tests.helpers import fixtures_lmcache as F
from tierkv.storage_backends.base import PageTokens
from tierkv.storage_backends.common import ConfigError
from tierkv.storage_backends.factory import build_backend, validate_l3
from tierkv.storage_backends.lmcache.store import LMCacheStore

NS = bytes(range(16))
PB = 4096
C = F.PAGE_TOKENS


def pages(n: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.frombuffer(rng.bytes(PB), dtype=np.uint8).copy()) for _ in range(n)]


def keys(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16).hex() for _ in range(n)]


def prefix_tokens(n_pages: int, seed: int, root: bytes) -> list[PageTokens]:
    toks = [int(t) for t in np.random.default_rng(seed).integers(0, 150_000, n_pages * C)]
    return [PageTokens(toks[:(i + 1) * C], root) for i in range(n_pages)]


@pytest.fixture
def shared(tmp_path):
    with F.make_backend(tmp_path, PB, NS) as h:
        yield h


def test_pages_named_by_tokens_round_trip_and_line_up_with_lmcache_chunks(shared):
    """Pages sent with their token ids: one range per prefix, leading-run exists from any page on, a batch starting
    mid-prefix, and the server's own lookup of those tokens (LMCache's naming) finds exactly those chunks."""
    b = shared.backend
    root = bytes(range(100, 116))
    pt, ks, src = prefix_tokens(8, 1, root), keys(8, 1), pages(8, 1)
    assert b.batch_set(ks[:5], src[:5], tokens=pt[:5]) == [True] * 5
    assert b.batch_exists(ks, tokens=pt) == 5
    assert b.batch_exists(ks[3:], tokens=pt[3:]) == 2
    assert b.batch_exists(ks[5:], tokens=pt[5:]) == 0
    dst = [torch.zeros(PB, dtype=torch.uint8) for _ in ks]
    assert b.batch_get(ks[2:], dst[2:], tokens=pt[2:]) == [True] * 3 + [False] * 3
    assert all(torch.equal(dst[i], src[i]) for i in range(2, 5))
    # LMCache's own view: a lookup of the 5-page prefix under this store's model name and the request root as salt
    rid = "probe-" + os.urandom(4).hex()
    key = {"model_name": b.lm_model, "world_size": 1, "worker_id": None, "token_ids": list(pt[7].prefix),
           "start": 0, "end": 8 * C, "request_id": rid, "cache_salt": root.hex(), "request_configs": None,
           "num_kv_readers": 1}
    assert F.request(shared.endpoint, "lookup", key, 1) == (True, None)
    assert F.request(shared.endpoint, "wait_prefetch_status", rid, 2.0) == (True, 5)
    F.request(shared.endpoint, "free_lookup_locks", key, 1)
    F.request(shared.endpoint, "end_session", rid)


def test_tokens_of_another_salt_or_prefix_never_match(shared):
    b = shared.backend
    root = bytes(16)
    pt, ks, src = prefix_tokens(3, 2, root), keys(3, 2), pages(3, 2)
    assert b.batch_set(ks, src, tokens=pt) == [True] * 3
    other_root = [PageTokens(p.prefix, bytes([1]) * 16) for p in pt]
    assert b.batch_exists(ks, tokens=other_root) == 0
    changed = list(pt[2].prefix)
    changed[0] += 1  # the same last page after another first token: another chunk hash
    dst = [torch.full((PB,), 9, dtype=torch.uint8)]
    assert b.batch_get(ks[2:], dst, tokens=[PageTokens(changed, root)]) == [False]
    assert bool((dst[0] == 9).all())
    # the same tokens without tokens (key-named pages) are another key space as well
    assert b.batch_exists(ks) == 0


def test_bad_tokens_raise_value_error(shared):
    b = shared.backend
    ks, src = keys(2, 3), pages(2, 3)
    root = bytes(16)
    for bad in ([PageTokens([1] * C, root)],                          # one entry for two keys
                [PageTokens([1] * (C - 1), root)] * 2,                  # not a whole page
                [PageTokens([-1] * C, root), PageTokens([1] * 2 * C, root)],
                [PageTokens([2**32] * C, root), PageTokens([1] * 2 * C, root)],
                [PageTokens([1] * C, b"short"), PageTokens([1] * 2 * C, root)],
                [([1] * C, root), ([1] * 2 * C, root)]):              # not PageTokens
        with pytest.raises(ValueError):
            b.batch_set(ks, src, tokens=bad)
    assert b.stats()["set_failures"] == 0


def test_other_model_label_or_namespace_never_matches(shared):
    a = shared.backend
    ks, src = keys(4, 4), pages(4, 4)
    assert a.batch_set(ks, src) == [True] * 4
    other_label = shared.new_client(model_name="someone-else")
    other_ns = shared.new_client(namespace=bytes(range(1, 17)))
    for c in (other_label, other_ns):
        dst = [torch.full((PB,), 3, dtype=torch.uint8) for _ in ks]
        assert c.batch_exists(ks) == 0
        assert c.batch_get(ks, dst) == [False] * 4
        assert all(bool((d == 3).all()) for d in dst)
    assert shared.new_client().batch_exists(ks) == 4


def test_server_of_another_chunk_size_is_a_clear_error(shared):
    with pytest.raises(ConfigError, match=r"chunk size 16 but 'l3\.lmcache\.page_tokens' is 32"):
        LMCacheStore(NS, PB, endpoint=shared.endpoint, page_tokens=32, timeout_s=3.0)
    with pytest.raises(ConfigError, match=r"l3\.lmcache\.page_tokens"):
        build_backend({"backend": "lmcache", "lmcache": {"endpoint": shared.endpoint, "page_tokens": 32}}, NS, PB)


def test_server_down_at_start_then_another_chunk_size_disables_the_store(tmp_path):
    port = F._free_port()
    t0 = time.monotonic()
    b = LMCacheStore(NS, PB, endpoint=f"tcp://127.0.0.1:{port}", page_tokens=32, timeout_s=0.5,
                     reconnect_backoff_s=0.0, max_backoff_s=0.0)
    try:
        assert time.monotonic() - t0 < 5.0
        ks, src = keys(2, 5), pages(2, 5)
        assert b.batch_set(ks, src) == [False, False] and b.batch_exists(ks) == 0
        assert b.stats()["timeouts"] >= 1
        p, _, shm = F.start_server(16, port=port, log_path=str(tmp_path / "server.log"))
        try:
            assert b.batch_set(ks, src) == [False, False]
            assert b.batch_get(ks, [bytearray(PB), bytearray(PB)]) == [False, False]
            st = b.stats()
            assert st["refused"] >= 2 and "chunk size 16" in st["disabled"]
        finally:
            F._stop_proc(p, shm, grace_s=2.0)
    finally:
        b.close()


def test_rejected_request_times_out_then_the_store_registers_again(shared):
    """LMCache answers nothing to a request it rejects: here the server forgot this store's worker instance (as
    its reaper does with silent workers). The call gives up after timeout_s, the next one registers anew."""
    b = shared.new_client(timeout_s=1.0, reconnect_backoff_s=0.0)
    ks, src = keys(3, 6), pages(3, 6)
    assert b.batch_set(ks[:1], src[:1]) == [True]
    assert F.request(shared.endpoint, "unregister_kv_cache_engine_driven_context", b._instance) == (True, None)
    t0 = time.monotonic()
    assert b.batch_set(ks[1:2], src[1:2]) == [False]
    assert 0.9 <= time.monotonic() - t0 <= 4.0
    assert b.stats()["timeouts"] == 1
    assert b.batch_set(ks[1:], src[1:]) == [True, True]
    dst = [torch.zeros(PB, dtype=torch.uint8) for _ in ks]
    assert b.batch_get(ks, dst) == [True] * 3 and all(torch.equal(s, d) for s, d in zip(src, dst))
    assert b.stats()["registrations"] == 2


def test_vanished_shared_memory_segment_is_a_miss_never_wrong_bytes(tmp_path):
    with F.make_backend(tmp_path, PB, NS, private=True, timeout_s=1.0) as h:
        b = h.backend
        ks, src = keys(4, 7), pages(4, 7)
        assert b.batch_set(ks, src) == [True] * 4
        os.unlink(h.shm_path)
        t0 = time.monotonic()
        dst = [torch.full((PB,), 1, dtype=torch.uint8) for _ in ks]
        assert b.batch_get(ks, dst) == [False] * 4
        assert b.batch_set(keys(1, 8), pages(1, 8)) == [False]
        assert b.batch_exists(ks) == 0
        assert time.monotonic() - t0 < 10.0
        assert all(bool((d == 1).all()) for d in dst)
        assert b.stats()["shm_lost"] >= 1


def test_factory_builds_it_and_names_bad_keys(shared):
    s = build_backend({"backend": "lmcache", "lmcache": {"endpoint": shared.endpoint, "page_tokens": C}}, NS, PB)
    try:
        assert isinstance(s, LMCacheStore)
        assert s.batch_set(keys(1, 9), pages(1, 9)) == [True]
    finally:
        s.close()
    for sub, msg in (({"page_tokens": C, "port": 1}, r"unknown config key 'l3\.lmcache\.port'"),
                     ({}, r"missing config key 'l3\.lmcache\.page_tokens'"),
                     ({"page_tokens": 2}, r"l3\.lmcache\.page_tokens.*>= 4"),
                     ({"page_tokens": C, "endpoint": "localhost:5555"}, r"l3\.lmcache\.endpoint"),
                     ({"page_tokens": C, "worker_id": 1}, r"l3\.lmcache\.worker_id")):
        with pytest.raises(ConfigError, match=msg):
            validate_l3({"backend": "lmcache", "lmcache": sub})
    with pytest.raises(TypeError, match="port"):
        LMCacheStore(NS, PB, endpoint=shared.endpoint, page_tokens=C, port=1)


# every test here starts its objects on a machine booted a moment ago (both clocks at 0.0)
pytestmark = pytest.mark.usefixtures("young_clock")
