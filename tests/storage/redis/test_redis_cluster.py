"""The ``redis`` store in cluster mode on a real Redis Cluster (3 masters, one replica each) beyond the contract suite:
a batch split per node, MOVED and ASK redirects (a slot migrated under the store) followed and counted, and a master
killed: its pages are misses, never an exception, and service comes back after its replica takes over."""
from __future__ import annotations

import time

import torch
from redis.cluster import ClusterNode, RedisCluster

from tests.helpers import fixtures_redis_cluster as F
from tests.helpers.redis_servers import RedisClusterServers
from tests.storage.redis.test_redis_store import count_round_trips, empties, keys, pages
from tierkv.storage_backends.redis import RedisStore

NS = bytes(range(16))
PB = 8 * 1024


def test_a_batch_is_one_pipeline_per_node(tmp_path, monkeypatch):
    with F.make_backend(tmp_path, PB, NS) as h:
        b = h.backend
        ks, src = keys(30, 11), pages(30, PB, 11)
        raw = h.raw()
        owners = {raw.get_node_from_key(h.name_of(k)).name for k in ks}
        assert len(owners) == 3                                  # 30 random keys land on all three masters
        calls = count_round_trips(monkeypatch)
        assert b.batch_set(ks, src) == [True] * 30
        assert len(calls) == 3
        dst = empties(30, PB)
        assert b.batch_get(ks, dst) == [True] * 30 and all(torch.equal(s, d) for s, d in zip(src, dst))
        assert len(calls) == 6 and b.stats()["redirects"] == 0


def test_moved_and_ask_redirects_are_followed_and_counted(tmp_path):
    """Migrate the slot of a stored page to another master under a store that has cached the slot map: mid-migration
    the old owner answers ASK for the moved key, afterwards MOVED; both are followed (the page reads back whole) and
    counted in ``redirects``."""
    with F.make_backend(tmp_path, PB, NS) as h:
        b = h.backend
        ks, src = keys(4, 12), pages(4, PB, 12)
        assert b.batch_set(ks, src) == [True] * 4
        raw = h.raw()
        name = h.name_of(ks[0])
        slot = raw.keyslot(name)
        src_node = raw.get_node_from_key(name)
        dst_node = next(n for n in raw.get_primaries() if n.name != src_node.name)
        ids = {name_: info["node_id"] for name_, info in raw.cluster_nodes().items()}
        src_c, dst_c = raw.get_redis_connection(src_node), raw.get_redis_connection(dst_node)
        dst_c.execute_command("CLUSTER", "SETSLOT", slot, "IMPORTING", ids[src_node.name])
        src_c.execute_command("CLUSTER", "SETSLOT", slot, "MIGRATING", ids[dst_node.name])
        src_c.execute_command("MIGRATE", dst_node.host, dst_node.port, "", 0, 5000, "KEYS", name)
        dst = empties(4, PB)
        assert b.batch_get(ks, dst) == [True] * 4                 # ASK: the key is on the importing node
        assert b.stats()["redirects"] == 1
        for n in raw.get_primaries():
            raw.get_redis_connection(n).execute_command("CLUSTER", "SETSLOT", slot, "NODE", ids[dst_node.name])
        dst = empties(4, PB)
        assert b.batch_get(ks, dst) == [True] * 4                 # MOVED: the slot has a new owner
        assert all(torch.equal(s, d) for s, d in zip(src, dst))
        assert b.stats()["redirects"] == 2
        assert b.batch_get(ks[:1], empties(1, PB)) == [True]      # the slot map was refreshed: no redirect now
        assert b.stats()["redirects"] == 2 and b.stats()["corrupt"] == 0


def test_a_killed_master_is_misses_then_its_replica_serves(tmp_path):
    cluster = RedisClusterServers(str(tmp_path / "cluster"), masters=3, replicas=1, node_timeout_ms=1000)
    b = RedisStore(NS, PB, mode="cluster", nodes=cluster.nodes, timeout_s=1.0, reconnect_backoff_s=0.01,
                   max_backoff_s=0.05, key_prefix="kill")
    try:
        ks, src = keys(30, 13), pages(30, PB, 13)
        assert b.batch_set(ks, src) == [True] * 30
        raw = RedisCluster(startup_nodes=[ClusterNode("127.0.0.1", cluster.servers[0].port)])
        owner = {k: raw.get_node_from_key(f"kill:{NS.hex()}:{k}").port for k in ks}
        raw.close()
        victim = next(s for s in cluster.servers if s.port == owner[ks[0]])
        on_victim = {k for k in ks if owner[k] == victim.port}
        assert 0 < len(on_victim) < 30
        victim.sigstop()                                          # a hung master: its replica takes over
        t0 = time.monotonic()
        got = b.batch_get(ks, empties(30, PB))
        assert time.monotonic() - t0 < 4.0
        assert [k for k, g in zip(ks, got) if not g] == [k for k in ks if k in on_victim]   # the others still hit
        assert b.stats()["node_failures"] >= 1
        victim.kill9()
        rest = [s for s in cluster.servers if s is not victim]
        cluster.wait_ok(rest, timeout_s=20)
        deadline = time.monotonic() + 20
        while True:                                               # the promoted replica took the replicated pages
            dst = empties(30, PB)
            got = b.batch_get(ks, dst)
            if all(got):
                break
            assert time.monotonic() < deadline, f"{got.count(False)} pages still missing after the failover"
            time.sleep(0.05)
        assert all(torch.equal(s, d) for s, d in zip(src, dst))
        assert b.batch_set(ks[:5], src[:5]) == [True] * 5 and b.stats()["corrupt"] == 0
    finally:
        b.close()
        cluster.close()


def test_unreachable_seeds_at_start_up_warn_once_and_give_misses(caplog):
    import logging

    from tests.helpers.redis_servers import free_port

    nodes = [f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"]
    with caplog.at_level(logging.WARNING, logger="tierkv.redis"):
        b = RedisStore(NS, PB, mode="cluster", nodes=nodes, timeout_s=0.5, reconnect_backoff_s=0.01,
                       max_backoff_s=0.02)
        try:
            ks, src = keys(3, 14), pages(3, PB, 14)
            for _ in range(3):
                assert b.batch_set(ks, src) == [False] * 3 and b.batch_exists(ks) == 0
                assert b.batch_get(ks, empties(3, PB)) == [False] * 3
        finally:
            b.close()
    lines = [r.message for r in caplog.records if "redis L3" in r.message]
    assert len(lines) == 1 and f"cannot reach {', '.join(nodes)} at start-up" in lines[0], lines
