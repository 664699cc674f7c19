"""examples/route_by_prefix.py: the router's bookkeeping and choice, fed with real vLLM events.

L1 events come from vLLM's own ``BlockPool`` for vLLM ``Request`` objects; L2/L3 events from tierkv's
``TierEvents`` (what the connector publishes); every batch is encoded and decoded with msgspec as vLLM's ZMQ
publisher and a subscriber do. Two engines are given different hash seeds (``PYTHONHASHSEED``), so the same tokens
have different vLLM block hashes on each, as can happen in a fleet.
"""
import importlib.util
import sys
from pathlib import Path

import msgspec
import pytest
from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

from tierkv.connector.obs.kv_events import L2, L3, TierEvents, page_infos

P = 32
_SPEC = importlib.util.spec_from_file_location(
    "route_by_prefix", Path(__file__).resolve().parents[2] / "examples" / "route_by_prefix.py")
rbp = importlib.util.module_from_spec(_SPEC)
sys.modules["route_by_prefix"] = rbp  # dataclasses look their module up there
_SPEC.loader.exec_module(rbp)


def toks(seed: int, n: int) -> list[int]:
    return [10 + (seed * 7919 + i * 104729) % 990 for i in range(n)]


class VEngine:
    """vLLM's block pool and request hashing under one hash seed, plus tierkv's event builder: the events one
    engine would publish, passed through msgpack as over the wire."""

    def __init__(self, monkeypatch, seed: str, l3_backend="mooncake"):
        from vllm.utils.hashing import sha256
        from vllm.v1.core.block_pool import BlockPool
        from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

        self._mp, self._seed = monkeypatch, seed
        self._hasher = get_request_block_hasher(P, sha256)
        self._init = lambda: (monkeypatch.setenv("PYTHONHASHSEED", seed), init_none_hash(sha256))
        self.pool = BlockPool(64, True, P, enable_kv_cache_events=True)
        self.reqs: dict = {}
        self.tier = TierEvents(lambda rid, a, b: page_infos(self.reqs[rid], a, b, P), block_size=P,
                               l3_backend=l3_backend, spec_kind="full_attention")
        self.enc = msgspec.msgpack.Encoder()
        self.dec = msgspec.msgpack.Decoder(type=KVEventBatch)

    def request(self, rid, tokens, salt=None):
        from vllm.sampling_params import SamplingParams
        from vllm.v1.request import Request

        self._init()
        r = Request(rid, tokens, SamplingParams(max_tokens=1), None, cache_salt=salt, block_hasher=self._hasher)
        self.reqs[rid] = r
        return r

    def wire(self, events) -> list:
        return self.dec.decode(self.enc.encode(KVEventBatch(ts=0.0, events=list(events)))).events

    def l1_store(self, rid, tokens, salt=None) -> list:
        """vLLM caches the request's full blocks in L1: its BlockStored events, decoded."""
        r = self.request(rid, tokens, salt)
        n = len(tokens) // P
        self.blocks = self.pool.get_new_blocks(n)
        self.pool.cache_full_blocks(r, self.blocks, 0, n, P, 0)
        return self.wire(self.pool.take_events())

    def tier_store(self, tier, rid, first, last) -> list:
        """tierkv announces pages [first, last) of request ``rid`` in ``tier`` (L2 or L3)."""
        keys = [f"{rid}:{i}".encode().ljust(16, b"\0") for i in range(first, last)]
        self.tier.describe(rid, keys, first, last)
        self.tier.stored(tier, keys)
        return self.wire(self.tier.take_vllm_events())

    def tier_remove(self, tier, rid, first, last) -> list:
        keys = [f"{rid}:{i}".encode().ljust(16, b"\0") for i in range(first, last)]
        self.tier.removed(tier, keys)
        return self.wire(self.tier.take_vllm_events())

    def hashes(self, rid) -> list:
        from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
        return [maybe_convert_block_hash(h) for h in self.reqs[rid].block_hashes]


def feed(view, name, events):
    for e in events:
        view.apply(name, e)


@pytest.fixture
def two(monkeypatch):
    return VEngine(monkeypatch, "11"), VEngine(monkeypatch, "22")


def test_the_same_tokens_get_the_same_content_keys_on_engines_with_different_block_hashes(two):
    a, b = two
    doc = toks(1, 4 * P + 5)
    ev_a, ev_b = a.l1_store("r", doc), b.l1_store("r", doc)
    assert a.hashes("r") != b.hashes("r")  # different seeds: vLLM's hashes differ
    view = rbp.FleetView(["A", "B"])
    feed(view, "A", ev_a)
    feed(view, "B", ev_b)
    keys = rbp.prompt_keys(doc, P)
    assert len(keys) == 4 and len(set(keys)) == 4
    assert view.engines["A"].l1 == view.engines["B"].l1 == set(keys)
    assert [view.engines["A"].by_hash[h] for h in a.hashes("r")] == keys
    assert view.match("A", keys) == ["L1"] * 4
    # another document shares nothing; the same document after one changed token shares the blocks before it
    assert view.match("A", rbp.prompt_keys(toks(2, 4 * P), P)) == []
    changed = doc[:2 * P + 3] + [doc[2 * P + 3] + 1] + doc[2 * P + 4:]
    assert view.match("A", rbp.prompt_keys(changed, P)) == ["L1", "L1"]


def test_a_cache_salt_keys_the_first_block_as_vllm_does(two):
    a, _b = two
    doc = toks(3, 3 * P)
    view = rbp.FleetView(["A"])
    feed(view, "A", a.l1_store("s", doc, salt="tenant-1"))
    assert view.match("A", rbp.prompt_keys(doc, P, cache_salt="tenant-1")) == ["L1"] * 3
    assert view.match("A", rbp.prompt_keys(doc, P)) == []
    assert view.match("A", rbp.prompt_keys(doc, P, cache_salt="tenant-2")) == []


def test_l2_and_l3_events_follow_the_tiers_and_l3_is_shared_by_store(two, monkeypatch):
    a, b = two
    doc = toks(4, 5 * P + 1)
    view = rbp.FleetView(["A", "B", "C"])
    feed(view, "A", a.l1_store("d", doc))
    feed(view, "A", a.tier_store(L2, "d", 0, 5))
    feed(view, "A", a.tier_store(L3, "d", 0, 5))
    keys = rbp.prompt_keys(doc, P)
    assert view.engines["A"].l2 == set(keys) and view.l3 == {"L3:mooncake": set(keys)}
    # B has announced the same store (for its own pages), C a file store of its own: only B sees A's pages
    other = toks(5, 2 * P)
    feed(view, "B", b.l1_store("o", other))
    feed(view, "B", b.tier_store(L3, "o", 0, 2))
    c = VEngine(monkeypatch, "33", l3_backend="file")
    feed(view, "C", c.l1_store("o", other))
    feed(view, "C", c.tier_store(L3, "o", 0, 2))
    assert view.match("B", keys) == ["L3"] * 5
    assert view.match("C", keys) == []
    # L1 evicts blocks 2..4 (vLLM's removal), then L2 evicts 3..4 (tierkv's removal for CPU only)
    a.pool.evict_blocks({blk.block_id for blk in a.blocks[2:]})
    removed = a.wire(a.pool.take_events())
    assert {type(e) for e in removed} == {BlockRemoved}
    feed(view, "A", removed)
    assert view.match("A", keys) == ["L1", "L1", "L2", "L2", "L2"]
    feed(view, "A", a.tier_remove(L2, "d", 3, 5))
    assert view.match("A", keys) == ["L1", "L1", "L2", "L3", "L3"]
    # the store lost page 4: gone for every engine using it
    feed(view, "A", a.tier_remove(L3, "d", 4, 5))
    assert view.match("A", keys) == ["L1", "L1", "L2", "L3"] and view.match("B", keys) == ["L3"] * 4
    # vLLM's reset of L1: only L1 goes
    feed(view, "A", a.wire([AllBlocksCleared()]))
    assert view.match("A", keys) == ["L2", "L2", "L2", "L3"]


def test_an_event_whose_parent_was_never_seen_is_counted_and_skipped(two):
    a, _b = two
    doc = toks(6, 4 * P)
    events = a.l1_store("x", doc)
    assert isinstance(events[0], BlockStored)
    tail = BlockStored(block_hashes=events[0].block_hashes[2:], parent_block_hash=events[0].block_hashes[1],
                       token_ids=events[0].token_ids[2 * P:], block_size=P, lora_id=None, medium="GPU",
                       lora_name=None)
    view = rbp.FleetView(["A"])
    feed(view, "A", a.wire([tail]))
    assert view.engines["A"].orphans == 1 and not view.engines["A"].l1


def test_the_router_prefers_the_longest_weighted_prefix_and_never_counts_the_last_block(two):
    a, b = two
    doc = toks(7, 4 * P)  # 4 full blocks; the last holds the last token, so at most 3 are loadable
    view = rbp.FleetView(["A", "B"])
    feed(view, "A", a.l1_store("d", doc))
    feed(view, "A", a.tier_store(L3, "d", 0, 4))
    a.pool.evict_blocks({blk.block_id for blk in a.blocks})
    feed(view, "A", a.wire(a.pool.take_events()))            # A: all 4 blocks in L3 only
    feed(view, "B", b.l1_store("d", doc[:2 * P] + toks(8, 2 * P)))  # B: the first 2 blocks in L1
    feed(view, "B", b.tier_store(L3, "d", 0, 1))             # B uses the same store
    prompt = doc + toks(9, 10)
    r = rbp.PrefixRouter(view, P)
    c = r.choose(prompt)
    # A: 4 blocks in L3 = 4 * 32 * 0.7 = 89.6; B: 2 blocks in L1 + 2 in L3 = 64 + 44.8 = 108.8
    assert (c.engine, c.tiers, c.tokens, round(c.score, 1)) == ("B", ["L1", "L1", "L3", "L3"],
                                                                {"L1": 64, "L2": 0, "L3": 64}, 108.8)
    # the prompt itself (its last token in block 4): only 3 blocks count
    assert r.predict("A", rbp.prompt_keys(doc, P), len(doc)).tokens == {"L1": 0, "L2": 0, "L3": 3 * P}
    # weights move the choice: a cheap L1 (weight 0.1) makes A's longer L3 run win
    r2 = rbp.PrefixRouter(view, P, weights={"L1": 0.1, "L2": 0.9, "L3": 0.7})
    assert r2.choose(prompt).engine == "A"


def test_ties_go_to_the_engine_with_fewer_requests_and_round_robin_alternates(two):
    view = rbp.FleetView(["A", "B"])
    r = rbp.PrefixRouter(view, P)
    assert [r.choose(toks(i, 3 * P)).engine for i in range(4)] == ["A", "B", "A", "B"]
    rr = rbp.PrefixRouter(view, P, policy="round_robin")
    assert [rr.choose(toks(i, 3 * P)).engine for i in range(3)] == ["A", "B", "A"]
    assert rr.assigned == {"A": 2, "B": 1}


def test_bad_policy_weights_and_engine_flags_name_the_allowed_forms():
    view = rbp.FleetView(["A"])
    with pytest.raises(ValueError, match="allowed values are prefix, round_robin"):
        rbp.PrefixRouter(view, P, policy="random")
    with pytest.raises(ValueError, match="give exactly L1, L2, L3"):
        rbp.PrefixRouter(view, P, weights={"L1": 1.0})
    with pytest.raises(ValueError, match="keys must be L1, L2, L3"):
        rbp.parse_weights("L1=1,L4=2")
    with pytest.raises(ValueError, match="L2 needs a number"):
        rbp.parse_weights("L1=1,L2=x,L3=1")
    assert rbp.parse_weights("l1=1,L2=0.5,L3=0.25") == {"L1": 1.0, "L2": 0.5, "L3": 0.25}
    with pytest.raises(ValueError, match="NAME=HTTP_BASE,EVENTS_ENDPOINT"):
        rbp.parse_engine("hostA=http://10.77.0.1:8000")
    e = rbp.parse_engine("hostA=http://10.77.0.1:8000/,tcp://10.77.0.1:5557")
    assert (e.name, e.base, e.events) == ("hostA", "http://10.77.0.1:8000", "tcp://10.77.0.1:5557")


def test_the_request_sequence_asks_every_document_repeats_times_with_its_own_questions():
    seq = rbp.make_sequence(docs=5, doc_blocks=3, repeats=3, block_size=P, question_tokens=7, seed=1)
    assert sorted(r["doc"] for r in seq) == sorted(list(range(5)) * 3)
    assert all(len(r["prompt"]) == 3 * P + 7 for r in seq)
    first = {}
    for r in seq:
        first.setdefault(r["doc"], r["prompt"])
        assert r["prompt"][:3 * P] == first[r["doc"]][:3 * P]
    assert len({tuple(r["prompt"]) for r in seq}) == 15  # every question differs
    assert [r["doc"] for r in seq][:1] == [0] and seq == rbp.make_sequence(5, 3, 3, P, 7, seed=1)
