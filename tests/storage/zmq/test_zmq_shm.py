"""The ZMQ store's shared-memory data path (docs/architecture.md, "L3 stores"), against a real
``tierkv server`` process: exact round trips through the client's ``/dev/shm`` segment, re-attach after a server
restart, a removed segment, a timed-out call, the token, refused slot offsets and names, fallback to frames,
threads of one client. The contract suite also runs with the path on (``tests/helpers/fixtures_zmq_shm.py``)."""
from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from tests.helpers import fixtures_zmq as FZ
from tierkv.storage_backends.zmq import client as zmq_client
from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.zmq import shm_path
from tierkv.storage_backends.common import ConfigError
from tierkv.storage_backends.shm_segment import Segment
from tierkv.storage_backends.zmq.client import ZmqStore, check_options

KiB = 1 << 10
NS = bytes(range(70, 86))
PB = 64 * KiB


def keys_of(n: int, salt: int = 0) -> list[str]:
    return [f"{salt:08x}{i:024x}" for i in range(n)]


def pages(n: int, seed: int, pb: int = PB) -> list[torch.Tensor]:
    rng = np.random.default_rng(seed)
    return [torch.from_numpy(np.frombuffer(rng.bytes(pb), dtype=np.uint8).copy()) for _ in range(n)]


def empties(n: int, pb: int = PB) -> list[torch.Tensor]:
    return [torch.zeros(pb, dtype=torch.uint8) for _ in range(n)]


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def shm_req(h, op: str, **fields) -> dict:
    """One hand-made v3 request (with the handle's token unless ``token`` is given) -> decoded reply."""
    hd = {"v": P.SHM_PROTOCOL_VERSION, "id": 7, "op": op, "keys": [], **fields}
    if h.token and "token" not in fields:
        hd["token"] = h.token
    rep = FZ.raw_request(h.endpoint, hd)
    assert rep is not None, f"no reply to {op}"
    return FZ.decode_reply(rep)


def test_round_trip_through_segment_in_rounds_and_removed_on_close(tmp_path):
    # a 4-page segment: a batch of 11 pages takes three rounds; the server sees no payload frames
    with FZ.make_backend(tmp_path, PB, NS, shm="auto", shm_bytes=4 * PB) as h:
        c = h.backend
        ks, src = keys_of(11), pages(11, 1)
        assert c.batch_set(ks, src) == [True] * 11
        dst = empties(12)
        assert c.batch_get(ks + keys_of(1, 9), dst) == [True] * 11 + [False]
        assert same(dst[:11], src) and not dst[11].any()
        st, sv = c.stats(), h.server_stats()
        assert st["shm"] == "attached" and st["shm_pages_out"] == 11 and st["shm_pages_in"] == 11
        assert sv["shm_bytes_in"] == 11 * PB and sv["shm_bytes_out"] == 11 * PB and sv["shm_segments"] == 1
        # a frames client (protocol v1, as before this path existed) reads the same pages
        old = h.new_client(shm="off")
        dst2 = empties(11)
        assert old.batch_get(ks, dst2) == [True] * 11 and same(dst2, src)
        assert old.stats()["shm_pages_in"] == 0
        path = c._seg.path
        assert os.path.exists(path) and oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert c._seg.name[len(P.SHM_PREFIX):][:8] == f"{os.getpid():08x}"
        c.close()
        assert not os.path.exists(path)  # the client removes its segment; the server only unmaps it
        assert old.server_stats()["shm_segments"] == 0


def test_restart_reattaches_and_removed_segment_is_recreated(tmp_path):
    with FZ.make_backend(tmp_path, PB, NS, shm="on", shm_bytes=8 * PB) as h:
        c = h.backend
        ks, src = keys_of(6), pages(6, 2)
        assert c.batch_set(ks, src) == [True] * 6
        # the segment file is removed under the running pair: both mappings stay valid, nothing changes
        first = c._seg.name
        os.unlink(c._seg.path)
        dst = empties(6)
        assert c.batch_get(ks, dst) == [True] * 6 and same(dst, src)
        # a restarted server does not hold the segment (shm_unknown) and cannot open the removed file: the
        # client makes a new segment and attaches it within the same call
        h.restart()
        assert c.batch_set(ks, src) == [True] * 6
        st = c.stats()
        assert st["shm_recreated"] == 1 and st["shm_attaches"] == 2 and st["shm_fallbacks"] == 0
        assert c._seg.name != first
        dst = empties(6)
        assert c.batch_get(ks, dst) == [True] * 6 and same(dst, src)
        # restart with the file in place: re-attached, the first call after it is served
        h.restart()
        assert c.batch_set(ks[:2], src[:2]) == [True, True]
        assert c.stats()["shm_attaches"] == 3


def test_timed_out_call_replaces_the_segment(tmp_path):
    with FZ.make_backend(tmp_path, PB, NS, shm="on", timeout_s=0.3, reconnect_backoff_s=0.0,
                         max_backoff_s=0.0) as h:
        c = h.backend
        ks, src = keys_of(3), pages(3, 3)
        assert c.batch_set(ks, src) == [True] * 3
        old = c._seg.path
        h.stop()
        try:
            assert c.batch_get(ks, empties(3)) == [False] * 3
        finally:
            h.cont()
        # the server may still copy into the old slots: they are never used again, and the file is gone
        assert c._seg is None and not os.path.exists(old)
        dst = empties(3)
        assert c.batch_get(ks, dst) == [True] * 3 and same(dst, src)
        assert c._seg.path != old and c.stats()["shm_attaches"] == 2


def test_token_is_required_to_attach(tmp_path):
    with FZ.make_backend(tmp_path, PB, NS, token="s3cret", shm="on") as h:
        c = h.backend
        ks, src = keys_of(2), pages(2, 4)
        assert c.batch_set(ks, src) == [True, True] and c.stats()["shm"] == "attached"
        r = shm_req(h, "shm_attach", name=c._seg.name, size=c._seg.size, token="wrong")
        assert not r["ok"] and r["code"] == "auth"
        r = shm_req(h, "get", ns=NS, keys=ks, shm=c._seg.name, len=PB, offs=[0, PB], token="wrong")
        assert not r["ok"] and r["code"] == "auth"
        bad = h.new_client(token="wrong", shm="on")
        assert bad.batch_get(ks, empties(2)) == [False, False]


def test_bad_slots_names_and_versions_are_refused(tmp_path):
    with FZ.make_backend(tmp_path, PB, NS, shm="on", shm_bytes=4 * PB) as h:
        c = h.backend
        ks, src = keys_of(2), pages(2, 5)
        assert c.batch_set(ks, src) == [True, True]
        name, size = c._seg.name, c._seg.size
        for offs in ([0, size - PB + 1], [-1, 0], [0, size], [0, "0"], [0]):
            r = shm_req(h, "get", ns=NS, keys=ks, shm=name, len=PB, offs=offs)
            assert not r["ok"] and r["code"] == "bad_request", (offs, r)
        r = shm_req(h, "set", ns=NS, keys=ks, shm=name, len=size + 1, offs=[0, 0], hdrs=[b"x", b"y"])
        assert not r["ok"] and r["code"] == "bad_request"
        for bad in ("../tierkv-shm-" + "a" * 16, "tierkv-shm-" + "a" * 15, "other-" + "a" * 20,
                    "tierkv-shm-" + "a" * 16 + "/x", 5):
            r = shm_req(h, "shm_attach", name=bad, size=PB)
            assert not r["ok"] and r["code"] == "bad_request", (bad, r)
        r = shm_req(h, "shm_attach", name="tierkv-shm-" + "0" * 24, size=PB)  # no such file
        assert not r["ok"] and r["code"] == "shm"
        r = shm_req(h, "shm_attach", name=name, size=size + 1)  # larger than the file
        assert not r["ok"] and r["code"] == "shm"
        r = shm_req(h, "get", ns=NS, keys=ks, shm="tierkv-shm-" + "1" * 24, len=PB, offs=[0, PB])
        assert not r["ok"] and r["code"] == "shm_unknown"
        r = shm_req(h, "get", ns=NS, keys=ks, shm=name, len=PB, offs=[0, PB], v=1)  # v1 with a segment
        assert not r["ok"] and r["code"] == "version"
        # the refusals changed nothing: the client still reads its pages through the segment
        dst = empties(2)
        assert c.batch_get(ks, dst) == [True, True] and same(dst, src)
        assert c.stats()["shm_pages_in"] == 2


def test_unusable_segment_falls_back_to_frames(tmp_path, monkeypatch, caplog):
    def no_shm(size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(shm_path, "_Segment", no_shm)  # a full /dev/shm cannot be produced on demand
    with FZ.make_backend(tmp_path, PB, NS, shm="on") as h:
        c = h.backend
        ks, src = keys_of(3), pages(3, 6)
        assert c.batch_set(ks, src) == [True] * 3
        dst = empties(3)
        assert c.batch_get(ks, dst) == [True] * 3 and same(dst, src)
        st = c.stats()
        assert st["shm"] == "off" and st["shm_fallbacks"] == 1 and st["shm_pages_out"] == 0
        assert "pages travel as ZMQ frames" in caplog.text


def test_a_segment_larger_than_shm_is_refused_at_creation():
    # the bytes are allocated up front: a /dev/shm too small (a container's) is ENOSPC at creation, not a SIGBUS at
    # the first write into a page the mapping could not get; nothing is left behind
    st = os.statvfs(P.SHM_DIR)
    name = f"{P.SHM_PREFIX}{os.getpid():08x}{'ef' * 8}"
    with pytest.raises(OSError):
        Segment.create(P.SHM_DIR, name, st.f_blocks * st.f_frsize + (1 << 30))
    assert not os.path.exists(os.path.join(P.SHM_DIR, name))


def test_segments_of_dead_processes_are_swept(tmp_path):
    # a SIGKILLed client leaves its file; the next client that makes a segment removes files of dead pids only
    dead = os.path.join(P.SHM_DIR, f"{P.SHM_PREFIX}7ffffff0{'ab' * 8}")  # above any pid_max
    alive = os.path.join(P.SHM_DIR, f"{P.SHM_PREFIX}{os.getpid():08x}{'cd' * 8}")
    for p in (dead, alive):
        open(p, "wb").close()
    try:
        with FZ.make_backend(tmp_path, PB, NS, shm="on") as h:
            assert h.backend.batch_set(keys_of(1), pages(1, 8)) == [True]
            assert not os.path.exists(dead) and os.path.exists(alive)
    finally:
        for p in (dead, alive):
            if os.path.exists(p):
                os.unlink(p)


def test_threads_of_one_client_never_share_slots(tmp_path):
    with FZ.make_backend(tmp_path, PB, NS, shm="on", shm_bytes=4 * PB) as h:
        c = h.backend
        errors: list = []

        def work(t: int) -> None:
            try:
                for r in range(4):
                    ks, src = keys_of(6, 100 * t + r), pages(6, 1000 * t + r)
                    assert c.batch_set(ks, src) == [True] * 6
                    dst = empties(6)
                    assert c.batch_get(ks, dst) == [True] * 6 and same(dst, src)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        ts = [threading.Thread(target=work, args=(t,)) for t in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert not errors, errors
        assert c.stats()["corrupt"] == 0 and c.stats()["shm_pages_in"] == 4 * 4 * 6


def test_shm_options_are_checked():
    assert zmq_client.OPTION_DEFAULTS["shm"] == "off"
    check_options({"shm": False})  # YAML reads `off` / `on` as booleans
    check_options({"shm": True, "shm_bytes": 1 << 20})
    with pytest.raises(ConfigError, match=r"l3\.zmq\.shm.*auto, on, off"):
        check_options({"shm": "yes"})
    with pytest.raises(ConfigError, match=r"l3\.zmq\.shm_bytes"):
        check_options({"shm_bytes": 1000}, page_bytes=4096)
    s = ZmqStore(NS, PB, endpoint="tcp://10.1.2.3:5557", shm="auto")  # not this host: frames
    s2 = ZmqStore(NS, PB, endpoint="ipc:///tmp/x.sock", shm="auto")
    try:
        assert s.stats()["shm"] == "off" and s2.stats()["shm"] == "ready"
    finally:
        s.close()
        s2.close()
