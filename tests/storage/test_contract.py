"""L3 store contract (docs/architecture.md, "L3 stores"; SGLang HiCacheStorage semantics), run against every backend in
conftest.KINDS."""
from __future__ import annotations

import multiprocessing as mp
import time

import numpy as np
import pytest
import torch

from tests.helpers import contract_workers as W

from pathlib import Path

_HELPERS = Path(__file__).resolve().parents[1] / "helpers"
_KINDS = [k for k in ("file", "zmq", "zmq_shm", "mooncake", "lmcache", "redis", "redis_cluster")
          if (_HELPERS / f"fixtures_{k}.py").exists()]
# Parametrisations restricted per store (the only ones; every other test runs on every store of conftest.KINDS):
# - the exact LRU eviction test: Mooncake and LMCache evict by their own policies (watermark, LMCache's), not an exact
#   LRU of a given number of pages, so there is nothing exact to assert for them;
# - the SIGSTOP test: the file store has no server process to stop.
# Stores where a read concurrent with an overwrite of the key may be a miss (never wrong data), and where of two
# clients overwriting one key at the same moment one may be refused (its set returns False; Mooncake logs
# "Failed to finalize upsert ... ILLEGAL_CLIENT"): Mooncake writes by upsert, which replaces the object
# (docs/architecture.md, "L3 stores"). The other stores switch from one whole page to the next and accept every set.
MISS_WHILE_OVERWRITTEN = ("mooncake",)
EXACT_LRU = [k for k in _KINDS if k in ("file", "zmq", "zmq_shm")]
STOPPABLE = [k for k in _KINDS if k in ("zmq", "zmq_shm", "mooncake", "lmcache", "redis", "redis_cluster")]

KiB = 1024
NS_A = bytes(range(16))      # the namespace make_store uses by default (conftest.NS_A)
NS_B = bytes(range(16, 32))


def keys_of(n: int, salt: int = 0) -> list[str]:
    rng = np.random.default_rng(1000 + salt)
    return [rng.bytes(16).hex() for _ in range(n)]


def pages(n: int, page_bytes: int, seed: int = 0) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.frombuffer(rng.bytes(page_bytes), dtype=np.uint8).copy()) for _ in range(n)]


def empties(n: int, page_bytes: int, fill: int = 0) -> list[torch.Tensor]:
    return [torch.full((page_bytes,), fill, dtype=torch.uint8) for _ in range(n)]


@pytest.mark.parametrize("page_bytes", [4 * KiB, 64 * KiB, 256 * KiB])
def test_round_trip(make_store, page_bytes):
    h = make_store(page_bytes=page_bytes)
    b = h.backend
    ks, src = keys_of(6, page_bytes), pages(6, page_bytes, seed=page_bytes)
    assert b.batch_set(ks, src) == [True] * 6
    assert b.batch_exists(ks) == 6
    dst = empties(6, page_bytes)
    assert b.batch_get(ks, dst) == [True] * 6
    for s, d in zip(src, dst):
        assert torch.equal(s, d)
    # other buffer kinds: bytes / bytearray sources, memoryview / bytearray destinations
    k2 = keys_of(2, salt=page_bytes + 1)
    raw = [bytes(src[0].numpy()), bytearray(src[1].numpy().tobytes())]
    assert b.batch_set(k2, raw) == [True, True]
    ba, mv = bytearray(page_bytes), memoryview(bytearray(page_bytes))
    assert b.batch_get(k2, [ba, mv]) == [True, True]
    assert bytes(ba) == raw[0] and mv.tobytes() == bytes(raw[1])


def test_exists_counts_leading_run(make_store):
    h = make_store()
    b = h.backend
    ks = keys_of(8)
    present = [0, 1, 2, 3, 5, 7]
    assert b.batch_set([ks[i] for i in present], pages(len(present), 4096)) == [True] * len(present)
    assert b.batch_exists(ks) == 4          # 0..3 then a hole at 4
    assert b.batch_exists(ks[5:]) == 1      # 5, hole at 6
    assert b.batch_exists(ks[4:]) == 0
    assert b.batch_exists([ks[7], ks[0], ks[6]]) == 2
    assert b.batch_exists([]) == 0
    assert b.exists(ks[7]) and not b.exists(ks[6])


def test_missing_get_is_a_miss_and_leaves_destination(make_store):
    h = make_store()
    b = h.backend
    ks = keys_of(3)
    src = pages(1, 4096, seed=3)
    assert b.batch_set([ks[1]], src) == [True]
    dst = empties(3, 4096, fill=0xAB)
    assert b.batch_get(ks, dst) == [False, True, False]
    assert torch.equal(dst[1], src[0])
    assert bool((dst[0] == 0xAB).all()) and bool((dst[2] == 0xAB).all())
    st = b.stats()
    assert (st["misses"], st["hits"], st["sets"], st["corrupt"]) == (2, 1, 1, 0)


def test_overwrite_replaces_page(make_store):
    h = make_store()
    b = h.backend
    k = keys_of(1)
    first, second = pages(2, 4096, seed=9)
    assert b.batch_set(k, [first]) == [True]
    assert b.batch_set(k, [second]) == [True]
    dst = empties(1, 4096)
    assert b.batch_get(k, dst) == [True]
    # a write-once store (LMCache keeps the first copy of a chunk) still returns one whole page, never a mix
    assert torch.equal(dst[0], first if getattr(h, "write_once", False) else second)


@pytest.mark.parametrize("backend_kind", EXACT_LRU, indirect=True)
def test_capacity_evicts_least_recently_used(make_store):
    h = make_store(capacity_pages=8)
    assert h.capacity_pages is not None
    b = h.backend
    cap = h.capacity_pages
    ks = keys_of(cap + cap // 2)
    src = pages(len(ks), 4096, seed=5)
    assert b.batch_set(ks[:cap], src[:cap]) == [True] * cap
    keep = list(range(cap // 2))                      # read the oldest half: now the most recently used
    assert b.batch_get([ks[i] for i in keep], empties(len(keep), 4096)) == [True] * len(keep)
    assert b.batch_set(ks[cap:], src[cap:]) == [True] * (len(ks) - cap)
    expect_gone = set(range(cap // 2, cap))           # the unread half was least recently used
    dst = empties(len(ks), 4096)
    res = b.batch_get(ks, dst)
    for i, r in enumerate(res):
        if i in expect_gone:
            assert not r, f"page {i} should have been evicted"
        else:
            assert r, f"page {i} should have survived"
            assert torch.equal(dst[i], src[i])
    assert b.stats()["evictions"] == len(expect_gone)


@pytest.mark.parametrize("how", ["truncate", "flip", "foreign_namespace"])
def test_corrupt_page_is_a_miss_never_data(make_store, how):
    h = make_store(page_bytes=16 * KiB)
    b = h.backend
    ks = keys_of(3)
    src = pages(3, 16 * KiB, seed=11)
    assert b.batch_set(ks, src) == [True] * 3
    before = b.stats()["corrupt"]
    # every fixture must be able to damage a stored page in every way: one that cannot (e.g. after a change of
    # storage layout it no longer finds the record) fails here, it never turns this integrity test into a skip
    assert h.corrupt(ks[1], how) is True, f"{h.name} fixture could not corrupt the stored page by {how!r}"
    dst = empties(3, 16 * KiB)
    assert b.batch_get(ks, dst) == [True, False, True]
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[2])
    assert b.stats()["corrupt"] == before + 1
    assert b.batch_get([ks[1]], empties(1, 16 * KiB)) == [False]   # stays a miss
    if getattr(h, "write_once", False):  # the bad copy cannot be replaced: the set says so, the page stays a miss
        assert b.batch_set([ks[1]], [src[1]]) == [False]
        assert b.batch_get([ks[1]], dst[1:2]) == [False]
        return
    # the key can be stored again and then reads back
    assert b.batch_set([ks[1]], [src[1]]) == [True]
    assert b.batch_get([ks[1]], dst[1:2]) == [True] and torch.equal(dst[1], src[1])


@pytest.mark.parametrize("bad", ["", "xyz", "0" * 31, "0" * 33, "A" * 32, "../" + "0" * 29, "0" * 30 + "/x",
                                 b"0" * 32, 123, None])
def test_bad_keys_raise_value_error(make_store, bad):
    b = make_store().backend
    good = keys_of(1)[0]
    with pytest.raises(ValueError):
        b.batch_exists([good, bad])
    with pytest.raises(ValueError):
        b.batch_get([bad], empties(1, 4096))
    with pytest.raises(ValueError):
        b.batch_set([good, bad], pages(2, 4096))
    assert b.batch_exists([good]) == 0  # nothing was stored by the failed set


def test_wrong_buffer_sizes_raise_value_error(make_store):
    b = make_store().backend
    ks = keys_of(2)
    with pytest.raises(ValueError):
        b.batch_set(ks[:1], [bytes(4095)])
    with pytest.raises(ValueError):
        b.batch_set(ks[:1], [torch.zeros(4097, dtype=torch.uint8)])
    with pytest.raises(ValueError):
        b.batch_get(ks[:1], [torch.zeros(1000, dtype=torch.uint8)])
    with pytest.raises(ValueError):
        b.batch_get(ks, empties(1, 4096))      # fewer destinations than keys
    with pytest.raises(ValueError):
        b.batch_set(ks, pages(3, 4096))        # more sources than keys
    with pytest.raises(ValueError):
        b.batch_get(ks[:1], [bytes(4096)])     # read-only destination
    assert b.batch_exists(ks) == 0


def test_namespace_isolation(make_store):
    """Namespace isolation at the L3 level: the same key text under another namespace is another page."""
    h = make_store()
    a = h.backend
    other = h.new_client(namespace=NS_B)
    ks = keys_of(4)
    pa, pb = pages(4, 4096, seed=21), pages(4, 4096, seed=22)
    assert a.batch_set(ks, pa) == [True] * 4
    assert other.batch_exists(ks) == 0
    dst = empties(4, 4096, fill=7)
    assert other.batch_get(ks, dst) == [False] * 4
    assert all(bool((d == 7).all()) for d in dst)
    assert other.batch_set(ks, pb) == [True] * 4
    da, db = empties(4, 4096), empties(4, 4096)
    assert a.batch_get(ks, da) == [True] * 4 and other.batch_get(ks, db) == [True] * 4
    assert all(torch.equal(x, y) for x, y in zip(da, pa))
    assert all(torch.equal(x, y) for x, y in zip(db, pb))
    same = h.new_client(namespace=NS_A)
    assert same.batch_exists(ks) == 4


def test_restart_keeps_or_drops_pages_never_wrong(make_store):
    h = make_store()
    ks = keys_of(6)
    src = pages(6, 4096, seed=31)
    assert h.backend.batch_set(ks, src) == [True] * 6
    b = h.restart()
    assert b is h.backend
    dst = empties(6, 4096)
    res = b.batch_get(ks, dst)
    # persistent stores keep every page; the others come back empty (a new server / master): never a wrong page
    assert res == ([True] * 6 if h.persistent else [False] * 6)
    for r, d, s in zip(res, dst, src):
        if r:
            assert torch.equal(d, s)
    # normal service after the restart
    k2, s2 = keys_of(2, salt=7), pages(2, 4096, seed=32)
    assert b.batch_set(k2, s2) == [True, True]
    d2 = empties(2, 4096)
    assert b.batch_get(k2, d2) == [True, True] and all(torch.equal(x, y) for x, y in zip(d2, s2))


@pytest.mark.parametrize("backend_kind", STOPPABLE, indirect=True)
def test_stopped_server_calls_time_out_then_service_resumes(make_store):
    """A hung server (SIGSTOP): every call returns misses/False within the configured per-call bound, and the
    same client serves again after SIGCONT."""
    timeout_s = 1.0
    h = make_store(timeout_s=timeout_s)
    assert h.supports_stop
    b = h.backend
    ks, src = keys_of(3), pages(3, 4096, seed=51)
    assert b.batch_set(ks[:2], src[:2]) == [True, True]
    bound = timeout_s + 2.0  # margin for a busy machine
    h.stop()
    try:
        for call in (lambda: b.batch_exists(ks[:2]), lambda: b.batch_get(ks[:2], empties(2, 4096)),
                     lambda: b.batch_set(ks[2:], src[2:])):
            t0 = time.monotonic()
            res = call()
            assert time.monotonic() - t0 <= bound
            assert res in (0, [False, False], [False])
    finally:
        h.cont()
    # the same client recovers within a bounded time (a client may back off before reconnecting)
    k2, s2 = keys_of(1, salt=52), pages(1, 4096, seed=52)
    deadline = time.monotonic() + 15.0
    while b.batch_set(k2, s2) != [True]:
        assert time.monotonic() < deadline, f"{h.name}: no service 15 s after SIGCONT"
        time.sleep(0.05)
    d2 = empties(1, 4096)
    assert b.batch_get(k2, d2) == [True] and torch.equal(d2[0], s2[0])
    d3 = empties(2, 4096)  # a stopped (not killed) server keeps its pages
    assert b.batch_get(ks[:2], d3) == [True, True]
    assert torch.equal(d3[0], src[0]) and torch.equal(d3[1], src[1])


COUNTERS = ("hits", "misses", "sets", "set_failures", "corrupt", "errors", "evictions")


def test_stats_count_exactly_and_close_idempotent(make_store):
    h = make_store()
    b = h.backend
    assert {k: b.stats()[k] for k in COUNTERS} == dict.fromkeys(COUNTERS, 0)   # a fresh client
    ks, src = keys_of(5, salt=13), pages(5, 4096, seed=13)
    assert b.batch_set(ks[:3], src[:3]) == [True] * 3
    assert b.batch_get(ks, empties(5, 4096)) == [True, True, True, False, False]
    assert b.batch_get(ks[1:2], empties(1, 4096)) == [True]
    assert h.corrupt(ks[2], "flip") is True
    assert b.batch_get(ks[2:3], empties(1, 4096)) == [False]
    st = b.stats()
    assert {k: st[k] for k in COUNTERS} == {"hits": 4, "misses": 3, "sets": 3, "set_failures": 0, "corrupt": 1,
                                             "errors": 0, "evictions": 0}
    b.close()
    b.close()


def test_concurrent_writers_and_readers_across_processes(make_store):
    """Two processes overwrite the same keys while a third reads them: every hit is a complete page of the
    right key (never torn or mixed), and the final pages are from the last round of some writer."""
    page_bytes = 64 * KiB
    h = make_store(page_bytes=page_bytes)
    factory = h.client_factory()
    assert factory is not None, f"{h.name}: the fixture must give a client factory for spawned processes"
    ks = keys_of(6, salt=99)
    # every key holds a complete page before the processes start, so every read of the reader must be a hit
    assert h.backend.batch_set(ks, [W.page(0, 0, i, page_bytes) for i in range(len(ks))]) == [True] * len(ks)
    rounds = 100
    ctx = mp.get_context("spawn")
    out, stop, start, read_once = ctx.Queue(), ctx.Event(), ctx.Barrier(3), ctx.Event()
    writers = [ctx.Process(target=W.writer, args=(factory, ks, w, rounds, page_bytes, start, out, read_once))
               for w in (1, 2)]
    readers = [ctx.Process(target=W.reader, args=(factory, ks, r, page_bytes, start, stop, out, read_once))
               for r in (1,)]
    procs = readers + writers
    try:
        for p in procs:
            p.start()
        results = []
        for p in writers:
            p.join(timeout=120)
            assert p.exitcode == 0, f"writer exit code {p.exitcode}"
        stop.set()
        for p in readers:
            p.join(timeout=120)
            assert p.exitcode == 0, f"reader exit code {p.exitcode}"
        while len(results) < 3:
            results.append(out.get(timeout=10))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    wr = [r for r in results if r[0] == "writer"]
    rd = [r for r in results if r[0] == "reader"]
    if h.name in MISS_WHILE_OVERWRITTEN:  # measured: 0 to 6 of 600 sets refused per writer on a loaded machine
        assert all(rounds * len(ks) * 9 // 10 <= w[2] <= rounds * len(ks) for w in wr), wr
    else:
        assert sorted(w[2] for w in wr) == [rounds * len(ks)] * 2
    for _, rid, hits, bad, passes, during, hits_during in rd:
        assert bad == 0, f"reader {rid} saw {bad} bad pages"
        # at least one whole pass ran while the writers still had rounds to write (they wait for it half way)
        assert during >= 1, f"reader {rid}: no pass while the writers were writing"
        if h.name in MISS_WHILE_OVERWRITTEN:
            assert hits_during > 0 and hits - hits_during == len(ks), (hits, hits_during, passes)
        else:  # each key always held a complete page, so every read was a hit
            assert hits == passes * len(ks), (hits, passes)
    print(f"{h.name}: reader passes {[r[4] for r in rd]} ({[r[5] for r in rd]} during the writes), "
          f"hits {[r[2] for r in rd]}")
    dst = empties(len(ks), page_bytes)
    assert h.backend.batch_get(ks, dst) == [True] * len(ks)
    for i, d in enumerate(dst):
        good, w, r = W.check(d.numpy().tobytes(), i, page_bytes)
        if getattr(h, "write_once", False):  # the first copy stays: the one set before the processes started
            assert good and (w, r) == (0, 0)
        else:
            # the last round of some writer (Mooncake: a round whose set was not refused)
            assert good and w in (1, 2) and (r == rounds - 1 or h.name in MISS_WHILE_OVERWRITTEN)


def test_faulty_wrapper_over_backend(make_store):
    """The fault wrapper works over every backend: injected failures are per key, inner results pass through."""
    from tierkv.storage_backends import FaultyBackend

    h = make_store()
    ks = keys_of(4)
    src = pages(4, 4096, seed=41)
    f = FaultyBackend(h.new_client(), fail_set_keys=[ks[2]], fail_get_keys=[ks[0]])
    assert f.batch_set(ks, src) == [True, True, False, True]
    assert f.batch_exists(ks) == 2
    dst = empties(4, 4096, fill=3)
    assert f.batch_get(ks, dst) == [False, True, False, True]
    assert bool((dst[0] == 3).all()) and torch.equal(dst[1], src[1]) and torch.equal(dst[3], src[3])
    assert f.stats()["injected_get_failures"] == 1
    f.close()



# ------------------------------------------------------------------ "checksum once": batch_set(..., checksums=...)

def sums_of(srcs) -> list[int]:
    """XXH3-64 of each page's bytes, as the L2 host pool records it when the page arrives."""
    from tierkv.storage_backends.page_format import payload_checksum

    return [payload_checksum(s.numpy() if isinstance(s, torch.Tensor) else s) for s in srcs]


def count_payload_hashes(monkeypatch, page_bytes: int) -> list[int]:
    """Count calls of ``xxhash.xxh3_64_intdigest`` on inputs of at least ``page_bytes`` bytes (payloads; the 56-byte
    header checksums are not counted). Every backend and page_format call it through the module attribute."""
    import xxhash

    real = xxhash.xxh3_64_intdigest
    calls: list[int] = []

    def counting(data, *a, **kw):
        try:
            n = memoryview(data).nbytes
        except TypeError:
            n = 0
        if n >= page_bytes:
            calls.append(n)
        return real(data, *a, **kw)

    monkeypatch.setattr(xxhash, "xxh3_64_intdigest", counting)
    return calls


@pytest.mark.parametrize("page_bytes", [4 * KiB, 256 * KiB])
def test_set_with_precomputed_checksums_round_trips(make_store, page_bytes):
    b = make_store(page_bytes=page_bytes).backend
    ks, src = keys_of(5, salt=page_bytes + 3), pages(5, page_bytes, seed=page_bytes + 3)
    assert b.batch_set(ks, src, checksums=sums_of(src)) == [True] * 5
    dst = empties(5, page_bytes)
    assert b.batch_get(ks, dst) == [True] * 5
    assert all(torch.equal(s, d) for s, d in zip(src, dst))
    # other source kinds, checksums as a numpy uint64 array (how a host pool may keep them)
    k2 = keys_of(2, salt=page_bytes + 4)
    raw = [bytes(src[0].numpy()), bytearray(src[1].numpy().tobytes())]
    assert b.batch_set(k2, raw, checksums=np.array(sums_of(raw), dtype=np.uint64)) == [True, True]
    ba = [bytearray(page_bytes), bytearray(page_bytes)]
    assert b.batch_get(k2, ba) == [True, True] and bytes(ba[0]) == raw[0] and ba[1] == raw[1]
    assert b.stats()["corrupt"] == 0


def test_set_with_checksums_does_not_hash_payloads(make_store, monkeypatch):
    page_bytes = 64 * KiB
    b = make_store(page_bytes=page_bytes).backend
    ks, src = keys_of(6, salt=61), pages(6, page_bytes, seed=61)
    sums = sums_of(src)
    calls = count_payload_hashes(monkeypatch, page_bytes)
    assert b.batch_set(ks[:3], src[:3], checksums=sums[:3]) == [True] * 3
    assert calls == [], f"{len(calls)} payload-sized XXH3 calls in a set with checksums"
    assert b.batch_set(ks[3:], src[3:]) == [True] * 3  # without: the store hashes (the counter does see it)
    assert len(calls) >= 3
    monkeypatch.undo()
    dst = empties(6, page_bytes)
    assert b.batch_get(ks, dst) == [True] * 6 and all(torch.equal(s, d) for s, d in zip(src, dst))


def test_wrong_checksum_is_a_miss_when_read(make_store):
    """A checksum that does not match the payload (caller bug, or the slot changed after it was hashed) is not
    detected by the set: the record fails verification on read, so it is a miss, never data; the key can be stored
    again."""
    page_bytes = 16 * KiB
    h = make_store(page_bytes=page_bytes)
    b = h.backend
    ks, src = keys_of(3, salt=71), pages(3, page_bytes, seed=71)
    sums = sums_of(src)
    sums[1] ^= 1 << 17
    assert b.batch_set(ks, src, checksums=sums) == [True] * 3
    before = b.stats()["corrupt"]
    dst = empties(3, page_bytes, fill=0x5A)
    assert b.batch_get(ks, dst) == [True, False, True]
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[2], src[2])  # dst[1] is not trusted (False)
    assert b.stats()["corrupt"] == before + 1
    assert b.batch_get([ks[1]], empties(1, page_bytes)) == [False]
    if getattr(h, "write_once", False):
        assert b.batch_set([ks[1]], [src[1]], checksums=sums_of(src[1:2])) == [False]  # write-once: stays a miss
        return
    assert b.batch_set([ks[1]], [src[1]], checksums=sums_of(src[1:2])) == [True]
    assert b.batch_get([ks[1]], dst[1:2]) == [True] and torch.equal(dst[1], src[1])


def test_checksums_of_wrong_length_or_type_raise_value_error(make_store):
    b = make_store().backend
    ks, src = keys_of(3, salt=81), pages(3, 4096, seed=81)
    sums = sums_of(src)
    for bad in (sums[:2], sums + [1], [], 12345, "x" * 3, [sums[0], 1.5, sums[2]], [sums[0], -1, sums[2]],
                [sums[0], 1 << 64, sums[2]]):
        with pytest.raises(ValueError):
            b.batch_set(ks, src, checksums=bad)
    assert b.batch_exists(ks) == 0  # nothing was stored by the refused sets
    assert b.stats()["set_failures"] == 0


def test_faulty_wrapper_passes_checksums_of_the_pages_it_forwards(make_store):
    from tierkv.storage_backends import FaultyBackend

    h = make_store()
    ks, src = keys_of(4, salt=91), pages(4, 4096, seed=91)
    sums = sums_of(src)
    sums[2] ^= 1  # the inner store must get the checksums re-aligned with the pages that were not failed
    f = FaultyBackend(h.new_client(), fail_set_keys=[ks[1]])
    with pytest.raises(ValueError):
        f.batch_set(ks, src, checksums=sums[:3])
    assert f.batch_set(ks, src, checksums=sums) == [True, False, True, True]
    dst = empties(4, 4096)
    assert f.batch_get(ks, dst) == [True, False, False, True]
    assert torch.equal(dst[0], src[0]) and torch.equal(dst[3], src[3])
    f.close()


# ------------------------------------------------------------------ vectored sources: a page given as its runs

def runs_of(page: torch.Tensor, cuts: list[int]) -> list[np.ndarray]:
    """``page``'s bytes split at the byte offsets ``cuts`` into numpy views (how the connector passes the runs of a
    ``layer_first`` L2 slot: one per layer)."""
    a = page.numpy()
    edges = [0, *cuts, a.nbytes]
    return [a[s:e] for s, e in zip(edges, edges[1:])]


def test_page_given_as_runs_round_trips_or_is_refused(make_store):
    """A store with ``vectored_sources`` stores a page given as a list or tuple of runs exactly as the same page
    given whole (read back bit for bit, checksums given or hashed by the store); a store without refuses runs as a
    bad buffer (ValueError), storing nothing."""
    page_bytes = 64 * KiB
    b = make_store(page_bytes=page_bytes).backend
    ks, src = keys_of(4, salt=101), pages(4, page_bytes, seed=101)
    given = [runs_of(src[0], [16 * KiB, 32 * KiB, 48 * KiB]),     # four equal runs (layers)
             (*runs_of(src[1], [1, 40 * KiB + 3])[:2], src[1][40 * KiB + 3:]),  # uneven, a 1-byte run, a tensor
             [src[2].numpy()],                                     # one run: the whole page
             src[3]]                                               # a page given whole, in the same call
    if not b.vectored_sources:
        with pytest.raises(ValueError, match=r"sources\[0\]"):
            b.batch_set(ks, given)
        assert b.batch_exists(ks) == 0
        return
    assert b.batch_set(ks[:2], given[:2]) == [True, True]  # the store hashes the runs
    assert b.batch_set(ks[2:], given[2:], checksums=sums_of(src[2:])) == [True, True]
    dst = empties(4, page_bytes)
    assert b.batch_get(ks, dst) == [True] * 4
    assert all(torch.equal(s, d) for s, d in zip(src, dst))
    assert b.stats()["corrupt"] == 0


def test_runs_not_adding_up_to_a_page_raise_value_error(make_store):
    page_bytes = 16 * KiB
    b = make_store(page_bytes=page_bytes).backend
    ks, src = keys_of(2, salt=111), pages(2, page_bytes, seed=111)
    a = src[1].numpy()
    t = src[1].view(4, -1)
    for bad in ([a[:8 * KiB]], [a[:8 * KiB], a], [], [a[::2], a[1::2]], [a[:8 * KiB], "text"], [t[:, :2048], t[:, 2048:]]):
        with pytest.raises(ValueError, match=r"sources\[1\]"):
            b.batch_set(ks, [src[0], bad])
    assert b.batch_exists(ks) == 0


# ------------------------------------------------------------------ vectored destinations, verified checksums

def test_page_read_into_runs_is_the_page_or_is_refused(make_store):
    """Every store reads a page into a list or tuple of writable runs (``vectored_destinations``) exactly as into
    one buffer (four equal runs, uneven runs with a 1-byte run and a tensor run, one run, and a whole page in the
    same call); a read-only run or runs not adding up to a page are refused (ValueError), and a miss leaves its runs
    untouched."""
    page_bytes = 64 * KiB
    b = make_store(page_bytes=page_bytes).backend
    ks, src = keys_of(5, salt=121), pages(5, page_bytes, seed=121)
    assert b.batch_set(ks[:4], src[:4]) == [True] * 4
    dst = empties(5, page_bytes)
    for d in dst:
        d.fill_(7)
    given = [runs_of(dst[0], [16 * KiB, 32 * KiB, 48 * KiB]),
             (*runs_of(dst[1], [1, 40 * KiB + 3])[:2], dst[1][40 * KiB + 3:]),
             [dst[2].numpy()],
             dst[3],
             runs_of(dst[4], [32 * KiB])]                      # never stored: a miss
    ro = dst[0].numpy().copy()
    ro.flags.writeable = False
    with pytest.raises(ValueError, match=r"destinations\[1\]"):
        b.batch_get(ks[:2], [dst[0], [ro[:32 * KiB], ro[32 * KiB:]]])
    assert b.vectored_destinations is True and b.verified_checksums is True  # every store: the connector's readers
    assert b.batch_get(ks, given) == [True, True, True, True, False]
    assert all(torch.equal(s, d) for s, d in zip(src[:4], dst[:4]))
    assert bool((dst[4] == 7).all())
    assert b.stats()["corrupt"] == 0
    with pytest.raises(ValueError, match=r"destinations\[1\]"):
        b.batch_get(ks[:2], [dst[0], [dst[1].numpy()[:8 * KiB]]])


def test_a_corrupt_page_read_into_runs_is_a_miss(make_store):
    b_h = make_store(page_bytes=16 * KiB)
    b = b_h.backend
    assert b.vectored_destinations is True
    ks, src = keys_of(2, salt=131), pages(2, 16 * KiB, seed=131)
    assert b.batch_set(ks, src) == [True, True]
    assert b_h.corrupt(ks[1], "flip") is True
    dst = empties(2, 16 * KiB)
    assert b.batch_get(ks, [runs_of(d, [4 * KiB, 8 * KiB]) for d in dst]) == [True, False]
    assert torch.equal(dst[0], src[0]) and b.stats()["corrupt"] == 1


def test_verified_checksums_are_the_pages_checksums_and_none_for_misses(make_store):
    """``batch_get(..., checksums=out)`` (every store: ``verified_checksums``) fills ``out`` with each hit's XXH3-64
    (what the page read hashes to) and None for a miss; a list of the wrong length raises ValueError. Through the
    fault injector the same, with None for the pages it failed."""
    page_bytes = 16 * KiB
    h = make_store(page_bytes=page_bytes)
    b = h.backend
    assert b.verified_checksums is True
    ks, src = keys_of(3, salt=141), pages(3, page_bytes, seed=141)
    assert b.batch_set(ks[:2], src[:2]) == [True, True]
    out = ["junk"] * 3
    dst = empties(3, page_bytes)
    assert b.batch_get(ks, dst, checksums=out) == [True, True, False]
    assert out == [*sums_of(src[:2]), None]
    with pytest.raises(ValueError, match="checksums"):
        b.batch_get(ks, dst, checksums=[None])
    from tierkv.storage_backends.faulty import FaultyBackend
    f = FaultyBackend(b, fail_get_keys=[ks[0]])
    assert f.verified_checksums is True and f.vectored_destinations is True
    out = ["junk"] * 3
    assert f.batch_get(ks, empties(3, page_bytes), checksums=out) == [False, True, False]
    assert out == [None, sums_of(src[1:2])[0], None]
