"""Transfer kernels (torch path; the numba kernels are in test_numba_impl.py): argument checks before any byte moves, run planning, scattered ids, gathers,
and per-layer loading (LayerwiseLoad)."""
import random
import threading

import pytest
import torch

import tierkv.connector.l2.layer_loader as layer_loader
from tierkv.connector.l2.device_pool import DevicePool
from tierkv.connector.l2.host_pool import HOST_POOL_LAYOUTS, HostPool
from tierkv.connector.l2.layer_loader import LayerwiseLoad
from tierkv.kernels import load_pages, plan_runs, save_pages, torch_impl
from tierkv.kernels.testing import block_bytes_reference, make_kv_caches


def _dev(name="cpu", **kw):
    args = dict(num_layers=4, num_blocks=16, block_size=32, num_kv_heads=2, head_dim=8)
    args.update(kw)
    kv, storage, spec = make_kv_caches(name, **args)
    dev = DevicePool.from_vllm(kv, num_blocks=spec.num_blocks, block_size=spec.block_size,
                               kv_cache_layout=spec.kv_cache_layout, backend=spec.backend, use_mla=spec.use_mla)
    return dev, storage, spec, kv


def test_plan_runs_merges_consecutive_pairs():
    assert plan_runs([], []) == []
    assert plan_runs([4, 5, 6, 9, 1], [0, 1, 2, 3, 7]) == [(1, 7, 1), (4, 0, 3), (9, 3, 1)]
    assert plan_runs([3, 2, 1], [2, 1, 0]) == [(1, 0, 3)]
    assert plan_runs([1, 2, 3], [0, 2, 4]) == [(1, 0, 1), (2, 2, 1), (3, 4, 1)]


BAD = [
    (dict(block_ids=[0, 16], slots=[0, 1]), "block id 16 out of range"),
    (dict(block_ids=[-1], slots=[0]), "block id -1 out of range"),
    (dict(block_ids=[0, 1], slots=[0, 8]), "slot 8 out of range"),
    (dict(block_ids=[0, 1, 2], slots=[0, 1]), "one slot per block"),
    (dict(block_ids=[0, 1], slots=[3, 3]), "slot 3 given twice"),
    (dict(block_ids=[2, 2], slots=[0, 1]), "block id 2 given twice"),
    (dict(block_ids=[0], slots=[0], layers=[4]), "layer 4 out of range"),
    (dict(block_ids=[0.0], slots=[0]), "must hold ints"),
    (dict(block_ids=[True], slots=[0]), "must hold ints"),
    (dict(block_ids=torch.tensor([0.5]), slots=[0]), "integer"),
    (dict(block_ids=5, slots=[0]), "sequence"),
]


@pytest.mark.parametrize("impl", ["torch", None])
@pytest.mark.parametrize("layout", HOST_POOL_LAYOUTS)
@pytest.mark.parametrize("args,match", BAD)
def test_bad_arguments_raise_before_any_byte_moves(layout, args, match, impl):
    dev, storage, *_ = _dev()
    hp = HostPool.for_device(dev, 8, layout)
    hp.buffer.fill_(7)
    before_dev, before_host = storage.clone(), hp.buffer.clone()
    kw = dict(args)
    b, s, layers = kw.pop("block_ids"), kw.pop("slots"), kw.pop("layers", None)
    with pytest.raises(ValueError, match=match):
        save_pages(dev, hp, b, s, layers, impl=impl)
    with pytest.raises(ValueError, match=match):
        load_pages(hp, dev, s, b, layers, impl=impl)
    assert torch.equal(storage, before_dev) and torch.equal(hp.buffer, before_host)


def test_mismatched_l1_l2_geometry_is_refused():
    dev, storage, *_ = _dev()
    # same bytes per block (2 heads x 8 dims == 4 heads x 4 dims), different head shape
    other, *_ = _dev(num_kv_heads=4, head_dim=4)
    assert other.block_bytes == dev.block_bytes
    for layout in HOST_POOL_LAYOUTS:
        hp = HostPool.for_device(other, 4, layout)
        with pytest.raises(ValueError, match="num_kv_heads"):
            save_pages(dev, hp, [0], [0])
    f16, *_ = _dev("flashinfer_hnd", dtype=torch.float16)
    bf16, *_ = _dev("flashinfer_hnd")
    with pytest.raises(ValueError, match="dtype"):
        load_pages(HostPool.for_device(f16, 4, "page_first"), bf16, [0], [0])
    fewer, *_ = _dev(num_layers=3)
    with pytest.raises(ValueError, match="layers"):
        save_pages(fewer, HostPool.for_device(dev, 4), [0], [0])
    small_pages, *_ = _dev(block_size=16, num_kv_heads=4)  # 16 tokens x 4 heads: same bytes, other page size
    with pytest.raises(ValueError, match="page_size"):
        save_pages(small_pages, HostPool.for_device(dev, 4), [0], [0])
    plain = HostPool(4, 4, dev.block_bytes * 2)  # layer_first without geometry: bytes checked
    with pytest.raises(ValueError, match="bytes per layer"):
        save_pages(dev, plain, [0], [0])
    nhd, *_ = _dev("flash_attn_nhd")
    with pytest.raises(ValueError, match="device layout"):
        save_pages(nhd, HostPool.for_device(dev, 4), [0], [0])


def test_plain_layer_first_pool_without_geometry_round_trips():
    dev, storage, *_ = _dev()
    hp = HostPool(6, dev.num_layers, dev.block_bytes)
    save_pages(dev, hp, [9, 3, 4], [5, 0, 1])
    before = storage.clone()
    storage[256:].zero_()
    load_pages(hp, dev, [5, 0, 1], [9, 3, 4])
    now, was = storage[256:].view(4, 16, -1), before[256:].view(4, 16, -1)  # [L, B, block bytes]
    for b in range(16):
        if b in (9, 3, 4):
            assert torch.equal(now[:, b], was[:, b])
        else:
            assert not now[:, b].any()


@pytest.mark.parametrize("layout", HOST_POOL_LAYOUTS)
@pytest.mark.parametrize("layers", [None, [1, 3]])
def test_scattered_ids_and_gather_path_match_reference(layout, layers, monkeypatch):
    dev, storage, spec, kv = _dev()
    rng = random.Random(5)
    blocks = rng.sample(range(16), 10)
    slots = list(range(1, 11)) if layout == "layer_first" else rng.sample(range(12), 10)
    ref = HostPool.for_device(dev, 12, layout)
    ref.buffer.zero_()
    # reference: one pair at a time (no run merging, no gathers)
    for b, s in zip(blocks, slots):
        save_pages(dev, ref, [b], [s], layers, impl="torch")
    for min_run in (1, 10 ** 6):  # force the run-copy path and the index_select gather path (torch)
        monkeypatch.setattr(torch_impl, "GATHER_MIN_AVG_RUN", min_run)
        hp = HostPool.for_device(dev, 12, layout)
        hp.buffer.zero_()
        save_pages(dev, hp, blocks, slots, layers, impl="torch")
        assert torch.equal(hp.buffer, ref.buffer)
    hp = HostPool.for_device(dev, 12, layout)  # and the numba kernels (the CPU default)
    hp.buffer.zero_()
    save_pages(dev, hp, blocks, slots, layers, impl="numba")
    assert torch.equal(hp.buffer, ref.buffer)


def test_many_pages_consecutive_runs_cover_all_layers_in_one_copy(monkeypatch):
    dev, storage, spec, kv = _dev()
    hp = HostPool.for_device(dev, 16, "layer_first")
    calls = []
    orig = torch.Tensor.copy_

    def counting(self, src, *a, **k):
        calls.append(self.shape)
        return orig(self, src, *a, **k)

    monkeypatch.setattr(torch.Tensor, "copy_", counting)
    save_pages(dev, hp, list(range(2, 10)), list(range(0, 8)), impl="torch")
    monkeypatch.setattr(torch.Tensor, "copy_", orig)
    assert len(calls) == 1 and tuple(calls[0]) == (8, 4, dev.block_bytes)
    for i, b in enumerate(range(2, 10)):
        for l in range(4):
            assert torch.equal(hp.layer_view()[l, i], block_bytes_reference(kv, spec, l, b))


# ---------------------------------------------------------------- LayerwiseLoad
@pytest.mark.parametrize("layout", HOST_POOL_LAYOUTS)
def test_layerwise_load_restores_every_layer_in_order(layout):
    dev, storage, spec, kv = _dev()
    hp = HostPool.for_device(dev, 8, layout)
    blocks, slots = [7, 1, 12, 3], [0, 5, 6, 2]
    save_pages(dev, hp, blocks, slots)
    want = {(l, b): block_bytes_reference(kv, spec, l, b).clone() for l in range(4) for b in blocks}
    storage[256:].zero_()
    ld = LayerwiseLoad(hp, dev, slots, blocks)
    ld.start()
    for l in range(4):
        ld.wait_layer(l)
        for b in blocks:  # this layer is complete as soon as wait_layer returns
            assert torch.equal(block_bytes_reference(kv, spec, l, b), want[l, b])
    ld.wait_all()
    assert ld.done
    assert [t[0] for t in ld.timeline] == [0, 1, 2, 3]
    assert all(a[2] <= b[1] for a, b in zip(ld.timeline, ld.timeline[1:]))


def test_layerwise_later_layers_proceed_while_caller_waits_on_earlier(monkeypatch):
    """wait_layer(0) returns while layer 1 is still blocked: only the awaited layer must be in L1."""
    dev, storage, spec, kv = _dev()
    hp = HostPool.for_device(dev, 4, "layer_first")
    gate = threading.Event()
    real = layer_loader.load_pages

    def gated(host, d, s, b, layers, **kw):
        if layers == [1]:
            assert gate.wait(timeout=30)
        return real(host, d, s, b, layers, **kw)

    monkeypatch.setattr(layer_loader, "load_pages", gated)
    ld = LayerwiseLoad(hp, dev, [0], [0])
    ld.start()
    ld.wait_layer(0)
    assert not ld.done
    gate.set()
    ld.wait_layer(3)
    ld.wait_all()


def test_layerwise_failure_is_reraised(monkeypatch):
    dev, storage, spec, kv = _dev()
    hp = HostPool.for_device(dev, 4, "page_first_direct")
    real = layer_loader.load_pages

    def failing(host, d, s, b, layers, **kw):
        if layers == [2]:
            raise OSError("injected copy failure")
        return real(host, d, s, b, layers, **kw)

    monkeypatch.setattr(layer_loader, "load_pages", failing)
    ld = LayerwiseLoad(hp, dev, [0, 1], [4, 5])
    ld.wait_layer(0)  # starts it
    ld.wait_layer(1)
    with pytest.raises(RuntimeError, match="layer 2") as ei:
        ld.wait_layer(2)
    assert isinstance(ei.value.__cause__, OSError)
    with pytest.raises(RuntimeError):
        ld.wait_all()


def test_layerwise_validates_up_front():
    dev, *_ = _dev()
    hp = HostPool.for_device(dev, 4)
    with pytest.raises(ValueError, match="slot 9"):
        LayerwiseLoad(hp, dev, [9], [0])
    ld = LayerwiseLoad(hp, dev, [], [])
    with pytest.raises(ValueError, match="layer_index"):
        ld.wait_layer(4)
    ld.wait_all()


@pytest.mark.parametrize("impl", ["torch", None])
def test_swapped_pools_are_named_before_any_byte_moves(impl):
    """load_pages(dev, host, ...) instead of load_pages(host, dev, ...): a ValueError saying which is which."""
    dev, storage, *_ = _dev()
    hp = HostPool.for_device(dev, 8, "layer_first")
    before_dev, before_host = storage.clone(), hp.buffer.clone()
    with pytest.raises(ValueError, match="got HostPool as the device pool and DevicePool as the host pool"):
        save_pages(hp, dev, [0], [0], impl=impl)
    with pytest.raises(ValueError, match="got HostPool as the device pool and DevicePool as the host pool"):
        load_pages(dev, hp, [0], [0], impl=impl)
    assert torch.equal(storage, before_dev) and torch.equal(hp.buffer, before_host)
