"""``tierkv server --eviction-policy``: each tenant's records are evicted in the policy's order (a scan through the
page store keeps a re-used working set except under lru), the flag is checked, and it reaches the page store."""
from __future__ import annotations

import argparse

import pytest

from tierkv import cli_server
from tierkv.storage_backends.zmq.server.page_store import PageStore
from tierkv.storage_backends.zmq.server.tenants import single_tenant

HDR = b"h" * 64
PAYLOAD = b"p" * 192
REC = len(HDR) + len(PAYLOAD)
NS = b"n" * 16


def store(policy: str, pages: int) -> tuple[PageStore, object]:
    table = single_tenant(None, pages * REC)
    return PageStore(table, pages * REC, eviction_policy=policy), table.tenants["default"]


@pytest.mark.parametrize("policy,kept", [("lru", 0), ("lfu", 4), ("slru", 4), ("s3fifo", 4)])
def test_a_scan_keeps_the_working_set_except_under_lru(policy, kept):
    ps, t = store(policy, 10)
    for i in range(10):
        assert ps.put(t, NS, f"old{i}", HDR, PAYLOAD)
    work = [f"w{i}" for i in range(4)]
    for _ in range(3):
        for w in work:
            if ps.lookup(t, NS, w) is None:
                assert ps.put(t, NS, w, HDR, PAYLOAD)
    for i in range(30):
        assert ps.put(t, NS, f"scan{i}", HDR, PAYLOAD)
    assert sum(ps.present(t, NS, w) for w in work) == kept
    assert ps.pages() == 10 and ps.used_bytes == 10 * REC
    assert ps.of(t).counters["evictions"] == 44 - 10  # every write past the capacity evicted exactly one


def test_an_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="eviction_policy must be one of lru, lfu, slru, s3fifo"):
        store("fifo", 4)


def test_the_flag_lists_the_policies_and_reaches_the_server(capsys):
    p = cli_server.add_arguments(argparse.ArgumentParser())
    assert p.parse_args([]).eviction_policy == "lru"
    assert p.parse_args(["--eviction-policy", "s3fifo"]).eviction_policy == "s3fifo"
    with pytest.raises(SystemExit):
        p.parse_args(["--eviction-policy", "arc"])
    err = capsys.readouterr().err
    assert "--eviction-policy" in err and "'lru', 'lfu', 'slru', 's3fifo'" in err


def test_cache_server_hands_the_policy_to_its_page_store():
    from tierkv.storage_backends.zmq.server import CacheServer

    srv = CacheServer(port=0, capacity_bytes=1 << 20, eviction_policy="slru")
    try:
        assert srv.store.eviction_policy == "slru" and srv.store.of(srv.table.tenants["default"]).order.name == "slru"
    finally:
        srv.close()
