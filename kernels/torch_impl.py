"""CPU transfer kernels in plain torch.

Pairs (block, slot) are merged into runs of consecutive blocks and consecutive slots
(:func:`tierkv.kernels.plan_runs`); each run is one strided ``copy_`` that covers every selected layer at once
when the device pool has all-layer views (vLLM's single shared allocation), so a batch of consecutive pages is a
handful of large copies. Saves of scattered block ids into consecutive slots (what the slot allocator hands out)
are one ``torch.index_select(..., out=host_slice)`` gather per slot run instead. ``index_copy_``/``index_put_``
scatter is never used (slower than ``copy_``: benchmarks/README.md, "Measurements behind code choices");
loads into scattered blocks are slice copies per run. Copies run with :data:`COPY_THREADS` intra-op
threads (default: torch's own, see there).

* ``layer_first`` (opaque bytes): ``host[l, s:s+k, :] <-> dev_bytes[l, b:b+k, :]``.
* ``page_first`` / ``page_first_direct`` (semantic): per part (K, V or MLA latent),
  ``host_part[s:s+k, l, tokens, H, D] <-> dev_part[l, b:b+k, tokens, H, D]`` where the device view decodes the
  backend's packing with strides (see :class:`~tierkv.connector.l2.device_pool.DevicePool.semantic_view`).
"""
from __future__ import annotations

import os
from contextlib import contextmanager
from typing import Optional

import torch

from . import plan_runs

#: a save switches to ``index_select`` gathers (one per run of consecutive slots) when it has at least this many
#: times more (block, slot) runs than slot runs, i.e. when block ids are scattered
GATHER_MIN_AVG_RUN = 2
#: intra-op threads used by the copies (env ``TIERKV_COPY_THREADS``; 0, the default, leaves torch's setting alone).
#: Inside vLLM's CPU worker the thread count is bound by vLLM (with a core reserved for the connector) and
#: ``torch.set_num_threads`` is refused with a warning, so the kernels must not touch it there. Standalone use on an
#: oversubscribed box can set 1: measured on a loaded 2-core machine, a 256 KiB ``copy_`` took ~34 ms with 2
#: threads and ~13 us with 1.
COPY_THREADS = int(os.environ.get("TIERKV_COPY_THREADS", "0"))


@contextmanager
def copy_threads(n: Optional[int] = None):
    """Run the body with ``n`` (default :data:`COPY_THREADS`) torch intra-op threads, restoring the previous count.
    With OpenMP the count is per calling thread, so a copy thread does not change the engine's forward threads."""
    n = COPY_THREADS if n is None else n
    prev = torch.get_num_threads()
    if n <= 0 or n == prev:
        yield
        return
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(prev)


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
    with copy_threads():
        _transfer(dev, host, block_ids, slots, layers, save)


def _transfer(dev, host, block_ids, slots, layers, save) -> None:
    runs = plan_runs(block_ids, slots)
    pairs = _pairs(dev, host, layers)
    if save:
        groups = _slot_groups(block_ids, slots, dev.device)
        if len(runs) >= GATHER_MIN_AVG_RUN * len(groups) and len(runs) > len(groups):
            # scattered block ids: one index_select gather per run of consecutive slots (no Python loop per page)
            for d, h in pairs:
                for s0, idx in groups:
                    torch.index_select(d, 0, idx, out=h[s0:s0 + idx.numel()])
            return
        for d, h in pairs:
            for b, s, k in runs:
                h[s:s + k].copy_(d[b:b + k])
    else:
        # scatter into L1: slice copies per run (index_copy_/index_put_ measured 1.5-2x slower here)
        for d, h in pairs:
            for b, s, k in runs:
                d[b:b + k].copy_(h[s:s + k])


def _slot_groups(block_ids, slots, device) -> list[tuple[int, torch.Tensor]]:
    """Runs of consecutive slots with their (arbitrary) block ids: ``[(first_slot, block_id_tensor)]``."""
    order = sorted(range(len(slots)), key=slots.__getitem__)
    groups = []
    i = 0
    while i < len(order):
        j = i + 1
        s0 = slots[order[i]]
        while j < len(order) and slots[order[j]] == s0 + (j - i):
            j += 1
        groups.append((s0, torch.tensor([block_ids[x] for x in order[i:j]], dtype=torch.long, device=device)))
        i = j
    return groups
