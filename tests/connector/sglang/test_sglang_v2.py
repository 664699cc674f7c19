"""SGLang's hybrid (v2) storage interface on tierkv's backend (file store), driven by SGLang's own
``HybridCacheController`` storage methods (``_page_backup_with_stable_layout``, ``_storage_hit_query``,
``_page_transfer_with_stable_layout``) over SGLang's own host pools on the CPU: an MHA KV anchor, an MHA
sliding-window (SWA) side pool and a Mamba state side pool (both ``trailing_pages``), as a hybrid model's rank has.
Two engines share one store: engine B restores what engine A backed up, bit for bit; records of another pool,
layout, TP rank or namespace never match; missing or corrupt records are misses."""
from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from tests.helpers import sgl as _sgl  # noqa: F401  (shims + SGLang imports)
from tests.helpers.sgl import (attach, extra_config, fill_pages, fill_slots, hybrid_controller, keys, mamba_pool, mha_pool,
                  mla_pool, page_bytes_of, slot_bytes)
from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer, count_pool_hits
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import PrefetchOperation, StorageOperation
from sglang.srt.mem_cache.utils import get_storage_hash_str

PS = 16  # tokens per KV page
W = 2  # SWA window, in pages
TRAIL = PoolHitPolicy.TRAILING_PAGES


def file_l3(tmp_path) -> dict:
    return {"backend": "file", "file": {"root": str(tmp_path / "l3")}}


def engine(l3: dict, *, mamba_layout: str = "page_first", tp_rank: int = 0, tp_size: int = 1):
    """One rank of a hybrid model: its pools, the backend attached as SGLang's hybrid attach does (anchor, then the
    pool group through ``register_mem_host_pool_v2``, then ``on_host_pools_registered``) and SGLang's controller."""
    kv, swa, mamba = mha_pool(pages=8), mha_pool(layers=1, heads=1, head_dim=32, pages=8), mamba_pool(mamba_layout)
    b = attach(extra_config(l3, split_kv=True), kv, tp_rank=tp_rank, tp_size=tp_size)
    pools = {PoolName.KV: kv, PoolName.SWA: swa, PoolName.MAMBA: mamba}
    for name, pool in pools.items():
        b.register_mem_host_pool_v2(pool, name)
    b.on_host_pools_registered()
    return SimpleNamespace(b=b, kv=kv, swa=swa, mamba=mamba, ctl=hybrid_controller(b, pools, PS))


def side(hashes, mamba_slot: int, swa_start: int, swa_pages: int = W):
    """The trailing transfers of a node whose last page is ``hashes[-1]``: its Mamba state (one slot) and its SWA
    window (the last ``swa_pages`` pages, in the SWA pool from token slot ``swa_start``)."""
    return [PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([mamba_slot]), keys=hashes[-1:],
                         hit_policy=TRAIL),
            PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(swa_start, swa_start + swa_pages * PS),
                         keys=hashes[-swa_pages:], hit_policy=TRAIL)]


def backed_up_request(tmp_path):
    """Engine A holds a 6-page request as two radix nodes (pages 0-2 and 3-5), each with its Mamba state and SWA
    window, and backs both up through SGLang's controller. Returns (A, tokens, page hashes)."""
    a = engine(file_l3(tmp_path))
    idx = fill_pages(a.kv, 6, seed=1)
    fill_slots(a.mamba, [2, 5], seed=2)
    fill_slots(a.swa, range(0, 4 * PS, PS), seed=3)
    tokens = list(range(1000, 1000 + 6 * PS))
    h = get_storage_hash_str(tokens, None, page_size=PS)
    for node, (lo, hi), slot, swa in ((0, (0, 3), 2, 0), (1, (3, 6), 5, W * PS)):
        op = StorageOperation(idx[lo * PS:hi * PS], tokens[lo * PS:hi * PS], hash_value=h[lo:hi],
                              prefix_keys=h[:lo] or None, pool_transfers=side(h[lo:hi], slot, swa))
        a.ctl._page_backup_with_stable_layout(op)
        assert op.completed_tokens == 3 * PS, node
        assert op.pool_storage_result.extra_pool_hit_pages == {PoolName.MAMBA: 1, PoolName.SWA: W}
    return a, tokens, h


def prefetch(eng, tokens, mamba_slot: int = 1, swa_start: int = 0):
    """SGLang's prefetch of ``tokens`` on engine ``eng``: the hit query (``batch_exists_v2``), then the transfer
    (``batch_get_v1`` for KV, ``batch_get_v2`` for the trailing side pools). Returns (operation, sidecar pool hits)."""
    h = get_storage_hash_str(tokens, None, page_size=PS)
    op = PrefetchOperation(SimpleNamespace(rid="r"), tokens, pool_transfers=side(h, mamba_slot, swa_start))
    hit_hashes, hit_tokens = eng.ctl._storage_hit_query(op)
    op.hash_value, op.storage_hit_count = hit_hashes, hit_tokens
    op.host_indices = torch.arange(hit_tokens, dtype=torch.int64)
    eng.ctl._page_transfer_with_stable_layout(op)
    acks = [eng.ctl.prefetch_sync_queue.get_nowait() for _ in range(eng.ctl.prefetch_sync_queue.qsize())]
    return op, acks[-1].pool_hits


def test_hybrid_backup_and_prefetch_round_trip_bit_exact(tmp_path):
    a, tokens, h = backed_up_request(tmp_path)
    b = engine(file_l3(tmp_path))
    op, pool_hits = prefetch(b, tokens, mamba_slot=1, swa_start=0)
    # both node ends are restorable stop points; the longest wins
    assert op.pool_storage_result.restorable_prefix_pages == [3, 6]
    assert op.storage_hit_count == 6 * PS and op.hash_value == h
    assert op.query_pool_hit_pages == {PoolName.KV: 6, PoolName.MAMBA: 6, PoolName.SWA: 6}
    assert pool_hits == {PoolName.MAMBA: 1, PoolName.SWA: W}
    assert all(torch.equal(page_bytes_of(b.kv, i), page_bytes_of(a.kv, i)) for i in range(6))
    assert torch.equal(slot_bytes(b.mamba, 1), slot_bytes(a.mamba, 5))
    assert all(torch.equal(slot_bytes(b.swa, i * PS), slot_bytes(a.swa, (W + i) * PS)) for i in range(W))
    assert b.b.stats()["errors"] == 0 and set(b.b.stats()["pools"]) == {"swa", "mamba"}


def test_a_missing_trailing_state_cuts_the_hit_back_to_the_last_restorable_node(tmp_path):
    """Without node 2's Mamba state only the first node is restorable: the hit query says 3 pages, and the
    transfer re-aligns the trailing keys (SGLang's ``_sync_trailing_keys``) to node 1's Mamba state and window."""
    a, tokens, h = backed_up_request(tmp_path)
    m = a.b.pools["mamba"]
    k = a.b.tierkv_keys(h[5], PoolName.MAMBA)[0]
    os.remove(tmp_path / "l3" / m.digest.hex() / k[:2] / f"{k}.page")
    b = engine(file_l3(tmp_path))
    op, pool_hits = prefetch(b, tokens, mamba_slot=3, swa_start=2 * PS)
    assert op.pool_storage_result.restorable_prefix_pages == [3]
    assert op.storage_hit_count == 3 * PS and op.query_pool_hit_pages[PoolName.MAMBA] == 3
    assert pool_hits == {PoolName.MAMBA: 1, PoolName.SWA: W}
    assert torch.equal(slot_bytes(b.mamba, 3), slot_bytes(a.mamba, 2))
    assert all(torch.equal(slot_bytes(b.swa, (2 + i) * PS), slot_bytes(a.swa, i * PS)) for i in range(W))


def test_a_corrupt_side_page_is_a_miss_never_data(tmp_path):
    a, tokens, h = backed_up_request(tmp_path)
    s = a.b.pools["swa"]
    k = a.b.tierkv_keys(h[4], PoolName.SWA)[0]
    path = tmp_path / "l3" / s.digest.hex() / k[:2] / f"{k}.page"
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0x40
    path.write_bytes(bytes(raw))
    b = engine(file_l3(tmp_path))
    res = b.b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(2 * PS), keys=h[4:6])])
    assert res == {PoolName.SWA: [False, True]} and count_pool_hits(res) == {PoolName.SWA: 0}
    assert torch.equal(slot_bytes(b.swa, PS), slot_bytes(a.swa, 3 * PS))  # the good page still loads
    assert b.b.stats()["pools"]["swa"]["corrupt"] == 1 and b.b.stats()["pages_hit"] == 1


@pytest.mark.parametrize("other", ["pool", "mamba_layout", "tp_rank", "kv_only_reader"])
def test_pages_of_another_pool_layout_or_rank_never_match(tmp_path, other):
    a, tokens, h = backed_up_request(tmp_path)
    l3 = file_l3(tmp_path)
    if other == "pool":  # Mamba's key asked of the SWA pool, SWA's of the Mamba pool, either of KV
        r = engine(l3)
        res = r.b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(PS), keys=h[2:3]),
                                PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=h[1:2])])
        assert res == {PoolName.SWA: [True], PoolName.MAMBA: [False]}  # SWA holds page 2 (node 1's window)
        assert r.b.pools["mamba"].exists(h[1:2]) == 0 and r.b.pools["swa"].exists(h[5:6]) == 1
        assert r.b.pools["swa"].exists(h[0:1]) == 0 and r.b.pools["mamba"].exists(h[0:1]) == 0
        return
    r = engine(l3, mamba_layout="page_first_direct") if other == "mamba_layout" else \
        engine(l3, tp_rank=1, tp_size=2) if other == "tp_rank" else None
    if other == "kv_only_reader":  # a rank whose pool group has no Mamba pool: its transfers of it are misses
        r = engine(l3)
        r.b.pools.pop("mamba").close()
    res = r.b.batch_exists_v2(h, side(h, 0, 0))
    # (the fold stops at the first pool that leaves no stop point, as SGLang's file backend: no SWA verdict)
    assert res.kv_hit_pages == 0 and res.restorable_prefix_pages == []
    assert res.extra_pool_hit_pages == ({} if other == "tp_rank" else {PoolName.KV: 6})
    got = r.b.batch_get_v2(side(h, 0, 0))
    assert got[PoolName.MAMBA] == [False]


def test_trailing_window_fold_and_all_pages_policy(tmp_path):
    """``batch_exists_v2`` folds as SGLang's file backend: a trailing window of W pages is restorable where all W
    are stored (holes allowed), an ``all_pages`` pool cuts at its first missing page, and a pool of no transfer
    keys counts one trailing page."""
    a, tokens, h = backed_up_request(tmp_path)
    b = a.b
    swa = lambda w: PoolTransfer(name=PoolName.SWA, keys=h[:w], hit_policy=TRAIL)  # noqa: E731
    # SWA stored at pages 1, 2, 4, 5 (0-based): windows of 1 end at 2, 3, 5, 6; of 2 at 3, 6; of 3 nowhere
    assert b.batch_exists_v2(h, [swa(1)]).restorable_prefix_pages == [2, 3, 5, 6]
    assert b.batch_exists_v2(h, [swa(2)]).restorable_prefix_pages == [3, 6]
    r = b.batch_exists_v2(h, [swa(3)])
    assert (r.kv_hit_pages, r.restorable_prefix_pages, r.extra_pool_hit_pages) == (0, [], {PoolName.KV: 6})
    r = b.batch_exists_v2(h, [PoolTransfer(name=PoolName.SWA, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages) == (0, {PoolName.KV: 6})  # page 0 has no SWA record
    r = b.batch_exists_v2(h[1:3], [PoolTransfer(name=PoolName.SWA, hit_policy=PoolHitPolicy.ALL_PAGES)])
    assert (r.kv_hit_pages, r.extra_pool_hit_pages[PoolName.SWA]) == (2, 2)
    r = b.batch_exists_v2(h, [PoolTransfer(name=PoolName.MAMBA, hit_policy=TRAIL)])
    assert r.restorable_prefix_pages == [3, 6] and r.kv_hit_pages == 6
    assert b.batch_exists_v2(h[:2], []).kv_hit_pages == 2 and b.batch_exists_v2([], None).kv_hit_pages == 0


def test_length_mismatch_unknown_pool_and_kv_transfers(tmp_path):
    """Host indices that do not cover the keys, or a pool never registered: all False, counted, with a (rate-limited)
    log line (SGLang's file backend does the same); a ``kv`` transfer reads and writes the anchor's records (the v1 path's)."""
    a, tokens, h = backed_up_request(tmp_path)
    b = a.b
    res = b.batch_get_v2([PoolTransfer(name=PoolName.SWA, host_indices=torch.arange(PS), keys=h[4:6]),
                          PoolTransfer(name=PoolName.INDEXER, host_indices=torch.arange(PS), keys=h[:1])])
    assert res == {PoolName.SWA: [False, False], PoolName.INDEXER: [False]}
    assert b.stats()["v2_rejected"] == 2
    r = engine(file_l3(tmp_path))
    assert r.b.batch_get_v2([PoolTransfer(name=PoolName.KV, host_indices=torch.arange(2 * PS),
                                          keys=h[:2])]) == {PoolName.KV: [True, True]}
    assert all(torch.equal(page_bytes_of(r.kv, i), page_bytes_of(a.kv, i)) for i in range(2))
    ks = keys(1, "kv-v2")
    assert r.b.batch_set_v2([PoolTransfer(name="kv", host_indices=torch.arange(PS), keys=ks)]) == {"kv": [True]}
    assert r.b.batch_exists(ks) == 1


def test_mla_side_pools_shared_across_tp_except_mamba(tmp_path):
    """Under an MLA model, a latent side pool (here a second MLA pool, as DSA's indexer is page-packed) is one copy
    for every TP rank, but Mamba state (TP-sharded) is per rank: rank 1 reads rank 0's indexer pages, never its
    Mamba state."""
    l3 = file_l3(tmp_path)
    ranks = []
    for rank in (0, 1):
        kv, idx_pool, mamba = mla_pool(pages=4), mla_pool(kv_lora_rank=32, rope_dim=0, pages=4), mamba_pool()
        b = attach(extra_config(l3), kv, tp_rank=rank, tp_size=2, mla=True)
        b.register_mem_host_pool_v2(idx_pool, PoolName.INDEXER)
        b.register_mem_host_pool_v2(mamba, PoolName.MAMBA)
        ranks.append(SimpleNamespace(b=b, idx=idx_pool, mamba=mamba))
    w, r = ranks
    fill_pages(w.idx, 2, seed=8)
    fill_slots(w.mamba, [0], seed=9)
    ks = keys(2, "mla-side")
    put = [PoolTransfer(name=PoolName.INDEXER, host_indices=torch.arange(2 * PS), keys=ks),
           PoolTransfer(name=PoolName.MAMBA, host_indices=torch.tensor([0]), keys=ks[1:])]
    assert w.b.batch_set_v2(put) == {PoolName.INDEXER: [True, True], PoolName.MAMBA: [True]}
    assert r.b.batch_get_v2(put) == {PoolName.INDEXER: [True, True], PoolName.MAMBA: [False]}
    assert all(torch.equal(page_bytes_of(r.idx, i), page_bytes_of(w.idx, i)) for i in range(2))
    assert w.b.pools["indexer"].digest == r.b.pools["indexer"].digest
    assert w.b.pools["mamba"].digest != r.b.pools["mamba"].digest


def test_side_pool_registered_again_is_replaced_and_close_ends_all(tmp_path):
    e = engine(file_l3(tmp_path))
    old = e.b.pools["mamba"]
    e.b.register_mem_host_pool_v2(mamba_pool(slots=4), PoolName.MAMBA)
    assert e.b.pools["mamba"] is not old and old.store is None
    e.b.close()
    assert all(io.store is None for io in e.b.pools.values()) and e.b.kv.store is None
    assert e.b.batch_get_v2(side(keys(2, "closed"), 0, 0)) == {PoolName.MAMBA: [False], PoolName.SWA: [False] * W}


def test_side_pool_mooncake_clients_add_no_segment():
    from tierkv.connector.sglang.hicache import side_pool_l3

    l3 = {"backend": "mooncake", "mooncake": {"master_address": "127.0.0.1:1", "global_segment_size": 1 << 30}}
    assert side_pool_l3(l3)["mooncake"] == {"master_address": "127.0.0.1:1", "global_segment_size": 0}
    assert l3["mooncake"]["global_segment_size"] == 1 << 30  # the anchor's section is left as it was
    file_l3 = {"backend": "file", "file": {"root": "/x"}}
    assert side_pool_l3(file_l3) is file_l3
