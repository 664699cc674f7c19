"""numba CPU kernels (``kernels/numba_impl.py``): byte-for-byte against the reference gather/scatter of
``kernels/testing.py`` and against the torch implementation, for every device layout (CPU backend, FlashAttention /
FlashInfer NHD and HND, block-outermost, MLA), every host layout, both directions, runs and scattered ids, layer
subsets, the register-transpose, wide-transpose and element-loop paths, misaligned storages (non-temporal head/tail
handling), ordinary and non-temporal stores; bad input raises before any byte moves; the dispatcher falls back to
torch without numba."""
import random
import zlib

import pytest
import torch

import tierkv.kernels as kernels
from tierkv.connector.l2.device_pool import DevicePool
from tierkv.connector.l2.host_pool import HOST_POOL_LAYOUTS, HostPool
from tierkv.kernels import load_pages, numba_impl, save_pages, torch_impl
from tierkv.kernels.testing import (DEVICE_LAYOUTS, block_bytes_reference, encode_semantic, make_kv_caches,
                                    random_semantic)

def test_numba_is_installed():
    """numba is a dependency of the CPU build (``make venv`` installs it): without it every test below fails, never
    skips, and this one says why."""
    assert numba_impl.available(), "numba is not importable: install the cpu extra (make venv)"


def _dev(name, *, ratio=1, head_dim=16, num_kv_heads=2, dtype=torch.bfloat16, pad_bytes=256, num_layers=3,
         num_blocks=10, seed=0):
    kv, storage, spec = make_kv_caches(name, num_layers=num_layers, num_blocks=num_blocks, block_size=32,
                                       kernel_block_size=32 // ratio, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                       dtype=dtype, pad_bytes=pad_bytes, seed=seed)
    sem = random_semantic(spec, seed=seed + 1)
    encode_semantic(kv, spec, sem)
    dev = DevicePool.from_vllm(kv, num_blocks=num_blocks, block_size=32, kv_cache_layout=spec.kv_cache_layout,
                               backend=spec.backend, use_mla=spec.use_mla)
    return dev, storage, spec, sem, kv


def _bits(t):
    return t.contiguous().view(torch.uint8)


def _check_host(dev, hp, kv, spec, sem, blocks, slots, layers):
    """Host pool content against the reference: opaque block bytes or semantic token-major K/V."""
    ls = range(spec.num_layers) if layers is None else layers
    for b, s in zip(blocks, slots):
        for l in ls:
            if hp.layout == "layer_first":
                assert torch.equal(hp.layer_view()[l, s], block_bytes_reference(kv, spec, l, b)), (l, b, s)
            else:
                for part in dev.parts():
                    assert torch.equal(_bits(hp.slot_view(part)[s, l]), _bits(sem[part][l, b])), (part, l, b, s)


# device layout x kernel-block ratio x head dim: head_dim 16 takes the 16x16 register transposes on the CPU layout,
# 32 the wide (whole-line) ones in both directions, 12 the element loop
CASES = [(d, r, hd) for d in DEVICE_LAYOUTS for r in (1, 2) for hd in (12, 16, 32)
         if not (r == 2 and d.startswith(("flashinfer_bl", "flash_attn_bl")))]


@pytest.mark.parametrize("layout", HOST_POOL_LAYOUTS)
@pytest.mark.parametrize("dname,ratio,head_dim", CASES)
def test_save_and_load_match_reference_and_torch(dname, ratio, head_dim, layout):
    dev, storage, spec, sem, kv = _dev(dname, ratio=ratio, head_dim=head_dim)
    rng = random.Random(zlib.crc32(repr((dname, ratio, head_dim, layout)).encode()))  # stable seed
    for pattern in ("run", "scattered"):
        for layers in (None, [2, 0]):
            if pattern == "run":
                b0 = rng.randrange(0, 5)
                blocks, slots = list(range(b0, b0 + 5)), list(range(1, 6))
            else:
                blocks, slots = rng.sample(range(10), 5), rng.sample(range(7), 5)
            got = HostPool.for_device(dev, 7, layout)
            ref = HostPool.for_device(dev, 7, layout)
            got.buffer.fill_(0x5A)
            ref.buffer.fill_(0x5A)
            save_pages(dev, got, blocks, slots, layers, impl="numba")
            save_pages(dev, ref, blocks, slots, layers, impl="torch")
            _check_host(dev, got, kv, spec, sem, blocks, slots, layers)
            assert torch.equal(got.buffer, ref.buffer)  # incl. untouched slots and layers
            # load into a zeroed device: exactly the selected (layer, block) bytes come back
            want = {(l, b): block_bytes_reference(kv, spec, l, b).clone() for l in range(3) for b in range(10)}
            before = storage.clone()
            storage[256:].zero_()
            load_pages(got, dev, slots, blocks, layers, impl="numba")
            numba_bytes = storage.clone()
            for l in range(3):
                for b in range(10):
                    moved = b in blocks and (layers is None or l in layers)
                    cur = block_bytes_reference(kv, spec, l, b)
                    assert torch.equal(cur, want[l, b]) if moved else not cur.any(), (l, b, moved)
            storage[256:].zero_()
            load_pages(ref, dev, slots, blocks, layers, impl="torch")
            assert torch.equal(numba_bytes, storage)
            assert torch.equal(storage[:256], before[:256])
            storage.copy_(before)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.float8_e4m3fn])
@pytest.mark.parametrize("dname", ["cpu", "flash_attn_nhd", "mla"])
def test_other_dtypes_take_the_element_paths_and_match_torch(dtype, dname):
    dev, storage, spec, sem, kv = _dev(dname, dtype=dtype, head_dim=16)
    blocks, slots = [7, 2, 5], [0, 3, 1]
    for layout in HOST_POOL_LAYOUTS:
        a, b = HostPool.for_device(dev, 4, layout), HostPool.for_device(dev, 4, layout)
        a.buffer.zero_()
        b.buffer.zero_()
        save_pages(dev, a, blocks, slots, impl="numba")
        save_pages(dev, b, blocks, slots, impl="torch")
        assert torch.equal(a.buffer, b.buffer), layout
        before = storage.clone()
        storage[256:].zero_()
        load_pages(a, dev, slots, blocks, impl="numba")
        got = storage.clone()
        storage[256:].zero_()
        load_pages(b, dev, slots, blocks, impl="torch")
        assert torch.equal(got, storage), layout
        storage.copy_(before)


@pytest.mark.parametrize("nontemporal", [True, False])
@pytest.mark.parametrize("pad_bytes", [2, 34, 256])
@pytest.mark.parametrize("dname", ["cpu", "flash_attn_nhd", "flashinfer_hnd"])
def test_misaligned_storage_and_store_kinds(dname, pad_bytes, nontemporal, monkeypatch):
    """A device storage that starts 2 or 34 bytes off a 32-byte boundary: rows get unaligned heads/tails and
    transposes fall back to ordinary stores; results stay byte-identical."""
    monkeypatch.setattr(numba_impl, "NONTEMPORAL", nontemporal)
    dev, storage, spec, sem, kv = _dev(dname, pad_bytes=pad_bytes, head_dim=32, num_kv_heads=3)
    blocks, slots = [9, 0, 4, 5], [2, 0, 3, 1]
    for layout in HOST_POOL_LAYOUTS:
        hp = HostPool.for_device(dev, 4, layout)
        hp.buffer.fill_(1)
        save_pages(dev, hp, blocks, slots, impl="numba")
        _check_host(dev, hp, kv, spec, sem, blocks, slots, None)
        want = {(l, b): block_bytes_reference(kv, spec, l, b).clone() for l in range(3) for b in blocks}
        before = storage.clone()
        storage[pad_bytes:].zero_()
        load_pages(hp, dev, slots, blocks, impl="numba")
        for (l, b), w in want.items():
            assert torch.equal(block_bytes_reference(kv, spec, l, b), w), (layout, l, b)
        assert int(storage.ne(0).sum()) == sum(int(w.ne(0).sum()) for w in want.values()) + int(
            storage[:pad_bytes].ne(0).sum())  # nothing else written
        storage.copy_(before)


def test_large_batch_against_torch_with_many_pages():
    """Enough pages that the unit tables and pair sorting matter (the benchmark's geometry, fewer layers)."""
    dev, storage, spec, sem, kv = _dev("cpu", head_dim=64, num_kv_heads=4, num_layers=2, num_blocks=96)
    rng = random.Random(3)
    blocks = rng.sample(range(96), 64)
    slots = rng.sample(range(80), 64)
    for layout in HOST_POOL_LAYOUTS:
        a, b = HostPool.for_device(dev, 80, layout), HostPool.for_device(dev, 80, layout)
        a.buffer.zero_()
        b.buffer.zero_()
        save_pages(dev, a, blocks, slots, impl="numba")
        save_pages(dev, b, blocks, slots, impl="torch")
        assert torch.equal(a.buffer, b.buffer)
        _check_host(dev, a, kv, spec, sem, blocks[:4], slots[:4], None)


def test_separate_layer_storages_are_moved_per_storage():
    """Layers that are not views of one storage (no all-layer views) still move correctly."""
    kv, storage, spec = make_kv_caches("cpu", num_layers=2, num_blocks=6, head_dim=16)
    kv = {k: v.clone() for k, v in kv.items()}  # one storage per layer
    dev = DevicePool.from_vllm(kv, num_blocks=6, block_size=32)
    assert not dev.has_all_layer_views
    for layout in HOST_POOL_LAYOUTS:
        a, b = HostPool.for_device(dev, 3, layout), HostPool.for_device(dev, 3, layout)
        a.buffer.zero_()
        b.buffer.zero_()
        save_pages(dev, a, [5, 1, 2], [0, 2, 1], impl="numba")
        save_pages(dev, b, [5, 1, 2], [0, 2, 1], impl="torch")
        assert torch.equal(a.buffer, b.buffer)
        saved = {k: v.clone() for k, v in kv.items()}
        for v in kv.values():
            v.zero_()
        load_pages(a, dev, [0, 2, 1], [5, 1, 2], impl="numba")
        for k, v in kv.items():
            assert torch.equal(_bits(v[[5, 1, 2]]), _bits(saved[k][[5, 1, 2]]))
            assert not v[[0, 3, 4]].any()


BAD = [
    (dict(block_ids=[0, 10], slots=[0, 1]), "block id 10 out of range"),
    (dict(block_ids=[0, 1], slots=[0, 0]), "slot 0 given twice"),
    (dict(block_ids=[0], slots=[0], layers=[3]), "layer 3 out of range"),
    (dict(block_ids=[0, 1], slots=[0]), "one slot per block"),
]


@pytest.mark.parametrize("layout", HOST_POOL_LAYOUTS)
@pytest.mark.parametrize("args,match", BAD)
def test_bad_arguments_raise_before_any_byte_moves(layout, args, match):
    dev, storage, *_ = _dev("cpu")
    hp = HostPool.for_device(dev, 4, layout)
    hp.buffer.fill_(7)
    before_dev, before_host = storage.clone(), hp.buffer.clone()
    kw = dict(args)
    b, s, layers = kw.pop("block_ids"), kw.pop("slots"), kw.pop("layers", None)
    with pytest.raises(ValueError, match=match):
        save_pages(dev, hp, b, s, layers, impl="numba")
    with pytest.raises(ValueError, match=match):
        load_pages(hp, dev, s, b, layers, impl="numba")
    assert torch.equal(storage, before_dev) and torch.equal(hp.buffer, before_host)


def test_dispatch_defaults_to_numba_and_falls_back_to_torch(monkeypatch):
    dev, *_ = _dev("cpu")
    assert kernels._impl(dev, None) is numba_impl
    monkeypatch.setattr(numba_impl, "available", lambda: False)
    assert kernels._impl(dev, None) is torch_impl
    with pytest.raises(ValueError, match="numba"):
        kernels._impl(dev, "numba")
    monkeypatch.setattr(numba_impl, "available", lambda: True)
    monkeypatch.setattr(kernels, "CPU_KERNELS", "torch")
    assert kernels._impl(dev, None) is torch_impl
    with pytest.raises(ValueError, match="impl must be"):
        kernels._impl(dev, "cuda")


def test_plan_cache_is_per_host_pool_and_layers():
    dev, *_ = _dev("cpu")
    h1, h2 = HostPool.for_device(dev, 2, "page_first"), HostPool.for_device(dev, 2, "page_first_direct")
    p1, p2 = numba_impl.plan(dev, h1, None), numba_impl.plan(dev, h2, None)
    assert p1 is numba_impl.plan(dev, h1, None) and p1 is not p2
    assert numba_impl.plan(dev, h1, [1]) is not p1
    # one storage group; the unit tables cover every byte of a page exactly once in each direction
    for pools in (p1, p2):
        (g,) = pools
        for units in (g.save_units, g.load_units):
            src, dst, length, mode = units
            elements = {1: 16 * 16, 3: 16 * 32}  # 16x16 and wide 16x32 register transposes
            moved = length[mode == 0].sum() + sum(int((mode == m).sum()) * k * dev.esz for m, k in elements.items())
            assert moved == dev.num_layers * dev.block_bytes
            assert set(mode.tolist()) <= {0, 1, 3}
