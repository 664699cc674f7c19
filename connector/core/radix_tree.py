"""The radix tree of the prefix index: nodes, matching, insertion and splits (page-aligned, after SGLang HiCache).

An edge is a run of whole pages, identified by chained page keys (:mod:`tierkv.connector.core.page_hash`: a key names
the page's tokens, every page before it and the namespace), so two sequences share a path exactly when they share a
page-aligned token prefix; a tail shorter than a page has no key and never matches. Children are keyed by the key of
their first page. Each node holds per page its L2 host slot (``-1`` = none) and whether L3 holds it. Matching an edge
is O(1) (equal last keys mean the whole edge matches; a binary search finds a divergence inside it), so a match costs
O(nodes on the path), and a :class:`MatchCursor` resumes a waiting request's lookup in O(1). A match that ends inside
an edge splits the node there (no page data is copied; the new parent inherits ``lock_ref``). The tier bookkeeping
(locks, eviction heaps, tier counters) is :class:`~tierkv.connector.core.radix_index.RadixIndex`'s.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

NO_SLOT = -1
_L2, _L3 = 1, 2  # tier bits of :mod:`tierkv.connector.obs.kv_events`


class RadixNode:
    """One edge of the tree: a run of pages. ``keys[i]``/``host_slots[i]``/``in_l3[i]`` describe page i.

    Bookkeeping kept by :class:`RadixIndex`: ``depth`` (pages from the root to the end of this edge; a split keeps it
    for the lower part, which stays this object), ``l2_count`` (pages with a slot), ``l2_children`` (children with
    ``l2_count > 0``), ``l2_sub`` (children whose subtree holds an L2 page; ``has_l2``: this subtree does), ``gen`` (bumped whenever this node loses L2 copies, so cached matches through it are redone). ``ev_*``: the eviction policy's
    state (:mod:`tierkv.connector.core.node_eviction`).
    """

    __slots__ = ("id", "parent", "children", "keys", "host_slots", "in_l3", "lock_ref", "last_access",
                 "hit_count", "_heap_stamp", "_l3_stamp", "depth", "l2_count", "l2_children", "l2_sub", "has_l2", "gen",
                 "ev_seg", "ev_stamp", "ev_freq", "ev_pages")

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
        self.ev_seg = self.ev_stamp = self.ev_freq = self.ev_pages = 0

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
    so that vLLM's per-step repeat of the lookup costs O(1)."""

    __slots__ = ("node", "pages", "gen", "epoch", "require_l2")

    def __init__(self, node: RadixNode, pages: int, gen: int, epoch: int, require_l2: bool):
        self.node, self.pages, self.gen, self.epoch, self.require_l2 = node, pages, gen, epoch, require_l2


class RadixTree:
    """The tree part of :class:`~tierkv.connector.core.radix_index.RadixIndex` (its base class): structure, matching,
    insertion, splits and walks. Keeps ``total_pages``, ``num_nodes``, ``inserted_pages``, ``splits`` and
    ``match_steps`` (nodes entered plus binary-search probes, for tests that count work instead of timing it); calls
    the subclass's tier bookkeeping (``_push``, ``_push_l3``, the L2/L3 page counters) as pages change."""

    def __init__(self) -> None:
        self._ids = itertools.count()
        self.root = RadixNode(next(self._ids), None, [], [], [])
        self.root.lock_ref = 1  # the root is never evicted
        self._clock = itertools.count(1)
        self.total_pages = 0
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

    def path_keys(self, node: RadixNode) -> list[bytes]:
        """The page keys from the root down to the end of ``node``."""
        parts = []
        while node is not None and node is not self.root:
            parts.append(node.keys)
            node = node.parent
        return [k for part in reversed(parts) for k in part]

    # ------------------------------------------------------------------ internals
    def _iter_nodes(self) -> Iterator[RadixNode]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

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

    def _touch(self, path: list[RadixNode], hit: bool) -> None:
        # strictly increasing stamps from root to leaf: a leaf is never older than its ancestors
        for n in path:
            n.last_access = next(self._clock)
            if hit:
                n.hit_count += 1
        if self._ev.segmented:  # slru, s3fifo: per-node segment state
            for n in path:
                self._ev.touched(n, hit)
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
        self._ev.split(top, child)
        self._push(top)
        return top

    def _announce(self, keys: Sequence[bytes], slots: Sequence[int], l3: Sequence[bool]) -> None:
        self.events.stored(_L2, [k for k, s in zip(keys, slots) if s != NO_SLOT])
        self.events.stored(_L3, [k for k, f in zip(keys, l3) if f])
