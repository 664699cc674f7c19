"""Page transfer kernels between L1 (the engine's KV blocks, :class:`~tierkv.connector.l2.device_pool.DevicePool`)
and L2 (the host pool, :class:`~tierkv.connector.l2.host_pool.HostPool`).

* :func:`save_pages` (L1 -> L2, "backup"): block ``block_ids[i]`` of every selected layer -> slot ``slots[i]``.
* :func:`load_pages` (L2 -> L1, "load_back"): slot ``slots[i]`` -> block ``block_ids[i]``.

``layers`` selects a subset of layer indices (None = all). The implementation follows the device of the KV tensors:
on CPU :mod:`tierkv.kernels.numba_impl` when numba is installed, else :mod:`tierkv.kernels.torch_impl`; on CUDA
:mod:`tierkv.kernels.triton_impl`. ``impl="numba"|"torch"|"triton"`` forces one; env ``TIERKV_CPU_KERNELS=torch``
makes torch the CPU default. How each implementation moves bytes: docs/developer-guide.md.

Every argument is checked before any byte moves; a bad one raises ValueError naming it: ids out of range,
lengths that differ, a slot or block given twice, unknown layers, or an L1/L2 pair whose layers, dtype, heads,
head dim, page size or block bytes differ.
"""
from __future__ import annotations

import os
from typing import Optional, Sequence

import numpy as np
import torch

__all__ = ["save_pages", "load_pages", "validate_transfer", "plan_runs", "warm_up"]


def _as_int_list(name: str, v) -> list[int]:
    if isinstance(v, torch.Tensor):
        if v.dtype.is_floating_point or v.dtype == torch.bool or v.dim() > 1:
            raise ValueError(f"{name} must be a 1-D integer sequence, got tensor {v.dtype} {tuple(v.shape)}")
        return v.tolist()
    if isinstance(v, np.ndarray):
        if v.dtype.kind not in "iu" or v.ndim > 1:
            raise ValueError(f"{name} must be a 1-D integer sequence, got array {v.dtype} {v.shape}")
        return v.tolist()
    try:
        out = list(v)
    except TypeError:
        raise ValueError(f"{name} must be a sequence of ints, got {type(v).__name__}") from None
    for x in out:
        if isinstance(x, bool) or not isinstance(x, (int, np.integer)):
            raise ValueError(f"{name} must hold ints, got {x!r}")
    return [int(x) for x in out]


def _check_range(name: str, ids: list[int], n: int, what: str) -> None:
    if ids:
        lo, hi = min(ids), max(ids)
        if lo < 0 or hi >= n:
            bad = lo if lo < 0 else hi
            raise ValueError(f"{name}: {what} {bad} out of range [0, {n})")
    if len(set(ids)) != len(ids):
        seen = set()
        for x in ids:
            if x in seen:
                raise ValueError(f"{name}: {what} {x} given twice")
            seen.add(x)


def validate_transfer(dev, host, block_ids, slots, layers) -> tuple[list[int], list[int], Optional[list[int]]]:
    """Check a transfer order; return (block_ids, slots, layers) as int lists (layers None = all).
    Raises ValueError before any byte moves (see the module docstring)."""
    from tierkv.connector.l2.device_pool import DevicePool
    from tierkv.connector.l2.host_pool import HostPool

    if not isinstance(dev, DevicePool) or not isinstance(host, HostPool):
        raise ValueError(f"expected an L1 DevicePool and an L2 HostPool, got {type(dev).__name__} as the device "
                         f"pool and {type(host).__name__} as the host pool (save_pages(dev, host, block_ids, slots); "
                         "load_pages(host, dev, slots, block_ids))")
    host.check_compatible(dev)
    b = _as_int_list("block_ids", block_ids)
    s = _as_int_list("slots", slots)
    if len(b) != len(s):
        raise ValueError(f"block_ids has {len(b)} entries and slots {len(s)}: one slot per block (page) expected")
    _check_range("block_ids", b, dev.num_blocks, "block id")
    _check_range("slots", s, host.num_slots, "slot")
    ls = None
    if layers is not None:
        ls = _as_int_list("layers", layers)
        _check_range("layers", ls, dev.num_layers, "layer")
        if len(ls) == dev.num_layers and ls == list(range(dev.num_layers)):
            ls = None
    return b, s, ls


def plan_runs(block_ids: list[int], slots: list[int]) -> list[tuple[int, int, int]]:
    """Merge (block, slot) pairs into runs ``(first_block, first_slot, length)`` where both ids are consecutive.
    Pairs are ordered by block id first (order never matters: ids are unique)."""
    if not block_ids:
        return []
    pairs = sorted(zip(block_ids, slots))
    runs = []
    b0, s0 = pairs[0]
    k = 1
    for b, s in pairs[1:]:
        if b == b0 + k and s == s0 + k:
            k += 1
        else:
            runs.append((b0, s0, k))
            b0, s0, k = b, s, 1
    runs.append((b0, s0, k))
    return runs


#: CPU implementation used when ``impl`` is not given: ``"numba"`` (default when numba imports) or ``"torch"``
#: (env ``TIERKV_CPU_KERNELS``)
CPU_KERNELS = os.environ.get("TIERKV_CPU_KERNELS", "numba")


def _impl(dev, impl: Optional[str]):
    if impl is None:
        if dev.device.type == "cuda":
            impl = "triton"
        else:
            from . import numba_impl
            impl = "numba" if CPU_KERNELS == "numba" and numba_impl.available() else "torch"
    if impl == "numba":
        from . import numba_impl
        if not numba_impl.available():
            raise ValueError("impl='numba' requested but numba is not installed (pip install numba)")
        return numba_impl
    if impl == "torch":
        from . import torch_impl
        return torch_impl
    if impl == "triton":
        from . import triton_impl
        return triton_impl
    raise ValueError(f"impl must be 'numba', 'torch' or 'triton', got {impl!r}")


def save_pages(dev, host, block_ids: Sequence[int], slots: Sequence[int], layers: Optional[Sequence[int]] = None,
               *, impl: Optional[str] = None, **kw) -> None:
    """L1 -> L2: copy block ``block_ids[i]`` (of ``layers``, default all) into host slot ``slots[i]``.

    On CPU the copy is complete on return. On CUDA it runs on the transfer side stream after the current stream's
    pending work; pass ``sync=False`` to return without waiting (the returned ``torch.cuda.Event`` marks the end).
    """
    b, s, ls = validate_transfer(dev, host, block_ids, slots, layers)
    if not b:
        return None
    return _impl(dev, impl).transfer(dev, host, b, s, ls, save=True, **kw)


def load_pages(host, dev, slots: Sequence[int], block_ids: Sequence[int], layers: Optional[Sequence[int]] = None,
               *, impl: Optional[str] = None, **kw) -> None:
    """L2 -> L1: copy host slot ``slots[i]`` into block ``block_ids[i]`` (of ``layers``, default all).
    Completion as for :func:`save_pages`."""
    b, s, ls = validate_transfer(dev, host, block_ids, slots, layers)
    if not b:
        return None
    return _impl(dev, impl).transfer(dev, host, b, s, ls, save=False, **kw)


def warm_up(dev, host, *, impl: Optional[str] = None) -> float:
    """Compile and run both transfer directions once, before the engine's first step (numba compiles a kernel on
    its first call: without this, the first step that saves or loads pays that compile, about a second). Copies
    block 0 into slot 0 and back, so the block's bytes are unchanged (vLLM never reads block 0, its null block).
    Returns the seconds it took."""
    import time

    t0 = time.perf_counter()
    save_pages(dev, host, [0], [0], impl=impl)
    load_pages(host, dev, [0], [0], impl=impl)
    return time.perf_counter() - t0
