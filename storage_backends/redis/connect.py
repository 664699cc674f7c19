"""Clients and transports of the ``redis`` store: one pipelined round trip per batch, standalone or cluster.

A transport's ``run(cmds)`` sends ``cmds`` (tuples of Redis command arguments, the key second) and returns one result
per command, an exception object where that command failed; it raises only for a caller bug. ``standalone``: one
pipeline (``transaction=False``) on a blocking connection pool of ``pool_size``. ``cluster``: the commands grouped by
the node that owns their key's slot, one pipeline per node, the nodes' pipelines sent in parallel threads; a command
answered ``MOVED``/``ASK`` (a slot migrating, a failover) is counted and re-sent once through the cluster client,
which follows the redirect; a node that fails makes its commands fail (misses) and refreshes the slot map.
:func:`startup_error` turns what the server says at start-up into a :class:`ConfigError` naming the key.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Optional, Sequence

import redis
from redis.backoff import NoBackoff
from redis.cluster import ClusterNode, RedisCluster
from redis.exceptions import (AskError, AuthenticationError, AuthenticationWrongNumberOfArgsError, MovedError,
                              RedisClusterException, RedisError, ResponseError)
from redis.retry import Retry

from tierkv.storage_backends.common import ConfigError
from tierkv.storage_backends.redis.config import RedisStoreConfig, parse_node

log = logging.getLogger("tierkv.redis")


class ServerRefusedConfig(ConfigError):
    """The server answered and refused this configuration (wrong or missing password, a cluster node given as a
    standalone server or the reverse, a failed TLS handshake): unlike an unreachable server, waiting does not help, so
    the engine stops at start-up instead of serving without L3 (``stops_startup``)."""

    stops_startup = True


class NotStandalone(RedisError):
    """The server named by ``l3.redis.url`` is a cluster node (it would answer MOVED for most keys)."""


def _common_kwargs(cfg: RedisStoreConfig) -> dict:
    kw: dict[str, Any] = {"username": cfg.username, "password": cfg.password, "socket_timeout": cfg.timeout_s,
                          "socket_connect_timeout": cfg.timeout_s, "retry": Retry(NoBackoff(), 0)}
    if cfg.use_tls:
        kw.update(ssl=True, ssl_ca_certs=cfg.tls_ca_file, ssl_certfile=cfg.tls_cert_file,
                  ssl_keyfile=cfg.tls_key_file, ssl_check_hostname=cfg.tls_check_hostname)
    return kw


def standalone_client(cfg: RedisStoreConfig) -> redis.Redis:
    """A client on ``cfg.url`` with a blocking pool of ``pool_size`` connections (a call waits up to ``timeout_s``
    for a free one). Connects lazily: building it does no I/O."""
    kw = _common_kwargs(cfg)
    if cfg.use_tls and cfg.url.startswith("redis://"):
        url = "rediss://" + cfg.url[len("redis://"):]
    else:
        url = cfg.url
        if not cfg.use_tls:
            kw = {k: v for k, v in kw.items() if not k.startswith("ssl")}
    kw.pop("ssl", None)  # the rediss:// scheme selects the TLS connection class
    pool = redis.BlockingConnectionPool.from_url(url, max_connections=cfg.pool_size, timeout=cfg.timeout_s,
                                                 **{k: v for k, v in kw.items() if k != "retry"})
    return redis.Redis(connection_pool=pool, retry=kw["retry"])


def cluster_client(cfg: RedisStoreConfig) -> RedisCluster:
    """A cluster client seeded with ``cfg.nodes`` (reads the slot map now: raises RedisError / RedisClusterException
    when no seed answers or a seed is not in cluster mode)."""
    nodes = [ClusterNode(*parse_node(n)) for n in cfg.nodes]
    kw = _common_kwargs(cfg)
    kw["retry"] = Retry(NoBackoff(), 1)
    return RedisCluster(startup_nodes=nodes, require_full_coverage=False, max_connections=cfg.pool_size, **kw)


def startup_error(err: BaseException, cfg: RedisStoreConfig) -> Optional[ConfigError]:
    """The :class:`ConfigError` (naming the key) that ``err``, raised by the first exchange with the server, means;
    None for a fault of the moment (unreachable, timed out): the store then serves misses and retries."""
    text = str(err)
    key = f"l3.redis.{'nodes' if cfg.mode == 'cluster' else 'url'}"
    where = f"{', '.join(cfg.nodes) if cfg.mode == 'cluster' else cfg.url} ({key})"
    if isinstance(err, (AuthenticationError, AuthenticationWrongNumberOfArgsError)) or "NOAUTH" in text \
            or "WRONGPASS" in text or "invalid password" in text or "invalid username-password" in text:
        what = "is missing (the server needs AUTH)" if cfg.password is None else "or l3.redis.username is wrong"
        return ServerRefusedConfig(f"invalid tierkv config: l3.redis.password {what}: the server at {where} said: {text}")
    if "cluster support disabled" in text or "Cluster mode is not enabled" in text:
        return ServerRefusedConfig(f"invalid tierkv config: l3.redis.nodes names a server that is not in cluster mode "
                           f"({', '.join(cfg.nodes)}): use mode 'standalone' and l3.redis.url, or cluster seed nodes")
    if isinstance(err, NotStandalone):
        return ServerRefusedConfig("invalid tierkv config: l3.redis.url names a cluster node: use mode 'cluster' and "
                           "l3.redis.nodes")
    if isinstance(err, ResponseError) and "DB index is out of range" in text:
        return ServerRefusedConfig(f"invalid tierkv config: bad value for 'l3.redis.url': {text}")
    if "SSL" in type(err).__name__ or "certificate" in text or "wrong version number" in text:
        return ServerRefusedConfig(f"invalid tierkv config: TLS to {where} failed (l3.redis.tls*): {text}")
    if isinstance(err, FileNotFoundError) or (isinstance(err, RedisClusterException)
                                               and "Redis Cluster cannot be connected" not in text):
        return ServerRefusedConfig(f"invalid tierkv config: {key}: {text}")
    return None


class StandaloneTransport:
    """One pipeline per batch on one server."""

    def __init__(self, cfg: RedisStoreConfig):
        self.client = standalone_client(cfg)

    def probe(self) -> None:
        """One ``INFO cluster`` (raises what the server or the socket raises, or :class:`NotStandalone`)."""
        if self.client.info("cluster").get("cluster_enabled"):
            raise NotStandalone("l3.redis.url names a node of a Redis Cluster")

    def run(self, cmds: Sequence[tuple], counters: dict) -> list:
        pipe = self.client.pipeline(transaction=False)
        for c in cmds:
            pipe.execute_command(*c)
        try:
            return pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as e:
            return [e] * len(cmds)
        finally:
            pipe.reset()

    def get_many(self, names: Sequence[str]) -> list:
        """One ``MGET`` of ``names``: a value (bytes) or None per name (a key of another type reads as None), or the
        exception once per name when the call failed. One reply for the batch instead of one parsed per command."""
        try:
            return self.client.execute_command("MGET", *names)
        except (RedisError, OSError) as e:
            return [e] * len(names)

    def raw(self) -> redis.Redis:
        return self.client

    def close(self) -> None:
        self.client.close()
        self.client.connection_pool.disconnect()


class ClusterTransport:
    """Per-node pipelines sent in parallel; redirects re-sent through the cluster client (module docstring)."""

    def __init__(self, cfg: RedisStoreConfig):
        self.client = cluster_client(cfg)
        self._pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="tierkv-redis-node")
        self._refresh_lock = threading.Lock()

    def probe(self) -> None:
        for node in self.client.get_primaries():
            self.client.get_redis_connection(node).ping()

    def _node_run(self, node: ClusterNode, idx: list[int], cmds: Sequence[tuple]) -> list:
        pipe = self.client.get_redis_connection(node).pipeline(transaction=False)
        for i in idx:
            pipe.execute_command(*cmds[i])
        try:
            return pipe.execute(raise_on_error=False)
        except (RedisError, OSError) as e:
            return [e] * len(idx)
        finally:
            pipe.reset()

    def refresh(self, wait: bool = False) -> None:
        """Re-read the slot map (after a failed node or a redirect) in a pool thread, so a batch never waits for the
        seeds' timeouts (``wait``: in this thread); one refresh at a time, never raises."""
        if not self._refresh_lock.acquire(blocking=False):
            return  # another thread is at it

        def run():
            try:
                self.client.nodes_manager.initialize()
            except (RedisError, OSError) as e:
                log.debug("redis cluster: slot map refresh failed: %s", e)
            finally:
                self._refresh_lock.release()

        if wait:
            run()
        else:
            try:
                self._pool.submit(run)
            except RuntimeError:  # pool shut down (closing)
                self._refresh_lock.release()

    def run(self, cmds: Sequence[tuple], counters: dict) -> list:
        groups: dict[str, tuple[ClusterNode, list[int]]] = {}
        out: list = [None] * len(cmds)
        for i, c in enumerate(cmds):
            try:
                node = self.client.get_node_from_key(c[1])
            except (RedisError, OSError) as e:  # a slot no node serves (its master is down, no replica took over)
                out[i] = e
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)
        parts = list(groups.values())
        if len(parts) == 1:
            results = [self._node_run(parts[0][0], parts[0][1], cmds)]
        else:
            results = list(self._pool.map(lambda p: self._node_run(p[0], p[1], cmds), parts))
        redirected, failed_node = [], False
        for (_node, idx), res in zip(parts, results):
            for i, r in zip(idx, res):
                out[i] = r
                if isinstance(r, (MovedError, AskError)):
                    redirected.append(i)
                elif isinstance(r, (redis.ConnectionError, redis.TimeoutError, OSError)):
                    failed_node = True
        if failed_node:
            counters["node_failures"] += 1
            self.refresh()
        if redirected:
            counters["redirects"] += len(redirected)
            if any(isinstance(out[i], MovedError) for i in redirected):
                self.refresh(wait=True)
            for i in redirected:  # the slow path: one command at a time, the client follows MOVED / ASK
                try:
                    out[i] = self.client.execute_command(*cmds[i])
                except (RedisError, OSError) as e:
                    out[i] = e
        return out

    def raw(self) -> RedisCluster:
        return self.client

    def close(self) -> None:
        self._pool.shutdown(wait=False)
        self.client.close()


def make_transport(cfg: RedisStoreConfig):
    """The transport of ``cfg.mode`` (cluster: reads the slot map, so it may raise like :func:`cluster_client`)."""
    return ClusterTransport(cfg) if cfg.mode == "cluster" else StandaloneTransport(cfg)
