"""The ``redis`` L3 store on a real ``redis-server`` beyond the contract suite (test_contract.py runs that on it too):
one round trip per batch, TTL, planted values, ``maxmemory`` under ``noeviction`` and ``allkeys-lru``, a server killed
and restarted mid-run, a server that comes only after start-up, and start-up errors that name their key."""
from __future__ import annotations

import logging
import os
import time

import numpy as np
import pytest
import torch

from tests.helpers import fixtures_redis as F
from tests.helpers.redis_servers import RedisServer, free_port
from tierkv.storage_backends.common import ConfigError
from tierkv.storage_backends.factory import build_backend, validate_l3
from tierkv.storage_backends.page_format import HEADER_BYTES, encode_header
from tierkv.storage_backends.redis import RedisStore

NS = bytes(range(16))
KiB = 1024


def pages(n: int, pb: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.frombuffer(rng.bytes(pb), dtype=np.uint8).copy()) for _ in range(n)]


def keys(n: int, seed: int) -> list[str]:
    rng = np.random.default_rng(seed)
    return [rng.bytes(16).hex() for _ in range(n)]


def empties(n: int, pb: int) -> list[torch.Tensor]:
    return [torch.zeros(pb, dtype=torch.uint8) for _ in range(n)]


def count_round_trips(monkeypatch) -> list[int]:
    """Count the writes of packed commands to a socket (one per pipeline: a round trip)."""
    from redis.connection import AbstractConnection

    calls: list[int] = []
    real = AbstractConnection.send_packed_command

    def counting(self, command, check_health=True):
        calls.append(1)
        return real(self, command, check_health)

    monkeypatch.setattr(AbstractConnection, "send_packed_command", counting)
    return calls


def test_a_batch_is_one_round_trip(tmp_path, monkeypatch):
    with F.make_backend(tmp_path, 16 * KiB, NS) as h:
        b = h.backend
        ks, src = keys(32, 1), pages(32, 16 * KiB, 1)
        calls = count_round_trips(monkeypatch)
        assert b.batch_set(ks, src) == [True] * 32
        assert len(calls) == 1
        assert b.batch_exists(ks) == 32
        dst = empties(32, 16 * KiB)
        assert b.batch_get(ks, dst) == [True] * 32
        assert len(calls) == 3
        assert all(torch.equal(s, d) for s, d in zip(src, dst))


def test_ttl_is_set_on_every_page_and_keys_carry_the_namespace(tmp_path):
    with F.make_backend(tmp_path, 4 * KiB, NS, ttl_s=30.0, key_prefix="ttltest") as h:
        ks = keys(3, 2)
        assert h.backend.batch_set(ks, pages(3, 4 * KiB, 2)) == [True] * 3
        raw = h.raw()
        names = sorted(n.decode() for n in raw.keys("*"))
        assert names == sorted(f"ttltest:{NS.hex()}:{k}" for k in ks)
        assert all(25_000 < raw.pttl(n) <= 30_000 for n in names)


def test_planted_values_are_misses_never_data(tmp_path):
    """Values another client put under the store's keys: wrong length, random bytes of a page's length, a valid
    record of another key: each a miss counted as corrupt; another type: a miss (MGET reads it as absent); exists
    does not count wrong lengths."""
    pb = 8 * KiB
    with F.make_backend(tmp_path, pb, NS) as h:
        b, raw = h.backend, h.raw()
        ks, src = keys(5, 3), pages(5, pb, 3)
        assert b.batch_set(ks, src) == [True] * 5
        raw.set(h.name_of(ks[0]), b"not a page")
        raw.set(h.name_of(ks[1]), os.urandom(HEADER_BYTES + pb))
        other = bytes(src[2].numpy())
        raw.set(h.name_of(ks[2]), encode_header(ks[3], NS, other) + other)   # another key's valid record
        raw.delete(h.name_of(ks[3]))
        raw.hset(h.name_of(ks[3]), "a", "b")                                  # a hash, not a string
        assert b.batch_exists(ks) == 0 and b.batch_exists(ks[1:]) == 2        # length only: ks[3] ends the run
        dst = empties(5, pb)
        assert b.batch_get(ks, dst) == [False, False, False, False, True]
        assert torch.equal(dst[4], src[4]) and not any(bool(d.any()) for d in dst[:4])
        assert b.stats()["corrupt"] == 3 and b.stats()["hits"] == 1 and b.stats()["misses"] == 4


def test_noeviction_refuses_writes_counted_and_logged_once(tmp_path, caplog):
    pb = 64 * KiB
    with F.make_backend(tmp_path, pb, NS, server_args=("--maxmemory", "4mb", "--maxmemory-policy",
                                                       "noeviction")) as h:
        b = h.backend
        ks, src = keys(120, 4), pages(120, pb, 4)
        with caplog.at_level(logging.WARNING, logger="tierkv.redis"):
            res = [r for i in range(0, 120, 20) for r in b.batch_set(ks[i:i + 20], src[i:i + 20])]
        stored = sum(res)
        assert 0 < stored < 120 and res[:stored] == [True] * stored   # refused once full, never before
        st = b.stats()
        assert st["refused"] == 120 - stored == st["set_failures"] and st["errors"] == 0
        assert len([r for r in caplog.records if "refuses writes" in r.message]) == 1
        dst = empties(120, pb)
        got = b.batch_get(ks, dst)                                     # reads go on: every stored page is there
        assert got == res and all(torch.equal(dst[i], src[i]) for i in range(stored))


def test_allkeys_lru_evicts_pages_as_misses_never_wrong_bytes(tmp_path):
    pb = 64 * KiB
    with F.make_backend(tmp_path, pb, NS, server_args=("--maxmemory", "4mb", "--maxmemory-policy",
                                                       "allkeys-lru")) as h:
        b = h.backend
        ks, src = keys(150, 5), pages(150, pb, 5)
        for i in range(0, 150, 25):
            assert b.batch_set(ks[i:i + 25], src[i:i + 25]) == [True] * 25   # the server makes room
        dst = empties(150, pb)
        got = b.batch_get(ks, dst)
        assert 0 < sum(got) < 100 and not all(got[:50])                   # older pages evicted
        assert all(torch.equal(dst[i], src[i]) for i, g in enumerate(got) if g)
        st = b.stats()
        assert st["corrupt"] == 0 and st["misses"] == 150 - sum(got) and st["errors"] == 0


def test_server_killed_and_restarted_mid_run(tmp_path):
    """Killed: calls return misses / False within the bound, never raise; restarted on the same port: the same
    store serves again (the pages went with the server: persistence is off)."""
    pb = 4 * KiB
    with F.make_backend(tmp_path, pb, NS, timeout_s=1.0, reconnect_backoff_s=0.01, max_backoff_s=0.05) as h:
        b = h.backend
        ks, src = keys(6, 6), pages(6, pb, 6)
        assert b.batch_set(ks[:3], src[:3]) == [True] * 3
        h.server.kill9()
        t0 = time.monotonic()
        assert b.batch_set(ks[3:], src[3:]) == [False] * 3
        assert b.batch_get(ks[:3], empties(3, pb)) == [False] * 3
        assert b.batch_exists(ks) == 0
        assert time.monotonic() - t0 < 3.0
        assert b.stats()["errors"] >= 1
        h.server.start()
        deadline = time.monotonic() + 10
        while b.batch_set(ks[3:], src[3:]) != [True] * 3:
            assert time.monotonic() < deadline, "no service 10 s after the restart"
            time.sleep(0.02)
        dst = empties(6, pb)
        assert b.batch_get(ks, dst) == [False] * 3 + [True] * 3
        assert all(torch.equal(dst[i], src[i]) for i in range(3, 6))


def test_unreachable_at_start_up_warns_once_and_connects_when_the_server_comes(tmp_path, caplog):
    port = free_port()
    with caplog.at_level(logging.WARNING, logger="tierkv.redis"):
        b = RedisStore(NS, 4 * KiB, url=f"redis://127.0.0.1:{port}/0", timeout_s=1.0, reconnect_backoff_s=0.01,
                       max_backoff_s=0.05)
        ks, src = keys(2, 7), pages(2, 4 * KiB, 7)
        assert b.batch_get(ks, empties(2, 4 * KiB)) == [False, False]
        assert b.batch_set(ks, src) == [False, False]
    assert len([r for r in caplog.records if "at start-up" in r.message]) == 1
    server = RedisServer(str(tmp_path / "late"), port=port)
    try:
        deadline = time.monotonic() + 10
        while b.batch_set(ks, src) != [True, True]:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        dst = empties(2, 4 * KiB)
        assert b.batch_get(ks, dst) == [True, True] and torch.equal(dst[1], src[1])
    finally:
        b.close()
        server.close()


@pytest.mark.parametrize("section, key", [
    ({"url": "http://127.0.0.1:6379"}, "l3.redis.url"),
    ({"url": "redis://:secret@127.0.0.1:6379"}, "l3.redis.url"),
    ({"url": "redis://127.0.0.1:6379/zero"}, "l3.redis.url"),
    ({"mode": "cluster"}, "l3.redis.nodes"),
    ({"mode": "cluster", "nodes": ["127.0.0.1"]}, "l3.redis.nodes"),
    ({"mode": "sharded"}, "l3.redis.mode"),
    ({"pool_size": 0}, "l3.redis.pool_size"),
    ({"ttl_s": -1}, "l3.redis.ttl_s"),
    ({"key_prefix": "a b"}, "l3.redis.key_prefix"),
    ({"timeout_s": 0}, "l3.redis.timeout_s"),
    ({"tls_cert_file": "/c.pem"}, "l3.redis.tls_key_file"),
    ({"pool": 3}, "l3.redis.pool"),
])
def test_bad_keys_are_named_at_config_load(section, key):
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        validate_l3({"backend": "redis", "redis": section})


def test_password_errors_stop_start_up_naming_the_key(tmp_path):
    s = RedisServer(str(tmp_path / "pw"), password="s3cret")
    try:
        for extra in ({}, {"password": "wrong"}):
            with pytest.raises(ConfigError, match=r"l3\.redis\.password") as e:
                build_backend({"backend": "redis", "redis": {"url": s.url, **extra}}, NS, 4 * KiB)
            assert "wrong" not in str(e.value).replace("is wrong", "")   # the secret is not shown
        b = build_backend({"backend": "redis", "redis": {"url": s.url, "password": "s3cret"}}, NS, 4 * KiB)
        assert b.batch_set(keys(1, 8), pages(1, 4 * KiB, 8)) == [True]
        b.close()
    finally:
        s.close()


def test_cluster_nodes_naming_a_standalone_server_stop_start_up(tmp_path):
    s = RedisServer(str(tmp_path / "solo"))
    try:
        with pytest.raises(ConfigError, match=r"l3\.redis\.nodes .*not in cluster mode"):
            build_backend({"backend": "redis", "redis": {"mode": "cluster", "nodes": [s.node]}}, NS, 4 * KiB)
    finally:
        s.close()


def _certs(d) -> dict:
    """A CA and a server certificate for 127.0.0.1 made with the openssl command line (PEM files in ``d``)."""
    import subprocess

    d.mkdir()
    ca, ca_key, crt, key, csr, ext = (str(d / n) for n in ("ca.crt", "ca.key", "srv.crt", "srv.key", "srv.csr",
                                                            "ext.cnf"))
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    for cmd in (["req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", ca_key, "-out", ca, "-days", "2",
                 "-subj", "/CN=tierkv-test-ca"],
                ["req", "-newkey", "rsa:2048", "-nodes", "-keyout", key, "-out", csr, "-subj", "/CN=127.0.0.1"],
                ["x509", "-req", "-in", csr, "-CA", ca, "-CAkey", ca_key, "-CAcreateserial", "-out", crt,
                 "-days", "2", "-extfile", ext]):
        subprocess.run(["openssl", *cmd], check=True, capture_output=True, timeout=60)
    return {"ca": ca, "crt": crt, "key": key}


def test_tls_with_the_servers_ca_and_a_refused_handshake_without_it(tmp_path):
    c = _certs(tmp_path / "pki")
    port = free_port()
    s = RedisServer(str(tmp_path / "tls"), port=free_port(), args=(
        "--tls-port", str(port), "--tls-cert-file", c["crt"], "--tls-key-file", c["key"], "--tls-ca-cert-file",
        c["ca"], "--tls-auth-clients", "no"))
    try:
        url = f"rediss://127.0.0.1:{port}/0"
        b = RedisStore(NS, 4 * KiB, url=url, tls_ca_file=c["ca"])
        ks, src = keys(3, 9), pages(3, 4 * KiB, 9)
        assert b.batch_set(ks, src) == [True] * 3
        dst = empties(3, 4 * KiB)
        assert b.batch_get(ks, dst) == [True] * 3 and all(torch.equal(x, y) for x, y in zip(src, dst))
        b.close()
        with pytest.raises(ConfigError, match=r"TLS .*l3\.redis\.tls"):   # the system CAs do not know this one
            RedisStore(NS, 4 * KiB, url=url)
    finally:
        s.close()


def test_clear_drops_only_this_namespace(tmp_path):
    with F.make_backend(tmp_path, 4 * KiB, NS) as h:
        other = h.new_client(namespace=bytes(range(16, 32)))
        ks = keys(40, 10)
        assert h.backend.batch_set(ks, pages(40, 4 * KiB, 10)) == [True] * 40
        assert other.batch_set(ks, pages(40, 4 * KiB, 11)) == [True] * 40
        h.backend.clear()
        assert h.backend.batch_exists(ks) == 0 and other.batch_exists(ks) == 40
