"""File store fast paths: the header it writes is exactly page_format's, hits are stamped lazily but persisted
(flush on time, on close, on a dropped store), and directory fsyncs run for every directory of a batch."""
from __future__ import annotations

import gc
import os
import random

import torch

import tierkv.storage_backends.file.store as file_mod
from tierkv.storage_backends.file.store import FileStore
from tierkv.storage_backends.page_format import HEADER_BYTES, decode_record, encode_header

_RK = random.Random(0xfa57)  # fixed: the same keys in every run (a failure reproduces)

NS = bytes(range(16))
PAGE = 4096


def _path(root: str, key: str) -> str:
    return os.path.join(root, NS.hex(), key[:2], key + ".page")


def _mtime(root: str, key: str) -> int:
    return os.stat(_path(root, key)).st_mtime_ns


def test_record_is_page_format(tmp_path):
    s = FileStore(NS, PAGE, root=str(tmp_path))
    k = _RK.randbytes(16).hex()
    src = torch.randint(0, 256, (PAGE,), dtype=torch.uint8)
    assert s.batch_set([k], [src]) == [True]
    raw = open(_path(str(tmp_path), k), "rb").read()
    assert raw[:HEADER_BYTES] == encode_header(k, NS, src.numpy())
    assert bytes(decode_record(raw, k, NS, PAGE)) == bytes(src.numpy())


def test_hits_are_stamped_lazily_and_persisted_on_close(tmp_path):
    root = str(tmp_path)
    s = FileStore(NS, PAGE, root=root, touch_flush_s=3600)
    ks = [_RK.randbytes(16).hex() for _ in range(3)]
    assert s.batch_set(ks, [bytes(PAGE)] * 3) == [True] * 3
    before = [_mtime(root, k) for k in ks]
    dst = [bytearray(PAGE) for _ in ks]
    assert s.batch_get(ks[::-1], dst) == [True] * 3  # read 2, 1, 0
    assert [_mtime(root, k) for k in ks] == before  # not yet written
    s.close()
    after = [_mtime(root, k) for k in ks]
    assert after[2] < after[1] < after[0] and min(after) > max(before)


def test_touch_flush_s_zero_stamps_every_batch(tmp_path):
    root = str(tmp_path)
    s = FileStore(NS, PAGE, root=root, touch_flush_s=0)
    ks = [_RK.randbytes(16).hex() for _ in range(2)]
    assert s.batch_set(ks, [bytes(PAGE)] * 2) == [True] * 2
    assert _mtime(root, ks[0]) < _mtime(root, ks[1])
    assert s.batch_get([ks[0]], [bytearray(PAGE)]) == [True]
    assert _mtime(root, ks[0]) > _mtime(root, ks[1])


def test_dropped_store_persists_pending_hits(tmp_path):
    root = str(tmp_path)
    s = FileStore(NS, PAGE, root=root, touch_flush_s=3600)
    ks = [_RK.randbytes(16).hex() for _ in range(2)]
    assert s.batch_set(ks, [bytes(PAGE)] * 2) == [True] * 2
    assert s.batch_get([ks[0]], [bytearray(PAGE)]) == [True]
    del s
    gc.collect()
    assert _mtime(root, ks[0]) > _mtime(root, ks[1])
    s2 = FileStore(NS, PAGE, root=root, capacity_bytes=2 * (HEADER_BYTES + PAGE))
    assert s2.batch_set([_RK.randbytes(16).hex()], [bytes(PAGE)]) == [True]
    assert [s2.exists(k) for k in ks] == [True, False]  # ks[1] was the least recently used


def test_evicted_and_deleted_pages_drop_their_pending_stamp(tmp_path):
    root = str(tmp_path)
    s = FileStore(NS, PAGE, root=root, touch_flush_s=3600, capacity_bytes=2 * (HEADER_BYTES + PAGE))
    ks = [_RK.randbytes(16).hex() for _ in range(4)]
    assert s.batch_set(ks[:2], [bytes(PAGE)] * 2) == [True] * 2
    assert s.batch_get(ks[:2], [bytearray(PAGE), bytearray(PAGE)]) == [True, True]
    assert len(s._touches) == 2
    assert s.batch_delete([ks[1]]) == 1
    assert len(s._touches) == 1
    assert s.batch_set(ks[2:], [bytes(PAGE)] * 2) == [True] * 2  # the second one evicts ks[0]
    assert s._touches == {} and s.flush_touches() == 0
    assert [s.exists(k) for k in ks] == [False, False, True, True]


def test_fsync_batch_writes_concurrently_each_record_synced_before_its_rename(tmp_path, monkeypatch):
    """fsync: true keeps temp -> fsync -> rename for every record while a batch's records are written by pool
    threads (their fsyncs overlap); a key repeated in one batch still ends with its last page."""
    import threading

    s = FileStore(NS, PAGE, root=str(tmp_path), fsync=True)
    ks = [_RK.randbytes(16).hex() for _ in range(12)]
    srcs = [bytes([i]) * PAGE for i in range(12)]
    synced, order, caller = set(), [], threading.get_ident()
    real_fsync, real_rename = os.fsync, os.rename

    def fsync(fd):
        path = os.readlink(f"/proc/self/fd/{fd}")
        order.append(("fsync", path, threading.get_ident()))
        synced.add(path)
        return real_fsync(fd)

    def rename(a, b):
        order.append(("rename", a, threading.get_ident()))
        assert a in synced, f"{a} renamed before its fsync"
        return real_rename(a, b)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "rename", rename)
    assert s.batch_set(ks, srcs) == [True] * 12
    renames = [o for o in order if o[0] == "rename"]
    assert len(renames) == 12 and all(t != caller for _, _, t in renames)  # written by the pool
    dst = [bytearray(PAGE) for _ in ks]
    assert s.batch_get(ks, dst) == [True] * 12 and all(bytes(d) == x for d, x in zip(dst, srcs))
    k = ks[0]
    assert s.batch_set([k, k, k], [b"\x07" * PAGE, b"\x08" * PAGE, b"\x09" * PAGE]) == [True] * 3
    assert s.batch_get([k], dst[:1]) == [True] and bytes(dst[0]) == b"\x09" * PAGE
    s.close()


def test_fsync_batch_syncs_every_directory(tmp_path, monkeypatch):
    s = FileStore(NS, PAGE, root=str(tmp_path), fsync=True)
    ks = [f"{i:02x}" + _RK.randbytes(15).hex() for i in (1, 2, 3, 3)]
    synced = []
    real = FileStore._fsync_dir
    monkeypatch.setattr(FileStore, "_fsync_dir", lambda self, d: (synced.append(d), real(self, d))[1])
    assert s.batch_set(ks, [bytes(PAGE)] * 4) == [True] * 4
    assert sorted(synced) == sorted({os.path.dirname(_path(str(tmp_path), k)) for k in ks})
    assert file_mod._FSYNC_POOL is not None
