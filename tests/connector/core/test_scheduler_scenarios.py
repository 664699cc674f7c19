"""Connector core end to end without an engine: scheduler side + worker side on real L1/L2 tensors.

Namespace isolation, keys shorter than a page, preemption, aborts and a seeded soak, as they apply to L1/L2.
"""
import random

import pytest

from tests.helpers.fake_engine import LAYERS, P, FakeEngine, Req, inject_copy_fault
from tierkv.connector.core.page_hash import page_keys, request_root


def toks(a, n):
    return list(range(a, a + n))


def test_repeat_prefix_is_loaded_from_l2_bit_exact():
    e = FakeEngine()
    doc = toks(100, 4 * P)
    assert e.run(Req("a", doc + [1, 2, 3])) == 0
    assert e.run(Req("b", doc + [7, 8])) == 4 * P
    assert e.worker.counters.verified_pages == 4 and e.worker.counters.checksum_mismatches == 0
    # an exact multiple of the page: the last page is recomputed (one token must be left to compute)
    assert e.run(Req("c", doc)) == 3 * P
    e.idle_check()


def test_keys_shorter_than_a_page():
    e = FakeEngine()
    for i, n in enumerate([0, 1, P - 1]):
        assert e.run(Req(f"s{i}", toks(5, n))) == 0
    assert e.sched.index.total_pages == 0 and e.sched.index.num_nodes == 1  # no node, no empty key
    assert e.worker.counters.save_pages == 0
    assert e.run(Req("p", toks(5, P))) == 0         # exactly one page: saved, but nothing to match yet
    assert e.sched.index.total_pages == 1
    assert e.run(Req("p1", toks(5, P + 1))) == P    # same first page + 1 token
    assert e.run(Req("short", toks(5, P - 1))) == 0  # a prefix of a cached page: no partial-page match
    e.idle_check()
    assert e.sched.index.total_pages == e.sched.stats()["index_pages"] == e.sched.index.l2_pages


@pytest.mark.parametrize("field", ["salt", "lora"])
def test_namespaces_never_share_pages(field):
    e = FakeEngine()
    T = toks(11, 4 * P) + [1]
    kw = lambda v: {field: v, "tag": f"{field}:{v}"}
    assert e.run(Req("A", T, **kw("tenantA"))) == 0
    assert e.run(Req("B", T, **kw("tenantB"))) == 0
    assert e.run(Req("C", T)) == 0
    assert e.run(Req("D", T, **kw("tenantA"))) == 4 * P   # fingerprints of tenantA checked inside run()
    assert e.run(Req("E", T, **{field: ""})) == 4 * P  # empty salt/LoRA name == none (documented)
    e.idle_check()


def test_preempted_request_readmitted_after_its_saves():
    e = FakeEngine()
    r = Req("R", toks(1, 3 * P) + [9])
    e.admit(r)
    e.step()                    # computes and saves 3 pages within the step
    e.preempt(r)                # its blocks go back to L1's free list
    assert e.sched.index.locked_pages == 0
    r2 = Req("R", r.tokens)     # re-admitted: the lookup sees the completed saves
    assert e.admit(r2) == 3 * P
    e.step()
    assert all(e.page_ok(r2, i) for i in range(3))
    e.finish(r2)
    e.idle_check()


def test_abort_between_match_and_load_leaks_nothing():
    e = FakeEngine(num_blocks=32, num_slots=16)
    T = toks(1, 4 * P)
    e.run(Req("seed", T + [1]))
    base_free = e.sched.allocator.num_free
    for i in range(100):
        r = Req(f"r{i}", T + [17, 18, 19, 20])
        assert e.admit(r) == 4 * P
        e.finish(r)             # aborted before the step that carries its load
        e.step()                # the load order is still executed into blocks the engine has not reused yet
        assert e.sched.index.locked_pages == 0
        assert e.sched.allocator.num_free == base_free
        assert len(e.free_blocks) == 31
    e.idle_check()


def test_abort_during_save_and_preempt_with_lock_held():
    e = FakeEngine()
    T = toks(1, 2 * P) + [5]
    e.run(Req("a", T))
    r = Req("b", T + toks(500, 2 * P))
    assert e.admit(r) == 2 * P
    assert e.sched.index.locked_pages == 2
    e.preempt(r)                # preempted while holding its lock: released
    assert e.sched.index.locked_pages == 0
    r = Req("b", r.tokens)
    e.admit(r)
    e.step()
    e.finish(r)
    e.idle_check()
    assert e.sched.index.total_pages == 4


def test_locked_pages_survive_pressure_and_pool_smaller_than_request():
    e = FakeEngine(num_blocks=64, num_slots=6)
    a = Req("a", toks(1, 4 * P) + [1])
    e.run(a)
    r = Req("b", a.tokens)
    assert e.admit(r) == 4 * P          # locks 4 pages
    big = Req("big", toks(900, 8 * P) + [1])
    e.admit(big)
    e.step()                            # big needs 8 slots, only 2 are free and 4 are locked
    assert e.sched.counters.save_skipped_pages == 6
    assert all(e.page_ok(r, i) for i in range(4))
    e.finish(r)
    e.finish(big)
    e.idle_check()
    assert e.sched.allocator.num_free + e.sched.index.l2_pages == 6


def test_eviction_is_lru_over_unlocked_leaves():
    e = FakeEngine(num_slots=8)
    docs = [toks(1000 * (i + 1), 2 * P) + [1] for i in range(4)]
    for i, d in enumerate(docs):
        e.run(Req(f"d{i}", d))
    assert e.run(Req("hit0", docs[0])) == 2 * P   # doc 0 becomes most recent
    e.run(Req("new", toks(50000, 2 * P) + [1]))   # needs 2 slots: evicts doc 1 (least recent)
    assert e.run(Req("q1", docs[1])) == 0
    assert e.run(Req("q0", docs[0])) == 2 * P
    e.idle_check()


def test_corrupted_l2_page_is_never_loaded():
    e = FakeEngine()
    T = toks(1, 3 * P) + [1]
    e.run(Req("a", T))
    slot = e.sched.index.match_prefix(page_keys(request_root(e.ns.digest()), T, P)).host_slots[1]
    page = e.host.read_page(slot).clone()
    page[7] ^= 0xFF
    e.host.write_page(slot, page)
    r = Req("b", T)
    assert e.admit(r) == 3 * P
    e.step()
    assert e.worker.counters.checksum_mismatches == 1
    # pages from the corrupt one on are reported failed (vLLM recomputes them); page 0 was loaded and is right
    assert e.failed_blocks == {r.blocks[1], r.blocks[2]}
    assert e.page_ok(r, 0)


def test_soak_random_ops_returns_to_baseline():
    rng = random.Random(7)
    e = FakeEngine(num_blocks=200, num_slots=64)
    prefixes = [toks(10000 * (i + 1), rng.randint(1, 4) * P) for i in range(20)]
    hits = []
    for it in range(600):
        pre = rng.choice(prefixes)
        r = Req(f"r{it}", pre + [rng.randrange(1, 99) for _ in range(rng.randint(1, 40))])
        ext = e.admit(r)
        op = rng.random()
        if op < 0.05:
            e.finish(r)          # abort before the step
            e.step()
        elif op < 0.1:
            e.preempt(r)
            e.step()
            if rng.random() < 0.5:
                e.sched.on_finished(r.req_id)   # aborted while preempted
            else:                               # resumed later, then finishes
                r = Req(r.req_id, r.tokens)
                e.admit(r)
                e.step()
                e.finish(r)
        else:
            e.step()
            for i in range(ext // P):
                assert e.page_ok(r, i)
            e.finish(r)
        if it >= 300:
            hits.append(ext > 0)
        if it % 100 == 99:
            e.idle_check()
            assert e.sched.allocator.num_free + e.sched.index.l2_pages == 64
            assert len(e.sched.requests) == 0
    assert sum(hits) / len(hits) > 0.5   # hit rate on shared prefixes does not decay
    assert e.worker.counters.checksum_mismatches == 0


@pytest.mark.parametrize("layerwise", [False, True])
@pytest.mark.parametrize("k", range(LAYERS))
def test_copy_failure_at_a_layer_ends_in_recomputed_blocks(monkeypatch, layerwise, k):
    """An L2 -> L1 copy that fails at layer ``k``: the step completes (no exception reaches the engine), every block
    of the load is reported (get_block_ids_with_load_errors), the request recomputes them and ends with every page
    right; the L2 copies are untouched, so once the fault is gone the next request loads them. The same outcome
    with and without layer-wise loading."""
    e = FakeEngine(layerwise=layerwise)
    T = toks(1, 3 * P) + [1]
    assert e.run(Req("a", T)) == 0
    asked = inject_copy_fault(monkeypatch, k)
    r = Req("b", T)
    assert e.admit(r) == 3 * P
    e.step()
    assert asked == ([[x] for x in range(k + 1)] if layerwise else [list(range(LAYERS))])
    assert e.failed_blocks == set(r.blocks[:3]) and r.req_id in e.rolled_back
    e.step()                                         # vLLM's next step recomputes from the first failed block
    assert all(e.page_ok(r, i) for i in range(3))
    c = e.worker.counters
    assert (c.failed_load_blocks, c.load_pages, c.checksum_mismatches) == (3, 0, 0)
    e.finish(r)
    monkeypatch.undo()
    e.failed_blocks.clear()
    assert e.run(Req("c", T)) == 3 * P              # loaded bit-exact (checked inside run) from the same L2 pages
    assert e.failed_blocks == set() and e.worker.counters.load_pages == 3
    e.idle_check()


def _l2_pages(e, tokens):
    """Leading pages of ``tokens`` the index holds in L2 (no side effect on it)."""
    return e.sched.index.match_prefix(page_keys(request_root(e.ns.digest()), tokens, P), require_l2=True).num_pages


@pytest.mark.parametrize("policy, victim", [("lru", 0), ("lfu", 1)])
def test_eviction_policy_through_the_scheduler(policy, victim):
    """Doc 0 is hit most often but longest ago; docs 1-3 once each, later. Under pressure LRU evicts doc 0 (least
    recent), LFU evicts doc 1 (fewest hits, then least recent) and keeps doc 0."""
    e = FakeEngine(num_slots=8, policy=policy)
    docs = [toks(1000 * (i + 1), 2 * P) + [1] for i in range(4)]
    for i, d in enumerate(docs):
        assert e.run(Req(f"d{i}", d)) == 0
    for j in range(3):
        assert e.run(Req(f"again{j}", docs[0])) == 2 * P
    for i in (1, 2, 3):
        assert e.run(Req(f"once{i}", docs[i])) == 2 * P
    assert e.sched.allocator.num_free == 0
    e.run(Req("new", toks(50000, 2 * P) + [1]))   # needs 2 slots: one doc leaves L2
    assert e.sched.counters.evicted_pages == 2
    assert [_l2_pages(e, d) for d in docs] == [0 if i == victim else 2 for i in range(4)]
    e.idle_check()


def test_reset_empties_l2_and_the_index_except_locked_pages():
    """reset_cache (vLLM's reset_prefix_cache(reset_connector=True)): every unlocked page leaves the index and its
    slot is free again, so the next lookup misses; pages a running request holds locked stay."""
    e = FakeEngine(num_slots=16)
    a, b = toks(1, 3 * P) + [1], toks(9000, 2 * P) + [1]
    e.run(Req("a", a))
    e.run(Req("b", b))
    held = Req("held", b)
    assert e.admit(held) == 2 * P            # locks b's 2 pages until it finishes
    assert e.sched.index.l2_pages == 5 and e.sched.allocator.num_free == 11
    assert e.sched.reset() is True
    assert e.sched.index.l2_pages == 2 and e.sched.index.total_pages == 2 and e.sched.allocator.num_free == 14
    assert _l2_pages(e, a) == 0 and _l2_pages(e, b) == 2
    e.step()
    e.finish(held)
    assert e.run(Req("a2", a)) == 0          # missed: recomputed and saved again
    assert e.run(Req("a3", a)) == 3 * P
    e.idle_check()

