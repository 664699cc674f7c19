"""Mooncake backend's two set paths against a real ``mooncake_master``: zero-copy puts of pages inside a registered
host buffer (header slice + payload slice, ``batch_put_from_multi_buffers``) and the staged upsert for everything
else. Every check reads the stored object back byte for byte, so a header or payload in the wrong place, a stale
record left by a silently dropped put, or a corrupted record served as data fails here."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.helpers.fixtures_mooncake import make_backend

from tierkv.storage_backends.file.store import FileStore
from tierkv.storage_backends.page_format import HEADER_BYTES, encode_record

NS = bytes(range(40, 56))
PB = 16 * 1024


def keys_of(n: int, salt: int) -> list[str]:
    rng = np.random.default_rng(7000 + salt)
    return [rng.bytes(16).hex() for _ in range(n)]


def pool_of(n: int, seed: int) -> torch.Tensor:
    """A host pool of ``n`` pages (one contiguous uint8 tensor), random bytes."""
    rng = np.random.default_rng(seed)
    return torch.from_numpy(np.frombuffer(rng.bytes(n * PB), dtype=np.uint8).copy())


def empties(n: int) -> list[torch.Tensor]:
    return [torch.zeros(PB, dtype=torch.uint8) for _ in range(n)]


@pytest.fixture
def zc(tmp_path):
    """A store that takes the zero-copy path for any page size (the default threshold is 1 MiB)."""
    with make_backend(tmp_path, PB, NS, timeout_s=3.0, zero_copy_min_page_bytes=0) as h:
        yield h


def stored(h, key: str) -> bytes:
    return h.backend.client.get(h.backend.object_name(key))


def test_zero_copy_round_trip_and_exact_record(zc):
    b = zc.backend
    pool = pool_of(8, seed=1)
    assert b.register_host_buffer(pool) is True
    pages = list(pool.view(8, PB))
    ks = keys_of(8, salt=1)
    assert b.batch_set(ks, pages) == [True] * 8
    st = b.stats()
    assert st["zero_copy_sets"] == 8 and st["staged_sets"] == 0, st
    for k, p in zip(ks, pages):
        assert stored(zc, k) == encode_record(k, NS, p.numpy())  # header slice then payload slice, exactly
    dst = empties(8)
    assert b.batch_get(ks, dst) == [True] * 8
    assert all(torch.equal(d, p) for d, p in zip(dst, pages))


def test_mixed_sources_take_both_paths_and_store_the_same_records(zc):
    b = zc.backend
    pool = pool_of(4, seed=2)
    assert b.register_host_buffer(pool)
    rng = np.random.default_rng(22)
    loose = [torch.from_numpy(np.frombuffer(rng.bytes(PB), dtype=np.uint8).copy()) for _ in range(3)]
    tail = bytearray(rng.bytes(PB))  # a non-tensor source outside the pool
    srcs = [pool[:PB], loose[0], pool[2 * PB:3 * PB], loose[1], loose[2], memoryview(tail), pool[3 * PB:]]
    ks = keys_of(len(srcs), salt=2)
    assert b.batch_set(ks, srcs) == [True] * len(srcs)
    st = b.stats()
    assert st["zero_copy_sets"] == 3 and st["staged_sets"] == 4, st
    for k, s in zip(ks, srcs):
        want = s.numpy() if isinstance(s, torch.Tensor) else s
        assert stored(zc, k) == encode_record(k, NS, want)
    dst = empties(len(srcs))
    assert b.batch_get(ks, dst) == [True] * len(srcs)
    assert bytes(dst[5].numpy()) == bytes(tail) and torch.equal(dst[1], loose[0])


def test_overwrite_of_zero_copy_pages_replaces_them(zc):
    """Mooncake's put of an existing key is a silent no-op: the store must notice and upsert instead."""
    b = zc.backend
    pool = pool_of(4, seed=3)
    assert b.register_host_buffer(pool)
    pages = list(pool.view(4, PB))
    ks = keys_of(4, salt=3)
    assert b.batch_set(ks, pages) == [True] * 4
    old = [p.clone() for p in pages]
    pool.copy_(pool_of(4, seed=33))  # the pool now holds other bytes for the same keys
    assert not torch.equal(pages[0], old[0])
    assert b.batch_set(ks, pages) == [True] * 4
    st = b.stats()
    assert st["zero_copy_sets"] == 4 and st["staged_sets"] == 4, st  # the overwrites went through upsert
    dst = empties(4)
    assert b.batch_get(ks, dst) == [True] * 4
    assert all(torch.equal(d, p) for d, p in zip(dst, pages))
    assert stored(zc, ks[0]) == encode_record(ks[0], NS, pages[0].numpy())


def test_key_left_processing_by_another_writer_is_claimed(zc):
    """A writer killed mid-put, on the zero-copy path: another client started a put of the key and never finished it.
    The zero-copy put is dropped by Mooncake (reported 0); the store sees the key still absent and upserts it."""
    b = zc.backend
    other = zc.new_client()
    ks = keys_of(2, salt=4)
    rc = other.client.batch_put_session_start([other.object_name(k) for k in ks], [HEADER_BYTES + PB] * 2)
    assert rc == [0, 0], rc
    pool = pool_of(2, seed=4)
    assert b.register_host_buffer(pool)
    assert b.batch_set(ks, list(pool.view(2, PB))) == [True, True]
    dst = empties(2)
    assert b.batch_get(ks, dst) == [True, True]
    assert torch.equal(dst[1], pool[PB:])
    assert b.stats()["staged_sets"] == 2


def test_corrupt_zero_copy_record_is_a_miss(zc):
    b = zc.backend
    pool = pool_of(3, seed=5)
    assert b.register_host_buffer(pool)
    ks = keys_of(3, salt=5)
    assert b.batch_set(ks, list(pool.view(3, PB))) == [True] * 3
    assert zc.corrupt(ks[0], "flip") and zc.corrupt(ks[1], "truncate")
    dst = empties(3)
    assert b.batch_get(ks, dst) == [False, False, True]
    assert not dst[0].any() and not dst[1].any()  # a miss never writes its destination
    assert b.stats()["corrupt"] == 2


def test_unregister_and_default_threshold_send_pages_staged(zc, tmp_path):
    b = zc.backend
    pool = pool_of(2, seed=6)
    assert b.register_host_buffer(pool)
    b.unregister_host_buffer(pool)
    b.unregister_host_buffer(pool)  # twice: a no-op
    ks = keys_of(2, salt=6)
    assert b.batch_set(ks, list(pool.view(2, PB))) == [True, True]
    assert b.stats()["zero_copy_sets"] == 0 and b.stats()["staged_sets"] == 2
    # a store with the default threshold (1 MiB) stages 16 KiB pages even from a registered pool
    (tmp_path / "dflt").mkdir()
    with make_backend(tmp_path / "dflt", PB, NS, timeout_s=3.0) as h:
        assert h.backend.register_host_buffer(pool)
        assert h.backend.batch_set(ks, list(pool.view(2, PB))) == [True, True]
        assert h.backend.stats()["zero_copy_sets"] == 0
        assert stored(h, ks[1]) == encode_record(ks[1], NS, pool[PB:].numpy())
    with pytest.raises(ValueError):
        b.register_host_buffer(torch.zeros(4, 4, dtype=torch.uint8).t())  # not contiguous
    # the base interface's default: nothing to register
    fs = FileStore(NS, PB, root=str(tmp_path / "fs"))
    try:
        assert fs.register_host_buffer(pool) is False
        fs.unregister_host_buffer(pool)
    finally:
        fs.close()


def test_pipelined_groups_store_exact_records_and_route_overwrites(zc, monkeypatch):
    """Zero-copy sets go out in groups (headers of the next group checksummed while the previous one is put): with
    one page per group, fresh keys and existing keys interleaved across group boundaries, every fresh page is
    stored zero-copy, every existing key is replaced through the upsert, and every record is exact."""
    import tierkv.storage_backends.mooncake.store as mc

    monkeypatch.setattr(mc, "PUT_GROUP_BYTES", 2 * PB)  # groups of 2 pages: 7 pages -> 4 groups
    b = zc.backend
    pool = pool_of(7, seed=9)
    assert b.register_host_buffer(pool)
    pages = list(pool.view(7, PB))
    ks = keys_of(7, salt=9)
    old = [torch.full((PB,), 3, dtype=torch.uint8) for _ in range(3)]
    assert b.batch_set([ks[1], ks[2], ks[6]], old) == [True] * 3  # loose tensors: staged
    assert b.batch_set(ks, pages) == [True] * 7
    st = b.stats()
    assert st["zero_copy_sets"] == 4 and st["staged_sets"] == 3 + 3, st
    for k, p in zip(ks, pages):
        assert stored(zc, k) == encode_record(k, NS, p.numpy())
    dst = empties(7)
    assert b.batch_get(ks, dst) == [True] * 7 and all(torch.equal(d, p) for d, p in zip(dst, pages))


def test_zero_copy_set_with_checksums_stores_exact_records_without_hashing(zc, monkeypatch):
    """"Checksum once" on the zero-copy path: the given checksums go into the header arena as they are (the same
    record bytes as a set that hashes), no payload is hashed, and all the pages go out in one put group."""
    import xxhash

    import tierkv.storage_backends.mooncake.store as mc
    from tierkv.storage_backends.page_format import payload_checksum

    monkeypatch.setattr(mc, "PUT_GROUP_BYTES", 2 * PB)  # would be 3 groups of 2 pages when hashing here
    b = zc.backend
    pool = pool_of(6, seed=11)
    assert b.register_host_buffer(pool)
    pages = list(pool.view(6, PB))
    ks = keys_of(6, salt=11)
    sums = [payload_checksum(p.numpy()) for p in pages]
    real, big = xxhash.xxh3_64_intdigest, []
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest",
                        lambda d, *a: (memoryview(d).nbytes >= PB and big.append(1)) or real(d, *a))
    puts = []
    client = b.client
    orig_put = client.batch_put_from_multi_buffers

    class Spy:  # the pybind client's methods cannot be patched on the instance: wrap the store's reference
        def __getattr__(self, name):
            return getattr(client, name)

        def batch_put_from_multi_buffers(self, names, *rest):
            puts.append(len(names))
            return orig_put(names, *rest)

    monkeypatch.setattr(b, "_store", Spy())
    assert b.batch_set(ks, pages, checksums=sums) == [True] * 6
    assert big == [] and puts == [6]
    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", real)
    monkeypatch.setattr(b, "_store", client)  # the real client again before the fixture closes the store
    st = b.stats()
    assert st["zero_copy_sets"] == 6 and st["staged_sets"] == 0, st
    for k, p in zip(ks, pages):
        assert stored(zc, k) == encode_record(k, NS, p.numpy())
    dst = empties(6)
    assert b.batch_get(ks, dst) == [True] * 6 and all(torch.equal(d, p) for d, p in zip(dst, pages))


def test_zero_copy_set_with_a_wrong_checksum_is_a_miss(zc):
    from tierkv.storage_backends.page_format import payload_checksum

    b = zc.backend
    pool = pool_of(3, seed=12)
    assert b.register_host_buffer(pool)
    pages = list(pool.view(3, PB))
    ks = keys_of(3, salt=12)
    sums = [payload_checksum(p.numpy()) for p in pages]
    sums[0] = (sums[0] + 1) % (1 << 64)
    assert b.batch_set(ks, pages, checksums=sums) == [True] * 3
    assert b.stats()["zero_copy_sets"] == 3
    dst = empties(3)
    assert b.batch_get(ks, dst) == [False, True, True]
    assert torch.equal(dst[1], pages[1]) and torch.equal(dst[2], pages[2])
    assert b.stats()["corrupt"] == 1
