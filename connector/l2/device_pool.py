"""L1 adapter: the engine's paged KV tensors, seen as blocks of bytes and as K/V (or latent) token views.

:class:`DevicePool` takes the per-layer KV tensors the engine registers (views of one allocation) and builds views,
never copies, for :mod:`tierkv.kernels`:

* block bytes: ``uint8 [num_blocks, block_bytes]`` per layer, row ``b`` = every byte of manager block ``b``;
  layouts ``LBNHC``/``NHD``, ``LBHNC``/``HND``, ``BLNHC``, ``BLHNC`` (``BHLNC``, ``LHBNC`` are refused);
* semantic views: ``k``/``v`` ``[num_blocks, r, n, H, D]`` (``r`` kernel blocks of ``n`` tokens per manager block,
  ``H`` KV heads, ``D`` head dim), MLA ``latent`` ``[num_blocks, r, n, 1, C]``, decoded with strides only;
* all-layer views with a leading ``L`` dim, when every layer sits in one storage at a constant layer stride.

:attr:`DevicePool.layout_tag` (:func:`device_layout_tag`, e.g. ``"cpu-amx/LBHNC"``, ``"flash/LBNHC"``) names the
device kind, the CPU attention ISA and the layout; it is part of the page-key namespace. Tensors this adapter cannot
read raise ValueError. Packing per device kind and the ISA caveat: docs/developer-guide.md.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

import torch

from tierkv.connector.cpu.cpu_features import cpu_flags

#: attention backend names (vLLM ``AttentionBackendEnum`` names, case-insensitive) -> device kind
_BACKEND_KINDS = {
    "cpu_attn": "cpu",
    "cpu": "cpu",
    "torch_sdpa": "cpu",
    "flash_attn": "flash",
    "flash_attention": "flash",
    "flashinfer": "flash",
    "triton_attn": "flash",
    "rocm_attn": "flash",
    "rocm_aiter_fa": "flash",
    "rocm_aiter_unified_attn": "flash",
    "flex_attention": "flash",
}
#: ``KVCacheLayout`` names (and legacy aliases) this adapter handles -> (token-major inside a block?, block-outermost?)
_LAYOUTS = {
    "LBNHC": (True, False),
    "NHD": (True, False),
    "LBHNC": (False, False),
    "HND": (False, False),
    "BLNHC": (True, True),
    "BLHNC": (False, True),
}
_UNSUPPORTED_LAYOUTS = ("BHLNC", "LHBNC")
DEVICE_KINDS = ("cpu", "flash", "mla")


#: layout name aliases -> the ``KVCacheLayout`` name used in :func:`device_layout_tag` (one name per byte order)
_LAYOUT_CANON = {"NHD": "LBNHC", "HND": "LBHNC"}


def device_kind(backend: Optional[str], device_type: str, use_mla: bool) -> str:
    """The device kind (``"cpu"``, ``"flash"`` or ``"mla"``) of an attention ``backend`` name (None = the platform's
    default: ``"cpu"`` for ``device_type == "cpu"``, else ``"flash"``); any backend naming MLA, or ``use_mla``, is
    ``"mla"``. Raises ValueError for a backend name this adapter does not know."""
    b = (backend or "").strip()
    if use_mla or "mla" in b.lower():
        return "mla"
    if not b:
        return "cpu" if device_type == "cpu" else "flash"
    if b.lower() not in _BACKEND_KINDS:
        raise ValueError(f"unknown attention backend {backend!r}; supported: "
                         f"{sorted(k.upper() for k in _BACKEND_KINDS)} and MLA backends")
    return _BACKEND_KINDS[b.lower()]


def device_layout_tag(kind: str, kv_cache_layout: Optional[str], isa: Optional[str] = None) -> str:
    """Text naming how a device packs a page's bytes: ``"<kind>[-<isa>]/<layout>"``.

    ``isa`` is the CPU attention ISA (``"amx"``, ``"vec"``, ``"vec16"``, ``"neon"``, ...; only for ``kind == "cpu"``,
    ignored otherwise); the layout is the ``KVCacheLayout`` name with the aliases ``NHD``/``HND`` written as
    ``LBNHC``/``LBHNC`` (same bytes, one name). The CPU backend's layout is always ``LBHNC``."""
    lay = (kv_cache_layout or "").upper()
    lay = _LAYOUT_CANON.get(lay, lay) or "auto"
    if kind == "cpu":
        return f"cpu-{isa or 'vec'}/LBHNC"
    return f"{kind}/{lay}"


@dataclass(frozen=True)
class KVGeometry:
    """What the bytes of one page mean: element ``dtype``, ``num_kv_heads`` (1 for MLA), ``head_dim`` (K head dim;
    for MLA the latent width ``C``), ``page_size`` (tokens per page = manager block), ``use_mla``.

    Used by :class:`tierkv.connector.l2.host_pool.HostPool` for its semantic layouts and to refuse a device pool of a
    different shape (ValueError before any byte moves)."""

    dtype: torch.dtype
    num_kv_heads: int
    head_dim: int
    page_size: int
    use_mla: bool = False

    @property
    def elem_size(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()

    @property
    def planes(self) -> int:
        """Number of planes per token: 2 (K and V) or 1 (MLA latent)."""
        return 1 if self.use_mla else 2

    @property
    def block_bytes(self) -> int:
        """Bytes of one page of one layer."""
        return self.planes * self.page_size * self.num_kv_heads * self.head_dim * self.elem_size


def _layer_sort_key(name: str):
    return tuple(int(x) for x in re.findall(r"\d+", name))


def _raw(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor of ``dtype`` over the whole storage of ``t`` (offset 0)."""
    storage = t.untyped_storage()
    esz = torch.empty((), dtype=dtype).element_size()
    return torch.empty(0, dtype=dtype, device=t.device).set_(storage, 0, (storage.nbytes() // esz,), (1,))


def _dense_extent(sizes, strides) -> Optional[int]:
    """If the elements addressed by (sizes, strides) form one dense run starting at offset 0, its length; else None."""
    dims = sorted((st, sz) for sz, st in zip(sizes, strides) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return None
        expect *= sz
    return expect


class DevicePool:
    """L1 adapter over the engine's registered KV tensors (see the module docstring for the layouts).

    Attributes:
        layer_names: attention layer names in layer order.
        num_layers, num_blocks (manager blocks), block_size (tokens per manager block).
        block_bytes: bytes of one block of ONE layer (all heads, K and V / latent).
        dtype, device: of the KV elements.
        kind: ``"cpu"``, ``"flash"`` or ``"mla"``; kv_cache_layout: the ``KVCacheLayout`` name;
        backend: the attention backend name as given (or inferred).
        geometry: :class:`KVGeometry`.
        isa: the CPU attention ISA named in the tag (None for other kinds).
        layout_tag: :func:`device_layout_tag` of this pool, e.g. ``"cpu-vec/LBHNC"``; part of the page-key
            namespace (``ModelNamespace.kv_layout``) via ``HostPool.kv_layout``.
    """

    def __init__(self, layer_names: list[str], tensors: list[torch.Tensor], *, num_blocks: int, block_size: int,
                 kind: str, kv_cache_layout: str, backend: str, use_mla: bool, isa: Optional[str] = None):
        if kind not in DEVICE_KINDS:
            raise ValueError(f"device kind {kind!r} unknown; allowed: {DEVICE_KINDS}")
        if not tensors:
            raise ValueError("no KV cache tensors given")
        self.layer_names = list(layer_names)
        self.num_layers = len(tensors)
        self.num_blocks = int(num_blocks)
        self.block_size = int(block_size)
        self.kind = kind
        self.kv_cache_layout = kv_cache_layout
        self.backend = backend
        self.use_mla = use_mla
        t0 = tensors[0]
        self.dtype = t0.dtype
        self.device = t0.device
        for name, t in zip(layer_names, tensors):
            if t.dtype != self.dtype or t.device != self.device or t.shape != t0.shape:
                raise ValueError(f"layer {name!r}: shape/dtype/device {tuple(t.shape)}/{t.dtype}/{t.device} differs "
                                 f"from layer {layer_names[0]!r} {tuple(t0.shape)}/{t0.dtype}/{t0.device}")
            if t.untyped_storage().data_ptr() == 0 and t.numel():
                raise ValueError(f"layer {name!r}: tensor has no storage")
        self.esz = t0.element_size()
        rows = t0.shape[0]
        if rows % self.num_blocks:
            raise ValueError(f"KV tensor of layer {layer_names[0]!r} has {rows} blocks, not a multiple of "
                             f"num_blocks={self.num_blocks}")
        self.ratio = rows // self.num_blocks
        if kind == "mla":
            t4 = [t if t.dim() == 4 else t.unsqueeze(1) for t in tensors]
            _, h, n, c = t4[0].shape
            if h != 1:
                raise ValueError(f"MLA KV tensor must have 1 head, got shape {tuple(t0.shape)}")
            heads, head_dim = 1, c
        else:
            t4 = list(tensors)
            _, h, n, c = t4[0].shape
            if c % 2:
                raise ValueError(f"KV tensor last dim {c} is odd: expected K and V of equal head size (2*head_dim)")
            heads, head_dim = h, c // 2
        self.kernel_block_size = n
        if n * self.ratio != self.block_size:
            raise ValueError(f"block_size={self.block_size} tokens does not match the KV tensors: {self.ratio} kernel "
                             f"blocks of {n} tokens per manager block (shape {tuple(t0.shape)}, num_blocks={num_blocks})")
        self.num_kv_heads, self.head_dim = heads, head_dim
        self.geometry = KVGeometry(self.dtype, heads, head_dim, self.block_size, use_mla)
        self.block_bytes = self.geometry.block_bytes
        self._t4 = t4
        # strides of one manager block: [r, H, n, C] (elements)
        sB, sH, sN, sC = t4[0].stride()
        if sC != 1:
            raise ValueError(f"KV tensor last dim must be contiguous, strides {t4[0].stride()}")
        for t in t4[1:]:
            if t.stride() != t4[0].stride():
                raise ValueError("KV tensors of different layers have different strides")
        ext = _dense_extent((self.ratio, h, n, c), (sB, sH, sN, 1))
        if ext is None:
            raise ValueError(f"a block of one layer is not one dense run of memory (layout {kv_cache_layout}, "
                             f"strides {t4[0].stride()}): unsupported KV cache layout")
        self._sB = sB
        if kind == "cpu" and (sN != c or sH != n * c):
            raise ValueError(f"CPU backend KV tensor must be [B, H, N, 2D] contiguous inside a block (layout LBHNC), "
                             f"got strides {t4[0].stride()}")
        if kind == "flash" and kv_cache_layout in _LAYOUTS:
            token_major = _LAYOUTS[kv_cache_layout][0]
            if h > 1 and n > 1 and token_major != (sN > sH):
                raise ValueError(f"KV tensor strides {t4[0].stride()} contradict kv_cache_layout={kv_cache_layout!r}")
        if kind == "cpu" and not isa:  # the engine did not say: vLLM's choice for bf16 and 32-token blocks
            amx = "amx_bf16" in cpu_flags()
            isa = "amx" if (self.dtype == torch.bfloat16 and amx and block_size % 32 == 0) else "vec"
        self.isa = isa if kind == "cpu" else None
        self.layout_tag = device_layout_tag(kind, kv_cache_layout, self.isa)
        # per-layer typed offsets (elements) into the shared storage
        self._offsets = [t.storage_offset() for t in t4]
        same_storage = all(t.untyped_storage().data_ptr() == t4[0].untyped_storage().data_ptr() for t in t4)
        self._layer_stride: Optional[int] = None
        if same_storage:
            if self.num_layers == 1:
                self._layer_stride = 0
            else:
                step = self._offsets[1] - self._offsets[0]
                if step > 0 and all(self._offsets[i] - self._offsets[0] == i * step for i in range(self.num_layers)):
                    self._layer_stride = step
        self._raw_typed = [_raw(t, self.dtype) for t in t4]
        self._raw_bytes = [_raw(t, torch.uint8) for t in t4]
        self._cache: dict = {}

    # ------------------------------------------------------------------ construction from vLLM
    @classmethod
    def from_vllm(cls, kv_caches: dict[str, torch.Tensor], *, num_blocks: int, block_size: int,
                  kv_cache_layout: Optional[str] = None, backend: Optional[str] = None,
                  use_mla: bool = False, isa: Optional[str] = None) -> "DevicePool":
        """Wrap the ``kv_caches`` vLLM passes to ``register_kv_caches``.

        Args:
            kv_caches: layer name -> KV tensor (``[B, H, N, C]``; MLA also ``[B, N, C]``); layers are ordered by the
                integers in their names (``model.layers.3...``), else as given.
            num_blocks: manager blocks (``kv_cache_config.num_blocks``); ``B`` may be a multiple (kernel blocks).
            block_size: tokens per manager block.
            kv_cache_layout: ``KVCacheLayout`` name (``LBNHC``/``NHD``, ``LBHNC``/``HND``, ``BLNHC``, ``BLHNC``);
                None = ``LBHNC`` for the CPU backend, else read from the strides.
            backend: attention backend name (``CPU_ATTN``, ``FLASH_ATTN``, ``FLASHINFER``, ``TRITON_ATTN``, any name
                containing ``MLA``, ...); None = ``CPU_ATTN`` for CPU tensors, ``FLASH_ATTN`` otherwise (MLA when
                ``use_mla`` or the tensors are 3-D).
            use_mla: the model uses MLA (one latent vector per token).
            isa: the CPU attention ISA the engine packs pages with (vLLM's ``layer.isa``: ``amx``, ``vec``,
                ``vec16``, ...); None = ``amx`` for bf16 on a CPU with AMX and blocks of a multiple of 32 tokens, else
                ``vec``. Ignored for other kinds. Named in :attr:`layout_tag`.
        Raises:
            ValueError: unknown backend or layout, a layout whose blocks are not dense byte runs, shapes that
                disagree with ``num_blocks``/``block_size``, or tensors that differ between layers.
        """
        if not kv_caches:
            raise ValueError("kv_caches is empty")
        names = list(kv_caches)
        if all(re.search(r"\d", n) for n in names):
            names = sorted(names, key=_layer_sort_key)
        tensors = [kv_caches[n] for n in names]
        t0 = tensors[0]
        layout = kv_cache_layout.upper() if kv_cache_layout else None
        if layout in _UNSUPPORTED_LAYOUTS:
            raise ValueError(f"kv_cache_layout {kv_cache_layout!r} is not supported: a block of one layer is not one "
                             f"dense run of memory; supported: {sorted(_LAYOUTS)}")
        if layout is not None and layout not in _LAYOUTS:
            raise ValueError(f"unknown kv_cache_layout {kv_cache_layout!r}; supported: {sorted(_LAYOUTS)}")
        kind = device_kind(backend, t0.device.type, use_mla or t0.dim() == 3)
        if kind == "mla":
            if t0.dim() not in (3, 4):
                raise ValueError(f"MLA KV tensor must be [B, N, C] or [B, 1, N, C], got shape {tuple(t0.shape)}")
            use_mla = True
        else:
            if t0.dim() != 4:
                raise ValueError(f"KV tensor for backend {backend or kind!r} must be 4-D [B, H, N, 2D] (vLLM 0.32), got "
                                 f"shape {tuple(t0.shape)}; the pre-0.32 [2, B, N, H, D] layout is not supported")
        if kind == "cpu":
            if layout not in (None, "LBHNC", "HND"):
                raise ValueError(f"the CPU backend only uses layout LBHNC, got kv_cache_layout={kv_cache_layout!r}")
            layout = "LBHNC"
        if layout is None:
            if kind == "mla":
                layout = "LBNHC"
            else:
                sB, sH, sN, _ = t0.stride()
                layout = "LBNHC" if sN > sH else "LBHNC"
        return cls(names, tensors, num_blocks=num_blocks, block_size=block_size, kind=kind,
                   kv_cache_layout=layout, backend=backend or kind, use_mla=use_mla, isa=isa)

    # ------------------------------------------------------------------ views
    def _stack(self, layer: Optional[int], raw: torch.Tensor, offset: int, sizes, strides) -> torch.Tensor:
        if layer is None:
            return raw.as_strided((self.num_layers, *sizes), (self._layer_stride, *strides), offset)
        return raw.as_strided(sizes, strides, offset)

    @property
    def has_all_layer_views(self) -> bool:
        """True when all layers live in one storage at a constant layer stride (one view spans every layer)."""
        return self._layer_stride is not None

    def block_bytes_view(self, layer: Optional[int] = None) -> torch.Tensor:
        """``uint8 [num_blocks, block_bytes]`` view of one layer, or ``[num_layers, num_blocks, block_bytes]`` for
        ``layer=None`` (only when :attr:`has_all_layer_views`). Row ``b`` = all bytes of block ``b``."""
        key = ("bytes", layer)
        v = self._cache.get(key)
        if v is None:
            if layer is None and not self.has_all_layer_views:
                raise ValueError("layers are not in one storage at a constant stride; use per-layer views")
            li = 0 if layer is None else layer
            sizes, strides = (self.num_blocks, self.block_bytes), (self.ratio * self._sB * self.esz, 1)
            raw, off = self._raw_bytes[li], self._offsets[li] * self.esz
            if layer is None:
                v = raw.as_strided((self.num_layers, *sizes), (self._layer_stride * self.esz, *strides), off)
            else:
                v = raw.as_strided(sizes, strides, off)
            self._cache[key] = v
        return v

    def semantic_view(self, part: str, layer: Optional[int] = None) -> torch.Tensor:
        """Token-major view of ``part`` (``"k"``, ``"v"``, or ``"latent"`` for MLA) of every block:
        ``[num_blocks, r, n, H, D]`` for one layer, ``[num_layers, num_blocks, r, n, H, D]`` for ``layer=None``
        (``r`` kernel blocks of ``n`` tokens per manager block; MLA: ``H`` = 1, ``D`` = latent width C)."""
        key = (part, layer)
        v = self._cache.get(key)
        if v is not None:
            return v
        if layer is None and not self.has_all_layer_views:
            raise ValueError("layers are not in one storage at a constant stride; use per-layer views")
        li = 0 if layer is None else layer
        t = self._t4[li]
        sB, sH, sN, _ = t.stride()
        r, n, H, D = self.ratio, self.kernel_block_size, self.num_kv_heads, self.head_dim
        sizes = (self.num_blocks, r, n, H, D)
        off = self._offsets[li]
        if self.kind == "mla":
            if part != "latent":
                raise ValueError(f"MLA pages have one part 'latent', not {part!r}")
            strides = (r * sB, sB, sN, sH, 1)
        elif part not in ("k", "v"):
            raise ValueError(f"part must be 'k' or 'v', got {part!r}")
        elif self.kind == "cpu":
            if part == "k":  # K^T [D, n] at the start of each (block, head) page
                strides = (r * sB, sB, 1, sH, n)
            else:  # V [n, D] after it
                strides, off = (r * sB, sB, D, sH, 1), off + n * D
        else:  # flash family: [.., 2D] = K then V, physical order in the strides
            strides = (r * sB, sB, sN, sH, 1)
            if part == "v":
                off += D
        v = self._stack(layer, self._raw_typed[li], off, sizes, strides)
        self._cache[key] = v
        return v

    def parts(self) -> tuple[str, ...]:
        """Semantic parts of a page: ``("k", "v")`` or ``("latent",)``."""
        return ("latent",) if self.kind == "mla" else ("k", "v")

    def __repr__(self) -> str:
        return (f"DevicePool({self.layout_tag}, backend={self.backend}, layers={self.num_layers}, "
                f"blocks={self.num_blocks}x{self.block_size} tokens, heads={self.num_kv_heads}, "
                f"head_dim={self.head_dim}, dtype={self.dtype}, block_bytes={self.block_bytes}, device={self.device})")
