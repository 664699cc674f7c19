"""Real ``redis-server`` processes for the redis store's tests: standalone (optionally with a password, a
``maxmemory`` policy) and a cluster of 3 masters with one replica each, on free loopback ports.

A server is ready when its log (its stdout) says ``Ready to accept connections``; a cluster when every node reports
``cluster_state:ok`` and knows all others (polled with a bounded deadline). Persistence is off (``save ""``,
``appendonly no``): a restarted server comes back empty. Every process is stopped by its PID (atexit as a last resort).
``redis-server`` / ``redis-cli`` come from the Debian package installed by ``.ci/setup_env.sh``.
"""
from __future__ import annotations

import atexit
import os
import selectors
import signal
import socket
import subprocess
import time
from typing import Optional

import redis

READY_TIMEOUT_S = 30.0
_LIVE: dict[int, subprocess.Popen] = {}
atexit.register(lambda: [stop(p) for p in list(_LIVE.values())])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        os.kill(p.pid, signal.SIGCONT)
        os.kill(p.pid, signal.SIGKILL)
        p.wait()
    _LIVE.pop(p.pid, None)


class RedisServer:
    """One ``redis-server`` on ``127.0.0.1:port``; :meth:`kill9` and :meth:`start` (same port, same options)."""

    def __init__(self, workdir: str, port: int = 0, password: Optional[str] = None, args: tuple = ()):
        self.workdir = workdir
        os.makedirs(workdir, exist_ok=True)
        self.port = port or free_port()
        self.password = password
        self.args = tuple(args)
        self.proc: Optional[subprocess.Popen] = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def node(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> None:
        cmd = ["redis-server", "--bind", "127.0.0.1", "--port", str(self.port), "--save", "", "--appendonly", "no",
               "--dir", self.workdir, "--protected-mode", "no", "--logfile", "", *self.args]
        if self.password:
            cmd += ["--requirepass", self.password]
        last = ""
        for _ in range(10):  # a port freed by a killed server is normally free at once; retry if not yet
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True)
            _LIVE[p.pid] = p
            ok, last = _wait_line(p, b"Ready to accept connections", os.path.join(self.workdir, "redis.log"))
            if ok:
                self.proc = p
                return
            stop(p)
            if b"Address already in use" not in last.encode():
                break
        raise RuntimeError(f"redis-server on port {self.port} did not start:\n{last[-2000:]}")

    def client(self, **kw) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, password=self.password, socket_timeout=5, **kw)

    def kill9(self) -> None:
        stop(self.proc)

    def sigstop(self) -> None:
        from tests.helpers.sigstop import sigstop

        sigstop(self.proc.pid)

    def sigcont(self) -> None:
        os.kill(self.proc.pid, signal.SIGCONT)

    def close(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def _wait_line(p: subprocess.Popen, needle: bytes, log_path: str) -> tuple[bool, str]:
    """Read ``p``'s stdout until a line holds ``needle`` (True) or it exits / the deadline passes (False), then keep
    copying it to ``log_path`` in a thread so the server never blocks on a full pipe."""
    sel = selectors.DefaultSelector()
    fd = p.stdout.fileno()
    sel.register(fd, selectors.EVENT_READ)
    seen = b""
    deadline = time.monotonic() + READY_TIMEOUT_S
    try:
        while time.monotonic() < deadline:
            if not sel.select(timeout=max(0.0, deadline - time.monotonic())):
                break
            chunk = os.read(fd, 65536)
            if not chunk:
                break
            seen += chunk
            if needle in seen:
                with open(log_path, "ab") as f:
                    f.write(seen)
                _drain(p, log_path)
                return True, seen.decode(errors="replace")
    finally:
        sel.close()
    return False, seen.decode(errors="replace")


def _drain(p: subprocess.Popen, log_path: str) -> None:
    import threading

    def run():
        fd = p.stdout.fileno()
        with open(log_path, "ab", buffering=0) as f:
            while chunk := os.read(fd, 65536):
                f.write(chunk)

    threading.Thread(target=run, daemon=True, name=f"redis-log-{p.pid}").start()


class RedisClusterServers:
    """``masters`` cluster nodes plus ``replicas`` replicas each, on loopback; the cluster is formed with
    ``redis-cli --cluster create`` and is ready when every node says ``cluster_state:ok`` and sees all others."""

    def __init__(self, workdir: str, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000):
        self.workdir = workdir
        n = masters * (1 + replicas)
        args = ("--cluster-enabled", "yes", "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-require-full-coverage", "no", "--cluster-allow-reads-when-down", "no",
                "--repl-diskless-sync-delay", "0")
        self.servers = []
        for i in range(n):
            port = free_port()
            d = os.path.join(workdir, f"node{i}")
            self.servers.append(RedisServer(d, port, args=(*args, "--cluster-port", str(free_port()),
                                                           "--cluster-config-file", os.path.join(d, "nodes.conf"))))
        cmd = ["redis-cli", "--cluster", "create", *[s.node for s in self.servers], "--cluster-replicas",
               str(replicas), "--cluster-yes"]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        if r.returncode != 0:
            self.close()
            raise RuntimeError(f"redis-cli --cluster create failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
        self.wait_ok()

    @property
    def nodes(self) -> list[str]:
        return [s.node for s in self.servers]

    def wait_ok(self, servers: Optional[list] = None, timeout_s: float = 30.0) -> None:
        """Poll until every node in ``servers`` (default: all) says ``cluster_state:ok``, knows every other and, for a
        replica, has its link to its master up."""
        servers = servers or self.servers
        deadline = time.monotonic() + timeout_s
        while True:
            ok = True
            for s in servers:
                try:
                    c = s.client()
                    info = c.cluster("info")
                    known = c.cluster("nodes")
                    repl = c.info("replication")
                    c.close()
                except redis.RedisError:
                    ok = False
                    break
                if info.get("cluster_state") != "ok" or len(known) < len(servers) or (
                        repl.get("role") == "slave" and repl.get("master_link_status") != "up"):
                    ok = False
                    break
            if ok:
                return
            if time.monotonic() > deadline:
                raise RuntimeError("redis cluster did not reach cluster_state:ok")
            time.sleep(0.05)  # polling a state with a deadline, not a sleep as synchronisation

    def masters(self) -> list[RedisServer]:
        out = []
        for s in self.servers:
            if s.proc.poll() is None and s.client().info("replication").get("role") == "master":
                out.append(s)
        return out

    def restart_all(self) -> None:
        """kill -9 every node and start them again (same ports and nodes.conf): an empty cluster, same topology."""
        for s in self.servers:
            s.kill9()
        for s in self.servers:
            s.start()
        self.wait_ok()

    def close(self) -> None:
        for s in self.servers:
            s.close()


__all__ = ["RedisServer", "RedisClusterServers", "free_port", "stop"]
