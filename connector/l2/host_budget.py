"""One L2 memory budget per host, shared by every co-located worker.

Before a worker allocates its L2 pool it takes its share from one ledger per host: a JSON file under ``/dev/shm``
(``/tmp`` without it; ``$TIERKV_LEDGER_DIR`` overrides), changed under an exclusive ``flock``, listing the live
reservations ``{pid, start, group, rank, bytes}``; entries of dead processes are dropped on every visit.

- Budget (bytes): measured by the first visitor of an empty ledger as ``min(MemAvailable, cgroup room) -
  host_pool.reserve_gb`` and reused by every later worker, so it does not depend on start order.
- An engine (``group``, ``local_ranks`` ranks on this host) asks ``bytes_per_rank * local_ranks``, which must fit in
  the budget less other groups' reservations: every rank decides the same, so all start or all stop with a
  :class:`~tierkv.storage_backends.common.ConfigError` naming ``host_pool.size_gb``, the total and the budget.
- No size configured: ``auto_fraction`` of the budget (at most what other groups left), split among the ranks and
  capped at ``auto_max_gb`` per rank.

Why a ledger: docs/developer-guide.md.
"""
from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Optional

from tierkv.storage_backends.common import ConfigError

logger = logging.getLogger("tierkv.host_budget")

GiB = 1 << 30


# ---------------------------------------------------------------------------------------------- measuring the host
def _meminfo(key: str) -> Optional[int]:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _read_int(path: str) -> Optional[int]:
    try:
        text = Path(path).read_text().strip()
    except OSError:
        return None
    if not text or text == "max":
        return None
    try:
        v = int(text)
    except ValueError:
        return None
    return v if v < (1 << 60) else None  # cgroup v1 writes a huge number for "no limit"


def _inactive_file(stat_path: str, key: str) -> int:
    try:
        for line in Path(stat_path).read_text().splitlines():
            k, _, v = line.partition(" ")
            if k == key:
                return int(v)
    except (OSError, ValueError):
        pass
    return 0


def cgroup_room_bytes(root: str = "/sys/fs/cgroup") -> Optional[int]:
    """Bytes this process's memory cgroup can still take (limit - usage + reclaimable file cache), None without a
    limit. cgroup v2 (``memory.max``) and v1 (``memory/memory.limit_in_bytes``)."""
    limit = _read_int(f"{root}/memory.max")
    if limit is not None:
        used = _read_int(f"{root}/memory.current") or 0
        return max(0, limit - used + _inactive_file(f"{root}/memory.stat", "inactive_file"))
    limit = _read_int(f"{root}/memory/memory.limit_in_bytes")
    if limit is not None:
        used = _read_int(f"{root}/memory/memory.usage_in_bytes") or 0
        return max(0, limit - used + _inactive_file(f"{root}/memory/memory.stat", "total_inactive_file"))
    return None


def measure_budget_bytes(reserve_bytes: int) -> int:
    """``min(MemAvailable, cgroup room) - reserve_bytes``, at least 0 (bytes)."""
    avail = _meminfo("MemAvailable")
    if avail is None:
        avail = _meminfo("MemTotal") or 0
    room = cgroup_room_bytes()
    if room is not None:
        avail = min(avail, room)
    return max(0, avail - int(reserve_bytes))


# ---------------------------------------------------------------------------------------------- the ledger
def _start_time(pid: int) -> Optional[str]:
    """Process start time (clock ticks since boot, /proc/PID/stat field 22): tells a live PID from a reused one."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text.rsplit(")", 1)[1].split()[19]


def ledger_path(directory: Optional[str] = None) -> Path:
    """The ledger file of this host: ``<dir>/tierkv-l2-<hostname>.json``; dir: ``$TIERKV_LEDGER_DIR``, else
    ``/dev/shm`` (``/tmp`` where it does not exist)."""
    d = directory or os.environ.get("TIERKV_LEDGER_DIR") or ("/dev/shm" if os.path.isdir("/dev/shm") else "/tmp")
    return Path(d) / f"tierkv-l2-{socket.gethostname()}.json"


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[dict]:
    """The ledger's content under an exclusive lock; what the block leaves in the dict is written back."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        with os.fdopen(os.dup(fd), "r+") as f:
            text = f.read()
            try:
                data = json.loads(text) if text.strip() else {}
            except json.JSONDecodeError:
                data = {}
            if not isinstance(data, dict):
                data = {}
            data.setdefault("entries", [])
            yield data
            f.seek(0)
            f.truncate()
            f.write(json.dumps(data, sort_keys=True))
            f.flush()
    finally:
        os.close(fd)  # releases the flock


def _live(entries: list) -> list:
    return [e for e in entries if isinstance(e, dict) and _start_time(int(e.get("pid", -1))) == e.get("start")]


@dataclass
class Reservation:
    """A worker's share of the host budget: ``bytes`` for its L2 pool (``0`` when there is no room at all for an
    automatic size), out of ``budget`` bytes for the host, ``group_total`` for its engine."""

    bytes: int
    budget: int
    group_total: int
    others: int
    path: Optional[Path]

    def release(self) -> None:
        """Drop this process's entry (also dropped automatically once the process is gone)."""
        if self.path is None:
            return
        with _locked(self.path) as data:
            me = os.getpid()
            data["entries"] = [e for e in _live(data["entries"]) if e.get("pid") != me]


def reserve(group: str, rank: int, local_ranks: int, *, requested_bytes: Optional[int], auto_fraction: float,
            auto_max_bytes: int, reserve_bytes: int, page_bytes: int = 1, ledger_dir: Optional[str] = None,
            measure: Callable[[int], int] = measure_budget_bytes) -> Reservation:
    """Take this worker's L2 share from the host ledger (see the module docstring).

    Args:
        group: id shared by the ranks of one engine (e.g. vLLM's ``instance_id`` + data-parallel rank).
        rank: this worker's rank within the group (for the ledger and messages only).
        local_ranks: ranks of the group on this host (TP x PP per node).
        requested_bytes: bytes per rank from ``host_pool.size_gb`` / ``num_pages``, or None for the automatic size.
        auto_fraction / auto_max_bytes: the automatic size: this share of the budget per group, at most
            ``auto_max_bytes`` per rank.
        reserve_bytes: memory left to everything else on the host (``host_pool.reserve_gb``), bytes.
        page_bytes: an automatic size is rounded down to whole pages of this many bytes.
        measure: ``reserve_bytes -> budget bytes`` (tests pass their own).
    Returns:
        the :class:`Reservation` (recorded in the ledger).
    Raises:
        ConfigError: the group's total does not fit in what the budget leaves, naming ``host_pool.size_gb``, the
            total requested and the budget.
    """
    if local_ranks < 1:
        raise ValueError(f"local_ranks must be >= 1, got {local_ranks}")
    try:
        path = ledger_path(ledger_dir)
        ctx = _locked(path)
        data = ctx.__enter__()
    except OSError as e:  # no shared directory: decide alone (still before any allocation)
        logger.warning("tierkv: host memory ledger unavailable (%s); checking this worker's L2 pool alone", e)
        path, ctx, data = None, None, {"entries": []}
    try:
        entries = _live(data["entries"])
        if not entries or not isinstance(data.get("budget"), int):
            data["budget"] = int(measure(reserve_bytes))
        budget = int(data["budget"])
        me = os.getpid()
        entries = [e for e in entries if e.get("pid") != me]
        others = sum(int(e.get("bytes", 0)) for e in entries if e.get("group") != group)
        room = max(0, budget - others)
        if requested_bytes is None:
            per_rank = min(int(budget * auto_fraction) // local_ranks, room // local_ranks, int(auto_max_bytes))
            per_rank -= per_rank % max(1, page_bytes)
        else:
            per_rank = int(requested_bytes)
        total = per_rank * local_ranks
        if requested_bytes is not None and total > room:
            data["entries"] = entries
            raise ConfigError(
                f"tierkv: the L2 host pools do not fit in this host's memory: host_pool.size_gb (or num_pages) asks "
                f"{per_rank / GiB:.2f} GiB per worker x {local_ranks} worker(s) on this host = {total / GiB:.2f} GiB "
                f"requested, budget {budget / GiB:.2f} GiB (available memory and cgroup limit minus "
                f"host_pool.reserve_gb={reserve_bytes / GiB:g}) of which {others / GiB:.2f} GiB is held by other "
                f"engines on this host. Set host_pool.size_gb <= {room / local_ranks / GiB:.2f} or leave it unset "
                f"(automatic size).")
        entries.append({"pid": me, "start": _start_time(me), "group": group, "rank": int(rank), "bytes": per_rank})
        data["entries"] = entries
        return Reservation(bytes=per_rank, budget=budget, group_total=total, others=others, path=path)
    finally:
        if ctx is not None:
            ctx.__exit__(None, None, None)


def group_bytes(group: str, ledger_dir: Optional[str] = None) -> tuple[Optional[int], Optional[int]]:
    """``(bytes per rank, budget)``: what the live workers of ``group`` reserved (the largest entry) and the host
    budget, ``(None, None)`` if none did: lets the scheduler process size its index exactly as its workers sized
    their pools."""
    try:
        path = ledger_path(ledger_dir)
        if not path.exists():
            return None, None
        with _locked(path) as data:
            data["entries"] = live = _live(data["entries"])
            budget = data.get("budget")
    except OSError:
        return None, None
    mine = [int(e.get("bytes", 0)) for e in live if e.get("group") == group]
    return (max(mine), budget) if mine else (None, None)
