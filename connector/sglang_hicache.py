"""tierkv's L3 stores as an SGLang HiCache storage backend (docs/architecture.md §10).

SGLang (0.5.23) loads out-of-tree L3 backends with ``--hicache-storage-backend dynamic`` and
``--hicache-storage-backend-extra-config '{"backend_name": "tierkv", "module_path":
"tierkv.connector.sglang_hicache", "class_name": "TierKVHiCacheStorage", "interface_v1": 1, "l3": {...}}'``.
Its ``StorageBackendFactory`` imports this module, checks that :class:`TierKVHiCacheStorage` subclasses
``HiCacheStorage`` and builds it with ``(HiCacheStorageConfig, kwargs)``; the controller then calls
:meth:`TierKVHiCacheStorage.register_mem_pool_host` with its host pool (L2), and from two background threads
``batch_exists`` (prefetch queries), ``batch_get``/``batch_get_v1`` (L3 -> L2) and ``batch_set``/``batch_set_v1``
(L2 -> L3). ``l3`` is the ``l3`` section of a tierkv config (``backend: file|zmq|mooncake|lmcache`` plus that
backend's keys, optional ``faults``), built by :func:`tierkv.storage_backends.factory.build_backend`, so the same store, with
the same checks, serves vLLM (through :mod:`tierkv.connector.vllm_connector`) and SGLang.

This module is the engine edge: nothing in tierkv's core imports it, and it is the only tierkv module importing
``sglang`` (at import time; tierkv works without SGLang installed).

Keys (decision recorded in docs/architecture.md §10): SGLang names a page by a 64-hex SHA-256 chain hash that
carries neither the model's dtype nor the host layout, nor (for MLA) anything but the model name. tierkv stores
index 32-hex (16-byte) keys and check a 16-byte namespace digest in every record header. The adapter maps

    tierkv_key(page, part) = BLAKE2b-128("tierkv/sglang-key/v1" || namespace digest || SGLang key || part)

where the namespace (:class:`tierkv.connector.page_hash.ModelNamespace`) holds the served model name, the KV dtype
(for SGLang's ``uint8`` FP8 pools with the ``kv_cache_dtype`` of the extra config),
the host pool class and layout (plus SGLang's ``storage_format_tag``), page size in tokens, layer count, heads and
head dims, TP rank/size (ignored for MLA, whose pages are identical on every rank), PP rank/size, attention-CP and
DCP shard, and tierkv's ``FORMAT_VERSION``. So a page written by TP rank 0 of 2, by another dtype or layout, or
under another format version is a different key *and* a foreign namespace in the header: a miss, never data. The
record format is unchanged (no version bump): SGLang's key is an input of the key, not stored.

Pages and parts: a page is stored in the byte order of SGLang's flat data page (``host_pool.get_data_page(i)``,
what SGLang's own file backend stores), split into ``parts_per_page`` records of equal size: 2 for MHA pools with ``split_kv`` (the
K half and the V half, each one contiguous region of the host pool in the ``page_first``, ``page_first_direct`` and
``page_head`` layouts; the default for every backend but ``file``), else 1 (MLA, or ``file``: one file per page,
as SGLang's own file backend). The copy path (``batch_get``/``batch_set``, flat page tensors) and the zero-copy
path (``batch_get_v1``/``batch_set_v1``, host-pool indices) therefore read and write the same records. In the
zero-copy layouts the store reads into and writes from the host pool directly (Mooncake registers the whole pool,
as SGLang's Mooncake backend does); ``layer_first`` pages, and single-record MHA pages, are not one contiguous
region: each record is handed to the store as its contiguous runs in the pool (one per layer, or K then V), read
into and written from in place, when the store takes runs (``vectored_destinations`` / ``vectored_sources``) and the
runs average at least ``VECTORED_MIN_RUN_BYTES`` (the connector's rule, :mod:`tierkv.connector.l3_io`); otherwise
through one staging page each.
A page is present only if all its parts are; results keep SGLang's leading-run semantics.

Faults: a dead, hung or slow store answers misses/False within the store's own per-call bound (tierkv's ZMQ and
Mooncake clients have ``timeout_s``); nothing here raises on the I/O threads. Bad configuration raises
:class:`tierkv.storage_backends.common.ConfigError` at attach time (the constructor or ``register_mem_pool_host``),
which SGLang reports and rolls back.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any, Dict, List, Optional, Sequence

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig

from tierkv.connector.l3_io import VECTORED_MIN_RUN_BYTES
from tierkv.connector.page_hash import FORMAT_VERSION, KEY_BYTES, ModelNamespace, check_salt, resolve_salt
from tierkv.storage_backends.base import StorageBackend
from tierkv.storage_backends.common import ConfigError, RateLimitedLog, config_error
from tierkv.storage_backends.factory import L3_BACKENDS, build_backend, validate_l3

logger = logging.getLogger(__name__)
_warn = RateLimitedLog(logger)

#: extra-config keys that belong to SGLang (the controller pops most of them before the backend sees the rest)
SGLANG_KEYS = ("backend_name", "module_path", "class_name", "interface_v1", "prefetch_threshold",
               "prefetch_timeout_base", "prefetch_timeout_per_ki_token", "hicache_storage_pass_prefix_keys",
               "tp_lcm_size", "allocator")
_KEY_DOMAIN = b"tierkv/sglang-key/v1"


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


def _is_mha(pool: Any) -> bool:
    return hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer") and hasattr(pool, "head_num")


def records_per_page(pool: Any, split_kv: Optional[bool], backend: str) -> int:
    """Records one page is stored as: 2 (K, V) for an MHA pool when ``split_kv`` (default: every backend but
    ``file``), else 1."""
    if not _is_mha(pool):
        return 1
    if split_kv is None:
        split_kv = backend != "file"
    return 2 if split_kv else 1


def build_namespace(storage_config: HiCacheStorageConfig, pool: Any, model_id: Optional[str] = None,
                    namespace_extra: Sequence[str] = (), records: int = 1,
                    kv_cache_dtype: Optional[str] = None, salt: Optional[str] = None) -> ModelNamespace:
    """The tierkv namespace of one SGLang rank's pages (see the module docstring for what it holds). The dtype is
    the host pool's; a ``uint8`` pool (SGLang's storage of every FP8 format) adds ``kv_cache_dtype``.

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
    mha = _is_mha(pool)
    layout = f"sglang/{type(pool).__name__}/{pool.layout}"
    tag = getattr(pool, "storage_format_tag", None)
    if tag:
        layout += f"/{tag}"
    extra = [("sglang_hicache", 1),
             ("v_head_dim", int(getattr(pool, "v_head_dim", 0) or 0)),
             ("attn_cp", storage_config.attn_cp_rank, storage_config.attn_cp_size),
             ("dcp", storage_config.dcp_rank, storage_config.dcp_size, storage_config.logical_page_size or 0),
             ("records_per_page", int(records))]
    extra += [("user", str(x)) for x in namespace_extra]
    dtype = str(pool.dtype).removeprefix("torch.")
    if dtype == "uint8":
        if not kv_cache_dtype:
            raise ConfigError("SGLang's host pool holds this KV cache as uint8 (how it stores FP8), which does not "
                              "say which FP8 format: set 'kv_cache_dtype' in --hicache-storage-backend-extra-config "
                              "to SGLang's --kv-cache-dtype (e.g. fp8_e4m3, fp8_e5m2)")
        dtype += f"/{kv_cache_dtype}"
    return ModelNamespace(
        model_id=str(name), dtype=dtype, kv_layout=layout,
        page_size=int(pool.page_size), num_layers=int(pool.layer_num),
        num_kv_heads=int(pool.head_num) if mha else 1,
        head_dim=int(pool.head_dim) if mha else int(getattr(pool, "kv_cache_dim", 0) or 0),
        tp_rank=storage_config.tp_rank, tp_size=storage_config.tp_size,
        pp_rank=storage_config.pp_rank, pp_size=storage_config.pp_size,
        use_mla=bool(storage_config.is_mla_model), extra=tuple(extra), salt=salt)


def byte_runs(part: torch.Tensor) -> list:
    """The bytes of ``part`` (a view of SGLang's host pool whose last dimension is contiguous) in row-major order, as
    the fewest ``uint8`` numpy views that are each contiguous: split along the leading dimensions until each piece
    is (a ``layer_first`` K half: one run per layer). Their bytes in order are the part's flat form (what
    ``_copy_page`` stages). No copy."""
    def split(a) -> list:
        if a.flags.c_contiguous:
            return [a.reshape(-1)]
        return [r for i in range(a.shape[0]) for r in split(a[i])]
    return split(part.view(torch.uint8).numpy())


def map_key(namespace_digest: bytes, sglang_key: str, part: int) -> str:
    """tierkv key (32 lowercase hex) of part ``part`` of the page SGLang calls ``sglang_key`` (any string; 64-hex
    SHA-256 in SGLang 0.5.23)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(_KEY_DOMAIN)
    h.update(namespace_digest)
    h.update(sglang_key.encode())
    h.update(bytes((part,)))
    return h.hexdigest()


class TierKVHiCacheStorage(HiCacheStorage):
    """SGLang ``HiCacheStorage`` over one tierkv store (file, ZMQ cache server, Mooncake, LMCache server: any backend
    tierkv's factory builds). Built by SGLang's ``StorageBackendFactory`` (``dynamic``) as
    ``TierKVHiCacheStorage(storage_config, kwargs)``; usable only after :meth:`register_mem_pool_host`.

    Page tensors: the copy path takes and returns flat pages as SGLang's host pool makes them
    (``get_data_page(i)`` / ``get_dummy_flat_data_page()``: 1-D, the pool's dtype, ``page_bytes`` bytes); the
    zero-copy path takes ``host_indices`` (int64 token slots of the host pool, ``page_size`` per page, page ``i``
    starting at ``host_indices[i * page_size]``).

    Attributes (after registration): ``namespace`` (:class:`ModelNamespace`), ``page_bytes`` (bytes of one page),
    ``parts_per_page``, ``part_bytes``, ``zero_copy`` (False for ``layer_first`` and single-record MHA pages),
    ``vectored_get`` / ``vectored_set`` (such pages read / written in place as their runs; else staged), ``store``.

    Raises (at attach): :class:`ConfigError` for a bad extra config (see :func:`parse_extra_config`), a namespace
    that cannot be built (:func:`build_namespace`) or a store that cannot start.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: Optional[dict] = None):
        self.storage_config = storage_config
        self.cfg = parse_extra_config(storage_config.extra_config)
        self.store: Optional[StorageBackend] = None
        self.zero_copy = self.vectored_get = self.vectored_set = False
        self.mem_pool_host = None
        self.namespace: Optional[ModelNamespace] = None
        self._ns_digest = b""
        self._lock = threading.Lock()
        self._registered: Optional[torch.Tensor] = None
        self._counts = {"pages_get": 0, "pages_hit": 0, "pages_set": 0, "pages_set_failed": 0, "errors": 0}
        self._metrics = {"prefetch_pgs": [], "backup_pgs": []}
        self._closed = False
        # staged pages (layouts without an in-place region): one buffer per direction, since SGLang reads and
        # writes from two threads
        self._stage: Dict[str, torch.Tensor] = {}
        self._stage_lock = {"get": threading.Lock(), "set": threading.Lock()}

    # ------------------------------------------------------------------ attach
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        """Receive SGLang's host pool: build the namespace and the store (``l3``), register the pool's buffer with
        the store for zero-copy sets. Raises :class:`ConfigError` (SGLang rolls the attach back)."""
        if self.store is not None:  # registered again (SGLang registers once per attach): start over on this pool
            self.close()
            self._closed = False
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        probe = pool.get_data_page(0, flat=False)
        self.parts_per_page = records_per_page(pool, self.cfg.split_kv, str(self.cfg.l3.get("backend")))
        if self.parts_per_page == 2 and probe.shape[0] != 2:
            raise ConfigError(f"split_kv: a page of {type(pool).__name__} ({pool.layout}) has no K/V axis first "
                              f"(shape {tuple(probe.shape)}); set split_kv false")
        ns = build_namespace(self.storage_config, pool, self.cfg.model_id, self.cfg.namespace_extra,
                             self.parts_per_page, self.cfg.kv_cache_dtype, self.cfg.namespace_salt)
        self.page_bytes = probe.numel() * probe.element_size()
        if self.page_bytes % self.parts_per_page:
            raise ConfigError(f"host pool page of {self.page_bytes} bytes does not split into "
                              f"{self.parts_per_page} parts")
        self.part_bytes = self.page_bytes // self.parts_per_page
        self.zero_copy = all(p.is_contiguous() for p in self._split(probe))
        try:
            runs = 0 if self.zero_copy else sum(len(byte_runs(p)) for p in self._split(probe))
        except (RuntimeError, TypeError):  # a view whose last dimension is not contiguous: staged
            runs = 0
        self.page_size = int(pool.page_size)
        self.namespace = ns
        self._ns_digest = ns.digest()
        store = build_backend(self.cfg.l3, self._ns_digest, self.part_bytes)
        long_runs = runs > 0 and self.page_bytes >= runs * VECTORED_MIN_RUN_BYTES
        self.vectored_get = long_runs and bool(getattr(store, "vectored_destinations", False))
        self.vectored_set = long_runs and bool(getattr(store, "vectored_sources", False))
        if self.zero_copy:
            kv = getattr(pool, "kv_buffer", None)
            if isinstance(kv, torch.Tensor) and kv.is_contiguous():
                try:
                    if store.register_host_buffer(kv):
                        self._registered = kv
                except ValueError as e:  # not a CPU buffer (cannot happen for SGLang host pools); stay on copies
                    _warn.warning("register", "host pool not registered with the store: %s", e)
        self.store = store
        logger.info("tierkv HiCache storage: %s store, namespace %s, %d B/page in %d part(s), %s",
                    self.cfg.l3.get("backend"), self._ns_digest.hex(), self.page_bytes, self.parts_per_page,
                    "zero-copy" if self.zero_copy else
                    f"{runs} runs in place ({pool.layout})" if self.vectored_get and self.vectored_set else
                    f"staged ({pool.layout})")

    def _need_store(self) -> StorageBackend:
        if self.store is None:
            raise RuntimeError("TierKVHiCacheStorage used before register_mem_pool_host (SGLang calls it at attach)")
        return self.store

    # ------------------------------------------------------------------ keys and views
    def tierkv_keys(self, key: str) -> List[str]:
        """The tierkv keys (one per part) under which SGLang's page ``key`` is stored."""
        return [map_key(self._ns_digest, key, j) for j in range(self.parts_per_page)]

    def _all_keys(self, keys: Sequence[str]) -> List[str]:
        d, n = self._ns_digest, self.parts_per_page
        return [map_key(d, k, j) for k in keys for j in range(n)]

    def _split(self, page: torch.Tensor) -> List[torch.Tensor]:
        """Parts of a page as given by ``get_data_page(i, flat=False)`` (views into the pool)."""
        return [page[j] for j in range(2)] if self.parts_per_page == 2 else [page]

    def _flat_parts(self, flat: torch.Tensor) -> List[torch.Tensor]:
        b = flat.reshape(-1).view(torch.uint8)
        pb = self.part_bytes
        return [b[j * pb:(j + 1) * pb] for j in range(self.parts_per_page)]

    def _page_ok(self, res: Sequence[bool], n_pages: int) -> List[bool]:
        p = self.parts_per_page
        if len(res) != n_pages * p:
            return [False] * n_pages
        return [all(res[i * p:(i + 1) * p]) for i in range(n_pages)]

    def _page_starts(self, n: int, host_indices: torch.Tensor) -> List[int]:
        starts = host_indices[: n * self.page_size: self.page_size].tolist()
        if len(starts) != n:
            raise ValueError(f"{n} keys but {host_indices.numel()} host indices (page_size {self.page_size})")
        return starts

    # ------------------------------------------------------------------ existence
    def batch_exists(self, keys: List[str], extra_info: Any = None) -> int:
        """Number of leading ``keys`` whose every part is stored (0 on any store error)."""
        if not keys:
            return 0
        try:
            n = self._need_store().batch_exists(self._all_keys(keys))
        except Exception as e:  # noqa: BLE001 - a store bug must not kill SGLang's prefetch thread
            self._count_error("batch_exists", e)
            return 0
        return n // self.parts_per_page

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    # ------------------------------------------------------------------ copy path
    def batch_get(self, keys: List[str], target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> List[Optional[torch.Tensor]]:
        """Copy path: fill each flat page tensor in ``target_locations`` (SGLang passes
        ``get_dummy_flat_data_page()`` per key; ``None`` allocates them) and return it, or ``None`` for a miss
        (missing, corrupt, truncated, foreign or unreadable)."""
        if not keys:
            return []
        store = self._need_store()
        if target_locations is None:
            target_locations = [torch.empty(self.page_bytes, dtype=torch.uint8).view(self.mem_pool_host.dtype)
                                for _ in keys]
        dests = [p for t in target_locations for p in self._flat_parts(t)]
        ok = self._get(store, keys, dests)
        return [t if o else None for t, o in zip(target_locations, ok)]

    def get(self, key: str, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> Optional[torch.Tensor]:
        return self.batch_get([key], None if target_location is None else [target_location])[0]

    def batch_set(self, keys: List[str], values: Optional[Any] = None, target_locations: Optional[Any] = None,
                  target_sizes: Optional[Any] = None) -> bool:
        """Copy path: store flat pages ``values`` (``get_data_page(i)`` per key). True only if every page was
        stored."""
        if not keys:
            return True
        store = self._need_store()
        srcs = [p for v in values for p in self._flat_parts(v.contiguous())]
        return all(self._set(store, keys, srcs))

    def set(self, key: str, value: Optional[Any] = None, target_location: Optional[Any] = None,
            target_sizes: Optional[Any] = None) -> bool:
        return self.batch_set([key], [value])

    # ------------------------------------------------------------------ zero-copy path
    def batch_get_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Zero-copy path: read page ``i`` straight into the host-pool slots starting at
        ``host_indices[i * page_size]``; one bool per key (SGLang uses the leading run of True)."""
        if not keys:
            return []
        store = self._need_store()
        pool = self.mem_pool_host
        starts = self._page_starts(len(keys), host_indices)
        if self.zero_copy or self.vectored_get:
            dests = [self._in_place(p) for s in starts for p in self._split(pool.get_data_page(s, flat=False))]
            return self._get(store, keys, dests)
        with self._stage_lock["get"]:
            staging = self._staging("get", len(keys))
            ok = self._get(store, keys, [p for t in staging for p in self._flat_parts(t)])
            for s, t, o in zip(starts, staging, ok):
                if o:
                    self._copy_page(pool.get_data_page(s, flat=False), t, to_pool=True)
        return ok

    def batch_set_v1(self, keys: List[str], host_indices: torch.Tensor, extra_info: Any = None) -> List[bool]:
        """Zero-copy path: store the pages held in the host-pool slots starting at ``host_indices[i * page_size]``;
        one bool per key."""
        if not keys:
            return []
        store = self._need_store()
        pool = self.mem_pool_host
        starts = self._page_starts(len(keys), host_indices)
        if self.zero_copy or self.vectored_set:
            srcs = [self._in_place(p) for s in starts for p in self._split(pool.get_data_page(s, flat=False))]
            return self._set(store, keys, srcs)
        with self._stage_lock["set"]:
            staging = self._staging("set", len(keys))
            for s, t in zip(starts, staging):
                self._copy_page(pool.get_data_page(s, flat=False), t, to_pool=False)
            return self._set(store, keys, [p for t in staging for p in self._flat_parts(t)])

    def _in_place(self, part: torch.Tensor) -> Any:
        """A record's part as the store is given it in place: the view itself when it is one contiguous region
        (zero-copy layouts), else its runs (:func:`byte_runs`)."""
        return part if self.zero_copy else byte_runs(part)

    def _copy_page(self, page: torch.Tensor, flat: torch.Tensor, to_pool: bool) -> None:
        """Copy between a host-pool page (``get_data_page(i, flat=False)``, a view) and its flat byte form
        ``flat`` (uint8, ``page_bytes``), the K and V halves separately: each is one contiguous region in the
        page-first layouts (a plain memcpy), cheaper than one strided copy of the whole page."""
        off = 0
        for part in ([page[0], page[1]] if _is_mha(self.mem_pool_host) and page.shape[0] == 2 else [page]):
            n = part.numel() * part.element_size()
            f = flat[off:off + n].view(part.dtype).view(part.shape)
            (part.copy_(f) if to_pool else f.copy_(part))
            off += n

    def _staging(self, direction: str, n: int) -> List[torch.Tensor]:
        """``n`` page-sized uint8 views of this direction's staging buffer (kept between calls, grown on demand:
        no allocation and no fresh page faults per batch). Caller holds ``self._stage_lock[direction]``."""
        buf = self._stage.get(direction)
        if buf is None or buf.numel() < n * self.page_bytes:
            buf = self._stage[direction] = torch.empty(n * self.page_bytes, dtype=torch.uint8)
        pb = self.page_bytes
        return [buf[i * pb:(i + 1) * pb] for i in range(n)]

    # ------------------------------------------------------------------ I/O with accounting
    def _get(self, store: StorageBackend, keys: Sequence[str], dests: List[Any]) -> List[bool]:
        try:
            res = store.batch_get(self._all_keys(keys), dests)
        except Exception as e:  # noqa: BLE001 - degrade to a miss, never crash the prefetch thread
            self._count_error("batch_get", e)
            return [False] * len(keys)
        ok = self._page_ok(res, len(keys))
        hits = sum(ok)
        with self._lock:
            self._counts["pages_get"] += len(keys)
            self._counts["pages_hit"] += hits
            self._metrics["prefetch_pgs"].append(hits)
        return ok

    def _set(self, store: StorageBackend, keys: Sequence[str], srcs: List[Any]) -> List[bool]:
        try:
            res = store.batch_set(self._all_keys(keys), srcs)
        except Exception as e:  # noqa: BLE001 - a failed backup is a later miss, never a crash
            self._count_error("batch_set", e)
            return [False] * len(keys)
        ok = self._page_ok(res, len(keys))
        done = sum(ok)
        with self._lock:
            self._counts["pages_set"] += done
            self._counts["pages_set_failed"] += len(keys) - done
            self._metrics["backup_pgs"].append(done)
        return ok

    def _count_error(self, op: str, e: BaseException) -> None:
        with self._lock:
            self._counts["errors"] += 1
        if isinstance(e, ValueError):  # a caller bug (wrong buffer size, bad key): say so loudly
            logger.error("tierkv HiCache %s: %s", op, e)
        else:
            _warn.warning(op, "tierkv HiCache %s failed (%s: %s); treated as a miss", op, type(e).__name__, e)

    # ------------------------------------------------------------------ lifecycle
    def clear(self) -> None:
        """Drop every page of this namespace from the store (SGLang's ``/clear_hicache_storage_backend``)."""
        if self.store is None:
            return
        try:
            self.store.clear()
        except NotImplementedError:
            _warn.warning("clear", "tierkv HiCache clear: the %s store cannot clear", self.cfg.l3.get("backend"))

    def stats(self) -> Dict[str, Any]:
        """Adapter counters (pages asked/hit/stored/failed, errors) and the store's own ``stats()`` under
        ``"store"``."""
        with self._lock:
            out: Dict[str, Any] = dict(self._counts)
        if self.store is not None:
            out["store"] = self.store.stats()
        return out

    def get_stats(self):
        """SGLang's ``StorageMetrics`` (pages per prefetch / backup call since the last call), with tierkv's
        counters (:meth:`stats`) attached as ``.tierkv``."""
        with self._lock:
            pre, back = self._metrics["prefetch_pgs"], self._metrics["backup_pgs"]
            self._metrics = {"prefetch_pgs": [], "backup_pgs": []}
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
        """Unregister the host pool and close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        store, self.store = self.store, None
        if store is None:
            return
        if self._registered is not None:
            try:
                store.unregister_host_buffer(self._registered)
            except Exception as e:  # noqa: BLE001
                _warn.warning("close", "tierkv HiCache close: unregister failed: %s", e)
            self._registered = None
        store.close()


__all__ = ["TierKVHiCacheStorage", "SGLangExtraConfig", "parse_extra_config", "build_namespace", "map_key",
           "SGLANG_KEYS", "FORMAT_VERSION", "records_per_page"]
