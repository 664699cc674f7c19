"""``tierkv store stats|verify|gc|clear ADDRESS``: look after an L3 store without an engine.

Addresses (:func:`tierkv.cli_common.parse_target`): a directory (a file store, read directly); ``tcp://HOST:PORT``
(``tierkv server``, through protocol 2's ``scan`` and ``verify``; a tenant's token sees only its own pages, and
stats add per-tenant counters); ``mooncake://HOST:PORT`` (a master: totals from ``--metrics-port``, it cannot list
objects); ``lmcache://HOST:PORT`` (``stats`` only: what the server tells); ``redis://HOST:PORT/DB``, ``rediss://`` or
``unix:///path`` (standalone Redis / Valkey, ``stats`` and ``clear``: the keys ``<--key-prefix>:<namespace>:<page>``
found by SCAN, ages from OBJECT IDLETIME). Namespaces are the 16-byte digests in page headers; a file store's
``<namespace>/namespace.json`` (model, dtype, layout) is shown with them. Exit codes: :mod:`tierkv.cli_common`.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from typing import Any, Optional

from tierkv.cli_common import (
    EXIT_FOUND,
    EXIT_NEWER,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_UNREACHABLE,
    EXIT_USAGE,
    CliError,
    Target,
    fail,
    human_bytes,
    parse_target,
    progress,
)

AGE_LABELS = ("<1m", "<10m", "<1h", "<6h", "<1d", "<7d", ">=7d")
DEFAULT_MOONCAKE_METRICS_PORT = 9003  # mooncake_master's default -metrics_port


# ----------------------------------------------------------------------------------------------- helpers
def _ns_arg(text: str) -> str:
    t = text.lower()
    if len(t) != 32 or any(c not in "0123456789abcdef" for c in t):
        raise argparse.ArgumentTypeError(f"invalid namespace {text!r}: expected the 32 hex characters that "
                                         "'tierkv store stats' prints")
    return t


def _bytes_arg(text: str) -> int:
    from tierkv.storage_backends.common import parse_bytes

    try:
        v = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid byte size {text!r} (e.g. 1073741824, 512MiB, 8GiB)") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"byte size must be >= 0, got {text!r}")
    return v


def _age_bucket(age_s: float) -> int:
    from tierkv.storage_backends.zmq.protocol import AGE_BUCKETS_S

    for i, b in enumerate(AGE_BUCKETS_S):
        if age_s < b:
            return i
    return len(AGE_BUCKETS_S)


def _file_root(t: Target) -> str:
    if not os.path.exists(t.path):
        raise CliError(EXIT_USAGE, f"no such directory: {t.text}")
    if not os.path.isdir(t.path):
        raise CliError(EXIT_USAGE, f"not a directory: {t.text} (a file store is a directory)")
    if not os.access(t.path, os.R_OK | os.X_OK):
        raise CliError(EXIT_USAGE, f"cannot read directory {t.text}: permission denied")
    _check_store_dir(t)
    return t.path


def _check_store_dir(t: Target) -> None:
    """A file store directory holds only namespace directories (32 hex digits), ``quarantine/`` and the store's
    temporary files; an empty directory is an empty store. Anything else is refused (exit 2), so a mistyped path
    given to ``gc`` or ``clear`` is an error, not a silent success."""
    import re

    from tierkv.storage_backends.file.store import QUARANTINE_DIR, TMP_PREFIX

    try:
        names = os.listdir(t.path)
    except OSError as e:
        raise CliError(EXIT_USAGE, f"cannot list {t.text}: {e.strerror}") from None
    foreign = [n for n in names if not (re.fullmatch(r"[0-9a-f]{32}", n) and os.path.isdir(os.path.join(t.path, n)))
               and n != QUARANTINE_DIR and not n.startswith(TMP_PREFIX)]
    if foreign:
        shown = ", ".join(repr(n[:40]) for n in sorted(foreign)[:3]) + (" ..." if len(foreign) > 3 else "")
        raise CliError(EXIT_USAGE, f"not a tierkv file store: {t.text} holds {len(foreign)} entr"
                                   f"{'y' if len(foreign) == 1 else 'ies'} a store never writes ({shown})")


def _list_files(root: str, namespaces: Optional[list] = None) -> list:
    from tierkv.storage_backends.file.store import iter_page_files

    try:
        return list(iter_page_files(root, namespaces))
    except OSError as e:
        raise CliError(EXIT_USAGE, f"cannot list {root}: {e.strerror or e}") from None


def _newer_error(where: str, n: int, version: int) -> CliError:
    from tierkv.storage_backends.page_format import VERSION

    return CliError(EXIT_NEWER, f"{where} holds {n} record(s) of page format version {version}, newer than this "
                                f"tierkv reads ({VERSION}); upgrade tierkv (nothing was changed)")


def _lmcache_target(text: str) -> Optional[Target]:
    """``lmcache://HOST:PORT`` as a Target of kind ``lmcache``; None for any other address. Raises CliError(2) for a
    bad host:port."""
    if not text.startswith("lmcache://"):
        return None
    host, sep, port = text[len("lmcache://"):].rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(EXIT_USAGE, f"bad address {text!r}: expected lmcache://HOST:PORT")
    return Target("lmcache", host=host.strip("[]"), port=int(port), text=text)


def _redis_target(text: str) -> Optional[Target]:
    """``redis://``, ``rediss://`` or ``unix://`` addresses as a Target of kind ``redis`` (``path`` holds the URL);
    None for any other address. Raises CliError(2) for a URL the redis store would refuse (credentials in it,
    no host, a database that is not a number...)."""
    from tierkv.storage_backends.redis.config import URL_SCHEMES

    if text.split("://", 1)[0] not in URL_SCHEMES or "://" not in text:
        return None
    from pydantic import ValidationError

    from tierkv.storage_backends.redis.config import RedisStoreConfig

    try:
        RedisStoreConfig(url=text)
    except ValidationError as e:
        why = e.errors()[0].get("msg", str(e)).removeprefix("Value error, ")
        raise CliError(EXIT_USAGE, f"bad address {text!r}: {why} (expected redis://HOST:PORT/DB, rediss://HOST:PORT/DB "
                                   "or unix:///path; the password goes in --password or $TIERKV_REDIS_PASSWORD)"
                       ) from None
    return Target("redis", path=text, text=text)


# ----------------------------------------------------------------------------------------------- ZMQ admin client
class ZmqAdmin:
    """Blocking request/reply client for one ``tierkv server`` (admin use: one request at a time, ``timeout_s``
    per reply). Raises :class:`CliError` for a server that does not answer (3), refuses the token (5) or speaks
    only a newer protocol (4)."""

    def __init__(self, t: Target, token: Optional[str], timeout_s: float):
        import zmq

        self.t, self.token, self.timeout_s = t, token, timeout_s
        # ZMQ connects lazily and would wait the whole --timeout for an answer from a port nothing listens on; a
        # plain TCP connect first is refused at once there (a filtered remote port still takes up to --timeout)
        _check_port(t, timeout_s, "'tierkv server'")
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        host = f"[{t.host}]" if ":" in t.host else t.host
        if ":" in t.host:
            self.sock.setsockopt(zmq.IPV6, 1)
        self.sock.connect(f"tcp://{host}:{t.port}")
        self._id = 0

    def call(self, op: str, v: int = 1, timeout_s: Optional[float] = None, **fields: Any) -> dict:
        import zmq

        from tierkv.storage_backends.zmq import protocol as P

        self._id += 1
        h = {"v": v, "id": self._id, "op": op, **fields}
        if self.token:
            h["token"] = self.token
        self.sock.send_multipart([P.pack(h)])
        if not self.sock.poll(int(1000 * (timeout_s or self.timeout_s)), zmq.POLLIN):
            raise CliError(EXIT_UNREACHABLE, f"no answer from {self.t.text} within {timeout_s or self.timeout_s:g} s "
                                             "(is 'tierkv server' running there? see --timeout)")
        frames = self.sock.recv_multipart()
        try:
            r = P.unpack_header(frames[0], max_map_len=1024)
        except P.ProtocolError as e:
            raise CliError(EXIT_UNREACHABLE, f"{self.t.text} sent an unreadable reply ({e}); is it a tierkv server?")
        if r.get("ok") is True:
            return r
        code, err = r.get("code"), str(r.get("err", ""))[:200]
        if code == "auth":
            raise CliError(EXIT_REFUSED, f"{self.t.text} refused the request: missing or wrong token (give --token "
                                         "or set $TIERKV_SERVER_TOKEN)")
        if code == "version":
            raise CliError(EXIT_REFUSED, f"{self.t.text} cannot do '{op}': {err}")
        raise CliError(EXIT_REFUSED, f"{self.t.text} refused '{op}': {code}: {err}")

    def protos(self) -> list:
        """Protocol versions the server speaks (a version-1 server does not list them: ``[1]``)."""
        r = self.call("ping")
        protos = r.get("protos") or [r.get("proto", 1)]
        return [p for p in protos if isinstance(p, int)]

    def need_admin(self) -> bool:
        """True if the server speaks protocol 2 (scan/verify). Raises CliError(4) for a server of only newer ones."""
        from tierkv.storage_backends.zmq import protocol as P

        protos = self.protos()
        if P.ADMIN_PROTOCOL_VERSION in protos:
            return True
        if protos and min(protos) > max(P.SUPPORTED_VERSIONS):
            raise CliError(EXIT_NEWER, f"{self.t.text} speaks protocol {protos}, newer than this tierkv "
                                       f"({list(P.SUPPORTED_VERSIONS)}); upgrade tierkv")
        return False

    def close(self) -> None:
        self.sock.close(0)
        self.ctx.term()


def _admin(args) -> ZmqAdmin:
    return ZmqAdmin(args._target, args.token, args.timeout)


# ----------------------------------------------------------------------------------------------- stats
def _stats_file(args) -> dict:
    from tierkv.storage_backends.file.store import QUARANTINE_DIR
    from tierkv.storage_backends.page_format import HEADER_BYTES, VERSION, PageFormatError, read_header

    root = _file_root(args._target)
    files = _list_files(root)
    now = time.time()
    per: dict[str, dict] = {}
    bad_headers = 0
    newer: dict[int, int] = {}
    with progress(len(files), "reading headers", args.quiet) as bar:
        for f in files:
            bar.update(1)
            d = per.get(f.ns_hex)
            if d is None:
                d = per[f.ns_hex] = {"namespace": f.ns_hex, "pages": 0, "bytes": 0, "payload_bytes": set(),
                                     "versions": set(), "bad_headers": 0, "ages": [0] * len(AGE_LABELS)}
            d["pages"] += 1
            d["bytes"] += f.size
            d["ages"][_age_bucket(now - f.mtime_ns / 1e9)] += 1
            try:
                with open(f.path, "rb", buffering=0) as fh:
                    info = read_header(fh.read(HEADER_BYTES))
            except (OSError, PageFormatError):
                d["bad_headers"] += 1
                bad_headers += 1
                continue
            d["versions"].add(info["version"])
            d["payload_bytes"].add(info["length"])
            if info["version"] > VERSION:
                newer[info["version"]] = newer.get(info["version"], 0) + 1
    if newer:
        v = max(newer)
        raise _newer_error(args._target.text, sum(newer.values()), v)
    for ns_hex, d in per.items():
        d["payload_bytes"] = sorted(d["payload_bytes"])
        d["versions"] = sorted(d["versions"])
        d["describe"] = _ns_info(root, ns_hex)
    try:
        quarantined = len(os.listdir(os.path.join(root, QUARANTINE_DIR)))
    except OSError:
        quarantined = 0
    return {"store": args._target.text, "kind": "file", "pages": sum(d["pages"] for d in per.values()),
            "bytes": sum(d["bytes"] for d in per.values()), "bad_headers": bad_headers, "quarantined": quarantined,
            "age_labels": list(AGE_LABELS), "namespaces": sorted(per.values(), key=lambda d: -d["bytes"])}


def _ns_info(root: str, ns_hex: str) -> Optional[dict]:
    """The optional ``namespace.json`` next to a namespace's pages (model_id, dtype, kv_layout, ...), if readable."""
    from tierkv.storage_backends.file.store import NAMESPACE_INFO_FILE

    try:
        with open(os.path.join(root, ns_hex, NAMESPACE_INFO_FILE)) as f:
            d = json.load(f)
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None


def _stats_zmq(args) -> dict:
    from tierkv.storage_backends.zmq import protocol as P

    a = _admin(args)
    try:
        admin = a.need_admin()
        st = a.call("stats").get("stats", {})
        out = {"store": args._target.text, "kind": "zmq", "pages": int(st.get("keys", 0)),
               "bytes": int(st.get("bytes", 0)), "capacity_bytes": st.get("capacity_bytes"),
               "server": {k: st.get(k) for k in ("tenant", "uptime_s", "hits", "misses", "sets", "evictions", "spilled",
                                                 "refused", "auth_failures", "errors", "rss_bytes", "spill")},
               "tenants": st.get("tenants") if isinstance(st.get("tenants"), dict) else None,
               "age_labels": list(AGE_LABELS), "namespaces": None}
        if not admin:
            out["note"] = "server speaks protocol 1 only: per-namespace stats need a newer tierkv server"
            return out
        r = a.call("scan", v=P.ADMIN_PROTOCOL_VERSION)
    finally:
        a.close()
    ns = []
    newer = 0
    for d in r.get("namespaces", []):
        vers = [v for v in d.get("versions", []) if isinstance(v, int)]
        if any(v > _page_version() for v in vers):
            newer += d.get("pages", 0)
        ns.append({"namespace": bytes(d["ns"]).hex(), "pages": d.get("pages", 0), "bytes": d.get("bytes", 0),
                   "payload_bytes": d.get("payload_bytes", []), "versions": vers, "ages": d.get("ages", []),
                   "describe": None})
    if newer:
        raise _newer_error(args._target.text, newer, max(v for d in ns for v in d["versions"]))
    out["pages"] = sum(d["pages"] for d in ns)  # memory and spill
    out["bytes"] = sum(d["bytes"] for d in ns)
    out["namespaces"] = sorted(ns, key=lambda d: -d["bytes"])
    out["traffic"] = _server_traffic(st, ns)
    return out


def _server_traffic(st: dict, ns: list) -> dict:
    """What a tierkv server counted since it started: pages written (``sets``) and read (``hits``), and their bytes
    when every namespace holds pages of one payload size."""
    sizes = {b for d in ns for b in d.get("payload_bytes", [])}
    out = {"written_pages": int(st.get("sets", 0) or 0), "read_pages": int(st.get("hits", 0) or 0)}
    if len(sizes) == 1:
        pb = sizes.pop()
        out.update(written_bytes=out["written_pages"] * pb, read_bytes=out["read_pages"] * pb)
    return out


def _engine_tiers(path: str) -> dict:
    """Per tier (L2, L3) bytes written and served, from an engine scheduler's stats file (``stats_path``), and
    whether the tier only writes (served under 1 % of what it wrote, :mod:`tierkv.connector.obs.tier_bytes`)."""
    from tierkv.connector.obs.tier_bytes import SERVED_FRACTION

    try:
        with open(path) as f:
            st = json.load(f)
    except OSError as e:
        raise CliError(EXIT_USAGE, f"--engine-stats {path}: cannot read it: {e.strerror or e}") from None
    except ValueError:
        raise CliError(EXIT_USAGE, f"--engine-stats {path}: not a JSON stats file") from None
    if not isinstance(st, dict) or "l2_written_bytes" not in st:
        role = st.get("role") if isinstance(st, dict) else None
        raise CliError(EXIT_USAGE, f"--engine-stats {path}: no per-tier byte counters in it"
                                   + (" (a worker's file: give the scheduler's)" if role == "worker" else
                                      " (give an engine scheduler's stats_path file)"))
    out = {}
    for tier in ("l2", "l3"):
        if f"{tier}_written_bytes" not in st:
            continue
        w, sv = int(st[f"{tier}_written_bytes"]), int(st.get(f"{tier}_served_bytes", 0))
        out[tier.upper()] = {"written_bytes": w, "served_bytes": sv,
                             "served_fraction": sv / w if w else None,
                             "write_only": bool(w) and sv < SERVED_FRACTION * w}
    return {"file": path, "tiers": out}


def _page_version() -> int:
    from tierkv.storage_backends.page_format import VERSION

    return VERSION


def _check_port(t: Target, timeout_s: float, what: str) -> None:
    try:
        with socket.create_connection((t.host, t.port), timeout=timeout_s):
            pass
    except OSError as e:
        raise CliError(EXIT_UNREACHABLE, f"cannot reach {what} at {t.host}:{t.port}: {e.strerror or e} (is it "
                                         "running there and listening on that address? see --timeout)") from None


def _stats_mooncake(args) -> dict:
    import urllib.request

    t = args._target
    _check_port(t, args.timeout, "the Mooncake master")
    url = f"http://{t.host}:{args.metrics_port}/metrics"
    try:
        with urllib.request.urlopen(url, timeout=args.timeout) as resp:
            text = resp.read().decode(errors="replace")
    except OSError as e:
        raise CliError(EXIT_UNREACHABLE, f"the Mooncake master at {t.host}:{t.port} answers, but its metrics at {url} "
                                         f"do not ({getattr(e, 'reason', e)}); give --metrics-port") from None
    m: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("master_") and " " in line:
            name, _, val = line.partition(" ")
            try:
                m[name] = float(val)
            except ValueError:
                pass
    if "master_key_count" not in m:
        raise CliError(EXIT_UNREACHABLE, f"{url} holds no master_key_count: not a Mooncake master's metrics endpoint")
    return {"store": t.text, "kind": "mooncake", "pages": int(m["master_key_count"]),
            "bytes": int(m.get("master_allocated_bytes", 0)),
            "capacity_bytes": int(m.get("master_total_capacity_bytes", 0)),
            "server": {"active_clients": int(m.get("master_active_clients", 0))}, "age_labels": list(AGE_LABELS),
            "namespaces": None,
            "note": "a Mooncake master does not list its objects: pages = every key it holds (tierkv's and any "
                    "other client's), bytes = allocated segment bytes; no namespaces or ages"}


def _stats_lmcache(args) -> dict:
    from tierkv.storage_backends.lmcache.store import server_info
    from tierkv.storage_backends.zmq.channel import ChannelFailed

    t = args._target
    host = f"[{t.host}]" if ":" in t.host else t.host
    _check_port(t, args.timeout, "the LMCache server")
    try:
        info = server_info(f"tcp://{host}:{t.port}", timeout_s=args.timeout)
    except ChannelFailed as e:
        raise CliError(EXIT_UNREACHABLE, f"no answer from the LMCache server at {t.host}:{t.port} ({e}); is it "
                                         "running there? see --timeout") from None
    except ValueError as e:
        raise CliError(EXIT_UNREACHABLE, str(e)) from None
    return {"store": t.text, "kind": "lmcache", "pages": None, "bytes": None, "capacity_bytes": info["pool_bytes"],
            "server": {"chunk_size": info["chunk_size"], "experimental": ",".join(info["experimental"]) or "none",
                       "shm_segment": info["shm_name"], "shm_resident_bytes": info["shm_resident_bytes"]},
            "age_labels": list(AGE_LABELS), "namespaces": None,
            "note": "an LMCache server cannot list its chunks (no listing op over ZMQ; its HTTP /cache/objects lists "
                    "L2 adapters only): pages, bytes, namespaces and ages are unknown. capacity = its shared-memory "
                    "L1 pool; shm_resident_bytes = pool bytes ever written (a high-water mark, this host only)"}


#: keys of one pipelined round trip of ``store stats`` / ``store clear`` on a redis server
REDIS_BATCH = 512


def _redis_client(args):
    """A redis-py client on the target (one connection, ``--timeout`` per call) after a PING. Raises CliError: 3 for
    a server that does not answer, 5 for one that refuses the password (naming --password)."""
    import redis

    from tierkv.storage_backends.redis.config import RedisStoreConfig
    from tierkv.storage_backends.redis.connect import standalone_client

    t = args._target
    cfg = RedisStoreConfig(url=t.path, username=args.username, password=args.password or None,
                           timeout_s=args.timeout, pool_size=1)
    c = standalone_client(cfg)
    try:
        c.ping()
    except (redis.AuthenticationError, redis.AuthenticationWrongNumberOfArgsError) as e:
        c.close()
        raise CliError(EXIT_REFUSED, f"{t.text} refused the password ({e}): give --password or set "
                                     "$TIERKV_REDIS_PASSWORD (and --username for an ACL user)") from None
    except redis.ResponseError as e:
        c.close()
        if "NOAUTH" in str(e) or "WRONGPASS" in str(e):
            raise CliError(EXIT_REFUSED, f"{t.text} needs a password ({e}): give --password or set "
                                         "$TIERKV_REDIS_PASSWORD") from None
        raise CliError(EXIT_REFUSED, f"{t.text} refused PING: {e}") from None
    except (redis.ConnectionError, redis.TimeoutError, OSError) as e:
        c.close()
        raise CliError(EXIT_UNREACHABLE, f"cannot reach the redis server at {t.text}: {e} (is it running there? "
                                         "see --timeout)") from None
    return c


def _redis_call(t: Target, fn, *a):
    """``fn(*a)`` with a redis fault turned into CliError(3)."""
    import redis

    try:
        return fn(*a)
    except redis.RedisError as e:
        raise CliError(EXIT_UNREACHABLE, f"redis server at {t.text} failed during the walk: {e}") from None


def _check_key_prefix(prefix: str) -> None:
    from tierkv.storage_backends.redis.config import _PREFIX_RE

    if not _PREFIX_RE.match(prefix):
        raise CliError(EXIT_USAGE, f"invalid --key-prefix {prefix!r}: 1-64 characters of A-Z a-z 0-9 _ . - "
                                   "(as l3.redis.key_prefix)")


def _redis_keys(c, t: Target, prefix: str) -> list:
    return _redis_call(t, lambda: list(c.scan_iter(match=_redis_glob(prefix) + ":*", count=1000)))


def _redis_glob(text: str) -> str:
    return "".join("\\" + ch if ch in "*?[]\\" else ch for ch in text)


def _stats_redis(args) -> dict:
    import re

    from tierkv.storage_backends.page_format import HEADER_BYTES, PageFormatError, read_header

    t = args._target
    _check_key_prefix(args.key_prefix)
    c = _redis_client(args)
    try:
        info = _redis_call(t, c.info)
        dbsize = int(_redis_call(t, c.dbsize))
        names = _redis_keys(c, t, args.key_prefix)
        per: dict[str, dict] = {}
        bad_headers = foreign = 0
        newer: dict[int, int] = {}
        with progress(len(names), "reading headers", args.quiet) as bar:
            for s in range(0, len(names), REDIS_BATCH):
                chunk = names[s:s + REDIS_BATCH]
                pipe = c.pipeline(transaction=False)
                for n in chunk:
                    pipe.getrange(n, 0, HEADER_BYTES - 1)
                    pipe.strlen(n)
                    pipe.object("idletime", n)
                res = _redis_call(t, pipe.execute, False)
                bar.update(len(chunk))
                for i, n in enumerate(chunk):
                    hdr, size, idle = res[3 * i:3 * i + 3]
                    parts = n.decode(errors="replace").split(":")
                    if len(parts) != 3 or not re.fullmatch(r"[0-9a-f]{32}", parts[1]):
                        foreign += 1  # under the prefix but not named as a page
                        continue
                    if isinstance(hdr, Exception) and "WRONGTYPE" not in str(hdr) or hdr in (b"", None):
                        continue  # gone meanwhile (evicted, expired) or unreadable now
                    d = per.get(parts[1])
                    if d is None:
                        d = per[parts[1]] = {"namespace": parts[1], "pages": 0, "bytes": 0, "payload_bytes": set(),
                                             "versions": set(), "bad_headers": 0, "ages": [0] * len(AGE_LABELS)}
                    d["pages"] += 1
                    d["bytes"] += size if isinstance(size, int) else 0
                    if isinstance(idle, int):
                        d["ages"][_age_bucket(idle)] += 1
                    try:
                        if isinstance(hdr, Exception):
                            raise PageFormatError(str(hdr))
                        h = read_header(hdr)
                    except PageFormatError:
                        d["bad_headers"] += 1
                        bad_headers += 1
                        continue
                    d["versions"].add(h["version"])
                    d["payload_bytes"].add(h["length"])
                    if h["version"] > _page_version():
                        newer[h["version"]] = newer.get(h["version"], 0) + 1
    finally:
        c.close()
    if newer:
        raise _newer_error(t.text, sum(newer.values()), max(newer))
    for d in per.values():
        d["payload_bytes"] = sorted(d["payload_bytes"])
        d["versions"] = sorted(d["versions"])
        d["describe"] = None
    note = None
    if str(info.get("cluster_enabled", 0)) == "1":
        note = "a cluster node: only the keys of this node are listed (run stats on every master)"
    elif not str(info.get("maxmemory_policy", "")).startswith("allkeys") and int(info.get("maxmemory", 0) or 0):
        note = (f"maxmemory_policy {info.get('maxmemory_policy')}: a full server refuses writes (counted 'refused' by "
                "the engines) instead of evicting pages")
    return {"store": t.text, "kind": "redis", "pages": sum(d["pages"] for d in per.values()),
            "bytes": sum(d["bytes"] for d in per.values()), "bad_headers": bad_headers,
            "capacity_bytes": int(info.get("maxmemory", 0) or 0) or None,
            "server": {"version": info.get("redis_version"), "key_prefix": args.key_prefix, "dbsize": dbsize,
                       "other_keys": dbsize - len(names), "foreign_keys": foreign,
                       "used_memory": info.get("used_memory"), "maxmemory_policy": info.get("maxmemory_policy"),
                       "evicted_keys": info.get("evicted_keys"), "expired_keys": info.get("expired_keys"),
                       "keyspace_hits": info.get("keyspace_hits"), "keyspace_misses": info.get("keyspace_misses"),
                       "connected_clients": info.get("connected_clients"), "uptime_s": info.get("uptime_in_seconds")},
            "age_labels": list(AGE_LABELS), "namespaces": sorted(per.values(), key=lambda d: -d["bytes"]),
            **({"note": note} if note else {})}


def _clear_redis(args) -> int:
    t = args._target
    _check_key_prefix(args.key_prefix)
    c = _redis_client(args)
    try:
        if args.all_namespaces:
            names = _redis_keys(c, t, args.key_prefix)
        else:
            names = [n for ns in args.namespace for n in _redis_keys(c, t, f"{args.key_prefix}:{ns}")]
        n = 0
        for s in range(0, len(names), REDIS_BATCH):
            n += int(_redis_call(t, c.unlink, *names[s:s + REDIS_BATCH]))
    finally:
        c.close()
    print(f"{t.text}: removed {n} pages")
    return EXIT_OK


def _print_stats(d: dict) -> None:
    if d["pages"] is None:
        head = f"{d['store']} ({d['kind']}): pages and bytes not listed"
    else:
        head = f"{d['store']} ({d['kind']}): {d['pages']} pages, {human_bytes(d['bytes'])}"
    if d.get("capacity_bytes"):
        head += f"{',' if d['pages'] is None else ' of'} {human_bytes(d['capacity_bytes'])} capacity"
    if d.get("namespaces") is not None:
        head += f", {len(d['namespaces'])} namespace(s)"
    print(head)
    if d.get("quarantined") or d.get("bad_headers"):
        print(f"  quarantined files: {d.get('quarantined', 0)}, records with an unreadable header: "
              f"{d.get('bad_headers', 0)}")
    for k, v in (d.get("server") or {}).items():
        if v is not None:
            print(f"  {k}: {v}")
    for name, t in sorted((d.get("tenants") or {}).items()):
        if isinstance(t, dict):
            print(f"tenant {name}: {t.get('pages')} pages, {human_bytes(int(t.get('bytes') or 0))} of "
                  f"{human_bytes(int(t.get('quota_bytes') or 0))} quota, hits {t.get('hits')}, misses "
                  f"{t.get('misses')}, sets {t.get('sets')}, refused {t.get('refused')}, evictions "
                  f"{t.get('evictions')}" + ("" if t.get("evict", True) else " (eviction off)"))
    for ns in d.get("namespaces") or []:
        pb = ",".join(str(x) for x in ns["payload_bytes"]) or "?"
        vers = ",".join(str(x) for x in ns["versions"]) or "?"
        print(f"namespace {ns['namespace']}: {ns['pages']} pages, {human_bytes(ns['bytes'])}, "
              f"page_bytes {pb}, format v{vers}")
        if ns.get("describe"):
            print("  " + ", ".join(f"{k}={v}" for k, v in ns["describe"].items()))
        print("  age: " + "  ".join(f"{lab} {n}" for lab, n in zip(d["age_labels"], ns["ages"])))
    t = d.get("traffic")
    if t:
        print(f"  written: {t['written_pages']} pages" + (f" ({human_bytes(t['written_bytes'])})" if "written_bytes" in t
                                                         else "")
              + f", read: {t['read_pages']} pages" + (f" ({human_bytes(t['read_bytes'])})" if "read_bytes" in t else ""))
    eng = d.get("engine")
    if eng:
        for tier, v in eng["tiers"].items():
            frac = "" if v["served_fraction"] is None else f" ({100 * v['served_fraction']:.2f} %)"
            print(f"engine {tier}: wrote {human_bytes(v['written_bytes'])}, served {human_bytes(v['served_bytes'])}"
                  f"{frac}" + (": writes only; for L3 consider l3.admission: second_sight" if v["write_only"] else ""))
    if d.get("note"):
        print(f"note: {d['note']}")


def cmd_stats(args) -> int:
    engine = _engine_tiers(args.engine_stats) if args.engine_stats else None  # bad input before the store
    d = {"file": _stats_file, "zmq": _stats_zmq, "mooncake": _stats_mooncake,
         "lmcache": _stats_lmcache, "redis": _stats_redis}[args._target.kind](args)
    if engine is not None:
        d["engine"] = engine
    if args.json:
        print(json.dumps(d, indent=1, default=list))
    else:
        _print_stats(d)
    return EXIT_OK


# ----------------------------------------------------------------------------------------------- verify
def _verify_file(args) -> dict:
    from tierkv.storage_backends.file.store import quarantine_file, read_record_file
    from tierkv.storage_backends.page_format import NewerFormatError, PageFormatError, check_record

    root = _file_root(args._target)
    files = _list_files(root, [args.namespace] if args.namespace else None)
    reasons: dict[str, int] = {}
    bad: list[tuple[str, str]] = []
    newer: dict[int, int] = {}
    ok = 0
    with progress(len(files), "verifying", args.quiet) as bar:
        for f in files:
            bar.update(1)
            try:
                hdr, payload = read_record_file(f.path)
            except FileNotFoundError:
                continue  # evicted by a running engine meanwhile
            except OSError as e:
                reasons[f"unreadable: {e.strerror}"] = reasons.get(f"unreadable: {e.strerror}", 0) + 1
                continue
            try:
                check_record(hdr, payload, key=f.key, namespace=bytes.fromhex(f.ns_hex))
                ok += 1
            except NewerFormatError:
                v = int.from_bytes(hdr[4:6], "little")
                newer[v] = newer.get(v, 0) + 1
            except PageFormatError as e:
                reasons[str(e)] = reasons.get(str(e), 0) + 1
                bad.append((f.path, str(e)))
    if newer:
        raise _newer_error(args._target.text, sum(newer.values()), max(newer))
    removed = 0
    if args.fix and bad:
        with progress(len(bad), "quarantining" if not args.delete else "deleting", args.quiet) as bar:
            for path, why in bad:
                bar.update(1)
                try:
                    if args.delete:
                        os.unlink(path)
                    else:
                        quarantine_file(root, path, why)
                    removed += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise CliError(EXIT_USAGE, f"cannot {'delete' if args.delete else 'quarantine'} {path}: "
                                               f"{e.strerror or e}") from None
    return {"store": args._target.text, "checked": ok + len(bad), "ok": ok, "bad": len(bad), "removed": removed,
            "action": ("deleted" if args.delete else "quarantined") if args.fix else "none", "reasons": reasons}


#: records a ``tierkv server`` checks per ``verify`` request (it answers other clients between two requests)
VERIFY_RECORDS_PER_REQUEST = 256


def verify_server(a: ZmqAdmin, namespace: Optional[str], fix: bool, quiet: bool = True,
                  per_request: int = VERIFY_RECORDS_PER_REQUEST, on_step: Optional[Any] = None) -> dict:
    """Verify a ``tierkv server``'s records in steps of ``per_request`` records (a ``verify`` session, protocol 2):
    the server answers other requests between two steps. ``on_step(reply)``, when given, is called after every step
    but the last with the running totals (``checked``, ``good``, ``bad``, ``newer``, ``removed``, ``reasons``).
    A server that does not know sessions checks everything in its first reply (then no ``on_step`` call). Returns
    the last reply. Raises :class:`CliError` as :meth:`ZmqAdmin.call` does."""
    from tierkv.storage_backends.zmq import protocol as P

    fields: dict = {"fix": bool(fix), "limit": per_request}
    if namespace:
        fields["ns"] = bytes.fromhex(namespace)
    with progress(None, "verifying", quiet) as bar:
        r = a.call("verify", v=P.ADMIN_PROTOCOL_VERSION, **fields)
        while r.get("done") is False and type(r.get("session")) is int:
            bar.update(int(r.get("checked", 0)) - bar.n)
            if on_step is not None:
                on_step(r)
            r = a.call("verify", v=P.ADMIN_PROTOCOL_VERSION, session=r["session"], limit=per_request)
    return r


def _verify_zmq(args) -> dict:
    a = _admin(args)
    try:
        if not a.need_admin():
            raise CliError(EXIT_REFUSED, f"{args._target.text} speaks protocol 1 only; 'store verify' needs a "
                                         "tierkv server with protocol 2 (upgrade the server)")
        r = verify_server(a, args.namespace, args.fix, args.quiet)
    finally:
        a.close()
    if r.get("newer"):
        raise _newer_error(args._target.text, int(r["newer"]), _page_version() + 1)
    return {"store": args._target.text, "checked": r.get("checked", 0), "ok": r.get("good", 0), "bad": r.get("bad", 0),
            "removed": r.get("removed", 0), "action": "dropped" if args.fix else "none",
            "reasons": r.get("reasons", {})}


def cmd_verify(args) -> int:
    kind = args._target.kind
    if kind == "lmcache":
        raise CliError(EXIT_REFUSED, "an LMCache server cannot list its chunks, so its pages cannot be walked; "
                                     "tierkv verifies every LMCache page on read (counter 'corrupt')")
    if kind == "redis":
        raise CliError(EXIT_REFUSED, "'store verify' does not walk a redis server; tierkv verifies every redis page "
                                     "on read (counter 'corrupt'); 'store stats' counts pages with a bad header")
    if kind == "mooncake":
        raise CliError(EXIT_REFUSED, "a Mooncake master cannot list its objects, so its pages cannot be walked; "
                                     "tierkv verifies every Mooncake page on read (counter 'corrupt') and removes "
                                     "bad ones")
    if args.delete and not args.fix:
        raise CliError(EXIT_USAGE, "--delete only makes sense with --fix")
    d = _verify_file(args) if kind == "file" else _verify_zmq(args)
    if args.json:
        print(json.dumps(d, indent=1))
    else:
        print(f"{d['store']}: checked {d['checked']}, ok {d['ok']}, bad {d['bad']}, "
              f"{d['action']} {d['removed']}")
        for why, n in sorted(d["reasons"].items()):
            print(f"  {n} x {why}")
    return EXIT_FOUND if d["bad"] else EXIT_OK


# ----------------------------------------------------------------------------------------------- gc, clear
def cmd_gc(args) -> int:
    t = args._target
    if t.kind != "file":
        raise CliError(EXIT_REFUSED, f"'store gc' works on a file store directory; {t.text} evicts by itself "
                                     "(its capacity)")
    root = _file_root(t)
    files = sorted(_list_files(root), key=lambda f: f.mtime_ns)  # least recently used first
    total = sum(f.size for f in files)
    removed = freed = 0
    with progress(len(files), "gc", args.quiet) as bar:
        for f in files:
            if total - freed <= args.max_bytes:
                break
            bar.update(1)
            if not args.dry_run:
                try:
                    os.unlink(f.path)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    raise CliError(EXIT_USAGE, f"cannot delete {f.path}: {e.strerror or e}") from None
            removed += 1
            freed += f.size
    verb = "would remove" if args.dry_run else "removed"
    print(f"{t.text}: {verb} {removed} least recently used pages ({human_bytes(freed)}); "
          f"{len(files) - removed} pages, {human_bytes(total - freed)} left (limit {human_bytes(args.max_bytes)})")
    return EXIT_OK


def cmd_clear(args) -> int:
    t = args._target
    if not args.namespace and not args.all_namespaces:
        raise CliError(EXIT_USAGE, "name what to clear: --namespace HEX (repeatable) or --all-namespaces")
    if t.kind == "lmcache":
        raise CliError(EXIT_REFUSED, "an LMCache server has no per-namespace clear (its 'clear' drops every model's "
                                     "chunks); restart it to empty it")
    if t.kind == "file":
        root = _file_root(t)
        files = _list_files(root, args.namespace or None)
        n = 0
        with progress(len(files), "clearing", args.quiet) as bar:
            for f in files:
                bar.update(1)
                try:
                    os.unlink(f.path)
                    n += 1
                except FileNotFoundError:
                    pass
                except OSError as e:
                    raise CliError(EXIT_USAGE, f"cannot delete {f.path}: {e.strerror or e}") from None
        print(f"{t.text}: removed {n} pages")
        return EXIT_OK
    if t.kind == "zmq":
        from tierkv.storage_backends.zmq import protocol as P

        a = _admin(args)
        try:
            namespaces = args.namespace
            if args.all_namespaces:
                if not a.need_admin():
                    raise CliError(EXIT_REFUSED, f"{t.text} speaks protocol 1 only: give --namespace")
                r = a.call("scan", v=P.ADMIN_PROTOCOL_VERSION)
                namespaces = [bytes(d["ns"]).hex() for d in r.get("namespaces", [])]
            n = 0
            for ns in namespaces:
                n += int(a.call("clear", ns=bytes.fromhex(ns)).get("cleared", 0))
        finally:
            a.close()
        print(f"{t.text}: cleared {len(namespaces)} namespace(s), {n} pages in memory (spilled pages dropped too)")
        return EXIT_OK
    if t.kind == "redis":
        return _clear_redis(args)
    return _clear_mooncake(args)


def _clear_mooncake(args) -> int:
    import re

    t = args._target
    if args.all_namespaces:
        pats = ["^" + re.escape(args.key_prefix + "/")]
    else:
        pats = ["^" + re.escape(f"{args.key_prefix}/{ns}/") for ns in args.namespace]
    _check_port(t, args.timeout, "the Mooncake master")
    from tierkv.storage_backends.common import ConfigError
    from tierkv.storage_backends.mooncake.store import MooncakeStore

    meta = args.metadata_server or f"http://{t.host}:8080/metadata"
    try:
        st = MooncakeStore(b"\0" * 16, 4096, master_address=f"{t.host}:{t.port}", metadata_server=meta,
                           global_segment_size=0, local_buffer_size=0, setup_timeout_s=args.timeout,
                           key_prefix=args.key_prefix)
    except ConfigError as e:
        raise CliError(EXIT_UNREACHABLE, f"cannot join the Mooncake master at {t.host}:{t.port}: {e}") from None
    try:
        n = 0
        for pat in pats:
            r = st.client.remove_by_regex(pat, True)
            n += max(int(r), 0)
    finally:
        st.close()
    print(f"{t.text}: removed {n} objects")
    return EXIT_OK


# ----------------------------------------------------------------------------------------------- argparse
def _common(p: argparse.ArgumentParser, target_help: str) -> None:
    p.add_argument("target", metavar="PATH|URL", help=target_help)
    p.add_argument("--token", default=os.environ.get("TIERKV_SERVER_TOKEN"),
                   help="token of a tierkv server (default: $TIERKV_SERVER_TOKEN)")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for a server's answer (default 10)")
    p.add_argument("--metrics-port", type=int, default=DEFAULT_MOONCAKE_METRICS_PORT,
                   help=f"Mooncake master metrics port (default {DEFAULT_MOONCAKE_METRICS_PORT})")
    p.add_argument("--password", default=os.environ.get("TIERKV_REDIS_PASSWORD"),
                   help="AUTH password of a redis server (default: $TIERKV_REDIS_PASSWORD)")
    p.add_argument("--username", default=None, help="ACL user of a redis server (default: the default user)")
    p.add_argument("--quiet", "-q", action="store_true", help="no progress bar")


_ADDR = ("a file store directory, tcp://HOST:PORT (tierkv server), mooncake://HOST:PORT (Mooncake master RPC "
         "address), redis://HOST:PORT/DB (redis server) or, for stats, lmcache://HOST:PORT (LMCache server)")


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.epilog = "exit codes: 0 ok, 1 bad records found (verify), 2 bad input, 3 store unreachable, 4 newer format, " \
               "5 refused (token, or not possible for this store kind)"
    sub = p.add_subparsers(dest="store_command", metavar="ACTION")
    sub.required = True
    s = sub.add_parser("stats", help="pages, bytes, namespaces and an age histogram",
                       description="Pages, bytes, namespaces (digest, page size, format version) and an age histogram "
                                   "(time since each page was last written or read) of a store.")
    _common(s, _ADDR)
    s.add_argument("--json", action="store_true", help="print JSON instead of text")
    s.add_argument("--key-prefix", default="tierkv", help="key prefix of a redis store (l3.redis.key_prefix)")
    s.add_argument("--engine-stats", metavar="FILE", default=None,
                   help="an engine scheduler's stats file (config stats_path): also print the bytes each tier (L2, "
                        "L3) wrote and served, and flag a tier that only writes")
    s.set_defaults(_store_run=cmd_stats)
    v = sub.add_parser("verify", help="read every record and check its checksums",
                       description="Read every record, check header and payload checksums, namespace, key and "
                                   "length; print counts. With --fix move bad records to <root>/quarantine/ (file "
                                   "store; --delete removes them) or drop them (tierkv server).")
    _common(v, "a file store directory or tcp://HOST:PORT")
    v.add_argument("--fix", action="store_true", help="quarantine (file store) or drop (server) bad records")
    v.add_argument("--delete", action="store_true", help="with --fix: delete bad files instead of quarantining them")
    v.add_argument("--namespace", type=_ns_arg, default=None, help="only this namespace (32 hex characters)")
    v.add_argument("--json", action="store_true", help="print JSON instead of text")
    v.set_defaults(_store_run=cmd_verify)
    g = sub.add_parser("gc", help="evict least recently used pages of a file store down to --max-bytes",
                       description="Delete the least recently used page files (oldest mtime) of a file store until "
                                   "its page files take at most --max-bytes. Safe while engines run (a deleted page "
                                   "is a miss).")
    _common(g, "a file store directory")
    g.add_argument("--max-bytes", type=_bytes_arg, required=True, help="bytes to keep at most (e.g. 20GiB)")
    g.add_argument("--dry-run", action="store_true", help="only print what would be removed")
    g.set_defaults(_store_run=cmd_gc)
    c = sub.add_parser("clear", help="remove every page of one or more namespaces",
                       description="Remove every page of the given namespaces (see 'tierkv store stats').")
    _common(c, _ADDR)
    c.add_argument("--namespace", type=_ns_arg, action="append", default=[], help="namespace digest (32 hex chars); "
                   "repeatable")
    c.add_argument("--all-namespaces", action="store_true", help="remove every tierkv page")
    c.add_argument("--metadata-server", default=None,
                   help="Mooncake metadata server URL (default http://HOST:8080/metadata)")
    c.add_argument("--key-prefix", default="tierkv", help="key prefix of a Mooncake or redis store "
                   "(l3.mooncake.key_prefix, l3.redis.key_prefix)")
    c.set_defaults(_store_run=cmd_clear)
    return p


def run(args: argparse.Namespace) -> int:
    prog = f"tierkv store {args.store_command}"
    try:
        args._target = _lmcache_target(args.target) or _redis_target(args.target) or parse_target(args.target)
        return args._store_run(args)
    except CliError as e:
        return fail(prog, e)
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
