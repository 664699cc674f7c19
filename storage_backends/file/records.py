"""Record I/O of the file store, one record file at a time: write a record atomically (to a temporary or spare
file, header and payload in one ``writev``, mtime set to its LRU stamp, optional ``fsync``, then ``rename``), finish
a short read, and quarantine or delete a record that failed verification.

A write reports out of space as ``False`` (:func:`write_or_evict` then evicts and retries once) and any other failure
as ``None`` (counted, logged); it never leaves its temporary file behind. Nothing here raises for run-time I/O errors.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

import xxhash

from tierkv.storage_backends.file.layout import PAGE_SUFFIX, TMP_PREFIX, _bytes_after, _write_rest
from tierkv.storage_backends.page_format import HEADER_BYTES, payload_checksum

if TYPE_CHECKING:
    from tierkv.storage_backends.file.store import FileStore

_WR_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_RECYCLE_FLAGS = os.O_WRONLY | os.O_CLOEXEC


def write_record(store: "FileStore", key: str, kraw: bytes, path: str, mv: Any, stamp: int,
               last_try: bool = False, psum: Optional[int] = None) -> Optional[bool]:
    """Write one record atomically, its mtime set to ``stamp`` (ns); ``mv``: the payload, one flat view or a list
    of flat views of its runs (written by the same ``writev`` as the header); ``psum``: the payload's XXH3-64 if
    the caller gave it (else computed here). The record is written to a spare (an evicted record file of the same
    size, :meth:`Evictor.spare_locked`) when one is kept, else to a new temporary file, then renamed to ``path``.
    True: stored. False: out of space (caller may evict and retry). None: other failure (counted, logged).
    Never leaves the temporary file behind."""
    d = path[: -len(key) - len(PAGE_SUFFIX) - 1]
    spare = store._ev.take_spare()
    tmp = spare or f"{d}/{TMP_PREFIX}{key}.{os.getpid()}.{threading.get_ident()}.{next(store._tmp_seq)}"
    # the page_format header, built here from the key bytes already validated (no second regex / struct call)
    if psum is None:
        psum = payload_checksum(mv)
    head = store._hdr_fixed + kraw + store._hdr_len + psum.to_bytes(8, "little")
    head += xxhash.xxh3_64_intdigest(head).to_bytes(8, "little")
    fd = -1
    try:
        if d not in store._made_dirs:
            os.makedirs(d, exist_ok=True)
            store._made_dirs.add(d)
        if spare is not None:
            try:
                fd = os.open(spare, _RECYCLE_FLAGS)
            except OSError:  # removed meanwhile (another process's start-up scan): a new file instead
                spare = None
                tmp = f"{d}/{TMP_PREFIX}{key}.{os.getpid()}.{threading.get_ident()}.{next(store._tmp_seq)}"
        if spare is None:
            try:
                fd = os.open(tmp, _WR_FLAGS, 0o644)
            except FileNotFoundError:  # the directory was removed (clear() in another process): recreate once
                os.makedirs(d, exist_ok=True)
                fd = os.open(tmp, _WR_FLAGS, 0o644)
        bufs = [head, *mv] if isinstance(mv, list) else [head, mv]
        total = HEADER_BYTES + store.page_bytes
        n = os.writev(fd, bufs)
        if n < total:  # a short write (a signal, a filesystem's own limit): the rest from where it stopped
            _write_rest(fd, bufs, n)
        if spare is not None and os.fstat(fd).st_size != total:  # not a record's size (never expected): cut
            os.ftruncate(fd, total)
        os.utime(fd, ns=(stamp, stamp))  # exact LRU order after a restart (kernel mtimes are jiffy-coarse)
        if store._fsync:
            os.fsync(fd)
        os.close(fd)
        fd = -1
        os.rename(tmp, path)
        if spare is not None:
            with store._lock:
                store.counters["recycled"] += 1
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
        with store._lock:
            store.counters["errors"] += 1
        store._warn.warning("write", "file store %s: cannot store page %s: %s", store.root, key, e)
        return None


def write_or_evict(store: "FileStore", key: str, kraw: bytes, path: str, mv: Any, stamp: int,
                   psum: Optional[int] = None) -> Optional[bool]:
    """:func:`write_record`; when the filesystem is full below the store's capacity: drop the spare files, force out
    ``enospc_evict_pages`` least recently used records (never ``path``) and try once more. Returns True (stored) or
    None (not stored: nothing left to evict, still full, or another error; counted, logged)."""
    ok = write_record(store, key, kraw, path, mv, stamp, psum=psum)
    if ok is False:  # out of space below our capacity: spares and a forced eviction free it, one retry
        ev, lock = store._ev, store._lock
        ev.drop_spares()
        with lock:
            store.counters["enospc"] += 1
            forced = ev.evict_locked(count=store.cfg.enospc_evict_pages, keep=path, free=True)
            store.counters["forced_evictions"] += forced
        if forced:
            ok = write_record(store, key, kraw, path, mv, stamp, last_try=True, psum=psum)
        else:
            ok = None
            with lock:
                store.counters["errors"] += 1
            store._warn.warning("enospc", "file store %s: filesystem full and nothing left to evict; "
                                "page %s not stored", store.root, key)
    return ok


def read_rest(fd: int, hdr: bytearray, mv: Any, got: int, record_bytes: int) -> int:
    """After a short ``preadv``: the record size (``record_bytes`` if the file has exactly that size and was read
    completely into ``hdr`` and ``mv``, one view or a list of run views, else the file size)."""
    size = os.fstat(fd).st_size
    if size != record_bytes:
        return size
    bufs = [memoryview(hdr), *mv] if isinstance(mv, list) else [memoryview(hdr), mv]
    while got < record_bytes:  # a regular file read was interrupted: continue where it stopped
        n = os.preadv(fd, _bytes_after(bufs, got), got)
        if n <= 0:
            return got
        got += n
    return got


def discard_bad(store: "FileStore", path: str, reason: str, ino: Optional[int] = None) -> None:
    """Quarantine (or delete) a record that failed verification; never raises."""
    if store.cfg.read_only:
        return
    with store._lock:
        store._ev.drop_locked(path)
    try:
        if ino is not None and os.stat(path).st_ino != ino:
            return  # replaced by a fresh record meanwhile: leave that one alone
        if store.cfg.quarantine and store._quarantine_count < store.cfg.quarantine_max_files:
            os.makedirs(store.quarantine_dir, exist_ok=True)
            dst = os.path.join(store.quarantine_dir, f"{os.path.basename(os.path.dirname(os.path.dirname(path)))}-"
                               f"{os.path.basename(path)}.{os.getpid()}.{time.time_ns()}.bad")
            os.rename(path, dst)
            store._quarantine_count += 1
            store.counters["quarantined"] += 1
        else:
            os.unlink(path)
            store.counters["deleted_bad"] += 1
    except FileNotFoundError:
        pass
    except OSError as e:
        store._warn.warning("quarantine", "file store %s: cannot quarantine %s: %s", store.root, path, e)
    store._warn.warning("corrupt", "file store %s: bad page record %s (%s): treated as a miss", store.root, path,
                       reason)
