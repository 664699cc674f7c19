"""Mooncake backend against a real ``mooncake_master``: a writer killed mid-put, a master restart while data holders
stay up, a hung (SIGSTOPped) or dead master, and bad configuration."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

from tests.helpers.fixtures_mooncake import make_backend
from tests.helpers.mooncake_master import free_ports

from tierkv.connector.core.config import ConfigError, load_config
from tierkv.storage_backends.factory import build_backend
from tierkv.storage_backends.mooncake.store import MooncakeStore
from tierkv.storage_backends.page_format import HEADER_BYTES, encode_record

NS = bytes(range(16))
PB = 16 * 1024


def keys_of(n: int, salt: int = 0) -> list[str]:
    rng = np.random.default_rng(5000 + salt)
    return [rng.bytes(16).hex() for _ in range(n)]


def pages(n: int, seed: int, page_bytes: int = PB) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.frombuffer(rng.bytes(page_bytes), dtype=np.uint8).copy()) for _ in range(n)]


def empties(n: int, page_bytes: int = PB) -> list[torch.Tensor]:
    return [torch.zeros(page_bytes, dtype=torch.uint8) for _ in range(n)]


@pytest.fixture
def mc(tmp_path):
    with make_backend(tmp_path, PB, NS, timeout_s=2.0) as h:
        yield h


# --------------------------------------------------------------------------------------------------- master restart


def test_master_restart_old_keys_miss_new_keys_exact_never_foreign(mc):
    """A stores K1-K8; only the master restarts; B stores K9-K16; C joins; A, B, C read all 16 keys."""
    a = mc.backend                       # holds the segment: the data holder that stays up
    b = mc.new_client()                  # an instance that exists across the restart
    ks = keys_of(16, salt=16)
    src = pages(16, seed=16)
    assert a.batch_set(ks[:8], src[:8]) == [True] * 8
    assert b.batch_exists(ks[:8]) == 8
    old_pid = mc.master.pid
    mc.restart()                          # same ports; A and B are not restarted, they rejoin on their own
    assert mc.master.pid != old_pid
    assert b.batch_set(ks[8:], src[8:]) == [True] * 8
    c = mc.new_client()                  # a new instance joins the restarted master
    for who in (a, b, c):
        dst = empties(16)
        res = who.batch_get(ks, dst)
        assert res[8:] == [True] * 8
        for i in range(16):
            if res[i]:
                assert torch.equal(dst[i], src[i]), f"key {i} returned other bytes"
            else:
                assert bool((dst[i] == 0).all()), f"a miss wrote into destination {i}"
        assert who.stats()["corrupt"] == 0
    # the old master's objects are gone: a miss, not stale data (no recovery is implemented)
    assert a.batch_exists(ks[:8]) == 0


def test_record_of_another_key_is_a_miss(mc):
    """A region holding another key's record (what a restarted master handing out old space would produce) is a
    miss, counted as corrupt and removed; the key can then be stored again."""
    a = mc.backend
    k1, k2 = keys_of(2, salt=2)
    p1, p2 = pages(2, seed=2)
    assert a.batch_set([k1], [p1]) == [True]
    raw = a.client
    assert raw.put(a.object_name(k2), encode_record(k1, NS, p1.numpy())) == 0   # k1's record under k2's name
    dst = empties(2)
    assert a.batch_get([k1, k2], dst) == [True, False]
    assert torch.equal(dst[0], p1) and bool((dst[1] == 0).all())
    st = a.stats()
    assert st["corrupt"] == 1 and st["removed_corrupt"] == 1
    assert a.batch_exists([k2]) == 0
    assert a.batch_set([k2], [p2]) == [True]
    assert a.batch_get([k2], dst[1:]) == [True] and torch.equal(dst[1], p2)


# ------------------------------------------------------------------------------------------------ writer killed mid-put

_WRITER = textwrap.dedent("""
    import os, sys, time
    from tierkv.storage_backends.mooncake.store import MooncakeStore
    master, meta, seg, ns_hex, pb, mode = sys.argv[1:7]
    keys = sys.argv[7:]
    s = MooncakeStore(bytes.fromhex(ns_hex), int(pb), master_address=master, metadata_server=meta,
                      global_segment_size=int(seg), timeout_s=5.0)
    if mode == "session":
        # first phase of Mooncake's two-phase put: space reserved, key "processing", never completed
        rc = s.client.batch_put_session_start([s.object_name(k) for k in keys], [64 + int(pb)] * len(keys))
        print("started", rc, flush=True)
        time.sleep(600)
    else:
        import torch
        src = [torch.full((int(pb),), 0x5A, dtype=torch.uint8) for _ in keys]
        print("started", flush=True)
        while True:
            s.batch_set(keys, src)
""")


def _run_writer_and_kill(h, keys, mode: str, seg: int) -> None:
    p = subprocess.Popen([sys.executable, "-c", _WRITER, h.master.master_address, h.master.metadata_server,
                          str(seg), NS.hex(), str(PB), mode, *keys],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        line = p.stdout.readline()
        assert line.startswith("started"), line
        if mode == "session":
            assert "-" not in line.split("[", 1)[1], f"session start failed: {line}"
        else:
            # let it get into the middle of its loop of sets: wait until at least one of its pages is visible, so
            # the kill falls into a loop of puts that really runs (it writes the same keys again and again)
            # (measured: the writer's first batch_set may not return for tens of seconds while its objects come and
            # go at the master, so the bound is generous)
            deadline = time.monotonic() + 90
            seen = False
            while not seen and time.monotonic() < deadline:
                seen = h.backend.batch_exists(keys[:1]) == 1
                time.sleep(0.01)
            assert seen, "the loop writer stored no page within 90 s"
        os.kill(p.pid, signal.SIGKILL)
    finally:
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdout.close()


@pytest.mark.parametrize("mode,seg", [("session", 0), ("session", 16 << 20), ("loop", 0)])
def test_writer_killed_mid_put(tmp_path, mode, seg):
    """Writers SIGKILLed in the middle of puts (three times, 8 keys each). B then sees each key absent (or, for
    keys the writer completed, the writer's valid page), its reads are misses within the timeout, its put of new
    bytes succeeds within two client TTLs and reads back exactly."""
    ttl = 2
    with make_backend(tmp_path, PB, NS, timeout_s=2.0, master_args=("-client_ttl", str(ttl))) as h:
        b = h.new_client()
        for rep in range(3):
            ks = keys_of(8, salt=100 * rep + seg % 7 + len(mode))
            _run_writer_and_kill(h, ks, mode, seg)
            t0 = time.monotonic()
            n = b.batch_exists(ks)
            dst = empties(8)
            res = b.batch_get(ks, dst)
            assert time.monotonic() - t0 < 2 * 2.0 + 1.0
            for r, d in zip(res, dst):
                if r:  # only possible for a page the loop writer completed: its own complete bytes
                    assert mode == "loop" and bool((d == 0x5A).all())
            if mode == "session":
                assert n == 0 and res == [False] * 8
            mine = pages(8, seed=rep)
            deadline = time.monotonic() + 2 * ttl + 10   # two lease periods, plus slack for a busy machine
            ok = b.batch_set(ks, mine)
            while not all(ok) and time.monotonic() < deadline:
                time.sleep(0.1)  # poll: a dead writer's segment is unmounted after the client TTL
                todo = [i for i, x in enumerate(ok) if not x]
                for i, x in zip(todo, b.batch_set([ks[i] for i in todo], [mine[i] for i in todo])):
                    ok[i] = x
            assert all(ok), f"rep {rep}: puts still failing: {ok}"
            dst = empties(8)
            assert b.batch_get(ks, dst) == [True] * 8
            assert all(torch.equal(x, y) for x, y in zip(dst, mine))
        assert b.stats()["corrupt"] == 0


# ----------------------------------------------------------------------------------------- hung / dead master


def test_sigstopped_master_calls_time_out_within_bound(mc):
    b = mc.backend
    ks = keys_of(4, salt=7)
    src = pages(4, seed=7)
    assert b.batch_set(ks[:2], src[:2]) == [True, True]
    bound = b.timeout_s + 1.5  # the configured bound plus scheduling slack on a shared machine
    mc.stop()
    try:
        for what, call, expect in [
            ("exists", lambda: b.batch_exists(ks), 0),
            ("get", lambda: b.batch_get(ks[:2], empties(2)), [False, False]),
            ("set", lambda: b.batch_set(ks[2:], src[2:]), [False, False]),
        ]:
            t0 = time.monotonic()
            assert call() == expect, what
            assert time.monotonic() - t0 < bound, f"{what} took {time.monotonic() - t0:.2f}s"
        # more calls while the earlier ones are still stuck: they fail fast once max_inflight are outstanding
        for _ in range(b.cfg.max_inflight + 2):
            t0 = time.monotonic()
            assert b.batch_exists(ks) == 0
            assert time.monotonic() - t0 < bound
        st = b.stats()
        assert st["timeouts"] >= 3 and st["busy"] >= 1
    finally:
        mc.cont()
    mc.wait_serving()
    assert b.batch_set(ks[2:], src[2:]) == [True, True]
    dst = empties(4)
    assert b.batch_get(ks, dst) == [True] * 4
    assert all(torch.equal(x, y) for x, y in zip(dst, src))


def test_dead_master_degrades_to_misses_then_recovers(mc):
    b = mc.backend
    ks = keys_of(2, salt=9)
    src = pages(2, seed=9)
    mc.master.kill()
    t0 = time.monotonic()
    assert b.batch_exists(ks) == 0
    assert b.batch_set(ks, src) == [False, False]
    assert b.batch_get(ks, empties(2)) == [False, False]
    assert time.monotonic() - t0 < 3 * (b.timeout_s + 1.5)
    mc.master.start()
    mc.wait_serving()
    assert b.batch_set(ks, src) == [True, True]
    dst = empties(2)
    assert b.batch_get(ks, dst) == [True, True] and torch.equal(dst[1], src[1])


# ----------------------------------------------------------------------------------------------- config


def test_bad_config_names_the_key(mc):
    cfg = mc.master.client_config()
    for bad, key in [({"nonsense": 1}, "l3.mooncake.nonsense"),
                     ({"protocol": "carrier-pigeon"}, "l3.mooncake.protocol"),
                     ({"master_address": "localhost"}, "l3.mooncake.master_address"),
                     ({"metadata_server": "ftp://x"}, "l3.mooncake.metadata_server"),
                     ({"global_segment_size": "lots"}, "l3.mooncake.global_segment_size"),
                     ({"global_segment_size": "8MiB"}, "l3.mooncake.global_segment_size"),
                     ({"timeout_s": 0}, "l3.mooncake.timeout_s"),
                     ({"key_prefix": "a/b"}, "l3.mooncake.key_prefix"),
                     ({"staging_bytes": 100}, "l3.mooncake.staging_bytes")]:
        with pytest.raises(ValueError, match=key.replace(".", r"\.")):
            MooncakeStore(NS, PB, **dict(cfg, **bad))
    with pytest.raises(TypeError):
        MooncakeStore(b"short", PB, **cfg)
    with pytest.raises(TypeError):
        MooncakeStore(NS, 0, **cfg)
    # the factory reports the same keys
    with pytest.raises(ConfigError, match=r"l3\.mooncake\.nonsense"):
        build_backend({"backend": "mooncake", "mooncake": dict(cfg, nonsense=1)}, NS, PB)


def test_native_client_is_never_left_to_the_garbage_collector(mc):
    """A store dropped without close() keeps its native client alive (its destructor would block the collecting
    thread while it retries a dead master); close() releases it."""
    import gc
    from tierkv.storage_backends.mooncake import store as mooncake

    before = len(mooncake._UNCLOSED)
    s = mc.new_client()
    native = s.client
    assert any(x is native for x in mooncake._UNCLOSED)
    s.close()
    assert not any(x is native for x in mooncake._UNCLOSED) and len(mooncake._UNCLOSED) == before
    dropped = MooncakeStore(NS, PB, **dict(mc.master.client_config(), global_segment_size=0))
    native = dropped.client
    del dropped
    gc.collect()
    assert any(x is native for x in mooncake._UNCLOSED)


def test_unreachable_master_is_a_clear_error_within_bound():
    rpc, http = free_ports(2)
    t0 = time.monotonic()
    from tierkv.storage_backends.mooncake import store as mooncake

    before = len(mooncake._UNCLOSED)
    with pytest.raises(ConfigError, match="master_address"):
        MooncakeStore(NS, PB, master_address=f"127.0.0.1:{rpc}", metadata_server=f"http://127.0.0.1:{http}/metadata",
                      global_segment_size=0, setup_timeout_s=3.0)
    assert time.monotonic() - t0 < 3.0 + 2.0
    assert len(mooncake._UNCLOSED) == before  # refused before a native client was made


def test_shipped_config_builds_a_working_store(mc):
    cfg = load_config("l3_mooncake.yaml", {"l3.mooncake.master_address": mc.master.master_address,
                                           "l3.mooncake.metadata_server": mc.master.metadata_server,
                                           "l3.mooncake.global_segment_size": "0",
                                           "l3.mooncake.staging_bytes": "1MiB"})
    assert cfg.l3.backend == "mooncake"
    store = build_backend(cfg.l3, NS, PB)
    try:
        assert isinstance(store, MooncakeStore) and store.cfg.staging_bytes == 1 << 20
        ks = keys_of(200, salt=3)                      # more than one staging buffer (1 MiB / 16 KiB = 63 pages)
        src = pages(200, seed=3)
        assert store.batch_set(ks, src) == [True] * 200
        dst = empties(200)
        assert mc.backend.batch_get(ks, dst) == [True] * 200   # written by one client, read by another
        assert all(torch.equal(x, y) for x, y in zip(dst, src))
        assert store.batch_exists(ks) == 200
        store.clear()
        assert mc.backend.batch_exists(ks) == 0
    finally:
        store.close()


def test_record_layout_is_header_plus_payload(mc):
    """The stored object is exactly the page_format record, so any Mooncake reader can check it."""
    b = mc.backend
    k = keys_of(1, salt=11)[0]
    p = pages(1, seed=11)[0]
    assert b.batch_set([k], [p]) == [True]
    raw = b.client.get(b.object_name(k))
    assert len(raw) == HEADER_BYTES + PB
    assert raw == encode_record(k, NS, p.numpy())
    assert b.object_name(k) == f"tierkv/{NS.hex()}/{k}"
