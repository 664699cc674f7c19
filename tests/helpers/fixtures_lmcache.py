"""Contract-suite fixture for the ``lmcache`` store on a REAL LMCache 0.5.6 multiprocess cache server (convention: see
``conftest.py``).

The server runs from its own venv (``benchmarks/peers/.lmcache-venv``, built by
``benchmarks/peers/setup_lmcache_venv.sh``, which ``.ci/setup_env.sh`` calls; override with ``TIERKV_LMCACHE_PYTHON``)
on loopback (one server per chunk size is shared by the tests of a session, each handle in a key space of its own:
a unique ``model_name`` label; ``private=True`` gives a test its own server): ``--host 127.0.0.1``, engine-driven transfer through a shared-memory segment of its own name, usage
reporting off (``LMCACHE_TRACK_USAGE=false``, ``DO_NOT_TRACK=1``) and ``--disable-observability`` (its Prometheus
exporter would listen on 0.0.0.0, whatever port it is given). It is ready when it answers a ``noop`` (polled, no
sleeping) and is stopped by PID.

Not exercised through this fixture: capacity/LRU (LMCache evicts by its own L1 policy) and the ``truncate`` corruption
(a chunk slot has a fixed size); ``h.corrupt`` damages the slot of a stored page in the shared-memory segment (flip one
payload byte, or write a valid header of another namespace).
"""
from __future__ import annotations

import atexit
import contextlib
import functools
import os
import signal
import socket
import subprocess
import itertools
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Optional

import msgpack
import zmq

from tests.helpers.sigstop import sigstop
from tierkv.storage_backends.lmcache.store import OPS, LMCacheStore

NAME = "lmcache"
REPO = Path(__file__).resolve().parents[2]
DEFAULT_VENV_PYTHON = REPO / "benchmarks" / "peers" / ".lmcache-venv" / "bin" / "python"
#: tokens per page = the server's --chunk-size used unless ``page_tokens`` is given
PAGE_TOKENS = 16
DEFAULT_TIMEOUT_S = 3.0
READY_TIMEOUT_S = 120.0
_LIVE: dict[int, subprocess.Popen] = {}
#: chunk size -> (process, endpoint, shm name) of the server shared by handles that do not ask for their own
_SHARED: dict[int, tuple] = {}
_LABELS = itertools.count()


def lmcache_python() -> str:
    """The interpreter of the LMCache venv (``TIERKV_LMCACHE_PYTHON`` or the default venv). Raises RuntimeError with
    the command that builds it when it is missing."""
    py = os.environ.get("TIERKV_LMCACHE_PYTHON") or str(DEFAULT_VENV_PYTHON)
    if not os.path.exists(py):
        raise RuntimeError(f"no LMCache venv at {py}: run `bash benchmarks/peers/setup_lmcache_venv.sh` "
                           "(.ci/setup_env.sh does)")
    return py


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stop_proc(p: subprocess.Popen, shm_name: Optional[str] = None, grace_s: float = 15.0) -> None:
    """Stop server ``p`` by PID (SIGTERM, then SIGKILL after ``grace_s``) and remove its segment if it left one."""
    if p.poll() is None:
        try:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            p.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
        if p.poll() is None:
            p.kill()
            p.wait()
    _LIVE.pop(p.pid, None)
    if shm_name:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(f"/dev/shm/lmcache_l1_pool_{shm_name}")


def _stop_shared() -> None:
    for p, _, shm in list(_SHARED.values()):
        _stop_proc(p, shm, grace_s=2.0)
    _SHARED.clear()


def shared_server(chunk_size: int) -> tuple[subprocess.Popen, str, str]:
    """The session's server of this chunk size (started on first use, restarted if it died)."""
    s = _SHARED.get(chunk_size)
    if s is None or s[0].poll() is not None:
        log_path = os.path.join(tempfile.gettempdir(), f"tierkv-lmcache-{os.getpid()}-{chunk_size}.log")
        s = _SHARED[chunk_size] = start_server(chunk_size, l1_size_gb=0.5, log_path=log_path)
    return s


atexit.register(_stop_shared)
atexit.register(lambda: [_stop_proc(p) for p in list(_LIVE.values())])


def request(endpoint: str, op: str, *args: Any, timeout_s: float = 2.0) -> tuple[bool, Any]:
    """One request on a fresh DEALER socket: ``(answered, result)``."""
    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send_multipart([msgpack.packb(1), msgpack.packb(OPS.get(op, op))]
                         + [msgpack.packb(a, use_bin_type=True) for a in args])
        if not s.poll(int(timeout_s * 1000)):
            return False, None
        fr = s.recv_multipart()
        return True, (msgpack.unpackb(fr[2], raw=False) if len(fr) > 2 else None)
    finally:
        s.close(0)


def start_server(chunk_size: int = PAGE_TOKENS, *, port: int = 0, shm_name: Optional[str] = None,
                 l1_size_gb: float = 0.25, log_path: Optional[str] = None,
                 extra_args: tuple = ()) -> tuple[subprocess.Popen, str, str]:
    """Start an LMCache MP server on 127.0.0.1 and wait until it answers. Returns ``(process, endpoint, shm_name)``
    (the segment is ``/dev/shm/lmcache_l1_pool_<shm_name>``). Raises RuntimeError with its log if it exits first."""
    port = port or _free_port()
    shm_name = shm_name or f"tierkv{uuid.uuid4().hex[:12]}"
    cmd = [lmcache_python(), "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(port),
           "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU",
           "--supported-transfer-mode", "engine_driven", "--shm-name", shm_name, "--disable-observability",
           *map(str, extra_args)]
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    log = open(log_path, "ab") if log_path else subprocess.DEVNULL
    try:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
    finally:
        if log_path:
            log.close()
    _LIVE[p.pid] = p
    endpoint = f"tcp://127.0.0.1:{port}"
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while True:
            if p.poll() is not None:
                tail = open(log_path, errors="replace").read()[-3000:] if log_path else ""
                raise RuntimeError(f"LMCache server exited (rc={p.returncode}) before answering; log:\n{tail}")
            answered, res = request(endpoint, "noop", timeout_s=1.0)
            if answered and res == "OK":
                return p, endpoint, shm_name
            if time.monotonic() > deadline:
                raise RuntimeError(f"LMCache server on {endpoint} did not answer within {READY_TIMEOUT_S}s")
    except BaseException:
        _stop_proc(p)
        raise


class LMCacheHandle:
    """An LMCache server subprocess plus ``lmcache`` stores on it (see ``conftest.py`` for the attributes)."""

    name = NAME
    supports_stop = True
    persistent = False       # restart() brings back an empty server
    capacity_pages = None    # LMCache evicts by its own policy
    write_once = True        # LMCache keeps the first copy of a chunk

    def __init__(self, tmp_path, page_bytes: int, namespace: bytes, page_tokens: int = PAGE_TOKENS,
                 chunk_size: Optional[int] = None, private: bool = False, **opts: Any):
        self.tmp_path = str(tmp_path)
        self.page_bytes = page_bytes
        self.namespace = namespace
        self.page_tokens = page_tokens
        self.chunk_size = chunk_size or page_tokens
        self.log_path = os.path.join(self.tmp_path, "lmcache-server.log")
        keys = ("timeout_s", "reconnect_backoff_s", "max_backoff_s", "model_name", "world_size", "worker_id")
        self._client_opts = {k: v for k, v in opts.items() if k in keys}
        self._client_opts.setdefault("timeout_s", DEFAULT_TIMEOUT_S)
        self._client_opts.setdefault("model_name", f"t{os.getpid()}x{next(_LABELS)}")  # a key space per handle
        self._clients: list[LMCacheStore] = []
        self.private = private
        if private:
            self.proc, self.endpoint, self.shm_name = start_server(self.chunk_size, log_path=self.log_path)
        else:
            self.proc, self.endpoint, self.shm_name = shared_server(self.chunk_size)
            self.log_path = os.path.join(tempfile.gettempdir(), f"tierkv-lmcache-{os.getpid()}-{self.chunk_size}.log")
        self.port = int(self.endpoint.rsplit(":", 1)[1])
        self.backend = self.new_client() if opts.get("connect", True) else None

    @property
    def shm_path(self) -> str:
        return f"/dev/shm/lmcache_l1_pool_{self.shm_name}"

    def options(self, **overrides: Any) -> dict:
        return {"endpoint": self.endpoint, "page_tokens": self.page_tokens, **self._client_opts, **overrides}

    def new_client(self, namespace: Optional[bytes] = None, **overrides: Any) -> LMCacheStore:
        c = LMCacheStore(namespace or self.namespace, self.page_bytes, **self.options(**overrides))
        self._clients.append(c)
        return c

    def client_factory(self, namespace: Optional[bytes] = None):
        return functools.partial(LMCacheStore, namespace or self.namespace, self.page_bytes, **self.options())

    def kill9(self) -> None:
        """SIGKILL the server (its segment stays in /dev/shm, as after a crash)."""
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        _stop_proc(self.proc)

    def start(self) -> None:
        """Start an empty server on the same port and segment name (after :meth:`kill9`)."""
        self.proc, ep, _ = start_server(self.chunk_size, port=self.port, shm_name=self.shm_name,
                                        l1_size_gb=0.25 if self.private else 0.5, log_path=self.log_path)
        assert ep == self.endpoint
        if not self.private:
            _SHARED[self.chunk_size] = (self.proc, self.endpoint, self.shm_name)

    def restart(self) -> LMCacheStore:
        self.kill9()
        self.start()
        return self.backend

    def stop(self) -> None:
        """SIGSTOP the server and return once all its threads are stopped (a hung server)."""
        sigstop(self.proc.pid)

    def cont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def slot_of(self, key: str) -> Optional[tuple[int, int]]:
        """``(offset, length)`` of the stored chunk of ``key`` (a page set without tokens) in the segment."""
        b = self.backend
        with b._lock:
            g = b._groups([key], None)
            b._begin(1)
            try:
                n = b._lookup(g)[0]
                if not n:
                    return None
                rep = b._calls([("prepare_retrieve", b._key(g[0], 0), b._instance)])[0]
            finally:
                b._calls([], [("commit_retrieve", b._key(g[0], 0), b._instance), ("end_session", g[0].rid)])
        slots = rep.get("context", {}).get("slots") if rep and rep.get("success") else None
        return (slots[0]["offset"], slots[0]["length"]) if slots else None

    def corrupt(self, key: str, how: str, namespace: Optional[bytes] = None) -> bool:
        """Damage the stored chunk of ``key`` in the shared-memory segment: ``flip`` (one payload byte),
        ``foreign_namespace`` (a valid header of another namespace) or ``truncate``: slots have a fixed size, so a
        record cannot be shorter; the nearest fault is a torn write, the second half of the payload never written
        (zeros)."""
        where = self.slot_of(key)
        if where is None:
            return False
        off, _ = where
        from tierkv.storage_backends.page_format import HEADER_BYTES, encode_header

        fd = os.open(self.shm_path, os.O_RDWR)
        try:
            if how == "flip":
                b = os.pread(fd, 1, off + HEADER_BYTES + 7)
                os.pwrite(fd, bytes([b[0] ^ 0xFF]), off + HEADER_BYTES + 7)
            elif how == "truncate":
                half = self.page_bytes // 2
                os.pwrite(fd, bytes(self.page_bytes - half), off + HEADER_BYTES + half)
            elif how == "foreign_namespace":
                payload = os.pread(fd, self.page_bytes, off + HEADER_BYTES)
                os.pwrite(fd, encode_header(key, bytes(16), payload), off)
            else:
                raise ValueError(how)
        finally:
            os.close(fd)
        return True

    def close(self) -> None:
        for c in self._clients:
            c.close()
        if self.private:
            _stop_proc(self.proc, self.shm_name, grace_s=2.0)
        elif self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a test that stopped the shared server leaves it running


@contextlib.contextmanager
def make_backend(tmp_path, page_bytes: int, namespace: bytes, **opts: Any):
    """Yield a :class:`LMCacheHandle`: a real LMCache server on loopback (chunk size ``page_tokens``, default 16) and
    an ``lmcache`` store on it. Options: ``page_tokens``, ``chunk_size`` (server, default = page_tokens),
    ``connect`` (False: no store yet), ``private`` (a server of its own, stopped on exit), client options ``timeout_s`` (default :data:`DEFAULT_TIMEOUT_S`),
    ``reconnect_backoff_s``, ``max_backoff_s``, ``model_name``, ``world_size``, ``worker_id``; others are ignored."""
    h = LMCacheHandle(tmp_path, page_bytes, namespace, **opts)
    try:
        yield h
    finally:
        h.close()


__all__ = ["make_backend", "LMCacheHandle", "start_server", "request", "lmcache_python", "PAGE_TOKENS"]
