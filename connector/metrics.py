"""Counters export: a JSON file per process (``stats_path``), for tests, benchmarks and the demo.

``stats_path`` may contain ``{role}`` (``scheduler``/``worker``) and ``{pid}``; each process writes its own
file atomically (temporary name + rename) whenever its counters changed, at most every ``min_interval_s``
seconds, and once more at shutdown.
"""
from __future__ import annotations

import json
import os
import threading
import time
from typing import Callable, Optional


class StatsFile:
    """Writes ``snapshot()`` (a JSON-serialisable dict) to ``path_template`` expanded for this process."""

    def __init__(self, path_template: Optional[str], role: str, snapshot: Callable[[], dict],
                 min_interval_s: float = 0.2):
        self.path = None
        if path_template:
            self.path = path_template.format(role=role, pid=os.getpid())
            d = os.path.dirname(self.path)
            if d:
                os.makedirs(d, exist_ok=True)
        self.role = role
        self.snapshot = snapshot
        self.min_interval_s = min_interval_s
        self._last_t = 0.0
        self._last: Optional[str] = None
        self._lock = threading.Lock()

    def maybe_write(self, force: bool = False) -> None:
        if self.path is None:
            return
        now = time.monotonic()
        if not force and now - self._last_t < self.min_interval_s:
            return
        with self._lock:
            data = dict(self.snapshot())
            data["role"] = self.role
            data["pid"] = os.getpid()
            text = json.dumps(data, sort_keys=True)
            if text == self._last and not force:
                return
            tmp = f"{self.path}.tmp{os.getpid()}"
            with open(tmp, "w") as f:
                f.write(text)
            os.replace(tmp, self.path)
            self._last = text
            self._last_t = now
