"""CPU transfer kernels in plain torch.

Pairs (block, slot) are merged into runs of consecutive blocks and consecutive slots
(:func:`tierkv.kernels.plan_runs`); each run is one strided ``copy_`` that covers every selected layer at once
when the device pool has all-layer views (vLLM's single shared allocation), so a batch of consecutive pages is a
handful of large copies. ``index_copy_``/``index_put_`` scatter is never used (about 2 GB/s for 64 KiB pages
where ``copy_`` reaches 17 GB/s on the machine this was measured on).

* ``layer_first`` (opaque bytes): ``host[l, s:s+k, :] <-> dev_bytes[l, b:b+k, :]``.
* ``page_first`` / ``page_first_direct`` (semantic): per part (K, V or MLA latent),
  ``host_part[s:s+k, l, tokens, H, D] <-> dev_part[l, b:b+k, tokens, H, D]`` where the device view decodes the
  backend's packing with strides (see :class:`~tierkv.connector.device_pool.DevicePool.semantic_view`).
"""
from __future__ import annotations

from typing import Optional

import torch

from . import plan_runs

#: runs shorter than this (pages) on average, in a save, switch to an ``index_select`` gather per slot run
GATHER_MIN_AVG_RUN = 2


def _pairs(dev, host, ls):
    """(device view, host view, layer axis first?) pairs to move, as [N_blocks_or_slots, ...] views."""
    out = []
    layer_groups = [None] if (ls is None and dev.has_all_layer_views) else (ls if ls is not None else range(dev.num_layers))
    if host.layout == "layer_first":
        hv = host.layer_view()  # [L, S, bb]
        for l in layer_groups:
            if l is None:
                out.append((dev.block_bytes_view(None).transpose(0, 1), hv.transpose(0, 1)))  # [B, L, bb], [S, L, bb]
            else:
                out.append((dev.block_bytes_view(l), hv[l]))  # [B, bb], [S, bb]
    else:
        for part in dev.parts():
            hs = host.slot_view(part)  # [S, L, p, H, D]
            hs = hs.unflatten(2, (dev.ratio, dev.kernel_block_size))  # [S, L, r, n, H, D]
            for l in layer_groups:
                if l is None:
                    out.append((dev.semantic_view(part, None).transpose(0, 1), hs))  # [B, L, r, n, H, D]
                else:
                    out.append((dev.semantic_view(part, l), hs[:, l]))  # [B, r, n, H, D]
    return out


def transfer(dev, host, block_ids: list[int], slots: list[int], layers: Optional[list[int]], save: bool,
             **_ignored) -> None:
    """Move pages; arguments already validated by :func:`tierkv.kernels.validate_transfer`."""
    runs = plan_runs(block_ids, slots)
    pairs = _pairs(dev, host, layers)
    if save and len(runs) * GATHER_MIN_AVG_RUN > len(block_ids) and host.layout == "layer_first" and layers is not None:
        _gather_save(pairs, block_ids, slots, dev.device)
        return
    for d, h in pairs:
        if save:
            for b, s, k in runs:
                h[s:s + k].copy_(d[b:b + k])
        else:
            for b, s, k in runs:
                d[b:b + k].copy_(h[s:s + k])


def _gather_save(pairs, block_ids, slots, device) -> None:
    """Save with scattered block ids: per run of consecutive slots, one ``index_select(..., out=)`` gather per
    (contiguous) host row range."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    s_sorted = [slots[i] for i in order]
    b_sorted = [block_ids[i] for i in order]
    groups = []
    i = 0
    while i < len(s_sorted):
        j = i + 1
        while j < len(s_sorted) and s_sorted[j] == s_sorted[i] + (j - i):
            j += 1
        groups.append((s_sorted[i], torch.tensor(b_sorted[i:j], dtype=torch.long, device=device)))
        i = j
    for d, h in pairs:
        for s0, idx in groups:
            torch.index_select(d, 0, idx, out=h[s0:s0 + idx.numel()])
