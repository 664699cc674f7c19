"""Which keys a tierkv cache server holds, published in shared memory so that a client on the same host answers
"how many leading pages are stored?" without a round trip (:meth:`.client.ZmqStore.batch_exists`).

A table is a file ``/dev/shm/tierkv-presence-<pid><hex>``: a header of :data:`HEADER_WORDS` little-endian uint64
words (magic, format, slot count, state, writer pid, live entries, used slots) and then ``slots`` uint64 slots (a
power of two), an open-addressing set of 64-bit key fingerprints with linear probing (:func:`fingerprint`: XXH3-64 of
namespace + key; slot value 0 is empty, 1 a removed entry). One process writes (the server: :meth:`create`,
:meth:`add`, :meth:`discard`); any number read (:meth:`open`, mapped read-only), without a lock. A table too full or
with too many removed entries is rebuilt under a new name and the old one retired; a reader of a retired table, or
of one whose writer is gone, gets None and asks the server again. A wrong "present" (a fingerprint collision, a
racing eviction) is a miss when loaded, never wrong data. Why a table beats a round trip and why reads need no
lock: docs/developer-guide.md, section "storage_backends/zmq/presence_table.py".
"""
from __future__ import annotations

import os
import re
import select
import threading
from typing import Iterable, Optional, Sequence

import numpy as np
import xxhash

from tierkv.storage_backends.shm_segment import Segment

__all__ = ["PresenceTable", "fingerprint", "PRESENCE_PREFIX", "PRESENCE_NAME_RE"]

MAGIC = int.from_bytes(b"TKVPRES1", "little")
FORMAT = 1
#: header length in uint64 words (56 bytes used, the rest reserved)
HEADER_WORDS = 16
_SLOTS, _STATE, _PID, _LIVE, _USED = 2, 3, 4, 5, 6
EMPTY, REMOVED = 0, 1
LIVE, RETIRED = 0, 1
#: smallest table (slots); a table is rebuilt with 4x its live entries, at least this many
MIN_SLOTS = 4096
#: file names: prefix + writer pid (8 hex digits) + 16 random hex digits
PRESENCE_PREFIX = "tierkv-presence-"
PRESENCE_NAME_RE = re.compile(r"^tierkv-presence-[0-9a-f]{24}$")


class _ExitWatch:
    """Whether process ``pid`` has exited, from a pidfd (Linux >= 5.3): calling the object polls it without waiting
    (one ``poll`` system call; a lock keeps calls from several threads apart, as one poll object allows). :meth:`close`
    closes the descriptor (idempotent); a closed watch reports "exited"."""

    def __init__(self, fd: int):
        self._fd = fd
        self._poll = select.poll()
        self._lock = threading.Lock()
        if fd >= 0:
            self._poll.register(fd, select.POLLIN)

    def __call__(self) -> bool:
        with self._lock:
            return self._fd < 0 or bool(self._poll.poll(0))

    def close(self) -> None:
        with self._lock:
            fd, self._fd = self._fd, -1
        if fd >= 0:
            os.close(fd)


def _exit_watch(pid: int) -> Optional[_ExitWatch]:
    """An :class:`_ExitWatch` of ``pid``; one that reports "exited" when no such process exists in this pid
    namespace; None where pidfds are not available (not Linux, an old kernel, a seccomp filter: the caller uses
    ``kill(pid, 0)``)."""
    if pid <= 0:
        return _ExitWatch(-1)
    try:
        return _ExitWatch(os.pidfd_open(pid))
    except ProcessLookupError:
        return _ExitWatch(-1)
    except (AttributeError, OSError):
        return None


def fingerprint(namespace: bytes, key: str) -> int:
    """The table's 64-bit fingerprint of page ``key`` (32 hex characters) under ``namespace`` (bytes): XXH3-64 of the
    namespace followed by the key's ASCII, moved off the two reserved values (0 empty, 1 removed)."""
    fp = xxhash.xxh3_64_intdigest(namespace + key.encode())
    return fp if fp > REMOVED else fp + 2


class PresenceTable:
    """One presence table (see the module docstring). Build with :meth:`create` (writer) or :meth:`open` (reader).
    Attributes: ``name`` (file name), ``slots``, ``writer`` (True in the process that created it)."""

    def __init__(self, seg: Segment, words: memoryview, writer: bool):
        self._seg, self._w = seg, words
        self.name, self.writer = seg.name, writer
        self.slots = int(words[_SLOTS])
        self._mask = self.slots - 1
        self._pid = int(words[_PID])
        self._exited = None if writer else _exit_watch(self._pid)

    # ----------------------------------------------------------------------------------------- writer
    @classmethod
    def create(cls, directory: str, entries: Iterable[int] = (), min_slots: int = MIN_SLOTS) -> "PresenceTable":
        """A new table file in ``directory`` (mode 0600) holding the fingerprints ``entries`` (ints >= 2, or a
        uint64 array; repeats count once), with a power-of-two number of slots of at least ``min_slots`` and 4x the
        entries. Raises OSError (no such directory, no space).

        The entries are placed in bulk (numpy), one probe step for all of them per round: every fingerprint whose
        slot is empty is written there (of several for one slot the last write stays), those that stayed are
        placed, and the rest move one slot on. A fingerprint thus moves past a slot only once that slot is taken,
        which is all a probe needs; copies of one fingerprint travel together and take one slot. At a load of at
        most 1/4 a few rounds place them all, where one at a time in Python a million take seconds, during which
        the single-threaded server answers nothing."""
        fps = (entries.astype(np.uint64) if isinstance(entries, np.ndarray)
               else np.fromiter(entries, dtype=np.uint64))
        fps = fps[fps > REMOVED]  # (the reserved values are no fingerprints)
        slots = 1 << max(int(min_slots) - 1, 4 * fps.size, 1).bit_length()
        name = f"{PRESENCE_PREFIX}{os.getpid() & 0xFFFFFFFF:08x}{os.urandom(8).hex()}"
        seg = Segment.create(directory, name, 8 * (HEADER_WORDS + slots))
        words = seg.mv.cast("Q")
        words[_SLOTS], words[_PID] = slots, os.getpid()
        table = np.frombuffer(seg.mv, dtype=np.uint64, count=slots, offset=8 * HEADER_WORDS)
        pos = fps & np.uint64(slots - 1)
        while fps.size:
            free = table[pos] == EMPTY
            table[pos[free]] = fps[free]
            left = table[pos] != fps
            fps, pos = fps[left], (pos[left] + np.uint64(1)) & np.uint64(slots - 1)
        del table
        words[_LIVE] = words[_USED] = int(np.count_nonzero(np.frombuffer(seg.mv, dtype=np.uint64, count=slots,
                                                                            offset=8 * HEADER_WORDS)))
        words[1] = FORMAT
        words[0] = MAGIC  # last: a reader that maps the file before this finds no table
        return cls(seg, words, True)

    def entries(self) -> np.ndarray:
        """The fingerprints held (a uint64 array, a copy), e.g. to build a replacement table from."""
        a = np.frombuffer(self._seg.mv, dtype=np.uint64, count=self.slots, offset=8 * HEADER_WORDS)
        return a[a > REMOVED].copy()

    def _find(self, fp: int) -> tuple[int, int]:
        """(slot holding ``fp`` or -1, the first removed or empty slot of its probe sequence or -1)."""
        w, mask, h = self._w, self._mask, HEADER_WORDS
        i, free = fp & mask, -1
        for _ in range(self.slots):
            v = w[h + i]
            if v == fp:
                return i, free
            if v == EMPTY:
                return -1, (i if free < 0 else free)
            if v == REMOVED and free < 0:
                free = i
            i = (i + 1) & mask
        return -1, free

    def add(self, fp: int) -> bool:
        """Record fingerprint ``fp`` (from :func:`fingerprint`). False when the table is too full and must be
        replaced (:meth:`full`); adding one that is present changes nothing."""
        at, free = self._find(fp)
        if at >= 0:
            return True
        w = self._w
        if free < 0 or (w[HEADER_WORDS + free] == EMPTY and w[_USED] + 1 > self.slots * 3 // 4):
            return False
        if w[HEADER_WORDS + free] == EMPTY:
            w[_USED] += 1
        w[HEADER_WORDS + free] = fp
        w[_LIVE] += 1
        return True

    def discard(self, fp: int) -> bool:
        """Remove fingerprint ``fp``; True if it was there."""
        at, _free = self._find(fp)
        if at < 0:
            return False
        self._w[HEADER_WORDS + at] = REMOVED
        self._w[_LIVE] -= 1
        return True

    def full(self) -> bool:
        """More than 3/4 of the slots are live or removed entries: the writer should build a replacement."""
        return self._w[_USED] > self.slots * 3 // 4

    def live(self) -> int:
        """Number of fingerprints held."""
        return int(self._w[_LIVE])

    def retire(self) -> None:
        """Mark the table retired (readers stop using it) and, in the writer, remove its file and unmap it."""
        if self.writer:
            self._w[_STATE] = RETIRED
        self.close()

    # ----------------------------------------------------------------------------------------- reader
    @classmethod
    def open(cls, path: str) -> "PresenceTable":
        """Map the table at ``path`` read-only. Raises OSError (cannot open or map) or ValueError (not a table of
        this format: bad name, magic, format or size)."""
        if not PRESENCE_NAME_RE.match(os.path.basename(path)):
            raise ValueError(f"{path} is not named like a presence table")
        seg = Segment.open(path, None, populate=False, readonly=True)
        if seg.size < 8 * HEADER_WORDS or seg.size % 8:
            seg.close()
            raise ValueError(f"{path}: {seg.size} bytes is no presence table")
        words = seg.mv.cast("Q")
        slots = int(words[_SLOTS])
        if (words[0] != MAGIC or words[1] != FORMAT or slots < 1 or slots & (slots - 1)
                or seg.size != 8 * (HEADER_WORDS + slots)):
            words.release()
            seg.close()
            raise ValueError(f"{path} is not a presence table of format {FORMAT}")
        return cls(seg, words, False)

    def usable(self) -> bool:
        """The table is live and its writer process has not exited. A server killed by SIGKILL never retires its
        table; its exit is seen through a pidfd opened with the table (readable from the moment the process ends,
        also while it is an unreaped zombie, and never fooled by a reused pid), else (no pidfd here) by one
        ``kill(pid, 0)``, which a zombie passes. A pid from another pid namespace reads as gone, so such a reader
        asks over ZMQ."""
        if self._w[_STATE] != LIVE:
            return False
        if not self.writer:
            if self._exited is not None:
                return not self._exited()
            try:
                os.kill(self._pid, 0)
            except ProcessLookupError:
                return False
            except OSError:  # alive, not ours to signal
                pass
        return True

    def lead(self, fps: Sequence[int]) -> Optional[int]:
        """How many leading fingerprints of ``fps`` are present, or None when the table is not :meth:`usable`."""
        if not self.usable():
            return None
        n = 0
        for fp in fps:
            if self._find(fp)[0] < 0:
                break
            n += 1
        return n

    def close(self) -> None:
        """Unmap (and in the writer remove the file). Idempotent."""
        if self._exited is not None:
            self._exited.close()
        try:
            self._w.release()
        except BufferError:
            pass
        self._seg.close()
