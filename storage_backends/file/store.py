"""Hash-indexed file L3 store: one file per page, atomic writes, verified reads, LRU capacity (docs/architecture.md §5).

Layout under ``root`` (one directory may be shared by several processes and several namespaces)::

    root/<namespace hex, 32 chars>/<key[0:2]>/<key>.page      one page record: 64-byte header || payload
    root/<namespace hex>/<key[0:2]>/.tmp.<key>.<pid>.<tid>.<n>  a write in progress (renamed when complete)
    root/quarantine/                                          records that failed verification (bounded)

The record format is :mod:`tierkv.storage_backends.page_format` (magic, version, namespace, key, length,
XXH3-64 of header and payload). The namespace digest is in the path as well as in the header, so two engines
with different model identities (docs/architecture.md §8 R01, R02) never even open each other's files; keys are
validated hex (:func:`~tierkv.storage_backends.page_format.check_key`), so no key can name a path outside
``root``.

Where it comes from and what it does differently:

- SGLang HiCache's ``HiCacheFile`` writes one raw ``.bin`` per page to a temporary name and renames it, and seeds an
  optional LRU evictor from file mtimes. It stores no header or checksum: a truncated page is reported present and
  then raises, a page corrupted in place is served as a hit. Here every read checks header and payload checksum and a
  bad record is a miss (counted, quarantined), never data.
- LMCache's local disk backend lost its index on restart (docs/architecture.md §8 R17). Here the index (path -> size, in LRU
  order) is rebuilt from the directory at start: page files sorted by mtime (a write sets its record's mtime to an
  exact stamp; a hit is stamped in memory at read time and written to the file's mtime lazily, one ``utime`` per page
  per ``touch_flush_s`` and at close/rescan/exit, so recency survives restarts without a syscall per hit), files of
  the wrong size quarantined, temporary files of dead writers removed. One ``stat`` per file (tested in ``tests/storage/test_file_restart.py``).
- Mooncake's offload tier and DingoCache filled their disk (R20). Here the capacity (bytes of page files, headers
  included) is enforced by LRU eviction out of the box (default: 90 % of what the filesystem can give us at start),
  and ``ENOSPC``/``EDQUOT`` on a write evicts ``enospc_evict_pages`` records and retries once; a failed write leaves
  no file behind.

Concurrency: the object is thread-safe (SGLang calls a store from a read and a write thread at once). Several
processes may share ``root``: writes are ``write temp; [fsync]; rename``, so a reader sees the old or the new complete
record, never a torn one; two writers of one key both write complete records and the last rename wins. Each process
enforces ``capacity_bytes`` on what it has seen (its start-up scan, its own writes, pages it found on disk);
:meth:`FileStore.rescan` refreshes that view.

Errors: bad keys and wrong buffer sizes raise ``ValueError`` (caller bugs). A root that cannot be created or written
raises :class:`tierkv.storage_backends.common.ConfigError` at construction (unless ``read_only``), so a misconfigured
deployment fails at start-up rather than silently caching nothing. Everything at run time (``EIO``, ``EROFS``, disk
full, files vanishing under another process) becomes a miss / ``False``, a counter in :meth:`FileStore.stats` and a
rate-limited warning in the ``tierkv.storage.file`` logger.
"""
from __future__ import annotations

import math
import errno
import itertools
import logging
import os
import struct
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import xxhash
from pydantic import ValidationError

from tierkv.storage_backends.base import Buffer, PageTokens, StorageBackend
from tierkv.storage_backends.common import (  # noqa: F401 - parse_bytes, as_byte_view: also imported from here
    ConfigError,
    Counters,
    RateLimitedLog,
    as_byte_view,
    check_store_identity,
    config_error,
    parse_bytes,
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
)

log = logging.getLogger("tierkv.storage.file")

_WR_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_RECYCLE_FLAGS = os.O_WRONLY | os.O_CLOEXEC
#: evicted record files kept for reuse (``recycle_evicted``), at most this many bytes and this many files per store
SPARE_MAX_BYTES = 64 << 20
SPARE_MAX_FILES = 64
# reads skip the access-time update (the store orders by mtime, never atime); dropped if the kernel refuses it
_RD_FLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOATIME", 0)
_TOUCH_MAX_PENDING = 4096  # pending hit stamps that force a flush (bounds memory and what a crash can lose)
_NO_JOURNAL_WARNED: set[str] = set()  # mount points of ext4 without a journal already named in this process


from tierkv.storage_backends.file.config import FileStoreConfig  # noqa: E402,F401 - also imported from here


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


def _apply_touches(touches: dict) -> None:
    """Write pending hit stamps (path -> ns) as mtimes; for a store collected or left open at interpreter exit."""
    while touches:
        try:
            p, t = touches.popitem()
            os.utime(p, ns=(t, t))
        except (OSError, KeyError):
            pass


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
        self._index: "OrderedDict[str, int]" = OrderedDict()  # path -> file bytes, least recently used first
        self._usage = 0
        self._made_dirs: set[str] = set()
        self._writing: dict[str, int] = {}  # paths with a write in flight in this process -> writers
        self._tmp_seq = itertools.count()
        self._closed = False
        self._last_stamp = 0
        self._touches: dict[str, int] = {}  # path -> hit stamp (ns) not yet written to the file, oldest first
        self._touch_due = -math.inf  # time.monotonic() by which pending stamps are written
        weakref.finalize(self, _apply_touches, self._touches)  # a store dropped without close() still persists them
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
        # evicted record files renamed out of the key space, to be overwritten by the next writes (recycle_evicted)
        self._spares: list[str] = []
        self._spare_max = (min(SPARE_MAX_FILES, max(1, SPARE_MAX_BYTES // self.record_bytes))
                           if self.cfg.recycle_evicted and not self.cfg.fsync and not self.cfg.read_only else 0)
        if self.cfg.capacity_bytes is not None and self.cfg.capacity_bytes < self.record_bytes:
            raise ConfigError(f"bad value {self.cfg.capacity_bytes!r} for 'l3.file.capacity_bytes': smaller than one "
                              f"record ({self.record_bytes} bytes = 64-byte header + page_bytes)")
        self._check_root()
        self.filesystem = mount_of(self.root)
        if (self.filesystem.get("journal") is False and not self.cfg.read_only
                and self.filesystem["mount"] not in _NO_JOURNAL_WARNED):
            _NO_JOURNAL_WARNED.add(self.filesystem["mount"])
            log.warning("file store %s: on ext4 without a journal (%s at %s): once many files on it have been deleted, "
                        "creating each record costs several times more CPU for up to minutes (the kernel skips "
                        "recently deleted inodes); a journaled filesystem or tmpfs does not have this",
                        self.root, self.filesystem["device"], self.filesystem["mount"])
        self._quarantine_count = self._count_quarantine()
        self._scan_done = threading.Event()
        if self.cfg.background_scan:
            self.capacity_bytes = self.cfg.capacity_bytes or self._default_capacity()
            threading.Thread(target=self._startup_scan, name="tkv-file-scan", daemon=True).start()
        else:
            self._startup_scan()

    def _startup_scan(self) -> None:
        try:
            self.rescan()
            if self.cfg.capacity_bytes is not None:
                self.capacity_bytes = self.cfg.capacity_bytes
            else:
                self.capacity_bytes = self._default_capacity()
            if not self.cfg.read_only:
                with self._lock:
                    self._evict_locked(0)
        finally:
            self._scan_done.set()

    def wait_scan(self, timeout_s: Optional[float] = None) -> bool:
        """True once the start-up scan has finished (at once without ``background_scan``)."""
        return self._scan_done.wait(timeout_s)

    # ------------------------------------------------------------------ set-up
    def _check_root(self) -> None:
        root = self.root
        if self.cfg.read_only:
            if not os.path.isdir(root):
                raise ConfigError(f"bad value {root!r} for 'l3.file.root': not a directory (read_only store)")
            return
        try:
            os.makedirs(root, exist_ok=True)
            if not os.path.isdir(root):
                raise NotADirectoryError(errno.ENOTDIR, "not a directory", root)
            probe = os.path.join(root, f"{TMP_PREFIX}probe.{os.getpid()}.{threading.get_ident()}")
            fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            os.close(fd)
            os.unlink(probe)
            os.makedirs(self.ns_dir, exist_ok=True)
        except OSError as e:
            raise ConfigError(f"bad value {root!r} for 'l3.file.root': cannot create or write the store directory "
                              f"({type(e).__name__}: {e.strerror or e}); give a writable directory or set "
                              f"l3.file.read_only: true") from None

    def _default_capacity(self) -> int:
        try:
            st = os.statvfs(self.root)
            avail = st.f_bavail * st.f_frsize
        except OSError:
            avail = 0
        cap = int((avail + self._usage) * self.cfg.default_capacity_fraction)
        return max(cap, self.record_bytes)

    def _count_quarantine(self) -> int:
        try:
            with os.scandir(self.quarantine_dir) as it:
                return sum(1 for _ in it)
        except OSError:
            return 0

    def rescan(self) -> dict[str, Any]:
        """Rebuild the index and usage from the directory (done at construction).

        Walks ``root/<ns>/<xx>/``: page files become index entries in mtime order (oldest = least recently used);
        records of this namespace with the wrong size (or, with ``scan_verify: header``, a bad header) are
        quarantined; temporary files of dead writers or older than ``stale_temp_s`` are removed; other names are
        left alone. Returns ``{"files", "seconds", "quarantined", "temp_removed"}``.
        """
        t0 = time.perf_counter()
        self.flush_touches()  # the scan orders by mtime: hits not yet stamped would lose their place
        entries: list[tuple[float, str, int]] = []
        n_q = n_tmp = 0
        now = time.time()
        rw = not self.cfg.read_only
        mypid = os.getpid()
        try:
            walk = _walk(self.root, temps=rw)
        except OSError as e:
            self._warn.warning("scan", "file store %s: cannot scan: %s", self.root, e)
            walk = iter(())
        own_ns = self.namespace.hex()
        for ns_hex, fname, path, st in walk:
            if not fname.startswith(TMP_PREFIX):
                if ns_hex == own_ns and rw:
                    bad = None
                    if st.st_size != self.record_bytes:
                        bad = f"size {st.st_size} != {self.record_bytes}"
                    elif self.cfg.scan_verify == "header":
                        bad = self._header_problem(path, fname[:32])
                    if bad is not None:
                        self._discard_bad(path, bad, ino=st.st_ino)
                        n_q += 1
                        continue
                entries.append((st.st_mtime, path, st.st_size))
                continue
            parts = fname.split(".")
            try:
                pid = int(parts[3])
            except (IndexError, ValueError):
                pid = -1
            dead = pid != mypid and (pid <= 0 or not pid_alive(pid))
            if dead or now - st.st_mtime > self.cfg.stale_temp_s:
                try:
                    os.unlink(path)
                    n_tmp += 1
                except OSError:
                    pass
        entries.sort()
        with self._lock:
            index = OrderedDict((p, s) for _, p, s in entries)
            for p, size in self._index.items():  # written or found while the walk ran (a background scan)
                if p not in index and os.path.exists(p):
                    index[p] = size
            for p in self._writing:  # keep the reservations of writes in flight
                index[p] = self.record_bytes
            self._index = index
            self._usage = sum(index.values())
            self.counters["temp_removed"] += n_tmp
            self.counters["scan_files"] = len(entries)
            dt = time.perf_counter() - t0
            self.counters["scan_seconds"] = dt
        if n_q or n_tmp:
            log.info("file store %s: scan found %d pages, quarantined %d bad records, removed %d temp files (%.3f s)",
                     self.root, len(entries), n_q, n_tmp, dt)
        return {"files": len(entries), "seconds": dt, "quarantined": n_q, "temp_removed": n_tmp}

    def _header_problem(self, path: str, key: str) -> Optional[str]:
        try:
            with open(path, "rb", buffering=0) as f:
                head = f.read(HEADER_BYTES)
            decode_header(head, key, self.namespace, self.page_bytes)
        except PageFormatError as e:
            return str(e)
        except OSError:
            return None
        return None

    # ------------------------------------------------------------------ helpers
    def _path(self, key: str) -> str:
        return f"{self.ns_dir}/{key[:2]}/{key}{PAGE_SUFFIX}"

    def _discard_bad(self, path: str, reason: str, ino: Optional[int] = None) -> None:
        """Quarantine (or delete) a record that failed verification; never raises."""
        if self.cfg.read_only:
            return
        with self._lock:
            size = self._index.pop(path, None)
            if size is not None:
                self._usage -= size
            self._touches.pop(path, None)
        try:
            if ino is not None and os.stat(path).st_ino != ino:
                return  # replaced by a fresh record meanwhile: leave that one alone
            if self.cfg.quarantine and self._quarantine_count < self.cfg.quarantine_max_files:
                os.makedirs(self.quarantine_dir, exist_ok=True)
                dst = os.path.join(self.quarantine_dir, f"{os.path.basename(os.path.dirname(os.path.dirname(path)))}-"
                                   f"{os.path.basename(path)}.{os.getpid()}.{time.time_ns()}.bad")
                os.rename(path, dst)
                self._quarantine_count += 1
                self.counters["quarantined"] += 1
            else:
                os.unlink(path)
                self.counters["deleted_bad"] += 1
        except FileNotFoundError:
            pass
        except OSError as e:
            self._warn.warning("quarantine", "file store %s: cannot quarantine %s: %s", self.root, path, e)
        self._warn.warning("corrupt", "file store %s: bad page record %s (%s): treated as a miss", self.root, path,
                           reason)

    def _forget(self, path: str) -> None:
        """Drop an index entry whose file is gone (checked under the lock: a write may have finished since the
        caller looked)."""
        with self._lock:
            if path in self._writing or path not in self._index or os.path.exists(path):
                return
            size = self._index.pop(path, None)
            if size is not None:
                self._usage -= size

    def _evict_locked(self, need: int = 0, count: Optional[int] = None, keep: str = "", free: bool = False) -> int:
        """Evict least recently used records (pop and remove, holding the lock so no reader re-indexes a file being
        removed) until ``usage + need <= capacity`` or, with ``count``, exactly ``count`` records. Records being
        written and ``keep`` are skipped. A removed record is unlinked, or with ``recycle_evicted`` (and not
        ``free``, which must give space back) renamed to a spare temporary file that a later write overwrites
        (:meth:`_spare_locked`). Returns the number evicted."""
        skipped, n = [], 0
        while self._index and (self._usage + need > self.capacity_bytes if count is None else n < count):
            p, size = self._index.popitem(last=False)
            if p in self._writing or p == keep:
                skipped.append((p, size))
                continue
            self._usage -= size
            self._touches.pop(p, None)
            n += 1
            try:
                if free or size != self.record_bytes or not self._spare_locked(p):
                    os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError as e:
                self._warn.warning("evict", "file store %s: cannot evict %s: %s", self.root, p, e)
        for p, size in reversed(skipped):  # back to the least recently used end, in their order
            self._index[p] = size
            self._index.move_to_end(p, last=False)
        self.counters["evictions"] += n
        return n

    def _spare_locked(self, path: str) -> bool:
        """Rename the evicted record ``path`` to a spare temporary file in its directory, if fewer than the spare
        limit are kept (``SPARE_MAX_FILES`` files, ``SPARE_MAX_BYTES`` bytes). True if it became a spare.

        A write that takes a spare overwrites it in place and renames it to its own key's path, so at capacity a
        write neither allocates an inode and blocks nor frees them (ext4: inode allocation scans past recently
        deleted inodes; unlink frees the extents; benchmarks/README.md, file_at_capacity). The spare has a
        temporary name: no lookup finds it, and the start-up scan removes it once its process is gone. A reader
        that opened the record before it was evicted may then read a mix of two pages: its checksums make that a
        miss. Raises OSError from the rename (FileNotFoundError: another process removed the record)."""
        if len(self._spares) >= self._spare_max:
            return False
        spare = (f"{os.path.dirname(path)}/{TMP_PREFIX}spare.{os.getpid()}.{threading.get_ident()}."
                 f"{next(self._tmp_seq)}")
        os.rename(path, spare)
        self._spares.append(spare)
        return True

    def _drop_spares(self) -> int:
        """Unlink every spare file (on close and when the filesystem is full). Returns how many were removed."""
        with self._lock:
            spares, self._spares = self._spares, []
        n = 0
        for sp in spares:
            try:
                os.unlink(sp)
                n += 1
            except OSError:
                pass
        return n

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
                self._forget(p)
                break
            if st.st_size != self.record_bytes:
                break
            if p not in self._index:
                self._adopt(p, st.st_size)
            n += 1
        return n

    def _adopt(self, path: str, size: int) -> None:
        """Index a record another process wrote (most recently used end)."""
        with self._lock:
            if path not in self._index and os.path.exists(path):
                self._index[path] = size
                self._usage += size

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
                self._forget(p)
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
                    got = self._read_slow(fd, hdr, mv, got)
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
        flush = False
        with self._lock:
            idx = self._index
            touch = self._touch
            if touch and hit_paths:
                touches = self._touches
                if not touches:
                    self._touch_due = time.monotonic() + self.cfg.touch_flush_s
                t = max(time.time_ns(), self._last_stamp + 1)
            for p in hit_paths:
                if p in idx:
                    idx.move_to_end(p)
                elif os.path.exists(p):  # written by another process (or evicted while we read it: not re-added)
                    idx[p] = rec
                    self._usage += rec
                else:
                    continue
                if touch:
                    touches.pop(p, None)  # re-insert: the dict stays in stamp order
                    touches[p] = t
                    t += 1
            if touch and hit_paths:
                self._last_stamp = t
                flush = len(touches) >= _TOUCH_MAX_PENDING or time.monotonic() >= self._touch_due
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
        n = 0
        while True:
            with self._lock:  # held around the utimes, so a write of the same page cannot slip in between
                touches = self._touches
                if not touches:
                    return n
                chunk = list(itertools.islice(touches.items(), 256))
                for p, t in chunk:
                    del touches[p]
                    try:
                        os.utime(p, ns=(t, t))
                        n += 1
                    except OSError:
                        pass  # evicted, deleted or replaced by another process: nothing to refresh

    def _read_slow(self, fd: int, hdr: bytearray, mv: Any, got: int) -> int:
        """After a short ``preadv``: the record size (``record_bytes`` if the file has exactly that size and was read
        completely into ``hdr`` and ``mv``, one view or a list of run views, else the file size)."""
        size = os.fstat(fd).st_size
        if size != self.record_bytes:
            return size
        bufs = [memoryview(hdr), *mv] if isinstance(mv, list) else [memoryview(hdr), mv]
        while got < self.record_bytes:  # a regular file read was interrupted: continue where it stopped
            n = os.preadv(fd, _bytes_after(bufs, got), got)
            if n <= 0:
                return got
            got += n
        return got

    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer],
                  checksums: Optional[Sequence[int]] = None,
                  tokens: Optional[Sequence[PageTokens]] = None) -> list[bool]:
        """Store pages from ``sources`` (each a contiguous CPU buffer of ``page_bytes`` bytes, or a list or tuple of
        contiguous runs adding up to it: :attr:`vectored_sources`).

        Each record is written to a temporary file in its final directory, optionally fsynced, and renamed over the
        key's path (an existing record of the key is replaced). Capacity is made by evicting least recently used
        records first; on ``ENOSPC`` ``enospc_evict_pages`` more are evicted and the write retried once. Returns one
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
        rec = self.record_bytes
        lock, writing, touches = self._lock, self._writing, self._touches
        plan = []
        for i, k in enumerate(keys):  # reserve space in key order (the batch's LRU order), then write
            p = self._path(k)
            with lock:
                index = self._index  # (rescan may have replaced it)
                old = index.pop(p, None)
                if old is not None:
                    self._usage -= old
                self._evict_locked(rec)
                index[p] = rec  # reserve at the most recently used end
                self._usage += rec
                writing[p] = writing.get(p, 0) + 1
                touches.pop(p, None)  # the write's own stamp is newer
                stamp = self._last_stamp = max(time.time_ns(), self._last_stamp + 1)
            plan.append((i, k, p, stamp))

        def write(item: tuple) -> Optional[bool]:
            i, k, p, stamp = item
            try:
                ok = self._write_one(k, kraws[i], p, views[i], stamp, psum=None if sums is None else sums[i])
                if ok is False:  # out of space below our capacity: spares and a forced eviction free it, one retry
                    self._drop_spares()
                    with lock:
                        self.counters["enospc"] += 1
                        forced = self._evict_locked(count=self.cfg.enospc_evict_pages, keep=p, free=True)
                        self.counters["forced_evictions"] += forced
                    if forced:
                        ok = self._write_one(k, kraws[i], p, views[i], stamp, last_try=True,
                                             psum=None if sums is None else sums[i])
                    else:
                        ok = None
                        with lock:
                            self.counters["errors"] += 1
                        self._warn.warning("enospc", "file store %s: filesystem full and nothing left to evict; "
                                           "page %s not stored", self.root, k)
                return ok
            finally:
                with lock:
                    left = writing[p] - 1
                    if left:
                        writing[p] = left
                    else:
                        del writing[p]

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
                self._forget(p)
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
            flush = bool(self._touches) and time.monotonic() >= self._touch_due
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

    def _write_one(self, key: str, kraw: bytes, path: str, mv: Any, stamp: int,
                   last_try: bool = False, psum: Optional[int] = None) -> Optional[bool]:
        """Write one record atomically, its mtime set to ``stamp`` (ns); ``mv``: the payload, one flat view or a list
        of flat views of its runs (written by the same ``writev`` as the header); ``psum``: the payload's XXH3-64 if
        the caller gave it (else computed here). The record is written to a spare (an evicted record file of the same
        size, :meth:`_spare_locked`) when one is kept, else to a new temporary file, then renamed to ``path``.
        True: stored. False: out of space (caller may evict and retry). None: other failure (counted, logged).
        Never leaves the temporary file behind."""
        d = path[: -len(key) - len(PAGE_SUFFIX) - 1]
        spare = None
        if self._spares:
            with self._lock:
                spare = self._spares.pop() if self._spares else None
        tmp = spare or f"{d}/{TMP_PREFIX}{key}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_seq)}"
        # the page_format header, built here from the key bytes already validated (no second regex / struct call)
        if psum is None:
            psum = payload_checksum(mv)
        head = self._hdr_fixed + kraw + self._hdr_len + psum.to_bytes(8, "little")
        head += xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")
        fd = -1
        try:
            if d not in self._made_dirs:
                os.makedirs(d, exist_ok=True)
                self._made_dirs.add(d)
            if spare is not None:
                try:
                    fd = os.open(spare, _RECYCLE_FLAGS)
                except OSError:  # removed meanwhile (another process's start-up scan): a new file instead
                    spare = None
                    tmp = f"{d}/{TMP_PREFIX}{key}.{os.getpid()}.{threading.get_ident()}.{next(self._tmp_seq)}"
            if spare is None:
                try:
                    fd = os.open(tmp, _WR_FLAGS, 0o644)
                except FileNotFoundError:  # the directory was removed (clear() in another process): recreate once
                    os.makedirs(d, exist_ok=True)
                    fd = os.open(tmp, _WR_FLAGS, 0o644)
            bufs = [head, *mv] if isinstance(mv, list) else [head, mv]
            total = HEADER_BYTES + self.page_bytes
            n = os.writev(fd, bufs)
            if n < total:  # a short write (a signal, a filesystem's own limit): the rest from where it stopped
                _write_rest(fd, bufs, n)
            if spare is not None and os.fstat(fd).st_size != total:  # not a record's size (never expected): cut
                os.ftruncate(fd, total)
            os.utime(fd, ns=(stamp, stamp))  # exact LRU order after a restart (kernel mtimes are jiffy-coarse)
            if self._fsync:
                os.fsync(fd)
            os.close(fd)
            fd = -1
            os.rename(tmp, path)
            if spare is not None:
                with self._lock:
                    self.counters["recycled"] += 1
            return True
        except OSError as e:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
            try:
                os.unlink(tmp)
            except OSError:
                pass
            if e.errno in (errno.ENOSPC, errno.EDQUOT) and not last_try:
                return False
            with self._lock:
                self.counters["errors"] += 1
            self._warn.warning("write", "file store %s: cannot store page %s: %s", self.root, key, e)
            return None

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
                size = self._index.pop(p, None)
                if size is not None:
                    self._usage -= size
                self._touches.pop(p, None)
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
            mine = [p for p in self._index if p.startswith(self.ns_dir + os.sep)]
            for p in mine:
                self._usage -= self._index.pop(p)
            for p in [p for p in self._touches if p.startswith(self.ns_dir + os.sep)]:
                del self._touches[p]
        for p in mine:
            try:
                os.unlink(p)
            except OSError:
                pass
        try:  # records written by other processes that this one never saw
            for sub in os.scandir(self.ns_dir):
                if len(sub.name) == 2 and sub.is_dir(follow_symlinks=False):
                    for f in os.scandir(sub.path):
                        if f.name.endswith(PAGE_SUFFIX):
                            try:
                                os.unlink(f.path)
                            except OSError:
                                pass
        except OSError:
            pass

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
        self._drop_spares()

    def __repr__(self) -> str:
        return (f"FileStore(root={self.root!r}, namespace={self.namespace.hex()[:8]}.., page_bytes={self.page_bytes}, "
                f"capacity_bytes={getattr(self, 'capacity_bytes', None)})")
