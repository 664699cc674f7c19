"""Existence answers of :class:`.client.ZmqStore` from its server's presence table (:mod:`.presence_table`): on the
server's host, ``batch_exists`` probes the table in ``/dev/shm`` instead of making a round trip.

The table is asked for with a ping (``"presence": true``) and mapped read-only; a retired table, or one whose server
is gone, is dropped and the current one asked for. A server that names none (older, remote, a spill tier) or a
table that cannot be mapped is asked again at most every :data:`PRESENCE_RETRY_S` seconds; meanwhile existence is
asked over ZMQ. State lives on the store (``_presence``, ``_presence_on``, ``_presence_due``, under
``_presence_lock``). Raises nothing for run-time faults.
"""
from __future__ import annotations

import logging
import math
import os
import time
from typing import TYPE_CHECKING, Optional, Sequence

from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.zmq.presence_table import PRESENCE_NAME_RE, PresenceTable, fingerprint

if TYPE_CHECKING:
    from tierkv.storage_backends.zmq.client import ZmqStore

log = logging.getLogger("tierkv.zmq_client")

#: seconds between two pings asking a server that named no presence table (or one this client could not map) again
PRESENCE_RETRY_S = 5.0


def lead(store: "ZmqStore", keys: Sequence[str]) -> Optional[int]:
    """Leading ``keys`` present according to the server's presence table, or None (no table here: the caller
    asks over ZMQ). A retired table, or one whose server is gone, is dropped and the server asked (one ping)
    for its current one; a server without one (older, remote, a spill tier) is asked again at most every
    :data:`PRESENCE_RETRY_S` seconds."""
    with store._presence_lock:
        t = store._presence
        if t is None and (not store._presence_on or time.monotonic() < store._presence_due):
            return None
        fps = [fingerprint(store.namespace, k) for k in keys]
        n = None if t is None else t.lead(fps)
        if t is not None and n is None:
            store._presence = None
            t.close()
            store._presence_due = -math.inf
        if n is None:
            t = store._presence = map_table(store)
            n = None if t is None else t.lead(fps)
        if n is not None:
            store.counters["presence_answers"] += 1
        return n


def map_table(store: "ZmqStore") -> Optional[PresenceTable]:
    """Ask the server for its presence table (a ping) and map it; None when it names none or it cannot be
    mapped (not asked again for :data:`PRESENCE_RETRY_S`), or no answer came (asked again on the next call: the
    channel's back-off spaces the tries). Called with ``_presence_lock`` held."""
    if not store._presence_on or time.monotonic() < store._presence_due:
        return None
    got: dict = {}

    def on_reply(i, rh, frames):
        name = rh.get("presence")
        if isinstance(name, str) and PRESENCE_NAME_RE.match(name):
            got["name"] = name

    if not store._exchange([({"op": "ping", "keys": [], "presence": True}, [])], on_reply)[0]:
        return None
    if "name" not in got:
        store._presence_due = time.monotonic() + PRESENCE_RETRY_S
        return None
    try:
        t = PresenceTable.open(os.path.join(P.SHM_DIR, got["name"]))
    except (OSError, ValueError) as e:
        store._presence_due = time.monotonic() + PRESENCE_RETRY_S
        log.info("zmq store %s: cannot map the server's presence table (%s); existence is asked over ZMQ",
                 store.endpoint, e)
        return None
    store.counters["presence_tables"] += 1
    return t
