"""ZMQ cache server: entry points, loopback default, token, message bounds, several clients, spill, and fuzzing
(untrusted bytes on the socket never build objects, never crash or bloat the server)."""
from __future__ import annotations

import os
import pickle
import random
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import msgpack
import numpy as np
import pytest
import torch

from tests.helpers import fixtures_zmq as FZ
from tierkv.storage_backends.zmq import protocol as P
from tierkv import cli_server
from tierkv.storage_backends.zmq.client import ZmqStore

KiB, MiB = 1 << 10, 1 << 20
NS = bytes(range(100, 116))


def keys_of(n: int, salt: int = 0) -> list[str]:
    return [f"{salt:08x}{i:024x}" for i in range(n)]


def pages(n: int, page_bytes: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.frombuffer(rng.bytes(page_bytes), dtype=np.uint8).copy()) for _ in range(n)]


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    """One server for the tests that do not kill it (each test uses its own keys)."""
    with FZ.make_backend(tmp_path_factory.mktemp("zmqsrv"), 4096, NS) as h:
        yield h


def roundtrip_ok(h, salt: int) -> bool:
    """A valid store and read of one page on a fresh client."""
    c = h.new_client()
    k = keys_of(1, salt)
    src = pages(1, h.page_bytes, seed=salt)
    dst = [torch.zeros(h.page_bytes, dtype=torch.uint8)]
    ok = c.batch_set(k, src) == [True] and c.batch_get(k, dst) == [True] and torch.equal(dst[0], src[0])
    c.close()
    return ok


def req(**kw) -> dict:
    h = {"v": P.PROTOCOL_VERSION, "id": 77, "op": "ping", "keys": [], "ns": NS}
    h.update(kw)
    return h


def assert_error(rep, code: str):
    assert rep is not None, "expected an error reply, got none"
    r = FZ.decode_reply(rep)
    assert r["ok"] is False and r["code"] == code, r
    return r


# ----------------------------------------------------------------------------------------------- entry points
def test_default_bind_is_loopback(srv):
    assert cli_server.add_arguments(__import__("argparse").ArgumentParser()).parse_args([]).host == "127.0.0.1"
    assert srv.endpoint.startswith("tcp://127.0.0.1:")
    # the kernel's listening socket for that port is bound to 127.0.0.1 only (0100007F), not 0.0.0.0
    listen = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        f = line.split()
        addr, port = f[1].split(":")
        if int(port, 16) == srv.port and f[3] == "0A":  # 0A = LISTEN
            listen.append(addr)
    assert listen == ["0100007F"], listen


def test_cli_server_ping_sigterm_and_no_test_ops(tmp_path):
    """`tierkv server` (console script) prints its ready line, serves, refuses test ops unless enabled, and exits 0
    on SIGTERM."""
    exe = Path(sys.executable).parent / "tierkv"
    assert exe.exists(), "console script 'tierkv' is not installed (setup.py entry_points)"
    log = tmp_path / "cli.log"
    p = subprocess.Popen([str(exe), "server", "--port", "0", "--capacity-bytes", "8MiB", "--log-level", "info"],
                         stdout=subprocess.PIPE, stderr=open(log, "wb"), text=True)
    try:
        line = p.stdout.readline().strip()
        assert line.startswith("tierkv-server ready tcp://127.0.0.1:"), line
        ep = line.split()[-1]
        c = ZmqStore(NS, 4096, endpoint=ep, timeout_s=5.0)
        assert c.ping()
        assert c.server_stats()["capacity_bytes"] == 8 * MiB
        c.close()
        assert_error(FZ.raw_request(ep, req(op="t_corrupt", keys=keys_of(1), how="flip")), "unknown_op")
        p.send_signal(signal.SIGTERM)
        assert p.wait(timeout=30) == 0
        text = log.read_text()
        assert "stopped" in text
        if sys.platform.startswith("linux") and os.confstr("CS_GNU_LIBC_VERSION"):
            assert "malloc tuned True" in text  # glibc: freed page frames stay mapped for reuse
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        p.stdout.close()


def test_pipelined_set_splits_batch_into_messages_and_round_trips(srv, monkeypatch):
    """A set larger than PIPELINE_BYTES goes out as several messages (the next one checksummed while the previous
    one is in flight); every page lands exactly, in key order, and a page of the last message is not mixed up."""
    from tierkv.storage_backends.zmq import client as zmq_client

    monkeypatch.setattr(zmq_client, "PIPELINE_BYTES", 3 * 4096)  # 3 pages per message
    c = srv.new_client()
    ks = keys_of(10, salt=31)
    src = pages(10, 4096, 31)
    before = c.stats()["requests"]
    assert c.batch_set(ks, src) == [True] * 10
    assert c.stats()["requests"] - before == 4  # 3 + 3 + 3 + 1 pages
    dst = [torch.zeros(4096, dtype=torch.uint8) for _ in ks]
    assert c.batch_get(ks, dst) == [True] * 10
    assert all(torch.equal(d, s) for d, s in zip(dst, src))
    # non-uint8 and 2-D sources take the general path and store the same bytes
    f32 = [s.view(torch.float32).reshape(32, 32) for s in src[:2]]
    assert c.batch_set(ks[:2], f32) == [True] * 2
    assert c.batch_get(ks[:2], dst[:2]) == [True] * 2 and torch.equal(dst[0], src[0])


def test_reply_that_arrived_during_a_pause_is_an_answer_not_a_timeout(srv, monkeypatch):
    """The client thread is paused (a long GC, a stopped process) between sending and reading, for longer than
    ``timeout_s``, while the server answers: the reply waiting on the socket is used, no timeout is counted.
    The pause is made by a clock that, on its first reading after the send, waits until the reply is readable
    and then reads 100 s later."""
    import zmq
    from tierkv.storage_backends.zmq import channel as zmq_channel

    c = srv.new_client(timeout_s=0.5)
    ks, src = keys_of(2, salt=33), pages(2, 4096, 33)
    sent = []
    real_send = zmq.Socket.send_multipart

    def send_multipart(self, *a, **kw):
        out = real_send(self, *a, **kw)
        sent.append(self)
        return out

    real_clock = time.monotonic

    paused = []

    def clock():
        if sent and not paused:
            assert sent[0].poll(10_000, zmq.POLLIN)  # the reply is there: the "paused" thread has not read it
            paused.append(True)
        return real_clock() + (100.0 if paused else 0.0)

    monkeypatch.setattr(zmq.Socket, "send_multipart", send_multipart)
    monkeypatch.setattr(zmq_channel, "time", types.SimpleNamespace(monotonic=clock))  # the request channel's clock
    try:
        assert c.batch_set(ks, src) == [True, True]
    finally:
        monkeypatch.undo()
    assert c.stats()["timeouts"] == 0
    dst = [torch.zeros(4096, dtype=torch.uint8) for _ in ks]
    assert c.batch_get(ks, dst) == [True, True] and torch.equal(dst[1], src[1])


def test_set_with_checksums_is_split_by_max_message_bytes_only(srv, monkeypatch):
    """With the checksums given there is nothing to hash while a message is sent, so a set is not pipelined: it
    goes out in as few messages as ``max_message_bytes`` allows, every page exact."""
    from tierkv.storage_backends.zmq import client as zmq_client
    from tierkv.storage_backends.page_format import payload_checksum

    monkeypatch.setattr(zmq_client, "PIPELINE_BYTES", 3 * 4096)
    monkeypatch.setattr(zmq_client, "FIRST_MESSAGE_BYTES", 4096)
    c = srv.new_client()
    ks, src = keys_of(10, salt=32), pages(10, 4096, 32)
    sums = [payload_checksum(s.numpy()) for s in src]
    before = c.stats()["requests"]
    assert c.batch_set(ks, src, checksums=sums) == [True] * 10
    assert c.stats()["requests"] - before == 1
    small = ZmqStore(NS, 4096, endpoint=srv.endpoint, timeout_s=5.0, max_message_bytes=(64 << 10) + 4 * (4096 + 256))
    try:
        assert small.keys_per_message == 4
        k2 = keys_of(10, salt=33)
        assert small.batch_set(k2, src, checksums=sums) == [True] * 10
        assert small.stats()["requests"] == 3  # 4 + 4 + 2 pages
    finally:
        small.close()
    dst = [torch.zeros(4096, dtype=torch.uint8) for _ in ks]
    assert c.batch_get(ks, dst) == [True] * 10 and all(torch.equal(d, s) for d, s in zip(dst, src))
    assert c.batch_get(k2, dst) == [True] * 10 and all(torch.equal(d, s) for d, s in zip(dst, src))


def test_keep_freed_memory_applies_on_glibc():
    """The server's allocator tuning (run before the ZMQ context exists) reports success on glibc Linux."""
    code = "from tierkv.storage_backends.zmq.server import keep_freed_memory as k; print(k(64 << 20))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    glibc = sys.platform.startswith("linux") and bool(os.confstr("CS_GNU_LIBC_VERSION"))
    assert out.stdout.strip() == str(glibc)


def test_exists_leading_run_and_per_key(srv):
    c = srv.new_client()
    ks = keys_of(6, salt=1)
    assert c.batch_set([ks[0], ks[1], ks[3]], pages(3, 4096, 1)) == [True] * 3
    assert c.batch_exists(ks) == 2
    assert c.batch_exists(ks[3:4]) == 1 and c.batch_exists(ks[2:]) == 0
    r = FZ.decode_reply(FZ.raw_request(srv.endpoint, req(op="exists", keys=ks, all=True)))
    assert r["ok"] and r["lead"] == 2 and r["present"] == [True, True, False, True, False, False]
    assert c.batch_delete([ks[1], ks[2]]) == 1
    assert c.batch_exists(ks) == 1


def test_several_clients_concurrently(srv):
    """Four clients in four threads write and read their own pages and a shared set: every read is exact."""
    shared = keys_of(8, salt=2)
    shared_src = pages(8, 4096, 2)
    assert srv.backend.batch_set(shared, shared_src) == [True] * 8
    errors: list = []

    def work(t: int):
        try:
            c = srv.new_client()
            mine = keys_of(16, salt=100 + t)
            src = pages(16, 4096, 100 + t)
            for rnd in range(10):
                assert c.batch_set(mine, src) == [True] * 16
                dst = [torch.zeros(4096, dtype=torch.uint8) for _ in range(24)]
                assert c.batch_get(mine + shared, dst) == [True] * 24
                assert all(torch.equal(a, b) for a, b in zip(dst, src + shared_src))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    th = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in th:
        t.start()
    for t in th:
        t.join(timeout=120)
    assert not errors, errors
    # one client shared by several threads (the socket is locked)
    c = srv.new_client()
    th = [threading.Thread(target=lambda: [c.batch_exists(shared) for _ in range(50)]) for _ in range(3)]
    for t in th:
        t.start()
    for t in th:
        t.join(timeout=60)
    assert c.stats()["errors"] == 0 and c.stats()["timeouts"] == 0 and c.batch_exists(shared) == 8


# ----------------------------------------------------------------------------------------------- token, bounds
def test_token_and_message_bounds(tmp_path):
    """Clients without the token are refused; a message over --max-message-bytes gets an error reply; a single
    oversized frame drops that connection only; the client splits large batches under its bound."""
    pb = 256 * KiB
    with FZ.make_backend(tmp_path, pb, NS, token="s3cret", max_message_bytes=MiB, timeout_s=5.0) as h:
        ks = keys_of(16, salt=3)
        src = pages(16, pb, 3)
        good = h.backend
        assert good.batch_set(ks, src) == [True] * 16
        assert good.stats()["requests"] >= 4  # 16 x 256 KiB under a 1 MiB bound: several messages
        dst = [torch.zeros(pb, dtype=torch.uint8) for _ in ks]
        assert good.batch_get(ks, dst) == [True] * 16 and all(torch.equal(a, b) for a, b in zip(dst, src))

        for tok in (None, "wrong"):
            bad = ZmqStore(NS, pb, endpoint=h.endpoint, timeout_s=5.0, token=tok, max_message_bytes=MiB)
            d = [torch.full((pb,), 9, dtype=torch.uint8)]
            assert bad.batch_exists(ks) == 0
            assert bad.batch_get(ks[:1], d) == [False] and bool((d[0] == 9).all())
            assert bad.batch_set(keys_of(1, salt=4), src[:1]) == [False]
            assert bad.stats()["error_replies"] == 3 and bad.stats()["timeouts"] == 0
            bad.close()
        assert_error(FZ.raw_request(h.endpoint, req()), "auth")
        assert good.batch_exists(keys_of(1, salt=4)) == 0
        assert h.server_stats()["auth_failures"] >= 7

        # 3 frames of 400 KiB: 1.2 MiB in total, each frame under the bound -> error reply "too_large"
        big = req(op="set", keys=keys_of(3, salt=5), token="s3cret", hdrs=[b"h" * 64] * 3)
        assert_error(FZ.raw_request(h.endpoint, big, [bytes(400 * KiB)] * 3), "too_large")
        # one 2 MiB frame: ZMQ drops that connection (no reply), the server keeps serving others
        assert FZ.raw_request(h.endpoint, big, [bytes(2 * MiB)] * 3, timeout_s=1.0) is None
        assert good.batch_exists(keys_of(3, salt=5)) == 0
        assert good.batch_exists(ks) == 16
        with pytest.raises(ValueError, match="max_message_bytes"):
            ZmqStore(NS, 2 * MiB, endpoint=h.endpoint, max_message_bytes=MiB)


def test_bad_client_options_name_the_key():
    with pytest.raises(TypeError, match="timeout"):
        ZmqStore(NS, 4096, timeout=1.0)
    for kw, key in (({"timeout_s": 0}, "timeout_s"), ({"endpoint": "http://x"}, "endpoint"),
                    ({"reconnect_backoff_s": -1}, "reconnect_backoff_s"), ({"token": ""}, "token"),
                    ({"max_message_bytes": 10}, "max_message_bytes")):
        with pytest.raises(ValueError, match=key):
            ZmqStore(NS, 4096, **kw)
    with pytest.raises(ValueError):
        ZmqStore(b"short", 4096)


# ----------------------------------------------------------------------------------------------- spill
def test_spill_to_file_store(tmp_path):
    """Pages evicted from memory spill to a FileStore and come back on get; delete and clear reach the spill."""
    pb = 16 * KiB
    with FZ.make_backend(tmp_path, pb, NS, capacity_pages=4, spill_dir=str(tmp_path / "spill")) as h:
        c = h.backend
        ks = keys_of(12, salt=6)
        src = pages(12, pb, 6)
        assert c.batch_set(ks, src) == [True] * 12
        st = h.server_stats()
        assert st["keys"] == 4 and st["evictions"] == 8 and st["spilled"] == 8
        assert c.batch_exists(ks) == 12
        dst = [torch.zeros(pb, dtype=torch.uint8) for _ in ks]
        assert c.batch_get(ks, dst) == [True] * 12 and all(torch.equal(a, b) for a, b in zip(dst, src))
        # a spill hit is put back into memory (evicting the LRU page to the spill): reading the 8 spilled pages first
        # pushes the 4 memory pages out before they are read, so all 12 reads come from the spill
        assert h.server_stats()["spill_hits"] == 12
        assert c.batch_delete(ks[:1]) == 1 and c.batch_exists(ks) == 0 and c.batch_exists(ks[1:]) == 11
        c.clear()
        assert c.batch_exists(ks[1:]) == 0


# ----------------------------------------------------------------------------------------------- fuzz
class _Canary:
    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def test_hostile_frames_get_error_replies_and_service_continues(srv, tmp_path):
    canary = tmp_path / "canary"
    evil = pickle.dumps(_Canary(str(canary)))
    ep = srv.endpoint
    rss0 = FZ.rss_bytes(srv.pid)
    cases = [
        ("pickle as header", dict(raw_header=evil), "bad_header"),
        ("pickle inside a bin field", dict(header=req(op="get", keys=keys_of(1), ns=evil[:16])), None),
        ("ext type", dict(header={"v": 1, "id": 5, "op": "ping", "x": msgpack.ExtType(42, b"boom")}), "bad_header"),
        ("timestamp ext", dict(raw_header=b"\x82\xa1v\x01\xa2id\xd6\xff\x00\x00\x00\x01"), "bad_header"),
        ("bin declaring ~4 GiB then 10 bytes", dict(raw_header=b"\x81\xa1x\xc6\xff\xff\xff\xf0" + b"0123456789"),
         "bad_header"),
        ("str declaring ~4 GiB", dict(raw_header=b"\x81\xa1x\xdb\xff\xff\xff\xf0abc"), "bad_header"),
        ("array declaring 2^32-1 items", dict(raw_header=b"\x81\xa1x\xdd\xff\xff\xff\xff\x01"), "bad_header"),
        ("arrays nested 10,000 deep", dict(raw_header=b"\x91" * 10000 + b"\xc0"), "bad_header"),
        ("maps nested 10,000 deep", dict(raw_header=b"\x81\xa1k" * 10000 + b"\xc0"), "bad_header"),
        ("header is a list", dict(raw_header=msgpack.packb([1, 2, 3])), "bad_header"),
        ("trailing bytes", dict(raw_header=msgpack.packb(req()) + b"\x00"), "bad_header"),
        ("non-str map key", dict(raw_header=b"\x81\x01\x02"), "bad_header"),
        ("bad version", dict(header=req(v=99)), "version"),
        ("id is a string", dict(header=req(id="1")), "bad_request"),
        ("negative id", dict(header=req(id=-1)), "bad_request"),
        ("unknown op", dict(header=req(op="__import__")), "unknown_op"),
        ("keys not a list", dict(header=req(op="exists", keys="abc")), "bad_request"),
        ("path-like key", dict(header=req(op="get", keys=["../../../../etc/passwd"])), "bad_request"),
        ("uppercase key", dict(header=req(op="get", keys=["A" * 32])), "bad_request"),
        ("ns of wrong length", dict(header=req(op="get", keys=keys_of(1), ns=b"x")), "bad_request"),
        ("set: 2 keys, 1 payload frame", dict(header=req(op="set", keys=keys_of(2), hdrs=[b"h" * 64] * 2),
                                              payloads=[b"p" * 4096]), "bad_request"),
        ("set: 1 key, 3 payload frames", dict(header=req(op="set", keys=keys_of(1), hdrs=[b"h" * 64]),
                                              payloads=[b"p"] * 3), "bad_request"),
        ("set: hdrs count disagrees", dict(header=req(op="set", keys=keys_of(2), hdrs=[b"h" * 64]),
                                           payloads=[b"p", b"q"]), "bad_request"),
        ("set: hdr of wrong type", dict(header=req(op="set", keys=keys_of(1), hdrs=["h" * 64]),
                                        payloads=[b"p"]), "bad_request"),
        ("get with payload frames", dict(header=req(op="get", keys=keys_of(1)), payloads=[b"x"]), "bad_request"),
        ("bool as id", dict(header=req(id=True)), "bad_request"),
        ("id nested 900 deep", dict(raw_header=b"\x84\xa1v\x01\xa2op\xa4ping\xa4keys\x90\xa2id"
                                    + b"\x91" * 900 + b"\x01"), "bad_request"),
        ("version nested 900 deep", dict(raw_header=b"\x84\xa1v" + b"\x91" * 900 + b"\x01"
                                         + b"\xa2op\xa4ping\xa4keys\x90\xa2id\x01"), "version"),
        ("key nested 900 deep", dict(raw_header=b"\x84\xa1v\x01\xa2op\xa3get\xa2id\x01\xa4keys\x91"
                                     + b"\x91" * 900 + b"\x01"), "bad_request"),
    ]
    for i, (name, kw, code) in enumerate(cases):
        rep = FZ.raw_request(ep, kw.get("header"), kw.get("payloads", []), raw_header=kw.get("raw_header"))
        if code is None:  # well-formed: the bytes are a namespace digest like any other, never interpreted
            r = FZ.decode_reply(rep)
            assert r["ok"] is True and r["hits"] == [False], (name, r)
        else:
            r = assert_error(rep, code)
            assert isinstance(r["err"], str) and r["err"], name
        assert roundtrip_ok(srv, salt=1000 + i), f"service broken after: {name}"
    # a pickle stored as a page payload is stored opaquely and read back as a miss (no valid page header)
    k = keys_of(1, salt=7)
    st = FZ.raw_request(ep, req(op="set", keys=k, hdrs=[evil[:64]]), [evil + bytes(4096 - len(evil))])
    assert FZ.decode_reply(st)["stored"] == [True]
    d = [torch.zeros(4096, dtype=torch.uint8)]
    assert srv.new_client().batch_get(k, d) == [False] and not bool(d[0].any())
    # an empty header frame (e.g. a REQ-style empty delimiter) is refused
    assert_error(FZ.raw_request(ep, None, frames=[b"", msgpack.packb(req())]), "bad_header")
    assert roundtrip_ok(srv, salt=1999)
    assert not canary.exists(), "a pickle was executed"
    assert FZ.rss_bytes(srv.pid) - rss0 < 32 * MiB


def test_random_and_truncated_msgpack_fuzz(srv, tmp_path):
    """Random frames, truncated/mutated valid headers and random frame counts for a bounded time: the server
    answers or drops each, keeps serving, and its memory stays within a small bound."""
    import zmq

    rng = random.Random(1234)
    ep = srv.endpoint
    rss0 = FZ.rss_bytes(srv.pid)
    templates = [
        msgpack.packb(req(op=op, keys=keys_of(rng.randint(0, 4), salt=8), hdrs=[b"h" * 64] * 2, all=True))
        for op in ("ping", "exists", "get", "set", "delete", "stats", "clear")
    ]
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(ep)
    sent = replies = 0
    t_end = time.monotonic() + 5.0
    try:
        while time.monotonic() < t_end:
            kind = rng.randrange(4)
            if kind == 0:
                head = rng.randbytes(rng.randint(0, 200))
            elif kind == 1:
                t = rng.choice(templates)
                head = t[: rng.randint(0, len(t))]
            elif kind == 2:
                b = bytearray(rng.choice(templates))
                for _ in range(rng.randint(1, 4)):
                    b[rng.randrange(len(b))] = rng.randrange(256)
                head = bytes(b)
            else:
                head = bytes([rng.choice([0x91, 0x81, 0xdc, 0xde, 0xc4, 0xc5, 0xc6, 0xd4, 0xc7])]) + rng.randbytes(8)
            frames = [head] + [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.choice([0, 0, 1, 3]))]
            s.send_multipart(frames)
            sent += 1
            while s.poll(0, zmq.POLLIN):
                rep = s.recv_multipart()
                replies += 1
                r = msgpack.unpackb(rep[0], raw=False)
                assert isinstance(r, dict) and isinstance(r["ok"], bool)
        while s.poll(1000, zmq.POLLIN):
            s.recv_multipart()
            replies += 1
    finally:
        s.close(0)
    assert sent > 200 and replies > sent // 2, (sent, replies)
    assert roundtrip_ok(srv, salt=2000)
    st = srv.server_stats()
    assert st["errors"] > 0 and st["pending_writes"] == 0
    assert FZ.rss_bytes(srv.pid) - rss0 < 32 * MiB


def test_shipped_l3_zmq_config_builds_a_working_store(srv):
    """configs/l3_zmq.yaml validates, and the factory builds a ZmqStore from it (endpoint overridden)."""
    from tierkv.connector.core.config import load_config
    from tierkv.storage_backends.factory import build_backend

    cfg = load_config("l3_zmq.yaml", {"l3.zmq.endpoint": srv.endpoint})
    assert cfg.l3.backend == "zmq"
    st = build_backend(cfg.l3, NS, 4096)
    try:
        assert isinstance(st, ZmqStore) and st.endpoint == srv.endpoint and st.timeout_s == cfg.l3.zmq["timeout_s"]
        k, src = keys_of(1, salt=10), pages(1, 4096, 10)
        dst = [torch.zeros(4096, dtype=torch.uint8)]
        assert st.batch_set(k, src) == [True] and st.batch_get(k, dst) == [True] and torch.equal(dst[0], src[0])
    finally:
        st.close()


def test_test_op_corrupt_validates_how(srv):
    k = keys_of(1, salt=9)
    assert srv.backend.batch_set(k, pages(1, 4096, 9)) == [True]
    assert_error(FZ.raw_request(srv.endpoint, req(op="t_corrupt", keys=k, how="melt")), "bad_request")
    assert srv.corrupt(k[0], "flip")
    assert srv.backend.batch_get(k, [torch.zeros(4096, dtype=torch.uint8)]) == [False]


def test_cli_sizes_mean_what_the_yaml_configs_mean():
    """`tierkv server` parses sizes with the YAML configs' parser: GiB/MiB are 1024-based, GB/G 1000-based."""
    import argparse

    from tierkv import cli_server as S
    from tierkv.storage_backends.file.store import parse_bytes

    p = S.add_arguments(argparse.ArgumentParser())
    a = p.parse_args(["--capacity-bytes", "8GiB", "--max-message-bytes", "64MiB"])
    assert a.capacity_bytes == 8 << 30 == parse_bytes("8GiB") and a.max_message_bytes == 64 << 20
    assert p.parse_args(["--capacity-bytes", "8GB"]).capacity_bytes == 8 * 10**9 == parse_bytes("8GB")
    assert p.parse_args(["--capacity-bytes", "1073741824"]).capacity_bytes == 1 << 30
    for bad in (["--capacity-bytes", "lots"], ["--capacity-bytes", "0"], ["--max-message-bytes", "10"],
                ["--max-message-bytes", "1000KB"]):
        with pytest.raises(SystemExit):
            p.parse_args(bad)
    assert p.parse_args(["--max-message-bytes", "1MiB"]).max_message_bytes == 1 << 20
