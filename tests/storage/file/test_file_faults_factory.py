"""FaultyBackend (seeded failures, delays, releasable hangs) and build_backend (config validation, lazy backends)."""
from __future__ import annotations

import concurrent.futures as cf
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from tierkv.connector.core.config import ConfigError, L3Config, load_config
from tierkv.storage_backends import FaultyBackend, FileStore, StorageBackend, build_backend

NS = bytes(range(16))
PAGE = 1024
KEYS = [f"{i:032x}" for i in range(64)]


def src(n=64):
    return [torch.full((PAGE,), i % 251, dtype=torch.uint8) for i in range(n)]


@pytest.fixture
def store(tmp_path):
    s = FileStore(NS, PAGE, root=str(tmp_path / "l3"))
    yield s
    s.close()


def test_failures_are_seeded_and_per_key(store):
    patterns = []
    for _ in range(2):
        f = FaultyBackend(store, fail_set=0.25, seed=7)
        patterns.append(f.batch_set(KEYS, src()))
    assert patterns[0] == patterns[1]
    n_fail = patterns[0].count(False)
    assert 6 <= n_fail <= 26  # 25 % of 64, loosely
    f3 = FaultyBackend(store, fail_set=0.25, seed=8)
    assert f3.batch_set(KEYS, src()) != patterns[0]
    # get failures leave the destination untouched and do not reach the store
    before = store.stats()["hits"]
    g = FaultyBackend(store, fail_get=1.0)
    dst = [torch.full((PAGE,), 255, dtype=torch.uint8) for _ in range(4)]
    assert g.batch_get(KEYS[:4], dst) == [False] * 4
    assert all(bool((d == 255).all()) for d in dst) and store.stats()["hits"] == before
    assert g.stats()["injected_get_failures"] == 4


def test_exists_failure_cuts_the_leading_run(store):
    store.batch_set(KEYS[:8], src(8))
    f = FaultyBackend(store, fail_exists_keys=[KEYS[3]])
    assert f.batch_exists(KEYS[:8]) == 3
    f.set_faults(fail_exists_keys=[], fail_exists=1.0)
    assert f.batch_exists(KEYS[:8]) == 0
    f.set_faults(fail_exists=0.0)
    assert f.batch_exists(KEYS[:8]) == 8


def test_hang_blocks_until_released(store):
    store.batch_set(KEYS[:2], src(2))
    f = FaultyBackend(store, hang_get=True)
    with cf.ThreadPoolExecutor(2) as ex:
        fut = ex.submit(f.batch_get, KEYS[:2], [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(2)])
        assert f.wait_hanging(1, timeout=10)
        with pytest.raises(cf.TimeoutError):  # an upper layer's timeout fires; the call is still blocked
            fut.result(timeout=0.01)
        assert f.hanging == 1 and not fut.done()
        f.release()
        assert fut.result(timeout=10) == [True, True]
    assert f.hanging == 0 and f.stats()["injected_hangs"] == 1
    # close() releases hung calls too
    f.set_faults(hang_set=True)
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(f.batch_set, KEYS[2:3], src(1))
        assert f.wait_hanging(1, timeout=10)
        f.close()
        assert fut.result(timeout=10) == [False]  # the inner store is closed by then


def test_delay(store):
    f = FaultyBackend(store, delay_exists_s=0.05)
    t0 = time.monotonic()
    assert f.batch_exists(KEYS[:1]) == 0
    assert time.monotonic() - t0 >= 0.05 and f.stats()["injected_delays"] == 1


def test_delay_per_page_grows_with_the_pages_read(store, monkeypatch):
    """``delay_get_page_s`` sleeps per key of a ``batch_get`` (on top of ``delay_get_s`` per call); other calls are
    not delayed by it."""
    import tierkv.storage_backends.faulty as faulty
    slept = []
    monkeypatch.setattr(faulty.time, "sleep", slept.append)
    f = FaultyBackend(store, delay_get_s=0.01, delay_get_page_s=0.002)
    assert f.batch_set(KEYS[:4], src(4)) == [True] * 4
    assert f.batch_exists(KEYS[:4]) == 4
    dst = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(4)]
    assert f.batch_get(KEYS[:4], dst) == [True] * 4 and f.batch_get(KEYS[:1], dst[:1]) == [True]
    assert slept == [pytest.approx(0.01 + 4 * 0.002), pytest.approx(0.01 + 0.002)]
    with pytest.raises(ValueError):
        f.set_faults(delay_get_page_s=-1.0)


def test_healthy_get_pages_then_the_get_faults(store):
    """``healthy_get_pages``: reads get no get fault (no delay, hang or failure) while they add up to at most N
    pages; the read that would go past N and every later one get them all: a store that serves, then stalls or
    fails. Other operations are not counted."""
    store.batch_set(KEYS[:4], src(4))
    f = FaultyBackend(store, fail_get=1.0, delay_get_s=0.01, healthy_get_pages=5)
    dst = [torch.zeros(PAGE, dtype=torch.uint8) for _ in range(2)]
    assert f.batch_exists(KEYS[:4]) == 4
    assert f.batch_get(KEYS[:2], dst) == [True, True] and f.batch_get(KEYS[2:4], dst) == [True, True]
    assert bool((dst[1] == 3).all())
    assert f.stats()["injected_delays"] == 0 and f.stats()["injected_get_failures"] == 0
    assert f.batch_get(KEYS[:2], dst) == [False, False]  # pages 5 and 6: past the healthy 5, delayed and failed
    assert f.batch_get(KEYS[:1], dst[:1]) == [False]     # and every read after it
    assert f.stats()["injected_delays"] == 2 and f.stats()["injected_get_failures"] == 3
    # a stall after one healthy read (the l3_hit_ttft "turns stalled" store): the second read hangs
    g = FaultyBackend(store, hang_get=True, healthy_get_pages=1)
    assert g.batch_get(KEYS[:1], dst[:1]) == [True]
    with cf.ThreadPoolExecutor(1) as ex:
        fut = ex.submit(g.batch_get, KEYS[:1], dst[:1])
        assert g.wait_hanging(1, timeout=10)
        g.release()
        assert fut.result(timeout=10) == [True]
    with pytest.raises(ValueError):
        g.set_faults(healthy_get_pages=-1)


@pytest.mark.parametrize("faults, local", [({}, True), ({"delay_get_s": 1.0, "hang_get": True, "fail_set": 0.5}, True),
                                            ({"delay_exists_s": 0.1}, False), ({"hang_exists": True}, False),
                                            ({"fail_exists": 0.1}, False), ({"fail_exists_keys": KEYS[:1]}, False)])
def test_the_scheduler_may_ask_a_wrapped_local_store_unless_its_existence_queries_are_faulted(store, faults, local):
    """``local_exists`` (the scheduler answers existence itself) follows the inner store, unless an existence fault
    would make the scheduler's loop wait or fail."""
    assert FaultyBackend(store, **faults).local_exists is local
    assert FaultyBackend(types.SimpleNamespace(page_bytes=PAGE, namespace=NS, local_exists=False)).local_exists is False


def test_timeout_s_is_the_inner_stores(store):
    """A caller capping ``timeout_s`` through the wrapper caps the inner store's; a store without one has none."""
    inner = types.SimpleNamespace(page_bytes=PAGE, namespace=NS, timeout_s=5.0)
    f = FaultyBackend(inner)
    f.timeout_s = min(f.timeout_s, 0.05)
    assert inner.timeout_s == 0.05
    assert not hasattr(FaultyBackend(store), "timeout_s")


def test_bad_settings_and_keys(store):
    with pytest.raises(ValueError):
        FaultyBackend(store, fail_get=1.5)
    f = FaultyBackend(store)
    with pytest.raises(ValueError):
        f.set_faults(fail_everything=1.0)
    with pytest.raises(ValueError):
        f.batch_exists(["not hex"])
    with pytest.raises(ValueError):
        f.batch_get(KEYS[:2], [torch.zeros(PAGE, dtype=torch.uint8)])


# ---------------------------------------------------------------------------------------------------- factory
def test_build_none_file_and_faults(tmp_path):
    assert build_backend({}, NS, PAGE) is None
    assert build_backend(L3Config(), NS, PAGE) is None
    s = build_backend({"backend": "file", "file": {"root": str(tmp_path / "a"), "capacity_bytes": "1MiB",
                                                   "fsync": True}}, NS, PAGE)
    assert isinstance(s, FileStore) and s.capacity_bytes == 1 << 20 and s.cfg.fsync
    f = build_backend(L3Config(backend="file", file={"root": str(tmp_path / "b")}, faults={"fail_set": 1.0}),
                      NS, PAGE)
    assert isinstance(f, FaultyBackend) and isinstance(f.inner, FileStore)
    assert f.batch_set(KEYS[:1], src(1)) == [False]


@pytest.mark.parametrize("cfg,match", [
    ({"backend": "fiel"}, r"'l3\.backend'.*'none', 'file', 'zmq', 'mooncake', 'lmcache' or 'redis'"),
    ({"backend": "file", "file": {}}, r"missing config key 'l3\.file\.root'"),
    ({"backend": "file", "file": {"root": "/tmp/x", "capacity": 5}}, r"unknown config key 'l3\.file\.capacity'"),
    ({"backend": "file", "file": {"root": "/tmp/x", "capacity_bytes": "lots"}}, r"l3\.file\.capacity_bytes"),
    ({"backend": "file", "file": {"root": "/tmp/x", "capacity_bytes": 0}}, r"l3\.file\.capacity_bytes"),
    ({"backend": "file", "file": {"root": "/tmp/x", "capacity_bytes": 100}}, r"l3\.file\.capacity_bytes"),
    ({"backend": "file", "file": {"root": "/tmp/x", "scan_verify": "all"}}, r"l3\.file\.scan_verify.*'size' or 'header'"),
    ({"backend": "file", "file": {"root": "/tmp/x"}, "faults": {"fail_get": -1}}, r"l3\.faults\.fail_get"),
    ({"backend": "file", "file": {"root": "/tmp/x"}, "faults": {"explode": True}}, r"l3\.faults\.explode"),
    ({"backend": "file", "file": {"root": "/tmp/x"}, "faults": {"healthy_get_pages": -2}},
     r"l3\.faults\.healthy_get_pages"),
    ({"backend": "none", "faults": {"fail_get": 0.5}}, r"l3\.faults"),
    ({"backend": "file", "bogus": {}}, r"l3\.bogus"),
])
def test_config_errors_name_the_key(cfg, match):
    with pytest.raises(ConfigError, match=match):
        build_backend(cfg, NS, PAGE)


class _FakeZmqStore(StorageBackend):
    def __init__(self, namespace, page_bytes, *, address="tcp://127.0.0.1:1", timeout_s=1.0):
        self.namespace, self.page_bytes, self.address = namespace, page_bytes, address

    def batch_exists(self, keys):
        return 0

    def batch_get(self, keys, destinations):
        return [False] * len(keys)

    def batch_set(self, keys, sources):
        return [False] * len(keys)

    def stats(self):
        return {}

    def close(self):
        pass


def test_lazy_backends_get_their_section_as_kwargs(monkeypatch):
    mod = types.ModuleType("tierkv.storage_backends.zmq.client")
    mod.ZmqStore = _FakeZmqStore
    monkeypatch.setitem(sys.modules, "tierkv.storage_backends.zmq.client", mod)
    s = build_backend({"backend": "zmq", "zmq": {"address": "tcp://127.0.0.1:5555"}}, NS, PAGE)
    assert isinstance(s, _FakeZmqStore) and s.address == "tcp://127.0.0.1:5555" and s.page_bytes == PAGE
    with pytest.raises(ConfigError, match=r"l3\.zmq"):
        build_backend({"backend": "zmq", "zmq": {"adress": "x"}}, NS, PAGE)
    import tierkv.storage_backends as sb

    assert sb.ZmqStore is _FakeZmqStore


def test_missing_lazy_backend_is_a_clear_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "tierkv.storage_backends.mooncake.store", None)  # import fails
    with pytest.raises(ConfigError, match=r"l3\.backend 'mooncake' is not available"):
        build_backend({"backend": "mooncake"}, NS, PAGE)


def test_shipped_l3_file_config_builds_a_store(tmp_path):
    cfg = load_config("l3_file.yaml", {"l3.file.root": str(tmp_path / "l3")})
    assert cfg.l3.backend == "file"
    s = build_backend(cfg.l3, NS, PAGE)
    assert isinstance(s, FileStore) and s.root == str(tmp_path / "l3")
    assert s.batch_set(KEYS[:1], src(1)) == [True] and s.batch_exists(KEYS[:1]) == 1


def test_faulty_backend_passes_tokens_and_namespace_description_through(store):
    """The fault wrapper hands ``tokens`` (only of the keys not chosen to fail) and ``describe_namespace`` to the
    store it wraps, so a token-keyed store (lmcache) keeps its fast path under fault injection."""
    import json

    from tierkv.storage_backends.base import PageTokens

    seen = []

    class Recording(FileStore):
        def batch_set(self, keys, sources, checksums=None, tokens=None):
            seen.append(("set", list(keys), tokens))
            return super().batch_set(keys, sources, checksums=checksums)

        def batch_get(self, keys, destinations, tokens=None):
            seen.append(("get", list(keys), tokens))
            return super().batch_get(keys, destinations)

        def batch_exists(self, keys, tokens=None):
            seen.append(("exists", list(keys), tokens))
            return super().batch_exists(keys)

    inner = Recording(NS, PAGE, root=store.root)
    toks = [PageTokens(list(range(4 * (i + 1))), bytes(16)) for i in range(4)]
    f = FaultyBackend(inner, fail_set_keys=[KEYS[1]], fail_get_keys=[KEYS[2]])
    assert f.batch_set(KEYS[:4], src(4), tokens=toks) == [True, False, True, True]
    assert f.batch_get(KEYS[:4], [torch.empty(PAGE, dtype=torch.uint8) for _ in range(4)], tokens=toks) == [
        True, False, False, True]
    assert f.batch_exists(KEYS[:1], tokens=toks[:1]) == 1
    assert seen == [("set", [KEYS[0], KEYS[2], KEYS[3]], [toks[0], toks[2], toks[3]]),
                    ("get", [KEYS[0], KEYS[1], KEYS[3]], [toks[0], toks[1], toks[3]]),
                    ("exists", [KEYS[0]], [toks[0]])]
    assert f.describe_namespace({"model_id": "m", "dtype": "bfloat16"}) is True
    info = json.loads((Path(store.root) / NS.hex() / "namespace.json").read_text())
    assert info == {"model_id": "m", "dtype": "bfloat16"}
    inner.close()


def test_every_store_declares_the_tokens_parameter(store):
    """Callers may pass ``tokens`` to any store (base.py): every registered store class and the fault wrapper declare
    it on the three batch methods, and a store keyed by the page key (file) ignores it."""
    import importlib
    import inspect

    from tierkv.storage_backends.base import PageTokens
    from tierkv.storage_backends.factory import BACKENDS

    classes = [getattr(importlib.import_module(b.module), b.cls) for b in BACKENDS.values()] + [FaultyBackend]
    for cls in classes:
        for name in ("batch_exists", "batch_get", "batch_set"):
            assert "tokens" in inspect.signature(getattr(cls, name)).parameters, (cls.__name__, name)
    toks = [PageTokens(list(range(4)), bytes(16))]
    assert store.batch_set(KEYS[:1], src(1), tokens=toks) == [True]
    assert store.batch_exists(KEYS[:1], tokens=toks) == 1
    assert store.batch_get(KEYS[:1], [torch.empty(PAGE, dtype=torch.uint8)], tokens=toks) == [True]
