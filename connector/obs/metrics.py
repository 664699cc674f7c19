"""Counters export: a JSON file per process (``stats_path``), for tests, benchmarks, the demo and operators.

``stats_path`` may contain ``{role}`` (``scheduler``/``worker``) and ``{pid}``; each process writes its own file
atomically (temporary name + rename) whenever its counters changed, at most every ``min_interval_s`` seconds, and
once more at shutdown. The file never lags the counters by more than about ``min_interval_s``: a change seen by
:meth:`StatsFile.maybe_write` inside the interval is written by a background flusher thread when the interval ends,
even if the engine never steps again. :meth:`StatsFile.maybe_write` and :meth:`StatsFile.write_soon` (called from
the engine's hooks) leave the write to the flusher; ``force`` and :meth:`StatsFile.close` write on the caller's
thread. With ``snapshot_thread_safe`` (worker side) the flusher also takes snapshots itself. Why a flusher thread:
docs/developer-guide.md.
"""
from __future__ import annotations

import math
import json
import logging
import os
import threading
import time
from typing import Callable, Optional

from .thread_names import name_this_thread

logger = logging.getLogger("tierkv.metrics")


class StatsFile:
    """Writes ``snapshot()`` (a JSON-serialisable dict) to ``path_template`` expanded for this process.

    Args:
        path_template: file path, may hold ``{role}`` and ``{pid}``; None = write nothing.
        role: ``scheduler`` or ``worker`` (written into the file and the path).
        snapshot: returns the counters (called on the caller's thread, and on the flusher thread only when
            ``snapshot_thread_safe``).
        min_interval_s: seconds between two writes at most (bursts are coalesced, the last state is kept).
        snapshot_thread_safe: the flusher may call ``snapshot`` itself every ``min_interval_s``.
    """

    def __init__(self, path_template: Optional[str], role: str, snapshot: Callable[[], dict],
                 min_interval_s: float = 0.2, snapshot_thread_safe: bool = False):
        self.path = None
        if path_template:
            self.path = path_template.format(role=role, pid=os.getpid())
            d = os.path.dirname(self.path)
            if d:
                os.makedirs(d, exist_ok=True)
        self.role = role
        self.snapshot = snapshot
        self.min_interval_s = min_interval_s
        self.snapshot_thread_safe = snapshot_thread_safe
        self._last_t = -math.inf  # time.monotonic() of the last write; never written: the first is not held back
        self._last: Optional[str] = None
        self._pending: Optional[dict] = None
        self._lock = threading.Lock()       # guards _pending, _closed, _seq: held only for moments
        self._wake = threading.Condition(self._lock)
        self._io_lock = threading.Lock()    # one writer of the file at a time; never held with _lock wanted
        self._seq = 0                       # snapshots handed to a writer, in order
        self._written_seq = 0               # the newest of them written (an older one is never written after it)
        self._flusher: Optional[threading.Thread] = None
        self._closed = False
        self._urgent = False                # write_soon: the pending snapshot is written without the interval

    def maybe_write(self, force: bool = False, data: Optional[dict] = None) -> None:
        """Record the current counters. ``force``: written now, on the caller's thread. Otherwise the file is written
        by the flusher thread (at once if the last write is ``min_interval_s`` old, else when the interval ends), so
        a vLLM hook that calls this every step never serialises JSON or touches the file system: with
        ``snapshot_thread_safe`` not even the snapshot is taken here (the flusher takes its own every
        ``min_interval_s``), else the snapshot is taken here and handed over. ``data``: a snapshot the caller
        already took (a dict this object may keep), used instead of calling ``snapshot``."""
        if self.path is None:
            return
        if force:
            data = dict(self.snapshot()) if data is None else data
            with self._lock:
                self._pending = None
                seq = self._next_seq_locked()
            try:
                self._write(data, seq, force)
            except OSError as e:  # shutdown and atexit: a counters file that cannot be written never stops them
                logger.warning("tierkv: cannot write the counters file %s: %s", self.path, e)
            return
        if self.snapshot_thread_safe:
            if self._flusher is None:
                with self._lock:
                    self._start_flusher_locked()
            return
        self._hand_over(dict(self.snapshot()) if data is None else data, urgent=False)

    def write_soon(self) -> None:
        """Have the flusher write the current counters at once, whatever the interval. For the moments after which no
        step may come to write them: the engine just went idle, and vLLM's API server may stop it without running any
        shutdown hook. The snapshot is taken here (the caller's counters may not be safe
        to read from another thread); the JSON and the file system are the flusher's, so the hook that went idle (at
        concurrency 1 the end of every request) does not wait for them."""
        if self.path is None:
            return
        self._hand_over(dict(self.snapshot()), urgent=True)

    def close(self) -> None:
        """Write the last counters and stop the flusher (idempotent)."""
        if self.path is None:
            return
        self.maybe_write(force=True)
        with self._lock:
            self._closed = True
            self._wake.notify()

    # ------------------------------------------------------------------ internals
    def _hand_over(self, data: dict, urgent: bool) -> None:
        """Give the flusher ``data`` to write (``urgent``: without waiting for the interval). The flusher is woken
        only when it may be waiting without a deadline (nothing was pending) or for an urgent write: while a snapshot
        is pending it already sleeps until the interval ends and then writes the newest one, so a hook that hands one
        over every step does not wake a thread (and hand it the GIL) every step."""
        with self._lock:
            idle = self._pending is None
            self._pending = data
            self._urgent = self._urgent or urgent
            self._start_flusher_locked()
            if idle or urgent:
                self._wake.notify()

    def _next_seq_locked(self) -> int:
        self._seq += 1
        return self._seq

    def _write(self, data: dict, seq: int, force: bool = False) -> None:
        """Serialise and write ``data`` (snapshot number ``seq``) unless a newer snapshot was written already.
        Called without ``_lock``: a hook's :meth:`maybe_write` never waits for the JSON and the file system, only
        for another writer's brief hand-over."""
        with self._io_lock:
            if seq < self._written_seq:
                return
            data["role"] = self.role
            data["pid"] = os.getpid()
            text = json.dumps(data, sort_keys=True)
            self._last_t = time.monotonic()
            self._written_seq = seq
            if text == self._last and not force:
                return
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
            self._last = text

    def _start_flusher_locked(self) -> None:
        if self._flusher is None:
            self._flusher = threading.Thread(target=self._flush_loop, name=f"tierkv-stats-{self.role}", daemon=True)
            self._flusher.start()

    def _flush_loop(self) -> None:
        name_this_thread()
        with self._lock:
            while not self._closed:
                if self._pending is None and not self.snapshot_thread_safe:
                    self._wake.wait()
                    continue
                left = 0.0 if self._urgent else self._last_t + self.min_interval_s - time.monotonic()
                if left > 0:
                    self._wake.wait(left)
                    continue
                data = self._pending
                self._pending = None
                self._urgent = False
                seq = self._next_seq_locked()
                self._lock.release()  # the snapshot, JSON and file writes run without it: hooks never wait on them
                try:
                    if data is None:  # thread-safe snapshots: poll the counters (written only if they changed)
                        data = dict(self.snapshot())
                    self._write(data, seq)
                except Exception:  # pragma: no cover - directory gone (tests' tmp dirs) or a snapshot racing
                    self._last_t = time.monotonic()  # shutdown: keep serving, try again after the interval
                finally:
                    self._lock.acquire()

    def start_polling(self) -> None:
        """Start the flusher now (``snapshot_thread_safe`` files: counters moved between steps get written)."""
        if self.path is None or not self.snapshot_thread_safe:
            return
        with self._lock:
            self._start_flusher_locked()
