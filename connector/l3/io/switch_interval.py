"""The process's GIL switch interval: raised while a worker runs L3 I/O threads, given back at shutdown
(``controller.gil_switch_interval_s``). Process-wide: it applies to every thread of the process.
"""
from __future__ import annotations

import sys
from typing import Optional


def raise_switch_interval(min_s: float) -> Optional[float]:
    """Raise this process's GIL switch interval (``sys.setswitchinterval``) to at least ``min_s`` seconds. Returns
    the previous interval when it was raised, None when ``min_s`` is 0 or the interval is already that long.

    Why: a Python thread that has waited the switch interval for the GIL makes the holder drop it. The L3 threads
    release and take the GIL around every syscall (several per page), so at the interpreter's 5 ms they keep
    forcing the engine's thread, which holds the GIL between its kernels, to hand it over, and where the forward
    keeps every core busy each hand-over also waits for the L3 thread to get a CPU (benchmarks/README.md,
    no_reuse_cost). A longer interval leaves them the GIL the engine's thread releases on its own (around every
    torch kernel). Process-wide: it applies to every thread of the process."""
    if min_s <= 0:
        return None
    prev = sys.getswitchinterval()
    if prev >= min_s:
        return None
    sys.setswitchinterval(min_s)
    return prev


def restore_switch_interval(prev: Optional[float], set_s: float) -> None:
    """Undo :func:`raise_switch_interval` (``prev`` its result, ``set_s`` the value it set) unless something else
    has changed the interval since."""
    if prev is not None and abs(sys.getswitchinterval() - set_s) < 1e-9:
        sys.setswitchinterval(prev)
