"""File store across restarts: index rebuilt and torn files dropped, with exact counts, LRU order that survives a
restart, start-up header verification."""
from __future__ import annotations

import dataclasses
import hashlib
import multiprocessing as mp
import os
import random
import signal

import torch

from tests.helpers.fixtures_file import crash_during_write
from tests.helpers.namespace import make_namespace
from tierkv.connector.core.page_hash import ModelNamespace, key_hex, page_keys, request_root
from tierkv.storage_backends.file.store import FileStore
from tierkv.storage_backends.page_format import HEADER_BYTES

_RK = random.Random(0x4e57)  # fixed: the same keys in every run (a failure reproduces)

P = 4
NS = make_namespace(model_id="tiny-llama", kv_layout="layer_first", page_size=P)
PAGE_BYTES = 2 * NS.num_layers * P * NS.num_kv_heads * NS.head_dim * 2  # K and V, bf16: 512 bytes
REC = HEADER_BYTES + PAGE_BYTES


def prompt_tokens(j: int) -> list[int]:
    return list(range(1000 * (j + 1) + 1, 1000 * (j + 1) + 4 * P + 1))  # 4 pages


def fingerprint(ns: ModelNamespace, tokens: list[int], page: int) -> torch.Tensor:
    """Bytes of page ``page``: a function of the namespace and the whole token prefix up to the page's end."""
    prefix = b"".join(t.to_bytes(8, "little") for t in tokens[: (page + 1) * P])
    raw = hashlib.shake_256(ns.digest() + prefix).digest(PAGE_BYTES)
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


def prompt_keys(ns: ModelNamespace, j: int) -> list[str]:
    return key_hex(page_keys(request_root(ns.digest()), prompt_tokens(j), P))


def page_files(root: str) -> list[str]:
    out = []
    for d, _, files in os.walk(root):
        out += [os.path.join(d, f) for f in files]
    return out


def test_restart_rebuilds_index_drops_torn_files(tmp_path):
    root = str(tmp_path / "l3")
    cap = 32 * REC
    keys = [prompt_keys(NS, j) for j in range(5)]
    flat_keys = [k for ks in keys for k in ks]
    flat_pages = [fingerprint(NS, prompt_tokens(j), i) for j in range(5) for i in range(4)]
    extra_key = prompt_keys(NS, 5)[0]

    # 1-2. process 1 stores 20 pages and is SIGKILLed while writing a 21st
    ctx = mp.get_context("spawn")
    started = ctx.Event()
    p = ctx.Process(target=crash_during_write, args=(root, NS.digest(), PAGE_BYTES, cap, flat_keys,
                                                     [bytes(t.numpy()) for t in flat_pages], extra_key, started))
    p.start()
    try:
        assert started.wait(timeout=120), "writer never reached the 21st page"
        os.kill(p.pid, signal.SIGKILL)
        p.join(timeout=30)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
    assert p.exitcode == -signal.SIGKILL
    temps = [f for f in page_files(root) if os.path.basename(f).startswith(".tmp.")]
    assert len(temps) == 1 and os.path.getsize(temps[0]) == HEADER_BYTES + PAGE_BYTES // 2
    store_path = lambda k: os.path.join(root, NS.digest().hex(), k[:2], k + ".page")  # noqa: E731
    assert not os.path.exists(store_path(extra_key))
    os.truncate(store_path(keys[0][3]), REC // 2)
    with open(store_path(keys[1][3]), "ab") as f:
        f.write(b"junk" * 8)

    # 3. process 2 on the same directory
    s = FileStore(NS.digest(), PAGE_BYTES, root=root, capacity_bytes=cap)
    st = s.stats()
    assert st["usage_pages"] == 18 and st["usage_bytes"] == 18 * REC
    assert st["temp_removed"] == 1 and st["quarantined"] == 2
    assert not [f for f in page_files(root) if os.path.basename(f).startswith(".tmp.")]
    assert [s.batch_exists(ks) for ks in keys] == [3, 3, 4, 4, 4]
    hits = 0
    for j, ks in enumerate(keys):
        dst = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in ks]
        res = s.batch_get(ks, dst)
        assert res == ([True] * 3 + [False] if j < 2 else [True] * 4)
        for i, (r, d) in enumerate(zip(res, dst)):
            if r:
                assert torch.equal(d, fingerprint(NS, prompt_tokens(j), i))
                hits += 1
    assert hits == 18
    assert s.stats()["corrupt"] == 0  # the bad files were gone before any read

    # 4. 20 more pages: usage stays <= 32 by evicting the least recently used (prompts 1 and 2, read first)
    more = [prompt_keys(NS, j) for j in range(5, 10)]
    for j, ks in zip(range(5, 10), more):
        assert s.batch_set(ks, [fingerprint(NS, prompt_tokens(j), i) for i in range(4)]) == [True] * 4
        assert s.stats()["usage_pages"] <= 32
    assert s.stats()["usage_pages"] == 32
    assert len([f for f in page_files(root) if f.endswith(".page")]) == 32
    assert [s.batch_exists(ks) for ks in keys] == [0, 0, 4, 4, 4]
    assert [s.batch_exists(ks) for ks in more] == [4] * 5
    s.close()

    # 5. restart with another dtype: nothing of the bf16 run is served
    ns8 = dataclasses.replace(NS, dtype="fp8_e4m3")
    s8 = FileStore(ns8.digest(), PAGE_BYTES, root=root, capacity_bytes=cap)
    assert [s8.batch_exists(prompt_keys(ns8, j)) for j in range(10)] == [0] * 10
    assert [s8.batch_exists(ks) for ks in keys + more] == [0] * 10  # even the very same key text
    dst = [torch.zeros(PAGE_BYTES, dtype=torch.uint8) for _ in range(4)]
    assert s8.batch_get(more[0], dst) == [False] * 4
    s8.close()
    # and the bf16 pages are still there for a bf16 engine
    s2 = FileStore(NS.digest(), PAGE_BYTES, root=root, capacity_bytes=cap)
    assert [s2.batch_exists(ks) for ks in more] == [4] * 5


def test_lru_order_survives_restart(tmp_path):
    root = str(tmp_path / "l3")
    ns = bytes(range(16))
    ks = [_RK.randbytes(16).hex() for _ in range(12)]
    src = [torch.full((PAGE_BYTES,), i, dtype=torch.uint8) for i in range(12)]
    s = FileStore(ns, PAGE_BYTES, root=root, capacity_bytes=8 * REC)
    assert s.batch_set(ks[:8], src[:8]) == [True] * 8
    # read in reverse, so the recency order is the opposite of the write order
    for i in reversed(range(4)):
        assert s.batch_get([ks[i]], [torch.empty(PAGE_BYTES, dtype=torch.uint8)]) == [True]
    s.close()
    s = FileStore(ns, PAGE_BYTES, root=root, capacity_bytes=8 * REC)
    assert s.usage()["pages"] == 8
    for n in range(4):  # each new page evicts exactly the least recently used one: 4, 5, 6, 7, in order
        assert s.batch_set([ks[8 + n]], [src[8 + n]]) == [True]
        assert [s.exists(k) for k in ks[4:8]] == [i > n for i in range(4)]
    # pages read before the restart survived, in their recency order 3, 2, 1, 0 (0 most recent)
    assert s.batch_set([_RK.randbytes(16).hex()], [src[0]]) == [True]
    assert [s.exists(k) for k in ks[:4]] == [True, True, True, False]


def test_scan_verify_header_quarantines_bad_headers(tmp_path):
    root = str(tmp_path / "l3")
    ns = bytes(range(16))
    ks = [_RK.randbytes(16).hex() for _ in range(3)]
    s = FileStore(ns, PAGE_BYTES, root=root)
    assert s.batch_set(ks, [torch.zeros(PAGE_BYTES, dtype=torch.uint8)] * 3) == [True] * 3
    p = os.path.join(root, ns.hex(), ks[1][:2], ks[1] + ".page")
    with open(p, "r+b") as f:
        f.seek(10)
        f.write(b"\xff")  # inside the namespace field: header checksum fails, size unchanged
    assert FileStore(ns, PAGE_BYTES, root=root, scan_verify="size").usage()["pages"] == 3  # size looks right
    s2 = FileStore(ns, PAGE_BYTES, root=root, scan_verify="header")
    assert s2.usage()["pages"] == 2 and s2.stats()["quarantined"] == 1
    assert s2.batch_exists(ks) == 1 and os.listdir(os.path.join(root, "quarantine"))


def test_background_scan_serves_while_it_scans_and_indexes_everything(tmp_path):
    """``background_scan``: the constructor returns before the scan of a directory of 20,000 records ends; reads,
    existence and writes work meanwhile; afterwards every record (and the new one) is in the index."""
    import numpy as np

    from tierkv.storage_backends.file.store import FileStore

    pb, n = 256, 20_000
    ns = bytes(range(16))
    keys = [f"{i:032x}" for i in range(n + 1)]
    page = np.frombuffer(np.random.default_rng(3).bytes(pb), dtype=np.uint8)
    s = FileStore(ns, pb, root=str(tmp_path), capacity_bytes=1 << 30)
    for i in range(0, n, 2000):
        assert all(s.batch_set(keys[i:i + 2000], [page] * 2000))
    s.close()
    s = FileStore(ns, pb, root=str(tmp_path), capacity_bytes=1 << 30, background_scan=True)
    try:
        running = not s.wait_scan(0)
        buf = np.zeros(pb, dtype=np.uint8)
        assert s.batch_get([keys[n - 1]], [buf]) == [True] and np.array_equal(buf, page)
        assert s.batch_exists(keys[:3]) == 3 and s.batch_set([keys[n]], [page]) == [True]
        assert s.wait_scan(120)
        st = s.stats()
        assert running, "the scan of 20,000 records ended before the constructor returned"
        assert st["scan_files"] >= n and len(s._index) == n + 1 and s._usage == (n + 1) * (pb + 64)
    finally:
        s.close()
