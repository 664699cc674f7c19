"""The L3 contract cases through SGLang's interface (docs/sglang.md): tierkv's file store, ZMQ cache
server (a real server subprocess) and Mooncake store (a real ``mooncake_master``), each attached to SGLang's own
MHA host pool through SGLang's ``StorageBackendFactory`` (``dynamic``) and driven with the calls SGLang's
controller makes (``batch_exists``, ``batch_get_v1``/``batch_set_v1`` over host indices, ``batch_get``/``batch_set``
over flat pages, and the hybrid controller's v2 calls over side pools). Servers come from the storage tests' fixtures (tests/helpers/fixtures_*.py)."""
from __future__ import annotations

import contextlib
import importlib
import time

import pytest
import torch

from tests.helpers import sgl as _sgl  # noqa: F401  (shims + SGLang imports)
from tests.helpers.sgl import (attach, build_namespace_for, extra_config, fill_pages, fill_slots, keys, mamba_pool, mha_pool,
                  page_bytes_of, slot_bytes)
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

TIMEOUT_S = 1.0
KINDS = ["file", "zmq", "mooncake", "lmcache", "redis", "redis_cluster"]


def l3_for(h) -> dict:
    if h.name == "file":
        return {"backend": "file", "file": {"root": h.root}}
    if h.name == "zmq":
        return {"backend": "zmq", "zmq": {"endpoint": h.endpoint, "timeout_s": TIMEOUT_S,
                                          "reconnect_backoff_s": 0.05, "max_backoff_s": 0.2}}
    if h.name in ("redis", "redis_cluster"):
        return {"backend": "redis", "redis": h.options(timeout_s=TIMEOUT_S)}
    if h.name == "lmcache":  # page_tokens = the server's chunk size = the host pool's page size (16)
        return {"backend": "lmcache", "lmcache": h.options(timeout_s=TIMEOUT_S)}
    cfg = h.config(global_segment_size=0)  # a pure client: the pages live in the handle's own client's segment
    cfg["timeout_s"] = TIMEOUT_S
    return {"backend": "mooncake", "mooncake": cfg}


def xc(h) -> dict:
    """Extra config with two records per page (K, V) on every backend: the zero-copy path in place."""
    return extra_config(l3_for(h), split_kv=True)


@contextlib.contextmanager
def rig(kind: str, tmp_path, **opts):
    """(handle, adapter, pool): a store of ``kind`` whose fixture client shares the adapter's namespace and part
    size (so ``h.corrupt`` can reach the adapter's records), and the adapter attached to a fresh host pool."""
    pool = mha_pool()
    ns = build_namespace_for(pool, records=2)
    part_bytes = pool.get_data_page(0).numel() * pool.get_data_page(0).element_size() // 2
    mod = importlib.import_module(f"tests.helpers.fixtures_{kind}")
    with mod.make_backend(tmp_path, part_bytes, ns.digest(), timeout_s=TIMEOUT_S, **opts) as h:
        b = attach(xc(h), pool)
        assert b.part_bytes == part_bytes and b.namespace == ns
        try:
            yield h, b, pool
        finally:
            b.close()


def same_pages(pool, want, n) -> bool:
    return all(torch.equal(page_bytes_of(pool, i), want[i]) for i in range(n))


@pytest.mark.parametrize("kind", KINDS)
def test_round_trip_leading_run_and_corruption(kind, tmp_path):
    with rig(kind, tmp_path) as (h, b, pool):
        idx = fill_pages(pool, 6, seed=11)
        want = [page_bytes_of(pool, i) for i in range(6)]
        ps = pool.page_size
        ks = keys(6, kind)
        # round trip, zero-copy path into another pool and copy path
        assert b.batch_set_v1(ks[:4], idx[: 4 * ps]) == [True] * 4
        pool2 = mha_pool()
        b2 = attach(xc(h), pool2)
        assert b2.batch_get_v1(ks[:4], idx[: 4 * ps]) == [True] * 4 and same_pages(pool2, want, 4)
        flat = b2.batch_get(ks[:4], [pool2.get_dummy_flat_data_page() for _ in range(4)])
        assert all(torch.equal(f.view(torch.uint8), want[i]) for i, f in enumerate(flat))
        # leading run: page 5 stored, page 4 not
        assert b.batch_set(ks[5:], [pool.get_data_page(5 * ps)]) is True
        assert b.batch_exists(ks) == 4 and b.batch_exists(ks[5:]) == 1
        # corruption of one part (K or V record) = a miss, never data; the neighbours still hit
        # (an LMCache chunk slot has a fixed size: no truncation there, a second flip instead)
        hows = ("flip", "flip" if kind == "lmcache" else "truncate", "foreign_namespace")
        for i, how in zip((1, 2, 3), hows):
            assert h.corrupt(b.tierkv_keys(ks[i])[i % 2], how, namespace=b._ns_digest), how
        pool3 = mha_pool()
        b3 = attach(xc(h), pool3)
        assert b3.batch_get_v1(ks[:4], idx[: 4 * ps]) == [True, False, False, False]
        assert same_pages(pool3, want, 1)
        assert b3.batch_get(ks[1:4], [pool3.get_dummy_flat_data_page() for _ in range(3)]) == [None] * 3
        assert b3.stats()["pages_hit"] == 1 and b3.stats()["pages_get"] == 7
        b2.close(), b3.close()


@pytest.mark.parametrize("kind", KINDS)
def test_restart_and_hang(kind, tmp_path):
    """Restart: the file store keeps its pages; a restarted ZMQ server / Mooncake master loses them (misses, never
    wrong bytes) and serves new ones. Hang (SIGSTOP of the server / master): every call answers within the
    client's bound with misses / False; service returns after SIGCONT."""
    with rig(kind, tmp_path, **({"private": True} if kind == "lmcache" else {})) as (h, b, pool):
        idx = fill_pages(pool, 3, seed=21)
        want = [page_bytes_of(pool, i) for i in range(3)]
        ps = pool.page_size
        ks = keys(3, kind + "r")
        assert b.batch_set_v1(ks, idx) == [True] * 3
        h.restart()
        pool2 = mha_pool()
        b2 = attach(xc(h), pool2)
        res = b2.batch_get_v1(ks, idx)
        assert res == ([True] * 3 if h.persistent else [False] * 3)  # kept, or a new empty server / master
        assert all(torch.equal(page_bytes_of(pool2, i), want[i]) for i, r in enumerate(res) if r)
        k2 = keys(1, kind + "after")
        deadline = time.monotonic() + 30.0
        while b.batch_set_v1(k2, idx[:ps]) != [True]:  # the adapter's client reconnects by itself
            assert time.monotonic() < deadline, f"{kind}: no service 30 s after the restart"
            time.sleep(0.05)
        assert b2.batch_get_v1(k2, idx[:ps]) == [True] and torch.equal(page_bytes_of(pool2, 0), want[0])
        b2.close()
        # the hang half needs a server process to SIGSTOP: every store but the file store has one (explicit, so a
        # fixture that loses supports_stop fails here instead of silently skipping the hang half)
        assert h.supports_stop == (kind != "file"), (kind, h.supports_stop)
        if kind == "file":
            return
        h.stop()
        try:
            for call, miss in ((lambda: b.batch_exists(k2), 0), (lambda: b.batch_get_v1(k2, idx[:ps]), [False]),
                               (lambda: b.batch_set_v1(keys(1, "hang"), idx[:ps]), [False])):
                t0 = time.monotonic()
                assert call() == miss
                assert time.monotonic() - t0 <= 3 * TIMEOUT_S + 2.0  # per-call bound + margin (shared machine)
        finally:
            h.cont()
        deadline = time.monotonic() + 30.0
        while b.batch_get_v1(k2, idx[:ps]) != [True]:
            assert time.monotonic() < deadline, f"{kind}: no service 30 s after SIGCONT"
            time.sleep(0.05)


@pytest.mark.parametrize("kind", KINDS)
def test_v2_side_pools_round_trip_on_every_store(kind, tmp_path):
    """SGLang's hybrid (v2) calls on every store: an SWA and a Mamba side pool (each its own store client, namespace
    and record size) next to the KV anchor. What one engine stores (``batch_set_v1`` + ``batch_set_v2``) another
    finds (``batch_exists_v2``: the trailing windows) and restores bit-exact (``batch_get_v2``); a page of one pool
    is never found in another."""
    trail = PoolHitPolicy.TRAILING_PAGES

    def side_pools(b):
        swa, mamba = mha_pool(layers=1, heads=1, head_dim=32, pages=4), mamba_pool()
        b.register_mem_host_pool_v2(swa, PoolName.SWA)
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        b.on_host_pools_registered()
        return swa, mamba

    def transfers(ks, swa_at: int, slot: int):
        return [PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(swa_at, swa_at + 32), keys=ks[1:3],
                             hit_policy=trail),
                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([slot]), keys=ks[2:3], hit_policy=trail)]

    with rig(kind, tmp_path) as (h, b, pool):
        swa, mamba = side_pools(b)
        idx = fill_pages(pool, 3, seed=31)
        fill_pages(swa, 2, seed=32)
        fill_slots(mamba, [4], seed=33)
        ks = keys(3, kind + "v2")
        assert b.batch_set_v1(ks, idx) == [True] * 3
        assert b.batch_set_v2(transfers(ks, 0, 4)) == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
        pool2 = mha_pool()
        b2 = attach(xc(h), pool2)
        swa2, mamba2 = side_pools(b2)
        r = b2.batch_exists_v2(ks, transfers(ks, 32, 1))
        assert (r.kv_hit_pages, r.restorable_prefix_pages) == (3, [3])
        assert r.extra_pool_hit_pages == {PoolName.KV: 3, PoolName.SWA: 3, PoolName.MAMBA: 3}
        assert b2.batch_get_v1(ks, idx) == [True] * 3 and same_pages(pool2, [page_bytes_of(pool, i) for i in range(3)], 3)
        assert b2.batch_get_v2(transfers(ks, 32, 1)) == {PoolName.SWA: [True, True], PoolName.MAMBA: [True]}
        assert torch.equal(slot_bytes(mamba2, 1), slot_bytes(mamba, 4))
        assert all(torch.equal(slot_bytes(swa2, 32 + i * 16), slot_bytes(swa, i * 16)) for i in range(2))
        # another pool's page under the same SGLang key: not there
        assert b2.batch_get_v2([PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=ks[1:2]),
                                PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(16), keys=ks[0:1])]) == \
            {PoolName.MAMBA: [False], PoolName.SWA: [False]}
        assert b2.stats()["errors"] == 0
        b2.close()
