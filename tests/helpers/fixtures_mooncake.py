"""Contract-suite fixture for the Mooncake store (convention: see ``conftest.py``).

``make_backend`` starts a real ``mooncake_master`` (HTTP metadata server enabled) on free loopback ports through
:class:`mooncake_master.MooncakeMaster`, connects a :class:`~tierkv.storage_backends.mooncake.store.MooncakeStore` that
contributes the store's memory (``global_segment_size``), and stops the master by PID on exit. Further clients
(``new_client``, ``client_factory``) live in the same process or in spawned ones and contribute no memory, so their
pages sit in the first client's segment and outlive them. Several ``MooncakeDistributedStore`` clients in one
process work (each has its own transfer engine port).
"""
from __future__ import annotations

import contextlib
import functools
import os
import time
from typing import Any, Callable, Optional

from tests.helpers.mooncake_master import MooncakeMaster  # noqa: E402

from tierkv.storage_backends.mooncake.store import MooncakeStore  # noqa: E402
from tierkv.storage_backends.page_format import HEADER_BYTES, encode_header  # noqa: E402

NAME = "mooncake"
#: per-call bound used by the fixture's clients unless ``timeout_s`` is given (generous: the machine is shared).
DEFAULT_TIMEOUT_S = 3.0
DEFAULT_SEGMENT = 64 << 20
#: how long restart() waits for every client to be served by the new master (reconnect + segment re-mount).
REJOIN_TIMEOUT_S = 60.0


class MooncakeHandle:
    """Handle on one master and its clients: ``backend`` (the client holding the segment), more clients,
    restart / SIGSTOP / SIGCONT of the master, corruption of a stored record through the raw client."""

    name = NAME
    supports_stop = True
    persistent = False       # a master restart forgets every object (old keys become misses)
    capacity_pages = None    # Mooncake evicts by its own watermark policy, not an exact LRU

    def __init__(self, tmp_path, page_bytes: int, namespace: bytes, master_args: tuple = (), **opts: Any):
        opts.pop("capacity_pages", None)
        self.page_bytes = page_bytes
        self.namespace = namespace
        self.master = MooncakeMaster(extra_args=master_args, log_dir=str(tmp_path))
        self.master.start()
        self._opts = dict(opts)
        self._opts.setdefault("timeout_s", DEFAULT_TIMEOUT_S)
        self._clients: list[MooncakeStore] = []
        self.backend = self._open(namespace, self._opts.pop("global_segment_size", DEFAULT_SEGMENT))

    def config(self, namespace: Optional[bytes] = None, global_segment_size: int = 0) -> dict:
        cfg = dict(self.master.client_config(), **self._opts)
        cfg["global_segment_size"] = global_segment_size
        return cfg

    def _open(self, namespace: bytes, global_segment_size: int = 0) -> MooncakeStore:
        s = MooncakeStore(namespace, self.page_bytes, **self.config(namespace, global_segment_size))
        self._clients.append(s)
        return s

    def new_client(self, namespace: Optional[bytes] = None, global_segment_size: int = 0) -> MooncakeStore:
        """Another client in this process (contributes ``global_segment_size`` bytes, default none)."""
        return self._open(namespace or self.namespace, global_segment_size)

    def client_factory(self, namespace: Optional[bytes] = None) -> Callable[[], MooncakeStore]:
        """A picklable zero-argument callable that connects another client (no memory) in a spawned process."""
        return functools.partial(MooncakeStore, namespace or self.namespace, self.page_bytes, **self.config())

    def wait_serving(self, clients=None, timeout_s: float = REJOIN_TIMEOUT_S) -> None:
        """Poll until each client can store and read back a probe object (after a master restart the clients
        reconnect and re-mount their segments on their own, within a few ping periods)."""
        deadline = time.monotonic() + timeout_s
        for i, c in enumerate(clients if clients is not None else self._clients):
            if c._closed:  # noqa: SLF001 - a client a test closed has nothing to rejoin
                continue
            probe = f"tierkv-probe/{os.getpid()}/{i}"
            while True:
                if c.client.upsert(probe, b"probe") == 0 and c.client.get(probe) == b"probe":
                    c.client.remove(probe, True)
                    break
                if time.monotonic() > deadline:
                    raise RuntimeError(f"client {i} not served by the restarted master within {timeout_s}s:\n"
                                       f"{self.master.log_tail()}")
                time.sleep(0.05)  # polling interval

    def restart(self) -> MooncakeStore:
        """Restart the master on the same ports and wait until every open client is served again. The client
        objects are kept (``backend`` is the same object)."""
        self.master.restart()
        self.wait_serving()
        return self.backend

    def stop(self) -> None:
        self.master.pause()

    def cont(self) -> None:
        self.master.resume()

    def corrupt(self, key: str, how: str, namespace: Optional[bytes] = None) -> bool:
        """Replace the stored record of ``key`` through the raw Mooncake client: ``truncate`` (half the record),
        ``flip`` (one payload byte), ``foreign_namespace`` (a valid header of another namespace). False if there is
        no such object."""
        ns = namespace or self.namespace
        raw = self.backend.client
        name = f"{self.backend.cfg.key_prefix}/{ns.hex()}/{key}"
        rec = raw.get(name)
        if not rec:
            return False
        if how == "truncate":
            new = rec[: len(rec) // 2]
        elif how == "flip":
            b = bytearray(rec)
            b[HEADER_BYTES + self.page_bytes // 2] ^= 0x01
            new = bytes(b)
        elif how == "foreign_namespace":
            other = bytes(x ^ 0xFF for x in ns)
            new = encode_header(key, other, rec[HEADER_BYTES:]) + rec[HEADER_BYTES:]
        else:
            raise ValueError(f"unknown corruption {how!r}")
        raw.remove(name, True)
        return raw.put(name, new) == 0

    def close(self) -> None:
        try:
            for c in reversed(self._clients):
                c.close()
        finally:
            self.master.stop()


@contextlib.contextmanager
def make_backend(tmp_path, page_bytes: int, namespace: bytes, **opts: Any):
    """Yield a :class:`MooncakeHandle` with a fresh master. Options: ``master_args`` (extra ``mooncake_master``
    flags), ``global_segment_size`` of the main client, and any ``l3.mooncake`` key (``timeout_s``...)."""
    h = MooncakeHandle(tmp_path, page_bytes, namespace, **opts)
    try:
        yield h
    finally:
        h.close()


__all__ = ["make_backend", "MooncakeHandle", "MooncakeMaster"]
