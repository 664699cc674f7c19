"""Radix prefix index over pages: which prefixes live in which tier.

Design after SGLang HiCache's radix tree (``HiRadixCache``), adapted to a plug-in:

- An edge is a run of whole pages. Pages are identified by their chained page keys
  (:mod:`tierkv.connector.core.page_hash`), which name the token ids of the page *and* of every page before it
  *and* the namespace (model, dtype, layout, LoRA, cache salt...). So two sequences share a path exactly
  when they share a page-aligned token prefix within one namespace, and matching is page-aligned by
  construction: a tail shorter than a page has no key and never matches (docs/architecture.md §8 R12).
- Children are keyed by the key of their first page.
- Each node holds, per page, its residency: its L2 host slot (``-1`` = no L2 copy) and whether L3 holds it
  (``in_l3``, set only when the store acknowledged the page). Every indexed page has at least one copy: L2, L3
  or both (an "L3-only" page has no slot); :meth:`RadixIndex.check_invariants` checks it.
- ``lock_ref`` counts in-flight users of a node *and every ancestor* (a lock on a node is applied along the
  path to the root, as in SGLang's ``inc_lock_ref``). Locked pages are never evicted.
- L2 eviction takes unlocked nodes that hold L2 pages while none of their children does (the deepest L2
  copies), in LRU order (or LFU: hit count, then LRU), from a lazily-validated heap. It drops only the L2 copy of
  a page that L3 still holds (the page stays indexed as L3-only, and can be prefetched back); from the first page
  without an L3 copy on, the node and everything below it leave the index. Without L3 this is plain LRU eviction
  of leaves. L3-only leaves leave the index through :meth:`RadixIndex.evict_l3_only` when it grows past a bound.
- A match that ends inside an edge splits the node at that page boundary; the split divides the per-page
  lists and copies no page data. The new parent inherits the child's ``lock_ref`` (every lock through the
  child passes through it).
- Matching an edge costs O(1), not O(pages): keys are chained, so the edge's last key equal to the request's key at
  that depth means every page of the edge matches (a binary search finds a divergence inside the edge). A match
  therefore costs O(nodes on the path); :class:`MatchCursor` lets a waiting request's repeated lookup resume from its
  last answer in O(1) (docs/architecture.md §9).
- Every eviction is O(log nodes) per victim: nodes count their L2 pages and their children holding L2 pages, and
  L2 victims and L3-only leaves come from two lazily validated heaps.

The index owns no memory: it records slot numbers; :meth:`evict` / :meth:`drop_l2` return the slots they dropped
so the caller frees them in its allocator (every slot freed exactly once). A controller that must back a page up
before its L2 copy goes (write_back) takes victims one at a time with :meth:`pop_l2_victim`, locks them while the
backup runs, and calls :meth:`drop_l2` once the store acknowledged them (docs/architecture.md §4). It imports no
engine and no torch.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

NO_SLOT = -1
_L2, _L3 = 1, 2  # tier bits of :mod:`tierkv.connector.obs.kv_events`


class RadixNode:
    """One edge of the tree: a run of pages. ``keys[i]``/``host_slots[i]``/``in_l3[i]`` describe page i.

    Bookkeeping kept by :class:`RadixIndex`: ``depth`` (pages from the root to the end of this edge; a split keeps it
    for the lower part, which stays this object), ``l2_count`` (pages with a slot), ``l2_children`` (children with
    ``l2_count > 0``), ``l2_sub`` (children whose subtree holds an L2 page; ``has_l2``: this subtree does), ``gen`` (bumped whenever this node loses L2 copies, so cached matches through it are redone).
    """

    __slots__ = ("id", "parent", "children", "keys", "host_slots", "in_l3", "lock_ref", "last_access",
                 "hit_count", "_heap_stamp", "_l3_stamp", "depth", "l2_count", "l2_children", "l2_sub", "has_l2", "gen")

    def __init__(self, node_id: int, parent: Optional["RadixNode"], keys: list[bytes], host_slots: list[int],
                 in_l3: list[bool]):
        self.id = node_id
        self.parent = parent
        self.children: dict[bytes, RadixNode] = {}
        self.keys = keys
        self.host_slots = host_slots
        self.in_l3 = in_l3
        self.lock_ref = 0
        self.last_access = 0
        self.hit_count = 0
        self._heap_stamp = -1
        self._l3_stamp = -1
        self.depth = (parent.depth if parent is not None else 0) + len(keys)
        self.l2_count = len(host_slots) - host_slots.count(NO_SLOT)
        self.l2_children = 0
        self.l2_sub = 0
        self.has_l2 = self.l2_count > 0
        self.gen = 0

    @property
    def num_pages(self) -> int:
        return len(self.keys)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return f"RadixNode(id={self.id}, pages={len(self.keys)}, lock_ref={self.lock_ref}, children={len(self.children)})"


@dataclass
class MatchResult:
    """Result of :meth:`RadixIndex.match_prefix`.

    ``num_pages``: length of the matched prefix in pages; ``host_slots``: the L2 slot of each matched page
    (``-1`` for pages not in L2 when matching with ``require_l2=False``); ``in_l3``: per matched page;
    ``last_node``: the deepest node of the match (lock it to protect the whole prefix), the root if nothing
    matched.
    """

    num_pages: int
    host_slots: list[int]
    in_l3: list[bool]
    last_node: RadixNode


class MatchCursor:
    """Where the last :meth:`RadixIndex.match_len` of one request ended: the node holding its last matched page, the
    matched length (pages), and the generations that make it still valid. The scheduler keeps one per waiting request
    so that vLLM's per-step repeat of the lookup costs O(1) (docs/architecture.md §9)."""

    __slots__ = ("node", "pages", "gen", "epoch", "require_l2")

    def __init__(self, node: RadixNode, pages: int, gen: int, epoch: int, require_l2: bool):
        self.node, self.pages, self.gen, self.epoch, self.require_l2 = node, pages, gen, epoch, require_l2


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


class RadixIndex:
    """Page-aligned radix prefix index with lock_ref protection and LRU/LFU eviction of unlocked leaves.

    Args:
        eviction_policy: ``"lru"`` (least recently matched/inserted leaf first) or ``"lfu"`` (fewest hits,
            then least recent).
    Accounting (pages): ``total_pages``, ``l2_pages`` (pages with a host slot), ``l3_pages`` (pages L3
    acknowledged), ``locked_pages`` (pages of nodes with ``lock_ref > 0``); :meth:`check_invariants` recounts
    them. ``match_steps`` counts the work of matching (nodes entered plus binary-search probes), for tests that
    count work instead of timing it.
    """

    def __init__(self, eviction_policy: str = "lru"):
        if eviction_policy not in ("lru", "lfu"):
            raise ValueError(f"eviction_policy must be 'lru' or 'lfu', got {eviction_policy!r}")
        self.policy = eviction_policy
        self._ids = itertools.count()
        self.root = RadixNode(next(self._ids), None, [], [], [])
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self._heap: list[tuple] = []     # L2 victims
        self._l3_heap: list[tuple] = []  # L3-only leaves
        self.total_pages = 0
        self.l2_pages = 0
        self.l3_pages = 0
        self.locked_pages = 0
        self.locked_l2_pages = 0  # L2 copies on locked nodes: what eviction cannot reclaim now (staging room)
        self.evicted_pages = 0
        self.inserted_pages = 0
        self.splits = 0
        self.num_nodes = 1
        self.match_steps = 0
        #: optional observer of tier changes (:class:`tierkv.connector.obs.kv_events.TierEvents`): told which pages gain
        #: or lose an L2 copy or an L3 copy and which leave the index
        self.events = None
        # bumped when a node loses L2 copies while a child still holds some (only a write_back victim that gained
        # L2 children while its backup ran): then a cached match below it cannot see the loss, so all are redone
        self._epoch = 0

    # ------------------------------------------------------------------ matching
    def _edge_match(self, node: RadixNode, pos: int, keys: Sequence[bytes], i: int, n: int) -> int:
        """End of the run of ``node``'s pages from ``pos`` equal to ``keys[i:]`` (page index within the node), given
        that pages before ``pos`` matched. O(1) when the whole run matches (chained keys: equal keys at the end mean
        equal prefixes), else a binary search."""
        nk = node.keys
        end = min(len(nk), pos + n - i)
        self.match_steps += 1
        if end <= pos:
            return pos
        off = i - pos
        if nk[end - 1] == keys[end - 1 + off]:
            return end
        lo, hi = pos, end - 1  # answer in [lo, hi]: pages < lo match, page hi does not
        while lo < hi:
            mid = (lo + hi) // 2
            self.match_steps += 1
            if nk[mid] == keys[mid + off]:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def match_prefix(self, keys: Sequence[bytes], *, require_l2: bool = True, split: bool = False,
                     touch: bool = False) -> MatchResult:
        """Longest prefix of ``keys`` present in the index. O(nodes on the path) plus copying the result.

        Args:
            keys: page keys of a sequence, in order.
            require_l2: stop at the first page without an L2 host slot (what can be loaded from L2 now).
            split: split the last node if the match ends inside it, so that ``last_node`` covers exactly the
                matched prefix (needed before locking). Without it ``last_node`` is the deepest node fully
                matched.
            touch: refresh LRU stamps (and hit counts) along the matched path.
        """
        node = self.root
        slots: list[int] = []
        l3: list[bool] = []
        i = 0
        n = len(keys)
        path: list[RadixNode] = []
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                break
            self.match_steps += 1
            m = len(child.keys)
            j = self._edge_match(child, 1, keys, i + 1, n) if m > 1 else 1
            if require_l2 and child.l2_count != m:
                hs = child.host_slots
                try:
                    j = hs.index(NO_SLOT, 0, j)
                except ValueError:
                    pass
            if j == 0:
                break
            if j == m:
                slots.extend(child.host_slots)
                l3.extend(child.in_l3)
            else:
                slots.extend(child.host_slots[:j])
                l3.extend(child.in_l3[:j])
            i += j
            if j < m:
                if split:
                    child = self._split(child, j)
                    path.append(child)
                    node = child
                break
            path.append(child)
            node = child
        if touch and path:
            self._touch(path, hit=True)
        return MatchResult(num_pages=i, host_slots=slots, in_l3=l3, last_node=node)

    def match_len(self, keys: Sequence[bytes], n: Optional[int] = None, *, require_l2: bool = True,
                  cursor: Optional[MatchCursor] = None) -> tuple[int, MatchCursor]:
        """Length (pages) of the longest indexed prefix of ``keys[:n]``, without building per-page lists or changing
        the index. With the ``cursor`` of an earlier call on the same keys (same ``require_l2``), it resumes from
        there: O(1) when nothing on the path lost L2 copies or left the index since, plus O(log) per node of new
        pages. Returns (pages, cursor to pass next time)."""
        if n is None:
            n = len(keys)
        node, i = self.root, 0
        if (cursor is not None and cursor.require_l2 == require_l2 and cursor.epoch == self._epoch
                and cursor.node.gen == cursor.gen and (cursor.node.parent is not None or cursor.node is self.root)):
            node, i = cursor.node, cursor.pages
            self.match_steps += 1
            while node is not self.root and i <= node.depth - len(node.keys):  # the node was split above us
                node = node.parent
            if i > n:  # fewer keys offered than last time: start over (rare)
                node, i = self.root, 0
        pos = i - (node.depth - len(node.keys))
        while i < n:
            m = len(node.keys)
            if pos == m:
                child = node.children.get(keys[i])
                if child is None:
                    break
                self.match_steps += 1
                node, pos = child, 0
                m = len(child.keys)
            j = self._edge_match(node, pos, keys, i, n)
            if require_l2 and node.l2_count != m:
                try:
                    j = node.host_slots.index(NO_SLOT, pos, j)
                except ValueError:
                    pass
            if j == pos:
                if pos == 0:  # nothing of the child matched: the last matched page is its parent's
                    node = node.parent
                break
            i += j - pos
            pos = j
            if pos < m:
                break
        if i == 0:
            node = self.root
        return i, MatchCursor(node, i, node.gen, self._epoch, require_l2)

    # ------------------------------------------------------------------ insertion
    def insert(self, keys: Sequence[bytes], host_slots: Sequence[int], *, in_l3: Optional[Sequence[bool]] = None,
               start: int = 0) -> tuple[RadixNode, list[int]]:
        """Insert the pages ``keys[start:]`` (whose ancestors ``keys[:start]`` must already be indexed) with
        their L2 slots ``host_slots`` (``len(keys) - start`` entries; ``-1`` allowed for pages that are only in L3).

        Pages already present keep their slot; if the index already had a slot for such a page, the slot
        passed for it is returned in ``duplicate_slots`` (the caller frees it); if the page was present
        without an L2 copy (L3-only), the new slot fills it. ``in_l3`` (per new page) marks pages L3 holds; a
        flag already set is never cleared here. A new page must have a copy somewhere: a slot or ``in_l3``.

        Returns:
            (deepest node of the inserted path, duplicate_slots).
        Raises:
            ValueError: ``keys[:start]`` is not fully indexed, the lengths disagree, or a page not yet indexed
                comes with neither a slot nor ``in_l3``.
        """
        new_keys = keys[start:] if start else keys
        n = len(new_keys)
        if len(host_slots) != n:
            raise ValueError(f"insert: {n} pages but {len(host_slots)} host slots")
        if in_l3 is not None and len(in_l3) != n:
            raise ValueError("insert: in_l3 length differs from the page count")
        m = self.match_prefix(keys[:start], require_l2=False, split=True) if start else None
        if m is not None and m.num_pages != start:
            raise ValueError(f"insert: ancestors not indexed ({m.num_pages} of {start} pages present)")
        node = m.last_node if m is not None else self.root
        dups: list[int] = []
        i = 0
        path: list[RadixNode] = []
        while i < n:
            child = node.children.get(new_keys[i])
            if child is None:
                tail_slots = list(host_slots[i:]) if i else list(host_slots)
                tail_l3 = [bool(f) for f in in_l3[i:]] if in_l3 is not None else [False] * (n - i)
                if NO_SLOT in tail_slots and any(sl == NO_SLOT and not f for sl, f in zip(tail_slots, tail_l3)):
                    raise ValueError("insert: a new page needs an L2 slot or in_l3=True (no copy anywhere)")
                leaf = RadixNode(next(self._ids), node, list(new_keys[i:]), tail_slots, tail_l3)
                node.children[new_keys[i]] = leaf
                if leaf.l2_count:
                    node.l2_children += 1
                    node.l2_sub += 1
                    self._refresh_sub(node)
                self.l3_pages += sum(tail_l3)
                if self.events is not None:
                    self._announce(leaf.keys, tail_slots, tail_l3)
                self.num_nodes += 1
                added = n - i
                self.total_pages += added
                self.inserted_pages += added
                self.l2_pages += leaf.l2_count
                path.append(leaf)
                node = leaf
                i = n
                break
            mp = len(child.keys)
            j = self._edge_match(child, 1, new_keys, i + 1, n) if mp > 1 else 1
            if child.l2_count == mp and in_l3 is None:  # fast path: every page already has a slot
                given = host_slots[i:i + j]
                dups.extend(given if NO_SLOT not in given else [s for s in given if s != NO_SLOT])
            else:
                self._merge_pages(child, j, host_slots, in_l3, i, dups)
            if j < mp:
                child = self._split(child, j)
            path.append(child)
            node = child
            i += j
        if path:
            self._touch(path, hit=False)
        return node, dups

    def _merge_pages(self, child: RadixNode, j: int, host_slots: Sequence[int], in_l3: Optional[Sequence[bool]],
                     i: int, dups: list[int]) -> None:
        had_l2 = child.l2_count > 0
        got_l2, got_l3 = [], []
        for k in range(j):
            new_slot = host_slots[i + k]
            if new_slot != NO_SLOT:
                if child.host_slots[k] == NO_SLOT:
                    child.host_slots[k] = new_slot
                    child.l2_count += 1
                    self.l2_pages += 1
                    got_l2.append(child.keys[k])
                    if child.lock_ref:
                        self.locked_l2_pages += 1
                else:
                    dups.append(new_slot)
            if in_l3 is not None and in_l3[i + k] and not child.in_l3[k]:
                child.in_l3[k] = True
                self.l3_pages += 1
                got_l3.append(child.keys[k])
        if self.events is not None:
            self.events.stored(_L2, got_l2)
            self.events.stored(_L3, got_l3)
        if not had_l2 and child.l2_count:
            child.parent.l2_children += 1
            self._refresh_sub(child)

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
        while self._heap:
            _prio, stamp, _nid, node = heapq.heappop(self._heap)
            if stamp != node._heap_stamp or not self._l2_evictable(node):
                continue
            node._heap_stamp = -1
            return node
        return None

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
        subtree below (pages computed on a broken prefix, or a page that failed its load: docs/architecture.md §8
        R31). Returns the released L2 slots (``[]`` when the page is not indexed), or None, changing nothing, when
        something there is locked (the caller tries again later)."""
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

    def path_keys(self, node: RadixNode) -> list[bytes]:
        """The page keys from the root down to the end of ``node``."""
        parts = []
        while node is not None and node is not self.root:
            parts.append(node.keys)
            node = node.parent
        return [k for part in reversed(parts) for k in part]

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
        assert len(self._heap) <= 4 * self.num_nodes + 1025 and len(self._l3_heap) <= 4 * self.num_nodes + 1025

    # ------------------------------------------------------------------ internals
    def _iter_nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def _evictable(self, node: RadixNode) -> bool:
        return (node is not self.root and node.parent is not None and not node.children and node.lock_ref == 0
                and node.parent.children.get(node.keys[0]) is node)

    def _priority(self, node: RadixNode) -> tuple:
        if self.policy == "lfu":
            return (node.hit_count, node.last_access)
        return (node.last_access,)

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

    def _refresh_sub(self, node: RadixNode) -> None:
        # recompute ``has_l2`` upwards while it flips (O(1) unless a whole chain gains or loses its last L2 page)
        while node is not None:
            has = node.l2_count > 0 or node.l2_sub > 0
            if has == node.has_l2:
                return
            node.has_l2 = has
            node = node.parent
            if node is not None:
                node.l2_sub += 1 if has else -1

    def walk(self, keys: Sequence[bytes]) -> Iterator[tuple[RadixNode, int, int]]:
        """``(node, page index in the node, page index in keys)`` for each indexed page of the path ``keys`` (from the
        root), stopping at the first page not indexed. Read-only."""
        node, i, n = self.root, 0, len(keys)
        while i < n:
            child = node.children.get(keys[i])
            if child is None:
                return
            j = 0
            while j < child.num_pages and i < n and child.keys[j] == keys[i]:
                yield child, j, i
                i += 1
                j += 1
            if j < child.num_pages:
                return
            node = child

    def _push(self, node: RadixNode) -> None:
        if self._l2_evictable(node):
            if len(self._heap) > 4 * self.num_nodes + 1024:
                self._compact_heap()
            stamp = next(self._clock)
            node._heap_stamp = stamp
            heapq.heappush(self._heap, (self._priority(node), stamp, node.id, node))
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

    def _compact_heap(self) -> None:
        # drop stale entries so the heap stays O(nodes) over long runs (no slow leak, docs/architecture.md §8 R21)
        self._heap = [e for e in self._heap if e[3]._heap_stamp == e[1] and self._l2_evictable(e[3])]
        heapq.heapify(self._heap)

    def _touch(self, path: list[RadixNode], hit: bool) -> None:
        # strictly increasing stamps from root to leaf: a leaf is never older than its ancestors
        for n in path:
            n.last_access = next(self._clock)
            if hit:
                n.hit_count += 1
        # re-queue the deepest L2 holder of the path with its new stamp (its old heap entry is stale now)
        for n in reversed(path):
            if n.l2_count:
                self._push(n)
                break
        last = path[-1]
        if not last.l2_count and not last.children:
            self._push_l3(last)

    def _split(self, child: RadixNode, j: int) -> RadixNode:
        """Split ``child`` after its first ``j`` pages; returns the new parent holding those pages. ``child`` keeps the
        lower pages (its depth and heap entries stay valid; its generation moves on, so cursors into it are redone)."""
        parent = child.parent
        top = RadixNode(next(self._ids), parent, child.keys[:j], child.host_slots[:j], child.in_l3[:j])
        top.lock_ref = child.lock_ref
        top.last_access = child.last_access
        top.hit_count = child.hit_count
        child.gen += 1  # a cursor may point at a page that now lives in ``top``: it is redone once
        top.gen = child.gen
        child.keys = child.keys[j:]
        child.host_slots = child.host_slots[j:]
        child.in_l3 = child.in_l3[j:]
        child.parent = top
        had = child.l2_count > 0  # the parent counted ``child`` among its L2 children; ``top`` takes its place
        child.l2_count -= top.l2_count
        top.l2_children = 1 if child.l2_count else 0
        if had != (top.l2_count > 0):
            parent.l2_children += 1 if top.l2_count else -1
        # subtree flags: ``top``'s subtree is the old ``child``'s, so the parent's l2_sub does not change
        child.has_l2 = child.l2_count > 0 or child.l2_sub > 0
        top.l2_sub = 1 if child.has_l2 else 0
        top.has_l2 = top.l2_count > 0 or top.l2_sub > 0
        top.children[child.keys[0]] = child
        parent.children[top.keys[0]] = top
        self.num_nodes += 1
        self.splits += 1
        self._push(top)
        return top

    def _announce(self, keys: Sequence[bytes], slots: Sequence[int], l3: Sequence[bool]) -> None:
        self.events.stored(_L2, [k for k, s in zip(keys, slots) if s != NO_SLOT])
        self.events.stored(_L3, [k for k, f in zip(keys, l3) if f])

    def _remove_leaf(self, node: RadixNode) -> None:
        if self.events is not None:
            self.events.removed(_L2, [k for k, s in zip(node.keys, node.host_slots) if s != NO_SLOT])
            self.events.forgotten(node.keys)
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
