"""XXH3-64 of the page in each L2 slot, kept by the worker side ("checksum once").

A page's checksum is taken once, when it enters L2 (after the L1 -> L2 save, or when a prefetched page arrived
intact from L3), and travels from there: into the L3 record header on backup (the store does not hash the
payload again) and into the check before an L2 -> L1 load when ``verify_checksums`` is on. The table has one
entry per slot, so its size is bounded by the pool (``num_slots`` x 25 bytes); the entry also names the page key,
so a slot that was reused for another page never passes for the old one.

Two threads write it: the worker's step (saves) and the L3 readers (prefetched pages). The table owns its
consistency: every call holds its lock, so an entry is never seen half written (a new key with the old checksum).
"""
from __future__ import annotations

import threading
from typing import Optional

import numpy as np


class SlotChecksums:
    """Per-slot ``(page key, XXH3-64)`` of the L2 host pool.

    Args:
        num_slots: slots of the host pool (> 0).
    Raises:
        ValueError: ``num_slots`` <= 0; a slot out of range or a key that is not 16 bytes in :meth:`record`.
    """

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._sums = np.zeros(num_slots, dtype=np.uint64)
        self._keys = np.zeros((num_slots, 16), dtype=np.uint8)  # raw bytes ("S16" would drop trailing NULs)
        self._valid = np.zeros(num_slots, dtype=bool)
        self._lock = threading.Lock()

    def record(self, slot: int, key: bytes, checksum: int) -> None:
        """Slot ``slot`` now holds page ``key`` (16 bytes) whose bytes hash to ``checksum``."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"slot {slot} out of range [0, {self.num_slots})")
        if len(key) != 16:
            raise ValueError(f"page key must be 16 bytes, got {len(key)}")
        k = np.frombuffer(key, dtype=np.uint8)
        with self._lock:
            self._sums[slot] = checksum
            self._keys[slot] = k
            self._valid[slot] = True

    def get(self, slot: int, key: bytes) -> Optional[int]:
        """The checksum recorded for ``key`` in ``slot``, or None (never recorded, or the slot now holds another
        page)."""
        if not 0 <= slot < self.num_slots:
            return None
        with self._lock:
            if not self._valid[slot] or self._keys[slot].tobytes() != key:
                return None
            return int(self._sums[slot])

    def forget(self, slot: int) -> None:
        """Slot ``slot`` holds no known page any more (no-op for a slot out of range)."""
        if 0 <= slot < self.num_slots:
            with self._lock:
                self._valid[slot] = False

    def __len__(self) -> int:
        with self._lock:
            return int(self._valid.sum())
