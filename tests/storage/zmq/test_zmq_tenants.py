"""Tenants on ``tierkv server`` (a real server process with ``--tokens-file``): each tenant's pages are its own
namespace (read, exists, delete, clear, scan, verify --fix, stats), quotas evict the tenant's own LRU pages or, with
eviction off, refuse the write (the client counts it failed), SIGHUP reloads the file, a bad file names its line."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

from tests.helpers import fixtures_zmq as FZ
from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.page_format import HEADER_BYTES
from tierkv.storage_backends.zmq.client import ZmqStore
from tierkv.storage_backends.zmq.server.tenants import TokensFileError, load_tokens_file

PB = 4096
REC = PB + HEADER_BYTES
NS = bytes(range(40, 56))
TOK = {"a": "token-of-team-a-0123456789", "b": "token-of-team-b-0123456789", "c": "token-of-team-c-0123456789",
       "ops": "token-of-operator-012345678"}


def tokens_yaml(quota_a: int = 64 * REC, extra: str = "", tok_a: str = TOK["a"]) -> str:
    return (f"tenants:\n"
            f"  - name: team-a\n    token: {tok_a}\n    quota_bytes: {quota_a}\n"
            f"  - name: team-b\n    token: {TOK['b']}\n    quota_bytes: 64MiB\n"
            f"  - name: team-c\n    token: {TOK['c']}\n    quota_bytes: {4 * REC}\n    evict: false\n"
            f"  - name: ops\n    token: {TOK['ops']}\n    quota_bytes: 1MiB\n    admin: true\n" + extra)


def keys_of(n: int, salt: int = 0) -> list[str]:
    return [f"{salt:08x}{i:024x}" for i in range(n)]


def pages(n: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.frombuffer(rng.bytes(PB), dtype=np.uint8).copy()) for _ in range(n)]


class Server:
    def __init__(self, tmp_path, text: str, args: tuple = ()):
        self.path = str(tmp_path / "tokens.yaml")
        with open(self.path, "w") as f:
            f.write(text)
        self.log = str(tmp_path / "server.log")
        self.proc, self.endpoint = FZ.start_server(0, log_path=self.log, args=("--tokens-file", self.path, *args))
        self.clients: list[ZmqStore] = []

    def client(self, who: str, ns: bytes = NS) -> ZmqStore:
        c = ZmqStore(ns, PB, endpoint=self.endpoint, token=TOK[who], timeout_s=FZ.DEFAULT_TIMEOUT_S)
        self.clients.append(c)
        return c

    def call(self, who: str, **h) -> dict:
        h = {"v": P.ADMIN_PROTOCOL_VERSION, "id": 5, "keys": [], "token": TOK[who], **h}
        rep = FZ.raw_request(self.endpoint, h)
        assert rep is not None
        return FZ.decode_reply(rep)

    def stats(self, who: str = "ops") -> dict:
        r = self.call(who, op="stats")
        assert r["ok"], r
        return r["stats"]

    def close(self) -> None:
        for c in self.clients:
            c.close()
        FZ._stop_proc(self.proc)


@pytest.fixture
def srv(tmp_path):
    s = Server(tmp_path, tokens_yaml())
    yield s
    s.close()


def read(c: ZmqStore, ks: list) -> list:
    dst = [torch.zeros(PB, dtype=torch.uint8) for _ in ks]
    hits = c.batch_get(ks, dst)
    return [d if h else None for d, h in zip(dst, hits)]


def test_same_key_of_two_tenants_is_two_records_and_each_reads_its_own(srv):
    a, b = srv.client("a"), srv.client("b")
    ks = keys_of(4, 1)
    pa, pb = pages(4, 1), pages(4, 2)
    assert a.batch_set(ks, pa) == [True] * 4 and b.batch_set(ks, pb) == [True] * 4
    assert all(torch.equal(x, y) for x, y in zip(read(a, ks), pa))
    assert all(torch.equal(x, y) for x, y in zip(read(b, ks), pb))
    st = srv.stats()
    assert st["tenants"]["team-a"]["pages"] == 4 and st["tenants"]["team-b"]["pages"] == 4 and st["keys"] == 8


def test_another_tenants_page_is_a_counted_miss_and_never_revealed(srv):
    a, b = srv.client("a"), srv.client("b")
    ks = keys_of(3, 2)
    assert a.batch_set(ks, pages(3, 3)) == [True] * 3
    assert read(b, ks) == [None] * 3 and b.batch_exists(ks) == 0
    assert b.batch_delete(ks) == 0
    b.clear()  # same namespace, other tenant: nothing of team-a's goes
    assert a.batch_exists(ks) == 3
    st = srv.stats()
    assert st["cross_tenant_misses"] == 3 and st["tenants"]["team-b"]["misses"] == 3
    seen_by_b = srv.stats("b")  # what team-b may see: its own counters only, nothing about the foreign pages
    assert set(seen_by_b["tenants"]) == {"team-b"} and "cross_tenant_misses" not in seen_by_b
    assert seen_by_b["keys"] == 0 and seen_by_b["misses"] == 3
    # the miss reply to team-b is the same as for a key nobody holds
    fresh = srv.call("b", v=1, op="get", ns=NS, keys=keys_of(1, 99))
    foreign = srv.call("b", v=1, op="get", ns=NS, keys=ks[:1])
    assert {k: v for k, v in fresh.items() if k != "id"} == {k: v for k, v in foreign.items() if k != "id"}


def test_scan_and_verify_fix_see_only_the_own_tenants_pages(srv):
    a, b = srv.client("a"), srv.client("b", ns=bytes(range(16)))
    ka, kb = keys_of(3, 3), keys_of(2, 4)
    assert a.batch_set(ka, pages(3, 4)) == [True] * 3 and b.batch_set(kb, pages(2, 5)) == [True] * 2
    r = srv.call("a", op="t_corrupt", v=1, ns=NS, keys=ka[:1], how="flip")
    assert r["ok"] and r["corrupted"] == 1
    scan_b = srv.call("b", op="scan")
    assert [bytes(d["ns"]) for d in scan_b["namespaces"]] == [bytes(range(16))] and scan_b["tenant"] == "team-b"
    vb = srv.call("b", op="verify", fix=True)
    assert vb["checked"] == 2 and vb["bad"] == 0 and vb["removed"] == 0
    assert a.batch_exists(ka) == 3 and srv.stats()["tenants"]["team-a"]["pages"] == 3
    va = srv.call("a", op="verify", fix=True)
    assert va["checked"] == 3 and va["bad"] == 1 and va["removed"] == 1
    assert srv.stats()["tenants"]["team-a"]["pages"] == 2 and b.batch_exists(kb) == 2


def test_over_quota_a_tenant_evicts_its_own_lru_pages(tmp_path):
    s = Server(tmp_path, tokens_yaml(quota_a=4 * REC))
    try:
        a, b = s.client("a"), s.client("b")
        kb = keys_of(6, 5)
        pb = pages(6, 6)
        assert b.batch_set(kb, pb) == [True] * 6
        ka = keys_of(10, 6)
        pa = pages(10, 7)
        assert a.batch_set(ka, pa) == [True] * 10
        got = read(a, ka)
        assert got[:6] == [None] * 6 and all(torch.equal(x, y) for x, y in zip(got[6:], pa[6:]))
        assert all(torch.equal(x, y) for x, y in zip(read(b, kb), pb))  # team-b lost nothing
        t = s.stats()["tenants"]
        assert t["team-a"]["evictions"] == 6 and t["team-a"]["bytes"] == 4 * REC and t["team-b"]["evictions"] == 0
    finally:
        s.close()


def test_with_eviction_off_writes_over_quota_are_refused_and_reported(srv):
    c = srv.client("c")
    ks = keys_of(6, 7)
    src = pages(6, 8)
    assert c.batch_set(ks, src) == [True] * 4 + [False] * 2
    st = c.stats()
    assert st["set_failures"] == 2 and st["set_refused"] == 2 and st["sets"] == 4
    got = read(c, ks)
    assert all(torch.equal(x, y) for x, y in zip(got[:4], src[:4])) and got[4:] == [None, None]
    t = srv.stats()["tenants"]["team-c"]
    assert t["refused"] == 2 and t["pages"] == 4 and t["evictions"] == 0
    assert c.batch_set(ks[:1], src[1:2]) == [True]  # replacing a page within the quota is fine


def test_sighup_reloads_the_table_and_a_bad_file_keeps_the_old_one(srv):
    a = srv.client("a")
    ks = keys_of(2, 8)
    assert a.batch_set(ks, pages(2, 9)) == [True] * 2
    with open(srv.path, "w") as f:
        f.write(tokens_yaml(tok_a="rotated-token-of-team-a-0001",
                            extra="  - name: team-d\n    token: tok-d-0123456789\n    quota_bytes: 1MiB\n"))
    os.kill(srv.proc.pid, signal.SIGHUP)
    for _ in range(200):  # bounded: the server reloads at its next loop turn (100 ms poll)
        if srv.stats()["tokens_reloads"] == 1:
            break
        time.sleep(0.05)
    st = srv.stats()
    assert st["tokens_reloads"] == 1 and "team-d" in st["tenants"]
    assert srv.call("a", op="ping")["code"] == "auth"  # the old token of team-a is gone
    rotated = ZmqStore(NS, PB, endpoint=srv.endpoint, token="rotated-token-of-team-a-0001", timeout_s=3.0)
    try:
        assert rotated.batch_exists(ks) == 2  # same tenant name: its pages stayed
    finally:
        rotated.close()
    with open(srv.path, "w") as f:
        f.write(tokens_yaml() + f"  - name: team-e\n    token: {TOK['b']}\n    quota_bytes: 1MiB\n")
    os.kill(srv.proc.pid, signal.SIGHUP)
    for _ in range(200):
        if srv.stats()["tokens_reload_failures"] == 1:
            break
        time.sleep(0.05)
    st = srv.stats()
    assert st["tokens_reload_failures"] == 1 and st["tokens_reloads"] == 1 and "team-d" in st["tenants"]
    log = open(srv.log).read()
    assert "line 17: duplicate token" in log and TOK["b"] not in log


BAD_FILES = [
    ("tenants:\n  - name: x\n    token: t1\n    quota_bytes: 1MiB\n  - name: y\n    token: t1\n    quota_bytes: 1\n",
     "line 6: duplicate token"),
    ("tenants:\n  - name: x\n    token: t1\n    quota_bytes: -5\n", "line 4: quota_bytes '-5'"),
    ("tenants:\n  - name: x\n    token: t1\n    quota_bytes: lots\n", "line 4: quota_bytes 'lots'"),
    ("tenants:\n  - name: x\n    token: t1\n    quota_bytes: 1GiB\n    colour: red\n", "line 5: unknown key 'colour'"),
    ("tenants:\n  - name: x\n    token: t1\n    quota_bytes: 1GiB\n  - name: x\n    token: t2\n    quota_bytes: 1\n",
     "line 5: duplicate tenant name 'x'"),
    ("tenants:\n  - name: x\n    token: t1\n", "line 2: missing key 'quota_bytes'"),
    ("tenants: [\n", "not valid YAML"),
]


@pytest.mark.parametrize("text,message", BAD_FILES)
def test_bad_tokens_file_names_the_line(tmp_path, text, message):
    p = tmp_path / "t.yaml"
    p.write_text(text)
    with pytest.raises(TokensFileError) as e:
        load_tokens_file(str(p))
    assert message in str(e.value) and "t1" not in str(e.value).replace("'t1'", "")


def test_server_refuses_to_start_on_a_bad_or_unreadable_tokens_file(tmp_path):
    p = tmp_path / "t.yaml"
    p.write_text(BAD_FILES[0][0])
    for path, message in ((str(p), "line 6: duplicate token"), (str(tmp_path / "absent.yaml"), "cannot read it")):
        r = subprocess.run([sys.executable, "-m", "tierkv.cli_server", "--port", "0",
                            "--tokens-file", path], capture_output=True, text=True, timeout=120)
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.returncode == 5 and len(lines) == 1 and message in lines[0], r.stderr
    r = subprocess.run([sys.executable, "-m", "tierkv.cli_server", "--port", "0", "--tokens-file",
                        str(p), "--token", "x"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 5 and "not both" in r.stderr


def test_tierkv_store_stats_shows_the_tenants(srv):
    def tierkv(*argv, json_out=False):
        exe = os.path.join(os.path.dirname(sys.executable), "tierkv")
        r = subprocess.run([exe, *argv], capture_output=True, text=True, timeout=120)
        return (r, json.loads(r.stdout) if r.returncode == 0 else None) if json_out else r

    a = srv.client("a")
    assert a.batch_set(keys_of(3, 9), pages(3, 10)) == [True] * 3
    port = srv.endpoint.rsplit(":", 1)[1]
    r, d = tierkv("store", "stats", f"tcp://127.0.0.1:{port}", "--token", TOK["a"], "--json", json_out=True)
    assert r.returncode == 0, r.stderr
    assert set(d["tenants"]) == {"team-a"} and d["tenants"]["team-a"]["pages"] == 3 and d["pages"] == 3
    r = tierkv("store", "stats", f"tcp://127.0.0.1:{port}", "--token", TOK["ops"])
    assert r.returncode == 0 and "tenant team-a: 3 pages" in r.stdout and "tenant team-c:" in r.stdout
    assert "(eviction off)" in r.stdout


def test_a_shared_memory_segment_belongs_to_the_tenant_that_attached_it(srv):
    a = ZmqStore(NS, PB, endpoint=srv.endpoint, token=TOK["a"], timeout_s=3.0, shm="on", shm_bytes=4 * PB)
    srv.clients.append(a)
    ks = keys_of(2, 11)
    assert a.batch_set(ks, pages(2, 12)) == [True] * 2 and a.stats()["shm"] == "attached"
    name = a._seg.name
    for who in ("b", "ops"):  # naming team-a's segment: neither its slots nor the segment itself are reachable
        got = srv.call(who, v=P.SHM_PROTOCOL_VERSION, op="get", ns=NS, keys=ks[:1], shm=name, len=PB, offs=[0])
        assert got["code"] == "shm_unknown", got
        put = srv.call(who, v=P.SHM_PROTOCOL_VERSION, op="set", ns=NS, keys=ks[:1], shm=name, len=PB, offs=[0],
                       hdrs=[b"h" * 64])
        assert put["code"] == "shm_unknown", put
        assert srv.call(who, v=P.SHM_PROTOCOL_VERSION, op="shm_attach", name=name, size=4 * PB)["code"] == "shm"
        assert srv.call(who, v=P.SHM_PROTOCOL_VERSION, op="shm_detach", name=name)["detached"] is False
    dst = [torch.zeros(PB, dtype=torch.uint8) for _ in ks]
    assert a.batch_get(ks, dst) == [True] * 2 and a.stats()["shm_pages_in"] == 2
    assert srv.stats()["shm_segments"] == 1


def test_each_tenant_spills_to_its_own_directory(tmp_path):
    spill = tmp_path / "spill"
    s = Server(tmp_path, tokens_yaml(quota_a=2 * REC), args=("--spill-dir", str(spill)))
    try:
        a, b = s.client("a"), s.client("b")
        ks = keys_of(5, 12)
        pa = pages(5, 13)
        assert a.batch_set(ks, pa) == [True] * 5  # 3 of them evicted to team-a's spill directory
        files = {w: [f for f in (spill / "tenants" / w).rglob("*.page")] for w in ("team-a", "team-b")}
        assert len(files["team-a"]) == 3 and files["team-b"] == [], files
        assert b.batch_exists(ks) == 0 and read(b, ks) == [None] * 5
        assert all(torch.equal(x, y) for x, y in zip(read(a, ks), pa))
        t = s.stats()["tenants"]["team-a"]
        assert t["spilled"] >= 3 and t["spill_hits"] >= 3 and t["bytes"] <= 2 * REC
    finally:
        s.close()
