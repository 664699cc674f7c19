"""tierkv's L3 stores as an SGLang HiCache storage backend (docs/sglang.md).

SGLang (0.5.23) loads it with ``--hicache-storage-backend dynamic`` and an extra config ``{"backend_name": "tierkv",
"module_path": "tierkv.connector.sglang.hicache", "class_name": "TierKVHiCacheStorage", "interface_v1": 1, "l3":
{...}}`` (``l3``: a tierkv ``l3`` section for :func:`~tierkv.storage_backends.factory.build_backend`). Served:
``batch_exists``, ``batch_get``/``batch_set`` (flat pages), ``batch_get_v1``/``batch_set_v1`` (host indices), the
hybrid path ``register_mem_host_pool_v2`` + ``batch_*_v2`` (one :class:`PoolTransfer` per side pool), and the
pointer form of ``get``/``set``. Each pool is a :class:`~tierkv.connector.sglang.pool_io.PoolIO` with its own
store and namespace; SGLang's key maps to ``BLAKE2b-128(domain, namespace, key, part)``, so another rank, dtype,
layout, pool or format version is a miss, never data. The only tierkv module that imports ``sglang``.

Faults: store errors are misses / False, never raised on SGLang's I/O threads; bad configuration raises
:class:`~tierkv.storage_backends.common.ConfigError` at attach (SGLang reports it and rolls back). What a namespace
holds: docs/developer-guide.md.
"""
from __future__ import annotations

import dataclasses
import logging
import threading
from enum import Enum
from typing import Any, Dict, List, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

try:  # the hybrid (v2) interface; an SGLang without it never calls the v2 methods
    from sglang.srt.mem_cache.hicache_storage import PoolTransfer, PoolTransferResult
except ImportError:  # pragma: no cover - not the SGLang the tests install
    PoolTransfer = PoolTransferResult = None

from tierkv.connector.core.page_hash import FORMAT_VERSION, ModelNamespace, check_salt, resolve_salt
from tierkv.connector.sglang.pool_io import IOCounters, PoolIO, byte_runs, is_mha, map_key, region
from tierkv.storage_backends.common import ConfigError, RateLimitedLog, config_error
from tierkv.storage_backends.factory import L3_BACKENDS, validate_l3

logger = logging.getLogger(__name__)
_warn = RateLimitedLog(logger)

#: extra-config keys that belong to SGLang (the controller pops most of them before the backend sees the rest)
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
               "tp_lcm_size", "allocator")


class SGLangExtraConfig(BaseModel):
    """tierkv's keys in ``--hicache-storage-backend-extra-config`` (SGLang's own keys, :data:`SGLANG_KEYS`, are
    accepted and ignored here).

    ``l3``: the tierkv ``l3`` section (``{"backend": "file", "file": {"root": "/mnt/kv"}}``,
    ``{"backend": "zmq", "zmq": {"endpoint": "tcp://host:5555", "timeout_s": 1.0}}``,
    ``{"backend": "mooncake", "mooncake": {...}}``; optional ``faults``). ``model_id``: overrides SGLang's
    served model name in the namespace (e.g. to add a revision). ``namespace_extra``: further identity
    (list of strings) for pages that must not be shared, e.g. a quantisation recipe. ``split_kv``: store an MHA page
    as two records (K half, V half), which the zero-copy path reads and writes in place in the host pool, or as one
    record (staged through one page copy each way, half the records: fewer files for the file store). Default
    (``None``): one record for ``l3.backend: file``, two otherwise. Part of the namespace: writers and readers of
    one store must agree (a mismatch is a miss). ``kv_cache_dtype``: the ``--kv-cache-dtype`` SGLang serves with;
    required when it is an FP8 format, because SGLang's host pool holds FP8 caches as ``uint8`` and cannot tell
    e4m3 from e5m2 (part of the namespace). ``namespace_salt``: the operator's secret in every key (or
    ``$TIERKV_NAMESPACE_SALT``; docs/tenants.md).
    """

    model_config = ConfigDict(extra="forbid")

    l3: Dict[str, Any]
    model_id: Optional[str] = None
    namespace_extra: List[str] = Field(default_factory=list)
    split_kv: Optional[bool] = None
    kv_cache_dtype: Optional[str] = None
    namespace_salt: Optional[str] = Field(default=None, repr=False)

    @field_validator("namespace_salt")
    @classmethod
    def _salt(cls, v: Any) -> Optional[str]:
        return check_salt(v)


def parse_extra_config(extra: Optional[dict]) -> SGLangExtraConfig:
    """Validate the extra config SGLang hands the backend; the L3 section is checked without touching the network.

    Raises:
        ConfigError: a missing ``l3`` key, an unknown key (the message lists the allowed keys), ``l3.backend``
            ``none`` or unknown (the message lists the allowed backends), or a bad key of the chosen backend.
    """
    ours = {k: v for k, v in (extra or {}).items() if k not in SGLANG_KEYS}
    try:
        cfg = SGLangExtraConfig.model_validate(ours)
    except ValidationError as e:
        err = config_error(e, "hicache-storage-backend-extra-config", SGLangExtraConfig)
        raise ConfigError(f"{err} (tierkv keys: {', '.join(SGLangExtraConfig.model_fields)}; SGLang keys: "
                          f"{', '.join(SGLANG_KEYS)})") from None
    try:
        cfg.namespace_salt = resolve_salt(cfg.namespace_salt)
    except ValueError as e:
        raise ConfigError(f"--hicache-storage-backend-extra-config: {e}") from None
    l3 = validate_l3(cfg.l3)
    if l3.backend == "none":
        raise ConfigError("l3.backend 'none' in --hicache-storage-backend-extra-config: the tierkv HiCache backend "
                          f"needs a store; choose one of {', '.join(b for b in L3_BACKENDS if b != 'none')} "
                          "(or drop --hicache-storage-backend)")
    return cfg



def records_per_page(pool: Any, split_kv: Optional[bool], backend: str) -> int:
    """Records one page is stored as: 2 (K, V) for an MHA pool when ``split_kv`` (default: every backend but
    ``file``), else 1."""
    if not is_mha(pool):
        return 1
    if split_kv is None:
        split_kv = backend != "file"
    return 2 if split_kv else 1


def build_namespace(storage_config: HiCacheStorageConfig, pool: Any, model_id: Optional[str] = None,
                    namespace_extra: Sequence[str] = (), records: int = 1,
                    kv_cache_dtype: Optional[str] = None, page_bytes: Optional[int] = None,
                    salt: Optional[str] = None) -> ModelNamespace:
    """The tierkv namespace of one SGLang rank's pages (see the module docstring for what it holds). The dtype is
    the host pool's; a ``uint8`` pool (SGLang's storage of every FP8 format) adds ``kv_cache_dtype``; ``page_bytes``
    (for pools whose attributes do not fix it) is added when given.

    Raises:
        ConfigError: no model name (SGLang's ``--served-model-name``/model path, or ``model_id``),
            ``tp_lcm_size`` head splitting (``should_split_heads``), which this adapter does not store, or a
            ``uint8`` pool without ``kv_cache_dtype``.
    """
    name = model_id or storage_config.model_name
    if not name:
        raise ConfigError("no model name for the tierkv namespace: SGLang passed model_name=None; set "
                          "'model_id' in --hicache-storage-backend-extra-config")
    if storage_config.should_split_heads:
        raise ConfigError("tp_lcm_size head splitting (page_head layout shared across TP sizes) is not supported "
                          "by the tierkv HiCache backend; remove 'tp_lcm_size' from the extra config")
    mha = is_mha(pool)
    layout = f"sglang/{type(pool).__name__}/{pool.layout}"
    tag = getattr(pool, "storage_format_tag", None)
    if tag:
        layout += f"/{tag}"
    extra = [("sglang_hicache", 1),
             ("v_head_dim", int(getattr(pool, "v_head_dim", 0) or 0)),
             ("attn_cp", getattr(storage_config, "attn_cp_rank", 0), getattr(storage_config, "attn_cp_size", 1)),
             ("dcp", getattr(storage_config, "dcp_rank", 0), getattr(storage_config, "dcp_size", 1),
              getattr(storage_config, "logical_page_size", None) or 0),
             ("records_per_page", int(records))]
    extra += [("user", str(x)) for x in namespace_extra]
    if page_bytes is not None:
        extra.append(("page_bytes", int(page_bytes)))
    dtype = str(getattr(pool, "dtype", None) or pool.kv_buffer.dtype).removeprefix("torch.")
    if dtype == "uint8":
        if not kv_cache_dtype:
            raise ConfigError("SGLang's host pool holds this KV cache as uint8 (how it stores FP8), which does not "
                              "say which FP8 format: set 'kv_cache_dtype' in --hicache-storage-backend-extra-config "
                              "to SGLang's --kv-cache-dtype (e.g. fp8_e4m3, fp8_e5m2)")
        dtype += f"/{kv_cache_dtype}"
    return ModelNamespace(
        model_id=str(name), dtype=dtype, kv_layout=layout,
        page_size=int(pool.page_size), num_layers=int(getattr(pool, "layer_num", 0) or 0),
        num_kv_heads=int(pool.head_num) if mha else 1,
        head_dim=int(pool.head_dim) if mha else int(getattr(pool, "kv_cache_dim", 0) or 0),
        tp_rank=storage_config.tp_rank, tp_size=storage_config.tp_size,
        pp_rank=storage_config.pp_rank, pp_size=storage_config.pp_size,
        use_mla=bool(storage_config.is_mla_model), extra=tuple(extra), salt=salt)


#: SGLang's pool names and hit policies (its ``PoolName`` / ``PoolHitPolicy`` are str enums equal to these)
KV, MAMBA = "kv", "mamba"
ALL_PAGES, TRAILING_PAGES, BLOCK_GROUPS = "all_pages", "trailing_pages", "block_groups"

#: host-pool attributes that describe a side pool's bytes (those it has go into its namespace)
_GEOMETRY = ("layer_num", "num_mamba_layers", "head_num", "head_dim", "v_head_dim", "kv_cache_dim", "kv_lora_rank",
             "qk_rope_head_dim", "temporal_dtype", "conv_dtype", "temporal_state_shape", "conv_state_shapes",
             "size_per_token", "storage_format_tag")


def side_namespace(anchor: ModelNamespace, name: str, pool: Any, storage_config: HiCacheStorageConfig,
                   records: int = 1, page_bytes: int = 0, kv_cache_dtype: Optional[str] = None) -> ModelNamespace:
    """Namespace of side pool ``name`` (v2): the anchor's, with the pool's name, class, layout, dtype, page size,
    page bytes and geometry (:data:`_GEOMETRY`). TP-rank specific unless the model is MLA and the pool is neither
    Mamba state (always TP-sharded) nor an MHA pool (heads split over TP), so a rank never reads another rank's
    shard."""
    shared = bool(storage_config.is_mla_model) and name != MAMBA and not is_mha(pool)
    layout = str(getattr(pool, "layout", ""))
    facts = [("pool", name), ("records_per_page", int(records)), ("page_bytes", int(page_bytes))]
    facts += [(a, str(getattr(pool, a))) for a in _GEOMETRY if getattr(pool, a, None) is not None]
    dtype = str(getattr(pool, "dtype", "")).removeprefix("torch.")
    if dtype == "uint8" and kv_cache_dtype:
        dtype += f"/{kv_cache_dtype}"
    return dataclasses.replace(
        anchor, dtype=dtype, kv_layout=f"sglang/{type(pool).__name__}/{layout}", use_mla=shared,
        page_size=int(getattr(pool, "page_size", 1) or 1), num_layers=int(getattr(pool, "layer_num", 0) or 0),
        num_kv_heads=int(getattr(pool, "head_num", 1) or 1), head_dim=int(getattr(pool, "head_dim", 0) or 0),
        extra=tuple(anchor.extra) + (("side_pool", tuple(facts)),))


def side_pool_l3(l3: dict) -> dict:
    """The ``l3`` section a side pool's store client is built from: the anchor's, except that a Mooncake client of a
    side pool contributes no segment of its own (``global_segment_size: 0``; its records live in the segments the
    anchor's and other clients contribute), so N side pools do not add N segments of this process's memory."""
    if l3.get("backend") != "mooncake":
        return l3
    return {**l3, "mooncake": {**l3.get("mooncake", {}), "global_segment_size": 0}}


def _name(name: Any) -> str:
    """A pool name as text (``PoolName`` member or plain string)."""
    return name.value if isinstance(name, Enum) else str(name)


class TierKVHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over tierkv stores (file, ZMQ cache server, Mooncake, LMCache server: any backend
    tierkv's factory builds). Built by SGLang's ``StorageBackendFactory`` (``dynamic``) as
    ``TierKVHiCacheStorage(storage_config, kwargs)``; usable after :meth:`register_mem_pool_host`.

    Page tensors: the copy path takes and returns flat pages as SGLang's host pool makes them (``get_data_page(i)``
    / ``get_dummy_flat_data_page()``); the zero-copy and v2 paths take ``host_indices`` (int64 slots of the pool,
    ``page_size`` per page, page ``i`` starting at ``host_indices[i * page_size]``).

    Attributes (after registration): ``kv`` (the anchor pool's :class:`PoolIO`; ``namespace``, ``page_bytes``,
    ``part_bytes``, ``parts_per_page``, ``zero_copy``, ``vectored_get``/``vectored_set`` and ``store`` read
    through to it) and ``pools`` (side pools by name, from :meth:`register_mem_host_pool_v2`).

    Raises (at attach): :class:`ConfigError` for a bad extra config (:func:`parse_extra_config`), a namespace that
    cannot be built (:func:`build_namespace`), a pool whose pages cannot be read or a store that cannot start.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.cfg = parse_extra_config(storage_config.extra_config)
        self.mem_pool_host = None
        self.kv: Optional[PoolIO] = None
        self.pools: Dict[str, PoolIO] = {}
        self.registered_pools: Dict[Any, Any] = {}
        self._counters = IOCounters()
        self._pools_lock = threading.Lock()

    # read-through attributes of the anchor pool
    store = property(lambda self: self.kv.store if self.kv else None)
    namespace = property(lambda self: self.kv.namespace if self.kv else None)
    _ns_digest = property(lambda self: self.kv.digest if self.kv else b"")
    page_bytes = property(lambda self: self._need_kv().page_bytes)
    part_bytes = property(lambda self: self._need_kv().part_bytes)
    parts_per_page = property(lambda self: self._need_kv().parts_per_page)
    page_size = property(lambda self: self._need_kv().page_size)
    zero_copy = property(lambda self: bool(self.kv and self.kv.zero_copy))
    vectored_get = property(lambda self: bool(self.kv and self.kv.vectored_get))
    vectored_set = property(lambda self: bool(self.kv and self.kv.vectored_set))

    # ------------------------------------------------------------------ attach
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Receive SGLang's anchor host pool (L2): build its namespace and store (``l3``), register the pool's buffer
        with the store for zero-copy sets. Registering again starts over. Raises :class:`ConfigError`."""
        if self.kv is not None or self.pools:
            self.close()
            with self._pools_lock:
                self.pools = {}
        super().register_mem_pool_host(mem_pool_host)
        pool, cfg = mem_pool_host, self.cfg
        backend = str(cfg.l3.get("backend"))

        def namespace(records: int, page_bytes: int) -> ModelNamespace:
            # a pool without get_data_page (only get_page_buffer_meta) says nothing else that fixes its page size
            return build_namespace(self.storage_config, pool, cfg.model_id, cfg.namespace_extra, records,
                                   cfg.kv_cache_dtype, None if hasattr(pool, "get_data_page") else page_bytes,
                                   cfg.namespace_salt)

        self.kv = PoolIO(pool, KV, namespace, records_per_page(pool, cfg.split_kv, backend), cfg.l3,
                         self._counters)
        logger.info("tierkv HiCache storage: %s store, namespace %s, %d B/page in %d part(s), %s (%s)", backend,
                    self.kv.digest.hex(), self.kv.page_bytes, self.kv.parts_per_page, self.kv.how,
                    getattr(pool, "layout", "?"))

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        """Receive one host pool of SGLang's hybrid pool group (v2): ``kv`` is the anchor (already registered);
        any other name gets its own store and namespace (:func:`side_namespace`). Registering a name again
        replaces its pool. Raises :class:`ConfigError` (before the anchor: RuntimeError)."""
        kv = self._need_kv()
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        name = _name(host_pool_name)
        if name == KV:
            if host_pool is not self.mem_pool_host:
                logger.warning("tierkv HiCache: v2 'kv' pool %s is not the anchor pool %s; kv transfers use the "
                               "anchor's records", type(host_pool).__name__, type(self.mem_pool_host).__name__)
            return
        cfg = self.cfg

        def namespace(records: int, page_bytes: int) -> ModelNamespace:
            return side_namespace(kv.namespace, name, host_pool, self.storage_config, records, page_bytes,
                                  cfg.kv_cache_dtype)

        io = PoolIO(host_pool, name, namespace, records_per_page(host_pool, cfg.split_kv, str(cfg.l3.get("backend"))),
                    side_pool_l3(cfg.l3), self._counters)
        with self._pools_lock:
            old, self.pools[name] = self.pools.get(name), io
        if old is not None:
            old.close()
        logger.info("tierkv HiCache storage: side pool %s (%s), namespace %s, %d B/page in %d part(s), %s", name,
                    type(host_pool).__name__, io.digest.hex(), io.page_bytes, io.parts_per_page, io.how)

    def _need_kv(self) -> PoolIO:
        if self.kv is None:
            raise RuntimeError("TierKVHiCacheStorage used before register_mem_pool_host (SGLang calls it at attach)")
        return self.kv

    def _io(self, name: Any) -> Optional[PoolIO]:
        name = _name(name)
        return self._need_kv() if name == KV else self.pools.get(name)

    def tierkv_keys(self, key: str, pool: Any = KV) -> List[str]:
        """The tierkv keys (one per record) under which SGLang's page ``key`` of pool ``pool`` is stored."""
        return self._io(pool).keys_of([key])

    # ------------------------------------------------------------------ existence
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """Number of leading ``keys`` whose every record is stored (0 on any store error)."""
        return self._need_kv().exists(keys)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    def batch_exists_v2(self, keys: List[str], pool_transfers: Optional[List[PoolTransfer]] = None,
                        extra_info: Any = None) -> PoolTransferResult:
        """Usable prefix of ``keys`` over the KV pool and each side pool of ``pool_transfers`` (their hit policies):
        ``kv_hit_pages`` is the longest prefix every pool can restore, ``extra_pool_hit_pages`` each pool's own
        boundary, ``restorable_prefix_pages`` every prefix length all pools can restore (a ``trailing_pages`` pool
        holds only windows ending on stored pages, so the set has holes). A pool never registered is absent."""
        kv_pages = self.batch_exists(keys)
        hits: Dict[Any, int] = {KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for t in pool_transfers or []:
            if not restorable:
                break
            io = self._io(t.name)
            present = self._present(io, keys[:kv_pages]) if io is not None else [False] * kv_pages
            if t.hit_policy == ALL_PAGES:
                boundary = present.index(False) if False in present else kv_pages
                own = set(range(1, boundary + 1))
            elif t.hit_policy == TRAILING_PAGES:
                w = max(1, len(t.keys) if t.keys else 1)
                own = {p for p in range(1, kv_pages + 1) if all(present[max(0, p - w):p])}
                boundary = max(own, default=0)
            elif t.hit_policy == BLOCK_GROUPS:  # its own verdict only; never gates the KV hit
                g = max(1, t.group_pages or 1)
                groups = next((i for i in range(kv_pages // g) if not all(present[i * g:(i + 1) * g])), kv_pages // g)
                boundary, own = groups * g, restorable
            else:
                raise ValueError(f"unsupported pool hit policy: {t.hit_policy}")
            if boundary:
                hits[t.name] = boundary
            restorable &= own
        return PoolTransferResult(max(restorable, default=0), hits, sorted(restorable))

    @staticmethod
    def _present(io: PoolIO, keys: Sequence[str]) -> List[bool]:
        """Per page: stored or not, from the store's leading-run query (one call per run and per absent page)."""
        out = [False] * len(keys)
        i = 0
        while i < len(keys):
            run = io.exists(keys[i:])
            out[i:i + run] = [True] * run
            i += run + 1
        return out

    # ------------------------------------------------------------------ copy path and pointer form
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Any]:
        """Copy path: fill each flat page tensor in ``target_locations`` (SGLang passes
        ``get_dummy_flat_data_page()`` per key; ``None`` allocates them) and return it, or ``None`` for a miss
        (missing, corrupt, truncated, foreign or unreadable). Pointer form (``target_sizes`` given): per key an
        address and size as :meth:`get` takes; True per hit, None per miss."""
        kv = self._need_kv()
        if not keys:
            return []
        if target_sizes is not None:
            return [self.get(k, loc, n) for k, loc, n in zip(keys, target_locations or [None] * len(keys),
                                                              target_sizes)]
        if target_locations is None:
            dt = getattr(self.mem_pool_host, "dtype", torch.uint8)
            target_locations = [torch.empty(kv.page_bytes, dtype=torch.uint8).view(dt) for _ in keys]
        ok = kv.get(keys, [p for t in target_locations for p in kv.flat_parts(t)])
        return [t if o else None for t, o in zip(target_locations, ok)]

    def get(self, key: str, target_location: Optional[Any] = None, target_sizes: Optional[Any] = None) -> Any:
        """One page: copy path (``target_location`` a flat page tensor or None) as :meth:`batch_get`; pointer form
        (``target_location`` an address, ``target_sizes`` its bytes: the whole page in SGLang's flat byte order, or
        lists of one address and size per record) reads the page there and returns True, or None for a miss or a
        location that is not inside the host pool (one log line)."""
        if target_sizes is None:
            return self.batch_get([key], None if target_location is None else [target_location])[0]
        dests = self._pointer_parts("get", target_location, target_sizes)
        return True if dests is not None and self._need_kv().get([key], dests)[0] else None

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Copy path: store flat pages ``values`` (``get_data_page(i)`` per key); pointer form (``values`` None,
        ``target_locations``/``target_sizes`` per key as :meth:`set` takes). True only if every page was stored."""
        kv = self._need_kv()
        if not keys:
            return True
        if values is None:
            if target_locations is None or target_sizes is None:
                _warn.warning("set-none", "tierkv HiCache set: neither values nor target_locations/target_sizes "
                              "given; nothing stored")
                return False
            return all([self.set(k, None, loc, n) for k, loc, n in zip(keys, target_locations, target_sizes)])
        return all(kv.set(keys, [p for v in values for p in kv.flat_parts(v.contiguous())]))

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        """One page: copy path (``value`` a flat page) or pointer form (``target_location``/``target_sizes`` as
        :meth:`get` takes). False, with one log line, for a location that is not a whole page inside the host pool."""
        if value is not None:
            return self.batch_set([key], [value])
        if target_location is None or target_sizes is None:
            return self.batch_set([key], None)
        srcs = self._pointer_parts("set", target_location, target_sizes)
        return srcs is not None and self._need_kv().set([key], srcs)[0]

    def _pointer_parts(self, op: str, location: Any, sizes: Any) -> Optional[list]:
        """Views of the anchor pool's buffer for a pointer-form page: one address of ``page_bytes`` (split into the
        records), or one address per record of ``part_bytes`` each; None (logged) for anything else."""
        kv = self._need_kv()
        locs = list(location) if isinstance(location, (list, tuple)) else [location]
        lens = list(sizes) if isinstance(sizes, (list, tuple)) else [sizes]
        ok = len(locs) == len(lens) and all(isinstance(x, int) for x in locs + lens)
        if ok and len(locs) == 1 and lens[0] == kv.page_bytes:
            r = region(kv.pool, locs[0], lens[0])
            views = None if r is None else kv.flat_parts(r)
        elif ok and len(locs) == kv.parts_per_page and all(n == kv.part_bytes for n in lens):
            views = [region(kv.pool, p, n) for p, n in zip(locs, lens)]
            views = None if any(v is None for v in views) else views
        else:
            views = None
        if views is None:
            self._counters.bump("pointer_rejected")
            _warn.warning(f"pointer-{op}", "tierkv HiCache %s, pointer form: %r bytes at %r is not one page (%d bytes, "
                          "or %d records of %d) inside the host pool; %s", op, sizes, location, kv.page_bytes,
                          kv.parts_per_page, kv.part_bytes, "a miss" if op == "get" else "not stored")
        return views

    # ------------------------------------------------------------------ zero-copy path (anchor) and v2 (any pool)
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Zero-copy path: read page ``i`` straight into the host-pool slots starting at
        ``host_indices[i * page_size]``; one bool per key (SGLang uses the leading run of True)."""
        return self._need_kv().get_at(keys, host_indices)

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Zero-copy path: store the pages held in the host-pool slots starting at ``host_indices[i * page_size]``;
        one bool per key."""
        return self._need_kv().set_at(keys, host_indices)

    def batch_get_v2(self, transfers: List[PoolTransfer], extra_info: Any = None) -> Dict[Any, List[bool]]:
        """v2: per transfer, read its ``keys`` into its pool (``name``) at its ``host_indices`` (``page_size`` of
        that pool per key); ``{name: one bool per key}``. An unknown pool or a length mismatch is all False."""
        return self._v2("get", transfers)

    def batch_set_v2(self, transfers: List[PoolTransfer], extra_info: Any = None) -> Dict[Any, List[bool]]:
        """v2: per transfer, store its ``keys`` from its pool at its ``host_indices``; ``{name: one bool per key}``."""
        return self._v2("set", transfers)

    def _v2(self, op: str, transfers: List[PoolTransfer]) -> Dict[Any, List[bool]]:
        out: Dict[Any, List[bool]] = {}
        for t in transfers:
            ks = list(t.keys or [])
            io, hi = self._io(t.name), t.host_indices
            if io is None or hi is None or hi.numel() != len(ks) * io.page_size:
                self._counters.bump("v2_rejected")
                _warn.warning(f"v2-{op}-{io is None}", "tierkv HiCache batch_%s_v2: pool %s %s; %d page(s) %s", op, _name(t.name),
                              "not registered" if io is None else
                              f"has {0 if hi is None else hi.numel()} host indices for {len(ks)} keys", len(ks),
                              "missed" if op == "get" else "not stored")
                out[t.name] = [False] * len(ks)
                continue
            try:
                out[t.name] = io.get_at(ks, hi) if op == "get" else io.set_at(ks, hi)
            except Exception as e:  # noqa: BLE001 - a pool bug is a miss / failed backup, never a crash
                self._counters.error(f"batch_{op}_v2", e)
                out[t.name] = [False] * len(ks)
        return out

    # ------------------------------------------------------------------ lifecycle
    def _all_io(self) -> List[PoolIO]:
        with self._pools_lock:
            return ([self.kv] if self.kv else []) + list(self.pools.values())

    def clear(self) -> None:
        """Drop every page of every pool's store (SGLang's ``/clear_hicache_storage_backend``)."""
        for io in self._all_io():
            try:
                if io.store is not None:
                    io.store.clear()
            except NotImplementedError:
                _warn.warning("clear", "tierkv HiCache clear: the %s store cannot clear", self.cfg.l3.get("backend"))

    def stats(self) -> Dict[str, Any]:
        """Adapter counters (pages asked/hit/stored/failed, errors, all pools), the anchor store's ``stats()`` under
        ``"store"`` and each side pool's under ``"pools"``."""
        with self._counters.lock:
            out: Dict[str, Any] = dict(self._counters.counts)
        if self.kv is not None and self.kv.store is not None:
            out["store"] = self.kv.store.stats()
        out["pools"] = {n: io.store.stats() for n, io in list(self.pools.items()) if io.store is not None}
        return out

    def get_stats(self):
        """SGLang's ``StorageMetrics`` (pages per prefetch / backup call since the last call), with tierkv's
        counters (:meth:`stats`) attached as ``.tierkv``."""
        c = self._counters
        with c.lock:
            pre, back = c.metrics["prefetch_pgs"], c.metrics["backup_pgs"]
            c.metrics = {"prefetch_pgs": [], "backup_pgs": []}
        try:
            from sglang.srt.observability.metrics_collector import StorageMetrics
        except Exception:  # noqa: BLE001 - metrics module not importable: plain counters only
            return None
        m = StorageMetrics()
        m.prefetch_pgs.extend(pre)
        m.backup_pgs.extend(back)
        m.tierkv = self.stats()
        return m

    def close(self) -> None:
        """Unregister the host pools and close every store. Idempotent; afterwards every call is a miss / False."""
        for io in self._all_io():
            io.close()


__all__ = ["TierKVHiCacheStorage", "SGLangExtraConfig", "parse_extra_config", "build_namespace", "side_namespace",
           "side_pool_l3", "map_key", "byte_runs", "SGLANG_KEYS", "FORMAT_VERSION", "records_per_page"]
