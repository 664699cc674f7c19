"""Existence seam of the controller: is the rest of this prompt in L3?

A lookup whose prefix ends in the index asks for the leading run present in L3 after it. Where the store can answer
from the scheduler's process at once (``exists_fn``: one ``stat`` per key and rank for the file store) the answer is
used in the same lookup. Otherwise the workers (all ranks) are asked with a job: while it is pending
:meth:`Existence.l3_extend` returns None (vLLM asks again next step), for at most ``exists_wait_s``; then the request
goes on without L3 and the late answer still fills the index. Found pages are inserted as L3-only; the first absent
page is remembered for ``negative_ttl_s`` (one query per miss). Pages the workers' stores report evicted (backup
reports) are remembered until a lookup of their path clears their L3 flag (:meth:`Existence._forget_evicted`).
"""
from __future__ import annotations

from typing import Optional, Sequence

from tierkv.connector.core.plan import JOB_EXISTS, Job, JobReport
from tierkv.connector.core.radix_index import NO_SLOT
from tierkv.connector.l3.jobs import _JobState, _rate_limited

#: page keys reported evicted from L3 that the controller remembers until a lookup clears their flag (oldest go first:
#: a read of such a page then fails, as without the report)
EVICTED_KEYS_MAX = 1 << 18


class Existence:
    """Mixin of :class:`~tierkv.connector.l3.controller.Controller`: pages known absent, existence queries and the
    L3-only pages they index."""

    def _is_absent(self, key: bytes) -> bool:
        exp = self._absent.get(key)
        if exp is None:
            return False
        if exp < self.clock():
            del self._absent[key]
            return False
        return True

    def _mark_absent(self, key: bytes) -> None:
        self._absent[key] = self.clock() + self.negative_ttl_s
        self._absent.move_to_end(key)
        while len(self._absent) > 65536:
            self._absent.popitem(last=False)

    def usable_pages(self, path: Sequence[bytes], m_host_slots: Sequence[int], m_in_l3: Sequence[bool]) -> int:
        """Leading pages of a ``require_l2=False`` match that can be loaded: in L2, or in L3 and not known bad or
        evicted."""
        evicted = self._l3_evicted
        for i, (s, f) in enumerate(zip(m_host_slots, m_in_l3)):
            if s == NO_SLOT and (not f or self._is_absent(path[i]) or path[i] in evicted):
                return i
        return len(m_host_slots)

    def _note_evicted(self, keys: Sequence[bytes]) -> None:
        """The workers' stores evicted the pages ``keys`` (a backup report): remember them for lookups."""
        ev = self._l3_evicted
        for k in keys:
            ev[k] = None
            ev.move_to_end(k)
        self.counters.l3_evicted_pages += len(keys)
        while len(ev) > EVICTED_KEYS_MAX:
            ev.popitem(last=False)

    def _forget_evicted(self, path: Sequence[bytes], m):
        """Clear the L3 flag of the pages of ``m`` (``path``'s ``require_l2=False`` match) that L3 evicted, the way a
        failed read does (:meth:`RadixIndex.clear_l3`: an L3-only page leaves the index with the rest of its path,
        unless that is locked), and back up again what L2 still holds. Returns the match after that."""
        ev = self._l3_evicted
        pos = [i for i, f in enumerate(m.in_l3) if f and path[i] in ev]
        if not pos:
            return m
        freed = self.index.clear_l3(path[: m.num_pages], pos)
        if freed:
            self.allocator.free(freed)
        n, _cursor = self.index.match_len(path, require_l2=False)
        self.after_save(path[:n], 0)  # write_through: back up again what is in L2 and not in L3
        m = self.index.match_prefix(path, require_l2=False)
        for i in pos:  # a page still flagged (its path is locked) stays remembered
            if i >= m.num_pages or not m.in_l3[i]:
                del ev[path[i]]
        return m

    def l3_extend(self, path: Sequence[bytes], start: int) -> Optional[int]:
        """How many pages after ``path[:start]`` (indexed) are in L3 beyond what the index knows: 0 when known
        absent or when the answer is overdue, None while an existence query is pending (one is started if none
        is)."""
        if start >= len(path) or self._is_absent(path[start]):
            return 0
        first = path[start]
        if self.exists_fn is not None and first not in self._exists_pending:
            n = self._exists_here(path, start)
            if n is not None:
                return n
        jid = self._exists_pending.get(first)
        if jid is not None:
            st = self._jobs.get(jid)
            if st is not None and self.load_policy.exists_overdue(self.clock() - st.t0):
                self.counters.exists_late_answers += 1
                return 0
            return None
        job = Job(self._new_id(), JOB_EXISTS, list(path[start:]))
        self._exists_pending[first] = job.job_id
        self._order(_JobState(job, path=list(path[:start])))
        self.counters.exists_queries += 1
        return None

    def _exists_here(self, path: Sequence[bytes], start: int) -> Optional[int]:
        """Ask ``exists_fn`` about ``path[start:]``; index what it found. None when it could not answer."""
        try:
            n = self.exists_fn(list(path[start:]))
        except Exception as e:  # the workers answer instead
            _rate_limited.warning("exists_here", "tierkv: existence check in the scheduler failed (%r); asking the "
                                  "workers", e)
            return None
        if n is None:
            return None
        self.counters.exists_queries += 1
        self.counters.exists_local_queries += 1
        self._found(path[:start], list(path[start:]), n)
        return n

    def _end_exists(self, st: _JobState, r: JobReport) -> None:
        keys = st.job.keys
        self._exists_pending.pop(keys[0], None)
        self._found(st.path, keys, r.leading)

    def _found(self, prefix: list, keys: list, n: int) -> None:
        """``keys[:n]`` (after the indexed ``prefix``) are in L3, ``keys[n]`` is not: remember the absent page and
        index the found ones as L3-only."""
        if n < len(keys):
            self._mark_absent(keys[n])
        if n == 0:
            return
        self.counters.exists_found_pages += n
        for k in keys[:n]:
            self._l3_evicted.pop(k, None)  # written again since it was reported evicted
        start = len(prefix)
        m = self.index.match_prefix(prefix, require_l2=False)
        if m.num_pages < start:
            return  # the prefix left the index meanwhile: a later lookup asks again
        self.index.insert(list(prefix) + keys[:n], [NO_SLOT] * n, in_l3=[True] * n, start=start)
        if self.index.total_pages > self.max_index_pages:
            excess = self.index.total_pages - self.max_index_pages
            self.counters.index_l3_evicted_pages += self.index.evict_l3_only(excess + self.max_index_pages // 16)
