"""Contract-suite fixture for the ``redis`` store on a REAL ``redis-server`` (Redis 7, standalone; convention: see
``conftest.py``).

Each handle starts its own server on a free loopback port (about 10 ms; persistence off, so ``restart`` brings back an
empty server) and stops it by PID on exit. ``h.corrupt`` rewrites the stored value through a plain redis-py client, as
another client of the same server could: ``truncate`` (half the payload), ``flip`` (one payload byte, SETRANGE) or
``foreign_namespace`` (a valid header of another namespace). Options: ``password``, ``server_args`` (extra
``redis-server`` flags such as ``("--maxmemory", "1mb")``), client keys of ``l3.redis`` (``timeout_s``, ``ttl_s``,
``pool_size``, ...); ``capacity_pages`` is ignored (Redis evicts by its own approximate LRU: not exact).
"""
from __future__ import annotations

import contextlib
import functools
import itertools
import os
from typing import Any, Optional

from tests.helpers.redis_servers import RedisServer
from tierkv.storage_backends.page_format import HEADER_BYTES, encode_header
from tierkv.storage_backends.redis import RedisStore, RedisStoreConfig

NAME = "redis"
DEFAULT_TIMEOUT_S = 3.0
_LABELS = itertools.count()
CLIENT_KEYS = tuple(k for k in RedisStoreConfig.model_fields if k not in ("mode", "url", "nodes"))


def corrupt_value(raw, name: str, how: str, page_bytes: int, key: str) -> bool:
    """Damage the value ``name`` through the plain client ``raw`` (see the module docstring)."""
    v = raw.get(name)
    if v is None:
        return False
    if how == "truncate":
        raw.set(name, v[:HEADER_BYTES + page_bytes // 2])
    elif how == "flip":
        raw.setrange(name, HEADER_BYTES + 7, bytes([v[HEADER_BYTES + 7] ^ 0xFF]))
    elif how == "foreign_namespace":
        payload = v[HEADER_BYTES:]
        raw.set(name, encode_header(key, bytes(16), payload) + payload)
    else:
        raise ValueError(how)
    return True


class RedisHandle:
    """A ``redis-server`` subprocess plus ``redis`` stores on it (see ``conftest.py`` for the attributes)."""

    name = NAME
    supports_stop = True
    persistent = False
    capacity_pages = None

    def __init__(self, tmp_path, page_bytes: int, namespace: bytes, password: Optional[str] = None,
                 server_args: tuple = (), **opts: Any):
        self.page_bytes = page_bytes
        self.namespace = namespace
        self.server = RedisServer(os.path.join(str(tmp_path), "redis"), password=password, args=server_args)
        self._opts = {k: v for k, v in opts.items() if k in CLIENT_KEYS}
        self._opts.setdefault("timeout_s", DEFAULT_TIMEOUT_S)
        self._opts.setdefault("key_prefix", f"t{os.getpid()}x{next(_LABELS)}")
        if password:
            self._opts["password"] = password
        self._clients: list[RedisStore] = []
        self.backend = self.new_client()

    def options(self, **overrides: Any) -> dict:
        return {"url": self.server.url, **self._opts, **overrides}

    def new_client(self, namespace: Optional[bytes] = None, **overrides: Any) -> RedisStore:
        c = RedisStore(namespace or self.namespace, self.page_bytes, **self.options(**overrides))
        self._clients.append(c)
        return c

    def client_factory(self, namespace: Optional[bytes] = None):
        return functools.partial(RedisStore, namespace or self.namespace, self.page_bytes, **self.options())

    def raw(self):
        return self.server.client()

    def name_of(self, key: str, namespace: Optional[bytes] = None) -> str:
        return f"{self._opts['key_prefix']}:{(namespace or self.namespace).hex()}:{key}"

    def restart(self) -> RedisStore:
        self.server.kill9()
        self.server.start()
        return self.backend

    def stop(self) -> None:
        self.server.sigstop()

    def cont(self) -> None:
        self.server.sigcont()

    def corrupt(self, key: str, how: str, namespace: Optional[bytes] = None) -> bool:
        with contextlib.closing(self.raw()) as raw:
            return corrupt_value(raw, self.name_of(key, namespace), how, self.page_bytes, key)

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self.server.close()


@contextlib.contextmanager
def make_backend(tmp_path, page_bytes: int, namespace: bytes, **opts: Any):
    """Yield a :class:`RedisHandle`: a real ``redis-server`` on loopback and a ``redis`` store on it."""
    h = RedisHandle(tmp_path, page_bytes, namespace, **opts)
    try:
        yield h
    finally:
        h.close()


__all__ = ["make_backend", "RedisHandle", "corrupt_value"]
