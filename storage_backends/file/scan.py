"""The file store's start-up work: check that the root can be written, size the default capacity, and scan the
directory into the LRU index (in the constructor, or in a ``tkv-file-scan`` thread with ``background_scan``).

The scan orders page files by mtime (oldest = least recently used), quarantines records of the store's namespace
whose size (or, with ``scan_verify: header``, header) is wrong, and removes temporary files of dead writers or older
than ``stale_temp_s``; one ``stat`` per file. :func:`check_root` raises ``ConfigError``; the rest never raises.
"""
from __future__ import annotations

import errno
import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Optional

from tierkv.storage_backends.common import ConfigError
from tierkv.storage_backends.file.layout import TMP_PREFIX, _walk, pid_alive
from tierkv.storage_backends.page_format import HEADER_BYTES, PageFormatError, decode_header

if TYPE_CHECKING:
    from tierkv.storage_backends.file.store import FileStore

log = logging.getLogger("tierkv.storage.file")


def check_root(store: "FileStore") -> None:
    """Create ``store.root`` and its namespace directory and probe that a file can be written there (a read-only
    store: only that the root is a directory). Raises ConfigError naming ``l3.file.root``."""
    root = store.root
    if store.cfg.read_only:
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
        os.makedirs(store.ns_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"bad value {root!r} for 'l3.file.root': cannot create or write the store directory "
                          f"({type(e).__name__}: {e.strerror or e}); give a writable directory or set "
                          f"l3.file.read_only: true") from None


def default_capacity(store: "FileStore") -> int:
    """``default_capacity_fraction`` of (bytes indexed + bytes free on the filesystem), at least one record."""
    try:
        st = os.statvfs(store.root)
        avail = st.f_bavail * st.f_frsize
    except OSError:
        avail = 0
    cap = int((avail + store._ev.usage) * store.cfg.default_capacity_fraction)
    return max(cap, store.record_bytes)


def count_quarantine(quarantine_dir: str) -> int:
    """Files in the quarantine directory (0 when it cannot be listed)."""
    try:
        with os.scandir(quarantine_dir) as it:
            return sum(1 for _ in it)
    except OSError:
        return 0


def startup_scan(store: "FileStore") -> None:
    """The constructor's scan: :func:`rescan`, then the capacity (configured or default) enforced on what it found.
    Sets the store's scan-done event however it ends."""
    try:
        store.rescan()
        if store.cfg.capacity_bytes is not None:
            store.capacity_bytes = store.cfg.capacity_bytes
        else:
            store.capacity_bytes = default_capacity(store)
        if not store.cfg.read_only:
            with store._lock:
                store._ev.evict_locked(0)
    finally:
        store._scan_done.set()


def rescan(store: "FileStore") -> dict[str, Any]:
    """Rebuild ``store``'s index and usage from the directory (see :meth:`FileStore.rescan`). Returns
    ``{"files", "seconds", "quarantined", "temp_removed"}``."""
    t0 = time.perf_counter()
    store.flush_touches()  # the scan orders by mtime: hits not yet stamped would lose their place
    entries: list[tuple[float, str, int]] = []
    n_q = n_tmp = 0
    now = time.time()
    cfg = store.cfg
    rw = not cfg.read_only
    mypid = os.getpid()
    try:
        walk = _walk(store.root, temps=rw)
    except OSError as e:
        store._warn.warning("scan", "file store %s: cannot scan: %s", store.root, e)
        walk = iter(())
    own_ns = store.namespace.hex()
    for ns_hex, fname, path, st in walk:
        if not fname.startswith(TMP_PREFIX):
            if ns_hex == own_ns and rw:
                bad = None
                if st.st_size != store.record_bytes:
                    bad = f"size {st.st_size} != {store.record_bytes}"
                elif cfg.scan_verify == "header":
                    bad = header_problem(store, path, fname[:32])
                if bad is not None:
                    store._discard_bad(path, bad, ino=st.st_ino)
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
        if dead or now - st.st_mtime > cfg.stale_temp_s:
            try:
                os.unlink(path)
                n_tmp += 1
            except OSError:
                pass
    entries.sort()
    with store._lock:
        store._ev.replace_index_locked((p, s) for _, p, s in entries)
        store.counters["temp_removed"] += n_tmp
        store.counters["scan_files"] = len(entries)
        dt = time.perf_counter() - t0
        store.counters["scan_seconds"] = dt
    if n_q or n_tmp:
        log.info("file store %s: scan found %d pages, quarantined %d bad records, removed %d temp files (%.3f s)",
                 store.root, len(entries), n_q, n_tmp, dt)
    return {"files": len(entries), "seconds": dt, "quarantined": n_q, "temp_removed": n_tmp}


def header_problem(store: "FileStore", path: str, key: str) -> Optional[str]:
    """Why the record at ``path`` has a bad header for ``key`` (None: it is good, or cannot be read now)."""
    try:
        with open(path, "rb", buffering=0) as f:
            head = f.read(HEADER_BYTES)
        decode_header(head, key, store.namespace, store.page_bytes)
    except PageFormatError as e:
        return str(e)
    except OSError:
        return None
    return None
