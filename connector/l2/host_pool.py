"""L2: tierkv's host pool (DRAM, pinned on CUDA machines); its slot allocator is in :mod:`.slot_allocator`.

One flat ``uint8`` buffer of ``num_slots`` (``S``) pages; a page holds one manager block of every layer. The config
key ``host_pool.layout`` picks how the buffer is seen (and the runs of one page, in ``read_page`` order):

- ``layer_first``: ``uint8 [L, S, block_bytes]``, device blocks' bytes as the backend packs them; ``L`` runs.
- ``page_first``: ``[2, S*p, L, H, D]`` (MLA ``[S*p, L, 1, C]``); 2 runs, K then V (MLA: 1 run).
- ``page_first_direct``: ``[2, S, L, p, H, D]`` (MLA ``[S, L, p, 1, C]``); 2 runs, K then V (MLA: 1 run).

``L`` layers, ``p`` tokens per page, ``H`` KV heads, ``D`` head dim, ``C`` MLA latent width. The ``page_first``
layouts are semantic: K and V (or the latent) decoded from the device packing, stored token-major. Page bytes
(:meth:`HostPool.read_page`, what L3 stores) are a page's runs concatenated; they depend on the host layout and, for
``layer_first``, the device layout, so :attr:`HostPool.kv_layout` (``"<host layout>/<device layout tag>"``) must go
into ``ModelNamespace.kv_layout``. Why ``layer_first`` is opaque bytes: docs/developer-guide.md.
"""
from __future__ import annotations

import logging
import warnings
from typing import Optional

import numpy as np
import torch
import xxhash

from tierkv.connector.core.config import HOST_POOL_LAYOUTS
from .device_pool import DevicePool, KVGeometry

log = logging.getLogger(__name__)


def _copy_bytes(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst[...] = src`` for CPU ``uint8`` tensors of one shape (either may be strided), with numpy: one thread,
    the GIL released during the copy. ``read_page``/``write_page`` run on tierkv's L3 I/O threads; torch's ``copy_``
    of a 64 KiB strided page runs an OpenMP parallel region, and from a thread other than the engine's that starts a
    second OpenMP team which then spins on the cores the engine's forward runs on."""
    np.copyto(dst.numpy(), src.numpy())


def _as_uint8(src) -> torch.Tensor:
    if isinstance(src, torch.Tensor):
        if src.dtype != torch.uint8:
            src = src.contiguous().view(torch.uint8)
        return src.reshape(-1)
    if isinstance(src, np.ndarray):
        return torch.from_numpy(np.ascontiguousarray(src).view(np.uint8).reshape(-1))
    if isinstance(src, (bytes, bytearray, memoryview)):
        if len(src) == 0:
            return torch.empty(0, dtype=torch.uint8)
        with warnings.catch_warnings():  # read-only buffers are fine: we only read from them
            warnings.simplefilter("ignore")
            return torch.frombuffer(src, dtype=torch.uint8)
    raise TypeError(f"page source must be a uint8 tensor, numpy array or bytes-like, got {type(src).__name__}")


class HostPool:
    """The L2 memory: ``num_slots`` pages of ``num_layers`` x ``block_bytes`` bytes (worker side).

    Args:
        num_slots: pages in the pool.
        num_layers: layers per page.
        block_bytes: bytes of one page of one layer (``DevicePool.block_bytes``).
        layout: ``layer_first`` | ``page_first`` | ``page_first_direct`` (module docstring).
        pin_memory: page-lock the buffer (CUDA only; without CUDA a warning is logged and it stays pageable).
        geometry: :class:`~tierkv.connector.l2.device_pool.KVGeometry`; required by the semantic layouts, optional
            for ``layer_first`` (then only layer count and block bytes are checked against a device pool).
        prefault: zero the (unpinned) buffer once when it is allocated, so the kernel maps every one of its pages
            at start-up. Left to first use, each 4 KiB of a slot is mapped by a page fault (the kernel zeroes the
            page) inside the first L1 -> L2 save that writes it, on the engine's forward path and several times
            slower than the copy itself, and the memory is taken only as L2 fills. A pinned buffer is resident
            already. The connector prefaults a pool whose size the operator gave (``host_pool.num_pages`` or
            ``size_gb``), not an automatically sized one (a share of the host's memory, taken as it is used).
    Raises:
        ValueError: bad sizes, unknown layout, missing or inconsistent geometry.
    """

    def __init__(self, num_slots: int, num_layers: int, block_bytes: int, layout: str = "layer_first",
                 pin_memory: bool = False, geometry: Optional[KVGeometry] = None, prefault: bool = True):
        for name, v in (("num_slots", num_slots), ("num_layers", num_layers), ("block_bytes", block_bytes)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"HostPool: {name} must be a positive int, got {v!r}")
        if layout not in HOST_POOL_LAYOUTS:
            raise ValueError(f"HostPool: unknown layout {layout!r}; allowed: {HOST_POOL_LAYOUTS}")
        if geometry is not None and geometry.block_bytes != block_bytes:
            raise ValueError(f"HostPool: geometry gives {geometry.block_bytes} bytes per block and layer, "
                             f"block_bytes={block_bytes}")
        if layout != "layer_first" and geometry is None:
            raise ValueError(f"HostPool: layout {layout!r} stores K/V semantically and needs a geometry "
                             f"(use HostPool.for_device)")
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.block_bytes = block_bytes
        self.layout = layout
        self.geometry = geometry
        self.page_bytes = num_layers * block_bytes
        self.device_tag: Optional[str] = None
        if pin_memory and not torch.cuda.is_available():
            log.warning("HostPool: pin_memory requested but CUDA is not available; using pageable memory")
            pin_memory = False
        self.pinned = bool(pin_memory)
        self.buffer = torch.empty(num_slots * self.page_bytes, dtype=torch.uint8, pin_memory=self.pinned)
        self.prefaulted = bool(prefault and not self.pinned)
        if self.prefaulted:
            self.buffer.numpy().fill(0)  # map every page now (numpy: no OpenMP team on whatever thread builds it)
        self.nbytes = self.buffer.numel()
        L, S = num_layers, num_slots
        self.semantic = layout != "layer_first"
        if layout == "layer_first":
            self._pages = self.buffer.view(L, S, block_bytes).transpose(0, 1)  # [S, L, bb]
        elif geometry.use_mla:
            self._pages = self.buffer.view(S, 1, self.page_bytes)
        else:
            self._pages = self.buffer.view(2, S, self.page_bytes // 2).transpose(0, 1)  # [S, 2, bytes/2]
        self._views: dict = {}
        self._np_pages = self._pages.numpy()  # the same [S, runs, run bytes] view, for page_checksum

    @classmethod
    def for_device(cls, dev: DevicePool, num_slots: int, layout: str = "layer_first",
                   pin_memory: bool = False, prefault: bool = True) -> "HostPool":
        """A pool shaped for ``dev`` (same layers, block bytes, dtype, heads, head dim, page size)."""
        pool = cls(num_slots, dev.num_layers, dev.block_bytes, layout, pin_memory, geometry=dev.geometry,
                   prefault=prefault)
        pool.device_tag = dev.layout_tag
        return pool

    # ------------------------------------------------------------------ identity
    @property
    def kv_layout(self) -> str:
        """Name of the page byte layout for ``ModelNamespace.kv_layout``: ``"<host layout>/<device tag>"``.
        Semantic layouts name the device too because the CPU decode depends on the backend's packing."""
        return f"{self.layout}{'-mla' if self.geometry and self.geometry.use_mla else ''}/{self.device_tag or 'opaque'}"

    def check_compatible(self, dev: DevicePool) -> None:
        """ValueError naming the first difference between this pool and ``dev`` (layers, block bytes, dtype,
        heads, head dim, page size, MLA, device layout)."""
        if dev.num_layers != self.num_layers:
            raise ValueError(f"L1/L2 mismatch: device pool has {dev.num_layers} layers, host pool {self.num_layers}")
        if self.geometry is not None:
            g, d = self.geometry, dev.geometry
            for f in ("dtype", "use_mla", "page_size", "num_kv_heads", "head_dim"):
                if getattr(g, f) != getattr(d, f):
                    raise ValueError(f"L1/L2 mismatch: {f} is {getattr(d, f)} on the device pool, "
                                     f"{getattr(g, f)} in the host pool")
        if dev.block_bytes != self.block_bytes:
            raise ValueError(f"L1/L2 mismatch: device block is {dev.block_bytes} bytes per layer, host pool "
                             f"{self.block_bytes}")
        if self.device_tag is not None and dev.layout_tag != self.device_tag:
            raise ValueError(f"L1/L2 mismatch: host pool was made for device layout {self.device_tag!r}, "
                             f"device pool is {dev.layout_tag!r}")

    # ------------------------------------------------------------------ views used by the kernels
    def layer_view(self) -> torch.Tensor:
        """``layer_first`` only: ``uint8 [num_layers, num_slots, block_bytes]``."""
        if self.layout != "layer_first":
            raise ValueError(f"layer_view is for layout layer_first, this pool is {self.layout}")
        return self.buffer.view(self.num_layers, self.num_slots, self.block_bytes)

    def slot_view(self, part: str) -> torch.Tensor:
        """Semantic layouts: ``[num_slots, L, p, H, D]`` view of ``part`` (``"k"``, ``"v"``; MLA ``"latent"``
        with ``H`` = 1, ``D`` = C), in the element dtype. ``page_first`` returns a permuted (non-contiguous) view."""
        v = self._views.get(part)
        if v is not None:
            return v
        if not self.semantic:
            raise ValueError("slot_view is for the semantic layouts page_first / page_first_direct")
        g = self.geometry
        parts = ("latent",) if g.use_mla else ("k", "v")
        if part not in parts:
            raise ValueError(f"part {part!r} unknown for this pool; allowed: {parts}")
        S, L, p, H, D = self.num_slots, self.num_layers, g.page_size, g.num_kv_heads, g.head_dim
        typed = self.buffer.view(g.dtype)
        if g.use_mla:
            plane = typed
        else:
            plane = typed.view(2, -1)[0 if part == "k" else 1]
        if self.layout == "page_first":
            v = plane.view(S, p, L, H, D).transpose(1, 2)
        else:
            v = plane.view(S, L, p, H, D)
        self._views[part] = v
        return v

    # ------------------------------------------------------------------ page bytes (L3 side)
    def _check_slot(self, slot) -> int:
        if isinstance(slot, bool) or not isinstance(slot, (int, np.integer)) or not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot!r} out of range [0, {self.num_slots})")
        return int(slot)

    def page_views(self, slot: int) -> list[torch.Tensor]:
        """Zero-copy ``uint8`` views of the page's runs in page-byte order (1 run, 2 runs K/V, or one per layer):
        for vectored L3 writes. They alias the pool: do not keep them past the slot's life."""
        s = self._check_slot(slot)
        m = self._pages[s]
        return [m[i] for i in range(m.shape[0])]

    def page_runs(self, slot: int) -> list[np.ndarray]:
        """The page's runs as ``uint8`` numpy views of the pool, in page-byte order (one per layer for
        ``layer_first``, K then V for the semantic layouts, one for MLA): what a store with vectored writes
        (``StorageBackend.vectored_sources``) is given instead of a staged copy. Cheaper to build than
        :meth:`page_views` (one numpy view of the pool made at construction). They alias the pool: do not keep
        them past the slot's life. Raises ValueError for a bad slot."""
        return list(self._np_pages[self._check_slot(slot)])

    def read_page(self, slot: int, out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The page's bytes, ``uint8 [page_bytes]`` (for L3 writes).

        Without ``out``: a zero-copy view when the page is one contiguous run (MLA semantic layouts), else a new
        tensor. With ``out`` (``uint8``, ``page_bytes`` elements, contiguous): copied into it and returned.
        Raises ValueError for a bad slot or ``out``."""
        s = self._check_slot(slot)
        m = self._pages[s]
        if out is None:
            if m.is_contiguous():
                return m.reshape(-1)
            out = torch.empty(self.page_bytes, dtype=torch.uint8)
        if out.dtype != torch.uint8 or out.numel() != self.page_bytes or not out.is_contiguous():
            raise ValueError(f"read_page: out must be a contiguous uint8 tensor of {self.page_bytes} bytes, got "
                             f"{out.dtype} x {out.numel()}")
        _copy_bytes(out.view(m.shape), m)
        return out

    def write_page(self, slot: int, src) -> None:
        """Store page bytes (as returned by :meth:`read_page`, e.g. read back from L3) into ``slot``.
        ``src``: uint8 tensor, numpy array or bytes-like of exactly ``page_bytes`` bytes (ValueError otherwise)."""
        s = self._check_slot(slot)
        t = _as_uint8(src)
        if t.numel() != self.page_bytes:
            raise ValueError(f"write_page: page source has {t.numel()} bytes, a page is {self.page_bytes}")
        m = self._pages[s]
        _copy_bytes(m, t.view(m.shape))

    def page_checksum(self, slot: int) -> int:
        """xxhash XXH3-64 of the page's bytes (same value as hashing ``read_page(slot)``). Hashes the page's runs
        through one numpy view of the pool made at construction: a torch view and its ``.numpy()`` per run cost more
        than hashing the run. Raises ValueError for a bad slot."""
        h = xxhash.xxh3_64()
        for run in self._np_pages[self._check_slot(slot)]:
            h.update(run)
        return h.intdigest()

    def __repr__(self) -> str:
        return (f"HostPool({self.kv_layout}, slots={self.num_slots}, layers={self.num_layers}, "
                f"page_bytes={self.page_bytes}, pinned={self.pinned})")
