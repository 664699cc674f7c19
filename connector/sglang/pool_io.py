"""One SGLang host pool's pages in one tierkv store: the I/O half of :mod:`tierkv.connector.sglang.hicache`.

A :class:`PoolIO` owns a store built for the pool's namespace and record size (a store holds one record size), maps
SGLang's page keys to tierkv keys (:func:`map_key`) and moves pages between the pool and the store in one of three
modes, picked at attach from what the pool offers:

- ``view``: ``get_data_page(i, flat=False)`` is a view into the pool's buffer (MHA/MLA KV pools, SWA pools): records
  are read and written in place (one region, or its byte runs) or through one staging page each;
- ``flat``: ``get_data_page`` returns a copy (Mamba state pools): pages go out as ``get_data_page(i, flat=True)``
  and come back through ``set_from_flat_data_page``;
- ``meta``: only ``get_page_buffer_meta`` (pointer, size) entries into a contiguous ``kv_buffer``: each entry is one
  record, read and written in place; a pointer outside ``kv_buffer`` raises ValueError, never dereferenced.

A page is present only if all its records are. Store errors become misses / False, counted in :class:`IOCounters`.
"""
from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from tierkv.connector.l3.io import VECTORED_MIN_RUN_BYTES
from tierkv.connector.core.page_hash import KEY_BYTES, ModelNamespace
from tierkv.storage_backends.base import StorageBackend
from tierkv.storage_backends.common import ConfigError, RateLimitedLog
from tierkv.storage_backends.factory import build_backend

logger = logging.getLogger("tierkv.connector.sglang.hicache")
_warn = RateLimitedLog(logger)
_KEY_DOMAIN = b"tierkv/sglang-key/v1"


def map_key(namespace_digest: bytes, sglang_key: str, part: int) -> str:
    """tierkv key (32 lowercase hex) of part ``part`` of the page SGLang calls ``sglang_key`` (any string; 64-hex
    SHA-256 in SGLang 0.5.23)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    h.update(_KEY_DOMAIN)
    h.update(namespace_digest)
    h.update(sglang_key.encode())
    h.update(bytes((part,)))
    return h.hexdigest()


def is_mha(pool: Any) -> bool:
    return hasattr(pool, "k_buffer") and hasattr(pool, "v_buffer") and hasattr(pool, "head_num")


def byte_runs(part: torch.Tensor) -> list:
    """The bytes of ``part`` (a view of SGLang's host pool whose last dimension is contiguous) in row-major order, as
    the fewest ``uint8`` numpy views that are each contiguous: split along the leading dimensions until each piece
    is (a ``layer_first`` K half: one run per layer). Their bytes in order are the part's flat form. No copy."""
    def split(a) -> list:
        if a.flags.c_contiguous:
            return [a.reshape(-1)]
        return [r for i in range(a.shape[0]) for r in split(a[i])]
    return split(part.view(torch.uint8).numpy())


def pool_buffers(pool: Any) -> List[torch.Tensor]:
    """The pool's own contiguous CPU tensors (``kv_buffer``, or each tensor of a list of them; Mamba's temporal and
    conv buffers): the only memory a view or a caller's pointer may address."""
    out = []
    for attr in ("kv_buffer", "temporal_buffer", "conv_buffer"):
        v = getattr(pool, attr, None)
        for t in (v if isinstance(v, (list, tuple)) else [v]):
            if isinstance(t, torch.Tensor) and t.is_contiguous() and t.device.type == "cpu" and t.numel():
                out.append(t)
    return out


def region(pool: Any, ptr: int, size: int) -> Optional[torch.Tensor]:
    """The ``size`` bytes at address ``ptr`` as a uint8 view of one of the pool's buffers, or None when they do not
    lie inside one."""
    for t in pool_buffers(pool):
        base, n = t.data_ptr(), t.numel() * t.element_size()
        if size > 0 and base <= ptr and ptr + size <= base + n:
            off = ptr - base
            return t.reshape(-1).view(torch.uint8)[off:off + size]
    return None


class IOCounters:
    """Pages asked / hit / stored / failed and errors of one adapter (all its pools), plus SGLang's per-call
    page counts (``StorageMetrics``). Thread-safe."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.counts = {"pages_get": 0, "pages_hit": 0, "pages_set": 0, "pages_set_failed": 0, "errors": 0,
                       "v2_rejected": 0, "pointer_rejected": 0}
        self.metrics: Dict[str, list] = {"prefetch_pgs": [], "backup_pgs": []}

    def got(self, asked: int, hits: int) -> None:
        with self.lock:
            self.counts["pages_get"] += asked
            self.counts["pages_hit"] += hits
            self.metrics["prefetch_pgs"].append(hits)

    def stored(self, asked: int, done: int) -> None:
        with self.lock:
            self.counts["pages_set"] += done
            self.counts["pages_set_failed"] += asked - done
            self.metrics["backup_pgs"].append(done)

    def bump(self, name: str) -> None:
        with self.lock:
            self.counts[name] += 1

    def error(self, op: str, e: BaseException) -> None:
        with self.lock:
            self.counts["errors"] += 1
        if isinstance(e, ValueError):  # a caller bug (wrong buffer size, bad key): say so loudly
            logger.error("tierkv HiCache %s: %s", op, e)
        else:
            _warn.warning(op, "tierkv HiCache %s failed (%s: %s); treated as a miss", op, type(e).__name__, e)


class PoolIO:
    """Pages of host pool ``pool`` (named ``name``: ``kv`` for SGLang's anchor pool) in a store of ``l3`` under
    ``namespace(records_per_page, page_bytes)``, ``parts`` records per page (2 = K and V halves of an MHA view page, else 1; a ``meta`` pool has
    one record per buffer entry). Attributes: ``mode``, ``page_bytes``, ``part_bytes``, ``parts_per_page``,
    ``zero_copy``, ``vectored_get`` / ``vectored_set``, ``digest``, ``store``. Raises ConfigError at build."""

    def __init__(self, pool: Any, name: str, namespace: Callable[[int, int], ModelNamespace], parts: int, l3: dict,
                 counters: IOCounters):
        self.pool, self.name, self.counters = pool, str(name), counters
        self.page_size = int(getattr(pool, "page_size", 1) or 1)
        self.zero_copy = self.vectored_get = self.vectored_set = False
        self._registered: Optional[torch.Tensor] = None
        self._stage: Dict[str, torch.Tensor] = {}
        self._stage_lock = {"get": threading.Lock(), "set": threading.Lock()}
        runs = 0
        if hasattr(pool, "get_data_page"):
            probe = pool.get_data_page(0, flat=False)
            owners = {t.untyped_storage().data_ptr() for t in pool_buffers(pool)}
            self.mode = "view" if probe.untyped_storage().data_ptr() in owners else "flat"
            if self.mode == "flat":
                parts = 1
            elif parts == 2 and probe.shape[0] != 2:
                raise ConfigError(f"split_kv: a page of {type(pool).__name__} ({pool.layout}) has no K/V axis first "
                                  f"(shape {tuple(probe.shape)}); set split_kv false")
            self.page_bytes = probe.numel() * probe.element_size()
            if self.mode == "flat":
                self.flat_dtype = pool.get_dummy_flat_data_page().dtype
        elif hasattr(pool, "get_page_buffer_meta") and isinstance(getattr(pool, "kv_buffer", None), torch.Tensor):
            self.mode = "meta"
            ptrs, sizes = pool.get_page_buffer_meta(torch.arange(self.page_size, dtype=torch.int64))
            if not sizes or len(set(sizes)) != 1:
                raise ConfigError(f"{type(pool).__name__}: page buffer entries of unequal sizes {sizes} cannot be "
                                  "stored as equal records")
            parts, self.page_bytes = len(sizes), sum(sizes)
        else:
            raise ConfigError(f"host pool {type(pool).__name__} ({name}) has neither get_data_page nor "
                              "get_page_buffer_meta: the tierkv HiCache backend cannot read its pages")
        self.parts_per_page = parts
        if self.page_bytes <= 0:
            raise ConfigError(f"host pool {name} ({type(pool).__name__}) holds no page bytes (a logical anchor pool): "
                              "not supported by the tierkv HiCache backend")
        if self.page_bytes % parts:
            raise ConfigError(f"host pool {name}: a page of {self.page_bytes} bytes does not split into {parts} parts")
        self.part_bytes = self.page_bytes // parts
        self.namespace = namespace(parts, self.page_bytes)
        self.digest = self.namespace.digest()
        if self.mode == "view":
            self.zero_copy = all(p.is_contiguous() for p in self._split(probe))
            try:
                runs = 0 if self.zero_copy else sum(len(byte_runs(p)) for p in self._split(probe))
            except (RuntimeError, TypeError):  # a view whose last dimension is not contiguous: staged
                runs = 0
        self.zero_copy = self.zero_copy or self.mode == "meta"
        store = build_backend(l3, self.digest, self.part_bytes)
        long_runs = runs > 0 and self.page_bytes >= runs * VECTORED_MIN_RUN_BYTES
        self.vectored_get = long_runs and bool(getattr(store, "vectored_destinations", False))
        self.vectored_set = long_runs and bool(getattr(store, "vectored_sources", False))
        kv = getattr(pool, "kv_buffer", None)
        if self.zero_copy and isinstance(kv, torch.Tensor) and kv.is_contiguous():
            try:
                if store.register_host_buffer(kv):
                    self._registered = kv
            except ValueError as e:  # not a CPU buffer (cannot happen for SGLang host pools); stay on copies
                _warn.warning("register", "host pool not registered with the store: %s", e)
        self.store: Optional[StorageBackend] = store
        self.how = ("zero-copy" if self.zero_copy else f"{runs} runs in place" if self.vectored_get and self.vectored_set
                    else "staged")

    # ------------------------------------------------------------------ keys and views
    def keys_of(self, keys: Sequence[str]) -> List[str]:
        d, n = self.digest, self.parts_per_page
        return [map_key(d, k, j) for k in keys for j in range(n)]

    def _split(self, page: torch.Tensor) -> List[torch.Tensor]:
        return [page[j] for j in range(2)] if self.parts_per_page == 2 else [page]

    def flat_parts(self, flat: torch.Tensor) -> List[torch.Tensor]:
        b = flat.reshape(-1).view(torch.uint8)
        pb = self.part_bytes
        return [b[j * pb:(j + 1) * pb] for j in range(self.parts_per_page)]

    def page_starts(self, n: int, host_indices: torch.Tensor) -> List[int]:
        starts = host_indices[: n * self.page_size: self.page_size].tolist()
        if len(starts) != n or host_indices.numel() < n * self.page_size:
            raise ValueError(f"{self.name}: {n} keys but {host_indices.numel()} host indices "
                             f"(page_size {self.page_size})")
        return starts

    def _in_place(self, starts: Sequence[int]) -> List[Any]:
        """Per record, what the store reads into / writes from in place: a pool view (one region), its runs, or a
        ``meta`` entry's region."""
        if self.mode == "meta":
            ptrs, sizes = self.pool.get_page_buffer_meta(
                torch.tensor([s + j for s in starts for j in range(self.page_size)], dtype=torch.int64))
            out = [region(self.pool, p, n) for p, n in zip(ptrs, sizes)]
            if len(out) != len(starts) * self.parts_per_page or any(r is None for r in out):
                raise ValueError(f"{self.name}: get_page_buffer_meta gave entries outside the pool's buffer")
            return out
        parts = [p for s in starts for p in self._split(self.pool.get_data_page(s, flat=False))]
        return parts if self.zero_copy else [byte_runs(p) for p in parts]

    def _staging(self, direction: str, n: int) -> List[torch.Tensor]:
        """``n`` page-sized uint8 views of this direction's staging buffer (kept, grown on demand). Caller holds
        ``self._stage_lock[direction]``."""
        buf = self._stage.get(direction)
        if buf is None or buf.numel() < n * self.page_bytes:
            buf = self._stage[direction] = torch.empty(n * self.page_bytes, dtype=torch.uint8)
        pb = self.page_bytes
        return [buf[i * pb:(i + 1) * pb] for i in range(n)]

    def _copy_page(self, start: int, flat: torch.Tensor, to_pool: bool) -> None:
        """Copy between the pool page at ``start`` and its flat byte form ``flat`` (uint8, ``page_bytes``)."""
        pool = self.pool
        if self.mode == "flat":
            if to_pool:
                pool.set_from_flat_data_page(start, flat.view(self.flat_dtype))
            else:
                flat.copy_(pool.get_data_page(start, flat=True).contiguous().reshape(-1).view(torch.uint8))
            return
        page = pool.get_data_page(start, flat=False)
        off = 0  # K and V halves separately: each is one region in the page-first layouts (a plain memcpy)
        for part in ([page[0], page[1]] if is_mha(pool) and page.shape[0] == 2 else [page]):
            n = part.numel() * part.element_size()
            f = flat[off:off + n].view(part.dtype).view(part.shape)
            (part.copy_(f) if to_pool else f.copy_(part))
            off += n

    # ------------------------------------------------------------------ pages at host indices
    def exists(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` whose every record is stored (0 on any store error)."""
        if not keys:
            return 0
        try:
            return self.store.batch_exists(self.keys_of(keys)) // self.parts_per_page
        except Exception as e:  # noqa: BLE001 - a store bug must not kill SGLang's prefetch thread
            self.counters.error("batch_exists", e)
            return 0

    def get_at(self, keys: Sequence[str], host_indices: torch.Tensor) -> List[bool]:
        """Read page ``i`` into the pool slots starting at ``host_indices[i * page_size]``; one bool per key."""
        if not keys:
            return []
        starts = self.page_starts(len(keys), host_indices)
        if self.zero_copy or self.vectored_get:
            return self.get(keys, self._in_place(starts))
        with self._stage_lock["get"]:
            staging = self._staging("get", len(keys))
            ok = self.get(keys, [p for t in staging for p in self.flat_parts(t)])
            for s, t, o in zip(starts, staging, ok):
                if o:
                    self._copy_page(s, t, to_pool=True)
        return ok

    def set_at(self, keys: Sequence[str], host_indices: torch.Tensor) -> List[bool]:
        """Store the pages held in the pool slots starting at ``host_indices[i * page_size]``; one bool per key."""
        if not keys:
            return []
        starts = self.page_starts(len(keys), host_indices)
        if self.zero_copy or self.vectored_set:
            return self.set(keys, self._in_place(starts))
        with self._stage_lock["set"]:
            staging = self._staging("set", len(keys))
            for s, t in zip(starts, staging):
                self._copy_page(s, t, to_pool=False)
            return self.set(keys, [p for t in staging for p in self.flat_parts(t)])

    # ------------------------------------------------------------------ records, with accounting
    def get(self, keys: Sequence[str], dests: List[Any]) -> List[bool]:
        """Read the records of ``keys`` into ``dests`` (``parts_per_page`` per key); one bool per page."""
        try:
            res = self.store.batch_get(self.keys_of(keys), dests)
        except Exception as e:  # noqa: BLE001 - degrade to a miss, never crash the prefetch thread
            self.counters.error("batch_get", e)
            return [False] * len(keys)
        ok = self._page_ok(res, len(keys))
        self.counters.got(len(keys), sum(ok))
        return ok

    def set(self, keys: Sequence[str], srcs: List[Any]) -> List[bool]:
        """Store the records of ``keys`` from ``srcs`` (``parts_per_page`` per key); one bool per page."""
        try:
            res = self.store.batch_set(self.keys_of(keys), srcs)
        except Exception as e:  # noqa: BLE001 - a failed backup is a later miss, never a crash
            self.counters.error("batch_set", e)
            return [False] * len(keys)
        ok = self._page_ok(res, len(keys))
        self.counters.stored(len(keys), sum(ok))
        return ok

    def _page_ok(self, res: Sequence[bool], n_pages: int) -> List[bool]:
        p = self.parts_per_page
        if len(res) != n_pages * p:
            return [False] * n_pages
        return [all(res[i * p:(i + 1) * p]) for i in range(n_pages)]

    def close(self) -> None:
        """Unregister the pool's buffer and close the store. Idempotent."""
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
