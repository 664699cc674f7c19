"""A vLLM worker's pools: the device pool adapter over vLLM's KV tensors, the L2 host pool and the CacheWorker.

:func:`build_worker` runs once per worker (vLLM's ``register_kv_caches``): it wraps the engine's KV tensors
(:class:`~tierkv.connector.l2.device_pool.DevicePool`), maps a host pool of as many page slots as the scheduler side
indexes (pages of several engine blocks over a pool of block rows), builds this rank's L3 store with an L3 store
configured (:func:`~tierkv.connector.vllm.stores.build_worker_l3`), and warms the kernels up. Raises ConfigError
when the worker's page layout, page bytes or CPU attention ISA disagree with the page namespace.
"""
from __future__ import annotations

import logging
from typing import Optional

from tierkv.connector.core.config import ConfigError, TierKVConfig
from tierkv.connector.core.page_hash import ModelNamespace

from .geometry import Geometry
from .namespace import device_packing
from .sizing import _SIZE_KEYS
from .stores import build_worker_l3

logger = logging.getLogger("tierkv.vllm")


def build_worker(vllm_config, kv_cache_config, cfg: TierKVConfig, geo: Geometry, ns: ModelNamespace,
                 num_slots: int, size_from: str, kv_caches: dict) -> tuple[Optional[object], Optional[float]]:
    """``(worker, switch_prev)``: the :class:`~tierkv.connector.l2.worker.CacheWorker` (None with a pool of no page:
    caching disabled, with a warning) and the GIL switch interval the L3 threads replaced (None: unchanged)."""
    from tierkv import kernels
    from tierkv.connector.l2.device_pool import DevicePool
    from tierkv.connector.l2.host_pool import HostPool
    from tierkv.connector.l2.worker import CacheWorker, MultiBlockPages
    layout = kv_cache_config.kv_cache_layout or vllm_config.cache_config.kv_cache_layout
    backend = None
    try:
        backend = vllm_config.attention_config.backend  # may be None (auto)
        backend = getattr(backend, "name", backend)
    except AttributeError:
        pass
    caches = {n: kv_caches[n] for n in geo.layer_names if n in kv_caches} or kv_caches
    _kind, isa = device_packing(vllm_config, geo.spec, geo.use_mla)
    dev = DevicePool.from_vllm(caches, num_blocks=geo.num_blocks, block_size=geo.block_size,
                               kv_cache_layout=layout, backend=backend, use_mla=geo.use_mla, isa=isa)
    for name in geo.layer_names[:1]:  # the ISA vLLM's CPU backend gave its layers, where it already did
        layer = vllm_config.compilation_config.static_forward_context.get(name)
        if isa is not None and getattr(layer, "isa", isa) != isa:
            raise ConfigError(f"tierkv: vLLM packs KV pages with the {layer.isa!r} ISA but the page namespace "
                              f"names {isa!r}")
    if num_slots == 0:
        logger.warning("tierkv worker: host pool of 0 pages (%s); caching disabled", _SIZE_KEYS[size_from])
        return None, None
    pin = cfg.host_pool.pin_memory == "true" or (cfg.host_pool.pin_memory == "auto" and dev.device.type == "cuda")
    host = HostPool.for_device(dev, num_slots * geo.blocks_per_page, cfg.host_pool.layout,
                               pin_memory=pin, prefault=size_from != "automatic size")
    if geo.blocks_per_page > 1:  # page slot s = the pool's block rows s*k .. s*k+k-1
        host = MultiBlockPages(host, geo.blocks_per_page)
    if host.kv_layout != ns.kv_layout:
        raise ConfigError(f"tierkv: pages are laid out as {host.kv_layout!r} in the worker but the page "
                          f"namespace names {ns.kv_layout!r}")
    if host.page_bytes != geo.page_bytes:
        raise ConfigError(f"tierkv: page of {host.page_bytes} bytes in the worker but {geo.page_bytes} "
                          "bytes from the KV cache spec")
    l3, checksums, switch_prev = None, None, None
    if cfg.l3.backend != "none":
        l3, checksums, switch_prev = build_worker_l3(cfg, ns, host, geo.page_bytes)
    group_layers = None
    if geo.hybrid:  # each group's layers, as indices into the device pool's layers
        index = {n: i for i, n in enumerate(dev.layer_names)}
        group_layers = [[index[n] for n in names] for names in geo.group_names]
    worker = CacheWorker(dev, host, verify=cfg.verify_checksums, layerwise=cfg.layerwise_load, l3=l3,
                         checksums=checksums, group_layers=group_layers)
    kernels.warm_up(dev, getattr(host, "block_pool", host))
    logger.debug("tierkv worker: %r, L2 %s, L3 %s", dev, host, l3.store if l3 is not None else "none")
    return worker, switch_prev
