"""Free-slot allocator of the L2 host pool (scheduler side).

Pure Python and no torch: the scheduler process, which decides which slot holds which page, never imports the
tensor code. The worker side owns the memory (:class:`tierkv.connector.l2.host_pool.HostPool`);
both sides agree on ``num_slots``.
"""
from __future__ import annotations

import heapq
import threading
from typing import Iterable, Optional

import numpy as np


class SlotAllocator:
    """Free-slot allocator of the host pool (scheduler side; pure Python, no tensors; thread-safe).

    Slots are handed out lowest first, so pages saved together usually get consecutive slots and the transfer
    kernels can merge them into single copies. ``alloc`` is all-or-nothing; ``free`` refuses double frees and
    out-of-range slots (ValueError, nothing freed)."""

    def __init__(self, num_slots: int):
        if not isinstance(num_slots, int) or num_slots <= 0:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.num_slots = num_slots
        self._free = list(range(num_slots))  # a heap (sorted list is a valid heap)
        self._used = bytearray(num_slots)
        self._lock = threading.Lock()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_slots - len(self._free)

    def alloc(self, n: int) -> Optional[list[int]]:
        """``n`` free slots (ascending), or None if fewer than ``n`` are free (then nothing is taken)."""
        if not isinstance(n, int) or n < 0:
            raise ValueError(f"alloc: n must be an int >= 0, got {n!r}")
        with self._lock:
            if n > len(self._free):
                return None
            if n == len(self._free):
                out = sorted(self._free)
                self._free = []
            else:
                out = [heapq.heappop(self._free) for _ in range(n)]
            for s in out:
                self._used[s] = 1
            return out

    def free(self, slots: Iterable[int]) -> None:
        """Return ``slots`` to the pool. Raises ValueError (freeing none of them) for an out-of-range slot, a slot
        that is not allocated, or a slot given twice."""
        slots = list(slots)
        with self._lock:
            seen = set()
            for s in slots:
                if not isinstance(s, (int, np.integer)) or isinstance(s, bool) or not 0 <= s < self.num_slots:
                    raise ValueError(f"free: slot {s!r} out of range [0, {self.num_slots})")
                if not self._used[s] or s in seen:
                    raise ValueError(f"free: slot {s} is not allocated (double free)")
                seen.add(s)
            for s in slots:
                self._used[s] = 0
                heapq.heappush(self._free, int(s))

    def is_allocated(self, slot: int) -> bool:
        return bool(self._used[slot])
