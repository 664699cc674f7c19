"""``tierkv store stats|verify|gc|clear`` on a real file store directory, a real ``tierkv server`` process and a real
Mooncake master; bad input gives one line and the documented exit code (tierkv/cli_common.py)."""
from __future__ import annotations

import json
import os
import socket
import struct
import time

import pytest
import xxhash

from tests.helpers.cli import NS_A, NS_B, key, one_line_error, page, tierkv
from tierkv.cli import main
from tierkv.cli_common import EXIT_FOUND, EXIT_NEWER, EXIT_OK, EXIT_REFUSED, EXIT_UNREACHABLE, EXIT_USAGE
from tierkv.storage_backends.file.store import FileStore

PB_A, PB_B = 4096, 8192
DAY = 86400


def run_json(capsys, *argv) -> tuple[int, dict]:
    rc = main([*argv, "--json", "-q"])
    out = capsys.readouterr().out
    return rc, (json.loads(out) if out.strip() else {})


def page_path(root, ns: bytes, k: str) -> str:
    return os.path.join(root, ns.hex(), k[:2], f"{k}.page")


@pytest.fixture
def store(tmp_path):
    """A file store directory written by FileStore: 3 pages of NS_A (4 KiB), 2 of NS_B (8 KiB); page 0 of NS_A last
    used two days ago, page 1 of NS_A two hours ago."""
    root = str(tmp_path / "l3")
    a = FileStore(NS_A, PB_A, root=root)
    assert a.batch_set([key(i) for i in range(3)], [page(i, PB_A) for i in range(3)]) == [True] * 3
    a.close()
    b = FileStore(NS_B, PB_B, root=root)
    assert b.batch_set([key(i) for i in range(2)], [page(i, PB_B) for i in range(2)]) == [True] * 2
    b.close()
    now = time.time()
    os.utime(page_path(root, NS_A, key(0)), (now - 2 * DAY, now - 2 * DAY))
    os.utime(page_path(root, NS_A, key(1)), (now - 7200, now - 7200))
    return root


def test_stats_of_a_file_store_counts_pages_bytes_namespaces_and_ages(store, capsys):
    rc, d = run_json(capsys, "store", "stats", store)
    assert rc == EXIT_OK
    assert d["pages"] == 5 and d["bytes"] == 3 * (64 + PB_A) + 2 * (64 + PB_B)
    by_ns = {n["namespace"]: n for n in d["namespaces"]}
    assert set(by_ns) == {NS_A.hex(), NS_B.hex()}
    a, b = by_ns[NS_A.hex()], by_ns[NS_B.hex()]
    assert (a["pages"], a["payload_bytes"], a["versions"]) == (3, [PB_A], [1])
    assert (b["pages"], b["payload_bytes"]) == (2, [PB_B])
    # buckets <1m <10m <1h <6h <1d <7d >=7d: one page now, one 2 h old, one 2 days old
    assert a["ages"] == [1, 0, 0, 1, 0, 1, 0]
    assert b["ages"] == [2, 0, 0, 0, 0, 0, 0]
    assert main(["store", "stats", store, "-q"]) == EXIT_OK  # text form
    text = capsys.readouterr().out
    assert f"namespace {NS_A.hex()}: 3 pages" in text and "5 pages" in text


def test_stats_shows_a_namespace_description_where_present(store, capsys):
    from tierkv.storage_backends.file.store import describe_namespace

    assert describe_namespace(store, NS_B, {"model_id": "Qwen/Qwen3-0.6B", "dtype": "bfloat16",
                                            "kv_layout": "layer_first/LBHNC"})
    rc, d = run_json(capsys, "store", "stats", store)
    desc = {n["namespace"]: n["describe"] for n in d["namespaces"]}
    assert desc[NS_B.hex()]["dtype"] == "bfloat16" and desc[NS_A.hex()] is None


def test_verify_counts_then_quarantines_bad_records(store, capsys):
    flipped, cut = page_path(store, NS_A, key(1)), page_path(store, NS_B, key(0))
    with open(flipped, "r+b") as f:
        f.seek(64 + 100)
        b = f.read(1)
        f.seek(64 + 100)
        f.write(bytes([b[0] ^ 0xFF]))
    os.truncate(cut, 64 + 100)
    rc, d = run_json(capsys, "store", "verify", store)
    assert rc == EXIT_FOUND and (d["checked"], d["ok"], d["bad"], d["removed"]) == (5, 3, 2, 0)
    assert d["reasons"] == {"payload checksum mismatch": 1, "payload length mismatch": 1}
    assert os.path.exists(flipped) and os.path.exists(cut)  # without --fix nothing moves
    rc, d = run_json(capsys, "store", "verify", store, "--fix")
    assert rc == EXIT_FOUND and d["removed"] == 2 and d["action"] == "quarantined"
    assert not os.path.exists(flipped) and not os.path.exists(cut)
    assert len(os.listdir(os.path.join(store, "quarantine"))) == 2
    rc, d = run_json(capsys, "store", "verify", store)
    assert rc == EXIT_OK and (d["checked"], d["bad"]) == (3, 0)


def test_a_store_written_by_a_newer_format_is_refused_untouched(store, capsys):
    p = page_path(store, NS_A, key(2))
    with open(p, "r+b") as f:
        head = bytearray(f.read(56))
        head[4:6] = struct.pack("<H", 2)  # page format version 2, header checksum made valid again
        f.seek(0)
        f.write(bytes(head) + struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(head))))
    for argv in (["store", "stats", store], ["store", "verify", store, "--fix"]):
        r = tierkv(*argv)
        assert r.returncode == EXIT_NEWER
        assert "newer than this tierkv" in one_line_error(r)
    assert os.path.exists(p)


def test_gc_removes_least_recently_used_pages_down_to_max_bytes(tmp_path, capsys):
    root = str(tmp_path / "gc")
    s = FileStore(NS_A, PB_A, root=root)
    assert all(s.batch_set([key(i) for i in range(6)], [page(i, PB_A) for i in range(6)]))
    s.close()
    now = time.time()
    for i in range(6):  # page i last used (6 - i) hours ago: 0 is the least recently used
        os.utime(page_path(root, NS_A, key(i)), (now - (6 - i) * 3600,) * 2)
    rec = 64 + PB_A
    assert main(["store", "gc", root, "--max-bytes", str(3 * rec + 10), "--dry-run", "-q"]) == EXIT_OK
    assert "would remove 3" in capsys.readouterr().out
    assert len(os.listdir(os.path.join(root, NS_A.hex(), "00"))) == 6
    assert main(["store", "gc", root, "--max-bytes", str(3 * rec + 10), "-q"]) == EXIT_OK
    left = sorted(f[:32] for f in os.listdir(os.path.join(root, NS_A.hex(), "00")))
    assert left == [key(3), key(4), key(5)]
    r = FileStore(NS_A, PB_A, root=root)  # a store opened afterwards sees exactly what is left
    assert r.usage()["pages"] == 3 and r.batch_exists([key(3), key(4), key(5)]) == 3
    r.close()


def test_clear_removes_only_the_named_namespace(store, capsys):
    assert main(["store", "clear", store, "--namespace", NS_A.hex(), "-q"]) == EXIT_OK
    assert "removed 3 pages" in capsys.readouterr().out
    rc, d = run_json(capsys, "store", "stats", store)
    assert [n["namespace"] for n in d["namespaces"]] == [NS_B.hex()] and d["pages"] == 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_bad_input_is_one_line_and_a_documented_exit_code(tmp_path, store):
    f = tmp_path / "plain"
    f.write_text("x")
    cases = [
        (["store", "stats", str(tmp_path / "missing")], EXIT_USAGE, "no such directory"),
        (["store", "verify", str(f)], EXIT_USAGE, "not a directory"),
        (["store", "gc", str(tmp_path), "--max-bytes", "0"], EXIT_USAGE, "not a tierkv file store"),
        (["store", "stats", "http://x:1"], EXIT_USAGE, "unknown store address"),
        (["store", "stats", f"tcp://127.0.0.1:{_free_port()}", "--timeout", "0.5"], EXIT_UNREACHABLE,
         "cannot reach 'tierkv server'"),
        (["store", "stats", f"mooncake://127.0.0.1:{_free_port()}", "--timeout", "0.5"], EXIT_UNREACHABLE,
         "cannot reach"),
        (["store", "clear", store], EXIT_USAGE, "--namespace"),
        (["store", "clear", store, "--namespace", "xyz"], EXIT_USAGE, "invalid namespace"),
        (["store", "gc", store], EXIT_USAGE, "--max-bytes"),
        (["store", "gc", "tcp://127.0.0.1:5557", "--max-bytes", "1"], EXIT_REFUSED, "evicts by itself"),
    ]
    for argv, code, words in cases:
        r = tierkv(*argv)
        assert r.returncode == code, (argv, r.returncode, r.stderr)
        assert words in one_line_error(r), (argv, r.stderr)


# ----------------------------------------------------------------------------------------------- tierkv server
def test_server_stats_verify_fix_and_clear_over_the_wire(tmp_path, capsys, fresh_env):
    from tests.helpers.fixtures_zmq import ZmqHandle

    h = ZmqHandle(tmp_path, PB_A, NS_A, token="tok-123")
    try:
        other = h.new_client(NS_B)
        assert all(h.backend.batch_set([key(i) for i in range(4)], [page(i, PB_A) for i in range(4)]))
        assert all(other.batch_set([key(9)], [page(9, PB_A)]))
        ep = h.endpoint
        rc, d = run_json(capsys, "store", "stats", ep, "--token", "tok-123")
        assert rc == EXIT_OK and d["pages"] == 5
        assert {n["namespace"]: n["pages"] for n in d["namespaces"]} == {NS_A.hex(): 4, NS_B.hex(): 1}
        assert d["namespaces"][0]["ages"][0] == 4 and d["namespaces"][0]["payload_bytes"] == [PB_A]

        assert h.corrupt(key(1), "flip") and h.corrupt(key(2), "foreign_namespace")
        rc, d = run_json(capsys, "store", "verify", ep, "--token", "tok-123")
        assert rc == EXIT_FOUND and (d["checked"], d["ok"], d["bad"], d["removed"]) == (5, 3, 2, 0)
        assert h.backend.batch_exists([key(1)]) == 1  # still there: no --fix
        rc, d = run_json(capsys, "store", "verify", ep, "--token", "tok-123", "--fix")
        assert rc == EXIT_FOUND and d["removed"] == 2
        assert h.backend.batch_exists([key(0)]) == 1 and h.backend.batch_exists([key(1)]) == 0
        assert h.backend.batch_exists([key(2)]) == 0
        rc, d = run_json(capsys, "store", "verify", ep, "--token", "tok-123")
        assert rc == EXIT_OK and d["checked"] == 3

        r = tierkv("store", "verify", ep, "--fix", "--token", "wrong")
        assert r.returncode == EXIT_REFUSED and "wrong token" in one_line_error(r)
        assert "wrong" not in r.stderr.replace("wrong token", "")

        assert main(["store", "clear", ep, "--token", "tok-123", "--namespace", NS_A.hex(), "-q"]) == EXIT_OK
        capsys.readouterr()
        assert h.backend.batch_exists([key(0)]) == 0 and other.batch_exists([key(9)]) == 1
    finally:
        h.close()


def test_server_stats_and_verify_include_spilled_pages(tmp_path, capsys, fresh_env):
    from tests.helpers.fixtures_zmq import ZmqHandle

    h = ZmqHandle(tmp_path, PB_A, NS_A, capacity_pages=2, spill_dir=str(tmp_path / "spill"))
    try:
        assert all(h.backend.batch_set([key(i) for i in range(5)], [page(i, PB_A) for i in range(5)]))
        rc, d = run_json(capsys, "store", "stats", h.endpoint)
        assert rc == EXIT_OK and d["pages"] == 5  # 2 in memory + 3 spilled
        assert d["bytes"] == 5 * (64 + PB_A) and d["namespaces"][0]["payload_bytes"] == [PB_A]
        rc, d = run_json(capsys, "store", "verify", h.endpoint)
        assert rc == EXIT_OK and (d["checked"], d["ok"]) == (5, 5)
    finally:
        h.close()


def test_server_verify_runs_in_steps_and_other_clients_are_answered_in_between(tmp_path, fresh_env):
    """A verify of 30 records (20 in memory, 10 spilled) in steps of 7: after the first step, with 7 of 30 checked,
    another client's exists and get are answered; then the verify goes on to all 30 and drops the corrupt one."""
    from tests.helpers.fixtures_zmq import ZmqHandle

    from tierkv.cli_common import parse_target
    from tierkv.cli_store import ZmqAdmin, verify_server

    h = ZmqHandle(tmp_path, PB_A, NS_A, capacity_pages=20, spill_dir=str(tmp_path / "spill"))
    try:
        keys = [key(i) for i in range(30)]
        assert all(h.backend.batch_set(keys, [page(i, PB_A) for i in range(30)]))
        assert h.corrupt(key(25), "flip")
        other = h.new_client()
        steps, answered = [], []

        def between(r):
            steps.append(r["checked"])
            if len(steps) == 1:  # the verify is running: 7 of 30 checked
                got = bytearray(PB_A)
                answered.append((other.batch_exists(keys), other.batch_get([key(29)], [got]), bytes(got)))

        a = ZmqAdmin(parse_target(h.endpoint), None, 5.0)
        try:
            r = verify_server(a, None, True, per_request=7, on_step=between)
        finally:
            a.close()
        assert steps == [7, 14, 21, 28]
        assert answered == [(30, [True], bytes(page(29, PB_A)))]
        assert (r["checked"], r["good"], r["bad"], r["removed"], r["done"]) == (30, 29, 1, 1, True)
        assert other.batch_exists([key(25)]) == 0 and other.batch_exists([key(24)]) == 1
    finally:
        h.close()


# ----------------------------------------------------------------------------------------------- LMCache server
def test_lmcache_server_stats_say_what_the_server_can_tell(tmp_path, capsys):
    """A real LMCache 0.5.6 server (the session's shared one): stats give its chunk size, its L1 pool as capacity (the
    segment's size) and the pool bytes ever written (the segment's resident blocks: at least the 8 slots of 64 + 4096
    bytes just set), pages unknown; verify and clear are refused (exit 5), a bad address is exit 2, a port where no
    server listens exit 3."""
    from tests.helpers.fixtures_lmcache import make_backend

    with make_backend(tmp_path, PB_A, NS_A) as h:
        addr = f"lmcache://127.0.0.1:{h.port}"
        assert all(h.backend.batch_set([key(i) for i in range(8)], [page(i, PB_A) for i in range(8)]))
        rc, d = run_json(capsys, "store", "stats", addr)
        st = os.stat(h.shm_path)
        assert rc == EXIT_OK and d["kind"] == "lmcache" and d["pages"] is None and d["namespaces"] is None
        assert d["capacity_bytes"] == st.st_size > 0
        assert d["server"]["chunk_size"] == 16 and d["server"]["shm_segment"] == os.path.basename(h.shm_path)
        assert d["server"]["shm_resident_bytes"] == st.st_blocks * 512 >= 8 * (64 + PB_A)
        assert h.backend.batch_exists([key(i) for i in range(8)]) == 8  # the probe left the store's pages alone
        assert main(["store", "stats", addr, "-q"]) == EXIT_OK
        assert f"pages and bytes not listed, {st.st_size / 2**20:.1f} MiB capacity" in capsys.readouterr().out
        for argv, words in ((["store", "verify", addr], "cannot list its chunks"),
                            (["store", "clear", addr, "--all-namespaces"], "no per-namespace clear")):
            assert main(argv) == EXIT_REFUSED and words in capsys.readouterr().err, argv
    assert main(["store", "stats", "lmcache://127.0.0.1"]) == EXIT_USAGE
    assert "expected lmcache://HOST:PORT" in capsys.readouterr().err
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        free = s.getsockname()[1]
    assert main(["store", "stats", f"lmcache://127.0.0.1:{free}", "--timeout", "0.3"]) == EXIT_UNREACHABLE
    assert "cannot reach the LMCache server" in capsys.readouterr().err


# ----------------------------------------------------------------------------------------------- Mooncake master
def test_mooncake_master_stats_and_clear(tmp_path, capsys):
    from tests.helpers.mooncake_master import MooncakeMaster

    from tierkv.storage_backends.mooncake.store import MooncakeStore

    with MooncakeMaster(log_dir=str(tmp_path)) as m:
        st = MooncakeStore(NS_A, PB_A, **m.client_config(), global_segment_size=16 << 20, staging_bytes=1 << 20)
        try:
            assert all(st.batch_set([key(i) for i in range(3)], [page(i, PB_A) for i in range(3)]))
            addr = f"mooncake://{m.master_address}"
            rc, d = run_json(capsys, "store", "stats", addr, "--metrics-port", str(m.metrics_port))
            assert rc == EXIT_OK and d["pages"] == 3 and d["bytes"] == 3 * (64 + PB_A)
            assert d["capacity_bytes"] == 16 << 20
            r = tierkv("store", "verify", addr)
            assert r.returncode == EXIT_REFUSED and "cannot list" in one_line_error(r)
            assert main(["store", "clear", addr, "--namespace", NS_A.hex(), "--metadata-server",
                         m.metadata_server, "-q"]) == EXIT_OK
            assert "removed 3 objects" in capsys.readouterr().out
            assert st.batch_exists([key(0)]) == 0
        finally:
            st.close()


def test_a_loopback_port_nothing_listens_on_answers_at_once_with_the_default_timeout(capsys):
    """With the default --timeout (10 s), a refused loopback connect is reported at once, naming what to check."""
    for scheme, what in (("tcp", "'tierkv server'"), ("lmcache", "the LMCache server")):
        t0 = time.monotonic()
        assert main(["store", "stats", f"{scheme}://127.0.0.1:{_free_port()}"]) == EXIT_UNREACHABLE
        took = time.monotonic() - t0
        err = capsys.readouterr().err.strip()
        assert len(err.splitlines()) == 1, err
        assert f"cannot reach {what} at 127.0.0.1:" in err and "is it running there" in err, err
        assert took < 1.0, (scheme, took)   # was the whole 10 s of --timeout


# ----------------------------------------------------------------------------------------------- redis server
def test_redis_server_stats_count_pages_namespaces_ages_and_server_counters(tmp_path, capsys, monkeypatch):
    """A real redis-server (tests/storage/_redis_servers.py) written by RedisStore: 3 pages of NS_A, 2 of NS_B, one
    key of another application, one key under the prefix that is not a page; stats list exactly the pages, clear
    removes one namespace."""
    from tests.helpers.redis_servers import RedisServer

    from tierkv.storage_backends.redis import RedisStore

    monkeypatch.delenv("TIERKV_REDIS_PASSWORD", raising=False)
    srv = RedisServer(str(tmp_path / "redis"), args=("--maxmemory", "64mb", "--maxmemory-policy", "allkeys-lru"))
    try:
        a, b = RedisStore(NS_A, PB_A, url=srv.url), RedisStore(NS_B, PB_B, url=srv.url)
        assert a.batch_set([key(i) for i in range(3)], [page(i, PB_A) for i in range(3)]) == [True] * 3
        assert b.batch_set([key(i) for i in range(2)], [page(i, PB_B) for i in range(2)]) == [True] * 2
        a.close(), b.close()
        c = srv.client()
        c.set("someone-else:key", b"x")
        c.set(f"tierkv:{NS_A.hex()}:{key(9)}", b"not a page")   # a page name holding no tierkv header
        c.close()

        rc, d = run_json(capsys, "store", "stats", srv.url)
        assert rc == EXIT_OK, capsys.readouterr().err
        assert d["kind"] == "redis" and d["pages"] == 6 and d["bad_headers"] == 1
        assert d["bytes"] == 3 * (64 + PB_A) + 2 * (64 + PB_B) + len(b"not a page")
        assert d["capacity_bytes"] == 64 << 20
        sv = d["server"]
        assert (sv["dbsize"], sv["other_keys"], sv["foreign_keys"], sv["maxmemory_policy"]) == (7, 1, 0, "allkeys-lru")
        assert sv["evicted_keys"] == 0 and sv["used_memory"] > 0
        by_ns = {n["namespace"]: n for n in d["namespaces"]}
        a_ns, b_ns = by_ns[NS_A.hex()], by_ns[NS_B.hex()]
        assert (a_ns["pages"], a_ns["payload_bytes"], a_ns["versions"], a_ns["bad_headers"]) == (4, [PB_A], [1], 1)
        assert (b_ns["pages"], b_ns["payload_bytes"]) == (2, [PB_B])
        assert sum(b_ns["ages"]) == 2 and b_ns["ages"][0] == 2   # OBJECT IDLETIME: just written
        assert main(["store", "stats", srv.url, "-q"]) == EXIT_OK   # text form
        text = capsys.readouterr().out
        assert "(redis): 6 pages" in text and f"namespace {NS_B.hex()}: 2 pages" in text and "dbsize: 7" in text

        # another key prefix: nothing of tierkv's
        rc, d = run_json(capsys, "store", "stats", srv.url, "--key-prefix", "other")
        assert rc == EXIT_OK and d["pages"] == 0 and d["server"]["other_keys"] == 7

        assert main(["store", "clear", srv.url, "--namespace", NS_A.hex(), "-q"]) == EXIT_OK
        assert "removed 4 pages" in capsys.readouterr().out
        rc, d = run_json(capsys, "store", "stats", srv.url)
        assert d["pages"] == 2 and [n["namespace"] for n in d["namespaces"]] == [NS_B.hex()]
        r = tierkv("store", "verify", srv.url)
        assert r.returncode == EXIT_REFUSED and "verifies every redis page on read" in one_line_error(r)
    finally:
        srv.close()


def test_redis_bad_input_names_the_flag(tmp_path, capsys, monkeypatch):
    """A password-protected server without --password (5), a wrong key prefix or URL (2), a port nothing listens
    on (3): one line naming the flag or the address."""
    from tests.helpers.redis_servers import RedisServer, free_port

    monkeypatch.delenv("TIERKV_REDIS_PASSWORD", raising=False)
    srv = RedisServer(str(tmp_path / "redis"), password="s3cret")
    try:
        r = tierkv("store", "stats", srv.url, env={"TIERKV_REDIS_PASSWORD": ""})
        assert r.returncode == EXIT_REFUSED and "--password" in one_line_error(r)
        r = tierkv("store", "stats", srv.url, "--password", "wrong")
        assert r.returncode == EXIT_REFUSED and "--password" in one_line_error(r)
        assert "s3cret" not in r.stderr and "wrong" not in r.stderr.split("--password")[0]
        r, d = tierkv("store", "stats", srv.url, "--json", "-q", json_out=True, env={"TIERKV_REDIS_PASSWORD": "s3cret"})
        assert r.returncode == EXIT_OK and d["pages"] == 0, r.stderr
        r = tierkv("store", "stats", srv.url, "--password", "s3cret", "--key-prefix", "a:b")
        assert r.returncode == EXIT_USAGE and "--key-prefix" in one_line_error(r)
    finally:
        srv.close()
    r = tierkv("store", "stats", "redis://:pw@127.0.0.1:6379/0")
    assert r.returncode == EXIT_USAGE and "--password" in one_line_error(r)
    r = tierkv("store", "stats", "redis://127.0.0.1:6379/x")
    assert r.returncode == EXIT_USAGE and "redis://HOST:PORT/DB" in one_line_error(r)
    assert main(["store", "stats", f"redis://127.0.0.1:{free_port()}/0", "--timeout", "1"]) == EXIT_UNREACHABLE
    assert "cannot reach the redis server" in capsys.readouterr().err
