"""KV events for tierkv's tiers (connector/obs/kv_events.py) on the fake engine: which pages are announced as stored in
and removed from L2 and L3, with the block hashes the resolver gives (vLLM's, in the connector), and their shape
as vLLM events (docs/architecture.md, "KV events")."""
import hashlib

import msgspec
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from tests.helpers.fake_engine import P, FakeEngine, Req
from tests.connector.l3.test_controller import file_store, toks
from tierkv.connector.obs.kv_events import L2, L3, PageInfo, TierEvents


def vhash(tokens, i) -> bytes:
    """A stand-in for vLLM's block hash of page ``i``: a digest of every token up to the end of the page."""
    return hashlib.sha256(repr(tuple(tokens[: (i + 1) * P])).encode()).digest()


def attach(engine, l3_backend="file", **kw):
    """TierEvents on the engine's index, resolving pages of the requests registered in the returned dict."""
    reqs: dict[str, Req] = {}

    def resolve(rid, a, b):
        r = reqs[rid]
        return [PageInfo(vhash(r.tokens, i), vhash(r.tokens, i - 1) if i else None, tuple(r.tokens[i * P:(i + 1) * P]))
                for i in range(a, b) if (i + 1) * P <= len(r.tokens)]

    ev = TierEvents(resolve, block_size=P, l3_backend=l3_backend, **kw)
    engine.sched.index.events = ev
    return ev, reqs


def req(reqs, rid, tokens) -> Req:
    reqs[rid] = r = Req(rid, tokens)
    return r


def hashes(records, stored, tier):
    return [info.block_hash for s, t, info in records if s == stored and t == tier]


def test_pages_are_announced_in_l2_then_l3_with_their_block_hashes(tmp_path):
    doc = toks(100, 4 * P)
    e = FakeEngine(num_slots=16, store=file_store(tmp_path), controller={"write_policy": "write_through"})
    ev, reqs = attach(e)
    e.run_l3(req(reqs, "a", doc + [1]))
    e.settle()
    recs = ev.take()
    want = [vhash(doc, i) for i in range(4)]
    assert hashes(recs, True, L2) == want        # saved L1 -> L2 in the computing step
    assert hashes(recs, True, L3) == want        # then acknowledged by the store (write_through)
    assert not hashes(recs, False, L2) and not hashes(recs, False, L3)
    cpu, storage = ev.to_vllm(recs)              # one chained run per tier
    assert isinstance(cpu, BlockStored) and cpu.medium == "CPU" and cpu.locality == "LOCAL" and cpu.ownership is None
    assert storage.medium == "STORAGE" and storage.ownership == "L3:file" and storage.locality == "LOCAL"
    for s in (cpu, storage):
        assert s.block_hashes == want and s.parent_block_hash is None and s.token_ids == doc
        assert s.block_size == P and s.group_idx == 0
    # a second request on the same document announces nothing new: every page is already in both tiers
    e.run_l3(req(reqs, "b", doc + [2]))
    e.settle()
    assert ev.take() == []
    # vLLM's publisher encodes them; a subscriber decodes them with vLLM's own classes
    batch = KVEventBatch(ts=1.0, events=[cpu, storage])
    back = msgspec.msgpack.Decoder(type=KVEventBatch).decode(msgspec.msgpack.Encoder().encode(batch))
    assert [x.block_hashes for x in back.events] == [want, want] and back.events[1].ownership == "L3:file"
    e.idle_check()
    e.close()


def test_l2_eviction_removes_from_l2_only_and_a_fetch_announces_l2_again(tmp_path):
    a, b = toks(1000, 4 * P), toks(2000, 8 * P)
    e = FakeEngine(num_slots=8, store=file_store(tmp_path), controller={"write_policy": "write_through"})
    ev, reqs = attach(e)
    e.run_l3(req(reqs, "a", a + [1]))
    e.settle()
    ev.take()
    e.run_l3(req(reqs, "b", b + [1]))    # 8 pages into an L2 of 8: A's copies go (A stays in L3)
    e.settle()
    recs = ev.take()
    a_hashes = [vhash(a, i) for i in range(4)]
    assert set(a_hashes) <= set(hashes(recs, False, L2))
    assert not hashes(recs, False, L3)   # L3 still holds every page
    removed = [x for x in ev.to_vllm([r for r in recs if not r[0]])]
    assert all(isinstance(x, BlockRemoved) and x.medium == "CPU" for x in removed)
    # A again: fetched L3 -> L2, so its pages are in L2 again; L3 is not announced twice
    assert e.run_l3(req(reqs, "a2", a + [2])) == 4 * P
    e.settle()
    recs = ev.take()
    assert set(a_hashes) <= set(hashes(recs, True, L2)) and not hashes(recs, True, L3)
    e.idle_check()
    e.close()


def test_without_l3_eviction_removes_and_forgets(tmp_path):
    a, b = toks(1000, 4 * P), toks(2000, 8 * P)
    e = FakeEngine(num_slots=8)
    ev, reqs = attach(e, l3_backend=None)
    e.run(req(reqs, "a", a + [1]))
    e.run(req(reqs, "b", b + [1]))
    recs = ev.take()
    a_hashes = [vhash(a, i) for i in range(4)]
    assert hashes(recs, True, L2)[:4] == a_hashes and set(a_hashes) <= set(hashes(recs, False, L2))
    assert not [k for k, info in ev._known.items() if info.block_hash in a_hashes]   # forgotten with the pages
    e.run(req(reqs, "a2", a + [2]))      # recomputed and saved again: announced again
    assert hashes(ev.take(), True, L2)[:4] == a_hashes


def test_reset_removes_l2_pages_and_l3_pages_found_again_are_announced(tmp_path):
    doc = toks(300, 3 * P)
    e = FakeEngine(num_slots=16, store=file_store(tmp_path), controller={"write_policy": "write_through"})
    ev, reqs = attach(e)
    e.run_l3(req(reqs, "a", doc + [1]))
    e.settle()
    ev.take()
    e.sched.reset()                      # reset_cache: the index forgets, L2 copies go, L3 keeps its records
    recs = ev.take()
    want = [vhash(doc, i) for i in range(3)]
    assert sorted(hashes(recs, False, L2)) == sorted(want) and not hashes(recs, False, L3)
    assert e.run_l3(req(reqs, "b", doc + [2])) == 3 * P   # found in L3 by an existence query, then fetched
    e.settle()
    recs = ev.take()
    assert hashes(recs, True, L3) == want and hashes(recs, True, L2) == want
    assert [s for s, t, _ in recs] == [True] * 6 and [t for _s, t, _ in recs] == [L3] * 3 + [L2] * 3
    e.idle_check()
    e.close()
    # a restarted engine on the same store announces what it finds there and loads back
    e2 = FakeEngine(num_slots=16, store=file_store(tmp_path), controller={"write_policy": "write_through"})
    ev2, reqs2 = attach(e2)
    assert e2.run_l3(req(reqs2, "c", doc + [3])) == 3 * P
    e2.settle()
    recs = ev2.take()
    assert hashes(recs, True, L3) == want and hashes(recs, True, L2) == want
    e2.close()


def test_pages_the_store_lost_are_removed_from_l3(tmp_path):
    a, b = toks(1000, 4 * P), toks(2000, 8 * P)
    e = FakeEngine(num_slots=8, store=file_store(tmp_path), controller={"write_policy": "write_through"})
    ev, reqs = attach(e)
    e.run_l3(req(reqs, "a", a + [1]))
    e.settle()
    e.run_l3(req(reqs, "b", b + [1]))    # A's pages are L3-only now
    e.settle()
    ev.take()
    e.ranks[0][3].l3.store.clear()       # the store loses every record
    e.run_l3(req(reqs, "a2", a + [2]))   # the read finds them missing: the index drops them from L3
    e.settle()
    recs = ev.take()
    a_hashes = [vhash(a, i) for i in range(4)]
    assert vhash(a, 0) in hashes(recs, False, L3)
    assert set(hashes(recs, False, L3)) <= set(a_hashes)
    e.close()


def test_a_full_buffer_drops_and_counts_instead_of_growing(tmp_path):
    doc = toks(500, 6 * P)
    e = FakeEngine(num_slots=16)
    ev, reqs = attach(e, l3_backend=None, max_buffered=4)
    e.run(req(reqs, "a", doc + [1]))
    assert len(ev.take()) == 4
    assert ev.stats()["kv_events_dropped"] == 2 and ev.stats()["kv_events_stored_pages"] == 4
    e.run(req(reqs, "b", toks(900, 2 * P) + [1]))   # the buffer was drained: room again
    assert len(ev.take()) == 2 and e.sched.stats()["kv_events_dropped"] == 2


def test_undescribed_pages_are_counted_not_published():
    from tierkv.connector.core.radix_index import RadixIndex
    idx = RadixIndex()
    ev = TierEvents(lambda rid, a, b: [], block_size=P)
    idx.events = ev
    idx.insert([b"k0" * 8, b"k1" * 8], [0, 1])
    assert ev.take() == [] and ev.stats()["kv_events_undescribed_pages"] == 2


def test_a_removal_is_published_only_for_a_tier_the_page_was_announced_in():
    ev = TierEvents(lambda rid, a, b: [PageInfo(bytes([i]) * 32, None, (i,)) for i in range(a, b)], block_size=1)
    keys = [b"a" * 16, b"b" * 16]
    ev.describe("r", keys, 0, 2)
    ev.stored(L2, keys)
    ev.removed(L3, keys)               # never announced in L3
    ev.removed(L2, keys[:1])
    assert [(s, t, i.block_hash[0]) for s, t, i in ev.take()] == [(True, L2, 0), (True, L2, 1), (False, L2, 0)]


def test_page_infos_name_the_blocks_as_vllms_own_l1_events_with_lora_and_cache_salt():
    """A vLLM ``Request`` with a LoRA adapter and a cache salt: tierkv's L2 event for its pages carries the hashes,
    parents, tokens, LoRA and extra keys of vLLM's own L1 ``BlockStored`` for the same blocks (vLLM's BlockPool)."""
    from vllm.lora.request import LoRARequest
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.block_pool import BlockPool
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    from tierkv.connector.obs.kv_events import page_infos
    init_none_hash(sha256)
    tokens = toks(40, 3 * P + 5)
    r = Request("r", tokens, SamplingParams(max_tokens=1), None, lora_request=LoRARequest("ad", 7, "/nowhere"),
                cache_salt="tenant-1", block_hasher=get_request_block_hasher(P, sha256))
    pool = BlockPool(16, True, P, enable_kv_cache_events=True)
    pool.cache_full_blocks(r, pool.get_new_blocks(3), 0, 3, P, 0)
    l1 = [e for e in pool.take_events() if isinstance(e, BlockStored)]
    ev = TierEvents(lambda rid, a, b: page_infos(r, a, b, P), block_size=P, l3_backend=None,
                    spec_kind="full_attention")
    keys = [bytes([i]) * 16 for i in range(3)]
    ev.describe("r", keys, 0, 3)
    ev.stored(L2, keys)
    (ours,) = ev.take_vllm_events()
    assert ours.block_hashes == [h for e in l1 for h in e.block_hashes]
    assert ours.parent_block_hash == l1[0].parent_block_hash is None
    assert ours.token_ids == [t for e in l1 for t in e.token_ids] == tokens[: 3 * P]
    assert ours.extra_keys == [k for e in l1 for k in e.extra_keys] and ours.extra_keys[0] == ("ad", "tenant-1")
    assert (ours.lora_id, ours.lora_name) == (l1[0].lora_id, l1[0].lora_name) == (7, "ad")
    assert ours.medium == "CPU" and l1[0].medium == "GPU"
