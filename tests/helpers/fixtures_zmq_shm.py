"""Contract-suite fixture: the ZMQ cache server with the client's shared-memory data path on (``shm="on"``).

The same server subprocess as ``fixtures_zmq.py``; every client made here moves pages through its own
``/dev/shm`` segment (a small one, ``SHM_BYTES``, so batches of the suite also take several rounds), and the
handle checks on close that pages really went that way (in this process; the clients of the multi-process case
each make and attach a segment of their own).
"""
from __future__ import annotations

import contextlib
from typing import Any


def _base():
    from tests.helpers import fixtures_zmq
    return fixtures_zmq


NAME = "zmq_shm"
#: segment of each client: 8 pages of 256 KiB (the suite's largest page), so bigger batches take several rounds.
SHM_BYTES = 8 * 256 * 1024


class ZmqShmHandle(_base().ZmqHandle):
    name = NAME

    def close(self) -> None:
        moved = sum(c.counters["shm_pages_in"] + c.counters["shm_pages_out"] for c in self._clients)
        used_frames = [c for c in self._clients if c.counters["shm_fallbacks"]]
        super().close()
        assert not used_frames, "a zmq_shm client fell back to frames"
        assert moved or not any(c.counters["sets"] for c in self._clients), "no page went through shared memory"


@contextlib.contextmanager
def make_backend(tmp_path, page_bytes: int, namespace: bytes, **opts: Any):
    """Like ``_fixtures_zmq.make_backend`` with ``shm="on"`` and ``shm_bytes`` = max(:data:`SHM_BYTES`, one page)."""
    opts.setdefault("shm", "on")
    opts.setdefault("shm_bytes", max(SHM_BYTES, page_bytes))
    h = ZmqShmHandle(tmp_path, page_bytes, namespace, **opts)
    try:
        yield h
    finally:
        h.close()
