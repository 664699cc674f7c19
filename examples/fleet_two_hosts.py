"""A fleet of two hosts on one machine: two network namespaces, a vLLM server with tierkv in each, a shared L3, and
the prefix router of ``examples/route_by_prefix.py`` in front of them.

Run as root (network namespaces), from the repository root, under the engine lock on a shared machine::

    flock /tmp/tierkv-engine.lock .venv/bin/python examples/fleet_two_hosts.py [--l3 mooncake|zmq] \\
        [--out benchmarks/results/fleet_two_hosts_mooncake.json] [router flags: --docs 8 --doc-blocks 6 ...]

What it builds (README, "A fleet of two hosts"):

- Two namespaces, host A and host B, joined by one veth pair: A ``10.77.0.1/24``, B ``10.77.0.2/24`` (``--subnet``
  changes the first three octets), ``lo`` up in each. No route, bridge or NAT: each namespace reaches only its own
  loopback and the other end of the pair, never anything beyond the machine. Names carry this process's PID
  (``tkvfA<pid>``), so two runs never share them.
- In host A: the L3 store, listening on A's address only: ``--l3 mooncake`` a ``mooncake_master`` (RPC and HTTP
  metadata server; the engines' Mooncake clients use the TCP transport, ``MC_TCP_BIND_ADDRESS`` and
  ``local_hostname`` set to their own host's address; A's client holds the store's memory, B's contributes none,
  so every page B reads or writes crosses the pair), ``--l3 zmq`` a ``tierkv server`` with a random token (written
  to ``<run dir>/server.token``, mode 0600; the engines get it in their connector config). Before the engines
  start, a client in host B checks that the server stores and finds a page for the token and refuses clients
  without it or with a wrong one (``token_check`` in the result).
- In each host: ``python -m vllm.entrypoints.openai.api_server`` on the host's address, port 8000, with a tiny
  local model (``--preset``, built by ``examples/make_tiny_model.py``), tierkv's connector (L2 of
  ``--l2-pages`` pages, the shared L3, ``write_through``, ``wait_complete``), L1 of ``--l1-blocks`` blocks, and KV
  events published by ZMQ on ``tcp://*:5560`` inside the namespace (its addresses: loopback and the pair's),
  topic = the host's name. Each engine is pinned to its own CPU (``VLLM_CPU_OMP_THREADS_BIND``: A 0, B 1).
- The router runs in host A (``ip netns exec``), subscribes to both publishers over the pair, waits until both
  servers answer, and runs its steps (cross-host check, then prefix and round-robin routing of one request
  sequence; see its docstring). Its result JSON becomes part of this script's ``--out``.

Every process is started in its own session and stopped by its PID's process group (SIGTERM, SIGKILL after
``--stop-timeout-s``); then any process still inside the namespaces is killed by PID (``ip netns pids``) and the
namespaces are deleted (which removes the veth pair), also after a failure, Ctrl-C or SIGTERM. Logs, stats files and
the token stay in the run directory (``--run-dir``, default ``runs/fleet-<UTC time>``).

Exit status 0 when the run finished and the cross-host outputs were identical, 1 otherwise (the reason on stderr),
2 for a bad flag. Needs root and ``ip`` (iproute2).
"""
from __future__ import annotations

import argparse
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Optional

REPO = Path(__file__).resolve().parents[1]
ENGINE_PORT = 8000
EVENTS_PORT = 5560
ZMQ_PORT = 5557
MC_RPC_PORT, MC_HTTP_PORT, MC_METRICS_PORT = 50051, 8080, 9003
ENGINE_ENV = {
    "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
    "VLLM_CPU_KVCACHE_SPACE": "1",   # GiB; --num-gpu-blocks-override decides the real L1 size
    "VLLM_NO_USAGE_STATS": "1",
    "VLLM_DO_NOT_TRACK": "1",
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "TOKENIZERS_PARALLELISM": "false",
}
#: tierkv stats keys copied per engine into the result
STATS_KEYS = ("l2_hit_tokens", "ctl_l3_hit_tokens", "save_pages", "load_pages", "ctl_l3_backup_pages",
              "ctl_l3_prefetch_pages", "ctl_l3_prefetch_failed_pages", "l3_declined_slow_pages", "kv_events_dropped",
              "lookup_tokens", "lookup_l1_tokens", "lookup_l2_tokens", "lookup_l3_tokens", "lookup_miss_tokens",
              "lookup_declined_slow_tokens", "lookup_late_tokens", "lookup_failed_tokens")


class Fleet:
    """The namespaces and processes of one run; :meth:`close` undoes all of it (idempotent)."""

    def __init__(self, run_dir: Path, subnet: str, stop_timeout_s: float):
        tag = str(os.getpid())
        self.ns = {"hostA": f"tkvfA{tag}", "hostB": f"tkvfB{tag}"}
        self.veth = {"hostA": f"tkvfa{tag}"[:15], "hostB": f"tkvfb{tag}"[:15]}
        self.addr = {"hostA": f"{subnet}.1", "hostB": f"{subnet}.2"}
        self.run_dir, self.stop_timeout_s = run_dir, stop_timeout_s
        self.procs: dict[str, subprocess.Popen] = {}
        self.made_ns: list[str] = []
        self.logs: dict[str, Path] = {}

    # -- network ---------------------------------------------------------------------------------------------
    def up(self) -> None:
        """Create both namespaces, the veth pair between them, the addresses, and bring every link up."""
        a, b = self.ns["hostA"], self.ns["hostB"]
        for ns in (a, b):
            _ip("netns", "add", ns)
            self.made_ns.append(ns)
        va, vb = self.veth["hostA"], self.veth["hostB"]
        _ip("link", "add", va, "type", "veth", "peer", "name", vb)
        _ip("link", "set", va, "netns", a)
        _ip("link", "set", vb, "netns", b)
        for host, dev in (("hostA", va), ("hostB", vb)):
            ns = self.ns[host]
            _ip("-n", ns, "addr", "add", f"{self.addr[host]}/24", "dev", dev)
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "link", "set", dev, "up")

    # -- processes -------------------------------------------------------------------------------------------
    def start(self, name: str, host: str, cmd: list, env: Optional[dict] = None) -> subprocess.Popen:
        """Start ``cmd`` inside ``host``'s namespace in a new session, output to ``<run dir>/<name>.log``."""
        log_path = self.run_dir / f"{name}.log"
        self.logs[name] = log_path
        with open(log_path, "wb") as log:
            p = subprocess.Popen(["ip", "netns", "exec", self.ns[host], *cmd], stdout=log, stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, cwd=str(REPO), start_new_session=True)
        self.procs[name] = p
        return p

    def wait_port(self, host: str, addr: str, port: int, timeout_s: float, watch: str) -> None:
        """Poll from inside ``host`` until ``addr:port`` accepts a TCP connection (RuntimeError if the process
        ``watch`` exits first or after ``timeout_s``)."""
        code = ("import socket,sys,time\n"
                f"end=time.monotonic()+{timeout_s}\n"
                "while time.monotonic()<end:\n"
                "    try:\n"
                f"        socket.create_connection(({addr!r},{port}),timeout=1).close(); sys.exit(0)\n"
                "    except OSError: time.sleep(0.1)\n"
                "sys.exit(1)\n")
        poller = subprocess.Popen(["ip", "netns", "exec", self.ns[host], sys.executable, "-c", code])
        while poller.poll() is None:
            if self.procs[watch].poll() is not None:
                poller.kill()
                poller.wait()
                raise RuntimeError(f"{watch} exited with {self.procs[watch].returncode}:\n{self.tail(watch)}")
            try:
                poller.wait(timeout=0.5)
            except subprocess.TimeoutExpired:
                pass
        if poller.returncode != 0:
            raise RuntimeError(f"{watch}: {addr}:{port} not open after {timeout_s} s:\n{self.tail(watch)}")

    def tail(self, name: str, n: int = 4000) -> str:
        try:
            return self.logs[name].read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def stop(self, name: str) -> Optional[int]:
        """SIGTERM to the process group of ``name`` (its session), SIGKILL after the stop timeout; its exit code."""
        p = self.procs.get(name)
        if p is None:
            return None
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGTERM)
                p.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait(timeout=30)
            except ProcessLookupError:
                pass
        try:  # children that outlived their leader (same process group)
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        return p.returncode

    def close(self) -> dict:
        """Stop every process (SIGTERM to all process groups at once, then SIGKILL to those still running after the
        stop timeout), kill by PID whatever still runs in the namespaces, delete them. Returns what it had to force:
        ``{"leftover_pids": [...], "namespaces_deleted": [...]}``."""
        for p in self.procs.values():
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        deadline = time.monotonic() + self.stop_timeout_s
        for p in self.procs.values():
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        for name in reversed(list(self.procs)):
            self.stop(name)
        leftover = []
        for ns in self.made_ns:
            r = subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True)
            for pid in r.stdout.split():
                leftover.append(int(pid))
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except ProcessLookupError:
                    pass
        deleted = []
        for ns in list(self.made_ns):
            if subprocess.run(["ip", "netns", "del", ns], capture_output=True).returncode == 0:
                deleted.append(ns)
            self.made_ns.remove(ns)
        return {"leftover_pids": leftover, "namespaces_deleted": deleted}


def _ip(*args: str) -> None:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")


def _machine() -> dict:
    model = ""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in out.splitlines() if ln.startswith("Model name")), "")
    except OSError:
        pass
    return {"cpu_model": model, "cpus": os.cpu_count(), "loadavg": list(os.getloadavg())}


def _git() -> dict:
    def run(*a):
        return subprocess.run(["git", *a], capture_output=True, text=True, cwd=str(REPO)).stdout
    return {"head": run("rev-parse", "HEAD").strip(),
            "dirty_paths": [ln[3:] for ln in run("status", "--porcelain", "--untracked-files=no").splitlines()]}


def engine_command(args, fleet: Fleet, host: str, model: str, store: dict) -> tuple[list, dict]:
    """The OpenAI server command and environment for ``host``."""
    addr = fleet.addr[host]
    extra = {"host_pool": {"num_pages": args.l2_pages},
             "l3": store[host],
             "controller": {"write_policy": "write_through", "prefetch_policy": "wait_complete"},
             "stats_path": str(fleet.run_dir / f"stats-{host}" / "{role}-{pid}.json")}
    kv = {"kv_connector": "TierKVConnector", "kv_connector_module_path": "tierkv.connector.vllm.connector",
          "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}
    events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{EVENTS_PORT}",
              "topic": host}
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", addr,
           "--port", str(ENGINE_PORT), "--block-size", str(args.block_size), "--enable-prefix-caching",
           "--enforce-eager", "--dtype", "bfloat16", "--max-model-len", str(args.max_model_len),
           "--max-num-batched-tokens", str(args.max_model_len), "--num-gpu-blocks-override", str(args.l1_blocks),
           "--max-num-seqs", "2", "--seed", "0", "--kv-transfer-config", json.dumps(kv),
           "--kv-events-config", json.dumps(events)]
    env = dict(os.environ, **ENGINE_ENV)
    env["VLLM_CPU_OMP_THREADS_BIND"] = "0" if host == "hostA" else "1"
    env["TIERKV_ESTIMATES_DIR"] = str(fleet.run_dir / f"estimates-{host}")
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    if args.l3 == "mooncake":
        env["MC_TCP_BIND_ADDRESS"] = addr
    else:  # an address inherited from the caller's environment means nothing inside the namespace
        env.pop("MC_TCP_BIND_ADDRESS", None)
    return cmd, env


def start_store(args, fleet: Fleet) -> dict:
    """Start the L3 store in host A; returns each host's ``l3`` connector config."""
    a = fleet.addr["hostA"]
    if args.l3 == "zmq":
        token = secrets.token_hex(16)
        tok = fleet.run_dir / "server.token"
        tok.touch(mode=0o600)
        tok.write_text(token + "\n")
        fleet.start("tierkv_server", "hostA", [sys.executable, "-m", "tierkv.cli_server", "--host", a, "--port",
                                               str(ZMQ_PORT), "--capacity-bytes", args.l3_bytes,
                                               "--token-file", str(tok)])
        fleet.wait_port("hostA", a, ZMQ_PORT, 120, "tierkv_server")
        cfg = {"backend": "zmq", "zmq": {"endpoint": f"tcp://{a}:{ZMQ_PORT}", "token": token, "timeout_s": 5.0}}
        return {"hostA": cfg, "hostB": cfg}
    master = shutil.which("mooncake_master", path=os.path.dirname(sys.executable)) or shutil.which("mooncake_master")
    if master is None:
        raise RuntimeError("mooncake_master not found next to this Python nor on PATH (make venv installs it)")
    fleet.start("mooncake_master", "hostA", [master, "-rpc_port", str(MC_RPC_PORT), "-rpc_address", a,
                                             "-enable_http_metadata_server=true", "-http_metadata_server_host", a,
                                             "-http_metadata_server_port", str(MC_HTTP_PORT),
                                             "-metrics_port", str(MC_METRICS_PORT), "-metrics_host", a])
    fleet.wait_port("hostA", a, MC_RPC_PORT, 120, "mooncake_master")
    fleet.wait_port("hostA", a, MC_HTTP_PORT, 120, "mooncake_master")
    out = {}
    for host in ("hostA", "hostB"):
        out[host] = {"backend": "mooncake", "mooncake": {
            "master_address": f"{a}:{MC_RPC_PORT}", "metadata_server": f"http://{a}:{MC_HTTP_PORT}/metadata",
            "protocol": "tcp", "local_hostname": fleet.addr[host],
            "global_segment_size": args.l3_bytes if host == "hostA" else 0}}
    return out


#: run in host B against host A's tierkv server: a client with the token stores and finds a probe page, clients
#: without it or with a wrong one are refused (argv: endpoint, token file); prints the outcome as JSON
TOKEN_CHECK = """
import json, os, sys
from tierkv.storage_backends.zmq.client import ZmqStore
ep, token = sys.argv[1], open(sys.argv[2]).read().strip()
ns, key, page = b"fleet-token-chk!", os.urandom(16).hex(), bytearray(os.urandom(4096))
out = {}
for name, tok in (("with_token", token), ("without_token", None), ("wrong_token", token + "x")):
    st = ZmqStore(ns, 4096, endpoint=ep, token=tok, timeout_s=5.0)
    out[name] = {"set": st.batch_set([key], [page]) == [True], "exists": st.batch_exists([key]),
                 "error_replies": st.stats()["error_replies"]}
    st.close()
print(json.dumps(out))
"""


def token_check(fleet: Fleet, endpoint: str, token_file: Path) -> dict:
    """Run :data:`TOKEN_CHECK` in host B; its JSON (RuntimeError with its output if it fails)."""
    r = subprocess.run(["ip", "netns", "exec", fleet.ns["hostB"], sys.executable, "-c", TOKEN_CHECK, endpoint,
                        str(token_file)], capture_output=True, text=True, cwd=str(REPO), timeout=120,
                       env=dict(os.environ, PYTHONPATH=str(REPO)))
    if r.returncode != 0:
        raise RuntimeError(f"token check in hostB failed:\n{r.stdout[-2000:]}{r.stderr[-2000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def read_stats(stats_dir: Path) -> dict:
    """Sum of :data:`STATS_KEYS` over the connector's stats files in ``stats_dir``."""
    tot: dict = {}
    for f in sorted(stats_dir.glob("*.json")):
        try:
            d = json.loads(f.read_text())
        except (OSError, ValueError):
            continue
        flat = d.get("stats", d) if isinstance(d, dict) else {}
        for k in STATS_KEYS:
            v = flat.get(k)
            if isinstance(v, (int, float)):
                tot[k] = tot.get(k, 0) + v
    return tot


def main(argv: Optional[list] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--l3", choices=("mooncake", "zmq"), default="mooncake", help="the shared L3 in host A")
    ap.add_argument("--preset", default="demo", help="examples/make_tiny_model.py preset (default demo)")
    ap.add_argument("--subnet", default="10.77.0", help="first three octets of the pair's /24 (private range)")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--l1-blocks", type=int, default=16, help="vLLM KV blocks per engine (L1)")
    ap.add_argument("--l2-pages", type=int, default=48, help="tierkv host pool pages per engine (L2; 3x L1, so it holds pages L1 dropped)")
    ap.add_argument("--l3-bytes", default="512MiB", help="L3 capacity (Mooncake segment of host A, or the server's)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="default: min(512, (l1 blocks - 1) x block size), the most vLLM accepts for that L1")
    ap.add_argument("--ready-timeout-s", type=float, default=900.0)
    ap.add_argument("--stop-timeout-s", type=float, default=60.0)
    ap.add_argument("--run-dir", default=None)
    ap.add_argument("--out", default=None, help="result JSON (default <run dir>/fleet.json)")
    args, router_args = ap.parse_known_args(argv)
    first = args.subnet.split(".")
    if len(first) != 3 or not all(x.isdigit() and int(x) < 256 for x in first) or \
            not (first[0] == "10" or (first[0] == "192" and first[1] == "168")
                 or (first[0] == "172" and 16 <= int(first[1]) < 32)):
        ap.error(f"--subnet {args.subnet!r}: three octets of a private range (10.x.y, 172.16-31.y, 192.168.y)")
    if args.max_model_len is None:
        args.max_model_len = min(512, (args.l1_blocks - 1) * args.block_size)
    if os.geteuid() != 0:
        print("fleet_two_hosts: needs root (network namespaces)", file=sys.stderr)
        return 1
    run_dir = Path(args.run_dir or REPO / "runs" / f"fleet-{datetime.now(timezone.utc):%Y%m%d-%H%M%S}").resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    out_path = Path(args.out) if args.out else run_dir / "fleet.json"

    sys.path.insert(0, str(REPO / "examples"))
    from make_tiny_model import make_model  # noqa: E402

    model = str(make_model(preset=args.preset))
    fleet = Fleet(run_dir, args.subnet, args.stop_timeout_s)

    def on_signal(signum, _frame):
        raise KeyboardInterrupt(f"signal {signum}")

    signal.signal(signal.SIGTERM, on_signal)
    result: dict = {"started_utc": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                    "machine_before": _machine(), "git": _git(),
                    "config": {k: getattr(args, k) for k in ("l3", "preset", "block_size", "l1_blocks", "l2_pages",
                                                           "l3_bytes", "max_model_len")},
                    "addresses": None, "router_args": router_args, "run_dir": str(run_dir)}
    ok = False
    t0 = time.monotonic()
    try:
        fleet.up()
        result["addresses"] = fleet.addr
        store = start_store(args, fleet)
        if args.l3 == "zmq":  # the server refuses clients without the token, over the pair too
            result["token_check"] = tc = token_check(fleet, store["hostB"]["zmq"]["endpoint"],
                                                     run_dir / "server.token")
            if not (tc["with_token"]["set"] and tc["with_token"]["exists"] == 1 and
                    all(not tc[k]["set"] and tc[k]["exists"] == 0 and tc[k]["error_replies"] > 0
                        for k in ("without_token", "wrong_token"))):
                raise RuntimeError(f"token check: {tc}")
        for host in ("hostA", "hostB"):
            cmd, env = engine_command(args, fleet, host, model, store)
            fleet.start(f"engine_{host}", host, cmd, env)
        router_out = run_dir / "router.json"
        engines = [f"--engine={h}=http://{fleet.addr[h]}:{ENGINE_PORT},tcp://{fleet.addr[h]}:{EVENTS_PORT}"
                   for h in ("hostA", "hostB")]
        router = fleet.start("router", "hostA", [sys.executable, str(REPO / "examples" / "route_by_prefix.py"),
                                                 *engines, "--model", model, "--block-size", str(args.block_size),
                                                 "--wait-ready-s", str(args.ready_timeout_s), "--out",
                                                 str(router_out), *router_args])
        while router.poll() is None:  # an engine that dies ends the run at once
            for h in ("hostA", "hostB"):
                p = fleet.procs[f"engine_{h}"]
                if p.poll() is not None:
                    raise RuntimeError(f"engine on {h} exited with {p.returncode}:\n{fleet.tail('engine_' + h)}")
            try:
                router.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
        print(fleet.tail("router", 3000))
        if router.returncode != 0:
            raise RuntimeError(f"router exited with {router.returncode}")
        result["router"] = json.loads(router_out.read_text())
        result["router_wall_s"] = round(time.monotonic() - t0, 1)
        for h in ("hostA", "hostB"):
            result.setdefault("engine_exit", {})[h] = fleet.stop(f"engine_{h}")
            result.setdefault("tierkv_stats", {})[h] = read_stats(run_dir / f"stats-{h}")
        ok = bool(result["router"].get("cross_host", {}).get("identical"))
        if not ok:
            print("fleet_two_hosts: the cross-host outputs differ", file=sys.stderr)
    except (Exception, KeyboardInterrupt) as e:  # noqa: BLE001 - reported, then cleaned up below
        result["error"] = f"{type(e).__name__}: {e}"
        print(f"fleet_two_hosts: {result['error']}", file=sys.stderr)
    finally:
        result["cleanup"] = fleet.close()
        result["wall_s"] = round(time.monotonic() - t0, 1)
        result["machine_after"] = _machine()
        out_path.parent.mkdir(parents=True, exist_ok=True)
        out_path.write_text(json.dumps(result, indent=1) + "\n")
        print(f"fleet_two_hosts: result in {out_path}; logs in {run_dir}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
