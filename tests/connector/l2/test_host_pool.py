"""HostPool layouts and SlotAllocator: round trips L1 -> L2 -> (L3 page bytes) -> L2 -> L1 for every host layout and
every device layout, semantic content against a reference, page bytes API, errors."""
import random
import zlib

import numpy as np
import pytest
import torch
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from tierkv.connector.l2.device_pool import DevicePool
from tierkv.connector.l2.host_pool import HOST_POOL_LAYOUTS, HostPool
from tierkv.connector.l2.slot_allocator import SlotAllocator
from tierkv.connector.core.page_hash import ModelNamespace
from tierkv.kernels import load_pages, save_pages
from tierkv.kernels.testing import (DEVICE_LAYOUTS, block_bytes_reference, encode_semantic, make_kv_caches,
                                    random_semantic)


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _dev(name, ratio=1, **kw):
    kv, storage, spec = make_kv_caches(name, num_layers=3, num_blocks=10, block_size=32,
                                       kernel_block_size=32 // ratio, num_kv_heads=2, head_dim=8, **kw)
    sem = random_semantic(spec)
    encode_semantic(kv, spec, sem)
    dev = DevicePool.from_vllm(kv, num_blocks=spec.num_blocks, block_size=spec.block_size,
                               kv_cache_layout=spec.kv_cache_layout, backend=spec.backend, use_mla=spec.use_mla)
    return dev, storage, spec, sem, kv


# ---------------------------------------------------------------- SlotAllocator
def test_allocator_all_or_nothing_and_ascending():
    a = SlotAllocator(5)
    assert a.alloc(3) == [0, 1, 2]
    assert a.num_free == 2 and a.num_used == 3
    assert a.alloc(3) is None and a.num_free == 2  # nothing taken
    assert a.alloc(0) == []
    a.free([1])
    assert a.alloc(3) == [1, 3, 4]
    assert a.num_free == 0 and a.alloc(1) is None


def test_allocator_errors_leave_state_unchanged():
    a = SlotAllocator(4)
    got = a.alloc(2)
    with pytest.raises(ValueError, match="out of range"):
        a.free([0, 4])
    with pytest.raises(ValueError, match="double free"):
        a.free([0, 0])
    with pytest.raises(ValueError, match="double free"):
        a.free([3])
    assert a.num_used == 2 and all(a.is_allocated(s) for s in got)
    with pytest.raises(ValueError):
        SlotAllocator(0)
    with pytest.raises(ValueError):
        a.alloc(-1)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 6)), max_size=40))
def test_allocator_never_hands_out_a_slot_twice(ops):
    a = SlotAllocator(10)
    held: list[int] = []
    for do_alloc, n in ops:
        if do_alloc:
            got = a.alloc(n)
            if n > 10 - len(held):
                assert got is None
            else:
                assert len(got) == n and not set(got) & set(held)
                held += got
        elif held:
            k = min(n, len(held))
            a.free(held[:k])
            held = held[k:]
        assert a.num_used == len(held) and a.num_free == 10 - len(held)


# ---------------------------------------------------------------- HostPool basics
def test_constructor_errors():
    with pytest.raises(ValueError, match="layout"):
        HostPool(4, 2, 64, layout="page_head")
    with pytest.raises(ValueError, match="geometry"):
        HostPool(4, 2, 64, layout="page_first")
    with pytest.raises(ValueError, match="num_slots"):
        HostPool(0, 2, 64)
    dev, *_ = _dev("cpu")
    with pytest.raises(ValueError, match="bytes per block"):
        HostPool(4, 3, dev.block_bytes + 2, layout="page_first", geometry=dev.geometry)


@pytest.mark.parametrize("layout", HOST_POOL_LAYOUTS)
@pytest.mark.parametrize("name", ["cpu", "mla"])
def test_page_bytes_api(layout, name):
    dev, *_ = _dev(name)
    hp = HostPool.for_device(dev, 4, layout)
    assert hp.page_bytes == 3 * dev.block_bytes
    g = torch.Generator().manual_seed(3)
    data = torch.randint(0, 256, (hp.page_bytes,), dtype=torch.uint8, generator=g)
    hp.write_page(2, data)
    got = hp.read_page(2)
    assert torch.equal(got, data)
    assert hp.page_checksum(2) == xxhash.xxh3_64_intdigest(data.numpy().tobytes())
    assert torch.equal(torch.cat(hp.page_views(2)), data)
    out = torch.empty(hp.page_bytes, dtype=torch.uint8)
    assert hp.read_page(2, out=out) is out and torch.equal(out, data)
    # zero-copy only where the page is one run: MLA in the semantic layouts
    zero_copy = name == "mla" and layout != "layer_first"
    assert (got.data_ptr() == hp.page_views(2)[0].data_ptr()) == zero_copy
    # bytes / numpy sources, and errors
    hp.write_page(1, bytes(data.numpy()))
    assert torch.equal(hp.read_page(1), data)
    hp.write_page(0, data.numpy())
    assert torch.equal(hp.read_page(0), data)
    with pytest.raises(ValueError, match="bytes"):
        hp.write_page(0, data[:-1])
    with pytest.raises(ValueError, match="out of range"):
        hp.read_page(4)
    with pytest.raises(ValueError, match="out must"):
        hp.read_page(0, out=torch.empty(3, dtype=torch.uint8))
    with pytest.raises(TypeError):
        hp.write_page(0, [1, 2, 3])


def test_page_copies_from_an_io_thread_start_no_openmp_team():
    """L3 backups and prefetches call read_page / write_page on tierkv's I/O threads. torch's copy_ of a strided
    64 KiB page runs an OpenMP parallel region, and the first one on a new thread starts a team of OpenMP threads
    for it (3 more threads here), which spin on the cores of the engine's forward. The copies are numpy's: the
    thread count stays where it was."""
    import os
    import threading
    saved = torch.get_num_threads()
    torch.set_num_threads(2)        # a parallel copy_ needs two threads; restored below
    try:
        hp = HostPool(4, 8, 8192)   # layer_first: 8 runs of 8 KiB per page, 64 KiB
        data = torch.randint(0, 256, (hp.page_bytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
        got, during = [], set()

        def io():  # only the pool's calls on the I/O thread (any torch op there may start a team)
            for _ in range(20):
                hp.write_page(1, data)
                got.append(hp.read_page(1, out=torch.empty(hp.page_bytes, dtype=torch.uint8)))
            during.update(os.listdir("/proc/self/task"))  # a team lives as long as its thread: count it now

        before = set(os.listdir("/proc/self/task"))
        t = threading.Thread(target=io)
        t.start()
        t.join()
        assert during == before | {str(t.native_id)}
        assert len(got) == 20 and all(torch.equal(g, data) for g in got)
    finally:
        torch.set_num_threads(saved)


_FAULTS_SCRIPT = r"""
import resource, sys
import numpy as np, torch
from tierkv.connector.l2.host_pool import HostPool

def faults_writing(buf, page):
    a = buf.numpy()
    f0 = resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
    for i in range(a.size // page.size):
        a[i * page.size:(i + 1) * page.size] = page
    return resource.getrusage(resource.RUSAGE_THREAD).ru_minflt - f0

prefault = sys.argv[1] == "1"
hp = HostPool(96, 8, 65536, prefault=prefault)         # 96 pages of 512 KiB: 48 MiB, 12,288 pages of 4 KiB
page = np.full(hp.page_bytes, 7, dtype=np.uint8)
n = faults_writing(hp.buffer, page)
assert bool((hp.buffer == 7).all())
print(n, hp.nbytes)
"""


def test_the_pool_is_mapped_at_allocation_so_a_first_save_takes_no_page_faults():
    """Writing every slot of a new pool takes (almost) no minor page faults on the writing thread: the pool mapped
    its memory when it was built. The same writes into a pool built with ``prefault=False`` fault once per 4 KiB
    page (the reference, measured here). Each pool is built in a new process: in this one, the allocator may hand
    out memory an earlier test already touched, which takes no fault either way."""
    import subprocess
    import sys

    def faults(prefault: bool) -> tuple[int, int]:
        r = subprocess.run([sys.executable, "-c", _FAULTS_SCRIPT, "1" if prefault else "0"], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        n, nbytes = r.stdout.split()
        return int(n), int(nbytes)

    reference, nbytes = faults(prefault=False)
    pool, _ = faults(prefault=True)
    assert reference >= nbytes // 4096 // 2, reference       # first touch faults (unless the kernel used huge pages)
    assert pool <= 16, (pool, reference)


def test_kv_layout_names_distinguish_layouts_in_the_namespace():
    names = set()
    for dname in ("cpu", "flashinfer_hnd", "flash_attn_nhd", "mla"):
        dev, *_ = _dev(dname)
        for layout in HOST_POOL_LAYOUTS:
            names.add(HostPool.for_device(dev, 2, layout).kv_layout)
    assert len(names) == 12
    digests = {ModelNamespace("m", "bfloat16", n, 32, 3, 2, 8).digest() for n in names}
    assert len(digests) == 12


# ---------------------------------------------------------------- round trips, every host x device layout
RT_CASES = [(d, layout, ratio) for d in DEVICE_LAYOUTS for layout in HOST_POOL_LAYOUTS
            for ratio in (1, 2) if not (ratio == 2 and ("bl" in d or layout == "layer_first"))]


@pytest.mark.parametrize("impl", ["numba", "torch"])
@pytest.mark.parametrize("dname,layout,ratio", RT_CASES)
def test_round_trip_through_page_bytes(dname, layout, ratio, impl):
    dev, storage, spec, sem, kv = _dev(dname, ratio)
    rng = random.Random(zlib.crc32(repr((dname, layout, ratio)).encode()))  # stable seed
    blocks = rng.sample(range(10), 6)
    slots = rng.sample(range(8), 6)
    hp = HostPool.for_device(dev, 8, layout)
    hp.buffer.fill_(0xAB)
    save_pages(dev, hp, blocks, slots, impl=impl)
    # L2 content against the reference: semantic token-major K/V, or the device block's bytes
    for b, s in zip(blocks, slots):
        if layout == "layer_first":
            for l in range(3):
                assert torch.equal(hp.layer_view()[l, s], block_bytes_reference(kv, spec, l, b))
        else:
            for part in dev.parts():
                assert torch.equal(_bits(hp.slot_view(part)[s]), _bits(sem[part][:, b]))
    # L2 -> L3 bytes -> a fresh L2 -> L1 (zeroed)
    stored = {s: bytes(hp.read_page(s).numpy()) for s in slots}
    hp2 = HostPool.for_device(dev, 8, layout)
    new_slots = rng.sample(range(8), 6)
    for s, ns in zip(slots, new_slots):
        hp2.write_page(ns, stored[s])
        assert hp2.page_checksum(ns) == hp.page_checksum(s)
    want = {(l, b): block_bytes_reference(kv, spec, l, b).clone() for l in range(3) for b in range(10)}
    before = storage.clone()
    pad = 256
    storage[pad:].zero_()
    load_pages(hp2, dev, new_slots, blocks, impl=impl)
    for l in range(3):
        for b in range(10):
            got = block_bytes_reference(kv, spec, l, b)
            if b in blocks:
                assert torch.equal(got, want[l, b]), (l, b)  # restored bit-exactly
            else:
                assert not got.any(), (l, b)  # blocks not loaded stay untouched (zero)
    assert torch.equal(storage[:pad], before[:pad])  # nothing outside the views touched


@pytest.mark.parametrize("layout", HOST_POOL_LAYOUTS)
@pytest.mark.parametrize("dname", ["cpu", "flashinfer_blhnc", "mla"])
def test_layer_subset_moves_only_those_layers(layout, dname):
    dev, storage, spec, sem, kv = _dev(dname)
    hp = HostPool.for_device(dev, 4, layout)
    hp.buffer.zero_()
    save_pages(dev, hp, [3, 4], [1, 2], layers=[2, 0])
    full = HostPool.for_device(dev, 4, layout)
    full.buffer.zero_()
    save_pages(dev, full, [3, 4], [1, 2])
    for s in (1, 2):
        for l in range(3):
            if layout == "layer_first":
                got, want = hp.layer_view()[l, s], full.layer_view()[l, s]
            else:
                got = torch.cat([_bits(hp.slot_view(p)[s, l]).reshape(-1) for p in dev.parts()])
                want = torch.cat([_bits(full.slot_view(p)[s, l]).reshape(-1) for p in dev.parts()])
            if l == 1:
                assert not got.any()
            else:
                assert torch.equal(got, want)
    # load only layer 1 back over a zeroed device: other layers stay zero
    storage[256:].zero_()
    load_pages(full, dev, [1, 2], [3, 4], layers=[1])
    for l in range(3):
        for b in (3, 4):
            got = block_bytes_reference(kv, spec, l, b)
            assert bool(got.any()) == (l == 1)


def test_float32_and_fp16_dtypes_round_trip():
    for dtype in (torch.float32, torch.float16):
        kv, storage, spec = make_kv_caches("flashinfer_hnd", num_blocks=4, dtype=dtype)
        dev = DevicePool.from_vllm(kv, num_blocks=4, block_size=32, backend="FLASHINFER", kv_cache_layout="HND")
        for layout in HOST_POOL_LAYOUTS:
            hp = HostPool.for_device(dev, 4, layout)
            save_pages(dev, hp, [0, 1, 2, 3], [3, 2, 1, 0])
            before = storage.clone()
            storage[256:].zero_()
            load_pages(hp, dev, [3, 2, 1, 0], [0, 1, 2, 3])
            assert torch.equal(storage, before)


def test_page_checksums_survive_np_and_bytes_paths():
    dev, *_ = _dev("cpu")
    hp = HostPool.for_device(dev, 3, "page_first")
    save_pages(dev, hp, [1, 2, 3], [0, 1, 2])
    for s in range(3):
        raw = np.frombuffer(bytes(hp.read_page(s).numpy()), dtype=np.uint8)
        assert xxhash.xxh3_64_intdigest(raw.tobytes()) == hp.page_checksum(s)
