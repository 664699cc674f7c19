"""Radix prefix index: unit tests and a hypothesis state machine over insert/match/lock/unlock/evict."""
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from tierkv.connector.core.page_hash import page_keys, request_root
from tierkv.connector.core.radix_index import NO_SLOT, RadixIndex

P = 2
ROOT = request_root(b"\x00" * 16)


def keys_of(tokens):
    return page_keys(ROOT, tokens, P)


def test_match_empty_and_short_keys():
    idx = RadixIndex()
    assert idx.match_prefix([]).num_pages == 0
    assert keys_of([5]) == []  # shorter than a page: no key at all
    node, dups = idx.insert(keys_of([5]), [])
    assert node is idx.root and dups == [] and idx.num_nodes == 1  # no node with an empty key
    idx.check_invariants()


def test_insert_match_split_without_copy():
    idx = RadixIndex()
    a = keys_of([1, 2, 3, 4, 5, 6])        # 3 pages
    b = keys_of([1, 2, 3, 4, 9, 9, 7, 7])  # shares 2 pages
    idx.insert(a, [10, 11, 12])
    assert idx.match_prefix(a).host_slots == [10, 11, 12]
    m = idx.match_prefix(b, split=False)
    assert m.num_pages == 2 and idx.num_nodes == 2  # no split without asking
    m = idx.match_prefix(b, split=True)
    assert m.num_pages == 2 and m.host_slots == [10, 11] and idx.num_nodes == 3
    assert m.last_node.keys == a[:2]
    _, dups = idx.insert(b, [20, 21, 22, 23])
    assert dups == [20, 21]  # the first two pages were already in L2: caller frees the new slots
    assert idx.match_prefix(b).host_slots == [10, 11, 22, 23]
    assert idx.match_prefix(a).host_slots == [10, 11, 12]
    idx.check_invariants()
    assert idx.total_pages == 5 and idx.l2_pages == 5


def test_lock_protects_path_and_lru_order():
    idx = RadixIndex()
    a, b, c = keys_of([1, 1, 2, 2]), keys_of([1, 1, 3, 3]), keys_of([4, 4])
    idx.insert(a, [0, 1])
    idx.insert(b, [1, 2], )  # page 0 duplicate -> slot 1 returned as dup
    idx.insert(c, [3])
    m = idx.match_prefix(a, split=True, touch=True)
    h = idx.lock(m.last_node)
    # unlocked leaves: b's tail (older), c (older than a's touch). a's leaf and its parent are locked.
    freed = idx.evict(10)
    assert sorted(freed) == [2, 3]
    assert idx.match_prefix(a).num_pages == 2
    idx.unlock(h)
    assert sorted(idx.evict(10)) == [0, 1]
    assert idx.total_pages == 0
    idx.check_invariants()
    with pytest.raises(RuntimeError):
        idx.unlock(h)


def test_lru_evicts_least_recently_matched_leaf_first():
    idx = RadixIndex()
    seqs = [keys_of([i, i]) for i in range(4)]
    for i, s in enumerate(seqs):
        idx.insert(s, [i])
    idx.match_prefix(seqs[0], touch=True)
    assert idx.evict(1) == [1]
    assert idx.evict(1) == [2]
    assert idx.evict(1) == [3]
    assert idx.evict(1) == [0]


def test_lfu_prefers_fewest_hits():
    idx = RadixIndex("lfu")
    seqs = [keys_of([i, i]) for i in range(3)]
    for i, s in enumerate(seqs):
        idx.insert(s, [i])
    for _ in range(3):
        idx.match_prefix(seqs[0], touch=True)
    idx.match_prefix(seqs[1], touch=True)
    assert idx.evict(1) == [2]
    assert idx.evict(1) == [1]


def test_insert_requires_indexed_ancestors():
    idx = RadixIndex()
    k = keys_of([1, 1, 2, 2])
    with pytest.raises(ValueError):
        idx.insert(k, [5], start=1)
    with pytest.raises(ValueError):
        idx.insert(k, [5])


def test_bad_policy():
    with pytest.raises(ValueError, match="eviction_policy"):
        RadixIndex("fifo")


# ---------------------------------------------------------------- residency: L2, L3, both
def test_l2_eviction_keeps_pages_l3_holds():
    idx = RadixIndex()
    k = keys_of([1, 1, 2, 2, 3, 3, 4, 4])  # 4 pages
    idx.insert(k, [0, 1, 2, 3])
    assert idx.set_in_l3(k, [True] * 4) == 4 and idx.l3_pages == 4
    assert sorted(idx.evict(4)) == [0, 1, 2, 3]
    assert idx.l2_pages == 0 and idx.total_pages == 4 and idx.l3_pages == 4
    assert idx.match_prefix(k).num_pages == 0  # nothing loadable from L2
    m = idx.match_prefix(k, require_l2=False)
    assert m.num_pages == 4 and m.host_slots == [NO_SLOT] * 4 and m.in_l3 == [True] * 4
    # a prefetch publishes L2 copies into the L3-only pages: no duplicate slots, both copies now
    _, dups = idx.insert(k, [7, 8], start=2)
    assert dups == [] and idx.match_prefix(k, require_l2=False).host_slots == [NO_SLOT, NO_SLOT, 7, 8]
    idx.check_invariants()


def test_l2_eviction_cuts_at_first_page_without_l3():
    idx = RadixIndex()
    k = keys_of([1, 1, 2, 2, 3, 3, 4, 4])
    idx.insert(k, [0, 1, 2, 3])
    idx.set_in_l3(k, [True, True, False, True])  # page 3 held by L3 but unreachable once page 2 is gone
    assert sorted(idx.evict(1)) == [0, 1, 2, 3]
    m = idx.match_prefix(k, require_l2=False)
    assert m.num_pages == 2 and m.in_l3 == [True, True] and m.host_slots == [NO_SLOT, NO_SLOT]
    assert idx.total_pages == 2 and idx.l3_pages == 2 and idx.l2_pages == 0
    idx.check_invariants()


def test_parent_becomes_victim_when_children_hold_only_l3():
    idx = RadixIndex()
    a = keys_of([1, 1, 2, 2])
    b = keys_of([1, 1, 2, 2, 5, 5, 6, 6])
    idx.insert(a, [0, 1])
    idx.insert(b, [2, 3], start=2)
    idx.set_in_l3(b, [False, False, True, True])  # only the child's pages are in L3
    assert sorted(idx.evict(1)) == [2, 3]        # the deepest L2 copies go first, the child stays L3-only
    assert idx.match_prefix(b, require_l2=False).num_pages == 4
    assert sorted(idx.evict(1)) == [0, 1]        # then the parent: not in L3, so it and its subtree go
    assert idx.total_pages == 0 and idx.num_nodes == 1
    idx.check_invariants()


def test_pop_victim_lock_then_drop_write_back_shape():
    idx = RadixIndex()
    k = keys_of([1, 1, 2, 2])
    idx.insert(k, [4, 5])
    v = idx.pop_l2_victim()
    assert v is not None and v.host_slots == [4, 5]
    h = idx.lock(v)                      # a backup runs: the victim is pinned
    assert idx.pop_l2_victim() is None and idx.evict(2) == []
    idx.set_in_l3(k, [True, True])       # the store acknowledged both pages
    idx.unlock(h)
    assert sorted(idx.drop_l2(v)) == [4, 5]
    assert idx.match_prefix(k, require_l2=False).in_l3 == [True, True]
    with pytest.raises(RuntimeError):
        idx.drop_l2(idx.lock(v))
    idx.check_invariants()


def test_insert_refuses_page_without_any_copy_and_l3_only_leaves_are_bounded():
    idx = RadixIndex()
    k = keys_of([1, 1, 2, 2, 3, 3])
    with pytest.raises(ValueError, match="no copy"):
        idx.insert(k, [NO_SLOT, NO_SLOT, NO_SLOT])
    idx.insert(k, [NO_SLOT] * 3, in_l3=[True] * 3)     # pages found in L3 by an existence query
    other = keys_of([9, 9])
    idx.insert(other, [0])
    assert idx.evict_l3_only(1) == 3                   # the L3-only leaf goes whole; the L2 page stays
    assert idx.total_pages == 1 and idx.match_prefix(other).host_slots == [0]
    idx.check_invariants()


TOKENS = st.lists(st.integers(0, 2), min_size=0, max_size=10)


class IndexMachine(RuleBasedStateMachine):
    NUM_SLOTS = 12

    @initialize()
    def setup(self):
        self.idx = RadixIndex()
        self.free = set(range(self.NUM_SLOTS))
        self.locks = []  # (node, keys, slots) held

    def _alloc(self, n):
        if len(self.free) < n:
            freed = self.idx.evict(n - len(self.free))
            for s in freed:
                assert s not in self.free, f"slot {s} freed twice"
                for _node, _k, slots in self.locks:
                    assert s not in slots, f"locked slot {s} evicted"
            self.free.update(freed)
        k = min(n, len(self.free))
        out = sorted(self.free)[:k]
        self.free.difference_update(out)
        return out

    @rule(tokens=TOKENS)
    def insert(self, tokens):
        keys = keys_of(tokens)
        m = self.idx.match_prefix(keys, split=True)
        guard = self.idx.lock(m.last_node) if m.num_pages else None
        slots = self._alloc(len(keys) - m.num_pages)
        if guard is not None:
            self.idx.unlock(guard)
        n = m.num_pages + len(slots)
        _, dups = self.idx.insert(keys[:n], slots, start=m.num_pages)
        assert dups == []
        # match after insert returns the inserted prefix, up to the last whole page
        m2 = self.idx.match_prefix(keys)
        assert m2.num_pages >= n
        assert m2.host_slots[m.num_pages:n] == slots

    @rule(tokens=TOKENS)
    def lock(self, tokens):
        keys = keys_of(tokens)
        m = self.idx.match_prefix(keys, split=True, touch=True)
        if m.num_pages:
            self.locks.append((self.idx.lock(m.last_node), keys[: m.num_pages], list(m.host_slots)))

    @rule(i=st.integers(0, 100))
    def unlock(self, i):
        if self.locks:
            node, _k, _s = self.locks.pop(i % len(self.locks))
            self.idx.unlock(node)

    @rule(n=st.integers(1, 6))
    def evict(self, n):
        freed = self.idx.evict(n)
        for s in freed:
            assert s not in self.free
            for _node, _k, slots in self.locks:
                assert s not in slots
        self.free.update(freed)

    @rule(tokens=TOKENS, data=st.data())
    def mark_l3(self, tokens, data):
        keys = keys_of(tokens)
        flags = data.draw(st.lists(st.booleans(), min_size=len(keys), max_size=len(keys)))
        self.idx.set_in_l3(keys, flags)

    @rule(n=st.integers(1, 6))
    def evict_l3_only(self, n):
        before = self.idx.l2_pages
        self.idx.evict_l3_only(n)
        assert self.idx.l2_pages == before  # only pages without an L2 copy leave

    @rule(tokens=TOKENS)
    def match(self, tokens):
        keys = keys_of(tokens)
        m = self.idx.match_prefix(keys)
        assert m.num_pages <= len(keys)
        assert NO_SLOT not in m.host_slots

    @invariant()
    def consistent(self):
        if not hasattr(self, "idx"):
            return
        self.idx.check_invariants()
        used = self.idx.all_slots()
        assert not set(used) & self.free
        assert len(used) + len(self.free) == self.NUM_SLOTS  # no leak, no double use
        for node, keys, slots in self.locks:  # locked prefixes stay whole
            m = self.idx.match_prefix(keys)
            assert m.num_pages == len(keys) and m.host_slots == slots


IndexMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None,
                                          suppress_health_check=[HealthCheck.too_slow])
TestIndexMachine = IndexMachine.TestCase
