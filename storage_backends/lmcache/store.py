"""L3 store on an LMCache multiprocess cache server (``python -m lmcache.v1.multiprocess.server``, LMCache >= 0.5.6).

tierkv uses a server many vLLM deployments already run, without importing LMCache: the client speaks its wire
protocol itself (:mod:`.wire`) and moves page bytes only through the server's shared-memory segment in ``/dev/shm``,
never LMCache's pickle path. A set reserves chunk slots (``prepare_store``), writes them and publishes them
(``commit_store``); a get is ``lookup``, ``wait_prefetch_status``, ``prepare_retrieve`` (read-locked slots) and
``commit_retrieve``; each operation runs in its own server session. Pages are named as chunks by :mod:`.chunk_keys`;
registration, refresh and recovery are :mod:`.session`'s, the options :mod:`.config`'s.

LMCache's ``model_name`` is ``<model_name>-tierkv-<namespace hex>``; each chunk slot holds tierkv's 64-byte page
header (:mod:`.page_format`) before the payload, checked on every read: a slot that does not verify is a miss.
Faults (a dead, stopped or restarted server, a rejected request, a vanished segment) become misses / ``False`` with a
counter and a rate-limited warning, never an exception or a hang longer than ``timeout_s`` per exchange. LMCache
keeps the first copy of a chunk (a later set still reports ``True``) and evicts by its own policy, not tierkv's LRU.
"""
from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from typing import Any, Optional, Sequence

from tierkv.storage_backends.base import Buffer, PageTokens, StorageBackend
from tierkv.storage_backends.common import ConfigError, Counters, RateLimitedLog, check_store_identity
from tierkv.storage_backends.lmcache.chunk_keys import KEY_SALT, MAX_TOKEN, KeyRange, page_ranges, range_key  # noqa: F401
from tierkv.storage_backends.lmcache.config import LMCacheStoreConfig, check_options
from tierkv.storage_backends.lmcache.server_info import server_info
from tierkv.storage_backends.lmcache.session import REFRESH_S, ServerSession  # noqa: F401
from tierkv.storage_backends.lmcache.wire import OPS, lm_calls as _lm_calls  # noqa: F401
from tierkv.storage_backends.shm_segment import Segment
from tierkv.storage_backends.zmq.channel import ChannelFailed, RequestChannel
from tierkv.storage_backends.page_format import (HEADER_BYTES, PageFormatError, check_checksums, copy_verified,
                                                 encode_headers)

log = logging.getLogger("tierkv.lmcache")

#: how many keys found corrupt are remembered (a set cannot replace them: it reports False for them)
BAD_KEYS_KEPT = 4096


class LMCacheStore(ServerSession, StorageBackend):
    """L3 store on an LMCache multiprocess cache server, data through its ``/dev/shm`` segment.

    Args:
        namespace: 16-byte namespace digest (``ModelNamespace.digest()``); part of LMCache's ``model_name`` and of
            every page header.
        page_bytes: bytes of one page payload (> 0). Each LMCache chunk slot holds ``64 + page_bytes`` bytes
            (registered as a ``uint8`` chunk of shape ``[2, 1, page_tokens, ceil((64 + page_bytes) / (2 *
            page_tokens))]``).
        endpoint, page_tokens, model_name, world_size, worker_id, timeout_s, reconnect_backoff_s, max_backoff_s,
            shm_dir: see :class:`LMCacheStoreConfig` (``l3.lmcache.*``).
    Raises:
        ConfigError: a bad option (naming ``l3.lmcache.<key>``), or a server that answers with another chunk size
            than ``page_tokens`` or without a shared-memory segment.
        TypeError: an unknown option.
        ValueError: bad ``namespace`` or ``page_bytes``.
    A server that does not answer at start-up is not an error: the store logs a warning, answers misses and checks
    the chunk size when the server first answers (a mismatch then disables the store, logged).
    """

    vectored_destinations = True  # a verified page is copied run by run from the server's shared-memory slot
    verified_checksums = True     # batch_get(checksums=) hands back the payload checksum each read was verified by

    def __init__(self, namespace: bytes, page_bytes: int, **options: Any):
        unknown = sorted(set(options) - set(LMCacheStoreConfig.model_fields))
        if unknown:
            raise TypeError(f"LMCacheStore got unknown option(s) {', '.join(unknown)}; allowed: "
                            f"{', '.join(LMCacheStoreConfig.model_fields)}")
        check_store_identity(namespace, page_bytes)
        self.cfg = check_options(options)
        self.namespace = bytes(namespace)
        self.page_bytes = page_bytes
        self.endpoint = self.cfg.endpoint
        self.page_tokens = self.cfg.page_tokens
        self.timeout_s = float(self.cfg.timeout_s)
        self.lm_model = f"{self.cfg.model_name}-tierkv-{self.namespace.hex()}"
        self.slot_bytes = HEADER_BYTES + page_bytes
        self._hidden = -(-self.slot_bytes // (2 * self.page_tokens))
        self._lock = threading.RLock()
        self._instance: Optional[int] = None
        self._registered_at = -math.inf
        self._checked = False       # the server's chunk size was compared with page_tokens
        self._refused: Optional[str] = None  # a permanent mismatch (chunk size, no shm): every call is a miss
        self._seg: Optional[Segment] = None  # the server's segment, mapped
        self._shm_view: Optional[memoryview] = None
        self._closed = False
        self._warn = RateLimitedLog(log)
        self._bad_keys: OrderedDict = OrderedDict()
        self.counters = Counters("requests", "already_present", "timeouts", "reconnects", "registrations",
                                 "fast_fails", "stale_replies", "bad_replies", "shm_lost", "refused")
        self._chan = RequestChannel(self.endpoint, timeout_s=self.timeout_s, backoff_s=self.cfg.reconnect_backoff_s,
                                    max_backoff_s=self.cfg.max_backoff_s, counters=self.counters, log=log,
                                    what="LMCache server", hwm=100000, monitor=True, on_fork=self._forked)
        with self._lock:
            try:
                self._ensure_ready()
            except ChannelFailed as e:
                self._failed(f"not reachable at start-up ({e})")
        if self._refused:
            msg = self._refused
            self.close()
            raise ConfigError(msg)

    # ------------------------------------------------------------------------------------------- keys
    def _key(self, g: KeyRange, worker: Optional[int]) -> dict:
        return range_key(g, self.lm_model, self.cfg.world_size, worker)

    def _groups(self, keys: Sequence[str], tokens: Optional[Sequence[PageTokens]]) -> list:
        """:func:`page_ranges` of this store's ``page_tokens``. Raises ValueError for bad tokens."""
        return page_ranges(keys, tokens, self.page_tokens)

    # ------------------------------------------------------------------------------------------- lookups
    def _lookup(self, groups: list) -> list:
        """Leading chunks present per group (prefetched into the server's L1 and read-locked). Raises ChannelFailed."""
        C = self.page_tokens
        res = self._calls([("lookup", self._key(g, None), 1) for g in groups])
        del res
        wait = max(0.05, 0.8 * self.timeout_s)
        counts = self._calls([("wait_prefetch_status", g.rid, wait) for g in groups])
        out = []
        for g, n in zip(groups, counts):
            pages = len(g.idx)
            if type(n) is not int or n < 0:
                out.append(0)
                continue
            # the server answers where the leading run of present chunks in [start, end) ends, in chunks from token
            # 0 (0 when the first chunk of the range is absent)
            out.append(max(0, min(pages, n - g.start // C)))
        return out

    def batch_exists(self, keys: Sequence[str], tokens: Optional[Sequence[PageTokens]] = None) -> int:
        """Number of leading ``keys`` present (0 on any failure). ``tokens``: see :class:`PageTokens`.
        Raises ValueError for bad keys or tokens."""
        self._keys(keys)
        if not keys:
            return 0
        groups = self._groups(keys, tokens)
        with self._lock:
            if not self._begin(len(groups)):
                return 0
            try:
                counts = self._lookup(groups)
                forget = [("free_lookup_locks", self._key(g, None), 1) for g in groups]
                self._calls([], forget + [("end_session", g.rid) for g in groups])
            except ChannelFailed as e:
                self._failed(str(e))
                return 0
            self._ok()
        lead = 0
        for g, n in zip(groups, counts):
            lead += n
            if n < len(g.idx):
                break
        return lead

    def batch_get(self, keys: Sequence[str], destinations: Sequence[Buffer],
                  tokens: Optional[Sequence[PageTokens]] = None, checksums: Optional[list] = None) -> list[bool]:
        """Fill ``destinations`` (writable ``page_bytes`` buffers, or lists or tuples of writable runs adding up to
        one: :attr:`vectored_destinations`) with the pages of ``keys``; one bool per key. A page is copied only after
        its header (namespace, key, length) and payload XXH3-64 verify; the destination of a miss is left untouched.
        ``tokens``: see :class:`PageTokens`. ``checksums``: a list of ``len(keys)`` filled with each hit's verified
        payload XXH3-64 and None for each miss (:attr:`verified_checksums`). Raises ValueError for bad keys, buffers
        or tokens (caller bugs)."""
        self._keys(keys)
        dsts = self._dest_views(keys, destinations)
        sums = self._checksums_out(checksums, len(keys))
        res = [False] * len(keys)
        if not keys:
            return res
        groups = self._groups(keys, tokens)
        with self._lock:
            if self._begin(len(groups)):
                try:
                    self._get(keys, groups, dsts, res, sums)
                    self._ok()
                except ChannelFailed as e:
                    self._failed(str(e))
        nh = sum(res)
        self.counters["hits"] += nh
        self.counters["misses"] += len(keys) - nh
        return res

    def _get(self, keys, groups, dsts, res, sums) -> None:
        C = self.page_tokens
        counts = self._lookup(groups)
        hit = [(g, n) for g, n in zip(groups, counts) if n > 0]
        ranges = []
        for g, n in hit:
            r = KeyRange(g.idx[:n], g.tokens, g.start, g.start + n * C, g.salt)
            r.rid = g.rid
            ranges.append(r)
        replies = self._calls([("prepare_retrieve", self._key(r, self.cfg.worker_id), self._instance)
                               for r in ranges])
        shm = self._shm_view
        try:
            for r, rep in zip(ranges, replies):
                slots = rep.get("context", {}).get("slots") if isinstance(rep, dict) and rep.get("success") else None
                if not isinstance(slots, list) or len(slots) != len(r.idx):
                    continue
                for i, slot in zip(r.idx, slots):
                    try:
                        off, length = slot["offset"], slot["length"]
                        if (type(off) is not int or type(length) is not int or length < self.slot_bytes
                                or off < 0 or off + length > len(shm)):
                            raise PageFormatError(f"slot {slot!r:.80} does not hold a page")
                        sums[i] = copy_verified(shm[off:off + HEADER_BYTES],
                                                shm[off + HEADER_BYTES:off + self.slot_bytes], dsts[i], keys[i],
                                                self.namespace, self.page_bytes)
                    except (PageFormatError, KeyError, TypeError) as e:
                        self.counters["corrupt"] += 1
                        self._bad_keys[keys[i]] = True
                        while len(self._bad_keys) > BAD_KEYS_KEPT:
                            self._bad_keys.popitem(last=False)
                        self._warn.warning("corrupt", "LMCache chunk for page %s is not a valid tierkv page (%s): "
                                           "miss", keys[i], e)
                        continue
                    res[i] = True
                    self.counters["bytes_read"] += self.page_bytes
        finally:
            forget = [("commit_retrieve", self._key(r, self.cfg.worker_id), self._instance) for r in ranges]
            self._calls([], forget + [("end_session", g.rid) for g in groups])

    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer], checksums: Optional[Sequence[int]] = None,
                  tokens: Optional[Sequence[PageTokens]] = None) -> list[bool]:
        """Store ``sources`` (``page_bytes`` buffers) under ``keys``; one bool per key (``True`` also for a page the
        server already holds: LMCache keeps the first copy of a chunk; ``False`` when that copy was found corrupt by
        this store, since it cannot be replaced). Each page is written as header + payload
        into the slot the server reserved in its shared memory, then published with ``commit_store``; a set that
        fails before the commit leaves nothing visible. ``checksums``, ``tokens``: see
        :meth:`StorageBackend.batch_set`. Raises ValueError for bad keys, buffers, checksums or tokens."""
        kraw = self._keys(keys)
        sums = check_checksums(checksums, len(keys))
        srcs = self._views(keys, sources, False, "sources")
        res = [False] * len(keys)
        if keys:
            groups = self._groups(keys, tokens)
            with self._lock:
                if self._begin(len(groups)):
                    try:
                        self._set(keys, kraw, srcs, sums, groups, res)
                        self._ok()
                    except ChannelFailed as e:
                        self._failed(str(e))
        ok = sum(res)
        self.counters["sets"] += ok
        self.counters["set_failures"] += len(keys) - ok
        return res

    def _set(self, keys, kraw, srcs, sums, groups, res) -> None:
        inst = self._instance
        replies = self._calls([("prepare_store", self._key(g, self.cfg.worker_id), inst) for g in groups])
        shm = self._shm_view
        commits, committed = [], []
        for g, rep in zip(groups, replies):
            ctx = rep.get("context") if isinstance(rep, dict) else None
            slots = ctx.get("slots") if isinstance(ctx, dict) else None
            idxs = ctx.get("chunk_indices") if isinstance(ctx, dict) else None
            if not isinstance(slots, list) or not isinstance(idxs, list) or len(slots) != len(idxs):
                self.counters["bad_replies"] += 1
                continue
            reserved = set()
            good = True
            for slot, ci in zip(slots, idxs):
                off, length = slot.get("offset"), slot.get("length")
                if (type(ci) is not int or not 0 <= ci < len(g.idx) or type(off) is not int or type(length) is not int
                        or length < self.slot_bytes or off < 0 or off + length > len(shm)):
                    good = False
                    break
                i = g.idx[ci]
                hdr = encode_headers([kraw[i]], self.namespace, [srcs[i]], self.page_bytes,
                                     None if sums is None else [sums[i]])[0]
                shm[off:off + HEADER_BYTES] = hdr
                shm[off + HEADER_BYTES:off + self.slot_bytes] = srcs[i]
                reserved.add(ci)
            if not good:  # still commit: the server releases what it reserved (a page with a bad slot is a miss)
                self.counters["bad_replies"] += 1
            if slots:  # nothing reserved (every chunk already held): nothing to commit
                commits.append(("commit_store", self._key(g, self.cfg.worker_id), inst, b""))
            committed.append((g, reserved, good, len(commits) - 1 if slots else None))
        done = self._calls(commits, [("end_session", g.rid) for g in groups])
        for (g, reserved, good, ci_commit), ok in ((c, True if c[3] is None else done[c[3]]) for c in committed):
            if ok is not True or not good:
                continue
            for ci, i in enumerate(g.idx):
                if ci in reserved:
                    res[i] = True
                    self.counters["bytes_written"] += self.page_bytes
                    self._bad_keys.pop(keys[i], None)
                else:  # the server holds this chunk already and keeps its copy
                    self.counters["already_present"] += 1
                    res[i] = keys[i] not in self._bad_keys  # a copy found corrupt stays a miss: say so

    # ------------------------------------------------------------------------------------------- misc
    def ping(self) -> bool:
        """True when the server answers within ``timeout_s``."""
        with self._lock:
            if self._closed:
                return False
            try:
                return self._calls([("noop",)])[0] == "OK"
            except ChannelFailed as e:
                self._failed(str(e))
                return False

    def clear(self) -> None:
        """Drop every chunk the LMCache server holds: **all models and users of that server**, not only this store's
        namespace (LMCache has no per-model clear). A failure is counted and logged, not raised."""
        with self._lock:
            if not self._begin(1):
                return
            try:
                self._calls([("clear", False)])
            except ChannelFailed as e:
                self._failed(str(e))

    def stats(self) -> dict:
        """Counters: requests, hits, misses, sets, set_failures, already_present (sets of chunks the server already
        held), corrupt (slots failing tierkv's header or checksum), errors, timeouts, reconnects (server connection
        dropped and came back), registrations, fast_fails (calls skipped during back-off), stale_replies,
        bad_replies, shm_lost, refused (calls of a store disabled by a chunk-size mismatch), bytes_read/bytes_written
        (payload bytes), evictions (always 0: LMCache does not report them); plus backend, endpoint, lm_model,
        page_tokens."""
        s = dict(self.counters)
        s.update(backend="lmcache", endpoint=self.endpoint, lm_model=self.lm_model, page_tokens=self.page_tokens,
                 connected=self._chan.connected, disabled=self._refused)
        return s

    def close(self) -> None:
        """Unregister from the server (best effort, bounded by ``timeout_s``), unmap the segment and close the
        socket. Idempotent; later calls return misses/False."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._instance is not None and self._chan.connected and not self._chan.fails and not self._refused:
                try:
                    self._calls([("unregister_kv_cache_engine_driven_context", self._instance)])
                except ChannelFailed:
                    pass
            self._chan.close()
            self._unmap_shm()

    def __repr__(self) -> str:
        return f"LMCacheStore({self.endpoint}, page_tokens={self.page_tokens}, model={self.lm_model})"


__all__ = ["LMCacheStore", "LMCacheStoreConfig", "check_options", "server_info", "OPS", "KEY_SALT"]
