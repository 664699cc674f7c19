"""The chunk size of a ``timed_trace``: how many tokens one hash id stands for, read off the trace itself.

A request of ``input_length`` tokens cut into chunks of ``c`` tokens has ``ceil(input_length / c)`` hash ids (the
last chunk may be cut). For ``n >= 2`` ids that holds exactly for ``c`` in ``[ceil(L / n), ceil(L / (n - 1)) - 1]``;
the chunk size is the size inside the range most requests agree on with the most trailing zero bits (512 for
Mooncake's published traces, 32 for ``benchmarks/make_multiturn_trace.py``). Requests of 0 or 1 id say nearly
nothing about it and are left out of the choice, not of the count of requests that agree.

Inputs are ``(input_length, number of hash ids)`` pairs; nothing here raises.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence


@dataclass(frozen=True)
class ChunkFit:
    """``size``: the detected chunk size in tokens (None: no request has two or more ids); ``agree``: requests whose
    id count is ``ceil(input_length / size)``; ``total``: requests looked at."""

    size: Optional[int]
    agree: int
    total: int


def fits(input_length: int, n_ids: int, size: int) -> bool:
    """Whether ``n_ids`` hash ids are ``input_length`` tokens cut into chunks of ``size`` tokens."""
    return -(-input_length // size) == n_ids


def agreeing(records: Sequence[tuple[int, int]], size: int) -> int:
    """Requests ``(input_length, n_ids)`` that chunks of ``size`` tokens explain."""
    return sum(1 for n_in, n in records if fits(n_in, n, size))


def _range(n_in: int, n: int) -> Optional[tuple[int, int]]:
    """Chunk sizes (inclusive range) giving ``n >= 2`` ids for ``n_in`` tokens, or None when none does."""
    lo = -(-n_in // n)
    hi = -(-n_in // (n - 1)) - 1
    return (lo, hi) if lo <= hi else None


def _roundest(lo: int, hi: int) -> int:
    """The number in ``[lo, hi]`` with the most trailing zero bits (there is exactly one)."""
    for k in range(hi.bit_length(), -1, -1):
        v = -(-lo >> k) << k
        if v <= hi:
            return v
    return lo


def detect(records: Sequence[tuple[int, int]]) -> ChunkFit:
    """The chunk size of requests ``(input_length, n_ids)``: sweep the ranges each request of two or more ids allows,
    take the stretch of sizes most of them share, and within it the roundest size."""
    events: dict[int, int] = {}
    for n_in, n in records:
        if n >= 2 and n_in > 0:
            r = _range(n_in, n)
            if r is not None:
                events[r[0]] = events.get(r[0], 0) + 1
                events[r[1] + 1] = events.get(r[1] + 1, 0) - 1
    if not events:
        return ChunkFit(None, 0, len(records))
    best, best_ranges, cur = 0, [], 0
    points = sorted(events)
    for a, b in zip(points, points[1:]):
        cur += events[a]
        if cur > best:
            best, best_ranges = cur, [(a, b - 1)]
        elif cur == best and cur:
            best_ranges.append((a, b - 1))
    size = max((_roundest(lo, hi) for lo, hi in best_ranges), key=lambda v: ((v & -v), -v))
    return ChunkFit(size, agreeing(records, size), len(records))
