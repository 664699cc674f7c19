"""CPU transfer kernels compiled with numba: one pass per page, every byte straight into its final position.

A move (any device layout, host layout and direction) is a list of (block, slot) pairs and a per-page unit table,
built once per (device pool, host pool, layer subset) and cached: each unit's source and destination byte offset in
a page and its kind. Units of all parts (K, V or MLA latent) share one table, so a page is read once. Unit kinds:
**row** (mode 0: contiguous on both sides, adjacent rows merged), **register transpose** (modes 1 and 3, 2-byte
dtypes: the CPU backend's K ``[D, N]`` <-> token-major ``[N, D]``, 16x16 elements or whole 64-byte cache lines) and
**tile transpose** (mode 2: an element loop for other sizes).

Units and pairs run in source order; row stores of whole aligned 32-byte pieces are non-temporal, transposes only
when their destination rows are at most :data:`NT_TRANSPOSE_MAX_STRIDE` bytes apart; a fence ends every call, so
the bytes are visible to other threads when it returns. Single-threaded. Compiled lazily on first use (~2 s) and
cached on disk (~0.5 s to load). Without numba :func:`available` is False and :mod:`tierkv.kernels` uses the torch
implementation. Why each choice: docs/developer-guide.md.
"""
from __future__ import annotations

import threading
import weakref
from typing import Optional

import numpy as np
import torch

try:  # numba is optional: the torch implementation is the fallback
    import numba
    import llvmlite.ir as ir
    from numba import types
    from numba.extending import intrinsic
    _NUMBA_ERROR: Optional[BaseException] = None
except Exception as exc:  # pragma: no cover - exercised only without numba
    numba = None
    _NUMBA_ERROR = exc

__all__ = ["available", "transfer", "plan", "copy_contiguous"]


def available() -> bool:
    """True when numba (and llvmlite) import; the kernels themselves compile on first use."""
    return numba is not None


# ---------------------------------------------------------------------------------------------- LLVM intrinsics
if numba is not None:
    # Every intrinsic takes absolute addresses (ints): passing arrays into the inlined helpers would make numba
    # reference-count them on every call (measured: an atomic pair per 128-byte row, 3x slower).
    def _addr_ptr(builder, addr, vty):
        return builder.inttoptr(addr, vty.as_pointer())

    def _set_nontemporal(builder, store):
        store.set_metadata("nontemporal", builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)]))

    def _make_copy(nbytes: int, nontemporal: bool = False):
        @intrinsic
        def copy_bytes(typingctx, dst, src):
            """Copy ``nbytes`` bytes from address ``src`` to address ``dst``. The non-temporal variant needs
            ``dst`` aligned to ``nbytes``."""
            sig = types.void(types.intp, types.intp)

            def codegen(context, builder, signature, args):
                d, s_ = args
                vty = ir.VectorType(ir.IntType(8), nbytes) if nbytes >= 16 else ir.IntType(8 * nbytes)
                v = builder.load(_addr_ptr(builder, s_, vty), align=1)
                st = builder.store(v, _addr_ptr(builder, d, vty), align=nbytes if nontemporal else 1)
                if nontemporal:
                    _set_nontemporal(builder, st)
                return context.get_dummy_value()
            return sig, codegen
        return copy_bytes

    def _shuffle(builder, a, b, idx):
        mask = ir.Constant(ir.VectorType(ir.IntType(32), len(idx)), [ir.Constant(ir.IntType(32), i) for i in idx])
        return builder.shuffle_vector(a, b, mask)

    def _unpack_masks(size: int):
        """Per-128-bit-lane unpack-low/high masks of two ``<16 x i16>`` vectors, pieces of ``size`` elements."""
        lo, hi = [], []
        for lane in range(2):
            base, k = lane * 8, 8 // size
            for which, out in ((0, lo), (k // 2, hi)):
                for g in range(k // 2):
                    for src in (0, 16):
                        out.extend(src + base + (g + which) * size + e for e in range(size))
        return lo, hi

    def _make_transpose16(nontemporal: bool, tiles: int = 1):
        @intrinsic
        def transpose16(typingctx, src, ss, dst, ds):
            """Transpose of 2-byte elements: source row ``i`` (16 elements at address ``src + i*ss``, ``i`` <
            16 * ``tiles``) becomes column ``i`` of the destination (16 rows of 16 * ``tiles`` elements at
            ``dst + c*ds``); strides in bytes. ``tiles`` = 2 writes whole 64-byte destination lines."""
            sig = types.void(types.intp, types.intp, types.intp, types.intp)

            def codegen(context, builder, signature, args):
                s_, ss_, d, ds_ = args
                vty = ir.VectorType(ir.IntType(16), 16)
                out = [one_tile(builder, s_, ss_, vty, tile) for tile in range(tiles)]
                for row in range(16):  # the pieces of one destination row back to back (whole lines)
                    for tile in range(tiles):
                        a = builder.add(d, builder.add(builder.mul(ds_, ir.Constant(ds_.type, row)),
                                                       ir.Constant(ds_.type, 32 * tile)))
                        st = builder.store(out[tile][row], _addr_ptr(builder, a, vty),
                                           align=32 if nontemporal else 2)
                        if nontemporal:
                            _set_nontemporal(builder, st)
                return context.get_dummy_value()

            def one_tile(builder, s_, ss_, vty, tile):
                rows = [builder.load(_addr_ptr(builder, builder.add(s_, builder.mul(ss_, ir.Constant(
                    ss_.type, 16 * tile + i))), vty), align=2) for i in range(16)]
                m16, m32, m64 = _unpack_masks(1), _unpack_masks(2), _unpack_masks(4)

                def eight(r):  # in-lane 8x8 transposes of rows r[0..7]: out[c] = (col c | col 8+c) of 8 rows
                    t = []
                    for i in range(0, 8, 2):
                        t += [_shuffle(builder, r[i], r[i + 1], m16[0]), _shuffle(builder, r[i], r[i + 1], m16[1])]
                    u = []
                    for a, b in ((0, 2), (1, 3), (4, 6), (5, 7)):
                        u += [_shuffle(builder, t[a], t[b], m32[0]), _shuffle(builder, t[a], t[b], m32[1])]
                    o = []
                    for k in range(4):
                        o += [_shuffle(builder, u[k], u[k + 4], m64[0]), _shuffle(builder, u[k], u[k + 4], m64[1])]
                    return o
                top, bottom = eight(rows[:8]), eight(rows[8:])
                low_lanes = list(range(0, 8)) + list(range(16, 24))
                high_lanes = list(range(8, 16)) + list(range(24, 32))
                out = [None] * 16
                for c in range(8):
                    out[c] = _shuffle(builder, top[c], bottom[c], low_lanes)
                    out[c + 8] = _shuffle(builder, top[c], bottom[c], high_lanes)
                return out
            return sig, codegen
        return transpose16

    @intrinsic
    def _fence(typingctx):
        """A full memory fence (orders the weakly ordered non-temporal stores before the kernel returns)."""
        def codegen(context, builder, signature, args):
            builder.fence("seq_cst")
            return context.get_dummy_value()
        return types.void(), codegen

    _copy1, _copy2, _copy4, _copy8 = _make_copy(1), _make_copy(2), _make_copy(4), _make_copy(8)
    _copy32 = _make_copy(32)
    _copy32_nt = _make_copy(32, True)
    _transpose16 = _make_transpose16(False)
    _transpose16_nt = _make_transpose16(True)
    _transpose32 = _make_transpose16(False, 2)
    _transpose32_nt = _make_transpose16(True, 2)

    @numba.njit(nogil=True, cache=True, inline="always")
    def _element(d, s, esz):
        if esz == 2:
            _copy2(d, s)
        elif esz == 4:
            _copy4(d, s)
        elif esz == 8:
            _copy8(d, s)
        else:
            for x in range(esz):
                _copy1(d + x, s + x)

    @numba.njit(nogil=True, cache=True, inline="always")
    def _row(d, s, n, nt):
        """Copy ``n`` bytes from address ``s`` to ``d``; aligned 32-byte pieces non-temporally when ``nt``."""
        if ((d | n) & 31) == 0:  # the common case: whole aligned 32-byte pieces
            if nt:
                for i in range(0, n, 32):
                    _copy32_nt(d + i, s + i)
            else:
                for i in range(0, n, 32):
                    _copy32(d + i, s + i)
            return
        i = 0
        if nt:
            head = (32 - (d & 31)) & 31
            if head > n:
                head = n
            while i < head:
                _copy1(d + i, s + i)
                i += 1
            while i + 32 <= n:
                _copy32_nt(d + i, s + i)
                i += 32
        else:
            while i + 32 <= n:
                _copy32(d + i, s + i)
                i += 32
        while i + 8 <= n:
            _copy8(d + i, s + i)
            i += 8
        while i < n:
            _copy1(d + i, s + i)
            i += 1

    @numba.njit(nogil=True, cache=True, inline="always")
    def _unit(d, s, mode, rowbytes, srs, drs, rows, cols, esz, nt, tnt):
        if mode == 0:
            _row(d, s, rowbytes, nt)
        elif mode == 1:
            if tnt and (d & 31) == 0 and (drs & 31) == 0:
                _transpose16_nt(s, srs, d, drs)
            else:
                _transpose16(s, srs, d, drs)
        elif mode == 3:
            if tnt and (d & 31) == 0 and (drs & 31) == 0:
                _transpose32_nt(s, srs, d, drs)
            else:
                _transpose32(s, srs, d, drs)
        else:  # element loop: src (i, j) at s + i*srs + j*esz -> dst (j, i) at d + j*drs + i*esz
            for i in range(rows):
                for j in range(cols):
                    _element(d + j * drs + i * esz, s + i * srs + j * esz, esz)

    @numba.njit(nogil=True, cache=True)
    def _move(dst, src, pair_src, pair_dst, unit_src, unit_dst, unit_len, unit_mode, srs, drs, rows, cols, esz, nt,
              tnt):
        """For every pair ``p`` and unit ``u``: one unit (mode 0: row of ``unit_len[u]`` bytes; 1, 3: register
        transposes, 16 or 32 source rows; 2: element-loop transpose of a ``rows`` x ``cols`` tile) from address
        ``src + pair_src[p] + unit_src[u]`` to ``dst + pair_dst[p] + unit_dst[u]``. ``nt``/``tnt``: non-temporal
        stores for rows / transposes."""
        nu = unit_src.shape[0]
        for p in range(pair_src.shape[0]):
            s0 = src + pair_src[p]
            d0 = dst + pair_dst[p]
            for u in range(nu):
                _unit(d0 + unit_dst[u], s0 + unit_src[u], unit_mode[u], unit_len[u], srs, drs, rows, cols, esz, nt,
                      tnt)
        if nt or tnt:
            _fence()


# ---------------------------------------------------------------------------------------------- planning
class _Group:
    """Everything one :func:`_move` call needs for the layers of one storage (vLLM: all layers), all parts of a
    page together (K and V interleave in device memory, so one pass per page reads it once). Offsets in bytes."""

    def __init__(self, dev_raw, host_raw, dev_block, host_slot):
        self.dev_raw, self.host_raw = dev_raw, host_raw  # uint8 tensors over the whole storages
        self.dev_block, self.host_slot = dev_block, host_slot  # bytes between blocks / slots
        self.pieces = []  # (dev offsets, host offsets, mode, rowbytes, directions) per part
        self.dev_rs = self.host_rs = self.rows = self.cols = 0  # transposes: row strides, tile (mode 2)
        self.esz = 1

    def add(self, dev_layers, host_layers, dims, mode, rowbytes, dirs=(True, False)):
        """A part: units at every point of ``dims`` ((count, device stride, host stride) in bytes) for every layer
        offset; ``dirs`` = the directions (True = save) that use these units."""
        dev_off, host_off = np.asarray(dev_layers, np.int64), np.asarray(host_layers, np.int64)
        for count, ds, hs in dims:  # outer product of every dim with the layer offsets
            i = np.arange(count, dtype=np.int64)
            dev_off = (dev_off[:, None] + i[None, :] * ds).reshape(-1)
            host_off = (host_off[:, None] + i[None, :] * hs).reshape(-1)
        self.pieces.append((dev_off, host_off, mode, rowbytes, dirs))

    def units(self, save: bool):
        """(src offsets, dst offsets, lengths, modes) of one page in source order (reads stream front to back,
        which beats destination order once the stores are non-temporal); rows that continue each other on
        both sides are merged."""
        pieces = [p for p in self.pieces if save in p[4]]
        src = np.concatenate([p[0] if save else p[1] for p in pieces])
        dst = np.concatenate([p[1] if save else p[0] for p in pieces])
        length = np.concatenate([np.full(p[0].shape[0], p[3], np.int64) for p in pieces])
        mode = np.concatenate([np.full(p[0].shape[0], p[2], np.int64) for p in pieces])
        order = np.argsort(src, kind="stable")
        src, dst, length, mode = src[order], dst[order], length[order], mode[order]
        if src.shape[0] > 1:
            cont = (mode[1:] == 0) & (mode[:-1] == 0) & (src[1:] == src[:-1] + length[:-1]) & \
                   (dst[1:] == dst[:-1] + length[:-1])
            starts = np.flatnonzero(np.concatenate([[True], ~cont]))
            ends = np.append(starts[1:], src.shape[0])
            csum = np.concatenate([[0], np.cumsum(length)])
            length = csum[ends] - csum[starts]
            src, dst, mode = src[starts], dst[starts], mode[starts]
        return tuple(np.ascontiguousarray(x) for x in (src, dst, length, mode))


def _raw_bytes(t: torch.Tensor) -> torch.Tensor:
    st = t.untyped_storage()
    return torch.empty(0, dtype=torch.uint8, device=t.device).set_(st, 0, (st.nbytes(),), (1,))


def _storage_groups(dev, layers):
    """Selected layers grouped by storage (vLLM: one group), as lists of layer indices."""
    groups: dict = {}
    for l in layers:
        ptr = dev.block_bytes_view(l).untyped_storage().data_ptr()
        groups.setdefault(ptr, []).append(l)
    return list(groups.values())


def _groups(dev, host, layers: list[int]) -> list[_Group]:
    out = []
    hraw = host.buffer
    e = dev.esz
    r, n, H, D = dev.ratio, dev.kernel_block_size, dev.num_kv_heads, dev.head_dim
    for grp in _storage_groups(dev, layers):
        v0 = dev.block_bytes_view(grp[0])
        if host.layout == "layer_first":
            hv = host.layer_view()  # [L, S, bb]
            g = _Group(_raw_bytes(v0), hraw, v0.stride(0), hv.stride(1))
            g.add([dev.block_bytes_view(l).storage_offset() for l in grp], [hv[l].storage_offset() for l in grp],
                  [], 0, dev.block_bytes)
            out.append(g)
            continue
        hs0 = host.slot_view(dev.parts()[0])
        g = _Group(_raw_bytes(v0), hraw, v0.stride(0), hs0.stride(0) * e)
        for part in dev.parts():
            hs = host.slot_view(part).unflatten(2, (r, n))  # [S, L, r, n, H, D]
            hS, hL, hR, hN, hH, hD = (x * e for x in hs.stride())
            views = [dev.semantic_view(part, l) for l in grp]  # [B, r, n, H, D]
            dB, dR, dN, dH, dD = (x * e for x in views[0].stride())
            if hS != g.host_slot or dB != g.dev_block or hD != e:  # pragma: no cover - fixed by the pool layouts
                raise ValueError(f"unexpected strides for part {part!r}")
            dlay = [v.storage_offset() * e for v in views]
            hlay = [hs.storage_offset() * e + l * hL for l in grp]
            if dD == e:  # rows of D elements on both sides
                g.add(dlay, hlay, [(r, dR, hR), (n, dN, hN), (H, dH, hH)], 0, D * e)
            elif dN == e and e == 2 and n % 16 == 0 and D % 16 == 0:  # K^T [D, n]: register transposes
                for save in (True, False):
                    # whole 64-byte destination lines where the dims allow: save writes 32 dims of a token row,
                    # load 32 tokens of a K^T row
                    nt_, dt_ = (16, 32) if save else (32, 16)
                    wide = n % nt_ == 0 and D % dt_ == 0
                    if not wide:
                        nt_ = dt_ = 16
                    g.add(dlay, hlay, [(r, dR, hR), (n // nt_, nt_ * dN, nt_ * hN), (H, dH, hH),
                                       (D // dt_, dt_ * dD, dt_ * hD)], 3 if wide else 1, 0, dirs=(save,))
                g.dev_rs, g.host_rs = dD, hN
            elif dN == e:  # K^T, element loop over a whole [D, n] tile
                g.add(dlay, hlay, [(r, dR, hR), (H, dH, hH)], 2, 0)
                g.dev_rs, g.host_rs, g.rows, g.cols, g.esz = dD, hN, D, n, e
            else:  # pragma: no cover - DevicePool only builds these strides
                raise ValueError(f"unsupported device strides for part {part!r}: {views[0].stride()}")
        out.append(g)
    return out


#: plans cached per (device pool, host pool, layers)
_plan_cache: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_plan_lock = threading.Lock()


def plan(dev, host, layers: Optional[list[int]]) -> list[_Group]:
    """The unit tables of a move between ``dev`` and ``host`` for ``layers`` (None = all), cached per pool pair."""
    key = (id(host), None if layers is None else tuple(layers))
    with _plan_lock:
        hit = _plan_cache.setdefault(dev, {}).get(key)
        if hit is not None and hit[0]() is host:
            return hit[1]
    groups = _groups(dev, host, list(range(dev.num_layers)) if layers is None else list(layers))
    for g in groups:
        g.save_units, g.load_units = g.units(True), g.units(False)
        del g.pieces
    with _plan_lock:
        _plan_cache.setdefault(dev, {})[key] = (weakref.ref(host), groups)
    return groups


#: stores of whole aligned 32-byte pieces bypass the cache (see the module docstring); False = ordinary stores
NONTEMPORAL = True
#: transposes store non-temporally only when their destination rows are at most this many bytes apart: one unit
#: writes 16 rows, and with rows further apart (page_first's 4 KiB token rows) ordinary stores measured faster
#: (page_first saves 56 % -> 75 % of copy_), with rows close together non-temporal ones (K^T rows of a device
#: block on load: 66 % -> 75 %; page_first_direct saves: 79 % -> 89 %)
NT_TRANSPOSE_MAX_STRIDE = 1024


def transfer(dev, host, block_ids: list[int], slots: list[int], layers: Optional[list[int]], save: bool,
             **_ignored) -> None:
    """Move pages; arguments already validated by :func:`tierkv.kernels.validate_transfer`."""
    if numba is None:  # pragma: no cover
        raise RuntimeError(f"numba is not available: {_NUMBA_ERROR}")
    if dev.device.type != "cpu":
        raise ValueError(f"the numba kernels move CPU tensors only, got device {dev.device}")
    blocks = np.asarray(block_ids, np.int64)
    slot_arr = np.asarray(slots, np.int64)
    for g in plan(dev, host, layers):
        b, s = blocks * g.dev_block, slot_arr * g.host_slot
        if save:
            src, dst, ps, pd, units = g.dev_raw, g.host_raw, b, s, g.save_units
            srs, drs, rows, cols = g.dev_rs, g.host_rs, g.rows, g.cols
        else:
            src, dst, ps, pd, units = g.host_raw, g.dev_raw, s, b, g.load_units
            srs, drs, rows, cols = g.host_rs, g.dev_rs, g.cols, g.rows
        order = np.argsort(ps, kind="stable")  # source front to back
        _move(dst.data_ptr(), src.data_ptr(), ps[order], pd[order], *units, srs, drs, rows, cols, g.esz,
              NONTEMPORAL, NONTEMPORAL and 0 < drs <= NT_TRANSPOSE_MAX_STRIDE)


def copy_contiguous(dst: torch.Tensor, src: torch.Tensor, nontemporal: bool = True) -> None:
    """``dst.copy_(src)`` for two contiguous CPU tensors of the same byte size, through the same row kernel (and
    the same non-temporal stores) as :func:`transfer`: the benchmark's "best possible" contiguous reference.
    Raises ValueError for tensors that are not contiguous CPU tensors of equal byte size."""
    if numba is None:  # pragma: no cover
        raise RuntimeError(f"numba is not available: {_NUMBA_ERROR}")
    n = dst.numel() * dst.element_size()
    if (dst.device.type != "cpu" or src.device.type != "cpu" or not dst.is_contiguous() or not src.is_contiguous()
            or src.numel() * src.element_size() != n):
        raise ValueError("copy_contiguous: dst and src must be contiguous CPU tensors of the same byte size")
    zero = np.zeros(1, np.int64)
    _move(dst.data_ptr(), src.data_ptr(), zero, zero, zero, zero, np.array([n], np.int64), zero, 0, 0, 0, 0, 1,
          nontemporal, False)
