"""The shared-memory data path of :class:`.client.ZmqStore`: on the server's host, pages travel through a
``/dev/shm`` segment of the client's (``shm_bytes``) that the server maps (``shm_attach``), and get/set requests
name slots of it (byte offsets, one page each) instead of carrying payload frames.

The functions taking the store run with ``store._lock`` held and keep their state on it (``_seg``, ``_seg_attached``,
``_shm_on``). A server that does not offer the path, a refused attach or a segment that cannot be created turns it
off for good (``shm_fallbacks``: pages go as frames); a restarted server is attached again; after a timed-out call
the segment is replaced, so a late server copy never lands in a later call's slots. Pages are verified as on the
frame path. Raises nothing for run-time faults.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from tierkv.storage_backends.page_format import PageFormatError, copy_into, decode_header, encode_headers, verify_payload
from tierkv.storage_backends.shm_segment import Segment, sweep_dead_files
from tierkv.storage_backends.zmq import protocol as P

if TYPE_CHECKING:
    from tierkv.storage_backends.zmq.client import ZmqStore

log = logging.getLogger("tierkv.zmq_client")

#: payload bytes per message on the shared-memory path: the server copies one message's slots while the client
#: fills (set) or verifies (get) the next one's.
SHM_MESSAGE_BYTES = 4 << 20


def sweep_dead_segments(shm_dir: str = P.SHM_DIR) -> int:
    """Remove this user's segment files whose creating process is gone (a client killed by SIGKILL never runs its
    finalizer). The creator's pid is the first 8 hex digits after :data:`zmq_protocol.SHM_PREFIX`. Removing a file
    never breaks a live pair (both keep their mappings; a client whose file is gone makes a new one when it must
    attach again), so a pid seen from another pid namespace costs at most one new segment. Returns files removed
    (:func:`~.shm_segment.sweep_dead_files`)."""
    return sweep_dead_files(shm_dir, P.SHM_NAME_RE, len(P.SHM_PREFIX))


def _Segment(size: int) -> Segment:
    """A new segment of this client (:class:`~.shm_segment.Segment`, ``size`` bytes) named
    :data:`zmq_protocol.SHM_PREFIX` + pid (8 hex digits) + 16 random hex digits; its file is removed by its ``close``,
    when it is collected or at interpreter exit, only by the creating process (a forked child makes its own), and by
    :func:`sweep_dead_segments` when that process died without.

    Raises:
        OSError: the segment cannot be created or mapped (no /dev/shm, no space).
    """
    return Segment.create(P.SHM_DIR, f"{P.SHM_PREFIX}{os.getpid() & 0xFFFFFFFF:08x}{os.urandom(8).hex()}", size)


def drop_segment(store: "ZmqStore") -> None:
    """Forget the segment (closed, i.e. its file removed, only by the process that created it)."""
    if store._seg is not None:
        if store._seg.pid == os.getpid():
            store._seg.close()
        store._seg = None
    store._seg_attached = False


def shm_off(store: "ZmqStore", why: str) -> None:
    """Turn the shared-memory path off for good (counted ``shm_fallbacks``, logged): frames from now on."""
    store.counters["shm_fallbacks"] += 1
    store._shm_on = False
    drop_segment(store)
    log.warning("tierkv zmq server %s: shared-memory path not used (%s); pages travel as ZMQ frames",
                store.endpoint, why)


def shm_ready(store: "ZmqStore") -> Optional[Segment]:
    """The attached segment, creating and attaching it when needed; None = use frames for this call (or for
    good, after :func:`shm_off`). Called with ``store._lock`` held."""
    if not store._shm_on or store._closed:
        return None
    if store._seg is not None and store._seg.pid != os.getpid():  # forked: the parent's slots are not ours
        store._seg, store._seg_attached = None, False
    for attempt in range(2):
        if store._seg is not None and not store._seg_attached and not store._seg.exists():
            log.warning("shared-memory segment %s of %s was removed; creating a new one", store._seg.name,
                        store.endpoint)
            store.counters["shm_recreated"] += 1
            drop_segment(store)
        if store._seg is None:
            try:
                sweep_dead_segments()
                store._seg = _Segment(store.shm_bytes)
            except OSError as e:
                shm_off(store, f"cannot create a {store.shm_bytes}-byte segment in {P.SHM_DIR}: {e}")
                return None
        if store._seg_attached:
            return store._seg
        errs: dict = {}
        ok = store._exchange([({"op": "shm_attach", "v": P.SHM_PROTOCOL_VERSION, "name": store._seg.name,
                               "size": store._seg.size, "keys": []}, [])], lambda i, rh, fr: None, errs)[0]
        if ok:
            store._seg_attached = True
            store.counters["shm_attaches"] += 1
            return store._seg
        code = errs.get(0)
        if code is None:  # no answer: this call fails anyway; try again on the next one
            return None
        if code == "shm" and attempt == 0 and not store._seg.exists():
            continue  # removed between the check and the server's open: make a new one
        shm_off(store, f"server refused shm_attach ({code})")
        return None
    return None


def shm_rounds(store: "ZmqStore", n: int, build: Callable, on_reply: Callable) -> bool:
    """Run a shared-memory get or set of ``n`` pages: rounds of as many pages as the segment holds, each
    round split into messages of :data:`SHM_MESSAGE_BYTES` with their own slots. ``build(seg, s, e, slot0)``
    returns a message; ``on_reply(seg, s, e, slot0, rh, frames)`` applies a reply. Returns False when the
    segment could not be used (the caller then sends the whole batch as frames). Called with ``store._lock`` held."""
    seg = shm_ready(store)
    if seg is None:
        return False
    pb = store.page_bytes
    per_round = min(P.MAX_KEYS, seg.size // pb)
    per_msg = max(1, min(per_round, SHM_MESSAGE_BYTES // pb))
    for rs in range(0, n, per_round):
        chunks = [(s, min(n, rs + per_round, s + per_msg)) for s in range(rs, min(n, rs + per_round), per_msg)]
        for attempt in range(2):
            seg = store._seg if attempt == 0 else shm_ready(store)
            if seg is None:
                return False  # the caller moves the whole batch as frames (or fails it as they do)
            errs: dict = {}
            ff = store.counters["fast_fails"]
            done = store._exchange(
                [lambda s=s, e=e, sg=seg: build(sg, s, e, rs) for s, e in chunks],
                lambda ci, rh, fr, sg=seg: on_reply(sg, *chunks[ci], rs, rh, fr), errs)
            if all(done):
                break
            if any(code == "shm_unknown" for code in errs.values()):  # the server restarted: attach again
                store._seg_attached = False
                continue
            if len(errs) < done.count(False) and store.counters["fast_fails"] == ff:
                # timed out: the server may still copy into these slots later, so never reuse them
                drop_segment(store)
            break
    return True


def get_shm(store: "ZmqStore", keys: Sequence[str], dsts: list, res: list, sums: list) -> bool:
    """:meth:`.client.ZmqStore.batch_get` through the segment: fills ``res`` (hit per key) and ``sums`` (verified
    payload XXH3-64 per hit); False when the segment could not be used (the caller sends frames)."""
    pb = store.page_bytes

    def build(seg, s, e, slot0):
        return {"op": "get", "v": P.SHM_PROTOCOL_VERSION, "ns": store.namespace, "keys": list(keys[s:e]),
                "shm": seg.name, "len": pb, "offs": [(i - slot0) * pb for i in range(s, e)]}, []

    def on_reply(seg, s, e, slot0, rh, frames):
        hits, hdrs = rh.get("hits"), rh.get("hdrs")
        if frames or not isinstance(hits, list) or len(hits) != e - s or not all(isinstance(x, bool) for x in hits):
            raise P.ProtocolError("bad_reply", "get reply: 'hits' is not one bool per key")
        if not isinstance(hdrs, list) or len(hdrs) != sum(hits):
            raise P.ProtocolError("bad_reply", "get reply: not one header per hit")
        bad = rh.get("bad", 0)
        if type(bad) is int and bad > 0:  # records of the wrong length: corrupt, so misses
            store.counters["corrupt"] += bad
            store._warn.warning("corrupt", "%d page(s) from %s have a stored payload of the wrong length: misses",
                               bad, store.endpoint)
        j = 0
        for off, hit in enumerate(hits):
            if not hit:
                continue
            idx, hdr = s + off, hdrs[j]
            j += 1
            o = (idx - slot0) * pb
            try:
                if not isinstance(hdr, bytes):
                    raise PageFormatError("header is not bin")
                psum = decode_header(hdr, keys[idx], store.namespace, pb)
                # copy first, then check the copy: the slot is memory another process can write, the
                # destination is not (a page that fails leaves garbage there, as with the file store)
                copy_into(dsts[idx], seg.mv[o:o + pb])
                verify_payload(dsts[idx], psum)
                sums[idx] = psum
            except PageFormatError as err:
                store.counters["corrupt"] += 1
                store._warn.warning("corrupt", "page %s from %s is not valid (%s): miss", keys[idx], store.endpoint,
                                   err)
                continue
            res[idx] = True
            store.counters["bytes_read"] += pb
            store.counters["shm_pages_in"] += 1

    return shm_rounds(store, len(keys), build, on_reply)


def set_shm(store: "ZmqStore", keys: Sequence[str], kraw: list, srcs: list, sums: Optional[list], res: list) -> bool:
    """:meth:`.client.ZmqStore.batch_set` through the segment: fills ``res`` (stored per key); False when the
    segment could not be used (the caller sends frames)."""
    pb = store.page_bytes

    def build(seg, s, e, slot0):
        slots = []
        for i in range(s, e):
            o = (i - slot0) * pb
            slot = seg.mv[o:o + pb]
            src = srcs[i]
            if isinstance(src, list):  # a page given as runs: each copied to its place in the slot
                at = 0
                for run in src:
                    slot[at:at + run.nbytes] = run
                    at += run.nbytes
            else:
                slot[:] = src
            slots.append(slot)
        # checksums of what the server will copy (the slots), unless the caller gave them
        hdrs = encode_headers(kraw[s:e], store.namespace, slots, pb, None if sums is None else sums[s:e])
        return {"op": "set", "v": P.SHM_PROTOCOL_VERSION, "ns": store.namespace, "keys": list(keys[s:e]),
                "hdrs": hdrs, "shm": seg.name, "len": pb, "offs": [(i - slot0) * pb for i in range(s, e)]}, []

    def on_reply(seg, s, e, slot0, rh, frames):
        st = rh.get("stored")
        if frames or not isinstance(st, list) or len(st) != e - s or not all(isinstance(x, bool) for x in st):
            raise P.ProtocolError("bad_reply", "set reply: 'stored' is not one bool per key")
        res[s:e] = st
        store.counters["shm_pages_out"] += sum(st)
        store._set_reply_counts(rh)

    return shm_rounds(store, len(keys), build, on_reply)
