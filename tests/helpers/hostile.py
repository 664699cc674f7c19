"""Helpers of the hostile-client tests (importable by spawned children): the well-behaved engine whose latency is
measured in a process of its own (so the attacker's Python never competes with it for a GIL), and raw ZMTP bytes."""
from __future__ import annotations

import socket
import struct
import time

import numpy as np

PB = 64 << 10
N_PAGES = 16
NS = bytes(range(60, 76))


def keys() -> list[str]:
    return [f"{0xfeed:08x}{i:024x}" for i in range(N_PAGES)]


def page(i: int) -> np.ndarray:
    return np.frombuffer(np.random.default_rng(9000 + i).bytes(PB), dtype=np.uint8)


def probe(endpoint: str, token, started, stop, out, max_s: float) -> None:
    """Read 4 of the preloaded pages per call (checking every byte) until ``stop`` is set or ``max_s`` passed; set
    ``started`` after the first call; put ``[(time.time() at the start, latency s, good)]`` (wall clock: the
    test process's monotonic clock is shifted by the test-suite) on ``out``."""
    import torch

    from tierkv.storage_backends.zmq.client import ZmqStore

    c = ZmqStore(NS, PB, endpoint=endpoint, token=token, timeout_s=10.0)
    ks = keys()
    want = [torch.from_numpy(page(i).copy()) for i in range(N_PAGES)]
    samples = []
    t_end = time.monotonic() + max_s
    i = 0
    try:
        while not stop.is_set() and time.monotonic() < t_end:
            sel = [(i + j) % N_PAGES for j in range(4)]
            dst = [torch.zeros(PB, dtype=torch.uint8) for _ in sel]
            t0, m0 = time.time(), time.perf_counter()
            hits = c.batch_get([ks[j] for j in sel], dst)
            dt = time.perf_counter() - m0
            samples.append((t0, dt, all(hits) and all(torch.equal(d, want[j]) for d, j in zip(dst, sel))))
            started.set()
            i += 1
    finally:
        c.close()
    out.put(samples)


def greeting() -> bytes:
    """A ZMTP 3.0 greeting of a NULL-mechanism client."""
    return b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def ready(socket_type: bytes = b"DEALER") -> bytes:
    body = b"\x05READY" + b"\x0bSocket-Type" + struct.pack(">I", len(socket_type)) + socket_type
    return b"\x04" + bytes([len(body)]) + body


def long_frame_header(length: int) -> bytes:
    """The header of a single message frame claiming ``length`` bytes (ZMTP long frame)."""
    return b"\x02" + struct.pack(">Q", length)


def raw_connect(port: int, timeout_s: float = 5.0) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout_s)
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return s


def closed_by_peer(s: socket.socket, timeout_s: float) -> bool:
    """True once the server has closed ``s`` (reads until EOF, within ``timeout_s``)."""
    s.settimeout(timeout_s)
    t_end = time.monotonic() + timeout_s
    try:
        while time.monotonic() < t_end:
            if not s.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False
    return False


def crash_writer(factory, keys: list, writer_id: int, page_bytes: int, progress, max_rounds: int) -> None:
    """Write every key round after round (pages tagged as in ``_contract_workers``) until killed; ``progress[id]`` =
    rounds completed."""
    from tests.helpers.contract_workers import page as tagged

    store = factory()
    for r in range(max_rounds):
        store.batch_set(keys, [np.frombuffer(tagged(writer_id, r, i, page_bytes), dtype=np.uint8)
                               for i in range(len(keys))])
        progress[writer_id] = r + 1
