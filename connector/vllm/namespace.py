"""The page namespace of a vLLM engine: every fact that changes a page's bytes or its key chain.

:func:`model_namespace` builds the engine's :class:`~tierkv.connector.core.page_hash.ModelNamespace` (model id,
page geometry, KV dtype, host and device layout, model dtype, quantisation, byte order, the sliding-window scheme and
the operator's salt); :func:`rank_namespace` gives one rank's copy, the only place that maps every MLA rank onto
TP rank 0 (MLA pages are the same on every rank: one record, written by TP rank 0, read by all). :func:`lora_key`
is the LoRA identity a request's key chain starts from. Raises ConfigError for a ``--kv-cache-dtype`` whose pages
were not verified (:func:`kv_dtype_name`).
"""
from __future__ import annotations

import dataclasses
import logging
import os
from typing import Optional

from tierkv.connector.core.config import ConfigError, TierKVConfig
from tierkv.connector.core.page_hash import ModelNamespace, lora_identity

from .geometry import Geometry

logger = logging.getLogger("tierkv.vllm")


def _dtype_name(dt) -> str:
    return str(dt).replace("torch.", "")


#: ``--kv-cache-dtype`` values whose pages are exactly the bytes of the KV tensors tierkv copies
_KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")


def kv_dtype_name(cache_dtype: Optional[str], spec_dtype, fp8_fnuz: bool = False) -> str:
    """The namespace's ``dtype``: the KV element type as stored. ``auto``/``bfloat16``/``float16``: the KV tensors'
    dtype; FP8: the ``--kv-cache-dtype`` name (vLLM keeps every FP8 cache in ``uint8`` tensors, so the tensor dtype
    cannot tell e4m3 from e5m2), with ``-fnuz`` on platforms whose FP8 is the fnuz variant (other bytes). Per-tensor
    k/v scales are not stored with pages: in vLLM 0.32 they are 1.0 or read from the checkpoint, so the model
    identity fixes them. Raises ConfigError for other cache dtypes (their scales or packing live outside the KV
    tensors tierkv copies, or have not been verified)."""
    cd = str(cache_dtype or "auto")
    if cd not in _KV_CACHE_DTYPES:
        raise ConfigError(f"--kv-cache-dtype {cd} is not supported by tierkv (its pages were not verified to hold "
                          f"every byte a hit needs); use one of {', '.join(_KV_CACHE_DTYPES)} or serve without tierkv")
    if cd.startswith("fp8"):
        return cd + ("-fnuz" if fp8_fnuz else "")
    return _dtype_name(spec_dtype)


def device_packing(vllm_config, spec, use_mla: bool) -> tuple[str, Optional[str]]:
    """(device kind, CPU attention ISA or None) of this engine's KV tensors, known
    without the tensors (the scheduler process has none): the kind from the attention backend and the platform,
    the ISA from vLLM's own choice (``cpu_attn._get_attn_isa`` over the model dtype, block size, head size and
    cache dtype, which reads the CPU's AMX/AVX-512 support)."""
    from vllm.platforms import current_platform

    from tierkv.connector.l2.device_pool import device_kind
    backend = getattr(getattr(vllm_config, "attention_config", None), "backend", None)
    backend = getattr(backend, "name", backend)
    kind = device_kind(backend, "cpu" if current_platform.is_cpu() else "cuda", use_mla)
    isa = None
    if kind == "cpu":
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa
        isa = _get_attn_isa(vllm_config.model_config.dtype, int(spec.block_size), int(spec.head_size),
                            vllm_config.cache_config.cache_dtype)
    return kind, isa


_PROCESS_NONCE = os.urandom(8).hex()
_unhashed_adapters: set = set()


def lora_key(lora_request) -> Optional[str]:
    """The LoRA identity a request's key chain starts from (``None`` without an adapter): the adapter's name and
    the content digest of its files (:func:`tierkv.connector.core.page_hash.lora_identity`, computed once per adapter in
    this process), the files found as vLLM's worker finds them (``get_adapter_absolute_path``). When they cannot be
    read here, the identity is the name plus this process's random nonce, with one warning per adapter: its pages
    are then reused inside this engine only, never through a store shared with another engine."""
    if lora_request is None or not getattr(lora_request, "lora_name", None):
        return None
    name, path = lora_request.lora_name, getattr(lora_request, "lora_path", None) or ""
    adapter_id = getattr(lora_request, "lora_int_id", None)
    if path and not os.path.exists(path):
        try:
            from vllm.lora.utils import get_adapter_absolute_path
            path = get_adapter_absolute_path(path)
        except Exception:  # not resolvable here: adapter_digest raises OSError below
            pass
    try:
        return lora_identity(name, path, adapter_id)
    except OSError as e:
        if (name, path) not in _unhashed_adapters:
            _unhashed_adapters.add((name, path))
            logger.warning("tierkv: LoRA adapter %r: its files at %r cannot be read (%s); its pages are reused inside "
                           "this engine only", name, path, e)
        return f"{name}@process:{_PROCESS_NONCE}:{adapter_id}"


def page_namespace_facts(vllm_config, kv_cache_config, spec, use_mla: bool, host_layout: str) -> dict:
    """The ``ModelNamespace`` fields, besides model id and geometry, that change a page's bytes: ``dtype``
    (:func:`kv_dtype_name`), ``kv_layout`` (``"<host layout>/<device packing>"``, equal to the worker's
    ``HostPool.kv_layout``: :func:`tierkv.connector.l2.device_pool.device_layout_tag` of :func:`device_packing`) and
    ``extra`` (the model dtype, the weights' quantisation method and the host byte order)."""
    import sys

    from vllm.platforms import current_platform

    from tierkv.connector.l2.device_pool import device_layout_tag
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    kind, isa = device_packing(vllm_config, spec, use_mla)
    layout = kv_cache_config.kv_cache_layout or cc.kv_cache_layout
    fnuz = bool(getattr(current_platform, "is_fp8_fnuz", lambda: False)())
    return dict(dtype=kv_dtype_name(cc.cache_dtype, spec.dtype, fnuz),
                kv_layout=f"{host_layout}{'-mla' if use_mla else ''}/{device_layout_tag(kind, layout, isa)}",
                extra=(("model_dtype", _dtype_name(mc.dtype)), ("quantization", mc.quantization or None),
                       ("byteorder", sys.byteorder)))


def _local_kv(hybrid: bool) -> str:
    """The namespace's ``local_attention_kv`` fact of a model with sliding-window layers: ``every_token`` (vLLM's
    hybrid KV cache manager off: one group, those layers kept in full) or ``per_group`` (on: each group's blocks
    copied apart, a sliding-window layer's blocks before a hit's window never loaded)."""
    return "per_group" if hybrid else "every_token"


def model_namespace(vllm_config, kv_cache_config, geo: Geometry, cfg: TierKVConfig) -> ModelNamespace:
    """The engine's namespace (TP and PP rank 0; :func:`rank_namespace` for a rank's own)."""
    mc = vllm_config.model_config
    spec = geo.spec
    model_id = cfg.model_id or f"{mc.model}@{getattr(mc, 'revision', None) or ''}"
    ns = ModelNamespace(
        model_id=model_id, page_size=geo.page_size, num_layers=len(geo.layer_names),
        num_kv_heads=int(getattr(spec, "num_kv_heads", 1)), head_dim=int(getattr(spec, "head_size", 0)),
        tp_rank=0, tp_size=geo.tp_size, pp_rank=0, pp_size=geo.pp_size,
        use_mla=geo.use_mla, salt=cfg.namespace_salt,
        **page_namespace_facts(vllm_config, kv_cache_config, spec, geo.use_mla, cfg.host_pool.layout))
    if geo.local_window:  # sliding-window layers stored another way: never mixed with pages of another scheme
        ns = dataclasses.replace(ns, extra=tuple(ns.extra) + (("local_attention_kv", _local_kv(geo.hybrid)),))
    return ns


def rank_namespace(ns: ModelNamespace, tp_rank: int, pp_rank: int) -> ModelNamespace:
    """The namespace of the rank (``tp_rank``, ``pp_rank``): MLA ranks all use TP rank 0's."""
    return dataclasses.replace(ns, tp_rank=0 if ns.use_mla else tp_rank, pp_rank=pp_rank)


def rank_namespaces(ns: ModelNamespace) -> list[ModelNamespace]:
    """Every distinct rank namespace of the engine (MLA: one per PP rank), sorted by (TP rank, PP rank)."""
    ranks = sorted({(0 if ns.use_mla else t, p) for t in range(ns.tp_size) for p in range(ns.pp_size)})
    return [rank_namespace(ns, t, p) for t, p in ranks]
