"""tierkv ZMQ cache server: a standalone process that holds L3 pages in memory for several engines.

Run it as ``tierkv server`` or ``python -m tierkv.cli_server`` (same flags; the command line is
:mod:`tierkv.cli_server`). It binds a ZMQ ROUTER socket on ``--host`` (127.0.0.1 unless a wider address is
given explicitly) and ``--port`` (0 = any free port), prints one line ``tierkv-server ready tcp://HOST:PORT``
on stdout once it is listening, and exits cleanly on SIGTERM/SIGINT.

Storage: an LRU of records ``(namespace, key) -> (page record header, payload frame)`` bounded by
``--capacity-bytes``
(header + payload bytes); received payload frames are kept as they came off the wire and sent back with
zero-copy sends. Evicted records optionally spill to a :class:`tierkv.storage_backends.file.store.FileStore`
under ``--spill-dir`` and are read back (and promoted to memory) on a later get. The server never looks
inside a payload: the client wraps every page with a :mod:`.page_format` header and verifies it on read.

Safe by default (docs/architecture.md §12): a ``--host`` beyond loopback without a token (``--token``,
``--token-file``, ``$TIERKV_SERVER_TOKEN``) refuses to start (exit 5) unless ``--allow-unauthenticated`` is given;
with a token every request (the destructive ``delete``, ``clear``, ``verify`` with ``fix`` included) must carry it;
error replies and log lines carry ``***`` in its place. The admin ops ``scan`` and ``verify`` (protocol version 2)
serve ``tierkv store stats|verify``.

Same-host clients may attach a shared-memory segment of their own (``shm_attach``, protocol version 3): their
get/set requests then name slots of it instead of carrying payload frames, and the server copies pages into and
out of those slots (docs/architecture.md §5, "Shared-memory data path"). The server maps a segment, never creates
or removes one: it belongs to the client. It does publish one file of its own there, once a loopback client asks for
it in a ping and when it runs without a spill directory: the presence table of the keys it holds
(:mod:`.presence_table`), which same-host clients probe to answer ``exists`` without a round trip; the ping reply
names it. A server whose clients never ask (the shared-memory path off) keeps nothing in ``/dev/shm``.

Wire format and safety rules: :mod:`.protocol` (msgpack headers under strict limits, raw payload frames,
an error reply for every request it can attribute, no pickle). Design inspired by LMCache's MP cache server
(DEALER/ROUTER, request ids) and SGLang HiCache's storage semantics (leading-run exists), with the fixes
docs/architecture.md §8 R13, R15, R19 call for.
"""
from __future__ import annotations

import functools
import hmac
import itertools
import logging
import os
import struct
import sys
import time
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import zmq

from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.common import Counters
from tierkv.storage_backends.zmq.presence_table import PRESENCE_NAME_RE, PRESENCE_PREFIX, PresenceTable, fingerprint
from tierkv.storage_backends.shm_segment import Segment, sweep_dead_files

log = logging.getLogger("tierkv.zmq_server")

DEFAULT_PORT = 5557
DEFAULT_CAPACITY_BYTES = 1 << 30
_POLL_MS = 100
_BATCH_RECV = 64
#: most client shared-memory segments mapped at once; attaching one more unmaps the least recently used.
MAX_SEGMENTS = 256
#: a mapped segment whose file is gone (its client closed or died) and that was unused this long is unmapped when
#: another client attaches (seconds).
SEGMENT_IDLE_S = 60.0
#: payload bytes one ``verify`` step hashes at most (a step stops after the record that crosses it).
VERIFY_SLICE_BYTES = 64 << 20
#: ``verify`` sessions kept between steps (one per running ``tierkv store verify``).
MAX_VERIFY_SESSIONS = 8


def _nbytes(buf: Any) -> int:
    if isinstance(buf, zmq.Frame):
        return len(buf)
    return memoryview(buf).nbytes


class _SpillTier:
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


class CacheServer:
    """The server state and request handlers (single-threaded; one ROUTER socket).

    Args:
        host: bind address (default loopback). ``port``: TCP port, 0 = any free one.
        capacity_bytes: bound on stored bytes (page header + payload per record), LRU eviction.
        spill_dir: optional directory for evicted records (a FileStore per record length).
        spill_capacity_bytes: capacity of each spill FileStore (None: the FileStore default, a share of free disk).
        max_message_bytes: largest accepted multipart message (bytes); a single larger frame makes ZMQ drop
            the sender's connection (``ZMQ_MAXMSGSIZE``), a larger total gets an error reply.
        token: optional shared secret every request must carry (compared in constant time).
        enable_test_ops: answer test-only ops (``t_corrupt``) used by the test-suite.
    Raises:
        ValueError: a non-positive capacity or message bound.
    """

    def __init__(self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, capacity_bytes: int = DEFAULT_CAPACITY_BYTES,
                 spill_dir: Optional[str] = None, max_message_bytes: int = P.DEFAULT_MAX_MESSAGE_BYTES,
                 token: Optional[str] = None, enable_test_ops: bool = False,
                 spill_capacity_bytes: Optional[int] = None):
        if capacity_bytes <= 0:
            raise ValueError(f"capacity_bytes must be > 0, got {capacity_bytes}")
        if max_message_bytes <= 0:
            raise ValueError(f"max_message_bytes must be > 0, got {max_message_bytes}")
        if not 0 <= port <= 65535:
            raise ValueError(f"port must be in 0..65535, got {port}")
        self.capacity_bytes = int(capacity_bytes)
        self.max_message_bytes = int(max_message_bytes)
        self.token = token.encode() if token else None
        self._token_text = token or None
        if token:
            _install_redaction(token)
        self.enable_test_ops = enable_test_ops
        self.records: "OrderedDict[tuple[bytes, str], tuple[bytes, Any]]" = OrderedDict()
        self.written: dict[tuple[bytes, str], float] = {}  # time.time() of each in-memory record's last set (scan)
        self.used_bytes = 0
        self.pending_writes = 0
        self.counters = Counters("requests", "auth_failures", "too_large", "dropped", "spilled", "spill_hits", "deletes",
                                 "shm_attached", "shm_refused", "shm_bytes_in", "shm_bytes_out", "presence_tables")
        #: client segments: name -> [Segment, last use (monotonic seconds)]
        self.segments: "OrderedDict[str, list]" = OrderedDict()
        self.spill = _SpillTier(spill_dir, spill_capacity_bytes) if spill_dir else None
        #: the presence table same-host clients probe: made when the first loopback client asks for it (ping with
        #: ``presence``), never with a spill tier (whose evictions it cannot follow), None while /dev/shm is unusable;
        #: replaced by a fresh one when full (:meth:`_presence_rebuild`)
        self.presence: Optional[PresenceTable] = None
        #: whether the request being handled came from this host (the ping reply names the presence table only then)
        self._peer_local = False
        #: unfinished ``verify`` sessions: id -> job (see :meth:`_op_verify`)
        self._verifies: "OrderedDict[int, dict]" = OrderedDict()
        self._verify_ids = itertools.count(int.from_bytes(os.urandom(6), "little"))
        self.started = time.time()
        self._stop = False
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, self.max_message_bytes)
        self.sock.setsockopt(zmq.SNDHWM, 1000)
        self.sock.setsockopt(zmq.RCVHWM, 1000)
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

    # ----------------------------------------------------------------------------------------- storage
    def _evict_until(self, need: int) -> None:
        while self.records and self.used_bytes + need > self.capacity_bytes:
            (ns, key), (hdr, payload) = self.records.popitem(last=False)
            self.written.pop((ns, key), None)
            self.used_bytes -= len(hdr) + _nbytes(payload)
            self._presence_discard(ns, key)
            self.counters["evictions"] += 1
            if self.spill is not None and self.spill.put(ns, key, hdr, payload):
                self.counters["spilled"] += 1

    def _put(self, ns: bytes, key: str, hdr: bytes, payload: Any, born: Optional[float] = None) -> bool:
        size = len(hdr) + _nbytes(payload)
        if size > self.capacity_bytes:
            return False
        old = self.records.pop((ns, key), None)
        if old is not None:
            self.used_bytes -= len(old[0]) + _nbytes(old[1])
        self._evict_until(size)
        if self.spill is not None:
            self.spill.tombstones.discard((ns, key))
        self.records[(ns, key)] = (hdr, payload)
        if old is None:
            self._presence_add(ns, key)
        self.written[(ns, key)] = time.time() if born is None else born
        self.used_bytes += size
        return True

    def _lookup(self, ns: bytes, key: str) -> Optional[tuple[bytes, Any]]:
        rec = self.records.get((ns, key))
        if rec is not None:
            self.records.move_to_end((ns, key))
            return rec
        if self.spill is not None:
            got = self.spill.get(ns, key)
            if got is not None:
                self.counters["spill_hits"] += 1
                self._put(ns, key, got[0], got[1], born=got[2] if len(got) > 2 else None)
                return got
        return None

    def _presence_rebuild(self, extra: tuple = ()) -> None:
        """Publish a fresh presence table and retire the old one (when a client first asks for one, and when the old
        one is full of removed entries or too small): the old one's entries plus ``extra`` fingerprints (the key
        whose ``add`` found it full), or for a first table every in-memory key; the first one also sweeps tables
        that killed servers left behind. On failure (no /dev/shm, no space) the clients ask over ZMQ, and the next
        ping that asks for a table tries again."""
        old, self.presence = self.presence, None
        try:
            if old is None:
                sweep_dead_presence()
            live = (old.entries() if old is not None
                    else np.fromiter((fingerprint(ns, k) for ns, k in self.records), dtype=np.uint64))
            self.presence = PresenceTable.create(P.SHM_DIR, np.append(live, np.array(extra, dtype=np.uint64)))
            self.counters["presence_tables"] += 1
        except OSError as e:
            log.info("no presence table in %s (%s): clients ask over ZMQ whether pages exist", P.SHM_DIR, e)
        if old is not None:
            old.retire()

    def _presence_add(self, ns: bytes, key: str) -> None:
        t = self.presence
        if t is not None:
            fp = fingerprint(ns, key)
            if not t.add(fp) or t.full():
                self._presence_rebuild((fp,))

    def _presence_discard(self, ns: bytes, key: str) -> None:
        t = self.presence
        if t is not None:
            t.discard(fingerprint(ns, key))
            if t.full():
                self._presence_rebuild()

    def _present(self, ns: bytes, key: str) -> bool:
        return (ns, key) in self.records or (self.spill is not None and self.spill.exists(ns, key))

    # ----------------------------------------------------------------------------------------- requests
    def handle(self, frames: list) -> Optional[list]:
        """Answer one request (``frames`` = header frame + payload frames, without the ROUTER identity).

        Returns the reply frames, or None to drop the message. Never raises for bad input."""
        self.counters["requests"] += 1
        if not frames:
            self.counters["dropped"] += 1
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
            if self.token is not None:
                tok = h.get("token")
                if not isinstance(tok, str) or not hmac.compare_digest(tok.encode(), self.token):
                    self.counters["auth_failures"] += 1
                    raise P.ProtocolError("auth", "missing or wrong token")
            fn = self._OPS.get(op)
            if fn is None and self.enable_test_ops and op in P.TEST_OPS:
                fn = CacheServer._op_t_corrupt
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

    def _op_ping(self, h, payloads):
        """Who we are; to a client on this host that asks (``presence: true``) also the name of the presence table
        (``presence``, a file name in /dev/shm), made now if there is none yet; absent without a table (a spill
        tier, /dev/shm unusable; older servers never send it)."""
        body = {"server": "tierkv", "proto": P.PROTOCOL_VERSION, "protos": list(P.SUPPORTED_VERSIONS),
                "token_required": self.token is not None, "shm": os.path.isdir(P.SHM_DIR)}
        if h.get("presence") is True and self._peer_local and self.spill is None:
            if self.presence is None:
                self._presence_rebuild()
            if self.presence is not None:
                body["presence"] = self.presence.name
        return body, []

    # ----------------------------------------------------------------------------------------- shared memory
    def _unmap(self, name: str) -> bool:
        seg = self.segments.pop(name, None)
        if seg is None:
            return False
        seg[0].close()
        return True

    def _op_shm_attach(self, h, payloads):
        """Map the client's segment ``/dev/shm/<name>`` (at least ``size`` bytes) read-write (v3)."""
        name = P.get_shm_name(h)
        size = P.get_int(h, "size", 1, P.MAX_SHM_BYTES)
        self._unmap(name)  # re-attach (the client re-registers after a restart or a failure): map it afresh
        now = time.monotonic()
        for n, seg in list(self.segments.items()):  # segments of clients that went away
            if now - seg[1] > SEGMENT_IDLE_S and not seg[0].exists():
                self._unmap(n)
        while len(self.segments) >= MAX_SEGMENTS:
            self._unmap(next(iter(self.segments)))
        try:
            seg = Segment.open(os.path.join(P.SHM_DIR, name), size)
        except OSError as e:
            self.counters["shm_refused"] += 1
            raise P.ProtocolError("shm", f"cannot open segment {name}: {e.strerror}") from None
        except ValueError:
            self.counters["shm_refused"] += 1
            raise P.ProtocolError("shm", f"segment {name} is not a regular file of >= {size} bytes") from None
        self.segments[name] = [seg, now]
        self.counters["shm_attached"] += 1
        return {"attached": True}, []

    def _op_shm_detach(self, h, payloads):
        """Unmap the client's segment (v3); the client removes the file."""
        return {"detached": self._unmap(P.get_shm_name(h))}, []

    def _segment(self, h) -> tuple:
        """``(memoryview of the segment, its size)`` named by ``shm``. Raises :class:`ProtocolError` (``shm_unknown``
        when this server does not hold it, e.g. after a restart)."""
        name = P.get_shm_name(h, "shm")
        seg = self.segments.get(name)
        if seg is None:
            raise P.ProtocolError("shm_unknown", f"segment {name} is not attached")
        seg[1] = time.monotonic()
        self.segments.move_to_end(name)
        return seg[0].mv, seg[0].size

    def _op_exists(self, h, payloads):
        keys, ns = P.get_keys(h), P.get_ns(h)
        want_all = P.get_bool(h, "all")
        present, lead = [], 0
        for k in keys:
            p = self._present(ns, k)
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

    def _op_get(self, h, payloads):
        keys, ns = P.get_keys(h), P.get_ns(h)
        if "shm" in h:
            return self._op_get_shm(h, keys, ns)
        hits, hdrs, out = [], [], []
        for k in keys:
            rec = self._lookup(ns, k)
            if rec is None:
                hits.append(False)
                self.counters["misses"] += 1
                continue
            hits.append(True)
            hdrs.append(rec[0])
            out.append(rec[1])
            self.counters["hits"] += 1
            self.counters["bytes_read"] += _nbytes(rec[1])
        return {"hits": hits, "hdrs": hdrs}, out

    def _op_get_shm(self, h, keys, ns):
        """``get`` into slots of the client's segment: one copy per hit from the stored payload into its slot."""
        mv, size = self._segment(h)
        length = P.get_int(h, "len", 1, size)
        offs = P.get_offsets(h, len(keys), length, size)
        hits, hdrs, bad = [], [], 0
        for k, off in zip(keys, offs):
            rec = self._lookup(ns, k)
            pl = None if rec is None else (rec[1].buffer if isinstance(rec[1], zmq.Frame) else memoryview(rec[1]))
            if pl is None or pl.nbytes != length:
                bad += pl is not None
                hits.append(False)
                self.counters["misses"] += 1
                continue
            mv[off:off + length] = pl.cast("B") if pl.format != "B" or pl.ndim != 1 else pl
            hits.append(True)
            hdrs.append(rec[0])
            self.counters["hits"] += 1
            self.counters["bytes_read"] += length
            self.counters["shm_bytes_out"] += length
        return {"hits": hits, "hdrs": hdrs, "bad": bad}, []

    def _op_set(self, h, payloads):
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
        ev0 = self.counters["evictions"]
        try:
            stored = []
            for k, hdr, frame in zip(keys, hdrs, payloads):
                ok = self._put(ns, k, hdr, frame)
                stored.append(ok)
                self.counters["sets" if ok else "set_failures"] += 1
        finally:
            self.pending_writes -= 1
        return {"stored": stored, "evicted": self.counters["evictions"] - ev0}, []

    def _op_delete(self, h, payloads):
        n, ns = 0, P.get_ns(h)
        for k in P.get_keys(h):
            rec = self.records.pop((ns, k), None)
            self.written.pop((ns, k), None)
            if rec is not None:
                self.used_bytes -= len(rec[0]) + _nbytes(rec[1])
                self._presence_discard(ns, k)
            spilled = self.spill.delete(ns, k) if self.spill is not None else False
            n += int(rec is not None or spilled)
        self.counters["deletes"] += n
        return {"deleted": n}, []

    def _op_clear(self, h, payloads):
        ns = P.get_ns(h)
        mine = [k for k in self.records if k[0] == ns]
        for k in mine:
            hdr, payload = self.records.pop(k)
            self.written.pop(k, None)
            self.used_bytes -= len(hdr) + _nbytes(payload)
            self._presence_discard(*k)
        if self.spill is not None:
            self.spill.clear(ns)
        return {"cleared": len(mine)}, []

    def _op_stats(self, h, payloads):
        return {"stats": self.stats()}, []

    def _redact(self, text: str) -> str:
        """``text`` with the token replaced by ``***`` (error replies and log lines never carry it)."""
        t = self._token_text
        return text.replace(t, "***") if t and t in text else text

    def _all_records(self, ns: Optional[bytes] = None, headers_only: bool = False):
        """Yield ``(ns, key, header, payload, written_at, where)`` for every record in memory, then in the spill
        directory (``where``: ``"memory"`` or ``"spill"``); ``ns``: only that namespace. ``headers_only``: spilled
        payloads are given as their length (int), not read."""
        for (rns, key), (hdr, payload) in list(self.records.items()):
            if ns is None or rns == ns:
                yield rns, key, hdr, payload, self.written.get((rns, key), self.started), "memory"
        if self.spill is not None:
            yield from self.spill.records(ns, skip=self.records, headers_only=headers_only)

    def _op_scan(self, h, payloads):
        """Per-namespace pages, bytes, payload sizes, page format versions and an age histogram (v2)."""
        from tierkv.storage_backends import page_format

        now = time.time()
        per: dict[bytes, dict] = {}
        for rns, _key, hdr, payload, born, _where in self._all_records(headers_only=True):
            d = per.get(rns)
            if d is None:
                d = per[rns] = {"ns": rns, "pages": 0, "bytes": 0, "payload_bytes": set(), "versions": set(),
                                "ages": [0] * (len(P.AGE_BUCKETS_S) + 1)}
            n = payload if isinstance(payload, int) else _nbytes(payload)
            d["pages"] += 1
            d["bytes"] += len(hdr) + n
            d["payload_bytes"].add(n)
            try:
                d["versions"].add(page_format.read_header(hdr)["version"])
            except page_format.PageFormatError:
                d["versions"].add(-1)
            d["ages"][_bucket(now - born)] += 1
        out = []
        for d in per.values():
            d["payload_bytes"] = sorted(d["payload_bytes"])[:64]
            d["versions"] = sorted(d["versions"])
            out.append(d)
        return {"namespaces": out, "age_buckets_s": list(P.AGE_BUCKETS_S), "now": now}, []

    def _verify_records(self, ns: Optional[bytes]):
        """Yield ``(ns, key, header, payload, where)`` for a verify: the in-memory records of a snapshot of the keys
        taken at the first step (a record dropped or replaced meanwhile is skipped, its replacement being checked in
        its place), then the spilled records as :meth:`_SpillTier.records` walks them. Between two steps of a session
        other requests run, so a record moved between memory and the spill directory meanwhile (evicted, or read back
        by a get) may be checked twice or not at all."""
        for k in [k for k in self.records if ns is None or k[0] == ns]:
            rec = self.records.get(k)
            if rec is not None:
                yield k[0], k[1], rec[0], rec[1], "memory"
        if self.spill is not None:
            for rns, key, hdr, payload, _born, where in self.spill.records(ns, skip=self.records):
                yield rns, key, hdr, payload, where

    def _verify_step(self, job: dict, limit: Optional[int]) -> bool:
        """Check up to ``limit`` records (None: all) of ``job`` (its counters are updated in place), or fewer once
        :data:`VERIFY_SLICE_BYTES` of payload were hashed; with ``job["fix"]`` drop the bad ones. Returns True when
        the job has no records left."""
        from tierkv.storage_backends import page_format

        n = hashed = 0
        for rns, key, hdr, payload, where in job["records"]:
            job["checked"] += 1
            n += 1
            hashed += _nbytes(payload)
            try:
                page_format.check_record(hdr, payload.buffer if isinstance(payload, zmq.Frame) else payload,
                                         key=key, namespace=rns)
                job["good"] += 1
            except page_format.NewerFormatError:
                job["newer"] += 1
            except page_format.PageFormatError as e:
                job["bad"] += 1
                job["reasons"][str(e)] = job["reasons"].get(str(e), 0) + 1
                if job["fix"]:
                    cur = self.records.get((rns, key)) if where == "memory" else None
                    if cur is not None and cur[0] is hdr and cur[1] is payload:  # the record checked, not a newer one
                        del self.records[(rns, key)]
                        self._presence_discard(rns, key)
                        self.written.pop((rns, key), None)
                        self.used_bytes -= len(hdr) + _nbytes(payload)
                        job["removed"] += 1
                    elif where == "spill" and self.spill.delete(rns, key):
                        job["removed"] += 1
            if limit is not None and (n >= limit or hashed >= VERIFY_SLICE_BYTES):
                return False
        return True

    def _op_verify(self, h, payloads):
        """Check every record (or those of ``ns``); with ``fix`` drop the bad ones (v2).

        Without ``limit`` the whole store is checked before the reply (what older tools send). With ``limit`` (1 ..
        :data:`zmq_protocol.MAX_KEYS` records) a request checks at most that many records (and at most
        :data:`VERIFY_SLICE_BYTES` of payload) and the reply carries ``session`` and ``done``; the next request names
        the ``session`` to go on, so other clients' requests are answered between the steps of a long verify.
        Counts in a reply are the session's totals so far. At most :data:`MAX_VERIFY_SESSIONS` sessions are kept (the
        least recently used one is dropped); naming an unknown one is a ``bad_request``."""
        limit = P.get_int(h, "limit", 1, P.MAX_KEYS) if "limit" in h else None
        if "session" in h:
            sid = P.get_int(h, "session")
            job = self._verifies.pop(sid, None)
            if job is None:
                raise P.ProtocolError("bad_request", f"verify session {sid} is unknown (finished, or dropped after "
                                                     f"{MAX_VERIFY_SESSIONS} newer ones)")
        else:
            sid = next(self._verify_ids) & P.MAX_ID
            job = {"fix": P.get_bool(h, "fix"), "records": self._verify_records(P.get_ns(h) if "ns" in h else None),
                   "checked": 0, "good": 0, "bad": 0, "newer": 0, "removed": 0, "reasons": {}}
        done = self._verify_step(job, limit)
        if not done:
            self._verifies[sid] = job
            while len(self._verifies) > MAX_VERIFY_SESSIONS:
                self._verifies.popitem(last=False)
        elif job["removed"]:
            log.info("verify: dropped %d bad records", job["removed"])
        body = {k: job[k] for k in ("checked", "good", "bad", "newer", "removed", "reasons")}
        if limit is not None:
            body.update(session=sid, done=done)
        return body, []

    def _op_t_corrupt(self, h, payloads):
        """Test-only: damage a stored record in place (``how`` in :data:`zmq_protocol.CORRUPT_HOWS`)."""
        keys, ns = P.get_keys(h), P.get_ns(h)
        how = P.get_str(h, "how")
        if how not in P.CORRUPT_HOWS:
            raise P.ProtocolError("bad_request", f"how={how[:40]!r}: allowed values are {P.CORRUPT_HOWS}")
        done = 0
        for k in keys:
            rec = self.records.get((ns, k))
            if rec is None:
                continue
            hdr, payload = rec
            data = bytes(memoryview(payload.buffer if isinstance(payload, zmq.Frame) else payload))
            if how == "truncate":
                data = data[: len(data) // 2]
            elif how == "flip":
                b = bytearray(data)
                b[len(b) // 2] ^= 0xFF
                data = bytes(b)
            else:
                from tierkv.storage_backends import page_format

                other = bytes(x ^ 0x5A for x in ns)
                hdr = page_format.encode_header(k, other, data)
            self.used_bytes -= len(rec[0]) + _nbytes(rec[1])
            self.records[(ns, k)] = (hdr, data)
            self.used_bytes += len(hdr) + len(data)
            done += 1
        return {"corrupted": done}, []

    _OPS = {"ping": _op_ping, "exists": _op_exists, "get": _op_get, "set": _op_set, "delete": _op_delete,
            "clear": _op_clear, "stats": _op_stats, "scan": _op_scan, "verify": _op_verify,
            "shm_attach": _op_shm_attach, "shm_detach": _op_shm_detach}

    def stats(self) -> dict:
        """Server counters: keys, bytes (stored), capacity_bytes, pending_writes, requests, errors, auth_failures,
        too_large, hits, misses, sets, set_failures (sets refused), evictions, spilled, spill_hits, bytes_read (served),
        bytes_written (received), rss_bytes;
        shared memory: shm_segments (mapped now), shm_attached, shm_refused, shm_bytes_in/out (payload bytes);
        presence (the presence table's file name, or None), presence_slots, presence_tables (tables published)."""
        s: dict = dict(self.counters)
        s.update(keys=len(self.records), bytes=self.used_bytes, capacity_bytes=self.capacity_bytes,
                 pending_writes=self.pending_writes, uptime_s=round(time.time() - self.started, 3),
                 rss_bytes=_rss_bytes(), pid=os.getpid(), spill=bool(self.spill), shm_segments=len(self.segments),
                 presence=self.presence.name if self.presence else None,
                 presence_slots=self.presence.slots if self.presence else 0)
        return s

    # ----------------------------------------------------------------------------------------- loop
    def stop(self, *_a) -> None:
        self._stop = True

    def serve_forever(self) -> None:
        """Serve until :meth:`stop` (or SIGTERM/SIGINT when installed by :func:`main`)."""
        sock = self.sock
        while not self._stop:
            try:
                if not sock.poll(_POLL_MS, zmq.POLLIN):
                    continue
            except zmq.ZMQError as e:
                if e.errno == zmq.EINTR:
                    continue
                raise
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
                except zmq.Again:
                    self.counters["dropped"] += 1
                except zmq.ZMQError as e:
                    self.counters["dropped"] += 1
                    log.warning("reply dropped: %s", e)

    def close(self) -> None:
        try:
            for name in list(self.segments):
                self._unmap(name)
            if self.presence is not None:
                self.presence.retire()
                self.presence = None
            self.sock.close(0)
            self.ctx.term()
        finally:
            if self.spill is not None:
                self.spill.close()


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


def _bucket(age_s: float) -> int:
    for i, b in enumerate(P.AGE_BUCKETS_S):
        if age_s < b:
            return i
    return len(P.AGE_BUCKETS_S)


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
