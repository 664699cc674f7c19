"""Eviction policies over keys: which entry a store gives up next when it is full (file store, ``tierkv server``,
the planner's L3 model). The radix index orders its nodes with the same names (:mod:`tierkv.connector.core.node_eviction`).

``lru``: least recently inserted or hit first. ``lfu``: fewest hits, then least recent. ``slru``: probation and
protected segments; a hit in probation promotes, the protected segment holds at most ``protected_fraction`` of the
most entries held so far (its least recent go back to probation's most recent end); victims come from probation first. ``s3fifo``: a
small FIFO (``small_fraction`` of the entries), a main FIFO and a ghost of keys evicted from small (as many as main
holds); a new key goes to small, or to main if the ghost remembers it; small's head moves to main if hit since it was
inserted, else it is evicted into the ghost; main's head is re-queued with its hit count lowered while it has hits
(at most 3). Entries are counted, not bytes. ``pop_victim(skip)`` passes over keys ``skip`` says are in use (writes in
flight), leaving them where they are. Here lives the shared vocabulary too: :data:`POLICIES`, the checks of a name and
a fraction, and which L3 backends evict by themselves. Everything is O(1) per operation except ``lfu`` (O(log n)).
"""
from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Callable, Hashable, Iterable, Iterator, Optional

POLICIES = ("lru", "lfu", "slru", "s3fifo")
DEFAULT_PROTECTED_FRACTION = 0.8
DEFAULT_SMALL_FRACTION = 0.1
S3FIFO_MAX_FREQ = 3

#: L3 backends that evict by themselves: an eviction policy set on them is refused with this reason
SELF_EVICTING = {
    "mooncake": "Mooncake's master evicts by itself (its own eviction settings)",
    "lmcache": "LMCache's server evicts by itself",
    "redis": "Redis evicts by itself: set its maxmemory-policy",
    "zmq": "the tierkv server evicts for its clients: set it on the server (tierkv server --eviction-policy)",
}

_never: Callable[[Hashable], bool] = lambda _k: False


def check_policy(name: str, key: str = "eviction_policy") -> str:
    """``name`` if it is one of :data:`POLICIES`. Raises ValueError naming ``key`` and the allowed values."""
    if name not in POLICIES:
        raise ValueError(f"{key} must be one of {', '.join(POLICIES)}, got {name!r}")
    return name


def check_fraction(value: float, key: str) -> float:
    """``value`` if 0 < value < 1. Raises ValueError naming ``key``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1:
        raise ValueError(f"{key} must be a fraction > 0 and < 1, got {value!r}")
    return float(value)


def self_evicting_error(backend: str) -> str:
    """Why ``l3.<backend>.eviction_policy`` is refused."""
    return (f"l3.{backend}.eviction_policy: this store manages its own eviction ({SELF_EVICTING[backend]}); "
            "remove the key")


def _first(od: "OrderedDict", skip: Callable[[Hashable], bool]) -> Optional[Hashable]:
    for k in od:
        if not skip(k):
            return k
    return None


class KeyPolicy:
    """The interface: ``insert`` a new key (or re-insert: a write), ``hit`` a key read, ``remove`` a key deleted,
    ``pop_victim`` the next key to evict (removed from the policy; None when every key is skipped or none is left).
    ``len`` and ``in`` work; iteration yields the keys, roughly the next victims first."""

    name = ""

    def insert(self, key: Hashable) -> None:
        raise NotImplementedError

    def hit(self, key: Hashable) -> None:
        raise NotImplementedError

    def remove(self, key: Hashable) -> None:
        raise NotImplementedError

    def pop_victim(self, skip: Callable[[Hashable], bool] = _never) -> Optional[Hashable]:
        raise NotImplementedError

    def __len__(self) -> int:
        raise NotImplementedError

    def __contains__(self, key: Hashable) -> bool:
        raise NotImplementedError

    def __iter__(self) -> Iterator[Hashable]:
        raise NotImplementedError


class LruKeys(KeyPolicy):
    name = "lru"

    def __init__(self) -> None:
        self.od: "OrderedDict[Hashable, None]" = OrderedDict()

    def insert(self, key: Hashable) -> None:
        self.od[key] = None
        self.od.move_to_end(key)

    def hit(self, key: Hashable) -> None:
        if key in self.od:
            self.od.move_to_end(key)

    def remove(self, key: Hashable) -> None:
        self.od.pop(key, None)

    def pop_victim(self, skip: Callable[[Hashable], bool] = _never) -> Optional[Hashable]:
        k = _first(self.od, skip)
        if k is not None:
            del self.od[k]
        return k

    def __len__(self) -> int:
        return len(self.od)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.od

    def __iter__(self) -> Iterator[Hashable]:
        return iter(self.od)


class LfuKeys(KeyPolicy):
    """Fewest hits first, least recent among equals: a lazily validated heap of ``(hits, stamp)``."""

    name = "lfu"

    def __init__(self) -> None:
        self.state: dict[Hashable, tuple[int, int]] = {}  # key -> (hits, stamp of its live heap entry)
        self.heap: list = []
        self.clock = itertools.count()

    def _push(self, key: Hashable, hits: int) -> None:
        stamp = next(self.clock)
        self.state[key] = (hits, stamp)
        heapq.heappush(self.heap, (hits, stamp, key))
        if len(self.heap) > 2 * len(self.state) + 1024:
            self.heap = [e for e in self.heap if self.state.get(e[2], (0, -1))[1] == e[1]]
            heapq.heapify(self.heap)

    def insert(self, key: Hashable) -> None:
        self._push(key, self.state.get(key, (0, 0))[0])

    def hit(self, key: Hashable) -> None:
        if key in self.state:
            self._push(key, self.state[key][0] + 1)

    def remove(self, key: Hashable) -> None:
        self.state.pop(key, None)

    def pop_victim(self, skip: Callable[[Hashable], bool] = _never) -> Optional[Hashable]:
        skipped, got = [], None
        while self.heap:
            e = heapq.heappop(self.heap)
            if self.state.get(e[2], (0, -1))[1] != e[1]:
                continue
            if skip(e[2]):
                skipped.append(e)
                continue
            got = e[2]
            del self.state[got]
            break
        for e in skipped:
            heapq.heappush(self.heap, e)
        return got

    def __len__(self) -> int:
        return len(self.state)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.state

    def __iter__(self) -> Iterator[Hashable]:
        return (e[2] for e in sorted(self.heap) if self.state.get(e[2], (0, -1))[1] == e[1])


class SlruKeys(KeyPolicy):
    """Probation and protected LRU segments; protected bounded to ``protected_fraction`` of the entries."""

    name = "slru"

    def __init__(self, protected_fraction: float = DEFAULT_PROTECTED_FRACTION) -> None:
        self.fraction = check_fraction(protected_fraction, "slru protected fraction")
        self.probation: "OrderedDict[Hashable, None]" = OrderedDict()
        self.protected: "OrderedDict[Hashable, None]" = OrderedDict()
        self.high = 0  # the most entries held so far: the store's capacity once it is full

    def insert(self, key: Hashable) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
        else:
            self.probation[key] = None
            self.probation.move_to_end(key)

    def hit(self, key: Hashable) -> None:
        if key in self.protected:
            self.protected.move_to_end(key)
        elif key in self.probation:
            del self.probation[key]
            self.protected[key] = None
            self.high = max(self.high, len(self))
            bound = max(1, int(self.fraction * self.high))
            while len(self.protected) > bound:  # the least recent protected entry goes back to probation's MRU end
                k, _ = self.protected.popitem(last=False)
                self.probation[k] = None

    def remove(self, key: Hashable) -> None:
        self.probation.pop(key, None)
        self.protected.pop(key, None)

    def pop_victim(self, skip: Callable[[Hashable], bool] = _never) -> Optional[Hashable]:
        for seg in (self.probation, self.protected):
            k = _first(seg, skip)
            if k is not None:
                del seg[k]
                return k
        return None

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.probation or key in self.protected

    def __iter__(self) -> Iterator[Hashable]:
        return itertools.chain(self.probation, self.protected)


class S3FifoKeys(KeyPolicy):
    """Small FIFO, main FIFO and the ghost of keys evicted from small (bounded to main's length)."""

    name = "s3fifo"

    def __init__(self, small_fraction: float = DEFAULT_SMALL_FRACTION) -> None:
        self.fraction = check_fraction(small_fraction, "s3fifo small fraction")
        self.small: "OrderedDict[Hashable, None]" = OrderedDict()
        self.main: "OrderedDict[Hashable, None]" = OrderedDict()
        self.ghost: "OrderedDict[Hashable, None]" = OrderedDict()
        self.freq: dict[Hashable, int] = {}

    def insert(self, key: Hashable) -> None:
        if key in self.freq:  # a re-write: counts as a hit
            self.hit(key)
            return
        self.freq[key] = 0
        if key in self.ghost:  # evicted from small not long ago: it is re-used, straight to main
            del self.ghost[key]
            self.main[key] = None
        else:
            self.small[key] = None

    def hit(self, key: Hashable) -> None:
        f = self.freq.get(key)
        if f is not None:
            self.freq[key] = min(f + 1, S3FIFO_MAX_FREQ)

    def remove(self, key: Hashable) -> None:
        if self.freq.pop(key, None) is not None:
            self.small.pop(key, None)
            self.main.pop(key, None)

    def _remember(self, key: Hashable) -> None:
        self.ghost[key] = None
        while len(self.ghost) > max(1, len(self.main)):
            self.ghost.popitem(last=False)

    def pop_victim(self, skip: Callable[[Hashable], bool] = _never) -> Optional[Hashable]:
        # each step either evicts or moves an entry one queue on / lowers its count: at most 4 steps per entry
        for _ in range(4 * len(self.freq) + 2):
            from_small = len(self.small) > self.fraction * len(self) or not self.main
            q = self.small if from_small else self.main
            k = _first(q, skip)
            if k is None:
                q = self.main if from_small else self.small
                from_small = not from_small
                k = _first(q, skip)
                if k is None:
                    return None
            del q[k]
            f = self.freq[k]
            if from_small:
                if f > 0:
                    self.freq[k] = 0
                    self.main[k] = None
                    continue
                self._remember(k)
            elif f > 0:
                self.freq[k] = f - 1
                self.main[k] = None
                continue
            del self.freq[k]
            return k
        return None

    def __len__(self) -> int:
        return len(self.freq)

    def __contains__(self, key: Hashable) -> bool:
        return key in self.freq

    def __iter__(self) -> Iterator[Hashable]:
        return itertools.chain(self.small, self.main)


def make_key_policy(name: str, protected_fraction: float = DEFAULT_PROTECTED_FRACTION,
                    small_fraction: float = DEFAULT_SMALL_FRACTION, keys: Iterable[Hashable] = ()) -> KeyPolicy:
    """A fresh policy ``name`` holding ``keys`` (inserted in the order given: least recent first).

    Raises:
        ValueError: an unknown name or a fraction outside (0, 1), naming what is wrong.
    """
    check_policy(name)
    pol: KeyPolicy
    if name == "slru":
        pol = SlruKeys(protected_fraction)
    elif name == "s3fifo":
        pol = S3FifoKeys(small_fraction)
    elif name == "lfu":
        pol = LfuKeys()
    else:
        pol = LruKeys()
    for k in keys:
        pol.insert(k)
    return pol
