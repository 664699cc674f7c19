"""Fault injection around any L3 store, for tests of the layers above (controller, connector).

After SGLang HiCache's ``HiCacheStorageFailureInjector`` (random delay and failure probability from environment
variables), with what the fault tests need on top: a seeded, reproducible choice of which keys fail; fixed
failing keys ("fail the read of page 3"); a *hang* that blocks a call until the test releases it (so timeout paths
are tested with events, not sleeps); counters of what was injected.

Per key, a failed get is ``False`` with the destination untouched (the inner store is not asked for that key), a
failed set is ``False`` with nothing stored, a failed exists makes that key absent (the leading run stops there).
Randomness comes from one ``random.Random(seed)`` drawn in call order (one draw per key per enabled fraction), so
a single-threaded test sees the same faults on every run.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Iterable, Optional, Sequence

from pydantic import BaseModel, ConfigDict, Field

from tierkv.storage_backends.base import Buffer, EvictedKeys, PageTokens, StorageBackend
from tierkv.storage_backends.page_format import check_checksums

_OPS = ("get", "set", "exists")


class FaultsConfig(BaseModel):
    """Keys of ``l3.faults`` (all optional; an empty section means no wrapper). Fractions are per key, delays and
    hangs per call."""

    model_config = ConfigDict(extra="forbid")

    fail_get: float = Field(default=0.0, ge=0.0, le=1.0)
    fail_set: float = Field(default=0.0, ge=0.0, le=1.0)
    fail_exists: float = Field(default=0.0, ge=0.0, le=1.0)
    delay_get_s: float = Field(default=0.0, ge=0.0)
    delay_set_s: float = Field(default=0.0, ge=0.0)
    delay_exists_s: float = Field(default=0.0, ge=0.0)
    delay_get_page_s: float = Field(default=0.0, ge=0.0)
    hang_get: bool = False
    hang_set: bool = False
    hang_exists: bool = False
    fail_get_keys: list[str] = Field(default_factory=list)
    fail_set_keys: list[str] = Field(default_factory=list)
    fail_exists_keys: list[str] = Field(default_factory=list)
    healthy_get_pages: int = Field(default=0, ge=0)
    seed: int = 0


class FaultyBackend(StorageBackend):
    """Wraps ``inner`` and fails, delays or hangs a chosen share of its calls.

    Args:
        inner: the store to wrap (any :class:`StorageBackend`); closed with the wrapper.
        fail_get, fail_set, fail_exists: probability (0..1) that each key of a call fails.
        delay_get_s, delay_set_s, delay_exists_s: seconds slept before each call of that kind.
        delay_get_page_s: seconds slept per key of each ``batch_get``, after ``delay_get_s`` (a store whose reads
            take a time proportional to the pages read, e.g. one bound by its bandwidth).
        hang_get, hang_set, hang_exists: block each call of that kind until :meth:`release` (or :meth:`close`);
            then the call proceeds normally. :meth:`wait_hanging` tells a test that a call is blocked.
        fail_get_keys, fail_set_keys, fail_exists_keys: keys (text form) that always fail for that operation.
        healthy_get_pages: ``batch_get`` calls get none of the get faults (no delay, hang or failure) while the
            pages they read add up to at most this many; the first call that would go past it and every later
            one get them all (a store that serves, then turns slow, stalls or fails between two reads). Counted
            per wrapper, i.e. per process that holds one (each worker of an engine has its own).
        seed: seed of the random draws.

    All settings can be changed at run time with :meth:`set_faults`. ``stats()`` is the inner store's counters
    plus ``injected_{get,set,exists}_failures``, ``injected_delays``, ``injected_hangs``.
    """

    def __init__(self, inner: StorageBackend, fail_get: float = 0.0, fail_set: float = 0.0,
                 fail_exists: float = 0.0, delay_get_s: float = 0.0, delay_set_s: float = 0.0,
                 delay_exists_s: float = 0.0, delay_get_page_s: float = 0.0, hang_get: bool = False, hang_set: bool = False,
                 hang_exists: bool = False, fail_get_keys: Iterable[str] = (), fail_set_keys: Iterable[str] = (),
                 fail_exists_keys: Iterable[str] = (), healthy_get_pages: int = 0, seed: int = 0):
        self.inner = inner
        self.page_bytes = inner.page_bytes
        self.namespace = inner.namespace
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._hanging = threading.Condition(self._lock)
        self._n_hanging = 0
        self._closed = False
        self._c = {f"injected_{op}_failures": 0 for op in _OPS}
        self._c.update(injected_delays=0, injected_hangs=0)
        self._fail: dict[str, float] = {}
        self._delay: dict[str, float] = {}
        self._hang: dict[str, bool] = {}
        self._fail_keys: dict[str, frozenset] = {}
        self._rng = random.Random(seed)
        self._healthy_pages = 0   # pages that batch_get calls may still read without get faults
        self.set_faults(fail_get=fail_get, fail_set=fail_set, fail_exists=fail_exists, delay_get_s=delay_get_s,
                        delay_set_s=delay_set_s, delay_exists_s=delay_exists_s,
                        delay_get_page_s=delay_get_page_s, hang_get=hang_get,
                        hang_set=hang_set, hang_exists=hang_exists, fail_get_keys=fail_get_keys,
                        fail_set_keys=fail_set_keys, fail_exists_keys=fail_exists_keys,
                        healthy_get_pages=healthy_get_pages)

    @classmethod
    def from_config(cls, inner: StorageBackend, cfg: FaultsConfig) -> "FaultyBackend":
        return cls(inner, **cfg.model_dump())

    def set_faults(self, **kw: Any) -> None:
        """Change settings (same names as the constructor, except ``inner``; ``seed`` re-seeds;
        ``healthy_get_pages`` counts from this call). Arming a hang clears an earlier :meth:`release`. Raises
        ValueError for an unknown name, a fraction outside 0..1 or a negative delay or count."""
        with self._lock:
            for name, v in kw.items():
                if name == "seed":
                    self._rng = random.Random(v)
                    continue
                if name == "healthy_get_pages":
                    if int(v) < 0:
                        raise ValueError(f"{name} must be >= 0, got {v!r}")
                    self._healthy_pages = int(v)
                    continue
                head, _, op = name.partition("_")
                op = op.removesuffix("_s").removesuffix("_keys")
                ops = _OPS + ("get_page",) if head == "delay" else _OPS  # delay_get_page_s: per key of a get
                if op not in ops or head not in ("fail", "delay", "hang"):
                    raise ValueError(f"unknown fault setting {name!r}")
                if name.endswith("_keys"):
                    if head != "fail":
                        raise ValueError(f"unknown fault setting {name!r}")
                    self._fail_keys[op] = frozenset(v)
                elif head == "fail":
                    if not 0.0 <= float(v) <= 1.0:
                        raise ValueError(f"{name} must be in 0..1, got {v!r}")
                    self._fail[op] = float(v)
                elif head == "delay":
                    if float(v) < 0:
                        raise ValueError(f"{name} must be >= 0 seconds, got {v!r}")
                    self._delay[op] = float(v)
                else:
                    self._hang[op] = bool(v)
                    if v:
                        self._release.clear()

    @property
    def vectored_sources(self) -> bool:
        """The inner store's :attr:`StorageBackend.vectored_sources` (sources are passed through as given)."""
        return bool(getattr(self.inner, "vectored_sources", False))

    @property
    def vectored_destinations(self) -> bool:
        """The inner store's :attr:`StorageBackend.vectored_destinations` (destinations are passed through as given)."""
        return bool(getattr(self.inner, "vectored_destinations", False))

    @property
    def verified_checksums(self) -> bool:
        """The inner store's :attr:`StorageBackend.verified_checksums` (its answers are passed through as given; a
        page this wrapper fails gets None)."""
        return bool(getattr(self.inner, "verified_checksums", False))

    @property
    def reports_evictions(self) -> bool:
        """The inner store's :attr:`StorageBackend.reports_evictions`."""
        return bool(getattr(self.inner, "reports_evictions", False))

    def take_evicted(self) -> EvictedKeys:
        """The inner store's :meth:`StorageBackend.take_evicted`."""
        return self.inner.take_evicted()

    @property
    def local_exists(self) -> bool:
        """Whether the engine scheduler's own copy of this store may answer existence queries in its loop
        (:attr:`StorageBackend.local_exists`): when the inner store may and no existence fault is set. Faults of
        reads and writes do not touch ``batch_exists``, so a store whose reads are slow or stall is still asked
        in the scheduler, as the same store without the wrapper would be; a delayed, hanging or failing existence
        query is left to the workers (the scheduler's loop must not wait on it)."""
        with self._lock:
            faulted = bool(self._fail.get("exists") or self._delay.get("exists") or self._hang.get("exists")
                           or self._fail_keys.get("exists"))
        return bool(getattr(self.inner, "local_exists", False)) and not faulted

    @property
    def timeout_s(self) -> float:
        """The inner store's per-call timeout in seconds (``AttributeError`` when it has none), read and set
        through the wrapper, so that a caller that caps it (the scheduler's copy of a ZMQ store) reaches the store."""
        return self.inner.timeout_s

    @timeout_s.setter
    def timeout_s(self, value: float) -> None:
        self.inner.timeout_s = value

    def release(self) -> None:
        """Let every hung call (and every later one, until a hang is armed again) proceed."""
        self._release.set()

    def wait_hanging(self, n: int = 1, timeout: Optional[float] = 10.0) -> bool:
        """Block until at least ``n`` calls are hung; ``False`` on timeout."""
        with self._hanging:
            return self._hanging.wait_for(lambda: self._n_hanging >= n, timeout=timeout)

    @property
    def hanging(self) -> int:
        """Calls blocked in a hang right now."""
        with self._lock:
            return self._n_hanging

    # ------------------------------------------------------------------ injection
    def _before(self, op: str, keys: int = 0) -> None:
        d = self._delay.get(op, 0.0) + self._delay.get("get_page", 0.0) * keys  # keys: only a get passes them
        if d > 0:
            with self._lock:
                self._c["injected_delays"] += 1
            time.sleep(d)
        if self._hang.get(op) and not self._closed:
            with self._hanging:
                self._n_hanging += 1
                self._c["injected_hangs"] += 1
                self._hanging.notify_all()
            try:
                self._release.wait()
            finally:
                with self._lock:
                    self._n_hanging -= 1

    def _failing(self, op: str, keys: Sequence[str]) -> list[bool]:
        p = self._fail.get(op, 0.0)
        fixed = self._fail_keys.get(op, frozenset())
        with self._lock:
            out = [(p > 0 and self._rng.random() < p) or (k in fixed) for k in keys]
            self._c[f"injected_{op}_failures"] += sum(out)
        return out

    # ------------------------------------------------------------------ interface
    def batch_exists(self, keys: Sequence[str], tokens: Optional[Sequence[PageTokens]] = None) -> int:
        self._keys(keys)
        self._before("exists")
        fail = self._failing("exists", keys)
        limit = fail.index(True) if True in fail else len(keys)
        if limit == 0:
            return 0
        if tokens is None:
            return self.inner.batch_exists(list(keys[:limit]))
        return self.inner.batch_exists(list(keys[:limit]), tokens=list(tokens[:limit]))

    def batch_get(self, keys: Sequence[str], destinations: Sequence[Buffer],
                  tokens: Optional[Sequence[PageTokens]] = None, checksums: Optional[list] = None) -> list[bool]:
        """Inner ``batch_get`` of the keys not chosen to fail (after the configured delay or hang), with their
        destinations, tokens and, where the inner store fills them (:attr:`verified_checksums`), ``checksums``
        (None for every page not read)."""
        if len(keys) != len(destinations):
            raise ValueError(f"{len(keys)} keys but {len(destinations)} destinations")
        if checksums is not None:
            self._checksums_out(checksums, len(keys))
        self._keys(keys)
        with self._lock:
            healthy = len(keys) <= self._healthy_pages   # 0 by default: every read gets the faults
            self._healthy_pages = self._healthy_pages - len(keys) if healthy else 0
        if not healthy:
            self._before("get", len(keys))
        fail = [False] * len(keys) if healthy else self._failing("get", keys)
        idx = [i for i, f in enumerate(fail) if not f]
        out = [False] * len(keys)
        if idx:
            kw = {} if tokens is None else {"tokens": [tokens[i] for i in idx]}
            sub = [None] * len(idx) if checksums is not None and self.verified_checksums else None
            if sub is not None:
                kw["checksums"] = sub
            res = self.inner.batch_get([keys[i] for i in idx], [destinations[i] for i in idx], **kw)
            for j, (i, r) in enumerate(zip(idx, res)):
                out[i] = r
                if sub is not None and r:
                    checksums[i] = sub[j]
        return out

    def batch_set(self, keys: Sequence[str], sources: Sequence[Buffer],
                  checksums: Optional[Sequence[int]] = None,
                  tokens: Optional[Sequence[PageTokens]] = None) -> list[bool]:
        """Inner ``batch_set`` of the keys not chosen to fail, with their ``checksums`` and ``tokens`` (passed
        through as given; checksums validated first: ValueError for a wrong length or type, like every store)."""
        if len(keys) != len(sources):
            raise ValueError(f"{len(keys)} keys but {len(sources)} sources")
        self._keys(keys)
        sums = check_checksums(checksums, len(keys))
        self._before("set")
        fail = self._failing("set", keys)
        idx = [i for i, f in enumerate(fail) if not f]
        out = [False] * len(keys)
        if idx:
            inner_keys, inner_srcs = [keys[i] for i in idx], [sources[i] for i in idx]
            kw = {} if tokens is None else {"tokens": [tokens[i] for i in idx]}
            if sums is None:
                res = self.inner.batch_set(inner_keys, inner_srcs, **kw)
            else:
                res = self.inner.batch_set(inner_keys, inner_srcs, checksums=[sums[i] for i in idx], **kw)
            for i, r in zip(idx, res):
                out[i] = r
        return out

    def register_host_buffer(self, buffer: Buffer) -> bool:
        return self.inner.register_host_buffer(buffer)

    def unregister_host_buffer(self, buffer: Buffer) -> None:
        self.inner.unregister_host_buffer(buffer)

    def describe_namespace(self, info: dict[str, Any]) -> bool:
        return self.inner.describe_namespace(info)

    def clear(self) -> None:
        self.inner.clear()

    def stats(self) -> dict[str, Any]:
        d = dict(self.inner.stats())
        with self._lock:
            d.update(self._c)
        return d

    def close(self) -> None:
        """Release hung calls and close the inner store. Idempotent."""
        self._closed = True
        self._release.set()
        self.inner.close()

    def __repr__(self) -> str:
        return f"FaultyBackend({self.inner!r}, fail={self._fail}, delay={self._delay}, hang={self._hang})"
