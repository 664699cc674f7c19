"""tierkv's tiers in vLLM's KV events: a live OpenAI server with ``--kv-events-config`` (ZMQ publisher connecting to
a subscriber bound on loopback) and a file L3; the subscriber decodes every batch with vLLM's own classes
(``KVEventBatch``, msgpack) as a router would.

Workload (one server, requests one at a time, each ``DOC`` plus its own 10-token question, 4 tokens generated, so
each request fills exactly its document's full pages; L2 holds 8 pages):

1. ``A`` (5 pages): vLLM announces its 5 blocks in L1 (``GPU``); tierkv announces the same block hashes, parents and
   tokens in L2 (``CPU``) and, once the store acknowledged the write-through, in L3 (``STORAGE``, ``L3:file``).
2. ``B`` (6 pages): L2 needs room, so A's L2 copies go: a removal for L2 (``CPU``) of every A block, none for L3.
3. ``POST /reset_prefix_cache?reset_external=true``, then ``A`` again: the pages found in L3 by the existence query
   are announced in L3 again and, fetched back, in L2.
"""
import json
import os
import random
import signal
import subprocess
import sys
import time

import msgspec
import pytest
import requests
import zmq
from vllm.distributed.kv_events import BlockRemoved, BlockStored, KVEventBatch

from tests.helpers.engine import DEFAULT_ENV, TIERKV_CONNECTOR, TIERKV_MODULE
from tests.helpers.servers import unused_loopback_ports

P = 32
STARTUP_S = 600
EVENT_WAIT_S = 60


class Subscriber:
    """A ZMQ SUB socket bound on 127.0.0.1 that the engine's publisher connects to; decodes vLLM's batches."""

    def __init__(self, port: int):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.sock.bind(f"tcp://127.0.0.1:{port}")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.events: list = []

    def pump(self):
        """Take what arrived, without waiting. libzmq attaches a new connection to a socket (and sends the
        subscription to the publisher) only inside a call on that socket, so this runs while the engine starts:
        without it the publisher drops the first batches for lack of a subscriber."""
        while self.sock.poll(0):
            self._recv()

    def _recv(self):
        _topic, _seq, payload = self.sock.recv_multipart()
        self.events.extend(self.decoder.decode(payload).events)

    def until(self, pred, what: str):
        """Receive batches until ``pred(self.events)`` holds (each receive waits at most the time left)."""
        deadline = time.monotonic() + EVENT_WAIT_S
        while not pred(self.events):
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(int(left * 1000)):
                raise AssertionError(f"no {what} within {EVENT_WAIT_S} s; got {self.events}")
            self._recv()

    def close(self):
        self.sock.close(linger=0)
        self.ctx.term()


def stored_hashes(events, medium, ownership=None):
    return [h for e in events if isinstance(e, BlockStored) and e.medium == medium
            and (ownership is None or e.ownership == ownership) for h in e.block_hashes]


def removed_hashes(events, medium):
    return [h for e in events if isinstance(e, BlockRemoved) and e.medium == medium for h in e.block_hashes]


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kv_events")
    port, ev_port = unused_loopback_ports(2)
    sub = Subscriber(ev_port)
    kv = {"kv_connector": TIERKV_CONNECTOR, "kv_connector_module_path": TIERKV_MODULE, "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute",
          "kv_connector_extra_config": {
              "host_pool": {"num_pages": 8},
              "l3": {"backend": "file", "file": {"root": str(tmp / "l3")}},
              "controller": {"write_policy": "write_through", "prefetch_policy": "wait_complete"}}}
    events_cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://127.0.0.1:{ev_port}"}
    env = dict(os.environ, **DEFAULT_ENV, VLLM_SERVER_DEV_MODE="1")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", tiny_model, "--host", "127.0.0.1",
           "--port", str(port), "--block-size", str(P), "--enable-prefix-caching", "--enforce-eager",
           "--dtype", "bfloat16", "--max-model-len", "256", "--max-num-batched-tokens", "256",
           "--num-gpu-blocks-override", "24", "--max-num-seqs", "2",
           "--seed", "0", "--kv-transfer-config", json.dumps(kv), "--kv-events-config", json.dumps(events_cfg)]
    log_path = tmp / "server.log"
    log = open(log_path, "wb")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(tmp), start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_S
        while True:  # readiness: the server answers /health (polled while the engine starts)
            sub.pump()
            if proc.poll() is not None:
                raise RuntimeError(f"API server exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if requests.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except requests.ConnectionError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"API server not ready after {STARTUP_S} s:\n{log_path.read_text()[-4000:]}")
            time.sleep(0.25)
        yield base, tiny_model, sub
    finally:
        try:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=60)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        log.close()
        sub.close()


def _complete(base, model, prompt):
    r = requests.post(f"{base}/v1/completions", timeout=300, json={
        "model": model, "prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True})
    r.raise_for_status()


def test_a_document_is_announced_in_l1_l2_l3_and_its_l2_eviction_in_l2_only(server):
    base, model, sub = server
    rng = random.Random(21)
    doc_a = [rng.randrange(10, 1000) for _ in range(5 * P)]
    doc_b = [rng.randrange(10, 1000) for _ in range(6 * P)]

    def question():
        return [rng.randrange(10, 1000) for _ in range(10)]

    # 1. A: L1 (vLLM's own), L2 and L3 (tierkv), the same block hashes
    _complete(base, model, doc_a + question())
    sub.until(lambda ev: len(stored_hashes(ev, "STORAGE")) >= 5, "L3 store of A")
    l1 = [e for e in sub.events if isinstance(e, BlockStored) and e.medium == "GPU"]
    a_blocks = {}  # block hash -> (parent, tokens) of A's blocks as vLLM announced them in L1
    for e in l1:
        parent = e.parent_block_hash
        for i, h in enumerate(e.block_hashes):
            a_blocks[h] = (parent, e.token_ids[i * P:(i + 1) * P])
            parent = h
    a_hashes = [h for h, (_p, t) in a_blocks.items() if t in [doc_a[i * P:(i + 1) * P] for i in range(5)]]
    assert len(a_hashes) == 5
    for medium, owner in (("CPU", None), ("STORAGE", "L3:file")):
        ours = [e for e in sub.events if isinstance(e, BlockStored) and e.medium == medium]
        assert stored_hashes(ours, medium) == a_hashes, medium
        assert all(e.block_size == P and e.ownership == owner and e.group_idx == 0 for e in ours)
        assert {e.kv_cache_spec_kind for e in ours} == {e.kv_cache_spec_kind for e in l1} == {"full_attention"}
        parent = None
        for e in ours:  # same parents and tokens as vLLM's L1 events for these blocks
            assert e.parent_block_hash == a_blocks[e.block_hashes[0]][0]
            for i, h in enumerate(e.block_hashes):
                assert a_blocks[h][1] == e.token_ids[i * P:(i + 1) * P]
            parent = e.block_hashes[-1]
        assert parent == a_hashes[-1]
    assert not removed_hashes(sub.events, "CPU") and not removed_hashes(sub.events, "STORAGE")

    # 2. B needs L2 room: A's L2 copies go (removed from L2 only; L3 keeps them)
    n = len(sub.events)
    _complete(base, model, doc_b + question())
    sub.until(lambda ev: set(a_hashes) <= set(removed_hashes(ev[n:], "CPU")), "L2 removal of A")
    sub.until(lambda ev: len(stored_hashes(ev[n:], "STORAGE")) >= 6, "L3 store of B")
    assert not removed_hashes(sub.events, "STORAGE")

    # 3. reset L1 and tierkv's index, then A again: found in L3 (announced again) and fetched back into L2
    r = requests.post(f"{base}/reset_prefix_cache", params={"reset_external": "true"}, timeout=60)
    r.raise_for_status()
    n = len(sub.events)
    _complete(base, model, doc_a + question())
    sub.until(lambda ev: set(a_hashes) <= set(stored_hashes(ev[n:], "CPU")), "L2 store of A fetched from L3")
    assert stored_hashes(sub.events[n:], "STORAGE", "L3:file") == a_hashes
    assert not removed_hashes(sub.events, "STORAGE")
