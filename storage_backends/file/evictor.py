"""The file store's index and capacity accounting: which record files this process knows, in eviction order, how
many bytes they take, which writes are in flight, which hits still have to be stamped on their files, and which
evicted files are kept for reuse.

Paths map to file sizes in bytes; the order is the ``eviction_policy``'s (:mod:`tierkv.storage_backends.eviction`:
lru, lfu, slru, s3fifo; writes in flight and the path being written are never victims). After a restart the index is
rebuilt from the files' mtimes (least recent first): lru's order survives; lfu's hit counts, slru's segments and
s3fifo's queues and ghost are not persisted and start over from that order. Every method that ends in ``_locked`` expects the
caller to hold :attr:`Evictor.lock` (the store's one lock, so an index update and the file operation it stands for
are atomic for the threads of one process); the others take it themselves. Nothing here raises for a file that
vanished or cannot be removed: that is logged (rate-limited) and the index follows the directory.
"""
from __future__ import annotations

import itertools
import math
import os
import threading
import time
from typing import Iterable, Optional

from tierkv.storage_backends.base import EVICTED_BUFFER_MAX, EvictedKeys
from tierkv.storage_backends.common import Counters, RateLimitedLog
from tierkv.storage_backends.eviction import DEFAULT_PROTECTED_FRACTION, DEFAULT_SMALL_FRACTION, make_key_policy
from tierkv.storage_backends.file.layout import PAGE_SUFFIX, TMP_PREFIX

#: evicted record files kept for reuse (``recycle_evicted``), at most this many bytes and this many files per store
SPARE_MAX_BYTES = 64 << 20
SPARE_MAX_FILES = 64
TOUCH_MAX_PENDING = 4096  # pending hit stamps that force a flush (bounds memory and what a crash can lose)


def apply_touches(touches: dict) -> None:
    """Write pending hit stamps (path -> ns) as mtimes; for a store collected or left open at interpreter exit."""
    while touches:
        try:
            p, t = touches.popitem()
            os.utime(p, ns=(t, t))
        except (OSError, KeyError):
            pass


class Evictor:
    """Eviction order and capacity of the record files one file store has seen.

    Args:
        lock: the store's lock (held around every index change).
        root: the store directory (for log messages).
        record_bytes: bytes of one record file (header + page).
        spare_max: evicted files to keep for reuse (0: unlink every evicted file).
        counters: the store's counters (``evictions`` is counted here).
        warn: the store's rate-limited logger.
        tmp_seq: the store's counter for temporary file names.
        policy, protected_fraction, small_fraction: the eviction policy and its parameters.
    """

    def __init__(self, lock: threading.Lock, root: str, record_bytes: int, spare_max: int, counters: Counters,
                 warn: RateLimitedLog, tmp_seq: "itertools.count", policy: str = "lru",
                 protected_fraction: float = DEFAULT_PROTECTED_FRACTION,
                 small_fraction: float = DEFAULT_SMALL_FRACTION):
        self.lock = lock
        self.root = root
        self.record_bytes = record_bytes
        self.counters = counters
        self._warn = warn
        self._tmp_seq = tmp_seq
        self.index: dict[str, int] = {}  # path -> file bytes
        self.policy = (policy, protected_fraction, small_fraction)
        self.order = make_key_policy(*self.policy)  # the paths of ``index``, in eviction order
        self.usage = 0
        self.writing: dict[str, int] = {}  # paths with a write in flight in this process -> writers
        self.last_stamp = 0
        self.touches: dict[str, int] = {}  # path -> hit stamp (ns) not yet written to the file, oldest first
        self.touch_due = -math.inf  # time.monotonic() by which pending stamps are written
        # evicted record files renamed out of the key space, to be overwritten by the next writes (recycle_evicted)
        self.spares: list[str] = []
        self.spare_max = spare_max
        self.evicted: list[str] = []  # paths evicted since the last take_evicted (at most EVICTED_BUFFER_MAX)
        self.evicted_lost = 0         # evictions since then left out of ``evicted`` (it was full)

    # ------------------------------------------------------------------ eviction
    def evict_locked(self, need: int = 0, count: Optional[int] = None, keep: str = "", free: bool = False) -> int:
        """Evict records in policy order (pop and remove, holding the lock so no reader re-indexes a file being
        removed) until ``usage + need <= capacity`` or, with ``count``, exactly ``count`` records. Records being
        written and ``keep`` are skipped. A removed record is unlinked, or with ``recycle_evicted`` (and not
        ``free``, which must give space back) renamed to a spare temporary file that a later write overwrites
        (:meth:`spare_locked`). Returns the number evicted."""
        n = 0
        writing = self.writing
        busy = (lambda p: p in writing or p == keep) if keep else writing.__contains__
        while self.index and (self.usage + need > self.capacity_bytes if count is None else n < count):
            p = self.order.pop_victim(busy)
            if p is None:
                break
            size = self.index.pop(p, None)
            if size is None:
                continue
            self.usage -= size
            self.touches.pop(p, None)
            n += 1
            if len(self.evicted) < EVICTED_BUFFER_MAX:
                self.evicted.append(p)
            else:
                self.evicted_lost += 1
            try:
                if free or size != self.record_bytes or not self.spare_locked(p):
                    os.unlink(p)
            except FileNotFoundError:
                pass
            except OSError as e:
                self._warn.warning("evict", "file store %s: cannot evict %s: %s", self.root, p, e)
        self.counters["evictions"] += n
        return n

    def take_evicted(self) -> EvictedKeys:
        """The keys of the records :meth:`evict_locked` removed since the last call (every path: capacity, forced by
        ``ENOSPC``, recycled as spares), oldest first, and how many were left out because the buffer was full."""
        with self.lock:
            paths, self.evicted = self.evicted, []
            lost, self.evicted_lost = self.evicted_lost, 0
        cut = len(PAGE_SUFFIX)
        return EvictedKeys([os.path.basename(p)[:-cut] for p in paths], lost)

    def spare_locked(self, path: str) -> bool:
        """Rename the evicted record ``path`` to a spare temporary file in its directory, if fewer than the spare
        limit are kept (``SPARE_MAX_FILES`` files, ``SPARE_MAX_BYTES`` bytes). True if it became a spare.

        A write that takes a spare overwrites it in place and renames it to its own key's path, so at capacity a
        write neither allocates an inode and blocks nor frees them (ext4: inode allocation scans past recently
        deleted inodes; unlink frees the extents; benchmarks/README.md, file_at_capacity). The spare has a
        temporary name: no lookup finds it, and the start-up scan removes it once its process is gone. A reader
        that opened the record before it was evicted may then read a mix of two pages: its checksums make that a
        miss. Raises OSError from the rename (FileNotFoundError: another process removed the record)."""
        if len(self.spares) >= self.spare_max:
            return False
        spare = (f"{os.path.dirname(path)}/{TMP_PREFIX}spare.{os.getpid()}.{threading.get_ident()}."
                 f"{next(self._tmp_seq)}")
        os.rename(path, spare)
        self.spares.append(spare)
        return True

    def take_spare(self) -> Optional[str]:
        """A spare file to overwrite with the next record, or None when none is kept."""
        if not self.spares:
            return None
        with self.lock:
            return self.spares.pop() if self.spares else None

    def drop_spares(self) -> int:
        """Unlink every spare file (on close and when the filesystem is full). Returns how many were removed."""
        with self.lock:
            spares, self.spares = self.spares, []
        n = 0
        for sp in spares:
            try:
                os.unlink(sp)
                n += 1
            except OSError:
                pass
        return n

    # ------------------------------------------------------------------ index entries
    def forget(self, path: str) -> None:
        """Drop an index entry whose file is gone (checked under the lock: a write may have finished since the
        caller looked)."""
        with self.lock:
            if path in self.writing or path not in self.index or os.path.exists(path):
                return
            size = self.index.pop(path, None)
            self.order.remove(path)
            if size is not None:
                self.usage -= size

    def adopt(self, path: str, size: int) -> None:
        """Index a record another process wrote (most recently used end)."""
        with self.lock:
            if path not in self.index and os.path.exists(path):
                self.index[path] = size
                self.order.insert(path)
                self.usage += size

    def drop_locked(self, path: str) -> None:
        """Forget ``path`` (deleted or quarantined by the caller): its index entry, its bytes, its pending stamp."""
        size = self.index.pop(path, None)
        self.order.remove(path)
        if size is not None:
            self.usage -= size
        self.touches.pop(path, None)

    def drop_under_locked(self, prefix: str) -> list[str]:
        """Forget every indexed path under the directory ``prefix`` (with its separator). Returns those paths."""
        mine = [p for p in self.index if p.startswith(prefix)]
        for p in mine:
            self.usage -= self.index.pop(p)
            self.order.remove(p)
        for p in [p for p in self.touches if p.startswith(prefix)]:
            del self.touches[p]
        return mine

    def replace_index_locked(self, entries: Iterable[tuple[str, int]]) -> None:
        """Make ``entries`` (path, size; least recently used first) the index, keeping entries indexed meanwhile
        whose file exists (written or found while a background scan walked) and the reservations of writes in
        flight. The policy starts over from that order (hit counts, segments and queues are not kept)."""
        index = dict(entries)
        for p, size in self.index.items():
            if p not in index and os.path.exists(p):
                index[p] = size
        for p in self.writing:
            index[p] = self.record_bytes
        self.index = index
        self.order = make_key_policy(*self.policy, keys=index)
        self.usage = sum(index.values())

    # ------------------------------------------------------------------ writes
    def reserve_locked(self, path: str) -> int:
        """Make room for one record at ``path`` and reserve it (a new entry of the policy: the most recently used end
        for lru), counted as a write in flight until :meth:`release`. Returns the write's mtime stamp (ns, later than every earlier stamp)."""
        old = self.index.pop(path, None)
        if old is not None:
            self.usage -= old
            self.order.remove(path)
        self.evict_locked(self.record_bytes)
        self.index[path] = self.record_bytes
        self.order.insert(path)
        self.usage += self.record_bytes
        self.writing[path] = self.writing.get(path, 0) + 1
        self.touches.pop(path, None)  # the write's own stamp is newer
        stamp = self.last_stamp = max(time.time_ns(), self.last_stamp + 1)
        return stamp

    def release(self, path: str) -> None:
        """The write of ``path`` reserved by :meth:`reserve_locked` has ended (stored or not)."""
        with self.lock:
            left = self.writing[path] - 1
            if left:
                self.writing[path] = left
            else:
                del self.writing[path]

    # ------------------------------------------------------------------ hits and their stamps
    def note_hits_locked(self, paths: list[str], touch: bool, flush_s: float) -> bool:
        """Count a hit on each record just read (lru: to the most recently used end; indexing ones another process
        wrote) and, with
        ``touch``, stamp each with the hit time for :meth:`flush_touches`. True when the stamps are due."""
        idx = self.index
        rec = self.record_bytes
        touch = touch and bool(paths)
        if touch:
            touches = self.touches
            if not touches:
                self.touch_due = time.monotonic() + flush_s
            t = max(time.time_ns(), self.last_stamp + 1)
        order = self.order
        for p in paths:
            if p in idx:
                order.hit(p)
            elif os.path.exists(p):  # written by another process (or evicted while we read it: not re-added)
                idx[p] = rec
                order.insert(p)
                self.usage += rec
            else:
                continue
            if touch:
                touches.pop(p, None)  # re-insert: the dict stays in stamp order
                touches[p] = t
                t += 1
        if touch:
            self.last_stamp = t
            return len(touches) >= TOUCH_MAX_PENDING or time.monotonic() >= self.touch_due
        return False

    def touches_due_locked(self) -> bool:
        """True when hit stamps are pending and their flush time has come."""
        return bool(self.touches) and time.monotonic() >= self.touch_due

    def flush_touches(self) -> int:
        """Write the pending hit stamps to the records' mtimes, oldest first. Returns the number of records stamped.
        Never raises."""
        n = 0
        while True:
            with self.lock:  # held around the utimes, so a write of the same page cannot slip in between
                touches = self.touches
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
