"""Key-based eviction policies (storage_backends/eviction.py): a randomized sequence per policy against a model set,
behaviour that tells the policies apart, and the config checks (bad names, bad fractions, self-evicting stores)."""
from __future__ import annotations

import random

import pytest

from tierkv.storage_backends.common import ConfigError
from tierkv.storage_backends.eviction import POLICIES, make_key_policy
from tierkv.storage_backends.factory import build_backend, validate_l3


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(5))
def test_random_sequence_keeps_the_key_set_and_never_pops_a_busy_key(policy, seed):
    rnd = random.Random(seed)
    pol = make_key_policy(policy)
    held: set[int] = set()
    busy: set[int] = set()  # writes in flight: never a victim
    for _ in range(3000):
        op = rnd.random()
        k = rnd.randrange(60)
        if op < 0.35:
            pol.insert(k)
            held.add(k)
        elif op < 0.6:
            pol.hit(k)
        elif op < 0.7:
            pol.remove(k)
            held.discard(k)
            busy.discard(k)
        elif op < 0.8 and k in held:
            busy ^= {k}  # a write starts or ends
        else:
            v = pol.pop_victim(busy.__contains__)
            if held - busy:
                assert v in held and v not in busy
                held.discard(v)
            else:
                assert v is None
        assert len(pol) == len(held) and set(pol) == held
        assert all(x in pol for x in held)


class Store:
    """A cache of ``cap`` keys over a key policy, evicting as the file store does."""

    def __init__(self, policy, cap):
        self.pol, self.cap = make_key_policy(policy), cap

    def get(self, k):
        if k in self.pol:
            self.pol.hit(k)
            return True
        if len(self.pol) >= self.cap:
            self.pol.pop_victim()
        self.pol.insert(k)
        return False


@pytest.mark.parametrize("policy,kept", [("lru", 0), ("lfu", 4), ("slru", 4), ("s3fifo", 4)])
def test_a_one_time_scan_evicts_the_working_set_only_under_lru(policy, kept):
    s = Store(policy, 10)
    for i in range(10):
        s.get(f"old{i}")
    work = [f"w{i}" for i in range(4)]
    for _ in range(3):
        for w in work:
            s.get(w)
    for i in range(30):
        s.get(f"scan{i}")
    assert sum(w in s.pol for w in work) == kept


def test_lfu_keeps_the_most_hit_key():
    for policy, survivor in (("lfu", "a"), ("lru", "d")):
        pol = make_key_policy(policy, keys="abcd")
        for _ in range(5):
            pol.hit("a")
        for k in "bcd":
            pol.hit(k)
        for _ in range(3):
            pol.pop_victim()
        assert list(pol) == [survivor], policy


def test_s3fifo_ghost_sends_a_reinserted_key_to_main():
    pol = make_key_policy("s3fifo", keys=[f"x{i}" for i in range(10)])
    for i in range(1, 10):
        pol.hit(f"x{i}")
    assert pol.pop_victim() == "x0"  # small's head, never hit: evicted into the ghost
    assert "x0" in pol.ghost and "x0" not in pol
    pol.insert("x0")
    assert "x0" in pol.main and "x0" not in pol.ghost
    pol.insert("new")
    assert "new" in pol.small


def test_slru_promotes_on_a_second_hit_and_bounds_protected():
    pol = make_key_policy("slru", protected_fraction=0.5, keys=range(8))
    for k in range(8):
        pol.hit(k)
        assert len(pol.protected) <= 4
    assert list(pol.protected) == [4, 5, 6, 7] and list(pol.probation) == [0, 1, 2, 3]
    assert pol.pop_victim() == 0


@pytest.mark.parametrize("name", ["fifo", "LRU", ""])
def test_unknown_policy_is_refused(name):
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, lfu, slru, s3fifo"):
        make_key_policy(name)


@pytest.mark.parametrize("kw", [{"protected_fraction": 0}, {"protected_fraction": 1}])
def test_slru_fraction_inside_zero_one(kw):
    with pytest.raises(ValueError, match="fraction"):
        make_key_policy("slru", **kw)


@pytest.mark.parametrize("v", [0, 1, 1.5])
def test_s3fifo_fraction_inside_zero_one(v):
    with pytest.raises(ValueError, match="fraction"):
        make_key_policy("s3fifo", small_fraction=v)


def test_file_store_policy_names_the_key_and_the_choices(tmp_path):
    with pytest.raises(ConfigError, match=r"l3\.file\.eviction_policy(.|\n)*'lru'(.|\n)*'s3fifo'"):
        validate_l3({"backend": "file", "file": {"root": str(tmp_path), "eviction_policy": "arc"}})
    for key in ("slru_protected_fraction", "s3fifo_small_fraction"):
        for v in (0, 1):
            with pytest.raises(ConfigError, match=rf"l3\.file\.{key}"):
                validate_l3({"backend": "file", "file": {"root": str(tmp_path), key: v}})
    cfg = validate_l3({"backend": "file", "file": {"root": str(tmp_path), "eviction_policy": "s3fifo"}})
    store = build_backend(cfg, bytes(16), 64)
    try:
        assert store._ev.order.name == "s3fifo"
    finally:
        store.close()


@pytest.mark.parametrize("backend,says", [("mooncake", "Mooncake"), ("lmcache", "LMCache"),
                                          ("redis", "maxmemory-policy"), ("zmq", "tierkv server --eviction-policy")])
def test_a_policy_on_a_self_evicting_store_stops_start_up(backend, says):
    l3 = {"backend": backend, backend: {"eviction_policy": "lru"}}
    with pytest.raises(ConfigError, match=rf"l3\.{backend}\.eviction_policy: this store manages its own eviction"
                                          rf"(.|\n)*{says}"):
        validate_l3(l3)
    with pytest.raises(ConfigError, match="manages its own eviction"):
        build_backend(l3, bytes(16), 64)
