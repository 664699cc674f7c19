"""The file store at capacity overwrites evicted record files instead of unlinking them and creating new ones
(``l3.file.recycle_evicted``, storage_backends/file/store.py): real files on the test machine's filesystem."""
from __future__ import annotations

import os

import numpy as np
import pytest

from tierkv.storage_backends.file.store import TMP_PREFIX, FileStore
from tierkv.storage_backends.page_format import HEADER_BYTES, PageFormatError, decode_header

PAGE = 4096
REC = HEADER_BYTES + PAGE
NS = bytes(range(16))
CAP = 4  # records


def _key(i: int) -> str:
    return f"{i:032x}"


def _page(i: int) -> np.ndarray:
    return np.random.default_rng(i).integers(0, 256, PAGE, dtype=np.uint8)


def _files(root) -> tuple[list[str], list[str]]:
    """(record files, temporary files) under ``root``."""
    rec, tmp = [], []
    for d, _, fs in os.walk(root):
        for f in fs:
            (tmp if f.startswith(TMP_PREFIX) else rec).append(os.path.join(d, f))
    return rec, tmp


def _inode(store: FileStore, key: str) -> int:
    return os.stat(store._path(key)).st_ino


@pytest.mark.parametrize("recycle", [True, False])
def test_writes_at_capacity_reuse_the_evicted_files_and_read_back_exact(tmp_path, recycle):
    s = FileStore(NS, PAGE, root=str(tmp_path / "l3"), capacity_bytes=CAP * REC, recycle_evicted=recycle)
    first = [_key(i) for i in range(CAP)]
    assert s.batch_set(first, [_page(i) for i in range(CAP)]) == [True] * CAP
    old_inodes = {_inode(s, k) for k in first}
    later = [_key(i) for i in range(CAP, 2 * CAP)]
    assert s.batch_set(later, [_page(i) for i in range(CAP, 2 * CAP)]) == [True] * CAP
    new_inodes = {_inode(s, k) for k in later}
    if recycle:
        assert new_inodes == old_inodes                  # the evicted records' files, overwritten
        assert s.stats()["recycled"] == CAP
    else:
        assert s.stats()["recycled"] == 0
    assert s.stats()["evictions"] == CAP
    assert s.batch_exists(first) == 0                    # evicted: misses
    out = [np.zeros(PAGE, np.uint8) for _ in later]
    assert s.batch_get(later, out) == [True] * CAP
    for i, o in zip(range(CAP, 2 * CAP), out):
        assert np.array_equal(o, _page(i))
    recs, tmps = _files(tmp_path / "l3")
    assert len(recs) == CAP and tmps == []                # every spare taken by a write
    s.close()


def test_spares_are_bounded_and_removed_on_close(tmp_path):
    """Evicted records wait as spares under temporary names (no lookup finds them) until writes take them;
    ``close`` removes those no write took."""
    s = FileStore(NS, PAGE, root=str(tmp_path / "l3"), capacity_bytes=CAP * REC)
    assert s.batch_set([_key(i) for i in range(CAP)], [_page(i) for i in range(CAP)]) == [True] * CAP
    with s._lock:
        evicted = s._evict_locked(need=CAP * REC)         # what a reservation does before its writes
    assert evicted == CAP
    recs, tmps = _files(tmp_path / "l3")
    assert recs == [] and len(tmps) == CAP                # renamed out of the key space: no lookup finds them
    assert s.batch_exists([_key(0)]) == 0
    s.close()
    assert _files(tmp_path / "l3") == ([], [])


def test_a_spare_removed_by_another_process_makes_a_new_file(tmp_path):
    """Another process's start-up scan may delete a spare (its temporary name looks stale): the write that wanted
    it creates a new file instead and succeeds."""
    s = FileStore(NS, PAGE, root=str(tmp_path / "l3"), capacity_bytes=CAP * REC)
    assert s.batch_set([_key(i) for i in range(CAP)], [_page(i) for i in range(CAP)]) == [True] * CAP
    with s._lock:
        s._evict_locked(need=REC)
    _, tmps = _files(tmp_path / "l3")
    assert len(tmps) == 1
    os.unlink(tmps[0])                                    # what the other process's scan does
    assert s.batch_set([_key(99)], [_page(99)]) == [True]
    out = np.zeros(PAGE, np.uint8)
    assert s.batch_get([_key(99)], [out]) == [True] and np.array_equal(out, _page(99))
    assert s.stats()["recycled"] == 0
    assert _files(tmp_path / "l3")[1] == []
    s.close()


def test_a_reader_of_a_recycled_file_gets_a_miss_not_the_new_page(tmp_path):
    """A reader that found a record just before it was evicted and overwritten reads the file's new bytes under the
    old key: the header names another key, so the read is a miss and nothing is loaded."""
    s = FileStore(NS, PAGE, root=str(tmp_path / "l3"), capacity_bytes=CAP * REC)
    assert s.batch_set([_key(i) for i in range(CAP)], [_page(i) for i in range(CAP)]) == [True] * CAP
    victim = s._path(_key(0))                             # least recently used: evicted first
    fd = os.open(victim, os.O_RDONLY)                     # the reader opened it before the eviction
    try:
        assert s.batch_set([_key(50)], [_page(50)]) == [True]
        assert os.fstat(fd).st_ino == _inode(s, _key(50))  # the same file now holds key 50's record
        raw = os.pread(fd, REC, 0)
    finally:
        os.close(fd)
    with pytest.raises(PageFormatError):                 # the check a read makes before it uses a byte
        decode_header(raw[:HEADER_BYTES], _key(0), NS, PAGE)
    decode_header(raw[:HEADER_BYTES], _key(50), NS, PAGE)  # (the file itself is key 50's intact record)
    s.close()


def test_fsync_and_read_only_stores_do_not_recycle(tmp_path):
    s = FileStore(NS, PAGE, root=str(tmp_path / "l3"), capacity_bytes=CAP * REC, fsync=True)
    assert s.batch_set([_key(i) for i in range(2 * CAP)], [_page(i) for i in range(2 * CAP)]) == [True] * (2 * CAP)
    assert s.stats()["recycled"] == 0 and _files(tmp_path / "l3")[1] == []
    s.close()


@pytest.mark.parametrize("recycle", [True, False])
def test_take_evicted_names_each_eviction_once(tmp_path, recycle):
    """Every record evicted for capacity, its file recycled as a spare or unlinked, is named by ``take_evicted``
    once, least recently used first; a page written again after its eviction is named only if evicted again."""
    s = FileStore(NS, PAGE, root=str(tmp_path / "l3"), capacity_bytes=CAP * REC, recycle_evicted=recycle)
    keys = [_key(i) for i in range(3 * CAP)]
    assert s.batch_set(keys[:CAP], [_page(i) for i in range(CAP)]) == [True] * CAP
    assert s.take_evicted() == ([], 0)                   # within capacity: nothing evicted
    out = [np.zeros(PAGE, np.uint8)]
    assert s.batch_get([keys[0]], out) == [True]         # a hit: keys[0] is now the most recently used
    assert s.batch_set(keys[CAP:CAP + 2], [_page(i) for i in range(CAP, CAP + 2)]) == [True] * 2
    assert s.take_evicted() == ([keys[1], keys[2]], 0)
    assert s.take_evicted() == ([], 0)                   # taken: forgotten
    assert s.batch_set([keys[1]], [_page(1)]) == [True]   # written again: evicts keys[3]
    assert s.take_evicted() == ([keys[3]], 0)
    assert s.stats()["evictions"] == 3
    assert s.batch_exists([keys[1]]) == 1 and s.batch_exists([keys[2]]) == 0


def test_take_evicted_counts_what_its_buffer_lost(tmp_path, monkeypatch):
    """Past ``EVICTED_BUFFER_MAX`` keys between two calls the rest are counted as lost, not named."""
    monkeypatch.setattr("tierkv.storage_backends.file.evictor.EVICTED_BUFFER_MAX", 2)
    s = FileStore(NS, PAGE, root=str(tmp_path / "l3"), capacity_bytes=CAP * REC)
    keys = [_key(i) for i in range(CAP + 3)]
    for i, k in enumerate(keys):  # one write at a time (a batch's own records are being written: never victims)
        assert s.batch_set([k], [_page(i)]) == [True]
    assert s.take_evicted() == (keys[:2], 1)
    assert s.take_evicted() == ([], 0)
