"""Backup policy of the controller (L2 -> L3) and the one L2 reclaim loop.

``write_through``: every page saved into L2 is backed up in the same step's plan. ``write_through_selective``: a page
is backed up once its node was hit ``write_through_threshold`` times. ``write_back``: a page is backed up only when L2
eviction picks it (on demand, and ahead of demand to keep a quarter of the slots free or being freed); its slot is
freed only after the store acknowledged the page, and a page whose backup failed is dropped, never marked as stored.
While a backup runs, the index node holding its pages is locked (its slots cannot be evicted or reused). Every page a
policy offers passes the controller's admission (:mod:`~tierkv.connector.l3.admission`, ``l3.admission``) first
(pages a request keeps, request control ``keep``, pass it whatever it decides); ``reused_in_l2`` moves the offer to
L2 eviction, as ``write_back`` does, whatever the write policy.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

from tierkv.connector.core.plan import JOB_BACKUP, Job, JobReport
from tierkv.connector.core.radix_index import NO_SLOT, RadixIndex, RadixNode
from tierkv.connector.l3.jobs import _JobState


def reclaim_l2(index: RadixIndex, allocator, target: int, *,
               back_up: Optional[Callable[[RadixNode], Optional[int]]] = None, freeing: Optional[int] = None) -> None:
    """The one L2 reclaim loop (the scheduler without an L3 and the controller both use it): take victims in the
    index's policy order (:meth:`RadixIndex.pop_l2_victim`) until ``target`` slots are free, or no victim is left.

    ``back_up(victim)`` may keep a victim's L2 copy for now (write_back: its pages go to L3 first) and return how
    many slots it will free later; None drops the victim's L2 copy at once and returns its slots to ``allocator``.
    With ``freeing`` (slots already being freed that way) the target counts those as free, so it is met by slots
    free *or being freed* (reclaiming ahead of need); without it only free slots count (room needed now).
    """
    ahead = freeing is not None
    pending = freeing or 0
    while allocator.num_free + pending < target:
        v = index.pop_l2_victim()
        if v is None:
            return
        later = back_up(v) if back_up is not None else None
        if later is None:
            allocator.free(index.drop_l2(v))
        elif ahead:
            pending += later


class BackupPolicy:
    """Mixin of :class:`~tierkv.connector.l3.controller.Controller`: when pages go to L3, and how L2 makes room
    (``write_back`` victims are backed up before their slots are freed)."""

    def after_save(self, path: Sequence[bytes], start: int, req_id: Optional[str] = None, keep: bool = False) -> None:
        """Pages ``path[start:]`` were just given L2 slots and saved (in this step's plan), by request ``req_id``
        (None: pages back in L2 for another reason; the admission does not count them as seen). ``keep``: the
        request keeps them (request control ``keep``): admission lets them through whenever they are offered."""
        if start >= len(path):
            return
        adm = self.admission
        if req_id is not None:
            adm.seen(req_id, path, start)
        if keep:
            adm.keep(path[start:])
        if self.write_policy == "write_through" and not adm.on_eviction:
            self._backup_admitted(path, list(range(start, len(path))))

    def after_hit(self, path: Sequence[bytes], upto: int) -> None:
        """Pages ``path[:upto]`` were hit (matched and loaded or kept): under ``write_through_selective``, back up
        those whose node reached the hit threshold; under ``write_through`` with ``second_sight``, those rejected at
        their save that a second request has seen now."""
        if upto <= 0:
            return
        adm = self.admission
        adm.hit(path[:upto])
        if adm.on_eviction:
            return
        if self.write_policy == "write_through_selective":
            due = [i for node, j, i in self.index.walk(path[:upto])
                   if node.hit_count >= self.threshold and not node.in_l3[j] and node.host_slots[j] != NO_SLOT]
            if due:
                self._backup_admitted(path, due)
        elif self.write_policy == "write_through" and adm.mode == "second_sight":
            due = [i for node, j, i in self.index.walk(path[:upto])
                   if not node.in_l3[j] and node.host_slots[j] != NO_SLOT and path[i] not in self._backing_up]
            if due:
                self._backup_admitted(path, due, count_rejects=False)

    @property
    def l1_hits_offer(self) -> bool:
        """Whether a prefix the engine's own cache (L1) served is a hit that may start backups
        (:meth:`after_hit`): under ``write_through_selective``, and under ``write_through`` with ``second_sight``
        (a second request served from L1 is a second sight of those pages)."""
        return self.write_policy == "write_through_selective" or (
            self.write_policy == "write_through" and self.admission.mode == "second_sight")

    def _backup_admitted(self, path: Sequence[bytes], idxs: list, victim: Optional[RadixNode] = None,
                         count_rejects: bool = True) -> list:
        """Back up the pages at ``idxs`` (positions in ``path``, in order) that can be backed up (an L2 copy, not in
        L3, not being backed up) and that the admission admits (a leading run of them); returns the positions
        backed up (empty when none)."""
        return self._backup(path, idxs, victim=victim,
                            admit=lambda keys: self.admission.admit_run(keys, count_rejects))

    def _backup(self, path: Sequence[bytes], idxs, victim: Optional[RadixNode] = None, admit=None) -> list:
        path = list(path)
        idxs = [i for i in idxs if path[i] not in self._backing_up]
        if not idxs:
            return []
        last = max(idxs) + 1
        m = self.index.match_prefix(path[:last], require_l2=False, split=True)
        idxs = [i for i in idxs if i < m.num_pages and m.host_slots[i] != NO_SLOT and not m.in_l3[i]]
        if idxs and admit is not None:
            idxs = idxs[:admit([path[i] for i in idxs])]
        if not idxs:
            return []
        lock = self.index.lock(m.last_node)
        keys = [path[i] for i in idxs]
        self._backing_up.update(keys)
        job = Job(self._new_id(), JOB_BACKUP, keys, slots=[m.host_slots[i] for i in idxs])
        self._order(_JobState(job, lock=lock, path=path[: m.num_pages], idx=idxs, victim=victim))
        self.counters.backup_jobs += 1
        self.counters.backup_ordered_pages += len(keys)
        return idxs

    def _end_backup(self, st: _JobState, r: JobReport) -> None:
        if st.cancelled:  # cancel_backups released everything; its pages left the index
            self._note_evicted(r.evicted)
            return
        self._backing_up.difference_update(st.job.keys)
        flags = [False] * len(st.path)
        for i, ok in zip(st.idx, r.ok):
            flags[i] = ok
        self.index.set_in_l3(st.path, flags)
        for k, ok in zip(st.job.keys, r.ok):
            if ok:
                self._absent.pop(k, None)  # an earlier "absent" answer is stale now
                self._l3_evicted.pop(k, None)  # so is an earlier eviction
        # after the stored pages: the worker left out pages written again after their eviction, so a page named
        # here was evicted after its last write
        self._note_evicted(r.evicted)
        self.lookup_stats.stored_l3([k for k, ok in zip(st.job.keys, r.ok) if ok])
        stored = sum(r.ok)
        self.counters.backup_stored_pages += stored
        self.counters.backup_failed_pages += len(r.ok) - stored
        if st.lock is not None:
            self.index.unlock(st.lock)
        v = st.victim
        if v is not None and v.parent is not None and v.lock_ref == 0 and any(s != NO_SLOT for s in v.host_slots):
            # write_back: the eviction that started this backup goes on now; pages whose backup failed (or that
            # admission did not let into it) are dropped with it, never marked as stored
            self.counters.write_back_dropped_pages += len(r.ok) - stored  # not those admission turned away
            self.allocator.free(self.index.drop_l2(v))

    def cancel_backups(self, keys: set[bytes]) -> None:
        """The pages ``keys`` are leaving the index because they were computed on a broken prefix (their saves were
        not made: their KV followed a failed load). A backup job whose pages are all among them is cancelled now: its
        lock is released and its report, when it comes (every page "not done": the worker does not send a page whose
        save was not made), changes nothing. A job that also holds other pages keeps running; those pages leave the
        index once it ended."""
        for st in self._jobs.values():
            if st.job.kind != JOB_BACKUP or st.cancelled or not set(st.job.keys) <= keys:
                continue
            st.cancelled = True
            self._backing_up.difference_update(st.job.keys)
            if st.lock is not None:
                self.index.unlock(st.lock)
                st.lock = None
            self.counters.backup_cancelled_pages += st.job.num_pages

    # ------------------------------------------------------------------ L2 room
    def make_room(self, need: int) -> int:
        """Free L2 slots until ``need`` are free or nothing more can go now (:func:`reclaim_l2`, with this
        controller's write-back rule: a victim with pages not yet in L3 is backed up first and freed when the store
        acknowledged it, later). Returns the number of free slots."""
        reclaim_l2(self.index, self.allocator, need, back_up=self._write_back_victim)
        return self.allocator.num_free

    def keep_free(self, target: int) -> None:
        """``write_back`` only: start backups of L2 victims ahead of need, so that about ``target`` slots are free
        or being freed (their backup acknowledged, they are dropped by the report). Without it every save or
        staging slot that needs room would wait a step for a backup. Victims already held by L3 are freed now."""
        if self.write_policy != "write_back":
            return
        freeing = sum(sum(1 for sl in st.victim.host_slots if sl != NO_SLOT)
                      for st in self._jobs.values() if st.victim is not None)
        reclaim_l2(self.index, self.allocator, target, back_up=self._write_back_victim, freeing=freeing)

    def _write_back_victim(self, v: RadixNode) -> Optional[int]:
        """:func:`reclaim_l2`'s ``back_up`` under ``write_back`` (or admission ``reused_in_l2``): back up the
        victim's pages L3 lacks that the admission admits and keep its L2 copy until the report; returns how many of
        its slots that will free, or None (nothing to back up or admitted, another policy, or the backup could not
        start: drop it now)."""
        missing = [j for j, f in enumerate(v.in_l3) if not f]
        if (self.write_policy != "write_back" and not self.admission.on_eviction) or not missing:
            return None
        path = self.index.path_keys(v)
        off = len(path) - v.num_pages
        started = self._backup_admitted(path, [off + j for j in missing], victim=v)
        if not started:
            return None
        self.counters.write_back_pages += len(started)
        return sum(1 for sl in v.host_slots if sl != NO_SLOT)

    def room_possible(self, need: int) -> bool:
        """Whether ``need`` slots can be had now: free slots plus L2 copies on unlocked nodes (an unlocked node's
        whole subtree is unlocked, so :meth:`make_room` reaches every one of them). O(1), no side effect. Pages a
        running prefetch locks but has not fetched yet are L3-only (no L2 copy) and hide nothing."""
        return self.allocator.num_free + max(0, self.index.l2_pages - self.index.locked_l2_pages) >= need
