"""L2 eviction policies of the radix index (lru, lfu, slru, s3fifo): a hypothesis state machine per policy over
insert/match(touch)/lock/unlock/evict/pop-lock-drop with the invariants and "no locked page lost" after every step,
and behaviour that tells the policies apart."""
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import initialize, rule

from tierkv.connector.core.node_eviction import FIRST, SECOND
from tierkv.connector.core.radix_index import RadixIndex
from tests.connector.core.test_radix_index import TOKENS, IndexMachine, keys_of


class _PolicyMachine(IndexMachine):
    POLICY = "lru"

    @initialize()
    def setup(self):
        super().setup()
        self.idx = RadixIndex(self.POLICY)

    @rule(tokens=TOKENS)
    def hit(self, tokens):  # a lookup that counts: stamps, hits, promotions
        m = self.idx.match_prefix(keys_of(tokens), touch=True)
        assert m.num_pages <= len(tokens) // 2

    @rule(tokens=TOKENS, i=st.integers(0, 4))
    def remove_from(self, tokens, i):  # pages computed on a broken prefix leave the index, L2 copies and all
        keys = keys_of(tokens)
        if i < len(keys):
            freed = self.idx.remove_from(keys, i)
            if freed is not None:
                self.free.update(freed)

    @rule()
    def pop_lock_drop(self):  # the write_back shape: take a victim, lock it while its backup runs, then drop it
        node = self.idx.pop_l2_victim()
        if node is None:
            return
        assert node.lock_ref == 0 and node.l2_count
        self.idx.lock(node)
        self.idx.check_invariants()
        self.idx.unlock(node)
        freed = self.idx.drop_l2(node)
        for s in freed:
            for _node, _k, slots in self.locks:
                assert s not in slots, f"locked slot {s} dropped"
        self.free.update(freed)


def _machine(policy):
    cls = type(f"{policy.upper()}Machine", (_PolicyMachine,), {"POLICY": policy})
    cls.TestCase.settings = settings(max_examples=60, stateful_step_count=40, deadline=None,
                                     suppress_health_check=[HealthCheck.too_slow])
    return cls.TestCase


TestLruMachine = _machine("lru")
TestLfuMachine = _machine("lfu")
TestSlruMachine = _machine("slru")
TestS3FifoMachine = _machine("s3fifo")


class Cache:
    """An L2 of ``slots`` pages over the index: one-page sequences, evicting as the scheduler does."""

    def __init__(self, policy, slots):
        self.idx = RadixIndex(policy)
        self.free = list(range(slots))

    def put(self, key):
        if self.idx.match_prefix([key]).num_pages:
            return
        if not self.free:
            self.free.extend(self.idx.evict(1))
        self.idx.insert([key], [self.free.pop()])
        self.idx.check_invariants()

    def get(self, key):
        return self.idx.match_prefix([key], touch=True).num_pages == 1

    def held(self, keys):
        return [k for k in keys if self.idx.match_prefix([k]).num_pages]


def k(name):
    return name.encode().ljust(16, b".")


@pytest.mark.parametrize("policy,kept", [("lru", 0), ("lfu", 4), ("slru", 4), ("s3fifo", 4)])
def test_a_scan_larger_than_l2_evicts_the_working_set_only_under_lru(policy, kept):
    c = Cache(policy, 10)
    for i in range(10):  # L2 full, as in steady state
        c.put(k(f"old{i}"))
    work = [k(f"w{i}") for i in range(4)]
    for _ in range(3):  # a working set re-used a few times
        for w in work:
            c.put(w)
            c.get(w)
    for i in range(30):  # a one-time scan of 30 pages through an L2 of 10
        c.put(k(f"scan{i}"))
    assert len(c.held(work)) == kept


def test_lfu_keeps_the_most_hit_page_lru_does_not():
    for policy, survivor in (("lfu", "a"), ("lru", "d")):
        c = Cache(policy, 4)
        for name in "abcd":
            c.put(k(name))
        for _ in range(5):
            c.get(k("a"))
        for name in "bcd":
            c.get(k(name))  # more recent than a, but hit once
        c.idx.evict(3)
        assert c.held([k(n) for n in "abcd"]) == [k(survivor)], policy


def test_s3fifo_ghost_sends_a_reinserted_key_to_main():
    c = Cache("s3fifo", 8)
    for i in range(8):
        c.put(k(f"x{i}"))
    for i in range(1, 8):
        c.get(k(f"x{i}"))  # all but x0 hit: x0 is small's one victim
    c.put(k("y"))
    assert c.held([k("x0")]) == []
    assert k("x0") in c.idx._ev.ghost
    c.put(k("x0"))  # back soon after: straight to main, not small
    node = c.idx.match_prefix([k("x0")]).last_node
    assert node.ev_seg == SECOND and k("x0") not in c.idx._ev.ghost
    c.put(k("z"))  # a key never seen goes to small
    assert c.idx.match_prefix([k("z")]).last_node.ev_seg == FIRST


def test_slru_protected_segment_is_bounded_and_demotes_to_probation():
    c = Cache("slru", 10)
    names = [k(f"p{i}") for i in range(10)]
    for n in names:
        c.put(n)
    for n in names:  # every page hit once: all would be protected without the bound
        c.get(n)
        pol = c.idx._ev
        assert pol.pages[SECOND] <= 0.8 * c.idx.l2_pages
    segs = [c.idx.match_prefix([n]).last_node.ev_seg for n in names]
    assert segs == [FIRST, FIRST] + [SECOND] * 8  # the two least recent protected went back to probation
    c.idx.evict(1)
    assert c.held(names[:1]) == []  # probation's least recent goes first


def test_locked_pages_survive_every_policy():
    for policy in ("lru", "lfu", "slru", "s3fifo"):
        c = Cache(policy, 6)
        for i in range(6):
            c.put(k(f"l{i}"))
        node = c.idx.match_prefix([k("l0")], split=True).last_node
        c.idx.lock(node)
        assert len(c.idx.evict(10)) == 5
        assert c.held([k("l0")]) == [k("l0")], policy
        c.idx.check_invariants()


@pytest.mark.parametrize("policy", ["fifo", "LRU", ""])
def test_unknown_policy_names_the_key_and_the_choices(policy):
    with pytest.raises(ValueError, match=r"eviction_policy must be one of lru, lfu, slru, s3fifo"):
        RadixIndex(policy)


@pytest.mark.parametrize("kw", [{"protected_fraction": 0}, {"protected_fraction": 1}, {"small_fraction": 0},
                                {"small_fraction": 1.0}])
def test_fractions_must_be_inside_zero_one(kw):
    name = "slru" if "protected_fraction" in kw else "s3fifo"
    with pytest.raises(ValueError, match="fraction"):
        RadixIndex(name, **kw)


def test_config_accepts_the_four_policies_and_names_them_when_wrong():
    from tierkv.connector.core.config import ConfigError, load_config

    for name in ("lru", "lfu", "slru", "s3fifo"):
        assert load_config(overrides={"eviction_policy": name}).eviction_policy == name
    with pytest.raises(ConfigError, match=r"eviction_policy(.|\n)*'lru'(.|\n)*'s3fifo'"):
        load_config(overrides={"eviction_policy": "arc"})


@pytest.mark.parametrize("policy", ["lru", "lfu", "slru", "s3fifo"])
@pytest.mark.parametrize("seed", range(3))
def test_random_sequence_keeps_invariants_and_every_locked_page(policy, seed):
    import random

    rng = random.Random(seed)
    idx = RadixIndex(policy)
    free = set(range(12))
    locks = []  # (node, keys, slots) held, or (victim, None, None) in write_back shape
    for _step in range(1500):
        keys = keys_of([rng.randrange(3) for _ in range(rng.randrange(0, 11))])
        r = rng.random()
        if r < 0.35:  # save: lock the match, evict for room, insert
            m = idx.match_prefix(keys, split=True)
            guard = idx.lock(m.last_node) if m.num_pages else None
            need = len(keys) - m.num_pages
            if len(free) < need:
                free.update(idx.evict(need - len(free)))
            if guard is not None:
                idx.unlock(guard)
            got = sorted(free)[:need]
            free.difference_update(got)
            idx.insert(keys[:m.num_pages + len(got)], got, start=m.num_pages)
        elif r < 0.55:
            idx.match_prefix(keys, touch=True)
        elif r < 0.65:
            m = idx.match_prefix(keys, split=True, touch=True)
            if m.num_pages:
                locks.append((idx.lock(m.last_node), keys[:m.num_pages], list(m.host_slots)))
        elif r < 0.75 and locks:
            node, k, _s = locks.pop(rng.randrange(len(locks)))
            idx.unlock(node)
            if k is None and node.parent is not None and not node.lock_ref:
                free.update(idx.drop_l2(node))
        elif r < 0.82:
            free.update(idx.evict(rng.randrange(1, 6)))
        elif r < 0.87:
            v = idx.pop_l2_victim()
            if v is not None:
                locks.append((idx.lock(v), None, None))
        elif r < 0.93 and keys:
            freed = idx.remove_from(keys, rng.randrange(len(keys)))
            free.update(freed or [])
        else:
            idx.set_in_l3(keys, [rng.random() < 0.6 for _ in keys])
        idx.check_invariants()
        assert len(idx.all_slots()) + len(free) == 12
        for _node, k, slots in locks:
            if k is not None:
                m = idx.match_prefix(k)
                assert m.num_pages == len(k) and m.host_slots == slots, "a locked page was lost"


@pytest.mark.parametrize("key", ["slru_protected_fraction", "s3fifo_small_fraction"])
@pytest.mark.parametrize("value", [0, 1, -0.5])
def test_config_fractions_must_be_inside_zero_one(key, value):
    from tierkv.connector.core.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=key):
        load_config(overrides={key: value})


def test_the_fractions_reach_the_index_through_the_scheduler():
    from tests.helpers.namespace import make_namespace
    from tierkv.connector.core.scheduler import CacheScheduler

    s = CacheScheduler(make_namespace(), 16, 16, 8, "slru", eviction_params={"protected_fraction": 0.5})
    assert s.index._ev.fraction == 0.5
    s = CacheScheduler(make_namespace(), 16, 16, 8, "s3fifo", eviction_params={"small_fraction": 0.25})
    assert s.index._ev.fraction == 0.25
