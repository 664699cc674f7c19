"""Shared-memory and admin request handlers of ``tierkv server`` (mixins of :class:`.server.CacheServer`).

The shared-memory segments of same-host clients (``shm_attach``/``shm_detach``, protocol v3) and the admin ops
``scan``, ``verify`` (protocol v2) and the test-only ``t_corrupt``. They use the server's ``store``, ``counters``,
``segments``, ``table``, ``_tenant`` (the tenant of the request being handled) and ``_verifies``.

A segment belongs to the tenant that attached it: another tenant can neither name it in a get/set nor detach it.
``scan`` and ``verify`` see only the requesting tenant's records; a verify session belongs to its tenant.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Optional

import zmq

from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.shm_segment import Segment
from tierkv.storage_backends.zmq.server.page_store import VERIFY_SLICE_BYTES, nbytes

log = logging.getLogger("tierkv.zmq_server")

#: most client shared-memory segments mapped at once; attaching one more unmaps the least recently used.
MAX_SEGMENTS = 256
#: a mapped segment whose file is gone (its client closed or died) and that was unused this long is unmapped when
#: another client attaches (seconds).
SEGMENT_IDLE_S = 60.0
#: ``verify`` sessions kept between steps (one per running ``tierkv store verify``).
MAX_VERIFY_SESSIONS = 8


class ShmOps:
    """Shared-memory segments of same-host clients."""

    def _unmap(self, name: str) -> bool:
        seg = self.segments.pop(name, None)
        if seg is None:
            return False
        seg[0].close()
        return True

    def _op_shm_attach(self, h, payloads):
        """Map the client's segment ``/dev/shm/<name>`` (at least ``size`` bytes) read-write (v3); it belongs to the
        attaching tenant (a segment another tenant holds is refused)."""
        name = P.get_shm_name(h)
        size = P.get_int(h, "size", 1, P.MAX_SHM_BYTES)
        held = self.segments.get(name)
        if held is not None and held[2] != self._tenant.name:
            self.counters["shm_refused"] += 1
            raise P.ProtocolError("shm", f"segment {name} is attached by another client")
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
        self.segments[name] = [seg, now, self._tenant.name]
        self.counters["shm_attached"] += 1
        return {"attached": True}, []

    def _op_shm_detach(self, h, payloads):
        """Unmap the client's segment (v3); the client removes the file."""
        name = P.get_shm_name(h)
        seg = self.segments.get(name)
        return {"detached": seg is not None and seg[2] == self._tenant.name and self._unmap(name)}, []

    def _segment(self, h) -> tuple:
        """``(memoryview of the segment, its size)`` named by ``shm``. Raises :class:`ProtocolError` (``shm_unknown``
        when this server does not hold it for this tenant, e.g. after a restart)."""
        name = P.get_shm_name(h, "shm")
        seg = self.segments.get(name)
        if seg is None or seg[2] != self._tenant.name:
            raise P.ProtocolError("shm_unknown", f"segment {name} is not attached")
        seg[1] = time.monotonic()
        self.segments.move_to_end(name)
        return seg[0].mv, seg[0].size


class AdminOps:
    """``scan``, ``verify`` and the test-only ``t_corrupt``."""

    def _op_scan(self, h, payloads):
        """Per-namespace pages, bytes, payload sizes, page format versions and an age histogram of the requesting
        tenant's records (v2)."""
        from tierkv.storage_backends import page_format

        now = time.time()
        per: dict[bytes, dict] = {}
        for rns, _key, hdr, payload, born, _where in self.store.records(self._tenant, headers_only=True):
            d = per.get(rns)
            if d is None:
                d = per[rns] = {"ns": rns, "pages": 0, "bytes": 0, "payload_bytes": set(), "versions": set(),
                                "ages": [0] * (len(P.AGE_BUCKETS_S) + 1)}
            n = payload if isinstance(payload, int) else nbytes(payload)
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
        return {"namespaces": out, "age_buckets_s": list(P.AGE_BUCKETS_S), "now": now, "tenant": self._tenant.name}, []

    def _verify_step(self, job: dict, limit: Optional[int]) -> bool:
        """Check up to ``limit`` records (None: all) of ``job`` (its counters are updated in place), or fewer once
        :data:`VERIFY_SLICE_BYTES` of payload were hashed; with ``job["fix"]`` drop the bad ones. Returns True when
        the job has no records left. Between two steps other requests run, so a record moved between memory and the
        spill directory meanwhile may be checked twice or not at all."""
        from tierkv.storage_backends import page_format

        tenant = self.table.tenants[job["tenant"]]
        n = hashed = 0
        for rns, key, hdr, payload, _born, where in job["records"]:
            job["checked"] += 1
            n += 1
            hashed += nbytes(payload)
            try:
                page_format.check_record(hdr, payload.buffer if isinstance(payload, zmq.Frame) else payload,
                                         key=key, namespace=rns)
                job["good"] += 1
            except page_format.NewerFormatError:
                job["newer"] += 1
            except page_format.PageFormatError as e:
                job["bad"] += 1
                job["reasons"][str(e)] = job["reasons"].get(str(e), 0) + 1
                if job["fix"] and self.store.drop_if_same(tenant, rns, key, hdr, payload, where):
                    job["removed"] += 1
            if limit is not None and (n >= limit or hashed >= VERIFY_SLICE_BYTES):
                return False
        return True

    def _op_verify(self, h, payloads):
        """Check every record of the requesting tenant (or those of ``ns``); with ``fix`` drop the bad ones (v2).

        Without ``limit`` the whole store is checked before the reply (what older tools send). With ``limit`` (1 ..
        :data:`zmq_protocol.MAX_KEYS` records) a request checks at most that many records (and at most
        :data:`VERIFY_SLICE_BYTES` of payload) and the reply carries ``session`` and ``done``; the next request names
        the ``session`` to go on. Counts in a reply are the session's totals so far. At most
        :data:`MAX_VERIFY_SESSIONS` sessions are kept (the least recently used one is dropped); naming an unknown one
        (or another tenant's) is a ``bad_request``."""
        limit = P.get_int(h, "limit", 1, P.MAX_KEYS) if "limit" in h else None
        if "session" in h:
            sid = P.get_int(h, "session")
            job = self._verifies.get(sid)
            if job is None or job["tenant"] != self._tenant.name:
                raise P.ProtocolError("bad_request", f"verify session {sid} is unknown (finished, or dropped after "
                                                     f"{MAX_VERIFY_SESSIONS} newer ones)")
            del self._verifies[sid]
        else:
            sid = next(self._verify_ids) & P.MAX_ID
            ns = P.get_ns(h) if "ns" in h else None
            job = {"fix": P.get_bool(h, "fix"), "tenant": self._tenant.name,
                   "records": self.store.records(self._tenant, ns),
                   "checked": 0, "good": 0, "bad": 0, "newer": 0, "removed": 0, "reasons": {}}
        done = self._verify_step(job, limit)
        if not done:
            self._verifies[sid] = job
            while len(self._verifies) > MAX_VERIFY_SESSIONS:
                self._verifies.popitem(last=False)
        elif job["removed"]:
            log.info("verify: dropped %d bad records of tenant %r", job["removed"], job["tenant"])
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
        recs = self.store.of(self._tenant).records
        for k in keys:
            rec = recs.get((ns, k))
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

                hdr = page_format.encode_header(k, bytes(x ^ 0x5A for x in ns), data)
            self.store.replace(self._tenant, ns, k, hdr, data)
            done += 1
        return {"corrupted": done}, []


def _bucket(age_s: float) -> int:
    for i, b in enumerate(P.AGE_BUCKETS_S):
        if age_s < b:
            return i
    return len(P.AGE_BUCKETS_S)
