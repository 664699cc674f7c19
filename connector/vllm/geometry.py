"""The engine's KV cache geometry as tierkv needs it: which KV cache groups it serves, its layers and page shape.

:func:`engine_geometry` reads vLLM's ``kv_cache_config`` once per connector (both roles) into a :class:`Geometry`:
the reference spec, every layer name (ordered as the device pool orders them), the groups of a hybrid model (vLLM's
hybrid KV cache manager on), the sliding window, and the page shape: ``page_size`` tokens = ``blocks_per_page``
engine blocks, ``page_bytes`` = per-layer block bytes x layers x blocks per page. Raises ConfigError for a page size
that is not a whole multiple of the engine block size, a missing ``kv_cache_config`` and the KV cache groups tierkv
cannot store (:func:`_geometry`).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from tierkv.connector.core.config import ConfigError, TierKVConfig


#: KV cache spec kinds (vLLM class names, matched along the class's MRO) whose group vLLM keeps only in part, and why
#: tierkv cannot store their pages: vLLM frees blocks a layer no longer reads and puts its null block in their place
_PARTIAL_SPECS = {
    "MambaSpec": "Mamba/SSM layers keep one recurrent state per request, not one KV entry per token, so no page of "
                 "a prefix holds what a hit needs",
    "SlidingWindowSpec": "every layer attends within a sliding window, and vLLM frees each request's blocks before "
                         "the window (its null block takes their place), so those pages can be neither saved nor "
                         "loaded",
    "ChunkedLocalAttentionSpec": "every layer attends within local chunks, and vLLM frees each request's blocks "
                                 "before the current chunk, so those pages can be neither saved nor loaded",
    "RSWASpec": "every layer keeps a ring of sliding-window blocks, and vLLM frees each request's blocks before the "
                "window, so those pages can be neither saved nor loaded",
    "CircularBufferSpec": "every layer keeps a circular buffer of blocks, not one block per page of the prompt",
}


def _spec_kind(spec) -> str:
    """The vLLM class name a KV cache spec is an instance of, for messages: the first of :data:`_PARTIAL_SPECS`
    along its MRO, else its own class name."""
    names = [c.__name__ for c in type(spec).__mro__]
    return next((n for n in names if n in _PARTIAL_SPECS), names[0])


#: KV cache spec kinds a hybrid model's groups (vLLM's hybrid KV cache manager on) may have: full attention, and
#: sliding window (its blocks before the window are null in vLLM's tables: :func:`tierkv.connector.core.plan.live_blocks`)
_GROUP_SPECS = ("FullAttentionSpec", "SlidingWindowSpec")


def _group_kind(spec) -> str:
    """``spec``'s class name when it is one of :data:`_GROUP_SPECS` (exactly: subclasses such as vLLM's R-SWA or
    sliding-window MLA are not verified), else :func:`_spec_kind`."""
    kind = type(spec).__name__
    return kind if kind in _GROUP_SPECS else _spec_kind(spec)


def _geometry(kv_cache_config, model_type: str = "this model"
              ) -> tuple[Any, list[str], Optional[int], Optional[list[list[str]]], int]:
    """``(spec, layer names, window, groups, ref)`` of the model's KV cache groups.

    One group (every plain model, and a hybrid model with vLLM's hybrid KV cache manager off): ``groups`` None,
    ``ref`` 0, ``window`` (tokens) not None when some layers attend within a sliding window (or local chunks) but
    vLLM keeps their KV for every token (it then gives them a ``FullAttentionSpec`` carrying the window in the one
    group): every page holds every layer's KV of its tokens and is stored and loaded like a full-attention page.

    Several groups (a hybrid model, Gemma-2/3 shape, with the hybrid KV cache manager on, which vLLM keeps on for
    tierkv since it is ``SupportsHMA``): full-attention and sliding-window groups of one block size and one per-layer
    block size are served: ``groups`` lists each group's layer names, ``layer names`` every layer (ordered as the
    device pool orders them), ``ref`` the first full-attention group (its blocks are never null), ``window`` the
    sliding window. Each page still holds every layer; each group's blocks are copied with that group's layers, null
    blocks never (:func:`tierkv.connector.core.plan.live_blocks`).

    Raises ConfigError naming ``model_type`` (the HF ``model_type``) and why, for: no KV cache group
    (attention-free model); several groups with a kind other than full attention and sliding window (Mamba/SSM
    state, local chunks, ...), with no full-attention group, or with different block sizes or per-layer block bytes;
    one group of a kind vLLM keeps only in part (:data:`_PARTIAL_SPECS`: sliding window or local chunks in every
    layer, Mamba/SSM state)."""
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups:
        raise ConfigError(f"tierkv: model type {model_type!r} has no KV cache (attention-free); tierkv has nothing "
                          "to store: serve it without --kv-transfer-config")
    if len(groups) != 1:
        kinds = [_group_kind(g.kv_cache_spec) for g in groups]
        other = sorted({k for k in kinds if k not in _GROUP_SPECS})
        if other:
            why = "; ".join(f"{k}: {_PARTIAL_SPECS[k]}" if k in _PARTIAL_SPECS else f"{k}: not verified with tierkv"
                            for k in other)
            raise ConfigError(f"tierkv cannot serve model type {model_type!r}: of its {len(groups)} KV cache groups, "
                              f"{', '.join(other)} ones are neither full attention nor sliding window ({why}); serve "
                              "it without tierkv")
        if "FullAttentionSpec" not in kinds:
            raise ConfigError(f"tierkv cannot serve model type {model_type!r}: none of its {len(groups)} KV cache "
                              "groups is full attention (every layer attends within a sliding window, so no page of "
                              "a long prefix stays in vLLM's cache); serve it without tierkv")
        specs = [g.kv_cache_spec for g in groups]
        shapes = {(int(sp.block_size), int(sp.page_size_bytes)) for sp in specs}
        if len(shapes) != 1:
            raise ConfigError(f"tierkv cannot serve model type {model_type!r}: its KV cache groups have different "
                              f"(block size, block bytes per layer) {sorted(shapes)}; tierkv pages need one; serve it "
                              "without tierkv")
        ref = kinds.index("FullAttentionSpec")
        names = [list(g.layer_names) for g in groups]
        from tierkv.connector.l2.device_pool import _layer_sort_key
        layers = sorted((n for g in names for n in g), key=_layer_sort_key)
        window = max((int(getattr(sp, "sliding_window", 0) or 0) for sp in specs), default=0)
        return specs[ref], layers, (window or None), names, ref
    spec = groups[0].kv_cache_spec
    kind = _spec_kind(spec)
    if kind in _PARTIAL_SPECS:
        hint = (" (or with --disable-sliding-window, which caps the model length at the window)"
                if kind in ("SlidingWindowSpec", "RSWASpec") else "")
        raise ConfigError(f"tierkv cannot serve model type {model_type!r} ({kind}): {_PARTIAL_SPECS[kind]}; serve "
                          f"it without tierkv{hint}")
    window = getattr(spec, "sliding_window", None) or getattr(spec, "attention_chunk_size", None)
    return spec, list(groups[0].layer_names), (int(window) if window else None), None, 0



def _local_layer_count(model_config, window: Optional[int]) -> tuple[int, int]:
    """(layers that attend within a sliding window or local chunks, layers) of the whole model, from the HF config's
    ``layer_types``; (0, 0) when ``window`` is None or the config has no ``layer_types`` (unknown)."""
    types = getattr(getattr(model_config, "hf_text_config", None), "layer_types", None) or ()
    if not window or not types:
        return 0, 0
    return sum(1 for t in types if t in ("sliding_attention", "chunked_attention")), len(types)


@dataclass(frozen=True)
class Geometry:
    """One engine's KV cache shape as tierkv stores it (see the module docstring); sizes in tokens and bytes."""
    spec: Any                              # the reference KV cache spec (the first full-attention group's)
    layer_names: list                      # every layer, ordered as the device pool orders them
    local_window: Optional[int]            # sliding window (tokens) of some layers, or None
    group_names: Optional[list]            # each KV cache group's layer names (hybrid manager on), or None
    ref_group: int                         # the group whose block ids count pages (never null blocks)
    local_layers: tuple                    # (sliding-window layers, layers) of the model, (0, 0) when unknown
    block_size: int                        # tokens per engine block
    page_size: int                         # tokens per tierkv page
    blocks_per_page: int
    num_blocks: int                        # engine blocks (L1)
    use_mla: bool
    page_bytes: int                        # bytes of one page, every layer
    tp_size: int
    pp_size: int

    @property
    def hybrid(self) -> bool:
        """Several KV cache groups (vLLM's hybrid KV cache manager on): every load asynchronous."""
        return self.group_names is not None

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size


def engine_geometry(vllm_config, kv_cache_config, cfg: TierKVConfig) -> Geometry:
    """The :class:`Geometry` of this engine under ``cfg`` (``page_size``; empty = one engine block)."""
    from tierkv.connector.core.scheduler import check_page_size
    block_size = int(vllm_config.cache_config.block_size)
    page_size = int(cfg.page_size or block_size)
    try:  # a page is k whole engine blocks of the request (k >= 1)
        blocks_per_page = check_page_size(page_size, block_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    if kv_cache_config is None:
        raise ConfigError("tierkv needs vLLM's kv_cache_config (vLLM >= 0.32)")
    model_type = str(getattr(vllm_config.model_config.hf_config, "model_type", None) or "?")
    spec, layer_names, window, group_names, ref = _geometry(kv_cache_config, model_type)
    pc = vllm_config.parallel_config
    return Geometry(spec=spec, layer_names=layer_names, local_window=window, group_names=group_names, ref_group=ref,
                    local_layers=_local_layer_count(vllm_config.model_config, window), block_size=block_size,
                    page_size=page_size, blocks_per_page=blocks_per_page, num_blocks=int(kv_cache_config.num_blocks),
                    use_mla=type(spec).__name__.startswith("MLA") or "MLA" in type(spec).__name__,
                    page_bytes=int(spec.page_size_bytes) * len(layer_names) * blocks_per_page,
                    tp_size=int(pc.tensor_parallel_size), pp_size=int(pc.pipeline_parallel_size))
