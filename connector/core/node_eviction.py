"""The radix index's L2 eviction policies: the order in which the candidates it offers lose their L2 copy.

A candidate is a node that may lose its L2 copy now (unlocked, holding L2 pages, no child holding any); the index
offers one with :meth:`NodePolicy.push` whenever a node may have become one (touched, unlocked, lost its last L2 child,
split) and validates what :meth:`NodePolicy.pop` returns the same way: a lazily validated heap per queue, entries
stamped, a stale stamp or a node no longer a candidate skipped, so a victim costs O(log nodes) amortised. The policy
sees every node of a matched (hit) or inserted path (:meth:`touched`), a node losing its L2 copy or leaving the index
(:meth:`forget`) and splits, and keeps its state on the node: ``ev_seg`` (segment or queue), ``ev_stamp`` (place in
it), ``ev_freq`` (s3fifo hits), ``ev_pages`` (L2 pages counted in its segment when it joined). Names and semantics
are those of :mod:`tierkv.storage_backends.eviction`, applied to nodes; segment sizes are in L2 pages. ``lru`` and
``lfu`` are the index's original orders, unchanged. Raises ValueError for an unknown name or a fraction outside (0, 1).
"""
from __future__ import annotations

import heapq
from collections import OrderedDict

from tierkv.storage_backends.eviction import (
    DEFAULT_PROTECTED_FRACTION,
    DEFAULT_SMALL_FRACTION,
    POLICIES,
    S3FIFO_MAX_FREQ,
    check_fraction,
    check_policy,
)

__all__ = ["POLICIES", "NodePolicy", "make_node_policy"]

OUT, FIRST, SECOND = 0, 1, 2  # no L2 copy / probation or small / protected or main


class NodePolicy:
    """``lru`` (least recently matched or inserted first) and the base of the others: one heap of candidates ordered
    by :meth:`key`. ``index`` is the :class:`~tierkv.connector.core.radix_index.RadixIndex` (its clock, its
    ``_l2_evictable`` check, its node and L2 page counts)."""

    name = "lru"
    segmented = False  # True: the index calls :meth:`touched` for every node of a touched path

    def __init__(self, index) -> None:
        self.ix = index
        self.heap: list[tuple] = []

    def key(self, node) -> tuple:
        return (node.last_access,)

    # -------------------------------------------------------------- what the index tells
    def touched(self, node, hit: bool) -> None:
        """``node`` is on a path just matched (``hit``) or inserted, root side first, after its stamps moved on."""

    def forget(self, node, evicted: bool) -> None:
        """``node`` lost its last L2 copy (``evicted``: by :meth:`RadixIndex.drop_l2`) or left the index."""

    def split(self, top, child) -> None:
        """``top`` took the first pages of ``child``; it inherits ``child``'s place."""

    # -------------------------------------------------------------- candidates
    def push(self, node) -> None:
        """Queue the candidate ``node`` at its place now (its earlier entry, if any, goes stale)."""
        self._push(self.heap, node)

    def _push(self, heap: list, node) -> None:
        ix = self.ix
        if len(heap) > 4 * ix.num_nodes + 1024:
            heap[:] = [e for e in heap if e[3]._heap_stamp == e[1] and ix._l2_evictable(e[3])]
            heapq.heapify(heap)
        stamp = next(ix._clock)
        node._heap_stamp = stamp
        heapq.heappush(heap, (self.key(node), stamp, node.id, node))

    def _pop(self, heap: list):
        ix = self.ix
        while heap:
            _k, stamp, _nid, node = heapq.heappop(heap)
            if stamp == node._heap_stamp and ix._l2_evictable(node):
                node._heap_stamp = -1
                return node
        return None

    def pop(self):
        """The next victim (out of the queues; the index re-offers it when it is touched or unlocked), or None."""
        return self._pop(self.heap)

    def queued(self) -> int:
        return len(self.heap)

    def check(self) -> None:
        """Recount the policy's page counters over the index (tests). Raises AssertionError."""


class LfuPolicy(NodePolicy):
    """Fewest hits first, then least recent."""

    name = "lfu"

    def key(self, node) -> tuple:
        return (node.hit_count, node.last_access)


class _Segmented(NodePolicy):
    """Two segments (``FIRST``, ``SECOND``) with their L2 pages counted in ``pages``."""

    segmented = True

    def __init__(self, index) -> None:
        super().__init__(index)
        self.pages = [0, 0, 0]

    def _join(self, node, seg: int) -> None:
        node.ev_seg = seg
        node.ev_stamp = next(self.ix._clock)
        node.ev_pages = node.l2_count
        self.pages[seg] += node.ev_pages

    def _leave(self, node) -> None:
        self.pages[node.ev_seg] -= node.ev_pages
        node.ev_seg, node.ev_pages, node.ev_freq = OUT, 0, 0

    def forget(self, node, evicted: bool) -> None:
        if node.ev_seg != OUT:
            self._leave(node)

    def split(self, top, child) -> None:
        top.ev_seg, top.ev_stamp, top.ev_freq = child.ev_seg, child.ev_stamp, child.ev_freq
        top.ev_pages = min(top.l2_count, child.ev_pages)
        child.ev_pages -= top.ev_pages

    def check(self) -> None:
        count = [0, 0, 0]
        for n in self.ix._iter_nodes():
            count[n.ev_seg] += n.ev_pages
            assert n.ev_pages >= 0 and (n.ev_seg != OUT or n.ev_pages == 0), f"node {n.id}: ev_pages {n.ev_pages}"
            assert n.ev_seg != OUT or not n.l2_count, f"node {n.id} holds L2 pages outside the policy's segments"
        assert count[FIRST:] == self.pages[FIRST:], (count, self.pages)


class SlruPolicy(_Segmented):
    """Probation (``FIRST``) and protected (``SECOND``): a hit in probation promotes; protected holds at most
    ``fraction`` of the most L2 pages the index held so far, its least recent demoted to probation's most recent end; probation's least recent
    candidates go first."""

    name = "slru"

    def __init__(self, index, fraction: float) -> None:
        super().__init__(index)
        self.fraction = fraction
        self.protected: list[tuple] = []  # (ev_stamp, id, node): protected nodes, least recent first (lazy)
        self.high = 0  # the most L2 pages the index held: its capacity once full (the index is not told it)

    def key(self, node) -> tuple:
        return (node.ev_seg == SECOND, node.ev_stamp)

    def touched(self, node, hit: bool) -> None:
        if node.ev_seg == OUT:
            if node.l2_count:
                self._join(node, FIRST)
            return
        if hit and node.ev_seg == FIRST:
            self._leave(node)
            self._join(node, SECOND)
        else:
            node.ev_stamp = next(self.ix._clock)
        if node.ev_seg == SECOND:
            self._queue_protected(node)
            self._bound()

    def _queue_protected(self, node) -> None:
        if len(self.protected) > 4 * self.ix.num_nodes + 1024:
            self.protected = [e for e in self.protected if e[2].ev_seg == SECOND and e[2].ev_stamp == e[0]]
            heapq.heapify(self.protected)
        heapq.heappush(self.protected, (node.ev_stamp, node.id, node))

    def split(self, top, child) -> None:
        super().split(top, child)
        if top.ev_seg == SECOND:
            self._queue_protected(top)

    def _bound(self) -> None:
        self.high = max(self.high, self.ix.l2_pages)
        limit = self.fraction * self.high
        while self.pages[SECOND] > limit and self.protected:
            stamp, _nid, node = heapq.heappop(self.protected)
            if node.ev_seg != SECOND or node.ev_stamp != stamp:
                continue
            self._leave(node)
            self._join(node, FIRST)
            if self.ix._l2_evictable(node):
                self.push(node)  # its place changed: the old entry goes stale

    def pop(self):
        self._bound()  # L2 shrank since the last hit: protected may be over its share
        return self._pop(self.heap)

    def queued(self) -> int:
        return len(self.heap) + len(self.protected)


class S3FifoPolicy(_Segmented):
    """Small (``FIRST``) and main (``SECOND``) FIFOs of candidates and a ghost of the page keys evicted from small."""

    name = "s3fifo"

    def __init__(self, index, fraction: float) -> None:
        super().__init__(index)
        self.fraction = fraction
        self.queues: list[list] = [[], [], []]
        self.ghost: "OrderedDict[bytes, None]" = OrderedDict()

    def key(self, node) -> tuple:
        return (node.ev_stamp,)

    def touched(self, node, hit: bool) -> None:
        if node.ev_seg == OUT:
            if node.l2_count:
                self._admit(node)
        elif hit:
            node.ev_freq = min(node.ev_freq + 1, S3FIFO_MAX_FREQ)

    def _admit(self, node) -> None:
        ghost = self.ghost
        seen = False
        for k in node.keys:
            if k in ghost:
                del ghost[k]
                seen = True
        self._join(node, SECOND if seen else FIRST)

    def forget(self, node, evicted: bool) -> None:
        if evicted and node.ev_seg == FIRST:
            self.ghost.update(dict.fromkeys(node.keys))
            while len(self.ghost) > max(1, self.pages[SECOND]):
                self.ghost.popitem(last=False)
        super().forget(node, evicted)

    def push(self, node) -> None:
        if node.ev_seg == OUT:
            self._admit(node)
        self._push(self.queues[node.ev_seg], node)

    def pop(self):
        for _ in range(4 * self.ix.num_nodes + 2):  # each round evicts, moves a node on or spends one of its hits
            small, main = self.pages[FIRST], self.pages[SECOND]
            order = (FIRST, SECOND) if small > self.fraction * (small + main) or not main else (SECOND, FIRST)
            node, q = None, FIRST
            for q in order:
                node = self._pop(self.queues[q])
                if node is not None:
                    break
            if node is None:
                return None
            if node.ev_seg != q:  # queued before it moved (cannot happen: a move re-queues it); take it as it is
                return node
            if node.ev_freq <= 0:
                return node
            if q == FIRST:  # hit while in small: to main's tail
                self._leave(node)
                self._join(node, SECOND)
            else:
                node.ev_freq -= 1
                node.ev_stamp = next(self.ix._clock)
            self.push(node)
        return None

    def queued(self) -> int:
        return sum(len(q) for q in self.queues)


def make_node_policy(index, name: str, protected_fraction: float = DEFAULT_PROTECTED_FRACTION,
                     small_fraction: float = DEFAULT_SMALL_FRACTION) -> NodePolicy:
    """The policy ``name`` (one of :data:`POLICIES`) for ``index``. Raises ValueError naming ``eviction_policy`` or
    the fraction."""
    check_policy(name)
    if name == "slru":
        return SlruPolicy(index, check_fraction(protected_fraction, "slru_protected_fraction"))
    if name == "s3fifo":
        return S3FifoPolicy(index, check_fraction(small_fraction, "s3fifo_small_fraction"))
    return LfuPolicy(index) if name == "lfu" else NodePolicy(index)
