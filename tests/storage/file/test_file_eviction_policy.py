"""The file store under each eviction policy: scan resistance through real records, writes in flight never evicted,
and the order a restart starts from (mtimes; policy state is not persisted)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tierkv.storage_backends.eviction import POLICIES
from tierkv.storage_backends.file.store import FileStore
from tierkv.storage_backends.page_format import HEADER_BYTES

NS = bytes(range(16))
PAGE = 256
REC = HEADER_BYTES + PAGE


def key(name: str) -> str:
    return name.encode().hex().ljust(32, "0")[:32]


def put(s: FileStore, names):
    assert all(s.batch_set([key(n) for n in names], [np.full(PAGE, 7, np.uint8) for _ in names]))


def get(s: FileStore, names) -> list[bool]:
    return s.batch_get([key(n) for n in names], [np.zeros(PAGE, np.uint8) for _ in names])


@pytest.mark.parametrize("policy,kept", [("lru", 0), ("lfu", 4), ("slru", 4), ("s3fifo", 4)])
def test_a_scan_through_the_store_keeps_the_working_set_except_under_lru(tmp_path, policy, kept):
    s = FileStore(NS, PAGE, root=str(tmp_path), capacity_bytes=10 * REC, eviction_policy=policy,
                  recycle_evicted=False)
    try:
        put(s, [f"o{i}" for i in range(10)])
        work = [f"w{i}" for i in range(4)]
        for _ in range(3):
            for w in work:
                if not get(s, [w])[0]:
                    put(s, [w])
        for i in range(30):
            put(s, [f"s{i}"])
        assert sum(get(s, work)) == kept
        assert s.stats()["usage_pages"] == 10
    finally:
        s.close()


@pytest.mark.parametrize("policy", POLICIES)
def test_records_being_written_are_never_evicted(tmp_path, policy):
    s = FileStore(NS, PAGE, root=str(tmp_path), capacity_bytes=4 * REC, eviction_policy=policy)
    try:
        put(s, ["a", "b", "c", "d"])
        ev = s._ev
        busy = s._path(key("a"))
        with s._lock:
            ev.writing[busy] = 1  # a write of "a" in flight (a second writer of the same page)
            n = ev.evict_locked(count=4)
            del ev.writing[busy]
        assert n == 3 and get(s, ["a", "b", "c", "d"]) == [True, False, False, False]
        with s._lock:  # the path a write is reserving is kept too
            assert ev.evict_locked(count=1, keep=busy) == 0
    finally:
        s.close()


def test_restart_starts_from_mtime_order_whatever_the_policy(tmp_path):
    s = FileStore(NS, PAGE, root=str(tmp_path), eviction_policy="slru")
    names = ["a", "b", "c", "d"]
    put(s, names)
    s.close()
    for i, n in enumerate(["c", "a", "d", "b"]):  # mtimes: c oldest ... b newest
        os.utime(s._path(key(n)), (1e9 + i, 1e9 + i))
    s2 = FileStore(NS, PAGE, root=str(tmp_path), eviction_policy="slru", capacity_bytes=4 * REC,
                   recycle_evicted=False)
    try:
        assert list(s2._ev.order) == [s2._path(key(n)) for n in ["c", "a", "d", "b"]]
        put(s2, ["e"])
        assert get(s2, ["c"]) == [False] and get(s2, ["a", "d", "b", "e"]) == [True] * 4
    finally:
        s2.close()
