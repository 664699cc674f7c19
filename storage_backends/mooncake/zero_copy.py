"""Host memory of the Mooncake store: registered buffers it reads pages from directly (zero-copy sets) and the
store-owned staging buffers and header arenas it copies records through, reused across calls.

With an RDMA-like protocol every such region is registered with Mooncake (``register_buffer``); with tcp only the
bounds are kept. :class:`HostBuffers` is mixed into :class:`~tierkv.storage_backends.mooncake.store.MooncakeStore`
and uses its lock, counters, client and call wrapper. ``register_host_buffer`` raises ``ValueError`` for a buffer
that is not contiguous CPU memory or a closed store; a refused registration or a busy pool is a staged set or a
failure counted in ``stats()``, never an exception.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Optional

import numpy as np
import torch

from tierkv.storage_backends.base import Buffer
from tierkv.storage_backends.page_format import HEADER_BYTES, encode_headers

log = logging.getLogger("tierkv.storage.mooncake")

#: payload bytes per ``batch_put_from_multi_buffers`` of a zero-copy set: the next group's XXH3 runs while the
#: previous group is on the wire (measured on 2 cores, 64 x 2 MiB pages).
PUT_GROUP_BYTES = 32 << 20


class _Staging:
    """One registered staging buffer of ``nbytes`` (a torch uint8 tensor, kept alive while registered)."""

    __slots__ = ("tensor", "np", "ptr", "nbytes")

    def __init__(self, nbytes: int):
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8)  # zeros: touch the pages now, not mid-transfer
        self.np = self.tensor.numpy()
        self.ptr = self.tensor.data_ptr()
        self.nbytes = nbytes


class _BufferPool:
    """Store-owned registered buffers of one kind (staging records, or header arenas of the zero-copy path), reused
    across calls: a free buffer big enough is handed out, a free one too small is replaced by a new one, and at
    most ``limit`` exist at once. Guarded by the store's ``lock``; ``is_closed`` tells whether buffers given back
    are to be dropped."""

    def __init__(self, lock: threading.Lock, limit: int, register: Callable[[_Staging], bool],
                 unregister: Callable[[_Staging], None], is_closed: Callable[[], bool]):
        self._lock, self._limit = lock, limit
        self._register, self._unregister, self._is_closed = register, unregister, is_closed
        self._free: list[_Staging] = []
        self._count = 0

    def take(self, need_bytes: int, new_bytes: int) -> Optional[_Staging]:
        """A buffer of at least ``need_bytes``: a free one, else a new one of ``new_bytes`` while fewer than
        ``limit`` exist. None when ``limit`` are in use or ``register`` returns False; raises what allocation or
        ``register`` raise (the slot is released either way)."""
        with self._lock:
            for i, b in enumerate(self._free):
                if b.nbytes >= need_bytes:
                    return self._free.pop(i)
            small = self._free.pop() if self._free else None  # too small: replaced by a bigger one
            if small is None:
                if self._count >= self._limit:
                    return None
                self._count += 1
        if small is not None:
            self._unregister(small)
        ok = False
        try:
            b = _Staging(new_bytes)
            ok = self._register(b)
        finally:
            if not ok:
                with self._lock:
                    self._count -= 1
        return b if ok else None

    def give(self, b: _Staging) -> None:
        with self._lock:
            drop = self._is_closed()
            if drop:
                self._count -= 1
            else:
                self._free.append(b)
        if drop:
            self._unregister(b)

    def drain(self) -> list[_Staging]:
        """Take every free buffer out (call with the lock held, at close); the caller unregisters them."""
        free, self._free = self._free, []
        self._count -= len(free)
        return free


class _Hold:
    """Shared ownership of a staging buffer by the caller and the worker running the Mooncake call; the buffer
    goes back to the pool when both have let go (the worker may let go long after a timeout)."""

    __slots__ = ("_n", "_lock", "_release")

    def __init__(self, release: Callable[[], None]):
        self._n, self._lock, self._release = 2, threading.Lock(), release

    def drop(self) -> None:
        with self._lock:
            self._n -= 1
            last = self._n == 0
        if last:
            self._release()


class HostBuffers:
    """Registered host buffers, staging buffers and the zero-copy set of :class:`MooncakeStore` (a mixin: the store
    provides ``_lock``, ``_closed``, ``_host``, ``_register``, ``_store``, ``_staging``, ``_headers``, ``_call``,
    ``_count``, ``_warn``, ``cfg``, ``page_bytes`` and ``record_bytes``)."""

    @staticmethod
    def _span(buffer: Any) -> tuple[int, int, Any]:
        """``(address, nbytes, owner)`` of a contiguous CPU buffer. Raises ValueError for anything else."""
        if isinstance(buffer, torch.Tensor):
            if not buffer.is_cpu or buffer.layout is not torch.strided or not buffer.is_contiguous():
                raise ValueError("host buffer must be a contiguous CPU tensor")
            return buffer.data_ptr(), buffer.nbytes, buffer
        try:
            mv = memoryview(buffer)
        except TypeError:
            raise ValueError(f"host buffer of type {type(buffer).__name__} is not a buffer") from None
        if not mv.c_contiguous:
            raise ValueError("host buffer must be contiguous")
        arr = np.frombuffer(mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv, dtype=np.uint8)
        return arr.ctypes.data, arr.nbytes, buffer

    def register_host_buffer(self, buffer: Buffer) -> bool:
        """Let sets read pages inside ``buffer`` (e.g. the whole host pool, a contiguous CPU tensor) directly:
        zero-copy, no staging copy. ``buffer`` must stay allocated until :meth:`unregister_host_buffer` or
        :meth:`close`; the store keeps a reference to it meanwhile. With an RDMA-like protocol the region is also
        registered with Mooncake (``register_buffer``); with tcp any address can be sent from, so only the bounds
        are recorded. Returns ``False`` (and logs why) if Mooncake refuses the registration.

        Raises:
            ValueError: not a contiguous CPU buffer, or the store is closed.
        """
        ptr, nbytes, owner = self._span(buffer)
        if nbytes == 0:
            return False
        with self._lock:
            if self._closed:
                raise ValueError("MooncakeStore is closed")
            if ptr in self._host:
                return True
        if self._register:
            rc = self._call("register_host_buffer", lambda: self._store.register_buffer(ptr, nbytes))
            if rc != 0:
                log.warning("mooncake register_buffer of a %d-byte host buffer returned %s: staged sets", nbytes, rc)
                return False
        with self._lock:
            self._host[ptr] = (ptr, ptr + nbytes, owner)
        return True

    def unregister_host_buffer(self, buffer: Buffer) -> None:
        """Forget a buffer given to :meth:`register_host_buffer` (a no-op if it never was). Call it only when no
        ``batch_set`` of its pages is running (as with Mooncake's own ``unregister_buffer``)."""
        ptr = self._span(buffer)[0]
        with self._lock:
            known = self._host.pop(ptr, None) is not None
        if known and self._register:
            try:
                self._store.unregister_buffer(ptr)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def _registered_ptr(self, source: Any, view: memoryview) -> Optional[int]:
        """Address of ``source`` if its ``page_bytes`` lie inside one registered host buffer (and pages are big
        enough for the zero-copy path), else None."""
        if not self._host or self.page_bytes < self.cfg.zero_copy_min_page_bytes:
            return None
        if isinstance(source, torch.Tensor):
            p = source.data_ptr()
        else:
            p = np.frombuffer(view, dtype=np.uint8).ctypes.data
        for start, end, _ in self._host.values():
            if start <= p and p + self.page_bytes <= end:
                return p
        return None

    def _take_headers(self, n: int) -> Optional[_Staging]:
        """A header arena for ``n`` records (store-owned, registered like staging), or None while ``max_inflight``
        are in use or registration fails."""
        return self._headers.take(n * HEADER_BYTES, max(n, self._slots_per_staging) * HEADER_BYTES)

    def _register_headers(self, hb: _Staging) -> bool:
        return not self._register or self._call(
            "register_buffer", lambda: self._store.register_buffer(hb.ptr, hb.nbytes)) == 0

    def _take_staging(self, records: int) -> Optional[_Staging]:
        """A staging buffer for at least ``records`` records (at most ``slots_per_staging``): a free one that is
        big enough, else a new one (sized to the next power of two) while fewer than ``max_inflight`` exist.
        ``None`` if none can be had now. Raises if allocation or registration fails."""
        slots = min(self._slots_per_staging, 1 << max(0, records - 1).bit_length())
        return self._staging.take(records * self.record_bytes, slots * self.record_bytes)

    def _register_staging(self, st: _Staging) -> bool:
        if self._register:
            # RDMA-like transports need registered memory; with tcp any address works (measured: same speed)
            # and registering would touch the metadata server, so it is skipped.
            rc = self._call("register_buffer", lambda: self._store.register_buffer(st.ptr, st.nbytes))
            if rc != 0:
                raise RuntimeError(f"register_buffer returned {rc}")
        return True

    def _unregister(self, st: _Staging) -> None:
        if self._register:
            try:
                self._store.unregister_buffer(st.ptr)
            except Exception:  # noqa: BLE001 - best effort
                pass

    def _staging_hold(self, what: str, n: int, fail_counter: str) -> Optional[tuple[_Staging, _Hold]]:
        try:
            st = self._take_staging(n)
        except Exception as e:  # noqa: BLE001
            self._count(errors=1, **{fail_counter: n})
            self._warn.warning("staging", "mooncake: cannot register a staging buffer: %s", e)
            return None
        if st is None:
            self._count(busy=1, **{fail_counter: n})
            self._warn.warning("busy", "mooncake %s: %d calls still outstanding (master hung?); failing fast",
                               what, self.cfg.max_inflight)
            return None
        return st, _Hold(lambda: self._staging.give(st))

    def _set_direct(self, keys, names, srcs, direct: list[tuple[int, int]], out: list[bool],
                    sums: Optional[list[int]] = None) -> list[int]:
        """Zero-copy put of ``direct`` = ``[(index, source address)]`` (sources inside registered host buffers).
        Returns the indices that must go through the staged upsert: keys that existed before (overwrites) and keys
        the put did not make visible. A timeout or error fails the pages here (no second attempt). ``sums``: the
        payload checksums of all the batch's sources (by index) when the caller gave them.

        Pipelined: the worker thread checks which keys exist while this thread checksums the first group of
        pages (:data:`PUT_GROUP_BYTES`), then puts group after group as their headers become ready, while this
        thread checksums the next group (the Mooncake calls release the GIL); one existence check of all the put
        keys closes the batch. With ``sums`` the headers take microseconds, so all the pages go in one group."""
        n, pb = len(direct), self.page_bytes
        hb = self._take_headers(n)
        if hb is None:
            return [i for i, _ in direct]
        hold = _Hold(lambda: self._headers.give(hb))
        per = n if sums is not None else max(1, PUT_GROUP_BYTES // pb)
        groups = [(a, min(n, a + per)) for a in range(0, n, per)]
        ready = [threading.Event() for _ in groups]
        abort = [False]
        sub = [names[i] for i, _ in direct]
        bufs = [[hb.ptr + j * HEADER_BYTES, p] for j, (_, p) in enumerate(direct)]
        store, rcfg, wait_s = self._store, self._rcfg, self.timeout_s

        def headers() -> None:  # caller thread: fill the header arena group by group
            try:
                hview = hb.np
                for g, (a, b) in enumerate(groups):
                    hs = encode_headers([bytes.fromhex(keys[i]) for i, _ in direct[a:b]], self.namespace,
                                        [srcs[i] for i, _ in direct[a:b]], pb,
                                        None if sums is None else [sums[i] for i, _ in direct[a:b]])
                    hview[a * HEADER_BYTES:b * HEADER_BYTES] = np.frombuffer(b"".join(hs), dtype=np.uint8)
                    ready[g].set()
            except BaseException:
                abort[0] = True
                raise
            finally:
                for ev in ready:
                    ev.set()

        def put() -> list[bool]:  # worker thread
            done = [False] * n
            exist = store.batch_is_exist(sub)
            put_ok: list[int] = []
            for g, (a, b) in enumerate(groups):
                if not ready[g].wait(wait_s) or abort[0]:
                    raise RuntimeError("page headers were not ready")
                fresh = [j for j in range(a, b) if exist[j] == 0]
                if fresh:
                    rc = store.batch_put_from_multi_buffers([sub[j] for j in fresh], [bufs[j] for j in fresh],
                                                            [[HEADER_BYTES, pb]] * len(fresh), rcfg)
                    put_ok += [j for j, r in zip(fresh, rc) if r == 0]
            if put_ok:  # a put of a key another writer holds is dropped silently: only a visible key counts
                for j, e in zip(put_ok, store.batch_is_exist([sub[j] for j in put_ok])):
                    done[j] = e == 1
            return done

        try:
            res = self._call("batch_set", put, hold, meanwhile=headers)
        finally:
            hold.drop()
        if res is None:
            self._count(set_failures=n)
            return []
        rest = []
        for (i, _), ok in zip(direct, res):
            out[i] = ok
            if not ok:
                rest.append(i)
        n_ok = n - len(rest)
        self._count(sets=n_ok, zero_copy_sets=n_ok, bytes_written=n_ok * pb)
        return rest
