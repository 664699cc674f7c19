"""Plain pieces of the L3 I/O: a page's L3 key, the store's reader count, the counters, a prefetch in flight and
what a poll hands to the engine thread. No threads, no I/O.

L3 keys are per rank: ``xxh3_128(rank namespace || page key)``, so two tensor-parallel ranks never share a record.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import xxhash

from tierkv.connector.core.plan import Job, PageOrder


def l3_key(rank_namespace: bytes, key: bytes) -> str:
    """Text key (32 lowercase hex chars) of page ``key`` (16 bytes) in the L3 store, for the rank whose namespace
    digest is ``rank_namespace`` (16 bytes)."""
    return xxhash.xxh3_128_hexdigest(rank_namespace + key)


def default_read_threads(store) -> int:
    """The ``default_read_threads`` of the store under any wrappers (``.inner``: fault injector, ``.store``: timing)."""
    seen = 0
    while seen < 8:
        inner = getattr(store, "inner", None) or getattr(store, "store", None)
        if inner is None or inner is store:
            break
        store, seen = inner, seen + 1
    return int(getattr(store, "default_read_threads", 2))


@dataclass
class L3Counters:
    backup_jobs: int = 0
    backup_pages: int = 0
    backup_failed_pages: int = 0
    backup_dropped_pages: int = 0
    backup_skipped_pages: int = 0      # not sent: the slot's save was not made (its request's load failed)
    backup_other_rank_pages: int = 0   # not sent, reported done: another rank writes the one shared record (MLA)
    backup_bytes: int = 0
    backup_seconds: float = 0.0
    backup_pauses: int = 0             # backup batches held back by a pause (a forward computing prompt tokens)
    backup_pause_seconds: float = 0.0  # the writer's time held back by those pauses
    prefetch_jobs: int = 0
    prefetch_pages: int = 0
    prefetch_failed_pages: int = 0     # read and missing, corrupt or failed (not the cancelled ones)
    prefetch_cancelled_pages: int = 0  # never read: their request was released (deadline) or aborted first
    prefetch_late_pages: int = 0       # arrived after the request's deadline, or never fetched because of it
    prefetch_bytes: int = 0
    prefetch_seconds: float = 0.0
    prefetch_deadline_misses: int = 0  # requests released at their deadline with pages still missing
    exists_jobs: int = 0
    exists_seconds: float = 0.0
    store_errors: int = 0
    evicted_pages: int = 0             # pages the store evicted, named in backup reports (the index drops them)
    evicted_unnamed_pages: int = 0     # evictions the writer could not name (a read finds those pages missing)

    def as_dict(self) -> dict:
        return {f"l3_{k}": v for k, v in self.__dict__.items()}


@dataclass
class _Prefetch:
    job: Job
    start: float                            # perf_counter seconds
    deadline: Optional[float]               # ``clock`` seconds, None = until the I/O ends
    ok: list[bool]
    read_t0: Optional[float] = None         # ``clock`` seconds when a reader started it (None: still queued)
    io_done: bool = False
    cancel: bool = False
    cancelled: int = 0                      # pages not read because ``cancel`` came first
    request_done: bool = False
    aborted: bool = False
    bytes: int = 0
    end: float = 0.0
    cold: bool = False                      # started before this process's first prefetch read ended


@dataclass
class PollResult:
    """What :meth:`L3IO.poll` hands to the engine thread: per request whose load ended, the L2 -> L1 copies to make
    now (``orders``: the leading run of intact pages, ``slots[i]`` -> ``block_ids[i]`` with the page keys, which the
    worker checks like a synchronous load's before copying), requests whose load ended, and block ids whose load
    failed (to recompute)."""

    orders: list[PageOrder] = field(default_factory=list)
    finished: set[str] = field(default_factory=set)
    failed_blocks: set[int] = field(default_factory=set)
