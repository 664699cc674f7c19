"""Contract-suite fixture for the ``redis`` store in cluster mode on a REAL Redis Cluster: 3 masters with one replica
each (``redis-server`` processes on loopback, formed by ``redis-cli --cluster create``; convention: see
``conftest.py``).

The cluster (about 2 s to form) is shared by the handles of a test session, each in a key space of its own (a unique
``key_prefix``); ``restart`` kills every node with SIGKILL and starts them again on the same ports with their
``nodes.conf`` (the same topology, no data); ``stop`` / ``cont`` SIGSTOP / SIGCONT every node. ``h.corrupt`` as in
``_fixtures_redis``, through a redis-py cluster client.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import itertools
import os
import tempfile
from typing import Any, Optional

from redis.cluster import ClusterNode, RedisCluster

from tests.helpers.fixtures_redis import CLIENT_KEYS, corrupt_value
from tests.helpers.redis_servers import RedisClusterServers
from tierkv.storage_backends.redis import RedisStore

NAME = "redis_cluster"
DEFAULT_TIMEOUT_S = 3.0
_LABELS = itertools.count()
_SHARED: list[RedisClusterServers] = []


def shared_cluster() -> RedisClusterServers:
    """The session's cluster (formed on first use; formed again if a test left a node dead)."""
    if _SHARED and all(s.proc is not None and s.proc.poll() is None for s in _SHARED[0].servers):
        return _SHARED[0]
    if _SHARED:
        _SHARED.pop().close()
    _SHARED.append(RedisClusterServers(tempfile.mkdtemp(prefix="tierkv-redis-cluster-")))
    return _SHARED[0]


atexit.register(lambda: [c.close() for c in _SHARED])


class RedisClusterHandle:
    """Stores on the shared cluster (see ``conftest.py`` for the attributes)."""

    name = NAME
    supports_stop = True
    persistent = False
    capacity_pages = None

    def __init__(self, tmp_path, page_bytes: int, namespace: bytes, **opts: Any):
        self.page_bytes = page_bytes
        self.namespace = namespace
        self.cluster = shared_cluster()
        self._opts = {k: v for k, v in opts.items() if k in CLIENT_KEYS}
        self._opts.setdefault("timeout_s", DEFAULT_TIMEOUT_S)
        self._opts.setdefault("key_prefix", f"c{os.getpid()}x{next(_LABELS)}")
        self._clients: list[RedisStore] = []
        self.backend = self.new_client()

    def options(self, **overrides: Any) -> dict:
        return {"mode": "cluster", "nodes": self.cluster.nodes[:2], **self._opts, **overrides}

    def new_client(self, namespace: Optional[bytes] = None, **overrides: Any) -> RedisStore:
        c = RedisStore(namespace or self.namespace, self.page_bytes, **self.options(**overrides))
        self._clients.append(c)
        return c

    def client_factory(self, namespace: Optional[bytes] = None):
        return functools.partial(RedisStore, namespace or self.namespace, self.page_bytes, **self.options())

    def raw(self) -> RedisCluster:
        s = self.cluster.servers[0]
        return RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", s.port)], socket_timeout=5)

    def name_of(self, key: str, namespace: Optional[bytes] = None) -> str:
        return f"{self._opts['key_prefix']}:{(namespace or self.namespace).hex()}:{key}"

    def restart(self) -> RedisStore:
        self.cluster.restart_all()
        return self.backend

    def stop(self) -> None:
        for s in self.cluster.servers:
            s.sigstop()

    def cont(self) -> None:
        for s in self.cluster.servers:
            s.sigcont()

    def corrupt(self, key: str, how: str, namespace: Optional[bytes] = None) -> bool:
        with contextlib.closing(self.raw()) as raw:
            return corrupt_value(raw, self.name_of(key, namespace), how, self.page_bytes, key)

    def close(self) -> None:
        for c in self._clients:
            c.close()
        self.cont()  # a test that stopped the shared cluster leaves it running


@contextlib.contextmanager
def make_backend(tmp_path, page_bytes: int, namespace: bytes, **opts: Any):
    """Yield a :class:`RedisClusterHandle`: a ``redis`` store in cluster mode on the session's cluster."""
    h = RedisClusterHandle(tmp_path, page_bytes, namespace, **opts)
    try:
        yield h
    finally:
        h.close()


__all__ = ["make_backend", "RedisClusterHandle", "shared_cluster"]
