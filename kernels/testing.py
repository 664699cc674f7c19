"""Builders of vLLM-like KV cache tensors on CPU, for tests and benchmarks (no vLLM import).

:func:`make_kv_caches` allocates one flat ``int8`` storage (with a leading pad, so views have non-zero offsets)
and hands out one view per layer, the way vLLM 0.32's ``allocate_kv_cache`` / ``create_kv_cache_views`` do, for
every device layout the adapter supports. :func:`encode_semantic` writes known K/V (or MLA latent) values into
them through the *logical* definition of each backend's packing (written independently of
:class:`~tierkv.connector.l2.device_pool.DevicePool`'s stride arithmetic), so tests can check the adapter's decode
against a reference.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

#: name -> (backend, kv_cache_layout, use_mla, physical order)
DEVICE_LAYOUTS = {
    "cpu": ("CPU_ATTN", "LBHNC", False, "LBHNC"),
    "flash_attn_nhd": ("FLASH_ATTN", "LBNHC", False, "LBNHC"),
    "flashinfer_nhd": ("FLASHINFER", "NHD", False, "LBNHC"),
    "flashinfer_hnd": ("FLASHINFER", "HND", False, "LBHNC"),
    "flashinfer_blhnc": ("FLASHINFER", "BLHNC", False, "BLHNC"),
    "flash_attn_blnhc": ("FLASH_ATTN", "BLNHC", False, "BLNHC"),
    "mla": ("FLASHMLA", "LBNHC", True, "LBNHC"),
}


@dataclass
class KVSpec:
    name: str
    backend: str
    kv_cache_layout: str
    use_mla: bool
    num_layers: int
    num_blocks: int
    block_size: int
    kernel_block_size: int
    num_kv_heads: int
    head_dim: int  # K head dim; MLA: latent width C
    dtype: torch.dtype

    @property
    def ratio(self) -> int:
        return self.block_size // self.kernel_block_size


def make_kv_caches(name: str, *, num_layers: int = 3, num_blocks: int = 12, block_size: int = 32,
                   kernel_block_size: int | None = None, num_kv_heads: int = 2, head_dim: int = 16,
                   dtype: torch.dtype = torch.bfloat16, pad_bytes: int = 256, mla_3d: bool = True,
                   seed: int = 0):
    """Return ``(kv_caches, storage, spec)``: layer name -> view, the flat int8 storage, and a :class:`KVSpec`.
    The storage is filled with random bytes (``seed``)."""
    backend, layout, use_mla, phys = DEVICE_LAYOUTS[name]
    n = kernel_block_size or block_size
    r = block_size // n
    Bk = num_blocks * r
    L, H = num_layers, (1 if use_mla else num_kv_heads)
    C = head_dim if use_mla else 2 * head_dim
    esz = torch.empty((), dtype=dtype).element_size()
    numel = L * Bk * H * n * C
    storage = torch.empty(pad_bytes + numel * esz, dtype=torch.int8)
    g = torch.Generator().manual_seed(seed)
    storage.copy_(torch.randint(-128, 128, storage.shape, generator=g, dtype=torch.int8))
    flat = storage[pad_bytes:].view(dtype)
    kv = {}
    for l in range(L):
        if phys == "LBHNC":
            t = flat.view(L, Bk, H, n, C)[l]
        elif phys == "LBNHC":
            t = flat.view(L, Bk, n, H, C)[l].transpose(1, 2)
        elif phys == "BLHNC":
            t = flat.view(Bk, L, H, n, C)[:, l]
        elif phys == "BLNHC":
            t = flat.view(Bk, L, n, H, C)[:, l].transpose(1, 2)
        else:
            raise ValueError(phys)
        if use_mla and mla_3d:
            t = t[:, 0]  # [Bk, n, C]
        kv[f"model.layers.{l}.self_attn.attn"] = t
    spec = KVSpec(name, backend, layout, use_mla, L, num_blocks, block_size, n, H, head_dim, dtype)
    return kv, storage, spec


def random_semantic(spec: KVSpec, seed: int = 1) -> dict[str, torch.Tensor]:
    """Random K/V (or latent) values ``[L, num_blocks, block_size, H, D]`` (as random bit patterns)."""
    g = torch.Generator().manual_seed(seed)
    shape = (spec.num_layers, spec.num_blocks, spec.block_size, spec.num_kv_heads, spec.head_dim)
    parts = ("latent",) if spec.use_mla else ("k", "v")
    out = {}
    for p in parts:
        bits = torch.randint(-32768, 32768, shape, generator=g, dtype=torch.int32).to(torch.int16)
        out[p] = bits.view(spec.dtype) if torch.empty((), dtype=spec.dtype).element_size() == 2 else \
            torch.randn(shape, generator=g).to(spec.dtype)
    return out


def encode_semantic(kv: dict[str, torch.Tensor], spec: KVSpec, sem: dict[str, torch.Tensor]) -> None:
    """Write ``sem`` (from :func:`random_semantic`) into the device tensors following each backend's definition:
    CPU pages hold, per (kernel block, head), K transposed ``[D, n]`` then V ``[n, D]``; FlashAttention/FlashInfer
    logical ``[B, H, n, 2D]`` hold K in ``[..., :D]`` and V in ``[..., D:]``; MLA ``[B, n, C]`` the latent."""
    r, n, D = spec.ratio, spec.kernel_block_size, spec.head_dim
    for l, t in enumerate(kv.values()):
        for b in range(spec.num_blocks):
            for j in range(r):
                kb = b * r + j
                tok = slice(j * n, (j + 1) * n)
                if spec.use_mla:
                    dst = t[kb] if t.dim() == 3 else t[kb, 0]
                    dst.copy_(sem["latent"][l, b, tok, 0])
                    continue
                for h in range(spec.num_kv_heads):
                    k = sem["k"][l, b, tok, h]  # [n, D]
                    v = sem["v"][l, b, tok, h]
                    if spec.backend == "CPU_ATTN":
                        page = t[kb, h].reshape(-1)  # contiguous [n * 2D]
                        page[: n * D].copy_(k.t().reshape(-1))
                        page[n * D:].copy_(v.reshape(-1))
                    else:
                        t[kb, h, :, :D].copy_(k)
                        t[kb, h, :, D:].copy_(v)


def block_bytes_reference(kv: dict[str, torch.Tensor], spec: KVSpec, layer: int, block: int) -> torch.Tensor:
    """Reference bytes of one manager block of one layer: the kernel blocks' dense memory regions, found from the
    physical layout (not from the adapter)."""
    t = list(kv.values())[layer]
    if t.dim() == 3:
        t = t.unsqueeze(1)
    rows = t[block * spec.ratio:(block + 1) * spec.ratio]
    # the physical (dense) order of a block: permute the logical dims by decreasing stride
    order = sorted(range(4), key=lambda i: -rows.stride(i))
    return rows.permute(order).contiguous().view(torch.uint8).reshape(-1)
