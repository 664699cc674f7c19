"""ZMQ L3 faults: a server killed, restarted or stopped; half, stale and malformed replies; a writer killed in the
middle of a put; against the real server or a hand-written fake one."""
from __future__ import annotations

import json
import socket
import struct
import subprocess
import sys
import threading
import time
from typing import Callable, Optional

import msgpack
import numpy as np
import pytest
import torch
import zmq

from tests.helpers import fixtures_zmq as FZ
from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.page_format import encode_header
from tierkv.storage_backends.zmq.client import ZmqStore

KiB, MiB = 1 << 10, 1 << 20
NS = bytes(range(50, 66))
T = 0.5          # client timeout in these tests (seconds)
MARGIN = 0.75    # allowed lateness on a busy 2-core machine (seconds)


def keys_of(n: int, salt: int = 0) -> list[str]:
    return [f"{salt:08x}{i:024x}" for i in range(n)]


def pages(n: int, page_bytes: int, seed: int) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.frombuffer(rng.bytes(page_bytes), dtype=np.uint8).copy()) for _ in range(n)]


def filled(n: int, page_bytes: int, v: int = 7) -> list[torch.Tensor]:
    return [torch.full((page_bytes,), v, dtype=torch.uint8) for _ in range(n)]


def untouched(ts, v: int = 7) -> bool:
    return all(bool((t == v).all()) for t in ts)


def timed(fn: Callable, *a):
    t0 = time.monotonic()
    r = fn(*a)
    return r, time.monotonic() - t0


# ------------------------------------------------------------------------------------------ dead or stopped real server
def test_kill9_then_restart_on_same_port(tmp_path):
    with FZ.make_backend(tmp_path, 4096, NS, timeout_s=T) as h:
        c = h.backend
        ks, src = keys_of(4, 1), pages(4, 4096, 1)
        assert c.batch_set(ks, src) == [True] * 4
        dst = filled(4, 4096, 0)
        assert c.batch_get(ks, dst) == [True] * 4 and all(torch.equal(a, b) for a, b in zip(dst, src))

        h.kill9()
        n, dt = timed(c.batch_exists, ks)
        assert n == 0 and dt < T + MARGIN, dt
        dst = filled(4, 4096)
        r, dt = timed(c.batch_get, ks, dst)
        assert r == [False] * 4 and dt < T + MARGIN and untouched(dst), dt
        r, dt = timed(c.batch_set, keys_of(4, 2), pages(4, 4096, 2))
        assert r == [False] * 4 and dt < T + MARGIN, dt
        st = c.stats()
        assert st["timeouts"] >= 1 and st["pending"] == 0

        h.start()  # empty server on the same port; the same client object reconnects by itself
        ks2, src2 = keys_of(4, 3), pages(4, 4096, 3)
        for attempt in range(3):
            if c.batch_set(ks2, src2) == [True] * 4:
                break
            time.sleep(c.max_backoff_s)  # a call that lands in a back-off window fails at once; then it retries
        else:
            pytest.fail(f"no reconnection after restart: {c.stats()}")
        dst = filled(4, 4096, 0)
        assert c.batch_get(ks2, dst) == [True] * 4 and all(torch.equal(a, b) for a, b in zip(dst, src2))
        assert c.batch_exists(ks) == 0  # the restarted server is empty
        assert c.stats()["reconnects"] >= 1


def test_sigstop_calls_time_out_and_pending_stays_bounded(tmp_path):
    with FZ.make_backend(tmp_path, 4096, NS, timeout_s=T) as h:
        c = h.backend
        ks, src = keys_of(4, 4), pages(4, 4096, 4)
        assert c.batch_set(ks, src) == [True] * 4
        h.stop()
        try:
            for i in range(8):
                dst = filled(4, 4096)
                if i % 3 == 0:
                    r, dt = timed(c.batch_exists, ks)
                    assert r == 0
                elif i % 3 == 1:
                    r, dt = timed(c.batch_get, ks, dst)
                    assert r == [False] * 4 and untouched(dst)
                else:
                    r, dt = timed(c.batch_set, keys_of(2, 5), pages(2, 4096, 5))
                    assert r == [False] * 2
                assert dt < T + MARGIN, (i, dt)
                st = c.stats()
                assert st["pending"] == 0 and st["max_pending"] <= 1, st
            st = c.stats()
            assert st["timeouts"] >= 2 and st["timeouts"] + st["fast_fails"] >= 8
        finally:
            h.cont()
        deadline = time.monotonic() + 10
        dst = filled(4, 4096, 0)
        while c.batch_get(ks, dst) != [True] * 4:
            assert time.monotonic() < deadline, c.stats()
            time.sleep(0.05)
        assert all(torch.equal(a, b) for a, b in zip(dst, src))


# ---------------------------------------------------------------------- half, stale and malformed replies (fake server)
class FakeServer:
    """A ROUTER on loopback answering each request with ``behave(n, ident, header, frames, sock)``."""

    def __init__(self, behave: Callable, port: int = 0):
        self.behave = behave
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port or '*'}")
        self.endpoint = self.sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.requests: list[dict] = []
        self.errors: list = []
        self._stop = threading.Event()
        self.th = threading.Thread(target=self._run, daemon=True)
        self.th.start()

    def _run(self):
        try:
            while not self._stop.is_set():
                if not self.sock.poll(50, zmq.POLLIN):
                    continue
                ident, head, *frames = self.sock.recv_multipart()
                h = msgpack.unpackb(head, raw=False)
                self.requests.append(h)
                if self.behave(len(self.requests) - 1, ident, h, frames, self.sock) == "stop":
                    return
        except Exception as e:  # noqa: BLE001 - surfaced by close()
            self.errors.append(e)

    def close(self):
        self._stop.set()
        self.th.join(timeout=10)
        self.sock.close(0)
        self.ctx.term()
        assert not self.errors, self.errors


def rep(h: dict, **body) -> bytes:
    return msgpack.packb({"v": 1, "id": h["id"], "op": h["op"], "ok": True, **body}, use_bin_type=True)


@pytest.fixture
def fake():
    made = []

    def make(behave, **kw):
        f = FakeServer(behave, **kw)
        made.append(f)
        return f

    yield make
    for f in made:
        f.close()


def test_stale_reply_for_an_older_request_is_never_applied(fake):
    """Request 1 is left unanswered (the client times out); request 2 for the *same key* is answered first with
    request 1's id and an old but valid page, then with its own id and the new page: the client returns the new
    page. With only the stale reply, request 3 is a miss and its destination is untouched."""
    k = keys_of(1, 6)
    old, new = pages(2, 4096, 6)
    rec = {n: (encode_header(k[0], NS, p.numpy()), p.numpy().tobytes()) for n, p in (("old", old), ("new", new))}

    def behave(n, ident, h, frames, sock):
        if n == 0:
            return  # silence: the client times out
        first = fake_srv.requests[0]
        sock.send_multipart([ident, rep(first, hits=[True], hdrs=[rec["old"][0]]), rec["old"][1]])
        if n == 1:
            sock.send_multipart([ident, rep(h, hits=[True], hdrs=[rec["new"][0]]), rec["new"][1]])

    fake_srv = fake(behave)
    c = ZmqStore(NS, 4096, endpoint=fake_srv.endpoint, timeout_s=T, reconnect_backoff_s=0)
    try:
        dst = filled(1, 4096)
        r, dt = timed(c.batch_get, k, dst)
        assert r == [False] and untouched(dst) and dt < T + MARGIN
        dst = filled(1, 4096)
        assert c.batch_get(k, dst) == [True] and torch.equal(dst[0], new)
        assert c.stats()["stale_replies"] == 1
        dst = filled(1, 4096)
        r, dt = timed(c.batch_get, k, dst)
        assert r == [False] and untouched(dst) and dt < T + MARGIN
        assert c.stats()["stale_replies"] == 2
        assert len({q["id"] for q in fake_srv.requests}) == 3  # every request had its own id
    finally:
        c.close()


def test_half_reply_then_server_gone_then_back(fake):
    """The server sends the first frame of a reply and closes: ZMQ never delivers the partial message, the call is a
    miss within the timeout; a server back on the same port is used again without recreating the client."""
    k, p = keys_of(1, 7), pages(1, 4096, 7)[0].numpy()
    hdr = encode_header(k[0], NS, p)

    def half(n, ident, h, frames, sock):
        sock.send(ident, zmq.SNDMORE)
        sock.send(rep(h, hits=[True], hdrs=[hdr]), zmq.SNDMORE)  # the payload frame never follows
        sock.close(0)
        return "stop"  # ends this fake's loop

    f1 = fake(half)
    port = int(f1.endpoint.rsplit(":", 1)[1])
    c = ZmqStore(NS, 4096, endpoint=f1.endpoint, timeout_s=T, reconnect_backoff_s=0)
    try:
        dst = filled(1, 4096)
        r, dt = timed(c.batch_get, k, dst)
        assert r == [False] and untouched(dst) and dt < T + MARGIN
        f1._stop.set()
        f1.th.join(timeout=5)
        f1.errors.clear()

        def good(n, ident, h, frames, sock):
            sock.send_multipart([ident, rep(h, hits=[True], hdrs=[hdr]), p.tobytes()])

        fake(good, port=port)
        dst = filled(1, 4096)
        assert c.batch_get(k, dst) == [True] and bool((dst[0].numpy() == p).all())
    finally:
        c.close()


def _one_page(salt: int):
    k = keys_of(2, salt)
    ps = [p.numpy() for p in pages(2, 4096, salt)]
    return k, ps, [encode_header(kk, NS, pp) for kk, pp in zip(k, ps)]


BAD_GET_REPLIES = {
    # name: reply frames built from (request header, keys, payloads, page headers)
    "header is a list": lambda h, k, p, hd: [msgpack.packb([h["id"], True])],
    "header is garbage": lambda h, k, p, hd: [b"\xc1\xc1\xc1"],
    "header is a pickle": lambda h, k, p, hd: [b"\x80\x04\x95" + bytes(20)],
    "ext type in header": lambda h, k, p, hd: [msgpack.packb({"id": h["id"], "x": msgpack.ExtType(3, b"z")})],
    "ok is a string": lambda h, k, p, hd: [msgpack.packb({"v": 1, "id": h["id"], "op": "get", "ok": "yes"})],
    "wrong op echoed": lambda h, k, p, hd: [rep({**h, "op": "set"}, stored=[True, True])],
    "wrong version": lambda h, k, p, hd: [msgpack.packb({"v": 9, "id": h["id"], "op": "get", "ok": True,
                                                         "hits": [True, True], "hdrs": hd}), *p],
    "hits is an int": lambda h, k, p, hd: [rep(h, hits=2, hdrs=hd), *p],
    "hits of ints": lambda h, k, p, hd: [rep(h, hits=[1, 1], hdrs=hd), *p],
    "hits too short": lambda h, k, p, hd: [rep(h, hits=[True], hdrs=hd[:1]), p[0]],
    "fewer frames than hits": lambda h, k, p, hd: [rep(h, hits=[True, True], hdrs=hd), p[0]],
    "more frames than hits": lambda h, k, p, hd: [rep(h, hits=[True, False], hdrs=hd[:1]), p[0], p[1]],
    "hdrs of str": lambda h, k, p, hd: [rep(h, hits=[True, True], hdrs=["x", "y"]), *p],
    "pages swapped between keys": lambda h, k, p, hd: [rep(h, hits=[True, True], hdrs=[hd[1], hd[0]]), p[1], p[0]],
    "payload truncated": lambda h, k, p, hd: [rep(h, hits=[True, True], hdrs=hd), p[0][:100], p[1][:4095]],
    "payload of another page": lambda h, k, p, hd: [rep(h, hits=[True, True], hdrs=hd), p[1], p[0]],
    "error reply": lambda h, k, p, hd: [msgpack.packb({"v": 1, "id": h["id"], "op": "get", "ok": False,
                                                       "code": "x", "err": "nope"})],
}


@pytest.mark.parametrize("name", list(BAD_GET_REPLIES))
def test_malformed_get_replies_are_misses(fake, name):
    """A fake server answers a get of two keys with a malformed reply: both are misses, destinations untouched,
    nothing raised, within the timeout; the next (good) reply on the same client is applied."""
    k, ps, hd = _one_page(8)
    build = BAD_GET_REPLIES[name]

    def behave(n, ident, h, frames, sock):
        out = build(h, k, ps, hd) if n == 0 else [rep(h, hits=[True, True], hdrs=hd), *ps]
        sock.send_multipart([ident, *[bytes(memoryview(x)) for x in out]])

    f = fake(behave)
    c = ZmqStore(NS, 4096, endpoint=f.endpoint, timeout_s=T, reconnect_backoff_s=0)
    try:
        dst = filled(2, 4096)
        r, dt = timed(c.batch_get, k, dst)
        assert r == [False, False] and untouched(dst) and dt < T + MARGIN, (r, dt)
        st = c.stats()
        assert st["bad_replies"] + st["corrupt"] + st["error_replies"] + st["timeouts"] >= 1, st
        dst = filled(2, 4096)
        assert c.batch_get(k, dst) == [True, True]
        assert all(bool((d.numpy() == p).all()) for d, p in zip(dst, ps))
    finally:
        c.close()


@pytest.mark.parametrize("body", [dict(lead=3), dict(lead="2"), dict(lead=-1), dict(present=[True]), dict(lead=True)])
def test_malformed_exists_replies_are_zero(fake, body):
    f = fake(lambda n, ident, h, frames, sock: sock.send_multipart([ident, rep(h, **body)]))
    c = ZmqStore(NS, 4096, endpoint=f.endpoint, timeout_s=T)
    try:
        r, dt = timed(c.batch_exists, keys_of(2, 9))
        assert r == 0 and dt < T + MARGIN and c.stats()["bad_replies"] == 1
    finally:
        c.close()


@pytest.mark.parametrize("body", [dict(stored=[True]), dict(stored="yes"), dict(stored=[1, 1]), dict()])
def test_malformed_set_replies_are_failures(fake, body):
    f = fake(lambda n, ident, h, frames, sock: sock.send_multipart([ident, rep(h, **body)]))
    c = ZmqStore(NS, 4096, endpoint=f.endpoint, timeout_s=T)
    try:
        r, dt = timed(c.batch_set, keys_of(2, 10), pages(2, 4096, 10))
        assert r == [False, False] and dt < T + MARGIN and c.stats()["set_failures"] == 2
    finally:
        c.close()


def test_oversized_reply_frame_is_dropped(fake):
    """A reply frame over the client's max_message_bytes makes ZMQ drop the connection: a miss, not a 100 MiB read."""
    k, ps, hd = _one_page(11)
    f = fake(lambda n, ident, h, frames, sock: sock.send_multipart([ident, rep(h, hits=[True, True], hdrs=hd),
                                                                     bytes(4 * MiB), ps[1]]))
    c = ZmqStore(NS, 4096, endpoint=f.endpoint, timeout_s=T, max_message_bytes=MiB)
    try:
        dst = filled(2, 4096)
        r, dt = timed(c.batch_get, k, dst)
        assert r == [False, False] and untouched(dst) and dt < T + MARGIN
    finally:
        c.close()


# ----------------------------------------------------------------------------------------------- writer killed mid-put
def _recv_exact(s: socket.socket, n: int) -> bytes:
    b = b""
    while len(b) < n:
        chunk = s.recv(n - len(b))
        if not chunk:
            raise ConnectionError("peer closed")
        b += chunk
    return b


def zmtp_connect(port: int) -> socket.socket:
    """A plain TCP socket that has done the ZMTP 3.0 NULL handshake as a DEALER (RFC 23), so the test controls
    exactly which bytes of a message reach the server."""
    s = socket.create_connection(("127.0.0.1", port), timeout=10)
    s.sendall(b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31)
    g = _recv_exact(s, 64)
    assert g[0] == 0xFF and g[9] == 0x7F and g[10] == 3, g[:12]
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", 6) + b"DEALER"
    s.sendall(bytes([0x04, len(body)]) + body)
    flags = _recv_exact(s, 1)[0]  # the server's READY command
    size = struct.unpack(">Q", _recv_exact(s, 8))[0] if flags & 0x02 else _recv_exact(s, 1)[0]
    assert flags & 0x04 and _recv_exact(s, size).startswith(b"\x05READY")
    return s


def zmtp_frame(body: bytes, more: bool, declared: Optional[int] = None) -> bytes:
    n = len(body) if declared is None else declared
    return bytes([int(more) | 0x02]) + struct.pack(">Q", n) + body


def zmtp_read_message(s: socket.socket) -> list[bytes]:
    out = []
    while True:
        flags = _recv_exact(s, 1)[0]
        size = struct.unpack(">Q", _recv_exact(s, 8))[0] if flags & 0x02 else _recv_exact(s, 1)[0]
        out.append(_recv_exact(s, size))
        if not flags & 0x01:
            return out


def abort(s: socket.socket) -> None:
    """Close with RST, as the kernel does for a killed process with unsent data."""
    s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    s.close()


def test_writer_dies_mid_put_raw_zmtp(tmp_path):
    """200 writers each send a set's header frame and part of its 1 MiB payload frame, then vanish (RST). The key is
    never visible; B's exists/get of it are immediate misses; B's put of it then reads back B's bytes; the server has
    no pending write and its memory does not grow. A frame declaring ~4 GiB is refused without allocating it."""
    pb = MiB
    with FZ.make_backend(tmp_path, pb, NS, capacity_bytes=64 * MiB, timeout_s=5.0) as h:
        # the raw ZMTP client is a real client: a complete ping gets an answer
        s = zmtp_connect(h.port)
        s.sendall(zmtp_frame(P.pack({"v": 1, "id": 5, "op": "ping", "keys": []}), more=False))
        r = msgpack.unpackb(zmtp_read_message(s)[0], raw=False)
        assert r["ok"] and r["id"] == 5
        abort(s)

        b = h.new_client()
        rng = np.random.default_rng(15)
        payload = rng.bytes(pb)
        rss0 = FZ.rss_bytes(h.pid)
        ks = keys_of(200, 15)
        for i, k in enumerate(ks):
            s = zmtp_connect(h.port)
            head = P.pack({"v": 1, "id": i + 1, "op": "set", "ns": NS, "keys": [k],
                           "hdrs": [encode_header(k, NS, payload)]})
            cut = int(rng.integers(0, pb))
            s.sendall(zmtp_frame(head, more=True) + zmtp_frame(payload[:cut], more=False, declared=pb))
            abort(s)
            if i % 20 == 0:
                (n, dt) = timed(b.batch_exists, [k])
                assert n == 0 and dt < 1.0
                d = filled(1, pb)
                assert b.batch_get([k], d) == [False] and untouched(d)
                mine = pages(1, pb, i)
                assert b.batch_set([k], mine) == [True]
                d = filled(1, pb)
                assert b.batch_get([k], d) == [True] and torch.equal(d[0], mine[0])
        assert b.batch_exists(ks[1:20]) == 0 and b.batch_exists(ks[-19:]) == 0
        st = h.server_stats()
        assert st["pending_writes"] == 0 and st["keys"] == 10 and st["sets"] == 10
        # a frame declaring ~4 GiB followed by 10 bytes: refused by the size bound (connection dropped), no allocation
        s = zmtp_connect(h.port)
        s.sendall(zmtp_frame(b"0123456789", more=False, declared=(4 << 30) - 16))
        s.settimeout(10)
        try:
            assert s.recv(1) == b""  # the server closed the connection
        except ConnectionResetError:
            pass
        s.close()
        assert b.ping()
        assert FZ.rss_bytes(h.pid) - rss0 < 10 * MiB + 48 * MiB  # B's 10 pages + allocator slack


_SPAWNER = r"""
import json, os, random, signal, sys, time
import msgpack, zmq
from tierkv.storage_backends.zmq.client import ZmqStore
ep, spec = sys.argv[1], json.load(open(sys.argv[2]))
rnd = random.Random(spec["seed"])
probe = ZmqStore(bytes.fromhex(spec["ns"]), spec["page_bytes"], endpoint=ep, timeout_s=5.0)
out = []
for i, (key, hdr_hex) in enumerate(spec["items"]):
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # writer A: one set of one big page, then wait to be killed
        os.close(rfd)
        ctx = zmq.Context()
        s = ctx.socket(zmq.DEALER)
        s.connect(ep)
        payload = bytes.fromhex(key) * (spec["page_bytes"] // 16)
        head = msgpack.packb({"v": 1, "id": i + 1, "op": "set", "ns": bytes.fromhex(spec["ns"]), "keys": [key],
                              "hdrs": [bytes.fromhex(hdr_hex)]}, use_bin_type=True)
        s.poll(5000, zmq.POLLOUT)
        os.write(wfd, b"1")  # about to send
        s.send_multipart([head, payload], copy=False)
        time.sleep(60)
        os._exit(0)
    os.close(wfd)
    os.read(rfd, 1)
    os.close(rfd)
    when = ("now", "random", "stored")[i % 3]
    if when == "random":
        time.sleep(rnd.uniform(0, spec["max_delay_s"]))
    elif when == "stored":  # let the put complete: the server holds the page before the writer dies
        deadline = time.monotonic() + 60
        while probe.batch_exists([key]) == 0 and time.monotonic() < deadline:
            time.sleep(0.005)
    os.kill(pid, signal.SIGSTOP)  # freeze the writer, then look at the server: was its put still in flight?
    visible = probe.batch_exists([key]) == 1
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)
    # at once after the kill (later writers' pages may evict it): absent, or the writer's complete page
    dst = bytearray(spec["page_bytes"])
    got = probe.batch_get([key], [dst]) == [True]
    exact = got and bytes(dst) == bytes.fromhex(key) * (spec["page_bytes"] // 16)
    out.append({"key": key, "when": when, "visible_before_kill": visible, "present_after": got, "exact": exact})
probe.close()
print(json.dumps(out), flush=True)
"""


def test_writer_process_sigkilled_mid_put(tmp_path):
    """Writer processes are SIGKILLed while sending a 16 MiB set: at once after they start sending, at a random
    moment, or after the server stored the page. Before each kill (the writer frozen by SIGSTOP) the test records
    whether the server already holds the page: some did and some did not, so kills really hit puts in flight. Then
    each key is either absent or the writer's complete page (checked byte for byte; a page visible before the kill
    must be there), B can overwrite it and reads B's bytes, and the server ends with no pending write."""
    pb, n = 16 * MiB, 24
    with FZ.make_backend(tmp_path, pb, NS, capacity_bytes=128 * MiB, timeout_s=5.0) as h:
        ks = keys_of(n, 16)
        items = [(k, encode_header(k, NS, bytes.fromhex(k) * (pb // 16)).hex()) for k in ks]
        spec = tmp_path / "spec.json"
        spec.write_text(json.dumps({"items": items, "page_bytes": pb, "ns": NS.hex(), "seed": 16,
                                    "max_delay_s": 0.03}))
        script = tmp_path / "spawner.py"
        script.write_text(_SPAWNER)
        r = subprocess.run([sys.executable, str(script), h.endpoint, str(spec)], capture_output=True, text=True,
                           timeout=300)
        assert r.returncode == 0, r.stderr
        kills = json.loads(r.stdout.strip().splitlines()[-1])
        assert [k["key"] for k in kills] == ks
        visible = [k["visible_before_kill"] for k in kills]
        # every "stored" kill came after the put; at least one kill came while a put was still in flight
        assert all(v for k, v in zip(kills, visible) if k["when"] == "stored")
        assert 0 < sum(visible) < n, visible
        for k in kills:  # as each killed writer left its key: absent, or its complete page; a stored page stays
            assert k["exact"] == k["present_after"], k
            assert k["present_after"] or not k["visible_before_kill"], k
        present = sum(k["present_after"] for k in kills)
        b = h.new_client()
        for k in ks:  # now (128 MiB hold 8 of the 16 MiB pages): absent, or complete and exact
            d = filled(1, pb)
            if b.batch_get([k], d) == [True]:
                assert d[0].numpy().tobytes() == bytes.fromhex(k) * (pb // 16)
            else:
                assert untouched(d) and b.batch_exists([k]) == 0
        for i, k in enumerate(ks):  # then B claims every key
            mine = pages(1, pb, i)
            assert b.batch_set([k], mine) == [True]
            d = filled(1, pb)
            assert b.batch_get([k], d) == [True] and torch.equal(d[0], mine[0])
        st = h.server_stats()
        assert st["pending_writes"] == 0 and st["errors"] == 0
        assert b.stats()["corrupt"] == 0
        by_when = {w: [k["visible_before_kill"] for k in kills if k["when"] == w] for w in ("now", "random")}
        print(f"writer killed mid-put: stored before the kill {sum(visible)}/{n} "
              f"(now {sum(by_when['now'])}/{len(by_when['now'])}, "
              f"random {sum(by_when['random'])}/{len(by_when['random'])}); present after {present}; server {st}")


def test_corrupt_pages_are_logged_rate_limited(tmp_path, caplog):
    """Pages that fail verification are counted one by one but logged at most once per kind and period (a whole
    batch of bad pages is one warning line, docs/architecture.md, "Configuration and observability")."""
    import logging

    with FZ.make_backend(tmp_path, 4096, NS, timeout_s=5.0) as h:
        ks = keys_of(6, salt=91)
        assert h.backend.batch_set(ks, pages(6, 4096, seed=5)) == [True] * 6
        assert all(h.corrupt(k, "flip") for k in ks)
        with caplog.at_level(logging.WARNING, logger="tierkv.zmq_client"):
            assert h.backend.batch_get(ks, filled(6, 4096)) == [False] * 6
            assert h.backend.batch_get(ks, filled(6, 4096)) == [False] * 6
        assert h.backend.stats()["corrupt"] == 12
        assert len([r for r in caplog.records if "is not valid" in r.getMessage()]) == 1
