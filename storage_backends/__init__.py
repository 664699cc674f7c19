"""L3 storage backends (docs/architecture.md §5): one interface (:class:`StorageBackend`), the file store (:class:`FileStore`),
the fault-injection wrapper (:class:`FaultyBackend`) and :func:`build_backend` (from the ``l3`` config section).

The networked stores are imported lazily so their dependencies are only needed by who uses them:
``ZmqStore`` (``tierkv.storage_backends.zmq_client``) and ``MooncakeStore`` (``tierkv.storage_backends.mooncake``)
are reachable as attributes of this package, e.g. ``tierkv.storage_backends.ZmqStore``.
"""
from __future__ import annotations

import importlib
from typing import Any

from tierkv.storage_backends.base import StorageBackend
from tierkv.storage_backends.factory import build_backend
from tierkv.storage_backends.faulty import FaultsConfig, FaultyBackend
from tierkv.storage_backends.file import FileStore, FileStoreConfig

__all__ = ["StorageBackend", "FileStore", "FileStoreConfig", "FaultyBackend", "FaultsConfig", "build_backend",
           "ZmqStore", "MooncakeStore"]

_LAZY = {
    "ZmqStore": "tierkv.storage_backends.zmq_client",
    "MooncakeStore": "tierkv.storage_backends.mooncake",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
