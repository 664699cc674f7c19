"""L3 store on a Redis >= 7 or Valkey server or cluster (``l3.backend: redis``), through redis-py.

A page is one string value ``header || payload`` (:mod:`..page_format`: 64-byte header with namespace, key, length and
XXH3-64) under the key ``<key_prefix>:<namespace hex>:<page key>``; every read checks it, so a value of the wrong
length, a bad checksum or another namespace's header (planted by another client) is a miss and ``corrupt`` +1, never
data; a value of another type is a miss. A batch is one round trip (cluster: one per node, in parallel;
:mod:`.connect`): ``batch_get`` = one ``MGET`` (cluster: pipelined GETs, a multi-key command must stay in one slot),
``batch_set`` = pipelined SETs (``PX`` with ``ttl_s``; one MSET measured slower: benchmarks/README.md "Redis store"),
``batch_exists`` = STRLENs (no value moves; a key counts when its value has the length of a page). A key the server
evicted (``maxmemory`` with an LRU policy) or that expired is a miss. Faults never raise: a refused write (``OOM``
under ``noeviction``) is ``False``, ``refused`` +1 and one warning; an unreachable server gives misses, ``errors`` +1
and, after a failure, ``reconnect_backoff_s`` (doubling to ``max_backoff_s``) of calls answered at once without I/O
(``unavailable``). A server unreachable at start-up is one
warning (the store connects when it answers); a wrong or missing password, a non-cluster server named by
``l3.redis.nodes`` or a bad URL raise :class:`ConfigError` naming the key.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional, Sequence

from pydantic import ValidationError
from redis.exceptions import OutOfMemoryError

from tierkv.storage_backends.base import Buffer, PageTokens, StorageBackend
from tierkv.storage_backends.common import ConfigError, Counters, RateLimitedLog, check_store_identity, config_error
from tierkv.storage_backends.page_format import (HEADER_BYTES, PageFormatError, check_checksums, copy_verified,
                                                 encode_headers, payload_checksum)
from tierkv.storage_backends.redis.config import RedisStoreConfig
from tierkv.storage_backends.redis.connect import make_transport, startup_error

log = logging.getLogger("tierkv.redis")
#: counters of this store besides the common ones
OWN_COUNTERS = ("refused", "unavailable", "redirects", "node_failures", "connects")


def _is_conn_error(r: Any) -> bool:
    import redis

    return isinstance(r, (redis.ConnectionError, redis.TimeoutError, OSError))


class RedisStore(StorageBackend):
    """L3 store on a Redis >= 7 or Valkey server or cluster: one pipelined round trip per batch, pages verified.
    ``RedisStore(namespace, page_bytes, **l3.redis section)``; see the module docstring."""

    vectored_sources = True
    vectored_destinations = True
    verified_checksums = True

    def __init__(self, namespace: bytes, page_bytes: int, **section: Any):
        self.namespace = check_store_identity(namespace, page_bytes)
        self.page_bytes = page_bytes
        try:
            self.cfg = RedisStoreConfig.model_validate(section)
        except ValidationError as e:
            raise config_error(e, "l3.redis", RedisStoreConfig) from None
        self._prefix = f"{self.cfg.key_prefix}:{self.namespace.hex()}:"
        self._record_bytes = HEADER_BYTES + page_bytes
        self._ttl_ms = None if self.cfg.ttl_s is None else max(1, int(self.cfg.ttl_s * 1000))
        self._lock = threading.Lock()
        self._stats = Counters(*OWN_COUNTERS)
        self._warn = RateLimitedLog(log, every_s=30.0)
        self._transport = None
        self._down_until = 0.0
        self._backoff = self.cfg.reconnect_backoff_s
        self._refused_logged = False
        self._closed = False
        self._where = ", ".join(self.cfg.nodes) if self.cfg.mode == "cluster" else self.cfg.url
        try:
            self._connect(startup=True)
        except ConfigError:
            self.close()
            raise

    # ------------------------------------------------------------------ connection state

    def _connect(self, startup: bool = False) -> bool:
        """Build the transport if there is none yet and probe the server. Returns True when it answered."""
        try:
            if self._transport is None:
                self._transport = make_transport(self.cfg)
            self._transport.probe()
        except Exception as e:  # noqa: BLE001 - classified: a config error raises, anything else is a fault
            err = startup_error(e, self.cfg)
            if err is not None and startup:
                raise err from None
            self._failed(f"cannot reach {self._where}", e, warn=not startup)
            if startup:
                log.warning("redis L3: cannot reach %s at start-up (%s: %s); serving without L3 until it answers",
                            self._where, type(e).__name__, e)
            return False
        with self._lock:
            self._stats.add(connects=1)
        return True

    def _failed(self, what: str, err: BaseException, warn: bool = True) -> None:
        with self._lock:
            self._stats.add(errors=1)
            self._down_until = time.monotonic() + self._backoff
            self._backoff = min(max(self._backoff * 2, 0.001), self.cfg.max_backoff_s)
        if warn and self._stats["connects"]:  # never connected: the start-up warning said so already
            self._warn.warning("conn", "redis L3: %s (%s: %s); misses until it answers", what, type(err).__name__,
                               err)

    def _ready(self, n: int) -> bool:
        """False (and ``unavailable`` += n) while backing off after a failure; builds the transport if needed."""
        if self._closed:
            return False
        if time.monotonic() < self._down_until:
            with self._lock:
                self._stats.add(unavailable=n)
            return False
        if self._transport is None and not self._connect():
            with self._lock:
                self._stats.add(unavailable=n)
            return False
        return True

    def _run(self, cmds: list) -> Optional[list]:
        """Send ``cmds``; None when every command failed for the connection (counted, backoff started)."""
        return self._checked(self._transport.run(cmds, self._stats), cmds[0][0])

    def _get(self, keys: Sequence[str]) -> Optional[list]:
        """The values of ``keys``: one ``MGET`` on a standalone server, GETs in per-node pipelines on a cluster (an
        ``MGET`` there must stay within one slot); None as :meth:`_run`."""
        names = [self._name(k) for k in keys]
        get_many = getattr(self._transport, "get_many", None)
        if get_many is not None:
            return self._checked(get_many(names), "MGET")
        return self._run([("GET", n) for n in names])

    def _checked(self, res: list, what: str) -> Optional[list]:
        if res and all(_is_conn_error(r) for r in res):
            self._failed(f"{what} batch to {self._where} failed", res[0])
            return None
        with self._lock:
            self._backoff = self.cfg.reconnect_backoff_s
        return res

    def _name(self, key: str) -> str:
        return self._prefix + key

    # ------------------------------------------------------------------ the store interface

    def batch_exists(self, keys: Sequence[str], tokens: Optional[Sequence[PageTokens]] = None) -> int:
        self._keys(keys)
        if not keys or not self._ready(len(keys)):
            return 0
        res = self._run([("STRLEN", self._name(k)) for k in keys])
        n = 0
        for r in res or ():
            if r != self._record_bytes:  # absent (0), another length (not a page) or an error: the run ends
                break
            n += 1
        return n

    def batch_get(self, keys: Sequence[str], destinations: Sequence[Buffer],
                  tokens: Optional[Sequence[PageTokens]] = None, checksums: Optional[list] = None) -> list[bool]:
        self._keys(keys)
        dsts = self._dest_views(keys, destinations)
        sums = self._checksums_out(checksums, len(keys))
        out = [False] * len(keys)
        if not keys:
            return out
        if not self._ready(len(keys)):
            with self._lock:
                self._stats.add(misses=len(keys))
            return out
        res = self._get(keys) or [None] * len(keys)
        hits = misses = corrupt = errors = 0
        for i, (k, r) in enumerate(zip(keys, res)):
            if isinstance(r, (bytes, bytearray)):
                mv = memoryview(r)
                try:
                    if mv.nbytes != self._record_bytes:
                        raise PageFormatError(f"value of {mv.nbytes} bytes, expected {self._record_bytes}")
                    sums[i] = copy_verified(mv[:HEADER_BYTES], mv[HEADER_BYTES:], dsts[i], k, self.namespace,
                                            self.page_bytes)
                    out[i] = True
                    hits += 1
                    continue
                except PageFormatError as e:
                    corrupt += 1
                    self._warn.warning("corrupt", "redis L3: page %s is not a valid tierkv page (%s): a miss", k, e)
            elif isinstance(r, Exception):
                if "WRONGTYPE" in str(r):  # a value of another type under the key: not ours
                    corrupt += 1
                elif not _is_conn_error(r):
                    errors += 1
                    self._warn.warning("get", "redis L3: GET failed (%s: %s)", type(r).__name__, r)
            misses += 1
        with self._lock:
            self._stats.add(hits=hits, misses=misses, corrupt=corrupt, errors=errors,
                            bytes_read=hits * self.page_bytes)
        return out

    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer], checksums: Optional[Sequence[int]] = None,
                  tokens: Optional[Sequence[PageTokens]] = None) -> list[bool]:
        raw = self._keys(keys)
        srcs = self._source_views(keys, sources)
        given = check_checksums(checksums, len(keys))
        out = [False] * len(keys)
        if not keys:
            return out
        if not self._ready(len(keys)):
            with self._lock:
                self._stats.add(set_failures=len(keys))
            return out
        sums = given if given is not None else [payload_checksum(s) for s in srcs]
        headers = encode_headers(raw, self.namespace, srcs, self.page_bytes, sums)
        px = () if self._ttl_ms is None else ("PX", self._ttl_ms)
        cmds = [("SET", self._name(k), b"".join([h, *s]) if isinstance(s, list) else b"".join((h, s)), *px)
                for k, h, s in zip(keys, headers, srcs)]
        res = self._run(cmds) or [None] * len(keys)
        ok = refused = errors = 0
        for i, r in enumerate(res):
            if r is True or r == b"OK":
                out[i] = True
                ok += 1
            elif isinstance(r, OutOfMemoryError) or isinstance(r, Exception) and str(r).startswith("OOM"):
                refused += 1
            elif isinstance(r, Exception) and not _is_conn_error(r):
                errors += 1
                self._warn.warning("set", "redis L3: SET failed (%s: %s)", type(r).__name__, r)
        with self._lock:
            self._stats.add(sets=ok, set_failures=len(keys) - ok, refused=refused, errors=errors,
                            bytes_written=ok * self.page_bytes)
            first_refusal = refused and not self._refused_logged
            self._refused_logged = self._refused_logged or bool(refused)
        if first_refusal:
            log.warning("redis L3: the server at %s refuses writes (maxmemory reached under a noeviction policy): "
                        "pages are not stored, counted in 'refused'; serving goes on (logged once)", self._where)
        return out

    def clear(self) -> None:
        """Delete every page of this namespace under this key prefix (SCAN + UNLINK on every node)."""
        if not self._ready(1):
            return
        names = list(self._transport.raw().scan_iter(match=self._prefix + "*", count=1000))
        for i in range(0, len(names), 512):
            self._run([("UNLINK", n) for n in names[i:i + 512]])

    def stats(self) -> dict[str, Any]:
        with self._lock:
            st = dict(self._stats)
        st.update(backend="redis", mode=self.cfg.mode, target=self._where)
        return st

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        t, self._transport = self._transport, None
        if t is not None:
            t.close()
