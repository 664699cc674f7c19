"""The spill tier of ``tierkv server``: records evicted from memory, kept on disk in FileStores (``--spill-dir``).

Each tenant other than the default one spills under ``<spill dir>/tenants/<name>``
(:class:`tierkv.storage_backends.zmq.server.page_store.PageStore`); the default tenant's records stay at the root, where servers
without tenants always kept them.
"""
from __future__ import annotations

import logging
import os
import struct
from typing import Any, Optional

from tierkv.storage_backends.zmq import protocol as P

log = logging.getLogger("tierkv.zmq_server")


class SpillTier:
    """Evicted records on disk: one FileStore per (namespace, record length) (a FileStore has a fixed page size).

    A spilled record is ``u16 header length || page header || payload``, stored as one FileStore page of the
    client's namespace under ``root/<namespace hex>/rec-<length>``; stores found there are reopened at start.
    FileStore has no per-key delete, so a deleted spilled key is remembered in memory (a tombstone, dropped when
    the key is stored again) until the next restart or clear of its namespace."""

    def __init__(self, root: str, capacity_bytes: Optional[int] = None):
        from tierkv.storage_backends.file.store import FileStore  # lazy: spill is optional

        self._cls = FileStore
        self.root = root
        self.capacity_bytes = capacity_bytes
        os.makedirs(root, exist_ok=True)
        self.stores: dict[tuple[bytes, int], Any] = {}
        self.tombstones: set[tuple[bytes, str]] = set()
        for nsdir in sorted(os.listdir(root)):
            if not P.KEY_RE.match(nsdir):
                continue
            for name in sorted(os.listdir(os.path.join(root, nsdir))):
                if name.startswith("rec-") and name[4:].isdigit():
                    self._store(bytes.fromhex(nsdir), int(name[4:]))

    def _store(self, ns: bytes, length: int):
        st = self.stores.get((ns, length))
        if st is None:
            kw = {"capacity_bytes": self.capacity_bytes} if self.capacity_bytes else {}
            st = self._cls(ns, length, root=os.path.join(self.root, ns.hex(), f"rec-{length}"), **kw)
            self.stores[(ns, length)] = st
        return st

    def _of(self, ns: bytes):
        return [(length, st) for (n, length), st in self.stores.items() if n == ns]

    def put(self, ns: bytes, key: str, hdr: bytes, payload: Any) -> bool:
        if len(hdr) > P.MAX_RECORD_HEADER_BYTES:
            return False
        rec = struct.pack("<H", len(hdr)) + hdr + bytes(memoryview(payload))
        try:
            ok = bool(self._store(ns, len(rec)).batch_set([key], [rec])[0])
        except Exception as e:  # a failing disk never takes the server down
            log.warning("spill of %s failed: %s", key, e)
            return False
        if ok:
            self.tombstones.discard((ns, key))
        return ok

    def get(self, ns: bytes, key: str) -> Optional[tuple[bytes, bytes]]:
        if (ns, key) in self.tombstones:
            return None
        for length, st in self._of(ns):
            try:
                if st.batch_exists([key]) != 1:
                    continue
                buf = bytearray(length)
                if st.batch_get([key], [buf])[0]:
                    (hl,) = struct.unpack_from("<H", buf)
                    if 0 < hl <= P.MAX_RECORD_HEADER_BYTES and 2 + hl <= length:
                        return bytes(buf[2 : 2 + hl]), bytes(buf[2 + hl :])
            except Exception as e:
                log.warning("spill read of %s failed: %s", key, e)
        return None

    def exists(self, ns: bytes, key: str) -> bool:
        if (ns, key) in self.tombstones:
            return False
        for _length, st in self._of(ns):
            try:
                if st.batch_exists([key]) == 1:
                    return True
            except Exception as e:
                log.warning("spill lookup of %s failed: %s", key, e)
        return False

    def delete(self, ns: bytes, key: str) -> bool:
        if self.exists(ns, key):
            self.tombstones.add((ns, key))
            return True
        return False

    def records(self, ns: Optional[bytes], skip: Any = (), headers_only: bool = False):
        """Yield ``(ns, key, header, payload, written_at, "spill")`` for every spilled record (of ``ns`` if given),
        except tombstoned ones and keys in ``skip`` (a mapping of ``(ns, key)`` held in memory). ``headers_only``:
        ``payload`` is its length in bytes (an int) and only the start of each file is read."""
        from tierkv.storage_backends.file.store import iter_page_files, read_record_file
        from tierkv.storage_backends.page_format import HEADER_BYTES

        for (sns, length), st in list(self.stores.items()):
            if ns is not None and sns != ns:
                continue
            try:
                files = list(iter_page_files(st.root, [sns.hex()]))
            except OSError:
                continue
            for f in files:
                if (sns, f.key) in self.tombstones or (sns, f.key) in skip:
                    continue
                try:
                    if headers_only:
                        with open(f.path, "rb", buffering=0) as fh:
                            rec = fh.read(HEADER_BYTES + 2 + P.MAX_RECORD_HEADER_BYTES)[HEADER_BYTES:]
                    else:
                        _outer, rec = read_record_file(f.path)
                except OSError:
                    continue
                hl = struct.unpack_from("<H", rec)[0] if len(rec) >= 2 else 0
                hdr = rec[2:2 + hl]
                payload = max(f.size - HEADER_BYTES - 2 - hl, 0) if headers_only else rec[2 + hl:]
                yield sns, f.key, hdr, payload, f.mtime_ns / 1e9, "spill"

    def clear(self, ns: bytes) -> None:
        self.tombstones = {t for t in self.tombstones if t[0] != ns}
        for _length, st in self._of(ns):
            try:
                st.clear()
            except Exception as e:
                log.warning("spill clear failed: %s", e)

    def close(self) -> None:
        for st in self.stores.values():
            try:
                st.close()
            except Exception:
                pass
