"""``tierkv server``: run the L3 ZMQ cache server (:class:`tierkv.storage_backends.zmq.server.CacheServer`) from the
command line. ``python -m tierkv.cli_server`` takes the same flags. The server module
imports nothing from the command line, so the two never import each other.

Exit codes are :mod:`tierkv.cli_common`'s: 0 after SIGTERM/SIGINT, :data:`~tierkv.cli_common.EXIT_USAGE` for a bad
flag, :data:`~tierkv.cli_common.EXIT_REFUSED` when the server refuses to start (a bind beyond loopback without a
token, an unreadable or empty ``--token-file``, a bad ``--tokens-file`` (the message names the line), an address it
cannot listen on); each failure is one line on stderr. SIGHUP re-reads ``--tokens-file`` (docs/tenants.md); a bad file
is logged with its line and the tenants in use stay.
"""
from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
from typing import Optional

from tierkv.cli_common import EXIT_OK, EXIT_REFUSED, CliError, fail
from tierkv.storage_backends.zmq import protocol as P
from tierkv.storage_backends.zmq import server as zmq_server
from tierkv.storage_backends.common import parse_bytes
from tierkv.storage_backends.eviction import POLICIES

log = logging.getLogger("tierkv.zmq_server")

#: the smallest ``--max-message-bytes`` the CLI accepts: a client needs one page plus 64 KiB of slack per message
#: (see ``l3.zmq.max_message_bytes``), so below this no realistic page could be stored
MIN_CLI_MAX_MESSAGE_BYTES = 1 << 20


def _size(text: str) -> int:
    """Parse a byte size the way the YAML configs do (:func:`tierkv.storage_backends.common.parse_bytes`): an integer,
    or a number with a unit, ``K``/``KB``/``M``/``MB``/``G``/``GB`` = powers of 1000 and ``KiB``/``MiB``/``GiB`` =
    powers of 1024 (``512MiB``, ``8GiB``, ``10GB``). Raises argparse.ArgumentTypeError otherwise or for sizes <= 0."""
    try:
        v = parse_bytes(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid byte size {text!r} (e.g. 1073741824, 512MiB, 8GiB, 10GB)") from None
    if v <= 0:
        raise argparse.ArgumentTypeError(f"byte size must be > 0, got {text!r}")
    return v


def _message_size(text: str) -> int:
    v = _size(text)
    if v < MIN_CLI_MAX_MESSAGE_BYTES:
        raise argparse.ArgumentTypeError(
            f"--max-message-bytes {text!r} is below {MIN_CLI_MAX_MESSAGE_BYTES} bytes (1 MiB): clients need one page "
            "plus 64 KiB per message, so every set would be refused")
    return v


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The server's flags."""
    p.epilog = (f"exit codes: 0 stopped by SIGTERM/SIGINT, 2 bad flag, {EXIT_REFUSED} refused to start (a --host beyond "
                "loopback without a token, an unreadable or empty --token-file, a bad --tokens-file, an address it "
                "cannot listen on); SIGHUP re-reads --tokens-file")
    p.add_argument("--host", default="127.0.0.1",
                   help="bind address (default 127.0.0.1; give 0.0.0.0 or an interface address explicitly to expose it)")
    p.add_argument("--port", type=int, default=zmq_server.DEFAULT_PORT,
                   help=f"TCP port, 0 = any free port (default {zmq_server.DEFAULT_PORT})")
    p.add_argument("--capacity-bytes", type=_size, default=zmq_server.DEFAULT_CAPACITY_BYTES,
                   help="in-memory capacity in bytes (e.g. 8GiB; KiB/MiB/GiB = 1024-based, KB/MB/GB or K/M/G = "
                        "1000-based, as in the YAML configs), LRU eviction (default 1 GiB)")
    p.add_argument("--spill-dir", default=None, help="spill evicted pages to a file store in this directory (optional)")
    p.add_argument("--spill-capacity-bytes", type=_size, default=None,
                   help="capacity of the spill store (per page record size; default: the file store's default)")
    p.add_argument("--max-message-bytes", type=_message_size, default=P.DEFAULT_MAX_MESSAGE_BYTES,
                   help="refuse larger messages (at least 1MiB; default 64MiB)")
    p.add_argument("--token", default=os.environ.get("TIERKV_SERVER_TOKEN"),
                   help="shared secret every request must carry (default: $TIERKV_SERVER_TOKEN, else none; prefer the "
                        "variable or --token-file: a command line is visible to other users in ps)")
    p.add_argument("--token-file", default=None, help="read the token from this file (first line; overrides --token)")
    p.add_argument("--tokens-file", default=None,
                   help="tenants: a YAML file mapping each token to a tenant name and its quota in bytes "
                        "(docs/tenants.md); each tenant's pages are its own; re-read on SIGHUP. Excludes --token")
    p.add_argument("--no-evict", action="store_true",
                   help="a tenant over its quota (or a full server) has its writes refused, not its oldest pages "
                        "evicted (the default of tokens-file entries without 'evict')")
    p.add_argument("--allow-unauthenticated", action="store_true",
                   help="allow a --host beyond loopback without a token (any client that reaches the port may read, "
                        f"write and clear pages); without it such a server refuses to start (exit {EXIT_REFUSED})")
    p.add_argument("--eviction-policy", default="lru", choices=POLICIES,
                   help="order in which a tenant's pages are evicted when over its quota or the capacity: lru "
                        "(default), lfu, slru (scan-resistant: probation + protected), s3fifo (small + main FIFO + "
                        "ghost)")
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    p.add_argument("--enable-test-ops", action="store_true", help=argparse.SUPPRESS)
    return p


def _token(args: argparse.Namespace) -> Optional[str]:
    """The token from ``--token-file`` (its first line) or ``--token``/``$TIERKV_SERVER_TOKEN``."""
    if not getattr(args, "token_file", None):
        return args.token
    try:
        with open(args.token_file) as f:
            token = f.read().strip()
    except OSError as e:
        raise CliError(EXIT_REFUSED, f"cannot read --token-file {args.token_file!r}: {e.strerror}") from None
    if not token:
        raise CliError(EXIT_REFUSED, f"--token-file {args.token_file!r} is empty")
    return token


def serve(args: argparse.Namespace) -> int:
    """Start a server from parsed :func:`add_arguments` flags and serve until SIGTERM/SIGINT. Returns 0.

    Raises:
        CliError(EXIT_REFUSED): see the module docstring.
    """
    logging.basicConfig(level=getattr(logging, args.log_level.upper()), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    tokens_file = getattr(args, "tokens_file", None)
    token = _token(args)
    if tokens_file and token:
        raise CliError(EXIT_REFUSED, "give --tokens-file or a single token (--token, --token-file, "
                                     "$TIERKV_SERVER_TOKEN), not both")
    if not zmq_server.is_loopback(args.host):
        if not token and not tokens_file and not args.allow_unauthenticated:
            raise CliError(EXIT_REFUSED, f"refusing to listen on {args.host} (beyond this machine) without a token: "
                                         "give --token/--token-file/$TIERKV_SERVER_TOKEN, or --allow-unauthenticated "
                                         "to accept any client")
        log.warning("binding %s: the cache server is reachable beyond this machine%s", args.host,
                    "" if token or tokens_file else " and accepts any client (--allow-unauthenticated)")
    tuned = zmq_server.keep_freed_memory(args.capacity_bytes)
    try:
        srv = zmq_server.CacheServer(host=args.host, port=args.port, capacity_bytes=args.capacity_bytes,
                                     spill_dir=args.spill_dir, spill_capacity_bytes=args.spill_capacity_bytes,
                                     max_message_bytes=args.max_message_bytes, token=token,
                                     enable_test_ops=args.enable_test_ops, tokens_file=tokens_file,
                                     evict=not getattr(args, "no_evict", False),
                                     eviction_policy=getattr(args, "eviction_policy", "lru"))
    except zmq_server.TokensFileError as e:
        raise CliError(EXIT_REFUSED, str(e)) from None
    except zmq_server.zmq.ZMQError as e:  # address in use, unknown host: the operator's input, not a bug
        raise CliError(EXIT_REFUSED, f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    signal.signal(signal.SIGTERM, srv.stop)
    signal.signal(signal.SIGINT, srv.stop)
    signal.signal(signal.SIGHUP, srv.hup)
    print(f"tierkv-server ready {srv.endpoint}", flush=True)
    log.info("serving on %s, capacity %d bytes, eviction %s, spill %s, malloc tuned %s, token %s", srv.endpoint,
             srv.capacity_bytes, srv.store.eviction_policy, args.spill_dir, tuned,
             f"tenants from {tokens_file} ({len(srv.table.tenants)})" if tokens_file
             else ("required" if token else "none"))
    try:
        srv.serve_forever()
    finally:
        srv.close()
        log.info("stopped")
    return EXIT_OK


def run(args: argparse.Namespace) -> int:
    """:func:`serve`, a refusal printed as one line: the exit status."""
    try:
        return serve(args)
    except CliError as e:
        return fail("tierkv server", e)


def main(argv: Optional[list] = None) -> int:
    from tierkv.cli import OneLineParser

    p = OneLineParser(prog="tierkv server",
                      description="tierkv L3 cache server (ZMQ ROUTER, msgpack headers, raw payload frames)")
    return run(add_arguments(p).parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
