"""The L2 pool's size for one vLLM engine, and the start-up line that reports tierkv's effective configuration.

:func:`pool_size` sizes a connector's host pool from the host budget (:mod:`tierkv.connector.l2.host_budget`): a
worker reserves its share before any page exists (ConfigError on every rank when the engine's pools do not fit, or
when ``host_pool.size_gb`` holds no page); the scheduler process sizes its index like its workers (an automatic
size: from their reservations). :func:`startup_line` is the one INFO line an engine logs with tiers, sizes, layout,
policies and store.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from tierkv.connector.core.config import ConfigError, TierKVConfig
from tierkv.connector.l2.host_budget import group_bytes, reserve

logger = logging.getLogger("tierkv.vllm")

#: the keys behind each way of sizing the L2 pool (named in messages about its size)
_SIZE_KEYS = {"num_pages": "host_pool.num_pages", "size_gb": "host_pool.size_gb",
              "automatic size": "host_pool.auto_fraction/auto_max_gb/reserve_gb"}


@dataclass(frozen=True)
class PoolSize:
    """One connector's L2 pool: ``bytes``, the worker ranks on this node, the host ledger's group name, which keys
    sized it (a :data:`_SIZE_KEYS` key) and the host budget (bytes, None when unknown)."""
    bytes: int
    local_ranks: int
    group: str
    size_from: str
    budget: Optional[int]


def pool_size(cfg: TierKVConfig, vllm_config, page_bytes: int, num_layers: int, page_size: int,
              worker: bool) -> PoolSize:
    """This connector's :class:`PoolSize` (see the module docstring); ``worker``: the worker role (reserves)."""
    pc = vllm_config.parallel_config
    hp = cfg.host_pool
    local_ranks = max(1, int(pc.tensor_parallel_size) * int(pc.pipeline_parallel_size)
                      // max(1, int(getattr(pc, "nnodes", 1) or 1)))
    group = f"{getattr(vllm_config, 'instance_id', '') or 'engine'}/dp{getattr(pc, 'data_parallel_rank', 0)}"
    requested = None
    if hp.num_pages is not None or hp.size_gb is not None:
        requested = cfg.host_pool_bytes(page_bytes)
        if requested < page_bytes:  # only size_gb can ask for less than one page (num_pages >= 1)
            raise ConfigError(
                f"bad value {hp.size_gb!r} for 'host_pool.size_gb': {requested} bytes hold no page of "
                f"{page_bytes} bytes ({num_layers} layers x {page_size} tokens); give at "
                f"least {page_bytes / 2**30:.3g} GiB, or host_pool.num_pages")
    size_from = ("num_pages" if hp.num_pages is not None else "size_gb" if hp.size_gb is not None
                 else "automatic size")
    if worker:
        rank = 0
        try:
            from vllm.distributed.parallel_state import get_world_group
            rank = get_world_group().rank_in_group
        except Exception:  # no distributed state (single process)
            pass
        r = reserve(group, rank, local_ranks, requested_bytes=requested,
                    auto_fraction=hp.auto_fraction, auto_max_bytes=int(hp.auto_max_gb * 2**30),
                    reserve_bytes=int(hp.reserve_gb * 2**30), page_bytes=page_bytes)
        return PoolSize(r.bytes, local_ranks, group, size_from, r.budget)
    got, budget = group_bytes(group)
    if requested is not None:
        n = requested
    elif got is None:  # pragma: no cover - the workers register before vLLM builds the scheduler
        logger.warning("tierkv: no L2 reservation of this engine's workers found in the host ledger; sizing the "
                       "index from the configuration (set host_pool.size_gb to be sure both sides agree)")
        n = cfg.host_pool_bytes(page_bytes)
    else:
        n = got
    return PoolSize(n, local_ranks, group, size_from, budget)


def _l3_target(cfg: TierKVConfig) -> str:
    from tierkv.storage_backends.factory import l3_target

    l3 = cfg.l3
    if l3.backend == "none":
        return "none"
    faults = " with injected faults" if l3.faults else ""
    return f"{l3.backend}({l3_target(l3)}){faults}"


def startup_line(cfg: TierKVConfig, *, num_slots: int, page_bytes: int, page_size: int, ranks: int, size_from: str,
                 budget: Optional[int], num_blocks: int, layout: str, namespace_hex: str,
                 local: Optional[tuple[int, int, Optional[int]]] = None, hybrid: bool = False) -> str:
    """The one INFO line an engine logs at start-up with tierkv's effective configuration (tiers, sizes, layout,
    policies, store). ``local`` = (sliding-window layers, layers, window in tokens) of a hybrid model
    (:func:`_geometry`): the line then says how their KV is kept: in full (``hybrid`` False: vLLM's hybrid KV cache
    manager off) or per KV cache group (``hybrid`` True)."""
    def size(n: float) -> str:
        return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"

    bud = f", host budget {size(budget)}" if budget is not None else ""
    c = cfg.controller
    l3 = _l3_target(cfg)
    pol = (f", write_policy={c.write_policy}, prefetch_policy={c.prefetch_policy}" if cfg.l3.backend != "none" else "")
    return (f"tierkv: L1 {num_blocks} blocks (vLLM) | L2 {num_slots} pages x {page_bytes} B = {size(num_slots * page_bytes)} per "
            f"worker x {ranks} worker(s) ({size_from}{bud}), layout {layout}, page {page_size} tokens, "
            f"eviction {cfg.eviction_policy} | L3 {l3}{pol} | verify_checksums={cfg.verify_checksums}, "
            f"layerwise_load={cfg.layerwise_load}, stats_path={cfg.stats_path}, namespace {namespace_hex}"
            + _local_note(local, hybrid))


def _local_note(local: Optional[tuple[int, int, Optional[int]]], hybrid: bool = False) -> str:
    """The start-up line's note on sliding-window layers (empty when there are none): kept in full (vLLM's hybrid KV
    cache manager off) or per KV cache group (on)."""
    if local is None or not local[2]:
        return ""
    n, total, window = local
    which = f"{n} of {total} layers" if n else "some layers"
    if hybrid:
        return (f" | hybrid model: {which} attend a {window}-token sliding window; vLLM's hybrid KV cache manager "
                "is on: every page is stored with every layer, and a hit loads those layers' blocks inside the "
                "window only")
    return (f" | hybrid model: {which} attend a {window}-token sliding window; vLLM's hybrid KV cache manager is off "
            "with tierkv, so their KV is kept, stored and loaded for every token like the full-attention layers'")
