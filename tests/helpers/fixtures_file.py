"""Contract-suite fixture for the file store (see conftest.py for the convention every backend follows)."""
from __future__ import annotations

import contextlib
import functools
import os
from typing import Any, Callable, Optional

from tierkv.storage_backends.file.store import FileStore, FileStoreConfig
from tierkv.storage_backends.page_format import HEADER_BYTES, encode_header

NAME = "file"


class FileHandle:
    """Handle on one file store directory: ``backend`` (a FileStore), more clients, restart (re-open the
    directory), corruption of a stored record. No server process, so no stop/cont."""

    name = NAME
    supports_stop = False
    persistent = True  # pages survive restart()

    def __init__(self, root: str, page_bytes: int, namespace: bytes, capacity_pages: Optional[int] = None,
                 **opts: Any):
        self.root = root
        self.page_bytes = page_bytes
        self.namespace = namespace
        self.capacity_pages = capacity_pages
        # options of other backends (timeout_s, token...) mean nothing here: keep only l3.file keys
        self._cfg = {k: v for k, v in opts.items() if k in FileStoreConfig.model_fields and k != "root"}
        if capacity_pages is not None:
            self._cfg["capacity_bytes"] = capacity_pages * (HEADER_BYTES + page_bytes)
        self._clients: list[FileStore] = []
        self.backend = self._open(namespace)

    def _open(self, namespace: bytes) -> FileStore:
        s = FileStore(namespace, self.page_bytes, root=self.root, **self._cfg)
        self._clients.append(s)
        return s

    def new_client(self, namespace: Optional[bytes] = None) -> FileStore:
        return self._open(namespace or self.namespace)

    def client_factory(self, namespace: Optional[bytes] = None) -> Callable[[], FileStore]:
        """A picklable zero-argument callable that opens another client (for spawned processes)."""
        return functools.partial(FileStore, namespace or self.namespace, self.page_bytes, root=self.root,
                                 **self._cfg)

    def restart(self) -> FileStore:
        self.backend.close()
        self.backend = self._open(self.namespace)
        return self.backend

    def stop(self) -> None:
        raise NotImplementedError("file store has no server process")

    cont = stop

    def path(self, key: str, namespace: Optional[bytes] = None) -> str:
        return os.path.join(self.root, (namespace or self.namespace).hex(), key[:2], key + ".page")

    def corrupt(self, key: str, how: str, namespace: Optional[bytes] = None) -> bool:
        """Damage the stored record of ``key``: ``truncate`` (to half), ``flip`` (one payload byte),
        ``foreign_namespace`` (a valid header of another namespace). False if there is no such record."""
        p = self.path(key, namespace)
        if not os.path.exists(p):
            return False
        if how == "truncate":
            os.truncate(p, os.path.getsize(p) // 2)
        elif how == "flip":
            with open(p, "r+b") as f:
                off = HEADER_BYTES + self.page_bytes // 2
                f.seek(off)
                b = f.read(1)
                f.seek(off)
                f.write(bytes([b[0] ^ 0x01]))
        elif how == "foreign_namespace":
            with open(p, "r+b") as f:
                payload = f.read()[HEADER_BYTES:]
                other = bytes(b ^ 0xFF for b in (namespace or self.namespace))
                f.seek(0)
                f.write(encode_header(key, other, payload))
        else:
            raise ValueError(f"unknown corruption {how!r}")
        return True

    def close(self) -> None:
        for c in self._clients:
            c.close()


@contextlib.contextmanager
def make_backend(tmp_path, page_bytes: int, namespace: bytes, **opts: Any):
    """Yield a :class:`FileHandle` on a fresh directory under ``tmp_path``. Options: ``capacity_pages`` and any
    ``l3.file`` key (``fsync``, ``quarantine``...)."""
    h = FileHandle(str(tmp_path / "l3"), page_bytes, namespace, **opts)
    try:
        yield h
    finally:
        h.close()


__all__ = ["make_backend", "FileHandle"]


def crash_during_write(root: str, namespace: bytes, page_bytes: int, capacity_bytes: int,
                       keys: list, payloads: list, last_key: str, started) -> None:
    """Spawned child for the torn-file restart test: store ``keys`` through a FileStore, then start writing ``last_key``
    through the store's own write path, stop after half the payload (signalling ``started``) and wait to be
    SIGKILLed, leaving a real torn temporary file behind."""
    import threading

    import tierkv.storage_backends.file.store as file_mod

    store = FileStore(namespace, page_bytes, root=root, capacity_bytes=capacity_bytes)
    assert store.batch_set(keys, payloads) == [True] * len(keys)
    real_writev = os.writev

    def torn_writev(fd, bufs):
        head, payload = bufs[0], memoryview(bufs[1])
        n = real_writev(fd, [head, payload[: len(payload) // 2]])
        started.set()
        threading.Event().wait()  # until killed
        return n

    file_mod.os.writev = torn_writev
    store.batch_set([last_key], [payloads[0]])
