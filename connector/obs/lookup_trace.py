"""Lookup trace (config key ``trace_path``): one JSON line per counted lookup, for ``tierkv plan``.

:class:`tierkv.connector.core.scheduler.CacheScheduler` hands :meth:`LookupTrace.lookup` each request that may read
a cache, once, when its lookup is counted at first admission. The file holds:

- a header line ``{"tierkv_lookup_trace": 1, "page_size": P, "l2_pages": N, "eviction_policy": "lru"}``;
- per lookup ``{"t": seconds since the header, "keys": [hex page keys], "lookup_pages": n, "outcome": {...}}``:
  ``keys`` every full page of the request at admission, ``lookup_pages`` how many of them the lookup offered,
  ``outcome`` the nonzero tokens per part (``l1``, ``l2``, ``l3``, the miss reasons ``MISS_REASONS`` of
  :mod:`tierkv.connector.l3.controller`), ``load_cap`` / ``save_cap`` (pages) when the controls limit them, and
  ``keep: true`` when they keep its pages (they bypass L3 admission).

No token ids are written (keys are one-way hashes). Lines are buffered (:data:`FLUSH_LINES`, :data:`FLUSH_S`) and
the writer never fails the engine: an ``OSError`` is counted (``trace_errors``) and logged once, later lines are only
counted (``trace_dropped_lines``); ``trace_lines`` counts the lines written. Details: docs/developer-guide.md.
"""
from __future__ import annotations

import atexit
import json
import logging
import os
import threading
import time
from typing import Optional

logger = logging.getLogger("tierkv.trace")

FORMAT = 1
HEADER_KEY = "tierkv_lookup_trace"
FLUSH_LINES = 256
FLUSH_S = 1.0


class LookupTrace:
    """Buffered, line-per-lookup writer of a lookup trace at ``path`` (``{pid}`` expanded; the file is replaced).

    Args:
        path: the file to write.
        page_size, l2_pages, eviction_policy: written in the header (what ``tierkv plan`` replays with by default).
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(self, path: str, page_size: int, l2_pages: int, eviction_policy: str, clock=time.monotonic):
        self.path = path.replace("{pid}", str(os.getpid()))
        self.clock = clock
        self.t0 = clock()
        self._buf: list[str] = []
        self._last_flush = self.t0
        self._lock = threading.Lock()
        self._f = None
        self._header = json.dumps({HEADER_KEY: FORMAT, "page_size": page_size, "l2_pages": l2_pages,
                                   "eviction_policy": eviction_policy}) + "\n"
        self._failed = False  # an OSError happened: logged once, later lines are counted as dropped
        self.lines = 0
        self.errors = 0
        self.dropped = 0
        atexit.register(self.close)

    def lookup(self, keys, lookup_pages: int, outcome: dict, load_cap: Optional[int] = None,
               save_cap: Optional[int] = None, keep: bool = False) -> None:
        """Record one counted lookup (see the module docstring). Never raises."""
        try:
            rec = {"t": round(self.clock() - self.t0, 6), "keys": [k.hex() for k in keys],
                   "lookup_pages": lookup_pages, "outcome": {k: v for k, v in outcome.items() if v}}
            if load_cap is not None:
                rec["load_cap"] = load_cap
            if save_cap is not None:
                rec["save_cap"] = save_cap
            if keep:
                rec["keep"] = True
            line = json.dumps(rec, separators=(",", ":")) + "\n"
        except Exception as e:  # never the engine's problem
            self._error(e)
            return
        with self._lock:
            if self._failed:
                self.dropped += 1
                return
            self._buf.append(line)
            if len(self._buf) >= FLUSH_LINES or self.clock() - self._last_flush >= FLUSH_S:
                self._flush_locked()

    def flush(self) -> None:
        with self._lock:
            self._flush_locked()

    def close(self) -> None:
        """Write what is buffered and close the file (idempotent)."""
        with self._lock:
            self._flush_locked()
            if self._f is not None:
                try:
                    self._f.close()
                except OSError as e:
                    self._error(e)
                self._f = None

    def stats(self) -> dict:
        return {"trace_lines": self.lines, "trace_errors": self.errors, "trace_dropped_lines": self.dropped}

    def _flush_locked(self) -> None:
        self._last_flush = self.clock()
        if self._failed or (not self._buf and self._f is not None):
            return
        buf, self._buf = self._buf, []
        try:
            if self._f is None:
                self._f = open(self.path, "w")
                self._f.write(self._header)
            self._f.write("".join(buf))
            self._f.flush()
            self.lines += len(buf)
        except OSError as e:
            self.dropped += len(buf)
            self._failed = True
            self._error(e)

    def _error(self, e: Exception) -> None:
        self.errors += 1
        if self.errors == 1:
            logger.warning("tierkv: lookup trace %s: %s; no more lines are written (counted as trace_dropped_lines)",
                           self.path, e)
