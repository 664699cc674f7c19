"""The writer's table of the pages it backed up, to name the ones its store evicted in the index's terms.

A store names pages by L3 key (a one-way hash of the rank namespace and the page key, :func:`.types.l3_key`); the
index names them by page key. For a store that reports its evictions (``reports_evictions``, the file store) the
writer keeps, for each page it stored, L3 key -> page key, at most :data:`NAMES_MAX` of them (the oldest go first),
and after each backup batch turns the store's evicted L3 keys into page keys for the job's report. Evictions it
cannot name (written by an earlier process, dropped from the table, or past the store's buffer) are only counted:
a read finds those pages missing, as without this table.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

#: L3 keys the writer remembers the page key of (about 200 bytes each)
NAMES_MAX = 1 << 20


class EvictedNames:
    """L3 key -> page key of the pages one writer stored; turns the store's evictions into page keys."""

    def __init__(self, store, names_max: int = NAMES_MAX):
        self.store = store
        self.names_max = names_max
        self.names: "OrderedDict[str, bytes]" = OrderedDict()
        self.unnamed = 0  # evictions not named: unknown L3 key or lost by the store's buffer

    def after_batch(self, l3_keys: Sequence[str], keys: Sequence[bytes], stored: Sequence[bool],
                    evicted: dict) -> None:
        """One backup batch ended: ``l3_keys[i]`` (page ``keys[i]``) was stored where ``stored[i]``. Adds the pages
        the store evicted meanwhile to ``evicted`` (page key -> None, the job's so far), then removes the ones stored
        now, which are in L3 again. A page of this batch that was also evicted in it (its old record, before this
        write; or, on ``ENOSPC``, this record after it) is looked up in the store: one ``batch_exists`` each."""
        ev = self.store.take_evicted()
        self.unnamed += ev.lost
        names = self.names
        now = set(ev.keys)
        batch = set(l3_keys) if ev.keys else ()
        for lk in ev.keys:
            k = names.pop(lk, None)
            if k is None:
                self.unnamed += lk not in batch
            else:
                evicted[k] = None
        for lk, k, ok in zip(l3_keys, keys, stored):
            if not ok:
                continue
            if lk in now and not self.store.batch_exists([lk]):
                evicted[k] = None
                continue
            evicted.pop(k, None)
            names[lk] = k
            names.move_to_end(lk)
        while len(names) > self.names_max:
            names.popitem(last=False)
