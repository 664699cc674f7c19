"""Hash-indexed file L3 store: one record file per page, atomic writes, verified reads, LRU capacity.

:class:`FileStore` does the batch operations and the record I/O; the layout and offline tools are in
:mod:`.layout`, the options in :mod:`.config`, the LRU index and capacity in :mod:`.evictor`, the start-up scan in
:mod:`.scan`, single-record writes and quarantine in :mod:`.records`. Every read checks the record's header and payload
XXH3-64: a bad record is a miss (counted, quarantined), never data. The index is rebuilt from the directory at start
(mtime order; hit stamps are written to mtimes lazily), so LRU order survives restarts. Capacity is enforced by
eviction in ``eviction_policy`` order (default lru; default 90 % of what the filesystem offers at start); ``ENOSPC``
evicts a few records and retries once.

Thread-safe; several processes may share ``root`` (``write temp; [fsync]; rename``: a reader sees a whole old or
new record). Bad keys and buffer sizes raise ``ValueError``; an unwritable root raises ``ConfigError`` at
construction (unless ``read_only``); run-time I/O errors become misses / ``False``, counters and rate-limited
warnings in the ``tierkv.storage.file`` logger.
"""
from __future__ import annotations

import itertools
import logging
import os
import struct
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import xxhash
from pydantic import ValidationError

from tierkv.storage_backends.base import Buffer, EvictedKeys, PageTokens, StorageBackend
from tierkv.storage_backends.common import (  # noqa: F401 - parse_bytes, as_byte_view: also imported from here
    ConfigError,
    Counters,
    RateLimitedLog,
    as_byte_view,
    check_store_identity,
    config_error,
    parse_bytes,
)
from tierkv.storage_backends.file import records, scan
from tierkv.storage_backends.file.config import FileStoreConfig  # noqa: F401 - also imported from here
from tierkv.storage_backends.file.evictor import SPARE_MAX_BYTES, SPARE_MAX_FILES, Evictor, apply_touches
from tierkv.storage_backends.file.layout import (  # noqa: F401 - the offline tools are also imported from here
    NAMESPACE_INFO_FILE,
    PAGE_SUFFIX,
    QUARANTINE_DIR,
    TMP_PREFIX,
    PageFile,
    _bytes_after,
    _walk,
    _write_rest,
    describe_namespace,
    iter_page_files,
    mount_of,
    pid_alive,
    quarantine_file,
    read_record_file,
    unlink_records,
)
from tierkv.storage_backends.page_format import (
    HEADER_BYTES,
    MAGIC,
    VERSION,
    PageFormatError,
    check_checksums,
    decode_header,
    payload_checksum,
)

log = logging.getLogger("tierkv.storage.file")

# reads skip the access-time update (the store orders by mtime, never atime); dropped if the kernel refuses it
_RD_FLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)
_NO_JOURNAL_WARNED: set[str] = set()  # mount points of ext4 without a journal already named in this process


_FSYNC_POOL: Optional[ThreadPoolExecutor] = None
_FSYNC_POOL_PID = 0
_FSYNC_POOL_LOCK = threading.Lock()


def _fsync_pool() -> ThreadPoolExecutor:
    """Threads for the record writes and directory fsyncs of a batch with ``fsync: true`` (shared by every store;
    created on first use, so a store without fsync starts no thread)."""
    global _FSYNC_POOL, _FSYNC_POOL_PID
    with _FSYNC_POOL_LOCK:
        if _FSYNC_POOL is None or _FSYNC_POOL_PID != os.getpid():  # a forked child has none of the parent's threads
            _FSYNC_POOL = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tierkv-file-fsync")
            _FSYNC_POOL_PID = os.getpid()
        return _FSYNC_POOL


def _filesystem_of(root: str, read_only: bool) -> dict[str, Any]:
    """:func:`mount_of` ``root``, with a warning once per mount point (and process) when a writable store is on ext4
    without a journal."""
    fs = mount_of(root)
    if fs.get("journal") is False and not read_only and fs["mount"] not in _NO_JOURNAL_WARNED:
        _NO_JOURNAL_WARNED.add(fs["mount"])
        log.warning("file store %s: on ext4 without a journal (%s at %s): once many files on it have been deleted, "
                    "creating each record costs several times more CPU for up to minutes (the kernel skips "
                    "recently deleted inodes); a journaled filesystem or tmpfs does not have this",
                    root, fs["device"], fs["mount"])
    return fs


class FileStore(StorageBackend):
    """L3 page store on a local (or shared POSIX) directory.

    Args:
        namespace: 16-byte namespace digest (``ModelNamespace.digest()``), written into and checked against every
            record, and the name of this store's sub-directory.
        page_bytes: bytes of one page payload; every buffer passed in must have exactly this size.
        root, **cfg: the store directory (created if missing) and the other options, the keys of
            :class:`~tierkv.storage_backends.file.config.FileStoreConfig` (capacity, fsync, read-only, quarantine,
            start-up scan, recency stamps, temporary files, disk-full eviction, recycling).

    Raises:
        ConfigError: bad option values, or ``root`` cannot be created or written (and not ``read_only``).
        ValueError: ``namespace`` not 16 bytes, ``page_bytes`` not positive.
    """

    default_read_threads = 4  # independent files: reads of several threads overlap in the page cache and the disk
    local_exists = True       # one stat per key
    vectored_sources = True   # a page given as runs is written with one writev (header + runs), never joined
    vectored_destinations = True  # a page read into runs with one preadv (header + runs + a byte past the end)
    verified_checksums = True     # batch_get(checksums=) hands back the payload checksum each read was verified by
    reports_evictions = True      # take_evicted names the records this object evicted

    def __init__(self, namespace: bytes, page_bytes: int, root: Optional[str] = None, **cfg: Any):
        check_store_identity(namespace, page_bytes)
        try:
            self.cfg = FileStoreConfig(root=root, **cfg) if root is not None else FileStoreConfig(**cfg)
        except ValidationError as e:
            raise config_error(e, "l3.file", FileStoreConfig) from None
        self.namespace = bytes(namespace)
        self.page_bytes = page_bytes
        self.record_bytes = HEADER_BYTES + page_bytes
        self.root = self.cfg.root
        self.ns_dir = os.path.join(self.root, self.namespace.hex())
        self.quarantine_dir = os.path.join(self.root, QUARANTINE_DIR)
        self._lock = threading.Lock()
        self._made_dirs: set[str] = set()
        self._tmp_seq = itertools.count()
        self._closed = False
        self._rd_flags = _RD_FLAGS
        self._fsync = self.cfg.fsync
        # page_format header pieces (see page_format.py): bytes 0..24 and 40..48 are the same for every record
        self._hdr_fixed = struct.pack("<4sHH16s", MAGIC, VERSION, 0, self.namespace)
        self._hdr_magic_ver = self._hdr_fixed[:6]
        self._hdr_ns = self.namespace
        self._hdr_len = struct.pack("<Q", page_bytes)
        self._warn = RateLimitedLog(log)
        self._touch = self.cfg.touch_on_read and not self.cfg.read_only
        self.counters = Counters("forced_evictions", "enospc", "quarantined", "deleted_bad", "temp_removed",
                                 "scan_files", "scan_seconds", "recycled")
        spare_max = (min(SPARE_MAX_FILES, max(1, SPARE_MAX_BYTES // self.record_bytes))
                     if self.cfg.recycle_evicted and not self.cfg.fsync and not self.cfg.read_only else 0)
        self._ev = Evictor(self._lock, self.root, self.record_bytes, spare_max, self.counters, self._warn,
                           self._tmp_seq, self.cfg.eviction_policy, self.cfg.slru_protected_fraction,
                           self.cfg.s3fifo_small_fraction)
        weakref.finalize(self, apply_touches, self._ev.touches)  # a store dropped without close() still persists them
        if self.cfg.capacity_bytes is not None and self.cfg.capacity_bytes < self.record_bytes:
            raise ConfigError(f"bad value {self.cfg.capacity_bytes!r} for 'l3.file.capacity_bytes': smaller than one "
                              f"record ({self.record_bytes} bytes = 64-byte header + page_bytes)")
        scan.check_root(self)
        self.filesystem = _filesystem_of(self.root, self.cfg.read_only)
        self._quarantine_count = scan.count_quarantine(self.quarantine_dir)
        self._scan_done = threading.Event()
        if self.cfg.background_scan:
            self.capacity_bytes = self.cfg.capacity_bytes or scan.default_capacity(self)
            threading.Thread(target=scan.startup_scan, args=(self,), name="tkv-file-scan", daemon=True).start()
        else:
            scan.startup_scan(self)

    # the evictor's state under the names the store had for it
    @property
    def capacity_bytes(self) -> int:
        """Bytes of record files this process keeps under ``root`` (LRU eviction beyond it)."""
        return self._ev.capacity_bytes

    @capacity_bytes.setter
    def capacity_bytes(self, value: int) -> None:
        self._ev.capacity_bytes = value

    @property
    def _index(self) -> dict[str, int]:
        return self._ev.index

    @property
    def _usage(self) -> int:
        return self._ev.usage

    @property
    def _touches(self) -> dict[str, int]:
        return self._ev.touches

    def _evict_locked(self, need: int = 0, count: Optional[int] = None, keep: str = "", free: bool = False) -> int:
        """:meth:`Evictor.evict_locked` (the caller holds ``_lock``)."""
        return self._ev.evict_locked(need, count, keep, free)

    def take_evicted(self) -> EvictedKeys:
        """The keys of the records this object evicted since the last call (:meth:`Evictor.take_evicted`). Records
        other processes sharing ``root`` evicted are not named: a read finds them missing."""
        return self._ev.take_evicted()

    def wait_scan(self, timeout_s: Optional[float] = None) -> bool:
        """True once the start-up scan has finished (at once without ``background_scan``)."""
        return self._scan_done.wait(timeout_s)

    # ------------------------------------------------------------------ set-up
    def rescan(self) -> dict[str, Any]:
        """Rebuild the index and usage from the directory (done at construction).

        Walks ``root/<ns>/<xx>/``: page files become index entries in mtime order (oldest = least recently used);
        records of this namespace with the wrong size (or, with ``scan_verify: header``, a bad header) are
        quarantined; temporary files of dead writers or older than ``stale_temp_s`` are removed; other names are
        left alone. Returns ``{"files", "seconds", "quarantined", "temp_removed"}``.
        """
        return scan.rescan(self)

    def _path(self, key: str) -> str:
        return f"{self.ns_dir}/{key[:2]}/{key}{PAGE_SUFFIX}"

    def _discard_bad(self, path: str, reason: str, ino: Optional[int] = None) -> None:
        """Quarantine (or delete) a record that failed verification; never raises."""
        records.discard_bad(self, path, reason, ino)

    # ------------------------------------------------------------------ interface
    def batch_exists(self, keys: Sequence[str], tokens: Optional[Sequence[PageTokens]] = None) -> int:
        """Number of leading ``keys`` whose record file is present with the right size.

        Looks at the directory (one ``stat`` per key), so pages written by other processes count. A record whose
        payload was corrupted in place is only found out by :meth:`batch_get`. Raises ValueError for a bad key."""
        self._keys(keys)
        if self._closed:
            return 0
        n = 0
        for k in keys:
            p = self._path(k)
            try:
                st = os.stat(p)
            except OSError:
                self._ev.forget(p)
                break
            if st.st_size != self.record_bytes:
                break
            if p not in self._index:
                self._ev.adopt(p, st.st_size)
            n += 1
        return n

    def batch_get(self, keys: Sequence[str], destinations: Sequence[Buffer],
                  tokens: Optional[Sequence[PageTokens]] = None,
                  checksums: Optional[list] = None) -> list[bool]:
        """Read pages into ``destinations`` (each a writable contiguous CPU buffer of ``page_bytes`` bytes, e.g. a
        ``torch.uint8`` host-pool page, or a list or tuple of writable runs adding up to it:
        :attr:`vectored_destinations`), directly with ``preadv`` (no intermediate copy).

        Every hit has had its header (magic, version, namespace, key, length, header XXH3-64) and its payload
        XXH3-64 checked. Returns one bool per key. ``False``: missing (destination untouched), or
        corrupt/foreign/truncated (counted in ``corrupt``, quarantined; the destination may hold garbage).
        ``checksums``: a list of ``len(keys)`` filled with each hit's payload XXH3-64 (the value its bytes were just
        verified against) and None for each miss (:attr:`verified_checksums`). Raises ValueError for a bad key, a
        length mismatch between ``keys`` and ``destinations`` (or ``checksums``) or a buffer or run of the wrong
        size."""
        kraws = self._keys(keys)
        pb = self.page_bytes
        views = self._dest_views(keys, destinations)
        sums = self._checksums_out(checksums, len(keys))
        if self._closed:
            return [False] * len(keys)
        out = [False] * len(keys)
        hdr, tail = bytearray(HEADER_BYTES), bytearray(1)
        hview = memoryview(hdr)
        rec = self.record_bytes
        magic_ver, ns_part, len_part = self._hdr_magic_ver, self._hdr_ns, self._hdr_len
        digest = xxhash.xxh3_64_intdigest
        from_le = int.from_bytes
        rd_flags = self._rd_flags
        os_open, os_preadv, os_close = os.open, os.preadv, os.close
        hit_paths: list[str] = []
        misses = corrupt = errors = 0
        for i, k in enumerate(keys):
            mv = views[i]
            p = self._path(k)
            try:
                try:
                    fd = os_open(p, rd_flags)
                except PermissionError:
                    if rd_flags == os.O_RDONLY:
                        raise
                    # O_NOATIME on a file of another user is refused: stop asking for it
                    rd_flags = self._rd_flags = os.O_RDONLY
                    fd = os_open(p, rd_flags)
            except FileNotFoundError:
                self._ev.forget(p)
                misses += 1
                continue
            except OSError as e:
                errors += 1
                misses += 1
                self._warn.warning("read", "file store %s: cannot open %s: %s", self.root, p, e)
                continue
            bad = None
            ino = None
            try:
                # one syscall for header, payload (whole or its runs) and one byte past the end (an extended file
                # shows up)
                got = os_preadv(fd, [hdr, *mv, tail] if isinstance(mv, list) else [hdr, mv, tail], 0)
                if got != rec:
                    got = records.read_rest(fd, hdr, mv, got, rec)
                if got != rec:
                    bad = f"record of {got} bytes, expected {rec}"
                else:
                    # fast path: the expected header bytes and the header checksum; anything else goes through
                    # page_format.decode_header for the exact reason
                    if (hdr[0:6] == magic_ver and hdr[8:24] == ns_part and hdr[24:40] == kraws[i]
                            and hdr[40:48] == len_part and digest(hview[:56]) == from_le(hdr[56:64], "little")):
                        psum = from_le(hdr[48:56], "little")
                    else:
                        psum = decode_header(hdr, k, self.namespace, pb)
                    if (payload_checksum(mv) if isinstance(mv, list) else digest(mv)) != psum:
                        bad = "payload checksum mismatch"
                    else:
                        sums[i] = psum
            except PageFormatError as e:
                bad = str(e)
            except OSError as e:
                errors += 1
                misses += 1
                self._warn.warning("read", "file store %s: cannot read %s: %s", self.root, p, e)
                os_close(fd)
                continue
            if bad is not None:
                try:
                    ino = os.fstat(fd).st_ino
                except OSError:
                    pass
            os_close(fd)
            if bad is not None:
                corrupt += 1
                misses += 1
                self._discard_bad(p, bad, ino=ino)
                continue
            out[i] = True
            hit_paths.append(p)
        with self._lock:
            flush = self._ev.note_hits_locked(hit_paths, self._touch, self.cfg.touch_flush_s)
            c = self.counters
            c["hits"] += len(hit_paths)
            c["misses"] += misses
            c["corrupt"] += corrupt
            c["errors"] += errors
            c["bytes_read"] += len(hit_paths) * pb
        if flush:
            self.flush_touches()
        return out

    def flush_touches(self) -> int:
        """Write the pending hit stamps (see ``touch_on_read``) to the records' mtimes, oldest first. Returns the
        number of records stamped. Called by :meth:`batch_get`, :meth:`rescan` and :meth:`close`; never raises."""
        return self._ev.flush_touches()

    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer],
                  checksums: Optional[Sequence[int]] = None,
                  tokens: Optional[Sequence[PageTokens]] = None) -> list[bool]:
        """Store pages from ``sources`` (each a contiguous CPU buffer of ``page_bytes`` bytes, or a list or tuple of
        contiguous runs adding up to it: :attr:`vectored_sources`).

        Each record is written to a temporary file in its final directory, optionally fsynced, and renamed over the
        key's path (an existing record of the key is replaced). Capacity is made by evicting records in
        ``eviction_policy`` order (lru: least recently used first); on ``ENOSPC`` ``enospc_evict_pages`` more are evicted and the write retried once. Returns one
        bool per key; ``False`` leaves no file behind. ``checksums``: one XXH3-64 per source (see
        :meth:`StorageBackend.batch_set`), written into the headers instead of hashing the payloads; a wrong one
        makes that record fail verification on read (a miss; the record is quarantined). Raises ValueError for a bad
        key, a length mismatch, a buffer of the wrong size or bad ``checksums``."""
        kraws = self._keys(keys)
        sums = check_checksums(checksums, len(keys))
        views = self._source_views(keys, sources)
        if self._closed or self.cfg.read_only:
            with self._lock:
                self.counters["set_failures"] += len(keys)
            return [False] * len(keys)
        out = [False] * len(keys)
        dirs: set[str] = set()
        lock, ev = self._lock, self._ev
        plan = []
        for i, k in enumerate(keys):  # reserve space in key order (the batch's LRU order), then write
            p = self._path(k)
            with lock:
                stamp = self._ev.reserve_locked(p)  # (rescan may have replaced the index)
            plan.append((i, k, p, stamp))

        def write(item: tuple) -> Optional[bool]:
            i, k, p, stamp = item
            try:
                return records.write_or_evict(self, k, kraws[i], p, views[i], stamp, None if sums is None else sums[i])
            finally:
                ev.release(p)

        if self._fsync and len(plan) > 1 and len({x[2] for x in plan}) == len(plan):  # (a repeated key: in order)
            # each record still goes temp -> fsync -> rename, but the records of a batch are written by a few
            # threads, so their fsyncs wait on the device together (the filesystem commits them as a group)
            results = list(_fsync_pool().map(write, plan))
        else:
            results = [write(x) for x in plan]
        for (i, k, p, _), ok in zip(plan, results):
            if ok:
                out[i] = True
                if self._fsync:
                    dirs.add(p[: -len(k) - len(PAGE_SUFFIX) - 1])
            else:
                self._ev.forget(p)
        if len(dirs) > 1:  # concurrently: the waits for the device overlap (one journal commit serves them all)
            list(_fsync_pool().map(self._fsync_dir, dirs))
        elif dirs:
            self._fsync_dir(dirs.pop())
        n_ok = sum(out)
        with lock:
            c = self.counters
            c["sets"] += n_ok
            c["set_failures"] += len(keys) - n_ok
            c["bytes_written"] += n_ok * self.page_bytes
            flush = ev.touches_due_locked()
        if flush:
            self.flush_touches()
        return out

    def _fsync_dir(self, d: str) -> None:
        """fsync directory ``d`` (makes the renames in it durable); a failure is logged, never raised."""
        try:
            dfd = os.open(d, os.O_RDONLY)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)
        except OSError as e:
            self._warn.warning("fsync", "file store %s: cannot fsync directory %s: %s", self.root, d, e)

    def batch_delete(self, keys: Sequence[str]) -> int:
        """Remove the records of ``keys`` (absent ones are ignored). Returns how many files were removed.
        Raises ValueError for a bad key."""
        self._keys(keys)
        if self.cfg.read_only:
            return 0
        n = 0
        for k in keys:
            p = self._path(k)
            with self._lock:
                self._ev.drop_locked(p)
                try:
                    os.unlink(p)
                    n += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    self._warn.warning("delete", "file store %s: cannot delete %s: %s", self.root, p, e)
        return n

    def clear(self) -> None:
        """Delete every record of this namespace (records of other namespaces under ``root`` are kept)."""
        if self.cfg.read_only:
            return
        with self._lock:
            mine = self._ev.drop_under_locked(self.ns_dir + os.sep)
        for p in mine:
            try:
                os.unlink(p)
            except OSError:
                pass
        unlink_records(self.ns_dir)  # records written by other processes that this one never saw

    def usage(self) -> dict[str, int]:
        """``{"bytes", "pages", "capacity_bytes"}`` as this process sees them (``pages`` = indexed files)."""
        with self._lock:
            return {"bytes": self._usage, "pages": len(self._index), "capacity_bytes": self.capacity_bytes}

    def describe_namespace(self, info: dict[str, Any]) -> bool:
        """Write ``<root>/<namespace hex>/namespace.json`` (see :func:`describe_namespace`)."""
        return describe_namespace(self.root, self.namespace, info)

    def stats(self) -> dict[str, Any]:
        """Counters since construction: ``hits``, ``misses``, ``sets``, ``set_failures``, ``corrupt`` (records that
        failed verification), ``errors`` (I/O errors), ``evictions`` (of which ``forced_evictions`` on ENOSPC),
        ``enospc``, ``quarantined``, ``deleted_bad``, ``temp_removed``, ``bytes_read``, ``bytes_written`` (payload
        bytes), plus ``usage_bytes``, ``usage_pages``, ``capacity_bytes``, ``scan_files``, ``scan_seconds``."""
        with self._lock:
            d = dict(self.counters)
            d.update(usage_bytes=self._usage, usage_pages=len(self._index), capacity_bytes=self.capacity_bytes,
                     backend="file", root=self.root)
        return d

    def close(self) -> None:
        """Write pending hit stamps (see ``touch_on_read``), remove the spare files kept for reuse
        (``recycle_evicted``) and mark the store closed (later calls miss). Holds no open files between calls.
        Idempotent."""
        self._closed = True
        self.flush_touches()
        self._ev.drop_spares()

    def __repr__(self) -> str:
        return (f"FileStore(root={self.root!r}, namespace={self.namespace.hex()[:8]}.., page_bytes={self.page_bytes}, "
                f"capacity_bytes={getattr(self, 'capacity_bytes', None)})")
