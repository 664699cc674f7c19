"""Client of the tierkv ZMQ cache server (:mod:`.server`): an L3 :class:`StorageBackend`.

:class:`ZmqStore` is thread-safe (one request channel per store, under a lock). Every page travels as a 64-byte
:mod:`.page_format` header plus its payload: a raw frame sent zero-copy from the caller's buffer, or a slot of a
shared-memory segment on the server's host (:mod:`.shm_path`, ``l3.zmq.shm``). A page read is checked (header and
payload XXH3-64) before it counts as a hit, so a missing, corrupt, truncated or foreign page is a miss, never data.

A dead, stopped or unreachable server makes calls return misses/``False`` after ``timeout_s`` of silence, never
raise or hang; the socket is then replaced and consecutive failures back off (:mod:`.channel`, :mod:`.exchange`).
Batches over ``max_message_bytes`` or :data:`.protocol.MAX_KEYS` keys are split into pipelined messages; a set
hashes each payload unless given its checksums. On the server's host, existence is answered from its presence
table (:mod:`.presence_probe`) when it publishes one. Options: :mod:`.client_config`. Faults and the
shared-memory path in detail: docs/developer-guide.md, section "storage_backends/zmq/client.py".
"""
from __future__ import annotations

import logging
import math
import threading
from typing import Any, Callable, Optional, Sequence

from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.base import Buffer, PageTokens, StorageBackend
from tierkv.storage_backends.common import Counters, RateLimitedLog, check_store_identity
from tierkv.storage_backends.zmq.client_config import (  # noqa: F401 - also imported from here
    _MSG_SLACK, _PER_KEY_OVERHEAD, OPTION_DEFAULTS, SHM_MODES, ZmqStoreConfig, check_options, is_local_endpoint,
    shm_mode)
from tierkv.storage_backends.zmq import presence_probe
from tierkv.storage_backends.zmq.presence_probe import PRESENCE_RETRY_S  # noqa: F401 - also imported from here
from tierkv.storage_backends.zmq.presence_table import PresenceTable
from tierkv.storage_backends.shm_segment import Segment
from tierkv.storage_backends.zmq.channel import RequestChannel
from tierkv.storage_backends.zmq.exchange import exchange
from tierkv.storage_backends.zmq import shm_path
from tierkv.storage_backends.zmq.shm_path import SHM_MESSAGE_BYTES, _Segment, sweep_dead_segments  # noqa: F401
from tierkv.storage_backends.page_format import PageFormatError, check_checksums, copy_verified, encode_headers

log = logging.getLogger("tierkv.zmq_client")

#: payload bytes per ``set`` message when a batch is pipelined: the pages of the next message are checksummed
#: while ZMQ's I/O thread already transmits the previous one (measured on 2 cores, 64 x 256 KiB and 64 x 2 MiB).
#: A set given its checksums is not pipelined: its messages are only bounded by ``max_message_bytes`` (interleaved
#: A/B, 64 x 256 KiB: one message 4-10 points of the raw pyzmq reference faster than 1 MiB + 8 MiB messages in four
#: runs; 64 x 2 MiB: the same within noise).
PIPELINE_BYTES = 8 << 20
#: payload bytes of the first ``set`` message of a pipelined batch: nothing is on the wire while its pages are
#: checksummed, so it is kept small (the following messages are checksummed while the previous one is sent).
FIRST_MESSAGE_BYTES = 1 << 20


class ZmqStore(StorageBackend):
    """L3 store on a tierkv ZMQ cache server.

    Args:
        namespace: 16-byte namespace digest written into and checked against every page header.
        page_bytes: bytes of one page payload (> 0).
        options: the keys of :class:`ZmqStoreConfig` (``l3.zmq.*``):
        endpoint: server address, ``tcp://HOST:PORT`` (default ``tcp://127.0.0.1:5557``) or ``ipc://PATH``.
        timeout_s: seconds without a reply after which an exchange fails (> 0).
        token: shared secret the server was started with (``--token``), or None.
        max_message_bytes: bound on one message in bytes; batches are split under it; must hold one page.
        reconnect_backoff_s: first back-off after a failed exchange (seconds, >= 0); doubles per consecutive
            failure up to ``max_backoff_s``.
        max_backoff_s: longest back-off (seconds, >= reconnect_backoff_s).
        shm: shared-memory data path: ``"auto"`` (when the endpoint is loopback or ``ipc://`` and the server
            offers it), ``"on"`` (try it whatever the endpoint), ``"off"`` (default; payload frames only).
        shm_bytes: size of this client's ``/dev/shm`` segment in bytes (>= one page; default 64 MiB). A batch of
            more pages than fit is moved in several rounds.
    Raises:
        TypeError: an unknown keyword argument (named in the message).
        ConfigError: (a ValueError) a bad option value; the message names ``l3.zmq.<key>``.
        ValueError: bad ``namespace`` or ``page_bytes``.
    """

    vectored_sources = True  # a page given as runs is copied run by run into its shared-memory slot
    vectored_destinations = True  # a page read is copied run by run from its shared-memory slot (or frame)
    verified_checksums = True     # batch_get(checksums=) hands back the payload checksum each read was verified by

    def __init__(self, namespace: bytes, page_bytes: int, **options: Any):
        unknown = sorted(set(options) - set(ZmqStoreConfig.model_fields))
        if unknown:
            raise TypeError(f"ZmqStore got unknown option(s) {', '.join(unknown)}; allowed: "
                            f"{', '.join(ZmqStoreConfig.model_fields)}")
        check_store_identity(namespace, page_bytes)
        cfg = check_options(options, page_bytes)
        self.namespace = bytes(namespace)
        self.page_bytes = page_bytes
        self.endpoint = cfg.endpoint
        self.token = cfg.token
        self.max_message_bytes = cfg.max_message_bytes
        self.reconnect_backoff_s = cfg.reconnect_backoff_s
        self.max_backoff_s = cfg.max_backoff_s
        self.keys_per_message = max(1, min(P.MAX_KEYS, (cfg.max_message_bytes - _MSG_SLACK) // (page_bytes + _PER_KEY_OVERHEAD)))
        self._lock = threading.RLock()
        self._closed = False
        self._warn = RateLimitedLog(log)
        self.counters = Counters("requests", "timeouts", "reconnects", "fast_fails", "stale_replies", "bad_replies",
                                 "error_replies", "max_pending", "shm_pages_in", "shm_pages_out", "shm_attaches",
                                 "shm_fallbacks", "shm_recreated", "presence_answers", "presence_tables", "set_refused")
        self._chan = RequestChannel(cfg.endpoint, timeout_s=cfg.timeout_s, backoff_s=cfg.reconnect_backoff_s,
                                    max_backoff_s=cfg.max_backoff_s, counters=self.counters, log=log,
                                    what="tierkv zmq server", hwm=10000, max_message_bytes=cfg.max_message_bytes)
        mode = cfg.shm
        self.shm = mode
        self.shm_bytes = cfg.shm_bytes
        #: the shared-memory path is tried (False once it is found unusable: frames from then on)
        self._shm_on = mode == "on" or (mode == "auto" and is_local_endpoint(cfg.endpoint))
        self._seg: Optional[Segment] = None
        self._seg_attached = False
        #: the server's presence table (:mod:`.presence_table`), probed by :meth:`batch_exists` instead of a round
        #: trip; asked for (a ping) on this host when the shared-memory path is tried, again at most every
        #: :data:`PRESENCE_RETRY_S` while there is none
        self._presence: Optional[PresenceTable] = None
        self._presence_on = self._shm_on
        self._presence_due = -math.inf
        self._presence_lock = threading.Lock()

    # ----------------------------------------------------------------------------------------- requests
    @property
    def timeout_s(self) -> float:
        """Seconds without a reply after which an exchange fails (``l3.zmq.timeout_s``; may be changed)."""
        return self._chan.timeout_s

    @timeout_s.setter
    def timeout_s(self, v: float) -> None:
        self._chan.timeout_s = v

    def _exchange(self, msgs: list, on_reply: Callable[[int, dict, list], None],
                  errors: Optional[dict] = None) -> list:
        """:func:`.exchange.exchange` of ``msgs`` on this store: one bool per message (answered ok)."""
        return exchange(self, msgs, on_reply, errors)

    # ----------------------------------------------------------------------------------------- interface
    def _chunks(self, n: int, per: int) -> list:
        return [(s, min(n, s + per)) for s in range(0, n, per)]

    @property
    def local_exists(self) -> bool:
        """True when the server is on this machine (``ipc://`` or a loopback ``tcp://`` address): an existence query
        is one short round trip that the engine's scheduler may make in its own loop (``controller.exists_in_scheduler``;
        the scheduler's copy of the store caps ``timeout_s``)."""
        return is_local_endpoint(self.endpoint)

    def batch_exists(self, keys: Sequence[str], tokens: Optional[Sequence[PageTokens]] = None) -> int:
        """Number of leading ``keys`` present on the server (0 on any failure). On the server's host the answer
        comes from its presence table (:mod:`.presence_table`) without a round trip, when it publishes one."""
        self._keys(keys)
        n = presence_probe.lead(self, keys)
        if n is not None:
            return n
        lead = 0
        for s, e in self._chunks(len(keys), P.MAX_KEYS):
            got: dict = {}

            def on_reply(i, rh, frames, n=e - s):
                v = rh.get("lead")
                if frames or type(v) is not int or not 0 <= v <= n:
                    raise P.ProtocolError("bad_reply", f"exists reply lead={P.brief(v)} frames={len(frames)}")
                got["lead"] = v

            if not self._exchange([({"op": "exists", "ns": self.namespace, "keys": list(keys[s:e])}, [])], on_reply)[0]:
                return lead
            lead += got["lead"]
            if got["lead"] < e - s:
                break
        return lead

    def batch_get(self, keys: Sequence[str], destinations: Sequence[Buffer],
                  tokens: Optional[Sequence[PageTokens]] = None, checksums: Optional[list] = None) -> list[bool]:
        """Fill ``destinations`` (writable ``page_bytes`` buffers, or lists or tuples of writable runs adding up to
        one: :attr:`vectored_destinations`) with the pages of ``keys``; one bool per key. ``checksums``: a list of
        ``len(keys)`` filled with each hit's verified payload XXH3-64 and None for each miss
        (:attr:`verified_checksums`).

        On the frame path a page is copied into its destination only after its header (namespace, key, length,
        header checksum) and payload XXH3-64 are verified, and a destination of a miss is left untouched. On the
        shared-memory path the header is checked, the slot copied, and the XXH3-64 checked on the copy (the slot is
        shared memory, the destination is not), so a page that fails leaves garbage in its destination, as with
        the file store; a key the server does not hold leaves it untouched.
        Raises ValueError for bad keys or buffers (caller bugs)."""
        self._keys(keys)
        dsts = self._dest_views(keys, destinations)
        sums = self._checksums_out(checksums, len(keys))
        res = [False] * len(keys)
        if self._shm_on:
            with self._lock:
                if shm_path.get_shm(self, keys, dsts, res, sums):
                    nh = sum(res)
                    self.counters["hits"] += nh
                    self.counters["misses"] += len(keys) - nh
                    return res
        chunks = self._chunks(len(keys), self.keys_per_message)

        def on_reply(ci, rh, frames):
            s, e = chunks[ci]
            hits, hdrs = rh.get("hits"), rh.get("hdrs")
            if not isinstance(hits, list) or len(hits) != e - s or not all(isinstance(x, bool) for x in hits):
                raise P.ProtocolError("bad_reply", "get reply: 'hits' is not one bool per key")
            nh = sum(hits)
            if not isinstance(hdrs, list) or len(hdrs) != nh or len(frames) != nh:
                raise P.ProtocolError("bad_reply", f"get reply: {nh} hits, {len(hdrs) if isinstance(hdrs, list) else P.brief(hdrs)} "
                                                   f"headers, {len(frames)} payload frames")
            j = 0
            for off, hit in enumerate(hits):
                if not hit:
                    continue
                idx, hdr, fr = s + off, hdrs[j], frames[j]
                j += 1
                try:
                    if not isinstance(hdr, bytes):
                        raise PageFormatError("header is not bin")
                    sums[idx] = copy_verified(hdr, fr.buffer, dsts[idx], keys[idx], self.namespace, self.page_bytes)
                except PageFormatError as err:
                    self.counters["corrupt"] += 1
                    self._warn.warning("corrupt", "page %s from %s is not valid (%s): miss", keys[idx], self.endpoint,
                                       err)
                    continue
                res[idx] = True
                self.counters["bytes_read"] += self.page_bytes

        self._exchange([({"op": "get", "ns": self.namespace, "keys": list(keys[s:e])}, []) for s, e in chunks], on_reply)
        nh = sum(res)
        self.counters["hits"] += nh
        self.counters["misses"] += len(keys) - nh
        return res


    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer],
                  checksums: Optional[Sequence[int]] = None,
                  tokens: Optional[Sequence[PageTokens]] = None) -> list[bool]:
        """Store ``sources`` (``page_bytes`` buffers, sent zero-copy; or lists of runs adding up to it,
        :attr:`vectored_sources`: copied straight into the shared-memory slots, or joined for the frame path) under
        ``keys``; one bool per key.

        The server stores a message's pages whole or not at all (ZMQ delivers multipart messages atomically). A
        set reported ``False`` because of a timeout may still land later, complete (like any timed-out remote
        write), never partially. ``checksums``: one XXH3-64 per source (see :meth:`StorageBackend.batch_set`),
        written into the headers as given (no payload is hashed; the server does not check payloads, so a wrong
        value is found by the reader: a miss). Raises ValueError for bad keys, buffers or ``checksums`` (caller
        bugs)."""
        kraw = self._keys(keys)
        sums = check_checksums(checksums, len(keys))
        srcs = self._source_views(keys, sources)
        n = len(keys)
        res = [False] * n
        if self._shm_on:
            with self._lock:
                if shm_path.set_shm(self, keys, kraw, srcs, sums, res):
                    ok = sum(res)
                    self.counters["sets"] += ok
                    self.counters["set_failures"] += n - ok
                    self.counters["bytes_written"] += ok * self.page_bytes
                    return res
        srcs = [b"".join(v) if isinstance(v, list) else v for v in srcs]  # one payload frame per page
        if sums is None:  # pipelined: the next message's pages are hashed while the previous one is sent
            per = max(1, min(self.keys_per_message, PIPELINE_BYTES // self.page_bytes))
            first = max(1, min(per, FIRST_MESSAGE_BYTES // self.page_bytes))
            chunks = ([(0, min(n, first))] + [(s + first, e + first) for s, e in self._chunks(max(0, n - first), per)]
                      if n else [])
        else:  # nothing to hash, so nothing to overlap: as few messages as max_message_bytes allows
            chunks = self._chunks(n, self.keys_per_message)

        def build(s: int, e: int) -> tuple:
            hdrs = encode_headers(kraw[s:e], self.namespace, srcs[s:e], self.page_bytes,
                                  None if sums is None else sums[s:e])
            return {"op": "set", "ns": self.namespace, "keys": list(keys[s:e]), "hdrs": hdrs}, srcs[s:e]

        msgs = [lambda s=s, e=e: build(s, e) for s, e in chunks]

        def on_reply(ci, rh, frames):
            s, e = chunks[ci]
            st = rh.get("stored")
            if frames or not isinstance(st, list) or len(st) != e - s or not all(isinstance(x, bool) for x in st):
                raise P.ProtocolError("bad_reply", "set reply: 'stored' is not one bool per key")
            res[s:e] = st
            self._set_reply_counts(rh)

        self._exchange(msgs, on_reply)
        ok = sum(res)
        self.counters["sets"] += ok
        self.counters["set_failures"] += len(keys) - ok
        self.counters["bytes_written"] += ok * self.page_bytes
        return res

    def _set_reply_counts(self, rh: dict) -> None:
        """``evicted`` (server evictions this set caused) and ``refused`` (pages the server refused for this
        tenant's quota with eviction off: already counted as set failures) of a set reply."""
        for name, counter in (("evicted", "evictions"), ("refused", "set_refused")):
            v = rh.get(name, 0)
            if type(v) is int and v > 0:
                self.counters[counter] += v

    def batch_delete(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` on the server; returns how many existed (0 on failure)."""
        self._keys(keys)
        n = [0]

        def on_reply(i, rh, frames):
            v = rh.get("deleted")
            if type(v) is not int or v < 0:
                raise P.ProtocolError("bad_reply", "delete reply: 'deleted' is not a count")
            n[0] += v

        self._exchange([({"op": "delete", "ns": self.namespace, "keys": list(keys[s:e])}, []) for s, e in self._chunks(len(keys), P.MAX_KEYS)],
                       on_reply)
        return n[0]

    def clear(self) -> None:
        """Drop every page of this store's namespace on the server (other namespaces are kept). A failure is
        counted and logged, not raised."""
        if not self._exchange([({"op": "clear", "ns": self.namespace, "keys": []}, [])], lambda i, rh, fr: None)[0]:
            self.counters["errors"] += 1

    def ping(self) -> bool:
        """True when the server answers a ping within ``timeout_s``."""
        return self._exchange([({"op": "ping", "keys": []}, [])], lambda i, rh, fr: None)[0]

    def server_stats(self) -> Optional[dict]:
        """The server's counters (see :meth:`zmq_server.CacheServer.stats`), or None when it does not answer."""
        out: dict = {}

        def on_reply(i, rh, frames):
            st = rh.get("stats")
            if not isinstance(st, dict):
                raise P.ProtocolError("bad_reply", "stats reply without a 'stats' map")
            out.update(st)

        return out if self._exchange([({"op": "stats", "keys": []}, [])], on_reply)[0] else None

    def stats(self) -> dict:
        """Client counters: requests, hits, misses, sets, set_failures (set_refused of them: refused by the server
        for the tenant's quota), corrupt (pages failing verification),
        errors, timeouts, reconnects, fast_fails (calls skipped during back-off), stale_replies, bad_replies,
        error_replies, bytes_read/bytes_written (payload bytes), evictions (server evictions caused by this client's
        sets), pending (requests awaiting a reply now), max_pending, connected (a socket is open); shared memory:
        shm (``"attached"``, ``"ready"`` = to be attached on the next call, or ``"off"``), shm_pages_in/out (pages
        moved through the segment), shm_attaches, shm_fallbacks (times it was found unusable), shm_recreated;
        presence (``"mapped"``: existence is answered from the server's presence table, else ``"off"``),
        presence_answers (existence calls answered from it), presence_tables (tables mapped)."""
        s = dict(self.counters)  # no lock: never waits behind a call that is waiting for the server
        s.update(pending=self._chan.pending, max_pending=self._chan.max_pending, connected=self._chan.connected,
                 backend="zmq", endpoint=self.endpoint,
                 shm="attached" if self._seg_attached else ("ready" if self._shm_on else "off"),
                 presence="mapped" if self._presence is not None else "off")
        return s

    def close(self) -> None:
        """Close the socket and the ZMQ context. Idempotent; later calls return misses/False."""
        with self._presence_lock:  # first and on its own: a call holding it may be waiting for self._lock
            self._presence_on = False
            if self._presence is not None:
                self._presence.close()
                self._presence = None
        with self._lock:
            if self._closed:
                return
            if self._seg_attached and self._chan.connected and not self._chan.fails:
                t, self.timeout_s = self.timeout_s, min(self.timeout_s, 0.2)  # best effort: the server unmaps it
                try:
                    self._exchange([({"op": "shm_detach", "v": P.SHM_PROTOCOL_VERSION, "name": self._seg.name,
                                      "keys": []}, [])], lambda i, rh, fr: None, {})
                finally:
                    self.timeout_s = t
            shm_path.drop_segment(self)
            self._closed = True
            self._chan.close()
