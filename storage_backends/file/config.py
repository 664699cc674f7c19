"""The ``l3.file`` options of the file store, validated: :class:`FileStoreConfig`.

``capacity_bytes`` takes an int or a size string (``"20GiB"``); ``root`` is made absolute. Unknown keys and bad
values raise ``pydantic.ValidationError`` (the store turns it into a ``ConfigError`` naming ``l3.file.<key>``).
"""
from __future__ import annotations

import os
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tierkv.storage_backends.common import parse_bytes
from tierkv.storage_backends.eviction import DEFAULT_PROTECTED_FRACTION, DEFAULT_SMALL_FRACTION, POLICIES


class FileStoreConfig(BaseModel):
    """Keys of ``l3.file`` (see ``configs/l3_file.yaml`` for comments), the keyword options of
    :class:`~tierkv.storage_backends.file.store.FileStore`. Unknown keys are errors.

    Keys:
        root: the store directory (created if missing).
        capacity_bytes: maximum bytes of page files under ``root`` (records of every namespace, 64-byte headers
            included), int or a string like ``"20GiB"``. ``None``: ``default_capacity_fraction`` of (bytes already
            stored + free space of the filesystem) at start.
        fsync: ``fsync`` each record before the rename and its directory after it (durable across power loss;
            slower). Default off: a crash can lose recent pages but never leaves a torn one visible.
        read_only: open an existing store for reads only (sets return ``False``); no root write check, nothing is
            deleted or quarantined.
        quarantine: move records that fail verification to ``root/quarantine/`` (``False``: delete them).
        quarantine_max_files: keep at most this many quarantined files; beyond it bad records are deleted.
        scan_verify: start-up check of each file: ``"size"`` (file size only: catches truncated and extended
            records of this namespace) or ``"header"`` (also read and check each 64-byte header).
        background_scan: run the start-up scan in a thread (``tkv-file-scan``) so the constructor returns at once:
            reads and existence checks go to the files themselves (and index what they find), writes proceed; the
            capacity is enforced on the whole directory once the scan ends (:meth:`FileStore.wait_scan`). Until then a record
            the scan would quarantine (wrong size) is found only when read (then verified: a miss). The scan of 100k
            records took 1.3-2.6 s on a warm page cache (benchmarks/README.md, file_scan).
        touch_on_read: refresh a record's mtime on hits so LRU order survives a restart. Hits are stamped with their
            time at once but written to the files lazily (deduplicated: one ``utime`` per page however often it was
            hit), at the first call more than ``touch_flush_s`` seconds after the oldest unwritten hit, once 4096
            are pending, and at :meth:`FileStore.rescan`, ``close`` and interpreter exit.
        touch_flush_s: see ``touch_on_read``; ``0`` writes the stamps at the end of every ``batch_get``. A process
            that is SIGKILLed loses the recency of at most this many seconds of hits (the pages stay; only their
            place in the LRU order after a restart is older).
        stale_temp_s: temporary files older than this, or whose writer pid is dead, are removed at start-up.
        enospc_evict_pages: records to evict when the filesystem reports it is full, before the one retry.
        recycle_evicted: keep up to 64 evicted record files (at most 64 MiB) under temporary names and overwrite
            them with the next records instead of unlinking them and creating new files (not with ``fsync`` or
            ``read_only``). The files under ``root`` then take up to that much more than ``capacity_bytes``;
            ``close`` and a full filesystem remove them. Counted in ``recycled``.
        default_capacity_fraction: see ``capacity_bytes``.
        eviction_policy: the order in which records go beyond the capacity: ``lru`` (default), ``lfu``, ``slru`` or
            ``s3fifo`` (:mod:`tierkv.storage_backends.eviction`). Only lru's order survives a restart (mtimes).
        slru_protected_fraction, s3fifo_small_fraction: slru's protected and s3fifo's small share of the records.
    """

    model_config = ConfigDict(extra="forbid")

    root: str
    capacity_bytes: Optional[int] = Field(default=None, gt=0)
    fsync: bool = False
    read_only: bool = False
    quarantine: bool = True
    quarantine_max_files: int = Field(default=1000, ge=0)
    scan_verify: Literal["size", "header"] = "size"
    background_scan: bool = False
    touch_on_read: bool = True
    touch_flush_s: float = Field(default=5.0, ge=0)
    stale_temp_s: float = Field(default=300.0, ge=0)
    enospc_evict_pages: int = Field(default=8, ge=1)
    recycle_evicted: bool = True
    default_capacity_fraction: float = Field(default=0.9, gt=0, le=1.0)
    eviction_policy: Literal[POLICIES] = "lru"
    slru_protected_fraction: float = Field(default=DEFAULT_PROTECTED_FRACTION, gt=0, lt=1)
    s3fifo_small_fraction: float = Field(default=DEFAULT_SMALL_FRACTION, gt=0, lt=1)

    @field_validator("root")
    @classmethod
    def _root(cls, v: str) -> str:
        if not v:
            raise ValueError("root must name a directory")
        return os.path.abspath(os.path.expanduser(v))

    @field_validator("capacity_bytes", mode="before")
    @classmethod
    def _cap(cls, v: Any) -> Any:
        return None if v is None else parse_bytes(v)
