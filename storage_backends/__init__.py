"""L3 storage backends: one interface (:class:`StorageBackend`), the file store (:class:`FileStore`),
the fault-injection wrapper (:class:`FaultyBackend`) and :func:`build_backend` (from the ``l3`` config section).

The other stores are imported lazily, so their dependencies are only needed by who uses them: every store class of
:data:`~tierkv.storage_backends.factory.BACKENDS` (``ZmqStore``, ``MooncakeStore``, ``LMCacheStore``) is reachable as
an attribute of this package, e.g. ``tierkv.storage_backends.ZmqStore``.
"""
from __future__ import annotations

import importlib
from typing import Any

from tierkv.storage_backends.base import StorageBackend
from tierkv.storage_backends.factory import BACKENDS, build_backend
from tierkv.storage_backends.faulty import FaultsConfig, FaultyBackend
from tierkv.storage_backends.file.store import FileStore, FileStoreConfig

__all__ = ["StorageBackend", "FileStore", "FileStoreConfig", "FaultyBackend", "FaultsConfig", "build_backend",
           *(b.cls for b in BACKENDS.values() if b.cls != "FileStore")]

_LAZY = {b.cls: b.module for b in BACKENDS.values()}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
