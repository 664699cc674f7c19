"""tierkv ZMQ cache server: a standalone process that holds L3 pages in memory for several engines.

Run it as ``tierkv server`` or ``python -m tierkv.cli_server`` (same flags; the command line is
:mod:`tierkv.cli_server`). It binds a ZMQ ROUTER socket on ``--host`` (127.0.0.1 unless a wider address is
given explicitly) and ``--port`` (0 = any free port), prints one line ``tierkv-server ready tcp://HOST:PORT``
on stdout once it is listening, exits cleanly on SIGTERM/SIGINT and re-reads its ``--tokens-file`` on SIGHUP.

This module is the protocol side: frames, authentication (a request's token names its tenant,
:mod:`.tenants`), dispatch, shared-memory segments, ``verify`` sessions and counters of bad traffic. The pages
live in a :class:`.page_store.PageStore` (one namespace per tenant, quotas, LRU, spill, presence table). The server
never looks inside a payload: the client wraps every page with a :mod:`.page_format` header and checks it on read.

Safe by default (docs/architecture.md, docs/tenants.md): a ``--host`` beyond loopback without a token refuses to
start unless ``--allow-unauthenticated``; error replies and log lines carry ``***`` in place of any token; a request
for another tenant's page is a miss. Wire format and its limits: :mod:`.zmq_protocol` (no pickle).
"""
from __future__ import annotations

import functools
import itertools
import logging
import os
import sys
import time
from collections import OrderedDict
from typing import Any, Optional

import zmq
from zmq.utils.monitor import parse_monitor_message

from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.common import Counters
from tierkv.storage_backends.zmq.presence_table import PRESENCE_NAME_RE, PRESENCE_PREFIX
from tierkv.storage_backends.shm_segment import sweep_dead_files
from tierkv.storage_backends.zmq.server.ops import (  # noqa: F401 - the limits are re-exported
    MAX_SEGMENTS, MAX_VERIFY_SESSIONS, SEGMENT_IDLE_S, AdminOps, ShmOps)
from tierkv.storage_backends.zmq.server.page_store import VERIFY_SLICE_BYTES, PageStore, nbytes  # noqa: F401
from tierkv.storage_backends.zmq.server.tenants import Tenant, TenantTable, TokensFileError, load_tokens_file, single_tenant

log = logging.getLogger("tierkv.zmq_server")

DEFAULT_PORT = 5557
DEFAULT_CAPACITY_BYTES = 1 << 30
_POLL_MS = 100
_BATCH_RECV = 64
#: replies queued for one client before further replies to it are dropped (counted ``replies_dropped``): a client
#: that does not read its answers holds at most this many (ROUTER high-water mark, messages; they share the stored
#: payload frames, so memory stays bounded). Well above what a pipelining client keeps in flight: libzmq frees room
#: in a pipe only in batches, so a queue near a client's window drops replies it is about to read.
REPLY_QUEUE = 1000
#: seconds a new connection may take to finish the ZMTP handshake before it is closed (``handshakes_failed``).
HANDSHAKE_S = 5.0
#: counter of each refused request's code (``auth`` and ``too_large`` are counted where they are detected)
_BAD = {"bad_header": "bad_header", "bad_request": "bad_request", "version": "version_refused",
        "unknown_op": "unknown_op", "shm_unknown": "shm_unknown"}
#: counters of bad traffic (see :meth:`CacheServer.stats`)
BAD_TRAFFIC = ("empty_messages", "bad_header", "bad_request", "version_refused", "unknown_op", "auth_failures",
               "too_large", "replies_dropped", "handshakes_failed", "shm_refused", "shm_unknown")
_MON_EVENTS = (zmq.EVENT_ACCEPTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED
               | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL)
_nbytes = nbytes


class CacheServer(ShmOps, AdminOps):
    """The protocol side of the server (single-threaded; one ROUTER socket); pages are in :attr:`store`.

    Args:
        host: bind address (default loopback). ``port``: TCP port, 0 = any free one.
        capacity_bytes: bound on stored bytes of all tenants (page header + payload per record).
        spill_dir: optional directory for evicted records (a FileStore per tenant and record length).
        spill_capacity_bytes: capacity of each spill FileStore (None: the FileStore default, a share of free disk).
        max_message_bytes: largest accepted multipart message (bytes); a single larger frame makes ZMQ drop
            the sender's connection (``ZMQ_MAXMSGSIZE``), a larger total gets an error reply.
        token: optional shared secret every request must carry (one tenant, :data:`.tenants.DEFAULT_TENANT`).
        tokens_file: a tokens file (:mod:`.tenants`; excludes ``token``), re-read by :meth:`reload_tenants`.
        evict: False = a tenant over its quota (or a full server) has its writes refused, not its pages evicted
            (the default of tenants whose entry has no ``evict``).
        enable_test_ops: answer test-only ops (``t_corrupt``) used by the test-suite.
        eviction_policy: the order each tenant's records are evicted in: lru (default), lfu, slru or s3fifo.
    Raises:
        ValueError: a non-positive capacity or message bound, an unknown policy; :class:`.tenants.TokensFileError`.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                 spill_dir: Optional[str] = None, max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES,
                 token: Optional[str] = None, enable_test_ops: bool = False,
                 spill_capacity_bytes: Optional[int] = None, tokens_file: Optional[str] = None, evict: bool = True,
                 eviction_policy: str = "lru"):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        if token and tokens_file:
            raise ValueError("give a token or a tokens file, not both")
        self.capacity_bytes = int(capacity_bytes)
        self.max_message_bytes = int(max_message_bytes)
        self.tokens_file, self.evict = tokens_file, evict
        table = load_tokens_file(tokens_file, evict) if tokens_file else single_tenant(token, capacity_bytes, evict)
        self.table = table
        self._redact_tokens(table)
        self.store = PageStore(table, capacity_bytes, spill_dir, spill_capacity_bytes, eviction_policy)
        self.spill = bool(spill_dir)
        self.enable_test_ops = enable_test_ops
        self.pending_writes = 0
        self.counters = Counters("requests", "dropped", "shm_attached", "shm_bytes_in", "shm_bytes_out",
                                 "tokens_reloads", "tokens_reload_failures", "connections_accepted",
                                 "connections_closed", *BAD_TRAFFIC)
        #: client segments: name -> [Segment, last use (monotonic seconds), tenant name]
        self.segments: "OrderedDict[str, list]" = OrderedDict()
        #: the tenant of the request being handled, and whether it came from this host
        self._tenant: Tenant = next(iter(table.tenants.values()))
        self._peer_local = False
        #: unfinished ``verify`` sessions: id -> job (see :meth:`_op_verify`)
        self._verifies: "OrderedDict[int, dict]" = OrderedDict()
        self._verify_ids = itertools.count(int.from_bytes(os.urandom(6), "little"))
        self._handshaken: set = set()  # fds of connections that finished the ZMTP handshake
        self.started = time.time()
        self._stop = False
        self._reload = False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        for opt, v in ((zmq.LINGER, 0), (zmq.MAXMSGSIZE, self.max_message_bytes), (zmq.SNDHWM, REPLY_QUEUE),
                       (zmq.RCVHWM, 1000), (zmq.ROUTER_MANDATORY, 1), (zmq.HANDSHAKE_IVL, int(HANDSHAKE_S * 1000))):
            self.sock.setsockopt(opt, v)
        self.monitor = self.sock.get_monitor_socket(_MON_EVENTS)
        if host == "localhost":
            host = "127.0.0.1"
        if ":" in host:
            self.sock.setsockopt(zmq.IPV6, 1)
            host_fmt = f"[{host}]"
        else:
            host_fmt = host
        self.sock.bind(f"tcp://{host_fmt}:{port if port else '*'}")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.port = int(self.endpoint.rsplit(":", 1)[1])

    # ----------------------------------------------------------------------------------------- tenants
    def _redact_tokens(self, table: TenantTable) -> None:
        self._tokens = sorted(set(getattr(self, "_tokens", [])) | set(table.tokens), key=len, reverse=True)
        for t in table.tokens:
            _install_redaction(t)

    def reload_tenants(self) -> bool:
        """Re-read the tokens file (SIGHUP). On an error the old table stays (logged with the file's line,
        ``tokens_reload_failures`` += 1). Returns True when the new table is in use."""
        if not self.tokens_file:
            log.info("SIGHUP: no --tokens-file to reload")
            return False
        try:
            table = load_tokens_file(self.tokens_file, self.evict)
        except TokensFileError as e:
            self.counters["tokens_reload_failures"] += 1
            log.error("%s; keeping the %d tenants in use", e, len(self.table.tenants))
            return False
        self._redact_tokens(table)
        self.store.apply(table)
        self.table = table
        for sid in [s for s, j in self._verifies.items() if j["tenant"] not in table.tenants]:
            del self._verifies[sid]
        self.counters["tokens_reloads"] += 1
        log.info("tokens file reloaded: %d tenants (%s)", len(table.tenants), ", ".join(sorted(table.tenants)))
        return True

    # ----------------------------------------------------------------------------------------- requests
    def handle(self, frames: list) -> Optional[list]:
        """Answer one request (``frames`` = header frame + payload frames, without the ROUTER identity).

        Returns the reply frames, or None to drop the message. Never raises for bad input."""
        self.counters["requests"] += 1
        if not frames:
            self.counters["dropped"] += 1
            self.counters["empty_messages"] += 1
            return None
        req_id, op, ver = 0, "", P.PROTOCOL_VERSION
        try:
            total = sum(len(f) for f in frames)
            self.counters["bytes_written"] += total
            h = P.unpack_header(frames[0].buffer if isinstance(frames[0], zmq.Frame) else frames[0])
            rid = h.get("id")
            if type(rid) is int and 0 <= rid <= P.MAX_ID:
                req_id = rid
            op = h.get("op") if isinstance(h.get("op"), str) else ""
            if total > self.max_message_bytes:
                self.counters["too_large"] += 1
                raise P.ProtocolError("too_large", f"message of {total} bytes > limit {self.max_message_bytes}")
            req_id = P.get_int(h, "id")
            v = h.get("v")
            if type(v) is not int or v not in P.SUPPORTED_VERSIONS:
                raise P.ProtocolError("version", f"protocol version {P.brief(v)} not supported (server speaks "
                                                 f"{', '.join(map(str, P.SUPPORTED_VERSIONS))})")
            ver = v
            op = P.get_str(h, "op")
            tenant = self.table.by_token(h.get("token"))
            if tenant is None:
                self.counters["auth_failures"] += 1
                raise P.ProtocolError("auth", "missing or wrong token")
            self._tenant = tenant
            fn = self._OPS.get(op)
            if fn is None and self.enable_test_ops and op in P.TEST_OPS:
                fn = AdminOps._op_t_corrupt
            if fn is None:
                raise P.ProtocolError("unknown_op", f"unknown op {op[:40]!r}; allowed: {', '.join(P.OPS)}")
            if op in P.ADMIN_OPS and ver < P.ADMIN_PROTOCOL_VERSION:
                raise P.ProtocolError("version", f"op {op!r} needs protocol version {P.ADMIN_PROTOCOL_VERSION}")
            if (op in P.SHM_OPS or "shm" in h) and ver < P.SHM_PROTOCOL_VERSION:
                raise P.ProtocolError("version", f"op {op!r} with shared memory needs protocol version "
                                                 f"{P.SHM_PROTOCOL_VERSION}")
            if (op in P.SHM_OPS or "shm" in h) and not _local_peer(frames[0]):
                self.counters["shm_refused"] += 1
                raise P.ProtocolError("shm", "shared memory is only for clients on this host (loopback)")
            payloads = frames[1:]
            self._peer_local = op == "ping" and _local_peer(frames[0])
            if (op != "set" or "shm" in h) and payloads:
                raise P.ProtocolError("bad_request", f"op {op[:40]!r} takes no payload frames, got {len(payloads)}")
            body, out = fn(self, h, payloads)
        except P.ProtocolError as e:
            self.counters["errors"] += 1
            if e.code in _BAD:
                self.counters[_BAD[e.code]] += 1
            log.debug("request %d (%s) refused: %s", req_id, self._redact(op), self._redact(str(e)))
            return [P.error_reply(req_id, self._redact(op), e.code, self._redact(str(e)), v=ver)]
        except Exception as e:  # a bug must not take down the server
            self.counters["errors"] += 1
            log.exception("request %d (%s) failed", req_id, self._redact(op))
            return [P.error_reply(req_id, self._redact(op), "internal", self._redact(f"{type(e).__name__}: {e}"),
                                  v=ver)]
        reply = {"v": ver, "id": req_id, "op": op, "ok": True}
        reply.update(body)
        return [P.pack(reply)] + out

    def _redact(self, text: str) -> str:
        """``text`` with every known token replaced by ``***`` (error replies and log lines never carry one)."""
        for t in self._tokens:
            if t in text:
                text = text.replace(t, "***")
        return text

    def _op_ping(self, h, payloads):
        """Who we are; to a client on this host that asks (``presence: true``) also the name of the presence table
        (``presence``, a file name in /dev/shm), made now if there is none yet; absent without a table (tenants, a
        spill tier, /dev/shm unusable; older servers never send it)."""
        body = {"server": "tierkv", "proto": P.PROTOCOL_VERSION, "protos": list(P.SUPPORTED_VERSIONS),
                "token_required": not self.table.open, "shm": os.path.isdir(P.SHM_DIR)}
        st = self.store
        if h.get("presence") is True and self._peer_local and not st.multi and not self.spill:
            if st.presence is None:
                st.presence_rebuild()
            if st.presence is not None:
                body["presence"] = st.presence.name
        return body, []

    # ----------------------------------------------------------------------------------------- data ops
    def _op_exists(self, h, payloads):
        keys, ns = P.get_keys(h), P.get_ns(h)
        want_all = P.get_bool(h, "all")
        present, lead = [], 0
        for k in keys:
            p = self.store.present(self._tenant, ns, k)
            if not want_all and not p:
                break
            present.append(p)
        for p in present:
            if not p:
                break
            lead += 1
        body: dict = {"lead": lead}
        if want_all:
            body["present"] = present
        return body, []

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] += n
        self.store.of(self._tenant).counters[name] += n

    def _op_get(self, h, payloads):
        keys, ns = P.get_keys(h), P.get_ns(h)
        if "shm" in h:
            return self._op_get_shm(h, keys, ns)
        hits, hdrs, out = [], [], []
        for k in keys:
            rec = self.store.lookup(self._tenant, ns, k)
            if rec is None:
                hits.append(False)
                self._count("misses")
                continue
            hits.append(True)
            hdrs.append(rec[0])
            out.append(rec[1])
            self._count("hits")
            self.counters["bytes_read"] += _nbytes(rec[1])
        return {"hits": hits, "hdrs": hdrs}, out

    def _op_get_shm(self, h, keys, ns):
        """``get`` into slots of the client's segment: one copy per hit from the stored payload into its slot."""
        mv, size = self._segment(h)
        length = P.get_int(h, "len", 1, size)
        offs = P.get_offsets(h, len(keys), length, size)
        hits, hdrs, bad = [], [], 0
        for k, off in zip(keys, offs):
            rec = self.store.lookup(self._tenant, ns, k)
            pl = None if rec is None else (rec[1].buffer if isinstance(rec[1], zmq.Frame) else memoryview(rec[1]))
            if pl is None or pl.nbytes != length:
                bad += pl is not None
                hits.append(False)
                self._count("misses")
                continue
            mv[off:off + length] = pl.cast("B") if pl.format != "B" or pl.ndim != 1 else pl
            hits.append(True)
            hdrs.append(rec[0])
            self._count("hits")
            self.counters["bytes_read"] += length
            self.counters["shm_bytes_out"] += length
        return {"hits": hits, "hdrs": hdrs, "bad": bad}, []

    def _op_set(self, h, payloads):
        """Store each page; ``stored`` is one bool per key, ``refused`` the pages refused for the tenant's quota (or
        a full server) with eviction off: never acknowledged, so the client counts them as failed sets."""
        keys, ns = P.get_keys(h), P.get_ns(h)
        if "shm" in h:  # payloads come out of the client's segment: one copy each, into a bytes object we keep
            mv, size = self._segment(h)
            length = P.get_int(h, "len", 1, size)
            offs = P.get_offsets(h, len(keys), length, size)
            payloads = [bytes(mv[o:o + length]) for o in offs]
            self.counters["bytes_written"] += length * len(keys)
            self.counters["shm_bytes_in"] += length * len(keys)
        if len(payloads) != len(keys):
            raise P.ProtocolError("bad_request", f"set of {len(keys)} keys carries {len(payloads)} payload frames")
        hdrs = P.get_bins(h, "hdrs", len(keys))
        self.pending_writes += 1
        tp = self.store.of(self._tenant)
        ev0 = tp.counters["evictions"]
        refused = 0
        try:
            stored = []
            for k, hdr, frame in zip(keys, hdrs, payloads):
                ok = self.store.put(self._tenant, ns, k, hdr, frame)
                refused += ok is None
                stored.append(bool(ok))
                self._count("sets" if ok else "set_failures")
        finally:
            self.pending_writes -= 1
        return {"stored": stored, "evicted": tp.counters["evictions"] - ev0, "refused": refused}, []

    def _op_delete(self, h, payloads):
        ns = P.get_ns(h)
        n = sum(self.store.delete(self._tenant, ns, k) for k in P.get_keys(h))
        return {"deleted": n}, []

    def _op_clear(self, h, payloads):
        return {"cleared": self.store.clear(self._tenant, P.get_ns(h))}, []

    def _op_stats(self, h, payloads):
        return {"stats": self.stats(self._tenant)}, []

    _OPS = {"ping": _op_ping, "exists": _op_exists, "get": _op_get, "set": _op_set, "delete": _op_delete,
            "clear": _op_clear, "stats": _op_stats, "scan": AdminOps._op_scan,
            "verify": AdminOps._op_verify, "shm_attach": ShmOps._op_shm_attach, "shm_detach": ShmOps._op_shm_detach}

    def stats(self, viewer: Optional[Tenant] = None) -> dict:
        """Counters as ``viewer`` (default: an admin) may see them (:meth:`.page_store.PageStore.stats`): keys,
        bytes, capacity_bytes, tenants (per tenant: pages, bytes, quota_bytes, evict, hits, misses, sets,
        set_failures, refused, evictions, deletes, spilled, spill_hits), pending_writes, requests, errors, hits,
        misses, sets, set_failures, refused, evictions, bytes_read/bytes_written, rss_bytes; bad traffic
        (:data:`BAD_TRAFFIC`); connections_accepted/closed/open; tokens_reloads(_failures); to an admin also
        cross_tenant_misses (requests for a page only another tenant holds); shared memory: shm_segments,
        shm_attached, shm_refused, shm_bytes_in/out; presence (the table's file name, or None), presence_slots,
        presence_tables. A tenant that is not an admin sees its own hits, misses, sets and set_failures."""
        viewer = viewer or Tenant("-", self.capacity_bytes, admin=True)
        s: dict = dict(self.counters)
        if viewer.admin:
            s.update(evictions=sum(tp.counters["evictions"] for tp in self.store.tenants.values()))
            s.update(self.store.stats(viewer))
        else:
            own = self.store.of(viewer).counters
            s.update({k: own[k] for k in ("hits", "misses", "sets", "set_failures", "evictions")})
            s.update(self.store.stats(viewer))
        s.update(pending_writes=self.pending_writes, uptime_s=round(time.time() - self.started, 3),
                 rss_bytes=_rss_bytes(), pid=os.getpid(), spill=self.spill, shm_segments=len(self.segments),
                 connections_open=self.counters["connections_accepted"] - self.counters["connections_closed"])
        return s

    # ----------------------------------------------------------------------------------------- loop
    def stop(self, *_a) -> None:
        self._stop = True

    def hup(self, *_a) -> None:
        """SIGHUP: re-read the tokens file at the next turn of the loop (never inside the signal handler)."""
        self._reload = True

    def _watch(self) -> None:
        """Count connections from the socket monitor: accepted, closed, closed before the handshake finished."""
        while True:
            try:
                ev = parse_monitor_message(self.monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.Again:
                return
            kind, fd = ev["event"], ev["value"]
            if kind == zmq.EVENT_ACCEPTED:
                self.counters["connections_accepted"] += 1
            elif kind == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self._handshaken.add(fd)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.counters["connections_closed"] += 1
                if fd in self._handshaken:
                    self._handshaken.discard(fd)
                else:
                    self.counters["handshakes_failed"] += 1

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (or SIGTERM/SIGINT when installed by :func:`main`)."""
        sock = self.sock
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(self.monitor, zmq.POLLIN)
        while not self._stop:
            if self._reload:
                self._reload = False
                self.reload_tenants()
            try:
                ready = dict(poller.poll(_POLL_MS))
            except zmq.ZMQError as e:
                if e.errno == zmq.EINTR:
                    continue
                raise
            if self.monitor in ready:
                self._watch()
            if sock not in ready:
                continue
            for _ in range(_BATCH_RECV):
                try:
                    frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                except zmq.ZMQError as e:
                    if e.errno == zmq.EINTR:
                        break
                    raise
                ident, body = frames[0], frames[1:]
                reply = self.handle(body)
                if reply is None:
                    continue
                try:
                    sock.send_multipart([ident] + reply, zmq.NOBLOCK, copy=False)
                except zmq.ZMQError as e:  # EAGAIN: its reply queue is full (it does not read); EHOSTUNREACH: gone
                    self.counters["dropped"] += 1
                    self.counters["replies_dropped"] += 1
                    if e.errno not in (zmq.EAGAIN, zmq.EHOSTUNREACH):
                        log.warning("reply dropped: %s", e)

    def close(self) -> None:
        try:
            for name in list(self.segments):
                self._unmap(name)
            self.store.close()
            self.sock.disable_monitor()
            self.monitor.close(0)
            self.sock.close(0)
            self.ctx.term()
        finally:
            pass


def keep_freed_memory(capacity_bytes: int) -> bool:
    """Tune glibc's allocator for a server whose working set is its capacity; returns True when applied.

    libzmq's I/O thread mallocs every received payload frame and the server keeps it as the stored page; with
    glibc's defaults, freed frames (evicted, deleted, cleared pages) often go back to the kernel (a per-thread
    arena's empty heap is unmapped, the main heap is trimmed), so the next pages land in fresh memory and pay a
    page fault per 4 KiB (the cost measured: benchmarks/README.md, "Measurements behind code choices").
    Here one arena serves every thread (``M_ARENA_MAX`` 1: no per-thread heaps to unmap), frames up to 32 MiB come
    from it (``M_MMAP_THRESHOLD``), and up to ``capacity_bytes`` of free memory stays mapped for reuse
    (``M_TRIM_THRESHOLD``), so a server that has once been full keeps receiving into already-mapped memory.
    Call it before the ZMQ context exists (:func:`tierkv.cli_server.run` does). A no-op (False) off glibc."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        import ctypes

        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold, m_arena_max = -1, -3, -8  # glibc <malloc.h>
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(m_arena_max, 1) and mallopt(m_mmap_threshold, 32 << 20)
                and mallopt(m_trim_threshold, min(int(capacity_bytes), (1 << 31) - 1)))


def sweep_dead_presence(shm_dir: str = P.SHM_DIR) -> int:
    """Remove this user's presence tables (:mod:`.presence_table`) whose server is gone (killed by SIGKILL: its
    file stays). Returns files removed (:func:`~.shm_segment.sweep_dead_files`)."""
    return sweep_dead_files(shm_dir, PRESENCE_NAME_RE, len(PRESENCE_PREFIX))


@functools.lru_cache(maxsize=1024)
def is_loopback(host: str) -> bool:
    """True for addresses only this machine can reach (``127.0.0.0/8``, ``::1``, ``localhost``). Cached: the server
    asks it of the peer address of every shared-memory request (``ipaddress`` parsing showed in its profile)."""
    if host == "localhost":
        return True
    import ipaddress

    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # an interface name or host name: assume it is reachable from elsewhere


def _local_peer(frame: Any) -> bool:
    """True when the request came over loopback (ZMQ's ``Peer-Address`` of the frame), or from this process (a
    frame that is not a ZMQ frame: a direct :meth:`CacheServer.handle` call). Only such clients may use the
    shared-memory path: a remote client must never reach a local client's segment through the server."""
    if not isinstance(frame, zmq.Frame):
        return True
    try:
        peer = frame.get("Peer-Address")
    except (zmq.ZMQError, ValueError, TypeError):
        return False
    return isinstance(peer, str) and is_loopback(peer)


class _Redact(logging.Filter):
    """Replaces the server token by ``***`` in every record of the ``tierkv`` loggers (message and arguments)."""

    def __init__(self, token: str):
        super().__init__()
        self.token = token

    def filter(self, record: logging.LogRecord) -> bool:
        t = self.token
        msg = record.getMessage()
        if t in msg:
            record.msg, record.args = msg.replace(t, "***"), ()
        if record.exc_info and record.exc_info[1] is not None and t in str(record.exc_info[1]):
            record.exc_info, record.exc_text = None, None
        return True


def _install_redaction(token: str) -> None:
    for name in ("tierkv", "tierkv.zmq_server", "tierkv.storage.file"):
        lg = logging.getLogger(name)
        if not any(isinstance(f, _Redact) and f.token == token for f in lg.filters):
            lg.addFilter(_Redact(token))


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError):
        return 0
