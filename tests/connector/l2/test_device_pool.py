"""DevicePool: recognition of vLLM KV layouts, byte and semantic views against reference encodings, errors."""
import pytest
import torch

from tierkv.connector.l2.device_pool import DevicePool
from tierkv.kernels.testing import (DEVICE_LAYOUTS, block_bytes_reference, encode_semantic, make_kv_caches,
                                    random_semantic)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _pool(kv, spec, **kw):
    args = dict(num_blocks=spec.num_blocks, block_size=spec.block_size, kv_cache_layout=spec.kv_cache_layout,
                backend=spec.backend, use_mla=spec.use_mla)
    args.update(kw)
    return DevicePool.from_vllm(kv, **args)


CASES = [(name, ratio) for name in DEVICE_LAYOUTS for ratio in (1, 2) if not (ratio == 2 and "bl" in name)]


@pytest.mark.parametrize("name,ratio", CASES)
def test_views_match_reference(name, ratio):
    kv, storage, spec = make_kv_caches(name, num_layers=3, num_blocks=6, block_size=32, kernel_block_size=32 // ratio,
                                       num_kv_heads=2, head_dim=8)
    sem = random_semantic(spec)
    encode_semantic(kv, spec, sem)
    dev = _pool(kv, spec)
    assert dev.num_layers == 3 and dev.num_blocks == 6 and dev.block_size == 32 and dev.ratio == ratio
    H = 1 if spec.use_mla else 2
    assert dev.block_bytes == (1 if spec.use_mla else 2) * 32 * H * 8 * 2
    assert dev.kind == ("mla" if spec.use_mla else "cpu" if name == "cpu" else "flash")
    assert dev.has_all_layer_views
    # semantic views decode the packing: equal to the values written through the backend's definition
    for part in dev.parts():
        all_layers = dev.semantic_view(part, None)  # [L, B, r, n, H, D]
        for l in range(3):
            per = dev.semantic_view(part, l)
            want = sem[part][l].unflatten(1, (ratio, 32 // ratio))  # [B, r, n, H, D]
            assert torch.equal(_bits(per), _bits(want)), (part, l)
            assert torch.equal(_bits(all_layers[l]), _bits(want))
    # byte views: row b = the block's dense memory region
    for l in range(3):
        bv = dev.block_bytes_view(l)
        for b in range(6):
            assert torch.equal(bv[b], block_bytes_reference(kv, spec, l, b))
            assert torch.equal(dev.block_bytes_view(None)[l, b], bv[b])


def test_layer_order_from_names_and_shared_storage_offsets():
    kv, storage, spec = make_kv_caches("cpu", num_layers=12, num_blocks=4)
    shuffled = {k: kv[k] for k in sorted(kv)}  # "model.layers.10" sorts before "model.layers.2" as text
    dev = _pool(shuffled, spec)
    assert dev.layer_names == [f"model.layers.{i}.self_attn.attn" for i in range(12)]
    assert dev.has_all_layer_views
    assert kv["model.layers.0.self_attn.attn"].storage_offset() > 0  # the builder pads: views have offsets


def test_separate_storages_have_no_all_layer_view():
    kv, _, spec = make_kv_caches("flashinfer_hnd", num_layers=2, num_blocks=4)
    kv = {k: v.clone() for k, v in kv.items()}
    dev = _pool(kv, spec)
    assert not dev.has_all_layer_views
    with pytest.raises(ValueError, match="one storage"):
        dev.block_bytes_view(None)


def test_defaults_infer_cpu_and_layout_from_strides():
    kv, _, spec = make_kv_caches("cpu", num_blocks=4)
    dev = DevicePool.from_vllm(kv, num_blocks=4, block_size=32)
    assert dev.kind == "cpu" and dev.kv_cache_layout == "LBHNC"
    assert dev.layout_tag.startswith("cpu-") and dev.layout_tag.endswith("/LBHNC")
    kv, _, spec = make_kv_caches("flash_attn_nhd", num_blocks=4)
    dev = DevicePool.from_vllm(kv, num_blocks=4, block_size=32, backend="FLASH_ATTN")
    assert dev.kv_cache_layout == "LBNHC" and dev.layout_tag == "flash/LBNHC"
    kv, _, spec = make_kv_caches("mla", num_blocks=4)
    dev = DevicePool.from_vllm(kv, num_blocks=4, block_size=32)  # 3-D tensors => MLA
    assert dev.kind == "mla" and dev.parts() == ("latent",)


def test_mla_4d_view_accepted():
    kv, _, spec = make_kv_caches("mla", num_blocks=4, mla_3d=False)
    dev = _pool(kv, spec)
    assert dev.num_kv_heads == 1 and dev.head_dim == spec.head_dim


@pytest.mark.parametrize("kw,match", [
    (dict(backend="NOT_A_BACKEND"), "unknown attention backend"),
    (dict(kv_cache_layout="BHLNC"), "not supported"),
    (dict(kv_cache_layout="XYZ"), "unknown kv_cache_layout"),
    (dict(kv_cache_layout="LBNHC"), "only uses layout LBHNC"),
    (dict(num_blocks=5), "not a multiple"),
    (dict(block_size=64), "block_size=64"),
])
def test_bad_configuration_errors(kw, match):
    kv, _, spec = make_kv_caches("cpu", num_blocks=6)
    with pytest.raises(ValueError, match=match):
        _pool(kv, spec, **kw)


def test_layout_contradicting_strides_is_refused():
    kv, _, spec = make_kv_caches("flash_attn_nhd", num_blocks=4)
    with pytest.raises(ValueError, match="contradict"):
        _pool(kv, spec, kv_cache_layout="HND")


def test_old_5d_layout_and_mismatched_layers_are_refused():
    t = torch.zeros(2, 4, 32, 2, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="4-D"):
        DevicePool.from_vllm({"l.0": t}, num_blocks=4, block_size=32, backend="FLASH_ATTN")
    a = torch.zeros(4, 2, 32, 16, dtype=torch.bfloat16)
    b = torch.zeros(4, 2, 32, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="differs"):
        DevicePool.from_vllm({"l.0": a, "l.1": b}, num_blocks=4, block_size=32)
    with pytest.raises(ValueError, match="empty"):
        DevicePool.from_vllm({}, num_blocks=4, block_size=32)


def test_non_dense_block_is_refused():
    # a layer whose block is not one dense run (heads of a block spread over the allocation)
    base = torch.zeros(2, 4, 32, 16, dtype=torch.bfloat16)  # [H, B, n, C]
    t = base.transpose(0, 1)  # logical [B, H, n, C], head-outermost physically (like LHBNC)
    with pytest.raises(ValueError, match="dense"):
        DevicePool.from_vllm({"l.0": t}, num_blocks=4, block_size=32, backend="FLASHINFER")
