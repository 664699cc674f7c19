"""CUDA transfer kernels in Triton (also run on CPU tensors under ``TRITON_INTERPRET=1``, which is how CI tests them).

One generic kernel, ``_page_copy_kernel``, copies a batch of *items*: item ``i`` is a small strided tensor (up to 5
dims) starting at element ``src_base[i]`` of the source and ``dst_base[i]`` of the destination, each side with its
own strides. A step's transfer is one launch per part over all its (block, slot) pairs and, when the layers share
one allocation, all layers at once:

* ``layer_first`` (opaque): item = ``[L, block_bytes / w]`` words of width ``w`` (8, 4, 2 or 1 bytes, the widest
  that divides every size and offset), device stride per layer = the layer stride, host stride = ``S * block_bytes``.
* semantic layouts: item = ``[L, r, n, H, D]`` elements; device strides decode the backend packing
  (:meth:`~tierkv.connector.l2.device_pool.DevicePool.semantic_view`), host strides are the pool's.

On CUDA the host pool must be pinned (a pageable one falls back to the torch implementation, warned once). Copies
run on a per-device side stream that first waits for the current stream; ``sync=True`` (default) returns after the
copy, ``sync=False`` returns the ``torch.cuda.Event`` recorded after it. Why: docs/developer-guide.md.
"""
from __future__ import annotations

import logging
from typing import Optional

import torch
import triton
import triton.language as tl

log = logging.getLogger(__name__)

BLOCK = 1024
_side_streams: dict = {}
_warned_pageable = False


@triton.jit
def _page_copy_kernel(src_ptr, dst_ptr, src_base_ptr, dst_base_ptr, numel,
                      S1, S2, S3, S4,
                      a0, a1, a2, a3, a4,
                      c0, c1, c2, c3, c4,
                      BLOCK: tl.constexpr):
    item = tl.program_id(0)
    chunk = tl.program_id(1)
    e = chunk * BLOCK + tl.arange(0, BLOCK)
    mask = e < numel
    sb = tl.load(src_base_ptr + item)
    db = tl.load(dst_base_ptr + item)
    i4 = e % S4
    r = e // S4
    i3 = r % S3
    r = r // S3
    i2 = r % S2
    r = r // S2
    i1 = r % S1
    i0 = (r // S1).to(tl.int64)
    i1 = i1.to(tl.int64)
    i2 = i2.to(tl.int64)
    i3 = i3.to(tl.int64)
    i4 = i4.to(tl.int64)
    so = sb + i0 * a0 + i1 * a1 + i2 * a2 + i3 * a3 + i4 * a4
    do = db + i0 * c0 + i1 * c1 + i2 * c2 + i3 * c3 + i4 * c4
    x = tl.load(src_ptr + so, mask=mask)
    tl.store(dst_ptr + do, x, mask=mask)


def _flat(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """1-D ``dtype`` tensor over the whole storage of ``t``."""
    st = t.untyped_storage()
    esz = torch.empty((), dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=t.device).set_(st, 0, (st.nbytes() // esz,), (1,))


def _launch(src_flat, dst_flat, src_base: list[int], dst_base: list[int], sizes, src_strides, dst_strides) -> None:
    sizes = list(sizes)
    src_strides, dst_strides = list(src_strides), list(dst_strides)
    while len(sizes) < 5:  # pad leading dims
        sizes.insert(0, 1)
        src_strides.insert(0, 0)
        dst_strides.insert(0, 0)
    numel = 1
    for s in sizes:
        numel *= s
    dev = src_flat.device if src_flat.device.type == "cuda" else dst_flat.device
    sb = torch.tensor(src_base, dtype=torch.int64).to(dev, non_blocking=True)
    db = torch.tensor(dst_base, dtype=torch.int64).to(dev, non_blocking=True)
    grid = (len(src_base), triton.cdiv(numel, BLOCK))
    _page_copy_kernel[grid](src_flat, dst_flat, sb, db, numel,
                            sizes[1], sizes[2], sizes[3], sizes[4],
                            *src_strides, *dst_strides, BLOCK=BLOCK)


def _word_dtype(*nbytes: int) -> torch.dtype:
    for w, dt in ((8, torch.int64), (4, torch.int32), (2, torch.int16)):
        if all(x % w == 0 for x in nbytes):
            return dt
    return torch.uint8


def _jobs(dev, host, block_ids, slots, layers):
    """Yield launch arguments (src/dst flat tensors are device-side / host-side, before direction is applied)."""
    L = dev.num_layers
    groups = [None] if (layers is None and dev.has_all_layer_views) else (layers if layers is not None else range(L))
    if host.layout == "layer_first":
        bb = dev.block_bytes
        for l in groups:
            dv = dev.block_bytes_view(l)
            if l is None:
                off, (sl, sb, _) = dv.storage_offset(), dv.stride()
                nl = L
            else:
                off, (sb, _) = dv.storage_offset(), dv.stride()
                sl, nl = 0, 1
            hoff = 0 if l is None else l * host.num_slots * bb
            wdt = _word_dtype(bb, off, sb, sl or 8, hoff)
            w = torch.empty((), dtype=wdt).element_size()
            d_base = [(off + b * sb) // w for b in block_ids]
            h_base = [(hoff + s * bb) // w for s in slots]
            yield (_flat(dv, wdt), _flat(host.buffer, wdt), d_base, h_base, (nl, bb // w),
                   (sl // w, 1), (host.num_slots * bb // w, 1))
    else:
        for part in dev.parts():
            hs = host.slot_view(part)  # [S, L, p, H, D]
            hs = hs.unflatten(2, (dev.ratio, dev.kernel_block_size))  # [S, L, r, n, H, D]
            h_s, h_l = hs.stride(0), hs.stride(1)
            for l in groups:
                dv = dev.semantic_view(part, l)
                if l is None:
                    d_l, d_b = dv.stride(0), dv.stride(1)
                    inner = dv.stride()[2:]
                    nl, hl0 = L, 0
                else:
                    d_l, d_b = 0, dv.stride(0)
                    inner = dv.stride()[1:]
                    nl, hl0 = 1, l
                off, hoff = dv.storage_offset(), hs.storage_offset() + hl0 * h_l
                d_base = [off + b * d_b for b in block_ids]
                h_base = [hoff + s * h_s for s in slots]
                sizes = (nl, dev.ratio, dev.kernel_block_size, dev.num_kv_heads, dev.head_dim)
                # merge (r, n) into one dim so the 5 kernel dims suffice: [L, r*n... ] only if strides allow
                d_str = (d_l, *inner)
                h_str = (h_l, *hs.stride()[2:])
                if dev.ratio == 1:
                    sizes = sizes[:1] + sizes[2:]
                    d_str = d_str[:1] + d_str[2:]
                    h_str = h_str[:1] + h_str[2:]
                    yield (_flat(dv, dev.dtype), _flat(host.buffer, dev.dtype), d_base, h_base, sizes, d_str, h_str)
                else:
                    for li in range(nl):  # 6 dims with L: one launch per layer
                        yield (_flat(dv, dev.dtype), _flat(host.buffer, dev.dtype),
                               [x + li * d_l for x in d_base], [x + li * h_l for x in h_base],
                               sizes[1:], d_str[1:], h_str[1:])


def _side_stream(device: torch.device):
    s = _side_streams.get(device)
    if s is None:
        s = _side_streams[device] = torch.cuda.Stream(device=device)
    return s


def transfer(dev, host, block_ids: list[int], slots: list[int], layers: Optional[list[int]], save: bool,
             stream=None, sync: bool = True):
    """Move pages with the Triton kernel; arguments validated by :func:`tierkv.kernels.validate_transfer`.
    Returns the completion ``torch.cuda.Event`` on CUDA, None on CPU (interpreter)."""
    global _warned_pageable
    cuda = dev.device.type == "cuda"
    if cuda and not host.buffer.is_pinned():
        if not _warned_pageable:
            log.warning("tierkv: host pool is not pinned; Triton kernels need pinned memory, using torch copies")
            _warned_pageable = True
        from . import torch_impl
        torch_impl.transfer(dev, host, block_ids, slots, layers, save)
        return None
    jobs = list(_jobs(dev, host, block_ids, slots, layers))
    if not cuda:
        for d_flat, h_flat, d_base, h_base, sizes, d_str, h_str in jobs:
            if save:
                _launch(d_flat, h_flat, d_base, h_base, sizes, d_str, h_str)
            else:
                _launch(h_flat, d_flat, h_base, d_base, sizes, h_str, d_str)
        return None
    side = stream or _side_stream(dev.device)
    side.wait_stream(torch.cuda.current_stream(dev.device))
    with torch.cuda.stream(side):
        for d_flat, h_flat, d_base, h_base, sizes, d_str, h_str in jobs:
            if save:
                _launch(d_flat, h_flat, d_base, h_base, sizes, d_str, h_str)
            else:
                _launch(h_flat, d_flat, h_base, d_base, sizes, h_str, d_str)
        ev = torch.cuda.Event()
        ev.record(side)
    if sync:
        ev.synchronize()
    return ev
