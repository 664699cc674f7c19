"""Client of the tierkv ZMQ cache server (:mod:`.zmq_server`): an L3 :class:`StorageBackend`.

One DEALER socket per store, guarded by a lock (thread-safe). Every page travels as a 64-byte
:mod:`.page_format` header (inside the msgpack request header) plus one raw payload frame sent zero-copy from
the caller's buffer (e.g. a host-pool page, a ``torch.uint8`` tensor); on read the header and the payload's
XXH3-64 are checked before the payload is copied into the destination, so a missing, corrupt, truncated or
foreign page is a miss, never data.

Fault handling (docs/architecture.md §8 R13; LMCache issue #3565 is the failure this avoids):

- every request carries a fresh 64-bit id and replies are matched by id: a stale, duplicate, undecodable or
  wrongly shaped reply is discarded or turned into a miss, and never applied to another request;
- every exchange is bounded by ``timeout_s`` of silence (the clock restarts when a reply arrives, so a large
  batch split into several messages is not cut short while the server makes progress); with
  ``ZMQ_IMMEDIATE`` nothing is queued while the server is down, so a dead or stopped (SIGSTOP) server
  yields misses/``False`` after ``timeout_s``, never an exception or a hang;
- after a timeout the socket (and everything queued on it) is discarded; the next call opens a new one,
  i.e. reconnects without recreating the store. Consecutive failures back off exponentially from
  ``reconnect_backoff_s`` (from the second consecutive failure) up to ``max_backoff_s``; during a back-off
  window calls fail at once (counted ``fast_fails``) instead of each waiting ``timeout_s``.

Batches larger than ``max_message_bytes`` (or :data:`zmq_protocol.MAX_KEYS` keys) are split into several
messages that are pipelined on the socket. A set hashes each payload for its header unless the caller passes the
checksums (``batch_set(..., checksums=...)``, "checksum once").
"""
from __future__ import annotations

import itertools
import logging
import math
import os
import random
import threading
import time
from typing import Any, Callable, Optional, Sequence

import torch
import zmq

from tierkv.storage_backends import zmq_protocol as P
from tierkv.storage_backends.base import Buffer, StorageBackend
from tierkv.storage_backends.common import ConfigError
from tierkv.storage_backends.page_format import (PageFormatError, check_checksums, check_key, decode_header,
                                                 encode_headers, verify_payload)

log = logging.getLogger("tierkv.zmq_client")

#: bytes kept free in each message for the msgpack header (per-key costs are added on top).
_MSG_SLACK = 64 << 10
#: per-key allowance for the key text, the page header and frame overhead in one message.
_PER_KEY_OVERHEAD = 256
#: payload bytes per ``set`` message when a batch is pipelined: the pages of the next message are checksummed
#: while ZMQ's I/O thread already transmits the previous one (measured on 2 cores, 64 x 256 KiB and 64 x 2 MiB).
#: A set given its checksums is not pipelined: its messages are only bounded by ``max_message_bytes`` (interleaved
#: A/B, 64 x 256 KiB: one message 4-10 points of the raw pyzmq reference faster than 1 MiB + 8 MiB messages in four
#: runs; 64 x 2 MiB: the same within noise).
PIPELINE_BYTES = 8 << 20
#: payload bytes of the first ``set`` message of a pipelined batch: nothing is on the wire while its pages are
#: checksummed, so it is kept small (the following messages are checksummed while the previous one is sent).
FIRST_MESSAGE_BYTES = 1 << 20


#: the keys of ``l3.zmq`` (the keyword arguments of :class:`ZmqStore`) and their defaults
OPTION_DEFAULTS: dict[str, Any] = dict(endpoint="tcp://127.0.0.1:5557", timeout_s=1.0, token=None,
                                       max_message_bytes=P.DEFAULT_MAX_MESSAGE_BYTES, reconnect_backoff_s=0.05,
                                       max_backoff_s=1.0)


def check_options(cfg: dict, page_bytes: Optional[int] = None) -> None:
    """Validate the ``l3.zmq`` section without connecting (the connector checks it at start-up, before any
    backend exists). ``page_bytes`` (bytes of one page), when known, also checks that ``max_message_bytes``
    holds one page.

    Raises:
        ConfigError: an unknown key (the allowed ones are listed) or a bad value, naming ``l3.zmq.<key>``.
    """
    unknown = sorted(set(cfg) - set(OPTION_DEFAULTS))
    if unknown:
        raise ConfigError(f"invalid tierkv config: unknown config key(s) {', '.join(f'l3.zmq.{k}' for k in unknown)}; "
                          f"allowed: {', '.join(OPTION_DEFAULTS)}")
    c = {**OPTION_DEFAULTS, **cfg}

    def bad(key: str, value: Any, want: str) -> ConfigError:
        return ConfigError(f"invalid tierkv config: bad value {value!r:.80} for 'l3.zmq.{key}': {want}")

    endpoint = c["endpoint"]
    if not isinstance(endpoint, str) or not endpoint.startswith(("tcp://", "ipc://")):
        raise bad("endpoint", endpoint, "must look like 'tcp://HOST:PORT' or 'ipc://PATH'")
    for name, positive in (("timeout_s", True), ("reconnect_backoff_s", False), ("max_backoff_s", False)):
        v = c[name]
        if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0
                or (positive and v == 0)):
            raise bad(name, v, f"must be a finite number of seconds {'> 0' if positive else '>= 0'}")
    if c["max_backoff_s"] < c["reconnect_backoff_s"]:
        raise bad("max_backoff_s", c["max_backoff_s"], f"must be >= reconnect_backoff_s ({c['reconnect_backoff_s']})")
    token = c["token"]
    if token is not None and (not isinstance(token, str) or not token):
        raise bad("token", "<hidden>", "must be a non-empty string or null")
    mmb = c["max_message_bytes"]
    need = (page_bytes or 1) + _PER_KEY_OVERHEAD + _MSG_SLACK
    if type(mmb) is not int or mmb < need:
        held = f"one page of page_bytes={page_bytes}" if page_bytes else "one page plus 64 KiB"
        raise bad("max_message_bytes", mmb, f"must be an int >= {need} to hold {held}")


def _byte_view(buf: Any, page_bytes: int, writable: bool, what: str, i: int) -> memoryview:
    """A flat uint8 memoryview of ``buf`` (torch CPU tensor, memoryview, bytearray, bytes) of ``page_bytes`` bytes.

    Raises:
        ValueError: wrong size, non-contiguous or non-CPU tensor, read-only destination.
    """
    if (type(buf) is torch.Tensor and buf.dtype is torch.uint8 and buf.dim() == 1 and buf.is_contiguous()
            and buf.device.type == "cpu" and not buf.requires_grad):
        mv = memoryview(buf.numpy())  # fast path: a host-pool page as the pool hands it out
    elif isinstance(buf, torch.Tensor):
        if buf.device.type != "cpu":
            raise ValueError(f"{what}[{i}] must be a CPU tensor, got device {buf.device}")
        if not buf.is_contiguous():
            raise ValueError(f"{what}[{i}] must be a contiguous tensor")
        t = buf.detach()
        if t.dtype != torch.uint8:
            t = t.reshape(-1).view(torch.uint8)
        mv = memoryview(t.reshape(-1).numpy())
    else:
        try:
            mv = memoryview(buf)
        except TypeError:
            raise ValueError(f"{what}[{i}] of type {type(buf).__name__} is not a buffer") from None
        if not mv.contiguous:
            raise ValueError(f"{what}[{i}] must be contiguous")
        mv = mv.cast("B") if (mv.format != "B" or mv.ndim != 1) else mv
    if mv.nbytes != page_bytes:
        raise ValueError(f"{what}[{i}] has {mv.nbytes} bytes, expected page_bytes={page_bytes}")
    if writable and mv.readonly:
        raise ValueError(f"{what}[{i}] is read-only")
    return mv


class ZmqStore(StorageBackend):
    """L3 store on a tierkv ZMQ cache server.

    Args:
        namespace: 16-byte namespace digest written into and checked against every page header.
        page_bytes: bytes of one page payload (> 0).
        endpoint: server address, ``tcp://HOST:PORT`` (default ``tcp://127.0.0.1:5557``) or ``ipc://PATH``.
        timeout_s: seconds without a reply after which an exchange fails (> 0).
        token: shared secret the server was started with (``--token``), or None.
        max_message_bytes: bound on one message in bytes; batches are split under it; must hold one page.
        reconnect_backoff_s: first back-off after a failed exchange (seconds, >= 0); doubles per consecutive
            failure up to ``max_backoff_s``.
        max_backoff_s: longest back-off (seconds, >= reconnect_backoff_s).
    Raises:
        TypeError: an unknown keyword argument (named in the message).
        ConfigError: (a ValueError) a bad option value; the message names ``l3.zmq.<key>``.
        ValueError: bad ``namespace`` or ``page_bytes``.
    """

    def __init__(self, namespace: bytes, page_bytes: int, endpoint: str = "tcp://127.0.0.1:5557",
                 timeout_s: float = 1.0, token: Optional[str] = None,
                 max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES, reconnect_backoff_s: float = 0.05,
                 max_backoff_s: float = 1.0, **kw: Any):
        if kw:
            raise TypeError(f"ZmqStore got unknown option(s) {', '.join(sorted(kw))}; allowed: endpoint, timeout_s, "
                            "token, max_message_bytes, reconnect_backoff_s, max_backoff_s")

        if not isinstance(namespace, (bytes, bytearray)) or len(namespace) != 16:
            raise ValueError(f"namespace must be a 16-byte digest, got {namespace!r:.60}")
        if type(page_bytes) is not int or page_bytes <= 0:
            raise ValueError(f"page_bytes must be a positive int, got {page_bytes!r}")
        check_options(dict(endpoint=endpoint, timeout_s=timeout_s, token=token, max_message_bytes=max_message_bytes,
                           reconnect_backoff_s=reconnect_backoff_s, max_backoff_s=max_backoff_s), page_bytes)
        self.namespace = bytes(namespace)
        self.page_bytes = page_bytes
        self.endpoint = endpoint
        self.timeout_s = float(timeout_s)
        self.token = token
        self.max_message_bytes = max_message_bytes
        self.reconnect_backoff_s = float(reconnect_backoff_s)
        self.max_backoff_s = float(max_backoff_s)
        self.keys_per_message = max(1, min(P.MAX_KEYS, (max_message_bytes - _MSG_SLACK) // (page_bytes + _PER_KEY_OVERHEAD)))
        self._lock = threading.RLock()
        self._ctx: Optional[zmq.Context] = zmq.Context()
        self._sock: Optional[zmq.Socket] = None
        self._ever_connected = False
        self._ids = itertools.count(random.getrandbits(48))
        self._fails = 0
        self._retry_at = 0.0
        self._pending = 0
        self._closed = False
        self._pid = os.getpid()
        self.c = dict(requests=0, hits=0, misses=0, sets=0, set_failures=0, corrupt=0, errors=0, timeouts=0,
                      reconnects=0, fast_fails=0, stale_replies=0, bad_replies=0, error_replies=0, bytes_in=0,
                      bytes_out=0, max_pending=0, evictions=0)

    # ----------------------------------------------------------------------------------------- socket
    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            s = self._ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.IMMEDIATE, 1)  # queue nothing while disconnected
            s.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)  # a peer sending a bigger frame is dropped
            s.setsockopt(zmq.SNDHWM, 10000)
            s.setsockopt(zmq.RCVHWM, 10000)
            s.setsockopt(zmq.RECONNECT_IVL, 20)
            s.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
            if self.endpoint.startswith("tcp://["):
                s.setsockopt(zmq.IPV6, 1)
            s.connect(self.endpoint)
            if self._ever_connected:
                self.c["reconnects"] += 1
            self._ever_connected = True
            self._sock = s
        return self._sock

    def _discard_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)  # drops everything still queued on it (bounded pending queue)
            self._sock = None
        self._pending = 0

    def _failed(self, why: str) -> None:
        self._discard_socket()
        self._fails += 1
        # the first failure may be a one-off (the next call reconnects at once); from the second consecutive
        # failure on, calls within the back-off window fail immediately instead of each waiting timeout_s
        back = 0.0 if self._fails < 2 else min(self.reconnect_backoff_s * (2 ** (self._fails - 2)), self.max_backoff_s)
        self._retry_at = time.monotonic() + back
        if self._fails == 1:
            log.warning("tierkv zmq server %s: %s; pages count as misses, reconnecting with back-off", self.endpoint, why)
        else:
            log.debug("tierkv zmq server %s: %s (failure %d, back-off %.3fs)", self.endpoint, why, self._fails, back)

    def _exchange(self, msgs: list, on_reply: Callable[[int, dict, list], None]) -> list:
        """Send ``msgs`` (``(header dict, payload buffers)``, or a callable returning one, called just before its
        message is sent), pipelined, and hand each matched, well-formed,
        ``ok`` reply to ``on_reply(index, header, frames)``. Returns one bool per message (answered ok).
        Never raises for network faults."""
        done = [False] * len(msgs)
        if not msgs:
            return done
        with self._lock:
            if self._closed:
                self.c["errors"] += len(msgs)
                return done
            if os.getpid() != self._pid:  # forked: the parent's context and socket are not usable here
                self._ctx, self._sock, self._pid = zmq.Context(), None, os.getpid()
            now = time.monotonic()
            if now < self._retry_at:
                self.c["fast_fails"] += len(msgs)
                return done
            sock = self._socket()
            deadline = now + self.timeout_s
            waiting: dict[int, tuple[int, str]] = {}
            for i, m in enumerate(msgs):
                h, payloads = m() if callable(m) else m  # built lazily: overlaps the previous send
                rid = next(self._ids) & P.MAX_ID
                h = dict(h, v=P.PROTOCOL_VERSION, id=rid)
                if self.token is not None:
                    h["token"] = self.token
                if not sock.poll(max(0, int((deadline - time.monotonic()) * 1000)), zmq.POLLOUT):
                    self.c["timeouts"] += 1
                    self._failed("not connected (send timed out)")
                    return done
                try:
                    sock.send_multipart([P.pack(h)] + list(payloads), zmq.NOBLOCK, copy=False)
                except zmq.ZMQError as e:
                    self.c["errors"] += 1
                    self._failed(f"send failed: {e}")
                    return done
                self.c["requests"] += 1
                waiting[rid] = (i, h["op"])
                self._pending = len(waiting)
                self.c["max_pending"] = max(self.c["max_pending"], self._pending)
            while waiting:
                left = deadline - time.monotonic()
                # past the deadline, still look once without waiting: a reply that arrived while this thread was
                # not running (a long GC pause, a stopped process) is an answer, not a timeout
                if not sock.poll(max(1, int(left * 1000)) if left > 0 else 0, zmq.POLLIN):
                    if time.monotonic() < deadline:
                        continue
                    self.c["timeouts"] += 1
                    self._failed(f"no reply within {self.timeout_s}s")
                    return done
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    continue
                except zmq.ZMQError as e:
                    self.c["errors"] += 1
                    self._failed(f"receive failed: {e}")
                    return done
                try:
                    rh = P.unpack_header(frames[0].buffer, max_map_len=256)
                except P.ProtocolError as e:
                    self.c["bad_replies"] += 1
                    log.debug("discarding undecodable reply: %s", e)
                    continue
                rid = rh.get("id")
                slot = waiting.pop(rid, None) if type(rid) is int else None
                if slot is None:
                    self.c["stale_replies"] += 1  # an older request's reply, or one never asked for
                    continue
                self._pending = len(waiting)
                deadline = time.monotonic() + self.timeout_s  # progress: restart the silence clock
                i, op = slot
                if rh.get("v") != P.PROTOCOL_VERSION or rh.get("op") != op or not isinstance(rh.get("ok"), bool):
                    self.c["bad_replies"] += 1
                    continue
                if not rh["ok"]:
                    self.c["error_replies"] += 1
                    err = rh.get("err")
                    log.warning("tierkv zmq server refused %s: %s: %s", op, P.brief(rh.get("code")),
                                err[:200] if isinstance(err, str) else P.brief(err))
                    continue
                try:
                    on_reply(i, rh, frames[1:])
                except (P.ProtocolError, TypeError, ValueError, KeyError, IndexError) as e:
                    self.c["bad_replies"] += 1
                    log.warning("malformed %s reply from %s discarded: %s", op, self.endpoint, e)
                    continue
                done[i] = True
            self._pending = 0
            if self._fails:
                log.info("tierkv zmq server %s reachable again", self.endpoint)
            self._fails = 0
            return done

    # ----------------------------------------------------------------------------------------- interface
    def _chunks(self, n: int, per: int) -> list:
        return [(s, min(n, s + per)) for s in range(0, n, per)]

    def batch_exists(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` present on the server (0 on any failure)."""
        for k in keys:
            check_key(k)
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

    def batch_get(self, keys: Sequence[str], destinations: Sequence[Buffer]) -> list[bool]:
        """Fill ``destinations`` (writable ``page_bytes`` buffers) with the pages of ``keys``; one bool per key.

        A page is copied into its destination only after its header (namespace, key, length, header checksum)
        and payload XXH3-64 are verified; a destination of a miss is left untouched.
        Raises ValueError for bad keys or buffers (caller bugs)."""
        if len(keys) != len(destinations):
            raise ValueError(f"batch_get: {len(keys)} keys but {len(destinations)} destinations")
        for k in keys:
            check_key(k)
        dsts = [_byte_view(d, self.page_bytes, True, "destinations", i) for i, d in enumerate(destinations)]
        res = [False] * len(keys)
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
                    psum = decode_header(hdr, keys[idx], self.namespace, self.page_bytes)
                    buf = fr.buffer
                    if buf.nbytes != self.page_bytes:
                        raise PageFormatError(f"payload frame of {buf.nbytes} bytes, expected {self.page_bytes}")
                    verify_payload(buf, psum)
                except PageFormatError as err:
                    self.c["corrupt"] += 1
                    log.warning("page %s from %s is not valid (%s): miss", keys[idx], self.endpoint, err)
                    continue
                dsts[idx][:] = buf
                res[idx] = True
                self.c["bytes_in"] += self.page_bytes

        self._exchange([({"op": "get", "ns": self.namespace, "keys": list(keys[s:e])}, []) for s, e in chunks], on_reply)
        nh = sum(res)
        self.c["hits"] += nh
        self.c["misses"] += len(keys) - nh
        return res

    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer],
                  checksums: Optional[Sequence[int]] = None) -> list[bool]:
        """Store ``sources`` (``page_bytes`` buffers, sent zero-copy) under ``keys``; one bool per key.

        The server stores a message's pages whole or not at all (ZMQ delivers multipart messages atomically). A
        set reported ``False`` because of a timeout may still land later, complete (like any timed-out remote
        write), never partially. ``checksums``: one XXH3-64 per source (see :meth:`StorageBackend.batch_set`),
        written into the headers as given (no payload is hashed; the server does not check payloads, so a wrong
        value is found by the reader: a miss). Raises ValueError for bad keys, buffers or ``checksums`` (caller
        bugs)."""
        if len(keys) != len(sources):
            raise ValueError(f"batch_set: {len(keys)} keys but {len(sources)} sources")
        kraw = [check_key(k) for k in keys]
        sums = check_checksums(checksums, len(keys))
        srcs = [_byte_view(b, self.page_bytes, False, "sources", i) for i, b in enumerate(sources)]
        n = len(keys)
        res = [False] * n
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
            ev = rh.get("evicted", 0)
            if type(ev) is int and ev > 0:
                self.c["evictions"] += ev

        self._exchange(msgs, on_reply)
        ok = sum(res)
        self.c["sets"] += ok
        self.c["set_failures"] += len(keys) - ok
        self.c["bytes_out"] += ok * self.page_bytes
        return res

    def batch_delete(self, keys: Sequence[str]) -> int:
        """Delete ``keys`` on the server; returns how many existed (0 on failure)."""
        for k in keys:
            check_key(k)
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
            self.c["errors"] += 1

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
        """Client counters: requests, hits, misses, sets, set_failures, corrupt (pages failing verification),
        errors, timeouts, reconnects, fast_fails (calls skipped during back-off), stale_replies, bad_replies,
        error_replies, bytes_in/bytes_out (payload bytes), evictions (server evictions caused by this client's
        sets), pending (requests awaiting a reply now), max_pending, connected (a socket is open)."""
        s = dict(self.c)  # no lock: never waits behind a call that is waiting for the server
        s.update(pending=self._pending, connected=self._sock is not None, backend="zmq", endpoint=self.endpoint)
        return s

    def close(self) -> None:
        """Close the socket and the ZMQ context. Idempotent; later calls return misses/False."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._discard_socket()
            if self._ctx is not None:
                self._ctx.term()
                self._ctx = None
