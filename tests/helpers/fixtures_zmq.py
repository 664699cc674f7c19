"""Contract-suite fixture for the ZMQ cache server and its client (convention: see ``conftest.py``).

``make_backend`` starts a real ``python -m tierkv.cli_server`` subprocess on loopback with
``--port 0`` (the port is read from its ready line, no sleeping), with ``--enable-test-ops`` so ``h.corrupt``
can damage a stored record in place, and kills it by PID on exit. Helpers for the ZMQ-specific tests:
:func:`start_server`, :func:`raw_request` (one hand-made request on a fresh DEALER socket), :func:`rss_bytes`.
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import selectors
import signal
import subprocess
import sys
import time
from typing import Any, Optional

import msgpack
import zmq

from tests.helpers.sigstop import sigstop
from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.page_format import HEADER_BYTES
from tierkv.storage_backends.zmq.client import ZmqStore

NAME = "zmq"
#: client timeout used by the fixture unless ``timeout_s`` is given (generous: the test machine is shared).
DEFAULT_TIMEOUT_S = 3.0
READY_TIMEOUT_S = 120.0
_LIVE: dict[int, subprocess.Popen] = {}


def _kill_all_at_exit() -> None:  # last resort if a test process dies without running its finally blocks
    for p in list(_LIVE.values()):
        _stop_proc(p)


atexit.register(_kill_all_at_exit)


def _stop_proc(p: subprocess.Popen) -> None:
    if p.poll() is None:
        try:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            p.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        if p.poll() is None:
            p.kill()
            p.wait()
    _LIVE.pop(p.pid, None)
    if p.stdout:
        p.stdout.close()


def start_server(port: int = 0, *, log_path: Optional[str] = None, test_ops: bool = True,
                 args: tuple = ()) -> tuple[subprocess.Popen, str]:
    """Start a server subprocess (``--port port``, ``--host 127.0.0.1`` unless ``args`` override it) and wait for
    its ready line. Returns ``(process, endpoint)``. Raises RuntimeError (with its log) if it exits first."""
    cmd = [sys.executable, "-m", "tierkv.cli_server", "--port", str(port), *map(str, args)]
    if test_ops:
        cmd.append("--enable-test-ops")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=log, stdin=subprocess.DEVNULL)
    finally:
        if log_path:
            log.close()
    _LIVE[p.pid] = p
    sel = selectors.DefaultSelector()
    sel.register(p.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + READY_TIMEOUT_S
    buf = b""
    try:
        while b"\n" not in buf:
            left = deadline - time.monotonic()
            if left <= 0 or not sel.select(left):
                raise RuntimeError(f"zmq server gave no ready line within {READY_TIMEOUT_S}s")
            chunk = os.read(p.stdout.fileno(), 4096)
            if not chunk:
                raise RuntimeError(f"zmq server exited (rc={p.wait()}) before its ready line; log: {log_path}\n"
                                   + (open(log_path).read()[-3000:] if log_path else ""))
            buf += chunk
    except BaseException:
        _stop_proc(p)
        raise
    finally:
        sel.close()
    line = buf.split(b"\n", 1)[0].decode()
    if not line.startswith("tierkv-server ready tcp://"):
        _stop_proc(p)
        raise RuntimeError(f"unexpected ready line {line!r}")
    return p, line.split()[-1]


def raw_request(endpoint: str, header: Any, payloads: list = (), *, timeout_s: float = 5.0,
                raw_header: Optional[bytes] = None, frames: Optional[list] = None) -> Optional[list]:
    """Send one hand-made request on a fresh DEALER socket and return the reply frames (bytes), or None on
    timeout. ``header`` is msgpack-encoded unless ``raw_header`` is given; ``frames`` replaces the whole message."""
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        if frames is None:
            head = raw_header if raw_header is not None else msgpack.packb(header, use_bin_type=True)
            frames = [head, *payloads]
        s.send_multipart(frames, copy=True)
        if not s.poll(int(timeout_s * 1000), zmq.POLLIN):
            return None
        return s.recv_multipart()
    finally:
        s.close(0)


def decode_reply(frames: list) -> dict:
    return msgpack.unpackb(frames[0], raw=False)


def rss_bytes(pid: int) -> int:
    """Resident set size of process ``pid`` in bytes (from /proc)."""
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


class ZmqHandle:
    """A server subprocess plus clients on it (see ``conftest.py`` for the attributes' meaning)."""

    name = NAME
    supports_stop = True
    persistent = False  # restart() brings back an empty server

    def __init__(self, tmp_path, page_bytes: int, namespace: bytes, capacity_pages: Optional[int] = None,
                 capacity_bytes: Optional[int] = None, token: Optional[str] = None,
                 max_message_bytes: Optional[int] = None, spill_dir: Optional[str] = None,
                 server_args: tuple = (), **opts: Any):
        self.tmp_path = str(tmp_path)
        self.page_bytes = page_bytes
        self.namespace = namespace
        if capacity_pages is not None:
            capacity_bytes = capacity_pages * (HEADER_BYTES + page_bytes)
        self.capacity_bytes = capacity_bytes
        self.capacity_pages = capacity_bytes // (HEADER_BYTES + page_bytes) if capacity_bytes else None
        self.token = token
        args = list(server_args)
        if capacity_bytes:
            args += ["--capacity-bytes", str(capacity_bytes)]
        if token:
            args += ["--token", token]
        if max_message_bytes:
            args += ["--max-message-bytes", str(max_message_bytes)]
        if spill_dir:
            args += ["--spill-dir", str(spill_dir)]
        self._server_args = tuple(args)
        self.log_path = os.path.join(self.tmp_path, "server.log")
        client_keys = ("timeout_s", "reconnect_backoff_s", "max_backoff_s", "shm", "shm_bytes")
        self._client_opts = {k: v for k, v in opts.items() if k in client_keys}
        self._client_opts.setdefault("timeout_s", DEFAULT_TIMEOUT_S)
        if max_message_bytes:
            self._client_opts["max_message_bytes"] = max_message_bytes
        if token:
            self._client_opts["token"] = token
        self._clients: list[ZmqStore] = []
        self.proc, self.endpoint = start_server(0, log_path=self.log_path, args=self._server_args)
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.backend = self.new_client()

    @property
    def pid(self) -> int:
        return self.proc.pid

    def new_client(self, namespace: Optional[bytes] = None, **overrides: Any) -> ZmqStore:
        """Another ZmqStore on this server (same options unless overridden)."""
        c = ZmqStore(namespace or self.namespace, self.page_bytes, endpoint=self.endpoint,
                     **{**self._client_opts, **overrides})
        self._clients.append(c)
        return c

    def client_factory(self, namespace: Optional[bytes] = None):
        """A picklable zero-argument callable building a client (for spawned processes)."""
        return functools.partial(ZmqStore, namespace or self.namespace, self.page_bytes, endpoint=self.endpoint,
                                 **self._client_opts)

    def kill9(self) -> None:
        """SIGKILL the server and reap it."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        _stop_proc(self.proc)

    def start(self) -> None:
        """Start an empty server on the same port (after :meth:`kill9`)."""
        last: Optional[Exception] = None
        for _ in range(20):  # the port is normally free at once; retry briefly if the kernel still holds it
            try:
                self.proc, ep = start_server(self.port, log_path=self.log_path, args=self._server_args)
                assert ep == self.endpoint, (ep, self.endpoint)
                return
            except RuntimeError as e:
                last = e
                time.sleep(0.2)
        raise RuntimeError(f"could not restart the zmq server on port {self.port}: {last}")

    def restart(self) -> ZmqStore:
        """kill -9 the server and start an empty one on the same port; the clients reconnect by themselves."""
        self.kill9()
        self.start()
        return self.backend

    def stop(self) -> None:
        """SIGSTOP the server and return once all its threads are stopped (a hung server)."""
        sigstop(self.proc.pid)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def corrupt(self, key: str, how: str, namespace: Optional[bytes] = None) -> bool:
        """Damage the stored record of ``key`` in the server's memory (test-only op): ``truncate`` (payload cut to
        half), ``flip`` (one payload byte), ``foreign_namespace`` (a valid header of another namespace).
        False if there is no such record."""
        h = {"v": P.PROTOCOL_VERSION, "id": 1, "op": "t_corrupt", "keys": [key], "how": how,
             "ns": namespace or self.namespace}
        if self.token:
            h["token"] = self.token
        rep = raw_request(self.endpoint, h)
        if rep is None:
            raise RuntimeError("zmq server did not answer t_corrupt")
        r = decode_reply(rep)
        if not r.get("ok"):
            raise RuntimeError(f"t_corrupt refused: {r}")
        return r["corrupted"] == 1

    def server_stats(self) -> dict:
        st = self.backend.server_stats()
        if st is None:
            raise RuntimeError("zmq server did not answer stats")
        return st

    def close(self) -> None:
        for c in self._clients:
            c.close()
        _stop_proc(self.proc)


@contextlib.contextmanager
def make_backend(tmp_path, page_bytes: int, namespace: bytes, **opts: Any):
    """Yield a :class:`ZmqHandle`: a server subprocess on loopback (port picked by the server) and a ZmqStore on it.

    Options: ``capacity_pages`` or ``capacity_bytes`` (server memory capacity), ``token``, ``max_message_bytes``,
    ``spill_dir``, ``server_args`` (extra server flags), and client options ``timeout_s``
    (default :data:`DEFAULT_TIMEOUT_S`), ``reconnect_backoff_s``, ``max_backoff_s``, ``shm``, ``shm_bytes``; others
    are ignored."""
    h = ZmqHandle(tmp_path, page_bytes, namespace, **opts)
    try:
        yield h
    finally:
        h.close()


__all__ = ["make_backend", "ZmqHandle", "start_server", "raw_request", "decode_reply", "rss_bytes"]
