"""Start, pause, restart and stop a real ``mooncake_master`` on loopback, by PID (tests and benchmarks).

The master runs with its HTTP metadata server enabled (so no etcd is needed), its RPC, metadata and metrics ports
on free loopback ports chosen at start (kept across :meth:`MooncakeMaster.restart`), and its log in a file. Ready
means: the process is alive, its RPC port accepts connections and its metadata server answers HTTP; this is polled,
never slept for. Everything started here is stopped by PID (``SIGCONT`` then ``SIGTERM``, ``SIGKILL`` after a grace
period), also at interpreter exit.

Note: this Mooncake build (0.3.13.post1) logs "HTTP metadata server started on 127.0.0.1:<port>" but listens on
0.0.0.0 for that port; the RPC and metrics ports honour ``-rpc_address``/``-metrics_host``.

Usable from any test or script: ``from tests.helpers.mooncake_master import MooncakeMaster`` (the repository root
on ``sys.path``), or load this file by path.
"""
from __future__ import annotations

import atexit
import http.client
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Optional, Sequence

from tests.helpers.sigstop import sigstop

_LIVE: dict[int, subprocess.Popen] = {}


def find_master_binary() -> str:
    """Path of ``mooncake_master``: next to this interpreter (venv ``bin``), inside the ``mooncake`` package, or on
    ``PATH``. Raises FileNotFoundError naming where it looked."""
    cands = [os.path.join(os.path.dirname(sys.executable), "mooncake_master")]
    try:
        import mooncake  # noqa: PLC0415

        cands.append(os.path.join(os.path.dirname(mooncake.__file__), "mooncake_master"))
    except ImportError:
        pass
    on_path = shutil.which("mooncake_master")
    if on_path:
        cands.append(on_path)
    for c in cands:
        if os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    raise FileNotFoundError(f"mooncake_master not found (looked in {cands}); "
                            "install mooncake-transfer-engine-non-cuda (pip install -e '.[mooncake]')")


def free_ports(n: int) -> list[int]:
    """``n`` distinct currently free TCP ports on 127.0.0.1."""
    socks, ports = [], []
    try:
        while len(ports) < n:
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
            ports.append(s.getsockname()[1])
    finally:
        for s in socks:
            s.close()
    return ports


def _kill_all_at_exit() -> None:
    for p in list(_LIVE.values()):
        _stop_proc(p, grace_s=2.0)


atexit.register(_kill_all_at_exit)


def _stop_proc(p: subprocess.Popen, grace_s: float = 10.0) -> None:
    if p.poll() is None:
        try:
            os.kill(p.pid, signal.SIGCONT)
            p.terminate()
            p.wait(timeout=grace_s)
        except ProcessLookupError:
            pass
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
    _LIVE.pop(p.pid, None)


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _http_answers(port: int) -> bool:
    try:
        c = http.client.HTTPConnection("127.0.0.1", port, timeout=1.0)
        c.request("GET", "/metadata?key=tierkv-probe")
        c.getresponse().read()
        c.close()
        return True
    except (OSError, http.client.HTTPException):
        return False


class MooncakeMaster:
    """One ``mooncake_master`` process on loopback.

    Attributes: ``rpc_port``, ``http_port`` (metadata server), ``metrics_port``, ``master_address``
    (``"127.0.0.1:<rpc_port>"``), ``metadata_server`` (``"http://127.0.0.1:<http_port>/metadata"``), ``pid``,
    ``log_path``. ``extra_args`` are passed to the binary (e.g. ``["-put_start_discard_timeout_sec", "2"]``).
    """

    def __init__(self, extra_args: Sequence[str] = (), log_dir: Optional[str] = None,
                 ready_timeout_s: float = 60.0, binary: Optional[str] = None):
        self.binary = binary or find_master_binary()
        self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        self.extra_args = list(extra_args)
        self.ready_timeout_s = ready_timeout_s
        self.log_dir = log_dir or tempfile.mkdtemp(prefix="tierkv-mooncake-master-")
        self.log_path = os.path.join(self.log_dir, "mooncake_master.log")
        self.proc: Optional[subprocess.Popen] = None
        self.starts = 0

    @property
    def master_address(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_server(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    @property
    def pid(self) -> Optional[int]:
        return self.proc.pid if self.proc else None

    def client_config(self) -> dict:
        """``l3.mooncake`` keys that point a :class:`~tierkv.storage_backends.mooncake.store.MooncakeStore` here."""
        return {"master_address": self.master_address, "metadata_server": self.metadata_server,
                "protocol": "tcp", "local_hostname": "127.0.0.1"}

    def start(self) -> "MooncakeMaster":
        """Start the master and return once it is ready. Raises RuntimeError (with the log tail) if it exits or is
        not ready within ``ready_timeout_s``. A first start whose free ports were taken by another process in the
        meantime ("Address already in use") tries again on new ports, at most 3 times; a restart keeps its ports."""
        for attempt in range(3):
            try:
                return self._start()
            except RuntimeError as e:
                if self.starts > 1 or attempt == 2 or "Address already in use" not in str(e):
                    raise
                self.starts -= 1
                self.rpc_port, self.http_port, self.metrics_port = free_ports(3)
        raise AssertionError("unreachable")

    def _start(self) -> "MooncakeMaster":
        if self.proc is not None and self.proc.poll() is None:
            raise RuntimeError(f"mooncake_master already running (pid {self.proc.pid})")
        args = [self.binary, "-rpc_port", str(self.rpc_port), "-rpc_address", "127.0.0.1",
                "-enable_http_metadata_server=true", "-http_metadata_server_host", "127.0.0.1",
                "-http_metadata_server_port", str(self.http_port), "-metrics_port", str(self.metrics_port),
                "-metrics_host", "127.0.0.1", *self.extra_args]
        log = open(self.log_path, "ab")
        try:
            self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                         start_new_session=True)
        finally:
            log.close()
        _LIVE[self.proc.pid] = self.proc
        self.starts += 1
        deadline = time.monotonic() + self.ready_timeout_s
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"mooncake_master exited with {self.proc.returncode}:\n{self.log_tail()}")
            if _port_open(self.rpc_port) and _http_answers(self.http_port):
                return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"mooncake_master not ready after {self.ready_timeout_s}s:\n{self.log_tail()}")
            time.sleep(0.02)  # polling interval, not a synchronisation sleep

    def stop(self) -> None:
        """Stop the master (SIGCONT, SIGTERM, SIGKILL after 10 s) and wait until its ports are free."""
        if self.proc is None:
            return
        _stop_proc(self.proc)
        self.proc = None
        deadline = time.monotonic() + 30
        while (_port_open(self.rpc_port) or _port_open(self.http_port)) and time.monotonic() < deadline:
            time.sleep(0.02)

    def kill(self) -> None:
        """SIGKILL the master (a crash, no clean shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.proc is not None:
            _LIVE.pop(self.proc.pid, None)
        self.proc = None

    def restart(self) -> "MooncakeMaster":
        """Stop and start again on the same ports (a fresh master: it knows no objects and no segments)."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP the master and return once every one of its threads is stopped: it keeps its sockets open but
        answers nothing (a hung master). See :func:`sigstop.sigstop`."""
        if self.proc is not None:
            sigstop(self.proc.pid)

    def resume(self) -> None:
        """SIGCONT a paused master."""
        if self.proc is not None:
            os.kill(self.proc.pid, signal.SIGCONT)

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as f:
                return b"\n".join(f.read().splitlines()[-n:]).decode(errors="replace")
        except OSError:
            return "<no log>"

    def __enter__(self) -> "MooncakeMaster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
