"""The tierkv SGLang HiCache backend (connector/sglang/hicache.py) on the file store, driven through SGLang's own
factory and host pool (docs/sglang.md): layouts, copy vs zero-copy path, namespace isolation, bad input, stats / clear /
close."""
from __future__ import annotations

import pytest
import torch

from tests.helpers import sgl as _sgl  # noqa: F401  (shims + SGLang imports)
from tests.helpers.sgl import attach, extra_config, fill_pages, keys, mha_pool, mla_pool, page_bytes_of, storage_config
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

from tierkv.connector.core import page_hash
from tierkv.connector.sglang.hicache import TierKVHiCacheStorage, build_namespace, map_key
from tierkv.storage_backends.common import ConfigError


def file_l3(tmp_path) -> dict:
    return {"backend": "file", "file": {"root": str(tmp_path / "l3")}}


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("layout", ["page_first", "page_first_direct", "page_head", "layer_first"])
def test_both_paths_round_trip_and_share_records(tmp_path, layout, split):
    """A page written through the zero-copy path reads back bit-exact through both paths, and one written through
    the copy path reads back through the zero-copy path (same records), in every MHA host layout, as two records
    (K, V: in place in the host pool except layer_first) or one (staged)."""
    pool = mha_pool(layout)
    b = attach(extra_config(file_l3(tmp_path), split_kv=split), pool)
    assert isinstance(b, TierKVHiCacheStorage) and b.parts_per_page == (2 if split else 1)
    assert b.zero_copy is (split and layout != "layer_first")
    idx = fill_pages(pool, 4, seed=1)
    want = [page_bytes_of(pool, i) for i in range(4)]
    ks = keys(4, layout)
    assert b.batch_set_v1(ks[:2], idx[: 2 * pool.page_size]) == [True, True]
    assert b.batch_set(ks[2:], [pool.get_data_page(i * pool.page_size) for i in (2, 3)]) is True
    assert b.batch_exists(ks) == 4

    pool2 = mha_pool(layout)
    b2 = attach(extra_config(file_l3(tmp_path), split_kv=split), pool2)
    assert b2.batch_get_v1(ks, idx) == [True] * 4
    assert all(torch.equal(page_bytes_of(pool2, i), want[i]) for i in range(4))
    got = b2.batch_get(ks, [pool2.get_dummy_flat_data_page() for _ in ks])
    assert all(g is not None and torch.equal(g.view(torch.uint8), w) for g, w in zip(got, want))
    b.close(), b2.close()


@pytest.mark.parametrize("split", [True, False])
@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_pages_not_in_one_region_go_in_place_as_runs_and_share_records_with_the_staged_path(tmp_path, monkeypatch,
                                                                                           layout, split):
    """A record that is not one region of the host pool (``layer_first``; a single-record ``page_first`` page) is
    handed to a store that takes runs as its runs in the pool, in place, when they are long enough (32 KiB here):
    what it writes reads back bit-exact through the staged path (runs too short, forced), and what the staged path
    writes reads back in place; shorter runs are staged."""
    from tierkv.connector.sglang import pool_io as sio

    l3 = file_l3(tmp_path)
    pool = mha_pool(layout, heads=8, head_dim=128)  # 16 tokens x 8 heads x 128 x 2 bytes: 32 KiB per layer and K/V
    b = attach(extra_config(l3, split_kv=split), pool)
    in_place = not (split and layout == "page_first")  # (split page_first records are one region: zero-copy)
    assert b.zero_copy is not in_place and b.vectored_get is in_place and b.vectored_set is in_place
    idx = fill_pages(pool, 4, seed=11)
    want = [page_bytes_of(pool, i) for i in range(4)]
    ks = keys(4, f"runs-{layout}-{split}")
    assert b.batch_set_v1(ks[:2], idx[: 2 * pool.page_size]) == [True, True]
    monkeypatch.setattr(sio, "VECTORED_MIN_RUN_BYTES", 1 << 30)
    staged = attach(extra_config(l3, split_kv=split), mha_pool(layout, heads=8, head_dim=128))
    assert staged.vectored_get is False and staged.vectored_set is False
    assert staged.batch_get_v1(ks[:2], idx[: 2 * pool.page_size]) == [True, True]
    assert all(torch.equal(page_bytes_of(staged.mem_pool_host, i), want[i]) for i in range(2))
    assert staged.batch_set_v1(ks[2:], idx[: 2 * pool.page_size]) == [True, True]  # the same pages under keys 2, 3
    pool3 = mha_pool(layout, heads=8, head_dim=128)
    monkeypatch.setattr(sio, "VECTORED_MIN_RUN_BYTES", 32 << 10)
    r = attach(extra_config(l3, split_kv=split), pool3)
    assert r.vectored_get is in_place
    assert r.batch_get_v1(ks, idx) == [True] * 4
    assert all(torch.equal(page_bytes_of(pool3, i), want[i % 2]) for i in range(4))
    short = attach(extra_config(l3, split_kv=split), mha_pool(layout))  # 4 KiB runs: staged
    assert short.vectored_get is False and short.vectored_set is False
    b.close(), staged.close(), r.close(), short.close()


@pytest.mark.parametrize("layout,zero_copy", [("page_first", True), ("page_first_direct", True),
                                              ("layer_first", False)])
def test_mla_pages_round_trip_and_are_shared_across_tp_ranks(tmp_path, layout, zero_copy):
    """MLA: one record per page (in place where the page is one region), and TP rank 1 of 2 reads what rank 0
    wrote (MLA pages are the same on every rank); an MHA reader of the same store does not."""
    l3 = file_l3(tmp_path)
    pool = mla_pool(layout)
    w = attach(extra_config(l3, split_kv=True), pool, tp_rank=0, tp_size=2, mla=True)
    assert w.parts_per_page == 1 and w.zero_copy is zero_copy
    idx = fill_pages(pool, 3, seed=6)
    want = [page_bytes_of(pool, i) for i in range(3)]
    ks = keys(3, "mla")
    assert w.batch_set_v1(ks, idx) == [True] * 3
    pool2 = mla_pool(layout)
    r = attach(extra_config(l3), pool2, tp_rank=1, tp_size=2, mla=True)
    assert r.batch_get_v1(ks, idx) == [True] * 3
    assert all(torch.equal(page_bytes_of(pool2, i), want[i]) for i in range(3))
    flat = r.batch_get(ks, [pool2.get_dummy_flat_data_page() for _ in ks])
    assert all(torch.equal(f.view(torch.uint8), w_) for f, w_ in zip(flat, want))
    other = attach(extra_config(l3), mha_pool(), tp_rank=1, tp_size=2)
    assert other.batch_exists(ks) == 0
    w.close(), r.close(), other.close()


def test_leading_run_and_missing_page(tmp_path):
    pool = mha_pool()
    b = attach(extra_config(file_l3(tmp_path)), pool)
    idx = fill_pages(pool, 4, seed=2)
    ks = keys(4, "lead")
    ps = pool.page_size
    sel = torch.cat([idx[0:2 * ps], idx[3 * ps:4 * ps]])
    assert b.batch_set_v1([ks[0], ks[1], ks[3]], sel) == [True] * 3
    assert b.batch_exists(ks) == 2
    assert b.batch_exists(ks[3:]) == 1 and b.batch_exists(ks[2:]) == 0
    assert b.batch_get_v1(ks, idx) == [True, True, False, True]
    assert b.batch_get(ks[2:3], [pool.get_dummy_flat_data_page()]) == [None]
    b.close()


def test_a_page_with_one_part_missing_is_absent(tmp_path):
    """With split_kv an MHA page is a K record and a V record; without its V record a page is a miss everywhere."""
    pool = mha_pool()
    b = attach(extra_config(file_l3(tmp_path), split_kv=True), pool)
    idx = fill_pages(pool, 2, seed=3)
    ks = keys(2, "part")
    assert b.batch_set_v1(ks, idx) == [True, True]
    import os
    k_v = b.tierkv_keys(ks[1])[1]
    os.remove(os.path.join(str(tmp_path / "l3"), b._ns_digest.hex(), k_v[:2], k_v + ".page"))
    assert b.batch_exists(ks) == 1
    assert b.batch_get_v1(ks, idx) == [True, False]
    b.close()


@pytest.mark.parametrize("change", ["tp_rank", "dtype", "layout", "model", "page_size", "format_version",
                                    "split_kv"])
def test_other_namespace_is_a_miss(tmp_path, monkeypatch, change):
    """A page written by TP rank 0 of 2 (bfloat16, page_first, page 16, this model) is invisible to rank 1 of 2,
    to float16, to another layout / model / page size, and to a reader of another tierkv format version."""
    l3 = file_l3(tmp_path)
    pool = mha_pool()
    w = attach(extra_config(l3), pool, tp_rank=0, tp_size=2)
    idx = fill_pages(pool, 2, seed=4)
    ks = keys(2, "ns")
    assert w.batch_set_v1(ks, idx) == [True, True]
    cfg = {"tp_rank": 0, "tp_size": 2}
    pool2 = mha_pool()
    if change == "tp_rank":
        cfg["tp_rank"] = 1
    elif change == "dtype":
        pool2 = mha_pool(dtype=torch.float16)
    elif change == "layout":
        pool2 = mha_pool("page_first_direct")
    elif change == "model":
        cfg["model"] = "Qwen/Qwen3-1.7B"
    elif change == "page_size":
        pool2 = mha_pool(page_size=8, pages=32, head_dim=128)  # same bytes per page, other tokens per page
    elif change == "format_version":
        monkeypatch.setattr(page_hash, "FORMAT_VERSION", page_hash.FORMAT_VERSION + 1)
    r = attach(extra_config(l3, split_kv=True) if change == "split_kv" else extra_config(l3), pool2, **cfg)
    assert r.page_bytes == w.page_bytes and w.parts_per_page == 1  # file store default: one record per page
    assert r.batch_exists(ks) == 0
    assert r.batch_get_v1(ks, idx[: 2 * pool2.page_size]) == [False, False]
    monkeypatch.undo()
    same = attach(extra_config(l3), mha_pool(), tp_rank=0, tp_size=2)  # the writer's own namespace still hits
    assert same.batch_exists(ks) == 2
    w.close(), r.close(), same.close()


def test_default_records_per_page():
    from tierkv.connector.sglang.hicache import records_per_page

    pool = mha_pool()
    assert records_per_page(pool, None, "file") == 1 and records_per_page(pool, None, "zmq") == 2
    assert records_per_page(pool, None, "mooncake") == 2 and records_per_page(pool, False, "mooncake") == 1
    assert records_per_page(pool, True, "file") == 2


def test_mla_namespace_ignores_tp_rank_mha_does_not():
    pool = mha_pool()
    ns = lambda r, mla: build_namespace(storage_config({}, tp_rank=r, tp_size=2, mla=mla), pool).digest()  # noqa: E731
    assert ns(0, True) == ns(1, True)
    assert ns(0, False) != ns(1, False)
    k = "ab" * 32
    assert map_key(ns(0, False), k, 0) != map_key(ns(1, False), k, 0) != map_key(ns(1, False), k, 1)
    assert len(map_key(ns(0, False), k, 0)) == 32


@pytest.mark.parametrize("extra,exc,words", [
    ({"module_path": "tierkv.connector.sglang.hicache", "class_name": "TierKVHiCacheStorage"}, ValueError,
     ["backend_name"]),
    (extra_config(None) | {"l3": None}, ConfigError, ["l3"]),
    ({k: v for k, v in extra_config({}).items() if k != "l3"}, ConfigError, ["missing", "'hicache-storage-backend-extra-config.l3'"]),
    (extra_config({"backend": "nfs"}), ConfigError, ["l3.backend", "nfs", "file", "zmq", "mooncake"]),
    (extra_config({"backend": "none"}), ConfigError, ["none", "file, zmq, mooncake"]),
    (extra_config({"backend": "zmq", "zmq": {"endpoint": "tcp://127.0.0.1:1", "timeout": 1}}), ConfigError,
     ["l3.zmq", "timeout"]),
    (extra_config({"backend": "file", "file": {}}), ConfigError, ["l3.file", "root"]),
    (extra_config({"backend": "file", "file": {"root": "/tmp/x"}}, l3_root="/x"), ConfigError,
     ["l3_root", "allowed", "l3, model_id, namespace_extra"]),
    (extra_config({}) | {"class_name": "NoSuchClass"}, AttributeError, ["NoSuchClass"]),
])
def test_bad_extra_config_fails_at_attach_with_a_clear_error(extra, exc, words):
    with pytest.raises(exc) as ei:
        StorageBackendFactory.create_backend("dynamic", storage_config(extra), None)
    msg = str(ei.value)
    for w in words:
        assert w in msg, (w, msg)


def test_no_model_name_fails_at_register(tmp_path):
    b = StorageBackendFactory.create_backend("dynamic", storage_config(extra_config(file_l3(tmp_path)), model=None),
                                             None)
    with pytest.raises(ConfigError, match="model_id"):
        b.register_mem_pool_host(mha_pool())
    b2 = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra_config(file_l3(tmp_path), model_id="org/m@rev"), model=None), None)
    b2.register_mem_pool_host(mha_pool())
    assert b2.namespace.model_id == "org/m@rev"
    b2.close()


def test_stats_clear_close(tmp_path):
    pool = mha_pool()
    b = attach(extra_config(file_l3(tmp_path)), pool)
    idx = fill_pages(pool, 3, seed=5)
    ks = keys(3, "stats")
    assert b.batch_set_v1(ks, idx) == [True] * 3
    assert b.batch_get_v1(ks + keys(1, "none"), torch.cat([idx, idx[: pool.page_size]])) == [True] * 3 + [False]
    st = b.stats()
    assert (st["pages_set"], st["pages_get"], st["pages_hit"], st["errors"]) == (3, 4, 3, 0)
    assert (st["store"]["hits"], st["store"]["misses"]) == (3, 1)  # one record per page (file default)
    m = b.get_stats()
    assert m.backup_pgs == [3] and m.prefetch_pgs == [3] and m.tierkv["pages_hit"] == 3
    assert b.get_stats().backup_pgs == []  # drained, as SGLang's Mooncake backend does
    b.clear()
    assert b.batch_exists(ks) == 0
    pool2 = mha_pool("layer_first")
    b.register_mem_pool_host(pool2)  # a second registration rebuilds on the new pool (new layout: new namespace)
    assert b.zero_copy is False and b.namespace.kv_layout.endswith("/layer_first")
    idx2 = fill_pages(pool2, 1, seed=7)
    assert b.batch_set_v1(keys(1, "re"), idx2) == [True] and b.batch_exists(keys(1, "re")) == 1
    b.close()
    b.close()
    assert b.batch_exists(ks) == 0  # closed: no store, a miss (logged), never an exception into SGLang


@pytest.mark.parametrize("split", [False, True])
def test_concurrent_reads_and_writes_from_two_threads(tmp_path, split):
    """SGLang's controller reads (prefetch I/O thread) and writes (backup thread) at the same time on one backend
    object: staged and in-place pages stay bit-exact under that. (A smoke test: interleavings depend on the
    scheduler; on this file store it did not catch get and set sharing one staging buffer.)"""
    import threading

    ROUNDS = 30
    pool = mha_pool(pages=16)
    b = attach(extra_config(file_l3(tmp_path), split_kv=split), pool)
    ps = pool.page_size
    idx = fill_pages(pool, 16, seed=8)
    want = [page_bytes_of(pool, i) for i in range(16)]
    first = keys(8, "first")
    assert b.batch_set_v1(first, idx[: 8 * ps]) == [True] * 8
    errors = []

    def reader():  # the same backend object reads pages 0-7 back into their own slots (the writer reads 8-15)
        for _ in range(ROUNDS):
            pool.kv_buffer[:, : 8 * ps].zero_()
            if b.batch_get_v1(first, idx[: 8 * ps]) != [True] * 8:
                errors.append("read miss")
            if not all(torch.equal(page_bytes_of(pool, i), want[i]) for i in range(8)):
                errors.append("read bytes differ")

    def writer():
        for r in range(ROUNDS):
            ks = keys(8, f"w{r}")
            if b.batch_set_v1(ks, idx[8 * ps:]) != [True] * 8:
                errors.append("write failed")

    ts = [threading.Thread(target=reader), threading.Thread(target=writer)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=120)
    assert not errors, errors[:3]
    dst = mha_pool(pages=16)
    rd = attach(extra_config(file_l3(tmp_path), split_kv=split), dst)
    assert rd.batch_get_v1(keys(8, f"w{ROUNDS - 1}"), idx[8 * ps:]) == [True] * 8
    assert all(torch.equal(page_bytes_of(dst, 8 + i), want[8 + i]) for i in range(8))
    b.close(), rd.close()
