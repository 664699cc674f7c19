"""The page store of ``tierkv server``: one namespace per tenant, each a set of records under a quota.

A record is ``(client namespace, key) -> (page record header, payload frame)`` inside its tenant's
:class:`TenantPages`; the same key written by two tenants is two records, and a tenant's requests (get, exists,
delete, clear, scan, verify) only ever see its own. Bytes = record header + payload.
Writes: over its ``quota_bytes`` a tenant evicts its own records in ``eviction_policy`` order (lru, the default:
least recently used first; lfu, slru, s3fifo: :mod:`tierkv.storage_backends.eviction`); over the server's
``capacity_bytes`` the store evicts from the tenant using the largest share of its quota (so a tenant that writes much
evicts itself first). A tenant with ``evict`` off never loses a record to make room for its own writes: they are
refused (``refused``) instead. Evicted records optionally go to a per-tenant :class:`.spill.SpillTier`.
The presence table (:mod:`.presence_table`) is kept only while the store has one tenant (it would tell any local
process which keys another tenant holds). Single-threaded, like the server that owns it.
"""
from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any, Optional

import numpy as np
import zmq

from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.common import Counters
from tierkv.storage_backends.eviction import make_key_policy
from tierkv.storage_backends.zmq.presence_table import PRESENCE_NAME_RE, PRESENCE_PREFIX, PresenceTable, fingerprint
from tierkv.storage_backends.shm_segment import sweep_dead_files
from tierkv.storage_backends.zmq.server.spill import SpillTier
from tierkv.storage_backends.zmq.server.tenants import DEFAULT_TENANT, Tenant, TenantTable

log = logging.getLogger("tierkv.zmq_server")

#: payload bytes one ``verify`` step hashes at most (a step stops after the record that crosses it).
VERIFY_SLICE_BYTES = 64 << 20
#: per-tenant counters (``stats``' ``tenants`` map)
TENANT_COUNTERS = ("hits", "misses", "sets", "set_failures", "refused", "evictions", "deletes", "spilled",
                   "spill_hits")


def nbytes(buf: Any) -> int:
    if isinstance(buf, zmq.Frame):
        return len(buf)
    return memoryview(buf).nbytes


def _size(hdr: bytes, payload: Any) -> int:
    return len(hdr) + nbytes(payload)


class TenantPages:
    """One tenant's records (least recently used first), their eviction order (``order``, the store's policy), write
    times, bytes and counters."""

    def __init__(self, tenant: Tenant, policy: str = "lru"):
        self.tenant = tenant
        self.records: "OrderedDict[tuple[bytes, str], tuple[bytes, Any]]" = OrderedDict()
        self.order = make_key_policy(policy)
        self.written: dict[tuple[bytes, str], float] = {}  # time.time() of each record's last set (scan ages)
        self.used = 0
        self.counters = Counters(*TENANT_COUNTERS)
        self.spill: Optional[SpillTier] = None

    def share(self) -> float:
        return self.used / self.tenant.quota_bytes

    def stats(self) -> dict:
        t = self.tenant
        s = {k: self.counters[k] for k in TENANT_COUNTERS}
        s.update(pages=len(self.records), bytes=self.used, quota_bytes=t.quota_bytes, evict=t.evict)
        return s


class PageStore:
    """Every tenant's records, the global capacity, the spill tiers and the presence table.

    Args:
        table: the tenants (:func:`.tenants.single_tenant` or :func:`.tenants.load_tokens_file`).
        capacity_bytes: bound on the bytes of all tenants together. ``spill_dir``, ``spill_capacity_bytes``: the
            optional spill tier (see :class:`.spill.SpillTier`).
        eviction_policy: the order in which each tenant's records are evicted (one of
            :data:`tierkv.storage_backends.eviction.POLICIES`; ValueError otherwise).
    """

    def __init__(self, table: TenantTable, capacity_bytes: int, spill_dir: Optional[str] = None,
                 spill_capacity_bytes: Optional[int] = None, eviction_policy: str = "lru"):
        make_key_policy(eviction_policy)  # checks the name
        self.eviction_policy = eviction_policy
        self.capacity_bytes = int(capacity_bytes)
        self.spill_dir, self.spill_capacity_bytes = spill_dir, spill_capacity_bytes
        self.tenants: dict[str, TenantPages] = {}
        self.used_bytes = 0
        self.counters = dict.fromkeys(("spilled", "spill_hits", "deletes", "presence_tables", "refused",
                                       "cross_tenant_misses"), 0)
        self.presence: Optional[PresenceTable] = None
        self.started = time.time()
        self.apply(table)

    # ------------------------------------------------------------------------------------------- tenants
    def apply(self, table: TenantTable) -> None:
        """Switch to ``table``: new tenants start empty, kept ones keep their records (under a new quota: trimmed at
        once when they may evict), dropped ones lose their records in memory (their spill directory stays)."""
        for name in [n for n in self.tenants if n not in table.tenants]:
            tp = self.tenants.pop(name)
            for k in list(tp.records):
                self._remove(tp, k)
            if tp.spill is not None:
                tp.spill.close()
            log.info("tenant %r removed: its %d bytes in memory dropped", name, tp.used)
        for name, t in table.tenants.items():
            tp = self.tenants.get(name)
            if tp is None:
                tp = self.tenants[name] = TenantPages(t, self.eviction_policy)
                if self.spill_dir:
                    root = self.spill_dir if name == DEFAULT_TENANT else os.path.join(self.spill_dir, "tenants", name)
                    tp.spill = SpillTier(root, self.spill_capacity_bytes)
            tp.tenant = t
            while tp.used > t.quota_bytes and t.evict and tp.records:
                self._evict_one(tp)
        self.multi = table.from_file
        if self.multi and self.presence is not None:
            self.presence.retire()
            self.presence = None

    def of(self, tenant: Tenant) -> TenantPages:
        return self.tenants[tenant.name]

    # ------------------------------------------------------------------------------------------- records
    def _remove(self, tp: TenantPages, k: tuple) -> Optional[tuple]:
        rec = tp.records.pop(k, None)
        if rec is not None:
            tp.written.pop(k, None)
            tp.order.remove(k)
            n = _size(*rec)
            tp.used -= n
            self.used_bytes -= n
            self._presence_discard(*k)
        return rec

    def _evict_one(self, tp: TenantPages) -> None:
        k = tp.order.pop_victim()
        hdr, payload = self._remove(tp, k)
        tp.counters["evictions"] += 1
        if tp.spill is not None and tp.spill.put(k[0], k[1], hdr, payload):
            tp.counters["spilled"] += 1
            self.counters["spilled"] += 1

    def _victim(self) -> Optional[TenantPages]:
        """The tenant to evict from when the server is full: the largest share of its quota among those that may
        evict; None when none may."""
        cands = [tp for tp in self.tenants.values() if tp.records and tp.tenant.evict]
        return max(cands, key=TenantPages.share) if cands else None

    def put(self, tenant: Tenant, ns: bytes, key: str, hdr: bytes, payload: Any,
            born: Optional[float] = None) -> Optional[bool]:
        """Store a record: True stored, None refused (over quota or capacity with eviction off, or larger than the
        quota: counted ``refused``), False too large for the server."""
        tp = self.tenants[tenant.name]
        size = _size(hdr, payload)
        if size > self.capacity_bytes:
            return False
        k = (ns, key)
        old = tp.records.get(k)
        oldsz = 0 if old is None else _size(*old)
        quota, evict = tenant.quota_bytes, tenant.evict
        if size > quota or (not evict and tp.used - oldsz + size > quota):
            return self._refuse(tp)
        if old is not None:
            self._remove(tp, k)
        while tp.used + size > quota:
            self._evict_one(tp)
        while self.used_bytes + size > self.capacity_bytes:
            victim = self._victim()
            if victim is None:
                if old is not None:
                    self._insert(tp, k, *old, tp.written.get(k))
                return self._refuse(tp)
            self._evict_one(victim)
        if tp.spill is not None:
            tp.spill.tombstones.discard(k)
        self._insert(tp, k, hdr, payload, born)
        return True

    def _refuse(self, tp: TenantPages) -> None:
        tp.counters["refused"] += 1
        self.counters["refused"] += 1
        return None

    def _insert(self, tp: TenantPages, k: tuple, hdr: bytes, payload: Any, born: Optional[float]) -> None:
        tp.records[k] = (hdr, payload)
        tp.order.insert(k)
        tp.written[k] = time.time() if born is None else born
        n = _size(hdr, payload)
        tp.used += n
        self.used_bytes += n
        self._presence_add(*k)

    def lookup(self, tenant: Tenant, ns: bytes, key: str) -> Optional[tuple[bytes, Any]]:
        """The record (touched: most recently used), from memory or the spill tier (then read back into memory when
        the quota allows); None for a miss. A miss on a key another tenant holds is counted
        ``cross_tenant_misses`` (never told to the client)."""
        tp = self.tenants[tenant.name]
        k = (ns, key)
        rec = tp.records.get(k)
        if rec is not None:
            tp.records.move_to_end(k)
            tp.order.hit(k)
            return rec
        if tp.spill is not None:
            got = tp.spill.get(ns, key)
            if got is not None:
                tp.counters["spill_hits"] += 1
                self.counters["spill_hits"] += 1
                self.put(tenant, ns, key, got[0], got[1])
                return got
        if len(self.tenants) > 1 and any(k in o.records for o in self.tenants.values() if o is not tp):
            self.counters["cross_tenant_misses"] += 1
        return None

    def present(self, tenant: Tenant, ns: bytes, key: str) -> bool:
        tp = self.tenants[tenant.name]
        return (ns, key) in tp.records or (tp.spill is not None and tp.spill.exists(ns, key))

    def delete(self, tenant: Tenant, ns: bytes, key: str) -> bool:
        tp = self.tenants[tenant.name]
        rec = self._remove(tp, (ns, key))
        spilled = tp.spill.delete(ns, key) if tp.spill is not None else False
        if rec is not None or spilled:
            tp.counters["deletes"] += 1
            self.counters["deletes"] += 1
            return True
        return False

    def clear(self, tenant: Tenant, ns: bytes) -> int:
        """Drop every record of namespace ``ns`` of this tenant (memory and spill); returns those in memory."""
        tp = self.tenants[tenant.name]
        mine = [k for k in tp.records if k[0] == ns]
        for k in mine:
            self._remove(tp, k)
        if tp.spill is not None:
            tp.spill.clear(ns)
        return len(mine)

    def drop_if_same(self, tenant: Tenant, ns: bytes, key: str, hdr: bytes, payload: Any, where: str) -> bool:
        """``verify --fix``: drop the record checked (not a newer one written since). True when dropped."""
        tp = self.tenants[tenant.name]
        if where == "spill":
            return tp.spill is not None and tp.spill.delete(ns, key)
        cur = tp.records.get((ns, key))
        if cur is not None and cur[0] is hdr and cur[1] is payload:
            self._remove(tp, (ns, key))
            return True
        return False

    def replace(self, tenant: Tenant, ns: bytes, key: str, hdr: bytes, payload: Any) -> None:
        """Test-only (``t_corrupt``): swap a record's bytes in place, no quota check."""
        tp = self.tenants[tenant.name]
        k = (ns, key)
        old = tp.records[k]
        d = _size(hdr, payload) - _size(*old)
        tp.records[k] = (hdr, payload)
        tp.used += d
        self.used_bytes += d

    def records(self, tenant: Tenant, ns: Optional[bytes] = None, headers_only: bool = False):
        """Yield ``(ns, key, header, payload, written_at, where)`` for this tenant's records in memory (a snapshot of
        the keys; a record dropped meanwhile is skipped), then in its spill directory (``where``: ``"memory"`` or
        ``"spill"``); ``ns``: only that namespace. ``headers_only``: spilled payloads are given as their length."""
        tp = self.tenants[tenant.name]
        for k in [k for k in tp.records if ns is None or k[0] == ns]:
            rec = tp.records.get(k)
            if rec is not None:
                yield k[0], k[1], rec[0], rec[1], tp.written.get(k, self.started), "memory"
        if tp.spill is not None:
            yield from tp.spill.records(ns, skip=tp.records, headers_only=headers_only)

    def pages(self) -> int:
        return sum(len(tp.records) for tp in self.tenants.values())

    # ------------------------------------------------------------------------------------------- presence
    def presence_rebuild(self, extra: tuple = ()) -> None:
        """Publish a fresh presence table and retire the old one (when a client first asks for one, and when the old
        one is full of removed entries or too small): the old one's entries plus ``extra`` fingerprints (the key
        whose ``add`` found it full), or for a first table every in-memory key; the first one also sweeps tables
        that killed servers left behind. On failure (no /dev/shm, no space) the clients ask over ZMQ, and the next
        ping that asks for a table tries again. Never with several tenants or a spill tier."""
        if self.multi or self.spill_dir:
            return
        old, self.presence = self.presence, None
        try:
            if old is None:
                sweep_dead_files(P.SHM_DIR, PRESENCE_NAME_RE, len(PRESENCE_PREFIX))
            keys = [k for tp in self.tenants.values() for k in tp.records]
            live = (old.entries() if old is not None
                    else np.fromiter((fingerprint(ns, k) for ns, k in keys), dtype=np.uint64))
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
                self.presence_rebuild((fp,))

    def _presence_discard(self, ns: bytes, key: str) -> None:
        t = self.presence
        if t is not None:
            t.discard(fingerprint(ns, key))
            if t.full():
                self.presence_rebuild()

    # ------------------------------------------------------------------------------------------- stats
    def stats(self, viewer: Tenant) -> dict:
        """Counters for ``viewer``: an admin sees the whole server and every tenant; another tenant sees its own
        pages, bytes and quota (as ``keys``, ``bytes``, ``capacity_bytes``) and only its own entry in ``tenants``."""
        if viewer.admin:
            s: dict = dict(self.counters)
            s.update(keys=self.pages(), bytes=self.used_bytes, capacity_bytes=self.capacity_bytes,
                     tenants={n: tp.stats() for n, tp in self.tenants.items()})
        else:
            own = self.tenants[viewer.name]
            s = {k: own.counters[k] for k in ("spilled", "spill_hits", "deletes", "refused")}
            s.update(keys=len(own.records), bytes=own.used, capacity_bytes=viewer.quota_bytes,
                     tenants={viewer.name: own.stats()})
        s.update(tenant=viewer.name, presence=self.presence.name if self.presence else None,
                 presence_slots=self.presence.slots if self.presence else 0)
        return s

    def close(self) -> None:
        if self.presence is not None:
            self.presence.retire()
            self.presence = None
        for tp in self.tenants.values():
            if tp.spill is not None:
                tp.spill.close()
