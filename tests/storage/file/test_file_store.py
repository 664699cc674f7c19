"""File store specifics: planted pickle, index rebuild rate, paths stay under the root, zero-copy reads,
thread safety, clear, quarantine bound."""
from __future__ import annotations

import os
import pickle
import random
import subprocess
import sys
import threading
import time

import numpy as np
import pytest
import torch
import xxhash

from tierkv.storage_backends.file.store import FileStore, as_byte_view, parse_bytes
from tierkv.storage_backends.page_format import HEADER_BYTES

_RK = random.Random(0xf11e)  # fixed: the same keys in every run (a failure reproduces)

NS = bytes(range(16))
PAGE = 4096
REC = HEADER_BYTES + PAGE


def _path(root, key, ns=NS):
    return os.path.join(root, ns.hex(), key[:2], key + ".page")


class _Canary:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):  # unpickling this creates the canary file
        return (open, (self.path, "w"))


@pytest.mark.parametrize("padded", [True, False])
def test_planted_pickle_page_is_a_miss(tmp_path, padded):
    root = str(tmp_path / "l3")
    s = FileStore(NS, PAGE, root=root)
    canary = tmp_path / "canary"
    stream = pickle.dumps(_Canary(str(canary)), protocol=2)
    # prove the stream is live: unpickling it (here, in a child, for another path) creates a canary
    probe = tmp_path / "probe"
    subprocess.run([sys.executable, "-c", "import pickle,sys; pickle.loads(sys.stdin.buffer.read())"],
                   input=pickle.dumps(_Canary(str(probe)), protocol=2), check=False, capture_output=True)
    assert probe.exists(), "the planted stream would not have done anything: test is meaningless"
    key = "ab" * 16
    p = _path(root, key)
    os.makedirs(os.path.dirname(p), exist_ok=True)
    with open(p, "wb") as f:
        f.write(stream.ljust(REC, b"\0") if padded else stream)
    dst = torch.full((PAGE,), 5, dtype=torch.uint8)
    assert s.batch_exists([key]) == (1 if padded else 0)  # exists only stats the file
    assert s.batch_get([key], [dst]) == [False]
    assert not canary.exists()
    assert s.batch_exists([key]) == 0  # the bad record was moved away
    assert s.stats()["corrupt"] == 1 and s.stats()["quarantined"] == 1
    # a restarted store does not pick it up either
    with open(p, "wb") as f:
        f.write(stream.ljust(REC, b"\0"))
    s2 = FileStore(NS, PAGE, root=root, scan_verify="header")
    assert s2.batch_exists([key]) == 0 and not canary.exists()


def test_index_rebuild_rate(tmp_path):
    """Start-up scan of 10k records: correct usage and LRU order; the rate is printed (100k files take 10x)."""
    root = str(tmp_path / "l3")
    n = 10_000
    page_bytes = 64
    s = FileStore(NS, page_bytes, root=root)
    keys = [f"{i:032x}" for i in range(n)]
    payload = bytes(page_bytes)
    t0 = time.perf_counter()
    for i in range(0, n, 1000):
        assert all(s.batch_set(keys[i:i + 1000], [payload] * 1000))
    t_write = time.perf_counter() - t0
    s.close()
    rec = HEADER_BYTES + page_bytes
    t0 = time.perf_counter()
    s2 = FileStore(NS, page_bytes, root=root, capacity_bytes=(n - 1000) * rec)
    t_open = time.perf_counter() - t0
    st = s2.stats()
    print(f"\nindex rebuild: {n} files in {st['scan_seconds']:.3f} s scan ({n / st['scan_seconds']:.0f} files/s), "
          f"open incl. eviction of 1000 {t_open:.3f} s; writing them took {t_write:.2f} s")
    assert st["scan_files"] == n
    assert st["usage_pages"] == n - 1000 and st["evictions"] == 1000
    # the 1000 oldest (first written) were evicted
    assert s2.batch_exists(keys[:1]) == 0 and s2.batch_exists([keys[999]]) == 0
    assert s2.batch_exists(keys[1000:]) == n - 1000


def test_keys_never_leave_the_root(tmp_path):
    root = tmp_path / "l3"
    s = FileStore(NS, PAGE, root=str(root))
    for bad in ["../" * 10 + "etc", "/etc/passwd" + "0" * 21, "..", "0" * 31 + "/", "0" * 30 + "\x00\x00"]:
        with pytest.raises(ValueError):
            s.batch_set([bad], [bytes(PAGE)])
    assert s.batch_set(["0f" * 16], [bytes(PAGE)]) == [True]
    all_files = [os.path.join(d, f) for d, _, fs in os.walk(tmp_path) for f in fs]
    assert all_files == [_path(str(root), "0f" * 16)]


def test_get_reads_into_destination_in_place(tmp_path):
    s = FileStore(NS, PAGE, root=str(tmp_path))
    src = torch.arange(PAGE, dtype=torch.int32).to(torch.uint8)
    assert s.batch_set(["01" * 16], [src]) == [True]
    pool = torch.zeros(4, PAGE, dtype=torch.uint8)  # a host pool: pages are rows
    row = pool[2]
    ptr = row.data_ptr()
    assert s.batch_get(["01" * 16], [row]) == [True]
    assert row.data_ptr() == ptr and torch.equal(pool[2], src) and int(pool[[0, 1, 3]].sum()) == 0
    # other dtypes: the tensor's bytes
    bf = torch.zeros(PAGE // 2, dtype=torch.bfloat16)
    assert s.batch_get(["01" * 16], [bf]) == [True]
    assert bf.view(torch.uint8).equal(src)
    with pytest.raises(ValueError):
        s.batch_get(["01" * 16], [pool[:, 0]])  # not contiguous
    with pytest.raises(ValueError):
        as_byte_view(torch.zeros(PAGE, dtype=torch.uint8)[::2].contiguous(), PAGE, True)


def test_threads_share_one_store(tmp_path):
    """A read thread and a write thread at once (as SGLang's controller calls a store)."""
    s = FileStore(NS, PAGE, root=str(tmp_path), capacity_bytes=64 * REC)
    keys = [_RK.randbytes(16).hex() for _ in range(200)]
    pages = {k: np.random.default_rng(i).bytes(PAGE) for i, k in enumerate(keys)}
    errors = []

    def writer():
        for i in range(0, 200, 8):
            if not all(s.batch_set(keys[i:i + 8], [pages[k] for k in keys[i:i + 8]])):
                errors.append("set failed")

    def reader():
        dst = [bytearray(PAGE) for _ in range(8)]
        for _ in range(100):
            for i in range(0, 200, 8):
                for k, ok, d in zip(keys[i:i + 8], s.batch_get(keys[i:i + 8], dst), dst):
                    if ok and bytes(d) != pages[k]:
                        errors.append(f"wrong bytes for {k}")

    ts = [threading.Thread(target=writer), threading.Thread(target=reader), threading.Thread(target=reader)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert not errors
    u = s.usage()
    assert u["pages"] <= 64 and u["bytes"] == u["pages"] * REC
    on_disk = sum(len(fs) for d, _, fs in os.walk(tmp_path) if "quarantine" not in d)
    assert on_disk == u["pages"]


def test_clear_drops_only_this_namespace(tmp_path):
    a = FileStore(NS, PAGE, root=str(tmp_path))
    b = FileStore(bytes(range(16, 32)), PAGE, root=str(tmp_path))
    assert a.batch_set(["01" * 16, "02" * 16], [bytes(PAGE)] * 2) == [True, True]
    assert b.batch_set(["01" * 16], [bytes(PAGE)]) == [True]
    a.clear()
    assert a.batch_exists(["01" * 16]) == 0 and a.batch_exists(["02" * 16]) == 0
    assert b.batch_exists(["01" * 16]) == 1 and a.usage()["pages"] == 0


def test_batch_delete(tmp_path):
    s = FileStore(NS, PAGE, root=str(tmp_path))
    ks = ["01" * 16, "02" * 16, "03" * 16]
    assert s.batch_set(ks[:2], [bytes(PAGE)] * 2) == [True, True]
    assert s.batch_delete(ks) == 2
    assert s.batch_exists(ks[:1]) == 0 and s.usage()["pages"] == 0
    with pytest.raises(ValueError):
        s.batch_delete(["../x"])


def test_import_does_not_need_torch():
    """The cache server imports FileStore for spilling and stays free of torch."""
    code = ("import sys; import tierkv.storage_backends.file.store as f; assert 'torch' not in sys.modules, 'torch'; "
            "import tempfile; s = f.FileStore(bytes(16), 8, root=tempfile.mkdtemp()); "
            "assert s.batch_set(['00' * 16], [b'abcdefgh']) == [True]; b = bytearray(8); "
            "assert s.batch_get(['00' * 16], [b]) == [True] and b == b'abcdefgh'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_quarantine_is_bounded(tmp_path):
    s = FileStore(NS, PAGE, root=str(tmp_path), quarantine_max_files=2)
    keys = [f"{i:02x}" * 16 for i in range(4)]
    assert s.batch_set(keys, [bytes(PAGE)] * 4) == [True] * 4
    for k in keys:
        os.truncate(_path(str(tmp_path), k), 10)
    assert s.batch_get(keys, [bytearray(PAGE) for _ in keys]) == [False] * 4
    assert len(os.listdir(tmp_path / "quarantine")) == 2
    st = s.stats()
    assert st["quarantined"] == 2 and st["deleted_bad"] == 2 and st["corrupt"] == 4
    assert not any(os.path.exists(_path(str(tmp_path), k)) for k in keys)


def test_fsync_mode_round_trip(tmp_path):
    s = FileStore(NS, PAGE, root=str(tmp_path), fsync=True)
    assert s.batch_set(["0a" * 16], [bytes(range(256)) * 16]) == [True]
    d = bytearray(PAGE)
    assert s.batch_get(["0a" * 16], [d]) == [True] and bytes(d) == bytes(range(256)) * 16


def test_parse_bytes():
    assert parse_bytes("6MiB") == 6 << 20 and parse_bytes("1.5 GB") == 1_500_000_000 and parse_bytes(42) == 42
    for bad in ["6 parsecs", "", "MiB", True]:
        with pytest.raises(ValueError):
            parse_bytes(bad)


def test_write_rest_resumes_a_short_vectored_write_at_any_byte(tmp_path):
    """After a short ``writev`` (a signal, a filesystem's own limit) the record is completed from the byte where the
    write stopped: in the header, at a run's edge or inside a run, the file ends up the header and runs in order."""
    from tierkv.storage_backends.file.store import _write_rest

    rng = np.random.default_rng(3)
    head = rng.bytes(64)
    page = rng.integers(0, 256, 12 * 1024, dtype=np.uint8)
    runs = [memoryview(page[:4096]), memoryview(page[4096:4097]), memoryview(page[4097:])]
    want = head + page.tobytes()
    for done in (0, 1, 63, 64, 64 + 4096, 64 + 4097, 64 + 5000, len(want) - 1, len(want)):
        p = tmp_path / f"rec-{done}"
        fd = os.open(p, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, want[:done])  # what the short write got out
            _write_rest(fd, [head, *runs], done)
        finally:
            os.close(fd)
        assert p.read_bytes() == want, f"resumed after {done} bytes"


@pytest.mark.parametrize("step", [1, 63, 100, 4096, 5000])
def test_a_short_read_into_runs_resumes_where_it_stopped(tmp_path, monkeypatch, step):
    """A ``preadv`` that returns fewer bytes than asked (a signal, a filesystem's own limit) is resumed from the byte
    where it stopped, in the header, at a run's edge or inside a run: the page read into runs is the page, and its
    checksum the page's."""
    page = np.random.default_rng(step).integers(0, 256, PAGE, dtype=np.uint8)
    s = FileStore(NS, PAGE, root=str(tmp_path))
    key = "3c" * 16
    assert s.batch_set([key], [page]) == [True]
    real = os.preadv

    def short(fd, bufs, offset):  # at most ``step`` bytes a call, from the first buffers given
        out, left = [], step
        for b in bufs:
            m = memoryview(b).cast("B")
            if left <= 0:
                break
            out.append(m[:left])
            left -= min(left, m.nbytes)
        return real(fd, out, offset)

    monkeypatch.setattr(os, "preadv", short)
    dst = np.zeros(PAGE, dtype=np.uint8)
    sums = [None]
    assert s.batch_get([key], [[dst[:1], dst[1:4096], dst[4096:]]], checksums=sums) == [True]
    assert np.array_equal(dst, page) and sums == [xxhash.xxh3_64_intdigest(page)]
    assert s.stats()["corrupt"] == 0
