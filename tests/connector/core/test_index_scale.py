"""The index at scale (docs/architecture.md, "The structures"): work counted, not timed.

- a waiting request's repeated lookup costs O(1) index work and hashes nothing after the first, while other
  requests insert and evict around it, and its answer still follows every change of its own path;
- evicting n pages costs work proportional to n, not to the size of the index;
- a seeded long run of 100k random operations keeps every invariant, and the cursor-resumed match always equals a
  fresh one.
"""
import random
from typing import Optional

import pytest

from tests.helpers.namespace import make_namespace
from tierkv.connector.core.page_hash import page_keys, request_root
from tierkv.connector.core.radix_index import NO_SLOT, RadixIndex
from tierkv.connector.core.scheduler import CacheScheduler
from tierkv.storage_backends.eviction import POLICIES

P = 4
NS = make_namespace(dtype="float16", page_size=P, num_kv_heads=1)


def _store(s: CacheScheduler, rid: str, tokens: list[int]) -> None:
    """Request ``rid`` computes all its tokens and its full pages are saved to L2 (what schedule_saves orders)."""
    s.add_request(rid, tokens)
    s.lookup(rid, 0)
    n_pages = len(tokens) // P
    s.schedule_saves(rid, len(tokens), list(range(n_pages + 1)))
    s.build_plan()


def test_waiting_request_lookup_is_o1_after_the_first():
    s = CacheScheduler(NS, P, P, num_slots=600)
    doc = list(range(1000, 1000 + 400 * P))          # 400 pages
    _store(s, "a", doc)
    s.on_finished("a")
    doc_keys = page_keys(request_root(s.ns_digest), doc, P)
    held = s.index.lock(s.index.match_prefix(doc_keys, split=True).last_node)  # a running request holds the doc
    s.add_request("w", doc + [7] * (3 * P + 1))      # waits: vLLM asks every step
    assert s.lookup("w", 0) == 400 * P
    hashed = s.requests["w"].keys.hashed_pages
    assert hashed == 403
    rng = random.Random(1)
    for step in range(60):
        # the engine runs other requests: their pages are inserted, and L2 (600 slots) evicts older ones
        other = [rng.randrange(10**6) for _ in range(rng.randrange(8, 40) * P)]
        _store(s, f"o{step}", other)
        s.on_finished(f"o{step}")
        before = s.index.match_steps
        assert s.lookup("w", 0) == 400 * P
        assert s.index.match_steps - before <= 2, "a repeated lookup walked the index"
        assert s.requests["w"].keys.hashed_pages == hashed, "a repeated lookup hashed pages again"
    assert s.index.evicted_pages > 0  # evictions did happen around the waiting request
    # its own path changes: another request stores the next pages of w -> the answer grows, from the cursor
    _store(s, "x", doc + [7] * (3 * P))
    s.on_finished("x")
    before = s.index.match_steps
    assert s.lookup("w", 0) == 403 * P
    assert s.index.match_steps - before <= 4
    # unlocked and evicted: the answer shrinks to what a fresh match says
    s.index.unlock(held)
    s.allocator.free(s.index.evict(10**6))
    assert s.lookup("w", 0) == 0
    s.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_eviction_work_is_proportional_to_pages_evicted(policy):
    idx = RadixIndex(policy)
    root = request_root(bytes(16))
    slot = 0
    prefixes = [page_keys(root, [r] * (8 * P), P) for r in range(50)]
    for r in range(50):  # 50 roots x 100 branches of 8 + 8 pages
        for b in range(100):
            keys = page_keys(root, [r] * (8 * P) + [r * 1000 + b + 1] * (8 * P), P)
            _, dups = idx.insert(keys, list(range(slot, slot + 16)))
            slot += 16
            assert len(dups) == (8 if b else 0)
    assert idx.total_pages == 50 * 8 + 5000 * 8
    popped = []
    orig = idx.pop_l2_victim

    def counting_pop():
        v = orig()
        popped.append(v)
        return v

    idx.pop_l2_victim = counting_pop
    freed = idx.evict(8 * 3)  # three leaves
    assert len(freed) == 24 and len(popped) == 3
    assert idx._ev.queued() <= 2 * (4 * idx.num_nodes + 1025)
    # the victims' siblings were not rescanned: removing a leaf costs O(1) bookkeeping in its parent
    parent = idx.match_prefix(prefixes[0]).last_node
    assert parent.l2_children == sum(1 for c in parent.children.values() if c.l2_count)
    idx.check_invariants()


def _long_run(ops: int, seed: int, policy: Optional[str] = None, check_every: int = 5000) -> RadixIndex:
    rng = random.Random(seed)
    root = request_root(bytes(16))
    # a family of sequences that share prefixes at many depths
    trunks = [[rng.randrange(50) for _ in range(rng.randrange(1, 10) * P)] for _ in range(12)]
    seqs = []
    for _ in range(300):
        t = rng.choice(trunks)
        cut = rng.randrange(len(t) // P + 1) * P
        seqs.append(page_keys(root, t[:cut] + [rng.randrange(50) for _ in range(rng.randrange(0, 12) * P)], P))
    seqs = [k for k in seqs if k]
    num_slots = 400
    free = list(range(num_slots))
    drawn = rng.choice(["lru", "lfu"])
    idx = RadixIndex(policy or drawn)
    locks: list = []
    cursors: dict = {}
    for op in range(ops):
        keys = rng.choice(seqs)
        r = rng.random()
        if r < 0.25:  # save: slots for the pages past the L2 match
            m = idx.match_prefix(keys, split=True, touch=True)
            guard = idx.lock(m.last_node) if m.num_pages else None
            need = len(keys) - m.num_pages
            if len(free) < need:
                free.extend(idx.evict(need - len(free)))
            if guard is not None:
                idx.unlock(guard)
            k = min(need, len(free))
            slots = [free.pop() for _ in range(k)]
            if k:
                # pages may already be indexed as L3-only: the slots fill them; no duplicates since m stopped there
                _, dups = idx.insert(keys[:m.num_pages + k], slots, start=m.num_pages)
                free.extend(dups)
        elif r < 0.33:  # pages found in L3 by an existence query
            m = idx.match_prefix(keys, require_l2=False, split=True)
            if m.num_pages < len(keys):
                n = rng.randrange(1, len(keys) - m.num_pages + 1)
                idx.insert(keys[:m.num_pages + n], [NO_SLOT] * n, in_l3=[True] * n, start=m.num_pages)
        elif r < 0.43:
            idx.set_in_l3(keys, [rng.random() < 0.7 for _ in keys])
        elif r < 0.47:
            free.extend(idx.clear_l3(keys, [i for i in range(len(keys)) if rng.random() < 0.2]))
        elif r < 0.55:
            m = idx.match_prefix(keys, split=True, touch=True)
            if m.num_pages:
                locks.append((idx.lock(m.last_node), keys[:m.num_pages], list(m.host_slots)))
        elif r < 0.63:
            if locks:
                idx.unlock(locks.pop(rng.randrange(len(locks)))[0])
        elif r < 0.70:
            free.extend(idx.evict(rng.randrange(1, 12)))
        elif r < 0.74:  # write_back shape: pop a victim, hold it, drop it later
            v = idx.pop_l2_victim()
            if v is not None:
                idx.lock(v)
                locks.append((v, None, None))
        elif r < 0.77:
            before = idx.l2_pages
            idx.evict_l3_only(rng.randrange(1, 10))
            assert idx.l2_pages == before
        elif r < 0.80:
            held = [i for i, (n, k, _s) in enumerate(locks) if k is None]
            if held:
                v = locks.pop(held[0])[0]
                idx.unlock(v)
                if v.parent is not None and not v.lock_ref:
                    free.extend(idx.drop_l2(v))
        else:  # the lookup of a waiting request, resumed from its cursor, equals a fresh match
            for req in (True, False):
                cid = (id(keys), req)
                n = rng.randrange(len(keys) + 1) if rng.random() < 0.1 else len(keys)
                got, cursors[cid] = idx.match_len(keys, n, require_l2=req, cursor=cursors.get(cid))
                assert got == idx.match_prefix(keys[:n], require_l2=req).num_pages, (op, req)
        if op % check_every == 0:
            idx.check_invariants()
            assert len(idx.all_slots()) + len(free) == num_slots
            for node, k, slots in locks:  # locked prefixes stay whole
                if k is not None:
                    m = idx.match_prefix(k)
                    assert m.num_pages == len(k) and m.host_slots == slots
    idx.check_invariants()
    assert len(set(idx.all_slots())) + len(set(free)) == num_slots and len(free) == len(set(free))
    return idx


@pytest.mark.parametrize("policy", POLICIES)
def test_long_run_of_each_policy_keeps_invariants_and_locked_pages(policy):
    # invariants (the policy's segment counters recounted too) and every locked prefix whole, every 50 operations
    idx = _long_run(20_000, seed=7, policy=policy, check_every=50)
    assert idx.evicted_pages > 200 and idx.splits > 20


def test_long_run_100k_operations_keeps_invariants():
    idx = _long_run(100_000, seed=20261201)
    assert idx.evicted_pages > 1000 and idx.splits > 100 and idx.inserted_pages > 1000
