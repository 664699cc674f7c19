"""The tierkv server's presence table (``storage_backends/zmq/presence_table.py``): a same-host client answers ``exists``
from it without a round trip, and the answer follows the server's sets, deletes and evictions, a replaced table, a
killed or restarted server and a server that cannot publish one (a spill tier). Real server processes; the table
itself also alone."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch

from tests.helpers import fixtures_zmq as FZ
from tierkv.storage_backends.zmq import presence_table as PT
from tierkv.storage_backends.zmq.presence_table import PresenceTable
from tierkv.storage_backends.zmq.server import sweep_dead_presence

KiB = 1 << 10
NS = bytes(range(90, 106))
PB = 16 * KiB


def keys_of(n: int, salt: int = 0) -> list[str]:
    return [f"{salt:08x}{i:024x}" for i in range(n)]


def pages(n: int, pb: int = PB) -> list[torch.Tensor]:
    rng = np.random.default_rng(n)
    return [torch.from_numpy(np.frombuffer(rng.bytes(pb), dtype=np.uint8).copy()) for _ in range(n)]


def server_requests(h) -> int:
    return int(h.server_stats()["requests"]) - 1  # (the stats request itself)


def test_table_entries_removed_slots_fullness_and_retirement(tmp_path):
    w = PresenceTable.create(str(tmp_path), min_slots=8)
    r = PresenceTable.open(os.path.join(tmp_path, w.name))
    assert w.slots == r.slots == 8
    for fp in range(8, 14):  # slots 0..5, in order
        assert w.add(fp)
    assert r.lead([8, 9, 10, 11]) == 4 and r.lead([9, 99]) == 1 and r.lead([99, 8]) == 0
    assert not w.full() and w.live() == 6
    assert w.discard(10) and not w.discard(10) and w.live() == 5
    assert r.lead([8, 9, 10]) == 2
    assert r.lead([11, 12, 13]) == 3  # probes pass the removed slot
    # 18 probes from slot 2 (removed): it takes that slot, no new slot used; 22 would need a 7th of 8 slots
    assert w.add(18) and r.lead([18]) == 1 and not w.full()
    assert not w.add(22) and r.lead([22]) == 0
    assert w.add(18)  # present already: nothing changes
    with pytest.raises(TypeError):  # the reader's mapping is read-only
        r._w[PT.HEADER_WORDS] = 5
    w.retire()
    assert r.lead([8]) is None and not os.path.exists(os.path.join(tmp_path, w.name))
    r.close()


def test_a_table_built_in_bulk_finds_colliding_and_repeated_entries(tmp_path):
    same_home = [64 * i for i in range(1, 6)]  # 8 entries given -> 64 slots: each of these five has home slot 0
    w = PresenceTable.create(str(tmp_path), same_home + same_home[:2] + [65], min_slots=8)
    assert w.slots == 64 and w.live() == 6  # repeats count once
    assert sorted(w.entries().tolist()) == sorted(same_home + [65])
    r = PresenceTable.open(os.path.join(tmp_path, w.name))
    assert r.lead(same_home + [65]) == 6 and r.lead([128, 64 * 7]) == 1
    assert w.discard(64) and r.lead(same_home[1:]) == 4  # the probe passes the removed home slot
    rng = np.random.default_rng(1)
    many = rng.integers(2, 1 << 62, 20000, dtype=np.uint64)
    big = PresenceTable.create(str(tmp_path), np.append(many, w.entries()))
    assert big.live() == 20005 and big.slots == 1 << 17
    rb = PresenceTable.open(os.path.join(tmp_path, big.name))
    assert rb.lead([int(x) for x in many]) == 20000 and rb.lead(same_home[1:] + [64]) == 4
    for t in (r, rb):
        t.close()
    w.retire()
    big.retire()


def test_table_of_a_killed_writer_is_not_answered_from_and_is_swept(tmp_path):
    code = ("import sys; from tierkv.storage_backends.zmq.presence_table import PresenceTable as T; "
            "t = T.create(sys.argv[1]); t.add(12345); print(t.name, flush=True); sys.stdin.read()")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp_path)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    try:
        name = p.stdout.readline().strip()
        r = PresenceTable.open(os.path.join(tmp_path, name))
        assert r.lead([12345, 7]) == 1
        assert sweep_dead_presence(str(tmp_path)) == 0  # its writer lives
        p.send_signal(signal.SIGKILL)
        os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped: a zombie that kill(pid, 0) passes
        assert r.lead([12345]) is None  # never retired, but its writer is gone
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert r.lead([12345]) is None
    assert sweep_dead_presence(str(tmp_path)) == 1 and not os.path.exists(os.path.join(tmp_path, name))
    r.close()
    other = tmp_path / f"{PT.PRESENCE_PREFIX}{'0' * 24}"
    other.write_bytes(bytes(8 * (PT.HEADER_WORDS + 8)))
    with pytest.raises(ValueError, match="not a presence table"):
        PresenceTable.open(str(other))


def test_exists_is_answered_from_the_table_and_follows_sets_deletes_and_evictions(tmp_path):
    with FZ.make_backend(tmp_path, PB, NS, shm="on", capacity_pages=8) as h:
        c, plain = h.backend, h.new_client(shm="off")
        ks = keys_of(6)
        assert plain.batch_set(ks, pages(6)) == [True] * 6 and plain.batch_exists(ks) == 6
        assert h.server_stats()["presence"] is None  # no client asked for a table: none made
        assert c.batch_exists(ks) == 6  # the first call asks for the table (a ping, which makes it), then probes it
        assert h.server_stats()["presence"] is not None
        before = server_requests(h)
        assert c.batch_exists(ks) == 6 and c.batch_exists(ks[:3] + keys_of(1, 9)) == 3
        assert c.batch_exists(keys_of(2, 9)) == 0
        assert server_requests(h) == before + 1  # only the stats request between: no exists reached the server
        st = c.stats()
        assert st["presence"] == "mapped" and st["presence_answers"] == 4 and st["presence_tables"] == 1
        assert c.batch_delete([ks[2]]) == 1
        assert c.batch_exists(ks) == 2 == plain.batch_exists(ks)
        new = keys_of(6, 1)  # 6 more of 8: the 4 oldest are evicted
        assert c.batch_set(new, pages(6)) == [True] * 6
        for probe in (ks, ks[4:], new, new[:3] + ks[:1]):
            assert c.batch_exists(probe) == plain.batch_exists(probe)
        assert c.batch_exists(ks[4:]) == 2 and c.batch_exists(ks) == 0 and c.batch_exists(new) == 6
        assert plain.stats()["presence_answers"] == 0 and plain.stats()["presence"] == "off"


def test_a_full_table_is_replaced_and_clients_follow_the_new_one(tmp_path):
    pb = 4 * KiB
    with FZ.make_backend(tmp_path, pb, NS, shm="on", capacity_pages=4000) as h:
        c = h.backend
        ks = keys_of(3500)  # more than 3/4 of the first table's 4,096 slots
        assert c.batch_exists(ks[:1]) == 0  # makes and maps the first table
        first = h.server_stats()["presence"]
        for s in range(0, 3500, 500):
            assert all(c.batch_set(ks[s:s + 500], pages(500, pb)))
        st = h.server_stats()
        assert st["presence"] != first and st["presence_slots"] > 4096 and st["presence_tables"] >= 2
        assert not os.path.exists(os.path.join("/dev/shm", first))
        assert c.batch_exists(ks) == 3500  # the retired table sends the client to the new one
        assert c.stats()["presence_tables"] == 2 and c.stats()["presence_answers"] == 2


def test_a_killed_or_restarted_server_is_never_answered_from_its_old_table(tmp_path):
    with FZ.make_backend(tmp_path, PB, NS, shm="on", timeout_s=0.5, reconnect_backoff_s=0.0) as h:
        c = h.backend
        ks = keys_of(4)
        assert c.batch_set(ks, pages(4)) == [True] * 4 and c.batch_exists(ks) == 4
        old = h.server_stats()["presence"]
        h.kill9()
        assert c.batch_exists(ks) == 0  # the table's writer is gone; the server does not answer either
        h.start()  # an empty server: a table of its own, the dead one's file swept
        assert c.batch_exists(ks) == 0
        assert c.stats()["presence"] == "mapped" and not os.path.exists(os.path.join("/dev/shm", old))
        assert c.batch_set(ks, pages(4)) == [True] * 4 and c.batch_exists(ks) == 4


def test_a_server_with_a_spill_tier_publishes_no_table_and_is_asked(tmp_path):
    with FZ.make_backend(tmp_path, PB, NS, shm="on", capacity_pages=2, spill_dir=str(tmp_path / "spill")) as h:
        c = h.backend
        ks = keys_of(4)
        assert c.batch_set(ks, pages(4)) == [True] * 4  # two in memory, two spilled
        assert h.server_stats()["presence"] is None
        assert c.batch_exists(ks) == 4 and c.batch_exists(keys_of(1, 5)) == 0
        assert c.stats()["presence_answers"] == 0 and c.stats()["presence"] == "off"


def test_close_never_deadlocks_with_a_call_asking_for_the_table(tmp_path):
    # a batch_exists that holds the table's lock may be waiting for the request lock (its ping); close must not
    # hold the request lock while it waits for the table's lock
    import threading

    with FZ.make_backend(tmp_path, PB, NS, shm="on") as h:
        c = h.new_client()
        c._presence_lock.acquire()  # where a batch_exists would be before its ping
        closer = threading.Thread(target=c.close, daemon=True)
        closer.start()
        closer.join(0.3)  # close now waits for the table's lock
        got = c._lock.acquire(timeout=5)  # what that ping does next: with close holding it, a deadlock
        if got:
            c._lock.release()
        c._presence_lock.release()
        closer.join(5)
        assert got, "close held the request lock while it waited for the table's lock"
        assert not closer.is_alive() and c.stats()["presence"] == "off"
