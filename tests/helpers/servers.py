"""Real L3 servers for end-to-end tests: a tierkv ZMQ cache server and a ``mooncake_master`` on loopback.

Nothing is copied from the storage tests: their helpers (``tests.helpers.fixtures_zmq`` and
``fixtures_mooncake``) are wrapped so that an e2e test gets what an engine's ``l3`` config needs:

- :func:`zmq_server` -> a :class:`_fixtures_zmq.ZmqHandle`: a server subprocess on a free loopback port (read from
  its ready line), ``.endpoint``, ``.pid``, ``.kill9()`` (SIGKILL by PID), ``.start()`` (an empty server on the same
  port), ``.server_stats()`` (through a :class:`~tierkv.storage_backends.zmq.client.ZmqStore` client of the test
  process; ``["keys"]`` = records held), stopped by PID on exit.
- :func:`mooncake_store` -> a :class:`_fixtures_mooncake.MooncakeHandle`: a master on free loopback ports plus a
  client in the test process that contributes the store's memory (``global_segment_size``), so pages written by an
  engine (a pure client) outlive that engine; master stopped by PID on exit.
- :func:`zmq_l3` / :func:`mooncake_l3`: the ``l3`` section of a tierkv config pointing an engine at them;
  :func:`unused_loopback_ports`: ports nobody listens on (a server that is down).
"""
from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Iterator, Optional

from tests.helpers import fixtures_zmq as _fixtures_zmq  # noqa: E402  (tests/storage)
from tests.helpers.mooncake_master import free_ports  # noqa: E402  (tests/storage)

#: namespace and page size of the test process's own client (only used for server_stats / segment holding)
_NS = bytes(range(100, 116))
_PAGE = 4096


@contextlib.contextmanager
def zmq_server(tmp_path, **opts) -> Iterator["_fixtures_zmq.ZmqHandle"]:
    """A ``tierkv`` ZMQ cache server subprocess on 127.0.0.1 (free port), stopped by PID when the block ends.
    ``opts`` go to :func:`_fixtures_zmq.make_backend` (``capacity_bytes``, client ``timeout_s`` ...)."""
    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    with _fixtures_zmq.make_backend(tmp_path, _PAGE, _NS, **opts) as h:
        yield h


def zmq_l3(endpoint: str, *, timeout_s: float = 1.0, reconnect_backoff_s: float = 0.05,
           max_backoff_s: float = 0.2, faults: Optional[dict] = None, shm: str = "off") -> dict:
    """``l3`` config section for a ZMQ server at ``endpoint`` (``shm``: ``l3.zmq.shm``; with it on, pages move
    through shared memory and existence is answered from the server's presence table)."""
    l3 = {"backend": "zmq", "zmq": {"endpoint": endpoint, "timeout_s": timeout_s, "shm": shm,
                                    "reconnect_backoff_s": reconnect_backoff_s, "max_backoff_s": max_backoff_s}}
    if faults:
        l3["faults"] = dict(faults)
    return l3


@contextlib.contextmanager
def mooncake_store(tmp_path, segment_bytes: int = 64 << 20) -> Iterator["object"]:
    """A ``mooncake_master`` on free loopback ports and a client of the test process holding ``segment_bytes`` of
    store memory; both gone when the block ends (master stopped by PID)."""
    from tests.helpers import fixtures_mooncake as _fixtures_mooncake  # noqa: PLC0415 - imports the Mooncake wheel; only tests that need it pay for it

    Path(tmp_path).mkdir(parents=True, exist_ok=True)
    with _fixtures_mooncake.make_backend(tmp_path, _PAGE, _NS, global_segment_size=segment_bytes) as h:
        yield h


def mooncake_l3(master_address: str, metadata_server: str, *, timeout_s: float = 5.0,
                setup_timeout_s: float = 30.0) -> dict:
    """``l3`` config section for an engine that is a pure Mooncake client (no memory of its own, small staging)."""
    return {"backend": "mooncake",
            "mooncake": {"master_address": master_address, "metadata_server": metadata_server, "protocol": "tcp",
                         "local_hostname": "127.0.0.1", "global_segment_size": 0, "staging_bytes": "4MiB",
                         "local_buffer_size": "4MiB", "timeout_s": timeout_s, "setup_timeout_s": setup_timeout_s}}


def unused_loopback_ports(n: int = 1) -> list[int]:
    """``n`` distinct TCP ports on 127.0.0.1 that nobody listens on right now."""
    return free_ports(n)


__all__ = ["zmq_server", "zmq_l3", "mooncake_store", "mooncake_l3", "unused_loopback_ports"]
