"""L3 backend over the Mooncake store (``mooncake_master`` + ``mooncake.store.MooncakeDistributedStore``), the
distributed L3 for deployments that outgrow one node.

Page ``key`` of namespace ``ns`` is the object ``<key_prefix>/<ns hex>/<key>`` holding a page record (64-byte header
|| payload, :mod:`tierkv.storage_backends.page_format`); every read verifies it, so a truncated, corrupted or foreign
record is a miss, counted ``corrupt`` and removed. Sets of big pages inside a registered host buffer go zero-copy
(:mod:`.zero_copy`); other sets are staged and upserted; gets land in a staging buffer and are copied out only once
verified. Every client call runs on a worker thread under ``timeout_s`` (a timeout is a miss / ``False`` / 0) with at
most ``max_inflight`` outstanding. A writer killed mid-put leaves a key an upsert reclaims; after a master restart
old objects are misses and clients re-mount by themselves.

Requires ``mooncake-transfer-engine-non-cuda`` (CPU) or ``mooncake-transfer-engine`` and ``libibverbs1``.
``MC_TCP_BIND_ADDRESS`` is set to ``local_hostname`` when unset.
"""
from __future__ import annotations

import concurrent.futures as cf
import logging
import os
import re
import socket
import threading
import time
from typing import Any, Callable, Optional, Sequence

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tierkv.storage_backends.base import Buffer, PageTokens, StorageBackend
from tierkv.storage_backends.common import (ConfigError, Counters, RateLimitedLog, check_store_identity,
                                             config_error, parse_bytes)
from tierkv.storage_backends.page_format import (
    HEADER_BYTES,
    PageFormatError,
    check_checksums,
    check_key,
    copy_verified,
    encode_header,
)
from tierkv.storage_backends.mooncake.zero_copy import (  # noqa: F401 - also imported from here
    PUT_GROUP_BYTES,
    HostBuffers,
    _BufferPool,
    _Hold,
    _Staging,
)

log = logging.getLogger("tierkv.storage.mooncake")

#: Mooncake client error codes this module distinguishes (mooncake-store ``ErrorCode``).
MC_OBJECT_NOT_FOUND = -704
MC_BUFFER_TOO_SMALL = -600
MC_MIN_SEGMENT = 16 << 20  # the client refuses smaller non-zero segments
MC_UPSERT_CONFLICT = -601  # another client's put/upsert of the same key is in progress
_NOT_FOUND_CODES = (MC_OBJECT_NOT_FOUND, -703)  # -703: not (yet) ready, e.g. a put in progress
#: native clients not (yet) closed cleanly: open ones, a setup that timed out, calls still outstanding at close. A
#: client leaves this list only when its close() succeeds; the others live until the process exits. The native
#: destructor of a client whose master is gone blocks while it retries the master (16 s seen in CI), so it is never
#: left to the garbage collector, which would stall whichever thread happened to collect it.
_UNCLOSED: list = []

_PREFIX_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,64}$")


class MooncakeStoreConfig(BaseModel):
    """Keys of ``l3.mooncake`` (see ``configs/l3_mooncake.yaml``). Sizes take ints (bytes) or strings such as
    ``"512MiB"``, ``"1gb"``. Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")

    master_address: str = "127.0.0.1:50051"
    metadata_server: str = "http://127.0.0.1:8080/metadata"
    protocol: str = "tcp"
    local_hostname: str = "127.0.0.1"
    global_segment_size: int = Field(default=512 << 20, ge=0)
    local_buffer_size: int = Field(default=16 << 20, ge=0)
    device_name: str = ""
    timeout_s: float = Field(default=5.0, gt=0, le=3600)
    key_prefix: str = "tierkv"
    staging_bytes: int = Field(default=160 << 20, gt=0)
    max_inflight: int = Field(default=4, ge=1, le=64)
    setup_timeout_s: float = Field(default=30.0, gt=0)
    replica_num: int = Field(default=1, ge=1, le=16)
    remove_corrupt: bool = True
    zero_copy_min_page_bytes: int = Field(default=1 << 20, ge=0)

    @field_validator("global_segment_size", "local_buffer_size", "staging_bytes", "zero_copy_min_page_bytes",
                     mode="before")
    @classmethod
    def _size(cls, v: Any) -> Any:
        return parse_bytes(v)

    @field_validator("global_segment_size")
    @classmethod
    def _segment(cls, v: int) -> int:
        if 0 < v < MC_MIN_SEGMENT:
            raise ValueError(f"0 (no memory) or at least {MC_MIN_SEGMENT} bytes (Mooncake's minimum segment)")
        return v

    @field_validator("master_address")
    @classmethod
    def _hostport(cls, v: str) -> str:
        host, sep, port = v.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError("expected host:port, e.g. 127.0.0.1:50051")
        return v

    @field_validator("metadata_server")
    @classmethod
    def _meta(cls, v: str) -> str:
        if not (v.startswith(("http://", "etcd://", "redis://")) or v in ("P2PHANDSHAKE",)):
            raise ValueError("expected an http://host:port/metadata URL (or etcd://, redis://, P2PHANDSHAKE)")
        return v

    @field_validator("protocol")
    @classmethod
    def _proto(cls, v: str) -> str:
        if v not in ("tcp", "rdma", "efa", "cxl", "nvlink", "ascend"):
            raise ValueError("allowed values are 'tcp', 'rdma', 'efa', 'cxl', 'nvlink', 'ascend'")
        return v

    @field_validator("key_prefix")
    @classmethod
    def _prefix(cls, v: str) -> str:
        if not _PREFIX_RE.match(v):
            raise ValueError("1-64 characters from [A-Za-z0-9_.-]")
        return v


def _probe_endpoints(c: MooncakeStoreConfig) -> None:
    """Fail fast (ConfigError) if the master's RPC port or an http:// metadata server does not accept a TCP
    connection within ``setup_timeout_s``: Mooncake's own ``setup`` holds the GIL while it retries for minutes."""
    targets = [("master_address", c.master_address)]
    if c.metadata_server.startswith("http://"):
        hostport = c.metadata_server[len("http://"):].split("/", 1)[0]
        targets.append(("metadata_server", hostport if ":" in hostport else hostport + ":80"))
    deadline = time.monotonic() + c.setup_timeout_s
    for key, hp in targets:
        host, _, port = hp.rpartition(":")
        host = host.strip("[]")
        while True:
            left = deadline - time.monotonic()
            try:
                with socket.create_connection((host, int(port)), timeout=max(0.1, min(2.0, left))):
                    break
            except OSError as e:
                if time.monotonic() >= deadline:
                    raise ConfigError(f"mooncake: cannot connect to 'l3.mooncake.{key}'={getattr(c, key)!r} "
                                      f"within setup_timeout_s={c.setup_timeout_s}s: {e}") from None
                time.sleep(0.1)  # retry interval while the master may still be starting


class MooncakeStore(HostBuffers, StorageBackend):
    """A :class:`~tierkv.storage_backends.base.StorageBackend` over one ``MooncakeDistributedStore`` client.

    Args:
        namespace: 16-byte namespace digest, written into and checked against every page header.
        page_bytes: bytes of one page payload (> 0); sources and destinations must have exactly this many bytes.
        master_address: ``host:port`` of ``mooncake_master``'s RPC port.
        metadata_server: the transfer engine's metadata service, e.g. the master's own HTTP metadata server
            ``http://127.0.0.1:8080/metadata`` (``mooncake_master -enable_http_metadata_server=true``).
        protocol: transfer protocol (``tcp`` on CPU machines; ``rdma`` needs ``device_name``).
        local_hostname: address this client's transfer engine advertises (loopback for one node).
        global_segment_size: bytes of memory this client contributes to the store (0 = pure client).
        local_buffer_size: bytes of Mooncake's own client buffer (used by its bytes API only).
        device_name: RDMA device list for ``protocol: rdma``; empty for tcp.
        timeout_s: the most a call waits for Mooncake (seconds); later results are dropped (miss/False/0).
        key_prefix: first component of every Mooncake object name (``[A-Za-z0-9_.-]``, up to 64 chars).
        staging_bytes: size of one registered staging buffer; a batch larger than it is split into several calls.
        max_inflight: Mooncake calls that may be outstanding at once (including ones abandoned after a timeout).
        setup_timeout_s: the most construction waits for the client to join the master.
        replica_num: Mooncake replicas per object.
        remove_corrupt: remove an object whose record fails verification (so the key can be stored again).
        zero_copy_min_page_bytes: smallest page sent zero-copy from a registered host buffer (default 1 MiB);
            smaller pages are staged: over TCP the separate 64-byte header slice costs more than copying a small
            page (measured: benchmarks/README.md, "Measurements behind code choices").
    Raises:
        ConfigError (a ``ValueError``): an unknown key or bad value, naming ``l3.mooncake.<key>``;
            or the client cannot join the master within ``setup_timeout_s``.
        TypeError: ``namespace``/``page_bytes`` of the wrong type.
        ImportError: the Mooncake wheel is not installed.
    """

    default_read_threads = 4  # the client runs up to max_inflight (4) calls at once
    vectored_destinations = True  # a verified page is copied run by run from its staging buffer
    verified_checksums = True     # batch_get(checksums=) hands back the payload checksum each read was verified by

    def __init__(self, namespace: bytes, page_bytes: int, **cfg: Any):
        check_store_identity(namespace, page_bytes, error=TypeError)
        try:
            c = MooncakeStoreConfig.model_validate(cfg)
        except ValidationError as e:
            raise config_error(e, "l3.mooncake") from None
        if c.staging_bytes < HEADER_BYTES + page_bytes:
            raise ConfigError(f"bad value {c.staging_bytes!r} for 'l3.mooncake.staging_bytes': smaller than one "
                              f"record ({HEADER_BYTES + page_bytes} bytes)")
        self.cfg = c
        self.namespace = bytes(namespace)
        self.page_bytes = page_bytes
        self.record_bytes = HEADER_BYTES + page_bytes
        self.timeout_s = c.timeout_s
        self._prefix = f"{c.key_prefix}/{self.namespace.hex()}/"
        self._slots_per_staging = c.staging_bytes // self.record_bytes
        self._lock = threading.Lock()
        self._staging = _BufferPool(self._lock, c.max_inflight, self._register_staging, self._unregister,
                                    lambda: self._closed)
        self._headers = _BufferPool(self._lock, c.max_inflight, self._register_headers, self._unregister,
                                    lambda: self._closed)  # header arenas of the zero-copy set path
        self._host: dict[int, tuple[int, int, Any]] = {}  # registered host buffers: ptr -> (start, end, owner)
        self._inflight = 0
        self._closed = False
        self._warn = RateLimitedLog(log)
        self.counters = Counters("timeouts", "busy", "removed_corrupt", "set_retries", "zero_copy_sets", "staged_sets")

        if c.protocol == "tcp" and re.match(r"^[0-9.]+$", c.local_hostname):
            os.environ.setdefault("MC_TCP_BIND_ADDRESS", c.local_hostname)
        from mooncake.store import MooncakeDistributedStore, ReplicateConfig  # ImportError if not installed

        self._register = c.protocol != "tcp"
        self._rcfg = ReplicateConfig()
        self._rcfg.replica_num = c.replica_num
        _probe_endpoints(c)
        self._store = MooncakeDistributedStore()
        _UNCLOSED.append(self._store)  # until close() succeeds
        self._pool = cf.ThreadPoolExecutor(max_workers=c.max_inflight, thread_name_prefix="tierkv-mooncake")
        fut = self._pool.submit(self._store.setup, c.local_hostname, c.metadata_server, c.global_segment_size,
                                c.local_buffer_size, c.protocol, c.device_name, c.master_address)
        try:
            rc = fut.result(timeout=c.setup_timeout_s)
        except cf.TimeoutError:
            rc = None
        if rc != 0:
            self._pool.shutdown(wait=False)  # the native client stays in _UNCLOSED: setup may still be running
            what = "timed out" if rc is None else f"failed with code {rc}"
            raise ConfigError(f"mooncake store setup {what}: master 'l3.mooncake.master_address'="
                              f"{c.master_address!r}, metadata 'l3.mooncake.metadata_server'={c.metadata_server!r}")

    # ------------------------------------------------------------------ helpers

    def object_name(self, key: str) -> str:
        """The Mooncake object name of page ``key`` (validated) in this store's namespace."""
        check_key(key)
        return self._prefix + key

    @property
    def client(self):
        """The underlying ``MooncakeDistributedStore`` (for tests and tools; calls on it are not time-bounded)."""
        return self._store

    def _count(self, **inc: int) -> None:
        with self._lock:
            self.counters.add(**inc)

    def _call(self, what: str, fn: Callable[[], Any], hold: Optional[_Hold] = None,
              meanwhile: Optional[Callable[[], None]] = None) -> Any:
        """Run ``fn`` on a worker thread and wait at most ``timeout_s``. Returns its result, or ``None`` after a
        timeout, when ``max_inflight`` calls are outstanding, or if it raised (each counted and logged).
        ``hold`` (if given) loses the worker's share when ``fn`` has returned (also late, after a timeout), or
        at once if ``fn`` never starts. ``meanwhile`` (if given) runs on the calling thread once ``fn`` has been
        handed to the worker (not at all if it was not), before the wait; what it raises propagates."""
        with self._lock:
            if self._closed:
                raise ValueError("MooncakeStore is closed")
            busy = self._inflight >= self.cfg.max_inflight
            if busy:
                self.counters["busy"] += 1
            else:
                self._inflight += 1
        if busy:
            self._warn.warning("busy", "mooncake %s: %d calls still outstanding (master hung?); failing fast",
                               what, self.cfg.max_inflight)
            if hold:
                hold.drop()
            return None

        def done(_f: cf.Future) -> None:
            with self._lock:
                self._inflight -= 1
            if hold:
                hold.drop()

        try:
            fut = self._pool.submit(fn)
        except RuntimeError:  # pool shut down by a concurrent close()
            done(None)
            return None
        fut.add_done_callback(done)
        if meanwhile is not None:
            meanwhile()
        try:
            return fut.result(timeout=self.timeout_s)
        except cf.TimeoutError:
            self._count(timeouts=1)
            self._warn.warning("timeout", "mooncake %s: no answer within %.2fs from master %s; treated as a miss",
                               what, self.timeout_s, self.cfg.master_address)
        except Exception as e:  # noqa: BLE001 - a client error is a per-call failure, never a crash
            self._count(errors=1)
            self._warn.warning("error", "mooncake %s failed: %s: %s", what, type(e).__name__, e)
        return None

    def _check_keys(self, keys: Sequence[str]) -> list[str]:
        """Object names of ``keys``; ``ValueError`` (from :func:`check_key`) for any bad key, before any I/O."""
        self._keys(keys)
        return [self._prefix + k for k in keys]

    def _chunks(self, n: int):
        step = self._slots_per_staging
        for a in range(0, n, step):
            yield a, min(n, a + step)

    # ------------------------------------------------------------------ interface

    def batch_exists(self, keys: Sequence[str], tokens: Optional[Sequence[PageTokens]] = None) -> int:
        """Number of leading ``keys`` whose objects exist; 0 on timeout/error.

        Mooncake grants a read lease on every object an existence query finds, and leased objects are not evicted
       . Only the leading run can ever be read, so the keys are asked in chunks of
        1, 2, 4, ... and the query stops at the first absent key: objects after a hole are never leased by it. A full
        hit of n keys costs about log2(n) + 1 ``batch_is_exist`` RPCs; a call that times out or fails ends the query
        with 0 (each call is bounded by ``timeout_s``, and no later chunk is asked)."""
        names = self._check_keys(keys)
        n, size = 0, 1
        while n < len(names):
            chunk = names[n:n + size]
            res = self._call("batch_exists", lambda chunk=chunk: self._store.batch_is_exist(chunk))
            if res is None:  # a timeout or an error ends the query at once (one timeout_s at most): all misses
                return 0
            for r in res:
                if r != 1:
                    if r < 0:
                        self._count(errors=1)
                    return n
                n += 1
            size *= 2
        return n

    def batch_get(self, keys: Sequence[str], destinations: Sequence[Buffer],
                  tokens: Optional[Sequence[PageTokens]] = None, checksums: Optional[list] = None) -> list[bool]:
        """Fetch, verify and copy pages into ``destinations`` (writable, ``page_bytes`` each, or lists or tuples of
        writable runs adding up to it: :attr:`vectored_destinations`). A destination is written only for a verified
        hit. ``checksums``: a list of ``len(keys)`` filled with each hit's verified payload XXH3-64 and None for each
        miss (:attr:`verified_checksums`)."""
        names = self._check_keys(keys)
        dsts = [v if isinstance(v, list) else np.frombuffer(v, dtype=np.uint8)
                for v in self._dest_views(keys, destinations)]
        sums = self._checksums_out(checksums, len(keys))
        out = [False] * len(names)
        for a, b in self._chunks(len(names)):
            bad = self._get_chunk(keys, names, dsts, list(range(a, b)), out, sums, recheck=True)
            if bad:
                # A record that fails verification is fetched once more before it counts as corrupt (and is
                # removed): a concurrent overwrite by another client must not be mistaken for damage.
                bad = self._get_chunk(keys, names, dsts, bad, out, sums, recheck=False)
                self._count(corrupt=len(bad), misses=len(bad))
                if bad and self.cfg.remove_corrupt:
                    bad_names = [names[i] for i in bad]
                    rm = self._call("remove_corrupt", lambda: self._store.batch_remove(bad_names, True))
                    if rm is not None:
                        self._count(removed_corrupt=sum(1 for r in rm if r == 0))
        return out

    def _get_chunk(self, keys, names, dsts, idx: list[int], out: list[bool], sums: list,
                   recheck: bool) -> list[int]:
        """Fetch ``idx`` (at most one staging buffer's worth) and fill verified hits (and their checksums into
        ``sums``). Returns the indices whose records failed verification (not counted yet as misses or corrupt)."""
        rb, pb, n = self.record_bytes, self.page_bytes, len(idx)
        sh = self._staging_hold("batch_get", n, "misses")
        if sh is None:
            return []
        st, hold = sh
        sub, ptrs = [names[i] for i in idx], [st.ptr + j * rb for j in range(n)]
        bad: list[int] = []
        hits = misses = errors = 0
        try:
            res = self._call("batch_get", lambda: self._store.batch_get_into(sub, ptrs, [rb] * n), hold)
            if res is None:
                self._count(misses=n)
                return []
            for j, (i, r) in enumerate(zip(idx, res)):
                if r == rb:
                    rec = st.np[j * rb:(j + 1) * rb]
                    try:
                        sums[i] = copy_verified(memoryview(rec[:HEADER_BYTES]), rec[HEADER_BYTES:], dsts[i],
                                                keys[i], self.namespace, pb)
                    except PageFormatError as e:
                        bad.append(i)
                        if not recheck:
                            self._warn.warning("corrupt", "mooncake: page %s is not a valid record (%s); a miss",
                                               keys[i], e)
                        continue
                    out[i] = True
                    hits += 1
                elif r in _NOT_FOUND_CODES:
                    misses += 1
                elif r >= 0 or r == MC_BUFFER_TOO_SMALL:  # a record of another length: truncated or foreign
                    bad.append(i)
                    if not recheck:
                        self._warn.warning("corrupt", "mooncake: page %s has a record of the wrong length (%d); "
                                           "a miss", keys[i], r)
                else:
                    errors += 1
                    misses += 1
                    self._warn.warning("get_error", "mooncake batch_get: key %s failed with code %d", keys[i], r)
        finally:
            hold.drop()
        self._count(hits=hits, misses=misses, errors=errors, bytes_read=hits * pb)
        return bad

    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer],
                  checksums: Optional[Sequence[int]] = None,
                  tokens: Optional[Sequence[PageTokens]] = None) -> list[bool]:
        """Store pages (``page_bytes`` each) as header+payload records, replacing any existing record of a key
        (Mooncake upsert). ``True`` per key once Mooncake has accepted the whole record. ``checksums``: one XXH3-64
        per source (see :meth:`StorageBackend.batch_set`), written into the headers as given on both set paths (no
        payload is hashed); a wrong one makes that record fail verification on read (a miss; the object is
        removed with ``remove_corrupt``). Raises ValueError for bad keys, buffers or ``checksums``."""
        names = self._check_keys(keys)
        sums = check_checksums(checksums, len(names))
        srcs = self._views(keys, sources, False, "sources")
        out = [False] * len(names)
        for a, b in self._chunks(len(names)):
            direct, staged = [], []
            for i in range(a, b):
                p = self._registered_ptr(sources[i], srcs[i])
                (staged if p is None else direct).append((i, p))
            if direct:
                staged += [(i, None) for i in self._set_direct(keys, names, srcs, direct, out, sums)]
            if staged:
                self._set_chunk(keys, names, srcs, sorted(i for i, _ in staged), out, sums)
        return out

    def _set_chunk(self, keys, names, srcs, idx: list[int], out: list[bool], sums: Optional[list[int]] = None) -> None:
        """Staged upsert of the pages ``idx`` (at most one staging buffer's worth); ``sums``: the payload checksums
        of all the batch's sources (by index) when the caller gave them."""
        rb, n = self.record_bytes, len(idx)
        sh = self._staging_hold("batch_set", n, "set_failures")
        if sh is None:
            return
        st, hold = sh
        try:
            for j, i in enumerate(idx):
                rec = st.np[j * rb:(j + 1) * rb]
                rec[HEADER_BYTES:] = np.frombuffer(srcs[i], dtype=np.uint8)
                rec[:HEADER_BYTES] = np.frombuffer(
                    encode_header(keys[i], self.namespace, memoryview(rec[HEADER_BYTES:]),
                                  None if sums is None else sums[i]), dtype=np.uint8)
        except BaseException:
            hold.drop()
            hold.drop()
            raise
        sub, ptrs, rcfg = [names[i] for i in idx], [st.ptr + j * rb for j in range(n)], self._rcfg
        retried = [0]

        def upsert() -> list[int]:
            deadline = time.monotonic() + 0.8 * self.timeout_s
            res = list(self._store.batch_upsert_from(sub, ptrs, [rb] * n, rcfg))
            plain_retry_done, pause = False, 0.001
            while True:
                conflict = [j for j, r in enumerate(res) if r == MC_UPSERT_CONFLICT]
                other = [] if plain_retry_done else [j for j, r in enumerate(res) if r not in (0, MC_UPSERT_CONFLICT)]
                # Another client's upsert of the same key is in flight (-601): retry with backoff until it is done.
                # Any other failure gets one retry: a key left "processing" by a crashed writer whose segment is
                # gone fails its first upsert, the master then drops that entry and the retry claims it.
                again = conflict + other
                if not again or (not other and time.monotonic() + pause > deadline):
                    return res
                if other:
                    plain_retry_done = True
                if conflict:
                    time.sleep(pause)  # backoff before retrying a key another writer holds
                    pause = min(pause * 2, 0.05)
                retried[0] += len(again)
                rr = self._store.batch_upsert_from([sub[j] for j in again], [ptrs[j] for j in again],
                                                   [rb] * len(again), rcfg)
                for j, r in zip(again, rr):
                    res[j] = r

        try:
            res = self._call("batch_set", upsert, hold)
        finally:
            hold.drop()
        if res is not None:
            for i, r in zip(idx, res):
                out[i] = r == 0
            codes = sorted({r for r in res if r != 0})
            if codes:
                self._warn.warning("set_error", "mooncake batch_set: %d of %d pages failed (codes %s)",
                                   sum(1 for r in res if r != 0), n, codes)
        n_ok = sum(out[i] for i in idx)
        self._count(sets=n_ok, staged_sets=n_ok, set_failures=n - n_ok, bytes_written=n_ok * self.page_bytes,
                    set_retries=retried[0])

    def remove(self, keys: Sequence[str]) -> list[bool]:
        """Remove pages (forced: ignores Mooncake's read leases). ``True`` per key removed."""
        names = self._check_keys(keys)
        if not names:
            return []
        res = self._call("remove", lambda: self._store.batch_remove(names, True))
        return [False] * len(names) if res is None else [r == 0 for r in res]

    def clear(self) -> None:
        """Remove every page of this namespace (``remove_by_regex`` on the object-name prefix)."""
        pat = "^" + re.escape(self._prefix)
        self._call("clear", lambda: self._store.remove_by_regex(pat, True))

    def stats(self) -> dict[str, Any]:
        """Counters: ``hits``, ``misses`` (corrupt included), ``sets``, ``set_failures``, ``corrupt`` (records that
        failed verification), ``removed_corrupt``, ``errors`` (Mooncake error codes/exceptions), ``timeouts``,
        ``busy`` (calls refused while ``max_inflight`` were outstanding), ``set_retries``, ``zero_copy_sets`` /
        ``staged_sets`` (pages stored by each set path), ``evictions`` (always 0:
        Mooncake evicts on its own), ``bytes_read``/``bytes_written`` (payload bytes returned/stored), ``inflight``."""
        with self._lock:
            s = dict(self.counters)
            s["inflight"] = self._inflight
        s["backend"] = "mooncake"
        return s

    def close(self) -> None:
        """Unregister staging buffers and close the Mooncake client. Idempotent. If calls are still outstanding
        (a hung master) the client is left to the process exit instead of being closed under them. A store that is
        never closed also keeps its native client until the process exits (see ``_UNCLOSED``): call close()."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            free = self._staging.drain() + self._headers.drain()
            host, self._host = list(self._host), {}
            inflight = self._inflight
        for st in free:
            self._unregister(st)
        if self._register:
            for ptr in host:
                try:
                    self._store.unregister_buffer(ptr)
                except Exception:  # noqa: BLE001 - best effort
                    pass
        self._pool.shutdown(wait=False)
        if inflight == 0:
            try:
                self._store.close()
            except Exception as e:  # noqa: BLE001
                log.warning("mooncake close: %s", e)
            else:
                _UNCLOSED.remove(self._store)
        else:
            log.warning("mooncake close: %d calls still outstanding; client not closed (kept until process exit)",
                        inflight)

    def __repr__(self) -> str:
        return (f"MooncakeStore(master={self.cfg.master_address!r}, namespace={self.namespace.hex()}, "
                f"page_bytes={self.page_bytes})")
