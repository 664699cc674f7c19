"""The recompute estimate outlives the engine process: a restarted engine starts with its predecessor's prefill time
per token instead of none.

An engine restarted over a warm L3 may never time a prefill (it computes only short suffixes) and, without an
estimate, would take and wait for every L3 hit however slow the store. So the scheduler writes its prefill estimate
to a small JSON file per host and page namespace, and a new scheduler of the same namespace on the same host starts
from it. Why in full: docs/developer-guide.md, section "connector/l3/estimates.py".

File: ``<dir>/tierkv-estimates-<hostname>-<namespace hex>.json`` = ``{"prefill_s_per_token": float,
"written_at": unix seconds}``; ``dir`` is ``$TIERKV_ESTIMATES_DIR``, else the host-budget ledger's directory
(``$TIERKV_LEDGER_DIR``, ``/dev/shm``, ``/tmp``). Written atomically (temporary file + rename), at most once per
:data:`SAVE_INTERVAL_S` and when the value moved by more than :data:`SAVE_CHANGE` since the last write. A missing,
unreadable, malformed or implausible file (not a finite number in (0, :data:`MAX_S_PER_TOKEN`]) is no estimate.
"""
from __future__ import annotations

import json
import math
import os
import socket
import time
from typing import Optional

#: seconds between two writes of the file (a changed estimate waits at most this long to be written)
SAVE_INTERVAL_S = 10.0
#: relative change of the estimate that makes a write due (once the interval passed)
SAVE_CHANGE = 0.05
#: a larger stored value (seconds per prompt token) is taken for a damaged file
MAX_S_PER_TOKEN = 1.0


def estimates_dir() -> str:
    """``$TIERKV_ESTIMATES_DIR``, else ``$TIERKV_LEDGER_DIR``, else ``/dev/shm`` (``/tmp`` without it)."""
    return (os.environ.get("TIERKV_ESTIMATES_DIR") or os.environ.get("TIERKV_LEDGER_DIR")
            or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"))


class EstimateFile:
    """The stored prefill estimate of one page namespace on this host.

    Args:
        namespace_hex: the page namespace digest (hex) the estimate belongs to.
        directory: where the file lives (default :func:`estimates_dir`).
        clock: monotonic seconds (tests pass a fake one).
    """

    def __init__(self, namespace_hex: str, directory: Optional[str] = None, clock=time.monotonic):
        d = directory or estimates_dir()
        self.path = os.path.join(d, f"tierkv-estimates-{socket.gethostname()}-{namespace_hex}.json")
        self.clock = clock
        self._saved: Optional[float] = None
        self._saved_at: Optional[float] = None

    def load(self) -> Optional[float]:
        """The stored prefill time per prompt token (seconds), or None (no file, or not a plausible value)."""
        try:
            with open(self.path) as f:
                v = json.load(f).get("prefill_s_per_token")
        except (OSError, ValueError, AttributeError):
            return None
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= MAX_S_PER_TOKEN:
            return None
        self._saved = float(v)
        return float(v)

    def maybe_save(self, value: Optional[float]) -> bool:
        """Write ``value`` if it is due (first value, or :data:`SAVE_INTERVAL_S` passed and it moved by more than
        :data:`SAVE_CHANGE`). Returns whether it wrote; an OS error is no write (the engine goes on)."""
        if value is None or not math.isfinite(value) or value <= 0:
            return False
        now = self.clock()
        if self._saved_at is not None and now - self._saved_at < SAVE_INTERVAL_S:
            return False
        if self._saved is not None and abs(value - self._saved) <= SAVE_CHANGE * self._saved:
            return False
        tmp = f"{self.path}.tmp{os.getpid()}"
        try:
            with open(tmp, "w") as f:
                json.dump({"prefill_s_per_token": value, "written_at": time.time()}, f)
            os.replace(tmp, self.path)
        except OSError:
            return False
        self._saved, self._saved_at = value, now
        return True
