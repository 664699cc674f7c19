"""On-disk layout of the file store and the tools that read it without a store object.

Under ``root``: ``<namespace hex, 32 chars>/<key[0:2]>/<key>.page`` holds one record (64-byte header || payload,
see :mod:`tierkv.storage_backends.page_format`); ``.tmp.*`` files next to it are writes in progress or spare files
kept for reuse; ``quarantine/`` holds records that failed verification. Keys are validated hex, so no key can name a
path outside ``root``. Here: the names, the directory walk, record files read whole, quarantine, the namespace
description file and the filesystem a path is on. Functions raise ``OSError`` where they say so.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import time
from typing import Any, Optional, Sequence

from tierkv.storage_backends.page_format import HEADER_BYTES

log = logging.getLogger("tierkv.storage.file")

PAGE_SUFFIX = ".page"
TMP_PREFIX = ".tmp."
QUARANTINE_DIR = "quarantine"
NAMESPACE_INFO_FILE = "namespace.json"
_NS_HEX_LEN = 32
_HEX = frozenset("0123456789abcdef")


def pid_alive(pid: int) -> bool:
    """True unless no process ``pid`` exists (a process of another user counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class PageFile:
    """One record file found by :func:`iter_page_files`: ``ns_hex`` (namespace directory name), ``key`` (hex),
    ``path``, ``size`` (bytes), ``mtime_ns`` (last write or hit, see ``touch_on_read``)."""

    __slots__ = ("ns_hex", "key", "path", "size", "mtime_ns")

    def __init__(self, ns_hex: str, key: str, path: str, size: int, mtime_ns: int):
        self.ns_hex, self.key, self.path, self.size, self.mtime_ns = ns_hex, key, path, size, mtime_ns


def _bytes_after(bufs: list, done: int) -> list[memoryview]:
    """The views of what follows the first ``done`` bytes of ``bufs`` (flat byte buffers, in order): the buffers
    wholly after that point and the tail of the one it falls in."""
    rest = []
    for b in bufs:
        m = memoryview(b)
        if done >= m.nbytes:
            done -= m.nbytes
            continue
        rest.append(m[done:])
        done = 0
    return rest


def _write_rest(fd: int, bufs: list, done: int) -> None:
    """Write what follows the first ``done`` bytes of ``bufs`` (byte buffers, in order) to ``fd``, retrying short
    writes. Raises OSError as ``os.writev`` does, and EIO when a write makes no progress."""
    rest = _bytes_after(bufs, done)
    while rest:
        n = os.writev(fd, rest)
        if n <= 0:
            raise OSError(errno.EIO, "a write made no progress")
        while rest and n >= rest[0].nbytes:
            n -= rest[0].nbytes
            rest.pop(0)
        if rest and n:
            rest[0] = rest[0][n:]


def mount_of(path: str, mounts: str = "/proc/mounts", jbd2_dir: str = "/proc/fs/jbd2") -> dict[str, Any]:
    """The filesystem ``path`` is on: the entry of ``mounts`` (``/proc/mounts`` format) with the longest mount point
    above ``path``, as ``{"device", "mount", "fstype", "options", "journal"}``. ``journal`` is for ext4 only: True
    when ``jbd2_dir`` has a journal of the device (``<device name>-<inode>``), False when it has none, else None.

    Why it matters to a file store: ext4 without a journal skips every inode deleted in the last 5 s (300 s while
    its inode-table block is dirty) when it allocates one (the kernel's
    ext4 inode allocator does this only without a journal), so after many records or other files are deleted each file creation scans past
    them and costs several times more CPU (see ``benchmarks/README.md``, file_at_capacity and no_reuse_cost).
    Returns ``{}`` when ``mounts`` cannot be read."""
    path = os.path.realpath(path)
    best: Optional[list[str]] = None
    try:
        with open(mounts) as f:
            for line in f:
                fields = line.split()
                if len(fields) < 4:
                    continue
                mnt = fields[1].replace("\\040", " ")
                if (path == mnt or path.startswith(mnt.rstrip("/") + "/")) and (
                        best is None or len(mnt) >= len(best[1])):
                    best = [fields[0], mnt, fields[2], fields[3]]
    except OSError:
        return {}
    if best is None:
        return {}
    dev, mnt, fstype, opts = best
    journal = None
    if fstype == "ext4":
        name = os.path.basename(os.path.realpath(dev)) if dev.startswith("/") else dev
        try:
            journal = any(j.rsplit("-", 1)[0] == name for j in os.listdir(jbd2_dir))
        except OSError:
            journal = None
    return {"device": dev, "mount": mnt, "fstype": fstype, "options": opts, "journal": journal}


def iter_page_files(root: str, namespaces: Optional[Sequence[str]] = None):
    """Yield a :class:`PageFile` for every ``root/<ns hex>/<xx>/<key>.page`` (the layout of this module's docstring),
    optionally only for the namespace directories named in ``namespaces`` (hex). Files that vanish while walked are
    skipped; temporary and quarantined files are not records and are not yielded. Reads no file content.

    Raises:
        OSError: ``root`` itself cannot be listed (missing, not a directory, no permission).
    """
    for ns_hex, fname, path, st in _walk(root, namespaces):
        yield PageFile(ns_hex, fname[:32], path, st.st_size, st.st_mtime_ns)


def _walk(root: str, namespaces: Optional[Sequence[str]] = None, temps: bool = False):
    """The directory walk of a store (:meth:`FileStore.rescan`, :func:`iter_page_files`): an iterator of
    ``(ns_hex, file name, path, stat result)`` for every page file ``root/<ns hex>/<xx>/<key>.page`` (and, with
    ``temps``, every temporary file ``<xx>/`` holds), namespace and ``<xx>`` directories in name order, optionally only
    the namespaces named in ``namespaces`` (hex). Entries that vanish while walked are skipped; stats do not follow
    links.

    Raises:
        OSError: ``root`` itself cannot be listed (raised here, before any entry is yielded).
    """
    top = sorted(os.scandir(root), key=lambda e: e.name)
    return _walk_entries(top, None if namespaces is None else set(namespaces), temps)


def _walk_entries(top: list, want: Optional[set], temps: bool):
    for nsent in top:
        name = nsent.name
        if len(name) != _NS_HEX_LEN or not set(name) <= _HEX or not nsent.is_dir(follow_symlinks=False):
            continue
        if want is not None and name not in want:
            continue
        try:
            subs = sorted(os.scandir(nsent.path), key=lambda e: e.name)
        except OSError:
            continue
        for sub in subs:
            if len(sub.name) != 2 or not sub.is_dir(follow_symlinks=False):
                continue
            try:
                files = list(os.scandir(sub.path))
            except OSError:
                continue
            for f in files:
                fname = f.name
                if not ((fname.endswith(PAGE_SUFFIX) and len(fname) == 32 + len(PAGE_SUFFIX))
                        or (temps and fname.startswith(TMP_PREFIX))):
                    continue
                try:
                    st = f.stat(follow_symlinks=False)
                except OSError:
                    continue
                yield name, fname, f.path, st


def unlink_records(ns_dir: str) -> None:
    """Remove every record file under the namespace directory ``ns_dir`` (``<xx>/<key>.page``); never raises."""
    try:
        for sub in os.scandir(ns_dir):
            if len(sub.name) == 2 and sub.is_dir(follow_symlinks=False):
                for f in os.scandir(sub.path):
                    if f.name.endswith(PAGE_SUFFIX):
                        try:
                            os.unlink(f.path)
                        except OSError:
                            pass
    except OSError:
        pass


def read_record_file(path: str) -> tuple[bytes, bytes]:
    """``(header, payload)`` of a record file (header: the first 64 bytes, shorter if the file is). Raises OSError."""
    with open(path, "rb", buffering=0) as f:
        data = f.read()
    return data[:HEADER_BYTES], data[HEADER_BYTES:]


def quarantine_file(root: str, path: str, reason: str) -> str:
    """Move a bad record file to ``root/quarantine/`` (named like the store's own quarantine: namespace, key, pid,
    time, ``.bad``). Returns the new path. Raises OSError."""
    qdir = os.path.join(root, QUARANTINE_DIR)
    os.makedirs(qdir, exist_ok=True)
    ns_hex = os.path.basename(os.path.dirname(os.path.dirname(path)))
    dst = os.path.join(qdir, f"{ns_hex}-{os.path.basename(path)}.{os.getpid()}.{time.time_ns()}.bad")
    os.rename(path, dst)
    log.info("quarantined %s (%s) as %s", path, reason, dst)
    return dst



def describe_namespace(root: str, namespace: bytes, info: dict) -> bool:
    """Write ``root/<namespace hex>/namespace.json``: what the 16-byte digest stands for (e.g.
    ``dataclasses.asdict(ModelNamespace)``: model_id, dtype, kv_layout, page_size, ranks), so ``tierkv store stats``
    can show it; the digest itself cannot be decoded. Written atomically (temp + rename), never read by the store, so a
    wrong or missing file only changes what the tool prints. Returns False (and logs) when it cannot be written."""
    d = os.path.join(root, bytes(namespace).hex())
    tmp = os.path.join(d, f"{TMP_PREFIX}{NAMESPACE_INFO_FILE}.{os.getpid()}")
    try:
        os.makedirs(d, exist_ok=True)
        with open(tmp, "w") as f:
            json.dump(info, f, sort_keys=True, default=str)
        os.rename(tmp, os.path.join(d, NAMESPACE_INFO_FILE))
        return True
    except OSError as e:
        log.warning("cannot write %s in %s: %s", NAMESPACE_INFO_FILE, d, e)
        try:
            os.unlink(tmp)
        except OSError:
            pass
        return False
