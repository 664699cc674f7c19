"""Radix prefix index over pages: which prefixes live in which tier (L2 host slots, L3 flags).

The tree (nodes, matching, insertion, splits) is :class:`~tierkv.connector.core.radix_tree.RadixTree`; this module
adds the tier bookkeeping. Every indexed page has a copy: an L2 slot, L3 (``in_l3``, set only once the store
acknowledged the page) or both. ``lock_ref`` counts in-flight users of a node and every ancestor; locked pages are
never evicted. L2 eviction takes unlocked nodes holding L2 pages while none of their children does (the candidates),
in the order of the eviction policy (lru, lfu, slru or s3fifo: :mod:`tierkv.connector.core.node_eviction`, lazily
validated heaps), O(log nodes) per victim: a page L3 holds stays indexed as L3-only, and from the
first page without an L3 copy on the node and its subtree leave the index. L3-only leaves leave through
:meth:`RadixIndex.evict_l3_only` when the index grows past a bound. The index owns no memory: :meth:`evict` and
:meth:`drop_l2` return the slots they dropped for the caller to free (each exactly once); a write_back controller
takes victims one at a time (:meth:`pop_l2_victim`) and drops them once their backup was acknowledged.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Optional, Sequence

from tierkv.connector.core.node_eviction import make_node_policy
from tierkv.connector.core.radix_tree import _L2, _L3, NO_SLOT, MatchCursor, MatchResult, RadixNode, RadixTree

__all__ = ["NO_SLOT", "IndexStats", "MatchCursor", "MatchResult", "RadixIndex", "RadixNode", "RadixTree"]


@dataclass
class IndexStats:
    nodes: int = 0
    pages: int = 0
    l2_pages: int = 0
    l3_pages: int = 0
    locked_pages: int = 0
    locked_l2_pages: int = 0
    evictable_pages: int = 0
    evicted_pages: int = 0
    inserted_pages: int = 0
    splits: int = 0


class RadixIndex(RadixTree):
    """Page-aligned radix prefix index with lock_ref protection and policy-ordered eviction of unlocked leaves.

    Args:
        eviction_policy: ``"lru"`` (least recently matched/inserted leaf first), ``"lfu"`` (fewest hits, then least
            recent), ``"slru"`` or ``"s3fifo"`` (:mod:`tierkv.connector.core.node_eviction`).
        protected_fraction, small_fraction: slru's protected share and s3fifo's small share of the L2 pages.
    Accounting (pages): ``total_pages``, ``l2_pages`` (pages with a host slot), ``l3_pages`` (pages L3
    acknowledged), ``locked_pages`` (pages of nodes with ``lock_ref > 0``); :meth:`check_invariants` recounts
    them. ``match_steps`` counts the work of matching (nodes entered plus binary-search probes), for tests that
    count work instead of timing it.
    """

    def __init__(self, eviction_policy: str = "lru", *, protected_fraction: float = 0.8, small_fraction: float = 0.1):
        super().__init__()
        self._ev = make_node_policy(self, eviction_policy, protected_fraction, small_fraction)  # L2 victims
        self.policy = eviction_policy
        self._l3_heap: list[tuple] = []  # L3-only leaves
        self.l2_pages = 0
        self.l3_pages = 0
        self.locked_pages = 0
        self.locked_l2_pages = 0  # L2 copies on locked nodes: what eviction cannot reclaim now (staging room)
        self.evicted_pages = 0

    # ------------------------------------------------------------------ locking
    def lock(self, node: RadixNode) -> RadixNode:
        """Increment ``lock_ref`` of ``node`` and every ancestor (not the root). Returns ``node`` as the
        handle to pass to :meth:`unlock`."""
        n = node
        while n is not self.root:
            if n.lock_ref == 0:
                self.locked_pages += n.num_pages
                self.locked_l2_pages += n.l2_count
            n.lock_ref += 1
            n = n.parent
        return node

    def unlock(self, node: RadixNode) -> None:
        """Reverse one :meth:`lock` of ``node``. Raises RuntimeError if a lock count would go negative."""
        n = node
        while n is not self.root:
            if n.lock_ref <= 0:
                raise RuntimeError(f"unlock of node {n.id} with lock_ref {n.lock_ref}")
            n.lock_ref -= 1
            if n.lock_ref == 0:
                self.locked_pages -= n.num_pages
                self.locked_l2_pages -= n.l2_count
                self._push(n)
            n = n.parent

    # ------------------------------------------------------------------ eviction
    def evict(self, num_pages: int) -> list[int]:
        """Drop L2 copies, victim by victim in policy order (:meth:`pop_l2_victim` + :meth:`drop_l2`), until at
        least ``num_pages`` slots were released or no victim is left. Pages L3 holds stay indexed as L3-only.
        Cost: O(log nodes) per victim (amortised), proportional to what is evicted.

        Returns the released L2 slots (each exactly once); the caller returns them to its allocator.
        """
        freed: list[int] = []
        while len(freed) < num_pages:
            node = self.pop_l2_victim()
            if node is None:
                break
            freed.extend(self.drop_l2(node))
        return freed

    def pop_l2_victim(self) -> Optional[RadixNode]:
        """The next node whose L2 copy may go, in policy order, or None: unlocked, holding L2 pages, no child
        holding any. The node leaves the heap; the caller either calls :meth:`drop_l2` on it now, or locks it
        (e.g. while a write_back backup runs) and drops it later. A node popped and left alone is pushed again the
        next time it is touched, unlocked or loses its last L2 child."""
        return self._ev.pop()

    def drop_l2(self, node: RadixNode) -> list[int]:
        """Drop the L2 copy of ``node``'s pages. Pages before the first page without an L3 copy stay indexed as
        L3-only; from that page on, the node (split there, no data copied) and its whole subtree leave the index.

        Returns the released L2 slots (of the node and of any removed descendant).
        Raises:
            RuntimeError: ``node`` (or a descendant that would be removed) is locked.
        """
        if node.lock_ref:
            raise RuntimeError(f"drop_l2 of locked node {node.id}")
        orig_parent = node.parent
        if node.l2_sub:
            self._epoch += 1  # an ancestor loses L2 above a descendant that keeps it: cursors cannot see that
        node.gen += 1
        freed = [sl for sl in node.host_slots if sl != NO_SLOT] if node.l2_count else []
        if self.events is not None:
            self.events.removed(_L2, [k for k, sl in zip(node.keys, node.host_slots) if sl != NO_SLOT])
        node.host_slots = [NO_SLOT] * node.num_pages
        self._set_l2_count(node, 0)
        self._refresh_sub(node)
        self.l2_pages -= len(freed)
        self._ev.forget(node, True)
        if False in node.in_l3:
            j = node.in_l3.index(False)
            if j > 0:
                self._split(node, j)  # the head (pages [:j]) stays as L3-only; ``node`` is now the tail
            freed.extend(self.remove_prefix_from(node))
        else:
            self._push_l3(node)
        self.evicted_pages += len(freed)
        if orig_parent is not None and orig_parent is not self.root:
            self._push(orig_parent)  # it may now hold the deepest L2 copies on its path
        return freed

    def evict_l3_only(self, num_pages: int) -> int:
        """Remove unlocked L3-only leaves (no L2 copy; the L3 copy stays in the store) in LRU order until at least
        ``num_pages`` pages left the index or none is left. Bounds the index's memory when L3 is much larger than
        L2. Returns the number of pages removed. O(log nodes) per leaf removed (amortised)."""
        removed = 0
        while removed < num_pages and self._l3_heap:
            _prio, stamp, _nid, leaf = heapq.heappop(self._l3_heap)
            if stamp != leaf._l3_stamp or not self._l3_evictable(leaf):
                continue
            leaf._l3_stamp = -1
            removed += leaf.num_pages
            self._remove_leaf(leaf)
        return removed

    def clear_l3(self, keys: Sequence[bytes], positions: Sequence[int]) -> list[int]:
        """L3 no longer holds the pages ``keys[i]`` for ``i`` in ``positions`` (a read found them missing or
        corrupt). Pages with an L2 copy just lose their L3 flag. From the first listed page without an L2 copy
        on, the path is cut (node split there, the rest and its subtree removed) unless something there is locked;
        then those pages keep their flag (the caller remembers them as absent). Returns the released L2 slots."""
        want = set(positions)
        cut = None
        for node, j, i in self.walk(keys):
            if i not in want or not node.in_l3[j]:
                continue
            if node.host_slots[j] == NO_SLOT:
                cut = (node, j, i)
                break
            node.in_l3[j] = False
            self.l3_pages -= 1
            if self.events is not None:
                self.events.removed(_L3, [node.keys[j]])
        if cut is None:
            return []
        node, j, at = cut
        if node.lock_ref:
            return []
        if self.events is not None:  # the store lost the listed pages from the cut on; the rest leaves the index
            self.events.removed(_L3, [keys[i] for i in sorted(want) if at <= i < len(keys)])
        if j > 0:
            self._split(node, j)  # ``node`` is now the tail starting at the page to forget
        orig_parent = node.parent
        freed = self.remove_prefix_from(node)
        if orig_parent is not None and orig_parent is not self.root:
            self._push(orig_parent)
        return freed

    def remove_from(self, keys: Sequence[bytes], i: int) -> Optional[list[int]]:
        """Drop page ``keys[i]`` of the path ``keys`` (from the root), every page after it on its node and the whole
        subtree below (pages computed on a broken prefix, or a page that failed its load). Returns the released L2
        slots (``[]`` when the page is not indexed), or None, changing nothing, when something there is locked (the
        caller tries again later)."""
        if not 0 <= i < len(keys):
            raise ValueError(f"remove_from: page {i} outside the path of {len(keys)} pages")
        at = None
        for node, j, k in self.walk(keys[: i + 1]):
            if k == i:
                at = (node, j)
        if at is None:
            return []
        node, j = at
        if node.lock_ref:
            return None
        if j > 0:
            self._split(node, j)  # ``node`` is now the tail starting at page i
        orig_parent = node.parent
        freed = self.remove_prefix_from(node)
        if orig_parent is not None and orig_parent is not self.root:
            self._push(orig_parent)
        return freed

    def set_in_l3(self, keys: Sequence[bytes], flags: Sequence[bool]) -> int:
        """Mark the pages ``keys`` (a path from the root) as held by L3 where ``flags[i]`` is true (the store
        acknowledged page i). Pages no longer indexed are skipped. Returns the number of pages newly marked."""
        if len(flags) != len(keys):
            raise ValueError(f"set_in_l3: {len(keys)} keys but {len(flags)} flags")
        marked = 0
        for node, j, i in self.walk(keys):
            if flags[i] and not node.in_l3[j]:
                node.in_l3[j] = True
                marked += 1
                if self.events is not None:
                    self.events.stored(_L3, [node.keys[j]])
        self.l3_pages += marked
        return marked

    def remove_prefix_from(self, node: RadixNode) -> list[int]:
        """Drop ``node`` and its whole subtree (e.g. pages found corrupt). Returns the released L2 slots.
        Raises RuntimeError if any node of the subtree is locked."""
        stack = [node]
        sub = []
        while stack:
            n = stack.pop()
            if n.lock_ref:
                raise RuntimeError(f"cannot remove locked node {n.id}")
            sub.append(n)
            stack.extend(n.children.values())
        freed = []
        for n in reversed(sub):  # leaves first
            freed.extend(s for s in n.host_slots if s != NO_SLOT)
            self._remove_leaf(n)
        return freed

    def clear(self) -> list[int]:
        """Drop every unlocked node (locked paths stay). Returns the released slots."""
        freed: list[int] = []
        while True:
            leaves = [n for n in self._iter_nodes() if self._evictable(n)]
            if not leaves:
                return freed
            for leaf in leaves:
                freed.extend(s for s in leaf.host_slots if s != NO_SLOT)
                self._remove_leaf(leaf)

    # ------------------------------------------------------------------ accounting
    def stats(self) -> IndexStats:
        return IndexStats(nodes=self.num_nodes, pages=self.total_pages, l2_pages=self.l2_pages,
                          l3_pages=self.l3_pages, locked_pages=self.locked_pages,
                          evictable_pages=self.total_pages - self.locked_pages,
                          evicted_pages=self.evicted_pages, inserted_pages=self.inserted_pages,
                          splits=self.splits)

    def all_slots(self) -> list[int]:
        """Every L2 slot referenced by the index."""
        return [s for n in self._iter_nodes() for s in n.host_slots if s != NO_SLOT]

    def check_invariants(self) -> None:
        """Recount everything and check the tree's invariants; raises AssertionError on a violation.

        No empty edge; children keyed by their first page key; parents consistent; depth, l2_count and l2_children
        equal a recount; lock_ref >= 0 and no child locked more than its parent; every page has a copy (L2 slot or
        L3); no slot referenced twice; page counters equal a recount."""
        pages = l2 = l3 = locked = nodes = 0
        seen: set[int] = set()
        assert self.root.l2_children == sum(1 for c in self.root.children.values() if c.l2_count)
        for n in self._iter_nodes():
            nodes += 1
            assert n.num_pages > 0, f"node {n.id} has an empty key"
            assert len(n.host_slots) == len(n.keys) == len(n.in_l3)
            assert n.parent is not None and n.parent.children.get(n.keys[0]) is n
            assert n.depth == n.parent.depth + n.num_pages, f"node {n.id}: depth {n.depth}"
            assert n.l2_count == sum(1 for s in n.host_slots if s != NO_SLOT), f"node {n.id}: l2_count"
            assert n.l2_children == sum(1 for c in n.children.values() if c.l2_count), f"node {n.id}: l2_children"
            assert n.l2_sub == sum(1 for c in n.children.values() if c.has_l2), f"node {n.id}: l2_sub"
            assert n.has_l2 == (n.l2_count > 0 or n.l2_sub > 0), f"node {n.id}: has_l2"
            assert n.lock_ref >= 0
            if n.parent is not self.root:
                assert n.lock_ref <= n.parent.lock_ref, "child locked more than its parent"
            pages += n.num_pages
            l3 += sum(n.in_l3)
            for s_, f in zip(n.host_slots, n.in_l3):
                assert s_ != NO_SLOT or f, f"node {n.id}: a page with no copy (no L2 slot, not in L3)"
            if n.lock_ref:
                locked += n.num_pages
            for s in n.host_slots:
                if s != NO_SLOT:
                    assert s not in seen, f"slot {s} referenced twice"
                    seen.add(s)
                    l2 += 1
            # every candidate is findable: an L2 victim has a live heap entry, so is an L3-only leaf
            if self._l2_evictable(n):
                assert n._heap_stamp != -1, f"node {n.id} may lose its L2 copy but is not queued"
            if self._l3_evictable(n):
                assert n._l3_stamp != -1, f"L3-only leaf {n.id} is not queued"
        assert nodes + 1 == self.num_nodes, (nodes + 1, self.num_nodes)
        assert pages == self.total_pages, (pages, self.total_pages)
        assert l2 == self.l2_pages, (l2, self.l2_pages)
        assert l3 == self.l3_pages, (l3, self.l3_pages)
        assert locked == self.locked_pages, (locked, self.locked_pages)
        locked_l2 = sum(n.l2_count for n in self._iter_nodes() if n.lock_ref > 0)
        assert locked_l2 == self.locked_l2_pages, (locked_l2, self.locked_l2_pages)
        assert self._ev.queued() <= 2 * (4 * self.num_nodes + 1025) and len(self._l3_heap) <= 4 * self.num_nodes + 1025
        self._ev.check()

    # ------------------------------------------------------------------ internals
    def _evictable(self, node: RadixNode) -> bool:
        return (node is not self.root and node.parent is not None and not node.children and node.lock_ref == 0
                and node.parent.children.get(node.keys[0]) is node)

    def _l2_evictable(self, node: RadixNode) -> bool:
        # unlocked, holds L2 copies, and none of its children does: the deepest L2 copies on their path. O(1).
        return (node.l2_count > 0 and node.l2_children == 0 and node.lock_ref == 0 and node.parent is not None)

    def _l3_evictable(self, node: RadixNode) -> bool:
        return (node.l2_count == 0 and not node.children and node.lock_ref == 0 and node.parent is not None
                and node is not self.root)

    def _set_l2_count(self, node: RadixNode, count: int) -> None:
        if (node.l2_count > 0) != (count > 0) and node.parent is not None:
            node.parent.l2_children += 1 if count > 0 else -1
        node.l2_count = count

    def _push(self, node: RadixNode) -> None:
        if self._l2_evictable(node):
            self._ev.push(node)
        elif self._l3_evictable(node):
            self._push_l3(node)

    def _push_l3(self, node: RadixNode) -> None:
        if self._l3_evictable(node):
            if len(self._l3_heap) > 4 * self.num_nodes + 1024:
                self._l3_heap = [e for e in self._l3_heap if e[3]._l3_stamp == e[1] and self._l3_evictable(e[3])]
                heapq.heapify(self._l3_heap)
            stamp = next(self._clock)
            node._l3_stamp = stamp
            heapq.heappush(self._l3_heap, (node.last_access, stamp, node.id, node))

    def _remove_leaf(self, node: RadixNode) -> None:
        if self.events is not None:
            self.events.removed(_L2, [k for k, s in zip(node.keys, node.host_slots) if s != NO_SLOT])
            self.events.forgotten(node.keys)
        self._ev.forget(node, False)
        parent = node.parent
        del parent.children[node.keys[0]]
        if node.l2_count:
            parent.l2_children -= 1
        if node.has_l2:
            parent.l2_sub -= 1
            self._refresh_sub(parent)
        node.parent = None
        node.gen += 1
        self.num_nodes -= 1
        self.total_pages -= node.num_pages
        self.l2_pages -= node.l2_count
        self.l3_pages -= sum(node.in_l3)
        if parent is not self.root:
            self._push(parent)
