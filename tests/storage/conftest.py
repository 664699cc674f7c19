"""Fixtures of the L3 storage tests; the contract suite runs once per backend.

Backend fixture convention (``tests/helpers/fixtures_<name>.py``, name in ``KINDS``: file, zmq, zmq_shm, mooncake,
lmcache, redis, redis_cluster):

    @contextlib.contextmanager
    def make_backend(tmp_path, page_bytes: int, namespace: bytes, **opts) -> Iterator[handle]

``tmp_path`` is a fresh, empty directory for this store. ``opts`` may hold ``capacity_pages`` (ask for a store
that keeps that many pages of ``page_bytes`` before evicting) and ``timeout_s`` (per-call bound of a networked
client); a fixture ignores options it does not know. On exit the fixture stops every process and closes every
client it made. The yielded handle ``h`` has:

- ``h.name``: the name in ``KINDS``;
- ``h.backend``: the :class:`~tierkv.storage_backends.base.StorageBackend` under test (may be a new object after
  ``h.restart()``);
- ``h.new_client(namespace=None)``: another client on the same store (``namespace`` default: the same one);
- ``h.client_factory(namespace=None)``: a picklable zero-argument callable that builds such a client inside a
  spawned process (required: the multi-process test fails for a fixture without one);
- ``h.restart()``: restart the server / master (zmq, mooncake) or re-open the directory (file);
- ``h.persistent``: True if pages survive ``h.restart()``;
- ``h.write_once`` (optional, default False): a set of a page the store already holds keeps the stored copy
  (LMCache);
- ``h.supports_stop`` and ``h.stop()`` / ``h.cont()``: SIGSTOP / SIGCONT the server process;
- ``h.corrupt(key, how)`` with ``how`` in ``"truncate"``, ``"flip"``, ``"foreign_namespace"``: damage the stored
  page of ``key`` and return True; every fixture implements every ``how``; False (no such record found, e.g. after
  a change of storage layout) fails the calling test, it never skips it;
- ``h.capacity_pages``: pages the store keeps before evicting, least recently used first, exactly; ``None`` if it
  has no exact LRU capacity (``test_contract.EXACT_LRU`` lists the stores the eviction test runs on, with the
  reason for the others).

A fixture module that is absent generates no parameter; one that fails to import fails its tests.
"""
from __future__ import annotations

import contextlib
import importlib
import itertools
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parents[1] / "helpers"
KINDS = [k for k in ("file", "zmq", "zmq_shm", "mooncake", "lmcache", "redis", "redis_cluster")
         if (HELPERS / f"fixtures_{k}.py").exists()]

NS_A = bytes(range(16))
NS_B = bytes(range(16, 32))


def load_fixture_module(kind: str):
    """Import ``tests.helpers.fixtures_<kind>`` and return it."""
    return importlib.import_module(f"tests.helpers.fixtures_{kind}")


@pytest.fixture(params=KINDS)
def backend_kind(request) -> str:
    return request.param


@pytest.fixture
def make_store(backend_kind, tmp_path):
    """``make_store(page_bytes=4096, namespace=NS_A, **opts)`` -> handle (see module docstring); every store made
    is torn down after the test."""
    try:
        mod = load_fixture_module(backend_kind)
    except Exception as e:  # noqa: BLE001 - reported as a test failure, not a collection error
        pytest.fail(f"cannot import tests/helpers/fixtures_{backend_kind}.py: {type(e).__name__}: {e}")
    counter = itertools.count()
    with contextlib.ExitStack() as stack:
        def make(page_bytes: int = 4096, namespace: bytes = NS_A, **opts):
            d = tmp_path / f"{backend_kind}-{next(counter)}"
            d.mkdir()
            return stack.enter_context(mod.make_backend(d, page_bytes, namespace, **opts))

        yield make
