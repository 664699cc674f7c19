"""Shared pieces of the ``tierkv`` subcommands: exit codes, the one-line error, store addresses, progress bars.

Exit codes (the same for every subcommand, documented in README "Operating tierkv" and docs/architecture.md §12):

==== ==========================================================================================================
0    success (``store verify``: every record is good)
1    ``store verify`` found bad records (counted; removed or quarantined with ``--fix``); ``config check``:
     the file is invalid; ``bench``: the benchmark script failed
2    bad input: unknown flag or value, missing path, not a store, a config file that cannot be read
3    the store is unreachable: a ``tierkv server`` or Mooncake master that does not answer
4    the store (or server) was written by / speaks a newer format or protocol version than this tierkv
5    refused: wrong or missing ``--token``, an operation the store kind cannot do (e.g. verify a Mooncake store),
     or ``tierkv server`` refusing to start (a bind beyond loopback without a token, an unreadable or empty
     ``--token-file``, an address it cannot listen on)
70   internal error (a bug: one line still; ``TIERKV_DEBUG=1`` shows the traceback)
130  interrupted (Ctrl-C)
==== ==========================================================================================================

Every failure prints exactly one line ``tierkv <command>: error: <what>`` on stderr, never a traceback.
"""
from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import Optional

EXIT_OK = 0
EXIT_FOUND = 1
EXIT_USAGE = 2
EXIT_UNREACHABLE = 3
EXIT_NEWER = 4
EXIT_REFUSED = 5
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A failure to report as one line with exit status ``code``."""

    def __init__(self, code: int, msg: str):
        super().__init__(msg)
        self.code = code


def fail(prog: str, err: CliError) -> int:
    """Print ``err`` as one line on stderr and return its exit code."""
    msg = " ".join(str(err).split())  # one line, whatever the message holds
    print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
    return err.code


@dataclass
class Target:
    """A store address given on the command line: ``kind`` is ``file`` (``path``), ``zmq`` (``tcp://host:port``) or
    ``mooncake`` (``mooncake://host:rpc_port``)."""

    kind: str
    path: str = ""
    host: str = ""
    port: int = 0
    text: str = ""


def parse_target(text: str) -> Target:
    """Parse ``PATH``, ``file://PATH``, ``tcp://HOST:PORT`` or ``mooncake://HOST:PORT``.

    Raises:
        CliError(EXIT_USAGE): an unknown scheme or a bad host:port.
    """
    if "://" not in text:
        return Target("file", path=os.path.abspath(os.path.expanduser(text)), text=text)
    scheme, rest = text.split("://", 1)
    if scheme == "file":
        return Target("file", path=os.path.abspath(os.path.expanduser(rest)), text=text)
    if scheme not in ("tcp", "mooncake"):
        raise CliError(EXIT_USAGE, f"unknown store address {text!r}: give a directory, tcp://HOST:PORT (tierkv server) "
                                   "or mooncake://HOST:PORT (Mooncake master RPC address)")
    host, sep, port = rest.rstrip("/").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise CliError(EXIT_USAGE, f"bad address {text!r}: expected {scheme}://HOST:PORT")
    return Target("zmq" if scheme == "tcp" else "mooncake", host=host.strip("[]"), port=int(port), text=text)


def progress(total: Optional[int], desc: str, quiet: bool = False, unit: str = "page"):
    """A tqdm bar on stderr, shown only when stderr is a terminal (so logs and pipes get no bar) and not ``quiet``."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, disable=True if quiet else None, file=sys.stderr, leave=False,
                mininterval=0.5, dynamic_ncols=True)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n} B"
