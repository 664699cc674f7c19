"""Admission to L3 (config ``l3.admission``): which pages the write policy offers for a backup are written to L3.

``always``: every offered page (no admission). ``second_sight``: a page is written only once its key was seen by two
different requests within the ghost window: a request sees a key when its lookup offers it or when it saves the page
into L2. The ghost is an LRU of the last ``l3.admission_window_pages`` keys seen, each with the first request that
saw it. ``reused_in_l2``: pages are offered when L2 evicts them and written only if a later request found them in L2
(an L2 hit, remembered per key in an LRU of the same bound). Offers are leading runs of a request's path, so the
decision is a leading run too: an L3 copy after a gap would leave the index with the gap. A rejected key is kept (same
bound) until a lookup wants it again while no tier holds it: ``rejected_hit_pages``, what admission cost. A page a
request keeps (request control ``keep``: it must survive for a restart) bypasses both modes: its key is remembered
(same bound) and admitted whenever offered; ``kept_pages`` counts those admission alone would have turned away.
Memory: at most four LRUs of ``window_pages`` 16-byte keys; O(1) per key. Raises ValueError for a bad setting.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Sequence

from tierkv.connector.core.config import L3_ADMISSIONS

#: ``l3.admission_window_pages`` default: 262144 keys per LRU (about 30 MB for the three a mode fills; the kept keys'
#: LRU only holds what requests keep)
DEFAULT_WINDOW_PAGES = 1 << 18

#: the ghost's mark of a key seen by two different requests
_TWICE = ("seen twice",)


class _Lru:
    """An LRU set of page keys holding at most ``bound`` of them (the oldest go first); each key carries a value."""

    __slots__ = ("d", "bound")

    def __init__(self, bound: int):
        self.d: "OrderedDict[bytes, object]" = OrderedDict()
        self.bound = bound

    def put(self, key: bytes, value: object = None) -> None:
        d = self.d
        d[key] = value
        d.move_to_end(key)
        if len(d) > self.bound:
            d.popitem(last=False)


class Admission:
    """The admission decision of one controller (see the module docstring).

    Args:
        mode: one of :data:`~tierkv.connector.core.config.L3_ADMISSIONS`.
        window_pages: keys each LRU (ghost, reused, rejected, kept) remembers, > 0.
    Raises:
        ValueError: an unknown mode (naming ``l3.admission`` and the allowed values), ``window_pages`` <= 0.
    """

    def __init__(self, mode: str = "always", window_pages: int = DEFAULT_WINDOW_PAGES):
        if mode not in L3_ADMISSIONS:
            raise ValueError(f"bad value {mode!r} for 'l3.admission': allowed values are {', '.join(L3_ADMISSIONS)}")
        if not isinstance(window_pages, int) or window_pages <= 0:
            raise ValueError(f"bad value {window_pages!r} for 'l3.admission_window_pages': must be an integer > 0")
        self.mode = mode
        self.window_pages = window_pages
        self.ghost = _Lru(window_pages)      # key -> the first request that saw it, or _TWICE
        self.reused = _Lru(window_pages)     # keys a request found in L2
        self.rejected = _Lru(window_pages)   # keys admission turned away, until a lookup wants them again
        self.kept = _Lru(window_pages)       # keys a request keeps (request control ``keep``): always admitted
        self._looked: dict[str, int] = {}    # live request -> keys of its lookups already seen
        self.offered_pages = 0
        self.admitted_pages = 0
        self.rejected_pages = 0
        self.rejected_hit_pages = 0
        self.kept_pages = 0

    @property
    def on_eviction(self) -> bool:
        """Whether pages are offered when L2 evicts them (``reused_in_l2``) instead of by the write policy."""
        return self.mode == "reused_in_l2"

    # ------------------------------------------------------------------ what requests do
    def seen(self, req_id: str, keys: Sequence[bytes], start: int = 0) -> None:
        """Request ``req_id`` saw ``keys[start:]`` (``second_sight`` only; elsewhere nothing to remember)."""
        if self.mode != "second_sight":
            return
        ghost = self.ghost
        d = ghost.d
        for i in range(start, len(keys)):
            k = keys[i]
            first = d.get(k)
            ghost.put(k, req_id if first is None else first if first is _TWICE or first == req_id else _TWICE)

    def seen_lookup(self, req_id: str, keys: Sequence[bytes], n: int) -> None:
        """A lookup of ``req_id`` offered ``keys[:n]``; a waiting request's next lookup costs only its new keys."""
        if self.mode != "second_sight":
            return
        done = self._looked.get(req_id, 0)
        if n > done:
            self.seen(req_id, keys[:n], done)
            self._looked[req_id] = n

    def hit(self, keys: Sequence[bytes]) -> None:
        """A request found ``keys`` in L2 (``reused_in_l2`` only)."""
        if self.mode == "reused_in_l2":
            for k in keys:
                self.reused.put(k)

    def keep(self, keys: Sequence[bytes]) -> None:
        """A request keeps ``keys`` (request control ``keep``): admitted whenever offered while remembered (not
        under ``always``, which admits everything anyway)."""
        if self.mode != "always":
            for k in keys:
                self.kept.put(k)

    def end_request(self, req_id: str) -> None:
        self._looked.pop(req_id, None)

    # ------------------------------------------------------------------ decisions
    def admit_run(self, keys: Sequence[bytes], count_rejects: bool = True) -> int:
        """How many leading ``keys`` (pages offered for a backup, in path order) go to L3; the rest are rejected
        and remembered. ``count_rejects=False``: a page offered again (a hit on a page rejected before) that is
        still not admitted is neither counted nor remembered again."""
        n = len(keys)
        if self.mode == "always":
            self.offered_pages += n
            self.admitted_pages += n
            return n
        ok = self._admits
        a = 0
        while a < n and ok(keys[a]):
            a += 1
        for k in keys[:a]:
            self.rejected.d.pop(k, None)
        self.admitted_pages += a
        if count_rejects:
            self.offered_pages += n
            self.rejected_pages += n - a
            for k in keys[a:]:
                self.rejected.put(k)
        else:
            self.offered_pages += a
        return a

    def _admits(self, key: bytes) -> bool:
        if self.mode == "second_sight":
            ok = self.ghost.d.get(key) is _TWICE
        else:
            ok = key in self.reused.d
        if not ok and key in self.kept.d:
            self.kept_pages += 1
            return True
        return ok

    def wanted(self, keys: Sequence[bytes]) -> int:
        """A lookup wants ``keys`` (in path order), which no tier holds: counts (once) the leading ones admission
        rejected, and returns how many."""
        rej = self.rejected.d
        if not rej:
            return 0
        n = 0
        for k in keys:
            if k not in rej:
                break
            del rej[k]
            n += 1
        self.rejected_hit_pages += n
        return n

    def stats(self) -> dict:
        """Counters (pages) under their stats keys, and the ghost's size."""
        return {"ctl_admission_offered_pages": self.offered_pages,
                "ctl_admission_admitted_pages": self.admitted_pages,
                "ctl_admission_rejected_pages": self.rejected_pages,
                "ctl_admission_rejected_hit_pages": self.rejected_hit_pages,
                "ctl_admission_kept_pages": self.kept_pages,
                "ctl_admission_ghost_pages": len(self.ghost.d) if self.mode == "second_sight" else 0}

    def memory_keys(self) -> int:
        """Keys held in all four LRUs (each at most ``window_pages``)."""
        return len(self.ghost.d) + len(self.reused.d) + len(self.rejected.d) + len(self.kept.d)

