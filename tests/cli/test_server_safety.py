"""A safe ``tierkv server`` by default: a bind beyond loopback needs a token (or ``--allow-unauthenticated``), every op
and so every destructive one needs the token once one is set, and the token is in no reply and no log line."""
from __future__ import annotations

import argparse
import subprocess
import sys

import msgpack
import pytest

from tests.helpers.cli import NS_A, key, page
from tierkv.storage_backends.zmq import protocol as P
from tierkv import cli_server
from tierkv.storage_backends.zmq import server as zmq_server

TOKEN = "Tk-9f3c2a7e51"


@pytest.mark.parametrize("host", ["0.0.0.0", "192.0.2.10", "::", "eth0"])
def test_non_loopback_bind_without_token_refuses_to_start(host, fresh_env):
    r = subprocess.run([sys.executable, "-m", "tierkv.cli_server", "--host", host, "--port", "0"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == cli_server.EXIT_REFUSED and r.stdout == ""  # no ready line: it never listened
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "--allow-unauthenticated" in lines[0] and host in lines[0]


def test_loopback_addresses_are_recognised():
    assert all(zmq_server.is_loopback(h) for h in ("127.0.0.1", "127.3.4.5", "::1", "[::1]", "localhost"))
    assert not any(zmq_server.is_loopback(h) for h in ("0.0.0.0", "::", "10.0.0.1", "eth0", "example.org"))


class _Bound(Exception):
    pass


@pytest.mark.parametrize("extra,expect_token", [(["--allow-unauthenticated"], None), (["--token", TOKEN], TOKEN)])
def test_non_loopback_bind_starts_with_token_or_explicit_opt_out(monkeypatch, extra, expect_token, fresh_env):
    """This machine's tests may bind loopback only, so the server object is replaced here by one that records its
    arguments instead of binding (the refusal above needs no bind and runs the real process)."""
    seen = {}

    def fake_server(**kw):
        seen.update(kw)
        raise _Bound

    monkeypatch.setattr(zmq_server, "CacheServer", fake_server)
    monkeypatch.setattr(zmq_server, "keep_freed_memory", lambda n: False)
    args = cli_server.add_arguments(argparse.ArgumentParser()).parse_args(["--host", "0.0.0.0", *extra])
    with pytest.raises(_Bound):
        cli_server.run(args)
    assert seen["host"] == "0.0.0.0" and seen["token"] == expect_token


def test_token_file_is_read_and_an_empty_one_refused(tmp_path, monkeypatch, fresh_env):
    f = tmp_path / "tok"
    f.write_text("")
    args = cli_server.add_arguments(argparse.ArgumentParser()).parse_args(["--token-file", str(f)])
    assert cli_server.run(args) == cli_server.EXIT_REFUSED
    f.write_text(TOKEN + "\n")
    seen = {}

    def fake_server(**kw):
        seen.update(kw)
        raise _Bound

    monkeypatch.setattr(zmq_server, "CacheServer", fake_server)
    with pytest.raises(_Bound):
        cli_server.run(args)
    assert seen["token"] == TOKEN


@pytest.fixture
def srv(tmp_path, fresh_env):
    """A real server process with a token, debug logging into a file, a store client and 3 pages of NS_A."""
    from tests.helpers.fixtures_zmq import ZmqHandle

    h = ZmqHandle(tmp_path, 4096, NS_A, token=TOKEN, server_args=("--log-level", "debug"))
    assert all(h.backend.batch_set([key(i) for i in range(3)], [page(i, 4096) for i in range(3)]))
    yield h
    h.close()


def _req(h, **fields) -> dict:
    from tests.helpers.fixtures_zmq import decode_reply, raw_request

    hdr = {"v": P.PROTOCOL_VERSION, "id": 7, **fields}
    rep = raw_request(h.endpoint, hdr)
    assert rep is not None, f"no reply to {fields.get('op')}"
    return decode_reply(rep)


def test_destructive_ops_need_the_token(srv):
    ns, ks = NS_A, [key(0), key(1)]
    for op, extra in (("delete", {"keys": ks}), ("clear", {}), ("verify", {"fix": True, "v": 2})):
        for tok in ({}, {"token": "not-it"}):
            r = _req(srv, op=op, ns=ns, **extra, **tok)
            assert r["ok"] is False and r["code"] == "auth", (op, tok, r)
        assert srv.backend.batch_exists([key(0), key(1), key(2)]) == 3, op  # nothing was dropped
    r = _req(srv, op="delete", ns=ns, keys=ks, token=TOKEN)
    assert r["ok"] is True and r["deleted"] == 2
    r = _req(srv, op="clear", ns=ns, token=TOKEN)
    assert r["ok"] is True and srv.backend.batch_exists([key(2)]) == 0


def test_no_reply_or_log_line_contains_the_token(srv):
    """Requests that put the token (or a wrong one that contains it) where a server echoes text: the op name, the
    version, a key, the namespace, an unknown field; refused and accepted ones. No reply frame and no line of the
    server's debug log holds the token."""
    replies = [
        _req(srv, op=TOKEN, ns=NS_A, token=TOKEN),                  # unknown op named like the token
        _req(srv, op="get", ns=NS_A, keys=[TOKEN], token=TOKEN),    # invalid key = the token
        _req(srv, op="get", ns=TOKEN, keys=[key(0)], token=TOKEN),  # namespace = the token
        _req(srv, op="exists", v=TOKEN, keys=[key(0)], token=TOKEN),  # version = the token
        _req(srv, op="ping", token=TOKEN + "x"),                    # wrong token containing the right one
        _req(srv, op="ping", token=TOKEN[:-1]),                     # a prefix of it
        _req(srv, op="stats", token=TOKEN),
        _req(srv, op="scan", v=2, token=TOKEN),
        _req(srv, op="verify", v=2, token=TOKEN),
        _req(srv, op="scan", v=1, token=TOKEN),                     # admin op on protocol 1: refused
    ]
    assert [r["ok"] for r in replies] == [False] * 6 + [True] * 3 + [False]
    assert replies[0]["code"] == "unknown_op" and "***" in replies[0]["err"]
    assert replies[-1]["code"] == "version"
    blob = b"".join(msgpack.packb(r, use_bin_type=True) for r in replies)
    assert TOKEN.encode() not in blob
    srv.close()  # flush and stop: the whole log is written
    log = open(srv.log_path).read()
    assert "refused" in log and "serving on" in log  # the log was written at debug level
    assert TOKEN not in log


def test_ping_lists_protocols_and_whether_a_token_is_required(srv):
    r = _req(srv, op="ping", token=TOKEN)
    assert r["protos"] == [1, 2, 3] and r["token_required"] is True and r["v"] == 1 and r["shm"] is True


def test_port_in_use_is_a_one_line_error_not_a_crash(srv):
    """A second server on a port that is taken: exit 5 (refused) and one line naming the address, no traceback."""
    port = srv.endpoint.rsplit(":", 1)[1]
    r = subprocess.run([sys.executable, "-m", "tierkv.cli_server", "--port", port],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == cli_server.EXIT_REFUSED and r.stdout == ""
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and f"127.0.0.1:{port}" in lines[0] and "in use" in lines[0], r.stderr
